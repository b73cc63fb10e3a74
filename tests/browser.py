"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol, to check pages as a browser
renders them: console errors, uncaught exceptions, and what a script evaluated in the page returns."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from tests.servers import free_port


@dataclass
class PageLoad:
    errors: list[str] = field(default_factory=list)  # console errors, failed loads, uncaught exceptions
    value: object = None  # what the script returned


@contextlib.contextmanager
def chromium() -> Iterator[str]:
    """A headless Chromium with remote debugging on a free port; yields its DevTools HTTP base URL."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise RuntimeError("chromium is not installed: `make test` installs it (apt chromium)")
    port = free_port()
    # its helper processes may still write to the profile while they exit: cleanup errors are not the test's
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 f"--remote-debugging-port={port}", f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while not _answers(base + "/json/version"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("chromium did not start")
                time.sleep(0.1)
            yield base
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # the browser and every helper process it started
            proc.wait(timeout=30)


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1).status_code == 200
    return False


def load(devtools: str, page: Path | str, script: str, timeout_s: float = 60.0) -> PageLoad:
    """Open ``page`` (a file, or a URL) in a new tab, wait for its load event, then evaluate ``script`` (an
    expression, awaited if it is a promise); everything the page reported as an error on the way is returned
    with the value."""
    url = page.resolve().as_uri() if isinstance(page, Path) else page
    return asyncio.run(asyncio.wait_for(_load(devtools, url, script), timeout_s))


async def _load(devtools: str, url: str, script: str) -> PageLoad:
    out = PageLoad()
    ids = itertools.count(1)
    async with aiohttp.ClientSession() as http:
        async with http.put(f"{devtools}/json/new?about:blank") as r:
            tab = await r.json()
        async with http.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0) as ws:

            async def call(method: str, **params) -> dict:
                key = next(ids)
                await ws.send_json({"id": key, "method": method, "params": params})
                while True:
                    message = json.loads((await ws.receive()).data)
                    if message.get("id") == key:
                        return message.get("result", {})
                    _note(message, out)

            for domain in ("Page", "Runtime", "Log"):
                await call(f"{domain}.enable")
            await call("Page.navigate", url=url)
            while True:
                message = json.loads((await ws.receive()).data)
                if message.get("method") == "Page.loadEventFired":
                    break
                _note(message, out)
            result = await call("Runtime.evaluate", expression=script, awaitPromise=True, returnByValue=True)
            if "exceptionDetails" in result:
                out.errors.append(f"script: {result['exceptionDetails'].get('text')}")
            out.value = result.get("result", {}).get("value")
    return out


def _note(message: dict, out: PageLoad) -> None:
    method, params = message.get("method"), message.get("params", {})
    if method == "Runtime.exceptionThrown":
        out.errors.append(f"exception: {params['exceptionDetails'].get('text')}")
    elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
        out.errors.append(f"console.{params['type']}: {[a.get('value') for a in params.get('args', [])]}")
    elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
        out.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
