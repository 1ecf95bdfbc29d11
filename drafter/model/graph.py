"""The GPU worker's decode step: one static-shape, sync-free forward over the engine's whole slot pool,
compiled with `torch.compile(fullgraph=True)` region by region (the embedding, one layer, the head: one
compile of a layer serves every layer) and, on CUDA, captured whole as one CUDA graph: the engine's "graph"
backend.

Why: on a GPU, the eager decoder (specloop.drafter.model.decoder.LeanDecoder) launches a few hundred small kernels
per step from Python, and the GPU waits on the host; a captured step replays them all in one launch.

The step (`static_forward`, a pure function of its tensors):
- every call has the same shapes: all S rows of the pool (rows nobody runs ride along with no real
  token), W = k_max + 1 query positions per row (a plain step is a verify pass with one real query and
  W − 1 padded ones), the KV cache's whole capacity attended under a mask. So the one-token step and
  a verify pass of k + 1 tokens are the same kernels on the same shapes, and a row's result cannot
  depend on how many of its queries are real, on how long it is, or on what the other rows hold:
  greedy speculative output equals this engine's own plain decoding by construction, in bf16 too
  (tests/drafter/model/test_graph.py checks it on the CPU; bench/gpu.py on a GPU);
- token, length and count inputs are device tensors; nothing in it reads a value back to the host or
  branches on one: the host reads the step's verdict once, after it (specloop.drafter.decode.speculative);
- KV writes go to each row's positions lens .. lens + n_new − 1; a padded query's write goes to the
  cache's last position, a trash slot no real query ever sees (the pool is allocated one position
  longer than asked: `GraphDecoder.new_cache`). Rolling back stays `lens = ...` on the host.

`GraphDecoder` wraps a LeanDecoder: forwards shaped like a decode step (T <= W tokens on the pool) run
the compiled step; everything else (prefills, one prompt at a time; caches that are not the pool; the
early-exit layers a DVI drafter runs) goes to the LeanDecoder's own passes, which write the same cache
layout. Plain float weights only (fp32 / bf16): `graph_ready` says whether a decoder qualifies.
"""
from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from specloop.drafter.model import decode_attention, skinny_linear
from specloop.drafter.model.attention import KEY_BLOCK, _round_up
from specloop.drafter.model.decoder import ForwardOut
from specloop.drafter.model.kv_cache import KVCache, PromptFeatures, copy_positions
from specloop.drafter.model.weights.linears import Dense

log = logging.getLogger(__name__)
BACKENDS = ("auto", "eager", "graph")
PREFILL_CHUNK = 64  # a prompt's prefill on a GPU: chunks of this many tokens, each one replay of a 1-row step
PREFILLS = ("auto", "eager", "graph")  # SPECLOOP_PREFILL: auto = graph where the steps replay captured graphs
ATTENTIONS = ("auto", "torch", "triton", "flex", "sdpa")
LINEARS = ("auto", "torch", "skinny")  # SPECLOOP_LINEAR


def resolve_attention(device: torch.device) -> str:
    """The step's attention:
    - "torch" (`_attend`: the whole capacity under a mask; the default, auto);
    - "triton" (specloop.drafter.model.decode_attention, SPECLOOP_ATTENTION=triton): two launches per layer,
      each row's keys up to its own length, split across programs in fixed ranges of key positions;
    - "flex" (`_flex_attend`, SPECLOOP_ATTENTION=flex): torch's flex attention, the same mask as a score
      modification, one fused kernel per layer that splits the keys across programs for short queries;
    - "sdpa" (`_sdpa_attend`, SPECLOOP_ATTENTION=sdpa): torch's scaled_dot_product_attention over the whole
      capacity with the step's mask as an additive bias made once per step: on a GPU one memory-efficient
      attention kernel per layer where the torch path launches two products and ~3 kernels around them.
    Flex, sdpa and the split Triton kernel: not yet measured on a GPU. The torch and sdpa attentions read every
    row's whole capacity each step (a pool sized for long requests makes a short row's step cost what a long
    one's does), the Triton kernel a row's own keys. Measured on an H200 (bench/README.md section 25), the
    Triton kernel's first form lost: one program per (row, KV head) left most of the GPU idle at batch 1 (2.52
    against 2.32 ms per step on the 1.7B shape, 12.99 against 5.83 ms on the 8B); it now splits each row's
    keys across programs (flash-decoding)."""
    wanted = os.environ.get("SPECLOOP_ATTENTION", "auto")
    if wanted not in ATTENTIONS:
        raise ValueError(f"SPECLOOP_ATTENTION must be one of {', '.join(ATTENTIONS)}, got {wanted!r}")
    if wanted in ("flex", "sdpa"):
        return wanted
    if wanted != "triton":
        return "torch"
    if not decode_attention.available():
        raise ValueError("SPECLOOP_ATTENTION=triton: triton does not import here")
    return "triton"


def resolve_linear() -> str:
    """The step's weight products: "torch" (F.linear: cuBLAS on a GPU; the default, auto) or "skinny"
    (SPECLOOP_LINEAR=skinny: specloop.drafter.model.skinny_linear's Triton kernel for products of at most
    skinny_linear.MAX_ROWS rows, a fixed split of K over enough programs to stream the weights; exact by
    construction; not yet measured on a GPU: bench/gpu.py's path direct-skinny and section products)."""
    wanted = os.environ.get("SPECLOOP_LINEAR", "auto")
    if wanted not in LINEARS:
        raise ValueError(f"SPECLOOP_LINEAR must be one of {', '.join(LINEARS)}, got {wanted!r}")
    if wanted != "skinny":
        return "torch"
    if not skinny_linear.available():
        raise ValueError("SPECLOOP_LINEAR=skinny: triton does not import here")
    return "skinny"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """"eager" or "graph": "auto" (and None, and SPECLOOP_BACKEND when set) means graph on CUDA, eager on
    the CPU, where specloop.drafter.model.kernels' own passes are faster than a compiled step and already exact."""
    backend = backend or os.environ.get("SPECLOOP_BACKEND") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "graph" if device.type == "cuda" else "eager"
    return backend


