"""drafter/model/graph.py: the static decode step behind the engine's graph backend (the GPU worker's step).

On the CPU the step runs uncompiled (SPECLOOP_COMPILE=0: the same function, no inductor build) except
where a test is about compiling it; tests marked for CUDA skip here (CI has no GPU)."""
from __future__ import annotations

import time

import pytest
import torch

from specloop.drafter.decode.controller import ControllerConfig
from specloop.drafter.decode.engine import Engine, generate
from specloop.drafter.decode.requests import EngineRequest, StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.graph import PREFILL_CHUNK, GraphDecoder, StaticModel, graph_ready, resolve_backend
from specloop.drafter.model.kv_cache import KVCache, prefill_rows
from specloop.drafter.model.loading import load_model
from tests.drafter_helpers import POSITIONS, PROMPT, SETTINGS, VOCAB, WARPED, sampled_counts
from tests.stats import chi2_pvalue, exact_marginals
from tests.tiny import build_model, llama_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def uncompiled(monkeypatch):
    monkeypatch.setenv("SPECLOOP_COMPILE", "0")


@pytest.fixture(scope="module")
def reference_bf16(reference_pair):
    """The reference verifier served in bf16 (where a width-dependent product would show)."""
    return load_model(reference_pair[0], dtype=torch.bfloat16)


@pytest.fixture
def compiles(monkeypatch):
    """Every step a GraphDecoder compiles from now on, counted (torch.compile's graphs, run without inductor)."""
    from torch._dynamo.testing import CompileCounter

    import specloop.drafter.model.graph as graph_module

    counter = CompileCounter()
    monkeypatch.setattr(graph_module, "compile_step",
                        lambda model, device, compiled: torch.compile(model, fullgraph=True, dynamic=False, backend=counter))
    return counter


def _pool(lean, prompts: list[list[int]], slots: int, width: int, capacity: int = 128):
    graph = GraphDecoder(lean, slots, width, compiled=False)
    cache = graph.new_cache(slots, capacity)
    prefill_rows(lean, cache, list(range(len(prompts))), prompts)
    return graph, cache


def _copy(cache: KVCache) -> KVCache:
    return KVCache([k.clone() for k in cache.keys], [v.clone() for v in cache.values], cache.lens.clone())


def _inputs(graph: GraphDecoder, cache: KVCache, tokens: torch.Tensor, n_new: torch.Tensor):
    S, W = graph.slots, graph.width
    padded = torch.zeros(S, W, dtype=torch.long)
    padded[: len(tokens), : tokens.shape[1]] = tokens
    counts, lens = torch.zeros(S, dtype=torch.long), torch.zeros(S, dtype=torch.long)
    counts[: len(n_new)], lens[: len(cache.lens)] = n_new, cache.lens
    return cache.keys, cache.values, padded, counts, lens


def test_the_static_step_traces_as_one_graph_with_no_graph_break_or_host_sync(tiny_verifier):
    # fullgraph=True makes any graph break (a .item(), a data-dependent branch, an untraceable call) an error
    lean = tiny_verifier.lean
    graph, cache = _pool(lean, [[5, 6, 7, 8], [9, 10]], slots=3, width=5)
    args = _inputs(graph, cache, torch.tensor([[11, 12, 13], [14, 0, 0]]), torch.tensor([3, 1]))
    model = StaticModel(lean)
    traced = torch.compile(model, fullgraph=True, dynamic=False, backend="eager")
    for capture, last_only in (((), False), ((0, 1), False), ((), True)):
        expected = model(*_copy_args(args), capture=capture, last_only=last_only)
        got = traced(*_copy_args(args), capture=capture, last_only=last_only)
        assert torch.equal(got[0], expected[0]) and len(got[1]) == len(capture)
        assert torch.equal(got[2], expected[0].argmax(dim=-1))  # the greedy verdict's choices, made in the step
    assert torch._dynamo.explain(model)(*_copy_args(args)).graph_break_count == 0


