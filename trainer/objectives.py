"""Online objectives on replay records: kl (OSD), klrl (DVI's KL→RL schedule), lk (KL blended into TV).

Per logged position (see `specloop.trainer.records`): p = the verifier's distribution, known as top-K
probabilities plus the remaining mass; q = the drafter's, recomputed with the current weights;
a = the drafted token, r = its reward (1 accepted, 0 the first reject).

Distribution terms compare p and q over K + 1 buckets (the top-K tokens of p, and "the rest"),
which is exact for the top-K and lumps the tail; `specloop.trainer.losses` computes them on bucket
log-probabilities:
- KL(p ‖ q)                      online distillation, every record in the window;
- Σ min(p, q)                    expected acceptance of a sampled draft (the registry's gate
                                 figure for T > 0; for greedy records, argmax agreement).
Policy terms (on-policy drafted records only: drafted by the version the learner last published; an observed
record, from a step left plain, drafted nothing and enters the distribution terms alone):
- reward-masked CE  −mean_{r=1} log q(a)              credit where speculation succeeded;
- REINFORCE         −mean (r − b) log q(a)            b = EMA of rewards (variance reduction);
- entropy bonus     −w_ent H[q]                        optional.

klrl weights over updates t (DVI §3.4): warm-up t < T_warmup: (λ_pg, λ_kl) = (0, λ_0); a linear
ramp over T_ramp to (λ_pg^max, λ_kl^min); then constant.
    loss = λ_kl KL + λ_pg (w_ce CE_masked + w_rl PG) − w_ent H
lk: λ KL + (1 − λ) TV with λ = 1 − α̂, α̂ an EMA of Σ min(p, q) (`specloop.trainer.losses.lk_hybrid`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from specloop.trainer.losses import distribution_loss, expected_acceptance, forward_kl

OBJECTIVES = ("kl", "klrl", "lk")


@dataclass
class ObjectiveConfig:
    name: str = "klrl"  # one of OBJECTIVES
    warmup_updates: int = 50  # T_warmup: updates of KL only before the policy terms start
    ramp_updates: int = 100  # T_ramp: updates over which the policy terms ramp in and KL decays
    kl_weight: float = 1.0  # λ_0: KL weight during warm-up
    kl_weight_min: float = 0.2  # λ_kl^min: KL weight after the ramp (keeps the drafter calibrated)
    pg_weight_max: float = 1.0  # λ_pg^max: weight of the policy terms after the ramp
    ce_weight: float = 1.0  # w_ce: reward-masked cross-entropy on accepted positions
    rl_weight: float = 0.5  # w_rl: REINFORCE with the EMA baseline on accepted + first-rejected positions
    entropy_weight: float = 0.0  # w_ent: entropy bonus (0 = off)
    baseline_decay: float = 0.95  # EMA decay of the reward baseline b
    acceptance_decay: float = 0.95  # EMA decay of α̂ (LK's λ)

    def __post_init__(self):
        if self.name not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.name!r}; choose one of {', '.join(OBJECTIVES)}")
        if self.warmup_updates < 0 or self.ramp_updates < 0:
            raise ValueError("warmup_updates and ramp_updates must be >= 0")


@dataclass
class PositionBatch:
    """N logged positions gathered from a minibatch of records."""

    tokens: torch.Tensor  # [N] int64 drafted tokens a
    rewards: torch.Tensor  # [N] float32 r
    top_ids: torch.Tensor  # [N, K] int64
    top_logprobs: torch.Tensor  # [N, K] float32 log p
    rest_mass: torch.Tensor  # [N] float32
    temperature: torch.Tensor  # [N] float32 (0 = greedy)
    on_policy: torch.Tensor  # [N] bool: drafted by the learner's last published version(s)
    drafted: torch.Tensor  # [N] bool: a drafted token with its reward (False: an observed record's position)

    def to(self, device) -> "PositionBatch":
        return PositionBatch(**{f: getattr(self, f).to(device) for f in self.__dataclass_fields__})


def bucket_logprobs(batch: PositionBatch, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log q) over K + 1 buckets, both [N, K + 1]; q_logits [N, V]."""
    tiny = 1e-12
    log_q = F.log_softmax(q_logits.float(), dim=-1)  # [N, V]
    q_top = log_q.gather(-1, batch.top_ids)  # [N, K]
    q_rest = (1.0 - q_top.exp().sum(dim=-1)).clamp(min=tiny).log()  # [N]
    p_rest = batch.rest_mass.clamp(min=tiny).log()  # [N]
    return torch.cat([batch.top_logprobs, p_rest[:, None]], -1), torch.cat([q_top, q_rest[:, None]], -1)


