"""Continuous batching: a fixed pool of cache slots that requests join and leave between steps.

Pure torch, no processes: `generate()` and the serving worker both drive an `Engine`.

- `admit(requests)` prefills new prompts into free slots (one forward for all of them, the other
  rows untouched) — between two steps, never inside one.
- `step()` runs one `speculative_step` over the pool. Rows differ in k, temperature, top-k/top-p
  and seed: the drafter proposes max k for every row, and row b accepts at most its own k (the
  position after is its bonus, drawn from p alone), so each row is decoded exactly as it would be
  alone — the same token ids at temperature 0, the same draws from its own seeded stream.
- k = None ("auto"): the engine's `Controller` (drafter/decode/controller.py) chooses one k for all such
  rows at every step, from the acceptance and step times it is fed after each step; explicit-k rows
  keep theirs. When every row's k is 0 the step is plain decoding: no drafter call at all, so the
  drafter falls behind on those rows; before a row drafts again, `join` restarts it from the row's
  committed tokens (exact; a drafter LM re-prefills them, an SD² drafter's steering inputs are zeros
  for that first block: fewer accepted drafts, never other output). A drafter that follows plain steps
  lazily (an eagle head, or a mix of eagle heads whose suffix member still follows: `follows_lazily`) skips the
  plain steps (and lookups) the controller does not time (no probe due) where no hook observes plain steps; a
  row it skipped decodes the next drafting step plain, which it follows, and drafts from the one after: where
  speculation is off, the step costs what the verifier alone's does.
- Free drafts: on a step the controller leaves plain, a drafter with a `lookup` (suffix decoding,
  alone or in a mix of speculators) is still asked for the drafts that cost no model pass, and each
  row keeps what its confidence pays for (the controller's `cut`); rows with none verify `last`
  alone. The prompt and the turns draft wherever they match, whatever the learned head earns.
- A request leaves the moment it finishes (EOS, stop string, max tokens) or is aborted; its slot is
  free for the next `admit`. Empty slots ride along inactive (their cache never advances).
- The engine owns each running request's state (`LiveRequest`: the request, its generation so far,
  its random stream), found by id with `get`; `step()` hands a finished request's `Generation` over
  on its last update.
- `offer_swap()` (between steps, and before every drafting step) lets the hooks hand over a new
  drafter version: the one place `drafter` is written after construction.

A step is planned (`StepPlan`, drafter/decode/plan.py: the rows, each row's k, the sampling params, the
uniforms), run (`speculative_step`) and committed (row updates, the controller's observation, timing).
Uniforms per step (kmax = max k of the live rows): row b with its own k_b draws 2 k_b + 1 from its stream,
as `generate` alone would: `u_draft[b, :k_b]` drive drafting, `u_accept[b, :k_b]` the accept tests,
`u_accept[b, kmax]` the emitted token; the other columns are unused filler.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

import torch

from specloop.drafter.decode.capacity import draft_reserve, positions_needed
from specloop.drafter.decode.controller import Batch, Choice, Confident, Controller, StepSample, calibrated_as
from specloop.drafter.decode.grammar import GrammarCompiler, GrammarSpec
from specloop.drafter.decode.logprobs import Scoring, TokenScore, scoring_for
from specloop.drafter.decode.plan import StepPlan
from specloop.drafter.decode.prefix_cache import PrefixCache, cache_output, cut_free, prefill_cached
from specloop.drafter.decode.proposer import FREE_SOURCES, Drafter, VerifierView
from specloop.drafter.decode.rejection import BlockOutcome, rejection_sample
from specloop.drafter.decode.requests import EngineRequest, Generation, RowUpdate, StopRule
from specloop.drafter.decode.sampling import RowParams, SamplingParams, make_generators, warp_key
from specloop.drafter.decode.shaping import Controls, RowShaping, StepShaper
from specloop.drafter.decode.speculative import (
    Gate,
    Sampler,
    StepClock,
    StepHooks,
    StepOptions,
    follows_plain,
    lazy_part,
    speculative_step,
)
from specloop.drafter.decode.stats import AcceptanceStats
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.graph import GraphDecoder, graph_ready, on_backend, resolve_backend
from specloop.drafter.model.kv_cache import KVCache, prefill_rows


@dataclass
class LiveRequest:
    """A running request as the engine holds it."""

    request: EngineRequest
    slot: int
    gen: Generation  # its tokens, stats (and log-probabilities) so far
    generator: torch.Generator | None  # None when greedy
    shaping: RowShaping | None = None  # its sampling controls and grammar (None: none asked)

    @property
    def history(self) -> list[int]:
        return self.request.prompt + self.gen.token_ids


class OwnLM(Protocol):
    """A drafter with an LM of its own (drafter/kinds/pretrained.py), which the Drafter protocol does not
    name: the engine reads these where the drafter has a `graph_width`."""

    graph_width: int  # its widest decode pass: specloop.drafter.model.graph runs its LM at this width
    lean: LeanDecoder | GraphDecoder
    cache: KVCache


class Chained(Protocol):
    """A drafter whose greedy drafts can run as one captured graph (drafter/kinds/eagle.py): the engine
    says for how many rows and how deep, or None (the eager loop)."""

    def use_chain(self, slots: int | None, depth: int = 0, compiled: bool = True) -> None: ...


@dataclass
class StepTiming:
    """The last step: its times, and the controller's choice when it had rows to choose for."""

    forward_s: float = 0.0  # inside speculative_step (draft + verify passes, acceptance)
    total_s: float = 0.0  # the whole step, Python bookkeeping included
    draft_s: float = 0.0  # drafter.propose
    verify_s: float = 0.0  # the verify pass and the verdict
    resync_s: float = 0.0  # restarting drafter rows that fell behind during plain steps
    trace_s: float = 0.0  # the trace callback (replay records, inline): not priced by the controller, whose
    #                       choice would follow the logger's costs (a cold first record: tens of ms) otherwise
    choice: Choice | None = None  # the controller's k for the auto rows (None: no auto row, or no drafter)


