"""Load through nginx: streaming chat clients against `specloop serve`, continuous batching vs one
request at a time, the online learner on vs off, speculation on vs off.

Every server is a real `specloop serve` (its own local Ray instance, the verifier worker actor, the
learner actor when on) with a real nginx in front of it, rendered from
deploy/nginx/nginx.conf.template (both upstream entries point at the one API). Clients are httpx
async tasks, each a closed loop: send a streaming chat completion (stream_options.include_usage,
temperature 0, max_tokens 64, prompts of ../shared/prompts/chat_dev.jsonl in turn), read it to the
end, send the next. A configuration runs for a fixed window; at its end the requests still in
flight are cut (the client closes the stream; the worker frees the slot), and their tokens so far
are counted by re-tokenizing the text received.

Servers (learner off unless said):
  batch8   --max-num-seqs 8  (continuous batching; speculation on, and off per request for `-nospec`)
  serial1  --max-num-seqs 1  (one request at a time: the baseline)
  batch16  --max-num-seqs 16 (32 clients only)
  klrl8    --max-num-seqs 8 --learner klrl (phase 2, once serial1 and batch16 are stopped)

Phase 1: batch8, serial1 and batch16 run side by side (idle servers cost ~nothing); the batch8 /
serial1 ratio at 8 clients is also measured in `--rounds` short alternating rounds (median
reported). Phase 2: klrl8 starts beside batch8; batch8 is measured again (`batch8-p2`, the
learner-off reference, while klrl8 has had no traffic and its learner nothing to train on), then
klrl8 (its learner trains on the traffic as it comes, one of the two cores).
Per configuration the worker's Prometheus histograms (specloop:step_forward_seconds,
specloop:step_seconds) and counters are scraped at the start and the end of the window, giving
forward ms/step vs the rest of the step (Python scheduling), server-side tokens/s and τ.

    .venv/bin/python bench/load.py                 # the full run (~9 min)
    .venv/bin/python bench/load.py --seconds 3 --round-seconds 2 --out bench/results/load_smoke.json
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import cycle
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.machine import machine_info  # noqa: E402
from specloop.services.cli.launch import free_port  # noqa: E402

SHARED = ROOT.parent / "shared"
VENV_BIN = Path(sys.executable).parent
SPECLOOP = shutil.which("specloop", path=str(VENV_BIN)) or shutil.which("specloop")
NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/bin")
CLIENT_LEVELS = (1, 8, 32)
# `specloop serve` with the replay buffer forced to the embedded one (the default picks a Redis on
# 127.0.0.1:6379 when one answers, which on this machine is the shared test Redis)
SERVE_EMBEDDED = ("import sys, specloop.services.cli.deployment as s; s.detect_redis = lambda: None; print(\"services from\", s.__file__, file=sys.stderr); "
                  "from specloop.services.cli.main import main; sys.exit(main(sys.argv[1:]))")
SERVE_AUTO = "import sys; from specloop.services.cli.main import main; sys.exit(main(sys.argv[1:]))"


def snapshot(dest: Path, head_files: list[str]) -> dict:
    """Copy the working tree (tracked and untracked, not ignored) to `dest`, so that edits made to the
    checkout while the benchmark runs do not reach its servers; `head_files` are taken from git HEAD
    instead. What was copied is recorded: HEAD, `git status --short`, a hash of the copied tree."""
    import hashlib

    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    digest = hashlib.sha256()
    for name in sorted(n for n in names if n):
        src = ROOT / name
        if not src.is_file() or name.startswith("bench/results/"):
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name in head_files:
            target.write_bytes(subprocess.run(["git", "show", f"HEAD:{name}"], cwd=ROOT, capture_output=True,
                                              check=True).stdout)
        else:
            shutil.copy2(src, target)
        if name.endswith(".py"):
            digest.update(name.encode() + b"\0" + target.read_bytes())
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"head": git("rev-parse", "HEAD"), "status": git("status", "--short").splitlines(),
            "files_from_head": head_files, "python_tree_sha256": digest.hexdigest()}


def _load_render():
    spec = importlib.util.spec_from_file_location("deploy_render", ROOT / "deploy" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ processes


@dataclass
class Server:
    """`specloop serve` + nginx in front of it."""

    name: str
    slots: int
    learner: str
    folder: Path
    args: argparse.Namespace
    code: Path  # the snapshot the servers import from
    api: str = ""
    url: str = ""  # nginx
    procs: list = field(default_factory=list)  # (name, Popen), stopped in reverse order
    model: str = ""
    worker_targets: list = field(default_factory=list)
    learner_targets: list = field(default_factory=list)
    start_s: float = 0.0

    def _spawn(self, tag: str, cmd: list[str], env: dict) -> subprocess.Popen:
        log = open(self.folder / f"{tag}.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, cwd=self.code)
        self.procs.append((tag, proc))
        return proc

    def log(self, tag: str, tail: int = 3000) -> str:
        path = self.folder / f"{tag}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def command(self, port: int) -> list[str]:
        """`specloop serve` (specloop.services.cli.main.main), run from the code snapshot."""
        a = self.args
        flags = ["--threads", str(a.threads), "serve", "--verifier", str(a.verifier), "--drafter", str(a.drafter),
                 "--port", str(port), "--registry", str(self.folder / "registry"), "--learner", self.learner,
                 "--max-num-seqs", str(self.slots)]
        return [sys.executable, "-c", SERVE_AUTO if a.redis == "auto" else SERVE_EMBEDDED, *flags]

    def launch(self) -> None:
        """Start serve (returns at once; `wait_ready` waits)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SPECLOOP_"))}
        env |= {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(self.code)}
        port = free_port()
        self.api = f"http://127.0.0.1:{port}"
        self.start_s = time.monotonic()
        self._spawn("serve", self.command(port), env)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = dict(self.procs)["serve"]
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name}: serve exited with {proc.returncode}:\n{self.log('serve')}")
            try:
                if httpx.get(f"{self.api}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: not ready after {timeout} s:\n{self.log('serve')}")
            time.sleep(0.25)
        self.start_s = time.monotonic() - self.start_s
        self.model = httpx.get(f"{self.api}/v1/models", timeout=5).json()["data"][0]["id"]
        self._start_nginx()
        targets = [t for group in httpx.get(f"{self.url}/sd/targets", timeout=5).json() for t in group["targets"]]
        for t in targets:
            text = httpx.get(f"http://{t}/metrics", timeout=5).text
            (self.worker_targets if "specloop:step_seconds" in text else self.learner_targets).append(t)
        if not self.worker_targets:
            raise RuntimeError(f"{self.name}: no worker among /sd/targets {targets}")

    def _start_nginx(self) -> None:
        folder = self.folder / "nginx"
        folder.mkdir(exist_ok=True)
        port = free_port()
        upstream = self.api.removeprefix("http://")
        conf = folder / "nginx.conf"
        conf.write_text(_load_render().render_nginx({"LISTEN": f"127.0.0.1:{port}", "API_1": upstream,
                                                     "API_2": upstream, "PID": str(folder / "nginx.pid"),
                                                     "TEMP": str(folder)}))
        self._spawn("nginx", [NGINX, "-p", str(folder), "-e", "stderr", "-c", str(conf), "-g", "daemon off;"],
                    dict(os.environ))
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or dict(self.procs)["nginx"].poll() is not None:
                raise RuntimeError(f"{self.name}: nginx did not answer:\n{self.log('nginx')}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGINT to serve (it stops its actors and Ray), SIGTERM to nginx; SIGKILL the group after 40 s."""
        for tag, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT if tag == "serve" else signal.SIGTERM)
                try:
                    proc.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(timeout=10)

    def nginx_statuses(self) -> dict:
        """Upstream statuses in nginx's access log: every try, retried ones too."""
        counts: dict[str, int] = {}
        for line in self.log("nginx", tail=10**9).splitlines():
            if "upstream_status=" not in line or "/v1/chat/completions" not in line:
                continue
            for s in line.split("upstream_status=", 1)[1].split(" time=")[0].replace(":", ",").split(","):
                s = s.strip()
                counts[s] = counts.get(s, 0) + 1
        return counts


