"""Suffix decoding (Oliaro et al. 2024; vLLM's `suffix` method): model-free drafts from the
continuations of the longest suffix of the context seen before, in the request itself or in the
outputs of earlier requests.

Two token stores are searched at every step, for every row:
- the row's own history (its prompt and what it generated so far), and
- the global store: the outputs of recent finished requests, concatenated with a separator,
  bounded at `global_tokens` (the oldest outputs are evicted first).

A store answers like a suffix tree over its tokens, computed on the fly rather than kept as nodes: its
tokens (4 bytes each) and an index of where each token and each adjacent pair ends (`TokenIndex`,
16 bytes a token, kept as tokens arrive and leave), so a step's matching never scans the store. The store is
C++ (csrc/suffix.cpp: appending, evicting, matching and following in one call each, ~10× less host time a
step) where it builds, else `NumpyTokens`, the reference it is tested against draft for draft:

    match:   the positions P where the longest suffix of the context (up to `max_depth` tokens)
             occurs with a continuation, from the most recent MAX_HITS occurrences of its last two
             tokens (or its last one); its length m is the match length
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
import functools
import hashlib
import logging
import os
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specloop.drafter.decode.proposer import Proposal, VerifierView, first_rows, with_rows
from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import RowParams, SamplingParams
from specloop.drafter.model.kernels import announce_first_build

log = logging.getLogger(__name__)

SEPARATOR = -1  # between two outputs in the global store: never a token, never continued past
MAX_HITS = 4096  # the most recent occurrences a match starts from (bounds the work of a very common suffix)
FEW = 64  # occurrences at or below which a path is followed in Python rather than numpy


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


class TokenIndex:
    """Where each token, and each pair of adjacent tokens, ends in a growing sequence: absolute positions,
    ascending, in compact arrays, kept as tokens are appended and the oldest evicted. A match starts from
    the occurrences of the context's last two tokens (or its last one) without scanning the sequence:
    a step's matching costs the same in a 64k-token store as in a short prompt."""

    def __init__(self) -> None:
        self.ones: dict[int, array] = {}
        self.pairs: dict[int, array] = {}

    def add(self, tokens: list[int], at: int, before: int = SEPARATOR) -> None:
        """Index `tokens`, the first at absolute position `at`, `before` the token preceding it."""
        ones, pairs = self.ones, self.pairs
        for t in tokens:
            if t != SEPARATOR:
                _positions(ones, t).append(at)
                if before != SEPARATOR:
                    _positions(pairs, _pair(before, t)).append(at)
            before, at = t, at + 1

    def drop(self, tokens: list[int], at: int, before: int = SEPARATOR) -> None:
        """Forget the oldest indexed `tokens` (as `add` took them): each one's entries are its lists' first."""
        for t in tokens:
            if t != SEPARATOR:
                _pop_first(self.ones, t, at)
                if before != SEPARATOR:
                    _pop_first(self.pairs, _pair(before, t), at)
            before, at = t, at + 1

    def starts(self, context: np.ndarray, max_depth: int, base: int, n: int) -> tuple[np.ndarray, int]:
        """The most recent MAX_HITS occurrences (positions from `base`, with a continuation before n) of the
        context's last two tokens, m = 2; else of its last one, m = 1; else none, m = 0."""
        last = int(context[-1])
        if max_depth >= 2 and len(context) >= 2:
            ends = _live(self.pairs.get(_pair(int(context[-2]), last)), base, n)
            if ends.size:
                return ends, 2
        ends = _live(self.ones.get(last), base, n)
        return ends, int(ends.size > 0)


def _pair(a: int, b: int) -> int:
    return (a << 32) | (b & 0xFFFFFFFF)


def _positions(table: dict[int, array], key: int) -> array:
    got = table.get(key)
    if got is None:
        got = table[key] = array("q")
    return got


def _pop_first(table: dict[int, array], key: int, at: int) -> None:
    got = table[key]
    assert got[0] == at, "the index forgets its oldest entries first"
    if len(got) == 1:
        del table[key]
    else:
        del got[0]


def _live(positions: array | None, base: int, n: int) -> np.ndarray:
    """`positions` (absolute, ascending) as positions from `base`, without one at n − 1 (no continuation),
    at most the MAX_HITS most recent (a copy: the array stays free to grow)."""
    if not positions:
        return np.empty(0, dtype=np.int64)
    hi = len(positions) - (positions[-1] == base + n - 1)
    return np.frombuffer(positions, dtype=np.int64)[max(0, hi - MAX_HITS) : hi] - base