def test_the_regional_step_compiles_one_layer_for_every_layer_and_scores_as_the_whole_step(tiny_verifier):
    # each region traced with fullgraph=True (no break, no host sync in it); a layer is one graph whatever the
    # layer, and another model of the same shapes reuses every graph; the glue between regions changes no value
    from torch._dynamo.testing import CompileCounter

    from specloop.drafter.model.graph import PLAIN, Regions, regional_step

    lean = tiny_verifier.lean
    assert lean.num_layers > 1
    graph, cache = _pool(lean, [[5, 6, 7, 8], [9, 10]], slots=3, width=5)
    args = _inputs(graph, cache, torch.tensor([[11, 12, 13], [14, 0, 0]]), torch.tensor([3, 1]))
    counter = CompileCounter()
    torch._dynamo.reset()
    parts = Regions(*(torch.compile(f, fullgraph=True, dynamic=False, backend=counter) for f in PLAIN))
    step = regional_step(StaticModel(lean), parts)
    whole = StaticModel(lean)
    for capture in ((), (0, 1)):
        expected = whole(*_copy_args(args), capture=capture)
        got = step(*_copy_args(args), capture=capture)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1])) and len(got[1]) == len(capture)
    assert counter.frame_count == 3  # the prologue, one layer, the head: not one graph per layer
    regional_step(StaticModel(lean), parts)(*_copy_args(args))
    assert counter.frame_count == 3


def _copy_args(args):
    keys, values, *rest = args
    return [k.clone() for k in keys], [v.clone() for v in values], *rest


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_another_attention_in_the_step_scores_as_the_torch_attention_and_traces_as_one_graph(tiny_verifier, attention,
                                                                                             monkeypatch):
    # SPECLOOP_ATTENTION=flex: the same mask as a score modification in one fused kernel (on a GPU); sdpa: the mask
    # as a bias to torch's scaled_dot_product_attention (one memory-efficient attention kernel on a GPU)
    lean = tiny_verifier.lean
    graph, cache = _pool(lean, [[5, 6, 7, 8], [9, 10]], slots=3, width=5)
    args = _inputs(graph, cache, torch.tensor([[11, 12, 13], [14, 0, 0]]), torch.tensor([3, 1]))
    torch_step = StaticModel(lean)
    monkeypatch.setenv("SPECLOOP_ATTENTION", attention)
    other_step = StaticModel(lean)
    assert (torch_step.attention, other_step.attention) == ("torch", attention)
    expected = torch_step(*_copy_args(args), capture=(1,))
    got = other_step(*_copy_args(args), capture=(1,))
    real = torch.tensor([[True, True, True, False, False], [True, False, False, False, False],
                         [False] * 5])  # rows' real queries (the third row and padded queries: anything)
    assert torch.allclose(got[0][real], expected[0][real], atol=1e-4, rtol=1e-4)
    traced = torch.compile(other_step, fullgraph=True, dynamic=False, backend="eager")
    assert torch.equal(traced(*_copy_args(args))[0], other_step(*_copy_args(args))[0])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_speculation_through_another_attention_equals_plain_decoding(tiny_verifier, attention, monkeypatch):
    monkeypatch.setenv("SPECLOOP_ATTENTION", attention)
    prompts = _prompts(tiny_verifier)[:2]
    plain = _decode(tiny_verifier, None, prompts, 0, slots=2, max_tokens=12)
    drafted = _decode(tiny_verifier, build_drafter("ngram", tiny_verifier, None), prompts, 4, slots=2, max_tokens=12)
    assert drafted == plain


def test_the_static_step_scores_as_the_lean_decoder_and_writes_only_real_tokens(tiny_verifier):
    lean = tiny_verifier.lean
    graph, cache = _pool(lean, [[5, 6, 7, 8], [9, 10, 11]], slots=3, width=5)
    before, eager = _copy(cache), _copy(cache)
    rows = KVCache([k[:2] for k in cache.keys], [v[:2] for v in cache.values], cache.lens[:2].clone())  # the occupied prefix
    tokens, n_new = torch.tensor([[20, 21, 22], [23, 0, 0]]), torch.tensor([3, 1])
    out = graph.forward(rows, tokens, n_new)
    ref = lean.forward(KVCache([k[:2] for k in eager.keys], [v[:2] for v in eager.values], eager.lens[:2].clone()),
                       tokens, n_new)
    assert graph.graph_calls == 1 and torch.equal(rows.lens, torch.tensor([6, 3]))
    assert torch.allclose(out.logits[0], ref.logits[0], atol=1e-4)  # every query of the full row
    assert torch.allclose(out.logits[1, 0], ref.logits[1, 0], atol=1e-4)  # the padded row's real query
    for k_new, k_old in zip(cache.keys, before.keys):
        changed = (k_new != k_old).any(dim=(1, 3))  # [slots, capacity]: positions written
        trash = k_new.shape[2] - 1
        assert changed[0, 3:6].all() and changed[1, 2]  # the real tokens' positions
        assert not changed[0, :3].any() and not changed[0, 6:trash].any() and not changed[1, 3:trash].any()
        assert not changed[2].any() or changed[2].nonzero().flatten().tolist() == [trash]  # the empty row: trash only