def policy_logprob(batch: PositionBatch, q_logits: torch.Tensor) -> torch.Tensor:
    """[N] log q(a) under the distribution the drafter samples from (its logits / T; T = 1 when greedy)."""
    t = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    return F.log_softmax(q_logits.float() / t[:, None], dim=-1).gather(-1, batch.tokens[:, None]).squeeze(-1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def klrl_weights(cfg: ObjectiveConfig, t: int) -> tuple[float, float]:
    """(λ_pg, λ_kl) at update t."""
    if t < cfg.warmup_updates:
        return 0.0, cfg.kl_weight
    frac = 1.0 if cfg.ramp_updates == 0 else min(1.0, (t - cfg.warmup_updates) / cfg.ramp_updates)
    return frac * cfg.pg_weight_max, cfg.kl_weight - frac * (cfg.kl_weight - cfg.kl_weight_min)


class Objective:
    """A stateful loss: the update counter, the reward baseline b and the acceptance EMA α̂."""

    def __init__(self, cfg: ObjectiveConfig):
        self.cfg = cfg
        self.updates = 0
        self.baseline: float | None = None
        self.acceptance: float | None = None

    def __call__(self, batch: PositionBatch, q_logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(loss, info) for one update; advances the counter and the EMAs."""
        log_p, log_q = bucket_logprobs(batch, q_logits)
        acc = float(expected_acceptance(log_p, log_q))
        acceptance = _ema(self.acceptance, acc, self.cfg.acceptance_decay)
        info = {"sim_acceptance": acc, "reward": float(_masked_mean(batch.rewards, batch.drafted.float())),
                "observed": int((~batch.drafted).sum())}
        if self.cfg.name == "klrl":
            loss = self._klrl(batch, q_logits, log_p, log_q, info)
        else:
            loss, lam = distribution_loss(self.cfg.name, log_p, log_q, acceptance)
            info["lambda_kl"] = lam
        info["loss"] = float(loss.detach())
        if math.isfinite(info["loss"]) and math.isfinite(acc):  # the learner skips a non-finite step: so do the state's
            self.acceptance = acceptance
            self.baseline = _ema(self.baseline, info["reward"], self.cfg.baseline_decay)
            self.updates += 1
        return loss, info

    def _klrl(self, batch, q_logits, log_p, log_q, info: dict) -> torch.Tensor:
        cfg = self.cfg
        lam_pg, lam_kl = klrl_weights(cfg, self.updates)
        loss = lam_kl * forward_kl(log_p, log_q)
        info.update(lambda_pg=lam_pg, lambda_kl=lam_kl, on_policy=int(batch.on_policy.sum()))
        if lam_pg > 0:
            logp_a = policy_logprob(batch, q_logits)  # [N]
            policy = (batch.on_policy & batch.drafted).float()  # observed positions drafted nothing
            ce = -_masked_mean(logp_a, batch.rewards * policy)
            b = self.baseline if self.baseline is not None else info["reward"]
            pg = -_masked_mean((batch.rewards - b) * logp_a, policy)
            loss = loss + lam_pg * (cfg.ce_weight * ce + cfg.rl_weight * pg)
            info.update(ce=float(ce.detach()), pg=float(pg.detach()), baseline=b)
        if cfg.entropy_weight:
            log_all = F.log_softmax(q_logits.float(), dim=-1)
            entropy = -(log_all.exp() * log_all).sum(-1).mean()
            loss = loss - cfg.entropy_weight * entropy
        return loss

    def state(self) -> dict:
        return {"updates": self.updates, "baseline": self.baseline, "acceptance": self.acceptance,
                "config": asdict(self.cfg)}


@torch.no_grad()
def position_acceptance(batch: PositionBatch, q_logits: torch.Tensor) -> torch.Tensor:
    """Per position [N], the probability that the drafter's token would be accepted, as the request
    was served: Σ min(p, q) on the K + 1 buckets when it sampled (T > 0); at T = 0, whether the
    drafter's argmax equals the verifier's (greedy acceptance is exactly that)."""
    log_p, log_q = bucket_logprobs(batch, q_logits)
    sampled = torch.minimum(log_p.exp(), log_q.exp()).sum(dim=-1)  # [N]
    greedy = (q_logits.argmax(dim=-1) == batch.top_ids[:, 0]).float()  # [N]
    return torch.where(batch.temperature > 0, sampled, greedy)


def simulated_acceptance(batch: PositionBatch, q_logits: torch.Tensor) -> float:
    """`position_acceptance` averaged over the positions."""
    return float(position_acceptance(batch, q_logits).mean())


def _ema(old: float | None, new: float, decay: float) -> float:
    return new if old is None else decay * old + (1.0 - decay) * new
