"""What every specloop metrics exporter shares: the `specloop:` prefix, latency buckets, the
`Exporter` base (a `CollectorRegistry` of its own, `model_name` bound to every series), the collector
of absolute totals, and the `/metrics` HTTP endpoint (`serve_metrics`, `stop_metrics`). The metric
names are listed in `specloop.services.metrics`."""
from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

PREFIX = "specloop:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)


class Totals:
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



class Exporter:
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

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = (), prefix: str = PREFIX):
        return self._bind(Counter(prefix + name, doc, self._names(labels), registry=self.registry), labels)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = (), prefix: str = PREFIX):
        return self._bind(Gauge(prefix + name, doc, self._names(labels), registry=self.registry), labels)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()):
        metric = Histogram(PREFIX + name, doc, self._names(labels), buckets=buckets, registry=self.registry)
        return self._bind(metric, labels)


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


def served_registry(address: str) -> CollectorRegistry | None:
    """The registry this process serves at `address` ("host:port" as `serve_metrics` returned it), None
    when this process serves nothing there."""
    server = _servers.get(address)
    return None if server is None else getattr(server.RequestHandlerClass, "registry", None)


def stop_metrics(address: str) -> None:
    """Stop a server started by `serve_metrics`."""
    server = _servers.pop(address, None)
    if server is not None:
        server.shutdown()
        server.server_close()
