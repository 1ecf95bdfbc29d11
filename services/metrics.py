"""Prometheus metrics of every specloop process: the verifier worker, the learner and the HTTP API.

Names follow vLLM's (`vllm:x` is `specloop:x` wherever both mean the same thing), prefixed
`specloop:`. Counters only for what is counted; every rate is taken in PromQL. The statistics of
verified blocks (`BlockStats`) are plain Python, kept apart from the exporters (`WorkerMetrics`,
`LearnerMetrics`, `ApiMetrics`), which own a `CollectorRegistry` each (a new one per instance unless
one is passed, so tests and co-hosted components never collide; the three may share one registry:
their names are disjoint).

Every series carries `model_name` (as vLLM's), bound when the exporter is built: callers never pass
it. An exporter built without a model name exports no `model_name` label, which Prometheus reads as
`model_name=""` (an empty label and a missing one are the same series).

Speculative decoding (worker, labelled `drafter_version`; a block drafts k tokens and the
verifier accepts n ∈ [0, k] of them; a k = 0 block drafts nothing and counts no draft):

    specloop:spec_decode_num_drafts_total                       blocks with k > 0
    specloop:spec_decode_num_draft_tokens_total                 Σ k
    specloop:spec_decode_num_accepted_tokens_total              Σ n
    specloop:spec_decode_num_accepted_tokens_per_pos_total{position}   blocks with n > position (0-based)

Derived rates (`$__rate_interval` in Grafana; the dashboard adds `{model_name=~"$model_name",
instance=~"$instance"}` to every selector):

    # acceptance rate α = accepted / drafted
    sum by (drafter_version) (rate(specloop:spec_decode_num_accepted_tokens_total[$__rate_interval]))
      / sum by (drafter_version) (rate(specloop:spec_decode_num_draft_tokens_total[$__rate_interval]))

    # mean acceptance length τ = 1 + accepted / drafts (block efficiency)
    1 + sum by (drafter_version) (rate(specloop:spec_decode_num_accepted_tokens_total[$__rate_interval]))
      / sum by (drafter_version) (rate(specloop:spec_decode_num_drafts_total[$__rate_interval]))

    # per-position acceptance P(position i accepted)
    sum by (drafter_version, position) (rate(specloop:spec_decode_num_accepted_tokens_per_pos_total[$__rate_interval]))
      / on (drafter_version) group_left
      sum by (drafter_version) (rate(specloop:spec_decode_num_drafts_total[$__rate_interval]))

    # tokens/s committed by the workers; tokens/s generated for clients (the API's, as vLLM's)
    sum(rate(specloop:committed_tokens_total[$__rate_interval]))
    sum(rate(specloop:generation_tokens_total[$__rate_interval]))

    # requests finished per second by reason (stop, length, abort, error)
    sum by (finished_reason) (rate(specloop:request_success_total[$__rate_interval]))

    # mean k the cost-aware controller chose for auto requests (one observation per step), and the
    # share of those steps that speculated at all
    sum by (drafter_version) (rate(specloop:spec_decode_chosen_k_sum[$__rate_interval]))
      / sum by (drafter_version) (rate(specloop:spec_decode_chosen_k_count[$__rate_interval]))
    1 - sum by (drafter_version) (rate(specloop:spec_decode_chosen_k_bucket{le="0.0"}[$__rate_interval]))
      / sum by (drafter_version) (rate(specloop:spec_decode_chosen_k_count[$__rate_interval]))

    # share of a worker step spent in forward passes (the rest is Python scheduling)
    sum(rate(specloop:step_forward_seconds_sum[$__rate_interval])) / sum(rate(specloop:step_seconds_sum[$__rate_interval]))

    # latency quantiles, e.g. TTFT p99
    histogram_quantile(0.99, sum by (le) (rate(specloop:time_to_first_token_seconds_bucket[$__rate_interval])))

Worker (`WorkerMetrics`): the counters above, the histogram `specloop:spec_decode_chosen_k{drafter_version}`
(the controller's k per step, buckets 0..8; drafter/controller.py), the controller's current estimates
for the serving engine as gauges `specloop:spec_decode_est_acceptance{position}` (conditional
acceptance of 0-based position i given the earlier ones accepted) and
`specloop:spec_decode_est_speedup{k}` (expected tokens/s with draft length k over plain decoding, at
the running batch; > 1 + margin is when it speculates), `specloop:committed_tokens_total`, gauges
`specloop:num_requests_waiting` / `specloop:num_requests_running` (vLLM's) and
`specloop:cache_slot_usage_perc` (running / cache slots, 0..1: specloop's counterpart of vLLM's
`kv_cache_usage_perc`, whose cache is paged in blocks where specloop's holds one slot per running
request), histograms `specloop:step_forward_seconds` / `specloop:step_seconds`,
`specloop:drafter_swaps_total`, `specloop:drafter_rollbacks_total`, `specloop:drafter_load_failures_total`,
`specloop:registry_up`, `specloop:drafter_info{drafter_version}` (1 for the serving version),
`specloop:worker_info{worker}`, `specloop:replay_records_logged_total`,
`specloop:replay_records_dropped_total`.

Learner (`LearnerMetrics`): `specloop:learner_updates_total`, `specloop:learner_loss`,
`specloop:learner_lag_versions`, `specloop:learner_record_age_seconds`, `specloop:buffer_depth`,
`specloop:buffer_pending`, `specloop:learner_versions_published_total`,
`specloop:promotions_total`, `specloop:promotion_refusals_total`, `specloop:canary_rollbacks_total`,
`specloop:learner_skipped_updates_total`, `specloop:learner_stale_records_total`.

API (`ApiMetrics`, vLLM's request metrics): `specloop:http_requests_total{endpoint,status}`,
histograms `specloop:time_to_first_token_seconds`, `specloop:inter_token_latency_seconds` (one
observation per gap between two streamed chunks that carry tokens),
`specloop:request_time_per_output_token_seconds` (one per request: its mean time per output token
after the first), `specloop:e2e_request_latency_seconds`, `specloop:request_queue_time_seconds`,
counters `specloop:prompt_tokens_total`, `specloop:generation_tokens_total`,
`specloop:request_success_total{finished_reason}` (stop | length | abort | error).

Renamed for vLLM parity (issue 17): the API's `time_per_output_token_seconds` (a per-request mean)
is `request_time_per_output_token_seconds`; its `completion_tokens_total` is
`generation_tokens_total`, so the worker's former `generation_tokens_total` is
`committed_tokens_total` (one name, one meaning: a sum over all targets never counts a token twice).

Each worker and learner process serves its registry with `serve_metrics` on its own port; the API
lists those addresses at `GET /sd/targets` for Prometheus's HTTP service discovery.
"""
from __future__ import annotations

