"""`specloop serve` as a child process: start it on a free port, wait until it is ready, stop it with
SIGINT (what Ctrl-C sends: the API, the actors and Ray stop cleanly). The demo, the dashboard test and
the benchmarks all run the real server this way."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

FIRST_PORT = 20000  # below: ports services take by default (Ray's workers 10002-19999, its client 10001, Redis,
                    # Prometheus, the dashboards)


def free_port() -> int:
    """A local TCP port nothing listens on now, below the kernel's range of ephemeral ports where it can: a port of
    that range (what binding port 0 returns) can go to any outgoing connection, Ray's or a Redis client's, before
    the caller's server binds it ("address already in use" in a test, seen once in ~1,750)."""
    low = ephemeral_low()
    if low > FIRST_PORT + 1024:
        for port in random.Random().sample(range(FIRST_PORT, low), 64):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port of the kernel's ephemeral range (Linux; 0 where it cannot be read: port 0 is used then)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class ServeProcess:
    def __init__(self, flags: Sequence[str | Path], threads: int = 2, registry: Path | None = None,
                 log: Path | None = None, cwd: Path | None = None, api_key: str | None = None):
        """flags: `serve`'s own (models, learner, ...); `--port` and `--registry` are added here.
        log: where its output goes (None: this process's stdout/stderr). api_key: the key `/v1` asks for
        (None: SPECLOOP_API_KEY, which the child reads as well; `--api-key` in flags needs it here too)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.registry = None if registry is None else Path(registry).resolve()
        extra = [] if self.registry is None else ["--registry", str(self.registry)]
        self.cmd = [sys.executable, "-m", "specloop", "--threads", str(threads), "serve", "--port", str(self.port),
                    *extra, *map(str, flags)]
        self.log_path, self.cwd = log, cwd
        self.proc: subprocess.Popen | None = None
        self.redis_url: str | None = None
        self.model: str | None = None
        key = api_key if api_key is not None else os.environ.get("SPECLOOP_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def start(self, timeout: float = 300.0) -> "ServeProcess":
        from specloop.services.cli.deployment import detect_redis

        self.redis_url = detect_redis()  # what serve picks by the same rule (for forget_redis_keys)
        out = None if self.log_path is None else open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT if out else None, cwd=self.cwd, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"specloop serve was not ready after {timeout:.0f} s{self._tail()}")
            time.sleep(0.25)
        self.model = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=10).json()["data"][0]["id"]
        return self

    def ready(self) -> bool:
        assert self.proc is not None, "start() first"
        if self.proc.poll() is not None:
            raise RuntimeError(f"specloop serve exited with code {self.proc.returncode}{self._tail()}")
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def logs(self) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_text(errors="replace")[-4000:]

    def _tail(self) -> str:
        logs = self.logs()
        return f":\n{logs}" if logs else ""

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGINT, then SIGKILL to its process group if it has not exited within `timeout`."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def forget_redis_keys(self) -> int:
        """Delete what serve kept in Redis under its registry's prefix (a throwaway run); the count."""
        if self.redis_url is None or self.registry is None:
            return 0
        from specloop.services.registry.meta import forget_namespace, redis_namespace

        return forget_namespace(self.redis_url, redis_namespace(self.registry))

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
