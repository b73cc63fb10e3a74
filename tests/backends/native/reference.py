"""transformers as the oracle: greedy continuations and last-position logits, one prompt at a time, and
the prompts the parity suites run."""

from __future__ import annotations

import torch

from backends.native.batch import Batch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (EOS ignored) and the fp32 logits at the last prompt position."""
    device = model.device
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
    first_logits = out.logits[0, -1].float()
    past, tokens = out.past_key_values, []
    logits = first_logits
    for _ in range(max_new_tokens):
        tok = int(logits.argmax())
        tokens.append(tok)
        out = model(torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return tokens, first_logits.cpu()


QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 17 times 23?", "Give me a tip for learning to cook.", "Why is the sky blue?",
    "Summarise the plot of Cinderella in two sentences.", "What does a CPU do?", "Name a famous painting.",
]
LONG_CONTEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring; "
    "stored programs made software possible, compilers made it portable, and operating systems shared "
    "one machine among many users. Networks then joined machines together. "
) * 4
RAW_TEXTS = [
    "Once upon a time", "def fibonacci(n):", "The three laws of thermodynamics are",
    LONG_CONTEXT + "In summary,", LONG_CONTEXT + "The most important idea was",
    LONG_CONTEXT * 2 + "Looking ahead,", "import torch\nimport numpy as np\n\n", "1, 2, 3, 5, 8, 13,",
    "Dear hiring manager,", "Q: What is the boiling point of water?\nA:", "Paris is", "<html><body>",
]


def parity_prompts(tokenizer) -> list[list[int]]:
    """Chat and raw-text prompts of 6 to ~400 tokens, some sharing long prefixes."""
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return chats + [tokenizer.encode(t) for t in RAW_TEXTS]


def prefill_batch(prompts: list[list[int]], block_size: int, spare: int = 0) -> tuple[Batch, list[list[int]]]:
    """One flat prefill step of ``prompts``, each in fresh consecutive blocks with room for ``spare`` more
    tokens; and the block tables."""
    next_block, flat, positions, slots, tables = 0, [], [], [], []
    for p in prompts:
        table = list(range(next_block, next_block + -(-(len(p) + spare) // block_size)))
        next_block += len(table)
        tables.append(table)
        flat += p
        positions += range(len(p))
        slots += [table[i // block_size] * block_size + i % block_size for i in range(len(p))]
    lens = [len(p) for p in prompts]
    return Batch(flat, positions, slots, lens, lens, tables, [True] * len(prompts)), tables