class NumpyTokens:
    """The reference token store: its tokens in a growing int32 buffer (positions from `base`, the absolute position
    of its first: the global store evicts) and their TokenIndex. csrc/suffix.cpp's `Store` is the same store in C++
    (`Tokens` takes it where it is built): the same methods, the same drafts."""

    def __init__(self, capacity: int = 16):
        self.buf = np.empty(capacity, dtype=np.int32)
        self.n, self.base = 0, 0
        self.index = TokenIndex()

    def size(self) -> int:
        return self.n

    def last(self) -> int:
        if not self.n:
            raise IndexError("an empty store has no last token")
        return int(self.buf[self.n - 1])

    def slice(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) from the store's first (a view)."""
        return self.buf[: self.n][lo:hi]

    def extend(self, tokens: list[int]) -> None:
        """Append and index `tokens` (the buffer doubles as needed)."""
        if self.n + len(tokens) > len(self.buf):
            grown = np.empty(max(2 * len(self.buf), self.n + len(tokens), 16), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        before = int(self.buf[self.n - 1]) if self.n else SEPARATOR
        self.buf[self.n : self.n + len(tokens)] = tokens
        self.index.add(tokens, self.base + self.n, before)
        self.n += len(tokens)

    def evict(self, count: int) -> None:
        """Drop the oldest `count` tokens (shifting the rest to the buffer's start): whole texts, each ended by a
        separator, so that no pair indexed across the cut stays behind."""
        if not 0 < count <= self.n or self.buf[count - 1] != SEPARATOR:
            raise ValueError("evict whole texts")
        self.index.drop(self.buf[:count].tolist(), self.base)
        self.buf[: self.n - count] = self.buf[count : self.n]
        self.n, self.base = self.n - count, self.base + count

    def match(self, context: np.ndarray, max_depth: int) -> tuple[np.ndarray, int]:
        """(P, m): the end positions p (with a continuation p + 1) of the longest suffix of `context` that occurs
        here, up to max_depth tokens, and its length m (0 and no P: no match). From the index's occurrences of
        the last two tokens, narrowed one token further back at a time."""
        if self.n < 2 or not len(context):
            return np.empty(0, dtype=np.int64), 0
        ends, m = self.index.starts(context, max_depth, self.base, self.n)
        seq, top = self.buf, min(max_depth, len(context))
        if m == 1 and top >= 2:  # the last two tokens never occur together: nothing longer does
            return ends, m
        while 0 < m < top:
            before = ends - m
            ok = before >= 0
            keep = ends[ok][seq[before[ok]] == context[-1 - m]]
            if not keep.size:
                break
            ends, m = keep, m + 1
        return ends, m

    def draft(self, ctx: "NumpyTokens", max_depth: int, k: int, spec_factor: float,
              min_prob: float) -> tuple[list[int], list[float], int]:
        """(tokens, p_i, match length) of the draft this store gives for `ctx`'s tokens (`draft_from`)."""
        context = ctx.buf[max(0, ctx.n - max(max_depth, 2)) : ctx.n]  # all that a match of max_depth reads
        ends, m = self.match(context, max_depth)
        if not m:
            return [], [], 0
        limit = min(k, max(1, int(spec_factor * m)))
        path = follow(self.buf[: self.n], ends, limit, min_prob)
        return [t for t, _ in path], [p for _, p in path], m


@functools.cache
def native_module():
    """csrc/suffix.cpp built for this machine (once; pybind11 only, seconds), or None: no compiler, a failed build,
    or SPECLOOP_KERNELS=stock (the Python reference everywhere)."""
    if os.environ.get("SPECLOOP_KERNELS", "auto") == "stock":
        return None
    source = Path(__file__).with_name("csrc") / "suffix.cpp"
    try:
        from torch.utils.cpp_extension import load

        digest = hashlib.sha256(f"{torch.__version__}|{source.resolve()}|{source.read_text()}".encode()).hexdigest()
        name = f"specloop_suffix_{digest[:12]}"
        announce_first_build(name, "suffix decoding's C++ store (once, ~10 s)")
        return load(name=name, sources=[str(source)],
                    extra_cflags=["-O2", "-ffp-contract=off"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: the Python store, the same drafts
        log.warning("suffix decoding's C++ store not built (%s: %s); using the Python one", type(e).__name__, e)
        return None


def new_store(native: bool | None = None, capacity: int = 16):
    """An empty token store: the C++ one where it is built (native None: where available; True: required), else
    the Python reference."""
    mod = native_module() if native is not False else None
    if native and mod is None:
        raise RuntimeError("suffix decoding's C++ store is not built on this machine")
    return mod.Store() if mod is not None else NumpyTokens(capacity)


class Tokens:
    """A token store searched for matches (a row's history, the global store of earlier outputs): its `impl` is
    the C++ store or the Python reference (`new_store`), behind one interface."""

    def __init__(self, tokens: list[int] | np.ndarray | tuple[()] = (), native: bool | None = None,
                 capacity: int = 16):
        self.impl = new_store(native, capacity)
        if len(tokens):
            self.extend(tokens)

    @property
    def n(self) -> int:
        return self.impl.size()

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self.impl.slice(0, self.n), dtype=np.int32)

    @property
    def last(self) -> int:
        return self.impl.last()

    def extend(self, tokens: list[int] | np.ndarray | tuple[()]) -> None:
        """Append and index `tokens`."""
        self.impl.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens))

    def evict(self, count: int) -> None:
        """Drop the oldest `count` tokens: whole texts, each ended by a separator."""
        self.impl.evict(count)


