"""Building a drafter of a named kind from a directory (plain Hugging Face or a trained checkpoint).

A trained checkpoint directory holds `manifest.json` (kind, base, layers, k, loss, data, steps),
`drafter/` (Hugging Face format, for the kinds with their own LM) and the kind's extra weights
(`steering.safetensors` for sd2, `dvi_head.safetensors` for dvi).
"""
from __future__ import annotations

import json
from pathlib import Path

from drafter.dvi import DraftHead, DVIConfig, DVIDrafter
from drafter.models import LoadedModel, ModelError, check_same_vocabulary, load_model
from drafter.ngram import NgramDrafter
from drafter.pretrained import PretrainedDrafter
from drafter.proposer import Drafter
from drafter.sd2 import MANIFEST, Steering, SteeredDrafter, steering_for

DRAFTER_KINDS = ("pretrained", "ngram", "sd2", "dvi")
NEEDS_DIR = {"pretrained", "sd2"}


def read_checkpoint_kind(path: Path) -> str | None:
    """The kind in a trained checkpoint's manifest, or None for a plain model directory."""
    manifest = Path(path) / MANIFEST
    return json.loads(manifest.read_text())["kind"] if manifest.is_file() else None


def drafter_lm_dir(path: Path) -> Path:
    """The Hugging Face directory inside a trained checkpoint, or the path itself."""
    path = Path(path)
    return path / "drafter" if (path / MANIFEST).is_file() and (path / "drafter").is_dir() else path


def _load_lm(verifier: LoadedModel, path: Path) -> LoadedModel:
    model = load_model(drafter_lm_dir(path), device=verifier.lean.device, dtype=verifier.lean.dtype)
    check_same_vocabulary(verifier, model)
    return model


def build_drafter(kind: str, verifier: LoadedModel, drafter_dir: str | Path | None) -> Drafter:
    """A drafter of `kind` paired with `verifier`; refuses unknown kinds and mismatched vocabularies."""
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; choose one of {', '.join(DRAFTER_KINDS)}")
    if kind in NEEDS_DIR and drafter_dir is None:
        raise ValueError(f"drafter kind {kind!r} needs --drafter DIR")
    found = None if drafter_dir is None else read_checkpoint_kind(drafter_dir)
    if found is not None and found != kind and not (kind == "pretrained" and found == "sd2"):
        raise ModelError(f"{drafter_dir} holds a {found!r} checkpoint, not {kind!r}")
    if kind == "ngram":
        return NgramDrafter(verifier.vocab_size)
    if kind == "dvi":
        head = DraftHead.load(drafter_dir, verifier.hf) if drafter_dir else DraftHead(verifier.hf, DVIConfig())
        return DVIDrafter(verifier.lean, head)
    lm = _load_lm(verifier, drafter_dir)
    if kind == "pretrained":
        return PretrainedDrafter(lm.lean)
    steering = Steering.load(drafter_dir) if found == "sd2" else steering_for(verifier.hf.config, lm.hf.config)
    return SteeredDrafter(lm.lean, steering)

