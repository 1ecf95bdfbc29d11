"""The registry as a serving thread sees it, without ever waiting on it.

A `RegistryWatcher` thread reads the registry's alias every `interval` seconds; when the champion
changed it loads that version's drafter (on the same thread) and leaves it in `ready` for the serving
thread to take between two steps. Rollbacks the serving thread decides are carried out on this thread
too. The serving thread only reads what the thread left: a registry whose Redis hangs or is down costs
it nothing (it keeps serving the drafter it has, and `down` / `errors` say so).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from specloop.services.event_log import EventLog

log = logging.getLogger("specloop.worker")


@dataclass
class Loaded:
    """A champion's drafter, built off the serving thread (or the error that stopped it)."""

    version: str
    started: float  # perf_counter when its load began
    drafter: object | None = None
    error: Exception | None = None


class RegistryWatcher:
    RETRY_S = 5.0  # a champion that failed to load is tried again after this long (a file still being copied)

    def __init__(self, registry, load: Callable[[str], object], interval: float, serving: str):
        self.registry, self.load, self.interval = registry, load, interval
        self._failed_at: float | None = None  # when the last load of the alias's champion failed
        self.serving = serving  # the version the serving thread runs (it writes this, the thread reads it)
        self.token: str | None = None  # the alias last acted on
        self.down = False  # the last read failed
        self.errors = 0  # reads that failed
        self.rollbacks: EventLog[str] = EventLog()  # reasons of the last rollbacks carried out
        self._ready: Loaded | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._polls = 0  # reads finished (successful or not)
        self._reading = False  # a read is under way (set and cleared under the lock)
        self._champion: str | None = None  # the champion of the alias last read
        self._kick = False
        self._tasks: list[Callable[[], None]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="registry-watcher", daemon=True)

    def start(self) -> "RegistryWatcher":
        self._thread.start()
        return self

    # -- the serving thread's side: never blocks on the registry

    def take(self) -> Loaded | None:
        """The loaded champion, once (None while nothing new is ready)."""
        with self._lock:
            ready, self._ready = self._ready, None
        return ready

    def fresh(self, timeout: float) -> bool:
        """Ask for a read now and wait up to `timeout` for it (at most: not at all while the registry
        is known to be down). True when a read finished in time."""
        with self._wake:
            target = self._polls + (2 if self._reading else 1)  # a read under way may predate the ask
            self._kick = True
            self._wake.notify_all()
            if self.down:
                return False
            return self._wake.wait_for(lambda: self._polls >= target or self._stop, timeout=timeout)

    def rollback(self, reason: str, expected: str) -> None:
        """Roll the registry back from `expected` (compare-and-set: refused when another worker already
        did), on the watcher's thread."""
        self._submit(lambda: self._rollback(reason, expected))

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=5)

    # -- the thread

    def _submit(self, task: Callable[[], None]) -> None:
        with self._wake:
            self._tasks.append(task)
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stop or self._kick or self._tasks, timeout=self.interval)
                if self._stop:
                    return
                tasks, self._tasks, self._kick = self._tasks, [], False
                self._reading = True
            for task in tasks:
                task()
            self.poll()
            with self._wake:
                self._reading = False
                self._polls += 1
                self._wake.notify_all()

    def poll(self) -> None:
        """One read of the alias; a new champion is loaded before this returns (on the caller's thread:
        the watcher's, or the constructor's before serving starts), and left ready only if it is still
        the champion once loaded (an operator may have rolled back meanwhile)."""
        champion = self._changed_champion()
        while champion is not None:
            started = time.perf_counter()
            try:
                loaded, self._failed_at = Loaded(champion, started, drafter=self.load(champion)), None
            except Exception as exc:  # noqa: BLE001 - a bad version never stops serving
                loaded, self._failed_at = Loaded(champion, started, error=exc), time.monotonic()
            now = self._changed_champion()
            if now == champion or (now is None and self._champion == champion):
                with self._lock:
                    self._ready = loaded
                return
            champion = now

    def _changed_champion(self) -> str | None:
        """Read the alias: the champion to load when it changed to a version not serving, else None
        (a registry that cannot be read changes nothing)."""
        try:
            alias = self.registry.alias()
        except Exception as exc:  # noqa: BLE001 - serving never fails on the registry
            if not self.down:
                log.warning("registry unreachable, serving %s until it answers: %s", self.serving, exc)
            self.down = True
            self.errors += 1
            return None
        if self.down:
            log.info("registry reachable again")
            self.down = False
        if alias.token() == self.token:
            return self._retry(alias.champion)
        self.token, self._champion, self._failed_at = alias.token(), alias.champion, None
        if alias.champion is None or alias.champion == self.serving:
            self.take()  # a load that is no longer the champion is never switched to
            return None
        return alias.champion

    def _retry(self, champion: str | None) -> str | None:
        """The champion again once RETRY_S passed since its load failed, else None."""
        if self._failed_at is None or time.monotonic() - self._failed_at < self.RETRY_S or champion == self.serving:
            return None
        self._failed_at = None
        return champion

    def _rollback(self, reason: str, expected: str) -> None:
        try:
            back = self.registry.rollback(reason, expected=expected)
        except Exception as exc:  # noqa: BLE001 - refused, or the registry is unreachable: serving goes on
            log.warning("automatic rollback refused: %s", exc)
            return
        self.rollbacks.append(reason)
        log.warning("rolled back to %s: %s", back, reason)
