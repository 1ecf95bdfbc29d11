"""What the lean decoder reads from a model besides running it: whether the checkpoint is a SwiGLU
decoder it reproduces exactly (`check_config`, `UnsupportedModel`), its shapes (`Architecture`), a
layer's fused inference weights (`fuse_layer`) and its rotary embedding without the module
(`StaticRope`). specloop.drafter.model.decoder re-exports every name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

SUPPORTED_ACT = {"silu", "swish"}


class UnsupportedModel(ValueError):
    """The checkpoint is not a SwiGLU decoder this forward pass reproduces exactly."""


@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 H_kv) D, hidden] (the linears: raw tensors, or weights.quant weight objects)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3-style per-head RMSNorm weights [D]
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor
    # (ids of the four linears, specloop.drafter.model.kernels.layer's arguments or None, the linears themselves):
    # LeanDecoder._layer_args
    _fused_args: tuple[tuple[int, ...], tuple | None, tuple] | None = field(default=None, init=False, repr=False,
                                                                             compare=False)
    # assignments to any layer's weights or norms, all layers counted together: what LeanDecoder._stack keys on (a
    # step reading its 30 layers' 180 objects for their ids cost ~45 µs on two cores, every one a cache miss after the
    # layers' weights streamed through)
    writes: ClassVar[int] = 0

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "_fused_args":
            _Layer.writes += 1
        object.__setattr__(self, name, value)


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

    config: Any  # the transformers config
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

