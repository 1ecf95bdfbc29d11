"""The replay buffer's interface (`ReplayBuffer`) and records (`BufferEntry`, `BufferStats`), shared
by `buffer.memory` and `buffer.redis_stream` (semantics in `buffer.connect`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol


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
