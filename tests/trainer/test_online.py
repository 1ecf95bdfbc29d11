"""The online learner: how records are split (window / holdout / anchor), when it may update, that
the learner's forward at logged positions is the serving drafter's (train/serve consistency), that
the kl objective improves held-out simulated acceptance, and that weights and bad steps are safe."""
from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.loading import load_model
from specloop.trainer.objectives import ObjectiveConfig
from specloop.trainer.online import (
    LearnerConfig,
    OnlineLearner,
    lm_inputs,
    logged,
    position_batch,
    record_logits,
    serving_student,
)
from specloop.trainer.records import ReplayRecord
from tests.drafter_helpers import trained_eagle as trained_like
from tests.drafter_helpers import trained_eagle3 as trained_like3
from tests.records_helpers import log_blocks, perturbed_head, perturbed_steering
from tests.tiny import TEXT

torch.set_num_threads(1)

K = 4


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    v = load_model(tiny_pair[0], dtype=torch.float32)
    v.hf.requires_grad_(False)
    return v


@pytest.fixture(scope="module")
def checkpoints(tiny_pair, verifier, tmp_path_factory):
    """kind -> the serving drafter directory: the plain drafter LM, an SD² checkpoint with non-zero
    W_s, and a DVI checkpoint with non-zero LoRA adapters."""
    root = tmp_path_factory.mktemp("online")
    drafter = load_model(tiny_pair[1], dtype=torch.float32)
    sd2 = root / "sd2"
    perturbed_steering(verifier.hf, drafter.hf, std=0.5).save(sd2, {})
    shutil.copytree(tiny_pair[1], sd2 / "drafter")
    dvi = root / "dvi"
    perturbed_head(verifier.hf, std=0.1).save(dvi, {})
    eagle = root / "eagle"
    trained_like(verifier.lean, std=0.1).save(eagle, {})
    eagle3 = root / "eagle3"
    trained_like3(verifier.lean, std=0.1).save(eagle3, {})
    return {"pretrained": tiny_pair[1], "sd2": sd2, "dvi": dvi, "eagle": eagle, "eagle3": eagle3}


@pytest.fixture(scope="module")
def prompts(verifier):
    tok = verifier.tokenizer
    return [tok.encode(t[:24]) for t in TEXT] + [tok.encode(t[-24:]) for t in TEXT]


@pytest.fixture(scope="module")
def served(verifier, checkpoints, prompts):
    """kind -> records logged while the drafter built from its checkpoint served the prompts (greedy)."""
    return {kind: [item.record for item in log_blocks(verifier, build_drafter(kind, verifier, ck), kind, prompts,
                                                      max_tokens=16)]
            for kind, ck in checkpoints.items()}


def synthetic(verifier, i: int, kind: str = "dvi", version: str = "v0", m: int = 2, seed: int | None = None) -> ReplayRecord:
    """A cheap DVI-shaped record (random hidden states and verifier distribution) for the bookkeeping tests."""
    g = torch.Generator().manual_seed(i if seed is None else seed)
    d, vocab = verifier.hf.config.hidden_size, verifier.vocab_size
    logp = torch.log_softmax(3 * torch.randn(m, vocab, generator=g), -1)
    top = logp.topk(8, dim=-1)
    return ReplayRecord(
        request_id=f"r{i}", drafter_version=version, block=0, kind=kind, k=K, temperature=0.0,
        tokens=torch.randint(0, vocab, (m,), generator=g).numpy(), rewards=np.array([1] * (m - 1) + [0], np.uint8),
        draft_logprobs=np.full(m, -1.0, np.float32), top_ids=top.indices.numpy(), top_logprobs=top.values.numpy(),
        rest_mass=(1 - top.values.exp().sum(-1)).clamp(min=0).numpy(), context=np.zeros(0, np.int64),
        hidden=torch.randn(m, d, generator=g).numpy(),
    )


