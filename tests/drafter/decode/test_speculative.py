"""Losslessness of the speculative loop: greedy equality, output distribution, acceptance extremes."""

import os

import pytest
import torch

from bench.gpu_sampling import residual_dropped
from specloop.drafter.decode.controller import Controller, ControllerConfig
from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.plan import StepPlan
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.decode.speculative import rolled_back
from specloop.drafter.kinds.dvi import DVIDrafter
from specloop.drafter.kinds.ngram import NgramDrafter
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.sd2 import SteeredDrafter
from specloop.drafter.kinds.suffix import SuffixDrafter
from specloop.drafter.model.attention import KV_CACHE_ENV
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.loading import load_model, load_tokenizer
from specloop.services.prompts import encode, load_prompts
from tests.conftest import SHARED_PROMPTS
from tests.drafter_helpers import (
    POSITIONS,
    PROMPT,
    SETTINGS,
    VOCAB,
    WARPED,
    Scripted,
    fast_exact_weights,
    perturbed_head,
    perturbed_steering,
    sampled_counts,
)
from tests.stats import chi2_pvalue, exact_marginals
from tests.tiny import build_model, llama_config

TIE = 1e-4
N_PROMPTS = 26  # per domain: 52 prompts in all
MAX_TOKENS = 40


# ---------------------------------------------------------------- greedy equality on the reference pair


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """This module is single-process compute (no servers beside it): both cores when it runs alone. Under
    pytest-xdist each worker already has a core of its own (scripts/test.sh: one worker per core), and a second
    thread per worker oversubscribes the machine: OpenMP's spinning barriers then wait on a thread that is not
    running (seen: 4-8x the CPU time of one thread). The products it checks do not depend on the thread count
    (drafter/model/decoder.py), which the rest of the suite runs at one."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer(reference_pair):
    return load_tokenizer(reference_pair[0])


@pytest.fixture(scope="module")
def prompts(tokenizer):
    tok = tokenizer
    recs = load_prompts(SHARED_PROMPTS / "chat_dev.jsonl", N_PROMPTS) + load_prompts(
        SHARED_PROMPTS / "code_dev.jsonl", N_PROMPTS
    )
    return [encode(tok, r) for r in recs]


@pytest.fixture(scope="module")
def rule(tokenizer):
    return StopRule(frozenset([tokenizer.eos_token_id]))


class Served:
    """The reference pair served in a weight mode (None: as stored, fp32; "fast": `fast_exact_weights`) and the
    verifier's own greedy decoding of every prompt alone there, each loaded or decoded once, when first asked."""

    def __init__(self, paths):
        self.paths, self.models, self.greedy = paths, {}, {}

    @staticmethod
    def mode(weights: str | None) -> str | None:
        return fast_exact_weights() if weights == "fast" else None

    def pair(self, weights: str | None = None):
        mode = self.mode(weights)
        if mode not in self.models:
            self.models[mode] = tuple(load_model(path, weights=mode) for path in self.paths)
        return self.models[mode]

    def reference(self, prompts, rule, weights: str | None = None) -> list[list[int]]:
        mode, params = self.mode(weights), SamplingParams(max_tokens=MAX_TOKENS)
        if mode not in self.greedy:
            verifier = self.pair(weights)[0]
            self.greedy[mode] = [generate(verifier.lean, None, [p], params, 0, rule)[0].token_ids for p in prompts]
        return self.greedy[mode]


@pytest.fixture(scope="module")
def served(reference_pair):
    return Served(reference_pair)


@pytest.fixture(scope="module")
def pair(served):
    return served.pair()


@pytest.fixture(scope="module")
def reference(served, prompts, rule):
    return served.reference(prompts, rule)


