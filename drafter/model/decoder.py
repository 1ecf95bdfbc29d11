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

Where the parts live (every name importable from here): specloop.drafter.model.architecture (what is read from a
model: support checks, shapes, fused layer weights, RoPE), specloop.drafter.model.kv_cache (the cache, prefills),
specloop.drafter.model.attention (the reference attention path and the cache layout's constants).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specloop.drafter.model import kernels
from specloop.drafter.model.architecture import Architecture, _Layer, _tensor, check_config, fuse_layer
from specloop.drafter.model.attention import (
    CPU_KV_DTYPES,
    KEY_BLOCK,
    QUERY_CHUNK,
    StepPositions,
    _rope,
    _round_up,
    exact_attention,
    kv_dtype,
)
from specloop.drafter.model.kv_cache import KVCache, untouched_zeros
from specloop.drafter.model.vocab import expand
from specloop.drafter.model.weights.linears import linear


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, T, V] (or [B, 1, V] when only the last valid position was asked for)
    hidden: dict[int, torch.Tensor]  # layer index -> [B, T, hidden] (residual stream after that layer)
    choices: torch.Tensor | None = None  # [B, T] the logits' argmax where the pass computed it (the graph step, the
    #                                      CPU's w8a8 LM head)


@contextmanager
def one_thread():
    """torch's CPU ops on one thread inside, the caller's count restored after (a device's ops are not affected)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
        would own them: specloop.drafter.model.loading streams a checkpoint into it tensor by tensor.

        `embed`, `final_norm`, `lm_head` as `__init__` takes them from a module (`lm_head` may already
        be a weights.quant weight object); `layers`: `fuse_layer` results (an empty list may be filled
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
        self.dtype = self.embed.dtype  # activations, KV cache, RoPE tables (weights.quant may change it)
        self.quant = None  # specloop.drafter.model.weights.quant.QuantSpec once quantize_decoder prepared the linears
        self.vocab_ids: torch.Tensor | None = None  # FR-Spec draft vocabulary: the LM head holds these rows only
        n = max_positions or int(getattr(self.config, "max_position_embeddings", 4096))
        self.cos, self.sin = self._rope_tables(rotary, n)
        # specloop.drafter.model.kernels (RMSNorm, SwiGLU, and RoPE + cache write + attention in one call per layer) on
        # the CPU where they build; else, and with SPECLOOP_KERNELS=stock, torch's ops and
        # exact_attention: the reference path
        widths = (self.hidden_size, int(self.config.intermediate_size))
        self.fused = (self.device.type == "cpu" and self.head_dim in (32, 64, 128, 256) and kernels.available()
                      and all(w % 16 == 0 for w in widths) and kv_dtype(self.device, self.dtype) in CPU_KV_DTYPES)
        self._rope32 = (self.cos.float().contiguous(), self.sin.float().contiguous()) if self.fused else None

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Score only the vocabulary rows `ids` (sorted; specloop.drafter.model.vocab): forward's logits are still
        [.., vocab_size], -inf outside them. Before quantizing: the smaller head is what gets packed."""
        if self.quant is not None or self.vocab_ids is not None:
            raise ValueError("restrict the vocabulary once, before quantize_decoder")
        self.lm_head = self.lm_head[ids.to(self.lm_head.device)]
        self.vocab_ids = ids.to(self.device)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype (specloop.drafter.model.attention.kv_dtype): on the CPU fp32 unless bf16 is asked."""
        return kv_dtype(self.device, self.dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def rows_alike(self) -> bool:
        """Whether every position's result is computed alike whatever pass computes it (its width, where it starts,
        the batch beside it): each layer runs specloop's own CPU kernels end to end (`_layer_args`: quantized
        weights whose every row goes through the same instructions whatever the row count; RoPE and attention one
        query alone over its keys; norms row by row). Then a prompt's KV is the same bits however its prefill is
        cut, and the KV a decode step writes is the bits a prefill of the same tokens writes
        (specloop.drafter.decode.prefix_cache relies on it). Not so for float weights (the BLAS rounds a row by the
        product's shape) nor on a GPU."""
        return self.fused and self.dtype == torch.float32 and all(self._layer_args(w) is not None for w in self.layers)

    def _fuse(self, layer) -> _Layer:
        return fuse_layer(lambda name: _tensor(layer, name))

    def _rope_tables(self, rotary, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [0, n) from the model's own rotary module (any rope type it knows), torch's CPU
        ops on one thread: the first parallel cos of a process (these tables are often it) gave other bits in about one
        process in five (2 threads, torch 2.13, a Xeon with AMX; the same call again in that process, or on one
        thread, gave the usual ones), and every key, logit and sampled token after them changed with it."""
        pos = torch.arange(n, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        with torch.no_grad(), one_thread():
            cos, sin = rotary(probe, pos)
        return cos[0].to(self.dtype), sin[0].to(self.dtype)  # [n, D]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        if capacity > _round_up(self.cos.shape[0], KEY_BLOCK):  # positions() guards the table's own end
            raise ValueError(f"sequence of {capacity} positions exceeds the model's {self.cos.shape[0]}")
        shape = (batch, self.n_kv, _round_up(capacity, KEY_BLOCK), self.head_dim)  # whole key blocks
        dtype = self.kv_dtype
        mk = lambda: untouched_zeros(shape, dtype, self.device)  # noqa: E731
        return KVCache(
            keys=[mk() for _ in self.layers],
            values=[mk() for _ in self.layers],
            lens=torch.zeros(batch, dtype=torch.long),
        )

    def positions(self, cache: KVCache, T: int, wide: bool = False) -> "StepPositions":
        """Where T new tokens per row go: row b writes positions lens[b] .. lens[b] + T - 1. Keys are
        attended in whole blocks of KEY_BLOCK (`exact_attention`), the tail masked; `wide`: all queries in one
        product where the decoder is on a GPU (a prefill: `attend_wide`)."""
        B = cache.lens.shape[0]
        max_len = max(cache.lens.tolist()) + T  # one read (max, then its item: two ops, each cold after the layers)
        if max_len > min(cache.capacity, self.cos.shape[0]):
            raise ValueError(f"KV cache of {min(cache.capacity, self.cos.shape[0])} positions is full")
        if self.fused:  # specloop.drafter.model.kernels.attend needs only where each row starts
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
            wide=wide and self.device.type == "cuda",
        )

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(tokens.to(self.device), self.embed)  # [B, T, hidden]
        return self.embed.rows(tokens.to(self.device))  # a quantized table (weights.quant.OwnW8A8Weight)

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
        stack = self._stack() if mlp_up_bias is None and x.dtype == torch.float32 and layers.step == 1 else None
        if stack is not None:  # runs of layers in one call each, a run ending at each captured layer
            start = layers.start
            for i in layers:
                if i in capture or i == layers[-1]:
                    x = stack.forward(x, cache.keys[start : i + 1], cache.values[start : i + 1], at.lens, start)
                    if i in capture:
                        assert hidden is not None
                        hidden[i] = x
                    start = i + 1
            return x
        for i in layers:
            up_bias = None if mlp_up_bias is None else mlp_up_bias[i]
            x = self._layer(self.layers[i], x, cache.keys[i], cache.values[i], at, up_bias)
            if i in capture:
                assert hidden is not None  # a caller that captures layers passes the dict to fill
                hidden[i] = x
        return x

    def logits(self, x: torch.Tensor, norm: torch.Tensor | None = None, head=None, exact: bool = True):
        """Final RMSNorm and LM head (defaults: the model's own); `head` is a raw [V, hidden] tensor or a
        specloop.drafter.model.weights.quant weight object."""
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
        prefill: bool = False,  # a prompt's prefill: on a GPU its attention is one product (`attend_wide`)
        choose: bool = False,  # the caller reads the logits' argmax: `choices` where the LM head finds it in its call
    ) -> ForwardOut:
        """Append `tokens` at each row's `lens`, attend causally, advance `lens` by `n_new`."""
        B, T = tokens.shape
        at = self.positions(cache, T, wide=prefill)
        advanced = cache.lens + (T if n_new is None else n_new)  # before the layers: an op after them runs cold
        hidden: dict[int, torch.Tensor] = {}
        x = self.run_layers(cache, at, self.embed_tokens(tokens), range(self.num_layers), capture, mlp_up_bias, hidden)
        if last_only:
            x = last_valid(x, torch.full((B,), T, dtype=torch.long) if n_new is None else n_new)
        cache.lens = advanced
        logits, choices = self._logits_and_choices(x, exact=x.shape[1] <= QUERY_CHUNK, choose=choose)
        if self.vocab_ids is not None:
            logits = expand(logits, self.vocab_ids, self.vocab_size)
        return ForwardOut(logits=logits, hidden=hidden, choices=choices)

    def _logits_and_choices(self, x: torch.Tensor, exact: bool,
                            choose: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`logits`, and (`choose`) each position's argmax [B, T] where the LM head finds it in the same call
        (specloop's w8a8 head, `OwnW8A8Weight.choose`: while each thread's logits are in its cache; reading 49,152 of
        them back for numpy's argmax cost a greedy step ~160 µs on two cores, bench/README.md section 57); else
        None."""
        head = getattr(self.lm_head, "choose", None) if choose and self.vocab_ids is None else None
        if head is None:
            return self.logits(x, exact=exact), None
        return head(self._norm(x, self.final_norm))

    def _layer(self, w: _Layer, x, kc, vc, at: "StepPositions", up_bias):
        if self.fused and up_bias is None and x.dtype == torch.float32:
            args = self._layer_args(w)
            if args is not None:  # the whole layer in one compiled call: the same functions, the same bits
                assert self._rope32 is not None  # set whenever self.fused
                return kernels.layer(x, w.in_norm, w.post_norm, self.eps, *args, kc, vc, *self._rope32, at.lens,
                                     self.n_heads, self.scaling)
        B, T, _ = x.shape
        H = self.n_heads
        h = self._norm(x, w.in_norm)
        exact = T <= QUERY_CHUNK  # decode-shaped: rows independent of each other (weights.quant.row_blocked)
        qkv = linear(h, w.qkv, w.qkv_bias, exact)
        if w.q_norm is not None:
            qkv = self._qk_norm(w, qkv)
        if self.fused:
            assert self._rope32 is not None  # set whenever self.fused
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

    def _stack(self):
        """Every layer's `kernels.layer` arguments held by one compiled object (`kernels.LayerStack`), where each
        layer takes the fused call, else None: a run of layers is then one call (the same functions, the same
        bits) instead of one a layer from Python. Rebuilt when any layer's field is assigned (`_Layer.writes`) or
        the layer list changes (its identity and length; the cache holds the list, so that no id is reused while
        it is kept)."""
        if not self.fused:
            return None
        key = (_Layer.writes, id(self.layers), len(self.layers))
        cached = getattr(self, "_stack_cached", None)
        if cached is None or cached[0] != key:
            args = [self._layer_args(w) for w in self.layers]
            stack = None
            if all(a is not None for a in args):
                assert self._rope32 is not None  # set whenever self.fused
                stack = kernels.layer_stack([w.in_norm for w in self.layers], [w.post_norm for w in self.layers],
                                            args, *self._rope32, self.eps, self.n_heads, self.scaling)
            cached = self._stack_cached = (key, stack, self.layers)
        return cached[1]

    def _layer_args(self, w: _Layer):
        """(kinds, widths, packed tensors) of the layer's four linears for `kernels.layer`, or None where
        one of them is not one of specloop's kernel weights (or has a bias, or the layer per-head
        norms). Cached on the layer, keyed by the weight objects (quantize_decoder replaces them; the cache holds
        them, so that no id is reused while it is kept)."""
        from specloop.drafter.model.weights.own_linears import kernel_linears

        linears = (w.qkv, w.o, w.gate_up, w.down)
        key = tuple(map(id, linears))
        cached = getattr(w, "_fused_args", None)
        if cached is None or cached[0] != key:
            cached = (key, kernel_linears(linears) if w.q_norm is None and w.qkv_bias is None else None, linears)
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
        # positions() fills the eager fields wherever the fused kernels do not run
        assert at.cos is not None and at.sin is not None and at.mask is not None
        q, k = _rope(qk.view(B, T, H + Hkv, D), at.cos, at.sin).split((H, Hkv), dim=2)  # one pass for both
        kc[at.rows, :, at.pos] = k.to(kc.dtype)  # [B, T, Hkv, D] into [B, Hkv, capacity, D]
        vc[at.rows, :, at.pos] = v.view(B, T, Hkv, D).to(vc.dtype)
        return exact_attention(q, kc, vc, at.mask, self.scaling, wide=at.wide).reshape(B, T, H * D)


def last_valid(x: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
    """[B, T, H] → [B, 1, H] at each row's last real (non-padding) position."""
    idx = (n_new - 1).clamp(min=0).to(x.device)
    return x[torch.arange(x.shape[0], device=x.device), idx][:, None]
