"""Benchmark: drafter kinds side by side after the same offline training budget.

Trains distilled, SD² (steering + full fine-tune), SD² with the drafter frozen (steering only) and
the DVI head with `specloop train offline` (same steps and tokens each, one thread each),
then measures τ on chat and code prompts at T = 0 and T = 1 (3 seeds), tokens/s, and the
per-block overhead of steering. Writes bench/results/drafters.json and drafters_*.png.

    .venv/bin/python bench/drafters.py --train-steps 600 --prompts-per-domain 20 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specloop.drafter.decode.engine import generate  # noqa: E402
from specloop.drafter.decode.requests import StopRule  # noqa: E402
from specloop.drafter.decode.sampling import SamplingParams  # noqa: E402
from specloop.drafter.kinds.sd2 import SteeredDrafter  # noqa: E402
from specloop.drafter.kinds.table import build_drafter  # noqa: E402
from specloop.drafter.model.loading import load_model  # noqa: E402
from specloop.services.prompts import encode, load_prompts  # noqa: E402

SHARED = ROOT.parent / "shared"
METHODS = ("distill", "sd2", "sd2-frozen", "dvi")


@dataclass
class System:
    label: str
    kind: str
    directory: Path | None


def train_all(args, ckpt: Path) -> dict:
    """Train every method with the same budget, two processes at a time, one thread each."""
    specloop = [sys.executable, "-m", "specloop", "--threads", "1", "train", "offline"]
    models = args.models
    jobs = []
    for method in METHODS:
        if args.generated_cache:  # each run gets its own copy: runs may extend it independently
            shutil.copytree(args.generated_cache, ckpt / method / "data", dirs_exist_ok=True)
        cmd = specloop + ["--method", method, "--verifier", str(models / "verifier"), "--out", str(ckpt / method)]
        cmd += ["--max-steps", str(args.train_steps), "--data", args.data, "--k", str(args.k), "--seed", "0"]
        if method != "dvi":
            cmd += ["--drafter", str(models / "drafter")]
        jobs.append((method, cmd))
    running, started = [], {}
    while jobs or running:
        while jobs and len(running) < args.parallel:
            method, cmd = jobs.pop(0)
            log = open(ckpt.parent / f"train_{method}.log", "w")
            running.append((method, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)))
            started[method] = time.time()
        time.sleep(2)
        for method, proc in list(running):
            if proc.poll() is not None:
                running.remove((method, proc))
                if proc.returncode:
                    raise SystemExit(f"training {method} failed; see {ckpt.parent}/train_{method}.log")
                print(f"trained {method} in {time.time() - started[method]:.0f}s", file=sys.stderr)
    return {m: json.loads((ckpt / m / "manifest.json").read_text()) for m in METHODS}


def systems(args, ckpt: Path) -> list[System]:
    return [
        System("pretrained", "pretrained", args.models / "drafter"),
        System("distilled", "pretrained", ckpt / "distill"),
        System("sd2", "sd2", ckpt / "sd2"),
        System("sd2-frozen", "sd2", ckpt / "sd2-frozen"),
        System("dvi", "dvi", ckpt / "dvi"),
        System("dvi-untrained", "dvi", None),
    ]


class BiasTimer:
    """Per-block cost of steering (W_s g and g itself), timed in situ."""

    def __init__(self, drafter):
        self.times: list[float] = []
        if isinstance(drafter, SteeredDrafter):
            inner = drafter.block_bias

            def timed():
                t0 = time.perf_counter()
                out = inner()
                self.times.append(time.perf_counter() - t0)
                return out

            drafter.block_bias = timed


def evaluate(verifier, system: System, prompts, temperature, seed, k, max_tokens, batch) -> dict:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    rule = StopRule(frozenset([verifier.tokenizer.eos_token_id]))
    tokens = blocks = accepted = 0
    seconds = 0.0
    drafter = build_drafter(system.kind, verifier, system.directory)  # start() resets it for every batch
    timer = BiasTimer(drafter)
    for lo in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        gens = generate(verifier.lean, drafter, prompts[lo : lo + batch], params, k, rule, first_request=lo)
        seconds += time.perf_counter() - t0
        for g in gens:
            tokens += len(g.token_ids)
            blocks += g.stats.blocks
            accepted += g.stats.accepted
    return {
        "tau": (accepted + blocks) / blocks,
        "tokens_per_s": tokens / seconds,
        "block_ms": seconds / blocks * 1e3,
        "steering_ms_per_block": statistics.mean(timer.times) * 1e3 if timer.times else None,
    }


def verifier_alone(verifier, prompts, max_tokens) -> float:
    rule = StopRule(frozenset([verifier.tokenizer.eos_token_id]))
    t0 = time.perf_counter()
    gens = [generate(verifier.lean, None, [p], SamplingParams(max_tokens=max_tokens), 0, rule)[0] for p in prompts]
    return sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", type=Path, default=SHARED / "models")
    ap.add_argument("--train-steps", type=int, default=600, help="same steps (= tokens) for every method")
    ap.add_argument("--data", default="teacher-forced", choices=["teacher-forced", "generated"])
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--generated-cache", type=Path, help="with --data generated: a prebuilt generated-data cache")
    ap.add_argument("--tag", default="", help="suffix of the result files (drafters_TAG.json)")
    ap.add_argument("--skip-train", action="store_true", help="reuse the checkpoints in --work")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "drafters")
    ap.add_argument("--prompts-per-domain", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    ckpt = args.work / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    manifests = (
        {m: json.loads((ckpt / m / "manifest.json").read_text()) for m in METHODS}
        if args.skip_train
        else train_all(args, ckpt)
    )
    torch.set_num_threads(args.threads)
    verifier = load_model(args.models / "verifier")
    domains = {
        d: [encode(verifier.tokenizer, r) for r in load_prompts(SHARED / "prompts" / f"{d}_dev.jsonl", args.prompts_per_domain)]
        for d in ("chat", "code")
    }
    rows = []
    for system in systems(args, ckpt):
        for domain, prompts in domains.items():
            for temperature, seeds in ((0.0, [0]), (1.0, args.seeds)):
                runs = [evaluate(verifier, system, prompts, temperature, s, args.k, args.max_tokens, args.batch) for s in seeds]
                taus = [r["tau"] for r in runs]
                rows.append({
                    "system": system.label, "domain": domain, "temperature": temperature, "seeds": seeds,
                    "tau_mean": statistics.mean(taus), "tau_std": statistics.stdev(taus) if len(taus) > 1 else 0.0,
                    "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in runs),
                    "block_ms": statistics.mean(r["block_ms"] for r in runs),
                    "steering_ms_per_block": runs[0]["steering_ms_per_block"],
                })
                print(f"{system.label} {domain} T={temperature:g}: τ={rows[-1]['tau_mean']:.3f}", file=sys.stderr)
    baseline = {d: verifier_alone(verifier, p, args.max_tokens) for d, p in domains.items()}
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "training": manifests,
        "verifier_alone_tokens_per_s": baseline,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"drafters_{args.tag}" if args.tag else "drafters"
    (args.out / f"{name}.json").write_text(json.dumps(report, separators=(",", ":")) + "\n")
    plot(report, args.out / f"{name}_tau.png")
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    lines = ["| drafter | domain | T | τ (mean ± std) | τ − 1 | tokens/s | block ms | steering ms/block |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        steer = "–" if r["steering_ms_per_block"] is None else f"{r['steering_ms_per_block']:.3f}"
        lines.append(
            f"| {r['system']} | {r['domain']} | {r['temperature']:g} | {r['tau_mean']:.3f} ± {r['tau_std']:.3f} | "
            f"{r['tau_mean'] - 1:.3f} | {r['tokens_per_s']:.0f} | {r['block_ms']:.2f} | {steer} |"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["system"] for r in report["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, temp in zip(axes, (0.0, 1.0)):
        for j, domain in enumerate(("chat", "code")):
            sel = {r["system"]: r for r in report["rows"] if r["domain"] == domain and r["temperature"] == temp}
            xs = [i + (j - 0.5) * 0.38 for i in range(len(labels))]
            ax.bar(xs, [sel[s]["tau_mean"] - 1 for s in labels], width=0.38, yerr=[sel[s]["tau_std"] for s in labels],
                   label=domain, capsize=3)
        ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=8)
        ax.set_title(f"accepted tokens per block (τ − 1), T = {temp:g}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
