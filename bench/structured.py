"""Structured output under speculation on the real pair: 50 JSON schemas × prompts, greedy, batch 1.

For each schema (generated from a pool of typed fields, every one required, no others allowed, strings and arrays
bounded so a whole value fits `--max-tokens`) and its prompt, five systems take turns (the first rotating):
- alone+json: the verifier alone under the schema's grammar;
- spec+json: the default speculator of the fetched pair (what `specloop serve` runs) under the same grammar, with
  what the grammar forces drafted free (`Engine.grammar_drafts`, the default);
- spec+json-unforced: the same without forced drafts (the engine before them);
- alone, spec: the same two without a grammar (the prompt still asks for JSON), for the ratio speculation earns
  without one.
Each speculating system has a drafter of its own (a suffix member's store of earlier outputs holds its own answers
alone). Checks: every grammar output parses and holds exactly the schema's fields; spec+json's (and spec+json-unforced's)
tokens equal alone+json's on every prompt (greedy: lossless under the grammar). Reports τ (tokens per verify pass) and tokens/s with and without
the grammar, and the speed-up of speculation in each case.

    .venv/bin/python bench/structured.py --schemas 50 --max-tokens 160 --out bench/results/structured.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIELDS = {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo", "Cairo"]},
    "active": {"type": "boolean"},
    "score": {"type": "number", "minimum": 0, "maximum": 10},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    "color": {"enum": ["red", "green", "blue", "black"]},
    "price": {"type": "number", "minimum": 0, "maximum": 1000},
    "summary": {"type": "string", "maxLength": 60},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
}
TOPICS = ["a famous scientist", "a city you like", "a new phone", "a book", "a football player", "a recipe",
          "a car", "a movie", "a programming language", "a painting", "a mountain", "a startup", "a song",
          "a museum", "a holiday trip"]
SYSTEMS = ("alone+json", "spec+json", "spec+json-unforced", "alone", "spec")


@dataclass
class Run:
    system: str
    schema: int
    tokens: int = 0
    seconds: float = 0.0
    blocks: int = 0
    token_ids: list[int] = field(default_factory=list)
    parsed: bool | None = None  # grammar systems: the output is a value of the schema


def schemas(n: int, seed: int = 0) -> list[tuple[dict, str]]:
    """n (schema, prompt) pairs: 2–4 fields each, drawn with a fixed seed."""
    rng, out = random.Random(seed), []
    for i in range(n):
        names = rng.sample(sorted(FIELDS), rng.randint(2, 4))
        schema = {"type": "object", "properties": {f: FIELDS[f] for f in names}, "required": names,
                  "additionalProperties": False}
        prompt = f"Describe {TOPICS[i % len(TOPICS)]} as a JSON object with the fields {', '.join(names)}."
        out.append((schema, prompt))
    return out


def decode(verifier, drafter, controller, grammars, prompt: list[int], spec, max_tokens: int, run: Run,
           forced: bool = True) -> None:
    from specloop.drafter.decode.capacity import positions_needed
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest, StopRule
    from specloop.drafter.decode.sampling import SamplingParams

    k = 0 if drafter is None else None
    t0 = time.perf_counter()
    engine = Engine(verifier.lean, drafter, 1, positions_needed(len(prompt), max_tokens, k, controller.cfg.k_max),
                    StopRule(verifier.eos_ids), controller=controller, grammars=grammars, grammar_drafts=forced)
    engine.admit([EngineRequest("q", prompt, SamplingParams(max_tokens=max_tokens), k, grammar=spec)])
    gen = None
    while engine.running:
        gen = next((u.generation for u in engine.step() if u.generation is not None), gen)
    run.seconds = time.perf_counter() - t0
    assert gen is not None
    run.tokens, run.blocks, run.token_ids = len(gen.token_ids), gen.stats.blocks, list(gen.token_ids)


def check(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(schema["required"])


def summarize(runs: list[Run]) -> dict:
    by = {s: [r for r in runs if r.system == s] for s in SYSTEMS}
    out: dict = {}
    for s, rs in by.items():
        tokens, seconds, blocks = sum(r.tokens for r in rs), sum(r.seconds for r in rs), sum(r.blocks for r in rs)
        out[s] = {"requests": len(rs), "tokens": tokens, "tokens_per_s": tokens / seconds if seconds else 0.0,
                  "tau": tokens / blocks if blocks else 0.0}
        if "+json" in s:
            out[s]["parsed"] = sum(bool(r.parsed) for r in rs)

    def speedup(a: str, b: str) -> float:
        ratios = [ra.seconds / rb.seconds * rb.tokens / max(1, ra.tokens) if ra.tokens else 1.0
                  for ra, rb in zip(by[a], by[b])]
        return statistics.median(ratios) if ratios else 0.0

    out["speedup_median"] = {"with_grammar": speedup("alone+json", "spec+json"),
                             "with_grammar_unforced": speedup("alone+json", "spec+json-unforced"),
                             "forced_over_unforced": speedup("spec+json-unforced", "spec+json"),
                             "without": speedup("alone", "spec")}
    for s in ("spec+json", "spec+json-unforced"):
        pairs = list(zip(by["alone+json"], by[s]))
        out[f"identical_under_grammar ({s})"] = sum(a.token_ids == b.token_ids for a, b in pairs)
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = ["no grammar", "JSON, unforced", "JSON, forced drafts"]
    a.bar(labels, [summary[s]["tau"] for s in ("spec", "spec+json-unforced", "spec+json")])
    a.set_title("tokens per verify pass (speculation)")
    speedups = summary["speedup_median"]
    b.bar(labels, [speedups["without"], speedups["with_grammar_unforced"], speedups["with_grammar"]])
    b.axhline(1.0, color="grey", lw=0.8)
    b.set_title("speculation / verifier alone (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", type=Path, help="default: the fetched pair (specloop models fetch)")
    ap.add_argument("--drafter", type=Path, help="default: the fetched pair's drafter")
    ap.add_argument("--schemas", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "structured.json")
    args = ap.parse_args()

    import torch

    from bench.machine import machine_info
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.decode.grammar import GrammarSpec
    from specloop.drafter.kinds.table import build_drafter, default_speculators, resolve_kind
    from specloop.drafter.model.loading import load_model
    from specloop.services.cli.options import DEFAULT_CACHE
    from specloop.services.prompts import PromptRecord, encode
    from specloop.services.worker.worker import grammar_compiler
    from specloop.trainer.fetch import DEFAULT_MODEL, default_out

    torch.set_num_threads(args.threads)
    pair = default_out(DEFAULT_CACHE, DEFAULT_MODEL)
    verifier_dir, drafter_dir = args.verifier or pair / "verifier", args.drafter or pair / "drafter"
    verifier = load_model(verifier_dir, weights="auto")
    kind = resolve_kind(None, drafter_dir) or "pretrained"
    # a drafter per speculating system: a suffix member's store of earlier outputs must not hold another system's
    # answer to the same prompt (spec+json and spec+json-unforced write the same tokens)
    drafters = {s: build_drafter(kind, verifier, drafter_dir, "auto", default_speculators(kind))
                for s in SYSTEMS if s.startswith("spec")}
    grammars = grammar_compiler(verifier.tokenizer, verifier.lean.vocab_size, verifier.eos_ids)
    controllers = {s: Controller() for s in SYSTEMS}
    runs: list[Run] = []
    for i, (schema, text) in enumerate(schemas(args.schemas)):
        prompt = encode(verifier.tokenizer, PromptRecord(str(i), messages=({"role": "user", "content": text},)))
        spec = GrammarSpec("json_schema", json.dumps(schema))
        order = SYSTEMS[i % len(SYSTEMS):] + SYSTEMS[: i % len(SYSTEMS)]
        for s in order:
            run = Run(s, i)
            decode(verifier, drafters.get(s), controllers[s], grammars, prompt,
                   spec if "+json" in s else None, args.max_tokens, run, forced=not s.endswith("-unforced"))
            if "+json" in s:
                run.parsed = check(verifier.tokenizer.decode(run.token_ids, skip_special_tokens=True), schema)
            runs.append(run)
        print(f"schema {i}: " + " ".join(f"{r.system} {r.tokens / r.seconds:.0f} tok/s" for r in runs[-len(SYSTEMS):]),
              flush=True)
    summary = summarize(runs)
    result = {"machine": machine_info(), "threads": args.threads, "verifier": str(verifier_dir),
              "served": verifier.served, "drafter_kind": kind, "schemas": args.schemas,
              "max_tokens": args.max_tokens, "summary": summary, "runs": [asdict(r) for r in runs]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(summary, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
