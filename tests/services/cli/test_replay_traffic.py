"""`specloop replay` on real Ray and real Redis: with the learner on, acceptance on a repeated prompt
stream rises while champions hot-swap and the output stays the verifier's own greedy decoding; with
it off, acceptance stays put; Redis going away mid-run fails no request.

The conftest tiny pair accepts every draft (both models repeat the last token), so these tests build
a sharp tiny pair (init_std 0.3) whose drafter starts out disagreeing with the verifier: on 6 prompts
served 9 times it can memorise the verifier's greedy continuations within seconds."""
from __future__ import annotations

import json
import time
from uuid import uuid4

import pytest
import ray
import redis

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.model.loading import load_model
from specloop.services.cli.replay_traffic import Replay, ReplayConfig, ReplaySummary
from specloop.services.worker.worker import ServeResult
from tests.redis_helpers import REDIS_URL, needs_redis, needs_redis_server, redis_up
from tests.tiny import TEXT, make_pair

K, MAX_TOKENS = 4, 24
PROMPTS, CYCLES = 6, 9  # thirds of the stream are 3 whole cycles each
UPDATES_PER_REQUEST = 4  # the pace of traffic: a request arrives once the learner took ~this many steps
PACE_TIMEOUT_S = 0.3  # ... or after this long, whichever comes first
LEARNER = {"lr": 3e-3, "lm_lr": 3e-3, "batch_records": 8, "publish_every": 5, "replay_ratio": 16.0,
           "holdout_every": 4}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def sharp_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("sharp"), init_std=0.3)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    """6 distinct prompts cycled 9 times: a stream a drafter can learn by heart."""
    texts = [text[start : start + 20] for text in TEXT[:3] for start in (0, 25)]
    path = tmp_path_factory.mktemp("prompts") / "repeated.jsonl"
    lines = [json.dumps({"id": f"p{j}-c{c}", "prompt": texts[j]}) for c in range(CYCLES) for j in range(PROMPTS)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(sharp_pair):
    """prompt ids -> the verifier's greedy tokens alone (`specloop generate --no-speculation`)."""
    verifier = load_model(sharp_pair[0])
    rule, params, cache = StopRule(verifier.eos_ids), SamplingParams(max_tokens=MAX_TOKENS), {}

    def tokens(prompt_ids: list[int]) -> list[int]:
        key = tuple(prompt_ids)
        if key not in cache:
            cache[key] = generate(verifier.lean, None, [prompt_ids], params, 0, rule)[0].token_ids
        return cache[key]

    return tokens


def replay_config(sharp_pair, prompt_file, registry, learner: str, buffer: str, prefix: str) -> ReplayConfig:
    return ReplayConfig(verifier=sharp_pair[0], drafter=sharp_pair[1], kind="pretrained", prompts=[prompt_file],
                        learner=learner, buffer=buffer, max_tokens=MAX_TOKENS, k=K, temperature=0.0,
                        registry=registry, redis_prefix=prefix, learner_overrides=LEARNER)


def paced(replay: Replay, results):
    """Yield results, letting the learner take about UPDATES_PER_REQUEST steps per request (bounded wait)."""
    for i, result in enumerate(results):
        yield result
        if replay.learner is None:
            continue
        deadline = time.monotonic() + PACE_TIMEOUT_S
        while time.monotonic() < deadline:
            if ray.get(replay.learner.stats.remote()).learner.updates >= UPDATES_PER_REQUEST * (i + 1):
                break
            time.sleep(0.02)


def run_replay(cfg: ReplayConfig) -> tuple[list[ServeResult], ReplaySummary, list[list[int]]]:
    """(results in request order, finish() summary, prompt ids per request)."""
    replay = Replay(cfg)
    try:
        results = list(paced(replay, replay.run(progress=False)))
    finally:
        summary = replay.finish()
    return results, summary, [r.prompt_ids for r in replay.traffic]


def thirds(results: list[ServeResult]) -> tuple[float, float]:
    """Mean τ (block efficiency) over the first and the last third of the requests."""
    n = len(results) // 3
    mean = lambda rs: sum(r.block_efficiency for r in rs) / len(rs)  # noqa: E731
    return mean(results[:n]), mean(results[-n:])


@pytest.fixture(scope="module")
def runs(sharp_pair, prompt_file, tmp_path_factory):
    """Replay runs cached per (learner, buffer), so that several tests can look at one run."""
    cache: dict = {}
    prefixes: list[str] = []

    def get(learner: str, buffer: str):
        if (learner, buffer) not in cache:
            prefix = f"test-replay-{uuid4().hex}"
            prefixes.append(prefix)
            spec = {"memory": "memory", "redis": REDIS_URL}[buffer]
            t0 = time.monotonic()
            registry = tmp_path_factory.mktemp("registry")
            cache[learner, buffer] = run_replay(replay_config(sharp_pair, prompt_file, registry, learner, spec, prefix))
            print(f"replay learner={learner} buffer={buffer}: {time.monotonic() - t0:.1f}s")
        return cache[learner, buffer]

    yield get
    if prefixes and redis_up():
        admin = redis.Redis.from_url(REDIS_URL)
        for prefix in prefixes:
            keys = admin.keys(f"{prefix}*")
            if keys:
                admin.delete(*keys)
        admin.close()


@pytest.mark.parametrize("buffer", ["memory", pytest.param("redis", marks=needs_redis)])
def test_acceptance_on_a_repeated_stream_rises_with_the_learner_on(runs, buffer):
    results, summary, _ = runs("kl", buffer)
    first, last = thirds(results)
    learner = summary.learner
    promoted = [p.version for p in learner.published if p.promoted]
    print(f"{buffer}: τ first third {first:.2f} -> last third {last:.2f}; updates {learner.learner.updates}, "
          f"published {len(learner.published)}, promoted {len(promoted)}, swaps {len(summary.worker.swaps)}")
    assert len(results) == PROMPTS * CYCLES
    assert last > first + 0.2
    assert promoted and promoted[-1] != "v0001"
    assert summary.worker.swaps  # the worker served the new champions
    assert {r.drafter_version for r in results[-PROMPTS:]} != {"v0001"}
    records = summary.worker.records
    assert records.dropped == 0 and records.logged >= learner.learner.records_seen > 0


def test_acceptance_on_a_repeated_stream_stays_put_with_the_learner_off(runs):
    # with the learner off nothing is logged, so the buffer plays no part: one run covers both
    results, summary, _ = runs("off", "memory")
    first, last = thirds(results)
    print(f"off: τ first third {first:.2f} -> last third {last:.2f}")
    assert abs(last - first) < 0.05
    assert {r.drafter_version for r in results} == {"base"}
    assert summary.learner is None and summary.worker.records is None


@pytest.mark.parametrize("buffer", ["memory", pytest.param("redis", marks=needs_redis)])
def test_greedy_outputs_while_versions_swap_equal_the_verifier_alone(runs, reference, buffer):
    results, summary, prompt_ids = runs("kl", buffer)
    assert len({tuple(r.drafter_versions) for r in results}) > 1  # several drafter versions served
    for result, ids in zip(results, prompt_ids):
        assert result.token_ids == reference(ids), result.id


# ---------------------------------------------------------------- Redis going away mid-run


@needs_redis_server
def test_redis_stopped_mid_run_fails_no_request_and_logging_resumes_when_it_returns(
    sharp_pair, prompt_file, reference, tmp_path, redis_server
):
    prefix = f"test-replay-{uuid4().hex}"
    cfg = replay_config(sharp_pair, prompt_file, tmp_path / "registry", "kl", redis_server.url, prefix)
    replay = Replay(cfg)
    results, summary = [], None
    try:
        stream = replay.run(progress=False)
        total = len(replay.traffic)
        results += [next(stream) for _ in range(total // 2)]
        before = ray.get(replay.worker.drain.remote()).records
        assert before.logged > 0 and before.dropped == 0

        redis_server.stop()
        results += [next(stream) for _ in range(5)]  # served while Redis is down
        down = ray.get(replay.worker.drain.remote()).records
        assert down.dropped > 0  # the records of those requests were dropped, not waited on

        redis_server.start()
        seen_at_restart = ray.get(replay.learner.stats.remote()).learner.records_seen
        results += list(paced(replay, stream))
        ray.get(replay.worker.drain.remote())
        client = redis.Redis(port=redis_server.port)
        streams = [key for key in client.keys(f"{prefix}*") if client.type(key) == b"stream"]
        stream_len = sum(client.xlen(key) for key in streams)  # the restarted server started empty
        client.close()
    finally:
        summary = replay.finish()
    after = summary.worker.records
    assert len(results) == total == PROMPTS * CYCLES
    assert [r.index for r in results] == list(range(total))
    for result, request in zip(results, replay.traffic):
        assert result.token_ids == reference(request.prompt_ids), result.id
    assert after.logged > down.logged  # logging resumed by itself
    assert after.dropped >= down.dropped > 0
    assert stream_len > 0  # the records logged since the restart are in the stream
    assert summary.learner.learner.records_seen > seen_at_restart  # and the learner read them
    print(f"redis outage: logged {before.logged} -> {down.logged} -> {after.logged}, "
          f"dropped {after.dropped}, stream after restart {stream_len}")


def test_a_prompt_that_does_not_fit_the_context_is_skipped_not_fatal(tiny_pair, tmp_path, caplog):
    from specloop.services.cli.replay_traffic import load_traffic

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "short", "prompt": "def f(x):"}) + "\n"
                       + json.dumps({"id": "long", "prompt": "x = 1\n" * 200}) + "\n"
                       + json.dumps({"id": "short2", "prompt": "import os"}) + "\n")
    cfg = ReplayConfig(verifier=tiny_pair[0], drafter=tiny_pair[1], kind="pretrained", prompts=[prompts],
                       learner="off", max_tokens=8, k=2, worker_overrides={"max_context": 64})
    with caplog.at_level("WARNING", logger="specloop.replay"):
        traffic = load_traffic(cfg)
    assert [(r.index, r.id) for r in traffic] == [(0, "short"), (1, "short2")]
    assert "skipped 1 prompt(s)" in caplog.text and "long" in caplog.text
