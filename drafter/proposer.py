"""The drafter interface: `propose()` k tokens per row, then `observe()` what the verifier kept.

Every drafter kind (pretrained LM, n-gram lookup, and the trainable kinds) implements this, so the
speculative step never knows which one it drives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from drafter.decoder import KVCache
from drafter.rejection import BlockOutcome
from drafter.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] int64 drafted tokens
    probs: torch.Tensor | None  # [B, k, V] q the tokens were drawn from; None at temperature 0


@dataclass
class VerifierView:
    """What a drafter may read of the verifier, computed by passes the verifier runs anyway."""

    cache: KVCache  # the verifier's KV cache (lens = committed tokens but the newest)
    features: dict[int, torch.Tensor]  # layer -> [B, hidden]: residual stream at the position that
    #                                    produced the newest committed token (the drafter's `verifier_layers`)


class Drafter(Protocol):
    kind: str
    verifier_layers: tuple[int, ...]  # hidden states it needs from the verifier (SD² steering)

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView) -> None:
        """Begin a batch: remember (or prefill) each row's prompt; capacity bounds its length."""

    def propose(self, k: int, params: SamplingParams, uniforms: torch.Tensor | None) -> Proposal:
        """Draft k tokens per row; uniforms [B, k] drive sampling at temperature > 0."""

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView) -> None:
        """Take the verifier's verdict; rows where active [B] is False are finished."""


def stack_proposal(drafts: list[torch.Tensor], probs: list[torch.Tensor | None], params: SamplingParams) -> Proposal:
    """k per-step [B] tokens and [B, V] distributions → one Proposal."""
    return Proposal(tokens=torch.stack(drafts, dim=1), probs=None if params.greedy else torch.stack(probs, dim=1))


def emitted_tokens(outcome: BlockOutcome, b: int) -> list[int]:
    """The n + 1 tokens row b gained in this block."""
    n = int(outcome.num_accepted[b])
    return outcome.tokens[b, : n + 1].tolist()
