"""A Triton decode-attention kernel for the graph step (specloop.drafter.model.graph): the semantics of
graph.py's `_attend` with visible = arange(C) <= pos, in one launch per layer, reading each row's keys
only up to the block its furthest query can see (bytes proportional to the row's length, not to C).

Exact by construction: a query's output bits do not depend on how many other queries its row has, on
which query index it sits at, or on how many key blocks beyond its own position the row's loop visits.
- one program per (row, KV head); its tile holds the row's W * rep queries of that KV head, one tile
  row per query head; every tile row's scores, maxima, sums and value products are its own (a dot's
  output row reads one row of its left operand; reductions run along a row), so the other rows of a
  tile (queries of any position, padding) never enter a query's arithmetic;
- keys are visited in blocks of KEY_BLOCK in a fixed order, from block 0 to the block holding the
  row's largest position; a query's arithmetic is the same over the blocks up to its own;
- a block wholly beyond a query's position is an exact no-op for it: its scores are -inf (not a
  finite stand-in), so the running max is unchanged, the rescale is exp2(0) = 1, the added
  probabilities are exactly 0 and the value product adds exact zeros (cached values are finite);
- position 0 is visible to every query (pos >= 0), so the running max is finite after block 0 and
  the first rescale, exp2(-inf - m) = 0, is exact too; tile rows beyond W * rep load pos 0 and q 0.
The tile shape (BLOCK_M, from W * rep) is the same for every query of a launch: the engine's W is
fixed per compiled step, so a plain step and a verify pass share it.

Triton may be missing (CPU machines): the module imports without it; `available()` says whether the
kernel exists. Tests run it on the CPU under TRITON_INTERPRET=1 (set before triton is imported)."""
import functools
import importlib.util

import torch

from specloop.drafter.model.attention import KEY_BLOCK

_TRITON = importlib.util.find_spec("triton") is not None  # a CPU machine without it: graph.py keeps `_attend`

LOG2E = 1.4426950408889634  # folded into the score scale: the kernel's softmax runs on exp2


def available() -> bool:
    """Whether triton imports, i.e. whether `decode_attention` can run."""
    return _TRITON


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [S, W, H, D] (fp32 / bf16 / fp16) over the pool kc/vc [S, H_kv, C, D] (fp32 / bf16), query (s, w)
    seeing the keys at positions <= pos[s, w] (pos [S, W] int64) → [S, W, H D] float32. Query head h
    reads KV head h // (H / H_kv). No host sync: the row's bound is read from pos on the device."""
    if not _TRITON:
        raise RuntimeError("decode_attention needs triton (graph.py's _attend is the fallback)")
    _check(q, kc, vc, pos)
    if not torch.compiler.is_compiling():  # a traced step finds the op built (graph.StaticModel builds it)
        build()
    return torch.ops.specloop.decode_attention(q, kc, vc, pos, scale)


def _check(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor) -> None:
    S, W, H, D = q.shape
    if kc.shape != vc.shape or kc.shape[0] != S or kc.shape[3] != D or H % kc.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool {tuple(kc.shape)} / {tuple(vc.shape)}")
    if kc.dtype != vc.dtype or kc.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"keys and values in {kc.dtype} / {vc.dtype}")
    if pos.shape != (S, W) or pos.dtype != torch.int64:
        raise ValueError(f"pos must be [S, W] int64, got {tuple(pos.shape)} {pos.dtype}")


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """graph.py's `_attend` on the same inputs (float32): what the kernel computes, for the tests."""
    from specloop.drafter.model.graph import _attend  # here: graph.py may import this module

    visible = torch.arange(kc.shape[2], device=pos.device)[None, None] <= pos[:, :, None]
    return _attend(q, kc, vc, visible, scale).float()


def tile_rows(width: int, rep: int) -> int:
    """BLOCK_M: a tile row per (query, head of the KV head's group); tl.dot takes 16 rows at least."""
    return max(16, 1 << (width * rep - 1).bit_length())


