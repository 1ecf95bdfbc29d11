"""Benchmark: what a step the controller left plain costs the host with the served default, beyond the verifier alone.

Where speculation does not pay (chat sampled at T = 1 on two CPU cores), the served default (the fetched eagle head
with suffix decoding, k auto) runs most steps plain and untimed: the controller's choice, suffix decoding following
the token, the lookups' checks. What such a step costs the host beyond the verifier alone's is what speculation
turned off still costs. Host time: a step's wall time less its compiled layer calls and LM head
(`bench.runs.time_kernels`), over the untimed plain steps alone (no probe, no lookup verified); medians.

Arms, one process, taking turns request by request (held-out chat prompts, --temperature, 128 tokens, batch 1),
each keeping its controller across requests as a server does:
- alone: the verifier alone;
- default: the served default;
- default-evaluating: the same with its controller evaluating every choice (before bench/README.md section 54, a
  controller that left speculation off priced every plain step's choice again).

    .venv/bin/python bench/plain_host.py --rounds 3 --out plain_host
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

ARMS = ("alone", "default", "default-evaluating")


def untimed_plain(engine, updates: list) -> bool:
    """Whether the step just run was plain (the verifier alone's, or one the controller left plain and untimed)
    and verified nothing."""
    choice = engine.timing.choice
    return ((choice is None or not (choice.k or choice.timed)) and bool(updates)
            and all(len(u.new_tokens) == 1 and u.speculator is None for u in updates))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12, help="held-out chat prompts (chat_dev's last)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="plain_host", help="bench/results/<out>.json and .png")
    args = ap.parse_args()

    import torch

    from bench.machine import machine_info
    from bench.runs import held_out_prompts, plot_arms, time_kernels
    from bench.specbench import Run, build_systems, decode
    from bench.whole_process import PAIR
    from specloop.drafter.decode import engine as engine_module
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.model.loading import load_model

    class Evaluating(Controller):
        """The controller with its quiet runs of plain choices forgotten before every choice: each evaluated."""

        def choose(self, batch):
            self._quiet = None
            return super().choose(batch)

    torch.set_num_threads(args.threads)
    verifier = load_model(PAIR / "verifier", weights="auto")
    built = build_systems(["alone", "default"], verifier, PAIR / "drafter", None, "eagle")
    systems = {"alone": None, "default": built["default"],
               "default-evaluating": build_systems(["default"], verifier, PAIR / "drafter", None, "eagle")["default"]}
    controllers = {"alone": Controller(), "default": Controller(), "default-evaluating": Evaluating()}
    prompts = held_out_prompts(verifier.tokenizer, args.prompts)[: args.prompts]  # chat_dev's
    spent = time_kernels()
    host: dict[str, list[float]] = {arm: [] for arm in ARMS}
    kernels: dict[str, list[float]] = {arm: [] for arm in ARMS}
    tokens: dict[str, list[float]] = {arm: [] for arm in ARMS}
    arm_now = [ARMS[0]]
    step = engine_module.Engine.step

    def measured(self):
        spent[0] = 0.0
        t = time.perf_counter()
        updates = step(self)
        wall = time.perf_counter() - t
        if untimed_plain(self, updates):
            host[arm_now[0]].append((wall - spent[0]) * 1e6)
            kernels[arm_now[0]].append(spent[0] * 1e6)
        return updates

    engine_module.Engine.step = measured  # type: ignore[method-assign]
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            params = SamplingParams(args.temperature, max_tokens=args.max_tokens, seed=i + 1000 * r)
            j = (i + r) % len(ARMS)
            for arm in ARMS[j:] + ARMS[:j]:
                arm_now[0] = arm
                run = Run(arm, str(i), "chat")
                decode(verifier, systems[arm], controllers[arm], prompt, args.max_tokens, run, params)
                tokens[arm].append(run.tokens / (run.seconds - run.prefill_s))
        print(f"round {r + 1}: " + ", ".join(f"{a} {statistics.median(host[a]):.0f} µs" for a in ARMS), flush=True)
    summary = {arm: {"plain_steps": len(host[arm]), "host_us": statistics.median(host[arm]),
                     "host_us_mean": statistics.fmean(host[arm]), "kernels_us": statistics.median(kernels[arm]),
                     "decode_tok_s": statistics.median(tokens[arm])} for arm in ARMS}
    base = summary["alone"]
    for arm in ARMS:
        summary[arm]["host_beyond_alone_us"] = summary[arm]["host_us"] - base["host_us"]
        summary[arm]["beyond_alone_share"] = summary[arm]["host_beyond_alone_us"] / (base["host_us"]
                                                                                     + base["kernels_us"])
    result = {"machine": machine_info(), "threads": args.threads, "temperature": args.temperature,
              "rounds": args.rounds, "prompts": len(prompts), "max_tokens": args.max_tokens, "summary": summary}
    out = ROOT / "bench" / "results" / f"{Path(args.out).name}.json"
    out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    cells = {f"T = {args.temperature:g}": {f"{a}_{k}": summary[a][k] for a in ARMS for k in ("host_us", "kernels_us")}}
    plot_arms(cells, ARMS, (("host_us", "µs a plain step (median)", "host"),
                            ("kernels_us", "µs a plain step (median)", "layers and LM head")), out.with_suffix(".png"))
    for arm in ARMS:
        s = summary[arm]
        print(f"{arm:>19}: {s['plain_steps']} untimed plain steps, host {s['host_us']:.1f} µs "
              f"(+{s['host_beyond_alone_us']:.1f} over alone, {100 * s['beyond_alone_share']:.2f} % of its step), "
              f"kernels {s['kernels_us']:.0f} µs")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
