"""drafter/decode/prefix_cache.py: blocks of prompt-prefix KV reused across requests and chat turns, exactly."""
from __future__ import annotations

import random

import pytest
import torch

import specloop.drafter.decode.prefix_cache as pc
from specloop.drafter.decode.engine import Engine
from specloop.drafter.decode.prefix_cache import (
    ROOT,
    PrefixCache,
    cache_output,
    final_start,
    passes,
    prefill_cached,
    reusable,
)
from specloop.drafter.decode.requests import EngineRequest, StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.attention import QUERY_CHUNK
from specloop.drafter.model.graph import on_backend
from specloop.drafter.model.kv_cache import prefill_rows
from specloop.drafter.model.loading import load_model

B = 4  # block size of the unit tests
WINDOW = 40  # the eagle3 head's: longer than a prompt's last pass may be, so that it bounds hits


def fake_kv(tokens):
    """read(first, end) for `insert`: keys [1 layer, 1 head, end - first, 1] holding the tokens themselves."""
    t = torch.tensor(tokens, dtype=torch.float32)
    return lambda a, b: (t[a:b].view(1, 1, -1, 1).clone(), -t[a:b].view(1, 1, -1, 1).clone())


def cached_tokens(blocks) -> list[int]:
    return [int(x) for blk in blocks for x in blk.keys.flatten().tolist()]


# ---------------------------------------------------------------- the schedule


@pytest.mark.parametrize("block", [4, 16, 32, 64])
def test_every_aligned_start_runs_the_fresh_schedules_passes_from_there(block):
    for n in range(0, 300):
        fresh = passes(0, n, block)
        assert [p for p in fresh if p[1] > p[0]] == fresh
        assert (fresh[0][0], fresh[-1][1]) == (0, n) if n else fresh == []
        assert all(a[1] == b[0] for a, b in zip(fresh, fresh[1:]))  # contiguous
        assert all(b - a == block for a, b in fresh[:-1])  # one pass per block, aligned
        if n > QUERY_CHUNK and block > QUERY_CHUNK:
            assert fresh[-1][1] - fresh[-1][0] > QUERY_CHUNK  # a long last pass, as a one-pass prefill's
        for start in range(0, final_start(n, block) + 1, block):
            assert passes(start, n, block) == [p for p in fresh if p[0] >= start]


def test_a_hit_leaves_the_last_pass_and_a_windowed_heads_positions_to_compute():
    assert reusable(100, 32) == 64 == final_start(100, 32)  # the last pass [64, 100) is 36 > 16 positions long
    assert reusable(80, 32) == 32  # [64, 80) would be 16: the last pass starts at 32
    assert reusable(100, 32, tail=40) == 32
    assert reusable(16, 32) == 0 and reusable(1, 4) == 0
    assert reusable(9, 4) == 8 and reusable(8, 4) == 4  # blocks within QUERY_CHUNK: the last pass may be 1 position


# ---------------------------------------------------------------- the cache


def test_a_prompt_finds_its_longest_cached_chain_of_whole_blocks():
    cache = PrefixCache(budget=100, block_size=B)
    first = list(range(1, 15))  # 3 whole blocks and 2 tokens
    assert cache.match(first, 14) == []
    assert cache.insert(first, 14, fake_kv(first)) == 3
    assert cached_tokens(cache.match(first, 14)) == first[:12]
    assert cached_tokens(cache.match(first + [99], 15)) == first[:12]
    assert cached_tokens(cache.match(first, 11)) == first[:8]  # within the limit
    other = first[:6] + [77] + first[7:]  # differs in the second block
    assert cached_tokens(cache.match(other, 14)) == first[:4]
    assert cache.match([0] + first[1:], 14) == []  # the same later blocks after another first block: no hit
    assert cache.insert(other, 14, fake_kv(other)) == 2  # shares the first block
    assert len(cache) == 5
    assert cached_tokens(cache.match(other, 14)) == other[:12]


