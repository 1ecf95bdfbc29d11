"""The serving loop: concurrent requests stay lossless, the queue is bounded, cancelled requests leave."""
from __future__ import annotations

import asyncio
import time

import pytest

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.loading import load_model
from specloop.services.protocol import CompletionRequest
from specloop.services.worker.serving_loop import LocalBackend


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0])


def _serve_all(backend, requests) -> list:
    """Every request's chunks, all submitted at once; the backend is closed afterwards."""

    async def all_of_them():
        return await asyncio.gather(*(_collect(backend, r) for r in requests))

    try:
        return asyncio.run(all_of_them())
    finally:
        asyncio.run(backend.close())


def _collect(backend, request):
    async def run():
        return [c async for c in backend.stream(request)]
    return run()


def test_concurrent_requests_decode_exactly_as_generate_alone(tiny_pair, verifier):
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=3, max_queue=8)
    prompts = [verifier.tokenizer.encode(t, add_special_tokens=False) for t in ("def main", "hello", "import os", "class A")]
    requests = [CompletionRequest(f"r{i}", p, max_tokens=10 + i, temperature=0.8 * (i % 2), seed=3, stream_index=i, k=i % 3 + 1)
                for i, p in enumerate(prompts * 2)]  # 8 requests for 3 slots: they queue, join and leave

    results = _serve_all(backend, requests)
    rule = StopRule(verifier.eos_ids)
    drafter = build_drafter("pretrained", verifier, tiny_pair[1])
    for r, chunks in zip(requests, results):
        tokens = [t for c in chunks for t in c.token_ids]
        alone = generate(verifier.lean, drafter, [r.prompt_ids], r.sampling(), r.k, rule, first_request=r.stream_index)[0]
        assert tokens == alone.token_ids, r.id  # the same seeded draws as `specloop generate`
        if r.temperature == 0:  # and at temperature 0, the verifier's own greedy output
            assert tokens == generate(verifier.lean, None, [r.prompt_ids], r.sampling(), 0, rule)[0].token_ids
        usage = chunks[-1].usage
        assert usage.completion_tokens == len(tokens) and usage.drafted_tokens == r.k * usage.blocks
        assert chunks[-1].finish_reason in ("stop", "length")


def test_auto_requests_beside_explicit_ones_stay_lossless_and_export_the_chosen_k(tiny_pair, verifier):
    from specloop.services.metrics.serving import attach_metrics
    from specloop.services.metrics.worker import WorkerMetrics

    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=3, max_queue=8)
    metrics = WorkerMetrics()
    attach_metrics(backend.loop, metrics)
    prompts = [verifier.tokenizer.encode(t, add_special_tokens=False) for t in ("def main", "hello", "import os")]
    requests = [CompletionRequest(f"a{i}", p, max_tokens=16, k=None if i % 3 else 2, stream_index=i)  # None: auto
                for i, p in enumerate(prompts * 2)]

    results = _serve_all(backend, requests)
    rule = StopRule(verifier.eos_ids)
    k_max = backend.loop.worker.engine.controller.cfg.k_max
    for r, chunks in zip(requests, results):
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == generate(verifier.lean, None, [r.prompt_ids], r.sampling(), 0, rule)[0].token_ids
        usage = chunks[-1].usage
        assert usage.drafted_tokens <= (k_max if r.k is None else r.k) * usage.blocks
    body = metrics.render()[0].decode()
    assert 'specloop:spec_decode_chosen_k_count{drafter_version="base"}' in body
    assert "specloop:spec_decode_est_acceptance" in body


def test_requests_beyond_the_queue_are_refused_as_overloaded(tiny_pair):
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=1, max_queue=1)
    requests = [CompletionRequest(f"q{i}", [5, 6, 7], max_tokens=40) for i in range(4)]

    async def burst():
        return await asyncio.gather(*(_collect(backend, r) for r in requests))

    try:
        results = asyncio.run(burst())
    finally:
        asyncio.run(backend.close())
    refused = [chunks[0].error for chunks in results if chunks[0].error is not None]
    assert refused and all(e.status == 503 and e.type == "overloaded_error" for e in refused)
    assert any(chunks[-1].finish_reason == "length" for chunks in results)


