"""Weight-only quantization of a LeanDecoder for CPU decoding, chosen at run time.

A linear "weight" is either a raw tensor (`F.linear`, the unquantized path) or one of the objects
below; `linear(x, w, bias)` calls either. Every object maps `x [..., K]` to `[..., N]` in the
activation dtype and holds its own bias:

- `Dense`: a float weight (fp32 or bf16), `F.linear`.
- `Int8Weight`: per-output-channel symmetric int8, `torch._weight_int8pack_mm`.
- `Int4Weight`: group-wise asymmetric int4 (groups of 32/64/128 along K), tinygemm's CPU packing,
  `torch._weight_int4pack_mm_for_cpu`.
- `OwnInt4Weight` / `OwnInt8Weight`: the same formats (int4 in groups of 32, w = q · d + m with fp16
  d, m; int8 per channel with fp32 scales) multiplied by specloop's own kernels (drafter.kernels),
  which read each tile of weights from memory once for all rows of a call and compute every row
  alike (bench/README.md section 9: a 5-token pass 0.84x of the stock kernels' cost, v_5 1.88
  against 2.04). Used wherever they build for this CPU (`QuantSpec.kernels == "own"`);
  SPECLOOP_KERNELS=stock serves the stock kernels instead.

Modes (`DTYPE_MODES`): "fp32" (raw fp32 tensors), "bf16" (bf16 weights and activations), "int8"
and "int4" (quantized weights; activations in fp32 with specloop's kernels, else in bf16 where the
CPU has native bf16, else fp32: `activation_dtype`), and "w4a8" (`OwnW4A8Weight`: int4 weights
times activations quantized to int8 per group of 32 inside each product, as llama.cpp computes a
Q4_1 model; specloop's kernels only). The embedding, norms and RoPE tables follow the activation dtype; the KV cache
is fp32 in every mode (drafter.decoder).

Which mode is served: `resolve_mode`. "auto" serves a verifier as its checkpoint is stored (fp32 /
bf16), or in the mode its own manifest.json names (a model published as a 4-bit GGUF: int4 packed
from the GGUF's groups, `OwnInt4Weight` / `Int4Weight.from_groups`); never a quantized copy nobody asked for.
`describe_mode` is the string printed wherever the model is named.

Losslessness is against the verifier as served. Greedy equality with that verifier alone needs
the verify pass (T = k+1) to score a token bit for bit as a one-token step does: the int kernels
compute every row on its own; float GEMMs go through `row_blocked` in decode-shaped passes (one
call shape for every row); attention is drafter.decoder.exact_attention.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from drafter import kernels

DTYPE_MODES = ("fp32", "bf16", "int8", "int4", "w4a8")
W4A8_NEEDS = "w4a8 (int4 weights, int8 activations) runs on specloop's own CPU kernels only (a C++ compiler)"
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
_INT4_N_MULTIPLE = 16  # the CPU int4 packing needs N % 16 == 0: pad with zero rows
# Int4Weight quantizes and packs in blocks of this many rows, so a large weight (an LM head) never has
# full-size float / int32 temporaries beside it. A multiple of 64: the CPU packing lays out each block
# of 64 rows on its own, so packing row blocks and concatenating them is the one-piece layout, bit for
# bit (tests/test_quant.py).
_INT4_BLOCK_ROWS = 4096


# Decode-shaped passes (one-token steps and verify passes) call the float GEMMs on row blocks of a
# fixed size, so that every row meets the same kernel path whatever the number of rows: the CPU's
# fp32 / bf16 kernels round a row differently depending on how many rows share the call (fp32 M = 1
# takes a GEMV path; bf16 changes blocking at M >= 15), and an unblocked verify pass of k+1 tokens
# would score a token differently from the one-token step. fp32 goes row by row (its M = 8 GEMM costs
# ~3x its GEMV here, which one-token decoding should not pay); bf16 in blocks of 8 (as fast as one
# row). The int8 / int4 kernels compute each row alone already. Long passes (prefills, one prompt
# at a time: drafter.decoder.prefill) take one plain call.
ROW_BLOCK = {torch.float32: 1, torch.bfloat16: 8, torch.float16: 8}


def row_blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed in calls of exactly ROW_BLOCK[dtype] rows (zero-padded)."""
    block = ROW_BLOCK.get(weight.dtype, 8)
    rows = x.reshape(-1, x.shape[-1])
    M = rows.shape[0]
    if block == 1:  # one call: a batch of one-row products (each row exactly what F.linear gives it alone)
        y = torch.bmm(rows[:, None], weight.t().expand(M, *weight.t().shape))[:, 0]
        y = y if bias is None else y + bias
        return y.view(*x.shape[:-1], weight.shape[0])
    if M == block:
        return F.linear(x, weight, bias)
    pad = -M % block
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    y = torch.cat([F.linear(r, weight, bias) for r in rows.split(block)])
    return y[:M].view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, exact: bool = True) -> torch.Tensor:
    """x @ wᵀ (+ bias) for a raw weight tensor or a weight object (which holds its own bias). `exact`:
    every row's result independent of the other rows in the call (`row_blocked`); False for long
    passes (prefills), where one plain call is faster."""
    if isinstance(w, torch.Tensor):
        return row_blocked(x, w, bias) if exact else F.linear(x, w, bias)
    if isinstance(w, Dense):
        return w(x, exact)
    return w(x)


