"""Benchmark: what a decode step's attention costs (`kernels.attend` over every layer, the KV cache read from
memory as a step reads it), this tree's kernels against an earlier revision's, in one process.

SmolLM2-135M's shapes (30 layers, 9 query heads over 3 KV heads of 64): each layer has its own random cache, and
an 80 MB array is summed between two passes over the layers (as the weights stream between a step's
attentions: no layer's keys are left in the caches). Cases: one row at --contexts tokens, and batches whose rows
differ in length, each for T new tokens a row (--widths). The two builds take turns pass by pass; the figure is
the median over --rounds of the per-round ratio (the same minute of the machine on both sides).

    .venv/bin/python bench/attention_cost.py --baseline 1a224c5 --out attention_cost_s59
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results"
H, HKV, D, LAYERS = 9, 3, 64, 30


def case(lens: list[int], T: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    B, C = len(lens), max(lens) + T + 16
    return {"keys": [torch.randn(B, HKV, C, D, generator=g) for _ in range(LAYERS)],
            "values": [torch.randn(B, HKV, C, D, generator=g) for _ in range(LAYERS)],
            "cos": torch.randn(C, D, generator=g), "sin": torch.randn(C, D, generator=g),
            "qkv": torch.randn(B, T, (H + 2 * HKV) * D, generator=g), "lens": torch.tensor(lens)}


def one_pass(mod, c: dict, flush) -> float:
    """Seconds for every layer's attention, then the caches flushed."""
    t = time.perf_counter()
    for k, v in zip(c["keys"], c["values"]):
        mod.attend(c["qkv"], k, v, c["cos"], c["sin"], c["lens"], H, 0.125)
    dt = time.perf_counter() - t
    flush.sum()
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the git revision whose kernels are the 'before'")
    p.add_argument("--contexts", default="20,300,1000,2000")
    p.add_argument("--batches", default="2000+100,1500+300+40+800,600+600+600+600",
                   help="rows' lengths joined by +, cases by commas")
    p.add_argument("--widths", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="attention_cost")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from bench.kernels_at import build_at
    from bench.machine import machine_info
    from bench.runs import write_result
    from specloop.drafter.model import kernels

    builds = {"before": build_at(args.baseline), "after": kernels._module()}
    flush = torch.randn(20_000_000)
    shapes = [[int(n)] for n in args.contexts.split(",")] + [[int(n) for n in b.split("+")] for b in
                                                              args.batches.split(",") if b]
    rows = []
    for lens in shapes:
        for T in (int(t) for t in args.widths.split(",")):
            c = case(lens, T)
            times = {name: [] for name in builds}
            for r in range(args.rounds):
                for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
                    times[name].append(one_pass(builds[name], c, flush))
            ratio = statistics.median(a / b for a, b in zip(times["after"], times["before"]))
            row = {"lens": lens, "T": T, "before_ms": 1e3 * statistics.median(times["before"]),
                   "after_ms": 1e3 * statistics.median(times["after"]), "after_over_before": ratio}
            rows.append(row)
            print(f"rows {'+'.join(map(str, lens)):>20} T={T}: {row['before_ms']:.2f} -> {row['after_ms']:.2f} ms "
                  f"(after / before {ratio:.3f})", flush=True)
    result = {"benchmark": "attention_cost", "machine": machine_info() | {"threads": args.threads},
              "baseline": args.baseline, "shapes": {"layers": LAYERS, "heads": H, "kv_heads": HKV, "head_dim": D},
              "rounds": args.rounds, "rows": rows}
    write_result(result, OUT, args.out, _plot)


def _plot(result: dict, path: Path) -> None:
    from bench.runs import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{'+'.join(map(str, r['lens']))}\nT={r['T']}" for r in result["rows"]]
    ax.bar(range(len(labels)), [r["after_over_before"] for r in result["rows"]], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=5, rotation=90)
    ax.set_ylabel(f"attention time, this tree / {result['baseline']}")
    ax.set_title(f"a step's attention from memory, {result['machine']['cpu']}, {result['machine']['threads']} threads",
                 fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