def top2_gap(model, context: list[int]) -> float:
    with torch.no_grad():
        logits = model.hf(torch.tensor([context])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare(model, prompts, reference, outputs) -> int:
    """Assert token equality except at near-ties of the verifier; returns the number of ties."""
    ties = 0
    for prompt, ref, out in zip(prompts, reference, outputs):
        if ref == out:
            continue
        t = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        gap = top2_gap(model, prompt + ref[:t])
        assert gap < TIE, f"mismatch at token {t} where the verifier's top-2 gap is {gap:.3g}: not a tie"
        ties += 1
    return ties






def make_drafter(kind, pair):
    v, d = pair
    if kind == "pretrained":
        return PretrainedDrafter(d.lean)
    if kind == "sd2":
        return SteeredDrafter(d.lean, perturbed_steering(v.hf, d.hf))
    if kind == "dvi":
        return DVIDrafter(v.lean, perturbed_head(v.hf, layers=2))
    if kind == "eagle3":
        from specloop.drafter.kinds.eagle3 import Eagle3Drafter
        from tests.drafter_helpers import trained_eagle3 as trained_like

        return Eagle3Drafter(v.lean, trained_like(v.lean, seed=1, std=0.05))
    return SuffixDrafter(v.vocab_size) if kind == "suffix" else NgramDrafter(v.vocab_size)


# A subset of the grid (CI time): fixed k = 4 one row at a time for the LM drafter, k = 8 in batches of 4 for the
# LM drafters and n-gram; DVI (and k = 1, and k changing every step) through the k-auto test below, strict alike.
# The pair as stored (fp32: row by row, what serving an fp32 checkpoint runs) for one case here and one in the k-auto
# test; the others serve it in the fast exact mode (`fast_exact_weights`: what the fetched model serves by default),
# which tests the same engine in a ninth of the time.
@pytest.mark.parametrize("kind,k,batch,weights", [
    ("suffix", 8, 4, "fp32"), ("pretrained", 4, 1, "fast"), ("pretrained", 8, 4, "fast"), ("ngram", 8, 4, "fast"),
    ("sd2", 8, 4, "fast"), ("eagle3", 4, 4, "fast")])
def test_greedy_output_equals_the_verifier_alone_on_every_prompt(served, prompts, rule, kind, batch, k, weights):
    pair, reference = served.pair(weights), served.reference(prompts, rule, weights)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outputs, accepted = [], 0
    for lo in range(0, len(prompts), batch):
        gens = generate(pair[0].lean, make_drafter(kind, pair), prompts[lo : lo + batch], params, k, rule)
        outputs += [g.token_ids for g in gens]
        accepted += sum(g.stats.accepted for g in gens)
    assert len(prompts) >= 50
    # bit-exact verification (drafter/model/decoder.py): equal token for token, no near-tie excused
    differ = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
    assert not differ, f"kind={kind} k={k} batch={batch}: prompts {differ} differ from the verifier alone"
    assert accepted > 0


@pytest.mark.parametrize("kind,batch,weights", [("pretrained", 1, "fp32"), ("pretrained", 4, "fast"),
                                                 ("ngram", 4, "fast"), ("sd2", 4, "fast"), ("dvi", 4, "fast")])
def test_greedy_output_with_k_auto_equals_the_verifier_alone_on_every_prompt(served, prompts, rule, kind, batch,
                                                                               weights):
    pair, reference = served.pair(weights), served.reference(prompts, rule, weights)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    controller = Controller(ControllerConfig(explore_min=2, explore_max=8))  # frequent probes: many switches
    outputs, drafted = [], 0
    for lo in range(0, len(prompts), batch):
        gens = generate(pair[0].lean, make_drafter(kind, pair), prompts[lo : lo + batch], params, None, rule,
                        controller=controller)
        outputs += [g.token_ids for g in gens]
        drafted += sum(g.stats.drafted for g in gens)
    differ = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
    assert not differ, f"kind={kind} k=auto batch={batch}: prompts {differ} differ from the verifier alone"
    assert drafted > 0


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_greedy_speculation_over_a_16_bit_cache_on_the_cpus_kernels_equals_its_plain_decoding(served, prompts, rule,
                                                                                             kv, monkeypatch):
    # `--kv-cache-dtype bfloat16 | float16` on the CPU: the verifier's and the drafter LM's caches in 16 bits, read by
    # specloop's own kernels (not torch's ops), speculation still that cache's plain decoding, token for token
    monkeypatch.setenv(KV_CACHE_ENV, kv)
    pair, params = served.pair("fast"), SamplingParams(max_tokens=MAX_TOKENS)
    verifier = pair[0].lean
    assert verifier.fused and verifier.new_cache(1, 64).keys[0].dtype == getattr(torch, kv)
    chosen = prompts[:16]
    plain = [generate(verifier, None, [p], params, 0, rule)[0].token_ids for p in chosen]
    for kind, k in (("pretrained", 4), ("ngram", 8)):
        outputs = [g.token_ids for lo in range(0, len(chosen), 4)
                   for g in generate(verifier, make_drafter(kind, pair), chosen[lo : lo + 4], params, k, rule)]
        assert outputs == plain, kind


def test_verifier_alone_matches_transformers_greedy_generate(pair, prompts, reference):
    model = pair[0].hf
    for prompt, ref in list(zip(prompts, reference))[:: len(prompts) // 6]:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=4, pad_token_id=0
        )[0, len(prompt) :].tolist()
        out = out[: out.index(4)] if 4 in out else out
        assert out == ref or compare(pair[0], [prompt], [ref], [out]) == 1


def test_a_drafter_identical_to_the_verifier_has_every_draft_accepted(pair, prompts):
    k = 4
    rule = StopRule()
    gens = generate(pair[0].lean, PretrainedDrafter(pair[0].lean), prompts[:6], SamplingParams(max_tokens=24), k, rule)
    for g in gens:
        assert g.stats.block_efficiency == k + 1
        assert g.stats.accepted_per_position == [g.stats.blocks] * k


def test_a_degraded_drafter_leaves_output_unchanged_and_acceptance_falls(served, prompts, rule):
    pair, reference = served.pair("fast"), served.reference(prompts, rule, "fast")
    params, k = SamplingParams(max_tokens=MAX_TOKENS), 4
    sub = prompts[:12]
    good = generate(pair[0].lean, PretrainedDrafter(pair[1].lean), sub, params, k, rule)
    broken = load_model(pair[1].path)
    broken.hf.lm_head.weight.data.zero_()  # tied: this zeroes the embeddings as well
    bad = generate(pair[0].lean, PretrainedDrafter(LeanDecoder(broken.hf)), sub, params, k, rule)
    assert [g.token_ids for g in bad] == reference[:12]
    tau = lambda gens: sum(g.stats.accepted + g.stats.blocks for g in gens) / sum(g.stats.blocks for g in gens)
    assert tau(bad) < tau(good) - 0.3, (tau(bad), tau(good))


def test_seeded_sampling_is_reproducible_and_repeated_prompts_are_independent(pair, prompts, rule):
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=3)
    batch = [prompts[0]] * 4
    run = lambda p: [g.token_ids for g in generate(pair[0].lean, PretrainedDrafter(pair[1].lean), batch, p, 4, rule)]
    first, again = run(params), run(params)
    assert first == again
    assert len({tuple(t) for t in first}) > 1  # same prompt, own streams: different draws
    other = run(SamplingParams(temperature=1.0, max_tokens=24, seed=4))
    assert other != first


