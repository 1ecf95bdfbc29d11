"""The serving loop around a `VerifierWorker`: a bounded queue, a thread that admits requests into
free cache slots and steps the continuous batch, and per-request streams of `Chunk`s.

Threads: callers (the API's event loop, or a Ray actor's) `submit` requests and `cancel` them; one
loop thread owns the engine and does everything else, so the engine itself needs no locks.

- Backpressure: at most `max_queue` requests wait for a slot; beyond that a request is answered at
  once with an overloaded error (the API turns it into 503 with Retry-After).
- A cancelled request (its client went away) leaves its slot at the next step.
- Text is detokenized incrementally: an incomplete UTF-8 character is held back, and with stop
  strings the last (longest stop − 1) characters are held back until the request ends, so no part
  of a stop string is ever streamed.

`VersionEngines` (requests naming another drafter version) lives in `specloop.services.worker.version_engines`,
`attach_metrics` in `specloop.services.metrics.serving`; both are importable from here.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import AsyncIterator, Callable

from specloop.drafter.decode.logprobs import TokenScore, prompt_scores
from specloop.drafter.decode.requests import EngineRequest, Generation, RowUpdate
from specloop.services.protocol import (
    MAX_TOP_LOGPROBS,
    Chunk,
    CompletionRequest,
    ErrorInfo,
    TokenLogprob,
    Usage,
    WorkerInfo,
    WorkerLoad,
    invalid,
    overloaded,
)
from specloop.services.worker.detokenize import IncrementalText
from specloop.services.worker.version_engines import VersionEngines
from specloop.services.worker.worker import VerifierWorker, WorkerConfig

log = logging.getLogger("specloop.serving")
Sink = Callable[[Chunk], None]


@dataclass
class _Waiting:
    """A request waiting for a cache slot, since when (time.monotonic)."""

    request: CompletionRequest
    sink: Sink
    since: float


@dataclass
class _Live:
    """What serving keeps of a running request (its tokens and counts are the engine's)."""

    request: CompletionRequest
    sink: Sink
    text: IncrementalText
    queued_s: float  # how long it waited for a slot (vLLM's queue time)


@dataclass
class ServingConfig:
    worker: WorkerConfig
    max_queue: int = 64  # requests waiting for a slot before new ones are refused (503)
    model: str = "specloop"  # the model id clients name
    name: str = "worker-0"
    idle_wait_s: float = 0.05  # how long the loop sleeps when nothing runs or waits
    version_slots: int = 2  # slots of the engine of each non-serving version that requests name
    max_versions: int = 2  # such engines kept at once (an idle one makes room for a new one)



class ServingLoop:
    def __init__(self, cfg: ServingConfig, worker: VerifierWorker):
        self.cfg, self.worker = cfg, worker
        self.tokenizer = tok = worker.verifier.tokenizer  # each request's text: IncrementalText over its DecodeStream
        self.decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        self.waiting: deque[_Waiting] = deque()
        self.cancelled: set[str] = set()
        self.live: dict[str, _Live] = {}
        self.pinned = VersionEngines(worker, cfg.version_slots, cfg.max_versions)  # requests naming another version
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopped = False
        self.ready = False
        self.failure: str | None = None  # why the loop thread ended early
        self.steps = 0
        self.thread = threading.Thread(target=self._run, name="serving-loop", daemon=True)

    def start(self) -> "ServingLoop":
        self.thread.start()
        return self

    # -- callers' side (any thread)

    def submit(self, request: CompletionRequest, sink: Sink) -> None:
        problem = self._validate(request)
        if problem is not None:
            return sink(problem)
        with self.lock:
            if len(self.waiting) >= self.cfg.max_queue:
                return sink(overloaded(request.id))
            self.waiting.append(_Waiting(request, sink, time.monotonic()))
        self.wake.set()

    def cancel(self, request_id: str) -> None:
        with self.lock:
            self.cancelled.add(request_id)
        self.wake.set()

    @property
    def running(self) -> int:
        return self.worker.engine.running + self.pinned.running

    def load(self) -> WorkerLoad:
        return WorkerLoad(len(self.waiting), self.running, self.worker.engine.slots, self.cfg.max_queue,
                          self.worker.version)

    def info(self, metrics_url: str | None = None, buffer: str | None = None) -> WorkerInfo:
        w = self.worker.cfg
        return WorkerInfo(self.cfg.name, w.verifier, self.cfg.model, w.kind, self.worker.version,
                          self.worker.max_context, w.slots, self.cfg.max_queue, w.registry, w.redis_url,
                          w.prefix, buffer, metrics_url, self.worker.verifier.served)

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Chunk]:
        """Chunks for one request, on the caller's event loop; closing the iteration cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Chunk] = asyncio.Queue()

        def sink(chunk: Chunk) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        self.submit(request, sink)
        done = False
        try:
            while not done:
                chunk = await queue.get()
                done = chunk.last
                yield chunk
        finally:
            if not done:
                self.cancel(request.id)

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=10)

    def _validate(self, r: CompletionRequest) -> Chunk | None:
        if r.drafter_version is not None and self.worker.registry is None and r.drafter_version != self.worker.version:
            return invalid(r.id, f"drafter_version {r.drafter_version!r}: this worker has no registry "
                                 f"(it serves {self.worker.version!r} only)", "speculative.drafter_version")
        if r.k and self.worker.engine.drafter is None:  # k = None (auto) decodes plainly without a drafter
            return invalid(r.id, "this worker has no drafter: set speculative.enabled false", "speculative")
        if r.k is not None and r.k < 0:
            return invalid(r.id, f"k = {r.k} < 0", "speculative.k")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(r, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                return invalid(r.id, f"{name} = {value}: between 0 and {MAX_TOP_LOGPROBS}", name)
        engine = self.worker.engine  # its capacity rule (specloop.drafter.decode.capacity) with its controller's k_max
        if not r.prompt_ids or not engine.fits(len(r.prompt_ids), r.max_tokens, r.k):
            return invalid(r.id, f"prompt of {len(r.prompt_ids)} tokens + max_tokens {r.max_tokens} "
                                 f"(+ {engine.reserve(r.k)} for drafting) exceeds the context of "
                                 f"{self.worker.max_context} positions", "max_tokens")
        try:
            r.sampling() if r.max_tokens else replace(r, max_tokens=1).sampling()  # 0: no sampling, the rest checked
        except ValueError as exc:
            return invalid(r.id, str(exc))
        return None

    # -- the loop thread

    def _run(self) -> None:
        try:
            self._warm_up()
        except Exception as exc:  # noqa: BLE001 - said by ready() at once, not after a timeout
            log.exception("warm-up failed")
            self.failure = f"the worker's warm-up forward pass failed: {type(exc).__name__}: {exc}"
            return
        while not self.stopped:
            self._drop_cancelled()
            self._admit()
            if not self.running:
                if not self.worker.engine.cache_finished(most=1):  # idle: one finished chat's answer cached
                    self.wake.wait(self.cfg.idle_wait_s)
                    self.wake.clear()
                continue
            try:
                updates = self.worker.step() if self.worker.engine.running else []
                updates += self.pinned.step()
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, never the worker
                log.exception("step failed")
                self._fail_all(f"internal error in a decoding step: {exc}")
                continue
            self.steps += 1
            for u in updates:
                self._deliver(u)

    def _warm_up(self) -> None:
        """One real forward pass (and drafter pass) before the worker says it is ready."""
        req = CompletionRequest("warm-up-" + uuid.uuid4().hex[:8], [0, 1], max_tokens=1,
                                k=1 if self.worker.engine.drafter is not None else 0)
        self.worker.admit([self._engine_request(req)])
        while self.worker.engine.running:
            self.worker.step()
        self.worker.engine.controller.reset()  # first calls carry one-time costs: not what a step costs
        self.ready = True

    def _drop_cancelled(self) -> None:
        with self.lock:
            gone, self.cancelled = self.cancelled, set()
            self.waiting = deque(item for item in self.waiting if item.request.id not in gone)
        for rid in gone:
            if self.live.pop(rid, None) is not None:
                self.worker.abort(rid) or self.pinned.abort(rid)

    def _admit(self) -> None:
        """Waiting requests into free slots, in arrival order per engine: the serving version's, or the
        engine of the version a request names (loaded in the background; its requests wait meanwhile)."""
        with self.lock:
            pending = list(self.waiting)
        chosen: dict[str | None, list] = {}  # engine (None: the serving version's) -> requests
        refused = []
        self.pinned.poll({key for item in pending if (key := self._engine_key(item)) is not None})
        for item in pending:
            key = self._engine_key(item)
            reserved = frozenset(k for k, batch in chosen.items() if k is not None and batch)
            free = len(self.worker.engine.free) if key is None else self.pinned.free(key, reserved)
            if free is None:  # the version failed to load: refuse its requests
                refused.append(item)
            elif len(chosen.setdefault(key, [])) < free:
                chosen[key].append(item)
        taken = {item.request.id for batch in [*chosen.values(), refused] for item in batch}
        if not taken:
            return
        with self.lock:
            self.waiting = deque(item for item in self.waiting if item.request.id not in taken)
        for item in refused:
            version = item.request.drafter_version
            assert version is not None  # refused by its version's engine (None: the serving version's)
            item.sink(Chunk(item.request.id, error=self.pinned.failure(version)))
        for key, batch in chosen.items():
            self._start(key, batch)

    def _engine_key(self, item: _Waiting) -> str | None:
        """The version whose engine serves `item` (None: the serving version's)."""
        version = item.request.drafter_version
        return None if version in (None, self.worker.version) else version

    def _start(self, version: str | None, batch: list[_Waiting]) -> None:
        for item in batch:
            if item.request.max_tokens == 0:  # nothing generated (a prompt scored, or echoed): no slot, no step
                self._score(item, final=True)
        batch = [item for item in batch if item.request.max_tokens > 0]
        if not batch:
            return
        try:
            requests = [self._engine_request(item.request) for item in batch]
            self.worker.admit(requests) if version is None else self.pinned.admit(version, requests)
        except Exception as exc:  # noqa: BLE001 - e.g. a request that does not fit: refuse it, keep serving
            log.warning("admission failed: %s", exc)
            for item in batch:
                item.sink(invalid(item.request.id, str(exc)))
            return
        now = time.monotonic()
        for item in batch:
            r = item.request
            text = IncrementalText(self.decode, tuple(r.stop), tokenizer=self.tokenizer)
            self.live[r.id] = _Live(r, item.sink, text, now - item.since)
            if r.prompt_logprobs is not None:  # its first chunk, before any step's tokens
                self._score(item, final=False)

    def _score(self, item: _Waiting, final: bool) -> None:
        """The request's prompt scored (`prompt_scores`: a pass of its own over the prompt; not where it asked for no
        prompt_logprobs) and sent as a chunk of its own; `final`: the request asked for nothing more (max_tokens 0),
        so the chunk ends it."""
        r = item.request
        try:
            scores = None if r.prompt_logprobs is None else \
                prompt_scores(self.worker.verifier.lean, r.prompt_ids, r.prompt_logprobs)
        except Exception as exc:  # noqa: BLE001 - one request's failure, never the worker's
            log.exception("scoring a prompt failed")
            if self.live.pop(r.id, None) is not None:
                self.worker.abort(r.id) or self.pinned.abort(r.id)
            item.sink(Chunk(r.id, error=ErrorInfo(f"internal error scoring the prompt: {exc}", "server_error", 500)))
            return
        chunk = Chunk(r.id, prompt_logprobs=token_logprobs(scores))
        if final:
            chunk.finish_reason = "length"
            chunk.usage = Usage(len(r.prompt_ids), 0, queue_time_s=time.monotonic() - item.since)
        item.sink(chunk)

    @staticmethod
    def _engine_request(r: CompletionRequest) -> EngineRequest:
        return r.engine_request()

    def _deliver(self, u: RowUpdate) -> None:
        live = self.live.get(u.id)
        if live is None:
            return
        final = u.generation is not None
        chunk = Chunk(u.id, list(u.new_tokens), live.text.push(u.new_tokens, final), u.finish_reason,
                      logprobs=token_logprobs(u.logprobs))
        if u.generation is not None:  # final
            self.pinned.forget(u.id)
            del self.live[u.id]
            chunk.usage = usage(live.request, u.generation, live.queued_s)
        if chunk.token_ids or final:
            live.sink(chunk)

    def _fail_all(self, message: str) -> None:
        for rid, live in list(self.live.items()):
            self.worker.abort(rid) or self.pinned.abort(rid)
            live.sink(Chunk(rid, error=ErrorInfo(message, "server_error", 500)))
        self.live.clear()


def usage(request: CompletionRequest, gen: Generation, queued_s: float = 0.0) -> Usage:
    """A finished request's usage, from the engine's generation and its wait for a slot."""
    s = gen.stats
    return Usage(len(request.prompt_ids), len(gen.token_ids), s.drafted, s.accepted, s.blocks,
                 ",".join(gen.drafter_versions), queued_s)


def token_logprobs(scores: list[TokenScore] | None) -> list[TokenLogprob] | None:
    """The engine's scores of a chunk's tokens as the protocol carries them (None: not asked for)."""
    return None if scores is None else [TokenLogprob(s.token_id, s.logprob, list(s.top)) for s in scores]



class LocalBackend:
    """A serving loop in this process behind the `Backend` interface (tests; serve without Ray)."""

    def __init__(self, loop: ServingLoop, metrics_url: str | None = None, buffer: str | None = None):
        self.loop, self.metrics_url, self.buffer = loop, metrics_url, buffer

    @classmethod
    def open(cls, verifier: str, drafter: str | None, kind: str = "pretrained", slots: int = 4, max_queue: int = 16,
             model: str = "specloop", max_versions: int = 2, **worker_fields) -> "LocalBackend":
        cfg = WorkerConfig(verifier=str(verifier), drafter=None if drafter is None else str(drafter), kind=kind,
                           slots=slots, log_records=False, **worker_fields)
        worker = VerifierWorker(cfg)
        serving = ServingConfig(cfg, max_queue=max_queue, model=model, max_versions=max_versions)
        return cls(ServingLoop(serving, worker).start())

    def stream(self, request: CompletionRequest) -> AsyncIterator[Chunk]:
        return self.loop.stream(request)

    async def workers(self) -> list[WorkerInfo]:
        return [self.loop.info(self.metrics_url, self.buffer)] if self.loop.thread.is_alive() else []

    async def loads(self) -> list[WorkerLoad]:
        return [self.loop.load()]

    async def ready(self) -> bool:
        return self.loop.ready

    async def buffer_stats(self) -> dict | None:
        buffer = self.loop.worker.logger.buffer if self.loop.worker.logger is not None else None
        return None if buffer is None else asdict(buffer.cached_stats())

    async def metrics_targets(self) -> list[str]:
        return [self.metrics_url] if self.metrics_url else []

    async def close(self) -> None:
        self.loop.stop()
        self.loop.worker.close()


def wait_ready(loop: ServingLoop, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not loop.ready and time.monotonic() < deadline:
        time.sleep(0.01)
    return loop.ready
