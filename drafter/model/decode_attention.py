"""A Triton decode-attention kernel for the graph step (specloop.drafter.model.graph): the semantics of
graph.py's `_attend` with visible = arange(C) <= pos, reading each row's keys only up to the block its
furthest query can see (bytes proportional to the row's length, not to the pool's capacity C), with the
keys split across programs (flash-decoding) so that a short batch still fills the GPU.

Two launches per layer:
- partials, one program per (row, KV head, split): split t covers the keys of the fixed absolute range
  [t * SPLIT_KEYS, (t + 1) * SPLIT_KEYS), whatever the row's length or the pool's capacity; the program
  runs an online softmax over its key blocks in a fixed order (up to the row's furthest position) and
  writes its running max, sum and weighted values; a split wholly beyond the row's furthest query exits;
- combine, one program per (row, KV head): the row's active splits, in split order, rescaled to their
  common max and summed one after the other.

Exact by construction: a query's output bits depend on its own inputs and position only: not on how many
other queries its row has, on which query index it sits at, on how many blocks or splits beyond its own
position the row's programs visit, nor on the pool's capacity.
- a tile holds the row's W * rep queries of one KV head, one tile row per query head; every tile row's
  scores, maxima, sums and value products are its own (a dot's output row reads one row of its left
  operand; reductions run along a row), so the other rows of a tile never enter a query's arithmetic;
- a block wholly beyond a query's position is an exact no-op for it: its scores are -inf (not a finite
  stand-in), so the running max is unchanged, the rescale is exp2(0) = 1 and the added probabilities and
  value products are exact zeros (cached values are finite); where nothing of a split was visible yet the
  max is -inf and the rescale runs against 0 instead (exp2(-inf) = 0, never -inf - -inf): such a split's
  partial is exactly (-inf, 0, 0), the same whether it ran or not;
- the combine adds, in split order, each split's terms scaled by exp2(m_t - M): a split beyond the query
  adds exact zeros; split 0 holds key 0, visible to every query (pos >= 0; tile rows beyond W * rep load
  pos 0 and q 0), so M is finite.
The tile shape (BLOCK_M, from W * rep) is the same for every query of a launch: the engine's W is fixed
per compiled step, so a plain step and a verify pass share it.

Triton may be missing (CPU machines): the module imports without it; `available()` says whether the
kernel exists. Tests run it on the CPU under TRITON_INTERPRET=1 (set before triton is imported)."""
import functools
import importlib.util

import torch

from specloop.drafter.model.attention import KEY_BLOCK

_TRITON = importlib.util.find_spec("triton") is not None  # a CPU machine without it: graph.py keeps `_attend`

LOG2E = 1.4426950408889634  # folded into the score scale: the kernel's softmax runs on exp2
SPLIT_KEYS = 2 * KEY_BLOCK  # keys per split: a row of 512 cached tokens runs 5 programs per KV head


def available() -> bool:
    """Whether triton imports, i.e. whether `decode_attention` can run."""
    return _TRITON


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [S, W, H, D] (fp32 / bf16 / fp16) over the pool kc/vc [S, H_kv, C, D] (fp32 / bf16), query (s, w)
    seeing the keys at positions <= pos[s, w] (pos [S, W] int64) → [S, W, H D] float32. Query head h
    reads KV head h // (H / H_kv). No host sync: each row's bound is read from pos on the device."""
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


