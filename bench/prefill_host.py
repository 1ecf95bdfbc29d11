"""Benchmark: what admitting a prompt costs the host on a GPU's graph backend, measured on the CPU.

On a GPU the eager prefill (the LeanDecoder's torch ops, attention in one product: `attention.attend_wide`) launches
every op of every layer from Python, one prompt at a time; the chunked prefill (`GraphDecoder.prefill_rows`) replays
a captured 1-row, 64-wide step per chunk of the prompt and copies the prompt's KV into its row. This counts, per
admitted prompt, the ops each dispatches (TorchDispatchMode: each one a kernel launch on a GPU) and the host µs they
take, with the chunked prefill's step stubbed as bench/host_step.py stubs a decode step (its replay is one launch on a
GPU: neither counted nor timed). The eager rows run torch's ops as a GPU would (SPECLOOP_KERNELS=stock: not the
CPU's own fused kernels, which a GPU does not have), so their µs are the CPU's arithmetic as well as the host's:
their op counts are the figure that carries to a GPU. Each mode alone, alternating, medians over rounds.

    PYTHONPATH=. .venv/bin/python bench/prefill_host.py --out bench/results/prefill_host.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["SPECLOOP_KERNELS"] = "stock"  # torch's ops, as on a GPU (set before the kernels' module decides)
os.environ["SPECLOOP_COMPILE"] = "0"  # the step is stubbed (host_step.StubStep): nothing to compile

import torch  # noqa: E402

from bench.host_step import STUB_S, OpCount, _timed_rerun, stub_graphs  # noqa: E402
from specloop.drafter.model import graph  # noqa: E402
from specloop.drafter.model.decoder import LeanDecoder  # noqa: E402
from specloop.drafter.model.graph import PREFILL_CHUNK, GraphDecoder  # noqa: E402
from specloop.drafter.model.kv_cache import prefill_rows  # noqa: E402

MODES = ("eager", "chunked")


def wide_everywhere() -> None:
    """The eager prefill's attention in one product on the CPU too (a GPU's: `attention.attend_wide`)."""
    positions = LeanDecoder.positions

    def wide(self, cache, T, wide=False):
        at = positions(self, cache, T, wide)
        at.wide = wide
        return at
    LeanDecoder.positions = wide  # type: ignore[method-assign]


def prompts_of(tokenizer, prompts_dir: Path, per_file: int) -> list[list[int]]:
    from specloop.services.prompts import encode, load_prompts

    return [encode(tokenizer, r) for name in ("chat_dev.jsonl", "code_dev.jsonl")
            for r in load_prompts(prompts_dir / name, per_file)]


def admit_all(dec: GraphDecoder, prompts: list[list[int]]) -> float:
    """Every prompt admitted into slot 0 of the pool in turn: host seconds outside the stubbed replays."""
    cache = dec.new_cache(dec.slots, max(map(len, prompts)) + 16)
    stub0 = STUB_S[0]
    t0 = time.perf_counter()
    for p in prompts:
        prefill_rows(dec, cache, [0], [p])
    return time.perf_counter() - t0 - (STUB_S[0] - stub0)


def count_ops(dec: GraphDecoder, prompts: list[list[int]]) -> int:
    """The ops `admit_all` dispatches outside the stubbed replays (a pass of its own: counting slows every op)."""
    with OpCount() as counter:
        counter.paused = False
        admit_all(dec, prompts)
    return counter.ops


def measure(path: Path, prompts_dir: Path, per_file: int, rounds: int) -> dict:
    from specloop.drafter.model.loading import load_model

    verifier = load_model(path, device=torch.device("cpu"), weights="bf16")
    lean = verifier.lean
    prompts = prompts_of(verifier.tokenizer, prompts_dir, per_file)
    dec = GraphDecoder(lean, 8, 5, compiled=False, direct=True)
    stub_graphs(lean, 1, PREFILL_CHUNK)  # the prefiller's step: one launch on a GPU
    times: dict[str, list[float]] = {m: [] for m in MODES}
    ops: dict[str, int] = {}
    for r in range(rounds + 1):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            os.environ["SPECLOOP_PREFILL"] = "eager" if mode == "eager" else "graph"
            seconds = admit_all(dec, prompts)
            if r:  # round 0 warms
                times[mode].append(1e6 * seconds / len(prompts))
            else:
                ops[mode] = count_ops(dec, prompts)
    tokens = statistics.mean(len(p) for p in prompts)
    out = {"model": str(path), "served": verifier.served, "layers": lean.num_layers, "prompts": len(prompts),
           "prompt_tokens_mean": tokens, "chunk": PREFILL_CHUNK}
    for mode in MODES:
        out[mode] = {"ops_per_prompt": ops[mode] / len(prompts), "host_us_per_prompt": statistics.median(times[mode]),
                     "host_us_rounds": times[mode]}
    out["ops_eager_over_chunked"] = out["eager"]["ops_per_prompt"] / out["chunked"]["ops_per_prompt"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from specloop.services.cli.options import DEFAULT_CACHE
    from specloop.trainer.fetch import DEFAULT_MODEL, default_out

    ap.add_argument("--models", nargs="*", type=Path, help="verifier folders (default: the reference pair's, the "
                    "fetched pair's)", default=[ROOT.parent / "shared" / "models" / "verifier",
                                                default_out(DEFAULT_CACHE, DEFAULT_MODEL) / "verifier"])
    ap.add_argument("--prompts", type=Path, default=ROOT.parent / "shared" / "prompts")
    ap.add_argument("--per-file", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefill_host.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    graph._rerun = _timed_rerun
    wide_everywhere()
    rows = []
    for path in args.models:
        if not path.is_dir():
            print(f"{path}: not found, skipped")
            continue
        row = measure(path, args.prompts, args.per_file, args.rounds)
        rows.append(row)
        print(f"{path.parent.name}/{path.name} ({row['layers']} layers, {row['prompt_tokens_mean']:.0f} tokens a prompt): "
              + ", ".join(f"{m} {row[m]['ops_per_prompt']:.0f} ops {row[m]['host_us_per_prompt']:.0f} µs"
                          for m in MODES) + f" a prompt; ops ×{row['ops_eager_over_chunked']:.1f}")
    from bench.machine import machine_info

    report = {"benchmark": "prefill_host", "machine": machine_info(), "torch": torch.__version__,
              "threads": args.threads, "models": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
