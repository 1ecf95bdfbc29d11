"""Serving while Redis hangs: `specloop serve --learner klrl` with its registry metadata and replay
buffer in a Redis that is paused (SIGSTOP) for `--pause-s` seconds while `--streams` chats stream.

Reports, per run (paused and, as the reference, not paused): every stream's status and completion,
the largest gap between two chunks of any stream, and the p50 / p99 of chunk gaps. The issue's
target: every stream completes, largest gap <= 2 s with an 8 s pause (10.1-10.8 s before the
registry watcher). Writes bench/results/redis_pause.json and .png.

    .venv/bin/python bench/redis_pause.py [--verifier DIR --drafter DIR] [--pause-s 8] [--streams 12]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_info  # noqa: E402
from specloop.services.cli.launch import ServeProcess  # noqa: E402
from tests.redis_helpers import ThrowawayRedis  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def chat_prompts(path: Path, n: int) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("messages"):
            out.append(record["messages"][0]["content"][:400])
        if len(out) == n:
            break
    return out


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    arrivals, status, error = [], None, None
    t0 = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append(time.monotonic())
                    if '"error"' in line:
                        error = line[:200]
    except httpx.HTTPError as exc:
        error = repr(exc)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]  # between two chunks (the wait for a slot is TTFT)
    return {"status": status, "chunks": len(arrivals), "error": error, "start": t0, "arrivals": arrivals,
            "ttft_s": arrivals[0] - t0 if arrivals else None, "max_gap_s": max(gaps, default=None)}


async def traffic(url: str, model: str, prompts: list[str], max_tokens: int, redis: ThrowawayRedis | None,
                  pause_at_s: float, pause_s: float) -> tuple[list[dict], tuple[float, float] | None]:
    async with httpx.AsyncClient() as client:
        tasks = [asyncio.create_task(stream_one(client, url, model, p, max_tokens)) for p in prompts]
        window = None
        if redis is not None:
            await asyncio.sleep(pause_at_s)
            os.kill(redis.proc.pid, signal.SIGSTOP)
            start = time.monotonic()
            await asyncio.sleep(pause_s)
            os.kill(redis.proc.pid, signal.SIGCONT)
            window = (start, time.monotonic())
        return await asyncio.gather(*tasks), window


def summary(streams: list[dict]) -> dict:
    gaps = sorted(b - a for s in streams for a, b in zip(s["arrivals"], s["arrivals"][1:]))
    pick = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else None  # noqa: E731
    return {"completed": sum(s["status"] == 200 and s["error"] is None and s["chunks"] > 0 for s in streams),
            "streams": len(streams), "largest_gap_s": max((s["max_gap_s"] or 0) for s in streams),
            "largest_ttft_s": max((s["ttft_s"] or 0) for s in streams),
            "gap_p50_s": pick(0.5), "gap_p99_s": pick(0.99), "errors": [s["error"] for s in streams if s["error"]]}


class Serve(ServeProcess):
    """`specloop serve` (specloop.services.cli.launch.ServeProcess) with its registry and replay stream in a
    throwaway Redis of its own, stopped with it."""

    def __init__(self, folder: Path, name: str, flags: list[str]):
        self.redis = ThrowawayRedis(folder / f"redis-{name}")
        self.redis.folder.mkdir()
        self.redis.start()
        os.environ.update(SPECLOOP_REDIS_URL=self.redis.url, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
        super().__init__(["--host", "127.0.0.1", *flags], threads=1, registry=folder / f"registry-{name}",
                         log=folder / f"serve-{name}.log", cwd=ROOT)

    def stop(self, timeout: float = 60.0) -> int | None:
        try:
            return super().stop(timeout)
        finally:
            self.redis.stop()


def run(args, paused: bool, folder: Path) -> dict:
    flags = ["--verifier", args.verifier, "--drafter", args.drafter, "--learner", args.learner,
             "--max-num-seqs", str(args.slots), "--max-queue", str(args.streams)]
    with Serve(folder, "paused" if paused else "steady", flags) as serve:
        model = serve.model
        prompts = chat_prompts(Path(args.prompts), args.streams)
        asyncio.run(traffic(serve.url, model, prompts[:2], 8, None, 0, 0))  # warm-up
        streams, window = asyncio.run(traffic(serve.url, model, prompts, args.max_tokens,
                                              serve.redis if paused else None, args.pause_at_s, args.pause_s))
    t0 = min(s["start"] for s in streams)
    return {"paused": paused, "pause_window_s": None if window is None else [window[0] - t0, window[1] - t0],
            **summary(streams), "arrivals_s": [[a - t0 for a in s["arrivals"]] for s in streams]}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), sharey=True)
    for ax, r in zip(axes, results):
        for i, arrivals in enumerate(r["arrivals_s"]):
            ax.plot(arrivals, [i] * len(arrivals), "|", markersize=6)
        if r["pause_window_s"]:
            ax.axvspan(*r["pause_window_s"], color="red", alpha=0.15, label="Redis paused (SIGSTOP)")
            ax.legend(loc="lower right")
        ax.set_title(f"{'Redis paused' if r['paused'] else 'Redis steady'}: largest chunk gap "
                     f"{r['largest_gap_s']:.2f} s, {r['completed']}/{r['streams']} complete")
        ax.set_xlabel("seconds since the first request")
    axes[0].set_ylabel("stream")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def deployment_arguments(doc: str) -> argparse.ArgumentParser:
    """A parser with the pair and prompts a benchmark's `specloop serve` runs (the reference pair)."""
    shared = ROOT.parent / "shared"
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default=str(shared / "models" / "verifier"))
    p.add_argument("--drafter", default=str(shared / "models" / "drafter"))
    p.add_argument("--prompts", default=str(shared / "prompts" / "chat_dev.jsonl"))
    return p


def main() -> int:
    p = deployment_arguments(__doc__)
    p.add_argument("--learner", default="klrl")
    p.add_argument("--streams", type=int, default=12)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--pause-at-s", type=float, default=1.5)
    p.add_argument("--pause-s", type=float, default=8.0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "redis_pause"))
    args = p.parse_args()
    if shutil.which("redis-server") is None:
        print("redis-server is not installed", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="redis-pause-"))
    results = [run(args, False, folder), run(args, True, folder)]
    out = {"machine": machine_info(), "args": vars(args),
           "runs": [{k: v for k, v in r.items() if k != "arrivals_s"} for r in results]}
    Path(args.out + ".json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    plot(results, Path(args.out + ".png"))
    for r in out["runs"]:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
