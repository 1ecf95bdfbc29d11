"""The HTTP API: OpenAI-compatible completions over a `Backend` (services/backend.py).

Endpoints
- `POST /v1/chat/completions`, `POST /v1/completions`: OpenAI request and response shapes, streamed
  as server-sent events (`data: {json}` … `data: [DONE]`) when `stream` is true. Parameters:
  `model` (required, the served id); `messages` / `prompt` (a string, a list of strings, a token-id
  list or a list of those); `max_tokens` (chat also `max_completion_tokens`; default: what fits the
  context, at most `DEFAULT_MAX_TOKENS` = 256; the context is the worker's positions less 2k + 2
  reserved for drafting); `temperature` (0..2, default 1; 0 is greedy, and a temperature in (0, 0.01)
  samples at 0.01, as vLLM clamps it, since dividing logits by 1e-40 overflows); `top_p` (0 < p ≤ 1); `top_k` (≥ 0, 0 or
  −1 = off; a vLLM extension); `n` (1..`MAX_CHOICES`); `stop` (a string or up to 4); `seed`
  (default: random when sampling, 0 when greedy); `stream_options.include_usage`; and the extension
  `speculative: {"enabled": bool, "k": "auto" | 1..16, "drafter_version": str}` (default: on, k =
  "auto": the worker chooses k step by step from measured costs and live acceptance, down to plain
  decoding when speculation does not pay, and reserves 2 `AUTO_K_MAX` + 2 positions; the champion).
  Sampling stays exact whatever k; a `seed` repeats the same draws for the same k's, so a client that
  needs repeatable samples at temperature > 0 fixes k.
  Log-probs, tools, penalties, logit bias and JSON mode are refused (400), not ignored.
  `usage` carries, besides OpenAI's three counts, `drafted_tokens`, `accepted_tokens` and the
  `drafter_version`(s) that drafted.
- `GET /v1/models` (and `/v1/models/{id}`): the verifier's id, with the serving `drafter_version`.
- `GET /health`: 200 `{"status": "ok", "workers": N}`, 503 when no worker is alive.
- `GET /ready`: 200 once a worker has run a real forward pass (and one is alive), else 503.
- `GET /metrics`: this process's Prometheus metrics (only when a metrics object is given).
- `GET /sd/targets`: Prometheus HTTP service discovery of the workers' and learner's endpoints.
- whatever the operator router (`admin_router`) adds.

Errors are OpenAI error objects `{"error": {"message", "type", "param", "code"}}`: 400
`invalid_request_error` for every malformed request (never FastAPI's 422), 413 for a body over
`MAX_BODY_BYTES` (refused while it is read), 404 `not_found_error`
for an unknown model, 503 with `Retry-After` when the workers are overloaded or none is alive. An
error after a stream began is sent in-band (`data: {"error": …}`) and the stream ends with
`data: [DONE]`. A client that goes away stops its backend streams, so the worker frees the slots.

Hostile input is cheap to refuse: JSON nested deeper than `MAX_JSON_DEPTH` is a 400; prompt text
longer than any prompt that could fit the context (`prompt_bytes_limit`) is a 400 before it is
tokenized; parsing and tokenizing run on a planner thread, never on the event loop that streams.

A request with `n` choices (or several prompts) fans out into one `CompletionRequest` per choice,
all with the request's seed and stream_index = choice index, merged in arrival order.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from drafter.controller import AUTO_K_MAX
from services.backend import Backend
from services.prompts import PromptError, PromptRecord, encode
from services.protocol import Chunk, CompletionRequest, ErrorInfo, Usage

log = logging.getLogger("specloop.api")

DEFAULT_MAX_TOKENS = 256  # when a request names none: what fits the context, at most this many
DEFAULT_K = "auto"  # draft length when `speculative.k` is not given: chosen per step by the worker
MAX_K = 16
MAX_CHOICES = 16  # n × prompts of one request: each choice holds a worker slot
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
RETRY_AFTER_S = 1  # what a 503 tells the client to wait
SD_JOB = "specloop-actors"  # the job label of /sd/targets
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering (nginx)
CLIENT_CLOSED = 499  # status counted for a request whose client went away (nginx's code)
MAX_BODY_BYTES = 8 * 2**20  # a request body beyond this is refused (413) before it is parsed
MAX_JSON_DEPTH = 32  # arrays / objects nested deeper are refused (400)


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


def error_response(err: ApiError, retry_after_s: int = RETRY_AFTER_S) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


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


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string, a list of text parts, or null (checked by `message_text`)


class Sampling(_Lenient):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: Any = None  # a string or a list of strings (checked by `stop_strings`)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    speculative: Speculative | None = None


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionBody(Sampling):
    prompt: Any  # checked by `completion_prompts`


# parameters this server accepts only at their neutral value (it returns no log-probs, calls no tools …)
NEUTRAL = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
}


def check_supported(body: dict) -> None:
    for name, neutral in NEUTRAL.items():
        if not any(_same(body.get(name), v) for v in neutral):
            raise invalid(f"`{name}` is not supported by this server (got {json.dumps(body.get(name))})", name)


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same kind (False is not 0)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


# ------------------------------------------------------------------------------------------- planning


@dataclass
class ApiConfig:
    model_id: str  # the id clients name in `model`
    max_context: int  # positions of a worker slot: prompt + max_tokens + draft_reserve(k) must fit
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    retry_after_s: int = RETRY_AFTER_S
    max_prompt_bytes: int | None = None  # prompt text beyond this cannot fit the context (`prompt_bytes_limit`)
    max_body_bytes: int = MAX_BODY_BYTES


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


def chat_prompt(tokenizer, messages: list[Message], cfg: ApiConfig) -> list[int]:
    """The chat template applied with a generation prompt (as `specloop generate` does)."""
    turns = tuple({"role": m.role, "content": message_text(m, i)} for i, m in enumerate(messages))
    check_prompt_bytes([t["content"] for t in turns], cfg, "messages")
    try:
        return encode(tokenizer, PromptRecord(id="request", messages=turns))
    except PromptError:
        raise invalid("the messages encode to no tokens", "messages") from None
    except Exception as exc:  # the template's own checks (jinja raise_exception)
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None


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
    return stops


def draft_reserve(k: int | None) -> int:
    """Positions a request needs beyond prompt + completion: a verify pass writes k drafts and one more
    token past the committed ones, and the worker's cache reserves 2k + 2 for it (services/serving.py);
    k = None (auto) reserves for the most the controller may choose, AUTO_K_MAX."""
    return 2 * (AUTO_K_MAX if k is None else k) + 2


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


def plan_request(body: Any, chat: bool, cfg: ApiConfig, tokenizer) -> Plan:
    """Validate a request body (a parsed JSON value) into a Plan; ApiError if anything is off."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        req = (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as exc:
        raise validation_message(exc) from None
    check_supported(body)
    if req.model != cfg.model_id:
        raise ApiError(404, f"The model `{req.model}` does not exist (this server serves `{cfg.model_id}`).",
                       "not_found_error", "model", "model_not_found")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    prompts = [chat_prompt(tokenizer, req.messages, cfg)] if chat else completion_prompts(tokenizer, req.prompt, cfg)
    n = req.n or 1
    if n * len(prompts) > MAX_CHOICES:
        raise invalid(f"n × prompts is at most {MAX_CHOICES}, got {n} × {len(prompts)}", "n")
    requested = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    spec = req.speculative or Speculative()
    k = (None if spec.k == "auto" else spec.k) if spec.enabled else 0  # None: auto
    budgets = [completion_budget(len(p), requested, k, cfg, "messages" if chat else "prompt") for p in prompts]
    temperature = 1.0 if req.temperature is None else req.temperature
    seed = req.seed if req.seed is not None else (secrets.randbits(63) if temperature > 0 else 0)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    common = dict(temperature=temperature, top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p,
                  seed=seed, stop=stop_strings(req.stop), k=k, drafter_version=spec.drafter_version)
    requests = [CompletionRequest(id=f"{rid}-{p * n + i}", prompt_ids=ids, max_tokens=budget,
                                  stream_index=p * n + i, **common)
                for p, (ids, budget) in enumerate(zip(prompts, budgets)) for i in range(n)]
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return Plan(rid, chat, int(time.time()), [len(p) for p in prompts], requests, bool(req.stream), include_usage)


