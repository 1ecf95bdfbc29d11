import numpy as np
import torch

from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.ngram import NgramDrafter, draft_row, lookup


def test_lookup_continues_the_latest_match_of_the_longest_suffix():
    history = np.array([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3])
    assert lookup(history, 2) == [5, 7]  # "2 3" last seen before position 5
    assert lookup(np.array([1, 2, 3]), 2) == []


def test_draft_row_always_returns_k_tokens():
    assert draft_row([5, 6, 7], 3, 3, 1) == [7, 7, 7]  # no match: repeat the last token
    assert draft_row([1, 2, 1], 4, 3, 1) == [2, 1, 2, 1]  # chained lookups


def test_observe_extends_history_with_accepted_and_bonus_tokens():
    d = NgramDrafter(vocab_size=10)
    d.start([[1, 2, 3, 1, 2]], capacity=32)
    prop = d.propose(3, SamplingParams(temperature=1.0), None)
    assert prop.tokens.tolist() == [[3, 1, 2]]
    assert torch.equal(prop.probs.argmax(-1), prop.tokens) and prop.probs.sum().item() == 3
    d.observe(BlockOutcome(torch.tensor([[3, 8, 0, 0]]), torch.tensor([1])), torch.tensor([True]))
    assert d.history[0] == [1, 2, 3, 1, 2, 3, 8]
