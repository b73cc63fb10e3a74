"""A LightLLM server reduced to its wire format, over the toy model.

Shapes follow ModelTC/lightllm: lightllm/server/api_lightllm.py (``lightllm_generate`` reply with
``generated_text`` as a list; ``lightllm_generate_stream`` events ``data:{json}`` with ``token``,
``finished``, ``finish_reason``), api_http.py (``{"message"}`` errors: 503 busy, 417 otherwise;
``/health``) and core/objs/sampling_params.py (``verify()`` messages; finish reasons stop/length).
"""

from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadtest.mock_server import create_mock_app
from tests.fakes import toy_model


def create_lightllm_app(model: str = "toy/lightllm", busy: bool = False) -> Starlette:
    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"message": message}, status_code=status)

    def verify(p: dict) -> str | None:
        checks = [
            (p.get("temperature", 1.0) <= 0.0, f"temperature must > 0.0, got {p.get('temperature')}"),
            (not 0.0 < p.get("top_p", 1.0) <= 1.0, f"top_p must be in (0.0, 1.0], got {p.get('top_p')}"),
            (p.get("top_k", -1) < -1 or p.get("top_k", -1) == 0,
             f"top_k must be -1 (disable), or at least 1, got {p.get('top_k')}."),
            (p.get("max_new_tokens", 16) < 1, f"max_new_tokens must be at least 1, got {p.get('max_new_tokens')}."),
            (p.get("presence_penalty", 0.0) < 0.0, f"presence_penalty must >= 0.0, got {p.get('presence_penalty')}"),
            (p.get("frequency_penalty", 0.0) < 0.0,
             f"frequency_penalty must >= 0.0, got {p.get('frequency_penalty')}"),
            (p.get("repetition_penalty", 1.0) < 1.0,
             f"repetition_penalty must >= 1.0, got {p.get('repetition_penalty')}"),
        ]
        return next((message for failed, message in checks if failed), None)

    def finish(step: toy_model.Step) -> str | None:
        return {"length": "length", None: None}.get(step.finish_reason, "stop")

    async def admitted(request: Request) -> tuple[str, dict] | Response:
        body = await request.json()
        if busy:
            return error(503, "server is busy")
        if (message := verify(body["parameters"])) is not None:
            return error(417, message)
        return body["inputs"], body["parameters"]

    async def generate(request: Request) -> Response:
        checked = await admitted(request)
        if isinstance(checked, Response):
            return checked
        inputs, p = checked
        try:
            out = list(toy_model.generate(inputs, p.get("max_new_tokens", 16), p.get("stop_sequences") or []))
        except RuntimeError as exc:
            return error(417, str(exc))
        text = "".join(s.token.text for s in out if not (s.token.special and p.get("skip_special_tokens", True)))
        return JSONResponse({"generated_text": [text], "count_output_tokens": len(out),
                             "finish_reason": finish(out[-1]), "prompt_tokens": toy_model.prompt_tokens(inputs)})

    async def generate_stream(request: Request) -> Response:
        checked = await admitted(request)
        if isinstance(checked, Response):
            return checked
        inputs, p = checked

        async def events():
            for i, step in enumerate(toy_model.generate(inputs, p.get("max_new_tokens", 16),
                                                        p.get("stop_sequences") or []), start=1):
                t = step.token
                text = "" if t.special and p.get("skip_special_tokens", True) else t.text
                ret = {"token": {"id": t.id, "text": text, "logprob": t.logprob, "special": t.special,
                                 "count_output_tokens": i, "prompt_tokens": toy_model.prompt_tokens(inputs)},
                       "generated_text": None, "finished": step.finish_reason is not None,
                       "finish_reason": finish(step), "details": None}
                yield ("data:" + json.dumps(ret, ensure_ascii=False) + "\n\n").encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_: Request) -> Response:
        return JSONResponse({"message": "Ok"})

    return Starlette(routes=[
        Route("/generate", generate, methods=["POST"]),
        Route("/generate_stream", generate_stream, methods=["POST"]),
        Route("/health", health),
        *(r for r in create_mock_app(model).routes if r.path.startswith("/v1/")),
    ])
