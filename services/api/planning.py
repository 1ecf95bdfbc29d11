"""Request planning: a validated request body becomes a `Plan`, one `CompletionRequest` per choice.

Planning resolves the prompt (chat template or completion prompt, as token ids; a chat's tools and
past calls rendered as services/api/tools.py says), the completion budget under the capacity rule
(drafter/decode/capacity.py: prompt + max_tokens + 2k + 2 positions), stop strings, the seed, the
draft length, the sampling controls (penalties, min_p, logit_bias, min_tokens, stop_token_ids) and
the structured-output spec (services/api/structured.py, or a forced tool call's grammar). It runs on
the API's planner thread (tokenizing never holds the event loop) and raises `ApiError` for anything off.

A request with `n` choices (or several prompts) fans out into one `CompletionRequest` per choice,
all with the request's seed and stream_index = choice index.
"""
from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from specloop.drafter.decode.capacity import draft_reserve
from specloop.services.api import tools as toolkit
from specloop.services.api.schemas import (
    MAX_BODY_BYTES,
    MAX_CHOICES,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    RETRY_AFTER_S,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    Message,
    Speculative,
    TokenizeBody,
    check_lengths,
    check_supported,
    count_messages,
    invalid,
    not_found,
    parse_body,
    parse_json,
    validation_message,
)
from specloop.services.api.structured import guided_spec
from specloop.services.api.tools import ToolPlan, tool_guided, tool_plan
from specloop.services.protocol import CompletionRequest

DEFAULT_MAX_TOKENS = 256  # when a request names none: what fits the context, at most this many
MAX_STOP = 4  # stop strings per request (OpenAI's limit)


@dataclass
class ApiConfig:
    model_id: str  # the id clients name in `model`
    max_context: int  # positions of a worker slot: prompt + max_tokens + draft_reserve(k) must fit
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    retry_after_s: int = RETRY_AFTER_S
    max_prompt_bytes: int | None = None  # prompt text beyond this cannot fit the context (`prompt_bytes_limit`)
    max_body_bytes: int = MAX_BODY_BYTES
    chat_template: str | None = None  # --chat-template: a Jinja template used instead of the tokenizer's own

    @property
    def max_messages(self) -> int:
        """Messages per request: each costs at least one token of the context after templating."""
        return min(MAX_MESSAGES, self.max_context)


