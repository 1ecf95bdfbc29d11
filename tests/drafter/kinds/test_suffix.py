"""Suffix decoding: matches and continuation frequencies against brute force, the bounded output
store, draft lengths that adapt to the match, and lossless decoding with earlier outputs in play."""
from collections import Counter

import numpy as np
import pytest
import torch

from specloop.drafter.decode.engine import Engine, generate
from specloop.drafter.decode.plan import StepPlan
from specloop.drafter.decode.requests import EngineRequest, StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.decode.speculative import StepOptions, drafted_q, speculative_step
from specloop.drafter.kinds.suffix import (
    MAX_HITS,
    SEPARATOR,
    Draft,
    History,
    OutputStore,
    SuffixConfig,
    SuffixDrafter,
    Tokens,
    best_draft,
    draft_from,
    follow,
    native_module,
)
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.kv_cache import prefill
from tests.tiny import build_model, llama_config

BACKENDS = [False, pytest.param(True, marks=pytest.mark.skipif(native_module() is None, reason="no C++ store built"))]


def brute_match(seq: list[int], context: list[int], max_depth: int) -> tuple[list[int], int]:
    """Every end p (with p + 1 < len(seq)) of the longest context suffix found in seq."""
    for m in range(min(max_depth, len(context)), 0, -1):
        pat = context[-m:]
        ends = [p for p in range(m - 1, len(seq) - 1) if seq[p - m + 1 : p + 1] == pat]
        if ends:
            return ends, m
    return [], 0


def brute_follow(seq: list[int], ends: list[int], limit: int, min_prob: float) -> list[tuple[int, float]]:
    path, p, at = [], 1.0, [e + 1 for e in ends]
    while len(path) < limit and at:
        taken = Counter(seq[a] for a in at if a < len(seq) and seq[a] != SEPARATOR)
        if not taken:
            break
        token, count = min(taken.items(), key=lambda tc: (-tc[1], tc[0]))  # most frequent, smallest id on a tie
        p *= count / len(at)
        if p < min_prob:
            break
        path.append((token, p))
        at = [a + 1 for a in at if a < len(seq) and seq[a] == token]
    return path


def test_the_longest_match_and_its_continuations_equal_brute_force_on_random_text():
    rng = np.random.default_rng(0)
    for trial in range(300):
        vocab = int(rng.integers(2, 6))
        seq = rng.integers(0, vocab, size=int(rng.integers(2, 60))).tolist()
        if trial % 3 == 0:  # separators inside, as in the output store
            seq = [SEPARATOR if rng.random() < 0.1 else t for t in seq]
        context = rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist()
        depth = int(rng.integers(1, 8))
        ends, m = Tokens(seq, native=False).impl.match(np.array(context, dtype=np.int32), depth)
        want_ends, want_m = brute_match(seq, context, depth)
        assert (sorted(ends.tolist()), m) == (want_ends, want_m), (seq, context, depth)
        got = follow(np.array(seq, dtype=np.int32), ends, 6, 0.05)
        want = brute_follow(seq, want_ends, 6, 0.05)
        assert [t for t, _ in got] == [t for t, _ in want]
        assert np.allclose([p for _, p in got], [p for _, p in want])


@pytest.mark.parametrize("native", BACKENDS)
def test_a_draft_is_no_longer_than_the_match_allows_and_stops_when_unlikely(native):
    text = Tokens([5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 5, 6], native)
    short = draft_from(text, text, 8, SuffixConfig())  # "5 6" matches: 2 tokens at spec_factor 1
    assert (short.match_len, short.tokens) == (2, [7, 8])
    long = draft_from(text, text, 8, SuffixConfig(spec_factor=4.0))
    assert long.tokens == [7, 8, 9, 10, 11, 12, 1, 2] and long.probs == [1.0] * 8
    branchy = Tokens([1, 2, 0, 1, 3, 0, 1, 4, 0, 1, 2, 0, 7, 1], native)  # after "1": 2, 3, 4, 2
    assert draft_from(branchy, branchy, 4, SuffixConfig(min_prob=0.6)).tokens == []
    assert draft_from(branchy, branchy, 1, SuffixConfig(min_prob=0.4)).tokens == [2]
    nothing = draft_from(text, Tokens([99], native), 8, SuffixConfig())
    assert (nothing.tokens, nothing.match_len, nothing.score) == ([], 0, 0.0)


