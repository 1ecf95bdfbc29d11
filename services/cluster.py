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

from specloop.services.actors import LEARNER_NAME, WORKER_PREFIX, named_actor, named_actors
from specloop.services.protocol import Chunk, CompletionRequest, ErrorInfo, WorkerInfo, WorkerLoad

log = logging.getLogger("specloop.cluster")
CALL_TIMEOUT_S = 5.0
REFRESH_S = 2.0  # how old the cached view of the workers may get before it is read again
PICK_WAIT_S = 0.5  # routing waits this long for the workers' loads, then picks among those that answered


def named_workers(known: dict[str, object]) -> dict[str, object]:
    """Handles of the named worker actors now in the cluster (blocking Ray calls: run off the event loop);
    one that died between listing and lookup is left out."""
    handles = {name: known.get(name) or named_actor(name) for name in named_actors(WORKER_PREFIX)}
    return {name: h for name, h in handles.items() if h is not None}


def learner_metrics_url() -> str | None:
    """The learner's metrics URL (blocking Ray calls: run off the event loop)."""
    learner = named_actor(LEARNER_NAME)
    try:
        return None if learner is None else ray.get(learner.metrics_url.remote(), timeout=CALL_TIMEOUT_S)
    except ray.exceptions.RayError:
        return None


async def answered(calls: dict, wait_s: float) -> list[tuple[WorkerLoad, object]]:
    """(load, handle) of the `load` calls that answered within `wait_s`; when none did, of the first
    that answers (a dead or hung worker's call fails or times out, and is left out)."""
    done, pending = await asyncio.wait(calls, timeout=wait_s)
    while not (live := [(WorkerLoad.from_dict(t.result()), calls[t]) for t in done if t.exception() is None]) \
            and pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    return live


def _logged(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("reading the workers failed: %s", task.exception())


class RayBackend:
    """The cluster's workers as the API sees them. Nothing here blocks the event loop: actor discovery
    runs on a thread, and the view of the workers (their handles and answers to `info` / `ready`) is
    cached: a caller gets the last view at once while one refresh at a time renews it in the background
    (only the first caller waits for it). Routing asks each worker's load per request, waiting at most
    PICK_WAIT_S for the slow ones."""

    def __init__(self) -> None:
        self._handles: dict[str, object] = {}
        self._view: tuple[list[WorkerInfo], bool] | None = None  # (infos of live workers, any ready)
        self._viewed = 0.0
        self._refresh: asyncio.Task[tuple[list[WorkerInfo], bool]] | None = None

    async def _workers(self) -> dict[str, object]:
        self._handles = await asyncio.to_thread(named_workers, dict(self._handles))
        return self._handles

    async def _call(self, handle, method: str):
        return await asyncio.wait_for(getattr(handle, method).remote(), CALL_TIMEOUT_S)

    async def _gather(self, method: str, handles: list) -> list:
        results = await asyncio.gather(*(self._call(h, method) for h in handles), return_exceptions=True)
        return [None if isinstance(r, BaseException) else r for r in results]

    async def _read_view(self) -> tuple[list[WorkerInfo], bool]:
        handles = list((await self._workers()).values())
        infos, ready = await asyncio.gather(self._gather("info", handles), self._gather("ready", handles))
        self._view = ([WorkerInfo.from_dict(d) for d in infos if d is not None], any(r for r in ready if r))
        self._viewed = time.monotonic()
        return self._view

    async def view(self) -> tuple[list[WorkerInfo], bool]:
        """The workers that answered and whether any is ready: the cached view, renewed in the
        background once it is REFRESH_S old (awaited only when there is none yet)."""
        if self._refresh is None or self._refresh.done():
            if self._view is None or time.monotonic() - self._viewed > REFRESH_S:
                self._refresh = asyncio.ensure_future(self._read_view())
                self._refresh.add_done_callback(_logged)
        if self._view is None:
            assert self._refresh is not None  # started above, or still running, while there is no view
            return await asyncio.shield(self._refresh)
        return self._view

    async def _known(self) -> list:
        """The workers' handles as of the view (renewed in the background once it is old)."""
        await self.view()
        return list(self._handles.values())

    async def _pick(self):
        calls = {asyncio.ensure_future(self._call(h, "load")): h for h in await self._known()}
        try:
            live = await answered(calls, PICK_WAIT_S)
        finally:
            for call in calls:
                call.cancel()
        return min(live, key=lambda pair: pair[0].queued + pair[0].running)[1] if live else None

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Chunk]:
        handle = await self._pick()
        if handle is None:
            yield Chunk(request.id, error=ErrorInfo("no verifier worker is alive", "server_error", 503,
                                                    code="no_worker"))
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
            yield Chunk(request.id, error=ErrorInfo("the verifier worker serving this request died", "server_error",
                                                    503, code="worker_lost"))
        finally:
            if not done:
                ray.cancel(gen)

    async def workers(self) -> list[WorkerInfo]:
        return (await self.view())[0]

    async def loads(self) -> list[WorkerLoad]:
        return [WorkerLoad.from_dict(d) for d in await self._gather("load", await self._known()) if d is not None]

    async def ready(self) -> bool:
        return (await self.view())[1]

    async def buffer_stats(self) -> dict | None:
        stats = await self._gather("buffer_stats", await self._known())
        return next((s for s in stats if s is not None), None)

    async def metrics_targets(self) -> list[str]:
        targets = [info.metrics_url for info in await self.workers() if info.metrics_url]
        learner = await asyncio.to_thread(learner_metrics_url)
        return targets + ([learner] if learner else [])

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        self._handles, self._view = {}, None
