"""services/actors.py on real Ray: a learner whose process dies is restarted by Ray and trains on."""
from __future__ import annotations

import time

import pytest
import ray

from services.actors import BufferHost, LearnerActor
from tests.test_learner import payloads  # noqa: F401 - the fixture: records a real worker logged
from trainer.objectives import ObjectiveConfig
from trainer.online import LearnerConfig


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


def test_a_learner_whose_process_dies_is_restarted_and_trains_on(local_ray, tiny_pair, tmp_path, payloads):  # noqa: F811
    host = BufferHost.remote(100_000)
    ray.get([host.append.remote(p) for p in payloads])
    learner_cfg = LearnerConfig(kind="pretrained", objective=ObjectiveConfig(name="kl"), batch_records=8,
                                publish_every=5, replay_ratio=16.0)
    cfg = {"verifier": str(tiny_pair[0]), "drafter": str(tiny_pair[1]), "registry": str(tmp_path / "registry"),
           "learner": learner_cfg.to_dict(), "read_count": 8, "claim_idle_ms": 200}
    learner = LearnerActor.remote(cfg, "memory", host)
    ray.get(learner.start.remote())
    before = wait_for(lambda: (s := ray.get(learner.stats.remote(), timeout=10))["learner"]["updates"] >= 3 and s)

    ray.kill(learner, no_restart=False)  # the process dies; Ray may bring it back
    ray.get([host.append.remote(p) for p in payloads])
    stats = wait_for(lambda: (s := ray.get(learner.stats.remote(), timeout=10))["learner"]["updates"] >= 3 and s)
    assert stats["pid"] != before["pid"] and stats["error"] is None and stats["champion"] is not None
