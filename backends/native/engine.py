"""The synchronous engine: admission checks, then the schedule → run → sample → postprocess step.

A request is validated once, where it enters (``check_request``); admitted requests are only checked for
invariants. What one step produces for a request is a ``GenerationChunk``, the type every backend
streams, so nothing converts it again between the engine and the gateway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from backends.base import (
    EngineStats,
    GenerationChunk,
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    Usage,
)
from backends.kv_events import KVEventBatch, ZmqEventPublisher
from backends.native.block_manager import BlockManager
from backends.native.config import EngineConfig
from backends.native.model_runner import ModelRunner, StepRunner, kv_bytes_per_block
from backends.native.openmp import release_thread_pool
from backends.native.process import prepare_process
from backends.native.sampler import Sampled, ranked, sample, sample_tokens, token_logprob, token_logprobs
from backends.native.scheduler import ScheduledStep, Scheduler, Update
from backends.native.sequence import Sequence
from backends.native.step_trace import StepTrace, open_trace
from backends.native.structured_output import GrammarCompiler, new_matcher
from backends.native.transfers import PendingPicks
from backends.native.weights import default_model_path, open_checkpoint
from backends.sim.runner import unsupported_by_simulation
from backends.stopping import StopChecker
from backends.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from backends.native.batch import Batch
    from backends.native.workers import ParallelRunner

log = logging.getLogger(__name__)

RequestOutput = tuple[str, GenerationChunk]  # (request id, what one step produced for it)


def start_engine(config: EngineConfig, tokenizer: Tokenizer | None = None) -> LLMEngine:
    """The process prepared for an engine (threads, memory: process.py; its CPUs shared with the other ranks
    when the model is split over processes of this machine), then the engine."""
    prepare_process(config, share=config.world_size if config.distributed_executor_backend == "mp" else 1)
    return LLMEngine(config, tokenizer)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        """Load the model named by ``config``; pass ``tokenizer`` to reuse one already loaded. The process's own
        settings (threads, memory) are ``process.prepare_process``'s, done before."""
        self.config = config
        model_path = Path(config.model_path) if config.model_path else default_model_path()
        self.model_path = model_path
        checkpoint = open_checkpoint(model_path, config.hf_overrides)
        self.model_config = checkpoint.config
        self.tokenizer = tokenizer or Tokenizer(Path(config.tokenizer) if config.tokenizer else checkpoint.tokenizer_path)
        self.max_model_len = min(config.max_model_len or checkpoint.config.max_position_embeddings,
                                 checkpoint.config.max_position_embeddings)
        eos = set(checkpoint.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.runner: StepRunner
        if config.simulate is not None:  # a simulated replica: no weights, each step the time a profile models
            from backends.sim.runner import SimulatedRunner

            self.runner = SimulatedRunner(config, checkpoint.config, self.tokenizer, self.eos_token_ids)
        elif config.world_size > 1:
            from backends.native.workers import ParallelRunner

            self.runner = ParallelRunner(config, checkpoint, self.max_model_len)
        else:
            self.runner = ModelRunner(config, checkpoint, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.overlap_steps = config.overlaps_steps(self.runner.device)  # async scheduling (step())
        self.kv_events = None  # the publisher of the prefix cache's KV events (backends/kv_events.py), if on
        events = config.kv_events_config
        if events.enable_kv_cache_events and events.publisher == "zmq":
            self.kv_events = ZmqEventPublisher(events.endpoint, events.topic)
            self.blocks.events = []
            self.blocks.medium = self.runner.kv_medium
        self._in_flight: tuple[ScheduledStep, PendingPicks] | None = None  # launched, tokens not applied yet
        self._pipeline: deque[ScheduledStep] = deque()  # pipeline parallelism: launched, oldest first
        self._busy: set[Sequence] = set()  # the sequences of the batches in the pipeline
        self.vocab_size = checkpoint.config.vocab_size
        self._requests: dict[str, list[Sequence]] = {}  # request id -> its n sequences, by choice index
        self._grammars: GrammarCompiler | None = None  # built on first use (xgrammar reads the vocabulary)
        self._grammars_lock = threading.Lock()
        self._offline_ids = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        log.info("native engine: %s on %s, %s (dtype %s), %d KV blocks of %d tokens (%d tokens, %s), max_model_len "
                 "%d, kernels: %s%s", model_path.name, self.runner.device, self.runner.dtype, config.dtype,
                 self.blocks.num_blocks, self.blocks.block_size, self.blocks.num_blocks * self.blocks.block_size,
                 self.runner.kv_dtype,
                 self.max_model_len, self.runner.kernels.describe(),
                 (", CUDA graphs" if self.runner.graphs else "") + (", async scheduling" if self.overlap_steps else ""))
        self.step_trace: StepTrace | None = None  # opened after the warm-up: it traces served steps only
        if config.warmup:
            self.warm_up()
        if config.step_trace:
            self.step_trace = open_trace(config.step_trace, self)
        # The thread that built the engine may never step it (AsyncEngine steps in its own): its parked
        # OpenMP threads would make every step's parallel regions sleep and wake (openmp.py).
        release_thread_pool()

    def warm_up(self) -> None:
        """Run prefill chunks and decode steps of throwaway requests once, as vLLM does before serving:
        kernels are compiled or autotuned, caches and allocators grown, so the first real burst runs as
        fast as the second. Leaves no sequence, KV block, prefix-cache entry or counted token behind."""
        started = time.perf_counter()
        capacity = self.blocks.num_blocks * self.blocks.block_size
        length = max(1, min(self.config.max_num_batched_tokens // 2, self.max_model_len - 8, capacity - 8, 256))
        prompts = [[(7 + 13 * i + j) % self.vocab_size for j in range(length)] for i in range(2)]
        self.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        self.blocks.reset_prefix_cache()
        self._publish_kv_events()  # AllBlocksCleared: readers forget the warm-up's blocks
        self.prompt_tokens_total = self.generation_tokens_total = self.scheduler.num_preemptions = 0
        log.info("native engine: warmed up in %.2f s", time.perf_counter() - started)

    # ------------------------------------------------------------------------------- admission
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` if this request can never run. Pure: safe from any thread."""
        params.validate()
        if self.runner.picks_tokens and (name := unsupported_by_simulation(params)):
            raise InvalidRequestError(f"{name} needs the model's logits, which a simulated replica does not compute.",
                                      param=name)
        if not prompt_ids:
            raise InvalidRequestError("The prompt is empty: it must contain at least one token.", param="prompt")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"Token id {bad} is out of vocabulary (vocab size {self.vocab_size}).",
                                      param="prompt")
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if not 0 <= t < self.vocab_size]
            if outside:  # vLLM's words (SamplingParams._validate_logit_bias)
                raise InvalidRequestError(f"token_id(s) {outside} in {name} contain out-of-vocab token ids. "
                                          f"Vocabulary size: {self.vocab_size}", param=name)
        max_n = min(self.config.max_n, self.config.max_num_seqs)
        if params.n > max_n:
            raise InvalidRequestError(f"n must be at most {max_n} on this deployment, got {params.n}.", param="n")
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

    def compile_grammar(self, structured: StructuredOutput) -> Any:
        """The compiled grammar of a structured output (LRU-cached); raises ``InvalidRequestError`` naming
        the request field when it is invalid. Safe from any thread: callers compile before admission."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars.compile(structured)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, grammar: Any = None) -> None:
        """Queue a request that ``check_request`` accepted, with its ``compile_grammar`` result if it has a
        structured output; ``params`` is read, never changed. Its ``n`` samples are ``n`` sequences."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        seqs = [self._sequence(request_id, prompt_ids, params, i, grammar) for i in range(params.n)]
        seqs[0].forks = seqs[1:]
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = []
        self._requests[request_id] = seqs
        self.scheduler.add(seqs[0])

    def _sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int,
                  grammar: Any) -> Sequence:
        seq = Sequence(request_id, list(prompt_ids), params, index=index)
        if params.seed is not None:  # sample i draws from seed + i, as vLLM's parallel sampling does
            seq.generator = torch.Generator().manual_seed(params.seed + index)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_ids)
        detokenizer = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                       if params.detokenize else None)
        seq.stop = StopChecker(params, detokenizer, self.eos_token_ids, max_tokens, self.max_model_len)
        if grammar is not None:
            seq.grammar = new_matcher(grammar)
        return seq

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV blocks. Unknown or finished ids are ignored."""
        for seq in self._requests.pop(request_id, []):
            self.scheduler.abort(seq)
        if self.step_trace is not None and not self.has_unfinished():  # emptied between steps: idle from here
            self.step_trace.called(in_flight=False, more=False)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or bool(self._pipeline)

    @property
    def alive(self) -> bool:
        """False once a tensor-parallel worker died: nothing more can run."""
        return self.runner.alive

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and the KV events' publisher; close the step trace first,
        while its last step can still be timed."""
        if self.step_trace is not None:
            self.step_trace.close()
        self.runner.close()
        if self.kv_events is not None:
            self.kv_events.close()

    # ------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one batch; (request id, chunk) for every request that got a token. With async scheduling, the
        batch is launched and the previous one's tokens come back: a step's outputs arrive with the next call,
        the host's bookkeeping overlapping the device's work. Requests that need each token on the host before
        the next step is scheduled (``_overlappable``) run synchronously, the step in flight finished first."""
        if self.runner.depth > 1:
            outputs = self._pipelined_step()
        elif self.overlap_steps and self._overlappable():
            outputs = self._launch_step()
        else:
            outputs = self._finish_in_flight() + self._sync_step()
        self._publish_kv_events()
        if self.step_trace is not None:
            self.step_trace.called(in_flight=self._in_flight is not None, more=self.has_unfinished())
        return outputs

    def _publish_kv_events(self) -> None:
        events = self.blocks.events
        if events and self.kv_events is not None:  # without a publisher, whoever set blocks.events reads them
            self.kv_events.publish(KVEventBatch(time.time(), list(events)))
            events.clear()

    def _sync_step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        start = self._mark()
        logits = self.runner.execute(scheduled.batch)
        self._count_prompt_tokens(scheduled)
        outputs = self._sampled(scheduled, logits)
        self._traced(scheduled.batch, start)
        return outputs

    def _mark(self) -> Any:
        """A mark on the step trace's clock (None without a trace)."""
        return self.step_trace.clock.mark() if self.step_trace is not None else None

    def _traced(self, batch: Batch, start: Any) -> None:
        """Tell the step trace (if any) of a step launched at ``start`` whose tokens are now sampled (on a GPU
        under async scheduling: enqueued)."""
        if self.step_trace is not None:
            self.step_trace.launched(batch, start, self.step_trace.clock.mark())

    def _pipelined_step(self) -> list[RequestOutput]:
        """Pipeline parallelism: launch batches of sequences not in flight until ``runner.depth`` are (vLLM's
        virtual engines: each stage works on one batch while the next stage works on the one before), then
        finish the oldest. A sequence is in one batch at a time (its next token needs the last one), and each batch
        takes an even share of the live sequences, so that the batches in flight are alike (vLLM's virtual engines
        each hold a share of the requests)."""
        runner = cast("ParallelRunner", self.runner)  # the one runner with pipeline stages (depth > 1)
        live = len(self.scheduler.running) + len(self.scheduler.waiting)
        share = max(1, -(-live // runner.depth))
        while len(self._pipeline) < runner.depth:
            scheduled = self.scheduler.schedule(busy=self._busy, max_seqs=share)
            if scheduled is None:
                break
            runner.launch(scheduled.batch)
            self._count_prompt_tokens(scheduled)
            self._pipeline.append(scheduled)
            self._busy.update(scheduled.seqs)
        if not self._pipeline:
            return []
        scheduled = self._pipeline.popleft()
        self._busy.difference_update(scheduled.seqs)
        return self._sampled(scheduled, runner.finish())

    def _sampled(self, scheduled: ScheduledStep, logits: torch.Tensor) -> list[RequestOutput]:
        """Sample a finished step's logits (prompt logprobs collected first) and apply its tokens."""
        batch = scheduled.batch
        if self.runner.picks_tokens:  # a simulated replica's runner returns its tokens: no logits to sample
            return self._outputs(self.scheduler.postprocess(scheduled, [Sampled(t) for t in logits]))
        sample_rows = []
        for seq, rows, samples, all_rows in zip(scheduled.seqs, batch.logits_rows(), batch.sample,
                                                batch.all_logits):
            if all_rows:
                self._collect_prompt_logprobs(seq, logits[rows.start:rows.stop])
            if samples:  # the prompt's forks sample from the same row
                sample_rows += [rows.stop - 1] * (1 + len(seq.forks))
        sampling = scheduled.sampling
        if sample_rows != list(range(logits.shape[0])):
            logits = logits[sample_rows]
        sampled = sample(logits, sampling, self.eos_token_ids) if sampling else []
        return self._outputs(self.scheduler.postprocess(scheduled, sampled))

    def _launch_step(self) -> list[RequestOutput]:
        """Schedule and launch a step over the placeholders of the one in flight, then finish that one."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return self._finish_in_flight()
        previous = self._in_flight[1].device if self._in_flight is not None else None
        runner = cast(ModelRunner, self.runner)  # async scheduling: one process (EngineConfig.overlaps_steps)
        start = self._mark()
        logits = runner.execute(scheduled.batch, previous)
        self._count_prompt_tokens(scheduled)
        tokens, _ = sample_tokens(logits, scheduled.sampling, self.eos_token_ids)  # every row samples (no forks)
        pending = PendingPicks(tokens)
        self._traced(scheduled.batch, start)
        outputs = self._finish_in_flight()
        self.scheduler.advance(scheduled, pending=True)
        self._in_flight = (scheduled, pending)
        return outputs

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Bring the step in flight's tokens to the host (waiting for its device work) and apply them."""
        if self._in_flight is None:
            return []
        scheduled, pending = self._in_flight
        self._in_flight = None
        return self._outputs(self.scheduler.resolve(scheduled, [Sampled(t) for t in pending.tolist()]))

    def _overlappable(self) -> bool:
        """Whether every live sequence can be scheduled before its last token is on the host: no logprobs,
        penalties, min_tokens, logit_bias, grammar or parallel samples (those read tokens on the host)."""
        return all(_needs_no_host_tokens(s.params) for s in self.scheduler.running) and \
            all(_needs_no_host_tokens(s.params) for s in self.scheduler.waiting)

    def _count_prompt_tokens(self, scheduled: ScheduledStep) -> None:
        self.prompt_tokens_total += sum(min(n, max(s.num_prompt - s.num_computed, 0))
                                        for s, n in zip(scheduled.seqs, scheduled.num_tokens))

    def _outputs(self, updates: list[Update]) -> list[RequestOutput]:
        self.generation_tokens_total += len(updates)
        outputs = [self._output(u) for u in updates]
        for u in updates:  # a request is done when its last sequence is
            group = self._requests.get(u.seq.request_id, ())
            if u.finish_reason is not None and all(s.finish_reason is not None for s in group):
                self._requests.pop(u.seq.request_id, None)
        return outputs

    def _collect_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens that this step's rows of ``seq`` predict (row j, at position
        ``num_computed + j``, predicts the token after it), appended to ``seq.prompt_logprobs``."""
        collected, start, top_n = seq.prompt_logprobs, seq.num_computed, seq.params.prompt_logprobs
        assert collected is not None and top_n is not None, "rows of every logit only for prompt_logprobs"
        if not collected:
            collected.append(None)  # the first prompt token has no logprob
        first = max(len(collected) - 1 - start, 0)  # the row predicting the next uncollected prompt token
        stop = min(logits.shape[0], seq.num_prompt - 1 - start)
        if stop <= first:
            return
        logprobs = torch.log_softmax(logits[first:stop], dim=-1)
        targets = torch.tensor(seq.token_ids[start + first + 1:start + stop + 1], device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
        token_ids, chosen = targets.tolist(), chosen.squeeze(1).tolist()
        tops = ranked(logprobs, token_ids, chosen, top_n)
        collected.extend(zip(token_ids, chosen, ranks, tops))

    def _output(self, update: Update) -> RequestOutput:
        seq, reason = update.seq, update.finish_reason
        group = self._requests[seq.request_id]
        logprobs = token_logprobs(self.tokenizer, update.sampled) if seq.params.logprobs is not None else None
        usage = Usage(seq.num_prompt, sum(s.num_output for s in group), group[0].num_cached_prompt)
        stop_reason = None
        if reason is not None:
            assert seq.stop is not None  # set when the engine admitted the request
            stop_reason = seq.stop.stop_reason
        chunk = GenerationChunk(update.text, [update.sampled.token_id], logprobs, reason, usage, seq.index,
                                stop_reason)
        if seq.num_output == 1 and (collected := group[0].prompt_logprobs) is not None:
            chunk.prompt_logprobs = self._prompt_logprobs(collected)
        return seq.request_id, chunk

    def _prompt_logprobs(self, collected: list) -> list[TokenLogprob | None]:
        """vLLM's prompt_logprobs from a sequence's ``collected`` entries: None for the first token, then each
        token's logprob and rank with the top alternatives (ranked 1, 2, ...)."""
        return [None if entry is None else token_logprob(self.tokenizer, entry[0], entry[1], entry[3], entry[2])
                for entry in collected]

    # ---------------------------------------------------------------------------------- figures
    def settings(self) -> dict:
        """What the engine runs with: its configuration with every ``auto`` resolved (for GET /info)."""
        runner = self.runner
        return {**self.config.model_dump(), "model_path": str(self.model_path), "device": str(runner.device),
                "num_threads": torch.get_num_threads(),  # as the process was prepared (process.py)
                "dtype": str(runner.dtype).removeprefix("torch."), "num_blocks": self.blocks.num_blocks,
                "block_size": self.blocks.block_size,
                "kv_cache_bytes": self.blocks.num_blocks * kv_bytes_per_block(  # the engine process's rank's
                    self.model_config, self.blocks.block_size, runner.kv_dtype, self.config.tensor_parallel_size,
                    runner.num_layers),
                "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
                "max_model_len": self.max_model_len, "kernels": runner.kernels.describe(),
                "linear_kernels": runner.linear_kernels(),  # the driver rank's, by layer kind (linear_kernels.py)
                "weight_bytes": runner.weight_bytes(),  # the driver rank's: int8 layers show here
                "small_step_copy_bytes": runner.small_step_copy_bytes(),  # within weight_bytes (linear.py)
                "cuda_graphs": runner.graphs is not None, "async_scheduling": self.overlap_steps,
                "fused_steps": runner.fused is not None}  # CPU steps in one C call (fused_step.py)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), kv_usage=self.blocks.usage,
            prefix_cache_queries=self.blocks.prefix_queries, prefix_cache_hits=self.blocks.prefix_hits,
            preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total)

    # ------------------------------------------------------------------------------ offline use
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[GenerationChunk]:
        """Run prompts to completion together; one folded chunk per choice: the ``n`` choices of each
        prompt in turn (one per prompt when n is 1)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{self._offline_ids + i}" for i in range(len(prompts))]
        self._offline_ids += len(prompts)
        for prompt, p in zip(prompts, plist):  # all checked before any is queued: a bad one leaves nothing behind
            self.check_request(prompt, p)
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p, self.compile_grammar(p.structured) if p.structured else None)
        folded = {(rid, i): GenerationChunk(index=i) for rid, p in zip(ids, plist) for i in range(p.n)}
        while self.has_unfinished():
            for rid, chunk in self.step():
                folded[rid, chunk.index].extend(chunk)
        return list(folded.values())


def _needs_no_host_tokens(p: SamplingParams) -> bool:
    return (p.n == 1 and p.logprobs is None and p.prompt_logprobs is None and p.structured is None
            and p.min_tokens == 0 and not p.logit_bias and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0)
