"""Weight-only quantization of a LeanDecoder for CPU decoding, chosen at run time.

A linear "weight" is either a raw tensor (`F.linear`, the unquantized path) or one of the weight
objects of weights.linears and weights.own_linears; `linear(x, w, bias)` calls either. Every object
maps `x [..., K]` to `[..., N]` in the activation dtype and holds its own bias:

- `Dense`: a float weight (fp32 or bf16), `F.linear`.
- `Int8Weight`: per-output-channel symmetric int8, `torch._weight_int8pack_mm`.
- `Int4Weight`: group-wise asymmetric int4 (groups of 32/64/128 along K), tinygemm's CPU packing,
  `torch._weight_int4pack_mm_for_cpu`.
- `OwnInt4Weight` / `OwnInt8Weight`: the same formats (int4 in groups of 32, w = q · d + m with fp16
  d, m; int8 per channel with fp32 scales) multiplied by specloop's own kernels (specloop.drafter.model.kernels),
  which read each tile of weights from memory once for all rows of a call and compute every row
  alike (bench/README.md section 9: a 5-token pass 0.84x of the stock kernels' cost, v_5 1.88
  against 2.04). Used wherever they build for this CPU (`QuantSpec.kernels == "own"`);
  SPECLOOP_KERNELS=stock serves the stock kernels instead.

Modes (`DTYPE_MODES`): "fp32" (raw fp32 tensors), "bf16" (bf16 weights and activations), "int8"
and "int4" (quantized weights; activations in fp32 with specloop's kernels, else in bf16 where the
CPU has native bf16, else fp32: `activation_dtype`), and "w4a8" (`OwnW4A8Weight`: int4 weights
times activations quantized to int8 per group of 32 inside each product, as llama.cpp computes a
Q4_1 model; specloop's kernels only). The embedding, norms and RoPE tables follow the activation dtype; the KV cache
is fp32 in every mode (specloop.drafter.model.decoder).

Which mode is served: `resolve_mode`. "auto" serves a verifier as its checkpoint is stored (fp32 /
bf16), or in the mode its own manifest.json names (a model published as a 4-bit GGUF: int4 packed
from the GGUF's groups, `OwnInt4Weight` / `Int4Weight.from_groups`); never a quantized copy nobody asked for.
`describe_mode` is the string printed wherever the model is named.

Losslessness is against the verifier as served. Greedy equality with that verifier alone needs
the verify pass (T = k+1) to score a token bit for bit as a one-token step does: the int kernels
compute every row on its own; float GEMMs go through `row_blocked` in decode-shaped passes (one
call shape for every row); attention is specloop.drafter.model.decoder.exact_attention.

Where each part lives (every name is importable from here): weights.modes (the modes, their
resolution and description), weights.linears (torch's kernels, `row_blocked`, the quantizers),
weights.own_linears (specloop's kernels), weights.groups (a checkpoint's own groups); this
module prepares a whole decoder (`quantize_decoder`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specloop.drafter.model import kernels
from specloop.drafter.model.weights.groups import int4_groups, int8_blocks, reproduces
from specloop.drafter.model.weights.linears import INT4_GROUP_SIZES, Dense, Int4Weight, Int8Weight, minmax_groups
from specloop.drafter.model.weights.modes import (
    DEFAULT_GROUP_SIZE,
    W4A8_NEEDS,
    _kernels_for,
    activation_dtype,
    check_mode,
)
from specloop.drafter.model.weights.own_linears import OwnInt4Weight, OwnInt8Weight, OwnW4A8Weight, OwnW8A8Weight


@dataclass(frozen=True)
class QuantSpec:
    """How a decoder's linears were prepared (kept on the decoder as `lean.quant`)."""

    mode: str
    act_dtype: torch.dtype
    group_size: int = DEFAULT_GROUP_SIZE
    from_groups: int = 0  # checkpoint weights packed from their own 4-bit groups (`int4_groups`), not requantized
    kernels: str = "stock"  # "own": model.kernels multiply int4 / int8 weights (fp32 products); "stock": torch's


