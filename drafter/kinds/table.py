"""The drafter kinds (`KINDS`, one `KindSpec` row each: how a kind is built, what it needs, how the learner
trains it, what its replay records keep) and building a drafter of a named kind from a directory (plain
Hugging Face or a trained checkpoint).

A trained checkpoint directory holds `manifest.json` (kind, base, layers, k, loss, data, steps),
`drafter/` (Hugging Face format, for the kinds with their own LM) and the kind's extra weights
(`steering.safetensors` for sd2, `dvi_head.safetensors` for dvi, `eagle_head.safetensors` for eagle,
`eagle3_head.safetensors` for eagle3).
"""
from __future__ import annotations

import json
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from specloop.drafter.decode.proposer import Drafter
from specloop.drafter.kinds.dvi import DraftHead, DVIConfig, DVIDrafter
from specloop.drafter.kinds.eagle import EagleDrafter, FeatureHead, new_head
from specloop.drafter.kinds.eagle3 import Eagle3Drafter, Eagle3Head, new_head3
from specloop.drafter.kinds.mix import SPECULATORS, SpeculatorMix
from specloop.drafter.kinds.ngram import NgramDrafter
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.sd2 import MANIFEST, SteeredDrafter, Steering, steering_for
from specloop.drafter.kinds.suffix import OutputStore, SuffixConfig, SuffixDrafter
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.loading import LoadedModel, ModelError, check_same_vocabulary, load_model
from specloop.drafter.model.vocab import load_vocab
from specloop.drafter.model.weights.modes import resolve_mode
from specloop.drafter.model.weights.quant import quantize_decoder

RecordContext = Literal["all", "last", "window", "none"]  # what of a row's committed tokens a replay record keeps
# (specloop.trainer.records.record_context): all of the context window (a drafter LM runs it again), the last
# one (the token the block started from), the head's window of positions, or none


@dataclass(frozen=True)
class Parts:
    """What a kind's `make` assembles a drafter from: the verifier it drafts for, the decoder of its own LM
    (None for the kinds without one), its part (steering or head; None without one) and its draft
    vocabulary (None: the full vocabulary)."""

    verifier: LoadedModel
    lean: LeanDecoder | None
    part: torch.nn.Module | None
    vocab: torch.Tensor | None


# (verifier, its own LM or None, the drafter directory, whether that directory is a checkpoint of this kind)
# -> the kind's part: the checkpoint's trained one, else a fresh one
PartLoader = Callable[[LoadedModel, LoadedModel | None, str | Path | None, bool], torch.nn.Module]


@dataclass(frozen=True)
class KindSpec:
    """What a drafter kind is, in one place: how it is built, what it needs, how the learner trains it and
    what its replay records keep. Builder, learner, records and worker read these facts instead of testing
    kind names, so a new kind is its own module plus one row of `KINDS` (and trainer code only for a new
    training method)."""

    name: str
    make: Callable[[Parts], Drafter]  # the drafter from its parts
    needs_dir: bool = False  # a drafter LM of its own, loaded from --drafter DIR ("lm.*" version weights)
    model_free: bool = False  # no weights: nothing to load, train or version
    part: Literal["steering", "head"] | None = None  # the module it adds to its LM or to the verifier: also the
    #                                                  prefix of its version weights and the builder's attribute
    load_part: PartLoader | None = None
    mixable: bool = False  # follows plain steps: a mix of speculators can hold it (specloop.drafter.kinds.mix)
    stale_on_swap: bool = False  # its own KV cache, adopted across a swap, holds the old weights' KV
    loads_from: tuple[str, ...] = ()  # other kinds whose checkpoints it is built from ("pretrained": an SD² LM)
    method: str | None = None  # the learner's training method (specloop.trainer.students.METHODS); None: untrained
    lr: float = 1e-3  # the learner's default rate for its steering / LoRA / head parameters
    batch: int = 16  # the learner's default records per update
    record_context: RecordContext = "none"
    steer_rows: int | None = 0  # verifier feature rows of a record's `steer` (None: one per context token kept)
    observable: bool = False  # a step left plain gives its records (observed, k = 0: their inputs need nothing
    #                           drafted, only the context or the features the drafter holds: `steer_now`)

    def __post_init__(self):
        if (self.part is None) != (self.load_part is None):
            raise ValueError(f"drafter kind {self.name!r}: a part and its loader come together")
        if self.model_free and (self.needs_dir or self.part or self.method):
            raise ValueError(f"drafter kind {self.name!r}: a model-free kind has no LM, part or training")

    @property
    def trainable(self) -> bool:
        return self.method is not None

    @property
    def head(self) -> bool:
        """A trained head on the verifier (its own file in a checkpoint), no LM of its own."""
        return self.part == "head"


