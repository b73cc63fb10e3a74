"""The app's routes by concern, each an ``APIRouter`` that ``gateway.app.create_app`` includes: the OpenAI
routes (``openai``), its Responses API (``responses``), vLLM's tokenizer routes (``tokenizer``) and the operations routes (``operations``). A
route finds the ``Gateway`` it serves on ``request.app.state.gateway`` and checks keys through the
dependencies of gateway/auth.py."""

from fastapi import Request

from gateway.service import Gateway


def gateway_of(request: Request) -> Gateway:
    """The gateway the app serving ``request`` was built around."""
    return request.app.state.gateway
