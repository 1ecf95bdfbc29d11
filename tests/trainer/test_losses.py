"""Distribution losses between verifier (p) and drafter (q) logits: KL, TV, acceptance, LK hybrid."""
import pytest
import torch

from specloop.trainer.losses import (
    distribution_loss,
    expected_acceptance,
    forward_kl,
    lk_hybrid,
    lk_weight,
    total_variation,
)

torch.set_num_threads(1)
V = 50


def logits(*shape, seed=0, scale=2.0):
    return torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed)) * scale


def test_every_loss_is_zero_for_identical_distributions():
    p = logits(6)
    assert forward_kl(p, p.clone()).abs() < 1e-6
    assert total_variation(p, p.clone()).abs() < 1e-6
    assert lk_hybrid(p, p.clone(), acceptance=0.3)[0].abs() < 1e-6
    assert expected_acceptance(p, p.clone()) == pytest.approx(1.0, abs=1e-5)


def test_shifting_logits_by_a_constant_changes_nothing():
    p = logits(4)
    assert forward_kl(p, p + 3.0).abs() < 1e-5
    assert total_variation(p, p - 7.0).abs() < 1e-5


def test_every_loss_is_positive_for_different_distributions():
    p, q = logits(6, seed=1), logits(6, seed=2)
    assert forward_kl(p, q) > 0
    assert total_variation(p, q) > 0
    assert lk_hybrid(p, q, acceptance=0.5)[0] > 0
    assert expected_acceptance(p, q) < 1


def test_total_variation_lies_in_zero_one_and_reaches_one_for_disjoint_supports():
    for seed in range(5):
        tv = total_variation(logits(8, seed=seed, scale=5.0), logits(8, seed=seed + 100, scale=5.0))
        assert 0.0 <= float(tv) <= 1.0
    p = torch.full((2, V), -1e4)
    q = torch.full((2, V), -1e4)
    p[:, 0] = q[:, 1] = 0.0
    assert float(total_variation(p, q)) == pytest.approx(1.0, abs=1e-6)
    assert float(expected_acceptance(p, q)) == pytest.approx(0.0, abs=1e-6)


def test_expected_acceptance_is_one_minus_total_variation():
    p, q = logits(3, 5, seed=3), logits(3, 5, seed=4)
    assert float(expected_acceptance(p, q)) == pytest.approx(1.0 - float(total_variation(p, q)), abs=1e-6)


def test_expected_acceptance_carries_no_gradient():
    q = logits(4, seed=5).requires_grad_()
    assert not expected_acceptance(logits(4), q).requires_grad


def test_forward_kl_is_the_mean_over_positions_of_the_textbook_formula():
    p, q = logits(5, seed=6), logits(5, seed=7)
    pp, qq = p.softmax(-1).double(), q.softmax(-1).double()
    expected = (pp * (pp.log() - qq.log())).sum(-1).mean()
    assert float(forward_kl(p, q)) == pytest.approx(float(expected), rel=1e-5)


def test_kl_gradient_in_drafter_logits_is_q_minus_p_and_descent_lowers_it():
    p, q = logits(4, seed=8), logits(4, seed=9).requires_grad_()
    loss = forward_kl(p, q)
    loss.backward()
    expected = (q.detach().softmax(-1) - p.softmax(-1)) / p.shape[0]
    assert torch.allclose(q.grad, expected, atol=1e-6)
    with torch.no_grad():
        assert forward_kl(p, q - 0.5 * q.grad) < loss


def test_tv_passes_a_gradient_to_the_drafter_logits():
    p, q = logits(3, seed=10), logits(3, seed=11).requires_grad_()
    total_variation(p, q).backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_lk_weight_falls_as_acceptance_rises_and_stays_in_zero_one():
    weights = [lk_weight(a) for a in (-0.5, 0.0, 0.2, 0.5, 0.8, 1.0, 1.5)]
    assert weights == sorted(weights, reverse=True)
    assert weights[0] == 1.0 and weights[-1] == 0.0
    p, q = logits(6, seed=12), logits(6, seed=13)
    _, low = lk_hybrid(p, q, acceptance=0.2)
    _, high = lk_hybrid(p, q, acceptance=0.8)
    assert low > high


def test_lk_is_the_lambda_mix_of_kl_and_tv():
    p, q = logits(6, seed=14), logits(6, seed=15)
    loss, lam = lk_hybrid(p, q, acceptance=torch.tensor(0.3))
    assert lam == pytest.approx(0.7)
    assert float(loss) == pytest.approx(0.7 * float(forward_kl(p, q)) + 0.3 * float(total_variation(p, q)), rel=1e-5)


@pytest.mark.parametrize("fn", [forward_kl, total_variation, expected_acceptance])
def test_mask_ignores_positions(fn):
    p, q = logits(2, 5, seed=16), logits(2, 5, seed=17)
    mask = torch.tensor([[True, True, False, True, False], [False, True, True, False, False]])
    masked = fn(p, q, mask)
    assert float(masked) == pytest.approx(float(fn(p[mask], q[mask])), rel=1e-5)
    q2 = q.clone()
    q2[~mask] = 100.0 * torch.randn_like(q2[~mask])
    assert float(fn(p, q2, mask)) == pytest.approx(float(masked), rel=1e-6)


def test_lk_mask_ignores_positions():
    p, q = logits(6, seed=18), logits(6, seed=19)
    mask = torch.tensor([True, False, True, True, False, False])
    assert float(lk_hybrid(p, q, 0.4, mask)[0]) == pytest.approx(float(lk_hybrid(p[mask], q[mask], 0.4)[0]), rel=1e-5)


def test_distribution_loss_dispatches_by_name_and_refuses_unknown_names():
    p, q = logits(3, seed=20), logits(3, seed=21)
    assert distribution_loss("kl", p, q)[1] == 1.0
    assert distribution_loss("tv", p, q)[1] == 0.0
    assert float(distribution_loss("lk", p, q, acceptance=0.25)[0]) == pytest.approx(float(lk_hybrid(p, q, 0.25)[0]))
    with pytest.raises(ValueError, match="unknown loss"):
        distribution_loss("ce", p, q)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="shapes differ"):
        forward_kl(logits(3), logits(4))
