"""A Triton product for the graph step's skinny linears (specloop.drafter.model.graph, SPECLOOP_LINEAR=skinny):
y = x W^T (+ b) for x [M, K] with few rows (a decode step's S·W queries: 5 at batch 1, 40 at batch 8) and a
weight W [N, K] that is read once from memory.

Why: on an H200 the 1.7B shape's step spends 83 % of its device time in cuBLAS's products at 54 % of the HBM
bandwidth (bench/README.md section 33): for a handful of rows cuBLAS picks tiles that leave the 2048-wide
products at ~1-2 TB/s. Here each weight is cut into column blocks of BLOCK_N outputs and its K into SPLIT
fixed ranges, one program per (block, range): enough programs to keep every SM streaming weights, each
reading its [BLOCK_N, K / SPLIT] slab once and multiplying it against all M rows (tl.dot, the rows padded to
BLOCK_M, fp32 accumulation).

Exact by construction, as the rest of the step:
- a program's output row m reads row m of x only (a dot's output row reads one row of its left operand);
- the K split is fixed by the shapes (M, N, K) and the device's SM count, never by the data: the split's
  partials [SPLIT, M, N] (fp32) are summed by `partials.sum(0)` in split order (a reduction of fixed shape,
  which the compiled step fuses into what follows);
- the engine's W is fixed per compiled step, so a plain step and a verify pass run the same launch.
So a row's output bits do not depend on the other rows, on how many are real, or on what they hold.

Triton may be missing (CPU machines): the module imports without it; `available()` says whether the kernel
exists. Tests run it on the CPU under TRITON_INTERPRET=1 (set before triton is imported): there, tl.dot cannot
take bf16 operands (triton-lang/triton#11584), so an interpreted kernel widens its tiles to fp32 first
(`UPCAST`), products of bf16 values being exact in fp32."""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

_TRITON = importlib.util.find_spec("triton") is not None

MAX_ROWS = 64  # above this many rows (a prefill chunk's, a large batch's) the product is cuBLAS's (F.linear)
PROGRAMS_PER_SM = 4  # the launch's programs aimed at: enough weight loads in flight to stream at HBM speed
PARTIAL_SHARE = 16  # the split's fp32 partials kept under ~1/16 of the weight's bytes (2 M SPLIT / K <= 1/16)


def available() -> bool:
    """Whether triton imports, i.e. whether `skinny_linear` can run."""
    return _TRITON


@dataclass(frozen=True)
class Tiling:
    """One product's launch: BLOCK_M rows (M padded), BLOCK_N outputs and BLOCK_K inputs a tile, K cut into
    `split` ranges of `k_per_split` (a multiple of BLOCK_K), `warps` and `stages` per program."""
    block_m: int
    block_n: int
    block_k: int
    split: int
    k_per_split: int
    warps: int = 4
    stages: int = 3

    def programs(self, n: int) -> int:
        return _ceil(n, self.block_n) * self.split


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def ranges(m: int, k: int, block_n: int, block_k: int, split: int, warps: int = 4, stages: int = 3) -> Tiling:
    """K cut into at most `split` ranges of whole BLOCK_K tiles (the last range may be shorter)."""
    per = _ceil(_ceil(k, block_k), split) * block_k
    return Tiling(max(16, 1 << (m - 1).bit_length()), block_n, block_k, _ceil(k, per), per, warps, stages)