# ---------------------------------------------------------------- output distribution on a tiny model



@pytest.fixture(scope="module")
def tiny():
    verifier = build_model(llama_config(VOCAB, 2, 32), seed=11, init_std=0.6)
    drafter = build_model(llama_config(VOCAB, 1, 32), seed=12, init_std=0.6)
    return verifier, drafter


# suffix decoding through the mix (eagle heads + suffix) here, alone with k changing every step below (suite time)
KINDS = [("pretrained", 2), ("ngram", 3), ("mix", 3), ("sd2", 2), ("dvi", 3), ("none", 0)]


@pytest.mark.usefixtures("wide_fp32_row_blocks")
@pytest.mark.parametrize("setting,kind,k", [(WARPED, kind, k) for kind, k in KINDS]
                         + [("T=1", "pretrained", 2), ("T=1", "none", 0)])
def test_sampled_output_distribution_equals_the_verifiers(tiny, setting, kind, k):
    params = SETTINGS[setting]
    exact = exact_marginals(tiny[0], PROMPT, POSITIONS, params)
    counts = sampled_counts(tiny, params, kind, k)
    pvalues = [chi2_pvalue(counts[t], exact[t]) for t in range(POSITIONS)]
    print(f"{setting} {kind} k={k}: chi-square p-values {pvalues}")
    assert min(pvalues) > 0.01, pvalues


@pytest.mark.usefixtures("wide_fp32_row_blocks")
@pytest.mark.parametrize("setting,kind", [(WARPED, kind) for kind in ("pretrained", "sd2", "dvi", "ngram", "suffix",
                                                                     "eagle3")]
                         + [("T=1", "pretrained")])
def test_sampled_output_distribution_with_k_changing_every_step_equals_the_verifiers(tiny, setting, kind):
    """k = auto: plain steps, then drafting rows restarted in the drafter, every k — each step a valid block."""
    params = SETTINGS[setting]
    exact = exact_marginals(tiny[0], PROMPT, POSITIONS, params)
    counts = sampled_counts(tiny, params, kind, None, controller=Scripted([0, 2, 1, 0, 3], k_max=3))
    pvalues = [chi2_pvalue(counts[t], exact[t]) for t in range(POSITIONS)]
    print(f"{setting} {kind} k=auto (scripted): chi-square p-values {pvalues}")
    assert min(pvalues) > 0.01, pvalues


