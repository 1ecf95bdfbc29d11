"""Spec-Bench on the real pair: the verifier alone against each speculator, per category, greedy, batch 1.

Spec-Bench (github.com/hemingkx/Spec-Bench, `data/spec_bench/question.jsonl`) is the field's common
yardstick for speculative decoding: 480 questions, 80 each of MT-bench (multi-turn conversation),
translation, summarization, QA, math reasoning and RAG. Its questions come from public datasets under
their own terms, so the file is not committed: get it once and pass its path.

    git clone --depth 1 https://github.com/hemingkx/Spec-Bench /tmp/Spec-Bench
    .venv/bin/python bench/specbench.py --questions /tmp/Spec-Bench/data/spec_bench/question.jsonl \\
        --per-category 6 --max-tokens 256 --out bench/results/specbench.json

Method. One process (what `specloop generate` runs, request by request), 2 threads. The systems take
turns question by question, the first system rotating, so that load on the machine hits all alike. Each
request is one whole request as a user sees it: a fresh engine, the prompt's prefill, the decode to EOS or
--max-tokens; tokens/s = new tokens / wall time, and, as the leaderboard's long answers make it, decode
tokens/s with the prefill excluded. Each system keeps its controller (k auto) and its drafter's state
(suffix decoding's store of earlier outputs) from one request to the next, as a server would. MT-bench:
turn 1, then turn 2 after the verifier's own answer to turn 1 (every system's greedy answer is that one),
the two requests summed. Greedy outputs are compared with the verifier alone's on every request.

Systems (--systems; those whose drafter is missing are skipped and recorded so):
- alone: the verifier alone (`--no-speculation`);
- default: what `specloop generate` / `serve` run with the fetched drafter and no flags;
- eagle, eagle3: a learned head alone (`--speculators none`); eagle3 needs `specloop models fetch
  --drafter-method eagle3`;
- suffix, ngram: model-free (`--drafter-kind suffix|ngram`);
- mix: the eagle head with a frozen static copy and suffix decoding (`--speculators static,suffix`).
- default-global: the default without a request's own evidence of suffix decoding's drafts, nor its tries
  (`per_request` empty: its drafts judged by the calibration over every request alone, as before section 53).
- alone-vector, default-vector: the verifier alone / the default with the int8 products' AMX tiles turned off (what
  a CPU without AMX runs, the same bits: bench/README.md section 60).
- default-ops, eagle-ops: the default / the eagle head alone with the head's draft by torch's ops, as before section
  56 (not one C++ call).

Two runs of the same questions compared request by request (no run: `--compare before=A.json after=B.json`, e.g.
A from `bench/kernels_at.py REV bench/specbench.py ...`): per system and category the geometric mean of after /
before for the prefill and for the whole request, and the prefill's share of a request before; JSON + PNG at --out.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.runs import add_compare, labelled_runs, pyplot  # noqa: E402

CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
# Spec-Bench's leaderboard (Vicuna-7B-v1.3, RTX 3090, greedy, fp16, batch 1): speed-up per category and
# mean accepted tokens per step (τ), for the methods closest to specloop's speculators
LEADERBOARD = {
    "PLD (prompt lookup)": ([1.64, 1.15, 2.46, 1.28, 1.72, 1.71], 1.73),
    "EAGLE": ([2.31, 1.72, 2.00, 1.91, 2.38, 1.75], 3.57),
    "EAGLE-2": ([2.56, 1.78, 2.09, 2.07, 2.66, 1.86], 4.35),
    "SAMD (suffix automaton + EAGLE-2)": ([2.85, 1.83, 2.64, 2.15, 2.63, 2.10], 4.61),
}
SYSTEMS = ("alone", "default", "eagle", "eagle3", "suffix", "ngram", "mix", "default-global", "default-ops",
           "eagle-ops", "alone-vector", "default-vector")
# systems whose int8 products leave the AMX tiles off (kernels.set_amx(False): the vector tiles alone, the same bits;
# bench/README.md section 60); the others run as served, with the tiles where the CPU has them
VECTOR = frozenset({"alone-vector", "default-vector"})
# systems whose controller is not the served one: the default judging suffix decoding's drafts by its calibration
# over every request alone (bench/README.md section 53: no request's own outcomes, no tries)
CONTROLLERS = {"default-global": {"per_request": frozenset()}}


@dataclass
class Question:
    qid: str
    category: str  # one of CATEGORIES
    turns: list[str]


@dataclass
class Run:
    """One system's answer to one question (both turns summed for MT-bench)."""

    system: str
    qid: str
    category: str
    tokens: int = 0
    seconds: float = 0.0  # whole requests: prefill + decode
    prefill_s: float = 0.0
    blocks: int = 0  # speculative blocks (steps that drafted)
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)  # the controller's k at each step it chose one
    speculators: dict[str, int] = field(default_factory=dict)  # blocks by the speculator that drafted them
    token_ids: list[list[int]] = field(default_factory=list)  # per turn


