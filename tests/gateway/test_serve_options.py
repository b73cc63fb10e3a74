"""``burstgate serve`` as a user starts it: every engine option reaches the running engine, checked by what
the engine itself reports on GET /info (the resolved dtype and device, not the configured words). bfloat16
is asked for because it is not what ``auto`` gives on a CPU without native bf16 (CI's), so a dropped
option shows; what ``auto`` resolves to is tests/backends/native/test_config.py's."""

from __future__ import annotations

import httpx

from tests.servers import burstgate_serve


def _engine(url: str) -> dict:
    (model,) = httpx.get(f"{url}/info").json()["models"]
    return model["name"], model["deployments"][0]["engine"]


def test_dtype_device_quantization_kv_cache_and_name_options_reach_the_running_engine():
    with burstgate_serve("--dtype", "bfloat16", "--device", "cpu", "--served-model-name", "smol-bf16",
                         "--tensor-parallel-size", "1", "--quantization", "int8", "--kv-cache-dtype", "fp8",
                         "--block-size", "32") as served:
        url = served.url
        name, engine = _engine(url)
        assert name == "smol-bf16" and engine["dtype"] == "bfloat16" and engine["device"] == "cpu"
        assert engine["kv_cache_dtype"] == "float8_e4m3fn" and engine["block_size"] == 32
        # int8 linear layers: SmolLM2's 135M parameters in under 1.5 bytes each (bf16 alone: 2), not counting
        # the second copy as tiles that CPUs with AMX or AVX512-BF16 keep for small steps (linear.py)
        held_once = engine["weight_bytes"] - engine["small_step_copy_bytes"]
        assert engine["quantization"] == "int8" and held_once < 1.5 * 135e6
        # each kind of layer multiplies int8 weights: on their tiles (AMX, AVX512-BF16) or the int8 kernel
        kernels = engine["linear_kernels"]
        assert set(kernels) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
        assert all(kernel.startswith("tile") or kernel == "int8" for kernel in kernels.values()), kernels
        assert engine["tensor_parallel_size"] == 1 and engine["warmup"] and engine["num_threads"] >= 1
        reply = httpx.post(f"{url}/v1/completions", json={"model": "smol-bf16", "prompt": "Hi", "max_tokens": 2},
                           timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
