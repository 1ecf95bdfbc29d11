"""Incremental detokenization (services/worker/detokenize.py): the text streamed is a full decode of the
tokens (cut at the first stop string to complete) for random token sequences and chunkings of real
tokenizers (the reference verifier's byte-level BPE, the tests' tiny one, a Llama-style byte-fallback
one), with both decoders (the tokenizers library's DecodeStream, the window over a decode callable);
no partial character or stop string is ever released; and the work per push is bounded."""
from __future__ import annotations

import random
import zlib

import pytest
from tokenizers import Tokenizer, decoders, models

from specloop.services.worker import detokenize
from specloop.services.worker.detokenize import MAX_PENDING, IncrementalText, StreamDecoder, WindowDecoder
from tests.conftest import SHARED_MODELS
from tests.tiny import CountingDecode, make_tokenizer


class FullRedecode:
    """The detokenizer serving used before IncrementalText, kept as a reference: it decodes every
    token again at every push (quadratic) and cuts at the earliest-starting stop string."""

    def __init__(self, decode, stop=()):
        self.decode, self.stop, self.tokens, self.sent = decode, tuple(stop), [], 0

    def push(self, new: list[int], final: bool) -> str:
        self.tokens.extend(new)
        text = self.decode(self.tokens)
        if final:
            text = cut_at_stop(text, self.stop)
        else:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence waits for its next bytes
            if self.stop:
                text = text[: max(self.sent, len(text) - (max(map(len, self.stop)) - 1))]
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text

MULTILINGUAL = ("Héllo wörld 😀👍🏽 — 世界你好, café déjà vu. Ünïcödé 🇫🇷 naïve 한국어 テスト "
                "def f(x):\n    return x ** 2  # ∑ ≤ ∞\n")


# ---------------------------------------------------------------- tokenizers


class Tok:
    """A tokenizer under test: its `decode(ids)` as serving calls it, what IncrementalText's
    `tokenizer` argument gets, its vocabulary size and an encoder."""

    def __init__(self, name: str, tokenizer, decode, encode, vocab: int):
        self.name, self.tokenizer, self.decode, self.encode, self.vocab = name, tokenizer, decode, encode, vocab

    def __repr__(self):
        return self.name


def hf(name: str, tokenizer) -> Tok:
    return Tok(name, tokenizer, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
               lambda text: tokenizer.encode(text, add_special_tokens=False), len(tokenizer))


def llama_style() -> Tok:
    """A raw `tokenizers.Tokenizer` as Llama's: Metaspace pieces, byte fallback, the leading space
    stripped, special tokens <s> and </s>."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("▁", "▁the", "▁hello", "▁world", "▁caf", "é", "s", "t", "o", "p", "▁S", "TOP", ".", "▁世界"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])

    def encode(text: str) -> list[int]:  # "▁word" when a piece, else "▁" and a byte-fallback token per byte
        ids = []
        for word in text.split(" "):
            ids += [vocab["▁" + word]] if "▁" + word in vocab else \
                [vocab["▁"]] + [vocab[f"<0x{b:02X}>"] for b in word.encode()]
        return ids
    return Tok("llama-style", tok, lambda ids: tok.decode(ids, skip_special_tokens=True), encode, len(vocab))


def random_ids(tok: Tok, rng: random.Random, n: int) -> list[int]:
    """n random tokens; for the byte-fallback tokenizer, random pieces, special tokens and the byte
    tokens of random characters (valid UTF-8, as models generate: see services/worker/detokenize.py)."""
    if tok.name != "llama-style":
        return [rng.randrange(tok.vocab) for _ in range(n)]
    ids = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.4:
            ids.append(rng.randrange(3 + 256, tok.vocab))  # a piece
        elif kind < 0.5:
            ids.append(rng.choice([1, 2]))  # <s>, </s>
        else:
            char = chr(rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0xC0, 0x250), rng.randrange(0x4E00, 0x9FFF),
                                   rng.randrange(0x1F600, 0x1F650)]))
            ids += [3 + b for b in char.encode()]
    return ids


@pytest.fixture(scope="module")
def reference() -> Tok:
    path = SHARED_MODELS / "verifier"
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"the reference verifier is not at {path}")
    from specloop.drafter.model.loading import load_tokenizer

    return hf("reference", load_tokenizer(path))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tok:
    return hf("tiny", make_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module", params=["reference", "tiny", "llama-style"])
def tok(request) -> Tok:
    return llama_style() if request.param == "llama-style" else request.getfixturevalue(request.param)


BACKENDS = ["stream", "window"]


def stream(tok: Tok, backend: str, stop: tuple[str, ...] = ()) -> IncrementalText:
    text = IncrementalText(tok.decode, stop, tokenizer=tok.tokenizer if backend == "stream" else None)
    assert isinstance(text.decoder, StreamDecoder if backend == "stream" else WindowDecoder)
    return text


def chunks(ids: list[int], rng: random.Random, most: int = 5) -> list[list[int]]:
    """ids cut into chunks of 1..most tokens (a speculative block commits several at once)."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, most)
        out.append(ids[i:i + n])
        i += n
    return out


