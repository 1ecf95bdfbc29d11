"""Benchmark: the eagle head's greedy draft in situ, done three ways, in one process:
- `expanded`: picked from its logits expanded to the whole vocabulary (`pick`, before bench/README.md section 55);
- `ops`: picked over its draft vocabulary alone (`pick_greedy`), the head's step and logits a dozen torch ops
  (section 55; "now" in its results);
- `one-call`: the head's step and logits in one C++ call and the pick in another (`kernels.head_draft`,
  `kernels.greedy_rows`: section 56, the default on specloop's CPU kernels).

The fetched pair's eagle head alone at k = 2 fixed (so that it drafts on every step), greedy, the held-out chat and
code prompts, 64 tokens, the arms taking turns prompt by prompt; per drafting step the engine's drafting and
verify seconds and the step's wall time (medians). Outputs are compared (greedy: every arm's is the verifier's).

    .venv/bin/python bench/eagle_pick.py --arms ops,one-call --out eagle_draft
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = ("expanded", "ops", "one-call")


def expanded_draft(drafter):
    """`EagleDrafter._draft` as it was before section 55: every draft picked from logits over the whole vocabulary."""
    from specloop.drafter.kinds import eagle

    def draft(z, tokens, params, u):
        z = drafter.step(z, tokens)  # the head's ops
        logits = eagle.head_logits(z, drafter.weights(), drafter.head_module.cfg.eps)
        choice, p = eagle.pick(logits, drafter.vocab, drafter.lean.vocab_size, params, u)
        return z, choice, p

    return draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default="ops,one-call", help=f"two or more of {','.join(ARMS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="eagle_pick", help="bench/results/<out>.json and .png")
    args = ap.parse_args()

    import torch

    from bench.machine import machine_info
    from bench.runs import held_out_prompts, plot_arms
    from bench.specbench import Run, build_systems, decode
    from bench.whole_process import PAIR
    from specloop.drafter.decode import engine as engine_module
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.model.loading import load_model

    arms = tuple(args.arms.split(","))
    if len(arms) < 2 or not set(arms) <= set(ARMS):
        ap.error(f"--arms: two or more of {', '.join(ARMS)}")
    torch.set_num_threads(args.threads)
    verifier = load_model(PAIR / "verifier", weights="auto")  # the fetched pair (`specloop models fetch`)
    drafters = {arm: build_systems(["eagle"], verifier, PAIR / "drafter", None, "eagle")["eagle"] for arm in arms}
    for arm, drafter in drafters.items():
        if arm != "one-call":  # the head's ops (and `pick_greedy` by ops)
            drafter._one_call = None
        if arm == "expanded":
            drafter._draft = expanded_draft(drafter)
    prompts = held_out_prompts(verifier.tokenizer, 12)
    seen: dict[str, list[float]] = collections.defaultdict(list)
    arm_now = [arms[0]]
    step = engine_module.Engine.step

    def measured(self):
        t = time.perf_counter()
        updates = step(self)
        wall = time.perf_counter() - t
        if self.timing.draft_s > 0:
            for key, value in (("draft", self.timing.draft_s), ("verify", self.timing.verify_s), ("wall", wall)):
                seen[f"{arm_now[0]} {key}"].append(value * 1e6)
        return updates

    engine_module.Engine.step = measured  # type: ignore[method-assign]
    controllers = {arm: Controller() for arm in arms}
    outputs: dict[str, list[list[int]]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for arm in arms[(i + r) % len(arms):] + arms[:(i + r) % len(arms)]:  # each arm first in turn
                arm_now[0] = arm
                run = Run(arm, str(i), "prompts")
                decode(verifier, drafters[arm], controllers[arm], prompt, 64, run, SamplingParams(max_tokens=64), 2)
                outputs[arm].append(run.token_ids[-1])
    summary = {arm: {key: statistics.median(seen[f"{arm} {key}"]) for key in ("draft", "verify", "wall")}
               | {"drafting_steps": len(seen[f"{arm} draft"])} for arm in arms}
    identical = all(outputs[arm] == outputs[arms[0]] for arm in arms)
    for arm in arms:
        s = summary[arm]
        print(f"{arm:>9}: {s['drafting_steps']} drafting steps, drafting {s['draft']:.0f} µs, verify "
              f"{s['verify']:.0f} µs, step {s['wall']:.0f} µs (medians)")
    first, last = arms[0], arms[-1]
    print(f"{last} / {first}: drafting {summary[last]['draft'] / summary[first]['draft']:.3f}, step "
          f"{summary[last]['wall'] / summary[first]['wall']:.3f}; outputs identical: {identical}")
    out = ROOT / "bench" / "results" / f"{Path(args.out).name}.json"
    out.write_text(json.dumps({"machine": machine_info(), "threads": args.threads, "rounds": args.rounds, "k": 2,
                               "arms": arms, "summary": summary, "identical": identical}, separators=(",", ":")) + "\n")
    plot_arms({"k = 2, greedy": {f"{a}_{key}": summary[a][key] for a in arms for key in ("draft", "wall")}}, arms,
              (("draft", "µs a drafting step (median)", "drafting"),
               ("wall", "µs a drafting step (median)", "the whole step")), out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
