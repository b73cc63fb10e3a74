"""What every split of a model over ranks must hold, whichever the split (tensor, pipeline, both) and the executor
(processes, Ray): the weight bytes of each rank's part, and a rank lost mid-burst failing every request in flight
(none hangs) and the deployment's health."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import httpx

from backends.native.backend import NativeBackend
from backends.native.engine import LLMEngine
from gateway.app import create_app
from gateway.config import Settings
from gateway.deployments import Deployment
from gateway.limits import ConcurrencyLimiter
from gateway.routing import ModelGroup
from gateway.service import Gateway
from tests.servers import serve_app


def rank_weight_bytes(cfg, tp: int = 1, layers: int | None = None, first: bool = True, last: bool = True) -> int:
    """fp32 weight bytes one of ``tp`` ranks of a stage holds: its shards of ``layers`` layers (default: all), the
    embedding table's rows on the first stage, the norm and LM head's rows on the last (its own copy of a tied
    table unless the stage is also the first), and what every rank holds whole (norms, a KV head shared by several
    ranks, the vocabulary padding)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size // tp
    q, kv = cfg.num_heads // tp * d, max(cfg.num_kv_heads // tp, 1) * d
    vocab_rows = -(-cfg.vocab_size // tp) * h
    tables = (first + last) if not (first and last) else (1 if cfg.tie_word_embeddings else 2)
    layer = (q + 2 * kv) * h + h * q + 3 * inter * h + 2 * h
    return 4 * (vocab_rows * tables + (cfg.num_layers if layers is None else layers) * layer + (h if last else 0))


@contextlib.contextmanager
def served(engine: LLMEngine, model: str = "split") -> Iterator[str]:
    """``engine`` behind a gateway that checks its health every 0.2 s; yields the gateway's URL."""
    backend = NativeBackend(model, engine=engine)
    group = ModelGroup(model, [Deployment(name=f"{model}-0", backend=backend, limiter=ConcurrencyLimiter(64, 64))])
    gateway = Gateway(Settings(resilience={"health_interval_s": 0.2}), [group])
    with serve_app(create_app(gateway)) as url:
        yield url


def assert_losing_a_rank_fails_requests_and_health(url: str, model: str, lose_a_rank: Callable[[], None]) -> None:
    """Start 8 streamed completions at ``url``, call ``lose_a_rank`` once tokens flow: every one must end with an
    error (none hangs) and the deployment must report unhealthy."""
    results: list[str] = []
    events = threading.Semaphore(0)  # one release per streamed line received

    def one_request(i: int) -> None:
        body = {"model": model, "prompt": f"Count to a thousand, take {i}:", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    events.release()
            results.append("error" if r.status_code != 200 or '"error"' in "".join(lines) else "ok")
        except httpx.HTTPError:
            results.append("error")

    clients = [threading.Thread(target=one_request, args=(i,)) for i in range(8)]
    for c in clients:
        c.start()
    for _ in range(20):  # the burst is under way
        assert events.acquire(timeout=120), "no tokens flow"
    lose_a_rank()
    for c in clients:
        c.join(timeout=60)
    assert not any(c.is_alive() for c in clients), "a request hangs"
    assert results == ["error"] * 8
    deadline = time.monotonic() + 10
    while True:
        deployments = httpx.get(f"{url}/admin/backends").json()["models"][0]["deployments"]
        if not any(d["healthy"] for d in deployments):
            break
        assert time.monotonic() < deadline, "the deployment still reports healthy"
        time.sleep(0.1)
