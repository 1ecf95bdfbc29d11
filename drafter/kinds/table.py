"""Building a drafter of a named kind from a directory (plain Hugging Face or a trained checkpoint).

A trained checkpoint directory holds `manifest.json` (kind, base, layers, k, loss, data, steps),
`drafter/` (Hugging Face format, for the kinds with their own LM) and the kind's extra weights
(`steering.safetensors` for sd2, `dvi_head.safetensors` for dvi, `eagle_head.safetensors` for eagle,
`eagle3_head.safetensors` for eagle3).
"""
from __future__ import annotations

import json
from copy import deepcopy
from pathlib import Path

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

DRAFTER_KINDS = ("pretrained", "ngram", "suffix", "sd2", "dvi", "eagle", "eagle3")
HEADS = {"dvi", "eagle", "eagle3"}  # a head on the verifier, no LM of its own
NEEDS_DIR = {"pretrained", "sd2"}
MODEL_FREE = {"ngram", "suffix"}  # no weights: nothing to load, train or version


def read_checkpoint_manifest(path: str | Path | None) -> dict:
    """A trained checkpoint's manifest, or {} for a plain model directory (or none)."""
    manifest = None if path is None else Path(path) / MANIFEST
    return json.loads(manifest.read_text()) if manifest is not None and manifest.is_file() else {}


def read_checkpoint_kind(path: Path) -> str | None:
    """The kind in a trained checkpoint's manifest, or None for a plain model directory."""
    return read_checkpoint_manifest(path).get("kind")


def _check_kind(explicit: str | None, found: str | None, drafter_dir) -> None:
    """Refuse an unknown kind, and one the checkpoint's manifest contradicts ("pretrained" may take an
    SD² checkpoint's LM alone)."""
    if explicit is not None and explicit not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind {explicit!r}; choose one of {', '.join(DRAFTER_KINDS)}")
    if found is not None and explicit is not None and explicit != found and not (explicit == "pretrained" and found == "sd2"):
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


MIXABLE = {"eagle", "eagle3"}  # kinds that follow plain steps: a mix of speculators can hold them (specloop.drafter.kinds.mix)
DEFAULT_SPECULATORS = ("suffix",)  # beside a mixable drafter when the user names none: the prompt as a free drafter


def default_speculators(kind: str) -> tuple[str, ...]:
    """The speculators beside a `kind` drafter when none are named: suffix decoding over the request's own
    prompt and turns (and earlier outputs) beside a learned head, chosen per step and row; nothing beside
    the other kinds (their drafters miss plain steps, which a mix needs)."""
    return DEFAULT_SPECULATORS if kind in MIXABLE else ()


def check_speculators(kind: str, speculators: tuple[str, ...]) -> tuple[str, ...]:
    """The speculators beside a `kind` drafter, refused where they make no sense."""
    unknown = [s for s in speculators if s not in SPECULATORS]
    if unknown:
        raise ValueError(f"unknown speculator {unknown[0]!r}; choose from {', '.join(SPECULATORS)}")
    if speculators and kind in MODEL_FREE:
        raise ValueError(f"speculators join a model drafter, not the model-free {kind!r} kind")
    return tuple(dict.fromkeys(speculators))


