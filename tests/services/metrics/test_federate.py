"""services/metrics/federate.py and the API's /metrics: one exposition of the API's own series and those of
every metrics endpoint behind it (workers labelled `worker`, the learner), read over HTTP within a deadline;
an endpoint that does not answer is left out and counted; a registry shared with the API is not read twice;
vLLM's spec-decode and scheduler names are exported by every worker, and the vLLM-named dashboard's queries
find every name they read at the API port of a real server (and in a real Prometheus scraping only it)."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from specloop.services.api.app import create_app
from specloop.services.metrics.api import ApiMetrics
from specloop.services.metrics.export import serve_metrics, stop_metrics
from specloop.services.metrics.federate import federated
from specloop.services.metrics.learner import LearnerMetrics
from specloop.services.metrics.serving import attach_metrics
from specloop.services.metrics.worker import WorkerMetrics
from specloop.services.protocol import WorkerInfo
from tests.admin_helpers import serving
from tests.prometheus_helpers import ThrowawayPrometheus, needs_prometheus

ROOT = Path(__file__).resolve().parents[3]
VLLM_DASHBOARD = ROOT / "dashboards" / "vllm_spec_decode.json"
MODEL = "tiny-verifier"


def info(name: str, metrics_url: str | None) -> WorkerInfo:
    return WorkerInfo(name, "/nowhere", MODEL, "pretrained", "v1", 256, 4, 16, metrics_url=metrics_url)


class Endpoints:
    """A Backend's metrics side: the workers (name → metrics_url) and the other endpoints listed."""

    def __init__(self, workers: dict[str, str | None], others: list[str] = ()):
        self.named, self.others = workers, list(others)

    async def workers(self) -> list[WorkerInfo]:
        return [info(name, url) for name, url in self.named.items()]

    async def metrics_targets(self) -> list[str]:
        return [url for url in self.named.values() if url] + self.others


def fed_worker(name: str, accepted: int) -> WorkerMetrics:
    m = WorkerMetrics(worker=name, model_name=MODEL, slots=4)
    m.serving("v1")
    m.blocks("v1", [3, 3], [accepted, 0])
    m.load(queued=1, running=2)
    m.step(0.01, 0.02)
    return m


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}; fails on a duplicate sample."""
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate sample {key}"
            out[key] = s.value
    return out


def assert_one_exposition(text: str) -> dict[tuple[str, tuple], float]:
    """Parses again, every family's HELP and TYPE once, no sample twice."""
    for kind in ("HELP", "TYPE"):
        names = [line.split()[2] for line in text.splitlines() if line.startswith(f"# {kind} ")]
        assert len(names) == len(set(names)), f"{kind} repeated: {sorted(n for n in names if names.count(n) > 1)}"
    return parse(text)


