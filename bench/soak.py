"""Soak: streaming clients through nginx to `specloop serve --learner klrl` (Redis buffer and registry)
for a long while, then a sweep of client counts with speculation on and off.

Reports: HTTP statuses (the target: no 5xx), per-process RSS over time (slope per minute, and the
growth from minute 2 of the soak to its end: the target is flat within 5%), Redis memory,
p50 / p99 time to first token and inter-token latency at each client count with speculation on and
off, and the controller's mean chosen k (the share of plain steps), read from the worker's metrics,
which shows the load at which it turns speculation off.

    .venv/bin/python bench/soak.py [--soak-minutes 10] [--clients 1 8 32 64] [--phase-s 45]

Writes bench/results/soak.json and soak.png.
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis as redis_py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_info  # noqa: E402
from bench.redis_pause import Serve, chat_prompts, deployment_arguments  # noqa: E402
from tests.redis_helpers import free_port  # noqa: E402

WARM_UP_S = 120.0  # RSS growth is measured from this far into the soak (the learner's pools fill first)


def start_nginx(folder: Path, upstream: str) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(ROOT / "deploy"))
    import render

    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o777)
    port = free_port()
    conf = folder / "nginx.conf"
    conf.write_text(render.render_nginx({"LISTEN": f"127.0.0.1:{port}", "API_1": upstream, "API_2": upstream,
                                         "PID": str(folder / "nginx.pid"), "TEMP": str(folder)}))
    proc = subprocess.Popen(["nginx", "-p", str(folder), "-e", "stderr", "-c", str(conf), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=open(folder / "nginx.err", "w"))
    return proc, f"http://127.0.0.1:{port}"


def tree_rss(pid: int) -> dict[str, int]:
    """RSS in bytes of `pid` and its descendants, by 'pid:name'."""
    out = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            name = Path(f"/proc/{p}/comm").read_text().strip()
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        rss = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS")), 0)
        out[f"{p}:{name}"] = rss
        todo.extend(int(c) for c in children)
    return out


async def client(http: httpx.AsyncClient, url: str, model: str, prompts: list[str], spec: bool, until: float,
                 max_tokens: int, out: dict, rng: random.Random) -> None:
    while time.monotonic() < until:
        body = {"model": model, "messages": [{"role": "user", "content": rng.choice(prompts)}],
                "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "stream": True,
                "speculative": {"enabled": spec}}
        t0 = time.monotonic()
        last = None
        try:
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
                out["status"][str(r.status_code)] = out["status"].get(str(r.status_code), 0) + 1
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.monotonic()
                    if last is None:
                        out["ttft"].append(now - t0)
                    else:
                        out["itl"].append(now - last)
                    last = now
                    if '"error"' in line:
                        out["errors"].append(line[:160])
        except httpx.HTTPError as exc:
            out["errors"].append(repr(exc)[:160])


def quantiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"n": len(v), "p50": pick(0.5), "p99": pick(0.99), "max": v[-1]}


def chosen_k(api: str) -> tuple[float, float, float]:
    """(sum, count, plain) of the workers' chosen-k histogram: mean k and the share of plain steps."""
    total = count = plain = 0.0
    for group in httpx.get(f"{api}/sd/targets", timeout=10).json():
        for target in group["targets"]:
            for line in httpx.get(f"http://{target}/metrics", timeout=10).text.splitlines():
                if line.startswith("specloop:spec_decode_chosen_k_sum"):
                    total += float(line.split()[-1])
                elif line.startswith("specloop:spec_decode_chosen_k_count"):
                    count += float(line.split()[-1])
                elif line.startswith("specloop:spec_decode_chosen_k_bucket") and 'le="0.0"' in line:
                    plain += float(line.split()[-1])
    return total, count, plain


async def phase(url: str, api: str, model: str, prompts: list[str], clients: int, spec: bool, seconds: float,
                max_tokens: int, sample) -> dict:
    out = {"status": {}, "ttft": [], "itl": [], "errors": []}
    k0 = chosen_k(api)
    until = time.monotonic() + seconds
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4)) as http:
        tasks = [asyncio.create_task(client(http, url, model, prompts, spec, until, max_tokens, out,
                                            random.Random(i))) for i in range(clients)]
        while not all(t.done() for t in tasks):
            sample()
            await asyncio.sleep(5)
        await asyncio.gather(*tasks)
    k1 = chosen_k(api)
    steps = k1[1] - k0[1]
    return {"clients": clients, "speculation": spec, "seconds": seconds, "status": out["status"],
            "errors": out["errors"][:5], "ttft_s": quantiles(out["ttft"]), "itl_s": quantiles(out["itl"]),
            "mean_k": (k1[0] - k0[0]) / steps if steps else None,
            "plain_step_share": (k1[2] - k0[2]) / steps if steps else None}


