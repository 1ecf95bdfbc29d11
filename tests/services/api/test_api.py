"""services/api/app.py: the OpenAI-compatible API over a real serving loop (`LocalBackend`, tiny models),
served by uvicorn on a free port and driven by the official `openai` client and by httpx."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch

from specloop.drafter.decode.capacity import draft_reserve
from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.model.loading import load_model, load_tokenizer
from specloop.services.api.app import create_app
from specloop.services.api.schemas import ApiError
from specloop.services.cli.generation import final_text
from specloop.services.protocol import Chunk, CompletionRequest, ErrorInfo
from specloop.services.worker.serving_loop import LocalBackend, wait_ready
from tests.admin_helpers import serving

torch.set_num_threads(1)

MODEL = "tiny-verifier"
CHAT = [{"role": "user", "content": "def main():"}]
TARGETS = ["127.0.0.1:9101", "127.0.0.1:9102"]


class Probe:
    """A Backend around a real one that records the requests it forwards and counts the streams still
    open. Knobs: `fail_after` (an error chunk after that many token chunks), `alive` / `warm` (False:
    no worker / not ready, whatever the real backend says)."""

    def __init__(self, inner, fail_after: int | None = None, alive: bool = True, warm: bool = True):
        self.inner, self.fail_after, self.alive, self.warm = inner, fail_after, alive, warm
        self.requests: list[CompletionRequest] = []
        self.open_streams = 0

    async def stream(self, request: CompletionRequest):
        self.requests.append(request)
        self.open_streams += 1
        stream, sent = self.inner.stream(request), 0
        try:
            async for chunk in stream:
                if sent == self.fail_after:
                    yield Chunk(request.id, error=ErrorInfo("the worker crashed", "server_error", 500))
                    return
                yield chunk
                sent += bool(chunk.token_ids)
        finally:
            await stream.aclose()
            self.open_streams -= 1

    async def workers(self):
        return await self.inner.workers() if self.alive else []

    async def loads(self):
        return await self.inner.loads()

    async def ready(self):
        return self.warm and await self.inner.ready()

    async def buffer_stats(self):
        return await self.inner.buffer_stats()

    async def metrics_targets(self):
        return TARGETS

    async def close(self):
        pass


@contextmanager
def local_backend(pair, **kwargs):
    """A LocalBackend (a real worker with continuous batching) on the tiny pair, warmed up, closed after."""
    backend = LocalBackend.open(str(pair[0]), str(pair[1]), "pretrained", model=MODEL, **kwargs)
    try:
        assert wait_ready(backend.loop, 30), "the worker did not warm up"
        yield backend
    finally:
        asyncio.run(backend.close())


@pytest.fixture(scope="module")
def local(tiny_pair):
    with local_backend(tiny_pair, slots=4, max_queue=16) as backend:
        yield backend


@pytest.fixture(scope="module")
def max_context(local) -> int:
    return asyncio.run(local.workers())[0].max_context


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0], torch.device("cpu"))


def make_app(backend, **kwargs):
    """The app as `specloop serve` builds it: model id, tokenizer and context from the first worker."""
    info = asyncio.run(backend.inner.workers() if isinstance(backend, Probe) else backend.workers())[0]
    return create_app(backend, load_tokenizer(info.verifier), info.model, info.max_context, **kwargs)


@pytest.fixture(scope="module")
def backend(local):
    return Probe(local)


@pytest.fixture(scope="module")
def url(backend):
    with serving(make_app(backend)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def greedy_text(verifier, prompt_ids: list[int], max_tokens: int) -> str:
    """The verifier's own greedy decoding (no speculation): what a lossless server must return."""
    tok = verifier.tokenizer
    rule = StopRule(verifier.eos_ids, lambda ids: tok.decode(ids, skip_special_tokens=True))
    gen = generate(verifier.lean, None, [prompt_ids], SamplingParams(0.0, max_tokens=max_tokens), 0, rule)[0]
    return final_text(tok, gen, ())


