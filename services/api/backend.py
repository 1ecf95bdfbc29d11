"""What the HTTP API drives: one or more verifier workers behind one interface.

- `LocalBackend`: a worker in this process (tests, `specloop serve` without Ray workers).
- `RayBackend` (services/actors.py): worker actors of a Ray cluster, least-loaded routing.

Both stream `specloop.services.protocol.Chunk`s for one `CompletionRequest`; cancelling the iteration (a
client that went away) frees the request's slot at the worker's next step.
"""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from specloop.services.protocol import Chunk, CompletionRequest, WorkerInfo, WorkerLoad


class Backend(Protocol):
    def stream(self, request: CompletionRequest) -> AsyncIterator[Chunk]:
        """Chunks for one request; the last has finish_reason or error set."""

    async def workers(self) -> list[WorkerInfo]:
        """The workers that answer now (empty: none alive)."""

    async def loads(self) -> list[WorkerLoad]:
        """Queue depth and running rows of each live worker."""

    async def ready(self) -> bool:
        """True once a worker has run a real forward pass."""

    async def buffer_stats(self) -> dict | None:
        """The replay buffer's statistics (None: no buffer)."""

    async def metrics_targets(self) -> list[str]:
        """host:port of every Prometheus endpoint behind this backend (workers, learner), for
        Prometheus's HTTP service discovery (`GET /sd/targets` of the API)."""

    async def close(self) -> None:
        """Release connections (not the workers)."""