def dvi_learner(verifier, **cfg) -> OnlineLearner:
    torch.manual_seed(0)
    objective = cfg.pop("objective", ObjectiveConfig(name="kl"))
    return OnlineLearner(LearnerConfig(kind="dvi", objective=objective, **cfg), serving_student("dvi", verifier, None))


def logged_logprobs(logits: torch.Tensor, records: list[ReplayRecord], temperature: float = 0.0) -> torch.Tensor:
    tokens = torch.from_numpy(np.concatenate([r.tokens for r in records]))
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, -1).gather(-1, tokens[:, None]).squeeze(-1)


# ----------------------------------------------------------------------------- ingest / ready


def test_every_holdout_every_th_record_is_held_out_and_the_rest_enter_the_window(verifier):
    learner = dvi_learner(verifier, holdout_every=4, batch_records=2, window=100)
    mine = [synthetic(verifier, i) for i in range(20)]
    others = [synthetic(verifier, 100 + i, kind="pretrained") for i in range(5)] + \
             [synthetic(verifier, 200 + i, kind="sd2") for i in range(3)]
    mixed = mine[:7] + others[:4] + mine[7:15] + others[4:] + mine[15:]
    learner.ingest(mixed)
    assert learner.seen == 20
    assert [r.request_id for r in learner.holdout] == [mine[i].request_id for i in (3, 7, 11, 15, 19)]
    assert [r.request_id for r in learner.window] == [r.request_id for j, r in enumerate(mine) if (j + 1) % 4]
    held = {r.request_id for r in learner.holdout}
    assert not held & {r.request_id for r in learner.anchor}
    kept = [r for part in (learner.window, learner.holdout, learner.anchor) for r in part]
    assert all(r.kind == "dvi" for r in kept)


def test_the_window_and_holdout_are_bounded_and_the_anchor_reservoir_never_exceeds_its_size(verifier):
    learner = dvi_learner(verifier, holdout_every=5, holdout_size=3, batch_records=2, window=8, anchor_size=6)
    for i in range(300):
        learner.ingest([synthetic(verifier, i, m=1)])
        assert len(learner.anchor) <= 6 and len(learner.window) <= 8 and len(learner.holdout) <= 3
    assert len(learner.anchor) == 6 and len(set(r.request_id for r in learner.anchor)) == 6
    window = {r.request_id for r in learner.window}
    assert {r.request_id for r in learner.anchor} - window, "the reservoir keeps older traffic than the window"
    assert learner.stats().anchor == 6 and learner.stats().records_seen == 300


def test_ready_waits_for_a_full_minibatch_and_respects_the_replay_ratio(verifier):
    learner = dvi_learner(verifier, batch_records=4, window=16, replay_ratio=2.0, holdout_every=1000, anchor_fraction=0.0)
    learner.ingest([synthetic(verifier, i) for i in range(3)])
    assert not learner.ready() and learner.update() is None  # 3 < batch_records
    learner.ingest([synthetic(verifier, 3)])
    assert learner.ready()  # (0 + 1)·4 <= 2·4
    assert learner.update() is not None and learner.ready()  # (1 + 1)·4 <= 8
    assert learner.update() is not None
    assert not learner.ready() and learner.update() is None  # (2 + 1)·4 > 8: wait for more records
    assert learner.updates == 2
    learner.ingest([synthetic(verifier, 4)])
    assert not learner.ready()  # 12 > 2·5
    learner.ingest([synthetic(verifier, 5)])
    assert learner.ready()  # 12 <= 2·6


def test_a_minibatch_has_batch_records_records_with_the_anchor_share_drawn_from_the_reservoir(verifier):
    learner = dvi_learner(verifier, batch_records=8, window=8, anchor_size=4, anchor_fraction=0.25, holdout_every=1000)
    learner.ingest([synthetic(verifier, i, m=1) for i in range(40)])
    batch = learner.sample()
    assert len(batch) == 8
    window = {r.request_id for r in learner.window}
    anchor_only = {r.request_id for r in learner.anchor} - window
    assert sum(r.request_id in window for r in batch[:6]) == 6
    assert all(r.request_id in {a.request_id for a in learner.anchor} for r in batch[6:])
    assert anchor_only  # with 40 records seen, the reservoir holds records the window dropped


