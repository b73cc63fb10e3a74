"""Which GPU, and how many: the native engine's memory and speed on a GPU type, before anyone rents one.

For a model (its config only), a dtype, a GPU type from ``GPUS`` (datasheet memory, bandwidth and bf16
dense peak) and a tensor-parallel size: the weights each GPU holds, the KV bytes per token, how many
tokens and sequences of a shape the KV cache holds (with the engine's own formula,
``model_runner.kv_cache_blocks``), and a roofline estimate of decode speed. With no size given, the
smallest one that fits. The estimate is a ceiling: a decode step cannot be faster than reading its
weights and KV cache once at the datasheet bandwidth, or computing at the datasheet peak; all-reduce
traffic between GPUs is left out.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from backends.native.config import DTYPE_NAMES, ModelConfig, torch_dtype_named
from backends.native.gpus import GPU, GPUS
from backends.native.model_runner import kv_bytes_per_block, kv_cache_blocks, local_config
from backends.native.parallel import can_split, check_tensor_parallel

TP_SIZES = (1, 2, 4, 8)
CUDA_CONTEXT_BYTES = 1 << 30  # CUDA context, cuBLAS workspaces, graph pools: what profiling finds beyond torch


def layer_parameters(config: ModelConfig, tp: int) -> int:
    """Parameters of one decoder layer that one of ``tp`` GPUs holds."""
    local = local_config(config, tp)
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size // tp
    q, kv = local.num_heads * d, local.num_kv_heads * d
    bias = q + 2 * kv if config.attention_bias else 0
    return (q + 2 * kv) * h + bias + h * q + 3 * inter * h + 2 * h


def weight_bytes_per_gpu(config: ModelConfig, dtype: torch.dtype, tp: int, layers: int | None = None,
                         first: bool = True, last: bool = True) -> int:
    """Bytes of the weights one of ``tp`` GPUs of a pipeline stage of ``layers`` layers (default: the whole model)
    holds: its shards, the replicated parts whole, the embedding rows on the first stage, the norm and LM head
    rows on the last (a tied head's own copy of the table unless the stage is both)."""
    h = config.hidden_size
    tables = (first + last) if not (first and last) else (1 if config.tie_word_embeddings else 2)
    vocab = -(-config.vocab_size // tp) * h * tables
    layers = config.num_layers if layers is None else layers
    return dtype.itemsize * (vocab + layers * layer_parameters(config, tp) + (h if last else 0))


def activation_bytes(config: ModelConfig, dtype: torch.dtype, tp: int, max_num_batched_tokens: int,
                     max_num_seqs: int) -> int:
    """An estimate of a step's peak activations at the full token budget (the engine measures it instead)."""
    local = local_config(config, tp)
    width = (local.num_heads + 2 * local.num_kv_heads) * config.head_dim + 2 * (config.intermediate_size // tp)
    return max_num_batched_tokens * (width + 4 * config.hidden_size) * dtype.itemsize + \
        max_num_seqs * config.vocab_size * 4


def gpu_kv_budget_bytes(config: ModelConfig, memory_bytes: int, dtype: torch.dtype, tp: int, utilization: float,
                        max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The KV-cache bytes one of ``tp`` GPUs of ``memory_bytes`` keeps: its share ``utilization`` less the weights,
    a step's peak activations and the CUDA context (the engine measures these where it runs; this predicts them)."""
    reserve = activation_bytes(config, dtype, tp, max_num_batched_tokens, max_num_seqs) + CUDA_CONTEXT_BYTES
    return int(memory_bytes * utilization) - weight_bytes_per_gpu(config, dtype, tp) - reserve


@dataclass
class Plan:
    gpu: str
    tensor_parallel_size: int
    fits: bool
    weights_per_gpu_gib: float
    kv_bytes_per_token_per_gpu: int
    kv_tokens: int
    sequences: int  # of (input_len + output_len) tokens held in the KV cache at once
    decode_tok_s_batch_1: float
    decode_tok_s_at_sequences: float
    why: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def plan(config: ModelConfig, gpu_name: str, dtype: str = "bfloat16", tensor_parallel_size: int | None = None,
         input_len: int = 512, output_len: int = 128, gpu_memory_utilization: float = 0.9, block_size: int = 16,
         max_num_batched_tokens: int = 2048, max_num_seqs: int = 256) -> Plan:
    """The plan at ``tensor_parallel_size``, or at the smallest size that fits when it is None."""
    if gpu_name not in GPUS:
        raise ValueError(f"unknown GPU {gpu_name!r}; choose one of {', '.join(GPUS)}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
    if tensor_parallel_size is not None:
        check_tensor_parallel(config, tensor_parallel_size)
        return _plan_at(config, GPUS[gpu_name], gpu_name, torch_dtype_named(dtype), tensor_parallel_size, input_len, output_len,
                        gpu_memory_utilization, block_size, max_num_batched_tokens, max_num_seqs)
    plans = []
    for tp in filter(functools.partial(can_split, config), TP_SIZES):
        plans.append(_plan_at(config, GPUS[gpu_name], gpu_name, torch_dtype_named(dtype), tp, input_len, output_len,
                              gpu_memory_utilization, block_size, max_num_batched_tokens, max_num_seqs))
        if plans[-1].fits:
            break
    return plans[-1]


def _plan_at(config: ModelConfig, gpu: GPU, gpu_name: str, dtype: torch.dtype, tp: int, input_len: int,
             output_len: int, utilization: float, block_size: int, max_num_batched_tokens: int,
             max_num_seqs: int) -> Plan:
    weights = weight_bytes_per_gpu(config, dtype, tp)
    reserve = activation_bytes(config, dtype, tp, max_num_batched_tokens, max_num_seqs) + CUDA_CONTEXT_BYTES
    budget = gpu_kv_budget_bytes(config, int(gpu.memory_gib * 2**30), dtype, tp, utilization, max_num_batched_tokens,
                                 max_num_seqs)
    blocks = kv_cache_blocks(config, block_size, dtype, budget, tp)
    per_sequence = -(-(input_len + output_len) // block_size)
    sequences = blocks // per_sequence
    kv_per_token = kv_bytes_per_block(config, block_size, dtype, tp) // block_size
    why = "" if sequences else (f"{weights / 2**30:.1f} GiB of weights and {reserve / 2**30:.1f} GiB of activations "
                                f"per GPU leave no room for one sequence in {gpu.memory_gib:g} GiB x {utilization}")

    def decode_tok_s(batch: int) -> float:
        if batch == 0:
            return 0.0
        context = input_len + output_len // 2  # the average decode step
        seconds = max((weights + batch * context * kv_per_token) / (gpu.bandwidth_gbs * 1e9),
                      2 * weights / dtype.itemsize * batch / (gpu.bf16_tflops * 1e12))
        return batch / seconds

    return Plan(gpu_name, tp, sequences > 0, weights / 2**30, kv_per_token, blocks * block_size, sequences,
                decode_tok_s(1 if sequences else 0), decode_tok_s(min(sequences, max_num_seqs)), why)