@pytest.mark.parametrize("dtype, kv", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                       (torch.bfloat16, "bfloat16"),  # a GPU's cache for a bf16 model
                                       (torch.bfloat16, "float16")])  # --kv-cache-dtype float16
def test_a_verify_pass_scores_each_token_bit_for_bit_as_one_token_steps_do(tiny_pair, dtype, kv, monkeypatch):
    # the property that makes speculation exact: a token's logits do not depend on how many real queries
    # its pass had, nor on its index among them, nor on the other rows
    monkeypatch.setenv("SPECLOOP_KV_CACHE_DTYPE", kv)
    lean = load_model(tiny_pair[0], dtype=dtype).lean
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    graph, cache = _pool(lean, prompts, slots=3, width=5)
    assert cache.keys[0].dtype == (torch.float32 if kv == "auto" else getattr(torch, kv))
    _, stepwise = _pool(lean, prompts, slots=3, width=5)  # a second pool, stepped one token at a time
    block = torch.tensor([[20, 21, 22, 23], [24, 25, 26, 27]])
    verify = graph.forward(KVCache([k[:2] for k in cache.keys], [v[:2] for v in cache.values], cache.lens[:2]),
                           block, torch.tensor([4, 2]))
    rows = KVCache([k[:2] for k in stepwise.keys], [v[:2] for v in stepwise.values], stepwise.lens[:2])
    for t in range(4):
        one = graph.forward(rows, block[:, t : t + 1], torch.tensor([1, 1 if t < 2 else 0]))
        assert torch.equal(one.logits[0, 0], verify.logits[0, t])
        if t < 2:
            assert torch.equal(one.logits[1, 0], verify.logits[1, t])
    assert graph.graph_calls == 5  # every pass ran the static step


def _decode(verifier, drafter, prompts, k, backend="graph", slots=3, max_tokens=24):
    """Requests joining a running pool of `slots` rows (continuous batching), each row's greedy tokens."""
    rule = StopRule(verifier.eos_ids)
    engine = Engine(verifier.lean, drafter, slots, 256, rule, backend=backend)
    assert engine.backend == backend
    waiting = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=max_tokens + 3 * i), k) for i, p in enumerate(prompts)]
    done = {}
    while waiting or engine.running:
        take = min(len(engine.free), len(waiting))
        engine.admit(waiting[:take])
        waiting = waiting[take:]
        for u in engine.step():
            if u.generation is not None:
                done[u.id] = u.generation.token_ids
    if backend == "graph":
        assert engine.verifier.graph_calls > 0  # the steps ran the static step
    return [done[f"r{i}"] for i in range(len(prompts))]


def _prompts(verifier):
    texts = ["def main():\n    print(", "The quick brown fox", "import os\nimport sys\n\nclass",
             "Sure, here is an example of"]
    return [verifier.tokenizer.encode(t, add_special_tokens=False) for t in texts]


@pytest.mark.parametrize("kind", ["pretrained", "ngram", "eagle", "sd2", "dvi"])
def test_greedy_speculation_in_bf16_on_the_graph_backend_equals_its_plain_decoding(kind, reference_bf16, reference_pair):
    # bf16 is where a verify pass of k + 1 tokens would round otherwise than a one-token step: every step
    # of the graph backend runs at one width, so speculative output is the engine's plain output
    verifier = reference_bf16
    prompts = _prompts(verifier)
    plain = _decode(verifier, None, prompts, 0)
    drafter = build_drafter(kind, verifier, reference_pair[1] if kind in ("pretrained", "sd2") else None)
    assert _decode(verifier, drafter, prompts, None) == plain  # k auto: the controller's k changes step by step
    if kind == "pretrained":
        assert isinstance(drafter.lean, GraphDecoder) and drafter.lean.graph_calls > 0  # its LM drafts in the step too
        assert _decode(verifier, build_drafter(kind, verifier, reference_pair[1]), prompts, 4) == plain


