"""`specloop demo`, the main job on embedded defaults: start `specloop serve` (Ray workers, learner,
registry, HTTP API), send real chat requests through the OpenAI-compatible API, print the answers and
the acceptance statistics, and stop the server cleanly."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.prompts import load_prompts
from services.serve import default_registry

READY_TIMEOUT_S = 300.0


@dataclass
class DemoConfig:
    verifier: Path
    drafter: Path
    prompts: Path
    registry: Path  # root: one registry per model pair below it
    max_tokens: int = 64
    temperature: float = 0.0
    k: int = 4
    clients: int = 4  # concurrent requests (they share the worker's continuous batch)
    threads: int = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cfg: DemoConfig, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", "--threads", str(cfg.threads), "serve", "--port", str(port),
           "--verifier", str(cfg.verifier), "--drafter", str(cfg.drafter), "--registry",
           str(default_registry(cfg.registry, cfg.verifier, cfg.drafter, "pretrained"))]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"specloop serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"specloop serve was not ready after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGINT (what Ctrl-C sends): the server stops its actors and Ray, then exits."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def chat(url: str, model: str, messages: list[dict], cfg: DemoConfig) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "speculative": {"enabled": True, "k": cfg.k}}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()


def as_messages(record) -> list[dict]:
    return list(record.messages) if record.messages else [{"role": "user", "content": record.prompt}]


def summary(replies: list[dict], seconds: float, k: int) -> str:
    usage = [r["usage"] for r in replies]
    tokens = sum(u["completion_tokens"] for u in usage)
    drafted = sum(u["drafted_tokens"] for u in usage)
    accepted = sum(u["accepted_tokens"] for u in usage)
    blocks = drafted // k  # every request drafted k per block
    versions = sorted({u["drafter_version"] for u in usage})
    alpha = accepted / drafted if drafted else 0.0
    tau = 1 + accepted / blocks if blocks else 0.0
    return (f"{len(replies)} chat requests, {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tokens/s; "
            f"drafted {drafted}, accepted {accepted}: α={alpha:.3f}, τ={tau:.3f}; drafter version(s) {', '.join(versions)}")


def run_demo(cfg: DemoConfig) -> int:
    records = load_prompts(cfg.prompts)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env_note = os.environ.get("SPECLOOP_REDIS_URL", "auto")
    print(f"starting specloop serve on {url} (Redis: {env_note}) ...", file=sys.stderr)
    proc = start_server(cfg, port)
    try:
        wait_ready(url, proc)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(cfg.clients) as pool:
            replies = list(pool.map(lambda r: chat(url, model, as_messages(r), cfg), records))
        seconds = time.perf_counter() - t0
        for record, reply in zip(records, replies):
            u = reply["usage"]
            print(f"── {record.id}  ({u['completion_tokens']} tokens, accepted {u['accepted_tokens']}/{u['drafted_tokens']} drafts)")
            print(reply["choices"][0]["message"]["content"])
        print(summary(replies, seconds, cfg.k), file=sys.stderr)
    finally:
        code = stop_server(proc)
        print(f"specloop serve stopped (exit code {code})", file=sys.stderr)
    return 0
