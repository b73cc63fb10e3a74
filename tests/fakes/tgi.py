"""A text-generation-inference server reduced to its wire format, over the toy model.

Shapes, status codes and messages follow huggingface/text-generation-inference:
router/src/server.rs (routes, ``compat_generate`` answering a list, SSE ``data:{json}`` with no
``[DONE]``, ``x-prompt-tokens`` header), router/src/lib.rs (StreamResponse, StreamDetails with
input_length, Details, Token, ErrorResponse, Info, ``GrammarType``: ``{"type": "json"|"json_object",
"value": <schema>}`` or ``{"type": "regex", "value": <pattern>}``) and router/src/validation.rs (error
messages). The parameters of every request are kept in ``app.state.parameters``, for the tests to read.
The official client (HF ``text-generation``) is run against it in the tests.
"""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadtest.mock_server import create_mock_app
from tests.fakes import toy_model

MAX_TOTAL_TOKENS = 64
MAX_STOP_SEQUENCES = 4


def create_tgi_app(model_id: str = "toy/tgi", max_concurrent: int = 128, token_delay_s: float = 0.0) -> Starlette:
    active = 0

    def error(status: int, message: str, error_type: str) -> JSONResponse:
        return JSONResponse({"error": message, "error_type": error_type}, status_code=status)

    def validate(body: dict) -> tuple[str, dict] | JSONResponse:
        inputs, p = body.get("inputs", ""), body.get("parameters") or {}
        checks = [
            (p.get("temperature") is not None and p["temperature"] <= 0, "`temperature` must be strictly positive"),
            (p.get("top_p") is not None and not 0 < p["top_p"] < 1, "`top_p` must be > 0.0 and < 1.0"),
            (p.get("top_k") is not None and p["top_k"] <= 0, "`top_k` must be strictly positive"),
            (p.get("repetition_penalty") is not None and p["repetition_penalty"] <= 0,
             "`repetition_penalty` must be strictly positive"),
            (p.get("max_new_tokens") is not None and p["max_new_tokens"] <= 0,
             "`max_new_tokens` must be strictly positive"),
            (len(p.get("stop") or []) > MAX_STOP_SEQUENCES,
             f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.get('stop') or [])}"),
            (not inputs, "`inputs` cannot be empty"),
            (not _grammar_ok(p.get("grammar")), "grammar is not valid"),
        ]
        for failed, message in checks:
            if failed:
                return error(422, f"Input validation error: {message}", "validation")
        app.state.parameters.append(p)
        n_in, max_new = toy_model.prompt_tokens(inputs), p.get("max_new_tokens") or 100
        if n_in + max_new > MAX_TOTAL_TOKENS:
            return error(422, f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
                              f"{MAX_TOTAL_TOKENS}. Given: {n_in} `inputs` tokens and {max_new} `max_new_tokens`",
                         "validation")
        return inputs, p

    def token_json(t: toy_model.Token) -> dict:
        return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}

    def top_tokens(t: toy_model.Token, n: int) -> list[dict]:
        return [token_json(t)] + [{"id": 5 + i, "text": f" alt{i}", "logprob": -3.0 - i, "special": False}
                                  for i in range(n - 1)]

    async def generate(request: Request) -> Response:
        return await _generate(await request.json(), compat_list=False)

    async def generate_stream(request: Request) -> Response:
        return await _stream(await request.json())

    async def compat(request: Request) -> Response:
        body = await request.json()
        return await (_stream(body) if body.get("stream") else _generate(body, compat_list=True))

    async def _generate(body: dict, compat_list: bool) -> Response:
        checked = validate(body)
        if isinstance(checked, Response):
            return checked
        inputs, p = checked
        try:
            steps = list(toy_model.generate(inputs, p.get("max_new_tokens") or 100, p.get("stop") or []))
        except RuntimeError as exc:
            return error(424, f"Request failed during generation: {exc}", "generation")
        n = p.get("top_n_tokens") or 0
        last = steps[-1]
        details = {"finish_reason": last.finish_reason, "generated_tokens": len(steps), "seed": p.get("seed"),
                   "prefill": [], "tokens": [token_json(s.token) for s in steps]}
        if n:
            details["top_tokens"] = [top_tokens(s.token, n) for s in steps]
        reply = {"generated_text": last.generated_text}
        if p.get("details"):
            reply["details"] = details
        headers = {"x-prompt-tokens": str(toy_model.prompt_tokens(inputs)), "x-generated-tokens": str(len(steps))}
        return JSONResponse([reply] if compat_list else reply, headers=headers)

    async def _stream(body: dict) -> Response:
        nonlocal active
        checked = validate(body)
        if isinstance(checked, Response):
            return checked
        if active >= max_concurrent:
            return error(429, "Model is overloaded", "overloaded")
        inputs, p = checked
        n = p.get("top_n_tokens") or 0

        async def events():
            nonlocal active
            active += 1
            try:
                for index, step in enumerate(toy_model.generate(inputs, p.get("max_new_tokens") or 100,
                                                                p.get("stop") or []), start=1):
                    if token_delay_s:
                        await asyncio.sleep(token_delay_s)
                    event = {"index": index, "token": token_json(step.token), "generated_text": None, "details": None}
                    if n:
                        event["top_tokens"] = top_tokens(step.token, n)
                    if step.finish_reason:
                        event["generated_text"] = step.generated_text
                        if p.get("details"):
                            event["details"] = {"finish_reason": step.finish_reason, "generated_tokens": index,
                                                "seed": p.get("seed"), "input_length": toy_model.prompt_tokens(inputs)}
                    yield f"data:{json.dumps(event)}\n\n"
            except RuntimeError as exc:
                yield "data:" + json.dumps({"error": f"Request failed during generation: {exc}",
                                            "error_type": "generation"}) + "\n\n"
            finally:
                active -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def info(_: Request) -> Response:
        return JSONResponse({"model_id": model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
                             "max_concurrent_requests": max_concurrent, "max_best_of": 2,
                             "max_stop_sequences": MAX_STOP_SEQUENCES, "max_input_tokens": MAX_TOTAL_TOKENS - 1,
                             "max_total_tokens": MAX_TOTAL_TOKENS, "validation_workers": 2,
                             "max_client_batch_size": 4, "router": "text-generation-router", "version": "3.3.6"})

    async def tokenize(request: Request) -> Response:
        words = (await request.json())["inputs"].split()
        return JSONResponse([{"id": 100 + i, "text": w, "start": 0, "stop": 0} for i, w in enumerate(words)])

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    app = Starlette(routes=[
        Route("/", compat, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/generate_stream", generate_stream, methods=["POST"]),
        Route("/info", info),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/health", health),
        # TGI's OpenAI-compatible routes behave as any OpenAI server: the instant mock's stand in for them.
        *(r for r in create_mock_app(model_id).routes if r.path.startswith("/v1/")),
    ])
    app.state.parameters = []
    return app


def _grammar_ok(grammar: object) -> bool:
    """Whether ``grammar`` deserializes as TGI's ``GrammarType`` (absent is fine)."""
    if grammar is None:
        return True
    if not isinstance(grammar, dict) or set(grammar) != {"type", "value"}:
        return False
    if grammar["type"] in ("json", "json_object"):
        return isinstance(grammar["value"], (dict, str))  # a schema, as JSON or as its text
    return grammar["type"] == "regex" and isinstance(grammar["value"], str)
