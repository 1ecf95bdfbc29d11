"""The linear layers on torch's own kernels, and the quantizers every weight object uses.

A linear "weight" is a raw tensor (`F.linear`, the unquantized path) or a weight object holding its
own bias; `linear(x, w, bias)` calls either. Here: `Dense` (fp32 / bf16), `Int8Weight`
(`torch._weight_int8pack_mm`), `Int4Weight` (tinygemm's CPU packing), `row_blocked` (decode-shaped
passes in calls of a fixed row count), and the quantizers `int8_channels` and `minmax_groups`.
specloop's own kernels' weight objects: specloop.drafter.model.weights.own_linears.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specloop.drafter.model.weights.modes import DEFAULT_GROUP_SIZE

INT4_GROUP_SIZES = (32, 64, 128)
_INT4_N_MULTIPLE = 16  # the CPU int4 packing needs N % 16 == 0: pad with zero rows
# Int4Weight quantizes and packs in blocks of this many rows, so a large weight (an LM head) never has
# full-size float / int32 temporaries beside it. A multiple of 64: the CPU packing lays out each block
# of 64 rows on its own, so packing row blocks and concatenating them is the one-piece layout, bit for
# bit (tests/drafter/model/test_quant.py).
_INT4_BLOCK_ROWS = 4096



# Decode-shaped passes (one-token steps and verify passes) call the float GEMMs on row blocks of a
# fixed size, so that every row meets the same kernel path whatever the number of rows: the CPU's
# fp32 / bf16 kernels round a row differently depending on how many rows share the call (fp32 M = 1
# takes a GEMV path; bf16 changes blocking at M >= 15), and an unblocked verify pass of k+1 tokens
# would score a token differently from the one-token step. fp32 goes row by row (its M = 8 GEMM costs
# ~3x its GEMV here, which one-token decoding should not pay); bf16 in blocks of 8 (as fast as one
# row). The int8 / int4 kernels compute each row alone already. Long passes (prefills, one prompt
# at a time: specloop.drafter.model.decoder.prefill) take one plain call.
ROW_BLOCK = {torch.float32: 1, torch.bfloat16: 8, torch.float16: 8}


def row_blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed in calls of exactly ROW_BLOCK[dtype] rows (zero-padded)."""
    block = ROW_BLOCK.get(weight.dtype, 8)
    rows = x.reshape(-1, x.shape[-1])
    M = rows.shape[0]
    if block == 1:  # one-row products, one call each: a batched product (bmm) of one-row products rounds
        # otherwise once the batch has 2+ rows on some CPUs (seen on an AMX Xeon), one call per row never
        # does, and costs about what the batch costs at decode sizes
        y = torch.cat([F.linear(r, weight, bias) for r in rows.split(1)]) if M > 1 else F.linear(rows, weight, bias)
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
        self.packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                                     rows.to(torch.int32).contiguous(), 1)
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

