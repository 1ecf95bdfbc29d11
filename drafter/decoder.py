"""A lean forward pass over a Hugging Face SwiGLU decoder, with a static per-row KV cache.

The Hugging Face module stays the owner of the weights (training, saving); this class holds fused
views of them (q|k|v and gate|up concatenated) and runs the few operations a decode step needs,
without the generic machinery that dominates the cost of a small forward pass on a CPU.

KV cache layout: one preallocated tensor per layer, `[B, capacity, H_kv, D]`, rows left-aligned,
`lens[b]` valid positions in row b. Invariant: positions `< lens[b]` hold the KV of committed
tokens; anything beyond is stale and is always overwritten before a query can see it (a forward
writes all of its T positions before attending, and the causal mask hides positions beyond each
query). Rolling back after a rejection is therefore only `lens[b] = new_len`: the accepted prefix is
never recomputed and nothing reallocates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter import kernels
from drafter.quant import linear
from drafter.vocab import expand

SUPPORTED_ACT = {"silu", "swish"}


class UnsupportedModel(ValueError):
    """The checkpoint is not a SwiGLU decoder this forward pass reproduces exactly."""


@dataclass
class KVCache:
    keys: list[torch.Tensor]  # per layer [B, H_kv, capacity, D], KV_DTYPE (capacity: whole KEY_BLOCKs)
    values: list[torch.Tensor]  # per layer [B, H_kv, capacity, D]
    lens: torch.Tensor  # [B] int64 on the host: valid positions per row

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, T, V] (or [B, 1, V] when only the last valid position was asked for)
    hidden: dict[int, torch.Tensor]  # layer index -> [B, T, hidden] (residual stream after that layer)


@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 H_kv) D, hidden] (the linears: raw tensors, or drafter.quant weight objects)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3-style per-head RMSNorm weights [D]
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor


def _tensor(module, name: str) -> torch.Tensor | None:
    """The detached tensor at dotted `name` under `module` ("self_attn.q_proj.bias"), or None where the
    module has none (no such submodule, or a None bias)."""
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module.detach()


def fuse_layer(get) -> _Layer:
    """One decoder layer's inference weights, q|k|v and gate|up concatenated (copies; the rest as
    given). `get(name)` returns the tensor of the layer's parameter `name` ("self_attn.q_proj.weight",
    names as in a Hugging Face Llama / Qwen2 / Qwen3 layer), or None where the layer has none."""
    biases = [get(f"self_attn.{p}_proj.bias") for p in "qkv"]
    return _Layer(
        in_norm=get("input_layernorm.weight"),
        qkv=torch.cat([get(f"self_attn.{p}_proj.weight") for p in "qkv"]),
        qkv_bias=None if biases[0] is None else torch.cat(biases),
        q_norm=get("self_attn.q_norm.weight"),
        k_norm=get("self_attn.k_norm.weight"),
        o=get("self_attn.o_proj.weight"),
        post_norm=get("post_attention_layernorm.weight"),
        gate_up=torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]),
        down=get("mlp.down_proj.weight"),
    )


def check_config(cfg) -> None:
    """What the config alone says about support: a SwiGLU MLP, full attention."""
    act = getattr(cfg, "hidden_act", None)
    if act not in SUPPORTED_ACT:
        raise UnsupportedModel(f"{cfg.model_type}: hidden_act={act!r}; specloop needs a SwiGLU (silu) MLP")
    if getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModel(f"{cfg.model_type}: sliding-window attention is not supported")


def _check_structure(hf_model) -> None:
    check_config(hf_model.config)
    cfg = hf_model.config
    layer = hf_model.model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(layer.self_attn, name):
            raise UnsupportedModel(f"{cfg.model_type}: attention has no {name}")
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not hasattr(layer.mlp, name):
            raise UnsupportedModel(f"{cfg.model_type}: MLP has no {name} (not SwiGLU)")


@dataclass(frozen=True)
class Architecture:
    """What a decoder needs to know of its model besides the weights."""

    config: object  # the transformers config
    head_dim: int
    scaling: float  # the attention's score scale
    vocab_size: int  # rows of the LM head

    @classmethod
    def of_module(cls, hf_model) -> "Architecture":
        """Read from a module (one on the meta device will do)."""
        _check_structure(hf_model)
        attn0 = hf_model.model.layers[0].self_attn
        return cls(hf_model.config, int(attn0.head_dim), float(attn0.scaling), hf_model.lm_head.weight.shape[0])


class StaticRope:
    """The rotary embedding of a Llama / Qwen2 / Qwen3 module, without the module: inverse frequencies
    and a scale fixed at construction (every rope type but the dynamic ones), applied as the module's
    forward applies them (`cos/sin(position · inv_freq) · scale` in fp32, then cast), so the tables are
    the module's bit for bit."""

    DYNAMIC = ("dynamic", "longrope")  # their frequencies change with the sequence length: the module's own

    def __init__(self, inv_freq: torch.Tensor, scale: float):
        self.inv_freq, self.scale = inv_freq, scale

    @classmethod
    def of_config(cls, cfg, head_dim: int) -> "StaticRope | None":
        """None where the rope type is dynamic or unknown here."""
        params = getattr(cfg, "rope_parameters", None) or {}
        kind = params.get("rope_type", "default")
        if kind == "default":
            base = params["rope_theta"]
            return cls(1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0)
        if kind in cls.DYNAMIC:
            return None
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS.get(kind)
        return None if init is None else cls(*init(cfg))

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(x.dtype), (emb.sin() * self.scale).to(x.dtype)


