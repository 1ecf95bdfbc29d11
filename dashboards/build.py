"""Build the specloop Grafana dashboard (grafana-foundation-sdk) into dashboards/specloop.json.

    python dashboards/build.py            # rewrite dashboards/specloop.json
    python dashboards/build.py --check    # exit 1 when the committed JSON is not a fresh build

Every panel reads the `specloop:` metrics of services/metrics.py (whose docstring has the same
PromQL); rates use `$__rate_interval`, the datasource is the `${datasource}` variable, and every
selector filters on the `model_name` and `instance` variables (as vLLM's dashboards filter on
`model_name`; "All" matches any value, an absent label included). Swaps and rollbacks of the
serving drafter are annotations. tests/test_dashboards.py evaluates every
query against a real Prometheus scraping a real `specloop serve`.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash_m

OUT = Path(__file__).resolve().parent / "specloop.json"
DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
RI = "$__rate_interval"
HEALTHY_ACCEPTANCE = 0.55  # the survey's rule of thumb for a healthy drafter (per drafted token)


VARIABLES = ("model_name", "instance")  # template variables every selector filters on
FILTER = ", ".join(f'{v}=~"${v}"' for v in VARIABLES)
ANY = ".*"  # the variables' "All" value: matches an absent label too


def sel(metric: str) -> str:
    """The metric's selector, filtered by the dashboard's variables."""
    return f"{metric}{{{FILTER}}}"


def rate(metric: str, by: str = "") -> str:
    """sum [by (labels)] (rate(metric{filter}[$__rate_interval]))."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({sel(metric)}[{RI}]))"


def increase(metric: str) -> str:
    return f"sum(increase({sel(metric)}[{RI}]))"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({sel(histogram + '_bucket')}[{RI}])))"


def quantiles(histogram: str) -> list[tuple[str, str]]:
    """p50 and p99 of a histogram."""
    return [(quantile(0.5, histogram), "p50"), (quantile(0.99, histogram), "p99")]


SPEC = "specloop:spec_decode_num_"
ACCEPTED = rate(SPEC + "accepted_tokens_total", "drafter_version")
ACCEPTANCE_RATE = f"{ACCEPTED}\n  / {rate(SPEC + 'draft_tokens_total', 'drafter_version')}"
ACCEPTANCE_ALL = f"{rate(SPEC + 'accepted_tokens_total')}\n  / {rate(SPEC + 'draft_tokens_total')}"
MEAN_ACCEPTANCE_LENGTH = f"1 + {ACCEPTED}\n  / {rate(SPEC + 'drafts_total', 'drafter_version')}"
PER_POSITION = (f"{rate(SPEC + 'accepted_tokens_per_pos_total', 'drafter_version, position')}\n"
                f"  / on (drafter_version) group_left\n  {rate(SPEC + 'drafts_total', 'drafter_version')}")
SPECULATOR = "specloop:spec_decode_speculator_"
SPECULATOR_SHARE = (f"{rate(SPECULATOR + 'drafts_total', 'speculator')}\n"
                    f"  / ignoring (speculator) group_left\n  {rate(SPECULATOR + 'drafts_total')}")
SPECULATOR_TAU = (f"1 + {rate(SPECULATOR + 'accepted_tokens_total', 'speculator')}\n"
                  f"  / {rate(SPECULATOR + 'drafts_total', 'speculator')}")
STEP_FORWARD = f"{rate('specloop:step_forward_seconds_sum')}\n  / {rate('specloop:step_seconds_count')}"
STEP_PYTHON = (f"({rate('specloop:step_seconds_sum')} - {rate('specloop:step_forward_seconds_sum')})\n"
               f"  / {rate('specloop:step_seconds_count')}")


# ----------------------------------------------------------------------------- panel specs


@dataclass
class Panel:
    """One panel: its queries as (PromQL, legend) pairs, drawn as a time series unless `stat`."""

    title: str
    description: str
    queries: list[tuple[str, str]]
    unit: str = "short"
    width: int = 8
    stat: bool = False
    min: float | None = None
    max: float | None = None
    threshold: float | None = None  # a dashed red line (time series)
    stacked: bool = False


