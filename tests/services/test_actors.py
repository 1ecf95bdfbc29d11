"""services/actors.py on real Ray: a learner whose process dies is restarted by Ray and trains on."""
from __future__ import annotations

import time

import pytest
import ray

from specloop.services.actors import BufferHost, LearnerActor
from specloop.trainer.objectives import ObjectiveConfig
from specloop.trainer.online import LearnerConfig


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()


def wait_for(probe, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = probe()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_a_learner_whose_process_dies_is_restarted_and_trains_on(local_ray, tiny_pair, tmp_path, payloads):
    host = BufferHost.remote(100_000)
    ray.get([host.append.remote(p) for p in payloads])
    learner_cfg = LearnerConfig(kind="pretrained", objective=ObjectiveConfig(name="kl"), batch_records=8,
                                publish_every=5, replay_ratio=16.0)
    cfg = {"verifier": str(tiny_pair[0]), "drafter": str(tiny_pair[1]), "registry": str(tmp_path / "registry"),
           "learner": learner_cfg.to_dict(), "read_count": 8, "claim_idle_ms": 200}
    learner = LearnerActor.remote(cfg, "memory", host)
    ray.get(learner.start.remote())
    before = wait_for(lambda: (s := ray.get(learner.stats.remote(), timeout=10)).learner.updates >= 3 and s)

    ray.kill(learner, no_restart=False)  # the process dies; Ray may bring it back
    ray.get([host.append.remote(p) for p in payloads])
    stats = wait_for(lambda: (s := ray.get(learner.stats.remote(), timeout=10)).learner.updates >= 3 and s)
    assert stats.pid != before.pid and stats.error is None and stats.champion is not None


@ray.remote(num_cpus=0)
class SlowWorker:
    """A worker that answers `load` after `delay` seconds (a hung or overloaded one)."""

    def __init__(self, delay: float, queued: int):
        self.delay, self.queued = delay, queued

    def load(self) -> dict:
        time.sleep(self.delay)
        return {"queued": self.queued, "running": 0, "slots": 1, "max_queue": 8, "version": "base"}

    def info(self) -> dict:
        return {"name": "slow", "verifier": "-", "model": "m", "drafter_kind": "pretrained", "drafter_version": "base",
                "max_context": 64, "slots": 1, "max_queue": 8}

    def ready(self) -> bool:
        return True


def test_the_api_never_waits_on_ray_on_its_event_loop_and_routes_past_a_hung_worker(local_ray):
    """Discovery runs on a thread, the view of the workers is cached, and routing takes the workers
    that answer within PICK_WAIT_S: a worker whose `load` hangs costs a request no more than that,
    even though it would be the least loaded, and the event loop keeps ticking meanwhile."""
    import asyncio
    import threading

    from specloop.services.actors import NAMESPACE, WORKER_PREFIX
    from specloop.services.cluster import PICK_WAIT_S, RayBackend

    options = dict(namespace=NAMESPACE, lifetime=None)
    hung = SlowWorker.options(name=WORKER_PREFIX + "hung", **options).remote(30.0, 0)
    fast = SlowWorker.options(name=WORKER_PREFIX + "fast", **options).remote(0.0, 5)
    ray.get([hung.ready.remote(), fast.ready.remote()])
    listed_on: list[str] = []
    real = ray.util.list_named_actors

    def spy(*args, **kwargs):  # the real call, noting which thread made it
        listed_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    async def scenario():
        backend, gaps, stop = RayBackend(), [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticks = asyncio.ensure_future(ticker())
        t0 = time.monotonic()
        picked = [await backend._pick() for _ in range(3)]
        picking_s = (time.monotonic() - t0) / 3
        workers = await backend.workers()
        stop.set()
        await ticks
        await backend.close()
        return picked, picking_s, workers, max(gaps)

    ray.util.list_named_actors = spy
    try:
        picked, picking_s, workers, gap = asyncio.run(scenario())
    finally:
        ray.util.list_named_actors = real
        for actor in (hung, fast):
            ray.kill(actor)
    assert all(p._actor_id == fast._actor_id for p in picked)  # the hung one's load never came
    assert picking_s < PICK_WAIT_S + 1.0 and gap < 0.25
    assert len(workers) == 2 and listed_on and threading.main_thread().name not in listed_on