class LeanDecoder:
    """Fast inference forward for Llama / Qwen2 / Qwen3-style decoders, sharing the HF weights."""

    def __init__(self, hf_model, max_positions: int | None = None):
        base = hf_model.model
        self._describe(Architecture.of_module(hf_model))
        self.embed = base.embed_tokens.weight.detach()
        self.final_norm = base.norm.weight.detach()
        self.lm_head = hf_model.lm_head.weight.detach()
        self.layers = [self._fuse(layer) for layer in base.layers]
        self._finish(base.rotary_emb, max_positions)

    @classmethod
    def from_parts(cls, arch: Architecture, embed: torch.Tensor, final_norm: torch.Tensor, lm_head,
                   layers: list[_Layer], rotary, max_positions: int | None = None) -> "LeanDecoder":
        """A decoder of architecture `arch` over weights prepared elsewhere, without the module that
        would own them: drafter.models streams a checkpoint into it tensor by tensor.

        `embed`, `final_norm`, `lm_head` as `__init__` takes them from a module (`lm_head` may already
        be a drafter.quant weight object); `layers`: `fuse_layer` results (an empty list may be filled
        afterwards, e.g. by `quantize_decoder(..., layers=...)`); `rotary`: the model's rotary embedding
        (its module, or a `StaticRope`), called as `rotary(x, position_ids)`. Activations, cache and
        RoPE tables take `embed`'s dtype, as in `__init__`."""
        check_config(arch.config)
        self = cls.__new__(cls)
        self._describe(arch)
        self.embed, self.final_norm, self.lm_head = embed, final_norm, lm_head
        self.layers = layers
        self._finish(rotary, max_positions)
        return self

    def _describe(self, arch: Architecture) -> None:
        """Shapes and constants of the architecture."""
        cfg = arch.config
        self.config = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = arch.head_dim
        self.scaling = arch.scaling
        self.eps = float(cfg.rms_norm_eps)
        self.hidden_size = cfg.hidden_size
        self.vocab_size = arch.vocab_size

    def _finish(self, rotary, max_positions: int | None) -> None:
        self.device = self.embed.device
        self.dtype = self.embed.dtype  # activations, KV cache, RoPE tables (drafter.quant may change it)
        self.quant = None  # drafter.quant.QuantSpec once quantize_decoder prepared the linears
        self.vocab_ids: torch.Tensor | None = None  # FR-Spec draft vocabulary: the LM head holds these rows only
        n = max_positions or int(getattr(self.config, "max_position_embeddings", 4096))
        self.cos, self.sin = self._rope_tables(rotary, n)
        # drafter.kernels (RMSNorm, SwiGLU, and RoPE + cache write + attention in one call per layer) on
        # the CPU where they build; else, and with SPECLOOP_KERNELS=stock, torch's ops and
        # exact_attention: the reference path
        widths = (self.hidden_size, int(self.config.intermediate_size))
        self.fused = (self.device.type == "cpu" and self.head_dim in (32, 64, 128, 256) and kernels.available()
                      and all(w % 16 == 0 for w in widths))
        self._rope32 = (self.cos.float().contiguous(), self.sin.float().contiguous()) if self.fused else None

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Score only the vocabulary rows `ids` (sorted; drafter.vocab): forward's logits are still
        [.., vocab_size], -inf outside them. Before quantizing: the smaller head is what gets packed."""
        if self.quant is not None or self.vocab_ids is not None:
            raise ValueError("restrict the vocabulary once, before quantize_decoder")
        self.lm_head = self.lm_head[ids.to(self.lm_head.device)]
        self.vocab_ids = ids.to(self.device)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _fuse(self, layer) -> _Layer:
        return fuse_layer(lambda name: _tensor(layer, name))

    def _rope_tables(self, rotary, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [0, n) from the model's own rotary module (any rope type it knows)."""
        pos = torch.arange(n, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            cos, sin = rotary(probe, pos)
        return cos[0].to(self.dtype), sin[0].to(self.dtype)  # [n, D]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        if capacity > _round_up(self.cos.shape[0], KEY_BLOCK):  # positions() guards the table's own end
            raise ValueError(f"sequence of {capacity} positions exceeds the model's {self.cos.shape[0]}")
        shape = (batch, self.n_kv, _round_up(capacity, KEY_BLOCK), self.head_dim)  # whole key blocks
        mk = lambda: torch.zeros(shape, device=self.device, dtype=KV_DTYPE)  # noqa: E731
        return KVCache(
            keys=[mk() for _ in self.layers],
            values=[mk() for _ in self.layers],
            lens=torch.zeros(batch, dtype=torch.long),
        )

    def positions(self, cache: KVCache, T: int) -> "StepPositions":
        """Where T new tokens per row go: row b writes positions lens[b] .. lens[b] + T - 1. Keys are
        attended in whole blocks of KEY_BLOCK (`exact_attention`), the tail masked."""
        B = cache.lens.shape[0]
        max_len = int(cache.lens.max()) + T
        if max_len > min(cache.capacity, self.cos.shape[0]):
            raise ValueError(f"KV cache of {min(cache.capacity, self.cos.shape[0])} positions is full")
        if self.fused:  # drafter.kernels.attend needs only where each row starts
            return StepPositions(rows=None, pos=None, mask=None, cos=None, sin=None, max_len=max_len, lens=cache.lens)
        pos = (cache.lens[:, None] + torch.arange(T)[None]).to(self.device, non_blocking=True)  # [B, T]
        blocks = _round_up(max_len, KEY_BLOCK)
        query_pos = pos[:, None, :, None, None]  # [B, 1, T, 1, 1]
        return StepPositions(
            rows=torch.arange(B, device=self.device)[:, None].expand(B, T),
            pos=pos,
            mask=torch.arange(blocks, device=self.device) > query_pos,  # [B, 1, T, 1, L]: True = hidden
            cos=self.cos[pos][:, :, None],  # [B, T, 1, D]
            sin=self.sin[pos][:, :, None],
            max_len=max_len,
            lens=cache.lens,
        )

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(tokens.to(self.device), self.embed)  # [B, T, hidden]
        return self.embed.rows(tokens.to(self.device))  # a quantized table (drafter.quant.OwnW8A8Weight)

    def run_layers(
        self,
        cache: KVCache,
        at: "StepPositions",
        x: torch.Tensor,  # [B, T, hidden]
        layers: range,
        capture: tuple[int, ...] = (),
        mlp_up_bias: list[torch.Tensor] | None = None,  # per layer [B, I] added to the up projection
        hidden: dict | None = None,
    ) -> torch.Tensor:
        """Layers `layers` over x, writing their KV at `at`; residual streams of `capture` go to hidden."""
        for i in layers:
            up_bias = None if mlp_up_bias is None else mlp_up_bias[i]
            x = self._layer(self.layers[i], x, cache.keys[i], cache.values[i], at, up_bias)
            if i in capture:
                hidden[i] = x
        return x

    def logits(self, x: torch.Tensor, norm: torch.Tensor | None = None, head=None, exact: bool = True):
        """Final RMSNorm and LM head (defaults: the model's own); `head` is a raw [V, hidden] tensor or a
        drafter.quant weight object."""
        x = self._norm(x, self.final_norm if norm is None else norm)
        return linear(x, self.lm_head if head is None else head, exact=exact)

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,  # [B, T] int64 (right-padded where rows have fewer new tokens)
        n_new: torch.Tensor | None = None,  # [B] host int64: real tokens per row; default T
        last_only: bool = False,
        capture: tuple[int, ...] = (),
        mlp_up_bias: list[torch.Tensor] | None = None,  # per layer [B, I] added to the up projection
    ) -> ForwardOut:
        """Append `tokens` at each row's `lens`, attend causally, advance `lens` by `n_new`."""
        B, T = tokens.shape
        n_new = torch.full((B,), T, dtype=torch.long) if n_new is None else n_new
        at = self.positions(cache, T)
        hidden: dict[int, torch.Tensor] = {}
        x = self.run_layers(cache, at, self.embed_tokens(tokens), range(self.num_layers), capture, mlp_up_bias, hidden)
        if last_only:
            x = last_valid(x, n_new)
        cache.lens = cache.lens + n_new
        logits = self.logits(x, exact=x.shape[1] <= QUERY_CHUNK)
        if self.vocab_ids is not None:
            logits = expand(logits, self.vocab_ids, self.vocab_size)
        return ForwardOut(logits=logits, hidden=hidden)

    def _layer(self, w: _Layer, x, kc, vc, at: "StepPositions", up_bias):
        if self.fused and up_bias is None and x.dtype == torch.float32:
            args = self._layer_args(w)
            if args is not None:  # the whole layer in one compiled call: the same functions, the same bits
                return kernels.layer(x, w.in_norm, w.post_norm, self.eps, *args, kc, vc, *self._rope32, at.lens,
                                     self.n_heads, self.scaling)
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        h = self._norm(x, w.in_norm)
        exact = T <= QUERY_CHUNK  # decode-shaped: rows independent of each other (drafter.quant.row_blocked)
        qkv = linear(h, w.qkv, w.qkv_bias, exact)
        if w.q_norm is not None:
            qkv = self._qk_norm(w, qkv)
        if self.fused:
            att = kernels.attend(qkv, kc, vc, *self._rope32, at.lens, H, self.scaling).to(x.dtype)
        else:
            att = self._attention_reference(qkv, kc, vc, at)
        x = x + linear(att, w.o, exact=exact)
        h = self._norm(x, w.post_norm)
        gate_up = linear(h, w.gate_up, exact=exact)
        if up_bias is not None:  # SD² steering: a per-row bias on the up half
            gate, up = gate_up.chunk(2, dim=-1)
            gate_up = torch.cat([gate, up + up_bias[:, None]], dim=-1)
        return x + linear(self._swiglu(gate_up), w.down, exact=exact)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels.rms_norm(x, weight, self.eps)
        return F.rms_norm(x, (self.hidden_size,), weight, self.eps)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _layer_args(self, w: _Layer):
        """(kinds, widths, packed tensors) of the layer's four linears for `kernels.layer`, or None where
        one of them is not one of specloop's kernel weights (or has a bias, or the layer per-head
        norms). Cached on the layer, keyed by the weight objects (quantize_decoder replaces them)."""
        linears = (w.qkv, w.o, w.gate_up, w.down)
        key = tuple(map(id, linears))
        cached = getattr(w, "_fused_args", None)
        if cached is None or cached[0] != key:
            cached = (key, _fused_linears(linears) if w.q_norm is None and w.qkv_bias is None else None)
            w._fused_args = cached
        return cached[1]

    def _qk_norm(self, w: _Layer, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3-style per-head RMSNorm of queries and keys, values untouched."""
        B, T, _ = qkv.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
        q = F.rms_norm(q.view(B, T, H, D), (D,), w.q_norm, self.eps)
        k = F.rms_norm(k.view(B, T, Hkv, D), (D,), w.k_norm, self.eps)
        return torch.cat([q.reshape(B, T, H * D), k.reshape(B, T, Hkv * D), v], dim=-1)

    def _attention_reference(self, qkv: torch.Tensor, kc, vc, at: "StepPositions") -> torch.Tensor:
        """Eager RoPE, cache write and `exact_attention`: [B, T, (H + 2 H_kv) D] → [B, T, H D]."""
        B, T, _ = qkv.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        qk, v = qkv.split(((H + Hkv) * D, Hkv * D), dim=-1)
        q, k = _rope(qk.view(B, T, H + Hkv, D), at.cos, at.sin).split((H, Hkv), dim=2)  # one pass for both
        kc[at.rows, :, at.pos] = k.to(KV_DTYPE)  # [B, T, Hkv, D] into [B, Hkv, capacity, D]
        vc[at.rows, :, at.pos] = v.view(B, T, Hkv, D).to(KV_DTYPE)
        return exact_attention(q, kc, vc, at.mask, self.scaling).reshape(B, T, H * D)


# Keys are attended in whole blocks of this many positions (the KV cache's capacity is a multiple).
KEY_BLOCK = 64
# The KV cache and attention are fp32 in every weight mode (bf16 keys and values are upcast exactly):
# fp32 batched products cost a third of bf16 ones at decode shapes here, and no per-step conversion.
KV_DTYPE = torch.float32
# Queries are attended at most this many tokens per call (longer passes, i.e. prefills, go in chunks).
QUERY_CHUNK = 16


def _fused_linears(linears) -> tuple | None:
    from drafter.quant import OwnInt4Weight, OwnInt8Weight, OwnW4A8Weight

    kinds, dims, parts = [], [], []
    for lin in linears:
        kind = {OwnInt4Weight: 0, OwnInt8Weight: 1, OwnW4A8Weight: 2}.get(type(lin))
        if kind is None or lin.bias is not None or lin.act_dtype != torch.float32:
            return None
        kinds.append(kind)
        dims.append(lin.out_features)
        parts += [lin.q, lin.scales, lin.scales] if kind == 1 else [lin.nibbles, lin.d, lin.m]
    return kinds, dims, parts


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def exact_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, hidden: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of q [B, T, H, D] over the cache (kc/vc [B, H_kv, capacity, D]) → [B, T, H, D],
    computed so that a query's output does not depend on T, on the batch, or on how many whole key
    blocks are attended: a verify pass of k+1 tokens scores every token bit for bit as the one-token
    step at its position does, and rows of different lengths share a batch exactly.

    How (the reduction structure is fixed by construction, not by the call's shape):
    - a pass of T tokens makes, for every token, the very products a one-token step makes (same
      shapes, same batch of rows and KV heads), one token after another: a BLAS may round a product
      by its shape (on AMD EPYC, one product with 5+ query columns rounds otherwise than one with 3),
      so no token's product is ever widened by another's;
    - scores are [rep, D] @ [D, L] per (row, KV head): the token's head group as rows, the keys as
      columns, each score a dot product over D alone;
    - keys are taken in whole blocks of KEY_BLOCK; positions a query may not see (`hidden`
      [B, 1, T, 1, L]: the causal tail and the stale rest of the last block) score -inf, so their
      probabilities are exactly 0 and appended blocks add exact zeros to every sum; the softmax runs
      over the keys in fp32 (a max is exact in any order; a sum over appended zeros is unchanged);
    - values are summed per key block (probs[rep, KEY_BLOCK] @ values[KEY_BLOCK, D] in fp32, one
      fixed inner length), and the blocks' sums are added in a fixed pairwise tree over a
      power-of-two count: zero blocks appended at the end leave every addition as it was (one product
      over all L keys is not enough: the BLAS splits a long reduction by its length);
    - queries go in chunks of at most QUERY_CHUNK tokens, which bounds a long prefill's temporaries.
    tests/test_decoder.py checks the bit-identity on the CPU that runs the suite (T 1..9, batches
    1/3/8, ragged rows, long prefills, every weight mode): that a product's result depends on its
    shape and operands alone, whatever the number of key columns, is a property of the machine's
    BLAS, which that test keeps honest.
    """
    T = q.shape[1]
    if T <= QUERY_CHUNK:
        return _attend(q, kc, vc, hidden, scale)
    return torch.cat([_attend(q[:, a : a + QUERY_CHUNK], kc, vc, hidden[:, :, a : a + QUERY_CHUNK], scale)
                      for a in range(0, T, QUERY_CHUNK)], dim=1)


def _attend(q, kc, vc, hidden, scale):
    B, T, H, D = q.shape
    Hkv, L = kc.shape[1], hidden.shape[-1]
    rep, n = H // Hkv, L // KEY_BLOCK
    keys = kc[:, :, :L].reshape(B * Hkv, L, D).transpose(1, 2)  # [B Hkv, D, L], a view
    queries = q.view(B, T, Hkv, rep, D).transpose(1, 2).reshape(B * Hkv, T, rep, D).to(kc.dtype)
    scores = torch.stack([torch.bmm(queries[:, t], keys) for t in range(T)], 1)  # [B Hkv, T, rep, L]
    scores = scores.view(B, Hkv, T, rep, L).mul_(scale).masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B * Hkv, T, rep, n, KEY_BLOCK).transpose(2, 3)
    values = vc[:, :, :L].reshape(B * Hkv * n, KEY_BLOCK, D)  # [B Hkv n, blk, D]
    parts = torch.stack([torch.bmm(probs[:, t].reshape(B * Hkv * n, rep, KEY_BLOCK), values).view(B * Hkv, n, rep, D)
                         for t in range(T)], 1)  # [B Hkv, T, n, rep, D]
    out = _sum_over_key_blocks(parts)  # [B Hkv, T, rep, D]
    return out.to(q.dtype).view(B, Hkv, T, rep, D).transpose(1, 2).reshape(B, T, H, D)


