import pytest
import torch

from drafter.kinds import build_drafter
from drafter.models import ModelError, check_same_vocabulary, default_dtype, load_model
from tests.tiny import make_model, make_tokenizer


def test_models_load_in_fp32_on_cpu(tiny_pair):
    m = load_model(tiny_pair[0], device=torch.device("cpu"))
    assert m.lean.dtype == torch.float32 and m.vocab_size == len(m.tokenizer)
    assert default_dtype(torch.device("cuda")) == torch.float32  # bf16 there is not greedy-lossless


def test_a_pair_with_different_vocabularies_is_refused(tiny_pair, tmp_path):
    other_tok = make_tokenizer(tmp_path / "tok", vocab_size=300)
    other = make_model(tmp_path / "other", other_tok, layers=1, hidden=32, seed=3)
    verifier = load_model(tiny_pair[0])
    with pytest.raises(ModelError, match="different vocabularies"):
        check_same_vocabulary(verifier, load_model(other))
    with pytest.raises(ModelError, match="different vocabularies"):
        build_drafter("pretrained", verifier, other)


def test_a_directory_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        load_model(tmp_path / "empty")
    with pytest.raises(ModelError, match="not found"):
        load_model(tmp_path / "missing")