ROWS: list[tuple[str, list[Panel]]] = [
    ("Speculative decoding", [
        Panel("Acceptance rate α by drafter version",
              "Accepted / drafted tokens. A healthy drafter accepts ≥ 0.55 per token (dashed line). "
              "'all versions' reads through hot swaps, when each version's line lives only seconds.",
              [(ACCEPTANCE_RATE, "{{drafter_version}}"), (ACCEPTANCE_ALL, "all versions")], unit="percentunit",
              min=0, max=1,
              threshold=HEALTHY_ACCEPTANCE),
        Panel("Mean acceptance length τ by drafter version",
              "1 + accepted / drafts: tokens per verifier pass. Near 1.0 while traffic flows is the silent "
              "failure (drafter weights lost or never synced).",
              [(MEAN_ACCEPTANCE_LENGTH, "{{drafter_version}}")], min=1, threshold=1.1),
        Panel("Per-position acceptance by drafter version",
              "P(draft position i accepted), 0-based: the early-warning signal.",
              [(PER_POSITION, "{{drafter_version}} pos {{position}}")], unit="percentunit", min=0, max=1),
        Panel("Drafting blocks by speculator",
              "With --speculators: the share of drafting blocks each speculator served (adaptive: the served "
              "version; static: the frozen base; suffix: suffix decoding).",
              [(SPECULATOR_SHARE, "{{speculator}}")], unit="percentunit", min=0, max=1, width=12),
        Panel("Mean acceptance length τ by speculator",
              "1 + accepted / drafts of the blocks each speculator drafted.",
              [(SPECULATOR_TAU, "{{speculator}}")], min=1, width=12),
    ]),
    ("Traffic", [
        Panel("Tokens / s", "Generated for clients and prompt tokens admitted (API), and committed by the workers.",
              [(rate("specloop:generation_tokens_total"), "generated (API)"),
               (rate("specloop:prompt_tokens_total"), "prompt (API)"),
               (rate("specloop:committed_tokens_total"), "committed (workers)")], unit="short"),
        Panel("Time to first token", "p50 and p99 over the API replicas.",
              quantiles("specloop:time_to_first_token_seconds"), unit="s"),
        Panel("Inter-token latency", "Gap between two streamed chunks carrying tokens: p50 and p99 over the API "
              "replicas (one speculative block may bring several tokens at once).",
              quantiles("specloop:inter_token_latency_seconds"), unit="s"),
        Panel("Request time per output token", "Each request's mean time per output token after the first: p50 "
              "and p99 over the API replicas.",
              quantiles("specloop:request_time_per_output_token_seconds"), unit="s"),
        Panel("Queue depth", "Requests waiting for a cache slot and holding one, over all workers.",
              [(f"sum({sel('specloop:num_requests_waiting')})", "waiting"),
               (f"sum({sel('specloop:num_requests_running')})", "running")], min=0),
        Panel("Cache slot usage", "Share of each worker's cache slots held by running requests (vLLM's KV cache "
              "usage: specloop's cache holds one slot per running request).",
              [(f"max by (instance) ({sel('specloop:cache_slot_usage_perc')})", "{{instance}}")],
              unit="percentunit", min=0, max=1),
        Panel("Queue time", "Time a request waited for a cache slot: p50 and p99 over the API replicas.",
              quantiles("specloop:request_queue_time_seconds"), unit="s"),
        Panel("Requests / s by endpoint and status", "HTTP answers of the API replicas.",
              [(rate("specloop:http_requests_total", "endpoint, status"), "{{endpoint}} {{status}}")], unit="reqps"),
        Panel("Finished requests / s by reason", "stop (stop token or string), length (max_tokens or the context), "
              "abort (the client left), error.",
              [(rate("specloop:request_success_total", "finished_reason"), "{{finished_reason}}")], unit="reqps"),
        Panel("End-to-end latency", "p50 and p99 over the API replicas.",
              quantiles("specloop:e2e_request_latency_seconds"), unit="s"),
    ]),
    ("Worker", [
        Panel("Step time split", "Mean time per engine step in forward passes (drafter + verifier) and in "
              "Python scheduling around them.",
              [(STEP_FORWARD, "forward passes"), (STEP_PYTHON, "scheduling (Python)")], unit="s", stacked=True,
              width=6),
        Panel("Replay records / s", "Records handed to the replay buffer, and dropped (buffer down or queue full).",
              [(rate("specloop:replay_records_logged_total"), "logged"),
               (rate("specloop:replay_records_dropped_total"), "dropped")], min=0, width=6),
        Panel("Drafter swaps and rollbacks", "Versions swapped in while serving, and automatic rollbacks.",
              [(increase("specloop:drafter_swaps_total"), "swaps"),
               (increase("specloop:drafter_rollbacks_total"), "rollbacks")], min=0, width=6),
        Panel("Serving drafter version", "The version each worker drafts with.",
              [(f"max by (drafter_version) ({sel('specloop:drafter_info')})", "{{drafter_version}}")], stat=True,
              width=6),
    ]),
    ("Learner", [
        Panel("Learner loss", "Loss of the newest update.", [(f"max({sel('specloop:learner_loss')})", "loss")]),
        Panel("Learner lag", "Versions between the newest record trained on and the newest promoted version.",
              [(f"max({sel('specloop:learner_lag_versions')})", "lag (versions)")], min=0),
        Panel("Record age at update", "Age of the newest record (buffer append to training).",
              quantiles("specloop:learner_record_age_seconds"), unit="s"),
        Panel("Learner updates / s", "Optimizer steps, and records used for distillation only (stale version).",
              [(rate("specloop:learner_updates_total"), "updates"),
               (rate("specloop:learner_stale_records_total"), "stale records")], min=0),
        Panel("Replay buffer", "Entries held, and delivered but not acknowledged.",
              [(f"max({sel('specloop:buffer_depth')})", "depth"),
               (f"max({sel('specloop:buffer_pending')})", "pending")], min=0),
        Panel("Publishing gate", "Versions published, promoted and refused by the gate.",
              [(increase("specloop:learner_versions_published_total"), "published"),
               (increase("specloop:promotions_total"), "promoted"),
               (increase("specloop:promotion_refusals_total"), "refused")], min=0),
    ]),
]

