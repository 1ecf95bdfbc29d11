"""Cost-aware speculation: the per-step choice of k (0 = the verifier alone) from live acceptance and
costs measured in place. Pure Python, no processes, no clock: the engine times its steps and feeds
them in (`observe`), then asks for the next k (`choose`); the same inputs give the same choices.

Model of one step with draft length k over a verify pass of B rows (bucket b = B rounded up to a
power of two):

    a_i   = P(draft i accepted | drafts < i accepted)       conditional per-position acceptance
    E(k)  = 1 + Σ_{i≤k} Π_{j≤i} a_j                          tokens a row gains from the block
    S(k)  = overhead(k > 0, b) + draft(k, b) + verify(k + 1, b)    seconds of the step
    k*    = argmax_k  E(k) / S(k)                            (rows · E(k) with several rows)

k* > 0 only if it beats k = 0 by `margin`. Rows with an explicit k ride along: their k is paid for
anyway, so the controller's rows draft at least that much (up to `k_max`) at no extra cost.

- Acceptance: per position, exponentially decayed counts of trials (a block tries position i when
  its first i − 1 drafts were accepted) and hits, shrunk towards a prior: `prior_acceptance` at
  position 1, then `depth_discount` × the estimate of the position before (positions never tried
  inherit a pessimistic guess). A new drafter (hot swap) keeps `swap_keep` of the old counts.
- Costs, relative to a plain (T = 1) verify pass at the same bucket, so that a busy machine, which
  slows every shape alike, changes none of them: r(T, b) = verify(T) / verify(1), learned only from
  drafting steps close (`side_by_side` steps) to a plain step at the same bucket; drafting per token
  and the rest of the step (bookkeeping, acceptance, logging; by drafting or not) relative to the
  same step's plain-pass equivalent (verify / r). Shapes never measured take the nearest measured
  bucket's slope (steeper for a larger batch) or the priors; the first sample of a shape may carry
  one-time costs, so a lower second sample replaces it. r(T) is never below 1 (more tokens never cost
  a pass less): a pass of T >= 2 measured more than `reference_drift` faster than its plain reference
  says the reference is stale (a process warming up runs each pass faster than the last for its first
  tens of steps), so it teaches no ratio (the reference is taken again on the schedule below). The
  decision needs only these ratios:

      S(k) / verify(1) = overhead(k > 0) + draft(k) + r(k + 1)

  Drafting is learned per k asked (a captured chain of k_max drafts costs one call whatever k; a drafter LM's
  chain, a fixed cost and one per pass): between measured k linearly, beyond them in proportion to the nearest,
  unmeasured per token. Once a bucket's drafting was measured at one k, the next probe tries k_max, so the
  cost of a deep block is never only the shallow one's times k.

- The reference: a batch bucket's first two steps are plain, whatever the estimates say (the first step
  of an engine carries one-time costs, and a lower second plain pass replaces it as the reference); a
  first probe that does not pay is followed at once by a second (its first drafting step carried them too),
  and so is a probe whose verify shape was new at its bucket, with the same k (a new shape's first pass
  carries them too: priced by it alone, the deeper drafts that pay were never tried again).
- Exploration: while nothing drafts, a probe (the best k > 0 under the current estimates) runs once
  `idle` steps have passed without drafting: `explore_min` steps when the probe's verify shape was
  never measured at this bucket, else `interval`, which doubles after every probe (up to
  `explore_max`) and is reset when speculation wins or the drafter changes. While drafting pays, a
  plain step is taken when the bucket's last one is older than `reference_age` (or there is none), to
  learn the ratios against: `explore_min` · 2 steps after its first ratios, doubling with each pair
  learned there, up to `explore_max` (the first ones are learned in a process's first steps; learned
  again only every `explore_max` steps, a wrong one kept a drafter that did not pay drafting for 256).
  Both wait longer by the measured cost of switching (the drafter restarts rows that skipped plain
  steps: `switch_cost`), so exploring costs at most about one step in `explore_min` and tends to one in
  `explore_max`.
- Confidence (drafters that report it: suffix decoding's path frequency, an eagle head's own
  probability of its drafts): once a step has drafted, the verify pass is cut to the width W* that
  maximizes the batch's expected tokens per unit of time, and each row keeps the first min(W*, L_b)
  of its L_b drafts (within the pass's width a row's drafts cost nothing more),

      W* = argmax_W Σ_b (1 + c · Σ_{i≤min(W, L_b)} P_{b,i}) / (overhead(W > 0) + r(W + 1))

  where P_{b,i} is the drafter's probability that row b's first i drafts are accepted and c the live
  calibration of the speculator that drafted row b (accepted / predicted, decayed; for a `per_request`
  speculator, suffix decoding, the row's own request's outcomes where they say more, and a request's first
  draft promising `try_tokens`, or one after `row_retry` cuts, at the speculator's word: `_weights`), each
  term c · P_{b,i} capped by Π_{j≤i} a_j, the per-position acceptance of that speculator's verified drafts (`depth`: a
  long unique continuation, P = 1 throughout, is worth only as deep as such drafts are accepted): a
  draft the verifier is unlikely to take costs no verify
  pass, and one row's draft widens the pass of a batch only where the batch gains. The drafting cost is
  spent by then and does not enter. Where asking costs little (drafting per token ≤ `cheap_draft` of a
  plain pass: a lookup), probes keep the shortest interval.
- Free drafts (specloop.drafter.decode.engine: a lookup on a step left plain): one whose drafts earned no token
  (rejected, or all cut by the gate) makes the next wait 1, then 3, then `lookup_backoff` steps; one that matched
  nothing waits one step; one that earned a token brings the next at once. A lookup the engine can tell
  ahead would verify nothing (no row's draft, or the gate would cut them all) is told here (`looked_up`) and
  the step runs plain, untimed: where free drafts never pay, a lookup costs the host a match and no more.
  Rows a free speculator drafted (a mix's suffix member) teach the calibration, never the acceptance k is
  chosen by: that prices the drafter that costs a pass.
- Cost of deciding: the evaluation of every k is reused for `refresh` steps of the same batch shape
  until a step drafts (new acceptance, new shapes): a plain step costs the controller a few µs. The step
  costs it rests on are priced again after `refresh` steps, a probe, or a step at a new shape: a steadily
  drafting step re-weighs only the acceptance. A step
  left plain while no probe is due is not timed (`Choice.timed`: the engine reads no clock and reports
  nothing), but for the last `side_by_side` before a probe: where speculation is off, the controller
  costs the host a choice a step and nothing more (on CUDA a timed step records three events).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from specloop.drafter.decode.capacity import AUTO_K_MAX

MAX_DEPTH = 32  # draft positions whose acceptance the confidence gate keeps per speculator


@dataclass(frozen=True)
class ControllerConfig:
    k_max: int = AUTO_K_MAX
    margin: float = 0.03  # speculate only when it is expected to be this much faster
    prior_acceptance: float = 0.4  # a_1 before any block was verified
    prior_strength: float = 4.0  # trials' worth of weight behind each position's prior
    depth_discount: float = 0.9  # prior of a_{i+1} = depth_discount · a_i
    acceptance_decay: float = 0.99  # weight kept by older trials of a position at each new one
    swap_keep: float = 0.25  # weight kept by acceptance counts when a new drafter takes over
    cost_decay: float = 0.9  # EWMA: weight kept by the old estimate at each new sample
    side_by_side: int = 2  # a drafting step this close (in steps) to a plain one measures r(T)
    reference_drift: float = 0.1  # r(T >= 2) measured this far below 1: the plain reference is stale, not r
    prior_verify_slope: float = 0.5  # verify(T) ≈ verify(1) · (1 + slope · (T − 1)) before measuring
    prior_draft_ratio: float = 0.3  # drafting per token ≈ ratio · verify(1) before measuring
    prior_overhead_ratio: float = 2.0  # a drafting step's overhead ≈ ratio · a plain step's before measuring
    explore_min: int = 16  # steps without drafting before a probe (an unmeasured shape, or a reset)
    explore_max: int = 256  # the longest interval between probes
    refresh: int = 8  # observed plain steps of the same batch shape that reuse the last evaluation (~20-30 µs)
    cheap_draft: float = 0.02  # drafting per token at most this share of a plain pass (a lookup): probes stay frequent
    calibration_decay: float = 0.98  # weight kept by older drafts in the confidence calibration
    lookup_backoff: int = 4  # the most steps without a lookup after lookups that earned nothing (1, 3, then this)
    lookup_max: int = 16  # the most free drafts a lookup verifies per row (eager backend; a graph step's k_max)
    # speculators whose drafts' worth is the request's own (suffix decoding copies from its prompt and answer): a
    # row's own outcomes weigh beside the speculator's calibration (`row_prior` predicted tokens' worth behind the
    # latter); its first draft promising `try_tokens` (Σ P_i) is verified at the speculator's word, and so is one
    # after `row_retry` cuts of the row's drafts (doubling while such tries earn nothing)
    per_request: frozenset[str] = frozenset({"suffix"})
    row_prior: float = 2.0
    try_tokens: float = 2.0
    row_retry: int = 8

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if self.lookup_max < 1:
            raise ValueError(f"lookup_max must be >= 1, got {self.lookup_max}")
        if not 1 <= self.explore_min <= self.explore_max:
            raise ValueError("need 1 <= explore_min <= explore_max")


SAMPLED = "@sampled"  # a calibration key's suffix for rows that sample (`calibrated_as`)


def calibrated_as(source: str | None, sampled: bool) -> str | None:
    """The key a row's confident drafts are calibrated under: its speculator's (None: the drafter's own), apart for a
    row that samples: a drafted token is taken there with the probability the verifier gives it at the row's
    temperature, not whenever it is the verifier's choice (suffix decoding's drafts, taken 0.4-0.7 of the time on
    greedy grounded requests, earn ~0.1 on chat at T = 1: one calibration for both verified chat's lookups at a loss
    after grounded requests, bench/README.md section 53)."""
    return f"{source or ''}{SAMPLED}" if sampled else source


def speculator_of(key: str | None) -> str | None:
    """`calibrated_as`'s inverse: the speculator a calibration key is of."""
    if key is None or not key.endswith(SAMPLED):
        return key
    return key[: -len(SAMPLED)] or None


