"""The C kernels take the layouts their fixed buffers hold and refuse the rest, by ``supports`` before
use and by a clear error if called anyway (the backends' numbers are checked in test_backends.py)."""

from __future__ import annotations

import pytest
import torch

from backends.native import cpu_kernels
from backends.native.attention import cpu_attention


def test_c_kernels_refuse_layouts_beyond_their_buffers():
    assert cpu_attention.supports(torch.float32, 9, 3, 64, 16)
    assert cpu_attention.supports(torch.bfloat16, 40, 8, 128, 16)
    assert not cpu_attention.supports(torch.float32, 32, 1, 64, 16)  # 32 query heads per KV head
    assert not cpu_attention.supports(torch.float32, 8, 8, 512, 16)  # head_dim 512
    assert not cpu_attention.supports(torch.float16, 9, 3, 64, 16)  # a storage type they do not read
    k_cache = v_cache = torch.zeros(1, 4, 16, 32)
    tables, lens = torch.zeros(2, 1, dtype=torch.int64), torch.tensor([3, 5])
    with pytest.raises(ValueError, match="unsupported layout"):
        cpu_attention.paged_decode_attention(torch.randn(2, 32, 32), k_cache, v_cache, tables, lens, 0.1)


def test_bf16_prefill_on_the_amx_tiles_answers_as_the_vector_kernel_does():
    lib = cpu_kernels.load()
    if lib is None or not lib.prefill_attention_amx_supported(9, 3, 64, 16):
        pytest.skip("no AMX tiles on this CPU (or no C kernels)")
    assert not lib.prefill_attention_amx_supported(10, 2, 40, 16)  # head size not a multiple of 32
    assert not lib.prefill_attention_amx_supported(17, 1, 64, 16)  # more query heads per KV head than a tile's rows
    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(3, 12, 16, 64).bfloat16() for _ in range(2))
    tables = torch.randperm(12)[:10].view(2, 5)
    # a 37-token prompt (tiles of 5 tokens x 3 heads, a partial last one) and 3 tokens after a 60-token prefix
    starts, lens, contexts = torch.tensor([0, 37]), torch.tensor([37, 3]), torch.tensor([37, 63])
    q = torch.randn(40, 9, 64).bfloat16()
    args = (q, k_cache, v_cache, tables, [starts, lens, contexts], 0.125)
    tiles = cpu_attention._run(lib.paged_prefill_attention_amx, *args)  # raises if the kernel refused
    vectors = cpu_attention._run(lib.paged_prefill_attention, *args)
    torch.testing.assert_close(tiles.float(), vectors.float(), atol=2e-2, rtol=2e-2)
    assert lib.paged_prefill_attention_amx(*([0] * 16), 0.1, 0, 0) == 1  # fp32 (is_bf16 0): not its to run
    # scale <= 0 is the vector kernel's to run: the tiles keep their running maxima on unscaled scores
    for scale in (0.0, -0.125):
        with pytest.raises(ValueError, match="unsupported layout"):  # refused on the layout it runs at 0.125
            cpu_attention._run(lib.paged_prefill_attention_amx, *args[:5], scale)
        torch.testing.assert_close(cpu_attention.paged_prefill_attention(q, *args[1:4], *args[4], scale).float(),
                                   cpu_attention._run(lib.paged_prefill_attention, *args[:5], scale).float())


@pytest.mark.parametrize("dtype, amx", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16-vector", "bf16-tiles"])
def test_a_long_prompts_first_keys_keep_their_weight(dtype, amx):
    # Equal scores over 4096 keys, values 1 on the first 32 and 0 after: each query at position p answers
    # 32 / (p + 1). The vector kernel rescales what it has summed at every slice of keys, so a rescale that is
    # not exactly 1 when the maximum stays put would compound over the prompt and shrink the first keys' weight
    # (the tile kernel's first cubic exp had exp(0) = 0.99993: ~1% here, before it raised maxima lazily)
    lib = cpu_kernels.load()
    if lib is None or (amx and not lib.prefill_attention_amx_supported(3, 1, 64, 16)):
        pytest.skip("no AMX tiles on this CPU (or no C kernels)")
    keys, new = 4096, 16
    k_cache = torch.zeros(1, keys // 16, 16, 64, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    v_cache[:, :2] = 1  # blocks 0 and 1: keys 0-31
    tables = torch.arange(keys // 16).view(1, -1)
    q = torch.randn(new, 3, 64).to(dtype)
    out = cpu_attention.paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0]), torch.tensor([new]),
                                                torch.tensor([keys]), 0.125, amx=amx)
    positions = torch.arange(keys - new, keys, dtype=torch.float64)
    expected = (32 / (positions + 1))[:, None, None].expand(new, 3, 64)
    torch.testing.assert_close(out.double(), expected, rtol=4e-3, atol=0)


@pytest.mark.parametrize("head_dim", [64, 128], ids=["output-in-tiles", "output-in-memory"])
@pytest.mark.parametrize("rise, spike", [(0.1, 0.0), (0.7, 0.0), (0.02, 150.0)],
                         ids=["every-few-steps", "every-step", "past-fp32"])
def test_tile_attention_follows_scores_that_rise_past_its_first_maxima(rise, spike, head_dim):
    # Scores grow along the keys (by `rise` per key after scaling): a step's probabilities pass e^8 against the
    # first step's maxima every few steps, or every step (past fp32 by the end); or they grow slowly and key 200
    # stands `spike` above its neighbours (2^216 in the kernel's base 2: past fp32). The tile kernel takes each
    # row's maximum in its first step only, and again, rescaling what it has summed, where a step's
    # probabilities may pass e^8: the answer must be softmax's either way (without the raises the last two cases
    # overflow), with the output in tiles (head size 64) or in memory (128).
    lib = cpu_kernels.load()
    if lib is None or not lib.prefill_attention_amx_supported(3, 1, head_dim, 16):
        pytest.skip("no AMX tiles on this CPU (or no C kernels)")
    torch.manual_seed(1)
    tokens, scale = 300, 0.125
    u = torch.nn.functional.normalize(torch.randn(head_dim), dim=0)
    q = (u / scale + 0.1 * torch.randn(tokens, 3, head_dim)).bfloat16()
    keys = rise * torch.arange(tokens, dtype=torch.float32)
    keys[200] += spike
    k = (keys[:, None] * u + 0.1 * torch.randn(tokens, head_dim)).bfloat16()
    v = torch.randn(tokens, head_dim).bfloat16()
    blocks = (tokens + 15) // 16
    k_cache, v_cache = (torch.zeros(1, blocks * 16, head_dim).bfloat16() for _ in range(2))
    k_cache[0, :tokens], v_cache[0, :tokens] = k, v
    out = cpu_attention.paged_prefill_attention(
        q, k_cache.view(1, blocks, 16, head_dim), v_cache.view(1, blocks, 16, head_dim),
        torch.arange(blocks).view(1, -1), torch.tensor([0]), torch.tensor([tokens]), torch.tensor([tokens]), scale)
    scores = torch.einsum("thd,nd->thn", q.double(), k.double()) * scale
    scores.masked_fill_(torch.ones(tokens, tokens, dtype=torch.bool).triu(1)[:, None, :], float("-inf"))
    expected = torch.einsum("thn,nd->thd", scores.softmax(-1), v.double())
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