def tiling(m: int, n: int, k: int, sms: int, block_n: int = 64, block_k: int = 128) -> Tiling:
    """The launch for an [m, k] × [n, k]ᵀ product on a device of `sms` SMs: a pure function of the shapes, so
    every step of a compiled graph (and a plain step beside a verify pass) splits K the same way.
    SPLIT is the power of two that brings the programs up to ~PROGRAMS_PER_SM a SM, no finer than one
    BLOCK_K per range, and no larger than keeps the partials' bytes under 1/PARTIAL_SHARE of the weight's."""
    want = _pow2_floor(PROGRAMS_PER_SM * sms // _ceil(n, block_n))
    cap = _pow2_floor(k // (2 * PARTIAL_SHARE * m))
    return ranges(m, k, block_n, block_k, min(want, cap, _pow2_floor(_ceil(k, block_k))))


def override(m: int, n: int, k: int) -> Tiling | None:
    """A tiling set by SPECLOOP_SKINNY_TILES (bench/gpu.py's section products writes the fastest it timed):
    a JSON object {"m,n,k": [block_n, block_k, split, warps, stages]}; None where it names no such shape."""
    return read_tiles().get(f"{m},{n},{k}")


def read_tiles() -> dict[str, Tiling]:
    """The tilings file (`override`), read once; graph.StaticModel reads it when built, so that a traced step
    finds it read (a file opened inside torch.compile's trace would break the graph)."""
    path = os.environ.get("SPECLOOP_SKINNY_TILES")
    if not path:
        return {}
    if path not in _READ:
        _READ[path] = _tiles(path)
    return _READ[path]


_READ: dict[str, dict[str, Tiling]] = {}  # a tilings file, read once (plain dicts: a traced step reads them)
_SMS: dict[str, int] = {}


def _tiles(path: str) -> dict[str, Tiling]:
    import json

    out = {}
    with open(path) as f:
        for key, (block_n, block_k, split, warps, stages) in json.load(f).items():
            m, _, k = (int(v) for v in key.split(","))
            out[key] = ranges(m, k, block_n, block_k, split, warps, stages)
    return out


def sm_count(device: str) -> int:
    """The device's SM count (a CPU stands in as 132, an H100 / H200's, so tests split as a GPU would)."""
    if device not in _SMS:
        cuda = device.startswith("cuda")
        _SMS[device] = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count if cuda else 132
    return _SMS[device]


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this product (a shape's decision, fixed per compiled step): few rows, a float
    weight of the activations' dtype, contiguous along K."""
    rows = x.numel() // x.shape[-1]
    return (_TRITON and 0 < rows <= MAX_ROWS and weight.dim() == 2 and x.dtype == weight.dtype
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.stride(1) == 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: Tiling | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through the kernel: x [..., K], weight [N, K] → [..., N] in x's dtype."""
    if not _TRITON:
        raise RuntimeError("skinny_linear needs triton (F.linear is the fallback)")
    *lead, k = x.shape
    n = weight.shape[0]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    t = tiles or override(m, n, k) or tiling(m, n, k, sm_count(str(x.device)))
    if not torch.compiler.is_compiling():  # a traced step finds the op built (graph.StaticModel builds it)
        build()
    partials = torch.ops.specloop.skinny_partials(flat, weight, t.block_m, t.block_n, t.block_k, t.split,
                                                  t.k_per_split, t.warps, t.stages)
    y = partials.sum(0) if t.split > 1 else partials[0]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, n)


@functools.cache
def build():
    """The kernel and its custom op `specloop::skinny_partials`, built on first use (Triton decides at
    `triton.jit` whether a kernel is interpreted, and graph.py imports this module before a test sets
    TRITON_INTERPRET)."""
    import triton
    import triton.language as tl

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"

    @triton.jit
    def _partials(x_ptr, w_ptr, out_ptr, M, N, K, sx_m, sw_n,
                  K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  UPCAST: tl.constexpr):
        """Program (b, t): outputs [b BLOCK_N, (b + 1) BLOCK_N) over inputs [t K_PER_SPLIT, (t + 1) K_PER_SPLIT)
        (K_PER_SPLIT a multiple of BLOCK_K; an argument, not a constant: one build serves every shape's split)."""
        b = tl.program_id(0)
        t = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = b * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        start = t * K_PER_SPLIT
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            ks = start + k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_m + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptr + cols[:, None].to(tl.int64) * sw_n + ks[None, :],
                         mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter's tl.dot takes no bf16 (module docstring)
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
        at = (t * M + rows[:, None].to(tl.int64)) * N + cols[None, :]
        tl.store(out_ptr + at, acc, mask=row_ok[:, None] & col_ok[None, :])

    @torch.library.triton_op("specloop::skinny_partials", mutates_args=())
    def _skinny_partials_op(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int, block_k: int,
                            split: int, k_per_split: int, warps: int, stages: int) -> torch.Tensor:
        """x [M, K] (rows contiguous along K) × weight [N, K] → partial products [split, M, N] float32, split t
        over inputs [t k_per_split, (t + 1) k_per_split)."""
        m, k = x.shape
        n = weight.shape[0]
        x = x.contiguous()
        out = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        torch.library.wrap_triton(_partials)[(triton.cdiv(n, block_n), split)](
            x, weight, out, m, n, k, x.stride(0), weight.stride(0), k_per_split, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, UPCAST=interpreted or x.dtype == torch.float32,
            num_warps=warps, num_stages=stages)
        return out

    @_skinny_partials_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int, block_k: int, split: int,
          k_per_split: int, warps: int, stages: int) -> torch.Tensor:
        """The output's metadata alone (see decode_attention's fake: the interpreted kernel would read data)."""
        return torch.empty((split, x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)

    return _skinny_partials_op