def _float_weight(w) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of a plain float linear (a raw tensor or a weights.linears.Dense), else None."""
    if isinstance(w, torch.Tensor):
        return w, None
    if isinstance(w, Dense):
        return w.weight, w.bias
    return None


def _dense(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_float_weight` of a linear that `graph_ready` passed."""
    got = _float_weight(w)
    if got is None:
        raise ValueError(f"the graph step takes fp32 / bf16 weights, not {type(w).__name__}")
    return got


def graph_ready(lean) -> str | None:
    """None when the compiled step can run `lean`, else why not (quantized weights run model.kernels)."""
    if lean.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"activations in {lean.dtype}"
    linears = [lean.lm_head] + [getattr(w, n) for w in lean.layers for n in ("qkv", "o", "gate_up", "down")]
    if not isinstance(lean.embed, torch.Tensor) or any(_float_weight(w) is None for w in linears):
        return f"weights served as {getattr(lean.quant, 'mode', '?')} (the graph step takes fp32 / bf16 weights)"
    return None


@dataclass(frozen=True)
class StepConstants:
    """What a step's regions read besides tensors: shapes, the norm's epsilon, the attention and the products the
    step runs (constants of a trace: the same object for every layer of a model)."""

    n_heads: int
    n_kv: int
    head_dim: int
    scaling: float
    eps: float
    hidden_size: int
    attention: str
    linear: str


class StaticLayer(torch.nn.Module):
    """One layer's weights as module buffers (the same storage, no copy) beside the step's constants: every layer
    is the same region to torch.compile (`_layer`), compiled once for them all (`regional_step`)."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    def __init__(self, w, c: StepConstants):
        super().__init__()
        self.c = c
        qkv, qkv_bias = _dense(w.qkv)
        for name, value in (("in_norm", w.in_norm), ("post_norm", w.post_norm), ("qkv", qkv),
                            ("qkv_bias", w.qkv_bias if w.qkv_bias is not None else qkv_bias),
                            ("q_norm", w.q_norm), ("k_norm", w.k_norm), ("o", _dense(w.o)[0]),
                            ("gate_up", _dense(w.gate_up)[0]), ("down", _dense(w.down)[0])):
            _put(self, name, value)


def _put(module: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
    """`value` as a buffer of `module`, at a static address for CUDA graphs (no identity guard: every layer, and
    another model of the same shapes, is the same compiled region)."""
    if value is not None:
        value = value.detach()
        torch._dynamo.mark_static_address(value, guard=False)
    module.register_buffer(name, value, persistent=False)


class StaticModel(torch.nn.Module):
    """A LeanDecoder's weights as module buffers (the same storage, no copy), so that a compiled step
    sees them at static addresses (CUDA graphs replay on them): the embedding, the final norm and the head here,
    each layer's in `layers`."""

    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    lm_head_bias: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    vocab_ids: torch.Tensor | None

    def __init__(self, lean):
        super().__init__()
        why = graph_ready(lean)
        if why is not None:
            raise ValueError(f"the graph step cannot run this decoder: {why}")
        self.vocab_size, self.dtype = lean.vocab_size, lean.dtype
        attention = resolve_attention(lean.device)  # a constant of the traced step
        if attention == "triton":
            decode_attention.build()  # the kernel's op, before any trace sees it
        linear = resolve_linear()  # a constant of the traced step, as the attention
        if linear == "skinny":
            skinny_linear.build()
            skinny_linear.read_tiles()
        self.c = StepConstants(lean.n_heads, lean.n_kv, lean.head_dim, lean.scaling, lean.eps, lean.hidden_size,
                               attention, linear)
        head, head_bias = _dense(lean.lm_head)
        for name, value in (("embed", lean.embed), ("final_norm", lean.final_norm), ("lm_head", head),
                            ("lm_head_bias", head_bias), ("cos", lean.cos), ("sin", lean.sin),
                            ("vocab_ids", lean.vocab_ids)):
            _put(self, name, value)
        self.layers = torch.nn.ModuleList(StaticLayer(w, self.c) for w in lean.layers)

    @property
    def attention(self) -> str:
        return self.c.attention

    @property
    def linear(self) -> str:
        return self.c.linear

    def forward(self, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: torch.Tensor,
                n_new: torch.Tensor, lens: torch.Tensor, bias: list[torch.Tensor] | None = None,
                capture: tuple[int, ...] = (), last_only: bool = False):
        return static_forward(self, keys, values, tokens, n_new, lens, bias, capture, last_only)


class Regions(NamedTuple):
    """The step's three parts, each a pure function of tensors and constants: as written (`PLAIN`; a whole-step
    trace inlines them into one graph) or each compiled on its own (`regions`: one compile of `_layer` serves every
    layer)."""

    prologue: Callable
    layer: Callable
    epilogue: Callable


def static_forward(m: StaticModel, keys: list[torch.Tensor], values: list[torch.Tensor],
                   tokens: torch.Tensor,  # [S, W] int64 on the device (right-padded)
                   n_new: torch.Tensor,  # [S] int64: real tokens per row (0: the row does not advance)
                   lens: torch.Tensor,  # [S] int64: committed positions per row before the step
                   bias: list[torch.Tensor] | None = None,  # per layer [S, I] added to the MLP's up half (SD²)
                   capture: tuple[int, ...] = (), last_only: bool = False, parts: "Regions | None" = None):
    """One decode-shaped pass over the pool: writes the real tokens' KV, attends over the whole capacity
    under the causal mask. Returns (logits [S, W, V] or [S, 1, V] at each row's last real token,
    residual streams [S, W, hidden] after each `capture` layer, in capture's order, the logits' argmax
    [S, W] or [S, 1]: a greedy verdict's input, computed in the step instead of one more launch after it).
    `parts`: the regions it runs (default: as written)."""
    parts = parts or PLAIN
    x, delta, rows, slot, cos, sin, visible = parts.prologue(m.c, m.embed, m.cos, m.sin, tokens, n_new, lens, keys[0])
    hidden = []
    last = len(m.layers) - 1
    for i, layer in enumerate(m.layers):
        up_bias = None if bias is None else bias[i]
        x, delta = parts.layer(layer, x, delta, keys[i], values[i], rows, slot, cos, sin, visible, up_bias)
        if i in capture and i != last:
            hidden.append(x + delta)
    logits, choices, x = parts.epilogue(m.c, m.final_norm, m.lm_head, m.lm_head_bias, m.vocab_ids, m.vocab_size,
                                        x, delta, n_new, last_only)
    if last in capture:  # the last layer's stream, as the head's region adds it (an eagle head's feature)
        hidden.append(x)
    return logits, tuple(hidden), choices