class Dense:
    """A float weight [N, K] (fp32 or bf16) and optional bias; inputs are cast to its dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        dtype = dtype or weight.dtype
        self.weight = weight.detach().to(dtype).contiguous()
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.act_dtype = dtype
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor, exact: bool = True) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        return row_blocked(x, self.weight, self.bias) if exact else F.linear(x, self.weight, self.bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()


class Int8Weight:
    """Per-output-channel symmetric int8: w ≈ q · scale[n], q ∈ [-127, 127]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype = torch.bfloat16):
        q, scales = int8_channels(weight)
        self.q, self.scales = q.contiguous(), scales.to(act_dtype)
        self.bias = None if bias is None else bias.detach().to(act_dtype)
        self.act_dtype = act_dtype
        self.out_features, self.in_features = self.q.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.q, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]


def _check_group_size(group_size: int, K: int) -> None:
    if group_size not in INT4_GROUP_SIZES or K % group_size:
        raise ValueError(f"int4 group size {group_size} must be one of {INT4_GROUP_SIZES} and divide K={K}")


def _nearest(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp64 values → the nearest `dtype` values. fp64 → fp32 → bf16 would round twice (a tie in the
    second step that the first created can go the wrong way): round to fp32 by round-to-odd first,
    which keeps the second rounding correct (fp32 has more than bf16's precision + 2 bits)."""
    x = x.double()
    y = x.float()
    if dtype == torch.float32:
        return y
    inexact = y.double() != x
    even = (y.view(torch.int32) & 1) == 0
    toward = torch.where(x > y.double(), torch.full_like(y, float("inf")), torch.full_like(y, float("-inf")))
    y = torch.where(inexact & even, torch.nextafter(y, toward), y)
    return y.to(dtype)


def int8_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [N, K] int8 in [-127, 127], scale [N] fp32), w ≈ q · scale."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8), scales


def minmax_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max groups along K (as GGUF's Q4_1 quantizer makes them): (q [N, K] uint8 in
    [0, 15], scale [N, K/g], minimum [N, K/g] fp32), w ≈ q · scale + minimum. q is computed in blocks
    of _INT4_BLOCK_ROWS rows, so a large weight (an LM head) has no full-size float temporary beside it."""
    N, K = weight.shape
    groups = weight.detach().float().reshape(-1, group_size)
    lo, hi = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    scales = (hi - lo).clamp(min=1e-6) / 15.0
    q = torch.empty(groups.shape, dtype=torch.uint8, device=groups.device)
    step = _INT4_BLOCK_ROWS * (K // group_size)  # groups per block of rows
    for g in range(0, groups.shape[0], step):
        q[g : g + step] = (groups[g : g + step] - lo[g : g + step]).div_(scales[g : g + step]).round_().clamp_(0, 15)
    return q.reshape(N, K), scales.view(N, -1), lo.view(N, -1)


class Int4Weight:
    """Group-wise asymmetric int4 along K: w ≈ (q − 8) · scale + zero per group of `group_size`
    inputs, q ∈ [0, 15] (zero = min + 8 · scale, the tinygemm convention). N is padded with zero rows
    to a multiple of 16 (the CPU packing's need) and the output sliced back.

    Built from a float weight (min/max groups), or with `from_groups` from a checkpoint's own 4-bit
    groups (GGUF Q4_1: w = q · d + m), which it then serves exactly as published."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype = torch.bfloat16,
                 group_size: int = DEFAULT_GROUP_SIZE):
        _check_group_size(group_size, weight.shape[1])
        q, scales, lo = minmax_groups(weight, group_size)
        zeros = lo + 8.0 * scales
        self._pack(q, scales.to(act_dtype), zeros.to(act_dtype), bias, act_dtype, group_size)

    @classmethod
    def from_groups(cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None = None,
                    act_dtype: torch.dtype = torch.bfloat16) -> "Int4Weight":
        """A weight given as its 4-bit groups: w = q · scale + minimum, q [N, K] integers in [0, 15],
        scale and minimum [N, K / group_size] (GGUF Q4_1: scale = d, minimum = m, groups of 32). The
        packed q are exactly these; scale and zero = minimum + 8 · scale are stored as the nearest
        values of the activation dtype (the kernel's only rounding of the weight)."""
        N, K = q.shape
        if scale.shape != minimum.shape or scale.dim() != 2 or scale.shape[0] != N or not scale.shape[1] \
                or K % scale.shape[1]:
            raise ValueError(f"groups of q {tuple(q.shape)} need scale and minimum [N, K / group size], got "
                             f"{tuple(scale.shape)} and {tuple(minimum.shape)}")
        group_size = K // scale.shape[1]
        _check_group_size(group_size, K)
        if q.is_floating_point() or int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("int4 groups need integer q in [0, 15]")
        scale64 = scale.detach().double()
        zero64 = minimum.detach().double() + 8.0 * scale64  # exact for fp16 / bf16 / fp32 inputs of sane range
        self = cls.__new__(cls)
        self._pack(q.to(torch.int32), _nearest(scale64, act_dtype), _nearest(zero64, act_dtype), bias, act_dtype,
                   group_size)
        return self

    def _pack(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias, act_dtype, group_size: int):
        """q [N, K] integers (int32 or uint8), scales / zeros [N, K/g] in act_dtype → tinygemm's CPU layout."""
        N, K = q.shape
        pad = -N % _INT4_N_MULTIPLE
        if pad:  # zero rows (q = 8, scale = zero = 0), sliced off the output
            q = torch.cat([q, q.new_full((pad, K), 8)])
            scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
            zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
        self.packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(rows.to(torch.int32).contiguous(), 1)
                                 for rows in q.split(_INT4_BLOCK_ROWS)])
        sz = torch.stack([scales, zeros], dim=2)  # [N, K/g, 2]
        self.scales_zeros = sz.transpose(0, 1).contiguous().to(act_dtype)  # [K/g, N, 2]
        self.bias = None if bias is None else bias.detach().to(act_dtype)
        self.act_dtype = act_dtype
        self.group_size = group_size
        self.out_features, self.in_features = N, K
        self._padded = bool(pad)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.packed, self.group_size,
                                              self.scales_zeros)
        if self._padded:
            y = y[:, : self.out_features]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [N, K] fp32 (for tests and error reports)."""
        eye = torch.eye(self.in_features, dtype=self.act_dtype)
        y = torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_zeros)
        return y[:, : self.out_features].float().t().contiguous()


class OwnInt4Weight:
    """Int4 groups of 32 along K, w = q · d + m (GGUF Q4_1's form, d and m in fp16, exact for a GGUF), multiplied by
    specloop's own kernel (drafter.kernels.q4_mm: fp32 products, each tile of weights read once for
    all rows, every row computed alike whatever the row count). Output in the activation dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None = None,
                 act_dtype: torch.dtype = torch.bfloat16):
        N, K = q.shape
        if scale.shape != (N, K // kernels.GROUP) or minimum.shape != scale.shape or K % kernels.GROUP:
            raise ValueError(f"int4 groups of 32: q {tuple(q.shape)} needs scale and minimum [N, K / 32]")
        self.nibbles, self.d, self.m = self._pack(q, scale, minimum)
        self._op = kernels.linear_op(self._kind)
        self.bias = None if bias is None else bias.detach().to(act_dtype)
        self.act_dtype, self.group_size = act_dtype, kernels.GROUP
        self.out_features, self.in_features = N, K

    _pack, _kind = staticmethod(kernels.pack_q4), "q4"  # the layout and the kernel (OwnW4A8Weight: its own)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype = torch.bfloat16):
        """Min/max groups of 32 of a float weight (`minmax_groups`)."""
        return cls(*minmax_groups(weight, kernels.GROUP), bias, act_dtype)

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] uint8, scale, minimum [N, K/32]) as packed."""
        return kernels.unpack_q4(self.nibbles, self.d, self.m, self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        y = self._op(x, self.nibbles, self.d, self.m, self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        eye = torch.eye(self.in_features)
        return kernels.q4_mm(eye, self.nibbles, self.d, self.m)[:, : self.out_features].t().contiguous()


class OwnW4A8Weight(OwnInt4Weight):
    """`OwnInt4Weight`'s weights (groups of 32, w = q · d + m, fp16 d and m) times activations quantized
    to int8 per row and group of 32 (x ≈ xq · dx, dx = max|x| / 127), as llama.cpp multiplies a Q4_1
    tensor by Q8_1 activations: integer dot products (VNNI where the CPU has it), then
    y = Σ_g d·dx·Σ q·xq + m·dx·Σ xq (drafter.kernels.w4a8_mm). Output fp32."""

    _pack, _kind = staticmethod(kernels.pack_w4a8), "w4a8"

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernels.unpack_w4a8(self.nibbles, self.d, self.m, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight values (the activations' own rounding is not part of them)."""
        return dequantize_groups(*self.groups())


