"""Operator endpoints: the drafter registry and the replay buffer, under /admin, behind a token.

    GET  /admin/drafter/versions   {"object": "list", "data": [version, ...]}, oldest first
    GET  /admin/drafter/status     champion, pin, previous champions, each live worker's version,
                                   recent registry events (?events=N, default 20)
    POST /admin/drafter/pin        {"version": "v0002"}: make it the champion and freeze it
    POST /admin/drafter/unpin      no body
    POST /admin/drafter/rollback   optional {"reason": "..."}: champion := the previous champion
    GET  /admin/buffer/stats       the backend's replay buffer statistics

Auth: every endpoint wants `Authorization: Bearer <SPECLOOP_ADMIN_TOKEN>`, compared in constant
time (`hmac.compare_digest`). With no token configured (None or empty) every endpoint answers 403.

The registry is the one the first live worker names (WorkerInfo.registry, redis_url, prefix).

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`, and never 422:
400 bad body or malformed version id, 401 missing / wrong token, 403 admin disabled,
404 unknown version / no registry / no buffer, 409 an operation the registry refuses
(rollback with no previous champion or while pinned, pin of non-finite weights),
503 no live worker to find the registry from.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from specloop.services.protocol import WorkerInfo
from specloop.services.registry.registry import Registry
from specloop.services.registry.types import VERSION_RE, AliasState, RegistryError, VersionInfo

DEFAULT_EVENTS = 20
MAX_EVENTS = 1000
DISABLED = "admin endpoints disabled: set SPECLOOP_ADMIN_TOKEN"


class AdminError(Exception):
    """An admin request that fails: carries its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> AdminError:
    return AdminError(400, message, "invalid_request_error", "bad_request", param)


def not_found(message: str, code: str) -> AdminError:
    return AdminError(404, message, "not_found_error", code)


def refused(message: str) -> AdminError:
    return AdminError(409, message, "conflict_error", "refused")


class _AdminRoute(APIRoute):
    """Answers an AdminError (or a RegistryError nothing more specific caught: 409) as its JSON."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            try:
                return await handler(request)
            except AdminError as exc:
                return exc.response()
            except RegistryError as exc:
                return refused(str(exc)).response()

        return guarded


# ---------------------------------------------------------------- pure pieces


def check_token(header: str | None, token: str | None) -> None:
    """Raise unless `header` is `Bearer <token>`; 403 when no token is configured."""
    if not token:
        raise AdminError(403, DISABLED, "permission_error", "admin_disabled")
    scheme, _, given = (header or "").strip().partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        message = "missing admin token: send 'Authorization: Bearer <SPECLOOP_ADMIN_TOKEN>'"
        raise AdminError(401, message, "authentication_error", "missing_token")
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise AdminError(401, "invalid admin token", "authentication_error", "invalid_token")


def parse_body(raw: bytes, allowed: set[str]) -> dict:
    """An optional JSON object with only `allowed` keys ({} for an empty body)."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unknown fields {unknown}; expected {sorted(allowed) or 'none'}", unknown[0])
    return body


def version_field(body: dict) -> str:
    version = body.get("version")
    if not isinstance(version, str) or not version:
        raise bad_request("'version' must be a version id such as 'v0002'", "version")
    if not VERSION_RE.fullmatch(version):
        raise bad_request(f"bad version id {version!r}: expected 'v' and at least 4 digits, e.g. 'v0001'", "version")
    return version


def reason_field(body: dict, default: str = "operator rollback") -> str:
    reason = body.get("reason", default)
    if not isinstance(reason, str) or not reason.strip():
        raise bad_request("'reason' must be a non-empty string", "reason")
    return reason.strip()


def events_param(value: str | None) -> int:
    if value is None:
        return DEFAULT_EVENTS
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_EVENTS:
        raise bad_request(f"'events' must be an integer in [0, {MAX_EVENTS}], got {value!r}", "events")
    return n


@dataclass(frozen=True)
class RegistryLocation:
    folder: str
    redis_url: str | None
    prefix: str


