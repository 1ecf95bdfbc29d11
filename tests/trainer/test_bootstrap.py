import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specloop.trainer.bootstrap import SPECIAL_TOKENS, BootstrapConfig, bootstrap_models, ensure_models
from specloop.trainer.corpora import render_chat


@pytest.fixture(scope="module")
def boot(tmp_path_factory):
    out = tmp_path_factory.mktemp("boot")
    summary = bootstrap_models(BootstrapConfig(out_dir=str(out), minutes=0.3, seed=0), progress=False)
    return out, summary


@pytest.fixture(scope="module")
def loaded(boot):
    out, _ = boot
    return {name: (AutoModelForCausalLM.from_pretrained(out / name), AutoTokenizer.from_pretrained(out / name))
            for name in ("verifier", "drafter")}


def test_bootstrap_writes_loadable_verifier_and_drafter_with_a_summary(boot, loaded):
    out, summary = boot
    assert json.loads((out / "bootstrap.json").read_text()) == summary
    assert summary["seed"] == 0 and summary["holdout_conversations"] == 500
    for name in ("verifier", "drafter"):
        assert (out / name / "model.safetensors").exists()
        assert summary[name]["steps"] >= 1 and summary[name]["tokens_seen"] > 0
        assert summary[name]["final_loss"] > 0
    assert 0.0 <= summary["greedy_agreement"] <= 1.0


def test_verifier_and_drafter_share_one_vocabulary_with_special_tokens_first(loaded):
    (verifier, v_tok), (drafter, d_tok) = loaded["verifier"], loaded["drafter"]
    assert v_tok.get_vocab() == d_tok.get_vocab()
    assert verifier.config.vocab_size == drafter.config.vocab_size == len(v_tok)
    assert v_tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3, 4]
    assert v_tok.eos_token_id == 4 and v_tok.pad_token_id == 0
    for model in (verifier, drafter):
        assert model.config.eos_token_id == 4 and model.config.pad_token_id == 0
        assert model.generation_config.eos_token_id == 4 and model.generation_config.pad_token_id == 0


def test_chat_template_renders_role_blocks_and_a_generation_prompt(loaded):
    _, tok = loaded["verifier"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>\nbe brief<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n"
    assert text == render_chat(messages, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(4) == 2 and 3 in ids


def test_tokenizer_round_trips_text_byte_for_byte(loaded):
    _, tok = loaded["drafter"]
    for text in ["héllo  wörld 😀\n\ttabs", "def f(x):\n    return x ** 2  # ok\n", " leading space", "<|user|>\nhi<|end|>\n"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_drafter_has_fewer_parameters_than_verifier(loaded):
    verifier, drafter = loaded["verifier"][0], loaded["drafter"][0]
    assert drafter.num_parameters() < verifier.num_parameters()


def test_verifier_generates_greedily_from_a_chat_prompt(loaded):
    model, tok = loaded["verifier"]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert torch.equal(out[:, : ids.shape[1]], ids)


def test_ensure_models_reuses_a_cached_pair_trained_with_the_same_seed(boot):
    out, _ = boot
    started = time.monotonic()
    verifier_dir, drafter_dir = ensure_models(out, minutes=0.3, seed=0, progress=False)
    assert (verifier_dir, drafter_dir) == (out / "verifier", out / "drafter")
    assert time.monotonic() - started < 2.0