def test_a_request_waiting_for_the_only_slot_reports_its_queue_time_in_usage(tiny_pair):
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=1, max_queue=4)
    first, second = (CompletionRequest(f"w{i}", [5, 6, 7], max_tokens=24, k=0) for i in range(2))
    results = _serve_all(backend, [first, second])
    usages = {chunks[-1].id: chunks[-1].usage for chunks in results}
    ends = {chunks[-1].id: chunks[-1].finish_reason for chunks in results}
    assert ends == {"w0": "length", "w1": "length"}
    waited, at_once = max(usages.values(), key=lambda u: u.queue_time_s), min(usages.values(), key=lambda u: u.queue_time_s)
    assert at_once.queue_time_s < waited.queue_time_s  # one waited while the other held the slot for 24 steps
    assert waited.queue_time_s > 0


def test_a_cancelled_request_leaves_its_slot_at_the_next_step(tiny_pair):
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=2, max_queue=4)

    async def start_then_leave():
        budget = backend.loop.worker.max_context - 3 - 10
        stream = backend.stream(CompletionRequest("gone", [5, 6, 7], max_tokens=budget))
        first = await stream.__anext__()
        assert first.error is None and first.finish_reason is None
        running = backend.loop.worker.engine.running
        await stream.aclose()
        deadline = time.monotonic() + 5
        while backend.loop.worker.engine.running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return running, backend.loop.worker.engine.running

    try:
        before, after = asyncio.run(start_then_leave())
    finally:
        asyncio.run(backend.close())
    assert (before, after) == (1, 0)


def test_a_request_that_does_not_fit_or_names_another_version_is_refused(tiny_pair):
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=1, max_queue=1, max_context=64)
    try:
        too_long = asyncio.run(_collect(backend, CompletionRequest("long", [5] * 60, max_tokens=8)))
        other = asyncio.run(_collect(backend, CompletionRequest("v", [5], max_tokens=2, drafter_version="v0009")))
    finally:
        asyncio.run(backend.close())
    assert too_long[0].error.status == 400 and "exceeds the context of 64" in too_long[0].error.message
    assert other[0].error.status == 400 and other[0].error.param == "speculative.drafter_version"


def test_a_request_naming_another_version_is_decoded_by_that_version_beside_the_champion(tiny_pair, verifier, tmp_path):
    from specloop.services.registry.registry import Registry
    from tests.worker_helpers import base_weights, noisy, publish

    reg = Registry(tmp_path / "registry")
    v1 = publish(reg, base_weights(tiny_pair[1]), None, 0.5)
    v2 = publish(reg, noisy(base_weights(tiny_pair[1]), 0.3, seed=1), v1, 0.6)
    assert reg.promote(v1).promoted and reg.promote(v2).promoted
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=2, max_queue=8, registry=str(tmp_path / "registry"))
    prompt = verifier.tokenizer.encode("def main", add_special_tokens=False)
    named = [CompletionRequest(f"n{i}", prompt, max_tokens=12, k=3, temperature=0.9, seed=i, drafter_version=v)
             for i, v in enumerate([v1, v2, None, v1])]

    async def together():
        return await asyncio.gather(*(_collect(backend, r) for r in named),
                                    _collect(backend, CompletionRequest("bad", prompt, max_tokens=2, drafter_version="v0077")))

    try:
        *results, unknown = asyncio.run(together())
    finally:
        asyncio.run(backend.close())
    builder = backend.loop.worker.builder
    rule = StopRule(verifier.eos_ids)
    for r, chunks in zip(named, results):
        version = r.drafter_version or v2
        assert chunks[-1].usage.drafter_version == version
        alone = generate(verifier.lean, builder.build(reg.load_weights(version)), [r.prompt_ids], r.sampling(), r.k, rule)[0]
        assert [t for c in chunks for t in c.token_ids] == alone.token_ids
    assert unknown[0].error.status == 404 and unknown[0].error.param == "speculative.drafter_version"