def chat_ids(verifier, messages) -> list[int]:
    ids = verifier.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent event stream (JSON decoded, except "[DONE]")."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def post_stream(url: str, path: str, body: dict) -> tuple[httpx.Response, list]:
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        return r, sse_events(r) if r.status_code == 200 else [r.read()]


# ------------------------------------------------------------------------------- the openai client


def test_chat_completion_with_the_openai_client_returns_the_verifiers_greedy_text(client, verifier):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MODEL
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == greedy_text(verifier, chat_ids(verifier, CHAT), 16)
    assert out.choices[0].finish_reason in ("stop", "length")
    u = out.usage
    assert u.prompt_tokens == len(chat_ids(verifier, CHAT)) and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_streamed_chat_with_the_openai_client_opens_with_the_role_and_joins_to_the_same_text(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_and_its_stream_with_the_openai_client_agree_with_greedy_decoding(client, verifier):
    prompt = "The quick brown fox"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    ids = verifier.tokenizer.encode(prompt, add_special_tokens=False)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.choices[0].text == greedy_text(verifier, ids, 10)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    assert streamed[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_completion_accepts_a_token_id_prompt(client, verifier):
    ids = verifier.tokenizer.encode("import os", add_special_tokens=False)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == greedy_text(verifier, ids, 6) and out.usage.prompt_tokens == len(ids)


def test_an_invalid_parameter_is_a_bad_request_error_for_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=2.5)
    assert exc.value.status_code == 400 and exc.value.body["param"] == "temperature"


def test_an_unknown_model_is_a_not_found_error_for_the_openai_client(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert exc.value.body["type"] == "not_found_error" and "gpt-4o" in exc.value.body["message"]


# ------------------------------------------------------------------------------------ validation


def assert_openai_400(r: httpx.Response, param: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_malformed_json_is_a_400_in_openai_shape_never_a_422(url):
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(url + path, content=b'{"model": "tiny-verifier", "messages": [', timeout=10,
                       headers={"content-type": "application/json"})
        assert "not valid JSON" in assert_openai_400(r)["message"]
    assert_openai_400(httpx.post(url + "/v1/completions", json=["not", "an", "object"], timeout=10))


@pytest.mark.parametrize("extra, param", [
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"n": 0}, "n"),
    ({"stream": "sometimes"}, "stream"),
    ({"stop": 7}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": "lucky"}, "seed"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ({"speculative": {"k": 17}}, "speculative.k"),
    ({"speculative": {"k": 0}}, "speculative.k"),
    ({"speculative": {"k": "sometimes"}}, "speculative.k"),
    ({"speculative": {"enabled": True, "kk": 3}}, "speculative.kk"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": 2}, "logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"min_p": 1.5}, "min_p"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ({"messages": [{"role": "user", "content": "hi", "name": 7}]}, "messages.0.name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages.0.tool_calls.0.function"),
    ({"messages": [{"role": "user", "content": "4", "tool_call_id": "c"}]}, "messages.0.tool_call_id"),
])
def test_wrong_parameters_are_400s_naming_the_parameter(url, extra, param):
    body = {"model": MODEL, "messages": CHAT, **extra}
    assert_openai_400(httpx.post(url + "/v1/chat/completions", json=body, timeout=10), param)


def test_neutral_values_of_unsupported_parameters_and_unknown_fields_are_accepted(url):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "presence_penalty": 0, "tool_choice": "none",
            "ignore_eos": False, "response_format": {"type": "text"}, "user": "u-1", "store": False}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    plain = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert_openai_400(httpx.post(url + "/v1/completions", json={**plain, "max_completion_tokens": 2}),
                      "max_completion_tokens")
    assert_openai_400(httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "echo": True}),
                      "echo")  # completions' only
    assert_openai_400(httpx.post(url + "/v1/completions", json={**plain, "max_tokens": 0}), "max_tokens")
    assert_openai_400(httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 0}),
                      "max_tokens")


