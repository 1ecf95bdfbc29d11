"""drafter.kernels: specloop's int4 / int8 CPU kernels, built for the CPU that runs the suite."""
import pytest
import torch

from drafter import kernels

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="specloop kernels not built on this machine")


def _groups(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    d = torch.rand(N, K // 32, generator=g) * 0.05 + 1e-3
    m = torch.randn(N, K // 32, generator=g) * 0.3
    return q, d, m


@needs_kernels
def test_q4_multiplies_by_q_times_d_plus_m_and_pads_n_to_64():
    N, K = 97, 96  # N padded to 128
    q, d, m = _groups(N, K)
    w = q.double() * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    x = torch.randn(5, K, dtype=torch.float64)
    y = kernels.q4_mm(x.float(), *kernels.pack_q4(q, d, m))
    assert y.shape == (5, 128) and torch.equal(y[:, N:], torch.zeros(5, 128 - N))
    torch.testing.assert_close(y[:, :N].double(), x @ w.t(), rtol=1e-5, atol=1e-4)


@needs_kernels
def test_q8_multiplies_by_q_times_scale():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (50, 64), generator=g, dtype=torch.int8)
    s = torch.rand(50, generator=g) * 0.01
    x = torch.randn(3, 64, dtype=torch.float64)
    y = kernels.q8_mm(x.float(), *kernels.pack_q8(q, s))
    torch.testing.assert_close(y[:, :50].double(), x @ (q.double() * s.double()[:, None]).t(), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_every_row_is_computed_as_it_is_alone_whatever_the_row_count(kind):
    """The property a verify pass needs: rows 1..17 in one call (chunks of 8 and their remainders) give
    each row bit for bit what a one-row call gives it."""
    N, K = 48, 576
    if kind == "q4":
        packed = kernels.pack_q4(*_groups(N, K, seed=2))
        call = lambda x: kernels.q4_mm(x, *packed)  # noqa: E731
    else:
        q = torch.randint(-127, 128, (N, K), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
        packed = kernels.pack_q8(q, torch.rand(N))
        call = lambda x: kernels.q8_mm(x, *packed)  # noqa: E731
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([call(x[i : i + 1]) for i in range(17)])
    for R in range(1, 18):
        assert torch.equal(call(x[:R]), alone[:R]), R


@needs_kernels
def test_thread_count_changes_no_rounding():
    packed = kernels.pack_q4(*_groups(256, 576, seed=5))
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.q4_mm(x, *packed)
        torch.set_num_threads(2)
        assert torch.equal(kernels.q4_mm(x, *packed), one)
    finally:
        torch.set_num_threads(threads)


def test_stock_kernels_can_be_forced(monkeypatch):
    """SPECLOOP_KERNELS=stock: drafter.quant serves torch's own int kernels."""
    from drafter.quant import _kernels_for

    monkeypatch.setenv("SPECLOOP_KERNELS", "stock")
    kernels._module.cache_clear()
    try:
        assert not kernels.available() and _kernels_for("int4", 32) == "stock"
    finally:
        monkeypatch.delenv("SPECLOOP_KERNELS")
        kernels._module.cache_clear()
    assert _kernels_for("int4", 64) == "stock" and _kernels_for("bf16", 32) == "stock"


@needs_kernels
def test_quantized_linears_take_any_leading_shape_and_keep_the_dtype():
    """OwnInt4Weight / OwnInt8Weight as the decoder calls them: [B, T, K] in, [B, T, N] out in the
    activation dtype, bias added, close to the float product."""
    from drafter.quant import OwnInt4Weight, OwnInt8Weight

    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(100, 64, generator=g) * 0.1, torch.randn(100, generator=g)
    x = torch.randn(2, 3, 64, generator=g)
    for lin in (OwnInt4Weight.quantize(w, b, torch.float32), OwnInt8Weight(w, b, torch.float32),
                OwnInt4Weight.quantize(w, b, torch.bfloat16)):
        y = lin(x)
        assert y.shape == (2, 3, 100) and y.dtype == lin.act_dtype
        exact = x @ lin.dequantize().t() + b  # the weight as quantized, in fp32
        tol = 1e-5 if lin.act_dtype == torch.float32 else 0.05  # bf16: the input and output roundings
        torch.testing.assert_close(y.float(), exact, rtol=tol, atol=tol)
        torch.testing.assert_close(lin.dequantize(), w, rtol=0, atol=0.05)


@needs_kernels
def test_the_load_time_self_check_accepts_this_build_and_refuses_wrong_or_row_dependent_ones():
    mod = kernels._module()
    assert kernels._self_check(mod)

    class Off:  # right rows, wrong values
        q4_mm = staticmethod(lambda x, *w: mod.q4_mm(x, *w) * 1.01)
        q8_mm = staticmethod(mod.q8_mm)

    class RowDependent:  # right values, but a row's result depends on the call's row count
        q4_mm = staticmethod(lambda x, *w: mod.q4_mm(x, *w) * (1 + 1e-5 * (x.shape[0] > 1)))
        q8_mm = staticmethod(mod.q8_mm)

    assert not kernels._self_check(Off) and not kernels._self_check(RowDependent)
