"""Soak: requests streamed, folded and abandoned at random points leave no memory growth, descriptor, task,
queued sequence or KV block behind. The suite runs a short soak on the shared engine; ``make soak`` runs
10,000 requests against ``burstgate serve`` with no config (the embedded default)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import pytest

from gateway.config import DEFAULT_MODEL_NAME
from tests.conftest import MODEL
from tests.gateway import soak
from tests.servers import burstgate_serve

SOAK_REQUESTS = int(os.environ.get("BURSTGATE_SOAK_REQUESTS", "0"))  # set by `make soak`


def test_a_short_soak_leaves_nothing_behind(start_gateway, engine_idle):
    with start_gateway() as (url, _):
        result = soak.run(url, MODEL, total=100, concurrency=16, warmup=40)
    assert result["outcomes"]["abandoned"] > 20 and result["outcomes"]["200"] > 20
    soak.check(result)


@pytest.mark.skipif(not SOAK_REQUESTS, reason="the long soak runs with `make soak`")
def test_soak_the_embedded_default():
    with burstgate_serve() as served:
        result = soak.run(served.url, DEFAULT_MODEL_NAME, total=SOAK_REQUESTS)
    result.update(command=f"make soak (BURSTGATE_SOAK_REQUESTS={SOAK_REQUESTS})", machine=platform.node(),
                  cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    out = Path(os.environ.get("BURSTGATE_SOAK_OUT", "benchmarks/results/soak.json"))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    soak.check(result)
