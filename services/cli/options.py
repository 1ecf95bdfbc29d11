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
Learner = Annotated[str, typer.Option(help="the online learner: off | kl | klrl | lk")]
RayAddress = Annotated[Optional[str], typer.Option(help="join this Ray cluster (default: a local instance)")]
Registry = Annotated[Optional[Path], typer.Option(
    help="drafter registry folder (default: one per model pair under the cache)")]
Cache = Annotated[Path, typer.Option(help="where fetched models and registries live")]
Minutes = Annotated[float, typer.Option(help="time budget in minutes")]
Out = Annotated[Path, typer.Option(help="output directory")]
DEFAULT_CACHE = Path.home() / ".cache" / "specloop"


# ---------------------------------------------------------------- option groups


@dataclass
class Models:
    """The model pair: MODEL (the verifier; --verifier is its hidden alias) and --drafter."""

    model: Annotated[Optional[Path], typer.Argument(
        metavar="MODEL", envvar="SPECLOOP_MODEL", show_default=False,
        help="the verifier's model directory")] = None
    verifier: Annotated[Optional[Path], typer.Option(hidden=True, help="the same as MODEL")] = None
    drafter: Drafter = None
    sources: dict = field(default_factory=dict, init=False, repr=False)  # field -> click ParameterSource name

    def verifier_dir(self) -> Path | None:
        """MODEL or --verifier, whichever comes from the stronger source (command line > environment >
        config); the same source giving two different directories is a UsageError."""
        given = [(RANK.get(self.sources.get(n, "DEFAULT"), 0), v) for n, v in (("model", self.model),
                                                                             ("verifier", self.verifier)) if v]
        if not given:
            return None
        best = max(rank for rank, _ in given)
        chosen = {Path(v) for rank, v in given if rank == best}
        if len(chosen) > 1:
            raise UsageError(f"MODEL and --verifier name different directories: {' vs '.join(map(str, chosen))}")
        return chosen.pop()

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
