"""Speculative decoding: one `speculative_step` (propose → verify → verdict → roll back → observe) and its verdict.

With k = 0 and no drafter the same step is plain verifier decoding (one token per pass), which is
how `--no-speculation`, the reference, runs. The loop around it (requests, stopping, `generate`)
is drafter/decode/engine.py's; this module knows nothing of requests.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol, cast

import torch

from specloop.drafter.decode.logprobs import Scoring
from specloop.drafter.decode.plan import StepPlan
from specloop.drafter.decode.proposer import GRAMMAR, Drafter, Proposal, VerifierView, steer_now
from specloop.drafter.decode.rejection import BlockOutcome, compiled_verdict, greedy_verdict, rejection_sample
from specloop.drafter.decode.sampling import RowParams, SamplingParams, argmax, warp
from specloop.drafter.decode.shaping import StepShaper
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.kv_cache import KVCache

Sampler = Callable[..., BlockOutcome]
Gate = Callable[[list[list[float]], list[str] | None], list[int]]  # rows' confidences, speculators -> draft lengths


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


_EVENTS: dict[torch.device, list] = {}  # StepClock's CUDA events per device, reused step after step


@dataclass
class StepClock:
    """Seconds of a step's drafting and of its verify pass with the verdict, filled in by
    `speculative_step` when it is given one (the cost model of drafter/decode/controller.py). On CUDA the
    passes run asynchronously, so the split is read from events on the stream once the host has
    waited for the verdict (which it does anyway); on the CPU it is wall time."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    trace_s: float = 0.0  # the step's trace callback (replay records): timed apart, not a cost of decoding
    _marks: int = 0  # marks made this step (CUDA: which of the device's three events the next one records)
    _stream: object = None  # CUDA: the stream the step runs on, looked up once (each lookup makes a Stream object)

    def mark(self, device: torch.device):
        """A point on the step's timeline: a CUDA event recorded on the stream (three per step, kept by this
        clock's device and reused: creating events costs the host more than recording them), else now."""
        if device.type != "cuda":
            return time.perf_counter()
        events = _EVENTS.setdefault(device, [])
        self._marks = self._marks % 3 + 1
        while len(events) < self._marks:
            events.append(torch.cuda.Event(enable_timing=True))
        if self._stream is None:
            self._stream = torch.cuda.current_stream(device)
        event = events[self._marks - 1]
        event.record(self._stream)
        return event

    def read(self, start, drafted, verified) -> None:
        if isinstance(start, float):
            self.draft_s, self.verify_s = drafted - start, verified - drafted
        else:
            self.draft_s, self.verify_s = start.elapsed_time(drafted) / 1e3, drafted.elapsed_time(verified) / 1e3


@dataclass(frozen=True)
class StepOptions:
    """The optional parts of a step, each costing nothing when None."""

    sampler: Sampler = rejection_sample  # the lossless verdict on sampled rows
    on_trace: Callable[[StepTrace], None] | None = None  # replay logging: the step's `StepTrace`
    clock: StepClock | None = None  # filled in with the seconds of the draft and verify passes
    scoring: Scoring | None = None  # rows whose emitted tokens get log-probabilities (filled in)
    gate: Gate | None = None  # each row's draft length from its confidence (the controller's `cut`)


