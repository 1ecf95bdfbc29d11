"""Structured outputs on the API side: OpenAI's `response_format` and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` become the one `guided`
spec of a CompletionRequest (services/protocol.py), {"kind", "spec"}:

- json_schema, the schema as JSON text: `response_format` {"type": "json_schema", "json_schema":
  {"schema": ...}}, `guided_json`, `structured_outputs.json`;
- json_object, "" (any JSON object): `response_format` {"type": "json_object"},
  `structured_outputs.json_object: true`;
- regex, the pattern: `guided_regex`, `structured_outputs.regex`;
- choice, a JSON list of strings: `guided_choice`, `structured_outputs.choice`;
- lark, an llguidance Lark grammar: `guided_grammar`, `structured_outputs.grammar` (GBNF is converted
  to Lark), and the grammar of a forced tool call (services/api/tools.py).

At most one of these per request. Each spec is compiled here with llguidance (no tokenizer: cheap,
well under a second for the largest spec allowed) so that a schema, pattern or grammar that cannot
work is a 400 naming its parameter before anything is queued; the worker compiles it again against
its vocabulary and masks decoding with it.
"""
from __future__ import annotations

import json
from typing import Any

from specloop.drafter.decode.grammar import GrammarError, GrammarSpec, check, lark_from
from specloop.services.api.schemas import invalid

MAX_GUIDED_CHARS = 64 * 1024  # characters of one schema (as JSON text), pattern, grammar or choice list
MAX_ERROR_CHARS = 400  # of llguidance's message quoted in a 400
GUIDED_PARAMS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' forms
STRUCTURED_NEUTRAL = {"disable_fallback": (None, False), "disable_any_whitespace": (None, False),
                      "disable_additional_properties": (None, False), "whitespace_pattern": (None,),
                      "structural_tag": (None,)}


def guided_spec(req: Any) -> tuple[dict | None, str | None]:
    """The request's structured-output spec and the parameter that asked for it ((None, None): none).
    `req` has the fields of schemas.Sampling."""
    given = [name for name in GUIDED_PARAMS if getattr(req, name, None) is not None
             and not (name == "response_format" and _is_text(req.response_format))]
    if not given:
        return None, None
    if len(given) > 1:
        raise invalid(f"give at most one structured-output form, got {', '.join(f'`{g}`' for g in given)}",
                      given[1])
    name = given[0]
    value = getattr(req, name)
    if name == "response_format":
        return response_format_spec(value), name
    if name == "guided_json":
        return json_schema_spec(_schema_value(value, name), name), name
    if name == "guided_regex":
        return regex_spec(value, name), name
    if name == "guided_choice":
        return choice_spec(value, name), name
    if name == "guided_grammar":
        return lark_spec(value, name), name
    return structured_outputs_spec(value), name


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def response_format_spec(value: Any) -> dict:
    """OpenAI's `response_format`: json_object, or json_schema with `json_schema.schema` (without a
    schema: any JSON object). `strict` is accepted either way: the schema is always enforced."""
    if not isinstance(value, dict):
        raise invalid('response_format must be an object such as {"type": "json_object"}', "response_format")
    kind = value.get("type")
    if kind == "json_object":
        return {"kind": "json_object", "spec": ""}
    if kind != "json_schema":
        raise invalid(f'response_format.type must be "text", "json_object" or "json_schema", got {json.dumps(kind)}',
                      "response_format.type")
    body = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(body, dict):
        raise invalid('response_format.json_schema must be an object {"name", "schema", "strict"}', param)
    if body.get("name") is not None and not isinstance(body.get("name"), str):
        raise invalid("response_format.json_schema.name must be a string", f"{param}.name")
    if body.get("strict") is not None and not isinstance(body.get("strict"), bool):
        raise invalid("response_format.json_schema.strict must be a boolean", f"{param}.strict")
    schema = body.get("schema")
    if schema is None:
        return {"kind": "json_object", "spec": ""}
    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema must be a JSON schema (an object)", f"{param}.schema")
    return json_schema_spec(schema, f"{param}.schema")


def structured_outputs_spec(value: Any) -> dict:
    """vLLM's `structured_outputs`: exactly one of json / regex / choice / grammar / json_object."""
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid('structured_outputs must be an object such as {"regex": "[0-9]+"}', param)
    for key, neutral in STRUCTURED_NEUTRAL.items():
        if not any(value.get(key) == v and isinstance(value.get(key), bool) == isinstance(v, bool) for v in neutral):
            raise invalid(f"`structured_outputs.{key}` is not supported by this server", f"{param}.{key}")
    given = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise invalid(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KEYS)}, got "
                      f"{', '.join(given) or 'none'}", param)
    key = given[0]
    item, where = value[key], f"{param}.{key}"
    if key == "json":
        return json_schema_spec(_schema_value(item, where), where)
    if key == "regex":
        return regex_spec(item, where)
    if key == "choice":
        return choice_spec(item, where)
    if key == "grammar":
        return lark_spec(item, where)
    if item is not True:
        raise invalid("structured_outputs.json_object must be true", where)
    return {"kind": "json_object", "spec": ""}


def _schema_value(value: Any, param: str) -> dict:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        _bound(value, param)
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid(f"{param} must be a JSON schema: an object, or its JSON text", param) from None
    if not isinstance(value, dict):
        raise invalid(f"{param} must be a JSON schema (an object)", param)
    return value


def json_schema_spec(schema: dict, param: str) -> dict:
    text = json.dumps(schema, ensure_ascii=False)
    _bound(text, param)
    return checked("json_schema", text, param, "JSON schema")


def regex_spec(pattern: Any, param: str) -> dict:
    if not isinstance(pattern, str) or not pattern:
        raise invalid(f"{param} must be a non-empty regular expression", param)
    _bound(pattern, param)
    return checked("regex", pattern, param, "regular expression")


def choice_spec(choices: Any, param: str) -> dict:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise invalid(f"{param} must be a non-empty list of non-empty strings", param)
    text = json.dumps(choices, ensure_ascii=False)
    _bound(text, param)
    return checked("choice", text, param, "choice")


def lark_spec(grammar: Any, param: str) -> dict:
    """A Lark grammar (llguidance's dialect), or a GBNF one converted to it."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise invalid(f"{param} must be a non-empty grammar (Lark, or GBNF)", param)
    _bound(grammar, param)
    try:
        lark = lark_from(grammar)
    except GrammarError as exc:
        raise invalid(f"{param}: the grammar is {_short(exc)}", param) from None
    return checked("lark", lark, param, "grammar")


def checked(kind: str, spec: str, param: str, what: str) -> dict:
    """The guided spec {"kind", "spec"}, compiled as the worker compiles it (drafter/decode/grammar.py `check`,
    without a tokenizer); a 400 naming `param` when it does not compile."""
    try:
        check(GrammarSpec(kind, spec))
    except GrammarError as exc:
        raise invalid(f"{param}: the {what} does not compile: {_short(exc)}", param) from None
    return {"kind": kind, "spec": spec}


def _bound(text: str, param: str) -> None:
    if len(text) > MAX_GUIDED_CHARS:
        raise invalid(f"{param} has {len(text)} characters; this server takes at most {MAX_GUIDED_CHARS}", param)


def _short(message: object) -> str:
    text = str(message).strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " …"
