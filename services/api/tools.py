"""Tool calling on the API side: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls`, the
tools and past calls rendered into the prompt, the grammar that forces a call, and the calls parsed
back out of the generated text (whole, or held back while streaming).

One format throughout, Hermes' (NousResearch Hermes 2 Pro, Qwen2.5 and the many templates that
copy them): a call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that speaks tools itself (its source uses both `tools` and `tool_calls`) gets them
as `apply_chat_template(..., tools=...)` and messages with `tool_calls` / `tool_call_id`. Any other
(SmolLM2-Instruct's, the reference pair's: both render only role and content) gets them as text:
the tools as a system block (`tools_system_block`, merged into the first system message or put
before the conversation), an assistant's calls as `<tool_call>` blocks in its content, and a tool
result as a user turn holding `<tool_response>` blocks (consecutive results share one turn).

`tool_choice`:
- "none" (the default without tools): the tools are not rendered and nothing is parsed; the request
  is an ordinary chat (past calls and results in the messages are still rendered);
- "auto" (the default with tools): rendered; calls are parsed from whatever the model writes;
- "required": rendered, and the output is constrained (a guided Lark grammar, `tool_lark`) to one
  or more calls of the given tools, each call's arguments matching that tool's `parameters` schema;
- {"type": "function", "function": {"name"}}: the same with that one function only.
`parallel_tool_calls: false` allows one call: the forced grammar takes one, parsing keeps the first.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from specloop.services.api.schemas import Tool, invalid
from specloop.services.api.structured import MAX_GUIDED_CHARS, checked

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.S)  # an unclosed last call counts
CHOICES = ("none", "auto", "required")
# a forced call's JSON is written as json.dumps writes it (and as past calls are rendered): ", " and ": ",
# no other whitespace, so a call always ends (no model can pad it with whitespace forever)
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

TOOLS_PREAMBLE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
"""
TOOLS_POSTAMBLE = """
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""


# ------------------------------------------------------------------------------------------ the request


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one chat request that are in play (tool_choice other than "none")."""

    tools: tuple[dict, ...]  # OpenAI tool objects as rendered: {"type": "function", "function": {name, ...}}
    choice: str  # "auto" | "required" | "function" (a named function)
    function: str | None = None  # the named function
    parallel: bool = True  # false: at most one call

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)


def tool_plan(tools: list[Tool] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's tools in play, or None (no tools, or tool_choice "none"); 400 naming `tools` /
    `tool_choice` when they do not fit together."""
    rendered = tuple(tool_dict(t) for t in tools or ())
    seen: set[str] = set()
    for i, t in enumerate(rendered):
        name = t["function"]["name"]
        if name in seen:
            raise invalid(f"two tools are named {json.dumps(name)}", f"tools.{i}.function.name")
        seen.add(name)
    choice, function = parse_tool_choice(tool_choice)
    if choice in ("required", "function") and not rendered:
        raise invalid(f"tool_choice {json.dumps(tool_choice)} needs `tools`", "tool_choice")
    if function is not None and function not in seen:
        raise invalid(f"tool_choice names the function {json.dumps(function)}, which is not among `tools`",
                      "tool_choice")
    if choice == "none" or not rendered:
        return None
    return ToolPlan(rendered, choice, function, parallel is not False)


def parse_tool_choice(value: Any) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "function", the named function or None); None is "auto" (with
    tools; without, nothing is rendered either way)."""
    if value is None:
        return "auto", None
    if isinstance(value, str) and value in CHOICES:
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]:
            return "function", function["name"]
    raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                  "tool_choice")


def tool_dict(tool: Tool) -> dict:
    """A tool as rendered and matched: OpenAI's shape with the fields that describe it."""
    fn = tool.function
    body: dict = {"name": fn.name}
    if fn.description is not None:
        body["description"] = fn.description
    if fn.parameters is not None:
        body["parameters"] = fn.parameters
    return {"type": "function", "function": body}


# ------------------------------------------------------------------------------------------ the grammar


def tool_guided(plan: ToolPlan | None) -> dict | None:
    """The guided spec (services/protocol.py) that forces a call: for "required" and a named function."""
    if plan is None or plan.choice == "auto":
        return None
    tools = [t for t in plan.tools if plan.function is None or t["function"]["name"] == plan.function]
    lark = tool_lark(tools, plan.parallel)
    if len(lark) > MAX_GUIDED_CHARS:
        raise invalid(f"the tools' schemas take {len(lark)} characters as a grammar; a forced tool_choice takes "
                      f"at most {MAX_GUIDED_CHARS}", "tools")
    return checked("lark", lark, "tools", "grammar")


