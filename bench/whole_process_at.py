"""Benchmark: whole `specloop generate` processes of an earlier revision against this tree, as users measure them.

The revision is checked out into a temporary git worktree and run from it (its own code and kernels, not the
editable install: `run_at`), this tree from here; each runs the verifier alone (`--no-speculation`) and the
served default, every process with --threads given, the four taking turns (order reversed every round) on the
held-out prompts of each set (bench/whole_process.py's `held_out`). Tokens/s = new tokens / the process's wall
time (start-up, model load, prefill, decode), beside the in-process figure each process prints; ratios after /
before per round, then the median. Also checks that every process's tokens equal this tree's verifier alone (at
--temperature > 0: the verifier alone's of both trees, same seed; the default's differ wherever it drafted).

    .venv/bin/python bench/whole_process_at.py 2aca0ba --rounds 3 --out whole_process_region
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.whole_process import PAIR, SHARED, SUMMARY, held_out  # noqa: E402

SYSTEMS = {"alone": ["--no-speculation"], "default": []}
TAU = re.compile(r"τ=([\d.]+)")
SETS = ("chat_dev", "code_dev")
# run a checkout's CLI, not the editable install's (whose finder would answer `import specloop` first)
RUN_AT = ("import sys; root = sys.argv[1]; sys.meta_path = [f for f in sys.meta_path if 'editable' not in "
          "type(f).__module__]; sys.path.insert(0, root); import specloop; assert specloop.__file__.startswith(root); "
          "from specloop.services.cli.main import main; sys.argv = ['specloop', *sys.argv[2:]]; sys.exit(main())")


def run(root: Path, system: str, prompts: Path, args) -> dict:
    cmd = [sys.executable, "-c", RUN_AT, str(root), "generate", str(args.pair / "verifier"), "--drafter",
           str(args.pair / "drafter"), "--prompts", str(prompts), "--threads", str(args.threads), "--max-tokens",
           str(args.max_tokens), "--temperature", str(args.temperature), "--seed", "0", "--json", *SYSTEMS[system]]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    found = SUMMARY.search(done.stderr)
    assert found, done.stderr[-500:]
    ids = [json.loads(line)["token_ids"] for line in done.stdout.splitlines() if line.startswith("{")]
    tau = TAU.search(done.stderr)  # the run's block efficiency (1.0: nothing drafted was accepted)
    return {"wall_s": wall, "tokens": int(found.group(2)), "whole_tps": int(found.group(2)) / wall,
            "inproc_tps": float(found.group(4)), "tau": float(tau.group(1)) if tau else None, "ids": ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the earlier revision (git)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-set", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pair", type=Path, default=PAIR, help="a fetched pair: verifier/ and drafter/")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sets", default=",".join(SETS), help="prompt sets of ../shared/prompts (their last prompts)")
    ap.add_argument("--out", default="whole_process_at")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "-q", str(old), args.rev], check=True)
        try:
            rows = measure({"before": old, "after": ROOT}, Path(tmp), args)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=True)
    report(rows, args)


def measure(builds: dict[str, Path], tmp: Path, args) -> list[dict]:
    sets = {name: held_out(SHARED / f"{name}.jsonl", args.prompts_per_set, tmp / f"{name}.jsonl")
            for name in args.sets.split(",")}
    for root in builds.values():  # each checkout builds its kernels once, outside the timing
        run(root, "alone", sets[SETS[0]], args)
    rows = []
    for r in range(args.rounds):
        for name, prompts in sets.items():
            order = [(b, s) for b in builds for s in SYSTEMS]
            out = {key: run(builds[key[0]], key[1], prompts, args) for key in (order if r % 2 == 0 else order[::-1])}
            reference = out[("after", "alone")]["ids"]
            compared = [o for (_, s), o in out.items() if not args.temperature or s == "alone"]
            rows.append({"round": r, "set": name, "identical": all(o["ids"] == reference for o in compared),
                         **{f"{b}/{s}": {k: v for k, v in o.items() if k != "ids"} for (b, s), o in out.items()}})
            print(f"round {r} {name}: " + "  ".join(f"{b}/{s} {o['whole_tps']:.1f} (τ {o['tau']})"
                                                     for (b, s), o in out.items())
                  + f"  identical {rows[-1]['identical']}", flush=True)
    return rows


def report(rows: list[dict], args) -> None:
    from bench.machine import machine_info

    summary = {}
    for name in args.sets.split(","):
        mine = [x for x in rows if x["set"] == name]
        for s in SYSTEMS:
            med = lambda b, k: statistics.median(x[f"{b}/{s}"][k] for x in mine)  # noqa: E731
            summary[f"{name} {s}"] = {
                "whole_tps": {b: med(b, "whole_tps") for b in ("before", "after")},
                "inproc_tps": {b: med(b, "inproc_tps") for b in ("before", "after")},
                "after_over_before_whole": statistics.median(x[f"after/{s}"]["whole_tps"] / x[f"before/{s}"]["whole_tps"]
                                                             for x in mine)}
            row = summary[f"{name} {s}"]
            print(f"{name} {s}: whole {row['whole_tps']['before']:.1f} -> {row['whole_tps']['after']:.1f} "
                  f"(x{row['after_over_before_whole']:.3f}), in-process {row['inproc_tps']['before']:.1f} -> "
                  f"{row['inproc_tps']['after']:.1f}")
    result = {"benchmark": "whole_process_at", "machine": machine_info() | {"threads": args.threads},
              "settings": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
              "identical_rounds": sum(x["identical"] for x in rows), "rounds": rows}
    out = ROOT / "bench" / "results"
    (out / f"{args.out}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(summary, out / f"{args.out}.png", args.rev)
    print(f"wrote {out / args.out}.json and .png")


def plot(summary: dict, path: Path, rev: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (b, kind) in enumerate([(b, k) for b in ("before", "after") for k in ("whole_tps", "inproc_tps")]):
        ax.bar([j + i * 0.2 for j in range(len(names))], [summary[n][kind][b] for n in names], 0.2,
               label=f"{b if b == 'after' else rev} {'whole process' if kind == 'whole_tps' else 'in-process'}")
    ax.set_xticks([j + 0.3 for j in range(len(names))], names)
    ax.set_ylabel("tokens/s (median of rounds)")
    ax.set_title("specloop generate, whole processes: before / after")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
