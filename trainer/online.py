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
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from specloop.drafter.kinds.dvi import DraftHead
from specloop.drafter.kinds.eagle import FeatureHead, new_head
from specloop.drafter.kinds.eagle3 import Eagle3Head, new_head3
from specloop.drafter.kinds.sd2 import Steering
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

TRAINABLE_KINDS = ("pretrained", "sd2", "dvi", "eagle", "eagle3")
# (lr, batch_records) of the kinds whose whole drafter arrives trained offline and is fine-tuned: the eagle heads.
# At 1e-3 and 16 records (~32 positions) per update the fetched head drifted on the real pair (klrl: code 0.97x,
# back on chat 0.91x the frozen head); at 2e-4 and 64 it holds chat (0.98x) and gains on code (bench/README.md 17).
# Steering, LoRA heads and small drafters keep (1e-3, 16).
KIND_DEFAULTS = {kind: (1e-3, 16) for kind in TRAINABLE_KINDS} | {"eagle": (2e-4, 64), "eagle3": (2e-4, 64)}


@dataclass
class LearnerConfig:
    kind: str  # serving drafter kind: pretrained | sd2 | dvi | eagle | eagle3
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    lr: float | None = None  # steering / LoRA / head parameters (None: the kind's default, KIND_DEFAULTS)
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
        lr, batch = KIND_DEFAULTS[self.kind]
        self.lr = lr if self.lr is None else self.lr
        self.batch_records = batch if self.batch_records is None else self.batch_records
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
    """The trainable counterpart of a serving drafter (plain directory or trained checkpoint)."""
    from specloop.drafter.kinds.table import drafter_lm_dir, read_checkpoint_kind

    found = None if drafter_dir is None else read_checkpoint_kind(Path(drafter_dir))
    device = verifier.lean.device
    if kind == "dvi":
        head = DraftHead.load(Path(drafter_dir), verifier.hf) if found == "dvi" else None
        if head is None:
            return build_student("dvi", verifier, None, k=1, dvi_layers=2, steer_layers=None,
                                 generator=torch.Generator(), device=device)
        return DVIStudent(head.to(device))
    if kind == "eagle":
        head = FeatureHead.load(Path(drafter_dir)) if found == "eagle" else new_head(verifier.lean)
        return EagleStudent(head.to(device), verifier.lean, depth=1, generator=torch.Generator())
    if kind == "eagle3":
        head = Eagle3Head.load(Path(drafter_dir)) if found == "eagle3" else new_head3(verifier.lean)
        return Eagle3Student(head.to(device), verifier.lean, depth=1, generator=torch.Generator())
    lm_dir = drafter_lm_dir(Path(drafter_dir)) if drafter_dir else None
    method = "distill" if kind == "pretrained" else ("sd2" if train_lm else "sd2-frozen")
    student = build_student(method, verifier, lm_dir, k=1, dvi_layers=2, steer_layers=None,
                            generator=torch.Generator(), device=device)
    if kind == "sd2" and found == "sd2":
        student.steering.load_state_dict(Steering.load(Path(drafter_dir)).state_dict())
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
    )


def lm_inputs(records: list[ReplayRecord]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [R, T] right-padded context + d_1..d_{m−1}, row [N], pos [N]) for LM drafters:
    position j of record r is predicted at index len(context) − 1 + j."""
    seqs = [list(r.context) + list(r.tokens[:-1]) for r in records]
    if any(len(r.context) == 0 for r in records):
        raise ValueError("pretrained / sd2 records need a context window")
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    rows, pos = [], []
    for i, (seq, r) in enumerate(zip(seqs, records)):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        rows += [i] * r.positions
        pos += range(len(r.context) - 1, len(r.context) - 1 + r.positions)
    return ids, torch.tensor(rows), torch.tensor(pos)


def record_logits(student: Student, records: list[ReplayRecord]) -> torch.Tensor:
    """The drafter's logits [N, V] at every logged position, with the student's current weights.
    Right padding needs no mask: causal attention keeps real positions from seeing it."""
    if isinstance(student, DVIStudent):
        hidden = torch.from_numpy(np.concatenate([r.hidden for r in records]))  # [N, d]
        return student.head(hidden.to(student.head.norm.device))
    if isinstance(student, Eagle3Student):  # before its base class
        return eagle3_record_logits(student, records)
    if isinstance(student, EagleStudent):
        return eagle_record_logits(student, records)
    if not isinstance(student, (SteeredStudent, DistillStudent)):
        raise ValueError(f"no record forward for {type(student).__name__}")
    device = student.lm.hf.device
    ids, rows, pos = (t.to(device) for t in lm_inputs(records))
    steering = nullcontext()
    if isinstance(student, SteeredStudent):
        steer = torch.stack([torch.from_numpy(r.steer) for r in records]).to(device)  # [R, 3, d_v]
        steering = student.steered(steer[:, None].expand(-1, ids.shape[1], -1, -1))  # one g per block, every position
    with steering:
        hidden = student.lm.hf.model(input_ids=ids, use_cache=False).last_hidden_state  # [R, T, d]
    return student.lm.hf.lm_head(hidden[rows, pos])  # [N, V]: the LM head only where positions were logged


def eagle_record_logits(student: EagleStudent, records: list[ReplayRecord]) -> torch.Tensor:
    """[N, V]: each record's block drafted again as it was (its feature `steer`, then the token the
    block started from and d_1..d_{m-1}), with the head's current weights."""
    if any(r.steer is None or len(r.context) == 0 for r in records):
        raise ValueError("eagle records need the block's feature (steer) and its first token (context)")
    device = student.head.fc.weight.device
    m = max(r.positions for r in records)
    tokens = torch.zeros(len(records), m, dtype=torch.long)
    for i, r in enumerate(records):
        inputs = [int(r.context[-1])] + [int(t) for t in r.tokens[: r.positions - 1]]
        tokens[i, : len(inputs)] = torch.tensor(inputs)
    start = torch.stack([torch.from_numpy(r.steer[0]) for r in records])  # [R, d]
    logits = student.chain_logits(start.to(device), tokens.to(device))  # [R, m, V]
    return torch.cat([logits[i, : r.positions] for i, r in enumerate(records)])


