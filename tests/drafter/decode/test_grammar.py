"""Structured output under speculation (drafter/decode/grammar.py through the step): every output satisfies its
grammar, greedy output equals the verifier alone under the same grammar, drafts the grammar refuses are cut
before the verify pass, and the masks are those of the committed tokens plus the drafts before each position.
What a grammar forces next is drafted free (speculative.with_forced) for drafters that follow the verdict: the same
greedy output in fewer steps, and the verifier's distribution when sampling."""
import json
import re
from collections import Counter

import pytest
import torch

from specloop.drafter.decode.capacity import positions_needed
from specloop.drafter.decode.engine import Engine, generate
from specloop.drafter.decode.grammar import GrammarCompiler, GrammarError, GrammarSpec, unpack
from specloop.drafter.decode.proposer import GRAMMAR
from specloop.drafter.decode.requests import EngineRequest, StopRule
from specloop.drafter.decode.sampling import SamplingParams, warp
from specloop.drafter.kinds.eagle import EagleDrafter
from specloop.drafter.kinds.mix import SpeculatorMix
from specloop.drafter.kinds.ngram import NgramDrafter
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.suffix import SuffixDrafter
from specloop.drafter.model.loading import load_model
from specloop.services.prompts import PromptRecord, encode
from tests.drafter_helpers import fast_exact_weights, trained_eagle
from tests.stats import chi2_pvalue

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "maxItems": 3}}, "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
     "required": ["ok", "score"], "additionalProperties": False},
]
PROMPTS = ["Give me a person as JSON.", "List some colours in JSON.", "Rate this answer in JSON: 2 + 2 = 4."]


@pytest.fixture(scope="module")
def pair(reference_pair):
    # served in the fast exact mode: the engine under a grammar is what these tests check, not fp32's products (a
    # 500-row verify pass in fp32 reads the weights once a row)
    mode = fast_exact_weights()
    return load_model(reference_pair[0], weights=mode), load_model(reference_pair[1], weights=mode)


@pytest.fixture(scope="module")
def stored_pair(reference_pair):
    """As stored (fp32): what the graph step takes."""
    return load_model(reference_pair[0]), load_model(reference_pair[1])


@pytest.fixture(scope="module")
def grammars(pair):
    v = pair[0]
    return GrammarCompiler(v.tokenizer, v.vocab_size, frozenset([v.tokenizer.eos_token_id]))


def chat(tok, text: str) -> list[int]:
    return encode(tok, PromptRecord("p", messages=({"role": "user", "content": text},)))


def decode_all(pair, grammars, spec, drafter, k, params=SamplingParams(max_tokens=48)):
    v = pair[0]
    rule = StopRule(frozenset([v.tokenizer.eos_token_id]))
    prompts = [chat(v.tokenizer, p) for p in PROMPTS]
    return generate(v.lean, drafter, prompts, params, k, rule, grammar=spec, grammars=grammars)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_output_parses_and_greedy_equals_the_verifier_alone_under_the_grammar(pair, grammars, i):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[i]))
    v, d = pair
    alone = decode_all(pair, grammars, spec, None, 0)
    for drafter, k in ((PretrainedDrafter(d.lean), 4), (NgramDrafter(v.vocab_size), 4)):
        spec_out = decode_all(pair, grammars, spec, drafter, k)
        assert [g.token_ids for g in spec_out] == [g.token_ids for g in alone]
    for g in alone:
        if g.finish_reason == "stop":  # a finished output is a whole value of the schema
            value = json.loads(v.tokenizer.decode(g.token_ids, skip_special_tokens=True))
            assert set(value) == set(SCHEMAS[i]["required"])


def test_sampled_output_satisfies_regex_and_choice_grammars_with_speculation(pair, grammars):
    v, d = pair
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=3)
    regex = GrammarSpec("regex", r"[A-Z][a-z]{2,8} [0-9]{2}")
    for g in decode_all(pair, grammars, regex, PretrainedDrafter(d.lean), 3, params):
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", v.tokenizer.decode(g.token_ids, skip_special_tokens=True))
    choice = GrammarSpec("choice", json.dumps(["yes", "no", "maybe later"]))
    for g in decode_all(pair, grammars, choice, PretrainedDrafter(d.lean), 3, params):
        assert v.tokenizer.decode(g.token_ids, skip_special_tokens=True) in ("yes", "no", "maybe later")


