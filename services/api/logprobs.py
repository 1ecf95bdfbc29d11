"""Log-probabilities in OpenAI's two response shapes, from the worker's `TokenLogprob`s
(services/protocol.py: each emitted token's log-probability under the verifier's raw distribution,
with its most likely alternatives).

    chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    completions:  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
                   "text_offset": [...]}

A token's string is the token decoded alone (special tokens kept); its `bytes` are that string's
UTF-8 bytes, except for a token that is part of a character (it decodes alone to U+FFFD): then the
raw bytes it stands for, so that a client can join the bytes of consecutive tokens into the text.
`text_offset` counts characters of the choice's token strings from the completion's start.
"""
from __future__ import annotations

import copy
import math
import re
from typing import Iterable

from specloop.services.protocol import TokenLogprob

FLOOR = -9999.0  # what a log-probability of −inf (or NaN) is sent as: JSON has no infinity
REPLACEMENT = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF = _byte_level_alphabet()
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte tokens


def raw_bytes(piece: str) -> bytes | None:
    """The bytes a vocabulary piece stands for, when it is a byte-level or byte-fallback piece."""
    m = BYTE_FALLBACK.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    if piece and all(ch in BYTE_OF for ch in piece):
        return bytes(BYTE_OF[ch] for ch in piece)
    return None


class TokenTexts:
    """Each token's string and bytes, decoded once and cached. It decodes with a copy of the
    tokenizer of its own: it runs on the event loop, while the planner thread uses the original."""

    def __init__(self, tokenizer) -> None:
        try:
            self.tokenizer = copy.deepcopy(tokenizer)
        except Exception:  # a tokenizer that cannot be copied: decoding alone shares no state
            self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            hit = self.cache[token_id] = self._decode(token_id)
        return hit

    def _decode(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw = None
        if REPLACEMENT in text:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            raw = raw_bytes(piece) if isinstance(piece, str) else None
        return text, list(raw if raw is not None else text.encode("utf-8"))

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def finite(logprob: float) -> float:
    return FLOOR if math.isnan(logprob) or logprob < FLOOR else float(logprob)


def chat_logprobs(entries: Iterable[TokenLogprob], texts: TokenTexts, top: int) -> dict:
    """`choices[i].logprobs` of a chat completion (or of one streamed chunk)."""
    return {"content": [chat_entry(e.token_id, e.logprob, texts) | {
        "top_logprobs": [chat_entry(t, lp, texts) for t, lp in e.top[:top]]} for e in entries]}


def chat_entry(token_id: int, logprob: float, texts: TokenTexts) -> dict:
    text, raw = texts.get(token_id)
    return {"token": text, "logprob": finite(logprob), "bytes": raw}


def completion_logprobs(entries: Iterable[TokenLogprob], texts: TokenTexts, top: int,
                        offset: int = 0) -> tuple[dict, int]:
    """`choices[i].logprobs` of a text completion (or of one streamed chunk, whose offsets start at
    `offset`), and the offset after its tokens. Each top_logprobs dict holds the `top` most likely
    tokens and the emitted one (so up to top + 1, as OpenAI's)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = texts.text(e.token_id)
        alternatives: dict[str, float] = {}
        for t, lp in e.top[:top]:
            alternatives.setdefault(texts.text(t), finite(lp))
        alternatives.setdefault(text, finite(e.logprob))
        out["tokens"].append(text)
        out["token_logprobs"].append(finite(e.logprob))
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def echo_logprobs(ids: Iterable[int], entries: list[TokenLogprob] | None, texts: TokenTexts,
                  top: int) -> tuple[dict, int]:
    """`choices[i].logprobs` of an echoed prompt (completions' `echo`): every prompt token, the first with a null
    log-probability and null alternatives (nothing before it), the others scored by the worker (`entries`, one per
    token after the first), offsets from the prompt's start; and the offset after its tokens."""
    first = texts.text(next(iter(ids)))
    head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    rest, offset = completion_logprobs(entries or [], texts, top, len(first))
    return {key: head[key] + rest[key] for key in head}, offset
