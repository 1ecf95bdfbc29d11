"""What replay logging adds to a speculative step, and what the records cost in Redis.

One verifier worker per mode (no logging / embedded buffer / Redis Streams), same drafter, same
prompts; the modes take turns prompt by prompt (alternating, so machine noise hits all alike) and
the outputs are identical (greedy, frozen drafter), so time per block compares directly. Reports
the median of per-round ratios against no logging, and Redis memory per 1,000 blocks (MEMORY
USAGE of the stream after the run / blocks logged).

    .venv/bin/python bench/online_overhead.py --prompts 40 --rounds 3
    # speculation off (every step plain): what observed records of one step in N cost
    .venv/bin/python bench/online_overhead.py --kind eagle --k 0 --observe-every 8
Writes bench/results/online_overhead_<kind>.json (_k0_every<N> for --k 0).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import redis  # noqa: E402
import torch  # noqa: E402
from machine import machine_info  # noqa: E402

from specloop.services.buffer.connect import open_buffer
from specloop.services.buffer.memory import MemoryBuffer
from specloop.services.prompts import encode, load_prompts  # noqa: E402
from specloop.services.protocol import CompletionRequest  # noqa: E402
from specloop.services.worker.worker import VerifierWorker, WorkerConfig  # noqa: E402

SHARED = ROOT.parent / "shared"
OUT = ROOT / "bench" / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="pretrained")
    p.add_argument("--models", type=Path, default=SHARED / "models",
                   help="DIR with verifier/ and drafter/ (default: the reference pair; the fetched pair: "
                        "~/.cache/specloop/models/smollm2-135m-instruct)")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--redis", default="redis://127.0.0.1:6379")
    p.add_argument("--k", type=lambda v: None if v == "auto" else int(v), default=None,
                   help="every request's draft length (default auto; 0: plain steps, whose records are observed ones)")
    p.add_argument("--observe-every", type=int, help="the logging workers' observe_every (default: the worker's)")
    args = p.parse_args()
    torch.set_num_threads(1)
    prefix = f"bench-overhead-{uuid.uuid4().hex[:8]}"
    redis_buffer = open_buffer(args.redis, prefix=prefix)
    drafter = None if args.kind == "dvi" else args.models / "drafter"
    cfg = dict(verifier=str(args.models / "verifier"), drafter=str(drafter) if drafter else None, kind=args.kind)
    logging = {} if args.observe_every is None else {"observe_every": args.observe_every}
    workers = {"none": VerifierWorker(WorkerConfig(**cfg, log_records=False)),
               "memory": VerifierWorker(WorkerConfig(**cfg, **logging), MemoryBuffer(1_000_000)),
               "redis": VerifierWorker(WorkerConfig(**cfg, **logging), redis_buffer)}
    tok = workers["none"].verifier.tokenizer
    chat = load_prompts(SHARED / "prompts" / "chat_dev.jsonl")[: args.prompts // 2]
    code = load_prompts(SHARED / "prompts" / "code_dev.jsonl")[: args.prompts - len(chat)]
    prompts = [encode(tok, r) for r in chat + code]
    per_block = {m: [] for m in workers}
    blocks = 0
    for rnd in range(args.rounds):
        for i, ids in enumerate(prompts):
            outs = {}
            for mode in (list(workers) if (rnd + i) % 2 == 0 else list(reversed(workers))):
                r = workers[mode].serve(CompletionRequest(str(i), ids, max_tokens=args.max_tokens, stream_index=i,
                                                          k=args.k))
                per_block[mode].append(r.seconds / r.blocks)
                outs[mode] = r.token_ids
            if len({tuple(t) for t in outs.values()}) != 1:
                raise SystemExit("outputs differ between modes: logging changed decoding")
            blocks += r.blocks
    for w in workers.values():
        w.drain()
    redis_buffer.flush()
    mem = redis_buffer.stats().memory_bytes
    stream_len = redis_buffer.stats().depth
    redis.Redis.from_url(args.redis).delete(f"{prefix}:replay")
    ratios = {m: statistics.median(a / b for a, b in zip(per_block[m], per_block["none"])) for m in ("memory", "redis")}
    result = {"machine": machine_info(), "models": str(args.models), "kind": args.kind, "prompts": len(prompts),
              "rounds": args.rounds,
              "k": "auto" if args.k is None else args.k, "observe_every": workers["redis"].cfg.observe_every,
              "blocks_per_mode": blocks, "median_ms_per_block": {m: 1e3 * statistics.median(v) for m, v in per_block.items()},
              "median_ratio_vs_no_logging": ratios,
              "records": {m: None if (rec := w.stats().records) is None else asdict(rec) for m, w in workers.items()},
              "redis_stream_entries": stream_len, "redis_memory_bytes": mem,
              "redis_bytes_per_1000_blocks": None if not mem or not stream_len else 1000 * mem / stream_len}
    OUT.mkdir(parents=True, exist_ok=True)
    tail = "" if args.k != 0 else f"_k0_every{workers['redis'].cfg.observe_every}"
    (OUT / f"online_overhead_{args.kind}{tail}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    for w in workers.values():
        w.close()


if __name__ == "__main__":
    main()