def test_a_request_naming_a_version_with_non_finite_weights_is_a_409_and_never_decoded(tiny_pair, verifier, tmp_path):
    """The gate refused it; a client naming it gets a 409 rather than garbage tokens at T > 0."""
    from specloop.services.registry.registry import Registry
    from tests.worker_helpers import base_weights, publish

    reg = Registry(tmp_path / "registry")
    v1 = publish(reg, base_weights(tiny_pair[1]), None, 0.5)
    bad = base_weights(tiny_pair[1])
    bad[next(n for n in bad if "mlp" in n)][0, 0] = float("nan")
    v2 = publish(reg, bad, v1, 0.9)
    assert reg.promote(v1).promoted and not reg.promote(v2).promoted
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=1, max_queue=4, registry=str(tmp_path / "registry"))
    try:
        chunks = asyncio.run(_collect(backend, CompletionRequest("nan", [5, 6], max_tokens=4, temperature=1.0,
                                                                 drafter_version=v2)))
    finally:
        asyncio.run(backend.close())
    assert len(chunks) == 1 and not chunks[0].token_ids
    err = chunks[0].error
    assert (err.status, err.code, err.param) == (409, "version_not_servable", "speculative.drafter_version")
    assert "non-finite" in err.message


def test_logprobs_come_one_per_streamed_token_as_the_verifier_alone_scores_them(tiny_pair, verifier):
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest
    from specloop.services.protocol import Chunk

    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=3, max_queue=8)
    prompt = verifier.tokenizer.encode("def main", add_special_tokens=False)
    requests = [CompletionRequest("greedy", prompt, max_tokens=12, k=3, logprobs=4),
                CompletionRequest("sampled", prompt, max_tokens=12, k=2, temperature=0.8, seed=1, logprobs=0),
                CompletionRequest("plain", prompt, max_tokens=12, k=2)]
    results = dict(zip([r.id for r in requests], _serve_all(backend, requests)))
    for rid, chunks in results.items():
        for c in chunks:
            assert Chunk.from_dict(c.to_dict()) == c  # through the actor boundary
            if rid == "plain":
                assert c.logprobs is None
            else:
                assert [e.token_id for e in c.logprobs] == c.token_ids
                assert all(len(e.top) == requests[rid == "sampled"].logprobs for e in c.logprobs)
    engine = Engine(verifier.lean, None, 1, 64, StopRule(verifier.eos_ids))
    engine.admit([EngineRequest("ref", prompt, requests[0].sampling(), 0, logprobs=4)])
    reference = None
    while reference is None:
        reference = next((u.generation.logprobs for u in engine.step() if u.generation is not None), None)
    served = [e for c in results["greedy"] for e in c.logprobs]
    assert [e.token_id for e in served] == [s.token_id for s in reference]
    assert all(e.top[0][0] == e.token_id for e in served)
    for e, s in zip(served, reference):
        assert abs(e.logprob - s.logprob) < 1e-4 and [t for t, _ in e.top] == [t for t, _ in s.top]


def test_logprobs_outside_0_to_20_are_refused(tiny_pair):
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=1, max_queue=2)
    try:
        refused = [asyncio.run(_collect(backend, CompletionRequest(f"x{n}", [5, 6], max_tokens=2, logprobs=n)))
                   for n in (-1, 21)]
        ok = asyncio.run(_collect(backend, CompletionRequest("ok", [5, 6], max_tokens=2, logprobs=20)))
    finally:
        asyncio.run(backend.close())
    for chunks in refused:
        assert chunks[0].error.status == 400 and chunks[0].error.param == "logprobs"
    assert ok[-1].finish_reason is not None and all(len(e.top) == 20 for c in ok for e in c.logprobs)