def follow(seq: np.ndarray, ends: np.ndarray, limit: int, min_prob: float) -> list[tuple[int, float]]:
    """The most frequent continuation path after the occurrences ending at `ends`: (token, p_i) pairs,
    at most `limit`, while p_i ≥ min_prob (the smallest token on a tie). An occurrence whose text ends
    (separator or end of `seq`) counts as a continuation that no token takes."""
    if ends.size > FEW:
        return _follow_many(seq, ends, limit, min_prob)
    alive = [seq[e + 1 : e + 1 + limit].tolist() for e in ends.tolist()]  # each one's next tokens (fewer at the end)
    path: list[tuple[int, float]] = []
    p = 1.0
    for i in range(limit):
        counts: dict[int, int] = {}
        for row in alive:
            if i < len(row) and row[i] != SEPARATOR:
                counts[row[i]] = counts.get(row[i], 0) + 1
        if not counts:
            break
        most = max(counts.values())
        token = min(t for t, c in counts.items() if c == most)
        p *= most / len(alive)
        if p < min_prob:
            break
        path.append((token, p))
        alive = [row for row in alive if i < len(row) and row[i] == token]
    return path


def _follow_many(seq: np.ndarray, ends: np.ndarray, limit: int, min_prob: float) -> list[tuple[int, float]]:
    """`follow` for many occurrences: counted with numpy, one depth at a time."""
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


def draft_from(store: Tokens, context: Tokens, k: int, cfg: SuffixConfig) -> Draft:
    """The draft `store` gives for `context`'s tokens: at most min(k, spec_factor · match length) tokens."""
    return Draft(*store.impl.draft(context.impl, cfg.max_depth, k, cfg.spec_factor, cfg.min_prob))  # fresh lists


def best_draft(row: "History", store: "OutputStore", k: int, cfg: SuffixConfig) -> Draft:
    """A row's draft: its own history's or the global store's, by score (the history's on a tie). The store
    is not searched when the history's draft is already all that a draft of k tokens can promise."""
    own = draft_from(row, row, k, cfg)
    if not store.n or own.score >= k:
        return own
    other = draft_from(store, row, k, cfg)
    return own if own.score >= other.score else other


class History(Tokens):
    """One row's tokens (prompt, then output), indexed as they grow."""

    def __init__(self, prompt: list[int] | np.ndarray, native: bool | None = None):
        super().__init__(prompt, native)
        self.prompt_len = len(prompt)
        self.drafted: tuple[tuple, Draft] | None = None  # the last draft asked of these tokens, and for what

    @property
    def output(self) -> np.ndarray:
        return np.asarray(self.impl.slice(self.prompt_len, self.n), dtype=np.int32)


class OutputStore(Tokens):
    """Earlier requests' outputs, oldest evicted first: at most `capacity` tokens with separators."""

    def __init__(self, capacity: int, native: bool | None = None):
        super().__init__((), native, capacity)
        self.capacity = capacity
        self.sizes: deque[int] = deque()  # tokens (and separator) of each stored output, oldest first
        self.version = 0  # outputs added so far: drafts computed before an addition are stale

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
            self.evict(drop)
        self.extend(np.append(output, SEPARATOR))
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
            row.drafted = (key, best_draft(row, self.store, k, self.cfg))
        return row.drafted[1]

    def propose(self, k: int, params: SamplingParams | RowParams, uniforms: torch.Tensor | None) -> Proposal:
        return proposal_of(self.drafts(k), k, self.fillers())

    def fillers(self) -> list[int]:
        """Each row's last token (what fills a proposal past its draft)."""
        return [row.last for row in self.rows]

    def lookup(self, k: int, params: SamplingParams) -> Proposal | None:
        """Drafts that cost no model pass (decode.engine asks for them on steps the controller left plain):
        this drafter's own, or None where no row has one."""
        drafts = self.drafts(k)
        return proposal_of(drafts, k, self.fillers()) if any(d.tokens for d in drafts) else None

    def free_confidence(self, k: int, m: int) -> tuple[list[list[float]], list[str] | None]:
        """What a lookup of rows [0, m) (`lookup`) would put before the confidence gate, without making it: each
        row's draft's confidence (its path probabilities as the proposal's float32 holds them; [] where it has
        none), and the speculator each row is calibrated as (None: this drafter's own)."""
        return [array("f", d.probs).tolist() for d in self.drafts(k, list(range(m)))], None  # float32, as proposal_of

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView | None = None) -> None:
        for b, on in enumerate(active.tolist()):  # one read of the rows' flags
            if on:
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
