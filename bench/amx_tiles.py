"""Benchmark: what AMX tiles save in w4a8 products of many rows (a prompt's prefill, a batch's verify pass), in one
process: this tree's kernels with the tiles (`tiles`), the same build with them turned off (`vector`,
`kernels.set_amx(False)`: the AVX-512 VNNI tiles alone) and, with --baseline REV, the kernels as revision REV wrote
them (`before`, built from its csrc/, serving a second copy of the model).

Three parts, the arms taking turns in every round (the order alternating), medians of the per-round ratios:
- products: SmolLM2-135M's four w4a8 shapes (random weights) at --rows rows, a call each;
- prefill: the fetched verifier (`specloop models fetch`) prefilling --prompts tokens (random ids);
- batches: its forward of B rows x T tokens at --context cached tokens (--batches, BxT), a batched verify pass.
Every part checks that the arms give the same bits (products, caches, logits). Needs a CPU with AMX-INT8 for the
tiles to differ from the vector arm (it says so and times the rest otherwise: there `tiles` and `vector` are one build
taking turns, a measure of the noise, and --baseline compares builds, as section 61 does on an AVX2-only CPU).

    .venv/bin/python bench/amx_tiles.py --baseline 3c54b53 --out amx_tiles_s60
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
DEFAULT_VERIFIER = Path.home() / ".cache" / "specloop" / "models" / "smollm2-135m-instruct" / "verifier"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)


def arms_of(before):
    """{arm: (kernel module or None for the tree's, whether the tree's AMX tiles are on)}."""
    arms = {"tiles": (None, True), "vector": (None, False)}
    if before is not None:
        arms["before"] = (before, True)
    return arms


def in_turn(arms: dict, rounds: int, run) -> dict:
    """{arm: [run(arm) for each round]}, the arms taking turns, the order reversed every other round."""
    from bench.kernels_at import kernels_from
    from specloop.drafter.model import kernels

    got = {name: [] for name in arms}
    for r in range(rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            mod, amx = arms[name]
            kernels.set_amx(amx)
            with kernels_from(mod):
                got[name].append(run(name))
    kernels.set_amx(True)
    return got


def summary(times: dict, same: bool) -> dict:
    row = {f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()}
    for name in times:
        if name != "vector":
            row[f"{name}_over_vector"] = statistics.median(a / b for a, b in zip(times[name], times["vector"]))
    return row | {"same_bits": same}


def timed(call):
    start = time.perf_counter()
    out = call()
    return time.perf_counter() - start, out


def products(arms: dict, rows: list[int], rounds: int) -> list[dict]:
    import torch

    from specloop.drafter.model import kernels

    g, out = torch.Generator().manual_seed(0), []
    weights = {}
    for name, (N, K) in SHAPES.items():
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        d, m = torch.rand(N, K // 32, generator=g) * 0.05 + 1e-3, torch.randn(N, K // 32, generator=g) * 0.3
        weights[name] = kernels.pack_w4a8(q, d.half().float(), m.half().float())
    for R in rows:
        xs = {name: torch.randn(R, K, generator=g) for name, (N, K) in SHAPES.items()}
        results = {}

        def run(arm):
            total = 0.0
            for name, packed in weights.items():
                dt, results[(arm, name)] = timed(lambda: kernels.w4a8_mm(xs[name], *packed))
                total += dt
            return total

        times = in_turn(arms, rounds, run)
        same = all(torch.equal(results[(a, n)], results[("vector", n)]) for a in arms for n in SHAPES)
        out.append({"rows": R} | summary(times, same))
        print(f"products, {R:4d} rows: " + _line(out[-1]), flush=True)
    return out


def _line(row: dict) -> str:
    ms = ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in row.items() if k.endswith("_ms"))
    ratios = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_over_vector"))
    return f"{ms} ({ratios}; same bits {row['same_bits']})"


def models_for(arms: dict, verifier: str) -> dict:
    """The verifier loaded once for the tree's build (both of its arms) and once for the baseline's: a weight binds
    its kernels when it is built."""
    from bench.kernels_at import kernels_from
    from specloop.drafter.model.loading import load_model

    tree = load_model(verifier, weights="auto").lean
    models = {}
    for name, (mod, _) in arms.items():
        if mod is None:
            models[name] = tree
        else:
            with kernels_from(mod):
                models[name] = load_model(verifier, weights="auto").lean
    return models


def prefills(arms: dict, models: dict, lengths: list[int], rounds: int) -> list[dict]:
    import torch

    from specloop.drafter.model.kv_cache import prefill

    out, g = [], torch.Generator().manual_seed(1)
    for n in lengths:
        tokens = torch.randint(100, 40000, (n + 1,), generator=g).tolist()
        caches = {}

        def run(arm):
            dt, (caches[arm], _) = timed(lambda: prefill(models[arm], [tokens], n + 16))
            return dt

        in_turn(arms, 1, run)  # a warm-up round
        times = in_turn(arms, rounds, run)
        same = all(torch.equal(a, b) for arm in arms
                   for a, b in zip(caches[arm].keys + caches[arm].values, caches["vector"].keys + caches["vector"].values))
        out.append({"tokens": n} | summary(times, same))
        print(f"prefill, {n:4d} tokens: " + _line(out[-1]), flush=True)
    return out


def batches(arms: dict, models: dict, shapes: list[tuple[int, int]], context: int, rounds: int) -> list[dict]:
    import torch

    from specloop.drafter.model.kv_cache import prefill

    out, g = [], torch.Generator().manual_seed(2)
    for B, T in shapes:
        prompts = [torch.randint(100, 40000, (context + 1,), generator=g).tolist() for _ in range(B)]
        tokens = torch.randint(100, 40000, (B, T), generator=g)
        state = {arm: prefill(models[arm], prompts, context + T + 16)[0] for arm in arms}
        base, logits = state["vector"].lens.clone(), {}

        def run(arm):
            state[arm].lens = base.clone()
            dt, logits[arm] = timed(lambda: models[arm].forward(state[arm], tokens))
            return dt

        times = in_turn(arms, rounds, run)
        same = all(torch.equal(logits[a].logits, logits["vector"].logits) for a in arms)
        out.append({"batch": B, "T": T, "context": context} | summary(times, same))
        print(f"batch {B} x {T} at {context}: " + _line(out[-1]), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="also time the kernels as this git revision wrote them")
    p.add_argument("--verifier", default=str(DEFAULT_VERIFIER))
    p.add_argument("--rows", default="16,32,64,256,750")
    p.add_argument("--prompts", default="64,256,750")
    p.add_argument("--batches", default="8x1,32x1,8x5,16x5", help="BxT, comma-separated")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="amx_tiles")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from bench.kernels_at import build_at
    from bench.machine import machine_info
    from bench.runs import write_result
    from specloop.drafter.model import kernels

    if not kernels.set_amx(True):
        print("no AMX tiles here (no AMX-INT8, or the kernel refused them): 'tiles' is the vector arm", flush=True)
    arms = arms_of(build_at(args.baseline) if args.baseline else None)
    result = {"benchmark": "amx_tiles", "machine": machine_info() | {"threads": args.threads},
              "amx": kernels.set_amx(True), "baseline": args.baseline, "rounds": args.rounds,
              "products": products(arms, [int(r) for r in args.rows.split(",")], args.rounds)}
    if Path(args.verifier).exists():
        models = models_for(arms, args.verifier)
        result["prefill"] = prefills(arms, models, [int(n) for n in args.prompts.split(",")], args.rounds)
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.batches.split(",") if s]
        result["batches"] = batches(arms, models, shapes, args.context, args.rounds)
    else:
        print(f"no verifier at {args.verifier} (specloop models fetch): products only", flush=True)
    write_result(result, OUT, args.out, _plot)


def _plot(result: dict, path: Path) -> None:
    from bench.runs import pyplot

    plt = pyplot()

    rows = ([(f"{r['rows']} rows", r) for r in result["products"]] +
            [(f"prefill {r['tokens']}", r) for r in result.get("prefill", [])] +
            [(f"{r['batch']}x{r['T']}", r) for r in result.get("batches", [])])
    arms = [k[: -len("_over_vector")] for k in rows[0][1] if k.endswith("_over_vector")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        ax.bar([j + i * width for j in range(len(rows))], [r[f"{arm}_over_vector"] for _, r in rows], width, label=arm)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(rows))], [n for n, _ in rows], fontsize=6,
                  rotation=60)
    ax.set_ylabel("time / the vector tiles' (AMX off)")
    what = "w4a8 on AMX tiles" if result["amx"] else f"int8 products of many rows against {result['baseline']} (no AMX)"
    ax.set_title(f"{what}, {result['machine']['cpu']}, {result['machine']['threads']} threads", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
