"""Acceptance counts over verified blocks: the one stats type of a request (`Generation.stats`), of a
run (`specloop generate`'s totals), of a drafter version (the worker's monitor, the metrics exporter)
and of the blocks drafted on a stale cache.

A block drafts k tokens (k = 0: a plain step) and the verifier accepts the first n of them, then
emits one more. Words as in docs/architecture.md: α = accepted / drafted; τ = mean(n + 1) over blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class AcceptanceStats:
    """Counts over blocks. Per-position counts start `positions` long (a request's k: the most a block
    of it may draft, so that its JSON lists every position) and grow with longer blocks."""

    positions: int = 0
    blocks: int = 0  # every block, plain ones (k = 0) too
    drafts: int = 0  # blocks that drafted (k > 0)
    drafted: int = 0  # Σ k
    accepted: int = 0  # Σ n
    accepted_per_position: list[int] = field(default_factory=list)  # blocks that accepted position i
    drafted_per_position: list[int] = field(default_factory=list)  # blocks that drafted position i

    def __post_init__(self):
        self._grow(self.positions)

    def observe(self, k: int, accepted: int) -> None:
        """One block: k drafted tokens, the first `accepted` of them accepted."""
        if not 0 <= accepted <= k:
            raise ValueError(f"a block accepts 0..k tokens: k={k}, accepted={accepted}")
        self.blocks += 1
        self.drafts += int(k > 0)
        self.drafted += k
        self.accepted += accepted
        self._grow(k)
        for i in range(k):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @classmethod
    def of(cls, k: Iterable[int], accepted: Iterable[int]) -> "AcceptanceStats":
        """The statistics of many blocks (one engine step's rows, a window of blocks)."""
        k, accepted = list(k), list(accepted)
        if len(k) != len(accepted):
            raise ValueError(f"{len(k)} draft lengths for {len(accepted)} accepted counts")
        stats = cls()
        for k_i, n_i in zip(k, accepted):
            stats.observe(k_i, n_i)
        return stats

    def merge(self, other: "AcceptanceStats") -> None:
        """Add another's counts into these (positions up to the longer of the two)."""
        self.blocks += other.blocks
        self.drafts += other.drafts
        self.drafted += other.drafted
        self.accepted += other.accepted
        self._grow(len(other.accepted_per_position))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            for i, c in enumerate(theirs):
                mine[i] += c

    def _grow(self, k: int) -> None:
        for counts in (self.accepted_per_position, self.drafted_per_position):
            counts.extend([0] * (k - len(counts)))

    def acceptance_rate(self) -> float | None:
        """α = accepted / drafted (None before any draft)."""
        return self.accepted / self.drafted if self.drafted else None

    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: τ over the blocks that drafted (vLLM's; None before any)."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def block_efficiency(self) -> float:
        """τ = mean(n + 1) over every block, plain ones included (0 before any)."""
        return (self.accepted + self.blocks) / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict:
        """The `stats` object of `specloop generate --json` (docs/usage.md)."""
        return {
            "blocks": self.blocks,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "block_efficiency": self.block_efficiency,
            "accepted_per_position": list(self.accepted_per_position),
        }
