"""Replay buffer: both backends behave like a Redis Streams consumer group; Redis outages never
reach the serving side. Redis tests use the real server on 127.0.0.1:6379 and throwaway ones."""
from __future__ import annotations

import time
from uuid import uuid4

import pytest
import redis

from specloop.services.buffer.connect import open_buffer
from specloop.services.buffer.memory import MemoryBuffer
from specloop.services.buffer.redis_stream import RedisStreamBuffer
from tests.redis_helpers import REDIS_URL, free_port, needs_redis, needs_redis_server


def _payloads(n: int, tag: bytes = b"") -> list[bytes]:
    # every byte value appears, including NUL and non-UTF-8 bytes
    return [tag + bytes([i % 256, 0, 255, 128]) + i.to_bytes(4, "little") + bytes(range(256))
            for i in range(n)]


@pytest.fixture
def redis_buffer_factory():
    """Opens RedisStreamBuffers on unique prefixes and deletes their keys afterwards."""
    opened: list[RedisStreamBuffer] = []

    def make(**kwargs) -> RedisStreamBuffer:
        buf = RedisStreamBuffer(REDIS_URL, prefix=f"test-buffer-{uuid4().hex}", **kwargs)
        opened.append(buf)
        return buf

    yield make
    admin = redis.Redis.from_url(REDIS_URL)
    for buf in opened:
        buf.close()
        admin.delete(buf.key)
    admin.close()


@pytest.fixture(params=["memory", pytest.param("redis", marks=needs_redis)])
def make_buffer(request, redis_buffer_factory):
    if request.param == "memory":
        return lambda maxlen=100_000: MemoryBuffer(maxlen=maxlen)
    return lambda maxlen=100_000: redis_buffer_factory(maxlen=maxlen)


def test_read_returns_appended_payloads_bit_for_bit_in_order(make_buffer):
    buf = make_buffer()
    sent = _payloads(50)
    assert all(buf.append(p) for p in sent)
    assert buf.flush()
    got = buf.read("a", count=100)
    assert [e.payload for e in got] == sent
    ids = [tuple(map(int, e.id.split("-"))) for e in got]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert buf.read("a", count=100) == []
    assert buf.read("b", count=100) == []
    stats = buf.stats()
    assert (stats.written, stats.dropped, stats.depth, stats.pending) == (50, 0, 50, 50)
    assert stats.memory_bytes and stats.memory_bytes > 0


def test_ack_reduces_pending_and_acked_entries_are_never_returned_again(make_buffer):
    buf = make_buffer()
    for p in _payloads(10):
        buf.append(p)
    buf.flush()
    got = buf.read("a", count=10)
    assert buf.ack([e.id for e in got[:4]]) == 4
    assert buf.stats().pending == 6
    assert buf.ack([got[0].id]) == 0
    buf.ack([e.id for e in got[4:]])
    assert buf.stats().pending == 0
    assert buf.read("a", count=10) == []
    time.sleep(0.02)
    assert buf.claim_stale("b", min_idle_ms=0) == []


def test_claim_stale_hands_a_dead_consumers_unacked_entries_to_a_new_consumer(make_buffer):
    buf = make_buffer()
    sent = _payloads(8)
    for p in sent:
        buf.append(p)
    buf.flush()
    got = buf.read("a", count=8)  # consumer "a" dies without acking
    buf.ack([got[0].id])
    assert buf.claim_stale("b", min_idle_ms=60_000) == []  # not idle long enough yet
    time.sleep(0.15)
    claimed = buf.claim_stale("b", min_idle_ms=100)
    assert [e.payload for e in claimed] == sent[1:]
    assert buf.claim_stale("c", min_idle_ms=100) == []  # claiming resets the idle time
    assert buf.ack([e.id for e in claimed]) == 7
    assert buf.stats().pending == 0
    time.sleep(0.02)
    assert buf.claim_stale("c", min_idle_ms=0) == []