import math
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from drafter.stats import AcceptanceStats

PREFIX = "specloop:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
K_BUCKETS = tuple(float(k) for k in range(9))  # chosen k: 0 (plain) .. 8
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
AGE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
MAX_VERSIONS = 16  # drafter versions whose spec-decode series a worker keeps (older ones are removed)


# ----------------------------------------------------------------------------- statistics


BlockStats = AcceptanceStats  # counts over verified blocks: the one stats type (drafter/stats.py)


class _Totals:
    """A collector of counters that are set to absolute totals counted elsewhere (the replay logger's),
    with the exporter's constant labels (`model_name`)."""

    def __init__(self, names: dict[str, str], labels: dict[str, str]):
        self.names = names  # name without _total -> help
        self.labels = labels
        self.values = dict.fromkeys(names, 0.0)

    def set(self, name: str, value: float) -> None:
        self.values[name] = float(value)

    def describe(self):
        return [CounterMetricFamily(n, h, labels=list(self.labels)) for n, h in self.names.items()]

    def collect(self):
        for name, doc in self.names.items():
            family = CounterMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), self.values[name])
            yield family


class _ModelBound:
    """A labelled metric whose constant labels (`model_name`) are bound: `labels` and `remove` take
    the other labels only, as if the metric had no constant label."""

    def __init__(self, metric, constant: tuple[str, ...]):
        self.metric, self.constant = metric, constant

    def labels(self, *values: str):
        return self.metric.labels(*self.constant, *values)

    def remove(self, *values: str) -> None:
        self.metric.remove(*self.constant, *values)


# ----------------------------------------------------------------------------- exporters


