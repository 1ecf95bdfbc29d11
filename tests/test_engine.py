"""Continuous batching: requests that join and leave a running pool decode exactly as they would alone."""
from __future__ import annotations

import pytest
import torch

from drafter.decoder import prefill
from drafter.engine import Engine, EngineRequest
from drafter.kinds import build_drafter
from drafter.models import load_model
from drafter.proposer import VerifierView, emitted_tokens
from drafter.sampling import SamplingParams, draw_uniforms, make_generators
from drafter.speculative import Generation, RequestStats, StopRule, generate, speculative_step

PROMPTS = ["def main():\n    print(", "hello world", "import os\nimport sys\n", "class Config:\n    def", "the quick brown"]
# (k, temperature, top_k, top_p, seed, stream): rows of one pool differ in all of them
MIX = [(4, 0.0, 0, 1.0, 0, 0), (2, 0.8, 0, 0.9, 7, 3), (0, 0.0, 0, 1.0, 0, 0), (3, 1.0, 5, 1.0, 11, 0),
       (4, 0.8, 0, 0.9, 7, 4), (1, 0.0, 0, 1.0, 0, 0), (0, 1.2, 0, 1.0, 5, 1)]


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0])


def _drafter(kind, verifier, tiny_pair):
    drafter = build_drafter(kind, verifier, None if kind in ("ngram", "dvi") else tiny_pair[1])
    if kind == "sd2":  # non-zero steering, so that a row's steering inputs matter
        with torch.no_grad():
            drafter.steering.w_s.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    return drafter


def _requests(verifier, max_tokens=12):
    tok = verifier.tokenizer
    out = []
    for i, (k, t, top_k, top_p, seed, stream) in enumerate(MIX):
        prompt = tok.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)
        params = SamplingParams(t, top_k, top_p, max_tokens + i, (), seed)
        out.append(EngineRequest(f"r{i}", prompt, params, k, stream))
    return out


def _alone(verifier, drafter, req: EngineRequest, rule):
    """The reference, independent of the engine: one request, its own cache, the step loop written out."""
    lean, k, params = verifier.lean, req.k, req.params
    capacity = len(req.prompt) + params.max_tokens + 2 * k + 2
    cache, features = prefill(lean, [req.prompt], capacity, drafter.verifier_layers if k else ())
    if k:
        drafter.start([req.prompt], capacity, VerifierView(cache, features))
    last, gen = torch.tensor([req.prompt[-1]]), Generation([], None, RequestStats(k))
    generators = make_generators(params.seed, 1, start=req.stream)
    while gen.finish_reason is None:
        uniforms = None if params.greedy else draw_uniforms(generators, 2 * k + 1)
        outcome = speculative_step(lean, cache, last, drafter if k else None, k, params, uniforms, torch.ones(1, dtype=torch.bool))
        rule.extend(gen, emitted_tokens(outcome, 0), params)
        last = outcome.last_tokens
    return gen.token_ids


def _run_staggered(engine: Engine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    """Admit one request per step while slots are free, step until all finish."""
    waiting, out = list(requests), {}
    while waiting or engine.running:
        if waiting and engine.free:
            engine.admit([waiting.pop(0)])
        for u in engine.step():
            out.setdefault(u.id, []).extend(u.new_tokens)
    return out


@pytest.mark.parametrize("kind", ["pretrained", "sd2", "dvi", "ngram"])
def test_requests_joining_a_running_pool_decode_exactly_as_alone(kind, verifier, tiny_pair):
    rule = StopRule(verifier.eos_ids)
    drafter = _drafter(kind, verifier, tiny_pair)
    requests = _requests(verifier)
    expected = {r.id: _alone(verifier, drafter, r, rule) for r in requests}
    engine = Engine(verifier.lean, _drafter(kind, verifier, tiny_pair), slots=3, capacity=96, stop_rule=rule)
    got = _run_staggered(engine, requests)
    assert got == expected


def test_greedy_rows_without_speculation_equal_the_verifier_alone(verifier, tiny_pair):
    rule = StopRule(verifier.eos_ids)
    requests = [r for r in _requests(verifier) if r.params.greedy]
    engine = Engine(verifier.lean, _drafter("pretrained", verifier, tiny_pair), slots=2, capacity=96, stop_rule=rule)
    got = _run_staggered(engine, requests)
    for r in requests:
        reference = generate(verifier.lean, None, [r.prompt], r.params, 0, rule)[0].token_ids
        assert got[r.id] == reference


def test_an_aborted_request_frees_its_slot_and_the_next_one_stays_exact(verifier, tiny_pair):
    rule = StopRule(verifier.eos_ids)
    drafter = _drafter("pretrained", verifier, tiny_pair)
    first, second, third = _requests(verifier)[:3]
    engine = Engine(verifier.lean, _drafter("pretrained", verifier, tiny_pair), slots=2, capacity=96, stop_rule=rule)
    engine.admit([first, second])
    engine.step()
    assert engine.free == []
    assert engine.abort(first.id) and not engine.abort(first.id)
    assert engine.free == [0]
    got = _run_staggered(engine, [third])
    assert got[third.id] == _alone(verifier, drafter, third, rule)


def test_a_request_that_does_not_fit_the_context_is_refused_before_it_takes_a_slot(verifier, tiny_pair):
    engine = Engine(verifier.lean, None, slots=2, capacity=32, stop_rule=StopRule(verifier.eos_ids))
    too_long = EngineRequest("x", list(range(1, 30)), SamplingParams(max_tokens=8), 0)
    with pytest.raises(ValueError, match="exceed the 32-position context"):
        engine.admit([too_long])
    assert engine.free == [0, 1]
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.admit([EngineRequest("y", [1, 2], SamplingParams(max_tokens=4), 2)])


def test_a_step_reports_every_running_request_and_its_timing(verifier, tiny_pair):
    rule = StopRule(verifier.eos_ids)
    engine = Engine(verifier.lean, _drafter("pretrained", verifier, tiny_pair), slots=4, capacity=96, stop_rule=rule)
    engine.admit(_requests(verifier)[:2])
    updates = engine.step()
    assert sorted(u.id for u in updates) == ["r0", "r1"]
    assert all(1 <= len(u.new_tokens) <= 5 for u in updates)
    assert 0 < engine.timing.forward_s <= engine.timing.total_s
    assert engine.step() and engine.running <= 2
