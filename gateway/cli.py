"""The ``burstgate`` command: ``serve`` the gateway; ``loadtest`` subcommands live in loadtest/cli.py."""

from __future__ import annotations

import json
import logging
import os
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from gateway.access_log import LogFormat, configure_logging
from gateway.config import DEFAULT_MODEL_NAME, ModelRoute, Settings, load_settings
from loadtest.cli import app as loadtest_app

app = typer.Typer(help="burstgate: OpenAI-compatible LLM gateway, native engine and burst load tester.",
                  no_args_is_help=True, add_completion=False)
app.add_typer(loadtest_app, name="loadtest", help="Burst-mode load tests, side by side across backends.")
log = logging.getLogger("burstgate")

_SERVE_ENV = "BURSTGATE_SERVE_ARGS"


@app.callback()
def main() -> None:
    """burstgate: OpenAI-compatible LLM gateway, native engine and burst load tester."""  # hands the parsed options to uvicorn worker processes


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class BackendKind(str, Enum):
    native = "native"
    deepspeed = "deepspeed"


def build_settings(config: Path | None, model: Path | None, dtype: Dtype | None, name: str | None,
                   backend: BackendKind = BackendKind.native, device: str | None = None) -> Settings:
    """The config file's settings; ``--model`` (a local path) or a non-native ``--backend`` replaces its
    models with that one model served in-process by that engine. ``--dtype`` and ``--device`` apply to
    every in-process deployment, and are refused where none would use them."""
    settings = load_settings(config)
    if model is not None and not model.exists():
        raise typer.BadParameter(f"{model} does not exist (give a local HF directory, .gguf or config.json file)",
                                 param_hint="--model")
    if device is not None and backend is not BackendKind.native:
        raise typer.BadParameter("--device applies to the native engine only", param_hint="--device")
    options = {key: value for key, value in (("dtype", dtype.value if dtype else None), ("device", device))
               if value is not None}
    try:
        if model is not None or backend is not BackendKind.native:
            deployment = {"kind": backend.value, "model_path": str(model) if model else None, **options}
            settings.models = [ModelRoute(name=name or (model.stem if model else DEFAULT_MODEL_NAME),
                                          deployments=[deployment])]
        elif options:
            settings.models = [_with_engine_options(route, options) for route in settings.routes()]
    except ValidationError as exc:
        raise typer.BadParameter(str(exc), param_hint="--dtype/--device") from exc
    return settings


def _with_engine_options(route: ModelRoute, options: dict[str, str]) -> ModelRoute:
    """``route`` with ``options`` set on its native deployments (validated again); an error if it has none."""
    if not any(d.kind == "native" for d in route.deployments):
        raise typer.BadParameter(f"model {route.name!r} has no native deployment to apply "
                                 f"{', '.join('--' + k for k in options)} to", param_hint="--dtype/--device")
    return ModelRoute.model_validate({**route.model_dump(), "deployments": [
        {**d.model_dump(), **options} if d.kind == "native" else d.model_dump() for d in route.deployments]})


def app_from_env():
    """uvicorn factory for ``--workers N``: each worker rebuilds the app from the serve options."""
    from gateway.app import create_app
    from gateway.service import Gateway

    args = json.loads(os.environ[_SERVE_ENV])
    configure_logging(args[6], args[7])  # a spawned worker starts with no logging configuration
    settings = build_settings(*(Path(a) if a else None for a in args[:2]),
                              Dtype(args[2]) if args[2] else None, args[3], BackendKind(args[4]), args[5])
    return create_app(Gateway.from_settings(settings))


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    config: Annotated[Path | None, typer.Option(help="YAML config (models, deployments, keys, limits).",
                                                exists=True, dir_okay=False)] = None,
    model: Annotated[Path | None, typer.Option(help="Serve this local model (HF dir or .gguf) on the native engine.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Public name for --model.")] = None,
    backend: Annotated[BackendKind, typer.Option(help="In-process engine for --model (or the embedded model).")] = BackendKind.native,
    dtype: Annotated[Dtype | None, typer.Option(help="In-process engine dtype (auto: bf16 where the hardware "
                                                "computes in it, else float32).")] = None,
    device: Annotated[str | None, typer.Option(help="Native engine device: auto (CUDA when present), cpu, cuda or "
                                               "cuda:N.")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes (each loads its own engines).")] = 1,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "info",
    log_format: Annotated[LogFormat, typer.Option(help="text, or json: one object per line (access lines "
                                                  "included), with the request's X-Request-Id.")] = "text",
) -> None:
    """Start the gateway. With no options: SmolLM2-135M-Instruct on the native engine, in-process."""
    import uvicorn

    from gateway.http_server import uvicorn_options

    configure_logging(log_level, log_format)
    settings = build_settings(config, model, dtype, served_model_name, backend, device)
    names = ", ".join(r.name for r in settings.routes())
    log.info("burstgate will listen on http://%s:%d (models: %s; workers: %d)", host, port, names, workers)
    options = uvicorn_options(settings.server)
    if workers > 1:
        os.environ[_SERVE_ENV] = json.dumps([str(config) if config else None, str(model) if model else None,
                                             dtype.value if dtype else None, served_model_name, backend.value,
                                             device, log_level, log_format])
        uvicorn.run("gateway.cli:app_from_env", factory=True, host=host, port=port, workers=workers,
                    log_level=log_level, **options)
        return
    from gateway.app import create_app
    from gateway.service import Gateway

    uvicorn.run(create_app(Gateway.from_settings(settings)), host=host, port=port, log_level=log_level, **options)



if __name__ == "__main__":
    app()
