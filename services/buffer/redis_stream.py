"""The Redis replay buffer (`RedisStreamBuffer`): a stream `{prefix}:replay` read through a consumer
group, bounded by entries and by bytes; appends go to a bounded local queue that a writer thread
ships in XADD pipelines, dropping (counted) while Redis is unreachable (see `specloop.services.buffer.connect`)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specloop.services.buffer.types import BufferEntry, BufferStats

log = logging.getLogger("specloop.buffer")

FIELD = b"r"  # the stream field that holds the payload
MIN_ENTRIES = 1024  # the byte bound never trims a Redis stream below this many entries
READ_TIMEOUT_S = 30  # the learner's reads fail after this long without an answer


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
        # Learner side: blocking reads may take as long as they ask for (at most READ_TIMEOUT_S - 5 s);
        # a Redis that stops answering fails the read after READ_TIMEOUT_S instead of hanging it.
        self._reader = redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_keepalive=True,
                                            socket_timeout=READ_TIMEOUT_S, decode_responses=False)
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
        block = min(block_ms, 1000 * (READ_TIMEOUT_S - 5)) if block_ms > 0 else None
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
            log.info("replay buffer: Redis at %s is back; writing to %s again", redacted(self.url), self.key)
        else:
            log.warning("replay buffer: Redis at %s unreachable (%s); dropping records until it "
                        "returns", redacted(self.url), error)


def redacted(url: str) -> str:
    """`url` without its password, for logs and errors (redis://:secret@redis:6379/0 ->
    redis://:***@redis:6379/0)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return "<a malformed URL>"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entries(raw) -> list[BufferEntry]:
    """(id, {b"r": payload}) pairs -> entries; skips entries whose payload was trimmed."""
    return [BufferEntry(_str(i), fields[FIELD]) for i, fields in raw or []
            if i is not None and fields and FIELD in fields]