def bucket(rows: int) -> int:
    """Rows of a verify pass rounded up to a power of two: the unit costs are measured and kept by."""
    return 1 << max(0, rows - 1).bit_length()


def expected_tokens(a: list[float], k: int) -> float:
    """E(k) = 1 + Σ_{i≤k} Π_{j≤i} a_j: tokens a row gains from a block of k drafts."""
    total, run = 1.0, 1.0
    for a_i in a[:k]:
        run *= a_i
        total += run
    return total


# ----------------------------------------------------------------------------- estimates


@dataclass
class Acceptance:
    """Conditional per-position acceptance a_1..a_{k_max}: decayed trial counts with a prior."""

    cfg: ControllerConfig
    hits: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    _rates: list[float] | None = field(default=None, init=False, repr=False, compare=False)  # `rates`, until observed

    def __post_init__(self):
        self.hits = self.hits or [0.0] * self.cfg.k_max
        self.trials = self.trials or [0.0] * self.cfg.k_max

    def observe(self, k: int, n: int) -> None:
        """One block: k drafts, the first n accepted. Positions 1..min(n + 1, k) were tried."""
        lam, self._rates = self.cfg.acceptance_decay, None
        for i in range(min(n + 1, k, self.cfg.k_max)):
            self.hits[i] = lam * self.hits[i] + (i < n)
            self.trials[i] = lam * self.trials[i] + 1.0

    def rates(self) -> list[float]:
        """a_1..a_{k_max} (one list until the next observation: read, not written, by its callers; the gate reads a
        speculator's 32 on every lookup with drafts)."""
        if self._rates is None:
            self._rates = self._estimate()
        return self._rates

    def _estimate(self) -> list[float]:
        m, prior, out = self.cfg.prior_strength, self.cfg.prior_acceptance, []
        for h, t in zip(self.hits, self.trials):
            a = (h + m * prior) / (t + m)
            out.append(a)
            prior = self.cfg.depth_discount * a
        return out

    def fade(self, keep: float) -> None:
        """Keep `keep` of the evidence (a new drafter: the old one's estimate becomes a weak prior)."""
        self.hits = [h * keep for h in self.hits]
        self.trials = [t * keep for t in self.trials]
        self._rates = None

    def toward(self, prior: list[float]) -> list[float]:
        """Per position, this evidence shrunk towards `prior` (another estimate's rates) with `prior_strength`
        trials' worth behind it."""
        m = self.cfg.prior_strength
        return [(h + m * g) / (t + m) for h, t, g in zip(self.hits, self.trials, prior)]


