"""The learner service without Ray: it seeds the registry, trains on the buffer's records, publishes
and promotes through the gate, acknowledges only what a durable version used, hands a dead
learner's pending records to the next one, keeps training while pinned and shrugs off bad payloads.
Records come from a real VerifierWorker serving the tiny pair; Redis tests use 127.0.0.1:6379."""
from __future__ import annotations

import time
from uuid import uuid4

import httpx
import pytest
import redis
import torch

from specloop.services.buffer.memory import MemoryBuffer
from specloop.services.buffer.redis_stream import RedisStreamBuffer
from specloop.services.learner.learner import LearnerService, LearnerServiceConfig
from specloop.services.protocol import CompletionRequest
from specloop.services.registry.registry import Registry
from specloop.services.worker.worker import ServeResult, VerifierWorker, WorkerConfig
from specloop.trainer.objectives import ObjectiveConfig
from specloop.trainer.online import LearnerConfig
from specloop.trainer.records import decode
from tests.redis_helpers import REDIS_URL, needs_redis
from tests.tiny import TEXT

PUBLISH_EVERY = 5
BATCH = 8


def filled(payloads: list[bytes]) -> MemoryBuffer:
    """A memory buffer holding `payloads`, in order."""
    buffer = MemoryBuffer()
    for p in payloads:
        buffer.append(p)
    return buffer


def make_service(tiny_pair, registry, buffer, consumer: str = "learner-0", **service) -> LearnerService:
    learner = LearnerConfig(kind="pretrained", objective=ObjectiveConfig(name="kl"), lr=3e-3, lm_lr=3e-3,
                            batch_records=BATCH, publish_every=PUBLISH_EVERY, replay_ratio=16.0, holdout_every=4)
    cfg = LearnerServiceConfig(verifier=str(tiny_pair[0]), drafter=str(tiny_pair[1]), registry=str(registry),
                               learner=learner, consumer=consumer, read_count=8, read_block_ms=5, **service)
    return LearnerService(cfg, buffer)


