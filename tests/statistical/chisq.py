"""Pearson chi-square goodness of fit without scipy (p-value from the regularised upper incomplete gamma)."""

from __future__ import annotations

import torch


def chi_square_p_value(
    counts: torch.Tensor,  # [cells] observed counts
    probs: torch.Tensor,  # [cells] expected probabilities
) -> float:
    """Pearson chi-square goodness of fit. Cells with expected count < 5 are pooled; a count in a zero-probability
    cell returns 0.0."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    total = counts.sum()
    if (counts[probs <= 0] > 0).any():
        return 0.0
    expected = probs * total
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    if dof < 1:  # everything pooled into one cell (too few samples for these cells): nothing to test
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))