def test_unknown_routes_and_methods_are_openai_errors(url):
    r = httpx.get(url + "/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] and "allow" in r.headers


def test_a_missing_model_or_prompt_is_a_400(url):
    assert_openai_400(httpx.post(url + "/v1/chat/completions", json={"messages": CHAT}, timeout=10), "model")
    assert_openai_400(httpx.post(url + "/v1/completions", json={"model": MODEL}, timeout=10), "prompt")
    assert_openai_400(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [10**6]}, timeout=10),
                      "prompt")


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(url, verifier, max_context):
    ids = verifier.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_context}
    msg = assert_openai_400(httpx.post(url + "/v1/completions", json=body, timeout=10), "max_tokens")["message"]
    assert f"{max_context - draft_reserve(4)} tokens" in msg and f"{len(ids) + max_context} tokens" in msg
    assert f"{len(ids)} in the prompt" in msg
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5] * max_context}, timeout=10)
    assert f"the prompt has {max_context} tokens" in assert_openai_400(r, "prompt")["message"]


def test_the_longest_request_that_fits_the_context_is_served(url, max_context):
    for k, spec in ((4, {"k": 4}), (0, {"enabled": False}), (None, {"k": "auto"})):
        prompt = [5] * (max_context - draft_reserve(k) - 3)
        body = {"model": MODEL, "prompt": prompt, "temperature": 0, "speculative": spec}
        out = httpx.post(url + "/v1/completions", json=body, timeout=30).json()  # default max_tokens: the 3 left
        assert out["usage"]["completion_tokens"] <= 3 and out["choices"][0]["finish_reason"] in ("stop", "length")


# ------------------------------------------------------------------------------------ log-probs