@dataclass
class Engine:
    verifier: LeanDecoder
    drafter: Drafter | None
    slots: int
    capacity: int  # positions per slot: a request's `specloop.drafter.decode.capacity.positions_needed` must fit
    stop_rule: StopRule
    sampler: Sampler = rejection_sample
    hooks: StepHooks | None = None
    controller: Controller = field(default_factory=Controller)  # chooses k for the auto rows
    timing: StepTiming = field(default_factory=StepTiming)  # of the last step
    # specloop.drafter.model.graph: "eager", "graph", or auto (None: graph on CUDA, eager on the CPU)
    backend: str | None = None
    # graph backend: compile the static step (SPECLOOP_COMPILE=0: run the same function eagerly, for tests and
    # debugging)
    compile_graphs: bool = field(default_factory=lambda: os.environ.get("SPECLOOP_COMPILE", "1") != "0")
    # steps the controller leaves plain still verify the drafter's free drafts (`Drafter.lookup`: suffix decoding
    # over the request's prompt and turns) where their confidence pays for them; False: plain means plain
    lookups: bool = True
    # what a row's grammar forces next (a schema's keys, its punctuation) is drafted free where the drafter follows
    # the verdict (`_forced`): on drafting steps where its own draft is shorter, and as a lookup on steps left plain
    grammar_drafts: bool = True
    # structured output: matchers for requests that name a grammar (None: such requests are refused)
    grammars: GrammarCompiler | None = None
    # prefix caching (drafter/decode/prefix_cache.py): prompts reuse the KV of prefixes earlier requests computed
    # (the cache may be shared by engines of one verifier); None: every prompt is prefilled in one pass
    prefix_cache: PrefixCache | None = None

    def __post_init__(self) -> None:
        self.backend = self._graph_backend(self.backend)
        self.cache = self.verifier.new_cache(self.slots, self.capacity)
        self.rows: list[LiveRequest | None] = [None] * self.slots
        self._slot_of: dict[str, int] = {}  # running request id -> slot
        self.last = torch.zeros(self.slots, dtype=torch.long)
        self.behind: set[int] = set()  # slots whose drafter state missed plain steps
        self.stale: set[int] = set()  # slots whose following drafter skipped untimed plain steps (`_lazy`)
        # finished requests whose history the prefix cache takes when the engine is idle (`cache_finished`):
        # slot -> (prompt length, prompt + output); dropped when the slot is reused first
        self.finished: dict[int, tuple[int, list[int]]] = {}
        self._batch: tuple[Batch | None] | None = None  # what `_choose` asks of the running requests (None: not made)
        # this step's lookup pre-check (`_free_drafts_verified`): (confidence, sources, keep), which the step's gate
        # takes instead of pricing the same drafts again (`_cut`); made and dropped within one step's plan and gate
        self._precut: tuple | None = None
        if self.drafter is not None:
            self._start_drafter(self.drafter)
        self.warm_s = self._warm()  # graph backend: seconds spent compiling / capturing the steps at start-up

    def _graph_backend(self, wanted: str | None) -> str:
        """Wrap the verifier (and a drafter's own LM) in specloop.drafter.model.graph's static step where the backend is
        graph; returns the backend the engine runs. Auto falls back to eager for weights the step cannot
        run (quantized: specloop.drafter.model.kernels); an explicit "graph" refuses them."""
        backend = resolve_backend(wanted, self.verifier.device)
        why = graph_ready(self.verifier) if backend == "graph" else None
        if why is not None:
            if wanted == "graph":
                raise ValueError(f"backend graph: {why}")
            backend = "eager"
        width = self.controller.cfg.k_max + 1  # W: a plain step is a verify pass with one real query
        self.verifier = on_backend(self.verifier, backend, self.slots, width, self.compile_graphs)
        if backend == "graph":  # every step runs at width W: the controller's prior knows it
            self.controller.verify_at_one_width()
        self._graph_drafter(self.drafter, backend)  # eager: a drafter an earlier graph engine wrapped runs eagerly
        return backend

    def _graph_drafter(self, drafter: Drafter | None, backend: str) -> None:
        """A drafter with an LM of its own (`graph_width`: its widest pass) drafts through this engine's
        static step on the graph backend (its LM as this engine's slots need it), through its own
        LeanDecoder on the eager one."""
        width = getattr(drafter, "graph_width", 0)
        own = cast(OwnLM, drafter)  # read only where it has a graph_width
        if width and graph_ready(own.lean) is None:
            own.lean = on_backend(own.lean, backend, self.slots, width, self.compile_graphs)
        chained = hasattr(drafter, "use_chain")  # a head whose greedy drafts run as one captured graph (eagle)
        if chained:
            direct = backend == "graph" and getattr(self.verifier, "direct", False)  # the verifier's own graphs
            cast(Chained, drafter).use_chain(self.slots if direct else None, self.controller.cfg.k_max,
                                             self.compile_graphs)

    def _warm(self) -> float:
        """Graph backend: build the verifier's step for the capture sets its steps use (none; the drafter's
        layers) and a drafter LM's step, before the first request pays for it."""
        if self.backend != "graph":
            return 0.0
        layers = tuple(self.drafter.verifier_layers) if self.drafter is not None else ()
        assert isinstance(self.verifier, GraphDecoder)  # _graph_backend wrapped it (on_backend, graph)
        seconds = self.verifier.warm(self.cache, {layers})  # plain steps run that graph too (`_capture_set`)
        if self.verifier.chunked_prefill:  # admissions' prefills (kv_cache.prefill_rows, prefix_cache.prefill_row)
            seconds += self.verifier.warm_prefill(self.cache.capacity, layers)
        lm = getattr(self.drafter, "lean", None)
        if isinstance(lm, GraphDecoder) and lm is not self.verifier:  # a drafter with an LM of its own
            biased = getattr(self.drafter, "graph_biased", False)  # an SD² drafter's passes carry MLP biases
            drafter_cache = cast(OwnLM, self.drafter).cache
            seconds += lm.warm(drafter_cache, {()}, last_only=True, biased=biased)
            if lm.chunked_prefill:
                seconds += lm.warm_prefill(drafter_cache.capacity, ())
        return seconds

    def close(self) -> None:
        """Hand the graph backend's pool to the next engine of its shape (with its captured graphs) now rather
        than once this engine is collected; the engine must not step after this."""
        if isinstance(self.verifier, GraphDecoder):
            self.verifier.release(self.cache)

    def _start_drafter(self, drafter: Drafter) -> None:
        self._calibrate(drafter)
        empty = [[0]] * self.slots
        zeros = {i: torch.zeros(self.slots, self.verifier.hidden_size, device=self.verifier.device,
                                dtype=self.verifier.dtype) for i in drafter.verifier_layers}
        drafter.start(empty, self.capacity, VerifierView(self.cache, zeros))

    def _calibrate(self, drafter: Drafter) -> None:
        """A drafter that weighs free drafts against its model's (a mix of speculators: `calibrated_by`) does so by
        this engine's controller, the one whose gate judges them."""
        if hasattr(drafter, "calibrated_by"):
            drafter.calibrated_by(self.controller)

    # -- admission

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def free(self) -> list[int]:
        return [s for s, r in enumerate(self.rows) if r is None]

    def get(self, request_id: str) -> LiveRequest | None:
        """The running request `request_id` (None once it finished or was aborted)."""
        slot = self._slot_of.get(request_id)
        return None if slot is None else self.rows[slot]

    def live(self) -> list[LiveRequest]:
        """Every running request, by slot."""
        return [r for r in self.rows if r is not None]

    def reserve(self, k: int | None) -> int:
        """Positions a request of draft length k needs beyond prompt + output (auto: the controller's k_max)."""
        return draft_reserve(k, self.controller.cfg.k_max)

    def fits(self, prompt_len: int, max_tokens: int, k: int | None) -> bool:
        return positions_needed(prompt_len, max_tokens, k, self.controller.cfg.k_max) <= self.capacity

    def admit(self, requests: list[EngineRequest]) -> list[int]:
        """Prefill `requests` into free slots (at most len(free) of them); returns their slots."""
        if not requests:
            return []
        if len(requests) > len(self.free):
            raise ValueError(f"{len(requests)} requests for {len(self.free)} free slots")
        for r in requests:
            self._check(r)
        shapings = [self._shaping(r) for r in requests]  # a grammar that does not compile refuses before any prefill
        slots = self.free[: len(requests)]
        prompts = [r.prompt for r in requests]
        layers = tuple(self.drafter.verifier_layers) if self.drafter is not None else ()
        tail = getattr(self.drafter, "feature_window", 0)  # a windowed head (eagle3) reads the prompt's last positions
        for s in slots:  # their rows are overwritten: an answer not yet cached is not (prompts still are)
            self.finished.pop(s, None)
        features, recent, lens = self._prefill(slots, prompts, layers, tail)
        deferred = self._defers_join(requests)
        if self.drafter is not None and not deferred:
            self._drafter_prefix_cache()
            window = (recent, lens) if tail else (None, None)
            self.drafter.join(slots, prompts, VerifierView(self.cache, features, *window))
        for s, r, shaping in zip(slots, requests, shapings):
            gen = None if r.params.greedy else make_generators(r.params.seed, 1, start=r.stream)[0]
            positions = self.controller.cfg.k_max if r.k is None else r.k
            scores: list[TokenScore] | None = None if r.logprobs is None else []
            self.rows[s] = LiveRequest(r, s, Generation([], None, AcceptanceStats(positions), scores), gen,
                                       shaping)
            self._slot_of[r.id] = s
            self.last[s] = r.prompt[-1]
        self._batch = None
        (self.behind.update if deferred else self.behind.difference_update)(slots)
        self.stale.difference_update(slots)
        return slots

    def _defers_join(self, requests: list[EngineRequest]) -> bool:
        """Whether admitted rows start in the drafter only when they first draft (`_resync`), not now: while the
        controller leaves speculation off (its last step untimed), for a drafter that reads no verifier features
        and falls behind on plain steps anyway (a drafter LM: its prefill of the prompt is saved where it never
        drafts), and requests that leave k to the controller or decode plain."""
        d, last = self.drafter, self.timing.choice
        if d is None or follows_plain(d) or d.verifier_layers:
            return False
        return last is not None and not last.k and not last.timed and not any(r.k for r in requests)

    def _check(self, r: EngineRequest) -> None:
        if not r.prompt:
            raise ValueError(f"request {r.id}: empty prompt")
        if r.id in self._slot_of:
            raise ValueError(f"request {r.id} is already running")
        if r.k and self.drafter is None:
            raise ValueError(f"request {r.id}: k = {r.k} needs a drafter")
        if r.params.stop and self.stop_rule.decode is None:
            raise ValueError("stop strings need a decode function")
        if r.k is not None and r.k < 0:
            raise ValueError(f"request {r.id}: k = {r.k} < 0")
        if self.backend == "graph" and r.k is not None and r.k > self.controller.cfg.k_max:
            raise ValueError(f"request {r.id}: k = {r.k} exceeds the graph step's {self.controller.cfg.k_max} drafts "
                             "per block (the controller's k_max)")
        if r.grammar is not None and self.grammars is None:
            raise ValueError(f"request {r.id}: structured output needs a tokenizer (the engine has no grammars)")
        if r.logprobs is not None and r.logprobs < 0:
            raise ValueError(f"request {r.id}: logprobs = {r.logprobs} < 0")
        if not self.fits(len(r.prompt), r.params.max_tokens, r.k):
            raise ValueError(f"request {r.id}: {len(r.prompt)} prompt tokens + {r.params.max_tokens} new "
                             f"(+ {self.reserve(r.k)} for drafting) exceed the {self.capacity}-position context")

    def _shaping(self, r: EngineRequest) -> RowShaping | None:
        """The request's shaping state (None when it asks for no control, grammar or stop token)."""
        if r.controls.neutral and r.grammar is None:
            return None
        grammar = None
        if r.grammar is not None:
            assert self.grammars is not None  # checked in `_check`
            grammar = self.grammars.matcher(r.grammar)
        ends = self.stop_rule.eos_ids | frozenset(r.params.stop_token_ids)
        return RowShaping(r.controls, r.prompt, self.verifier.vocab_size, ends, grammar)

    def abort(self, request_id: str) -> bool:
        """Free the request's slot now (between steps); False if it is not running."""
        if request_id not in self._slot_of:
            return False
        self._leave(self._slot_of[request_id])
        return True

    def _leave(self, slot: int) -> None:
        row = self._row(slot)
        del self._slot_of[row.request.id]
        self.rows[slot] = None
        self._batch = None
        self.controller.row_left(slot)
        self.behind.discard(slot)
        self.stale.discard(slot)
        if self.prefix_cache is not None and self.prefix_cache.outputs and row.gen.finish_reason is not None:
            if cut_free(self.verifier):  # copies of the row's own KV: now, before the slot is taken
                cache_output(self.verifier, self.cache, slot, len(row.request.prompt), row.history, self.prefix_cache)
            else:  # a second prefill: idle work (`cache_finished`)
                self.finished[slot] = (len(row.request.prompt), row.history)

    def cache_finished(self, most: int | None = None) -> int:
        """Idle work: the histories of finished requests (at most `most` of them; None: all) prefilled into the
        prefix cache (`cache_output`), so a next chat turn (previous prompt + answer + new message) finds the answer
        cached. Never on a step's path: done at a finish it would hold every running row and the finished request's
        last chunk; a serving loop calls this when nothing runs. Returns the blocks added. (Where every row is computed
        alike, `prefix_cache.cut_free`, answers are cached at their finish instead, from their rows' KV.)"""
        added = 0
        for slot in sorted(self.finished)[:most]:
            n, history = self.finished.pop(slot)
            assert self.prefix_cache is not None and self.rows[slot] is None  # set by `_leave`, popped on reuse
            added += cache_output(self.verifier, self.cache, slot, n, history, self.prefix_cache)
        return added

    # -- prefix caching

    def _prefill(self, slots: list[int], prompts: list[list[int]], layers: tuple[int, ...], tail: int):
        """The prompts' KV into rows `slots` of the pool: one pass per prompt without a prefix cache, else the
        cache's hit copied in and the rest prefilled by its aligned passes (exact: drafter/decode/prefix_cache.py).
        Returns (features, recent, recent_lens) as `prefill_rows` does."""
        if self.prefix_cache is None:
            return prefill_rows(self.verifier, self.cache, slots, prompts, layers, tail)
        return prefill_cached(self.verifier, self.cache, slots, prompts, self.prefix_cache, layers, tail)

    def _drafter_prefix_cache(self) -> None:
        """A drafter with an LM of its own (a `prefix_cache` attribute: drafter/kinds/pretrained.py) caches that LM's
        prompt prefixes in a cache of its own (other weights, other KV): one per drafter object, so a version swapped
        in starts with an empty one."""
        if self.prefix_cache is not None and getattr(self.drafter, "prefix_cache", False) is None:
            setattr(self.drafter, "prefix_cache", self.prefix_cache.sibling())

    def offer_swap(self) -> None:
        """Between steps: the hooks may hand over a new drafter version that took over the old one's
        rows (a hot swap, or a version switched in between requests); the controller is told."""
        if self.hooks is None or self.drafter is None:
            return
        new = self.hooks.swap(self.drafter, self._histories())
        if new is not self.drafter:
            assert self.backend is not None  # resolved in __post_init__
            self._graph_drafter(new, self.backend)
            self._calibrate(new)
            self.drafter = new
            self.controller.drafter_swapped()

    def _histories(self) -> list[list[int]]:
        return [r.history if r is not None else [0] for r in self.rows]

    def _row(self, slot: int) -> LiveRequest:
        """The request running in `slot`, a slot the caller knows is occupied (a live row of the step)."""
        row = self.rows[slot]
        assert row is not None, f"slot {slot} holds no request"
        return row

    # -- one step

    def step(self) -> list[RowUpdate]:
        """One speculative step over every running request, on the pool's occupied prefix: rows [0, m) with
        m = 1 + the highest occupied slot (admission fills the lowest free slots first), so a half-empty pool
        costs what its running requests cost. Plan (`_plan`: k per row, sampling, uniforms) → run
        (`speculative_step`) → commit (`_commit`: row updates, timing, the controller's observation)."""
        t0 = time.perf_counter()
        plan = self._plan()
        if plan is None:
            return []
        m = plan.m
        drafter, on_trace = self._hooked(plan.k)
        resync_s = self._resync([s for s in plan.live if plan.row_k[s] and s in self.behind]) if plan.k else 0.0
        timed = self._timed(plan)
        lazy = self._lazy(plan)
        # a lazy step runs as the verifier alone's (nothing captured), but for what must see every token (a mix's
        # suffix decoding): the drafter's rows go stale
        drafter = lazy_part(drafter) if lazy else drafter
        follow = bool(plan.k) or follows_plain(drafter)
        if not plan.k and self.drafter is not None and not follow and not lazy:
            self.behind.update(plan.live)
        (self.stale.update if lazy else self.stale.difference_update)(plan.live)
        cache = self._step_cache(m)
        narrowed = drafter.narrow(m) if drafter is not None and follow and m < self.slots else drafter
        clock = StepClock() if timed else None  # the controller's costs: only where it learns them
        scoring = scoring_for({s: top for s in plan.live if (top := self._row(s).request.logprobs) is not None})
        options = StepOptions(self.sampler, on_trace, clock, scoring, self._gate(plan))
        t1 = time.perf_counter()
        outcome = speculative_step(self.verifier, cache, self.last[:m], narrowed, plan, options=options)
        t2 = time.perf_counter()
        if narrowed is not drafter:
            assert drafter is not None and narrowed is not None  # narrowed from it
            drafter.widen(narrowed, m)
        self.cache.lens[:m] = cache.lens  # after the drafter's: the verifier's lengths are the truth
        timing = StepTiming(forward_s=t2 - t1, draft_s=clock.draft_s if clock else 0.0,
                            verify_s=clock.verify_s if clock else t2 - t1, resync_s=resync_s,
                            trace_s=clock.trace_s if clock else 0.0, choice=plan.choice)
        return self._commit(plan, outcome, scoring, timing, t0, timed)

    def _step_cache(self, m: int) -> KVCache:
        """The pool's first m rows as the step's cache, with lengths of its own (the step rolls them back; `step`
        writes them back after the drafter's): the pool's own tensors when every row is in it (no per-layer views:
        a step on a full pool costs the host none)."""
        pool = self.cache
        if m == self.slots:
            return KVCache(pool.keys, pool.values, pool.lens.clone())
        return KVCache([k[:m] for k in pool.keys], [v[:m] for v in pool.values], pool.lens[:m].clone())

    def _plan(self) -> StepPlan | None:
        """What this step runs (None: no request is running): the occupied prefix, the controller's k for the
        auto rows (or a lookup where it left the step plain), each row's k, the sampling params and the rows'
        uniforms, drawn from their streams."""
        live = [s for s, r in enumerate(self.rows) if r is not None]
        if not live:
            return None
        m = live[-1] + 1
        rows = self.rows[:m]
        self._precut = None
        choice = self._choose(rows, live, m)
        shaping = tuple(r.shaping if r is not None else None for r in rows)
        shaper = StepShaper(shaping) if any(x is not None for x in shaping) else None
        forced = self._forced(shaper, choice, live)
        width = self._lookup(choice, rows, live, forced is not None)
        auto_k = width if width > 0 else 0 if choice is None else choice.k
        ks = [(auto_k if r.request.k is None else r.request.k) if r is not None else 0 for r in rows]
        if self.stale and not width:  # rows whose drafter skipped plain steps (`_lazy`) decode this one plain, and
            ks = [0 if s in self.stale else k for s, k in enumerate(ks)]  # follow it (a lookup's drafts are current)
        kmax = max(ks[s] for s in live)
        params, limit = self._params(rows, live, ks, kmax)
        u_draft, u_accept = (None, None) if params.greedy else self._uniforms(rows, ks, kmax)
        # confidence may cut (the rows are those of `live`, and the empty slots between them); not on the graph
        # backend, whose verify pass has one width whatever it verifies: a cut would save nothing, cost accepted
        # drafts, and make the host wait for the drafts' confidence between the draft and the verify pass
        # nor on a probe, which measures the pass it chose: cut by the estimates it is to check, one outlier r(2) (a
        # stalled pass, 3.2 plain passes) had every later probe's draft cut, and was never measured again
        every_auto = choice is not None and all(r.request.k is None for r in rows if r is not None)
        cut = every_auto and self.backend != "graph" and not (choice is not None and choice.probe)
        return StepPlan(occupied(tuple(r is not None for r in rows)), kmax, params, u_draft, u_accept, limit,
                        lookup=width > 0, confidence_cut=cut, shaper=shaper, forced=forced if kmax else None, m=m,
                        live=tuple(live), row_k=tuple(ks), choice=choice)

    def _forced(self, shaper: StepShaper | None, choice: Choice | None, live: list[int]
                ) -> tuple[list[int], ...] | None:
        """The tokens each row's grammar forces next, up to a lookup's width (None: none anywhere): drafted free
        (`speculative.with_forced`) where the drafter follows the verdict, not its own drafts (`follows_plain`:
        an eagle head, suffix decoding, a mix of them; a drafter LM's cache holds what it drafted), and not on a
        probe of a plain pass (it prices the pass alone)."""
        if not (self.grammar_drafts and shaper is not None and follows_plain(self.drafter)):
            return None
        if choice is not None and choice.probe and not choice.k:
            return None
        return shaper.forced(self._lookup_width(live))

    def _lazy(self, plan: StepPlan) -> bool:
        """Whether this step, one the controller left plain with no probe due (`Choice.timed` False: nothing drafts
        soon), plain or a lookup of free drafts, leaves the drafter's rows stale instead of following
        (`follows_lazily`: an eagle head, whose state is the verifier's newest feature; a mix of such heads, whose
        suffix member still follows: `lazy_part`), where no hook observes plain steps (replay records of plain
        steps start from that feature). A row that is stale when the controller drafts again decodes that step
        plain, following, and drafts from the next."""
        choice = plan.choice
        if choice is None or choice.k or choice.timed or (plan.k and (not plan.lookup or plan.forced is not None)):
            return False  # (a grammar's forced tokens are drafted where the whole drafter follows)
        if not getattr(self.drafter, "follows_lazily", False):
            return False
        return not (self.hooks is not None and getattr(self.hooks, "observes_some_plain", lambda: False)())

    def _timed(self, plan: StepPlan) -> bool:
        """Whether the controller learns from this step (its clock read, its costs observed): not the verifier
        alone's, nor a step the controller left plain while no probe is due (`Choice.timed`)."""
        return self.drafter is not None and (plan.k > 0 or plan.choice is None or plan.choice.timed)

    def _gate(self, plan: StepPlan) -> Gate | None:
        """Each row's draft length from its confidence (the controller's `cut`), where the plan lets it cut."""
        if not plan.confidence_cut:
            return None
        def gate(confidence: list[list[float]], speculators: list[str] | None) -> list[int]:
            sources = self._calibrated(speculators, plan.m)
            keep = self._cut(confidence, plan.m, sources)
            self.controller.cuts(confidence, keep, sources)
            return keep

        return gate

    def _cut(self, confidence: list[list[float]], m: int, sources: list[str | None] | None) -> list[int]:
        """The controller's `cut` of these drafts, or the lookup pre-check's of the same drafts this step (nothing
        the controller reads changes between the two: ~0.2 ms of a lookup step on two cores, bench/README.md
        section 57)."""
        pre, self._precut = self._precut, None
        if pre is not None and pre[0] == confidence and pre[1] == sources:
            return list(pre[2])
        return self.controller.cut(confidence, m, sources)

    def _calibrated(self, speculators: list[str] | None, m: int) -> list[str | None] | None:
        """Rows [0, m)'s calibration keys (`controller.calibrated_as`: their speculator, apart where the row samples);
        None where every row is greedy and its drafter's own."""
        sampled = self._sampled(m)
        if speculators is None and not any(sampled):
            return None
        return [calibrated_as(None if speculators is None else speculators[b], sampled[b]) for b in range(m)]

    def _sampled(self, m: int) -> list[bool]:
        """Whether each of rows [0, m) samples (an empty slot does not)."""
        return [r is not None and not r.request.params.greedy for r in self.rows[:m]]

    def _commit(self, plan: StepPlan, outcome: BlockOutcome, scoring: Scoring | None, timing: StepTiming,
                t0: float, timed: bool) -> list[RowUpdate]:
        """The step's outcome committed: each live row's update (finished requests leave), the next step's
        `last`, the step's timing and what the controller learns from it (where it was `timed`)."""
        ks, live = list(plan.row_k), plan.live
        if outcome.drafted is not None:
            drafted = [min(k, int(d)) for k, d in zip(ks, outcome.drafted.tolist())]
        else:  # every row drafted its k, or none did (a pass of `last` alone: a lookup that found nothing)
            drafted = ks if outcome.tokens.shape[1] > 1 else [0] * len(ks)
        learns = timed and outcome.predicted is not None  # the rows' calibration keys: read while they run
        keys = self._calibrated(outcome.sources, plan.m) if learns else None
        updates = [self._commit_row(s, outcome, drafted[s], scoring) for s in live]
        self.last[:plan.m] = outcome.last_tokens
        self.timing = replace(timing, total_s=time.perf_counter() - t0)
        draft_s, verify_s, resync_s = timing.draft_s, timing.verify_s, timing.resync_s
        if not timed:  # the verifier alone, or a plain step nothing learns from: nothing to observe
            return updates
        # what asking k earns (a lookup's drafts, and a free speculator's rows, were not what k pays for:
        # they teach the calibration alone)
        blocks = () if plan.lookup else tuple((ks[s], outcome.accepted(s)) for s in live if ks[s] and (
            outcome.sources is None or outcome.sources[s] not in FREE_SOURCES))
        predicted = None if outcome.predicted is None else outcome.predicted.tolist()  # one read, not one a row
        # a row whose request finished in this step teaches the calibration, no request's own (its slot is free)
        confident = () if predicted is None else tuple(
            Confident(predicted[s], outcome.accepted(s), None if keys is None else keys[s], drafted[s],
                      s if self.rows[s] is not None else None) for s in live if drafted[s])
        rest = self.timing.total_s - draft_s - verify_s - resync_s - timing.trace_s
        self.controller.observe(StepSample(plan.m, outcome.tokens.shape[1] - 1, draft_s, verify_s, rest, blocks,
                                           resync_s, plan.k, confident, plan.lookup, lookup_cut(plan, outcome)))
        return updates

    def _lookup(self, choice: Choice | None, rows: list, live: list[int], forced: bool) -> int:
        """How many free drafts per row this step of auto rows verifies instead (`Drafter.lookup`; 0: none):
        where the controller left it plain (not to measure a plain pass), or gave a mix's model members k
        drafts but every row's free draft promises as much (`prefers_free`: a copy is not cut to k). Where a
        row's grammar forces tokens (`forced`), a step left plain verifies them (they are all but certain). A due
        lookup that would verify nothing is left out before the step (`_free_drafts_verified`)."""
        if not (choice is not None and not choice.probe and all(rows[s].request.k is None for s in live)):
            return 0
        if not choice.k and forced:
            return self._lookup_width(live)
        if not (self.lookups and hasattr(self.drafter, "lookup")):
            return 0
        if not choice.k:  # the width (a read of the rows' lengths) only where a lookup is due
            if not self.controller.lookup_due():
                return 0
            width = self._lookup_width(live)
            return width if self._free_drafts_verified(width, live, len(rows)) else 0
        prefers, width = getattr(self.drafter, "prefers_free", None), self._lookup_width(live)
        if prefers is None or choice.k >= width:
            return 0
        sampled = self._sampled(len(rows))
        return width if prefers(choice.k, width, live, [sampled[s] for s in live]) else 0

    def _free_drafts_verified(self, width: int, live: list[int], m: int) -> bool:
        """Whether a lookup due on a step left plain would verify any draft. A drafter that tells its free drafts'
        confidence ahead (`free_confidence`: suffix decoding, a mix holding it) is asked: where no row has a
        draft, or the gate would cut every live row's (as the step's `speculative.gated` would, from the same
        confidences), the controller learns the lookup's outcome here and the step runs plain, untimed and, for
        a lazily following drafter, lazy: as the verifier alone's (a lookup step is timed, draws a drafting
        step's uniforms and has its drafter follow)."""
        ask = getattr(self.drafter, "free_confidence", None)
        if ask is None:
            return True
        confidence, speculators = ask(width, m)
        if not any(confidence):
            self.controller.looked_up(earned=False, tried=False)
            return False
        if self.backend != "graph":  # the graph step verifies what it finds (`_plan`: no cut there)
            sources = self._calibrated(speculators, m)
            keep = self.controller.cut(confidence, m, sources)
            if not any(keep[s] for s in live):
                self.controller.cuts(confidence, keep, sources)  # (else the step's gate takes this cut, and counts)
                self.controller.looked_up(earned=False, tried=True)
                return False
            self._precut = (confidence, sources, keep)
        return True

    def _lookup_width(self, live: list[int]) -> int:
        """The most free drafts a lookup verifies per row: the controller's `lookup_max` (its k_max on the graph
        backend, whose step width is fixed), within the room every live row's cache has left, never under k_max
        (the capacity rule reserves that much)."""
        if self.backend == "graph":
            return self.controller.cfg.k_max
        lens = self.cache.lens.tolist()  # one read (indexing the tensor by `live` is ops: ~50 µs after the layers)
        room = self.capacity - 1 - max(lens[s] for s in live)
        return max(self.controller.cfg.k_max, min(self.controller.cfg.lookup_max, room))

    def _choose(self, rows: list, live: list[int], m: int) -> Choice | None:
        """The controller's k for this step's auto rows (None when there are none, or no drafter)."""
        if self.drafter is None:
            return None
        if self._batch is None:  # the same object while the same requests run (the controller's `choose` sees so)
            fixed = tuple(rows[s].request.k for s in live if rows[s].request.k is not None)
            self._batch = (None if len(fixed) == len(live) else Batch(m, len(live) - len(fixed), fixed),)
        batch = self._batch[0]
        return None if batch is None else self.controller.choose(batch)

    def _resync(self, slots: list[int]) -> float:
        """Rows that skipped plain steps restart in the drafter from their committed tokens (`join`);
        returns the seconds it took (0 when no row needed it), on CUDA waiting for its passes: timed from the host
        alone, a resync that costs the device ~10-20 ms (a drafter LM's prefill of 8 rows) read as µs and probes
        came at a plain drafter's interval, each paying it (the pretrained drafter at batch 8 on an H200, kept
        mostly off, 0.75× the verifier alone: bench/README.md section 33)."""
        if not slots:
            return 0.0
        assert self.drafter is not None  # rows fall behind, and resync, only on a drafting engine
        t0 = time.perf_counter()
        features = {i: torch.zeros(len(slots), self.verifier.hidden_size, device=self.verifier.device,
                                   dtype=self.verifier.dtype) for i in self.drafter.verifier_layers}
        self.drafter.join(slots, [self._row(s).history for s in slots], VerifierView(self.cache, features))
        if self.verifier.device.type == "cuda":  # the join's passes run asynchronously: what it costs is the device's
            torch.cuda.synchronize(self.verifier.device)
        self.behind.difference_update(slots)
        return time.perf_counter() - t0

    def _hooked(self, kmax: int):
        """The step's drafter (a drafting step first offers a swap) and its trace callback: every drafting
        step's, and a plain step's where the hooks observe it (`observes_plain`: replay records of plain steps)."""
        if self.hooks is None:
            return self.drafter, None
        if kmax:
            self.offer_swap()
        elif not (self.drafter is not None and getattr(self.hooks, "observes_plain", lambda: False)()):
            return self.drafter, None
        ids = [r.request.id if r is not None else None for r in self.rows]
        return self.drafter, self.hooks.traced(self._histories(), ids)

    @staticmethod
    def _params(rows: list, live: list[int], ks: list[int], kmax: int):
        """One SamplingParams when every live row shares the transform (the scalar path), else RowParams;
        per-row k limits only when live rows' k differ."""
        first = rows[live[0]].request.params
        shared = all(warp_key(rows[s].request.params) == warp_key(first) for s in live)
        params = first if shared else RowParams(tuple(r.request.params if r is not None else first for r in rows))
        same_k = all(ks[s] == kmax for s in live)
        return params, None if same_k else torch.tensor([k if r is not None else kmax for k, r in zip(ks, rows)])

    @staticmethod
    def _uniforms(rows: list, ks: list[int], kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(u_draft [m, kmax], u_accept [m, kmax + 1]) in `StepPlan`'s layout: row b's 2 k_b + 1 draws from its
        own stream, as it draws them decoded alone; 0.5 fills the rest (greedy rows, empty slots)."""
        u_draft, u_accept = torch.full((len(rows), kmax), 0.5), torch.full((len(rows), kmax + 1), 0.5)
        for s, row in enumerate(rows):
            if row is None or row.generator is None:
                continue
            k = ks[s]
            drawn = torch.rand(2 * k + 1, generator=row.generator)
            if k:  # a plain row's one draw needs none of these (four calls fewer a row, each cold after a forward)
                u_draft[s, :k] = drawn[:k]
                u_accept[s, :k] = drawn[k : 2 * k]
            u_accept[s, kmax] = drawn[2 * k]
        return u_draft, u_accept

    def _commit_row(self, s: int, outcome: BlockOutcome, k: int, scoring: Scoring | None) -> RowUpdate:
        row = self._row(s)
        n = outcome.accepted(s)
        before = len(row.gen.token_ids)
        row.gen.stats.observe(k, n)
        self.stop_rule.extend(row.gen, outcome.emitted(s), row.request.params)
        new = row.gen.token_ids[before:]  # cut as the stop rule cut them: their scores are cut the same way
        if row.shaping is not None:
            row.shaping.commit(new)
        scores: list[TokenScore] | None = None
        if row.gen.logprobs is not None:  # the request asked for them (admit): this step scored its row
            assert scoring is not None and row.request.logprobs is not None
            scores = scoring.scores(s, new, row.request.logprobs)
            row.gen.logprobs.extend(scores)
        done = row.gen.finish_reason is not None
        speculator = outcome.sources[s] if outcome.sources is not None and k else None
        update = RowUpdate(row.request.id, s, new, k, n, row.gen.finish_reason, scores, row.gen if done else None,
                           speculator)
        if done:
            self._leave(s)
        return update


@functools.lru_cache(maxsize=256)
def occupied(flags: tuple[bool, ...]) -> torch.Tensor:
    """[m] bool: which of a step's rows hold a request (`StepPlan.active`), made once per pattern and shared (nothing
    writes a plan's flags; an op after a forward costs ~30 µs on a CPU, bench/README.md section 48)."""
    return torch.tensor(flags)


def lookup_cut(plan: StepPlan, outcome: BlockOutcome) -> bool:
    """Whether a lookup step found drafts and cut every one before the verify pass (the gate, or a grammar: each
    row's length 0, so its verdict covers `last` alone), as against one that matched nothing (no lengths)."""
    return plan.lookup and outcome.tokens.shape[1] == 1 and outcome.drafted is not None


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
    backend: str | None = None,
    controls: Controls = Controls(),
    grammar: GrammarSpec | None = None,
    grammars: GrammarCompiler | None = None,
) -> list[Generation]:
    """Decode a batch of prompts (token ids, ragged) to completion. k = 0 means the verifier alone,
    k = None lets `controller` (drafter/decode/controller.py; a new one when None) choose k step by step.
    Request i draws from the stream seeded by (params.seed, first_request + i).

    `hooks` (serving): `swap()` may hand over a new drafter between two steps (it takes over the
    old one's rows), and `traced(histories)` returns a callback for the step's trace. `controls` and `grammar`
    (with the `grammars` that compile it) apply to every request (drafter/decode/shaping.py)."""
    if k and drafter is None:
        raise ValueError("k > 0 needs a drafter")
    controller = Controller() if controller is None else controller
    capacity = positions_needed(max(map(len, prompts)), params.max_tokens, k, controller.cfg.k_max)
    engine = Engine(verifier, drafter, len(prompts), capacity, stop_rule, sampler=sampler, hooks=hooks,
                    controller=controller, backend=backend, grammars=grammars)
    engine.admit([EngineRequest(str(i), p, params, k, first_request + i, controls=controls, grammar=grammar)
                  for i, p in enumerate(prompts)])
    finished: dict[str, Generation] = {}
    while engine.running:
        finished.update((u.id, u.generation) for u in engine.step() if u.generation is not None)
    engine.close()
    return [finished[str(i)] for i in range(len(prompts))]