def splits(capacity: int) -> int:
    """The partials' programs per (row, KV head) for a pool of `capacity` positions (those beyond a row's
    furthest query exit at once)."""
    return -(-capacity // SPLIT_KEYS)


@functools.cache
def build():
    """The kernels and their custom op `specloop::decode_attention`, built once, on first use rather than at
    import: Triton decides at `triton.jit` whether a kernel is interpreted (TRITON_INTERPRET=1, CPU tensors
    in tests) or compiled, and graph.py imports this module long before a test module sets that variable."""
    import triton
    import triton.language as tl

    @triton.jit
    def _partial(q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
                 sq_s, sq_w, sq_h, sq_d, sk_s, sk_h, sk_c, sk_d, sv_s, sv_h, sv_c, sv_d, sp_s, sp_w,
                 W, C, D, qk_scale, REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, SPLITS: tl.constexpr):
        """Program (s, g, t): row s, KV head g, keys [t SPLIT_BLOCKS BLOCK_N, (t + 1) SPLIT_BLOCKS BLOCK_N)."""
        s = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        t = tl.program_id(2)
        i = tl.arange(0, BLOCK_M)  # tile row i: query i // REP, head g * REP + i % REP
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
        # this split's blocks up to the one holding the row's largest position (none: the split is beyond it)
        first = t * SPLIT_BLOCKS
        end = tl.minimum(tl.minimum(tl.max(pos, axis=0).to(tl.int32) // BLOCK_N + 1, tl.cdiv(C, BLOCK_N)),
                         first + SPLIT_BLOCKS)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for b in range(first, end):
            n = b * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_mask = (n < C)[:, None] & d_ok[None, :]
            k = tl.load(k_row + n[:, None] * sk_c + d[None, :] * sk_d, mask=kv_mask, other=0.0)
            v = tl.load(v_row + n[:, None] * sv_c + d[None, :] * sv_d, mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # fp32 accumulation, no TF32
            # -inf, not a finite stand-in: a block beyond a query's position leaves its sums bit for bit
            qk = tl.where((n[None, :] <= pos[:, None]) & (n < C)[None, :], qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: no -inf - -inf
            alpha = tl.exp2(m_i - base)  # first visible block: exp2(-inf) = 0; a hidden block: exp2(0) = 1
            p = tl.exp2(qk - base[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
            m_i = m_new
        at = ((s * tl.num_programs(1) + g) * SPLITS + t) * BLOCK_M + i  # scratch [S, H_kv, SPLITS, BLOCK_M]
        active = (tl.zeros([BLOCK_M], tl.int32) + end) > first  # a split beyond the row writes nothing
        tl.store(m_ptr + at, m_i, mask=active)
        tl.store(l_ptr + at, l_i, mask=active)
        tl.store(acc_ptr + at[:, None] * BLOCK_D + d[None, :], acc, mask=active[:, None])

    @triton.jit
    def _combine(pos_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, sp_s, sp_w, so_s, so_w, W, D,
                 REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 SPLIT_BLOCKS: tl.constexpr, SPLITS: tl.constexpr):
        """Program (s, g): the row's active splits for KV head g, in split order."""
        s = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        i = tl.arange(0, BLOCK_M)
        w = i // REP
        real = w < W
        d = tl.arange(0, BLOCK_D)
        pos = tl.load(pos_ptr + s * sp_s + w * sp_w, mask=real, other=0)
        active = tl.max(pos, axis=0).to(tl.int32) // (BLOCK_N * SPLIT_BLOCKS) + 1
        row = (s * tl.num_programs(1) + g) * SPLITS
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for t in range(0, active):
            top = tl.maximum(top, tl.load(m_ptr + (row + t) * BLOCK_M + i))
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for t in range(0, active):  # a split beyond the query: m = -inf, l = 0, acc = 0, scaled by 0
            scale = tl.exp2(tl.load(m_ptr + (row + t) * BLOCK_M + i) - top)
            l_i += tl.load(l_ptr + (row + t) * BLOCK_M + i) * scale
            acc += tl.load(acc_ptr + ((row + t) * BLOCK_M + i)[:, None] * BLOCK_D + d[None, :]) * scale[:, None]
        head = g * REP + i % REP
        tl.store(out_ptr + s * so_s + w[:, None] * so_w + head[:, None] * D + d[None, :], acc / l_i[:, None],
                 mask=real[:, None] & (d < D)[None, :])

    @torch.library.triton_op("specloop::decode_attention", mutates_args=())
    def _decode_attention_op(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor,
                             scale: float) -> torch.Tensor:
        """The custom op: torch.compile(fullgraph=True) traces it as one node (Inductor, on CUDA, sees the
        kernels themselves); shapes alone decide the launches, so its fake impl is this function on fake
        tensors."""
        S, W, H, D = q.shape
        Hkv, C = kc.shape[1], kc.shape[2]
        rep, n_splits = H // Hkv, splits(C)
        block_m, block_d = tile_rows(W, rep), max(16, triton.next_power_of_2(D))
        out = torch.empty((S, W, H * D), dtype=torch.float32, device=q.device)
        m = torch.empty((S, Hkv, n_splits, block_m), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)  # noqa: E741
        acc = torch.empty((S, Hkv, n_splits, block_m, block_d), dtype=torch.float32, device=q.device)
        shape = dict(REP=rep, BLOCK_M=block_m, BLOCK_N=KEY_BLOCK, BLOCK_D=block_d,
                     SPLIT_BLOCKS=SPLIT_KEYS // KEY_BLOCK, SPLITS=n_splits)
        torch.library.wrap_triton(_partial)[(S, Hkv, n_splits)](
            q, kc, vc, pos, m, l, acc, *q.stride(), *kc.stride(), *vc.stride(), *pos.stride(), W, C, D,
            scale * LOG2E, **shape)
        torch.library.wrap_triton(_combine)[(S, Hkv)](
            pos, m, l, acc, out, *pos.stride(), out.stride(0), out.stride(1), W, D, **shape)
        return out

    @_decode_attention_op.register_fake
    def _(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
        """The output's metadata alone. triton_op's own fake runs the op's body on fake tensors, where a
        compiled kernel's launch is traced, not run; under TRITON_INTERPRET=1 (tests on the CPU) wrap_triton
        hands back the interpreted kernel itself, which would read the fake tensors' data."""
        S, W, H, D = q.shape
        return torch.empty((S, W, H * D), dtype=torch.float32, device=q.device)

    return _decode_attention_op
