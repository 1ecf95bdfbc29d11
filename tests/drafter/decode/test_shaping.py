"""The usual sampling controls under speculation (drafter/decode/shaping.py): the output distribution is the
verifier's shaped one (chi-square against an independent sequential reference), greedy output equals the verifier
alone with the same controls, min_tokens and stop_token_ids end where they should."""
import pytest
import torch

from specloop.drafter.decode import shaping
from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams, warp
from specloop.drafter.decode.shaping import Controls
from specloop.drafter.model.decoder import LeanDecoder
from tests.drafter_helpers import POSITIONS, PROMPT, VOCAB
from tests.stats import chi2_pvalue
from tests.tiny import build_model, llama_config

CONTROLS = Controls(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.5,
                    logit_bias=((3, 1.5), (5, -2.0), (7, 0.8)))
PARAMS = SamplingParams(temperature=0.9, min_p=0.05, max_tokens=POSITIONS, seed=5)


@pytest.fixture(scope="module")
def tiny():
    verifier = build_model(llama_config(VOCAB, 2, 32), seed=11, init_std=0.6)
    drafter = build_model(llama_config(VOCAB, 1, 32), seed=12, init_std=0.6)
    return verifier, drafter


def reference_logits(logits: torch.Tensor, prompt: list[int], out: list[int], c: Controls) -> torch.Tensor:
    """vLLM's controls written out for one sequence, position by position (independent of RowShaping)."""
    x = logits.double().clone()
    for t, b in c.logit_bias:
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / c.repetition_penalty if x[t] > 0 else x[t] * c.repetition_penalty
    for t in set(out):
        x[t] -= c.frequency_penalty * out.count(t) + c.presence_penalty
    return x


def shaped_joint(model, prompt, positions, params, controls) -> torch.Tensor:
    """P(the first `positions` generated tokens) [V ** positions], enumerating every prefix with the reference
    controls (the joint: a penalty's effect is on which tokens follow which)."""
    prefixes, weights = [[]], torch.ones(1, dtype=torch.float64)
    for _ in range(positions):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]
        shaped = torch.stack([reference_logits(row, prompt, p, controls) for row, p in zip(logits, prefixes)])
        probs = warp(shaped, params).double() * weights[:, None]
        prefixes = [p + [t] for p in prefixes for t in range(probs.shape[-1])]
        weights = probs.flatten()
    return weights


def joint_counts(tiny, params, kind, k, controls) -> torch.Tensor:
    """Counts of each generated sequence (the first POSITIONS tokens as a base-VOCAB number)."""
    from tests.drafter_helpers import N_SAMPLES, tiny_drafter

    verifier, counts = LeanDecoder(tiny[0]), torch.zeros(VOCAB ** POSITIONS)
    for lo in range(0, N_SAMPLES, 5000):
        gens = generate(verifier, tiny_drafter(tiny, kind), [PROMPT] * 5000, params, k, StopRule(), first_request=lo,
                        controls=controls)
        index = torch.tensor([sum(t * VOCAB ** (POSITIONS - 1 - i) for i, t in enumerate(g.token_ids)) for g in gens])
        counts += torch.bincount(index, minlength=VOCAB ** POSITIONS)
    return counts


@pytest.mark.usefixtures("wide_fp32_row_blocks")
@pytest.mark.parametrize("kind,k", [("pretrained", 2), ("none", 0)])
def test_sampled_output_with_penalties_bias_and_min_p_is_the_verifiers_shaped_distribution(tiny, kind, k):
    exact = shaped_joint(tiny[0], PROMPT, POSITIONS, PARAMS, CONTROLS)
    pvalue = chi2_pvalue(joint_counts(tiny, PARAMS, kind, k, CONTROLS), exact)
    print(f"{kind} k={k}: chi-square p-value of the joint {pvalue}")
    assert pvalue > 0.01, pvalue


@pytest.mark.usefixtures("wide_fp32_row_blocks")
def test_penalties_that_ignore_the_drafts_before_a_position_fail_the_same_test(tiny, monkeypatch):
    """A shaper that gives every drafted position the committed counts only (the drafts before it not
    counted) is caught: the test above can fail."""
    exact = shaped_joint(tiny[0], PROMPT, POSITIONS, PARAMS, CONTROLS)
    monkeypatch.setattr(shaping, "drafted_counts", lambda drafts, J, V: torch.zeros(len(drafts), J, V))
    pvalue = chi2_pvalue(joint_counts(tiny, PARAMS, "pretrained", 2, CONTROLS), exact)
    assert pvalue < 0.01, pvalue


@pytest.mark.parametrize("kind,k", [("pretrained", 3), ("ngram", 4)])
def test_greedy_output_with_controls_equals_the_verifier_alone_with_them(tiny, kind, k):
    from tests.drafter_helpers import tiny_drafter

    verifier = LeanDecoder(tiny[0])
    params = SamplingParams(max_tokens=12)
    prompts = [PROMPT, [4, 4, 2], [9, 1, 1, 6, 2, 3]]
    alone = generate(verifier, None, prompts, params, 0, StopRule(), controls=CONTROLS)
    spec = generate(verifier, tiny_drafter(tiny, kind), prompts, params, k, StopRule(), controls=CONTROLS)
    plain = generate(verifier, None, prompts, params, 0, StopRule())
    assert [g.token_ids for g in spec] == [g.token_ids for g in alone]
    assert [g.token_ids for g in alone] != [g.token_ids for g in plain]  # the controls changed something
    assert sum(g.stats.accepted for g in spec) > 0


def test_min_tokens_holds_eos_back_and_stop_token_ids_end_the_request(tiny):
    verifier = LeanDecoder(tiny[0])
    plain = generate(verifier, None, [PROMPT], SamplingParams(max_tokens=12), 0, StopRule())[0].token_ids
    i = next(i for i, t in enumerate(plain) if i and t not in plain[:i])  # a token greedy emits first at i > 0
    eos = plain[i]
    rule = StopRule(frozenset({eos}))
    ended = generate(verifier, None, [PROMPT], SamplingParams(max_tokens=12), 0, rule)[0]
    assert ended.token_ids == plain[:i] and ended.finish_reason == "stop"
    held = generate(verifier, None, [PROMPT], SamplingParams(max_tokens=12), 0, rule,
                    controls=Controls(min_tokens=i + 3))[0]
    assert len(held.token_ids) >= i + 3 and held.token_ids[:i] == plain[:i]  # EOS masked until then
    stopped = generate(verifier, None, [PROMPT], SamplingParams(max_tokens=12, stop_token_ids=(eos,)), 0,
                       StopRule())[0]
    assert stopped.token_ids == plain[:i] and stopped.finish_reason == "stop"


def test_neutral_controls_make_no_shaper():
    assert Controls().neutral and not Controls(min_tokens=1).neutral
    with pytest.raises(ValueError):
        Controls(repetition_penalty=0)
