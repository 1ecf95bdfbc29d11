"""The registry watcher: the serving thread never waits on the registry; rollbacks are compare-and-set."""
from __future__ import annotations

import os
import signal
import threading
import time

import torch

from specloop.services.registry.registry import Registry
from specloop.services.worker.watcher import RegistryWatcher
from tests.redis_helpers import needs_redis_server


def publish(reg: Registry, sim: float = 0.5) -> str:
    return reg.publish({"w": torch.ones(4)}, parent=None, learner_step=0, objective="kl", loss=0.1,
                       sim_acceptance=sim, kind="pretrained").id


def champion(reg: Registry, sim: float = 0.5) -> str:
    version = publish(reg, sim)
    assert reg.promote(version).promoted
    return version


def test_a_new_champion_is_loaded_on_the_watchers_thread_and_handed_over_once(tmp_path):
    reg = Registry(tmp_path)
    v1 = champion(reg)
    threads: list[str] = []
    watcher = RegistryWatcher(reg, lambda v: threads.append(threading.current_thread().name) or f"drafter {v}",
                              0.02, "base").start()
    try:
        assert watcher.fresh(10)
        ready = watcher.take()
        assert (ready.version, ready.drafter, ready.error) == (v1, f"drafter {v1}", None)
        assert watcher.take() is None and threads == ["registry-watcher"]
        watcher.serving = v1
        assert watcher.fresh(10) and watcher.take() is None and len(threads) == 1  # same alias: nothing reloaded
        v2 = champion(reg, 0.6)
        assert watcher.fresh(10) and watcher.take().version == v2
    finally:
        watcher.close()


def test_a_version_that_fails_to_load_is_handed_over_as_its_error(tmp_path):
    reg = Registry(tmp_path)
    v1 = champion(reg)

    def load(version: str):
        raise ValueError(f"{version} is corrupt")

    watcher = RegistryWatcher(reg, load, 0.02, "base").start()
    try:
        assert watcher.fresh(10)
        ready = watcher.take()
        assert ready.drafter is None and str(ready.error) == f"{v1} is corrupt"
    finally:
        watcher.close()


def test_a_champion_that_failed_to_load_is_tried_again_without_an_alias_change(tmp_path, monkeypatch):
    reg = Registry(tmp_path)
    v1 = champion(reg)
    attempts: list[str] = []

    def load(version: str):
        attempts.append(version)
        if len(attempts) == 1:
            raise OSError("the file is still being copied")
        return f"drafter {version}"

    monkeypatch.setattr(RegistryWatcher, "RETRY_S", 0.05)
    watcher = RegistryWatcher(reg, load, 0.02, "base").start()
    try:
        assert watcher.fresh(10) and watcher.take().error is not None
        deadline, ready = time.monotonic() + 10, None
        while ready is None and time.monotonic() < deadline:
            watcher.fresh(1.0)
            ready = watcher.take()
        assert ready.drafter == f"drafter {v1}" and attempts == [v1, v1]
    finally:
        watcher.close()


def test_two_workers_judging_one_version_roll_it_back_once(tmp_path):
    reg = Registry(tmp_path)
    v1, v2 = champion(reg, 0.5), champion(reg, 0.6)
    watchers = [RegistryWatcher(reg, str, 0.02, v2).start() for _ in range(2)]
    try:
        for w in watchers:
            w.rollback("live acceptance fell", expected=v2)
        for w in watchers:
            assert w.fresh(10)  # its queued rollback ran before that read
        assert reg.champion() == v1 and reg.previous_champions() == []
        assert sum(len(w.rollbacks) for w in watchers) == 1
        assert [e["event"] for e in reg.events()][-2:] == ["rollback", "refuse"]
    finally:
        for w in watchers:
            w.close()


@needs_redis_server
def test_a_paused_redis_never_holds_the_serving_side_and_is_followed_again(tmp_path, redis_server):
    reg = Registry(tmp_path / "reg", redis_server.url, "watch")
    v1 = champion(reg)
    watcher = RegistryWatcher(reg, str, 0.02, "base").start()
    try:
        assert watcher.fresh(10) and watcher.take().version == v1
        watcher.serving = v1
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # every registry call now hangs until its timeout
        try:
            worst, end = 0.0, time.monotonic() + 3 * Registry.redis_timeout_s()
            while time.monotonic() < end:
                t0 = time.monotonic()
                assert watcher.take() is None
                watcher.fresh(0.25)
                worst = max(worst, time.monotonic() - t0)
            assert watcher.down and watcher.errors >= 1
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert worst < 1.0, f"the serving side waited {worst:.2f} s on a paused Redis"
        v2 = champion(reg, 0.6)
        deadline, ready = time.monotonic() + 30, None
        while ready is None and time.monotonic() < deadline:
            watcher.fresh(1.0)
            ready = watcher.take()
        assert ready is not None and ready.version == v2 and not watcher.down
    finally:
        watcher.close()
