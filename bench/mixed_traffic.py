"""Benchmark: free drafts under mixed traffic, one controller for every request (as a server keeps it).

A server's controller sees every request. Suffix decoding's drafts fail on sampled chat and are taken on grounded
requests (a summary or an answer that copies its source): judged by one calibration over all requests, the chat
that came first can teach the gate to cut every suffix draft, and a draft the gate cuts is never verified, so the
grounded requests after it are decoded plain (bench/README.md section 53). This replays such traffic: sampled chat
(the held-out chat prompts at --temperature), then grounded greedy requests (Spec-Bench's summarization and RAG
questions), then the chat again, through each system in turn, request by request, each system keeping its
controller and its drafter's state throughout:

- alone: the verifier alone;
- default: the served default (the fetched eagle head with suffix decoding, k auto);
- default-global: the same without a request's own evidence of suffix decoding's drafts, nor its tries
  (`per_request` empty; up to 61d2b31 the gate of before section 53 exactly; since, it has the section's other two
  changes: sampled rows calibrated apart, probes never cut).

Each system's controller after each request (its cost ratios and overheads, probe interval, calibration) is in
the JSON's "controllers": what a run that stopped drafting knew.

Per phase: tokens/s over the verifier alone (aggregate over the phase's requests, and the median of per-request
ratios, decode only: prefill excluded), τ, the free (suffix) drafts verified and accepted. Greedy outputs are
compared with the verifier alone's.

With `--k N` the drafting systems draft N on every step (no controller choice): the head drafts throughout, as it
does where it pays (a GPU), and the mix of speculators alone picks each row's speculator (bench/README.md section 54).

    .venv/bin/python bench/mixed_traffic.py --questions /tmp/Spec-Bench/data/spec_bench/question.jsonl \\
        --threads 1 --out mixed_traffic
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.specbench import CONTROLLERS, Run, build_systems, decode, encode_chat, load_questions  # noqa: E402

SYSTEMS = ("alone", "default", "default-global")


def traffic(tokenizer, questions: Path, chat: int, grounded: int) -> list[tuple[str, list[int], bool]]:
    """(phase, prompt, sampled) in order: chat, grounded, chat again."""
    from bench.runs import held_out_prompts

    chats = held_out_prompts(tokenizer, chat)[:chat]  # chat_dev's last `chat`
    qs = [q for q in load_questions(questions, grounded) if q.category in ("summarization", "rag")] if grounded else []
    firsts = [encode_chat(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in qs]
    half = len(chats) // 2
    return ([("chat", p, True) for p in chats[:half]] + [("grounded", p, False) for p in firsts]
            + [("chat again", p, True) for p in chats[half:]])


def controller_state(c) -> dict:
    """What a controller knows after a request: its cost ratios and overheads (value, samples), its probe interval
    and idle steps, suffix decoding's calibration and the lookups' wait."""
    cells = lambda table: {str(k): [round(e.value, 3), e.n] for k, e in table.items()}  # noqa: E731
    return {"ratio": cells(c.costs.ratio), "overhead": cells(c.costs.overhead), "resync": cells(c.costs.resync),
            "interval": c.interval, "idle": c.idle, "steps": c.costs.steps,
            "c_suffix": round(c.confidence_scale("suffix"), 3), "lookup_wait": c.lookup_wait}


def phase_summary(runs: list[Run], systems: list[str], phase: str) -> dict:
    """One phase's figures per system (see the module doc)."""
    sel = {s: [r for r in runs if r.system == s and r.category == phase] for s in systems}
    decode_rate = lambda r: r.tokens / max(r.seconds - r.prefill_s, 1e-9)  # noqa: E731
    alone = sel["alone"]
    out = {}
    for s in systems:
        mine = sel[s]
        tokens, seconds = sum(r.tokens for r in mine), sum(r.seconds - r.prefill_s for r in mine)
        base = sum(r.tokens for r in alone) / sum(r.seconds - r.prefill_s for r in alone)
        blocks, accepted = sum(r.blocks for r in mine), sum(r.accepted for r in mine)
        free = [r.speculators.get("suffix", 0) for r in mine]
        out[s] = {"requests": len(mine), "tokens": tokens, "decode_tok_s": tokens / seconds,
                  "x_alone": tokens / seconds / base,
                  "x_alone_median": statistics.median(decode_rate(r) / decode_rate(a) for r, a in zip(mine, alone)),
                  "tau": (accepted + blocks) / blocks if blocks else 1.0, "suffix_blocks": sum(free)}
    return out


