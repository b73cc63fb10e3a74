"""The engine's two configurations: what to run (``EngineConfig``, passed whole from the deployment
to every part of the engine) and the model's shape (``ModelConfig``, read from an HF ``config.json`` or
from GGUF metadata).

torch is imported only where a setting is resolved against the hardware: the gateway validates native
deployments with this module, and a gateway of remote backends never loads torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.tool_calls import ToolParserName

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
# The embedded SmolLM2's own chat template with tools added (chat_templates/smollm2_tools.jinja): what the default
# deployment renders chats with, so that its hermes tool parser has calls to read
EMBEDDED_TOOLS_TEMPLATE = Path(__file__).parent / "chat_templates" / "smollm2_tools.jinja"
DEFAULT_MODEL_ENV = "BURSTGATE_DEFAULT_MODEL"  # a local GGUF served instead of the embedded SmolLM2 (weights.py)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# vLLM's --kv-cache-dtype names ("fp8" is e4m3, as in vLLM) for KV caches of one byte per value: torch's names
FP8_KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def torch_dtype_named(name: str) -> torch.dtype:
    """The torch dtype of one of ``DTYPE_NAMES`` (or torch's own name of any other)."""
    import torch

    return getattr(torch, name)


class KVEventsConfig(BaseModel):
    """vLLM's ``--kv-events-config``: publish what enters and leaves the prefix cache (backends/kv_events.py)."""

    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False  # publish them
    publisher: Literal["zmq", "null"] = "zmq"  # null: build the events, send none
    endpoint: str = "tcp://*:5557"  # ZMQ PUB socket it binds
    topic: str = ""  # the ZMQ topic every message is sent under


class SimulationConfig(BaseModel):
    """A simulated replica (backends/sim): this engine's scheduler and block manager, no model; each step takes
    the time a device profile's step-time model gives it."""

    model_config = ConfigDict(extra="forbid")

    profile: str  # a profile file, a name in backends/sim/profiles, or a GPU type of the planner's
    real_time: bool = True  # sleep each step's modelled time; False: a virtual-time driver keeps the clock
    spread: bool = True  # each step's time drawn from the profile's measured step spread, if it has one
    # of those draws; None: fresh at each start, as a real host's jitter is (a virtual fleet derives each replica's
    # from its own seed and this); served replicas given one seed draw alike
    seed: int | None = None

    @field_validator("profile")
    @classmethod
    def _known(cls, profile: str) -> str:
        from backends.sim.profile import load_profile

        load_profile(profile)  # a bad name or file is refused where the config is read, not when the engine starts
        return profile


class EngineConfig(BaseModel):
    """Everything the native engine runs with, validated once. A native deployment's configuration *is*
    this model (plus the gateway's own fields), so a new engine setting is one field here."""

    model_config = ConfigDict(extra="forbid")

    model_path: str | None = None  # local HF directory, .gguf file or config.json; None: the embedded SmolLM2
    tokenizer: str | None = None  # default: the model's own (the embedded one for a bare config.json)
    load_format: Literal["auto", "dummy"] = "auto"  # dummy: random weights (vLLM's name)
    hf_overrides: dict[str, Any] = Field(default_factory=dict)  # config.json fields replaced (e.g. fewer layers)
    seed: int = 0  # of dummy weights
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: see ``torch_dtype``
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")  # auto: CUDA when present
    # int8: weight-only int8, a scale per output channel (linear.py), for decode-bound CPU serving; CPU only
    quantization: Literal["int8"] | None = None
    # KV cache storage: auto, as the model's dtype; fp8 (e4m3) or fp8_e5m2, one byte per value with vLLM's default
    # scale of 1: half a bf16 cache's bytes for decode to read, twice the tokens in the same memory; CPU only
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # tokens per KV block; None: 64 on CPU, 16 on CUDA (``kv_block_size``)
    block_size: int | None = Field(None, ge=1, le=64)
    kv_cache_gb: float | None = Field(None, gt=0)  # None: 2 GiB on CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # share of the GPU this engine may use (vLLM's name)
    num_blocks: int | None = Field(None, ge=1)  # overrides both (tests force preemption with tiny values)
    max_model_len: int | None = Field(None, ge=2)  # default: the model's max_position_embeddings
    max_num_seqs: int = Field(256, ge=1)  # most sequences in one batch (vLLM's name)
    max_n: int = Field(128, ge=1)  # most parallel samples one request may ask for (OpenAI's limit)
    max_num_batched_tokens: int = Field(2048, ge=16)  # most tokens one step computes (prefill chunks + decodes)
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompts that start alike
    enable_chunked_prefill: bool = True  # long prompts prefilled in chunks beside running decodes
    num_threads: int | None = Field(None, ge=1)  # None: CPU affinity capped by the cgroup quota
    kernels: Literal["auto", "torch"] = "auto"  # auto: C kernels on CPU, Triton on CUDA; torch: pure torch
    enforce_eager: bool = False  # every step through the torch modules: no CUDA graphs, no fused CPU steps (vLLM's name)
    # schedule the next step while the GPU runs this one (vLLM's --async-scheduling); None: on CUDA (scheduler.py)
    async_scheduling: bool | None = None
    kv_events_config: KVEventsConfig = Field(default_factory=KVEventsConfig)  # vLLM's; for cache-aware routers
    tensor_parallel_size: int = Field(1, ge=1)  # ranks the model is split across (processes; GPUs on CUDA)
    # stages the layers are split into (vLLM's name); the model runs on tensor x pipeline ranks (parallel.py)
    pipeline_parallel_size: int = Field(1, ge=1)
    # layers per pipeline stage, first to last (vLLM's VLLM_PP_LAYER_PARTITION, which is read when this is None);
    # None and no variable: even shares, the remainder to the stages before the last (which holds the LM head)
    pipeline_layer_partition: list[int] | None = None
    # where the ranks beyond the engine's own run: mp, processes of this machine; ray, actors of a Ray cluster
    # placed across its nodes (the engine joins the cluster named by RAY_ADDRESS, else a local one) (vLLM's names)
    distributed_executor_backend: Literal["mp", "ray"] = "mp"
    warmup: bool = True  # run a few steps at start-up, so that the first requests find every kernel ready
    # Tool calling: the format tool calls are parsed from (vLLM's --tool-call-parser); None: tools are
    # rendered by the template but tool_choice auto/required/named is refused, as vLLM does without it.
    tool_parser: ToolParserName | None = None
    chat_template: str | None = None  # a Jinja template or a file holding one, instead of the model's
    simulate: SimulationConfig | None = None  # a simulated replica: no weights loaded, no model run (backends/sim)
    # a file the engine writes each step's batch and duration to while it serves (step_trace.py), for
    # `burstgate sim fit --from`: a simulator profile fitted on the steps served, not timed in-process
    step_trace: str | None = None

    @field_validator("pipeline_layer_partition")
    @classmethod
    def _positive(cls, partition: list[int] | None) -> list[int] | None:
        if partition is not None and min(partition, default=0) < 1:
            raise ValueError(f"every pipeline stage needs at least one layer, got {partition}")
        return partition

    @model_validator(mode="after")
    def _simulated_replicas_run_no_ranks(self) -> EngineConfig:
        if self.simulate is not None and (self.pipeline_parallel_size > 1 or self.distributed_executor_backend != "mp"):
            raise ValueError("a simulated replica runs no ranks: it models tensor parallelism (tensor_parallel_size), "
                             "not pipeline_parallel_size or distributed_executor_backend")
        return self

    @model_validator(mode="after")
    def _a_step_trace_times_one_batch_a_step(self) -> EngineConfig:
        if self.step_trace is not None and self.pipeline_parallel_size > 1:
            raise ValueError("step_trace times one batch a step: not with pipeline_parallel_size > 1, where "
                             "several are in flight")
        return self

    @property
    def world_size(self) -> int:
        """Ranks the model runs on: tensor x pipeline parallel (1: this process alone)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def torch_device(self) -> torch.device:
        """``device`` resolved: ``auto`` is the current CUDA device when there is one, else the CPU."""
        import torch

        if self.device == "auto":
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r}: CUDA is not available on this machine")
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
            device = torch.device("cuda", index)
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """``dtype`` resolved: ``auto`` is bf16 where the hardware computes in it natively (CUDA with bf16,
        CPUs with AMX or AVX512-BF16), float16 on older GPUs, float32 otherwise."""
        import torch

        if self.dtype != "auto":
            return torch_dtype_named(self.dtype)
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32

    def kv_block_size(self, device: torch.device) -> int:
        """``block_size`` resolved: 64 tokens on CPU, 16 on CUDA (the Triton kernels' and vLLM's GPU default).
        A CPU decode step reads every sequence's blocks from memory, and a block is one run of memory per KV
        head: longer runs keep the hardware prefetchers streaming, where 16-token blocks scattered over the
        cache made it wait.
        vLLM's CPU backend takes 128 for the same reason; our CPU kernels hold at most 64 a block."""
        if self.block_size is not None:
            return self.block_size
        return 16 if device.type == "cuda" else 64

    def overlaps_steps(self, device: torch.device) -> bool:
        """``async_scheduling`` resolved: on by default where the model runs asynchronously to the host (CUDA);
        on the CPU the host computes the step itself, so there is nothing to overlap. One process only: the
        parallel ranks take the batch's token ids from the engine's host lists."""
        if self.world_size > 1:
            return False
        return self.async_scheduling if self.async_scheduling is not None else device.type == "cuda"

    def torch_kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """``kv_cache_dtype`` resolved for a model computing in ``dtype``."""
        return dtype if self.kv_cache_dtype == "auto" else torch_dtype_named(FP8_KV_CACHE_DTYPES[self.kv_cache_dtype])


CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (/proc/cpuinfo); empty where it cannot be read."""
    try:
        line = next(line for line in CPUINFO.read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles or AVX512-BF16)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


@dataclass
class ModelConfig:
    """Llama-family decoder shape. ``rope_scaling`` keeps HF's dict form (``rope_type`` + its fields)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once): for FLOP and bandwidth estimates."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h

    # ------------------------------------------------------------------------------------ builders
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF ``config.json`` (Llama, Mistral or Qwen2 classes)."""
        arch = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope_from_hf(cfg)
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias and says nothing in its config.
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            architecture=arch,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(eos),
        )

    @classmethod
    def from_hf_file(cls, path: Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """From a ``config.json`` file, with ``overrides`` replacing its fields (vLLM's ``hf_overrides``)."""
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: expected a JSON object")
        cfg.update(overrides or {})
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"{path}: missing model fields {missing}")
        return cls.from_hf_dict(cfg)

    @classmethod
    def from_hf_dir(cls, path: Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        config = cls.from_hf_file(path / "config.json", overrides)
        gen_path = path / "generation_config.json"
        if gen_path.exists():
            gen_eos = _as_list(json.loads(gen_path.read_text()).get("eos_token_id"))
            config.eos_token_ids = sorted(set(config.eos_token_ids) | set(gen_eos))
        return config

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ModelConfig:
        """Build from GGUF key/values (``general.architecture`` prefixes the model keys)."""
        arch = meta["general.architecture"]

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        hidden = key("embedding_length")
        num_heads = key("attention.head_count")
        vocab = key("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        rope_scaling = None
        if key("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"),
            num_heads=num_heads,
            num_kv_heads=key("attention.head_count_kv", num_heads),
            head_dim=key("attention.key_length") or hidden // num_heads,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=key("rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=key("context_length", 4096),
            tie_word_embeddings=False,  # decided by the loader: tied when there is no output.weight
            attention_bias=arch == "qwen2",
            architecture=arch,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_list(eos),
        )


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Newer transformers put everything in ``rope_parameters``; older ones use ``rope_scaling`` + ``rope_theta``."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if params is not None and theta is None:
        theta = params.get("rope_theta")
    scaling = None
    if params is not None:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            scaling["rope_type"] = rope_type
    return float(theta if theta is not None else 10000.0), scaling


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
