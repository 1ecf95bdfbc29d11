import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.proposer import VerifierView
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.sd2 import SteeredDrafter, Steering, default_steer_layers, steering_for, width_map
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.kv_cache import prefill
from tests.tiny import build_model, llama_config


@pytest.fixture(scope="module")
def pair():
    verifier = build_model(llama_config(60, 4, 64), seed=0, init_std=0.2)
    drafter = build_model(llama_config(60, 2, 32), seed=1, init_std=0.2)
    return verifier, drafter


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12]]


def test_default_layers_are_three_l_half_and_l_minus_two():
    assert default_steer_layers(32) == (2, 15, 29)  # layers 3, 16, 30 counted from 1
    assert default_steer_layers(6) == (1, 2, 3)  # shallow: layers 2, 3, 4
    assert default_steer_layers(3) == (0, 1, 2)
    with pytest.raises(ValueError):
        default_steer_layers(2)


def test_w_hml_starts_as_the_sum_of_the_three_states():
    s = steering_for(llama_config(60, 4, 64), llama_config(60, 2, 64), layers=(0, 1, 2))
    h, m, l = torch.randn(3, 64)
    expected = torch.nn.functional.layer_norm(h + m + l, (64,))
    torch.testing.assert_close(s.vector(torch.stack([h, m, l])[None])[0], expected)
    P = width_map(32, 64)
    assert P.shape == (32, 64) and bool((P.sum(dim=1) == 2).all()) and bool((P.sum(dim=0) == 1).all())
    up = width_map(64, 32)
    assert up.shape == (64, 32) and bool((up.sum(dim=1) == 1).all()) and bool((up.sum(dim=0) == 2).all())


def test_untrained_steering_drafts_exactly_what_the_plain_drafter_drafts(pair):
    verifier, drafter = LeanDecoder(pair[0]), LeanDecoder(pair[1])
    steering = steering_for(pair[0].config, pair[1].config, layers=(0, 1, 2))
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    plain = generate(verifier, PretrainedDrafter(drafter), PROMPTS, params, 4, StopRule())
    steered = generate(verifier, SteeredDrafter(drafter, steering), PROMPTS, params, 4, StopRule())
    for a, b in zip(plain, steered):
        assert a.token_ids == b.token_ids and a.stats.to_dict() == b.stats.to_dict()


def test_trained_steering_changes_drafts_and_stays_lossless(pair):
    verifier, drafter = LeanDecoder(pair[0]), LeanDecoder(pair[1])
    steering = steering_for(pair[0].config, pair[1].config, layers=(0, 1, 2))
    torch.manual_seed(0)
    torch.nn.init.normal_(steering.w_s, std=0.5)
    params = SamplingParams(max_tokens=16)
    ref = generate(verifier, None, PROMPTS, params, 0, StopRule())
    plain = generate(verifier, PretrainedDrafter(drafter), PROMPTS, params, 4, StopRule())
    steered = generate(verifier, SteeredDrafter(drafter, steering), PROMPTS, params, 4, StopRule())
    assert [g.token_ids for g in steered] == [g.token_ids for g in ref]
    assert [g.stats.accepted_per_position for g in steered] != [g.stats.accepted_per_position for g in plain]


def test_bias_is_computed_once_per_block_from_the_emitting_position(pair):
    verifier, drafter = LeanDecoder(pair[0]), LeanDecoder(pair[1])
    steering = steering_for(pair[0].config, pair[1].config, layers=(0, 1, 2))
    d = SteeredDrafter(drafter, steering)
    calls = []
    original = d.block_bias
    d.block_bias = lambda steer: calls.append(1) or original(steer)
    gens = generate(verifier, d, [PROMPTS[0]], SamplingParams(max_tokens=12), 4, StopRule())
    assert len(calls) == gens[0].stats.blocks
    # the features of the first block are the verifier's states at the last prefilled position
    cache, feats = prefill(verifier, [PROMPTS[0]], 32, capture=(0, 1, 2))
    d.start([PROMPTS[0]], 32, VerifierView(cache, feats))
    with torch.no_grad():
        states = pair[0](torch.tensor([PROMPTS[0][:-1]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(d._features[2], states[3][:, -1], atol=1e-4, rtol=1e-4)


def test_steering_round_trips_through_safetensors(tmp_path, pair):
    s = steering_for(pair[0].config, pair[1].config, layers=(0, 1, 3))
    torch.nn.init.normal_(s.w_s)
    s.save(tmp_path, {"base": "x"})
    back = Steering.load(tmp_path)
    assert back.cfg == s.cfg
    torch.testing.assert_close(back.w_s, s.w_s)
