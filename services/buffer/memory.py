"""The in-process replay buffer (`MemoryBuffer`): the embedded default (single process, tests), with
the consumer-group semantics of a Redis stream (see `specloop.services.buffer.connect`)."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from specloop.services.buffer.types import BufferEntry, BufferStats


@dataclass
class _Pending:
    consumer: str
    delivered: float  # time.monotonic() of the last delivery


class MemoryBuffer:
    """In-process buffer with consumer-group semantics; thread-safe, bounded to `maxlen`."""

    def __init__(self, maxlen: int = 100_000):
        self.maxlen = maxlen
        self._cond = threading.Condition()
        self._ids: deque[str] = deque()  # held entries, oldest first
        self._payloads: dict[str, bytes] = {}
        self._trimmed = 0  # entries trimmed so far: ordinal of self._ids[0]
        self._cursor = 0  # ordinal of the next entry to deliver (group-wide)
        self._pending: dict[str, _Pending] = {}  # insertion order == id order
        self._last = (0, -1)  # (ms, seq) of the newest id
        self._bytes = 0
        self._written = 0
        self._dropped = 0
        self._closed = False

    def append(self, payload: bytes) -> bool:
        with self._cond:
            if self._closed:
                self._dropped += 1
                return False
            entry_id = self._next_id()
            self._ids.append(entry_id)
            self._payloads[entry_id] = bytes(payload)
            self._bytes += len(payload)
            self._written += 1
            self._trim()
            self._cond.notify_all()
            return True

    def flush(self, timeout: float = 5.0) -> bool:
        return True  # appends are synchronous

    def read(self, consumer: str, count: int, block_ms: int = 0) -> list[BufferEntry]:
        with self._cond:
            if block_ms > 0 and not self._has_new():
                self._cond.wait_for(self._has_new, timeout=block_ms / 1000)
            self._cursor = max(self._cursor, self._trimmed)
            stop = min(self._cursor + count, self._trimmed + len(self._ids))
            out = [self._entry(self._ids[i - self._trimmed]) for i in range(self._cursor, stop)]
            self._cursor = stop
            now = time.monotonic()
            for e in out:
                self._pending[e.id] = _Pending(consumer, now)
            return out

    def ack(self, ids: list[str]) -> int:
        with self._cond:
            return sum(self._pending.pop(i, None) is not None for i in ids)

    def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[BufferEntry]:
        with self._cond:
            now = time.monotonic()
            idle = [i for i, p in self._pending.items() if (now - p.delivered) * 1000 >= min_idle_ms]
            out = []
            for entry_id in idle[:count]:
                self._pending[entry_id] = _Pending(consumer, now)
                out.append(self._entry(entry_id))
            return out

    def stats(self) -> BufferStats:
        with self._cond:
            return BufferStats("memory", self._written, self._dropped, len(self._ids),
                               len(self._pending), self._bytes)

    def cached_stats(self) -> BufferStats:
        return self.stats()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _next_id(self) -> str:
        ms = int(time.time() * 1000)
        last_ms, last_seq = self._last
        self._last = (ms, 0) if ms > last_ms else (last_ms, last_seq + 1)
        return f"{self._last[0]}-{self._last[1]}"

    def _trim(self) -> None:
        while len(self._ids) > self.maxlen:
            old = self._ids.popleft()
            self._bytes -= len(self._payloads.pop(old))
            self._pending.pop(old, None)
            self._trimmed += 1

    def _has_new(self) -> bool:
        return self._closed or max(self._cursor, self._trimmed) < self._trimmed + len(self._ids)

    def _entry(self, entry_id: str) -> BufferEntry:
        return BufferEntry(entry_id, self._payloads[entry_id])
