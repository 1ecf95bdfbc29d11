import json

import pytest

from specloop.services.cli.main import main
from specloop.services.cli.operator import format_stats, table
from tests.admin_helpers import (
    TOKEN,
    WorkerListBackend,
    admin_app,
    filled_buffer,
    seeded_registry,
    serving,
    worker_info,
)
from tests.redis_helpers import free_port


@pytest.fixture(scope="module")
def server():
    """One real uvicorn server with the admin router; each test points its backend at a fresh registry."""
    backend = WorkerListBackend()
    with serving(admin_app(backend)) as url:
        yield backend, url


@pytest.fixture
def reg(server, tmp_path, monkeypatch):
    backend, url = server
    registry = seeded_registry(tmp_path / "registry")
    backend.infos = [worker_info("worker-0", registry.root, "v0002"), worker_info("worker-1", registry.root, "v0001")]
    backend.buffer = filled_buffer()
    monkeypatch.setenv("SPECLOOP_URL", url)
    monkeypatch.setenv("SPECLOOP_ADMIN_TOKEN", TOKEN)
    return registry


@pytest.fixture
def specloop(capsys):
    """specloop(*args) -> (exit code, stdout, stderr) of `specloop ARGS` run in-process."""

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _row(out: str, first: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [first])


# ---- reading


def test_drafter_list_prints_an_aligned_table_of_versions(reg, specloop):
    code, out, err = specloop("drafter", "list")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["VERSION", "PARENT", "CREATED", "KIND", "OBJECTIVE", "STEP", "LOSS", "SIM_ACC", "FLAGS"]
    assert [line.split()[0] for line in lines[1:]] == ["v0001", "v0002", "v0003"]
    assert len({line.index("KIND") for line in lines[:1]} | {line.index("pretrained") for line in lines[1:]}) == 1
    v2 = _row(out, "v0002")
    assert v2[1] == "v0001" and v2[-3:] == ["2.2500", "0.6000", "champion"]
    assert _row(out, "v0001")[1] == "-"


def test_drafter_list_json_is_the_servers_answer(reg, specloop):
    code, out, _ = specloop("drafter", "list", "--json")
    body = json.loads(out)
    assert code == 0 and [v["id"] for v in body["data"]] == ["v0001", "v0002", "v0003"]
    assert [v["champion"] for v in body["data"]] == [False, True, False]


def test_drafter_status_shows_the_champion_each_worker_and_recent_events(reg, specloop):
    code, out, _ = specloop("drafter", "status")
    assert code == 0
    assert "champion: v0002\n" in out and "previous champions (latest first): v0001" in out
    assert _row(out, "worker-0") == ["worker-0", "v0002"]
    assert _row(out, "worker-1") == ["worker-1", "v0001", "not", "the", "champion"]
    events = out.split("recent events (oldest first):\n")[1].splitlines()
    assert events[0].split() == ["TIME", "EVENT", "VERSION", "REASON"]
    assert [line.split()[2:4] for line in events[1:]] == [["publish", "v0001"], ["promote", "v0001"],
                                                          ["publish", "v0002"], ["promote", "v0002"],
                                                          ["publish", "v0003"]]


def test_drafter_status_json_returns_as_many_events_as_asked(reg, specloop):
    code, out, _ = specloop("drafter", "status", "--json", "--events", "1")
    body = json.loads(out)
    assert code == 0 and body["champion"] == "v0002" and len(body["events"]) == 1


def test_buffer_stats_prints_one_aligned_line_per_figure(reg, specloop):
    code, out, _ = specloop("buffer", "stats")
    assert code == 0
    assert [line.split() for line in out.splitlines()] == [
        ["backend", "memory"], ["written", "5"], ["dropped", "0"], ["depth", "5"], ["pending", "1"],
        ["memory_bytes", "30"]]
    assert len({line.index(line.split()[1]) for line in out.splitlines()}) == 1


def test_buffer_stats_json_is_the_servers_answer(reg, specloop):
    code, out, _ = specloop("buffer", "stats", "--json")
    assert code == 0 and json.loads(out)["pending"] == 1


def test_buffer_stats_of_a_deployment_without_buffer_exit_1_with_the_servers_message(server, reg, specloop):
    server[0].buffer = None
    code, out, err = specloop("buffer", "stats")
    assert (code, out) == (1, "")
    assert err.startswith("specloop: error: HTTP 404: no replay buffer")


# ---- changing


