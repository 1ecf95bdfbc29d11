"""services/api/tools.py: Hermes tool calls parsed out of generated text (whole and streamed), the
Lark grammar that forces them (checked with llguidance against the tiny tokenizer), and the chat
API's tool-call answers over a scripted backend, through uvicorn and the official `openai` client."""
from __future__ import annotations

import json

import openai
import pytest

from specloop.services.api.app import create_app
from specloop.services.api.tools import ToolStream, call_schema, parse_tool_calls, speaks_tools, tool_lark
from tests.admin_helpers import serving
from tests.api_helpers import MODEL, Scripted, scripted

NAMES = frozenset({"get_weather", "noop"})
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ------------------------------------------------------------------------------------------ parsing


def test_one_call_becomes_a_tool_call_and_no_content():
    content, calls = parse_tool_calls(PARIS, NAMES)
    assert content is None and names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]
    assert isinstance(calls[0]["function"]["arguments"], str)


def test_several_calls_and_the_text_around_them():
    text = f"Let me check both.\n{PARIS}\n{ROME}\nDone."
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check both.\n\n\nDone."
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    content, calls = parse_tool_calls(text, NAMES, parallel=False)
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", [
    "no call at all",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # unknown function
    '<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>',  # not a call object
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": "{oops"}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
])
def test_malformed_or_unknown_calls_stay_plain_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_a_bad_block_beside_a_good_one_stays_content_and_loose_forms_are_read():
    bad = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(f"{bad}\n{PARIS}", NAMES)
    assert content == bad and names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]
    loose = ['<tool_call>{"name": "noop"}</tool_call>',  # no arguments: {}
             '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>',
             '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}']  # unclosed, but whole
    _, calls = parse_tool_calls("".join(loose), NAMES)
    assert names_and_arguments(calls) == [("noop", {}), ("get_weather", {"city": "Oslo"}),
                                          ("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Lima"})]


def feed_all(pieces: list[str]) -> tuple[str, str, list[dict]]:
    stream = ToolStream()
    sent = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish(NAMES)
    return sent, rest, calls


def test_a_stream_sends_text_until_a_call_opens_and_the_calls_at_the_end():
    text = f"Sure.\n{PARIS}"
    for pieces in ([text], list(text), [text[:8], text[8:12], text[12:]]):
        sent, rest, calls = feed_all(pieces)
        assert sent == "Sure.\n" and rest == "" and names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]
    stream = ToolStream()
    assert stream.feed("a <tool") == "a " and stream.feed("box> b") == "<toolbox> b"  # a false start goes out
    assert stream.feed("<") == "" and stream.finish(NAMES) == ("<", [])


def test_a_stream_without_a_valid_call_sends_all_of_its_text():
    for text in ("plain text, no calls", "<tool_call>\nnot json\n</tool_call> after", "ends with <tool_c"):
        sent, rest, calls = feed_all(list(text))
        assert sent + rest == text and calls == []


# ------------------------------------------------------------------------------------------ the grammar


@pytest.fixture(scope="module")
def matcher_for(tiny_pair):
    """A function: (lark grammar, text) → whether the grammar accepts the text whole (the tiny tokenizer's
    tokens through an llguidance matcher, as the worker's grammar runs)."""
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer

    from specloop.drafter.model.loading import load_tokenizer

    tok = load_tokenizer(tiny_pair[0])
    lltok = from_tokenizer(tok)

    def accepts(lark: str, text: str) -> bool:
        m = LLMatcher(lltok, LLMatcher.grammar_from_lark(lark))
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    return accepts


def test_the_required_grammar_takes_calls_of_the_given_tools_with_valid_arguments(matcher_for):
    lark = tool_lark([WEATHER, NOOP])
    assert matcher_for(lark, PARIS)
    assert matcher_for(lark, f"{PARIS}\n{ROME}\n" + '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert not matcher_for(lark, "Sure. " + PARIS)  # nothing before the call
    assert not matcher_for(lark, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    assert not matcher_for(lark, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')  # city
    assert not matcher_for(lark, '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>')
    assert not matcher_for(lark, PARIS.replace('": ', '":  '))  # one way to write it: no whitespace padding
    assert not matcher_for(lark, "<tool_call>\n")  # unfinished
    single = tool_lark([WEATHER], parallel=False)
    assert matcher_for(single, ROME) and not matcher_for(single, f"{PARIS}\n{ROME}")


def test_parameters_with_local_references_keep_them_inside_the_call(matcher_for):
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "properties": {"src": {"$ref": "#/$defs/P"}, "dst": {"$ref": "#/properties/src"}}, "required": ["src", "dst"]}}}
    schema = call_schema(tool)
    assert "$defs" in schema and schema["properties"]["arguments"]["properties"]["dst"]["$ref"] == \
        "#/properties/arguments/properties/src"
    lark = tool_lark([tool])
    assert matcher_for(lark, '<tool_call>\n{"name": "move", "arguments": {"src": {"x": 1}, "dst": {"x": 2}}}\n</tool_call>')
    assert not matcher_for(lark, '<tool_call>\n{"name": "move", "arguments": {"src": {"x": 1}, "dst": {}}}\n</tool_call>')


