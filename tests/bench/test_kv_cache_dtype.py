"""bench/kv_cache_dtype.py: the teacher-forced comparison of KV cache dtypes."""
from __future__ import annotations

import pytest
import torch

from bench.kv_cache_dtype import compare, forced_logits, greedy_answer
from specloop.drafter.model.attention import KV_CACHE_ENV
from specloop.drafter.model.loading import load_model


def test_compare_counts_agreement_nll_and_differences():
    base = [(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), torch.tensor([0, 1]))]
    other = [(torch.tensor([[2.0, 0.5, 0.0], [0.0, 0.0, 3.0]]), torch.tensor([0, 1]))]
    row = compare(base, other)
    assert row["positions"] == 2 and row["top1_agreement"] == 0.5
    assert row["logit_diff_max"] == 3.0 and row["logit_diff_median"] == 0.0
    assert compare(base, base)["top1_agreement"] == 1.0


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_forced_logits_follow_the_cache_asked_for_and_the_greedy_answer_is_their_argmax(tiny_pair, kv, monkeypatch):
    lean = load_model(tiny_pair[0]).lean
    prompt = [5, 6, 7, 8, 9]
    monkeypatch.setenv(KV_CACHE_ENV, "float32")
    answer = greedy_answer(lean, prompt, 20, [])
    exact = forced_logits(lean, prompt + answer, len(prompt))
    assert exact.shape[0] == len(answer) and exact.argmax(-1).tolist() == answer  # teacher forcing = greedy here
    monkeypatch.setenv(KV_CACHE_ENV, kv)
    assert lean.new_cache(1, 8).keys[0].dtype == getattr(torch, kv)
    rounded = forced_logits(lean, prompt + answer, len(prompt))
    assert not torch.equal(rounded, exact) and torch.allclose(rounded, exact, atol=0.05)
