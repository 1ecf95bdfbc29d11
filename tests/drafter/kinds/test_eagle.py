"""The eagle feature head (specloop.drafter.kinds.eagle): drafts as its module computes them, lossless under the
speculative loop (fixed k, k auto with plain steps in between, continuous batching), follows plain
steps, round-trips through its checkpoint and refuses what does not fit."""
import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.plan import StepPlan
from specloop.drafter.decode.proposer import VerifierView
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.decode.speculative import speculative_step
from specloop.drafter.kinds import eagle as eagle_module
from specloop.drafter.kinds.eagle import EagleConfig, EagleDrafter, FeatureHead, new_head
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.kv_cache import prefill
from tests.drafter_helpers import chained_like_the_loop
from tests.drafter_helpers import trained_eagle as trained_like
from tests.tiny import build_model, llama_config

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def verifier():
    return build_model(llama_config(60, 4, 64), seed=0, init_std=0.2)


def test_drafts_are_the_modules_chain_from_the_verifiers_last_feature(verifier):
    lean = LeanDecoder(verifier)
    head = trained_like(lean)
    layer = lean.num_layers - 1
    cache, feats = prefill(lean, [PROMPTS[0]], 32, capture=(layer,))
    d = EagleDrafter(lean, head)
    assert d.verifier_layers == (layer,)
    d.start([PROMPTS[0]], 32, VerifierView(cache, feats))
    proposal = d.propose(3, SamplingParams(), None)
    z, token, want, sure = feats[layer], torch.tensor([PROMPTS[0][-1]]), [], [1.0]
    with torch.no_grad():
        for _ in range(3):
            z = head.step(z, verifier.model.embed_tokens(token))
            logits = head.logits(z, verifier.lm_head.weight)
            token = logits.argmax(-1)
            want.append(int(token))
            sure.append(sure[-1] * float(torch.softmax(logits, -1)[0, token]))
    assert proposal.tokens[0].tolist() == want
    assert torch.allclose(proposal.confidence[0], torch.tensor(sure[1:]), rtol=1e-4)  # its own P(drafts so far taken)
    assert torch.equal(proposal.steer[:, 0], feats[layer].float())  # what a replay record keeps


def test_a_draft_vocabulary_keeps_drafts_inside_it(verifier):
    lean = LeanDecoder(verifier)
    vocab = torch.arange(0, 60, 3)
    cache, feats = prefill(lean, PROMPTS, 32, capture=(lean.num_layers - 1,))
    d = EagleDrafter(lean, trained_like(lean), vocab)
    d.start(PROMPTS, 32, VerifierView(cache, feats))
    greedy = d.propose(4, SamplingParams(), None)
    sampled = d.propose(4, SamplingParams(temperature=1.0), torch.rand(3, 4))
    for tokens in (greedy.tokens, sampled.tokens):
        assert torch.isin(tokens, vocab).all()
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(3, 4))


def test_a_greedy_draft_over_a_draft_vocabulary_is_picked_without_the_whole_vocabularys_row(verifier):
    """Greedy drafts read the draft vocabulary's logits alone (`pick_greedy`): the same tokens and confidence as the
    argmax of those logits expanded to the whole vocabulary (ties included: the rows are sorted), the proposal's
    logits are the rows' (`logit_rows`), and its log q is the expanded one's; a token outside the rows (a suffix
    row merged in) has log q = -inf, not an error."""
    from specloop.drafter.decode.proposer import Proposal
    from specloop.drafter.kinds.eagle import pick, pick_greedy
    from specloop.drafter.model.vocab import expand

    lean = LeanDecoder(verifier)
    vocab = torch.arange(0, 60, 3)
    logits = torch.randn(4, len(vocab))
    logits[1, 2] = logits[1, 5] = logits[1].max() + 1  # a tie: the lower token, as the whole row's argmax takes it
    fast, p_fast = pick_greedy(logits, vocab)
    whole = expand(logits, vocab, 60)
    token = whole.argmax(-1)  # the whole row's argmax, and the head's probability of it as the rows give it
    p_whole = (whole.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)).exp()
    assert torch.equal(fast.token, token) and int(fast.token[1]) == 6 and torch.equal(p_fast, p_whole)
    one, p_one = pick_greedy(logits, vocab, fast=True)  # in one C++ call where the kernels are built
    assert torch.equal(one.token, token) and torch.allclose(p_one, p_whole, rtol=1e-5, atol=0)
    nan = logits.clone()
    nan[2, 7] = float("nan")  # a NaN counts as the largest (torch's argmax): the ops path answers for every row
    assert torch.equal(pick_greedy(nan, vocab, fast=True)[0].token, pick_greedy(nan, vocab)[0].token)
    full, p_full = pick(logits, vocab, 60, SamplingParams(), None)  # the chain's pick: the same, its row expanded
    assert torch.equal(full.token, token) and torch.equal(p_full, p_whole) and torch.equal(full.logits, whole)
    cache, feats = prefill(lean, PROMPTS, 32, capture=(lean.num_layers - 1,))
    d = EagleDrafter(lean, trained_like(lean), vocab)
    d.start(PROMPTS, 32, VerifierView(cache, feats))
    greedy = d.propose(3, SamplingParams(), None)
    assert greedy.logit_rows is vocab and greedy.logits[0].shape == (3, len(vocab))
    expanded = Proposal(greedy.tokens, None, logits=[expand(x, vocab, 60) for x in greedy.logits])
    assert torch.allclose(greedy.logprobs(), expanded.logprobs(), atol=1e-6)
    outside = Proposal(torch.tensor([[1, 3, 59]]), None, logits=[torch.zeros(1, len(vocab))] * 3, logit_rows=vocab)
    got = outside.logprobs()[0]
    assert got[0] == float("-inf") and got[2] == float("-inf") and got[1] == pytest.approx(-float(torch.log(
        torch.tensor(float(len(vocab))))))
    assert d.propose(2, SamplingParams(temperature=1.0), torch.rand(3, 2)).logit_rows is None  # sampling: the rows
    #                                                                                     expanded, as `pick` makes them


