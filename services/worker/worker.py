"""The verifier worker: lossless speculative decoding that logs replay records and hot-swaps
drafter versions between two steps (run as a Ray actor by `specloop replay` and `serve`).

Per step (`specloop.drafter.decode.speculative.StepHooks`):
- `swap`: a registry watcher thread (specloop.services.worker.watcher) reads the alias every `poll_interval_s` (an
  idle worker asks for a fresh read before a request, waiting `FRESH_WAIT_S` at most, not at all while
  the registry is down); when the champion changed, it loads its weights while serving goes on, and
  the serving thread, which never reads the registry itself, lets the new drafter take over the old
  one's rows between two steps. The swap stall (the adopt itself, on the serving thread) is timed. Output stays
  lossless whatever the drafter: the verifier decides.
- KV cache of in-flight rows on a swap (`swap_cache`): "keep" (default) — a pretrained / SD²
  drafter's cache was computed with the old weights; positions written after the swap use the new
  ones, so the rows in flight draft from a mixed cache until they finish (a transient acceptance
  dip, counted in `stale_blocks`); "recompute" — the new drafter prefills each row's committed
  tokens (exact, but the prefill is a stall on the serving thread). bench/swap_cache.py measures
  both. A DVI swap replaces only the head: the cache is the verifier's and stays exact.
- `traced`: each step's records (the verifier's top-K over the logged positions, the row's tag)
  are built and encoded inline and handed to the buffer, whose own writer thread talks to Redis, so
  the step never waits for the network. `log_thread=True` moves the building to a logger thread
  (a full queue drops and counts a step's records); on this 2-core CPU both cost the same, because
  the thread's Python work contends for the GIL (bench/online_overhead.py).
- Auto-rollback (opt-in, `rollback_window` > 0; the learner's canary, specloop.services.learner.canary, judges
  promotions by default: on the same traffic, so drift is not taken for a regression): once a newly
  promoted version has served `rollback_window` blocks, its acceptance rate is compared with its
  predecessor's over the predecessor's last `rollback_window` blocks;
  below by more than `rollback_margin`, the worker rolls the registry back (reason logged), on the
  watcher's thread and only if that version is still the champion (`Registry.rollback(expected=)`).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import torch

from specloop.drafter.decode.engine import Engine
from specloop.drafter.decode.grammar import GrammarCompiler
from specloop.drafter.decode.prefix_cache import PrefixCache, PrefixCacheStats
from specloop.drafter.decode.proposer import FREE_SOURCES, Drafter
from specloop.drafter.decode.requests import EngineRequest, RowUpdate, StopRule
from specloop.drafter.decode.speculative import StepTrace
from specloop.drafter.decode.stats import AcceptanceStats
from specloop.drafter.kinds.table import DrafterBuilder
from specloop.drafter.model.attention import KV_CACHE_ENV, KV_DTYPES
from specloop.drafter.model.loading import load_model
from specloop.services.buffer.types import ReplayBuffer
from specloop.services.event_log import EventLog
from specloop.services.protocol import CompletionRequest
from specloop.services.registry.registry import Registry
from specloop.services.worker.watcher import RegistryWatcher
from specloop.trainer.records import DEFAULT_CONTEXT, DEFAULT_TOP_K, RowTag, encode, records_from_snapshot, snapshot

log = logging.getLogger("specloop.worker")
BASE_VERSION = "base"  # label of the drafter as loaded, before any registry version
STATIC_VERSION = "static"  # records drafted by a mix's static member: never on-policy for the learner
MIN_POLL_S = 0.02  # the registry watcher reads the alias at most this often
FRESH_WAIT_S = 0.25  # an idle worker waits this long at most for a registry read before a request


@dataclass
class WorkerConfig:
    verifier: str
    drafter: str | None
    kind: str
    registry: str | None = None  # registry folder; None: serve the base drafter, no swaps
    redis_url: str | None = None  # registry metadata in Redis (several processes, one registry)
    prefix: str = "specloop"  # Redis key prefix
    top_k: int = DEFAULT_TOP_K  # verifier log-probs kept per logged position
    context: int = DEFAULT_CONTEXT  # committed tokens per record (pretrained / sd2)
    log_records: bool = True  # write replay records (needs a buffer)
    threads: int = 1  # torch threads of the serving process
    rollback_window: int = 0  # > 0: blocks compared between a new champion and its predecessor (0: off)
    rollback_margin: float = 0.1  # acceptance-rate drop that triggers an automatic rollback
    log_thread: bool = False  # build and encode records on a logger thread (else inline: no GIL contention)
    logger_queue: int = 256  # steps waiting for the logger thread before new ones are dropped
    poll_interval_s: float = 0.05  # registry reads between steps at most this often (each request starts with one)
    swap_cache: str = "keep"  # in-flight rows on a swap: keep the drafter KV cache, or "recompute" it
    slots: int = 1  # cache slots of the continuous batch (requests decoded together)
    max_context: int = 1024  # positions per slot: specloop.drafter.decode.capacity.positions_needed must fit
    #                          (capped by the model)
    weights: str = "auto"  # the verifier's weight mode (specloop.drafter.model.weights.quant: auto = as stored /
    #                        its manifest; fp32, bf16, int8, int4, w4a8)
    drafter_weights: str = "fp32"  # a drafter LM's own weight mode (pretrained / sd2)
    speculators: tuple[str, ...] = ()  # beside the served drafter, chosen per step and row (specloop.drafter.kinds.mix)
    prefix_caching: bool = True  # reuse the KV of prompt prefixes earlier requests computed (`specloop serve
    #                              --enable-prefix-caching`, on by default as in vLLM v1)
    kv_cache_dtype: str = "auto"  # the KV caches' dtype in this process (drafter.model.attention.kv_dtype: auto = the
    #                               model's on a GPU, fp32 on the CPU; `specloop serve --kv-cache-dtype`)
    enforce_eager: bool = False  # the engine's eager backend on a GPU too (`specloop serve --enforce-eager`)
    champion_wait_s: float = 0.0  # > 0: a learner starting beside this worker seeds the registry's champion; the
    #                               worker waits this long at most for it, so the champion serves from the first
    #                               request (`specloop serve` starts them together)
    observe_every: int = 8  # one step in this many of those the controller left plain gives observed records
    #                         (the verifier's next token where nothing was drafted: the learner keeps learning
    #                         when speculation is turned down); 0: none (kinds with `observable` records only)

    def __post_init__(self):
        if self.swap_cache not in ("keep", "recompute"):
            raise ValueError(f"swap_cache must be 'keep' or 'recompute', not {self.swap_cache!r}")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}, not {self.kv_cache_dtype!r}")
        if self.observe_every < 0:
            raise ValueError(f"observe_every must be >= 0 (0: no records of plain steps), not {self.observe_every}")



@dataclass(frozen=True)
class SwapEvent:
    time: float
    old: str
    new: str
    stall_ms: float  # serving-thread time of the switch
    load_ms: float  # background load time
    in_flight: bool  # a request was mid-decode


@dataclass(frozen=True)
class ServeResult:
    """One request decoded to completion (`VerifierWorker.serve`): the replay contract's object."""

    index: int  # the request's stream index (its place in the traffic)
    id: str
    drafter_version: str  # serving when it finished
    drafter_versions: list[str]  # every version that drafted for it, in order
    drafted: int
    accepted: int
    block_efficiency: float  # τ
    token_ids: list[int]
    text: str
    finish_reason: str
    blocks: int
    seconds: float


