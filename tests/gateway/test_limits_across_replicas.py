"""Rate limits hold exactly across gateway replicas, under twice the load they allow and through a Redis outage
(gateway/limits.py): two ``burstgate serve`` processes sharing one real redis-server, in front of one mock
upstream process, driven at a constant rate. Windows are 3 s instead of a minute (``limits.window_s``) so that
several pass in a test; benchmarks/limits_across_replicas.py runs the minute-long version.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import redis
import redis.asyncio
import yaml

from tests.servers import free_port, spawn_mock_server, start_burstgates, wait_for_port

WINDOW_S = 3.0
REQUESTS = 20  # per window, key "req"
TOKENS = 900  # per window, key "tok": requests of 3 prompt tokens (ids) and up to 3 output tokens
TOKEN_BODY = {"model": "counted", "prompt": [1, 2, 3], "max_tokens": 3}


@contextlib.contextmanager
def redis_on(port: int) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc=proc)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def fleet(folder, redis_port: int, requests: int = REQUESTS, tokens: int = TOKENS,
          window_s: float = WINDOW_S) -> Iterator[list[str]]:
    """The mock upstream and two gateways sharing Redis (key "req": ``requests`` per window, key "tok": ``tokens``
    per window); yields the gateways' URLs."""
    mock_port = free_port()
    upstream = spawn_mock_server(mock_port, model="upstream", itl_ms=20)
    deployment = {"kind": "openai", "url": f"http://127.0.0.1:{mock_port}/v1", "upstream_model": "upstream"}
    config = folder / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "models": [{"name": "counted", "deployments": [deployment]}, {"name": "plain", "deployments": [deployment]}],
        "api_keys": [{"name": "req", "key": "k-req", "requests_per_minute": requests},
                     {"name": "tok", "key": "k-tok", "tokens_per_minute": tokens}],
        "limits": {"redis_url": f"redis://127.0.0.1:{redis_port}/0", "window_s": window_s}}))
    gateways = []
    try:
        gateways = start_burstgates(*[["--config", str(config)]] * 2)
        warm_up([g.url for g in gateways])
        yield [g.url for g in gateways]
    finally:
        for process in [*(g.proc for g in gateways), upstream]:
            process.terminate()
            process.wait(timeout=30)


def warm_up(urls: list[str]) -> None:
    """One request of each key through each gateway, before the windows a test counts: a gateway's first requests
    (connections opened, code paths run once) can take long enough on a loaded machine to be admitted a window
    late, leaving the first counted window short of its limit."""
    for url in urls:
        for key, body in (("k-req", {"model": "plain", "prompt": "Hi", "max_tokens": 2}), ("k-tok", TOKEN_BODY)):
            response = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                  timeout=30)
            assert response.status_code == 200, response.text


