"""Weight-only quantization of a LeanDecoder for CPU decoding, chosen at run time.

A linear "weight" is either a raw tensor (`F.linear`, the unquantized path) or one of the objects
below; `linear(x, w, bias)` calls either. Every object maps `x [..., K]` to `[..., N]` in the
activation dtype and holds its own bias:

- `Dense`: a float weight (fp32 or bf16), `F.linear`.
- `Int8Weight`: per-output-channel symmetric int8, `torch._weight_int8pack_mm`.
- `Int4Weight`: group-wise asymmetric int4 (groups of 32/64/128 along K), tinygemm's CPU packing,
  `torch._weight_int4pack_mm_for_cpu`.

Modes (`DTYPE_MODES`): "fp32" (raw fp32 tensors: today's path, unchanged), "bf16" (bf16 weights and
activations), "int8" and "int4" (quantized weights; activations in bf16 or fp32, whichever that
kernel runs faster on this machine: `activation_dtype`). The embedding, norms, RoPE tables and KV
cache follow the activation dtype, so one decoder runs in one dtype end to end.

Losslessness is unaffected: speculative decoding reproduces whatever verifier it is given, and a
quantized verifier is simply a different (smaller, faster) verifier. Greedy equality with the
verifier alone needs the verify pass (T = k+1) to score a token as a one-token decode does: the int
kernels compute every row independently of the others (bit for bit); bf16 attention and GEMMs, like
fp32 `F.linear` (M=1 takes a GEMV path), agree only to rounding, so ties within rounding may break
either way, exactly as in fp32.

Measurements and the choice of default: `default_mode`. The int kernels' fp32-activation paths are
10-50x slower than their bf16 ones on the development CPU, hence bf16 activations there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPE_MODES = ("fp32", "bf16", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
_INT4_N_MULTIPLE = 16  # the CPU int4 packing needs N % 16 == 0: pad with zero rows


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ wᵀ (+ bias) for a raw weight tensor or a weight object (which holds its own bias)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w(x)


class Dense:
    """A float weight [N, K] (fp32 or bf16) and optional bias; inputs are cast to its dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        dtype = dtype or weight.dtype
        self.weight = weight.detach().to(dtype).contiguous()
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.act_dtype = dtype
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        return F.linear(x, self.weight, self.bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()


class Int8Weight:
    """Per-output-channel symmetric int8: w ≈ q · scale[n], q ∈ [-127, 127]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype = torch.bfloat16):
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.q = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(act_dtype)
        self.bias = None if bias is None else bias.detach().to(act_dtype)
        self.act_dtype = act_dtype
        self.out_features, self.in_features = self.q.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.q, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]


class Int4Weight:
    """Group-wise asymmetric int4 along K: w ≈ (q − 8) · scale + zero per group of `group_size`
    inputs, q ∈ [0, 15] (zero = min + 8 · scale, the tinygemm convention). N is padded with zero rows
    to a multiple of 16 (the CPU packing's need) and the output sliced back."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype = torch.bfloat16,
                 group_size: int = DEFAULT_GROUP_SIZE):
        N, K = weight.shape
        if group_size not in INT4_GROUP_SIZES or K % group_size:
            raise ValueError(f"int4 group size {group_size} must be one of {INT4_GROUP_SIZES} and divide K={K}")
        w = weight.detach().float()
        pad = -N % _INT4_N_MULTIPLE
        if pad:
            w = torch.cat([w, w.new_zeros(pad, K)])
        groups = w.reshape(-1, group_size)
        lo, hi = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
        scales = (hi - lo).clamp(min=1e-6) / 15.0
        zeros = lo + 8.0 * scales
        q = (groups - lo).div_(scales).round_().clamp_(0, 15).to(torch.int32).reshape(w.shape)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        n_pad = w.shape[0]
        sz = torch.stack([scales.view(n_pad, -1), zeros.view(n_pad, -1)], dim=2)  # [N, K/g, 2]
        self.scales_zeros = sz.transpose(0, 1).contiguous().to(act_dtype)  # [K/g, N, 2]
        self.bias = None if bias is None else bias.detach().to(act_dtype)
        self.act_dtype = act_dtype
        self.group_size = group_size
        self.out_features, self.in_features = N, K
        self._padded = bool(pad)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.packed, self.group_size,
                                              self.scales_zeros)
        if self._padded:
            y = y[:, : self.out_features]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [N, K] fp32 (for tests and error reports)."""
        eye = torch.eye(self.in_features, dtype=self.act_dtype)
        y = torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_zeros)
        return y[:, : self.out_features].float().t().contiguous()


@dataclass(frozen=True)
class QuantSpec:
    """How a decoder's linears were prepared (kept on the decoder as `lean.quant`)."""

    mode: str
    act_dtype: torch.dtype
    group_size: int = DEFAULT_GROUP_SIZE


