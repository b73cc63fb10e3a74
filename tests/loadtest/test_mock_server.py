"""The instant mock server counts prompts with a real tokenizer, as a model server would."""

from __future__ import annotations

import httpx

from loadtest.mock_server import create_mock_app
from tests.servers import serve_app


def test_usage_and_tokenize_count_tokens_not_words(smollm2_tokenizer):
    prompt = "Tokenisation isn't word-splitting!"
    messages = [{"role": "user", "content": prompt}]
    want = len(smollm2_tokenizer.encode(prompt))
    assert want != len(prompt.split())
    with serve_app(create_mock_app("m", tokenizer=smollm2_tokenizer)) as url:
        done = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2}).json()
        chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2}).json()
        counted = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
        tokens = httpx.post(f"{url}/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
        text = httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json()["prompt"]
        bad = httpx.post(f"{url}/tokenize", json={"nothing": 1})
    assert done["usage"]["prompt_tokens"] == want and text == prompt
    assert chat["usage"]["prompt_tokens"] == counted["count"] == len(smollm2_tokenizer.apply_chat_template(messages))
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
