"""The C kernels of csrc/ for CPUs: built once per machine on first use, or prebuilt; loaded with ctypes.

Every ``csrc/*.c`` is compiled with the system C compiler (``-march=native``, OpenMP) into one shared
library in a cache directory, keyed by the sources, the compiler, its flags and the CPU's features.
Where nothing can be built (no compiler, as in the container image, or a cache that is not writable)
``load()`` takes a library prebuilt for a portable x86-64 level from ``$BURSTGATE_KERNELS_DIR``: the
highest level this CPU runs (``python -m backends.native.cpu_kernels --build DIR`` makes them).
torch's own libgomp is already in the process, so the kernels share torch's OpenMP threads. With
neither, ``load()`` returns None and the engine keeps its pure-torch paths. Which one runs is logged
once. The Python faces of the kernels are attention/, layer_ops.py and linear_kernels.py.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch
import typer

from backends.cache import cache_dir
from backends.native.config import cpu_flags as _cpu_flags  # a module name tests replace

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# Fast math lets the compiler vectorise reductions and exp (libmvec); the kernels meet no NaN on valid inputs
# (running maxima start at -FLT_MAX, exp arguments are clamped), and inf in one place only: the AMX prefill
# kernel's probabilities may overflow to inf in a step that must raise a maximum, which the compare of their
# sum with e^8 catches (AVX-512 intrinsics, which GCC does not fold; clamping instead was slower). It applies to compiling
# only: linking with -ffast-math adds crtfastmath.o, which turns on flush-to-zero for the whole process.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math", "-fPIC"]
LDFLAGS = ["-shared", "-fopenmp"]
# x86-64 micro-architecture levels (the psABI's) and the /proc/cpuinfo flags each one needs; "abm" is LZCNT.
_V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
LEVELS = {"x86-64-v2": _V2, "x86-64-v3": _V3, "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq",
                                                                  "avx512vl"}}
DTYPE_FLAGS = {torch.float32: 0, torch.bfloat16: 1}  # the storage types the kernels read: their `is_bf16` flag
# KV caches in 8-bit floats: the kernels' `kv_format` (csrc/fp8.h); 0 is a cache stored as the activations
FP8_KV_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}

i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
SIGNATURES = {  # every exported function returns int (0, or nonzero for a layout it refuses)
    "paged_attention_supported": [i64, i64, i64, i64],
    "paged_decode_attention": [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, i32,
                               i32],
    "paged_prefill_attention": [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                f32, i32, i32],
    "add_rms_norm": [ptr, ptr, ptr, ptr, i64, i64, f32, i32],
    "silu_and_mul": [ptr, ptr, i64, i64, i32],
    "rotary_store_kv": [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32, i32],
    "int8_linear": [ptr, ptr, ptr, ptr, i64, i64, i64, i32],
    "tile_linear_supported": [],
    "tile_linear": [ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32],
    "tile_linear_silu_mul": [ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32],
    "tile_linear_add": [ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32],
    "prefill_attention_amx_supported": [i64, i64, i64, i64],
    "paged_prefill_attention_amx": [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                    f32, i32, i32],
    "strip_linear_supported": [],
    "strip_linear": [ptr, ptr, ptr, i64, i64, i64],
    "step_layers": [ptr, i64, ptr, ptr, ptr],
}


def kv_format(cache: torch.Tensor) -> int:
    """The kernels' ``kv_format`` of a KV cache tensor: 0 where it is stored as the activations, else its fp8 format."""
    return FP8_KV_FORMATS.get(cache.dtype, 0)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc"):
        if name and (path := shutil.which(name.split()[0])):
            return path
    return None


def _cpu_signature() -> str:
    """-march=native code is only valid on CPUs with the same features: key the cache on them."""
    return f"{platform.machine()} {platform.processor()} {' '.join(sorted(_cpu_flags()))}"


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