# ----------------------------------------------------------------------------- versions and batches


def test_policy_terms_use_records_of_the_last_published_versions_and_stale_ones_are_counted(verifier):
    objective = ObjectiveConfig(name="klrl", warmup_updates=0, ramp_updates=0)
    learner = dvi_learner(verifier, objective=objective, batch_records=8, window=8, holdout_every=1000,
                          anchor_fraction=0.0, replay_ratio=100.0)
    records = [synthetic(verifier, i, version="v0" if i < 3 else "v1", m=1) for i in range(8)]
    learner.ingest(records)
    assert learner.on_policy() is None  # nothing published yet: every record counts as on-policy
    learner.published("v1")
    info = learner.update()
    assert info.terms["on_policy"] == 5 and learner.stale_skipped == 3
    lagged = dvi_learner(verifier, objective=objective, batch_records=8, window=8, holdout_every=1000,
                         anchor_fraction=0.0, replay_ratio=100.0, max_policy_lag=1)
    lagged.ingest(records)
    lagged.published("v0")
    lagged.published("v1")
    assert lagged.update().terms["on_policy"] == 8 and lagged.stale_skipped == 0
    lagged.published("v2")  # v0 falls out of the lag window
    assert lagged.on_policy() == {"v1", "v2"}


def test_position_batches_concatenate_the_records_positions_with_their_flags(verifier):
    records = [synthetic(verifier, 0, version="a", m=3), synthetic(verifier, 1, version="b", m=1)]
    batch = position_batch(records, {"b"})
    assert batch.tokens.tolist() == records[0].tokens.tolist() + records[1].tokens.tolist()
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert batch.on_policy.tolist() == [False, False, False, True]
    assert position_batch(records, None).on_policy.all()


def test_lm_inputs_predict_position_j_at_context_length_minus_one_plus_j(served):
    records = served["pretrained"][:3]
    ids, rows, pos = lm_inputs(records)
    for i, r in enumerate(records):
        seq = list(r.context) + list(r.tokens[:-1])
        assert ids[i, : len(seq)].tolist() == seq
    assert rows.tolist() == [i for i, r in enumerate(records) for _ in range(r.positions)]
    for i, r in enumerate(records):
        p = pos[rows == i].tolist()
        assert p == list(range(len(r.context) - 1, len(r.context) - 1 + r.positions))
        # the input at the first logged position is the block's first input, the last committed token
        assert int(ids[i, p[0]]) == int(r.context[-1])


def test_lm_records_without_a_context_window_are_refused(served):
    r = served["pretrained"][0]
    bare = ReplayRecord(**(vars(r) | {"context": np.zeros(0, np.int64)}))
    with pytest.raises(ValueError, match="context"):
        lm_inputs([bare])


def test_logged_gathers_each_records_positions_in_order_and_sends_gradients_back_to_them():
    def record(positions: int) -> ReplayRecord:
        return ReplayRecord(request_id="r", drafter_version="v", block=0, kind="eagle", k=positions, temperature=0.0,
                            tokens=np.zeros(positions, np.int64), rewards=np.zeros(positions, np.uint8),
                            draft_logprobs=np.zeros(positions, np.float32), top_ids=np.zeros((positions, 2), np.int64),
                            top_logprobs=np.zeros((positions, 2), np.float32), rest_mass=np.zeros(positions, np.float32),
                            context=np.zeros(1, np.int64))

    records = [record(n) for n in (3, 1, 2)]
    per_block = torch.randn(3, 3, 5, requires_grad=True)  # [R, m, V]
    got = logged(per_block, records)
    want = torch.cat([per_block[i, : r.positions] for i, r in enumerate(records)])
    assert torch.equal(got, want)
    (got * torch.arange(30.0).reshape(6, 5)).sum().backward()
    grad = per_block.grad
    assert grad is not None and torch.equal(grad[0], torch.arange(15.0).reshape(3, 5))
    assert torch.equal(grad[1, 0], torch.arange(15.0, 20.0)) and torch.equal(grad[2, :2], torch.arange(20.0, 30.0).reshape(2, 5))
    assert not grad[1, 1:].any() and not grad[2, 2].any()  # padding past a record's positions gets nothing


