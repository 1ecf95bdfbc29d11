"""drafter/model/skinny_linear.py: the Triton product for the graph step's skinny linears against F.linear, the
bits a row's output may not depend on (the other rows), the tiling's split as a function of shapes only, and the
graph step through it (SPECLOOP_LINEAR=skinny).

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before triton is
imported), where bf16 tiles are widened to fp32 before tl.dot (the module's docstring); with CUDA the same tests
run the compiled kernel, bf16 on the tensor cores."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from specloop.drafter.model import skinny_linear as sl  # noqa: E402

sl.build()

DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("row_by_row_dot")  # tests/drafter/model/conftest.py


def _randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _reference(x, w, b=None):
    """The product in float64 (what either path rounds)."""
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("m", [1, 5, 16, 40])
@pytest.mark.parametrize("n,k", [(96, 256), (100, 300), (33, 1024)])  # N and K not multiples of the tiles too
def test_matches_the_product_in_fp32(m, n, k):
    x, w = _randn(m, k, seed=m), _randn(n, k, seed=n + k)
    t = sl.ranges(m, k, block_n=32, block_k=64, split=4)
    y = sl.skinny_linear(x, w, tiles=t)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _reference(x, w), rtol=1e-5, atol=1e-4)


def test_bf16_with_bias_and_leading_dims_rounds_as_f_linear():
    x = _randn(2, 5, 512, seed=1, dtype=torch.bfloat16)  # a step's [S, W, hidden]
    w, b = _randn(200, 512, seed=2, dtype=torch.bfloat16), _randn(200, seed=3, dtype=torch.bfloat16)
    y = sl.skinny_linear(x, w, b)
    assert y.shape == (2, 5, 200) and y.dtype == torch.bfloat16
    exact = _reference(x.reshape(10, 512), w, b).reshape(2, 5, 200)
    # one bf16 rounding of the fp32 sum: as close to the exact product as F.linear's own result
    assert (y.double() - exact).abs().max() <= 2 * (F.linear(x, w, b).double() - exact).abs().max() + 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_ignore_the_other_rows(dtype):
    """Row 2 of a 5-row product (a step's query) as the other rows change from zeros to large garbage: the same
    bits, so a plain step's one real query and a verify pass's five get the same output from the same launch."""
    k, n = 768, 160
    w = _randn(n, k, seed=5, dtype=dtype)
    x = _randn(5, k, seed=6, dtype=dtype)
    other = x.clone()
    other[[0, 1, 3, 4]] = _randn(4, k, seed=7, dtype=dtype) * 100
    zeros = torch.zeros_like(x)
    zeros[2] = x[2]
    t = sl.tiling(5, n, k, 132)
    assert t.split > 1  # the case that matters: partials summed across programs
    rows = [sl.skinny_linear(v, w)[2] for v in (x, other, zeros)]
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])


def test_the_split_is_a_function_of_the_shapes_that_fills_the_device():
    # SmolLM2-1.7B's products at batch 1 (W = 5) on an H200's 132 SMs
    for n, k in ((6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (49152, 2048)):
        t = sl.tiling(5, n, k, 132)
        assert t.split & (t.split - 1) == 0 and t.k_per_split % t.block_k == 0
        assert t.split * t.k_per_split >= k > (t.split - 1) * t.k_per_split  # every K in exactly one range
        assert t.programs(n) >= 132 or t.split * t.block_k >= k  # the device filled, or K cut as fine as it goes
        assert 2 * 5 * t.split / k <= 1 / sl.PARTIAL_SHARE  # partials small beside the weight
        assert sl.tiling(5, n, k, 132) == t
    assert sl.tiling(40, 2048, 2048, 132).split < sl.tiling(5, 2048, 2048, 132).split  # more rows: fewer partials


def test_fits_only_skinny_float_products():
    w = _randn(64, 128, seed=1)
    assert sl.fits(_randn(5, 128, seed=2), w)
    assert sl.fits(_randn(8, 8, 128, seed=2), w)  # 64 rows
    assert not sl.fits(_randn(65, 128, seed=2), w)  # a prefill chunk's rows: cuBLAS
    assert not sl.fits(_randn(5, 128, seed=2, dtype=torch.bfloat16), w)  # activations in another dtype
    assert not sl.fits(_randn(5, 128, seed=2), w.T.contiguous().T)  # a weight strided along K


def test_tiles_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "tiles.json"
    path.write_text('{"5,96,256": [32, 64, 2, 8, 2]}')
    monkeypatch.setenv("SPECLOOP_SKINNY_TILES", str(path))
    assert sl.override(5, 96, 256) == sl.Tiling(16, 32, 64, 2, 128, 8, 2)
    assert sl.override(5, 96, 512) is None
    x, w = _randn(5, 256, seed=1), _randn(96, 256, seed=2)
    torch.testing.assert_close(sl.skinny_linear(x, w).double(), _reference(x, w), rtol=1e-5, atol=1e-4)


def test_traces_without_graph_breaks():
    """fullgraph=True: the op is one node of the step's graph (on the CPU with dynamo's eager backend, as the
    decode-attention kernel's test; on CUDA, Inductor compiles it)."""
    x, w = _randn(5, 256, seed=1), _randn(96, 256, seed=2)

    def step(x, w):
        return sl.skinny_linear(x, w) + 1

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, w)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if CUDA else "eager")
    assert torch.equal(compiled(x, w), step(x, w))