def streamed(text: IncrementalText, parts: list[list[int]]) -> list[str]:
    """What each push releases, the last one final."""
    return [text.push(p, i == len(parts) - 1) for i, p in enumerate(parts)]


def first_completed_stop(text: str, stop: tuple[str, ...]) -> str:
    """The reference: `text` cut where the first stop string to complete starts (the longest of those
    completing at the same character)."""
    for end in range(len(text) + 1):
        starts = [end - len(s) for s in stop if s and text[:end].endswith(s)]
        if starts:
            return text[:min(starts)]
    return text


# ---------------------------------------------------------------- equal to a full decode


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_token_sequences_stream_exactly_the_full_decode(tok, backend):
    rng = random.Random(zlib.crc32(f"{tok.name} {backend}".encode()))
    for _ in range(150):
        ids = random_ids(tok, rng, rng.randint(1, 40))
        parts = chunks(ids, rng)
        assert "".join(streamed(stream(tok, backend), parts)) == tok.decode(ids), parts


@pytest.mark.parametrize("backend", BACKENDS)
def test_multilingual_text_split_token_by_token_streams_whole_characters_only(tok, backend):
    ids = tok.encode(MULTILINGUAL * 2)
    expected = tok.decode(ids)
    assert "😀" in expected and "世界" in expected
    out = streamed(stream(tok, backend), [[i] for i in ids])
    assert "".join(out) == expected
    assert not any("\ufffd" in piece for piece in out)
    assert out.count("") >= 3, "no character was split across tokens: the test would not test holding back"


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_incomplete_character_at_the_end_is_released_by_the_final_push(tok, backend):
    ids = tok.encode("ok 😀")
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    text = stream(tok, backend)
    held = [text.push([i], False) for i in ids[:cut]]
    assert "\ufffd" not in "".join(held)
    assert "".join(held) + text.push([], True) == tok.decode(ids[:cut])


