import pytest
import torch

from specloop.drafter.model.architecture import UnsupportedModel
from specloop.drafter.model.attention import KEY_BLOCK
from specloop.drafter.model.decoder import LeanDecoder
from tests.tiny import build_model, llama_config


def _ref_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_lean_forward_matches_transformers_logits(arch):
    model = build_model(llama_config(97, 2, 64, arch), seed=0, init_std=0.1)
    lean = LeanDecoder(model)
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = lean.new_cache(1, 32)
    out = lean.forward(cache, torch.tensor([ids])).logits[0]
    torch.testing.assert_close(out, _ref_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert int(cache.lens[0]) == 12


def test_incremental_decoding_matches_full_forward():
    model = build_model(llama_config(97, 2, 64), seed=1, init_std=0.1)
    lean = LeanDecoder(model)
    ids = list(range(3, 23))
    cache = lean.new_cache(1, 32)
    lean.forward(cache, torch.tensor([ids[:8]]))
    step_logits = [lean.forward(cache, torch.tensor([[t]])).logits[0, 0] for t in ids[8:]]
    full = _ref_logits(model, ids)[8:]
    torch.testing.assert_close(torch.stack(step_logits), full, atol=1e-4, rtol=1e-4)


def test_rollback_reuses_the_accepted_prefix_without_recomputing():
    model = build_model(llama_config(97, 2, 64), seed=2, init_std=0.1)
    lean = LeanDecoder(model)
    cache = lean.new_cache(1, 32)
    lean.forward(cache, torch.tensor([[5, 6, 7, 8]]))
    lean.forward(cache, torch.tensor([[50, 51, 52]]))  # a rejected block
    cache.lens = torch.tensor([5])  # keep 5, 6, 7, 8, 50
    out = lean.forward(cache, torch.tensor([[9, 10]])).logits[0]
    torch.testing.assert_close(out, _ref_logits(model, [5, 6, 7, 8, 50, 9, 10])[-2:], atol=1e-4, rtol=1e-4)


def test_ragged_batch_rows_match_single_row_results():
    model = build_model(llama_config(97, 2, 64), seed=3, init_std=0.1)
    lean = LeanDecoder(model)
    rows = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    cache = lean.new_cache(3, 32)
    padded = torch.tensor([r + [0] * (5 - len(r)) for r in rows])
    out = lean.forward(cache, padded, n_new=torch.tensor([5, 2, 3]), last_only=True).logits[:, 0]
    assert cache.lens.tolist() == [5, 2, 3]
    nxt = lean.forward(cache, torch.tensor([[1, 2], [1, 2], [1, 2]])).logits
    for b, r in enumerate(rows):
        ref = _ref_logits(model, r + [1, 2])
        torch.testing.assert_close(out[b], ref[len(r) - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(nxt[b], ref[-2:], atol=1e-4, rtol=1e-4)


def test_capture_returns_hidden_states_of_requested_layers():
    model = build_model(llama_config(97, 3, 64), seed=4, init_std=0.1)
    lean = LeanDecoder(model)
    ids = [3, 4, 5, 6]
    out = lean.forward(lean.new_cache(1, 8), torch.tensor([ids]), capture=(0, 2))
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden[0], ref[1], atol=1e-4, rtol=1e-4)
    assert set(out.hidden) == {0, 2}


def test_full_cache_is_refused_with_a_clear_error():
    lean = LeanDecoder(build_model(llama_config(97, 1, 32), seed=5))
    cache = lean.new_cache(1, 4)
    assert cache.capacity == KEY_BLOCK  # whole key blocks
    with pytest.raises(ValueError, match="full"):
        lean.forward(cache, torch.tensor([list(range(1, KEY_BLOCK + 2))]))


def test_non_swiglu_models_are_refused():
    model = build_model(llama_config(97, 1, 32, hidden_act="gelu"), seed=6)
    with pytest.raises(UnsupportedModel, match="SwiGLU"):
        LeanDecoder(model)


def _prefilled(lean, histories, capacity=512):
    """A cache holding every history, each prefilled alone as serving does (`prefill` keeps a prompt's
    last token for the first step; the 0 appended here is that token)."""
    from specloop.drafter.model.kv_cache import prefill

    return prefill(lean, [h + [0] for h in histories], capacity)[0]


@pytest.mark.parametrize("mode,attention", [("fp32", "kernels"), ("bf16", "kernels"), ("int8", "kernels"),
                                            ("int4", "kernels"), ("w4a8", "kernels"), ("fp32", "reference"),
                                            ("int4", "reference")])
def test_verify_pass_is_bit_identical_to_one_token_steps(mode, attention):
    """One call over T tokens (a verify pass), for ragged batches of 1, 3 and 8 rows, scores every token
    bit for bit as that row alone decoding one token at a time does (and a ragged batched prefill
    writes every row's KV as its own prefill would): every weight mode, T = 1..9, contexts spanning
    several key blocks."""
    from specloop.drafter.model.weights.quant import quantize_decoder

    model = build_model(llama_config(97, 2, 128, num_attention_heads=2, num_key_value_heads=1), seed=5, init_std=0.1)
    lean = LeanDecoder(model)
    if attention == "reference":  # the eager exact_attention path (SPECLOOP_KERNELS=stock, no compiler)
        lean.fused = False
    if mode != "fp32":
        quantize_decoder(lean, mode)
    g = torch.Generator().manual_seed(0)
    for B in (1, 3, 8):
        lens = torch.randint(20, 300, (B,), generator=g).tolist()
        histories = [torch.randint(1, 97, (n,), generator=g).tolist() for n in lens]
        alone = [_prefilled(lean, [h]) for h in histories]
        for T in range(1, 10):
            new = torch.randint(1, 97, (B, T), generator=g)
            batched = _prefilled(lean, histories)
            out = lean.forward(batched, new).logits
            for b in range(B):
                cache = alone[b]
                cache.lens = torch.tensor([lens[b]])
                steps = torch.stack([lean.forward(cache, new[b : b + 1, t : t + 1]).logits[0, 0] for t in range(T)])
                assert torch.equal(steps, out[b]), (mode, B, T, b, float((steps - out[b]).abs().max()))


@pytest.mark.parametrize("mode", ["w4a8", "int4"])
def test_runs_of_layers_in_one_call_are_the_layer_by_layer_bits_with_the_captured_layers(mode):
    """run_layers calls the compiled stack once a run of layers (`LeanDecoder._stack`; runs end at the captured
    layers): the logits, the captured residual streams and the KV it writes equal one call a layer, bit for bit
    (w4a8: each layer in one parallel region; int4: step by step), and a norm replaced afterwards is read too."""
    from specloop.drafter.model.weights.quant import quantize_decoder

    model = build_model(llama_config(97, 4, 128, num_attention_heads=2, num_key_value_heads=1), seed=6, init_std=0.1)
    lean = LeanDecoder(model)
    quantize_decoder(lean, mode)
    if lean._stack() is None:
        pytest.skip("specloop kernels not built on this machine")
    tokens = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(2))

    def run(stacked: bool):
        if not stacked:
            lean._stack = lambda: None  # one call a layer from Python
        cache = lean.new_cache(2, 64)
        lean.forward(cache, tokens[:, :6])
        out = lean.forward(cache, tokens[:, 6:], capture=(0, 2))
        if not stacked:
            del lean._stack
        return out, cache

    def same(a, b):
        (out, cache), (ref, ref_cache) = a, b
        return (torch.equal(out.logits, ref.logits) and set(out.hidden) == set(ref.hidden) == {0, 2}
                and all(torch.equal(out.hidden[i], ref.hidden[i]) for i in (0, 2))
                and all(torch.equal(x, y) for x, y in zip(cache.keys + cache.values, ref_cache.keys + ref_cache.values)))

    first = run(True)
    assert same(first, run(False)) and not torch.equal(first[0].hidden[0], first[0].hidden[2])
    lean.layers[1].in_norm = lean.layers[1].in_norm * 1.5  # a new tensor: the stack is built again
    again = run(True)
    assert not torch.equal(again[0].logits, first[0].logits) and same(again, run(False))
    stack = lean._stack()
    assert lean._stack() is stack  # nothing assigned: the same stack, its key read without the layers' objects
    lean.layers = lean.layers[:3]  # a new list: built again, over the layers it holds
    assert lean._stack() is not stack and same(run(True), run(False))


def test_a_run_of_layers_from_a_second_thread_gives_the_main_threads_bits():
    """A worker decodes on a thread of its own after its main thread loaded (and ran) the model: two OpenMP masters,
    on which libgomp's own barriers would only sleep and wake. The stack's region meets at barriers of its own;
    whichever thread runs it, with 1 or 2 threads, the logits and the KV are the same bits."""
    import threading

    from specloop.drafter.model.weights.quant import quantize_decoder

    model = build_model(llama_config(97, 4, 128, num_attention_heads=2, num_key_value_heads=1), seed=7, init_std=0.1)
    lean = LeanDecoder(model)
    quantize_decoder(lean, "w4a8")
    if lean._stack() is None:
        pytest.skip("specloop kernels not built on this machine")
    tokens = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(3))

    def run():
        cache = lean.new_cache(2, 64)
        lean.forward(cache, tokens[:, :6])
        return lean.forward(cache, tokens[:, 6:]).logits, cache.keys + cache.values

    threads = torch.get_num_threads()
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            main = run()
            got: list = []
            worker = threading.Thread(target=lambda: got.append(run()))
            worker.start()
            worker.join(timeout=60)
            assert not worker.is_alive() and got  # no barrier left waiting
            logits, kv = got[0]
            assert torch.equal(logits, main[0]) and all(torch.equal(a, b) for a, b in zip(kv, main[1]))
    finally:
        torch.set_num_threads(threads)


