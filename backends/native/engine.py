"""The synchronous engine: admission checks, the schedule → run → sample → detokenise step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.base import EngineStats, InvalidRequestError, SamplingParams
from backends.native.config import EngineConfig
from backends.native.cpu_quota import resolve_num_threads
from backends.native.kv_cache import BlockManager
from backends.native.model_runner import ModelRunner
from backends.native.sampler import Sampled, sample
from backends.native.scheduler import Scheduler, SchedulerConfig
from backends.native.sequence import Sequence
from backends.native.weights import default_model_path, open_checkpoint
from backends.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[Sampled] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class _Request:
    request_id: str
    seq: Sequence
    detok: IncrementalDetokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        """Load the model named by ``config``; pass ``tokenizer`` to reuse one already loaded."""
        self.config = config
        threads, source = resolve_num_threads(config.num_threads)
        torch.set_num_threads(threads)
        log.info("native engine: %d CPU threads (%s)", threads, source)
        model_path = Path(config.model_path) if config.model_path else default_model_path()
        self.model_path = model_path
        checkpoint = open_checkpoint(model_path, config.hf_overrides)
        self.model_config = checkpoint.config
        self.tokenizer = tokenizer or Tokenizer(Path(config.tokenizer) if config.tokenizer else checkpoint.tokenizer_path)
        self.max_model_len = min(config.max_model_len or checkpoint.config.max_position_embeddings,
                                 checkpoint.config.max_position_embeddings)
        self.runner = ModelRunner(config, checkpoint, self.max_model_len)
        num_blocks = self.runner.num_blocks
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill), self.blocks)
        eos = set(checkpoint.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = checkpoint.config.vocab_size
        self._requests: dict[str, _Request] = {}
        self._offline_ids = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        log.info("native engine: %s on %s, %s, %d KV blocks of %d tokens (%d tokens), max_model_len %d, "
                 "kernels: %s%s", model_path.name, self.runner.device, self.runner.dtype, num_blocks,
                 config.block_size, num_blocks * config.block_size, self.max_model_len,
                 self.runner.kernels.describe(), ", CUDA graphs" if self.runner.graphs else "")

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
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        self.check_request(prompt_ids, params)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(prompt_ids)
        seq = Sequence(request_id, list(prompt_ids), params)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens)
        self._requests[request_id] = _Request(request_id, seq, detok)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV blocks. Unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort(req.seq)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one batch and return what each sampled request produced."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        logits = self.runner.execute(scheduled.batch)
        self.prompt_tokens_total += sum(min(n, max(s.num_prompt - s.num_computed, 0))
                                        for s, n in zip(scheduled.seqs, scheduled.num_tokens))
        self.scheduler.complete(scheduled)
        sampling = [s for s, smp in zip(scheduled.seqs, scheduled.batch.sample) if smp]
        if not sampling:
            return []
        outputs = [self._append(self._requests[seq.request_id], sampled)
                   for seq, sampled in zip(sampling, sample(logits, sampling, self.eos_token_ids))]
        self.generation_tokens_total += len(outputs)
        return outputs

    def _append(self, req: _Request, sampled: Sampled) -> RequestOutput:
        seq, params = req.seq, req.seq.params
        tok = sampled.token_id
        seq.token_ids.append(tok)
        text, hit_stop = req.detok.add(tok)
        reason = None
        if hit_stop:
            reason = "stop"
        elif not params.ignore_eos and tok in self.eos_token_ids or tok in params.stop_token_ids:
            reason = "stop"
        elif seq.num_output >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            text += req.detok.flush()
            self.scheduler.finish(seq, reason)
            del self._requests[req.request_id]
        return RequestOutput(req.request_id, text, [tok], [sampled] if params.logprobs is not None else [],
                             reason, seq.num_prompt, seq.num_output, seq.num_cached_prompt)

    # ---------------------------------------------------------------------------------- figures
    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), kv_usage=self.blocks.usage,
            prefix_cache_queries=self.blocks.prefix_queries, prefix_cache_hits=self.blocks.prefix_hits,
            preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total)

    # ------------------------------------------------------------------------------ offline use
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion together; one folded output per prompt, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{self._offline_ids + i}" for i in range(len(prompts))]
        self._offline_ids += len(prompts)
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, SamplingParams(**vars(p)))
        folded = {rid: RequestOutput(rid, "", []) for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                acc = folded[out.request_id]
                acc.text += out.text
                acc.token_ids += out.token_ids
                acc.logprobs += out.logprobs
                acc.finish_reason = out.finish_reason
                acc.prompt_tokens, acc.completion_tokens, acc.cached_tokens = (
                    out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        return [folded[rid] for rid in ids]
