"""The ``burstgate`` command: ``serve`` the gateway; ``loadtest`` subcommands live in loadtest/cli.py."""

from __future__ import annotations

import json
import logging
import os
from enum import Enum, StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, cast, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError

from backends.native.config import EngineConfig
from backends.native.gpus import GPUS, INTERCONNECTS
from backends.sim.cli import app as sim_app
from gateway.access_log import LogFormat, configure_logging
from gateway.cli_help import HelpCommand, HelpGroup
from gateway.config import DEFAULT_MODEL_NAME, ModelRoute, Settings, load_settings
from loadtest.cli import app as loadtest_app

app = typer.Typer(help="burstgate: OpenAI-compatible LLM gateway, native engine and burst load tester.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None, cls=HelpGroup, epilog="""
burstgate serve                         # SmolLM2 at http://127.0.0.1:8000
burstgate serve --config gateway.yaml   # your vLLM / TGI / native fleet
burstgate loadtest run --url http://127.0.0.1:8000 \\
    --model SmolLM2-135M-Instruct --preset paper
burstgate plan --model configs/llama-12.3b-gqa.json --gpu h100

Each command's options and examples: burstgate COMMAND --help
""")
app.add_typer(loadtest_app, name="loadtest", help="Burst-mode load tests, side by side across backends.",
              epilog="""
burstgate loadtest run --url http://127.0.0.1:8000 --model smollm2 \\
    --preset paper
burstgate loadtest report --out report/
burstgate loadtest recommend
""")
app.add_typer(sim_app, name="sim", help="Simulated replicas: device profiles, fleets on a virtual clock.", epilog="""
burstgate sim profiles
burstgate sim run --model configs/llama-12.3b-gqa.json --replicas 8
""")
log = logging.getLogger("burstgate")

# The sections of `serve --help` and `plan --help`.
SERVER, ENGINE, PARALLEL, TLS = "Server", "Engine (--model or the embedded model)", "Parallelism", "HTTPS"
MODEL_GPU, SPLIT, SLO = "Model and GPU", "Splitting over --gpus N", "Replicas for an SLO (--slo)"

_SERVE_ENV = "BURSTGATE_SERVE_OPTIONS"  # hands the parsed options to uvicorn worker processes (WorkerOptions)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"burstgate {version('burstgate')}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False) -> None:
    """burstgate: OpenAI-compatible LLM gateway, native engine and burst load tester."""


class LogLevel(StrEnum):
    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"


def _engine_choices(name: str, field: str) -> type[Enum]:
    """The choices of an engine option, as the engine's config declares them (its Literal): one list, not a copy."""
    annotation = EngineConfig.model_fields[field].annotation
    (literal,) = (a for a in (annotation, *get_args(annotation)) if get_origin(a) is Literal)
    return cast(type[Enum], Enum(name, {value: value for value in get_args(literal)}, type=str))


if TYPE_CHECKING:  # made at run time from the engine config's Literals; to a type checker, enums of strings
    from enum import StrEnum as Dtype
    from enum import StrEnum as ExecutorBackend
    from enum import StrEnum as KvCacheDtype
    from enum import StrEnum as Quantization
else:
    Dtype = _engine_choices("Dtype", "dtype")
    Quantization = _engine_choices("Quantization", "quantization")
    KvCacheDtype = _engine_choices("KvCacheDtype", "kv_cache_dtype")
    ExecutorBackend = _engine_choices("ExecutorBackend", "distributed_executor_backend")


class BackendKind(StrEnum):
    native = "native"
    deepspeed = "deepspeed"


def build_settings(config: Path | None, model: Path | None, name: str | None = None,
                   backend: BackendKind = BackendKind.native, otlp_traces_endpoint: str | None = None,
                   **engine_options: str | int | None) -> Settings:
    """The config file's settings; ``--model`` (a local path) or a non-native ``--backend`` replaces its
    models with that one model served in-process by that engine; ``name`` is the public name of the one model
    served; ``otlp_traces_endpoint`` turns tracing on. ``engine_options`` (``dtype``, ``device``,
    ``tensor_parallel_size``, ``pipeline_parallel_size``, ``distributed_executor_backend``, ``quantization``, ``kv_cache_dtype``, ``block_size``, ``simulate``: None when not
    given) apply to every in-process deployment, and are refused where none would use them."""
    settings = load_settings(config)
    if otlp_traces_endpoint is not None:
        settings.tracing = settings.tracing.model_copy(update={"otlp_traces_endpoint": otlp_traces_endpoint})
    if model is not None and not model.exists():
        raise typer.BadParameter(f"{model} does not exist (give a local HF directory, .gguf or config.json file)",
                                 param_hint="--model")
    options: dict = {key: value for key, value in engine_options.items() if value is not None}
    if "simulate" in options:  # --simulate PROFILE: a simulated replica on that device profile (backends/sim)
        options["simulate"] = {"profile": options["simulate"]}
    native_only = sorted(set(options) - {"dtype"})
    if native_only and backend is not BackendKind.native:
        raise typer.BadParameter(f"{', '.join(_flag(k) for k in native_only)} apply to the native engine only",
                                 param_hint=_flag(native_only[0]))
    try:
        if model is not None or backend is not BackendKind.native:
            deployment = {"kind": backend.value, "model_path": str(model) if model else None, **options}
            settings.models = [ModelRoute(name=name or (model.stem if model else DEFAULT_MODEL_NAME),
                                          deployments=[deployment])]
        else:
            routes = settings.routes()
            if options:
                routes = [_with_engine_options(route, options) for route in routes]
            if name is not None:
                routes = [_renamed(routes, name)]
            settings.models = routes
    except ValidationError as exc:
        raise typer.BadParameter(str(exc), param_hint=", ".join(map(_flag, options))) from exc
    return settings


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def _renamed(routes: list[ModelRoute], name: str) -> ModelRoute:
    """The one model of ``routes`` served as ``name`` (``--served-model-name`` without ``--model``)."""
    if len(routes) != 1:
        raise typer.BadParameter(f"the config serves {len(routes)} models; name them in the config, not here",
                                 param_hint="--served-model-name")
    return routes[0].model_copy(update={"name": name})


def _with_engine_options(route: ModelRoute, options: dict[str, str]) -> ModelRoute:
    """``route`` with ``options`` set on its native deployments (validated again); an error if it has none."""
    if not any(d.kind == "native" for d in route.deployments):
        flags = ", ".join(map(_flag, options))
        raise typer.BadParameter(f"model {route.name!r} has no native deployment to apply {flags} to", param_hint=flags)
    return ModelRoute.model_validate({**route.model_dump(), "deployments": [
        {**d.model_dump(), **options} if d.kind == "native" else d.model_dump() for d in route.deployments]})


class WorkerOptions(BaseModel):
    """What each uvicorn worker of ``serve --workers N`` rebuilds its app from, handed over whole (as JSON in
    ``BURSTGATE_SERVE_OPTIONS``)."""

    config: Path | None
    model: Path | None
    served_model_name: str | None
    backend: BackendKind
    otlp_traces_endpoint: str | None
    engine_options: dict[str, str | int | None]
    log_level: str
    log_format: LogFormat

    def settings(self) -> Settings:
        return build_settings(self.config, self.model, self.served_model_name, self.backend, self.otlp_traces_endpoint,
                              **self.engine_options)


def app_from_env():
    """uvicorn factory for ``--workers N``: each worker rebuilds the app from the serve options."""
    from gateway.app import create_app
    from gateway.service import Gateway

    options = WorkerOptions.model_validate_json(os.environ[_SERVE_ENV])
    configure_logging(options.log_level, options.log_format)  # a spawned worker starts with no logging set up
    return create_app(Gateway.from_settings(options.settings()))


@app.command(cls=HelpCommand, epilog="""
burstgate serve                          # SmolLM2-135M-Instruct, embedded
burstgate serve --model ./Llama-3.2-1B-Instruct --dtype bfloat16
burstgate serve --config gateway.yaml --workers 4 --log-format json
burstgate serve --model ./llama-70b --tensor-parallel-size 2 \\
    --pipeline-parallel-size 2 --distributed-executor-backend ray
burstgate serve --simulate h100 --model configs/llama-12.3b-gqa.json
""")
def serve(
    host: Annotated[str, typer.Option(metavar="ADDR", help="Address to listen on.", rich_help_panel=SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", help="Port to listen on.", rich_help_panel=SERVER)] = 8000,
    config: Annotated[Path | None, typer.Option(help="YAML config (models, deployments, keys, limits).",
                                                exists=True, dir_okay=False, metavar="FILE", rich_help_panel=SERVER)] = None,
    model: Annotated[Path | None, typer.Option(metavar="PATH",
                                               help="Serve this local model (HF dir or .gguf) on the native engine.", rich_help_panel=ENGINE)] = None,
    served_model_name: Annotated[str | None, typer.Option(metavar="NAME", help="Public name for --model.", rich_help_panel=ENGINE)] = None,
    backend: Annotated[BackendKind, typer.Option(help="In-process engine for --model (or the embedded model).", rich_help_panel=ENGINE)] = BackendKind.native,
    dtype: Annotated[Dtype | None, typer.Option(help="In-process engine dtype (auto: bf16 where the hardware "
                                                "computes in it, else float32).", rich_help_panel=ENGINE)] = None,
    device: Annotated[str | None, typer.Option(metavar="DEVICE", help="Native engine device: auto (CUDA when "
                                               "present), cpu, cuda or cuda:N.", rich_help_panel=ENGINE)] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(min=1, metavar="N", help="Split the native engine's "
                                                             "model across N processes (GPUs on CUDA).", rich_help_panel=PARALLEL)] = None,
    pipeline_parallel_size: Annotated[int | None, typer.Option(min=1, metavar="N", help="Split the native engine's "
                                                               "layers into N stages, each on its own ranks "
                                                               "(vLLM's flag; uneven stages: "
                                                               "VLLM_PP_LAYER_PARTITION).", rich_help_panel=PARALLEL)] = None,
    distributed_executor_backend: Annotated[ExecutorBackend | None, typer.Option(
        help="Where the native engine's other ranks run: mp, processes of this machine; ray, actors of the Ray "
             "cluster at RAY_ADDRESS, across its nodes (vLLM's flag).", rich_help_panel=PARALLEL)] = None,
    quantization: Annotated[Quantization | None, typer.Option(help="Native engine weights: int8 (weight-only, a "
                                                              "scale per output channel; CPU) for decode-bound "
                                                              "serving.", rich_help_panel=ENGINE)] = None,
    kv_cache_dtype: Annotated[KvCacheDtype | None, typer.Option(help="Native engine KV cache: auto (the model's "
                                                                "dtype), or fp8 (e4m3) / fp8_e5m2, one byte per "
                                                                "value (CPU), as vLLM's --kv-cache-dtype.", rich_help_panel=ENGINE)] = None,
    block_size: Annotated[int | None, typer.Option(min=1, max=64, metavar="TOKENS", help="Native engine tokens per "
                                                   "KV block (default: 64 on CPU, 16 on CUDA), as vLLM's "
                                                   "--block-size.", rich_help_panel=ENGINE)] = None,
    simulate: Annotated[str | None, typer.Option(metavar="PROFILE", help="A simulated replica: the native engine's "
                                                 "scheduler with no model, each step the time this device profile "
                                                 "models (h100, h200, a GPU type, or a profile file; "
                                                 "`burstgate sim profiles`).", rich_help_panel=ENGINE)] = None,
    workers: Annotated[int, typer.Option(min=1, metavar="N", help="Worker processes (each loads its own engines).", rich_help_panel=SERVER)] = 1,
    otlp_traces_endpoint: Annotated[str | None, typer.Option(metavar="URL", help="Export OpenTelemetry traces of "
                                                             "each request over OTLP (http://collector:4318/v1/traces;"
                                                             " vLLM's flag). Off by default.", rich_help_panel=SERVER)] = None,
    ssl_keyfile: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE", help="Serve HTTPS: "
                                                     "the server's private key (PEM), with --ssl-certfile.", rich_help_panel=TLS)] = None,
    ssl_certfile: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE", help="Serve HTTPS: "
                                                      "the server's certificate chain (PEM).", rich_help_panel=TLS)] = None,
    ssl_ca_certs: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE", help="The CAs that "
                                                      "sign client certificates (mutual TLS, with "
                                                      "--ssl-cert-reqs).", rich_help_panel=TLS)] = None,
    ssl_cert_reqs: Annotated[int, typer.Option(min=0, max=2, metavar="N", help="Client certificates: 0 not asked "
                                               "for, 1 checked when given, 2 required (Python's ssl.CERT_*, as "
                                               "uvicorn's and vLLM's flag).", rich_help_panel=TLS)] = 0,
    log_level: Annotated[LogLevel, typer.Option(help="Logging level.", rich_help_panel=SERVER)] = LogLevel.info,
    log_format: Annotated[LogFormat, typer.Option(help="text, or json: one object per line (access lines "
                                                  "included), with the request's X-Request-Id.", rich_help_panel=SERVER)] = "text",
) -> None:
    """Start the gateway. With no options: SmolLM2-135M-Instruct on the native engine, in-process."""
    import uvicorn

    from gateway.http_server import uvicorn_options

    level = log_level.value
    configure_logging(level, log_format)
    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise typer.BadParameter("HTTPS needs both --ssl-keyfile and --ssl-certfile", param_hint="--ssl-certfile")
    if (ssl_ca_certs is not None or ssl_cert_reqs) and ssl_certfile is None:
        raise typer.BadParameter("client certificates need HTTPS (--ssl-keyfile, --ssl-certfile)",
                                 param_hint="--ssl-ca-certs / --ssl-cert-reqs")
    if ssl_cert_reqs and ssl_ca_certs is None:
        raise typer.BadParameter("checking client certificates needs the CAs that sign them", param_hint="--ssl-ca-certs")
    if ssl_certfile is not None:
        _check_tls_files(ssl_certfile, ssl_keyfile, ssl_ca_certs)
    engine_options = {"dtype": dtype.value if dtype else None, "device": device,
                      "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
                      "distributed_executor_backend": distributed_executor_backend.value
                      if distributed_executor_backend else None,
                      "quantization": quantization.value if quantization else None,
                      "kv_cache_dtype": kv_cache_dtype.value if kv_cache_dtype else None, "block_size": block_size,
                      "simulate": simulate}
    try:
        settings = build_settings(config, model, served_model_name, backend, otlp_traces_endpoint, **engine_options)
    except ValueError as exc:  # an invalid config file or environment override
        raise typer.BadParameter(str(exc), param_hint="--config / BURSTGATE_*") from None
    names = ", ".join(r.name for r in settings.routes())
    log.info("burstgate will listen on %s://%s:%d (models: %s; workers: %d)", "https" if ssl_certfile else "http",
             host, port, names, workers)
    options = uvicorn_options(settings.server)
    if ssl_certfile is not None:
        options |= {"ssl_keyfile": str(ssl_keyfile), "ssl_certfile": str(ssl_certfile), "ssl_cert_reqs": ssl_cert_reqs,
                    "ssl_ca_certs": str(ssl_ca_certs) if ssl_ca_certs else None}
    if workers > 1:
        os.environ[_SERVE_ENV] = WorkerOptions(config=config, model=model, served_model_name=served_model_name,
                                               backend=backend, otlp_traces_endpoint=otlp_traces_endpoint,
                                               engine_options=engine_options, log_level=level,
                                               log_format=log_format).model_dump_json()
        uvicorn.run("gateway.cli:app_from_env", factory=True, host=host, port=port, workers=workers,
                    log_level=level, **options)
        return
    from gateway.app import create_app
    from gateway.service import Gateway

    uvicorn.run(create_app(Gateway.from_settings(settings)), host=host, port=port, log_level=level, **options)



