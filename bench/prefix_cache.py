"""Benchmark: multi-turn chat with prefix caching on and off — time to first token per turn, and the hit rate.

A --turns-turn chat through the engine (one slot, greedy, the reference pair): turn 1 is a system prompt and the
first user message of ../shared/prompts/chat_dev.jsonl; every later turn re-renders the whole conversation with the
tokenizer's chat template (the previous answer as the assistant's message, then the next record's user message), as
an OpenAI-style server does. Each round runs the chat once with the prefix cache (drafter/decode/prefix_cache.py,
a fresh one per chat) and once without, in alternating order, each on a fresh engine; a short warm-up chat first.
Per turn: the admission (the prefill, cache hit copied in) and the time to first token (admission + the first step),
medians over --rounds; the tokens served from the cache; and, cache on, the seconds the engine's idle work spends
prefilling the answer into the cache (`Engine.cache_finished`, between turns: the user's think time, off every
step's path). Greedy outputs must be identical on and
off (recorded). Target: with the cache on, turn 10's TTFT ≤ 1.5× turn 1's.

    .venv/bin/python bench/prefix_cache.py --turns 10 --rounds 5 --threads 2
Writes bench/results/prefix_cache.json and .png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from specloop.drafter.decode import prefix_cache as prefix_module  # noqa: E402
from specloop.drafter.decode.engine import Engine  # noqa: E402
from specloop.drafter.decode.prefix_cache import BLOCK_SIZE, PrefixCache  # noqa: E402
from specloop.drafter.decode.requests import EngineRequest, StopRule  # noqa: E402
from specloop.drafter.decode.sampling import SamplingParams  # noqa: E402
from specloop.drafter.kinds.table import build_drafter  # noqa: E402
from specloop.drafter.model.loading import load_model  # noqa: E402
from specloop.services.prompts import load_prompts  # noqa: E402

SHARED = ROOT.parent / "shared"
OUT = ROOT / "bench" / "results"
SYSTEM = "You are a helpful assistant. Answer the user's questions clearly and keep the conversation going."


def user_messages(turns: int) -> list[str]:
    records = load_prompts(SHARED / "prompts" / "chat_dev.jsonl")
    texts = [m["content"] for r in records if r.messages for m in r.messages if m["role"] == "user"]
    return texts[:turns]


def render(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class FinishClock:
    """Seconds spent in `cache_output` (the finish's prefill of the answer), by wrapping the engine module's name."""

    def __init__(self):
        self.seconds = 0.0
        import specloop.drafter.decode.engine as engine_module

        self.module, self.inner = engine_module, prefix_module.cache_output

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return self.inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t

        engine_module.cache_output = timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def chat(verifier, drafter_factory, rule, messages_in: list[str], cached: bool, args, clock: FinishClock) -> dict:
    """One chat on a fresh engine; per turn: prompt tokens, hit tokens, admit / TTFT / finish seconds, answer."""
    tok = verifier.tokenizer
    prefix = PrefixCache(args.budget, args.block_size, outputs=not args.prompts_only) if cached else None
    engine = Engine(verifier.lean, drafter_factory(), 1, args.capacity, rule, prefix_cache=prefix)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for t, text in enumerate(messages_in):
        messages.append({"role": "user", "content": text})
        prompt = render(tok, messages)
        hits0 = prefix.stats().hits if prefix is not None else 0
        clock.take()
        t0 = time.perf_counter()
        engine.admit([EngineRequest(f"t{t}", prompt, SamplingParams(max_tokens=args.max_tokens), args.k, t)])
        t1 = time.perf_counter()
        updates = engine.step()
        t2 = time.perf_counter()
        done = next((u.generation for u in updates if u.generation is not None), None)
        while done is None:
            done = next((u.generation for u in engine.step() if u.generation is not None), None)
        engine.cache_finished()  # the user's think time: what the serving loop does when idle
        answer = done.token_ids
        turns.append({"prompt_tokens": len(prompt), "hit_tokens": (prefix.stats().hits if prefix else 0) - hits0,
                      "admit_s": t1 - t0, "ttft_s": t2 - t0, "finish_cache_s": clock.take(), "answer": answer})
        messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
    return {"turns": turns, "stats": None if prefix is None else vars(prefix.stats())}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = list(range(1, len(result["median"]["on"]["ttft_s"]) + 1))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, style in (("off", "o--"), ("on", "s-")):
        axes[0].plot(turns, [1000 * s for s in result["median"][mode]["ttft_s"]], style, label=f"cache {mode}")
    axes[0].set_xlabel("turn")
    axes[0].set_ylabel("TTFT, ms (median)")
    axes[0].set_title(f"time to first token ({result['threads']} threads)")
    axes[0].legend()
    axes[1].bar(turns, result["hit_rate_by_turn"])
    axes[1].set_ylim(0, 1)
    axes[1].set_xlabel("turn")
    axes[1].set_ylabel("prompt tokens served from the cache")
    axes[1].set_title(f"hit rate (all turns {result['hit_rate']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64, help="each answer's budget (EOS honoured)")
    ap.add_argument("--kind", default="none", help="drafter kind (none: the verifier alone, k = 0)")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    ap.add_argument("--budget", type=int, default=8192, help="prefix cache positions")
    ap.add_argument("--prompts-only", action="store_true", help="cache prompts only, not finished answers")
    ap.add_argument("--capacity", type=int, default=2048)
    ap.add_argument("--verifier", type=Path, default=SHARED / "models" / "verifier")
    ap.add_argument("--drafter", type=Path, default=SHARED / "models" / "drafter")
    ap.add_argument("--weights", default="auto", help="the verifier's weight mode (auto: as served, its manifest's)")
    ap.add_argument("--out", type=Path, default=OUT / "prefix_cache.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    verifier = load_model(args.verifier, weights=args.weights)
    rule = StopRule(verifier.eos_ids)
    args.k = 0 if args.kind == "none" else None

    def drafter_factory():
        if args.kind == "none":
            return None
        return build_drafter(args.kind, verifier, args.drafter if args.kind in ("pretrained", "sd2") else None)

    clock = FinishClock()
    texts = user_messages(args.turns)
    chat(verifier, drafter_factory, rule, texts[:2], True, args, clock)  # warm-up
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            runs[mode].append(chat(verifier, drafter_factory, rule, texts, mode == "on", args, clock))
        last = {m: runs[m][-1]["turns"][-1]["ttft_s"] for m in runs}
        print(f"round {r + 1}: last turn's TTFT on {last['on'] * 1000:.1f} ms, off {last['off'] * 1000:.1f} ms",
              flush=True)
    median = {m: {key: [statistics.median(run["turns"][t][key] for run in runs[m]) for t in range(len(texts))]
                  for key in ("admit_s", "ttft_s", "finish_cache_s")} for m in runs}
    first = runs["on"][0]["turns"]
    identical = all(run["turns"][t]["answer"] == first[t]["answer"] for m in runs for run in runs[m]
                    for t in range(len(texts)))
    on = median["on"]["ttft_s"]
    result = {
        "machine": machine_info() | {"threads": args.threads}, "threads": args.threads, "turns": len(texts),
        "rounds": args.rounds, "max_tokens": args.max_tokens, "kind": args.kind, "block_size": args.block_size,
        "budget": args.budget, "outputs_cached": not args.prompts_only, "served": verifier.served,
        "prompt_tokens": [t["prompt_tokens"] for t in first], "answer_tokens": [len(t["answer"]) for t in first],
        "hit_tokens": [t["hit_tokens"] for t in first],
        "hit_rate_by_turn": [t["hit_tokens"] / t["prompt_tokens"] for t in first],
        "hit_rate": sum(t["hit_tokens"] for t in first) / sum(t["prompt_tokens"] for t in first),
        "median": median,
        "ttft_last_over_first_on": on[-1] / on[0],
        "ttft_last_over_first_off": median["off"]["ttft_s"][-1] / median["off"]["ttft_s"][0],
        "ttft_on_over_off_by_turn": [a / b for a, b in zip(on, median["off"]["ttft_s"])],
        "target_last_over_first_le_1_5": on[-1] / on[0] <= 1.5,
        "greedy_identical_on_off": identical,
        "runs": {m: [[{k: v for k, v in t.items() if k != "answer"} for t in run["turns"]] for run in runs[m]]
                 for m in runs},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("prompt_tokens", "hit_tokens", "hit_rate", "ttft_last_over_first_on",
                                             "ttft_last_over_first_off", "greedy_identical_on_off")}))
    for t in range(len(texts)):
        print(f"turn {t + 1:2d}: {result['prompt_tokens'][t]:5d} tokens, {result['hit_tokens'][t]:5d} cached, TTFT on "
              f"{on[t] * 1000:7.1f} ms, off {median['off']['ttft_s'][t] * 1000:7.1f} ms, finish "
              f"{median['on']['finish_cache_s'][t] * 1000:6.1f} ms")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
