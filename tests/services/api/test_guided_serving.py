"""Structured outputs, tool calls and the sampling controls end to end: the API over a real serving
loop (`LocalBackend`, tiny models), served by uvicorn and driven by the official `openai` client.

The worker applies the controls and the guided spec (drafter/decode/shaping.py, grammar.py). Greedy decoding under a grammar or a control is the
same with and without speculation (it is lossless), so each check runs both ways and compares."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch

from specloop.drafter.model.loading import load_tokenizer
from specloop.services.api.app import create_app
from specloop.services.worker.serving_loop import LocalBackend, wait_ready
from tests.admin_helpers import serving

torch.set_num_threads(1)

MODEL = "tiny-verifier"
EOS = 4  # the tiny tokenizer's <|end|>
SPECULATION = [{"enabled": False}, {"k": 4}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}
# the tiny model's context (512) has no room for the Hermes tools block in its short tokens: a compact
# template that renders tools itself (and, as --chat-template, checks that plumbing too)
TEMPLATE = ("{% if tools %}<|system|>\ntools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>\n"
            "{% endif %}{% for m in messages %}<|{{ m.role }}|>\n{% if m.tool_calls %}{{ m.tool_calls | tojson }}"
            "{% else %}{{ m.content }}{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
            "{% endif %}")
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_pair):
    backend = LocalBackend.open(str(tiny_pair[0]), str(tiny_pair[1]), "pretrained", model=MODEL, slots=4, max_queue=16)
    try:
        assert wait_ready(backend.loop, 30), "the worker did not warm up"
        info = asyncio.run(backend.workers())[0]
        app = create_app(backend, load_tokenizer(info.verifier), MODEL, info.max_context, chat_template=TEMPLATE)
        with serving(app) as base:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    finally:
        asyncio.run(backend.close())


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return load_tokenizer(tiny_pair[0])


def both_ways(call) -> list:
    """`call(speculative)` without and with speculation (each caller checks that the answers agree)."""
    return [call(spec) for spec in SPECULATION]


def test_tool_choice_required_returns_a_call_whose_arguments_match_the_schema(client):
    answers = both_ways(lambda spec: client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, NOOP], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=120, extra_body={"speculative": spec}))
    for out in answers:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert (call.function.name, arguments) in [("noop", {}), ("get_weather", {"city": "Paris"}),
                                                   ("get_weather", {"city": "Rome"})]
    plain, speculative = (a.choices[0].message.tool_calls[0].function.model_dump() for a in answers)
    assert plain == speculative


def test_a_named_function_is_the_one_called_also_when_streamed(client):
    for spec in SPECULATION:
        stream = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, NOOP], tool_choice={"type": "function", "function": {
                "name": "get_weather"}}, parallel_tool_calls=False, temperature=0, max_tokens=120, stream=True,
            extra_body={"speculative": spec})
        calls, finish = [], None
        for chunk in stream:
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
        assert json.loads(calls[0].function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
        assert calls[0].id.startswith("call_") and calls[0].index == 0


def completion(client, spec, **kwargs):
    extra = kwargs.pop("extra_body", {})
    return client.completions.create(model=MODEL, prompt="The answer is", temperature=0,
                                     extra_body={"speculative": spec, **extra}, **kwargs).choices[0]


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
    ({"guided_regex": "[0-9]{3}"}, lambda text: len(text) == 3 and text.isdigit()),
    ({"structured_outputs": {"grammar": 'start: "(" NUM ")"\nNUM: /[1-9][0-9]?/'}},
     lambda text: text.startswith("(") and text.endswith(")") and text[1:-1].isdigit()),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY | {
        "x-guidance": {"whitespace_flexible": False}}}}}, lambda text: json.loads(text) in ({"city": "Paris"},
                                                                                         {"city": "Rome"})),
])
def test_structured_outputs_constrain_the_text_the_same_with_and_without_speculation(client, extra, check):
    texts = both_ways(lambda spec: completion(client, spec, max_tokens=40, extra_body=extra))
    for choice in texts:
        assert choice.finish_reason == "stop" and check(choice.text), choice
    assert texts[0].text == texts[1].text


def test_logit_bias_min_tokens_and_stop_token_ids_reach_the_worker(client, tokenizer):
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    forced = both_ways(lambda spec: completion(client, spec, max_tokens=5, logit_bias={str(a): 100}))
    assert [c.text for c in forced] == ["a" * 5] * 2
    # EOS pushed up but held back for 3 tokens: exactly 3 tokens, then the end
    held = both_ways(lambda spec: client.completions.create(
        model=MODEL, prompt="The answer is", temperature=0, max_tokens=20, logit_bias={str(EOS): 100, str(a): 50},
        extra_body={"min_tokens": 3, "speculative": spec}))
    assert all(h.choices[0].text == "aaa" and h.choices[0].finish_reason == "stop" for h in held)
    assert all(h.usage.completion_tokens in (3, 4) for h in held)  # with or without the EOS counted
    stopped = both_ways(lambda spec: completion(client, spec, max_tokens=5, logit_bias={str(a): 100},
                                                extra_body={"stop_token_ids": [a]}))
    assert all(c.text == "" and c.finish_reason == "stop" for c in stopped)
