"""specloop.drafter.model.kernels: specloop's int4 / int8 CPU kernels, built for the CPU that runs the suite."""
import itertools
import os
import shutil

import pytest
import torch

from specloop.drafter.model import kernels

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="specloop kernels not built on this machine")


def _groups(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    d = torch.rand(N, K // 32, generator=g) * 0.05 + 1e-3
    m = torch.randn(N, K // 32, generator=g) * 0.3
    return q, d.half().float(), m.half().float()  # fp16 values, as a GGUF stores them (the kernels keep fp16)


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
@pytest.mark.parametrize("kind", ["q4", "w4a8"])
def test_thread_count_changes_no_rounding(kind):
    packed = (kernels.pack_q4 if kind == "q4" else kernels.pack_w4a8)(*_groups(256, 576, seed=5))
    call = kernels.q4_mm if kind == "q4" else kernels.w4a8_mm
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call(x, *packed)
        torch.set_num_threads(2)
        assert torch.equal(call(x, *packed), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(os.environ.get("SPECLOOP_KERNELS") == "stock" or shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler here (or the stock kernels asked for): the stock kernels serve")
def test_the_kernels_build_and_pass_their_self_check_wherever_a_compiler_is_at_hand():
    """A build that fails, or fails its self-check, falls back to the stock kernels and every test of the kernels
    below skips: on a machine with a compiler that is a failure to see, not a skip."""
    assert kernels.available()


def test_stock_kernels_can_be_forced(monkeypatch):
    """SPECLOOP_KERNELS=stock: specloop.drafter.model.weights.quant serves torch's own int kernels."""
    from specloop.drafter.model.weights.modes import _kernels_for

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
    from specloop.drafter.model.weights.own_linears import OwnInt4Weight, OwnInt8Weight

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


def _attention_reference(qkv, cache_k, cache_v, cos, sin, start, H, written=False):
    """float64 RoPE + causal softmax attention of one row's T new tokens after `start` cached ones (`written`: the
    new tokens' keys and values too read from the cache, as the call wrote them)."""
    T, D = qkv.shape[0], cache_k.shape[-1]
    Hkv = cache_k.shape[0]
    x = qkv.double().view(T, H + 2 * Hkv, D)
    pos = torch.arange(start, start + T)
    half = D // 2

    def rope(t):
        return t * cos[pos, None].double() + torch.cat([-t[..., half:], t[..., :half]], -1) * sin[pos, None].double()

    keys = torch.cat([cache_k[:, :start].double(), rope(x[:, H : H + Hkv]).transpose(0, 1)], 1)
    values = torch.cat([cache_v[:, :start].double(), x[:, H + Hkv :].transpose(0, 1)], 1)
    if written:
        keys, values = cache_k[:, : start + T].double(), cache_v[:, : start + T].double()
    rep = H // Hkv
    q = rope(x[:, :H]).transpose(0, 1)  # [H, T, D]
    scores = q @ keys.repeat_interleave(rep, 0).transpose(1, 2) * 0.125  # [H, T, start + T]
    scores = scores.masked_fill(torch.ones(T, start + T, dtype=torch.bool).triu(start + 1), float("-inf"))
    return (scores.softmax(-1) @ values.repeat_interleave(rep, 0)).transpose(0, 1).reshape(T, H * D)


@needs_kernels
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attend_writes_the_cache_and_matches_a_float64_attention_bit_identical_across_t_and_batch(D, dtype):
    """SmolLM2's shapes (9 query heads over 3 KV heads, D = 64; and the other head sizes), rows of
    different lengths: one call over T tokens equals T one-token calls bit for bit and each row alone bit
    for bit, and all of them match a float64 RoPE + softmax attention. A 16-bit cache (`--kv-cache-dtype
    bfloat16 | float16`) holds the fp32 cache's keys and values rounded as torch rounds (nearest even), and the
    outputs match a float64 attention over what it holds."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, C = 3, 9, 3, 448
    cos, sin = torch.rand(C, D, generator=g), torch.rand(C, D, generator=g)
    starts = torch.tensor([0, 37, 301])
    history = [torch.randn(B, Hkv, C, D, generator=g).to(dtype) for _ in range(2)]
    qkv = torch.randn(B, 9, (H + 2 * Hkv) * D, generator=g)

    def run(rows, chunks, kv=dtype):
        kc, vc = history[0][rows].to(kv), history[1][rows].to(kv)
        lens, outs = starts[rows].clone(), []
        for a, b in chunks:
            outs.append(kernels.attend(qkv[rows, a:b], kc, vc, cos, sin, lens, H, 0.125))
            lens += b - a
        return torch.cat(outs, 1), kc, vc

    whole, kc, vc = run(torch.arange(B), [(0, 9)])
    assert kc.dtype == dtype and whole.dtype == torch.float32
    assert torch.equal(whole, run(torch.arange(B), [(t, t + 1) for t in range(9)])[0])
    assert torch.equal(whole, run(torch.arange(B), [(0, 4), (4, 9)])[0])
    _, kc32, vc32 = run(torch.arange(B), [(0, 9)], torch.float32)
    assert torch.equal(kc, kc32.to(dtype)) and torch.equal(vc, vc32.to(dtype))
    for b in range(B):
        assert torch.equal(whole[b], run(torch.tensor([b]), [(0, 9)])[0][0])
        n = int(starts[b])
        ref = _attention_reference(qkv[b], kc[b], vc[b], cos, sin, n, H, written=dtype != torch.float32)
        torch.testing.assert_close(whole[b].double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(kc[b, :, :n], history[0][b, :, :n])  # earlier positions untouched
        new_values = qkv[b].view(9, H + 2 * Hkv, D)[:, H + Hkv :].transpose(0, 1)
        assert torch.equal(vc[b, :, n : n + 9], new_values.to(dtype))
    with pytest.raises(RuntimeError, match="both fp32, bf16 or fp16"):
        kernels.attend(qkv[:1], kc[:1], vc32[:1].to(torch.float16 if dtype == torch.bfloat16 else torch.bfloat16),
                       cos, sin, starts[:1], H, 0.125)


@needs_kernels
@pytest.mark.parametrize("T", [1, 4, 9])
def test_attend_splits_rows_of_unequal_lengths_over_any_thread_count_without_changing_a_bit(T):
    """A batch whose rows' lengths differ by 50x (the threads' shares are even in keys read, not in units of
    work): 1, 2, 3 and 5 threads give the same bits, every row equal to the float64 attention (a unit of work
    that no thread took would leave its outputs unwritten)."""
    g = torch.Generator().manual_seed(5)
    B, H, Hkv, C, D = 4, 9, 3, 1100, 64
    cos, sin = torch.rand(C, D, generator=g), torch.rand(C, D, generator=g)
    starts = torch.tensor([1000, 20, 333, 0])
    history = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g)
    saved, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            kc, vc = history[0].clone(), history[1].clone()
            outs.append(kernels.attend(qkv, kc, vc, cos, sin, starts.clone(), H, 0.125))
    finally:
        torch.set_num_threads(saved)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    for b in range(B):
        ref = _attention_reference(qkv[b], history[0][b], history[1][b], cos, sin, int(starts[b]), H)
        torch.testing.assert_close(outs[0][b].double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_attend_refuses_a_full_cache():
    kc = torch.zeros(1, 1, 16, 32)
    with pytest.raises(RuntimeError, match="KV cache full"):
        kernels.attend(torch.zeros(1, 2, 3 * 32), kc, kc.clone(), torch.zeros(64, 32), torch.zeros(64, 32),
                       torch.tensor([15]), 1, 1.0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_swiglu_match_torch_and_compute_each_row_alone(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    w = torch.rand(576, generator=g) + 0.5
    normed = kernels.rms_norm(x, w, 1e-5)
    assert normed.dtype == dtype and normed.shape == x.shape
    ref = torch.nn.functional.rms_norm(x.float(), (576,), w, 1e-5)
    torch.testing.assert_close(normed.float(), ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    gate_up = (torch.randn(2, 3, 2 * 1536, generator=g) * 6).to(dtype)  # gates far into both tails of silu
    out = kernels.silu_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert out.shape == (2, 3, 1536) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), torch.nn.functional.silu(gate) * up, rtol=tol, atol=tol)
    for r in range(7):
        assert torch.equal(kernels.rms_norm(x[r : r + 1], w, 1e-5), normed[r : r + 1])
    assert torch.equal(kernels.silu_mul(gate_up[:, 1:2]), out[:, 1:2])


@needs_kernels
def test_w4a8_multiplies_int8_rounded_activations_by_q_times_d_plus_m_each_row_alone():
    """int4 weights (N not a multiple of 64) times activations rounded to int8 per group of 32, as the
    kernel documents it (`quantized_rows`): equal to a float64 product of those values, every row of a
    1..40-row call (the AVX2 build's runs of 16 and 8 rows and the tiles' chunks of 4 for the rest) equal to
    the row alone, and the packing round-trips."""
    q, d, m = _groups(200, 576, seed=8)
    packed = kernels.pack_w4a8(q, d, m)
    for runs in (1, 2, 4):  # blocks whose groups are interleaved: the build's own (4 on AVX-512, else 1) and others
        again = kernels.pack_w4a8(q, d, m, interleave=runs)
        assert all(torch.equal(a, b) for a, b in zip(kernels.unpack_w4a8(*again, 200, interleave=runs), (q, d, m)))
        assert all(torch.equal(a, b) for a, b in zip(again, packed)) == (runs == kernels._interleave())
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(9)) * 2
    xq, dx, sx = kernels.quantized_rows(x)
    assert int(xq.abs().max()) == 127 and torch.allclose(dx * xq.view(9, 18, 32).sum(-1).float(), sx)
    acts = xq.double().view(9, 18, 32) * dx.double()[..., None]
    w = q.double() * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    exact = acts.view(9, 576) @ w.t()
    alone = torch.cat([kernels.w4a8_mm(x[i : i + 1], *packed) for i in range(9)])
    assert alone.shape == (9, 256) and torch.equal(alone[:, 200:], torch.zeros(9, 56))
    torch.testing.assert_close(alone[:, :200].double(), exact, rtol=1e-5, atol=1e-4)
    assert (alone[:, :200].double() - x.double() @ w.t()).abs().max() > 1e-3  # the activations really are rounded
    more = torch.randn(40, 576, generator=torch.Generator().manual_seed(10)) * 2
    alone = torch.cat([kernels.w4a8_mm(r[None], *packed) for r in more])
    for R in (*range(1, 12), 15, 16, 17, 23, 24, 25, 31, 32, 33, 40):
        assert torch.equal(kernels.w4a8_mm(more[:R], *packed), alone[:R]), R


@needs_kernels
def test_w8a8_multiplies_q8_0_blocks_by_int8_rounded_activations_and_looks_rows_up_exactly():
    g = torch.Generator().manual_seed(10)
    q = torch.randint(-127, 128, (100, 576), generator=g, dtype=torch.int8)
    d = (torch.rand(100, 18, generator=g) * 0.02).half().float()
    packed = kernels.pack_w8a8(q, d)
    w = q.double() * d.double().repeat_interleave(32, 1)
    ids = torch.tensor([[0, 99, 17], [64, 63, 5]])
    assert torch.equal(kernels.w8a8_rows(*packed, ids).double(), w[ids])  # q · d, the table's own values
    assert torch.equal(kernels.w8a8_rows_by_ops(*packed, ids).double(), w[ids])
    with pytest.raises(RuntimeError, match="outside the table"):  # past the packed blocks (100 rows, padded to 128)
        kernels.w8a8_rows(*packed, torch.tensor([128]))
    x = torch.randn(9, 576, generator=g)
    xq, dx, _ = kernels.quantized_rows(x)
    exact = (xq.double().view(9, 18, 32) * dx.double()[..., None]).view(9, 576) @ w.t()
    alone = torch.cat([kernels.w8a8_mm(x[i : i + 1], *packed) for i in range(9)])
    torch.testing.assert_close(alone[:, :100].double(), exact, rtol=1e-5, atol=1e-4)
    for R in range(1, 10):
        assert torch.equal(kernels.w8a8_mm(x[:R], *packed), alone[:R])
    with pytest.raises(ValueError, match="-127"):
        kernels.pack_w8a8(torch.full((64, 32), -128, dtype=torch.int8), torch.ones(64, 1))


@needs_kernels
@pytest.mark.parametrize("N", [100, 2048, 5000])
def test_w8a8_choose_finds_the_argmax_of_the_product_it_returns(N):
    """`w8a8_choose` (an LM head's logits and greedy choices in one call): the same product as `w8a8_linear`, bit for
    bit, and numpy's argmax of it for every row (ties: the first; widths that cut a vector, several threads' shares);
    a row holding a NaN is reported, not chosen."""
    from specloop.drafter.decode.sampling import argmax

    g = torch.Generator().manual_seed(11)
    q = torch.randint(-127, 128, (N, 64), generator=g, dtype=torch.int8)
    q[N // 2] = q[N // 3] = q[7]  # equal rows: equal logits, the lowest index wins a tie
    q[7] = torch.where(torch.arange(64) % 2 == 0, 127, -127).to(torch.int8)  # a row some inputs make the largest
    q[N // 2] = q[N // 3] = q[7]
    d = torch.full((N, 2), 0.01).half().float()
    packed = kernels.pack_w8a8(q, d)
    x = torch.randn(2, 5, 64, generator=g)
    x[0, 0] = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)  # row 0's maximum is the tied rows'
    y, choices = kernels.w8a8_choose(x, *packed, N)
    assert torch.equal(y, kernels.linear_op("w8a8")(x, *packed, N))
    assert torch.equal(y, kernels.w8a8_mm(x.reshape(10, 64), *packed)[:, :N].reshape(2, 5, N))
    assert choices is not None and choices.shape == (2, 5) and torch.equal(choices, argmax(y))
    assert int(choices[0, 0]) == 7  # the first of the three equal maxima
    x[1, 2, 3] = float("inf")  # a row's outputs NaN (its int8 rounding's scale inf)
    y, choices = kernels.w8a8_choose(x, *packed, N)
    assert choices is None and torch.isnan(y[1, 2]).all()


def _w4a8_layer(Hd, H, Hkv, D, I, g):
    """A random SwiGLU layer of four w4a8 linears: (dims, packed parts) as `kernels.layer` takes them."""
    dims, parts = [(H + 2 * Hkv) * D, Hd, 2 * I, Hd], []
    for n, k in zip(dims, [Hd, H * D, Hd, I]):
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        d = (torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3).half().float()
        parts += kernels.pack_w4a8(q, d, (torch.randn(n, k // 32, generator=g) * 0.3).half().float())
    return dims, parts


@needs_kernels
@pytest.mark.parametrize("shape", [(96, 3, 1, 32, 160), (576, 9, 3, 64, 1536)], ids=["small", "smollm2"])
def test_a_w4a8_layer_in_one_parallel_region_is_the_step_by_step_layer_bit_for_bit(shape):
    """`layer` runs four w4a8 linears in one parallel region (csrc/region.cpp): its output and the keys and
    values it writes equal `layer_by_ops` (RMSNorm, products, attend, SwiGLU one call each) bit for bit, for
    one token and for verify- and prefill-shaped steps, rows of different lengths, on 1-3 threads (products
    split by blocks of 16 outputs, 576 of them not a multiple of the tiles' 64)."""
    Hd, H, Hkv, D, I = shape
    g = torch.Generator().manual_seed(11)
    dims, parts = _w4a8_layer(Hd, H, Hkv, D, I, g)
    C = 64
    angles = torch.arange(C)[:, None] * torch.rand(D // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    norms = torch.rand(Hd, generator=g) + 0.5, torch.rand(Hd, generator=g) + 0.5
    module, threads = kernels._module(), torch.get_num_threads()
    try:
        for (B, T), n in itertools.product([(1, 1), (1, 5), (3, 2), (2, 17)], (1, 2, 3)):
            torch.set_num_threads(n)
            lens = torch.randint(0, C - T, (B,), generator=g)
            kv = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
            x = torch.randn(B, T, Hd, generator=g) * 3
            outs = []
            for run in (module.layer, module.layer_by_ops):
                kc, vc = kv[0].clone(), kv[1].clone()
                y = run(x, *norms, 1e-5, [2] * 4, dims, parts, kc, vc, cos, sin, lens, H, D**-0.5)
                outs.append((y, kc, vc))
            (y, kc, vc), (y_ref, kc_ref, vc_ref) = outs
            assert torch.equal(y, y_ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), (B, T, n)
            assert not torch.equal(kc, kv[0])  # the step wrote its keys
    finally:
        torch.set_num_threads(threads)


def _with_amx(on, call):
    """call() with the int8 products' AMX tiles turned on or off (then as they were)."""
    was = kernels.amx_in_use()
    try:
        kernels.set_amx(on)
        return call()
    finally:
        kernels.set_amx(was)


needs_amx = pytest.mark.skipif(not (kernels.available() and kernels.set_amx(True)),
                               reason="no AMX-INT8 on this CPU (or not lent to the process): the vector tiles alone")


@needs_amx
def test_amx_tiles_are_on_by_default_and_specloop_amx_off_turns_them_off_at_load(monkeypatch):
    assert kernels.amx_in_use()
    monkeypatch.setenv("SPECLOOP_AMX", "off")
    kernels._module.cache_clear()
    try:
        assert kernels.available() and not kernels.amx_in_use()
    finally:
        monkeypatch.delenv("SPECLOOP_AMX")
        kernels._module.cache_clear()
        kernels.set_amx(True)
    assert kernels.amx_in_use()


@needs_amx
@pytest.mark.parametrize("N, K", [(200, 576), (576, 1536), (64, 32), (80, 96)])
def test_w4a8_rows_on_amx_tiles_are_the_vector_tiles_bits_and_each_row_alone(N, K):
    """From 32 rows on, w4a8 products take 16 rows' integer sums at a time from AMX tile products: every row
    equals the vector tiles' (AMX off) and the row computed alone, bit for bit, for row counts that are and are
    not multiples of 16, on 1 and 2 threads (tiles of 4 blocks and single blocks at a share's ends), and the
    result is the float64 product of the rounded activations."""
    q, d, m = _groups(N, K, seed=21)
    packed = kernels.pack_w4a8(q, d, m)
    x = torch.randn(100, K, generator=torch.Generator().manual_seed(22)) * 3
    alone = torch.cat([kernels.w4a8_mm(r[None], *packed) for r in x])
    threads = torch.get_num_threads()
    try:
        for R, n in itertools.product((32, 33, 47, 48, 100), (1, 2)):
            torch.set_num_threads(n)
            tiles = kernels.w4a8_mm(x[:R], *packed)
            assert torch.equal(tiles, alone[:R]), (R, n)
            assert torch.equal(_with_amx(False, lambda: kernels.w4a8_mm(x[:R], *packed)), tiles), (R, n)
    finally:
        torch.set_num_threads(threads)
    xq, dx, _ = kernels.quantized_rows(x)
    w = q.double() * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    exact = (xq.double().view(100, -1, 32) * dx.double()[..., None]).view(100, K) @ w.t()
    torch.testing.assert_close(alone[:, :N].double(), exact, rtol=1e-5, atol=1e-4)


@needs_amx
@pytest.mark.parametrize("N, K", [(100, 576), (3000, 96), (64, 32)])
def test_w8a8_rows_on_amx_tiles_are_the_vector_tiles_bits_and_choose_the_same_argmax(N, K):
    """From 8 rows on, w8a8 products (the LM head of a verify pass or a batch) take their integer sums from AMX tiles
    (runs of 16 rows, 8-15 more as a last run of 16 that overlaps the one before; 8-15 alone on tiles shaped for them): every row equals the
    vector tiles' and the row alone bit for bit, and `w8a8_choose` finds the same argmax."""
    g = torch.Generator().manual_seed(24)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = (torch.rand(N, K // 32, generator=g) * 0.02).half().float()
    packed = kernels.pack_w8a8(q, scale)
    x = torch.randn(40, K, generator=g) * 2
    alone = torch.cat([kernels.w8a8_mm(r[None], *packed) for r in x])
    for R in (8, 9, 12, 15, 16, 17, 24, 31, 33, 40):
        tiles = kernels.w8a8_mm(x[:R], *packed)
        assert torch.equal(tiles, alone[:R]), R
        assert torch.equal(_with_amx(False, lambda: kernels.w8a8_mm(x[:R], *packed)), tiles), R
        _, chosen = kernels.w8a8_choose(x[:R], *packed, N)
        assert torch.equal(chosen, tiles[:, :N].argmax(-1)), R
    w = q.double() * scale.double().repeat_interleave(32, 1)
    xq, dx, _ = kernels.quantized_rows(x)
    exact = (xq.double().view(40, -1, 32) * dx.double()[..., None]).view(40, K) @ w.t()
    torch.testing.assert_close(alone[:, :N].double(), exact, rtol=1e-5, atol=1e-4)


@needs_amx
def test_a_prefill_shaped_w4a8_layer_is_the_same_bits_with_and_without_amx_tiles():
    """A layer's one parallel region with 2 x 20 rows (its products' 32 rows on AMX tiles, 8 on the vector
    tiles): output, keys and values the same bits as with the tiles turned off."""
    Hd, H, Hkv, D, I = 576, 9, 3, 64, 1536
    g = torch.Generator().manual_seed(23)
    dims, parts = _w4a8_layer(Hd, H, Hkv, D, I, g)
    C, B, T = 64, 2, 20
    angles = torch.arange(C)[:, None] * torch.rand(D // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    norms = torch.rand(Hd, generator=g) + 0.5, torch.rand(Hd, generator=g) + 0.5
    lens, x = torch.tensor([0, 30]), torch.randn(B, T, Hd, generator=g) * 3
    kv = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)

    def run():
        kc, vc = kv[0].clone(), kv[1].clone()
        y = kernels._module().layer(x, *norms, 1e-5, [2] * 4, dims, parts, kc, vc, cos, sin, lens, H, D**-0.5)
        return y, kc, vc

    on, off = run(), _with_amx(False, run)
    assert all(torch.equal(a, b) for a, b in zip(on, off))



def test_greedy_rows_pick_each_rows_first_maximum_and_its_softmax_probability():
    """`kernels.greedy_rows` (a draft head's greedy pick in one call): the first of equal maxima as torch's argmax
    takes it, its softmax probability within float rounding of torch's, any width (a tail past the vector lanes),
    and None where a row holds a NaN or no finite maximum (the caller's ops path)."""
    if not kernels.available():
        pytest.skip("specloop's CPU kernels are not built here")
    g = torch.Generator().manual_seed(0)
    for V in (1, 7, 256, 8192, 8197):
        x = torch.randn(5, V, generator=g) * 4
        x[3] = x[3].round()  # ties: many equal maxima
        got = kernels.greedy_rows(x)
        assert got is not None
        col, p = got
        assert torch.equal(col, x.argmax(-1)), V
        assert torch.allclose(p, torch.softmax(x, -1).gather(-1, col[:, None])[:, 0], rtol=1e-5, atol=0), V
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 64, generator=g)
        x[1, 5] = bad
        assert kernels.greedy_rows(x) is None
    assert kernels.greedy_rows(torch.full((1, 40), float("-inf"))) is None