@pytest.mark.parametrize("mode", ["w4a8", "int4"])
def test_a_quantized_heads_draft_is_one_call_with_the_bits_of_its_ops(mode):
    """On specloop's CPU kernels the head drafts in one C++ call (`kernels.head_draft`): its next feature and logits
    are, bit for bit, the head's norms, linears and SwiGLU called one by one through the same kernels, and within
    float rounding of `head_step` / `head_logits` (torch's norms); the drafts it proposes are the ops path's, and
    speculation through it is still the verifier's own greedy output. A float head keeps the ops path."""
    from specloop.drafter.model import kernels
    from specloop.drafter.model.weights.linears import linear
    from specloop.drafter.model.weights.quant import quantize_decoder

    if kernels.head_draft_op() is None:
        pytest.skip("specloop's CPU kernels are not built here")
    model = build_model(llama_config(97, 2, 128, num_attention_heads=2, num_key_value_heads=1), seed=3, init_std=0.1)
    assert EagleDrafter(LeanDecoder(model), trained_like(LeanDecoder(model)))._one_call is None  # fp32: the ops
    lean = quantize_decoder(LeanDecoder(model), mode)
    head, vocab = trained_like(lean), torch.arange(0, 97, 2)
    d = EagleDrafter(lean, head, vocab)
    assert d._one_call is not None
    w, eps = d.weights(), head.cfg.eps
    g = torch.Generator().manual_seed(1)
    z, tokens = torch.randn(3, 128, generator=g), torch.tensor([5, 17, 96])
    got_z, got_logits = d._head(z, tokens)
    e = lean.embed_tokens(tokens[:, None])[:, 0]
    norm = lambda x, i: kernels.rms_norm(x, w[i], eps)
    x = linear(torch.cat([norm(z, 0), norm(e, 1)], dim=-1), w[3])
    want_z = x + linear(kernels.silu_mul(linear(norm(x, 2), w[4])), w[5])
    assert torch.equal(got_z, want_z) and torch.equal(got_logits, linear(norm(want_z, 6), w[7]))
    ops_z = eagle_module.head_step(z, e, w, eps)
    assert torch.allclose(got_z, ops_z, rtol=1e-4, atol=1e-4)
    assert torch.allclose(got_logits, eagle_module.head_logits(ops_z, w, eps), rtol=1e-3, atol=1e-3)
    cache, feats = prefill(lean, PROMPTS, 32, capture=(lean.num_layers - 1,))
    d.start(PROMPTS, 32, VerifierView(cache, feats))
    fused = d.propose(3, SamplingParams(), None)
    d._one_call = None
    ops = d.propose(3, SamplingParams(), None)
    assert torch.equal(fused.tokens, ops.tokens)
    assert torch.allclose(fused.confidence, ops.confidence, rtol=1e-3)
    prompts = [[3, 9, 27, 81], [2, 4, 8, 16, 32, 64]]
    params = SamplingParams(max_tokens=12)
    alone = generate(lean, None, prompts, params, 0, StopRule())
    out = generate(lean, EagleDrafter(lean, head, vocab), prompts, params, 3, StopRule())
    assert [g.token_ids for g in out] == [g.token_ids for g in alone]


@pytest.mark.parametrize("k", [1, 3, None])
def test_speculation_with_the_head_reproduces_the_verifier_alone(verifier, k):
    lean = LeanDecoder(verifier)
    params = SamplingParams(max_tokens=24)
    ref = generate(lean, None, PROMPTS, params, 0, StopRule())
    out = generate(lean, EagleDrafter(lean, trained_like(lean, seed=1)), PROMPTS, params, k, StopRule())
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]