@dataclass(frozen=True)
class BlockCounts:
    drafted: int  # draft tokens proposed
    accepted: int  # of them, accepted


@dataclass(frozen=True)
class RecordStats:
    """Replay records of a `RecordLogger`: logged = appended − dropped by the buffer; dropped = those + blocks
    dropped from the logger's full queue."""

    logged: int
    dropped: int
    bytes: int  # encoded payload bytes
    observed: int = 0  # of those appended, observed records (steps left plain: `WorkerConfig.observe_every`)


@dataclass(frozen=True)
class WorkerStats:
    version: str  # the drafter version serving
    swaps: list[SwapEvent]  # the last ones
    rollbacks: list[str]  # reasons of the automatic rollbacks (the last ones)
    load_failures: list[str]  # "version: error" of versions not served (the last ones)
    registry_errors: int  # registry reads that failed
    stale_blocks: BlockCounts  # blocks decoded on a stale drafter cache (swap_cache="keep")
    acceptance_by_version: dict[str, BlockCounts]
    records: RecordStats | None  # None: no record logging
    swap_stall_ms: dict[str, float]  # quantiles of the in-flight swaps' stalls: {"n"} or {"n", "p50", "p99", "max"}
    steps: int | None = None  # serving-loop steps (a `ServingActor`'s stats)
    prefix_cache: PrefixCacheStats | None = None  # the verifier's prefix cache (None: prefix caching off)