def verifier_logprobs(verifier_dir, ids: list[int], start: int) -> torch.Tensor:
    """[len(ids) - start, vocab]: the verifier's own log-softmax (transformers, fp32) predicting ids[start:]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_are_the_verifiers_own_with_or_without_speculation(url, verifier, tiny_pair):
    ids = verifier.tokenizer.encode("def main():", add_special_tokens=False)

    def ask(spec: dict) -> dict:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 10, "temperature": 0, "logprobs": 3, "speculative": spec}
        return httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]

    off, on, auto = ask({"enabled": False}), ask({"k": 3}), ask({"k": "auto"})
    tok = verifier.tokenizer
    rule = StopRule(verifier.eos_ids, lambda t: tok.decode(t, skip_special_tokens=True))
    greedy = generate(verifier.lean, None, [ids], SamplingParams(0.0, max_tokens=10), 0, rule)[0].token_ids
    assert off["tokens"] == on["tokens"] == auto["tokens"] == [tok.decode([t]) for t in greedy]
    ref = verifier_logprobs(tiny_pair[0], ids + greedy, len(ids))
    expected = [ref[i, t].item() for i, t in enumerate(greedy)]
    for got in (off, on, auto):
        assert max(abs(a - b) for a, b in zip(got["token_logprobs"], expected)) < 1e-3
        for i, alternatives in enumerate(got["top_logprobs"]):  # greedy: the emitted token is the most likely
            assert max(alternatives.values()) == got["token_logprobs"][i] and 3 <= len(alternatives) <= 4
            best = sorted(ref[i].topk(3).values.tolist(), reverse=True)
            assert abs(sorted(alternatives.values(), reverse=True)[0] - best[0]) < 1e-3


def test_echo_scores_the_prompt_as_the_verifier_does_and_leads_the_completion_with_it(url, verifier, tiny_pair):
    # what evaluation harnesses send (lm-eval's loglikelihood: echo with logprobs; scoring: max_tokens 0 too)
    tok = verifier.tokenizer
    ids = tok.encode("def main():\n    return", add_special_tokens=False)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True,
            "speculative": {"k": 2}}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    lp, n = choice["logprobs"], len(ids)
    prompt_text = tok.decode(ids, skip_special_tokens=False)
    assert choice["text"].startswith(prompt_text) and len(lp["tokens"]) == n + 4
    assert lp["tokens"][:n] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = verifier_logprobs(tiny_pair[0], ids, 1)  # position j predicts ids[j + 1]
    assert max(abs(lp["token_logprobs"][j + 1] - ref[j, t].item()) for j, t in enumerate(ids[1:])) < 1e-3
    assert all(2 <= len(alt) <= 3 for alt in lp["top_logprobs"][1:])
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets  # from the prompt's start, on through the completion
    plain = {k: v for k, v in body.items() if k != "echo"}
    rest = httpx.post(url + "/v1/completions", json=plain, timeout=30).json()["choices"][0]
    assert choice["text"] == prompt_text + rest["text"] and lp["tokens"][n:] == rest["logprobs"]["tokens"]

    scored = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=30).json()
    (only,) = scored["choices"]
    assert only["text"] == prompt_text and only["finish_reason"] == "length"
    assert only["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    assert scored["usage"]["prompt_tokens"] == n and scored["usage"]["completion_tokens"] == 0


def test_echo_scores_each_prompt_once_whatever_n(url, backend):
    body = {"model": MODEL, "prompt": ["def f", "import os"], "max_tokens": 3, "temperature": 0.8, "seed": 1, "n": 2,
            "logprobs": 1, "echo": True}
    full = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"]
    assert [q.prompt_logprobs for q in backend.requests[-4:]] == [1, None, 1, None]  # one pass a prompt
    for a, b in (full[:2], full[2:]):  # siblings echo the same prompt, scored once
        n = len(a["logprobs"]["tokens"]) - 3
        assert a["logprobs"]["token_logprobs"][:n] == b["logprobs"]["token_logprobs"][:n]
        assert a["logprobs"]["token_logprobs"][0] is None and None not in a["logprobs"]["token_logprobs"][1:]
    _, events = post_stream(url, "/v1/completions", {**body, "stream": True})
    firsts = {}
    for e in events[:-1]:
        for c in e.get("choices", []):
            firsts.setdefault(c["index"], c)
    assert sorted(firsts) == [0, 1, 2, 3]
    for i, c in firsts.items():  # every choice's first chunk: its prompt, scored (a sibling's scores included)
        assert c["text"] == body["prompt"][i // 2] and c["logprobs"]["token_logprobs"][1:] == \
            full[i]["logprobs"]["token_logprobs"][1:len(c["logprobs"]["tokens"])]
    scored = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=30).json()["choices"]
    assert [c["text"] for c in scored] == ["def f", "def f", "import os", "import os"]
    assert scored[1]["logprobs"] == scored[0]["logprobs"] and scored[1]["finish_reason"] == "length"


def test_echo_streams_the_prompt_first_and_needs_no_logprobs(url):
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 5, "temperature": 0, "echo": True}
    full = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert full["text"].startswith("def main():") and full["logprobs"] is None
    _, events = post_stream(url, "/v1/completions", {**body, "stream": True, "logprobs": 1})
    texts = [e["choices"][0]["text"] for e in events[:-1] if e.get("choices")]
    assert texts[0] == "def main():" and "".join(texts) == full["text"]
    first = next(e for e in events[:-1] if e.get("choices"))["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and first["text_offset"][0] == 0
    two = httpx.post(url + "/v1/completions", json={**body, "n": 2, "prompt": ["ab", "def"]}, timeout=30).json()
    assert len(two["choices"]) == 4  # n per prompt, each choice led by its own prompt
    assert all(c["text"].startswith(p) for c, p in zip(two["choices"], ["ab", "ab", "def", "def"]))


def test_chat_logprobs_stream_as_they_come_in_full(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    streamed = [e for c in client.chat.completions.create(**kwargs, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


# ------------------------------------------------------------------------------ sampling features


def test_n_2_returns_two_choices_and_streams_them_by_index(url, backend):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0.9, "seed": 11, "n": 2,
            "speculative": {"k": 2}}  # a fixed k: with k = auto the draws follow the k's chosen step by step
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    plain = r.json()
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    sent = backend.requests[-2:]
    assert {q.seed for q in sent} == {11} and sorted(q.stream_index for q in sent) == [0, 1]
    _, events = post_stream(url, "/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    texts, finishes = {0: "", 1: ""}, {}
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["message"]["content"] for c in plain["choices"]}  # same seed: same draws
    assert set(finishes) == {0, 1}


# ------------------------------------------------------------------------------- hostile input


def test_deeply_nested_json_is_a_400_never_a_500(url):
    for body in (b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, json.dumps({"model": MODEL, "prompt": [[[[[[[[[[
            [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}).encode()):
        r = httpx.post(url + "/v1/completions", content=body, timeout=30, headers={"content-type": "application/json"})
        assert "nests arrays or objects more than" in assert_openai_400(r)["message"]


def test_a_body_over_the_limit_is_a_413_in_openai_shape(url):
    from specloop.services.api.schemas import MAX_BODY_BYTES

    body = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    r = httpx.post(url + "/v1/completions", content=body, timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large" and str(MAX_BODY_BYTES) in err["message"]


def refused_beside_a_stream(url: str, path: str, body: dict | bytes) -> tuple[httpx.Response, float]:
    """`body` posted while a stream is being served: its answer and the stream's largest gap between
    two chunks (seconds)."""
    import threading

    arrivals: list[float] = []

    def stream() -> None:
        body = {"model": MODEL, "prompt": "import", "max_tokens": 48, "stream": True, "temperature": 0,
                "speculative": {"enabled": False}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())

    streamer = threading.Thread(target=stream)
    streamer.start()
    while len(arrivals) < 2 and streamer.is_alive():
        time.sleep(0.005)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, timeout=60, headers={"content-type": "application/json"})
    streamer.join(60)
    assert len(arrivals) > 10, "the stream did not run"
    return r, max(b - a for a, b in zip(arrivals, arrivals[1:]))


def test_a_prompt_longer_than_any_that_fits_is_refused_before_tokenizing_without_stalling_a_stream(url, backend):
    """A 6 MB prompt (under the body limit) is refused from its size alone, on the planner thread,
    while a stream is being served: the stream's chunks keep coming."""
    huge = {"model": MODEL, "prompt": "def f(x):\n    return x\n" * 250_000, "max_tokens": 4}
    r, gap = refused_beside_a_stream(url, "/v1/completions", huge)
    err = assert_openai_400(r, "prompt")
    assert "bytes of text" in err["message"] and "Please shorten it" in err["message"]
    assert gap < 1.0, f"the stream stalled {gap:.2f} s"


