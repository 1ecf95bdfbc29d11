"""deploy/ and docker-compose.yml, checked by the real tools: `docker-compose config` (no daemon
needed), `nginx -t`, `promtool check config`, and a real redis-server reading deploy/redis/redis.conf.
Each test skips when its program is absent (scripts/system-deps.sh installs them)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest
import yaml

from tests.deploy_helpers import DEPLOY, ROOT, render

COMPOSE_FILE = ROOT / "docker-compose.yml"
SERVICES = {"redis", "ray-head", "ray-worker", "api-1", "api-2", "nginx", "prometheus", "grafana"}
SECRETS = {"SPECLOOP_ADMIN_TOKEN": "test-token", "RAY_AUTH_TOKEN": "ray-test-token", "SPECLOOP_API_KEY": "test-key",
           "REDIS_PASSWORD": "redis-test-password", "GRAFANA_ADMIN_PASSWORD": "grafana-test-password"}
SPECLOOP_SERVICES = ("ray-head", "ray-worker", "api-1", "api-2")






def program(name: str) -> str:
    """The path of a system program (nginx lives in /usr/sbin), or skip the test."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if path is None:
        pytest.skip(f"{name} is not installed (scripts/system-deps.sh installs it)")
    return path


def upstream_servers(nginx_conf: str) -> list[str]:
    """host:port of every `server` in the `specloop_api` upstream block."""
    block = re.search(r"upstream specloop_api \{(.*?)\}", nginx_conf, re.S)
    assert block, "no `upstream specloop_api` block"
    return re.findall(r"^\s*server\s+(\S+)", block.group(1), re.M)