def quantize_weight(weight: torch.Tensor, spec: QuantSpec, bias: torch.Tensor | None = None):
    """One linear weight [N, K] prepared for `spec`: a raw tensor in fp32 mode, else a weight object.
    int4 layers whose K no allowed group size divides fall back to int8 (never silently to float)."""
    if spec.mode == "fp32":
        return weight.to(spec.act_dtype)  # raw: the unquantized path (bias stays with the caller)
    if spec.mode == "bf16":
        return Dense(weight, bias, spec.act_dtype)
    own = spec.kernels == "own"
    if spec.mode == "w4a8":
        if not own:
            raise ValueError(W4A8_NEEDS)
        if weight.shape[1] % kernels.GROUP == 0:
            return OwnW4A8Weight(*minmax_groups(weight, kernels.GROUP), bias, spec.act_dtype)
        return OwnInt8Weight(weight, bias, spec.act_dtype)
    if spec.mode == "int4":
        K = weight.shape[1]
        if own and K % 32 == 0:
            return OwnInt4Weight.quantize(weight, bias, spec.act_dtype)
        sizes = [g for g in INT4_GROUP_SIZES if g <= spec.group_size and K % g == 0]
        if sizes:
            return Int4Weight(weight, bias, spec.act_dtype, max(sizes))
    return (OwnInt8Weight if own else Int8Weight)(weight, bias, spec.act_dtype)


def quantize_like(lean, weight: torch.Tensor):
    """`weight` (e.g. a DVI head's merged LM head) prepared as `lean`'s own linears are; a raw tensor
    in the decoder's dtype when it was never quantized."""
    spec = getattr(lean, "quant", None)
    weight = weight.to(lean.device)
    return weight.to(lean.dtype) if spec is None else quantize_weight(weight, spec)


def quantize_decoder(lean, mode: str, group_size: int = DEFAULT_GROUP_SIZE, act_dtype: torch.dtype | None = None,
                     groups: "str | Path | dict | None" = None, layers=None):
    """Convert `lean` in place to `mode`: every layer's linears and whatever `lean.lm_head` holds now
    (a truncated draft vocabulary's rows included); the embedding, norms, RoPE tables and the KV caches
    it makes from now on move to the activation dtype. Returns `lean`.

    `act_dtype` overrides the run-time choice (`activation_dtype`). Caches made before the call are in
    the old dtype: make new ones. Drafters that read `lean.dtype` (SD² steering) must be built after.

    `groups`: the checkpoint directory `lean` was loaded from (or `int4_groups`'s dict). In int4 mode
    with its group size, every linear it holds 4-bit groups for (a GGUF's Q4_1 tensors) is packed from
    those groups instead of requantized: the model as published (`_grouped`).

    `layers`: the decoder's layers when they are not in `lean.layers` yet (which must then be empty):
    an iterable that specloop.drafter.model.loading fills from a checkpoint, one float layer at a time; each is
    converted as it comes and appended. The LM head and the embedding are converted before any layer.
    """
    check_mode(mode)
    if layers is not None and lean.layers:
        raise ValueError("quantize_decoder(layers=...) fills a decoder that has no layers yet")
    if getattr(lean, "quant", None) is not None:
        raise ValueError(f"decoder is already prepared as {lean.quant.mode!r}; build a new LeanDecoder to change it")
    if mode in ("int8", "int4", "w4a8") and lean.device.type != "cpu":
        raise ValueError(f"weight dtype mode {mode!r} uses CPU kernels; on {lean.device.type} use fp32 or bf16")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size {group_size} is not one of {INT4_GROUP_SIZES}")
    spec = QuantSpec(mode, act_dtype or activation_dtype(mode), group_size, kernels=_kernels_for(mode, group_size))
    if mode == "w4a8" and spec.kernels != "own":
        raise ValueError(W4A8_NEEDS + "; they are not built here: use int4")
    act = spec.act_dtype
    source = groups if isinstance(groups, (str, Path)) else None
    table: Mapping[str, Any]  # parameter name -> its 4-bit groups (q, scale, minimum)
    if mode not in ("int4", "w4a8") or groups is None:
        table = {}
    elif not isinstance(groups, Mapping):
        table = int4_groups(groups) or {}
    else:
        table = groups
    used = []
    tied = getattr(lean.config, "tie_word_embeddings", False)
    head = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    # A published 4-bit model whose head is stored at higher precision (SmolLM2's GGUF: Q8_0, tied to
    # the embedding) keeps an 8-bit head: int4 there flipped 8 of 8 greedy answers against the GGUF's.
    head_spec = replace(spec, mode="int8") if table and not any(n in table for n in head) else spec
    blocks = _head_blocks(lean, head[0], source, mode)
    if blocks is not None:  # the published int8 head (Q8_0) as it is, and the tied embedding read from it
        lean.lm_head = blocks
        lean.embed = blocks if tied else lean.embed.to(act)
        used.append(head[0])
    else:
        lean.lm_head = _grouped(lean.lm_head, head if lean.vocab_ids is None else [], table, head_spec, used)
        lean.embed = lean.embed.to(act)
    lean.final_norm = lean.final_norm.to(act)
    lean.cos, lean.sin = lean.cos.to(act), lean.sin.to(act)
    for i, layer in enumerate(lean.layers if layers is None else layers):
        pre = f"model.layers.{i}."
        attn = [f"{pre}self_attn.{n}_proj.weight" for n in "qkv"]
        layer.qkv = _grouped(layer.qkv, attn, table, spec, used, layer.qkv_bias)
        if mode == "fp32":
            layer.qkv_bias = None if layer.qkv_bias is None else layer.qkv_bias.to(act)
        else:
            layer.qkv_bias = None  # held by the weight object
        layer.o = _grouped(layer.o, [f"{pre}self_attn.o_proj.weight"], table, spec, used)
        layer.gate_up = _grouped(layer.gate_up, [f"{pre}mlp.gate_proj.weight", f"{pre}mlp.up_proj.weight"], table,
                                 spec, used)
        layer.down = _grouped(layer.down, [f"{pre}mlp.down_proj.weight"], table, spec, used)
        layer.in_norm, layer.post_norm = layer.in_norm.to(act), layer.post_norm.to(act)
        layer.q_norm = None if layer.q_norm is None else layer.q_norm.to(act)
        layer.k_norm = None if layer.k_norm is None else layer.k_norm.to(act)
        if layers is not None:
            lean.layers.append(layer)
    lean.dtype = act
    lean.quant = replace(spec, from_groups=len(used))
    return lean


