"""Metrics exporters: the exposition text of the worker's, the learner's and the API's metrics (names,
labels, per-position counts, absolute totals, swaps), block statistics, and `serve_metrics` over HTTP."""
from __future__ import annotations

import math

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from specloop.drafter.decode.stats import AcceptanceStats
from specloop.services.metrics.api import FINISHED_REASONS, ApiMetrics
from specloop.services.metrics.export import serve_metrics, stop_metrics
from specloop.services.metrics.learner import LearnerMetrics
from specloop.services.metrics.worker import MAX_VERSIONS, WorkerMetrics


def samples(exporter) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} parsed from an exporter's exposition."""
    body, content_type = exporter.render()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def value(exporter, name: str, **labels) -> float | None:
    return samples(exporter).get((name, tuple(sorted(labels.items()))))


# ---------------------------------------------------------------- block statistics


def test_block_stats_count_drafts_tokens_and_accepted_positions():
    stats = AcceptanceStats.of([4, 4, 2, 0], [4, 1, 0, 0])
    assert (stats.drafts, stats.drafted, stats.accepted) == (3, 10, 5)
    assert stats.accepted_per_position == [2, 1, 1, 1]
    assert stats.acceptance_rate() == 0.5
    assert stats.mean_acceptance_length() == pytest.approx(1 + 5 / 3)


def test_block_stats_reject_more_accepted_than_drafted_and_mismatched_rows():
    with pytest.raises(ValueError):
        AcceptanceStats.of([2], [3])
    with pytest.raises(ValueError):
        AcceptanceStats.of([2, 2], [1])
    assert AcceptanceStats.of([0], [0]).mean_acceptance_length() is None


# ---------------------------------------------------------------- worker


def test_worker_blocks_export_the_spec_decode_counters_by_drafter_version():
    m = WorkerMetrics()
    m.blocks("v0002", [4, 4, 4], [4, 2, 0])
    m.block("v0002", 4, 1)
    m.block("v0003", 2, 2)
    s = samples(m)
    v2 = (("drafter_version", "v0002"),)
    assert s[("specloop:spec_decode_num_drafts_total", v2)] == 4
    assert s[("specloop:spec_decode_num_draft_tokens_total", v2)] == 16
    assert s[("specloop:spec_decode_num_accepted_tokens_total", v2)] == 7
    per_pos = [s[("specloop:spec_decode_num_accepted_tokens_per_pos_total",
                  (("drafter_version", "v0002"), ("position", str(i))))] for i in range(4)]
    assert per_pos == [3, 2, 1, 1]
    assert value(m, "specloop:spec_decode_num_accepted_tokens_total", drafter_version="v0003") == 2


def test_a_mix_of_speculators_exports_blocks_draft_tokens_and_accepted_by_speculator():
    m = WorkerMetrics()
    m.speculators("v0002", [("suffix", 3, 3), ("adaptive", 4, 1), ("suffix", 2, 0), ("static", 0, 0)])
    m.speculators("v0002", [("static", 4, 4)])
    got = {(spec, name): value(m, f"specloop:spec_decode_speculator_{name}_total", drafter_version="v0002",
                               speculator=spec)
           for spec in ("suffix", "adaptive", "static") for name in ("drafts", "draft_tokens", "accepted_tokens")}
    assert [got[("suffix", n)] for n in ("drafts", "draft_tokens", "accepted_tokens")] == [2, 5, 3]
    assert [got[("adaptive", n)] for n in ("drafts", "draft_tokens", "accepted_tokens")] == [1, 4, 1]
    assert [got[("static", n)] for n in ("drafts", "draft_tokens", "accepted_tokens")] == [1, 4, 4]  # k = 0: none


def test_every_drafted_position_is_exported_even_when_never_accepted():
    m = WorkerMetrics()
    m.blocks("v1", [3, 3], [0, 0])
    for i in range(3):
        assert value(m, "specloop:spec_decode_num_accepted_tokens_per_pos_total", drafter_version="v1",
                     position=str(i)) == 0


def test_blocks_without_a_draft_count_no_drafts_and_tokens_are_counted_by_generated():
    m = WorkerMetrics()
    m.blocks("v1", [0, 0], [0, 0])
    m.generated(2)
    m.generated(5)
    assert value(m, "specloop:spec_decode_num_drafts_total", drafter_version="v1") is None
    assert value(m, "specloop:committed_tokens_total") == 7


