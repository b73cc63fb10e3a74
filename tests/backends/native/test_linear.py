"""Linear layers repacked for oneDNN compute what F.linear computes, and give the weight memory back; on CPUs
with AMX tiles or AVX512-BF16, bf16 layers with a tile copy answer small steps from it with the same product (on
AMX tiles, steps of any size), and on CPUs with AVX-512 fp32 layers with a strip copy do."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backends.native import host_memory
from backends.native import model as model_module
from backends.native.config import ModelConfig
from backends.native.layer_ops import CpuLayerOps, TorchLayerOps
from backends.native.linear import GateUpLinear, Int8Rows, Linear
from backends.native.linear_kernels import (
    INT8,
    PLAIN,
    STRIP_ROWS,
    TILE_ROWS,
    TILE_STEPS_ANY,
    TILE_STEPS_NONE,
    TILE_STEPS_SMALL,
    OneDnnGateUpKernel,
    OneDnnKernel,
    StripKernel,
    TileKernel,
    can_pack,
    can_strip,
    can_tile,
    layout_serves_all_rows,
    strip_layout,
    strip_matmul,
    tile_add,
    tile_layout,
    tile_matmul,
    tile_silu_mul,
    tile_steps,
)
from backends.native.model import LlamaModel, dummy_tensors
from backends.native.model_runner import build_model

pytestmark = pytest.mark.skipif(not can_pack(torch.float32, torch.device("cpu")), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_f_linear(dtype, tol, bias, rows):
    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip(f"no native {dtype} matmuls on this CPU")
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.pack()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 160)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_packing_drops_the_original_weight_unless_asked_to_keep_it():
    dropped, kept = Linear(32, 48, bias=False), Linear(32, 48, bias=False)
    original = kept.weight
    dropped.pack()
    kept.pack(keep_weight=True)
    assert dropped.weight.numel() == 0
    assert kept.weight is original  # a weight tied to the embedding table stays readable


def test_a_layer_multiplies_with_the_one_kernel_chosen_when_its_weight_was_laid_out():
    """torch's matmul until the layer is laid out, the int8 kernel from ``to_int8``, oneDNN's from ``pack``; forward
    asks the kernel and nothing else."""
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True)
    x = torch.randn(3, 64)
    expected = F.linear(x, layer.weight, layer.bias)
    assert layer.kernel is PLAIN and layer.kernel.describe() == "plain"
    layer.pack()
    assert type(layer.kernel) is OneDnnKernel and layer.kernel.describe() == "onednn"
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    int8 = Linear(64, 96, bias=False)
    int8.to_int8()
    assert int8.kernel is INT8
    int8.pack()  # int8 weights are not packed for oneDNN: the int8 kernel stays
    assert int8.kernel is INT8 and int8.kernel.describe() == "int8" and not int8.kernel.compiles_per_shape


def test_a_model_names_each_kind_of_layers_kernel_once_in_its_log_and_on_request(caplog):
    """``linear_kernels()`` (GET /info's ``linear_kernels``) gives the kernel of each kind of layer as packing chose
    it, and the start-up log says the same, once."""
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    model = LlamaModel(cfg, max_positions=64)
    model.load_weights(dummy_tensors(cfg, 0, torch.float32, torch.device("cpu")))
    assert set(model.linear_kernels().values()) == {"plain"}
    expected = f"strip (up to {STRIP_ROWS} rows), then onednn" if can_strip(model.lm_head.weight) else "onednn"
    with caplog.at_level(logging.INFO, logger=model_module.__name__):
        assert model.pack_linear_weights()
    assert model.linear_kernels() == dict.fromkeys(("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"),
                                                   expected)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("linear kernels")]
    assert f"qkv_proj: {expected}; o_proj: {expected}; " in line


def test_only_cpu_fp32_and_native_bf16_are_packed():
    assert can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.float16, torch.device("cpu"))
    assert not can_pack(torch.float32, torch.device("meta"))


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_bf16_gate_and_up_give_silu_and_mul_from_the_matmul_epilogues(rows):
    # Packed apart, the halves multiply in oneDNN's epilogues: silu of the gate's fp32 sums (HF rounds them to bf16
    # first) times the up's, within bf16's rounding of the reference; forward still gives both halves
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no native bf16 matmuls on this CPU")
    torch.manual_seed(0)
    layer = GateUpLinear(64, 2 * 96, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    both = F.linear(x, layer.weight)
    expected = TorchLayerOps.silu_and_mul(both)
    layer.pack()
    assert isinstance(layer.kernel, OneDnnGateUpKernel) and layer.weight.numel() == 0
    assert [p.dtype for p in layer.kernel.layouts()] == [torch.bfloat16, torch.bfloat16]
    torch.testing.assert_close(layer.silu_and_mul(x, CpuLayerOps).float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(layer(x).float(), both.float(), atol=1e-2, rtol=1e-2)


def test_fp32_gate_and_up_pack_as_one_matmul():
    layer = GateUpLinear(64, 2 * 96, bias=False)
    x = torch.randn(5, 64)
    expected = TorchLayerOps.silu_and_mul(F.linear(x, layer.weight))
    layer.pack()
    assert type(layer.kernel) is OneDnnKernel and len(layer.kernel.layouts()) == 1
    torch.testing.assert_close(layer.silu_and_mul(x, CpuLayerOps), expected, atol=1e-5, rtol=1e-5)


def _tile_layer(out_features: int, in_features: int, bias: bool = False) -> Linear:
    layer = Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    if not can_tile(layer.weight):
        pytest.skip("no AMX tiles or AVX512-BF16 on this CPU (or no C kernels)")
    return layer


def _needs_tiles_for_every_step() -> None:
    if tile_steps() != TILE_STEPS_ANY:
        pytest.skip("steps past TILE_ROWS multiply the tile layout on AMX tiles only")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 24, 40, TILE_ROWS])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (960, 576), (576, 1536)])
def test_tile_copy_gives_the_fp32_product_rounded_to_bf16(rows, bias, out_features, in_features):
    """Full 16-row tiles, a remainder, and both together; k of 2 to 48 tiles; fp32 sums, as oneDNN's."""
    torch.manual_seed(rows)
    layer = _tile_layer(out_features, in_features, bias)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    layer.pack("tiles")
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [TILE_ROWS + 1, 96, 100, 300])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (960, 576), (576, 1536), (64, 32)])
def test_tile_layout_multiplies_steps_of_any_size(rows, out_features, in_features):
    """Past TILE_ROWS rows, blocks of 32 x 32 (a partial last row block; 48 outputs stream instead), fp32 sums."""
    torch.manual_seed(rows)
    _needs_tiles_for_every_step()
    layer = _tile_layer(out_features, in_features)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    got = tile_matmul(x, tile_layout(layer.weight))
    torch.testing.assert_close(got.float(), F.linear(x.float(), layer.weight.float()), atol=2e-2, rtol=1e-2)