HUGE_INT = "9" * 5000  # more digits than Python's int() reads from text


@pytest.mark.parametrize("path, body, param, says", [
    # 250,000 empty messages (7.5 MB): refused from the list's length, before pydantic or the template
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 250_000}, "messages",
     "at most"),
    ("/tokenize", {"messages": [{"role": "user", "content": ""}] * 250_000}, "messages", "at most"),
    ("/detokenize", {"tokens": [0] * 1_000_000}, "tokens", "at most"),
    ("/v1/completions", {"model": MODEL, "prompt": "import", "stop": "x" * 100_000}, "stop", "characters"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_k": 10**30}, "top_k", ""),
])
def test_costly_requests_are_cheap_400s_beside_a_stream(url, path, body, param, says):
    r, gap = refused_beside_a_stream(url, path, body)
    err = assert_openai_400(r, param)
    assert says in err["message"]
    assert gap < 1.0, f"the stream stalled {gap:.2f} s"


@pytest.mark.parametrize("path, raw", [
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "seed": %s}'),
    ("/v1/completions", '{"model": "%s", "prompt": "import", "max_tokens": %s}'),
    ("/tokenize", '{"model": "%s", "prompt": "x", "extra": [%s]}'),
    ("/detokenize", '{"model": "%s", "tokens": [%s]}'),
])
def test_an_integer_of_5000_digits_anywhere_is_a_400(url, path, raw):
    r = httpx.post(url + path, content=(raw % (MODEL, HUGE_INT)).encode(), timeout=30,
                   headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_openai_400(r)["message"]


def test_messages_up_to_the_limit_are_planned(verifier):
    from specloop.services.api.planning import ApiConfig, plan_request

    cfg = ApiConfig(model_id=MODEL, max_context=64)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * cfg.max_messages, "max_tokens": 1}
    with pytest.raises(ApiError) as refused:  # the limit is not the last word: the prompt still has to fit
        plan_request(body, True, cfg, verifier.tokenizer)
    assert f"{cfg.max_messages} items" not in refused.value.message
    body["messages"].append({"role": "user", "content": "hi"})
    with pytest.raises(ApiError) as refused:
        plan_request(body, True, cfg, verifier.tokenizer)
    assert refused.value.param == "messages" and f"at most {cfg.max_messages}" in refused.value.message


