"""Replay records: one speculative block's drafted positions, as the learner needs them.

A record holds the positions i = 1..m of one block up to and including the first rejection
(m = n + 1 when a draft was rejected, m = k when all k were accepted); later positions are
counterfactual and never logged. Per position: the drafted token d_i, the reward (1 accepted,
0 the first reject), the drafter's log q(d_i), and the verifier's next-token distribution p_i as
its top-K log-probabilities plus the remaining mass. Plus what the drafter kind needs to
recompute its forward on the learner:

- pretrained / sd2: `context`, the last W committed tokens (ending with the token the block
  started from), so the drafter LM can be run on context + d_1..d_{m-1};
- sd2: `steer` [3, d_verifier], the verifier features the block's steering vector came from;
- eagle: `steer` [1, d_verifier], the verifier feature the block was drafted from, and `context`,
  the token the block started from;
- dvi: `hidden` [m, d], the verifier's residual stream after layer s at the positions that
  predict d_1..d_m (the draft head's input).

(Per kind: `record_context` and `steer_rows` of its row in specloop.drafter.kinds.table.KINDS.)

An observed record (k = 0) comes from a step the controller left plain (kinds whose records need nothing
drafted: `KindSpec.observable`): one position, the verifier's distribution after the block's first input,
which is what the drafter's first draft would have been judged against; `tokens` holds the token the
verifier emitted there, `rewards` [0] and `draft_logprobs` [0] (nothing was drafted: the learner's policy
terms skip it, its distillation term does not). The learner keeps learning where the controller has
turned drafting off.

Wire format (`encode` / `decode`): the magic b"SLRC", then a safetensors blob (numpy arrays;
scalar fields in its string metadata, with the schema version). Decoding validates the magic,
the schema, every array's dtype and shape, and the reward pattern; anything else raises
RecordError. Nothing is ever pickled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from specloop.drafter.kinds.table import KINDS, RecordContext

MAGIC = b"SLRC"
SCHEMA = 1
DEFAULT_TOP_K = 64  # verifier log-probabilities kept per position
DEFAULT_CONTEXT = 128  # committed tokens kept for pretrained / sd2 recompute


class RecordError(ValueError):
    """A payload that is not a valid replay record (corrupted, truncated, wrong schema)."""


@dataclass
class ReplayRecord:
    request_id: str
    drafter_version: str
    block: int  # block index within the request
    kind: str  # drafter kind that drafted it
    k: int  # draft length of the block (0: an observed record, a step left plain)
    temperature: float  # sampling temperature of the request (0 = greedy)
    tokens: np.ndarray  # [m] int64 drafted tokens d_1..d_m
    rewards: np.ndarray  # [m] uint8: 1 accepted, 0 first reject (only ever last)
    draft_logprobs: np.ndarray  # [m] float32 log q(d_i)
    top_ids: np.ndarray  # [m, K] int64 verifier top-K token ids at position i
    top_logprobs: np.ndarray  # [m, K] float32 their log p (temperature 1)
    rest_mass: np.ndarray  # [m] float32 1 − Σ top-K p
    context: np.ndarray  # [W] int64 committed tokens ending with the block's first input (may be empty)
    steer: np.ndarray | None = None  # [3, d_verifier] float32 (sd2)
    hidden: np.ndarray | None = None  # [m, d] float32 (dvi)
    entry: str | None = None  # the buffer entry it was read from (set by the learner service; never encoded)

    @property
    def positions(self) -> int:
        return len(self.tokens)

    @property
    def accepted(self) -> int:
        return int(self.rewards.sum())

    @property
    def observed(self) -> bool:
        """Made on a step left plain: nothing was drafted (k = 0)."""
        return self.k == 0


ARRAYS = {  # name -> (dtype, rank)
    "tokens": (np.int64, 1), "rewards": (np.uint8, 1), "draft_logprobs": (np.float32, 1),
    "top_ids": (np.int64, 2), "top_logprobs": (np.float32, 2), "rest_mass": (np.float32, 1),
    "context": (np.int64, 1), "steer": (np.float32, 2), "hidden": (np.float32, 2),
}
OPTIONAL = ("steer", "hidden")
SCALARS = {"request_id": str, "drafter_version": str, "block": int, "kind": str, "k": int, "temperature": float}


def encode(record: ReplayRecord) -> bytes:
    """Record → bytes (MAGIC + safetensors)."""
    arrays = {}
    for name, (dtype, _) in ARRAYS.items():
        value = getattr(record, name)
        if value is not None:
            arrays[name] = np.ascontiguousarray(value, dtype=dtype)
    meta = {"schema": str(SCHEMA), "fields": json.dumps({n: getattr(record, n) for n in SCALARS})}
    return MAGIC + st_save(arrays, metadata=meta)


def decode(payload: bytes) -> ReplayRecord:
    """bytes → record, validated; RecordError on anything malformed."""
    if not isinstance(payload, (bytes, bytearray, memoryview)) or bytes(payload[:4]) != MAGIC:
        raise RecordError("not a replay record (bad magic)")
    body = bytes(payload[4:])
    try:
        arrays = st_load(body)
        meta = _metadata(body)
    except (SafetensorError, ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"corrupted or truncated replay record: {exc}") from exc
    if meta.get("schema") != str(SCHEMA):
        raise RecordError(f"replay record schema {meta.get('schema')!r}, expected {SCHEMA}")
    record = ReplayRecord(**_scalars(meta), **_arrays(arrays))
    validate(record)
    return record


def _metadata(body: bytes) -> dict:
    """The safetensors header's __metadata__ (the numpy loader drops it)."""
    n = int.from_bytes(body[:8], "little")
    if n <= 0 or 8 + n > len(body):
        raise ValueError("header length out of range")
    return json.loads(body[8 : 8 + n].decode("utf-8")).get("__metadata__") or {}


