"""services/api/planning.py: request bodies become Plans (one CompletionRequest per choice) within the
context (drafter/decode/capacity.py), with the tiny verifier's tokenizer."""
from __future__ import annotations

import pytest

from specloop.drafter.decode.capacity import AUTO_K_MAX, draft_reserve
from specloop.drafter.model.loading import load_tokenizer
from specloop.services.api.planning import (
    DEFAULT_MAX_TOKENS,
    ApiConfig,
    completion_budget,
    plan_request,
    prompt_bytes_limit,
)
from specloop.services.api.schemas import ApiError
from tests.tiny import TEXT

MODEL = "tiny-verifier"
CHAT = [{"role": "user", "content": "def main():"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return load_tokenizer(tiny_pair[0])


def test_default_max_tokens_fills_the_context_up_to_a_cap():
    cfg = ApiConfig(MODEL, 512)
    usable = 512 - draft_reserve(4)
    assert completion_budget(10, None, 4, cfg) == DEFAULT_MAX_TOKENS
    assert completion_budget(usable - 3, None, 4, cfg) == 3
    assert completion_budget(usable - 3, None, 0, cfg) == 3 + draft_reserve(4) - draft_reserve(0)
    assert completion_budget(10, usable - 10, 4, cfg) == usable - 10
    with pytest.raises(ApiError):
        completion_budget(11, usable - 10, 4, cfg)


def test_a_plan_fans_n_choices_out_with_one_seed_and_stream_indices(tokenizer):
    cfg, tok = ApiConfig(MODEL, 512), tokenizer
    body = {"model": MODEL, "messages": CHAT, "n": 3, "temperature": 0.7, "top_k": -1, "max_completion_tokens": 5,
            "speculative": {"k": 2, "drafter_version": "v0003"}}
    plan = plan_request(body, True, cfg, tok)
    assert [r.stream_index for r in plan.requests] == [0, 1, 2] and len({r.seed for r in plan.requests}) == 1
    assert all(r.k == 2 and r.drafter_version == "v0003" and r.max_tokens == 5 and r.top_k == 0 for r in plan.requests)
    assert plan_request(body, True, cfg, tok).requests[0].seed != plan.requests[0].seed  # random per request
    greedy = plan_request({"model": MODEL, "prompt": "x", "temperature": 0, "speculative": {"enabled": False}},
                          False, cfg, tok)
    assert greedy.requests[0].seed == 0 and greedy.requests[0].k == 0


def test_k_is_auto_by_default_and_auto_reserves_room_for_the_most_the_controller_drafts(tokenizer):
    cfg, tok = ApiConfig(MODEL, 512), tokenizer
    for spec in (None, {}, {"k": "auto"}, {"enabled": True, "k": "auto"}):
        body = {"model": MODEL, "prompt": "x"} | ({} if spec is None else {"speculative": spec})
        assert plan_request(body, False, cfg, tok).requests[0].k is None  # None: auto
    assert draft_reserve(None) == draft_reserve(AUTO_K_MAX)
    assert completion_budget(512 - draft_reserve(None) - 3, None, None, cfg) == 3
    with pytest.raises(ApiError, match="reserved for drafting with k=auto"):
        completion_budget(600, None, None, cfg)


def test_the_prompt_byte_limit_never_refuses_a_prompt_that_fits(tokenizer):
    """Text that encodes to n tokens is never over the limit for a context of n tokens."""
    tok = tokenizer
    for text in [*TEXT, " " * 300, "\n\t" * 200, "é" * 100, "日本語のテキスト" * 20, "<|user|>" * 10, "0123456789" * 50]:
        n = len(tok.encode(text, add_special_tokens=False))
        assert len(text.encode()) <= prompt_bytes_limit(tok, n), text[:40]


def test_ignore_eos_reaches_every_choice_and_its_sampling_params(tokenizer):
    cfg = ApiConfig(MODEL, 512)
    plan = plan_request({"model": MODEL, "prompt": "x", "n": 2, "ignore_eos": True}, False, cfg, tokenizer)
    assert all(r.ignore_eos and r.sampling().ignore_eos for r in plan.requests)
    assert not plan_request({"model": MODEL, "prompt": "x"}, False, cfg, tokenizer).requests[0].sampling().ignore_eos
    with pytest.raises(ApiError):
        plan_request({"model": MODEL, "prompt": "x", "ignore_eos": "yes please"}, False, cfg, tokenizer)


def test_a_body_with_far_more_role_keys_than_messages_allowed_is_refused_before_parsing():
    import json

    from specloop.services.api.schemas import ApiError, count_messages

    at_limit = json.dumps({"messages": [{"role": "user", "content": 'my "role" is "role"'}] * 64}).encode()
    count_messages(at_limit, 64)  # quotes inside strings are escaped: only the keys count
    over = json.dumps({"messages": [{"role": "user", "content": ""}] * 200}).encode()
    try:
        count_messages(over, 64)
    except ApiError as err:
        assert err.status == 400 and err.param == "messages" and "at most 64" in err.message
    else:
        raise AssertionError("200 messages passed a limit of 64")


# ------------------------------------------------------------------------ sampling controls and structured outputs


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}


def test_the_sampling_controls_reach_every_choice_and_the_wire(tokenizer):
    from specloop.services.protocol import CompletionRequest

    cfg = ApiConfig(MODEL, 512)
    body = {"model": MODEL, "prompt": "x", "n": 2, "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.3, "min_p": 0.05, "logit_bias": {"7": -100, "3": 2.5}, "min_tokens": 4,
            "max_tokens": 8, "stop_token_ids": [2, 9, 2]}
    for r in plan_request(body, False, cfg, tokenizer).requests:
        assert (r.presence_penalty, r.frequency_penalty, r.repetition_penalty, r.min_p) == (0.5, -1.0, 1.3, 0.05)
        assert r.logit_bias == [(3, 2.5), (7, -100.0)]  # string keys → ints, sorted
        assert r.min_tokens == 4 and r.stop_token_ids == [2, 9] and r.guided is None
        assert CompletionRequest.from_dict(r.to_dict()) == r
    plain = plan_request({"model": MODEL, "prompt": "x"}, False, cfg, tokenizer).requests[0]
    assert (plain.presence_penalty, plain.frequency_penalty, plain.repetition_penalty, plain.min_p) == (0, 0, 1, 0)
    assert plain.logit_bias == [] and plain.min_tokens == 0 and plain.stop_token_ids == []


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.mark.parametrize("extra, kind, spec", [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "json_object", ""),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_json": '{"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}'},
     "json_schema", SCHEMA),
    ({"guided_regex": "(yes|no)"}, "regex", "(yes|no)"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"guided_grammar": 'start: "yes" | "no"'}, "lark", 'start: "yes" | "no"'),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ["a", "b"]),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, "lark", 'start: "a"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
])
@pytest.mark.parametrize("chat", [True, False])
def test_each_structured_form_becomes_the_guided_spec_of_every_choice(tokenizer, extra, kind, spec, chat):
    import json

    body = {"model": MODEL, "n": 2, **({"messages": CHAT} if chat else {"prompt": "x"}), **extra}
    for r in plan_request(body, chat, ApiConfig(MODEL, 512), tokenizer).requests:
        assert r.guided["kind"] == kind
        assert (json.loads(r.guided["spec"]) if kind in ("json_schema", "choice") else r.guided["spec"]) == spec


