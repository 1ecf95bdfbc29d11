import hmac
import math

import pytest
import torch
from fastapi.testclient import TestClient

from specloop.services.registry.registry import Registry
from tests.admin_helpers import (
    TOKEN,
    WorkerListBackend,
    admin_app,
    filled_buffer,
    publish,
    seeded_registry,
    worker_info,
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENDPOINTS = [
    ("GET", "/admin/drafter/versions"),
    ("GET", "/admin/drafter/status"),
    ("POST", "/admin/drafter/pin"),
    ("POST", "/admin/drafter/unpin"),
    ("POST", "/admin/drafter/rollback"),
    ("GET", "/admin/buffer/stats"),
]


@pytest.fixture
def reg(tmp_path):
    return seeded_registry(tmp_path / "registry")


@pytest.fixture
def backend(reg):
    workers = [worker_info("worker-0", reg.root, "v0002"), worker_info("worker-1", reg.root, "v0001")]
    return WorkerListBackend(workers, filled_buffer())


@pytest.fixture
def client(backend):
    with TestClient(admin_app(backend)) as c:
        yield c


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---- auth


@pytest.mark.parametrize("method,path", ENDPOINTS)
def test_every_endpoint_refuses_a_request_without_a_token(client, method, path):
    resp = client.request(method, path, json={"version": "v0001"})
    err = _error(resp, 401)
    assert err["type"] == "authentication_error" and err["code"] == "missing_token"
    assert resp.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}x", "Bearer wrong", f"Basic {TOKEN}", "Bearer", TOKEN])
def test_a_wrong_or_malformed_token_is_refused(client, header):
    err = _error(client.get("/admin/drafter/versions", headers={"Authorization": header}), 401)
    assert err["type"] == "authentication_error"


