"""The online learner: trains the serving drafter kind from replay records (no processes here;
`specloop.services.learner.learner` runs it against the replay buffer and the registry).

Records flow in with `ingest()`. Every `holdout_every`-th record is held out (the most recent
`holdout_size` of them measure simulated acceptance for the registry's gate); the rest enter a
bounded window of recent records and a reservoir sample over everything seen (the anchor: a slice
of older traffic blended into each minibatch against forgetting, ATLAS-style). `update()` samples
a minibatch of records, recomputes the drafter's logits at their logged positions with the
current weights (`record_logits`), and takes one optimizer step on the objective
(`specloop.trainer.objectives`). `weights()` is what a published version holds, named as the student's
trainable parameters ("lm.*", "steering.*", "head.*").

Policy terms use only on-policy records: drafted by one of the last `max_policy_lag + 1` versions
this learner published (`published()`); the others still feed KL. Records skipped as stale for
the policy terms are counted.
"""
from __future__ import annotations

import random
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from specloop.drafter.kinds.dvi import DraftHead
from specloop.drafter.kinds.eagle import FeatureHead
from specloop.drafter.kinds.eagle3 import Eagle3Head
from specloop.drafter.kinds.table import KINDS, TRAINABLE_KINDS, KindSpec, drafter_lm_dir, read_checkpoint_kind
from specloop.drafter.model.loading import LoadedModel
from specloop.trainer.objectives import Objective, ObjectiveConfig, PositionBatch, position_acceptance
from specloop.trainer.records import ReplayRecord
from specloop.trainer.students import (
    DistillStudent,
    DVIStudent,
    Eagle3Student,
    EagleStudent,
    SteeredStudent,
    Student,
    build_student,
)


@dataclass
class LearnerConfig:
    kind: str  # serving drafter kind: one of TRAINABLE_KINDS (specloop.drafter.kinds.table)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    lr: float | None = None  # steering / LoRA / head parameters (None: the kind's default, its KINDS row)
    lm_lr: float = 1e-4  # drafter LM parameters (pretrained, sd2)
    batch_records: int | None = None  # records (blocks) per update (None: the kind's default)
    window: int = 2048  # recent records kept to sample minibatches from
    anchor_size: int = 512  # reservoir over all records seen (older traffic)
    anchor_fraction: float = 0.25  # share of each minibatch drawn from the anchor reservoir
    holdout_every: int = 8  # every n-th record is held out for simulated acceptance
    holdout_size: int = 256  # most recent held-out records kept
    publish_every: int = 20  # updates between published versions
    max_policy_lag: int = 0  # policy terms use records of the last (lag + 1) published versions
    replay_ratio: float = 4.0  # updates wait until updates × batch_records <= ratio × records seen
    grad_clip: float = 0.5  # global gradient-norm clip
    train_lm: bool = True  # sd2: train the drafter LM with the steering (False: steering only)
    seed: int = 0

    def __post_init__(self):
        if self.kind not in TRAINABLE_KINDS:
            raise ValueError(f"the learner trains {', '.join(TRAINABLE_KINDS)} drafters, not {self.kind!r}")
        spec = KINDS[self.kind]
        self.lr = spec.lr if self.lr is None else self.lr
        self.batch_records = spec.batch if self.batch_records is None else self.batch_records
        if self.batch_records < 1 or self.window < self.batch_records or self.publish_every < 1:
            raise ValueError("need batch_records >= 1, window >= batch_records and publish_every >= 1")
        if not 0.0 <= self.anchor_fraction < 1.0 or self.holdout_every < 2:
            raise ValueError("need 0 <= anchor_fraction < 1 and holdout_every >= 2")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LearnerConfig":
        return cls(**(d | {"objective": ObjectiveConfig(**d.get("objective", {}))}))


def serving_student(kind: str, verifier: LoadedModel, drafter_dir: str | Path | None, train_lm: bool = True) -> Student:
    """The trainable counterpart of a serving drafter (plain directory or trained checkpoint): the student of
    its kind's training method, with the checkpoint's part (steering or head) where it holds this kind."""
    spec = KINDS[kind]
    if not spec.trainable:
        raise ValueError(f"the learner trains {', '.join(TRAINABLE_KINDS)} drafters, not {kind!r}")
    assert spec.method is not None  # trainable
    found = None if drafter_dir is None else read_checkpoint_kind(Path(drafter_dir))
    return TRAINING[spec.method].student(spec, verifier, drafter_dir, found == kind, train_lm)


