"""A public model name's deployments, the policy routing among them, and the models to fall back to."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.base import GenerationRequest, UnavailableError
from gateway.routing.least_outstanding import LeastOutstandingConfig
from gateway.routing.policy import POLICIES, Choice, Conversation, PolicyConfig, RoutedRequest

if TYPE_CHECKING:
    from gateway.deployments import Deployment


class ModelGroup:
    def __init__(self, name: str, deployments: list[Deployment], routing: PolicyConfig | None = None,
                 fallbacks: Collection[str] = ()) -> None:
        self.name = name
        self.deployments = deployments
        self.fallbacks = list(fallbacks)
        config = routing or LeastOutstandingConfig()
        self.policy = POLICIES[config.policy](config, deployments)
        self._tokenizer: Any = None  # the policy config's local tokenizer, loaded on first use

    @property
    def routing(self) -> str:
        """The routing policy's name."""
        return self.policy.name

    def join(self, deployment: Deployment) -> list:
        """A replica found by discovery takes requests from now on; returns the policy's jobs for it."""
        self.deployments.append(deployment)  # the policy's list too: the same object
        return self.policy.joined(deployment)

    def leave(self, deployment: Deployment) -> None:
        """A replica gone: no new request goes to it (the ones it runs finish)."""
        self.deployments.remove(deployment)
        self.policy.forget(deployment)

    @property
    def ready(self) -> bool:
        return any(d.healthy for d in self.deployments)

    def candidates(self, exclude: Collection[Deployment] = ()) -> list[Deployment]:
        """Deployments that may take a request: healthy, breaker letting requests through, not excluded."""
        candidates = [d for d in self.deployments if d.available and d not in exclude]
        if not candidates:
            raise UnavailableError(f"no healthy backend for model '{self.name}'")
        return candidates

    async def route(self, request: GenerationRequest, exclude: Collection[Deployment] = (),
                    conversation: Conversation | None = None) -> Choice:
        """The deployment that serves ``request`` and why; the policy hears of the dispatch. A conversation's
        next turn goes where its previous one was answered while that keeps the load balanced. Raises
        ``UnavailableError`` when none is available."""
        candidates = self.candidates(exclude)
        routed = RoutedRequest(request, session=(conversation and conversation.session) or request.user)
        if self.policy.needs_tokens:
            routed.tokens, routed.tokens_source = await self.tokens(request, candidates)
        held = next((d for d in candidates if d.name == conversation.held_by), None) if conversation else None
        if len(candidates) == 1:
            choice = Choice(candidates[0], "only")
        elif held is not None and self.policy.balanced(held, candidates):
            choice = Choice(held, "conversation")
        else:
            choice = self.policy.choose(candidates, routed)
        self.policy.dispatched(choice.deployment, routed)
        return Choice(choice.deployment, choice.reason, routed)

    async def finished(self, choice: Choice, answer: str) -> None:
        """The request of ``choice`` was answered with ``answer`` (its first choice's text): the policy hears of
        the tokens its deployment holds now, the prompt's and the answer's (counted as the prompt was)."""
        routed = choice.routed
        if routed is None or routed.tokens is None or not answer or choice.deployment not in self.deployments:
            return  # (a replica that left meanwhile holds nothing for the index any more)
        if routed.tokens_source == "tokenizer" and self._tokenizer is not None:
            more = self._tokenizer.encode(answer, add_special_tokens=False)
        elif routed.tokens_source in ("engine", "server"):
            try:
                more = await choice.deployment.backend.tokenize(answer, None, False, None)
            except Exception:  # its tokenizer went away: the prompt's blocks were recorded already
                return
        elif routed.tokens_source == "characters":
            more = [ord(c) for c in answer]
        else:  # token ids in the request, and no tokenizer for the answer
            return
        self.policy.finished(choice.deployment, routed, [*routed.tokens, *more])

    def choose(self, request: GenerationRequest | None = None, exclude: Collection[Deployment] = ()) -> Deployment:
        """A deployment for work that needs any (tokenizing): the policy's choice without token ids."""
        candidates = self.candidates(exclude)
        if len(candidates) == 1 or request is None:
            return min(candidates, key=lambda d: d.outstanding / d.weight)
        return self.policy.choose(candidates, RoutedRequest(request, session=request.user)).deployment

    async def prepare(self) -> None:
        """Load what routing needs before the first request: the policy's tokenizer (seconds from a GGUF), in a
        worker thread."""
        path = getattr(self.policy.config, "tokenizer", None)
        if path is not None and self._tokenizer is None:
            from backends.tokenizer import Tokenizer

            self._tokenizer = await asyncio.to_thread(Tokenizer, Path(path))

    async def tokens(self, request: GenerationRequest, candidates: list[Deployment]) -> tuple[list[int], str]:
        """The request's token ids as the engines will see them, and who counted them: the request itself, the
        policy's tokenizer, an in-process engine, a deployment's /tokenize, else the prompt's characters."""
        if isinstance(request.prompt, list):
            return request.prompt, "request"
        path = getattr(self.policy.config, "tokenizer", None)
        if path is not None:
            return self._local_tokens(Path(path), request), "tokenizer"
        native = [d for d in candidates if d.backend.stats() is not None]  # an in-process engine's own tokenizer
        for d in native or candidates:
            try:
                ids = await d.backend.tokenize(request.prompt, request.messages, request.add_special_tokens,
                                               request.tools)
                return ids, "engine" if native else "server"
            except Exception:  # no /tokenize there: the next, else characters
                continue
        text = request.prompt if request.messages is None else "".join(str(m.get("content")) for m in request.messages)
        return [ord(c) for c in text or ""], "characters"

    def _local_tokens(self, path: Path, request: GenerationRequest) -> list[int]:
        if self._tokenizer is None:
            from backends.tokenizer import Tokenizer

            self._tokenizer = Tokenizer(path)
        if request.messages is not None:
            return self._tokenizer.apply_chat_template(request.messages, tools=request.tools)
        return self._tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
