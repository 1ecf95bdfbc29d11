"""N-gram prompt lookup: draft the continuation of the latest earlier occurrence of the suffix."""
from __future__ import annotations

import copy

import numpy as np
import torch

from specloop.drafter.decode.proposer import Proposal, VerifierView, emitted_tokens, first_rows, with_rows
from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import RowParams, SamplingParams


def lookup(history: np.ndarray, k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens following the most recent earlier match of the longest suffix n-gram."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)
        hits = np.flatnonzero((windows == history[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return history[start : start + k].tolist()
    return []


def draft_row(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Exactly k tokens: chain lookups when a match runs short; repeat the last token if none."""
    seq = list(history)
    while len(seq) - len(history) < k:
        more = lookup(np.asarray(seq), k - (len(seq) - len(history)), max_n, min_n)
        seq.extend(more or [seq[-1]])
    return seq[len(history) :]


class NgramDrafter:
    """Deterministic drafts (q is one-hot on the drafted token), so sampling stays lossless."""

    kind = "ngram"
    verifier_layers: tuple[int, ...] = ()
    record_layers: tuple[int, ...] = ()
    follows_plain = False  # its histories miss the tokens of plain steps

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView | None = None) -> None:
        self.history = [list(p) for p in prompts]

    def join(self, slots: list[int], prompts: list[list[int]], view: VerifierView | None = None) -> None:
        for s, p in zip(slots, prompts):
            self.history[s] = list(p)

    def propose(self, k: int, params: SamplingParams | RowParams, uniforms: torch.Tensor | None) -> Proposal:
        rows = [draft_row(h, k, self.max_n, self.min_n) for h in self.history]
        tokens = torch.tensor(rows, dtype=torch.long)
        probs = None if params.greedy else torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        return Proposal(tokens=tokens, probs=probs)

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView | None = None) -> None:
        for b in torch.nonzero(active).flatten().tolist():
            self.history[b].extend(emitted_tokens(outcome, b))

    def narrow(self, m: int) -> "NgramDrafter":
        view = copy.copy(self)
        view.history = first_rows(self.history, m)
        return view

    def widen(self, view: "NgramDrafter", m: int) -> None:
        self.history = with_rows(self.history, view.history, m)

    def adopt(self, old: "NgramDrafter") -> None:
        """Continue `old`'s rows: its state is the committed tokens, valid for any lookup."""
        self.history = old.history

    def refill(self, old: "NgramDrafter", histories: list[list[int]]) -> None:
        self.history = [list(h) for h in histories]
