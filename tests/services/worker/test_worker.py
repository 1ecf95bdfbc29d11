"""The verifier worker: hot swaps stay lossless, registry versions serve, roll back and get logged."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.table import DrafterBuilder
from specloop.drafter.model.attention import KV_CACHE_ENV
from specloop.drafter.model.loading import load_model
from specloop.services.buffer.memory import MemoryBuffer
from specloop.services.buffer.redis_stream import RedisStreamBuffer
from specloop.services.protocol import CompletionRequest
from specloop.services.registry.registry import Registry
from specloop.services.worker.worker import AcceptanceMonitor, ServeResult, VerifierWorker, WorkerConfig
from specloop.trainer.records import decode
from tests.redis_helpers import needs_redis_server
from tests.stats import chi2_pvalue, exact_marginals
from tests.tiny import TEXT, build_model, llama_config
from tests.worker_helpers import base_weights, noisy, publish

K = 4
MAX_TOKENS = 24
NO_AUTO_ROLLBACK = 10**9  # a rollback window no test fills


# ---------------------------------------------------------------- drafters whose weights change every step


def perturbed_weights(builder: DrafterBuilder, kind: str, gen: torch.Generator, std: float) -> dict:
    """A registry-style version (the learner's names) of `kind`: the base's trainable tensors plus noise.
    pretrained: "lm.*" (every drafter LM parameter); sd2: "steering.*" (W_s ≠ 0, so it steers);
    dvi: "head.*" LoRA adapters (B ≠ 0, so the head differs from the early exit); eagle3: every "head.*"."""
    if kind == "pretrained":
        named = [("lm." + n, p) for n, p in builder.lm.hf.named_parameters()]
    elif kind == "sd2":
        named = [("steering." + n, p) for n, p in builder.steering.named_parameters()]
    else:
        named = [("head." + n, p) for n, p in builder.head.named_parameters() if kind == "eagle3" or "lora_" in n]
    return {n: p.detach().cpu() + std * torch.randn(p.shape, generator=gen) for n, p in named}


class SwapEveryStep:
    """StepHooks that hand over a freshly perturbed drafter version before every step."""

    def __init__(self, builder: DrafterBuilder, kind: str, std: float, seed: int = 0):
        self.builder, self.kind, self.std = builder, kind, std
        self.gen = torch.Generator().manual_seed(seed)
        self.swaps = 0

    def swap(self, drafter, histories):
        new = self.builder.build(perturbed_weights(self.builder, self.kind, self.gen, self.std))
        new.refill(drafter, histories) if self.swaps % 2 else new.adopt(drafter)  # both ways of taking over rows
        self.swaps += 1
        return new

    def traced(self, histories, ids):
        return None


# noise large enough to change drafts of the tiny pair (whose models repeat the last prompt token)
GREEDY_STD = {"pretrained": 0.1, "sd2": 0.5, "dvi": 0.1, "eagle3": 0.3}


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0])


@pytest.fixture(scope="module")
def builders(tiny_pair, verifier):
    drafter_dir = {"pretrained": tiny_pair[1], "sd2": tiny_pair[1], "dvi": None, "eagle3": None}
    return {kind: DrafterBuilder(kind, verifier, d) for kind, d in drafter_dir.items()}


@pytest.fixture(scope="module")
def prompts(verifier):
    tok = verifier.tokenizer
    return [tok.encode(text[start : start + 24]) for text in TEXT for start in (0, 17)]  # 8 prompts


@pytest.mark.parametrize("kind", ["pretrained", "sd2", "dvi", "eagle3"])
def test_greedy_output_equals_the_verifier_alone_while_versions_are_swapped_after_every_step(
    verifier, builders, prompts, kind
):
    rule, params = StopRule(verifier.eos_ids), SamplingParams(max_tokens=MAX_TOKENS)
    reference = [generate(verifier.lean, None, [p], params, 0, rule)[0].token_ids for p in prompts]
    builder = builders[kind]
    hooks = SwapEveryStep(builder, kind, GREEDY_STD[kind])
    swapped = generate(verifier.lean, builder.build(), prompts, params, K, rule, hooks=hooks)
    steady = generate(verifier.lean, builder.build(), prompts, params, K, rule)

    assert [g.token_ids for g in swapped] == reference
    assert [g.token_ids for g in steady] == reference
    assert hooks.swaps == max(g.stats.blocks for g in swapped)  # one swap before every step of the batch
    assert hooks.swaps >= 5
    accepted = lambda gens: sum(g.stats.accepted for g in gens)  # noqa: E731
    print(f"{kind}: {hooks.swaps} swaps, accepted {accepted(swapped)} swapping vs {accepted(steady)} steady")
    if kind != "eagle3":  # an untrained eagle3 head never drafts the tiny verifier's repeated token (its drafts
        # are accepted in the sampled test below, with 12 tokens)
        assert accepted(swapped) != accepted(steady)  # the drafts came from the swapped-in versions


# ---------------------------------------------------------------- output distribution with swaps every step

VOCAB = 12
PROMPT = [1, 2, 3, 1, 2]
N_SAMPLES = 10_000  # as in test_speculative, whose wrong-sampler test still fails at this size
CHUNK = 5_000
POSITIONS = 3
SAMPLING = SamplingParams(temperature=1.0, max_tokens=POSITIONS, seed=5)


def save_small_vocab_model(out, layers: int, seed: int):
    """A sharp VOCAB-token Llama (init_std 0.6) with a word-level tokenizer, loadable by load_model."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    model = build_model(llama_config(VOCAB, layers, 32), seed=seed, init_std=0.6)
    model.save_pretrained(out)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """(verifier LoadedModel, drafter dir): 3 verifier layers so that DVI's default s = 2 fits."""
    root = tmp_path_factory.mktemp("small_vocab")
    save_small_vocab_model(root / "verifier", layers=3, seed=11)
    save_small_vocab_model(root / "drafter", layers=1, seed=12)
    return load_model(root / "verifier"), root / "drafter"


@pytest.mark.usefixtures("wide_fp32_row_blocks")
@pytest.mark.parametrize("kind,k,std", [("pretrained", 2, 0.3), ("sd2", 2, 0.5), ("dvi", 3, 0.5), ("eagle3", 3, 0.5)])
def test_sampled_output_distribution_equals_the_verifiers_while_versions_are_swapped_after_every_step(
    small_vocab, kind, k, std
):
    verifier, drafter_dir = small_vocab
    builder = DrafterBuilder(kind, verifier, None if kind in ("dvi", "eagle3") else drafter_dir)
    rule = StopRule()  # no EOS: every sample has POSITIONS tokens
    counts = torch.zeros(POSITIONS, VOCAB)
    swaps = 0
    for lo in range(0, N_SAMPLES, CHUNK):
        hooks = SwapEveryStep(builder, kind, std, seed=lo)
        gens = generate(verifier.lean, builder.build(), [PROMPT] * CHUNK, SAMPLING, k, rule, first_request=lo,
                        hooks=hooks)
        swaps += hooks.swaps
        toks = torch.tensor([g.token_ids for g in gens])
        for t in range(POSITIONS):
            counts[t] += torch.bincount(toks[:, t], minlength=VOCAB)
    exact = exact_marginals(verifier.hf, PROMPT, POSITIONS, SAMPLING)
    pvalues = [chi2_pvalue(counts[t], exact[t]) for t in range(POSITIONS)]
    print(f"{kind} k={k}: {swaps} swaps, chi-square p-values {pvalues}")
    assert swaps >= N_SAMPLES // CHUNK * 2  # at least two steps (so one swap mid-request) per chunk
    assert min(pvalues) > 0.01, pvalues


# ---------------------------------------------------------------- the worker and a folder registry








def start_worker(tiny_pair, root, drafter_dir=None, buffer=None, **cfg) -> VerifierWorker:
    cfg = {"rollback_window": NO_AUTO_ROLLBACK, "poll_interval_s": 0.0} | cfg  # tests see every registry change at once
    config = WorkerConfig(verifier=str(tiny_pair[0]), drafter=str(drafter_dir or tiny_pair[1]), kind="pretrained",
                          registry=str(root), **cfg)
    return VerifierWorker(config, buffer)


def requests(verifier, start: int = 0) -> list[CompletionRequest]:
    tok = verifier.tokenizer
    texts = [text[s : s + 24] for text in TEXT for s in (0, 17)]
    return [CompletionRequest(f"r{start + i}", tok.encode(t), max_tokens=MAX_TOKENS, k=K, stream_index=start + i)
            for i, t in enumerate(texts)]


def verifier_alone(worker: VerifierWorker, reqs: list[CompletionRequest]) -> list[list[int]]:
    return [generate(worker.verifier.lean, None, [r.prompt_ids], r.sampling(), 0, worker.stop_rule)[0].token_ids
            for r in reqs]


def serve_all(worker: VerifierWorker, reqs: list[CompletionRequest]) -> list[ServeResult]:
    return [worker.serve(r) for r in reqs]


def settle(worker: VerifierWorker, version: str, timeout: float = 30.0) -> int:
    """Serve warm-up requests until one is decoded entirely by `version`; returns how many it took."""
    warm = requests(worker.verifier, start=1000)[0]
    deadline = time.monotonic() + timeout
    for n in range(1, 10_000):
        if worker.serve(warm).drafter_versions == [version]:
            return n
        assert time.monotonic() < deadline, f"worker never served {version}: {worker.stats()}"
        time.sleep(0.01)
    raise AssertionError("unreachable")


def per_request(results: list[ServeResult]) -> list[tuple]:
    return [(r.token_ids, r.drafted, r.accepted) for r in results]


@pytest.fixture
def champion_worker(tiny_pair, tmp_path):
    """start(weights=None, **cfg) -> (registry, "v0001", worker): a folder registry whose champion v0001 is
    `weights` (default: the base drafter's) and a worker serving it; the workers are closed afterwards."""
    workers: list[VerifierWorker] = []

    def start(weights: dict | None = None, **cfg) -> tuple[Registry, str, VerifierWorker]:
        reg = Registry(tmp_path / "reg")
        v1 = publish(reg, base_weights(tiny_pair[1]) if weights is None else weights, None, 0.5)
        assert reg.promote(v1).promoted
        workers.append(start_worker(tiny_pair, tmp_path / "reg", **cfg))
        return reg, v1, workers[-1]

    yield start
    for worker in workers:
        worker.close()


@pytest.mark.parametrize("swap_cache", ["keep", "recompute"])
def test_the_worker_serves_the_champion_and_picks_up_a_newly_promoted_version(tiny_pair, champion_worker, swap_cache):
    reg, v1, worker = champion_worker(swap_cache=swap_cache)
    reqs = requests(worker.verifier)
    reference = verifier_alone(worker, reqs)
    first = serve_all(worker, reqs)
    assert {r.drafter_version for r in first} == {"v0001"}
    assert [r.token_ids for r in first] == reference

    v2 = publish(reg, noisy(base_weights(tiny_pair[1]), 0.1, seed=1), v1, 0.6)
    assert reg.promote(v2).promoted
    results, deadline = [], time.monotonic() + 30
    for i in range(10_000):
        r = reqs[i % len(reqs)]
        results.append((r, worker.serve(r)))
        if results[-1][1].drafter_version == "v0002":
            break
        assert time.monotonic() < deadline, "the worker never picked up v0002"
        time.sleep(0.01)
    print(f"v0002 served after {len(results)} request(s); versions {[x.drafter_versions for _, x in results]}")
    results += [(r, worker.serve(r)) for r in reqs]
    assert results[-1][1].drafter_versions == ["v0002"]
    assert [x.token_ids for _, x in results] == verifier_alone(worker, [r for r, _ in results])

    stats = worker.stats()
    assert stats.version == "v0002"
    swap = [s for s in stats.swaps if s.new == "v0002"]
    assert len(swap) == 1 and swap[0].old == "v0001"
    assert swap[0].stall_ms >= 0 and swap[0].load_ms >= 0
    assert stats.swap_stall_ms["n"] == sum(s.in_flight for s in stats.swaps)
    assert set(stats.acceptance_by_version) >= {"v0001", "v0002"}
    assert stats.load_failures == [] and stats.rollbacks == []


def test_rollback_restores_the_previous_champions_outputs_and_statistics_exactly(tiny_pair, champion_worker):
    reg, v1, worker = champion_worker()
    reqs = requests(worker.verifier)
    s1 = per_request(serve_all(worker, reqs))

    v2 = publish(reg, noisy(base_weights(tiny_pair[1]), 0.1, seed=1), v1, 0.6)
    assert reg.promote(v2).promoted
    settle(worker, "v0002")
    s2 = serve_all(worker, reqs)
    assert {r.drafter_version for r in s2} == {"v0002"}
    assert [(d, a) for _, d, a in per_request(s2)] != [(d, a) for _, d, a in s1]
    assert [t for t, _, _ in per_request(s2)] == [t for t, _, _ in s1]  # lossless either way

    assert reg.rollback("test") == "v0001"
    settle(worker, "v0001")
    s3 = serve_all(worker, reqs)
    assert {r.drafter_version for r in s3} == {"v0001"}
    assert per_request(s3) == s1


def test_a_rollback_while_the_new_version_is_still_loading_keeps_the_champion_serving(tiny_pair, champion_worker):
    reg, v1, worker = champion_worker()
    gate, loading = threading.Event(), threading.Event()
    load = worker.watcher.load

    def gated(version: str):
        loading.set()
        assert gate.wait(30)
        return load(version)

    worker.watcher.load = gated
    v2 = publish(reg, noisy(base_weights(tiny_pair[1]), 0.1, seed=1), v1, 0.6)
    reg.promote(v2)
    assert loading.wait(30)  # the watcher is loading v0002
    assert worker.swap(worker.drafter, [[1]]) is worker.drafter  # nothing ready: serving goes on
    assert reg.rollback("operator changed their mind") == "v0001"
    gate.set()
    assert worker.watcher.fresh(30)  # v0002's load finished, and the watcher read the alias after it
    results = serve_all(worker, requests(worker.verifier)[:3])
    assert [r.drafter_versions for r in results] == [["v0001"]] * 3
    assert worker.stats().version == reg.champion() == "v0001"


@needs_redis_server
def test_a_worker_whose_redis_hangs_keeps_serving_and_follows_the_registry_again(tiny_pair, tmp_path, redis_server):
    """Registry metadata and replay records in one Redis, paused (SIGSTOP) while the worker serves: no
    step waits on it (the registry is read on the watcher's thread, the buffer's sizes on its writer's)."""
    reg = Registry(tmp_path / "reg", redis_server.url, "hang")
    v1 = publish(reg, base_weights(tiny_pair[1]), None, 0.5)
    assert reg.promote(v1).promoted
    buffer = RedisStreamBuffer(redis_server.url, prefix="hang")
    worker = start_worker(tiny_pair, tmp_path / "reg", buffer=buffer, redis_url=redis_server.url, prefix="hang",
                          poll_interval_s=0.05)
    try:
        reqs = requests(worker.verifier)
        steps: list[float] = []
        worker.on_step.append(lambda *_: steps.append(time.monotonic()))
        served = serve_all(worker, reqs[:2])
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + 2 * Registry.redis_timeout_s()
            while time.monotonic() < end:
                served.append(worker.serve(reqs[len(served) % len(reqs)]))
                worker.stats()  # what a metrics scrape reads
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        gap = max(b - a for a, b in zip(steps, steps[1:]))
        assert gap < 1.0, f"a step waited {gap:.2f} s on the paused Redis"
        assert worker.registry_errors >= 1 and {r.drafter_version for r in served} == {v1}
        served_reqs = [reqs[i % len(reqs)] for i in range(len(served))]
        assert [r.token_ids for r in served] == verifier_alone(worker, served_reqs)
        v2 = publish(reg, noisy(base_weights(tiny_pair[1]), 0.1, seed=1), v1, 0.6)
        assert reg.promote(v2).promoted
        settle(worker, v2)
    finally:
        worker.close()
        buffer.close()


def test_a_version_with_nan_weights_is_refused_and_the_champion_keeps_serving(tiny_pair, champion_worker):
    reg, v1, worker = champion_worker()
    reqs = requests(worker.verifier)[:4]
    before = per_request(serve_all(worker, reqs))
    bad = base_weights(tiny_pair[1])
    name = next(n for n in bad if "mlp" in n)
    bad[name][0, 0] = float("nan")
    v2 = publish(reg, bad, v1, 0.9)

    refused = reg.promote(v2)
    assert not refused.promoted and "non-finite" in refused.reason and name in refused.reason
    assert refused.champion == "v0001"
    forced = reg.promote(v2, force=True)
    assert not forced.promoted and "non-finite" in forced.reason
    assert reg.champion() == "v0001"
    assert [e["event"] for e in reg.events() if e["version"] == v2] == ["publish", "refuse", "refuse"]

    after = serve_all(worker, reqs)
    assert {r.drafter_version for r in after} == {"v0001"}
    assert per_request(after) == before
    stats = worker.stats()
    assert [s.new for s in stats.swaps] == ["v0001"]  # only the start-up load
    assert stats.load_failures == []


@pytest.mark.parametrize("seeded", [True, False])
def test_a_worker_started_beside_the_learner_waits_for_the_champion_it_seeds(tiny_pair, tmp_path, seeded):
    # `specloop serve` starts the learner and the workers together: a worker serves the champion the learner
    # publishes while it loads from its first request; where none comes, it gives up at its deadline, on its base
    reg = Registry(tmp_path / "reg")
    wait = 60.0 if seeded else 0.5
    config = WorkerConfig(verifier=str(tiny_pair[0]), drafter=str(tiny_pair[1]), kind="pretrained",
                          registry=str(reg.root), rollback_window=NO_AUTO_ROLLBACK, champion_wait_s=wait)
    weights = base_weights(tiny_pair[1])

    def seed() -> None:  # the learner's start: the base weights published and promoted, a while after
        time.sleep(1.0)
        vid = reg.publish(weights, parent=None, learner_step=0, objective="base", loss=None, sim_acceptance=None,
                          kind="pretrained").id
        reg.promote(vid, force=True)

    learner = threading.Thread(target=seed)
    if seeded:
        learner.start()
    started = time.monotonic()
    worker = VerifierWorker(config)
    try:
        waited = time.monotonic() - started
        first = serve_all(worker, requests(worker.verifier)[:1])[0]
        if seeded:
            assert first.drafter_version == "v0001" and waited >= 0.9
        else:
            assert first.drafter_version == "base" and waited >= 0.5
    finally:
        if seeded:
            learner.join()
        worker.close()


def test_a_dvi_worker_given_a_plain_drafter_directory_serves_registry_heads_losslessly(tiny_pair, tmp_path):
    reg = Registry(tmp_path / "reg")
    config = WorkerConfig(verifier=str(tiny_pair[0]), drafter=str(tiny_pair[1]), kind="dvi", registry=str(reg.root),
                          rollback_window=NO_AUTO_ROLLBACK)
    worker = VerifierWorker(config)  # a plain LM directory is no DVI checkpoint: an untrained head, like the learner's
    try:
        reqs = requests(worker.verifier)[:4]
        assert {r.drafter_version for r in serve_all(worker, reqs)} == {"base"}
        head = perturbed_weights(worker.builder, "dvi", torch.Generator().manual_seed(0), 0.1)
        vid = reg.publish(head, parent=None, learner_step=1, objective="kl", loss=None, sim_acceptance=0.5,
                          kind="dvi").id
        assert reg.promote(vid).promoted
        settle(worker, vid)
        results = serve_all(worker, reqs)
        assert {r.drafter_version for r in results} == {vid}
        # the new head is not the early exit (which accepts every draft of the tiny pair)
        assert sum(r.accepted for r in results) < sum(r.drafted for r in results)
        assert [r.token_ids for r in results] == verifier_alone(worker, reqs)
    finally:
        worker.close()


# ---------------------------------------------------------------- automatic rollback


def monitor_after_promotion(window: int, margin: float, v1_blocks: int, drafted: int, accepted: int):
    """An AcceptanceMonitor that saw `v1_blocks` blocks of v1 (`accepted` of `drafted` each), then v1 -> v2."""
    m = AcceptanceMonitor(window=window, margin=margin)
    for _ in range(v1_blocks):
        m.observe("v1", drafted, accepted)
    m.promoted("v1", "v2")
    return m


def test_acceptance_monitor_gives_no_verdict_before_the_new_versions_window_fills():
    m = monitor_after_promotion(window=4, margin=0.1, v1_blocks=4, drafted=4, accepted=4)
    for _ in range(3):
        m.observe("v2", 4, 0)
        assert m.verdict() is None
    m.observe("v2", 4, 0)
    reason = m.verdict()
    assert reason is not None and "v2" in reason and "v1" in reason and "0.000" in reason and "1.000" in reason


def test_acceptance_monitor_gives_a_verdict_below_the_margin_and_none_within_it():
    def run(new_accepted: int) -> str | None:
        m = monitor_after_promotion(window=4, margin=0.1, v1_blocks=4, drafted=20, accepted=16)  # α = 0.8
        for _ in range(4):
            m.observe("v2", 20, new_accepted)
        return m.verdict()

    assert run(15) is None  # 0.75: worse, but within the margin
    assert run(16) is None and run(20) is None
    assert run(13) is not None  # 0.65 < 0.8 − 0.1


def test_acceptance_monitor_gives_only_one_verdict_per_promotion():
    m = monitor_after_promotion(window=2, margin=0.05, v1_blocks=2, drafted=4, accepted=4)
    verdicts = []
    for _ in range(10):
        m.observe("v2", 4, 0)
        verdicts.append(m.verdict())
    assert sum(v is not None for v in verdicts) == 1 and verdicts[1] is not None
    m.promoted("v2", "v1")  # the rollback: v1 is now watched against v2 and is better
    for _ in range(4):
        m.observe("v1", 4, 4)
        assert m.verdict() is None


def test_acceptance_monitor_does_not_judge_a_version_whose_predecessor_lacks_a_full_window():
    m = monitor_after_promotion(window=4, margin=0.1, v1_blocks=3, drafted=4, accepted=4)
    for _ in range(8):
        m.observe("v2", 4, 0)
        assert m.verdict() is None


def test_the_worker_rolls_back_a_promoted_version_whose_live_acceptance_collapses(tiny_pair, champion_worker):
    good = base_weights(tiny_pair[1])
    reg, v1, worker = champion_worker(good, rollback_window=8, rollback_margin=0.05)
    reqs = requests(worker.verifier)
    under_v1 = serve_all(worker, reqs[:4])  # ≥ 8 blocks: v0001 has a full window
    assert sum(r.drafted for r in under_v1) // K >= 8
    rate_v1 = sum(r.accepted for r in under_v1) / sum(r.drafted for r in under_v1)

    v2 = publish(reg, {n: t * 0 for n, t in good.items()}, v1, 0.9)  # a drafter that lost its weights
    assert reg.promote(v2).promoted
    served, deadline = [], time.monotonic() + 60
    while not worker.stats().rollbacks:
        served.append(worker.serve(reqs[len(served) % len(reqs)]))
        assert time.monotonic() < deadline, f"no automatic rollback: {worker.stats()}"
    assert reg.champion() == "v0001"
    reason = worker.stats().rollbacks[0]
    assert "v0002" in reason and "v0001" in reason
    rollback = [e for e in reg.events() if e["event"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["version"] == "v0001" and rollback[0]["previous"] == "v0002"
    assert rollback[0]["reason"] == reason
    by_version = worker.stats().acceptance_by_version
    rate_v2 = by_version["v0002"].accepted / by_version["v0002"].drafted
    print(f"rolled back: α v0001 {rate_v1:.3f}, v0002 {rate_v2:.3f}: {reason}")
    assert rate_v2 < rate_v1 - 0.05

    settle(worker, "v0001")  # the worker follows the registry back
    again = serve_all(worker, reqs[:4])
    assert per_request(again) == per_request(under_v1)
    assert len(worker.stats().rollbacks) == 1
    served_reqs = [reqs[i % len(reqs)] for i in range(len(served))]
    assert [x.token_ids for x in served] == verifier_alone(worker, served_reqs)


# ---------------------------------------------------------------- replay records


@pytest.mark.parametrize("log_thread", [False, True])
def test_the_worker_logs_one_record_per_served_block_tagged_with_the_serving_version(tiny_pair, champion_worker, log_thread):
    buffer = MemoryBuffer()
    # noisy weights: rejections, so the records vary
    _, _, worker = champion_worker(noisy(base_weights(tiny_pair[1]), 0.1, seed=3), buffer=buffer, log_thread=log_thread)
    results = serve_all(worker, requests(worker.verifier))
    worker.drain()
    blocks = sum(r.drafted for r in results) // K
    entries = buffer.read("test", count=10 * blocks)
    assert len(entries) == blocks == buffer.stats().depth
    records = [decode(e.payload) for e in entries]
    assert {r.drafter_version for r in records} == {"v0001"}
    assert {r.kind for r in records} == {"pretrained"} and {r.k for r in records} == {K}
    for res in results:
        mine = [r for r in records if r.request_id == res.id]
        assert [r.block for r in mine] == list(range(res.drafted // K))
        assert sum(r.accepted for r in mine) == res.accepted
    stats = worker.stats().records
    assert stats.logged == blocks and stats.dropped == 0


def test_a_mix_of_speculators_logs_the_models_blocks_only_and_serves_the_verifiers_tokens(tiny_pair):
    """Suffix drafts are never records; a static member's are, under its own version (KL-only for the learner)."""
    buffer = MemoryBuffer()
    config = WorkerConfig(verifier=str(tiny_pair[0]), drafter=None, kind="eagle", speculators=("static", "suffix"))
    worker = VerifierWorker(config, buffer)
    try:
        reqs = requests(worker.verifier) + requests(worker.verifier, start=100)  # the same texts twice
        results = serve_all(worker, reqs)
        worker.drain()
        assert [r.token_ids for r in results] == verifier_alone(worker, reqs)
        served = worker.drafter.served
        assert served["suffix"] > 0 and served["adaptive"] + served["static"] > 0, served
        records = [decode(e.payload) for e in buffer.read("test", count=100_000)]
        assert len(records) == served["adaptive"] + served["static"]
        assert {r.drafter_version for r in records} <= {"base", "static"} and {r.kind for r in records} == {"eagle"}
    finally:
        worker.close()


@pytest.mark.parametrize("observe_every, speculators", [(0, ()), (1, ()), (3, ()), (3, ("suffix",))])
def test_steps_left_plain_give_observed_records_of_the_verifiers_own_tokens(tiny_pair, observe_every, speculators):
    """Speculation off (k = 0) for every request: an eagle worker (alone, or the served default's mix with suffix
    decoding) logs one step in `observe_every` as observed records (k = 0: the verifier's next token, the head's
    feature it would have drafted from), none with 0."""
    buffer = MemoryBuffer()
    config = WorkerConfig(verifier=str(tiny_pair[0]), drafter=None, kind="eagle", observe_every=observe_every,
                          speculators=speculators)
    worker = VerifierWorker(config, buffer)
    try:
        reqs = [dataclasses.replace(r, k=0) for r in requests(worker.verifier)[:3]]
        results = serve_all(worker, reqs)
        worker.drain()
        assert [r.token_ids for r in results] == verifier_alone(worker, reqs)
        records = [decode(e.payload) for e in buffer.read("test", count=100_000)]
        steps = sum(len(r.token_ids) for r in results)  # one request at a time: a token a step
        assert worker.plain_steps == (steps if observe_every else 0)
        assert len(records) == (steps // observe_every if observe_every else 0)
        for record in records:
            assert record.observed and record.kind == "eagle" and record.drafter_version == "base"
            assert record.steer.shape == (1, worker.verifier.lean.hidden_size) and np.isfinite(record.steer).all()
            res = next(r for r in results if r.id == record.request_id)
            text = next(q for q in reqs if q.id == record.request_id).prompt_ids + res.token_ids
            at = [i for i in range(1, len(text)) if text[i - 1] == int(record.context[-1])
                  and text[i] == int(record.tokens[0])]
            assert at, "an observed record's token follows its context in the request's text"
        assert worker.stats().records.logged == worker.stats().records.observed == len(records)
    finally:
        worker.close()


def test_an_unknown_swap_cache_mode_or_a_negative_observation_interval_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="swap_cache"):
        WorkerConfig(verifier=str(tiny_pair[0]), drafter=str(tiny_pair[1]), kind="pretrained", swap_cache="flush")
    with pytest.raises(ValueError, match="observe_every"):
        WorkerConfig(verifier=str(tiny_pair[0]), drafter=str(tiny_pair[1]), kind="pretrained", observe_every=-1)


def test_enforce_eager_and_the_kv_cache_dtype_reach_the_engine_and_its_drafter_lm(tiny_pair, monkeypatch):
    # `specloop serve --enforce-eager --kv-cache-dtype ...`: the engine on the eager backend where the graph one would
    # run (SPECLOOP_BACKEND=graph stands in for a GPU's default), and the caches in the dtype asked for
    monkeypatch.setenv("SPECLOOP_COMPILE", "0")
    monkeypatch.setenv("SPECLOOP_BACKEND", "graph")
    monkeypatch.setenv(KV_CACHE_ENV, "auto")  # restored after: the worker sets it for its process
    fields = dict(verifier=str(tiny_pair[0]), drafter=str(tiny_pair[1]), kind="pretrained", log_records=False)
    for eager, kv, want in ((False, "auto", torch.float32), (True, "bfloat16", torch.bfloat16)):
        worker = VerifierWorker(WorkerConfig(**fields, enforce_eager=eager, kv_cache_dtype=kv))
        try:
            assert worker.engine.backend == ("eager" if eager else "graph")
            assert worker.engine.cache.keys[0].dtype == want
            assert worker.engine.drafter.cache.keys[0].dtype == want  # the drafter LM's own cache
            reqs = requests(worker.verifier)[:2]
            alone = [generate(worker.verifier.lean, None, [r.prompt_ids], r.sampling(), 0, worker.stop_rule,
                              backend=worker.engine.backend)[0].token_ids for r in reqs]  # the same backend's
            assert [r.token_ids for r in serve_all(worker, reqs)] == alone
        finally:
            worker.close()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, not 'fp8'"):
        WorkerConfig(**fields, kv_cache_dtype="fp8")
