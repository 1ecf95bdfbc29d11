"""Prometheus metrics of every specloop process: the verifier worker, the learner and the HTTP API.

Names follow vLLM's (`vllm:x` is `specloop:x` wherever both mean the same thing), prefixed
`specloop:`. Counters only for what is counted; every rate is taken in PromQL. The statistics of
verified blocks (`specloop.drafter.decode.stats.AcceptanceStats`) are plain Python, kept apart from the exporters
(`WorkerMetrics`, `LearnerMetrics`, `ApiMetrics`), which own a `CollectorRegistry` each (a new one per
instance unless one is passed, so tests and co-hosted components never collide; the three may share
one registry: their names are disjoint).

Every series carries `model_name` (as vLLM's), bound when the exporter is built: callers never pass
it. An exporter built without a model name exports no `model_name` label, which Prometheus reads as
`model_name=""` (an empty label and a missing one are the same series).

Speculative decoding (worker, labelled `drafter_version`; a block drafts k tokens and the
verifier accepts n ∈ [0, k] of them; a k = 0 block drafts nothing and counts no draft):

    specloop:spec_decode_num_drafts_total                       blocks with k > 0
    specloop:spec_decode_num_draft_tokens_total                 Σ k
    specloop:spec_decode_num_accepted_tokens_total              Σ n
    specloop:spec_decode_num_accepted_tokens_per_pos_total{position}   blocks with n > position (0-based)

With a mix of speculators (`--speculators`, drafter/kinds/mix.py) the same three counts by who drafted the
block, labelled `speculator` (adaptive: the served version; static: the frozen base; suffix):

    specloop:spec_decode_speculator_drafts_total{speculator}
    specloop:spec_decode_speculator_draft_tokens_total{speculator}
    specloop:spec_decode_speculator_accepted_tokens_total{speculator}

    # share of drafting blocks each speculator served, and its mean acceptance length
    sum by (speculator) (rate(specloop:spec_decode_speculator_drafts_total[$__rate_interval]))
      / ignoring (speculator) group_left sum (rate(specloop:spec_decode_speculator_drafts_total[$__rate_interval]))
    1 + sum by (speculator) (rate(specloop:spec_decode_speculator_accepted_tokens_total[$__rate_interval]))
      / sum by (speculator) (rate(specloop:spec_decode_speculator_drafts_total[$__rate_interval]))

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
    sum(rate(specloop:step_forward_seconds_sum[$__rate_interval]))
      / sum(rate(specloop:step_seconds_sum[$__rate_interval]))

    # latency quantiles, e.g. TTFT p99
    histogram_quantile(0.99, sum by (le) (rate(specloop:time_to_first_token_seconds_bucket[$__rate_interval])))

Worker (`WorkerMetrics`): the counters above, the histogram `specloop:spec_decode_chosen_k{drafter_version}`
(the controller's k per step, buckets 0..8; drafter/decode/controller.py), the controller's current estimates
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
`specloop:replay_records_dropped_total`, `specloop:replay_records_observed_total` (of the logged, those of steps
left plain), `specloop:prefix_cache_queries_total` /
`specloop:prefix_cache_hits_total` (prompt tokens looked up in the verifier's prefix cache, and served from it:
drafter/decode/prefix_cache.py; also as vLLM's `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total`).

vLLM's own names (worker, `VllmWorkerSeries` in `vllm.py`, labelled `model_name` only: totals over every drafter
version, fed by the same calls as their `specloop:` counterparts), so that a dashboard built for vLLM reads them:

    vllm:spec_decode_num_drafts_total
    vllm:spec_decode_num_draft_tokens_total
    vllm:spec_decode_num_accepted_tokens_total
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
    vllm:num_requests_running
    vllm:num_requests_waiting

    # acceptance rate and mean acceptance length, as a vLLM dashboard asks (dashboards/vllm_spec_decode.json)
    sum(rate(vllm:spec_decode_num_accepted_tokens_total[$__rate_interval]))
      / sum(rate(vllm:spec_decode_num_draft_tokens_total[$__rate_interval]))
    1 + sum(rate(vllm:spec_decode_num_accepted_tokens_total[$__rate_interval]))
      / sum(rate(vllm:spec_decode_num_drafts_total[$__rate_interval]))

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
`specloop:request_success_total{finished_reason}` (stop | length | abort | error),
`specloop:metrics_scrape_errors_total{target}` (an endpoint behind the API left out of its /metrics).

Renamed for vLLM parity (issue 17): the API's `time_per_output_token_seconds` (a per-request mean)
is `request_time_per_output_token_seconds`; its `completion_tokens_total` is
`generation_tokens_total`, so the worker's former `generation_tokens_total` is
`committed_tokens_total` (one name, one meaning: a sum over all targets never counts a token twice).

Each worker and learner process serves its registry with `serve_metrics` on its own port; the API
lists those addresses at `GET /sd/targets` for Prometheus's HTTP service discovery. The API's own
`GET /metrics` carries their series as well (`federate.py`): on each scrape it reads every one of those
endpoints over HTTP within one deadline, labels each worker's samples `worker` (its name), and merges
them with its own into one exposition (each family once); one that does not answer in time is left out
and counted in `specloop:metrics_scrape_errors_total{target}`. `GET /metrics?federate=false` is the
API's own series only, for a Prometheus that scrapes /sd/targets as well (both would count twice).

Modules: `specloop.services.metrics.export` (the `Exporter` base, buckets, `serve_metrics` / `stop_metrics`),
`specloop.services.metrics.worker`, `specloop.services.metrics.learner` and `specloop.services.metrics.api`
(one exporter each), `specloop.services.metrics.vllm` (the worker's vLLM names) and
`specloop.services.metrics.federate` (the API's merged /metrics). Every name is importable from here.
"""
from __future__ import annotations


