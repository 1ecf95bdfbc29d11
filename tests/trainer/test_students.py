"""Students: SD² offsets lie in [1, k], and the verifier's targets and residual streams are what the
lean decoder computes at inference."""
import torch

from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.loading import load_model
from specloop.trainer.students import offset_sources, verifier_targets

torch.set_num_threads(1)


def test_sd2_offsets_lie_between_one_and_k_before_clamping():
    src = offset_sources(64, 40, 5, torch.Generator().manual_seed(0))
    delta = torch.arange(40)[None] - src
    assert int(delta[:, 5:].min()) == 1 and int(delta[:, 5:].max()) == 5
    assert int(src.min()) == 0
    assert set(delta[:, 5:].flatten().tolist()) == {1, 2, 3, 4, 5}


def test_verifier_residuals_are_what_the_lean_decoder_captures_at_inference(peaky_verifier):
    v = load_model(peaky_verifier)
    ids = torch.tensor([[5, 9, 30, 41, 7, 12]])
    layers = tuple(range(v.hf.config.num_hidden_layers))  # the last one too (HF's last hidden state is normed)
    logits, residuals = verifier_targets(v.hf, ids, layers)
    lean = LeanDecoder(v.hf)
    out = lean.forward(lean.new_cache(1, 8), ids, capture=layers)
    # the same model computed two ways: fp32 rounding apart (the lean attention sums keys block by block)
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=1e-5)
    for i in layers:
        torch.testing.assert_close(residuals[i], out.hidden[i], atol=1e-4, rtol=1e-5)
