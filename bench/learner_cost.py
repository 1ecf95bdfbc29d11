"""Benchmark: what the online learner's updates cost, and what they cost the verifier beside them.

On a machine where the learner shares the node with the worker (`specloop serve` on one host: the worker gets half
the --threads, the learner one), every byte the learner moves is memory bandwidth the verifier's decode step does
not get. This measures, in one run:

- the learner's update (the fetched pair's eagle head, klrl, 64 records an update, one torch thread) as the learner
  computes it now (`gather`: the LM head only at the records' logged positions, one gather) and as it did before
  (`slices`: logits at every padded position, then one slice a record, whose backward zero-fills a gradient of the
  whole [records, positions, vocabulary] logits each: 64 x 63 MB an update);
- the verifier's forward of T = 1 and T = 5 tokens (the served w4a8 model, --threads, 300 cached tokens) with no
  learner, and with a learner process running updates back to back (as it does while traffic brings records) in
  each mode, the three states taking turns round by round (order alternating), medians.

Records are synthetic with the real shapes (the head's feature, 1-5 logged positions drawn as a head accepting ~0.35
logs them, verifier top-16): an update's cost depends on the shapes only.

    .venv/bin/python bench/learner_cost.py --rounds 4       # writes bench/results/learner_cost.json and .png
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results"
PAIR = Path.home() / ".cache" / "specloop" / "models" / "smollm2-135m-instruct"
MODES = ("slices", "gather")
POSITIONS = (1, 1, 1, 2, 2, 3, 4, 5)  # logged positions a record (up to and including the first rejection)


def synthetic_records(n: int, hidden: int, vocab: int, seed: int = 0) -> list:
    import numpy as np

    from specloop.trainer.records import ReplayRecord

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        m = int(rng.choice(POSITIONS))
        top = np.log(np.sort(rng.dirichlet(np.ones(17)))[::-1][:16]).astype(np.float32)
        out.append(ReplayRecord(
            request_id=f"r{i}", drafter_version="v0001", block=i, kind="eagle", k=5, temperature=0.0,
            tokens=rng.integers(0, vocab, m), rewards=np.array([1] * (m - 1) + [0], np.uint8),
            draft_logprobs=np.zeros(m, np.float32), top_ids=rng.integers(0, vocab, (m, 16)),
            top_logprobs=np.tile(top, (m, 1)), rest_mass=np.full(m, 0.05, np.float32),
            context=rng.integers(0, vocab, 1), steer=rng.standard_normal((1, hidden)).astype(np.float32)))
    return out


def sliced_eagle_logits(student, records):
    """The learner's forward as it was: the LM head at every padded position, then one slice a record."""
    import torch

    from specloop.trainer import online

    device = student.head.fc.weight.device
    start, tokens = online.eagle_blocks(records)
    logits = student.head.logits(student.chain_features(start.to(device), tokens.to(device)), student.lm_head)
    return torch.cat([logits[i, : r.positions] for i, r in enumerate(records)])


def learner_loop(mode: str, pair: Path, report: Path) -> None:
    """A learner process: updates back to back until stdin closes; their seconds go to `report` (JSON)."""
    import threading

    import torch

    torch.set_num_threads(1)
    from specloop.drafter.model.loading import load_model
    from specloop.trainer import online

    if mode == "slices":
        online.TRAINING["eagle"] = dataclasses.replace(online.TRAINING["eagle"], record_logits=sliced_eagle_logits)
    verifier = load_model(str(pair / "verifier"), dtype=torch.float32, keep_module=True)
    student = online.serving_student("eagle", verifier, str(pair / "drafter"))
    learner = online.OnlineLearner(online.LearnerConfig(kind="eagle", replay_ratio=1e9), student)
    learner.ingest(synthetic_records(4096, verifier.lean.hidden_size, student.lm_head.shape[0]))
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    seconds = []
    while not stop.is_set():
        start = time.perf_counter()
        learner.update()
        seconds.append(time.perf_counter() - start)
        if len(seconds) == 1:
            print("ready", flush=True)  # the first update (one-time costs) is done: the serving side times now
    report.write_text(json.dumps(seconds))


