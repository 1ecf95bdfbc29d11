"""Benchmark: a decode step's host time on the CPU, outside the layers and the LM head, this tree against an earlier
revision, in separate processes taking turns.

A step's wall time minus the time of its compiled layer calls (`LeanDecoder.run_layers`) and of its LM head (the
decoder's `linear`): what the interpreter, torch's small ops, sampling and the engine's bookkeeping add to the weights'
streaming. Right after the layers every small op runs cold (~30 µs on 2 cores, a few µs warm), so this part of a step
is larger than its op count suggests (bench/README.md section 48). The fetched pair's verifier alone (w4a8, k = 0),
16 held-out chat prompts, 64 tokens each (ignore_eos), at batch 1 and 8, greedy and T = 1; medians over every step of
a run, then the median of the rounds; tokens/s of the same decode beside it.

    .venv/bin/python bench/host_time.py --at ef20a7f --rounds 3 --out host_time
"""
from __future__ import annotations

import argparse
import json
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT.parent / "shared" / "prompts" / "chat_dev.jsonl"  # the last 16: held out from the fetched drafter
CONDITIONS = ((1, 0.0), (1, 1.0), (8, 0.0), (8, 1.0))  # (batch, temperature)


def measure(threads: int, max_tokens: int, prompt_file: str) -> dict:
    """In this process (its `specloop` imported from sys.path[0]): each condition's median host µs a step, tok/s."""
    import torch

    from bench.specbench import encode_chat
    from bench.whole_process import PAIR
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest, StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.model.loading import load_model

    torch.set_num_threads(threads)
    verifier = load_model(PAIR / "verifier", weights="auto")
    records = [json.loads(line) for line in Path(prompt_file).read_text().splitlines() if line.strip()][-16:]
    prompts = [encode_chat(verifier.tokenizer, r["messages"]) for r in records]
    # this file's sibling, not that tree's bench/ (an earlier revision's may have none): it patches that tree's decoder
    kernel_s = runpy.run_path(str(Path(__file__).with_name("runs.py")))["time_kernels"]()
    capacity = max(len(p) for p in prompts) + max_tokens + 8

    def run(batch: int, temperature: float) -> tuple[float, float]:
        host, tokens, start = [], 0, time.perf_counter()
        for i in range(0, len(prompts), batch):
            engine = Engine(verifier.lean, None, batch, capacity, StopRule(verifier.eos_ids))
            engine.admit([EngineRequest(str(j), p, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                   seed=j, ignore_eos=True), 0)
                          for j, p in enumerate(prompts[i : i + batch])])
            while engine.running:
                kernel_s[0] = 0.0
                t = time.perf_counter()
                tokens += sum(len(u.new_tokens) for u in engine.step())
                host.append(time.perf_counter() - t - kernel_s[0])
        return statistics.median(host) * 1e6, tokens / (time.perf_counter() - start)

    run(1, 1.0)  # warm
    return {f"B{b} T{t:g}": dict(zip(("host_us", "tok_s"), run(b, t))) for b, t in CONDITIONS}


def in_process(root: Path, args) -> dict:
    code = (f"import sys, json; sys.meta_path = [f for f in sys.meta_path if 'editable' not in type(f).__module__]; "
            f"sys.path.insert(0, {str(root)!r}); import specloop, runpy; "
            f"assert specloop.__file__.startswith({str(root)!r}); "
            f"measure = runpy.run_path({str(Path(__file__).resolve())!r})['measure']; "  # this file, that tree's code
            f"print(json.dumps(measure({args.threads}, {args.max_tokens}, {str(PROMPTS)!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["after"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, arm in enumerate(("before", "after")):
        ax.bar([j + 0.4 * i for j in range(len(names))], [summary[arm][n] for n in names], 0.4, label=arm)
    ax.set_xticks([j + 0.2 for j in range(len(names))], names)
    ax.set_ylabel("host µs a step (median)")
    ax.set_title(f"verifier alone, fetched pair: before = {summary['at']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--at", required=True, help="the earlier revision (run from a temporary git worktree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="host_time", help="bench/results/<out>.json and .png")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.machine import machine_info

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.at], check=True,
                       capture_output=True)
        try:
            for r in range(args.rounds):
                for arm in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    got = in_process(old if arm == "before" else ROOT, args)
                    rows.append({"round": r, "arm": arm, **got})
                    print(r, arm, {k: round(v["host_us"]) for k, v in got.items()}, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    names = [f"B{b} T{t:g}" for b, t in CONDITIONS]
    summary: dict = {"at": args.at, "machine": machine_info(), "threads": args.threads, "rounds": rows}
    for arm in ("before", "after"):
        summary[arm] = {n: statistics.median(x[n]["host_us"] for x in rows if x["arm"] == arm) for n in names}
        summary[arm + "_tok_s"] = {n: statistics.median(x[n]["tok_s"] for x in rows if x["arm"] == arm) for n in names}
    summary["tok_s_after_over_before"] = {n: statistics.median(
        a[n]["tok_s"] / b[n]["tok_s"] for a, b in zip([x for x in rows if x["arm"] == "after"],
                                                     [x for x in rows if x["arm"] == "before"])) for n in names}
    out = ROOT / "bench" / "results" / args.out
    out.with_suffix(".json").write_text(json.dumps(summary, separators=(",", ":")) + "\n")
    plot(summary, out.with_suffix(".png"))
    for n in names:
        print(f"{n}: host {summary['before'][n]:.0f} -> {summary['after'][n]:.0f} us a step; tok/s after / before "
              f"{summary['tok_s_after_over_before'][n]:.3f} ({summary['before_tok_s'][n]:.1f} -> "
              f"{summary['after_tok_s'][n]:.1f})")


if __name__ == "__main__":
    main()
