"""`specloop serve` set-up pieces that need no cluster (the cluster itself: test_cluster.py, test_dashboards.py),
and the API process's drain on a real SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specloop.services.cli.deployment import LOCAL_REDIS, ServeConfig, default_registry, detect_redis, served_name
from specloop.services.cli.main import main
from tests.api_helpers import MODEL, Streamer
from tests.redis_helpers import free_port

ROOT = Path(__file__).resolve().parents[3]
# `serve_until_stopped` over a slowly streaming scripted backend, as `specloop api` serves its app
API_PROCESS = """
import sys
from specloop.services.cli.deployment import serve_until_stopped
from tests.api_helpers import scripted, scripted_app
backend = scripted(sys.argv[1], "Sure, here is an example of how you could write", delay_s=0.1)
serve_until_stopped(scripted_app(backend), "127.0.0.1", int(sys.argv[2]), drain_timeout=20.0)
print("stopped with", backend.open_streams, "open streams", flush=True)
"""


def test_redis_comes_from_the_environment_first(monkeypatch):
    monkeypatch.setenv("SPECLOOP_REDIS_URL", "redis://10.0.0.1:6380/2")
    assert detect_redis() == "redis://10.0.0.1:6380/2"


def test_redis_is_the_local_one_when_it_answers_else_none(monkeypatch):
    import specloop.services.cli.deployment as serve

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


def test_the_served_name_is_the_flag_then_the_fetched_pairs_name_then_the_folders(tmp_path):
    fetched = tmp_path / "smollm2-135m-instruct"
    (fetched / "verifier").mkdir(parents=True)
    (fetched / "fetched.json").write_text("{}")  # what `specloop models fetch` leaves beside the pair
    assert served_name(ServeConfig(fetched / "verifier", None)) == "smollm2-135m-instruct"
    assert served_name(ServeConfig(fetched / "verifier", None, model_id="smollm2")) == "smollm2"
    (tmp_path / "mine" / "verifier").mkdir(parents=True)
    assert served_name(ServeConfig(tmp_path / "mine" / "verifier", None)) == "verifier"


def test_serve_refuses_bad_flags_with_exit_code_2(tiny_pair, capsys):
    base = ["serve", "--verifier", str(tiny_pair[0]), "--drafter", str(tiny_pair[1])]
    assert main(base + ["--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    assert main(base + ["--learner", "sgd"]) == 2
    assert "unknown learner" in capsys.readouterr().err
    assert main(base + ["--observe-every", "-1"]) == 2
    assert "--observe-every must be >= 0" in capsys.readouterr().err
    assert main(["serve", "--verifier", str(tiny_pair[0]), "--learner", "klrl"]) == 2  # no drafter: suffix decoding
    assert "--drafter" in capsys.readouterr().err


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the API process did not come up"
        time.sleep(0.1)


def test_sigterm_drains_the_api_process_then_it_exits_cleanly(tiny_pair):
    """A real SIGTERM to a real process: /ready is 503 at once, a new request a 503, the stream in
    flight ends with [DONE], and the process returns from serve_until_stopped (exit code 0)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", API_PROCESS, str(tiny_pair[0]), str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_up(url, proc)
        stream = Streamer(url)
        stream.start()
        stream.wait_for(2)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 1.0
        while httpx.get(url + "/ready", timeout=1).status_code != 503:
            assert time.monotonic() < deadline, "/ready still 200 a second after SIGTERM"
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        stream.join(20)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert stream.status == 200 and stream.events[-1] == "[DONE]" and len(stream.events) > 20
    assert proc.returncode == 0, err
    assert "stopped with 0 open streams" in out
