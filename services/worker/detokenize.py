"""Incremental detokenization of one request's tokens, linear in the output's length.

`IncrementalText` is what serving streams each request's text with (`push(new, final) -> str`); it
keeps the guarantees of the full re-decode it replaced (`TextStream`):

- no partial UTF-8: text whose decoding ends with U+FFFD (a character whose bytes are split across
  tokens) is held back until the character completes; the final push releases whatever is left;
- no partial stop string: with stop strings, the last (longest stop - 1) characters are held back
  until the request ends, and nothing from a stop string on is ever released;
- the concatenation of everything released equals a full decode of all the tokens, cut at the
  first stop string to complete (the earliest-ending match; of those ending together, the earliest
  starting one). A generation that ends on its stop string, as the engine's do, gives exactly
  `cut_at_stop(decode(tokens), stop)`.

Unlike TextStream, which decodes every token again at every push (quadratic), each push does work
bounded by the sizes of its own chunk and of the one before, never by the output's length:

- decoding: with a `tokenizer` whose Rust backend has `tokenizers.decoders.DecodeStream`, one
  `DecodeStream.step` per push (it keeps only the ids since its last released chunk); otherwise the
  prefix/read-offset method over the `decode` callable: a window of the tokens of the last chunk
  released (context for the decoder's spacing and byte merging) and those pushed since;
- stop strings: only the tail that can hold a new match is searched: the last (longest stop - 1)
  characters already seen and the new text.

A character whose bytes stay incomplete for more than MAX_PENDING tokens (never, with real
tokenizers: a character is at most 4 bytes) is released as decoded, U+FFFD included, so that the
window stays bounded whatever the tokens.

Exactness needs a decoder whose text for a window is a prefix-extension of its text for a shorter
one. Byte-level BPE (GPT-2 style, the reference model's) always is. A byte-fallback decoder
(Llama/SentencePiece) is for valid UTF-8, what models generate; an invalid byte turns its whole byte
run into U+FFFD in a full decode, characters already streamed included, which no stream can take back
(TextStream could not either).
"""
from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"
MAX_PENDING = 32  # tokens held for an incomplete character before they are released anyway

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - an older tokenizers
    # mypy cannot type an optional import's fallback (python/mypy#1153); callers check for None
    DecodeStream = None  # type: ignore[misc,assignment]


# ----------------------------------------------------------------------------- decoding backends


class WindowDecoder:
    """The prefix/read-offset method over a `decode(ids) -> str` callable: decodes the tokens of the
    last chunk released (`context`) with the pending ones and releases what the pending ones add,
    once it does not end with an incomplete character. Each push decodes the tokens of the last
    chunk released and of its own (and those held for an incomplete character): bounded by the
    chunk sizes, not the output's length. Counts the tokens it decodes (`decoded_tokens`)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.context: list[int] = []  # the tokens of the last chunk released
        self.pending: list[int] = []  # tokens whose text is not released yet
        self.decoded_tokens = 0
        self.decode_calls = 0

    def _decode(self, ids: list[int]) -> str:
        self.decoded_tokens += len(ids)
        self.decode_calls += 1
        return self.decode(ids)

    def _added(self) -> str:
        """The text the pending tokens add after the context's."""
        prefix = self._decode(self.context) if self.context else ""
        text = self._decode(self.context + self.pending)
        return text[len(prefix):]

    def _release(self, added: str) -> None:
        """The pending tokens' text `added` was released: they are the next context. Their text starts
        and ends on whole characters (a byte-fallback decoder turns every byte of a run into U+FFFD
        when the run starts mid-character). Tokens that added nothing (MAX_PENDING special tokens
        skipped) do not become the context: one decoding to "" would lose the decoder's view of the
        text before (a Metaspace decoder would strip the next word's space as the text's first)."""
        if added:
            self.context = self.pending
        self.pending = []

    def step(self, ids: list[int]) -> str:
        """The text released by these new tokens ("" while it ends with an incomplete character)."""
        self.pending.extend(ids)
        if not self.pending:
            return ""
        added = self._added()
        if (not added or added.endswith(REPLACEMENT)) and len(self.pending) <= MAX_PENDING:
            return ""  # an incomplete character, or tokens with no text yet (a Metaspace "▁" at the start)
        self._release(added)
        return added

    def flush(self) -> str:
        """Whatever the pending tokens add, incomplete characters included (the request ended)."""
        if not self.pending:
            return ""
        added = self._added()
        self._release(added)
        return added


