"""A frequency-ranked truncated draft vocabulary (FR-Spec, Zhao et al. 2025).

On a small model the drafter's LM head (vocabulary × hidden) costs as much as several of its
layers. FR-Spec lets the drafter score only the `size` most frequent tokens of real traffic: its
logits are computed over that subset and scattered into the full vocabulary with -inf elsewhere,
so its distribution q puts no mass outside the subset. The verifier still scores the full
vocabulary, and rejection sampling only needs q to be a distribution the draft was drawn from,
so the output stays exactly the verifier's (a token outside the subset is never drafted; it is
emitted as a recovered or bonus token instead).

The subset is stored beside a drafter checkpoint as `draft_vocab.safetensors` (sorted int64 ids)
and named in its manifest under "draft_vocab".
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file

VOCAB_FILE = "draft_vocab.safetensors"


def frequency_ranked(token_lists: Iterable[list[int]], size: int, vocab_size: int,
                     always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids in `token_lists` (ties: lower id first) plus `always`
    (end-of-sequence and special ids), sorted. Fewer when the traffic holds fewer distinct ids."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts: Counter[int] = Counter()
    for ids in token_lists:
        counts.update(ids)
    keep = set(always)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        keep.add(token)
    bad = [t for t in keep if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:3]} lie outside the vocabulary of {vocab_size}")
    return torch.tensor(sorted(keep), dtype=torch.long)


def save_vocab(directory: Path, ids: torch.Tensor) -> dict:
    """Write the subset; returns the manifest entry."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"ids": ids.to(torch.long).contiguous()}, directory / VOCAB_FILE)
    return {"file": VOCAB_FILE, "size": int(ids.numel())}


def load_vocab(directory: Path, manifest: dict, vocab_size: int) -> torch.Tensor | None:
    """The checkpoint's draft vocabulary (sorted ids), or None when it drafts over the full one."""
    entry = manifest.get("draft_vocab")
    if not entry:
        return None
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise ValueError(f"{directory}: manifest names draft vocabulary {entry['file']}, which is missing")
    ids = load_file(path)["ids"].to(torch.long)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{path}: draft vocabulary must be sorted distinct ids in [0, {vocab_size})")
    return ids


def expand(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., n] subset logits → [..., vocab_size] full logits, -inf outside the subset."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., ids] = logits
    return full
