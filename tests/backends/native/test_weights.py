"""Opening a checkpoint: the GGUF read as gguf's own reader reads it (only faster), and the model's skeleton built
without the work that would slow every engine's start."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np

from backends.native.weights import _gguf_reader


def test_the_gguf_is_read_field_by_field_and_tensor_by_tensor_as_ggufs_own_reader_reads_it(smollm2_path):
    ours, theirs = _gguf_reader(smollm2_path), gguf.GGUFReader(str(smollm2_path))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(mine.data, reference.data), mine.name
        assert not mine.data.flags.writeable  # still the read-only map of the file, not a copy


def test_a_models_skeleton_is_built_without_importing_torchs_compiler():
    """Computed on the meta device, the rotary tables would go through torch's Python references, whose first use
    imports torch._dynamo: a second and a half of every engine's start, for tables thrown away."""
    code = ("import sys, torch\n"
            "from backends.native.model_runner import build_model\n"
            "from backends.native.weights import default_model_path, open_checkpoint\n"
            "config = open_checkpoint(default_model_path()).config\n"
            "model = build_model(config, 512, torch.float32, torch.device('cpu'))\n"
            "assert model.rotary.cos.shape == (512, config.head_dim // 2), model.rotary.cos.shape\n"
            "print('torch._dynamo' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
