"""Structured output: a grammar (JSON schema, regex, a choice of strings, a Lark grammar) as a token mask, through
llguidance. One `GrammarCompiler` per tokenizer (the worker's); one `llguidance.LLMatcher` per request, advanced by the
tokens a request commits and rolled back after each draft it checks.

Under speculation (drafter/decode/shaping.py): a row's drafts are cut before the verify pass at the first one the
grammar refuses (`valid_prefix`: it would be rejected anyway, p = 0 there), and the verifier's logits at each drafted
position are masked by the grammar state reached after the drafts before it (`masks`). The verdict then preserves
the masked distribution exactly, as the verifier decoding alone under the same grammar would produce it. What the
grammar forces next (`forced`: a schema's keys and punctuation) is drafted for free where the drafter's own draft
is shorter (drafter/decode/speculative.py `with_forced`): verified like any draft, so still lossless.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# JSON as `json.dumps` writes it (", " and ": ", no other whitespace) unless a schema's own "x-guidance" says
# otherwise: with free whitespace a small model can pad a value with blanks until max_tokens
COMPACT_JSON: "JsonCompileOptions" = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that does not compile, or a spec of an unknown kind: the request is refused."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    spec: str  # json_schema: the schema as JSON text; json_object: ignored; regex: the pattern;
    #            choice: a JSON list of strings; lark: an llguidance Lark grammar

    @classmethod
    def from_dict(cls, data: dict | None) -> "GrammarSpec | None":
        if data is None:
            return None
        kind, spec = data.get("kind"), data.get("spec", "")
        if kind not in KINDS or not isinstance(spec, str):
            raise GrammarError(f"unknown structured-output spec {json.dumps(data)[:200]}")
        return cls(kind, spec)


def grammar_text(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (its JSON form)."""
    import llguidance

    m = llguidance.LLMatcher
    try:
        if spec.kind == "json_schema":
            return m.grammar_from_json_schema(json.loads(spec.spec), defaults=COMPACT_JSON)
        if spec.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=COMPACT_JSON)
        if spec.kind == "regex":
            return m.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("a choice needs a non-empty list of strings")
            return m.grammar_from_lark(choice_lark(choices))
        return m.grammar_from_lark(spec.spec)
    except GrammarError:
        raise
    except (ValueError, TypeError, RuntimeError) as exc:  # llguidance raises ValueError on bad input
        raise GrammarError(f"{spec.kind}: {str(exc)[:300]}") from None


def lark_from(text: str) -> str:
    """A grammar as llguidance's Lark dialect: Lark as given, or GBNF (llama.cpp's) converted; GrammarError where it
    is neither (the API's `guided_grammar` and `specloop generate --grammar-file` read grammars so)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the GBNF converter's own errors
        raise GrammarError(f"neither Lark nor GBNF that converts to it: {str(exc).strip()}") from None


def choice_lark(choices: list[str]) -> str:
    """The Lark grammar of a choice of strings."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def check(spec: GrammarSpec, tokenizer=None) -> str:
    """The spec's llguidance grammar, validated (against `tokenizer` where given: the API checks without one, the
    worker with its own); GrammarError where it does not compile."""
    import llguidance

    text = grammar_text(spec)
    try:
        problem = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise GrammarError(f"{spec.kind}: {str(exc)[:300]}") from None
    if problem:
        raise GrammarError(f"{spec.kind}: {str(problem)[:300]}")
    return text


class GrammarCompiler:
    """Matchers for one tokenizer, whose vocabulary is padded to the model's `vocab_size` (logit columns past the
    tokenizer's own tokens are never allowed). llguidance reads the tokenizer on the first grammar (about a second
    for a 49k vocabulary): a worker that never sees one never pays it."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: frozenset[int] = frozenset()):
        self.hf_tokenizer, self.vocab_size, self.eos_ids = hf_tokenizer, vocab_size, eos_ids
        self._tokenizer = None

    @property
    def tokenizer(self):
        """llguidance's view of the tokenizer (built once; GrammarError where it cannot read it)."""
        if self._tokenizer is None:
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=sorted(self.eos_ids) or None)
            except Exception as exc:  # noqa: BLE001 - a tokenizer llguidance cannot import: no structured output
                raise GrammarError(f"structured output is unavailable for this tokenizer: {str(exc)[:200]}") from None
        return self._tokenizer

    def matcher(self, spec: GrammarSpec) -> "RowGrammar":
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, check(spec, self.tokenizer))
        if matcher.is_error():
            raise GrammarError(f"{spec.kind}: {matcher.get_error()[:300]}")
        return RowGrammar(matcher, self.vocab_size)


class RowGrammar:
    """One request's grammar state: what it committed so far."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of `drafts` (from the committed state) the grammar allows, in order."""
        return int(self.matcher.validate_tokens(drafts)) if drafts else 0

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, V] bool: the tokens allowed after the committed tokens and drafts[:j], for each j
        (none after a draft that ends the output). `drafts` must be a valid prefix; the matcher is left where it
        was."""
        words = torch.zeros(len(drafts) + 1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        consumed = 0
        for j in range(len(drafts) + 1):
            if self.matcher.is_stopped():  # a draft ended the output (EOS): nothing after it is ever committed, and
                break  #                     a stopped matcher's mask is not asked (llguidance then cannot roll back)
            row = words[j]
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if j < len(drafts):
                self.matcher.consume_token(drafts[j])
                consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return unpack(words, self.vocab_size)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next, from the committed state (llguidance's fast-forward
        tokens: where one continuation is the only one its bytes allow, as after `{` of a schema's object, the
        key); none where the next token is a choice, or the matcher stopped."""
        if limit < 1 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens()[:limit])

    def commit(self, tokens: list[int]) -> None:
        if tokens and not self.matcher.is_stopped():
            self.matcher.consume_tokens(tokens)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, ceil(V / 32)] int32 bitmask (bit i of word w: token 32 w + i) → [N, V] bool."""
    bits = (words[:, :, None] >> _BITS) & 1
    return bits.reshape(len(words), -1)[:, :vocab_size].bool()
