"""services/api/schemas.py (with the checks planning and structured.py add): the sampling controls,
structured outputs, tools and the message fields of tool calling are accepted in range and refused
out of it with a 400 that names the parameter; what stays unsupported is still refused."""
from __future__ import annotations

import pytest

from specloop.drafter.model.loading import load_tokenizer
from specloop.services.api.planning import ApiConfig, plan_request
from specloop.services.api.schemas import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOOLS, ApiError
from specloop.services.api.structured import MAX_GUIDED_CHARS

MODEL = "tiny-verifier"
CHAT = [{"role": "user", "content": "def main():"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return load_tokenizer(tiny_pair[0])


def plan(tokenizer, extra: dict, chat: bool = True):
    body = {"model": MODEL, **({"messages": CHAT} if chat else {"prompt": "x"}), **extra}
    return plan_request(body, chat, ApiConfig(MODEL, 512), tokenizer)


def refused(tokenizer, extra: dict, chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as exc:
        plan(tokenizer, extra, chat)
    assert exc.value.status == 400 and exc.value.type == "invalid_request_error", exc.value.message
    return exc.value


CONTROLS = [
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.2}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"logit_bias": [[5, 1]]}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias"),  # beyond the vocabulary (planning)
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 6, "max_tokens": 5}, "min_tokens"),
    ({"min_tokens": 5000}, "min_tokens"),  # more than the default budget
    ({"stop_token_ids": 4}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids.0"),
    ({"stop_token_ids": ["4"]}, "stop_token_ids.0"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("extra, param", CONTROLS)
def test_sampling_controls_out_of_range_are_400s_naming_the_parameter(tokenizer, extra, param, chat):
    assert refused(tokenizer, extra, chat).param == param


STRUCTURED = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "structural_tag", "structures": []}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes", "schema": {}}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    ({"guided_json": '{"type": "integer", "minimum": "x"}'}, "guided_json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_regex": "a" * (MAX_GUIDED_CHARS + 1)}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": ["yes", 1]}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_grammar": 5}, "guided_grammar"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),  # at most one form
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("extra, param", STRUCTURED)
def test_structured_outputs_that_cannot_work_are_400s_naming_the_parameter(tokenizer, extra, param, chat):
    err = refused(tokenizer, extra, chat)
    assert err.param == param, err.message


TOOLS = [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"messages": [{"role": "user", "content": "hi", "name": ["ann"]}]}, "messages.0.name"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "content": "hi", "tool_call_id": "c"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "retrieval", "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": "f()"}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "tool", "content": "4", "tool_call_id": 4}]}, "messages.0.tool_call_id"),
]


@pytest.mark.parametrize("extra, param", TOOLS)
def test_tools_that_do_not_fit_are_400s_naming_the_parameter(tokenizer, extra, param):
    err = refused(tokenizer, extra)
    assert err.param == param, err.message


def test_tools_stay_chat_parameters_and_the_deprecated_functions_point_to_them(tokenizer):
    assert refused(tokenizer, {"tools": [WEATHER]}, chat=False).param == "tools"
    assert refused(tokenizer, {"tool_choice": "required"}, chat=False).param == "tool_choice"
    assert "use `tools` instead" in refused(tokenizer, {"functions": [{"name": "f"}]}).message
    assert "use `tool_choice` instead" in refused(tokenizer, {"function_call": {"name": "f"}}).message


def test_neutral_and_valid_values_are_accepted(tokenizer):
    for extra in ({"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tool_choice": "auto"},
                  {"tools": []}, {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0},
                  {"logit_bias": {}}, {"stop_token_ids": []}, {"min_tokens": 0}, {"parallel_tool_calls": False},
                  {"functions": [], "function_call": "auto"},
                  {"tools": [WEATHER], "tool_choice": "none", "guided_regex": "[a-z]+"},
                  {"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 5.0, "min_p": 1},
                  {"logit_bias": {"0": -100, "5": 100}, "min_tokens": 3, "max_tokens": 3, "stop_token_ids": [0]},
                  {"structured_outputs": {"regex": "a", "disable_fallback": False}}):
        assert plan(tokenizer, extra).requests, extra