def check_mode(mode: str) -> str:
    if mode not in DTYPE_MODES:
        raise ValueError(f"unknown weight dtype mode {mode!r}; choose one of {', '.join(DTYPE_MODES)}")
    return mode


def quantize_weight(weight: torch.Tensor, spec: QuantSpec, bias: torch.Tensor | None = None):
    """One linear weight [N, K] prepared for `spec`: a raw tensor in fp32 mode, else a weight object.
    int4 layers whose K no allowed group size divides fall back to int8 (never silently to float)."""
    if spec.mode == "fp32":
        return weight.to(spec.act_dtype)  # raw: the unquantized path (bias stays with the caller)
    if spec.mode == "bf16":
        return Dense(weight, bias, spec.act_dtype)
    if spec.mode == "int4":
        K = weight.shape[1]
        sizes = [g for g in INT4_GROUP_SIZES if g <= spec.group_size and K % g == 0]
        if sizes:
            return Int4Weight(weight, bias, spec.act_dtype, max(sizes))
    return Int8Weight(weight, bias, spec.act_dtype)


def quantize_like(lean, weight: torch.Tensor):
    """`weight` (e.g. a DVI head's merged LM head) prepared as `lean`'s own linears are; a raw tensor
    in the decoder's dtype when it was never quantized."""
    spec = getattr(lean, "quant", None)
    weight = weight.to(lean.device)
    return weight.to(lean.dtype) if spec is None else quantize_weight(weight, spec)


def quantize_decoder(lean, mode: str, group_size: int = DEFAULT_GROUP_SIZE, act_dtype: torch.dtype | None = None):
    """Convert `lean` in place to `mode`: every layer's linears and whatever `lean.lm_head` holds now
    (a truncated draft vocabulary's rows included); the embedding, norms, RoPE tables and the KV caches
    it makes from now on move to the activation dtype. Returns `lean`.

    `act_dtype` overrides the run-time choice (`activation_dtype`). Caches made before the call are in
    the old dtype: make new ones. Drafters that read `lean.dtype` (SD² steering) must be built after.
    """
    check_mode(mode)
    if getattr(lean, "quant", None) is not None:
        raise ValueError(f"decoder is already prepared as {lean.quant.mode!r}; build a new LeanDecoder to change it")
    if mode in ("int8", "int4") and lean.device.type != "cpu":
        raise ValueError(f"weight dtype mode {mode!r} uses CPU kernels; on {lean.device.type} use fp32 or bf16")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size {group_size} is not one of {INT4_GROUP_SIZES}")
    spec = QuantSpec(mode, act_dtype or activation_dtype(mode), group_size)
    act = spec.act_dtype
    for layer in lean.layers:
        layer.qkv = quantize_weight(layer.qkv, spec, layer.qkv_bias)
        if mode == "fp32":
            layer.qkv_bias = None if layer.qkv_bias is None else layer.qkv_bias.to(act)
        else:
            layer.qkv_bias = None  # held by the weight object
        layer.o = quantize_weight(layer.o, spec)
        layer.gate_up = quantize_weight(layer.gate_up, spec)
        layer.down = quantize_weight(layer.down, spec)
        layer.in_norm, layer.post_norm = layer.in_norm.to(act), layer.post_norm.to(act)
        layer.q_norm = None if layer.q_norm is None else layer.q_norm.to(act)
        layer.k_norm = None if layer.k_norm is None else layer.k_norm.to(act)
    lean.lm_head = quantize_weight(lean.lm_head, spec)
    lean.embed = lean.embed.to(act)
    lean.final_norm = lean.final_norm.to(act)
    lean.cos, lean.sin = lean.cos.to(act), lean.sin.to(act)
    lean.dtype = act
    lean.quant = spec
    return lean


