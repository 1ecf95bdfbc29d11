"""Benchmark: what a `specloop` process costs before it decodes, as users meet it (whole processes).

Each command runs as its own process, one token of one short prompt where it generates, so its wall time is
start-up: imports, the model's load and conversion, the drafter's, the tokenizer. Per process: wall seconds and
peak resident memory (the child's own rusage); for `serve`, the seconds from its start to the first 200 of /ready. Checkouts named by --revisions (git revisions, `.` = this working
tree) run from worktrees of this repository (as the working directory and PYTHONPATH: its `specloop` is imported),
after one untimed run each, alternating round by round (checkouts and commands); medians over rounds. Every process gets --threads explicitly.

--graph: the graph backend's start-up instead (the GPU worker's path: bf16 weights, the static step compiled by
torch.compile and, on CUDA, captured; prompts prefilled in captured chunks), `generate` of 8 tokens with the served
default drafter: "cold" with an empty inductor / Triton cache of its own (a bare machine), "warm" on a cache the
untimed run filled (a restarted worker). On a CPU the backend is forced (SPECLOOP_BACKEND=graph), so this measures
what compiling the step costs, not what a CPU user runs.

    .venv/bin/python bench/startup.py --revisions HEAD~1,. --rounds 3 --out bench/results/startup.json
    .venv/bin/python bench/startup.py --graph --revisions HEAD~1,. --rounds 2 --out bench/results/startup_graph.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.whole_process import PAIR  # noqa: E402  (`specloop models fetch`'s pair)

SERVE = "serve (to /ready)"


GRAPH_ENV = {"SPECLOOP_BACKEND": "graph", "SPECLOOP_PREFILL": "graph"}  # --graph: the GPU worker's path, forced
COLD, WARM = "generate (graph, cold cache)", "generate (graph, warm cache)"


def commands(pair: Path, prompts: Path, threads: int, graph: bool = False) -> dict[str, list[str]]:
    one = ["generate", str(pair / "verifier"), "--drafter", str(pair / "drafter"), "--prompts", str(prompts),
           "--max-tokens", "1", "--json"]
    if graph:
        eight = [*one[:-3], "--max-tokens", "8", "--json", "--weights", "bf16", "--drafter-weights", "bf16"]
        return {COLD: ["--threads", str(threads), *eight], WARM: ["--threads", str(threads), *eight]}
    return {"--help": ["--help"], "generate --no-speculation": ["--threads", str(threads), *one, "--no-speculation"],
            "generate (default)": ["--threads", str(threads), *one],
            SERVE: [str(pair / "verifier"), "--drafter", str(pair / "drafter"), "--learner", "off"]}


def measure(checkout: Path, name: str, args: list[str], threads: int, warm_cache: Path | None = None) -> dict:
    """One timed process of command `name` from `checkout`; `warm_cache` (--graph): the graph backend, compiling into
    that cache (the checkout's own, kept across its runs), or into a fresh one for the cold command."""
    if name == SERVE:
        return serve_ready(checkout, args, threads)
    if warm_cache is None:
        return run(checkout, args)
    cache = Path(tempfile.mkdtemp(prefix="specloop-inductor-")) if name == COLD else warm_cache
    try:
        return run(checkout, args, dict(GRAPH_ENV, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton")))
    finally:
        if cache != warm_cache:
            shutil.rmtree(cache, ignore_errors=True)


def serve_ready(checkout: Path, flags: list[str], threads: int) -> dict:
    """`specloop serve FLAGS` from `checkout` (its Ray actors too: PYTHONPATH is inherited), timed from its start to
    the first 200 of /ready (Ray, the worker's load and warm-up, the API), then stopped (SIGINT) and its registry's
    Redis keys dropped. Peak RSS: not counted (the actors are not its children)."""
    from specloop.services.cli.launch import ServeProcess

    registry = Path(tempfile.mkdtemp(prefix="specloop-startup-registry-"))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(checkout)
    try:
        server = ServeProcess(flags, threads=threads, registry=registry, cwd=checkout, log=registry / "serve.log")
        start = time.perf_counter()
        server.start()
        ready = time.perf_counter() - start
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    server.stop()
    server.forget_redis_keys()
    return {"wall_s": ready, "peak_rss_mb": None}


def run(checkout: Path, args: list[str], extra: dict[str, str] | None = None) -> dict:
    """One process: wall seconds and peak RSS (MB) of `python -m specloop ARGS` run from `checkout` (`extra`: more
    environment)."""
    env = dict(os.environ, PYTHONPATH=str(checkout), **(extra or {}))
    start = time.perf_counter()
    # cwd: `python -m` puts the working directory first on sys.path, before PYTHONPATH
    proc = subprocess.Popen([sys.executable, "-m", "specloop", *args], env=env, cwd=checkout,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: specloop {' '.join(args)} exited {proc.returncode}:\n{err[-2000:]}")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def median_or_none(values: list) -> float | None:
    return None if None in values else statistics.median(values)


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MB"


def checkouts(revisions: list[str], into: Path) -> dict[str, Path]:
    """Each revision's tree: this working tree for `.`, else a detached worktree under `into`."""
    trees = {}
    for rev in revisions:
        if rev == ".":
            trees[rev] = ROOT
            continue
        tree = into / rev.replace("/", "_").replace("~", "-")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), rev], check=True,
                       capture_output=True)
        trees[rev] = tree
    return trees


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revisions", default=".", help="comma-separated git revisions; . = this working tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pair", type=Path, default=PAIR, help="a fetched pair: verifier/ and drafter/")
    ap.add_argument("--graph", action="store_true", help="the graph backend's start-up, cold and warm compile caches")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "startup.json")
    args = ap.parse_args()
    from bench.machine import machine_info

    tmp = Path(tempfile.mkdtemp(prefix="specloop-startup-"))
    prompts = tmp / "one.jsonl"
    prompts.write_text(json.dumps({"id": "one", "prompt": "Hello"}) + "\n")
    revisions = [r.strip() for r in args.revisions.split(",") if r.strip()]
    trees = checkouts(revisions, tmp)
    runs: dict[str, dict[str, list[dict]]] = {rev: {} for rev in revisions}
    cmds = commands(args.pair, prompts, args.threads, args.graph)
    first = WARM if args.graph else "generate (default)"
    caches = {rev: tmp / f"inductor-{i}" if args.graph else None for i, rev in enumerate(revisions)}
    try:
        for rev in revisions:  # untimed: a checkout's first run builds its CPU kernels (~40 s, once per tree)
            measure(trees[rev], first, cmds[first], args.threads, caches[rev])  # --graph: and fills its warm cache
        for r in range(args.rounds):
            order = revisions if r % 2 == 0 else list(reversed(revisions))
            for name, cmd in (cmds.items() if r % 2 == 0 else reversed(cmds.items())):
                for rev in order:
                    got = measure(trees[rev], name, cmd, args.threads, caches[rev])
                    runs[rev].setdefault(name, []).append(got)
                    print(f"round {r + 1} {rev:>10} {name:28} {got['wall_s']:.2f} s  {mb(got['peak_rss_mb'])}", flush=True)
    finally:
        for rev, tree in trees.items():
            if tree != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    medians = {rev: {name: {"wall_s": statistics.median(g["wall_s"] for g in got),
                            "peak_rss_mb": median_or_none([g["peak_rss_mb"] for g in got])}
                     for name, got in per.items()} for rev, per in runs.items()}
    for rev, per in medians.items():
        for name, m in per.items():
            print(f"== {rev:>10} {name:28} median {m['wall_s']:.2f} s, {mb(m['peak_rss_mb'])}")
    commits = {rev: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD" if rev == "." else rev],
                                   capture_output=True, text=True).stdout.strip() for rev in revisions}
    out = {"machine": machine_info(), "threads": args.threads, "rounds": args.rounds, "commits": commits,
           "graph": args.graph, "env": GRAPH_ENV if args.graph else {},
           "runs": runs, "medians": medians}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    plot({("this tree " + commits[rev] if rev == "." else rev): per for rev, per in medians.items()},
         args.out.with_suffix(".png"))
    print(f"wrote {args.out} and .png")


def plot(medians: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    names = list(next(iter(medians.values())))
    width = 0.8 / len(medians)
    for i, (rev, per) in enumerate(medians.items()):
        xs = [j + (i - (len(medians) - 1) / 2) * width for j in range(len(names))]
        axes[0].bar(xs, [per[n]["wall_s"] for n in names], width, label=rev)
        axes[1].bar(xs, [per[n]["peak_rss_mb"] or 0 for n in names], width, label=rev)
    for ax, label in zip(axes, ("wall seconds (median)", "peak RSS, MB (median)")):
        ax.set_xticks(range(len(names)), names, rotation=10, fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
