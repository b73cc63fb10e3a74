"""Gateway configuration: one YAML file, validated by pydantic, overridable by ``BURSTGATE_*`` env vars.

With no file and no models the gateway serves the embedded default: SmolLM2 on the native engine.
Nested env overrides use ``__``: ``BURSTGATE_LIMITS__MAX_BODY_BYTES=1000000``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from backends.deepspeed_config import DeepSpeedConfig
from backends.http import RemoteConfig, TextServerConfig, env_reference, from_environment
from backends.mii import MIIConfig
from backends.native.config import DEFAULT_MODEL_ENV, EMBEDDED_TOOLS_TEMPLATE, EngineConfig
from gateway.discovery import DiscoveryConfig
from gateway.routing import routing_config
from gateway.routing.least_outstanding import LeastOutstandingConfig
from gateway.tracing import TracingConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Deployment(_Strict):
    """What the gateway itself needs of every deployment, whatever its kind."""

    name: str | None = None  # label in metrics and /admin/backends; derived when omitted
    weight: float = Field(1.0, gt=0)  # share of the traffic against the model's other deployments (weighted policies)
    max_concurrency: int = Field(256, ge=1)  # requests in flight on this deployment
    max_queue: int = Field(1024, ge=0)  # requests waiting for a slot before 429
    # timeouts enforced by the gateway for every kind; None: no limit (a burst may queue for minutes)
    first_token_timeout_s: float | None = Field(None, gt=0)  # until the first token
    total_timeout_s: float | None = Field(None, gt=0)  # a request's whole answer
    # where this deployment's engine publishes its KV-cache events (vLLM's --kv-events-config endpoint, as a
    # reader connects to it: tcp://vllm-0:5557), and their topic: cache_aware routing follows them
    kv_events: str | None = None
    kv_events_topic: str = ""  # the ZMQ topic of those events
    # the replicas behind this deployment, found by DNS or the Kubernetes API (gateway/discovery/): this entry is
    # then their template, its url's host and port replaced by each replica's (and "{host}" in kv_events)
    discover: DiscoveryConfig | None = None

    @model_validator(mode="after")
    def _discover_needs_a_url(self) -> _Deployment:
        if self.discover is not None and not hasattr(self, "url"):
            raise ValueError("discover: needs a remote deployment (a kind with a url)")
        return self


# One class per kind: the gateway's fields plus the backend's own configuration, which the backend
# receives whole (the native engine's ``EngineConfig``, an HTTP adapter's ``RemoteConfig`` ...).
class NativeDeployment(_Deployment, EngineConfig):
    kind: Literal["native"] = "native"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.model_dump(include=set(EngineConfig.model_fields)))


class DeepSpeedDeployment(_Deployment, DeepSpeedConfig):
    kind: Literal["deepspeed"]


class OpenAIDeployment(_Deployment, RemoteConfig):
    kind: Literal["openai"]
    # how /v1/responses reaches the server: "relay" to its own /v1/responses (vLLM has one), "chat" over its chat
    # completions, "auto" relays when the server has the route (asked once: GET /v1/responses answers 405)
    responses_api: Literal["auto", "relay", "chat"] = "auto"


class TGIDeployment(_Deployment, TextServerConfig):
    kind: Literal["tgi"]


class LightLLMDeployment(_Deployment, TextServerConfig):
    kind: Literal["lightllm"]


class MIIDeployment(_Deployment, MIIConfig):
    kind: Literal["mii"]


def _kind(value: Any) -> str:
    """A deployment without ``kind`` is a native one."""
    return (value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)) or "native"


DeploymentConfig = Annotated[
    Annotated[NativeDeployment, Tag("native")] | Annotated[DeepSpeedDeployment, Tag("deepspeed")]
    | Annotated[OpenAIDeployment, Tag("openai")] | Annotated[TGIDeployment, Tag("tgi")]
    | Annotated[LightLLMDeployment, Tag("lightllm")] | Annotated[MIIDeployment, Tag("mii")],
    Discriminator(_kind)]


if TYPE_CHECKING:  # made at run time from the registered policies: to a type checker, any policy's config
    from gateway.routing.policy import PolicyConfig as RoutingConfig
else:
    RoutingConfig = routing_config()  # every registered policy's config, by its ``policy:``


class ModelRoute(_Strict):
    name: str = Field(min_length=1)  # the public model name clients send as `model`
    # where it runs: one or more deployments of any kind (`kind:`, default native), routed by `routing`
    deployments: list[DeploymentConfig] = Field(min_length=1)
    # the routing policy (gateway/routing/): its name, or policy: and its settings
    routing: RoutingConfig = Field(default_factory=LeastOutstandingConfig)
    fallbacks: list[str] = Field(default_factory=list)  # models tried, in order, when none of ours answers

    @field_validator("routing", mode="before")
    @classmethod
    def _named_policy(cls, value: Any) -> Any:
        return {"policy": value} if isinstance(value, str) else value


class Resilience(_Strict):
    """Retries, circuit breakers and health checks, for every deployment (``resilience:``; ``router:``, its
    earlier name, is still read)."""

    retries: int = Field(2, ge=0)  # extra attempts per model, for failures before the first token
    retry_backoff_s: float = Field(0.05, ge=0)  # base of the exponential backoff (full jitter)
    retry_backoff_max_s: float = Field(1.0, ge=0)  # the backoff's cap
    breaker_failures: int = Field(5, ge=1)  # consecutive failures that open a deployment's breaker
    breaker_cooldown_s: float = Field(30.0, ge=0)  # open time before one probe request is let through
    health_interval_s: float = Field(5.0, gt=0)  # time between two health checks of a deployment
    health_timeout_s: float = Field(5.0, gt=0)  # a check slower than this fails


class ApiKey(_Strict):
    """A key. Give ``key`` (hashed at load, never kept; ``os.environ/NAME`` reads it from the environment)
    or its ``sha256`` hex digest. Rate limits apply to client keys."""

    model_config = ConfigDict(hide_input_in_errors=True)  # a config error never echoes a key

    name: str = "default"  # shown in logs and in the rate-limit metric, never the key itself
    key: str | None = Field(None, repr=False)  # the key, or os.environ/NAME
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")  # instead of key: its SHA-256 hex digest
    requests_per_minute: int | None = Field(None, ge=1)  # per rate window (limits.window_s); None: unlimited
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt + completion, per window; None: unlimited

    @model_validator(mode="after")
    def _hash_now(self) -> ApiKey:
        if self.key is not None:
            name = env_reference(self.key)
            key = from_environment(name, f"API key {self.name!r}") if name else self.key
            self.sha256, self.key = hash_key(key), None
        if not self.sha256:
            raise ValueError("an API key needs key or sha256")
        self.sha256 = self.sha256.lower()
        return self


class Limits(_Strict):
    max_body_bytes: int = Field(2_000_000, ge=1024)  # a larger request body is refused with 413
    redis_url: str | None = None  # shared rate-limit counters when several replicas run
    # the keys' rate windows (requests_per_minute and tokens_per_minute count per window): a minute unless said
    window_s: float = Field(60.0, gt=0)


class ResponsesStore(_Strict):
    """Where the Responses API keeps stored responses: Redis (``redis_url``, else ``limits.redis_url``), shared by
    gateway replicas, else this process's memory."""

    retention_s: float = Field(30 * 24 * 3600.0, gt=0)  # OpenAI keeps stored responses 30 days
    max_records: int = Field(10_000, ge=1)  # in memory only: the oldest are dropped beyond it
    redis_url: str | None = None  # redis://host:6379/0; default: limits.redis_url


