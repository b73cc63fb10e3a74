"""transformers as the oracle: greedy continuations and last-position logits, alone or in one padded batch, and
the prompts the parity suites run."""

from __future__ import annotations

import torch

from backends.native.batch import Batch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (EOS ignored) and the fp32 logits at the last prompt position."""
    return hf_greedy_batch(model, [prompt_ids], max_new_tokens)[0]


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """``hf_greedy`` of every prompt, in left-padded batches of similar lengths: a decode step reads the weights
    once for the batch, not once per prompt (3x faster on the parity prompts), and the attention mask and
    positions leave the padding out, so each row computes what it would alone up to float rounding."""
    results: list[tuple[list[int], torch.Tensor]] = [([], torch.empty(0))] * len(prompts)
    for group in _similar_lengths(prompts):
        for i, result in zip(group, _padded_greedy(model, [prompts[i] for i in group], max_new_tokens)):
            results[i] = result
    return results


def _similar_lengths(prompts: list[list[int]]) -> list[list[int]]:
    """Prompt indices grouped by length so that padding at most doubles a group's tokens."""
    groups: list[list[int]] = []
    tokens = 0  # the last group's
    for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
        n = len(prompts[i])
        if groups and (len(groups[-1]) + 1) * n <= 2 * (tokens + n):
            groups[-1].append(i)
            tokens += n
        else:
            groups.append([i])
            tokens = n
    return groups


@torch.inference_mode()
def _padded_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    device, width = model.device, max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
    first_logits = out.logits[:, -1].float()
    logits, tokens = first_logits, []
    while max_new_tokens:
        tokens.append(logits.argmax(-1))
        if len(tokens) == max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(tokens[-1][:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True)
        logits = out.logits[:, -1].float()
    rows = torch.stack(tokens, dim=1).tolist() if tokens else [[] for _ in prompts]
    return [(row, first_logits[i].cpu()) for i, row in enumerate(rows)]


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
