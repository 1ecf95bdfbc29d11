"""The Grafana dashboard and the alert rules: the committed JSON is a fresh build of
dashboards/build.py, every panel queries Prometheus through the `${datasource}` variable and filters
every selector on the `model_name` and `instance` variables, the alert rules pass promtool, and
every panel's PromQL returns data from a real Prometheus scraping specloop metrics: exporters fed
with known counts (checking the numbers the queries derive, and that another model's name or another
instance filters them out), and a real `specloop serve` under chat traffic."""
from __future__ import annotations

import json
import math
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from dashboards import build
from specloop.services.cli.launch import ServeProcess
from specloop.services.metrics.api import ApiMetrics
from specloop.services.metrics.export import serve_metrics, stop_metrics
from specloop.services.metrics.learner import LearnerMetrics
from specloop.services.metrics.worker import WorkerMetrics
from tests.prometheus_helpers import PROMTOOL, ThrowawayPrometheus, needs_prometheus, needs_promtool

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "specloop.json"
RULES = ROOT / "deploy" / "prometheus"
RATE_INTERVAL = "15s"
MODEL = "tiny-chat"  # the fake exporters' model_name


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def fill(expr: str, interval: str = RATE_INTERVAL, model: str = build.ANY, instance: str = build.ANY) -> str:
    """What Grafana sends: the rate interval and the variables filled in ("All" is `.*`)."""
    return (expr.replace("$__rate_interval", interval).replace("$model_name", model)
            .replace("$instance", instance))


def raw_panel_queries(board: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in board["panels"] if p["type"] != "row" for t in p["targets"]]


def panel_queries(board: dict, **variables) -> list[tuple[str, str]]:
    """(panel title, PromQL with $__rate_interval and the variables filled in) of every panel target."""
    return [(title, fill(expr, **variables)) for title, expr in raw_panel_queries(board)]


def annotation_queries(board: dict, **variables) -> list[tuple[str, str]]:
    return [(a["name"], fill(a["expr"], **variables)) for a in board["annotations"]["list"]]


def variables(board: dict) -> dict[str, dict]:
    return {v["name"]: v for v in board["templating"]["list"]}


SELECTOR = re.compile(r"(specloop:\w+)(\{[^}]*\})?")


# ---------------------------------------------------------------- the JSON and the rules


def test_the_committed_dashboard_json_is_a_fresh_build():
    assert DASHBOARD.read_text() == build.render(), "run: python dashboards/build.py"


