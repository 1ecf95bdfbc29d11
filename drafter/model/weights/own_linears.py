"""The linear layers on specloop's own CPU kernels (specloop.drafter.model.kernels): int4 groups of 32 (GGUF Q4_1's
form), int4 weights times int8 activations (w4a8), int8 blocks (GGUF Q8_0) and per-channel int8."""
from __future__ import annotations

import torch

from specloop.drafter.model import kernels
from specloop.drafter.model.weights.groups import dequantize_groups
from specloop.drafter.model.weights.linears import int8_channels, minmax_groups


class OwnInt4Weight:
    """Int4 groups of 32 along K, w = q · d + m (GGUF Q4_1's form, d and m in fp16, exact for a GGUF), multiplied by
    specloop's own kernel (specloop.drafter.model.kernels.q4_mm: fp32 products, each tile of weights read once for
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
    y = Σ_g d·dx·Σ q·xq + m·dx·Σ xq (specloop.drafter.model.kernels.w4a8_mm). Output fp32."""

    _pack, _kind = staticmethod(kernels.pack_w4a8), "w4a8"

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernels.unpack_w4a8(self.nibbles, self.d, self.m, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight values (the activations' own rounding is not part of them)."""
        return dequantize_groups(*self.groups())


class OwnW8A8Weight:
    """Int8 blocks of 32 along K with an fp16 scale each (GGUF Q8_0: w = q · d) times activations
    rounded to int8 per group of 32, as llama.cpp multiplies Q8_0 by Q8_0 (specloop.drafter.model.kernels.w8a8_mm).
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

    def choose(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(this product, each row's argmax over it [...]: the logits and the greedy choices of an LM head, from one
        call, specloop.drafter.model.kernels.w8a8_choose; None for the choices where a row holds a NaN, or with a
        bias)."""
        if self.bias is not None:
            return self(x), None
        both = kernels.w8a8_choose(x, self.q, self.d, self.out_features)
        return (self(x), None) if both is None else both

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: rows `ids` as q · d in fp32 ([*ids.shape, K]), exactly the table's values."""
        return kernels.w8a8_rows(self.q, self.d, ids)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))


class OwnInt8Weight:
    """Per-output-channel symmetric int8 (w ≈ q · scale[n], fp32 scales) multiplied by specloop's own
    kernel (specloop.drafter.model.kernels.q8_mm, as `OwnInt4Weight`). Output in the activation dtype."""

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


def kernel_linears(linears) -> tuple[list[int], list[int], list[torch.Tensor]] | None:
    """(kinds, widths, packed tensors) of `linears` as the C++ calls that take several linears at once read them
    (`kernels.layer`, `kernels.head_draft`: kind 0 int4, 1 int8, 2 w4a8; three tensors each), or None where one of
    them is not one of these weights, has a bias, or computes in another dtype than fp32."""
    kinds, dims, parts = [], [], []
    for lin in linears:
        kind = {OwnInt4Weight: 0, OwnInt8Weight: 1, OwnW4A8Weight: 2}.get(type(lin))
        if kind is None or lin.bias is not None or lin.act_dtype != torch.float32:
            return None
        kinds.append(kind)
        dims.append(lin.out_features)
        parts += [lin.q, lin.scales, lin.scales] if kind == 1 else [lin.nibbles, lin.d, lin.m]
    return kinds, dims, parts
