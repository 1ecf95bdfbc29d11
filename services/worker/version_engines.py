"""Engines for requests that name a drafter version other than the one a worker serves
(`VersionEngines`), and the error such a request gets when its version cannot be served
(`version_refusal`). Used by `specloop.services.worker.serving_loop.ServingLoop`."""
from __future__ import annotations

from concurrent.futures import Future

from specloop.drafter.decode.engine import Engine
from specloop.drafter.decode.requests import EngineRequest, RowUpdate
from specloop.services.protocol import ErrorInfo
from specloop.services.registry.types import UnknownVersion, UnservableVersion
from specloop.services.worker.worker import VerifierWorker


def version_refusal(version: str, exc: Exception | None) -> ErrorInfo:
    """The error a request naming `version` gets: 404 for a version never published, 409 for one that
    exists but cannot be served (unreadable or non-finite weights), 400 otherwise (a malformed id)."""
    message = f"drafter_version {version!r} cannot be served" + ("" if exc is None else f": {exc}")
    if isinstance(exc, UnknownVersion):
        return ErrorInfo(message, "not_found_error", 404, param="speculative.drafter_version")
    if isinstance(exc, UnservableVersion):
        return ErrorInfo(message, "invalid_request_error", 409, param="speculative.drafter_version",
                         code="version_not_servable")
    return ErrorInfo(message, "invalid_request_error", 400, param="speculative.drafter_version")


class VersionEngines:
    """Engines for requests that name a drafter version other than the serving one (an operator
    comparing a candidate, a client pinning a version): each its own small slot pool, weights from the
    registry loaded on the worker's loader thread, no hot swaps, no replay logging (the learner's
    policy terms use the serving version's records only). Stepped right after the serving engine."""

    def __init__(self, worker: VerifierWorker, slots: int, keep: int):
        self.worker, self.slots, self.keep = worker, slots, keep
        self.engines: dict[str, Engine] = {}
        self.loading: dict[str, Future[Engine]] = {}  # version -> its Engine, loading
        self.failures: dict[str, ErrorInfo] = {}
        self.requests: dict[str, str] = {}  # running request id -> version
        self.peak = 0  # the most engines + loads held at once (never above keep)

    def free(self, version: str, reserved: frozenset[str] = frozenset()) -> int | None:
        """Free slots of the version's engine (0 while it loads or while `keep` engines and loads are
        held by other versions), None if it cannot be served. `reserved`: versions given requests in
        this admission pass, never evicted for this one."""
        if version in self.failures:
            return None
        if version in self.engines:
            return len(self.engines[version].free)
        future = self.loading.get(version)
        if future is None:
            if len(self.engines) + len(self.loading) >= self.keep and not self._evict_idle(reserved):
                return 0
            self.loading[version] = self.worker.loader.submit(self._build, version)
            self.peak = max(self.peak, len(self.engines) + len(self.loading))
            return 0
        if not future.done():
            return 0
        return None if self._settle(version) is None else len(self.engines[version].free)

    def poll(self, wanted: set[str]) -> None:
        """Finished loads become engines (or failures); loads and failures no waiting request wants any
        more are dropped (a load not yet started is cancelled; one running finishes as an idle engine,
        the first to be evicted)."""
        for version, future in list(self.loading.items()):
            if future.done():
                self._settle(version)
            elif version not in wanted and future.cancel():
                del self.loading[version]
        for version in set(self.failures) - wanted:
            del self.failures[version]

    def _settle(self, version: str) -> Engine | None:
        future = self.loading.pop(version)
        try:
            self.engines[version] = engine = future.result()
        except Exception as exc:  # noqa: BLE001 - unknown version, unreadable or non-finite weights
            self.failures[version] = version_refusal(version, exc)
            return None
        return engine

    def failure(self, version: str) -> ErrorInfo:
        """Why the version's requests are refused (once: a later request tries to load it again)."""
        return self.failures.pop(version, version_refusal(version, None))

    def _build(self, version: str) -> Engine:
        w = self.worker
        assert w.registry is not None  # without one, ServingLoop._validate refuses requests naming another version
        weights = w.registry.load_weights(version)
        return Engine(w.verifier.lean, w.builder.build(weights), self.slots, w.max_context, w.stop_rule,
                      grammars=w.grammars, prefix_cache=w.prefix_cache, backend=w.engine.backend)

    def _evict_idle(self, reserved: frozenset[str]) -> bool:
        idle = [v for v, e in self.engines.items() if not e.running and v not in reserved]
        if idle:
            del self.engines[idle[0]]
        return bool(idle)

    @property
    def running(self) -> int:
        return sum(e.running for e in self.engines.values())

    def admit(self, version: str, requests: list[EngineRequest]) -> None:
        engine = self.engines[version]
        engine.admit(requests)
        for r in requests:
            live = engine.get(r.id)
            assert live is not None  # admitted just above
            live.gen.drafter_versions.append(version)
        self.requests.update((r.id, version) for r in requests)

    def step(self) -> list[RowUpdate]:
        updates = []
        for version, engine in self.engines.items():
            if engine.running:
                mine = engine.step()
                for callback in self.worker.on_step:
                    callback(mine, engine, version)
                updates += mine
        return updates

    def abort(self, request_id: str) -> bool:
        version = self.requests.pop(request_id, None)
        return version in self.engines and self.engines[version].abort(request_id)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