@pytest.mark.parametrize("native", BACKENDS)
def test_the_output_store_keeps_the_newest_outputs_within_its_capacity(native):
    rng = np.random.default_rng(1)
    store, kept = OutputStore(200, native), []
    for _ in range(500):
        out = rng.integers(0, 50, size=int(rng.integers(1, 90))).astype(np.int32)
        store.add(out)
        kept.append(out[-199:].tolist() + [SEPARATOR])
        assert store.n <= 200 and (native or len(store.impl.buf) == 200)  # memory never grows
        expect, total = [], 0
        for piece in reversed(kept):  # the newest outputs that fit, oldest evicted first
            if total + len(piece) > 200:
                break
            expect, total = piece + expect, total + len(piece)
        assert store.tokens.tolist() == expect
        assert store.outputs == len(expect) - len([t for t in expect if t != SEPARATOR])


def _relative(index, base: int) -> tuple[dict, dict]:
    return tuple({key: [p - base for p in pos] for key, pos in table.items()} for table in (index.ones, index.pairs))


def test_the_stores_index_follows_appends_and_evictions_exactly():
    """The index kept as outputs arrive and the oldest are evicted equals one built afresh from what the store
    holds (so it holds one entry per token and pair kept: its memory is bounded with the store's), and every
    match on it equals brute force."""
    rng = np.random.default_rng(2)
    store = OutputStore(300, native=False)
    for step in range(400):
        store.add(rng.integers(0, 6, size=int(rng.integers(1, 60))).astype(np.int32))
        assert _relative(store.impl.index, store.impl.base) == _relative(Tokens(store.tokens, False).impl.index, 0)
        if step % 20 == 0:
            seq = store.tokens.tolist()
            for _ in range(10):
                context = rng.integers(0, 6, size=int(rng.integers(1, 10))).tolist()
                ends, m = store.impl.match(np.array(context, dtype=np.int32), 8)
                assert (ends.tolist(), m) == brute_match(seq, context, 8)
    history = History([1, 2, 3], native=False)
    for _ in range(50):
        history.extend(rng.integers(0, 6, size=int(rng.integers(1, 6))).tolist())
    assert _relative(history.impl.index, 0) == _relative(Tokens(history.tokens, False).impl.index, 0)


def test_a_match_starts_from_the_most_recent_occurrences_of_a_very_common_pair():
    seq = np.array([3, 4] * (MAX_HITS + 100) + [9], dtype=np.int32)
    ends, m = Tokens(seq, native=False).impl.match(np.array([5, 3, 4], dtype=np.int32), 8)
    pairs = [p for p in range(1, len(seq) - 1) if seq[p - 1] == 3 and seq[p] == 4]
    assert m == 2 and ends.tolist() == pairs[-MAX_HITS:]


def _same_drafts(stores: tuple[Tokens, Tokens], rows: tuple[Tokens, Tokens], cfg: SuffixConfig, k: int) -> Draft:
    """Each backend's draft of `stores` for `rows` (C++, Python): equal token for token and bit for bit."""
    native, reference = (draft_from(store, row, k, cfg) for store, row in zip(stores, rows))
    assert native == reference, (native, reference)
    return native


@pytest.mark.skipif(native_module() is None, reason="no C++ store built")
def test_the_cpp_store_drafts_what_the_python_store_drafts_through_appends_and_evictions():
    """csrc/suffix.cpp against the Python reference: a global store of random outputs (evicting its oldest), rows
    growing a token or a few at a time, every configuration's draft equal (tokens, p_i to the bit, match length),
    matches that start from MAX_HITS occurrences of a common pair, contexts that match nothing."""
    rng = np.random.default_rng(7)
    stores = OutputStore(500, native=True), OutputStore(500, native=False)
    drafted = 0
    for step in range(300):
        vocab = int(rng.integers(2, 9))
        out = rng.integers(0, vocab, size=int(rng.integers(1, 80))).astype(np.int32)
        for store in stores:
            store.add(out)
        assert stores[0].tokens.tolist() == stores[1].tokens.tolist()
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist()
        rows = History(prompt, native=True), History(prompt, native=False)
        for _ in range(4):
            cfg = SuffixConfig(max_depth=int(rng.integers(1, 12)), spec_factor=float(rng.choice([0.5, 1.0, 2.5])),
                               min_prob=float(rng.choice([0.0, 0.1, 0.4])))
            k = int(rng.integers(1, 9))
            drafted += len(_same_drafts(stores, rows, cfg, k).tokens)
            assert best_draft(rows[0], stores[0], k, cfg) == best_draft(rows[1], stores[1], k, cfg)
            _same_drafts(rows, rows, cfg, k)
            more = rng.integers(0, vocab, size=int(rng.integers(1, 4))).tolist()
            for row in rows:
                row.extend(more)
            assert rows[0].output.tolist() == rows[1].output.tolist() and rows[0].last == rows[1].last
    assert drafted > 500  # the stores matched often
    common = [3, 4] * (MAX_HITS + 100) + [9, 3, 4, 3]
    pair = Tokens(common, True), Tokens(common, False)
    assert _same_drafts(pair, pair, SuffixConfig(max_depth=3, spec_factor=4.0), 8).tokens == [4, 3, 4, 3, 4, 3, 4, 3]
    nothing = Tokens([99], True), Tokens([99], False)
    assert _same_drafts(stores, nothing, SuffixConfig(), 4) == Draft()


