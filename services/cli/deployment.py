"""`specloop serve` and `specloop api`: the serving system on Ray.

serve: starts a local Ray instance (or joins `--ray-address`), the verifier worker actors (named
`specloop-worker-<i>` in the Ray namespace "specloop", each asking for a GPU when the cluster has
one), the learner actor (unless `--learner off`), the registry, and the HTTP API in this process.
api: an extra API process that attaches to the workers of a running cluster (what sits behind the
load balancer). Both drain on SIGTERM / SIGINT (services/api/drain.py: not ready at once, requests in
flight finish within `drain_timeout`), then stop; serve also stops the actors it started.

Embedded defaults: Redis from `SPECLOOP_REDIS_URL`, else 127.0.0.1:6379 when it answers, else the
embedded buffer (said once in the log); models from the flags or the bootstrap cache; the registry
in `--registry` or the cache folder.
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specloop.services.registry.meta import redis_namespace

log = logging.getLogger("specloop.serve")
LOCAL_REDIS = "redis://127.0.0.1:6379"


@dataclass
class ServeConfig:
    verifier: Path
    drafter: Path | None
    kind: str = "pretrained"
    speculators: tuple[str, ...] = ()  # beside the drafter, chosen per step and row (specloop.drafter.kinds.mix)
    host: str = "127.0.0.1"
    port: int = 8000
    learner: str = "klrl"  # off | kl | klrl | lk
    ray_address: str | None = None
    workers: int = 1
    slots: int = 8  # continuous-batch slots per worker
    max_queue: int = 64  # waiting requests per worker before 503
    max_context: int = 1024
    registry: Path | None = None
    cache: Path = Path.home() / ".cache" / "specloop"  # the default registry lives under cache/registry
    redis_url: str | None = None  # None: detect (SPECLOOP_REDIS_URL, then the local Redis, else embedded)
    admin_token: str | None = None
    api_key: str | None = None  # when set, /v1 asks for `Authorization: Bearer KEY` (401 without it)
    drain_timeout: float = 30.0  # seconds in-flight requests may take to finish after SIGTERM
    docs: bool = False  # serve /docs and /openapi.json
    worker_threads: int = 1
    learner_threads: int = 1
    worker_resources: dict = field(default_factory=dict)  # Ray custom resources each worker asks for
    model_id: str | None = None  # --served-model-name; default: `served_name`
    weights: str = "auto"  # the verifier's weight mode (drafter.model.weights.quant; auto = as stored / its manifest)
    drafter_weights: str = "auto"
    chat_template: str | None = None  # --chat-template's text (None: the tokenizer's own template)
    prefix_caching: bool = True  # --enable-prefix-caching (the workers' WorkerConfig.prefix_caching)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype (the workers' WorkerConfig.kv_cache_dtype)
    enforce_eager: bool = False  # --enforce-eager (the workers' WorkerConfig.enforce_eager)
    observe_every: int = 8  # --observe-every (the workers' WorkerConfig.observe_every: records of steps left plain)
    uvicorn_log_level: str = "warning"  # --uvicorn-log-level


def detect_redis() -> str | None:
    """SPECLOOP_REDIS_URL, else the local Redis when it answers, else None (embedded buffer)."""
    url = os.environ.get("SPECLOOP_REDIS_URL")
    if url:
        return url
    import redis

    client = redis.Redis.from_url(LOCAL_REDIS, socket_connect_timeout=0.5)
    try:
        client.ping()
        return LOCAL_REDIS
    except redis.RedisError:
        return None
    finally:
        client.close()


def default_registry(root: Path, verifier: Path, drafter: Path | None, kind: str) -> Path:
    """One registry folder per (verifier, drafter, kind) under `root`: versions trained from one
    drafter never serve another."""
    key = "|".join([str(Path(verifier).resolve()), str(Path(drafter).resolve()) if drafter else "-", kind])
    return Path(root) / hashlib.sha1(key.encode()).hexdigest()[:12]


CHAMPION_WAIT_S = 300.0  # a worker started beside the learner waits this long at most for the champion it seeds


def worker_fields(cfg: ServeConfig, registry: Path | None, prefix: str, redis_url: str | None) -> dict:
    """The WorkerConfig fields (specloop.services.worker.worker) a serve deployment's worker actors are started
    with, as plain values for Ray; `registry`: the learner's (None: no learner, no replay records)."""
    return {"verifier": str(cfg.verifier), "drafter": _opt(cfg.drafter), "kind": cfg.kind,
            "registry": _opt(registry), "threads": cfg.worker_threads, "prefix": prefix,
            "log_records": registry is not None, "redis_url": redis_url, "slots": cfg.slots,
            "max_context": cfg.max_context, "weights": cfg.weights, "drafter_weights": cfg.drafter_weights,
            "speculators": list(cfg.speculators), "prefix_caching": cfg.prefix_caching,
            "kv_cache_dtype": cfg.kv_cache_dtype, "enforce_eager": cfg.enforce_eager,
            "observe_every": cfg.observe_every, "champion_wait_s": CHAMPION_WAIT_S}


