"""A real cluster on this machine, no mocks: a Ray head and a second Ray node (`ray start`),
`specloop serve` with two verifier workers (one on each node), two `specloop api` replicas and
nginx (deploy/nginx/nginx.conf.template) in front of them, over the tiny model pair.

Everything runs on 127.0.0.1 ports picked free, from a temp dir of its own; teardown stops the
processes this file started (SIGTERM to `ray start --block` stops that node's Ray processes) and
never runs a global `ray stop`, which would end every Ray instance on the machine.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.deploy_helpers import render
from tests.redis_helpers import free_port

VENV_BIN = Path(sys.executable).parent
RAY = shutil.which("ray", path=str(VENV_BIN)) or shutil.which("ray")
SPECLOOP = shutil.which("specloop", path=str(VENV_BIN)) or shutil.which("specloop")
NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")

pytestmark = pytest.mark.skipif(RAY is None or SPECLOOP is None, reason="the ray / specloop commands are not installed")
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/system-deps.sh)")

PROMPTS = ["def add(a, b):", "Hello, my name is", "import os\nimport sys\n", "The quick brown fox",
           "for i in range(10):", "Once upon a time"]
MAX_TOKENS = 24
STARTUP_S = 60  # a process that is not up by then fails the test, with its log
SERVE_STARTUP_S = 150  # two Ray worker processes import torch and load models: slow on 2 busy cores


# ----------------------------------------------------------------------------- processes


@dataclass
class Processes:
    """The processes a test started, each logging to its own file; stopped in reverse order."""

    folder: Path
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def log(self, name: str, tail: int | None = 4000) -> str:
        """What `name` printed (the last `tail` characters; None: all)."""
        path = self.folder / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text if tail is None else text[-tail:]

    def ray_errors(self, lines: int = 15) -> str:
        """The end of every Ray worker's stderr that holds a traceback (an actor that failed)."""
        out = []
        for err in sorted(self.folder.glob("*/session_latest/logs/worker-*.err")):
            text = err.read_text(errors="replace")
            if "Traceback" in text:
                out.append(f"--- {err}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(out)

    def check_alive(self, name: str) -> None:
        proc = dict(self.procs)[name]
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode} (logs in {self.folder}):\n{self.log(name)}\n{self.ray_errors()}")

    @staticmethod
    def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            self.stop(proc)
        # Ray's worker processes outlive a raylet for a moment; kill what is left of this run
        # alone: processes whose command line names this run's unique folder.
        for p in psutil.process_iter(["cmdline"]):
            if any(str(self.folder) in part for part in (p.info["cmdline"] or [])):
                try:
                    p.kill()
                except psutil.Error:
                    pass


