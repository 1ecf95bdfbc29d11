import torch

from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.model.decoder import LeanDecoder
from tests.tiny import build_model, llama_config


def _greedy_continuation(lean, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        cache = lean.new_cache(1, 64)
        seq.append(int(lean.forward(cache, torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def test_greedy_drafts_are_the_drafters_own_greedy_continuation():
    lean = LeanDecoder(build_model(llama_config(50, 2, 32), seed=0, init_std=0.3))
    d = PretrainedDrafter(lean)
    d.start([[1, 2, 3]], capacity=64)
    prop = d.propose(4, SamplingParams(), None)
    assert prop.tokens[0].tolist() == _greedy_continuation(lean, [1, 2, 3], 4) and prop.probs is None


def test_cache_after_a_rejection_matches_a_fresh_prefill():
    lean = LeanDecoder(build_model(llama_config(50, 2, 32), seed=1, init_std=0.3))
    d = PretrainedDrafter(lean)
    d.start([[1, 2, 3], [4, 5]], capacity=64)
    prop = d.propose(4, SamplingParams(), None)
    # row 0 accepts 2 drafts then gets token 49; row 1 accepts all 4 plus bonus 48
    tokens = torch.cat([prop.tokens, torch.zeros(2, 1, dtype=torch.long)], dim=1)
    tokens[0, 2], tokens[1, 4] = 49, 48
    d.observe(BlockOutcome(tokens, torch.tensor([2, 4])), torch.tensor([True, True]))
    committed = [[1, 2, 3] + prop.tokens[0, :2].tolist() + [49], [4, 5] + prop.tokens[1].tolist() + [48]]
    assert d.pending == [[49], [int(prop.tokens[1, 3]), 48]]  # d_4 never went through the drafter
    assert d.cache.lens.tolist() == [len(c) - len(p) for c, p in zip(committed, d.pending)]
    nxt = d.propose(2, SamplingParams(), None)
    for b, c in enumerate(committed):
        assert nxt.tokens[b].tolist() == _greedy_continuation(lean, c, 2)
