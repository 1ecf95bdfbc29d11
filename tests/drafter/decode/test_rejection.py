import pytest
import torch

from specloop.drafter.decode.rejection import (
    BlockOutcome,
    compiled_verdict,
    greedy_verdict,
    no_accepts,
    rejection_sample,
)
from specloop.drafter.decode.sampling import RowParams, SamplingParams, sample, warp
from specloop.drafter.model import kernels
from tests.stats import chi2_pvalue


def test_greedy_accepts_the_leading_drafts_that_match_the_argmax():
    logits = torch.full((2, 4, 6), -5.0)
    for b, target in enumerate([[1, 2, 3, 4], [1, 5, 3, 2]]):
        logits[b, torch.arange(4), torch.tensor(target)] = 5.0
    out = greedy_verdict(torch.tensor([[1, 2, 3], [1, 2, 3]]), logits.argmax(dim=-1))
    assert out.num_accepted.tolist() == [3, 1]
    assert out.tokens[0].tolist() == [1, 2, 3, 4]  # all accepted + bonus
    assert out.tokens[1, :2].tolist() == [1, 5]  # recovered token at the first mismatch


@pytest.mark.parametrize("limited", [False, True])
def test_a_host_verdict_is_the_tensor_forms_counts_and_its_lists_are_the_outcomes(limited):
    g = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, 3, (64, 4), generator=g)  # three symbols: long runs of matches and early misses
    target = torch.randint(0, 3, (64, 5), generator=g)
    limit = torch.randint(0, 5, (64,), generator=g) if limited else None
    out = greedy_verdict(drafts, target, limit)
    runs = (drafts == target[:, :-1]).long().cumprod(dim=-1).sum(dim=-1)
    expected = runs if limit is None else torch.minimum(runs, limit)
    assert out.num_accepted.tolist() == expected.tolist()
    assert 0 < int((expected > 0).sum()) < 64 and (not limited or bool((runs > limit).any()))  # both cases met
    assert [out.emitted(b) for b in range(64)] == [target[b, : int(n) + 1].tolist() for b, n in enumerate(expected)]
    assert out.last_tokens.tolist() == target[torch.arange(64), expected].tolist()


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


def _residual_draw(p0: torch.Tensor, u0: torch.Tensor) -> torch.Tensor:
    """The general path's draw after an empty draft, written out: norm(max(0, p − q)) with q = 0, p where it is
    empty, drawn by inverse CDF."""
    residual = (p0 - torch.zeros_like(p0)).clamp_(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) <= 0, p0, residual)
    cdf = residual.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u0[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=p0.shape[-1] - 1)


def test_an_empty_draft_draws_the_same_token_as_the_residual_of_a_zero_q():
    """The plain step's shortcut (`plain_sample`) gives the bits of the general rule with q = 0, rows with top-k
    zeros and one-hot rows included, with or without per-row limits, and accepts nothing."""
    g = torch.Generator().manual_seed(3)
    V, B = 4099, 64
    logits = torch.randn(B, 1, V, generator=g) * 4
    logits[::3, :, V // 2:] = float("-inf")  # top-k-like zeros
    logits[1::7, :, :] = float("-inf")
    logits[1::7, :, 5] = 0.0  # one-hot rows
    p = torch.softmax(logits, dim=-1)
    u = torch.rand(B, 1, generator=g)
    u[0, 0], u[2, 0] = 0.0, 1.0 - 2 ** -24
    want = _residual_draw(p[:, 0], u[:, 0])
    empty = torch.zeros(B, 0, dtype=torch.long)
    for limit in (None, torch.zeros(B, dtype=torch.long)):
        out = rejection_sample(empty, torch.zeros(B, 0, V), p, u, limit=limit)
        assert out.tokens.shape == (B, 1) and torch.equal(out.tokens[:, 0], want)
        assert torch.equal(out.num_accepted, torch.zeros(B, dtype=torch.long))
    assert bool((want[1::7] == 5).all()) and bool((want[::3] < V // 2).all())


def test_the_last_tokens_are_each_rows_token_at_its_count_and_a_plain_steps_its_one_column():
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert BlockOutcome(tokens, torch.tensor([2, 0])).last_tokens.tolist() == [7, 8]
    plain = BlockOutcome(torch.tensor([[3], [4]]), no_accepts(2, torch.device("cpu")))
    assert plain.last_tokens.tolist() == [3, 4] and plain.num_accepted.tolist() == [0, 0]
    assert no_accepts(2, torch.device("cpu")) is plain.num_accepted  # made once, shared by every plain step
    assert greedy_verdict(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[1], [2]])).num_accepted is plain.num_accepted


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="specloop kernels not built on this machine")