def test_greedy_speculation_with_a_bf16_cache_equals_its_plain_decoding(reference_pair, monkeypatch):
    # a GPU's default for a bf16 model (attention.kv_dtype), on the CPU through the environment: the cache, the
    # drafter LM's cache and the eager prefills all in bf16, speculation still the engine's plain output
    monkeypatch.setenv("SPECLOOP_KV_CACHE_DTYPE", "bfloat16")
    verifier = load_model(reference_pair[0], dtype=torch.bfloat16)
    assert verifier.lean.kv_dtype == torch.bfloat16
    prompts = _prompts(verifier)
    plain = _decode(verifier, None, prompts, 0)
    for kind, path, k in (("pretrained", reference_pair[1], 4), ("ngram", None, None), ("eagle", None, 4)):
        drafter = build_drafter(kind, verifier, path)
        assert _decode(verifier, drafter, prompts, k) == plain, kind
        if kind == "pretrained":
            assert drafter.lean.kv_dtype == torch.bfloat16


def test_sampled_output_on_the_graph_backend_is_distributed_as_the_verifiers(monkeypatch):
    tiny = (build_model(llama_config(VOCAB, 2, 32), seed=11, init_std=0.6),
            build_model(llama_config(VOCAB, 1, 32), seed=12, init_std=0.6))  # test_speculative's pair
    params = SETTINGS[WARPED]
    exact = exact_marginals(tiny[0], PROMPT, POSITIONS, params)
    monkeypatch.setenv("SPECLOOP_BACKEND", "graph")
    counts = sampled_counts(tiny, params, "pretrained", 2)
    pvalues = [chi2_pvalue(counts[t], exact[t]) for t in range(POSITIONS)]
    assert min(pvalues) > 0.01, pvalues


def test_warming_builds_the_graph_the_steps_then_run_and_prefills_never_run_it(tiny_verifier, compiles):
    engine = Engine(tiny_verifier.lean, None, 2, 128, StopRule(tiny_verifier.eos_ids), backend="graph", compile_graphs=True)
    built = compiles.frame_count
    assert built == 1  # the verifier alone: one capture set
    engine.admit([EngineRequest("a", [5, 6, 7], SamplingParams(max_tokens=6), 0),
                  EngineRequest("b", [8, 9], SamplingParams(max_tokens=6), 0)])  # short prompts: prefills as wide as W
    assert engine.verifier.graph_calls == 0  # prefills run the LeanDecoder's own passes
    while engine.running:
        engine.step()
    assert engine.verifier.graph_calls > 0 and compiles.frame_count == built  # no step compiled anything new
    again = Engine(tiny_verifier.lean, None, 2, 150, StopRule(tiny_verifier.eos_ids), backend="graph", compile_graphs=True)
    assert again.verifier is engine.verifier and compiles.frame_count == built  # a pool of the same size: no recompile


def test_an_engine_with_a_drafter_runs_one_verifier_graph_for_plain_and_drafting_steps(tiny_pair, compiles):
    # plain steps ask no layers, drafting and followed steps the eagle head's: one graph captures them for both
    # (`GraphDecoder._capture_set`), one compile at warm-up, and greedy output stays the verifier alone's
    verifier = load_model(tiny_pair[0])  # a decoder no earlier engine wrapped
    drafter = build_drafter("eagle", verifier, None)
    engine = Engine(verifier.lean, drafter, 2, 128, StopRule(verifier.eos_ids), backend="graph", compile_graphs=True)
    assert compiles.frame_count == 1 and drafter.verifier_layers  # the step with the head's layers, alone
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    engine.admit([EngineRequest(f"r{i}", p, SamplingParams(max_tokens=10), k) for i, (p, k) in
                  enumerate(zip(prompts, (0, 3)))])  # a plain row and a drafting one
    done = {}
    while engine.running:
        done.update({u.id: u.generation.token_ids for u in engine.step() if u.generation is not None})
    assert compiles.frame_count == 1
    alone = [generate(verifier.lean, None, [p], SamplingParams(max_tokens=10), 0, StopRule(verifier.eos_ids),
                      backend="graph")[0].token_ids for p in prompts]
    assert [done["r0"], done["r1"]] == alone