def tool_lark(tools: list[dict], parallel: bool = True) -> str:
    """The Lark grammar (llguidance's: `%json` embeds a JSON schema) of one or more Hermes calls (one
    when not `parallel`), each `{"name": <a tool's name>, "arguments": <its parameters>}`:

        start: call ("\\n" call)*
        call: "<tool_call>\\n" (fn_0 | fn_1) "\\n</tool_call>"
        fn_0: %json {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {...}},
                     "required": ["name", "arguments"], "additionalProperties": false, "x-guidance": {...}}
    """
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    rules = [start, f'call: "<tool_call>\\n" ({" | ".join(f"fn_{i}" for i in range(len(tools)))}) "\\n</tool_call>"']
    rules += [f"fn_{i}: %json {json.dumps(call_schema(t), ensure_ascii=False)}" for i, t in enumerate(tools)]
    return "\n".join(rules) + "\n"


def call_schema(tool: dict) -> dict:
    """The JSON schema of one call of `tool`: its name, then arguments matching its parameters (any
    object when it has none), written compactly (`CALL_JSON`, llguidance's `x-guidance` options). The
    parameters' `$defs` / `definitions` move to this schema's root, and their other local references
    ("#", "#/properties/…") are pointed at `arguments`."""
    fn = tool["function"]
    params = dict(fn.get("parameters") or {"type": "object"})
    hoisted = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    schema: dict = {"type": "object",
                    "properties": {"name": {"const": fn["name"]}, "arguments": _repoint(params)},
                    "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": CALL_JSON}
    return schema | {key: _repoint(value) for key, value in hoisted.items()}


def _repoint(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _ref(v) if k == "$ref" and isinstance(v, str) else _repoint(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_repoint(v) for v in value]
    return value


def _ref(ref: str) -> str:
    if not ref.startswith("#") or ref.startswith(("#/$defs/", "#/definitions/")):
        return ref
    return "#/properties/arguments" + ref[1:]


# ------------------------------------------------------------------------------------------ rendering


def speaks_tools(template: Any) -> bool:
    """Whether a chat template renders tools and calls itself (else they are rendered as text here)."""
    if isinstance(template, dict):  # named templates: the default one decides
        template = template.get("default")
    return (isinstance(template, str) and re.search(r"\btools\b", template) is not None
            and re.search(r"\btool_calls\b", template) is not None)


def tools_system_block(tools: tuple[dict, ...] | list[dict]) -> str:
    """The Hermes / Qwen2.5 system text that lists the tools as JSON and asks for `<tool_call>` blocks."""
    return TOOLS_PREAMBLE + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_POSTAMBLE


def call_arguments(value: Any, param: str) -> Any:
    """An assistant call's `arguments`: the JSON object its text holds (OpenAI sends text), or the
    object itself; text that is not JSON is kept as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    if isinstance(value, dict):
        return value
    raise invalid("arguments must be a JSON object or its text", param)


def call_text(name: str, arguments: Any) -> str:
    """An assistant's call as the model writes one."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n" \
           f"{TOOL_CALL_CLOSE}"


def response_text(content: str) -> str:
    """A tool's result as a user-side block."""
    return f"<tool_response>\n{content}\n</tool_response>"


# ------------------------------------------------------------------------------------------ parsing


def parse_tool_calls(text: str, names: frozenset[str] | set[str], parallel: bool = True
                     ) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of generated text: every `<tool_call>` block (or an unclosed last one)
    whose JSON is {"name": <one of names>, "arguments": <object>} becomes an OpenAI tool call; the
    rest of the text (other blocks included) stays content, stripped, None when empty. Without any
    call the text is returned unchanged. Not `parallel`: the first call only."""
    calls, kept, last = [], [], 0
    for match in CALL_BLOCK.finditer(text):
        call = parse_call(match.group(1) if match.group(1) is not None else match.group(2), names)
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls if parallel else calls[:1]


def parse_call(body: str, names: frozenset[str] | set[str]) -> dict | None:
    """One block's JSON as an OpenAI tool call, or None (not JSON, not a call, an unknown function)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolStream:
    """One streamed choice's text with tools in play: text goes out as it comes until a `<tool_call>`
    opening appears (a possible start of one at the end waits for the next text); from there on it is
    held, and parsed when the choice finishes."""

    def __init__(self) -> None:
        self.pending = ""  # not sent yet: a possible start of the opening, or everything from the opening on
        self.holding = False

    def feed(self, text: str) -> str:
        """What of `text` can be sent now."""
        self.pending += text
        if self.holding:
            return ""
        at = self.pending.find(TOOL_CALL_OPEN)
        if at >= 0:
            out, self.pending, self.holding = self.pending[:at], self.pending[at:], True
            return out
        keep = next((n for n in range(min(len(TOOL_CALL_OPEN) - 1, len(self.pending)), 0, -1)
                     if TOOL_CALL_OPEN.startswith(self.pending[-n:])), 0)
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out

    def finish(self, names: frozenset[str] | set[str], parallel: bool = True) -> tuple[str, list[dict]]:
        """(the rest of the text, its calls) once the choice ended: without calls, the held text as it
        is; with calls, the text around them, stripped."""
        held, self.pending = self.pending, ""
        content, calls = parse_tool_calls(held, names, parallel)
        return content or "", calls
