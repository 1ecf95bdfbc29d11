"""Answering a planned request: the backend streams of its choices merged (`Fanout`), what each
choice has produced (`Progress`), and the OpenAI response shapes built from them: a full
chat.completion / text_completion, or server-sent events (`data: {json}` … `data: [DONE]`).

An error before any byte is sent becomes the HTTP status (`open_choices` waits for every choice's
first chunk); an error after a stream began is sent in-band (`data: {"error": …}`) and the stream
ends with `data: [DONE]`. A client that goes away stops its backend streams, so the worker frees
the slots.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from specloop.services.api.backend import Backend
from specloop.services.api.logprobs import TokenTexts, chat_logprobs, completion_logprobs, echo_logprobs
from specloop.services.api.planning import Plan
from specloop.services.api.schemas import ApiError
from specloop.services.api.tools import ToolStream, parse_tool_calls
from specloop.services.protocol import Chunk, CompletionRequest, ErrorInfo, TokenLogprob, Usage

log = logging.getLogger("specloop.api")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering (nginx)
CLIENT_CLOSED = 499  # status counted for a request whose client went away (nginx's code)


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

    def abort(self, chunk: Chunk) -> None:
        """End the request with `chunk` (an error) as if its first choice had sent it."""
        self.queue.put_nowait((0, chunk))

    def close(self) -> None:
        self.unwatch()
        for task in self.tasks:
            task.cancel()


# -------------------------------------------------------------------------------------------- progress


@dataclass
class ChoiceState:
    """What one choice has produced so far, and when."""

    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between successive chunks that carried tokens
    end_s: float | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the worker sent them
    text_offset: int = 0  # completions' log-probabilities: characters of token strings streamed so far
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens scored (completions' echo with logprobs)
    echoed: bool = False  # a streamed echo: the prompt has been sent


@dataclass
class Progress:
    """All choices of one request: updated per chunk, summarised into usage and metrics."""

    arrival_s: float
    sent_s: float  # when its requests were handed to the backend
    choices: list[ChoiceState]
    error: ErrorInfo | None = None
    error_index: int | None = None  # the choice whose chunk carried the error

    @classmethod
    def start(cls, arrival_s: float, n: int) -> "Progress":
        """The progress of n choices whose requests go to the backend now."""
        return cls(arrival_s, time.perf_counter(), [ChoiceState() for _ in range(n)])

    def observe(self, index: int, chunk: Chunk) -> None:
        c, now = self.choices[index], time.perf_counter()
        if chunk.token_ids:
            if c.first_token_s is None:
                c.first_token_s = now
            else:
                assert c.last_token_s is not None  # set along with first_token_s
                c.gaps_s.append(now - c.last_token_s)
            c.last_token_s = now
        c.tokens += len(chunk.token_ids)
        c.texts.append(chunk.text)
        c.logprobs.extend(chunk.logprobs or ())
        if chunk.prompt_logprobs is not None:
            c.prompt_logprobs = chunk.prompt_logprobs
        if chunk.error is not None and self.error is None:
            self.error, self.error_index = chunk.error, index
        if chunk.last:
            c.finish_reason, c.usage, c.end_s = chunk.finish_reason, chunk.usage, now

    @property
    def done(self) -> bool:
        return self.error is not None or all(c.end_s is not None for c in self.choices)

    @property
    def status(self) -> int:
        """For the request counter: 200, the error's status, or 499 (nginx's "client closed request")."""
        return self.error.status if self.error is not None else 200 if self.done else CLIENT_CLOSED

    def finish_reasons(self) -> list[str]:
        """Every choice's end for the metrics: its finish_reason, "error" for the one that failed,
        "abort" for one cut short (its client went away, or a sibling choice failed)."""
        return [c.finish_reason or ("error" if i == self.error_index else "abort") for i, c in enumerate(self.choices)]


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


@dataclass
class Shapes:
    """The OpenAI response shapes of one planned request: a full answer, streamed chunks, the usage
    chunk; `texts` gives the token strings of its log-probabilities (when it asked for them). With
    tools in play (`plan.tools`), an answer's tool calls are parsed out of its text (services/api/tools.py):
    a full answer's message gets `tool_calls`; a stream holds its text back from a `<tool_call>`
    opening on and sends the calls as `tool_calls` deltas before the finish. Either way the finish
    reason is then `tool_calls`."""

    plan: Plan
    model: str
    texts: TokenTexts | None = None
    held: dict[int, ToolStream] = field(default_factory=dict)  # streamed choices' text held back for tool calls

    @property
    def object(self) -> str:
        if self.plan.chat:
            return "chat.completion.chunk" if self.plan.stream else "chat.completion"
        return "text_completion"

    def head(self) -> dict:
        return {"id": self.plan.id, "object": self.object, "created": self.plan.created, "model": self.model}

    def full(self, progress: Progress) -> dict:
        """A non-streamed chat.completion / text_completion."""
        choices = []
        for i, c in enumerate(progress.choices):
            text, finish_reason = "".join(c.texts), c.finish_reason
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.plan.tools is not None:
                content, calls = parse_tool_calls(text, self.plan.tools.names, self.plan.tools.parallel)
                if calls:
                    message |= {"content": content, "tool_calls": calls}
                    finish_reason = "tool_calls"
            echo = self.plan.echo(i)
            if echo is None:
                logprobs = self.logprobs(c.logprobs)
            else:  # the prompt before the completion, in the text and (asked for) in the log-probabilities
                text = echo.text + text
                logprobs = self.echo_logprobs(i, c, progress)
                if logprobs is not None:  # then the completion's, their offsets going on from the prompt's end
                    rest = self.logprobs(c.logprobs, c)
                    assert rest is not None  # asked for: echo_logprobs said so
                    logprobs = {key: logprobs[key] + rest[key] for key in logprobs}
            body = {"message": message} if self.plan.chat else {"text": text}
            choices.append({"index": i, **body, "logprobs": logprobs, "finish_reason": finish_reason})
        return self.head() | {"choices": choices, "usage": usage_dict(self.plan.prompt_lens, progress.choices)}

    def chunk(self, index: int, text: str | None = None, role: bool = False, finish_reason: str | None = None,
              logprobs: dict | None = None, tool_call: dict | None = None) -> dict:
        """One streamed chunk of choice `index`: the role opening (chat), a text delta (with its tokens'
        log-probabilities), a tool call (chat: `tool_call` is its entry of `tool_calls`, with its
        `index`), or the finish."""
        if self.plan.chat:
            delta: dict[str, Any] = ({"role": "assistant", "content": ""} if role else
                                     {"content": text} if text is not None else {})
            if tool_call is not None:
                delta = {"tool_calls": [tool_call]}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        out = self.head() | {"choices": [choice]}
        if self.plan.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, progress: Progress) -> dict:
        return self.head() | {"choices": [], "usage": usage_dict(self.plan.prompt_lens, progress.choices)}

    def logprobs(self, entries: list[TokenLogprob] | None, choice: ChoiceState | None = None) -> dict | None:
        """`choices[i].logprobs` for these entries (None when the request asked for none). Given the
        streamed `choice`, completions' text offsets go on from where its last chunk left them."""
        if self.plan.logprobs is None or self.texts is None:
            return None
        if self.plan.chat:
            return chat_logprobs(entries or [], self.texts, self.plan.logprobs)
        out, end = completion_logprobs(entries or [], self.texts, self.plan.logprobs,
                                       choice.text_offset if choice else 0)
        if choice is not None:
            choice.text_offset = end
        return out

    def echo_logprobs(self, index: int, choice: ChoiceState, progress: Progress) -> dict | None:
        """The echoed prompt's part of choice `index`'s log-probabilities (None when none were asked), from the
        scores its prompt's first choice received; the choice's text offsets go on from its end."""
        echo = self.plan.echo(index)
        if echo is None or self.plan.logprobs is None or self.texts is None:
            return None
        scores = progress.choices[self.plan.scorer(index)].prompt_logprobs
        out, choice.text_offset = echo_logprobs(echo.ids, scores, self.texts, self.plan.logprobs)
        return out

    def deltas(self, index: int, chunk: Chunk, progress: Progress) -> list[dict]:
        """The streamed chunks one backend chunk of choice `index` becomes: an echoed prompt first (completions'
        `echo`: the choice's first chunk), its text (or, with log-probabilities asked, its tokens even when their
        text is held back), then its finish."""
        out, choice = [], progress.choices[index]
        echo = self.plan.echo(index)
        if echo is not None and not choice.echoed:
            choice.echoed = True
            out.append(self.chunk(index, text=echo.text, logprobs=self.echo_logprobs(index, choice, progress)))
        text, finish_reason = chunk.text, chunk.finish_reason
        hold = None
        if self.plan.tools is not None:
            hold = self.held.setdefault(index, ToolStream())
            text = hold.feed(text)
        if text or (self.plan.logprobs is not None and chunk.token_ids):
            out.append(self.chunk(index, text=text, logprobs=self.logprobs(chunk.logprobs, choice)))
        if finish_reason is not None and hold is not None:
            assert self.plan.tools is not None  # a hold is made only with tools in play
            rest, calls = hold.finish(self.plan.tools.names, self.plan.tools.parallel)
            if rest:
                out.append(self.chunk(index, text=rest))
            out += [self.chunk(index, tool_call={"index": j} | call) for j, call in enumerate(calls)]
            finish_reason = "tool_calls" if calls else finish_reason
        if finish_reason is not None:
            out.append(self.chunk(index, finish_reason=finish_reason))
        return out


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


