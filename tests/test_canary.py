"""services/canary.py: which records a canary keeps, and when it calls for a rollback."""
from types import SimpleNamespace

from services.canary import Canary, CanaryConfig


def record(version: str):
    return SimpleNamespace(drafter_version=version)


def test_a_canary_keeps_only_the_watched_versions_records_up_to_its_sample():
    canary = Canary("v0005", "v0004", CanaryConfig(records=3))
    for version in ["v0004", "v0005", "base", "v0005", "v0005", "v0005"]:
        canary.offer(record(version))
        assert canary.ready == (len(canary.records) == 3)
    assert [r.drafter_version for r in canary.records] == ["v0005"] * 3 and canary.ready


def test_the_verdict_rolls_back_only_a_version_clearly_below_its_predecessor():
    canary = Canary("v0005", "v0004", CanaryConfig(records=2, margin=0.05))
    canary.records = [record("v0005")] * 2
    assert canary.verdict(0.50, 0.54) is None  # within the margin: drift moves both alike
    assert canary.verdict(0.90, 0.20) is None  # better
    assert canary.verdict(None, 0.5) is None and canary.verdict(0.1, None) is None
    reason = canary.verdict(0.10, 0.60)
    assert "v0005" in reason and "v0004" in reason and "0.100" in reason and "2 live records" in reason