def test_a_vanishing_temperature_samples_as_the_floor_temperature_does(client):
    def sample(t: float) -> str:
        out = client.completions.create(model=MODEL, prompt="import", max_tokens=8, temperature=t, seed=3,
                                        extra_body={"speculative": {"k": 2}})
        return out.choices[0].text

    from specloop.drafter.decode.sampling import MIN_TEMPERATURE

    assert sample(1e-40) == sample(MIN_TEMPERATURE)


def test_the_same_seed_samples_the_same_text(client):
    def sample():
        out = client.completions.create(model=MODEL, prompt="import", max_tokens=8, temperature=1.0, seed=5,
                                        extra_body={"speculative": {"k": 3}})  # fixed k: repeatable draws
        return out.choices[0].text
    assert sample() == sample()


def test_a_stop_string_cuts_the_text_and_finishes_with_stop(client):
    full = client.completions.create(model=MODEL, prompt="A hash table", max_tokens=24, temperature=0).choices[0].text
    assert len(full) >= 6, full
    stop = full[3:5]
    out = client.completions.create(model=MODEL, prompt="A hash table", max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_include_usage_sends_a_final_chunk_with_empty_choices_and_usage(url):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    _, events = post_stream(url, "/v1/chat/completions", body)
    *chunks, last, done = events
    assert done == "[DONE]" and last["choices"] == [] and all(c["usage"] is None for c in chunks)
    u = last["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] >= 1
    _, plain = post_stream(url, "/v1/chat/completions", {**body, "stream_options": None})
    assert all("usage" not in c for c in plain[:-1])


def test_usage_counts_drafted_and_accepted_tokens_and_the_drafter_version(url):
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 12, "temperature": 0, "speculative": {"k": 3}}
    on = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
    assert on["usage"]["drafted_tokens"] > 0 and on["usage"]["drafted_tokens"] % 3 == 0
    assert 0 <= on["usage"]["accepted_tokens"] <= on["usage"]["drafted_tokens"]
    assert on["usage"]["drafter_version"] == "base"
    off = httpx.post(url + "/v1/completions", json={**body, "speculative": {"enabled": False}}, timeout=30).json()
    assert off["usage"]["drafted_tokens"] == 0
    assert off["choices"][0]["text"] == on["choices"][0]["text"]  # lossless: the drafter changes nothing
    for spec in ({"k": "auto"}, None):  # explicit and by default: the worker chooses k step by step
        auto = httpx.post(url + "/v1/completions", json={**body, "speculative": spec}, timeout=30).json()
        assert auto["choices"][0]["text"] == off["choices"][0]["text"]
        assert 0 <= auto["usage"]["accepted_tokens"] <= auto["usage"]["drafted_tokens"]


# -------------------------------------------------------------------------- status endpoints


def test_models_lists_the_verifier_with_the_serving_drafter_version(client, url, max_context):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.drafter_version == "base"
    assert httpx.get(f"{url}/v1/models/{MODEL}").json()["max_model_len"] == max_context
    assert httpx.get(f"{url}/v1/models/nope").status_code == 404


def test_health_and_ready_are_200_with_a_warm_live_worker(url):
    assert httpx.get(url + "/health").json() == {"status": "ok", "workers": 1}
    assert httpx.get(url + "/ready").status_code == 200


def test_health_is_503_and_completions_say_retry_after_when_no_worker_is_alive(tiny_pair):
    with local_backend(tiny_pair, slots=1) as gone:
        app = make_app(gone)
        asyncio.run(gone.close())  # the worker's loop stops: no worker answers
        with serving(app) as base:
            r = httpx.get(base + "/health")
            assert r.status_code == 503 and r.json() == {"status": "unavailable", "workers": 0}
            assert httpx.get(base + "/ready").status_code == 503
            r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT}, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["message"]


