"""Building a drafter of a named kind."""
from __future__ import annotations

from pathlib import Path

from drafter.models import LoadedModel, check_same_vocabulary, load_model
from drafter.ngram import NgramDrafter
from drafter.pretrained import PretrainedDrafter
from drafter.proposer import Drafter

DRAFTER_KINDS = ("pretrained", "ngram")
NEEDS_DIR = {"pretrained"}


def build_drafter(kind: str, verifier: LoadedModel, drafter_dir: str | Path | None) -> Drafter:
    """A drafter of `kind` paired with `verifier`; refuses unknown kinds and mismatched vocabularies."""
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; choose one of {', '.join(DRAFTER_KINDS)}")
    if kind == "ngram":
        return NgramDrafter(verifier.vocab_size)
    if drafter_dir is None:
        raise ValueError(f"drafter kind {kind!r} needs --drafter DIR")
    model = load_model(drafter_dir, device=verifier.lean.device, dtype=verifier.lean.dtype)
    check_same_vocabulary(verifier, model)
    return PretrainedDrafter(model.lean)