# the weights the tile kernel's rounding passes take: bf16, or int8 with per-channel scales in fp32 or bf16
WEIGHTS = ["bf16", "int8", "int8-bf16-scales"]


def _tile_weight(kind: str, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random weight of ``kind`` as (its tile layout, its scales or None), for the tile kernel's rounding passes
    (AMX tiles only)."""
    _needs_tiles_for_every_step()
    weight = _tile_layer(out_features, in_features).weight
    if kind == "bf16":
        return tile_layout(weight), None
    q = Int8Rows.quantize(weight)
    return tile_layout(q.values), q.scales.to(torch.bfloat16 if kind == "int8-bf16-scales" else torch.float32)


@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("half", [48, 96])
@pytest.mark.parametrize("rows", [1, 5, 33, TILE_ROWS, 100, 300])
def test_tile_silu_mul_rounds_as_the_bf16_reference(rows, half, kind):
    """silu(gate) * up in the matmul's rounding pass: the tile product's gate and up (int8: scaled) rounded to bf16,
    then torch's bf16 silu and product, bit for bit (half 48: the up's first tile is not 32-column aligned)."""
    torch.manual_seed(rows)
    tiles, scales = _tile_weight(kind, 2 * half, 576)
    x = torch.randn(rows, 576, dtype=torch.bfloat16) * 4  # sums large enough for silu's whole range
    assert torch.equal(tile_silu_mul(x, tiles, scales), TorchLayerOps.silu_and_mul(tile_matmul(x, tiles, scales)))


@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("rows", [TILE_ROWS + 1, 100, 300])
@pytest.mark.parametrize("out_features, in_features", [(576, 576), (576, 1536)])
def test_tile_add_rounds_the_residual_add_as_torch(rows, out_features, in_features, kind):
    """residual + x @ W.T in the tile kernel's rounding pass: the product (int8: scaled) rounded to bf16, then
    torch's bf16 sum, bit for bit, written over the residual."""
    torch.manual_seed(rows)
    tiles, scales = _tile_weight(kind, out_features, in_features)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    residual = torch.randn(rows, out_features, dtype=torch.bfloat16) * 8
    expected = residual + tile_matmul(x, tiles, scales)
    tile_add(x, tiles, residual, scales)
    assert torch.equal(residual, expected)