def speculative_step(verifier: LeanDecoder, cache: KVCache, last: torch.Tensor, drafter: Drafter | None,
                     plan: StepPlan, *, options: StepOptions = StepOptions()) -> BlockOutcome:
    """One block over rows [0, B): propose → verify → verdict → roll back → observe. `last` [B]: the newest
    committed token per row (not yet in the verifier's cache); `plan`: what the caller decided (drafts per
    row, sampling, uniforms: drafter/decode/plan.py); `options`: the optional hooks. Each active row's cache
    length advances by its n + 1; a drafter asked to propose (or following plain steps) observes the verdict."""
    o, dev = options, verifier.device
    t_start = None if o.clock is None else o.clock.mark(dev)
    block = propose(verifier, last, drafter, plan, o.gate)
    t_drafted = None if o.clock is None else o.clock.mark(dev)
    # the drafter asked to propose (or following plain steps) observes the verdict; None: nothing observes it
    follower = drafter if block.asked or follows_plain(drafter) else None
    record = tuple(follower.record_layers) if follower is not None and block.k and o.on_trace else ()
    capture = tuple(follower.verifier_layers) + record if follower is not None else ()
    # a step planned plain and traced is observed for replay records: what a block drafted now would have
    # started from, read before the drafter observes this step
    observed = not plan.k and o.on_trace is not None
    steer = steer_now(drafter) if observed else None
    start = cache.lens
    out = verifier.forward(cache, block_tokens(last, block, dev), capture=capture, choose=reads_argmax(plan))
    logits = out.logits if plan.shaper is None else plan.shaper.apply(out.logits, block.proposal.tokens)
    choices = out.choices if plan.shaper is None else None  # the step's own argmax, where it made one
    verdict = accept(block, logits, plan.params, o.sampler, choices)
    t_verified = None if o.clock is None else o.clock.mark(dev)
    outcome = _on_host(verdict, block)
    if o.clock is not None:
        o.clock.read(t_start, t_drafted, t_verified)
    if o.scoring is not None:  # after the clock: the controller's costs are those of the step itself
        o.scoring.fill(out.logits, verdict.tokens)
    # roll back: keep the verifier's KV for `last` and the accepted drafts only
    cache.lens = rolled_back(cache.lens, start, outcome.num_accepted, plan, block.k)
    if follower is not None:
        n = outcome.num_accepted
        view = VerifierView(cache, at_emitting_position(out.hidden, n), out.hidden, n + 1)
        follower.observe(outcome, plan.active, view)
    if o.on_trace is not None and (block.k or observed):  # the proposal as verified, the logits it was verified
        hidden = {i: out.hidden[i] for i in record}  # against (observed: an empty one, with what it starts from)
        proposal = block.proposal if block.k else replace(block.proposal, steer=steer)
        t_trace = time.perf_counter()
        o.on_trace(StepTrace(proposal, out.logits, hidden, outcome, plan.active, block.limit))
        if o.clock is not None:
            o.clock.trace_s = time.perf_counter() - t_trace
    return outcome


def reads_argmax(plan: StepPlan) -> bool:
    """Whether the step's verdict is the logits' argmax (`accept`: every row greedy, the logits not reshaped by a
    grammar): then the verifier's LM head is asked to find it in its own call (`ForwardOut.choices`). A sampled step
    with greedy rows is judged in one compiled call on the CPU, its argmax read there."""
    return plan.shaper is None and plan.params.greedy


def rolled_back(lens: torch.Tensor, start: torch.Tensor, n: torch.Tensor, plan: StepPlan, k: int) -> torch.Tensor:
    """[B] each row's cache length after a block of k drafts: an active row keeps `last` and its n accepted drafts
    (start + n + 1), an inactive one nothing (start). `lens` is what the verify pass left (start + 1 + k: a plain
    step's already, where every row is active: no op, as each op after a forward costs ~30 µs on a CPU)."""
    if k == 0:
        return lens if len(plan.live) == len(start) else torch.where(plan.active, lens, start)
    if start.device.type == "cpu" and n.device.type == "cpu":  # as lists: a read each, not three ops run cold
        rows = zip(start.tolist(), n.tolist(), plan.active.tolist())
        return torch.tensor([s + c + 1 if a else s for s, c, a in rows], dtype=start.dtype)
    return torch.where(plan.active, start + n + 1, start)