# -------------------------------------------------------------------------------------------- fan-out


def server_error(request_id: str, message: str) -> Chunk:
    return Chunk(request_id, error=ErrorInfo(message, "server_error", 500))


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


class Fanout:
    """The backend streams of one request's choices, merged in arrival order. `close()` stops them
    all: each stream is closed, so the worker frees its slot. `watch(request)` makes `next()` raise
    ClientGone as soon as the client disconnects (FastAPI itself does not notice before a response
    is streamed)."""

    def __init__(self, backend: Backend, requests: list[CompletionRequest]):
        self.queue: asyncio.Queue[tuple[int, Chunk | None]] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(i, backend, r)) for i, r in enumerate(requests)]
        self.watcher: asyncio.Task | None = None

    async def _pump(self, index: int, backend: Backend, request: CompletionRequest) -> None:
        stream = None
        try:
            stream = backend.stream(request)
            async for chunk in stream:
                await self.queue.put((index, chunk))
                if chunk.last:
                    return
            await self.queue.put((index, server_error(request.id, "the worker ended the stream without a last chunk")))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a backend failure (a dead actor …) becomes this choice's error chunk
            log.exception("backend stream of %s failed", request.id)
            await self.queue.put((index, server_error(request.id, f"the backend failed: {type(exc).__name__}: {exc}")))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def watch(self, request: Request) -> None:
        self.watcher = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.queue.put_nowait((-1, None))

    def unwatch(self) -> None:
        """Stop watching (a streamed response listens for the disconnect itself)."""
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None

    async def next(self) -> tuple[int, Chunk]:
        index, chunk = await self.queue.get()
        if chunk is None:
            raise ClientGone()
        return index, chunk

    def close(self) -> None:
        self.unwatch()
        for task in self.tasks:
            task.cancel()