def test_the_right_token_is_accepted_whatever_the_scheme_case(client):
    assert client.get("/admin/drafter/versions", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200


def test_tokens_are_compared_in_constant_time(client, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert client.get("/admin/drafter/versions", headers=AUTH).status_code == 200
    assert client.get("/admin/drafter/versions", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert calls == [(TOKEN.encode(), TOKEN.encode()), (b"nope", TOKEN.encode())]


@pytest.mark.parametrize("token", [None, ""])
@pytest.mark.parametrize("method,path", ENDPOINTS)
def test_admin_endpoints_are_disabled_without_a_configured_token(backend, token, method, path):
    with TestClient(admin_app(backend, token=token)) as c:
        err = _error(c.request(method, path, headers=AUTH), 403)
    assert err["message"] == "admin endpoints disabled: set SPECLOOP_ADMIN_TOKEN"


def test_authentication_comes_before_body_validation(client):
    assert client.post("/admin/drafter/pin", content=b"not json").status_code == 401


# ---- reading


def test_versions_lists_every_version_oldest_first_with_champion_and_pin_flags(client):
    body = client.get("/admin/drafter/versions", headers=AUTH).json()
    assert body["object"] == "list"
    rows = body["data"]
    assert [r["id"] for r in rows] == ["v0001", "v0002", "v0003"]
    assert [r["parent"] for r in rows] == [None, "v0001", "v0002"]
    assert [r["champion"] for r in rows] == [False, True, False]
    assert not any(r["pinned"] for r in rows)
    assert rows[1]["metrics"] == {"loss": 2.25, "sim_acceptance": 0.6}
    assert rows[1]["learner_step"] == 20 and rows[1]["objective"] == "kl" and rows[1]["created"] > 0


def test_versions_show_a_nan_metric_as_a_string(client, reg):
    publish(reg, float("nan"), seed=4)
    last = client.get("/admin/drafter/versions", headers=AUTH).json()["data"][-1]
    assert last["metrics"]["sim_acceptance"] == "nan"


def test_status_names_the_champion_each_workers_version_and_recent_events(client):
    body = client.get("/admin/drafter/status", headers=AUTH).json()
    assert (body["champion"], body["pinned"], body["previous_champions"]) == ("v0002", None, ["v0001"])
    assert body["workers"] == [{"name": "worker-0", "drafter_version": "v0002"},
                               {"name": "worker-1", "drafter_version": "v0001"}]
    kinds = [e["event"] for e in body["events"]]
    assert kinds == ["publish", "promote", "publish", "promote", "publish"]


def test_status_returns_only_as_many_events_as_asked(client):
    body = client.get("/admin/drafter/status?events=2", headers=AUTH).json()
    assert [e["version"] for e in body["events"]] == ["v0002", "v0003"]
    assert client.get("/admin/drafter/status?events=0", headers=AUTH).json()["events"] == []


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "100000"])
def test_status_refuses_a_bad_events_count_with_400(client, value):
    err = _error(client.get(f"/admin/drafter/status?events={value}", headers=AUTH), 400)
    assert err["param"] == "events"


def test_changes_made_by_another_registry_process_are_visible(client, reg):
    Registry(reg.root).pin("v0003")
    body = client.get("/admin/drafter/status", headers=AUTH).json()
    assert (body["champion"], body["pinned"]) == ("v0003", "v0003")


# ---- changing


def test_pin_makes_the_version_champion_and_freezes_it(client, reg):
    resp = client.post("/admin/drafter/pin", json={"version": "v0003"}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"champion": "v0003", "pinned": "v0003", "previous_champions": ["v0001", "v0002"],
                           "generation": reg.alias().generation}
    assert (reg.champion(), reg.pinned()) == ("v0003", "v0003")
    better = publish(reg, 0.99, seed=5)
    assert not reg.promote(better.id).promoted  # the learner cannot promote past the pin


def test_unpin_releases_the_pin_and_keeps_the_champion(client, reg):
    reg.pin("v0001")
    resp = client.post("/admin/drafter/unpin", headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert (resp.json()["champion"], resp.json()["pinned"]) == ("v0001", None)
    assert (reg.champion(), reg.pinned()) == ("v0001", None)


def test_unpin_without_a_pin_changes_nothing(client, reg):
    before = reg.alias()
    assert client.post("/admin/drafter/unpin", json={}, headers=AUTH).status_code == 200
    assert reg.alias() == before


def test_rollback_returns_to_the_previous_champion_and_logs_the_reason(client, reg):
    resp = client.post("/admin/drafter/rollback", json={"reason": "acceptance fell to 0.1"}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert (resp.json()["champion"], resp.json()["previous_champions"]) == ("v0001", [])
    assert reg.champion() == "v0001"
    last = reg.events(1)[0]
    assert (last["event"], last["version"], last["reason"]) == ("rollback", "v0001", "acceptance fell to 0.1")


def test_rollback_without_a_body_uses_a_default_reason(client, reg):
    assert client.post("/admin/drafter/rollback", headers=AUTH).status_code == 200
    assert reg.events(1)[0]["reason"] == "operator rollback"


def test_rollback_with_no_previous_champion_is_refused_with_409(client, reg):
    assert client.post("/admin/drafter/rollback", headers=AUTH).status_code == 200
    err = _error(client.post("/admin/drafter/rollback", headers=AUTH), 409)
    assert "no previous champion" in err["message"] and err["type"] == "conflict_error"
    assert reg.champion() == "v0001"


def test_rollback_while_pinned_is_refused_with_409(client, reg):
    reg.pin()
    err = _error(client.post("/admin/drafter/rollback", headers=AUTH), 409)
    assert "pinned to v0002" in err["message"]
    assert reg.champion() == "v0002"


def test_pin_of_an_unknown_version_is_404(client, reg):
    err = _error(client.post("/admin/drafter/pin", json={"version": "v0042"}, headers=AUTH), 404)
    assert err["message"] == "unknown version v0042" and err["code"] == "unknown_version"
    assert reg.pinned() is None


def test_pin_of_non_finite_weights_is_refused_with_409(client, reg):
    bad = reg.publish({"w": torch.tensor([math.nan])}, parent=None, learner_step=0, objective="kl", loss=None,
                      sim_acceptance=None, kind="pretrained")
    err = _error(client.post("/admin/drafter/pin", json={"version": bad.id}, headers=AUTH), 409)
    assert "non-finite" in err["message"]
    assert reg.champion() == "v0002"


@pytest.mark.parametrize("path,content", [
    ("/admin/drafter/pin", b"not json"),
    ("/admin/drafter/pin", b"[\"v0001\"]"),
    ("/admin/drafter/pin", b"{}"),
    ("/admin/drafter/pin", b"{\"version\": 3}"),
    ("/admin/drafter/pin", b"{\"version\": \"\"}"),
    ("/admin/drafter/pin", b"{\"version\": \"latest\"}"),
    ("/admin/drafter/pin", b"{\"version\": \"../v0001\"}"),
    ("/admin/drafter/pin", b"{\"version\": \"v0001\", \"force\": true}"),
    ("/admin/drafter/pin", b"\xff\xfe"),
    ("/admin/drafter/rollback", b"{\"reason\": 5}"),
    ("/admin/drafter/rollback", b"{\"reason\": \"  \"}"),
    ("/admin/drafter/rollback", b"{\"why\": \"x\"}"),
    ("/admin/drafter/unpin", b"{\"version\": \"v0001\"}"),
])
def test_bad_bodies_are_answered_400_never_422(client, reg, path, content):
    before = reg.alias()
    err = _error(client.post(path, content=content, headers=AUTH | {"Content-Type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error"
    assert reg.alias() == before


# ---- buffer and deployment shapes


def test_buffer_stats_report_the_backends_replay_buffer(client):
    stats = client.get("/admin/buffer/stats", headers=AUTH).json()
    assert stats == {"backend": "memory", "written": 5, "dropped": 0, "depth": 5, "pending": 1,
                     "memory_bytes": 5 * len(b"record")}


def test_buffer_stats_without_a_buffer_are_404(reg):
    backend = WorkerListBackend([worker_info("w", reg.root, "v0002")], buffer=None)
    with TestClient(admin_app(backend)) as c:
        err = _error(c.get("/admin/buffer/stats", headers=AUTH), 404)
    assert "no replay buffer" in err["message"]


@pytest.mark.parametrize("path", ["/admin/drafter/versions", "/admin/drafter/status"])
def test_a_deployment_without_a_registry_answers_404(path):
    backend = WorkerListBackend([worker_info("w", None, "base")])
    with TestClient(admin_app(backend)) as c:
        err = _error(c.get(path, headers=AUTH), 404)
    assert err["message"] == "this deployment has no drafter registry"


def test_with_no_live_worker_the_registry_cannot_be_found_and_the_answer_is_503():
    with TestClient(admin_app(WorkerListBackend([]))) as c:
        err = _error(c.get("/admin/drafter/status", headers=AUTH), 503)
    assert "no live worker" in err["message"]