class Deployment:
    """The actors `serve` runs; `stop()` ends them (and Ray, when this process started it).

    The actors are detached: they outlive this process, so a `serve` that dies (SIGKILL, a lost node)
    leaves the workers serving the other API replicas. It holds a lease (`ServeLease`) it renews every
    few seconds; a new `serve` on the same cluster waits out a lease that is no longer renewed and
    adopts the workers, learner and buffer it finds instead of starting more (one that is still
    renewed means another serve runs: refused)."""

    def __init__(self, cfg: ServeConfig):
        import ray

        from specloop.services.actors import NAMESPACE, WORKER_PREFIX, init_ray, named_actors

        self.cfg = cfg
        self.started_ray = init_ray(cfg.ray_address, NAMESPACE)
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.lease = self._take_lease(ray)
        self._renewing = threading.Event()
        threading.Thread(target=self._renew, name="specloop-lease", daemon=True).start()
        redis_url = cfg.redis_url if cfg.redis_url is not None else detect_redis()
        if redis_url is None:
            log.warning("no Redis answers (SPECLOOP_REDIS_URL unset, nothing on 127.0.0.1:6379): "
                        "using the embedded buffer")
        self.registry = Path(cfg.registry or default_registry(Path(cfg.cache) / "registry",
                                                              cfg.verifier, cfg.drafter, cfg.kind)).resolve()
        self.registry.mkdir(parents=True, exist_ok=True)
        running = named_actors(WORKER_PREFIX)
        # Ray actor handles, typed Any: ray types an ActorHandle's methods Never
        self.workers: list[Any] = []
        self.learner: Any = None
        self.host: Any = None
        try:
            if running:
                self._adopt(ray, running)
            else:
                self._start(ray, redis_url)
            ray.get([w.info.remote() for w in self.workers])  # constructed (models loaded)
        except BaseException:
            self._renewing.set()
            for actor in ([] if running else [*self.workers, self.learner, self.host]) + [self.lease]:
                if actor is not None:
                    ray.kill(actor)  # detached: nothing else would end them
            raise

    def _take_lease(self, ray):
        from specloop.services.actors import LEASE_NAME, LEASE_S, NAMESPACE, ServeLease

        lease = ServeLease.options(name=LEASE_NAME, namespace=NAMESPACE, lifetime="detached",
                                   get_if_exists=True).remote()
        deadline = time.monotonic() + LEASE_S + 1.0
        owner, age = ray.get(lease.held.remote())
        while owner is not None and age < LEASE_S and time.monotonic() < deadline:  # gone, or alive?
            time.sleep(0.5)
            owner, age = ray.get(lease.held.remote())
        if owner is not None and age < LEASE_S:
            raise RuntimeError(f"this Ray cluster is served by another `specloop serve` ({owner}): attach with "
                               "`specloop api` instead")
        ray.get(lease.renew.remote(self.owner))
        return lease

    def _renew(self) -> None:
        from specloop.services.actors import LEASE_S

        while not self._renewing.wait(LEASE_S / 4):
            try:
                self.lease.renew.remote(self.owner)
            except Exception as exc:  # noqa: BLE001 - Ray going away: stop() follows
                log.debug("lease renewal failed: %s", exc)

    def _adopt(self, ray, names: list[str]) -> None:
        from specloop.services.actors import BUFFER_NAME, LEARNER_NAME, NAMESPACE, named_actor

        self.workers = [ray.get_actor(n, namespace=NAMESPACE) for n in names]
        self.learner, self.host = named_actor(LEARNER_NAME), named_actor(BUFFER_NAME)
        log.warning("adopted %d worker(s)%s a previous `specloop serve` left running (their own configuration "
                    "holds; stop them with this serve to start others)", len(self.workers),
                    " and the learner" if self.learner is not None else "")

    def _start(self, ray, redis_url: str | None) -> None:
        from specloop.services.actors import (
            BUFFER_NAME,
            LEARNER_NAME,
            WORKER_PREFIX,
            BufferHost,
            LearnerActor,
            ServingActor,
        )

        cfg = self.cfg
        learning = cfg.learner != "off"
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        model = served_name(cfg)
        log.warning("starting %d worker(s) serving %s%s%s; the API answers once the model is loaded%s", cfg.workers,
                    model, f" (KV cache {cfg.kv_cache_dtype})" if cfg.kv_cache_dtype != "auto" else "",
                    ", and the learner" if learning else "",
                    " and the GPU decode steps are compiled (longest on a first start: later starts reuse "
                    "torch.compile's cache)" if gpus and not cfg.enforce_eager else "")
        prefix = redis_namespace(self.registry)
        spec = (redis_url or "memory") if learning else None
        detached = {"lifetime": "detached"}
        # the actor classes are @ray.remote ActorClasses, but mypy ignores class decorators (hence the ignores)
        self.host = (BufferHost.options(name=BUFFER_NAME, **detached).remote(100_000)  # type: ignore[attr-defined]
                     if learning and redis_url is None else None)
        self.learner = None
        if learning:
            from specloop.trainer.objectives import ObjectiveConfig
            from specloop.trainer.online import LearnerConfig

            lcfg = LearnerConfig(kind=cfg.kind, objective=ObjectiveConfig(name=cfg.learner))
            self.learner = LearnerActor.options(name=LEARNER_NAME, **detached).remote(  # type: ignore[attr-defined]
                {"verifier": str(cfg.verifier), "drafter": _opt(cfg.drafter), "registry": str(self.registry),
                 "learner": lcfg.to_dict(), "threads": cfg.learner_threads, "prefix": prefix, "redis_url": redis_url},
                spec, self.host, prefix)
        self.workers = []
        wcfg = worker_fields(cfg, self.registry if learning else None, prefix, redis_url)
        for i in range(cfg.workers):  # loading beside the learner: they wait for the champion it seeds
            actor = ServingActor.options(name=f"{WORKER_PREFIX}{i}", num_gpus=gpus,  # type: ignore[attr-defined]
                                         resources=cfg.worker_resources or None, **detached)
            self.workers.append(actor.remote(wcfg, spec, self.host, prefix, f"worker-{i}", model, cfg.max_queue))
        if self.learner is not None:
            ray.get(self.learner.start.remote())  # constructed: the registry holds its champion (the base version)

    def wait_ready(self, timeout: float = 120.0) -> None:
        import ray

        deadline = time.monotonic() + timeout
        while not all(ray.get([w.ready.remote() for w in self.workers])):
            if time.monotonic() > deadline:
                raise TimeoutError("workers not ready after a warm-up forward pass")
            time.sleep(0.05)

    def stop(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - stopping goes on
                log.warning("worker close: %s", exc)
        if self.learner is not None:
            try:
                ray.get(self.learner.stop.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001
                log.warning("learner stop: %s", exc)
        self._renewing.set()
        for actor in [*self.workers, self.learner, self.host, self.lease]:
            if actor is not None:
                ray.kill(actor)
        if self.started_ray:
            ray.shutdown()


def _opt(path) -> str | None:
    return None if path is None else str(path)


def build_app(admin_token: str | None, api_key: str | None = None, docs: bool = False,
              chat_template: str | None = None):
    """The API over the cluster's workers (this process must have joined Ray); `api_key`: asked of
    every /v1 request (services/api/auth.py); `docs`: serve /docs and /openapi.json; `chat_template`:
    the Jinja template of chat requests (None: the tokenizer's own). The served model and its weight
    mode are logged."""
    import asyncio

    from specloop.drafter.model.loading import load_tokenizer
    from specloop.services.api.admin import make_admin_router
    from specloop.services.api.app import create_app
    from specloop.services.cluster import RayBackend
    from specloop.services.metrics.api import ApiMetrics

    backend = RayBackend()
    workers = asyncio.run(backend.workers())
    if not workers:
        raise RuntimeError("no specloop worker in this Ray cluster: start one with `specloop serve`")
    info = workers[0]
    tokenizer = load_tokenizer(info.verifier)
    log.warning("model %s, weights %s, drafter %s %s", info.model, info.weights, info.drafter_kind,
                info.drafter_version)
    return create_app(backend, tokenizer, info.model, info.max_context, make_admin_router(backend, admin_token),
                      ApiMetrics(model_name=info.model), api_key=api_key, docs=docs, chat_template=chat_template)


def served_name(cfg: ServeConfig) -> str:
    """The model id clients name: --served-model-name; else, for the fetched pair (its folder holds
    `fetched.json`, the verifier sits in `verifier/`), the pair's name (`smollm2-135m-instruct`); else the verifier
    folder's name."""
    from specloop.trainer.fetch import DONE_FILE  # torch: imported where a name is needed, after the CLI's checks

    if cfg.model_id:
        return cfg.model_id
    folder = Path(cfg.verifier)
    return folder.parent.name if (folder.parent / DONE_FILE).is_file() else folder.name


def run_serve(cfg: ServeConfig) -> int:
    deployment = Deployment(cfg)
    try:
        deployment.wait_ready()
        app = build_app(cfg.admin_token, cfg.api_key, cfg.docs, cfg.chat_template)
        log.warning("specloop serving %s on http://%s:%d (%d worker(s), learner %s, registry %s)",
                    served_name(cfg), cfg.host, cfg.port, cfg.workers, cfg.learner,
                    deployment.registry)
        serve_until_stopped(app, cfg.host, cfg.port, cfg.drain_timeout, cfg.uvicorn_log_level)
    finally:
        deployment.stop()
    return 0


def serve_until_stopped(app, host: str, port: int, drain_timeout: float = 30.0, log_level: str = "warning") -> None:
    """The API until SIGTERM / SIGINT, then its drain (services/api/drain.py: /ready 503 at once, new
    requests 503, those in flight finish within `drain_timeout` s); returns once uvicorn has shut down.
    `log_level`: uvicorn's (--uvicorn-log-level)."""
    from specloop.services.api.app import run_api

    try:
        run_api(app, host, port, drain_timeout, log_level)
    except KeyboardInterrupt:  # a signal that came before uvicorn took the handlers over
        pass
    log.warning("specloop stopping")


def run_api_process(ray_address: str | None, host: str, port: int, admin_token: str | None,
                    api_key: str | None = None, drain_timeout: float = 30.0, docs: bool = False,
                    chat_template: str | None = None, uvicorn_log_level: str = "warning") -> int:
    """`specloop api`: attach to a running cluster's workers and serve the API."""
    import ray

    from specloop.services.actors import NAMESPACE, init_ray

    init_ray(ray_address or "auto", NAMESPACE)
    try:
        serve_until_stopped(build_app(admin_token, api_key, docs, chat_template), host, port, drain_timeout,
                            uvicorn_log_level)
    finally:
        ray.shutdown()
    return 0
