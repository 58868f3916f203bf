"""hybridrl.ops.sampling.categorical_sample against the exact distribution it is given: a chi-square goodness of fit,
zero-probability tokens never drawn, block and padding edges, seeded rows reproducible."""

from __future__ import annotations

import torch

from hybridrl.ops.sampling import categorical_sample
from tests.stats import chi_square, chi_square_bound

VOCAB = 250  # not a multiple of the block: the padded tail is exercised


def _logprobs(seed: int, vocab: int = VOCAB, masked: int = 20) -> torch.Tensor:
    """A peaked random distribution (logits ~ 3 N(0, 1)) with ``masked`` entries at -inf, as top-k leaves them."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(vocab, generator=g)
    logits[torch.randperm(vocab, generator=g)[:masked]] = -torch.inf
    return logits.log_softmax(-1)


def _counts(logprobs: torch.Tensor, draws: int, rows: int = 4000, **kwargs) -> torch.Tensor:
    counts = torch.zeros(logprobs.shape[-1], dtype=torch.int64)
    for _ in range(draws // rows):
        tokens = categorical_sample(logprobs.expand(rows, -1), **kwargs)
        counts += torch.bincount(tokens, minlength=logprobs.shape[-1])
    return counts


def test_draws_the_given_distribution():
    """120k draws: the chi-square statistic is inside the bound a correct sampler exceeds with probability 3e-5,
    and the same counts against a slightly different distribution (temperature 1.1) fall outside it."""
    torch.manual_seed(0)
    logprobs = _logprobs(1)
    counts = _counts(logprobs, 120_000)
    assert counts.sum() == 120_000 and counts[logprobs == -torch.inf].sum() == 0
    stat, df = chi_square(counts, logprobs.exp())
    assert df > 50 and stat < chi_square_bound(df), (stat, df, chi_square_bound(df))
    wrong, wrong_df = chi_square(counts, (logprobs.nan_to_num(neginf=-1e4) / 1.1).softmax(-1))
    assert wrong > chi_square_bound(wrong_df), (wrong, wrong_df)


def test_small_block_and_vocabulary_not_multiple_of_it():
    """A block of 8 over 250 entries (32 blocks, the last padded): the same distribution, every token in range."""
    torch.manual_seed(1)
    logprobs = _logprobs(2, masked=100)
    counts = _counts(logprobs, 60_000, block=8)
    stat, df = chi_square(counts, logprobs.exp())
    assert stat < chi_square_bound(df), (stat, df)


def test_edges_of_blocks_and_vocabulary():
    """All mass on one token, at the first entry, a block's last and first entries, and the vocabulary's last entry
    (just before the padding): always that token; two tokens on both sides of a block edge: both, never another."""
    torch.manual_seed(2)
    for token in (0, 63, 64, 127, VOCAB - 1):
        logprobs = torch.full((VOCAB,), -torch.inf)
        logprobs[token] = 0.0
        assert categorical_sample(logprobs.expand(500, -1)).eq(token).all(), token
    logprobs = torch.full((VOCAB,), -torch.inf)
    logprobs[[63, 64]] = torch.tensor([0.25, 0.75]).log()
    counts = _counts(logprobs, 20_000)
    assert counts[63] + counts[64] == 20_000
    assert abs(counts[64].item() / 20_000 - 0.75) < 0.015  # 5 standard deviations of the binomial (0.003)


def test_tiny_probabilities_next_to_large_ones():
    """A token of probability 1e-6 in a block next to one of ~1: its draws stay near 1e-6 (float64 sums); tokens
    at -inf in the same block are never drawn."""
    torch.manual_seed(3)
    logprobs = torch.full((VOCAB,), -torch.inf)
    logprobs[[10, 11, 200]] = torch.tensor([1 - 2e-3 - 1e-6, 1e-6, 2e-3], dtype=torch.float64).log().float()
    counts = _counts(logprobs, 400_000, rows=20_000)
    assert counts[[10, 11, 200]].sum() == 400_000
    assert counts[11] <= 6  # expected 0.4; P(>= 7) < 1e-6
    assert abs(counts[200].item() - 800) < 5 * 800**0.5


def test_seeded_rows_repeat_and_unseeded_rows_follow_the_global_generator():
    """Rows with a generator draw from it (vLLM's seeded requests): the same seeds, the same tokens, whatever the
    global generator did; the other rows repeat under the same global seed."""
    logprobs = torch.zeros(6, VOCAB).log_softmax(-1)  # uniform: any change of the draw changes the token

    def draw(global_seed: int, seeds: dict[int, int]) -> torch.Tensor:
        torch.manual_seed(global_seed)
        return categorical_sample(logprobs, {row: torch.Generator().manual_seed(s) for row, s in seeds.items()})

    a, b = draw(0, {1: 11, 4: 44}), draw(1, {1: 11, 4: 44})
    assert a[[1, 4]].tolist() == b[[1, 4]].tolist()
    assert a[[0, 2, 3, 5]].tolist() != b[[0, 2, 3, 5]].tolist()
    assert draw(0, {1: 11, 4: 44}).tolist() == a.tolist()
    assert draw(0, {1: 12, 4: 44})[1] != a[1] or draw(0, {1: 13, 4: 44})[1] != a[1]