def test_masks_follow_the_drafts_and_refused_drafts_are_cut(pair, grammars):
    tok = pair[0].tokenizer
    g = grammars.matcher(GrammarSpec("regex", "abc[0-9]+"))
    good = tok.encode("abc12", add_special_tokens=False)
    assert g.valid_prefix(good) == len(good)
    assert g.valid_prefix(good[:1] + tok.encode("zz", add_special_tokens=False)) == 1
    masks = g.masks(good)
    assert masks.shape == (len(good) + 1, pair[0].vocab_size)
    assert all(masks[j, t] for j, t in enumerate(good))  # each draft allowed where it stands
    assert torch.equal(g.masks(good), masks)  # the matcher was rolled back to the committed state
    g.commit(good)
    assert g.masks([])[0, tok.eos_token_id]  # a whole match: the end is allowed


def test_masks_over_drafts_that_end_the_output_leave_the_matcher_where_it_was(pair, grammars):
    """A draft may end the output (EOS) with more drafts after it; the matcher must roll back all the same (asked
    for a stopped matcher's mask, llguidance could not, and the row's next commit failed)."""
    tok = pair[0].tokenizer
    eos = tok.eos_token_id
    g = grammars.matcher(GrammarSpec("regex", "abc"))
    good = tok.encode("abc", add_special_tokens=False)
    assert g.valid_prefix(good + [eos, eos]) == len(good) + 1
    masks = g.masks(good + [eos, eos])
    assert all(masks[j, t] for j, t in enumerate(good))
    assert not masks[len(good) + 1:].any()  # past the end: nothing (the shaper allows the ends alone there)
    assert g.valid_prefix(good) == len(good)  # rolled back to the committed state
    g.commit(good)
    assert not g.matcher.is_error()


def test_bad_grammars_are_refused_with_a_grammar_error(grammars):
    for spec in (GrammarSpec("regex", "(unclosed"), GrammarSpec("json_schema", "{not json"),
                 GrammarSpec("choice", "[]"), GrammarSpec("lark", "start: nothing_defined")):
        with pytest.raises(GrammarError):
            grammars.matcher(spec)
    with pytest.raises(GrammarError):
        GrammarSpec.from_dict({"kind": "xml", "spec": ""})


def test_unpack_reads_bit_i_of_word_w_as_token_32w_plus_i():
    words = torch.tensor([[1 - 2**31, 4]], dtype=torch.int32)  # bits 0 and 31 of word 0, bit 2 of word 1
    assert unpack(words, 40)[0].nonzero().flatten().tolist() == [0, 31, 34]


def test_a_grammar_that_does_not_compile_refuses_its_request_before_anything_is_prefilled(pair, grammars):
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest

    v = pair[0]
    engine = Engine(v.lean, None, 2, 256, StopRule(frozenset([v.tokenizer.eos_token_id])), grammars=grammars)
    good = EngineRequest("ok", [1, 2, 3], SamplingParams(max_tokens=4), 0)
    bad = EngineRequest("bad", [1, 2, 3], SamplingParams(max_tokens=4), 0, grammar=GrammarSpec("regex", "(open"))
    with pytest.raises(GrammarError):
        engine.admit([good, bad])
    assert engine.running == 0 and len(engine.free) == 2  # neither was admitted


# -- what the grammar forces, drafted free


def following_drafters(v):
    """Drafters that follow the verdict rather than their own drafts: the ones given forced drafts."""
    eagle = EagleDrafter(v.lean, trained_eagle(v.lean, seed=1))
    mix = SpeculatorMix({"adaptive": EagleDrafter(v.lean, trained_eagle(v.lean, seed=2)), "suffix": SuffixDrafter(64)})
    return {"eagle": eagle, "suffix": SuffixDrafter(64), "mix": mix}


