"""`specloop serve` set-up pieces that need no cluster (the cluster itself: test_cluster.py, test_dashboards.py)."""
from __future__ import annotations

from pathlib import Path

from services.cli import main
from services.serve import LOCAL_REDIS, default_registry, detect_redis
from tests.redis_helpers import free_port


def test_redis_comes_from_the_environment_first(monkeypatch):
    monkeypatch.setenv("SPECLOOP_REDIS_URL", "redis://10.0.0.1:6380/2")
    assert detect_redis() == "redis://10.0.0.1:6380/2"


def test_redis_is_the_local_one_when_it_answers_else_none(monkeypatch):
    import services.serve as serve

    monkeypatch.delenv("SPECLOOP_REDIS_URL", raising=False)
    monkeypatch.setattr(serve, "LOCAL_REDIS", f"redis://127.0.0.1:{free_port()}")
    assert detect_redis() is None  # nothing listens there: the embedded buffer
    monkeypatch.setattr(serve, "LOCAL_REDIS", LOCAL_REDIS)
    from tests.redis_helpers import redis_up

    assert detect_redis() == (LOCAL_REDIS if redis_up() else None)


def test_each_model_pair_gets_its_own_registry_folder(tmp_path):
    a = default_registry(tmp_path, Path("v"), Path("d1"), "pretrained")
    assert a == default_registry(tmp_path, Path("v"), Path("d1"), "pretrained")
    assert a.parent == tmp_path
    others = {default_registry(tmp_path, Path("v"), Path("d2"), "pretrained"),
              default_registry(tmp_path, Path("v"), Path("d1"), "sd2"), default_registry(tmp_path, Path("v"), None, "dvi")}
    assert a not in others and len(others) == 3


def test_serve_refuses_bad_flags_with_exit_code_2(tiny_pair, capsys):
    base = ["serve", "--verifier", str(tiny_pair[0]), "--drafter", str(tiny_pair[1])]
    assert main(base + ["--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    assert main(base + ["--learner", "sgd"]) == 2
    assert "unknown learner" in capsys.readouterr().err
    assert main(["serve", "--verifier", str(tiny_pair[0])]) == 2
    assert "--drafter" in capsys.readouterr().err