FROZEN_LM = {"sd2": "sd2-frozen"}  # method -> the one that keeps the drafter LM frozen (LearnerConfig.train_lm)


def lm_student(spec: KindSpec, verifier: LoadedModel, drafter_dir: str | Path | None, trained: bool,
               train_lm: bool) -> Student:
    """A drafter LM's student (steered where its kind has steering, the checkpoint's when `trained`)."""
    lm_dir = drafter_lm_dir(Path(drafter_dir)) if drafter_dir else None
    assert spec.method is not None  # a trainable kind (TRAINING is keyed by its method)
    method = spec.method if train_lm else FROZEN_LM.get(spec.method, spec.method)
    student = build_student(method, verifier, lm_dir, k=1, dvi_layers=2, steer_layers=None,
                            generator=torch.Generator(), device=verifier.lean.device)
    if trained and spec.part == "steering":
        # a steering kind trains a SteeredStudent (sd2 / sd2-frozen), and a part comes with its loader
        assert isinstance(student, SteeredStudent) and spec.load_part is not None
        student.steering.load_state_dict(spec.load_part(verifier, None, drafter_dir, True).state_dict())
    return student


def head_student(wrap: Callable[[torch.nn.Module, LoadedModel], Student]):
    """A student builder around its kind's head on the verifier (the checkpoint's when `trained`, else a
    fresh one, as the serving drafter's builder makes it), `wrap`ped in the method's student."""
    def student(spec: KindSpec, verifier: LoadedModel, drafter_dir: str | Path | None, trained: bool,
                train_lm: bool) -> Student:
        assert spec.load_part is not None  # a head kind: its part comes with a loader
        return wrap(spec.load_part(verifier, None, drafter_dir, trained).to(verifier.lean.device), verifier)
    return student


# ----------------------------------------------------------------------------- record batches


def position_batch(records: list[ReplayRecord], on_policy: set[str] | None) -> PositionBatch:
    """Concatenate the records' positions; on_policy=None marks every position on-policy."""
    def cat(name: str) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([getattr(r, name) for r in records]))

    flags = [on_policy is None or r.drafter_version in on_policy for r in records]
    return PositionBatch(
        tokens=cat("tokens"), rewards=cat("rewards").float(), top_ids=cat("top_ids"),
        top_logprobs=cat("top_logprobs"), rest_mass=cat("rest_mass"),
        temperature=torch.tensor([r.temperature for r in records for _ in range(r.positions)], dtype=torch.float32),
        on_policy=torch.tensor([f for r, f in zip(records, flags) for _ in range(r.positions)]),
        drafted=torch.tensor([not r.observed for r in records for _ in range(r.positions)]),
    )


def lm_inputs(records: list[ReplayRecord]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [R, T] right-padded context + d_1..d_{m−1}, row [N], pos [N]) for LM drafters:
    position j of record r is predicted at index len(context) − 1 + j."""
    seqs = [list(r.context) + list(r.tokens[:-1]) for r in records]
    if any(len(r.context) == 0 for r in records):
        raise ValueError("pretrained / sd2 records need a context window")
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    rows: list[int] = []
    pos: list[int] = []
    for i, (seq, r) in enumerate(zip(seqs, records)):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        rows += [i] * r.positions
        pos += range(len(r.context) - 1, len(r.context) - 1 + r.positions)
    return ids, torch.tensor(rows), torch.tensor(pos)


def record_logits(student: Student, records: list[ReplayRecord]) -> torch.Tensor:
    """The drafter's logits [N, V] at every logged position, with the student's current weights: the forward
    of the training method of the student's kind (its KINDS row)."""
    spec = KINDS.get(getattr(student, "kind", ""))  # "": no kind, no spec
    if spec is None or not spec.trainable:
        raise ValueError(f"no record forward for {type(student).__name__}")
    assert spec.method is not None  # trainable
    return TRAINING[spec.method].record_logits(student, records)


def dvi_record_logits(student: DVIStudent, records: list[ReplayRecord]) -> torch.Tensor:
    """[N, V]: the head on the verifier's logged residual streams (`hidden`)."""
    hidden = torch.from_numpy(np.concatenate([r.hidden for r in records]))  # [N, d]
    return student.head(hidden.to(student.head.norm.device))