def test_a_prompt_is_scored_in_its_own_first_chunk_and_max_tokens_0_only_scores(tiny_pair, verifier):
    from specloop.drafter.decode.logprobs import prompt_scores

    prompt = verifier.tokenizer.encode("def main():", add_special_tokens=False)
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=1, max_queue=4)
    try:
        both = asyncio.run(_collect(backend, CompletionRequest("a", prompt, max_tokens=3, k=2, prompt_logprobs=2)))
        only = asyncio.run(_collect(backend, CompletionRequest("b", prompt, max_tokens=0, prompt_logprobs=0)))
        nothing = asyncio.run(_collect(backend, CompletionRequest("c", prompt, max_tokens=0)))  # an echo's sibling
        refused = asyncio.run(_collect(backend, CompletionRequest("x", prompt, max_tokens=2, prompt_logprobs=21)))
    finally:
        asyncio.run(backend.close())
    expected = prompt_scores(verifier.lean, prompt, 2)
    first = both[0]
    assert first.token_ids == [] and [e.token_id for e in first.prompt_logprobs] == prompt[1:]
    assert [round(e.logprob, 5) for e in first.prompt_logprobs] == [round(s.logprob, 5) for s in expected]
    assert all(len(e.top) == 2 for e in first.prompt_logprobs) and both[-1].usage.completion_tokens == 3
    (alone,) = only  # no slot, no step: one chunk that ends the request
    assert alone.finish_reason == "length" and alone.usage.completion_tokens == 0 and alone.token_ids == []
    assert [e.top for e in alone.prompt_logprobs] == [[]] * (len(prompt) - 1)
    (empty,) = nothing
    assert empty.finish_reason == "length" and empty.prompt_logprobs is None and empty.usage.completion_tokens == 0
    assert refused[0].error.param == "prompt_logprobs"


def _versions(tiny_pair, tmp_path, n: int) -> list[str]:
    from specloop.services.registry.registry import Registry
    from tests.worker_helpers import base_weights, noisy, publish

    reg, parent, out = Registry(tmp_path / "registry"), None, []
    for i in range(n):
        parent = publish(reg, noisy(base_weights(tiny_pair[1]), 0.1, seed=i), parent, 0.5 + i / 100)
        out.append(parent)
    return out


def test_two_versions_admitted_in_one_pass_with_keep_1_are_both_served(tiny_pair, verifier, tmp_path):
    """Before, the second version's load evicted the first one's engine between choosing its requests
    and admitting them: a spurious 400 naming the version."""
    v1, v2 = _versions(tiny_pair, tmp_path, 2)
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=1, max_queue=8, max_versions=1,
                                registry=str(tmp_path / "registry"))
    requests = [CompletionRequest(f"r{i}", [5, 6, 7], max_tokens=4, k=2, drafter_version=v)
                for i, v in enumerate([v1, v2, v1, v2])]
    results = _serve_all(backend, requests)
    for r, chunks in zip(requests, results):
        assert chunks[-1].error is None, chunks[-1].error
        assert chunks[-1].usage.drafter_version == r.drafter_version
    assert backend.loop.pinned.peak == 1


def test_engines_and_loads_stay_within_keep_and_a_load_nobody_waits_for_is_dropped(tiny_pair, tmp_path):
    versions = _versions(tiny_pair, tmp_path, 4)
    backend = LocalBackend.open(tiny_pair[0], tiny_pair[1], slots=1, max_queue=16, max_versions=2,
                                registry=str(tmp_path / "registry"))
    pinned = backend.loop.pinned

    async def scenario():
        gone = asyncio.ensure_future(_collect(backend, CompletionRequest("gone", [5], max_tokens=4, k=2,
                                                                         drafter_version=versions[3])))
        await asyncio.sleep(0.05)
        gone.cancel()  # its client leaves while the version may still be loading
        served = await asyncio.gather(*(_collect(backend, CompletionRequest(f"r{i}", [5, 6], max_tokens=4, k=2,
                                                                           drafter_version=v))
                                        for i, v in enumerate(versions[:3] * 2)))
        for _ in range(100):  # the serving loop settles the cancelled load at its next admission pass
            if not pinned.loading:
                break
            await asyncio.sleep(0.05)
            await _collect(backend, CompletionRequest("poke", [5], max_tokens=1, k=0))
        return served

    try:
        served = asyncio.run(scenario())
    finally:
        asyncio.run(backend.close())
    assert all(chunks[-1].error is None for chunks in served)
    assert pinned.peak <= 2 and len(pinned.engines) + len(pinned.loading) <= 2
    assert not pinned.loading and not pinned.failures