def test_a_gbnf_grammar_is_converted_to_lark(tokenizer):
    from llguidance import LLMatcher

    r = plan_request({"model": MODEL, "prompt": "x", "guided_grammar": 'root ::= "yes" | "no"'}, False,
                     ApiConfig(MODEL, 512), tokenizer).requests[0]
    assert r.guided["kind"] == "lark" and "::=" not in r.guided["spec"]
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(r.guided["spec"])) == ""


def compiles(lark: str) -> bool:
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark)) == ""


def test_tool_choice_required_or_named_is_a_lark_grammar_of_tool_calls_and_auto_or_none_none(tokenizer):
    cfg = ApiConfig(MODEL, 1024)
    body = {"model": MODEL, "messages": CHAT, "tools": [WEATHER, NOOP]}
    for choice in (None, "auto", "none"):
        p = plan_request(body | ({} if choice is None else {"tool_choice": choice}), True, cfg, tokenizer)
        assert p.requests[0].guided is None
        assert (p.tools is None) == (choice == "none")
    required = plan_request(body | {"tool_choice": "required"}, True, cfg, tokenizer)
    lark = required.requests[0].guided["spec"]
    assert required.requests[0].guided["kind"] == "lark" and compiles(lark)
    assert '"get_weather"' in lark and '"noop"' in lark and 'start: call ("\\n" call)*' in lark
    named = plan_request(body | {"tool_choice": {"type": "function", "function": {"name": "noop"}},
                                 "parallel_tool_calls": False}, True, cfg, tokenizer)
    lark = named.requests[0].guided["spec"]
    assert compiles(lark) and '"noop"' in lark and "get_weather" not in lark and "start: call\n" in lark
    assert named.tools.choice == "function" and named.tools.function == "noop" and not named.tools.parallel