@dataclass(frozen=True)
class Block:
    """The draft a step verifies, as `propose` left it."""

    proposal: Proposal  # as verified: tokens [B, k] on the device, cut to the longest row's draft, q where sampled
    asked: int  # drafts per row the drafter was asked for (0: none, a plain step)
    k: int  # drafts per row verified: `asked`, or fewer after a cut to the rows' lengths
    limit: torch.Tensor | None  # [B] int64: row b accepts at most limit[b] <= k drafts (None: every row k)
    u_accept: torch.Tensor | None  # [B, k + 1] on the device: the accept tests, then the emitted token's
    host: torch.Tensor | None = None  # [B, k] the drafts on the host where the drafter made them there (n-gram,
    #                                   suffix): the block is put together and judged there (`block_tokens`, `accept`)


def propose(verifier: LeanDecoder, last: torch.Tensor, drafter: Drafter | None, plan: StepPlan,
            gate: Gate | None) -> Block:
    """The block to verify: a lookup step's free drafts (none anywhere: a plain step), a drafting step's
    proposal, or an empty draft (the verifier alone); gated by confidence, cut to the rows' lengths and given
    its q. Each stage derives a new `Proposal`: the one the drafter returned is never written."""
    dev, k, u_accept = verifier.device, plan.k, plan.u_accept
    proposal = free_drafts(drafter, plan) if k and plan.lookup else None
    if plan.lookup and proposal is None:  # no free draft anywhere: a plain step
        k, u_accept = 0, plan.accept_uniforms(0)
    if k:
        assert drafter is not None, "the engine plans drafts (k > 0) only with a drafter"
        proposal = proposal or drafter.propose(k, plan.params, plan.u_draft)
    else:  # the verifier alone: an empty draft, q of shape [B, 0, V]
        proposal = empty_proposal(len(last), verifier.vocab_size, dev)
    asked, limit = k, plan.limit
    if k and gate is not None and proposal.confidence is not None:
        proposal = gated(proposal, gate, k)
    if k and plan.shaper is not None:
        proposal = within_grammar(proposal, plan.shaper, k)
    if k and plan.forced is not None:
        proposal = with_forced(proposal, plan.forced, k)
    if proposal.lengths is not None:  # rows drafted fewer than k tokens: verify up to the longest only
        proposal, limit = cut_to_lengths(proposal, plan.active, k, limit)
        k = proposal.tokens.shape[1]
        u_accept = plan.accept_uniforms(k)
    host = proposal.tokens if k and proposal.tokens.device.type == "cpu" else None  # a host-side drafter's (n-gram)
    if host is not None and not plan.params.greedy:  # a greedy verdict judges host drafts where they are
        proposal = replace(proposal, tokens=host.to(dev))
    if proposal.probs is not None:
        proposal = replace(proposal, probs=proposal.probs.to(dev))
    return Block(proposal, asked, k, limit, None if u_accept is None else u_accept.to(dev), host)


def block_tokens(last: torch.Tensor, block: Block, dev: torch.device) -> torch.Tensor:
    """[B, 1 + k]: each row's newest committed token, then its drafts; put together where the drafts were
    made (drafts made on the host: one copy to the device, in the verify pass's input)."""
    if block.k == 0:
        return last[:, None]
    if block.host is not None and last.device.type == "cpu":
        return torch.cat([last[:, None], block.host], dim=1)
    return torch.cat([last[:, None].to(dev), block.proposal.tokens], dim=1)


_EMPTY: dict[tuple, Proposal] = {}  # a plain step's empty draft per (rows, vocabulary, device): no tensor to make


def empty_proposal(rows: int, vocab_size: int, dev: torch.device) -> Proposal:
    """The verifier alone's draft: no tokens [rows, 0], q of shape [rows, 0, V] (shared: nothing writes an empty
    tensor, and every stage of `propose` derives a new Proposal)."""
    key = (rows, vocab_size, dev)
    if key not in _EMPTY:
        _EMPTY[key] = Proposal(torch.zeros(rows, 0, dtype=torch.long, device=dev),
                               torch.zeros(rows, 0, vocab_size, device=dev))
    return _EMPTY[key]