@dataclass
class ChoiceState:
    """What one choice has produced so far, and when."""

    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    first_token_s: float | None = None
    end_s: float | None = None
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass
class Progress:
    """All choices of one request: updated per chunk, summarised into usage and metrics."""

    arrival_s: float
    choices: list[ChoiceState]
    error: ErrorInfo | None = None

    @classmethod
    def start(cls, arrival_s: float, n: int) -> "Progress":
        return cls(arrival_s, [ChoiceState() for _ in range(n)])

    def observe(self, index: int, chunk: Chunk) -> None:
        c, now = self.choices[index], time.perf_counter()
        if chunk.token_ids and c.first_token_s is None:
            c.first_token_s = now
        c.tokens += len(chunk.token_ids)
        c.texts.append(chunk.text)
        if chunk.error is not None and self.error is None:
            self.error = chunk.error
        if chunk.last:
            c.finish_reason, c.usage, c.end_s = chunk.finish_reason, chunk.usage, now

    @property
    def done(self) -> bool:
        return self.error is not None or all(c.end_s is not None for c in self.choices)

    @property
    def status(self) -> int:
        """For the request counter: 200, the error's status, or 499 (nginx's "client closed request")."""
        return self.error.status if self.error is not None else 200 if self.done else CLIENT_CLOSED


def usage_dict(prompt_lens: list[int], choices: list[ChoiceState]) -> dict:
    """OpenAI usage (prompts counted once each, completions summed over choices) plus the draft counts."""
    completion = sum(c.usage.completion_tokens if c.usage else c.tokens for c in choices)
    versions: list[str] = []
    for c in choices:
        for v in (c.usage.drafter_version or "").split(",") if c.usage else ():
            if v and v not in versions:
                versions.append(v)
    return {
        "prompt_tokens": sum(prompt_lens),
        "completion_tokens": completion,
        "total_tokens": sum(prompt_lens) + completion,
        "drafted_tokens": sum(c.usage.drafted_tokens for c in choices if c.usage),
        "accepted_tokens": sum(c.usage.accepted_tokens for c in choices if c.usage),
        "drafter_version": ",".join(versions) or None,
    }


# ------------------------------------------------------------------------------------------ responses


def full_response(plan: Plan, model: str, progress: Progress) -> dict:
    """A non-streamed chat.completion / text_completion."""
    choices = []
    for i, c in enumerate(progress.choices):
        text = "".join(c.texts)
        body = {"message": {"role": "assistant", "content": text}} if plan.chat else {"text": text}
        choices.append({"index": i, **body, "logprobs": None, "finish_reason": c.finish_reason})
    return {"id": plan.id, "object": "chat.completion" if plan.chat else "text_completion", "created": plan.created,
            "model": model, "choices": choices, "usage": usage_dict(plan.prompt_lens, progress.choices)}


