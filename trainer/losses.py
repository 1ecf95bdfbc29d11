"""Losses between the verifier's and the drafter's next-token distributions, on logits.

Notation (one position): p = softmax(verifier logits) = π_V, q = softmax(drafter logits) = π_D.
Every function takes logits of shape [..., V] (flattened here to N positions), computes in float32
from log_softmax, and averages over positions; `mask` [...] (True = counts) drops padding positions.

- forward KL   KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)     mass-covering; its gradient in the
  drafter's logits is q − p, the cross-entropy gradient against soft targets.
- total variation  TV(p, q) = ½ Σ_v |p_v − q_v|  ∈ [0, 1].
- expected acceptance  α(p, q) = Σ_v min(p_v, q_v) = 1 − TV: the probability that speculative
  sampling accepts one token drafted from q (Leviathan et al.), so minimising TV maximises it.
- LK hybrid  λ·KL + (1 − λ)·TV with λ = clamp(1 − α̂, 0, 1), α̂ a running estimate of α supplied by
  the caller: KL leads while the drafter is far off (TV's gradient vanishes where q ≪ p), the
  acceptance objective takes over as α̂ rises.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _flat(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor | None):
    """[..., V] × 2 (+ mask [...]) → float32 [N, V] × 2 and weights [N] summing to 1."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}")
    p = p_logits.reshape(-1, p_logits.shape[-1]).float()  # [N, V]
    q = q_logits.reshape(-1, q_logits.shape[-1]).float()  # [N, V]
    if mask is None:
        w = torch.full((p.shape[0],), 1.0 / max(1, p.shape[0]), device=p.device)  # [N]
    else:
        w = mask.reshape(-1).to(device=p.device, dtype=torch.float32)  # [N]
        w = w / w.sum().clamp(min=1.0)
    return p, q, w


def forward_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """mean_t KL(π_V ‖ π_D) = mean_t Σ_v p (log p − log q).  p_logits, q_logits: [..., V]; mask: [...]."""
    p, q, w = _flat(p_logits, q_logits, mask)
    log_p = F.log_softmax(p, dim=-1)  # [N, V]
    log_q = F.log_softmax(q, dim=-1)  # [N, V]
    per_pos = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # [N]
    return (per_pos * w).sum()


def total_variation(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """mean_t ½ Σ_v |p − q|  ∈ [0, 1].  p_logits, q_logits: [..., V]; mask: [...]."""
    p, q, w = _flat(p_logits, q_logits, mask)
    per_pos = 0.5 * (F.softmax(p, dim=-1) - F.softmax(q, dim=-1)).abs().sum(dim=-1)  # [N]
    return (per_pos * w).sum()


@torch.no_grad()
def expected_acceptance(
    p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """mean_t Σ_v min(p, q) = 1 − TV (no gradient).  p_logits, q_logits: [..., V]; mask: [...]."""
    p, q, w = _flat(p_logits, q_logits, mask)
    per_pos = torch.minimum(F.softmax(p, dim=-1), F.softmax(q, dim=-1)).sum(dim=-1)  # [N]
    return (per_pos * w).sum()


def lk_weight(acceptance: float | torch.Tensor) -> float:
    """λ = clamp(1 − α̂, 0, 1): the KL share of the LK loss at running acceptance α̂."""
    return min(1.0, max(0.0, 1.0 - float(acceptance)))


def lk_hybrid(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    acceptance: float | torch.Tensor,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """(λ·KL(π_V ‖ π_D) + (1 − λ)·TV, λ) with λ = clamp(1 − acceptance, 0, 1).

    `acceptance` is the caller's running (EMA) estimate of expected acceptance, so the KL weight
    falls as the drafter improves. p_logits, q_logits: [..., V]; mask: [...].
    """
    lam = lk_weight(acceptance)
    loss = lam * forward_kl(p_logits, q_logits, mask) + (1.0 - lam) * total_variation(p_logits, q_logits, mask)
    return loss, lam


LOSSES = ("kl", "tv", "lk")


def distribution_loss(
    name: str,
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    acceptance: float = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """(loss, λ) for a loss named in LOSSES; λ is the KL share (1 for "kl", 0 for "tv")."""
    if name == "kl":
        return forward_kl(p_logits, q_logits, mask), 1.0
    if name == "tv":
        return total_variation(p_logits, q_logits, mask), 0.0
    if name == "lk":
        return lk_hybrid(p_logits, q_logits, acceptance, mask)
    raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