def test_a_chain_is_evicted_from_its_last_block_least_recently_used_first():
    cache = PrefixCache(budget=5 * B, block_size=B)
    a, b = list(range(100, 116)), list(range(200, 212))  # 4 and 3 blocks
    cache.insert(a, 16, fake_kv(a))
    cache.insert(b, 12, fake_kv(b))  # 7 blocks for 5: a's last two go
    assert cache.evicted == 2
    assert cached_tokens(cache.match(a, 16)) == a[:8] and cached_tokens(cache.match(b, 12)) == b
    cache.match(a, 16)  # a used last: b's blocks go first now
    c = list(range(300, 308))
    cache.insert(c, 8, fake_kv(c))
    assert cached_tokens(cache.match(b, 12)) == b[:4]
    assert cached_tokens(cache.match(a, 16)) == a[:8] and cached_tokens(cache.match(c, 8)) == c
    assert cache.stats().blocks == 5 and cache.evicted == 4


def test_random_traffic_never_leaves_a_block_whose_parent_was_evicted():
    rng = random.Random(0)
    cache = PrefixCache(budget=12 * B, block_size=B)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    for p in prompts:
        if rng.random() < 0.5:
            cache.match(p, len(p))
        cache.insert(p, len(p), fake_kv(p))
        blocks = cache._blocks
        assert len(blocks) <= 12
        assert all(blk.parent == ROOT or blk.parent in blocks for blk in blocks.values())


def test_a_chain_longer_than_the_budget_keeps_its_first_blocks_and_an_empty_budget_holds_none():
    cache = PrefixCache(budget=2 * B, block_size=B)
    p = list(range(20))
    assert cache.insert(p, 20, fake_kv(p)) == 2
    assert cached_tokens(cache.match(p, 20)) == p[:8]
    empty = PrefixCache(budget=0, block_size=B)
    assert empty.insert(p, 20, fake_kv(p)) == 0 and empty.match(p, 20) == []


def test_blocks_are_checked_by_their_tokens_and_parent_not_by_their_key_alone(monkeypatch):
    monkeypatch.setattr(pc, "block_key", lambda parent, tokens: b"every block collides")
    cache = PrefixCache(budget=100, block_size=B)
    a, b = list(range(8)), list(range(10, 18))
    assert cache.insert(a, 8, fake_kv(a)) == 1  # its second block's key is taken (by its first)
    assert cache.insert(b, 8, fake_kv(b)) == 0
    assert cache.match(b, 8) == []  # never another prompt's KV
    assert cached_tokens(cache.match(a, 8)) == a[:4]


def test_stats_count_prompt_tokens_looked_up_and_served():
    cache = PrefixCache(budget=64, block_size=B)
    cache.record(10, 0)
    cache.record(12, 8)
    s = cache.stats()
    assert (s.queries, s.hits, s.hit_rate) == (22, 8, 8 / 22)
    assert (s.budget, s.block_size) == (64, B)


# ---------------------------------------------------------------- exactness on the reference verifier


@pytest.fixture(scope="module")
def pair(reference_pair):
    return load_model(reference_pair[0]), reference_pair[1]


