"""Prepare ``.gpu/``: what ``make gpu-check`` needs on a lent GPU machine that its image lacks.

The device machine has Python 3.12 with CUDA PyTorch, Triton and transformers, but none of the gateway's
web stack and no way to download. It receives the working tree plus carried folders, 64 MiB in all, so:

- ``.gpu/whl/``: wheels for CPython 3.12 manylinux x86-64 of the packages in
  ``benchmarks/gpu_requirements.txt`` (pinned);
- ``.gpu/deepspeed/``: the peers' stack, one ``.tar.xz`` made by ``benchmarks/gpu_deepspeed_stack.sh``: DeepSpeed
  with the CUDA ops its kernel injection and FastGen use prebuilt for the device (compiled just in time there
  they take minutes of a 15-minute lease), and DeepSpeed-MII with its REST gateway's packages;
- ``.gpu/model/``: the embedded SmolLM2 GGUF cut to its first ``--layers`` decoder layers (tensors as
  stored, metadata and tokenizer unchanged but the layer count). The whole file (98 MB) does not fit the
  carry limit; the CUDA parity tests compare our engine with transformers on the same file, which any
  Llama checkpoint serves, and the throughput runs use random weights of the full shape.

    python benchmarks/gpu_carry.py            # then: device run with carry [".gpu"], `bash benchmarks/gpu_check.sh`
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from backends.native.weights import default_model_path

CARRY = ROOT / ".gpu"
REQUIREMENTS = ROOT / "benchmarks" / "gpu_requirements.txt"
DEVICE_PACKAGES = ROOT / "benchmarks" / "gpu_device_packages.txt"
CARRY_LIMIT = 64 * 2**20  # the device tool's limit on everything that travels
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_34_x86_64"]


def truncated_gguf(source: Path, layers: int, target: Path) -> None:
    """Copy ``source`` keeping decoder layers ``0 .. layers - 1``: every other tensor and every metadata field as
    stored, ``<arch>.block_count`` set to ``layers``."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        value = layers if name == f"{arch}.block_count" else field.contents()
        types = [gguf.GGUFValueType(t) for t in field.types]
        writer.add_key_value(name, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def download_wheels(target: Path) -> None:
    """The pinned wheels for the device's CPython 3.12, without their dependencies (the image has the rest)."""
    pins = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    pins = [p for p in pins if p]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(target), *pins],
                   check=True)


def missing_requirements(wheels: Path) -> list[str]:
    """Requirements that neither the device's image (benchmarks/gpu_device_packages.txt) nor a carried wheel
    meets: burstgate's own (pyproject.toml, extras included, e.g. uvicorn[standard]) and, transitively, those of
    every carried wheel, with their markers read for the device's CPython 3.12 on Linux."""
    import tomllib
    import zipfile

    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    device = {canonicalize_name(line.strip()) for line in DEVICE_PACKAGES.read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    carried = {}
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            requires = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                        if line.startswith("Requires-Dist:")]
        carried[canonicalize_name(parse_wheel_filename(wheel.name)[0])] = requires
    environment = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
                   "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    pending = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    missing, seen = set(), set()
    while pending:
        req = pending.pop()
        name = canonicalize_name(req.name)
        if (name, tuple(sorted(req.extras))) in seen:
            continue
        seen.add((name, tuple(sorted(req.extras))))
        if name in device:
            continue  # the image's own, with what it needs
        if name not in carried:
            missing.add(str(req))
            continue
        for text in carried[name]:
            dep = Requirement(text)
            if dep.marker is None or any(dep.marker.evaluate({**environment, "extra": e}) for e in req.extras or [""]):
                pending.append(dep)
    return sorted(missing)


def carried_bytes() -> int:
    """Bytes the device tool would send: tracked files plus ``.gpu/``."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [ROOT / f for f in tracked.decode().split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file()) + sum(
        f.stat().st_size for f in CARRY.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of SmolLM2 kept for the parity tests")
    parser.add_argument("--deepspeed-stack", type=Path, metavar="TAR_XZ",
                        help="the peers' stack benchmarks/gpu_deepspeed_stack.sh made (without it: no DeepSpeed, no MII)")
    args = parser.parse_args()
    shutil.rmtree(CARRY, ignore_errors=True)
    (CARRY / "whl").mkdir(parents=True)
    (CARRY / "model").mkdir()
    download_wheels(CARRY / "whl")
    if args.deepspeed_stack:
        (CARRY / "deepspeed").mkdir()
        shutil.copy(args.deepspeed_stack, CARRY / "deepspeed" / args.deepspeed_stack.name)
    model = CARRY / "model" / f"SmolLM2-135M-Instruct-{args.layers}-layers.gguf"
    truncated_gguf(default_model_path(), args.layers, model)
    if missing := missing_requirements(CARRY / "whl"):
        sys.exit(f"the device would lack {', '.join(missing)}: add them to {REQUIREMENTS.name}")
    total = carried_bytes()
    for f in sorted(CARRY.rglob("*")):
        if f.is_file():
            print(f"{f.stat().st_size / 2**20:8.2f} MiB  {f.relative_to(ROOT)}")
    print(f"carried in all: {total / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f}")
    if total > CARRY_LIMIT:
        sys.exit("over the device tool's carry limit: fewer --layers")


if __name__ == "__main__":
    main()
