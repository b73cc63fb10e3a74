"""Hostile clients against a real uvicorn with burstgate's server settings: slow headers and bodies time out
(408), huge heads are refused (431), bodies over the limit get 413 whether announced or chunked, and
thousands of idle connections are capped while a normal request is still answered."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest

from gateway.app import create_app
from gateway.config import Settings
from gateway.http_server import uvicorn_options
from gateway.service import Gateway
from loadtest.mock_server import create_mock_app
from tests.servers import serve_app

TIMEOUT_S = 1.0
MAX_CONNECTIONS = 200
BODY = {"model": "m", "prompt": "Hi", "max_tokens": 2}


@contextlib.contextmanager
def _gateway(**server):
    """A gateway in front of the mock server, served by uvicorn with burstgate's protocol and ``server``."""
    with serve_app(create_mock_app()) as up:
        settings = Settings(
            models=[{"name": "m", "deployments": [{"kind": "openai", "url": f"{up}/v1", "upstream_model": "mock"}]}],
            limits={"max_body_bytes": 4096}, server=server)
        with serve_app(create_app(Gateway.from_settings(settings)), **uvicorn_options(settings.server)) as url:
            yield url


@pytest.fixture(scope="module")
def url():
    with _gateway(request_timeout_s=TIMEOUT_S, max_header_bytes=8192) as url:
        yield url


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _normal_request_works(url: str) -> None:
    assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=10).status_code == 200


def test_headers_trickled_byte_by_byte_time_out_while_others_are_served(url):
    with contextlib.closing(_connect(url)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        start = time.monotonic()
        with pytest.raises(OSError):  # the server closes the connection under us, within the deadline
            while time.monotonic() - start < 10 * TIMEOUT_S:
                sock.sendall(b"x")
                _normal_request_works(url)  # the worker is not stuck meanwhile
                time.sleep(0.05)
        assert time.monotonic() - start < 5 * TIMEOUT_S


def test_a_slow_body_times_out_with_408(url):
    with contextlib.closing(_connect(url)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 200\r\n\r\n{\"model\": \"m\",")
        _normal_request_works(url)
        start = time.monotonic()
        answer = _answer(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - start < 5 * TIMEOUT_S


def test_a_connection_that_sends_nothing_is_closed(url):
    with contextlib.closing(_connect(url)) as sock:
        assert _answer(sock).startswith(b"HTTP/1.1 408 ")


def test_huge_headers_are_refused_with_431(url):
    with contextlib.closing(_connect(url)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 431 ")
    _normal_request_works(url)


def test_a_head_that_never_ends_is_refused_with_431_as_soon_as_it_passes_the_cap(url):
    with contextlib.closing(_connect(url)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        started = time.monotonic()
        for i in range(9):  # 9 x 1 KiB lines past the 8 KiB cap, never the blank line that ends a head
            sock.sendall(b"x-h%d: " % i + b"a" * 1024 + b"\r\n")
            time.sleep(0.01)
        assert _answer(sock).startswith(b"HTTP/1.1 431 ")
        assert time.monotonic() - started < TIMEOUT_S  # refused for its size, not timed out (408)
    _normal_request_works(url)


def test_a_small_head_arriving_with_a_large_body_in_one_read_is_served(url):
    """Reads that hold a head and a body are measured by the head alone."""
    body = b'{"model": "m", "prompt": "' + b"a" * 3000 + b'", "max_tokens": 2}'
    with contextlib.closing(_connect(url)) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
        pad = b"x-pad: " + b"a" * 6000 + b"\r\n"  # head ~6 KiB + body ~3 KiB: one read over the 8 KiB cap
        sock.sendall(head + pad + b"content-length: %d\r\n\r\n" % len(body) + body)
        assert _answer(sock).startswith(b"HTTP/1.1 200 ")


def test_bodies_over_the_limit_are_413_with_or_without_content_length(url):
    big = b'{"model": "m", "prompt": "' + b"a" * 10_000 + b'"}'

    def chunked():
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    announced = httpx.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json"})
    streamed = httpx.post(f"{url}/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert "content-length" not in streamed.request.headers  # sent chunked
    for r in (announced, streamed):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    _normal_request_works(url)


def test_thousands_of_idle_connections_are_capped_and_a_normal_request_is_answered():
    with _gateway(request_timeout_s=120, max_connections=MAX_CONNECTIONS) as url:  # no timeout closes them here
        _idle_connections_are_capped(url)


def _idle_connections_are_capped(url: str) -> None:
    socks = [_connect(url) for _ in range(2000)]
    try:
        _normal_request_works(url)
        for sock in socks:
            sock.setblocking(False)
        open_socks = socks
        deadline = time.monotonic() + 30  # a busy server may still be accepting the last of them
        while len(open_socks) > MAX_CONNECTIONS and time.monotonic() < deadline:
            open_socks = [sock for sock in open_socks if _open(sock)]
            time.sleep(0.1)
        assert len(open_socks) <= MAX_CONNECTIONS
        _normal_request_works(url)
    finally:
        for sock in socks:
            sock.close()


def _open(sock: socket.socket) -> bool:
    """Still held by the server: nothing to read yet (a closed one reads EOF, a refused one its answer)."""
    try:
        sock.recv(65536)
    except BlockingIOError:
        return True
    except ConnectionError:
        pass
    return False