@pytest.fixture(scope="module")
def rule(pair):
    return StopRule(frozenset(pair[0].eos_ids))


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(5, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_prefill_that_finds_its_prefix_cached_writes_the_fresh_schedules_kv_bit_for_bit(pair):
    lean = pair[0].lean
    prompt = _tokens(1, 170)
    cold = lean.new_cache(2, 256)
    fresh = PrefixCache(budget=1024)
    f_cold, _, _ = prefill_cached(lean, cold, [1], [prompt], fresh, (2, 5))
    warm_cache = PrefixCache(budget=1024)
    prefill_cached(lean, lean.new_cache(1, 256), [0], [prompt[:100] + _tokens(2, 30)], warm_cache)
    warm = lean.new_cache(2, 256)
    warm.keys[0].fill_(7.0)  # stale rows are overwritten or never read
    f_warm, _, _ = prefill_cached(lean, warm, [1], [prompt], warm_cache, (2, 5))
    assert warm_cache.stats().hits == 96  # blocks [0, 96) of the shared 100 tokens
    assert fresh.stats().hits == 0
    n = len(prompt) - 1
    assert int(warm.lens[1]) == int(cold.lens[1]) == n
    for a, b in zip(cold.keys + cold.values, warm.keys + warm.values):
        assert torch.equal(a[1, :, :n], b[1, :, :n])
    for i in (2, 5):
        assert torch.equal(f_cold[i], f_warm[i])


def _chat(verifier, drafter, rule, turns, prefix, k=0, max_tokens=12, slots=1, backend="eager"):
    """A chat through the engine: turn t's prompt is turn t − 1's prompt + answer + a new message. Returns the
    answers, the hit of every turn, and the pool row's KV after each admission."""
    engine = Engine(verifier.lean, drafter, slots, 1024, rule, prefix_cache=prefix, backend=backend)
    prompt, answers, hits, kv = [], [], [], []
    for t, message in enumerate(turns):
        prompt = prompt + message
        before = prefix.stats().hits if prefix is not None else 0
        engine.admit([EngineRequest(f"t{t}", prompt, SamplingParams(max_tokens=max_tokens), k, t)])
        hits.append((prefix.stats().hits if prefix is not None else 0) - before)
        slot = engine.get(f"t{t}").slot
        kv.append([c[slot, :, : len(prompt) - 1].clone() for c in engine.cache.keys + engine.cache.values])
        done = None
        while done is None:
            done = next((u.generation for u in engine.step() if u.generation is not None), None)
        engine.cache_finished()  # the user's think time: the serving loop's idle work
        answers.append(done.token_ids)
        prompt = prompt + done.token_ids
    return answers, hits, kv


def _turns(n: int, seed: int = 0) -> list[list[int]]:
    """A system prompt and first message of 60 tokens (a block cached before its last pass), then messages of
    8..29 tokens."""
    g = torch.Generator().manual_seed(seed)
    return [_tokens(seed * 100 + t, 60 if t == 0 else int(torch.randint(8, 30, (1,), generator=g))) for t in range(n)]


@pytest.mark.parametrize("outputs", [True, False])
def test_a_ten_turn_chat_hits_on_every_turn_after_the_first_with_the_verifiers_own_output(pair, rule, outputs):
    turns = _turns(10)
    plain, _, _ = _chat(pair[0], None, rule, turns, None)
    prefix = PrefixCache(budget=2048, outputs=outputs)
    cached, hits, kv = _chat(pair[0], None, rule, turns, prefix)
    assert cached == plain
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])
    assert hits == expected_hits(turns, cached, outputs)
    fresh, prompt = PrefixCache(budget=2048), []
    for t, (message, answer) in enumerate(zip(turns, cached)):
        prompt = prompt + message
        if t in (3, 9):  # the pool's KV is the fresh schedule's bit for bit
            n = len(prompt) - 1
            cold = pair[0].lean.new_cache(1, 1024)
            prefill_cached(pair[0].lean, cold, [0], [prompt], fresh)
            assert all(torch.equal(c[0, :, :n], w) for c, w in zip(cold.keys + cold.values, kv[t]))
        prompt = prompt + answer