def test_a_plain_step_hands_the_head_the_verifiers_feature_and_token(verifier):
    lean = LeanDecoder(verifier)
    layer = lean.num_layers - 1
    cache, feats = prefill(lean, PROMPTS, 32, capture=(layer,))
    d = EagleDrafter(lean, trained_like(lean))
    d.start(PROMPTS, 32, VerifierView(cache, feats))
    last = torch.tensor([p[-1] for p in PROMPTS])
    before = cache.lens.clone()
    outcome = speculative_step(lean, cache, last, d, StepPlan(torch.ones(3, dtype=torch.bool), 0, SamplingParams()))
    assert torch.equal(d.last, outcome.last_tokens)
    again, _ = prefill(lean, PROMPTS, 32)  # the same step by hand: the feature at each prompt's last token
    again.lens = before.clone()
    want = lean.forward(again, last[:, None], capture=(layer,)).hidden[layer][:, 0]
    torch.testing.assert_close(d.feature, want)


def test_the_head_round_trips_and_builds_from_its_checkpoint(tmp_path, verifier):
    lean = LeanDecoder(verifier)
    head = trained_like(lean)
    head.save(tmp_path / "h", {"method": "test"})
    back = FeatureHead.load(tmp_path / "h")
    assert back.cfg == head.cfg
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), head.state_dict().values()))


def test_kinds_builds_an_eagle_drafter_and_refuses_what_does_not_fit(tmp_path, tiny_pair):
    from specloop.drafter.model.loading import load_model

    v = load_model(tiny_pair[0], dtype=torch.float32)
    untrained = build_drafter("eagle", v, None)
    assert isinstance(untrained, EagleDrafter)
    trained_like(v.lean).save(tmp_path / "e", {})
    built = build_drafter("eagle", v, tmp_path / "e")
    assert built.kind == "eagle" and built.verifier_layers == (v.lean.num_layers - 1,)
    with pytest.raises(ValueError, match="does not fit"):
        EagleDrafter(v.lean, FeatureHead(EagleConfig(hidden=v.lean.hidden_size + 16)))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "manifest.json").write_text('{"kind": "dvi"}')
    with pytest.raises(ValueError, match="not an eagle head"):
        FeatureHead.load(tmp_path / "x")


def test_an_untrained_head_is_the_same_on_every_build(verifier):
    lean = LeanDecoder(verifier)
    torch.manual_seed(1)
    a = new_head(lean).state_dict()
    torch.manual_seed(2)
    b = new_head(lean).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("vocab", [None, torch.arange(0, 60, 3)])
def test_the_compiled_chain_compiles_one_draft_for_every_depth_and_drafts_as_the_uncompiled_one(verifier, vocab):
    from torch._dynamo.testing import CompileCounter

    from specloop.drafter.kinds.eagle import draft_chain, draft_one

    lean = LeanDecoder(verifier)
    d = EagleDrafter(lean, trained_like(lean), vocab)
    g = torch.Generator().manual_seed(3)
    inputs = (torch.randn(4, lean.hidden_size, generator=g), torch.randint(0, 60, (4,), generator=g), lean.embed,
              *d.weights())
    counter = CompileCounter()
    one = torch.compile(draft_one, fullgraph=True, dynamic=False, backend=counter)
    for depth in (1, 4, 3):
        got = draft_chain(*inputs, vocab=vocab, depth=depth, vocab_size=60, eps=1e-5, one=one)
        expected = draft_chain(*inputs, vocab=vocab, depth=depth, vocab_size=60, eps=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)) and got[0].shape == (4, depth)
    assert counter.frame_count == 1  # one draft's graph, whatever the chain's length


@pytest.mark.parametrize("vocab", [None, torch.arange(0, 60, 3)])
def test_the_captured_chain_drafts_as_the_loop_does(verifier, vocab):
    # the graph backend's greedy drafts (use_chain: k_max drafts for the pool's rows, one graph) against the eager
    # loop on the same state: tokens, confidence and logits of the first k; the chain traces with no graph break
    lean = LeanDecoder(verifier)
    cache, feats = prefill(lean, PROMPTS, 32, capture=(lean.num_layers - 1,))
    d = EagleDrafter(lean, trained_like(lean), vocab)
    d.start(PROMPTS, 32, VerifierView(cache, feats))
    chained_like_the_loop(d, 3, slots=4)
    sampled = d.propose(2, SamplingParams(temperature=1.0), torch.rand(3, 2))  # sampling: the loop
    assert sampled.probs is not None
    from specloop.drafter.kinds.eagle import draft_chain

    inputs = (torch.zeros(4, lean.hidden_size), torch.zeros(4, dtype=torch.long), lean.embed, *d.weights())
    explained = torch._dynamo.explain(draft_chain)(*inputs, vocab=vocab, depth=4, vocab_size=60, eps=1e-5)
    assert explained.graph_break_count == 0
    kept = d.chain
    d.use_chain(slots=4, depth=4, compiled=False)  # the next engine of the same shape: the same capture
    assert d.chain is kept
    d.use_chain(slots=8, depth=4, compiled=False)  # another pool: captured again
    assert d.chain is not kept and d.chain is not None and len(d.chain.buffers[0]) == 8
    d.use_chain(None)
    assert d.chain is None
