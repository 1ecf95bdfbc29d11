"""Weight-only quantization (specloop.drafter.model.weights.quant): kernels, accuracy per mode, and losslessness against the
quantized verifier."""

import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.dvi import DVIDrafter
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.sd2 import SteeredDrafter
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.loading import load_model
from specloop.drafter.model.weights.linears import Dense, Int4Weight, Int8Weight, linear
from specloop.drafter.model.weights.modes import DTYPE_MODES, default_mode
from specloop.drafter.model.weights.quant import QuantSpec, quantize_decoder, quantize_weight
from specloop.services.prompts import encode, load_prompts
from tests.conftest import SHARED_PROMPTS
from tests.drafter_helpers import perturbed_head, perturbed_steering
from tests.quant_helpers import packed_q, q4_1_groups
from tests.tiny import build_model, llama_config

# per mode: (max |logit error| / max |logit|, argmax agreement with fp32) on the reference verifier
TOLERANCE = {"fp32": (1e-5, 1.0), "bf16": (0.03, 0.97), "int8": (0.05, 0.95), "int4": (0.3, 0.85), "w4a8": (0.3, 0.85)}
QUANTIZED = ("bf16", "int8", "int4", "w4a8")


@pytest.fixture(scope="module")
def pair(reference_pair):
    return load_model(reference_pair[0]), load_model(reference_pair[1])


@pytest.fixture(scope="module")
def prompts(pair):
    recs = load_prompts(SHARED_PROMPTS / "chat_dev.jsonl", 3) + load_prompts(SHARED_PROMPTS / "code_dev.jsonl", 3)
    return [encode(pair[0].tokenizer, r) for r in recs]


@pytest.fixture(scope="module")
def verifiers(pair):
    """mode -> the reference verifier's LeanDecoder prepared in that mode."""
    return {m: quantize_decoder(LeanDecoder(pair[0].hf), m) for m in DTYPE_MODES}


def _full_logits(lean, ids: list[int]) -> torch.Tensor:
    return lean.forward(lean.new_cache(1, len(ids)), torch.tensor([ids])).logits[0].float()


def test_unknown_modes_and_double_quantization_are_refused():
    lean = LeanDecoder(build_model(llama_config(97, 1, 32), seed=0))
    with pytest.raises(ValueError, match="unknown weight dtype mode 'fp8'.*fp32, bf16, int8, int4"):
        quantize_decoder(lean, "fp8")
    quantize_decoder(lean, "int8")
    with pytest.raises(ValueError, match="already prepared"):
        quantize_decoder(lean, "int4")
    assert default_mode() in DTYPE_MODES and default_mode("cpu", "drafter") in DTYPE_MODES
    with pytest.raises(ValueError, match="role"):
        default_mode("cpu", "teacher")


def test_weight_objects_compute_with_the_weight_they_hold():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(97, 64, generator=g), torch.randn(97, generator=g), torch.randn(2, 3, 64, generator=g)
    for lin in (Dense(w, b, torch.bfloat16), Int8Weight(w, b, torch.float32), Int8Weight(w, b, torch.bfloat16),
                Int4Weight(w, b, torch.float32, 32), Int4Weight(w, b, torch.bfloat16, 64)):  # N = 97: padded to 112
        y = linear(x, lin)
        assert y.shape == (2, 3, 97) and y.dtype == lin.act_dtype
        ref = x @ lin.dequantize().t() + b
        tol = 0.05 if lin.act_dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)
        if not isinstance(lin, Dense):  # the int kernels compute each row on its own: batch-invariant
            assert torch.equal(lin(x[1, 2:]), y[1, 2:]) and torch.equal(lin(x[:1]), y[:1])
        rel = (lin.dequantize() - w).norm() / w.norm()
        assert rel < {Dense: 0.01, Int8Weight: 0.01, Int4Weight: 0.1}[type(lin)]
    # K = 48: no int4 group size divides it, so that linear falls back to int8
    assert isinstance(quantize_weight(torch.randn(32, 48), QuantSpec("int4", torch.bfloat16)), Int8Weight)


