"""Benchmark: how far suffix decoding can take Spec-Bench on this verifier and machine, by replay.

The verifier's own greedy answers to Spec-Bench questions are decoded once (the verifier alone); then
every position of every answer is replayed through suffix decoding's drafts (specloop.drafter.kinds.suffix: the row's
prompt and answer so far, and the store of earlier answers), and each draft policy is charged the step
costs measured on this machine (bench/step_cost.py's verify ratios v(T) = verify(T) / verify(1), plus
a drafting step's extra overhead). Greedy acceptance is known exactly from the answer itself, so a
policy's decode speed-up is (answer tokens) / Σ(step costs in plain-step units), with no timing noise:

- `all ≤ m` (specloop.drafter.kinds.suffix's own rule: at most k and match-length tokens, every one verified);
- `learned`: each draft cut where the expected tokens per unit of cost peak, from live per-position
  acceptance kept per match-length bucket (what a confidence model can learn online);
- `oracle`: the verify pass covers exactly the drafts that will be accepted (where that pays): a
  ceiling no predictor reaches, for what the answers' overlap with prompts and earlier answers allows.

What it leaves out (and the live benchmark, bench/specbench.py, includes): the lookup's own cost,
prefill, and per-step bookkeeping; so it bounds the live figures from above.

    .venv/bin/python bench/suffix_ceiling.py --questions /tmp/Spec-Bench/data/spec_bench/question.jsonl \
        --step-costs bench/results/step_cost.json --out bench/results/suffix_ceiling.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specloop.drafter.kinds.suffix import Draft, History, OutputStore, SuffixConfig, best_draft  # noqa: E402

PRIOR_SLOPE = 0.2  # v(T) per extra token past the widest measured shape
EXPLORE = 16  # the learned policy verifies one draft of a key it has written off once in this many


@dataclass(frozen=True)
class CostModel:
    """Verify ratios v(1..n) measured on this machine, extended linearly; a drafting step's extra overhead."""

    ratios: tuple[float, ...]  # v(1) = 1, v(2), ...
    overhead: float = 0.06

    def step(self, width: int) -> float:
        """Plain-step units of a step verifying `width` drafts (0: a plain step)."""
        T = width + 1
        v = self.ratios[T - 1] if T <= len(self.ratios) else self.ratios[-1] + PRIOR_SLOPE * (T - len(self.ratios))
        return v + (self.overhead if width else 0.0)


@dataclass
class Table:
    """Per-position acceptance per key (hits, trials), shrunk towards the pooled per-position rate."""

    strength: float = 4.0
    cells: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0.0]))
    pooled: dict = field(default_factory=lambda: defaultdict(lambda: [1.0, 2.0]))

    def rate(self, key, i: int) -> float:
        h, t = self.cells[(key, i)]
        ph, pt = self.pooled[i]
        return (h + self.strength * ph / pt) / (t + self.strength)

    def observe(self, key, width: int, accepted: int) -> None:
        for i in range(min(accepted + 1, width)):
            for cell in (self.cells[(key, i)], self.pooled[i]):
                cell[0] += i < accepted
                cell[1] += 1


def accepted_of(draft: Draft, answer: list[int], at: int) -> int:
    n = 0
    for a, b in zip(draft.tokens, answer[at : at + len(draft.tokens)]):
        if a != b:
            break
        n += 1
    return n


def best_width(gains, costs: CostModel) -> int:
    """The width whose (1 + Σ gains[:W]) per unit of cost is largest (0: a plain step)."""
    best, width, expected = 1.0 / costs.step(0), 0, 1.0
    for i, g in enumerate(gains):
        expected += g
        rate = expected / costs.step(i + 1)
        if rate > best:
            best, width = rate, i + 1
    return width


