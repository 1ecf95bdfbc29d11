"""services/api/logprobs.py: token strings and bytes, and OpenAI's chat and completions log-prob shapes."""
from __future__ import annotations

import json

import pytest

from specloop.drafter.model.loading import load_tokenizer
from specloop.services.api.logprobs import FLOOR, TokenTexts, chat_logprobs, completion_logprobs, raw_bytes
from specloop.services.protocol import TokenLogprob


@pytest.fixture(scope="module")
def texts(tiny_pair):
    return TokenTexts(load_tokenizer(tiny_pair[0]))


def test_a_token_string_is_the_token_decoded_alone_with_special_tokens_kept(texts):
    tok = texts.tokenizer
    for t in tok.encode("def main():\n    return 0", add_special_tokens=False):
        assert texts.get(t) == (tok.decode([t]), list(tok.decode([t]).encode()))
    assert texts.text(tok.eos_token_id) == tok.eos_token


def test_the_bytes_of_a_part_of_a_character_are_the_raw_bytes_it_stands_for(texts):
    ids = texts.tokenizer.encode("日本語", add_special_tokens=False)
    assert any(texts.text(t) == "\ufffd" for t in ids)  # the tiny vocabulary splits these characters
    assert bytes(b for t in ids for b in texts.get(t)[1]) == "日本語".encode()


def test_raw_bytes_reads_byte_level_and_byte_fallback_pieces():
    assert raw_bytes("<0xE6>") == b"\xe6" and raw_bytes("Ġthe") == b" the" and raw_bytes("æĹ") == b"\xe6\x97"
    assert raw_bytes("▁the") is None and raw_bytes("") is None


def test_chat_logprobs_hold_each_token_with_its_top_alternatives(texts):
    a, b = texts.tokenizer.encode("def main", add_special_tokens=False)[:2]
    entries = [TokenLogprob(a, -0.25, [(a, -0.25), (b, -1.5), (7, -3.0)]), TokenLogprob(b, float("-inf"), [])]
    out = chat_logprobs(entries, texts, top=2)
    first, second = out["content"]
    assert first == {"token": texts.text(a), "logprob": -0.25, "bytes": texts.get(a)[1],
                     "top_logprobs": [{"token": texts.text(a), "logprob": -0.25, "bytes": texts.get(a)[1]},
                                      {"token": texts.text(b), "logprob": -1.5, "bytes": texts.get(b)[1]}]}
    assert second["logprob"] == FLOOR and second["top_logprobs"] == []
    json.dumps(out, allow_nan=False)  # valid JSON: no infinities


def test_completion_logprobs_add_the_emitted_token_and_count_text_offsets(texts):
    a, b = texts.tokenizer.encode("def main", add_special_tokens=False)[:2]
    entries = [TokenLogprob(a, -2.0, [(b, -0.5)]), TokenLogprob(b, -0.1, [(b, -0.1), (a, -4.0)])]
    out, end = completion_logprobs(entries, texts, top=1, offset=10)
    assert out["tokens"] == [texts.text(a), texts.text(b)] and out["token_logprobs"] == [-2.0, -0.1]
    assert out["top_logprobs"] == [{texts.text(b): -0.5, texts.text(a): -2.0}, {texts.text(b): -0.1}]
    assert out["text_offset"] == [10, 10 + len(texts.text(a))] and end == out["text_offset"][1] + len(texts.text(b))
    empty, same = completion_logprobs([], texts, top=3, offset=4)
    assert empty == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} and same == 4


def test_an_echoed_prompt_leads_with_a_null_first_token_and_counts_offsets_from_its_start(texts):
    from specloop.services.api.logprobs import echo_logprobs

    a, b, c = texts.tokenizer.encode("def main(", add_special_tokens=False)[:3]
    out, end = echo_logprobs([a, b, c], [TokenLogprob(b, -1.0, [(a, -0.5)]), TokenLogprob(c, -2.0, [])], texts, top=1)
    assert out["tokens"] == [texts.text(a), texts.text(b), texts.text(c)]
    assert out["token_logprobs"] == [None, -1.0, -2.0]
    assert out["top_logprobs"] == [None, {texts.text(a): -0.5, texts.text(b): -1.0}, {texts.text(c): -2.0}]
    assert out["text_offset"] == [0, len(texts.text(a)), len(texts.text(a)) + len(texts.text(b))]
    assert end == sum(len(texts.text(t)) for t in (a, b, c))