def get(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def served():
    """serve_metrics for the test, every endpoint stopped afterwards."""
    addresses: list[str] = []

    def serve(exporter) -> str:
        addresses.append(serve_metrics(exporter))
        return addresses[-1]

    yield serve
    for address in addresses:
        stop_metrics(address)


# ---------------------------------------------------------------- the merge


def test_the_api_answers_its_own_series_and_every_workers_and_the_learners_as_one_exposition(served):
    api = ApiMetrics(model_name=MODEL)
    api.request("/v1/completions", 200)
    w0, w1 = served(fed_worker("worker-0", 3)), served(fed_worker("worker-1", 1))
    learner = LearnerMetrics(model_name=MODEL)
    learner.update(0.5, 1, 2.0)
    endpoints = Endpoints({"worker-0": w0, "worker-1": w1}, [served(learner)])

    body, content_type = asyncio.run(federated(api, endpoints, timeout=5))
    assert content_type.startswith("text/plain")
    s = assert_one_exposition(body.decode())
    assert get(s, "specloop:http_requests_total", endpoint="/v1/completions", status="200", model_name=MODEL) == 1
    for worker, accepted in (("worker-0", 3), ("worker-1", 1)):  # the same series of two workers, told apart
        labels = dict(model_name=MODEL, worker=worker)
        assert get(s, "specloop:spec_decode_num_accepted_tokens_total", drafter_version="v1", **labels) == accepted
        assert get(s, "specloop:spec_decode_num_drafts_total", drafter_version="v1", **labels) == 2
        assert get(s, "vllm:spec_decode_num_accepted_tokens_total", **labels) == accepted
        assert get(s, "vllm:num_requests_running", **labels) == 2
        assert get(s, "specloop:step_seconds_bucket", le="0.025", **labels) == 1
        assert get(s, "specloop:worker_info", **labels) == 1  # its own worker label, kept (not doubled)
    assert get(s, "specloop:learner_updates_total", model_name=MODEL) == 1  # the learner's: as they are
    assert not [k for k in s if k[0].startswith("specloop:spec_decode") and "worker" not in dict(k[1])]
    assert get(s, "specloop:metrics_scrape_errors_total", model_name=MODEL, target="worker-0") is None


def test_without_endpoints_behind_it_the_api_answers_its_own_render():
    api = ApiMetrics(model_name=MODEL)
    body, _ = asyncio.run(federated(api, Endpoints({"worker-0": None})))
    assert body == api.render()[0]


class _Garbage(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"# TYPE x counter\nx{unclosed 1\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_an_endpoint_that_does_not_answer_in_time_or_answers_garbage_is_left_out_and_counted(served):
    api = ApiMetrics(model_name=MODEL)
    good = served(fed_worker("worker-0", 2))
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    garbage = ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=garbage.serve_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nobody listens there
    endpoints = Endpoints({"worker-0": good, "worker-1": f"127.0.0.1:{silent.getsockname()[1]}",
                           "worker-2": f"127.0.0.1:{garbage.server_address[1]}", "worker-3": refused})
    try:
        for scrape in (1, 2):
            start = time.monotonic()
            body, _ = asyncio.run(federated(api, endpoints, timeout=0.5))
            assert time.monotonic() - start < 2.0  # the deadline, not the silent worker, ends the scrape
            s = assert_one_exposition(body.decode())
            assert get(s, "specloop:spec_decode_num_accepted_tokens_total", drafter_version="v1", model_name=MODEL,
                       worker="worker-0") == 2
            for worker in ("worker-1", "worker-2", "worker-3"):
                assert get(s, "specloop:metrics_scrape_errors_total", model_name=MODEL, target=worker) == scrape
            assert get(s, "specloop:metrics_scrape_errors_total", model_name=MODEL, target="worker-0") is None
    finally:
        silent.close()
        garbage.shutdown()
        garbage.server_close()


def test_a_worker_sharing_the_apis_registry_in_one_process_is_not_read_twice(served):
    shared = CollectorRegistry()
    api, worker = ApiMetrics(shared, model_name=MODEL), WorkerMetrics(shared, worker="worker-0", model_name=MODEL)
    worker.blocks("v1", [2], [1])
    own = served(worker)  # the shared registry, served in this process
    other = served(fed_worker("worker-1", 3))  # a worker of its own registry
    body, _ = asyncio.run(federated(api, Endpoints({"worker-0": own, "worker-1": other}), timeout=5))
    s = assert_one_exposition(body.decode())
    drafts = {dict(k[1]).get("worker"): v for k, v in s.items() if k[0] == "vllm:spec_decode_num_drafts_total"}
    assert drafts == {None: 1, "worker-1": 2}  # the shared registry's once (unlabelled: the API's own), the other's
    assert get(s, "specloop:metrics_scrape_errors_total", model_name=MODEL, target="worker-0") is None


def test_a_family_typed_otherwise_at_a_worker_is_left_out_and_the_rest_kept(served):
    clash = CollectorRegistry()
    from prometheus_client import Gauge

    Gauge("specloop:http_requests_total", "not a counter", registry=clash).set(7)  # the API's counter's name
    fed = WorkerMetrics(clash, worker="worker-0")
    fed.blocks("v1", [2], [2])
    api = ApiMetrics(model_name=MODEL)
    body, _ = asyncio.run(federated(api, Endpoints({"worker-0": served(clash)}), timeout=5))
    s = assert_one_exposition(body.decode())
    assert not [k for k in s if k[0] == "specloop:http_requests_total" and dict(k[1]).get("worker")]
    assert get(s, "specloop:spec_decode_num_drafts_total", drafter_version="v1", worker="worker-0") == 1


# ---------------------------------------------------------------- vLLM's names


def test_a_worker_exports_vllms_spec_decode_and_scheduler_series_over_every_drafter_version():
    m = WorkerMetrics(model_name=MODEL)
    m.serving("v1")
    m.blocks("v1", [4, 4, 0], [4, 1, 0])
    m.block("v2", 2, 2)
    m.load(queued=3, running=5)
    s = parse(m.render()[0].decode())
    assert get(s, "vllm:spec_decode_num_drafts_total", model_name=MODEL) == 3
    assert get(s, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL) == 10
    assert get(s, "vllm:spec_decode_num_accepted_tokens_total", model_name=MODEL) == 7
    per_pos = [get(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name=MODEL, position=str(i))
               for i in range(4)]
    assert per_pos == [3, 2, 1, 1]
    assert get(s, "vllm:num_requests_running", model_name=MODEL) == 5
    assert get(s, "vllm:num_requests_waiting", model_name=MODEL) == 3
    for i in range(20):  # the specloop: series of old versions go; vLLM's totals stay
        m.block(f"v9{i:03d}", 1, 1)
    assert get(parse(m.render()[0].decode()), "vllm:spec_decode_num_drafts_total", model_name=MODEL) == 23


def vllm_dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(VLLM_DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def vllm_names(expr: str) -> set[str]:
    return set(re.findall(r"vllm:[a-zA-Z_:]+[a-zA-Z_]", expr))


def test_the_vllm_dashboard_reads_vllms_spec_decode_names_only():
    queries = vllm_dashboard_queries()
    names = set().union(*(vllm_names(e) for _, e in queries))
    assert {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "vllm:num_requests_running", "vllm:num_requests_waiting"} == names
    for title, expr in queries:
        assert "specloop:" not in expr, title
        assert all(f'{n}{{model_name=~"$model_name"}}' in expr for n in vllm_names(expr)), title
    assert "rate(vllm:spec_decode_num_accepted_tokens_total" in queries[0][1]  # acceptance rate: accepted / drafted
    assert "rate(vllm:spec_decode_num_draft_tokens_total" in queries[0][1]


# ---------------------------------------------------------------- a real API and worker


@pytest.fixture(scope="module")
def api_and_worker(tiny_pair):
    """A real worker (LocalBackend, the tiny pair) whose WorkerMetrics are served on their own port, behind the
    API (its own ApiMetrics) served by uvicorn; one speculative request decoded. Yields (API URL, worker address)."""
    from specloop.drafter.model.loading import load_tokenizer
    from specloop.services.worker.serving_loop import LocalBackend, wait_ready

    backend = LocalBackend.open(str(tiny_pair[0]), str(tiny_pair[1]), "pretrained", model=MODEL, slots=2)
    metrics = WorkerMetrics(worker="worker-0", model_name=MODEL, slots=2)
    attach_metrics(backend.loop, metrics)
    backend.metrics_url = serve_metrics(metrics)
    try:
        assert wait_ready(backend.loop, 30), "the worker did not warm up"
        info = asyncio.run(backend.workers())[0]
        app = create_app(backend, load_tokenizer(info.verifier), info.model, info.max_context,
                         metrics=ApiMetrics(model_name=MODEL))
        with serving(app) as url:
            body = {"model": MODEL, "prompt": "def main():", "max_tokens": 16, "temperature": 0,
                    "speculative": {"enabled": True, "k": 4}}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["drafted_tokens"] > 0, reply.json()["usage"]
            yield url, backend.metrics_url
    finally:
        stop_metrics(backend.metrics_url)
        asyncio.run(backend.close())


def test_the_api_ports_metrics_carry_every_name_the_vllm_spec_decode_panels_read(api_and_worker):
    url, _ = api_and_worker
    reply = httpx.get(url + "/metrics", timeout=10)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    s = assert_one_exposition(reply.text)
    present = {name for name, labels in s if dict(labels).get("worker") == "worker-0"}
    for title, expr in vllm_dashboard_queries():
        missing = vllm_names(expr) - present
        assert not missing, f"{title}: {sorted(missing)} not at the API port's /metrics"
    assert get(s, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL, worker="worker-0") > 0
    assert get(s, "specloop:http_requests_total", endpoint="/v1/completions", status="200", model_name=MODEL) == 1
    assert reply.text.count("# TYPE specloop:http_requests_total counter") == 1


def test_metrics_federate_false_answers_the_apis_own_series_and_sd_targets_is_unchanged(api_and_worker):
    url, worker = api_and_worker
    own = parse(httpx.get(url + "/metrics", params={"federate": "false"}, timeout=10).text)
    assert get(own, "specloop:http_requests_total", endpoint="/v1/completions", status="200", model_name=MODEL) == 1
    assert not [k for k in own if k[0].startswith(("vllm:", "specloop:spec_decode"))]
    assert httpx.get(url + "/sd/targets", timeout=10).json() == [{"targets": [worker],
                                                                  "labels": {"job": "specloop-actors"}}]


@pytest.mark.integration
@needs_prometheus
def test_a_prometheus_scraping_only_the_api_port_answers_every_vllm_spec_decode_panel(api_and_worker, tmp_path):
    url, _ = api_and_worker
    prom = ThrowawayPrometheus(tmp_path, [url.removeprefix("http://")]).start()
    try:
        prom.wait_for_targets(1)
        prom.wait_for_samples("vllm:spec_decode_num_drafts_total", 3)
        for title, expr in vllm_dashboard_queries():
            filled = expr.replace("$__rate_interval", "15s").replace("$model_name", ".*")
            result = prom.query(filled)
            assert result, f"{title}: no data for {filled}"
        [drafted] = prom.query('vllm:spec_decode_num_draft_tokens_total{job="static", worker="worker-0"}')
        assert float(drafted["value"][1]) > 0
    finally:
        prom.stop()
