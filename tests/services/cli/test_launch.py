"""`specloop serve` as a child process (the running case: test_demo.py, test_dashboards.py)."""
from __future__ import annotations

import socket

import pytest

from specloop.services.cli.launch import ServeProcess, ephemeral_low, free_port


def test_the_command_names_its_port_registry_and_flags(tmp_path):
    proc = ServeProcess(["--verifier", tmp_path / "v", "--learner", "off"], threads=3, registry=tmp_path / "reg")
    assert proc.cmd[-9:] == ["serve", "--port", str(proc.port), "--registry", str((tmp_path / "reg").resolve()),
                             "--verifier", str(tmp_path / "v"), "--learner", "off"]
    assert proc.cmd[proc.cmd.index("--threads") + 1] == "3" and proc.url.endswith(f":{proc.port}")
    assert proc.stop() is None and proc.forget_redis_keys() == 0  # never started: nothing to stop or delete


def test_a_server_that_exits_at_once_is_reported_with_its_exit_code_and_log(tmp_path, tiny_pair):
    log = tmp_path / "serve.log"
    proc = ServeProcess(["--verifier", tiny_pair[0], "--drafter", tiny_pair[1], "--workers", "0"], threads=1, log=log)
    with pytest.raises(RuntimeError, match="exited with code 2") as err:
        proc.start(timeout=120)
    assert "--workers must be >= 1" in str(err.value)
    assert proc.stop() == 2


def test_a_free_port_comes_from_below_the_ephemeral_range_and_binds(tmp_path):
    low = ephemeral_low()
    ports = {free_port() for _ in range(8)}
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: nothing listens there
        assert 0 < port < 65536 and (low <= 21024 or 20000 <= port < low)
    ranges = tmp_path / "range"
    ranges.write_text("40000\t60999\n")
    assert ephemeral_low(ranges) == 40000 and ephemeral_low(tmp_path / "missing") == 0
