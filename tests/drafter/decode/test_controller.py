"""The cost-aware controller: synthetic acceptance and step times in, draft lengths out (no clock, no models)."""
from __future__ import annotations

import copy

import pytest

from specloop.drafter.decode.controller import (
    Acceptance,
    Batch,
    Calibration,
    Controller,
    ControllerConfig,
    Costs,
    Ewma,
    StepSample,
    bucket,
    calibrated_as,
    expected_tokens,
    speculator_of,
)

PLAIN_S, OVERHEAD_S = 0.010, 0.001


def verify_time(T: int, rows: int = 1, slope: float = 0.05, batch_slope: float = 0.0) -> float:
    """A verify pass that costs PLAIN_S at T = 1 and `slope` more per extra token per row; with a batch, each
    row adds `batch_slope` to that marginal cost (big batches leave no idle compute)."""
    return PLAIN_S * rows ** 0.5 * (1 + (slope + batch_slope * (rows - 1)) * (T - 1))


def run(controller: Controller, steps: int, accepted, rows: int = 1, draft_s: float = 0.0005,
        slope: float = 0.05, batch_slope: float = 0.0, choices: list | None = None) -> list[int]:
    """Drive the controller through `steps` steps of a batch of auto rows; accepted(k) = drafts accepted per row.
    As the engine does, a step the controller leaves untimed is not observed (`choices` gets every Choice)."""
    chosen = []
    for _ in range(steps):
        choice = controller.choose(Batch(rows, rows))
        k = choice.k
        n = min(k, accepted(k))
        if choice.timed:
            controller.observe(StepSample(rows, k, draft_s * k, verify_time(k + 1, rows, slope, batch_slope),
                                          OVERHEAD_S, ((k, n),) * rows if k else ()))
        chosen.append(k)
        if choices is not None:
            choices.append(choice)
    return chosen


