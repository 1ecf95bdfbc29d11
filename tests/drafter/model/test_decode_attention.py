"""drafter/model/decode_attention.py: the Triton decode-attention kernels against graph.py's `_attend`, and the
bits a query's output may not depend on (its row's other queries, its index, the blocks and splits the row
visits, the pool's capacity).

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before
triton is imported); the module is skipped where triton is not installed. With CUDA the same tests run the
compiled kernel. The interpreter cannot run tl.dot on bf16 operands (it multiplies their raw uint16 bits:
triton-lang/triton#11584), so bf16 keys and values are checked on CUDA only; bf16 queries are cast to the
cache's fp32 inside the kernel and run everywhere."""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from specloop.drafter.model import decode_attention as da  # noqa: E402

da.build()  # the kernel, interpreted where TRITON_INTERPRET=1 (set above, before its first build)

DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.usefixtures("row_by_row_dot")  # tests/drafter/model/conftest.py
S, W, D, C = 3, 5, 32, 256
SCALE = D ** -0.5
HEADS = [(4, 2), (4, 1), (4, 4)]  # (H, H_kv): rep 2, MQA, rep 1


def _randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _inputs(H, Hkv, pos, seed=0, q_dtype=torch.float32, kv_dtype=torch.float32):
    """q [S, W, H, D] (a strided view, as a split would leave it), kc/vc [S, H_kv, C, D]."""
    q = _randn(pos.shape[0], W, H + 1, D, seed=seed, dtype=q_dtype)[:, :, 1:]
    kc = _randn(pos.shape[0], Hkv, C, D, seed=seed + 1, dtype=kv_dtype)
    vc = _randn(pos.shape[0], Hkv, C, D, seed=seed + 2, dtype=kv_dtype)
    return q, kc, vc


def _pos(lens):
    """Each row's W query positions: lens .. lens + W − 1 (a step's real and padded queries alike)."""
    return torch.tensor(lens, device=DEVICE)[:, None] + torch.arange(W, device=DEVICE)[None]


