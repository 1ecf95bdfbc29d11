"""The options of the `specloop` commands, each declared once.

An option used by several commands is an `Annotated` alias here; options that travel together
(the model pair, sampling, weight modes, the HTTP endpoint, the global options) are option
groups: dataclasses whose fields are such aliases. A command takes a group as one parameter
(`sampling: Sampling`) and `specloop.services.cli.runtime.expand` turns its fields into Typer options.

Every option also reads `SPECLOOP_<NAME>` from the environment (the commands' auto_envvar_prefix;
explicit names where the parameter's name differs from the option's, e.g. --json). Kept free of
torch: choices that live in torch modules are checked where the values are used.
"""
from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

RANK = {"COMMANDLINE": 3, "PROMPT": 3, "ENVIRONMENT": 2, "DEFAULT_MAP": 1, "DEFAULT": 0}  # click's ParameterSource


class UsageError(ValueError):
    """Bad input from the command line: reported as one line and exit code 2."""


def draft_len(value) -> int | None:
    """--k: "auto" (None: chosen per step by the cost-aware controller) or a fixed draft length."""
    if value is None or value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"expected 'auto' or an integer, got {value!r}") from None


# ---------------------------------------------------------------- single options

# specloop.drafter.model.weights.quant.DTYPE_MODES (no torch here)
WeightMode = Literal["auto", "fp32", "bf16", "int8", "int4", "w4a8"]
Verifier = Annotated[Path, typer.Option(help="the verifier's model directory")]
Drafter = Annotated[Optional[Path], typer.Option(help="the drafter: a checkpoint or drafter LM directory")]
DrafterKind = Annotated[Optional[str], typer.Option(
    help="default: the checkpoint manifest's kind, else pretrained (with --drafter); or suffix / ngram (model-free)")]
Speculators = Annotated[Optional[str], typer.Option(
    metavar="static,suffix|none", show_default=False,
    help="speculators chosen per step and row beside the drafter: static (a frozen copy of its base weights "
         "beside the learner's versions), suffix (suffix decoding over the prompt, the turns and earlier "
         "outputs); comma-separated, or none. Default: suffix beside an eagle / eagle3 head, none otherwise")]
Prompts = Annotated[Path, typer.Option(help="JSON lines: {id, prompt} or {id, messages}")]
Stop = Annotated[Optional[list[str]], typer.Option(show_default=False, help="stop string (repeatable)")]
DraftLenAuto = Annotated[Optional[int], typer.Option(
    "--k", parser=draft_len, metavar="auto|K", show_default="auto",
    help="draft length per block: auto chooses it step by step from measured costs and live acceptance "
         "(0 = plain decoding when speculation does not pay); K fixes it")]
MaxTokens = Annotated[int, typer.Option(help="new tokens per request")]
Temperature = Annotated[float, typer.Option(help="0 = greedy")]
Seed = Annotated[int, typer.Option(help="random seed")]
Json = Annotated[bool, typer.Option("--json", envvar="SPECLOOP_JSON", help="JSON lines on stdout")]
JsonSchema = Annotated[Optional[str], typer.Option(
    "--json-schema", metavar="SCHEMA|FILE", show_default=False,
    help="every answer JSON matching this schema (its JSON text, or a file holding it), as llama.cpp's --json-schema")]
Regex = Annotated[Optional[str], typer.Option(
    "--regex", metavar="PATTERN", show_default=False, help="every answer matching this regular expression")]
GrammarFile = Annotated[Optional[Path], typer.Option(
    "--grammar-file", metavar="FILE", show_default=False,
    help="every answer in this grammar: Lark (llguidance's dialect) or GBNF (llama.cpp's --grammar-file), converted")]
Learner = Annotated[str, typer.Option(help="the online learner: off | kl | klrl | lk")]
RayAddress = Annotated[Optional[str], typer.Option(help="join this Ray cluster (default: a local instance)")]
Registry = Annotated[Optional[Path], typer.Option(
    help="drafter registry folder (default: one per model pair under the cache)")]
Cache = Annotated[Path, typer.Option(help="where fetched models and registries live")]
Minutes = Annotated[float, typer.Option(help="time budget in minutes")]
Out = Annotated[Path, typer.Option(help="output directory")]
DEFAULT_CACHE = Path.home() / ".cache" / "specloop"