class OwnW8A8Weight:
    """Int8 blocks of 32 along K with an fp16 scale each (GGUF Q8_0: w = q · d) times activations
    rounded to int8 per group of 32, as llama.cpp multiplies Q8_0 by Q8_0 (drafter.kernels.w8a8_mm).
    A published model's tied embedding / LM head: `rows` looks rows up from the same bytes, so the
    embedding needs no float copy. Output fp32."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 act_dtype: torch.dtype = torch.float32):
        N, K = q.shape
        if scale.shape != (N, K // kernels.GROUP) or K % kernels.GROUP:
            raise ValueError(f"int8 blocks of 32: q {tuple(q.shape)} needs scale [N, K / 32]")
        self.q, self.d = kernels.pack_w8a8(q, scale)
        self._op = kernels.linear_op("w8a8")
        self.bias = None if bias is None else bias.detach().to(act_dtype)
        self.act_dtype, self.group_size = act_dtype, kernels.GROUP
        self.out_features, self.in_features = N, K
        self.dtype, self.device = torch.float32, q.device  # as an embedding table (`rows`)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._op(x, self.q, self.d, self.out_features)
        return y if self.bias is None else y + self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: rows `ids` as q · d in fp32 ([*ids.shape, K]), exactly the table's values."""
        return kernels.w8a8_rows(self.q, self.d, ids)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))


