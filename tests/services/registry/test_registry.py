import json
import logging
import math
import threading
import time
from uuid import uuid4

import pytest
import torch

from specloop.services.registry.meta import RedisMeta
from specloop.services.registry.registry import Registry
from specloop.services.registry.types import PromotionResult, RegistryError, VersionInfo
from tests.redis_helpers import needs_redis

REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_or_skip():
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379 (start it with scripts/redis.sh)")
    return client


@pytest.fixture(params=["folder", "redis"])
def make(request, tmp_path):
    """make() -> a Registry on one shared root (and, for redis, one shared prefix)."""
    root = tmp_path / "registry"
    if request.param == "folder":
        yield lambda: Registry(root)
        return
    client = _redis_or_skip()
    prefix = f"test-registry-{uuid4().hex}"
    yield lambda: Registry(root, redis_url=REDIS_URL, prefix=prefix)
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def reg(make):
    return make()


def _weights(seed=0, fill=None):
    g = torch.Generator().manual_seed(seed)
    w = {
        "embed.weight": torch.randn(7, 4, generator=g),
        "head.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "steps": torch.tensor([1, 2, 3], dtype=torch.int64),
    }
    if fill is not None:
        w["embed.weight"][2, 1] = fill
    return w


def _publish(reg, sim=0.5, seed=0, fill=None, parent=None, **kw):
    return reg.publish(
        _weights(seed, fill), parent=parent, learner_step=seed, objective="kl", loss=0.1, sim_acceptance=sim,
        kind="pretrained", **kw,
    )


# ---- versions


def test_publish_and_load_round_trip_tensors_exactly(reg):
    w = _weights(3)
    info = reg.publish(w, parent=None, learner_step=7, objective="base", loss=None, sim_acceptance=None,
                       kind="dvi", extra={"note": "x"})
    back = reg.load_weights(info.id)
    assert set(back) == set(w)
    for name, t in w.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    assert reg.get(info.id) == info
    assert (info.learner_step, info.objective, info.kind, info.extra) == (7, "base", "dvi", {"note": "x"})


def test_tied_tensors_are_stored(reg):
    shared = torch.randn(5, 3)
    info = reg.publish({"a": shared, "b": shared}, parent=None, learner_step=0, objective="base", loss=None,
                       sim_acceptance=None, kind="sd2")
    back = reg.load_weights(info.id)
    assert torch.equal(back["a"], shared) and torch.equal(back["b"], shared)


def test_ids_are_monotonic_and_list_is_oldest_first(reg):
    first = _publish(reg, seed=1)
    second = _publish(reg, seed=2, parent=first.id)
    third = _publish(reg, seed=3, parent=second.id)
    assert [first.id, second.id, third.id] == ["v0001", "v0002", "v0003"]
    assert [i.id for i in reg.list()] == ["v0001", "v0002", "v0003"]
    assert reg.get("v0003").parent == "v0002"


def test_publish_leaves_no_temporary_files_and_writes_info_json(reg):
    info = _publish(reg)
    folder = reg.root / "versions" / info.id
    assert sorted(p.name for p in folder.iterdir()) == ["info.json", "weights.safetensors"]
    assert not [p for p in reg.root.rglob("*") if p.name.endswith(".tmp")]
    assert json.loads((folder / "info.json").read_text())["id"] == info.id


def test_publishing_does_not_promote(reg):
    _publish(reg)
    assert reg.champion() is None


def test_version_info_round_trips_through_strict_json():
    info = VersionInfo("v0001", None, 1.5, 3, "lk", float("nan"), float("inf"), "sd2", {"a": 1})
    text = json.dumps(info.to_dict(), allow_nan=False)
    back = VersionInfo.from_dict(json.loads(text))
    assert math.isnan(back.loss) and back.sim_acceptance == float("inf") and back.extra == {"a": 1}