def test_which_templates_speak_tools(tiny_pair):
    from pathlib import Path

    from specloop.drafter.model.loading import load_tokenizer

    assert not speaks_tools(load_tokenizer(tiny_pair[0]).chat_template)
    assert not speaks_tools(None)
    assert speaks_tools("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.tool_calls }}"
                        "{% endfor %}")
    for folder in (Path("/tmp/shared/models/verifier"), Path.home() / ".cache/specloop/models/smollm2-135m-instruct/"
                   "verifier"):  # the reference pair's and SmolLM2-135M-Instruct's render role and content only
        if (folder / "tokenizer_config.json").is_file():
            assert not speaks_tools(load_tokenizer(folder).chat_template)


# ------------------------------------------------------------------------------------------ the API


class Replies(Scripted):
    """A Scripted backend whose text can be changed between requests (`say`)."""

    def say(self, text: str) -> None:
        self.tokens = self.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def backend(tiny_pair):
    base = scripted(tiny_pair[0])
    return Replies(base.tokenizer, base.tokens, verifier=base.verifier)


@pytest.fixture(scope="module")
def client(backend):
    # a context large enough for the tools' system block in the tiny tokenizer's short tokens
    with serving(create_app(backend, backend.tokenizer, MODEL, 4096)) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_tool_call_comes_back_as_tool_calls_with_finish_reason_tool_calls(client, backend):
    backend.say(f"Let me check.\n{PARIS}")
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1000)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    request = backend.requests[-1]
    assert request.guided is None and "<tools>" in backend.tokenizer.decode(request.prompt_ids)  # auto: no grammar
    # the call and its result go back in the next request
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "22 C"}]
    backend.say("It is 22 C in Paris.")
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=1000)
    assert out.choices[0].message.content == "It is 22 C in Paris." and not out.choices[0].message.tool_calls
    prompt = backend.tokenizer.decode(backend.requests[-1].prompt_ids)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n22 C\n</tool_response>" in prompt


def test_required_and_named_tool_choices_send_the_grammar(client, backend):
    backend.say(PARIS)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOOP], tool_choice="required",
                                         max_tokens=1000)
    assert out.choices[0].message.content is None and out.choices[0].finish_reason == "tool_calls"
    guided = backend.requests[-1].guided
    assert guided["kind"] == "lark" and '"get_weather"' in guided["spec"] and '"noop"' in guided["spec"]
    client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOOP], max_tokens=1000,
                                   tool_choice={"type": "function", "function": {"name": "noop"}})
    assert '"get_weather"' not in backend.requests[-1].guided["spec"]


def test_without_a_call_or_with_tool_choice_none_the_answer_is_plain_text(client, backend):
    backend.say(f"I would call {PARIS} but no.")
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                         max_tokens=1000)
    assert out.choices[0].message.content == f"I would call {PARIS} but no." and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "length"
    assert "<tools>" not in backend.tokenizer.decode(backend.requests[-1].prompt_ids)
    backend.say("<tool_call>\n{\"name\": \"launch_rockets\", \"arguments\": {}}\n</tool_call>")
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1000)
    assert out.choices[0].message.content.startswith("<tool_call>") and not out.choices[0].message.tool_calls


def test_a_streamed_tool_call_holds_its_text_back_and_ends_with_tool_calls_deltas(client, backend):
    backend.say(f"Checking.\n{PARIS}\n{ROME}")
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1000, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments), tc.id)
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking.\n" and finish == "tool_calls" and "<tool" not in content
    assert [c[:2] for c in calls.values()] == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(c[2].startswith("call_") for c in calls.values())
    backend.say("No call <tool here, just text.")
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1000, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "No call <tool here, just text."
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tokenize_renders_tools_as_a_chat_request_does(client, backend):
    import httpx

    url = str(client.base_url).removesuffix("/v1/")
    plain = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": ASK}, timeout=30).json()
    with_tools = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": ASK, "tools": [WEATHER]},
                            timeout=30).json()
    assert "<tools>" in backend.tokenizer.decode(with_tools["tokens"]) and with_tools["count"] > plain["count"]
    backend.say("ok")
    client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=5)
    assert backend.requests[-1].prompt_ids == with_tools["tokens"]