class StreamDecoder:
    """`tokenizers.decoders.DecodeStream` over a Rust `tokenizers.Tokenizer`: one `step` per push. It
    holds text that ends with an incomplete character itself; the tokens it holds are tracked here
    (with those of the last chunk released) so that the final push can release them. The request goes
    on with the window method once DecodeStream holds more than MAX_PENDING tokens, or refuses a window
    whose text does not extend its prefix (it raises "Invalid prefix encountered", seen with
    byte-fallback decoders on invalid bytes)."""

    def __init__(self, backend, skip_special_tokens: bool = True):
        self.backend = backend
        self.stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.window = WindowDecoder(lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens))
        self.step_calls = 0

    def step(self, ids: list[int]) -> str:
        if not ids:
            return ""
        w = self.window
        if self.stream is None:  # DecodeStream gave up on this request
            return w.step(ids)
        self.step_calls += 1
        try:
            chunk = self.stream.step(self.backend, list(ids))
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception
            self.stream = None
            return w.step(ids)
        w.pending.extend(ids)
        if chunk is not None:
            w._release(chunk)
            return chunk
        if len(w.pending) > MAX_PENDING:  # the window releases them; it goes on with the request
            self.stream = None
            return w.flush()
        return ""

    def flush(self) -> str:
        return self.window.flush()


def rust_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind `tokenizer` (a transformers fast tokenizer, or one itself),
    or None when DecodeStream cannot reproduce its `decode` (no Rust backend, an old tokenizers, or
    transformers' clean-up of tokenization spaces, which the Rust decoder does not do)."""
    if tokenizer is None or DecodeStream is None:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    for backend in (tokenizer, getattr(tokenizer, "backend_tokenizer", None), getattr(tokenizer, "_tokenizer", None)):
        if backend is not None and type(backend).__module__.startswith("tokenizers") and hasattr(backend, "decode"):
            return backend
    return None


def make_decoder(decode: Callable[[list[int]], str], tokenizer=None, skip_special_tokens: bool = True):
    """A StreamDecoder when the tokenizer allows, else a WindowDecoder over `decode`."""
    backend = rust_backend(tokenizer)
    if backend is not None:
        return StreamDecoder(backend, skip_special_tokens)
    return WindowDecoder(decode)


# ----------------------------------------------------------------------------- stop strings


def first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first stop string to complete in `text` starts: the earliest-ending match, and of
    those ending together the earliest-starting one; None without a match."""
    best = None  # (end, start)
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return None if best is None else best[1]


# ----------------------------------------------------------------------------- the stream


class IncrementalText:
    """One request's text, released as tokens arrive (see the module's docstring). `decode` decodes
    a list of token ids (what TextStream takes); `tokenizer`, when given, lets it use the tokenizers
    library's DecodeStream (`skip_special_tokens` is then its decoding's, as serving's `decode`
    skips them). Empty stop strings are ignored. Counts the stop-string search's work in
    `scanned_chars`."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (), tokenizer=None,
                 skip_special_tokens: bool = True):
        self.decoder = make_decoder(decode, tokenizer, skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self.keep = max(map(len, self.stop), default=1) - 1  # characters that may start a stop string
        self.held = ""  # decoded, not released (at most `keep` characters between pushes)
        self.recent = ""  # the last `keep` characters decoded: where a match ending later may start
        self.sent = 0  # characters released
        self.stopped = False
        self.scanned_chars = 0

    def push(self, new: list[int], final: bool) -> str:
        """The new text that may be streamed now; `final`: the request ended, release the rest."""
        if self.stopped:
            return ""
        piece = self.decoder.step(list(new))
        if final:
            piece += self.decoder.flush()
        out = self._cut(piece, final) if self.stop else piece
        self.sent += len(out)
        return out

    def _cut(self, piece: str, final: bool) -> str:
        """Release `held + piece` but the characters that may start a stop string; cut at a match."""
        scan = self.recent + piece
        self.scanned_chars += len(scan)
        at = first_stop(scan, self.stop)
        text = self.held + piece
        if at is not None:  # the match ends in `piece`, so it starts within held + piece (see `keep`)
            self.stopped, self.held = True, ""
            return text[: len(text) - len(scan) + at]  # scan and text both end with piece
        self.recent = scan[-self.keep:] if self.keep else ""
        if final:
            self.held = ""
            return text
        cut = max(0, len(text) - self.keep)
        self.held = text[cut:]
        return text[:cut]

