"""How to split a model over a number of GPUs: tensor x pipeline parallel x replicas, chosen per interconnect.

For a burst of requests (the seed study's by default: 1,000 prompts of 512 tokens, a fixed output, all sent at
once) on ``gpus`` GPUs of a type, every layout the model allows (tp x pp GPUs a replica, as many replicas as the
GPUs hold) is estimated from first principles, as the engine runs it:

- a step of a stage takes the longer of its compute (linear layers, attention, the LM head's sampled rows at the
  GPU's bf16 peak) and its memory traffic (its weights and the KV cache it reads at the GPU's bandwidth), plus
  its tensor-parallel collectives (two all-reduces a layer, the embedding's, the logits' gather) and, between
  stages, the send of the hidden states and residual stream, each at the link's rate (gpus.INTERCONNECTS; a link
  between nodes where a replica crosses one);
- prefill runs the prompts in chunks of ``max_num_batched_tokens``, which flow through the stages; decode runs
  the sequences the KV cache holds in ``pp`` batches in flight (workers.py), a round giving every sequence one
  token in the longer of one batch's way through every stage and the busiest stage's work on all batches: when
  there are fewer batches than stages, stages wait (the bubble);
- the burst is the prompts' prefill, then waves of decoding as the KV cache frees room.

It is a ceiling, as planner.py's rooflines are, and it leaves out what the native engine's profiles measure per
GPU (backends/sim): what it is for is the comparison between layouts, whose differences are the interconnect's.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from backends.native.config import ModelConfig, torch_dtype_named
from backends.native.gpus import GPU, GPUS, INTERCONNECTS, Interconnect
from backends.native.model_runner import kv_bytes_per_block
from backends.native.parallel import can_split, stage_layers
from backends.native.planner import CUDA_CONTEXT_BYTES, activation_bytes, layer_parameters, weight_bytes_per_gpu


@dataclass(frozen=True)
class Burst:
    """The traffic a layout is judged on, and the engine's limits."""

    requests: int = 1000
    input_len: int = 512
    output_len: int = 128
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048