# ----------------------------------------------------------------------------- train/serve consistency


@pytest.mark.parametrize("kind", ["pretrained", "sd2", "dvi", "eagle", "eagle3"])
def test_record_logits_reproduce_the_serving_drafters_log_probs_at_every_logged_position(verifier, checkpoints, served, kind):
    records = served[kind]
    assert len(records) >= 8 and all(len(r.context) > 0 for r in records if kind != "dvi")
    assert all(len(r.context) == 1 and r.steer.shape == (1, verifier.lean.hidden_size) for r in records if kind == "eagle")
    if kind == "eagle3":  # the head's window: 4 positions once a row has 5 committed tokens (the prompts have more)
        assert all(r.steer.shape == (4, 3 * verifier.lean.hidden_size) and len(r.context) == 4 for r in records)
    student = serving_student(kind, verifier, checkpoints[kind])
    with torch.no_grad():
        got = logged_logprobs(record_logits(student, records), records)
    want = torch.from_numpy(np.concatenate([r.draft_logprobs for r in records]))
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < 1e-4


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "pretrained"])
def test_an_observed_record_is_the_first_position_of_a_block_drafted_at_the_same_point(verifier, checkpoints, prompts,
                                                                                        kind):
    # greedy output is the verifier's whatever k, so a step left plain (k = 0, observed) and a drafting step
    # (k = 1) that start from the same committed tokens have the same inputs and the same verifier distribution
    # at the block's first position; the learner's forward on the observed record gives the draft made there
    drafter = build_drafter(kind, verifier, checkpoints[kind])
    drafted = log_blocks(verifier, drafter, kind, prompts[:3], k=1, max_tokens=12)
    observed = {tuple(item.history): item.record for item in log_blocks(
        verifier, build_drafter(kind, verifier, checkpoints[kind]), kind, prompts[:3], k=0, max_tokens=12, observe=True)}
    pairs = [(observed[tuple(item.history)], item.record) for item in drafted if tuple(item.history) in observed]
    assert len(pairs) >= 6 and len(observed) == 3 * 12  # one a step (each step emits one token a row)
    for seen, made in pairs:
        assert seen.observed and seen.positions == 1 and seen.rewards.tolist() == [0] and not made.observed
        assert np.array_equal(seen.context, made.context)
        assert (seen.steer is None) == (made.steer is None) and (seen.steer is None or np.array_equal(seen.steer, made.steer))
        assert np.array_equal(seen.top_ids[0], made.top_ids[0])
        assert np.allclose(seen.top_logprobs[0], made.top_logprobs[0], atol=1e-5)
        assert int(seen.tokens[0]) == int(made.top_ids[0, 0])  # greedy: the verifier emitted its argmax
    student = serving_student(kind, verifier, checkpoints[kind])
    with torch.no_grad():
        first = record_logits(student, [seen for seen, _ in pairs]).argmax(dim=-1)
    assert first.tolist() == [int(made.tokens[0]) for _, made in pairs]


def test_steering_matters_for_the_consistency_check(verifier, checkpoints, served):
    """The same records scored without steering (W_s = 0) do not reproduce the served log-probs."""
    records = served["sd2"]
    student = serving_student("sd2", verifier, checkpoints["sd2"])
    assert float(student.steering.w_s.detach().abs().max()) > 0
    with torch.no_grad():
        student.steering.w_s.zero_()
        got = logged_logprobs(record_logits(student, records), records)
    want = torch.from_numpy(np.concatenate([r.draft_logprobs for r in records]))
    assert float((got - want).abs().max()) > 1e-2