def test_ready_is_503_until_a_forward_pass_ran(local):
    with serving(make_app(Probe(local, warm=False))) as base:
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/ready").status_code == 503


def test_sd_targets_is_prometheus_http_service_discovery(url, local):
    assert httpx.get(url + "/sd/targets").json() == [{"targets": TARGETS, "labels": {"job": "specloop-actors"}}]
    with serving(make_app(local)) as base:  # no metrics endpoint behind it: an empty list
        assert httpx.get(base + "/sd/targets").json() == []


def test_metrics_count_requests_latencies_tokens_and_finish_reasons(local):
    from prometheus_client import CollectorRegistry

    from specloop.services.metrics.api import ApiMetrics

    registry = CollectorRegistry()
    metrics = ApiMetrics(registry, model_name=MODEL)

    def value(name: str, **labels) -> float:
        return registry.get_sample_value(f"specloop:{name}", {"model_name": MODEL, **labels}) or 0.0

    body = {"model": MODEL, "prompt": "x", "max_tokens": 6, "temperature": 0, "n": 2, "speculative": {"enabled": False}}
    with serving(make_app(local, metrics=metrics)) as base:
        plain = httpx.post(base + "/v1/completions", json=body, timeout=30).json()
        _, events = post_stream(base, "/v1/completions", {**body, "n": 1, "stream": True,
                                                          "stream_options": {"include_usage": True}})
        httpx.post(base + "/v1/completions", json={"model": MODEL})
        text = httpx.get(base + "/metrics").text
    assert 'endpoint="/v1/completions"' in text and 'status="200"' in text and 'status="400"' in text
    generated = plain["usage"]["completion_tokens"] + events[-2]["usage"]["completion_tokens"]
    assert value("generation_tokens_total") == generated and value("prompt_tokens_total") == 2  # "x": 1 token each
    assert value("request_success_total", finished_reason="length") + value(
        "request_success_total", finished_reason="stop") == 3  # every choice of the two answered requests
    assert value("time_to_first_token_seconds_count") == 3 and value("e2e_request_latency_seconds_count") == 2
    assert value("request_queue_time_seconds_count") == 3  # per choice: each waits for its own cache slot
    assert value("request_time_per_output_token_seconds_count") >= 1
    assert value("inter_token_latency_seconds_count") >= 1


def test_a_client_gone_counts_its_choices_as_aborted(local):
    from prometheus_client import CollectorRegistry

    from specloop.services.metrics.api import ApiMetrics

    registry = CollectorRegistry()
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 200, "temperature": 0, "stream": True,
            "speculative": {"enabled": False}}
    with slow_steps(local, 0.05), serving(make_app(local, metrics=ApiMetrics(registry))) as base:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            next(r.iter_lines())
        assert wait_until(lambda: registry.get_sample_value("specloop:request_success_total",
                                                            {"finished_reason": "abort"}) == 1, 3.0)
    assert registry.get_sample_value("specloop:http_requests_total", {"endpoint": "/v1/completions", "status": "499"}) == 1


def test_an_admin_router_is_mounted(local):
    from fastapi import APIRouter

    router = APIRouter(prefix="/admin")
    router.get("/ping")(lambda: {"pong": True})
    with serving(make_app(local, admin_router=router)) as base:
        assert httpx.get(base + "/admin/ping").json() == {"pong": True}


# --------------------------------------------------------------------------------- tokens, version