# -------------------------------------------------------------------------------------------- metrics


def scrape(targets: list[str]) -> dict[str, float]:
    """Sum of each sample (by name, labels dropped) over the targets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for t in targets:
        text = httpx.get(f"http://{t}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_bucket") or s.name.endswith("_created"):
                    continue
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def worker_figures(before: dict, after: dict, seconds: float) -> dict:
    steps = delta(before, after, "specloop:step_seconds_count")
    total = delta(before, after, "specloop:step_seconds_sum")
    fwd = delta(before, after, "specloop:step_forward_seconds_sum")
    drafts = delta(before, after, "specloop:spec_decode_num_drafts_total")
    drafted = delta(before, after, "specloop:spec_decode_num_draft_tokens_total")
    accepted = delta(before, after, "specloop:spec_decode_num_accepted_tokens_total")
    gen = delta(before, after, "specloop:committed_tokens_total")
    return {"steps": int(steps), "steps_per_s": steps / seconds,
            "step_ms": 1e3 * total / steps if steps else None,
            "forward_ms_per_step": 1e3 * fwd / steps if steps else None,
            "python_ms_per_step": 1e3 * (total - fwd) / steps if steps else None,
            "forward_share": fwd / total if total else None,
            "busy_share": total / seconds,  # wall time of the window spent inside steps
            # the serving loop's time between steps: admission (prefill), chunk delivery, idle
            "outside_steps_ms_per_step": 1e3 * (seconds - total) / steps if steps else None,
            "tokens_per_s": gen / seconds, "tokens_per_step": gen / steps if steps else None,
            "alpha": accepted / drafted if drafted else None, "tau": 1 + accepted / drafts if drafts else None}


def learner_figures(before: dict, after: dict) -> dict:
    names = ("learner_updates_total", "learner_versions_published_total", "promotions_total",
             "promotion_refusals_total")
    return {n: delta(before, after, "specloop:" + n) for n in names}


# -------------------------------------------------------------------------------------------- clients


@dataclass
class Req:
    sent: float
    first: float | None = None
    end: float | None = None
    text: list = field(default_factory=list)
    status: int | None = None
    error: str | None = None
    usage: dict | None = None


def load_prompts(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


async def one_request(client: httpx.AsyncClient, url: str, body: dict, rec: Req) -> None:
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            rec.error = (await resp.aread()).decode(errors="replace")[:300]
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                rec.error = json.dumps(obj["error"])[:300]
                continue
            if obj.get("usage"):
                rec.usage = obj["usage"]
            for ch in obj.get("choices") or ():
                content = (ch.get("delta") or {}).get("content")
                if content:
                    if rec.first is None:
                        rec.first = time.perf_counter()
                    rec.text.append(content)
                if ch.get("finish_reason") is not None:
                    rec.end = time.perf_counter()


async def drive(url: str, model: str, clients: int, seconds: float, prompts: list, start_index: int,
                speculative: bool, max_tokens: int, on_start=None) -> tuple[list[Req], float]:
    """`clients` closed-loop clients for `seconds`; the in-flight requests are cut at the end."""
    order = cycle(range(len(prompts)))
    for _ in range(start_index % len(prompts)):
        next(order)
    records: list[Req] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def loop() -> None:
            while time.perf_counter() < deadline:
                body = {"model": model, "messages": prompts[next(order)], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                if not speculative:
                    body["speculative"] = {"enabled": False}
                rec = Req(time.perf_counter())
                records.append(rec)
                try:
                    await one_request(client, url, body, rec)
                except httpx.HTTPError as exc:
                    rec.error = f"{type(exc).__name__}: {exc}"[:300]

        if on_start:
            on_start()
        tasks = [asyncio.create_task(loop()) for _ in range(clients)]
        await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
        elapsed = time.perf_counter() - t0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records, elapsed


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def client_figures(records: list[Req], seconds: float, count_tokens) -> dict:
    done = [r for r in records if r.end is not None and r.usage is not None and r.error is None]
    finished = {id(r) for r in done}
    cut = [r for r in records if id(r) not in finished and r.error is None and r.status in (200, None)]
    errors = [r for r in records if r.error is not None or (r.status is not None and r.status != 200)]
    done_tokens = sum(r.usage["completion_tokens"] for r in done)
    cut_tokens = sum(count_tokens("".join(r.text)) for r in cut if r.text)
    drafted = sum(r.usage.get("drafted_tokens", 0) for r in done)
    tau_num = sum(r.usage["completion_tokens"] - 1 for r in done if r.usage["completion_tokens"] > 0)
    accepted = sum(r.usage.get("accepted_tokens", 0) for r in done)
    ttft = [1e3 * (r.first - r.sent) for r in records if r.first is not None]
    tpot = [1e3 * (r.end - r.first) / (r.usage["completion_tokens"] - 1)
            for r in done if r.first is not None and r.usage["completion_tokens"] > 1]
    statuses: dict[str, int] = {}
    for r in records:
        key = str(r.status) if r.status is not None else "none"
        statuses[key] = statuses.get(key, 0) + 1
    return {"window_s": seconds, "requests_sent": len(records), "requests_completed": len(done),
            "requests_cut_at_end": len(cut), "cut_before_first_token": sum(r.first is None for r in cut),
            "non_200": sum(1 for r in records if r.status is not None and r.status != 200),
            "status_5xx": sum(1 for r in records if r.status is not None and r.status >= 500),
            "errors": len(errors), "error_samples": [r.error for r in errors[:3]], "statuses": statuses,
            "tokens_completed": done_tokens, "tokens_cut_estimated": cut_tokens,
            "tokens_per_s": (done_tokens + cut_tokens) / seconds,
            "completed_tokens_per_s": done_tokens / seconds,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "alpha": accepted / drafted if drafted else None,
            # τ from usage: tokens per verifier pass; a request's first token comes from its prefill,
            # every later block commits its accepted drafts + 1, so blocks = completion − 1 − accepted
            "tau": (tau_num / (tau_num - accepted)) if drafted and tau_num > accepted else None}


# -------------------------------------------------------------------------------------------- the run


class Bench:
    def __init__(self, args):
        self.args = args
        self.prompts = load_prompts(args.prompts)
        self.next_prompt = 0
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(args.verifier))
        self.count_tokens = lambda text: len(tok.encode(text, add_special_tokens=False))
        self.results: list[dict] = []

    def wait_idle(self, server: Server, timeout: float = 15.0) -> float:
        """Until the worker stops stepping (the cut requests are released); the seconds it took. (The
        load gauges are only set by a step, so an idle worker's last value stays: count steps instead.)"""
        t0 = time.monotonic()
        last = scrape(server.worker_targets).get("specloop:step_seconds_count", 0.0)
        while time.monotonic() - t0 < timeout:
            time.sleep(0.3)
            now = scrape(server.worker_targets).get("specloop:step_seconds_count", 0.0)
            if now == last:
                return time.monotonic() - t0
            last = now
        print(f"  warning: {server.name} still stepping after {timeout} s", file=sys.stderr)
        return time.monotonic() - t0

    def measure(self, server: Server, clients: int, seconds: float, speculative: bool = True,
                label: str | None = None, keep: bool = True) -> dict:
        drain_s = self.wait_idle(server)
        state: dict = {}

        def on_start():
            state["before"] = scrape(server.worker_targets + server.learner_targets)
            state["load1"] = os.getloadavg()[0]

        records, elapsed = asyncio.run(drive(server.url, server.model, clients, seconds, self.prompts,
                                             self.next_prompt, speculative, self.args.max_tokens, on_start))
        after = scrape(server.worker_targets + server.learner_targets)
        self.next_prompt += len(records)
        name = label or (server.name if speculative else f"{server.name}-nospec")
        row = {"config": name, "server": server.name, "slots": server.slots, "learner": server.learner,
               "speculative": speculative, "clients": clients,
               **client_figures(records, elapsed, self.count_tokens),
               "worker": worker_figures(state["before"], after, elapsed),
               "loadavg_1m_at_start": state["load1"], "idle_wait_before_s": drain_s}
        if server.learner_targets:
            row["learner_counters"] = learner_figures(state["before"], after)
        w = row["worker"]
        print(f"  {name:>16} clients {clients:>2}: {row['tokens_per_s']:7.1f} tok/s (worker {w['tokens_per_s']:7.1f}), "
              f"TTFT p50/p99 {_f(row['ttft_ms_p50'])}/{_f(row['ttft_ms_p99'])} ms, TPOT p50 {_f(row['tpot_ms_p50'])} ms, "
              f"done {row['requests_completed']}, non-200 {row['non_200']}, errors {row['errors']}, "
              f"α {_f(row['alpha'], 3)} τ {_f(w['tau'], 2)}, step {_f(w['step_ms'], 2)} ms "
              f"(fwd {_f(w['forward_ms_per_step'], 2)})", flush=True)
        if keep:
            self.results.append(row)
        return row

    def warm(self, server: Server) -> None:
        asyncio.run(drive(server.url, server.model, 4, self.args.warmup_seconds, self.prompts, 10_000,
                          True, 16))
        self.wait_idle(server)


def _f(x, digits: int = 0) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def start(servers: list[Server]) -> None:
    for s in servers:
        s.launch()
    for s in servers:
        s.wait_ready()
        print(f"  {s.name}: serve ready in {s.start_s:.1f} s, nginx {s.url} -> {s.api}, "
              f"worker metrics {s.worker_targets}, learner {s.learner_targets}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="window per configuration")
    p.add_argument("--rounds", type=int, default=5, help="alternating batch8 / serial1 rounds at 8 clients")
    p.add_argument("--round-seconds", type=float, default=10.0)
    p.add_argument("--warmup-seconds", type=float, default=3.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="specloop --threads (the worker gets half)")
    p.add_argument("--verifier", type=Path, default=SHARED / "models" / "verifier")
    p.add_argument("--drafter", type=Path, default=SHARED / "models" / "drafter")
    p.add_argument("--prompts", type=Path, default=SHARED / "prompts" / "chat_dev.jsonl")
    p.add_argument("--redis", choices=("embedded", "auto"), default="embedded",
                   help="replay buffer of the learner: embedded, or serve's own detection (a local Redis if one answers)")
    p.add_argument("--head-files", nargs="*", default=[],
                   help="files the servers take from git HEAD instead of the working tree (an edit in progress)")
    p.add_argument("--no-slots16", action="store_true", help="skip the --max-num-seqs 16 server")
    p.add_argument("--phases", type=lambda v: {int(x) for x in v.split(",")}, default={1, 2},
                   help="1: batching, one-at-a-time, speculation off, rounds; 2: learner klrl vs off (default 1,2)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load.json")
    p.add_argument("--replot", type=Path, help="only redraw the plot and table of an existing results JSON")
    args = p.parse_args(argv)
    if args.replot:
        out = json.loads(args.replot.read_text())
        plot(out, args.replot.with_suffix(".png"))
        print_table(out)
        return 0
    if SPECLOOP is None or NGINX is None:
        print("load.py: needs the specloop command and nginx", file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks stop the servers
    t_start = time.monotonic()
    bench = Bench(args)
    folder = Path(tempfile.mkdtemp(prefix="slload-", dir="/tmp"))
    servers: list[Server] = []
    ok = False
    rounds: list[dict] = []
    code = snapshot(folder / "code", args.head_files)
    starts: dict[str, float] = {}
    phase2_info: dict = {}
    nginx_status: dict[str, dict] = {}
    try:
        def make(name: str, slots: int, learner: str) -> Server:
            (folder / name).mkdir()
            s = Server(name, slots, learner, folder / name, args, folder / "code")
            servers.append(s)
            return s

        batch8 = make("batch8", 8, "off")
        if 1 in args.phases:
            # phase 1: batch8, serial1 (and batch16) side by side
            serial1 = make("serial1", 1, "off")
            phase1 = [batch8, serial1] + ([] if args.no_slots16 else [make("batch16", 16, "off")])
            print("phase 1: starting " + ", ".join(s.name for s in phase1), flush=True)
            start(phase1)
            for s in phase1:
                starts[s.name] = s.start_s
                bench.warm(s)
            for clients in CLIENT_LEVELS:
                bench.measure(batch8, clients, args.seconds)
                bench.measure(serial1, clients, args.seconds)
                bench.measure(batch8, clients, args.seconds, speculative=False)
                if clients == 32 and not args.no_slots16:
                    bench.measure(phase1[2], clients, args.seconds)
            print(f"phase 1: {args.rounds} alternating rounds at 8 clients, {args.round_seconds} s each", flush=True)
            for i in range(args.rounds):
                pair = (batch8, serial1) if i % 2 == 0 else (serial1, batch8)
                r = {s.name: bench.measure(s, 8, args.round_seconds, label=f"round{i}-{s.name}", keep=False)
                     for s in pair}
                rounds.append({"round": i, "order": [s.name for s in pair],
                               "batch8_tokens_per_s": r["batch8"]["tokens_per_s"],
                               "serial1_tokens_per_s": r["serial1"]["tokens_per_s"],
                               "batch8_worker_tokens_per_s": r["batch8"]["worker"]["tokens_per_s"],
                               "serial1_worker_tokens_per_s": r["serial1"]["worker"]["tokens_per_s"],
                               "non_200": r["batch8"]["non_200"] + r["serial1"]["non_200"],
                               "errors": r["batch8"]["errors"] + r["serial1"]["errors"],
                               "ratio": r["batch8"]["tokens_per_s"] / r["serial1"]["tokens_per_s"]})
                print(f"  round {i}: ratio {rounds[-1]['ratio']:.2f}", flush=True)
            for s in phase1[1:]:
                s.stop()
                nginx_status[s.name] = s.nginx_statuses()

        if 2 in args.phases:
            # phase 2: the learner on (klrl8) against learner off (batch8, measured again now, while
            # klrl8 is up but has seen no traffic, so its learner has nothing to train on)
            klrl = make("klrl8", 8, "klrl")
            batch8_running = bool(batch8.api)
            fresh = [klrl] if batch8_running else [batch8, klrl]
            print("phase 2: starting " + ", ".join(s.name for s in fresh), flush=True)
            start(fresh)
            for s in fresh:
                starts[s.name] = s.start_s
            if not batch8_running:
                bench.warm(batch8)
            before = scrape(klrl.learner_targets)
            for clients in CLIENT_LEVELS:
                bench.measure(batch8, clients, args.seconds, label="batch8-p2")
            idle_check = learner_figures(before, scrape(klrl.learner_targets))
            print(f"  klrl8's learner while batch8-p2 ran: {idle_check}", flush=True)
            phase2_info["klrl8_learner_during_batch8_p2"] = idle_check
            bench.warm(klrl)
            for clients in CLIENT_LEVELS:
                bench.measure(klrl, clients, args.seconds)
            klrl.stop()
            nginx_status[klrl.name] = klrl.nginx_statuses()
        batch8.stop()
        nginx_status[batch8.name] = batch8.nginx_statuses()
        ok = True
    finally:
        for s in servers:
            try:
                s.stop()
            except Exception as exc:  # noqa: BLE001 - stop the others
                print(f"stopping {s.name}: {exc}", file=sys.stderr)
        if ok:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"logs kept in {folder}", file=sys.stderr)

    summary = summarize(bench.results, rounds)
    out = {"machine_info": machine_info(), "loadavg_end": os.getloadavg(),
           "config": {k: str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set) else v
                      for k, v in vars(args).items()} | {
               "command": "python bench/load.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "client_levels": CLIENT_LEVELS, "temperature": 0, "k": 4, "stream": True,
               "nginx": subprocess.run([NGINX, "-v"], capture_output=True, text=True).stderr.strip(),
               "server_start_s": starts, "wall_s": time.monotonic() - t_start, "code": code},
           "results": bench.results, "rounds": rounds, "summary": summary, "phase2": phase2_info, "nginx_upstream_statuses": nginx_status}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    plot(out, args.out.with_suffix(".png"))
    print_table(out)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {time.monotonic() - t_start:.0f} s")
    return 0


def summarize(results: list[dict], rounds: list[dict]) -> dict:
    by = {(r["config"], r["clients"]): r for r in results}

    def ratio(a: str, b: str, clients: int) -> float | None:
        ra, rb = by.get((a, clients)), by.get((b, clients))
        return ra["tokens_per_s"] / rb["tokens_per_s"] if ra and rb and rb["tokens_per_s"] else None

    ratios = [r["ratio"] for r in rounds]
    return {
        "batch8_vs_serial1_8clients_median_of_rounds": statistics.median(ratios) if ratios else None,
        "batch8_vs_serial1_rounds": ratios,
        "batch8_vs_serial1": {c: ratio("batch8", "serial1", c) for c in CLIENT_LEVELS},
        "spec_on_vs_off_batch8": {c: ratio("batch8", "batch8-nospec", c) for c in CLIENT_LEVELS},
        "learner_klrl_vs_off_batch8": {c: ratio("klrl8", "batch8-p2" if ("batch8-p2", c) in by else "batch8", c)
                                       for c in CLIENT_LEVELS},
        "batch16_vs_batch8_32clients": ratio("batch16", "batch8", 32),
        "non_200_total": sum(r["non_200"] for r in results) + sum(r["non_200"] for r in rounds),
        "errors_total": sum(r["errors"] for r in results) + sum(r["errors"] for r in rounds),
    }


def print_table(out: dict) -> None:
    print("\n| config | slots | learner | spec | clients | tokens/s | worker tokens/s | TTFT p50 / p99 (ms) | "
          "TPOT p50 / p99 (ms) | α | τ (usage / worker) | done | cut | non-200 | step ms | forward ms | Python in step ms "
          "| between steps ms | load1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["results"]:
        w = r["worker"]
        print(f"| {r['config']} | {r['slots']} | {r['learner']} | {'on' if r['speculative'] else 'off'} | {r['clients']} "
              f"| {r['tokens_per_s']:.0f} | {w['tokens_per_s']:.0f} | {_f(r['ttft_ms_p50'])} / {_f(r['ttft_ms_p99'])} "
              f"| {_f(r['tpot_ms_p50'], 1)} / {_f(r['tpot_ms_p99'], 1)} | {_f(r['alpha'], 3)} "
              f"| {_f(r['tau'], 2)} / {_f(w['tau'], 2)} | {r['requests_completed']} | {r['requests_cut_at_end']} "
              f"| {r['non_200']} | {_f(w['step_ms'], 2)} | {_f(w['forward_ms_per_step'], 2)} "
              f"| {_f(w['python_ms_per_step'], 2)} | {_f(w['outside_steps_ms_per_step'], 2)} | {r['loadavg_1m_at_start']:.2f} |")
    print("\nrounds (8 clients, batch8 / serial1 tokens/s):",
          ", ".join(f"{r['batch8_tokens_per_s']:.0f}/{r['serial1_tokens_per_s']:.0f} = {r['ratio']:.2f}"
                    for r in out["rounds"]))
    print("summary:", json.dumps(out["summary"]))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = out["results"]
    configs = list(dict.fromkeys(r["config"] for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for name in configs:
        rows = sorted((r for r in results if r["config"] == name), key=lambda r: r["clients"])
        xs = [r["clients"] for r in rows]
        line, = axes[0].plot(xs, [r["tokens_per_s"] for r in rows], "o-", label=name)
        axes[1].plot(xs, [r["ttft_ms_p50"] for r in rows], "o-", color=line.get_color(), label=f"{name} p50")
        axes[1].plot(xs, [r["ttft_ms_p99"] for r in rows], "s--", color=line.get_color(), alpha=0.6,
                     label=f"{name} p99")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(CLIENT_LEVELS, [str(c) for c in CLIENT_LEVELS])
        ax.set_xlabel("concurrent streaming clients")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("output tokens/s (through nginx)")
    axes[0].set_title("throughput")
    axes[0].legend(fontsize=8)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("TTFT (ms, client side)")
    axes[1].set_title("time to first token p50 / p99")
    axes[1].legend(fontsize=6, ncol=2)
    # step split at 8 clients (and 32)
    labels, fwd, py, out_ = [], [], [], []
    for r in results:
        if r["clients"] in (8, 32) and r["worker"]["steps"]:
            labels.append(f"{r['config']}\n{r['clients']} cl.")
            fwd.append(r["worker"]["forward_ms_per_step"])
            py.append(r["worker"]["python_ms_per_step"])
            out_.append(r["worker"]["outside_steps_ms_per_step"])
    x = np.arange(len(labels))
    axes[2].bar(x, fwd, label="in step: forward passes (draft + verify)")
    axes[2].bar(x, py, bottom=fwd, label="in step: Python bookkeeping")
    axes[2].bar(x, out_, bottom=np.add(fwd, py), label="between steps: admission/prefill, delivery, idle")
    axes[2].set_xticks(x, labels, fontsize=6, rotation=45, ha="right")
    axes[2].set_ylabel("ms per worker step")
    axes[2].set_title("where a step's time goes")
    axes[2].legend(fontsize=8)
    ratio = out["summary"]["batch8_vs_serial1_8clients_median_of_rounds"]
    fig.suptitle(f"specloop serve through nginx, {out['machine_info']['cpu']}; batch8 / serial1 at 8 clients "
                 f"(median of rounds): {_f(ratio, 2)}×", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
