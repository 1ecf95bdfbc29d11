"""The dashboard's acceptance panel over a drift replay: a real Prometheus scraping a real `specloop serve`.

Starts `specloop --threads 2 serve` (API, one verifier worker, the klrl learner, a fresh registry) and
a throwaway Prometheus (tests/prometheus_helpers.py: scrape every 1 s, the worker and the learner
discovered through the API's /sd/targets), sends drift traffic through the OpenAI API — chat prompts
of ../shared/prompts/chat_dev.jsonl (/v1/chat/completions), then code prompts of code_dev.jsonl
(/v1/completions; code the drafter never saw) — from a few concurrent clients at temperature 0, then
evaluates the Grafana panel "Acceptance rate α by drafter version" (its exact PromQL from
dashboards/specloop.json, `$__rate_interval` filled in), the τ panel and the swap / rollback
annotation queries through /api/v1/query_range over the run.

    .venv/bin/python bench/dashboard_drift.py --chat 80 --code 240 --clients 3

Writes bench/results/dashboard_drift.json (the raw series, per-request usage, figures, machine) and
bench/results/dashboard_drift.png (α per drafter_version against time, the chat → code switch,
swaps and rollbacks).
"""
from __future__ import annotations

import argparse
import json
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import machine_info  # noqa: E402

from specloop.services.cli.launch import ServeProcess  # noqa: E402
from tests.prometheus_helpers import PROMETHEUS, ThrowawayPrometheus  # noqa: E402

SHARED = ROOT.parent / "shared"
OUT = ROOT / "bench" / "results"
DASHBOARD = ROOT / "dashboards" / "specloop.json"
ACCEPTANCE_TITLE = "Acceptance rate α by drafter version"
TAU_TITLE = "Mean acceptance length τ by drafter version"
WINDOW = 50  # requests in the "start of code" / "end of code" client-side figures
FROZEN = OUT / "drift_pretrained_t0.json"  # bench/drift.py: the same prompts, k = 4, T = 0, learner off


# ----------------------------------------------------------------------------- the dashboard's queries


def dashboard_queries(rate_interval: str) -> dict:
    """The acceptance and τ panels' PromQL and the annotations', exactly as the dashboard holds them."""
    board = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in board["panels"] if p.get("type") != "row"}
    fill = lambda expr: (expr.replace("$__rate_interval", rate_interval)  # noqa: E731 - every model and instance
                         .replace("$model_name", ".*").replace("$instance", ".*"))
    [acceptance] = panels[ACCEPTANCE_TITLE]["targets"]
    [tau] = panels[TAU_TITLE]["targets"]
    return {"acceptance": fill(acceptance["expr"]), "tau": fill(tau["expr"]),
            "annotations": {a["name"]: fill(a["expr"]) for a in board["annotations"]["list"]}}


# ----------------------------------------------------------------------------- serve


def make_serve(work: Path, args) -> ServeProcess:
    """`specloop --threads N serve` with its own registry, logging to work/serve.log; SIGINT stops it."""
    flags = ["--verifier", args.verifier, "--drafter", args.drafter, "--learner", args.learner]
    return ServeProcess(flags, threads=args.threads, registry=work / "registry", log=work / "serve.log", cwd=work)


# ----------------------------------------------------------------------------- traffic