@functools.cache
def build():
    """The kernel and its custom op `specloop::decode_attention`, built once, on first use rather than at
    import: Triton decides at `triton.jit` whether a kernel is interpreted (TRITON_INTERPRET=1, CPU tensors
    in tests) or compiled, and graph.py imports this module long before a test module sets that variable."""
    import triton
    import triton.language as tl


    @triton.jit
    def _kernel(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr,
                sq_s, sq_w, sq_h, sq_d, sk_s, sk_h, sk_c, sk_d, sv_s, sv_h, sv_c, sv_d, sp_s, sp_w, so_s, so_w,
                W, C, D, qk_scale,
                REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program (s, g): row s, KV head g; tile row i is query i // REP, head g * REP + i % REP."""
        s = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        i = tl.arange(0, BLOCK_M)
        w = i // REP
        head = g * REP + i % REP
        real = w < W
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        pos = tl.load(pos_ptr + s * sp_s + w * sp_w, mask=real, other=0)  # tile padding sees key 0 only
        q = tl.load(q_ptr + s * sq_s + w[:, None] * sq_w + head[:, None] * sq_h + d[None, :] * sq_d,
                    mask=real[:, None] & d_ok[None, :], other=0.0)
        q = q.to(k_ptr.dtype.element_ty)  # as _attend: queries in the cache's dtype
        qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes a float argument as fp64
        k_row = k_ptr + s * sk_s + g * sk_h
        v_row = v_ptr + s * sv_s + g * sv_h
        # the row's bound, on the device: every block up to the one holding its largest position
        n_blocks = tl.minimum(tl.max(pos, axis=0).to(tl.int32) // BLOCK_N + 1, tl.cdiv(C, BLOCK_N))
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for b in range(0, n_blocks):
            n = b * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_mask = (n < C)[:, None] & d_ok[None, :]
            k = tl.load(k_row + n[:, None] * sk_c + d[None, :] * sk_d, mask=kv_mask, other=0.0)
            v = tl.load(v_row + n[:, None] * sv_c + d[None, :] * sv_d, mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # fp32 accumulation, no TF32
            # -inf, not a finite stand-in: a block beyond a query's position leaves its sums bit for bit
            qk = tl.where((n[None, :] <= pos[:, None]) & (n < C)[None, :], qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)  # block 0: exp2(-inf) = 0; a hidden block: exp2(0) = 1
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + s * so_s + w[:, None] * so_w + head[:, None] * D + d[None, :], out,
                 mask=real[:, None] & d_ok[None, :])

    @torch.library.triton_op("specloop::decode_attention", mutates_args=())
    def _decode_attention_op(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor,
                             scale: float) -> torch.Tensor:
        """The custom op: torch.compile(fullgraph=True) traces it as one node (Inductor, on CUDA, sees the
        kernel itself); shapes alone decide the launch, so its fake impl is this function on fake tensors."""
        S, W, H, D = q.shape
        Hkv, C = kc.shape[1], kc.shape[2]
        rep = H // Hkv
        out = torch.empty((S, W, H * D), dtype=torch.float32, device=q.device)
        torch.library.wrap_triton(_kernel)[(S, Hkv)](
            q, kc, vc, pos, out, *q.stride(), *kc.stride(), *vc.stride(), *pos.stride(), out.stride(0),
            out.stride(1), W, C, D, scale * LOG2E, REP=rep, BLOCK_M=tile_rows(W, rep), BLOCK_N=KEY_BLOCK,
            BLOCK_D=max(16, triton.next_power_of_2(D)))
        return out

    @_decode_attention_op.register_fake
    def _(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
        """The output's metadata alone. triton_op's own fake runs the op's body on fake tensors, where a
        compiled kernel's launch is traced, not run; under TRITON_INTERPRET=1 (tests on the CPU) wrap_triton
        hands back the interpreted kernel itself, which would read the fake tensors' data."""
        S, W, H, D = q.shape
        return torch.empty((S, W, H * D), dtype=torch.float32, device=q.device)

    return _decode_attention_op
