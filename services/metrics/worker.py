"""The verifier worker's metrics (`WorkerMetrics`): spec-decode counters by drafter version (the
newest MAX_VERSIONS versions kept), the controller's k and estimates, load, step times, drafter swaps
and rollbacks, registry reachability and replay logging. Names in `specloop.services.metrics`."""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

from prometheus_client import CollectorRegistry

from specloop.drafter.decode.stats import AcceptanceStats
from specloop.services.metrics.export import PREFIX, Exporter, Totals
from specloop.services.metrics.vllm import VLLM_PREFIX, VllmWorkerSeries

K_BUCKETS = tuple(float(k) for k in range(9))  # chosen k: 0 (plain) .. 8
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_VERSIONS = 16  # drafter versions whose spec-decode series a worker keeps (older ones are removed)


class _VersionSeries:
    """The spec-decode counter children of one drafter version, looked up once."""

    def __init__(self, m: "WorkerMetrics", version: str):
        self.version, self.m = version, m
        self.drafts = m.num_drafts.labels(version)
        self.draft_tokens = m.num_draft_tokens.labels(version)
        self.accepted = m.num_accepted_tokens.labels(version)
        self.chosen_k = m.chosen.labels(version)
        self.per_pos: list = []
        self.by_speculator: dict[str, tuple] = {}  # speculator -> (blocks, draft tokens, accepted) children

    def add_speculator(self, speculator: str, blocks: int, drafted: int, accepted: int) -> None:
        children = self.by_speculator.get(speculator)
        if children is None:
            children = self.by_speculator[speculator] = tuple(
                c.labels(self.version, speculator) for c in (self.m.spec_blocks, self.m.spec_draft_tokens,
                                                             self.m.spec_accepted_tokens))
        for child, value in zip(children, (blocks, drafted, accepted)):
            child.inc(value)

    def add(self, stats: AcceptanceStats) -> None:
        self.m.vllm.add(stats)  # vLLM's names: the totals over every version
        self.drafts.inc(stats.drafts)
        self.draft_tokens.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        while len(self.per_pos) < len(stats.accepted_per_position):  # every drafted position exists, even at 0
            self.per_pos.append(self.m.accepted_per_pos.labels(self.version, str(len(self.per_pos))))
        for child, count in zip(self.per_pos, stats.accepted_per_position):
            if count:
                child.inc(count)

    def remove(self) -> None:
        for metric in (self.m.num_drafts, self.m.num_draft_tokens, self.m.num_accepted_tokens, self.m.chosen):
            metric.remove(self.version)
        for i in range(len(self.per_pos)):
            self.m.accepted_per_pos.remove(self.version, str(i))
        for speculator in self.by_speculator:
            for metric in (self.m.spec_blocks, self.m.spec_draft_tokens, self.m.spec_accepted_tokens):
                metric.remove(self.version, speculator)