# ---------------------------------------------------------------------------------------- answering


async def open_choices(fanout: Fanout, progress: Progress) -> list[tuple[int, Chunk]]:
    """Chunks until every choice has sent its first one (or one failed): before any byte is sent, so an
    early error (overloaded, unknown drafter version …) becomes the HTTP status."""
    events: list[tuple[int, Chunk]] = []
    started: set[int] = set()
    while len(started) < len(progress.choices) and progress.error is None:
        index, chunk = await fanout.next()
        progress.observe(index, chunk)
        events.append((index, chunk))
        started.add(index)
    return events


async def collect(fanout: Fanout, progress: Progress) -> None:
    """Every remaining chunk (a non-streamed answer)."""
    while not progress.done:
        progress.observe(*await fanout.next())


async def stream_events(shapes: Shapes, fanout: Fanout, progress: Progress,
                        opened: list[tuple[int, Chunk]]) -> AsyncIterator[bytes]:
    """The SSE body: role openings, text deltas and finishes by arrival, the usage chunk, [DONE]."""
    if shapes.plan.chat:
        for i in range(len(shapes.plan.requests)):
            yield sse(shapes.chunk(i, role=True))
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
        for delta in shapes.deltas(index, chunk, progress):
            yield sse(delta)
    if shapes.plan.include_usage and progress.error is None:
        yield sse(shapes.usage_chunk(progress))
    yield sse("[DONE]")


class ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: finished, client gone, or never
    started (a client gone before the first byte: the body generator never runs at all)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
