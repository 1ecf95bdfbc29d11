"""Shared by test_admin.py and test_operator.py: a real registry with published versions, a
backend that answers only what the admin router reads (live workers, buffer stats) from real
data, an app with just the admin router, and a real uvicorn server for it in a thread."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import uvicorn
from fastapi import FastAPI

from specloop.services.api.admin import make_admin_router
from specloop.services.buffer.memory import MemoryBuffer
from specloop.services.protocol import WorkerInfo
from specloop.services.registry.registry import Registry
from specloop.services.registry.types import VersionInfo
from tests.redis_helpers import free_port

TOKEN = "s3cret-admin-token"


def publish(reg: Registry, sim: float | None, seed: int = 0, parent: str | None = None) -> VersionInfo:
    weights = {"head.weight": torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))}
    return reg.publish(weights, parent=parent, learner_step=seed * 10, objective="kl", loss=0.25 + seed,
                       sim_acceptance=sim, kind="pretrained")


def seeded_registry(root: Path) -> Registry:
    """v0001 (first champion) → v0002 (champion, parent v0001); v0003 published, never promoted."""
    reg = Registry(root)
    first = publish(reg, 0.5, seed=1)
    reg.promote(first.id)
    second = publish(reg, 0.6, seed=2, parent=first.id)
    reg.promote(second.id)
    publish(reg, 0.4, seed=3, parent=second.id)
    return reg


def worker_info(name: str, registry: Path | None, version: str) -> WorkerInfo:
    return WorkerInfo(name=name, verifier="/models/verifier", model="specloop-test", drafter_kind="pretrained",
                      drafter_version=version, max_context=256, slots=4, max_queue=16,
                      registry=None if registry is None else str(registry))


def filled_buffer(n: int = 5, payload: bytes = b"record") -> MemoryBuffer:
    """A memory buffer with n appended payloads, 2 of them read and 1 of those acknowledged."""
    buf = MemoryBuffer(maxlen=100)
    for _ in range(n):
        buf.append(payload)
    delivered = buf.read("learner-0", count=2)
    buf.ack([delivered[0].id])
    return buf


@dataclass
class WorkerListBackend:
    """The part of specloop.services.api.backend.Backend the admin router reads: live workers and buffer stats."""

    infos: list[WorkerInfo] = field(default_factory=list)
    buffer: MemoryBuffer | None = None

    async def workers(self) -> list[WorkerInfo]:
        return list(self.infos)

    async def buffer_stats(self) -> dict | None:
        return None if self.buffer is None else self.buffer.stats().to_dict()


def admin_app(backend: WorkerListBackend, token: str | None = TOKEN) -> FastAPI:
    app = FastAPI()
    app.include_router(make_admin_router(backend, token))
    return app


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Serve `app` with uvicorn on a free local port in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