def lm_record_logits(student: DistillStudent | SteeredStudent, records: list[ReplayRecord],
                     steered: bool = False) -> torch.Tensor:
    """[N, V]: the drafter LM run again on each record's context + d_1..d_{m-1} (steered by the record's
    `steer` when `steered`). Right padding needs no mask: causal attention keeps real positions from seeing it."""
    device = student.lm.hf.device
    ids, rows, pos = (t.to(device) for t in lm_inputs(records))
    steering: AbstractContextManager[Any] = nullcontext()
    if steered:
        assert isinstance(student, SteeredStudent)  # only sd2 records are steered
        steer = torch.stack([torch.from_numpy(r.steer) for r in records]).to(device)  # [R, 3, d_v]
        steering = student.steered(steer[:, None].expand(-1, ids.shape[1], -1, -1))  # one g per block, every position
    with steering:
        hidden = student.lm.hf.model(input_ids=ids, use_cache=False).last_hidden_state  # [R, T, d]
    return student.lm.hf.lm_head(hidden[rows, pos])  # [N, V]: the LM head only where positions were logged


def steered_record_logits(student: SteeredStudent, records: list[ReplayRecord]) -> torch.Tensor:
    return lm_record_logits(student, records, steered=True)


def _steer(r: ReplayRecord) -> np.ndarray:
    """A record's `steer`, which the caller checked is there."""
    assert r.steer is not None
    return r.steer


def eagle_record_logits(student: EagleStudent, records: list[ReplayRecord]) -> torch.Tensor:
    """[N, V]: each record's block drafted again as it was (its feature `steer`, then the token the
    block started from and d_1..d_{m-1}), with the head's current weights."""
    device = student.head.fc.weight.device
    start, tokens = eagle_blocks(records)
    features = student.chain_features(start.to(device), tokens.to(device))  # [R, m, d]
    return student.head.logits(logged(features, records), student.lm_head)  # the LM head at logged positions only


def eagle_blocks(records: list[ReplayRecord]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each record's block as the eagle head drafted it: its feature `steer` [R, d] and the inputs of its drafts
    [R, m] (the token the block started from, then d_1..d_{m-1}; right-padded with 0)."""
    if any(r.steer is None or len(r.context) == 0 for r in records):
        raise ValueError("eagle records need the block's feature (steer) and its first token (context)")
    tokens = torch.zeros(len(records), max(r.positions for r in records), dtype=torch.long)
    for i, r in enumerate(records):
        inputs = [int(r.context[-1])] + [int(t) for t in r.tokens[: r.positions - 1]]
        tokens[i, : len(inputs)] = torch.tensor(inputs)
    return torch.stack([torch.from_numpy(_steer(r)[0]) for r in records]), tokens


def logged(per_block: torch.Tensor, records: list[ReplayRecord]) -> torch.Tensor:
    """[R, m, ...] → [N, ...]: each record's first `positions` entries, record by record, in one gather (its
    backward writes one gradient of the input's size; a slice a record would write one each: 64 records x
    [R, m, V] zero-filled floats, 4 GB an update on the real pair)."""
    rows = torch.repeat_interleave(torch.arange(len(records)), torch.tensor([r.positions for r in records]))
    pos = torch.cat([torch.arange(r.positions) for r in records])
    return per_block[rows.to(per_block.device), pos.to(per_block.device)]


def eagle3_record_logits(student: Eagle3Student, records: list[ReplayRecord]) -> torch.Tensor:
    """[N, V]: each record's block drafted again from its window (`steer`, one row per `context`
    token, the newest last) through d_1..d_{m-1}, with the head's current weights."""
    if any(r.steer is None or len(r.steer) != len(r.context) or len(r.context) == 0 for r in records):
        raise ValueError("eagle3 records need the block's window: features (steer) and tokens (context), row for row")
    device = student.head.fc.weight.device
    R, W, m = len(records), max(len(r.context) for r in records), max(r.positions for r in records)
    raw = torch.zeros(R, W, _steer(records[0]).shape[1])
    tokens, valid = torch.zeros(R, W, dtype=torch.long), torch.zeros(R, W, dtype=torch.bool)
    drafted = torch.zeros(R, m - 1, dtype=torch.long)
    for i, r in enumerate(records):
        n = len(r.context)
        raw[i, W - n :], tokens[i, W - n :], valid[i, W - n :] = (
            torch.from_numpy(_steer(r)), torch.from_numpy(r.context), True)
        drafted[i, : r.positions - 1] = torch.from_numpy(r.tokens[: r.positions - 1])
    logits = student.window_logits(raw.to(device), tokens.to(device), valid.to(device), drafted.to(device))
    return logged(logits, records)  # [N, V]


