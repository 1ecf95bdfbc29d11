"""What the HTTP API accepts and how it refuses: the request bodies (pydantic), the OpenAI error
object (`ApiError`) and its responses, and the hostile-input guards on a raw body (size, JSON
depth). Nothing here touches a tokenizer or a backend.

Every malformed request is a 400 `invalid_request_error` naming its `param` (never FastAPI's 422);
parameters this server does not implement are refused unless they carry their neutral value.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from specloop.services.protocol import MAX_TOP_LOGPROBS, ErrorInfo

DEFAULT_K: Literal["auto"] = "auto"  # draft length when `speculative.k` is not given: chosen per step by the worker
MAX_K = 16
MAX_CHOICES = 16  # n × prompts of one request: each choice holds a worker slot
RETRY_AFTER_S = 1  # what a 503 tells the client to wait
MAX_BODY_BYTES = 8 * 2**20  # a request body beyond this is refused (413) before it is parsed
MAX_JSON_DEPTH = 32  # arrays / objects nested deeper are refused (400)
MAX_MESSAGES = 4096  # messages per request (and never more than the context: each costs at least a token)
MAX_STOP_CHARS = 512  # characters per stop string (the stop check decodes a window this long per token)
MAX_DETOKENIZE = 65536  # token ids per /detokenize request
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request
MAX_TOOLS = 128  # tools per request
MAX_TOOL_NAME = 128  # characters of a tool's (function's) name
_DIGITS = re.compile(r"(0|[1-9][0-9]*)\Z")  # a token id as a logit_bias key


# ---------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_info(cls, info: ErrorInfo) -> "ApiError":
        return cls(info.status, info.message, info.type, info.param, info.code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def not_found(model: str, served: str | None = None) -> ApiError:
    tail = f" (this server serves `{served}`)" if served else ""
    return ApiError(404, f"The model `{model}` does not exist{tail}.", "not_found_error", "model", "model_not_found")


def error_response(err: ApiError, retry_after_s: int = RETRY_AFTER_S,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The error as its HTTP answer; a 503 says when to retry."""
    headers = dict(headers or {})
    if err.status == 503:
        headers["Retry-After"] = str(retry_after_s)
    return JSONResponse(err.body(), status_code=err.status, headers=headers or None)


def validation_message(exc: ValidationError | RequestValidationError) -> ApiError:
    """The first pydantic error as a 400: `param` is its dotted location (`messages.0.role`)."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return invalid(f"the request body is not valid JSON: {first.get('msg')}")
    return invalid(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param)


# ---------------------------------------------------------------------------------------- request models


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # unknown OpenAI fields (user, store …): ignored


class Speculative(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo here would silently change decoding
    enabled: bool = True
    k: int | Literal["auto"] = DEFAULT_K
    drafter_version: str | None = None

    @field_validator("k", mode="before")
    @classmethod
    def _auto_or_length(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_K):
            return value
        raise ValueError(f'must be "auto" or an integer from 1 to {MAX_K}')


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: StrictBool | None = None  # vLLM's usage on every chunk: only false (`validated`)


class FunctionCall(_Lenient):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME)
    arguments: Any = "{}"  # a JSON object as text (OpenAI's), or the object itself (checked by tools.call_arguments)


class ToolCall(_Lenient):
    """A call an assistant message made (OpenAI's `tool_calls` entry)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string, a list of text parts, or null (checked by `message_text`)
    name: str | None = None  # a speaker's name: passed to the chat template
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call this result answers


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object (None: any object)


class Tool(_Lenient):
    """A tool the model may call (OpenAI's `tools` entry: functions only)."""

    type: Literal["function"]
    function: FunctionDef


class Sampling(_Lenient):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: Any = None  # a string or a list of strings (checked by `stop_strings`)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    speculative: Speculative | None = None
    ignore_eos: bool | None = False  # vLLM's: EOS does not end a choice
    # the usual sampling controls (vLLM's ranges), applied losslessly under speculation by the worker
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's; 1 = none
    min_p: float | None = Field(None, ge=0, le=1)
    logit_bias: list[tuple[int, float]] | None = None  # {token id: bias} on the wire (`_bias_pairs`)
    min_tokens: int | None = Field(None, ge=0)  # at most max_tokens (checked by planning)
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)  # ids checked by planning
    # structured outputs: at most one of these (services/api/structured.py checks and compiles them)
    response_format: Any = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    guided_json: Any = None  # vLLM's: a JSON schema (an object, or its text)
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None  # a Lark grammar (llguidance's), or GBNF (converted)
    structured_outputs: Any = None  # vLLM's newer form: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, value):
        """OpenAI's map of token id (a string of digits, or an int) → bias in [-100, 100] as sorted
        (id, bias) pairs; the ids are checked against the vocabulary by planning."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("must be an object mapping token ids to biases")
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"takes at most {MAX_LOGIT_BIAS} token ids, got {len(value)}")
        pairs = {}
        for key, bias in value.items():
            if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and _DIGITS.match(key))):
                raise ValueError(f"keys must be token ids (non-negative integers), got {json.dumps(key)}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"biases must be numbers from -100 to 100, got {json.dumps(bias)} for {key}")
            if int(key) < 0:
                raise ValueError(f"token ids are non-negative, got {key}")
            pairs[int(key)] = float(bias)
        return sorted(pairs.items())


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # only with logprobs: true
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}} (tools.py)
    parallel_tool_calls: StrictBool | None = None  # default true; false: at most one call


class CompletionBody(Sampling):
    prompt: Any  # checked by `completion_prompts`
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token
    echo: StrictBool | None = False  # the prompt before the completion (with logprobs: its tokens scored too)
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt scored, nothing generated


class TokenizeBody(_Lenient):
    """POST /tokenize (vLLM's shape): a completion prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_generation_prompt: StrictBool = True  # messages: end with the assistant's turn opening
    add_special_tokens: StrictBool = False  # prompt: as /v1/completions encodes it (no special tokens)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # messages: rendered as a chat request's are


class DetokenizeBody(_Lenient):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[StrictInt]


# parameters this server accepts only at their neutral value, unless the body's model declares them:
# each would change what is generated (or how it is returned), so one is refused, never ignored.
# Other unknown fields (user, store, metadata, service_tier …) change nothing and are ignored.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "top_logprobs": (None, 0),  # a chat parameter (on /v1/completions: refused)
    "max_completion_tokens": (None,),  # a chat parameter
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),  # chat (on /v1/completions: refused)
    "functions": (None, []),  # deprecated: `tools`
    "tool_choice": (None, "none", "auto"),  # chat
    "function_call": (None, "none", "auto"),  # deprecated: `tool_choice`
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    # vLLM's extensions
    "length_penalty": (None, 1),
    "bad_words": (None, []),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "prompt_logprobs": (None,),
    "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,),
    "add_special_tokens": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "guided_whitespace_pattern": (None,),
    "logits_processors": (None,),
    "allowed_token_ids": (None,),
    "return_tokens_as_token_ids": (None, False),
    "reasoning_effort": (None,),
}
# what a refusal adds for a parameter that has a supported replacement
HINTS = {"functions": "use `tools` instead", "function_call": "use `tool_choice` instead"}