def stream_chunk(plan: Plan, model: str, index: int, text: str | None = None, role: bool = False,
                 finish_reason: str | None = None) -> dict:
    """One streamed chunk of choice `index`: the role opening (chat), a text delta, or the finish."""
    if plan.chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    out = {"id": plan.id, "object": "chat.completion.chunk" if plan.chat else "text_completion",
           "created": plan.created, "model": model, "choices": [choice]}
    if plan.include_usage:
        out["usage"] = None
    return out


def usage_chunk(plan: Plan, model: str, progress: Progress) -> dict:
    return {"id": plan.id, "object": "chat.completion.chunk" if plan.chat else "text_completion",
            "created": plan.created, "model": model, "choices": [],
            "usage": usage_dict(plan.prompt_lens, progress.choices)}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


# -------------------------------------------------------------------------------------------- metrics


class NullMetrics:
    """The ApiMetrics interface (services/metrics.py), doing nothing."""

    def request(self, endpoint: str, status: int) -> None: ...
    def ttft(self, seconds: float) -> None: ...
    def tpot(self, seconds: float) -> None: ...
    def e2e(self, seconds: float) -> None: ...
    def generated(self, tokens: int) -> None: ...


def record(metrics, endpoint: str, status: int, progress: Progress) -> None:
    """The request's status; TTFT (arrival → first token) and TPOT ((e2e − ttft) / (tokens − 1)) per
    choice; e2e per answered request."""
    metrics.request(endpoint, status)
    now = time.perf_counter()
    for c in progress.choices:
        if c.first_token_s is not None:
            ttft = c.first_token_s - progress.arrival_s
            metrics.ttft(ttft)
            if c.tokens > 1 and c.end_s is not None:
                metrics.tpot((c.end_s - progress.arrival_s - ttft) / (c.tokens - 1))
        metrics.generated(c.tokens)
    if status == 200:
        metrics.e2e(now - progress.arrival_s)


# --------------------------------------------------------------------------------------------- serving


async def open_choices(fanout: Fanout, progress: Progress) -> list[tuple[int, Chunk]]:
    """Chunks until every choice has sent its first one (or one failed): before any byte is sent, so an
    early error (overloaded, unknown drafter version …) becomes the HTTP status."""
    events, started = [], set()
    while len(started) < len(progress.choices) and progress.error is None:
        index, chunk = await fanout.next()
        progress.observe(index, chunk)
        events.append((index, chunk))
        started.add(index)
    return events


async def stream_events(plan: Plan, model: str, fanout: Fanout, progress: Progress,
                        opened: list[tuple[int, Chunk]]) -> AsyncIterator[bytes]:
    """The SSE body: role openings, text deltas and finishes by arrival, the usage chunk, [DONE]."""
    try:
        if plan.chat:
            for i in range(len(plan.requests)):
                yield sse(stream_chunk(plan, model, i, role=True))
        pending = list(opened)
        while pending or not progress.done:
            if pending:
                index, chunk = pending.pop(0)
            else:
                index, chunk = await fanout.next()
                progress.observe(index, chunk)
            if chunk.error is not None:
                yield sse(ApiError.from_info(chunk.error).body())
                break
            if chunk.text:
                yield sse(stream_chunk(plan, model, index, text=chunk.text))
            if chunk.finish_reason is not None:
                yield sse(stream_chunk(plan, model, index, finish_reason=chunk.finish_reason))
        if plan.include_usage and progress.error is None:
            yield sse(usage_chunk(plan, model, progress))
        yield sse("[DONE]")
    finally:  # also when the client went away (the task is cancelled at a yield)
        fanout.close()


class ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: finished, client gone, or never
    started (a client gone before the first byte: the body generator never runs its `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def create_app(backend: Backend, tokenizer, model_id: str, max_context: int, admin_router: APIRouter | None = None,
               metrics=None, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> FastAPI:
    """The API over `backend`. `tokenizer` is the verifier's (chat template, prompt encoding);
    `metrics` an ApiMetrics (services/metrics.py) or None (no /metrics, nothing recorded)."""
    cfg = ApiConfig(model_id, max_context, default_max_tokens, max_prompt_bytes=prompt_bytes_limit(tokenizer, max_context))
    # parsing and tokenizing run here, one request at a time (a tokenizer is not safe to share between
    # threads), so that a large prompt never holds the event loop and the streams it serves
    planner = ThreadPoolExecutor(1, thread_name_prefix="specloop-planner")
    app = FastAPI(title="specloop", summary="OpenAI-compatible speculative decoding")
    app.state.api = cfg
    meter = metrics if metrics is not None else NullMetrics()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_message(exc))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, cfg.retry_after_s)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:  # logged by the server as well
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))

    async def complete(request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        endpoint = request.url.path
        try:
            raw = await read_body(request, cfg.max_body_bytes)
            plan = await asyncio.get_running_loop().run_in_executor(planner, plan_body, raw, chat, cfg, tokenizer)
            if not await live_workers(backend):
                raise ApiError(503, "no worker is alive; retry later", "overloaded_error", code="no_worker")
        except ApiError as err:
            meter.request(endpoint, err.status)
            return error_response(err, cfg.retry_after_s)
        fanout, progress = Fanout(backend, plan.requests), Progress.start(arrival, len(plan.requests))
        fanout.watch(request)
        try:
            opened = await open_choices(fanout, progress)
            if progress.error is None and not plan.stream:
                while not progress.done:
                    progress.observe(*await fanout.next())
        except ClientGone:
            fanout.close()
            record(meter, endpoint, progress.status, progress)
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            fanout.close()
            raise
        if progress.error is not None or not plan.stream:
            fanout.close()
            record(meter, endpoint, progress.status, progress)
            if progress.error is not None:
                return error_response(ApiError.from_info(progress.error), cfg.retry_after_s)
            return JSONResponse(full_response(plan, cfg.model_id, progress))
        fanout.unwatch()

        def closed() -> None:
            fanout.close()
            record(meter, endpoint, progress.status, progress)

        return ClosingStream(stream_events(plan, cfg.model_id, fanout, progress, opened), closed,
                             media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [await model_card(backend, cfg)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        if model != cfg.model_id:
            raise ApiError(404, f"The model `{model}` does not exist.", "not_found_error", "model", "model_not_found")
        return await model_card(backend, cfg)

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = await live_workers(backend)
        return JSONResponse({"status": "ok" if workers else "unavailable", "workers": workers},
                            status_code=200 if workers else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        try:
            ok = await backend.ready() and await live_workers(backend) > 0
        except Exception:
            log.exception("backend.ready() failed")
            ok = False
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/sd/targets")
    async def sd_targets() -> list:
        targets = await backend.metrics_targets()
        return [{"targets": list(targets), "labels": {"job": SD_JOB}}] if targets else []

    if metrics is not None:
        @app.get("/metrics")
        async def prometheus() -> Response:
            body, content_type = metrics.render()
            return Response(body, media_type=content_type)

    if admin_router is not None:
        app.include_router(admin_router)
    return app


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
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise too_deep from None
    if json_depth(value, max_depth) > max_depth:
        raise too_deep
    return value


def plan_body(raw: bytes, chat: bool, cfg: ApiConfig, tokenizer) -> Plan:
    """A raw request body parsed and planned: what runs on the planner thread, off the event loop."""
    return plan_request(parse_json(raw), chat, cfg, tokenizer)


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


async def live_workers(backend: Backend) -> int:
    try:
        return len(await backend.workers())
    except Exception:
        log.exception("backend.workers() failed")
        return 0


async def model_card(backend: Backend, cfg: ApiConfig) -> dict:
    try:
        workers = await backend.workers()
    except Exception:
        workers = []
    return {"id": cfg.model_id, "object": "model", "created": int(time.time()), "owned_by": "specloop",
            "max_model_len": cfg.max_context, "drafter_version": workers[0].drafter_version if workers else None,
            "weights": workers[0].weights if workers else None}


def api_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000):
    """A uvicorn server for `app` (warnings only, no access log); `.run()` blocks, `.should_exit` stops it."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))


def run_api(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve `app` until interrupted (`specloop serve` / `specloop api`)."""
    api_server(app, host, port).run()
