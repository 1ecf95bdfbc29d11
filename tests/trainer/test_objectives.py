"""Online objectives: the KL→RL schedule, K + 1 bucket distances, REINFORCE's sign and its on-policy
mask, LK's adaptive weight, on free logits (no model needed)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specloop.trainer.losses import forward_kl, total_variation
from specloop.trainer.objectives import (
    Objective,
    ObjectiveConfig,
    PositionBatch,
    bucket_logprobs,
    klrl_weights,
    policy_logprob,
    simulated_acceptance,
)

torch.set_num_threads(1)

V, K = 40, 6


def verifier_logits(n: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(n, V, generator=torch.Generator().manual_seed(seed))


def make_batch(p_logits: torch.Tensor, tokens=None, rewards=None, on_policy=None, temperature: float = 0.0,
               drafted=None) -> PositionBatch:
    """What a record logs for verifier logits p_logits [N, V]: its top-K log-probs and the rest mass."""
    n = len(p_logits)
    logp = F.log_softmax(p_logits.float(), -1)
    top = logp.topk(K, dim=-1)
    return PositionBatch(
        tokens=torch.as_tensor(tokens if tokens is not None else [0] * n, dtype=torch.long),
        rewards=torch.as_tensor(rewards if rewards is not None else [1.0] * n, dtype=torch.float32),
        top_ids=top.indices, top_logprobs=top.values,
        rest_mass=(1.0 - top.values.exp().sum(-1)).clamp(min=0.0),
        temperature=torch.full((n,), temperature),
        on_policy=torch.as_tensor(on_policy if on_policy is not None else [True] * n, dtype=torch.bool),
        drafted=torch.as_tensor(drafted if drafted is not None else [True] * n, dtype=torch.bool),
    )


def bucket_kl(batch: PositionBatch, q_logits: torch.Tensor) -> torch.Tensor:
    return forward_kl(*bucket_logprobs(batch, q_logits))


def sgd_step(loss: torch.Tensor, q: torch.Tensor, lr: float) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, q)
    return (q - lr * grad).detach().requires_grad_(True)


# ----------------------------------------------------------------------------- klrl schedule


def test_klrl_weights_warm_up_ramp_linearly_then_hold():
    cfg = ObjectiveConfig(warmup_updates=10, ramp_updates=20, kl_weight=1.0, kl_weight_min=0.2, pg_weight_max=0.8)
    for t in (0, 5, 9):
        assert klrl_weights(cfg, t) == (0.0, 1.0)
    assert klrl_weights(cfg, 10) == pytest.approx((0.0, 1.0))
    assert klrl_weights(cfg, 20) == pytest.approx((0.4, 0.6))  # halfway: half of λ_pg^max, midpoint of the KL weights
    assert klrl_weights(cfg, 15) == pytest.approx((0.2, 0.8))
    for t in (30, 31, 1000):
        assert klrl_weights(cfg, t) == pytest.approx((0.8, 0.2))


def test_klrl_with_no_ramp_jumps_to_the_final_weights_after_warm_up():
    cfg = ObjectiveConfig(warmup_updates=3, ramp_updates=0, kl_weight=2.0, kl_weight_min=0.5, pg_weight_max=1.5)
    assert klrl_weights(cfg, 2) == (0.0, 2.0)
    assert klrl_weights(cfg, 3) == pytest.approx((1.5, 0.5))


def test_the_objective_follows_the_schedule_one_update_at_a_time():
    cfg = ObjectiveConfig(name="klrl", warmup_updates=2, ramp_updates=2, kl_weight=1.0, kl_weight_min=0.2, pg_weight_max=1.0)
    obj = Objective(cfg)
    batch = make_batch(verifier_logits(3), tokens=[1, 2, 3], rewards=[1, 1, 0])
    seen = []
    for _ in range(6):
        _, info = obj(batch, torch.zeros(3, V))
        seen.append((info["lambda_pg"], info["lambda_kl"]))
        assert ("pg" in info) == (info["lambda_pg"] > 0)
    flat = [w for pair in seen for w in pair]
    assert flat == pytest.approx([0, 1, 0, 1, 0, 1, 0.5, 0.6, 1, 0.2, 1, 0.2])
    assert obj.updates == 6 and obj.state()["updates"] == 6


# ----------------------------------------------------------------------------- bucket distances


def test_bucket_kl_is_zero_when_q_equals_p():
    p = verifier_logits(5)
    batch = make_batch(p)
    loss, info = Objective(ObjectiveConfig(name="kl"))(batch, p.clone())
    assert abs(float(loss)) < 1e-5 and info["lambda_kl"] == 1.0
    assert simulated_acceptance(batch, p + 3.0) == pytest.approx(1.0, abs=1e-5)  # a shift of the logits is the same q


def test_bucket_kl_is_zero_when_q_matches_p_on_the_top_k_and_the_rest_mass_only():
    p = verifier_logits(4, seed=1)
    batch = make_batch(p)
    logp = F.log_softmax(p, -1)
    # reshuffle the tail: same top-K probabilities, same rest mass, different distribution over the rest
    q = logp.clone()
    tail = torch.ones_like(q, dtype=torch.bool).scatter_(-1, batch.top_ids, False)
    for i in range(len(q)):
        idx = tail[i].nonzero().flatten()
        q[i, idx] = logp[i, idx.flip(0)]
    assert not torch.allclose(F.softmax(q, -1), F.softmax(p, -1))
    assert float(bucket_kl(batch, q)) == pytest.approx(0.0, abs=1e-5)
    assert simulated_acceptance(batch, q) == pytest.approx(1.0, abs=1e-5)


def test_bucket_kl_is_positive_and_simulated_acceptance_below_one_when_q_differs():
    p = verifier_logits(5)
    batch = make_batch(p, temperature=1.0)
    for q in (torch.zeros(5, V), verifier_logits(5, seed=7), p + 0.5 * verifier_logits(5, seed=3)):
        assert float(bucket_kl(batch, q)) > 1e-3
        assert simulated_acceptance(batch, q) < 0.99
    # and it is Σ min(p, q) over the K + 1 buckets
    q = verifier_logits(5, seed=7)
    log_p, log_q = bucket_logprobs(batch, q)
    want = torch.minimum(log_p.exp(), log_q.exp()).sum(-1).mean()
    assert simulated_acceptance(batch, q) == pytest.approx(float(want), abs=1e-6)


def test_simulated_acceptance_of_greedy_records_is_argmax_agreement():
    p = verifier_logits(6)
    q = p.clone()
    q[:2] = -p[:2]  # flips the argmax of the first two positions
    batch = make_batch(p, temperature=0.0)
    assert simulated_acceptance(batch, q) == pytest.approx(4 / 6)
    assert simulated_acceptance(batch, p + 0.3 * verifier_logits(6, seed=9)) <= 1.0
    assert simulated_acceptance(batch, p) == 1.0


def test_bucket_log_probabilities_are_normalised_over_k_plus_one_buckets():
    p, q = verifier_logits(3), verifier_logits(3, seed=5)
    log_p, log_q = bucket_logprobs(make_batch(p), q)
    assert log_p.shape == log_q.shape == (3, K + 1)
    assert torch.allclose(log_p.exp().sum(-1), torch.ones(3), atol=1e-5)
    assert torch.allclose(log_q.exp().sum(-1), torch.ones(3), atol=1e-5)


def test_one_sgd_step_on_the_kl_objective_moves_q_toward_p():
    p = verifier_logits(6)
    batch = make_batch(p)
    obj = Objective(ObjectiveConfig(name="kl"))
    q = torch.zeros(6, V, requires_grad=True)
    before_kl, before_acc = float(bucket_kl(batch, q.detach())), simulated_acceptance(batch, q.detach())
    loss, _ = obj(batch, q)
    q = sgd_step(loss, q, lr=5.0)
    assert float(bucket_kl(batch, q.detach())) < before_kl
    assert simulated_acceptance(batch, q) > before_acc
    for _ in range(200):
        loss, _ = obj(batch, q)
        q = sgd_step(loss, q, lr=5.0)
    assert float(bucket_kl(batch, q.detach())) < 0.02 * before_kl


# ----------------------------------------------------------------------------- policy terms


def klrl_after_warm_up(**over) -> Objective:
    """klrl whose policy terms are fully on from update 1, with the KL term almost off."""
    cfg = dict(name="klrl", warmup_updates=1, ramp_updates=0, kl_weight=1e-6, kl_weight_min=1e-6,
               pg_weight_max=1.0, ce_weight=0.0, rl_weight=1.0)
    return Objective(ObjectiveConfig(**(cfg | over)))


@pytest.mark.parametrize("ce_weight", [0.0, 1.0])
def test_reinforce_raises_a_rewarded_tokens_log_prob_and_lowers_a_first_rejected_ones(ce_weight):
    p = verifier_logits(2)
    batch = make_batch(p, tokens=[5, 9], rewards=[1.0, 0.0])
    obj = klrl_after_warm_up(ce_weight=ce_weight)
    obj(batch, torch.zeros(2, V))  # warm-up: KL only, and the baseline b becomes mean reward 0.5
    assert obj.baseline == pytest.approx(0.5)
    q = verifier_logits(2, seed=11).requires_grad_(True)
    before = policy_logprob(batch, q).detach()
    loss, info = obj(batch, q)
    assert info["lambda_pg"] == 1.0 and info["baseline"] == pytest.approx(0.5)
    after = policy_logprob(batch, sgd_step(loss, q, lr=0.5)).detach()
    assert after[0] > before[0] + 1e-3  # reward 1 > b: pushed up
    assert after[1] < before[1] - 1e-3  # reward 0 < b: pushed down


def test_the_reinforce_advantage_is_reward_minus_the_ema_baseline():
    p = verifier_logits(2)
    obj = klrl_after_warm_up(baseline_decay=0.5)
    obj(make_batch(p, rewards=[1.0, 1.0]), torch.zeros(2, V))  # b = 1
    obj(make_batch(p, rewards=[0.0, 0.0]), torch.zeros(2, V))  # uses b = 1, then b = 0.5·1 + 0.5·0
    assert obj.baseline == pytest.approx(0.5)
    batch = make_batch(p, tokens=[3, 4], rewards=[1.0, 0.0])
    q = torch.zeros(2, V, requires_grad=True)
    loss, info = obj(batch, q)
    assert info["baseline"] == pytest.approx(0.5)
    logp_a = policy_logprob(batch, q)
    want = -((batch.rewards - 0.5) * logp_a).mean()  # every position on-policy
    assert info["pg"] == pytest.approx(float(want.detach()), abs=1e-5)
    # with all rewards equal to the baseline the policy gradient vanishes
    obj2 = klrl_after_warm_up()
    obj2(make_batch(p, rewards=[1.0, 1.0]), torch.zeros(2, V))  # b = 1
    q = torch.zeros(2, V, requires_grad=True)
    loss, info = obj2(make_batch(p, tokens=[3, 4], rewards=[1.0, 1.0]), q)
    kl_only = 1e-6 * bucket_kl(make_batch(p), q)
    (g,) = torch.autograd.grad(loss, q)
    (g_kl,) = torch.autograd.grad(kl_only, q)
    assert torch.allclose(g, g_kl, atol=1e-9)


def test_off_policy_positions_get_only_the_kl_gradient():
    p = verifier_logits(3)
    warm = make_batch(p, rewards=[1.0, 0.0, 1.0])
    batch = make_batch(p, tokens=[5, 9, 2], rewards=[1.0, 0.0, 1.0], on_policy=[True, False, False])
    obj = klrl_after_warm_up(kl_weight=0.3, kl_weight_min=0.3, ce_weight=1.0)
    obj(warm, torch.zeros(3, V))
    q = verifier_logits(3, seed=2).requires_grad_(True)
    loss, info = obj(batch, q)
    assert info["on_policy"] == 1 and info["lambda_pg"] == 1.0
    (g,) = torch.autograd.grad(loss, q)
    (g_kl,) = torch.autograd.grad(0.3 * bucket_kl(batch, q), q)
    assert torch.allclose(g[1:], g_kl[1:], atol=1e-7)  # off-policy rows: KL only
    assert not torch.allclose(g[0], g_kl[0], atol=1e-4)  # the on-policy row gets the policy terms too


def test_observed_positions_get_only_the_kl_gradient_and_leave_the_reward_baseline_alone():
    # an observed record (a step left plain) drafted nothing: its token is the verifier's own, its reward a
    # placeholder 0; on-policy or not, only the distillation term may see it
    p = verifier_logits(3)
    obj = klrl_after_warm_up(kl_weight=0.3, kl_weight_min=0.3, ce_weight=1.0, baseline_decay=0.0)
    batch = make_batch(p, tokens=[5, 9, 2], rewards=[1.0, 0.0, 0.0], drafted=[True, False, False])
    obj(batch, torch.zeros(3, V))
    assert obj.baseline == pytest.approx(1.0)  # the drafted position's reward alone (all three: 1/3)
    q = verifier_logits(3, seed=2).requires_grad_(True)
    loss, info = obj(batch, q)
    assert info["observed"] == 2 and info["reward"] == pytest.approx(1.0)
    (g,) = torch.autograd.grad(loss, q)
    (g_kl,) = torch.autograd.grad(0.3 * bucket_kl(batch, q), q)
    assert torch.allclose(g[1:], g_kl[1:], atol=1e-7)  # observed rows: KL only
    assert not torch.allclose(g[0], g_kl[0], atol=1e-4)  # the drafted row gets the policy terms too


def test_a_batch_with_no_on_policy_positions_has_exactly_the_kl_gradient():
    p = verifier_logits(3)
    batch = make_batch(p, tokens=[5, 9, 2], rewards=[1.0, 1.0, 0.0], on_policy=[False, False, False])
    obj = klrl_after_warm_up(kl_weight=0.3, kl_weight_min=0.3, ce_weight=1.0)
    obj(batch, torch.zeros(3, V))
    q = verifier_logits(3, seed=2).requires_grad_(True)
    loss, info = obj(batch, q)
    assert info["on_policy"] == 0
    (g,) = torch.autograd.grad(loss, q)
    (g_kl,) = torch.autograd.grad(0.3 * bucket_kl(batch, q), q)
    assert torch.allclose(g, g_kl, atol=1e-7)
    assert float(loss.detach()) == pytest.approx(float(0.3 * bucket_kl(batch, q.detach())), abs=1e-6)


def test_the_policy_log_prob_is_taken_at_the_requests_temperature():
    q = verifier_logits(2, seed=4)
    greedy = make_batch(verifier_logits(2), tokens=[1, 2], temperature=0.0)
    warm = make_batch(verifier_logits(2), tokens=[1, 2], temperature=0.5)
    assert torch.allclose(policy_logprob(greedy, q), F.log_softmax(q, -1)[[0, 1], [1, 2]])
    assert torch.allclose(policy_logprob(warm, q), F.log_softmax(q / 0.5, -1)[[0, 1], [1, 2]])


def test_the_entropy_bonus_lowers_the_loss_by_its_weight_times_the_entropy():
    p = verifier_logits(2)
    batch = make_batch(p)
    q = verifier_logits(2, seed=9)
    plain, _ = Objective(ObjectiveConfig(name="klrl", warmup_updates=5))(batch, q)
    bonus, _ = Objective(ObjectiveConfig(name="klrl", warmup_updates=5, entropy_weight=0.1))(batch, q)
    logq = F.log_softmax(q, -1)
    entropy = -(logq.exp() * logq).sum(-1).mean()
    assert float(plain - bonus) == pytest.approx(0.1 * float(entropy), abs=1e-6)


# ----------------------------------------------------------------------------- lk


def test_lk_kl_weight_is_one_minus_the_acceptance_ema():
    p = verifier_logits(4)
    batch = make_batch(p, temperature=1.0)  # sampled records: simulated acceptance is Σ min(p, q)
    obj = Objective(ObjectiveConfig(name="lk", acceptance_decay=0.9))
    q1, q2 = torch.zeros(4, V), p + 0.3 * verifier_logits(4, seed=8)
    loss1, info1 = obj(batch, q1)
    a1 = simulated_acceptance(batch, q1)
    assert info1["sim_acceptance"] == pytest.approx(a1)
    assert info1["lambda_kl"] == pytest.approx(1.0 - a1)
    log_p, log_q = bucket_logprobs(batch, q1)
    want = (1 - a1) * forward_kl(log_p, log_q) + a1 * total_variation(log_p, log_q)
    assert float(loss1) == pytest.approx(float(want), abs=1e-6)
    _, info2 = obj(batch, q2)
    a2 = simulated_acceptance(batch, q2)
    assert a2 > a1
    assert obj.acceptance == pytest.approx(0.9 * a1 + 0.1 * a2)
    assert info2["lambda_kl"] == pytest.approx(1.0 - obj.acceptance)


def test_kl_reports_a_kl_weight_of_one_and_its_loss_is_the_bucket_kl():
    p = verifier_logits(3)
    batch = make_batch(p)
    q = verifier_logits(3, seed=6)
    loss, info = Objective(ObjectiveConfig(name="kl"))(batch, q)
    assert info["lambda_kl"] == 1.0
    assert float(loss) == pytest.approx(float(bucket_kl(batch, q)), abs=1e-6)
    assert info["loss"] == pytest.approx(float(loss))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", ["tv", "KL", "reinforce", ""])
def test_an_unknown_objective_name_is_refused(name):
    with pytest.raises(ValueError, match="unknown objective"):
        ObjectiveConfig(name=name)


def test_negative_schedule_lengths_are_refused():
    with pytest.raises(ValueError):
        ObjectiveConfig(warmup_updates=-1)
    with pytest.raises(ValueError):
        ObjectiveConfig(ramp_updates=-1)


def test_a_non_finite_batch_leaves_the_counter_and_the_emas_untouched():
    p = verifier_logits(2)
    good = make_batch(p, rewards=[1.0, 0.0])
    for name in ("kl", "klrl", "lk"):
        obj = Objective(ObjectiveConfig(name=name))
        obj(good, torch.zeros(2, V))
        state = obj.state()
        bad = make_batch(p, rewards=[1.0, 0.0])
        bad.top_logprobs[0, 0] = float("nan")
        loss, info = obj(bad, torch.zeros(2, V))
        assert not math.isfinite(float(loss))
        assert obj.state() == state, name
        _, info = obj(good, torch.zeros(2, V))
        assert math.isfinite(info["loss"]) and obj.updates == 2
        assert math.isfinite(obj.acceptance) and math.isfinite(obj.baseline)