def _check_tls_files(certfile: Path, keyfile: Path | None, ca_certs: Path | None) -> None:
    """Files that do not load fail here, named, not as a traceback when uvicorn starts."""
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except ssl.SSLError as exc:
        raise typer.BadParameter(f"the certificate and key do not load together: {exc}",
                                 param_hint="--ssl-certfile / --ssl-keyfile") from None
    try:
        if ca_certs is not None:
            context.load_verify_locations(ca_certs)
    except ssl.SSLError as exc:
        raise typer.BadParameter(f"no CA certificates there: {exc}", param_hint="--ssl-ca-certs") from None


if TYPE_CHECKING:  # typer's choices, made from the tables at run time
    from enum import StrEnum as GpuName
    from enum import StrEnum as InterconnectName
else:
    GpuName = Enum("GpuName", {name.replace("-", "_"): name for name in GPUS}, type=str)
    InterconnectName = Enum("InterconnectName", {name.replace("-", "_"): name for name in INTERCONNECTS}, type=str)


class PlanDtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@app.command(cls=HelpCommand, short_help="What fits where, how to split a model over GPUs, how many replicas for an "
             "SLO.", epilog="""
# what fits where: weights, KV capacity, roofline decode speed
burstgate plan --model configs/llama-12.3b-gqa.json --gpu h100 --gpu rtx4090

# how to split a 70B model over 8 GPUs without peer-to-peer
burstgate plan --model configs/llama-2-70b.json --gpu rtx4090 --gpus 8 \\
    --interconnect pcie4-no-p2p

# the fewest replicas that serve 20 req/s within both SLOs
burstgate plan --model configs/llama-12.3b-gqa.json --gpu h100 --rate 20 \\
    --slo ttft_p99_ms=2000 --slo tpot_p99_ms=100 --plot replicas.png
""")
def plan(
    model: Annotated[Path, typer.Option(exists=True, metavar="PATH",
                                        help="HF directory, .gguf or config.json (only the config is read).", rich_help_panel=MODEL_GPU)],
    gpu: Annotated[list[GpuName], typer.Option(metavar="GPU", help=f"GPU type, one of {', '.join(GPUS)} (datasheet "
                                               "memory, bandwidth and bf16 peak); repeat to compare types.", rich_help_panel=MODEL_GPU)],
    dtype: Annotated[PlanDtype, typer.Option(help="Weights and KV cache dtype.", rich_help_panel=MODEL_GPU)] = PlanDtype.bfloat16,
    tensor_parallel_size: Annotated[int | None, typer.Option(min=1, metavar="N", help="GPUs per model; default: "
                                                             "the fewest that fit (with --slo: each size a node "
                                                             "takes, the fewest GPUs in all).", rich_help_panel=MODEL_GPU)] = None,
    input_len: Annotated[int, typer.Option(min=1, metavar="N", help="Prompt tokens per sequence.", rich_help_panel=MODEL_GPU)] = 512,
    output_len: Annotated[int, typer.Option(min=1, metavar="N", help="Output tokens per sequence.", rich_help_panel=MODEL_GPU)] = 128,
    gpu_memory_utilization: Annotated[float, typer.Option(min=0.05, max=1.0, metavar="X",
                                                          help="Share of each GPU the engine takes.", rich_help_panel=MODEL_GPU)] = 0.9,
    max_num_seqs: Annotated[int, typer.Option(min=1, metavar="N", help="The engine's concurrency limit.", rich_help_panel=MODEL_GPU)] = 256,
    slo: Annotated[list[str] | None, typer.Option(metavar="METRIC_STAT_ms=LIMIT", help="With it, the fewest replicas "
                                                  "that meet it, from simulated fleets (repeatable; e.g. "
                                                  "ttft_p99_ms=2000, tpot_p99_ms=100).", rich_help_panel=SLO)] = None,
    rate: Annotated[float | None, typer.Option(min=0.001, metavar="REQ/S", help="With --slo: the traffic's arrival "
                                               "rate.", rich_help_panel=SLO)] = None,
    requests: Annotated[int, typer.Option(min=1, metavar="N", help="With --slo: requests simulated; with --gpus: "
                                          "prompts in the burst.", rich_help_panel=MODEL_GPU)] = 1000,
    arrivals: Annotated[str, typer.Option(metavar="KIND", help="With --slo: poisson, constant or gamma.", rich_help_panel=SLO)] = "poisson",
    trace: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE", help="With --slo: a "
                                               "Mooncake-format trace as the traffic instead.", rich_help_panel=SLO)] = None,
    dataset: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE", help="With --slo: "
                                                 "prompts from a load-test dataset (JSONL, ShareGPT or Alpaca JSON), "
                                                 "with its own output lengths, at --rate.", rich_help_panel=SLO)] = None,
    routing: Annotated[str, typer.Option(metavar="POLICY", help="With --slo: the routing policy.", rich_help_panel=SLO)] = "cache_aware",
    routing_option: Annotated[list[str] | None, typer.Option(metavar="KEY=VALUE", help="With --slo: a setting of the "
                              "routing policy (repeatable), e.g. load_cost_tokens=256.", rich_help_panel=SLO)] = None,
    max_replicas: Annotated[int, typer.Option(min=1, metavar="N", help="With --slo: the most replicas tried.", rich_help_panel=SLO)] = 64,
    plot: Annotated[Path | None, typer.Option(dir_okay=False, metavar="FILE.png", help="With --slo: the curves "
                                              "behind the answer as a chart.", rich_help_panel=SLO)] = None,
    gpus: Annotated[int | None, typer.Option(min=1, metavar="N", help="How to split the model over N GPUs: every "
                                             "tensor x pipeline parallel layout and its burst time, the fastest "
                                             "recommended.", rich_help_panel=SPLIT)] = None,
    interconnect: Annotated[InterconnectName | None, typer.Option(
        metavar="LINK", help=f"With --gpus: how GPUs in a node are joined, one of {', '.join(INTERCONNECTS)} "
        "(default: the GPU type's).", rich_help_panel=SPLIT)] = None,
    network: Annotated[InterconnectName, typer.Option(metavar="LINK", help="With --gpus: how nodes are joined.",
                                                      rich_help_panel=SPLIT)] = InterconnectName("ib-200g"),
    gpus_per_node: Annotated[int, typer.Option(min=1, metavar="N", help="With --gpus: GPUs in a node.", rich_help_panel=SPLIT)] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.", rich_help_panel=MODEL_GPU)] = False,
) -> None:
    """Memory and roofline speed of the native engine for a model on a GPU type: what fits where. With --gpus: how
    to split it over that many (tensor x pipeline parallel, per interconnect). With --slo: how many replicas of it
    carry a traffic within that SLO, per GPU type."""
    from backends.native.weights import open_checkpoint

    if gpus is not None:
        _plan_split(model, [g.value for g in gpu], gpus, dtype.value, input_len, output_len, requests,
                    gpu_memory_utilization, max_num_seqs, interconnect.value if interconnect else None,
                    InterconnectName(network).value, gpus_per_node, as_json)
        return
    if slo:
        _plan_for_slo(model, [g.value for g in gpu], slo, rate, requests, arrivals, trace, dataset, input_len,
                      output_len, tensor_parallel_size, max_num_seqs, gpu_memory_utilization, routing,
                      routing_option or [], max_replicas,
                      plot, as_json)
        return
    from backends.native.planner import plan as make_plan

    try:
        config = open_checkpoint(model).config
        results = [make_plan(config, g.value, dtype.value, tensor_parallel_size, input_len, output_len,
                             gpu_memory_utilization, max_num_seqs=max_num_seqs) for g in gpu]
    except (ValueError, KeyError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--model / --tensor-parallel-size") from None
    if as_json:
        dicts = [r.as_dict() for r in results]
        typer.echo(json.dumps(dicts[0] if len(dicts) == 1 else dicts, indent=2))
        return
    for g, result in zip(gpu, results):
        _print_static_plan(model, g.value, dtype.value, input_len, output_len, max_num_seqs, result)


def _print_static_plan(model: Path, gpu: str, dtype: str, input_len: int, output_len: int, max_num_seqs: int,
                       result) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{model.name} on {GPUS[gpu].name}, {dtype}, ({input_len} in, {output_len} out)")
    for column in ("", "value"):
        table.add_column(column)
    rows = [("tensor parallel size", str(result.tensor_parallel_size)), ("fits", "yes" if result.fits else "no"),
            ("weights per GPU", f"{result.weights_per_gpu_gib:.2f} GiB"),
            ("KV bytes per token per GPU", f"{result.kv_bytes_per_token_per_gpu:,}"),
            ("KV cache", f"{result.kv_tokens:,} tokens, {result.sequences:,} sequences"),
            ("decode, batch 1 (roofline)", f"{result.decode_tok_s_batch_1:,.0f} tok/s"),
            (f"decode, {min(result.sequences, max_num_seqs)} sequences (roofline)",
             f"{result.decode_tok_s_at_sequences:,.0f} tok/s")]
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    if result.why:
        typer.echo(result.why)


def _plan_split(model: Path, gpus: list[str], count: int, dtype: str, input_len: int, output_len: int, requests: int,
                utilization: float, max_num_seqs: int, interconnect: str | None, network: str, gpus_per_node: int,
                as_json: bool) -> None:
    """``plan --gpus N``: per GPU type, every tensor x pipeline layout of the model on N GPUs, fastest first."""
    from rich.console import Console
    from rich.table import Table

    from backends.native.split_planner import Burst, plan_split
    from backends.native.weights import open_checkpoint

    burst = Burst(requests, input_len, output_len, utilization, max_num_seqs)
    try:
        config = open_checkpoint(model).config
        plans = [plan_split(config, g, count, burst, dtype, interconnect, network, gpus_per_node) for g in gpus]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model / --gpus") from None
    if as_json:
        dicts = [p.as_dict() for p in plans]
        typer.echo(json.dumps(dicts[0] if len(dicts) == 1 else dicts, indent=2))
        return
    for p in plans:
        table = Table(title=f"{model.name} on {count} x {GPUS[p.gpu].name} ({INTERCONNECTS[p.interconnect].name}), "
                            f"{dtype}: {requests} x ({input_len} in, {output_len} out) at once")
        for column in ("TP", "PP", "replicas", "nodes", "fits", "running", "prefill s", "decode s", "burst s",
                       "output tok/s", "all-reduce s", "sends s", "waiting s"):
            table.add_column(column, justify="right", no_wrap=True)
        for l in p.layouts:
            cells = [f"{l.prefill_s:,.1f}", f"{l.decode_s:,.1f}", f"{l.burst_s:,.1f}", f"{l.output_tok_s:,.0f}",
                     f"{l.all_reduce_s:,.1f}", f"{l.send_s:,.2f}", f"{l.bubble_s:,.1f}"] if l.fits else [""] * 7
            table.add_row(str(l.tensor_parallel_size), str(l.pipeline_parallel_size), str(l.replicas),
                          str(l.nodes_per_replica), "yes" if l.fits else "no", str(l.sequences), *cells)
        Console(width=max(Console().width, 140)).print(table)  # 13 columns: wider than a default 80
        typer.echo(f"recommended: {p.reason}")


def _plan_for_slo(model: Path, gpus: list[str], slo_texts: list[str], rate: float | None, requests: int,
                  arrivals: str, trace: Path | None, dataset: Path | None, input_len: int, output_len: int,
                  tensor_parallel_size: int | None,
                  max_num_seqs: int, gpu_memory_utilization: float, routing: str, routing_options: list[str],
                  max_replicas: int,
                  plot: Path | None, as_json: bool) -> None:
    """``plan --slo``: per GPU type, the fewest GPUs whose simulated fleet meets every SLO (replicas x tensor-parallel
    size, every size a node takes tried unless --tensor-parallel-size fixes it)."""
    from backends.native.config import EngineConfig
    from backends.sim.capacity import parse_slo, plan_fleet
    from backends.sim.cli import build_workload, routing_config
    from backends.sim.virtual import engine_tokenizer

    try:
        slos = dict(parse_slo(text) for text in slo_texts)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--slo") from None
    if rate is None and trace is None:
        raise typer.BadParameter("an SLO holds at a traffic: give its --rate (or a --trace)", param_hint="--rate")
    engine = EngineConfig(model_path=str(model), max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                          gpu_memory_utilization=gpu_memory_utilization)
    policy = routing_config(routing, routing_options)

    tokenizer = engine_tokenizer(engine)  # loaded once: the dataset's prompts and every simulated engine
    try:
        work = build_workload(requests, input_len, None if dataset else output_len, rate, arrivals, 0, trace=trace,
                              dataset=dataset, tokenizer=tokenizer)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--trace") from None
    try:
        plans = [plan_fleet(engine, g, work, slos, policy, max_replicas, tensor_parallel_size, tokenizer)
                 for g in gpus]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model / --tensor-parallel-size") from None
    if plot is not None:
        from backends.sim.charts import plan_chart

        plan_chart(plans, slos, plot)
    if as_json:
        typer.echo(json.dumps({"slos_ms": slos, "rate": rate, "plans": [p.as_dict(slos) for p in plans]}, indent=2))
        return
    limits = ", ".join(f"{k} <= {v:g}" for k, v in slos.items())
    traffic = (f"trace {trace.name}" if trace else f"{dataset.name} at {rate:g} req/s" if dataset
               else f"{rate:g} req/s ({input_len} in, {output_len} out)")
    typer.echo(f"{model.name}, {traffic}, {limits}, routing {routing} (simulated fleets, backends/sim):")
    for p in plans:
        answer = (f"{p.replicas} replica{'s' if p.replicas > 1 else ''} x TP {p.tensor_parallel_size} = {p.gpus} "
                  f"GPU{'s' if (p.gpus or 0) > 1 else ''}" if p.replicas else p.why)
        others = "; ".join(f"TP {o.tensor_parallel_size}: " + (f"{o.replicas} x {o.tensor_parallel_size} = {o.gpus}"
                                                               if o.replicas else o.why) for o in p.others)
        typer.echo(f"  {p.gpu}: {answer}" + (f" (also tried {others})" if others else ""))
        for point in p.curve:
            s = point.summary
            typer.echo(f"    {point.replicas:>3} replicas: {'meets' if point.meets else 'misses':<6}  output "
                       f"{s['output_throughput']:,.0f} tok/s  TTFT p50/p99 {s['median_ttft_ms']:,.0f}/"
                       f"{s['p99_ttft_ms']:,.0f} ms  TPOT p50/p99 {s['median_tpot_ms']:.1f}/{s['p99_tpot_ms']:.1f} ms")


if __name__ == "__main__":
    app()