def test_tokenize_gives_the_ids_a_completion_is_fed(url, client, verifier, max_context):
    r = httpx.post(url + "/tokenize", json={"prompt": "The quick brown fox"}, timeout=10).json()
    ids = verifier.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert r == {"tokens": ids, "count": len(ids), "max_model_len": max_context}
    chat = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": CHAT}, timeout=10).json()
    assert chat["tokens"] == chat_ids(verifier, CHAT)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == chat["count"]
    bare = httpx.post(url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}, timeout=10).json()
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]


def test_detokenize_turns_ids_back_into_the_text(url, verifier):
    ids = verifier.tokenizer.encode("import os\nimport sys", add_special_tokens=False)
    assert httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=10).json() == {"prompt": "import os\nimport sys"}
    assert httpx.post(url + "/detokenize", json={"tokens": []}, timeout=10).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens.0"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": "yes"}, "add_generation_prompt"),
])
def test_bad_token_requests_are_400s_naming_the_parameter(url, path, body, param):
    assert_openai_400(httpx.post(url + path, json=body, timeout=10), param)


def test_token_routes_refuse_another_model_and_garbage(url):
    r = httpx.post(url + "/tokenize", json={"model": "gpt-4o", "prompt": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert_openai_400(httpx.post(url + "/detokenize", content=b"[" * 1000, timeout=10))


def test_the_api_docs_are_off_unless_asked_for(url, backend):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(url + path, timeout=10).status_code == 404, path
    from fastapi.testclient import TestClient

    with TestClient(make_app(backend, docs=True)) as open_docs:
        assert open_docs.get("/openapi.json").json()["info"]["title"] == "specloop"
        assert open_docs.get("/docs").status_code == 200


def test_version_is_the_package_version(url):
    from importlib.metadata import version

    assert httpx.get(url + "/version").json() == {"version": version("specloop")}


# --------------------------------------------------------------------------- errors and clients


def test_an_overloaded_worker_is_a_503_with_retry_after(tiny_pair):
    with local_backend(tiny_pair, slots=1, max_queue=0) as full, serving(make_app(full)) as base:
        for stream in (False, True):
            body = {"model": MODEL, "messages": CHAT, "stream": stream}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "overloaded_error"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as exc:
            client.completions.create(model=MODEL, prompt="x")
        assert exc.value.status_code == 503


def test_a_worker_refusal_before_the_first_token_is_its_http_status(url):
    body = {"model": MODEL, "prompt": "x", "speculative": {"drafter_version": "v0042"}}
    err = assert_openai_400(httpx.post(url + "/v1/completions", json=body, timeout=10))
    assert "v0042" in err["message"]


def test_an_error_after_the_stream_began_is_sent_in_band_then_done(local):
    with serving(make_app(Probe(local, fail_after=3))) as base:
        body = {"model": MODEL, "prompt": "def main():", "max_tokens": 12, "temperature": 0, "stream": True,
                "speculative": {"enabled": False}}
        r, events = post_stream(base, "/v1/completions", body)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert len(events) == 3 + 2 and all(e["choices"][0]["text"] for e in events[:3])
        assert events[-2] == {"error": {"message": "the worker crashed", "type": "server_error", "param": None,
                                        "code": None}}
        r = httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["message"] == "the worker crashed"


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@contextmanager
def slow_steps(backend: LocalBackend, seconds: float):
    """Every decoding step of the worker takes at least `seconds` more."""
    def nap(updates, engine, version):
        time.sleep(seconds)
    backend.loop.worker.on_step.append(nap)
    try:
        yield
    finally:
        backend.loop.worker.on_step.remove(nap)


def test_a_client_that_goes_away_frees_its_worker_slot(local):
    probe = Probe(local)
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 200, "temperature": 0,
            "speculative": {"enabled": False}}

    def running() -> int:
        return asyncio.run(local.loads())[0].running

    with slow_steps(local, 0.05), serving(make_app(probe)) as base:
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            assert probe.open_streams == 1 and running() == 1
        assert wait_until(lambda: probe.open_streams == 0 and running() == 0, 3.0), "a streamed request kept its slot"
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body, timeout=0.5)
        assert wait_until(lambda: probe.open_streams == 0 and running() == 0, 3.0), "a plain request kept its slot"
