"""``GET /info``: the machine this gateway serves from and what each deployment runs, for ops and load tests.

Devices come from the OS (CPU, RAM) and NVML (GPUs; torch.cuda when NVML is missing). Deployment
settings are dumped generically from their configuration objects, with secrets left out, so a new
backend kind or setting shows up here without code changes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import sys
from collections import Counter
from typing import Any

from pydantic import BaseModel

_SECRET_NAMES = ("api_key", "key", "secret", "password", "token", "authorization", "sha256")


def devices() -> list[dict[str, Any]]:
    """The CPU (logical cores, RAM) and the GPUs grouped by name (count, memory per device, bytes)."""
    cpu = {"kind": "cpu", "name": cpu_model(), "count": os.cpu_count() or 1,
           "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    gpus = Counter(_nvml_memory("total") or _torch_gpus())
    return [cpu] + [{"kind": "cuda", "name": name, "count": count, "memory_bytes": memory}
                    for (name, memory), count in gpus.items()]


def describe(devs: list[dict[str, Any]]) -> str:
    """One line naming the accelerators, else the CPU: ``2x NVIDIA H100 80GB HBM3`` or ``cpu: 16x AMD EPYC``."""
    gpus = [d for d in devs if d["kind"] != "cpu"]
    if gpus:
        return " + ".join(f"{d['count']}x {d['name']}" for d in gpus)
    cpu = devs[0]
    return f"cpu: {cpu['count']}x {cpu['name']}"


def machine_summary() -> str:
    """This machine in words: CPU model and the cores this process may use."""
    return f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvml_memory(kind: str) -> list[tuple[str, int]]:
    """Each GPU's (name, bytes of memory ``kind``: ``total`` or ``used``) from NVML; none without it."""
    nvml = _nvml()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())] if nvml else []
        return [(_text(nvml.nvmlDeviceGetName(h)), int(getattr(nvml.nvmlDeviceGetMemoryInfo(h), kind)))
                for h in handles]
    except Exception:  # a driver that stopped answering: no figure rather than a failed request
        return []


def _torch_gpus() -> list[tuple[str, int]]:
    """The GPUs torch sees, where an in-process engine loaded it already (a gateway of remote backends never
    loads torch: NVML answers there)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    try:

        if not torch.cuda.is_available():
            return []
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        return [(p.name, int(p.total_memory)) for p in props]
    except Exception:
        return []


def gpu_memory_used() -> list[tuple[str, int]]:
    """Each GPU's (name, bytes in use), the whole device's as nvidia-smi shows them: from NVML, else from torch where
    an in-process engine loaded it; none on a machine without GPUs."""
    if used := _nvml_memory("used"):
        return used
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return []
        return [(torch.cuda.get_device_name(i), int(total - free))
                for i in range(torch.cuda.device_count()) for free, total in [torch.cuda.mem_get_info(i)]]
    except Exception:
        return []


@functools.cache
def _nvml():
    """pynvml, initialised once; None without the library, a driver or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def public_settings(obj: Any) -> Any:
    """A pydantic model or dataclass (nested in dicts and lists) as plain JSON data without secrets."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return {k: public_settings(v) for k, v in obj.items() if not _is_secret(str(k))}
    if isinstance(obj, (list, tuple)):
        return [public_settings(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)  # paths and enums


def _is_secret(name: str) -> bool:
    name = name.lower()
    return any(name == s or name.endswith("_" + s) for s in _SECRET_NAMES)


def deployment_info(deployment) -> dict[str, Any]:
    """A deployment's kind, its configured settings, and an in-process engine's running settings."""
    config = getattr(deployment, "config", None)
    backend = deployment.backend
    kind = getattr(config, "kind", None) or backend.name.split(":", 1)[0]
    out: dict[str, Any] = {"name": deployment.name, "kind": kind,
                           "settings": public_settings(config) if config is not None else {}}
    engine = _engine_config(backend)
    if engine is not None:
        out["engine"] = public_settings(engine)
    return out


def _engine_config(backend) -> Any:
    """The settings an in-process engine actually runs with (it may be shared, or built outside the config)."""
    try:
        engine = getattr(backend, "engine", None)
    except Exception:  # not started yet: what it will be started with
        engine = None
    if engine is not None and hasattr(engine, "settings"):
        return engine.settings()
    return getattr(engine, "config", None) or getattr(backend, "config", None)


def server_info(gateway) -> dict[str, Any]:
    """The body of ``GET /info``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        burstgate = version("burstgate")
    except PackageNotFoundError:
        burstgate = None
    devs = devices()
    return {"server": "burstgate", "version": burstgate, "hardware": describe(devs), "devices": devs,
            "gpu_memory_used_bytes": [used for _, used in gpu_memory_used()],  # by GPU index, now
            "models": [{"name": g.name, "routing": g.routing,
                        "deployments": [deployment_info(d) for d in g.deployments]}
                       for g in gateway.groups.values()]}