def window_of(t: float, window_s: float = WINDOW_S) -> int:
    return int(t // window_s)


async def drive(urls: list[str], key: str, rate: float, windows: int, body: dict, stream_every: int = 0,
                window_s: float = WINDOW_S) -> list[tuple[int, int]]:
    """``rate`` requests/s (on a schedule, not a pause between sends) for ``windows`` whole windows, alternating the gateways, none sent within 0.8 s of a
    window's end (so each is admitted in the window it was sent in, even on a loaded machine); every ``stream_every``-th request is streamed
    and every other such one abandoned after its first chunk. Returns (window, status) per request."""
    start = (window_of(time.time(), window_s) + 1) * window_s
    await asyncio.sleep(start - time.time())
    results: list[tuple[int, int]] = []
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {key}"}) as client:
        async def one(i: int, sent: float) -> None:
            url = f"{urls[i % 2]}/v1/completions"
            if stream_every and i % stream_every == 0:
                async with client.stream("POST", url, json={**body, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        if (i // stream_every) % 2:
                            break  # abandoned: charged what it got
                status = r.status_code
            else:
                status = (await client.post(url, json=body)).status_code
            results.append((window_of(sent, window_s), status))

        tasks, i, tick = [], 0, 0
        while (due := start + tick / rate) < start + windows * window_s:
            tick += 1
            await asyncio.sleep(due - time.time())  # on schedule; a loop fallen behind catches up at once
            if (now := time.time()) % window_s < window_s - 0.8:
                tasks.append(asyncio.create_task(one(i, now)))
                i += 1
        await asyncio.gather(*tasks)
    return results


def admitted(results: list[tuple[int, int]]) -> Counter:
    assert {status for _, status in results} <= {200, 429}
    return Counter(window for window, status in results if status == 200)


def counted_tokens(urls: list[str]) -> float:
    """Tokens the gateways' metrics say model "counted" used, both replicas together."""
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith(("burstgate:prompt_tokens_total{", "burstgate:generation_tokens_total{")) \
                    and 'model="counted"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_replicas_admit_exactly_each_limit_under_twice_the_load_and_charge_each_token_once(tmp_path):
    redis_port = free_port()
    with redis_on(redis_port), fleet(tmp_path, redis_port) as urls:
        charged: dict[int, int] = {}
        warmed_up = counted_tokens(urls)
        requests, tokens, _ = asyncio.run(_both(urls, redis.asyncio.Redis(port=redis_port), charged))
        in_metrics = counted_tokens(urls) - warmed_up
    assert set(admitted(requests).values()) == {REQUESTS}  # every window: exactly the limit, over both replicas
    assert len(admitted(requests)) == 4
    assert len(admitted(tokens)) == 4 and 429 in {status for _, status in tokens}  # the budget bound, each window
    assert all(0.99 * TOKENS <= c <= TOKENS for c in charged.values()), charged  # within 1%, never over
    assert sum(charged.values()) == in_metrics  # streamed, abandoned and folded: each token charged once


async def _both(urls: list[str], shared: redis.asyncio.Redis, charged: dict[int, int]):
    return await asyncio.gather(drive(urls, "k-req", 2 * REQUESTS / WINDOW_S, 4, {"model": "plain", "prompt": "Hi",
                                                                                "max_tokens": 2}),
                                drive(urls, "k-tok", 2 * TOKENS / 6 / WINDOW_S, 4, TOKEN_BODY, stream_every=3),
                                read_windows(shared, 4, charged))


async def read_windows(shared: redis.asyncio.Redis, windows: int, charged: dict[int, int | None],
                       window_s: float = WINDOW_S) -> None:
    """Each window's tokens as Redis holds them 1 s after it ended (its requests settled; before the key expires);
    None where Redis did not answer."""
    first = window_of(time.time(), window_s) + 1
    for w in range(first, first + windows):
        await asyncio.sleep((w + 1) * window_s + 1.0 - time.time())
        try:
            charged[w] = int(await shared.get(f"burstgate:tok:tok:{w}") or 0)
        except redis.RedisError:
            charged[w] = None
    await shared.aclose()


def test_through_a_redis_outage_each_replica_limits_alone_and_they_agree_again_when_it_returns(tmp_path):
    redis_port = free_port()
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(redis_on(redis_port))
        urls = stack.enter_context(fleet(tmp_path, redis_port))

        async def scenario():
            load = asyncio.create_task(drive(urls, "k-req", 2 * REQUESTS / WINDOW_S, 6,
                                             {"model": "plain", "prompt": "Hi", "max_tokens": 2}))
            start = (window_of(time.time()) + 1) * WINDOW_S
            await asyncio.sleep(start + 1.5 * WINDOW_S - time.time())  # Redis dies halfway through window 1
            first.kill()
            await asyncio.sleep(start + 3.5 * WINDOW_S - time.time())  # window 2 passes without it entirely
            back = await asyncio.to_thread(stack.enter_context, redis_on(redis_port))  # back (empty) in window 3
            assert back.poll() is None
            return start, await load

        start, results = asyncio.run(scenario())
    per_window = admitted(results)
    windows = [window_of(start) + k for k in range(6)]
    assert per_window[windows[0]] == REQUESTS  # shared
    assert REQUESTS <= per_window[windows[1]] <= 2 * REQUESTS  # went on from the count Redis gave each
    assert REQUESTS < per_window[windows[2]] <= 2 * REQUESTS  # each replica its own limit
    assert REQUESTS <= per_window[windows[3]] <= 2 * REQUESTS  # Redis back halfway, from nothing
    assert per_window[windows[4]] == per_window[windows[5]] == REQUESTS  # shared, exact again