def registry_location(workers: list[WorkerInfo]) -> RegistryLocation:
    """Where the registry is, as the first live worker says."""
    if not workers:
        raise AdminError(503, "no live worker: cannot locate the drafter registry", "server_error", "no_worker")
    first = workers[0]
    if not first.registry:
        raise not_found("this deployment has no drafter registry", "no_registry")
    return RegistryLocation(first.registry, first.redis_url, first.prefix)


def version_row(info: VersionInfo, alias: AliasState) -> dict:
    d = info.to_dict()
    return {
        "id": d["id"], "parent": d["parent"], "created": d["created"], "kind": d["kind"],
        "objective": d["objective"], "learner_step": d["learner_step"],
        "metrics": {"loss": d["loss"], "sim_acceptance": d["sim_acceptance"]}, "extra": d["extra"],
        "champion": info.id == alias.champion, "pinned": info.id == alias.pinned,
    }


def alias_body(alias: AliasState) -> dict:
    return {"champion": alias.champion, "pinned": alias.pinned, "previous_champions": list(alias.history),
            "generation": alias.generation}


def status_body(alias: AliasState, workers: list[WorkerInfo], events: list[dict]) -> dict:
    serving = [{"name": w.name, "drafter_version": w.drafter_version} for w in workers]
    return alias_body(alias) | {"workers": serving, "events": events}


def require_version(registry: Registry, version: str) -> None:
    try:
        registry.get(version)
    except RegistryError as exc:
        raise not_found(str(exc), "unknown_version") from None


# ---------------------------------------------------------------- router


def make_admin_router(backend, token: str | None) -> APIRouter:
    """The /admin endpoints over `backend` (specloop.services.api.backend.Backend: `workers`, `buffer_stats`)."""
    registries: dict[RegistryLocation, Registry] = {}

    async def authorize(request: Request) -> None:
        check_token(request.headers.get("authorization"), token)

    async def registry() -> tuple[Registry, list[WorkerInfo]]:
        workers = await backend.workers()
        where = registry_location(workers)
        if where not in registries:
            registries[where] = await run_in_threadpool(Registry, where.folder, where.redis_url, where.prefix)
        return registries[where], workers

    router = APIRouter(prefix="/admin", tags=["admin"], route_class=_AdminRoute, dependencies=[Depends(authorize)])

    @router.get("/drafter/versions")
    async def versions() -> dict:
        reg, _ = await registry()
        infos, alias = await run_in_threadpool(lambda: (reg.list(), reg.alias()))
        return {"object": "list", "data": [version_row(i, alias) for i in infos]}

    @router.get("/drafter/status")
    async def status(request: Request) -> dict:
        limit = events_param(request.query_params.get("events"))
        reg, workers = await registry()
        alias, events = await run_in_threadpool(lambda: (reg.alias(), reg.events(limit)))
        return status_body(alias, workers, events)

    @router.post("/drafter/pin")
    async def pin(request: Request) -> dict:
        version = version_field(parse_body(await request.body(), {"version"}))
        reg, _ = await registry()
        await run_in_threadpool(require_version, reg, version)
        await run_in_threadpool(reg.pin, version)
        return alias_body(await run_in_threadpool(reg.alias))

    @router.post("/drafter/unpin")
    async def unpin(request: Request) -> dict:
        parse_body(await request.body(), set())
        reg, _ = await registry()
        await run_in_threadpool(reg.unpin)
        return alias_body(await run_in_threadpool(reg.alias))

    @router.post("/drafter/rollback")
    async def rollback(request: Request) -> dict:
        reason = reason_field(parse_body(await request.body(), {"reason"}))
        reg, _ = await registry()
        await run_in_threadpool(reg.rollback, reason)
        return alias_body(await run_in_threadpool(reg.alias))

    @router.get("/buffer/stats")
    async def buffer_stats() -> dict:
        stats = await backend.buffer_stats()
        if stats is None:
            raise not_found("no replay buffer: this deployment does not log replay records", "no_buffer")
        return stats

    return router