@needs_kernels
@pytest.mark.parametrize("lookup", [False, True])
def test_the_compiled_verdict_is_the_rejection_samplers_on_warped_logits(lookup):
    g = torch.Generator().manual_seed(2)
    B, k, V = 6, 4, 3000
    mismatches = 0
    for trial in range(60):
        logits = torch.randn(B, k + 1, V, generator=g) * 2
        logits[:, :, ::11] = float("-inf")  # masked tokens
        params = SamplingParams(temperature=(0.5, 1.0, 1.6)[trial % 3])
        p = warp(logits, params)
        if lookup:  # a lookup's drafts, q one-hot; the first often the most likely token
            drafts = torch.randint(0, V, (B, k), generator=g)
            drafts[:, 0] = p[:, 0].argmax(-1)
            q = torch.zeros(B, k, V).scatter_(-1, drafts[..., None], 1.0)
        else:  # a model's drafts from a q near p: several accepted
            q = warp(logits[:, :k] + 0.3 * torch.randn(B, k, V, generator=g), params)
            drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, k)
        u = torch.rand(B, k + 1, generator=g)
        limit = torch.randint(0, k + 1, (B,), generator=g) if trial % 2 else None
        want = rejection_sample(drafts, q, p, u, limit=limit)
        got = compiled_verdict(drafts, q, logits, params, u, limit)
        assert got is not None
        if lookup:  # one-hot drafts as they are, q never made: the same verdict
            same = compiled_verdict(drafts, None, logits, params, u, limit, one_hot=True)
            assert torch.equal(same.tokens, got.tokens) and torch.equal(same.num_accepted, got.num_accepted)
        mismatches += int(not (torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.tokens, want.tokens)))
        if limit is not None:
            assert bool((got.num_accepted <= limit).all())
    assert mismatches <= 1  # the same verdicts but where a uniform falls within float rounding of an edge


@needs_kernels
def test_the_compiled_verdict_judges_greedy_rows_by_argmax_and_leaves_what_it_cannot_to_the_ops():
    g = torch.Generator().manual_seed(4)
    k, V = 3, 500
    logits = torch.randn(3, k + 1, V, generator=g)
    target = logits.argmax(-1)
    drafts = target[:, :k].clone()
    drafts[2, 1] = (drafts[2, 1] + 1) % V  # row 2's second draft is not the argmax
    q = torch.zeros(3, k, V).scatter_(-1, drafts[..., None], 1.0)
    u = torch.rand(3, k + 1, generator=g)
    params = RowParams((SamplingParams(), SamplingParams(temperature=1.0), SamplingParams()))
    got = compiled_verdict(drafts, q, logits, params, u, torch.tensor([3, 3, 3]))
    greedy = greedy_verdict(drafts, target)
    assert got.num_accepted[0] == 3 and got.num_accepted[2] == 1
    assert torch.equal(got.tokens[[0, 2]], greedy.tokens[[0, 2]])
    alone = compiled_verdict(drafts[1:2], q[1:2], logits[1:2], params.rows[1], u[1:2])
    assert torch.equal(got.tokens[1], alone.tokens[0]) and got.num_accepted[1] == alone.num_accepted[0]
    nan = logits.clone()
    nan[1, 0, 7] = float("nan")  # where the row is judged first (a NaN after its rejection is never read)
    assert compiled_verdict(drafts, q, nan, params, u) is None
    assert compiled_verdict(drafts, q, logits, SamplingParams(temperature=1.0, top_p=0.9), u) is None
    assert compiled_verdict(drafts, q.bfloat16(), logits, SamplingParams(temperature=1.0), u) is None
    assert compiled_verdict(drafts, None, logits, SamplingParams(temperature=1.0), u) is None  # q unknown