class Learner:
    """A learner process in `mode`, started and running its updates on entry, stopped on exit."""

    def __init__(self, mode: str, pair: Path, report: Path):
        self.cmd = [sys.executable, __file__, "--role", "learner", "--mode", mode, "--pair", str(pair),
                    "--report", str(report)]
        self.report = report

    def __enter__(self):
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc):
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.updates = json.loads(self.report.read_text())[1:]  # the first carried one-time costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("bench", "learner"), default="bench")
    ap.add_argument("--mode", choices=MODES, default="gather")
    ap.add_argument("--report", type=Path)
    ap.add_argument("--pair", type=Path, default=PAIR)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=60, help="forwards of each T per state and round")
    ap.add_argument("--threads", type=int, default=1, help="the verifier's (serve gives the worker half of 2)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--out", default="learner_cost")
    args = ap.parse_args()
    if args.role == "learner":
        return learner_loop(args.mode, args.pair, args.report)
    import tempfile

    import torch

    torch.set_num_threads(args.threads)
    from bench.machine import machine_info
    from bench.step_cost import forward_ms, load
    from specloop.drafter.model.weights.modes import describe_mode

    lean = load(str(args.pair / "verifier"), "own")
    states = ("none", *MODES)
    forward = {(s, T): [] for s in states for T in (1, 5)}
    updates: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for state in states if r % 2 == 0 else states[::-1]:
                learner = None if state == "none" else Learner(state, args.pair, Path(tmp) / f"{state}.json")
                if learner is not None:
                    learner.__enter__()
                for T in (1, 5):
                    forward[(state, T)].append(forward_ms(lean, args.context, T, args.repeats))
                if learner is not None:
                    learner.__exit__(None, None, None)
                    updates[state] += learner.updates
                print(f"round {r} {state:6s}: T=1 {forward[(state, 1)][-1]:.2f} ms, T=5 {forward[(state, 5)][-1]:.2f} ms"
                      + (f", {len(learner.updates)} updates" if learner else ""), flush=True)
    result = {"benchmark": "learner_cost", "machine": machine_info() | {"threads": args.threads},
              "settings": {k: str(v) for k, v in vars(args).items()}, "served": describe_mode(lean),
              "update_ms": {m: statistics.median(u) * 1e3 for m, u in updates.items()},
              "updates": {m: len(u) for m, u in updates.items()},
              "forward_ms": {f"{s}/T{T}": statistics.median(v) for (s, T), v in forward.items()},
              "rounds_ms": {f"{s}/T{T}": v for (s, T), v in forward.items()}}
    result["beside_learner_over_none"] = {
        f"{m}/T{T}": statistics.median(a / b for a, b in zip(forward[(m, T)], forward[("none", T)]))
        for m in MODES for T in (1, 5)}
    for m in MODES:
        print(f"{m}: update {result['update_ms'][m]:.0f} ms (median of {len(updates[m])}); the verifier's forward "
              f"beside it / alone: T=1 {result['beside_learner_over_none'][f'{m}/T1']:.3f}, "
              f"T=5 {result['beside_learner_over_none'][f'{m}/T5']:.3f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.out}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(result, OUT / f"{args.out}.png")
    print(f"wrote {OUT / args.out}.json and .png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar(list(result["update_ms"]), list(result["update_ms"].values()), color=["#c44", "#4a4"])
    a.set_ylabel("ms per update (median)")
    a.set_title("the learner's update (64 records, 1 thread)", fontsize=9)
    keys = ["none", *MODES]
    for i, T in enumerate((1, 5)):
        b.bar([x + 0.38 * i for x in range(3)], [result["forward_ms"][f"{k}/T{T}"] for k in keys], width=0.36,
              label=f"T = {T}")
    b.set_xticks([x + 0.19 for x in range(3)], ["no learner", "beside slices", "beside gather"])
    b.set_ylabel("ms per verifier forward (median)")
    b.set_title(f"the verifier beside it, {result['machine']['threads']} thread(s)", fontsize=9)
    b.legend(fontsize=8)
    fig.suptitle(f"{result['machine']['cpu']}: {result['served']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