def _prologue(c: StepConstants, embed: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
              tokens: torch.Tensor, n_new: torch.Tensor, lens: torch.Tensor, kc: torch.Tensor):
    """What every layer of the step reads: the embedded tokens (as the residual stream x = 0 and its pending
    update, `_layer`'s contract), each query's cache slot, its rotary rows, and what the attention reads of the
    queries' positions."""
    S, W = tokens.shape
    C = kc.shape[2]
    dev = tokens.device
    j = torch.arange(W, device=dev)
    pos = lens[:, None] + j[None]  # [S, W] absolute position of each query
    real = j[None] < n_new[:, None]  # [S, W]
    slot = torch.where(real, pos, C - 1)  # padded queries write the trash slot
    at = pos.clamp(max=cos_table.shape[0] - 1)
    cos, sin = cos_table[at][:, :, None], sin_table[at][:, :, None]  # [S, W, 1, D]
    # a query sees keys at positions <= its own; the trash slot (C − 1) is beyond every real query
    if c.attention in ("torch", "sdpa"):  # what the attention reads of the queries' positions: a mask [S, W, C],
        visible = torch.arange(C, device=dev)[None, None] <= pos[:, :, None]
        if c.attention == "sdpa":  # as an additive bias, once for every layer
            visible = _sdpa_bias(visible, c.n_heads // c.n_kv, kc.dtype)
    else:  # the positions [S, W] (triton), the rows' lengths [S] (flex)
        visible = lens if c.attention == "flex" else pos
    rows = torch.arange(S, device=dev)[:, None].expand(S, W)
    delta = F.embedding(tokens, embed)  # [S, W, hidden]
    return torch.zeros_like(delta), delta, rows, slot, cos, sin, visible


def _layer(L: StaticLayer, x, delta, kc, vc, rows, slot, cos, sin, visible, up_bias):
    """One layer on the residual stream x and its pending update `delta` (the MLP's output of the layer before;
    the embedding for the first): returns this layer's (x, delta). Adding the update here, not at the end of the
    layer before, keeps the add fused with this layer's first norm when each layer is its own compiled region."""
    c = L.c
    S, W, _ = x.shape
    H, Hkv, D = c.n_heads, c.n_kv, c.head_dim
    x = x + delta
    h = F.rms_norm(x, (c.hidden_size,), L.in_norm, c.eps)
    q, k, v = _linear(c, h, L.qkv, L.qkv_bias).split((H * D, Hkv * D, Hkv * D), dim=-1)
    q, k, v = q.view(S, W, H, D), k.view(S, W, Hkv, D), v.view(S, W, Hkv, D)
    if L.q_norm is not None:  # Qwen3: per-head RMSNorm of queries and keys
        q = F.rms_norm(q, (D,), L.q_norm, c.eps)
        k = F.rms_norm(k, (D,), L.k_norm, c.eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    kc[rows, :, slot] = k.to(kc.dtype)  # [S, W, Hkv, D] into [S, Hkv, C, D]
    vc[rows, :, slot] = v.to(vc.dtype)
    if c.attention == "torch":  # visible: [S, W, C] bool
        att = _attend(q, kc, vc, visible, c.scaling)  # [S, W, H D]
    elif c.attention == "flex":  # visible: the rows' lengths [S] (query j sits at lens + j)
        att = _flex_attend(q, kc, vc, visible, c.scaling)
    elif c.attention == "sdpa":  # visible: the mask as a bias [S, 1, W rep, C]
        att = _sdpa_attend(q, kc, vc, visible, c.scaling)
    else:  # visible: the queries' positions [S, W]
        att = decode_attention.decode_attention(q, kc, vc, visible, c.scaling)
    x = x + _linear(c, att.to(x.dtype), L.o)
    h = F.rms_norm(x, (c.hidden_size,), L.post_norm, c.eps)
    gate, up = _linear(c, h, L.gate_up).chunk(2, dim=-1)
    if up_bias is not None:
        up = up + up_bias[:, None]
    return x, _linear(c, F.silu(gate) * up, L.down)


def _epilogue(c: StepConstants, final_norm: torch.Tensor, head: torch.Tensor, head_bias: torch.Tensor | None,
              vocab_ids: torch.Tensor | None, vocab_size: int, x: torch.Tensor, delta: torch.Tensor,
              n_new: torch.Tensor, last_only: bool):
    """The last layer's update added, the final norm and the head: (logits, their argmax, the last layer's residual
    stream [S, W, hidden])."""
    x = stream = x + delta
    if last_only:
        S = x.shape[0]
        x = x[torch.arange(S, device=x.device), (n_new - 1).clamp(min=0)][:, None]  # [S, 1, hidden]
    x = F.rms_norm(x, (c.hidden_size,), final_norm, c.eps)
    logits = _linear(c, x, head, head_bias)
    if vocab_ids is not None:  # FR-Spec: the head holds the draft vocabulary's rows only
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        logits = full.index_copy(-1, vocab_ids, logits)
    return logits, logits.argmax(dim=-1), stream


PLAIN = Regions(_prologue, _layer, _epilogue)


def _linear(c: StepConstants, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A weight product of the step: the skinny kernel where the step chose it and the product's shape fits
    (`skinny_linear.fits`: a decision of shapes, the same on every replay), else F.linear."""
    if c.linear == "skinny" and skinny_linear.fits(x, weight):
        return skinny_linear.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention (x [S, W, heads, D], cos/sin [S, W, 1, D])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, W, H, D] over the whole cache kc/vc [S, H_kv, C, D] where visible [S, W, C] → [S, W, H D], in
    the cache's dtype (`attention.kv_dtype`): each query's scores, softmax and value sum reduce over all C keys, masked
    ones exactly 0, whatever the row's length."""
    S, W, H, D = q.shape
    Hkv, C = kc.shape[1], kc.shape[2]
    rep = H // Hkv
    queries = q.to(kc.dtype).view(S, W, Hkv, rep, D).permute(0, 2, 1, 3, 4).reshape(S, Hkv, W * rep, D)
    scores = torch.matmul(queries, kc.transpose(-1, -2)).view(S, Hkv, W, rep, C) * scale
    scores = scores.masked_fill(~visible[:, None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(S, Hkv, W * rep, C)
    out = torch.matmul(probs, vc)  # [S, Hkv, W rep, D]
    return out.view(S, Hkv, W, rep, D).permute(0, 2, 1, 3, 4).reshape(S, W, H * D)


def _sdpa_bias(visible: torch.Tensor, rep: int, dtype: torch.dtype) -> torch.Tensor:
    """The step's mask [S, W, C] as `_sdpa_attend`'s additive bias [S, 1, W rep, C] in the cache's dtype:
    0 where a key is visible, -inf elsewhere, each query's row repeated for the `rep` heads sharing a KV head."""
    S, W, C = visible.shape
    bias = torch.zeros(S, W, C, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    return bias[:, None, :, None].expand(S, 1, W, rep, C).reshape(S, 1, W * rep, C)


def _sdpa_attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """`_attend`'s contract through torch's scaled_dot_product_attention: q [S, W, H, D] over the whole cache kc/vc
    [S, H_kv, C, D] under `bias` (`_sdpa_bias`) → [S, W, H D] in the cache's dtype. The queries sharing a KV head
    are one head's W · rep queries (no copy of the keys); every step has the same shapes, so the same kernel and
    the same order of reduction: exact by the graph step's construction."""
    S, W, H, D = q.shape
    Hkv = kc.shape[1]
    rep = H // Hkv
    queries = q.to(kc.dtype).view(S, W, Hkv, rep, D).permute(0, 2, 1, 3, 4).reshape(S, Hkv, W * rep, D)
    out = F.scaled_dot_product_attention(queries, kc, vc, attn_mask=bias, scale=scale)  # [S, Hkv, W rep, D]
    return out.view(S, Hkv, W, rep, D).permute(0, 2, 1, 3, 4).reshape(S, W, H * D)


def _flex_attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`_attend`'s contract through flex attention: q [S, W, H, D] over the whole cache kc/vc [S, H_kv, C, D], a key
    visible to query j of row b at positions <= lens[b] + j → [S, W, H D] in the cache's dtype. Each query's
    result reduces over the same keys in the same order whatever the other queries hold, and every step has the
    same shapes (so the same kernel and the same split of the keys): exact by the graph step's construction.
    (The mask reads the step's input `lens`, not positions computed in the step: inductor's CPU template refuses
    a computed buffer there.)"""
    from torch.nn.attention.flex_attention import flex_attention

    S, W, H, D = q.shape

    def visible(score, b, h, query, key):
        return torch.where(key <= lens[b] + query, score, float("-inf"))

    out = flex_attention(q.to(kc.dtype).transpose(1, 2), kc, vc, score_mod=visible, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(S, W, H * D)


def compile_step(model: StaticModel, device: torch.device, compiled: bool = True):
    """The callable a GraphDecoder runs: `model` itself (eager; tests and debugging), or compiled with
    fullgraph=True region by region (`regional_step`): a graph break or host sync in the step is an error, not a
    silent slowdown. No CUDA graph here: on CUDA the GraphDecoder captures the compiled step itself, one graph
    per pool (`CapturedStep`), and replays it without dynamo's guards or the cudagraph trees' bookkeeping. Only
    torch.compile's own CUDA graphs (SPECLOOP_CUDA_GRAPHS=trees) take the whole step as one graph."""
    if not compiled:
        return model
    if device.type == "cuda" and capture_mode() == "trees":
        return torch.compile(model, fullgraph=True, dynamic=False, mode="reduce-overhead")
    mode = None
    if os.environ.get("SPECLOOP_AUTOTUNE") == "1":  # Triton GEMMs tuned for the step's shapes
        from torch._inductor import config as inductor

        inductor.coordinate_descent_tuning = True  # (minutes of compile per shape; measured in
        mode = "max-autotune-no-cudagraphs"  # bench/gpu.py's section paths)
    return regional_step(model, compiled_regions(mode))


@functools.cache
def compiled_regions(mode: str | None = None) -> Regions:
    """The step's regions, each compiled with fullgraph=True, once per process and inductor mode (torch.compile
    keeps a graph per shapes and constants of each: one `_layer` graph serves every layer of a model, where a
    whole-step trace compiled every layer again: bench/README.md section 36)."""
    return Regions(*(torch.compile(fn, fullgraph=True, dynamic=False, mode=mode) for fn in PLAIN))


def regional_step(model: StaticModel, parts: Regions):
    """`model`'s step (its call's signature) running `parts`: the glue between the regions is a loop over the layers
    and the adds of the layers a pass captures, nothing that reads the device; on CUDA the whole step, regions and
    glue, is captured as one graph (`CapturedStep`), so the glue costs nothing on replay."""
    return functools.partial(static_forward, model, parts=parts)


def capture_mode() -> str:
    """How a CUDA step runs: "direct" (default: `CapturedStep`, a torch.cuda.CUDAGraph per pool and
    capture set), "trees" (torch.compile's mode="reduce-overhead"; SPECLOOP_CUDA_GRAPHS=trees) or "off"
    (the compiled step launched kernel by kernel; for debugging)."""
    mode = os.environ.get("SPECLOOP_CUDA_GRAPHS", "direct")
    if mode not in ("direct", "trees", "off"):
        raise ValueError(f"SPECLOOP_CUDA_GRAPHS must be direct, trees or off, got {mode!r}")
    return mode


# a pool held by a GraphDecoder: its keys, its values, and its cache (a weak reference; `_gone` once released)
Held = tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], object]]


def direct_capture(device: torch.device, compiled: bool) -> bool:
    """Whether a GraphDecoder replays its step as CapturedStep graphs: on CUDA, compiled, in "direct" mode."""
    return compiled and device.type == "cuda" and capture_mode() == "direct"


class CapturedStep:
    """The compiled step over one pool, for one capture set, as one CUDA graph: its inputs are buffers
    of its own (tokens [S, W]; counts and lengths as one [2, S] tensor, one copy from the host), its
    outputs the tensors the capture produced (overwritten by the next replay: callers copy them). The
    pool and the weights are read and written in place, at the addresses the graph was captured with:
    a graph lives on its pool (`GraphDecoder._graphs_of`), and an engine that reuses the pool
    (`GraphDecoder.new_cache`) reuses its graphs."""

    def __init__(self, fn, pool, slots: int, width: int, capture: tuple[int, ...], last_only: bool,
                 bias_shapes: list[tuple[int, ...]] | None, dtype: torch.dtype):
        dev = pool[0][0].device
        self.tokens = torch.zeros(slots, width, dtype=torch.long, device=dev)
        self.meta = torch.zeros(2, slots, dtype=torch.long, device=dev)  # n_new, lens
        self.bias = None if bias_shapes is None else [torch.zeros(s, dtype=dtype, device=dev) for s in bias_shapes]
        call = lambda: fn(*pool, self.tokens, self.meta[0], self.meta[1], self.bias, capture, last_only)  # noqa: E731
        self.replay, self.out = _record(call) if dev.type == "cuda" else _rerun(call)

    def __call__(self, tokens: torch.Tensor, meta: torch.Tensor, bias: list[torch.Tensor] | None):
        B, T = tokens.shape  # the buffer's other positions keep earlier steps' tokens: padded queries (their
        self.tokens[:B, :T].copy_(tokens, non_blocking=True)  # count says so) write the trash slot, seen by none
        self.meta.copy_(meta, non_blocking=True)
        if self.bias is not None and bias is not None:
            for mine, b in zip(self.bias, bias):
                mine.zero_()
                mine[: len(b)].copy_(b, non_blocking=True)
        self.replay()
        return self.out


def _record(call):
    """(replay, outputs) of `call` captured as a CUDA graph, after two warm-up calls on a side stream
    (inductor compiles there; no row is real: only the trash slot is written)."""
    dev = torch.cuda.current_device()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph.replay, out


def _rerun(call):
    """`_record`'s contract without a GPU (tests): a replay calls again and writes the result into the
    outputs of the first call, as a graph's replay overwrites its outputs."""
    out = call()

    def replay() -> None:
        for mine, new in zip(_flat(out), _flat(call())):
            mine.copy_(new)
    return replay, out


def _flat(out) -> list[torch.Tensor]:
    return torch.utils._pytree.tree_leaves(out)


class Replay:
    """A function of static-shape tensors run as one captured graph (on CUDA; on the CPU, tests: called
    again) on input buffers of its own: a call copies its values into the buffers' first rows, replays, and
    returns the capture's outputs (overwritten by the next call: callers copy what they keep). The eagle
    head's draft chain runs so (specloop.drafter.kinds.eagle)."""

    def __init__(self, fn, buffers: list[torch.Tensor]):
        self.buffers = buffers
        call = lambda: fn(*buffers)  # noqa: E731
        self.replay, self.out = _record(call) if buffers[0].device.type == "cuda" else _rerun(call)

    def __call__(self, *values: torch.Tensor):
        for buf, value in zip(self.buffers, values):
            buf[: len(value)].copy_(value, non_blocking=True)
        self.replay()
        return self.out


def pool_shape(batch: int, capacity: int, lean) -> tuple[int, int, int, int]:
    """A graph pool's KV shape per layer: one position longer than asked (the trash slot), in whole key
    blocks, rounded up to one of 8 sizes per octave (at most 1/8 more): engines sized by their longest
    prompt (`generate`, batch by batch) share a few compiled shapes instead of one per 64 positions."""
    blocks = _round_up(capacity + 1, KEY_BLOCK) // KEY_BLOCK
    step = 1 << max(0, blocks.bit_length() - 4)
    return (batch, lean.n_kv, KEY_BLOCK * _round_up(blocks, step), lean.head_dim)


class GraphDecoder:
    """A LeanDecoder whose decode-shaped passes on the engine's pool run one compiled static step.

    slots: the pool's rows (every step runs all of them); width: W, the query positions per row (the
    verifier: k_max + 1; a drafter LM: 2, its pending tokens). Every other attribute is the wrapped
    decoder's, and every other pass its own."""

    def __init__(self, lean, slots: int, width: int, compiled: bool = True, direct: bool | None = None):
        self.lean, self.slots, self.width, self.compiled = lean, slots, width, compiled
        self.model = StaticModel(lean)
        # every decoder's step is one code object to dynamo: each model, width and pool shape a compile of it (the
        # verifier's, a drafter LM's and each one's prefiller: more than dynamo's default 8 in one process)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.step_fn = compile_step(self.model, lean.device, compiled)
        # on CUDA, the compiled step replays as this decoder's own CUDA graphs (CapturedStep); `direct`
        # forces it either way (on the CPU a "graph" re-runs the step: tests of the buffers around it)
        self.direct = direct_capture(lean.device, compiled) if direct is None else direct
        self.graph_calls = 0  # passes the static step ran (the rest went to the eager decoder)
        self.captures = 0  # CUDA graphs captured (one per pool and capture set)
        self.capture_error: str | None = None  # why capturing failed, where it did (then: torch.compile's graphs)
        # pools by shape, each with the cache that holds it (a weak reference: a pool is free again once the
        # engine that took it is gone): a new engine of the same shape reuses a free pool, and its graphs
        self._pools: dict[tuple[int, ...], list[Held]] = {}
        self._scratch: dict[tuple[int, ...], KVCache] = {}  # a prefiller's 1-row pools (`chunked_prefill`)
        self._widest: dict[tuple[bool, bool], tuple[int, ...]] = {}  # `_capture_set`: per kind of pass

    def __getattr__(self, name: str):
        return getattr(self.__dict__["lean"], name)

    @property
    def eager(self):
        """The wrapped LeanDecoder: what prefills run (specloop.drafter.model.kv_cache), whatever the cache."""
        return self.lean

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A cache the LeanDecoder's passes can use too; a pool (batch == slots) gets the trash slot and
        static addresses for the compiled step: a free pool of the same shape (zeroed), else a new one."""
        if batch != self.slots:
            return self.lean.new_cache(batch, capacity)
        shape = pool_shape(batch, capacity, self.lean)
        held = self._pools.setdefault(shape, [])
        free = _first_free(held)
        held[:] = [p for p in held if p[2]() is not None or p is free]  # one free pool per shape is kept
        if free is not None:
            keys, values = free[0], free[1]
            for t in keys + values:
                t.zero_()
            held.remove(free)
        else:
            keys, values = self._new_pool(shape)
        cache = KVCache(keys, values, torch.zeros(batch, dtype=torch.long))
        held.append((keys, values, weakref.ref(cache)))
        return cache

    def release(self, cache: KVCache) -> None:
        """`cache`'s pool is free for the next engine of its shape now, not only once the cache is collected
        (an engine whose owner is done with it: `Engine.close`); the cache must not be used after this."""
        for held in self._pools.values():
            for i, (keys, values, ref) in enumerate(held):
                if ref() is cache:
                    held[i] = (keys, values, _gone)

    def _new_pool(self, shape: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for _ in range(self.lean.num_layers):
            for store in (keys, values):
                t = torch.zeros(shape, device=self.lean.device, dtype=self.lean.kv_dtype)
                # static for CUDA graphs, no identity guard: another pool of this shape reuses the compiled step
                torch._dynamo.mark_static_address(t, guard=False)
                t._specloop_pool = True  # type: ignore[attr-defined]  # a marker on the tensor object (read by _pool)
                store.append(t)
        return keys, values

    def _pool(self, cache: KVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The pool tensors behind `cache` when it is the pool or its first rows (the engine's step over
        the occupied prefix), else None."""
        k0 = cache.keys[0]
        base = k0 if k0._base is None else k0._base
        if not getattr(base, "_specloop_pool", False) or k0.storage_offset() != 0 or base.shape[0] != self.slots:
            return None
        full = lambda t: t if t._base is None else t._base  # noqa: E731
        return [full(t) for t in cache.keys], [full(t) for t in cache.values]

    @property
    def chunked_prefill(self) -> bool:
        """Whether prompts are prefilled through `prefill_rows` (captured chunks) rather than the LeanDecoder's own
        eager passes: where the steps replay captured graphs (a GPU), unless SPECLOOP_PREFILL=eager;
        SPECLOOP_PREFILL=graph forces it (the CPU's tests)."""
        wanted = os.environ.get("SPECLOOP_PREFILL", "auto")
        if wanted not in PREFILLS:
            raise ValueError(f"SPECLOOP_PREFILL must be one of {', '.join(PREFILLS)}, got {wanted!r}")
        return wanted == "graph" or (wanted == "auto" and self.direct)

    def prefiller(self) -> "GraphDecoder":
        """The 1-row, PREFILL_CHUNK-wide static step of this decoder's model (one per model, `on_backend`)."""
        return on_backend(self.lean, "graph", 1, PREFILL_CHUNK, self.compiled)

    def scratch(self, capacity: int) -> KVCache:
        """This (1-row) decoder's pool of `capacity` positions, kept for every prefill after: a prompt is
        prefilled into it chunk by chunk, then copied into its row of the engine's pool."""
        shape = pool_shape(1, capacity, self.lean)
        if shape not in self._scratch:
            self._scratch[shape] = self.new_cache(1, capacity)
        return self._scratch[shape]

    @torch.inference_mode()
    def prefill_rows(self, cache: KVCache, slots: list[int], prompts: list[list[int]],
                     capture: tuple[int, ...] = (), tail: int = 0):
        """specloop.drafter.model.kv_cache.prefill_rows's contract through captured passes: each prompt (but its
        last token) in chunks of PREFILL_CHUNK tokens, each chunk one replay of the 1-row static step over a
        scratch pool (`prefiller`), then its KV copied into row `slots[b]` of `cache`. On a GPU the LeanDecoder's
        eager prefill launches ~30 kernels a layer from Python per prompt (several ms for a 30-layer model,
        most of an admission at batch 8); a chunk is one launch. One prompt at a time in a 1-row pool: a
        prompt's KV does not depend on which others joined with it. Returns (features, recent, recent_lens)."""
        step = self.prefiller()
        scratch = step.scratch(cache.capacity)
        got = PromptFeatures.zeros(self.lean, prompts, capture, tail)
        first: dict[tuple[int, ...], int] = {}  # identical prompts (n > 1, repeated requests) are computed once
        for b, (slot, prompt) in enumerate(zip(slots, prompts)):
            n = len(prompt) - 1
            cache.lens[slot] = max(n, 0)
            if n < 1:
                continue
            src = first.setdefault(tuple(prompt), b)
            if src != b:
                copy_positions(cache, slots[src], cache, slot, n)
                got.copy(b, src)
                continue
            scratch.lens = torch.zeros(1, dtype=torch.long)  # what was there before is beyond every query
            tokens = torch.tensor([prompt[:n]])
            parts = [step.forward(scratch, tokens[:, lo:hi], last_only=True, capture=capture).hidden  # no logits
                     for lo, hi in prefill_spans(0, n)]
            copy_positions(scratch, 0, cache, slot, n)
            got.keep(b, {i: torch.cat([h[i][0] for h in parts]) for i in capture})
        return got.parts()

    @torch.inference_mode()
    def warm_prefill(self, capacity: int, capture: tuple[int, ...]) -> float:
        """Compile (and on CUDA capture) the prefiller's step for a pool of `capacity` before the first admission
        needs it. Seconds."""
        step = self.prefiller()
        return step.warm(step.scratch(capacity), {capture}, last_only=True)

    def _capture_set(self, capture: tuple[int, ...], last_only: bool, biased: bool) -> tuple[int, ...]:
        """The layers a pass that asks `capture` runs capturing: the widest set run so far by passes of its kind
        (last_only, biased), grown to cover `capture` where it does not. Every pass of an engine with a drafter then
        runs one graph (the verifier's step captures the drafter's layers on plain steps too: a compile and a CUDA
        graph fewer at start-up, and a plain step and a verify pass are the same graph by construction); the extra
        residual streams a pass did not ask for are written, not copied out."""
        key = (last_only, biased)
        widest = self._widest.get(key, ())
        if not set(capture) <= set(widest):
            widest = tuple(sorted(set(widest) | set(capture)))
            self._widest[key] = widest
        return widest

    def _graphs_of(self, pool) -> dict:
        """The CUDA graphs captured on this pool (kept on its first tensor: they go when the pool goes)."""
        return pool[0][0].__dict__.setdefault("_specloop_graphs", {})

    def _captured(self, pool, capture: tuple[int, ...], last_only: bool, bias: list[torch.Tensor] | None,
                  depth: int = 0) -> CapturedStep:
        """The pool's graph of the step for this capture set (depth > 0: of `depth` chained greedy passes,
        `draft_chain`), captured on first use."""
        graphs = self._graphs_of(pool)
        key = ("chain", depth, bias is not None) if depth else (capture, last_only, bias is not None)
        if key not in graphs:
            shapes = None if bias is None else [(self.slots, *b.shape[1:]) for b in bias]
            fn = _chain(self.step_fn, depth) if depth else self.step_fn
            graphs[key] = CapturedStep(fn, pool, self.slots, self.width, capture, last_only, shapes, self.lean.dtype)
            self.captures += 1
        return graphs[key]

    def _fall_back(self, exc: Exception) -> None:
        """A capture that failed leaves this decoder on torch.compile's own CUDA graphs (mode="reduce-overhead"),
        said once on the log: serving goes on, slower to start."""
        log.warning("graph step: capturing a CUDA graph failed (%s: %s); using torch.compile's cudagraph trees",
                    type(exc).__name__, exc)
        self.direct, self.capture_error = False, f"{type(exc).__name__}: {exc}"
        self.step_fn = torch.compile(self.model, fullgraph=True, dynamic=False, mode="reduce-overhead")

    @torch.inference_mode()
    def draft_chain(self, cache: KVCache, tokens: torch.Tensor, n_new: torch.Tensor, depth: int,
                    bias: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`depth` greedy drafts of this decoder's LM (a drafter's) for the rows of `cache` as one captured graph:
        the first pass feeds `tokens` [B, T <= W] (n_new [B] real each), every later one the previous pass's
        argmax; (drafts [B, depth], their logits [B, depth, V]), copies. Exactly the passes `forward` would
        run one by one (last_only), so `cache.lens` advances as theirs would: n_new, then 1 per later pass.
        None where the chain cannot run (not replaying its own graphs, or not on the pool): loop `forward`."""
        pool = self._pool(cache) if self.direct and tokens.shape[1] <= self.width else None
        if pool is None:
            return None
        B, n_new = len(tokens), n_new.cpu()
        step = self._captured(pool, (), True, bias, depth)
        drafts, logits = step(tokens, _meta(n_new, cache.lens, self.slots), bias)
        self.graph_calls += depth
        cache.lens = cache.lens + n_new + (depth - 1) * (n_new > 0).long()
        return drafts[:B].clone(), logits[:B].clone()

    @torch.inference_mode()
    def warm(self, cache: KVCache, captures: set[tuple[int, ...]], last_only: bool = False,
             biased: bool = False) -> float:
        """Compile (and on CUDA capture) the step before any request needs it, capturing every layer of `captures`
        (one graph for them all: `_capture_set`): a pass over `cache`'s pool in which no row has a real token (only
        the trash slot is written); `biased`: the passes carry per-layer MLP biases (an SD² drafter's LM). Seconds."""
        pool = self._pool(cache)
        if pool is None:
            raise ValueError("warm() takes the pool this decoder's new_cache made")
        t0 = time.perf_counter()
        S, W, dev = self.slots, self.width, self.lean.device
        m = self.model
        bias = [torch.zeros(S, layer.gate_up.shape[0] // 2, dtype=m.dtype, device=dev)
                for layer in m.layers] if biased else None
        capture = self._capture_set(tuple(i for c in captures for i in c), last_only, biased)
        captured = False
        if self.direct:
            try:
                self._captured(pool, capture, last_only, bias)
                captured = True
            except Exception as exc:  # noqa: BLE001 - any failure of a capture falls back, logged
                self._fall_back(exc)
        if not captured:  # inputs as forward passes them: distinct tensors (dynamo guards on aliasing)
            tokens, counts, lens = (torch.zeros(shape, dtype=torch.long, device=dev) for shape in ((S, W), (S,), (S,)))
            self.step_fn(*pool, tokens, counts, lens, bias, capture, last_only)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def forward(self, cache: KVCache, tokens: torch.Tensor, n_new: torch.Tensor | None = None,
                last_only: bool = False, capture: tuple[int, ...] = (),
                mlp_up_bias: list[torch.Tensor] | None = None, choose: bool = False):
        """LeanDecoder.forward's contract (append at each row's lens, advance lens by n_new; the captured step finds
        its choices whatever `choose` says)."""
        B, T = tokens.shape
        pool = self._pool(cache) if T <= self.width else None
        if pool is None:
            return self.lean.forward(cache, tokens, n_new, last_only, capture, mlp_up_bias, choose=choose)
        n_new = torch.full((B,), T, dtype=torch.long) if n_new is None else n_new.cpu()
        S, W, dev = self.slots, self.width, self.lean.device
        meta = _meta(n_new, cache.lens, S)  # counts, lens: one copy to the device
        wanted = set(capture)
        capture = self._capture_set(tuple(wanted), last_only, mlp_up_bias is not None)
        step = None
        if self.direct:
            try:
                step = self._captured(pool, capture, last_only, mlp_up_bias)
            except Exception as exc:  # noqa: BLE001 - any failure of a capture falls back, logged
                self._fall_back(exc)
        if step is not None:
            logits, hidden, choices = step(tokens, meta, mlp_up_bias)
        else:
            padded = torch.zeros(S, W, dtype=torch.long, device=dev)  # on the device: the tokens may be drafts there
            padded[:B, :T] = tokens.to(dev)
            bias = None if mlp_up_bias is None else [_pad_rows(b, S) for b in mlp_up_bias]
            counts, lens = meta[0].to(dev), meta[1].to(dev)  # distinct tensors, as warm() passes them
            logits, hidden, choices = self.step_fn(*pool, padded, counts, lens, bias, capture, last_only)
        self.graph_calls += 1
        cache.lens = cache.lens + n_new
        # copies, of the layers asked for: a captured graph's outputs are overwritten by its next replay
        logits, choices = (logits[:B], choices[:B]) if last_only else (logits[:B, :T], choices[:B, :T])
        return ForwardOut(logits=logits.clone(), choices=choices.clone(),
                          hidden={i: h[:B, :T].clone() for i, h in zip(capture, hidden) if i in wanted})


def prefill_spans(start: int, n: int) -> list[tuple[int, int]]:
    """A chunked prefill's passes (first, end) over positions [start, n): PREFILL_CHUNK tokens each, the last
    what is left. Each is one replay of the same static step, whose result for a position does not depend on
    how many of its queries are real: the KV is the same bits however a prompt is cut (a prefix cache's hit
    followed by the rest is a fresh prefill)."""
    return [(a, min(a + PREFILL_CHUNK, n)) for a in range(start, n, PREFILL_CHUNK)]


def _chain(step, depth: int):
    """The static step run `depth` times as one function of its inputs (CapturedStep's signature): greedy drafts,
    each pass fed the argmax of the one before (one real token: rows that had any), lengths advanced on the
    device between passes; returns (drafts [S, depth], their logits [S, depth, V])."""

    def run(keys, values, tokens, n_new, lens, bias, capture, last_only):
        drafts, logits = [], []
        meta, one = torch.stack((n_new, lens)), (n_new > 0).long()
        for _ in range(depth):  # each pass's counts and lengths as views of one tensor, as CapturedStep passes them
            out, _, choice = step(keys, values, tokens, meta[0], meta[1], bias, (), True)  # [S, 1, V], [S, 1]
            drafts.append(choice[:, 0])
            logits.append(out[:, 0])
            meta = torch.stack((one, meta[1] + meta[0]))
            tokens = choice.expand(-1, tokens.shape[1]).contiguous()  # its other positions are padding
        return torch.stack(drafts, dim=1), torch.stack(logits, dim=1)
    return run


def _meta(n_new: torch.Tensor, lens: torch.Tensor, slots: int) -> torch.Tensor:
    """[2, slots] int64 on the host: each row's real tokens and its length before the step (rows past the
    step's: 0, 0)."""
    if len(n_new) == slots:
        return torch.stack((n_new.long(), lens.long()))
    meta = torch.zeros(2, slots, dtype=torch.long)
    meta[0, : len(n_new)], meta[1, : len(n_new)] = n_new, lens
    return meta


def _gone() -> None:
    """A released pool's reference: its cache is gone (`GraphDecoder.release`)."""
    return None


def _first_free(held: list) -> tuple | None:
    """The first pool in `held` whose cache is gone (None: all in use)."""
    return next((p for p in held if p[2]() is None), None)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def decoder_key(lean, slots: int, width: int, compiled: bool) -> tuple:
    """Which GraphDecoder `on_backend` keeps for `lean`: its shape, and the environment's choices of the step
    (capture, attention, products and their tilings, autotuning)."""
    return (slots, width, compiled, capture_mode(), resolve_attention(lean.device), resolve_linear(),
            os.environ.get("SPECLOOP_SKINNY_TILES"), os.environ.get("SPECLOOP_AUTOTUNE") == "1")


def on_backend(lean, backend: str, slots: int, width: int, compiled: bool = True):
    """`lean` (a LeanDecoder, or a GraphDecoder an earlier engine made) as an engine of `slots` rows runs it:
    the LeanDecoder itself (eager), or its GraphDecoder for (slots, width): one per decoder and shape,
    kept on the decoder, so that every engine of that shape (`generate` batch after batch, an engine
    per drafter version) reuses one compiled step."""
    lean = getattr(lean, "eager", lean)
    if backend == "eager":
        return lean
    graphs = lean.__dict__.setdefault("_graph_decoders", {})
    key = decoder_key(lean, slots, width, compiled)
    if key not in graphs:
        graphs[key] = GraphDecoder(lean, slots, width, compiled)
    return graphs[key]