def test_claim_stale_with_zero_idle_returns_the_callers_own_pending_entries(make_buffer):
    buf = make_buffer()
    for p in _payloads(3):
        buf.append(p)
    buf.flush()
    got = buf.read("a", count=3)
    assert [e.id for e in buf.claim_stale("a", min_idle_ms=0)] == [e.id for e in got]


def test_blocking_read_waits_for_new_entries(make_buffer):
    buf = make_buffer()
    t0 = time.monotonic()
    assert buf.read("a", count=5, block_ms=200) == []
    assert time.monotonic() - t0 >= 0.15


def test_memory_buffer_keeps_exactly_maxlen_entries(make_buffer):
    buf = MemoryBuffer(maxlen=100)
    sent = _payloads(1000)
    for p in sent:
        buf.append(p)
    assert buf.stats().depth == 100
    assert [e.payload for e in buf.read("a", count=1000)] == sent[-100:]


def test_trimmed_entries_disappear_from_pending_in_memory():
    buf = MemoryBuffer(maxlen=5)
    for p in _payloads(5):
        buf.append(p)
    buf.read("a", count=5)
    for p in _payloads(3, tag=b"new"):
        buf.append(p)
    assert buf.stats().pending == 2
    assert len(buf.claim_stale("b", min_idle_ms=0)) == 2


@needs_redis
def test_redis_stream_stays_near_maxlen(redis_buffer_factory):
    buf = redis_buffer_factory(maxlen=100)
    for p in _payloads(1000):
        buf.append(p)
    assert buf.flush()
    stats = buf.stats()
    assert stats.written == 1000
    assert 100 <= stats.depth < 300


def test_redis_stream_stays_near_its_byte_bound(redis_buffer_factory, monkeypatch):
    import specloop.services.buffer.redis_stream as buffer_redis

    monkeypatch.setattr(buffer_redis, "MIN_ENTRIES", 10)
    buf = redis_buffer_factory(max_bytes=200 * 1024)  # 100 payloads of 2 KiB
    for i in range(2000):
        buf.append(bytes([i % 256]) * 2048)
    assert buf.flush()
    stats = buf.stats()
    assert stats.written == 2000 and 100 <= stats.depth < 300


def test_unreachable_redis_drops_records_without_raising_or_blocking():
    buf = RedisStreamBuffer(f"redis://127.0.0.1:{free_port()}/0", prefix=f"test-buffer-{uuid4().hex}")
    try:
        t0 = time.monotonic()
        results = [buf.append(p) for p in _payloads(1000)]
        assert time.monotonic() - t0 < 2.0
        assert all(results)  # queued; the writer drops them
        assert buf.flush(timeout=10)
        stats = buf.stats()
        assert (stats.written, stats.dropped, stats.depth) == (0, 1000, -1)
    finally:
        buf.close()


def test_a_full_local_queue_drops_and_counts():
    buf = RedisStreamBuffer(f"redis://127.0.0.1:{free_port()}/0", queue_size=10)
    try:
        results = [buf.append(b"x") for _ in range(2000)]
        assert not all(results)
        buf.flush(timeout=10)
        assert buf.stats().dropped == 2000
    finally:
        buf.close()


def _read_until(buf, consumer: str, want: int, seconds: float) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + seconds
    while len(got) < want and time.monotonic() < deadline:
        try:
            got += [e.payload for e in buf.read(consumer, count=1000)]
        except redis.RedisError:
            pass
        time.sleep(0.05)
    return got