def _sum_over_key_blocks(parts: torch.Tensor) -> torch.Tensor:
    """Σ over dim 2 of parts [..., T, n, rep, D] (one value sum per key block) in a fixed pairwise tree
    over the n blocks padded with zeros to a power of two → [..., T, rep, D]."""
    n = parts.shape[2]
    width = 1 << (n - 1).bit_length()
    if width > n:
        pad = list(parts.shape)
        pad[2] = width - n
        parts = torch.cat([parts, parts.new_zeros(pad)], dim=2)
    while parts.shape[2] > 1:
        parts = parts[:, :, 0::2] + parts[:, :, 1::2]
    return parts[:, :, 0]


@dataclass
class StepPositions:
    """Where a step's new tokens go. The eager attention's fields (rows .. sin) are None where
    drafter.kernels.attend runs, which needs `lens` alone."""
    rows: torch.Tensor | None  # [B, T] row index of every new token
    pos: torch.Tensor | None  # [B, T] absolute position of every new token
    mask: torch.Tensor | None  # [B, 1, T, 1, L] True where a key is hidden from the query (L: whole key blocks)
    cos: torch.Tensor | None  # [B, T, 1, D]
    sin: torch.Tensor | None
    max_len: int  # L: keys attended this step
    lens: torch.Tensor  # [B] host int64: valid positions per row before the step (new tokens go from here)


