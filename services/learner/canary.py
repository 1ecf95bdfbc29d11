"""Promotion by canary: a newly promoted drafter version is judged against its predecessor on the same
live traffic at the same time, so that a regression is told apart from a change of traffic.

The learner reads the replay records the new champion's blocks produce. Each carries the verifier's
distribution at the drafted positions (top-K log-probs) and the context, so both versions' drafting
distributions can be scored against the same verifier outcome: simulated acceptance Σ min(p, q) per
position, the quantity the promotion gate uses. When `records` such records arrived, the new
version is rolled back (compare-and-set: once, whatever the number of workers) if it scores more
than `margin` below its predecessor on them and the paired difference, record by record, is
`z` standard errors clear of zero: two close versions differ by noise on a sample this small (a
drift run with margin alone rolled back 1 of 48 promotions, 0.61 against 0.68 on 64 records).
Traffic that drifts lowers both scores alike and triggers nothing; a zeroed or garbage drafter
scores near 0 at once.

Pure bookkeeping here; `specloop.services.learner.learner` scores and acts.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CanaryConfig:
    records: int = 128  # records drafted by the new champion that decide (within 256 blocks)
    margin: float = 0.05  # how far its simulated acceptance may fall below its predecessor's
    z: float = 3.0  # standard errors the paired per-record difference must clear


@dataclass(frozen=True)
class CanaryVerdict:
    """A judged canary (`LearnerService.judge_canary`): both versions' simulated acceptance on the live
    records the watched one drafted, and whether it was rolled back (`reason`: why it should be; None: kept)."""

    version: str
    predecessor: str
    sim_acceptance: float
    predecessor_sim_acceptance: float
    records: int
    rolled_back: bool
    reason: str | None
    time: float


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

    def verdict(self, new: list[list[float]], old: list[list[float]]) -> str | None:
        """A rollback reason when the new version scored too far below its predecessor, else None.
        `new`, `old`: per record, per position simulated acceptance of each version."""
        pairs = [(sum(n) / len(n), sum(o) / len(o)) for n, o in zip(new, old) if n and o]
        if len(pairs) < 2:
            return None
        count = sum(len(n) for n in new)
        new_mean, old_mean = sum(map(sum, new)) / count, sum(map(sum, old)) / count
        diffs = [o - n for n, o in pairs]
        mean = sum(diffs) / len(diffs)
        se = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5
        if not (new_mean < old_mean - self.cfg.margin and mean > self.cfg.z * se):
            return None
        return (f"canary: {self.version} simulated acceptance {new_mean:.3f} < {self.predecessor} {old_mean:.3f} "
                f"− margin {self.cfg.margin} on the same {len(pairs)} live records (paired difference {mean:.3f} "
                f"± {se:.3f})")
