"""Workloads: exact prompt lengths as the target counts them, shared prefixes, datasets, seeding."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import pytest

from loadtest.mock_server import create_mock_app
from loadtest.workload import LocalCounter, ServerCounter, fit, from_file, synthetic
from tests.servers import serve_app


def test_synthetic_prompts_have_exact_token_counts(smollm2_tokenizer):
    specs = synthetic(smollm2_tokenizer, 30, (5, 300), (4, 9), seed=3)
    for s in specs:
        assert len(smollm2_tokenizer.encode(s.prompt, add_special_tokens=False)) == s.prompt_tokens
        assert 5 <= s.prompt_tokens <= 300 and 4 <= s.max_tokens <= 9
    assert [s.prompt for s in specs] == [s.prompt for s in synthetic(smollm2_tokenizer, 30, (5, 300), (4, 9), seed=3)]


def test_shared_prefix_workload_is_equal_groups_in_random_order(smollm2_tokenizer):
    specs = synthetic(smollm2_tokenizer, 12, 100, 8, seed=0, prefix_len=64, num_prefixes=2)
    assert all(len(smollm2_tokenizer.encode(s.prompt, add_special_tokens=False)) == 100 for s in specs)
    heads = [tuple(smollm2_tokenizer.encode(s.prompt, add_special_tokens=False)[:48]) for s in specs]
    assert sorted(Counter(heads).values()) == [6, 6]
    # not cycling: a router sending request i to replica i % n would otherwise pair each prefix with a replica
    assert [heads[i] == heads[0] for i in range(12)] != [i % 2 == 0 for i in range(12)]


def test_datasets_jsonl_sharegpt_alpaca(tmp_path, smollm2_tokenizer):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hello there", "max_tokens": 7}\n{"prompt": "bye"}\n')
    specs = from_file(jsonl, smollm2_tokenizer, None, None)
    assert sorted((s.prompt, s.max_tokens) for s in specs) == [("bye", 128), ("hello there", 7)]

    share = tmp_path / "share.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": "What is 2+2?"},
                                                    {"from": "gpt", "value": "It is four."}]},
                                 {"conversations": [{"from": "human", "value": "lonely"}]}]))
    (spec,) = from_file(share, smollm2_tokenizer, None, None)
    assert spec.prompt == "What is 2+2?" and spec.max_tokens == len(smollm2_tokenizer.encode("It is four."))

    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Summarise", "input": "a text", "output": "short"}]))
    (spec,) = from_file(alpaca, smollm2_tokenizer, None, 5)
    assert spec.prompt == "Summarise\n\na text" and spec.max_tokens == 5

    for name, content in [("bad.json", json.dumps([{"x": 1}])), ("broken.jsonl", '{"prompt": "a"}\n{oops\n'),
                          ("noprompt.jsonl", '{"text": "a"}\n'), ("object.json", '{"a": 1}')]:
        bad = tmp_path / name
        bad.write_text(content)
        with pytest.raises(ValueError, match=name):
            from_file(bad, smollm2_tokenizer, None, None)


class _WithBos:
    """The embedded tokenizer as one that adds a BOS token (as Llama's does) when asked for special tokens."""

    def __init__(self, tok) -> None:
        self.tok, self.hf = tok, tok.hf

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens)


def test_chat_prompts_land_on_the_asked_length_with_the_template_counted(smollm2_tokenizer):
    # SmolLM2's template (with its default system prompt) adds 30 tokens: 128 planned became 158
    counter = LocalCounter(smollm2_tokenizer, chat=True, name="smollm2")
    specs = asyncio.run(fit(synthetic(smollm2_tokenizer, 8, (40, 128), 4, seed=1), counter))
    for s in specs:
        assert len(smollm2_tokenizer.apply_chat_template([{"role": "user", "content": s.prompt}])) == s.prompt_tokens
    assert {s.prompt_tokens for s in specs} <= set(range(40, 129))


def test_special_tokens_the_target_adds_count_towards_the_length(smollm2_tokenizer):
    # vLLM's random dataset subtracts tokenizer.num_special_tokens_to_add() from the asked length
    tok = _WithBos(smollm2_tokenizer)
    (spec,) = asyncio.run(fit(synthetic(tok, 1, 64, 4, seed=2), LocalCounter(tok, chat=False, name="bos")))
    assert spec.prompt_tokens == 64 and len(tok.encode(spec.prompt)) == 64
    assert len(tok.encode(spec.prompt, add_special_tokens=False)) == 63


def test_a_length_below_the_template_overhead_is_refused(smollm2_tokenizer):
    counter = LocalCounter(smollm2_tokenizer, chat=True, name="smollm2")
    with pytest.raises(ValueError, match="chat template"):
        asyncio.run(fit(synthetic(smollm2_tokenizer, 1, 10, 4), counter))


def test_dataset_prompts_are_recounted_never_cut(tmp_path, smollm2_tokenizer):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hello there, how are you today?"}\n')
    counter = LocalCounter(smollm2_tokenizer, chat=True, name="smollm2")
    (spec,) = asyncio.run(fit(from_file(jsonl, smollm2_tokenizer, None, 8), counter, exact=False))
    assert spec.prompt == "hello there, how are you today?"
    assert spec.prompt_tokens == len(smollm2_tokenizer.apply_chat_template([{"role": "user", "content": spec.prompt}]))


def test_the_server_counter_speaks_vllms_tokenize_routes(smollm2_tokenizer):
    with serve_app(create_mock_app("m", tokenizer=smollm2_tokenizer)) as url:
        async def main():
            async with aiohttp.ClientSession() as http:
                counter = ServerCounter(http, url, "m", chat=True)
                assert await counter.works()
                return await fit(synthetic(smollm2_tokenizer, 3, 50, 4, seed=3), counter)

        specs = asyncio.run(main())
    for s in specs:
        assert len(smollm2_tokenizer.apply_chat_template([{"role": "user", "content": s.prompt}])) == 50


def test_the_server_counter_survives_a_connection_the_server_closed_while_the_client_was_busy(smollm2_tokenizer):
    """Building 1000 prompts keeps the client's event loop busy for seconds (12 s on a GPU machine's host): the
    server closes the idle keep-alive connection meanwhile, unseen, and the next /tokenize must not fail on it."""
    import time

    with serve_app(create_mock_app("m", tokenizer=smollm2_tokenizer), timeout_keep_alive=0.2) as url:
        async def main():
            async with aiohttp.ClientSession() as http:
                counter = ServerCounter(http, url, "m", chat=False)
                first = await counter.count("Hello there")
                time.sleep(1.0)  # busy, not awaiting: the server's close is not read
                return first, await counter.count("Hello there"), await counter.encode("Hello there")

        first, again, ids = asyncio.run(main())
    assert first == again and ids == smollm2_tokenizer.encode("Hello there", add_special_tokens=False)


def test_the_server_counter_survives_a_connection_reset_as_its_request_goes_out():
    """The other side of the same race: the server's close arrives as the request is written (a reset), seen as
    aiohttp's ClientOSError rather than a disconnect; /tokenize changes nothing, so it goes again once."""
    import socket
    import struct

    async def main():
        connections = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(writer)
            if len(connections) == 1:  # reset at once, as a server dropping a connection it timed out does
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            await reader.readuntil(b"\r\n\r\n")
            body = json.dumps({"count": 5}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, aiohttp.ClientSession() as http:
            return await ServerCounter(http, url, "m", chat=False).count("x " * 50_000), len(connections)

    assert asyncio.run(main()) == (5, 2)