def test_a_layer_joins_the_residual_stream_in_its_kernel_only_where_the_tiles_serve_the_step():
    """``with_residual``: (residual + x @ W.T, None) from the tile kernel past TILE_ROWS rows of a tile-only layer,
    else (x @ W.T, residual) untouched, for the next norm to add; the same sum either way."""
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=False).to(torch.bfloat16)
    if not layout_serves_all_rows(layer.weight, torch.bfloat16):
        pytest.skip("no AMX tiles on this CPU (or no C kernels)")
    layer.use_layout_only()
    for rows, fused in ((TILE_ROWS, False), (TILE_ROWS + 1, True), (200, True)):
        x, residual = torch.randn(rows, 64, dtype=torch.bfloat16), torch.randn(rows, 96, dtype=torch.bfloat16)
        expected = residual + layer(x)
        out, rest = layer.with_residual(x, residual.clone())
        assert (rest is None) == fused
        assert torch.equal(out if rest is None else out + rest, expected)


def test_a_layer_served_by_its_tiles_alone_answers_every_step_from_them():
    torch.manual_seed(0)
    layer = GateUpLinear(64, 2 * 96, bias=False).to(torch.bfloat16)
    if not layout_serves_all_rows(layer.weight, torch.bfloat16):
        pytest.skip("no AMX tiles on this CPU (or no C kernels)")
    weight = layer.weight.detach().clone()
    layer.use_layout_only()
    assert layer.layout_only and layer.weight.numel() == 0 and layer.kernel.layouts() == [layer.kernel.tiles]
    for rows in (3, TILE_ROWS, 200):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        both = F.linear(x.float(), weight.float())
        torch.testing.assert_close(layer(x).float(), both, atol=2e-2, rtol=1e-2)
        expected = TorchLayerOps.silu_and_mul(both.bfloat16())
        torch.testing.assert_close(layer.silu_and_mul(x, CpuLayerOps).float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert not layout_serves_all_rows(torch.zeros(48, 64, dtype=torch.bfloat16), torch.bfloat16)  # 48 outputs
    assert layout_serves_all_rows(torch.zeros(64, 64, dtype=torch.int8), torch.bfloat16)  # int8, widened
    assert not layout_serves_all_rows(torch.zeros(64, 64, dtype=torch.int8), torch.float32)  # fp32 activations


def test_tile_layout_puts_each_b_tile_in_one_kilobyte():
    """Tile (j, c) row r holds, for outputs 16j..16j+15, the weight's columns 32c + 2r and 32c + 2r + 1."""
    weight = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).bfloat16()
    tiles = tile_layout(weight)
    assert tiles.shape == (2, 2, 16, 16, 2) and tiles.is_contiguous()
    j, c, r, n = 1, 1, 3, 5
    assert torch.equal(tiles[j, c, r, n], weight[16 * j + n, 32 * c + 2 * r: 32 * c + 2 * r + 2])


def test_small_steps_read_the_tile_copy_and_larger_ones_the_onednn_copy():
    layer = _tile_layer(64, 64)
    layer.pack("tiles")
    layer.kernel.tiles.zero_()  # the copies now disagree: which one answered shows in the result
    assert not layer(torch.ones(TILE_ROWS, 64, dtype=torch.bfloat16)).any()
    assert layer(torch.ones(TILE_ROWS + 1, 64, dtype=torch.bfloat16)).all()