# ---------------------------------------------------------------- what this CPU runs fastest


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> bool:
    """Whether the CPU has bf16 arithmetic in hardware (AVX512_BF16 or AMX-BF16).

    `torch.backends.cpu.get_cpu_capability()` says only "AVX512" on such a CPU (it does not name
    the bf16 extension), and `torch.ops.mkldnn._is_mkldnn_bf16_supported()` is true on any AVX-512
    core CPU, so the flags are read directly; the capability string is the fallback."""
    flags = cpu_flags()
    if flags:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    capability = torch.backends.cpu.get_cpu_capability()
    return "BF16" in capability or "AMX" in capability


def activation_dtype(mode: str) -> torch.dtype:
    """The activation dtype for `mode`: fp32 → fp32, bf16 → bf16; int8 / int4 → bf16 where the CPU has
    native bf16, else fp32. Fixed by the CPU, never timed: two processes serving one model must run
    the same verifier. (Measured on the development CPU: with bf16 activations these kernels run
    10-50x faster than with fp32 ones, whose paths are not vectorized.)"""
    check_mode(mode)
    if mode in ("fp32", "bf16"):
        return torch.float32 if mode == "fp32" else torch.bfloat16
    return torch.bfloat16 if native_bf16() else torch.float32


def resolve_mode(mode: str | None, device: torch.device | str = "cpu", role: str = "verifier") -> str:
    """`mode` itself, or `default_mode` for "auto" / None."""
    return default_mode(device, role) if mode in (None, "auto") else check_mode(mode)


def default_mode(device: torch.device | str = "cpu", role: str = "verifier") -> str:
    """The sensible weight dtype mode here, for a `role` of "verifier" or "drafter".

    Measured on the development CPU (AMD EPYC, AVX-512 + avx512_bf16, no AMX; 1 thread; SmolLM2-135M
    shape with random weights, 128 tokens of context; ms per forward, T=1 decode / T=5 verify pass):
    fp32 42 / 80, bf16 33 / 29, int8 16 / 21, int4 12 / 19. Decoding a small model is bound by
    reading weights; int8 reads 4x and int4 ~7x fewer bytes than fp32. On the trained reference
    verifier (6 layers, d=256) greedy argmax agreed with fp32 at 99.1% (bf16), 98.6% (int8) and
    95.0% (int4) of positions.

    - CUDA: "fp32" for a verifier (bf16 verify passes are not token-identical to one-token steps there), "bf16" for a drafter (the int kernels here are CPU ones).
    - CPU with native bf16 (avx512_bf16 / AMX-BF16): "int8" for a verifier: 2.6x (T=1) to 3.8x (T=5)
      faster than fp32 at near-fp32 output (the verifier defines the output; speculation reproduces
      whatever verifier it is given, so its quality is the product's). "int4" for a drafter: the
      fastest, and a drafter's precision costs only acceptance, never output.
    - CPU without native bf16: "fp32". The int kernels are fast only with bf16 activations, and
      bf16 element-wise work is emulated there.
    """
    if role not in ("verifier", "drafter"):
        raise ValueError(f"role must be 'verifier' or 'drafter', got {role!r}")
    device = torch.device(device)
    if device.type == "cuda":  # bf16 verify passes round differently from one-token steps there (2/16
        return "fp32" if role == "verifier" else "bf16"  # prompts diverged on an H100; fp32: 16/16)
    if not native_bf16():
        return "fp32"
    return "int8" if role == "verifier" else "int4"
