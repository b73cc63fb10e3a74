"""transformers as the oracle: greedy continuations and last-position logits, one prompt at a time."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (EOS ignored) and the fp32 logits at the last prompt position."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    first_logits = out.logits[0, -1].float()
    past, tokens = out.past_key_values, []
    logits = first_logits
    for _ in range(max_new_tokens):
        tok = int(logits.argmax())
        tokens.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return tokens, first_logits
