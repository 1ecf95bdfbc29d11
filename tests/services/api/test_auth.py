"""services/api/auth.py: with an API key set, /v1 and the token routes ask for `Authorization: Bearer KEY`
(a 401 in OpenAI's shape otherwise); probes, metrics and the admin router do not. Through uvicorn."""
from __future__ import annotations

import httpx
import openai
import pytest
from fastapi import APIRouter

from specloop.services.api.auth import bearer_token, guarded, key_error
from tests.admin_helpers import serving
from tests.api_helpers import MODEL, scripted, scripted_app

KEY = "sk-specloop-test"


@pytest.fixture(scope="module")
def url(tiny_pair):
    from prometheus_client import CollectorRegistry

    from specloop.services.metrics.api import ApiMetrics

    admin = APIRouter(prefix="/admin")
    admin.get("/ping")(lambda: {"pong": True})
    app = scripted_app(scripted(tiny_pair[0]), api_key=KEY, admin_router=admin, metrics=ApiMetrics(CollectorRegistry()))
    with serving(app) as base:
        yield base


def test_the_bearer_token_is_read_in_any_scheme_case():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token(None) is None and bearer_token("Basic abc") is None and bearer_token("Bearer ") is None


def test_a_wrong_or_missing_key_is_an_invalid_api_key_error():
    assert key_error(f"Bearer {KEY}", KEY.encode()) is None
    for header in (None, "Bearer nope", f"Bearer {KEY}x", KEY, "Bearer \udcff"):
        err = key_error(header, KEY.encode())
        assert err.status == 401 and err.code == "invalid_api_key" and err.type == "invalid_request_error"


def test_only_the_openai_and_token_routes_are_guarded():
    assert all(guarded(p) for p in ("/v1/completions", "/v1/models/x", "/v1/anything", "/v1", "/tokenize", "/detokenize"))
    assert not any(guarded(p) for p in ("/health", "/ready", "/metrics", "/version", "/admin/versions", "/v1x"))


@pytest.mark.parametrize("path, body", [("/v1/models", None), ("/v1/chat/completions", {"model": MODEL}),
                                        ("/v1/no-such-route", None), ("/tokenize", {"prompt": "x"}),
                                        ("/detokenize", {"tokens": [1]})])
def test_a_request_without_the_key_is_a_401_in_openai_shape(url, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.request("POST" if body else "GET", url + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key" and err["param"] is None
        assert err["message"] and r.headers["www-authenticate"] == "Bearer"


def test_the_key_opens_the_api_to_the_openai_client(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id == MODEL
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3).choices[0].text
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}, headers=auth).json()["count"] >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_probes_metrics_version_and_the_admin_router_need_no_api_key(url):
    for path in ("/health", "/ready", "/metrics", "/version", "/admin/ping"):
        assert httpx.get(url + path, timeout=10).status_code == 200, path
