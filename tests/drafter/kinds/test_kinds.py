"""drafter/kinds/table.py: which drafter kind a directory holds, and building drafters in weight modes."""
from __future__ import annotations

import json

import pytest

from specloop.drafter.kinds.table import build_drafter, check_speculators, default_speculators, resolve_kind
from specloop.drafter.model.loading import ModelError, load_model


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
