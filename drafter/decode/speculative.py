"""Speculative decoding: one `speculative_step` (draft → verify → accept) and its verdict.

With k = 0 and no drafter the same step is plain verifier decoding (one token per pass), which is
how `--no-speculation`, the reference, runs. The loop around it (requests, stopping, `generate`)
is drafter/decode/engine.py's; this module knows nothing of requests.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from specloop.drafter.decode.logprobs import Scoring
from specloop.drafter.decode.proposer import Drafter, Proposal, VerifierView
from specloop.drafter.decode.rejection import BlockOutcome, greedy_accept, rejection_sample
from specloop.drafter.decode.sampling import RowParams, SamplingParams, warp
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.kv_cache import KVCache

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
    `speculative_step` when it is given one (the cost model of drafter/decode/controller.py). On CUDA the
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
    gate: Callable[[list[list[float]], list[str] | None], list[int]] | None = None,  # draft lengths from confidence
    lookup: bool = False,  # only drafts that cost no model pass (`Drafter.lookup`): a step the controller left plain
) -> BlockOutcome:
    dev = verifier.device
    t_start = None if clock is None else clock.mark(dev)
    u_draft, u_accept = (None, None) if uniforms is None else (uniforms[:, :k], uniforms[:, k:].to(dev))
    proposal = drafter.lookup(k, params) if k and lookup else None
    if lookup and proposal is None:  # no free draft anywhere: a plain step
        k, u_accept = 0, None if uniforms is None else uniforms[:, 2 * k:].to(dev)
    if k:
        proposal = proposal or drafter.propose(k, params, u_draft)
        proposal.tokens = proposal.tokens.to(dev)  # host-side drafters (n-gram) draft on the CPU
    else:  # the verifier alone: an empty draft, q of shape [B, 0, V]
        proposal = Proposal(torch.zeros(len(last), 0, dtype=torch.long, device=dev),
                            torch.zeros(len(last), 0, verifier.vocab_size, device=dev))
    follow = bool(k) or follows_plain(drafter)  # a drafter asked to propose observes the verdict
    if k and gate is not None and proposal.confidence is not None:
        gated(proposal, gate, k)
    if proposal.lengths is not None:  # rows drafted fewer than k tokens: verify up to the longest only
        k, limit, u_accept = cut_to_lengths(proposal, active, k, limit, uniforms)
    if proposal.one_hot and not params.greedy:  # deterministic drafts: q is one-hot, made for the cut draft only
        proposal.probs = torch.nn.functional.one_hot(proposal.tokens, verifier.vocab_size).float()
    if proposal.probs is not None:
        proposal.probs = proposal.probs.to(dev)
    t_drafted = None if clock is None else clock.mark(dev)
    start = cache.lens
    record = tuple(drafter.record_layers) if k and on_trace else ()
    capture = tuple(drafter.verifier_layers) + record if follow else ()
    out = verifier.forward(cache, torch.cat([last[:, None].to(dev), proposal.tokens], dim=1), capture=capture)
    logits = out.logits  # [B, k+1, V]
    verdict = accept(proposal, logits, params, u_accept, sampler, limit)
    t_verified = None if clock is None else clock.mark(dev)
    drafted = None if proposal.lengths is None else limit.cpu()
    tokens, n = _to_host(verdict)
    outcome = BlockOutcome(tokens, n, drafted, proposal.sources, predicted(proposal, drafted))
    if clock is not None:
        clock.read(t_start, t_drafted, t_verified)
    if scoring is not None:  # after the clock: the controller's costs are those of the step itself
        scoring.fill(logits, verdict.tokens)
    # roll back: keep the verifier's KV for `last` and the accepted drafts only
    cache.lens = torch.where(active, start + outcome.num_accepted + 1, start)
    if follow:
        view = VerifierView(cache, at_emitting_position(out.hidden, outcome.num_accepted), out.hidden, outcome.num_accepted + 1)
        drafter.observe(outcome, active, view)
    if k and on_trace is not None:
        on_trace(StepTrace(proposal, logits, {i: out.hidden[i] for i in record}, outcome, active, limit))
    return outcome


def _to_host(verdict: BlockOutcome) -> tuple[torch.Tensor, torch.Tensor]:
    """The verdict's tokens and counts on the host (what commits, rolls back, streams and feeds the
    controller): one transfer on a device, nothing on the CPU."""
    if verdict.tokens.device.type == "cpu":
        return verdict.tokens, verdict.num_accepted
    host = torch.cat([verdict.tokens, verdict.num_accepted[:, None].to(verdict.tokens.dtype)], dim=1).cpu()
    return host[:, :-1].contiguous(), host[:, -1].contiguous()


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


def cut_to_lengths(proposal: Proposal, active: torch.Tensor, k: int, limit: torch.Tensor | None,
                   uniforms: torch.Tensor | None) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """A proposal whose rows drafted lengths[b] <= k tokens (a self-limiting drafter: suffix) is cut
    to the longest active row's draft, so the verify pass costs what was drafted. Returns the new k,
    each row's limit (its own k and its draft length, the smaller) and the accept uniforms in the
    engine's layout (tests at columns k.., the emitted token's at 2k). Lossless: a row accepts at
    most its own draft, and the position after it is its bonus, drawn from p alone."""
    lengths = torch.where(active, proposal.lengths.clamp(max=k), 0)
    cut = int(lengths.max()) if len(lengths) else 0
    proposal.tokens = proposal.tokens[:, :cut]
    if proposal.probs is not None:
        proposal.probs = proposal.probs[:, :cut]
    if proposal.logits:
        proposal.logits = proposal.logits[:cut]
    if proposal.confidence is not None:
        proposal.confidence = proposal.confidence[:, :cut]
    proposal.lengths = lengths
    limit = lengths if limit is None else torch.minimum(limit.to(lengths.device), lengths)
    u_accept = None if uniforms is None else torch.cat([uniforms[:, k:k + cut], uniforms[:, 2 * k:2 * k + 1]], dim=1)
    return cut, limit, u_accept if u_accept is None else u_accept.to(proposal.tokens.device)


def gated(proposal: Proposal, gate: Callable[[list[list[float]], list[str] | None], list[int]], k: int) -> None:
    """Each row keeps the prefix of its draft the gate chooses from its confidence and the speculator that
    drafted it (specloop.drafter.decode.controller `cut`)."""
    lengths = proposal.lengths if proposal.lengths is not None else torch.full((len(proposal.tokens),), k)
    conf = proposal.confidence.float().cpu()
    rows = [conf[b, : int(n)].tolist() for b, n in enumerate(lengths.tolist())]
    proposal.lengths = torch.minimum(lengths.cpu(), torch.tensor(gate(rows, proposal.sources), dtype=torch.long))


def predicted(proposal: Proposal, drafted: torch.Tensor | None) -> torch.Tensor | None:
    """[B] Σ_i P_i over each row's drafted positions (None for a proposal without confidence)."""
    if proposal.confidence is None:
        return None
    conf = proposal.confidence.float().cpu()
    if drafted is None:
        return conf.sum(dim=1)
    mask = torch.arange(conf.shape[1])[None, :] < drafted[:, None]
    return (conf * mask).sum(dim=1)


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

    def traced(self, histories: list[list[int]], ids: list[str | None]) -> Callable[[StepTrace], None] | None:
        """A trace callback for the next step (same histories; ids[b]: the request in row b, None if empty)."""