@dataclass(frozen=True)
class Training:
    """The learner's code for a training method (KindSpec.method): its student built from the serving
    drafter's directory, and its forward at a record's logged positions."""

    student: Callable[[KindSpec, LoadedModel, str | Path | None, bool, bool], Student]
    record_logits: Callable[[Any, list[ReplayRecord]], torch.Tensor]  # takes its method's Student subclass


def _dvi(head: torch.nn.Module, verifier: LoadedModel) -> Student:
    assert isinstance(head, DraftHead)  # the dvi kind's load_part
    return DVIStudent(head)


def _eagle(head: torch.nn.Module, verifier: LoadedModel) -> Student:
    assert isinstance(head, FeatureHead)  # the eagle kind's load_part
    return EagleStudent(head, verifier.lean, depth=1, generator=torch.Generator())


def _eagle3(head: torch.nn.Module, verifier: LoadedModel) -> Student:
    assert isinstance(head, Eagle3Head)  # the eagle3 kind's load_part
    return Eagle3Student(head, verifier.lean, depth=1, generator=torch.Generator())


TRAINING = {  # KindSpec.method -> its code here
    "distill": Training(lm_student, lm_record_logits),
    "sd2": Training(lm_student, steered_record_logits),
    "dvi": Training(head_student(_dvi), dvi_record_logits),
    "eagle": Training(head_student(_eagle), eagle_record_logits),
    "eagle3": Training(head_student(_eagle3), eagle3_record_logits),
}


# ----------------------------------------------------------------------------- the learner


@dataclass(frozen=True)
class Update:
    """What one `OnlineLearner.update()` did: the objective's loss and terms on a minibatch of `positions`
    positions; `step` (the learner's update count after it) when the optimizer stepped, `skipped` (why
    not: "non-finite loss") when it did not (nothing changed then)."""

    loss: float
    terms: dict[str, float]  # the objective's info (`Objective.__call__`): sim_acceptance, reward, λs, loss, ...
    positions: int
    step: int | None = None
    skipped: str | None = None

    @property
    def stepped(self) -> bool:
        return self.skipped is None


@dataclass(frozen=True)
class LearnerStats:
    updates: int
    records_seen: int
    window: int  # records in the recent window
    holdout: int  # held-out records kept
    anchor: int  # records in the anchor reservoir
    stale_skipped: int  # records used for KL only (a newer version had been published)
    last: Update | None  # the last update (None before the first)
    objective: dict  # `Objective.state()`