class _Exporter:
    """A registry of our own and its exposition. Every metric carries `model_name` (none when it is
    empty: Prometheus reads a missing label as an empty one), bound here: a metric without other
    labels is returned as its only child (`inc`, `set`, `observe`), one with other labels as a
    `_ModelBound` (`labels(...)`, `remove(...)` without the model name)."""

    def __init__(self, registry: CollectorRegistry | None, model_name: str = ""):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.constant = {"model_name": model_name} if model_name else {}

    def render(self) -> tuple[bytes, str]:
        """(the text exposition, its content type): the body of a `/metrics` answer. Always the text
        format, never OpenMetrics (see `_MetricsHandler`: colons in names would be lost)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _bind(self, metric, labels: tuple[str, ...]):
        constant = tuple(self.constant.values())
        if labels:
            return _ModelBound(metric, constant)
        return metric.labels(*constant) if constant else metric

    def _names(self, labels: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(self.constant) + labels

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        return self._bind(Counter(PREFIX + name, doc, self._names(labels), registry=self.registry), labels)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        return self._bind(Gauge(PREFIX + name, doc, self._names(labels), registry=self.registry), labels)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()):
        metric = Histogram(PREFIX + name, doc, self._names(labels), buckets=buckets, registry=self.registry)
        return self._bind(metric, labels)


class _VersionSeries:
    """The spec-decode counter children of one drafter version, looked up once."""

    def __init__(self, m: "WorkerMetrics", version: str):
        self.version, self.m = version, m
        self.drafts = m.num_drafts.labels(version)
        self.draft_tokens = m.num_draft_tokens.labels(version)
        self.accepted = m.num_accepted_tokens.labels(version)
        self.chosen_k = m.chosen.labels(version)
        self.per_pos: list = []

    def add(self, stats: BlockStats) -> None:
        self.drafts.inc(stats.drafts)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted.inc(stats.accepted_tokens)
        while len(self.per_pos) < len(stats.accepted_per_pos):  # every drafted position exists, even at 0
            self.per_pos.append(self.m.accepted_per_pos.labels(self.version, str(len(self.per_pos))))
        for child, count in zip(self.per_pos, stats.accepted_per_pos):
            if count:
                child.inc(count)

    def remove(self) -> None:
        for metric in (self.m.num_drafts, self.m.num_draft_tokens, self.m.num_accepted_tokens, self.m.chosen):
            metric.remove(self.version)
        for i in range(len(self.per_pos)):
            self.m.accepted_per_pos.remove(self.version, str(i))


class WorkerMetrics(_Exporter):
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
        self.totals = _Totals({PREFIX + "replay_records_logged": "Replay records handed to the buffer.",
                               PREFIX + "replay_records_dropped": "Replay records dropped (buffer or queue full)."},
                              self.constant)
        self.registry.register(self.totals)
        self._versions: OrderedDict[str, _VersionSeries] = OrderedDict()
        self._serving: str | None = None
        self._lock = threading.Lock()

    # -- speculative decoding

    def block(self, version: str, k: int, accepted: int) -> None:
        """One row's verified block: k drafted, `accepted` accepted (k = 0: no draft, nothing counted).
        Tokens are counted by `generated`, once per committed token, for every k."""
        self.blocks(version, [k], [accepted])

    def blocks(self, version: str, k: list[int], accepted: list[int]) -> None:
        """Many rows' blocks of one engine step, all drafted by `version`: one inc per label set."""
        stats = BlockStats.of(k, accepted)
        if stats.drafts:
            self._series(version).add(stats)

    def observe(self, version: str, stats: BlockStats) -> None:
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

    # -- replay logging

    def records(self, logged_total: int, dropped_total: int) -> None:
        """The replay logger's running totals (absolute values, not increments)."""
        self.totals.set(PREFIX + "replay_records_logged", logged_total)
        self.totals.set(PREFIX + "replay_records_dropped", dropped_total)