def test_unknown_version_and_unknown_parent_raise(reg):
    with pytest.raises(RegistryError, match="unknown version v0042"):
        reg.get("v0042")
    with pytest.raises(RegistryError, match="unknown version"):
        _publish(reg, parent="v0042")


# ---- promotion gate


def test_first_promote_makes_the_champion(reg):
    v = _publish(reg)
    result = reg.promote(v.id)
    assert isinstance(result, PromotionResult)
    assert result.promoted and result.champion == v.id and reg.champion() == v.id
    assert reg.previous_champions() == []


def test_first_promote_accepts_a_version_without_sim_acceptance(reg):
    v = _publish(reg, sim=None)
    assert reg.promote(v.id).promoted


def test_worse_sim_acceptance_is_refused_with_both_numbers(reg):
    good, worse = _publish(reg, sim=0.6), _publish(reg, sim=0.4)
    reg.promote(good.id)
    result = reg.promote(worse.id)
    assert not result.promoted and result.champion == good.id
    assert "0.4000" in result.reason and "0.6000" in result.reason
    assert reg.champion() == good.id


@pytest.mark.parametrize("sim", [0.6, 0.7])
def test_equal_or_better_sim_acceptance_is_promoted(reg, sim):
    old, new = _publish(reg, sim=0.6), _publish(reg, sim=sim)
    reg.promote(old.id)
    result = reg.promote(new.id)
    assert result.promoted and reg.champion() == new.id
    assert reg.previous_champions() == [old.id]


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("force", [False, True])
def test_non_finite_weights_are_refused_even_with_force(reg, fill, force):
    base = _publish(reg, sim=0.1)
    reg.promote(base.id)
    broken = _publish(reg, sim=0.9, fill=fill)
    result = reg.promote(broken.id, force=force)
    assert not result.promoted and "non-finite" in result.reason and "embed.weight" in result.reason
    assert reg.champion() == base.id


def test_a_version_that_cannot_be_served_is_never_loaded(reg):
    from specloop.services.registry.types import UnknownVersion, UnservableVersion

    good, nan, cut = _publish(reg, seed=1), _publish(reg, fill=float("nan")), _publish(reg, seed=2)
    assert torch.equal(reg.load_weights(good.id)["embed.weight"], _weights(1)["embed.weight"])
    with pytest.raises(UnservableVersion, match="non-finite weights in embed.weight"):
        reg.load_weights(nan.id)
    path = reg.root / "versions" / cut.id / "weights.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a copy cut short
    with pytest.raises(UnservableVersion, match=f"weights of {cut.id} are unreadable"):
        reg.load_weights(cut.id)
    with pytest.raises(UnknownVersion):
        reg.load_weights("v9999")


def test_non_finite_weights_are_refused_as_first_champion(reg):
    broken = _publish(reg, fill=float("nan"))
    assert not reg.promote(broken.id).promoted and reg.champion() is None


@pytest.mark.parametrize("sim", [float("nan"), None])
def test_missing_or_nan_sim_acceptance_is_refused(reg, sim):
    base, bad = _publish(reg, sim=0.1), _publish(reg, sim=sim)
    reg.promote(base.id)
    result = reg.promote(bad.id)
    assert not result.promoted and "sim_acceptance" in result.reason


def test_force_skips_the_acceptance_comparison(reg):
    good, worse = _publish(reg, sim=0.6), _publish(reg, sim=0.2)
    reg.promote(good.id)
    assert reg.promote(worse.id, force=True).promoted and reg.champion() == worse.id


def test_promoting_the_champion_again_is_a_no_op(reg):
    v = _publish(reg)
    reg.promote(v.id)
    token = reg.state_token()
    result = reg.promote(v.id)
    assert not result.promoted and "already the champion" in result.reason
    assert reg.state_token() == token and reg.previous_champions() == []


# ---- pin


