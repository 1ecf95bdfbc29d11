"""`specloop models bootstrap|fetch` and `specloop train offline`: making the models specloop serves.

Torch and the trainers are imported when a command runs, not when the CLI is built (the operator
commands stay light); the choices that live in torch modules are checked by OfflineConfig.validate.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from specloop.services.cli.options import DEFAULT_CACHE, Cache, Globals, Minutes, Out, Seed, UsageError, Verifier
from specloop.services.cli.runtime import CommandError, use_threads

models = typer.Typer(help="Fetch a real model pair, or bootstrap one locally.", no_args_is_help=True)
train = typer.Typer(help="Train drafters.", no_args_is_help=True)

Int = Annotated[int, typer.Option()]


@models.command()
def bootstrap(out: Out, glob: Globals, minutes: Minutes = 4.0, seed: Seed = 0) -> int:
    """Train a tokenizer, verifier and drafter from local corpora."""
    from specloop.trainer.bootstrap import BootstrapConfig, bootstrap_models

    use_threads(glob.threads)
    summary = bootstrap_models(BootstrapConfig(out_dir=str(out), minutes=minutes, seed=seed, threads=glob.threads))
    print(json.dumps(summary, indent=2))
    return 0


@models.command()
def fetch(glob: Globals,
          name: Annotated[str, typer.Argument(metavar="NAME", help="model name")] = "smollm2-135m-instruct",
          out: Annotated[Optional[Path], typer.Option(
              help="output directory (default: the cache's models/NAME)")] = None,
          drafter_method: Annotated[Literal["eagle", "eagle3", "sd2", "distill"], typer.Option(
              help="the drafter to build: eagle (a feature head self-distilled from the verifier's own answers; "
                   "OUT/drafter), eagle3 (the EAGLE-3-style head, the same way; OUT/drafter-eagle3), "
                   "sd2 (a two-layer copy of the verifier, SD²-steered and aligned; OUT/drafter-sd2), "
                   "distill (the same copy, plain; OUT/drafter-distill)")] = "eagle",
          drafter_minutes: Annotated[Optional[float], typer.Option(
              help="offline training budget of the drafter "
                   "(default: 3 for sd2 and distill, 4.5 for the heads)")] = None,
          cache: Cache = DEFAULT_CACHE) -> int:
    """A real pretrained verifier and a drafter built for it."""
    from specloop.trainer.fetch import FetchConfig, default_out, fetch_models
    from specloop.trainer.gguf import FetchError

    if drafter_minutes is not None and drafter_minutes <= 0:
        raise UsageError("--drafter-minutes must be > 0")
    use_threads(glob.threads)
    try:
        summary = fetch_models(FetchConfig(name=name, out=out or default_out(cache, name), method=drafter_method,
                                           drafter_minutes=drafter_minutes, threads=glob.threads))
    except FetchError as exc:
        raise CommandError(str(exc)) from None
    print(json.dumps(summary, indent=2))
    print(f"specloop generate {summary['verifier']} --drafter {summary['drafter']} --prompts FILE", file=sys.stderr)
    return 0


@dataclass
class OfflineOptions:
    """The options of `specloop train offline` (defaults: specloop.trainer.offline.OfflineConfig's)."""

    method: Annotated[str, typer.Option(help="distill | sd2 | sd2-frozen | dvi | eagle | eagle3")]
    verifier: Verifier
    out: Annotated[Path, typer.Option(help="output (and checkpoint) directory")]
    drafter: Annotated[Optional[Path], typer.Option(
        help="drafter LM to start from (distill/sd2/sd2-frozen); with dvi only used to speed up --data "
             "generated when --gen-k > 0")] = None
    data: Annotated[str, typer.Option(
        help="teacher-forced | generated | code | self-distilled (an eagle or eagle3 head from the verifier's own "
             "answers, 4/9 of --minutes decoding them)")] = "teacher-forced"
    loss: Annotated[str, typer.Option(help="kl | tv | lk")] = "kl"
    k: Annotated[int, typer.Option(help="SD²: random offset δ in 1..k; eagle, eagle3: unrolled up to k drafts")] = 8
    minutes: Annotated[Optional[float], typer.Option(help="wall-clock budget (across resumed runs)")] = None
    max_steps: Annotated[Optional[int], typer.Option(help="step budget")] = None
    lr: Annotated[float, typer.Option(help="peak LR of steering / LoRA parameters")] = 1e-3
    lm_lr: Annotated[float, typer.Option(help="peak LR of drafter LM parameters")] = 3e-4
    weight_decay: Annotated[float, typer.Option(help="drafter LM matrices only")] = 0.0
    warmup_steps: Int = 20
    batch_size: Int = 8
    seq_len: Int = 128
    seed: Seed = 0
    dvi_layers: Annotated[int, typer.Option(help="DVI: verifier layers s under the head")] = 2
    steer_layers: Annotated[Optional[tuple[int, int, int]], typer.Option(
        metavar="I I I", help="SD²: three 0-based verifier layers (default: layers 3, L/2, L−2)")] = None
    resume: Annotated[bool, typer.Option(help="continue from OUT/checkpoint")] = False
    checkpoint_every: Int = 100
    data_cache: Annotated[Optional[Path], typer.Option(
        help="directory of the generated-data cache (default OUT/data)")] = None
    gen_batch: Int = 32
    gen_k: Annotated[int, typer.Option(help="draft length while generating (0: verifier alone)")] = 0
    gen_max_tokens: Int = 128
    draft_vocab: Annotated[Optional[Path], typer.Option(
        help="FR-Spec draft vocabulary (draft_vocab.safetensors): train over its rows only and draft over "
             "them when served")] = None
    freeze_embeddings: Annotated[bool, typer.Option(help="distill / sd2: keep embeddings fixed")] = False
    teacher_dtype: Annotated[str, typer.Option(
        help="the verifier's forward: fp32 | bf16 | auto (bf16 where the CPU has native bf16)")] = "fp32"


@train.command()
def offline(options: OfflineOptions, glob: Globals) -> int:
    """Align a drafter with the verifier offline."""
    from specloop.trainer.offline import train_offline
    from specloop.trainer.offline_config import config_from_options

    use_threads(glob.threads)
    print(json.dumps(train_offline(config_from_options(vars(options), glob.threads)), indent=2))
    return 0
