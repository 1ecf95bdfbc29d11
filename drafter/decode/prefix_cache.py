"""Prefix caching: the KV of prompt prefixes, kept in blocks of `block_size` tokens and reused across requests and
chat turns, so that a request re-prefills only what no earlier request computed — exactly.

Exactness. A prompt's KV depends on how its prefill is cut into passes: a pass of more than QUERY_CHUNK tokens takes
plain GEMMs, a shorter one the decode-shaped row-blocked products (specloop.drafter.model.weights.linears), and the
two round differently. Measured on the reference verifier (fp32, the CPU that runs the suite): prefill(prompt[:P])
then the rest in one pass differs from one pass over the prompt (KV and last logits, ~3e-6) whenever either pass has
16 tokens or fewer; with both passes longer, this CPU's BLAS (MKL in strict mode) happened to round every row as the
one-pass prefill does — a property of the machine, not of the method, and never of a GPU's GEMMs. And the KV a
decode step writes (row-blocked products) is never bit for bit a long pass's.

So where prefix caching is on, every prefill runs one fixed schedule (`passes`): one pass per block, aligned at
position 0, then one last pass over the rest, longer than QUERY_CHUNK where blocks are (`final_start`). A block's KV
is then computed by the same pass over the same earlier KV whether its request found a prefix cached or not: a hit is
bit for bit a fresh prefill by construction, on every backend, hence the same logits and the same output. Only
blocks those aligned passes computed are cached: the prompt's blocks before its last pass at admission
(`prefill_cached`), and at a request's finish its whole history's full blocks, computed again by the same aligned
passes (`cache_output`: one prefill of the generated tokens, so the next turn — previous prompt + answer + new message
— finds the answer cached; the KV the decode steps wrote is not what a prefill computes, so it is never copied).
A hit never covers the prompt's last pass (nor its last token, the first block's input), nor the last
`tail` positions whose features a windowed drafter head reads (eagle3's `feature_window`).

Where every position is computed alike whatever pass computes it (`LeanDecoder.rows_alike`: specloop's own CPU
kernels end to end, as the served w4a8 of a fetched model runs), no schedule is needed either: the rest after a hit is
one pass, every full block of it is cached, and a finished request's history is cached from the KV its row already
holds (the decode steps wrote the bits a prefill would), with no second prefill: copies, done at the finish itself
(`cut_free`), so that answers are cached under load too.

On a GPU, where prompts prefill in captured chunks (specloop.drafter.model.graph `chunked_prefill`), every chunk is
one replay of the same static step, whose result for a position does not depend on how many of its queries are real:
there a prompt's KV is the same bits however it is cut, the schedule above is not needed, and the rest after a hit
goes in chunks (`_workspace`). Decode steps run another width, so their KV is still never cached.

Blocks are keyed by a chained SHA-256 of (parent key, the block's tokens), which also hold their tokens and parent
(checked on every match). They are copied into a slot's row on a hit (the pool is one contiguous row per slot, not
paged), so no block is ever shared in place: no reference counts. Eviction is least recently used within a budget of
positions; a match or insert touches a chain from its last block to its first, so a parent is always more recent than
its children and evicted after them (the cache holds whole chains from position 0, never orphans). Stats count
prompt tokens looked up and served from the cache, as vLLM's prefix_cache_queries / prefix_cache_hits do.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specloop.drafter.model.attention import QUERY_CHUNK
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.graph import GraphDecoder, prefill_spans
from specloop.drafter.model.kv_cache import KVCache, PromptFeatures, copy_positions

BLOCK_SIZE = 32  # tokens per block: > QUERY_CHUNK, so every prefill pass is a long one, as a one-pass prefill is
ROOT = b""  # the parent key of a prompt's first block


def final_start(n: int, block: int) -> int:
    """Where the last prefill pass over n positions starts: the last multiple of `block` that leaves that pass more
    than QUERY_CHUNK positions when blocks are longer than that (every pass long, as a one-pass prefill is), at
    least one otherwise; 0 when no such multiple exists (one pass)."""
    least = QUERY_CHUNK + 1 if block > QUERY_CHUNK else 1
    return max(0, (n - least) // block * block)


def passes(start: int, n: int, block: int) -> list[tuple[int, int]]:
    """The prefill passes (first, end) over positions [start, n): one per block from `start` (a multiple of `block`,
    at most `final_start`) up to `final_start`, then one over the rest."""
    if n <= start:
        return []
    last = final_start(n, block)
    assert start % block == 0 and start <= last, (start, last)
    return [(a, a + block) for a in range(start, last, block)] + [(last, n)]


def reusable(n: int, block: int, tail: int = 0) -> int:
    """The most positions of an n-position prefill a hit may cover: whole blocks before its last pass, leaving the
    last `tail` positions to be computed (their residual streams are read by a windowed drafter head)."""
    return min(final_start(n, block), max(0, n - tail)) // block * block


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained key of a block: SHA-256 of its parent's key and its tokens."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(frozen=True)
class CachedBlock:
    key: bytes
    parent: bytes  # the key of the block before it (ROOT: the prompt's first block)
    tokens: tuple[int, ...]
    keys: torch.Tensor  # [layers, H_kv, block_size, D]
    values: torch.Tensor  # [layers, H_kv, block_size, D]


@dataclass(frozen=True)
class PrefixCacheStats:
    queries: int  # prompt tokens looked up (every admitted prompt's length)
    hits: int  # of them, served from the cache
    blocks: int  # blocks held
    budget: int  # positions the cache may hold
    block_size: int
    evicted: int  # blocks evicted so far

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """Blocks of KV by chained key, least recently used first. `budget`: positions (whole blocks) it may hold;
    `outputs`: at a request's finish, its generated tokens are prefilled and cached too (`cache_output`)."""

    def __init__(self, budget: int, block_size: int = BLOCK_SIZE, outputs: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if budget < 0:
            raise ValueError(f"budget must be >= 0 positions, got {budget}")
        self.block_size, self.budget, self.outputs = block_size, budget, outputs
        self.max_blocks = budget // block_size
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self.queries = self.hits = self.evicted = 0

    def sibling(self) -> "PrefixCache":
        """An empty cache of the same geometry (a drafter LM's own: other weights, other KV), prompts only."""
        return PrefixCache(self.budget, self.block_size, outputs=False)

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries, self.hits, len(self._blocks), self.budget, self.block_size, self.evicted)

    def record(self, queried: int, hit: int) -> None:
        """One admitted prompt: `queried` tokens looked up, `hit` of them served from the cache."""
        self.queries += queried
        self.hits += hit

    def match(self, tokens: Sequence[int], limit: int) -> list[CachedBlock]:
        """The longest cached chain of `tokens`' full blocks within its first `limit` positions (touched)."""
        B, found, parent = self.block_size, [], ROOT
        for a in range(0, limit - B + 1, B):
            chunk = tuple(tokens[a : a + B])
            blk = self._blocks.get(block_key(parent, chunk))
            if blk is None or blk.parent != parent or blk.tokens != chunk:
                break
            found.append(blk)
            parent = blk.key
        self._touch([b.key for b in found])
        return found

    def insert(self, tokens: Sequence[int], upto: int, read: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
               ) -> int:
        """Cache the full blocks of tokens[:upto] not cached yet, their KV read by `read(first, end)` ([layers, H_kv,
        end − first, D] keys and values, copies); the chain is touched. Returns the blocks added. A chain longer
        than the budget keeps its first blocks."""
        B, chain, parent, taken = self.block_size, [], ROOT, set()
        for a in range(0, min(upto, self.max_blocks * B) - B + 1, B):
            chunk = tuple(tokens[a : a + B])
            key = block_key(parent, chunk)
            blk = self._blocks.get(key)
            if (blk is not None and (blk.parent != parent or blk.tokens != chunk)) or key in taken:
                break  # another block under this key (never seen with SHA-256): leave it
            taken.add(key)
            chain.append((a, key, parent, chunk, blk))
            parent = key
        self._touch([key for _, key, _, _, blk in chain if blk is not None])
        added = [c for c in chain if c[4] is None]
        self._evict(len(self._blocks) + len(added) - self.max_blocks)
        for a, key, parent, chunk, _ in added:
            keys, values = read(a, a + B)
            self._blocks[key] = CachedBlock(key, parent, chunk, keys, values)
        self._touch([key for _, key, _, _, _ in chain])
        return len(added)

    def _touch(self, keys: list[bytes]) -> None:
        """Most recent: the chain's first block, then the next ... (eviction takes the last blocks first)."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def _evict(self, count: int) -> None:
        for _ in range(max(0, count)):
            self._blocks.popitem(last=False)
            self.evicted += 1


# -- the prefill schedule on a cache's rows


def cut_free(lean) -> bool:
    """Whether `lean`'s KV is the same bits however its passes are cut, decode steps included: a LeanDecoder computing
    every row alike. Then a prefill needs no schedule (`prefill_row`), and a finished history is cached from the KV
    its row holds (`cache_output`: copies, no pass, cheap enough to do at the finish itself). Never a GraphDecoder:
    its decode steps run a step of their own, whose KV is not its prefill's."""
    return isinstance(lean, LeanDecoder) and lean.rows_alike


