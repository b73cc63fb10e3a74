"""One real vLLM for the peer suite: the exported SmolLM2 in fp32, with vLLM's hermes tool parser and the
same ChatML tools template burstgate's native deployments use (configs/chat_templates/chatml_tools.jinja)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.peers import free_port, start_vllm

TOOLS_TEMPLATE = Path(__file__).resolve().parents[2] / "configs" / "chat_templates" / "chatml_tools.jinja"


@pytest.fixture(scope="session")
def vllm_url():
    port = free_port()
    proc = start_vllm(port, extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                        "--chat-template", str(TOOLS_TEMPLATE)))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
