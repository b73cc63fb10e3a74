"""One workload against one target: the timed window, warm-up, and what the run flags, against small real
servers on 127.0.0.1 that misbehave in one way each."""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from loadtest.client import RequestOptions, Target
from loadtest.metrics import RequestRecord
from loadtest.runner import RunConfig, TargetResult, run_target
from loadtest.workload import RequestSpec
from tests.servers import serve_app


def _server(seen: list[str], tokens: int | None = None, prompt_tokens: int | None = None,
            stall_unless: str | None = None, stall_s: float = 30.0) -> Starlette:
    """Streams ``tokens`` tokens (default: max_tokens) and reports usage; stalls prompts without ``stall_unless``."""

    async def handler(request: Request):
        body = json.loads(await request.body())
        seen.append(body["prompt"])
        n = tokens or body["max_tokens"]

        async def stream():
            if stall_unless is not None and stall_unless not in body["prompt"]:
                await asyncio.sleep(stall_s)
            for i in range(n):
                yield _event({"choices": [{"index": 0, "text": " x", "finish_reason": "stop" if i == n - 1 else None}]})
            usage = {"prompt_tokens": prompt_tokens or len(body["prompt"].split()), "completion_tokens": n}
            yield _event({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", handler, methods=["POST"])])


def _event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def _run(app: Starlette, specs: list[RequestSpec], cfg: RunConfig = RunConfig(), warmup=()):
    with serve_app(app) as url:
        return asyncio.run(asyncio.wait_for(run_target(Target(url, "m"), specs, cfg, warmup=warmup), 60))


def test_the_run_lasts_until_every_request_has_ended_timeouts_included():
    # 5 answered at once, 5 silent until the 1 s request timeout: vLLM's bench times gather() of all of them
    specs = [RequestSpec(f"fast {i}" if i % 2 else f"slow {i}", 2, 3) for i in range(10)]
    cfg = RunConfig(request=RequestOptions(timeout_s=1.0))
    result = _run(_server([], stall_unless="fast"), specs, cfg)
    s, t0 = result.summary, result.records[0].target_send
    assert s["completed"] == 5 and s["failures_by_kind"] == {"timeout": 5}
    assert s["duration"] >= max(r.end for r in result.records) - t0 >= 1.0
    assert s["request_throughput"] <= 5 / 1.0


def test_a_request_queued_longer_than_the_stall_timeout_is_still_measured():
    # In a burst the last requests wait for their first byte as long as the server takes to reach them (a
    # 200-request burst on a CPU: minutes); the stall timeout only bounds silences once a stream has begun.
    specs = [RequestSpec(f"queued {i}", 2, 3) for i in range(3)]
    cfg = RunConfig(request=RequestOptions(stall_timeout_s=0.3, timeout_s=20.0))
    result = _run(_server([], stall_unless="fast", stall_s=1.0), specs, cfg)
    assert result.summary["completed"] == 3 and result.summary["failed"] == 0
    assert all(r.ttft >= 1.0 for r in result.records)


def test_warm_up_requests_go_first_and_stay_out_of_the_numbers():
    seen: list[str] = []
    specs = [RequestSpec(f"measured {i}", 2, 2) for i in range(3)]
    result = _run(_server(seen), specs, warmup=[RequestSpec(f"warm {i}", 2, 2) for i in range(2)])
    assert sorted(seen[:2]) == ["warm 0", "warm 1"] and len(seen) == 5
    assert result.summary["completed"] == 3 and result.summary["warmup_requests"] == 2


def test_server_prompt_counts_that_differ_from_the_plan_are_flagged_and_used():
    result = _run(_server([], prompt_tokens=9), [RequestSpec("a b", 2, 2)] * 4)
    assert result.summary["prompt_tokens_mismatched"] == 4 and result.summary["total_input_tokens"] == 36
    assert all(r.planned_prompt_tokens == 2 and r.prompt_tokens == 9 for r in result.records)
    assert any("prompt lengths" in w for w in result.warnings)


def test_a_target_ignoring_ignore_eos_is_flagged_per_request():
    cfg = RunConfig(request=RequestOptions(ignore_eos=True))
    result = _run(_server([], tokens=1), [RequestSpec("a", 1, 5)] * 3, cfg)
    assert result.summary["short_outputs"] == 3 and all(r.short_output for r in result.records)
    assert any("ignore_eos" in w for w in result.warnings)
    fine = _run(_server([]), [RequestSpec("a", 1, 5)] * 3, cfg)
    assert fine.summary["short_outputs"] == 0 and not any("ignore_eos" in w for w in fine.warnings)


def test_a_results_repr_leaves_out_its_chunk_times():
    # asyncio.run reprs its finished task's result (restoring the SIGINT handler): a repr of every chunk time of a
    # long run took a second of the client's CPU
    records = [RequestRecord(i, 0.0, chunk_times=[0.001 * k for k in range(4096)]) for i in range(64)]
    result = TargetResult(Target.parse("http://127.0.0.1:1#m"), RunConfig(), records, {})
    assert len(repr(result)) < 10_000 and len(repr(records)) < 1_000 * len(records)
