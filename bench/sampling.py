"""Benchmark: sampled decoding (temperature, top-p) as users measure it, one checkout against another.

Each (condition, checkout) runs `specloop generate` on the fetched pair as its own process (start-up, load, prefill
and decode all counted) on the held-out chat prompts; the checkouts (git revisions, `.` = this working tree, run
from worktrees as `bench/startup.py` runs them) alternate round by round. Per process: tokens/s over its wall time
and in-process (its summary line); per round the ratio of each checkout to the first; medians over rounds. Every
process gets --threads explicitly. Conditions: the verifier alone (`--no-speculation`) and the served default, at
T = 1 with and without top-p 0.9 and at T = 1.3.

    .venv/bin/python bench/sampling.py --revisions fcea817,. --rounds 3 --out bench/results/sampling.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.startup import checkouts  # noqa: E402
from bench.whole_process import PAIR, SHARED, SUMMARY, held_out  # noqa: E402

# (name, temperature, top_p, the verifier alone)
CONDITIONS = (("alone, T=1", 1.0, 1.0, True), ("alone, T=1, top_p 0.9", 1.0, 0.9, True),
              ("default, T=1, top_p 0.9", 1.0, 0.9, False), ("alone, T=1.3", 1.3, 1.0, True),
              ("default, T=1.3", 1.3, 1.0, False))


def generate(checkout: Path, prompts: Path, temperature: float, top_p: float, alone: bool, args) -> dict:
    """One `specloop generate` process from `checkout`: wall and in-process tokens/s."""
    cmd = [sys.executable, "-m", "specloop", "--threads", str(args.threads), "generate", str(args.pair / "verifier"),
           "--drafter", str(args.pair / "drafter"), "--prompts", str(prompts), "--max-tokens", str(args.max_tokens),
           "--temperature", str(temperature), "--top-p", str(top_p), "--seed", "0", "--json",
           *(["--no-speculation"] if alone else [])]
    start = time.perf_counter()
    # cwd: `python -m` puts the working directory first on sys.path, before PYTHONPATH
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=checkout,
                          env=dict(os.environ, PYTHONPATH=str(checkout)))
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    found = SUMMARY.search(done.stderr)
    assert found, done.stderr[-2000:]
    tokens = int(found.group(2))
    return {"wall_s": wall, "tokens": tokens, "whole_tps": tokens / wall, "inproc_tps": float(found.group(4))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revisions", default="HEAD~1,.", help="comma-separated git revisions; . = this working tree; "
                    "ratios are to the first")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12, help="held-out chat prompts (the set's last)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pair", type=Path, default=PAIR, help="a fetched pair: verifier/ and drafter/")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sampling.json")
    args = ap.parse_args()
    from bench.machine import machine_info

    tmp = Path(tempfile.mkdtemp(prefix="specloop-sampling-"))
    prompts = held_out(SHARED / "chat_dev.jsonl", args.prompts, tmp / "chat.jsonl")
    revisions = [r.strip() for r in args.revisions.split(",") if r.strip()]
    trees = checkouts(revisions, tmp)
    results = []
    try:
        for rev in revisions:  # untimed: a checkout's first run builds its CPU kernels (~40 s, once per tree)
            generate(trees[rev], prompts, 1.0, 1.0, True, args)
        for name, temperature, top_p, alone in CONDITIONS:
            rounds = []
            for r in range(args.rounds):
                order = revisions if r % 2 == 0 else list(reversed(revisions))
                got = {rev: generate(trees[rev], prompts, temperature, top_p, alone, args) for rev in order}
                rounds.append(got)
                print(f"{name} round {r + 1}: " + "  ".join(
                    f"{rev} {g['whole_tps']:.1f} tok/s whole, {g['inproc_tps']:.1f} in-process ({g['tokens']} tokens)"
                    for rev, g in got.items()), flush=True)
            base = revisions[0]
            summary = {rev: {"whole_tps": statistics.median(g[rev]["whole_tps"] for g in rounds),
                             "inproc_tps": statistics.median(g[rev]["inproc_tps"] for g in rounds),
                             "whole_ratio": statistics.median(g[rev]["whole_tps"] / g[base]["whole_tps"] for g in rounds),
                             "inproc_ratio": statistics.median(g[rev]["inproc_tps"] / g[base]["inproc_tps"]
                                                               for g in rounds)} for rev in revisions}
            results.append({"condition": name, "temperature": temperature, "top_p": top_p, "alone": alone,
                            "rounds": rounds, "medians": summary})
            print(f"== {name}: " + ", ".join(f"{rev} {s['whole_ratio']:.3f}x whole / {s['inproc_ratio']:.3f}x in-process"
                                             for rev, s in summary.items()), flush=True)
    finally:
        for rev, tree in trees.items():
            if tree != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    commits = {rev: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD" if rev == "." else rev],
                                   capture_output=True, text=True).stdout.strip() for rev in revisions}
    out = {"machine": machine_info(), "threads": args.threads, "max_tokens": args.max_tokens, "prompts": args.prompts,
           "rounds": args.rounds, "revisions": revisions, "commits": commits, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    plot(results, revisions, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and .png")


def plot(results: list[dict], revisions: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    names = [r["condition"] for r in results]
    width = 0.8 / len(revisions)
    for i, rev in enumerate(revisions):
        xs = [j + (i - (len(revisions) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [r["medians"][rev]["whole_tps"] for r in results], width, label=f"{rev} (whole process)")
        ax.scatter(xs, [r["medians"][rev]["inproc_tps"] for r in results], color="k", s=12, zorder=3,
                   label="in-process" if i == 0 else None)
    ax.set_xticks(range(len(names)), names, rotation=12, fontsize=8)
    ax.set_ylabel("tokens/s (median of rounds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