class OwnInt8Weight:
    """Per-output-channel symmetric int8 (w ≈ q · scale[n], fp32 scales) multiplied by specloop's own
    kernel (drafter.kernels.q8_mm, as `OwnInt4Weight`). Output in the activation dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype = torch.bfloat16):
        q, scales = int8_channels(weight)
        self.q, self.scales = kernels.pack_q8(q, scales)
        self._op = kernels.linear_op("q8")
        self.bias = None if bias is None else bias.detach().to(act_dtype)
        self.act_dtype = act_dtype
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        y = self._op(x, self.q, self.scales, self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        eye = torch.eye(self.in_features)
        return kernels.q8_mm(eye, self.q, self.scales)[:, : self.out_features].t().contiguous()


def _kernels_for(mode: str, group_size: int) -> str:
    """"own" where drafter.kernels serve this mode here (built for this CPU, self-checked; int8, or
    int4 in groups of 32), else "stock" (torch's kernels). SPECLOOP_KERNELS=stock forces the latter."""
    fits = mode in ("int8", "w4a8") or (mode == "int4" and group_size == 32)
    return "own" if fits and kernels.available() else "stock"


@dataclass(frozen=True)
class QuantSpec:
    """How a decoder's linears were prepared (kept on the decoder as `lean.quant`)."""

    mode: str
    act_dtype: torch.dtype
    group_size: int = DEFAULT_GROUP_SIZE
    from_groups: int = 0  # checkpoint weights packed from their own 4-bit groups (`int4_groups`), not requantized
    kernels: str = "stock"  # "own": drafter.kernels multiply int4 / int8 weights (fp32 products); "stock": torch's


def check_mode(mode: str) -> str:
    if mode not in DTYPE_MODES:
        raise ValueError(f"unknown weight dtype mode {mode!r}; choose one of {', '.join(DTYPE_MODES)}")
    return mode


def quantize_weight(weight: torch.Tensor, spec: QuantSpec, bias: torch.Tensor | None = None):
    """One linear weight [N, K] prepared for `spec`: a raw tensor in fp32 mode, else a weight object.
    int4 layers whose K no allowed group size divides fall back to int8 (never silently to float)."""
    if spec.mode == "fp32":
        return weight.to(spec.act_dtype)  # raw: the unquantized path (bias stays with the caller)
    if spec.mode == "bf16":
        return Dense(weight, bias, spec.act_dtype)
    own = spec.kernels == "own"
    if spec.mode == "w4a8":
        if not own:
            raise ValueError(W4A8_NEEDS)
        if weight.shape[1] % kernels.GROUP == 0:
            return OwnW4A8Weight(*minmax_groups(weight, kernels.GROUP), bias, spec.act_dtype)
        return OwnInt8Weight(weight, bias, spec.act_dtype)
    if spec.mode == "int4":
        K = weight.shape[1]
        if own and K % 32 == 0:
            return OwnInt4Weight.quantize(weight, bias, spec.act_dtype)
        sizes = [g for g in INT4_GROUP_SIZES if g <= spec.group_size and K % g == 0]
        if sizes:
            return Int4Weight(weight, bias, spec.act_dtype, max(sizes))
    return (OwnInt8Weight if own else Int8Weight)(weight, bias, spec.act_dtype)


def quantize_like(lean, weight: torch.Tensor):
    """`weight` (e.g. a DVI head's merged LM head) prepared as `lean`'s own linears are; a raw tensor
    in the decoder's dtype when it was never quantized."""
    spec = getattr(lean, "quant", None)
    weight = weight.to(lean.device)
    return weight.to(lean.dtype) if spec is None else quantize_weight(weight, spec)


def quantize_decoder(lean, mode: str, group_size: int = DEFAULT_GROUP_SIZE, act_dtype: torch.dtype | None = None,
                     groups: "str | Path | dict | None" = None, layers=None):
    """Convert `lean` in place to `mode`: every layer's linears and whatever `lean.lm_head` holds now
    (a truncated draft vocabulary's rows included); the embedding, norms, RoPE tables and the KV caches
    it makes from now on move to the activation dtype. Returns `lean`.

    `act_dtype` overrides the run-time choice (`activation_dtype`). Caches made before the call are in
    the old dtype: make new ones. Drafters that read `lean.dtype` (SD² steering) must be built after.

    `groups`: the checkpoint directory `lean` was loaded from (or `int4_groups`'s dict). In int4 mode
    with its group size, every linear it holds 4-bit groups for (a GGUF's Q4_1 tensors) is packed from
    those groups instead of requantized: the model as published (`_grouped`).

    `layers`: the decoder's layers when they are not in `lean.layers` yet (which must then be empty):
    an iterable that drafter.models fills from a checkpoint, one float layer at a time; each is
    converted as it comes and appended. The LM head and the embedding are converted before any layer.
    """
    check_mode(mode)
    if layers is not None and lean.layers:
        raise ValueError("quantize_decoder(layers=...) fills a decoder that has no layers yet")
    if getattr(lean, "quant", None) is not None:
        raise ValueError(f"decoder is already prepared as {lean.quant.mode!r}; build a new LeanDecoder to change it")
    if mode in ("int8", "int4", "w4a8") and lean.device.type != "cpu":
        raise ValueError(f"weight dtype mode {mode!r} uses CPU kernels; on {lean.device.type} use fp32 or bf16")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size {group_size} is not one of {INT4_GROUP_SIZES}")
    spec = QuantSpec(mode, act_dtype or activation_dtype(mode), group_size, kernels=_kernels_for(mode, group_size))
    if mode == "w4a8" and spec.kernels != "own":
        raise ValueError(W4A8_NEEDS + "; they are not built here: use int4")
    act = spec.act_dtype
    source = groups if isinstance(groups, (str, Path)) else None
    if mode not in ("int4", "w4a8") or groups is None:
        groups = {}
    elif not isinstance(groups, Mapping):
        groups = int4_groups(groups) or {}
    used = []
    tied = getattr(lean.config, "tie_word_embeddings", False)
    head = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    # A published 4-bit model whose head is stored at higher precision (SmolLM2's GGUF: Q8_0, tied to
    # the embedding) keeps an 8-bit head: int4 there flipped 8 of 8 greedy answers against the GGUF's.
    head_spec = replace(spec, mode="int8") if groups and not any(n in groups for n in head) else spec
    blocks = _head_blocks(lean, head[0], source, mode)
    if blocks is not None:  # the published int8 head (Q8_0) as it is, and the tied embedding read from it
        lean.lm_head = blocks
        lean.embed = blocks if tied else lean.embed.to(act)
        used.append(head[0])
    else:
        lean.lm_head = _grouped(lean.lm_head, head if lean.vocab_ids is None else [], groups, head_spec, used)
        lean.embed = lean.embed.to(act)
    lean.final_norm = lean.final_norm.to(act)
    lean.cos, lean.sin = lean.cos.to(act), lean.sin.to(act)
    for i, layer in enumerate(lean.layers if layers is None else layers):
        pre = f"model.layers.{i}."
        attn = [f"{pre}self_attn.{n}_proj.weight" for n in "qkv"]
        layer.qkv = _grouped(layer.qkv, attn, groups, spec, used, layer.qkv_bias)
        if mode == "fp32":
            layer.qkv_bias = None if layer.qkv_bias is None else layer.qkv_bias.to(act)
        else:
            layer.qkv_bias = None  # held by the weight object
        layer.o = _grouped(layer.o, [f"{pre}self_attn.o_proj.weight"], groups, spec, used)
        layer.gate_up = _grouped(layer.gate_up, [f"{pre}mlp.gate_proj.weight", f"{pre}mlp.up_proj.weight"], groups,
                                 spec, used)
        layer.down = _grouped(layer.down, [f"{pre}mlp.down_proj.weight"], groups, spec, used)
        layer.in_norm, layer.post_norm = layer.in_norm.to(act), layer.post_norm.to(act)
        layer.q_norm = None if layer.q_norm is None else layer.q_norm.to(act)
        layer.k_norm = None if layer.k_norm is None else layer.k_norm.to(act)
        if layers is not None:
            lean.layers.append(layer)
    lean.dtype = act
    lean.quant = replace(spec, from_groups=len(used))
    return lean


def _head_blocks(lean, name: str, source, mode: str) -> "OwnW8A8Weight | None":
    """In w4a8 mode, the LM head from the checkpoint's own int8 blocks (`int8_blocks` of `source`, a
    directory) when they reproduce the loaded head exactly (a stale file is never served), else None."""
    if mode != "w4a8" or source is None or lean.vocab_ids is not None or not isinstance(lean.lm_head, torch.Tensor):
        return None
    found = int8_blocks(source).get(name)
    if found is None:
        return None
    q, d = found
    if not reproduces(q, d, None, lean.lm_head):
        import warnings

        warnings.warn(f"int8 blocks of {name} do not reproduce the loaded weight: requantizing it")
        return None
    return OwnW8A8Weight(q, d)


INT4_GROUPS_FILE = "q4_1.safetensors"  # a fetched verifier's GGUF Q4_1 groups: NAME.q [N, K] uint8, NAME.d / .m [N, K/32]


def int4_groups(path: str | Path) -> "GroupsFile | None":
    """The 4-bit groups a checkpoint directory ships beside its float weights (named by its manifest's
    "groups", written by `specloop models fetch` from the GGUF): Hugging Face parameter name →
    (q [N, K] uint8 in [0, 15], scale [N, K/g], minimum [N, K/g]) with w = q · scale + minimum. None
    when it has none."""
    return _source_tensors(path, with_minimum=True)


def int8_blocks(path: str | Path) -> "GroupsFile | dict":
    """The int8 blocks a checkpoint directory ships in its groups file (a GGUF's Q8_0 tensors: NAME.q
    int8, NAME.d [N, K/32], no NAME.m): Hugging Face parameter name → (q, d), w = q · d."""
    return _source_tensors(path, with_minimum=False) or {}


def _source_tensors(path: str | Path, with_minimum: bool) -> "GroupsFile | None":
    """From the groups file the manifest names (None when there is none): NAME → (q, d, m) for the
    entries that have a minimum, or (q, d) for those that have none; each read when asked for."""
    name = _read_json(Path(path) / VERIFIER_MANIFEST).get("groups")
    if not name or not (Path(path) / name).is_file():
        return None
    return GroupsFile(Path(path) / name, with_minimum)


class GroupsFile(Mapping):
    """A groups file's entries, read on demand (one weight's parts at a time), so that converting a
    model holds one layer's groups at a time rather than the whole file (150 MB for SmolLM2-135M)."""

    def __init__(self, file: Path, with_minimum: bool):
        self.file, self.parts = file, (".q", ".d", ".m") if with_minimum else (".q", ".d")
        with open_safetensors(file) as f:
            keys = set(f.keys())
        self.names = sorted(k[:-2] for k in keys if k.endswith(".q") and k[:-2] + ".d" in keys
                            and (k[:-2] + ".m" in keys) == with_minimum)

    def __getitem__(self, name: str) -> tuple[torch.Tensor, ...]:
        if name not in self.names:
            raise KeyError(name)
        with open_safetensors(self.file) as f:
            return tuple(f.get_tensor(name + p) for p in self.parts)

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def open_safetensors(file: Path):
    """A safetensors file opened to read tensors with pread(2) into memory of their own: the default
    memory map keeps every page a read touched resident (and counted) while the file is open."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", backend="pread")
    except TypeError:  # safetensors before the `backend` option: memory-mapped
        return safe_open(str(file), framework="pt")


def reproduces(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, weight: torch.Tensor,
               rows: int = 4096) -> bool:
    """Whether `dequantize_groups(q, scale, minimum)` equals `weight` exactly, compared a block of rows
    at a time (a whole LM head dequantized at once is a float copy of it: 113 MB on SmolLM2)."""
    if q.shape != weight.shape:
        return False
    for i in range(0, q.shape[0], rows):
        part = slice(i, i + rows)
        m = None if minimum is None else minimum[part]
        if not torch.equal(dequantize_groups(q[part], scale[part], m), weight[part].detach().float().cpu()):
            return False
    return True


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None = None) -> torch.Tensor:
    """q · scale (+ minimum) in fp32 per group, [N, K]: a product, then a sum, as GGUF's own
    dequantization of Q4_1 (with a minimum) and Q8_0 (without)."""
    N, K = q.shape
    G = scale.shape[1]
    w = q.float().view(N, G, K // G) * scale.float()[..., None]
    return (w if minimum is None else w + minimum.float()[..., None]).view(N, K)


def _grouped(weight: torch.Tensor, names: list[str], groups: dict, spec: QuantSpec, used: list,
             bias: torch.Tensor | None = None):
    """`quantize_weight`, or an `Int4Weight.from_groups` when `groups` holds every part of this (fused)
    weight, concatenated along N as the decoder concatenates the weights, at the spec's group size,
    and q · scale + minimum equals the weight exactly (a stale groups file is never served)."""
    parts = [groups.get(n) for n in names]
    if not parts or any(p is None for p in parts):
        return quantize_weight(weight, spec, bias)
    q, d, m = (torch.cat([p[j] for p in parts]) for j in range(3))
    K = weight.shape[1]
    if q.shape != weight.shape or d.shape[1] == 0 or K % d.shape[1] or K // d.shape[1] != spec.group_size:
        return quantize_weight(weight, spec, bias)
    if not reproduces(q, d, m, weight):
        import warnings

        warnings.warn(f"int4 groups of {', '.join(names)} do not reproduce the loaded weight: requantizing it")
        return quantize_weight(weight, spec, bias)
    used.extend(names)
    if spec.mode == "w4a8":
        return OwnW4A8Weight(q, d.float(), m.float(), bias, spec.act_dtype)
    if spec.kernels == "own":
        return OwnInt4Weight(q, d.float(), m.float(), bias, spec.act_dtype)
    return Int4Weight.from_groups(q, d, m, bias, spec.act_dtype)


# ---------------------------------------------------------------- what this CPU runs fastest


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> bool:
    """Whether the CPU has bf16 arithmetic in hardware (AVX512_BF16 or AMX-BF16).

    `torch.backends.cpu.get_cpu_capability()` says only "AVX512" on such a CPU (it does not name
    the bf16 extension), and `torch.ops.mkldnn._is_mkldnn_bf16_supported()` is true on any AVX-512
    core CPU, so the flags are read directly; the capability string is the fallback."""
    flags = cpu_flags()
    if flags:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    capability = torch.backends.cpu.get_cpu_capability()
    return "BF16" in capability or "AMX" in capability


def activation_dtype(mode: str) -> torch.dtype:
    """The activation dtype for `mode`: fp32 → fp32, bf16 → bf16; int8 / int4 → fp32 where specloop's
    own kernels serve them (drafter.kernels), else bf16 where the CPU has native bf16, else fp32.
    Fixed by the CPU, never timed: two processes serving one model must run the same verifier.
    (Measured on the development CPU: with bf16 activations torch's stock int kernels run 10-50x
    faster than with fp32 ones, whose paths are not vectorized.)"""
    check_mode(mode)
    if mode in ("fp32", "bf16"):
        return torch.float32 if mode == "fp32" else torch.bfloat16
    if mode == "w4a8":
        return torch.float32  # the products quantize their inputs themselves
    if _kernels_for(mode, DEFAULT_GROUP_SIZE) == "own":
        return torch.float32  # specloop's kernels multiply in fp32: bf16 activations would only add roundings
    return torch.bfloat16 if native_bf16() else torch.float32


VERIFIER_MANIFEST = "manifest.json"  # in a verifier directory: {"weights": MODE, ...} names its served mode
_STORED_MODES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp32"}  # fp16 is upcast exactly


def stored_mode(path: str | Path | None) -> str:
    """The weight mode a Hugging Face directory is stored in (config.json `dtype` / `torch_dtype`):
    fp32 or bf16; fp16 checkpoints serve as fp32 (an exact upcast); fp32 when it says nothing."""
    config = {} if path is None else _read_json(Path(path) / "config.json")
    return _STORED_MODES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), "fp32")


def manifest_mode(path: str | Path | None) -> str | None:
    """The served mode a checkpoint's own manifest names (`specloop models fetch` writes "int4" for
    a model published as a 4-bit GGUF), or None."""
    mode = None if path is None else _read_json(Path(path) / VERIFIER_MANIFEST).get("weights")
    return None if mode is None else check_mode(mode)


def _read_json(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def resolve_mode(mode: str | None, device: torch.device | str = "cpu", role: str = "verifier",
                 path: str | Path | None = None) -> str:
    """`mode` itself, or what "auto" / None means for `role`:

    - a verifier is served as its checkpoint `path` is: the mode its manifest names, else the dtype it
      is stored in (fp32 / bf16). Never a quantized copy nobody asked for. A manifest's int8 / int4
      needs specloop's kernels built for this CPU (drafter.kernels) or native bf16 (torch's stock
      kernels are 10-50x slower with fp32 activations): elsewhere, and on CUDA, the stored dtype is
      served instead (`describe_mode` says so).
    - a drafter: `default_mode` (its precision costs acceptance only, never output).
    """
    if mode not in (None, "auto"):
        return check_mode(mode)
    if role == "drafter":
        return default_mode(device, role)
    wanted = manifest_mode(path)
    own = _kernels_for(wanted or "int8", DEFAULT_GROUP_SIZE) == "own"
    if wanted == "w4a8" and not own:
        wanted = "int4"  # the same weights through torch's stock kernels (where native bf16 makes them fast)
    if wanted in ("int8", "int4", "w4a8") and (torch.device(device).type != "cpu" or not (own or native_bf16())):
        wanted = None
    return wanted or stored_mode(path)


def describe_mode(lean) -> str:
    """What a decoder serves, for start-up lines, /v1/models and benchmark rows: "fp32", "int4
    (fp32 activations, specloop kernels)", "int8 (bf16 activations)" ..."""
    spec = getattr(lean, "quant", None)
    if spec is None:
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(lean.dtype, str(lean.dtype))
    act = {torch.float32: "fp32", torch.bfloat16: "bf16"}[spec.act_dtype]
    if spec.mode in ("fp32", "bf16"):
        return spec.mode
    if spec.mode == "w4a8":
        return "w4a8 (int4 weights, int8 activations, specloop kernels)"
    return f"{spec.mode} ({act} activations{', specloop kernels' if spec.kernels == 'own' else ''})"


