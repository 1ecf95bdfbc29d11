"""Benchmark: what one decode forward of T tokens costs, by kernel choice, in one process.

The verifier (default: the `specloop models fetch` pair, served as `auto`) is loaded once per
kernel choice (`own`: drafter/model/kernels.py; `stock`: torch's int kernels, SPECLOOP_KERNELS=stock),
a prompt of --context tokens is prefilled, and forwards of T new tokens on one row (--widths, 1..5) are
timed at that context (the cache length reset each time). Kinds take turns T by T, the order
alternating every round, medians of --repeats forwards per round and of the rounds. v_T = cost(T)
/ cost(1) is what a verify pass of k + 1 = T tokens costs in one-token steps. `--baseline REV` adds the
own kernels as revision REV wrote them (built from its csrc/, served to a second copy of the model),
timed in turn with this tree's. Kind `own-bf16kv`: the own kernels over a bf16 KV cache (`--kv-cache-dtype
bfloat16`), `own-f16kv` over an fp16 one, against `own`'s fp32 one.

    .venv/bin/python bench/step_cost.py            # writes bench/results/step_cost.json and .png
    .venv/bin/python bench/step_cost.py --baseline b039769 --kinds own --out step_cost_avx2
    .venv/bin/python bench/step_cost.py --baseline 28c124c --kinds own --second-thread --out step_cost_thread
    .venv/bin/python bench/step_cost.py --kinds own,own-bf16kv --context 2000 --out kv_bf16_2000
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results"
DEFAULT_VERIFIER = Path.home() / ".cache" / "specloop" / "models" / "smollm2-135m-instruct" / "verifier"
KINDS = ("own", "stock")
KV_KINDS = {"own-bf16kv": "bfloat16", "own-f16kv": "float16"}  # more kinds: the own kernels, the KV cache in this dtype


def load(path: str, kind: str):
    from specloop.drafter.model import kernels
    from specloop.drafter.model.loading import load_model

    os.environ["SPECLOOP_KERNELS"] = "stock" if kind == "stock" else "auto"
    kernels._module.cache_clear()
    lean = load_model(path, weights="auto").lean
    os.environ["SPECLOOP_KERNELS"] = "auto"  # the loaded weights keep their kernels; the own ones need the module
    kernels._module.cache_clear()
    return lean


def forward_ms(lean, context: int, T: int, repeats: int) -> float:
    import torch

    from specloop.drafter.model.kv_cache import prefill

    cache, _ = prefill(lean, [list(range(100, 100 + context + 1))], context + 64)
    base, tokens, times = cache.lens.clone(), torch.full((1, T), 200), []
    for _ in range(repeats):
        cache.lens = base.clone()
        start = time.perf_counter()
        lean.forward(cache, tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of a[i] / b[i] over the rounds: two kinds timed in turn within each round, so a slow minute of a
    shared machine moves both sides of each ratio."""
    return statistics.median(x / y for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verifier", default=str(DEFAULT_VERIFIER))
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline", metavar="REV", help="also time the own kernels as git revision REV wrote "
                    "them (kind own@REV), alternating with this tree's: a before / after in one process")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"of {', '.join((*KINDS, *KV_KINDS))} (default: {', '.join(KINDS)})")
    ap.add_argument("--second-thread", action="store_true", help="time the forwards from a thread other than the "
                    "one that loaded and ran the model first, as a Ray worker decodes (two OpenMP masters)")
    ap.add_argument("--widths", default="1,2,3,4,5", help="the T timed, comma-separated (1 first: v_T is over it)")
    ap.add_argument("--out", default="step_cost")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from bench.kernels_at import build_at, kernels_from
    from bench.machine import machine_info
    from bench.runs import scoped_env, write_result
    from specloop.drafter.model.attention import KV_CACHE_ENV
    from specloop.drafter.model.weights.modes import describe_mode

    builds = {kind: None for kind in args.kinds.split(",")}
    if args.baseline:
        builds[f"own@{args.baseline}"] = build_at(args.baseline)
    kinds = list(builds)
    models = {}
    for kind, build in builds.items():
        with kernels_from(build):
            models[kind] = load(args.verifier, kind)
    widths = [int(t) for t in args.widths.split(",")]
    if widths[0] != 1:
        ap.error("--widths starts at 1 (v_T = cost(T) / cost(1))")
    samples = {(kind, T): [] for kind in kinds for T in widths}

    def measure() -> None:
        for r in range(args.rounds):
            for T in widths:
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    with kernels_from(builds[kind]), scoped_env({KV_CACHE_ENV: KV_KINDS.get(kind, "auto")}):
                        samples[(kind, T)].append(forward_ms(models[kind], args.context, T, args.repeats))

    if args.second_thread:
        import threading

        for kind in kinds:  # the loading thread runs the model too (a worker's load and self-check)
            with kernels_from(builds[kind]):
                forward_ms(models[kind], args.context, 1, 2)
        worker = threading.Thread(target=measure)
        worker.start()
        worker.join()
    else:
        measure()
    result = {"benchmark": "step_cost", "machine": machine_info() | {"threads": args.threads},
              "timed_from": "a second thread" if args.second_thread else "the loading thread",
              "settings": vars(args), "kinds": {}}
    for kind in kinds:
        ms = {T: statistics.median(samples[(kind, T)]) for T in widths}
        row = {"served": describe_mode(models[kind]), "kv_cache": KV_KINDS.get(kind, "float32"), "ms_by_T": ms,
               "v_T": {T: ms[T] / ms[1] for T in widths},
               "rounds_ms": {T: samples[(kind, T)] for T in widths}}
        result["kinds"][kind] = row
        print(f"{kind:5s} {row['served']}: " + "  ".join(f"T={T} {ms[T]:.2f} ms (v={ms[T] / ms[1]:.2f})" for T in widths))
        if kind == kinds[0]:
            continue
        # the first kind against this one round by round (the same minute of the machine)
        ratios = row[f"{kinds[0]}_over_this"] = {T: paired_ratio(samples[(kinds[0], T)], samples[(kind, T)])
                                                 for T in widths}
        print(f"      {kinds[0]} / {kind}, median of the rounds' ratios: "
              + "  ".join(f"T={T} {r:.3f}" for T, r in ratios.items()))
    write_result(result, OUT, args.out, _plot)


def _plot(result: dict, path: Path) -> None:
    from bench.runs import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, row in result["kinds"].items():
        ms = {int(t): v for t, v in row["ms_by_T"].items()}  # int keys, or str ones read back from the JSON
        cache = f", {row['kv_cache']} KV cache" if row.get("kv_cache", "float32") != "float32" else ""
        ax.plot(sorted(ms), [ms[t] for t in sorted(ms)], marker="o", label=f"{kind}: {row['served']}{cache}")
    ax.set_xlabel("tokens per forward (T = k + 1)")
    ax.set_ylabel("ms per forward (median)")
    ax.set_title(f"decode forward cost at {result['settings']['context']} cached tokens, {result['machine']['cpu']}, "
                 f"{result['machine']['threads']} threads", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
