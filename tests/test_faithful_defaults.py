"""End to end: with default flags, specloop serves the checkpoint it was given.

`specloop generate` and `specloop serve` (concurrent requests through the API), both with default
flags (weights auto, speculation on with k auto), must reproduce plain `transformers` greedy decoding
of the reference pair's verifier on every reference prompt, whatever CPU runs the suite. The
reference is computed here with `AutoModelForCausalLM.generate(do_sample=False)`, one prompt at a
time, as a user would.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from services.launch import ServeProcess
from services.prompts import encode, load_prompts
from tests.conftest import SHARED_PROMPTS

MAX_TOKENS = 16
PROMPT_FILES = ("chat_dev.jsonl", "code_dev.jsonl")


@pytest.fixture(scope="module")
def records():
    return {name: load_prompts(SHARED_PROMPTS / name) for name in PROMPT_FILES}


@pytest.fixture(scope="module")
def transformers_greedy(reference_pair, records):
    """{prompt id: (token ids, text)} from plain transformers greedy decoding of the stored checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(reference_pair[0]).eval()
    tok = AutoTokenizer.from_pretrained(reference_pair[0])
    eos = model.generation_config.eos_token_id
    out = {}
    with torch.no_grad():
        for recs in records.values():
            for r in recs:
                ids = encode(tok, r)
                new = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                     eos_token_id=eos, pad_token_id=0)[0, len(ids):].tolist()
                new = new[: new.index(eos)] if eos in new else new
                out[r.id] = (new, tok.decode(new, skip_special_tokens=True))
    return out


def test_generate_with_default_flags_reproduces_transformers_greedy_on_every_prompt(reference_pair, records,
                                                                                      transformers_greedy):
    verifier, drafter = map(str, reference_pair)
    for name in PROMPT_FILES:
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "--threads", "1", "generate", "--verifier", verifier,
             "--drafter", drafter, "--prompts", str(SHARED_PROMPTS / name), "--max-tokens", str(MAX_TOKENS),
             "--batch-size", "4", "--json"],
            capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "served as fp32" in done.stderr  # the served mode is printed: the checkpoint's own dtype
        results = [json.loads(line) for line in done.stdout.splitlines()]
        assert len(results) == len(records[name])
        differ = [r["id"] for r in results if r["token_ids"] != transformers_greedy[r["id"]][0]]
        assert not differ, f"{len(differ)}/{len(results)} {name} prompts differ from transformers: {differ[:5]}"
        assert sum(r["stats"]["drafted"] for r in results) > 0  # speculation ran


def _request(url: str, model: str, record) -> str:
    if record.messages is not None:
        body = {"model": model, "messages": list(record.messages), "max_tokens": MAX_TOKENS, "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
        return reply["choices"][0]["message"]["content"]
    body = {"model": model, "prompt": record.prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    return reply["choices"][0]["text"]


def test_serve_with_default_flags_reproduces_transformers_greedy_under_concurrency(reference_pair, records,
                                                                                    transformers_greedy, tmp_path):
    server = ServeProcess(["--verifier", reference_pair[0], "--drafter", reference_pair[1], "--learner", "off"],
                          threads=2, registry=tmp_path / "registry", log=tmp_path / "serve.log").start()
    try:
        card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        assert card["weights"] == "fp32"
        every = [r for recs in records.values() for r in recs]
        with ThreadPoolExecutor(12) as pool:  # 12 requests in flight: continuous batching of ragged rows
            texts = list(pool.map(lambda r: _request(server.url, server.model, r), every))
    finally:
        server.stop()
        server.forget_redis_keys()
    differ = [r.id for r, text in zip(every, texts) if text != transformers_greedy[r.id][1]]
    assert not differ, f"{len(differ)}/{len(every)} prompts differ from transformers: {differ[:5]}"