@dataclass
class Calibration:
    """What confident drafts really earned over what their drafter predicted, both decayed:
    scale = accepted / predicted (1 before any draft)."""

    decay: float = 0.98
    accepted: float = 1.0
    predicted: float = 1.0

    def observe(self, predicted: float, accepted: float) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.predicted = self.decay * self.predicted + predicted

    def fade(self, keep: float) -> None:
        self.accepted, self.predicted = self.accepted * keep, self.predicted * keep

    @property
    def scale(self) -> float:
        return self.accepted / self.predicted if self.predicted > 0 else 1.0


@dataclass
class RowEvidence:
    """One request's own verified drafts of one speculator: what they predicted and earned, and per position
    (no decay: a request's lifetime)."""

    calibration: Calibration
    depth: Acceptance
    cuts: int = 0  # the row's drafts the gate cut since one was verified
    retry: int = 0  # cuts before a draft is tried at the speculator's word again (0: none verified yet)


@dataclass
class Ewma:
    value: float = 0.0
    n: int = 0  # samples seen

    def add(self, x: float, decay: float) -> None:
        if self.n == 0:
            self.value = x
        elif self.n == 1 and x < self.value:  # the first sample of a shape may carry one-time costs
            self.value = x
        else:
            w = max(1.0 - decay, 1.0 / (self.n + 1))
            self.value += w * (x - self.value)
        self.n += 1