# ---------------------------------------------------------------- vLLM's names (`specloop serve`, docs/usage.md)

DTYPES = {"auto": None, "bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32", "float": "fp32"}
HALF = ("half", "float16", "fp16")
QUANTIZATIONS = ("int8", "int4", "w4a8")  # the quantized weight modes (specloop.drafter.model.weights.quant)
Dtype = Annotated[str, typer.Option(
    metavar="auto|bfloat16|float32",
    help="vLLM's --dtype: the verifier's weights and activations (bfloat16 = --weights bf16, float32 = --weights "
         "fp32; auto: as --weights says). float16 is not served")]
Quantization = Annotated[Optional[str], typer.Option(
    metavar="int8|int4|w4a8", show_default=False,
    help="vLLM's --quantization, for the modes specloop has (= --weights int8 | int4 | w4a8); awq, gptq, fp8 and "
         "the other vLLM methods are not served")]
SpeculativeConfig = Annotated[Optional[str], typer.Option(
    metavar="JSON", show_default=False,
    help="vLLM's --speculative-config: {\"method\": ngram|suffix|eagle|eagle3|draft_model, \"model\": the drafter "
         "directory, \"num_speculative_tokens\": K} (beside or instead of --drafter / --drafter-kind; K: see "
         "docs/usage.md, the draft length stays per step or per request)")]
SPEC_METHODS = {"ngram": "ngram", "suffix": "suffix", "eagle": "eagle", "eagle3": "eagle3", "draft_model": "pretrained"}
SPEC_KEYS = ("method", "model", "num_speculative_tokens")
MaxModelLen = Annotated[Optional[int], typer.Option(
    show_default=False,
    help="positions per request (prompt + output + the drafting reserve). Default: the model's "
         "max_position_embeddings, lowered so one worker's KV cache (--max-num-seqs x positions) fits "
         "in 4 GiB, never below 1024")]
MaxNumSeqs = Annotated[Optional[int], typer.Option(
    show_default=False, help="requests decoded together per worker (its continuous-batch slots). Default: 8")]
ChatTemplate = Annotated[Optional[str], typer.Option(
    metavar="FILE|TEMPLATE", show_default=False,
    help="the chat template of /v1/chat/completions instead of the tokenizer's own: a Jinja file, or the "
         "template itself on one line (read at start-up)")]
UvicornLogLevel = Annotated[Literal["debug", "info", "warning", "error", "critical", "trace"], typer.Option(
    help="uvicorn's log level (info and below: with its access log)")]
KV_CACHE_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                   "half": "float16", "float32": "float32", "fp32": "float32",
                   "float": "float32"}  # --kv-cache-dtype's names -> specloop.drafter.model.attention.KV_DTYPES
KvCacheDtype = Annotated[str, typer.Option(
    metavar="auto|bfloat16|float16|float32",
    help="vLLM's --kv-cache-dtype: auto = the model's dtype on a GPU (bf16 for a bf16 model), fp32 on the CPU; "
         "bfloat16 / float16 / float32 choose (16 bits: half the bytes a long context's step reads, rounded as "
         "written). fp8 is not served")]
EnforceEager = Annotated[bool, typer.Option(
    "--enforce-eager", help="vLLM's: no compiled step and no CUDA graphs on a GPU (the eager backend, as the CPU "
                            "runs anyway)")]
PrefixCaching = Annotated[bool, typer.Option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    help="reuse the KV cache of a prompt prefix earlier requests computed (vLLM v1's default)")]


def served_kv_dtype(value: str) -> str:
    """--kv-cache-dtype's value as specloop names it (auto, bfloat16, float16, float32); fp8 is a UsageError."""
    name = value.strip().lower()
    if name.startswith("fp8"):
        raise UsageError(f"--kv-cache-dtype {value}: specloop keeps no fp8 KV cache; use auto (the model's dtype on a "
                         "GPU), bfloat16, float16 or float32")
    if name not in KV_CACHE_DTYPES:
        raise UsageError(f"--kv-cache-dtype {value}: choose auto, bfloat16 (bf16), float16 (fp16) or float32 (fp32)")
    return KV_CACHE_DTYPES[name]


