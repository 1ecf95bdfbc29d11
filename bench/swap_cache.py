"""Hot swap of a pretrained / SD² drafter mid-request: keep its KV cache, or recompute it?

Two registry versions with different weights (the reference drafter and one trained offline on
code) are promoted in turn every `--every` seconds by a background thread while one verifier
worker per mode serves the same chat + code prompts (modes alternate prompt by prompt). Per mode:
the swap stall on the serving thread (p50 / p99 ms), acceptance α of blocks drafted on a stale
cache (keep) vs all blocks, tokens/s; outputs must equal the verifier alone (greedy).

    .venv/bin/python bench/swap_cache.py --second runs/oracle-code-distill --prompts 30
Writes bench/results/swap_cache.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from machine import machine_info  # noqa: E402

from specloop.drafter.model.loading import load_model  # noqa: E402
from specloop.services.prompts import encode, load_prompts  # noqa: E402
from specloop.services.protocol import CompletionRequest  # noqa: E402
from specloop.services.registry.registry import Registry  # noqa: E402
from specloop.services.worker.worker import VerifierWorker, WorkerConfig  # noqa: E402
from specloop.trainer.online import serving_student  # noqa: E402

SHARED = ROOT.parent / "shared"
OUT = ROOT / "bench" / "results"


def version_weights(verifier, kind: str, drafter: Path) -> dict:
    student = serving_student(kind, verifier, drafter)
    return {n: p.detach().clone() for n, p, _ in student.trainable()}


def alternate(registries: list[Registry], ids: list[str], every: float, stop: threading.Event, counts: list[int]) -> None:
    i = 0
    while not stop.wait(every):
        i += 1
        for reg in registries:
            reg.promote(ids[i % 2], force=True)
        counts[0] += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="pretrained", choices=["pretrained", "sd2"])
    p.add_argument("--second", type=Path, required=True, help="a second drafter checkpoint (other weights)")
    p.add_argument("--prompts", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--every", type=float, default=0.15, help="seconds between promotions")
    args = p.parse_args()
    torch.set_num_threads(1)
    base = SHARED / "models" / "drafter"
    verifier = load_model(SHARED / "models" / "verifier", dtype=torch.float32)
    weights = [version_weights(verifier, args.kind, base), version_weights(verifier, args.kind, args.second)]
    modes = ("keep", "recompute")
    registries, workers = [], {}
    for mode in modes:
        reg = Registry(tempfile.mkdtemp(prefix=f"swap-{mode}-"))
        ids = [reg.publish(w, parent=None, learner_step=0, objective="bench", loss=None, sim_acceptance=None,
                           kind=args.kind).id for w in weights]
        reg.promote(ids[0], force=True)
        registries.append(reg)
        workers[mode] = VerifierWorker(WorkerConfig(str(SHARED / "models" / "verifier"), str(base), args.kind,
                                                    registry=reg.root, swap_cache=mode, log_records=False))
    tok = verifier.tokenizer
    chat = load_prompts(SHARED / "prompts" / "chat_dev.jsonl")[: args.prompts // 2]
    code = load_prompts(SHARED / "prompts" / "code_dev.jsonl")[: args.prompts - len(chat)]
    prompts = [encode(tok, r) for r in chat + code]
    reference = VerifierWorker(WorkerConfig(str(SHARED / "models" / "verifier"), str(base), args.kind, log_records=False))  # served with k = 0
    stop, promotions = threading.Event(), [0]
    thread = threading.Thread(target=alternate, args=(registries, ids, args.every, stop, promotions), daemon=True)
    thread.start()
    tokens = {m: 0 for m in modes}
    seconds = {m: 0.0 for m in modes}
    for i, ids_ in enumerate(prompts):
        want = reference.serve(CompletionRequest(str(i), ids_, max_tokens=args.max_tokens, k=0,
                                                 stream_index=i)).token_ids
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            r = workers[mode].serve(CompletionRequest(str(i), ids_, max_tokens=args.max_tokens, stream_index=i))
            if r.token_ids != want:
                raise SystemExit(f"{mode}: output differs from the frozen drafter's (lossless broken)")
            tokens[mode] += len(r.token_ids)
            seconds[mode] += r.seconds
    stop.set()
    thread.join()
    result = {"machine": machine_info(), "kind": args.kind, "prompts": len(prompts), "every_s": args.every,
              "promotions": promotions[0], "modes": {}}
    for mode, w in workers.items():
        s = w.stats()
        versions = s.acceptance_by_version
        drafted = sum(v.drafted for v in versions.values())
        accepted = sum(v.accepted for v in versions.values())
        stale = s.stale_blocks
        result["modes"][mode] = {
            "swaps_in_flight": s.swap_stall_ms.get("n", 0), "stall_ms": s.swap_stall_ms,
            "alpha_all": accepted / drafted if drafted else None,
            "alpha_stale_blocks": stale.accepted / stale.drafted if stale.drafted else None,
            "alpha_fresh_blocks": ((accepted - stale.accepted) / (drafted - stale.drafted)
                                   if drafted > stale.drafted else None),
            "stale_share_of_blocks": stale.drafted / drafted if drafted else None,
            "tokens_per_s": tokens[mode] / seconds[mode],
        }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"swap_cache_{args.kind}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(json.dumps(result["modes"], indent=1))


if __name__ == "__main__":
    main()