def load_questions(path: Path, per_category: int) -> list[Question]:
    """`per_category` questions of each category, evenly spaced through it in file order (MT-bench's eight
    sub-categories pooled, so its questions span them)."""
    by: dict[str, list[Question]] = {c: [] for c in CATEGORIES}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        cat = "mt_bench" if rec["category"] in MT_BENCH else rec["category"]
        if cat not in by:
            raise ValueError(f"{path}: unknown category {rec['category']!r}")
        turns = rec["turns"]
        turns = ast.literal_eval(turns) if isinstance(turns, str) else turns
        by[cat].append(Question(str(rec["question_id"]), cat, [str(t) for t in turns]))
    return [q for cat in CATEGORIES for q in _spaced(by[cat], per_category)]


def _spaced(items: list, n: int) -> list:
    n = min(n, len(items))
    return [items[(2 * i + 1) * len(items) // (2 * n)] for i in range(n)]


def build_systems(names: list[str], verifier, drafter_dir: Path | None, eagle3_dir: Path | None, kind: str):
    """name -> drafter (None: the verifier alone); names whose drafter is missing map to a reason (str)."""
    from specloop.drafter.kinds.table import build_drafter, default_speculators

    def model(kind_: str, path: Path | None, speculators: tuple[str, ...]):
        if path is None or not path.is_dir():
            return f"skipped: no {kind_} drafter at {path}"
        return build_drafter(kind_, verifier, path, "auto", speculators)

    def by_ops(drafter):  # the eagle head's draft by torch's ops (EagleDrafter._one_call None: before section 56)
        members = () if isinstance(drafter, str) else getattr(drafter, "members", {"": drafter}).values()
        for member in members:
            if hasattr(member, "_one_call"):
                member._one_call = None
        return drafter

    table = {
        "alone": lambda: None,
        "default": lambda: model(kind, drafter_dir, default_speculators(kind)),
        "alone-vector": lambda: None,
        "default-vector": lambda: model(kind, drafter_dir, default_speculators(kind)),
        "default-global": lambda: model(kind, drafter_dir, default_speculators(kind)),
        "default-ops": lambda: by_ops(model(kind, drafter_dir, default_speculators(kind))),
        "eagle": lambda: model(kind, drafter_dir, ()),
        "eagle-ops": lambda: by_ops(model(kind, drafter_dir, ())),
        "eagle3": lambda: model("eagle3", eagle3_dir, ()),
        "suffix": lambda: build_drafter("suffix", verifier, None),
        "ngram": lambda: build_drafter("ngram", verifier, None),
        "mix": lambda: model(kind, drafter_dir, ("static", "suffix")),
    }
    return {name: table[name]() for name in names}


def decode(verifier, drafter, controller, prompt: list[int], max_tokens: int, run: Run,
           params=None, k: int | None = None) -> list[int]:
    """One whole request on a fresh engine (as `specloop generate` runs it); accumulates into `run`. `params`:
    its SamplingParams (default: greedy, `max_tokens`); `k`: the drafter's draft length (None: auto)."""
    from specloop.drafter.decode.capacity import positions_needed
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest, StopRule
    from specloop.drafter.decode.sampling import SamplingParams

    k = 0 if drafter is None else k
    capacity = positions_needed(len(prompt), max_tokens, k, controller.cfg.k_max)
    t0 = time.perf_counter()
    engine = Engine(verifier.lean, drafter, 1, capacity, StopRule(verifier.eos_ids), controller=controller)
    engine.admit([EngineRequest("q", prompt, params or SamplingParams(max_tokens=max_tokens), k)])
    t1 = time.perf_counter()
    tokens, gen = [], None
    while engine.running:
        for u in engine.step():
            tokens += u.new_tokens
            if u.speculator is not None:
                run.speculators[u.speculator] = run.speculators.get(u.speculator, 0) + 1
            gen = u.generation or gen
        if engine.timing.choice is not None:
            run.ks.append(engine.timing.choice.k)
    t2 = time.perf_counter()
    run.tokens += len(tokens)
    run.seconds += t2 - t0
    run.prefill_s += t1 - t0
    stats = gen.stats
    run.blocks += stats.blocks
    run.accepted += stats.accepted
    run.drafted_per_position = _add(run.drafted_per_position, stats.drafted_per_position)
    run.accepted_per_position = _add(run.accepted_per_position, stats.accepted_per_position)
    run.token_ids.append(list(gen.token_ids))
    return list(gen.token_ids)


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def turn_prompts(tokenizer, q: Question, first_answer: str | None) -> list[dict]:
    """The chat messages of turn 1, or of turn 2 after `first_answer`."""
    messages = [{"role": "user", "content": q.turns[0]}]
    if first_answer is not None:
        messages += [{"role": "assistant", "content": first_answer}, {"role": "user", "content": q.turns[1]}]
    return messages


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    from specloop.services.prompts import PromptRecord, encode

    return encode(tokenizer, PromptRecord(id="q", messages=tuple(messages)))


def run_question(verifier, systems: dict, controllers: dict, q: Question, order: list[str], max_tokens: int,
                 both_turns: bool) -> dict[str, Run]:
    """Every system on question q (turn 1 for all, then turn 2 for all), in `order`."""
    from specloop.drafter.model import kernels

    runs = {name: Run(name, q.qid, q.category) for name in order}

    def each(prompt: list[int]) -> None:
        for name in order:
            kernels.set_amx(name not in VECTOR)
            decode(verifier, systems[name], controllers[name], prompt, max_tokens, runs[name])
        kernels.set_amx(True)

    each(encode_chat(verifier.tokenizer, turn_prompts(verifier.tokenizer, q, None)))
    if both_turns and q.category == "mt_bench" and len(q.turns) > 1:
        reference = runs["alone"].token_ids[0] if "alone" in runs else runs[order[0]].token_ids[0]
        answer = verifier.tokenizer.decode(reference, skip_special_tokens=True)
        each(encode_chat(verifier.tokenizer, turn_prompts(verifier.tokenizer, q, answer)))
    return runs


def summarize(runs: list[Run], systems: list[str]) -> dict:
    """Per category and system: tokens/s (whole requests and decode alone), ratios to the verifier alone
    (aggregate, and the median of per-question ratios), τ, per-position acceptance, k, speculators."""
    out: dict[str, dict] = {}
    alone = {(r.qid): r for r in runs if r.system == "alone"}
    for cat in CATEGORIES + ("all",):
        rows = {}
        for name in systems:
            sel = [r for r in runs if r.system == name and (cat == "all" or r.category == cat)]
            if not sel:
                continue
            tokens, seconds = sum(r.tokens for r in sel), sum(r.seconds for r in sel)
            decode_s = seconds - sum(r.prefill_s for r in sel)
            base = [alone[r.qid] for r in sel if r.qid in alone]
            row = {
                "questions": len(sel),
                "tokens": tokens,
                "tokens_per_s": tokens / seconds,
                "decode_tokens_per_s": tokens / decode_s,
                "prefill_share": 1 - decode_s / seconds,
                "identical": sum(r.token_ids == alone[r.qid].token_ids for r in sel if r.qid in alone),
                "tau": 1 + sum(r.accepted for r in sel) / max(1, sum(r.blocks for r in sel)),
                "acceptance_per_position": _ratios(sel),
                "mean_k": statistics.fmean(k for r in sel for k in r.ks) if any(r.ks for r in sel) else 0.0,
                "speculators": dict(sum((Counter(r.speculators) for r in sel), Counter())),
            }
            if base:
                b_tokens, b_seconds = sum(b.tokens for b in base), sum(b.seconds for b in base)
                b_decode = b_seconds - sum(b.prefill_s for b in base)
                row["speedup"] = row["tokens_per_s"] / (b_tokens / b_seconds)
                row["decode_speedup"] = row["decode_tokens_per_s"] / (b_tokens / b_decode)
                row["median_question_speedup"] = statistics.median(
                    (r.tokens / r.seconds) / (alone[r.qid].tokens / alone[r.qid].seconds) for r in sel)
            rows[name] = row
        out[cat] = rows
    for name in systems:  # the leaderboard's "overall": a geometric mean over the six categories
        per = [out[c][name].get("speedup") for c in CATEGORIES if name in out.get(c, {})]
        dec = [out[c][name].get("decode_speedup") for c in CATEGORIES if name in out.get(c, {})]
        if per and all(per):
            out["all"][name]["geomean_speedup"] = math.exp(statistics.fmean(map(math.log, per)))
            out["all"][name]["geomean_decode_speedup"] = math.exp(statistics.fmean(map(math.log, dec)))
    return out


def _ratios(sel: list[Run]) -> list[float]:
    drafted = [0] * max(len(r.drafted_per_position) for r in sel)
    accepted = [0] * len(drafted)
    for r in sel:
        drafted = _add(drafted, r.drafted_per_position)
        accepted = _add(accepted, r.accepted_per_position)
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def table(summary: dict, systems: list[str]) -> str:
    """Markdown: speed-up (whole requests / decode alone) and τ per category, one row per system."""
    head = "| system | " + " | ".join(CATEGORIES) + " | geomean | identical |"
    lines = [head, "|" + "---|" * (len(CATEGORIES) + 3)]
    for name in systems:
        if name == "alone" or name not in summary["all"]:
            continue
        cells = []
        for cat in CATEGORIES:
            r = summary[cat].get(name)
            cells.append("-" if r is None else f"{r['speedup']:.2f}× / {r['decode_speedup']:.2f}× (τ {r['tau']:.2f})")
        a = summary["all"][name]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {a.get('geomean_speedup', 0):.2f}× / "
                     f"{a.get('geomean_decode_speedup', 0):.2f}× | {a['identical']}/{a['questions']} |")
    return "\n".join(lines)


def plot(summary: dict, systems: list[str], path: Path) -> None:
    plt = pyplot()
    shown = [s for s in systems if s != "alone" and s in summary["all"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(shown))
    for panel, key, title in ((0, "speedup", "whole requests"), (1, "decode_speedup", "decode alone")):
        ax = axes[panel]
        for i, name in enumerate(shown):
            vals = [summary[c].get(name, {}).get(key, 0) for c in CATEGORIES]
            ax.bar([x + i * width for x in range(len(CATEGORIES))], vals, width, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(CATEGORIES))])
        ax.set_xticklabels(CATEGORIES, rotation=20, fontsize=8)
        ax.set_ylabel("× the verifier alone")
        ax.set_title(f"Spec-Bench, {title}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, help="Spec-Bench's question.jsonl (required unless --compare)")
    ap.add_argument("--verifier", type=Path, help="default: the fetched pair (specloop models fetch)")
    ap.add_argument("--drafter", type=Path, help="default: the fetched pair's drafter")
    ap.add_argument("--eagle3", type=Path, help="default: the fetched pair's drafter-eagle3, when present")
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--both-turns", action=argparse.BooleanOptionalAction, default=True,
                    help="MT-bench: turn 2 too (after the verifier's answer to turn 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "specbench.json")
    add_compare(ap)
    args = ap.parse_args()
    if args.compare:
        return compare(labelled_runs(args.compare), args.out)
    if args.questions is None:
        ap.error("--questions is required (Spec-Bench's question.jsonl)")

    import torch

    from bench.machine import machine_info
    from specloop.drafter.decode.controller import Controller, ControllerConfig
    from specloop.drafter.kinds.table import resolve_kind
    from specloop.drafter.model.loading import load_model
    from specloop.services.cli.options import DEFAULT_CACHE
    from specloop.trainer.fetch import DEFAULT_MODEL, default_out

    torch.set_num_threads(args.threads)
    pair = default_out(DEFAULT_CACHE, DEFAULT_MODEL)
    verifier_dir, drafter_dir = args.verifier or pair / "verifier", args.drafter or pair / "drafter"
    eagle3_dir = args.eagle3 or pair / "drafter-eagle3"
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system {unknown[0]!r}; choose from {', '.join(SYSTEMS)}")
    if "alone" not in names:
        names.insert(0, "alone")
    questions = load_questions(args.questions, args.per_category)
    verifier = load_model(verifier_dir, weights="auto")
    kind = resolve_kind(None, drafter_dir) or "pretrained"
    built = build_systems(names, verifier, drafter_dir, eagle3_dir, kind)
    skipped = {n: v for n, v in built.items() if isinstance(v, str)}
    systems = {n: v for n, v in built.items() if not isinstance(v, str)}
    order = [n for n in names if n in systems]
    controllers = {n: Controller(ControllerConfig(**CONTROLLERS.get(n, {}))) for n in order}
    print(f"verifier {verifier_dir} served as {verifier.served}; {len(questions)} questions; systems {order}"
          + (f"; skipped {skipped}" if skipped else ""), flush=True)
    runs: list[Run] = []
    for i, q in enumerate(questions):
        rotated = order[i % len(order):] + order[: i % len(order)]
        got = run_question(verifier, systems, controllers, q, rotated, args.max_tokens, args.both_turns)
        runs += got.values()
        line = " ".join(f"{n} {r.tokens / r.seconds:.0f}" for n, r in got.items())
        print(f"[{i + 1}/{len(questions)}] {q.category} {q.qid}: tokens/s {line}", flush=True)
    summary = summarize(runs, order)
    result = {"machine": machine_info(), "threads": args.threads, "verifier": str(verifier_dir),
              "served": verifier.served, "drafter": str(drafter_dir), "kind": kind,
              "per_category": args.per_category, "max_tokens": args.max_tokens, "both_turns": args.both_turns,
              "skipped": skipped, "summary": summary, "leaderboard_vicuna7b_3090": LEADERBOARD,
              "runs": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in runs]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(summary, order, args.out.with_suffix(".png"))
    print(table(summary, order))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def paired_ratios(before: list[dict], after: list[dict]) -> dict:
    """{system: {category: {prefill, whole: geomean of after / before over the requests both ran; per_token: the
    same of seconds per new token (where the answers differ in length, e.g. another KV cache's, whole time mixes
    in the lengths); share: the prefill's mean share of a request before}}}. The i-th run of `after` is paired with
    the i-th of `before` (runs made in turns), its requests by (system, question)."""
    pairs: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for b_run, a_run in zip(before, after):
        first = {(r["system"], r["qid"]): r for r in b_run["runs"]}
        for r in a_run["runs"]:
            if (r["system"], r["qid"]) in first:
                pairs.setdefault((r["system"], r["category"]), []).append((first[r["system"], r["qid"]], r))

    def geomean(values: list[float]) -> float:
        return math.exp(statistics.mean(math.log(v) for v in values))

    def per_token(r: dict) -> float:
        return r["seconds"] / r["tokens"]

    out: dict[str, dict] = {}
    for (system, category), got in sorted(pairs.items()):
        out.setdefault(system, {})[category] = {
            "prefill": geomean([a["prefill_s"] / b["prefill_s"] for b, a in got]),
            "whole": geomean([a["seconds"] / b["seconds"] for b, a in got]),
            "per_token": geomean([per_token(a) / per_token(b) for b, a in got]),
            "share": statistics.mean(b["prefill_s"] / b["seconds"] for b, _ in got), "requests": len(got)}
    return out


def compare(runs: dict[str, list[dict]], out: Path) -> None:
    (before_label, befores), (after_label, afters) = list(runs.items())[:2]
    if len(befores) != len(afters):
        raise SystemExit(f"--compare: {len(befores)} {before_label} run(s) against {len(afters)} {after_label}: "
                         "give as many of each (the i-th of one is paired with the i-th of the other)")
    ratios, after = paired_ratios(befores, afters), afters[-1]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "specbench compare", "labels": [before_label, after_label],
                               "machine": after.get("machine"), "runs": len(afters), "ratios": ratios},
                              separators=(",", ":")) + "\n")
    for system, cats in ratios.items():
        print(f"{system}: " + "; ".join(f"{c} prefill {v['prefill']:.2f}x whole {v['whole']:.2f}x per token "
                                        f"{v['per_token']:.2f}x (prefill {v['share']:.0%} before)"
                                        for c, v in cats.items()))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    cats = [c for c in CATEGORIES if any(c in v for v in ratios.values())]
    labels = [(system, kind) for system in ratios for kind in ("prefill", "whole")]
    width = 0.8 / max(len(labels), 1)
    for i, (system, kind) in enumerate(labels):
        ax.bar([j + i * width for j in range(len(cats))], [ratios[system].get(c, {}).get(kind, 0) for c in cats],
               width, label=f"{system} {kind}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, fontsize=7)
    ax.set_ylabel(f"{after_label} / {before_label}, time")
    ax.set_title(f"Spec-Bench request by request, {(after.get('machine') or {}).get('cpu', '')}", fontsize=8)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