def test_tile_kernel_serves_steps_of_any_size_on_amx_and_small_ones_on_avx512_bf16_vectors():
    """What the kernel library says it serves follows the CPU: AMX tiles any step, AVX512-BF16 alone (AMD Zen 4)
    steps of up to TILE_ROWS rows, which it then multiplies on vectors; past them it refuses, naming the weight."""
    flags = Path("/proc/cpuinfo").read_text().split()
    expected = (TILE_STEPS_ANY if "amx_bf16" in flags else TILE_STEPS_SMALL if "avx512_bf16" in flags
                else TILE_STEPS_NONE)
    if not can_pack(torch.bfloat16, torch.device("cpu")) or (expected and not can_tile(torch.zeros(16, 32).bfloat16())):
        pytest.skip("no native bf16 matmuls or no C kernels on this CPU")
    assert tile_steps() == expected
    if expected != TILE_STEPS_SMALL:
        return
    torch.manual_seed(0)
    weight = torch.randn(64, 96).bfloat16()
    x = torch.randn(TILE_ROWS, 96).bfloat16()
    torch.testing.assert_close(tile_matmul(x, tile_layout(weight)).float(), x.float() @ weight.float().T,
                               atol=2e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match=r"refused a \[64, 96\] weight"):
        tile_matmul(torch.randn(TILE_ROWS + 1, 96).bfloat16(), tile_layout(weight))


def test_the_tile_and_strip_kernels_refuse_activations_of_another_dtype():
    """The C kernels read the activations as bf16 (tiles) or fp32 (strips): another dtype is an error naming both,
    not garbage."""
    layer = _tile_layer(64, 64)
    with pytest.raises(ValueError, match=r"tile_linear multiplies torch.bfloat16 activations, not torch.float32"):
        tile_matmul(torch.ones(2, 64), tile_layout(layer.weight))
    strips = strip_layout(torch.ones(64, 64))
    with pytest.raises(ValueError, match=r"strip_linear multiplies torch.float32 activations, not torch.bfloat16"):
        strip_matmul(torch.ones(2, 64, dtype=torch.bfloat16), strips)


def test_only_bf16_weights_of_whole_tiles_get_a_tile_copy():
    _tile_layer(16, 32)  # skips where nothing can
    assert can_tile(torch.zeros(16, 32, dtype=torch.bfloat16))
    assert not can_tile(torch.zeros(16, 32))  # fp32: oneDNN only
    assert not can_tile(torch.zeros(24, 32, dtype=torch.bfloat16))  # outputs not a multiple of 16
    assert not can_tile(torch.zeros(16, 48, dtype=torch.bfloat16))  # inputs not a multiple of 32


def _strip_layer(out_features: int, in_features: int, bias: bool = False) -> Linear:
    layer = Linear(in_features, out_features, bias=bias)
    if not can_strip(layer.weight):
        pytest.skip("no AVX-512 on this CPU (or no C kernels)")
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40, STRIP_ROWS])
@pytest.mark.parametrize("out_features, in_features", [(32, 8), (960, 576), (576, 1536), (64, 200)])
def test_strip_copy_gives_the_fp32_product(rows, bias, out_features, in_features):
    """Whole 12-row blocks, a remainder, and both; k within one 128-column pass, several, and a part pass."""
    torch.manual_seed(rows)
    layer = _strip_layer(out_features, in_features, bias)
    x = torch.randn(rows, in_features)
    expected = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    layer.pack("strips")
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


def test_strip_layout_lays_each_strip_of_32_outputs_column_by_column():
    """Strip j at column c holds the weight's outputs 32j..32j+31 at input c."""
    weight = torch.arange(64 * 10, dtype=torch.float32).reshape(64, 10)
    strips = strip_layout(weight)
    assert strips.shape == (2, 10, 32) and strips.is_contiguous()
    assert torch.equal(strips[1, 7], weight[32:64, 7])


def test_small_fp32_steps_read_the_strip_copy_and_larger_ones_the_onednn_copy():
    layer = _strip_layer(64, 64)
    layer.pack("strips")
    layer.kernel.strips.zero_()  # the copies now disagree: which one answered shows in the result
    assert not layer(torch.ones(STRIP_ROWS, 64)).any()
    assert layer(torch.ones(STRIP_ROWS + 1, 64)).all()


