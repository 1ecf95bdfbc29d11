"""Replay buffer: serving workers append encoded replay records, learners read and ack them.

One interface (`ReplayBuffer`), two implementations:

- `MemoryBuffer`: in-process, the embedded default (single process, tests).
- `RedisStreamBuffer`: a Redis stream `{prefix}:replay` read through a consumer group.

Semantics (both follow Redis Streams consumer groups):

- Payloads are opaque `bytes`; the buffer never decodes them.
- Entry ids look like Redis stream ids, "ms-seq", and increase in append order.
- The buffer is bounded: past `maxlen` the oldest entries are trimmed (Redis: `MAXLEN ~`,
  so the stream may briefly hold somewhat more), and a Redis stream also by bytes: it keeps
  about `max_bytes` of payloads (256 MiB by default; never fewer than `MIN_ENTRIES` entries), so
  the replay stream cannot fill Redis and starve the registry. A trimmed entry is gone, also
  from pending.
- `read` hands each new entry to exactly one consumer of the group (a group-wide cursor,
  like `XREADGROUP ... >`). A delivered entry stays *pending* on its consumer until `ack`.
  Ack only once the update that used the entry is durable (at-least-once delivery).
- `claim_stale` moves entries that have been pending for at least `min_idle_ms` to the
  calling consumer (`XAUTOCLAIM`): how a new learner takes over a dead learner's work.
  With `min_idle_ms == 0` it returns every pending entry, the caller's own included.
  Redis quirk: an entry trimmed while pending stays in the group's pending list (and in
  `stats().pending`) until XAUTOCLAIM meets it, which drops it (Redis >= 7.0) and returns
  nothing for it. The memory buffer drops it from pending at trim time.

Serving must never wait on the buffer: `append` never raises and never blocks. The Redis
buffer only puts the payload on a bounded local queue; a writer thread ships batches with a
pipeline of XADD. When Redis is unreachable the writer drops what it holds (counted in
`dropped`), backs off, and reconnects by itself; it logs once when Redis goes away and once
when it comes back. `flush` waits for queued payloads to be written or dropped.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Protocol
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("specloop.buffer")

ACCEPTED_SPECS = "'memory' or 'redis://HOST:PORT[/DB]'"
FIELD = b"r"  # the stream field that holds the payload


@dataclass
class BufferEntry:
    id: str  # "ms-seq", increasing
    payload: bytes


@dataclass
class BufferStats:
    backend: str  # "memory" or "redis"
    written: int  # payloads that reached the backend (this process)
    dropped: int  # payloads dropped: backend unreachable or local queue full (this process)
    depth: int  # entries currently held; -1 if unknown
    pending: int  # delivered but not acknowledged (group-wide); -1 if unknown
    memory_bytes: int | None  # Redis MEMORY USAGE of the stream; payload bytes for memory

    def to_dict(self) -> dict:
        return asdict(self)


class ReplayBuffer(Protocol):
    def append(self, payload: bytes) -> bool:
        """Queue one payload; never raises or blocks. False when dropped (counted)."""

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until earlier appends were written or dropped; True if that happened in time."""

    def read(self, consumer: str, count: int, block_ms: int = 0) -> list[BufferEntry]:
        """Up to `count` entries never delivered to the group; they become pending on `consumer`."""

    def ack(self, ids: list[str]) -> int:
        """Acknowledge entries once their update is durable; returns how many were pending."""

    def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[BufferEntry]:
        """Move entries pending for >= `min_idle_ms` (on any consumer) to `consumer`."""

    def stats(self) -> BufferStats:
        """Counters and sizes, read now (a Redis call with short timeouts); never raises."""

    def cached_stats(self) -> BufferStats:
        """What a serving thread or event loop reads: counters, and sizes as last read by the buffer's
        own thread (about a second old; -1 when unknown). Never waits on I/O."""

    def close(self) -> None:
        """Drain briefly and stop; later appends are dropped."""


def open_buffer(spec: str, prefix: str = "specloop", maxlen: int = 100_000) -> ReplayBuffer:
    """"memory" -> MemoryBuffer; "redis://HOST:PORT[/DB]" -> RedisStreamBuffer."""
    check_spec(spec)
    if spec == "memory":
        return MemoryBuffer(maxlen=maxlen)
    return RedisStreamBuffer(spec, prefix=prefix, maxlen=maxlen)