ANNOTATIONS: list[tuple[str, str, str]] = [  # (name, PromQL, colour)
    ("Drafter swaps", f"{increase('specloop:drafter_swaps_total')} > 0", "blue"),
    ("Drafter rollbacks", f"{increase('specloop:drafter_rollbacks_total')} > 0", "red"),
]


# ----------------------------------------------------------------------------- builders


def query(expr: str, legend: str, ref: str) -> prom_b.Dataquery:
    return prom_b.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range().datasource(DATASOURCE)


def thresholds(value: float | None) -> dash_b.ThresholdsConfig:
    steps = [dash_m.Threshold(value=None, color="green")]
    if value is not None:
        steps.append(dash_m.Threshold(value=value, color="red"))
    return dash_b.ThresholdsConfig().mode(dash_m.ThresholdsMode.ABSOLUTE).steps(steps)


def timeseries(p: Panel) -> ts_b.Panel:
    panel = (ts_b.Panel().title(p.title).description(p.description).unit(p.unit).span(p.width).height(8)
             .datasource(DATASOURCE).line_width(1).fill_opacity(10).show_points(common.VisibilityMode.NEVER)
             .legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True))
             .thresholds(thresholds(p.threshold)))
    if p.threshold is not None:
        dashed = common_b.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.DASHED)
        panel = panel.thresholds_style(dashed)
    if p.stacked:
        panel = panel.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    return bounded(panel, p)


def stat(p: Panel) -> stat_b.Panel:
    panel = (stat_b.Panel().title(p.title).description(p.description).unit(p.unit).span(p.width).height(8)
             .datasource(DATASOURCE).text_mode(common.BigValueTextMode.NAME)
             .color_mode(common.BigValueColorMode.NONE).graph_mode(common.BigValueGraphMode.NONE)
             .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    return bounded(panel, p)


def bounded(panel, p: Panel):
    """Axis bounds and the panel's queries (refs A, B, ...)."""
    if p.min is not None:
        panel = panel.min(p.min)
    if p.max is not None:
        panel = panel.max(p.max)
    for i, (expr, legend) in enumerate(p.queries):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + i)))
    return panel


def variable(name: str, label: str, selector: str) -> dash_b.QueryVariable:
    """A multi-value query variable over the values of label `name` in the series of `selector`,
    "All" matching any value (an absent label too); refreshed when the time range changes."""
    return (dash_b.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query(f"label_values({selector}, {name})")
            .current(dash_m.VariableOption(text="All", value="$__all", selected=True))
            .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dash_m.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(ANY))


SPECLOOP_SERIES = '{__name__=~"specloop:.+"}'
VARIABLE_QUERIES = {  # name -> (label, selector of label_values): instances of the chosen models
    "model_name": ("Model", SPECLOOP_SERIES),
    "instance": ("Instance", '{__name__=~"specloop:.+", model_name=~"$model_name"}'),
}


def annotation(name: str, expr: str, colour: str) -> dash_b.AnnotationQuery:
    return dash_b.AnnotationQuery().name(name).datasource(DATASOURCE).expr(expr).icon_color(colour).enable(True)


def build() -> dict:
    """The dashboard as a JSON-able dict."""
    board = (dash_b.Dashboard("specloop").uid("specloop")
             .description("Speculative decoding with an online-learning drafter: acceptance by drafter version, "
                          "traffic and latency, worker internals, the learner.")
             .tags(["specloop", "speculative-decoding"]).editable().time("now-1h", "now").refresh("10s")
             .timezone("browser").tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
             .with_variable(dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus")))
    for name, (label, selector) in VARIABLE_QUERIES.items():
        board = board.with_variable(variable(name, label, selector))
    for name, expr, colour in ANNOTATIONS:
        board = board.annotation(annotation(name, expr, colour))
    ids = iter(range(1, 1000))
    for title, panels in ROWS:
        board = board.with_row(dash_b.Row(title).id(next(ids)))
        for p in panels:
            board = board.with_panel((stat(p) if p.stat else timeseries(p)).id(next(ids)))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        fresh = OUT.is_file() and OUT.read_text() == text
        print(f"{OUT}: {'up to date' if fresh else 'stale: run python dashboards/build.py'}")
        return 0 if fresh else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
