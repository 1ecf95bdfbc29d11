"""The learner service: reads replay records from the buffer, trains (`specloop.trainer.online`), publishes
versions to the registry and acknowledges what they used (run as a Ray actor by `specloop replay`).

Delivery: records are read through the buffer's consumer group. An entry is acknowledged only once
a version that used it is durable in the registry (published, weights on disk): its record was in a
successful update, or was deliberately left out (held out for the gate, another drafter kind, let
go of by the learner's bounded pools, a malformed payload: counted, never retried or executed).
Entries still waiting for an update stay pending, so a learner killed in between leaves them to the
next: every learner claims the entries pending for `claim_idle_ms` (a dead consumer's) at start and
every `claim_every_s`, and starts from the champion.

Publishing, every `publish_every` updates: the candidate's simulated acceptance and the current
champion's are measured on the same held-out records; the registry publishes the candidate and
promotes it through its gate (pinned, non-finite weights or lower acceptance: refused, logged).
Non-finite losses are skipped (no step, no publish); a candidate whose weights are non-finite anyway
is never published: the learner resets to the champion's weights.

Metrics (`specloop.services.metrics.LearnerMetrics`, one registry per service; `serve_metrics()` exposes it
over HTTP): per update the loss, the lag in promoted versions of the newest record ingested and
its age (from its buffer entry id, "ms-seq"); stale records; the buffer's depth and pending
entries (read at most every `BUFFER_STATS_EVERY_S`); publishes, promotions and refusals.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specloop.drafter.model.loading import load_model
from specloop.services.buffer.types import ReplayBuffer
from specloop.services.event_log import EventLog
from specloop.services.learner.canary import Canary, CanaryConfig, CanaryVerdict
from specloop.services.metrics.export import serve_metrics
from specloop.services.metrics.learner import LearnerMetrics
from specloop.services.registry.registry import Registry
from specloop.services.registry.types import AliasState, RegistryError
from specloop.trainer.online import LearnerConfig, LearnerStats, OnlineLearner, Update, is_finite, serving_student
from specloop.trainer.records import RecordError, decode

log = logging.getLogger("specloop.learner")
BUFFER_STATS_EVERY_S = 1.0
ALIAS_EVERY_S = 1.0  # how often the learner reads the registry alias (to watch a new champion)
CANARY_EVENTS = 1000  # registry events a restarted learner reads for a promotion still to be judged


def pending_canary(alias, events: list[dict], cfg) -> Canary | None:
    """The canary a restarted learner owes: the champion's promotion (or pin) over a predecessor, when
    no canary verdict and no rollback has been logged for it since."""
    if alias.champion is None or not alias.history:
        return None
    for event in reversed(events):
        if event.get("version") == alias.champion and event.get("event") == "canary":
            return None
        if event.get("event") == "rollback" and event.get("previous") == alias.champion:
            return None
        if event.get("version") == alias.champion and event.get("event") in ("promote", "pin"):
            log.info("canary: %s was promoted and never judged; watching it against %s", alias.champion,
                     alias.history[-1])
            return Canary(alias.champion, alias.history[-1], cfg)
    return None


@dataclass
class LearnerServiceConfig:
    verifier: str
    drafter: str | None
    registry: str
    learner: LearnerConfig
    redis_url: str | None = None  # registry metadata in Redis
    prefix: str = "specloop"
    consumer: str = "learner-0"  # consumer name in the buffer's group
    threads: int = 1  # torch threads of the learner process
    read_count: int = 64  # entries per buffer read
    read_block_ms: int = 100  # wait for new entries when there is nothing to train on
    claim_idle_ms: int = 2000  # pending entries idle this long belong to a dead learner
    claim_every_s: float = 30.0  # how often such entries are claimed (besides at start)
    keep_versions: int = 32  # the registry keeps this many newest versions (+ champion, pin, rollback history)
    canary: CanaryConfig = field(default_factory=CanaryConfig)  # how a promoted version is judged on live traffic
    updates_per_read: int = 1  # optimizer steps between two buffer reads
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PublishEvent:
    """A candidate published (`LearnerService.publish`) and whether the registry's gate promoted it."""

    version: str
    promoted: bool
    reason: str | None  # the gate's reason (a refusal's)
    sim_acceptance: float | None  # the candidate's, on the held-out records
    baseline: float | None  # the champion's, on the same records
    update: int  # the learner's update count at publish
    time: float