def plot(summary: dict, path: Path) -> None:
    """Per phase: each system's tokens/s over the verifier alone, and its τ."""
    from bench.runs import plot_arms

    cells = {p: {f"{s}_{key}": f[key] for s, f in phases.items() for key in ("x_alone", "tau")}
             for p, phases in summary.items()}
    plot_arms(cells, SYSTEMS[1:], (("x_alone", "× the verifier alone (decode)", "tokens/s"),
                                    ("tau", "tokens per verify pass", "τ")), path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, required=True, help="Spec-Bench's question.jsonl")
    ap.add_argument("--chat", type=int, default=12, help="held-out chat prompts (half before, half after)")
    ap.add_argument("--grounded", type=int, default=5, help="Spec-Bench questions of each grounded category")
    ap.add_argument("--temperature", type=float, default=1.0, help="the chat requests' temperature")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=None,
                    help="the drafting systems' k (default: auto); a fixed k drafts every step, as the controller "
                         "does where the head pays (a GPU): the mix alone then picks each row's speculator")
    ap.add_argument("--threads", type=int, default=1, help="1: a `specloop serve` worker's on a 2-core machine")
    ap.add_argument("--out", default="mixed_traffic", help="bench/results/<out>.json")
    args = ap.parse_args()

    import torch

    from bench.machine import machine_info
    from bench.whole_process import PAIR
    from specloop.drafter.decode.controller import Controller, ControllerConfig
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.model.loading import load_model

    torch.set_num_threads(args.threads)
    verifier = load_model(PAIR / "verifier", weights="auto")
    systems = build_systems(list(SYSTEMS), verifier, PAIR / "drafter", None, "eagle")
    controllers = {n: Controller(ControllerConfig(**CONTROLLERS.get(n, {}))) for n in SYSTEMS}
    requests = traffic(verifier.tokenizer, args.questions, args.chat, args.grounded)
    runs: list[Run] = []
    states: list[dict] = []  # each system's controller after each request: what a run that stopped drafting knew
    identical = 0
    for i, (phase, prompt, sampled) in enumerate(requests):
        params = SamplingParams(args.temperature if sampled else 0.0, max_tokens=args.max_tokens, seed=i)
        order = SYSTEMS[i % len(SYSTEMS):] + SYSTEMS[:i % len(SYSTEMS)]
        got = {}
        for name in order:
            got[name] = Run(name, str(i), phase)
            decode(verifier, systems[name], controllers[name], prompt, args.max_tokens, got[name], params,
                   args.k)
            if systems[name] is not None:
                states.append({"request": i, "system": name, "k_chosen": dict(Counter(got[name].ks)),
                               **controller_state(controllers[name])})
        runs += got.values()
        identical += not sampled and all(r.token_ids == got["alone"].token_ids for r in got.values())
        print(f"[{i + 1}/{len(requests)}] {phase}: " + " ".join(
            f"{n} {r.tokens / (r.seconds - r.prefill_s):.0f} tok/s (suffix blocks {r.speculators.get('suffix', 0)})"
            for n, r in got.items()), flush=True)
    phases = list(dict.fromkeys(p for p, _, _ in requests))
    summary = {p: phase_summary(runs, list(SYSTEMS), p) for p in phases}
    greedy = sum(not s for _, _, s in requests)
    result = {"machine": machine_info(), "threads": args.threads, "temperature": args.temperature, "k": args.k,
              "max_tokens": args.max_tokens, "greedy_identical": f"{identical}/{greedy}", "summary": summary,
              "runs": [{k: v for k, v in r.__dict__.items() if k not in ("token_ids", "ks")} for r in runs],
              "controllers": states}
    out = ROOT / "bench" / "results" / f"{args.out}.json"
    out.write_text(json.dumps(result, separators=(",", ":")))
    plot(summary, out.with_suffix(".png"))
    for p in phases:
        for s, f in summary[p].items():
            print(f"{p:>10} {s:>15}: {f['x_alone']:.3f}x (median {f['x_alone_median']:.3f}), tau {f['tau']:.2f}, "
                  f"suffix blocks {f['suffix_blocks']}")
    print(f"greedy identical {identical}/{greedy}; wrote {out}")


if __name__ == "__main__":
    main()