def _ngram(p: Parts) -> Drafter:
    return NgramDrafter(p.verifier.vocab_size)


def _suffix(p: Parts) -> Drafter:
    return SuffixDrafter(p.verifier.vocab_size)


def _plain_lm(p: Parts) -> Drafter:
    assert p.lean is not None  # a needs_dir kind: the builder loaded its LM
    return PretrainedDrafter(p.lean)


def _steered_lm(p: Parts) -> Drafter:
    assert p.lean is not None  # a needs_dir kind: the builder loaded its LM
    assert isinstance(p.part, Steering)  # loaded by _steering (or a copy of it)
    return SteeredDrafter(p.lean, p.part)


def _dvi(p: Parts) -> Drafter:
    assert isinstance(p.part, DraftHead)  # loaded by _dvi_head (or a copy of it)
    return DVIDrafter(p.verifier.lean, p.part, p.vocab)


def _eagle(p: Parts) -> Drafter:
    assert isinstance(p.part, FeatureHead)  # loaded by _eagle_head (or a copy of it)
    return EagleDrafter(p.verifier.lean, p.part, p.vocab)


def _eagle3(p: Parts) -> Drafter:
    assert isinstance(p.part, Eagle3Head)  # loaded by _eagle3_head (or a copy of it)
    return Eagle3Drafter(p.verifier.lean, p.part, p.vocab)


def _trained_dir(drafter_dir: str | Path | None) -> Path:
    """The checkpoint directory a trained part loads from (`trained` means there is one)."""
    assert drafter_dir is not None, "a trained part loads from its checkpoint directory"
    return Path(drafter_dir)


def _steering(verifier: LoadedModel, lm: LoadedModel | None, drafter_dir: str | Path | None,
              trained: bool) -> torch.nn.Module:
    if trained:
        return Steering.load(_trained_dir(drafter_dir))
    assert lm is not None  # sd2 needs_dir: the builder loaded its LM
    return steering_for(verifier.config, lm.config)


def _dvi_head(verifier: LoadedModel, lm: LoadedModel | None, drafter_dir: str | Path | None,
              trained: bool) -> torch.nn.Module:
    """Starts from the verifier's float LM head and norm: its module (loaded now where load_model did not keep
    it; the verifier's decoder may be quantized)."""
    return DraftHead.load(_trained_dir(drafter_dir), verifier.hf) if trained else DraftHead(verifier.hf, DVIConfig())


def _eagle_head(verifier: LoadedModel, lm: LoadedModel | None, drafter_dir: str | Path | None,
                trained: bool) -> torch.nn.Module:
    """An untrained head drafts noise until the learner trains it."""
    return FeatureHead.load(_trained_dir(drafter_dir)) if trained else new_head(verifier.lean)


def _eagle3_head(verifier: LoadedModel, lm: LoadedModel | None, drafter_dir: str | Path | None,
                 trained: bool) -> torch.nn.Module:
    return Eagle3Head.load(_trained_dir(drafter_dir)) if trained else new_head3(verifier.lean)


# The eagle heads arrive trained offline and are fine-tuned: at lr 1e-3 and 16 records (~32 positions) per update
# the fetched head drifted on the real pair (klrl: code 0.97x, back on chat 0.91x the frozen head); at 2e-4 and
# 64 it holds chat (0.98x) and gains on code (bench/README.md 17). Steering, LoRA heads and small drafters keep
# the defaults (1e-3, 16).
KINDS: dict[str, KindSpec] = {spec.name: spec for spec in (
    KindSpec("pretrained", make=_plain_lm, needs_dir=True, stale_on_swap=True, loads_from=("sd2",),
             method="distill", record_context="all", observable=True),
    KindSpec("ngram", make=_ngram, model_free=True),
    KindSpec("suffix", make=_suffix, model_free=True),
    KindSpec("sd2", make=_steered_lm, needs_dir=True, part="steering", load_part=_steering, stale_on_swap=True,
             method="sd2", record_context="all", steer_rows=3),
    KindSpec("dvi", make=_dvi, part="head", load_part=_dvi_head, method="dvi"),
    KindSpec("eagle", make=_eagle, part="head", load_part=_eagle_head, mixable=True, method="eagle",
             lr=2e-4, batch=64, record_context="last", steer_rows=1, observable=True),
    KindSpec("eagle3", make=_eagle3, part="head", load_part=_eagle3_head, mixable=True, method="eagle3",
             lr=2e-4, batch=64, record_context="window", steer_rows=None, observable=True),
)}
DRAFTER_KINDS = tuple(KINDS)  # what --drafter-kind accepts
TRAINABLE_KINDS = tuple(name for name, spec in KINDS.items() if spec.trainable)  # what the learner trains


