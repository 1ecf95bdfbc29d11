import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.proposer import VerifierView
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.dvi import DraftHead, DVIConfig, DVIDrafter
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.kv_cache import prefill
from tests.tiny import build_model, llama_config

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def verifier():
    return build_model(llama_config(60, 4, 64), seed=0, init_std=0.2)


def test_untrained_head_is_the_verifiers_early_exit(verifier):
    head = DraftHead(verifier, DVIConfig(layers=2))
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        hs = verifier(ids, output_hidden_states=True).hidden_states[2]
        x = verifier.model.norm(hs)
        torch.testing.assert_close(head(hs), verifier.lm_head(x), atol=1e-5, rtol=1e-5)


def test_only_the_norm_and_lora_adapters_train(verifier):
    head = DraftHead(verifier, DVIConfig(layers=1, rank=4))
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trainable and all(n == "norm" or "lora_" in n for n in trainable)
    assert not head.head.base_layer.weight.requires_grad


def test_drafts_match_running_the_first_layers_by_hand_and_leave_lens_alone(verifier):
    lean = LeanDecoder(verifier)
    head = DraftHead(verifier, DVIConfig(layers=2))
    cache, feats = prefill(lean, [PROMPTS[0]], 32)
    d = DVIDrafter(lean, head)
    d.start([PROMPTS[0]], 32, VerifierView(cache, feats))
    proposal = d.propose(3, SamplingParams(), None)
    assert cache.lens.tolist() == [len(PROMPTS[0]) - 1]
    seq, drafts = list(PROMPTS[0]), []
    for _ in range(3):
        with torch.no_grad():
            hs = verifier(torch.tensor([seq]), output_hidden_states=True).hidden_states[2][:, -1]
        drafts.append(int(head(hs).argmax()))
        seq.append(drafts[-1])
    assert proposal.tokens[0].tolist() == drafts


def test_lora_head_stays_lossless_and_leaves_the_verifier_cache_consistent(verifier):
    lean = LeanDecoder(verifier)
    head = DraftHead(verifier, DVIConfig(layers=2, rank=4))
    torch.manual_seed(0)
    for n, p in head.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3)
    params = SamplingParams(max_tokens=20)
    ref = generate(lean, None, PROMPTS, params, 0, StopRule())
    out = generate(lean, DVIDrafter(lean, head), PROMPTS, params, 4, StopRule())
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]


def test_head_round_trips_and_refuses_other_kinds(tmp_path, verifier):
    head = DraftHead(verifier, DVIConfig(layers=1, rank=4))
    for n, p in head.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p)
    head.save(tmp_path / "h", {"base": "v"})
    back = DraftHead.load(tmp_path / "h", verifier)
    torch.testing.assert_close(back.merged()[1], head.merged()[1])
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "manifest.json").write_text('{"kind": "sd2"}')
    with pytest.raises(ValueError, match="not a DVI head"):
        DraftHead.load(tmp_path / "x", verifier)
    with pytest.raises(ValueError, match="1 <= s"):
        DraftHead(verifier, DVIConfig(layers=4))
