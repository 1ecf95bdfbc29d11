"""Draining an API replica on SIGTERM (or SIGINT), so that a rolling restart loses no request.

When the drain starts, `/ready` answers 503 at once (the load balancer stops sending), and a new
completion request gets a 503 `shutting_down` with `Retry-After` (a client retries on another
replica). The requests in flight (streams included) go on to their end, for at most
`drain_timeout` seconds; whatever is still running then is cut in-band (a stream gets an error
event and `data: [DONE]`, a plain request a 503). Then uvicorn shuts down: it closes the listening
socket and idle connections and waits for the last responses to be written. A second signal moves the
deadline to now (what is in flight is cut in-band at once, and the process stops within `CUT_GRACE_S`:
a client still gets its error and `[DONE]`, the log no traceback); a third stops it at once (uvicorn's
force exit, which cancels what is still open).

`Drain` is the app's state (`app.state.drain`: the routes read it); `DrainingServer` is uvicorn's
server with signals that start the drain instead of stopping it.
"""
from __future__ import annotations

import logging
import signal
import time
from itertools import count
from typing import Callable

import uvicorn

log = logging.getLogger("specloop.api")

DRAIN_TIMEOUT_S = 30.0
CUT_GRACE_S = 2.0  # after the deadline: time for cut requests to send their error and for uvicorn to close


class Drain:
    """Whether this replica is draining, and the requests in flight (each with how to cut it short)."""

    def __init__(self) -> None:
        self.started_at: float | None = None
        self.timeout_s = DRAIN_TIMEOUT_S
        self.cut = False
        self.active: dict[int, Callable[[], None]] = {}
        self._ids = count()

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def start(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        if self.started_at is None:
            self.started_at, self.timeout_s = time.monotonic(), timeout_s
            log.warning("draining: %d request(s) in flight, at most %.0f s", len(self.active), timeout_s)

    def enter(self, cut: Callable[[], None]) -> int:
        """A request is in flight until `leave(token)`; `cut()` ends it early at the drain's deadline."""
        token = next(self._ids)
        self.active[token] = cut
        return token

    def leave(self, token: int) -> None:
        self.active.pop(token, None)

    def cut_now(self) -> None:
        """Move the deadline to now: the next `tick` cuts what is in flight, and the drain is over
        `CUT_GRACE_S` later."""
        self.timeout_s = self.elapsed()

    @property
    def overdue(self) -> bool:
        """Draining, and its deadline has come (it timed out, or `cut_now` moved it)."""
        return self.draining and self.elapsed() >= self.timeout_s

    def elapsed(self) -> float:
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    def tick(self) -> bool:
        """Called often while serving: cuts what is left once the deadline passed; True when the drain
        is over (nothing in flight, or the cut requests had their grace)."""
        if not self.draining:
            return False
        if self.active and not self.cut and self.overdue:
            self.cut = True
            log.warning("drain deadline: cutting %d request(s) short", len(self.active))
            for cut in list(self.active.values()):
                cut()
        return not self.active or self.elapsed() >= self.timeout_s + CUT_GRACE_S


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGTERM / SIGINT starts the drain of `drain`; it exits once the drain is over."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout: float = DRAIN_TIMEOUT_S):
        super().__init__(config)
        self.drain, self.drain_timeout = drain, drain_timeout

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if not self.drain.draining:
            log.warning("specloop API: %s received", name)
            self.drain.start(self.drain_timeout)
        elif not self.drain.overdue:  # a second signal: the deadline is now
            log.warning("specloop API: %s received again", name)
            self.drain.cut_now()
        else:  # a third (or a second after the deadline): stop at once
            log.warning("specloop API: %s received while cutting: stopping now", name)
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.drain.tick():
            # what is still open: last bytes only. uvicorn types it int | None, but uses it as
            # asyncio.wait_for's timeout (a float works)
            self.config.timeout_graceful_shutdown = CUT_GRACE_S  # type: ignore[assignment]
            self.should_exit = True
        return await super().on_tick(counter)
