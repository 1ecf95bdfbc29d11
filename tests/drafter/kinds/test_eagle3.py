"""The EAGLE-3-style head (specloop.drafter.kinds.eagle3): its training-time test computes exactly the chains that
drafting runs; drafting is lossless under the speculative loop (fixed k, k auto with plain steps,
continuous batching, a hot swap); its window follows plain steps and prefills; it round-trips
through its checkpoint and refuses what does not fit."""
import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.plan import StepPlan
from specloop.drafter.decode.proposer import VerifierView
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.decode.speculative import speculative_step
from specloop.drafter.kinds.eagle3 import (
    MATRICES,
    VECTORS,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Head,
    Window,
    chain,
    default_layers,
    draft_chain,
    shifted_in,
    ttt_logits,
    window_entries,
)
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.kv_cache import prefill_recent
from tests.drafter_helpers import chained_like_the_loop
from tests.drafter_helpers import trained_eagle3 as trained_like
from tests.tiny import build_model, llama_config

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20]]


@pytest.fixture(scope="module")
def verifier():
    return build_model(llama_config(60, 4, 64), seed=0, init_std=0.2)


def features(verifier, lean: LeanDecoder, ids: list[int], layers) -> torch.Tensor:
    """[T, 3d]: the verifier's residual streams at every position of `ids`, the head's layers concatenated."""
    out = lean.forward(lean.new_cache(1, len(ids)), torch.tensor([ids]), capture=tuple(layers))
    return torch.cat([out.hidden[i][0] for i in layers], dim=-1).float()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_training_time_test_computes_the_chains_drafting_runs(verifier, depth):
    """ttt_logits at depth j and position t = the j-th draft of a window ending j − 1 positions
    before t, fed the true tokens: the training objective is the drafting computation."""
    lean = LeanDecoder(verifier)
    head = trained_like(lean)
    cfg, w = head.cfg, head.weights()
    ids = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6]
    feats = features(verifier, lean, ids, cfg.layers)  # feats[p] produced ids[p + 1]
    embed = verifier.model.embed_tokens.weight.detach()
    lm = verifier.lm_head.weight.detach()
    T = len(ids) - 1  # training positions t = 1..T−1 pair (feats[t − 1], ids[t])
    prev, x = feats[None, : T], torch.tensor(ids[1 : T + 1])[None]  # position t: (feats[t], ids[t + 1])
    with torch.no_grad():
        got = ttt_logits(w, prev, torch.nn.functional.embedding(x, embed), torch.full((1, T), depth), lm, depth)
        for t in range(depth - 1, T):
            first = t - depth + 1  # the chain's true newest position
            lo = max(0, first - cfg.window + 1)
            raw, toks = prev[0, lo : first + 1], x[0, lo : first + 1]
            u, k, v = window_entries(w, raw[None], torch.nn.functional.embedding(toks, embed)[None])
            n = first + 1 - lo
            pad = cfg.window - n
            pad_to = lambda a: torch.cat([torch.zeros_like(a[:, :1]).expand(-1, pad, *a.shape[2:]), a], dim=1)  # noqa: E731
            win = Window(pad_to(raw[None]), pad_to(toks[None]), pad_to(torch.ones(1, n, dtype=torch.bool)),
                         pad_to(k), pad_to(v), u[:, -1])
            forced = x[0, first + 1 : t + 1]  # the tokens drafts 2..depth read
            out = chain(w, win, lambda tok: torch.nn.functional.embedding(tok, embed), lm, depth,
                        lambda i, logits: forced[i : i + 1])
            torch.testing.assert_close(got[0, t], out[-1][0], rtol=1e-4, atol=1e-4)


def test_shifted_in_appends_per_row_counts():
    old = torch.arange(8).view(2, 4)
    new = torch.tensor([[10, 11, 12], [20, 21, 22]])
    assert shifted_in(old, new, torch.tensor([2, 0])).tolist() == [[2, 3, 10, 11], [4, 5, 6, 7]]
    assert shifted_in(old, new, torch.tensor([3, 1])).tolist() == [[3, 10, 11, 12], [5, 6, 7, 20]]


