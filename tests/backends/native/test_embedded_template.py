"""The embedded default's chat template: SmolLM2's own, token for token, for chats without tools; with tools, the
tools listed in its system turn and calls and results in the hermes format its tool parser reads."""

from __future__ import annotations

import pytest

from backends.native.config import DEFAULT_MODEL_ENV, EMBEDDED_TOOLS_TEMPLATE
from gateway.config import Settings

TEMPLATE = EMBEDDED_TOOLS_TEMPLATE.read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "x"}],
])
def test_without_tools_it_is_smollm2s_own_template(smollm2_tokenizer, messages):
    assert smollm2_tokenizer.apply_chat_template(messages, None, TEMPLATE) == \
        smollm2_tokenizer.apply_chat_template(messages)


def test_with_tools_the_system_turn_lists_them_and_calls_round_trip(smollm2_tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    text = smollm2_tokenizer.decode(smollm2_tokenizer.apply_chat_template(messages, [WEATHER], TEMPLATE),
                                    skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                           "\n\nYou may call functions.")
    assert '"name": "get_weather"' in text.split("<tools>\n")[1].split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_the_default_deployment_uses_it_with_the_hermes_parser(monkeypatch):
    monkeypatch.delenv(DEFAULT_MODEL_ENV, raising=False)
    (deployment,) = Settings().routes()[0].deployments
    assert (deployment.chat_template, deployment.tool_parser) == (str(EMBEDDED_TOOLS_TEMPLATE), "hermes")
    monkeypatch.setenv(DEFAULT_MODEL_ENV, "/some/other.gguf")
    (deployment,) = Settings().routes()[0].deployments
    assert (deployment.chat_template, deployment.tool_parser) == (None, None)
