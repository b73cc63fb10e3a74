"""How long one engine step takes on a device, from first principles: each part of the step at the roofline of
what bounds it, the efficiencies and per-step costs fitted on measured steps (``fit.py``) and kept in a profile.

A step is the native engine's ``Batch``: per sequence, the tokens it computes (``query_lens``) and the tokens in
its KV cache after the step (``context_lens``). Its time is

    overhead + per_sequence * sequences + launches (+) device, where device =
      max(linear FLOPs / (peak FLOP/s * compute_efficiency), weight bytes / (bandwidth * memory_efficiency))
    + max(attention FLOPs / (peak * compute_efficiency), KV bytes / (bandwidth * memory_efficiency))
    + tensor-parallel all-reduces (two per layer, ring, at the interconnect's bandwidth)

(a profile's fitted ``memory_overlap`` says how much of the shorter of each max()'s two times hides behind the
longer: all of it on a GPU, the roofline; on a CPU, whose cores wait for memory and compute partly in turn at a
step's skinny matrix shapes, less; a step run whole computes at the profile's ``whole_step_compute_efficiency``
where it has one: a CPU's fused step runs kernels of its own; so does attention, at ``attention_compute_efficiency``
where a profile has one),
and launches = per_layer_launch * layers for a step run layer by layer from the host; none for a step run whole
(a decode-only one replayed from CUDA graphs on a GPU; on a CPU, one the fused C step takes: up to the rows of the
linear layers' small-step copies, prompt tokens or not). A GPU runs the launches beside the
device's work, so the step takes the longer of the two ((+) is max); a CPU does both itself ((+) is +).

The linear layers read every weight once per step however many tokens share it (decode is bound by bytes,
prefill by FLOPs); attention reads each sequence's keys and values once (decode at long contexts is bound by
the KV cache; of a block several of a step's sequences hold through the prefix cache, the profile's
``kv_cache_reuse`` share of the reads after the first comes from the caches) and computes a query against every
key before it. Pure arithmetic on plain numbers: the virtual-time fleet calls it once per simulated step.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.native.config import ModelConfig
from backends.sim.profile import StepProfile


@dataclass(frozen=True)
class StepCost:
    """The work of a model's step on one of ``tp`` ranks, per token and per byte: FLOPs and bytes, no time."""

    linear_flops_per_token: float  # every linear layer but the LM head, one token
    lm_head_flops_per_row: float  # the LM head, one sampled row
    attention_flops_per_query_key: float  # QK^T and PV of one query against one key, every layer
    weight_bytes: float  # read once per step
    kv_bytes_per_token: float  # keys and values of one token, every layer
    allreduce_bytes_per_token: float  # one all-reduce's payload per token (0 without tensor parallelism)
    allreduces_per_step: int
    layers: int
    tp: int

    @classmethod
    def of(cls, config: ModelConfig, dtype_bytes: int, kv_dtype_bytes: int, tp: int = 1) -> StepCost:
        """The cost of ``config``'s shape with weights of ``dtype_bytes`` and a KV cache of ``kv_dtype_bytes``
        per value, split Megatron-style across ``tp`` ranks (heads and MLP columns; KV heads replicated when
        there are fewer than ranks, as the engine does)."""
        h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
        q, kv = config.num_heads * d, config.num_kv_heads * d
        layer = (q + 2 * kv) * h + q * h + 3 * inter * h
        kv_heads_per_rank = max(config.num_kv_heads // tp, 1)
        lm_head = config.vocab_size * h  # the embedding table is read only at the step's rows: left out
        return cls(linear_flops_per_token=2 * config.num_layers * layer / tp,
                   lm_head_flops_per_row=2 * lm_head / tp,
                   attention_flops_per_query_key=4 * config.num_layers * config.num_heads * d / tp,
                   weight_bytes=dtype_bytes * (config.num_layers * layer + lm_head) / tp,
                   kv_bytes_per_token=2 * config.num_layers * kv_heads_per_rank * d * kv_dtype_bytes,
                   allreduce_bytes_per_token=h * dtype_bytes if tp > 1 else 0,
                   allreduces_per_step=2 * config.num_layers if tp > 1 else 0, layers=config.num_layers, tp=tp)


def kv_bytes(cost: StepCost, work: StepWork, reuse: float) -> float:
    """Bytes of KV cache a step moves: every cached token its sequences read, less the ``reuse`` share of the reads
    of blocks another of them reads too (``StepProfile.kv_cache_reuse``), and its new tokens written."""
    return cost.kv_bytes_per_token * (work.kv_read_tokens - reuse * work.shared_kv_tokens + work.tokens)


@dataclass(frozen=True)
class StepWork:
    """What one step does, summed over its sequences."""

    sequences: int
    tokens: int
    sampled_rows: int
    query_keys: float  # query-key pairs attention computes (causal within a chunk)
    kv_read_tokens: int  # tokens of KV cache attention reads
    decode_only: bool  # every sequence computes one token: a step the engine can replay whole
    shared_kv_tokens: int = 0  # of those, the ones another sequence of the step reads too (past the first reader)

    @classmethod
    def of(cls, query_lens: list[int], context_lens: list[int], sampled_rows: int, shared_tokens: int = 0) -> StepWork:
        """The work of a step over these sequences, of whose cached tokens ``shared_tokens`` are held by another of
        them too (``Batch.shared_kv_tokens``)."""
        # Query j of a chunk of q new tokens sees the c - q cached tokens and j + 1 of its own: c - (q - 1) / 2
        # keys on average.
        pairs = sum(q * (c - (q - 1) / 2) for q, c in zip(query_lens, context_lens))
        tokens = sum(query_lens)
        return cls(len(query_lens), tokens, sampled_rows, pairs, sum(context_lens), tokens == len(query_lens),
                   shared_tokens)


class StepTimeModel:
    """Seconds of a step of one model on one device profile."""

    def __init__(self, profile: StepProfile, cost: StepCost) -> None:
        self.profile, self.cost = profile, cost
        self._flops_per_s = profile.peak_flops * profile.compute_efficiency
        self._whole_flops_per_s = profile.peak_flops * (profile.whole_step_compute_efficiency
                                                        or profile.compute_efficiency)
        self._attention_flops_per_s = (profile.peak_flops * profile.attention_compute_efficiency
                                       if profile.attention_compute_efficiency else None)
        self._bytes_per_s = profile.bandwidth * profile.memory_efficiency

    def seconds(self, query_lens: list[int], context_lens: list[int], sampled_rows: int, shared_tokens: int = 0) -> float:
        """The modelled time of a step over these sequences (``Batch.query_lens`` and ``context_lens``; ``StepWork.of``
        says what ``shared_tokens`` are)."""
        if not query_lens:
            return 0.0
        return self.seconds_of(StepWork.of(query_lens, context_lens, sampled_rows, shared_tokens))

    def seconds_of(self, work: StepWork) -> float:
        p = self.profile
        device = sum(self.parts(work))
        launches = 0.0 if p.runs_whole(work.tokens, work.decode_only) else p.per_layer_launch_s * self.cost.layers
        busy = max(device, launches) if p.launches_overlap else device + launches
        return p.step_overhead_s + p.per_sequence_s * work.sequences + busy

    def parts(self, work: StepWork) -> tuple[float, float, float]:
        """(linear layers, attention, all-reduces) of a step, each at its roofline plus the share of its shorter
        time the profile does not hide (``memory_overlap``)."""
        c, bw = self.cost, self._bytes_per_s
        flops = self._whole_flops_per_s if self.profile.runs_whole(work.tokens, work.decode_only) else self._flops_per_s
        linear = self._part((c.linear_flops_per_token * work.tokens + c.lm_head_flops_per_row * work.sampled_rows) / flops,
                            c.weight_bytes / bw)
        attention = self._part(c.attention_flops_per_query_key * work.query_keys / (self._attention_flops_per_s or flops),
                               kv_bytes(c, work, self.profile.kv_cache_reuse) / bw)
        allreduce = 0.0
        if c.allreduces_per_step:  # ring all-reduce: each rank sends and receives 2 (tp - 1) / tp of the payload
            payload = c.allreduce_bytes_per_token * work.tokens * 2 * (c.tp - 1) / c.tp
            allreduce = c.allreduces_per_step * (self.profile.allreduce_latency_s
                                                 + payload / self.profile.interconnect_bandwidth)
        return linear, attention, allreduce

    def _part(self, flops_s: float, bytes_s: float) -> float:
        return part_seconds(flops_s, bytes_s, self.profile.memory_overlap)


def part_seconds(flops_s, bytes_s, overlap: float, maximum=max, minimum=min):
    """A part's time from its FLOPs' and its bytes': the longer, and the share of the shorter ``overlap`` does not
    hide. On plain numbers, or on arrays given numpy's ``maximum`` and ``minimum`` (the fit's grid)."""
    return maximum(flops_s, bytes_s) + (1 - overlap) * minimum(flops_s, bytes_s)
