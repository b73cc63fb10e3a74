"""DeepSpeed-MII's REST gateway reduced to its wire format, over the toy model.

Shapes follow deepspeedai/DeepSpeed-MII: mii/grpc_related/restful_gateway.py (``POST /mii/<deployment>``
with ``client.generate`` keywords, a JSON list of ``Response.to_msg_dict()``; ``GET /healthz`` → "ok";
a Flask-RESTful resource, so any exception is a 500 ``{"message": "Internal Server Error"}``),
mii/batching/data_classes.py (``generated_text``, ``prompt_length``, ``generated_length``,
``finish_reason``), mii/config.py (``GenerateParamsConfig`` bounds and defaults; ``stop`` one string or a
list) and mii/utils.py (``kwarg_dict_to_proto``: each keyword a scalar or a dict, anything else a 500).
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests.fakes import toy_model

INTERNAL_ERROR = {"message": "Internal Server Error"}


def create_mii_app(deployment: str = "toy-deployment") -> Starlette:
    async def generate(request: Request) -> Response:
        if request.path_params["name"] != deployment:
            return JSONResponse({"message": "The requested URL was not found on the server."}, status_code=404)
        kw = await request.json()
        prompts = kw.pop("prompts")
        if any(not isinstance(v, str | int | float | bool | dict) for v in kw.values()):
            return JSONResponse(INTERNAL_ERROR, status_code=500)  # KeyError in kwarg_dict_to_proto
        stop = kw.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        prompts = [prompts] if isinstance(prompts, str) else prompts
        top_p, temperature, top_k = kw.get("top_p", 0.9), kw.get("temperature"), kw.get("top_k")
        if not 0 < top_p <= 1 or (temperature is not None and temperature <= 0) or (top_k is not None and top_k <= 0):
            return JSONResponse(INTERNAL_ERROR, status_code=500)  # pydantic ValidationError inside Flask
        max_new = kw.get("max_new_tokens") or 1024 - max(toy_model.prompt_tokens(p) for p in prompts)
        out = []
        for prompt in prompts:
            try:
                steps = list(toy_model.generate(prompt, max_new, stop))
            except RuntimeError:
                return JSONResponse(INTERNAL_ERROR, status_code=500)
            text = "".join(s.token.text for s in steps if not s.token.special)
            reason = "length" if steps[-1].finish_reason == "length" else "stop"
            out.append({"generated_text": text, "prompt_length": toy_model.prompt_tokens(prompt),
                        "generated_length": len(steps), "finish_reason": reason})
        return JSONResponse(out)

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/mii/{name}", generate, methods=["POST"]), Route("/healthz", healthz)])
