"""`specloop demo`, the main job on embedded defaults: start `specloop serve` (Ray workers, learner,
registry, HTTP API), send real chat requests through the OpenAI-compatible API, print the answers and
the acceptance statistics, and stop the server cleanly."""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from specloop.services.buffer.redis_stream import redacted
from specloop.services.cli.deployment import default_registry
from specloop.services.cli.launch import ServeProcess
from specloop.services.prompts import load_prompts

READY_TIMEOUT_S = 300.0


@dataclass
class DemoConfig:
    verifier: Path
    drafter: Path
    prompts: Path
    registry: Path  # root: one registry per model pair below it
    max_tokens: int = 64
    temperature: float = 0.0
    k: int | None = None  # None: "auto", the server's cost-aware choice per step
    clients: int = 1  # concurrent requests (they share the worker's continuous batch)
    threads: int = 2
    compare: bool = True  # also decode every request with speculation off, and print the speed-up


def chat(url: str, model: str, messages: list[dict], cfg: DemoConfig, speculate: bool = True) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "speculative": {"enabled": speculate, "k": "auto" if cfg.k is None else cfg.k}}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()


def as_messages(record) -> list[dict]:
    return list(record.messages) if record.messages else [{"role": "user", "content": record.prompt}]


def summary(replies: list[dict], seconds: float, k: int | None) -> str:
    """Totals over the replies' usage; τ only for a fixed k (with k auto, blocks draft different k,
    some none: acceptance α is what the usage tells)."""
    usage = [r["usage"] for r in replies]
    tokens = sum(u["completion_tokens"] for u in usage)
    drafted = sum(u["drafted_tokens"] for u in usage)
    accepted = sum(u["accepted_tokens"] for u in usage)
    versions = sorted({str(u["drafter_version"]) for u in usage})
    alpha = accepted / drafted if drafted else 0.0
    tau = f", τ={1 + accepted / (drafted // k):.3f}" if k and drafted else ""
    return (f"{len(replies)} chat requests, {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tokens/s; "
            f"k={'auto' if k is None else k}: drafted {drafted}, accepted {accepted}: α={alpha:.3f}{tau}; "
            f"drafter version(s) {', '.join(versions)}")


def timed_round(url: str, model: str, records: list, cfg: DemoConfig,
                speculate: bool) -> tuple[list[dict], float, list[float]]:
    """Every record's reply, the round's seconds, and each request's own seconds (whole requests)."""
    def one(record) -> tuple[dict, float]:
        t = time.perf_counter()
        return chat(url, model, as_messages(record), cfg, speculate), time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(cfg.clients) as pool:
        done = list(pool.map(one, records))
    return [d[0] for d in done], time.perf_counter() - t0, [d[1] for d in done]


@dataclass
class Round:
    replies: list[dict]
    seconds: float  # the requests' wall time, summed over the chunks that ran them
    each: list[float]  # each request's own seconds


def paired_rounds(url: str, model: str, records: list, cfg: DemoConfig) -> tuple[Round, Round | None]:
    """Speculation on, and (cfg.compare) off, chunk by chunk: `cfg.clients` requests at a time with
    speculation, then the same requests alone, then the next chunk. Both sides of a pair run next to
    each other in time, so what else loads the machine (the learner training on the records the
    speculative chunk just wrote, Ray, Redis) weighs on both alike; a prompt is decoded with speculation
    before alone, so suffix decoding's store of earlier outputs never holds the answer it is asked for."""
    spec, alone = Round([], 0.0, []), Round([], 0.0, [])
    sides = ((spec, True), (alone, False)) if cfg.compare else ((spec, True),)
    size = max(1, cfg.clients)
    for at in range(0, len(records), size):
        chunk = records[at:at + size]
        for side, speculate in sides:
            replies, seconds, each = timed_round(url, model, chunk, cfg, speculate)
            side.replies += replies
            side.seconds += seconds
            side.each += each
    return spec, (alone if cfg.compare else None)


def request_line(record_id: str, reply: dict, seconds: float, plain: dict | None, plain_s: float | None) -> str:
    """One request's heading: tokens, its tokens/s with speculation (and alone, and the ratio, when it was
    also decoded alone), the drafts accepted and τ (tokens per verifier pass)."""
    u = reply["usage"]
    tokens, drafted, accepted = u["completion_tokens"], u["drafted_tokens"], u["accepted_tokens"]
    rate = tokens / seconds if seconds else 0.0
    speed = f"{rate:.1f} tokens/s"
    if plain is not None and plain_s:
        alone = plain["usage"]["completion_tokens"] / plain_s
        speed = f"{alone:.1f} → {rate:.1f} tokens/s = {rate / alone:.2f}x"
    return f"── {record_id}  ({tokens} tokens, {speed}; accepted {accepted}/{drafted} drafts)"


def comparison(plain: list[dict], plain_s: float, spec: list[dict], spec_s: float) -> str:
    same = all(a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
               for a, b in zip(plain, spec))
    rate = lambda replies, s: sum(r["usage"]["completion_tokens"] for r in replies) / s  # noqa: E731
    note = "identical answers" if same else "answers differ (expected only at temperature > 0)"
    return (f"verifier alone: {rate(plain, plain_s):.1f} tokens/s; with speculation: {rate(spec, spec_s):.1f} tokens/s "
            f"= {rate(spec, spec_s) / rate(plain, plain_s):.2f}x ({note})")


def run_demo(cfg: DemoConfig) -> int:
    from specloop.drafter.kinds.table import resolve_kind

    records = load_prompts(cfg.prompts)
    kind = resolve_kind(None, cfg.drafter)
    assert kind is not None  # a drafter is given: its kind is known
    # no prefix cache: each prompt is timed twice (speculation on, then off), and the second round would find the
    # first one's prompts cached: the comparison would be of the cache, not of speculation
    server = ServeProcess(["--verifier", cfg.verifier, "--drafter", cfg.drafter, "--no-enable-prefix-caching"],
                          threads=cfg.threads,
                          registry=default_registry(cfg.registry, cfg.verifier, cfg.drafter, kind))
    url = server.url
    print(f"starting specloop serve on {url} (Redis: {redacted(os.environ.get('SPECLOOP_REDIS_URL', 'auto'))}) ...",
          file=sys.stderr)
    try:
        model = server.start(READY_TIMEOUT_S).model
        assert model is not None  # start() read it from /v1/models
        card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        print(f"serving {model} as {card.get('weights')}", file=sys.stderr)
        # a request that warms the server up comes before both sides (paired_rounds: speculation first)
        chat(url, model, [{"role": "user", "content": "Hello!"}], cfg, False)
        spec, alone = paired_rounds(url, model, records, cfg)
        plain = alone.replies if alone is not None else [None] * len(records)
        plain_each = alone.each if alone is not None else [None] * len(records)
        for record, reply, s, plain_reply, plain_s in zip(records, spec.replies, spec.each, plain, plain_each):
            print(request_line(record.id, reply, s, plain_reply, plain_s))
            print(reply["choices"][0]["message"]["content"])
        print(summary(spec.replies, spec.seconds, cfg.k), file=sys.stderr)
        if alone is not None:  # cfg.compare
            print(comparison(alone.replies, alone.seconds, spec.replies, spec.seconds), file=sys.stderr)
    finally:
        code = server.stop(timeout=60)
        print(f"specloop serve stopped (exit code {code})", file=sys.stderr)
    return 0