def _eager_rows(lean, prompts, capture, tail, capacity=256):
    cache = lean.new_cache(len(prompts), capacity)
    return cache, prefill_rows(lean, cache, list(range(len(prompts))), prompts, capture, tail)


def test_a_chunked_prefill_holds_the_eager_prefills_kv_and_features(tiny_verifier, monkeypatch):
    # the GPU's prefill (captured chunks of PREFILL_CHUNK tokens on a 1-row scratch pool, then a copy into the
    # row): what a prompt leaves in its row and the features a drafter reads are the eager passes', to rounding
    monkeypatch.setenv("SPECLOOP_PREFILL", "graph")
    lean = tiny_verifier.lean
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (PREFILL_CHUNK + 3, 1, 12, 2 * PREFILL_CHUNK + 1)]
    graph = GraphDecoder(lean, 5, 5, compiled=False)
    assert graph.chunked_prefill
    cache = graph.new_cache(5, 256)
    slots, layers = [4, 0, 2, 1], (0, 1)
    before = graph.prefiller().graph_calls  # one prefiller per model: other tests' calls count there too
    features, recent, lens = prefill_rows(graph, cache, slots, prompts, layers, tail=6)
    eager, (e_features, e_recent, e_lens) = _eager_rows(lean, prompts, layers, 6)
    assert graph.prefiller().graph_calls - before == 2 + 1 + 2  # chunks of each prompt but its last: 66, 0, 11, 128
    assert torch.equal(lens, e_lens) and cache.lens.tolist() == [0, 128, 11, 0, 66]
    for b, (slot, prompt) in enumerate(zip(slots, prompts)):
        n = len(prompt) - 1
        for got, want in zip(cache.keys + cache.values, eager.keys + eager.values):
            assert torch.allclose(got[slot, :, :n], want[b, :, :n], atol=1e-5, rtol=1e-4)
        for i in layers:
            assert torch.allclose(features[i][b], e_features[i][b], atol=1e-5, rtol=1e-4)
            assert torch.allclose(recent[i][b], e_recent[i][b], atol=1e-5, rtol=1e-4)  # a tail across two chunks
    assert not features[0][1].any()  # a one-token prompt: nothing prefilled, no features


def test_identical_prompts_prefill_once_in_chunks_and_every_row_holds_their_kv(tiny_verifier, monkeypatch):
    monkeypatch.setenv("SPECLOOP_PREFILL", "graph")
    graph = GraphDecoder(tiny_verifier.lean, 3, 5, compiled=False)
    prompt = list(range(20, 20 + PREFILL_CHUNK + 10))
    cache = graph.new_cache(3, 256)
    before = graph.prefiller().graph_calls
    features, _, _ = prefill_rows(graph, cache, [2, 0, 1], [prompt, [5, 6, 7], prompt], (1,))
    assert graph.prefiller().graph_calls - before == 2 + 1  # the repeated prompt's two chunks once, and [5, 6]
    n = len(prompt) - 1
    assert all(torch.equal(t[2, :, :n], t[1, :, :n]) for t in cache.keys + cache.values)
    assert torch.equal(features[1][0], features[1][2]) and cache.lens.tolist() == [2, n, n]


def test_a_prompts_chunked_prefill_does_not_depend_on_what_was_prefilled_before_or_beside_it(tiny_verifier,
                                                                                             monkeypatch):
    monkeypatch.setenv("SPECLOOP_PREFILL", "graph")
    graph = GraphDecoder(tiny_verifier.lean, 3, 5, compiled=False)
    long_one, short = list(range(10, 10 + 2 * PREFILL_CHUNK)), [7, 8, 9, 10, 11]
    cache = graph.new_cache(3, 256)
    prefill_rows(graph, cache, [0, 1], [long_one, short])  # the scratch pool now holds long_one's tail beyond 4
    alone = graph.new_cache(3, 256)
    prefill_rows(graph, alone, [2], [short])
    for a, b in zip(cache.keys + cache.values, alone.keys + alone.values):
        assert torch.equal(a[1, :, :4], b[2, :, :4])