@needs_redis_server
def test_writing_resumes_by_itself_when_redis_comes_back(redis_server, caplog):
    caplog.set_level("INFO", logger="specloop.buffer")
    buf = RedisStreamBuffer(redis_server.url, prefix=f"test-buffer-{uuid4().hex}")
    try:
        before = _payloads(20, tag=b"before")
        for p in before:
            assert buf.append(p)
        assert buf.flush()
        assert buf.stats().written == 20
        assert [e.payload for e in buf.read("a", count=100)] == before

        redis_server.stop()
        for p in _payloads(30, tag=b"down"):
            buf.append(p)
        assert buf.flush(timeout=10)
        assert buf.stats().dropped == 30
        assert buf.stats().depth == -1

        redis_server.start()
        after = _payloads(25, tag=b"after")
        for p in after:
            buf.append(p)
        assert _read_until(buf, "a", want=25, seconds=8) == after
        assert buf.stats().written == 45
        messages = [r.getMessage() for r in caplog.records if r.name == "specloop.buffer"]
        assert sum("unreachable" in m for m in messages) == 1
        assert sum("is back" in m for m in messages) == 1
    finally:
        buf.close()


@needs_redis
def test_stats_are_json_friendly_and_name_the_backend(redis_buffer_factory):
    stats = redis_buffer_factory().stats()
    assert stats.to_dict()["backend"] == "redis"
    assert (stats.depth, stats.pending, stats.memory_bytes) == (0, 0, None)
    assert MemoryBuffer().stats().to_dict() == {
        "backend": "memory", "written": 0, "dropped": 0, "depth": 0, "pending": 0, "memory_bytes": 0}


@pytest.mark.parametrize("spec", ["redis:/bad", "kafka://x", "redis://", "redis://host:port",
                                  "redis://localhost:6379/db", ""])
def test_open_buffer_rejects_unknown_specs_naming_what_is_accepted(spec):
    with pytest.raises(ValueError, match=r"'memory' or 'redis://\[:PASSWORD@\]HOST:PORT\[/DB\]'"):
        open_buffer(spec)


def test_a_redis_password_never_appears_in_errors_or_logs():
    from specloop.services.buffer.redis_stream import redacted

    with pytest.raises(ValueError) as refused:
        open_buffer("redis://:s3cret@host:port/0")
    assert "s3cret" not in str(refused.value) and ":***@host" in str(refused.value)
    assert redacted("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted("redis://user:pw@redis:6379") == "redis://user:***@redis:6379"
    assert redacted("redis://redis:6379/0") == "redis://redis:6379/0"


def test_open_buffer_builds_each_backend():
    assert isinstance(open_buffer("memory", maxlen=7), MemoryBuffer)
    buf = open_buffer(f"redis://127.0.0.1:{free_port()}/2", prefix="p")
    try:
        assert isinstance(buf, RedisStreamBuffer) and buf.key == "p:replay"
    finally:
        buf.close()


@needs_redis_server
def test_a_byte_bounded_stream_leaves_a_memory_limited_redis_room_for_the_registry(tmp_path, monkeypatch):
    """Redis at `maxmemory 8mb` (noeviction, as deploy/redis runs it): 24 MB of records stream through
    a buffer bounded to 2 MiB, none is refused, and registry writes still succeed afterwards."""
    import subprocess

    import torch

    import specloop.services.buffer.redis_stream as buffer_redis
    from specloop.services.registry.registry import Registry

    monkeypatch.setattr(buffer_redis, "MIN_ENTRIES", 10)
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--maxmemory", "8mb", "--maxmemory-policy", "noeviction", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    buf = None
    try:
        client = redis.Redis(port=port, socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.05)
        buf = RedisStreamBuffer(url, prefix="bounded", max_bytes=2 * 2**20)
        for i in range(3000):
            buf.append(bytes([i % 256]) * 8192)
            if i % 500 == 499:
                assert buf.flush(timeout=30)
        assert buf.flush(timeout=30)
        stats = buf.stats()
        assert (stats.written, stats.dropped) == (3000, 0) and stats.memory_bytes < 4 * 2**20
        reg = Registry(tmp_path / "registry", url, "bounded")
        version = reg.publish({"w": torch.ones(3)}, parent=None, learner_step=0, objective="kl", loss=None,
                              sim_acceptance=0.5, kind="pretrained").id
        assert reg.promote(version).promoted and reg.champion() == version
    finally:
        if buf is not None:
            buf.close()
        proc.kill()
        proc.wait(10)