def wait_http(url: str, procs: Processes, name: str, timeout: float = STARTUP_S) -> None:
    """Wait until GET url answers 200 (the process `name` must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check_alive(name)
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{url} did not answer 200 within {timeout} s (logs in {procs.folder}); {name}:\n{procs.log(name)}\n"
                f"{procs.ray_errors()}")


def wait_log(procs: Processes, name: str, text: str, timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    while text not in procs.log(name):
        procs.check_alive(name)
        if time.monotonic() > deadline:
            pytest.fail(f"{name} did not log {text!r} within {timeout} s:\n{procs.log(name)}")
        time.sleep(0.2)


# ----------------------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    procs: Processes
    env: dict[str, str]
    ray_address: str
    api: str  # base URL of `specloop serve`'s own API

    def start_api(self, name: str) -> str:
        """One more `specloop api` replica attached to the cluster's workers; its base URL once ready."""
        port = free_port()
        self.procs.start(name, [SPECLOOP, "--threads", "1", "api", "--ray-address", self.ray_address,
                                "--host", "127.0.0.1", "--port", str(port)], self.env)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready", self.procs, name)
        return url

    def start_nginx(self, name: str, upstreams: list[str]) -> str:
        """nginx from deploy/nginx/nginx.conf.template in front of `upstreams` (host:port)."""
        folder = self.procs.folder / name
        folder.mkdir()
        self.procs.folder.chmod(0o711)  # nginx's workers (user nobody) write request bodies under it
        port = free_port()
        conf = folder / "nginx.conf"
        conf.write_text(render.render_nginx({"LISTEN": f"127.0.0.1:{port}", "API_1": upstreams[0],
                                             "API_2": upstreams[1], "PID": str(folder / "nginx.pid"),
                                             "TEMP": str(folder)}))
        self.procs.start(name, [NGINX, "-p", str(folder), "-e", "stderr", "-c", str(conf),
                                "-g", "daemon off;"], self.env)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", self.procs, name)
        return url


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    """Ray head (2 CPUs) + a second node (1 CPU), and `specloop serve` with two workers, one on each
    node: every worker asks for one unit of the custom resource `specloop_worker` (serve's
    --worker-resource), and each node offers exactly one. Learner off: no buffer, no Redis."""
    verifier, drafter = tiny_pair
    # short: Ray's unix socket paths must fit in 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="slc-", dir="/tmp"))
    procs = Processes(folder)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SPECLOOP_"))}
    # a token of its own: Ray turns token auth on by itself when ~/.ray/auth_token exists (another
    # local ray.init() writes it), and a node joining without the token is refused
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "SPECLOOP_ADMIN_TOKEN": "cluster-test-token",
            "OMP_NUM_THREADS": "1"}
    port = free_port()
    address = f"127.0.0.1:{port}"
    # fixed default ports (dashboard 8265, agent 52365) would clash with another Ray on this machine
    one_worker = json.dumps({"specloop_worker": 1})
    node = ["--block", "--dashboard-agent-listen-port", "0", "--disable-usage-stats"]
    try:
        procs.start("ray-head", [RAY, "start", "--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard=false",
                                 "--dashboard-port", "0", "--resources", one_worker, "--temp-dir", str(folder / "head"), *node], env)
        wait_log(procs, "ray-head", "Ray runtime started")
        procs.start("ray-node2", [RAY, "start", "--address", address, "--num-cpus", "1",
                                  "--resources", one_worker, "--temp-dir", str(folder / "node2"), *node], env)
        wait_log(procs, "ray-node2", "Ray runtime started")
        api_port = free_port()
        procs.start("serve", [SPECLOOP, "--threads", "1", "serve", "--ray-address", address,
                              "--host", "127.0.0.1", "--port", str(api_port),
                              "--verifier", str(verifier), "--drafter", str(drafter), "--learner", "off",
                              "--workers", "2", "--worker-resource", "specloop_worker",
                              "--registry", str(folder / "registry")], env)
        api = f"http://127.0.0.1:{api_port}"
        wait_http(f"{api}/ready", procs, "serve", timeout=SERVE_STARTUP_S)
        yield Cluster(procs, env, address, api)
        shutil.rmtree(folder, ignore_errors=True)  # kept when the cluster failed: Ray's logs are in it
    finally:
        procs.stop_all()


# ----------------------------------------------------------------------------- traffic


@dataclass
class Outcome:
    status: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    problem: str | None = None  # what makes the response incomplete, if anything

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.problem is None


def chat_body(model: str, prompt: str, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream, "stream_options": {"include_usage": True} if stream else None}