def pad_right(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists → ([B, T] int64 right-padded, [B] lengths)."""
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = max(1, int(lens.max())) if rows else 1
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out, lens


def prefill(lean: LeanDecoder, prompts: list[list[int]], capacity: int, capture: tuple[int, ...] = ()):
    """A new cache holding every prompt token but the last (which is the first block's input).

    Prompts are prefilled one at a time (each row's own pass, into its row of the cache): a long pass
    takes plain GEMMs whose rounding depends on their row count, so a prompt's KV must not depend on
    which other prompts joined with it (continuous batching stays exact).

    Returns (cache, features): features maps each captured layer to [B, hidden], the residual
    stream at the position whose output predicts the last prompt token (zeros for 1-token prompts).
    """
    cache = lean.new_cache(len(prompts), capacity)
    features = {i: torch.zeros(len(prompts), lean.hidden_size, device=lean.device, dtype=lean.dtype) for i in capture}
    first: dict[tuple[int, ...], int] = {}  # identical prompts (n > 1, repeated requests) are computed once
    for b, prompt in enumerate(prompts):
        if len(prompt) < 2:
            continue
        src = first.setdefault(tuple(prompt), b)
        if src != b:
            for layer in cache.keys + cache.values:
                layer[b] = layer[src]
            cache.lens[b] = cache.lens[src]
            for i in capture:
                features[i][b] = features[i][src]
            continue
        row = KVCache([k[b : b + 1] for k in cache.keys], [v[b : b + 1] for v in cache.values], cache.lens[b : b + 1])
        out = lean.forward(row, torch.tensor([prompt[:-1]]), last_only=True, capture=capture)
        cache.lens[b] = row.lens[0]
        for i in capture:
            features[i][b] = out.hidden[i][0, -1]
    return cache, features


def prefill_rows(lean: LeanDecoder, cache: KVCache, slots: list[int], prompts: list[list[int]],
                 capture: tuple[int, ...] = ()) -> dict[int, torch.Tensor]:
    """`prefill` into rows `slots` of an existing cache (continuous batching: requests join a running
    batch); the other rows are untouched. Returns the captured features, [len(slots), hidden] each."""
    width = max(len(p) for p in prompts)
    fresh, features = prefill(lean, prompts, width, capture)
    idx = torch.tensor(slots, dtype=torch.long)
    dev = idx.to(lean.device)
    for dst, src in zip(cache.keys + cache.values, fresh.keys + fresh.values):
        dst[dev, :, :width] = src[:, :, :width]
    cache.lens[idx] = fresh.lens
    return features


def last_valid(x: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
    """[B, T, H] → [B, 1, H] at each row's last real (non-padding) position."""
    idx = (n_new - 1).clamp(min=0).to(x.device)
    return x[torch.arange(x.shape[0], device=x.device), idx][:, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half convention (x: [B, T, H, D], cos/sin: [B, T, 1, D])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