def _head_blocks(lean, name: str, source, mode: str) -> "OwnW8A8Weight | None":
    """In w4a8 mode, the LM head from the checkpoint's own int8 blocks (`int8_blocks` of `source`, a
    directory) when they reproduce the loaded head exactly (a stale file is never served), else None."""
    if mode != "w4a8" or source is None or lean.vocab_ids is not None or not isinstance(lean.lm_head, torch.Tensor):
        return None
    found = int8_blocks(source).get(name)
    if found is None:
        return None
    q, d = found
    if not reproduces(q, d, None, lean.lm_head):
        import warnings

        warnings.warn(f"int8 blocks of {name} do not reproduce the loaded weight: requantizing it")
        return None
    return OwnW8A8Weight(q, d)


def _grouped(weight: torch.Tensor, names: list[str], groups: Mapping[str, Any], spec: QuantSpec, used: list[str],
             bias: torch.Tensor | None = None):
    """`quantize_weight`, or an `Int4Weight.from_groups` when `groups` holds every part of this (fused)
    weight, concatenated along N as the decoder concatenates the weights, at the spec's group size,
    and q · scale + minimum equals the weight exactly (a stale groups file is never served)."""
    found = [groups.get(n) for n in names]
    parts = [p for p in found if p is not None]
    if not found or len(parts) < len(found):
        return quantize_weight(weight, spec, bias)
    q, d, m = (torch.cat([p[j] for p in parts]) for j in range(3))
    K = weight.shape[1]
    if q.shape != weight.shape or d.shape[1] == 0 or K % d.shape[1] or K // d.shape[1] != spec.group_size:
        return quantize_weight(weight, spec, bias)
    if not reproduces(q, d, m, weight):
        import warnings

        warnings.warn(f"int4 groups of {', '.join(names)} do not reproduce the loaded weight: requantizing it")
        return quantize_weight(weight, spec, bias)
    used.extend(names)
    if spec.mode == "w4a8":
        return OwnW4A8Weight(q, d.float(), m.float(), bias, spec.act_dtype)
    if spec.kernels == "own":
        return OwnInt4Weight(q, d.float(), m.float(), bias, spec.act_dtype)
    return Int4Weight.from_groups(q, d, m, bias, spec.act_dtype)
