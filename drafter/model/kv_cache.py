"""The decoder's KV cache (`KVCache`; its layout and rollback: specloop.drafter.model.decoder) and filling it from
prompts: `prefill` (a new cache, one prompt at a time) and `prefill_rows` (rows of a running batch).
`lean` below is a specloop.drafter.model.decoder.LeanDecoder."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class KVCache:
    keys: list[torch.Tensor]  # per layer [B, H_kv, capacity, D], KV_DTYPE (capacity: whole KEY_BLOCKs)
    values: list[torch.Tensor]  # per layer [B, H_kv, capacity, D]
    lens: torch.Tensor  # [B] int64 on the host: valid positions per row

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of `shape` whose pages nothing has written yet (on the CPU: NumPy's calloc'd memory, whose pages the OS
    zeroes on first touch; 64-byte aligned), so that a KV pool sized for long requests costs neither the time to
    write its zeros (3.7 s for `serve`'s 8 slots of 8,192 positions of SmolLM2-135M, 3 GB) nor resident memory for the
    positions no request has reached. Elsewhere torch.zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


@dataclass
class PromptFeatures:
    """What prefills capture for a drafter, per prompt b of an admission: features {layer: [B, hidden]} (the residual
    stream at the position that produced the prompt's last token), recent {layer: [B, tail, hidden]} (those at the
    positions that produced its last `tail` tokens, oldest first) and lens [B] (how many of them are real:
    min(tail, len(prompt) − 1)). Zeros where a prompt has one token."""

    features: dict[int, torch.Tensor]
    recent: dict[int, torch.Tensor]
    lens: torch.Tensor

    @classmethod
    def zeros(cls, lean, prompts: list[list[int]], capture: tuple[int, ...], tail: int) -> "PromptFeatures":
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(len(prompts), *shape, lean.hidden_size, device=lean.device, dtype=lean.dtype)
        return cls({i: z() for i in capture}, {i: z(tail) for i in capture},
                   torch.tensor([min(tail, max(0, len(p) - 1)) for p in prompts], dtype=torch.long))

    def keep(self, b: int, hidden: dict[int, torch.Tensor]) -> None:
        """Prompt b's from its prefill's residual streams (hidden {layer: [T, hidden]}, its last positions, newest
        last: at least lens[b] of them)."""
        m = int(self.lens[b])
        for i, h in hidden.items():
            self.features[i][b] = h[-1]
            if m:
                self.recent[i][b, :m] = h[-m:]

    def copy(self, b: int, src: int) -> None:
        """Prompt b's as prompt src's (the same prompt)."""
        for i in self.features:
            self.features[i][b], self.recent[i][b] = self.features[i][src], self.recent[i][src]

    def parts(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], torch.Tensor]:
        return self.features, self.recent, self.lens


def copy_positions(src: KVCache, src_row: int, dst: KVCache, dst_row: int, n: int) -> None:
    """Every layer's keys and values at positions [0, n) of row `src_row` of `src` into row `dst_row` of `dst`, in one
    call (torch's multi-tensor copy: one dispatch from Python for all 2 × layers tensors)."""
    torch._foreach_copy_([t[dst_row, :, :n] for t in dst.keys + dst.values],
                         [t[src_row, :, :n] for t in src.keys + src.values])


def pad_right(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists → ([B, T] int64 right-padded, [B] lengths)."""
    sizes = [len(r) for r in rows]
    width = max(1, *sizes) if rows else 1
    # built as lists: one tensor made, not a copy per row (a drafting step of a drafter LM pads every row)
    out = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long).reshape(len(rows), width)
    return out, torch.tensor(sizes, dtype=torch.long)


def prefill(lean, prompts: list[list[int]], capacity: int, capture: tuple[int, ...] = ()):
    """A new cache holding every prompt token but the last (which is the first block's input).

    Prompts are prefilled one at a time (each row's own pass, into its row of the cache): a long pass
    takes plain GEMMs whose rounding depends on their row count, so a prompt's KV must not depend on
    which other prompts joined with it (continuous batching stays exact).

    Returns (cache, features): features maps each captured layer to [B, hidden], the residual
    stream at the position whose output predicts the last prompt token (zeros for 1-token prompts).
    """
    cache, features, _, _ = prefill_recent(lean, prompts, capacity, capture)
    return cache, features


def prefill_recent(lean, prompts: list[list[int]], capacity: int, capture: tuple[int, ...] = (), tail: int = 0):
    """`prefill`, also returning each captured layer's residual streams at the positions that
    produced the prompt's last `tail` tokens: (cache, features, recent {layer: [B, tail, hidden]},
    recent_lens [B]); row b's first recent_lens[b] = min(tail, len(prompt) − 1) are real, oldest first."""
    cache = lean.new_cache(len(prompts), capacity)  # a graph pool where `lean` is a model.graph.GraphDecoder
    lean = getattr(lean, "eager", lean)  # prefills run the LeanDecoder's own passes
    got = PromptFeatures.zeros(lean, prompts, capture, tail)
    first: dict[tuple[int, ...], int] = {}  # identical prompts (n > 1, repeated requests) are computed once
    for b, prompt in enumerate(prompts):
        if len(prompt) < 2:
            continue
        src = first.setdefault(tuple(prompt), b)
        if src != b:
            for layer in cache.keys + cache.values:
                layer[b] = layer[src]
            cache.lens[b] = cache.lens[src]
            got.copy(b, src)
            continue
        row = KVCache([k[b : b + 1] for k in cache.keys], [v[b : b + 1] for v in cache.values], cache.lens[b : b + 1])
        out = lean.forward(row, torch.tensor([prompt[:-1]]), last_only=True, capture=capture, prefill=True)
        cache.lens[b] = row.lens[0]
        got.keep(b, {i: out.hidden[i][0] for i in capture})
    return cache, *got.parts()


def prefill_rows(lean, cache: KVCache, slots: list[int], prompts: list[list[int]],
                 capture: tuple[int, ...] = (), tail: int = 0):
    """`prefill` into rows `slots` of an existing cache (continuous batching: requests join a running
    batch); the other rows are untouched. Returns what `prefill_recent` captured for these rows:
    (features [len(slots), hidden] per layer, recent [len(slots), tail, hidden] per layer, recent_lens)."""
    if getattr(lean, "chunked_prefill", False):  # a model.graph.GraphDecoder on a GPU: captured chunks
        return lean.prefill_rows(cache, slots, prompts, capture, tail)
    width = max(len(p) for p in prompts)
    fresh, features, recent, lens = prefill_recent(getattr(lean, "eager", lean), prompts, width, capture, tail)
    idx = torch.tensor(slots, dtype=torch.long)
    dev = idx.to(lean.device)
    for dst, src in zip(cache.keys + cache.values, fresh.keys + fresh.values):
        dst[dev, :, :width] = src[:, :, :width]
    cache.lens[idx] = fresh.lens
    return features, recent, lens