def test_default_layers_are_low_middle_high():
    assert default_layers(30) == [3, 15, 29]
    assert len(set(default_layers(4))) == 3


def start(lean, drafter, prompts, capacity=64):
    cache, feats, recent, lens = prefill_recent(lean, prompts, capacity, drafter.verifier_layers, drafter.feature_window)
    drafter.start(prompts, capacity, VerifierView(cache, feats, recent, lens))
    return cache


def test_the_window_holds_the_prompts_last_positions_and_follows_plain_steps(verifier):
    lean = LeanDecoder(verifier)
    d = Eagle3Drafter(lean, trained_like(lean))
    cache = start(lean, d, PROMPTS)
    W = d.w.cfg.window
    for b, p in enumerate(PROMPTS):  # entries pair the feature that produced token p[j] with p[j]
        n = max(1, min(W, len(p) - 1))
        assert d.win.valid[b].tolist() == [False] * (W - n) + [True] * n
        assert d.win.tokens[b, W - n :].tolist() == p[-n:]
    long = PROMPTS[2]
    want = features(verifier, lean, long, d.verifier_layers)[len(long) - 1 - W : len(long) - 1]
    torch.testing.assert_close(d.win.raw[2].float(), want)
    assert not d.win.raw[3].any()  # a one-token prompt: its token with a zero feature
    last = torch.tensor([p[-1] for p in PROMPTS])
    outcome = speculative_step(lean, cache, last, d, StepPlan(torch.ones(4, dtype=torch.bool), 0, SamplingParams()))
    assert d.win.tokens[:, -1].tolist() == outcome.last_tokens.tolist()
    grown = [p + [int(t)] for p, t in zip(PROMPTS, outcome.last_tokens)]
    again = Eagle3Drafter(lean, d.head_module)
    start(lean, again, grown)
    for name in ("raw", "keys", "values", "newest"):
        torch.testing.assert_close(getattr(d.win, name)[:3], getattr(again.win, name)[:3], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 3, None])
def test_speculation_with_the_head_reproduces_the_verifier_alone(verifier, k):
    lean = LeanDecoder(verifier)
    params = SamplingParams(max_tokens=24)
    ref = generate(lean, None, PROMPTS, params, 0, StopRule())
    out = generate(lean, Eagle3Drafter(lean, trained_like(lean, seed=1)), PROMPTS, params, k, StopRule())
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]


def test_a_hot_swap_recomputes_the_window_under_the_new_weights(verifier):
    lean = LeanDecoder(verifier)
    old, new = Eagle3Drafter(lean, trained_like(lean, seed=1)), Eagle3Drafter(lean, trained_like(lean, seed=2))
    start(lean, old, PROMPTS)
    new.adopt(old)
    fresh = Eagle3Drafter(lean, new.head_module)
    start(lean, fresh, PROMPTS)
    for name in ("keys", "values", "newest"):
        torch.testing.assert_close(getattr(new.win, name), getattr(fresh.win, name))
    assert torch.equal(new.propose(3, SamplingParams(), None).tokens, fresh.propose(3, SamplingParams(), None).tokens)


def test_a_narrowed_view_drafts_its_rows_as_the_pool_does(verifier):
    lean = LeanDecoder(verifier)
    d = Eagle3Drafter(lean, trained_like(lean))
    start(lean, d, PROMPTS)
    whole = d.propose(2, SamplingParams(), None)
    view = d.narrow(2)
    assert torch.equal(view.propose(2, SamplingParams(), None).tokens, whole.tokens[:2])
    d.widen(view, 2)
    assert d.win.raw.shape[0] == 4
    assert torch.equal(whole.steer, d.win.raw.float())  # the raw window: what a replay record keeps


