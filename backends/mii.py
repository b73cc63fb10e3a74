"""DeepSpeed-MII deployments over MII's REST gateway.

MII (deepspeedai/DeepSpeed-MII, mii/grpc_related/restful_gateway.py): ``POST /mii/<deployment>``
with ``client.generate``'s keyword arguments (``prompts``, ``max_new_tokens``, ``do_sample``,
``top_p``, ``top_k``, ``temperature``, ``ignore_eos``, ``min_new_tokens``, ``stop``; see
mii/config.py ``GenerateParamsConfig``, whose defaults are do_sample=True and top_p=0.9, so both are
always sent). The gateway packs each keyword into a gRPC ``Value`` of a scalar or a dict
(mii/utils.py ``kwarg_dict_to_proto``): a list is a 500, so ``stop`` travels as its one string (MII's
config makes it a list) and more than one stop string is refused, answered by a list of ``{generated_text, prompt_length, generated_length,
finish_reason}`` (mii/batching/data_classes.py). No streaming: the answer is one chunk. Any failure
is Flask's 500. ``GET /healthz`` answers "ok". MII's OpenAI server is reached with the ``openai`` kind.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from backends.base import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    UnavailableError,
    UpstreamError,
    Usage,
)
from backends.http import TextServerConfig, json_body, raise_for_status
from backends.text_server import TextServerBackend


class MIIConfig(TextServerConfig):
    upstream_model: str  # the MII deployment's name


class MIIRestBackend(TextServerBackend):
    kind = "mii"
    health_path = "/healthz"
    server_name = "DeepSpeed-MII"
    unsupported = ("min_p", "seed", "logprobs", "stop_token_ids", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", *TextServerBackend.unsupported)

    def __init__(self, model_name: str, cfg: MIIConfig) -> None:
        super().__init__(model_name, cfg)
        self.path = f"/mii/{cfg.upstream_model}"

    async def _generate(self, prompt: str, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        r = await self._http.call("POST", self.path, json={"prompts": [prompt], **mii_parameters(request.params)})
        raise_for_status(r.status, r.content, {404: UnavailableError}, "message")
        try:
            reply = json_body(r.content)[0]
            yield GenerationChunk(text=reply["generated_text"], finish_reason=_mii_finish(reply["finish_reason"]),
                                  usage=Usage(reply["prompt_length"], reply["generated_length"]))
        except (KeyError, IndexError, TypeError) as exc:
            raise UpstreamError(f"malformed reply from MII: {r.text[:200]!r}") from exc


def mii_parameters(p: SamplingParams) -> dict[str, Any]:
    """Our sampling settings in MII's ``generate`` keywords (``MIIRestBackend.unsupported`` are refused first)."""
    if len(p.stop) > 1:
        raise InvalidRequestError("stop with more than one string is not supported by DeepSpeed-MII backends "
                                  "(its REST gateway carries scalars only)", param="stop")
    out: dict[str, Any] = {"do_sample": not p.greedy, "top_p": p.top_p, "ignore_eos": p.ignore_eos,
                           "min_new_tokens": p.min_tokens}
    if p.stop:
        out["stop"] = p.stop[0]
    if p.max_tokens is not None:
        out["max_new_tokens"] = p.max_tokens
    if not p.greedy:
        out["temperature"] = p.temperature
        if p.top_k > 0:
            out["top_k"] = p.top_k
    return out


def _mii_finish(reason: str) -> FinishReason:
    return "length" if reason == "length" else "stop"
