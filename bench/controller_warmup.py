"""Benchmark: the controller's cost learning in a fresh process, before / after section 52's change (r(T) never under
1, a pass faster than its plain reference retakes the reference, the reference refreshed sooner while its ratios
are few), as `specloop generate` meets it.

Each run is a fresh process (its first passes slower than its later ones: what the change is about) that decodes the
held-out prompts of a set (chat by default) with the served default (the fetched pair's eagle head with suffix decoding, k auto, one
controller for the run, as `specloop generate`), then with the verifier alone in the same process; the ratio of
the two is the run's figure, with the default's τ (1.00: nothing drafted was accepted). The "before" arm runs this
tree with the cost learning of revision --at patched in (its `Costs.observe`, `ratio_of` and `_points`, and the
plain reference refreshed every `explore_max` steps while drafting pays); the arms alternate, one process each.

    .venv/bin/python bench/controller_warmup.py --at 63690e8 --runs 6 --out controller_warmup
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "prompts"


def one_run(args) -> dict:
    """In this (fresh) process: the default's and the verifier alone's tokens/s, and the default's τ."""
    sys.path.insert(0, str(ROOT))
    import importlib.util

    import torch

    from specloop.drafter.decode import controller as C

    if args.before:
        spec = importlib.util.spec_from_file_location("controller_before", args.before)
        old = sys.modules["controller_before"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
        assert spec.loader is not None
        spec.loader.exec_module(old)
        C.Costs.observe, C.Costs.ratio_of, C.Costs._points = old.Costs.observe, old.Costs.ratio_of, old.Costs._points
        C.Costs.reference_age = lambda self, b: self.cfg.explore_max
    from bench.whole_process import PAIR
    from specloop.drafter.decode.engine import generate
    from specloop.drafter.decode.requests import StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.kinds.table import build_drafter, default_speculators
    from specloop.drafter.model.loading import load_model
    from specloop.services.prompts import encode, load_prompts

    torch.set_num_threads(args.threads)
    verifier = load_model(PAIR / "verifier", weights="auto")
    prompts = [encode(verifier.tokenizer, r) for r in load_prompts(SHARED / f"{args.set}.jsonl")[-args.prompts:]]
    drafter = build_drafter("eagle", verifier, PAIR / "drafter", "fp32", default_speculators("eagle"))
    rule, out = StopRule(verifier.eos_ids), {}
    for system in ("default", "alone"):  # the default first, as a process starts with it
        controller, tokens, blocks, accepted, start = C.Controller(), 0, 0, 0, time.perf_counter()
        for i, prompt in enumerate(prompts):
            gen = generate(verifier.lean, drafter if system == "default" else None, [prompt],
                           SamplingParams(args.temperature, max_tokens=args.max_tokens, seed=0),
                           None if system == "default" else 0, rule, first_request=i, controller=controller)[0]
            tokens, blocks, accepted = tokens + len(gen.token_ids), blocks + gen.stats.blocks, accepted + gen.stats.accepted
        out[system] = {"tok_s": tokens / (time.perf_counter() - start), "tau": (accepted + blocks) / blocks}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--at", default="63690e8", help="the revision whose cost learning the before arm runs")
    ap.add_argument("--runs", type=int, default=6, help="processes per arm")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--set", default="chat_dev", help="a prompt set of ../shared/prompts (its last --prompts)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--before", help=argparse.SUPPRESS)  # (a child process: the before arm's controller.py)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="controller_warmup", help="bench/results/<out>.json and .png")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args)))
        return
    sys.path.insert(0, str(ROOT))
    from bench.machine import machine_info

    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "controller_before.py"
        before.write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{args.at}:drafter/decode/controller.py"],
                                         capture_output=True, text=True, check=True).stdout)
        rows = []
        for r in range(args.runs):
            for arm in ("before", "after") if r % 2 == 0 else ("after", "before"):
                cmd = [sys.executable, __file__, "--child", "--temperature", str(args.temperature), "--set", args.set, "--prompts",
                       str(args.prompts), "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
                done = subprocess.run(cmd + (["--before", str(before)] if arm == "before" else []),
                                      capture_output=True, text=True, check=True)
                got = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append({"run": r, "arm": arm, **got, "ratio": got["default"]["tok_s"] / got["alone"]["tok_s"]})
                print(r, arm, f"default / alone {rows[-1]['ratio']:.3f}, τ {got['default']['tau']:.3f}", flush=True)
    summary = {arm: {"ratio_median": statistics.median(x["ratio"] for x in rows if x["arm"] == arm),
                     "ratios": [round(x["ratio"], 3) for x in rows if x["arm"] == arm],
                     "taus": [round(x["default"]["tau"], 3) for x in rows if x["arm"] == arm]} for arm in ("before", "after")}
    for arm, row in summary.items():
        print(arm, f"default / alone median {row['ratio_median']:.3f}", row)
    result = {"benchmark": "controller_warmup", "machine": machine_info(), "settings": vars(args), "summary": summary,
              "runs": rows}
    out = ROOT / "bench" / "results" / args.out
    out.with_suffix(".json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(summary, out.with_suffix(".png"), args)


def plot(summary: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, arm in enumerate(("before", "after")):
        ax.scatter(summary[arm]["taus"], summary[arm]["ratios"], label=f"{arm if arm == 'after' else args.at}")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xlabel("the default's τ in the run")
    ax.set_ylabel("default / verifier alone (in-process)")
    ax.set_title(f"fresh processes, {args.set}, T = {args.temperature:g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