def served_weights(dtype: str, quantization: str | None, weights: str) -> str:
    """The verifier's weight mode from vLLM's --dtype and --quantization and specloop's --weights: the one
    mode they name (auto where none does); two that name different modes are a UsageError."""
    dtype = dtype.strip().lower()
    if dtype in HALF:
        raise UsageError(f"--dtype {dtype}: specloop does not serve float16 weights; use --dtype bfloat16 "
                         "(or float32)")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: choose auto, bfloat16 (bf16) or float32 (fp32, float)")
    quant = None if quantization is None else quantization.strip().lower()
    if quant is not None and quant not in QUANTIZATIONS:
        raise UsageError(f"--quantization {quant}: specloop serves {', '.join(QUANTIZATIONS)} (its own weight "
                         "modes, quantized at load); not vLLM's other methods (awq, gptq, fp8, bitsandbytes, ...): "
                         "serve the float checkpoint with one of those")
    named = {flag: mode for flag, mode in (("--dtype", DTYPES[dtype]), ("--quantization", quant),
                                          ("--weights", None if weights == "auto" else weights)) if mode}
    if len(set(named.values())) > 1:
        given = " and ".join(f"{flag} {mode}" for flag, mode in named.items())
        hint = (" (a quantized mode chooses its own activation dtype: leave --dtype auto with --quantization)"
                if "--quantization" in named and "--dtype" in named else "")
        raise UsageError(f"{given} name different weight modes; give one{hint}")
    return next(iter(named.values()), "auto")


@dataclass(frozen=True)
class Speculation:
    """What --speculative-config asks for: the drafter kind, its directory (None: none or model-free) and
    vLLM's num_speculative_tokens (None: not given)."""

    kind: str | None
    drafter: Path | None
    num_speculative_tokens: int | None


def parse_speculative_config(text: str) -> Speculation:
    """vLLM's --speculative-config JSON, mapped onto specloop's drafter kinds (SPEC_METHODS). A method
    without a `model` needs none (ngram, suffix; eagle / eagle3: an untrained head); `model` without a
    method: the kind its checkpoint manifest names, else a draft model (kind None here)."""
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--speculative-config: not JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise UsageError("--speculative-config: expected a JSON object, e.g. '{\"method\": \"ngram\"}'")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise UsageError(f"--speculative-config: unknown key(s) {', '.join(unknown)} "
                         f"(accepted: {', '.join(SPEC_KEYS)})")
    method, model, k = spec.get("method"), spec.get("model"), spec.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise UsageError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    if model is not None and not isinstance(model, str):
        raise UsageError(f"--speculative-config: model must be a directory (a string), got {model!r}")
    if method == "mtp":
        raise UsageError("--speculative-config: method mtp (the model's own multi-token-prediction layers) is not "
                         f"served by specloop; use one of {', '.join(SPEC_METHODS)}")
    if method is not None and method not in SPEC_METHODS:
        raise UsageError(f"--speculative-config: unknown method {method!r} (accepted: {', '.join(SPEC_METHODS)})")
    if method is None and model is None:
        raise UsageError("--speculative-config: give a method (ngram, suffix, eagle, eagle3, draft_model) or a model")
    kind = None if method is None else SPEC_METHODS[method]
    if kind in ("ngram", "suffix") and model is not None:
        raise UsageError(f"--speculative-config: method {method} drafts from the text itself and takes no model")
    if method == "draft_model" and model is None:
        raise UsageError("--speculative-config: method draft_model needs a model (the drafter directory)")
    return Speculation(kind, None if model is None else Path(model), k)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: the text of a file, or the template itself given inline (one line,
    backslash escapes such as \\n decoded). A value with no Jinja markup that is no file is a path that
    does not exist: a UsageError."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--chat-template {value}: cannot read it ({exc})") from None
    if not any(mark in value for mark in ("{{", "{%", "{#")):
        raise UsageError(f"--chat-template {value}: no such file (and no Jinja template given inline)")
    return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")


# ---------------------------------------------------------------- option groups

DEFAULT_SLOTS = 8  # --max-num-seqs


