"""Speculative decoding: one `speculative_step` (draft → verify → accept) and the loop around it.

With k = 0 and no drafter the same step is plain verifier decoding (one token per pass), which is
how `--no-speculation`, the reference, runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from drafter.controller import Controller
from drafter.decoder import KVCache, LeanDecoder, prefill
from drafter.logprobs import Scoring, TokenScore
from drafter.proposer import Drafter, Proposal, VerifierView, emitted_tokens
from drafter.rejection import BlockOutcome, greedy_accept, rejection_sample
from drafter.sampling import RowParams, SamplingParams, warp

Sampler = Callable[..., BlockOutcome]


@dataclass
class StepTrace:
    """What one speculative step had in hand, for replay logging: nothing here is computed extra
    except the residual streams of `drafter.record_layers`, captured in the verify pass."""

    proposal: Proposal  # drafted tokens [B, k], their log q [B, k], SD² steering inputs
    logits: torch.Tensor  # [B, k+1, V] the verifier's raw logits at `last` and each draft
    hidden: dict[int, torch.Tensor]  # record layer -> [B, k+1, d] residual streams at the same positions
    outcome: BlockOutcome
    active: torch.Tensor  # [B] bool: rows this step decoded
    limit: torch.Tensor | None = None  # [B] each row's own k when rows differ (continuous batching)


@dataclass
class StepClock:
    """Seconds of a step's drafting and of its verify pass with the verdict, filled in by
    `speculative_step` when it is given one (the cost model of drafter/controller.py). On CUDA the
    passes run asynchronously, so the split is read from events on the stream once the host has
    waited for the verdict (which it does anyway); on the CPU it is wall time."""

    draft_s: float = 0.0
    verify_s: float = 0.0

    @staticmethod
    def mark(device: torch.device):
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def read(self, start, drafted, verified) -> None:
        if isinstance(start, float):
            self.draft_s, self.verify_s = drafted - start, verified - drafted
        else:
            self.draft_s, self.verify_s = start.elapsed_time(drafted) / 1e3, drafted.elapsed_time(verified) / 1e3


def speculative_step(
    verifier: LeanDecoder,
    cache: KVCache,
    last: torch.Tensor,  # [B] the newest committed token per row (not yet in the verifier's cache)
    drafter: Drafter | None,
    k: int,
    params: SamplingParams | RowParams,
    uniforms: torch.Tensor | None,  # [B, 2k+1]: k for drafting, k+1 for acceptance; None if greedy
    active: torch.Tensor,  # [B] bool
    sampler: Sampler = rejection_sample,
    on_trace: Callable[[StepTrace], None] | None = None,  # replay logging; None costs nothing
    limit: torch.Tensor | None = None,  # [B] int64: row b accepts at most limit[b] <= k drafts
    clock: StepClock | None = None,  # timing of the draft and verify passes; None costs nothing
    scoring: Scoring | None = None,  # rows whose emitted tokens get log-probabilities; None costs nothing
) -> BlockOutcome:
    dev = verifier.device
    t_start = None if clock is None else clock.mark(dev)
    u_draft, u_accept = (None, None) if uniforms is None else (uniforms[:, :k], uniforms[:, k:].to(dev))
    if k:
        proposal = drafter.propose(k, params, u_draft)
        proposal.tokens = proposal.tokens.to(dev)  # host-side drafters (n-gram) draft on the CPU
    else:  # the verifier alone: an empty draft, q of shape [B, 0, V]
        proposal = Proposal(torch.zeros(len(last), 0, dtype=torch.long, device=dev),
                            torch.zeros(len(last), 0, verifier.vocab_size, device=dev))
    if proposal.probs is not None:
        proposal.probs = proposal.probs.to(dev)
    t_drafted = None if clock is None else clock.mark(dev)
    start = cache.lens
    record = tuple(drafter.record_layers) if k and on_trace else ()
    follow = bool(k) or follows_plain(drafter)
    capture = tuple(drafter.verifier_layers) + record if follow else ()
    out = verifier.forward(cache, torch.cat([last[:, None].to(dev), proposal.tokens], dim=1), capture=capture)
    logits = out.logits  # [B, k+1, V]
    verdict = accept(proposal, logits, params, u_accept, sampler, limit)
    t_verified = None if clock is None else clock.mark(dev)
    outcome = BlockOutcome(verdict.tokens.cpu(), verdict.num_accepted.cpu())  # the host commits and rolls back
    if clock is not None:
        clock.read(t_start, t_drafted, t_verified)
    if scoring is not None:  # after the clock: the controller's costs are those of the step itself
        scoring.fill(logits, verdict.tokens)
    # roll back: keep the verifier's KV for `last` and the accepted drafts only
    cache.lens = torch.where(active, start + outcome.num_accepted + 1, start)
    if follow:
        drafter.observe(outcome, active, VerifierView(cache, at_emitting_position(out.hidden, outcome.num_accepted)))
    if k and on_trace is not None:
        on_trace(StepTrace(proposal, logits, {i: out.hidden[i] for i in record}, outcome, active, limit))
    return outcome


def accept(proposal: Proposal, logits: torch.Tensor, params: SamplingParams | RowParams,
           u_accept: torch.Tensor | None, sampler: Sampler, limit: torch.Tensor | None) -> BlockOutcome:
    """The verdict on a block: greedy rows by argmax, sampled rows by the lossless sampler."""
    cap = {} if limit is None else {"limit": limit}
    greedy = greedy_accept(proposal.tokens, logits, **cap) if params.greedy or isinstance(params, RowParams) else None
    if params.greedy:
        return greedy
    sampled = sampler(proposal.tokens, proposal.probs, warp(logits, params), u_accept, **cap)
    if greedy is None:
        return sampled
    rows = params.greedy_rows.to(sampled.tokens.device)
    return BlockOutcome(tokens=torch.where(rows[:, None], greedy.tokens, sampled.tokens),
                        num_accepted=torch.where(rows, greedy.num_accepted, sampled.num_accepted))


def follows_plain(drafter: Drafter | None) -> bool:
    """Whether plain steps (k = 0) keep this drafter up to date (it reads only the verifier's
    features and committed tokens: observing a plain step costs nothing), so it is never behind."""
    return drafter is not None and getattr(drafter, "follows_plain", False)


def at_emitting_position(hidden: dict[int, torch.Tensor], n: torch.Tensor) -> dict[int, torch.Tensor]:
    """layer -> [B, hidden] at block index n: the position whose output is the emitted token."""
    return {i: h[torch.arange(len(n), device=h.device), n.to(h.device)] for i, h in hidden.items()}


class StepHooks(Protocol):
    def swap(self, drafter: Drafter, histories: list[list[int]]) -> Drafter:
        """The drafter for the next step: `drafter` itself, or a new version that took over its rows
        (`adopt`, or `refill` from the histories). histories[b] = row b's committed tokens, ending
        with the token the next step starts from."""

    def traced(self, histories: list[list[int]]) -> Callable[[StepTrace], None] | None:
        """A trace callback for the next step (same histories)."""


@dataclass
class RequestStats:
    """Counts over a request's blocks. A block drafts its own k (a request's explicit k, or the
    controller's choice of the step, 0 for a plain step); positions are counted up to `k`, the most
    a block of the request may draft."""

    k: int
    blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k] blocks that accepted position i
    drafted_per_position: list[int] = field(default_factory=list)  # [k] blocks that drafted position i

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.k
        self.drafted_per_position = self.drafted_per_position or [0] * self.k

    def record(self, n: int, k: int | None = None) -> None:
        """One block: k drafts (default: this request's k), the first n accepted."""
        k = self.k if k is None else k
        self.blocks += 1
        self.drafted += k
        self.accepted += n
        self._grow(k)
        for i in range(k):
            self.drafted_per_position[i] += 1
        for i in range(n):
            self.accepted_per_position[i] += 1

    def _grow(self, k: int) -> None:
        for counts in (self.accepted_per_position, self.drafted_per_position):
            counts.extend([0] * (k - len(counts)))

    def merge(self, other: "RequestStats") -> None:
        """Add another request's counts into these (positions up to the longer of the two)."""
        self.blocks += other.blocks
        self.drafted += other.drafted
        self.accepted += other.accepted
        self._grow(len(other.accepted_per_position))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            for i, c in enumerate(theirs):
                mine[i] += c

    @property
    def acceptance_rate(self) -> float:
        """α = accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def block_efficiency(self) -> float:
        """τ = mean(n + 1) over blocks."""
        return (self.accepted + self.blocks) / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict:
        return {
            "blocks": self.blocks,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "block_efficiency": self.block_efficiency,
            "accepted_per_position": list(self.accepted_per_position),
        }


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS or a stop string) or "length"
    stats: RequestStats
    logprobs: list[TokenScore] | None = None  # one per token id, when the request asked for them


@dataclass
class StopRule:
    """When a request ends: EOS, a stop string (params.stop), or params.max_tokens, whichever first."""

    eos_ids: frozenset[int] = frozenset()
    decode: Callable[[list[int]], str] | None = None  # needed only for stop strings

    def extend(self, gen: Generation, new: list[int], params: SamplingParams) -> None:
        """Append tokens one at a time, as plain decoding would, stopping where it would stop."""
        for t in new:
            if t in self.eos_ids:
                gen.finish_reason = "stop"
                return
            gen.token_ids.append(t)
            if params.stop and any(s in self.decode(gen.token_ids) for s in params.stop):
                gen.finish_reason = "stop"
                return
            if len(gen.token_ids) >= params.max_tokens:
                gen.finish_reason = "length"
                return


def generate(
    verifier: LeanDecoder,
    drafter: Drafter | None,
    prompts: list[list[int]],
    params: SamplingParams,
    k: int | None,
    stop_rule: StopRule,
    sampler: Sampler = rejection_sample,
    first_request: int = 0,
    hooks: "StepHooks | None" = None,
    controller: Controller | None = None,
) -> list[Generation]:
    """Decode a batch of prompts (token ids, ragged) to completion. k = 0 means the verifier alone,
    k = None lets `controller` (drafter/controller.py; a new one when None) choose k step by step.
    Request i draws from the stream seeded by (params.seed, first_request + i).

    `hooks` (serving): `swap()` may hand over a new drafter between two steps (it takes over the
    old one's rows), and `traced(histories)` returns a callback for the step's trace."""
    from drafter.engine import Engine, EngineRequest  # the engine drives this module's step

    if k and drafter is None:
        raise ValueError("k > 0 needs a drafter")
    controller = Controller() if controller is None else controller
    reserve = controller.cfg.k_max if k is None else k
    capacity = max(map(len, prompts)) + params.max_tokens + 2 * reserve + 2
    engine = Engine(verifier, drafter, len(prompts), capacity, stop_rule, sampler=sampler, hooks=hooks,
                    controller=controller)
    engine.admit([EngineRequest(str(i), p, params, k, first_request + i) for i, p in enumerate(prompts)])
    while engine.running:
        engine.step()
    return [engine.finished.pop(str(i)) for i in range(len(prompts))]
