"""Real servers for tests: uvicorn on 127.0.0.1 in a background thread, ``burstgate serve`` and redis-server
processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
import yaml


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` ports free now, all different (held together while chosen: one at a time, the OS may hand the
    same one out twice before any server binds it)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


@contextlib.contextmanager
def serve_app(app, timeout: float = 120.0, host: str = "127.0.0.1", port: int | None = None,
              **options) -> Iterator[str]:
    """Run an ASGI app under uvicorn (``options`` for its ``Config``) on ``host`` (any loopback address) at
    ``port`` (default: a free one); yields its base URL."""
    port = port or free_port()
    options = {"log_level": "warning", "timeout_graceful_shutdown": 5, **options}
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@dataclass
class Served:
    """A ``burstgate serve`` process and where it listens."""

    url: str
    port: int
    proc: subprocess.Popen


def spawn_burstgate(*options: str, port: int | None = None, env: dict[str, str] | None = None) -> Served:
    """``burstgate serve *options`` as a user starts it (``env`` added to this environment), not waited for:
    ``wait_until_ready`` does."""
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level",
                             "warning", *options], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    return Served(f"{'https' if '--ssl-certfile' in options else 'http'}://127.0.0.1:{port}", port, proc)


def wait_until_ready(served: Served, timeout: float = 600.0, verify: ssl.SSLContext | bool = True) -> Served:
    """``served`` once its ``/ready`` answers 200 (over HTTPS, checked with ``verify``, when it serves that);
    killed if it never does."""
    deadline = time.monotonic() + timeout  # a loaded 2-core machine loads and warms up a model slowly
    while True:
        if served.proc.poll() is not None:
            raise RuntimeError(f"burstgate serve exited with {served.proc.returncode}: {served.proc.stderr.read()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{served.url}/ready", timeout=2, verify=verify).status_code == 200:
                return served
        if time.monotonic() > deadline:
            served.proc.kill()
            raise RuntimeError("burstgate serve did not become ready")
        time.sleep(0.3)


def start_burstgate(*options: str, port: int | None = None, env: dict[str, str] | None = None,
                    timeout: float = 600.0, verify: ssl.SSLContext | bool = True) -> Served:
    """``spawn_burstgate`` once ready (``wait_until_ready``). The caller stops it (``proc.terminate()``)."""
    return wait_until_ready(spawn_burstgate(*options, port=port, env=env), timeout, verify)


def start_burstgates(*option_lists: Sequence[str], ports: Sequence[int] = (),
                     env: dict[str, str] | None = None) -> list[Served]:
    """A fleet of ``burstgate serve``, one per list of options (on ``ports``, else free ones), started together (a
    start is mostly one core's imports and model loading: two take the time of one on two cores) and returned once
    all are ready; none is left running if one fails. The caller stops them."""
    ports = list(ports) or free_ports(len(option_lists))
    spawned = [spawn_burstgate(*options, port=port, env=env) for options, port in zip(option_lists, ports)]
    try:
        return [wait_until_ready(served) for served in spawned]
    except BaseException:
        for served in spawned:
            served.proc.kill()
            served.proc.wait()
        raise


def replica_with_kv_events(folder: Path, events_port: int) -> list[str]:
    """The options of ``burstgate serve`` for one native engine (one thread, model "m", 16-token blocks) publishing
    its KV events on ``events_port``: a replica of a fleet as ops run it."""
    config = folder / f"replica-{events_port}.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": "m", "deployments": [{
        "kind": "native", "dtype": "float32", "num_threads": 1, "max_model_len": 2048, "num_blocks": 256,
        "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512,
        "kv_events_config": {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{events_port}"}}]}]}))
    return ["--config", str(config)]


@contextlib.contextmanager
def replicas_with_kv_events(folder: Path, count: int = 2) -> Iterator[list[tuple[Served, int]]]:
    """``count`` replicas of ``replica_with_kv_events``, each with its events port; those still running (the
    list's entries at the end: a test may restart one in its place) are stopped afterwards."""
    ports = free_ports(count)
    started = list(zip(start_burstgates(*(replica_with_kv_events(folder, port) for port in ports)), ports))
    try:
        yield started
    finally:
        for served, _ in started:
            if served.proc.poll() is None:
                served.proc.terminate()
                served.proc.wait(timeout=120)


@contextlib.contextmanager
def burstgate_serve(*options: str, env: dict[str, str] | None = None,
                    verify: ssl.SSLContext | bool = True) -> Iterator[Served]:
    """``start_burstgate``, stopped (SIGTERM, then waited for) on leaving."""
    served = start_burstgate(*options, env=env, verify=verify)
    try:
        yield served
    finally:
        if served.proc.poll() is None:
            served.proc.terminate()
        served.proc.wait(timeout=180)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A throw-away redis-server on a free port (no persistence); yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: `make test` installs it (apt redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.1):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def wait_for_port(port: int, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


def spawn_mock_server(port: int, model: str = "mock", ttft_ms: float = 0, itl_ms: float = 0) -> subprocess.Popen:
    """``burstgate loadtest mock-server`` as a separate process, so tests can kill it like a crashed backend."""
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "loadtest", "mock-server", "--port", str(port),
                             "--model", model, "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)])
    wait_for_port(port, proc=proc)
    return proc