def _cut(lean, tokens: list[int], cuts: list[int], capacity: int = 512):
    """A one-row cache prefilled with `tokens` in passes cut at `cuts`, and the last pass's last logits."""
    cache = lean.new_cache(1, capacity)
    bounds = [0, *cuts, len(tokens)]
    with torch.inference_mode():
        for a, b in zip(bounds, bounds[1:]):
            out = lean.forward(cache, torch.tensor([tokens[a:b]]), last_only=True, prefill=True)
    return cache, out.logits


@pytest.mark.parametrize("mode", ["w4a8", "int8", "int4"])
def test_with_its_own_kernels_end_to_end_a_prompts_kv_is_the_same_bits_however_its_prefill_is_cut(mode):
    # rows_alike: every position computed alike whatever pass computes it, short passes (the decode-shaped path of
    # float weights) and long ones alike; the prefix cache prefills in one pass where it holds
    from specloop.drafter.model.weights.quant import quantize_decoder

    model = build_model(llama_config(97, 2, 128, num_attention_heads=2, num_key_value_heads=1), seed=5, init_std=0.1)
    lean = LeanDecoder(model)
    assert not lean.rows_alike  # fp32: the BLAS rounds a row by its product's shape
    quantize_decoder(lean, mode)
    assert lean.rows_alike
    tokens = torch.randint(1, 97, (170,), generator=torch.Generator().manual_seed(1)).tolist()
    whole, logits = _cut(lean, tokens, [])
    for cuts in ([32, 64, 96, 128], [5, 9, 40], [1, 2, 3, 100, 150], list(range(1, 30))):
        cache, got = _cut(lean, tokens, cuts)
        assert torch.equal(got, logits), cuts
        for a, b in zip(whole.keys + whole.values, cache.keys + cache.values):
            assert torch.equal(a[0, :, :170], b[0, :, :170]), cuts
    lean.fused = False  # torch's ops (SPECLOOP_KERNELS=stock): not claimed
    assert not lean.rows_alike