class DrafterBuilder:
    """Drafters of one kind: the base one (as loaded from its directory) and, with `build`, the base
    plus a registry version's weights.

    Weight names are the learner's ("lm.*" drafter LM parameters, "steering.*" SD² steering,
    "head.*" DVI head); a version holds the parameters its learner trains, the rest come from the
    base. Building copies the base modules, so the serving drafter is never written in place.
    """

    def __init__(self, kind: str, verifier: LoadedModel, drafter_dir: str | Path | None, weights: str | None = None,
                 speculators: tuple[str, ...] = ()):
        _check_kind(kind, None, drafter_dir)
        self.speculators = check_speculators(kind, tuple(speculators))
        self.store = OutputStore(SuffixConfig().global_tokens) if "suffix" in self.speculators else None
        if kind in NEEDS_DIR and drafter_dir is None:
            raise ValueError(f"drafter kind {kind!r} needs --drafter DIR")
        manifest = read_checkpoint_manifest(drafter_dir)  # read once: kind, draft vocabulary
        found = manifest.get("kind")
        _check_kind(kind, found, drafter_dir)
        self.kind, self.verifier = kind, verifier
        self.weights = None if weights is None else resolve_mode(weights, verifier.lean.device, role="drafter")
        self.vocab = load_vocab(drafter_dir, manifest, verifier.vocab_size) if kind not in MODEL_FREE else None
        self.lm = _load_lm(verifier, drafter_dir) if kind in NEEDS_DIR else None
        self.steering = self.head = None
        if kind == "sd2":
            self.steering = Steering.load(drafter_dir) if found == "sd2" else steering_for(verifier.config, self.lm.config)
        if kind == "dvi":  # the head starts from the verifier's float LM head and norm: its module (loaded now
            # where load_model did not keep it; the verifier's decoder may be quantized)
            self.head = DraftHead.load(drafter_dir, verifier.hf) if found == "dvi" else DraftHead(verifier.hf, DVIConfig())
        if kind == "eagle":  # a trained head, or an untrained one (it drafts noise until the learner trains it)
            self.head = FeatureHead.load(drafter_dir) if found == "eagle" else new_head(verifier.lean)
        if kind == "eagle3":
            self.head = Eagle3Head.load(drafter_dir) if found == "eagle3" else new_head3(verifier.lean)
        self.base = self._mixed(self._assemble(self.lm.lean if self.lm else None, self.steering, self.head))

    def _mixed(self, drafter: Drafter) -> Drafter:
        """`drafter` alone, or as the adaptive member of a mix with the configured speculators (a static
        copy of the base weights with row state of its own; suffix decoding over the builder's one store)."""
        if not self.speculators:
            return drafter
        members = {"adaptive": drafter}
        if "static" in self.speculators:
            members["static"] = self._assemble(self.lm.lean if self.lm else None, self.steering, self.head)
        if "suffix" in self.speculators:
            members["suffix"] = SuffixDrafter(self.verifier.vocab_size, store=self.store)
        return SpeculatorMix(members)

    def _assemble(self, lean: LeanDecoder | None, steering, head) -> Drafter:
        if self.kind == "ngram":
            return NgramDrafter(self.verifier.vocab_size)
        if self.kind == "suffix":
            return SuffixDrafter(self.verifier.vocab_size)
        if self.kind == "dvi":
            return DVIDrafter(self.verifier.lean, head, self.vocab)
        if self.kind == "eagle":
            return EagleDrafter(self.verifier.lean, head, self.vocab)
        if self.kind == "eagle3":
            return Eagle3Drafter(self.verifier.lean, head, self.vocab)
        if self.vocab is not None and lean.vocab_ids is None:
            lean.restrict_vocab(self.vocab)
        if self.weights is not None and lean.quant is None:
            quantize_decoder(lean, self.weights)  # after the restriction: the smaller head is packed
        return PretrainedDrafter(lean) if self.kind == "pretrained" else SteeredDrafter(lean, steering)

    def build(self, weights: dict | None = None) -> Drafter:
        """The base drafter when `weights` is empty or None; else a new one with them loaded."""
        if not weights or self.kind in MODEL_FREE:
            return self.base
        if self.kind in HEADS:
            return self._mixed(self._assemble(None, None, _loaded(self.head, weights, "head.")))
        lean = LeanDecoder(_loaded(self.lm.hf, weights, "lm."))  # the LM's module: loaded on the first version
        steering = _loaded(self.steering, weights, "steering.") if self.kind == "sd2" else None
        return self._mixed(self._assemble(lean, steering, None))


def _loaded(module: torch.nn.Module, weights: dict, prefix: str) -> torch.nn.Module:
    """A deep copy of `module` with the `prefix`-named tensors of `weights` loaded into it."""
    copy = deepcopy(module)
    state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    if state:
        missing_unexpected = copy.load_state_dict(state, strict=False)
        if missing_unexpected.unexpected_keys:
            raise ModelError(f"version weights do not fit the {prefix[:-1]} module: {missing_unexpected.unexpected_keys[:3]}")
    return copy.eval()