def _spans(hit: int, n: int, block: int, chunked: bool, alike: bool) -> list[tuple[int, int]]:
    """The prefill passes over positions [hit, n): captured chunks, one pass where the cut changes nothing, else the
    schedule's aligned passes."""
    if chunked:
        return prefill_spans(hit, n)
    return [(hit, n)] if alike else passes(hit, n, block)


def _row(cache: KVCache, slot: int, length: int) -> KVCache:
    """Row `slot` of `cache` as a one-row cache of views (writes reach the pool), `length` positions valid."""
    return KVCache([k[slot : slot + 1] for k in cache.keys], [v[slot : slot + 1] for v in cache.values],
                   torch.tensor([length], dtype=torch.long))


def _workspace(lean, cache: KVCache, slot: int, length: int) -> tuple[LeanDecoder | GraphDecoder, KVCache, bool]:
    """(step, row, chunked): where row `slot`'s prefill runs, its first `length` positions valid there. The
    LeanDecoder's own passes on the row itself, in the schedule's aligned passes; or, where the decoder prefills in
    captured chunks (a model.graph.GraphDecoder on a GPU: `chunked_prefill`), the prefiller's 1-row scratch pool,
    copied into the row afterwards, in chunks (`prefill_spans`: any cut of a prompt gives the same bits there)."""
    if isinstance(lean, GraphDecoder) and lean.chunked_prefill:
        step = lean.prefiller()
        row = step.scratch(cache.capacity)
        row.lens = torch.tensor([length], dtype=torch.long)
        return step, row, True
    return getattr(lean, "eager", lean), _row(cache, slot, length), False