def decoded_prompt(tokenizer, body: dict, cfg: ApiConfig | None = None) -> str:
    plan = plan_request({"model": MODEL, **body}, True, cfg or ApiConfig(MODEL, 2048), tokenizer)
    return tokenizer.decode(plan.requests[0].prompt_ids)


HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?", "name": "ann"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "18 C, rain"}]},
]


def test_tools_and_past_calls_are_rendered_as_hermes_text_by_a_template_that_ignores_tools(tokenizer):
    text = decoded_prompt(tokenizer, {"messages": [{"role": "system", "content": "Be brief."}, *HISTORY],
                                      "tools": [WEATHER]})
    order = ["Be brief.", "<tools>\n", '"name": "get_weather"', "\n</tools>", "<tool_call>", "Weather in Paris"]
    assert [text.index(s) for s in order] == sorted(text.index(s) for s in order)  # one system turn, first
    assert text.count("<|system|>") == 1
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert "<tool_response>\n22 C, sunny\n</tool_response>\n<tool_response>\n18 C, rain\n</tool_response>" in text
    # tool_choice none: the tools are not rendered; the history still is
    text = decoded_prompt(tokenizer, {"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"})
    assert "<tools>" not in text and "<tool_response>\n22 C, sunny" in text and '"city": "Rome"' in text


NATIVE = ("{% if tools %}<|system|>\nTOOLS {% for t in tools %}{{ t.function.name }};{% endfor %}<|end|>\n{% endif %}"
          "{% for m in messages %}<|{{ m.role }}|>\n{% if m.name %}({{ m.name }}) {% endif %}"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
          "{% endfor %}{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }}: {{ m.content }}{% else %}{{ m.content }}"
          "{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_a_template_that_speaks_tools_renders_them_itself_and_the_configured_template_wins(tokenizer):
    cfg = ApiConfig(MODEL, 2048, chat_template=NATIVE)
    text = decoded_prompt(tokenizer, {"messages": HISTORY, "tools": [WEATHER, NOOP]}, cfg)
    assert "TOOLS get_weather;noop;" in text and "(ann) Weather in Paris" in text
    assert 'CALL get_weather {"city": "Paris"}CALL get_weather {"city": "Rome"}' in text  # arguments as objects
    assert "RESULT call_1: 22 C, sunny" in text and "RESULT call_2: 18 C, rain" in text
    assert "<tool_call>" not in text and "<tools>" not in text
    own = ApiConfig(MODEL, 2048, chat_template="{{ messages[0].content }}!")
    assert decoded_prompt(tokenizer, {"messages": CHAT}, own) == "def main():!"