def test_record_logits_reproduce_sampled_drafts_log_probs_at_their_temperature(verifier, checkpoints, prompts):
    items = log_blocks(verifier, build_drafter("pretrained", verifier, checkpoints["pretrained"]), "pretrained",
                       prompts[:4], max_tokens=16, temperature=0.5)
    records = [item.record for item in items]
    assert all(r.temperature == 0.5 for r in records)
    student = serving_student("pretrained", verifier, checkpoints["pretrained"])
    with torch.no_grad():
        got = logged_logprobs(record_logits(student, records), records, temperature=0.5)
    want = torch.from_numpy(np.concatenate([r.draft_logprobs for r in records]))
    assert float((got - want).abs().max()) < 1e-4


# ----------------------------------------------------------------------------- learning


def make_learner(kind: str, verifier, checkpoint, **cfg) -> OnlineLearner:
    torch.manual_seed(0)
    objective = cfg.pop("objective", ObjectiveConfig(name="kl"))
    config = LearnerConfig(kind=kind, objective=objective, lr=3e-3, lm_lr=1e-3, batch_records=8,
                           holdout_every=4, replay_ratio=10.0, seed=0, **cfg)
    return OnlineLearner(config, serving_student(kind, verifier, checkpoint))


@pytest.mark.parametrize("kind", ["pretrained", "dvi", "eagle", "eagle3"])
def test_thirty_kl_updates_raise_simulated_acceptance_on_the_held_out_records(verifier, checkpoints, prompts, kind):
    # sampled traffic (T = 1): simulated acceptance is Σ min(p, q), which KL training raises smoothly
    drafter_obj = build_drafter(kind, verifier, checkpoints[kind])
    sampled = [item.record for item in log_blocks(verifier, drafter_obj, kind, prompts, max_tokens=16, temperature=1.0)]
    learner = make_learner(kind, verifier, checkpoints[kind])
    learner.ingest(sampled)
    assert len(learner.holdout) >= 5
    start = learner.weights()
    before = learner.evaluate()
    for _ in range(30):
        info = learner.update()
        assert info is not None and info.skipped is None
    assert learner.updates == 30
    after = learner.evaluate()
    assert after > before + 1e-3, (before, after)
    # evaluating other weights gives their figure and leaves the current weights in place
    trained = learner.weights()
    assert learner.evaluate(weights=start) == pytest.approx(before, abs=1e-6)
    now = learner.weights()
    assert now.keys() == trained.keys() and all(torch.equal(now[n], trained[n]) for n in now)
    assert learner.evaluate() == pytest.approx(after, abs=1e-6)


def test_updates_on_observed_records_alone_raise_simulated_acceptance(verifier, checkpoints, prompts):
    # speculation off (k = 0), every step observed: the learner still has its distillation term to learn from
    kind = "eagle"
    sampled = [item.record for item in log_blocks(verifier, build_drafter(kind, verifier, checkpoints[kind]), kind,
                                                  prompts, k=0, max_tokens=16, temperature=1.0, observe=True)]
    assert sampled and all(r.observed for r in sampled)
    learner = make_learner(kind, verifier, checkpoints[kind], objective=ObjectiveConfig(name="klrl", warmup_updates=0))
    learner.ingest(sampled)
    before = learner.evaluate()
    for _ in range(30):
        info = learner.update()
        assert info is not None and info.skipped is None and info.terms["observed"] > 0
    assert learner.evaluate() > before + 1e-3


def test_training_is_deterministic_for_a_seed(verifier, checkpoints, served):
    runs = []
    for _ in range(2):
        learner = make_learner("dvi", verifier, checkpoints["dvi"])
        learner.ingest(served["dvi"])
        for _ in range(5):
            learner.update()
        runs.append((learner.evaluate(), learner.weights()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


def test_evaluate_without_held_out_records_is_none(verifier):
    assert dvi_learner(verifier).evaluate() is None


# ----------------------------------------------------------------------------- weights and bad steps


@pytest.mark.parametrize("kind, prefix", [("pretrained", "lm."), ("sd2", "steering."), ("dvi", "head."), ("eagle", "head."), ("eagle3", "head.")])
def test_weights_round_trip_through_load_weights(verifier, checkpoints, kind, prefix):
    learner = make_learner(kind, verifier, checkpoints[kind])
    weights = learner.weights()
    assert weights and any(n.startswith(prefix) for n in weights)
    assert all(t.device.type == "cpu" for t in weights.values())
    g = torch.Generator().manual_seed(3)
    changed = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in weights.items()}
    learner.load_weights(changed | {"not.a.parameter": torch.zeros(3)})
    back = learner.weights()
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[n], changed[n]) for n in back)
    back[next(iter(back))].add_(1.0)  # a copy: editing it leaves the parameters alone
    assert all(torch.equal(learner.weights()[n], changed[n]) for n in changed)
    learner.load_weights(weights)
    assert all(torch.equal(learner.weights()[n], weights[n]) for n in weights)