def _on_host(verdict: BlockOutcome, block: Block) -> BlockOutcome:
    """The verdict as the step returns it: tokens and counts on the host (what commits, rolls back, streams
    and feeds the controller; one transfer on a device, nothing on the CPU), with what each row drafted
    (after a cut: its own length) and what its drafter predicted."""
    drafted: torch.Tensor | None = None
    if block.proposal.lengths is not None:
        assert block.limit is not None, "a cut proposal carries its rows' limits (cut_to_lengths)"
        drafted = block.limit.cpu()
    if verdict.tokens.device.type == "cpu":
        tokens, n = verdict.tokens, verdict.num_accepted
    elif block.k == 0:  # a plain step accepts nothing: its token is all there is to read
        tokens, n = verdict.tokens.cpu(), torch.zeros(len(verdict.tokens), dtype=torch.long)
    else:
        host = torch.cat([verdict.tokens, verdict.num_accepted[:, None].to(verdict.tokens.dtype)], dim=1).cpu()
        tokens, n = host[:, :-1].contiguous(), host[:, -1].contiguous()
    return BlockOutcome(tokens, n, drafted, block.proposal.sources, predicted(block.proposal, drafted))


def accept(block: Block, logits: torch.Tensor, params: SamplingParams | RowParams, sampler: Sampler,
           choices: torch.Tensor | None = None) -> BlockOutcome:
    """The verdict on a block: greedy rows by argmax (`choices`: the logits' argmax where the pass computed it),
    sampled rows by the lossless sampler. A greedy step is judged on the host: the verifier's choices read back
    (with the drafts, where they were made on the device) in one copy, compared there (no comparison kernels
    to launch on a GPU)."""
    proposal, limit = block.proposal, block.limit
    cap = {} if limit is None else {"limit": limit}
    if not params.greedy and sampler is rejection_sample and block.u_accept is not None:  # on the CPU: one call
        judged = compiled_verdict(proposal.tokens, proposal.probs, logits, params, block.u_accept, limit,
                                  proposal.one_hot)
        if judged is not None:
            return judged
    sampled = lambda: sampler(proposal.tokens, drafted_q(proposal, logits.shape[-1]), warp(logits, params),  # noqa: E731
                              block.u_accept, **cap)
    if not params.greedy and not isinstance(params, RowParams):  # no greedy row: the verifier's argmax is not read
        return sampled()
    target = argmax(logits) if choices is None else choices
    if params.greedy:
        return greedy_verdict(*_choices_on_host(block, target), **cap)
    assert isinstance(params, RowParams)  # a sampled step with greedy rows: only per-row params mix them
    greedy, drawn = greedy_verdict(proposal.tokens, target, **cap), sampled()
    rows = params.greedy_rows.to(drawn.tokens.device)
    return BlockOutcome(tokens=torch.where(rows[:, None], greedy.tokens, drawn.tokens),
                        num_accepted=torch.where(rows, greedy.num_accepted, drawn.num_accepted))


def drafted_q(proposal: Proposal, vocab_size: int) -> torch.Tensor | None:
    """What the proposal's drafts were drawn from, for the rejection sampler's ops: deterministic drafts' q is one-hot,
    made here where those ops judge them (the compiled verdict takes them as they are)."""
    if proposal.one_hot and proposal.probs is None:
        return torch.nn.functional.one_hot(proposal.tokens, vocab_size).float()
    return proposal.probs


