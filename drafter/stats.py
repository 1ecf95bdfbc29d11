"""Acceptance counts over blocks."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    """Counts over a request's blocks. A block drafts its own k (a request's explicit k, or the
    controller's choice of the step, 0 for a plain step); positions are counted up to `k`, the most
    a block of the request may draft."""

    k: int
    blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k] blocks that accepted position i
    drafted_per_position: list[int] = field(default_factory=list)  # [k] blocks that drafted position i

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.k
        self.drafted_per_position = self.drafted_per_position or [0] * self.k

    def record(self, n: int, k: int | None = None) -> None:
        """One block: k drafts (default: this request's k), the first n accepted."""
        k = self.k if k is None else k
        self.blocks += 1
        self.drafted += k
        self.accepted += n
        self._grow(k)
        for i in range(k):
            self.drafted_per_position[i] += 1
        for i in range(n):
            self.accepted_per_position[i] += 1

    def _grow(self, k: int) -> None:
        for counts in (self.accepted_per_position, self.drafted_per_position):
            counts.extend([0] * (k - len(counts)))

    def merge(self, other: "RequestStats") -> None:
        """Add another request's counts into these (positions up to the longer of the two)."""
        self.blocks += other.blocks
        self.drafted += other.drafted
        self.accepted += other.accepted
        self._grow(len(other.accepted_per_position))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            for i, c in enumerate(theirs):
                mine[i] += c

    @property
    def acceptance_rate(self) -> float:
        """α = accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def block_efficiency(self) -> float:
        """τ = mean(n + 1) over blocks."""
        return (self.accepted + self.blocks) / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict:
        return {
            "blocks": self.blocks,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "block_efficiency": self.block_efficiency,
            "accepted_per_position": list(self.accepted_per_position),
        }