@needs_kernels
def test_the_compiled_verdicts_first_token_follows_the_target():
    p_logits = torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2, 1e-30]))
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])
    n = 100_000
    g = torch.Generator().manual_seed(9)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
    out = compiled_verdict(drafts, q.expand(n, 1, -1).contiguous(), p_logits.expand(n, 2, -1).contiguous(),
                           SamplingParams(temperature=1.0), torch.rand(n, 2, generator=g))
    p = torch.softmax(p_logits.double(), -1)
    assert chi2_pvalue(torch.bincount(out.tokens[:, 0], minlength=5).tolist(), p.tolist()) > 1e-3
    accept_rate = float(out.num_accepted.double().mean())
    assert abs(accept_rate - float(torch.minimum(p, q.double()).sum())) < 0.01  # Σ min(p, q)


def plain(logits, params, u):
    """A plain step's tokens [B] (logits [B, V], u [B]) through the compiled verdict with an empty draft; None where it
    leaves the step to the ops."""
    B = len(logits)
    judged = compiled_verdict(torch.empty(B, 0, dtype=torch.long), None, logits.reshape(B, 1, -1), params,
                              u.reshape(B, 1), one_hot=True)
    return None if judged is None else judged.tokens[:, 0]


@needs_kernels
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_a_plain_steps_compiled_draw_is_warp_and_sample_up_to_float_rounding(temperature):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 49152, generator=g) * torch.linspace(0.5, 12, 64)[:, None]
    logits[::3, ::7] = float("-inf")  # masked tokens (a grammar, a logit bias): never drawn
    u = torch.rand(64, generator=g)
    u[0], u[1] = 0.0, 1.0 - 2**-24
    params = SamplingParams(temperature=temperature)
    got = plain(logits, params, u)
    probs = warp(logits, params)
    want = sample(probs, u)
    assert got is not None and got.dtype == torch.long
    cdf = probs.double().cumsum(-1)
    target = u.double() * cdf[:, -1]
    for b in torch.nonzero(got != want).flatten().tolist():  # only where u is within rounding of an edge
        assert abs(cdf[b, want[b]] - target[b]) < 1e-5 or abs(cdf[b, want[b] - 1] - target[b]) < 1e-5, b
    assert int((got != want).sum()) <= 1
    assert not bool(torch.isinf(logits[torch.arange(64), got]).any())
    assert got[0] == 1  # u = 0 in a row whose token 0 is masked: the first token with mass


@needs_kernels
def test_a_plain_steps_compiled_draw_follows_the_tempered_distribution_in_a_vocabulary_of_no_whole_block():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 300, generator=g) * 2  # 300: a block of 256 and a tail
    n, temperature = 20_000, 0.8
    u = torch.rand(n, generator=g)
    drawn = torch.cat([plain(logits.expand(1000, -1).contiguous(), SamplingParams(temperature=temperature),
                                  u[i : i + 1000]) for i in range(0, n, 1000)])
    p = torch.softmax(logits[0].double() / temperature, dim=-1)
    assert chi2_pvalue(torch.bincount(drawn, minlength=300).tolist(), p.tolist()) > 1e-3


@needs_kernels
def test_a_plain_steps_compiled_draw_takes_each_row_alone_and_leaves_what_it_cannot_draw_to_the_ops():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 1000, generator=g)
    u = torch.rand(4, generator=g)
    rows = RowParams((SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.5),
                      SamplingParams(temperature=1.0, seed=3)))
    got = plain(logits, rows, u)
    assert got is not None and got[0] == logits[0].argmax()  # a greedy row: its argmax
    for b in (1, 2, 3):  # a sampled row: its own draw, whatever the other rows hold
        alone = plain(logits[b : b + 1], rows.rows[b], u[b : b + 1])
        garbage = logits.clone()
        garbage[torch.arange(4) != b] = torch.randn(3, 1000, generator=g) * 100
        assert got[b] == alone[0] == plain(garbage, rows, u)[b]
    nan = logits.clone()
    nan[2, 10] = float("nan")
    assert plain(nan, rows, u) is None  # the ops' NaN semantics decide
    assert plain(torch.full((1, 1000), float("-inf")), SamplingParams(temperature=1.0), u[:1]) is None
    for params in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=5),
                   SamplingParams(temperature=1.0, min_p=0.1)):
        assert plain(logits, params, u) is None
    assert plain(logits.double(), SamplingParams(temperature=1.0), u) is None