@dataclass
class Models:
    """The model pair: MODEL (the verifier; --verifier is its hidden alias) and --drafter."""

    model: Annotated[Optional[Path], typer.Argument(
        metavar="MODEL", envvar="SPECLOOP_MODEL", show_default=False,
        help="the verifier's model directory, or a Hugging Face model id (owner/name) in the local Hugging Face "
             "cache")] = None
    verifier: Annotated[Optional[Path], typer.Option(hidden=True, help="the same as MODEL")] = None
    drafter: Drafter = None
    sources: dict = field(default_factory=dict, init=False, repr=False)  # field -> click ParameterSource name
    repo_id: str | None = field(default=None, init=False, repr=False)  # MODEL was this Hugging Face id

    def verifier_dir(self) -> Path | None:
        """MODEL or --verifier, whichever comes from the stronger source (command line > environment >
        config); the same source giving two different directories is a UsageError. A Hugging Face model
        id (`owner/name`) that is no local directory is found in the local Hugging Face cache
        (specloop.drafter.model.loading.resolve_model_dir; not there: a ModelError, exit code 2)."""
        given = [(RANK.get(self.sources.get(n, "DEFAULT"), 0), v) for n, v in (("model", self.model),
                                                                             ("verifier", self.verifier)) if v]
        if not given:
            return None
        best = max(rank for rank, _ in given)
        chosen = {Path(v) for rank, v in given if rank == best}
        if len(chosen) > 1:
            raise UsageError(f"MODEL and --verifier name different directories: {' vs '.join(map(str, chosen))}")
        path = chosen.pop()
        if path.exists():
            return path
        from specloop.drafter.model.loading import looks_like_repo_id, resolve_model_dir  # torch: only for an id

        resolved = resolve_model_dir(path)
        self.repo_id = str(path) if resolved != path and looks_like_repo_id(path) else None
        return resolved

    def require_verifier(self) -> Path:
        verifier = self.verifier_dir()
        if verifier is None:
            raise UsageError("give the verifier: specloop COMMAND MODEL (or --verifier DIR)")
        return verifier


@dataclass
class Sampling:
    """How tokens are drawn (generate, replay)."""

    max_tokens: MaxTokens = 64
    temperature: Temperature = 0.0
    top_k: Annotated[int, typer.Option(help="0 = off")] = 0
    top_p: Annotated[float, typer.Option(help="1 = off")] = 1.0
    seed: Seed = 0


@dataclass
class Weights:
    """The weight modes of the verifier and of a drafter LM (specloop.drafter.model.weights.quant)."""

    weights: Annotated[WeightMode, typer.Option(
        help="the verifier's weight mode (auto: as the checkpoint is stored, or the mode its manifest.json names, "
             "e.g. w4a8 for a model published as a 4-bit GGUF; int8/int4 quantize it; w4a8: int4 weights times "
             "activations rounded to int8 per 32, as llama.cpp computes a Q4 model)")] = "auto"
    drafter_weights: Annotated[WeightMode, typer.Option(
        help="a drafter LM's weight mode (auto: w4a8 where specloop's kernels build, else int4 where the CPU "
             "has native bf16)")] = "auto"


@dataclass
class Endpoint:
    """Where and how an API process answers (serve, api)."""

    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1"
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000
    api_key: Annotated[Optional[str], typer.Option(
        show_default=False, help="clients must send `Authorization: Bearer KEY` to /v1")] = None
    admin_token: Annotated[Optional[str], typer.Option(
        show_default=False, help="the token of the /admin endpoints (the operator commands' --token)")] = None
    drain_timeout: Annotated[float, typer.Option(
        min=0, help="seconds in-flight requests may take to finish after SIGTERM")] = 30.0
    docs: Annotated[bool, typer.Option(
        "--docs", help="serve the interactive API docs at /docs and the schema at /openapi.json (off by default: "
                       "they list every route to whoever asks)")] = False
    chat_template: ChatTemplate = None
    uvicorn_log_level: UvicornLogLevel = "warning"