def load_prompts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def request_body(serve: ServeProcess, prompt: dict, max_tokens: int) -> tuple[str, dict]:
    """(endpoint, body): chat messages → /v1/chat/completions, a plain prompt → /v1/completions."""
    common = {"model": serve.model, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
    if "messages" in prompt:
        return "/v1/chat/completions", {**common, "messages": prompt["messages"]}
    return "/v1/completions", {**common, "prompt": prompt["prompt"]}


def run_phase(serve: ServeProcess, phase: str, prompts: list[dict], n: int, clients: int, max_tokens: int) -> list[dict]:
    """n successful requests from `prompts` (in order) sent by `clients` concurrent clients. A prompt the
    API refuses with a 400 (too long for the context) is skipped and recorded; the next one is taken."""
    todo: queue.Queue = queue.Queue()
    for p in prompts:
        todo.put(p)
    rows, lock, done = [], threading.Lock(), threading.Event()
    ok = [0]

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while not done.is_set():
                try:
                    prompt = todo.get_nowait()
                except queue.Empty:
                    return
                endpoint, body = request_body(serve, prompt, max_tokens)
                t0 = time.time()
                try:
                    reply = http.post(serve.url + endpoint, json=body)
                    status, data = reply.status_code, reply.json()
                except (httpx.HTTPError, ValueError) as exc:
                    status, data = -1, {"error": repr(exc)}
                t1 = time.time()
                row = {"phase": phase, "id": prompt["id"], "endpoint": endpoint, "status": status, "start": t0,
                       "end": t1}
                if status == 200:
                    u = data["usage"]
                    row |= {k: u.get(k) for k in ("prompt_tokens", "completion_tokens", "drafted_tokens",
                                                   "accepted_tokens", "drafter_version")}
                else:
                    row["error"] = str(data.get("error", data))[:300]
                with lock:
                    if status == 200:
                        if ok[0] >= n:
                            return
                        ok[0] += 1
                        if ok[0] >= n:
                            done.set()
                    rows.append(row)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows.sort(key=lambda r: r["start"])
    if ok[0] < n:
        print(f"{phase}: only {ok[0]} of {n} requests succeeded (prompts exhausted)", file=sys.stderr)
    return rows


# ----------------------------------------------------------------------------- Prometheus queries


def query_range(prom: ThrowawayPrometheus, expr: str, start: float, end: float, step: float) -> list[dict]:
    data = prom.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
    return [{"metric": r["metric"], "values": [[float(t), float(v)] for t, v in r["values"]]} for r in data["result"]]


def ratio_over(prom: ThrowawayPrometheus, num: str, den: str, a: float, b: float) -> float | None:
    """sum(increase(num[b - a])) / sum(increase(den[b - a])) at time b, over every drafter version."""
    seconds = max(int(round(b - a)), 2)
    expr = f"sum(increase({num}[{seconds}s])) / sum(increase({den}[{seconds}s]))"
    result = prom.api("query", query=expr, time=f"{b:.3f}")["result"]
    return float(result[0]["value"][1]) if result else None


def counter_steps(prom: ThrowawayPrometheus, metric: str, start: float, end: float) -> list[float]:
    """Times (1 s resolution) at which a counter's sum grew, once per increment."""
    series = query_range(prom, f"sum({metric})", start, end, 1)
    times = []
    for s in series:
        values = s["values"]
        for (_, v0), (t1, v1) in zip(values, values[1:]):
            times += [t1] * max(int(round(v1 - v0)), 0)
    return times


def serving_versions(prom: ThrowawayPrometheus, start: float, end: float) -> list[dict]:
    """Which drafter_version served when (drafter_info at 1 s), as [{version, from, to}] in order."""
    series = query_range(prom, "max by (drafter_version) (specloop:drafter_info)", start, end, 1)
    spans = [{"version": s["metric"]["drafter_version"], "from": s["values"][0][0], "to": s["values"][-1][0]}
             for s in series if s["values"]]
    return sorted(spans, key=lambda s: s["from"])


# ----------------------------------------------------------------------------- figures


def alpha(rows: list[dict]) -> float | None:
    drafted = sum(r["drafted_tokens"] or 0 for r in rows)
    return sum(r["accepted_tokens"] or 0 for r in rows) / drafted if drafted else None


def frozen_reference(chat: list[dict], code: list[dict], chat_prompts: list[dict], code_prompts: list[dict],
                     path: Path = FROZEN) -> dict | None:
    """α of the frozen reference drafter (bench/drift.py's `--learner off` run: greedy, k = 4, 64 tokens, same
    prompt files in the same order) over the very prompts of each window here — code prompts differ in how
    predictable they are, so "start vs end of code" needs this control. None when that run is absent."""
    if not path.is_file():
        return None
    ref = json.loads(path.read_text())
    if ref.get("k") != 4 or ref.get("max_tokens") != 64:
        return None
    frozen = next((r for r in ref["runs"] if r["learner"] == "off" and r["temperature"] == 0.0
                   and r["kind"] == "pretrained"), None)
    if frozen is None:
        return None
    n_chat = ref["segments"][0]
    by_index = {r["index"]: r for r in frozen["requests"]}
    position = {p["id"]: ("chat", i) for i, p in enumerate(chat_prompts[:n_chat])}
    position |= {p["id"]: ("code", i) for i, p in enumerate(code_prompts[:ref["segments"][1]])}

    def of(rows: list[dict]) -> float | None:
        picked = []
        for r in rows:
            where = position.get(r["id"])
            if where is None or where[0] != r["phase"]:
                return None  # a prompt the reference run did not serve
            picked.append(by_index[where[1] if where[0] == "chat" else n_chat + where[1]])
        drafted = sum(r["drafted"] for r in picked)
        return sum(r["accepted"] for r in picked) / drafted if drafted else None

    ok_chat = [r for r in chat if r["status"] == 200]
    ok_code = [r for r in code if r["status"] == 200]
    return {"source": str(path.relative_to(ROOT)), "chat_alpha": of(ok_chat),
            f"code_first{WINDOW}_alpha": of(ok_code[:WINDOW]), f"code_last{WINDOW}_alpha": of(ok_code[-WINDOW:]),
            "code_alpha": of(ok_code)}


def figures(prom: ThrowawayPrometheus, chat: list[dict], code: list[dict], boundary: float, end: float,
            window_s: float) -> dict:
    ok_chat = [r for r in chat if r["status"] == 200]
    ok_code = [r for r in code if r["status"] == 200]
    first, last = ok_code[:WINDOW], ok_code[-WINDOW:]
    num = "specloop:spec_decode_num_accepted_tokens_total"
    den = "specloop:spec_decode_num_draft_tokens_total"
    chat_start = min(r["start"] for r in ok_chat)
    return {
        "client": {  # from the API's usage (drafted_tokens, accepted_tokens) of each response
            "chat_alpha": alpha(ok_chat), f"code_first{WINDOW}_alpha": alpha(first),
            f"code_last{WINDOW}_alpha": alpha(last), "code_alpha": alpha(ok_code),
            "chat_requests": len(ok_chat), "code_requests": len(ok_code),
            "refused": sum(r["status"] != 200 for r in chat + code),
            "versions_in_usage": sorted({v for r in ok_chat + ok_code for v in (r["drafter_version"] or "").split(",")
                                         if v}),
        },
        "prometheus": {  # sum(increase(accepted)) / sum(increase(drafted)) over every version, per window
            "chat_alpha": ratio_over(prom, num, den, chat_start, boundary),
            f"code_first{int(window_s)}s_alpha": ratio_over(prom, num, den, boundary, boundary + window_s),
            f"code_last{int(window_s)}s_alpha": ratio_over(prom, num, den, end - window_s, end),
        },
        "chat_seconds": boundary - chat_start,
        "code_seconds": end - boundary,
        "chat_tokens_per_s": sum(r["completion_tokens"] for r in ok_chat) / (boundary - chat_start),
        "code_tokens_per_s": sum(r["completion_tokens"] for r in ok_code) / (end - boundary),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["times"]["chat_start"]
    series = sorted(result["series"]["acceptance"], key=lambda s: s["metric"].get("drafter_version", ""))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True, height_ratios=[3, 1.4])
    cmap = plt.get_cmap("viridis")
    for i, s in enumerate(series):
        xs = [t - t0 for t, _ in s["values"]]
        ys = [v for _, v in s["values"]]
        label = s["metric"].get("drafter_version", "?")
        ax.plot(xs, ys, lw=1.3, color=cmap(i / max(len(series) - 1, 1)), label=label)
    overall = result["series"]["overall_acceptance"]
    if overall:
        ax.plot([t - t0 for t, _ in overall[0]["values"]], [v for _, v in overall[0]["values"]], color="black",
                lw=0.8, ls=":", label="all versions (not a panel query)")
    ax.axhline(0.55, color="red", ls="--", lw=0.8)
    for a in (ax, ax2):
        a.axvline(result["times"]["boundary"] - t0, color="black", lw=1.2)
        for t in result["swaps"]:
            a.axvline(t - t0, color="tab:blue", lw=0.4, alpha=0.35)
        for t in result["rollbacks"]:
            a.axvline(t - t0, color="tab:red", lw=0.8, alpha=0.7)
    ax.plot([t - t0 for t in result["swaps"]], [0.99] * len(result["swaps"]), "v", color="tab:blue", ms=5,
            label=f"swaps ({len(result['swaps'])})")
    if result["rollbacks"]:
        ax.plot([t - t0 for t in result["rollbacks"]], [0.95] * len(result["rollbacks"]), "v", color="tab:red",
                ms=6, label=f"rollbacks ({len(result['rollbacks'])})")
    ax.text(result["times"]["boundary"] - t0, 0.02, "  chat → code", fontsize=9)
    client, frozen = result["figures"]["client"], result["figures"].get("frozen_reference") or {}
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["α from the responses' usage (online | frozen drafter, same prompts)"]
    for key, name in (("chat_alpha", "chat"), (f"code_first{WINDOW}_alpha", f"first {WINDOW} code"),
                      (f"code_last{WINDOW}_alpha", f"last {WINDOW} code")):
        lines.append(f"{name}: {fmt(client.get(key))} | {fmt(frozen.get(key))}")
    ax.text(0.99, 0.80, "\n".join(lines), transform=ax.transAxes, ha="right", va="top", fontsize=8,
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "0.7"})
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("acceptance rate α (accepted / drafted)")
    ax.set_title(f"Panel \"{ACCEPTANCE_TITLE}\" over a drift replay "
                 f"({result['config']['chat']} chat then {result['config']['code']} code requests, "
                 f"rate interval {result['config']['rate_interval']}, {result['config']['step_s']} s steps)",
                 fontsize=10)
    ncol = 1 + len(series) // 14
    ax.legend(fontsize=6.5, ncol=ncol, loc="center left", bbox_to_anchor=(1.01, 0.5), title="drafter_version",
              title_fontsize=7)
    for s in result["series"]["tau"]:
        ax2.plot([t - t0 for t, _ in s["values"]], [v for _, v in s["values"]], lw=1.0,
                 color=cmap(next((i for i, a in enumerate(series) if a["metric"] == s["metric"]), 0)
                            / max(len(series) - 1, 1)))
    ax2.set_ylabel("τ (1 + accepted / blocks)")
    ax2.set_xlabel(f"seconds since the first chat request (CPU: {result['machine']['cpu']})")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", type=Path, default=SHARED / "models" / "verifier")
    ap.add_argument("--drafter", type=Path, default=SHARED / "models" / "drafter")
    ap.add_argument("--learner", default="klrl")
    ap.add_argument("--threads", type=int, default=2, help="specloop --threads (serve gives the worker half)")
    ap.add_argument("--chat", type=int, default=80, help="chat requests (first phase)")
    ap.add_argument("--code", type=int, default=240, help="code requests (second phase)")
    ap.add_argument("--clients", type=int, default=3, help="concurrent clients")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rate-interval", default="15s", help="what $__rate_interval becomes")
    ap.add_argument("--step", type=float, default=2.0, help="query_range step, seconds")
    ap.add_argument("--window", type=float, default=30.0, help="seconds of the start / end of code figures")
    ap.add_argument("--out", type=Path, default=OUT / "dashboard_drift.json")
    ap.add_argument("--png", type=Path, default=OUT / "dashboard_drift.png")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (serve log, TSDB, registry)")
    args = ap.parse_args(argv)
    if PROMETHEUS is None:
        raise SystemExit("the prometheus binary is not installed (apt-get install prometheus)")
    chat_prompts = load_prompts(SHARED / "prompts" / "chat_dev.jsonl")
    code_prompts = load_prompts(SHARED / "prompts" / "code_dev.jsonl")
    queries = dashboard_queries(args.rate_interval)

    work = Path(tempfile.mkdtemp(prefix="specloop-dashboard-drift-"))
    serve, prom = make_serve(work, args), None
    try:
        t_launch = time.time()
        serve.start()
        print(f"serve ready on {serve.url} after {time.time() - t_launch:.0f} s (log {work / 'serve.log'})",
              file=sys.stderr)
        sd = httpx.get(f"{serve.url}/sd/targets", timeout=10).json()
        discovered = [t for group in sd for t in group["targets"]]
        prom = ThrowawayPrometheus(work, [f"127.0.0.1:{serve.port}"], [f"{serve.url}/sd/targets"]).start()
        prom.wait_for_targets(1 + len(discovered), timeout=60)
        time.sleep(3)  # a few scrapes of the idle counters (rate() needs a sample before the traffic)

        chat_start = time.time()
        chat = run_phase(serve, "chat", chat_prompts, args.chat, args.clients, args.max_tokens)
        boundary = time.time()
        print(f"chat phase: {len(chat)} requests in {boundary - chat_start:.0f} s, "
              f"α {alpha([r for r in chat if r['status'] == 200])}", file=sys.stderr)
        code = run_phase(serve, "code", code_prompts, args.code, args.clients, args.max_tokens)
        end = time.time()
        print(f"code phase: {len(code)} requests in {end - boundary:.0f} s", file=sys.stderr)
        time.sleep(3)  # the last scrapes

        q0, q1 = chat_start - 10, end + 10
        series = {"acceptance": query_range(prom, queries["acceptance"], q0, q1, args.step),
                  "tau": query_range(prom, queries["tau"], q0, q1, args.step),
                  "overall_acceptance": query_range(
                      prom, f"sum(rate(specloop:spec_decode_num_accepted_tokens_total[{args.rate_interval}])) / "
                            f"sum(rate(specloop:spec_decode_num_draft_tokens_total[{args.rate_interval}]))",
                      q0, q1, args.step),
                  "annotations": {name: query_range(prom, expr, q0, q1, args.step)
                                  for name, expr in queries["annotations"].items()}}
        swaps = counter_steps(prom, "specloop:drafter_swaps_total", q0, q1)
        rollbacks = counter_steps(prom, "specloop:drafter_rollbacks_total", q0, q1)
        versions = serving_versions(prom, q0, q1)
        published = prom.query("sum(specloop:learner_versions_published_total)")
        promoted = prom.query("sum(specloop:promotions_total)")
        figs = figures(prom, chat, code, boundary, end, args.window)
        figs["frozen_reference"] = frozen_reference(chat, code, chat_prompts, code_prompts)
        figs |= {"versions_in_acceptance_panel": sorted(s["metric"].get("drafter_version", "") for s in
                                                        series["acceptance"]),
                 "versions_served": [v["version"] for v in versions], "swaps": len(swaps),
                 "rollbacks": len(rollbacks),
                 "published": float(published[0]["value"][1]) if published else None,
                 "promoted": float(promoted[0]["value"][1]) if promoted else None}
        result = {
            "config": {"chat": args.chat, "code": args.code, "clients": args.clients, "max_tokens": args.max_tokens,
                       "temperature": 0.0, "k": 4, "learner": args.learner, "threads": args.threads,
                       "rate_interval": args.rate_interval, "step_s": args.step, "window_s": args.window,
                       "serve_cmd": serve.cmd, "scrape_interval_s": 1, "redis": serve.redis_url},
            "queries": queries,
            "times": {"chat_start": chat_start, "boundary": boundary, "end": end, "query_start": q0,
                      "query_end": q1},
            "figures": figs, "swaps": swaps, "rollbacks": rollbacks, "serving_versions": versions,
            "series": series, "requests": chat + code, "machine": machine_info(),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
        plot(result, args.png)
        print(json.dumps(figs, indent=1))
        print(f"wrote {args.out} and {args.png}", file=sys.stderr)
    finally:
        if prom is not None:
            prom.stop()
        code = serve.stop()
        print(f"serve stopped (rc {code}); Redis keys deleted: {serve.forget_redis_keys()}", file=sys.stderr)
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