class OnlineLearner:
    def __init__(self, cfg: LearnerConfig, student: Student):
        self.cfg, self.student = cfg, student
        self.objective = Objective(cfg.objective)
        self.params = student.trainable()
        self.device = self.params[0][1].device
        groups: list[dict[str, Any]] = [
            {"params": [p for _, p, g in self.params if g == "adapter"], "lr": cfg.lr},
            {"params": [p for _, p, g in self.params if g != "adapter"], "lr": cfg.lm_lr}]
        self.optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)
        self.rng = random.Random(cfg.seed)
        self.window: deque[ReplayRecord] = deque(maxlen=cfg.window)
        self.holdout: deque[ReplayRecord] = deque(maxlen=cfg.holdout_size)
        self.anchor: list[ReplayRecord] = []
        self.seen = 0
        self.updates = 0
        self.stale_skipped = 0  # records used for KL only because a newer version had been published
        self.trained: set[str] = set()  # buffer entries of the records successful updates used (the service clears it)
        self.versions: deque[str] = deque(maxlen=cfg.max_policy_lag + 1)
        self.last: Update | None = None

    # -- data

    def ingest(self, records: list[ReplayRecord]) -> None:
        for r in records:
            if r.kind != self.cfg.kind:
                continue
            self.seen += 1
            if self.seen % self.cfg.holdout_every == 0:
                self.holdout.append(r)
                continue
            self.window.append(r)
            if len(self.anchor) < self.cfg.anchor_size:
                self.anchor.append(r)
            elif (j := self.rng.randrange(self.seen)) < self.cfg.anchor_size:
                self.anchor[j] = r

    def ready(self) -> bool:
        """Enough records for a minibatch, and each record used about `replay_ratio` times at most."""
        budget = self.cfg.replay_ratio * self.seen
        assert self.cfg.batch_records is not None  # set by LearnerConfig.__post_init__
        return len(self.window) >= self.cfg.batch_records and (self.updates + 1) * self.cfg.batch_records <= budget

    def sample(self) -> list[ReplayRecord]:
        n = self.cfg.batch_records
        assert n is not None  # set by LearnerConfig.__post_init__
        n_anchor = min(len(self.anchor), int(round(n * self.cfg.anchor_fraction)))
        recent = list(self.window)[-self.cfg.window:]
        return self.rng.sample(recent, min(n - n_anchor, len(recent))) + self.rng.sample(self.anchor, n_anchor)

    # -- versions

    def published(self, version: str) -> None:
        """A version with the current weights now serves (or may): its records are on-policy."""
        self.versions.append(version)

    def on_policy(self) -> set[str] | None:
        return set(self.versions) if self.versions else None

    # -- training

    def update(self) -> Update | None:
        """One optimizer step on a sampled minibatch (none on a non-finite loss: `Update.skipped`); None
        until enough records arrived."""
        if not self.ready():
            return None
        records = self.sample()
        batch = position_batch(records, self.on_policy()).to(self.device)
        self.stale_skipped += sum(1 for r in records if self.versions and r.drafter_version not in self.versions)
        for _, p, _ in self.params:
            p.grad = None
        loss, info = self.objective(batch, record_logits(self.student, records))
        if not torch.isfinite(loss):
            self.last = Update(info["loss"], info, len(batch.tokens), skipped="non-finite loss")
            return self.last
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p, _ in self.params], self.cfg.grad_clip)
        self.optimizer.step()
        self.updates += 1
        self.trained.update(r.entry for r in records if r.entry is not None)
        self.last = Update(info["loss"], info, len(batch.tokens), step=self.updates)
        return self.last

    def in_pools(self) -> set[str]:
        """Buffer entries of the records an update may still sample."""
        return {r.entry for pool in (self.window, self.anchor) for r in pool if r.entry is not None}

    def should_publish(self) -> bool:
        return self.updates > 0 and self.updates % self.cfg.publish_every == 0

    @torch.no_grad()
    def evaluate(self, weights: dict[str, torch.Tensor] | None = None) -> float | None:
        """Simulated acceptance on the held-out records (averaged over their positions), with the
        current weights or `weights`."""
        records = list(self.holdout)
        if not records:
            return None
        by_position = torch.cat([torch.tensor(a) for a in self.acceptance_by_record(records, weights)])
        return float(by_position.mean())

    @torch.no_grad()
    def acceptance_by_record(self, records: list[ReplayRecord],
                             weights: dict[str, torch.Tensor] | None = None) -> list[list[float]]:
        """Each record's per-position simulated acceptance (`position_acceptance`), with the current
        weights or `weights` (the current ones are restored after)."""
        current = None if weights is None else self.weights()
        if weights is not None:
            self.load_weights(weights)
        try:
            batch = position_batch(records, None).to(self.device)
            accepted = position_acceptance(batch, record_logits(self.student, records)).cpu()
        finally:
            if current is not None:
                self.load_weights(current)
        return [part.tolist() for part in torch.split(accepted, [r.positions for r in records])]

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone().cpu() for n, p, _ in self.params}

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy named tensors into the trainable parameters (names this student does not train are ignored)."""
        for n, p, _ in self.params:
            if n in weights:
                p.copy_(weights[n].to(p.device, p.dtype))

    def stats(self) -> LearnerStats:
        return LearnerStats(updates=self.updates, records_seen=self.seen, window=len(self.window),
                            holdout=len(self.holdout), anchor=len(self.anchor), stale_skipped=self.stale_skipped,
                            last=self.last, objective=self.objective.state())


def is_finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point())
