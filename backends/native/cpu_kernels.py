"""The C kernels of csrc/ for CPUs: built once per machine on first use, loaded with ctypes.

Every ``csrc/*.c`` is compiled with the system C compiler (``-march=native``, OpenMP) into one shared
library in a cache directory, keyed by the sources, the compiler, its flags and the CPU's features.
torch's own libgomp is already in the process, so the kernels share torch's OpenMP threads. Without a
compiler (or when the build fails) ``load()`` returns None after one log line and the engine keeps its
pure-torch paths. The Python faces of the kernels are cpu_attention.py and layer_ops.py.
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

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# Fast math lets the compiler vectorise reductions and exp (libmvec); the kernels never meet inf or NaN
# on valid inputs (running maxima start at -FLT_MAX, exp arguments are clamped). It applies to compiling
# only: linking with -ffast-math adds crtfastmath.o, which turns on flush-to-zero for the whole process.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC"]
LDFLAGS = ["-shared", "-fopenmp"]
DTYPE_FLAGS = {torch.float32: 0, torch.bfloat16: 1}  # the storage types the kernels read: their `is_bf16` flag

i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
SIGNATURES = {  # every exported function returns int (0, or nonzero for a layout it refuses)
    "paged_attention_supported": [i64, i64, i64, i64],
    "paged_decode_attention": [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, i32],
    "paged_prefill_attention": [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                f32, i32],
    "add_rms_norm": [ptr, ptr, ptr, ptr, i64, i64, f32, i32],
    "silu_and_mul": [ptr, ptr, i64, i64, i32],
    "rotary_store_kv": [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32],
}


def cache_dir() -> Path:
    """Where built kernels live: $BURSTGATE_CACHE_DIR, else ~/.cache/burstgate (XDG)."""
    if env := os.environ.get("BURSTGATE_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "burstgate"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc"):
        if name and (path := shutil.which(name.split()[0])):
            return path
    return None


def _cpu_signature() -> str:
    """-march=native code is only valid on CPUs with the same features: key the cache on them."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for source in _sources():
            objects.append(obj := Path(tmp) / f"{source.stem}.o")
            subprocess.run([cc, *CFLAGS, "-c", str(source), "-o", str(obj)], check=True, capture_output=True,
                           text=True, timeout=120)
        built = Path(tmp) / target.name
        subprocess.run([cc, *LDFLAGS, *map(str, objects), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel library, or None (no compiler, or the build failed) after one log line."""
    if platform.system() != "Linux":
        log.info("CPU kernels: only built on Linux; using the pure-torch paths")
        return None
    cc = _compiler()
    if cc is None:
        log.warning("CPU kernels: no C compiler found; using the slower pure-torch paths")
        return None
    parts = [p.read_bytes() for p in sorted(CSRC.iterdir()) if p.suffix in (".c", ".h")]
    parts += [s.encode() for s in (cc, " ".join(CFLAGS + LDFLAGS), _cpu_signature())]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = cache_dir() / f"kernels-{key}.so"
    try:
        if not target.exists():
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU kernels: build failed (%s); using the pure-torch paths", detail)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, i32
    return lib


def library() -> ctypes.CDLL:
    """The loaded library; raises when this machine has none (callers check ``load()`` first)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    return lib