def poisoned(record: ReplayRecord) -> ReplayRecord:
    top = record.top_logprobs.copy()
    top[0, 0] = np.nan
    return ReplayRecord(**(vars(record) | {"top_logprobs": top}))


@pytest.mark.parametrize("name", ["kl", "klrl", "lk"])
def test_a_nan_loss_skips_the_step_and_changes_nothing(verifier, name):
    learner = dvi_learner(verifier, objective=ObjectiveConfig(name=name, warmup_updates=0), batch_records=4,
                          window=4, holdout_every=1000, anchor_fraction=0.0, replay_ratio=100.0)
    learner.ingest([synthetic(verifier, i) for i in range(4)])
    assert learner.update().skipped is None
    weights, objective = learner.weights(), learner.objective.state()
    learner.ingest([poisoned(synthetic(verifier, 10 + i)) for i in range(4)])  # the window now holds only these
    info = learner.update()
    assert info.skipped == "non-finite loss" and not math.isfinite(info.loss)
    assert learner.updates == 1
    assert all(torch.equal(learner.weights()[n], weights[n]) for n in weights)
    assert learner.objective.state() == objective  # no step, no schedule tick, no NaN in the EMAs
    assert all(p.grad is None for _, p, _ in learner.params)  # nothing was back-propagated
    learner.ingest([synthetic(verifier, 20 + i) for i in range(4)])
    info = learner.update()
    assert info.skipped is None and learner.updates == 2 and math.isfinite(info.loss)
    after = learner.weights()
    assert any(not torch.equal(after[n], weights[n]) for n in weights)
    assert all(torch.isfinite(t).all() for t in after.values())
    assert math.isfinite(learner.objective.acceptance)


# ----------------------------------------------------------------------------- config


def test_learner_config_round_trips_through_a_dict_and_refuses_bad_values():
    cfg = LearnerConfig(kind="sd2", objective=ObjectiveConfig(name="lk"), batch_records=4, window=8)
    assert LearnerConfig.from_dict(cfg.to_dict()) == cfg
    for bad in (dict(kind="ngram"), dict(kind="dvi", batch_records=0), dict(kind="dvi", batch_records=8, window=4),
                dict(kind="dvi", anchor_fraction=1.0), dict(kind="dvi", holdout_every=1), dict(kind="dvi", publish_every=0)):
        with pytest.raises(ValueError):
            LearnerConfig(**bad)


def test_the_eagle_heads_are_fine_tuned_gently_unless_told_otherwise():
    """The heads arrive trained offline: larger minibatches at a lower rate by default (the lr and batch of
    their rows in the table of kinds); the other kinds keep theirs, and a value given explicitly always wins."""
    for kind in ("eagle", "eagle3"):
        cfg = LearnerConfig(kind=kind)
        assert (cfg.lr, cfg.batch_records) == (2e-4, 64)
        assert LearnerConfig.from_dict(cfg.to_dict()) == cfg
        given = LearnerConfig(kind=kind, lr=1e-3, batch_records=8)
        assert (given.lr, given.batch_records) == (1e-3, 8)
    for kind in ("pretrained", "sd2", "dvi"):
        assert (LearnerConfig(kind=kind).lr, LearnerConfig(kind=kind).batch_records) == (1e-3, 16)
