"""`RayBackend`: the API's view of the serving actors of a Ray cluster (named actors in the
"specloop" namespace), behind the `Backend` interface.

Routing: each request goes to the live worker with the fewest queued + running requests (asked
per request: one small actor call). A worker that dies mid-stream ends the stream with a 503 error
chunk; a worker that cannot be reached is left out until it answers again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import ray

from services.actors import LEARNER_NAME, NAMESPACE, WORKER_PREFIX
from services.protocol import Chunk, CompletionRequest, ErrorInfo, WorkerInfo, WorkerLoad

log = logging.getLogger("specloop.cluster")
CALL_TIMEOUT_S = 5.0
REFRESH_S = 2.0  # how often the list of named actors is read again


class RayBackend:
    def __init__(self):
        self._handles: dict[str, object] = {}
        self._listed = 0.0

    def _workers(self) -> dict[str, object]:
        if time.monotonic() - self._listed > REFRESH_S or not self._handles:
            self._listed = time.monotonic()
            names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                           if a["namespace"] == NAMESPACE and a["name"].startswith(WORKER_PREFIX))
            handles = {}
            for name in names:
                try:
                    handles[name] = self._handles.get(name) or ray.get_actor(name, namespace=NAMESPACE)
                except ValueError:  # died between listing and lookup
                    continue
            self._handles = handles
        return self._handles

    async def _call(self, handle, method: str):
        return await asyncio.wait_for(getattr(handle, method).remote(), CALL_TIMEOUT_S)

    async def _gather(self, method: str) -> list:
        handles = list(self._workers().values())
        results = await asyncio.gather(*(self._call(h, method) for h in handles), return_exceptions=True)
        return [r for r in results if not isinstance(r, BaseException)]

    async def _pick(self):
        handles = self._workers()
        loads = await asyncio.gather(*(self._call(h, "load") for h in handles.values()), return_exceptions=True)
        live = [(WorkerLoad.from_dict(load), h) for load, h in zip(loads, handles.values()) if isinstance(load, dict)]
        if not live:
            return None
        return min(live, key=lambda pair: pair[0].queued + pair[0].running)[1]

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Chunk]:
        handle = await self._pick()
        if handle is None:
            yield Chunk(request.id, error=ErrorInfo("no verifier worker is alive", "server_error", 503, code="no_worker"))
            return
        gen = handle.stream.options(num_returns="streaming").remote(request.to_dict())
        done = False
        try:
            async for ref in gen:
                chunk = Chunk.from_dict(await ref)
                done = chunk.last
                yield chunk
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            log.warning("worker lost mid-request %s: %s", request.id, exc)
            done = True
            yield Chunk(request.id, error=ErrorInfo("the verifier worker serving this request died", "server_error", 503,
                                                    code="worker_lost"))
        finally:
            if not done:
                ray.cancel(gen)

    async def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo.from_dict(d) for d in await self._gather("info")]

    async def loads(self) -> list[WorkerLoad]:
        return [WorkerLoad.from_dict(d) for d in await self._gather("load")]

    async def ready(self) -> bool:
        return any(await self._gather("ready"))

    async def buffer_stats(self) -> dict | None:
        stats = await self._gather("buffer_stats")
        return next((s for s in stats if s is not None), None)

    async def metrics_targets(self) -> list[str]:
        targets = [info.metrics_url for info in await self.workers() if info.metrics_url]
        try:
            learner = ray.get_actor(LEARNER_NAME, namespace=NAMESPACE)
            targets.append(await asyncio.wait_for(learner.metrics_url.remote(), CALL_TIMEOUT_S))
        except (ValueError, asyncio.TimeoutError, ray.exceptions.RayError):
            pass
        return targets

    async def close(self) -> None:
        self._handles = {}
