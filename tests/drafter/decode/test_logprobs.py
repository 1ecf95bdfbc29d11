"""drafter/decode/logprobs.py: a prompt's own tokens scored as the verifier sees them."""
from __future__ import annotations

import pytest
import torch

from specloop.drafter.decode.logprobs import prompt_scores
from specloop.drafter.model.loading import load_model


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0], keep_module=True)


def reference(hf, prompt):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [n, V]


@pytest.mark.parametrize("chunk", [3, 128])  # several passes over the one-row cache, and one
def test_each_prompt_token_after_the_first_is_scored_by_the_positions_before_it(verifier, chunk):
    prompt = [5, 17, 3, 99, 42, 8, 8, 61, 7, 200, 13]
    got = prompt_scores(verifier.lean, prompt, top=3, chunk=chunk)
    lp = reference(verifier.hf, prompt)
    assert [s.token_id for s in got] == prompt[1:]
    for j, s in enumerate(got):  # token j + 1 by the logits at position j
        assert s.logprob == pytest.approx(lp[j, prompt[j + 1]].item(), abs=1e-4)
        ids = [t for t, _ in s.top]
        assert ids == lp[j].topk(3).indices.tolist()
        assert [v for _, v in s.top] == sorted((v for _, v in s.top), reverse=True)


def test_no_alternatives_asked_none_given_and_a_one_token_prompt_has_nothing_to_score(verifier):
    assert all(s.top == [] for s in prompt_scores(verifier.lean, [5, 6, 7], top=0))
    assert prompt_scores(verifier.lean, [5], top=2) == []