async def chat(client: httpx.AsyncClient, url: str, model: str, prompt: str, stream: bool) -> Outcome:
    """One chat completion, checked for completeness: a finish reason, and (streamed) every
    event parsed, no in-band error, the usage chunk and `data: [DONE]` last."""
    body = {k: v for k, v in chat_body(model, prompt, stream).items() if v is not None}
    try:
        if not stream:
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code != 200:
                return Outcome(r.status_code, problem=r.text[:300])
            data = r.json()
            choice = data["choices"][0]
            return Outcome(200, choice["message"]["content"], choice["finish_reason"],
                           data["usage"]["completion_tokens"],
                           None if choice["finish_reason"] in ("stop", "length") else "no finish reason")
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(r.status_code, problem=(await r.aread()).decode()[:300])
            events = [line[len("data: "):] async for line in r.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        return Outcome(0, problem=f"{type(exc).__name__}: {exc}")
    if not events or events[-1] != "[DONE]":
        return Outcome(200, problem=f"stream ended without [DONE] after {len(events)} events")
    chunks = [json.loads(e) for e in events[:-1]]
    if errors := [c["error"] for c in chunks if "error" in c]:
        return Outcome(200, problem=f"in-band error {errors[0]}")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    if not finish or not usage:
        return Outcome(200, text, problem="no finish reason or usage chunk")
    return Outcome(200, text, finish[-1], usage[-1]["completion_tokens"])


async def drive(url: str, model: str, prompts: list[str], concurrency: int, stagger_s: float = 0.0) -> list[Outcome]:
    """Every prompt once streamed and once not, at most `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: str, stream: bool) -> Outcome:
        await asyncio.sleep(i * stagger_s)
        async with gate:
            return await chat(client, url, model, prompt, stream)

    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        jobs = [(p, s) for p in prompts for s in (False, True)]
        return await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(jobs)))


def model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def reference_texts(url: str, model: str) -> dict[str, str]:
    """The greedy completion of every prompt, asked directly of serve's own API."""
    outcomes = asyncio.run(drive(url, model, PROMPTS, concurrency=4))
    assert all(o.ok for o in outcomes), [o.problem for o in outcomes if not o.ok]
    texts = {}
    for (prompt, _), outcome in zip([(p, s) for p in PROMPTS for s in (False, True)], outcomes):
        assert texts.setdefault(prompt, outcome.text) == outcome.text, "streamed and whole texts differ"
    return texts


def upstreams_of(access_log: str) -> list[list[str]]:
    """For each completion in nginx's access log, the replicas it was sent to, in order."""
    return [m.group(1).split(", ") for m in re.finditer(r'"POST /v1/chat/completions[^"]*".*upstream=(.*?) upstream_status=',
                                                        access_log)]


# ----------------------------------------------------------------------------- tests


@needs_nginx
def test_no_request_fails_when_an_api_replica_shuts_down_mid_run(cluster):
    """Chat traffic through nginx to two replicas; one replica is stopped (SIGTERM, what docker
    stop and a rolling restart send) while requests stream. Every response is 200 and complete,
    and equal to serve's own answer: requests the stopped replica had not started went to the
    other replica (nginx's proxy_next_upstream), the ones it had started it finished."""
    model = model_id(cluster.api)
    reference = reference_texts(cluster.api, model)
    replicas = [cluster.start_api("api-1"), cluster.start_api("api-2")]
    lb = cluster.start_nginx("nginx", [u.removeprefix("http://") for u in replicas])
    victim = dict(cluster.procs.procs)["api-1"]

    async def traffic_with_a_shutdown() -> tuple[list[Outcome], list[Outcome]]:
        during = asyncio.create_task(drive(lb, model, PROMPTS * 2, concurrency=6, stagger_s=0.1))
        await asyncio.sleep(0.8)  # requests are in flight on both replicas now
        victim.send_signal(signal.SIGTERM)
        first = await during
        await asyncio.to_thread(victim.wait, 30)
        after = await drive(lb, model, PROMPTS, concurrency=4)  # the replica is gone: retries
        return first, after

    during, after = asyncio.run(traffic_with_a_shutdown())
    outcomes = during + after
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{len(failed)} of {len(outcomes)} failed: {[(o.status, o.problem) for o in failed][:5]}"
    jobs = [p for p in PROMPTS * 2 for _ in (0, 1)] + [p for p in PROMPTS for _ in (0, 1)]
    assert [o.text for o in outcomes] == [reference[p] for p in jobs]
    assert all(o.completion_tokens and o.completion_tokens <= MAX_TOKENS for o in outcomes)

    routes = upstreams_of(cluster.procs.log("nginx", tail=None))
    api_1 = replicas[0].removeprefix("http://")
    assert any(route == [api_1] for route in routes), "api-1 served nothing before it stopped"
    assert any(len(route) == 2 and route[0] == api_1 for route in routes), \
        "no request was retried on the other replica after api-1 stopped"

    for size in (9 * 2**20, 17 * 2**20):  # over the API's limit (it answers), over nginx's (nginx answers)
        r = httpx.post(f"{lb}/v1/completions", content=b"x" * size, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]


@needs_nginx
def test_only_requests_in_flight_on_a_sigkilled_api_replica_fail(cluster):
    """An API replica is SIGKILLed (no drain) while traffic flows through nginx: at most the requests
    it was answering fail, and every request sent after it died is served by the other replica."""
    model = model_id(cluster.api)
    replicas = [cluster.start_api("api-3"), cluster.start_api("api-4")]
    lb = cluster.start_nginx("nginx-kill", [u.removeprefix("http://") for u in replicas])
    victim = dict(cluster.procs.procs)["api-3"]

    async def traffic_with_a_kill() -> tuple[list[Outcome], list[Outcome]]:
        during = asyncio.create_task(drive(lb, model, PROMPTS * 2, concurrency=6, stagger_s=0.1))
        await asyncio.sleep(0.8)
        victim.kill()
        first = await during
        await asyncio.to_thread(victim.wait, 30)
        return first, await drive(lb, model, PROMPTS, concurrency=4)

    during, after = asyncio.run(traffic_with_a_kill())
    failed = [o for o in during if not o.ok]
    print(f"SIGKILL: {len(failed)} of {len(during)} requests failed; {len(after)} sent after it died all served")
    assert len(failed) <= 6, f"{len(failed)} failed, more than the 6 in flight: {[o.problem for o in failed][:3]}"
    assert all(o.ok for o in after), [o.problem for o in after if not o.ok]


def worker_tokens(api: str) -> dict[str, float]:
    """Tokens each verifier worker generated so far, by worker name, read from the workers' own
    metric endpoints as Prometheus finds them (the API's /sd/targets)."""
    tokens = {}
    for group in httpx.get(f"{api}/sd/targets", timeout=10).json():
        for target in group["targets"]:
            text = httpx.get(f"http://{target}/metrics", timeout=10).text
            if worker := re.search(r'specloop:worker_info\{[^}]*worker="([^"]+)"', text):
                counted = re.findall(r"^specloop:committed_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)
                tokens[worker.group(1)] = sum(float(v) for v in counted)
    return tokens


def ray_node_of(port: int, folder: Path) -> str:
    """The Ray node (`ray start --temp-dir` under `folder`) whose raylet started the process
    listening on `port`."""
    pid = next(c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
    for parent in psutil.Process(pid).parents():
        if m := re.search(rf"--temp_dir={re.escape(str(folder))}/(\w+)", " ".join(parent.cmdline())):
            return m.group(1)
    raise AssertionError(f"the process on port {port} is not under a raylet of this cluster")


def test_both_workers_serve_when_one_runs_on_a_second_ray_node(cluster):
    """Concurrent requests spread over the two verifier workers (least-loaded routing), which run
    on different Ray nodes: each worker's own metrics count tokens of this traffic."""
    targets = [t for g in httpx.get(f"{cluster.api}/sd/targets", timeout=10).json() for t in g["targets"]]
    assert len(targets) == 2, f"expected the two workers' metric endpoints in /sd/targets, got {targets}"
    assert sorted(ray_node_of(int(t.rsplit(":", 1)[1]), cluster.procs.folder) for t in targets) == ["head", "node2"]

    before = worker_tokens(cluster.api)
    model = model_id(cluster.api)
    outcomes = asyncio.run(drive(cluster.api, model, PROMPTS * 2, concurrency=8))
    assert all(o.ok for o in outcomes), [o.problem for o in outcomes if not o.ok]
    after = worker_tokens(cluster.api)

    served = {w: after[w] - before.get(w, 0.0) for w in after}
    assert len(served) == 2 and all(n > 0 for n in served.values()), f"a worker generated nothing: {served}"
    assert sum(served.values()) >= sum(o.completion_tokens for o in outcomes)


def serving_actor_pids(cluster) -> list[int]:
    """The processes of this cluster's ServingActors (their environment carries its Ray token)."""
    token = f"RAY_AUTH_TOKEN={cluster.env['RAY_AUTH_TOKEN']}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"ray::ServingActor" in (proc / "cmdline").read_bytes() \
                    and token in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_a_worker_killed_mid_stream_ends_its_streams_in_band_and_ray_brings_it_back(cluster):
    """Both workers' processes are SIGKILLed while streams run: every open stream ends within 5 s
    with an in-band error and `data: [DONE]` (no hang), and Ray restarts the workers, which serve
    again. (Last in this file: the workers it kills are the module's.)"""
    model = model_id(cluster.api)

    async def stream_until_killed() -> tuple[list[list[str]], float]:
        async def one(client: httpx.AsyncClient, prompt: str, first: asyncio.Event) -> list[str]:
            # no end-of-sequence: every stream runs its 400 tokens, so the kill always finds them open
            body = chat_body(model, prompt, True) | {"max_tokens": 400, "ignore_eos": True}
            async with client.stream("POST", f"{cluster.api}/v1/chat/completions", json=body) as r:
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first.set()
                return events

        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            started = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(one(client, p, e)) for p, e in zip(PROMPTS, started)]
            await asyncio.gather(*(e.wait() for e in started))
            victims = serving_actor_pids(cluster)
            assert len(victims) == 2, victims
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - killed

    results, ended_after = asyncio.run(stream_until_killed())
    assert ended_after < 5.0, f"streams took {ended_after:.1f} s to end after the workers died"
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        finished = any('"finish_reason": "' in e or '"finish_reason":"' in e for e in events[:-1])
        assert finished or any('"error"' in e and "worker" in e for e in events[:-1]), events[-3:]
    assert any(any('"error"' in e for e in events) for events in results), "no stream was cut by the kill"

    deadline = time.monotonic() + SERVE_STARTUP_S  # Ray restarts both workers (each reloads its models)
    while time.monotonic() < deadline:
        outcomes = asyncio.run(drive(cluster.api, model, PROMPTS[:2], concurrency=2))
        if all(o.ok for o in outcomes):
            break
        time.sleep(1.0)
    assert all(o.ok for o in outcomes), [o.problem for o in outcomes if not o.ok]


def test_the_workers_outlive_a_sigkilled_serve_and_the_next_serve_adopts_them(cluster, tiny_pair):
    """`serve` is no single point of failure: SIGKILLed, its (detached) workers go on serving an API
    replica; a new `serve` on the cluster waits out the dead one's lease and adopts the workers
    instead of refusing or starting more. Last in this file: it replaces the fixture's serve."""
    replica = cluster.start_api("api-survivor")
    model = model_id(replica)
    serve = dict(cluster.procs.procs)["serve"]
    os.killpg(serve.pid, signal.SIGKILL)
    serve.wait(timeout=10)
    outcomes = asyncio.run(drive(replica, model, PROMPTS[:3], concurrency=2))
    assert all(o.ok for o in outcomes), [o.problem for o in outcomes if not o.ok]
    port = free_port()
    verifier, drafter = tiny_pair
    cluster.procs.start("serve-2", [SPECLOOP, "--threads", "1", "serve", "--ray-address", cluster.ray_address,
                                    "--host", "127.0.0.1", "--port", str(port), "--verifier", str(verifier),
                                    "--drafter", str(drafter), "--learner", "off", "--workers", "2",
                                    "--worker-resource", "specloop_worker",
                                    "--registry", str(cluster.procs.folder / "registry")], cluster.env)
    wait_http(f"http://127.0.0.1:{port}/ready", cluster.procs, "serve-2", timeout=SERVE_STARTUP_S)
    assert "adopted 2 worker(s)" in cluster.procs.log("serve-2", tail=None)
    outcomes = asyncio.run(drive(f"http://127.0.0.1:{port}", model, PROMPTS[:3], concurrency=2))
    assert all(o.ok for o in outcomes), [o.problem for o in outcomes if not o.ok]
    loads = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
    assert loads["workers"] == 2  # the same two, not two more
