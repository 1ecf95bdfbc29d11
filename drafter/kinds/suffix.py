"""Suffix decoding (Oliaro et al. 2024; vLLM's `suffix` method): model-free drafts from the
continuations of the longest suffix of the context seen before, in the request itself or in the
outputs of earlier requests.

Two token stores are searched at every step, for every row:
- the row's own history (its prompt and what it generated so far), and
- the global store: the outputs of recent finished requests, concatenated with a separator,
  bounded at `global_tokens` (the oldest outputs are evicted first).

A store answers like a suffix tree over its tokens, computed on the fly with numpy rather than
kept as nodes (memory stays the tokens themselves, 4 bytes each):

    match:   the positions P where the longest suffix of the context (up to `max_depth` tokens)
             occurs with a continuation; its length m is the match length
    draft:   follow the most frequent continuation among P, then among those that took it, ...;
             p_i = Π_{j≤i} count(chosen_j) / count(all continuations_j)  (the path's frequency)

A row drafts while p_i ≥ `min_prob` and for at most min(k, spec_factor · m) tokens: a long match
drafts far, a short one a token or two, none at all when nothing matches (the draft length adapts
per row and per step: `Proposal.lengths`). The store whose draft has the higher score Σ p_i wins.

Drafts are deterministic (q is one-hot on the drafted token), so the rejection sampler stays
lossless at any temperature, as with the n-gram kind.
"""
from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from specloop.drafter.decode.proposer import Proposal, VerifierView, first_rows, with_rows
from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import RowParams, SamplingParams

SEPARATOR = -1  # between two outputs in the global store: never a token, never continued past
MAX_HITS = 4096  # the most recent occurrences a match keeps (bounds the work of a very common suffix)


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 16  # the longest context suffix matched
    spec_factor: float = 1.0  # a row drafts at most spec_factor × match length tokens
    min_prob: float = 0.1  # stop a draft once the path's estimated probability falls below this
    global_tokens: int = 65_536  # tokens of earlier outputs kept (4 bytes each); 0 turns the global store off

    def __post_init__(self):
        if self.max_depth < 1 or self.spec_factor <= 0 or not 0 <= self.min_prob <= 1 or self.global_tokens < 0:
            raise ValueError(f"invalid suffix config {self}")


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # p_i: the path's estimated probability up to token i
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected accepted tokens under the store's own estimate."""
        return float(sum(self.probs))


def longest_match(seq: np.ndarray, context: np.ndarray, max_depth: int) -> tuple[np.ndarray, int]:
    """(P, m): the end positions p in `seq` (with a continuation seq[p + 1]) of the longest suffix of
    `context` that occurs there, up to max_depth tokens, and its length m (0 and no P: no match)."""
    if len(seq) < 2 or not len(context):
        return np.empty(0, dtype=np.int64), 0
    ends = np.flatnonzero(seq[:-1] == context[-1])[-MAX_HITS:]
    if not ends.size:
        return ends, 0
    m = 1
    while m < min(max_depth, len(context)):
        before = ends - m
        ok = before >= 0
        keep = ends[ok][seq[before[ok]] == context[-1 - m]]
        if not keep.size:
            break
        ends, m = keep, m + 1
    return ends, m


def follow(seq: np.ndarray, ends: np.ndarray, limit: int, min_prob: float) -> list[tuple[int, float]]:
    """The most frequent continuation path after the occurrences ending at `ends`: (token, p_i) pairs,
    at most `limit`, while p_i ≥ min_prob. An occurrence whose text ends (separator or end of `seq`)
    counts as a continuation that no token takes."""
    path: list[tuple[int, float]] = []
    p, at = 1.0, ends + 1
    while len(path) < limit and at.size:
        total = at.size
        at = at[at < len(seq)]
        nxt = seq[at]
        taken = nxt[nxt != SEPARATOR]
        if not taken.size:
            break
        values, counts = np.unique(taken, return_counts=True)
        best = int(counts.argmax())
        p *= counts[best] / total
        if p < min_prob:
            break
        token = int(values[best])
        path.append((token, float(p)))
        at = at[nxt == token] + 1
    return path


def draft_from(seq: np.ndarray, context: np.ndarray, k: int, cfg: SuffixConfig) -> Draft:
    """The draft one store gives for `context`: at most min(k, spec_factor · match length) tokens."""
    ends, m = longest_match(seq, context, cfg.max_depth)
    if not m:
        return Draft()
    limit = min(k, max(1, int(cfg.spec_factor * m)))
    path = follow(seq, ends, limit, cfg.min_prob)
    return Draft([t for t, _ in path], [p for _, p in path], m)


class History:
    """One row's tokens (prompt, then output) in a growing int32 buffer."""

    def __init__(self, prompt: list[int]):
        self.buf = np.asarray(prompt, dtype=np.int32).copy()
        self.n = len(prompt)
        self.prompt_len = len(prompt)
        self.drafted: tuple[tuple, Draft] | None = None  # the last draft asked of these tokens, and for what

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.n]

    def extend(self, tokens: list[int]) -> None:
        if self.n + len(tokens) > len(self.buf):
            grown = np.empty(max(2 * len(self.buf), self.n + len(tokens), 16), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : self.n + len(tokens)] = tokens
        self.n += len(tokens)

    @property
    def output(self) -> np.ndarray:
        return self.buf[self.prompt_len : self.n]


