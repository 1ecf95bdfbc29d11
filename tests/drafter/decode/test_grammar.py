"""Structured output under speculation (drafter/decode/grammar.py through the step): every output satisfies its
grammar, greedy output equals the verifier alone under the same grammar, drafts the grammar refuses are cut
before the verify pass, and the masks are those of the committed tokens plus the drafts before each position."""
import json
import re

import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.grammar import GrammarCompiler, GrammarError, GrammarSpec, unpack
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.ngram import NgramDrafter
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.model.loading import load_model
from specloop.services.prompts import PromptRecord, encode

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
