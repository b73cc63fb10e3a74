"""DeepSpeed: MII deployments over MII's REST wire format (tests/fakes/mii.py), and DeepSpeed-Inference
running for real in-process on this CPU, with transformers' greedy tokens, through the gateway."""

from __future__ import annotations

import asyncio

import pytest
import torch
from openai import OpenAI

from backends.base import GenerationRequest, InvalidRequestError, SamplingParams, UnavailableError, UpstreamError
from backends.mii import MIIConfig, MIIRestBackend
from gateway.app import create_app
from gateway.config import ModelRoute, Settings
from gateway.service import Gateway
from tests.backends.adapters import collect
from tests.backends.native.reference import hf_greedy
from tests.fakes.mii import create_mii_app
from tests.servers import serve_app


# ------------------------------------------------------------------------------------------ MII REST
@pytest.fixture(scope="module")
def mii_url():
    with serve_app(create_mii_app("toy-deployment")) as url:
        yield url


def run_mii(url: str, *, deployment="toy-deployment", cfg=None, **kw):
    return collect(lambda: MIIRestBackend("toy", MIIConfig(url=url, upstream_model=deployment,
                                                                  **(cfg or {}))), False, **kw)


def test_mii_answers_in_one_chunk_with_finish_reason_and_usage(mii_url):
    chunks, text = run_mii(mii_url, max_tokens=3, temperature=0.0)
    assert len(chunks) == 1 and text == " The quick brown" and chunks[0].finish_reason == "length"
    assert (chunks[0].usage.prompt_tokens, chunks[0].usage.completion_tokens) == (2, 3)
    chunks, text = run_mii(mii_url, max_tokens=50, temperature=0.5, top_k=5)
    assert text == " The quick brown fox jumps over the lazy dog ." and chunks[0].finish_reason == "stop"
    chunks, text = run_mii(mii_url, max_tokens=50, stop=[" lazy"])
    assert text == " The quick brown fox jumps over the" and chunks[0].finish_reason == "stop"


def test_mii_chat_needs_a_local_template(mii_url, smollm2_path):
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(InvalidRequestError, match="chat: template"):
        run_mii(mii_url, messages=messages)
    chunks, text = run_mii(mii_url, messages=messages, max_tokens=2,
                           cfg={"chat": "template", "tokenizer": str(smollm2_path)})
    assert text == " The quick" and chunks[0].usage.prompt_tokens > 2


def test_mii_errors(mii_url):
    with pytest.raises(InvalidRequestError, match="repetition_penalty is not supported"):
        run_mii(mii_url, repetition_penalty=1.2)
    with pytest.raises(InvalidRequestError, match="stop with more than one string"):
        run_mii(mii_url, max_tokens=5, stop=[" lazy", " dog"])
    with pytest.raises(UpstreamError, match="500"):
        run_mii(mii_url, prompt="CRASH please", max_tokens=5)
    with pytest.raises(UnavailableError, match="404"):
        run_mii(mii_url, deployment="no-such-deployment")


# ------------------------------------------------------------------------------- DeepSpeed-Inference
@pytest.fixture(scope="module")
def deepspeed_gateway():
    settings = Settings(models=[ModelRoute(name="ds", deployments=[dict(kind="deepspeed",
                                                                                    max_batch_size=8)])])
    with serve_app(create_app(Gateway.from_settings(settings))) as url:
        yield url


def test_deepspeed_inference_greedy_equals_transformers_through_the_gateway(deepspeed_gateway, hf_smollm2,
                                                                           smollm2_tokenizer):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far", "1, 2, 3, 4,"]
    client = OpenAI(base_url=f"{deepspeed_gateway}/v1", api_key="unused", max_retries=0)

    async def burst():  # together, so they share one padded batch
        from openai import AsyncOpenAI

        aclient = AsyncOpenAI(base_url=f"{deepspeed_gateway}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(aclient.completions.create(
            model="ds", prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}) for p in prompts))

    replies = asyncio.run(burst())
    for prompt, reply in zip(prompts, replies):
        expected, _ = hf_greedy(hf_smollm2, smollm2_tokenizer.encode(prompt), 16)
        assert reply.choices[0].text == smollm2_tokenizer.decode(expected), prompt
        assert reply.usage.completion_tokens == 16

    stream = client.chat.completions.create(model="ds", messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    events = list(stream)
    assert sum(1 for e in events if e.choices and e.choices[0].delta.content) >= 2  # streamed token by token
    assert events[-1].usage.completion_tokens <= 8


def test_deepspeed_inference_rejects_bad_input_and_survives_a_client_leaving(deepspeed_gateway):
    client = OpenAI(base_url=f"{deepspeed_gateway}/v1", api_key="unused", max_retries=0)
    import openai

    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="ds", prompt="hi", max_tokens=100_000)
    with client.completions.create(model="ds", prompt="Count:", max_tokens=200, stream=True) as stream:
        next(iter(stream))  # leave after the first token
    reply = client.completions.create(model="ds", prompt="Hello", max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_deepspeed_inference_keeps_rope_frequencies_in_fp32_under_bf16():
    from backends.deepspeed_config import DeepSpeedConfig
    from backends.deepspeed_inference import DeepSpeedInferenceBackend

    async def main():
        backend = DeepSpeedInferenceBackend("ds", DeepSpeedConfig(dtype="bfloat16"))
        await backend.start()
        try:
            rope = {n: b.dtype for n, b in backend.model.named_buffers() if "inv_freq" in n}
            weights = {p.dtype for p in backend.model.parameters()}
            request = GenerationRequest("r", "ds", SamplingParams(max_tokens=3, temperature=0), prompt="Hello")
            chunks = [c async for c in backend.stream(request)]
            return rope, weights, chunks
        finally:
            await backend.close()

    rope, weights, chunks = asyncio.run(main())
    assert rope and set(rope.values()) == {torch.float32} and weights == {torch.bfloat16}
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3


def test_deepspeed_inference_serves_random_weights_of_a_bare_config(tmp_path):
    """load_format dummy (vLLM's name): the shape of a config.json, no checkpoint read, the embedded tokenizer."""
    import json

    from backends.deepspeed_config import DeepSpeedConfig
    from backends.deepspeed_inference import DeepSpeedInferenceBackend

    config = tmp_path / "tiny-llama.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
                                  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}))

    async def main():
        backend = DeepSpeedInferenceBackend("ds", DeepSpeedConfig(model_path=str(config), load_format="dummy"))
        await backend.start()
        try:
            request = GenerationRequest("r", "ds", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                                        prompt="Hello there")
            chunks = [c async for c in backend.stream(request)]
            return backend.model.config, backend.max_model_len, chunks
        finally:
            await backend.close()

    shape, max_model_len, chunks = asyncio.run(main())
    assert (shape.num_hidden_layers, shape.hidden_size, max_model_len) == (2, 64, 256)
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 2  # "Hello there" in the embedded SmolLM2 tokenizer
