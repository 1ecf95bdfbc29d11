"""SD² steering vs plain distillation of the same depth-pruned drafter on the real model: the same
140 offline steps (steps, not minutes: a shared machine gives either arm fewer steps per minute),
data, draft vocabulary and frozen embeddings; then accepted tokens per block at k = 4 with the int8
verifier and int4 drafters on 10 chat + 10 code prompts × 64 tokens, greedy.

    .venv/bin/python bench/sd2_vs_distill_real.py 140     # after `specloop models fetch`
"""
import json
import sys

import torch

torch.set_num_threads(2)
from pathlib import Path

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.loading import load_model
from specloop.services.prompts import encode, load_prompts
from specloop.trainer.offline import train_offline
from specloop.trainer.offline_config import OfflineConfig

D = Path.home() / ".cache" / "specloop" / "models" / "smollm2-135m-instruct"
out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path.home() / ".cache" / "specloop" / "sd2_vs_distill"; out.mkdir(parents=True, exist_ok=True)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 140
res = {}
for method in ("distill", "sd2"):
    o = out / method
    if not (o / "manifest.json").is_file():
        cfg = OfflineConfig(method=method, verifier=str(D / "verifier"), drafter=str(D / "drafter-base"), out_dir=str(o),
                            max_steps=steps, k=4, lr=2e-3, lm_lr=1e-3, warmup_steps=5, batch_size=8, seq_len=128, threads=2,
                            draft_vocab=str(D / "draft_vocab.safetensors"), freeze_embeddings=True, teacher_dtype="auto")
        res[method] = {"train": train_offline(cfg, progress=False)}
    else:
        res[method] = {"train": json.loads((o / "summary.json").read_text())}
V = load_model(D / "verifier", weights="int8")
stop = StopRule(V.eos_ids)
recs = load_prompts("../shared/prompts/chat_dev.jsonl", limit=10) + load_prompts("../shared/prompts/code_dev.jsonl", limit=10)
prompts = [encode(V.tokenizer, r) for r in recs]
drafters = {m: build_drafter(m if m == "sd2" else "pretrained", V, out / m, weights="int4") for m in ("distill", "sd2")}
for m, d in drafters.items():
    for dom, ps in (("chat", prompts[:10]), ("code", prompts[10:])):
        acc = blocks = 0
        for p in ps:
            g = generate(V.lean, d, [p], SamplingParams(max_tokens=64), 4, stop)[0]
            acc += g.stats.accepted; blocks += g.stats.blocks
        res[m][dom] = {"accepted_per_block": acc / blocks, "tau": 1 + acc / blocks}
for dom in ("chat", "code"):
    res[f"ratio_{dom}"] = res["sd2"][dom]["accepted_per_block"] / max(res["distill"][dom]["accepted_per_block"], 1e-9)
print(json.dumps({k: (v if k.startswith("ratio") else {x: y for x, y in v.items() if x != "train"} | {"steps": v["train"]["steps"], "final_acceptance": v["train"]["final_acceptance"]}) for k, v in res.items()}, indent=1))
(Path(__file__).resolve().parent / "results" / "sd2_vs_distill_real.json").write_text(json.dumps(res, separators=(",", ":")) + "\n")