def test_pin_then_unpin_change_the_registry(reg, specloop):
    code, out, _ = specloop("drafter", "pin", "v0003")
    assert code == 0 and out.startswith("pinned v0003\nchampion: v0003 (pinned)\n")
    assert (reg.champion(), reg.pinned()) == ("v0003", "v0003")
    code, out, _ = specloop("drafter", "unpin")
    assert code == 0 and out.startswith("unpinned\nchampion: v0003\n")
    assert (reg.champion(), reg.pinned()) == ("v0003", None)


def test_pin_json_answers_the_alias_state(reg, specloop):
    code, out, _ = specloop("drafter", "pin", "v0001", "--json")
    assert code == 0 and json.loads(out)["pinned"] == "v0001"


def test_rollback_returns_to_the_previous_champion_with_the_reason_logged(reg, specloop):
    code, out, _ = specloop("drafter", "rollback", "--reason", "acceptance fell")
    assert code == 0 and out.startswith("rolled back\nchampion: v0001\n")
    assert reg.champion() == "v0001" and reg.events(1)[0]["reason"] == "acceptance fell"


def test_a_refused_rollback_exits_1_with_the_servers_message(reg, specloop):
    assert specloop("drafter", "rollback")[0] == 0
    code, out, err = specloop("drafter", "rollback")
    assert (code, out) == (1, "")
    assert err == "specloop: error: HTTP 409: rollback refused: no previous champion (operator rollback)\n"


def test_pinning_an_unknown_version_exits_1(reg, specloop):
    code, _, err = specloop("drafter", "pin", "v0099")
    assert code == 1 and err == "specloop: error: HTTP 404: unknown version v0099\n"
    assert reg.pinned() is None


def test_a_version_the_server_calls_malformed_exits_2(reg, specloop):
    code, _, err = specloop("drafter", "pin", "latest")
    assert code == 2 and err.startswith("specloop: error: HTTP 400: bad version id 'latest'")


# ---- auth

def test_a_wrong_token_exits_1_with_the_servers_message(reg, specloop):
    code, _, err = specloop("drafter", "list", "--token", "wrong")
    assert code == 1 and err == "specloop: error: HTTP 401: invalid admin token\n"


def test_without_a_token_the_server_asks_for_one(reg, specloop, monkeypatch):
    monkeypatch.delenv("SPECLOOP_ADMIN_TOKEN")
    code, _, err = specloop("drafter", "pin", "v0001")
    assert code == 1 and "HTTP 401: missing admin token" in err
    assert reg.pinned() is None


def test_the_token_option_overrides_the_environment(reg, specloop, monkeypatch):
    monkeypatch.setenv("SPECLOOP_ADMIN_TOKEN", "stale")
    assert specloop("drafter", "list", "--token", TOKEN)[0] == 0


# ---- bad input and unreachable service


def test_an_empty_version_exits_2_without_contacting_the_service(specloop):
    code, out, err = specloop("drafter", "pin", " ", "--url", f"http://127.0.0.1:{free_port()}")
    assert (code, out) == (2, "")
    assert err == "specloop: error: VERSION must not be empty (e.g. v0002)\n"


@pytest.mark.parametrize("url", ["foo", "ftp://127.0.0.1:8000", "http://", "http://127.0.0.1:99999", "127.0.0.1:8000"])
def test_a_bad_url_exits_2_with_one_line(specloop, url):
    code, _, err = specloop("drafter", "list", "--url", url)
    assert code == 2 and err.startswith(f"specloop: error: bad --url {url!r}") and err.count("\n") == 1


def test_a_dead_port_is_named_as_a_connection_error(specloop):
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = specloop("buffer", "stats", "--url", url)
    assert (code, out) == (1, "")
    assert err.startswith(f"specloop: error: cannot connect to specloop at {url}: ") and err.count("\n") == 1


@pytest.mark.parametrize("args", [("drafter", "pin"), ("drafter", "nope"), ("buffer", "stats", "--bogus"),
                                  ("drafter", "status", "--events", "-1")])
def test_usage_errors_exit_2_with_one_line(specloop, args):
    code, out, err = specloop(*args)
    assert (code, out) == (2, "")
    assert err.startswith("specloop: error: ") and err.count("\n") == 1


