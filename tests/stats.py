"""Goodness-of-fit helpers shared by the distribution tests: exact marginals and a chi-square test."""
from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from specloop.drafter.decode.sampling import SamplingParams, warp


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


def exact_marginals(model, prompt: list[int], positions: int, params: SamplingParams) -> list[torch.Tensor]:
    """P(token at generated position t) for t = 1..`positions` after `prompt` when a (small-vocabulary)
    HF causal LM samples with `params`, by enumerating every prefix."""
    marginals, prefixes, weights = [], [[]], torch.ones(1, dtype=torch.float64)
    for _ in range(positions):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]
        probs = warp(logits, params).double() * weights[:, None]  # [prefixes, V] joint
        marginals.append(probs.sum(dim=0))
        prefixes = [p + [t] for p in prefixes for t in range(probs.shape[-1])]
        weights = probs.flatten()
    return marginals
