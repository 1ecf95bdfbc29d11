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

Modules: `specloop.services.buffer.types` (the interface and records), `specloop.services.buffer.memory`,
`specloop.services.buffer.redis_stream` and this one (`open_buffer`, `check_spec`); every name is importable from here.
"""
from __future__ import annotations

from urllib.parse import urlparse

from specloop.services.buffer.memory import MemoryBuffer
from specloop.services.buffer.redis_stream import RedisStreamBuffer, redacted
from specloop.services.buffer.types import ReplayBuffer

ACCEPTED_SPECS = "'memory' or 'redis://[:PASSWORD@]HOST:PORT[/DB]'"


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
        raise ValueError(f"unknown replay buffer spec {redacted(spec)!r}: expected {ACCEPTED_SPECS}")
