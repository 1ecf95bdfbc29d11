"""bench/gpu_sampling.py: the two-sample chi-square that the GPU's sampling section rests on, and the section's
arms on this CPU (the graph backend, uncompiled: the code path; bench/gpu.py's call compiles it on the device)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from bench.gpu import Plan, Shape, build_lean
from bench.gpu_sampling import SamplingPlan, build_pair, homogeneity_pvalue, sampling_section


def test_the_homogeneity_pvalue_is_pearsons_on_a_two_row_table():
    rng = np.random.default_rng(0)
    for _ in range(20):
        bins = int(rng.integers(2, 12))
        a = rng.integers(20, 400, bins)
        b = rng.integers(20, 400, bins)
        expected = chi2_contingency(np.stack([a, b]), correction=False).pvalue
        assert homogeneity_pvalue(torch.tensor(a), torch.tensor(b)) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_sparse_bins_are_pooled_and_unequal_samples_compared_as_proportions():
    a = torch.tensor([500, 300, 200, 1, 0, 2])
    b = torch.tensor([1000, 600, 400, 0, 3, 1])  # twice the sample, same proportions; the last three pooled
    assert homogeneity_pvalue(a, b) > 0.5
    expected = chi2_contingency(np.array([[500, 300, 200, 3], [1000, 600, 400, 4]]), correction=False).pvalue
    assert homogeneity_pvalue(a, b) == pytest.approx(expected)
    assert homogeneity_pvalue(torch.tensor([600, 200, 200]), torch.tensor([1000, 600, 400])) < 1e-6


def test_the_section_passes_the_lossless_sampler_and_catches_the_dropped_residual(monkeypatch):
    monkeypatch.setenv("SPECLOOP_COMPILE", "0")
    plan = Plan(torch.device("cpu"), torch.bfloat16, {})
    sized = SamplingPlan(samples=3_000, chunk=1_500, settings=(("T=1", 1.0, 1.0),))
    said = []
    out = sampling_section({}, build_pair(Shape, build_lean, plan), sized, said.append)
    arms = out["settings"]["T=1"]["arms"]
    assert set(arms) == {"pretrained-k2", "ngram-k3", "wrong-sampler-k2"}
    assert out["verdict"]["holds"], out["verdict"]
    assert out["verdict"]["wrong_sampler_caught"], arms["wrong-sampler-k2"]["pvalues"]
    assert sum(map(sum, arms["pretrained-k2"]["counts"])) == 3 * 3_000
    assert said[-1].startswith("sampling: holds")
