"""Property-based fuzzing of every route in /openapi.json (schemathesis): no input may cause a 5xx, and
every answer (status, content type, body) is one the document declares.

Runs against its own engine with a 64-token context so that every generated request stays short.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from gateway.app import create_app
from gateway.config import Settings
from gateway.deployments import Deployment
from gateway.limits import ConcurrencyLimiter
from gateway.routing import ModelGroup
from gateway.service import Gateway
from tests.conftest import MODEL
from tests.servers import serve_app


@pytest.fixture(scope="module")
def fuzz_url(smollm2_tokenizer):
    engine = LLMEngine(EngineConfig(max_model_len=64, num_blocks=64), tokenizer=smollm2_tokenizer)
    deployment = Deployment(name="native-0", backend=NativeBackend(MODEL, engine=engine),
                            limiter=ConcurrencyLimiter(256, 1024))
    gateway = Gateway(Settings(), [ModelGroup(MODEL, [deployment])])
    with serve_app(create_app(gateway)) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(fuzz_url):
    return schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")


ROUTES = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/chat/completions/render"),
          ("POST", "/v1/completions/render"), ("GET", "/health"), ("GET", "/ready"),
          ("GET", "/metrics"), ("GET", "/admin/backends"), ("GET", "/info"), ("POST", "/v1/responses"),
          ("GET", "/v1/responses/{response_id}"), ("GET", "/v1/responses/{response_id}/input_items"),
          ("POST", "/v1/responses/{response_id}/cancel"), ("DELETE", "/v1/responses/{response_id}")}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_no_input_causes_a_server_error_or_an_undocumented_answer(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == ROUTES  # every route, and only these
    for operation in operations:
        @given(case=operation.as_strategy(), served_model=st.booleans())
        @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)  # the same cases every CI run
        def check(case, served_model):
            if served_model and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # reach the engine, not just the 404 path
            response = case.call(timeout=60)
            case.validate_response(response, checks=CHECKS)

        check()


HUGE = st.one_of(st.integers(-2, 4), st.integers(-2**70, 2**70), st.sampled_from([2**31, 2**62, 2**63, 2**64]))
COUNTS = {"n": HUGE, "best_of": HUGE, "max_tokens": HUGE, "min_tokens": HUGE, "logprobs": HUGE,
          "prompt_logprobs": HUGE, "top_k": HUGE, "seed": HUGE, "truncate_prompt_tokens": HUGE}


@given(prompts=st.lists(st.sampled_from(["a", "hi there", [1, 2, 3]]), min_size=1, max_size=4),
       counts=st.fixed_dictionaries({}, optional=COUNTS), stream=st.booleans())
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
def test_no_count_in_a_completion_request_causes_a_server_error(fuzz_url, prompts, counts, stream):
    """Lists of prompts x ``n`` x the other sizes a request names: every count is bounded before anything is sized
    by it, so the worst answer is a 400 naming a field (schemathesis' own cases rarely combine them)."""
    body = {"model": MODEL, "prompt": prompts, "stream": stream, **counts}
    response = httpx.post(f"{fuzz_url}/v1/completions", json=body, timeout=60)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["param"], response.text