def test_promotion_is_refused_while_pinned_but_the_learner_can_still_publish(reg):
    base = _publish(reg, sim=0.3)
    reg.promote(base.id)
    assert reg.pin() == base.id and reg.pinned() == base.id
    better = _publish(reg, sim=0.9)
    result = reg.promote(better.id)
    assert not result.promoted and result.reason == f"pinned to {base.id}"
    assert reg.champion() == base.id
    reg.unpin()
    assert reg.pinned() is None
    assert reg.promote(better.id).promoted and reg.champion() == better.id


def test_force_promotes_through_a_pin_and_moves_the_pin(reg):
    base, other = _publish(reg, sim=0.3), _publish(reg, sim=0.1)
    reg.promote(base.id)
    reg.pin()
    assert reg.promote(other.id, force=True).promoted
    assert reg.champion() == other.id and reg.pinned() == other.id


def test_pin_with_a_version_makes_it_the_champion(reg):
    a, b = _publish(reg, sim=0.9), _publish(reg, sim=0.1)
    reg.promote(a.id)
    assert reg.pin(b.id) == b.id
    assert reg.champion() == b.id and reg.pinned() == b.id
    assert reg.previous_champions() == [a.id]


def test_pin_without_a_champion_or_with_nan_weights_raises(reg):
    with pytest.raises(RegistryError, match="no champion"):
        reg.pin()
    broken = _publish(reg, fill=float("nan"))
    with pytest.raises(RegistryError, match="non-finite"):
        reg.pin(broken.id)


# ---- rollback and events


def test_rollback_restores_the_previous_champion(reg):
    a, b, c = _publish(reg, sim=0.1), _publish(reg, sim=0.2), _publish(reg, sim=0.3)
    for v in (a, b, c):
        reg.promote(v.id)
    assert reg.previous_champions() == [a.id, b.id]
    assert reg.rollback("acceptance fell to 0.2") == b.id
    assert reg.champion() == b.id and reg.previous_champions() == [a.id]
    assert reg.rollback("again") == a.id
    with pytest.raises(RegistryError, match="no previous champion"):
        reg.rollback("once more")
    assert reg.champion() == a.id


def test_rollback_with_empty_history_raises(reg):
    with pytest.raises(RegistryError, match="no previous champion"):
        reg.rollback("nothing to go back to")


def test_a_rollback_expecting_another_champion_is_refused_and_changes_nothing(reg):
    """Compare-and-set: two workers judging one bad version roll it back once, not twice."""
    a, b, c = _publish(reg, sim=0.1), _publish(reg, sim=0.2), _publish(reg, sim=0.3)
    for v in (a, b, c):
        reg.promote(v.id)
    assert reg.rollback("worker 1: acceptance fell", expected=c.id) == b.id
    with pytest.raises(RegistryError, match=f"the champion is {b.id}, not {c.id}"):
        reg.rollback("worker 2: acceptance fell", expected=c.id)
    assert reg.champion() == b.id and reg.previous_champions() == [a.id]
    assert [e["event"] for e in reg.events()][-2:] == ["rollback", "refuse"]


def test_prune_keeps_the_newest_the_champion_the_pin_and_the_rollback_history(reg):
    ids = [_publish(reg, sim=0.1 * i, seed=i).id for i in range(8)]
    for v in ids[1:4]:
        assert reg.promote(v).promoted  # champion ids[3], history [ids[1], ids[2]]
    deleted = reg.prune(keep=2)
    assert deleted == [ids[0], ids[4], ids[5]]
    assert [v.id for v in reg.list()] == [ids[1], ids[2], ids[3], ids[6], ids[7]]
    assert not (reg.root / "versions" / ids[0]).exists()
    assert reg.champion() == ids[3] and reg.previous_champions() == [ids[1], ids[2]]
    assert reg.events()[-1]["event"] == "prune" and reg.events()[-1]["deleted"] == deleted
    assert reg.rollback("back", expected=ids[3]) == ids[2]  # what a rollback needs is still there
    assert reg.prune(keep=2) == [ids[3]] and reg.prune(keep=2) == []
    assert int(_publish(reg, seed=9).id[1:]) == 9  # ids keep increasing past pruned ones