def expected_hits(turns, answers, outputs=True, tail=0, block=32, alike=False) -> list[int]:
    """What each turn of a chat finds: the previous history's whole blocks (its answer prefilled at the finish; where
    rows are computed alike, those of the KV its steps wrote: all but its last token's), or the previous prompt's
    blocks before its last pass (prompts only; where rows are computed alike, all its prefilled blocks), within what
    this prompt may reuse."""
    prompt, seen, out = [], 0, []
    for message, answer in zip(turns, answers):
        prompt = prompt + message
        n = len(prompt) - 1
        out.append(min(seen, reusable(n, block, tail)))
        history = len(prompt) + len(answer) - (1 if alike else 0)
        seen = max(seen, history // block * block if outputs else n // block * block if alike else final_start(n, block))
        prompt = prompt + answer
    return out


@pytest.fixture(scope="module")
def alike(reference_pair):
    """The reference verifier served in w4a8: specloop's own kernels end to end (`LeanDecoder.rows_alike`)."""
    return load_model(reference_pair[0], weights="w4a8"), reference_pair[1]


@pytest.mark.parametrize("kind,outputs", [(None, True), (None, False), ("ngram", True), ("pretrained", True)])
def test_where_rows_are_computed_alike_a_prompt_prefills_in_one_pass_and_an_answer_is_cached_from_its_own_kv(
        alike, kind, outputs, monkeypatch):
    # no aligned schedule: the rest after a hit is one pass, every full block of it is cached, and a finished
    # history's blocks are read from the KV its decode steps wrote (no second prefill); the chat's answers are the
    # verifier alone's without a cache, the pool's KV one fresh one-pass prefill's, bit for bit
    verifier, drafter_dir = alike
    lean = verifier.lean
    assert lean.rows_alike
    rule = StopRule(frozenset(verifier.eos_ids))
    turns = _turns(6, seed=2)
    plain, _, _ = _chat(verifier, None, rule, turns, None, max_tokens=16)
    idle, passes_seen = [False], []
    forward = lean.forward
    monkeypatch.setattr(lean, "forward", lambda cache, tokens, *a, **kw: (
        passes_seen.append((idle[0], tokens.shape)) or forward(cache, tokens, *a, **kw)))
    finish = Engine.cache_finished

    def cache_finished(engine, most=None):
        idle[0] = True
        try:
            return finish(engine, most)
        finally:
            idle[0] = False
    monkeypatch.setattr(Engine, "cache_finished", cache_finished)
    prefix = PrefixCache(budget=2048, outputs=outputs)
    drafter = build_drafter(kind, verifier, drafter_dir) if kind else None
    cached, hits, kv = _chat(verifier, drafter, rule, turns, prefix, k=4 if kind else 0, max_tokens=16)
    assert cached == plain
    assert hits == expected_hits(turns, cached, outputs, alike=True) and all(h > 0 for h in hits[1:])
    assert not [shape for in_idle, shape in passes_seen if in_idle]  # answers cached with no forward pass
    prompt = []
    for t, (message, answer) in enumerate(zip(turns, cached)):
        prompt = prompt + message
        n = len(prompt) - 1
        cold = lean.new_cache(1, 1024)
        forward(cold, torch.tensor([prompt[:n]]), last_only=True, prefill=True)
        assert all(torch.equal(c[0, :, :n], w) for c, w in zip(cold.keys + cold.values, kv[t])), t
        prompt = prompt + answer


@pytest.mark.parametrize("kind", ["pretrained", "ngram", "eagle3"])
def test_speculative_chats_with_the_cache_decode_as_the_verifier_alone(pair, rule, kind):
    verifier, drafter_dir = pair
    turns = _turns(4, seed=1)
    plain, _, _ = _chat(verifier, None, rule, turns, None, max_tokens=16)

    def drafter():
        if kind == "eagle3":
            from specloop.drafter.kinds.eagle3 import Eagle3Drafter
            from tests.drafter_helpers import trained_eagle3

            return Eagle3Drafter(verifier.lean, trained_eagle3(verifier.lean, seed=1, std=0.05, window=WINDOW))
        return build_drafter(kind, verifier, drafter_dir if kind == "pretrained" else None)

    spec = drafter()
    answers, hits, _ = _chat(verifier, spec, rule, turns, PrefixCache(budget=2048), k=4, max_tokens=16)
    assert answers == plain
    assert all(h > 0 for h in hits[1:])
    if kind == "pretrained":  # its LM's prompts went through a cache of its own
        assert spec.prefix_cache is not None and spec.prefix_cache.stats().hits > 0
    # a windowed head's positions are prefilled, never taken from the cache (with the pretrained drafter, the
    # verifier's prefill captures nothing: its hits are a chat's without a drafter)
    assert hits == expected_hits(turns, answers, tail=WINDOW if kind == "eagle3" else 0)
    if kind == "eagle3":
        assert hits != expected_hits(turns, answers)  # the window bounded some hit


@pytest.mark.parametrize("prefill", ["eager", "graph"])  # graph: a GPU's prefill in captured chunks
def test_the_graph_backend_with_the_cache_decodes_as_without(pair, rule, monkeypatch, prefill):
    monkeypatch.setenv("SPECLOOP_COMPILE", "0")
    monkeypatch.setenv("SPECLOOP_PREFILL", prefill)
    verifier = pair[0]
    turns = _turns(3, seed=3)

    def chat(prefix):
        engine = Engine(verifier.lean, build_drafter("ngram", verifier, None), 2, 512, rule, backend="graph",
                        prefix_cache=prefix)
        prompt, answers = [], []
        for t, message in enumerate(turns):
            prompt = prompt + message
            engine.admit([EngineRequest(f"t{t}", prompt, SamplingParams(max_tokens=10), None, t)])
            done = None
            while done is None:
                done = next((u.generation for u in engine.step() if u.generation is not None), None)
            engine.cache_finished()
            answers.append(done.token_ids)
            prompt = prompt + done.token_ids
        assert engine.verifier.graph_calls > 0
        assert engine.verifier.chunked_prefill == (prefill == "graph")
        return answers

    prefix = PrefixCache(budget=1024)
    assert chat(prefix) == chat(None)
    assert prefix.stats().hits > 0


@pytest.mark.parametrize("k", [0, 4])
def test_where_rows_are_computed_alike_an_answer_is_cached_up_to_its_last_fed_token(alike, k):
    # a history of exactly two blocks: its last token was never fed (no KV of its own), so only the first block is
    # taken from the row; a next turn then finds the fresh prefill's KV
    verifier, _ = alike
    lean, rule = verifier.lean, StopRule(frozenset(verifier.eos_ids))
    prefix = PrefixCache(budget=2048)
    drafter = build_drafter("ngram", verifier, None) if k else None
    engine = Engine(lean, drafter, 1, 512, rule, prefix_cache=prefix)
    prompt = _tokens(11, 40)
    engine.admit([EngineRequest("a", prompt, SamplingParams(max_tokens=24, ignore_eos=True), k, 0)])
    done = None
    while done is None:
        done = next((u.generation for u in engine.step() if u.generation is not None), None)
    history = prompt + done.token_ids
    assert len(history) == 64
    engine.cache_finished()
    assert len(prefix.match(history, 64)) == 1  # the prompt's block (cached at admission), not the second
    nxt = history + _tokens(12, 30)
    engine.admit([EngineRequest("b", nxt, SamplingParams(max_tokens=1), 0, 1)])
    n = len(nxt) - 1
    cold = lean.new_cache(1, 512)
    lean.forward(cold, torch.tensor([nxt[:n]]), last_only=True, prefill=True)
    slot = engine.get("b").slot
    assert all(torch.equal(c[0, :, :n], w[slot, :, :n]) for c, w in zip(cold.keys + cold.values,
                                                                       engine.cache.keys + engine.cache.values))


def test_an_aborted_request_caches_no_output_and_a_finished_one_its_whole_history(pair, rule):
    verifier = pair[0]
    prefix = PrefixCache(budget=2048)
    engine = Engine(verifier.lean, None, 1, 512, rule, prefix_cache=prefix)
    prompt = _tokens(7, 40)  # 39 positions to prefill: one pass, no block cached at admission
    engine.admit([EngineRequest("a", prompt, SamplingParams(max_tokens=40), 0, 0)])
    for _ in range(3):
        engine.step()
    assert engine.abort("a")
    assert len(prefix) == 0
    engine.admit([EngineRequest("b", prompt, SamplingParams(max_tokens=40), 0, 0)])
    done = None
    while done is None:
        done = next((u.generation for u in engine.step() if u.generation is not None), None)
    history = prompt + done.token_ids
    assert len(prefix) == 0  # the finish costs the step nothing: the answer is cached as idle work
    engine.cache_finished()
    assert len(history) >= 64 and len(prefix) == len(history) // 32
    assert len(prefix.match(history, len(history))) == len(history) // 32


def test_a_finished_answer_whose_slot_is_reused_before_the_idle_work_is_not_cached(pair, rule):
    """Under load the freed row is overwritten by the next admission before any idle time: that answer's KV is
    gone, so it is dropped (never cached from a row that no longer holds it); the new prompt's blocks are."""
    verifier = pair[0]
    prefix = PrefixCache(budget=2048)
    engine = Engine(verifier.lean, None, 1, 512, rule, prefix_cache=prefix)
    first, second = _tokens(3, 40), _tokens(4, 80)
    engine.admit([EngineRequest("a", first, SamplingParams(max_tokens=40), 0, 0)])
    while engine.running:
        engine.step()
    assert engine.finished
    engine.admit([EngineRequest("b", second, SamplingParams(max_tokens=4), 0, 0)])
    assert not engine.finished and engine.cache_finished() == 0
    assert not prefix.match(first, len(first)) and len(prefix.match(second, len(second))) > 0


def test_where_rows_are_computed_alike_an_answer_is_cached_at_its_finish_even_when_its_slot_is_reused_at_once(alike):
    # copies of the row's own KV, no pass: done at the finish, before the next admission takes the row
    verifier = alike[0]
    prefix = PrefixCache(budget=2048)
    engine = Engine(verifier.lean, None, 1, 512, StopRule(frozenset(verifier.eos_ids)), prefix_cache=prefix)
    first, second = _tokens(3, 40), _tokens(4, 80)
    engine.admit([EngineRequest("a", first, SamplingParams(max_tokens=40, ignore_eos=True), 0, 0)])
    done = None
    while done is None:
        done = next((u.generation for u in engine.step() if u.generation is not None), None)
    history = first + done.token_ids
    assert not engine.finished  # nothing left for the idle work
    engine.admit([EngineRequest("b", second, SamplingParams(max_tokens=4), 0, 0)])
    assert len(prefix.match(history, len(history))) == (len(history) - 1) // 32 == 2
    assert len(prefix.match(second, len(second))) == 2


def test_with_chunked_prefills_a_hit_and_a_cached_answer_leave_a_fresh_prefills_kv_bit_for_bit(pair, rule, monkeypatch):
    # a GPU's prefill (captured chunks of model.graph.PREFILL_CHUNK on a scratch pool): a hit's blocks, the rest in
    # chunks from the hit, and the answers cached at each finish (prefilled again on the scratch pool) make the
    # same KV as one fresh chunked prefill of the whole prompt
    monkeypatch.setenv("SPECLOOP_COMPILE", "0")
    monkeypatch.setenv("SPECLOOP_PREFILL", "graph")
    verifier = pair[0]
    turns = _turns(4, seed=4)
    prefix = PrefixCache(budget=2048)
    answers, hits, kv = _chat(verifier, None, rule, turns, prefix, backend="graph")
    assert hits == expected_hits(turns, answers) and all(h > 0 for h in hits[1:])
    graph = on_backend(verifier.lean, "graph", 1, 5, compiled=False)
    assert graph.chunked_prefill
    prompt = []
    for t, (message, answer) in enumerate(zip(turns, answers)):
        prompt = prompt + message
        n = len(prompt) - 1
        cold = graph.new_cache(1, 1024)  # a pool of one row, as the chat's engine had
        prefill_rows(graph, cold, [0], [prompt])
        assert all(torch.equal(c[0, :, :n], w) for c, w in zip(cold.keys + cold.values, kv[t])), t
        prompt = prompt + answer


def test_a_chunked_cache_output_prefills_on_its_own_rows_kv_not_on_what_the_scratch_pool_last_held(pair, monkeypatch):
    monkeypatch.setenv("SPECLOOP_COMPILE", "0")
    monkeypatch.setenv("SPECLOOP_PREFILL", "graph")
    graph = on_backend(pair[0].lean, "graph", 2, 5, compiled=False)
    prefix = PrefixCache(budget=2048)
    a, b = _tokens(11, 70), _tokens(12, 50)
    cache = graph.new_cache(2, 512)
    prefill_cached(graph, cache, [0], [a], prefix)
    prefill_cached(graph, cache, [1], [b], prefix)  # the prefiller's scratch pool holds b's KV now
    history = a + _tokens(13, 40)
    assert cache_output(graph, cache, 0, len(a), history, prefix) == 2  # blocks [64, 96) and [96, 128) were new
    follow = history + _tokens(14, 20)
    warm, cold = graph.new_cache(2, 512), graph.new_cache(2, 512)
    before = prefix.stats().hits
    prefill_cached(graph, warm, [0], [follow], prefix)
    assert prefix.stats().hits - before == 96  # a's blocks and the cached answer's
    prefill_rows(graph, cold, [0], [follow])
    n = len(follow) - 1
    assert all(torch.equal(c[0, :, :n], w[0, :, :n]) for c, w in zip(cold.keys + cold.values, warm.keys + warm.values))