def run_engine(pair, grammars, spec, drafter, k, prompts, params=SamplingParams(max_tokens=48), grammar_drafts=True,
               first_request=0, backend=None):
    """(outputs, speculators of the rows' steps, steps) of one engine decoding `prompts` under `spec`."""
    v = pair[0]
    capacity = positions_needed(max(map(len, prompts)), params.max_tokens, k, 8)
    engine = Engine(v.lean, drafter, len(prompts), capacity, StopRule(frozenset([v.tokenizer.eos_token_id])),
                    grammars=grammars, grammar_drafts=grammar_drafts, backend=backend)
    engine.admit([EngineRequest(str(i), p, params, k, first_request + i, grammar=spec) for i, p in enumerate(prompts)])
    out, speculators, steps = {}, Counter(), 0
    while engine.running:
        steps += 1
        for u in engine.step():
            speculators[u.speculator] += 1
            if u.generation is not None:
                out[u.id] = u.generation.token_ids
    engine.close()
    return [out[str(i)] for i in range(len(prompts))], speculators, steps


def test_forced_tokens_are_what_the_grammar_allows_alone(pair, grammars):
    tok = pair[0].tokenizer
    g = grammars.matcher(GrammarSpec("regex", "abc[0-9]+xyz"))
    forced = g.forced(8)
    assert tok.decode(forced) == "abc"
    assert g.forced(1) == forced[:1] and g.forced(0) == []
    g.commit(forced)
    assert g.forced(8) == []  # a digit: a choice
    g.commit(tok.encode("7", add_special_tokens=False))
    assert g.forced(8) == []  # another digit or the end's x: a choice
    person = grammars.matcher(GrammarSpec("json_schema", json.dumps(SCHEMAS[0])))
    assert tok.decode(person.forced(8)).startswith('{"name')


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_forced_drafts_keep_greedy_output_and_take_fewer_steps(pair, grammars, i):
    """Eagle, suffix decoding and a mix of them, fixed k and k auto: the verifier alone's greedy output under the
    grammar, and forced drafts verified (rows the grammar drafted); in fewer steps than without them."""
    v = pair[0]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[i]))
    prompts = [chat(v.tokenizer, p) for p in PROMPTS]
    alone, _, _ = run_engine(pair, grammars, spec, None, 0, prompts)
    for name in ("eagle", "suffix", "mix"):
        for k in (4, None):
            got, speculators, steps = run_engine(pair, grammars, spec, following_drafters(v)[name], k, prompts)
            assert got == alone, (name, k)
            assert speculators[GRAMMAR] > 0, (name, k)
            without, speculators_off, steps_off = run_engine(pair, grammars, spec, following_drafters(v)[name], k,
                                                             prompts, grammar_drafts=False)
            assert without == alone and speculators_off[GRAMMAR] == 0
            assert steps < steps_off, (name, k, steps, steps_off)


def test_forced_drafts_on_the_graph_backend_keep_greedy_output(stored_pair, grammars, monkeypatch):
    """The GPU's step on the CPU (uncompiled): an eagle head's captured chain, forced drafts merged into its
    proposal and verified in the fixed-width pass: the graph verifier alone's output under the grammar."""
    monkeypatch.setenv("SPECLOOP_COMPILE", "0")
    pair = stored_pair
    v = pair[0]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))
    prompts = [chat(v.tokenizer, p) for p in PROMPTS]
    alone, _, _ = run_engine(pair, grammars, spec, None, 0, prompts, backend="graph")
    for k in (4, None):
        got, speculators, _ = run_engine(pair, grammars, spec, following_drafters(v)["mix"], k, prompts, backend="graph")
        assert got == alone and speculators[GRAMMAR] > 0, k