def test_a_torn_event_log_line_is_skipped_and_the_next_event_still_parses(tmp_path):
    reg = Registry(tmp_path)
    _publish(reg)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"time": 1, "event": "promo')  # a crash mid-append
    reg.pin(reg.list()[0].id)
    assert [e["event"] for e in reg.events()] == ["publish", "pin"]


def test_the_event_log_is_rotated_and_read_across_the_rotation(tmp_path, monkeypatch):
    import specloop.services.registry.meta as registry_meta

    monkeypatch.setattr(registry_meta, "EVENT_LOG_BYTES", 600)
    reg = Registry(tmp_path)
    ids = [_publish(reg, seed=i).id for i in range(10)]
    assert (tmp_path / "events.jsonl.1").exists() and (tmp_path / "events.jsonl").stat().st_size <= 600 + 300
    assert [e["version"] for e in reg.events()][-3:] == ids[-3:]


def test_a_full_disk_fails_a_publish_cleanly_and_the_registry_serves_on(tmp_path):
    """The registry folder on a 512 KiB tmpfs: a version that does not fit raises, leaves no folder or
    temporary file, changes neither the list nor the champion, and publishing works once it fits."""
    import subprocess

    root = tmp_path / "small"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        reg = Registry(root)
        v1 = _publish(reg).id
        assert reg.promote(v1).promoted
        with pytest.raises(RegistryError, match="No space left on device"):
            reg.publish({"w": torch.zeros(300_000)}, parent=v1, learner_step=1, objective="kl", loss=0.1,
                        sim_acceptance=0.9, kind="pretrained")
        assert [v.id for v in reg.list()] == [v1] and reg.champion() == v1
        assert sorted(p.name for p in (root / "versions").iterdir()) == [v1]
        assert not [p for p in root.rglob("*.tmp")]
        v3 = _publish(reg, seed=3).id
        assert [v.id for v in reg.list()] == [v1, v3]
    finally:
        subprocess.run(["umount", str(root)], check=False)


def test_rollback_is_refused_while_pinned(reg):
    a, b = _publish(reg, sim=0.1), _publish(reg, sim=0.2)
    reg.promote(a.id)
    reg.promote(b.id)
    reg.pin()
    with pytest.raises(RegistryError, match=f"pinned to {b.id}; unpin first"):
        reg.rollback("bad")
    reg.unpin()
    assert reg.rollback("bad") == a.id


def test_events_record_promotions_refusals_and_rollbacks_with_reasons(reg, caplog):
    a, b, worse = _publish(reg, sim=0.5), _publish(reg, sim=0.6), _publish(reg, sim=0.1)
    with caplog.at_level(logging.INFO, logger="specloop.registry"):
        reg.promote(a.id)
        reg.promote(b.id)
        reg.promote(worse.id)
        reg.rollback("p95 acceptance dropped")
        reg.pin()
        reg.unpin()
    events = reg.events()
    assert [e["event"] for e in events] == [
        "publish", "publish", "publish", "promote", "promote", "refuse", "rollback", "pin", "unpin"
    ]
    assert all({"time", "event", "version", "reason"} <= set(e) for e in events)
    refuse, rollback = events[5], events[6]
    assert refuse["version"] == worse.id and "0.1000" in refuse["reason"]
    assert rollback["version"] == a.id and rollback["reason"] == "p95 acceptance dropped"
    assert [e["event"] for e in reg.events(limit=2)] == ["pin", "unpin"]
    assert "p95 acceptance dropped" in caplog.text and "refuse" in caplog.text


# ---- ids and paths


@pytest.mark.parametrize("bad", ["../x", "/etc", "v0001/../../x", "", "v1", "v0001/", "..", "V0001", "v0001\n", " v0001", 1])
def test_bad_ids_raise_and_write_nothing_outside_root(reg, tmp_path, bad):
    _publish(reg)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for call in (reg.get, reg.load_weights, reg.promote, reg.pin,
                 lambda v: _publish(reg, parent=v)):
        with pytest.raises(RegistryError):
            call(bad)
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    outside = [p for p in after if p not in before and p.parts[0] != "registry"]
    assert outside == []


