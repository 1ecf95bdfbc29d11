"""A checkpoint's own quantized groups, shipped beside its float weights (a GGUF's Q4_1 and Q8_0
tensors, written by `specloop models fetch`): reading them (`int4_groups`, `int8_blocks`, one weight
at a time), dequantizing them as GGUF does (`dequantize_groups`), and checking that they reproduce
the loaded weights exactly (`reproduces`; a stale file is never served)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from specloop.drafter.model.weights.modes import VERIFIER_MANIFEST, _read_json

# a fetched verifier's GGUF Q4_1 groups: NAME.q [N, K] uint8, NAME.d / .m [N, K/32]
INT4_GROUPS_FILE = "q4_1.safetensors"


def int4_groups(path: str | Path) -> "GroupsFile | None":
    """The 4-bit groups a checkpoint directory ships beside its float weights (named by its manifest's
    "groups", written by `specloop models fetch` from the GGUF): Hugging Face parameter name →
    (q [N, K] uint8 in [0, 15], scale [N, K/g], minimum [N, K/g]) with w = q · scale + minimum. None
    when it has none."""
    return _source_tensors(path, with_minimum=True)


def int8_blocks(path: str | Path) -> "GroupsFile | dict":
    """The int8 blocks a checkpoint directory ships in its groups file (a GGUF's Q8_0 tensors: NAME.q
    int8, NAME.d [N, K/32], no NAME.m): Hugging Face parameter name → (q, d), w = q · d."""
    return _source_tensors(path, with_minimum=False) or {}


def _source_tensors(path: str | Path, with_minimum: bool) -> "GroupsFile | None":
    """From the groups file the manifest names (None when there is none): NAME → (q, d, m) for the
    entries that have a minimum, or (q, d) for those that have none; each read when asked for."""
    name = _read_json(Path(path) / VERIFIER_MANIFEST).get("groups")
    if not name or not (Path(path) / name).is_file():
        return None
    return GroupsFile(Path(path) / name, with_minimum)


class GroupsFile(Mapping):
    """A groups file's entries, read on demand (one weight's parts at a time), so that converting a
    model holds one layer's groups at a time rather than the whole file (150 MB for SmolLM2-135M).
    The file stays open while the object lives: opening it parses its header, and a conversion reads
    ~200 entries (SmolLM2-135M: 0.35 s of opens when each read opened it)."""

    def __init__(self, file: Path, with_minimum: bool):
        self.file, self.parts = file, (".q", ".d", ".m") if with_minimum else (".q", ".d")
        self._handle = open_safetensors(file)
        keys = set(self._handle.keys())
        self.names = frozenset(k[:-2] for k in keys if k.endswith(".q") and k[:-2] + ".d" in keys
                               and (k[:-2] + ".m" in keys) == with_minimum)

    def __getitem__(self, name: str) -> tuple[torch.Tensor, ...]:
        if name not in self.names:
            raise KeyError(name)
        return tuple(self._handle.get_tensor(name + p) for p in self.parts)

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(sorted(self.names))

    def __len__(self) -> int:
        return len(self.names)


def open_safetensors(file: Path):
    """A safetensors file opened to read tensors with pread(2) into memory of their own: the default
    memory map keeps every page a read touched resident (and counted) while the file is open."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", backend="pread")
    except TypeError:  # safetensors before the `backend` option: memory-mapped
        return safe_open(str(file), framework="pt")


def reproduces(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, weight: torch.Tensor,
               rows: int = 1024) -> bool:
    """Whether `dequantize_groups(q, scale, minimum)` equals `weight` exactly, compared a block of rows
    at a time (a whole LM head dequantized at once is a float copy of it: 113 MB on SmolLM2)."""
    if q.shape != weight.shape:
        return False
    for i in range(0, q.shape[0], rows):
        part = slice(i, i + rows)
        m = None if minimum is None else minimum[part]
        if not torch.equal(dequantize_groups(q[part], scale[part], m), weight[part].detach().float().cpu()):
            return False
    return True


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None = None) -> torch.Tensor:
    """q · scale (+ minimum) in fp32 per group, [N, K]: a product, then a sum, as GGUF's own
    dequantization of Q4_1 (with a minimum) and Q8_0 (without), computed in place in one fp32 copy of q
    (three temporaries made a load's exactness checks, `reproduces`, 0.7 s instead of 0.3 on SmolLM2-135M)."""
    N, K = q.shape
    G = scale.shape[1]
    w = q.to(torch.float32, copy=True)
    grouped = w.view(N, G, K // G)
    grouped.mul_(scale.float()[..., None])
    if minimum is not None:
        grouped.add_(minimum.float()[..., None])
    return w
