"""The Drafter protocol: every kind declares all of it, and a narrowed view hands its rows back."""
from __future__ import annotations

import pytest
import torch

from specloop.drafter.decode.proposer import Drafter, VerifierView, first_rows, with_rows
from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.table import DRAFTER_KINDS, build_drafter
from specloop.drafter.model.kv_cache import prefill
from specloop.drafter.model.loading import load_model

NO_DIR = ("ngram", "suffix", "dvi", "eagle", "eagle3")
MEMBERS = [name for name in dir(Drafter) if not name.startswith("_")] + list(Drafter.__annotations__)


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0])


def _started(kind, verifier, tiny_pair, prompts):
    drafter = build_drafter(kind, verifier, None if kind in NO_DIR else tiny_pair[1])
    cache, features = prefill(verifier.lean, prompts, 64, tuple(drafter.verifier_layers))
    drafter.start(prompts, 64, VerifierView(cache, features))
    return drafter, cache


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_every_drafter_kind_declares_the_whole_protocol(kind, verifier, tiny_pair):
    drafter = build_drafter(kind, verifier, None if kind in NO_DIR else tiny_pair[1])
    missing = [name for name in MEMBERS if not hasattr(drafter, name)]
    assert missing == [], f"{kind} lacks {missing}"
    assert not hasattr(drafter, "row_state")


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_a_step_on_a_narrowed_view_changes_its_rows_only(kind, verifier, tiny_pair):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    drafter, _ = _started(kind, verifier, tiny_pair, prompts)
    reference, _ = _started(kind, verifier, tiny_pair, prompts)
    view = drafter.narrow(2)
    proposal = view.propose(2, SamplingParams(), None)
    outcome = BlockOutcome(torch.cat([proposal.tokens.cpu(), torch.tensor([[3], [4]])], dim=1), torch.tensor([1, 2]))
    hidden = {i: torch.zeros(2, verifier.lean.hidden_size) for i in drafter.verifier_layers}
    view.observe(outcome, torch.ones(2, dtype=torch.bool), VerifierView(getattr(view, "cache", None), hidden))
    drafter.widen(view, 2)
    after = drafter.propose(1, SamplingParams(), None).tokens
    before = reference.propose(1, SamplingParams(), None).tokens
    assert after[2].tolist() == before[2].tolist()  # the row outside the view is as it was


def test_with_rows_puts_a_views_rows_back_into_lists_tensors_and_dicts():
    assert first_rows(torch.arange(3), 2).tolist() == [0, 1]
    assert with_rows(torch.arange(3), torch.tensor([7, 8]), 2).tolist() == [7, 8, 2]
    assert with_rows([[1], [2], [3]], [[7], [8]], 2) == [[7], [8], [3]]
    assert with_rows({0: torch.zeros(3)}, {0: torch.ones(2)}, 2)[0].tolist() == [1, 1, 0]
