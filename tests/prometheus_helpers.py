"""A throwaway Prometheus (the Debian package's binary) for tests: a generated config that scrapes
static targets every second and discovers more through HTTP service discovery (an API's
`/sd/targets`), TSDB in a temporary folder, queried through the HTTP API."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from specloop.services.cli.launch import free_port  # noqa: F401 - the tests' helpers import it from here

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")


def scrape_config(static: list[str], sd_urls: list[str], interval: str = "1s") -> str:
    """prometheus.yml: job `static` scrapes `static`, job `discovered` every target of `sd_urls`."""
    lines = ["global:", f"  scrape_interval: {interval}", f"  evaluation_interval: {interval}", "scrape_configs:",
             "  - job_name: static", "    static_configs:", f"      - targets: {static!r}"]
    if sd_urls:
        lines += ["  - job_name: discovered", "    http_sd_configs:"]
        lines += [f"      - url: {url}\n        refresh_interval: 1s" for url in sd_urls]
    return "\n".join(lines).replace("'", '"') + "\n"


class ThrowawayPrometheus:
    """A Prometheus on a free port; `query` evaluates PromQL at the current time."""

    def __init__(self, tmp_path: Path, static: list[str], sd_urls: list[str] = ()):
        self.dir = tmp_path / "prometheus"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "prometheus.yml").write_text(scrape_config(static, list(sd_urls)))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "ThrowawayPrometheus":
        self.log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self._ready, timeout, lambda: f"prometheus not ready: {self.logs()}")
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited {self.proc.returncode}: {self.logs()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def logs(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")[-3000:]

    def api(self, path: str, **params) -> dict | list:
        reply = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = reply.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector (list of {metric, value}) of `expr` now; raises on a PromQL error."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    def wait_for_targets(self, n: int, timeout: float = 30.0) -> list[dict]:
        """Until at least n targets are up (discovered ones included)."""
        def up() -> bool:
            return sum(t["health"] == "up" for t in self.targets()) >= n
        wait_until(up, timeout, lambda: f"targets: {self.targets()}")
        return self.targets()

    def wait_for_samples(self, metric: str, n: int = 3, timeout: float = 30.0) -> None:
        """Until every series of `metric` has at least n samples (range functions need two)."""
        def enough() -> bool:
            result = self.query(f"count_over_time({metric}[1m])")
            return bool(result) and all(float(r["value"][1]) >= n for r in result)
        wait_until(enough, timeout, lambda: f"{metric}: {self.query(f'count_over_time({metric}[1m])')}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.log.close()


def wait_until(condition, timeout: float, message) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s: {message()}")