def _scalars(meta: dict) -> dict:
    try:
        fields = json.loads(meta["fields"])
        return {name: cast(fields[name]) for name, cast in SCALARS.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"replay record metadata is incomplete: {exc}") from exc


def _arrays(arrays: dict) -> dict:
    out: dict[str, np.ndarray | None] = {}
    for name, (dtype, rank) in ARRAYS.items():
        value = arrays.get(name)
        if value is None:
            if name not in OPTIONAL:
                raise RecordError(f"replay record lacks {name!r}")
            out[name] = None
            continue
        if value.dtype != dtype or value.ndim != rank:
            raise RecordError(f"replay record field {name!r} is {value.dtype}[{value.ndim}-d], "
                              f"expected {np.dtype(dtype)}[{rank}-d]")
        out[name] = value
    return out


def steer_rows(kind: str) -> int | None:
    """The verifier feature rows a block of `kind` was drafted from (None: one per context token kept, its
    window; 0: none, also for a kind the table lacks, so that a stray record's `steer` is refused)."""
    return KINDS[kind].steer_rows if kind in KINDS else 0


def validate(r: ReplayRecord) -> None:
    """Shapes agree and rewards are 1…1 then at most one 0 at the end."""
    m = r.positions
    if not 1 <= m <= max(r.k, 1) or r.k < 0:
        raise RecordError(f"replay record has {m} positions for k={r.k}")
    if r.observed and r.rewards[0] != 0:
        raise RecordError("an observed record (k = 0) drafted nothing: its reward is 0")
    same = [r.rewards, r.draft_logprobs, r.rest_mass, r.top_ids, r.top_logprobs]
    if any(len(a) != m for a in same) or r.top_ids.shape != r.top_logprobs.shape:
        raise RecordError("replay record arrays disagree on the number of positions")
    if (r.rewards[:-1] != 1).any() or r.rewards[-1] > 1:
        raise RecordError("replay record rewards must be 1…1 with at most one final 0")
    if m < r.k and r.rewards[-1] != 0:
        raise RecordError("a record shorter than k must end with its first rejection")
    if r.hidden is not None and len(r.hidden) != m:
        raise RecordError("replay record hidden states do not match its positions")
    if r.steer is None:
        return
    rows = steer_rows(r.kind)
    rows = len(r.context) if rows is None else rows
    if not rows or r.steer.ndim != 2 or r.steer.shape[0] != rows:
        raise RecordError(f"replay record steering inputs of a {r.kind!r} drafter must be "
                          f"[{rows or 'none'}, d], not {list(r.steer.shape)}")


# ----------------------------------------------------------------------------- building records


@dataclass
class BlockSnapshot:
    """One step's loggable tensors for the rows being logged, taken on the serving thread (cheap:
    a log-softmax and a top-K over k + 1 positions); records are built from it off that thread."""

    rows: list[int]  # batch rows this snapshot covers
    num_accepted: list[int]  # [R] n per row
    k: int  # 0: a step left plain, observed
    tokens: np.ndarray  # [R, k] drafted tokens (observed: [R, 1] the verifier's own)
    draft_logprobs: np.ndarray  # [R, k]
    top_ids: np.ndarray  # [R, m, K] verifier top-K at positions predicting d_1..d_m, m = max(n + 1) ≤ k
    top_logprobs: np.ndarray  # [R, m, K]
    rest_mass: np.ndarray  # [R, m]
    steer: np.ndarray | None  # [R, 3, d_v]
    hidden: np.ndarray | None  # [R, k, d]


