"""Next-token choice with vLLM's semantics.

Order of operations as in vLLM: the grammar bitmask of structured outputs (vLLM applies it to the
logits before its sampler), then min_tokens masking of stop tokens and logit_bias, then penalties
(repetition on prompt and output, presence/frequency on output), then greedy argmax or temperature →
top-k → top-p → min-p and a draw. A draw is one uniform number against the row's cumulative distribution, taken from the
request's own generator when it has a seed, so a seeded request samples the same tokens whatever else
is batched.
Logprobs are those of the distribution before sampling parameters (vLLM V1's default ``raw_logprobs``),
the grammar's mask included; alternatives are listed as vLLM does: the chosen token, then the top ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from backends.base import TokenLogprob
from backends.native.sequence import Sequence
from backends.native.structured_output import apply_grammar_bitmasks
from backends.native.transfers import to_device
from backends.tokenizer import Tokenizer


@dataclass
class Sampled:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def token_logprob(tokenizer: Tokenizer, token_id: int, logprob: float | None,
                  top: Iterable[tuple[int, float]] = (), rank: int | None = None) -> TokenLogprob:
    """A token's logprob and its alternatives as chunks carry them: with each token's text."""
    def text(t: int) -> str:
        return tokenizer.decode([t], False)

    return TokenLogprob(token_id, text(token_id), logprob, [(t, text(t), lp) for t, lp in top], rank)


def token_logprobs(tokenizer: Tokenizer, sampled: Sampled) -> list[TokenLogprob]:
    """``sampled``'s logprobs as a chunk carries them."""
    return [token_logprob(tokenizer, sampled.token_id, sampled.logprob, sampled.top or [])]


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]) -> list[Sampled]:
    """Pick one token per row of ``logits`` [B, V] (fp32, on any device; constrained rows are masked in
    place) for the matching sequence."""
    tokens, raw_logprobs = sample_tokens(logits, seqs, eos_token_ids)
    return picks(tokens, raw_logprobs, seqs)


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The picked token ids [B] on the logits' device, and the raw logprobs where a sequence asked for them:
    everything of ``sample`` but the copy to the host, so that the next step can be launched before it."""
    logits = apply_grammar_bitmasks(logits, seqs)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
    logits = _apply_penalties(logits, seqs, eos_token_ids)

    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    random = [i for i, s in enumerate(seqs) if not s.params.greedy]
    # max(dim).indices: the same first maximum as argmax, and faster on CPU
    if not random:  # no row copy when the whole batch is greedy, or the whole batch samples
        return logits.max(dim=-1).indices, raw_logprobs
    if not greedy:
        return _draw(logits, seqs), raw_logprobs
    tokens = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
    tokens[greedy] = logits[greedy].max(dim=-1).indices
    tokens[random] = _draw(logits[random], [seqs[i] for i in random])
    return tokens, raw_logprobs


def picks(tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, seqs: list[Sequence]) -> list[Sampled]:
    """``sample_tokens``' result on the host, with logprobs and alternatives where asked: the step's one
    device-to-host copy without logprobs."""
    out = [Sampled(tok) for tok in tokens.tolist()]
    asked = {i: s.params.logprobs for i, s in enumerate(seqs) if s.params.logprobs is not None}
    if asked:
        assert raw_logprobs is not None  # sample_tokens keeps them when a row asks for logprobs
        rows = list(asked)
        chosen = raw_logprobs[rows].gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
        for (i, top_n), logprob in zip(asked.items(), chosen):
            out[i].logprob = logprob
            (out[i].top,) = ranked(raw_logprobs[i:i + 1], [out[i].token_id], [logprob], top_n)
    return out


def ranked(logprobs: torch.Tensor, token_ids: list[int], chosen: list[float], k: int) -> list[list[tuple[int, float]]]:
    """vLLM's alternatives of each row of ``logprobs`` [N, V]: its token itself, then the ``k`` most likely
    others (one topk and one copy to the host for all rows)."""
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return [[(t, lp), *((a, b) for a, b in top if a != t)] for t, lp, top in zip(token_ids, chosen, tops)]


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]) -> torch.Tensor:
    cloned = False
    for i, seq in enumerate(seqs):
        p = seq.params
        needs_min_tokens = seq.num_output < p.min_tokens
        needs_penalty = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        if not (needs_min_tokens or needs_penalty or p.logit_bias):
            continue
        if not cloned:
            logits, cloned = logits.clone(), True
        row = logits[i]
        if needs_min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            row[sorted(stops)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=logits.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=logits.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.int64, device=logits.device),
                                    minlength=row.shape[0])
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One draw per row. Which filters apply is read from the parameters on the host, never from device
    tensors, so that a draw on a GPU queues its work without waiting for it (async scheduling)."""
    device, vocab, shaped = logits.device, logits.shape[1], logits  # shaped: after penalties, for lost rows
    params = [s.params for s in seqs]
    if any(p.temperature != 1 for p in params):
        logits = logits / to_device([p.temperature for p in params], logits.dtype, device).unsqueeze(1)
    if any(0 < p.top_k < vocab for p in params):
        top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (top_k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1 for p in params):
        top_p = to_device([p.top_p for p in params], probs.dtype, device).unsqueeze(1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], probs.dtype, device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    # Drawn on the CPU, where seeded requests' generators live: a seed gives the same tokens on any device.
    u = torch.rand(len(seqs), 1, dtype=torch.float64)
    for i, seq in enumerate(seqs):
        if seq.generator is not None:
            u[i] = torch.rand((), dtype=torch.float64, generator=seq.generator)
    picked, total = _inverse_cdf(probs, u.to(device, non_blocking=True))
    # A row whose mass is gone (a repetition penalty or top_p so small that every probability is 0, inf
    # or NaN) takes its most likely token, not an index past the vocabulary that fails the whole step. On a
    # GPU the fallback is computed for every row rather than asking the device whether any row needs it.
    lost = ~torch.isfinite(total) | (total <= 0)
    if logits.is_cuda or lost.any():
        picked = torch.where(lost.squeeze(1), shaped.nan_to_num(nan=float("-inf")).argmax(dim=-1), picked)
    return picked


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of ``probs`` [B, V] (unnormalised, >= 0), the token whose interval of the row's cumulative
    distribution holds ``u`` [B, 1] (uniform in [0, 1)) times the row's total; and that total [B, 1].

    One uniform per row, in two levels: the row's blocks of up to 1024 tokens by their sums, then the token
    within the chosen block; both cumulative sums in float64, so that tail tokens keep their weight, at a fraction
    of one cumulative sum over the whole vocabulary (the exponential trick needs a random number per entry)."""
    rows, vocab = probs.shape
    size = min(vocab & -vocab, 1024)  # the largest power of two dividing the vocabulary, so blocks tile it
    blocks = probs.reshape(rows, vocab // size, size)
    cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # Below the total, so the pick has nonzero probability even if u * total rounds up.
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(cdf, x, right=True)  # the first block whose cumulative mass passes x
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(x))
    inner = blocks.gather(1, block.clamp(max=cdf.shape[1] - 1).unsqueeze(-1).expand(rows, 1, size)).squeeze(1)
    inner = inner.double().cumsum(dim=-1)
    # The block's own sum may round differently from its entry in cdf: stay below its last token's bound.
    rest = torch.minimum(x - before, torch.nextafter(inner[:, -1:], torch.zeros_like(x)))
    return (block * size + torch.searchsorted(inner, rest, right=True)).squeeze(1), total
