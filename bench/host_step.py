"""Benchmark: what the graph backend's decode step costs the host, measured on the CPU.

On a GPU a captured step replays in one launch; what remains per step is the host's work around it:
planning, the wrapper's input copies, drafting, the verdict's eager kernels, reading the outcome back,
committing rows, the controller. For a small verifier that host work *is* the step (the reference pair
on an H200: ~1 ms a step, its graph a fraction of that: bench/README.md section 25), and speculation pays
only where a drafting step costs the host less than τ plain ones.

This measures that work without a GPU: the engine's graph backend (GraphDecoder, direct capture) with the
step's model pass replaced by a stub of the same shapes and no arithmetic (its "replay" writes the next
token of a fixed cycle of 13 tokens as one-hot logits: a text every drafter predicts, so τ is k + 1 and the
figures are costs, not a drafter's quality), so the time per step is the host's, plus the CPU's cost of the eager ops the GPU
would launch. Prefills run the real model and are not counted (steps only). Systems: the verifier
alone, n-gram (auto, k=4), the pretrained drafter (its LM stubbed the same way, auto and k=4), eagle
(k=4; its chain's replay costs nothing here, as on a GPU one launch; and k auto: the held chain's drafts are
never accepted, so this is what a drafter the controller should turn off costs) and the served default, eagle
with suffix decoding beside it (k auto). Rows: µs per step, µs per token,
τ, ops dispatched per step outside the stubbed pass (TorchDispatchMode: each one a kernel launch on a
GPU), and a cProfile of one pass per system.

    PYTHONPATH=. .venv/bin/python bench/host_step.py --models ../shared/models --out bench/results/host_step.json
    # before / after a change: run it in each checkout alone, alternating, then pool the runs
    .venv/bin/python bench/host_step.py --compare before=a1.json,a2.json after=b1.json,b2.json --out cmp.json
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from bench.runs import add_compare, labelled_runs  # noqa: E402
from specloop.drafter.kinds import eagle  # noqa: E402
from specloop.drafter.model import graph  # noqa: E402
from specloop.drafter.model.graph import GraphDecoder, decoder_key  # noqa: E402
from specloop.drafter.model.weights.linears import Dense  # noqa: E402

# the step's outputs as this checkout's static_forward returns them (an earlier commit's had no argmax: the same
# script measures it, for a before / after)
THREE_OUTPUTS = "argmax" in inspect.getsource(graph.static_forward)
STUB_S = [0.0]  # seconds spent in stubbed passes (what a GPU replays): subtracted from the steps' time
PERIOD, FIRST = 13, 100  # the stub's text: FIRST, FIRST + 1, ..., FIRST + PERIOD - 1, FIRST, ...


class StubStep:
    """The static step's signature and outputs, without the model: logits one-hot at the map's next token
    for every query, that token as the step's argmax, zeros for the captured layers' residual streams."""

    def __init__(self, lean):
        # fp32 logits: a bf16 argmax over the vocabulary costs the CPU ~100 µs (not vectorised), a GPU ~nothing;
        # this measures the host, not the CPU's arithmetic
        self.vocab, self.hidden_size, self.dtype = lean.vocab_size, lean.hidden_size, torch.float32

    def __call__(self, keys, values, tokens, n_new, lens, bias, capture, last_only):
        S, W = tokens.shape
        with _disable_current_modes():  # not counted: the pass a GPU replays in one launch
            at = tokens if not last_only else tokens.gather(1, (n_new - 1).clamp(min=0)[:, None])
            nxt = (at - FIRST + 1) % PERIOD + FIRST
            logits = torch.zeros(S, at.shape[1], self.vocab, dtype=self.dtype).scatter_(2, nxt[:, :, None], 1.0)
            hidden = tuple(torch.zeros(S, W, self.hidden_size, dtype=self.dtype) for _ in capture)
        return (logits, hidden, nxt) if THREE_OUTPUTS else (logits, hidden)


def stub_graphs(lean, slots: int, width: int) -> GraphDecoder:
    """The GraphDecoder an engine of `slots` rows and step width `width` finds for `lean` (on_backend's key,
    compiled off), replaying `StubStep` as a captured graph would."""
    dec = GraphDecoder(lean, slots, width, compiled=False, direct=True)
    dec.step_fn = StubStep(lean)
    lean.__dict__.setdefault("_graph_decoders", {})[decoder_key(lean, slots, width, False)] = dec
    return dec


class HeldReplay(graph.Replay):
    """A drafter's captured chain (the eagle head's) as a GPU replays it, costing the host one call: its outputs
    are those of the capture (the stub's text makes the drafts irrelevant to the cost)."""

    def __init__(self, fn, buffers):
        self.buffers = buffers
        self.out = fn(*buffers)
        self.replay = lambda: None


def _timed_rerun(call):
    """graph._rerun (a replay calls again and copies into the first call's outputs), its time counted as the
    stub's and its ops not counted: on a GPU it is one launch."""
    out = call()

    def replay() -> None:
        t0 = time.perf_counter()
        with _disable_current_modes():
            for mine, new in zip(graph._flat(out), graph._flat(call())):
                mine.copy_(new)
        STUB_S[0] += time.perf_counter() - t0
    return replay, out


class OpCount(TorchDispatchMode):
    """Ops dispatched (each a kernel launch on a GPU) outside the stubbed pass."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.paused = True  # counting only while a step runs (StepTimer)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not self.paused
        return func(*args, **(kwargs or {}))


@dataclass
class System:
    name: str
    kind: str | None
    k: int | None
    step_us: list[float] = field(default_factory=list)
    token_us: list[float] = field(default_factory=list)
    tau: float | None = None
    ops_per_step: float | None = None
    profile: list[str] = field(default_factory=list)


class StepTimer:
    """Engine.step wrapped for a block: seconds in steps and how many (prefills are not steps); a `counter` given
    counts the ops of the steps only."""

    def __init__(self, counter: OpCount | None = None):
        self.counter, self.seconds, self.steps = counter, 0.0, 0

    def __enter__(self):
        from specloop.drafter.decode.engine import Engine

        self.saved = saved = Engine.step

        def timed(engine, *a, **kw):
            t0, stub0 = time.perf_counter(), STUB_S[0]
            if self.counter is not None:
                self.counter.paused = False
            try:
                return saved(engine, *a, **kw)
            finally:
                if self.counter is not None:
                    self.counter.paused = True
                self.seconds += time.perf_counter() - t0 - (STUB_S[0] - stub0)
                self.steps += 1
        Engine.step = timed
        return self

    def __exit__(self, *exc):
        from specloop.drafter.decode.engine import Engine

        Engine.step = self.saved


def build(kind: str | None, verifier, models: Path, slots: int):
    from specloop.drafter.kinds.table import build_drafter

    if kind is None:
        return None
    base, _, beside = kind.partition("+")  # "eagle+suffix": the served default, a mix of speculators
    path = models / "drafter" if base == "pretrained" else None
    drafter = build_drafter(base, verifier, path, speculators=(beside,) if beside else ())
    head = drafter.members["adaptive"] if beside else drafter  # type: ignore[attr-defined]
    if base == "eagle":  # the CPU's prepared linears (Dense) as the plain tensors a GPU's head holds: the chain runs
        plain = tuple(graph._float_weight(w)[0] if isinstance(w, Dense) else w for w in head.weights())
        head.weights = lambda: plain
    lm = getattr(drafter, "lean", None)
    width = getattr(drafter, "graph_width", 0)
    if width and lm is not None:
        stub_graphs(getattr(lm, "eager", lm), slots, width)
    return drafter


def run_pass(verifier, drafter, prompts, batch: int, k: int | None, max_tokens: int,
             counter: OpCount | None = None, controller=None):
    from specloop.drafter.decode.engine import generate
    from specloop.drafter.decode.requests import StopRule
    from specloop.drafter.decode.sampling import SamplingParams

    params, rule, gens = SamplingParams(max_tokens=max_tokens), StopRule(verifier.eos_ids), []
    with StepTimer(counter) as timer:
        for lo in range(0, len(prompts), batch):
            gens += generate(verifier.lean, drafter, prompts[lo: lo + batch], params, k, rule, backend="graph",
                             controller=controller)
    tokens = sum(len(g.token_ids) for g in gens)
    blocks = sum(g.stats.blocks for g in gens)
    tau = (sum(g.stats.accepted for g in gens) + blocks) / blocks if blocks else None
    return timer, tokens, tau


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=ROOT.parent / "shared" / "models")
    ap.add_argument("--prompts", type=int, default=8, help="prompts (synthetic: the stub's text)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--systems", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kept-controller", action="store_true",
                    help="k auto: one controller per system over every pass, as a server keeps its engine's (default: "
                         "a new one per generate() call, each batch of prompts)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "host_step.json")
    add_compare(ap)
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare, args.out)
    torch.set_num_threads(args.threads)
    # the model passes and the eagle chain are stubbed or held (a GPU replays them in one launch): nothing to
    # compile, and the stub stands under the uncompiled step's key (`stub_graphs`)
    os.environ["SPECLOOP_COMPILE"] = "0"
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.model.loading import load_model

    graph._rerun = _timed_rerun
    eagle.Replay = HeldReplay
    verifier = load_model(args.models / "verifier", device=torch.device("cpu"), weights="bf16")
    # prompts in the stub's own text, each starting elsewhere in the cycle (prefills are real: short)
    prompts = [[FIRST + (i + j) % PERIOD for j in range(24)] for i in range(args.prompts)]
    kinds = [("alone", None, 0), ("ngram-auto", "ngram", None), ("ngram-k4", "ngram", 4),
             ("pretrained-auto", "pretrained", None), ("pretrained-k4", "pretrained", 4),
             ("eagle-auto", "eagle", None), ("eagle-k4", "eagle", 4),
             ("eagle+suffix-auto", "eagle+suffix", None)]  # the served default last
    wanted = set(args.systems.split(",")) if args.systems else None
    report = {"benchmark": "host_step", "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": args.threads, "controllers": "kept" if args.kept_controller else "one per generate()",
              "verifier": str(args.models / "verifier"), "served": verifier.served,
              "prompts": args.prompts, "max_tokens": args.max_tokens, "batches": {}}
    for batch in map(int, args.batches.split(",")):
        stub_graphs(verifier.lean, batch, 5)  # the controller's default k_max 4: W = 5
        systems = [System(n, kind, k) for n, kind, k in kinds if wanted is None or n in wanted]
        drafters = {s.name: build(s.kind, verifier, args.models, batch) for s in systems}
        kept = {s.name: Controller() if args.kept_controller and s.k is None else None for s in systems}
        for r in range(args.rounds + 1):
            for s in systems if r % 2 == 0 else systems[::-1]:
                timer, tokens, tau = run_pass(verifier, drafters[s.name], prompts, batch, s.k, args.max_tokens,
                                              controller=kept[s.name])
                if r:  # pass 0 warms
                    s.step_us.append(1e6 * timer.seconds / timer.steps)
                    s.token_us.append(1e6 * timer.seconds / tokens)
                s.tau = tau
        for s in systems:
            s.profile = profile(verifier, drafters[s.name], prompts, batch, s, args.max_tokens)
            s.ops_per_step = step_ops(verifier, drafters[s.name], prompts, batch, s, args.max_tokens)
        base = statistics.median(systems[0].token_us)
        report["batches"][batch] = {s.name: {
            "step_us_median": statistics.median(s.step_us), "token_us_median": statistics.median(s.token_us),
            "x_alone_per_token": base / statistics.median(s.token_us), "tau": s.tau,
            "ops_per_step": s.ops_per_step, "step_us_rounds": s.step_us, "profile": s.profile} for s in systems}
        for s in systems:
            row = report["batches"][batch][s.name]
            print(f"batch {batch} {s.name:16s} {row['step_us_median']:7.0f} µs/step {row['token_us_median']:6.0f} "
                  f"µs/token  x{row['x_alone_per_token']:.2f}  τ {s.tau or 0:.2f}  ops/step {s.ops_per_step:.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, separators=(",", ":")) + "\n")
    plot({"this checkout": [report]}, args.out.with_suffix(".png"))


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """µs per step and ops per step of each system, per batch size: one bar per label (`runs`: label -> reports
    of that checkout, medians pooled over them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(runs.values()))[0]["batches"]
    fig, axes = plt.subplots(2, len(first), figsize=(6 * len(first), 8), squeeze=False)
    for col, batch in enumerate(first):
        names = list(first[batch])
        for row, (key, unit) in enumerate((("step_us_rounds", "host µs per step (median)"),
                                             ("ops_per_step", "ops dispatched per step"))):
            ax, width = axes[row, col], 0.8 / len(runs)
            for i, (label, reports) in enumerate(runs.items()):
                values = [statistics.median(_pooled(reports, batch, n, key)) for n in names]
                ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=30, ha="right")
            ax.set(ylabel=unit, title=f"batch {batch}")
            ax.legend()
    fig.suptitle("the graph backend's host work per decode step (model pass stubbed; CPU, 1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _pooled(reports: list[dict], batch: str, name: str, field: str) -> list[float]:
    values = [r["batches"][batch][name][field] for r in reports]
    return [v for x in values for v in (x if isinstance(x, list) else [x])]


def compare(labelled: list[str], out: Path) -> None:
    """Before / after: `labelled` = ["label=run1.json,run2.json", ...] (each checkout run alone, alternating
    with the others), pooled into one JSON and one PNG."""
    runs = labelled_runs(labelled)
    table = {label: {batch: {name: {"step_us_median": statistics.median(_pooled(reports, batch, name, "step_us_rounds")),
                                    "ops_per_step": reports[0]["batches"][batch][name]["ops_per_step"],
                                    "tau": reports[0]["batches"][batch][name]["tau"]}
                             for name in reports[0]["batches"][batch]} for batch in reports[0]["batches"]}
             for label, reports in runs.items()}
    out.write_text(json.dumps({"benchmark": "host_step compare", "medians": table, "runs": runs}, separators=(",", ":")) + "\n")
    plot(runs, out.with_suffix(".png"))


def step_ops(verifier, drafter, prompts, batch: int, s: System, max_tokens: int) -> float:
    """Ops dispatched per step (prefills excluded: the counter counts inside Engine.step only)."""
    counter = OpCount()
    with counter:
        timer, _, _ = run_pass(verifier, drafter, prompts, batch, s.k, max_tokens, counter)
    return counter.ops / max(1, timer.steps)


def profile(verifier, drafter, prompts, batch: int, s: System, max_tokens: int, top: int = 30) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    run_pass(verifier, drafter, prompts, batch, s.k, max_tokens)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue().splitlines()[: top + 12]


if __name__ == "__main__":
    main()