def test_forced_drafts_in_a_batch_mixing_grammar_and_free_rows(pair, grammars):
    """Two requests under a grammar beside one without, in one engine with a mix drafting: every output is what that
    request gives decoded alone by the verifier (the free row's drafts are never replaced)."""
    v = pair[0]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[2]))
    prompts = [chat(v.tokenizer, p) for p in PROMPTS]
    specs = [spec, None, spec]
    alone = [run_engine(pair, grammars, s, None, 0, [p])[0][0] for s, p in zip(specs, prompts)]
    params = SamplingParams(max_tokens=48)
    engine = Engine(v.lean, following_drafters(v)["mix"], 3, positions_needed(max(map(len, prompts)), 48, None, 8),
                    StopRule(frozenset([v.tokenizer.eos_token_id])), grammars=grammars)
    engine.admit([EngineRequest(str(i), p, params, None, i, grammar=s) for i, (p, s) in enumerate(zip(prompts, specs))])
    out, speculators = {}, Counter()
    while engine.running:
        for u in engine.step():
            speculators[(u.id, u.speculator)] += 1
            if u.generation is not None:
                out[u.id] = u.generation.token_ids
    assert [out[str(i)] for i in range(3)] == alone
    assert speculators[("0", GRAMMAR)] + speculators[("2", GRAMMAR)] > 0 and speculators[("1", GRAMMAR)] == 0


def test_a_drafter_lm_is_given_no_forced_drafts(pair, grammars):
    """A drafter LM's cache holds what it drafted: the grammar does not draft for its rows."""
    v, d = pair
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))
    prompts = [chat(v.tokenizer, p) for p in PROMPTS]
    alone, _, _ = run_engine(pair, grammars, spec, None, 0, prompts)
    got, speculators, _ = run_engine(pair, grammars, spec, PretrainedDrafter(d.lean), 4, prompts)
    assert got == alone and speculators[GRAMMAR] == 0


CHOICE = r"(yes|no)abc(1|2)"


def exact_outputs(pair, grammars, prompt: list[int], params: SamplingParams, floor: float = 1e-6) -> dict:
    """P(output tokens) of the verifier sampling under the CHOICE grammar, every path enumerated (masked and warped
    as the engine does; paths below `floor` left out)."""
    v = pair[0]
    eos = v.tokenizer.eos_token_id
    paths, done = {(): 1.0}, {}
    while paths:
        grown = {}
        for path, p in paths.items():
            g = grammars.matcher(GrammarSpec("regex", CHOICE))
            g.commit(list(path))
            mask = g.masks([])[0]
            if not mask.any():  # the match is whole (the matcher stopped): the end alone, as the shaper allows
                mask[eos] = True
            with torch.inference_mode():
                logits = v.lean.forward(v.lean.new_cache(1, len(prompt) + 32), torch.tensor([prompt + list(path)]),
                                        last_only=True).logits[0, -1].float()
            probs = warp(logits.masked_fill(~mask, float("-inf"))[None], params)[0].double()
            for t in torch.nonzero(probs > 0).flatten().tolist():
                q = p * float(probs[t])
                if q < floor:
                    continue
                if t == eos:
                    done[path] = done.get(path, 0.0) + q
                else:
                    grown[path + (t,)] = q
        paths = grown
    return done


def test_sampled_output_with_forced_drafts_is_the_verifiers_distribution(pair, grammars):
    """T = 1, an eagle head drafting k = 4 with forced tokens between two choices: the outputs' frequencies
    against the verifier's exact distribution under the grammar (chi-square)."""
    v = pair[0]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=11)
    prompt = chat(v.tokenizer, "Answer yes or no, then abc and a digit.")
    exact = exact_outputs(pair, grammars, prompt, params)
    counts, speculators = Counter(), Counter()
    for lo in range(0, 2000, 500):
        got, used, _ = run_engine(pair, grammars, GrammarSpec("regex", CHOICE), following_drafters(v)["eagle"], 4,
                                  [prompt] * 500, params, first_request=lo)
        counts.update(tuple(g[:-1]) if g and g[-1] == v.tokenizer.eos_token_id else tuple(g) for g in got)
        speculators.update(used)
    assert speculators[GRAMMAR] > 0
    keys = sorted(exact, key=exact.get, reverse=True)
    other = sum(n for path, n in counts.items() if path not in exact)
    pvalue = chi2_pvalue([counts[p] for p in keys] + [other], [exact[p] for p in keys] + [1 - sum(exact.values())])
    print(f"chi-square p-value of {len(keys)} outputs: {pvalue}")
    assert pvalue > 0.01, pvalue
