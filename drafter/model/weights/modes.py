"""Which weight mode a decoder is served in, chosen at run time, and how it is named.

`DTYPE_MODES`: "fp32", "bf16", "int8", "int4", "w4a8" (weights.quant describes each). `resolve_mode`
says what "auto" means for a verifier (as its checkpoint is stored, or the mode its own manifest.json
names) or a drafter (`default_mode`); `activation_dtype` the activation dtype of a mode on this CPU;
`describe_mode` the string printed wherever the model is named. `_kernels_for` says whether
specloop's own kernels (specloop.drafter.model.kernels) serve a mode here.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specloop.drafter.model import kernels

DTYPE_MODES = ("fp32", "bf16", "int8", "int4", "w4a8")
W4A8_NEEDS = "w4a8 (int4 weights, int8 activations) runs on specloop's own CPU kernels only (a C++ compiler)"
DEFAULT_GROUP_SIZE = 32


def _kernels_for(mode: str, group_size: int) -> str:
    """"own" where specloop.drafter.model.kernels serve this mode here (built for this CPU, self-checked; int8, or
    int4 in groups of 32), else "stock" (torch's kernels). SPECLOOP_KERNELS=stock forces the latter."""
    fits = mode in ("int8", "w4a8") or (mode == "int4" and group_size == 32)
    return "own" if fits and kernels.available() else "stock"



def check_mode(mode: str) -> str:
    if mode not in DTYPE_MODES:
        raise ValueError(f"unknown weight dtype mode {mode!r}; choose one of {', '.join(DTYPE_MODES)}")
    return mode


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
    """The activation dtype for `mode`: fp32 → fp32, bf16 → bf16; int8 / int4 → fp32 where specloop's
    own kernels serve them (specloop.drafter.model.kernels), else bf16 where the CPU has native bf16, else fp32.
    Fixed by the CPU, never timed: two processes serving one model must run the same verifier.
    (Measured on the development CPU: with bf16 activations torch's stock int kernels run 10-50x
    faster than with fp32 ones, whose paths are not vectorized.)"""
    check_mode(mode)
    if mode in ("fp32", "bf16"):
        return torch.float32 if mode == "fp32" else torch.bfloat16
    if mode == "w4a8":
        return torch.float32  # the products quantize their inputs themselves
    if _kernels_for(mode, DEFAULT_GROUP_SIZE) == "own":
        return torch.float32  # specloop's kernels multiply in fp32: bf16 activations would only add roundings
    return torch.bfloat16 if native_bf16() else torch.float32


VERIFIER_MANIFEST = "manifest.json"  # in a verifier directory: {"weights": MODE, ...} names its served mode
_STORED_MODES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp32"}  # fp16 is upcast exactly


def stored_mode(path: str | Path | None) -> str:
    """The weight mode a Hugging Face directory is stored in (config.json `dtype` / `torch_dtype`):
    fp32 or bf16; fp16 checkpoints serve as fp32 (an exact upcast); fp32 when it says nothing."""
    config = {} if path is None else _read_json(Path(path) / "config.json")
    return _STORED_MODES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), "fp32")


def manifest_mode(path: str | Path | None) -> str | None:
    """The served mode a checkpoint's own manifest names (`specloop models fetch` writes "int4" for
    a model published as a 4-bit GGUF), or None."""
    mode = None if path is None else _read_json(Path(path) / VERIFIER_MANIFEST).get("weights")
    return None if mode is None else check_mode(mode)


def _read_json(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def resolve_mode(mode: str | None, device: torch.device | str = "cpu", role: str = "verifier",
                 path: str | Path | None = None) -> str:
    """`mode` itself, or what "auto" / None means for `role`:

    - a verifier is served as its checkpoint `path` is: the mode its manifest names, else the dtype it
      is stored in (fp32 / bf16). Never a quantized copy nobody asked for. A manifest's int8 / int4
      needs specloop's kernels built for this CPU (specloop.drafter.model.kernels) or native bf16 (torch's stock
      kernels are 10-50x slower with fp32 activations): elsewhere, and on CUDA, the stored dtype is
      served instead (`describe_mode` says so).
    - a drafter: `default_mode` (its precision costs acceptance only, never output).
    """
    if mode not in (None, "auto"):
        return check_mode(mode)
    if role == "drafter":
        return default_mode(device, role)
    wanted = manifest_mode(path)
    own = _kernels_for(wanted or "int8", DEFAULT_GROUP_SIZE) == "own"
    if wanted == "w4a8" and not own:
        wanted = "int4"  # the same weights through torch's stock kernels (where native bf16 makes them fast)
    if wanted in ("int8", "int4", "w4a8") and (torch.device(device).type != "cpu" or not (own or native_bf16())):
        wanted = None
    return wanted or stored_mode(path)


def describe_mode(lean) -> str:
    """What a decoder serves, for start-up lines, /v1/models and benchmark rows: "fp32", "int4
    (fp32 activations, specloop kernels)", "int8 (bf16 activations)" ..."""
    spec = getattr(lean, "quant", None)
    if spec is None:
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(lean.dtype, str(lean.dtype))
    act = {torch.float32: "fp32", torch.bfloat16: "bf16"}[spec.act_dtype]
    if spec.mode in ("fp32", "bf16"):
        return spec.mode
    if spec.mode == "w4a8":
        return "w4a8 (int4 weights, int8 activations, specloop kernels)"
    return f"{spec.mode} ({act} activations{', specloop kernels' if spec.kernels == 'own' else ''})"


def default_mode(device: torch.device | str = "cpu", role: str = "drafter") -> str:
    """The fastest sensible weight mode here. Used for drafters only by "auto" (a verifier is served
    as stored: `resolve_mode`); kept for `--weights fast`-style choices and benchmarks.

    Measured on the development CPU (AMD EPYC, AVX-512 + avx512_bf16, no AMX; 1 thread; SmolLM2-135M
    shape with random weights, 128 tokens of context; ms per forward, T=1 decode / T=5 verify pass):
    fp32 42 / 80, bf16 33 / 29, int8 16 / 21, int4 12 / 19. Decoding a small model is bound by
    reading weights; int8 reads 4x and int4 ~7x fewer bytes than fp32.

    - CUDA: "bf16" (the int kernels here are CPU ones; the graph backend keeps bf16 verification exact).
    - CPU where specloop's kernels build: "w4a8" for a drafter (int8 activations: cheapest drafts).
    - CPU with native bf16 (avx512_bf16 / AMX-BF16): "int8" for a verifier, "int4" for a drafter.
    - CPU without native bf16: "fp32". The int kernels are fast only with bf16 activations, and
      bf16 element-wise work is emulated there.
    """
    if role not in ("verifier", "drafter"):
        raise ValueError(f"role must be 'verifier' or 'drafter', got {role!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return "bf16"
    if role == "drafter" and _kernels_for("w4a8", DEFAULT_GROUP_SIZE) == "own":
        return "w4a8"
    if not native_bf16():
        return "fp32"
    return "int8" if role == "verifier" else "int4"