def step_until(service: LearnerService, done, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if done():
            return
        service.step()
    raise AssertionError(f"condition not reached in {max_steps} steps: {service.stats()}")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture
def redis_buffers():
    """Opens RedisStreamBuffers on one unique prefix (one stream, several clients) and deletes its keys."""
    prefix, opened = f"test-learner-{uuid4().hex}", []

    def make() -> RedisStreamBuffer:
        opened.append(RedisStreamBuffer(REDIS_URL, prefix=prefix))
        return opened[-1]

    yield make
    for buf in opened:
        buf.close()
    admin = redis.Redis.from_url(REDIS_URL)
    admin.delete(*admin.keys(f"{prefix}:*") or [f"{prefix}:replay"])
    admin.close()


# ---------------------------------------------------------------- seeding, training, publishing, acks


def test_a_learner_on_a_fresh_registry_seeds_it_with_the_base_version_as_champion(tiny_pair, tmp_path):
    service = make_service(tiny_pair, tmp_path / "registry", MemoryBuffer())
    registry = Registry(tmp_path / "registry")
    [base] = registry.list()
    assert (base.id, base.objective, base.parent, base.learner_step) == ("v0001", "base", None, 0)
    assert registry.champion() == "v0001"
    assert same_weights(registry.load_weights("v0001"), service.learner.weights())
    assert all(name.startswith("lm.") for name in service.learner.weights())

    again = make_service(tiny_pair, tmp_path / "registry", MemoryBuffer())  # a restart does not seed twice
    assert [v.id for v in registry.list()] == ["v0001"]
    assert again.learner.versions[-1] == "v0001"


def test_a_learner_whose_versions_lost_their_weights_seeds_a_new_champion_instead_of_failing(tiny_pair, tmp_path):
    """The registry's records outlived its weight files (a deleted cache folder while Redis kept its
    keys): the learner starts anyway, publishes the base weights as a new version and promotes it."""
    make_service(tiny_pair, tmp_path / "registry", MemoryBuffer())
    registry = Registry(tmp_path / "registry")
    (registry._folder("v0001") / "weights.safetensors").unlink()
    service = make_service(tiny_pair, tmp_path / "registry", MemoryBuffer())
    assert [v.id for v in registry.list()] == ["v0001", "v0002"]
    assert registry.champion() == "v0002" and service.learner.versions[-1] == "v0002"
    assert same_weights(registry.load_weights("v0002"), service.learner.weights())


def test_training_publishes_every_publish_every_updates_and_acks_entries_only_after_a_publish(
    tiny_pair, tmp_path, payloads
):
    buffer = filled(payloads)
    service = make_service(tiny_pair, tmp_path / "registry", buffer)
    registry = Registry(tmp_path / "registry")

    publishes = 0
    while publishes < 3:
        service.step()
        pending = buffer.stats().pending
        if len(service.published) == publishes:  # nothing durable since the last publish: what it read is pending
            assert pending == len(service.unacked)
            assert publishes or pending > 0
            continue
        publishes = len(service.published)
        # the publish acked what the version used or let go of: only records still waiting for an
        # update stay pending
        assert pending == len(service.unacked) < service.learner.seen
        assert set(service.unacked) <= service.learner.in_pools() and not service.learner.trained
        assert service.learner.updates == PUBLISH_EVERY * publishes

    versions = registry.list()
    assert [v.learner_step for v in versions] == [0, 5, 10, 15]
    assert all(v.objective == "kl" and v.sim_acceptance is not None for v in versions[1:])
    promoted = [e.version for e in service.published if e.promoted]
    assert promoted, service.published  # the kl objective on repeated greedy traffic beats the base drafter
    assert registry.champion() == promoted[-1]
    for event, info in zip(service.published, versions[1:]):
        assert info.extra["baseline"]["version"] == info.parent  # the candidate was compared with the champion
        assert event.promoted == (event.sim_acceptance >= event.baseline)

    # the entries read after the last publish are the only pending ones
    service.step()
    assert buffer.stats().pending == len(service.unacked)


@needs_redis
def test_a_killed_learners_pending_records_go_to_the_next_learner_which_resumes_from_the_champion(
    tiny_pair, tmp_path, payloads, redis_buffers
):
    writer = redis_buffers()
    for p in payloads:
        writer.append(p)
    assert writer.flush(timeout=10) and writer.stats().written == len(payloads)

    a_buffer = redis_buffers()
    a = make_service(tiny_pair, tmp_path / "registry", a_buffer, consumer="learner-a")
    step_until(a, lambda: len(a.published) == 1)  # noqa: F821 - deleted after the last use (ruff reads the del as unbinding it)
    acked_by_a = a.learner.seen - len(a.unacked)  # what the published version used or let go of
    step_until(a, lambda: a.learner.updates >= PUBLISH_EVERY + 3)  # more reads and updates, no second publish  # noqa: F821 - deleted after the last use (ruff reads the del as unbinding it)
    assert len(a.published) == 1 and a.unacked
    read_by_a = a.learner.seen
    assert writer.stats().pending == len(a.unacked) == read_by_a - acked_by_a
    newest = Registry(tmp_path / "registry").champion()
    del a  # killed: it never publishes or acks again (its client stays open, as a hung process's would)

    time.sleep(0.1)
    b = make_service(tiny_pair, tmp_path / "registry", redis_buffers(), consumer="learner-b", claim_idle_ms=50)
    assert b.learner.seen == read_by_a - acked_by_a  # exactly A's pending entries, claimed at start
    assert b.learner.updates == 0
    registry = Registry(tmp_path / "registry")
    assert same_weights(b.learner.weights(), registry.load_weights(newest))
    assert not same_weights(b.learner.weights(), registry.load_weights("v0001"))

    step_until(b, lambda: acked_by_a + b.learner.seen == len(payloads))  # B read the rest of the stream
    published = len(b.published)
    step_until(b, lambda: len(b.published) > published)
    assert writer.stats().pending == len(b.unacked) and set(b.unacked) <= b.learner.in_pools()
    assert acked_by_a + b.learner.seen == len(payloads)  # nothing lost, nothing delivered twice


def test_pinning_stops_promotion_while_the_learner_keeps_training(tiny_pair, tmp_path, payloads):
    buffer = filled(payloads)
    service = make_service(tiny_pair, tmp_path / "registry", buffer)
    registry = Registry(tmp_path / "registry")
    step_until(service, lambda: len(service.published) == 1)
    champion = registry.pin()
    updates, published = service.learner.updates, len(service.published)

    step_until(service, lambda: len(service.published) >= published + 3)
    refused = service.published[published:]
    assert all(not e.promoted and "pinned" in e.reason for e in refused), refused
    assert registry.champion() == registry.pinned() == champion
    assert service.learner.updates >= updates + 3 * PUBLISH_EVERY
    assert len(registry.list()) == 1 + len(service.published)  # refused versions are still published

    registry.unpin()
    published = len(service.published)
    step_until(service, lambda: any(e.promoted for e in service.published[published:]))
    assert registry.champion() != champion


def test_a_malformed_payload_is_counted_and_acknowledged_and_never_stops_the_learner(tiny_pair, tmp_path, payloads):
    buffer = MemoryBuffer()
    buffer.append(b"not a replay record")
    for p in payloads[:20]:
        buffer.append(p)
    buffer.append(payloads[0][: len(payloads[0]) // 2])  # truncated
    for p in payloads[20:]:
        buffer.append(p)
    service = make_service(tiny_pair, tmp_path / "registry", buffer)
    service.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (len(service.published) < 2 or service.learner.seen < len(payloads)):
            time.sleep(0.05)
    finally:
        stats = service.stop()
    assert stats.error is None
    assert stats.bad_records == 2
    assert service.learner.seen == len(payloads)  # every valid record was read
    assert len(stats.published) >= 2 and service.learner.updates >= 2 * PUBLISH_EVERY
    service.publish()  # acks what the thread's updates used after its last publish
    left = buffer.claim_stale("another-learner", 0)  # what is left to retry: records waiting for an update
    assert len(left) == len(service.unacked) == buffer.stats().pending
    assert all(decode(e.payload) for e in left)  # the malformed payloads were acknowledged, never retried


def test_the_learner_exports_updates_loss_lag_buffer_and_the_gate_as_prometheus_metrics(tiny_pair, tmp_path, payloads):
    from prometheus_client.parser import text_string_to_metric_families

    from specloop.services.metrics.export import stop_metrics

    buffer = filled(payloads)
    service = make_service(tiny_pair, tmp_path / "registry", buffer)
    step_until(service, lambda: len(service.published) == 1)
    address = service.serve_metrics()
    try:
        assert service.serve_metrics() == address == service.stats().metrics_url
        text = httpx.get(f"http://{address}/metrics", timeout=5).text
    finally:
        stop_metrics(address)
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert values["specloop:learner_updates_total"] == PUBLISH_EVERY
    assert values["specloop:learner_loss"] == pytest.approx(service.losses[-1])
    drafted_by = decode(payloads[-1]).drafter_version  # a worker without a registry: "base", older than v0001
    assert values["specloop:learner_lag_versions"] == (0 if drafted_by == "v0001" else 1)
    assert values["specloop:learner_record_age_seconds_count"] == PUBLISH_EVERY
    assert values["specloop:buffer_depth"] == len(payloads)
    assert values["specloop:learner_versions_published_total"] == 1
    assert values["specloop:promotions_total"] + values["specloop:promotion_refusals_total"] == 1
    assert values["specloop:promotions_total"] == service.published[0].promoted


def test_a_new_learner_resumes_from_the_champion_not_a_rolled_back_or_unreadable_version(tiny_pair, tmp_path, payloads):
    """The newest version was rolled back: the next learner starts from the champion. With the
    champion's file truncated too, the next one still starts, from the newest version that reads."""
    buffer = filled(payloads)
    a = make_service(tiny_pair, tmp_path / "registry", buffer)
    step_until(a, lambda: len(a.published) == 2)
    registry = Registry(tmp_path / "registry")
    *older, newest = [v.id for v in registry.list()]
    registry.promote(newest, force=True)
    champion = registry.rollback("live acceptance fell", expected=newest)
    assert champion != newest
    b = make_service(tiny_pair, tmp_path / "registry", MemoryBuffer(), consumer="learner-b")
    assert same_weights(b.learner.weights(), registry.load_weights(champion))
    assert not same_weights(b.learner.weights(), registry.load_weights(newest))

    (tmp_path / "registry" / "versions" / champion / "weights.safetensors").write_bytes(b"\x08\x00\x00")  # truncated
    readable = next(v for v in reversed([*older, newest]) if v != champion)
    c = make_service(tiny_pair, tmp_path / "registry", MemoryBuffer(), consumer="learner-c")
    assert same_weights(c.learner.weights(), registry.load_weights(readable))


def test_a_non_finite_loss_is_skipped_and_never_publishes(tiny_pair, tmp_path, payloads):
    buffer = filled(payloads)
    service = make_service(tiny_pair, tmp_path / "registry", buffer)
    registry = Registry(tmp_path / "registry")
    step_until(service, lambda: len(service.published) == 1)  # updates == PUBLISH_EVERY: "due" until the next one
    versions, updates = len(registry.list()), service.learner.updates
    service.learner.load_weights({n: torch.full_like(t, float("nan")) for n, t in service.learner.weights().items()})
    for _ in range(10):
        service.step()
    assert service.learner.updates == updates and len(service.published) == 1 and len(registry.list()) == versions
    skipped = service.metrics.registry.get_sample_value("specloop:learner_skipped_updates_total")
    assert skipped >= 10
    assert service.publish() is None and len(registry.list()) == versions  # non-finite weights: never published
    assert same_weights(service.learner.weights(), registry.load_weights(registry.champion()))


def test_a_dead_consumers_entries_are_claimed_while_the_learner_runs_not_only_at_start(tiny_pair, tmp_path, payloads):
    buffer = filled(payloads[:10])
    assert len(buffer.read("dead-learner", 100)) == 10  # read, never acknowledged
    t0 = time.monotonic()
    service = make_service(tiny_pair, tmp_path / "registry", buffer, claim_idle_ms=3000, claim_every_s=0.05)
    if time.monotonic() - t0 < 2.5:  # (a loaded machine can take longer than that to build the service)
        assert service.learner.seen == 0  # not idle long enough at start: still the dead consumer's
    time.sleep(max(0.0, 3.1 - (time.monotonic() - t0)))
    service.step()
    assert service.learner.seen == 10 and len(service.unacked) == 10


def test_the_learner_keeps_the_registry_bounded(tiny_pair, tmp_path, payloads):
    buffer = filled(payloads)
    service = make_service(tiny_pair, tmp_path / "registry", buffer, keep_versions=2)
    step_until(service, lambda: len(service.published) == 4)
    registry = Registry(tmp_path / "registry")
    alias = registry.alias()
    kept = {v.id for v in registry.list()}
    assert len(kept) <= 2 + 1 + 2 and {alias.champion, *alias.history} <= kept  # newest 2, champion, rollback history
    assert "v0001" not in kept and len(list((tmp_path / "registry" / "versions").iterdir())) == len(kept)


def _serve_with(registry_dir, tiny_pair, buffer, n: int, start: int = 0) -> list[ServeResult]:
    """A worker on the registry serving n greedy requests (its records go to `buffer`)."""
    worker = VerifierWorker(WorkerConfig(str(tiny_pair[0]), str(tiny_pair[1]), "pretrained", registry=str(registry_dir),
                                         poll_interval_s=0.0), buffer)
    tok = worker.verifier.tokenizer
    prompts = [tok.encode(text[s : s + 20]) for text in TEXT for s in (0, 15, 30)]
    try:
        return [worker.serve(CompletionRequest(f"c{start + i}", prompts[i % len(prompts)], max_tokens=32, k=4,
                                               stream_index=start + i)) for i in range(n)]
    finally:
        worker.close()


@pytest.mark.parametrize("scale, rolled_back", [(0.0, True), (1.0, False)])
def test_a_promoted_version_is_judged_against_its_predecessor_on_the_same_live_records(
        tiny_pair, tmp_path, scale, rolled_back):
    """An operator promotes a zeroed drafter (scale 0) or a copy of the champion (scale 1); the learner's
    canary scores both versions on the records the new one drafted: the zeroed one is rolled back
    (once, from that version), the copy stays."""
    buffer = MemoryBuffer()
    # seeds v0001 (the base drafter); no updates, so that no publish of its own moves the champion on
    service = make_service(tiny_pair, tmp_path / "registry", buffer, updates_per_read=0)
    registry = Registry(tmp_path / "registry")
    v1 = registry.champion()
    service.step()  # reads the alias
    weights = {n: t * scale for n, t in registry.load_weights(v1).items()}
    v2 = registry.publish(weights, parent=v1, learner_step=0, objective="operator", loss=None, sim_acceptance=None,
                          kind="pretrained").id
    assert registry.promote(v2, force=True).promoted
    time.sleep(1.1)  # the learner reads the alias once a second
    service.step()
    assert service.canary is not None and (service.canary.version, service.canary.predecessor) == (v2, v1)
    _serve_with(tmp_path / "registry", tiny_pair, buffer, 24)
    step_until(service, lambda: service.verdicts)
    verdict = service.verdicts[0]
    print(f"scale {scale}: {verdict}")
    # decided on the first 64 blocks the new version drafted (the target: within 256)
    assert verdict.version == v2 and verdict.rolled_back == rolled_back and verdict.records <= 256
    assert registry.champion() == (v1 if rolled_back else v2)
    if rolled_back:
        assert verdict.sim_acceptance < verdict.predecessor_sim_acceptance - 0.05
        assert [e["event"] for e in registry.events()].count("rollback") == 1
        assert same_weights(service.learner.weights(), registry.load_weights(v1))  # restarts from the champion


def test_a_periodic_claim_never_reads_the_learners_own_waiting_entries_twice(tiny_pair, tmp_path, payloads):
    buffer = filled(payloads)
    service = make_service(tiny_pair, tmp_path / "registry", buffer, claim_idle_ms=0, claim_every_s=0.0)
    step_until(service, lambda: len(service.published) == 2)
    for _ in range(5):
        service.step()  # each step claims every pending entry, its own included
    assert len(service.unacked) == len(set(service.unacked)) and service.learner.seen <= len(payloads)


def test_an_operator_rollback_resets_the_learner_to_the_champion(tiny_pair, tmp_path, payloads):
    """After `drafter rollback` the learner's next candidates descend from the champion rolled back to,
    not from the line the operator rolled away from."""
    registry = Registry(tmp_path / "registry")
    service = make_service(tiny_pair, tmp_path / "registry", filled(payloads))
    v1 = registry.champion()
    step_until(service, lambda: registry.champion() != v1)  # the learner's own version was promoted
    assert not same_weights(service.learner.weights(), registry.load_weights(v1))
    service.cfg.updates_per_read = 0  # from here on it only watches
    registry.rollback("operator: back to the base")
    time.sleep(1.1)  # the learner reads the alias once a second
    service.step()
    assert registry.champion() == v1
    assert same_weights(service.learner.weights(), registry.load_weights(v1))


def test_a_learner_restarted_after_a_promotion_still_judges_it(tiny_pair, tmp_path):
    """The canary's state is the registry's event log: a promotion with no verdict logged is watched
    by the next learner to start, and its verdict is logged (so a third learner owes none)."""
    buffer = MemoryBuffer()
    first = make_service(tiny_pair, tmp_path / "registry", buffer, updates_per_read=0)
    registry = Registry(tmp_path / "registry")
    v1 = registry.champion()
    zeroed = {n: t * 0 for n, t in registry.load_weights(v1).items()}
    v2 = registry.publish(zeroed, parent=v1, learner_step=0, objective="operator", loss=None, sim_acceptance=None,
                          kind="pretrained").id
    assert registry.promote(v2, force=True).promoted
    del first  # the learner dies before it ever read the alias
    second = make_service(tiny_pair, tmp_path / "registry", buffer, updates_per_read=0)
    second.step()
    assert second.canary is not None and (second.canary.version, second.canary.predecessor) == (v2, v1)
    _serve_with(tmp_path / "registry", tiny_pair, buffer, 24)
    step_until(second, lambda: second.verdicts)
    assert second.verdicts[0].rolled_back and registry.champion() == v1
    third = make_service(tiny_pair, tmp_path / "registry", buffer, updates_per_read=0)
    third.step()
    assert third.canary is None
    assert [e["event"] for e in registry.events()].count("canary") == 1