@pytest.fixture(scope="module")
def compose() -> dict:
    """docker-compose.yml as docker-compose itself resolves it (anchors, defaults, env)."""
    exe = program("docker-compose")
    out = subprocess.run([exe, "-f", str(COMPOSE_FILE), "config"], capture_output=True, text=True,
                         env=os.environ | SECRETS, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


# ----------------------------------------------------------------------------- docker-compose


def test_compose_config_resolves_with_every_service(compose):
    assert set(compose["services"]) == SERVICES


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_compose_refuses_to_start_without_its_secrets(secret):
    exe = program("docker-compose")
    env = {k: v for k, v in os.environ.items() if k not in SECRETS} | SECRETS
    del env[secret]
    out = subprocess.run([exe, "-f", str(COMPOSE_FILE), "config"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=60)
    assert secret in out.stdout + out.stderr
    assert "services:" not in out.stdout


def test_every_long_running_service_has_a_healthcheck(compose):
    for name, service in compose["services"].items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_services_wait_for_what_they_need_to_be_healthy(compose):
    services = compose["services"]

    def waits_for(name: str, dependency: str) -> str:
        return services[name]["depends_on"][dependency]["condition"]

    assert waits_for("ray-head", "redis") == "service_healthy"
    assert waits_for("api-1", "ray-head") == "service_healthy"
    assert waits_for("api-2", "ray-head") == "service_healthy"
    assert waits_for("nginx", "api-1") == "service_healthy"
    assert waits_for("nginx", "api-2") == "service_healthy"
    assert waits_for("grafana", "prometheus") == "service_healthy"


def test_ray_nodes_and_api_replicas_run_the_specloop_commands(compose):
    services = compose["services"]
    command = {name: " ".join(services[name]["command"]) for name in ("ray-head", "ray-worker", "api-1", "api-2")}
    assert "ray start --head --port=6379" in command["ray-head"]
    assert "specloop" in command["ray-head"] and " serve " in command["ray-head"]
    assert "--verifier /models/verifier" in command["ray-head"]
    assert "--registry /var/lib/specloop/registry" in command["ray-head"]  # the shared volume
    assert "ray start --address=ray-head:6379" in command["ray-worker"] and "--block" in command["ray-worker"]
    for api in ("api-1", "api-2"):
        assert " api --ray-address " in command[api]
        assert "--port 8000" in command[api]


def test_every_specloop_process_sees_redis_and_the_models(compose):
    for name in SPECLOOP_SERVICES:
        service = compose["services"][name]
        assert service["environment"]["SPECLOOP_REDIS_URL"] == "redis://:redis-test-password@redis:6379/0"
        assert service["environment"]["SPECLOOP_ADMIN_TOKEN"] == "test-token"
        assert (service["environment"]["RAY_AUTH_MODE"], service["environment"]["RAY_AUTH_TOKEN"]) == ("token", "ray-test-token")
        targets = [v.split(":")[1] for v in service["volumes"]]
        assert "/models" in targets and "/var/lib/specloop/registry" in targets, name


def test_redis_runs_with_the_deploy_conf(compose):
    redis = compose["services"]["redis"]
    assert redis["command"][-1].startswith("exec redis-server /usr/local/etc/redis/redis.conf --requirepass ")
    assert any(v.startswith(f"{DEPLOY / 'redis' / 'redis.conf'}:/usr/local/etc/redis/redis.conf") for v in redis["volumes"])


def _seconds(duration: str) -> float:
    """A compose duration ("45s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", duration))


def test_compose_is_closed_by_default(compose):
    """Nothing is reachable without a secret: every specloop process asks clients for the API key and
    operators for the admin token, talks to a Redis that asks a password, and runs as a non-root user;
    host ports listen on 127.0.0.1 only; Grafana has no anonymous access and no default password; the
    drain (30 s) ends before Docker's SIGKILL."""
    from specloop.services.cli.options import Endpoint

    drain = Endpoint.__dataclass_fields__["drain_timeout"].default
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            published = port if isinstance(port, str) else f"{port.get('host_ip')}:{port['published']}"
            assert published.startswith("127.0.0.1:"), (name, port)
    for name in SPECLOOP_SERVICES:
        env = compose["services"][name]["environment"]
        assert env["SPECLOOP_API_KEY"] == SECRETS["SPECLOOP_API_KEY"], name
        assert f":{SECRETS['REDIS_PASSWORD']}@" in env["SPECLOOP_REDIS_URL"], name
        assert _seconds(compose["services"][name]["stop_grace_period"]) >= drain + 10, name
        assert "--docs" not in json.dumps(compose["services"][name].get("command")), name
    redis = compose["services"]["redis"]
    assert "ports" not in redis and redis["environment"]["REDIS_PASSWORD"] == SECRETS["REDIS_PASSWORD"]
    grafana = compose["services"]["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == SECRETS["GRAFANA_ADMIN_PASSWORD"]
    users = re.findall(r"^USER\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert users and users[-1] not in ("root", "0")


def test_nginx_prometheus_and_grafana_mount_the_deploy_configs(compose):
    services = compose["services"]
    assert f"{DEPLOY / 'nginx' / 'nginx.conf'}:/etc/nginx/nginx.conf:ro" in services["nginx"]["volumes"]
    assert f"{DEPLOY / 'prometheus'}:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    grafana = services["grafana"]["volumes"]
    assert f"{DEPLOY / 'grafana' / 'provisioning'}:/etc/grafana/provisioning:ro" in grafana
    assert f"{ROOT / 'dashboards'}:/etc/dashboards/specloop:ro" in grafana


# ----------------------------------------------------------------------------- nginx


def test_nginx_upstream_lists_both_api_replicas():
    servers = upstream_servers((DEPLOY / "nginx" / "nginx.conf").read_text())
    assert [s for s in servers] == ["api-1:8000", "api-2:8000"]


def test_nginx_conf_is_the_template_rendered_for_compose():
    """deploy/nginx/nginx.conf is generated: `python deploy/render.py --compose` after a template edit."""
    assert (DEPLOY / "nginx" / "nginx.conf").read_text() == render.render_nginx(render.COMPOSE_NGINX)


def test_nginx_balances_by_least_connections_and_streams_unbuffered():
    conf = (DEPLOY / "nginx" / "nginx.conf.template").read_text()
    assert re.search(r"upstream specloop_api \{\s*least_conn;", conf)
    assert "proxy_buffering off;" in conf
    assert re.search(r"proxy_read_timeout (\d+)s;", conf) and int(re.search(r"proxy_read_timeout (\d+)s;", conf)[1]) >= 300
    assert "proxy_next_upstream error timeout http_502 http_503;" in conf
    assert all("max_fails=" in line and "fail_timeout=" in line
               for line in conf.splitlines() if line.strip().startswith("server ${API_"))


def test_render_refuses_a_missing_or_unknown_value():
    template = (DEPLOY / "nginx" / "nginx.conf.template").read_text()
    with pytest.raises(KeyError, match="API_2"):
        render.render(template, {k: v for k, v in render.COMPOSE_NGINX.items() if k != "API_2"})
    with pytest.raises(KeyError, match="PORT"):
        render.render(template, render.COMPOSE_NGINX | {"PORT": "1"})
    rendered = render.render(template, render.COMPOSE_NGINX)
    assert "$host" in rendered and "${" not in rendered  # nginx's own variables stay


def test_render_cli_answers_help_and_refuses_bad_input_with_exit_code_2(tmp_path, capsys):
    assert render.main(["--help"]) == 0 and "NAME=VALUE" in capsys.readouterr().out
    assert render.main(["--bogus"]) == 2
    assert render.main([str(tmp_path / "missing.template"), "A=1"]) == 2
    assert "missing.template" in capsys.readouterr().err
    template = tmp_path / "t.template"
    template.write_text("listen ${LISTEN};\n")
    assert render.main([str(template), "PORT=1"]) == 2 and "no value" in capsys.readouterr().err
    assert render.main([str(template), "LISTEN=80"]) == 0 and capsys.readouterr().out == "listen 80;\n"


def test_nginx_accepts_the_rendered_test_template(tmp_path):
    exe = program("nginx")
    conf = tmp_path / "nginx.conf"
    conf.write_text(render.render_nginx({"LISTEN": "127.0.0.1:18080", "API_1": "127.0.0.1:18081",
                                         "API_2": "127.0.0.1:18082", "PID": str(tmp_path / "nginx.pid"),
                                         "TEMP": str(tmp_path)}))
    out = subprocess.run([exe, "-t", "-p", str(tmp_path), "-e", "stderr", "-c", str(conf)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "test is successful" in out.stderr


# ----------------------------------------------------------------------------- redis


def test_redis_conf_appends_every_second_and_never_evicts(tmp_path):
    """A real redis-server reads deploy/redis/redis.conf (port and folder overridden)."""
    import redis

    from tests.redis_helpers import free_port

    exe = program("redis-server")
    port = free_port()
    proc = subprocess.Popen([exe, str(DEPLOY / "redis" / "redis.conf"), "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path), "--requirepass", "pw"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_timeout=5, password="pw")
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server rejected deploy/redis/redis.conf"
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.05)
        config = client.config_get("*")
        assert config["appendonly"] == "yes"
        assert config["appendfsync"] == "everysec"
        assert config["maxmemory-policy"] == "noeviction"
        assert int(config["maxmemory"]) == 2 * 1024**3
        assert config["protected-mode"] == "yes"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()
        for wipe in ("FLUSHALL", "FLUSHDB"):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                client.execute_command(wipe)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ----------------------------------------------------------------------------- prometheus


def test_promtool_accepts_the_prometheus_config():
    exe = program("promtool")
    config = DEPLOY / "prometheus" / "prometheus.yml"
    # without alerts.yml (written by the metrics module) only the syntax can be checked
    args = [] if (DEPLOY / "prometheus" / "alerts.yml").exists() else ["--syntax-only"]
    out = subprocess.run([exe, "check", "config", *args, str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_scrapes_the_api_replicas_and_discovers_workers_through_the_api():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["specloop-api"]["static_configs"][0]["targets"] == ["api-1:8000", "api-2:8000"]
    assert jobs["specloop-actors"]["http_sd_configs"][0]["url"].endswith("/sd/targets")
    assert config["rule_files"] == ["alerts.yml"]


# ----------------------------------------------------------------------------- grafana


def test_grafana_provisions_prometheus_and_the_dashboards_folder():
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [(d["type"], d["uid"], d["url"]) for d in datasources] == [("prometheus", "prometheus", "http://prometheus:9090")]
    providers = yaml.safe_load((provisioning / "dashboards" / "specloop.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == ["/etc/dashboards/specloop"]


def test_the_dashboard_names_the_provisioned_datasource():
    dashboard = ROOT / "dashboards" / "specloop.json"
    if not dashboard.exists():
        pytest.skip("dashboards/specloop.json is not generated yet")
    text = dashboard.read_text()
    uids = set(re.findall(r'"datasource":\s*\{[^}]*"uid":\s*"([^"]+)"', text))
    assert uids <= {"prometheus", "${datasource}", "${DS_PROMETHEUS}", "$datasource", "-- Grafana --"}, uids
    json.loads(text)


# ----------------------------------------------------------------------------- image


def test_the_image_installs_the_cpu_build_of_the_pinned_torch():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "FROM python:3.11-slim" in dockerfile
    pinned = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert f"pip install torch=={pinned} --index-url https://download.pytorch.org/whl/cpu" in dockerfile
