"""Ray actors around the worker, the learner and the embedded replay buffer.

What crosses an actor boundary is JSON-shaped (config dicts, the serving protocol's dicts), bytes
(encoded replay records) or the services' own frozen dataclasses (a served request, worker and learner
statistics); the classes behind the actors are plain Python, tested without Ray. Each actor
asks for a fraction of a CPU (Ray sees 2 on this machine) and sets its own torch thread count.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray

from specloop.services.buffer.connect import open_buffer
from specloop.services.buffer.memory import MemoryBuffer
from specloop.services.buffer.types import BufferEntry, BufferStats, ReplayBuffer

if TYPE_CHECKING:  # the actors import these modules in the processes that run them
    from specloop.services.learner.learner import LearnerServiceStats
    from specloop.services.worker.worker import ServeResult, WorkerStats

ACTOR_CPUS = 0.5  # the worker and the learner fit beside the driver on 2 CPUs
ACTOR_RESTARTS = 8  # Ray restarts a dead worker or learner this many times (each restart reloads it)


NAMESPACE = "specloop"  # Ray namespace of the serving actors (named, so API processes find them)
WORKER_PREFIX = "specloop-worker-"
LEARNER_NAME = "specloop-learner"
BUFFER_NAME = "specloop-buffer"
LEASE_NAME = "specloop-serve-lease"
LEASE_S = 10.0  # a `serve` that has not renewed its lease this long is gone: another may adopt its actors


def init_ray(address: str | None = None, namespace: str | None = None) -> bool:
    """Join `address` or start a local instance; True when this call started it."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    extra: dict[str, Any] = {} if address else {"include_dashboard": False}
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=True,
             namespace=namespace, **extra)
    return True


def named_actors(prefix: str) -> list[str]:
    """Names of the named actors in NAMESPACE that start with `prefix`, sorted (a blocking Ray call)."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(prefix))


def named_actor(name: str):
    """The named actor of NAMESPACE, or None when there is none (it never was, or died)."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


@ray.remote(num_cpus=0)
class ServeLease:
    """Which `specloop serve` process runs the (detached) serving actors: it renews the lease every
    LEASE_S / 4; a lease older than LEASE_S means that process is gone (its actors live on)."""

    def __init__(self):
        self.owner, self.renewed = None, 0.0

    def renew(self, owner: str) -> None:
        self.owner, self.renewed = owner, time.monotonic()

    def held(self) -> tuple[str | None, float]:
        """(owner, seconds since its last renewal); both measured on this actor's clock."""
        return self.owner, time.monotonic() - self.renewed


@ray.remote(num_cpus=0)
class BufferHost:
    """The embedded (in-memory) replay buffer, hosted in its own actor so that the worker and the
    learner, two processes, share it."""

    def __init__(self, maxlen: int):
        self.buffer = MemoryBuffer(maxlen)

    def append(self, payload: bytes) -> bool:
        return self.buffer.append(payload)

    def read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, bytes]]:
        return [(e.id, e.payload) for e in self.buffer.read(consumer, count, block_ms)]

    def ack(self, ids: list[str]) -> int:
        return self.buffer.ack(ids)

    def claim_stale(self, consumer: str, min_idle_ms: int, count: int) -> list[tuple[str, bytes]]:
        return [(e.id, e.payload) for e in self.buffer.claim_stale(consumer, min_idle_ms, count)]

    def stats(self) -> dict:
        return self.buffer.stats().to_dict()


class HostedBuffer:
    """`ReplayBuffer` over a BufferHost actor: appends are fire-and-forget remote calls."""

    def __init__(self, handle):
        self.handle = handle
        self.written = 0

    def append(self, payload: bytes) -> bool:
        self.handle.append.remote(payload)
        self.written += 1
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        ray.get(self.handle.stats.remote(), timeout=timeout)  # calls from one caller run in order
        return True

    def read(self, consumer: str, count: int, block_ms: int = 0) -> list[BufferEntry]:
        return [BufferEntry(i, p) for i, p in ray.get(self.handle.read.remote(consumer, count, block_ms))]

    def ack(self, ids: list[str]) -> int:
        return ray.get(self.handle.ack.remote(list(ids))) if ids else 0

    def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[BufferEntry]:
        return [BufferEntry(i, p) for i, p in ray.get(self.handle.claim_stale.remote(consumer, min_idle_ms, count))]

    def stats(self) -> BufferStats:
        return BufferStats(**ray.get(self.handle.stats.remote()))

    def cached_stats(self) -> BufferStats:
        return self.stats()  # the host is a process of specloop's own (memory), never Redis

    def close(self) -> None:
        pass


def make_buffer(spec: str | None, host=None, prefix: str = "specloop") -> ReplayBuffer | None:
    """The buffer an actor writes to / reads from: a hosted memory buffer, or its own Redis client."""
    if spec is None:
        return None
    if spec == "memory":
        if host is None:
            raise ValueError("the memory buffer needs a BufferHost actor across processes")
        return HostedBuffer(host)
    return open_buffer(spec, prefix=prefix)