class WorkerMetrics(Exporter):
    """What a verifier worker exports: spec-decode counters, load, step times, swaps, replay logging.
    `slots`: the cache slots of its continuous batch (0: unknown until `load` is told; the slot usage
    is NaN until then)."""

    def __init__(self, registry: CollectorRegistry | None = None, worker: str = "worker-0", model_name: str = "",
                 slots: int = 0):
        super().__init__(registry, model_name)
        self.worker, self.slots = worker, slots
        v = ("drafter_version",)
        self.num_drafts = self._counter("spec_decode_num_drafts", "Verified blocks that drafted (k > 0).", v)
        self.num_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Drafted tokens (sum of k).", v)
        self.num_accepted_tokens = self._counter("spec_decode_num_accepted_tokens", "Accepted drafted tokens.", v)
        self.accepted_per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos", "Blocks whose draft at this 0-based position was accepted.",
            v + ("position",))
        s = v + ("speculator",)
        self.spec_blocks = self._counter("spec_decode_speculator_drafts", "Verified blocks that drafted, by the "
                                         "speculator of a mix that drafted them (adaptive, static, suffix).", s)
        self.spec_draft_tokens = self._counter("spec_decode_speculator_draft_tokens",
                                               "Drafted tokens, by speculator.", s)
        self.spec_accepted_tokens = self._counter("spec_decode_speculator_accepted_tokens",
                                                  "Accepted drafted tokens, by speculator.", s)
        self.chosen = self._histogram("spec_decode_chosen_k", "Draft length the controller chose for auto "
                                      "requests, once per step (0: plain decoding).", K_BUCKETS, v)
        self.est_acceptance = self._gauge("spec_decode_est_acceptance", "The controller's estimate of P(draft at this "
                                          "0-based position accepted | earlier drafts accepted).", ("position",))
        self.est_speedup = self._gauge("spec_decode_est_speedup", "The controller's expected tokens/s with draft "
                                       "length k over plain decoding, at the running batch.", ("k",))
        self.committed_tokens = self._counter("committed_tokens", "Tokens committed to requests by the worker "
                                              "(the API counts those it sends as generation_tokens_total).")
        self.waiting = self._gauge("num_requests_waiting", "Requests queued for a cache slot.")
        self.running = self._gauge("num_requests_running", "Requests holding a cache slot.")
        self.slot_usage = self._gauge(
            "cache_slot_usage_perc", "Fraction of the worker's cache slots in use, 0..1 (running requests / slots; "
            "NaN while the slot count is unknown). A slot is one request's row of the continuous batch's KV cache: "
            "specloop's counterpart of vLLM's kv_cache_usage_perc, which counts paged cache blocks. Above 1 while "
            "requests naming another drafter version run in engines of their own.")
        self.slot_usage.set(0.0 if slots > 0 else math.nan)
        self.step_forward = self._histogram("step_forward_seconds", "Forward-pass time of one engine step.",
                                            STEP_BUCKETS)
        self.step_total = self._histogram("step_seconds", "Wall time of one engine step.", STEP_BUCKETS)
        self.swaps = self._counter("drafter_swaps", "Drafter versions swapped in while serving.")
        self.rollbacks = self._counter("drafter_rollbacks", "Automatic rollbacks to the previous drafter version.")
        self.load_failures = self._counter("drafter_load_failures", "Drafter versions that could not be loaded "
                                           "(unreadable or non-finite weights); the worker kept serving its own.")
        self.registry_up = self._gauge("registry_up", "1 while the worker's last read of the drafter registry "
                                       "succeeded, 0 while it is unreachable (the worker serves on).")
        self.drafter_info = self._gauge("drafter_info", "1 for the drafter version that serves.", v)
        self._gauge("worker_info", "1, labelled with the worker's name.", ("worker",)).labels(worker).set(1)
        self.totals = Totals({PREFIX + "replay_records_logged": "Replay records handed to the buffer.",
                               PREFIX + "replay_records_dropped": "Replay records dropped (buffer or queue full).",
                               PREFIX + "replay_records_observed": "Replay records of steps left plain (observed: "
                               "the verifier's next token where nothing was drafted) handed to the buffer."},
                              self.constant)
        self.registry.register(self.totals)
        queries, hits = "Prompt tokens looked up in the prefix cache.", "Prompt tokens served from the prefix cache."
        self.prefix_totals = Totals({PREFIX + "prefix_cache_queries": queries, PREFIX + "prefix_cache_hits": hits,
                                     VLLM_PREFIX + "prefix_cache_queries": queries,
                                     VLLM_PREFIX + "prefix_cache_hits": hits}, self.constant)
        self.registry.register(self.prefix_totals)
        self._versions: OrderedDict[str, _VersionSeries] = OrderedDict()
        self._serving: str | None = None
        self._lock = threading.Lock()
        self.vllm = VllmWorkerSeries(self)  # the spec-decode counters and the load under vLLM's names

    # -- speculative decoding

    def block(self, version: str, k: int, accepted: int) -> None:
        """One row's verified block: k drafted, `accepted` accepted (k = 0: no draft, nothing counted).
        Tokens are counted by `generated`, once per committed token, for every k."""
        self.blocks(version, [k], [accepted])

    def blocks(self, version: str, k: list[int], accepted: list[int]) -> None:
        """Many rows' blocks of one engine step, all drafted by `version`: one inc per label set."""
        stats = AcceptanceStats.of(k, accepted)
        if stats.drafts:
            self._series(version).add(stats)

    def speculators(self, version: str, blocks: list[tuple[str, int, int]]) -> None:
        """One step's drafting blocks of a mix of speculators: (speculator, k, accepted) per row."""
        totals: dict[str, list[int]] = {}
        for speculator, k, accepted in blocks:
            if k:
                t = totals.setdefault(speculator, [0, 0, 0])
                t[0], t[1], t[2] = t[0] + 1, t[1] + k, t[2] + accepted
        for speculator, (n, drafted, accepted) in totals.items():
            self._series(version).add_speculator(speculator, n, drafted, accepted)

    def observe(self, version: str, stats: AcceptanceStats) -> None:
        """Blocks already aggregated by the caller."""
        if stats.drafts:
            self._series(version).add(stats)

    def _series(self, version: str) -> _VersionSeries:
        with self._lock:
            series = self._versions.get(version)
            if series is None:
                series = self._versions[version] = _VersionSeries(self, version)
                self._evict()
            return series

    def _evict(self) -> None:
        """Keep the series of the newest MAX_VERSIONS versions (never the serving one's)."""
        while len(self._versions) > MAX_VERSIONS:
            oldest = next(v for v in self._versions if v != self._serving)
            self._versions.pop(oldest).remove()

    def chosen_k(self, version: str, k: int) -> None:
        """The controller chose draft length k for this step's auto requests (drafted by `version`)."""
        self._series(version).chosen_k.observe(k)

    def estimates(self, estimates: dict) -> None:
        """The controller's current estimates (`Controller.estimates`): acceptance by position, speedup by k."""
        for i, a in enumerate(estimates["acceptance"]):
            self.est_acceptance.labels(str(i)).set(a)
        for k, x in enumerate(estimates["speedup"] or ()):
            self.est_speedup.labels(str(k)).set(x)

    # -- tokens, load, step time

    def generated(self, tokens: int) -> None:
        """Tokens committed to requests (what clients receive, prefill's first token included)."""
        self.committed_tokens.inc(tokens)

    def load(self, queued: int, running: int, slots: int | None = None) -> None:
        """Requests waiting for a cache slot and holding one; `slots` updates the slot count."""
        self.waiting.set(queued)
        self.running.set(running)
        self.vllm.load(queued, running)
        if slots is not None and slots > 0:
            self.slots = slots
        if self.slots > 0:
            self.slot_usage.set(running / self.slots)

    def step(self, seconds_forward: float, seconds_total: float) -> None:
        """One engine step: time in forward passes (drafter + verifier) and its wall time."""
        self.step_forward.observe(seconds_forward)
        self.step_total.observe(seconds_total)

    # -- drafter versions

    def serving(self, version: str) -> None:
        """Mark the version that serves, without counting a swap (start-up). Its spec-decode counters
        are exported at 0 from now on: rate() misses whatever a series counted before its first scrape."""
        with self._lock:
            if self._serving is not None and self._serving != version:
                self._remove_info(self._serving)
            self._serving = version
        self.drafter_info.labels(version).set(1)
        self._series(version)

    def swap(self, old: str, new: str) -> None:
        """The worker swapped drafter `old` out for `new` between two steps."""
        self.swaps.inc()
        self._remove_info(old)
        self.serving(new)

    def _remove_info(self, version: str) -> None:
        try:
            self.drafter_info.remove(version)
        except KeyError:
            pass

    def rollback(self) -> None:
        self.rollbacks.inc()

    def load_failed(self) -> None:
        self.load_failures.inc()

    def registry_reachable(self, up: bool) -> None:
        self.registry_up.set(1 if up else 0)

    # -- prefix caching

    def prefix_cache(self, queries_total: int, hits_total: int) -> None:
        """The verifier's prefix cache's running totals (drafter/decode/prefix_cache.py), in prompt tokens: looked up,
        and served from the cache. Exported under specloop's names and vLLM's (vllm:prefix_cache_queries_total /
        vllm:prefix_cache_hits_total count tokens too)."""
        for prefix in (PREFIX, VLLM_PREFIX):
            self.prefix_totals.set(prefix + "prefix_cache_queries", queries_total)
            self.prefix_totals.set(prefix + "prefix_cache_hits", hits_total)

    # -- replay logging

    def records(self, logged_total: int, dropped_total: int, observed_total: int = 0) -> None:
        """The replay logger's running totals (absolute values, not increments)."""
        self.totals.set(PREFIX + "replay_records_logged", logged_total)
        self.totals.set(PREFIX + "replay_records_dropped", dropped_total)
        self.totals.set(PREFIX + "replay_records_observed", observed_total)