def test_the_graph_step_runs_its_products_through_the_kernel(tiny_verifier, monkeypatch):
    from specloop.drafter.model.graph import StaticModel, static_forward

    calls = []
    plain = sl.skinny_linear
    monkeypatch.setattr(sl, "skinny_linear", lambda *a, **kw: calls.append(a[1].shape) or plain(*a, **kw))
    lean = tiny_verifier.lean
    keys = [torch.zeros(2, lean.n_kv, 64, lean.head_dim, dtype=lean.dtype) for _ in range(lean.num_layers)]
    values = [torch.zeros_like(t) for t in keys]
    args = (torch.tensor([[5, 6, 7], [8, 0, 0]]), torch.tensor([3, 1]), torch.tensor([0, 0]), None, (), False)
    expected = static_forward(StaticModel(lean), [t.clone() for t in keys], [t.clone() for t in values], *args)
    monkeypatch.setenv("SPECLOOP_LINEAR", "skinny")
    model = StaticModel(lean)
    assert model.linear == "skinny" and not calls
    got = static_forward(model, keys, values, *args)
    assert len(calls) == 4 * lean.num_layers + 1  # qkv, o, gate-up, down a layer; the head
    real = torch.tensor([[True, True, True], [True, False, False]])
    torch.testing.assert_close(got[0][real], expected[0][real], rtol=1e-4, atol=1e-4)


def test_the_step_with_a_tilings_file_traces_as_one_graph(tiny_verifier, tmp_path, monkeypatch):
    """StaticModel reads SPECLOOP_SKINNY_TILES when built: the traced step opens no file (a graph break)."""
    from specloop.drafter.model.graph import StaticModel

    lean = tiny_verifier.lean
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({f"6,{lean.vocab_size},{lean.hidden_size}": [32, 32, 2, 4, 3]}))
    monkeypatch.setenv("SPECLOOP_LINEAR", "skinny")
    monkeypatch.setenv("SPECLOOP_SKINNY_TILES", str(path))
    monkeypatch.setattr(sl, "_READ", {})
    model = StaticModel(lean)
    keys = [torch.zeros(2, lean.n_kv, 64, lean.head_dim, dtype=lean.dtype) for _ in range(lean.num_layers)]
    args = (keys, [torch.zeros_like(t) for t in keys], torch.tensor([[5, 6, 7], [8, 0, 0]]), torch.tensor([3, 1]),
            torch.tensor([0, 0]))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert sl.override(6, lean.vocab_size, lean.hidden_size).split == 2  # the head's product, from the file


def test_an_unknown_linear_is_refused(monkeypatch):
    from specloop.drafter.model.graph import resolve_linear

    monkeypatch.setenv("SPECLOOP_LINEAR", "cutlass")
    with pytest.raises(ValueError, match="SPECLOOP_LINEAR"):
        resolve_linear()


@pytest.mark.parametrize("kind", ["pretrained", "ngram"])
def test_speculation_through_the_kernel_equals_plain_decoding(kind, graph_decode, monkeypatch):
    """The engine on the graph backend with every product through the kernel (uncompiled on the CPU, the kernel
    interpreted): greedy speculation equals the same engine's plain decoding."""
    monkeypatch.setenv("SPECLOOP_LINEAR", "skinny")
    monkeypatch.setenv("SPECLOOP_COMPILE", "0")

    def check(engine):
        assert engine.verifier.model.linear == "skinny"

    assert graph_decode(kind, 3, check) == graph_decode(kind, 0, check)