@ray.remote(num_cpus=ACTOR_CPUS)
class WorkerActor:
    def __init__(self, cfg: dict, buffer_spec: str | None, host=None, prefix: str = "specloop"):
        from specloop.services.worker.worker import VerifierWorker, WorkerConfig

        self.buffer = make_buffer(buffer_spec, host, prefix)
        self.worker = VerifierWorker(WorkerConfig(**cfg), self.buffer)

    def serve(self, request: dict) -> ServeResult:
        from specloop.services.protocol import CompletionRequest

        return self.worker.serve(CompletionRequest.from_dict(request))

    def stats(self) -> WorkerStats:
        return self.worker.stats()

    def drain(self) -> WorkerStats:
        self.worker.drain()
        if self.buffer is not None:
            self.buffer.flush()
        return self.worker.stats()

    def close(self) -> WorkerStats:
        self.worker.close()
        if self.buffer is not None:
            self.buffer.close()
        return self.worker.stats()


@ray.remote(num_cpus=ACTOR_CPUS, max_restarts=ACTOR_RESTARTS)
class ServingActor:
    """A verifier worker serving a continuous batch: `stream` is an async generator of chunk dicts
    (a Ray streaming call); cancelling it (the client left) frees the request's slot. Its metrics are
    served on their own port (`info()["metrics_url"]`), listed by the API for Prometheus."""

    def __init__(self, cfg: dict, buffer_spec: str | None, host=None, prefix: str = "specloop",
                 name: str = "worker-0", model: str = "specloop", max_queue: int = 64):
        from specloop.services.metrics.export import serve_metrics
        from specloop.services.metrics.serving import attach_metrics
        from specloop.services.metrics.worker import WorkerMetrics
        from specloop.services.worker.serving_loop import ServingConfig, ServingLoop
        from specloop.services.worker.worker import VerifierWorker, WorkerConfig

        self.buffer_spec = buffer_spec
        self.buffer = make_buffer(buffer_spec, host, prefix)
        wcfg = WorkerConfig(**cfg)
        self.loop = ServingLoop(ServingConfig(wcfg, max_queue, model, name), VerifierWorker(wcfg, self.buffer))
        self.metrics = WorkerMetrics(worker=name, model_name=model, slots=wcfg.slots)
        attach_metrics(self.loop, self.metrics)
        self.metrics_url = serve_metrics(self.metrics, host=ray.util.get_node_ip_address())
        self.loop.start()

    async def stream(self, request: dict):
        from specloop.services.protocol import CompletionRequest

        async for chunk in self.loop.stream(CompletionRequest.from_dict(request)):
            yield chunk.to_dict()

    async def info(self) -> dict:
        return self.loop.info(self.metrics_url, self.buffer_spec).to_dict()

    async def load(self) -> dict:
        return self.loop.load().to_dict()

    async def ready(self) -> bool:
        if self.loop.failure is not None:
            raise RuntimeError(self.loop.failure)
        return self.loop.ready

    async def buffer_stats(self) -> dict | None:
        from dataclasses import asdict

        return None if self.buffer is None else asdict(self.buffer.cached_stats())

    async def stats(self) -> WorkerStats:
        return replace(self.loop.worker.stats(), steps=self.loop.steps)

    async def close(self) -> WorkerStats:
        self.loop.stop()
        self.loop.worker.drain()
        self.loop.worker.close()
        if self.buffer is not None:
            self.buffer.close()
        return self.loop.worker.stats()


# ray's stubs leave the actor-only max_concurrency out of remote()'s keyword overload
@ray.remote(num_cpus=ACTOR_CPUS, max_concurrency=4, max_restarts=ACTOR_RESTARTS)  # type: ignore[call-overload]
class LearnerActor:
    """The learner trains on its own thread; stats/stop calls run beside it (max_concurrency)."""

    def __init__(self, cfg: dict, buffer_spec: str, host=None, prefix: str = "specloop"):
        from specloop.services.learner.learner import LearnerService, LearnerServiceConfig
        from specloop.trainer.online import LearnerConfig

        self.buffer = make_buffer(buffer_spec, host, prefix)
        assert self.buffer is not None  # buffer_spec is a spec, not None: make_buffer opened one
        cfg = cfg | {"learner": LearnerConfig.from_dict(cfg["learner"])}
        self.service = LearnerService(LearnerServiceConfig(**cfg), self.buffer)
        if ray.get_runtime_context().was_current_actor_reconstructed:
            # restarted by Ray after its process died: it resumed from the champion and claims the dead
            # one's pending entries; carry on training (the first start() came from serve / replay)
            self.service.start()

    def start(self) -> bool:
        self.service.start()
        return True

    def metrics_url(self) -> str:
        return self.service.serve_metrics(host=ray.util.get_node_ip_address())

    def stats(self) -> LearnerServiceStats:
        return self.service.stats()

    def stop(self) -> LearnerServiceStats:
        return self.service.stop()
