"""Goodness-of-fit helper shared by the distribution tests."""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of observed counts against exact probabilities.

    Bins with expected count below `min_expected` are pooled into one. A sample that falls where
    the probability is exactly zero is an outright failure (p-value 0).
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)