@dataclass
class Costs:
    """Step costs relative to a plain verify pass at the same bucket, and guesses for shapes never measured."""

    cfg: ControllerConfig
    ratio: dict[tuple[int, int], Ewma] = field(default_factory=dict)  # (T >= 2, bucket) -> verify(T) / verify(1)
    draft: dict[int, Ewma] = field(default_factory=dict)  # bucket -> drafting per token / verify(1)
    drafted: dict[tuple[int, int], Ewma] = field(default_factory=dict)  # (k asked, bucket) -> drafting / verify(1)
    overhead: dict[tuple[bool, int], Ewma] = field(default_factory=dict)  # (drafting?, bucket) -> rest / verify(1)
    resync: dict[int, Ewma] = field(default_factory=dict)  # bucket -> restarting the drafter's rows / verify(1)
    offered: dict[tuple[int, int], Ewma] = field(default_factory=dict)  # (k asked, bucket) -> drafts verified
    plain: dict[int, tuple[int, float]] = field(default_factory=dict)  # bucket -> (step, seconds): recent plain passes
    steps: int = 0  # steps observed

    def add(self, table: dict, key, value: float) -> None:
        table.setdefault(key, Ewma()).add(max(value, 0.0), self.cfg.cost_decay)

    def observe(self, step: StepSample) -> None:
        self.steps += 1
        b, T = bucket(step.rows), step.k + 1
        recent = self.plain.get(b)
        # the seconds of a plain pass at this bucket side by side with this step, else None
        beside = recent[1] if recent is not None and self.steps - recent[0] <= self.cfg.side_by_side else None
        if T == 1:
            seconds = step.verify_s if beside is None else beside + 0.5 * (step.verify_s - beside)
            if beside is not None and self.samples(False, b) == 1 and step.verify_s < beside:
                seconds = step.verify_s  # the first plain pass may carry one-time costs: a lower second replaces it
            self.plain[b] = (self.steps, seconds)
            unit = step.verify_s
        elif beside is not None and beside > 0 and step.verify_s >= (1 - self.cfg.reference_drift) * beside:
            self.add(self.ratio, (T, b), step.verify_s / beside)
            unit = beside
        else:  # drafting steps only (or one faster than its plain reference: the machine sped up since, no ratio
            #     learned): this pass in plain-pass units, by the ratio learned before
            unit = step.verify_s / self.ratio_of(T, b)
        if unit <= 0:
            return
        asked = 0 if step.lookup else step.drafting  # a lookup's drafts say nothing of what asking the drafter costs
        if asked:
            self.add(self.draft, b, step.draft_s / asked / unit)
            self.add(self.drafted, (asked, b), step.draft_s / unit)
            self.add(self.offered, (asked, b), float(step.k))
        if step.resync_s > 0:
            self.add(self.resync, b, step.resync_s / unit)
        self.add(self.overhead, (asked > 0 or T > 1, b), step.overhead_s / unit)

    def samples(self, drafting: bool, b: int) -> int:
        """Steps (drafting or plain) whose overhead was measured at bucket b."""
        got = self.overhead.get((drafting, b))
        return 0 if got is None else got.n

    def measured(self, k: int, b: int) -> bool:
        """Whether a step asking k drafts at bucket b was measured (k = 0: a plain pass)."""
        if not k:
            return b in self.plain
        if (k, b) not in self.offered:
            return False
        T = self.verify_shape(k, b)
        return T == 1 or (T, b) in self.ratio

    def verify_shape(self, k: int, b: int) -> int:
        """The verify pass's T a step asking k drafts is expected to have (rounded): k + 1, or less for
        a self-limiting drafter."""
        return round(1 + self.offered_of(k, b))

    def offered_of(self, k: int, b: int) -> float:
        """Drafts a step asking k verifies on average at bucket b: k, or less for a self-limiting drafter."""
        return min(float(k), self.offered[(k, b)].value) if (k, b) in self.offered else float(k)

    def reference_age(self, b: int) -> int:
        """Steps the plain reference at bucket b may age while drafting pays: `explore_min` · 2 after the first
        ratios learned there, doubling with every `side_by_side` learned since, up to `explore_max`."""
        learned = sum(e.n for (_, bb), e in self.ratio.items() if bb == b) // self.cfg.side_by_side
        return min(self.cfg.explore_max, self.cfg.explore_min << min(learned, 16))

    def stale(self, b: int, age: int) -> bool:
        """No plain pass at bucket b within the last `age` steps (the reference the ratios are learned against)."""
        return b not in self.plain or self.steps - self.plain[b][0] >= age

    def _nearest(self, b: int, buckets) -> int | None:
        """The measured bucket closest to b in log scale (the smaller one on a tie)."""
        return min(buckets, key=lambda x: (abs(x.bit_length() - b.bit_length()), x)) if buckets else None

    def _points(self, b: int) -> dict[int, float]:
        return {T: max(1.0, e.value) for (T, bb), e in self.ratio.items() if bb == b}

    def slope(self, b: int) -> float:
        """r(T) − 1 per extra token at bucket b: through r(1) = 1 and the largest shape learned there; else
        the nearest bucket's, steeper by sqrt(b / b') for a larger batch (less idle compute); else the prior."""
        pts = self._points(b)
        if pts:
            top = max(pts)
            return max(0.0, (pts[top] - 1) / (top - 1))
        near = self._nearest(b, {bb for (_, bb) in self.ratio})
        if near is None:
            return self.cfg.prior_verify_slope
        return self.slope(near) * max(1.0, (b / near) ** 0.5)

    def ratio_of(self, T: int, b: int) -> float:
        """r(T, b) = verify(T) / verify(1): learned, between learned shapes (linear), or by the slope."""
        if T == 1:
            return 1.0
        if (T, b) in self.ratio:
            return max(1.0, self.ratio[(T, b)].value)  # a noisy mean under 1 (one-width graph steps: r = 1)
        pts = {1: 1.0} | self._points(b)
        below, above = [t for t in pts if t < T], [t for t in pts if t > T]
        lo = max(below)
        if above:
            hi = min(above)
            return pts[lo] + (pts[hi] - pts[lo]) * (T - lo) / (hi - lo)
        return pts[lo] + self.slope(b) * (T - lo)

    def draft_of(self, b: int) -> float:
        """Drafting per token at bucket b, relative to a plain pass."""
        if b in self.draft:
            return self.draft[b].value
        near = self._nearest(b, set(self.draft))
        return self.cfg.prior_draft_ratio if near is None else self.draft[near].value

    def draft_cost(self, k: int, b: int) -> float:
        """Drafting k tokens at bucket b, relative to a plain pass: measured; between measured k (linear: a fixed
        cost and one per token, as a captured chain of passes has); beyond them, in proportion to the nearest
        (an upper bound past the deepest where part of its cost is fixed); else k times the per-token cost."""
        pts = {kk: e.value for (kk, bb), e in self.drafted.items() if bb == b}
        if k in pts:
            return pts[k]
        below, above = [x for x in pts if x < k], [x for x in pts if x > k]
        if below and above:
            lo, hi = max(below), min(above)
            return pts[lo] + (pts[hi] - pts[lo]) * (k - lo) / (hi - lo)
        if below or above:
            near = max(below) if below else min(above)
            return pts[near] * k / near
        return k * self.draft_of(b)

    def overhead_of(self, drafting: bool, b: int) -> float:
        if (drafting, b) in self.overhead:
            return self.overhead[(drafting, b)].value
        near = self._nearest(b, {bb for (d, bb) in self.overhead if d == drafting})
        if near is not None:
            return self.overhead[(drafting, near)].value
        return self.cfg.prior_overhead_ratio * self.overhead_of(False, b) if drafting else 0.0

    def switch_cost(self, b: int) -> float:
        """Plain passes' worth of work a switch from plain steps to drafting costs at bucket b (the drafter
        restarts the rows that skipped steps); exploring waits this much longer."""
        near = b if b in self.resync else self._nearest(b, set(self.resync))
        return 0.0 if near is None else self.resync[near].value

    def step_cost(self, k: int, b: int) -> float:
        """S(k) at bucket b in plain-pass units: overhead + k drafts + a verify pass of k + 1 tokens per row
        (of 1 + what a self-limiting drafter really drafts when asked for k, between the shapes around it)."""
        if not k:
            return self.overhead_of(False, b) + 1.0
        t = self.offered_of(k, b)
        lo = int(t)
        verify = self.ratio_of(lo + 1, b) + (t - lo) * (self.ratio_of(lo + 2, b) - self.ratio_of(lo + 1, b))
        return self.overhead_of(True, b) + self.draft_cost(k, b) + verify