@dataclass
class Layout:
    """One way to run a model on the GPUs, and what the burst costs on it."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    replicas: int
    nodes_per_replica: int
    fits: bool
    sequences: int  # running at once in one replica (KV cache, max_num_seqs, its share of the requests)
    weights_per_gpu_gib: float  # the heaviest stage's
    prefill_s: float
    decode_s: float
    burst_s: float
    output_tok_s: float
    all_reduce_s: float  # of burst_s: the tensor-parallel collectives on the critical path
    send_s: float  # of burst_s: stage-to-stage sends
    bubble_s: float  # of burst_s: the time a stage waits for the others (decode rounds with fewer batches than stages)
    why: str = ""

    @property
    def name(self) -> str:
        return f"TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size} x {self.replicas}"

    def as_dict(self) -> dict:
        return {**asdict(self), "name": self.name}


@dataclass
class SplitPlan:
    """Every layout of a model on the GPUs, fastest first, and the one recommended with its reason."""

    gpu: str
    gpus: int
    interconnect: str
    layouts: list[Layout]
    reason: str

    @property
    def best(self) -> Layout | None:
        return self.layouts[0] if self.layouts and self.layouts[0].fits else None

    def as_dict(self) -> dict:
        return {"gpu": self.gpu, "gpus": self.gpus, "interconnect": self.interconnect, "reason": self.reason,
                "layouts": [layout.as_dict() for layout in self.layouts]}


@dataclass(frozen=True)
class _Stage:
    """A pipeline stage as the estimate sees it: one of its tp GPUs."""

    layers: int
    first: bool
    last: bool
    weight_bytes: int
    kv_per_token: int  # bytes, its layers, this GPU's heads
    send: Interconnect | None  # the link to the next stage (None: the last)


@dataclass
class _Cost:
    seconds: float = 0.0
    all_reduce: float = 0.0
    send: float = 0.0
    bubble: float = 0.0

    def add(self, other: _Cost, times: float = 1.0) -> None:
        self.seconds += other.seconds * times
        self.all_reduce += other.all_reduce * times
        self.send += other.send * times
        self.bubble += other.bubble * times


def plan_split(config: ModelConfig, gpu_name: str, gpus: int, burst: Burst = Burst(), dtype: str = "bfloat16",
               interconnect: str | None = None, network: str = "ib-200g", gpus_per_node: int = 8) -> SplitPlan:
    """Every (tp, pp) layout of ``config`` on ``gpus`` GPUs of ``gpu_name`` joined by ``interconnect`` (default:
    the type's own) within a node of ``gpus_per_node`` and by ``network`` between nodes, fastest burst first."""
    if gpu_name not in GPUS:
        raise ValueError(f"unknown GPU {gpu_name!r}; choose one of {', '.join(GPUS)}")
    gpu = GPUS[gpu_name]
    link_name = interconnect or gpu.interconnect
    for name in (link_name, network):
        if name not in INTERCONNECTS:
            raise ValueError(f"unknown interconnect {name!r}; choose one of {', '.join(INTERCONNECTS)}")
    layouts = []
    for tp in filter(functools.partial(can_split, config), _divisors(gpus)):
        for pp in _divisors(gpus // tp):
            if pp <= config.num_layers:
                layouts.append(_estimate(config, gpu, torch_dtype_named(dtype), tp, pp, gpus // (tp * pp), burst,
                                         INTERCONNECTS[link_name], INTERCONNECTS[network], gpus_per_node))
    if not layouts:
        raise ValueError(f"no tensor-parallel size that divides {gpus} GPUs splits this model")
    layouts.sort(key=lambda l: (not l.fits, l.burst_s))
    return SplitPlan(gpu_name, gpus, link_name, layouts, _reason(layouts, link_name))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _estimate(config: ModelConfig, gpu: GPU, dtype: torch.dtype, tp: int, pp: int, replicas: int, burst: Burst,
              link: Interconnect, network: Interconnect, gpus_per_node: int) -> Layout:
    # Stages fill a node in order (a tensor-parallel group never spans two unless it must); a stage boundary where
    # one node ends sends over the network.
    stages_per_node = max(gpus_per_node // tp, 1)
    tp_link = link if tp <= gpus_per_node else network
    stages = []
    for index, layers in enumerate(stage_layers(config.num_layers, pp)):
        last = index == pp - 1
        crosses = (index + 1) % stages_per_node == 0
        stages.append(_Stage(len(layers), index == 0, last,
                             weight_bytes_per_gpu(config, dtype, tp, len(layers), index == 0, last),
                             kv_bytes_per_block(config, 1, dtype, tp, len(layers)),
                             None if last else network if crosses else link))
    nodes = -(-tp * pp // gpus_per_node)
    per_replica = -(-burst.requests // replicas)
    memory = int(gpu.memory_gib * 2**30 * burst.gpu_memory_utilization)
    reserve = activation_bytes(config, dtype, tp, burst.max_num_batched_tokens, burst.max_num_seqs) + CUDA_CONTEXT_BYTES
    kv_tokens = min((memory - s.weight_bytes - reserve) // s.kv_per_token for s in stages)
    sequences = min(max(kv_tokens, 0) // (burst.input_len + burst.output_len), burst.max_num_seqs, per_replica)
    heaviest = max(s.weight_bytes for s in stages) / 2**30
    if sequences < 1:
        return Layout(tp, pp, replicas, nodes, False, 0, heaviest, 0, 0, 0, 0, 0, 0, 0,
                      f"{heaviest:.1f} GiB of weights on a GPU leave no room for a sequence")
    step = _StepModel(config, gpu, dtype, tp, tp_link, stages)
    prefill = _Cost()
    chunks = -(-per_replica * burst.input_len // burst.max_num_batched_tokens)
    chunk = [step.stage(s, burst.max_num_batched_tokens, burst.input_len / 2, decode=False) for s in stages]
    # chunks stream through the stages: the busiest stage sets the pace, the others fill the pipe once
    busiest = max(chunk, key=lambda c: c.seconds)
    prefill.add(busiest, chunks)
    prefill.seconds += sum(c.seconds for c in chunk) - busiest.seconds
    decode = _Cost()
    left, context = per_replica, burst.input_len + burst.output_len / 2
    while left > 0:  # waves of as many sequences as run at once
        running = min(sequences, left)
        decode.add(step.round(running, context), burst.output_len)
        left -= running
    burst_s = prefill.seconds + decode.seconds
    return Layout(tp, pp, replicas, nodes, True, sequences, heaviest, prefill.seconds, decode.seconds, burst_s,
                  burst.requests * burst.output_len / burst_s, prefill.all_reduce + decode.all_reduce,
                  prefill.send + decode.send, prefill.bubble + decode.bubble)


@dataclass
class _StepModel:
    config: ModelConfig
    gpu: GPU
    dtype: torch.dtype
    tp: int
    tp_link: Interconnect
    stages: list[_Stage]

    def stage(self, s: _Stage, tokens: float, context: float, decode: bool) -> _Cost:
        """One step of ``tokens`` query tokens at an average ``context`` on stage ``s``: decodes (each reads its
        context's KV cache and is sampled), or a prefill chunk (compute-bound; its few sampled rows left out)."""
        sampled = tokens if decode else 0
        cfg, itemsize, h = self.config, self.dtype.itemsize, self.config.hidden_size
        q_width = cfg.num_heads // self.tp * cfg.head_dim
        flops = 2 * tokens * s.layers * (layer_parameters(cfg, self.tp) + 2 * context * q_width)
        if s.last:
            flops += 2 * sampled * -(-cfg.vocab_size // self.tp) * h
        memory = s.weight_bytes + (tokens * context * s.kv_per_token if decode else 0)
        busy = max(flops / (self.gpu.bf16_tflops * 1e12), memory / (self.gpu.bandwidth_gbs * 1e9))
        hidden = tokens * h * itemsize
        all_reduce = (2 * s.layers + s.first) * self.tp_link.all_reduce_s(hidden, self.tp)
        if s.last and self.tp > 1:  # the logits gathered on the first rank: every other rank's fp32 slice into it
            all_reduce += self.tp_link.gather_s(sampled * -(-cfg.vocab_size // self.tp) * 4, self.tp)
        send = s.send.send_s(2 * hidden) if s.send is not None else 0.0  # hidden states and residual stream
        return _Cost(busy + all_reduce + send, all_reduce, send)

    def round(self, sequences: int, context: float) -> _Cost:
        """Every one of ``sequences`` decoding sequences gets a token: ``pp`` batches in flight (fewer if fewer
        sequences), each through every stage, every stage working through every batch."""
        batches = min(len(self.stages), sequences)
        per_batch = [self.stage(s, sequences / batches, context, decode=True) for s in self.stages]
        through = sum(c.seconds for c in per_batch)  # one batch's way through the pipe
        busiest = batches * max(c.seconds for c in per_batch)
        seconds = max(through, busiest)
        work = batches * sum(c.seconds for c in per_batch) / len(self.stages)  # a stage's average busy time
        return _Cost(seconds, batches * sum(c.all_reduce for c in per_batch) / len(self.stages),
                     batches * sum(c.send for c in per_batch) / len(self.stages), seconds - work)


def _reason(layouts: list[Layout], link: str) -> str:
    fitting = [l for l in layouts if l.fits]
    if not fitting:
        return layouts[0].why
    best = fitting[0]
    text = f"{best.name}: the burst in {best.burst_s:,.0f} s ({best.output_tok_s:,.0f} output tok/s)"
    parts = []
    if best.all_reduce_s:
        parts.append(f"{best.all_reduce_s:,.0f} s in all-reduces over {link}")
    if best.send_s or best.bubble_s:
        parts.append(f"{best.send_s:,.1f} s in stage sends and {best.bubble_s:,.0f} s of stages waiting")
    if parts:
        text += ", of which " + " and ".join(parts)
    others = []
    for label, pick in (("tensor only", lambda l: l.pipeline_parallel_size == 1 and l.tensor_parallel_size > 1),
                        ("pipeline only", lambda l: l.tensor_parallel_size == 1 and l.pipeline_parallel_size > 1)):
        rival = next((l for l in fitting if pick(l) and l is not best and l.replicas == best.replicas), None)
        if rival is not None:
            others.append(f"{label}, {rival.name}, takes {rival.burst_s:,.0f} s ({rival.all_reduce_s:,.0f} s "
                          f"all-reduce, {rival.bubble_s:,.0f} s waiting)")
    return text + ("; " + "; ".join(others) if others else "")