def check_supported(body: dict, model: type[BaseModel]) -> None:
    for name, neutral in NEUTRAL.items():
        if name not in model.model_fields and not any(_same(body.get(name), v) for v in neutral):
            hint = f"; {HINTS[name]}" if name in HINTS else ""
            raise invalid(f"`{name}` is not supported by this server (got {json.dumps(body.get(name))}){hint}", name)


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same kind (False is not 0)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


# ---------------------------------------------------------------------------------------------- raw bodies


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {'at least ' if size <= limit else ''}{size} bytes; this server "
                    f"takes at most {limit}", code="request_too_large")


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body's JSON value; 400 when it is not JSON or nests deeper than `max_depth`."""
    too_deep = invalid(f"the request body nests arrays or objects more than {max_depth} deep")
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # ValueError: also an integer of more than 4,300 digits
        raise invalid(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise too_deep from None
    if json_depth(value, max_depth) > max_depth:
        raise too_deep
    return value


def json_depth(value: Any, stop: int) -> int:
    """How deep `value` nests lists and dicts (1 for a flat one), counted up to `stop` + 1 at most."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if deepest > stop:
                return deepest
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)
                        if isinstance(v, (list, dict)))
    return deepest


def check_lengths(body: dict, max_messages: int = MAX_MESSAGES) -> None:
    """Lists whose validation alone would hold the planner thread (250,000 empty messages fit in an
    8 MB body): refused before pydantic sees them."""
    for name, limit in (("messages", max_messages), ("tokens", MAX_DETOKENIZE), ("tools", MAX_TOOLS),
                        ("stop_token_ids", MAX_STOP_TOKEN_IDS), ("logit_bias", MAX_LOGIT_BIAS)):
        value = body.get(name)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise invalid(f"`{name}` holds {len(value)} items; this server takes at most {limit}", name)


def count_messages(raw: bytes, max_messages: int) -> None:
    """A body with far more `"role"` keys than messages allowed is refused before it is parsed: parsing
    250,000 message objects alone holds the planner thread (and the GIL) for half a second. A JSON
    string cannot hold an unescaped quote, so the count is of keys (and of values spelled "role")."""
    found = raw.count(b'"role"')
    if found > 2 * max_messages + 16:
        raise invalid(f"`messages` holds at least {found // 2} items; this server takes at most {max_messages}",
                      "messages")


Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, model: type[Body], max_messages: int = MAX_MESSAGES) -> Body:
    """A raw body as `model`, or the 400 that says what is wrong with it."""
    count_messages(raw, max_messages)
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_lengths(body, max_messages)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_message(exc) from None
