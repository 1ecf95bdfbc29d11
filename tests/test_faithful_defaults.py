"""End to end: with default flags, specloop serves the checkpoint it was given.

`specloop generate` and `specloop serve` (concurrent requests through the API), both with default
flags (weights auto, speculation on with k auto), must reproduce plain `transformers` greedy decoding
of the reference pair's verifier, whatever CPU runs the suite: `generate` on every reference prompt,
`serve` on every third of them, 12 requests in flight. The
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

from specloop.services.cli.launch import ServeProcess
from specloop.services.prompts import encode, load_prompts
from tests.conftest import SHARED_PROMPTS

MAX_TOKENS = 16
PROMPT_FILES = ("chat_dev.jsonl", "code_dev.jsonl")


@pytest.fixture(scope="module")
def records():
    return {name: load_prompts(SHARED_PROMPTS / name) for name in PROMPT_FILES}


def transformers_reference(verifier: str, prompt_files: list[str], out: str) -> None:
    """Plain transformers greedy decoding of the stored checkpoint, one prompt at a time, written to
    `out` as {prompt id: [token ids, text]}. Runs in its own process on one thread, beside the first
    test's `specloop generate` (one thread too): the two overlap instead of adding up."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(verifier).eval()
    tok = AutoTokenizer.from_pretrained(verifier)
    eos = model.generation_config.eos_token_id
    result = {}
    with torch.no_grad():
        for name in prompt_files:
            for r in load_prompts(name):
                ids = encode(tok, r)
                new = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                     eos_token_id=eos, pad_token_id=0)[0, len(ids):].tolist()
                new = new[: new.index(eos)] if eos in new else new
                result[r.id] = [new, tok.decode(new, skip_special_tokens=True)]
    with open(out, "w") as f:
        json.dump(result, f)


class Reference:
    """The reference, computed by a background process; `get()` waits for it."""

    def __init__(self, verifier: str, out):
        files = [str(SHARED_PROMPTS / name) for name in PROMPT_FILES]
        code = (f"from tests.test_faithful_defaults import transformers_reference; "
                f"transformers_reference({verifier!r}, {files!r}, {str(out)!r})")
        self.out, self._value = out, None
        self.proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)

    def get(self) -> dict[str, tuple[list[int], str]]:
        if self._value is None:
            _, err = self.proc.communicate(timeout=900)
            assert self.proc.returncode == 0, err[-2000:]
            with open(self.out) as f:
                self._value = {key: (ids, text) for key, (ids, text) in json.load(f).items()}
        return self._value


@pytest.fixture(scope="module")
def transformers_greedy(reference_pair, tmp_path_factory):
    reference = Reference(str(reference_pair[0]), tmp_path_factory.mktemp("reference") / "greedy.json")
    yield reference
    if reference.proc.poll() is None:
        reference.proc.kill()


def test_generate_with_default_flags_reproduces_transformers_greedy_on_every_prompt(reference_pair, records,
                                                                                      transformers_greedy):
    verifier, drafter = map(str, reference_pair)
    runs = {name: _generate(verifier, drafter, name) for name in PROMPT_FILES}  # beside the reference process
    reference = transformers_greedy.get()
    for name, results in runs.items():
        assert len(results) == len(records[name])
        differ = [r["id"] for r in results if r["token_ids"] != reference[r["id"]][0]]
        assert not differ, f"{len(differ)}/{len(results)} {name} prompts differ from transformers: {differ[:5]}"
        assert sum(r["stats"]["drafted"] for r in results) > 0  # speculation ran


def _generate(verifier: str, drafter: str, name: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "specloop", "--threads", "1", "generate", "--verifier", verifier,
         "--drafter", drafter, "--prompts", str(SHARED_PROMPTS / name), "--max-tokens", str(MAX_TOKENS),
         "--batch-size", "4", "--json"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "served as fp32" in done.stderr  # the served mode is printed: the checkpoint's own dtype
    return [json.loads(line) for line in done.stdout.splitlines()]


def _request(url: str, model: str, record) -> str:
    if record.messages is not None:
        body = {"model": model, "messages": list(record.messages), "max_tokens": MAX_TOKENS, "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
        return reply["choices"][0]["message"]["content"]
    body = {"model": model, "prompt": record.prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    return reply["choices"][0]["text"]


SERVE_EVERY = 3  # the served test takes every third prompt of each file (172 of 516): 12 in flight throughout; the
                # generate test above takes every prompt


def test_serve_with_default_flags_reproduces_transformers_greedy_under_concurrency(reference_pair, records,
                                                                                    transformers_greedy, tmp_path):
    server = ServeProcess(["--verifier", reference_pair[0], "--drafter", reference_pair[1], "--learner", "off"],
                          threads=2, registry=tmp_path / "registry", log=tmp_path / "serve.log").start()
    try:
        card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        assert card["weights"] == "fp32"
        served = [r for recs in records.values() for r in recs[::SERVE_EVERY]]
        with ThreadPoolExecutor(12) as pool:  # 12 requests in flight: continuous batching of ragged rows
            texts = list(pool.map(lambda r: _request(server.url, server.model, r), served))
    finally:
        server.stop()
        server.forget_redis_keys()
    reference = transformers_greedy.get()
    differ = [r.id for r, text in zip(served, texts) if text != reference[r.id][1]]
    assert not differ, f"{len(differ)}/{len(served)} prompts differ from transformers: {differ[:5]}"
