"""The learner service: reads replay records from the buffer, trains (`trainer.online`), publishes
versions to the registry and acknowledges what they used (run as a Ray actor by `specloop replay`).

Delivery: records are read through the buffer's consumer group. Their entry ids are acknowledged
only after a version trained on them is durable in the registry (published, weights on disk), so
a learner killed in between leaves them pending; a new learner first claims every pending entry
idle for `claim_idle_ms` (the dead consumer's) and starts from the newest published version.
Malformed payloads are acknowledged and counted, never retried or executed.

Publishing, every `publish_every` updates: the candidate's simulated acceptance and the current
champion's are measured on the same held-out records; the registry publishes the candidate and
promotes it through its gate (pinned, non-finite weights or lower acceptance: refused, logged).
A candidate with non-finite weights also resets the learner to the champion's weights.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from drafter.models import load_model
from services.buffer import ReplayBuffer
from services.registry import Registry
from trainer.online import LearnerConfig, OnlineLearner, is_finite, serving_student
from trainer.records import RecordError, decode

log = logging.getLogger("specloop.learner")


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
    updates_per_read: int = 1  # optimizer steps between two buffer reads
    extra: dict = field(default_factory=dict)


class LearnerService:
    def __init__(self, cfg: LearnerServiceConfig, buffer: ReplayBuffer):
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.learner.seed)
        self.cfg, self.buffer = cfg, buffer
        self.registry = Registry(cfg.registry, cfg.redis_url, cfg.prefix)
        verifier = load_model(cfg.verifier, dtype=torch.float32)
        verifier.hf.requires_grad_(False)
        student = serving_student(cfg.learner.kind, verifier, cfg.drafter, cfg.learner.train_lm)
        self.learner = OnlineLearner(cfg.learner, student)
        self.unacked: list[str] = []
        self.bad_records = 0
        self.published: list[dict] = []
        self.losses: list[float] = []
        self._champion: tuple[str, dict] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self._resume_or_seed()
        self._claim()

    # -- start-up

    def _resume_or_seed(self) -> None:
        """Resume from the newest published version, or publish the base weights as the first champion."""
        versions = self.registry.list()
        if versions:
            newest = versions[-1]
            self.learner.load_weights(self.registry.load_weights(newest.id))
            self.learner.published(self.registry.champion() or newest.id)
            log.info("learner resumes from %s", newest.id)
            return
        info = self.registry.publish(self.learner.weights(), parent=None, learner_step=0, objective="base",
                                     loss=None, sim_acceptance=None, kind=self.cfg.learner.kind)
        self.registry.promote(info.id, force=True)
        self.learner.published(info.id)

    def _claim(self) -> None:
        """Take over entries a dead learner read but never acknowledged."""
        claimed = self.buffer.claim_stale(self.cfg.consumer, self.cfg.claim_idle_ms, count=10_000)
        if claimed:
            log.info("claimed %d pending replay entries", len(claimed))
            self._ingest(claimed)

    # -- the loop

    def step(self) -> dict | None:
        """Read what arrived, take up to `updates_per_read` updates, publish when due."""
        block = 0 if self.learner.ready() else self.cfg.read_block_ms
        self._ingest(self.buffer.read(self.cfg.consumer, self.cfg.read_count, block_ms=block))
        info = None
        for _ in range(self.cfg.updates_per_read):
            info = self.learner.update()
            if info is None:
                break
            if "loss" in info:
                self.losses.append(info["loss"])
            if self.learner.should_publish():
                self.publish()
        return info

    def _ingest(self, entries) -> None:
        records = []
        for entry in entries:
            self.unacked.append(entry.id)
            try:
                records.append(decode(entry.payload))
            except RecordError as exc:
                self.bad_records += 1
                log.warning("dropped replay entry %s: %s", entry.id, exc)
        self.learner.ingest(records)

    def publish(self) -> dict:
        weights = self.learner.weights()
        champion = self.registry.champion()
        finite = is_finite(weights)
        candidate = self.learner.evaluate() if finite else float("nan")
        baseline = self.learner.evaluate(self._champion_weights(champion)) if champion else None
        recent = self.losses[-self.cfg.learner.publish_every:]
        info = self.registry.publish(
            weights, parent=champion, learner_step=self.learner.updates, objective=self.cfg.learner.objective.name,
            loss=sum(recent) / len(recent) if recent else None, sim_acceptance=candidate, kind=self.cfg.learner.kind,
            extra={"baseline": {"version": champion, "sim_acceptance": baseline}, "records_seen": self.learner.seen},
        )
        result = self.registry.promote(info.id)
        if result.promoted:
            self.learner.published(info.id)
        if not finite and champion:
            self.learner.load_weights(self._champion_weights(champion))
        self.buffer.ack(self.unacked)  # the version that used them is on disk
        self.unacked = []
        event = {"version": info.id, "promoted": result.promoted, "reason": result.reason,
                 "sim_acceptance": candidate, "baseline": baseline, "update": self.learner.updates,
                 "time": time.time()}
        self.published.append(event)
        return event

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

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        return self.stats()

    def stats(self) -> dict:
        return {"learner": self.learner.stats(), "published": list(self.published), "unacked": len(self.unacked),
                "bad_records": self.bad_records, "champion": self.registry.champion(), "error": self.error}
