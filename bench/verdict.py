"""Benchmark: a sampled step's verdict in situ, the compiled call (`rejection.compiled_verdict`) against warp + the ops
it replaces, in one process, the arms alternating round by round.

The fetched pair as served by default (its eagle head with suffix decoding, k auto), held-out chat and code prompts,
at batch 1 and 8, T = 0.7 and 1. The time of `speculative.accept` (the verdict: warp, accept tests, residual, draws)
per step, split into plain steps and drafting steps, medians over a run; tokens/s of the same runs beside it (this VM's
noise: not the figure). The "ops" arm turns the compiled call off (it returns None: its caller's fallback).

    .venv/bin/python bench/verdict.py --rounds 3 --out verdict
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.runs import in_situ_args  # noqa: E402

CONDITIONS = ((1, 0.7), (1, 1.0), (8, 0.7), (8, 1.0))  # (batch, temperature)


def main() -> None:
    args = in_situ_args(__doc__, "verdict")
    import torch

    from bench.machine import machine_info
    from bench.runs import held_out_prompts, plot_arms
    from bench.whole_process import PAIR
    from specloop.drafter.decode import rejection, speculative
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.decode.engine import generate
    from specloop.drafter.decode.requests import StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.kinds.table import build_drafter, default_speculators
    from specloop.drafter.model.loading import load_model

    torch.set_num_threads(args.threads)
    verifier = load_model(PAIR / "verifier", weights="auto")
    drafter = build_drafter("eagle", verifier, PAIR / "drafter", "fp32", default_speculators("eagle"))
    prompts = held_out_prompts(verifier.tokenizer, args.prompts)
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
    out.with_suffix(".json").write_text(json.dumps(summary, separators=(",", ":")) + "\n")
    plot_arms(summary["conditions"], ("ops", "compiled"),
              (("plain_us", "verdict µs a step (median)", "fetched pair, served default: plain steps"),
               ("drafting_us", "verdict µs a step (median)", "fetched pair, served default: drafting steps")),
              out.with_suffix(".png"))


if __name__ == "__main__":
    main()
