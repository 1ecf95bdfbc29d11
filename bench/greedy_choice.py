"""Benchmark: a greedy step's choice found by the LM head in its own call (`kernels.w8a8_choose`, bench/README.md
section 57) against numpy's argmax over the logits after it (before), in one process.

The fetched pair (w4a8, its w8a8 LM head), greedy, the last 16 held-out chat prompts, 64 new tokens (ignore_eos), batch
1; the verifier alone and the served default (`--systems`), each arm taking turns prompt by prompt; per step its wall
time (medians), whole requests' tokens/s, and whether both arms' outputs are identical.

    .venv/bin/python bench/greedy_choice.py --rounds 3 --out greedy_choice
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
PROMPTS = ROOT.parent / "shared" / "prompts" / "chat_dev.jsonl"  # the last 16: held out from the fetched drafter
ARMS = ("argmax after", "head's own")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default="alone,default")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="greedy_choice", help="bench/results/<out>.json and .png")
    args = ap.parse_args()

    import torch

    from bench.machine import machine_info
    from bench.runs import plot_arms
    from bench.specbench import build_systems, encode_chat
    from bench.whole_process import PAIR
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest, StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.model import decoder
    from specloop.drafter.model.loading import load_model

    torch.set_num_threads(args.threads)
    verifier = load_model(PAIR / "verifier", weights="auto")
    records = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][-16:]
    prompts = [encode_chat(verifier.tokenizer, r["messages"]) for r in records]
    names = args.systems.split(",")
    drafters = {(s, a): build_systems([s], verifier, PAIR / "drafter", None, "eagle")[s] for s in names for a in ARMS}
    controllers = {key: Controller() for key in drafters}
    own = decoder.LeanDecoder._logits_and_choices

    def after(self, x, exact, choose=False):  # before section 57: the logits alone, numpy's argmax in the verdict
        return own(self, x, exact, False)

    steps: dict = {key: [] for key in drafters}
    rates: dict = {key: [] for key in drafters}
    outputs: dict = {key: [] for key in drafters}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for system in names:
                for arm in ARMS if (i + r) % 2 == 0 else ARMS[::-1]:
                    decoder.LeanDecoder._logits_and_choices = own if arm == ARMS[1] else after
                    key = (system, arm)
                    engine = Engine(verifier.lean, drafters[key], 1, len(prompt) + args.max_tokens + 16,
                                    StopRule(verifier.eos_ids), controller=controllers[key])
                    engine.admit([EngineRequest(str(i), prompt, SamplingParams(max_tokens=args.max_tokens,
                                                                               ignore_eos=True), 0)])
                    tokens, start = [], time.perf_counter()
                    while engine.running:
                        t = time.perf_counter()
                        tokens += [tok for u in engine.step() for tok in u.new_tokens]
                        steps[key].append((time.perf_counter() - t) * 1e6)
                    rates[key].append(len(tokens) / (time.perf_counter() - start))
                    outputs[key].append(tokens)
    decoder.LeanDecoder._logits_and_choices = own
    summary = {}
    for system in names:
        a, b = (system, ARMS[0]), (system, ARMS[1])
        summary[system] = {"step_us": {arm: statistics.median(steps[(system, arm)]) for arm in ARMS},
                           "tok_s": {arm: statistics.median(rates[(system, arm)]) for arm in ARMS},
                           "tok_s_ratio_median": statistics.median(y / x for x, y in zip(rates[a], rates[b])),
                           "identical": outputs[a] == outputs[b]}
        s = summary[system]
        print(f"{system}: step {s['step_us'][ARMS[0]]:.0f} -> {s['step_us'][ARMS[1]]:.0f} µs (medians), tok/s "
              f"{s['tok_s'][ARMS[0]]:.1f} -> {s['tok_s'][ARMS[1]]:.1f}, paired ratio {s['tok_s_ratio_median']:.3f}; "
              f"identical: {s['identical']}")
    out = ROOT / "bench" / "results" / f"{Path(args.out).name}.json"
    out.write_text(json.dumps({"machine": machine_info(), "threads": args.threads, "rounds": args.rounds,
                               "max_tokens": args.max_tokens, "summary": summary}, separators=(",", ":")) + "\n")
    cells = {system: {f"{arm}_{key}": summary[system][key][arm] for arm in ARMS for key in ("step_us", "tok_s")}
             for system in names}
    plot_arms(cells, ARMS, (("step_us", "µs a step (median)", "a step"), ("tok_s", "tokens/s (median)", "requests")),
              out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