def _choices_on_host(block: Block, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [B, k], the verifier's choices [B, k + 1]) on the host, in one copy from the device at most."""
    if target.device.type == "cpu":
        return block.proposal.tokens, target
    if block.k == 0:  # nothing to compare: the empty draft's device does not matter
        return block.proposal.tokens, target.cpu()
    if block.host is not None:
        return block.host, target.cpu()
    both = torch.cat([target, block.proposal.tokens], dim=1).cpu()
    return both[:, block.k + 1:], both[:, : block.k + 1]


def cut_to_lengths(proposal: Proposal, active: torch.Tensor, k: int,
                   limit: torch.Tensor | None) -> tuple[Proposal, torch.Tensor]:
    """A proposal whose rows drafted lengths[b] <= k tokens (a self-limiting drafter: suffix), cut to the
    longest active row's draft, so the verify pass costs what was drafted; with each row's limit (its own k
    and its draft length, the smaller). Its accept uniforms are `StepPlan.accept_uniforms(cut)`. Lossless:
    a row accepts at most its own draft, and the position after it is its bonus, drawn from p alone."""
    assert proposal.lengths is not None  # called only for a proposal whose rows drafted their own lengths
    # as lists: a read each (the five ops of the tensor form each ran cold after the layers, ~50 µs on two cores)
    kept = [min(n, k) if a else 0 for a, n in zip(active.tolist(), proposal.lengths.tolist())]
    cut = max(kept, default=0)
    first = lambda t: None if t is None else t[:, :cut]  # noqa: E731
    lengths = torch.tensor(kept, dtype=torch.long)
    cut_proposal = replace(proposal, tokens=proposal.tokens[:, :cut], probs=first(proposal.probs),
                           logits=proposal.logits[:cut] if proposal.logits else proposal.logits,
                           confidence=first(proposal.confidence), lengths=lengths)
    if limit is None:
        return cut_proposal, lengths
    return cut_proposal, torch.tensor([min(a, b) for a, b in zip(limit.tolist(), kept)], dtype=torch.long)


def gated(proposal: Proposal, gate: Gate, k: int) -> Proposal:
    """The proposal with each row keeping the prefix of its draft the gate chooses from its confidence and
    the speculator that drafted it (specloop.drafter.decode.controller `cut`)."""
    assert proposal.confidence is not None  # gated only where the drafter gave its confidence
    lengths = [k] * len(proposal.tokens) if proposal.lengths is None else proposal.lengths.tolist()
    conf = proposal.confidence.float().tolist()  # one read each, compared as lists (ops after the layers run cold)
    keep = gate([row[:n] for row, n in zip(conf, lengths)], proposal.sources)
    return replace(proposal, lengths=torch.tensor([min(n, c) for n, c in zip(lengths, keep)], dtype=torch.long))


def within_grammar(proposal: Proposal, shaper: StepShaper, k: int) -> Proposal:
    """The proposal with each row cut before the first draft its grammar refuses (p is 0 there: it would be
    rejected; verifying it would only cost the pass)."""
    allowed = shaper.draft_limits(proposal.tokens)
    if allowed is None:
        return proposal
    lengths = proposal.lengths if proposal.lengths is not None else torch.full((len(proposal.tokens),), k)
    return replace(proposal, lengths=torch.minimum(lengths.cpu(), allowed))


def free_drafts(drafter: Drafter | None, plan: StepPlan) -> Proposal | None:
    """A lookup step's drafts (the engine plans one for a drafter with free drafts, or for rows whose grammar
    forces tokens): the drafter's own (`LooksUp.lookup`: suffix decoding), else the forced tokens alone (merged
    into the drafter's after the grammar's cut, `with_forced`); None where no row has any."""
    own = cast(LooksUp, drafter).lookup(plan.k, plan.params) if hasattr(drafter, "lookup") else None
    if own is None and plan.forced is not None:
        return with_forced(None, plan.forced, plan.k)
    return own


def with_forced(proposal: Proposal | None, forced: tuple[list[int], ...], k: int) -> Proposal:
    """Each row whose grammar forces more tokens than it has drafts (after `within_grammar`'s cut; none where
    `proposal` is None) drafts those tokens instead: free drafts with a one-hot q and confidence 1 (the verifier's
    masked distribution allows them alone, or they are rejected as any draft), source GRAMMAR. The engine plans
    forced tokens only for drafters that follow the verdict rather than their own drafts (`follows_plain`)."""
    B = len(forced)
    want = [f[:k] for f in forced]
    n = torch.tensor([len(f) for f in want], dtype=torch.long)
    tokens = torch.tensor([f + [0] * (k - len(f)) for f in want], dtype=torch.long).reshape(B, k)
    sure = (torch.arange(k)[None, :] < n[:, None]).float()
    if proposal is None:
        return Proposal(tokens, None, lengths=n, confidence=sure, sources=[GRAMMAR] * B, one_hot=True)
    had = proposal.lengths.cpu() if proposal.lengths is not None else torch.full((B,), k)
    take = n > had
    if not bool(take.any()):
        return proposal
    dev = proposal.tokens.device
    pick = take.to(dev)
    probs = proposal.probs
    if probs is not None:
        one_hot = torch.nn.functional.one_hot(tokens, probs.shape[-1]).to(probs)
        probs = torch.where(pick[:, None, None], one_hot.to(dev), probs)
    confidence = proposal.confidence
    if confidence is not None:
        confidence = torch.where(take[:, None], sure, confidence.float().cpu())
    sources = [GRAMMAR if t else s for t, s in zip(take.tolist(), proposal.sources or ["adaptive"] * B)]
    return replace(proposal, tokens=torch.where(pick[:, None], tokens.to(dev), proposal.tokens), probs=probs,
                   lengths=torch.where(take, n, had), confidence=confidence, sources=sources)


def predicted(proposal: Proposal, drafted: torch.Tensor | None) -> torch.Tensor | None:
    """[B] Σ_i P_i over each row's drafted positions (None for a proposal without confidence)."""
    if proposal.confidence is None:
        return None
    conf = proposal.confidence.float().cpu()
    if drafted is None:
        return conf.sum(dim=1)
    rows, lengths = conf.tolist(), drafted.tolist()  # a read each (three ops after the layers, each cold)
    return torch.tensor([sum(row[: int(n)]) for row, n in zip(rows, lengths)], dtype=torch.float32)


def follows_plain(drafter: Drafter | None) -> bool:
    """Whether plain steps (k = 0) keep this drafter up to date (it reads only the verifier's
    features and committed tokens: observing a plain step costs nothing), so it is never behind."""
    return drafter is not None and getattr(drafter, "follows_plain", False)


def lazy_part(drafter: Drafter | None) -> Drafter | None:
    """What still follows a plain step on which the engine leaves a lazily following drafter behind
    (`follows_lazily`): the members that must see every token (a mix's suffix decoding: `lazy_part`), or
    None (an eagle head alone: nothing)."""
    part = getattr(drafter, "lazy_part", None)
    return part() if part is not None else None


def at_emitting_position(hidden: dict[int, torch.Tensor], n: torch.Tensor) -> dict[int, torch.Tensor]:
    """layer -> [B, hidden] at block index n: the position whose output is the emitted token (a plain step's
    only position: a view, no gather)."""
    return {i: h[:, 0] if h.shape[1] == 1 else h[torch.arange(len(n), device=h.device), n.to(h.device)]
            for i, h in hidden.items()}


class LooksUp(Protocol):
    """A drafter with free drafts (`lookup`: suffix decoding, or a mix of speculators holding it), which the
    Drafter protocol does not name: the engine checks for it."""

    def lookup(self, k: int, params: SamplingParams | RowParams) -> Proposal | None:
        """Up to k drafts per row that cost no model pass (None: none anywhere)."""


class StepHooks(Protocol):
    def swap(self, drafter: Drafter, histories: list[list[int]]) -> Drafter:
        """The drafter for the next step: `drafter` itself, or a new version that took over its rows
        (`adopt`, or `refill` from the histories). histories[b] = row b's committed tokens, ending
        with the token the next step starts from."""

    def traced(self, histories: list[list[int]], ids: list[str | None]) -> Callable[[StepTrace], None] | None:
        """A trace callback for the next step (same histories; ids[b]: the request in row b, None if empty).
        A drafting step is traced; a step left plain only where the hooks have an `observes_plain()` that says
        so for it (optional: replay records of plain steps, `speculative_step`'s observed trace), and then their
        `observes_some_plain()` (optional) says whether any plain step may be: the engine's following drafter
        skips no plain step while one may (`Engine._lazy`)."""