def _key(*extra: str) -> str:
    parts = [p.read_bytes() for p in sorted(CSRC.iterdir()) if p.suffix in (".c", ".h")]
    return hashlib.sha256(b"\0".join(parts + [s.encode() for s in extra])).hexdigest()[:16]


def _flags(march: str) -> list[str]:
    return [f"-march={march}" if f == "-march=native" else f for f in CFLAGS]


def prebuilt_name(march: str) -> str:
    """The file a portable build for ``march`` has: keyed by the sources and flags, not the compiler."""
    return f"kernels-{_key(' '.join(_flags(march) + LDFLAGS))}-{march}.so"


def build_portable(directory: Path, marches: list[str]) -> list[Path]:
    """Build one library per x86-64 level into ``directory`` (for images whose runtime has no compiler)."""
    unknown = [m for m in marches if m not in LEVELS]
    if unknown:
        raise ValueError(f"unknown x86-64 levels {unknown}; choose from {list(LEVELS)}")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    targets = [directory / prebuilt_name(m) for m in marches]
    for march, target in zip(marches, targets):
        _build(cc, target, _flags(march))
    return targets


def _build(cc: str, target: Path, cflags: list[str] = CFLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for source in _sources():
            objects.append(obj := Path(tmp) / f"{source.stem}.o")
            subprocess.run([cc, *cflags, "-c", str(source), "-o", str(obj)], check=True, capture_output=True,
                           text=True, timeout=120)
        built = Path(tmp) / target.name
        subprocess.run([cc, *LDFLAGS, *map(str, objects), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library (a native build, else a prebuilt portable one), or None; the choice is logged."""
    if platform.system() != "Linux":
        log.info("CPU kernels: only built on Linux; using the pure-torch paths")
        return None
    lib, native_problem = _native()
    if lib is None:
        lib = _prebuilt(native_problem)
    if lib is None:
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, i32
    return lib


def _native() -> tuple[ctypes.CDLL | None, str]:
    """A -march=native build from the cache, built there first when missing; or None and why not."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found"
    target = cache_dir() / f"kernels-{_key(cc, ' '.join(CFLAGS + LDFLAGS), _cpu_signature())}.so"
    try:
        if not target.exists():
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"build failed in {target.parent} ({getattr(e, 'stderr', '') or e})"
    log.info("CPU kernels: built for this CPU (-march=native): %s", target)
    return lib, ""


def _prebuilt(native_problem: str) -> ctypes.CDLL | None:
    """The prebuilt library of the highest x86-64 level this CPU supports, from $BURSTGATE_KERNELS_DIR."""
    directory = os.environ.get("BURSTGATE_KERNELS_DIR")
    levels = [m for m, needs in LEVELS.items() if needs <= _cpu_flags()] if platform.machine() == "x86_64" else []
    if not directory:
        where = "BURSTGATE_KERNELS_DIR is not set"
    else:
        for march in reversed(levels):
            path = Path(directory) / prebuilt_name(march)
            if path.is_file():
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError as e:
                    log.warning("CPU kernels: cannot load %s (%s)", path, e)
                    continue
                log.info("CPU kernels: prebuilt for %s (%s): %s", march, native_problem, path)
                return lib
        where = f"none for this CPU's levels ({', '.join(levels) or 'none'}) in {directory}"
    log.warning("CPU kernels: NOT AVAILABLE, using the slower pure-torch paths: %s; prebuilt: %s",
                native_problem, where)
    return None


def library() -> ctypes.CDLL:
    """The loaded library; raises when this machine has none (callers check ``load()`` first)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    return lib


def main(
    build: Path = typer.Option(..., help="Directory to write the prebuilt libraries into."),
    march: list[str] = typer.Option(list(LEVELS), help="x86-64 levels to build (repeatable)."),
) -> None:
    """Prebuild the kernels for portable x86-64 levels (container images: their runtime has no compiler)."""
    for path in build_portable(build, march):
        print(path)


if __name__ == "__main__":
    typer.run(main)
