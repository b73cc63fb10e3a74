"""A whole session: the server's hardware and prompt counts come from the server, and every measurement gets
prompts of its own (no prefix cache serves a repeat), reproducible only when a seed is given."""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from gateway.info import describe, devices
from loadtest.client import RequestOptions, Target
from loadtest.runner import RunConfig
from loadtest.session import Session, Workload, run_session
from tests.conftest import MODEL
from tests.servers import serve_app


def _session(targets, points=None, seed=None, endpoint="completions", requests=3, input_len=16, warmup=1):
    points = points or [RunConfig(request=RequestOptions(endpoint=endpoint, ignore_eos=True))]
    return Session(targets, Workload(requests, input_len, 2), points, warmup, seed)


def _run(session, warnings=None):
    return asyncio.run(run_session(session, warn=(warnings if warnings is not None else []).append))


def test_a_burstgate_server_reports_its_hardware_and_counts_chat_prompts_exactly(start_gateway, engine_idle):
    with start_gateway() as (url, _):
        (result,) = _run(_session([Target(url, MODEL)], endpoint="chat", requests=4, input_len=48))
    s = result.summary
    assert s["hardware"] == describe(devices()) and s["hardware_source"] == "server /info"
    assert result.server_info["models"][0]["deployments"][0]["kind"] == "native"
    # the server's own usage.prompt_tokens: exactly the asked 48, its chat template included
    assert s["prompt_lengths_counted_by"] == "server /tokenize" and s["prompt_tokens_mismatched"] == 0
    assert [r.prompt_tokens for r in result.records] == [48] * 4 and s["total_input_tokens"] == 4 * 48
    assert s["warmup_requests"] == 1 and s["endpoint"] == "chat" and s["backend"] == "openai-chat"


def _recording(prompts: list[str]) -> Starlette:
    """An OpenAI completions server without /info or /tokenize that remembers every prompt."""

    async def handler(request: Request):
        body = json.loads(await request.body())
        prompts.append(body["prompt"])

        async def stream():
            for i in range(body["max_tokens"]):
                done = "length" if i == body["max_tokens"] - 1 else None
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': ' x', 'finish_reason': done}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", handler, methods=["POST"])])


def test_other_servers_need_their_hardware_declared():
    warnings: list[str] = []
    with serve_app(_recording([])) as url:
        declared, unknown = _run(_session([Target(url, "m", hardware="8x H100"), Target(url, "m")]), warnings)
    assert (declared.summary["hardware"], declared.summary["hardware_source"]) == ("8x H100", "declared")
    assert unknown.summary["hardware"] == "unknown" and any("URL#MODEL@HARDWARE" in w for w in warnings)
    # no /tokenize there: the local tokenizer counts; no usage: it re-counts the outputs too
    assert declared.summary["prompt_lengths_counted_by"].startswith("local tokenizer")
    assert declared.summary["output_tokens_counted_by_tokenizer"] == 3


def test_prompts_are_fresh_per_target_point_and_run_unless_a_seed_is_given():
    prompts: list[str] = []
    points = [RunConfig(concurrency=c, request=RequestOptions(ignore_eos=True)) for c in (1, 2)]
    with serve_app(_recording(prompts)) as url:
        targets = [Target(url, "m"), Target(url, "m", label="again")]

        def measured(seed):
            prompts.clear()
            _run(_session(targets, points, seed))
            sets = [prompts[i:i + 4] for i in range(0, len(prompts), 4)]  # per measurement: 1 warm-up + 3
            return [frozenset(s[1:]) for s in sets], {s[0] for s in sets}

        first, warm = measured(None)
        second, _ = measured(None)
        seeded, _ = measured(7)
        again, _ = measured(7)
    assert len(first) == 4 and len(set().union(*first)) == 12  # 2 targets x 2 points x 3 distinct prompts
    assert not warm & set().union(*first)  # warm-up on other prompts than the measured ones
    assert not set().union(*first) & set().union(*second)  # a second run is not served from a prefix cache
    assert seeded == again and seeded != first
