"""A rolling restart loses nothing: two ``burstgate serve`` processes behind HAProxy (Debian's, in TCP mode with
``/ready`` health checks: what a Kubernetes Service and its endpoints do), each stopped with SIGTERM and started
again in turn while clients stream without pause. Every request is answered and every stream runs to its end.

The replicas are simulated (``--simulate``: the engine's scheduler paced as the 2-core CPU profile models it),
so streams last seconds without computing a model.
"""

from __future__ import annotations

import csv
import shutil
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.gateway.test_drain import SIMULATED, completed, drain_env, stream
from tests.servers import free_port, start_burstgate, start_burstgates, wait_for_port

HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed: `make test` installs it")


def haproxy_config(listen: int, servers: list[int], stats: Path) -> str:
    # inter/fall: a draining replica (/ready 503) leaves the rotation within 0.2 s, well inside its grace window;
    # retries + redispatch: a connection refused by a replica that just stopped accepting goes to another;
    # the stats socket says when a restarted replica is back in the rotation (rise 2: 0.4 s after it is ready)
    lines = ["global", f"  stats socket {stats} level user", "defaults", "  mode tcp", "  timeout connect 2s", "  timeout client 120s", "  timeout server 120s",
             "  retries 3", "  option redispatch", "frontend gateways", f"  bind 127.0.0.1:{listen}",
             "  default_backend replicas", "backend replicas", "  balance roundrobin", "  option httpchk GET /ready",
             "  http-check expect status 200", "  default-server inter 200ms fall 1 rise 2"]
    lines += [f"  server g{i} 127.0.0.1:{port} check" for i, port in enumerate(servers)]
    return "\n".join(lines) + "\n"


def wait_until_in_rotation(stats: Path, server: str, timeout_s: float = 30.0) -> None:
    """Until HAProxy routes to ``server`` again: a rolling restart stops the next replica only then (a Kubernetes
    Deployment with maxUnavailable 0 waits for the new pod's readiness and its endpoint likewise)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(stats))
            sock.sendall(b"show stat\n")
            rows = b"".join(iter(lambda: sock.recv(65536), b"")).decode().splitlines()
        header = rows[0].lstrip("# ").split(",")
        for row in csv.DictReader(rows[1:], fieldnames=header):
            if row["pxname"] == "replicas" and row["svname"] == server and row["status"] == "UP":
                return
        time.sleep(0.05)
    raise TimeoutError(f"HAProxy did not put {server} back in rotation within {timeout_s} s")


def test_a_rolling_restart_of_two_gateways_behind_a_load_balancer_loses_no_request_and_cuts_no_stream(tmp_path):
    env = drain_env(grace_s=1.5, timeout_s=120)
    replicas = start_burstgates(SIMULATED, SIMULATED, env=env)
    listen = free_port()
    config = tmp_path / "haproxy.cfg"
    stats = tmp_path / "haproxy.sock"
    config.write_text(haproxy_config(listen, [r.port for r in replicas], stats))
    balancer = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{listen}"
    stop = threading.Event()
    results: list[list] = []

    def client() -> None:  # streams back to back, each on a new connection (as many clients would)
        while not stop.is_set():
            results.append(stream(url, 40))

    try:
        wait_for_port(listen, proc=balancer)
        with ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(client) for _ in range(4)]
            for i, replica in enumerate(replicas):
                served_before = len(results)
                replica.proc.send_signal(signal.SIGTERM)
                assert replica.proc.wait(timeout=180) in (0, -signal.SIGTERM)
                replicas[i] = start_burstgate(*SIMULATED, port=replica.port, env=env)
                wait_until_in_rotation(stats, f"g{i}")
                assert len(results) > served_before  # traffic went on while this replica was away
            stop.set()
            for c in clients:
                c.result()  # a failed request or a cut stream raises here
        assert len(results) >= 8 and all(completed(events, 40) for events in results)
    finally:
        stop.set()
        balancer.terminate()
        balancer.wait(timeout=10)
        for replica in replicas:
            replica.proc.terminate()
            replica.proc.wait(timeout=180)
