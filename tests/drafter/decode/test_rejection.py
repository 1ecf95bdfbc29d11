import torch

from specloop.drafter.decode.rejection import greedy_verdict, rejection_sample
from tests.stats import chi2_pvalue


def test_greedy_accepts_the_leading_drafts_that_match_the_argmax():
    logits = torch.full((2, 4, 6), -5.0)
    for b, target in enumerate([[1, 2, 3, 4], [1, 5, 3, 2]]):
        logits[b, torch.arange(4), torch.tensor(target)] = 5.0
    out = greedy_verdict(torch.tensor([[1, 2, 3], [1, 2, 3]]), logits.argmax(dim=-1))
    assert out.num_accepted.tolist() == [3, 1]
    assert out.tokens[0].tolist() == [1, 2, 3, 4]  # all accepted + bonus
    assert out.tokens[1, :2].tolist() == [1, 5]  # recovered token at the first mismatch


def _one_step(p, q, n=200_000, seed=0):
    """k = 1 with drafts drawn from q: returns the emitted first tokens and acceptance counts."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
    probs_q = q.expand(n, 1, -1)
    probs_p = p.expand(n, 2, -1)
    out = rejection_sample(drafts, probs_q, probs_p, torch.rand(n, 2, generator=g))
    return out.tokens[:, 0], out.num_accepted


def test_first_emitted_token_is_distributed_as_the_target():
    p = torch.tensor([0.1, 0.4, 0.3, 0.2, 0.0])
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])
    first, accepted = _one_step(p, q)
    counts = torch.bincount(first, minlength=5)
    assert counts[4] == 0  # p = 0: never emitted, even though the drafter proposes it
    assert chi2_pvalue(counts, p) > 0.01
    expected_alpha = torch.minimum(p, q).sum().item()  # P(accept) = Σ min(p, q)
    assert abs(accepted.float().mean().item() - expected_alpha) < 0.01


def test_identical_distributions_accept_every_draft():
    p = torch.tensor([0.25, 0.25, 0.5])
    _, accepted = _one_step(p, p, n=10_000)
    assert bool(accepted.eq(1).all())


def test_drafts_with_zero_target_mass_are_always_rejected():
    p = torch.tensor([0.0, 1.0, 0.0])
    q = torch.tensor([1.0, 0.0, 0.0])
    first, accepted = _one_step(p, q, n=1000)
    assert accepted.sum() == 0 and bool(first.eq(1).all())
