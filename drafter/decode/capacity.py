"""The one capacity rule: how many cache positions a request needs.

A verify pass writes the newest committed token and k drafts past the committed ones, and a slot
keeps room for two such blocks (one being rolled back while the next is written), so a request of
draft length k needs prompt + max_tokens + 2 k + 2 positions; k = None ("auto") reserves for the
most a controller may choose.
"""
from __future__ import annotations

AUTO_K_MAX = 4  # the most drafts per block a controller chooses by default


def draft_reserve(k: int | None, k_max: int = AUTO_K_MAX) -> int:
    """Positions beyond prompt + completion for draft length k (None: auto, up to k_max)."""
    return 2 * (k_max if k is None else k) + 2


def positions_needed(prompt_len: int, max_tokens: int, k: int | None, k_max: int = AUTO_K_MAX) -> int:
    """Cache positions a request of this prompt length, completion budget and draft length needs."""
    return prompt_len + max_tokens + draft_reserve(k, k_max)


def fits(prompt_len: int, max_tokens: int, k: int | None, capacity: int, k_max: int = AUTO_K_MAX) -> bool:
    return positions_needed(prompt_len, max_tokens, k, k_max) <= capacity
