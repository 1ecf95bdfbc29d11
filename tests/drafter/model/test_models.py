import json
from pathlib import Path

import pytest
import torch

from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.loading import ModelError, check_same_vocabulary, default_dtype, load_model, load_tokenizer
from specloop.drafter.model.weights.modes import DTYPE_MODES
from tests.tiny import build_model, llama_config, make_model, make_tokenizer


def test_models_load_in_fp32_on_cpu(tiny_pair):
    m = load_model(tiny_pair[0], device=torch.device("cpu"))
    assert m.lean.dtype == torch.float32 and m.vocab_size == len(m.tokenizer)
    assert default_dtype(torch.device("cpu")) == torch.float32


def test_on_cuda_a_checkpoint_is_read_in_the_dtype_it_is_stored_in(tiny_pair, tmp_path):
    # the graph backend makes bf16 exact there (specloop.drafter.model.graph): a bf16 checkpoint is not served at twice its bytes
    assert default_dtype(torch.device("cuda"), tiny_pair[0]) == torch.float32  # stored in fp32
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    config = json.loads((tiny_pair[0] / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert default_dtype(torch.device("cuda"), bf16) == torch.bfloat16
    assert default_dtype(torch.device("cpu"), bf16) == torch.float32  # the CPU converts with `weights`


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


# ---------------------------------------------------------------- streamed (module-free) loading

WEIGHT_MODES = (None, *DTYPE_MODES)  # None: as read, in the load dtype


@pytest.fixture(scope="module")
def checkpoints(tiny_pair, tmp_path_factory):
    """Saved tiny models: a tied Llama (the pair's verifier), an untied Qwen2 (q/k/v biases) with an
    odd vocabulary (the int4 head is padded), a Qwen3 (per-head q/k norms) stored in bf16."""
    root = tmp_path_factory.mktemp("stream")
    tok = load_tokenizer(tiny_pair[0])
    out = {"llama": tiny_pair[0]}
    for arch, extra, dtype in (("qwen2", {"tie_word_embeddings": False}, torch.float32), ("qwen3", {}, torch.bfloat16)):
        cfg = llama_config(len(tok) + 5, 2, 64, arch, **extra)
        model = build_model(cfg, seed=4, init_std=0.1).to(dtype)
        model.save_pretrained(root / arch)
        tok.save_pretrained(root / arch)
        out[arch] = root / arch
    return out


def _logits(loaded) -> torch.Tensor:
    """A ragged prefill of two rows, then a one-token step: the logits of both, in one tensor."""
    lean = loaded.lean
    cache = lean.new_cache(2, 32)
    ids = torch.tensor([[5, 9, 33, 2, 7, 100, 31, 8], [11, 3, 250, 6, 0, 0, 0, 0]])
    first = lean.forward(cache, ids, n_new=torch.tensor([8, 4])).logits
    step = lean.forward(cache, torch.tensor([[17], [19]])).logits
    return torch.cat([first, step], dim=1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_a_streamed_decoder_is_bit_identical_to_one_built_from_the_module(checkpoints, arch, mode, monkeypatch):
    import specloop.drafter.model.weights.linears as quant  # Int4Weight's module (specloop.drafter.model.weights.quant re-exports it)

    monkeypatch.setattr(quant, "_INT4_BLOCK_ROWS", 64)  # int4: the head and qkv pack in several row blocks
    kept = load_model(checkpoints[arch], device=torch.device("cpu"), weights=mode, keep_module=True)
    lean = load_model(checkpoints[arch], device=torch.device("cpu"), weights=mode)
    assert kept.module is not None and lean.module is None
    a, b = _logits(kept), _logits(lean)
    assert a.dtype == b.dtype == lean.lean.dtype and torch.equal(a, b)
    assert torch.equal(kept.lean.cos, lean.lean.cos) and torch.equal(kept.lean.sin, lean.lean.sin)
    assert (kept.served, kept.vocab_size, kept.eos_ids, kept.dtype) == (lean.served, lean.vocab_size, lean.eos_ids, lean.dtype)
    assert kept.config.to_dict() == lean.config.to_dict()


def test_fp32_serving_holds_one_copy_of_the_weights(checkpoints):
    """No module, and the tied embedding is the LM head itself: the decoder's tensors are all there is."""
    m = load_model(checkpoints["llama"], device=torch.device("cpu"), weights="fp32")
    assert m.module is None and m.lean.embed is m.lean.lm_head
    held = [v for v in vars(m.lean).values()] + [v for layer in m.lean.layers for v in vars(layer).values()]
    assert not any(isinstance(v, torch.nn.Module) for v in held)
    weights = {id(t): t for t in held if isinstance(t, torch.Tensor) and t is not m.lean.cos and t is not m.lean.sin}
    hf = m.hf  # loads the module now, separately
    assert sum(t.numel() for t in weights.values()) == sum(p.numel() for p in hf.parameters())
    ptrs = {t.untyped_storage().data_ptr() for t in weights.values()}
    assert not ptrs & {p.untyped_storage().data_ptr() for p in hf.parameters()}


def test_the_module_is_loaded_on_demand_and_then_kept(tiny_pair):
    m = load_model(tiny_pair[0], device=torch.device("cpu"), weights="int8")
    assert m.module is None
    hf = m.hf  # a DVI head or a registry version of a drafter LM asks for it
    assert m.module is hf and m.hf is hf and hf.dtype == m.dtype == torch.float32
    ids = torch.tensor([[5, 9, 33, 2]])
    ref = LeanDecoder(hf)
    cache = ref.new_cache(1, 8)
    plain = load_model(tiny_pair[0], device=torch.device("cpu"))
    assert torch.equal(ref.forward(cache, ids).logits, plain.lean.forward(plain.lean.new_cache(1, 8), ids).logits)


def test_a_checkpoint_the_stream_cannot_read_goes_through_the_module(checkpoints, monkeypatch):
    import specloop.drafter.model.loading as models

    direct = _logits(load_model(checkpoints["qwen2"], device=torch.device("cpu"), weights="int4"))
    monkeypatch.setattr(models, "_safetensors_files", lambda path: None)  # e.g. a pytorch_model.bin checkpoint
    m = load_model(checkpoints["qwen2"], device=torch.device("cpu"), weights="int4")
    assert m.module is None and torch.equal(_logits(m), direct)


def test_the_dvi_and_sd2_drafters_build_on_a_streamed_verifier(peaky_pair):
    v = load_model(peaky_pair[0], device=torch.device("cpu"), weights="int8")
    sd2 = build_drafter("sd2", v, peaky_pair[1])
    assert v.module is None  # SD² reads configs only
    dvi = build_drafter("dvi", v, None)
    assert v.module is not None  # the DVI head starts from the verifier's float LM head
    assert sd2 is not None and dvi is not None


def test_a_tokenizers_backend_directory_loads_without_autotokenizer_and_tokenizes_as_it_would(reference_pair,
                                                                                             monkeypatch):
    """The reference verifier's tokenizer_config names TokenizersBackend: load_tokenizer builds that class
    directly (AutoTokenizer is never called) and it encodes, templates and decodes every reference
    chat prompt exactly as AutoTokenizer's tokenizer does."""
    import json

    import transformers
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(reference_pair[0])
    monkeypatch.setattr(transformers, "AutoTokenizer", None)  # any use would fail (loading imports it where used)
    tok = load_tokenizer(reference_pair[0])
    assert type(tok) is type(reference)
    prompts = Path(reference_pair[0]).parent.parent / "prompts" / "chat_dev.jsonl"
    rows = [json.loads(line) for line in prompts.read_text().splitlines()[:60]]
    for row in rows:
        ids = tok.apply_chat_template(row["messages"], add_generation_prompt=True)
        assert ids == reference.apply_chat_template(row["messages"], add_generation_prompt=True)
        assert tok.decode(ids) == reference.decode(ids)
    assert (tok.eos_token_id, tok.pad_token_id, tok.all_special_ids) == \
        (reference.eos_token_id, reference.pad_token_id, reference.all_special_ids)


def test_a_streamed_load_never_imports_the_modelling_code(checkpoints):
    """The modelling module (and what it pulls in) costs a serving process ~130 MB: a streamed load of
    each architecture builds its decoder from the config and the files alone."""
    import subprocess
    import sys

    code = ("import sys, torch; from specloop.drafter.model.loading import load_model\n"
            "for p in sys.argv[1:]: load_model(p, device=torch.device('cpu'), weights='int4')\n"
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m and '.auto.' not in m))")
    out = subprocess.run([sys.executable, "-c", code, *map(str, checkpoints.values())], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "[]", out.stdout
