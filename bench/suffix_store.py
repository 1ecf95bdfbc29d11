"""Benchmark: suffix decoding's token stores in C++ (csrc/suffix.cpp) against the Python reference, in situ: the
served default (the fetched pair's eagle head with suffix decoding, k auto) decoding held-out chat and code prompts,
one process, the two arms alternating round by round.

Each run builds its arm's drafter afresh (a store is C++ or Python from its first token; the global store starts
empty, so that no run drafts from an earlier run's answers to the same prompts): the same weights, the same traffic.
Per step: the time spent in the suffix member (`SuffixDrafter`'s drafts, observations, rows started and outputs
stored; outermost calls only) and the step's host time (its wall time less its compiled layer calls and LM head, as
bench/host_time.py; the eagle head's passes are in it), medians and means over a run (a lookup step matches, a plain
one only appends), at batch 1 and 8, T = 0 and 1; tokens/s beside it (this VM's noise: not the figure). Greedy
outputs must be the same in both arms (the drafts are); sampled ones differ where the controller, timing each arm's
steps, chose another k.

    .venv/bin/python bench/suffix_store.py --rounds 3 --out suffix_store
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

CONDITIONS = ((1, 0.0), (1, 1.0), (8, 0.0), (8, 1.0))  # (batch, temperature)
ARMS = ("python", "cpp")


def main() -> None:
    args = in_situ_args(__doc__, "suffix_store")
    import torch

    from bench.machine import machine_info
    from bench.runs import held_out_prompts, plot_arms, time_kernels
    from bench.whole_process import PAIR
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest, StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.kinds import suffix
    from specloop.drafter.kinds.table import build_drafter, default_speculators
    from specloop.drafter.model.loading import load_model

    if suffix.native_module() is None:
        raise SystemExit("suffix decoding's C++ store is not built here: nothing to compare")
    torch.set_num_threads(args.threads)
    verifier = load_model(PAIR / "verifier", weights="auto")
    built = suffix.native_module

    def drafter_with(arm: str):
        suffix.native_module = built if arm == "cpp" else (lambda: None)
        return build_drafter("eagle", verifier, PAIR / "drafter", "fp32", default_speculators("eagle"))

    prompts = held_out_prompts(verifier.tokenizer, args.prompts)
    rule = StopRule(verifier.eos_ids)
    capacity = max(map(len, prompts)) + args.max_tokens + 16
    kernel_s = time_kernels()
    suffix_s, depth = [0.0], [0]

    def in_suffix(fn):
        def call(*a, **k):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    suffix_s[0] += time.perf_counter() - t
        return call

    for name in ("drafts", "observe", "start", "join", "fillers", "free_confidence"):
        setattr(suffix.SuffixDrafter, name, in_suffix(getattr(suffix.SuffixDrafter, name)))

    def run(arm: str, batch: int, temperature: float) -> tuple[dict, list[list[int]]]:
        drafter = drafter_with(arm)  # a fresh global store: no run drafts from an earlier run's answers
        host, spent, outputs, tokens, start, controller = [], [], {}, 0, time.perf_counter(), Controller()
        for lo in range(0, len(prompts), batch):
            engine = Engine(verifier.lean, drafter, batch, capacity, rule, controller=controller)
            engine.admit([EngineRequest(str(lo + j), p, SamplingParams(temperature, max_tokens=args.max_tokens,
                                                                        seed=0), None, lo + j)
                          for j, p in enumerate(prompts[lo : lo + batch])])
            while engine.running:
                kernel_s[0] = suffix_s[0] = 0.0
                t = time.perf_counter()
                for u in engine.step():
                    tokens += len(u.new_tokens)
                    if u.generation is not None:
                        outputs[int(u.id)] = list(u.generation.token_ids)
                host.append(time.perf_counter() - t - kernel_s[0])
                spent.append(suffix_s[0])
            engine.close()
        return ({"suffix_us_median": statistics.median(spent) * 1e6, "suffix_us_mean": statistics.fmean(spent) * 1e6,
                 "host_us_median": statistics.median(host) * 1e6, "host_us_mean": statistics.fmean(host) * 1e6,
                 "steps": len(host), "tok_s": tokens / (time.perf_counter() - start)},
                [outputs[i] for i in sorted(outputs)])

    for arm in ARMS:  # warm each arm's first calls
        run(arm, 1, 1.0)
    rows, same = [], {}
    for r in range(args.rounds):
        outs = {}
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            for batch, temperature in CONDITIONS:
                got, outs[arm, batch, temperature] = run(arm, batch, temperature)
                rows.append({"round": r, "arm": arm, "batch": batch, "temperature": temperature, **got})
                print(r, arm, f"B{batch} T{temperature:g}", {k: round(v, 1) for k, v in got.items()}, flush=True)
        for batch, temperature in CONDITIONS:
            name = f"B{batch} T{temperature:g}"
            a, b = outs["python", batch, temperature], outs["cpp", batch, temperature]
            same.setdefault(name, []).append(sum(x == y for x, y in zip(a, b)))
    summary: dict = {"machine": machine_info(), "threads": args.threads, "prompts": len(prompts),
                     "max_tokens": args.max_tokens, "rounds": rows, "conditions": {}}
    for batch, temperature in CONDITIONS:
        name = f"B{batch} T{temperature:g}"
        cell: dict = {"identical_outputs": f"{min(same[name])}/{len(prompts)} (worst round)"}
        if not temperature and min(same[name]) < len(prompts):
            raise SystemExit(f"{name}: greedy outputs differ between the stores")
        for arm in ARMS:
            mine = [x for x in rows if x["arm"] == arm and x["batch"] == batch and x["temperature"] == temperature]
            for key in ("suffix_us_median", "suffix_us_mean", "host_us_median", "host_us_mean", "tok_s", "steps"):
                cell[f"{arm}_{key}"] = statistics.median(x[key] for x in mine)
        summary["conditions"][name] = cell
        print(name, {k: round(v, 1) if isinstance(v, float) else v for k, v in cell.items()})
    out = ROOT / "bench" / "results" / args.out
    out.with_suffix(".json").write_text(json.dumps(summary, separators=(",", ":")) + "\n")
    plot_arms(summary["conditions"], ARMS, (("suffix_us_mean", "µs a step in the suffix member (mean)", "fetched pair, "
               "served default"), ("host_us_mean", "host µs a step (mean)", "fetched pair, served default")),
              out.with_suffix(".png"), label=lambda arm: f"{arm} store")


if __name__ == "__main__":
    main()