def eagle3_record_logits(student: Eagle3Student, records: list[ReplayRecord]) -> torch.Tensor:
    """[N, V]: each record's block drafted again from its window (`steer`, one row per `context`
    token, the newest last) through d_1..d_{m-1}, with the head's current weights."""
    if any(r.steer is None or len(r.steer) != len(r.context) or len(r.context) == 0 for r in records):
        raise ValueError("eagle3 records need the block's window: features (steer) and tokens (context), row for row")
    device = student.head.fc.weight.device
    R, W, m = len(records), max(len(r.context) for r in records), max(r.positions for r in records)
    raw = torch.zeros(R, W, records[0].steer.shape[1])
    tokens, valid = torch.zeros(R, W, dtype=torch.long), torch.zeros(R, W, dtype=torch.bool)
    drafted = torch.zeros(R, m - 1, dtype=torch.long)
    for i, r in enumerate(records):
        n = len(r.context)
        raw[i, W - n :], tokens[i, W - n :], valid[i, W - n :] = torch.from_numpy(r.steer), torch.from_numpy(r.context), True
        drafted[i, : r.positions - 1] = torch.from_numpy(r.tokens[: r.positions - 1])
    logits = student.window_logits(raw.to(device), tokens.to(device), valid.to(device), drafted.to(device))
    return torch.cat([logits[i, : r.positions] for i, r in enumerate(records)])


# ----------------------------------------------------------------------------- the learner


class OnlineLearner:
    def __init__(self, cfg: LearnerConfig, student: Student):
        self.cfg, self.student = cfg, student
        self.objective = Objective(cfg.objective)
        self.params = student.trainable()
        self.device = self.params[0][1].device
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for _, p, g in self.params if g == "adapter"], "lr": cfg.lr},
             {"params": [p for _, p, g in self.params if g != "adapter"], "lr": cfg.lm_lr}],
            betas=(0.9, 0.95), weight_decay=0.0)
        self.rng = random.Random(cfg.seed)
        self.window: deque[ReplayRecord] = deque(maxlen=cfg.window)
        self.holdout: deque[ReplayRecord] = deque(maxlen=cfg.holdout_size)
        self.anchor: list[ReplayRecord] = []
        self.seen = 0
        self.updates = 0
        self.stale_skipped = 0  # records used for KL only because a newer version had been published
        self.trained: set[str] = set()  # buffer entries of the records successful updates used (the service clears it)
        self.versions: deque[str] = deque(maxlen=cfg.max_policy_lag + 1)
        self.last_info: dict = {}

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
        return len(self.window) >= self.cfg.batch_records and (self.updates + 1) * self.cfg.batch_records <= budget

    def sample(self) -> list[ReplayRecord]:
        n = self.cfg.batch_records
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

    def update(self) -> dict | None:
        """One optimizer step on a sampled minibatch; None until enough records arrived."""
        if not self.ready():
            return None
        records = self.sample()
        batch = position_batch(records, self.on_policy()).to(self.device)
        self.stale_skipped += sum(1 for r in records if self.versions and r.drafter_version not in self.versions)
        for _, p, _ in self.params:
            p.grad = None
        loss, info = self.objective(batch, record_logits(self.student, records))
        if not torch.isfinite(loss):
            self.last_info = info | {"skipped": "non-finite loss"}
            return self.last_info
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p, _ in self.params], self.cfg.grad_clip)
        self.optimizer.step()
        self.updates += 1
        self.trained.update(r.entry for r in records if r.entry is not None)
        self.last_info = info | {"update": self.updates, "positions": len(batch.tokens)}
        return self.last_info

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

    def stats(self) -> dict:
        return {"updates": self.updates, "records_seen": self.seen, "window": len(self.window),
                "holdout": len(self.holdout), "anchor": len(self.anchor), "stale_skipped": self.stale_skipped,
                "last": self.last_info, "objective": self.objective.state()}


def is_finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point())
