"""Promotion by canary: a newly promoted drafter version is judged against its predecessor on the same
live traffic at the same time, so that a regression is told apart from a change of traffic.

The learner reads the replay records the new champion's blocks produce. Each carries the verifier's
distribution at the drafted positions (top-K log-probs) and the context, so both versions' drafting
distributions can be scored against the same verifier outcome: simulated acceptance Σ min(p, q) per
position, the quantity the promotion gate uses. When `records` such records arrived and the new
version scores more than `margin` below its predecessor on them, the registry is rolled back from
that version (compare-and-set: once, whatever the number of workers). Traffic that drifts lowers
both scores alike and triggers nothing; a zeroed or garbage drafter scores near 0 at once.

Pure bookkeeping here; `services.learner` scores and acts.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CanaryConfig:
    records: int = 64  # records drafted by the new champion that decide (well within 256 blocks)
    margin: float = 0.05  # how far its simulated acceptance may fall below its predecessor's


@dataclass
class Canary:
    """One promoted version under watch, with the live records it drafted since."""

    version: str
    predecessor: str
    cfg: CanaryConfig = field(default_factory=CanaryConfig)
    records: list = field(default_factory=list)

    def offer(self, record) -> None:
        """Keep `record` if the watched version drafted it and the sample is not full yet."""
        if record.drafter_version == self.version and len(self.records) < self.cfg.records:
            self.records.append(record)

    @property
    def ready(self) -> bool:
        return len(self.records) >= self.cfg.records

    def verdict(self, new: float | None, old: float | None) -> str | None:
        """A rollback reason when the new version scored too far below its predecessor, else None."""
        if new is None or old is None or not new < old - self.cfg.margin:
            return None
        return (f"canary: {self.version} simulated acceptance {new:.3f} < {self.predecessor} {old:.3f} − margin "
                f"{self.cfg.margin} on the same {len(self.records)} live records")
