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


def test_the_suffix_index_drafts_what_the_scan_drafts_as_a_history_grows():
    # SuffixIndex (kept up to date as tokens are appended) against draft_row's scan of the whole history, on
    # repetitive and random histories, chained lookups included (small vocabularies: matches everywhere)
    from specloop.drafter.kinds.ngram import SuffixIndex

    rng = np.random.default_rng(0)
    for vocab, (max_n, min_n) in ((3, (3, 1)), (6, (3, 1)), (50, (4, 2)), (4, (2, 2))):
        history = [int(t) for t in rng.integers(0, vocab, 3)]
        index = SuffixIndex(history, max_n, min_n)
        for _ in range(120):
            for k in (1, 4, 7):
                assert draft_row(history, k, max_n, min_n, index) == draft_row(history, k, max_n, min_n)
            history.extend(int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 4))))


def test_the_drafter_keeps_one_index_per_row_list():
    d = NgramDrafter(vocab_size=10)
    d.start([[1, 2, 3, 1, 2], [4, 4, 4]], capacity=32)
    d.propose(2, SamplingParams(), None)
    first = d._index(d.history[0])
    d.observe(BlockOutcome(torch.tensor([[3, 8, 0], [4, 4, 4]]), torch.tensor([1, 2])), torch.tensor([True, True]))
    assert d.propose(3, SamplingParams(), None).tokens.tolist() == [draft_row(h, 3, 3, 1) for h in d.history]
    assert d._index(d.history[0]) is first  # extended in place: the same index, caught up
    d.join([0], [[7, 7, 9]])
    assert d._index(d.history[0]) is not first  # a new request's row: a new index