@pytest.mark.parametrize("mode", DTYPE_MODES)
def test_logits_stay_close_to_fp32_and_mostly_agree_on_the_argmax(pair, prompts, verifiers, mode):
    ref, lean = LeanDecoder(pair[0].hf), verifiers[mode]
    max_err, tol_agree = TOLERANCE[mode]
    agree = n = 0
    for p in prompts:
        r, q = _full_logits(ref, p), _full_logits(lean, p)
        assert ((q - r).abs().max() / r.abs().max()).item() < max_err
        agree, n = agree + int((q.argmax(-1) == r.argmax(-1)).sum()), n + len(p)
    assert agree / n >= tol_agree, (mode, agree / n)
    assert lean.dtype == lean.embed.dtype
    assert lean.new_cache(1, 4).keys[0].dtype == torch.float32  # the KV cache is fp32 in every mode (specloop.drafter.model.decoder)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # a q/k/v bias (held by the weight object), per-head q/k norms
@pytest.mark.parametrize("mode", QUANTIZED)
def test_other_architectures_run_end_to_end(arch, mode):
    model = build_model(llama_config(97, 2, 64, arch), seed=0, init_std=0.1)
    ids = list(range(3, 15))
    r, q = _full_logits(LeanDecoder(model), ids), _full_logits(quantize_decoder(LeanDecoder(model), mode), ids)
    assert ((q - r).abs().max() / r.abs().max()).item() < 0.5


@pytest.mark.parametrize("mode", QUANTIZED)
def test_a_verify_pass_scores_tokens_as_one_token_decodes(verifiers, prompts, mode):
    """The T = k+1 verify pass scores tokens bit for bit as T = 1 decodes do, on the reference verifier
    (tests/drafter/model/test_decoder.py checks the construction on every weight mode, batch size and T)."""
    lean, ids = verifiers[mode], prompts[1]
    block, steps = lean.new_cache(1, 64), lean.new_cache(1, 64)
    lean.forward(block, torch.tensor([ids[:10]]))
    lean.forward(steps, torch.tensor([ids[:10]]))
    together = lean.forward(block, torch.tensor([ids[10:15]])).logits[0].float()
    one_by_one = torch.cat([lean.forward(steps, torch.tensor([[t]])).logits[0] for t in ids[10:15]]).float()
    assert torch.equal(together, one_by_one)


def test_the_head_in_place_at_quantization_is_the_one_quantized(pair):
    """A truncated draft vocabulary sets lean.lm_head to a row subset before quantizing."""
    full = LeanDecoder(pair[0].hf)
    lean = LeanDecoder(pair[0].hf)
    lean.lm_head = lean.lm_head[:100]
    quantize_decoder(lean, "int8")
    ids = [5, 6, 7, 8]
    sub = _full_logits(lean, ids)
    assert sub.shape == (4, 100)
    ref = _full_logits(full, ids)[:, :100]
    assert ((sub - ref).abs().max() / ref.abs().max()).item() < 0.05


@pytest.mark.parametrize("kind", ["pretrained", "sd2", "dvi"])
@pytest.mark.parametrize("mode", DTYPE_MODES)
def test_greedy_speculation_equals_the_quantized_verifier_alone(pair, prompts, verifiers, mode, kind):
    v, d = pair
    verifier = verifiers[mode]
    rule, params = StopRule(frozenset([v.tokenizer.eos_token_id])), SamplingParams(max_tokens=24)
    if kind == "dvi":
        drafter = DVIDrafter(verifier, perturbed_head(v.hf, layers=2))  # its head in the verifier's format
    else:
        small = quantize_decoder(LeanDecoder(d.hf), mode)  # before the SD² steering reads its dtype
        drafter = PretrainedDrafter(small) if kind == "pretrained" else SteeredDrafter(small, perturbed_steering(v.hf, d.hf))
    alone = generate(verifier, None, prompts, params, 0, rule)
    spec = generate(verifier, drafter, prompts, params, 4, rule)  # ragged batch of 6 rows
    for prompt, ref, out in zip(prompts, alone, spec):
        if out.token_ids != ref.token_ids:  # allowed only where the quantized verifier itself is tied
            t = next(i for i, (a, b) in enumerate(zip(ref.token_ids + [-1], out.token_ids + [-1])) if a != b)
            top = _full_logits(verifier, prompt + ref.token_ids[:t])[-1].topk(2).values
            assert top[0] - top[1] <= _tie(verifier, top[0]), f"{mode}/{kind}: mismatch at token {t}, not a tie"
    assert sum(g.stats.accepted for g in spec) > 0


