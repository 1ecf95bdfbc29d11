"""Helpers several test modules share (moved from test_quant.py)."""
from __future__ import annotations

import torch

from specloop.drafter.model.weights.linears import Int4Weight
from specloop.drafter.model.weights.own_linears import OwnInt4Weight


def q4_1_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1-style groups of 32 along K for w [N, K]: q uint8 in [0, 15], fp16 d and m."""
    N, K = w.shape
    blocks = w.float().reshape(N, K // 32, 32)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d, m = ((hi - lo) / 15).clamp(min=1e-4).half(), lo.half()
    q = ((blocks - m.float()[..., None]) / d.float()[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(N, K), d, m


def packed_q(w) -> torch.Tensor:
    """The 4-bit values an Int4Weight packed: its kernel with scale 1 and zero 8 multiplies by q itself
    (an OwnInt4Weight: its groups as packed)."""
    if isinstance(w, OwnInt4Weight):
        return w.groups()[0]
    probe = Int4Weight.__new__(Int4Weight)
    probe.__dict__.update(w.__dict__)
    probe.scales_zeros = torch.stack([torch.ones_like(w.scales_zeros[..., 0]), torch.full_like(w.scales_zeros[..., 1], 8)],
                                     dim=-1)
    return probe.dequantize().round().to(torch.uint8)
