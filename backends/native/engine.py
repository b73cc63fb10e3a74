"""The synchronous engine: admission checks, then the schedule → run → sample → postprocess step.

A request is validated once, where it enters (``check_request``); admitted requests are only checked for
invariants. What one step produces for a request is a ``GenerationChunk``, the type every backend
streams, so nothing converts it again between the engine and the gateway.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from backends.base import EngineStats, GenerationChunk, InvalidRequestError, SamplingParams, Usage
from backends.native.block_manager import BlockManager
from backends.native.config import EngineConfig
from backends.native.cpu_quota import resolve_num_threads
from backends.native.model_runner import ModelRunner, kv_bytes_per_block
from backends.native.sampler import sample, token_logprobs
from backends.native.scheduler import Scheduler, Update
from backends.native.sequence import Sequence
from backends.native.weights import default_model_path, open_checkpoint
from backends.stopping import StopChecker
from backends.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

RequestOutput = tuple[str, GenerationChunk]  # (request id, what one step produced for it)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        """Load the model named by ``config``; pass ``tokenizer`` to reuse one already loaded."""
        self.config = config
        threads, source = resolve_num_threads(config.num_threads)
        self.num_threads = threads
        torch.set_num_threads(threads)
        log.info("native engine: %d CPU threads (%s)", threads, source)
        model_path = Path(config.model_path) if config.model_path else default_model_path()
        self.model_path = model_path
        checkpoint = open_checkpoint(model_path, config.hf_overrides)
        self.model_config = checkpoint.config
        self.tokenizer = tokenizer or Tokenizer(Path(config.tokenizer) if config.tokenizer else checkpoint.tokenizer_path)
        self.max_model_len = min(config.max_model_len or checkpoint.config.max_position_embeddings,
                                 checkpoint.config.max_position_embeddings)
        if config.tensor_parallel_size > 1:
            from backends.native.workers import ParallelRunner

            self.runner = ParallelRunner(config, checkpoint, self.max_model_len)
        else:
            self.runner = ModelRunner(config, checkpoint, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        eos = set(checkpoint.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = checkpoint.config.vocab_size
        self._requests: dict[str, Sequence] = {}
        self._offline_ids = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        log.info("native engine: %s on %s, %s (dtype %s), %d KV blocks of %d tokens (%d tokens), max_model_len %d, "
                 "kernels: %s%s", model_path.name, self.runner.device, self.runner.dtype, config.dtype,
                 self.blocks.num_blocks, config.block_size, self.blocks.num_blocks * config.block_size,
                 self.max_model_len, self.runner.kernels.describe(), ", CUDA graphs" if self.runner.graphs else "")
        if config.warmup:
            self.warm_up()

    def warm_up(self) -> None:
        """Run prefill chunks and decode steps of throwaway requests once, as vLLM does before serving:
        kernels are compiled or autotuned, caches and allocators grown, so the first real burst runs as
        fast as the second. Leaves no sequence, KV block, prefix-cache entry or counted token behind."""
        started = time.perf_counter()
        length = max(1, min(self.config.max_num_batched_tokens // 2, self.max_model_len - 8, 256))
        prompts = [[(7 + 13 * i + j) % self.vocab_size for j in range(length)] for i in range(2)]
        self.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        self.blocks.reset_prefix_cache()
        self.prompt_tokens_total = self.generation_tokens_total = self.scheduler.num_preemptions = 0
        log.info("native engine: warmed up in %.2f s", time.perf_counter() - started)

    # ------------------------------------------------------------------------------- admission
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` if this request can never run. Pure: safe from any thread."""
        params.validate()
        if not prompt_ids:
            raise InvalidRequestError("The prompt is empty: it must contain at least one token.", param="prompt")
        for param, ids in (("prompt", prompt_ids), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"Token id {bad} is out of vocabulary (vocab size {self.vocab_size}).",
                                          param=param)
        max_tokens = params.max_tokens if params.max_tokens is not None else 1
        total = len(prompt_ids) + max_tokens
        if len(prompt_ids) >= self.max_model_len or total > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {len(prompt_ids)} input tokens, for a "
                f"total of {total} tokens. Please reduce the length of the input prompt or the number of "
                f"requested output tokens.", param="input_tokens", code="context_length_exceeded")
        if self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            raise InvalidRequestError(
                f"The request needs {total} tokens of KV cache but the engine holds only "
                f"{self.blocks.num_blocks * self.blocks.block_size}.", param="max_tokens")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request that ``check_request`` accepted; ``params`` is read, never changed."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        seq = Sequence(request_id, list(prompt_ids), params)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_ids)
        seq.stop = StopChecker(params, IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens),
                               self.eos_token_ids, max_tokens, self.max_model_len)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV blocks. Unknown or finished ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def alive(self) -> bool:
        """False once a tensor-parallel worker died: nothing more can run."""
        return self.runner.alive

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        self.runner.close()

    # ------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one batch; (request id, chunk) for every request that got a token."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        logits = self.runner.execute(scheduled.batch)
        self.prompt_tokens_total += sum(min(n, max(s.num_prompt - s.num_computed, 0))
                                        for s, n in zip(scheduled.seqs, scheduled.num_tokens))
        sampling = scheduled.sampling
        sampled = sample(logits, sampling, self.eos_token_ids) if sampling else []
        updates = self.scheduler.postprocess(scheduled, sampled)
        self.generation_tokens_total += len(updates)
        return [self._output(u) for u in updates]

    def _output(self, update: Update) -> RequestOutput:
        seq, reason = update.seq, update.finish_reason
        if reason is not None:
            del self._requests[seq.request_id]
        logprobs = token_logprobs(self.tokenizer, update.sampled) if seq.params.logprobs is not None else None
        usage = Usage(seq.num_prompt, seq.num_output, seq.num_cached_prompt) if reason is not None else None
        return seq.request_id, GenerationChunk(update.text, [update.sampled.token_id], logprobs, reason, usage)

    # ---------------------------------------------------------------------------------- figures
    def settings(self) -> dict:
        """What the engine runs with: its configuration with every ``auto`` resolved (for GET /info)."""
        runner = self.runner
        return {**self.config.model_dump(), "model_path": str(self.model_path), "device": str(runner.device),
                "num_threads": self.num_threads,
                "dtype": str(runner.dtype).removeprefix("torch."), "num_blocks": self.blocks.num_blocks,
                "kv_cache_bytes": self.blocks.num_blocks * kv_bytes_per_block(
                    self.model_config, self.blocks.block_size, runner.dtype, self.config.tensor_parallel_size),
                "max_model_len": self.max_model_len, "kernels": runner.kernels.describe(),
                "cuda_graphs": runner.graphs is not None}

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), kv_usage=self.blocks.usage,
            prefix_cache_queries=self.blocks.prefix_queries, prefix_cache_hits=self.blocks.prefix_hits,
            preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total)

    # ------------------------------------------------------------------------------ offline use
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[GenerationChunk]:
        """Run prompts to completion together; one folded chunk per prompt, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{self._offline_ids + i}" for i in range(len(prompts))]
        self._offline_ids += len(prompts)
        for rid, prompt, p in zip(ids, prompts, plist):
            self.check_request(prompt, p)
            self.add_request(rid, prompt, p)
        folded = {rid: GenerationChunk() for rid in ids}
        while self.has_unfinished():
            for rid, chunk in self.step():
                folded[rid].extend(chunk)
        return [folded[rid] for rid in ids]