def default_mode(device: torch.device | str = "cpu", role: str = "drafter") -> str:
    """The fastest sensible weight mode here. Used for drafters only by "auto" (a verifier is served
    as stored: `resolve_mode`); kept for `--weights fast`-style choices and benchmarks.

    Measured on the development CPU (AMD EPYC, AVX-512 + avx512_bf16, no AMX; 1 thread; SmolLM2-135M
    shape with random weights, 128 tokens of context; ms per forward, T=1 decode / T=5 verify pass):
    fp32 42 / 80, bf16 33 / 29, int8 16 / 21, int4 12 / 19. Decoding a small model is bound by
    reading weights; int8 reads 4x and int4 ~7x fewer bytes than fp32.

    - CUDA: "fp32" for a verifier, "bf16" for a drafter (the int kernels here are CPU ones).
    - CPU where specloop's kernels build: "w4a8" for a drafter (int8 activations: cheapest drafts).
    - CPU with native bf16 (avx512_bf16 / AMX-BF16): "int8" for a verifier, "int4" for a drafter.
    - CPU without native bf16: "fp32". The int kernels are fast only with bf16 activations, and
      bf16 element-wise work is emulated there.
    """
    if role not in ("verifier", "drafter"):
        raise ValueError(f"role must be 'verifier' or 'drafter', got {role!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return "fp32" if role == "verifier" else "bf16"
    if role == "drafter" and _kernels_for("w4a8", DEFAULT_GROUP_SIZE) == "own":
        return "w4a8"
    if not native_bf16():
        return "fp32"
    return "int8" if role == "verifier" else "int4"
