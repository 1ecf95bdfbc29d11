"""Redis for the tests: the shared server on 127.0.0.1:6379 (scripts/redis.sh) and throwaway
`redis-server` processes on free ports that a test can stop and start again."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from specloop.services.cli.launch import free_port  # noqa: F401 - the tests' helpers import it from here

REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_up() -> bool:
    """Whether the shared server at REDIS_URL answers."""
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


needs_redis = pytest.mark.skipif(not redis_up(), reason="no Redis on 127.0.0.1:6379 (scripts/redis.sh)")
needs_redis_server = pytest.mark.skipif(shutil.which("redis-server") is None,
                                        reason="redis-server binary not installed")


def start_redis(port: int, folder: Path) -> subprocess.Popen:
    """A throwaway redis-server on 127.0.0.1:`port` (no persistence), returned once it answers."""
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    for _ in range(100):
        try:
            if client.ping():
                return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")


def stop_redis(proc: subprocess.Popen) -> None:
    """Kill a throwaway server (if it still runs) and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


class ThrowawayRedis:
    """A redis-server on a free port that a test stops (an outage) and starts again (empty) at will."""

    def __init__(self, folder: Path):
        self.port, self.folder, self.proc = free_port(), folder, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = start_redis(self.port, self.folder)

    def stop(self) -> None:
        if self.proc is not None:
            stop_redis(self.proc)