class LearnerMetrics(_Exporter):
    """What the learner exports: updates, loss, staleness, buffer depth, publishing and the gate."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = ""):
        super().__init__(registry, model_name)
        self.updates = self._counter("learner_updates", "Optimizer steps taken by the learner.")
        self.loss = self._gauge("learner_loss", "Loss of the learner's last update.")
        self.lag = self._gauge("learner_lag_versions",
                               "Versions between the newest records trained on and the newest published version.")
        self.record_age = self._histogram("learner_record_age_seconds",
                                          "Age of the newest record at each update (append to training).",
                                          AGE_BUCKETS)
        self.depth = self._gauge("buffer_depth", "Entries held by the replay buffer.")
        self.pending = self._gauge("buffer_pending", "Replay entries delivered but not acknowledged.")
        self.versions_published = self._counter("learner_versions_published", "Versions the learner published.")
        self.promotions = self._counter("promotions", "Published versions promoted to champion.")
        self.refusals = self._counter("promotion_refusals", "Published versions the gate refused.")
        self.canary_rollbacks = self._counter("canary_rollbacks", "Promoted versions rolled back because they "
                                              "scored below their predecessor on the same live records.")
        self.skipped = self._counter("learner_skipped_updates", "Updates skipped for a non-finite loss, and "
                                     "candidates not published for non-finite weights.")
        self.stale_records = self._counter("learner_stale_records",
                                           "Records used for distillation only: drafted by a stale version.")

    def update(self, loss: float, lag_versions: int, record_age_s: float) -> None:
        """One optimizer step."""
        self.updates.inc()
        self.loss.set(loss)
        self.lag.set(lag_versions)
        self.record_age.observe(record_age_s)

    def buffer(self, depth: int, pending: int) -> None:
        self.depth.set(depth)
        self.pending.set(pending)

    def published(self, version: str) -> None:
        self.versions_published.inc()

    def promotion(self, refused: bool) -> None:
        (self.refusals if refused else self.promotions).inc()

    def canary_rollback(self) -> None:
        self.canary_rollbacks.inc()

    def skipped_update(self) -> None:
        self.skipped.inc()

    def stale(self, n: int) -> None:
        if n:
            self.stale_records.inc(n)


FINISHED_REASONS = ("stop", "length", "abort", "error")  # request_success_total{finished_reason}


class ApiMetrics(_Exporter):
    """What an API replica exports (vLLM's request metrics): requests by endpoint and status,
    latencies, prompt and generated tokens, finished requests by reason."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = ""):
        super().__init__(registry, model_name)
        self.requests = self._counter("http_requests", "HTTP requests answered.", ("endpoint", "status"))
        self.ttft_s = self._histogram("time_to_first_token_seconds", "Time from arrival to the first token.",
                                      LATENCY_BUCKETS)
        self.itl_s = self._histogram("inter_token_latency_seconds", "Time between two consecutive streamed chunks "
                                     "that carry tokens (one observation per gap).", LATENCY_BUCKETS)
        self.tpot_s = self._histogram("request_time_per_output_token_seconds", "Per request: its mean time per "
                                      "output token after the first ((e2e - ttft) / (tokens - 1)).", LATENCY_BUCKETS)
        self.e2e_s = self._histogram("e2e_request_latency_seconds", "Request latency, end to end.", LATENCY_BUCKETS)
        self.queue_s = self._histogram("request_queue_time_seconds", "Time a request waited for a cache slot.",
                                       LATENCY_BUCKETS)
        self.prompt_tokens_n = self._counter("prompt_tokens", "Prompt tokens of the requests admitted.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated for clients.")
        self.success = self._counter("request_success", "Requests finished, by reason: stop (a stop token or "
                                     "string), length (max_tokens or the context), abort (the client left), error.",
                                     ("finished_reason",))
        for reason in FINISHED_REASONS:  # every reason exported from the start: rate() sees the first one
            self.success.labels(reason)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def ttft(self, seconds: float) -> None:
        self.ttft_s.observe(seconds)

    def itl(self, seconds: float) -> None:
        """One gap between two streamed chunks that carry tokens."""
        self.itl_s.observe(seconds)

    def request_time_per_output_token(self, seconds: float) -> None:
        """One request's mean time per output token after the first."""
        self.tpot_s.observe(seconds)

    def tpot(self, seconds: float) -> None:
        """Former name of `request_time_per_output_token` (kept while call sites move)."""
        self.request_time_per_output_token(seconds)

    def e2e(self, seconds: float) -> None:
        self.e2e_s.observe(seconds)

    def queue_time(self, seconds: float) -> None:
        self.queue_s.observe(seconds)

    def prompt_tokens(self, n: int) -> None:
        self.prompt_tokens_n.inc(n)

    def generated(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def finished(self, reason: str) -> None:
        """One request finished: `reason` in FINISHED_REASONS."""
        if reason not in FINISHED_REASONS:
            raise ValueError(f"finished_reason must be one of {FINISHED_REASONS}, not {reason!r}")
        self.success.labels(reason).inc()


# ----------------------------------------------------------------------------- HTTP endpoint

_servers: dict[str, ThreadingHTTPServer] = {}  # address -> server (stop_metrics)


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics: the text format (0.0.4) whatever the scraper accepts. prometheus_client's own
    server negotiates OpenMetrics with Prometheus, and its OpenMetrics encoder writes `specloop:x`
    samples as `specloop_x` (client_python issue #1177): every `specloop:` query would come back empty."""

    registry: CollectorRegistry

    def do_GET(self):
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve_metrics(registry_or_metrics, host: str = "127.0.0.1", port: int = 0) -> str:
    """Serve a registry (or an exporter's) at http://host:port/metrics on a daemon thread; returns the
    "host:port" bound (port 0: a free one). A wildcard host is advertised as this machine's name."""
    registry = getattr(registry_or_metrics, "registry", registry_or_metrics)
    handler = type("MetricsHandler", (_MetricsHandler,), {"registry": registry})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    advertised = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    address = f"{advertised}:{server.server_address[1]}"
    _servers[address] = server
    return address


def stop_metrics(address: str) -> None:
    """Stop a server started by `serve_metrics`."""
    server = _servers.pop(address, None)
    if server is not None:
        server.shutdown()
        server.server_close()
