"""drafter/decode/requests.py: when a request ends (StopRule), exactly as plain decoding would end it."""
from __future__ import annotations

import random

import pytest

from specloop.drafter.decode.requests import Generation, StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.decode.stats import AcceptanceStats
from tests.tiny import CountingDecode


def _gen() -> Generation:
    return Generation([], None, AcceptanceStats(4))


@pytest.fixture(scope="module")
def tok(reference_pair):
    """The reference pair's tokenizer (skipped, as every reference-pair test, where the checkout lacks it)."""
    from specloop.drafter.model.loading import load_tokenizer

    return load_tokenizer(reference_pair[0])


def test_eos_ends_a_request_unless_it_ignores_eos():
    rule = StopRule(frozenset({4}))
    ended = _gen()
    rule.extend(ended, [7, 4, 9], SamplingParams(max_tokens=8))
    assert ended.token_ids == [7] and ended.finish_reason == "stop"
    ignored = _gen()
    rule.extend(ignored, [7, 4, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    assert ignored.token_ids == [7, 4, 9] and ignored.finish_reason is None
    rule.extend(ignored, [4] * 10, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(ignored.token_ids) == 8 and ignored.finish_reason == "length"


def test_the_tail_stop_check_stops_where_decoding_the_whole_text_stops(tok):
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    words = ["the", " cat", " sat", " on", " 世界", " 😀", "END", " café", "\n", " E", "ND", "!"]
    for _ in range(150):
        ids = tok.encode("".join(rng.choice(words) for _ in range(rng.randint(1, 40))), add_special_tokens=False)
        stop = tuple(rng.sample(["END", "sat on", "界 😀", "!\n", "café E"], rng.randint(1, 2)))
        params = SamplingParams(max_tokens=10_000, stop=stop)
        fast = _gen()
        StopRule(frozenset(), decode).extend(fast, ids, params)
        expected = next((n for n in range(1, len(ids) + 1) if any(s in decode(ids[:n]) for s in stop)), None)
        assert fast.token_ids == ids[: expected or len(ids)], (stop, decode(ids))
        assert fast.finish_reason == ("stop" if expected else None)


def test_the_stop_check_decodes_a_bounded_tail_per_token(tok):
    counting = CountingDecode(lambda ids: tok.decode(ids, skip_special_tokens=True))
    ids = tok.encode("a long answer that never says the word " * 240, add_special_tokens=False)
    assert len(ids) > 1500
    gen = _gen()
    rule = StopRule(frozenset(), counting)
    for t in ids:
        rule.extend(gen, [t], SamplingParams(max_tokens=10_000, stop=("never appears", "STOP")))
    assert gen.finish_reason is None and len(gen.token_ids) == len(ids)
    assert counting.tokens < 80 * len(ids)  # a tail per token; the whole text per token would be ~len(ids)² / 2
