"""services/learner/canary.py: which records a canary keeps, and when it calls for a rollback."""
from types import SimpleNamespace

from specloop.services.learner.canary import Canary, CanaryConfig


def record(version: str):
    return SimpleNamespace(drafter_version=version)


def test_a_canary_keeps_only_the_watched_versions_records_up_to_its_sample():
    canary = Canary("v0005", "v0004", CanaryConfig(records=3))
    for version in ["v0004", "v0005", "base", "v0005", "v0005", "v0005"]:
        canary.offer(record(version))
        assert canary.ready == (len(canary.records) == 3)
    assert [r.drafter_version for r in canary.records] == ["v0005"] * 3 and canary.ready


def test_the_verdict_rolls_back_only_a_version_clearly_below_its_predecessor():
    canary = Canary("v0005", "v0004", CanaryConfig(records=4, margin=0.05, z=3.0))
    canary.records = [record("v0005")] * 4
    same = [[1.0, 0.0], [1.0], [0.0, 1.0, 1.0], [1.0]]
    assert canary.verdict(same, same) is None
    assert canary.verdict([[0.5]] * 4, [[0.54]] * 4) is None  # within the margin: drift moves both alike
    assert canary.verdict([[0.9]] * 4, [[0.2]] * 4) is None  # better
    noisy_old, noisy_new = [[1.0], [1.0], [0.0], [1.0]], [[0.0], [1.0], [1.0], [0.5]]  # 0.75 vs 0.625, by noise
    assert canary.verdict(noisy_new, noisy_old) is None
    reason = canary.verdict([[0.1, 0.0]] * 4, [[0.6, 0.7]] * 4)
    assert "v0005" in reason and "v0004" in reason and "0.050" in reason and "4 live records" in reason