class AcceptanceMonitor:
    """Per-version acceptance over recent blocks, and the auto-rollback verdict."""

    def __init__(self, window: int, margin: float):
        self.window, self.margin = window, margin
        self.recent: dict[str, deque] = {}  # version -> its last `window` blocks, (k, accepted) each
        self.totals: dict[str, AcceptanceStats] = {}  # version -> all its blocks
        self.watch: tuple[str, str, float] | None = None  # (new, predecessor, predecessor α)

    def observe(self, version: str, drafted: int, accepted: int) -> None:
        self.recent.setdefault(version, deque(maxlen=self.window)).append((drafted, accepted))
        self.totals.setdefault(version, AcceptanceStats()).observe(drafted, accepted)

    def rate(self, version: str) -> float | None:
        """α over the version's recent window."""
        blocks = self.recent.get(version)
        return AcceptanceStats.of(*zip(*blocks)).acceptance_rate() if blocks else None

    def promoted(self, old: str, new: str) -> None:
        """Start watching `new` if `old` has a full window to compare with."""
        prev = self.rate(old)
        full = len(self.recent.get(old, ())) >= self.window
        self.watch = (new, old, prev) if prev is not None and full else None
        self.recent.pop(new, None)

    def verdict(self) -> str | None:
        """A rollback reason once the watched version has a full window and fell too far; else None."""
        if self.watch is None or len(self.recent.get(self.watch[0], ())) < self.window:
            return None
        new, old, prev = self.watch
        self.watch = None
        now = self.rate(new)
        if now is not None and now < prev - self.margin:
            return (f"live acceptance of {new} {now:.3f} < predecessor {old} {prev:.3f} − margin "
                    f"{self.margin} over {self.window} blocks")
        return None


