"""Shared by the API's tests (test_auth, test_streaming, test_drain, test_serve): a `Scripted` backend
that needs no model (it streams given token ids, one chunk each, with their text from the verifier's
tokenizer and made-up log-probabilities when the request asks for them), an app over it, and a
`Streamer` that reads a streamed completion in a thread."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx

from specloop.drafter.model.loading import load_tokenizer
from specloop.services.api.app import create_app
from specloop.services.protocol import Chunk, CompletionRequest, TokenLogprob, Usage, WorkerInfo

MODEL = "tiny-verifier"
MAX_CONTEXT = 256


def scripted_logprob(token: int, position: int, top: int, vocab: int) -> TokenLogprob:
    """Position i's made-up entry: the token at −(i + 1)/4, then `top` alternatives each 1 lower
    (the token itself first, as when it is the most likely)."""
    lp = -(position + 1) / 4
    return TokenLogprob(token, lp, [((token + j) % vocab, lp - j) for j in range(top)])


def incremental_texts(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, as the worker's detokenizer sends it: held back (empty) while the
    text so far ends inside a character."""
    out, sent = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1])
        if text.endswith("\ufffd") and i < len(ids) - 1:
            out.append("")
            continue
        out.append(text[len(sent):])
        sent = text
    return out


@dataclass
class Scripted:
    """A Backend without a model: every request streams `tokens` (cut to its max_tokens), one chunk
    per token, `delay_s` apart. `requests` records what it was asked; `open_streams` counts streams."""

    tokenizer: object
    tokens: list[int]
    delay_s: float = 0.0
    verifier: str = ""
    requests: list[CompletionRequest] = field(default_factory=list)
    open_streams: int = 0

    async def stream(self, request: CompletionRequest):
        self.requests.append(request)
        self.open_streams += 1
        try:
            ids = self.tokens[: request.max_tokens]
            for i, (t, text) in enumerate(zip(ids, incremental_texts(self.tokenizer, ids))):
                await asyncio.sleep(self.delay_s)
                yield self.chunk(request, i, t, text, last=i == len(ids) - 1)
        finally:
            self.open_streams -= 1

    def chunk(self, request: CompletionRequest, i: int, token: int, text: str, last: bool) -> Chunk:
        lps = None
        if request.logprobs is not None:
            lps = [scripted_logprob(token, i, request.logprobs, len(self.tokenizer))]
        usage = Usage(len(request.prompt_ids), i + 1) if last else None
        return Chunk(request.id, [token], text, "length" if last else None, usage, None, lps)

    async def workers(self):
        return [WorkerInfo("scripted", self.verifier, MODEL, "pretrained", "base", MAX_CONTEXT, 4, 16)]

    async def loads(self):
        return []

    async def ready(self):
        return True

    async def buffer_stats(self):
        return None

    async def metrics_targets(self):
        return []

    async def close(self):
        pass


def scripted(verifier_dir, text: str = "Sure, here is an example", delay_s: float = 0.0) -> Scripted:
    """A Scripted backend that streams the tokens of `text` (the tiny verifier's tokenizer)."""
    tok = load_tokenizer(verifier_dir)
    return Scripted(tok, tok.encode(text, add_special_tokens=False), delay_s, str(verifier_dir))


def scripted_app(backend: Scripted, **kwargs):
    return create_app(backend, backend.tokenizer, MODEL, MAX_CONTEXT, **kwargs)


class Streamer(threading.Thread):
    """A streamed completion read in a thread: its `data:` payloads, in order."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.events, self.status, self.cut = url, [], None, False

    def run(self) -> None:
        try:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 64, "stream": True}
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=30) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except httpx.RemoteProtocolError:  # the server went away mid-stream
            self.cut = True

    def wait_for(self, n: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < n:
            assert time.monotonic() < deadline, f"only {len(self.events)} events"
            time.sleep(0.01)