def test_load_and_step_times_are_exported_as_gauges_and_histograms():
    m = WorkerMetrics()
    m.load(queued=3, running=2)
    m.step(seconds_forward=0.004, seconds_total=0.006)
    m.step(seconds_forward=0.2, seconds_total=0.3)
    s = samples(m)
    assert s[("specloop:num_requests_waiting", ())] == 3
    assert s[("specloop:num_requests_running", ())] == 2
    assert s[("specloop:step_forward_seconds_count", ())] == 2
    assert s[("specloop:step_seconds_sum", ())] == pytest.approx(0.306)
    assert s[("specloop:step_seconds_bucket", (("le", "0.01"),))] == 1


def test_a_swap_counts_and_moves_the_drafter_info_gauge_to_the_new_version():
    m = WorkerMetrics(worker="worker-7")
    m.serving("v0001")
    assert value(m, "specloop:drafter_swaps_total") == 0
    m.swap("v0001", "v0002")
    m.rollback()
    assert value(m, "specloop:drafter_swaps_total") == 1
    assert value(m, "specloop:drafter_rollbacks_total") == 1
    assert value(m, "specloop:drafter_info", drafter_version="v0002") == 1
    assert value(m, "specloop:drafter_info", drafter_version="v0001") is None
    assert value(m, "specloop:worker_info", worker="worker-7") == 1
    assert value(m, "specloop:spec_decode_num_drafts_total", drafter_version="v0002") == 0  # before its first block


def test_replay_record_totals_are_set_to_absolute_values():
    m = WorkerMetrics()
    assert value(m, "specloop:replay_records_logged_total") == 0
    m.records(logged_total=10, dropped_total=1)
    m.records(logged_total=25, dropped_total=3, observed_total=7)
    assert value(m, "specloop:replay_records_logged_total") == 25
    assert value(m, "specloop:replay_records_dropped_total") == 3
    assert value(m, "specloop:replay_records_observed_total") == 7
    body, _ = m.render()
    assert b"# TYPE specloop:replay_records_dropped_total counter" in body


def test_old_versions_series_are_removed_but_never_the_serving_versions():
    m = WorkerMetrics()
    m.serving("v0000")
    for i in range(MAX_VERSIONS + 3):
        m.block(f"v{i:04d}", 2, 1)
    s = samples(m)
    versions = {dict(labels)["drafter_version"] for name, labels in s if name == "specloop:spec_decode_num_drafts_total"}
    assert len(versions) == MAX_VERSIONS
    assert "v0000" in versions and "v0001" not in versions and f"v{MAX_VERSIONS + 2:04d}" in versions


def test_the_controllers_chosen_k_is_a_histogram_by_drafter_version_and_its_estimates_are_gauges():
    m = WorkerMetrics()
    m.serving("v0001")
    for k in (0, 0, 0, 2):
        m.chosen_k("v0001", k)
    m.chosen_k("v0002", 4)
    assert value(m, "specloop:spec_decode_chosen_k_count", drafter_version="v0001") == 4
    assert value(m, "specloop:spec_decode_chosen_k_sum", drafter_version="v0001") == 2
    assert value(m, "specloop:spec_decode_chosen_k_bucket", drafter_version="v0001", le="0.0") == 3
    assert value(m, "specloop:spec_decode_chosen_k_bucket", drafter_version="v0002", le="3.0") == 0
    assert value(m, "specloop:spec_decode_chosen_k_bucket", drafter_version="v0002", le="4.0") == 1
    m.estimates({"acceptance": [0.6, 0.5], "speedup": [1.0, 1.2, 0.9]})
    assert value(m, "specloop:spec_decode_est_acceptance", position="1") == 0.5
    assert value(m, "specloop:spec_decode_est_speedup", k="1") == 1.2
    m.estimates({"acceptance": [0.4, 0.3], "speedup": None})  # nothing measured yet: no speedup to show
    assert value(m, "specloop:spec_decode_est_acceptance", position="0") == 0.4
    for i in range(MAX_VERSIONS + 2):  # an evicted version's histogram goes with its counters
        m.block(f"v9{i:03d}", 1, 1)
    assert value(m, "specloop:spec_decode_chosen_k_count", drafter_version="v0002") is None


def test_two_exporters_get_separate_registries_and_may_share_one():
    WorkerMetrics().block("v1", 1, 1)
    assert value(WorkerMetrics(), "specloop:spec_decode_num_drafts_total", drafter_version="v1") is None
    shared = CollectorRegistry()
    worker, learner, api = WorkerMetrics(shared), LearnerMetrics(shared), ApiMetrics(shared)
    worker.generated(3)
    api.generated(2)
    assert worker.render() == learner.render() == api.render()
    assert value(api, "specloop:committed_tokens_total") == 3  # the worker's
    assert value(api, "specloop:generation_tokens_total") == 2  # the API's (vLLM's name)