def test_only_fp32_weights_of_whole_strips_get_a_strip_copy():
    _strip_layer(32, 8)  # skips where nothing can
    assert can_strip(torch.zeros(32, 7))
    assert not can_strip(torch.zeros(32, 32, dtype=torch.bfloat16))  # bf16: tiles or oneDNN
    assert not can_strip(torch.zeros(48, 32))  # outputs not a multiple of 32


def _packed_bf16_model() -> LlamaModel:
    # three kinds of layer: outputs a multiple of 32 (gate/up 256, down 64, the LM head 512), qkv's 80 outputs, and
    # o_proj's 48 inputs (not a multiple of 32: no tiles at all)
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=3,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    model = LlamaModel(cfg, max_positions=64)
    model.load_weights(dummy_tensors(cfg, 0, torch.float32, torch.device("cpu")))
    model.to(torch.bfloat16)
    if not can_tile(model.lm_head.weight):
        pytest.skip("no AMX tiles or AVX512-BF16 on this CPU (or no C kernels)")
    return model


def test_a_bf16_model_lays_out_its_weights_as_tiles_and_keeps_copies_where_they_fit():
    """Layers whose outputs are a multiple of 32 keep only their tile layout (it serves steps of every size); qkv
    keeps its packed weight and a tile copy for small steps; o_proj only its packed weight. Each counted once."""
    model = _packed_bf16_model()
    _needs_tiles_for_every_step()
    x = torch.randn(100, 128, dtype=torch.bfloat16)  # down_proj's input, more rows than the tiles stream
    mlp = model.layers[0].mlp
    expected = F.linear(x.float(), mlp.down_proj.weight.float())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.pack_linear_weights()
    layers = [layer.mlp.gate_up_proj for layer in model.layers] + [layer.mlp.down_proj for layer in model.layers]
    assert all(m.layout_only and len(m.kernel.layouts()) == 1 and m.weight.numel() == 0 for m in layers)
    assert model.lm_head.layout_only and model.lm_head.weight is model.embed_tokens.weight  # tied: kept
    qkv, o = model.layers[0].self_attn.qkv_proj, model.layers[0].self_attn.o_proj
    assert isinstance(qkv.kernel, TileKernel) and isinstance(qkv.kernel.larger, OneDnnKernel)  # tiles, then oneDNN
    assert type(o.kernel) is OneDnnKernel
    copies = sum(layer.self_attn.qkv_proj.kernel.tiles.numel() * 2 for layer in model.layers)
    assert model.small_step_copy_bytes() == copies
    # each dropped float weight became a layout of its size; the tied head's tiles sit beside the embedding table
    assert model.weight_bytes() == params + copies + model.lm_head.kernel.tiles.numel() * 2
    torch.testing.assert_close(mlp.down_proj(x).float(), expected, atol=2e-2, rtol=1e-2)


def test_an_int8_bf16_model_keeps_only_the_tile_layout_of_int8_weights_whose_outputs_are_a_multiple_of_32():
    """The same three kinds of layer in int8 with bf16 activations: gate/up, down and the LM head (its own int8 copy
    of the tied table) keep only their int8 tiles and scales, and answer large steps from them (the blocked path,
    SwiGLU in its rounding pass); qkv keeps its int8 rows beside a tile copy for small steps; o_proj its rows."""
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=3,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    model = build_model(cfg, 64, torch.bfloat16, torch.device("cpu"), int8=True)
    model.load_weights(dummy_tensors(cfg, 0, torch.float32, torch.device("cpu")))
    _needs_tiles_for_every_step()
    mlp = model.layers[0].mlp
    gate_up = Int8Rows(mlp.gate_up_proj.weight.clone(), mlp.gate_up_proj.scales.float())
    x = torch.randn(100, 64, dtype=torch.bfloat16)  # more rows than the tiles stream
    both = x.float() @ gate_up.dequantize().T
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.pack_linear_weights()
    layers = [m for layer in model.layers for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj)] + [model.lm_head]
    assert all(m.layout_only and m.is_int8 and m.weight.numel() == 0 and m.kernel.tiles.dtype == torch.int8
               for m in layers)
    qkv, o = model.layers[0].self_attn.qkv_proj, model.layers[0].self_attn.o_proj
    assert isinstance(qkv.kernel, TileKernel) and qkv.kernel.larger is INT8 and qkv.weight.numel() > 0
    assert o.kernel is INT8 and o.weight.numel() > 0
    copies = sum(layer.self_attn.qkv_proj.kernel.tiles.numel() for layer in model.layers)
    assert model.small_step_copy_bytes() == copies
    assert model.weight_bytes() == params + copies  # each dropped int8 weight became a layout of its size
    torch.testing.assert_close(mlp.gate_up_proj(x).float(), both, atol=2e-2 * both.abs().max().item(), rtol=2e-2)
    expected = TorchLayerOps.silu_and_mul(both.bfloat16())
    got = mlp.gate_up_proj.silu_and_mul(x, CpuLayerOps)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2 * expected.abs().max().item(), rtol=2e-2)


