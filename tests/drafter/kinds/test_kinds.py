"""drafter/kinds/table.py: which drafter kind a directory holds, building drafters in weight modes, and the table
of kinds (its facts agree with what each kind's builder, learner and CLI do)."""
from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import shutil
from copy import deepcopy
from pathlib import Path

import pytest
import torch

import specloop.drafter.kinds
from specloop.drafter.kinds.mix import SpeculatorMix
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.table import (
    DRAFTER_KINDS,
    KINDS,
    TRAINABLE_KINDS,
    DrafterBuilder,
    build_drafter,
    check_speculators,
    default_speculators,
    resolve_kind,
)
from specloop.drafter.model.loading import ModelError, load_model
from specloop.services.cli.generation import GenerateConfig
from specloop.trainer.online import TRAINING, serving_student
from specloop.trainer.records import CONTEXT_RULES


def _checkpoint(tmp_path, kind: str):
    d = tmp_path / kind
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"kind": kind}))
    return d


def test_the_manifest_names_the_kind_and_an_explicit_contradiction_is_refused(tmp_path, tiny_pair):
    sd2 = _checkpoint(tmp_path, "sd2")
    assert resolve_kind(None, sd2) == "sd2"
    assert resolve_kind("sd2", sd2) == "sd2"
    assert resolve_kind("pretrained", sd2) == "pretrained"  # an SD² checkpoint's LM alone
    with pytest.raises(ModelError, match="holds a 'sd2' drafter"):
        resolve_kind("dvi", sd2)
    assert resolve_kind(None, tiny_pair[1]) == "pretrained"  # a plain model directory
    assert resolve_kind("ngram", None) == "ngram"
    assert resolve_kind(None, None) is None
    with pytest.raises(ValueError, match="unknown drafter kind"):
        resolve_kind("medusa", None)


def test_a_drafter_lm_is_built_in_its_own_weight_mode(tiny_pair):
    verifier = load_model(tiny_pair[0], weights="int8")
    drafter = build_drafter("pretrained", verifier, tiny_pair[1], weights="int4")
    assert verifier.lean.quant.mode == "int8" and drafter.lean.quant.mode == "int4"
    assert build_drafter("pretrained", verifier, tiny_pair[1]).lean.quant is None  # None: as loaded


def test_suffix_decoding_joins_a_learned_head_by_default_and_nothing_joins_the_other_kinds():
    assert default_speculators("eagle") == default_speculators("eagle3") == ("suffix",)
    for kind in ("pretrained", "sd2", "dvi", "ngram", "suffix"):
        assert default_speculators(kind) == ()
        check_speculators(kind, default_speculators(kind))  # a default is always a valid choice


# ----------------------------------------------------------------------------- the table of kinds


def _drafter_classes() -> dict[str, type]:
    """kind -> its drafter class, for every class of a specloop.drafter.kinds module that names a kind."""
    out = {}
    for info in pkgutil.iter_modules(specloop.drafter.kinds.__path__):
        module = importlib.import_module(f"specloop.drafter.kinds.{info.name}")
        out |= {cls.kind: cls for cls in vars(module).values() if inspect.isclass(cls)
                and cls.__module__ == module.__name__ and isinstance(getattr(cls, "kind", None), str)
                and hasattr(cls, "propose")}
    return out


def test_the_table_has_a_row_for_every_drafter_module_and_the_cli_accepts_exactly_its_kinds():
    assert set(KINDS) == set(_drafter_classes())
    assert DRAFTER_KINDS == tuple(KINDS)
    assert TRAINABLE_KINDS == tuple(name for name, spec in KINDS.items() if spec.trainable)
    for kind in KINDS:  # --drafter-kind: `specloop generate` and `serve` / `replay` (resolve_kind)
        assert GenerateConfig(verifier=Path("v"), prompts=Path("p"), drafter_kind=kind).drafter_kind == kind
        assert resolve_kind(kind, None) == kind
    with pytest.raises(ValueError, match="unknown drafter kind"):
        GenerateConfig(verifier=Path("v"), prompts=Path("p"), drafter_kind="medusa")
    for spec in KINDS.values():  # the learner has code for every training method a row names
        assert not spec.trainable or spec.method in TRAINING


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0])


def _trained(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters training moves (what a checkpoint of the part must carry)."""
    return {n: p.detach().cpu() for n, p in module.named_parameters() if p.requires_grad}


def _perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` with noise on its trained parameters (so that a loaded part is told apart from a
    fresh one; a copy, so that nothing it may share with the verifier moves)."""
    module, g = deepcopy(module), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
    return module


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kinds_facts_agree_with_what_its_builder_builds(kind, tiny_pair, verifier):
    spec = KINDS[kind]
    drafter_dir = tiny_pair[1] if spec.needs_dir else None
    if spec.needs_dir:
        with pytest.raises(ValueError, match="needs --drafter DIR"):
            build_drafter(kind, verifier, None)
    builder = DrafterBuilder(kind, verifier, drafter_dir)
    drafter = builder.base
    assert drafter.kind == kind and type(drafter) is _drafter_classes()[kind]
    assert (builder.lm is not None) == spec.needs_dir
    assert (builder.lm is None and builder.part is None) == spec.model_free
    assert (builder.head is not None) == spec.head and (builder.steering is not None) == (spec.part == "steering")
    assert spec.mixable == (drafter.follows_plain and not spec.model_free)
    assert isinstance(build_drafter(kind, verifier, drafter_dir, speculators=default_speculators(kind)),
                      SpeculatorMix) == spec.mixable
    assert spec.stale_on_swap == isinstance(drafter, PretrainedDrafter)  # a KV cache of its own LM, adopted as is
    assert spec.record_context in CONTEXT_RULES


@pytest.mark.parametrize("kind", [kind for kind, spec in KINDS.items() if spec.trainable])
def test_the_learners_weights_of_each_kind_fit_its_builder(kind, tiny_pair, verifier):
    """A version the learner publishes names the builder's modules: "lm.*" its LM, then its part's prefix."""
    spec = KINDS[kind]
    drafter_dir = tiny_pair[1] if spec.needs_dir else None
    builder = DrafterBuilder(kind, verifier, drafter_dir)
    student = serving_student(kind, verifier, drafter_dir)
    assert student.kind == kind
    modules = {"lm": builder.lm and builder.lm.hf, spec.part: builder.part}
    names = [n for n, _, _ in student.trainable()]
    assert names and all(n.split(".", 1)[1] in modules[n.split(".", 1)[0]].state_dict() for n in names)


@pytest.mark.parametrize("kind", [kind for kind, spec in KINDS.items() if spec.part is not None])
def test_a_checkpoint_of_a_kind_gives_its_trained_part_back(kind, tiny_pair, verifier, tmp_path):
    spec = KINDS[kind]
    fresh = DrafterBuilder(kind, verifier, tiny_pair[1] if spec.needs_dir else None)
    saved = _perturbed(fresh.part)
    saved.save(tmp_path, {})
    if spec.needs_dir:
        shutil.copytree(tiny_pair[1], tmp_path / "drafter")
    loaded, want = _trained(DrafterBuilder(kind, verifier, tmp_path).part), _trained(saved)
    assert want and loaded.keys() == want.keys()
    assert all(torch.equal(loaded[n], t) for n, t in want.items())
    assert not all(torch.equal(_trained(fresh.part)[n], t) for n, t in want.items())  # not a fresh one
