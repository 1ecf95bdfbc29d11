"""`specloop replay`: serve prompt files in order as one stream of traffic, with the learner running
alongside (asynchronous: a request never waits for the learner), on a local Ray instance.

Actors: the verifier worker (decodes, logs replay records, hot-swaps champions between steps),
the learner (unless --learner off), and for `--buffer memory` a host for the embedded buffer.
Results come back in request order as the replay contract's objects (`ServeResult`; printed as JSON).
"""
from __future__ import annotations

import logging
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from tqdm import tqdm

from specloop.drafter.decode.capacity import fits
from specloop.drafter.kinds.table import TRAINABLE_KINDS
from specloop.drafter.model.loading import load_tokenizer
from specloop.services.buffer.connect import check_spec
from specloop.services.buffer.types import BufferStats
from specloop.services.prompts import encode, load_prompts
from specloop.services.registry.meta import forget_namespace, redis_namespace
from specloop.trainer.objectives import ObjectiveConfig
from specloop.trainer.online import LearnerConfig

if TYPE_CHECKING:  # imported where the actors' results are unpickled, when a run starts
    from specloop.services.learner.learner import LearnerServiceStats
    from specloop.services.worker.worker import ServeResult, WorkerStats

log = logging.getLogger("specloop.replay")

LEARNERS = ("off", "kl", "klrl", "lk")


@dataclass
class ReplayConfig:
    verifier: Path
    drafter: Path | None
    kind: str
    prompts: list[Path]
    learner: str = "klrl"  # off | kl | klrl | lk
    buffer: str = "memory"  # memory | redis://HOST:PORT[/DB]
    max_tokens: int = 64
    k: int | None = 4  # None: auto (the controller chooses k step by step); 0: plain steps only (observed records)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    registry: Path | None = None  # default: a new temporary folder
    redis_prefix: str = "specloop"
    ray_address: str | None = None
    worker_threads: int = 1
    learner_threads: int = 1
    window: int = 32  # requests in the progress bar's τ
    learner_overrides: dict = field(default_factory=dict)  # LearnerConfig fields
    objective_overrides: dict = field(default_factory=dict)  # ObjectiveConfig fields
    worker_overrides: dict = field(default_factory=dict)  # WorkerConfig fields

    def __post_init__(self):
        if self.learner not in LEARNERS:
            raise ValueError(f"unknown learner {self.learner!r}; choose one of {', '.join(LEARNERS)}")
        if (self.k is not None and self.k < 0) or self.max_tokens < 1:
            raise ValueError("--k must be auto or >= 0 (0: the verifier alone; a learner then learns from the "
                             "observed records of its plain steps) and --max-tokens >= 1")
        if self.learner != "off" and self.kind not in TRAINABLE_KINDS:
            raise ValueError(f"the learner trains {', '.join(TRAINABLE_KINDS)} drafters, not {self.kind!r}")
        if not self.prompts:
            raise ValueError("give at least one prompt file")
        check_spec(self.buffer)  # here, not inside a Ray actor

    def learner_config(self) -> LearnerConfig:
        objective = ObjectiveConfig(name=self.learner, **self.objective_overrides)
        return LearnerConfig(kind=self.kind, objective=objective, seed=self.seed, **self.learner_overrides)


@dataclass(frozen=True)
class ReplaySummary:
    """What `Replay.finish()` collects."""

    registry: str  # the registry folder
    worker: WorkerStats
    learner: LearnerServiceStats | None = None  # None: --learner off
    buffer: BufferStats | None = None  # the embedded buffer's (--buffer memory, learner on)


@dataclass
class ReplayRequest:
    index: int
    id: str
    prompt_ids: list[int]


def load_traffic(cfg: ReplayConfig) -> list[ReplayRequest]:
    """Every prompt file in order, encoded with the verifier's tokenizer; a prompt that leaves no room
    for --max-tokens in the worker's context is skipped (and said once), as `serve` would refuse it,
    rather than failing the run when its turn comes."""
    from specloop.services.worker.worker import WorkerConfig

    tok = load_tokenizer(cfg.verifier)
    capacity = cfg.worker_overrides.get("max_context", WorkerConfig.max_context)
    out: list[ReplayRequest] = []
    skipped: list[str] = []
    for path in cfg.prompts:
        for rec in load_prompts(path):
            ids = encode(tok, rec)
            if fits(len(ids), cfg.max_tokens, cfg.k, capacity):
                out.append(ReplayRequest(len(out), rec.id, ids))
            else:
                skipped.append(rec.id)
    if skipped:
        log.warning("skipped %d prompt(s) that leave no room for %d new tokens in the %d-position context: %s%s",
                    len(skipped), cfg.max_tokens, capacity, ", ".join(skipped[:5]), " ..." if len(skipped) > 5 else "")
    return out