@pytest.mark.usefixtures("wide_fp32_row_blocks")
def test_a_wrong_sampler_fails_the_same_distribution_test(tiny):
    params = SETTINGS[WARPED]
    exact = exact_marginals(tiny[0], PROMPT, POSITIONS, params)
    counts = sampled_counts(tiny, params, "pretrained", 2, sampler=residual_dropped)  # the classic bug (bench/gpu_sampling.py)
    pvalues = [chi2_pvalue(counts[t], exact[t]) for t in range(POSITIONS)]
    assert min(pvalues) < 0.01, pvalues


# ---------------------------------------------------------------- stopping


def test_stop_rule_ends_at_eos_stop_string_or_max_tokens_whichever_first():
    from specloop.drafter.decode.requests import Generation
    from specloop.drafter.decode.stats import AcceptanceStats

    decode = lambda ids: "".join(chr(96 + t) for t in ids)  # 1 → a, 2 → b, ...
    rule = StopRule(frozenset([9]), decode)
    cases = [
        ([1, 2, 9, 3], SamplingParams(max_tokens=10), [1, 2], "stop"),
        ([1, 2, 3, 4], SamplingParams(max_tokens=3), [1, 2, 3], "length"),
        ([1, 2, 3, 4], SamplingParams(max_tokens=10, stop=("bc",)), [1, 2, 3], "stop"),
        ([1, 2], SamplingParams(max_tokens=10), [1, 2], None),
    ]
    for new, params, kept, reason in cases:
        gen = Generation([], None, AcceptanceStats(1))
        rule.extend(gen, new, params)
        assert (gen.token_ids, gen.finish_reason) == (kept, reason)


def test_stop_strings_end_speculative_and_plain_decoding_at_the_same_token(pair, prompts, reference):
    tok = pair[0].tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    rule = StopRule(frozenset([tok.eos_token_id]), decode)
    params = SamplingParams(max_tokens=MAX_TOKENS, stop=(" the",))
    sub = [p for p, r in zip(prompts, reference) if " the" in decode(r)][:8]
    assert sub
    plain = generate(pair[0].lean, None, sub, params, 0, rule)
    spec = generate(pair[0].lean, PretrainedDrafter(pair[1].lean), sub, params, 8, rule)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "stop"
        assert " the" in decode(a.token_ids) and " the" not in decode(a.token_ids[:-1])


def test_a_block_rolls_each_active_rows_cache_back_to_last_and_its_accepted_drafts_an_idle_row_to_where_it_was():
    start, n = torch.tensor([10, 20, 30]), torch.tensor([2, 0, 1])
    busy = StepPlan(torch.tensor([True, False, True]), 3, SamplingParams(), m=3, live=(0, 2))
    assert rolled_back(start + 4, start, n, busy, 3).tolist() == [13, 20, 32]  # the pass wrote 1 + k = 4 each
    plain_lens = start + 1
    assert rolled_back(plain_lens, start, n * 0, busy, 0).tolist() == [11, 20, 31]
    full = StepPlan(torch.ones(3, dtype=torch.bool), 0, SamplingParams(), m=3, live=(0, 1, 2))
    assert rolled_back(plain_lens, start, n * 0, full, 0) is plain_lens  # a plain step of full rows: as the pass left


def test_a_plain_sampled_verdict_is_the_compiled_draw_and_a_sampler_of_ones_own_is_still_asked():
    from specloop.drafter.decode.proposer import Proposal
    from specloop.drafter.decode.rejection import compiled_verdict, rejection_sample
    from specloop.drafter.decode.sampling import RowParams, sample, warp
    from specloop.drafter.decode.speculative import Block, accept

    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 1, 500, generator=g) * 3
    u = torch.rand(3, 1, generator=g)
    block = Block(Proposal(torch.empty(3, 0, dtype=torch.long), None), 0, 0, None, u)
    params = RowParams((SamplingParams(temperature=0.7), SamplingParams(), SamplingParams(temperature=1.3)))
    got = accept(block, logits, params, rejection_sample)
    drawn = compiled_verdict(block.proposal.tokens, None, logits, params, u)
    if drawn is not None:  # the kernels are built: the verdict is their draw
        assert torch.equal(got.tokens, drawn.tokens)
    assert got.tokens[1, 0] == logits[1, 0].argmax() and got.num_accepted.tolist() == [0, 0, 0]
    for b in (0, 2):  # a sampled row: warp and sample's token (the same weights, far from any edge here)
        assert got.tokens[b, 0] == sample(warp(logits[b], params.rows[b]), u[b])[0]
    asked = []

    def own(tokens, q, p, uniforms, **cap):
        asked.append(p.shape)
        return rejection_sample(tokens, q, p, uniforms, **cap)

    accept(block, logits, params, own)
    assert asked == [(3, 1, 500)]  # a sampler of the caller's own sees the warped p, as before
