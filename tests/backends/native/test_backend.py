"""The native engine through the Backend protocol: sampling semantics, streaming, cancellation, bad input."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from backends.base import GenerationRequest, InvalidRequestError, SamplingParams
from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from backends.tokenizer import IncrementalDetokenizer

_ids = itertools.count()


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer):
    engine = LLMEngine(EngineConfig(max_model_len=512, num_blocks=64), tokenizer=smollm2_tokenizer)
    b = NativeBackend("smollm2", engine=engine)
    asyncio.run(b.start())
    yield b
    asyncio.run(b.close())


def _req(prompt=None, messages=None, **params) -> GenerationRequest:
    return GenerationRequest(f"t{next(_ids)}", "smollm2", SamplingParams(**params), prompt=prompt, messages=messages)


async def _collect(backend, request):
    chunks = [c async for c in backend.stream(request)]
    return chunks, "".join(c.text for c in chunks)


def run(coro):
    return asyncio.run(coro)


def _all_blocks_free(backend) -> bool:
    bm = backend.engine.blocks
    return bm.num_free_blocks == bm.num_blocks


async def _wait_all_free(backend, timeout=10.0) -> bool:
    for _ in range(int(timeout / 0.05)):
        if _all_blocks_free(backend) and not backend.engine.has_unfinished():
            return True
        await asyncio.sleep(0.05)
    return False


def test_chat_stream_ends_with_usage(backend):
    chunks, text = run(_collect(backend, _req(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                              max_tokens=30, temperature=0)))
    assert "Paris" in text
    last = chunks[-1]
    assert last.finish_reason == "stop" and last.usage.completion_tokens == sum(len(c.token_ids) for c in chunks)
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert _all_blocks_free(backend)


def test_max_tokens_gives_length(backend):
    chunks, _ = run(_collect(backend, _req(prompt="Once upon a time", max_tokens=5, temperature=0, ignore_eos=True)))
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5


def test_same_seed_same_output_whatever_the_batch(backend):
    kw = dict(prompt="The best thing about the weekend is", max_tokens=24, temperature=1.0, seed=1234)
    alone = run(_collect(backend, _req(**kw)))[1]

    async def crowded():
        others = [asyncio.create_task(_collect(backend, _req(prompt=f"Story number {i}:", max_tokens=20,
                                                            temperature=1.0))) for i in range(5)]
        mine = await _collect(backend, _req(**kw))
        await asyncio.gather(*others)
        return mine[1]

    assert run(crowded()) == alone
    different_seed = run(_collect(backend, _req(**{**kw, "seed": 99})))[1]
    assert different_seed != alone


def test_stop_string_is_cut_and_never_streamed(backend):
    free_run = run(_collect(backend, _req(prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0)))[1]
    assert " 7," in free_run
    chunks, text = run(_collect(backend, _req(prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0, stop=[" 7,"])))
    assert chunks[-1].finish_reason == "stop"
    assert text == free_run[: free_run.index(" 7,")]
    assert all(" 7" not in c.text for c in chunks)


def test_stop_token_ids_and_min_tokens(backend):
    greedy = run(_collect(backend, _req(prompt="1, 2, 3, 4, 5,", max_tokens=6, temperature=0, ignore_eos=True)))[0]
    ids = [t for c in greedy for t in c.token_ids]
    chunks, _ = run(_collect(backend, _req(prompt="1, 2, 3, 4, 5,", max_tokens=6, temperature=0,
                                           stop_token_ids=[ids[2]])))
    assert [t for c in chunks for t in c.token_ids] == ids[:3] and chunks[-1].finish_reason == "stop"
    # min_tokens suppresses the stop token until enough tokens exist.
    chunks, _ = run(_collect(backend, _req(prompt="1, 2, 3, 4, 5,", max_tokens=6, temperature=0,
                                           stop_token_ids=[ids[0]], min_tokens=2)))
    assert chunks[0].token_ids != [ids[0]] and sum(len(c.token_ids) for c in chunks) >= 2


def test_logprobs_top_n(backend):
    chunks, _ = run(_collect(backend, _req(prompt="Paris is the capital of", max_tokens=3, temperature=0, logprobs=4)))
    for c in chunks:
        (lp,) = c.logprobs
        assert len(lp.top) == 4
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.logprob <= 0 and abs(lp.top[0][2] - lp.logprob) < 1e-6


def test_penalties_change_greedy_repetition(backend):
    kw = dict(prompt="the the the the the the", max_tokens=12, temperature=0, ignore_eos=True)
    plain = run(_collect(backend, _req(**kw)))[1]
    penalised = run(_collect(backend, _req(**kw, repetition_penalty=2.0, frequency_penalty=1.5)))[1]
    assert plain.count("the") > penalised.count("the")


def test_top_k_1_is_greedy(backend):
    kw = dict(prompt="Water boils at", max_tokens=10)
    greedy = run(_collect(backend, _req(**kw, temperature=0)))[1]
    assert run(_collect(backend, _req(**kw, temperature=0.8, top_k=1, seed=5)))[1] == greedy
    assert run(_collect(backend, _req(**kw, temperature=0.8, top_p=1e-6, seed=5)))[1] == greedy
    assert run(_collect(backend, _req(**kw, temperature=0.8, min_p=1.0, seed=5)))[1] == greedy


def test_cancelled_streams_free_their_blocks(backend):
    async def cancel_midway(i):
        async for chunk in backend.stream(_req(prompt=f"Tell me a long story {i}", max_tokens=200,
                                                temperature=0.5, ignore_eos=True)):
            if chunk.token_ids and i % 2:
                break  # closes the iterator: the engine must abort the sequence
        return True

    async def main():
        tasks = [asyncio.create_task(cancel_midway(i)) for i in range(8)]
        await asyncio.sleep(0.5)
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks[2::2]:  # the even ones ran to completion
            assert t.result() is True
        return await _wait_all_free(backend)

    assert run(main())


@pytest.mark.parametrize("request_kwargs, param", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt="word " * 600), "input_tokens"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=600), "input_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-2), "top_k"),
    (dict(prompt="hi", min_p=2.0), "min_p"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="hi", logprobs=50), "logprobs"),
    (dict(prompt=[1, 2, 10**9]), "prompt"),
    (dict(prompt=[-1]), "prompt"),
    (dict(prompt="bad \ud800 surrogate"), "prompt"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
])
def test_bad_input_is_a_typed_error_and_leaks_nothing(backend, request_kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        run(_collect(backend, _req(**request_kwargs)))
    assert err.value.param == param and err.value.message
    assert run(_wait_all_free(backend))


def test_incremental_detokenizer_never_splits_utf8(smollm2_tokenizer):
    text = "Grüße aus Köln! 世界你好 🎉🚀 naïve café"
    ids = smollm2_tokenizer.encode(text)
    detok = IncrementalDetokenizer(smollm2_tokenizer, [])
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == smollm2_tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