class OutputStore:
    """Earlier requests' outputs, oldest evicted first: at most `capacity` tokens with separators."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buf = np.empty(capacity, dtype=np.int32)
        self.n = 0
        self.sizes: deque[int] = deque()  # tokens (and separator) of each stored output, oldest first
        self.version = 0  # outputs added so far: drafts computed before an addition are stale

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.n]

    def add(self, output: np.ndarray) -> None:
        """Store one finished output (its last capacity − 1 tokens at most), evicting the oldest."""
        if self.capacity < 2 or not len(output):
            return
        output = output[-(self.capacity - 1):]
        need = len(output) + 1
        drop = 0
        while self.n - drop + need > self.capacity:
            drop += self.sizes.popleft()
        if drop:
            self.buf[: self.n - drop] = self.buf[drop : self.n]
            self.n -= drop
        self.buf[self.n : self.n + len(output)] = output
        self.buf[self.n + len(output)] = SEPARATOR
        self.n += need
        self.sizes.append(need)
        self.version += 1

    @property
    def outputs(self) -> int:
        return len(self.sizes)


class SuffixDrafter:
    """Drafts from the row's own history and the outputs of earlier requests (see the module doc)."""

    kind = "suffix"
    verifier_layers: tuple[int, ...] = ()
    record_layers: tuple[int, ...] = ()
    follows_plain = True  # observing a plain step appends one token per row: never behind

    def __init__(self, vocab_size: int, cfg: SuffixConfig | None = None, store: OutputStore | None = None):
        self.vocab_size, self.cfg = vocab_size, cfg or SuffixConfig()
        self.store = store if store is not None else OutputStore(self.cfg.global_tokens)
        self.rows: list[History] = []

    def _retire(self, row: History | None) -> None:
        """A row's request ended (its slot is taken, or the batch restarts): its output joins the store."""
        if row is not None and self.cfg.global_tokens:
            self.store.add(row.output)

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView | None = None) -> None:
        for row in self.rows:
            self._retire(row)
        self.rows = [History(p) for p in prompts]

    def join(self, slots: list[int], prompts: list[list[int]], view: VerifierView | None = None) -> None:
        for s, p in zip(slots, prompts):
            self._retire(self.rows[s])
            self.rows[s] = History(p)

    def drafts(self, k: int, rows: list[int] | None = None) -> list[Draft]:
        """Each row's (or the listed rows') best draft of at most k tokens: its history's or the global
        store's, by score."""
        return [self._draft(row, k) for row in (self.rows if rows is None else [self.rows[b] for b in rows])]

    def _draft(self, row: History, k: int) -> Draft:
        """One row's draft, computed once for its tokens, the store and k (a step may ask twice: whether the
        drafts are worth a lookup, then the lookup)."""
        key = (row.n, id(self.store), self.store.version, k, self.cfg)
        if row.drafted is None or row.drafted[0] != key:
            own = draft_from(row.tokens, row.tokens, k, self.cfg)
            other = draft_from(self.store.tokens, row.tokens, k, self.cfg) if self.store.n else Draft()
            row.drafted = (key, own if own.score >= other.score else other)
        return row.drafted[1]

    def propose(self, k: int, params: SamplingParams | RowParams, uniforms: torch.Tensor | None) -> Proposal:
        return proposal_of(self.drafts(k), k, [row.tokens[-1] for row in self.rows])

    def lookup(self, k: int, params: SamplingParams) -> Proposal | None:
        """Drafts that cost no model pass (decode.engine asks for them on steps the controller left plain):
        this drafter's own, or None where no row has one."""
        drafts = self.drafts(k)
        return proposal_of(drafts, k, [row.tokens[-1] for row in self.rows]) if any(d.tokens for d in drafts) else None

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView | None = None) -> None:
        for b in torch.nonzero(active).flatten().tolist():
            self.rows[b].extend(outcome.emitted(b))

    def narrow(self, m: int) -> "SuffixDrafter":
        view = copy.copy(self)  # the store is shared: it changes only between requests
        view.rows = first_rows(self.rows, m)
        return view

    def widen(self, view: "SuffixDrafter", m: int) -> None:
        self.rows = with_rows(self.rows, view.rows, m)

    def adopt(self, old: "SuffixDrafter") -> None:
        """Continue `old`'s rows and store: both are committed tokens, valid for any configuration."""
        self.rows, self.store = old.rows, old.store

    def refill(self, old: "SuffixDrafter", histories: list[list[int]]) -> None:
        self.store = old.store
        self.rows = [History(h) for h in histories]
        for row, before in zip(self.rows, old.rows):
            row.prompt_len = min(before.prompt_len, row.n) if before is not None else row.n


def proposal_of(drafts: list[Draft], k: int, filler: list[int]) -> Proposal:
    """A [B, k] proposal from per-row drafts of up to k tokens: positions past a row's draft hold a
    filler token and are never accepted (`lengths`); q is one-hot on every drafted token (made by the
    step once the draft is cut, and only when it samples: `Proposal.one_hot`)."""
    tokens = torch.tensor([d.tokens + [int(f)] * (k - len(d.tokens)) for d, f in zip(drafts, filler)],
                          dtype=torch.long).reshape(len(drafts), k)
    lengths = torch.tensor([len(d.tokens) for d in drafts], dtype=torch.long)
    confidence = torch.tensor([d.probs + [0.0] * (k - len(d.probs)) for d in drafts],
                              dtype=torch.float32).reshape(len(drafts), k)
    return Proposal(tokens=tokens, probs=None, lengths=lengths, confidence=confidence, one_hot=True)
