"""Every attention backend computes the same causal attention over the paged cache as plain softmax
attention in fp64: a step mixing decodes and prefill chunks, with and without cached prefixes, over
scattered blocks, in every supported head layout. The Triton backend runs on CPU under Triton's
interpreter (and on a GPU where there is one)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the Triton kernel is decorated: run it on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from backends.native.attention import Kernels, choose_kernels
from backends.native.attention.cpu_attention import CpuAttention
from backends.native.attention.torch_attention import TorchAttention
from backends.native.batch import Batch
from backends.native.config import ModelConfig
from backends.native.layer_ops import CpuLayerOps, TorchLayerOps

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None and (INTERPRETED or torch.cuda.is_available())
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
BLOCK_SIZE, NUM_BLOCKS = 16, 96
LAYOUTS = [(4, 4, 32), (9, 3, 64), (8, 2, 128), (40, 8, 128)]  # (query heads, KV heads, head_dim)
# (cached tokens, new tokens) per sequence: decodes first (longest context first), then prefill chunks
STEP = [(300, 1), (100, 1), (16, 1), (0, 1), (0, 16), (0, 70), (5, 11), (32, 40), (100, 3)]


def triton_backend(*args):
    from backends.native.attention.triton_attention import TritonAttention

    return TritonAttention(*args)


def c_with_vector_prefill(*args):
    return CpuAttention(*args, amx_prefill=False)


CPU_ONLY = (CpuAttention, c_with_vector_prefill)
BACKENDS = {
    "torch": TorchAttention,
    "c-cpu": CpuAttention,
    "c-cpu-vector-prefill": c_with_vector_prefill,
    "triton": pytest.param(triton_backend, marks=pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed")),
}


def make_step(hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device, block_size: int = BLOCK_SIZE):
    """A batch over random caches whose blocks are scattered; this step's keys/values already stored."""
    torch.manual_seed(0)
    num_blocks = NUM_BLOCKS * BLOCK_SIZE // block_size
    k_cache = torch.randn(hkv, num_blocks + 1, block_size, d).to(dtype)
    v_cache = torch.randn(hkv, num_blocks + 1, block_size, d).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    tables, slots, positions = [], [], []
    for cached, new in STEP:
        need = -(-(cached + new) // block_size)
        tables.append([free.pop() for _ in range(need)])
        for p in range(cached, cached + new):
            slots.append(tables[-1][p // block_size] * block_size + p % block_size)
            positions.append(p)
    batch = Batch([0] * len(slots), positions, slots, [n for _, n in STEP], [c + n for c, n in STEP], tables,
                  [True] * len(STEP))
    flat = torch.tensor(slots)
    k = k_cache.view(hkv, -1, d)[:, flat].transpose(0, 1)
    v = v_cache.view(hkv, -1, d)[:, flat].transpose(0, 1)
    q = torch.randn(len(slots), hq + hkv, d).to(dtype)[:, :hq]  # a strided view, as the layer ops leave it
    return [t.to(device) for t in (q, k, v, k_cache, v_cache)], batch


def reference(q, k_cache, v_cache, batch: Batch, scale: float) -> torch.Tensor:
    hkv, _, _, d = k_cache.shape
    group = q.shape[1] // hkv
    out, start = [], 0
    for n, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
        keys = k_cache[:, table].reshape(hkv, -1, d)[:, :ctx].double().repeat_interleave(group, 0)
        values = v_cache[:, table].reshape(hkv, -1, d)[:, :ctx].double().repeat_interleave(group, 0)
        scores = q[start:start + n].double().transpose(0, 1) @ keys.transpose(1, 2) * scale  # [Hq, n, ctx]
        visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append((probs @ values).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("make_backend", BACKENDS.values(), ids=BACKENDS.keys())
@pytest.mark.parametrize("hq, hkv, d", LAYOUTS)
def test_a_mixed_step_matches_causal_softmax_attention(make_backend, hq, hkv, d):
    device = DEVICE if make_backend not in CPU_ONLY else torch.device("cpu")
    (q, k, v, k_cache, v_cache), batch = make_step(hq, hkv, d, torch.float32, device)
    backend = make_backend(BLOCK_SIZE, NUM_BLOCKS, device)
    meta = backend.build(batch)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, d ** -0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    expected = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), batch, d ** -0.5)
    torch.testing.assert_close(got.cpu().double(), expected, atol=2e-5, rtol=2e-5)
    last_rows = torch.tensor([n for _, n in STEP]).cumsum(0) - 1  # each sequence samples from its last token
    assert meta.logits_indices.tolist() == last_rows.tolist()


@pytest.mark.parametrize("hq, hkv, d", [(10, 2, 40), (9, 3, 64), (6, 2, 38)])
@pytest.mark.parametrize("block_size", [1, 4, 24, 64])
def test_the_c_kernels_take_any_block_size_and_head_size(block_size, hq, hkv, d):
    # Their prefill walks keys 32 at a time across blocks and their outputs 4 (AVX-512; 2 otherwise) columns
    # at a time; decode with AVX-512 scores 16 keys per vector where the head size is a multiple of 32: blocks
    # smaller than, not a multiple of, or larger than 16 keys, head sizes that are not a multiple of 16 (40)
    # or of 4 (38)
    (q, k, v, k_cache, v_cache), batch = make_step(hq, hkv, d, torch.float32, torch.device("cpu"), block_size)
    backend = CpuAttention(block_size, k_cache.shape[1], torch.device("cpu"))
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build(batch), d ** -0.5)
    expected = reference(q, k_cache, v_cache, batch, d ** -0.5)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("make_backend", CPU_ONLY, ids=["c-cpu", "c-cpu-vector-prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 32), (9, 3, 64), (8, 2, 128)])
def test_scores_hundreds_apart_give_the_softmax_answer(make_backend, dtype, hq, hkv, d):
    # Real layers have keys that score hundreds above the rest (attention sinks): probabilities of e^-100 and
    # below, whose products with values would be denormals, count as 0 (the C prefill kernel flushes them);
    # the tile kernel raises its running maxima by jumps of more than 8 mid-prompt, with its output in tiles
    # (head sizes 32, 64) or in memory (128)
    (q, k, v, k_cache, v_cache), batch = make_step(hq, hkv, d, dtype, torch.device("cpu"))
    q = q * 40
    backend = make_backend(BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build(batch), d ** -0.5)
    expected = reference(q, k_cache, v_cache, batch, d ** -0.5)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # fp32 scores of ~100 carry rounding of ~1e-5
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("make_backend", [TorchAttention, *CPU_ONLY], ids=["torch", "c-cpu", "c-cpu-vector-prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 32), (9, 3, 64), (8, 2, 128)])
def test_a_late_key_scoring_hundreds_above_the_rest_takes_the_attention(make_backend, dtype, hq, hkv, d):
    # The tile decode kernel keeps a head's running maximum from its first keys until a later step's
    # probabilities could pass e^8: a key 200 above every earlier one, near the end of a 301-token context, must
    # raise it (e^200 overflows fp32) and leave the head attending to that key alone
    (q, k, v, k_cache, v_cache), batch = make_step(hq, hkv, d, dtype, torch.device("cpu"))
    scale, position = d ** -0.5, 290  # in the first sequence, a decode at position 300
    block, offset = batch.block_tables[0][position // BLOCK_SIZE], position % BLOCK_SIZE
    for h in range(hkv):  # the key of each KV head scores 200 against the group's first query head
        head = q[0, h * (hq // hkv)].float()
        k_cache[h, block, offset] = (head * (200 / scale / head.dot(head))).to(dtype)
    backend = make_backend(BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build(batch), scale)
    expected = reference(q, k_cache, v_cache, batch, scale)
    torch.testing.assert_close(expected[0, 0], v_cache[0, block, offset].double())  # the premise
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("make_backend", [CpuAttention, c_with_vector_prefill, pytest.param(
    triton_backend, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton runs on a GPU"))],
    ids=["c-cpu", "c-cpu-vector-prefill", "triton"])
@pytest.mark.parametrize("hq, hkv, d", LAYOUTS)
@pytest.mark.parametrize("block_size", [16, 24, 64])
def test_bf16_caches_give_bf16_answers_within_rounding(make_backend, hq, hkv, d, block_size):
    # On a CPU with AMX tiles the C decode kernel multiplies bf16 caches on the tiles where blocks hold a
    # multiple of 16 keys (16, 64: groups of 1 to 5 query heads, last steps of 1, 5, 13 and 17 of their 32
    # keys, the output in tiles at head sizes 32 and 64 and in memory at 128) and on vectors otherwise (24),
    # and prefill chunks run on the tiles (16 query rows, tokens x heads, per tile: a group of 3 splits a
    # token's heads between tiles; with and without cached prefixes, any block size) unless the vector kernel
    # is asked for; elsewhere on vectors
    device = DEVICE if make_backend not in CPU_ONLY else torch.device("cpu")
    (q, k, v, k_cache, v_cache), batch = make_step(hq, hkv, d, torch.bfloat16, device, block_size)
    backend = make_backend(block_size, k_cache.shape[1] - 1, device)
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build(batch), d ** -0.5)
    assert got.dtype == torch.bfloat16
    expected = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), batch, d ** -0.5)
    torch.testing.assert_close(got.cpu().double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("make_backend", [TorchAttention, *CPU_ONLY], ids=["torch", "c-cpu", "c-cpu-vector-prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("hq, hkv, d, block_size", [(9, 3, 64, 16), (8, 2, 128, 64), (10, 2, 40, 24)])
def test_fp8_caches_give_the_attention_of_the_values_they_hold(make_backend, dtype, cache_dtype, hq, hkv, d,
                                                                block_size):
    # kv_cache_dtype fp8: every path reads the one-byte caches as the values they hold (widened exactly: to bf16
    # for the decode tiles and the prefill tile kernel, to fp32 on vectors, on the scalar path for the tail of a
    # head size of 40); so the answer is that of those values in fp64, within the activations' rounding. This
    # step's fresh keys arrive in the activations' type, and prefill chunks attend to the cache's rounding of them
    (q, k, v, k_cache, v_cache), batch = make_step(hq, hkv, d, cache_dtype, torch.device("cpu"), block_size)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    backend = make_backend(block_size, k_cache.shape[1] - 1, torch.device("cpu"))
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build(batch), d ** -0.5)
    assert got.dtype == dtype
    expected = reference(q, k_cache.float(), v_cache.float(), batch, d ** -0.5)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


def _tiny_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    return ModelConfig(**{**fields, **overrides})


def _chosen(kernels: Kernels) -> tuple[str, type]:
    return type(kernels.attention).__name__, kernels.layer_ops


def test_kernels_are_chosen_by_config_and_device():
    cfg, cpu = _tiny_config(), torch.device("cpu")
    assert _chosen(choose_kernels("auto", cfg, torch.float32, cpu, 16, 8)) == ("CpuAttention", CpuLayerOps)
    assert _chosen(choose_kernels("auto", cfg, torch.bfloat16, cpu, 16, 8)) == ("CpuAttention", CpuLayerOps)
    assert _chosen(choose_kernels("auto", cfg, torch.float16, cpu, 16, 8)) == ("TorchAttention", TorchLayerOps)
    # 32 query heads per KV head: beyond the C attention kernel, the C layer ops still run
    wide = _tiny_config(num_heads=32, num_kv_heads=1)
    assert _chosen(choose_kernels("auto", wide, torch.float32, cpu, 16, 8)) == ("TorchAttention", CpuLayerOps)
    if HAS_TRITON:  # Triton on CUDA, for every layout with a power-of-two head size
        from backends.native.triton_layer_ops import TritonLayerOps

        cuda = torch.device("cuda")
        assert _chosen(choose_kernels("auto", cfg, torch.float32, cuda, 16, 8)) == ("TritonAttention", TritonLayerOps)
        odd = _tiny_config(hidden_size=96, num_heads=4, head_dim=24)
        assert _chosen(choose_kernels("auto", odd, torch.float32, cuda, 16, 8)) == ("TorchAttention", TorchLayerOps)
        assert _chosen(choose_kernels("torch", cfg, torch.float32, cuda, 16, 8)) == ("TorchAttention", TorchLayerOps)
    assert _chosen(choose_kernels("torch", cfg, torch.float32, cpu, 16, 8)) == ("TorchAttention", TorchLayerOps)
    with pytest.raises(ValueError, match="unknown kernels"):
        choose_kernels("flash", cfg, torch.float32, cpu, 16, 8)