def test_the_chunked_prefill_is_the_default_where_steps_replay_graphs_and_the_environment_chooses(tiny_verifier,
                                                                                                  monkeypatch):
    monkeypatch.delenv("SPECLOOP_PREFILL", raising=False)
    assert GraphDecoder(tiny_verifier.lean, 2, 5, compiled=False, direct=True).chunked_prefill  # a GPU's step
    assert not GraphDecoder(tiny_verifier.lean, 2, 5, compiled=False, direct=False).chunked_prefill
    monkeypatch.setenv("SPECLOOP_PREFILL", "eager")
    assert not GraphDecoder(tiny_verifier.lean, 2, 5, compiled=False, direct=True).chunked_prefill
    monkeypatch.setenv("SPECLOOP_PREFILL", "chunks")
    with pytest.raises(ValueError, match="SPECLOOP_PREFILL must be one of auto, eager, graph, got 'chunks'"):
        GraphDecoder(tiny_verifier.lean, 2, 5, compiled=False).chunked_prefill


@pytest.mark.parametrize("kind", ["pretrained", "eagle"])
def test_speculation_over_chunked_prefills_equals_its_plain_decoding_and_warming_built_the_prefill(
        kind, reference_bf16, reference_pair, monkeypatch, compiles):
    monkeypatch.setenv("SPECLOOP_PREFILL", "graph")
    verifier = reference_bf16
    prompts = _prompts(verifier)
    plain = _decode(verifier, None, prompts, 0)
    drafter = build_drafter(kind, verifier, reference_pair[1] if kind == "pretrained" else None)
    engine = Engine(verifier.lean, drafter, 3, 256, StopRule(verifier.eos_ids), backend="graph", compile_graphs=True)
    built = compiles.frame_count
    prefills = engine.verifier.prefiller().graph_calls  # one prefiller per model: earlier tests' calls count there
    engine.admit([EngineRequest("a", prompts[0], SamplingParams(max_tokens=8), 4)])
    while engine.running:
        engine.step()
    assert compiles.frame_count == built  # warming built the prefills' steps (verifier's and drafter LM's) too
    assert engine.verifier.prefiller().graph_calls == prefills + 1
    if kind == "pretrained":
        assert drafter.lean.prefiller().graph_calls == 1  # the drafter LM's prompts prefill in chunks too
    assert _decode(verifier, build_drafter(kind, verifier, reference_pair[1] if kind == "pretrained" else None),
                   prompts, 4) == plain


def test_a_drafter_runs_as_each_engine_it_serves_needs(tiny_verifier, tiny_pair):
    drafter = build_drafter("pretrained", tiny_verifier, tiny_pair[1])
    rule = StopRule(tiny_verifier.eos_ids)
    Engine(tiny_verifier.lean, drafter, 2, 128, rule, backend="graph")
    assert isinstance(drafter.lean, GraphDecoder) and drafter.lean.slots == 2
    Engine(tiny_verifier.lean, drafter, 3, 128, rule, backend="graph")
    assert drafter.lean.slots == 3  # its LM at this engine's pool size
    Engine(tiny_verifier.lean, drafter, 3, 128, rule, backend="eager")
    assert not isinstance(drafter.lean, GraphDecoder)  # and its own passes on the eager backend


def test_a_draft_length_beyond_the_steps_width_is_refused_before_it_takes_a_slot(tiny_verifier, tiny_pair):
    drafter = build_drafter("pretrained", tiny_verifier, tiny_pair[1])
    engine = Engine(tiny_verifier.lean, drafter, 2, 128, StopRule(tiny_verifier.eos_ids), backend="graph")
    with pytest.raises(ValueError, match="exceeds the graph step's 4 drafts"):
        engine.admit([EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=4), 6)])
    assert engine.running == 0


