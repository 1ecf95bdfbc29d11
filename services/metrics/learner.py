"""The learner's metrics (`LearnerMetrics`): updates, loss, staleness, buffer depth, publishing and
the promotion gate. Names in `specloop.services.metrics`."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from specloop.services.metrics.export import Exporter

AGE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class LearnerMetrics(Exporter):
    """What the learner exports: updates, loss, staleness, buffer depth, publishing and the gate."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = ""):
        super().__init__(registry, model_name)
        self.updates = self._counter("learner_updates", "Optimizer steps taken by the learner.")
        self.loss = self._gauge("learner_loss", "Loss of the learner's last update.")
        self.lag = self._gauge("learner_lag_versions",
                               "Versions between the newest records trained on and the newest published version.")
        self.record_age = self._histogram("learner_record_age_seconds",
                                          "Age of the newest record at each update (append to training).",
                                          AGE_BUCKETS)
        self.depth = self._gauge("buffer_depth", "Entries held by the replay buffer.")
        self.pending = self._gauge("buffer_pending", "Replay entries delivered but not acknowledged.")
        self.versions_published = self._counter("learner_versions_published", "Versions the learner published.")
        self.promotions = self._counter("promotions", "Published versions promoted to champion.")
        self.refusals = self._counter("promotion_refusals", "Published versions the gate refused.")
        self.canary_rollbacks = self._counter("canary_rollbacks", "Promoted versions rolled back because they "
                                              "scored below their predecessor on the same live records.")
        self.skipped = self._counter("learner_skipped_updates", "Updates skipped for a non-finite loss, and "
                                     "candidates not published for non-finite weights.")
        self.stale_records = self._counter("learner_stale_records",
                                           "Records used for distillation only: drafted by a stale version.")

    def update(self, loss: float, lag_versions: int, record_age_s: float) -> None:
        """One optimizer step."""
        self.updates.inc()
        self.loss.set(loss)
        self.lag.set(lag_versions)
        self.record_age.observe(record_age_s)

    def buffer(self, depth: int, pending: int) -> None:
        self.depth.set(depth)
        self.pending.set(pending)

    def published(self, version: str) -> None:
        self.versions_published.inc()

    def promotion(self, refused: bool) -> None:
        (self.refusals if refused else self.promotions).inc()

    def canary_rollback(self) -> None:
        self.canary_rollbacks.inc()

    def skipped_update(self) -> None:
        self.skipped.inc()

    def stale(self, n: int) -> None:
        if n:
            self.stale_records.inc(n)