@dataclass
class Plan:
    """One API request, validated: a CompletionRequest per choice (choice index = list index)."""

    id: str
    chat: bool
    created: int
    prompt_lens: list[int]  # tokens of each distinct prompt (usage counts each once)
    requests: list[CompletionRequest]
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: none asked; n: each token's log-probability and its n most likely alternatives
    tools: ToolPlan | None = None  # a chat's tools in play: its answers' tool calls are parsed (tools.py)
    echoes: list[Echo] | None = None  # completions' `echo`: each distinct prompt, sent before its choices' text
    n: int = 1  # choices per prompt (choice index = prompt index × n + i)

    def echo(self, choice: int) -> "Echo | None":
        """What choice `choice` sends before its completion (None: no echo)."""
        return None if self.echoes is None else self.echoes[choice // self.n]

    def scorer(self, choice: int) -> int:
        """The choice whose request scores the prompt of choice `choice` (its prompt's first: one pass a prompt)."""
        return choice // self.n * self.n


@dataclass(frozen=True)
class Echo:
    """A prompt sent back before its completion (OpenAI's `echo`): its text and its token ids (their strings and
    log-probabilities lead the choice's `logprobs` when the request asked for them)."""

    text: str
    ids: tuple[int, ...]


# ---------------------------------------------------------------------------------------------- prompts


def prompt_bytes_limit(tokenizer, max_context: int) -> int:
    """The most UTF-8 bytes of prompt text that can encode to `max_context` tokens or fewer: each token
    stands for at most as many input bytes as its own vocabulary string holds (an upper bound, so no
    prompt that fits is refused), doubled for normalizers that shorten their input. Checked before
    tokenizing, so a 12 MB prompt is refused in microseconds rather than after seconds of encoding."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max((len(t.encode("utf-8")) for t in tokens if isinstance(t, str)), default=1)
    return 2 * max(longest, 4) * max_context


def check_prompt_bytes(texts: list[str], cfg: ApiConfig, param: str) -> None:
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if cfg.max_prompt_bytes is not None and size > cfg.max_prompt_bytes:
        raise invalid(f"the prompt has {size} bytes of text; at most {cfg.max_prompt_bytes} can fit this model's "
                      f"context of {cfg.max_context} tokens. Please shorten it.", param)


def message_text(message: Message, i: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                              f"messages.{i}.content.{j}")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid("content must be a string or a list of text parts", f"messages.{i}.content")


def chat_prompt(tokenizer, messages: list[Message], cfg: ApiConfig, add_generation_prompt: bool = True,
                tools: ToolPlan | None = None) -> list[int]:
    """The chat template (cfg.chat_template, else the tokenizer's) applied, by default with a
    generation prompt (as `specloop generate` does), with `tools` and the messages' calls and results
    rendered by the template when it speaks tools, else as Hermes-style text (tools.py)."""
    template = cfg.chat_template if cfg.chat_template is not None else getattr(tokenizer, "chat_template", None)
    native = toolkit.speaks_tools(template)
    turns = chat_turns(messages, tools, native)
    tool_list = list(tools.tools) if tools is not None and native else None
    texts = [t["content"] for t in turns] + [json.dumps(t["tool_calls"], ensure_ascii=False) for t in turns
                                            if "tool_calls" in t]
    check_prompt_bytes(texts + ([json.dumps(tool_list, ensure_ascii=False)] if tool_list else []), cfg, "messages")
    try:
        ids = template_ids(tokenizer, turns, add_generation_prompt, cfg.chat_template, tool_list)
    except Exception as exc:  # the template's own checks (jinja raise_exception)
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
    if not ids:
        raise invalid("the messages encode to no tokens", "messages")
    return ids


def chat_turns(messages: list[Message], tools: ToolPlan | None, native: bool) -> list[dict]:
    """The messages as the chat template's turns. `native`: the template renders `tools`, an
    assistant's `tool_calls` (arguments as objects) and tool messages itself; else calls become
    `<tool_call>` text in the assistant's content, tool results a user turn of `<tool_response>`
    blocks (consecutive results share it), and the tools a system block (merged into a first system
    message, or put before the conversation). A message's `name` is passed on either way."""
    turns: list[dict] = []
    for i, m in enumerate(messages):
        content = message_text(m, i)
        if m.tool_calls and m.role != "assistant":
            raise invalid("only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise invalid("only tool messages carry a tool_call_id", f"messages.{i}.tool_call_id")
        calls = [(c, toolkit.call_arguments(c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"))
                 for j, c in enumerate(m.tool_calls or ())]
        if not native and m.role == "tool":
            block = toolkit.response_text(content)
            if i > 0 and messages[i - 1].role == "tool":
                turns[-1]["content"] += "\n" + block
            else:
                turns.append({"role": "user", "content": block})
            continue
        if not native and calls:
            content = "\n".join(([content] if content else []) + [toolkit.call_text(c.function.name, args)
                                                                  for c, args in calls])
        turn: dict = {"role": m.role, "content": content}
        if m.name is not None:
            turn["name"] = m.name
        if native and calls:
            turn["tool_calls"] = [({"id": c.id} if c.id is not None else {})
                                  | {"type": "function", "function": {"name": c.function.name, "arguments": args}}
                                  for c, args in calls]
        if native and m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        turns.append(turn)
    if tools is not None and not native:
        block = toolkit.tools_system_block(tools.tools)
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{block}" if turns[0]["content"] else block
        else:
            turns.insert(0, {"role": "system", "content": block})
    return turns


def template_ids(tokenizer, turns: list[dict], add_generation_prompt: bool, chat_template: str | None = None,
                 tools: list[dict] | None = None) -> list[int]:
    kwargs: dict[str, Any] = {}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if tools:
        kwargs["tools"] = tools
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def completion_prompts(tokenizer, prompt: Any, cfg: ApiConfig) -> list[list[int]]:
    """`prompt` as token ids: a string, a list of strings, a token-id list, or a list of those."""
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or _is_ids(p) for p in prompt):
        raise invalid("prompt must be a string, a list of strings, a list of token ids, or a list of those",
                      "prompt")
    if len(prompt) > MAX_CHOICES:
        raise invalid(f"at most {MAX_CHOICES} prompts per request, got {len(prompt)}", "prompt")
    for p in prompt:
        check_prompt_bytes([p] if isinstance(p, str) else [], cfg, "prompt")
    vocab = len(tokenizer)
    out = []
    for p in prompt:
        ids = p if _is_ids(p) else tokenizer.encode(p, add_special_tokens=False)
        if not ids:
            raise invalid("the prompt is empty (it encodes to no tokens)", "prompt")
        if not all(0 <= t < vocab for t in ids):
            raise invalid(f"prompt token ids must lie in [0, {vocab})", "prompt")
        out.append(list(ids))
    return out


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise invalid("stop strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid(f"stop strings are at most {MAX_STOP_CHARS} characters long, got "
                      f"{max(map(len, stops))}", "stop")
    return stops


# ---------------------------------------------------------------------------------------------- budgets


def completion_budget(prompt_len: int, requested: int | None, k: int | None, cfg: ApiConfig,
                      prompt_param: str = "prompt") -> int:
    """max_tokens for a prompt decoded with draft length k (None: auto): the requested count if it fits
    the context, else a 400; by default what fits, at most cfg.default_max_tokens."""
    reserve = draft_reserve(k)
    usable = cfg.max_context - reserve
    limit = (f"This model's maximum context length is {usable} tokens ({cfg.max_context} positions, {reserve} of "
             f"them reserved for drafting with k={'auto' if k is None else k}).")
    if requested is None:
        if prompt_len >= usable:
            raise invalid(f"{limit} However, the prompt has {prompt_len} tokens, which leaves no room for a "
                          "completion. Please shorten the prompt.", prompt_param)
        return min(usable - prompt_len, cfg.default_max_tokens)
    if prompt_len + requested > usable:
        raise invalid(f"{limit} However, you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                      f"{requested} for the completion). Please reduce the prompt or max_tokens.", "max_tokens")
    return requested


# ---------------------------------------------------------------------------------------------- plans


def plan_body(raw: bytes, chat: bool, cfg: ApiConfig, tokenizer) -> Plan:
    """A raw request body parsed and planned: what runs on the planner thread, off the event loop."""
    count_messages(raw, cfg.max_messages)
    return plan_request(parse_json(raw), chat, cfg, tokenizer)


def plan_request(body: Any, chat: bool, cfg: ApiConfig, tokenizer) -> Plan:
    """Validate a request body (a parsed JSON value) into a Plan; ApiError if anything is off."""
    req = validated(body, chat, cfg)
    logprobs = logprobs_asked(req)
    # cheap checks (stop strings, token ids) before compiling a schema, templating and tokenizing
    sampling = sampling_fields(req) | control_fields(req, len(tokenizer))
    guided, guided_param = guided_spec(req)
    tools = None
    if isinstance(req, ChatBody):  # what `validated` makes of a chat request (else a CompletionBody)
        tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        if tools is not None and guided_param is not None:
            raise invalid(f"`{guided_param}` cannot be combined with tools (unless tool_choice is \"none\")",
                          guided_param)
        guided = guided or tool_guided(tools)
        prompts = [chat_prompt(tokenizer, req.messages, cfg, tools=tools)]
        requested = req.max_completion_tokens or req.max_tokens
    else:
        prompts = completion_prompts(tokenizer, req.prompt, cfg)
        requested = req.max_tokens
        if requested == 0 and not req.echo:
            raise invalid("max_tokens = 0 generates nothing: it is only allowed with echo (the prompt scored)",
                          "max_tokens")
    n = req.n or 1
    if n * len(prompts) > MAX_CHOICES:
        raise invalid(f"n × prompts is at most {MAX_CHOICES}, got {n} × {len(prompts)}", "n")
    spec = req.speculative or Speculative()
    k = (None if spec.k == "auto" else spec.k) if spec.enabled else 0  # None: auto
    budgets = [completion_budget(len(p), requested, k, cfg, "messages" if chat else "prompt") for p in prompts]
    check_min_tokens(sampling["min_tokens"], min(budgets), requested is None)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    echoes = None
    if isinstance(req, CompletionBody) and req.echo:
        echoes = [Echo(echo_text(tokenizer, p, ids), tuple(ids)) for p, ids in zip(prompt_list(req), prompts)]
    # the prompt's tokens scored by the worker, once a prompt (its first choice's first chunk; the API opens a stream
    # only after every choice's first chunk, so the scores are there before any choice's echo is sent)
    scored = logprobs if echoes else None
    common = sampling | dict(k=k, drafter_version=spec.drafter_version, logprobs=logprobs, guided=guided)
    requests = [CompletionRequest(id=f"{rid}-{p * n + i}", prompt_ids=ids, max_tokens=budget,
                                  stream_index=p * n + i, prompt_logprobs=None if i else scored, **common)
                for p, (ids, budget) in enumerate(zip(prompts, budgets)) for i in range(n)]
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return Plan(rid, chat, int(time.time()), [len(p) for p in prompts], requests, bool(req.stream), include_usage,
                logprobs, tools, echoes, n)


def prompt_list(req: CompletionBody) -> list:
    """The request's prompts as given (one string or id list, or a list of them), in `completion_prompts`' order."""
    return [req.prompt] if isinstance(req.prompt, str) or _is_ids(req.prompt) else list(req.prompt)


def echo_text(tokenizer, given, ids: list[int]) -> str:
    """The prompt's text as echoed: as given, or its token ids decoded (special tokens kept, as vLLM's)."""
    return given if isinstance(given, str) else tokenizer.decode(ids, skip_special_tokens=False)


def validated(body: Any, chat: bool, cfg: ApiConfig) -> ChatBody | CompletionBody:
    """The body as its pydantic model, with the checks that span fields."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_lengths(body, cfg.max_messages)
    model = ChatBody if chat else CompletionBody
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise validation_message(exc) from None
    check_supported(body, model)
    check_model(req.model, cfg)
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise invalid("`continuous_usage_stats` is not supported by this server (include_usage is)",
                      "stream_options.continuous_usage_stats")
    return req


def logprobs_asked(req: ChatBody | CompletionBody) -> int | None:
    """The alternatives per token a request asks for (None: no log-probabilities): chat's
    `logprobs: true` with `top_logprobs` (0 by default; without logprobs it is a 400, as OpenAI's),
    completions' `logprobs: n`."""
    if isinstance(req, CompletionBody):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs is only allowed when logprobs is true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def sampling_fields(req: ChatBody | CompletionBody) -> dict:
    """temperature, top-k, top-p, seed and stop strings of the CompletionRequests."""
    temperature = 1.0 if req.temperature is None else req.temperature
    seed = req.seed if req.seed is not None else (secrets.randbits(63) if temperature > 0 else 0)
    return dict(temperature=temperature, top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p,
                seed=seed, stop=stop_strings(req.stop), ignore_eos=bool(req.ignore_eos))


def control_fields(req: ChatBody | CompletionBody, vocab: int) -> dict:
    """The sampling controls of the CompletionRequests (their neutral values when not given); the
    token ids of logit_bias and stop_token_ids must lie in [0, vocab)."""
    bias = list(req.logit_bias or [])
    stop_ids = list(dict.fromkeys(req.stop_token_ids or []))
    for param, ids in (("logit_bias", [t for t, _ in bias]), ("stop_token_ids", stop_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"{param}: token ids must lie in [0, {vocab}), got {bad}", param)
    return dict(presence_penalty=float(req.presence_penalty or 0.0),
                frequency_penalty=float(req.frequency_penalty or 0.0),
                repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
                min_p=float(req.min_p or 0.0), logit_bias=bias, min_tokens=req.min_tokens or 0,
                stop_token_ids=stop_ids)


def check_min_tokens(min_tokens: int, max_tokens: int, defaulted: bool) -> None:
    if min_tokens > max_tokens and defaulted:
        raise invalid(f"min_tokens ({min_tokens}) is more than the {max_tokens} tokens a completion gets by default "
                      "(what fits the context, at most the server's default); give max_tokens", "min_tokens")
    if min_tokens > max_tokens:
        raise invalid(f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")


# ---------------------------------------------------------------------------------------------- tokens


def tokenize(raw: bytes, cfg: ApiConfig, tokenizer) -> dict:
    """POST /tokenize: a prompt or chat messages as the token ids a completion would be fed."""
    body = parse_body(raw, TokenizeBody, cfg.max_messages)
    check_model(body.model, cfg)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of `prompt` (a string) or `messages`", "prompt")
    if body.messages is not None:
        ids = chat_prompt(tokenizer, body.messages, cfg, body.add_generation_prompt, tool_plan(body.tools, None, None))
    else:
        assert body.prompt is not None  # exactly one of prompt, messages (checked above)
        check_prompt_bytes([body.prompt], cfg, "prompt")
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    return {"tokens": ids, "count": len(ids), "max_model_len": cfg.max_context}


def detokenize(raw: bytes, cfg: ApiConfig, tokenizer) -> dict:
    """POST /detokenize: token ids as text (special tokens kept)."""
    body = parse_body(raw, DetokenizeBody)
    check_model(body.model, cfg)
    vocab = len(tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"token ids must lie in [0, {vocab}), got {bad}", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


def check_model(model: str | None, cfg: ApiConfig) -> None:
    """An optional `model` must name the served one."""
    if model is not None and model != cfg.model_id:
        raise not_found(model, cfg.model_id)