def test_a_bf16_model_on_vectors_keeps_oneDNN_packings_and_tile_copies_for_small_steps():
    """Where the tile layout serves small steps only (AVX512-BF16 without AMX), no layer gives up its packed weight:
    every weight of whole tiles (not o_proj's 48 inputs) gets a tile copy beside it, counted once, and small steps
    read it while larger ones read the packing."""
    model = _packed_bf16_model()
    if tile_steps() != TILE_STEPS_SMALL:
        pytest.skip("the tile layout serves every step here (AMX tiles)")
    x = torch.randn(TILE_ROWS + 1, 128, dtype=torch.bfloat16)
    down = model.layers[0].mlp.down_proj
    expected = F.linear(x.float(), down.weight.float())
    assert model.pack_linear_weights()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert not any(m.layout_only for m in linears) and all(m.kernel.compiles_per_shape for m in linears)
    o_projs = {layer.self_attn.o_proj for layer in model.layers}
    assert all(isinstance(m.kernel, TileKernel) != (m in o_projs) for m in linears)
    assert model.small_step_copy_bytes() == sum(m.kernel.tiles.numel() * 2 for m in linears if m not in o_projs)
    for rows in (1, TILE_ROWS, TILE_ROWS + 1):  # tile copy, tile copy, packed weight
        torch.testing.assert_close(down(x[:rows]).float(), expected[:rows], atol=2e-2, rtol=1e-2)


def test_an_fp32_model_keeps_strip_copies_and_counts_them():
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    model = LlamaModel(cfg, max_positions=64)
    model.load_weights(dummy_tensors(cfg, 0, torch.float32, torch.device("cpu")))
    if not can_strip(model.lm_head.weight):
        pytest.skip("no AVX-512 on this CPU (or no C kernels)")
    x = torch.randn(3, 64)
    expected = model.layers[0].mlp.gate_up_proj(x)
    assert model.pack_linear_weights()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.kernel, StripKernel) for m in linears)
    assert model.small_step_copy_bytes() == sum(m.kernel.strips.numel() * 4 for m in linears)
    torch.testing.assert_close(model.layers[0].mlp.gate_up_proj(x), expected, atol=1e-5, rtol=1e-5)


def test_a_model_goes_without_copies_its_container_has_no_room_for(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text(f"{64 << 10}\n")  # a cgroup limit of 64 KiB, none of it used
    (tmp_path / "memory.current").write_text("0\n")
    monkeypatch.setattr(host_memory, "CGROUP", tmp_path)
    model = _packed_bf16_model()
    assert model.pack_linear_weights()
    assert model.small_step_copy_bytes() == 0


def test_a_model_goes_without_tile_copies_that_would_not_fit(monkeypatch):
    monkeypatch.setattr(model_module, "SMALL_STEP_COPY_SHARE", 0.0)
    model = _packed_bf16_model()
    assert model.pack_linear_weights()
    assert model.small_step_copy_bytes() == 0
    assert all(isinstance(m.kernel, OneDnnKernel | OneDnnGateUpKernel) or m.layout_only for m in model.modules() if isinstance(m, Linear))