def test_available():
    assert da.available()


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv", HEADS)
def test_matches_attend_on_ragged_rows(q_dtype, H, Hkv):
    pos = _pos([0, 70, 190])  # rows of 1, 2 and 4 key blocks
    q, kc, vc = _inputs(H, Hkv, pos, q_dtype=q_dtype)
    out = da.decode_attention(q, kc, vc, pos, SCALE)
    assert out.shape == (S, W, H * D) and out.dtype == torch.float32
    torch.testing.assert_close(out, da.reference(q, kc, vc, pos, SCALE), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("p", [63, 64, 127])
@pytest.mark.parametrize("H,Hkv", HEADS)
def test_matches_attend_at_block_boundaries(p, H, Hkv):
    pos = torch.tensor([[p] * W, [p - 1] * W, [p + 1] * W], device=DEVICE)  # every query at the boundary
    pos[:, 1:] += torch.arange(1, W, device=DEVICE)
    q, kc, vc = _inputs(H, Hkv, pos, seed=7)
    torch.testing.assert_close(da.decode_attention(q, kc, vc, pos, SCALE), da.reference(q, kc, vc, pos, SCALE),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's tl.dot multiplies bf16 bit patterns (triton#11584)")
@pytest.mark.parametrize("H,Hkv", HEADS)
def test_matches_attend_with_bf16_cache(H, Hkv):
    pos = _pos([0, 70, 190])
    q, kc, vc = _inputs(H, Hkv, pos, seed=3, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    out = da.decode_attention(q, kc, vc, pos, SCALE)
    torch.testing.assert_close(out, da.reference(q, kc, vc, pos, SCALE), rtol=2e-2, atol=1e-2)


def _same_query_three_ways(p, H, Hkv):
    """One query (position p, the same q and the same keys up to p) as query 0 of a row at lens p (four
    padded queries after it), query 2 of a row at lens p − 2, and query 0 of a row whose other queries sit
    far beyond it (the row's loop visits every block); each row holds different garbage beyond p."""
    pos = torch.stack([_pos([p])[0], _pos([p - 2])[0],
                       torch.tensor([p, C - 1, 3, p + 65, 0], device=DEVICE)])
    q = _randn(3, W, H, D, seed=11)
    q[1, 2] = q[0, 0]
    q[2, 0] = q[0, 0]
    kc, vc = (_randn(3, Hkv, C, D, seed=s) for s in (12, 13))
    kc[1:, :, :p + 1] = kc[0, :, :p + 1]
    vc[1:, :, :p + 1] = vc[0, :, :p + 1]
    out = da.decode_attention(q, kc, vc, pos, SCALE)
    return out[0, 0], out[1, 2], out[2, 0]


@pytest.mark.parametrize("p", [2, 61, 63, 64, 100, 127, 128])
@pytest.mark.parametrize("H,Hkv", HEADS)
def test_query_bits_ignore_its_row(p, H, Hkv):
    first, third, far = _same_query_three_ways(p, H, Hkv)
    assert torch.equal(first, third)
    assert torch.equal(first, far)


def test_query_bits_ignore_garbage_beyond_it():
    """Two launches whose caches differ only beyond the query's position (the row visits those blocks)."""
    p = 70
    pos = torch.tensor([[p, C - 1, 0, 1, 2]] * S, device=DEVICE)
    q, kc, vc = _inputs(4, 2, pos, seed=21)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[:, :, p + 1:] = _randn(S, 2, C - p - 1, D, seed=22) * 100
    vc2[:, :, p + 1:] = _randn(S, 2, C - p - 1, D, seed=23) * 100
    a = da.decode_attention(q, kc, vc, pos, SCALE)[:, 0]
    b = da.decode_attention(q, kc2, vc2, pos, SCALE)[:, 0]
    assert torch.equal(a, b)
    assert not torch.equal(da.decode_attention(q, kc2, vc2, pos, SCALE)[:, 1], da.decode_attention(q, kc, vc, pos, SCALE)[:, 1])


def test_query_bits_ignore_the_pools_capacity():
    """The same rows in a pool four times as long (splits beyond a row's furthest query exit unread): the
    same bits, so a pool sized for long requests costs a short row nothing and changes none of its outputs."""
    pos = _pos([3, 130, 250 - W])
    q, kc, vc = _inputs(4, 2, pos, seed=31)
    long_k, long_v = (torch.cat([t, _randn(S, 2, 3 * C, D, seed=32) * 50], dim=2) for t in (kc, vc))
    assert da.splits(4 * C) == 4 * da.splits(C)
    assert torch.equal(da.decode_attention(q, long_k, long_v, pos, SCALE), da.decode_attention(q, kc, vc, pos, SCALE))


def test_rejects_mismatched_inputs():
    pos = _pos([0, 1, 2])
    q, kc, vc = _inputs(4, 2, pos)
    with pytest.raises(ValueError):
        da.decode_attention(q, kc, vc, pos.int(), SCALE)
    with pytest.raises(ValueError):
        da.decode_attention(q[..., :3, :], kc, vc, pos, SCALE)  # 3 query heads over 2 KV heads


def _step(q, kc, vc, pos):
    return da.decode_attention(q, kc, vc, pos, SCALE)


def test_traces_without_graph_breaks():
    """fullgraph=True: the op is one node of one graph. On the CPU, dynamo's own tracing (the op's fake impl
    gives its output's metadata) with the eager backend: AOTAutograd and Inductor decompose a triton_op into
    its kernel launch, which the interpreter cannot trace; on CUDA, Inductor compiles the step."""
    pos = _pos([0, 70, 190])
    q, kc, vc = _inputs(4, 2, pos)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_step)(q, kc, vc, pos)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend="inductor" if CUDA else "eager")
    assert torch.equal(compiled(q, kc, vc, pos), _step(q, kc, vc, pos))


def test_fake_impl_gives_the_output_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    pos = _pos([0, 70, 190])
    q, kc, vc = _inputs(4, 2, pos)
    with FakeTensorMode() as mode:
        out = torch.ops.specloop.decode_attention(*(mode.from_tensor(t) for t in (q, kc, vc, pos)), SCALE)
    assert out.shape == (S, W, 4 * D) and out.dtype == torch.float32 and out.device == q.device


@pytest.mark.parametrize("kind", ["pretrained", "ngram"])
def test_speculation_through_the_kernel_equals_plain_decoding(kind, graph_decode, monkeypatch):
    # the graph step with the kernel as its attention (SPECLOOP_ATTENTION=triton; uncompiled on the CPU, the
    # kernel interpreted): greedy speculation equals the same engine's plain decoding, as with `_attend`
    monkeypatch.setenv("SPECLOOP_ATTENTION", "triton")
    monkeypatch.setenv("SPECLOOP_COMPILE", "0")

    def check(engine):
        assert engine.verifier.model.attention == "triton"

    assert graph_decode(kind, 3, check) == graph_decode(kind, 0, check)