@pytest.mark.parametrize("vocab", [None, torch.arange(0, 60, 3)])
def test_the_captured_chain_drafts_as_the_loop_does(verifier, vocab):
    # the graph backend's greedy drafts (use_chain: k_max drafts for the pool's rows as one function, one graph on
    # a GPU) against the loop on the same windows: tokens, confidence, logits and steer of the first k; the
    # function traces with no graph break
    lean = LeanDecoder(verifier)
    d = Eagle3Drafter(lean, trained_like(lean, seed=3), vocab)
    start(lean, d, PROMPTS)
    loop, chained = chained_like_the_loop(d, 3, slots=6)
    assert torch.equal(chained.steer, loop.steer)
    assert torch.equal(d.narrow(2).propose(2, SamplingParams(), None).tokens, loop.tokens[:2, :2])  # a narrowed view
    assert d.propose(2, SamplingParams(temperature=1.0), torch.rand(4, 2)).probs is not None  # sampling: the loop
    win = d.win
    assert win is not None
    explained = torch._dynamo.explain(draft_chain)(
        win.keys, win.values, win.valid, win.newest, lean.embed, d.head, *(getattr(d.w, n) for n in MATRICES + VECTORS),
        cfg=d.w.cfg, vocab=d.vocab, depth=4, vocab_size=60)
    assert explained.graph_break_count == 0
    kept = d.chain
    d.use_chain(slots=6, depth=4, compiled=False)  # the next engine of the same shape: the same capture
    assert d.chain is kept
    d.use_chain(None)
    assert d.chain is None


def test_greedy_speculation_through_the_captured_chain_reproduces_the_verifier_alone(verifier, monkeypatch):
    # the engine's graph backend where its steps replay captured graphs (forced here: on the CPU a "replay"
    # calls again): the head drafts through its chain, and the output is the verifier alone's
    import specloop.drafter.model.graph as graph_module

    monkeypatch.setenv("SPECLOOP_COMPILE", "0")
    monkeypatch.setattr(graph_module, "direct_capture", lambda device, compiled: True)
    lean = LeanDecoder(verifier)
    params = SamplingParams(max_tokens=20)
    ref = generate(lean, None, PROMPTS, params, 0, StopRule(), backend="graph")
    d = Eagle3Drafter(lean, trained_like(lean, seed=1))
    chained: list[int] = []
    real = Eagle3Drafter._chained  # spied on the class: the engine drafts through narrowed copies too
    monkeypatch.setattr(Eagle3Drafter, "_chained", lambda self, captured, k: chained.append(k) or real(self, captured, k))
    out = generate(lean, d, PROMPTS, params, 3, StopRule(), backend="graph")
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]
    assert d.chain is not None and chained and set(chained) == {3}


def test_the_head_round_trips_and_builds_from_its_checkpoint(tmp_path, tiny_pair):
    from specloop.drafter.model.loading import load_model

    v = load_model(tiny_pair[0], dtype=torch.float32)
    head = trained_like(v.lean)
    head.save(tmp_path / "h", {"method": "test"})
    back = Eagle3Head.load(tmp_path / "h")
    assert back.cfg == head.cfg
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), head.state_dict().values()))
    built = build_drafter("eagle3", v, tmp_path / "h")
    assert built.kind == "eagle3" and built.verifier_layers == tuple(head.cfg.layers)
    assert isinstance(build_drafter("eagle3", v, None), Eagle3Drafter)  # untrained: the learner trains it
    with pytest.raises(ValueError, match="does not fit"):
        Eagle3Drafter(v.lean, Eagle3Head(Eagle3Config(hidden=v.lean.hidden_size + 16, layers=[0, 0, 0], heads=4)))
    with pytest.raises(ValueError, match="fuses 3 layers"):
        Eagle3Head(Eagle3Config(hidden=64, layers=[0, 1]))
    head.save(tmp_path / "x", {})
    (tmp_path / "x" / "manifest.json").write_text('{"kind": "eagle"}')
    with pytest.raises(ValueError, match="not an eagle3 head"):
        Eagle3Head.load(tmp_path / "x")