# ----------------------------------------------------------------------------- the controller


@dataclass(frozen=True)
class Batch:
    """The step to decide: the verify pass's rows, how many of them the controller's k applies to,
    and the explicit k of the others."""

    rows: int
    auto: int
    fixed: tuple[int, ...] = ()


class Evaluation(NamedTuple):
    """A batch's rates for k = 0..k_max and what the choice reads of them and of the costs."""

    rates: list[float]
    base: int  # the explicit rows' k: paid for anyway
    best: int  # the k of the highest rate from base up (the smallest on a tie)
    probe: int  # the k > 0 a probe would try
    switch: float  # 1 + what switching between plain steps and drafting costs, in plain passes
    probe_measured: bool  # the probe's verify shape was measured at this bucket
    cheap: bool  # drafting per token costs at most `cheap_draft` of a plain pass (a lookup)


@dataclass(frozen=True)
class Choice:
    k: int  # drafts per block for the controller's rows
    probe: bool = False  # chosen to measure, not because it is expected to win
    speedup: float = 1.0  # expected tokens/s of this choice over the cheapest one (k = the explicit rows' max)
    timed: bool = True  # False: a step left plain that nothing learns from (the engine times and reports none)


QUIET = Choice(0, timed=False)  # a step left plain that nothing learns from


class Confident(NamedTuple):
    """One row whose draft carried confidence, as verified: what its drafter predicted (Σ_i P_i over the
    drafts verified), what was accepted, the speculator that drafted it (None: the drafter itself; each
    speculator is calibrated on its own), how many drafts were verified (0: not known) and the row."""

    predicted: float
    accepted: int
    source: str | None = None
    drafted: int = 0
    row: int | None = None  # the row (slot) that drafted it (None: not known; no request's own evidence)


@dataclass(frozen=True)
class StepSample:
    """One measured step: the verify pass's rows and draft length (its T is k + 1), the seconds of
    drafting, of the verify pass and of the rest, and (k_b, n_b) of every row that drafted."""

    rows: int
    k: int  # drafts the verify pass covered (T = k + 1)
    draft_s: float
    verify_s: float
    overhead_s: float
    blocks: tuple[tuple[int, int], ...] = ()  # (k asked, n accepted) of every row asked to draft
    resync_s: float = 0.0  # restarting drafter rows that skipped plain steps (0: none needed it)
    asked: int | None = None  # the k the drafter was asked for (None: k); a self-limiting drafter
    #                           (suffix) may draft less, and the verify pass covers only what it drafted
    confident: tuple[Confident, ...] = ()  # every row whose draft carried confidence (plain tuples are read as one)
    lookup: bool = False  # the drafts were free ones on a step left plain (decode.engine `lookup`): no drafting cost
    cut: bool = False  # a lookup whose drafts were all cut before the verify pass (its gate: their confidence did
    #                    not pay), as against one that matched nothing

    @property
    def drafting(self) -> int:
        return self.k if self.asked is None else self.asked


