"""specloop.drafter.model.config: a plain Llama config.json read without transformers' config classes holds
transformers' values; anything else is left to transformers."""
from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

from specloop.drafter.model.architecture import StaticRope
from specloop.drafter.model.config import ABSENT, SERVED, TOKEN_IDS, PlainConfig, plain_config
from specloop.drafter.model.loading import _load_config, load_model


def _write(tmp_path, raw: dict, name: str = "m"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return d


@pytest.fixture
def base(reference_pair) -> dict:
    return json.loads((reference_pair[0] / "config.json").read_text())


def _assert_same_as_transformers(path) -> None:
    plain, full = plain_config(path), AutoConfig.from_pretrained(path)
    assert plain is not None
    for name in (*SERVED, *TOKEN_IDS):
        mine, theirs = getattr(plain, name), getattr(full, name)
        assert mine == theirs and type(mine) is type(theirs), name
    for name in ABSENT:
        assert not hasattr(plain, name) and not hasattr(full, name), name
    head_dim = plain.head_dim
    rope_mine, rope_theirs = StaticRope.of_config(plain, head_dim), StaticRope.of_config(full, head_dim)
    positions = torch.arange(4096)[None]
    x = torch.zeros(1, dtype=torch.float32)
    for a, b in zip(rope_mine(x, positions), rope_theirs(x, positions)):
        assert torch.equal(a, b)


def test_the_reference_pair_and_tiny_models_read_plainly_hold_transformers_values(reference_pair, tiny_pair):
    for path in (*reference_pair, *tiny_pair):
        _assert_same_as_transformers(path)


@pytest.mark.parametrize("edit", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "bos_token_id": 1, "eos_token_id": [2, 7],
     "unk_token_id": 0, "_model_name_or_path": "x"},  # as the fetched SmolLM2's config.json has them
    {"dtype": "bfloat16", "tie_word_embeddings": False, "num_key_value_heads": 4, "max_position_embeddings": 8192},
    {"rms_norm_eps": 9.999999747378752e-06, "head_dim": 32, "attention_bias": True},
])
def test_plain_variants_hold_transformers_values(tmp_path, base, edit):
    _assert_same_as_transformers(_write(tmp_path, base | edit))


@pytest.mark.parametrize("edit", [
    {"model_type": "qwen2"},  # another architecture: its defaults are its own
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000}},  # an int base: transformers' own reading
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},  # a key outside the plain ones
    {"sliding_window": 4096},
    {"head_dim": None},  # filled in by transformers
    {"num_key_value_heads": True},  # a bool where an int belongs
    {"eos_token_id": "2"},
    {"dtype": "float99"},
])
def test_anything_but_the_plain_case_is_left_to_transformers(tmp_path, base, edit):
    assert plain_config(_write(tmp_path, base | edit)) is None


def test_a_missing_field_is_left_to_transformers(tmp_path, base):
    del base["max_position_embeddings"]
    path = _write(tmp_path, base)
    assert plain_config(path) is None
    assert _load_config(path).max_position_embeddings == AutoConfig.from_pretrained(path).max_position_embeddings


def test_other_attributes_are_transformers_own_with_what_was_set_here(reference_pair):
    plain = plain_config(reference_pair[0])
    plain.dtype = torch.bfloat16  # as load_model sets it on the config of a decoder read in bf16
    assert plain.initializer_range == 0.02 and plain._full is not None  # not served here: read through transformers
    assert plain.to_dict()["dtype"] == "bfloat16"  # what was set here, carried over
    plain.num_labels = 3
    assert plain.full.num_labels == 3 and plain.num_labels == 3


def test_a_copy_or_a_pickle_does_not_load_transformers_config(reference_pair):
    plain = plain_config(reference_pair[0])
    for other in (copy.deepcopy(plain), pickle.loads(pickle.dumps(plain))):  # a Ray actor's arguments are pickled
        assert isinstance(other, PlainConfig) and other.hidden_size == plain.hidden_size and other._full is None
        assert other.rope_parameters == plain.rope_parameters and other.dtype is torch.float32
    assert plain._full is None


def test_loading_a_plain_checkpoint_imports_no_transformers_config_module(reference_pair):
    """What the plain reading saves: transformers' Llama config module (with torch._dynamo and torch.distributed
    behind it) is never imported by a load of the decoder, its tokenizer and its context facts."""
    code = ("import sys; from specloop.drafter.model.loading import load_model, context_facts; "
            f"m = load_model({str(reference_pair[0])!r}); context_facts({str(reference_pair[0])!r}); "
            "print(m.config.num_hidden_layers, sorted(n for n in sys.modules if n.endswith('configuration_llama') "
            "or n == 'torch._dynamo'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["6", "[]"]


def test_a_plainly_read_checkpoint_loads_the_same_decoder(reference_pair, monkeypatch):
    import specloop.drafter.model.loading as loading

    plainly = load_model(reference_pair[0])
    monkeypatch.setattr(loading, "plain_config", lambda path: None)
    through_transformers = load_model(reference_pair[0])
    ids = torch.tensor([[5, 17, 99, 4, 1000, 3]])
    logits = [m.lean.forward(m.lean.new_cache(1, 16), ids).logits for m in (plainly, through_transformers)]
    assert torch.equal(*logits)
    assert isinstance(plainly.config, PlainConfig) and not isinstance(through_transformers.config, PlainConfig)