@torch.inference_mode()
def snapshot(trace, rows: list[int], top_k: int = DEFAULT_TOP_K, k: int | None = None) -> BlockSnapshot:
    """Extract what records need from a `specloop.drafter.decode.speculative.StepTrace`, for `rows`, all drafted with
    k tokens (default: the step's; less when rows of a continuous batch differ in k). Only the first
    max(n + 1) positions are ever logged, so the verifier's top-K is taken over those alone."""
    idx = torch.tensor(rows, dtype=torch.long)
    k = k or trace.proposal.tokens.shape[1]
    n = trace.outcome.num_accepted[idx]
    m = min(k, int(n.max()) + 1) if k else 1  # a step left plain (k = 0): its one position, observed
    logp = torch.log_softmax(trace.logits[idx.to(trace.logits.device), :m].float(), dim=-1)  # [R, m, V]
    top = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    rest = (1.0 - top.values.exp().sum(dim=-1)).clamp(min=0.0)  # [R, k]
    prop = trace.proposal
    hidden = next(iter(trace.hidden.values()), None)
    if k:
        tokens, logprobs = prop.tokens[idx, :k].cpu().numpy(), prop.logprobs()[idx, :k].float().cpu().numpy()
    else:  # observed: the token the verifier emitted, nothing drafted
        tokens, logprobs = trace.outcome.tokens[idx, :1].cpu().numpy(), np.zeros((len(rows), 1), np.float32)
    return BlockSnapshot(
        rows=rows, num_accepted=n.tolist(), k=k, tokens=tokens, draft_logprobs=logprobs,
        top_ids=top.indices.cpu().numpy(), top_logprobs=top.values.cpu().numpy(), rest_mass=rest.cpu().numpy(),
        steer=None if prop.steer is None else prop.steer[idx.to(prop.steer.device)].float().cpu().numpy(),
        hidden=None if hidden is None else hidden[idx.to(hidden.device), :k].float().cpu().numpy(),
    )


@dataclass
class RowTag:
    """Who a logged row is: its request, the serving version, its block index, its context."""

    request_id: str
    drafter_version: str
    block: int
    context: list[int]  # committed tokens (already cut to the context window)
    temperature: float


# KindSpec.record_context -> (context, window) -> what a record keeps: all of it (the drafter LMs run it again),
# the block's first token (the eagle head), the tokens of the eagle3 head's window of `window` positions (one per
# committed token but the first), or nothing
CONTEXT_RULES: dict[RecordContext, Callable[[list[int], int], list[int]]] = {
    "all": lambda context, window: context,
    "last": lambda context, window: context[-1:],
    "window": lambda context, window: context[-max(1, min(window, len(context) - 1)):],
    "none": lambda context, window: [],
}


def record_context(kind: str, context: list[int], window: int = 1) -> list[int]:
    """What of a row's context window a record of `kind` keeps (its `record_context` rule; nothing for a
    kind the table lacks)."""
    return CONTEXT_RULES[KINDS[kind].record_context if kind in KINDS else "none"](context, window)


def records_from_snapshot(snap: BlockSnapshot, tags: list[RowTag], kind: str) -> list[ReplayRecord]:
    """One record per row: positions 1..min(n + 1, k) (an observed step's: its one position)."""
    out, rows = [], 1 if snap.steer is None else snap.steer.shape[1]
    by_context = steer_rows(kind) is None  # its steering rows follow the context kept: trimmed with it
    for j, (n, tag) in enumerate(zip(snap.num_accepted, tags)):
        m = min(n + 1, snap.k) if snap.k else 1  # observed (k = 0): one position, nothing drafted
        rewards = np.ones(m, dtype=np.uint8)
        if n < snap.k or not snap.k:
            rewards[-1] = 0
        out.append(ReplayRecord(
            request_id=tag.request_id, drafter_version=tag.drafter_version, block=tag.block, kind=kind,
            k=snap.k, temperature=tag.temperature, tokens=snap.tokens[j, :m].astype(np.int64), rewards=rewards,
            draft_logprobs=snap.draft_logprobs[j, :m], top_ids=snap.top_ids[j, :m].astype(np.int64),
            top_logprobs=snap.top_logprobs[j, :m], rest_mass=snap.rest_mass[j, :m],
            context=np.asarray(ctx := record_context(kind, tag.context, rows), dtype=np.int64),
            steer=None if snap.steer is None else snap.steer[j][-len(ctx) if by_context else 0:],
            hidden=None if snap.hidden is None else snap.hidden[j, :m],
        ))
    return out