def test_the_best_draft_is_the_higher_scoring_stores_and_skips_the_store_when_it_cannot_win():
    rng = np.random.default_rng(3)
    cfg = SuffixConfig(spec_factor=2.0)
    for _ in range(200):
        store = OutputStore(400)
        for _ in range(int(rng.integers(0, 6))):
            store.add(rng.integers(0, 4, size=int(rng.integers(1, 40))).astype(np.int32))
        row = History(rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist())
        k = int(rng.integers(1, 6))
        own = draft_from(row, row, k, cfg)
        other = draft_from(store, row, k, cfg)
        assert best_draft(row, store, k, cfg) == (own if own.score >= other.score else other)


def test_the_global_store_stays_bounded_while_serving_many_requests():
    verifier = LeanDecoder(build_model(llama_config(32, 1, 16), seed=3))
    drafter = SuffixDrafter(32, SuffixConfig(global_tokens=300))
    rule, params = StopRule(), SamplingParams(max_tokens=40)
    for i in range(12):
        generate(verifier, drafter, [[1 + i % 5, 2, 3], [4, 5 + i % 3]], params, 4, rule)
        assert drafter.store.n <= 300
    assert drafter.store.outputs >= 5  # earlier outputs were kept, the oldest evicted


def test_earlier_outputs_drive_drafts_and_greedy_output_stays_the_verifiers():
    """A second identical request drafts its whole answer from the first one's output."""
    verifier = LeanDecoder(build_model(llama_config(64, 2, 32), seed=4, init_std=0.6))
    rule, params = StopRule(), SamplingParams(max_tokens=30)
    prompt = [7, 8, 9, 10]
    alone = generate(verifier, None, [prompt], params, 0, rule)[0].token_ids
    drafter = SuffixDrafter(64, SuffixConfig(spec_factor=8.0))
    first = generate(verifier, drafter, [prompt], params, 4, rule)[0]
    second = generate(verifier, drafter, [prompt], params, 4, rule)[0]
    assert first.token_ids == second.token_ids == alone
    assert second.stats.block_efficiency > first.stats.block_efficiency
    assert second.stats.accepted >= len(alone) // 2


def test_rows_without_a_match_draft_nothing_and_the_verify_pass_shrinks():
    """A step whose rows found no match is a plain pass (T = 1), whatever k was asked."""
    verifier = LeanDecoder(build_model(llama_config(64, 1, 16), seed=5))
    engine = Engine(verifier, SuffixDrafter(64), slots=2, capacity=64, stop_rule=StopRule())
    params = SamplingParams(max_tokens=3)
    engine.admit([EngineRequest("a", [1, 2, 3], params, 4, 0), EngineRequest("b", [4, 5, 6], params, 4, 1)])
    updates = engine.step()
    assert [u.k for u in updates] == [0, 0]  # nothing drafted
    assert engine.controller.costs.plain and engine.controller.costs.offered[(4, 2)].value == 0  # a plain pass


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_are_one_hot_and_padded_past_each_rows_length(temperature):
    drafter = SuffixDrafter(16)
    drafter.start([[1, 2, 3, 1, 2], [9]], 32)
    proposal = drafter.propose(3, SamplingParams(temperature=temperature), None)
    assert proposal.lengths.tolist() == [2, 0]
    assert proposal.tokens[0, :2].tolist() == [3, 1]
    assert proposal.one_hot and proposal.probs is None  # q one-hot: the step makes it once the draft is cut