@dataclass
class Capacity:
    """How much one worker holds, by vLLM's names: --max-model-len (positions per request) and --max-num-seqs
    (requests decoded together); --max-context and --slots, specloop's earlier names, are hidden aliases
    (command line, SPECLOOP_MAX_CONTEXT / SPECLOOP_SLOTS, --config keys max-context / slots)."""

    max_model_len: MaxModelLen = None
    max_context: Annotated[Optional[int], typer.Option(hidden=True, help="the same as --max-model-len")] = None
    max_num_seqs: MaxNumSeqs = None
    slots: Annotated[Optional[int], typer.Option(hidden=True, help="the same as --max-num-seqs")] = None
    sources: dict = field(default_factory=dict, init=False, repr=False)

    def _pick(self, name: str, alias: str) -> tuple[str, int] | None:
        """(the flag, its value) of the name or its alias, whichever comes from the stronger source; the
        same source giving both, with different values, is a UsageError. Values below 1 are one too."""
        given = [(RANK.get(self.sources.get(n, "DEFAULT"), 0), "--" + n.replace("_", "-"), getattr(self, n))
                 for n in (name, alias) if getattr(self, n) is not None]
        if not given:
            return None
        best = max(rank for rank, _, _ in given)
        chosen = [(flag, value) for rank, flag, value in given if rank == best]
        if len({value for _, value in chosen}) > 1:
            raise UsageError(" and ".join(f"{flag} {value}" for flag, value in chosen) + ": give one")
        flag, value = chosen[0]
        if value < 1:
            raise UsageError(f"{flag} must be >= 1")
        return flag, value

    def context(self) -> tuple[str, int] | None:
        """(flag, positions) of --max-model-len / --max-context, or None: the model's default."""
        return self._pick("max_model_len", "max_context")

    def seqs(self) -> int:
        picked = self._pick("max_num_seqs", "slots")
        return DEFAULT_SLOTS if picked is None else picked[1]


@dataclass
class Globals:
    """Options every command takes, before or after its name (`specloop --threads 2 serve` or
    `specloop serve --threads 2`); --config names a YAML file of option defaults."""

    threads: Annotated[int, typer.Option(min=1, help="torch threads")] = min(os.cpu_count() or 1, 8)
    log_level: Annotated[Optional[Literal["debug", "info", "warning", "error", "critical"]], typer.Option(
        show_default=False, help="level of specloop's log messages (default: as Python's logging has it, "
                                 "warning)")] = None
    config: Annotated[Optional[Path], typer.Option(
        show_default=False, metavar="FILE",
        help="YAML file of option defaults (keys: option long names; the command line and SPECLOOP_* "
             "environment variables take precedence)")] = None
    sources: dict = field(default_factory=dict, init=False, repr=False)


def grammar_option(json_schema: str | None, regex: str | None, grammar_file: Path | None):
    """--json-schema / --regex / --grammar-file as one structured-output spec (specloop.drafter.decode.grammar
    GrammarSpec; None: none given), compiled once here: two given, a file that cannot be read, a schema that is
    not JSON or a grammar that does not compile is a UsageError."""
    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar-file", grammar_file))
             if v is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)}: give one structured-output constraint")
    if not given:
        return None
    from specloop.drafter.decode.grammar import GrammarError, GrammarSpec, check, lark_from  # torch: only when asked

    try:
        if json_schema is not None:
            spec = GrammarSpec("json_schema", _schema_text(json_schema))
        elif regex is not None:
            spec = GrammarSpec("regex", regex)
        else:
            assert grammar_file is not None
            spec = GrammarSpec("lark", lark_from(_read(grammar_file, "--grammar-file")))
        check(spec)
    except GrammarError as exc:
        raise UsageError(f"{given[0]}: {exc}") from None
    return spec


def _schema_text(value: str) -> str:
    """--json-schema's JSON text: the value itself where it is JSON (or looks like an object), else the file it
    names."""
    try:
        schema = json.loads(value)
    except ValueError as exc:
        if value.lstrip().startswith("{"):
            raise UsageError(f"--json-schema: not a JSON schema ({exc})") from None
        try:
            schema = json.loads(_read(Path(value), "--json-schema"))
        except ValueError as exc:
            raise UsageError(f"--json-schema {value}: not a JSON schema ({exc})") from None
    if not isinstance(schema, dict):
        raise UsageError("--json-schema: not a JSON schema (a schema is a JSON object)")
    return json.dumps(schema)


def _read(path: Path, flag: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {path}: not text") from None