def read_checkpoint_manifest(path: str | Path | None) -> dict:
    """A trained checkpoint's manifest, or {} for a plain model directory (or none)."""
    manifest = None if path is None else Path(path) / MANIFEST
    return json.loads(manifest.read_text()) if manifest is not None and manifest.is_file() else {}


def read_checkpoint_kind(path: str | Path) -> str | None:
    """The kind in a trained checkpoint's manifest, or None for a plain model directory."""
    return read_checkpoint_manifest(path).get("kind")


def _check_kind(explicit: str | None, found: str | None, drafter_dir) -> None:
    """Refuse an unknown kind, and one the checkpoint's manifest contradicts ("pretrained" may take an
    SD² checkpoint's LM alone)."""
    if explicit is not None and explicit not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind {explicit!r}; choose one of {', '.join(DRAFTER_KINDS)}")
    if found is not None and explicit is not None and explicit != found and found not in KINDS[explicit].loads_from:
        raise ModelError(f"{drafter_dir} holds a {found!r} drafter (its manifest.json says so), not {explicit!r}: "
                         f"drop --drafter-kind or pass {found!r}")


def resolve_kind(explicit: str | None, drafter_dir: str | Path | None) -> str | None:
    """The drafter kind to build: the checkpoint manifest's when there is one (an explicit kind that
    disagrees is an error, except "pretrained", which takes an SD² checkpoint's LM alone), else the
    explicit one, else "pretrained" for a plain model directory, else None (no drafter given)."""
    found = None if drafter_dir is None or not Path(drafter_dir).is_dir() else read_checkpoint_kind(drafter_dir)
    _check_kind(explicit, found, drafter_dir)
    return explicit or found or ("pretrained" if drafter_dir is not None else None)


def drafter_lm_dir(path: Path) -> Path:
    """The Hugging Face directory inside a trained checkpoint, or the path itself."""
    path = Path(path)
    return path / "drafter" if (path / MANIFEST).is_file() and (path / "drafter").is_dir() else path


def _load_lm(verifier: LoadedModel, path: Path) -> LoadedModel:
    model = load_model(drafter_lm_dir(path), device=verifier.lean.device, dtype=verifier.dtype)
    check_same_vocabulary(verifier, model)
    return model


def build_drafter(kind: str, verifier: LoadedModel, drafter_dir: str | Path | None, weights: str | None = None,
                  speculators: tuple[str, ...] = ()) -> Drafter:
    """A drafter of `kind` paired with `verifier`; refuses unknown kinds and mismatched vocabularies.
    `weights`: the weight mode of a drafter LM of its own (specloop.drafter.model.weights.quant; None: as loaded).
    `speculators`: others chosen per step and row beside it (specloop.drafter.kinds.mix: "static", "suffix")."""
    return DrafterBuilder(kind, verifier, drafter_dir, weights, speculators).base


DEFAULT_SPECULATORS = ("suffix",)  # beside a mixable drafter when the user names none: the prompt as a free drafter


def default_speculators(kind: str) -> tuple[str, ...]:
    """The speculators beside a `kind` drafter when none are named: suffix decoding over the request's own
    prompt and turns (and earlier outputs) beside a learned head, chosen per step and row; nothing beside
    the other kinds (their drafters miss plain steps, which a mix needs)."""
    return DEFAULT_SPECULATORS if kind in KINDS and KINDS[kind].mixable else ()


def check_speculators(kind: str, speculators: tuple[str, ...]) -> tuple[str, ...]:
    """The speculators beside a `kind` drafter, refused where they make no sense."""
    unknown = [s for s in speculators if s not in SPECULATORS]
    if unknown:
        raise ValueError(f"unknown speculator {unknown[0]!r}; choose from {', '.join(SPECULATORS)}")
    if speculators and kind in KINDS and KINDS[kind].model_free:
        raise ValueError(f"speculators join a model drafter, not the model-free {kind!r} kind")
    return tuple(dict.fromkeys(speculators))