def test_the_free_confidence_is_what_a_lookups_proposal_puts_before_the_gate():
    """Row by row, the confidence a lookup's proposal carries up to the row's draft length (float32 bits), for the
    first m rows; [] where a row has no draft."""
    drafter = SuffixDrafter(16)
    drafter.start([[1, 2, 3, 1, 2], [9], [4, 5, 4, 5, 4]], 32)
    proposal = drafter.lookup(3, SamplingParams(temperature=1.0))
    rows = [proposal.confidence[b, :n].tolist() for b, n in enumerate(proposal.lengths.tolist())]
    assert drafter.free_confidence(3, 3) == (rows, None) and rows[1] == [] and rows[0] and rows[2]
    assert drafter.free_confidence(3, 2) == (rows[:2], None)


def test_a_sampled_step_verifies_one_hot_drafts_cut_to_their_length():
    """At T > 0 the step verifies the cut draft, q one-hot on its tokens (made only where the ops judge it)."""
    verifier = LeanDecoder(build_model(llama_config(32, 1, 16), seed=3))
    drafter = SuffixDrafter(verifier.vocab_size)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    cache, _ = prefill(verifier, [prompt], 64)
    drafter.start([prompt], 64)
    seen = []
    plan = StepPlan.from_uniforms(torch.tensor([True]), 4, SamplingParams(temperature=1.0), torch.full((1, 9), 0.5))
    outcome = speculative_step(verifier, cache, torch.tensor([prompt[-1]]), drafter, plan,
                               options=StepOptions(on_trace=seen.append))
    proposal = seen[0].proposal  # the match "5 6 7" (3 tokens) drafts [8, 5, 6]: k = 4 is cut to 3
    assert proposal.one_hot and proposal.probs is None  # the compiled verdict takes one-hot drafts as they are
    q = drafted_q(proposal, verifier.vocab_size)  # what the rejection sampler's ops judge them with
    assert q.shape == (1, 3, verifier.vocab_size) and q.sum() == 3.0
    assert q[0].argmax(-1).tolist() == [8, 5, 6] and outcome.drafted.tolist() == [3]


def test_a_narrowed_view_and_a_hot_swap_keep_rows_and_the_store():
    drafter = SuffixDrafter(16)
    drafter.start([[1, 2], [3, 4], [5, 6]], 32)
    drafter.join([0], [[7, 8]])  # row 0's request ended: its (empty) output stays out of the store
    drafter.rows[1].extend([9, 9])
    drafter.join([1], [[1]])
    assert drafter.store.tokens.tolist() == [9, 9, SEPARATOR]
    view = drafter.narrow(2)
    assert view.store is drafter.store and len(view.rows) == 2
    new = SuffixDrafter(16)
    new.adopt(drafter)
    assert new.rows is drafter.rows and new.store is drafter.store
    other = SuffixDrafter(16)
    other.refill(drafter, [[7, 8, 1], [1], [5, 6]])
    assert other.rows[0].tokens.tolist() == [7, 8, 1] and other.rows[0].prompt_len == 2


def test_invalid_configs_are_refused():
    for bad in ({"max_depth": 0}, {"spec_factor": 0}, {"min_prob": 2}, {"global_tokens": -1}):
        with pytest.raises(ValueError):
            SuffixConfig(**bad)


def test_a_rows_draft_is_computed_once_per_state_and_never_stale():
    """Asking twice in a step (is a lookup worth it? then the lookup) reuses the draft; new tokens, a new
    output in the store, or another k give a fresh one."""
    drafter = SuffixDrafter(32)
    drafter.start([[1, 2, 3, 9, 1, 2]], 32)
    first = drafter.drafts(4)[0]
    assert drafter.drafts(4)[0] is first and drafter.drafts(4, [0])[0] is first
    assert first.tokens == [3, 9]
    assert drafter.drafts(1)[0].tokens == [3]
    drafter.rows[0].extend([3])
    assert drafter.drafts(4)[0].tokens == [9, 1, 2]  # the match "1 2 3" now drafts three
    drafter.store.add(np.asarray([5, 1, 2, 3, 7, 7, 7, 7], dtype=np.int32))
    assert drafter.drafts(4)[0] is not first
