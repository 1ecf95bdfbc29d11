"""An API replica's metrics (`ApiMetrics`, vLLM's request metrics): requests by endpoint and status,
latencies, prompt and generated tokens, finished requests by reason, and the metrics endpoints its /metrics
could not read. Names in `specloop.services.metrics`."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from specloop.services.metrics.export import LATENCY_BUCKETS, Exporter

FINISHED_REASONS = ("stop", "length", "abort", "error")  # request_success_total{finished_reason}


class ApiMetrics(Exporter):
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
        self.scrape_errors = self._counter(
            "metrics_scrape_errors", "Metrics endpoints behind this API (a worker, by its name; the learner, by "
            "its host:port) that did not answer a /metrics of the API in time, or answered something unreadable: "
            "their series were left out of that answer.", ("target",))

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

    def e2e(self, seconds: float) -> None:
        self.e2e_s.observe(seconds)

    def queue_time(self, seconds: float) -> None:
        self.queue_s.observe(seconds)

    def prompt_tokens(self, n: int) -> None:
        self.prompt_tokens_n.inc(n)

    def generated(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def scrape_failed(self, target: str) -> None:
        """A metrics endpoint behind the API was left out of its /metrics (services/metrics/federate.py)."""
        self.scrape_errors.labels(target).inc()

    def finished(self, reason: str) -> None:
        """One request finished: `reason` in FINISHED_REASONS."""
        if reason not in FINISHED_REASONS:
            raise ValueError(f"finished_reason must be one of {FINISHED_REASONS}, not {reason!r}")
        self.success.labels(reason).inc()