# ---------------------------------------------------------------- learner and API


def test_learner_metrics_export_updates_loss_lag_age_buffer_and_the_gate():
    m = LearnerMetrics()
    m.update(loss=0.7, lag_versions=0, record_age_s=0.3)
    m.update(loss=0.5, lag_versions=2, record_age_s=40.0)
    m.buffer(depth=120, pending=8)
    m.published("v0002")
    m.promotion(refused=False)
    m.promotion(refused=True)
    m.stale(4)
    s = samples(m)
    assert s[("specloop:learner_updates_total", ())] == 2
    assert s[("specloop:learner_loss", ())] == 0.5
    assert s[("specloop:learner_lag_versions", ())] == 2
    assert s[("specloop:learner_record_age_seconds_count", ())] == 2
    assert s[("specloop:learner_record_age_seconds_bucket", (("le", "0.5"),))] == 1
    assert (s[("specloop:buffer_depth", ())], s[("specloop:buffer_pending", ())]) == (120, 8)
    assert s[("specloop:learner_versions_published_total", ())] == 1
    assert s[("specloop:promotions_total", ())] == s[("specloop:promotion_refusals_total", ())] == 1
    assert s[("specloop:learner_stale_records_total", ())] == 4


def test_api_metrics_export_requests_by_endpoint_and_status_and_latency_histograms():
    m = ApiMetrics()
    m.request("/v1/chat/completions", 200)
    m.request("/v1/chat/completions", 200)
    m.request("/v1/completions", 400)
    m.ttft(0.002)
    m.request_time_per_output_token(0.03)
    m.request_time_per_output_token(0.02)
    for gap in (0.004, 0.004, 0.2):
        m.itl(gap)
    m.e2e(1.5)
    m.e2e(90.0)
    m.queue_time(0.3)
    s = samples(m)
    assert s[("specloop:http_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 2
    assert s[("specloop:http_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
    assert s[("specloop:time_to_first_token_seconds_bucket", (("le", "0.0025"),))] == 1
    assert s[("specloop:request_time_per_output_token_seconds_count", ())] == 2
    assert s[("specloop:request_time_per_output_token_seconds_sum", ())] == pytest.approx(0.05)
    assert s[("specloop:inter_token_latency_seconds_count", ())] == 3
    assert s[("specloop:inter_token_latency_seconds_bucket", (("le", "0.005"),))] == 2
    assert s[("specloop:e2e_request_latency_seconds_bucket", (("le", "60.0"),))] == 1
    assert s[("specloop:e2e_request_latency_seconds_bucket", (("le", "+Inf"),))] == 2
    assert s[("specloop:request_queue_time_seconds_bucket", (("le", "0.25"),))] == 0
    assert s[("specloop:request_queue_time_seconds_bucket", (("le", "0.5"),))] == 1
    assert not any(name.startswith("specloop:time_per_output_token") for name, _ in s)


def test_api_metrics_count_prompt_and_generated_tokens_and_finished_requests_by_reason():
    m = ApiMetrics()
    assert {value(m, "specloop:request_success_total", finished_reason=r) for r in FINISHED_REASONS} == {0}
    m.prompt_tokens(12)
    m.prompt_tokens(30)
    m.generated(5)
    for reason in ("stop", "stop", "length", "abort", "error"):
        m.finished(reason)
    assert value(m, "specloop:prompt_tokens_total") == 42
    assert value(m, "specloop:generation_tokens_total") == 5
    assert [value(m, "specloop:request_success_total", finished_reason=r) for r in FINISHED_REASONS] == [2, 1, 1, 1]
    with pytest.raises(ValueError):
        m.finished("eos")
    assert value(m, "specloop:request_success_total", finished_reason="eos") is None


# ---------------------------------------------------------------- model_name and cache slots


def fed_exporters(model_name: str):
    """A worker, a learner and an API exporter with every method called once."""
    worker = WorkerMetrics(worker="worker-3", model_name=model_name, slots=4)
    worker.serving("v1")
    worker.blocks("v1", [3, 0], [2, 0])
    worker.chosen_k("v1", 3)
    worker.estimates({"acceptance": [0.6], "speedup": [1.0, 1.3]})
    worker.generated(4)
    worker.load(queued=1, running=2)
    worker.step(0.01, 0.02)
    worker.swap("v1", "v2")
    worker.rollback()
    worker.load_failed()
    worker.registry_reachable(True)
    worker.records(3, 1)
    learner = LearnerMetrics(model_name=model_name)
    learner.update(0.5, 1, 2.0)
    learner.buffer(10, 2)
    learner.published("v2")
    learner.promotion(refused=False)
    learner.canary_rollback()
    learner.skipped_update()
    learner.stale(2)
    api = ApiMetrics(model_name=model_name)
    api.request("/v1/completions", 200)
    for call in (api.ttft, api.itl, api.request_time_per_output_token, api.e2e, api.queue_time):
        call(0.1)
    api.prompt_tokens(7)
    api.generated(4)
    api.finished("stop")
    return worker, learner, api


def test_every_series_of_every_exporter_carries_the_model_name_bound_at_construction():
    for exporter in fed_exporters("qwen-0.5b"):
        s = samples(exporter)
        assert len(s) > 20
        unlabelled = [name for name, labels in s if dict(labels).get("model_name") != "qwen-0.5b"]
        assert not unlabelled, unlabelled


def test_without_a_model_name_no_series_has_a_model_name_label():
    """Prometheus reads a missing label as an empty one: the default exports what it did before."""
    for exporter in fed_exporters(""):
        assert not [name for name, labels in samples(exporter) if "model_name" in dict(labels)]
    worker = fed_exporters("")[0]
    assert value(worker, "specloop:drafter_info", drafter_version="v2") == 1


def test_cache_slot_usage_is_running_over_slots_and_nan_while_the_slot_count_is_unknown():
    m = WorkerMetrics(model_name="m", slots=8)
    m.load(queued=0, running=6)
    assert value(m, "specloop:cache_slot_usage_perc", model_name="m") == 0.75
    assert value(m, "specloop:num_requests_running", model_name="m") == 6
    body, _ = m.render()
    assert b"cache slots" in body  # the help text says what a slot is
    unknown = WorkerMetrics()
    unknown.load(queued=3, running=2)
    assert math.isnan(value(unknown, "specloop:cache_slot_usage_perc"))
    unknown.load(queued=3, running=2, slots=4)  # told later
    assert value(unknown, "specloop:cache_slot_usage_perc") == 0.5
    unknown.load(queued=0, running=1)
    assert value(unknown, "specloop:cache_slot_usage_perc") == 0.25


def test_a_model_name_bound_worker_still_evicts_and_removes_its_versions_series():
    m = WorkerMetrics(model_name="m")
    m.serving("v0000")
    for i in range(MAX_VERSIONS + 3):
        m.block(f"v{i:04d}", 2, 1)
    m.swap("v0000", "v0100")
    versions = {dict(labels)["drafter_version"] for name, labels in samples(m)
                if name == "specloop:spec_decode_num_drafts_total"}
    assert len(versions) == MAX_VERSIONS and "v0001" not in versions
    assert value(m, "specloop:drafter_info", drafter_version="v0000", model_name="m") is None
    assert value(m, "specloop:drafter_info", drafter_version="v0100", model_name="m") == 1


# ---------------------------------------------------------------- HTTP


def test_serve_metrics_binds_a_free_port_and_answers_prometheus_scrapes():
    m = WorkerMetrics()
    m.block("v0001", 4, 3)
    address = serve_metrics(m)
    try:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        reply = httpx.get(f"http://{address}/metrics", timeout=5)
        assert reply.status_code == 200
        assert 'specloop:spec_decode_num_accepted_tokens_total{drafter_version="v0001"} 3.0' in reply.text
        assert httpx.get(f"http://{address}/other", timeout=5).status_code == 404
        other = serve_metrics(LearnerMetrics().registry)  # a bare registry works too
        assert other != address
        assert "specloop:learner_updates_total 0.0" in httpx.get(f"http://{other}/metrics", timeout=5).text
        stop_metrics(other)
    finally:
        stop_metrics(address)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{address}/metrics", timeout=2)


def test_serve_metrics_keeps_the_colons_when_the_scraper_asks_for_openmetrics():
    """Prometheus asks for OpenMetrics first; prometheus_client's OpenMetrics encoder would write the
    samples as specloop_... (client_python #1177), so the text format is served whatever is asked."""
    m = WorkerMetrics()
    m.block("v0001", 2, 2)
    address = serve_metrics(m)
    try:
        accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75," \
                 "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"  # what Prometheus 2.x sends
        reply = httpx.get(f"http://{address}/metrics", headers={"Accept": accept}, timeout=5)
        assert reply.headers["content-type"].startswith("text/plain")
        assert 'specloop:spec_decode_num_drafts_total{drafter_version="v0001"} 1.0' in reply.text
        assert "specloop_" not in reply.text
    finally:
        stop_metrics(address)
