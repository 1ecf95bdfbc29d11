"""services/api/planning.py: request bodies become Plans (one CompletionRequest per choice) within the
context (drafter/decode/capacity.py), with the tiny verifier's tokenizer."""
from __future__ import annotations

import pytest

from specloop.drafter.decode.capacity import AUTO_K_MAX, draft_reserve
from specloop.drafter.model.loading import load_tokenizer
from specloop.services.api.planning import (
    DEFAULT_MAX_TOKENS,
    ApiConfig,
    completion_budget,
    plan_request,
    prompt_bytes_limit,
)
from specloop.services.api.schemas import ApiError
from tests.tiny import TEXT

MODEL = "tiny-verifier"
CHAT = [{"role": "user", "content": "def main():"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return load_tokenizer(tiny_pair[0])


def test_default_max_tokens_fills_the_context_up_to_a_cap():
    cfg = ApiConfig(MODEL, 512)
    usable = 512 - draft_reserve(4)
    assert completion_budget(10, None, 4, cfg) == DEFAULT_MAX_TOKENS
    assert completion_budget(usable - 3, None, 4, cfg) == 3
    assert completion_budget(usable - 3, None, 0, cfg) == 3 + draft_reserve(4) - draft_reserve(0)
    assert completion_budget(10, usable - 10, 4, cfg) == usable - 10
    with pytest.raises(ApiError):
        completion_budget(11, usable - 10, 4, cfg)


def test_a_plan_fans_n_choices_out_with_one_seed_and_stream_indices(tokenizer):
    cfg, tok = ApiConfig(MODEL, 512), tokenizer
    body = {"model": MODEL, "messages": CHAT, "n": 3, "temperature": 0.7, "top_k": -1, "max_completion_tokens": 5,
            "speculative": {"k": 2, "drafter_version": "v0003"}}
    plan = plan_request(body, True, cfg, tok)
    assert [r.stream_index for r in plan.requests] == [0, 1, 2] and len({r.seed for r in plan.requests}) == 1
    assert all(r.k == 2 and r.drafter_version == "v0003" and r.max_tokens == 5 and r.top_k == 0 for r in plan.requests)
    assert plan_request(body, True, cfg, tok).requests[0].seed != plan.requests[0].seed  # random per request
    greedy = plan_request({"model": MODEL, "prompt": "x", "temperature": 0, "speculative": {"enabled": False}},
                          False, cfg, tok)
    assert greedy.requests[0].seed == 0 and greedy.requests[0].k == 0


def test_k_is_auto_by_default_and_auto_reserves_room_for_the_most_the_controller_drafts(tokenizer):
    cfg, tok = ApiConfig(MODEL, 512), tokenizer
    for spec in (None, {}, {"k": "auto"}, {"enabled": True, "k": "auto"}):
        body = {"model": MODEL, "prompt": "x"} | ({} if spec is None else {"speculative": spec})
        assert plan_request(body, False, cfg, tok).requests[0].k is None  # None: auto
    assert draft_reserve(None) == draft_reserve(AUTO_K_MAX)
    assert completion_budget(512 - draft_reserve(None) - 3, None, None, cfg) == 3
    with pytest.raises(ApiError, match="reserved for drafting with k=auto"):
        completion_budget(600, None, None, cfg)


def test_the_prompt_byte_limit_never_refuses_a_prompt_that_fits(tokenizer):
    """Text that encodes to n tokens is never over the limit for a context of n tokens."""
    tok = tokenizer
    for text in [*TEXT, " " * 300, "\n\t" * 200, "é" * 100, "日本語のテキスト" * 20, "<|user|>" * 10, "0123456789" * 50]:
        n = len(tok.encode(text, add_special_tokens=False))
        assert len(text.encode()) <= prompt_bytes_limit(tok, n), text[:40]


def test_ignore_eos_reaches_every_choice_and_its_sampling_params(tokenizer):
    cfg = ApiConfig(MODEL, 512)
    plan = plan_request({"model": MODEL, "prompt": "x", "n": 2, "ignore_eos": True}, False, cfg, tokenizer)
    assert all(r.ignore_eos and r.sampling().ignore_eos for r in plan.requests)
    assert not plan_request({"model": MODEL, "prompt": "x"}, False, cfg, tokenizer).requests[0].sampling().ignore_eos
    with pytest.raises(ApiError):
        plan_request({"model": MODEL, "prompt": "x", "ignore_eos": "yes please"}, False, cfg, tokenizer)


def test_a_body_with_far_more_role_keys_than_messages_allowed_is_refused_before_parsing():
    import json

    from specloop.services.api.schemas import ApiError, count_messages

    at_limit = json.dumps({"messages": [{"role": "user", "content": 'my "role" is "role"'}] * 64}).encode()
    count_messages(at_limit, 64)  # quotes inside strings are escaped: only the keys count
    over = json.dumps({"messages": [{"role": "user", "content": ""}] * 200}).encode()
    try:
        count_messages(over, 64)
    except ApiError as err:
        assert err.status == 400 and err.param == "messages" and "at most 64" in err.message
    else:
        raise AssertionError("200 messages passed a limit of 64")