def test_every_panel_queries_prometheus_through_the_datasource_variable():
    board = dashboard()
    assert [v["name"] for v in board["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"] and t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    for a in board["annotations"]["list"]:
        assert a["datasource"]["uid"] == "${datasource}" and "specloop:drafter_" in a["expr"]
    exprs = " ".join(q for _, q in panel_queries(board))
    for metric in ("spec_decode_num_accepted_tokens_per_pos_total", "generation_tokens_total", "prompt_tokens_total",
                   "committed_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                   "request_time_per_output_token_seconds", "request_queue_time_seconds", "request_success_total",
                   "num_requests_waiting", "num_requests_running", "cache_slot_usage_perc", "learner_loss",
                   "learner_lag_versions", "buffer_depth", "replay_records_dropped_total", "step_forward_seconds"):
        assert f"specloop:{metric}" in exprs
    for gone in ("specloop:time_per_output_token_seconds", "specloop:completion_tokens_total"):
        assert gone not in exprs


def test_the_model_name_and_instance_variables_list_the_label_values_of_specloop_series():
    found = variables(dashboard())
    assert list(found) == ["datasource", "model_name", "instance"]
    for name in ("model_name", "instance"):
        v = found[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}"
        assert re.fullmatch(rf'label_values\(\{{__name__=~"specloop:\.\+"[^}}]*\}}, {name}\)', v["query"]), v["query"]
        assert v["includeAll"] and v["multi"] and v["allValue"] == ".*" and v["current"]["value"] == "$__all"
    assert 'model_name=~"$model_name"' in found["instance"]["query"]  # instances of the chosen models


def test_every_selector_of_every_panel_and_annotation_filters_on_the_model_and_the_instance():
    board = dashboard()
    exprs = raw_panel_queries(board) + [(a["name"], a["expr"]) for a in board["annotations"]["list"]]
    assert len(exprs) > 30
    for title, expr in exprs:
        selectors = SELECTOR.findall(expr)
        assert selectors, f"{title}: no specloop metric in {expr}"
        for metric, matchers in selectors:
            assert 'model_name=~"$model_name"' in matchers and 'instance=~"$instance"' in matchers, \
                f"{title}: {metric} is not filtered by the variables: {expr}"


@needs_promtool
def test_the_alert_rules_pass_promtool_and_their_unit_tests():
    check = subprocess.run([PROMTOOL, "check", "rules", "alerts.yml"], cwd=RULES, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=RULES, capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr


# ---------------------------------------------------------------- exporters fed with known counts


class _ApiHandler(BaseHTTPRequestHandler):
    """GET /metrics (the API's registry) and GET /sd/targets (the worker's and learner's endpoints)."""

    api: ApiMetrics
    targets: list[str]

    def do_GET(self):
        if self.path == "/metrics":
            body, content_type = self.api.render()
        elif self.path == "/sd/targets":
            body, content_type = json.dumps([{"targets": self.targets}]).encode(), "application/json"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class FakeSpecloop:
    """Worker, learner and API exporters on three ports, fed every 50 ms with known counts:
    drafter v0001 accepts 2 of 4 drafts per block (α 0.5, τ 3), v0002 3 of 4 (after a swap)."""

    def __init__(self):
        self.worker = WorkerMetrics(worker="worker-0", model_name=MODEL, slots=8)
        self.learner, self.api = LearnerMetrics(model_name=MODEL), ApiMetrics(model_name=MODEL)
        self.endpoints = [serve_metrics(self.worker), serve_metrics(self.learner)]
        handler = type("Handler", (_ApiHandler,), {"api": self.api, "targets": self.endpoints})
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.address = f"127.0.0.1:{self.http.server_address[1]}"
        self.version, self.stop = "v0001", threading.Event()
        self.worker.serving(self.version)
        self.thread = threading.Thread(target=self._feed, daemon=True)

    def start(self) -> "FakeSpecloop":
        self.thread.start()
        return self

    def swap(self) -> None:
        """Swap v0002 in (and count a rollback, so that both annotations have an event)."""
        self.worker.swap(self.version, "v0002")
        self.worker.rollback()
        self.version = "v0002"

    def _feed(self) -> None:
        logged = 0
        while not self.stop.wait(0.05):
            accepted = 2 if self.version == "v0001" else 3
            self.worker.blocks(self.version, [4, 4, 4, 4], [accepted] * 4)
            self.worker.speculators(self.version, [("adaptive", 4, accepted)] * 3 + [("suffix", 4, 4)])
            self.worker.generated(4 * (accepted + 1))
            self.worker.load(queued=2, running=4)
            self.worker.step(0.008, 0.010)
            logged += 4
            self.worker.records(logged, logged // 100)
            self.learner.update(loss=0.4, lag_versions=1, record_age_s=1.5)
            self.learner.buffer(depth=logged, pending=8)
            self.learner.stale(1)
            self.api.request("/v1/chat/completions", 200)
            self.api.queue_time(0.001)
            self.api.ttft(0.02)
            self.api.itl(0.004)
            self.api.request_time_per_output_token(0.004)
            self.api.e2e(0.3)
            self.api.prompt_tokens(10)
            self.api.generated(16)
            self.api.finished("stop")

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.http.shutdown()
        for address in self.endpoints:
            stop_metrics(address)


@pytest.fixture
def fake_specloop():
    fake = FakeSpecloop().start()
    yield fake
    fake.close()


def quantile_of(histogram: str) -> str:
    return build.quantile(0.99, histogram)


def last_value(result: list[dict], **labels) -> float:
    [match] = [r for r in result if all(r["metric"].get(k) == v for k, v in labels.items())]
    return float(match["value"][1])


@needs_prometheus
def test_every_panel_query_returns_the_numbers_fed_to_the_exporters(tmp_path, fake_specloop):
    prom = ThrowawayPrometheus(tmp_path, [fake_specloop.address], [f"http://{fake_specloop.address}/sd/targets"]).start()
    try:
        prom.wait_for_targets(3)
        prom.wait_for_samples("specloop:spec_decode_num_drafts_total", 4)
        fake_specloop.swap()
        prom.wait_for_samples('specloop:spec_decode_num_drafts_total{drafter_version="v0002"}', 4)
        board = dashboard()
        for title, expr in panel_queries(board, model=MODEL):
            assert prom.query(expr), f"{title}: no data for {expr}"
        for name, expr in annotation_queries(board, model=MODEL):
            assert prom.query(expr), f"annotation {name}: no data for {expr}"
        other = dict(model="another-model")
        for title, expr in panel_queries(board, **other) + annotation_queries(board, **other):
            assert not prom.query(expr), f"{title}: data of another model for {expr}"

        acceptance = prom.query(fill(build.ACCEPTANCE_RATE, "1m", model=MODEL))
        assert last_value(acceptance, drafter_version="v0001") == pytest.approx(0.5, abs=0.02)
        assert last_value(acceptance, drafter_version="v0002") == pytest.approx(0.75, abs=0.02)
        tau = prom.query(fill(build.MEAN_ACCEPTANCE_LENGTH, "1m"))
        assert last_value(tau, drafter_version="v0001") == pytest.approx(3.0, abs=0.05)
        per_pos = prom.query(fill(build.PER_POSITION, "1m"))
        assert [last_value(per_pos, drafter_version="v0002", position=str(i)) for i in range(4)] == \
            pytest.approx([1.0, 1.0, 1.0, 0.0], abs=0.02)  # ratios of counters, as below
        share = prom.query(fill(build.SPECULATOR_SHARE, "1m"))
        assert last_value(share, speculator="suffix") == pytest.approx(0.25, abs=0.02)
        assert last_value(prom.query(fill(build.SPECULATOR_TAU, "1m")), speculator="suffix") == pytest.approx(5.0, abs=0.05)
        step = prom.query(fill(build.STEP_FORWARD, "1m"))
        # two counters (the forward seconds' sum, the steps' count) that a scrape may catch one observation apart:
        # 0.008 · 177 / 176 seen once (CI on a loaded machine)
        assert float(step[0]["value"][1]) == pytest.approx(0.008, rel=0.02)
        assert last_value(prom.query("max by (drafter_version) (specloop:drafter_info)"), drafter_version="v0002") == 1
        [usage] = prom.query(fill('max by (instance) (specloop:cache_slot_usage_perc{model_name=~"$model_name"})'))
        assert float(usage["value"][1]) == 0.5  # 4 running of 8 slots

        # The variables: Grafana's label_values(selector, label) is the series API's label values.
        def label_values(name: str, model: str = build.ANY) -> list[str]:
            selector = fill(build.VARIABLE_QUERIES[name][1], model=model)
            return prom.api(f"label/{name}/values", **{"match[]": selector})
        assert label_values("model_name") == [MODEL]
        worker, learner = fake_specloop.endpoints
        assert sorted(label_values("instance", MODEL)) == sorted([fake_specloop.address, worker, learner])
        assert label_values("instance", "another-model") == []
        # One instance chosen: the worker's panels keep their data, the API's have none.
        only_worker = dict(model=MODEL, instance=worker)
        assert prom.query(fill(build.ACCEPTANCE_RATE, **only_worker))
        assert not prom.query(fill(quantile_of("specloop:time_to_first_token_seconds"), **only_worker))
    finally:
        prom.stop()


# ---------------------------------------------------------------- a real `specloop serve` under traffic


class SpecloopServe(ServeProcess):
    """`specloop serve` over the tiny pair (API, worker and klrl learner training an eagle head, with a static
    copy and suffix decoding chosen per step beside it), with its own registry (and Redis key prefix, when
    Redis answers), deleted from Redis when it stops."""

    def __init__(self, tmp_path: Path, verifier: Path, drafter: Path):
        super().__init__(["--verifier", verifier, "--drafter", drafter, "--drafter-kind", "eagle",
                          "--speculators", "static,suffix", "--learner", "klrl"], threads=1,
                         registry=tmp_path / "registry", log=tmp_path / "serve.log", cwd=tmp_path)

    def chat(self, client: httpx.Client, i: int) -> None:
        """One chat request: greedy or sampled, streamed or not."""
        body = {"model": self.model, "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
                "max_tokens": 24, "temperature": 0.0 if i % 2 else 0.8, "seed": i, "stream": i % 3 == 0}
        reply = client.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text

    def traffic(self, stop: threading.Event, errors: list) -> None:
        with httpx.Client() as client:
            i = 0
            while not stop.is_set():
                try:
                    self.chat(client, i)
                except Exception as exc:  # reported by the test
                    errors.append(repr(exc))
                i += 1

    def stop(self) -> None:
        super().stop(timeout=60)
        self.forget_redis_keys()


@pytest.fixture
def specloop_under_traffic(tiny_pair, tmp_path):
    """A running `specloop serve` with two clients sending chat requests until the test ends."""
    serve = SpecloopServe(tmp_path, *tiny_pair).start()
    stop, errors = threading.Event(), []
    clients = [threading.Thread(target=serve.traffic, args=(stop, errors), daemon=True) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        yield serve, errors
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=90)
        serve.stop()


def finite(result: list[dict]) -> list[float]:
    return [v for r in result if math.isfinite(v := float(r["value"][1]))]


@needs_prometheus
def test_every_panel_query_returns_data_from_a_real_specloop_serve_under_traffic(tmp_path, specloop_under_traffic):
    serve, errors = specloop_under_traffic
    sd = httpx.get(f"{serve.url}/sd/targets", timeout=10).json()
    discovered = [t for group in sd for t in group["targets"]]
    assert len(discovered) >= 2, f"/sd/targets should list the worker and the learner: {sd}"
    prom = ThrowawayPrometheus(tmp_path, [f"127.0.0.1:{serve.port}"], [f"{serve.url}/sd/targets"]).start()
    try:
        prom.wait_for_targets(1 + len(discovered), timeout=60)
        for metric in ("specloop:spec_decode_num_drafts_total", "specloop:http_requests_total",
                       "specloop:learner_updates_total", "specloop:spec_decode_speculator_drafts_total"):
            prom.wait_for_samples(metric, 4, timeout=90)
        # Job "static" scrapes the API port alone: its /metrics carries the workers' series too, labelled `worker`.
        for metric in ("specloop:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total"):
            found = prom.query(f'{metric}{{job="static"}}')
            assert found and all(r["metric"].get("worker") for r in found), f"{metric} at the API port: {found}"
        board = dashboard()
        empty = [f"{title}: {expr}" for title, expr in panel_queries(board) if not prom.query(expr)]
        assert not empty, "panels without data:\n" + "\n".join(empty) + f"\nserve log: {serve.logs()}"
        for _, expr in annotation_queries(board):
            prom.query(expr)  # valid PromQL; a swap may or may not have happened yet
        # The counters themselves, scraped together: accepted never exceeds drafted, per version.
        raw = prom.query(f"{build.SPEC}accepted_tokens_total / {build.SPEC}draft_tokens_total")
        assert finite(raw) and all(0 <= a <= 1 for a in finite(raw)), raw
        # The panel's rate ratio: Prometheus extrapolates each series' rate to the window's edges on
        # its own (a version that appeared mid-window is extrapolated by its first sample), so a
        # ratio of two rates may overshoot the true acceptance by a few percent; never by more.
        rated = finite(prom.query(fill(build.ACCEPTANCE_RATE, "1m")))
        assert all(0 <= a <= 1.1 for a in rated), rated
        tokens = prom.query(f"sum(rate(specloop:generation_tokens_total[{RATE_INTERVAL}]))")
        assert finite(tokens) and finite(tokens)[0] > 0
    finally:
        prom.stop()
    assert not errors, errors[:5]