class Server(_Strict):
    """The HTTP server's limits against slow, huge and idle clients (gateway/http_server.py)."""

    # from a request's first byte (or the connection's opening) until its whole body is in: slow headers
    # and bodies end with 408 instead of holding a connection for ever (uvicorn itself never times them out)
    request_timeout_s: float = Field(30.0, gt=0)
    keep_alive_timeout_s: float = Field(5.0, gt=0)  # idle time allowed between two requests (uvicorn's)
    max_header_bytes: int = Field(65_536, ge=1024)  # request line and headers together; over it: 431
    # open connections; at the cap a new one closes the longest-idle one, or gets 503 when none is idle
    max_connections: int = Field(4096, ge=1)
    # on SIGTERM (gateway/drain.py): new requests still served this long while load balancers take the process
    # out (/ready is 503 at once), and requests in flight run to their end until drain_timeout_s after the
    # signal, then end with a 503 error; Kubernetes' terminationGracePeriodSeconds must cover both
    drain_grace_s: float = Field(0.0, ge=0)
    drain_timeout_s: float = Field(120.0, gt=0)  # from SIGTERM to the end of the requests still running

    @model_validator(mode="after")
    def _grace_within_the_deadline(self) -> Server:
        if self.drain_grace_s >= self.drain_timeout_s:
            raise ValueError("drain_grace_s must be shorter than drain_timeout_s (requests taken in the grace window "
                             "need time to finish)")
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BURSTGATE_", env_nested_delimiter="__", extra="forbid",
                                      hide_input_in_errors=True)  # errors name the field, never echo a key

    models: list[ModelRoute] = Field(default_factory=list)  # the served models; none: the embedded SmolLM2
    api_keys: list[ApiKey] = Field(default_factory=list)  # client keys: /v1/*, /tokenize, /detokenize
    api_key: str | None = Field(None, repr=False)  # shorthand for one unnamed key without limits (like VLLM_API_KEY)
    # /admin/* takes only these (never a client key); with no key of either kind configured, nothing is guarded
    admin_api_keys: list[ApiKey] = Field(default_factory=list)
    admin_api_key: str | None = Field(None, repr=False)  # shorthand for one admin key (BURSTGATE_ADMIN_API_KEY)
    protect_metrics: bool = False  # require a key (client or admin) on /metrics too
    limits: Limits = Field(default_factory=Limits)  # request size and the keys' rate windows
    # retries, breakers, health checks (`router:`, its earlier name, is still read)
    resilience: Resilience = Field(default_factory=Resilience, validation_alias=AliasChoices("resilience", "router"))
    server: Server = Field(default_factory=Server)  # the HTTP server's limits and draining
    responses: ResponsesStore = Field(default_factory=ResponsesStore)  # stored Responses API responses
    tracing: TracingConfig = Field(default_factory=TracingConfig)  # OpenTelemetry spans (off by default)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return env_settings, init_settings  # the environment overrides the file

    @model_validator(mode="after")
    def _fold_single_key(self) -> Settings:
        if self.api_key:
            self.api_keys = [*self.api_keys, ApiKey(name="default", key=self.api_key)]
            self.api_key = None
        if self.admin_api_key:
            self.admin_api_keys = [*self.admin_api_keys, ApiKey(name="admin", key=self.admin_api_key)]
            self.admin_api_key = None
        if {k.sha256 for k in self.api_keys} & {k.sha256 for k in self.admin_api_keys}:
            raise ValueError("admin_api_keys must differ from the client api_keys")
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ValueError("model names must be unique")
        for m in self.models:
            unknown = [f for f in m.fallbacks if f not in names or f == m.name]
            if unknown:
                raise ValueError(f"model {m.name!r}: fallbacks must name other configured models, not {unknown}")
        split = [m.name for m in self.models for d in m.deployments
                 if isinstance(d, NativeDeployment) and d.world_size > 1 and d.simulate is None]
        if len(split) > 1:  # torch.distributed: one default process group per process
            raise ValueError(f"models {split}: one gateway process runs at most one native engine split over ranks "
                             f"(tensor or pipeline parallel); serve the others with their own `burstgate serve`, "
                             f"behind an openai deployment")
        return self

    def routes(self) -> list[ModelRoute]:
        """The configured models, or the embedded default when none is configured."""
        return self.models or [ModelRoute(name=DEFAULT_MODEL_NAME, deployments=[embedded_default()])]


def embedded_default() -> NativeDeployment:
    """The deployment served when none is configured: the embedded SmolLM2, its chats rendered by its own template
    with tools added and tool calls read by the hermes parser (tool choice "auto" works out of the box); a model
    named by ``$BURSTGATE_DEFAULT_MODEL`` instead keeps its own template and calls only forced tools."""
    if os.environ.get(DEFAULT_MODEL_ENV):
        return NativeDeployment()
    return NativeDeployment(chat_template=str(EMBEDDED_TOOLS_TEMPLATE), tool_parser="hermes")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_settings(path: str | Path | None = None) -> Settings:
    """Read a YAML config file (optional) and apply ``BURSTGATE_*`` environment overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
    return Settings(**data)