def test_exact_attention_ignores_appended_key_blocks_and_the_number_of_queries():
    """The attention kernel alone: a query attended with L whole key blocks equals the same query among
    398 others attended with more blocks (a long prefill, which goes in query chunks, and where the BLAS
    would split one long reduction over keys differently)."""
    from specloop.drafter.model.attention import exact_attention

    torch.manual_seed(0)
    B, Hkv, rep, D, T = 4, 2, 2, 64, 398
    kc, vc = torch.randn(B, Hkv, 512, D), torch.randn(B, Hkv, 512, D)
    q = torch.randn(B, T, Hkv * rep, D)
    pos = torch.arange(T)[None].expand(B, T) + 10

    def hidden(p):
        L = -(-(int(p.max()) + 1) // KEY_BLOCK) * KEY_BLOCK
        return torch.arange(L) > p[:, None, :, None, None]  # [B, 1, T, 1, L]

    every = exact_attention(q, kc, vc, hidden(pos), 0.125)
    for t in (0, 53, 120, 300, 397):
        assert torch.equal(exact_attention(q[:, t : t + 1], kc, vc, hidden(pos[:, t : t + 1]), 0.125)[:, 0], every[:, t])


def test_a_wide_prefill_attends_as_the_exact_form_does_to_rounding():
    """`attend_wide` (a prefill on a GPU: one product over every query) computes what `exact_attention` does,
    to fp32 rounding, with grouped heads in the same order; a decoder on the CPU never takes it."""
    from specloop.drafter.model.attention import attend_wide, exact_attention

    torch.manual_seed(1)
    B, Hkv, rep, D, T = 2, 2, 3, 32, 40
    kc, vc = torch.randn(B, Hkv, 128, D), torch.randn(B, Hkv, 128, D)
    q = torch.randn(B, T, Hkv * rep, D)
    pos = torch.arange(T)[None].expand(B, T) + torch.tensor([[0], [30]])
    hidden = torch.arange(128) > pos[:, None, :, None, None]
    exact = exact_attention(q, kc, vc, hidden, 0.125)
    assert torch.allclose(attend_wide(q, kc, vc, hidden, 0.125), exact, rtol=1e-5, atol=1e-6)
    assert torch.allclose(exact_attention(q, kc, vc, hidden, 0.125, wide=True), exact, rtol=1e-5, atol=1e-6)
    lean = LeanDecoder(build_model(llama_config(64, 2, 32), seed=0))
    assert not lean.positions(lean.new_cache(1, 64), 4, wide=True).wide  # the CPU keeps the exact form


def test_the_rope_tables_are_computed_on_one_thread_and_the_thread_count_restored():
    """The first parallel cos of a process gave other bits in about one process in five (bench/README.md section
    46), and every key and sampled token after them with it: the tables are computed on one thread, whose bits are
    what the model's rotary module gives a forward's few positions. The caller's thread count comes back."""
    model = build_model(llama_config(97, 2, 64, "llama"), seed=0, init_std=0.1)
    seen: list[int] = []
    rotary = model.model.rotary_emb

    def spy(x, pos):
        seen.append(torch.get_num_threads())
        return rotary(x, pos)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lean = LeanDecoder(model)
        cos, sin = lean._rope_tables(spy, 4096)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with torch.no_grad():  # a forward's positions, as transformers computes them: the same bits
        ref_cos, ref_sin = rotary(torch.zeros(1), torch.arange(4096)[None])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_a_w8a8_lm_head_finds_the_greedy_choices_in_its_own_call():
    """`forward(choose=True)` with specloop's w8a8 LM head (the fetched pair's: `OwnW8A8Weight`) returns each
    position's argmax beside the logits (`ForwardOut.choices`), the logits' own argmax, and the same logits as
    without; a head that cannot (a float one), or choose=False, leaves choices None."""
    from specloop.drafter.decode.sampling import argmax
    from specloop.drafter.model import kernels
    from specloop.drafter.model.weights.own_linears import OwnW8A8Weight
    from specloop.drafter.model.weights.quant import quantize_decoder

    if not kernels.available():
        pytest.skip("specloop's CPU kernels are not built here")
    model = build_model(llama_config(97, 2, 128, num_attention_heads=2, num_key_value_heads=1), seed=7, init_std=0.1)
    float_head = LeanDecoder(model)
    lean = quantize_decoder(LeanDecoder(model), "w4a8")
    w = model.lm_head.weight.detach().float()
    d = (w.view(97, 4, 32).abs().amax(-1) / 127).half().float().clamp(min=1e-4)
    q = (w.view(97, 4, 32) / d[..., None]).round().clamp(-127, 127).to(torch.int8).view(97, 128)
    lean.lm_head = OwnW8A8Weight(q, d)
    histories = [[1, 5, 9, 2, 40], [3, 3, 3], [60, 61, 62, 63, 64, 65]]
    tokens = torch.tensor([[7, 8, 9], [10, 11, 12], [13, 14, 15]])
    chosen = lean.forward(_prefilled(lean, histories), tokens, choose=True)
    plain = lean.forward(_prefilled(lean, histories), tokens)
    assert chosen.choices is not None and chosen.choices.shape == (3, 3)
    assert torch.equal(chosen.logits, plain.logits) and plain.choices is None
    assert torch.equal(chosen.choices, argmax(chosen.logits))
    assert float_head.forward(_prefilled(float_head, histories), tokens, choose=True).choices is None