@pytest.mark.parametrize("backend", ["graph", "eager"])
def test_only_the_eager_backend_cuts_drafts_by_confidence_or_expects_wider_verify_passes_to_cost_more(backend, tiny_verifier):
    # the graph step verifies at one width whatever it verifies: a cut saves nothing there, loses accepted drafts
    # and would make the host wait for the drafts' confidence between drafting and the verify pass
    engine = Engine(tiny_verifier.lean, build_drafter("eagle", tiny_verifier, None), 2, 128,
                    StopRule(tiny_verifier.eos_ids), backend=backend)
    engine.admit([EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=4), None)])
    plan = engine._plan()
    assert plan is not None and plan.choice is not None  # an auto row: the controller chose
    assert plan.confidence_cut == (backend == "eager")
    default = ControllerConfig().prior_verify_slope  # and its cost model's prior knows the one width
    assert engine.controller.cfg.prior_verify_slope == (0.0 if backend == "graph" else default) and default > 0


def test_auto_is_eager_on_the_cpu_and_quantized_weights_never_run_the_graph_step(tiny_pair):
    assert resolve_backend(None, torch.device("cpu")) == "eager"
    assert resolve_backend("auto", torch.device("cuda")) == "graph"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("fast", torch.device("cpu"))
    int8 = load_model(tiny_pair[0], weights="int8")
    assert graph_ready(int8.lean) is not None
    with pytest.raises(ValueError, match="backend graph: weights served as int8"):
        Engine(int8.lean, None, 1, 64, StopRule(int8.eos_ids), backend="graph")


@pytest.mark.parametrize("attention", ["torch", "sdpa"])
def test_the_compiled_step_keeps_speculation_exact(tiny_verifier, attention, monkeypatch):
    # inductor's build of the step on the CPU (on CUDA the same build is then captured as a CUDA graph):
    # its kernels are not the uncompiled step's (with sdpa: inductor's own flash-attention template), and
    # speculation still equals plain decoding through them
    monkeypatch.setenv("SPECLOOP_COMPILE", "1")
    monkeypatch.setenv("SPECLOOP_ATTENTION", attention)
    prompts = _prompts(tiny_verifier)[:2]
    t0 = time.perf_counter()
    plain = _decode(tiny_verifier, None, prompts, 0, slots=2, max_tokens=12)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    drafted = _decode(tiny_verifier, build_drafter("ngram", tiny_verifier, None), prompts, 4, slots=2, max_tokens=12)
    print(f"compiled step: cold {cold:.1f} s, again (inductor's cache) {time.perf_counter() - t0:.1f} s")
    assert drafted == plain


@cuda
def test_on_cuda_the_default_serves_bf16_through_the_graph_step_and_speculation_is_exact(reference_pair):
    verifier = load_model(reference_pair[0], device=torch.device("cuda"), weights="bf16")
    assert verifier.lean.dtype == torch.bfloat16
    prompts = _prompts(verifier)
    plain = _decode(verifier, None, prompts, 0)
    # drafts made on the device (pretrained, the eagle chain) and on the host (n-gram: the block put together and
    # judged there, the verifier's choices read back)
    for kind, path in (("pretrained", reference_pair[1]), ("ngram", None), ("eagle", None)):
        assert _decode(verifier, build_drafter(kind, verifier, path), prompts, 4) == plain, kind