def test_specloop_help_lists_every_command_with_a_one_line_help(specloop):
    code, out, _ = specloop("--help")
    assert code == 0
    commands = out.split("Commands:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in commands] == ["generate", "replay", "serve", "api", "demo", "models", "train",
                                                      "drafter", "buffer"]
    assert all(len(line.split()) > 2 and not line.endswith("...") for line in commands)  # a help, not cut short
    flat = " ".join(out.split())
    assert "specloop drafter list|status|pin|unpin|rollback, specloop buffer stats" in flat
    assert "specloop models bootstrap|fetch, specloop train offline" in flat


def test_operator_help_lists_the_drafter_commands(specloop):
    code, out, _ = specloop("drafter", "--help")
    assert code == 0
    assert all(name in out for name in ("list", "status", "pin", "unpin", "rollback"))


# ---- global options, environment, --config


def test_global_options_go_before_or_after_an_operator_command(reg, specloop):
    assert specloop("--threads", "2", "drafter", "list")[0] == 0
    assert specloop("drafter", "list", "--threads", "2")[0] == 0
    code, _, err = specloop("drafter", "list", "--threads", "0")
    assert code == 2 and "Invalid value for '--threads'" in err and err.count("\n") == 1


def test_the_log_level_after_the_command_wins_over_the_one_before(specloop):
    import logging

    bad = ("--url", "nope")  # the command runs (its globals settled) and stops before any request
    try:
        assert specloop("--log-level", "info", "buffer", "stats", *bad)[0] == 2
        assert logging.getLogger("specloop").level == logging.INFO
        assert specloop("--log-level", "info", "buffer", "stats", "--log-level", "error", *bad)[0] == 2
        assert logging.getLogger("specloop").level == logging.ERROR
    finally:
        logging.getLogger("specloop").setLevel(logging.NOTSET)


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "specloop.yaml"
    path.write_text(text)
    return str(path)


def test_precedence_is_command_line_then_environment_then_config_then_default(specloop, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECLOOP_URL", raising=False)
    cfg = _config(tmp_path, "url: cfg://x\n")
    assert "bad --url 'http://127.0.0.1:99999'" in specloop("drafter", "list", "--url", "http://127.0.0.1:99999")[2]
    assert "bad --url 'cfg://x'" in specloop("drafter", "list", "--config", cfg)[2]
    assert "bad --url 'cfg://x'" in specloop("--config", cfg, "drafter", "list")[2]
    monkeypatch.setenv("SPECLOOP_URL", "env://x")
    assert "bad --url 'env://x'" in specloop("drafter", "list", "--config", cfg)[2]
    assert "bad --url 'cli://x'" in specloop("drafter", "list", "--config", cfg, "--url", "cli://x")[2]
    monkeypatch.setenv("SPECLOOP_CONFIG", cfg)
    monkeypatch.delenv("SPECLOOP_URL")
    assert "bad --url 'cfg://x'" in specloop("drafter", "list")[2]


def test_config_keys_may_use_underscores_and_global_options(specloop, tmp_path):
    code, _, err = specloop("drafter", "status", "--config", _config(tmp_path, "events: 5000\n"))
    assert code == 2 and "Invalid value for '--events'" in err
    code, _, err = specloop("drafter", "list", "--config", _config(tmp_path, "log_level: loud\n"))
    assert code == 2 and "'--log-level'" in err


@pytest.mark.parametrize("text,message", [
    ("url: http://x\nbogus: 1\n", "unknown key 'bogus' for `specloop drafter list`"),
    ("max_tokens: 5\n", "unknown key 'max_tokens'"),  # an option of another command
    ("- url\n", "expected a mapping"),
    ("url: [unclosed\n", "not YAML"),
])
def test_a_bad_config_file_exits_2_with_one_line(specloop, tmp_path, text, message):
    code, out, err = specloop("drafter", "list", "--config", _config(tmp_path, text))
    assert (code, out) == (2, "") and err.startswith("specloop: error: --config ") and message in err
    assert err.count("\n") == 1


def test_a_missing_config_file_exits_2(specloop, tmp_path):
    code, _, err = specloop("drafter", "list", "--config", str(tmp_path / "none.yaml"))
    assert code == 2 and "none.yaml" in err


# ---- pure formatting


def test_table_pads_every_column_to_its_widest_cell():
    assert table(["A", "BB"], [["xxx", "y"], ["z", ""]]) == "A    BB\nxxx  y\nz"


def test_stats_show_a_missing_figure_as_a_dash():
    assert format_stats({"depth": -1, "memory_bytes": None}) == "depth         -1\nmemory_bytes  -"