def test_none_is_not_a_version_id(reg):
    for call in (reg.get, reg.load_weights, reg.promote):
        with pytest.raises(RegistryError, match="bad version id"):
            call(None)


# ---- sharing


def test_two_registries_on_one_store_see_each_other(make):
    one, two = make(), make()
    a = _publish(one, sim=0.4)
    assert [i.id for i in two.list()] == [a.id]
    two.promote(a.id)
    assert one.champion() == a.id
    b = _publish(two, sim=0.5)
    assert b.id == "v0002"
    assert one.promote(b.id).promoted and two.champion() == b.id
    assert two.previous_champions() == [a.id]


def test_concurrent_publishes_never_collide(make):
    regs, ids, errors = [make(), make()], [], []

    def work(r, seed):
        try:
            for i in range(10):
                ids.append(_publish(r, seed=seed * 100 + i).id)
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r, n)) for n, r in enumerate(regs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(ids) == 20 and len(set(ids)) == 20
    assert [i.id for i in regs[0].list()] == sorted(ids)


def test_concurrent_promotions_keep_a_consistent_history(make):
    regs = [make(), make()]
    versions = [_publish(regs[0], sim=0.5, seed=i) for i in range(8)]

    def work(r, vs):
        for v in vs:
            r.promote(v.id)

    threads = [threading.Thread(target=work, args=(regs[n], versions[n::2])) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    history = regs[1].previous_champions()
    assert len(history) == 7 and len(set(history + [regs[1].champion()])) == 8


# ---- state token


def test_state_token_changes_on_promote_pin_and_rollback_but_not_publish(reg):
    tokens = [reg.state_token()]
    a = _publish(reg, sim=0.1)
    assert reg.state_token() == tokens[-1]
    steps = [lambda: reg.promote(a.id), lambda: _publish(reg, sim=0.2), lambda: reg.promote("v0002"),
             reg.pin, reg.unpin, lambda: reg.rollback("test")]
    changes = []
    for step in steps:
        step()
        changes.append(reg.state_token() != tokens[-1])
        tokens.append(reg.state_token())
    assert changes == [True, False, True, True, True, True]
    assert len(set(tokens)) == 6


def test_state_token_is_cheap_for_the_folder_backend(tmp_path):
    reg = Registry(tmp_path)
    reg.promote(_publish(reg).id)
    reg.state_token()
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        reg.state_token()
    per_call = (time.perf_counter() - start) / n
    assert per_call < 500e-6  # aim: < 50 µs; loose here so a busy CI machine does not flake


def test_versions_stay_readable_and_ids_unique_when_redis_metadata_is_lost(tmp_path):
    """A Redis that keeps nothing on disk restarts: the folder still holds every version."""
    client = _redis_or_skip()
    prefix = f"test-registry-{uuid4().hex}"
    try:
        reg = Registry(tmp_path / "registry", redis_url=REDIS_URL, prefix=prefix)
        v1 = _publish(reg, sim=0.5).id
        v2 = _publish(reg, sim=0.6, parent=v1).id
        client.delete(*client.scan_iter(f"{prefix}:*"))  # what a restart without persistence leaves
        assert reg.get(v2).sim_acceptance == pytest.approx(0.6)  # from the version folder's info.json
        assert torch.equal(reg.load_weights(v1)["embed.weight"], _weights()["embed.weight"])
        v3 = _publish(reg, sim=0.7, parent=v2).id
        assert v3 not in (v1, v2) and int(v3[1:]) > int(v2[1:])
    finally:
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)


def test_the_champion_and_the_pin_survive_redis_losing_its_data_and_the_gate_still_compares(tmp_path):
    client = _redis_or_skip()
    prefix = f"test-registry-{uuid4().hex}"
    try:
        reg = Registry(tmp_path / "registry", redis_url=REDIS_URL, prefix=prefix)
        v1, v2 = _publish(reg, sim=0.5).id, _publish(reg, sim=0.6, seed=1).id
        assert reg.promote(v1).promoted and reg.promote(v2).promoted
        client.delete(*client.scan_iter(f"{prefix}:*"))  # a restart without persistence
        again = Registry(tmp_path / "registry", redis_url=REDIS_URL, prefix=prefix)  # another process
        assert again.champion() == v2 and again.previous_champions() == [v1]
        worse = _publish(again, sim=0.1, seed=2).id
        refused = again.promote(worse)
        assert not refused.promoted and f"< champion {v2}" in refused.reason  # compared, not waved through
        again.pin()
        client.delete(*client.scan_iter(f"{prefix}:*"))
        better = reg.promote(_publish(reg, sim=0.9, seed=3).id)
        assert reg.pinned() == v2 and not better.promoted and "pinned" in better.reason
    finally:
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)


