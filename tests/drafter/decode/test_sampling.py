import pytest
import torch

from specloop.drafter.decode.sampling import (
    SamplingParams,
    argmax,
    draw_uniforms,
    make_generators,
    sample,
    sample_by_ops,
    warp,
)
from specloop.drafter.model import kernels
from tests.stats import chi2_pvalue


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = warp(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))


def test_top_k_keeps_exactly_the_k_most_likely_tokens():
    probs = warp(torch.tensor([[0.1, 3.0, 2.0, -1.0, 1.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, True, False, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    only_top = warp(logits, SamplingParams(temperature=1.0, top_p=0.1))
    torch.testing.assert_close(only_top, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_zero_mass():
    p = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    u = torch.rand(50_000, generator=torch.Generator().manual_seed(0))
    draws = sample(p.expand(len(u), -1), u)
    counts = torch.bincount(draws, minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    assert chi2_pvalue(counts, p) > 0.01
    edge = sample(p[None].expand(2, -1), torch.tensor([0.0, 1.0 - 2**-24]))
    assert edge.tolist() == [0, 3]


def test_each_request_owns_a_reproducible_stream():
    a = draw_uniforms(make_generators(7, 3), 4)
    b = draw_uniforms(make_generators(7, 3), 4)
    c = draw_uniforms(make_generators(7, 1, start=2), 4)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[2:], c)
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a, draw_uniforms(make_generators(8, 3), 4))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(max_tokens=0)])
def test_bad_sampling_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def _top_p_sorted(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p over the whole vocabulary sorted: the rule `_top_p` must reproduce."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(mass_before >= top_p, 0.0))
    return kept / kept.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])  # nuclei of thousands of tokens, of hundreds, of a few
def test_top_p_on_the_most_likely_tokens_gives_the_bits_of_the_whole_vocabulary_sorted(scale):
    """The CPU's top-p orders only the most likely tokens (64, then 8× while the nucleus may reach past them):
    the same probabilities, bit for bit, as sorting all 49,152 of them, for [B, T, V] blocks whose rows need
    different candidate counts, and top_p near 0 and 1."""
    from specloop.drafter.decode import sampling

    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(3, 4, 49152, generator=g) * scale
    logits[0, 1] *= 20  # one peaked row beside flat ones
    probs = torch.softmax(logits, dim=-1)
    for top_p in (0.01, 0.5, 0.9, 0.999):
        got = sampling._top_p(probs, top_p)
        assert torch.equal(got, _top_p_sorted(probs, top_p)), top_p
    flat = torch.full((1, 1000), 1e-3)  # ties everywhere: the nucleus still holds the mass asked for
    assert (sampling._top_p(flat, 0.5) > 0).sum() == 500


def test_argmax_is_torchs_argmax_first_of_equal_maxima_and_nan_as_the_largest():
    g = torch.Generator().manual_seed(0)
    nan_rows = torch.randint(-3, 3, (3, 7), generator=g).float()
    nan_rows[:, 2::3] = float("nan")
    for x in (torch.randint(-3, 3, (1, 1, 49152), generator=g).float(), torch.randint(-3, 3, (8, 5, 1000)).float(),
              nan_rows):  # many ties for the maximum
        got = argmax(x)
        shape = x.shape
        assert got.dtype == torch.long and got.shape == shape[:-1]
        assert torch.equal(got, x.argmax(dim=-1))
    for row in ([1.0, float("nan"), 5.0, float("nan")], [float("-inf")] * 3, [-0.0, 0.0], [float("inf"), float("nan")]):
        x = torch.tensor([row], dtype=torch.float64)
        assert torch.equal(argmax(x), x.argmax(dim=-1))
    half = torch.randn(2, 300, generator=g).bfloat16()  # no numpy bfloat16: torch's own
    assert torch.equal(argmax(half), half.argmax(dim=-1))


@pytest.mark.skipif(not kernels.available(), reason="specloop kernels not built on this machine")
def test_the_compiled_draw_is_the_ops_draw_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(64, 49152, generator=g) * torch.linspace(0.1, 8, 64)[:, None], dim=-1)
    probs[1] *= 3.0  # unnormalised
    probs[2] = 0.0  # no mass: the last token, as the ops give it
    probs[3, 100:] = 0.0  # a short support: u near 1 lands on its last token
    probs[4, 7] = float("nan")
    u = torch.rand(64, generator=g)
    u[3], u[5], u[6] = 1.0 - 2**-24, 0.0, 0.5
    got = sample(probs, u)
    assert got.dtype == torch.long and torch.equal(got, sample_by_ops(probs, u))
    assert got[2] == 49151 and got[3] < 100
    edges = probs[:8].cumsum(-1)  # a uniform exactly at a cumulative mass: the next token
    at = torch.tensor([0.25, 0.5, 0.75, 0.99, 0.01, 0.3, 0.6, 0.9])
    u_at = (edges[torch.arange(8), (at * 49151).long()] / edges[:, -1]).float()
    assert torch.equal(sample(probs[:8], u_at), sample_by_ops(probs[:8], u_at))
    strided = probs.view(8, 8, 49152)[:, 0]  # a view of every eighth row, as a verify pass's first position
    assert torch.equal(sample(strided, u[:8]), sample_by_ops(strided, u[:8]))