def _read(row: KVCache) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    return lambda a, b: (torch.stack([k[0, :, a:b] for k in row.keys]), torch.stack([v[0, :, a:b] for v in row.values]))


def _write(row: KVCache, blocks: list[CachedBlock]) -> None:
    """Copy a hit's blocks into the row's first positions."""
    if not blocks:
        return
    keys, values = torch.cat([b.keys for b in blocks], dim=2), torch.cat([b.values for b in blocks], dim=2)
    n = keys.shape[2]
    for i, (k, v) in enumerate(zip(row.keys, row.values)):
        k[0, :, :n] = keys[i]
        v[0, :, :n] = values[i]


@dataclass(frozen=True)
class RowPrefill:
    hit: int  # positions served from the cache
    hidden: dict[int, torch.Tensor]  # captured layer -> [m, hidden]: the residual streams of the last m positions


def prefill_row(lean, cache: KVCache, slot: int, tokens: list[int], prefix: PrefixCache,
                capture: tuple[int, ...] = (), tail: int = 1) -> RowPrefill:
    """Row `slot` of `cache` holding `tokens` (a prompt but its last token): its longest cached prefix copied in, the
    rest prefilled by the schedule's passes or in chunks (`lean`: a LeanDecoder, or a GraphDecoder: `_workspace`),
    the new blocks cached. Returns the hit and each captured layer's residual streams at the last
    min(max(tail, 1), len(tokens)) positions."""
    n, B = len(tokens), prefix.block_size
    blocks = prefix.match(tokens, reusable(n, B, tail))
    hit = len(blocks) * B
    step, row, chunked = _workspace(lean, cache, slot, hit)
    alike = not chunked and cut_free(step)
    _write(row, blocks)
    keep = min(max(tail, 1), n)
    kept: dict[int, torch.Tensor] = {}
    for a, b in _spans(hit, n, B, chunked, alike):
        out = step.forward(row, torch.tensor([tokens[a:b]]), last_only=True, capture=capture)
        kept = {i: torch.cat([kept[i], out.hidden[i][0]])[-keep:] if kept else out.hidden[i][0, -keep:]
                for i in capture}
    if chunked:
        copy_positions(row, 0, cache, slot, n)
    cache.lens[slot] = n
    prefix.insert(tokens, n // B * B if alike else final_start(n, B), _read(row))
    return RowPrefill(len(blocks) * B, kept)


@torch.inference_mode()
def prefill_cached(lean, cache: KVCache, slots: list[int], prompts: list[list[int]], prefix: PrefixCache,
                   capture: tuple[int, ...] = (), tail: int = 0):
    """`specloop.drafter.model.kv_cache.prefill_rows` through the prefix cache, with the same result:
    (features [len(slots), hidden] per captured layer, recent [len(slots), tail, hidden] per layer, recent_lens).
    Prompts go one at a time, each into its row of the pool, and count in the cache's stats."""
    got = PromptFeatures.zeros(getattr(lean, "eager", lean), prompts, capture, tail)
    for b, (slot, prompt) in enumerate(zip(slots, prompts)):
        if len(prompt) < 2:
            cache.lens[slot] = 0
            prefix.record(len(prompt), 0)
            continue
        done = prefill_row(lean, cache, slot, prompt[:-1], prefix, capture, tail)
        prefix.record(len(prompt), done.hit)
        got.keep(b, done.hidden)
    return got.parts()


@torch.inference_mode()
def cache_output(lean, cache: KVCache, slot: int, prompt_len: int, history: list[int], prefix: PrefixCache) -> int:
    """A finished request's history (prompt + generated tokens) cached in whole blocks: row `slot` (freed: nothing
    reads it before the next admission) holds the schedule's KV up to its prompt's last pass; the blocks from there
    are prefilled again by the same aligned passes a later prompt extending this history runs (the KV the decode steps
    wrote is not what they compute). Returns the blocks added."""
    B = prefix.block_size
    if cut_free(lean):
        # the row's KV is a prefill's bits up to its length (the history but its last token, at most)
        written = min(int(cache.lens[slot]), len(history) - 1)
        return prefix.insert(history, written // B * B, _read(_row(cache, slot, written)))
    start, end = final_start(max(0, prompt_len - 1), B), len(history) // B * B
    if end <= start:
        return 0
    step, row, chunked = _workspace(lean, cache, slot, start)
    if chunked:  # the scratch pool takes the row's prefilled positions first
        copy_positions(cache, slot, row, 0, start)
    for a, b in prefill_spans(start, end) if chunked else [(a, a + B) for a in range(start, end, B)]:
        step.forward(row, torch.tensor([history[a:b]]), last_only=True)
    return prefix.insert(history, end, _read(row))
