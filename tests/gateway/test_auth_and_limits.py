"""API keys, per-key rate limits (in memory and shared through a real Redis), and backend queue limits."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import Limits, Settings, hash_key
from gateway.limits import RedisRateLimiter
from gateway.service import Gateway
from tests.conftest import MODEL
from tests.servers import free_port, redis_server, serve_app

BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


WINDOW_S = Limits().window_s


def _fresh_window() -> None:
    """Limits count in fixed one-minute windows: start a counting test well inside one."""
    into = time.time() % WINDOW_S
    if into > WINDOW_S - 15:
        time.sleep(WINDOW_S - into + 0.1)


def _post(url, key=None, body=BODY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def test_keys_guard_v1_routes_but_not_health(start_gateway):
    keys = [{"name": "alice", "key": "sk-alice"}, {"name": "bob", "sha256": hash_key("sk-bob")}]
    with start_gateway(api_keys=keys) as (url, gateway):
        assert all(k.key is None for k in gateway.settings.api_keys)  # only hashes are kept
        assert _post(url).status_code == 401
        r = _post(url, "sk-wrong")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert _post(url, "sk-alice").status_code == 200
        assert _post(url, "sk-bob").status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-nope", max_retries=0).models.list()


def test_metrics_can_require_a_key(start_gateway):
    with start_gateway(api_keys=[{"key": "sk-ops"}], protect_metrics=True) as (url, _):
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk-ops"}).status_code == 200


def test_requests_per_minute_limit_is_429_with_retry_after(start_gateway):
    _fresh_window()
    with start_gateway(api_keys=[{"name": "tiny", "key": "sk-t", "requests_per_minute": 3}]) as (url, _):
        codes = [_post(url, "sk-t").status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        r = _post(url, "sk-t")
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-t", max_retries=0).completions.create(
                model=MODEL, prompt="x", max_tokens=1)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'burstgate:rate_limited_requests_total{key="tiny"} 3.0' in metrics


def test_tokens_per_minute_limit_reserves_what_a_request_may_use_and_charges_what_it_used(start_gateway):
    """As OpenAI counts it: a request reserves its prompt (estimated at 4 characters a token) and its max_tokens,
    is refused when that would pass the budget, and is charged what it really used once it ends."""
    _fresh_window()
    with start_gateway(api_keys=[{"name": "tok", "key": "sk-k", "tokens_per_minute": 21}]) as (url, _):
        body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True}  # reserves 3 + 8
        assert _post(url, "sk-k", body).status_code == 200  # used 2 + 8: 10 spent
        assert _post(url, "sk-k", body).status_code == 200  # 10 + 11 fits; used 10: 20 spent
        refused = _post(url, "sk-k", body)  # 20 + 11 does not
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        too_large = _post(url, "sk-k", {**body, "max_tokens": 30})  # more than the whole budget: never fits
        assert too_large.status_code == 429 and "Request too large" in too_large.json()["error"]["message"]


def test_tokens_of_an_abandoned_stream_are_charged_and_counted(start_gateway, engine_idle):
    """Through an OpenAI deployment, whose upstream reports usage only at the end: a stream abandoned
    before then is charged, and counted, for the tokens it got."""
    _fresh_window()
    with start_gateway() as (upstream, _):
        settings = Settings(api_keys=[{"name": "tok", "key": "sk-k", "tokens_per_minute": 150}], models=[
            {"name": MODEL, "deployments": [{"kind": "openai", "url": f"{upstream}/v1", "upstream_model": MODEL}]}])
        with serve_app(create_app(Gateway.from_settings(settings))) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-k", max_retries=0)
            stream = client.completions.create(model=MODEL, prompt="Count:", max_tokens=100, stream=True,
                                               extra_body={"ignore_eos": True})  # reserves 2 + 100 of 150
            for received, _ in enumerate(stream, start=1):
                if received == 12:  # no usage has come yet
                    break
            stream.close()
            time.sleep(0.5)  # the gateway sees the hang-up and ends the attempt
            metrics = httpx.get(f"{url}/metrics").text
            counted = next(float(line.split()[-1]) for line in metrics.splitlines()
                           if line.startswith("burstgate:generation_tokens_total{"))
            assert 12 <= counted < 100  # what it generated before the hang-up, not its max_tokens
            # charged those, not its reservation: another 2 + 100 fits in what is left, a third does not
            again = {"model": MODEL, "prompt": "Count:", "max_tokens": 100, "ignore_eos": True}
            assert _post(url, "sk-k", again).status_code == 200
            assert _post(url, "sk-k", again).status_code == 429


def test_limits_are_shared_across_replicas_through_redis(start_gateway):
    _fresh_window()
    key = [{"name": "shared", "key": "sk-s", "requests_per_minute": 4}]
    with redis_server() as redis_url:
        with start_gateway(api_keys=key, rate_limiter=RedisRateLimiter(redis_url)) as (a, _), \
                start_gateway(api_keys=key, rate_limiter=RedisRateLimiter(redis_url)) as (b, _):
            codes = [_post(url, "sk-s").status_code for url in (a, b, a, b, a, b)]
    assert codes == [200, 200, 200, 200, 429, 429]


def test_unreachable_redis_keeps_limits_per_replica_instead_of_failing(start_gateway):
    _fresh_window()
    key = [{"name": "solo", "key": "sk-r", "requests_per_minute": 2}]
    limiter = RedisRateLimiter(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with start_gateway(api_keys=key, rate_limiter=limiter) as (url, _):
        codes = [_post(url, "sk-r").status_code for _ in range(3)]
    assert codes == [200, 200, 429] and limiter.redis_down


def test_full_backend_queue_answers_429(start_gateway, engine_idle):
    async def burst(url):
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": MODEL, "prompt": "Tell a story", "max_tokens": 40, "ignore_eos": True}
            return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for _ in range(8)))

    with start_gateway(max_concurrency=2, max_queue=2) as (url, _):
        responses = asyncio.run(burst(url))
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) == 4 and codes.count(429) == 4
    assert all("Retry-After" in r.headers for r in responses if r.status_code == 429)


def test_tokens_used_beyond_a_reservation_are_charged_to_the_window_they_are_used_in():
    """A request without max_tokens reserves only its prompt; what it generates is charged when it ends, to the
    window then (its admission's may have passed: charged there, no budget would ever see it)."""
    from gateway.limits import KeyLimits, RateLimiter

    async def scenario():
        limiter, limits = RateLimiter(window_s=0.5), KeyLimits(tokens_per_minute=1000)
        admitted_in = await limiter.admit("k", limits, reserve_tokens=10)
        while limiter.window() == admitted_in:
            await asyncio.sleep(0.05)
        await limiter.settle("k", limits, admitted_in, reserved=10, used=300)
        return limiter._counts[f"tok:k:{admitted_in}"], limiter._counts[f"tok:k:{limiter.window()}"]

    assert asyncio.run(scenario()) == (10, 290)