def check_spec(spec: str) -> None:
    """ValueError unless `spec` is one `open_buffer` accepts (checked without connecting)."""
    if spec == "memory":
        return
    url = urlparse(spec)
    db = url.path.lstrip("/")
    try:
        ok = url.scheme == "redis" and bool(url.hostname) and url.port is not None
    except ValueError:  # a port that is not a number
        ok = False
    if not ok or not (db == "" or db.isdigit()):
        raise ValueError(f"unknown replay buffer spec {spec!r}: expected {ACCEPTED_SPECS}")


# ----------------------------------------------------------------------------- memory


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


# ------------------------------------------------------------------------------ redis


MIN_ENTRIES = 1024  # the byte bound never trims a Redis stream below this many entries


class RedisStreamBuffer:
    """Redis stream `{prefix}:replay` with consumer group `group`; writes via a daemon thread."""

    BATCH = 512  # payloads per XADD pipeline
    BACKOFF_MIN, BACKOFF_MAX = 0.2, 2.0  # seconds between attempts while Redis is down
    SIZES_EVERY_S = 1.0  # the writer thread reads the stream's sizes this often (`cached_stats`)

    def __init__(self, url: str, prefix: str = "specloop", maxlen: int = 100_000,
                 group: str = "learners", queue_size: int = 10_000, max_bytes: int = 256 * 2**20):
        self.url, self.key, self.group, self.maxlen = url, f"{prefix}:replay", group, maxlen
        self.max_bytes = max_bytes  # the stream's payload bytes are kept near this (`_bound`)
        self._mean_bytes = 0.0  # running mean payload size (writer thread)
        # Writer and stats: short timeouts and no client-side retries (the writer backs off).
        self._fast = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5,
                                          retry=Retry(NoBackoff(), 0), decode_responses=False)
        # Learner side: blocking reads may take as long as they ask for.
        self._reader = redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_keepalive=True,
                                            decode_responses=False)
        self._queue: queue.Queue[bytes] = queue.Queue(maxsize=queue_size)
        self._cond = threading.Condition()  # guards the counters below
        self._enqueued = self._settled = self._written = self._dropped = 0
        self._group_ready = False
        self._healthy = True
        self._sizes: tuple[int, int, int | None] = (-1, -1, None)  # depth, pending, memory (writer thread)
        self._sizes_at = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specloop-buffer-writer", daemon=True)
        self._thread.start()

    # -- serving side

    def append(self, payload: bytes) -> bool:
        if self._stop.is_set():
            return self._count_dropped(1, queued=False)
        try:
            with self._cond:
                self._queue.put_nowait(payload)
                self._enqueued += 1
            return True
        except queue.Full:
            return self._count_dropped(1, queued=False)

    def flush(self, timeout: float = 5.0) -> bool:
        with self._cond:
            target = self._enqueued
            return self._cond.wait_for(lambda: self._settled >= target, timeout=timeout)

    # -- learner side

    def read(self, consumer: str, count: int, block_ms: int = 0) -> list[BufferEntry]:
        block = block_ms if block_ms > 0 else None
        reply = self._with_group(lambda: self._reader.xreadgroup(
            self.group, consumer, {self.key: ">"}, count=count, block=block))
        return [e for _, entries in (reply or []) for e in _entries(entries)]

    def ack(self, ids: list[str]) -> int:
        return int(self._reader.xack(self.key, self.group, *ids)) if ids else 0

    def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[BufferEntry]:
        out: list[BufferEntry] = []
        start = "0-0"
        while len(out) < count:
            reply = self._with_group(lambda: self._reader.xautoclaim(
                self.key, self.group, consumer, min_idle_ms, start, count=count - len(out)))
            # Redis >= 7 replies [cursor, entries, deleted ids]; 6.2 has no third element.
            start, claimed = _str(reply[0]), _entries(reply[1])
            out.extend(claimed)
            if start == "0-0":
                break
        return out

    def stats(self) -> BufferStats:
        sizes = self._read_sizes()
        with self._cond:
            return BufferStats("redis", self._written, self._dropped, *sizes)

    def cached_stats(self) -> BufferStats:
        with self._cond:
            return BufferStats("redis", self._written, self._dropped, *self._sizes)

    def _read_sizes(self) -> tuple[int, int, int | None]:
        """(depth, pending, memory) of the stream now; -1 / None for what could not be read."""
        depth, pending, memory = -1, -1, None
        try:
            depth = int(self._fast.xlen(self.key))
            memory = self._fast.memory_usage(self.key)
            pending = self._pending_count()
        except redis.RedisError:
            pass
        return depth, pending, memory

    def _refresh_sizes(self) -> None:
        if time.monotonic() - self._sizes_at < self.SIZES_EVERY_S:
            return
        sizes = self._read_sizes() if self._healthy else (-1, -1, None)
        with self._cond:
            self._sizes, self._sizes_at = sizes, time.monotonic()

    def close(self) -> None:
        if not self._stop.is_set():
            self.flush(timeout=1.0)
            self._stop.set()
            self._thread.join(timeout=2.0)
        self._fast.close()
        self._reader.close()

    # -- internals

    def _pending_count(self) -> int:
        try:
            return int(self._fast.xpending(self.key, self.group)["pending"])
        except redis.ResponseError:  # no stream or no group yet: nothing delivered
            return 0

    def _with_group(self, command):
        """Run a group command, creating the group (and stream) when it is missing."""
        if not self._group_ready:
            self._create_group()
        try:
            return command()
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._create_group()  # e.g. Redis restarted without persistence
            return command()

    def _create_group(self) -> None:
        try:
            self._reader.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    def _count_dropped(self, n: int, queued: bool) -> bool:
        with self._cond:
            self._dropped += n
            if queued:
                self._settled += n
                self._cond.notify_all()
        return False

    def _run(self) -> None:
        backoff = self.BACKOFF_MIN
        while not (self._stop.is_set() and self._queue.empty()):
            self._refresh_sizes()
            batch = self._take_batch()
            if not batch:
                continue
            if self._write(batch):
                backoff = self.BACKOFF_MIN
            else:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.BACKOFF_MAX)

    def _take_batch(self) -> list[bytes]:
        try:
            batch = [self._queue.get(timeout=0.1)]
        except queue.Empty:
            return []
        while len(batch) < self.BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _write(self, batch: list[bytes]) -> bool:
        try:
            maxlen = self._bound(batch)
            pipe = self._fast.pipeline(transaction=False)
            for payload in batch:
                pipe.xadd(self.key, {FIELD: payload}, maxlen=maxlen, approximate=True)
            pipe.execute()
        except Exception as e:  # noqa: BLE001 - the writer thread must survive anything
            self._on_failure(batch, e)
            return False
        with self._cond:
            self._written += len(batch)
            self._settled += len(batch)
            self._cond.notify_all()
        self._set_healthy(True, None)
        return True

    def _bound(self, batch: list[bytes]) -> int:
        """Entries kept: `maxlen`, or fewer where that many payloads of the running mean size would
        hold more than `max_bytes` (a Redis that fills its memory refuses registry writes too)."""
        size = sum(map(len, batch)) / len(batch)
        self._mean_bytes = size if not self._mean_bytes else 0.9 * self._mean_bytes + 0.1 * size
        return min(self.maxlen, max(MIN_ENTRIES, int(self.max_bytes / self._mean_bytes)))

    def _on_failure(self, batch: list[bytes], error: Exception) -> None:
        """Drop the batch and everything queued behind it: Redis is not taking writes now."""
        n = len(batch)
        while True:
            try:
                self._queue.get_nowait()
                n += 1
            except queue.Empty:
                break
        self._count_dropped(n, queued=True)
        self._set_healthy(False, error)

    def _set_healthy(self, healthy: bool, error: Exception | None) -> None:
        if healthy == self._healthy:
            return
        self._healthy = healthy
        if healthy:
            log.info("replay buffer: Redis at %s is back; writing to %s again", self.url, self.key)
        else:
            log.warning("replay buffer: Redis at %s unreachable (%s); dropping records until it "
                        "returns", self.url, error)


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entries(raw) -> list[BufferEntry]:
    """(id, {b"r": payload}) pairs -> entries; skips entries whose payload was trimmed."""
    return [BufferEntry(_str(i), fields[FIELD]) for i, fields in raw or []
            if i is not None and fields and FIELD in fields]
