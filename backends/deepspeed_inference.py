"""DeepSpeed-Inference in-process: an HF model wrapped by ``deepspeed.init_inference`` (kernel injection
only on CUDA), served with static batching as DeepSpeed-Inference users do: waiting requests are padded
into one batch of at most ``max_batch_size`` that decodes until its last member finishes; each token is
streamed as soon as it is sampled (vLLM sampling semantics, shared with the native engine).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backends.base import (
    Backend,
    BackendInfo,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    UnavailableError,
    UpstreamError,
    Usage,
    refuse_unsupported,
)
from backends.deepspeed_config import DeepSpeedConfig
from backends.native.config import torch_dtype_named
from backends.native.sampler import Sampled, sample, token_logprobs
from backends.native.sequence import Sequence
from backends.stopping import StopChecker
from backends.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    seq: Sequence  # its ``stop`` detokenizes and applies the stop rules
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, item: GenerationChunk | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class DeepSpeedInferenceBackend(Backend):
    """A transformers model wrapped by ``deepspeed.init_inference``, batched and streamed in one thread."""

    # Static batches of single samples, no grammar engine: these are refused (logit_bias works: shared sampler).
    unsupported = ("n", "prompt_logprobs", "structured", "tools", "echo")

    def __init__(self, model_name: str, cfg: DeepSpeedConfig) -> None:
        self.model_name = model_name
        self.name = "deepspeed-inference"
        self.cfg = cfg
        self.max_batch_size = cfg.max_batch_size
        self.dtype = torch_dtype_named(cfg.dtype)
        self.model: Any = None  # the torch module init_inference returns, once started
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._serve, name="deepspeed-inference", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM

        from backends.native.weights import default_model_path

        path = Path(self.cfg.model_path) if self.cfg.model_path else default_model_path()
        if self.cfg.load_format == "dummy":
            model = _dummy_model(path, self.dtype)
        elif path.is_file():  # GGUF: transformers dequantises it
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=self.dtype)
            # The weights are dense tensors of ``dtype`` now; the flag would only stop DeepSpeed's dtype cast.
            model.is_quantized = False
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype, local_files_only=True)
        rope = {name: buf.detach().clone() for name, buf in model.named_buffers() if "inv_freq" in name}
        engine = deepspeed.init_inference(model, dtype=self.dtype, replace_with_kernel_inject=_kernel_inject(model))
        self.model = engine.module.eval()
        # init_inference casts every buffer to dtype; RoPE frequencies in bf16 change the outputs.
        for name, original in rope.items():
            owner, _, attr = name.rpartition(".")
            self.model.get_submodule(owner.removeprefix("module.")).register_buffer(attr, original, persistent=False)
        self.tokenizer = Tokenizer(path if path.suffix != ".json" else default_model_path())
        self.max_model_len = model.config.max_position_embeddings
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_token_ids = frozenset([*eos, self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None
                                       else eos)
        log.info("DeepSpeed-Inference ready: %s (%s, max batch %d)", path.name, self.cfg.dtype, self.max_batch_size)

    async def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    async def health(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def info(self) -> BackendInfo:
        return BackendInfo(model_ids=[self.model_name], max_model_len=self.max_model_len or None)

    async def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None,
                       add_special_tokens: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self._encode(text, messages, add_special_tokens, tools)

    async def detokenize(self, token_ids: list[int]) -> str:
        return self._tokenizer().decode(token_ids, skip_special_tokens=False)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        if self._thread is None or not self._thread.is_alive():
            raise UnavailableError("DeepSpeed-Inference is not running")
        refuse_unsupported(request, self.unsupported, "DeepSpeed-Inference")
        params = request.params
        params.validate()
        prompt_ids = (list(request.prompt) if isinstance(request.prompt, list)
                      else self._encode(request.prompt, request.messages, request.add_special_tokens))
        self._check(prompt_ids, params)
        seq = Sequence(request.request_id, prompt_ids, params)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_ids)
        seq.stop = StopChecker(params, IncrementalDetokenizer(self._tokenizer(), prompt_ids, params.skip_special_tokens),
                               self.eos_token_ids, max_tokens, self.max_model_len)
        job = _Job(seq, asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(job)
        try:
            while True:
                item = await job.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            job.cancelled.set()  # the batch stops computing for it at the next token

    # ------------------------------------------------------------------------------------ helpers
    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise UnavailableError("DeepSpeed-Inference is not started")
        return self.tokenizer

    def _encode(self, text: str | None, messages: list[dict[str, Any]] | None, add_special_tokens: bool,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
        tokenizer = self._tokenizer()
        if messages is not None:
            return tokenizer.apply_chat_template(messages, tools)
        try:
            return tokenizer.encode(text or "", add_special_tokens=add_special_tokens)
        except (UnicodeError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"prompt cannot be tokenised: {exc}", param="prompt") from exc

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        vocab = self._tokenizer().vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"Token ids must be in [0, {vocab}).", param="prompt")
        wanted = len(prompt_ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{params.max_tokens} output tokens and your prompt contains {len(prompt_ids)} input tokens, "
                f"for a total of {wanted} tokens.", param="input_tokens")

    # ------------------------------------------------------------------------------ worker thread
    def _serve(self) -> None:
        while True:
            job = self._inbox.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._inbox.put(None)
                    break
                batch.append(nxt)
            batch = [j for j in batch if not j.cancelled.is_set()]
            try:
                with torch.inference_mode():
                    self._run_batch(batch)
            except Exception as exc:  # one bad batch must not kill the server
                log.exception("DeepSpeed-Inference batch failed")
                for j in batch:
                    j.emit(UpstreamError(f"DeepSpeed-Inference failed: {exc}"))

    def _run_batch(self, batch: list[_Job]) -> None:
        if not batch:
            return
        longest = max(j.seq.num_prompt for j in batch)
        pad = 0
        ids = torch.full((len(batch), longest), pad, dtype=torch.int64)
        mask = torch.zeros((len(batch), longest), dtype=torch.int64)
        for i, j in enumerate(batch):  # left padding: every row's last token is at the same position
            ids[i, longest - j.seq.num_prompt:] = torch.tensor(j.seq.prompt_ids)
            mask[i, longest - j.seq.num_prompt:] = 1
        device = next(self.model.parameters()).device  # where init_inference put the model
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        live = list(range(len(batch)))
        while True:
            logits = out.logits[:, -1].float()
            rows = [i for i in live if not batch[i].cancelled.is_set()]
            picks = dict(zip(rows, sample(logits[rows], [batch[i].seq for i in rows], self.eos_token_ids))) if rows else {}
            next_ids = torch.full((len(batch), 1), pad, dtype=torch.int64, device=device)
            live = []
            for i, sampled in picks.items():
                if self._append(batch[i], sampled) is None:
                    live.append(i)
                    next_ids[i, 0] = sampled.token_id
            if not live:
                return
            mask = torch.cat([mask, torch.ones((len(batch), 1), dtype=torch.int64, device=device)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=next_ids, attention_mask=mask, position_ids=positions,
                             past_key_values=out.past_key_values, use_cache=True)

    def _append(self, job: _Job, sampled: Sampled) -> str | None:
        """Record one sampled token, stream its text; the finish reason once the sequence is done."""
        seq, tokenizer = job.seq, self.tokenizer
        assert seq.stop is not None and tokenizer is not None  # every sequence has its checker; loaded at start
        seq.token_ids.append(sampled.token_id)
        text, reason = seq.stop.add(sampled.token_id, seq.num_tokens)
        logprobs = token_logprobs(tokenizer, sampled) if seq.params.logprobs is not None else None
        job.emit(GenerationChunk(text=text, token_ids=[sampled.token_id], logprobs=logprobs, finish_reason=reason,
                                 usage=Usage(seq.num_prompt, seq.num_output) if reason else None))
        return reason


def _dummy_model(path: Path, dtype: torch.dtype):
    """A transformers model of the shape ``path`` describes (a config.json, or a directory holding one) with
    random weights, built where it will run (the GPU when there is one): no checkpoint is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _kernel_inject(model) -> bool:
    """DeepSpeed's fused inference kernels, on CUDA only, and only for models whose attention is not grouped:
    its injected Llama layer merges q, k and v as equal thirds (DeepSpeed 0.19.8 asserts "Merging tensors is not
    allowed here" on a GQA model), so a GQA model runs as transformers' layers under DeepSpeed-Inference."""
    cfg = model.config
    grouped = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads) != cfg.num_attention_heads
    if grouped and torch.cuda.is_available():
        log.info("DeepSpeed-Inference without kernel injection: %d KV heads for %d query heads (GQA)",
                 cfg.num_key_value_heads, cfg.num_attention_heads)
    return torch.cuda.is_available() and not grouped
