"""The paged attention kernels read the cache in place and agree with plain softmax attention over each
sequence's gathered blocks. Decode: the C kernel (CPU, built here), the Triton kernel (CUDA, run on CPU
under Triton's interpreter) and the pure-torch gather path. Prefill: the C causal kernel against the
pure-torch SDPA path, with and without cached prefixes."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernel is decorated: run on CPU tensors

from backends.native import cpu_attention  # noqa: E402
from backends.native.attention import _decode_attention, _prefill_attention  # noqa: E402
from backends.native.batch import AttentionMetadata, Batch  # noqa: E402
from backends.native.config import ModelConfig  # noqa: E402
from backends.native.layer_ops import CpuLayerOps, TorchLayerOps  # noqa: E402
from backends.native.model_runner import Kernels, choose_kernels  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None and (
    os.environ["TRITON_INTERPRET"] == "1" or torch.cuda.is_available())
BLOCK_SIZE, NUM_BLOCKS = 16, 64
LAYOUTS = [(4, 4, 32), (9, 3, 64), (8, 2, 128), (16, 1, 64)]  # (query heads, KV heads, head_dim)


def triton_kernel(*args):
    from backends.native.triton_attention import paged_decode_attention

    return paged_decode_attention(*args)


def torch_path(q, k_cache, v_cache, tables, lens, scale):
    """The gather path, driven through the same metadata the model runner builds."""
    tables_list = [t[: (n + BLOCK_SIZE - 1) // BLOCK_SIZE].tolist() for t, n in zip(tables, lens.tolist())]
    order = sorted(range(len(tables_list)), key=lambda i: -lens[i])  # decodes come longest first
    batch = Batch([0] * len(order), [0] * len(order), [0] * len(order), [1] * len(order),
                  [int(lens[i]) for i in order], [tables_list[i] for i in order], [True] * len(order))
    meta = AttentionMetadata.build(batch, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    out = torch.empty_like(q)
    out[order] = _decode_attention(q[order], k_cache, v_cache, meta, scale)
    return out


KERNELS = {
    "c-cpu": cpu_attention.paged_decode_attention,
    "triton": pytest.param(triton_kernel, marks=pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed")),
    "torch-gather": torch_path,
}


def reference(q, k_cache, v_cache, tables, lens, scale):
    hkv, _, bs, d = k_cache.shape
    out = []
    for i, ctx in enumerate(lens.tolist()):
        blocks = tables[i, : (ctx + bs - 1) // bs]
        k = k_cache[:, blocks].reshape(hkv, -1, d)[:, :ctx].float()
        v = v_cache[:, blocks].reshape(hkv, -1, d)[:, :ctx].float()
        group = q.shape[1] // hkv
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        probs = torch.softmax((q[i].float()[:, None, :] @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)
        out.append((probs[:, None, :] @ v).squeeze(1))
    return torch.stack(out)


def paged_inputs(hq, hkv, d, dtype=torch.float32):
    torch.manual_seed(0)
    lens = torch.tensor([1, 15, 16, 17, 100, 16 * BLOCK_SIZE + 5])  # ragged; the last spans two Triton splits
    max_blocks = (int(lens.max()) + BLOCK_SIZE - 1) // BLOCK_SIZE
    k_cache = torch.randn(hkv, NUM_BLOCKS, BLOCK_SIZE, d).to(dtype)
    v_cache = torch.randn(hkv, NUM_BLOCKS, BLOCK_SIZE, d).to(dtype)
    tables = torch.stack([torch.randperm(NUM_BLOCKS)[:max_blocks] for _ in lens])  # scattered blocks
    q = torch.randn(len(lens), hq, d).to(dtype)
    return q, k_cache, v_cache, tables, lens, d ** -0.5


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("hq, hkv, d", LAYOUTS)
def test_kernels_match_softmax_attention_over_the_paged_cache(kernel, hq, hkv, d):
    args = paged_inputs(hq, hkv, d)
    got = kernel(*args)
    assert got.shape == args[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq, hkv, d", LAYOUTS)
def test_c_kernel_reads_bf16_caches_and_answers_in_bf16(hq, hkv, d):
    args = paged_inputs(hq, hkv, d, torch.bfloat16)
    got = cpu_attention.paged_decode_attention(*args)
    assert got.dtype == torch.bfloat16
    # fp32 arithmetic on bf16 inputs: only the final rounding to bf16 separates it from the reference.
    torch.testing.assert_close(got.float(), reference(*args), atol=1e-2, rtol=1e-2)


def prefill_inputs(hq, hkv, d, dtype=torch.float32):
    """Prefill chunks of several lengths, some after a cached prefix, over scattered blocks; q is a strided
    view (as the model's fused q/k rotation leaves it)."""
    torch.manual_seed(0)
    chunks = [(0, 1), (0, 16), (0, 70), (5, 11), (32, 40), (100, 3), (0, 200)]  # (cached prefix, new tokens)
    k_cache = torch.randn(hkv, NUM_BLOCKS * 2, BLOCK_SIZE, d).to(dtype)
    v_cache = torch.randn(hkv, NUM_BLOCKS * 2, BLOCK_SIZE, d).to(dtype)
    need = [(p + n + BLOCK_SIZE - 1) // BLOCK_SIZE for p, n in chunks]
    order = torch.randperm(NUM_BLOCKS * 2).tolist()
    tables = torch.zeros(len(chunks), max(need), dtype=torch.int64)
    for i, k in enumerate(need):
        tables[i, :k] = torch.tensor(order[sum(need[:i]):sum(need[:i]) + k])
    lens = torch.tensor([n for _, n in chunks])
    starts = torch.cumsum(lens, 0) - lens
    context = torch.tensor([p + n for p, n in chunks])
    q = torch.randn(int(lens.sum()), hq + hkv, d).to(dtype)[:, :hq]  # strided rows
    return q, k_cache, v_cache, tables, starts, lens, context, d ** -0.5


def sdpa_prefill(q, k_cache, v_cache, tables, starts, lens, context, scale):
    hkv, _, bs, d = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype)
    for i in range(len(lens)):
        rows = slice(int(starts[i]), int(starts[i] + lens[i]))
        blocks = tables[i, : (int(context[i]) + bs - 1) // bs]
        keys = k_cache[:, blocks].reshape(hkv, -1, d)[:, : int(context[i])]
        values = v_cache[:, blocks].reshape(hkv, -1, d)[:, : int(context[i])]
        out[rows] = _prefill_attention(q[rows].transpose(0, 1), keys, values, scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("hq, hkv, d", LAYOUTS)
def test_c_prefill_kernel_matches_causal_sdpa_with_and_without_cached_prefixes(hq, hkv, d):
    args = prefill_inputs(hq, hkv, d)
    got = cpu_attention.paged_prefill_attention(*args)
    assert got.shape == args[0].shape and got.is_contiguous()
    torch.testing.assert_close(got, sdpa_prefill(*args), atol=1e-5, rtol=1e-5)


def test_c_prefill_kernel_reads_bf16_caches():
    args = prefill_inputs(9, 3, 64, torch.bfloat16)
    got = cpu_attention.paged_prefill_attention(*args)
    assert got.dtype == torch.bfloat16
    expected = sdpa_prefill(args[0].float(), args[1].float(), args[2].float(), *args[3:])
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)


def test_c_kernel_refuses_layouts_beyond_its_buffers():
    assert cpu_attention.supports(torch.float32, 9, 3, 64, 16)
    assert not cpu_attention.supports(torch.float32, 32, 1, 64, 16)  # 32 query heads per KV head
    assert not cpu_attention.supports(torch.float32, 8, 8, 512, 16)  # head_dim 512
    assert not cpu_attention.supports(torch.float16, 9, 3, 64, 16)  # a storage type it does not read
    _, k_cache, v_cache, tables, lens, scale = paged_inputs(1, 1, 32)
    with pytest.raises(ValueError, match="unsupported layout"):
        cpu_attention.paged_decode_attention(torch.randn(len(lens), 32, 32), k_cache, v_cache, tables, lens, scale)


def _tiny_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    return ModelConfig(**{**fields, **overrides})


def test_kernels_are_chosen_by_config_and_device():
    cfg, cpu = _tiny_config(), torch.device("cpu")
    assert choose_kernels("auto", cfg, torch.float32, cpu, 16) == Kernels(True, True, CpuLayerOps)
    assert choose_kernels("auto", cfg, torch.bfloat16, cpu, 16) == Kernels(True, True, CpuLayerOps)
    assert choose_kernels("auto", cfg, torch.float16, cpu, 16) == Kernels(False, False, TorchLayerOps)
    # Triton decodes on CUDA
    assert choose_kernels("auto", cfg, torch.float32, torch.device("cuda"), 16) == Kernels(True, False, TorchLayerOps)
    assert choose_kernels("torch", cfg, torch.float32, cpu, 16) == Kernels(False, False, TorchLayerOps)
    with pytest.raises(ValueError, match="unknown kernels"):
        choose_kernels("flash", cfg, torch.float32, cpu, 16)
