"""N-gram prompt lookup: draft the continuation of the latest earlier occurrence of the suffix."""
from __future__ import annotations

import copy

import numpy as np
import torch

from specloop.drafter.decode.proposer import Proposal, VerifierView, first_rows, with_rows
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


def draft_row(history: list[int], k: int, max_n: int, min_n: int, index: "SuffixIndex | None" = None) -> list[int]:
    """Exactly k tokens: chain lookups when a match runs short; repeat the last token if none. With `index`
    (the row's n-grams, kept as the history grows) the same drafts without scanning the history."""
    seq = list(history)
    while len(seq) - len(history) < k:
        need = k - (len(seq) - len(history))
        more = lookup(np.asarray(seq), need, max_n, min_n) if index is None else index.lookup(seq, need)
        seq.extend(more or [seq[-1]])
    return seq[len(history) :]


class SuffixIndex:
    """`lookup` for one growing history without a scan: for each n in [min_n, max_n], every n-gram of the
    history mapped to the end of its latest occurrence, brought up to date with the tokens appended since
    the last call (histories only grow: a row's list is replaced, never rewritten, when a request joins)."""

    def __init__(self, history: list[int], max_n: int, min_n: int):
        self.history, self.max_n, self.min_n = history, max_n, min_n
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest indexed occurrence
        self.indexed = 0  # windows ending at or before this position are in `latest`

    def fits(self, history: list[int]) -> bool:
        return history is self.history and self.indexed <= len(history)

    def _catch_up(self) -> None:
        """Index the windows of history[:-1] (ends up to len − 1) not yet indexed."""
        h, top = self.history, len(self.history) - 1
        for end in range(self.indexed + 1, top + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.latest[tuple(h[end - n : end])] = end
        self.indexed = max(self.indexed, top)

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """`lookup(np.asarray(seq), k, max_n, min_n)` for seq = the history + drafts appended to it."""
        self._catch_up()
        base, L = len(self.history), len(seq)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = seq[L - n :]
            # windows ending past the indexed history (in the appended drafts) are the latest: scanned first
            end = next((e for e in range(L - 1, max(base - 1, n - 1), -1) if seq[e - n : e] == suffix), None)
            if end is None:
                end = self.latest.get(tuple(suffix))
            if end is not None:
                return seq[end : end + k]
        return []


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
        rows = [draft_row(h, k, self.max_n, self.min_n, self._index(h)) for h in self.history]
        tokens = torch.tensor(rows, dtype=torch.long)
        probs = None if params.greedy else torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        return Proposal(tokens=tokens, probs=probs)

    def _index(self, history: list[int]) -> SuffixIndex:
        """The row's SuffixIndex (a cache kept by the list's identity: narrowed views share it; a row whose
        list was replaced gets a new one)."""
        indexes = self.__dict__.setdefault("_indexes", {})
        index = indexes.get(id(history))
        if index is None or not index.fits(history):
            if len(indexes) > 4 * max(1, len(self.history)):  # rows long gone
                indexes.clear()
            index = indexes[id(history)] = SuffixIndex(history, self.max_n, self.min_n)
        return index

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView | None = None) -> None:
        for b in torch.nonzero(active).flatten().tolist():
            self.history[b].extend(outcome.emitted(b))

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
