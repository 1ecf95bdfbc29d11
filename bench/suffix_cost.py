"""Benchmark: what suffix decoding's drafting costs the host per step, on real text.

The served default drafts with suffix decoding beside its eagle head on every step, plain ones too (its drafts
are free of model passes, not of host time): each row matches its context in its own history and in the global
store of earlier outputs, then follows the most frequent continuation. On a GPU that host time sits between two
replayed steps. This replays real token streams through `SuffixDrafter.drafts` as the engine calls it: the
global store filled with the real model's tokenization of one half of the reference prompt sets (chat + code,
repeated to the store's 64k tokens), rows taking the other half's texts a third in as their prompt and the rest
one token a step as their output. Rows: µs per step (the whole batch's drafts), per row, p90, drafted tokens per
row, µs to store one finished output and to start a row.

    .venv/bin/python bench/suffix_cost.py --out bench/results/suffix_cost.json
    # before / after a change: run it in each checkout alone, alternating, then pool the runs
    .venv/bin/python bench/suffix_cost.py --compare before=a1.json,a2.json after=b1.json,b2.json --out cmp.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.runs import add_compare, labelled_runs  # noqa: E402
from specloop.drafter.kinds.suffix import History, SuffixDrafter  # noqa: E402


def texts(prompts: Path, tokenizer) -> list[list[int]]:
    out = []
    for name in ("code_dev", "chat_dev"):
        for line in (prompts / f"{name}.jsonl").read_text().splitlines():
            item = json.loads(line)
            out.append(tokenizer(item.get("prompt") or item["messages"][0]["content"])["input_ids"])
    return out


def run(ids: list[list[int]], batch: int, store_tokens: int, k: int) -> dict:
    order = np.random.default_rng(0).permutation(len(ids))
    stored, rows = [ids[i] for i in order[: len(ids) // 2]], [ids[i] for i in order[len(ids) // 2:] if len(ids[i]) > 80]
    drafter = SuffixDrafter(1 << 16)
    added, t0 = 0, time.perf_counter()
    while drafter.store.n + len(stored[added % len(stored)]) < store_tokens:
        drafter.store.add(np.asarray(stored[added % len(stored)], dtype=np.int32))
        added += 1
    add_us = 1e6 * (time.perf_counter() - t0) / added
    steps, start_us, drafted, asked = [], [], 0, 0
    for lo in range(0, len(rows) - batch + 1, batch):
        group = rows[lo: lo + batch]
        t0 = time.perf_counter()
        drafter.rows = [History(t[: len(t) // 3]) for t in group]
        start_us.append(1e6 * (time.perf_counter() - t0) / sum(len(t) // 3 for t in group))
        for s in range(min(len(t) - len(t) // 3 for t in group)):
            t0 = time.perf_counter()
            drafts = drafter.drafts(k)
            steps.append(1e6 * (time.perf_counter() - t0))
            drafted, asked = drafted + sum(len(d.tokens) for d in drafts), asked + len(drafts)
            for row, t in zip(drafter.rows, group):
                row.extend([t[len(t) // 3 + s]])
    return {"step_us_median": statistics.median(steps), "row_us_median": statistics.median(steps) / batch,
            "step_us_p90": float(np.percentile(steps, 90)), "steps": len(steps), "drafted_per_row": drafted / asked,
            "store_tokens": drafter.store.n, "add_us_per_output": add_us,
            "start_us_per_prompt_token": statistics.median(start_us)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=Path, default=ROOT.parent / "shared" / "prompts")
    ap.add_argument("--tokenizer", type=Path, default=None, help="default: the fetched model's")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--store-tokens", type=int, default=65_536)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "suffix_cost.json")
    add_compare(ap)
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare, args.out)
    from transformers import AutoTokenizer

    from specloop.services.cli.options import DEFAULT_CACHE
    from specloop.trainer.fetch import DEFAULT_MODEL, default_out

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_out(DEFAULT_CACHE, DEFAULT_MODEL) / "verifier")
    ids = texts(args.prompts, tokenizer)
    report = {"benchmark": "suffix_cost", "cpu": platform.processor() or platform.machine(), "k": args.k,
              "batches": {}}
    for batch in map(int, args.batches.split(",")):
        rounds = [run(ids, batch, args.store_tokens, args.k) for _ in range(args.rounds)]
        report["batches"][batch] = {**rounds[0], "row_us_rounds": [r["row_us_median"] for r in rounds],
                                    "row_us_median": statistics.median(r["row_us_median"] for r in rounds)}
        row = report["batches"][batch]
        print(f"batch {batch}: {row['row_us_median']:.1f} µs per row a step, {row['drafted_per_row']:.3f} tokens "
              f"drafted per row, store {row['store_tokens']} tokens, {row['add_us_per_output']:.0f} µs per output "
              f"stored, {row['start_us_per_prompt_token']:.2f} µs per prompt token to start a row")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, separators=(",", ":")) + "\n")
    compare_runs({"this checkout": [report]}, args.out.with_suffix(".png"))


def compare(labelled: list[str], out: Path) -> None:
    runs = labelled_runs(labelled)
    medians = {label: {b: statistics.median(v for r in reports for v in r["batches"][b]["row_us_rounds"])
                       for b in reports[0]["batches"]} for label, reports in runs.items()}
    out.write_text(json.dumps({"benchmark": "suffix_cost compare", "row_us_medians": medians, "runs": runs}, separators=(",", ":")) + "\n")
    compare_runs(runs, out.with_suffix(".png"))


def compare_runs(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(next(iter(runs.values()))[0]["batches"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(runs)
    for i, (label, reports) in enumerate(runs.items()):
        values = [statistics.median(v for r in reports for v in r["batches"][b]["row_us_rounds"]) for b in batches]
        ax.bar([x + i * width for x in range(len(batches))], values, width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set(ylabel="µs per row per step (median)", title="suffix decoding's drafts on real text (CPU, 1 thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
