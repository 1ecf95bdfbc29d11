"""Benchmark: draft heads on the real pair (SmolLM2-135M-Instruct, served as its manifest says),
after their offline build: acceptance per position, τ and tokens/s at fixed k, greedy.

Each head (LABEL:KIND:DIR) drafts for the same chat-templated prompts (chat_dev.jsonl and
code_dev.jsonl, interleaved), batch 1, at each --k; the verifier alone decodes the same prompts in
the same process, the systems alternating prompt by prompt, so tokens/s ratios are medians of
per-prompt ratios taken side by side. Greedy output of every system is checked against the
verifier alone (the run fails on a difference: speculation must be lossless).

    .venv/bin/python bench/heads_real.py --head eagle:eagle:~/.cache/specloop/models/smollm2-135m-instruct/drafter \\
        --head eagle3:eagle3:/work/runs/e3a --chat 10 --code 10 --max-tokens 96 --k 2,4 --out heads_real
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_real import load_prompts_ids  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from specloop.drafter.decode.engine import generate  # noqa: E402
from specloop.drafter.decode.requests import StopRule  # noqa: E402
from specloop.drafter.decode.sampling import SamplingParams  # noqa: E402
from specloop.drafter.decode.stats import AcceptanceStats  # noqa: E402
from specloop.drafter.kinds.table import build_drafter  # noqa: E402
from specloop.drafter.model.loading import load_model  # noqa: E402

DEFAULT_PAIR = Path.home() / ".cache" / "specloop" / "models" / "smollm2-135m-instruct"
OUT = ROOT / "bench" / "results"


def timed(verifier, drafter, ids: list[int], k: int, max_tokens: int, eos: list[int]):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    g = generate(verifier.lean, drafter, [ids], params, k, StopRule(eos_ids=frozenset(eos)))[0]
    return g, time.perf_counter() - t0


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    verifier = load_model(args.verifier, weights="auto")
    prompts = load_prompts_ids(verifier.tokenizer, args.chat, args.code)
    heads = {label: build_drafter(kind, verifier, Path(d).expanduser()) for label, kind, d in
             (h.split(":", 2) for h in args.head)}
    ks = [int(k) for k in args.k.split(",")]
    eos = sorted(verifier.eos_ids)
    for label, d in heads.items():  # warm-up: first calls build kernels and caches
        timed(verifier, d, prompts[0]["ids"], ks[0], 8, eos)
    timed(verifier, None, prompts[0]["ids"], 0, 8, eos)
    rows = []
    for i, p in enumerate(prompts):
        base, t_base = timed(verifier, None, p["ids"], 0, args.max_tokens, eos)
        row = {"domain": p["domain"], "id": p["id"], "tokens": len(base.token_ids), "verifier_s": t_base, "systems": {}}
        order = [(label, k) for label in heads for k in ks]
        order = order[i % len(order):] + order[: i % len(order)]  # the first system rotates
        for label, k in order:
            g, t = timed(verifier, heads[label], p["ids"], k, args.max_tokens, eos)
            if g.token_ids != base.token_ids:
                raise SystemExit(f"{label} k={k} differs from the verifier alone on {p['id']}: speculation is not lossless")
            row["systems"][f"{label}@k{k}"] = {"seconds": t, "speedup": t_base / t, "tau": g.stats.block_efficiency,
                                           "stats": asdict(g.stats)}
        rows.append(row)
        print(f"{i + 1}/{len(prompts)} {p['domain']} " + " ".join(
            f"{n}: tau {s['tau']:.2f} x{s['speedup']:.2f}" for n, s in row["systems"].items()),
            file=sys.stderr)
    return {"machine": machine_info(), "threads": args.threads, "max_tokens": args.max_tokens,
            "heads": {h.split(":", 2)[0]: h.split(":", 2)[1:] for h in args.head}, "prompts": rows,
            "summary": summarise(rows)}


def summarise(rows: list[dict]) -> dict:
    """Per system and domain: τ (tokens per block, all blocks pooled), acceptance per position and
    the median per-prompt speed-up over the verifier alone."""
    out = {}
    for name in rows[0]["systems"]:
        for domain in ("chat", "code", "all"):
            picked = [r for r in rows if domain == "all" or r["domain"] == domain]
            if not picked:
                continue
            stats = AcceptanceStats()
            for r in picked:
                s = r["systems"][name]["stats"]
                stats.merge(AcceptanceStats(**s))
            per_pos = [a / d if d else None for a, d in zip(stats.accepted_per_position, stats.drafted_per_position)]
            out.setdefault(name, {})[domain] = {
                "tau": round(stats.block_efficiency, 3),
                "acceptance_per_position": [None if p is None else round(p, 3) for p in per_pos],
                "speedup_median": round(statistics.median(r["systems"][name]["speedup"] for r in picked), 3),
            }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "tau", "τ (tokens per block), greedy"),
                              (axes[1], "speedup_median", "tokens/s ÷ verifier alone (median)")):
        width = 0.8 / 2
        for j, domain in enumerate(("chat", "code")):
            vals = [result["summary"][n].get(domain, {}).get(metric, 0) for n in names]
            ax.bar([i + j * width for i in range(len(names))], vals, width, label=domain)
        ax.set_xticks([i + width / 2 for i in range(len(names))], names, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend()
    axes[1].axhline(1.0, color="grey", lw=0.8)
    fig.suptitle(f"draft heads on SmolLM2-135M ({result['machine']['cpu']}, {result['threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default=str(DEFAULT_PAIR / "verifier"))
    ap.add_argument("--head", action="append", required=True, metavar="LABEL:KIND:DIR")
    ap.add_argument("--chat", type=int, default=10)
    ap.add_argument("--code", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", default="2,4", help="comma-separated fixed draft lengths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="heads_real")
    args = ap.parse_args(argv)
    result = run(args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.out}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(result, OUT / f"{args.out}.png")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