@dataclass(frozen=True)
class LearnerServiceStats:
    learner: LearnerStats
    published: list[PublishEvent]  # the last ones
    unacked: int  # buffer entries read and not acknowledged yet
    canaries: list[CanaryVerdict]  # the canaries judged (the last ones)
    bad_records: int  # malformed payloads dropped
    champion: str | None
    error: str | None  # the last step's failure
    metrics_url: str | None
    pid: int  # the learner's process


class LearnerService:
    def __init__(self, cfg: LearnerServiceConfig, buffer: ReplayBuffer, metrics: LearnerMetrics | None = None):
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.learner.seed)
        self.cfg, self.buffer = cfg, buffer
        self.registry = Registry(cfg.registry, cfg.redis_url, cfg.prefix)
        verifier = load_model(cfg.verifier, dtype=torch.float32, keep_module=True)  # students read its module
        verifier.hf.requires_grad_(False)
        student = serving_student(cfg.learner.kind, verifier, cfg.drafter, cfg.learner.train_lm)
        self.learner = OnlineLearner(cfg.learner, student)
        self.unacked: list[str] = []
        self.bad_records = 0
        self.published: EventLog[PublishEvent] = EventLog(1024)
        self.canary: Canary | None = None  # the newly promoted version under watch (specloop.services.learner.canary)
        self.verdicts: EventLog[CanaryVerdict] = EventLog(1024)  # the canaries judged (the last ones)
        self._alias: AliasState | None = None  # the registry alias last read (`_watch_champion`)
        self._alias_read = float("-inf")
        self.losses: deque[float] = deque(maxlen=max(1, self.cfg.learner.publish_every))
        self._champion: tuple[str, dict] | None = None
        self._line: str | None = None  # the version the learner's weights descend from (`_now_serving`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.metrics = metrics if metrics is not None else LearnerMetrics()
        self.metrics_url: str | None = None
        self._served: dict[str, int] = {}  # promoted versions, in order (lag_versions)
        self._newest: tuple[str, float] | None = None  # (drafter version, append time) of the newest record
        self._stale_seen = 0
        self._claimed_at = time.monotonic()
        self._buffer_polled = float("-inf")
        self._resume_or_seed()
        self._claim()

    # -- start-up

    def _resume_or_seed(self) -> None:
        """Resume from the champion (never from a line the gate refused or a rollback left), else from
        the newest published version whose weights load, or publish the base weights as a new champion
        (none published yet, or every version unreadable: a registry folder deleted while Redis kept its
        records, a truncated file). A version that cannot be read is skipped, never fatal."""
        champion = self.registry.champion()
        newest_first = [v.id for v in reversed(self.registry.list())]
        for version in ([champion] if champion else []) + [v for v in newest_first if v != champion]:
            try:
                weights = self.registry.load_weights(version)
            except RegistryError as exc:
                log.warning("cannot resume from %s: %s", version, exc)
                continue
            self.learner.load_weights(weights)
            self._now_serving(champion or version)
            log.info("learner resumes from %s", version)
            return
        info = self.registry.publish(self.learner.weights(), parent=None, learner_step=0, objective="base",
                                     loss=None, sim_acceptance=None, kind=self.cfg.learner.kind)
        self.registry.promote(info.id, force=True)
        self._now_serving(info.id)

    def _claim(self) -> None:
        """Take over entries a dead learner read but never acknowledged."""
        self._claimed_at = time.monotonic()
        claimed = self.buffer.claim_stale(self.cfg.consumer, self.cfg.claim_idle_ms, count=10_000)
        mine = set(self.unacked)  # its own entries still waiting for an update come back too: not read twice
        claimed = [e for e in claimed if e.id not in mine]
        if claimed:
            log.info("claimed %d pending replay entries", len(claimed))
            self._ingest(claimed)

    # -- the loop

    def step(self) -> Update | None:
        """Read what arrived, take up to `updates_per_read` updates, publish when due; the last update."""
        if time.monotonic() - self._claimed_at >= self.cfg.claim_every_s:
            self._claim()
        block = 0 if self.learner.ready() else self.cfg.read_block_ms
        self._ingest(self.buffer.read(self.cfg.consumer, self.cfg.read_count, block_ms=block))
        info = None
        for _ in range(self.cfg.updates_per_read):
            info = self.learner.update()
            if info is None:
                break
            if not info.stepped:  # a non-finite loss: nothing changed, nothing to publish
                self.metrics.skipped_update()
                continue
            self.losses.append(info.loss)
            self._observe_update(info.loss)
            if self.learner.should_publish():
                self.publish()
        self._watch_champion()
        if self.canary is not None and self.canary.ready:
            self.judge_canary()
        self._observe_buffer()
        return info

    def _ingest(self, entries) -> None:
        records = []
        for entry in entries:
            self.unacked.append(entry.id)
            try:
                records.append(decode(entry.payload))
                records[-1].entry = entry.id
            except RecordError as exc:
                self.bad_records += 1
                log.warning("dropped replay entry %s: %s", entry.id, exc)
                continue
            self._newest = (records[-1].drafter_version, _appended_at(entry.id))
            if self.canary is not None:
                self.canary.offer(records[-1])
        self.learner.ingest(records)

    def publish(self) -> PublishEvent | None:
        weights = self.learner.weights()
        champion = self.registry.champion()
        if not is_finite(weights):
            log.warning("non-finite weights after update %d: not published; back to %s", self.learner.updates, champion)
            self.metrics.skipped_update()
            if champion:
                self.learner.load_weights(self._champion_weights(champion))
            return None
        candidate = self.learner.evaluate()
        baseline = self.learner.evaluate(self._champion_weights(champion)) if champion else None
        recent = list(self.losses)
        info = self.registry.publish(
            weights, parent=champion, learner_step=self.learner.updates, objective=self.cfg.learner.objective.name,
            loss=sum(recent) / len(recent) if recent else None, sim_acceptance=candidate, kind=self.cfg.learner.kind,
            extra={"baseline": {"version": champion, "sim_acceptance": baseline}, "records_seen": self.learner.seen},
        )
        result = self.registry.promote(info.id)
        self.metrics.published(info.id)
        self.metrics.promotion(refused=not result.promoted)
        if result.promoted:
            self._now_serving(info.id)
        self._ack_used()
        self._prune()

        event = PublishEvent(version=info.id, promoted=result.promoted, reason=result.reason,
                             sim_acceptance=candidate, baseline=baseline, update=self.learner.updates,
                             time=time.time())
        self.published.append(event)
        return event

    def _now_serving(self, version: str) -> None:
        """A version with the learner's current weights was promoted: its records are on-policy, and the
        learner's next candidates descend from it."""
        self.learner.published(version)
        self._served.setdefault(version, len(self._served))
        self._line = version

    def _adopt(self, champion: str) -> None:
        """The champion is a version this learner's weights do not descend from (an operator's pin or
        rollback, another learner's promotion): continue from its weights."""
        try:
            self.learner.load_weights(self._champion_weights(champion))
        except RegistryError as exc:
            log.warning("cannot continue from the champion %s: %s", champion, exc)
            return
        self._now_serving(champion)
        log.info("the champion is %s, which this learner did not train: it continues from it", champion)

    # -- metrics

    def _watch_champion(self) -> None:
        """Start a canary whenever a version is promoted over another (by this learner or by an operator);
        a rollback (the champion returns to the last of the history) starts none."""
        if time.monotonic() - self._alias_read < ALIAS_EVERY_S:
            return
        self._alias_read = time.monotonic()
        try:
            alias = self.registry.alias()
        except Exception as exc:  # noqa: BLE001 - a registry that cannot be read now never stops training
            log.debug("registry alias unavailable: %s", exc)
            return
        before, self._alias = self._alias, alias
        if alias.champion is not None and alias.champion != self._line:
            self._adopt(alias.champion)
        if before is None:  # (re)started: a promotion no canary has judged yet is judged now
            self.canary = pending_canary(alias, self.registry.events(CANARY_EVENTS), self.cfg.canary)
            return
        if alias.champion == before.champion or alias.champion is None:
            return
        rolled_back = bool(before.history) and alias.champion == before.history[-1]
        if (self.canary is None or self.canary.version != alias.champion) and not rolled_back and alias.history:
            self.canary = Canary(alias.champion, alias.history[-1], self.cfg.canary)
            log.info("canary: watching %s against %s on live traffic", alias.champion, alias.history[-1])
        elif rolled_back:
            self.canary = None

    def judge_canary(self) -> CanaryVerdict:
        """Score the watched version and its predecessor on the live records it drafted; roll back from
        it when it fell too far (the learner then restarts from the champion rolled back to)."""
        canary, self.canary = self.canary, None
        assert canary is not None  # judged only while one is watched (and ready)
        new = self.learner.acceptance_by_record(canary.records, self.registry.load_weights(canary.version))
        old = self.learner.acceptance_by_record(canary.records, self._champion_weights(canary.predecessor))
        reason = canary.verdict(new, old)
        judged, rolled_back = time.time(), False
        if reason is not None:
            try:
                back = self.registry.rollback(reason, expected=canary.version)
            except RegistryError as exc:  # pinned, or the champion moved on meanwhile
                log.warning("canary rollback refused: %s", exc)
            else:
                rolled_back = True
                self.metrics.canary_rollback()
                self.learner.load_weights(self._champion_weights(back))
                self._now_serving(back)
                log.warning("rolled back to %s: %s", back, reason)
        mean = lambda per_record: sum(map(sum, per_record)) / max(1, sum(map(len, per_record)))  # noqa: E731
        verdict = CanaryVerdict(version=canary.version, predecessor=canary.predecessor, sim_acceptance=mean(new),
                                predecessor_sim_acceptance=mean(old), records=len(canary.records),
                                rolled_back=rolled_back, reason=reason, time=judged)
        self.verdicts.append(verdict)
        self.registry.note("canary", canary.version, reason or "kept: acceptance held against the predecessor",
                           predecessor=canary.predecessor, rolled_back=rolled_back)
        return verdict

    def _prune(self) -> None:
        try:
            deleted = self.registry.prune(self.cfg.keep_versions)
        except Exception as exc:  # noqa: BLE001 - retention never stops learning
            log.warning("could not prune the registry: %s", exc)
            return
        if deleted:
            log.info("pruned %d old versions (%s ... %s)", len(deleted), deleted[0], deleted[-1])

    def _ack_used(self) -> None:
        """Acknowledge what the version now on disk used or deliberately left out (module docstring)."""
        waiting = self.learner.in_pools() - self.learner.trained
        done = [e for e in self.unacked if e not in waiting]
        self.buffer.ack(done)
        self.unacked = [e for e in self.unacked if e in waiting]
        self.learner.trained.clear()

    def _observe_update(self, loss: float) -> None:
        """Loss, lag and record age of one update, and the records it skipped as stale."""
        version, appended = self._newest or (None, time.time())
        newest = len(self._served) - 1
        # a version never promoted here (or none yet) counts as older than all
        lag = newest - (-1 if version is None else self._served.get(version, -1))
        self.metrics.update(loss, lag, max(0.0, time.time() - appended))
        self.metrics.stale(self.learner.stale_skipped - self._stale_seen)
        self._stale_seen = self.learner.stale_skipped

    def _observe_buffer(self) -> None:
        now = time.monotonic()
        if now - self._buffer_polled < BUFFER_STATS_EVERY_S:
            return
        self._buffer_polled = now
        try:
            stats = self.buffer.stats()
        except Exception as exc:  # a buffer that cannot answer now never stops training
            log.debug("buffer stats unavailable: %s", exc)
            return
        self.metrics.buffer(stats.depth, stats.pending)

    def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve the learner's metrics over HTTP (once); "host:port" for Prometheus to scrape."""
        if self.metrics_url is None:
            self.metrics_url = serve_metrics(self.metrics, host, port)
        return self.metrics_url

    def _champion_weights(self, champion: str) -> dict:
        if self._champion is None or self._champion[0] != champion:
            self._champion = (champion, self.registry.load_weights(champion))
        return self._champion[1]

    # -- thread control (the Ray actor calls these)


    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="learner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.step() is None and not self.learner.ready():
                    time.sleep(0.01)
            except Exception as exc:  # keep the last error for stats(); retry after a pause
                self.error = f"{type(exc).__name__}: {exc}"
                log.exception("learner step failed")
                time.sleep(0.5)

    def stop(self) -> LearnerServiceStats:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        return self.stats()

    def stats(self) -> LearnerServiceStats:
        return LearnerServiceStats(learner=self.learner.stats(), published=list(self.published),
                                   unacked=len(self.unacked), canaries=list(self.verdicts),
                                   bad_records=self.bad_records, champion=self.registry.champion(), error=self.error,
                                   metrics_url=self.metrics_url, pid=os.getpid())


def _appended_at(entry_id: str) -> float:
    """The time a buffer entry was appended, from its id "ms-seq" (now when the id is not one)."""
    try:
        return int(entry_id.split("-", 1)[0]) / 1000
    except ValueError:
        return time.time()