def _tie(lean, top: torch.Tensor) -> float:
    """Logit gaps that rounding can flip: 1e-4 in fp32 (as tests/drafter/decode/test_speculative.py), else two
    units in the last place of the top logit in the activation dtype."""
    if lean.dtype == torch.float32:
        return 1e-4
    return 2 * torch.finfo(lean.dtype).eps * 2.0 ** torch.floor(torch.log2(top.abs())).item()






def test_int4_from_groups_packs_the_given_q_and_the_nearest_scales_and_zeros():
    from specloop.drafter.model.weights.groups import dequantize_groups
    from specloop.drafter.model.weights.linears import _nearest

    g = torch.Generator().manual_seed(3)
    N, K = 97, 64  # N padded to 112 inside
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    d = (torch.rand(N, K // 32, generator=g) * 0.05 + 1e-3).half()
    m = (torch.randn(N, K // 32, generator=g) * 0.3).half()
    exact = dequantize_groups(q, d, m).double()
    for act in (torch.float32, torch.bfloat16):
        w = Int4Weight.from_groups(q, d, m, act_dtype=act)
        assert w.group_size == 32 and (w.out_features, w.in_features) == (N, K)
        assert torch.equal(packed_q(w), q)  # the groups' own q, not requantized
        scale, zero = w.scales_zeros[:, :N, 0].t(), w.scales_zeros[:, :N, 1].t()
        assert torch.equal(scale, d.to(act)) and torch.equal(zero, _nearest(m.double() + 8 * d.double(), act))
        kernel = w.dequantize().double()  # (q − 8) · scale + zero, in the activation dtype
        expected = (q.double().view(N, -1, 32) - 8) * scale.double()[..., None] + zero.double()[..., None]
        eps = torch.finfo(act).eps
        torch.testing.assert_close(kernel, expected.view(N, K), rtol=eps, atol=eps * 1e-3)
        # only the scale / zero rounding separates it from q · d + m: bf16's relative precision of the group's values
        bound = eps * (exact.view(N, -1, 32).abs().amax(-1) + 16 * d.double())[..., None].expand(N, -1, 32)
        assert ((kernel - exact).view(N, -1, 32).abs() <= bound).all()
        x = torch.randn(3, K, generator=g)
        torch.testing.assert_close(w(x).double(), x.double().to(act).double() @ kernel.t(), rtol=0.02, atol=0.02)
    with pytest.raises(ValueError, match="integer q in"):
        Int4Weight.from_groups(q.float(), d, m)
    with pytest.raises(ValueError, match="group size"):
        Int4Weight.from_groups(q[:, :48], d[:, :1], m[:, :1])  # groups of 48
    # nearest bf16 even where fp64 → fp32 → bf16 would round twice: 1 + 2⁻⁸ + 2⁻³⁰ lies above the tie
    assert _nearest(torch.tensor([1 + 2**-8 + 2**-30], dtype=torch.float64), torch.bfloat16).item() == 1 + 2**-7


def test_quantize_decoder_serves_a_checkpoints_own_int4_groups_exactly():
    config = llama_config(96, 2, 64, num_attention_heads=2, num_key_value_heads=1)
    hf = build_model(config, seed=4, init_std=0.2)
    groups = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.startswith("model.layers.") and name.endswith("proj.weight"):
                groups[name] = q4_1_groups(p)
                p.copy_(groups[name][0].float().view(p.shape[0], -1, 32).mul(groups[name][1].float()[..., None])
                        .add(groups[name][2].float()[..., None]).view(p.shape))  # the checkpoint is its groups
    lean = quantize_decoder(LeanDecoder(hf), "int4", groups=groups)
    assert lean.quant.from_groups == 14  # 7 linears × 2 layers; the (tied) head has no groups: requantized
    for i, layer in enumerate(lean.layers):
        pre = f"model.layers.{i}."
        fused = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
                 "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
        for attr, parts in fused.items():
            assert torch.equal(packed_q(getattr(layer, attr)), torch.cat([groups[f"{pre}{p}.weight"][0] for p in parts]))
    # with fp32 activations (and the float head) the int4 decoder is the checkpoint itself, to fp32 rounding
    exact = quantize_decoder(LeanDecoder(hf), "int4", act_dtype=torch.float32, groups=groups)
    exact.lm_head = hf.lm_head.weight.detach()
    x = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = LeanDecoder(hf)
    torch.testing.assert_close(exact.forward(exact.new_cache(1, 9), x).logits, ref.forward(ref.new_cache(1, 9), x).logits,
                               rtol=2e-5, atol=1e-5)  # two different kernels' fp32 roundings (seen: 1.04e-5 at 1.5)
    # other group sizes and modes ignore them; a stale group is never served
    assert quantize_decoder(LeanDecoder(hf), "int4", group_size=64, groups=groups).quant.from_groups == 0
    assert quantize_decoder(LeanDecoder(hf), "int8", groups=groups).quant.from_groups == 0
    stale = dict(groups)
    q, d, m = stale["model.layers.1.mlp.down_proj.weight"]
    stale["model.layers.1.mlp.down_proj.weight"] = ((q + 1).clamp(max=15), d, m)
    with pytest.warns(UserWarning, match="down_proj.*requantizing"):
        assert quantize_decoder(LeanDecoder(hf), "int4", groups=stale).quant.from_groups == 13


def test_int4_weights_quantize_and_pack_in_row_blocks_as_in_one_piece(monkeypatch):
    """Int4Weight works in blocks of _INT4_BLOCK_ROWS rows (an LM head never has full-size float
    temporaries); the CPU packing lays out 64-row blocks independently, so the result is the same bytes."""
    import specloop.drafter.model.weights.linears as linears  # where Int4Weight reads _INT4_BLOCK_ROWS

    w = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))  # N % 16 != 0: padded rows too
    whole = linears.Int4Weight(w, group_size=32)
    monkeypatch.setattr(linears, "_INT4_BLOCK_ROWS", 64)
    blocked = linears.Int4Weight(w, group_size=32)
    assert torch.equal(whole.packed, blocked.packed) and torch.equal(whole.scales_zeros, blocked.scales_zeros)


@pytest.mark.parametrize("with_minimum", [True, False])
def test_reproduces_finds_one_ulp_anywhere_in_any_row_block(with_minimum):
    from specloop.drafter.model.weights.groups import dequantize_groups, reproduces

    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (70, 64), generator=g, dtype=torch.uint8)
    d = (torch.rand(70, 2, generator=g) / 7).half()
    m = (torch.rand(70, 2, generator=g) - 0.5).half() if with_minimum else None
    w = dequantize_groups(q, d, m)
    assert reproduces(q, d, m, w, rows=16) and reproduces(q, d, m, w.bfloat16().float(), rows=16) == torch.equal(
        w.bfloat16().float(), w)
    for row, col in ((0, 0), (37, 40), (69, 63)):  # the first, a middle and the last (ragged) block
        off = w.clone()
        off[row, col] = torch.nextafter(off[row, col], torch.tensor(float("inf")))
        assert not reproduces(q, d, m, off, rows=16)
    assert not reproduces(q[:, :32], d[:, :1], None if m is None else m[:, :1], w)  # another shape
