"""Hostile requests against a real `specloop serve` (the fetched pair, --learner off, one worker):
for each, how long its refusal takes and the largest gap between two chunks of a stream being
served beside it (issue: hardening, second round; targets: a 4xx within 1 s, a gap ≤ 0.5 s).

Each hostile request is sent while a stream (greedy, 128 tokens, speculation off) is under way;
the same stream alone, before and after, is the control. Whole processes: the server and this
client are separate processes, as a user runs them.

    .venv/bin/python bench/hostile.py --rounds 3

Writes bench/results/hostile.json and hostile.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import machine_info  # noqa: E402

OUT = ROOT / "bench" / "results"
EMPTY = {"role": "user", "content": ""}


def cases(model: str) -> dict[str, tuple[str, bytes]]:
    """name -> (path, raw body)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def body(path: str, value: dict) -> tuple[str, bytes]:
        return path, json.dumps(value).encode()

    return {
        "250,000 empty messages (7.5 MB)": body("/v1/chat/completions", chat | {"messages": [EMPTY] * 250_000}),
        "250,000 messages to /tokenize": body("/tokenize", {"messages": [EMPTY] * 250_000}),
        "a 6 MB prompt": body("/v1/completions", {"model": model, "prompt": "def f(x):\n    return x\n" * 250_000}),
        "a 100,000-character stop string": body("/v1/chat/completions", chat | {"stop": "x" * 100_000}),
        "a 5,000-digit seed": ("/v1/chat/completions",
                               json.dumps(chat)[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}"),
        "1,000,000 token ids to /detokenize": body("/detokenize", {"tokens": [0] * 1_000_000}),
        "JSON nested 100,000 deep": ("/v1/completions", b"[" * 100_000),
        "a body over 8 MiB": body("/v1/completions", {"model": model, "prompt": "x" * (9 * 2**20)}),
        "an unknown drafter version": body("/v1/chat/completions", chat | {"speculative": {"drafter_version": "v9999"}}),
    }


def stream_gaps(url: str, model: str, started: threading.Event, out: list[float]) -> None:
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 128,
            "temperature": 0, "stream": True, "speculative": {"enabled": False}, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(time.monotonic())
                if len(out) == 3:
                    started.set()
    started.set()


def beside_a_stream(url: str, model: str, hostile: tuple[str, bytes] | None) -> dict:
    arrivals: list[float] = []
    started = threading.Event()
    streamer = threading.Thread(target=stream_gaps, args=(url, model, started, arrivals))
    streamer.start()
    started.wait(60)
    row = {}
    if hostile is not None:
        path, raw = hostile
        t0 = time.monotonic()
        r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
        row = {"status": r.status_code, "seconds": time.monotonic() - t0, "bytes": len(raw)}
    streamer.join(120)
    gaps = [b - a for a, b in zip(arrivals[2:], arrivals[3:])]  # after the stream was under way
    return row | {"max_gap_s": max(gaps), "chunks": len(arrivals)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="serve's torch threads")
    args = p.parse_args(argv)
    from specloop.services.cli.launch import ServeProcess

    server = ServeProcess(["--learner", "off", "--workers", "1"], threads=args.threads).start()
    try:
        named = cases(server.model)
        rows = {name: [] for name in ["(the stream alone)", *named]}
        for _ in range(args.rounds):
            rows["(the stream alone)"].append(beside_a_stream(server.url, server.model, None))
            for name, hostile in named.items():
                rows[name].append(beside_a_stream(server.url, server.model, hostile))
                print(name, rows[name][-1], file=sys.stderr)
    finally:
        server.stop()
    summary = {name: {"status": sorted({r.get("status") for r in rs} - {None}),
                      "seconds_median": statistics.median(r["seconds"] for r in rs) if "seconds" in rs[0] else None,
                      "seconds_max": max(r["seconds"] for r in rs) if "seconds" in rs[0] else None,
                      "max_gap_s_median": statistics.median(r["max_gap_s"] for r in rs),
                      "max_gap_s_max": max(r["max_gap_s"] for r in rs)} for name, rs in rows.items()}
    result = {"machine": machine_info(), "threads": args.threads, "rounds": args.rounds, "rows": rows,
              "summary": summary}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "hostile.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(summary, OUT / "hostile.png")
    print("| request | status | refused in (median / max) | stream's largest gap (median / max) |")
    print("|---|---|---|---|")
    for name, s in summary.items():
        took = "—" if s["seconds_median"] is None else f"{s['seconds_median']:.3f} / {s['seconds_max']:.3f} s"
        print(f"| {name} | {', '.join(map(str, s['status'])) or '—'} | {took} | "
              f"{s['max_gap_s_median']:.3f} / {s['max_gap_s_max']:.3f} s |")
    return 0


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ys = range(len(names))
    ax.barh([y + 0.2 for y in ys], [summary[n]["seconds_max"] or 0 for n in names], 0.4, label="refused in (max, s)")
    ax.barh([y - 0.2 for y in ys], [summary[n]["max_gap_s_max"] for n in names], 0.4,
            label="stream's largest chunk gap (max, s)")
    ax.axvline(0.5, color="grey", ls="--", lw=0.8)
    ax.axvline(1.0, color="grey", ls=":", lw=0.8)
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    ax.set_title("hostile requests beside a stream (specloop serve, whole processes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
