"""deploy/Dockerfile, read with BuildKit's own parser (no Docker engine runs here, so it is not built):
dependencies before the source, kernels prebuilt where the engine looks, a runtime stage with no
compiler, no load-tester extra and a numeric user; and that runtime environment really serves."""

from __future__ import annotations

import importlib.util
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dockerfile
import httpx
import pytest
import torch
import yaml

from backends.native import cpu_kernels
from tests.deploy.files import DEPLOY, ROOT, documents, gateway_pod, k8s_objects
from tests.servers import free_port


def _load_requirements_script():
    """deploy/requirements.py, the script the image runs to list what it installs."""
    spec = importlib.util.spec_from_file_location("deploy_requirements", DEPLOY / "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.requirements


requirements = _load_requirements_script()

COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|cc|build-essential|libc6-dev)\b")
LOADTEST_EXTRA = ("matplotlib", "pynvml")  # psutil is a core dependency (the engine reads free memory)


def stages() -> dict[str, list[dockerfile.Command]]:
    """Each stage's instructions by stage name, in order; the last one is the image."""
    out: dict[str, list[dockerfile.Command]] = {}
    for c in dockerfile.parse_file(str(DEPLOY / "Dockerfile")):
        if c.cmd == "FROM":
            name = c.value[2] if len(c.value) == 3 and c.value[1].upper() == "AS" else str(len(out))
            out[name] = [c]
        elif out:
            out[name].append(c)
    return out


def of(stage: list[dockerfile.Command], cmd: str) -> Iterator[dockerfile.Command]:
    return (c for c in stage if c.cmd == cmd)


def env(stage: list[dockerfile.Command]) -> dict[str, str]:
    return {k: v for c in of(stage, "ENV") for k, v in zip(c.value[::2], c.value[1::2])}


def runtime() -> list[dockerfile.Command]:
    return list(stages().values())[-1]


def test_the_stages_are_deps_kernels_runtime_and_the_image_is_the_runtime():
    assert list(stages()) == ["deps", "kernels", "runtime"]
    assert runtime()[0].value[0] == "${PYTHON_IMAGE}"  # a fresh base: nothing of the build stages but what it copies


def test_dependencies_are_installed_before_any_source_is_copied():
    deps = stages()["deps"]
    copies = [c for c in deps if c.cmd == "COPY"]
    assert [v for c in copies for v in c.value[:-1]] == ["pyproject.toml", "deploy/requirements.py"]
    install = next(i for i, c in enumerate(deps) if c.cmd == "RUN" and "pip install -r requirements.txt" in c.value[0])
    assert deps.index(copies[-1]) < install
    for name in ("gateway", "backends", "loadtest"):
        assert not any(name in v for c in copies for v in c.value), name


def test_the_runtime_has_no_compiler_and_runs_as_the_numeric_user_the_pods_name():
    image = runtime()
    assert not any(COMPILERS.search(c.value[0]) for c in of(image, "RUN"))
    assert {f for c in of(image, "COPY") for f in c.flags if f.startswith("--from=")} == {"--from=deps",
                                                                                        "--from=kernels"}
    user = [c.value[0] for c in image if c.cmd == "USER"]
    assert len(user) == 1 and re.fullmatch(r"\d+:\d+", user[0])
    uid, gid = map(int, user[0].split(":"))
    gateway = gateway_pod(k8s_objects())
    assert (gateway["securityContext"]["runAsUser"], gateway["securityContext"]["runAsGroup"]) == (uid, gid)


def test_the_kernels_are_prebuilt_into_the_directory_the_engine_reads():
    build = next(c.value[0] for c in of(stages()["kernels"], "RUN") if "backends.native.cpu_kernels" in c.value[0])
    directory = re.search(r"--build (\S+)", build).group(1)
    assert re.findall(r"--march (\S+)", build) == ["x86-64-v2", "x86-64-v3", "x86-64-v4"]
    assert env(runtime())["BURSTGATE_KERNELS_DIR"] == directory
    assert any(c.flags == ("--from=kernels",) and c.value == (directory, directory) for c in of(runtime(), "COPY"))


