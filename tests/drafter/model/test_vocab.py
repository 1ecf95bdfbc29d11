"""FR-Spec draft vocabulary: ranking, storage, and losslessness when the drafter scores a subset."""
from __future__ import annotations

import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.dvi import DVIDrafter
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.vocab import VOCAB_FILE, expand, frequency_ranked, load_vocab, save_vocab
from tests.drafter_helpers import perturbed_head
from tests.stats import chi2_pvalue, exact_marginals
from tests.tiny import build_model, llama_config


def test_frequency_ranked_keeps_the_most_frequent_ids_and_the_always_ids_sorted():
    traffic = [[5, 5, 5, 7, 7, 2], [7, 9, 5, 3, 3, 3, 3]]  # counts: 3:4, 5:4, 7:3, 9:1, 2:1
    assert frequency_ranked(traffic, 2, 10).tolist() == [3, 5]  # tie at 4: lower id first
    assert frequency_ranked(traffic, 3, 10, always=[0]).tolist() == [0, 3, 5]
    assert frequency_ranked(traffic, 10, 10).tolist() == [2, 3, 5, 7, 9]  # fewer distinct ids than asked


@pytest.mark.parametrize("size,vocab,ids", [(0, 10, []), (11, 10, []), (2, 10, [[12]])])
def test_frequency_ranked_refuses_bad_sizes_and_foreign_ids(size, vocab, ids):
    with pytest.raises(ValueError):
        frequency_ranked(ids, size, vocab)


def test_saved_vocab_loads_back_and_a_broken_one_is_refused(tmp_path):
    entry = save_vocab(tmp_path, torch.tensor([1, 4, 6]))
    assert entry == {"file": VOCAB_FILE, "size": 3}
    assert load_vocab(tmp_path, {"draft_vocab": entry}, 8).tolist() == [1, 4, 6]
    assert load_vocab(tmp_path, {}, 8) is None
    with pytest.raises(ValueError, match="sorted distinct"):
        load_vocab(tmp_path, {"draft_vocab": entry}, 5)  # id 6 outside a 5-token vocabulary
    save_vocab(tmp_path, torch.tensor([4, 1]))
    with pytest.raises(ValueError, match="sorted distinct"):
        load_vocab(tmp_path, {"draft_vocab": entry}, 8)
    with pytest.raises(ValueError, match="missing"):
        load_vocab(tmp_path, {"draft_vocab": {"file": "nope.safetensors"}}, 8)


def test_expand_scatters_subset_logits_and_masks_the_rest():
    full = expand(torch.tensor([[1.0, 2.0]]), torch.tensor([0, 3]), 5)
    assert full[0, 0] == 1 and full[0, 3] == 2
    assert torch.isinf(full[0, [1, 2, 4]]).all()


def test_restricted_lean_decoder_scores_only_the_subset_and_agrees_there():
    model = build_model(llama_config(40, 1, 32), seed=3)
    full, sub = LeanDecoder(model), LeanDecoder(model)
    ids = torch.tensor([0, 2, 5, 11, 39])
    sub.restrict_vocab(ids)
    assert sub.lm_head.shape[0] == 5
    tokens = torch.tensor([[1, 2, 3]])
    a = full.forward(full.new_cache(1, 8), tokens).logits
    b = sub.forward(sub.new_cache(1, 8), tokens).logits
    assert b.shape == a.shape
    torch.testing.assert_close(b[..., ids], a[..., ids])
    assert torch.isinf(b[..., 1]).all()
    with pytest.raises(ValueError, match="once"):
        sub.restrict_vocab(ids)


# ---------------------------------------------------------------- lossless with a truncated draft vocabulary

VOCAB = 12
SUBSET = torch.tensor([0, 1, 2, 3, 5, 8])  # half the vocabulary: many verifier tokens are never drafted
PROMPT = [1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def tiny():
    return build_model(llama_config(VOCAB, 2, 32), seed=11, init_std=0.6), build_model(llama_config(VOCAB, 1, 32), seed=12, init_std=0.6)


def restricted(tiny, kind: str):
    verifier, drafter = tiny
    if kind == "dvi":
        torch.manual_seed(0)  # LoRA A's initialisation: the same head whatever ran before
        return DVIDrafter(LeanDecoder(verifier), perturbed_head(verifier, layers=1, std=0.5), SUBSET)
    lean = LeanDecoder(drafter)
    lean.restrict_vocab(SUBSET)
    return PretrainedDrafter(lean)


@pytest.mark.parametrize("kind", ["pretrained", "dvi"])
def test_greedy_output_with_a_truncated_draft_vocabulary_is_the_verifiers(tiny, kind):
    verifier = LeanDecoder(tiny[0])
    prompts = [PROMPT, [4, 4, 7], [9, 10, 11, 6], [0]]
    params, rule = SamplingParams(max_tokens=24), StopRule()
    alone = [g.token_ids for g in generate(verifier, None, prompts, params, 0, rule)]
    gens = generate(verifier, restricted(tiny, kind), prompts, params, 3, rule)
    assert [g.token_ids for g in gens] == alone
    assert any(t not in SUBSET.tolist() for ids in alone for t in ids)  # tokens the drafter cannot draft
    assert sum(g.stats.accepted for g in gens) > 0


@pytest.mark.usefixtures("wide_fp32_row_blocks")
@pytest.mark.parametrize("kind", ["pretrained", "dvi"])
def test_sampled_output_with_a_truncated_draft_vocabulary_follows_the_verifier(tiny, kind):
    params = SamplingParams(temperature=1.0, max_tokens=3, seed=5)
    exact = exact_marginals(tiny[0], PROMPT, 3, params)
    verifier, counts = LeanDecoder(tiny[0]), torch.zeros(3, VOCAB)
    for lo in range(0, 12_000, 4000):
        gens = generate(verifier, restricted(tiny, kind), [PROMPT] * 4000, params, 2, StopRule(), first_request=lo)
        toks = torch.tensor([g.token_ids for g in gens])
        for t in range(3):
            counts[t] += torch.bincount(toks[:, t], minlength=VOCAB)
    pvalues = [chi2_pvalue(counts[t], exact[t]) for t in range(3)]
    assert min(pvalues) > 0.01, pvalues