def test_a_registry_folder_has_one_stable_redis_namespace(tmp_path):
    from specloop.services.registry.meta import redis_namespace

    assert redis_namespace(tmp_path) == redis_namespace(tmp_path / ".")
    assert redis_namespace(tmp_path).startswith("specloop:") and redis_namespace(tmp_path, "other").startswith("other:")
    assert redis_namespace(tmp_path) != redis_namespace(tmp_path / "x")


@needs_redis
def test_forgetting_a_namespace_deletes_its_keys_and_only_those(tmp_path):
    import redis

    from specloop.services.registry.meta import forget_namespace, redis_namespace

    url = "redis://127.0.0.1:6379"
    mine, other = redis_namespace(tmp_path, "sltest-forget"), redis_namespace(tmp_path / "o", "sltest-forget")
    client = redis.Redis.from_url(url)
    try:
        client.set(f"{mine}:a", 1), client.set(f"{mine}:b:c", 2), client.set(f"{other}:a", 3)
        assert forget_namespace(url, mine) == 2
        assert client.get(f"{mine}:a") is None and client.get(f"{other}:a") == b"3"
        assert forget_namespace(url, mine) == 0
    finally:
        client.delete(f"{other}:a")
        client.close()


def test_redis_data_lost_listing_and_pruning_still_see_every_version(make):
    reg = make()
    ids = [_publish(reg, sim=0.1 * i, seed=i).id for i in range(4)]
    assert reg.promote(ids[0]).promoted
    if isinstance(reg._meta, RedisMeta):
        reg._meta.r.delete(reg._meta.k_info)  # the index lost (a Redis restarted without its data)
        reg._meta.r.hset(reg._meta.k_info, "v0999", '{"id": "v0999"}')  # and one whose folder is gone
    assert [v.id for v in reg.list()] == ids
    if isinstance(reg._meta, RedisMeta):
        assert sorted(reg._meta.r.hkeys(reg._meta.k_info)) == ids  # reconciled with the folders
    assert reg.prune(keep=1) == ids[1:3]


def test_a_version_being_pruned_is_never_pinned_or_promoted_and_the_next_prune_finishes_it(reg):
    from dataclasses import replace

    ids = [_publish(reg, sim=0.1 * i, seed=i).id for i in range(3)]
    assert reg.promote(ids[0]).promoted
    # the state a prune leaves between marking its versions and deleting their folders
    reg._update(lambda s: (replace(s, pruning=[ids[1]]), None))
    with pytest.raises(RegistryError, match="being pruned"):
        reg.pin(ids[1])
    result = reg.promote(ids[1])
    assert not result.promoted and "being pruned" in result.reason
    assert reg.prune(keep=1) == [ids[1]]  # a prune killed before deleting is finished by the next
    assert reg.alias().pruning == [] and not (reg.root / "versions" / ids[1]).exists()
    assert reg.champion() == ids[0]