def replay(answers: list[dict], policy: str, costs: CostModel, k: int, cfg: SuffixConfig) -> dict[str, list[float]]:
    """category -> [answer tokens, plain-step units spent, steps] under one policy."""
    store, table, out = OutputStore(cfg.global_tokens), Table(), defaultdict(lambda: [0.0, 0.0, 0.0])
    idle: dict[int, int] = defaultdict(int)  # drafts left unverified per key since its last trial
    for item in answers:
        prompt, answer = item["prompt"], item["answer"]
        at, row = 0, History(prompt)
        while at < len(answer):
            draft = best_draft(row, store, k, cfg)
            n_all = accepted_of(draft, answer, at)
            key = min(draft.match_len, 8)
            if policy == "oracle":
                width = n_all if n_all and (n_all + 1) / costs.step(n_all) > 1.0 else 0
            elif policy == "learned":
                run, gains = 1.0, []
                for i in range(len(draft.tokens)):
                    run *= table.rate(key, i)
                    gains.append(run)
                width = best_width(gains, costs)
                if draft.tokens and not width:  # a key written off is still tried once in EXPLORE drafts
                    idle[key] += 1
                    width = int(idle[key] % EXPLORE == 0)
            else:
                width = len(draft.tokens)
            n = min(n_all, width)
            table.observe(key, width, n)
            cell = out[item["category"]]
            cell[1] += costs.step(width)
            cell[2] += 1
            row.extend(answer[at : at + n + 1])
            at += n + 1
        out[item["category"]][0] += len(answer)
        store.add(np.asarray(answer, dtype=np.int32))
    return out


def summarize(raw: dict[str, list[float]]) -> dict:
    per = {c: {"speedup": t / u, "tau": t / s} for c, (t, u, s) in raw.items()}
    per["geomean"] = {"speedup": math.exp(sum(math.log(v["speedup"]) for v in per.values()) / len(per))}
    return per


def answers_of(questions: Path, per_category: int, max_tokens: int, threads: int) -> list[dict]:
    """The verifier's greedy answers (turn 1, and MT-bench's turn 2 after it), as bench/specbench.py asks."""
    import torch

    from bench.specbench import Run, decode, encode_chat, load_questions, turn_prompts
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.model.loading import load_model
    from specloop.services.cli.options import DEFAULT_CACHE
    from specloop.trainer.fetch import DEFAULT_MODEL, default_out

    torch.set_num_threads(threads)
    verifier = load_model(default_out(DEFAULT_CACHE, DEFAULT_MODEL) / "verifier", weights="auto")
    out, controller = [], Controller()
    for q in load_questions(questions, per_category):
        first = None
        for turn in range(2 if q.category == "mt_bench" and len(q.turns) > 1 else 1):
            prompt = encode_chat(verifier.tokenizer, turn_prompts(verifier.tokenizer, q, first))
            answer = decode(verifier, None, controller, prompt, max_tokens, Run("alone", q.qid, q.category))
            out.append({"qid": q.qid, "category": q.category, "prompt": prompt, "answer": answer})
            first = verifier.tokenizer.decode(answer, skip_special_tokens=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, required=True, help="Spec-Bench's question.jsonl")
    ap.add_argument("--per-category", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--step-costs", type=Path, help="bench/step_cost.py's JSON (default: its w4a8 ratios)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--answers", type=Path, help="reuse answers saved by an earlier run (JSON)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "suffix_ceiling.json")
    args = ap.parse_args()
    ratios = (1.0, 1.23, 1.36, 1.57, 1.77)  # w4a8 on a 2-core Xeon (AVX-512, AMX), bench/step_cost.py
    if args.step_costs is not None:
        ratios = tuple(step_ratios(json.loads(args.step_costs.read_text())))
    costs = CostModel(ratios)
    if args.answers is not None and args.answers.exists():
        answers = json.loads(args.answers.read_text())
    else:
        answers = answers_of(args.questions, args.per_category, args.max_tokens, args.threads)
        if args.answers is not None:
            args.answers.write_text(json.dumps(answers))
    policies = {"all ≤ m, k 4": ("all", 4, 1.0), "all ≤ m, k 16": ("all", 16, 1.0),
                "learned, k 16": ("learned", 16, 16.0), "oracle, k 4": ("oracle", 4, 16.0),
                "oracle, k 16": ("oracle", 16, 16.0)}
    results = {}
    for name, (policy, k, factor) in policies.items():
        cfg = SuffixConfig(spec_factor=factor, min_prob=0.0 if policy != "all" else SuffixConfig().min_prob)
        results[name] = summarize(replay(answers, policy, costs, k, cfg))
        print(f"{name:>15}: " + "  ".join(f"{c} {v['speedup']:.2f}×" for c, v in results[name].items()), flush=True)
    args.out.write_text(json.dumps({"verify_ratios": list(ratios), "overhead": costs.overhead, "answers": len(answers),
                                    "max_tokens": args.max_tokens, "policies": results}, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}")


def step_ratios(result: dict) -> list[float]:
    """v(T) of specloop's own kernels from bench/step_cost.py's JSON."""
    v = result["kinds"]["own"]["v_T"]
    return [float(v[str(T)]) for T in range(1, len(v) + 1)]


if __name__ == "__main__":
    main()
