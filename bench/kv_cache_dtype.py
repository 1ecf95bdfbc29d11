"""Benchmark: what a 16-bit KV cache changes in a model's logits (`--kv-cache-dtype bfloat16 | float16`).

Teacher-forced, so that one different token does not change everything after it: each prompt of --prompts (its
first --limit), followed by the fp32 cache's own greedy answer of --answer tokens, is fed through the model in
16-token passes with the cache in fp32, bf16 and fp16; at every answer position the logits are compared with the
fp32 cache's: top-1 agreement, negative log-likelihood of the answer's tokens, |logit difference| median and max.
The step costs of the same caches: `bench/step_cost.py --kinds own,own-bf16kv,own-f16kv`.

    .venv/bin/python bench/kv_cache_dtype.py                                  # the fetched verifier, as served
    .venv/bin/python bench/kv_cache_dtype.py --verifier ../shared/models/verifier --weights fp32 --out kv_quality_ref
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results"
DEFAULT_VERIFIER = Path.home() / ".cache" / "specloop" / "models" / "smollm2-135m-instruct" / "verifier"
CACHES = ("float32", "bfloat16", "float16")


def forced_logits(lean, ids: list[int], start: int):
    """The logits predicting ids[start:], the whole sequence fed in 16-token passes (the cache's dtype: the
    environment's, as a worker's)."""
    import torch

    cache = lean.new_cache(1, len(ids) + 64)
    with torch.no_grad():
        parts = [lean.forward(cache, torch.tensor([ids[i : i + 16]])).logits[0] for i in range(0, len(ids), 16)]
    return torch.cat(parts)[start - 1 : len(ids) - 1].float()


def greedy_answer(lean, prompt: list[int], n: int, eos: list[int]) -> list[int]:
    """The engine's own greedy decoding of `prompt` alone (up to n tokens, EOS dropped)."""
    from specloop.drafter.decode.engine import generate
    from specloop.drafter.decode.requests import StopRule
    from specloop.drafter.decode.sampling import SamplingParams

    return generate(lean, None, [prompt], SamplingParams(max_tokens=n), 0, StopRule(eos))[0].token_ids


def compare(base: list, other: list) -> dict:
    import torch
    import torch.nn.functional as F

    n = sum(len(t) for _, t in base)
    diffs = torch.cat([(a - b).abs().flatten() for (a, _), (b, _) in zip(base, other)])
    return {"positions": n,
            "top1_agreement": sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for (a, _), (b, _) in zip(base, other)) / n,
            "nll_per_token": sum(float(F.cross_entropy(a, t, reduction="sum")) for a, t in other) / n,
            "logit_diff_median": float(diffs.median()), "logit_diff_max": float(diffs.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verifier", default=str(DEFAULT_VERIFIER))
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "prompts" / "chat_dev.jsonl"))
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="kv_quality")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from bench.machine import machine_info
    from bench.runs import scoped_env, write_result
    from specloop.drafter.model.attention import KV_CACHE_ENV
    from specloop.drafter.model.loading import load_model
    from specloop.drafter.model.weights.modes import describe_mode
    from specloop.services.prompts import encode, load_prompts

    model = load_model(args.verifier, weights=args.weights)
    lean = model.lean
    prompts = [encode(model.tokenizer, r) for r in load_prompts(args.prompts, args.limit)]
    with scoped_env({KV_CACHE_ENV: "float32"}):
        seqs = [(p, greedy_answer(lean, p, args.answer, model.eos_ids)) for p in prompts]
    seqs = [(p, a) for p, a in seqs if a]
    runs = {}
    for kv in CACHES:
        with scoped_env({KV_CACHE_ENV: kv}):
            runs[kv] = [(forced_logits(lean, p + a, len(p)), torch.tensor(a)) for p, a in seqs]
    result = {"benchmark": "kv_cache_dtype", "machine": machine_info() | {"threads": args.threads},
              "settings": vars(args), "served": describe_mode(lean), "sequences": len(seqs),
              "caches": {kv: compare(runs["float32"], runs[kv]) for kv in CACHES}}
    for kv, row in result["caches"].items():
        print(f"{kv:9s} top-1 agreement {row['top1_agreement']:.4f}  NLL/token {row['nll_per_token']:.4f}  "
              f"|logit diff| median {row['logit_diff_median']:.4f} max {row['logit_diff_max']:.3f}")
    write_result(result, OUT, args.out, _plot)


def _plot(result: dict, path: Path) -> None:
    from bench.runs import pyplot

    plt = pyplot()
    caches = [kv for kv in result["caches"] if kv != "float32"]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.bar(caches, [result["caches"][kv]["logit_diff_median"] for kv in caches], color=["#b07040", "#3a9a3a"])
    ax.set_ylabel("median |logit - fp32 cache's|")
    ax.set_title(f"{result['served'].split(' (')[0]}: {result['sequences']} answers, teacher-forced", fontsize=9)
    for i, kv in enumerate(caches):
        ax.annotate(f"top-1 {result['caches'][kv]['top1_agreement']:.3f}", (i, 0), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 3), textcoords="offset points")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
