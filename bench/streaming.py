"""Streaming stays linear in the output's length: the time between two streamed chunks late in a
2,000-token answer against early in it, through the real API (`specloop serve`, one stream at a
time, `ignore_eos` so that every answer runs to its length, a stop string that never matches so
that the stop check runs at every token), and the two per-token costs that grew with the output
before: the text stream and the stop-string check, each the old way (the whole output decoded
again at every chunk / token) and the new way, on the served model's tokenizer.

Reports, per speculation setting (off, auto): the median gap over chunks 50-100 and over the last
50 chunks, and their ratio. The verifier's attention reads every cached position, so some growth
is the model's own; the per-token costs show what the serving code adds. Writes
bench/results/streaming.json and .png.

    .venv/bin/python bench/streaming.py [--verifier DIR --drafter DIR] [--tokens 2000] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_info  # noqa: E402
from specloop.services.cli.launch import ServeProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STOP = "never appears in any answer"
PROMPT = "Write a long story about a lighthouse keeper."


def stream_gaps(url: str, model: str, tokens: int, spec: dict, headers: dict) -> list[float]:
    """Seconds between consecutive content chunks of one streamed chat answer of `tokens` tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stop": [STOP], "speculative": spec}
    arrivals = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def window_medians(gaps: list[float], early: tuple[int, int] = (50, 100), late: int = 50) -> dict:
    e, last = gaps[early[0]:early[1]], gaps[-late:]
    return {"chunks": len(gaps) + 1, "early_ms": 1e3 * statistics.median(e), "late_ms": 1e3 * statistics.median(last),
            "late_over_early": statistics.median(last) / statistics.median(e)}


def end_to_end(args) -> dict:
    flags = [args.verifier, "--drafter", args.drafter, "--learner", "off", "--max-num-seqs", "1",
             "--max-model-len", str(args.max_context)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp, ServeProcess(flags, threads=args.threads, registry=Path(tmp) / "reg",
                                                            log=Path(tmp) / "serve.log") as server:
        stream_gaps(server.url, server.model, 64, {"enabled": False}, server.headers)  # warm-up
        runs = {"off": [], "auto": []}
        for _ in range(args.repeats):  # alternating the two settings
            for name, spec in (("off", {"enabled": False}), ("auto", {"k": "auto"})):
                runs[name].append(window_medians(stream_gaps(server.url, server.model, args.tokens, spec, server.headers)))
        for name, rows in runs.items():
            out[name] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            out[name]["runs"] = rows
    return out


def per_token_costs(args) -> dict:
    """Microseconds per token of the text stream and the stop check at output lengths 100 and N,
    old (full re-decode) against new, on a real answer-like token sequence."""
    from specloop.drafter.decode.requests import Generation, StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.decode.stats import AcceptanceStats
    from specloop.drafter.model.loading import load_tokenizer
    from specloop.services.worker.detokenize import IncrementalText

    tok = load_tokenizer(args.verifier)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    text = (ROOT / "docs" / "architecture.md").read_text() * 4  # answer-like prose and code, without STOP
    assert STOP not in text
    ids = tok.encode(text, add_special_tokens=False)[: args.tokens]
    params = SamplingParams(max_tokens=10**6, stop=(STOP,))

    def old_stream(upto: int) -> float:  # decode everything pushed so far at every chunk
        t0 = time.perf_counter()
        for n in range(upto - 50, upto):
            decode(ids[:n + 1])
        return (time.perf_counter() - t0) / 50

    def new_stream(upto: int) -> float:
        stream = IncrementalText(decode, (STOP,), tokenizer=tok)
        for t in ids[:upto - 50]:  # token by token, as a stream receives them
            stream.push([t], False)
        t0 = time.perf_counter()
        for n in range(upto - 50, upto):
            stream.push([ids[n]], False)
        return (time.perf_counter() - t0) / 50

    def old_stop(upto: int) -> float:
        t0 = time.perf_counter()
        for n in range(upto - 50, upto):
            any(s in decode(ids[:n + 1]) for s in params.stop)
        return (time.perf_counter() - t0) / 50

    def new_stop(upto: int) -> float:
        rule = StopRule(frozenset(), decode)
        gen = Generation(list(ids[:upto - 50]), None, AcceptanceStats(0))
        t0 = time.perf_counter()
        for n in range(upto - 50, upto):
            rule.extend(gen, [ids[n]], params)
        return (time.perf_counter() - t0) / 50

    out = {}
    for name, fn in (("text_old", old_stream), ("text_new", new_stream), ("stop_old", old_stop), ("stop_new", new_stop)):
        short = statistics.median(fn(100) for _ in range(5))
        long = statistics.median(fn(len(ids)) for _ in range(5))
        out[name] = {"us_at_100": 1e6 * short, f"us_at_{len(ids)}": 1e6 * long, "ratio": long / short}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    e2e = result["end_to_end"]
    names = list(e2e)
    a.bar([f"{n}\nearly" for n in names] + [f"{n}\nlate" for n in names],
          [e2e[n]["early_ms"] for n in names] + [e2e[n]["late_ms"] for n in names])
    a.set_ylabel("median gap between chunks (ms)")
    a.set_title(f"chunks 50-100 vs the last 50 of {result['tokens']} tokens")
    costs = result["per_token"]
    keys = [k for k in next(iter(costs.values())) if k.startswith("us_at_")]
    for i, k in enumerate(keys):
        b.bar([x + 0.4 * i for x in range(len(costs))], [costs[n][k] for n in costs], width=0.4, label=k)
    b.set_xticks([x + 0.2 for x in range(len(costs))], list(costs))
    b.set_yscale("log")
    b.set_ylabel("µs per token")
    b.legend()
    b.set_title("text stream and stop check, old vs new")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    shared = ROOT.parent / "shared"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default=str(shared / "models" / "verifier"))
    p.add_argument("--drafter", default=str(shared / "models" / "drafter"))
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "streaming"))
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result = {"machine": machine_info(), "threads": args.threads, "tokens": args.tokens, "verifier": args.verifier,
              "per_token": per_token_costs(args), "end_to_end": end_to_end(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(result, Path(args.out + ".png"))
    print(json.dumps({k: result[k] for k in ("per_token", "end_to_end")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
