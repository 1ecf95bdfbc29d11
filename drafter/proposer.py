"""The drafter interface: `propose()` k tokens per row, then `observe()` what the verifier kept.

Every drafter kind (pretrained LM, n-gram lookup, and the trainable kinds) implements this, so the
speculative step never knows which one it drives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from drafter.rejection import BlockOutcome
from drafter.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] int64 drafted tokens
    probs: torch.Tensor | None  # [B, k, V] q the tokens were drawn from; None at temperature 0


class Drafter(Protocol):
    kind: str

    def start(self, prompts: list[list[int]], capacity: int) -> None:
        """Begin a batch: remember (or prefill) each row's prompt; capacity bounds its length."""

    def propose(self, k: int, params: SamplingParams, uniforms: torch.Tensor | None) -> Proposal:
        """Draft k tokens per row; uniforms [B, k] drive sampling at temperature > 0."""

    def observe(self, outcome: BlockOutcome, active: torch.Tensor) -> None:
        """Take the verifier's verdict; rows where active [B] is False are finished."""


def pad_right(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists → ([B, T] int64 right-padded, [B] lengths)."""
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = max(1, int(lens.max())) if rows else 1
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out, lens


def emitted_tokens(outcome: BlockOutcome, b: int) -> list[int]:
    """The n + 1 tokens row b gained in this block."""
    n = int(outcome.num_accepted[b])
    return outcome.tokens[b, : n + 1].tolist()