class DrafterBuilder:
    """Drafters of one kind: the base one (as loaded from its directory) and, with `build`, the base
    plus a registry version's weights.

    Weight names are the learner's ("lm.*" drafter LM parameters, then the kind's part: "steering.*" SD²
    steering, "head.*" a head); a version holds the parameters its learner trains, the rest come from the
    base. Building copies the base modules, so the serving drafter is never written in place.
    """

    def __init__(self, kind: str, verifier: LoadedModel, drafter_dir: str | Path | None, weights: str | None = None,
                 speculators: tuple[str, ...] = ()):
        _check_kind(kind, None, drafter_dir)
        self.spec = spec = KINDS[kind]
        self.speculators = check_speculators(kind, tuple(speculators))
        self.store = OutputStore(SuffixConfig().global_tokens) if "suffix" in self.speculators else None
        if spec.needs_dir and drafter_dir is None:
            raise ValueError(f"drafter kind {kind!r} needs --drafter DIR")
        manifest = read_checkpoint_manifest(drafter_dir)  # read once: kind, draft vocabulary
        found = manifest.get("kind")
        _check_kind(kind, found, drafter_dir)
        self.kind, self.verifier = kind, verifier
        self.weights = None if weights is None else resolve_mode(weights, verifier.lean.device, role="drafter")
        # no directory: no manifest, so the full vocabulary
        self.vocab = (None if spec.model_free or drafter_dir is None
                      else load_vocab(Path(drafter_dir), manifest, verifier.vocab_size))
        self.lm = _load_lm(verifier, Path(drafter_dir)) if spec.needs_dir and drafter_dir is not None else None
        # load_part is set exactly when part is (KindSpec.__post_init__)
        self.part = None if spec.load_part is None else spec.load_part(verifier, self.lm, drafter_dir, found == kind)
        self.base = self._mixed(self._assemble(self.lm.lean if self.lm else None, self.part))

    @property
    def steering(self) -> torch.nn.Module | None:
        """The SD² steering the versions train (None for the other kinds)."""
        return self.part if self.spec.part == "steering" else None

    @property
    def head(self) -> torch.nn.Module | None:
        """The head on the verifier the versions train (None for the kinds without one)."""
        return self.part if self.spec.head else None

    def _mixed(self, drafter: Drafter) -> Drafter:
        """`drafter` alone, or as the adaptive member of a mix with the configured speculators (a static
        copy of the base weights with row state of its own; suffix decoding over the builder's one store)."""
        if not self.speculators:
            return drafter
        members = {"adaptive": drafter}
        if "static" in self.speculators:
            members["static"] = self._assemble(self.lm.lean if self.lm else None, self.part)
        if "suffix" in self.speculators:
            members["suffix"] = SuffixDrafter(self.verifier.vocab_size, store=self.store)
        return SpeculatorMix(members)

    def _assemble(self, lean: LeanDecoder | None, part: torch.nn.Module | None) -> Drafter:
        """The kind's drafter from an LM decoder of its own (restricted to the draft vocabulary and put in its
        weight mode first) and its part."""
        if lean is not None:
            if self.vocab is not None and lean.vocab_ids is None:
                lean.restrict_vocab(self.vocab)
            if self.weights is not None and lean.quant is None:
                quantize_decoder(lean, self.weights)  # after the restriction: the smaller head is packed
        return self.spec.make(Parts(self.verifier, lean, part, self.vocab))

    def build(self, weights: dict | None = None) -> Drafter:
        """The base drafter when `weights` is empty or None; else a new one with them loaded."""
        if not weights or self.spec.model_free:
            return self.base
        # the LM's module: loaded on the first version
        lean = None if self.lm is None else LeanDecoder(_loaded(self.lm.hf, weights, "lm."))
        part = None if self.part is None else _loaded(self.part, weights, f"{self.spec.part}.")
        return self._mixed(self._assemble(lean, part))


def _loaded(module: torch.nn.Module, weights: dict, prefix: str) -> torch.nn.Module:
    """A deep copy of `module` with the `prefix`-named tensors of `weights` loaded into it."""
    copy = deepcopy(module)
    state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    if state:
        missing_unexpected = copy.load_state_dict(state, strict=False)
        if missing_unexpected.unexpected_keys:
            raise ModelError(f"version weights do not fit the {prefix[:-1]} module: "
                             f"{missing_unexpected.unexpected_keys[:3]}")
    return copy.eval()
