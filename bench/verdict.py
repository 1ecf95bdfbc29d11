"""Benchmark: a sampled step's verdict in situ, the compiled call (`rejection.compiled_verdict`) against warp + the ops
it replaces, in one process, the arms alternating round by round.

The fetched pair as served by default (its eagle head with suffix decoding, k auto), held-out chat and code prompts,
at batch 1 and 8, T = 0.7 and 1. The time of `speculative.accept` (the verdict: warp, accept tests, residual, draws)
per step, split into plain steps and drafting steps, medians over a run; tokens/s of the same runs beside it (this VM's
noise: not the figure). The "ops" arm turns the compiled call off (it returns None: its caller's fallback).

    .venv/bin/python bench/verdict.py --rounds 3 --out verdict
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "prompts"
CONDITIONS = ((1, 0.7), (1, 1.0), (8, 0.7), (8, 1.0))  # (batch, temperature)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts of each set (chat, code): the sets' last")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="verdict", help="bench/results/<out>.json and .png")
    args = ap.parse_args()
    import torch

    from bench.machine import machine_info
    from bench.whole_process import PAIR
    from specloop.drafter.decode import rejection, speculative
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.decode.engine import generate
    from specloop.drafter.decode.requests import StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.kinds.table import build_drafter, default_speculators
    from specloop.drafter.model.loading import load_model
    from specloop.services.prompts import encode, load_prompts

    torch.set_num_threads(args.threads)
    verifier = load_model(PAIR / "verifier", weights="auto")
    drafter = build_drafter("eagle", verifier, PAIR / "drafter", "fp32", default_speculators("eagle"))
    prompts = [encode(verifier.tokenizer, r) for name in ("chat_dev.jsonl", "code_dev.jsonl")
               for r in load_prompts(SHARED / name)[-args.prompts:]]  # chat messages templated, code as text
    rule = StopRule(verifier.eos_ids)
    compiled = rejection.compiled_verdict
    accept, times = speculative.accept, []

    def timed_accept(block, *a, **k):
        t = time.perf_counter()
        out = accept(block, *a, **k)
        times.append((block.k, time.perf_counter() - t))
        return out

    speculative.accept = timed_accept

    def run(arm: str, batch: int, temperature: float) -> dict:
        on = arm == "compiled"
        speculative.compiled_verdict = compiled if on else (lambda *a, **k: None)
        times.clear()
        tokens, start, controller = 0, time.perf_counter(), Controller()
        for lo in range(0, len(prompts), batch):
            gens = generate(verifier.lean, drafter, prompts[lo : lo + batch],
                            SamplingParams(temperature, max_tokens=args.max_tokens, seed=lo), None, rule,
                            first_request=lo, controller=controller)
            tokens += sum(len(g.token_ids) for g in gens)
        plain = [s for k, s in times if k == 0]
        drafting = [s for k, s in times if k > 0]
        return {"tok_s": tokens / (time.perf_counter() - start), "plain_steps": len(plain),
                "drafting_steps": len(drafting),
                "plain_us": statistics.median(plain) * 1e6 if plain else None,
                "drafting_us": statistics.median(drafting) * 1e6 if drafting else None}

    run("compiled", 1, 1.0)  # warm both paths' first calls
    run("ops", 1, 1.0)
    rows = []
    for r in range(args.rounds):
        for arm in ("ops", "compiled") if r % 2 == 0 else ("compiled", "ops"):
            for batch, temperature in CONDITIONS:
                got = run(arm, batch, temperature)
                rows.append({"round": r, "arm": arm, "batch": batch, "temperature": temperature, **got})
                print(r, arm, f"B{batch} T{temperature:g}", {k: round(v, 1) if isinstance(v, float) else v
                                                           for k, v in got.items()}, flush=True)
    summary: dict = {"machine": machine_info(), "threads": args.threads, "rounds": rows, "conditions": {}}
    for batch, temperature in CONDITIONS:
        name = f"B{batch} T{temperature:g}"
        cell = {}
        for arm in ("ops", "compiled"):
            mine = [x for x in rows if x["arm"] == arm and x["batch"] == batch and x["temperature"] == temperature]
            for key in ("plain_us", "drafting_us", "tok_s", "drafting_steps", "plain_steps"):
                vals = [x[key] for x in mine if x[key] is not None]
                cell[f"{arm}_{key}"] = statistics.median(vals) if vals else None
        summary["conditions"][name] = cell
        print(name, {k: round(v, 1) if isinstance(v, float) else v for k, v in cell.items()})
    out = ROOT / "bench" / "results" / args.out
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(summary, out.with_suffix(".png"))


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["conditions"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, title in zip(axes, ("plain_us", "drafting_us"), ("plain steps", "drafting steps")):
        for i, arm in enumerate(("ops", "compiled")):
            ax.bar([j + 0.4 * i for j in range(len(names))],
                   [summary["conditions"][n][f"{arm}_{key}"] or 0 for n in names], 0.4, label=arm)
        ax.set_xticks([j + 0.2 for j in range(len(names))], names)
        ax.set_ylabel("verdict µs a step (median)")
        ax.set_title(f"fetched pair, served default: {title}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