class Controller:
    def __init__(self, cfg: ControllerConfig | None = None):
        self.cfg = cfg or ControllerConfig()
        self.reset()

    def verify_at_one_width(self) -> None:
        """The steps it chooses for verify at one width whatever they verify (the graph backend, by construction):
        a verify pass of T tokens is expected to cost a plain one until measured (prior slope 0, kept by resets),
        and only a pass 20 % faster than its plain reference says the reference is stale (every pass is the same
        captured graph: smaller gaps are the timing's noise, whose low half a tighter bound would drop)."""
        drift = max(0.2, self.cfg.reference_drift)
        self.cfg = self.costs.cfg = replace(self.cfg, prior_verify_slope=0.0, reference_drift=drift)

    def reset(self) -> None:
        """Forget every estimate (back to the priors)."""
        self.acceptance = Acceptance(self.cfg)
        self.costs = Costs(self.cfg)
        self.interval = self.cfg.explore_min
        self.idle = self.cfg.explore_min - 1  # the first probe comes right after the plain reference is measured
        self._cached: tuple[Batch, Evaluation] | None = None  # the last evaluation, and its batch
        self._age = 0  # steps observed since it was made
        self._step_costs: dict[int, list[float]] = {}  # bucket -> S(k) for k = 0..k_max, in use (`step_costs`)
        self._costs_age = 0  # steps observed since they were priced
        self._probing = False  # the last choice was a probe of drafting: its costs are priced again at once
        self._quiet: tuple[Batch, int] | None = None  # (batch, n): its next n choices are untimed plain ones (`choose`)
        self.calibrations: dict[str | None, Calibration] = {}  # per speculator, of rows whose drafts carried confidence
        self.depths: dict[str | None, Acceptance] = {}  # per speculator, per-position acceptance of those rows
        self.rows: dict[int, dict[str | None, RowEvidence]] = {}  # per row, its request's own (`per_request`)
        self.lookup_misses = 0  # lookups in a row that earned no token
        self.lookup_wait = 0  # plain steps before the next lookup
        self.new_shape = 0  # the k of a probe whose verify shape was new at its bucket: probed again at once (0: none)

    # -- inputs

    def observe(self, step: StepSample) -> None:
        self._quiet = None  # a choice rests on what was observed
        # what a drafting step brings that the step costs in use lack: a probe's costs, or a shape never measured
        if step.drafting and not step.lookup and (
                self._probing or not self.costs.measured(step.drafting, bucket(step.rows))):
            self._step_costs.clear()
        self._costs_age += 1
        if self._costs_age >= self.cfg.refresh:
            self._step_costs.clear()
        self.costs.observe(step)
        for k, n in step.blocks:
            self.acceptance.observe(k, n)
        rows = [Confident(*row) for row in step.confident]
        for row in rows:
            self.calibration(row.source).observe(row.predicted, row.accepted)
            if row.drafted:
                self.depth(row.source).observe(row.drafted, row.accepted)
            if row.row is not None and speculator_of(row.source) in self.cfg.per_request:
                own = self.row_evidence(row.row, row.source)
                own.calibration.observe(row.predicted, row.accepted)
                if row.drafted:
                    own.depth.observe(row.drafted, row.accepted)
                own.cuts = 0
                retry = self.cfg.row_retry  # after one that earned nothing, twice the last wait
                own.retry = retry if row.accepted else min(max(2 * own.retry, retry), self.cfg.explore_max)
        if step.lookup:
            self.looked_up(any(row.accepted for row in rows), bool(rows) or step.cut)
        if step.drafting and not step.lookup:  # a lookup's free drafts say nothing of what asking k earns
            self._cached = None
        self._age += 1  # another observed step since the last evaluation

    def row_left(self, row: int) -> None:
        """Its request left the row (slot): its own evidence goes with it."""
        self.rows.pop(row, None)

    def drafter_swapped(self) -> None:
        """A new drafter (version) serves: its acceptance is unknown; the old estimate stays as a weak
        prior, and a probe comes soon."""
        self.acceptance.fade(self.cfg.swap_keep)
        for source in (None, "adaptive"):  # the served drafter's; the other speculators did not change
            for key in (source, calibrated_as(source, True)):
                self.calibration(key).fade(self.cfg.swap_keep)
                self.depth(key).fade(self.cfg.swap_keep)
        self.interval = self.cfg.explore_min
        self._cached = self._quiet = None

    def looked_up(self, earned: bool, tried: bool) -> None:
        """After a lookup: the next one comes at once if this one earned a token; after one step if nothing
        matched (in grounded text a copy starts anywhere: the next match is looked for soon); after 1, 3, ...
        steps (at most `lookup_backoff`) while lookups that found drafts (`tried`: verified, or all cut by the
        gate) keep earning nothing, so that where free drafts never pay they cost next to nothing: a gate that
        cuts every draft is not free either (at T = 1 on the fetched pair every other step was such a lookup,
        0.17 ms of a 4 ms step: bench/README section 32)."""
        if earned:
            self.lookup_misses = self.lookup_wait = 0
            return
        if not tried:
            self.lookup_wait = 1
            return
        self.lookup_misses = min(self.lookup_misses + 1, 16)
        self.lookup_wait = min((1 << self.lookup_misses) - 1, self.cfg.lookup_backoff)

    def lookup_due(self) -> bool:
        """Whether a step left plain looks the free drafts up (specloop.drafter.decode.engine); counts down the wait."""
        if self.lookup_wait:
            self.lookup_wait -= 1
            return False
        return True

    # -- the decision

    def rates(self, batch: Batch) -> list[float]:
        """Expected tokens of the whole batch per plain-pass time, for k = 0..k_max of the controller's rows."""
        a, b = self.acceptance.rates(), bucket(batch.rows)
        floor = max(batch.fixed, default=0)
        fixed_tokens = sum(expected_tokens(a, k) for k in batch.fixed)
        costs = self.step_costs(b) if floor <= self.cfg.k_max else [self.costs.step_cost(floor, b)] * (floor + 1)
        return [(batch.auto * expected_tokens(a, k) + fixed_tokens) / costs[max(k, floor)]
                for k in range(self.cfg.k_max + 1)]

    def step_costs(self, b: int) -> list[float]:
        """S(k) for k = 0..k_max at bucket b (`Costs.step_cost`), priced again after `refresh` observed steps, a
        probe that drafted, or a step that drafted at a shape never measured; in between, only the acceptance
        moves the choice (it is what changes step by step). Pricing every k on every drafting step cost the host
        ~0.1 ms a step (ngram at batch 8 on an H200: 0.91× the verifier alone where k = 4 fixed made 1.02×,
        bench/README.md section 34)."""
        if b not in self._step_costs:
            if not self._step_costs:
                self._costs_age = 0
            self._step_costs[b] = [self.costs.step_cost(k, b) for k in range(self.cfg.k_max + 1)]
        return self._step_costs[b]

    def _evaluate(self, batch: Batch) -> Evaluation:
        """What the choice rests on, reused until `refresh` steps of the same batch were observed since, or a step
        drafted (what the reuse can miss, plain steps' costs, moves slowly; drafting steps bring new acceptance and
        shapes; a lookup's free drafts do not: the drafter was not asked): a step nothing observes (`Choice.timed`)
        changes no estimate, and costs no evaluation."""
        if self._cached is not None and self._cached[0] == batch and self._age < self.cfg.refresh:
            return self._cached[1]
        rates, b = self.rates(batch), bucket(batch.rows)
        base = min(max(batch.fixed, default=0), self.cfg.k_max)  # paid for by explicit rows anyway
        best = max(range(base, len(rates)), key=lambda k: (rates[k], -k))
        probe = max(range(1, len(rates)), key=lambda k: (rates[k], -k))
        cheap = b in self.costs.draft and self.costs.draft_of(b) <= self.cfg.cheap_draft
        # a probe, or a plain step amid drafting, costs `switch` times more
        got = Evaluation(rates, base, best, probe, 1 + self.costs.switch_cost(b), self.costs.measured(probe, b), cheap)
        self._cached, self._age = (batch, got), 0
        return got

    def choose(self, batch: Batch) -> Choice:
        quiet = self._quiet  # what the last choice said of the steps after it
        if quiet is not None and quiet[1] and (quiet[0] is batch or quiet[0] == batch):
            self._quiet = (batch, quiet[1] - 1)
            return self._chose(QUIET)
        e, b = self._evaluate(batch), bucket(batch.rows)
        rates, base, best, switch = e.rates, e.base, e.best, e.switch
        if base == 0 and self.costs.samples(False, b) < 2:
            # the reference every cost is relative to: two plain passes first, as the first step of an engine
            # carries one-time costs (~2× a later plain step on the graph backend) and a lower second sample
            # replaces it; priced against the first alone, drafting looks cheaper than it is
            return self._chose(Choice(0))
        if best > base and rates[best] >= (1 + self.cfg.margin) * rates[base]:
            self.interval = self.cfg.explore_min
            if base == 0 and self.costs.stale(b, round(self.costs.reference_age(b) * switch)):  # refresh the reference
                return self._chose(Choice(0, True))
            return self._chose(Choice(best, False, rates[best] / rates[base]))
        if base == 0:
            # the first drafting step carries one-time costs too, and so does the first verify pass of a shape: a
            # second probe follows at once (of the same k, where its shape was new), and a lower sample replaces it
            again = self.costs.samples(True, b) == 1 or self.new_shape > 0
            # the deepest k is probed once its bucket's drafting was measured at another: what drafting costs per
            # token is then known apart from what it costs per call (a captured chain of k_max drafts costs as much
            # for one); priced from one shallow k alone, a deep block's cost was that k's times k
            deep = self.cfg.k_max if not again and (self.cfg.k_max, b) not in self.costs.drafted and any(
                bb == b for (_, bb) in self.costs.drafted) else 0
            probe = self.new_shape or deep or e.probe
            due = self.interval if e.probe_measured and not deep else self.cfg.explore_min
            if (again or self.idle >= due * switch) and not self.costs.stale(b, self.cfg.side_by_side):
                if not again:
                    self.interval = self.cfg.explore_min if e.cheap else min(2 * self.interval, self.cfg.explore_max)
                # a probe of a shape never measured here is probed again (once) at once
                self.new_shape = 0 if again else probe * (not self.costs.measured(probe, b))
                return self._chose(Choice(probe, True, rates[probe] / rates[0]))
            # left plain with no probe due: untimed but for the last `side_by_side` steps before one, the plain
            # reference the probe is priced against (a plain step's cost moves slowly; timing it costs the host)
            timed = again or self.idle + 1 + self.cfg.side_by_side >= due * switch
            if not timed:  # so are the next ones until then: nothing they decide on changes unobserved
                self._quiet = (batch, math.ceil(due * switch - self.cfg.side_by_side - self.idle - 2))
            return self._chose(QUIET if not timed else Choice(0))
        return self._chose(Choice(base))

    def _chose(self, choice: Choice) -> Choice:
        self.idle = 0 if choice.k else self.idle + 1
        self._probing = choice.probe and choice.k > 0
        return choice

    # -- confidence

    def calibration(self, source: str | None = None) -> Calibration:
        """The live calibration of one speculator's confidence (None: the drafter's own)."""
        if source not in self.calibrations:
            self.calibrations[source] = Calibration(self.cfg.calibration_decay)
        return self.calibrations[source]

    def depth(self, source: str | None = None) -> Acceptance:
        """Per-position acceptance of one speculator's confident drafts (what a draft as deep as i earned)."""
        if source not in self.depths:
            self.depths[source] = Acceptance(ControllerConfig(k_max=MAX_DEPTH, prior_acceptance=0.9,
                                                              depth_discount=1.0))
        return self.depths[source]

    def row_evidence(self, row: int, source: str | None) -> RowEvidence:
        """A row's request's own outcomes of one speculator's drafts."""
        own = self.rows.setdefault(row, {})
        if source not in own:
            own[source] = RowEvidence(Calibration(1.0, 0.0, 0.0), Acceptance(replace(
                self.depth(source).cfg, acceptance_decay=1.0, prior_strength=self.cfg.prior_strength)))
        return own[source]

    def cuts(self, confidence: list[list[float]], keep: list[int], sources: list[str | None] | None) -> None:
        """The gate's verdict on a step's drafts (`cut`, as applied): a `per_request` speculator's rows it cut
        count towards their next try."""
        for row, (probs, kept) in enumerate(zip(confidence, keep)):
            source = None if sources is None else sources[row]
            if probs and not kept and speculator_of(source) in self.cfg.per_request:
                self.row_evidence(row, source).cuts += 1

    def _weights(self, source: str | None, row: int, promised: float, scales: dict | None = None,
                 depth: bool = True) -> tuple[float, list[float]]:
        """(c, a_1..a_MAX_DEPTH) the gate weighs a row's draft by (`depth` False: c alone is read, and the rates
        are the speculator's): the speculator's (made once a call where `scales` holds them), or for a `per_request`
        speculator the row's own evidence beside it where it says more (a request that copies its prompt earns where
        others did not; one whose drafts fail is judged as the rest, whose failures the calibration holds: cutting
        more there kept the copies of a grounded request's later text unverified after its first short drafts
        failed). A draft promising at least `try_tokens` is taken at the speculator's word (c ≥ 1, its depth prior
        at least) where the row has no verified draft yet, or had `retry` drafts cut since: other requests'
        outcomes, or the row's own early ones, never keep a request from copying (a suffix calibration learned on
        chat cut every draft of a later request that edited its prompt, and learned nothing more: bench/README.md
        section 53)."""
        scales = {} if scales is None else scales
        if source not in scales:
            scales[source] = (self.confidence_scale(source), self.depth(source).rates())
        c, rates = scales[source]
        if speculator_of(source) not in self.cfg.per_request:
            return c, rates
        own = self.rows.get(row, {}).get(source)
        if promised >= self.cfg.try_tokens and (own is None or own.cuts >= own.retry):
            prior = self.depth(source).cfg.prior_acceptance  # a depth estimate's prior at every position
            return max(1.0, c), [max(a, prior) for a in rates] if depth else rates
        if own is None or not own.calibration.predicted:
            return c, rates
        w, cal = self.cfg.row_prior, own.calibration  # never below the speculator's: the row's failures are in it
        c = max(c, (cal.accepted + w * c) / (cal.predicted + w))
        return c, list(map(max, own.depth.toward(rates), rates)) if depth else rates

    def free_scales(self, rows: list[int], sources: list[str | None], promised: list[float]) -> list[float]:
        """c for each row's draft of speculator sources[i] (a calibration key) promising promised[i] (Σ_j P_j), as the
        gate weighs it (`_weights`): what a mix of speculators weighs a row's suffix draft against its model's by."""
        scales: dict[str | None, tuple[float, list[float]]] = {}  # per speculator, once a call
        return [self._weights(s, r, p, scales, depth=False)[0] for r, s, p in zip(rows, sources, promised)]

    def confidence_scale(self, source: str | None = None) -> float:
        """c: what a speculator's confident drafts really earned over what it predicted (1 before any)."""
        return self.calibration(source).scale

    def cut(self, confidence: list[list[float]], rows: int, sources: list[str | None] | None = None) -> list[int]:
        """Per row, how many of its drafts the verify pass keeps (see the module doc: one width W* for the
        batch) for cumulative acceptance probabilities confidence[b] = [P_1, P_2, ...] (non-increasing),
        at the bucket of a `rows`-row verify pass; row b's confidence is scaled by the calibration of the
        speculator that drafted it (`sources[b]`; None: the drafter's)."""
        b = bucket(rows)
        width = max(map(len, confidence), default=0)
        costs = [self.costs.overhead_of(W > 0, b) + self.costs.ratio_of(W + 1, b) for W in range(width + 1)]
        gains = [0.0] * (width + 1)
        scales: dict[str | None, tuple[float, list[float]]] = {}  # per speculator: c and a_1..a_MAX_DEPTH, once
        for row, probs in enumerate(confidence):
            source = None if sources is None else sources[row]
            (c, rates), total, run = self._weights(source, row, sum(probs), scales), 1.0, 1.0
            earned = [total]
            for i, p in enumerate(probs):  # c · P_i, but never above what drafts this deep earned: Π_{j≤i} a_j
                run *= rates[min(i, MAX_DEPTH - 1)]
                earned.append(total := total + min(c * p, run))
            for W in range(width + 1):
                gains[W] += earned[min(W, len(probs))]
        best = max(range(width + 1), key=lambda W: (gains[W] / costs[W], -W))
        return [min(best, len(probs)) for probs in confidence]

    # -- for metrics

    def estimates(self, rows: int) -> dict:
        """{"acceptance": [a_1..], "speedup": [rate(k) / rate(0) for k = 0..k_max]} for a batch of `rows`
        rows whose k the controller chooses."""
        rates = self.rates(Batch(rows, rows))
        return {"acceptance": self.acceptance.rates(), "speedup": [r / rates[0] for r in rates]}
