"""Continuous batching: requests that join and leave a running pool decode exactly as they would alone."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from specloop.drafter.decode.capacity import positions_needed
from specloop.drafter.decode.controller import Choice, Controller, ControllerConfig, speculator_of
from specloop.drafter.decode.engine import Engine, generate
from specloop.drafter.decode.plan import StepPlan
from specloop.drafter.decode.proposer import VerifierView
from specloop.drafter.decode.requests import EngineRequest, Generation, StopRule
from specloop.drafter.decode.sampling import SamplingParams, draw_uniforms, make_generators
from specloop.drafter.decode.speculative import speculative_step
from specloop.drafter.decode.stats import AcceptanceStats
from specloop.drafter.kinds.suffix import SuffixDrafter
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.kv_cache import prefill
from specloop.drafter.model.loading import load_model
from tests.drafter_helpers import Scripted

PROMPTS = ["def main():\n    print(", "hello world", "import os\nimport sys\n", "class Config:\n    def", "the quick brown"]
# (k, temperature, top_k, top_p, seed, stream): rows of one pool differ in all of them
MIX = [(4, 0.0, 0, 1.0, 0, 0), (2, 0.8, 0, 0.9, 7, 3), (0, 0.0, 0, 1.0, 0, 0), (3, 1.0, 5, 1.0, 11, 0),
       (4, 0.8, 0, 0.9, 7, 4), (1, 0.0, 0, 1.0, 0, 0), (0, 1.2, 0, 1.0, 5, 1)]


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0])


def _drafter(kind, verifier, tiny_pair):
    drafter = build_drafter(kind, verifier, None if kind in ("ngram", "dvi", "eagle") else tiny_pair[1])
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
    capacity = positions_needed(len(req.prompt), params.max_tokens, k)
    cache, features = prefill(lean, [req.prompt], capacity, drafter.verifier_layers if k else ())
    if k:
        drafter.start([req.prompt], capacity, VerifierView(cache, features))
    last, gen = torch.tensor([req.prompt[-1]]), Generation([], None, AcceptanceStats(k))
    generators = make_generators(params.seed, 1, start=req.stream)
    while gen.finish_reason is None:
        uniforms = None if params.greedy else draw_uniforms(generators, 2 * k + 1)
        plan = StepPlan.from_uniforms(torch.ones(1, dtype=torch.bool), k, params, uniforms)
        outcome = speculative_step(lean, cache, last, drafter if k else None, plan)
        rule.extend(gen, outcome.emitted(0), params)
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


@pytest.mark.parametrize("kind", ["pretrained", "sd2", "dvi", "ngram", "eagle"])
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


# ---------------------------------------------------------------- k = auto (the cost-aware controller)

def _auto(requests: list[EngineRequest]) -> list[EngineRequest]:
    return [EngineRequest(r.id, r.prompt, r.params, None, r.stream) for r in requests]


@pytest.mark.parametrize("kind", ["pretrained", "sd2", "dvi", "ngram", "eagle"])
def test_auto_rows_decode_greedy_as_the_verifier_alone_whatever_k_each_step_takes(kind, verifier, tiny_pair):
    rule = StopRule(verifier.eos_ids)
    requests = _auto([r for r in _requests(verifier, max_tokens=20) if r.params.greedy])
    engine = Engine(verifier.lean, _drafter(kind, verifier, tiny_pair), slots=2, capacity=96, stop_rule=rule,
                    controller=Scripted())
    got = _run_staggered(engine, requests)
    for r in requests:
        assert got[r.id] == generate(verifier.lean, None, [r.prompt], r.params, 0, rule)[0].token_ids


def test_auto_rows_with_the_real_controller_decode_greedy_as_the_verifier_alone(verifier, tiny_pair):
    rule = StopRule(verifier.eos_ids)
    requests = _auto([r for r in _requests(verifier, max_tokens=40) if r.params.greedy])
    engine = Engine(verifier.lean, _drafter("pretrained", verifier, tiny_pair), slots=3, capacity=128, stop_rule=rule,
                    controller=Controller(ControllerConfig(explore_min=2, explore_max=4)))  # probes often
    got = _run_staggered(engine, requests)
    for r in requests:
        assert got[r.id] == generate(verifier.lean, None, [r.prompt], r.params, 0, rule)[0].token_ids


class _Counting:
    """A drafter wrapper that counts the calls it gets."""

    def __init__(self, inner):
        self.inner, self.calls = inner, {"propose": 0, "observe": 0, "join": 0}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in self.calls:
            def counted(*args, **kwargs):
                self.calls[name] += 1
                return attr(*args, **kwargs)
            return counted
        return attr


def test_a_step_where_every_row_has_k_zero_never_calls_the_drafter(verifier, tiny_pair):
    rule = StopRule(verifier.eos_ids)
    drafter = _Counting(_drafter("pretrained", verifier, tiny_pair))
    engine = Engine(verifier.lean, drafter, slots=2, capacity=96, stop_rule=rule, controller=Scripted([0]))
    engine.admit(_auto(_requests(verifier)[:2]))
    while engine.running:
        assert all(u.k == 0 for u in engine.step())
        assert engine.timing.choice.k == 0
    assert drafter.calls == {"propose": 0, "observe": 0, "join": 1}  # the admission only


def test_explicit_k_rows_keep_their_k_and_auto_rows_take_the_controllers(verifier, tiny_pair):
    rule = StopRule(verifier.eos_ids)
    reqs = _requests(verifier)
    explicit = EngineRequest("fixed", reqs[5].prompt, reqs[5].params, 1, 0)  # k = 1
    auto = _auto([reqs[0]])[0]
    engine = Engine(verifier.lean, _drafter("pretrained", verifier, tiny_pair), slots=2, capacity=96,
                    stop_rule=rule, controller=Scripted([0, 3]))
    engine.admit([explicit, auto])
    first, second = engine.step(), engine.step()
    assert {u.id: u.k for u in first} == {"fixed": 1, "r0": 1}  # auto chose 0: it rides on the explicit k
    assert {u.id: u.k for u in second} == {"fixed": 1, "r0": 3}
    stats = engine.get("r0").gen.stats
    assert stats.drafted == 4 and stats.drafted_per_position == [2, 1, 1, 0] and stats.blocks == 2


def test_the_controller_is_asked_for_the_running_requests_as_they_join_and_leave(verifier, tiny_pair):
    """The engine makes the controller's `Batch` once per set of running requests (the controller answers the same
    batch from a quiet run of plain choices): every admission and departure makes it again."""
    seen = []

    class Recording(Scripted):
        def choose(self, batch):
            seen.append(batch)
            return super().choose(batch)

    reqs = _requests(verifier)
    engine = Engine(verifier.lean, _drafter("pretrained", verifier, tiny_pair), slots=3, capacity=96,
                    stop_rule=StopRule(verifier.eos_ids), controller=Recording([0]))
    engine.admit(_auto([reqs[0]]))
    engine.step()
    engine.admit([EngineRequest("fixed", reqs[5].prompt, reqs[5].params, 2, 0)])
    engine.step()
    engine.admit(_auto([reqs[2]]))
    engine.step()
    engine.abort("r0")
    engine.step()
    engine.abort("r2")
    engine.step()  # the explicit row alone: nothing to choose
    assert [(b.rows, b.auto, b.fixed) for b in seen] == [(1, 1, ()), (2, 1, (2,)), (3, 2, (2,)), (3, 1, (2,))]


def test_the_controller_prices_a_step_without_its_trace_callback(verifier, tiny_pair):
    # replay logging runs inside the step (inline): its time is reported apart and never taken for a cost of
    # decoding (a cold first record of tens of ms made plain steps look dear and kept a losing drafter on)
    samples = []

    class Watching(Controller):
        def observe(self, step):
            samples.append(step)
            super().observe(step)

    class SlowLogger:
        def swap(self, drafter, histories):
            return drafter

        def observes_plain(self):
            return True

        def traced(self, histories, ids):
            return lambda trace: (calls.append(1), time.sleep(0.05))

    calls: list[int] = []
    engine = Engine(verifier.lean, _drafter("eagle", verifier, tiny_pair), slots=1, capacity=96,
                    stop_rule=StopRule(verifier.eos_ids), controller=Watching(), hooks=SlowLogger())
    engine.admit(_auto(_requests(verifier)[:1]))
    traced = 0
    for _ in range(4):  # plain steps (observed) and probes (unless the confidence cut left nothing to verify)
        before = len(calls)
        engine.step()
        if len(calls) > before:
            traced += 1
            assert engine.timing.trace_s >= 0.05 and engine.timing.total_s >= 0.05
    assert traced >= 2 and len(samples) == 4
    assert all(s.overhead_s < 0.04 for s in samples), [s.overhead_s for s in samples]


def test_a_controller_that_turned_speculation_off_learns_from_few_plain_steps_and_output_is_unchanged(
        verifier, tiny_pair):
    # an eagle head made dear (each call to draft sleeps 100 ms, tens of plain steps' worth), so that speculation
    # cannot pay whatever the verifier takes of its drafts: once the controller leaves speculation off, its plain
    # steps are neither timed nor observed, but for the few before each probe. (Resting on an untrained head's
    # drafts not paying made the test depend on the machine's timing: on a busy AVX2 CI machine 145 of 240 steps
    # drafted, where 0 do here.)
    samples = []

    class Watching(Controller):
        def observe(self, step):
            samples.append(step)
            super().observe(step)

    rule, req = StopRule(()), _auto(_requests(verifier, max_tokens=240)[:1])[0]
    controller = Watching(ControllerConfig(explore_max=64))
    drafter = _drafter("eagle", verifier, tiny_pair)
    drafter.propose = lambda *a, propose=drafter.propose: (time.sleep(0.1), propose(*a))[1]
    engine = Engine(verifier.lean, drafter, slots=1,
                    capacity=positions_needed(len(req.prompt), req.params.max_tokens, None), stop_rule=rule,
                    controller=controller)
    engine.admit([req])
    tokens, steps, untimed = [], 0, 0
    while engine.running:
        for u in engine.step():
            tokens += u.new_tokens
        steps += 1
        choice = engine.timing.choice
        untimed += not choice.timed
        assert choice.timed or (choice.k == 0 and engine.timing.draft_s == 0)
    assert tokens == generate(verifier.lean, None, [req.prompt], req.params, 0, rule)[0].token_ids
    drafting = sum(1 for s in samples if s.k)
    assert drafting < steps / 8 and untimed > steps / 2  # speculation off most of the time, and untimed
    assert len(samples) == steps - untimed, (steps, untimed, drafting)


def test_an_eagle_head_skips_untimed_plain_steps_and_a_row_it_skipped_follows_one_step_before_drafting(verifier):
    # a lazy eagle head against one that follows every plain step, on the same schedule but for the step where
    # the lazy one's rows were stale (decoded plain, followed): the same drafts, verdicts and tokens, step by step
    from specloop.drafter.kinds.eagle import EagleDrafter
    from tests.drafter_helpers import trained_eagle

    rule, reqs = StopRule(()), _auto([r for r in _requests(verifier, max_tokens=30) if r.params.greedy][:2])
    lazy_ks = [0, -1, -1, 3, 3, -1, 2, 2, 0]
    eager_ks = [0, 0, 0, 0, 3, 0, 0, 2, 0]  # where a stale row decodes plain
    runs = {}
    for name, ks in (("lazy", lazy_ks), ("eager", eager_ks)):
        head = EagleDrafter(verifier.lean, trained_eagle(verifier.lean))
        head.follows_lazily, proposals, propose = name == "lazy", [], head.propose
        head.propose = lambda *a, proposals=proposals, propose=propose: (p := propose(*a), proposals.append(p.tokens))[0]
        drafter = _Counting(head)
        engine = Engine(verifier.lean, drafter, slots=2, capacity=96, stop_rule=rule, controller=Scripted(ks))
        engine.admit(reqs)
        steps = []
        while engine.running:
            observed = drafter.calls["observe"]
            updates = engine.step()
            steps.append(sorted((u.id, u.k, u.accepted, tuple(u.new_tokens)) for u in updates))
            skipped = engine.timing.choice is not None and not engine.timing.choice.timed
            assert (drafter.calls["observe"] == observed) == (skipped and name == "lazy")
        runs[name] = steps, [p.tolist() for p in proposals]
    assert runs["lazy"] == runs["eager"]  # the drafts too: drafted from the features a following head holds
    assert len(runs["lazy"][1]) >= 4 and sum(k for step in runs["lazy"][0] for _, k, _, _ in step) > 0


def _mix(verifier, observed: dict):
    """An eagle head with suffix decoding beside it (the served default's mix), each member's observations counted."""
    from specloop.drafter.kinds.eagle import EagleDrafter
    from specloop.drafter.kinds.mix import SpeculatorMix
    from tests.drafter_helpers import trained_eagle

    members = {"adaptive": EagleDrafter(verifier.lean, trained_eagle(verifier.lean)),
               "suffix": SuffixDrafter(verifier.vocab_size)}
    for name, member in members.items():
        def counted(*args, name=name, observe=member.observe):
            observed[name] += 1
            return observe(*args)
        member.observe = counted
    return SpeculatorMix(members)


@pytest.mark.parametrize("lookups", [False, True])
def test_a_mix_leaves_its_eagle_head_behind_on_untimed_steps_while_its_suffix_member_follows_every_one(
        verifier, lookups):
    # the eagle test's schedules on the served default's mix: on a step the controller left plain and untimed (and
    # on a lookup it leaves so) the head neither observes nor is captured for, the suffix member follows every
    # step; without lookups, step for step what a mix whose head follows every plain step drafts and decodes
    rule = StopRule(())
    reqs = _auto([r for r in _requests(verifier, max_tokens=30) if r.params.greedy][:2])
    want = {r.id: generate(verifier.lean, None, [r.prompt], r.params, 0, rule)[0].token_ids for r in reqs}
    schedules = {"lazy": [0, -1, -1, 3, 3, -1, 2, 2, 0], "eager": [0, 0, 0, 0, 3, 0, 0, 2, 0]}
    runs = {}
    for name, ks in schedules.items():
        observed = {"adaptive": 0, "suffix": 0}
        mix = _mix(verifier, observed)
        mix.members["adaptive"].follows_lazily = name == "lazy"
        engine = Engine(verifier.lean, mix, slots=2, capacity=96, stop_rule=rule, controller=Scripted(ks),
                        lookups=lookups)
        engine.admit(reqs)
        steps, got, skipped_steps = [], {}, 0
        while engine.running:
            before = dict(observed)
            updates = engine.step()
            steps.append(sorted((u.id, u.k, u.accepted, tuple(u.new_tokens)) for u in updates))
            for u in updates:
                got.setdefault(u.id, []).extend(u.new_tokens)
            skipped = engine.timing.choice is not None and not engine.timing.choice.timed
            skipped_steps += skipped
            assert observed["suffix"] == before["suffix"] + 1  # both rows in every step: no narrowed view
            assert (observed["adaptive"] == before["adaptive"]) == (skipped and name == "lazy")
        assert got == want
        assert skipped_steps > 0 or name == "eager"
        runs[name] = steps
    if not lookups:
        assert runs["lazy"] == runs["eager"]
    assert sum(k for step in runs["lazy"] for _, k, _, _ in step) > 0


def test_a_request_admitted_while_speculation_is_off_starts_in_a_drafter_lm_only_when_it_first_drafts(
        verifier, tiny_pair):
    # the drafter LM's prefill of a prompt is saved while the controller leaves speculation off (its last step
    # untimed); the row starts in the drafter (resync) at its first drafting step, and decodes as the verifier alone
    rule = StopRule(verifier.eos_ids)
    first, second = _auto([r for r in _requests(verifier, max_tokens=24) if r.params.greedy][:2])
    drafter = _Counting(_drafter("pretrained", verifier, tiny_pair))
    engine = Engine(verifier.lean, drafter, slots=2, capacity=96, stop_rule=rule,
                    controller=Scripted([0, -1, -1, -1, -1, -1, 3, 3, -1, -1]))
    engine.admit([first])
    assert drafter.calls["join"] == 1  # an engine's first request: no step yet, nothing known
    out: dict[str, list[int]] = {}
    for _ in range(2):
        for u in engine.step():
            out.setdefault(u.id, []).extend(u.new_tokens)
    assert not engine.timing.choice.timed
    engine.admit([second])
    assert drafter.calls["join"] == 1 and engine._slot_of[second.id] in engine.behind  # deferred
    while engine.running:
        for u in engine.step():
            out.setdefault(u.id, []).extend(u.new_tokens)
            assert u.k == 0 or drafter.calls["join"] >= 2  # it drafted only after it started in the drafter
    assert drafter.calls["join"] >= 2  # the resync, at the first drafting step
    for r in (first, second):
        assert out[r.id] == generate(verifier.lean, None, [r.prompt], r.params, 0, rule)[0].token_ids
    engine = Engine(verifier.lean, _Counting(_drafter("pretrained", verifier, tiny_pair)), slots=2, capacity=96,
                    stop_rule=rule, controller=Scripted([0]))  # timed plain steps: a probe may come, join at once
    engine.admit([first])
    engine.step()
    engine.admit([second])
    assert engine.drafter.calls["join"] == 2 and engine._slot_of[second.id] not in engine.behind


def test_a_drafter_swap_tells_the_controller(verifier, tiny_pair):
    swaps = []

    class Watching(Controller):
        def drafter_swapped(self):
            swaps.append(1)
            super().drafter_swapped()

    class SwapOnce:
        def __init__(self):
            self.new = None

        def swap(self, drafter, histories):
            return drafter if self.new is None or self.new is drafter else self._adopted(drafter)

        def _adopted(self, drafter):
            self.new.adopt(drafter)
            return self.new

        def traced(self, histories, ids):
            return None

    hooks = SwapOnce()
    engine = Engine(verifier.lean, _drafter("ngram", verifier, tiny_pair), slots=1, capacity=96,
                    stop_rule=StopRule(verifier.eos_ids), controller=Watching(), hooks=hooks)
    engine.admit(_auto(_requests(verifier)[:1]))
    engine.step()
    engine.offer_swap()
    assert swaps == []
    hooks.new = _drafter("ngram", verifier, tiny_pair)
    engine.offer_swap()  # the one path that writes engine.drafter
    assert engine.drafter is hooks.new and swaps == [1]
    engine.step()
    assert swaps == [1]


def test_an_auto_request_reserves_room_for_the_most_the_controller_may_draft(verifier):
    engine = Engine(verifier.lean, None, slots=1, capacity=32, stop_rule=StopRule(verifier.eos_ids),
                    controller=Controller(ControllerConfig(k_max=4)))
    assert engine.reserve(None) == 10 and engine.reserve(1) == 4
    with pytest.raises(ValueError, match=r"\+ 10 for drafting"):
        engine.admit([EngineRequest("x", list(range(1, 20)), SamplingParams(max_tokens=4), None)])
    engine.admit([EngineRequest("y", list(range(1, 19)), SamplingParams(max_tokens=4), None)])  # no drafter: plain
    while engine.running:
        assert all(u.k == 0 for u in engine.step())


# ---------------------------------------------------------------- log-probabilities (OpenAI `logprobs`)


def _scored(engine: Engine, requests: list[EngineRequest]) -> dict[str, tuple[list[int], list]]:
    """Each request's tokens and scores over its updates; every update scores exactly the tokens it commits."""
    waiting, out = list(requests), {}
    while waiting or engine.running:
        if waiting and engine.free:
            engine.admit([waiting.pop(0)])
        for u in engine.step():
            tokens, scores = out.setdefault(u.id, ([], []))
            tokens.extend(u.new_tokens)
            if u.logprobs is None:
                assert scores == []
                continue
            assert [s.token_id for s in u.logprobs] == u.new_tokens
            scores.extend(u.logprobs)
    return out


def _asking(req: EngineRequest, k: int | None, n: int | None) -> EngineRequest:
    return EngineRequest(req.id, req.prompt, req.params, k, req.stream, logprobs=n)


def _assert_same_scores(got: list, expected: list) -> None:
    assert [s.token_id for s in got] == [s.token_id for s in expected]
    assert torch.allclose(torch.tensor([s.logprob for s in got]), torch.tensor([s.logprob for s in expected]), atol=1e-4)
    for g, e in zip(got, expected):
        assert [t for t, _ in g.top] == [t for t, _ in e.top]
        assert torch.allclose(torch.tensor([lp for _, lp in g.top]), torch.tensor([lp for _, lp in e.top]), atol=1e-4)


@pytest.mark.parametrize("kind", ["pretrained", "ngram", "sd2", "dvi", "eagle"])
def test_greedy_logprobs_are_the_same_with_speculation_on_and_off_alone_and_batched(kind, verifier, tiny_pair):
    rule = StopRule(verifier.eos_ids)
    reqs = _requests(verifier, max_tokens=14)
    asking = lambda k: _asking(reqs[0], k, 3)  # noqa: E731 - greedy, 3 alternatives
    others = [_asking(reqs[1], 2, None), _asking(reqs[5], 1, None), _asking(reqs[3], None, None)]  # never asked
    reference = _scored(Engine(verifier.lean, None, 1, 96, rule), [asking(0)])["r0"]
    tokens, scores = reference
    assert tokens == generate(verifier.lean, None, [reqs[0].prompt], reqs[0].params, 0, rule)[0].token_ids
    assert len(scores) == len(tokens) and all(s.top[0][0] == s.token_id for s in scores)  # greedy: the top-1
    for k in range(5):
        alone = _scored(Engine(verifier.lean, _drafter(kind, verifier, tiny_pair), 1, 96, rule), [asking(k)])["r0"]
        batched = _scored(Engine(verifier.lean, _drafter(kind, verifier, tiny_pair), 3, 96, rule),
                          [others[0], asking(k), *others[1:]])
        for got in (alone, batched["r0"]):
            assert got[0] == tokens
            _assert_same_scores(got[1], scores)


def test_logprobs_are_the_verifiers_log_softmax_at_each_emitted_position(verifier, tiny_pair):
    """Sampled rows too (raw logits: before temperature / top-k / top-p), checked against one plain
    forward pass over prompt + output."""
    rule = StopRule(verifier.eos_ids)
    reqs = [_asking(r, r.k, i % 3 if i % 2 == 0 else None) for i, r in enumerate(_requests(verifier))]
    got = _scored(Engine(verifier.lean, _drafter("pretrained", verifier, tiny_pair), 3, 96, rule), reqs)
    for r in reqs:
        tokens, scores = got[r.id]
        if r.logprobs is None:
            assert scores == []
            continue
        seq = r.prompt + tokens
        cache = verifier.lean.new_cache(1, len(seq))
        logits = verifier.lean.forward(cache, torch.tensor([seq])).logits[0, len(r.prompt) - 1 : len(seq) - 1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        assert torch.allclose(torch.tensor([s.logprob for s in scores]), lp[torch.arange(len(tokens)), tokens], atol=1e-4)
        top = lp.topk(max(r.logprobs, 1), dim=-1)
        for j, s in enumerate(scores):
            assert len(s.top) == r.logprobs
            assert [t for t, _ in s.top] == top.indices[j, : r.logprobs].tolist()


def test_logprobs_are_cut_where_eos_a_stop_string_and_max_tokens_cut_the_tokens(verifier, tiny_pair):
    tok = verifier.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    base = _requests(verifier)[0]
    plain = generate(verifier.lean, None, [base.prompt], base.params, 0, StopRule(verifier.eos_ids))[0].token_ids
    text = decode(plain)
    cases = [  # (stop rule, params): each ends the request mid-block at k = 4
        (StopRule(frozenset({plain[5]}), decode), base.params),
        (StopRule(verifier.eos_ids, decode), SamplingParams(max_tokens=len(plain), stop=(text[len(text) // 2:][:2],))),
        (StopRule(verifier.eos_ids, decode), SamplingParams(max_tokens=7)),
    ]
    for rule, params in cases:
        req = EngineRequest("c", base.prompt, params, 4, logprobs=2)
        engine = Engine(verifier.lean, _drafter("ngram", verifier, tiny_pair), 1, 96, rule)
        tokens, scores = _scored(engine, [req])["c"]
        expected = generate(verifier.lean, None, [base.prompt], params, 0, rule)[0].token_ids
        assert tokens == expected and len(tokens) < len(plain)
        assert [s.token_id for s in scores] == tokens


def test_a_step_where_no_row_asked_computes_no_logprobs(verifier, tiny_pair, monkeypatch):
    from specloop.drafter.decode.logprobs import Scoring

    def refuse(*args, **kwargs):
        raise AssertionError("log-probabilities computed for a step where no row asked")

    monkeypatch.setattr(Scoring, "fill", refuse)
    engine = Engine(verifier.lean, _drafter("pretrained", verifier, tiny_pair), 3, 96, StopRule(verifier.eos_ids))
    got = _scored(engine, _requests(verifier)[:4])
    assert len(got) == 4
    with pytest.raises(AssertionError, match="no row asked"):
        engine.admit([_asking(_requests(verifier)[0], 2, 0)])
        engine.step()


def test_steps_left_plain_verify_free_drafts_and_stay_exact(verifier):
    """A controller that never drafts still gets the suffix drafter's free drafts verified (`lookup`),
    cut by its gate; greedy output stays the verifier's, and the lookups teach the calibration only."""
    rule, tok = StopRule(verifier.eos_ids), verifier.tokenizer
    text = "one two three four five one two three four five one two three four five one two"
    params = SamplingParams(0.0, 0, 1.0, 24, (), 0)
    requests = [EngineRequest(f"g{i}", tok.encode(t, add_special_tokens=False), params, None, 0)
                for i, t in enumerate([text, "hello world", text + " three"])]
    want = {r.id: generate(verifier.lean, None, [r.prompt], r.params, 0, rule)[0].token_ids for r in requests}
    drafted = {}
    for lookups in (True, False):
        controller = Scripted([0])
        engine = Engine(verifier.lean, SuffixDrafter(verifier.vocab_size), slots=2, capacity=96, stop_rule=rule,
                        controller=controller, lookups=lookups)
        got, ks = {}, []
        waiting = list(requests)
        while waiting or engine.running:
            if waiting and engine.free:
                engine.admit([waiting.pop(0)])
            for u in engine.step():
                got.setdefault(u.id, []).extend(u.new_tokens)
                ks.append(u.k)
        assert got == want
        drafted[lookups] = sum(ks)
        assert controller.acceptance.trials == [0.0] * 4  # lookups are not the drafter's answers to k
        assert not controller.costs.draft and not controller.costs.offered
    assert drafted[True] > 0 and drafted[False] == 0


def _decode_one(engine: Engine, request: EngineRequest, check=lambda: True) -> tuple[list[int], list[int]]:
    """One request decoded to its end: its tokens and each step's k; `check()` holds after every step."""
    engine.admit([request])
    got, ks = [], []
    while engine.running:
        for u in engine.step():
            got.extend(u.new_tokens)
            ks.append(u.k)
        assert check()
    return got, ks


def test_lookups_verify_past_k_max_within_each_rows_room(verifier):
    """A step left plain verifies up to `lookup_max` free drafts (more than the controller's k_max), never
    past the room a row's cache has left (its capacity is exactly what its request needs); output exact."""
    rule, tok = StopRule(verifier.eos_ids), verifier.tokenizer
    prompt = tok.encode(" ".join(["the cat sat on the mat and looked at the dog"] * 6), add_special_tokens=False)
    params = SamplingParams(0.0, 0, 1.0, 40, (), 0)
    want = generate(verifier.lean, None, [prompt], params, 0, rule)[0].token_ids
    capacity = positions_needed(len(prompt), params.max_tokens, None)
    controller = Scripted([0])
    controller.cfg = ControllerConfig(k_max=4, lookup_max=16)
    controller.cut = lambda confidence, rows, sources=None: [len(c) for c in confidence]  # keep every draft
    engine = Engine(verifier.lean, SuffixDrafter(verifier.vocab_size), slots=1, capacity=capacity, stop_rule=rule,
                    controller=controller)
    got, ks = _decode_one(engine, EngineRequest("r", prompt, params, None, 0),
                          lambda: int(engine.cache.lens[0]) <= capacity)
    assert got == want
    assert max(ks) > controller.cfg.k_max and max(ks) <= controller.cfg.lookup_max


@pytest.mark.parametrize("keep", [False, True])
def test_a_lookup_that_would_verify_nothing_is_left_out_and_the_step_decodes_as_the_verifier_alone(verifier, keep):
    """Where no row's free draft would reach the verify pass (it matched nothing, or the gate cuts it whole), the
    step is the verifier alone's: the same sampled tokens draw for draw (a lookup step draws a drafting step's
    uniforms), nothing timed or observed; the controller still learns each lookup's outcome and backs off after
    cut ones. Where the gate keeps drafts, the lookups are verified as before."""
    rule, tok = StopRule(verifier.eos_ids), verifier.tokenizer
    prompt = tok.encode(" ".join(["the cat sat on the mat and looked at the dog"] * 4), add_special_tokens=False)
    params = SamplingParams(1.0, 0, 1.0, 40, (), 3)
    outcomes, observed = [], []

    class Off(Controller):  # speculation off, no probe ever due; every lookup's drafts cut (or kept) whole
        def choose(self, batch):
            return Choice(0, timed=False)

        def cut(self, confidence, rows, sources=None):
            return [len(c) if keep else 0 for c in confidence]

        def looked_up(self, earned, tried):
            outcomes.append(tried)
            super().looked_up(earned, tried)

        def observe(self, step):
            observed.append(step)
            super().observe(step)

    want = generate(verifier.lean, None, [prompt], params, 0, rule)[0].token_ids
    engine = Engine(verifier.lean, SuffixDrafter(verifier.vocab_size), slots=1,
                    capacity=positions_needed(len(prompt), params.max_tokens, None), stop_rule=rule, controller=Off())
    got, ks = _decode_one(engine, EngineRequest("r", prompt, params, None, 0))
    if keep:
        assert max(ks) > 0 and len(observed) > 0  # verified lookups: timed, observed
        return
    assert got == want and ks == [0] * len(got) and observed == []
    assert True in outcomes and len(outcomes) < len(got) / 2  # cut lookups back off (1, 3, then 4 steps between)


def test_a_verified_lookup_prices_its_drafts_once_and_the_gate_keeps_the_same_cut(verifier):
    """A lookup the pre-check lets through (`_free_drafts_verified`) has its drafts priced once: the step's gate takes
    the pre-check's cut of the same drafts (nothing the controller reads changes in between) instead of pricing them
    again; every verified lookup is cut as the controller's `cut` would cut it, and output stays the verifier's."""
    rule, tok = StopRule(verifier.eos_ids), verifier.tokenizer
    prompt = tok.encode(" ".join(["the cat sat on the mat and looked at the dog"] * 5), add_special_tokens=False)
    params = SamplingParams(0.0, 0, 1.0, 40, (), 0)
    priced, gated = [], []

    class Off(Controller):  # speculation off, no probe due: every step plain, lookups where suffix decoding matches
        def choose(self, batch):
            return Choice(0, timed=False)

        def cut(self, confidence, rows, sources=None):
            keep = [min(len(c), 1 + len(priced) % 3) for c in confidence]  # cuts that differ from one call to the next
            priced.append((confidence, keep))
            return keep

        def cuts(self, confidence, keep, sources=None):
            gated.append((confidence, keep))
            super().cuts(confidence, keep, sources)

    want = generate(verifier.lean, None, [prompt], params, 0, rule)[0].token_ids
    engine = Engine(verifier.lean, SuffixDrafter(verifier.vocab_size), slots=1,
                    capacity=positions_needed(len(prompt), params.max_tokens, None), stop_rule=rule, controller=Off())
    got, ks = _decode_one(engine, EngineRequest("r", prompt, params, None, 0))
    assert got == want and max(ks) > 0
    verified = [k for k in ks if k]
    assert len(gated) == len(verified) and len(priced) == len(verified)  # one price a lookup, the pre-check's
    assert all(g == p for g, p in zip(gated, priced))  # the gate's cut is the one priced, for the same drafts


def test_a_lookup_whose_drafts_were_all_cut_is_told_apart_from_one_that_matched_nothing():
    """The controller backs lookups off after drafts that earned nothing, cut ones included, but looks again one
    step after a lookup that matched nothing (decode.controller `_looked_up`): the engine tells the two apart."""
    from specloop.drafter.decode.engine import lookup_cut
    from specloop.drafter.decode.rejection import BlockOutcome

    plan = StepPlan(torch.tensor([True, True]), 16, SamplingParams(), lookup=True)
    last_only = torch.tensor([[5], [6]])
    none = torch.zeros(2, dtype=torch.long)
    assert lookup_cut(plan, BlockOutcome(last_only, none, drafted=torch.zeros(2, dtype=torch.long)))  # all cut
    assert not lookup_cut(plan, BlockOutcome(last_only, none))  # nothing matched: no lengths at all
    verified = BlockOutcome(torch.tensor([[5, 7], [6, 8]]), none, drafted=torch.tensor([1, 0]))
    assert not lookup_cut(plan, verified)  # a draft was verified: its verdict says what it earned
    assert not lookup_cut(StepPlan(plan.active, 0, SamplingParams()), BlockOutcome(last_only, none))  # not a lookup


def test_each_rows_uniforms_are_its_own_streams_draws_in_the_plans_layout():
    """A row with k drafts takes 2k + 1 draws from its stream (k draft tests, k accept tests, then the emitted token's
    at column kmax); a plain row's one draw goes to column kmax; greedy rows and empty slots hold 0.5."""
    from specloop.drafter.decode.engine import LiveRequest

    def live(seed):
        return LiveRequest(None, 0, None, make_generators(seed, 1)[0])  # type: ignore[arg-type]

    rows = [live(1), live(2), None, LiveRequest(None, 3, None, None)]  # type: ignore[arg-type]
    u_draft, u_accept = Engine._uniforms(rows, [2, 0, 0, 0], 2)
    first, second = make_generators(1, 1)[0], make_generators(2, 1)[0]
    drawn = torch.rand(5, generator=first)
    assert torch.equal(u_draft[0], drawn[:2]) and torch.equal(u_accept[0], drawn[2:])
    plain = torch.rand(1, generator=second)
    assert torch.equal(u_accept[1], torch.tensor([0.5, 0.5, float(plain)]))
    assert bool((u_draft[1:] == 0.5).all()) and bool((u_accept[2:] == 0.5).all())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_rows_own_free_draft_outcomes_are_its_requests_and_leave_with_it(verifier, temperature):
    # the served default's mix: suffix decoding's verified drafts teach the controller the row's (slot's) own
    # evidence beside its calibration, read while the request runs and dropped when it leaves the slot
    seen, during, keys = [], [], set()

    class Watching(Controller):
        def observe(self, step):
            seen.extend(row for row in step.confident if speculator_of(row[2]) == "suffix")
            keys.update(row[2] for row in step.confident)
            during.append(set(self.rows))
            super().observe(step)

    rule = StopRule(())
    reqs = [EngineRequest(r.id, r.prompt, replace(r.params, temperature=temperature, seed=1), None, r.stream)
            for r in _requests(verifier, max_tokens=60) if r.params.greedy][:2]
    controller = Watching()
    engine = Engine(verifier.lean, _mix(verifier, {"adaptive": 0, "suffix": 0}), slots=2, capacity=128,
                    stop_rule=rule, controller=controller)
    slots = dict(zip((r.id for r in reqs), engine.admit(reqs)))
    got: dict[str, list[int]] = {}
    while engine.running:
        for u in engine.step():
            got.setdefault(u.id, []).extend(u.new_tokens)
    # every verified suffix draft: its row's (None: the step its request finished in, after which the slot is free)
    rows = {row[4] for row in seen} - {None}
    assert rows <= set(slots.values()) and rows and (temperature > 0 or rows == set(slots.values()))
    assert any(during) and controller.rows == {}  # kept while the requests ran; gone with them
    # the calibration a row's drafts teach: its speculator's, apart where it samples
    assert {speculator_of(k) for k in keys} <= {"suffix", "adaptive"} and all(k.endswith("@sampled") == (
        temperature > 0) for k in keys if k is not None)
    for r in reqs if not temperature else ():  # and greedy output is the verifier's
        assert got[r.id] == generate(verifier.lean, None, [r.prompt], r.params, 0, rule)[0].token_ids


def test_a_probe_verifies_the_drafts_it_chose_whatever_the_gate_would_cut(verifier, tiny_pair):
    # a probe measures the pass it chose: cut by the estimates it is to check (one outlier r(2), a stalled pass of
    # 3.2 plain passes, cut every later probe's draft and was never measured again), it would measure nothing
    class CutsAll(Controller):
        def __init__(self):
            super().__init__(ControllerConfig(k_max=4))
            self.calls = 0

        def choose(self, batch):
            self.calls += 1
            return Choice(2, probe=self.calls % 2 == 0)

        def cut(self, confidence, rows, sources=None):
            return [0] * len(confidence)

    rule = StopRule(())
    req = _auto([r for r in _requests(verifier, max_tokens=12) if r.params.greedy][:1])[0]
    engine = Engine(verifier.lean, _drafter("eagle", verifier, tiny_pair), slots=1, capacity=96, stop_rule=rule,
                    controller=CutsAll())
    engine.admit([req])
    verified = []
    while engine.running:
        probe = engine.controller.calls % 2 == 1  # the next choice's
        verified += [(probe, u.k) for u in engine.step()]
    assert {k for probe, k in verified if probe} == {2} and {k for probe, k in verified if not probe} == {0}