@pytest.mark.parametrize("backend", BACKENDS)
def test_special_tokens_are_skipped_as_a_full_decode_skips_them(tok, backend):
    rng = random.Random(7)
    specials = [i for i in range(tok.vocab) if tok.decode([i]) == "" and tok.decode([i, i]) == ""][:3]
    assert specials
    words = [tok.encode(w) for w in ("the", "hello", "world", "café", "世界", "😀")]
    for _ in range(40):
        ids = [t for _ in range(12) for t in ([rng.choice(specials)] if rng.random() < 0.3 else rng.choice(words))]
        assert "".join(streamed(stream(tok, backend), chunks(ids, rng))) == tok.decode(ids)


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_strings_spanning_chunks_are_cut_and_never_partly_released(tok, backend):
    ids = tok.encode("hello world STOP the café")
    full = tok.decode(ids)
    text = stream(tok, backend, ("STOP", "never"))
    released = ""
    for i, token in enumerate(ids):
        released += text.push([token], i == len(ids) - 1)
        assert "S" not in released and len(released) <= max(0, len(tok.decode(ids[:i + 1])) - len("never") + 1)
    assert released == full[:full.index("STOP")]
    assert text.push(tok.encode(" more"), True) == ""  # nothing after a stop


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_texts_with_stop_strings_stream_the_text_before_the_first_completed_stop(tok, backend):
    rng = random.Random(11)
    stops = [("é", "wor"), ("😀",), ("o w", "world", "ld S"), ("the", "e c", "he"), ("STOP", "P t")]
    words = ["hello", "world", "STOP", "the", "café", "😀", "世界", "o", "p", "s", "t"]
    for _ in range(120):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))))
        stop = rng.choice(stops)
        out = "".join(streamed(stream(tok, backend, stop), chunks(ids, rng)))
        assert out == first_completed_stop(tok.decode(ids), stop), (stop, tok.decode(ids))


def test_a_generation_ending_on_its_stop_string_streams_what_textstream_streams(reference):
    """What the engine produces (tokens up to the one completing a stop) gives TextStream's text."""
    rng = random.Random(3)
    ids = reference.encode(MULTILINGUAL)
    ends = [n for n in range(1, len(ids) + 1) if not reference.decode(ids[:n]).endswith("\ufffd")]
    for _ in range(60):
        end = rng.choice(ends)  # the token completing the stop string ends the generation
        tail = reference.decode(ids[:end])[-4:]
        stop = (tail[-rng.randint(1, len(tail)):], "zzz")
        parts = chunks(ids[:end], rng)
        new = "".join(streamed(IncrementalText(reference.decode, stop, tokenizer=reference.tokenizer), parts))
        full = reference.decode(ids[:end])
        assert new == cut_at_stop(full, stop)
        if full.index(stop[0]) == len(full) - len(stop[0]):  # TextStream, blind to stops before the end, agrees
            assert new == "".join(streamed(FullRedecode(reference.decode, stop), parts))


def test_a_stop_string_completed_by_a_push_that_goes_on_is_cut_there(reference):
    """The engine ends a request on the token completing a stop string; should more follow in the
    same push (or the next), nothing from the stop string on is released."""
    ids = reference.encode("one 世界你好 two")
    text = IncrementalText(reference.decode, ("世界你",), tokenizer=reference.tokenizer)
    out = [text.push(ids[:-2], False), text.push(ids[-2:], False), text.push(ids[:3], True)]
    assert "".join(out) == "one "


# ---------------------------------------------------------------- bounded work


def test_the_window_decoder_decodes_a_bounded_number_of_tokens_per_push(reference):
    ids = reference.encode(MULTILINGUAL * 30)
    assert len(ids) > 2000
    counting = CountingDecode(reference.decode)
    text = IncrementalText(counting, ("STOP!",))
    worst, before = 0, 0
    for i, token in enumerate(ids):
        text.push([token], i == len(ids) - 1)
        worst, before = max(worst, counting.tokens - before), counting.tokens
    bound = 2 * (1 + 4)  # the last chunk released and the pending tokens (a character is at most 4 bytes), twice
    assert worst <= bound
    assert counting.tokens <= bound * len(ids)
    old = CountingDecode(reference.decode)  # the quadratic TextStream fails the same bound
    streamed(FullRedecode(old, ("STOP!",)), [[i] for i in ids])
    assert old.tokens > bound * len(ids)


def test_the_stop_search_scans_the_new_text_and_the_longest_stop_less_one(reference):
    ids = reference.encode(MULTILINGUAL * 10)
    stop = ("never appears", "nor this")
    text = IncrementalText(reference.decode, stop, tokenizer=reference.tokenizer)
    for token in ids:
        before_scan, before_sent, before_held = text.scanned_chars, text.sent, len(text.held)
        text.push([token], False)
        new_chars = text.sent - before_sent + len(text.held) - before_held
        assert text.scanned_chars - before_scan <= len("never appears") - 1 + new_chars
        assert len(text.held) <= len("never appears") - 1