def test_expected_tokens_is_one_plus_the_products_of_conditional_acceptance():
    assert expected_tokens([0.5, 0.5, 1.0], 0) == 1
    assert expected_tokens([0.5, 0.5, 1.0], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert expected_tokens([1.0] * 4, 4) == 5


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_acceptance_counts_only_the_positions_a_block_tried():
    acc = Acceptance(ControllerConfig(prior_strength=0.0, acceptance_decay=1.0))
    acc.observe(4, 1)  # position 1 accepted, 2 rejected, 3 and 4 never tried
    acc.observe(4, 4)
    assert acc.trials == [2, 2, 1, 1] and acc.hits == [2, 1, 1, 1]
    assert acc.rates() == [1.0, 0.5, 1.0, 1.0]


def test_untried_positions_inherit_a_discounted_prior():
    cfg = ControllerConfig()
    rates = Acceptance(cfg).rates()
    assert rates[0] == cfg.prior_acceptance
    assert rates[1:] == pytest.approx([cfg.prior_acceptance * cfg.depth_discount ** i for i in range(1, cfg.k_max)])


def test_rarely_accepted_drafts_keep_the_verifier_alone_and_probes_are_rare():
    c = Controller()
    chosen = run(c, 2000, accepted=lambda k: 0)
    probes = [i for i, k in enumerate(chosen) if k]
    assert len(probes) <= 2000 // c.cfg.explore_min
    starts = [i for i in probes if i - 1 not in probes]  # a probe of a new shape is probed again at once
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= c.cfg.explore_max  # backs off up to the longest interval
    assert sum(chosen[1000:]) <= 1000 // c.cfg.explore_max * c.cfg.k_max
    assert c.choose(Batch(1, 1)).k == 0


def test_a_controller_that_left_speculation_off_times_only_the_steps_before_a_probe():
    # where speculation is off, a plain step costs the host a choice and nothing more: no clock, nothing observed,
    # but for the last side_by_side steps before each probe (its plain reference); the probes come as before
    c, choices = Controller(), []
    chosen = run(c, 2000, accepted=lambda k: 0, choices=choices)
    plain = [x for x in choices if not x.k]
    assert sum(x.timed for x in plain) < 0.1 * len(plain)
    assert all(x.timed for x in choices if x.k)
    probes = [i for i, x in enumerate(choices) if x.probe and x.k]
    assert len(probes) >= 6
    for i in probes:  # a timed plain step within side_by_side steps before every probe
        assert any(choices[j].timed and not choices[j].k for j in range(max(0, i - c.cfg.side_by_side), i))
    # timing every step changes no choice
    every = Controller()
    for k in chosen:
        assert every.choose(Batch(1, 1)).k == k
        every.observe(StepSample(1, k, 0.0005 * k, verify_time(k + 1), OVERHEAD_S, ((k, 0),) if k else ()))
    paying: list = []
    run(Controller(), 200, accepted=lambda k: k, choices=paying)
    assert all(x.timed for x in paying[20:])  # where drafting pays, every step is timed


def test_the_steps_a_quiet_choice_leaves_plain_are_chosen_without_the_rule_and_as_the_rule_chooses_them():
    # a choice that left the step plain and untimed says how many after it will be (nothing they decide on changes
    # unobserved): those are answered without evaluating, and exactly as the whole rule answers them
    fast, full, evaluated = Controller(), Controller(), []
    original = Controller._evaluate
    fast._evaluate = lambda batch: evaluated.append(1) or original(fast, batch)
    one, two = Batch(1, 1), Batch(2, 2)
    for i in range(3000):
        batch = one if (i // 500) % 2 == 0 else two  # a request joins, then leaves: another batch
        full._quiet = None
        got, want = fast.choose(batch), full.choose(batch)
        assert got == want, i
        if got.timed:
            for c in (fast, full):
                c.observe(StepSample(batch.rows, got.k, 0.0005 * got.k, verify_time(got.k + 1, batch.rows),
                                     OVERHEAD_S, ((got.k, 0),) * batch.rows if got.k else ()))
    assert len(evaluated) < 0.2 * 3000
    fast.drafter_swapped()  # a new drafter: probed soon, not after the quiet run it was in
    assert fast._quiet is None


def test_a_probe_of_a_new_verify_shape_is_probed_again_so_its_one_time_costs_do_not_keep_drafting_off():
    # host-bound steps (the graph backend): a drafting step's overhead is 2.7x a plain one's, every draft is
    # accepted, and the first step of each verify shape costs 1.5-3x (first calls): drafting at k = 4 pays 1.7x.
    # A probe of a new shape is probed again at once, so a lower second sample replaces the first
    for first_cost in (1.5, 3.0):
        c, seen, chosen = Controller(), set(), []
        c.verify_at_one_width()
        for i in range(800):
            choice = c.choose(Batch(1, 1))
            k = choice.k
            wobble = 1 + 0.1 * ((i * 7919) % 13 - 6) / 6  # ±10 %, deterministic
            verify, overhead = 80e-6 * (1 + 0.3 * k) * wobble, (160e-6 if k else 60e-6) * wobble
            if k + 1 not in seen:
                seen.add(k + 1)
                verify, overhead = verify * first_cost, overhead * first_cost
            if choice.timed:
                c.observe(StepSample(1, k, 20e-6 * k, verify, overhead, ((k, k),) if k else ()))
            chosen.append(k)
        assert sum(k == c.cfg.k_max for k in chosen[-200:]) >= 190, (first_cost, chosen[:80])


def test_a_drafter_whose_block_costs_one_call_whatever_k_is_probed_deep_and_drafts_where_that_pays():
    # a captured chain drafts k_max tokens for one call's cost (the eagle head's on the graph backend): 2 plain
    # passes whatever k. One draft never pays for that; four do (1.9x). Priced from k = 1 alone (four times
    # its cost) the controller never tried k = 4; it probes the deepest k once another was measured
    c, chosen = Controller(), []
    c.verify_at_one_width()
    for i in range(600):
        choice = c.choose(Batch(1, 1))
        k = choice.k
        wobble = 1 + 0.1 * ((i * 7919) % 13 - 6) / 6
        if choice.timed:
            c.observe(StepSample(1, k, 200e-6 * wobble if k else 0.0, 100e-6 * wobble,
                                 (80e-6 if k else 50e-6) * wobble, ((k, k),) if k else ()))
        chosen.append(k)
    assert sum(k == c.cfg.k_max for k in chosen[-300:]) >= 295  # a plain step now and then: the reference
    assert c.costs.draft_cost(2, 1) == pytest.approx(c.costs.draft_cost(c.cfg.k_max, 1), rel=0.2)  # flat, learned


def test_drafting_costs_are_interpolated_between_measured_k_and_scaled_beyond():
    costs = Costs(ControllerConfig())
    assert costs.draft_cost(3, 1) == pytest.approx(3 * costs.cfg.prior_draft_ratio)  # nothing measured: per token
    costs.plain[1] = (0, 1.0)
    for k, seconds in ((1, 0.3), (4, 0.6)):  # a fixed 0.2 and 0.1 per token
        costs.steps = 1
        costs.observe(StepSample(1, k, seconds, 1.0, 0.0))
    assert costs.draft_cost(2, 1) == pytest.approx(0.4) and costs.draft_cost(3, 1) == pytest.approx(0.5)
    assert costs.draft_cost(8, 1) == pytest.approx(1.2)  # beyond the deepest: in proportion to it


def test_steps_nothing_observes_reuse_the_last_evaluation():
    # an untimed step changes no estimate: choosing the next one evaluates nothing again (a choice costs µs)
    evaluations = []

    class Counting(Controller):
        def rates(self, batch):
            evaluations.append(batch)
            return super().rates(batch)

    c, choices = Counting(), []
    run(c, 2000, accepted=lambda k: 0, choices=choices)
    observed = sum(x.timed for x in choices)
    assert observed < 300 and len(evaluations) <= observed // c.cfg.refresh + sum(1 for x in choices if x.k) + 2


def test_high_acceptance_with_a_cheap_verify_pass_drafts_the_most():
    c = Controller()
    chosen = run(c, 200, accepted=lambda k: k)
    assert chosen[-50:] == [c.cfg.k_max] * 50
    assert c.choose(Batch(1, 1)).speedup > 2


def test_a_costlier_verify_pass_at_a_larger_batch_drafts_less():
    def settle(rows: int) -> int:
        c = Controller()
        return run(c, 400, accepted=lambda k: min(k, 2), rows=rows, batch_slope=0.2)[-1]

    alone, batched = settle(1), settle(8)
    assert alone >= 2 and batched < alone


def test_speculation_that_wins_by_less_than_the_margin_is_not_chosen():
    c = Controller(ControllerConfig(margin=0.03, prior_strength=1.0))
    for _ in range(5):
        c.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
        c.observe(StepSample(1, 1, 0.0, 0.0122, 0.0, ((1, 1),)))  # k = 1 ...
    for _ in range(200):
        c.acceptance.observe(1, 0)
        c.acceptance.observe(1, 0)
        c.acceptance.observe(1, 0)
        c.acceptance.observe(1, 1)
    rates = c.rates(Batch(1, 1))
    assert 1.0 < rates[1] / rates[0] < 1.03  # ... at 1.22× the time with a ≈ 0.25: ~1.02× faster
    assert c.choose(Batch(1, 1)).k == 0


def test_explicit_rows_set_a_floor_the_auto_rows_ride_on_for_free():
    c = Controller()
    run(c, 50, accepted=lambda k: 0)
    assert c.choose(Batch(1, 1)).k == 0
    assert c.choose(Batch(3, 2, (3,))).k == 3  # the pass is 4 tokens long anyway
    assert c.choose(Batch(3, 2, (9,))).k == c.cfg.k_max  # never beyond what an auto row reserved


def test_exploration_resumes_after_a_drafter_swap_and_old_acceptance_fades():
    c = Controller()
    run(c, 300, accepted=lambda k: 0)
    before = c.acceptance.rates()[0]
    c.drafter_swapped()
    assert c.acceptance.rates()[0] > before  # towards the prior
    chosen = run(c, c.cfg.explore_min + 1, accepted=lambda k: k)
    assert any(chosen)
    chosen = run(c, 100, accepted=lambda k: k)
    assert chosen[-1] == c.cfg.k_max  # the new drafter pays: speculation is back on


def test_speculation_turns_off_when_acceptance_collapses():
    c = Controller()
    assert run(c, 200, accepted=lambda k: k)[-1] == c.cfg.k_max
    assert run(c, 300, accepted=lambda k: 0)[-20:] == [0] * 20


def test_a_new_batch_bucket_is_measured_within_the_shortest_interval():
    c = Controller()
    run(c, 2000, accepted=lambda k: 0)  # long intervals at batch 1
    chosen = run(c, c.cfg.explore_min + 1, accepted=lambda k: 0, rows=8)
    assert any(chosen)


def test_the_same_inputs_give_the_same_choices():
    pattern = lambda k: [0, 1, 3, 1, 2][k % 5]  # noqa: E731
    assert run(Controller(), 500, pattern) == run(Controller(), 500, pattern)


def test_unmeasured_verify_shapes_are_scaled_from_measured_ones():
    costs = Costs(ControllerConfig(prior_verify_slope=0.5, prior_draft_ratio=0.3))
    assert costs.ratio_of(1, 1) == 1 and costs.ratio_of(3, 1) == pytest.approx(2.0)  # the prior slope
    assert costs.draft_of(1) == pytest.approx(0.3)  # drafting: a share of a plain pass
    costs.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    costs.observe(StepSample(1, 2, 0.0, 0.012, 0.0))  # side by side with the plain pass: r(3) = 1.2
    assert costs.ratio_of(3, 1) == pytest.approx(1.2)
    assert costs.ratio_of(2, 1) == pytest.approx(1.1)  # between two measured shapes
    assert costs.ratio_of(5, 1) == pytest.approx(1.4)  # beyond: the measured slope
    assert costs.ratio_of(3, 4) == pytest.approx(1 + 0.1 * 2 * 2)  # a larger batch: steeper by sqrt(4)


def test_a_controller_told_its_steps_verify_at_one_width_expects_flat_verify_costs_until_measured():
    controller = Controller(ControllerConfig(prior_verify_slope=0.5))
    assert controller.costs.ratio_of(5, 1) == pytest.approx(3.0)  # the prior slope
    controller.verify_at_one_width()
    assert controller.costs.ratio_of(5, 1) == 1.0
    controller.reset()  # forgets estimates, not how its steps are run
    assert controller.costs.ratio_of(5, 1) == 1.0
    controller.costs.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    controller.costs.observe(StepSample(1, 4, 0.0, 0.011, 0.0))  # measured: what it learns wins
    assert controller.costs.ratio_of(5, 1) == pytest.approx(1.1)


def test_ratios_are_learned_only_beside_a_plain_step():
    costs = Costs(ControllerConfig(side_by_side=2))
    costs.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    for _ in range(3):
        costs.observe(StepSample(1, 1, 0.0, 0.011, 0.0))
    assert costs.ratio[(2, 1)].n == 2  # the third came too late after the plain step
    assert costs.stale(1, 3) and not costs.stale(1, 5) and costs.stale(8, 100)


def test_a_machine_wide_slowdown_while_drafting_does_not_make_plain_steps_look_cheaper():
    c = Controller(ControllerConfig(prior_strength=1.0))
    for _ in range(20):  # side by side: plain 10 ms, a 2-token pass 11 ms, drafting 2 ms
        c.observe(StepSample(1, 0, 0.0, 0.010, 0.001))
        c.observe(StepSample(1, 1, 0.002, 0.011, 0.001, ((1, 1),)))
    before = c.costs.step_cost(1, 1) / c.costs.step_cost(0, 1)
    for _ in range(c.cfg.side_by_side):
        c.observe(StepSample(1, 1, 0.002, 0.011, 0.001, ((1, 1),)))
    for _ in range(100):  # then only drafting steps, on a machine twice as slow
        c.observe(StepSample(1, 1, 0.004, 0.022, 0.002, ((1, 1),)))
    assert c.costs.step_cost(1, 1) / c.costs.step_cost(0, 1) == pytest.approx(before, rel=0.01)
    assert c.costs.ratio_of(2, 1) == pytest.approx(1.1)


def test_while_drafting_pays_a_plain_step_now_and_then_refreshes_the_reference():
    c = Controller()
    chosen = run(c, 1200, accepted=lambda k: k)
    plain = [i for i, k in enumerate(chosen) if k == 0 and i > 100]
    assert plain and len(plain) <= 1100 // c.cfg.explore_max + 1


def test_a_lower_second_sample_replaces_a_first_that_carried_one_time_costs():
    e = Ewma()
    e.add(1.0, 0.9)
    e.add(0.1, 0.9)
    assert e.value == 0.1
    e.add(0.2, 0.9)
    assert 0.1 < e.value < 0.2


def test_the_plain_reference_is_two_passes_so_a_costly_first_step_does_not_make_drafting_look_cheap():
    # measured on the graph backend (bench/host_step.py): an engine's first step costs ~2x a later plain one;
    # priced against it alone, an eagle head whose drafts were never accepted kept drafting every step
    c = Controller()
    c.verify_at_one_width()
    first = StepSample(1, 0, 0.0, 0.020, 0.020)  # the first step: one-time costs in its pass and in the rest
    later = StepSample(1, 0, 0.0, 0.010, 0.010)
    assert c.choose(Batch(1, 1)).k == 0
    c.observe(first)
    assert c.choose(Batch(1, 1)).k == 0  # the priors alone would draft now (flat verify, acceptance 0.4)
    c.observe(later)
    assert c.costs.plain[1][1] == 0.010 and c.costs.overhead[(False, 1)].value == 1.0  # the second replaced it
    chosen = []
    for _ in range(200):  # drafts never accepted; a drafting step costs its drafts and more bookkeeping
        k = c.choose(Batch(1, 1)).k
        c.observe(StepSample(1, k, 0.002 * k, 0.010, 0.013 if k else 0.010, ((k, 0),) if k else ()))
        chosen.append(k)
    assert sum(1 for k in chosen if k) <= 6  # probes only
    assert c.costs.samples(False, 1) >= 190


def test_config_is_checked():
    with pytest.raises(ValueError):
        ControllerConfig(k_max=0)
    with pytest.raises(ValueError):
        ControllerConfig(explore_min=32, explore_max=16)



def test_a_costly_switch_to_drafting_makes_exploration_wait_longer():
    def probes(resync_s: float) -> int:
        c = Controller()
        chosen = []
        for _ in range(1000):
            k = c.choose(Batch(1, 1)).k
            c.observe(StepSample(1, k, 0.001 * k, verify_time(k + 1), OVERHEAD_S, ((k, 0),) if k else (),
                                 resync_s if k else 0.0))
            chosen.append(k)
        return sum(1 for k in chosen if k)

    assert probes(0.030) < probes(0.0)  # restarting the drafter's rows costs 3 plain passes


def test_a_self_limiting_drafter_is_costed_by_what_it_really_drafts():
    """Asked for 4, a suffix drafter that drafts 1 on average costs a 2-token verify pass, not a 5-token one;
    its acceptance counts what asking 4 earned (untried positions are misses)."""
    costs = Costs(ControllerConfig())
    costs.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    costs.observe(StepSample(1, 1, 0.0, 0.011, 0.0, asked=4))  # side by side: r(2) = 1.1
    costs.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    costs.observe(StepSample(1, 4, 0.0, 0.018, 0.0))  # a full draft: r(5) = 1.8
    limited = Costs(ControllerConfig())
    for step in (StepSample(1, 0, 0.0, 0.010, 0.0), StepSample(1, 1, 0.0, 0.011, 0.0, asked=4)):
        limited.observe(step)
    assert limited.offered_of(4, 1) == 1.0 and costs.offered_of(4, 1) == pytest.approx(2.5)
    assert limited.step_cost(4, 1) < costs.step_cost(4, 1)
    assert limited.verify_shape(4, 1) == 2 and limited.measured(4, 1)
    c = Controller()
    c.observe(StepSample(1, 1, 0.0, 0.011, 0.0, ((4, 1),), asked=4))
    assert c.acceptance.trials[:3] == [1.0, 1.0, 0.0] and c.acceptance.hits[:2] == [1.0, 0.0]


def test_a_cheap_self_limiting_drafter_that_is_right_when_it_drafts_is_turned_on():
    """Drafts on one step in two (1 token, always accepted), nearly free to ask: speculation pays and stays on."""
    c, chosen, step = Controller(), [], 0
    for step in range(400):
        k = c.choose(Batch(1, 1)).k
        drafted = min(k, 1) if step % 2 else 0
        c.observe(StepSample(1, drafted, 0.00002 * k, verify_time(drafted + 1, slope=0.2), OVERHEAD_S,
                             ((k, drafted),) if k else (), asked=k))
        chosen.append(k)
    assert sum(k > 0 for k in chosen[200:]) > 150


def test_confidence_cuts_each_row_to_the_prefix_worth_its_verify_pass():
    """r(T) = 1 + 0.25 (T − 1): a draft is worth its place only while its acceptance probability beats
    the marginal cost of a longer verify pass."""
    c = Controller()
    c.costs.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    c.costs.observe(StepSample(1, 4, 0.0, 0.020, 0.0))  # side by side: r(5) = 2.0, slope 0.25
    sure, unsure, mixed = [1.0, 1.0, 1.0, 1.0], [0.1, 0.01, 0.001, 0.0001], [0.9, 0.8, 0.1, 0.05]
    assert [c.cut([row], rows=1) for row in (sure, unsure, mixed, [])] == [[4], [0], [2], [0]]
    # one pass for a batch: as wide as the batch gains from (7.81 tokens for 1.5 at W = 2, 9.96 for 2.0 at
    # W = 4), and within it every row keeps its drafts
    assert c.cut([sure, unsure, mixed, []], rows=1) == [2, 2, 2, 0]


def test_one_rows_draft_widens_a_batchs_pass_only_where_the_batch_gains():
    """Alone, a draft with P = 0.6 pays for r(2) = 1.25; beside seven rows with nothing to verify it does
    not: 8.6 tokens for 1.25 plain passes is less than 8 for one."""
    c = Controller()
    for rows in (1, 8):
        c.costs.observe(StepSample(rows, 0, 0.0, 0.010, 0.0))
        c.costs.observe(StepSample(rows, 4, 0.0, 0.020, 0.0))  # r(5) = 2.0 at both buckets: r(2) = 1.25
    assert c.cut([[0.6]], rows=1) == [1]
    assert c.cut([[0.6]] + [[]] * 7, rows=8) == [0] * 8
    assert c.cut([[0.6]] * 8, rows=8) == [1] * 8  # every row gains: 12.8 tokens for 1.25


def test_the_confidence_calibration_follows_what_confident_drafts_earn():
    c = Controller(ControllerConfig(calibration_decay=1.0))
    for _ in range(10):  # predicted 2 accepted drafts per block, earned 1
        c.observe(StepSample(1, 2, 0.0, 0.012, 0.0, ((2, 1),), confident=((2.0, 1),)))
    assert c.confidence_scale() == pytest.approx((1 + 10) / (1 + 20))
    c.costs.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    c.costs.observe(StepSample(1, 2, 0.0, 0.018, 0.0))  # r(3) = 1.8: r(2) = 1.4
    assert c.cut([[0.5, 0.25]], rows=1) == [0]  # 0.5 predicted is ~0.26 earned: not worth r(2)
    assert c.cut([[0.5, 0.25]], rows=1, sources=["suffix"]) == [1]  # another speculator's, taken at its word:
    #                                                               1.5 tokens for 1.4 would pay
    c.calibrations[None] = Calibration()
    assert c.cut([[0.5, 0.25]], rows=1) == [1]


def test_each_speculator_is_calibrated_on_its_own_drafts():
    """A mix's rows carry their speculator: one that over-promises does not make the other's drafts look worse."""
    c = Controller(ControllerConfig(calibration_decay=1.0))
    for _ in range(10):
        c.observe(StepSample(2, 2, 0.0, 0.012, 0.0, confident=((2.0, 0, "adaptive"), (1.0, 1, "suffix"))))
    assert c.confidence_scale("adaptive") == pytest.approx(1 / 21)
    assert c.confidence_scale("suffix") == pytest.approx(11 / 11)
    c.drafter_swapped()  # a new served version: its calibration starts over, suffix decoding's is kept
    assert c.calibration("adaptive").predicted == pytest.approx(21 * ControllerConfig().swap_keep)
    assert c.calibration("suffix").predicted == pytest.approx(11)


def test_a_cheap_drafter_is_probed_at_the_shortest_interval():
    c, chosen = Controller(), []
    for _ in range(300):  # a lookup that costs 1 % of a plain pass and never helps
        k = c.choose(Batch(1, 1)).k
        c.observe(StepSample(1, 0, 0.0001 * k, PLAIN_S, OVERHEAD_S, ((k, 0),) if k else (), asked=k))
        chosen.append(k)
    gaps = [i for i, k in enumerate(chosen) if k]
    assert len(gaps) >= 300 // (ControllerConfig().explore_min + 2)  # never backs off to explore_max


def test_lookups_that_earn_nothing_back_off_and_one_that_earns_brings_the_next_at_once():
    c = Controller(ControllerConfig(lookup_backoff=4))
    pattern = []
    for _ in range(16):
        due = c.lookup_due()
        pattern.append(due)
        if due:  # a lookup step whose verified draft was rejected
            c.observe(StepSample(1, 1, 0.0, 0.01, 0.0, confident=((0.5, 0),), lookup=True))
        else:
            c.observe(StepSample(1, 0, 0.0, 0.01, 0.0))
    assert pattern == [True, False, True, False, False, False, True, False, False, False, False, True,
                       False, False, False, False]
    assert c.lookup_misses == 4 and c.lookup_due()  # the wait stays at lookup_backoff
    c.observe(StepSample(1, 1, 0.0, 0.01, 0.0, confident=((0.5, 1),), lookup=True))
    assert c.lookup_due() and c.lookup_due()  # after one that earned: every step


def test_a_lookup_that_matched_nothing_waits_one_step_and_one_the_gate_cut_backs_off():
    """No draft matched: in grounded text a copy may start at the next token, so the next lookup comes soon. Drafts
    the gate cut, every one (their confidence does not pay: sampled text at T >= 1): back off as rejected ones do
    (every other step before, 4 % of a step's time each on the fetched pair)."""
    for cut, want in ((False, [True, False] * 6),
                      (True, [True, False, True, False, False, False, True, False, False, False, False, True])):
        c, pattern = Controller(ControllerConfig(lookup_backoff=4)), []
        for _ in range(12):
            due = c.lookup_due()
            pattern.append(due)
            c.observe(StepSample(1, 0, 0.0, 0.01, 0.0, lookup=due, cut=due and cut))
        assert pattern == want and c.lookup_misses == (4 if cut else 0)


def test_a_long_sure_draft_is_cut_where_that_speculators_drafts_stop_being_accepted():
    """P_i = 1 for 16 tokens (a unique continuation) is worth 16 drafts only if drafts that deep earn:
    the gate caps c · P_i by Π a_j, the speculator's own per-position acceptance."""
    c = Controller(ControllerConfig(calibration_decay=1.0))
    c.costs.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    c.costs.observe(StepSample(1, 4, 0.0, 0.018, 0.0))  # r(5) = 1.8: 0.2 a token
    for _ in range(200):  # 8 drafts verified, predicted as earned: "copy" all 8 accepted, "guess" always 2
        c.observe(StepSample(2, 8, 0.0, 0.03, 0.0, confident=((8.0, 8, "copy", 8), (2.0, 2, "guess", 8))))
    assert c.confidence_scale("guess") == pytest.approx(1.0)  # one scalar cannot tell them apart
    sure = [[1.0] * 16]
    assert c.cut(sure, rows=1, sources=["copy"]) == [16]
    assert c.cut(sure, rows=1, sources=["guess"]) == [2]


def chat_taught_suffix(cfg: ControllerConfig | None = None) -> Controller:
    """A controller whose suffix calibration earlier requests taught low (~0.25: their drafts mostly failed), with
    r(T) = 1 + 0.4 (T − 1): a draft pays there only at c · P > 0.4 a token."""
    c = Controller(cfg or ControllerConfig(calibration_decay=1.0))
    for rows in (1, 2):
        c.costs.observe(StepSample(rows, 0, 0.0, 0.010, 0.0))
        c.costs.observe(StepSample(rows, 4, 0.0, 0.026, 0.0))  # r(5) = 2.6
    for _ in range(50):  # other requests' rows (row 3, since left), predicted 2 and earned 0.5 a draft
        c.observe(StepSample(1, 2, 0.0, 0.018, 0.0, confident=((2.0, 0, "suffix", 2, 3), (2.0, 1, "suffix", 2, 3)),
                             lookup=True))
    c.row_left(3)
    assert c.confidence_scale("suffix") == pytest.approx(51 / 201)
    return c


def test_a_requests_first_sure_free_draft_is_tried_whatever_other_requests_taught():
    """A suffix calibration learned on chat cut every draft of a later request that copies its prompt, and, as a cut
    draft is never verified, learned nothing more (bench/README.md section 53): a row's first draft promising two
    tokens is verified at the speculator's word; one promising less is judged by the calibration."""
    c = chat_taught_suffix()
    sure = [1.0, 1.0, 1.0]
    assert c.cut([sure], rows=1, sources=["suffix"]) == [3]
    assert c.cut([[1.0]], rows=1, sources=["suffix"]) == [0]  # promises one token: the calibration's cut
    c.calibrations[None] = c.calibration("suffix")
    assert c.cut([sure], rows=1) == [0]  # the drafter's own drafts (drafting paid for them): its calibration
    old = chat_taught_suffix(ControllerConfig(calibration_decay=1.0, per_request=frozenset()))
    assert old.cut([sure], rows=1, sources=["suffix"]) == [0]  # judged by the other requests alone: cut


def test_a_rows_own_outcomes_weigh_beside_its_speculators_calibration():
    c = chat_taught_suffix()
    for _ in range(3):  # row 0 copies its prompt: every verified draft accepted
        c.observe(StepSample(2, 2, 0.0, 0.018, 0.0, confident=((2.0, 2, "suffix", 2, 0),), lookup=True))
    assert c.cut([[1.0], [1.0]], rows=2, sources=["suffix"] * 2) == [1, 1]  # one pass for both: row 0 pays for it
    assert c.cut([[], [1.0]], rows=2, sources=["suffix"] * 2) == [0, 0]  # row 1 alone: the calibration's 0.25
    c.row_left(0)  # its request left: the next one in the slot starts from the calibration
    assert c.cut([[1.0], []], rows=2, sources=["suffix"] * 2) == [0, 0]


def test_a_row_tries_again_after_cuts_and_waits_twice_as_long_after_each_try_that_earned_nothing():
    c, sure = chat_taught_suffix(), [[1.0, 1.0]]

    def gate() -> int:
        keep = c.cut(sure, rows=1, sources=["suffix"])
        c.cuts(sure, keep, ["suffix"])
        if keep[0]:  # verified: nothing accepted
            c.observe(StepSample(1, keep[0], 0.0, 0.018, 0.0, confident=((2.0, 0, "suffix", 2, 0),), lookup=True))
        return keep[0]

    tried = [i for i in range(60) if gate()]
    retry = ControllerConfig().row_retry
    assert tried == [0, retry + 1, 3 * retry + 2, 7 * retry + 3]  # 8 cuts, then 16, then 32 between tries
    for _ in range(2):  # a try that earns resets the wait
        c.observe(StepSample(1, 2, 0.0, 0.018, 0.0, confident=((2.0, 2, "suffix", 2, 0),), lookup=True))
    assert c.rows[0]["suffix"].retry == retry and c.rows[0]["suffix"].cuts == 0


def test_rows_that_sample_are_calibrated_apart_from_greedy_ones():
    """A drafted token is taken from a row that samples with the probability the verifier gives it, not whenever it is
    the verifier's choice: one calibration for both verified sampled chat's lookups at a loss after greedy grounded
    requests had raised it (bench/README.md section 53)."""
    key = calibrated_as("suffix", True)
    assert key != "suffix" and speculator_of(key) == "suffix" and calibrated_as("suffix", False) == "suffix"
    assert speculator_of(calibrated_as(None, True)) is None and speculator_of(None) is None
    c = chat_taught_suffix()  # greedy rows' suffix drafts earned a quarter of what they promised
    for _ in range(50):  # sampled rows' earned all of it
        c.observe(StepSample(1, 2, 0.0, 0.018, 0.0, confident=((2.0, 2, key, 2, 3),), lookup=True))
    c.row_left(3)
    assert c.confidence_scale("suffix") == pytest.approx(51 / 201) and c.confidence_scale(key) == pytest.approx(1.0)
    assert c.cut([[1.0]], rows=1, sources=[key]) == [1] and c.cut([[1.0]], rows=1, sources=["suffix"]) == [0]
    c.observe(StepSample(1, 2, 0.0, 0.018, 0.0, confident=((2.0, 2, key, 2, 0),), lookup=True))
    assert set(c.rows[0]) == {key}  # a request's own evidence: as its rows are keyed (a row samples or not)


def test_steady_drafting_prices_the_step_costs_once_per_refresh_and_reweighs_the_acceptance_every_step(monkeypatch):
    # pricing S(k) for every k on every drafting step cost the host ~0.1 ms a step at batch 8 (bench/README section
    # 34): while drafting pays, the costs are priced again every `refresh` steps; the acceptance, every step
    c = Controller()
    run(c, 100, accepted=lambda k: k, rows=8)
    priced = []
    plain = c.costs.step_cost
    monkeypatch.setattr(c.costs, "step_cost", lambda k, b: priced.append(k) or plain(k, b))
    chosen = run(c, 80, accepted=lambda k: k, rows=8)
    assert min(chosen) == max(chosen) == c.cfg.k_max  # steady drafting (no probe, no new shape)
    assert len(priced) <= (80 // c.cfg.refresh + 1) * (c.cfg.k_max + 1)
    # the drafts stop paying: the choice follows the acceptance down as a controller pricing every step does
    every = copy.deepcopy(c)
    dropped = run(c, 40, accepted=lambda k: 0, rows=8)
    monkeypatch.setattr(every, "step_costs", lambda b: [every.costs.step_cost(k, b) for k in range(every.cfg.k_max + 1)])
    assert dropped == run(every, 40, accepted=lambda k: 0, rows=8) and dropped[-1] == 0


def test_a_pass_faster_than_its_plain_reference_teaches_no_ratio():
    costs = Costs(ControllerConfig())
    costs.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    costs.observe(StepSample(1, 1, 0.001, 0.0085, 0.0))  # 15 % under its plain reference: the machine sped up
    assert (2, 1) not in costs.ratio
    assert costs.draft[1].value == pytest.approx(0.001 / 0.0085 * costs.ratio_of(2, 1))  # priced by the prior r(2)
    costs.observe(StepSample(1, 0, 0.0, 0.0080, 0.0))  # the reference, taken again
    costs.observe(StepSample(1, 1, 0.001, 0.0087, 0.0))
    assert costs.ratio_of(2, 1) == pytest.approx(0.0087 / 0.0080)  # (a lower second plain pass replaced the first)
    fresh = Costs(ControllerConfig())
    fresh.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    fresh.observe(StepSample(1, 2, 0.001, 0.0095, 0.0))  # within the drift (noise): learned, but r(T) is never under 1
    assert fresh.ratio[(3, 1)].n == 1 and fresh.ratio_of(3, 1) == 1.0 and fresh.ratio_of(4, 1) >= 1.0


def test_while_drafting_pays_the_reference_is_refreshed_sooner_while_its_ratios_are_few():
    c = Controller()
    chosen = run(c, 1200, accepted=lambda k: k)
    start = next(i for i, k in enumerate(chosen) if k and all(chosen[i : i + 8]))  # drafting from here on
    plain = [i for i, k in enumerate(chosen) if k == 0 and i > start]
    gaps = [b - a for a, b in zip([start] + plain, plain)]
    assert gaps[0] <= 2 * c.cfg.explore_min + 2  # the first ratios learned are checked soon
    assert gaps == sorted(gaps[:4]) + gaps[4:] and max(gaps) >= c.cfg.explore_max - 2  # then ever less often


def test_a_process_warming_up_does_not_keep_a_drafter_that_does_not_pay_drafting():
    """A fresh process's passes run slower for its first tens of steps, each faster than the last (the fetched pair
    at T = 1 on the CPU: 4.8 ms falling to 2.9 over ~7 steps, bench/README.md section 52). Ratios learned then
    against a plain reference a few steps old came out under 1 (0.87), and an eagle head whose drafts (accepted 0.3-0.45
    of the time, 0.35 of a pass each) did not pay drafted on most of the next 256 steps: 0.88-0.93x the verifier
    alone in whole processes. Here drafts accepted 40 % of the time, 0.35 of a pass each, r(2) = 1.15: k = 1 makes
    1.4 tokens for 1.6 passes against a plain step's 1 for 1.1."""
    c = Controller()
    drafting, turn = [], iter([1, 0, 0, 1, 0] * 1000)
    for i in range(400):
        warm = 1 + 0.8 * max(0.0, 1 - i / 10)  # each pass faster than the last for 10 steps, then steady
        choice = c.choose(Batch(1, 1))
        k = choice.k
        if choice.timed:
            n = next((i for i in range(k) if not next(turn)), k)  # each draft accepted 40 % of the time
            c.observe(StepSample(1, k, 0.0035 * k * warm, PLAIN_S * warm * (1 + 0.15 * k), OVERHEAD_S * warm,
                                 ((k, n),) if k else ()))
        drafting.append(k > 0)
    assert sum(drafting[30:]) <= 80, sum(drafting[30:])  # until the reference is taken again (before: 246 of 370)


def test_at_one_width_only_a_large_gap_says_the_plain_reference_is_stale():
    c = Controller()
    c.verify_at_one_width()
    c.observe(StepSample(1, 0, 0.0, 0.010, 0.0))
    c.observe(StepSample(1, 1, 0.001, 0.0092, 0.0))  # 8 % under: the same graph, timing noise
    assert c.costs.ratio[(2, 1)].n == 1 and c.costs.ratio_of(2, 1) == 1.0
    c.observe(StepSample(1, 1, 0.001, 0.0070, 0.0))  # 30 % under: the reference is stale, nothing learned
    assert c.costs.ratio[(2, 1)].n == 1