class Replay:
    """The actors of one replay run; `run()` yields results in request order."""

    def __init__(self, cfg: ReplayConfig):
        from specloop.services.actors import BufferHost, LearnerActor, WorkerActor, init_ray

        self.cfg = cfg
        self.traffic = load_traffic(cfg)  # fails fast on bad prompt files, before Ray starts
        self.started_ray = init_ray(cfg.ray_address)
        self.registry = str(cfg.registry or tempfile.mkdtemp(prefix="specloop-registry-"))
        learning = cfg.learner != "off"
        # the actor classes are @ray.remote ActorClasses, but mypy ignores class decorators (hence the ignores)
        self.host = BufferHost.remote(100_000) if learning and cfg.buffer == "memory" else None  # type: ignore[attr-defined]
        spec = cfg.buffer if learning else None
        redis_url = cfg.buffer if cfg.buffer.startswith("redis://") else None  # registry metadata beside the buffer
        # one namespace per registry folder: its versions, its replay stream (a reused --registry resumes both)
        self.namespace = registry_prefix = redis_namespace(self.registry, cfg.redis_prefix)
        self.learner = None
        if learning:
            lcfg = {"verifier": str(cfg.verifier), "drafter": _opt(cfg.drafter), "registry": self.registry,
                    "learner": cfg.learner_config().to_dict(), "threads": cfg.learner_threads,
                    "prefix": registry_prefix, "redis_url": redis_url}
            self.learner = LearnerActor.remote(lcfg, spec, self.host, registry_prefix)  # type: ignore[attr-defined]
            import ray

            ray.get(self.learner.start.remote())  # seeds the registry with the base version first
        wcfg = {"verifier": str(cfg.verifier), "drafter": _opt(cfg.drafter), "kind": cfg.kind,
                "registry": self.registry if learning else None, "threads": cfg.worker_threads,
                "prefix": registry_prefix, "log_records": learning, "redis_url": redis_url} | cfg.worker_overrides
        self.worker = WorkerActor.remote(wcfg, spec, self.host, registry_prefix)  # type: ignore[attr-defined]

    def requests(self) -> Iterator[dict]:
        c = self.cfg
        for r in self.traffic:
            yield {"stream_index": r.index, "id": r.id, "prompt_ids": r.prompt_ids, "max_tokens": c.max_tokens,
                   "k": c.k, "temperature": c.temperature, "top_k": c.top_k, "top_p": c.top_p, "seed": c.seed}

    def run(self, progress: bool = True) -> Iterator[ServeResult]:
        import ray

        recent: deque = deque(maxlen=self.cfg.window)
        bar = tqdm(total=len(self.traffic), desc="replay", unit="req", disable=not progress, file=sys.stderr)
        for request in self.requests():
            result = ray.get(self.worker.serve.remote(request))
            recent.append((result.blocks, result.accepted))
            blocks = sum(b for b, _ in recent)
            tau = (blocks + sum(a for _, a in recent)) / blocks if blocks else 0.0
            bar.set_postfix(tau=f"{tau:.2f}", version=result.drafter_version, refresh=False)
            bar.update(1)
            yield result
        bar.close()

    def finish(self) -> ReplaySummary:
        """Drain the logger, stop the learner, collect statistics, stop Ray if this run started it."""
        import ray

        worker = ray.get(self.worker.drain.remote())
        learner = None
        if self.learner is not None:
            time.sleep(0.2)
            learner = ray.get(self.learner.stop.remote())
        buffer = None if self.host is None else BufferStats(**ray.get(self.host.stats.remote()))
        summary = ReplaySummary(self.registry, worker, learner, buffer)
        ray.get(self.worker.close.remote())
        for actor in (self.worker, self.learner, self.host):
            if actor is not None:
                ray.kill(actor)
        if self.started_ray:
            ray.shutdown()
        if self.cfg.registry is None and self.cfg.buffer.startswith("redis://"):
            # a throwaway run: its temporary registry goes, so do its stream and metadata
            forget_namespace(self.cfg.buffer, self.namespace)
        return summary


def _opt(path) -> str | None:
    return None if path is None else str(path)


def summary_line(summary: ReplaySummary) -> str:
    w = summary.worker
    versions = w.acceptance_by_version
    drafted = sum(v.drafted for v in versions.values())
    accepted = sum(v.accepted for v in versions.values())
    line = f"served by {len(versions)} version(s), α={accepted / drafted if drafted else 0:.3f}, swaps={len(w.swaps)}"
    if summary.learner is not None:
        lrn = summary.learner
        promoted = sum(1 for p in lrn.published if p.promoted)
        rolled = sum(c.rolled_back for c in lrn.canaries)
        line += (f", learner updates={lrn.learner.updates} published={len(lrn.published)}"
                 f" promoted={promoted} canaries={len(lrn.canaries)} rolled back={rolled}"
                 f" champion={lrn.champion}")
    if w.records is not None:
        line += f", records logged={w.records.logged} (observed {w.records.observed}) dropped={w.records.dropped}"
    return line + f"; registry {summary.registry}"