class RecordLogger:
    """Builds, encodes and appends replay records on its own thread.

    A Redis buffer accepts an append onto its local queue and may drop it later (Redis down), so
    `stats()` counts the buffer's own drops: logged = appended − dropped by the buffer; dropped =
    those + blocks dropped from this logger's full queue."""

    def __init__(self, buffer: ReplayBuffer, kind: str, maxsize: int, top_k: int, threaded: bool):
        self.buffer, self.kind, self.top_k = buffer, kind, top_k
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.appended = self.dropped = self.bytes = self.observed = 0  # dropped: from the logger queue only
        self.thread = threading.Thread(target=self._run, name="record-logger", daemon=True) if threaded else None
        if self.thread is not None:
            self.thread.start()

    def submit(self, trace: StepTrace, rows: list[int], tags: list[RowTag], k: int | None = None) -> None:
        """Log a step's records (for `rows`, drafted with k tokens each) now, or queue its trace for the
        logger thread (its tensors are fresh every step, never written again, so holding them is safe)."""
        if self.thread is None:
            return self._log(trace, rows, tags, k)
        try:
            self.queue.put_nowait((trace, rows, tags, k))
        except queue.Full:
            self.dropped += len(tags)

    def _log(self, trace: StepTrace, rows: list[int], tags: list[RowTag], k: int | None) -> None:
        for record in records_from_snapshot(snapshot(trace, rows, self.top_k, k), tags, self.kind):
            payload = encode(record)
            self.bytes += len(payload)
            self.buffer.append(payload)  # a refusal is counted in the buffer's stats
            self.appended += 1
            self.observed += record.observed

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            self._log(*item)
            self.queue.task_done()
        self.queue.task_done()

    def drain(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def stats(self) -> RecordStats:
        lost = self.buffer.cached_stats().dropped  # counters only: no I/O on the serving thread
        return RecordStats(logged=self.appended - lost, dropped=self.dropped + lost, bytes=self.bytes,
                           observed=self.observed)

    def close(self) -> None:
        if self.thread is not None:
            self.drain()
            self.queue.put(None)
            self.thread.join(timeout=5)


def grammar_compiler(tokenizer, vocab_size: int, eos_ids) -> GrammarCompiler:
    """Structured output's matchers for this tokenizer (llguidance reads it on the first grammar)."""
    return GrammarCompiler(tokenizer, vocab_size, frozenset(eos_ids))


class VerifierWorker:
    def __init__(self, cfg: WorkerConfig, buffer: ReplayBuffer | None = None):
        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        if cfg.kv_cache_dtype != "auto":  # the process's: the verifier's cache and every drafter LM's
            os.environ[KV_CACHE_ENV] = cfg.kv_cache_dtype
        self.verifier = load_model(cfg.verifier, weights=cfg.weights)
        log.info("verifier %s served as %s, its KV cache in %s", cfg.verifier, self.verifier.served,
                 str(self.verifier.lean.kv_dtype).removeprefix("torch."))
        tok = self.verifier.tokenizer
        self.stop_rule = StopRule(self.verifier.eos_ids, lambda ids: tok.decode(ids, skip_special_tokens=True))
        self.builder = DrafterBuilder(cfg.kind, self.verifier, cfg.drafter, cfg.drafter_weights, tuple(cfg.speculators))
        self.registry = Registry(cfg.registry, cfg.redis_url, cfg.prefix) if cfg.registry else None
        self.max_context = min(cfg.max_context, self.verifier.lean.cos.shape[0])
        self.grammars = grammar_compiler(tok, self.verifier.lean.vocab_size, self.verifier.eos_ids)
        # the verifier's prompt-prefix KV, shared by every engine of this verifier (as many positions as the pool's)
        self.prefix_cache = PrefixCache(cfg.slots * self.max_context) if cfg.prefix_caching else None
        self.engine = Engine(self.verifier.lean, self.builder.build(), cfg.slots, self.max_context, self.stop_rule,
                             hooks=self, grammars=self.grammars, prefix_cache=self.prefix_cache,
                             backend="eager" if cfg.enforce_eager else None)
        if self.engine.backend == "graph":
            log.info("graph backend: decode steps compiled for %d slots in %.1f s", cfg.slots, self.engine.warm_s)
        self.version = BASE_VERSION
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="drafter-loader")  # versions requests name
        self.watcher = None if self.registry is None else RegistryWatcher(
            self.registry, self._load, max(cfg.poll_interval_s, MIN_POLL_S), self.version)
        self.swaps: EventLog[SwapEvent] = EventLog()
        self.rollbacks: EventLog[str] = EventLog() if self.watcher is None else self.watcher.rollbacks
        self.load_failures: EventLog[str] = EventLog()
        self.monitor = AcceptanceMonitor(cfg.rollback_window, cfg.rollback_margin)
        self.stale = AcceptanceStats()  # blocks decoded on a stale drafter cache
        self.logger = (RecordLogger(buffer, cfg.kind, cfg.logger_queue, cfg.top_k, cfg.log_thread)
                       if buffer and cfg.log_records else None)
        self.stale_rows: set[str] = set()  # running requests whose drafter cache predates the serving version
        self.plain_steps = 0  # steps left plain that asked to be observed (`observes_plain`)
        self.on_step: list = []  # callables(updates, engine, version) after every step (metrics)
        if self.watcher is not None:
            self._await_champion(cfg.champion_wait_s)
            self.watcher.poll()  # the champion serves from the first request (the one wait on the registry)
            self.engine.offer_swap()
            self.watcher.start()

    def _await_champion(self, seconds: float) -> None:
        """Wait (at most `seconds`) until the registry names a champion: a learner started beside this worker
        publishes the base weights as one while the worker loads (a registry that cannot be read waits too)."""
        assert self.registry is not None  # a watcher exists only with a registry
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.registry.champion() is not None:
                    return
            except Exception as exc:  # noqa: BLE001 - the watcher reports a registry that does not answer
                log.debug("registry not readable yet: %s", exc)
            time.sleep(0.05)

    @property
    def drafter(self) -> Drafter:
        assert self.engine.drafter is not None  # built with one; a swap only ever replaces it with another
        return self.engine.drafter

    # -- serving

    def admit(self, requests: list[EngineRequest]) -> None:
        """Requests join the running batch (free slots must exist: `engine.free`)."""
        if not self.engine.running and self.watcher is not None:
            self.watcher.fresh(FRESH_WAIT_S)  # an idle worker starts a request on the champion of now
            self.engine.offer_swap()
        self.engine.admit(requests)
        for r in requests:
            live = self.engine.get(r.id)
            assert live is not None  # admitted just now
            live.gen.drafter_versions.append(self.version)

    def step(self) -> list[RowUpdate]:
        """One speculative step over the running requests (a finished one's update carries its generation)."""
        updates = self.engine.step()
        for u in updates:
            if u.generation is not None:
                self.stale_rows.discard(u.id)
        for callback in self.on_step:
            callback(updates, self.engine, self.version)
        return updates

    def abort(self, request_id: str) -> bool:
        self.stale_rows.discard(request_id)
        return self.engine.abort(request_id)

    def serve(self, request: CompletionRequest) -> ServeResult:
        """Decode one request to completion (replay: one at a time); the replay contract's object, whose
        `index` is the request's stream index (its place in the traffic)."""
        t0 = time.perf_counter()
        self.admit([request.engine_request()])
        gen = None
        while gen is None:
            gen = next((u.generation for u in self.step() if u.id == request.id and u.generation is not None), None)
        assert gen.finish_reason is not None  # the engine hands a generation over once it finished
        return ServeResult(index=request.stream_index, id=request.id, drafter_version=self.version,
                           drafter_versions=gen.drafter_versions, drafted=gen.stats.drafted,
                           accepted=gen.stats.accepted, block_efficiency=gen.stats.block_efficiency,
                           token_ids=gen.token_ids,
                           text=self.verifier.tokenizer.decode(gen.token_ids, skip_special_tokens=True),
                           finish_reason=gen.finish_reason, blocks=gen.stats.blocks,
                           seconds=time.perf_counter() - t0)

    # -- StepHooks

    def swap(self, drafter: Drafter, histories: list[list[int]]) -> Drafter:
        """The engine's one hot-swap path (mid-request, or between requests when it is idle)."""
        return self._take(in_flight=self.engine.running > 0, histories=histories) or drafter

    @property
    def registry_errors(self) -> int:
        """Registry reads that failed (its Redis down or hung): serving went on."""
        return 0 if self.watcher is None else self.watcher.errors

    def traced(self, histories: list[list[int]], ids: list[str | None]):
        return lambda trace: self._on_step(trace, histories, ids)

    def observes_some_plain(self) -> bool:
        """Whether steps left plain give observed records at all: where records are logged, `observe_every` is
        set and the served kind's records need nothing drafted (`KindSpec.observable`). The engine then keeps a
        following drafter up to date on every plain step (an observed record starts from its state)."""
        return self.logger is not None and bool(self.cfg.observe_every) and self.builder.spec.observable

    def observes_plain(self) -> bool:
        """Whether this step left plain gives observed records: one in `observe_every` (`observes_some_plain`)."""
        if not self.observes_some_plain():
            return False
        self.plain_steps += 1
        return self.plain_steps % self.cfg.observe_every == 0

    def _on_step(self, trace: StepTrace, histories: list[list[int]], ids: list[str | None]) -> None:
        slots = torch.nonzero(trace.active).flatten().tolist()
        kmax = trace.proposal.tokens.shape[1]
        if not kmax:  # a step left plain, observed: the served version's records of the verifier's own next token
            assert self.logger is not None  # `observes_plain` asks for plain steps only where records are logged
            self.logger.submit(trace, slots, [self._tag(ids[b], histories[b], self.version) for b in slots], 0)
            return
        sources = trace.proposal.sources
        by_k: dict[tuple[int, str], list[int]] = {}
        for b in slots:
            k = kmax if trace.limit is None else int(trace.limit[b])  # this block's k (auto rows: the controller's)
            n = int(trace.outcome.num_accepted[b])
            source = "adaptive" if sources is None else sources[b]
            if k and source == "adaptive":  # the served version's own drafts (a mix: not static's or suffix's)
                self.monitor.observe(self.version, k, n)
            if k and source not in FREE_SOURCES:  # a model's drafts are records; static's train the KL term only
                by_k.setdefault((k, source), []).append(b)
            if ids[b] in self.stale_rows:
                self.stale.observe(k, n)
        if self.logger is not None:
            for (k, source), group in by_k.items():
                version = self.version if source == "adaptive" else STATIC_VERSION
                self.logger.submit(trace, group, [self._tag(ids[b], histories[b], version) for b in group], k)
        self._check_rollback()

    def _tag(self, request_id: str | None, history: list[int], version: str) -> RowTag:
        """The record tag of a request's block being verified (the index of its drafting blocks)."""
        assert request_id is not None  # an active slot holds a request
        live = self.engine.get(request_id)
        assert live is not None  # a running request
        return RowTag(request_id, version, live.gen.stats.drafts, history[-self.cfg.context:],
                      live.request.params.temperature)

    # -- versions

    def _load(self, version: str) -> Drafter:
        """A registry version's drafter (the registry refuses unreadable and non-finite weights)."""
        assert self.registry is not None  # called by the watcher, which exists only with a registry
        return self.builder.build(self.registry.load_weights(version))

    def _take(self, in_flight: bool, histories: list[list[int]] | None = None) -> Drafter | None:
        """Switch to the champion the watcher loaded, if one is ready (no registry I/O here). Between
        requests only the pool's (empty) state carries over; mid-request the new drafter adopts (or,
        with swap_cache="recompute", refills) the rows in flight."""
        ready = None if self.watcher is None else self.watcher.take()
        if ready is None:
            return None
        if ready.error is not None:
            self._load_failed(ready.version, ready.error)
            return None
        # what `_load` built (the watcher holds it as an object): there is one, as its load raised no error
        new, old, t0 = cast(Drafter, ready.drafter), self.drafter, time.perf_counter()
        recompute = in_flight and self.cfg.swap_cache == "recompute"
        if recompute:
            assert histories is not None  # a mid-request swap (`swap`) passes the rows' histories
            new.refill(old, histories)
        else:
            new.adopt(old)
        self._switched(ready.version, t0, ready.started, in_flight)
        running = {live.request.id for live in self.engine.live()}
        stale = not recompute and self.builder.spec.stale_on_swap  # its cache holds the old weights' KV
        self.stale_rows = self.stale_rows | running if stale else self.stale_rows - running
        for live in self.engine.live():
            live.gen.drafter_versions.append(ready.version)
        return new

    def _switched(self, version: str, t0: float, t_load: float, in_flight: bool) -> None:
        old, self.version = self.version, version
        assert self.watcher is not None  # a swap takes what the watcher loaded
        self.watcher.serving = version
        stall = (time.perf_counter() - t0) * 1e3
        self.swaps.append(SwapEvent(time.time(), old, version, stall, (t0 - t_load) * 1e3, in_flight))
        self.monitor.promoted(old, version)
        log.info("swapped drafter %s -> %s (stall %.2f ms, in flight: %s)", old, version, stall, in_flight)

    def _load_failed(self, version: str, exc: Exception) -> None:
        self.load_failures.append(f"{version}: {exc}")
        log.warning("not serving %s: %s", version, exc)

    def _check_rollback(self) -> None:
        if self.cfg.rollback_window <= 0:
            return
        reason = self.monitor.verdict()
        if reason is not None and self.watcher is not None:
            self.watcher.rollback(reason, expected=self.version)  # carried out off the serving thread

    # -- operations

    def drain(self) -> None:
        if self.logger is not None:
            self.logger.drain()

    def stats(self) -> WorkerStats:
        stalls = sorted(s.stall_ms for s in self.swaps if s.in_flight)
        return WorkerStats(
            version=self.version, swaps=list(self.swaps), rollbacks=list(self.rollbacks),
            load_failures=list(self.load_failures), registry_errors=self.registry_errors,
            stale_blocks=BlockCounts(self.stale.drafted, self.stale.accepted),
            acceptance_by_version={v: BlockCounts(t.drafted, t.accepted) for v, t in self.monitor.totals.items()},
            records=None if self.logger is None else self.logger.stats(),
            swap_stall_ms=_quantiles(stalls),
            prefix_cache=None if self.prefix_cache is None else self.prefix_cache.stats(),
        )

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if self.watcher is not None:
            self.watcher.close()
        self.loader.shutdown(wait=False)


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"n": len(values), "p50": pick(0.5), "p99": pick(0.99), "max": values[-1]}
