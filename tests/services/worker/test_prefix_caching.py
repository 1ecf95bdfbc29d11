"""The worker's prefix cache (drafter/decode/prefix_cache.py): built from WorkerConfig.prefix_caching, shared by its
engines, counted in its stats and metrics (prompt tokens, under specloop's and vLLM's names)."""
from __future__ import annotations

import asyncio
import time

import pytest

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.prefix_cache import reusable
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.model.loading import load_model
from specloop.services.metrics.serving import attach_metrics
from specloop.services.metrics.worker import WorkerMetrics
from specloop.services.protocol import CompletionRequest
from specloop.services.worker.serving_loop import LocalBackend
from tests.tiny import TEXT


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0])


def _tokens(backend, request: CompletionRequest) -> list[int]:
    async def run():
        return [t for c in [c async for c in backend.stream(request)] for t in c.token_ids]
    return asyncio.run(run())


def test_a_chats_second_turn_hits_the_first_ones_history_and_the_metrics_count_it(tiny_pair, verifier):
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=1, max_queue=4)
    metrics = WorkerMetrics()
    attach_metrics(backend.loop, metrics)
    worker = backend.loop.worker
    rule = StopRule(verifier.eos_ids)
    tok = verifier.tokenizer
    prompt = tok.encode(TEXT[1] + TEXT[2], add_special_tokens=False)
    assert len(prompt) > 50  # a block before its last pass
    try:
        turns, hits, seen = [], [], 0
        for t, message in enumerate(("", TEXT[0], TEXT[3])):
            prompt = prompt + tok.encode(message, add_special_tokens=False)
            request = CompletionRequest(f"t{t}", prompt, max_tokens=12, k=None, stream_index=t)
            tokens = _tokens(backend, request)
            deadline = time.monotonic() + 30  # the loop caches the answer once idle (the user's think time)
            while worker.engine.finished and time.monotonic() < deadline:
                time.sleep(0.01)
            assert tokens == generate(verifier.lean, None, [prompt], request.sampling(), 0, rule)[0].token_ids
            turns.append(len(prompt))
            # what it finds: the previous turn's history, prefilled when the loop was idle, in whole blocks before its last pass
            hits.append(min(seen, reusable(len(prompt) - 1, 32)))
            prompt = prompt + tokens
            seen = len(prompt) // 32 * 32
    finally:
        asyncio.run(backend.close())
    assert worker.engine.prefix_cache is worker.prefix_cache is not None
    stats = worker.stats().prefix_cache
    assert stats is not None and stats.queries - sum(turns) in (0, 2)  # (+ the serving loop's 2-token warm-up)
    assert stats.hits == sum(hits) and hits[0] == 0 and min(hits[1:]) > 0
    body = metrics.render()[0].decode()
    for name in ("specloop:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"):
        assert f"{name} {float(stats.queries)}" in body
    for name in ("specloop:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"):
        assert f"{name} {float(stats.hits)}" in body


def test_prefix_caching_off_leaves_the_engines_without_a_cache(tiny_pair):
    backend = LocalBackend.open(tiny_pair[0], None, kind="ngram", slots=1, prefix_caching=False)
    try:
        worker = backend.loop.worker
        assert worker.prefix_cache is None and worker.engine.prefix_cache is None
        assert worker.stats().prefix_cache is None
    finally:
        asyncio.run(backend.close())