def test_the_serving_image_leaves_out_the_loadtest_extra():
    extras = next(c.value[0] for c in of(stages()["deps"], "ARG") if c.value[0].startswith("EXTRAS="))
    assert extras == 'EXTRAS=""'
    served = requirements(ROOT / "pyproject.toml", [])
    assert not [r for r in served if r.split(">")[0].split("=")[0] in ("matplotlib", "nvidia-ml-py")]
    assert "psutil>=6.0" in served  # the engine sizes its optional weight copies by the memory available
    assert "deepspeed>=0.15" in requirements(ROOT / "pyproject.toml", ["deepspeed"])
    dev = requirements(ROOT / "pyproject.toml", ["dev"])  # self-references unfold: the tests get the extra
    assert {"matplotlib>=3.8", "deepspeed>=0.15", "accelerate>=0.30"} <= set(dev)
    assert len(dev) == len(set(dev)) and not any(r.startswith("burstgate") for r in dev)


def test_dockerignore_lets_in_exactly_what_the_image_copies():
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == "*"  # everything out (.git, .venv, .peers, results, tests) ...
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = {v for stage in stages().values() for c in of(stage, "COPY") if not c.flags for v in c.value[:-1]}
    assert allowed == copied  # ... but what COPY takes


def test_the_ports_match_the_manifests():
    image = runtime()
    assert [c.value for c in of(image, "EXPOSE")] == [("8000",)]
    cmd = next(of(image, "CMD")).value
    assert cmd[cmd.index("--port") + 1] == "8000"
    compose = documents(DEPLOY / "compose.yaml")[0]
    assert compose["services"]["gateway-a"]["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile",
                                                          "args": {"EXTRAS": "deepspeed"}}


@pytest.fixture
def tiny_model_config(tmp_path, smollm2_tokenizer) -> Path:
    """A gateway config serving a two-layer random Llama (SmolLM2's tokenizer and head layout): quick to load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=smollm2_tokenizer.vocab_size, hidden_size=192,
                                         intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
                                         num_key_value_heads=1, max_position_embeddings=256, eos_token_id=2))
    model.save_pretrained(tmp_path / "tiny")
    smollm2_tokenizer.hf.save_pretrained(tmp_path / "tiny")
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": "tiny", "deployments": [
        {"kind": "native", "model_path": str(tmp_path / "tiny"), "kv_cache_gb": 0.01}]}]}))
    return config


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="the image is Linux x86-64")
def test_the_runtime_environment_serves_with_prebuilt_kernels_and_without_the_loadtest_extra(tmp_path,
                                                                                              tiny_model_config):
    """The image's ENV, CMD and kernel build, run here: no compiler on PATH, caches in a temporary
    directory, the load tester's extra unimportable. It answers, and it logs which kernels run."""
    image_env = env(runtime())
    kernels = tmp_path / "kernels"
    cpu_kernels.build_portable(kernels, ["x86-64-v2"])  # as the kernels stage does (its command: test_cpu_kernels)
    server_env = {k: v for k, v in image_env.items() if not v.startswith("/")}  # the flags, as they are
    server_env.update(PATH=str(Path(sys.executable).parent), PYTHONPATH=str(ROOT), HOME=str(tmp_path),
                      XDG_CACHE_HOME=str(tmp_path / "cache"), BURSTGATE_KERNELS_DIR=str(kernels))
    assert {"PYTHONPATH", "XDG_CACHE_HOME", "BURSTGATE_KERNELS_DIR", "HF_HUB_OFFLINE"} <= image_env.keys()
    assert image_env["HF_HUB_OFFLINE"] == "1"
    args = list(next(of(runtime(), "CMD")).value)
    port = free_port()
    args[args.index("--port") + 1], args[args.index("--host") + 1] = str(port), "127.0.0.1"
    args += ["--config", str(tiny_model_config)]
    code = (f"import sys\nfor m in {LOADTEST_EXTRA!r}: sys.modules[m] = None\n"
            f"sys.argv = ['burstgate', *{args!r}]\nimport runpy\nrunpy.run_module('gateway.cli', run_name='__main__')")
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], env=server_env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4,
                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "CPU kernels: prebuilt for x86-64-v2 (no C compiler found)" in text, text[-3000:]
    assert "NOT AVAILABLE" not in text
