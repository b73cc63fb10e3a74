"""Draws follow the distribution left after temperature, top-k, top-p and min-p; tokens those filters
remove are never drawn; a seeded row draws the same token whatever else is in the batch."""

from __future__ import annotations

import torch

from backends.base import SamplingParams
from backends.native.sampler import _inverse_cdf, sample
from backends.native.sequence import Sequence

VOCAB = 8
LOGITS = torch.log(torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01]))


def _seqs(n: int, seed: int | None = None, **params) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(seed=seed, **params)) for i in range(n)]
    if seed is not None:
        for s in seqs:
            s.generator = torch.Generator().manual_seed(seed)
    return seqs


def _frequencies(n: int, **params) -> torch.Tensor:
    torch.manual_seed(0)
    tokens = [s.token_id for s in sample(LOGITS.repeat(n, 1), _seqs(n, **params), frozenset())]
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / n


def _assert_follows(freq: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    # Within 5 standard errors of a binomial proportion per token (fails by chance ~1e-6 of the time).
    bound = 5 * torch.sqrt(probs * (1 - probs) / n) + 1e-9
    assert ((freq - probs).abs() <= bound).all(), (freq, probs)


def test_draws_follow_the_tempered_distribution():
    n = 20000
    probs = torch.softmax(LOGITS.double() / 0.7, dim=-1)
    _assert_follows(_frequencies(n, temperature=0.7), probs, n)


def test_draws_follow_the_distribution_across_the_blocks_of_a_large_vocabulary():
    # SmolLM2's vocabulary (48 blocks of 1024): mass on block edges, in the last token and spread thin elsewhere
    n, vocab = 20000, 49152
    probs = torch.full((vocab,), 0.2 / vocab, dtype=torch.float64)
    probs[[0, 1023, 1024, 30000, vocab - 1]] += torch.tensor([0.3, 0.2, 0.1, 0.1, 0.1], dtype=torch.float64)
    probs /= probs.sum()
    torch.manual_seed(0)
    tokens = [s.token_id for s in sample(probs.log().float().repeat(n, 1), _seqs(n, temperature=1.0), frozenset())]
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / n
    picked = [0, 1023, 1024, 30000, vocab - 1]
    _assert_follows(freq[picked], probs[picked], n)
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[picked] = False
    _assert_follows(freq[rest].sum(), probs[rest].sum(), n)


def test_the_two_level_draw_picks_the_token_of_one_cumulative_sum_over_the_vocabulary():
    # Rows with empty blocks and zero-probability tokens, a vocabulary of 1024-token blocks and an odd one
    for vocab in (4096, 1000, 999):
        gen = torch.Generator().manual_seed(vocab)
        probs = torch.rand(16, vocab, generator=gen) * (torch.rand(16, vocab, generator=gen) < 0.3)
        probs[:, : vocab // 2] = 0.0
        u = torch.rand(16, 1, dtype=torch.float64, generator=gen)
        u[0], u[1] = 0.0, 1.0 - 2**-53
        cdf = probs.double().cumsum(dim=-1)
        x = torch.minimum(u * cdf[:, -1:], torch.nextafter(cdf[:, -1:], torch.zeros(1, dtype=torch.float64)))
        expected = torch.searchsorted(cdf, x, right=True).squeeze(1)
        tokens, total = _inverse_cdf(probs, u)
        assert probs.gather(1, tokens.unsqueeze(1)).gt(0).all()
        assert torch.equal(tokens, expected), vocab
        assert torch.allclose(total, cdf[:, -1:])


def test_top_k_top_p_and_min_p_remove_tokens_and_renormalise_the_rest():
    n = 20000
    base = torch.softmax(LOGITS.double(), dim=-1)
    kept = {  # which tokens each filter leaves, by vLLM's rules
        "top_k": (dict(top_k=3), [0, 1, 2]),
        "top_p": (dict(top_p=0.7), [0, 1, 2]),  # 0.4 + 0.2 < 0.7: the third token is still needed
        "min_p": (dict(min_p=0.3), [0, 1, 2]),  # p >= 0.3 * 0.4
    }
    for params, tokens in kept.values():
        probs = torch.zeros(VOCAB, dtype=torch.float64)
        probs[tokens] = base[tokens] / base[tokens].sum()
        freq = _frequencies(n, temperature=1.0, **params)
        assert freq[[i for i in range(VOCAB) if i not in tokens]].sum() == 0
        _assert_follows(freq, probs, n)


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_batched():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3))

    def draws(seed: int, batched: bool) -> list[int]:
        seeded = _seqs(1, seed=seed, temperature=1.0)[0]
        seqs = _seqs(5, temperature=1.0) if batched else [seeded]
        seqs[2 if batched else 0] = seeded
        rows = logits if batched else logits[2:3]
        return [sample(rows, seqs, frozenset())[2 if batched else 0].token_id for _ in range(20)]

    assert draws(42, batched=True) == draws(42, batched=False)
    assert draws(42, batched=False) != draws(7, batched=False)


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    seqs = _seqs(2, temperature=0.0) + _seqs(2, temperature=1.0)
    logits = LOGITS.repeat(4, 1)
    logits[0, 5] = logits[1, 6] = 10.0
    out = [s.token_id for s in sample(logits, seqs, frozenset())]
    assert out[:2] == [5, 6]


def test_greedy_takes_the_first_of_equal_maxima_in_greedy_and_mixed_batches():
    # argmax's rule (and transformers' greedy search): the lowest token id among equal top logits
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0, 0.0, 0.0, 0.0]]).repeat(2, 1)
    greedy = sample(logits.clone(), _seqs(2, temperature=0.0), frozenset())
    mixed = sample(logits.clone(), _seqs(1, temperature=0.0) + _seqs(1, temperature=1.0), frozenset())
    assert [s.token_id for s in greedy] == [1, 1]
    assert mixed[0].token_id == 1
