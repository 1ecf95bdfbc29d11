"""The CUDA path on a lent GPU machine: lossless speculative decoding and its speed there.

On the reference pair (bf16 on CUDA, the default there): for each drafter (pretrained, sd2 with
untrained steering, n-gram, pretrained with an FR-Spec truncated draft vocabulary), greedy output
at batch 1 and batch 8 must equal the verifier decoding alone on every prompt; tokens/s of each
system is the median over alternating rounds. Writes JSON to --out.

    python bench/cuda_check.py --models ../shared/models --prompts ../shared/prompts --out results.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.loading import load_model
from specloop.drafter.model.vocab import frequency_ranked
from specloop.services.prompts import encode, load_prompts


def systems(verifier, models: Path, prompts: list[list[int]]) -> dict:
    vocab = frequency_ranked(prompts, 1024, verifier.vocab_size, always=sorted(verifier.eos_ids))
    restricted = load_model(models / "drafter", dtype=verifier.hf.dtype)
    restricted.lean.restrict_vocab(vocab)
    return {
        "alone": (None, 0),
        "pretrained": (build_drafter("pretrained", verifier, models / "drafter"), 4),  # loads in the verifier's dtype
        "sd2": (build_drafter("sd2", verifier, models / "drafter"), 4),
        "ngram": (build_drafter("ngram", verifier, None), 4),
        "pretrained-frspec1024": (PretrainedDrafter(restricted.lean), 4),
    }


def run(verifier, drafter, k, prompts, batch, params, rule):
    out, t0 = [], time.perf_counter()
    for lo in range(0, len(prompts), batch):
        out += generate(verifier.lean, drafter, prompts[lo : lo + batch], params, k, rule)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    verifier = load_model(args.models / "verifier", dtype=dtype)
    recs = load_prompts(args.prompts / "chat_dev.jsonl", args.n) + load_prompts(args.prompts / "code_dev.jsonl", args.n)
    prompts = [encode(verifier.tokenizer, r) for r in recs]
    params, rule = SamplingParams(max_tokens=args.max_tokens), StopRule(verifier.eos_ids)
    table = systems(verifier, args.models, prompts)
    print(f"loaded on {verifier.lean.device} in {verifier.lean.dtype}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": str(verifier.lean.dtype),
              "prompts": len(prompts), "max_tokens": args.max_tokens, "batches": {}}
    for batch in (1, 8):
        for drafter, k in table.values():  # warm-up: first CUDA calls of every system
            run(verifier, drafter, k, prompts[:batch], batch, params, rule)
        reference, _ = run(verifier, None, 0, prompts, batch, params, rule)
        rates = {name: [] for name in table}
        rows = {}
        for _ in range(args.rounds):
            for name, (drafter, k) in table.items():
                gens, seconds = run(verifier, drafter, k, prompts, batch, params, rule)
                print(f"batch {batch} {name}: {seconds:.2f} s", flush=True)
                rates[name].append(sum(len(g.token_ids) for g in gens) / seconds)
                same = [g.token_ids == r.token_ids for g, r in zip(gens, reference)]
                acc = sum(g.stats.accepted for g in gens)
                blocks = sum(g.stats.blocks for g in gens)
                rows[name] = {"identical_to_verifier_alone": f"{sum(same)}/{len(same)}",
                              "tau": (acc + blocks) / blocks if blocks else None}
        for name in table:
            rows[name]["tokens_per_s_median"] = statistics.median(rates[name])
            rows[name]["x_alone"] = statistics.median(a / b for a, b in zip(rates[name], rates["alone"]))
        result["batches"][str(batch)] = rows
        print(json.dumps({batch: rows}, indent=1), flush=True)
    args.out.write_text(json.dumps(result, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