@pytest.mark.parametrize("kind", ["pretrained", "sd2", "eagle"])
def test_replayed_graphs_decode_as_the_step_called_directly(kind, reference_pair, monkeypatch):
    # the buffers around a captured graph (padded tokens, counts and lengths in one copy, SD²'s biases, the
    # outputs a replay overwrites): on the CPU a "replay" re-runs the step into the first call's outputs.
    # Outputs are lossless whatever the drafts: the drafts themselves are compared
    import specloop.drafter.model.graph as graph_module

    def run(direct: bool):
        monkeypatch.setattr(graph_module, "direct_capture", lambda device, compiled: direct)
        verifier = load_model(reference_pair[0])  # a decoder no earlier engine wrapped
        path = reference_pair[1] if kind in ("pretrained", "sd2") else None
        drafter = _steered(build_drafter(kind, verifier, path))
        drafts = []
        propose = type(drafter).__dict__.get("_unspied", type(drafter).propose)

        def spied(self, *args):
            proposal = propose(self, *args)
            drafts.append(proposal.tokens.tolist())
            return proposal
        monkeypatch.setattr(type(drafter), "_unspied", propose, raising=False)
        monkeypatch.setattr(type(drafter), "propose", spied)  # on the class: the engine drafts through narrowed copies
        out = _decode(verifier, drafter, _prompts(verifier), 3)  # k fixed: every step drafts
        # the engine's step; where graphs replay, prompts also prefill through a 1-row prefiller (captured too)
        steps = [g for g in verifier.lean._graph_decoders.values() if g.width != PREFILL_CHUNK]
        assert len(verifier.lean._graph_decoders) == 1 + direct and len(steps) == 1
        assert steps[0].direct == direct and (steps[0].captures >= 1) == direct
        return out, drafts, drafter

    (called, drafted, eager), (replayed, redrafted, drafter) = run(False), run(True)
    assert replayed == called and redrafted == drafted
    if kind != "eagle":  # its LM's last-token step (warmed), and its greedy drafts as one chain of k = 3 passes
        assert drafter.lean.direct and drafter.lean.captures == 2
        assert any(key[:2] == ("chain", 3) for key in drafter.lean._graphs_of(drafter.lean._pool(drafter.cache)))
        assert eager.lean.draft_chain(eager.cache, torch.zeros(3, 1, dtype=torch.long), torch.ones(3), 3) is None
    else:  # the head's greedy drafts: one captured chain of k_max drafts, against the eager loop
        assert eager.chain is None and drafter.chain is not None
        assert drafter.chain.buffers[0].shape[0] == 3  # the engine's slots (_decode: 3)


def test_an_eagle_head_in_a_mix_of_speculators_drafts_through_its_chain_on_the_graph_backend(tiny_pair, monkeypatch):
    # the served default: the eagle head with suffix decoding beside it (drafter/kinds/mix.py)
    import specloop.drafter.model.graph as graph_module

    monkeypatch.setattr(graph_module, "direct_capture", lambda device, compiled: True)
    tiny_verifier = load_model(tiny_pair[0])  # a decoder no earlier engine wrapped: its graph steps replay
    mix = build_drafter("eagle", tiny_verifier, None, speculators=("suffix",))
    Engine(tiny_verifier.lean, mix, 2, 128, StopRule(tiny_verifier.eos_ids), backend="graph")
    assert mix.members["adaptive"].chain is not None and mix.members["adaptive"].chain.buffers[0].shape[0] == 2
    prompts = _prompts(tiny_verifier)
    assert _decode(tiny_verifier, mix, prompts, 4) == _decode(tiny_verifier, None, prompts, 0)  # lossless through it
    Engine(tiny_verifier.lean, mix, 2, 128, StopRule(tiny_verifier.eos_ids), backend="eager")
    assert mix.members["adaptive"].chain is None  # the eager loop


def _steered(drafter):
    """An SD² drafter with non-zero steering (untrained, W_s = 0: its biases would be zeros), else as given."""
    if getattr(drafter, "steering", None) is not None:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in drafter.steering.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return drafter


def test_a_new_engine_reuses_a_free_pool_and_its_graphs(tiny_pair, monkeypatch):
    import gc

    import specloop.drafter.model.graph as graph_module

    monkeypatch.setattr(graph_module, "direct_capture", lambda device, compiled: True)
    verifier = load_model(tiny_pair[0])  # a decoder no earlier engine wrapped
    rule = StopRule(verifier.eos_ids)
    first = Engine(verifier.lean, None, 2, 128, rule, backend="graph")
    graph = first.verifier
    assert graph.direct and graph.captures == 1  # warmed: the verifier alone, one capture set
    pool = first.cache.keys[0]
    first.admit([EngineRequest("a", [5, 6, 7], SamplingParams(max_tokens=4), 0)])
    while first.running:
        first.step()
    beside = Engine(verifier.lean, None, 2, 128, rule, backend="graph")
    assert beside.cache.keys[0] is not pool and graph.captures == 2  # the first engine still holds its pool
    del first, beside
    gc.collect()
    again = Engine(verifier.lean, None, 2, 128, rule, backend="graph")
    assert again.cache.keys[0] is pool and graph.captures == 2  # a free pool, and its graph, reused
    assert all(int(t.abs().sum()) == 0 for t in again.cache.keys + again.cache.values)  # handed over zeroed
    again.close()  # released while the engine object lives on (generate() closes its engine)
    assert Engine(verifier.lean, None, 2, 128, rule, backend="graph").cache.keys[0] is pool