def slope_per_minute(samples: list[tuple[float, int]]) -> float:
    if len(samples) < 2:
        return 0.0
    t = [s[0] for s in samples]
    y = [s[1] for s in samples]
    tm, ym = sum(t) / len(t), sum(y) / len(y)
    num = sum((a - tm) * (b - ym) for a, b in zip(t, y))
    den = sum((a - tm) ** 2 for a in t) or 1.0
    return num / den * 60


def main() -> int:
    p = deployment_arguments(__doc__)
    p.add_argument("--soak-minutes", type=float, default=10.0)
    p.add_argument("--soak-clients", type=int, default=64)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--phase-s", type=float, default=45.0)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak"))
    args = p.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="soak-"))
    folder.chmod(0o711)
    flags = ["--verifier", args.verifier, "--drafter", args.drafter, "--learner", "klrl", "--max-num-seqs", str(args.slots),
             "--max-queue", str(2 * max(args.clients + [args.soak_clients]))]
    rss: dict[str, list[tuple[float, int]]] = {}
    redis_memory: list[tuple[float, int]] = []
    t_start = time.monotonic()
    with Serve(folder, "soak", flags) as serve:
        redis_client = redis_py.Redis(port=serve.redis.port, socket_timeout=2)

        def sample() -> None:
            now = time.monotonic() - t_start
            for name, value in tree_rss(serve.proc.pid).items():
                rss.setdefault(name, []).append((now, value))
            try:
                redis_memory.append((now, int(redis_client.info("memory")["used_memory"])))
            except redis_py.RedisError:
                pass

        nginx, url = start_nginx(folder / "nginx", f"127.0.0.1:{serve.port}")
        try:
            time.sleep(1)
            model = serve.model
            prompts = chat_prompts(Path(args.prompts), 200)
            soak = asyncio.run(phase(url, serve.url, model, prompts, args.soak_clients, True, args.soak_minutes * 60,
                                     args.max_tokens, sample))
            soak_end = time.monotonic() - t_start
            sweep = [asyncio.run(phase(url, serve.url, model, prompts, n, spec, args.phase_s, args.max_tokens, sample))
                     for n in args.clients for spec in (True, False)]
        finally:
            nginx.send_signal(signal.SIGQUIT)

    big = {n: s for n, s in rss.items() if max(v for _, v in s) > 50 * 2**20}
    processes = {}
    for name, samples in big.items():
        during = [s for s in samples if s[0] <= soak_end]
        warm = [s for s in during if s[0] >= WARM_UP_S] or during  # after the pools and caches filled
        if len(warm) >= 2:
            processes[name] = {"first_mib": during[0][1] / 2**20, "warm_mib": warm[0][1] / 2**20,
                               "last_mib": during[-1][1] / 2**20, "peak_mib": max(v for _, v in during) / 2**20,
                               "growth_after_warm_up": during[-1][1] / warm[0][1] - 1,
                               "slope_mib_per_min": slope_per_minute(warm) / 2**20}
    out = {"machine": machine_info(), "args": vars(args), "soak": soak, "sweep": sweep,
           "rss_during_soak": processes,
           "redis_used_memory_mib": [(t, m / 2**20) for t, m in redis_memory[:: max(1, len(redis_memory) // 50)]]}
    Path(args.out + ".json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    plot(out, big, Path(args.out + ".png"))
    print(json.dumps({"soak": {k: soak[k] for k in ("status", "ttft_s", "itl_s", "mean_k", "errors")},
                      "rss": processes}, indent=1))
    for s in sweep:
        print(json.dumps({k: s[k] for k in ("clients", "speculation", "status", "ttft_s", "itl_s", "mean_k",
                                            "plain_step_share")}))
    return 0


def plot(out: dict, rss: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, samples in rss.items():
        a.plot([t / 60 for t, _ in samples], [v / 2**20 for _, v in samples], label=name.split(":", 1)[1][:18])
    a.set_xlabel("minutes")
    a.set_ylabel("RSS (MiB)")
    a.set_title("RSS per process (soak, then the sweep)")
    a.legend(fontsize=7)
    for spec, style in ((True, "o-"), (False, "s--")):
        rows = [s for s in out["sweep"] if s["speculation"] == spec]
        b.plot([s["clients"] for s in rows], [s["itl_s"].get("p50", float("nan")) * 1e3 for s in rows], style,
               label=f"inter-token p50, speculation {'on' if spec else 'off'}")
        b.plot([s["clients"] for s in rows], [s["itl_s"].get("p99", float("nan")) * 1e3 for s in rows], style,
               alpha=0.4, label=f"inter-token p99, speculation {'on' if spec else 'off'}")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("streaming clients")
    b.set_ylabel("ms")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