def test_the_stream_decoder_steps_once_per_push_and_keeps_few_tokens(reference):
    ids = reference.encode(MULTILINGUAL * 10)
    text = IncrementalText(reference.decode, (), tokenizer=reference.tokenizer)
    for token in ids:
        text.push([token], False)
        assert len(text.decoder.window.pending) <= 4 and len(text.decoder.window.context) <= 4
    assert text.decoder.step_calls == len(ids)
    assert text.decoder.window.decode_calls == 0  # the Rust stream did all the decoding


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_run_of_invalid_bytes_is_released_once_more_than_max_pending_tokens_hold_it(reference, backend):
    lone = [i for i in range(reference.vocab) if reference.decode([i]) == "\ufffd"
            and reference.decode([i, i]) == "\ufffd\ufffd"][:1]  # a continuation byte alone: invalid
    assert lone
    ids = reference.encode("ok ") + lone * (3 * MAX_PENDING) + reference.encode(" fine")
    text = stream(reference, backend)
    out = []
    for i, token in enumerate(ids):
        out.append(text.push([token], i == len(ids) - 1))
        assert len(text.decoder.pending if backend == "window" else text.decoder.window.pending) <= MAX_PENDING + 1
    assert "".join(out) == reference.decode(ids)
    assert sum(bool(o) for o in out[:len(ids) - 5]) >= 3  # released along the way, not only at the end


# ---------------------------------------------------------------- a drop-in for TextStream


def test_it_is_built_and_pushed_as_serving_builds_and_pushes_textstream(tiny):
    ids = tiny.encode("hello world, the quick brown fox")
    text = IncrementalText(tiny.decode, tuple(["fox"]))  # as the old TextStream(self.decode, tuple(r.stop)) was
    assert isinstance(text.decoder, WindowDecoder)  # no tokenizer given: the window decoder
    out = "".join(text.push(ids[i:i + 2], i + 2 >= len(ids)) for i in range(0, len(ids), 2))
    assert out == "hello world, the quick brown "
    assert text.sent == len(out)
    assert IncrementalText(tiny.decode, ("",)).stop == ()  # an empty stop string is no stop


def test_a_tokenizer_whose_decode_cleans_up_spaces_falls_back_to_the_window(tiny, monkeypatch):
    assert detokenize.rust_backend(tiny.tokenizer) is not None
    monkeypatch.setattr(tiny.tokenizer, "clean_up_tokenization_spaces", True, raising=False)
    assert detokenize.rust_backend(tiny.tokenizer) is None
    monkeypatch.setattr(detokenize, "DecodeStream", None)
    assert isinstance(IncrementalText(tiny.decode, (), tokenizer=llama_style().tokenizer).decoder, WindowDecoder)


# ---------------------------------------------------------------- byte-level guarantees (serving's former tests)


def _utf8(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_never_streams_part_of_a_stop_string():
    stream, sent = IncrementalText(_utf8, stop=("STOP",)), []
    pieces = [b"hello ", b"wor", b"ld S", b"TO", b"P and more"]
    for i, piece in enumerate(pieces):
        sent.append(stream.push(list(piece), final=i == len(pieces) - 1))
    assert "".join(sent) == "hello world "
    assert all("S" not in s for s in sent)


def test_text_stream_holds_back_an_incomplete_utf8_character():
    stream = IncrementalText(_utf8)
    euro = "€".encode()
    sent = [stream.push([ord("a"), euro[0]], final=False), stream.push([euro[1]], final=False)]
    assert all("\ufffd" not in s and "€" not in s for s in sent)  # the character's first bytes are held back
    sent.append(stream.push([euro[2]], final=True))
    assert "".join(sent) == "a€"
