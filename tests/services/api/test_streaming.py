"""services/api/streaming.py: the response shapes (full and streamed) over a scripted backend, through
uvicorn: log-probabilities in OpenAI's chat and completions shapes, with the official client."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from specloop.services.api.logprobs import TokenTexts
from tests.admin_helpers import serving
from tests.api_helpers import MODEL, scripted, scripted_app

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def backend(tiny_pair):
    return scripted(tiny_pair[0], "Sure, here is an example")


@pytest.fixture(scope="module")
def url(backend):
    with serving(scripted_app(backend)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def texts(backend):
    return TokenTexts(backend.tokenizer)


def events(url: str, path: str, body: dict) -> list:
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        out = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


def test_chat_logprobs_give_each_token_with_its_top_alternatives(client, backend, texts):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2)
    assert backend.requests[-1].logprobs == 2
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [texts.text(t) for t in backend.tokens[:5]]
    assert "".join(c.token for c in content) == out.choices[0].message.content
    assert [c.logprob for c in content] == [-(i + 1) / 4 for i in range(5)]
    assert all(bytes(c.bytes) == c.token.encode() and len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].token == content[0].token and content[0].top_logprobs[1].logprob == -1.25


def test_chat_logprobs_default_to_no_alternatives_and_are_null_when_not_asked(client, backend):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True)
    assert backend.requests[-1].logprobs == 0 and all(c.top_logprobs == [] for c in out.choices[0].logprobs.content)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert backend.requests[-1].logprobs is None and out.choices[0].logprobs is None


def test_streamed_chat_logprobs_come_with_each_delta(url):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 1}
    full = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    chunks = events(url, "/v1/chat/completions", body)
    role, *deltas, finish = [c["choices"][0] for c in chunks]
    assert role["logprobs"] is None and finish["logprobs"] is None and finish["finish_reason"] == "length"
    assert all(len(d["logprobs"]["content"]) == 1 for d in deltas)
    assert [e for d in deltas for e in d["logprobs"]["content"]] == full["content"]


def test_completion_logprobs_add_the_emitted_token_and_count_offsets(client, backend, texts):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=1)
    lp, strings = out.choices[0].logprobs, [texts.text(t) for t in backend.tokens[:4]]
    assert lp.tokens == strings and lp.token_logprobs == [-0.25, -0.5, -0.75, -1.0]
    assert lp.top_logprobs == [{s: lp.token_logprobs[i]} for i, s in enumerate(strings)]  # the top 1 is the token
    assert lp.text_offset == [sum(len(s) for s in strings[:i]) for i in range(4)]


def test_streamed_completion_logprobs_carry_offsets_across_chunks(url):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "logprobs": 3}
    full = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    parts = [c["choices"][0]["logprobs"] for c in events(url, "/v1/completions", body)]
    joined = {key: [v for p in parts if p for v in p[key]] for key in full}
    assert joined == full and parts[-1] is None  # the finish chunk carries none
    assert all(len(d) == 3 for d in full["top_logprobs"])


def test_tokens_whose_text_is_held_back_still_stream_their_logprobs(tiny_pair):
    backend = scripted(tiny_pair[0], "日本語")
    with serving(scripted_app(backend)) as base:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 20, "logprobs": True}
        deltas = [c["choices"][0] for c in events(base, "/v1/chat/completions", body)][1:-1]
    assert len(deltas) == len(backend.tokens) and any(d["delta"]["content"] == "" for d in deltas)
    assert "".join(d["delta"]["content"] for d in deltas) == "日本語"
    raw = bytes(b for d in deltas for b in d["logprobs"]["content"][0]["bytes"])
    assert raw == "日本語".encode()


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
])
def test_logprobs_out_of_range_or_of_the_wrong_kind_are_400s(url, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": CHAT} if "chat" in path else {"prompt": "x"}), **extra}
    r = httpx.post(url + path, json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
