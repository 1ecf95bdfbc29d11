"""The HTTP API: OpenAI-compatible completions over a `Backend` (services/api/backend.py).

Every endpoint, parameter and error is described in docs/api.md. The pieces:
- services/api/schemas.py: request bodies, the OpenAI error object, hostile-input guards;
- services/api/planning.py: a request body → a `Plan` (prompts, budgets, stop strings, seeds);
- services/api/streaming.py: the fan-out over the backend and the response / SSE shapes;
- this module: `create_app` (the routes), `api_server` / `run_api` (uvicorn).

Parsing and tokenizing run on one planner thread, never on the event loop that streams. Every
admitted completion request ends through one exit (`Completions.close`): its backend streams are
closed and it is recorded in the metrics, however it ended.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypedDict

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specloop.services.api.auth import ApiKeyAuth
from specloop.services.api.backend import Backend
from specloop.services.api.drain import DRAIN_TIMEOUT_S, Drain, DrainingServer
from specloop.services.api.logprobs import TokenTexts
from specloop.services.api.planning import (
    DEFAULT_MAX_TOKENS,
    ApiConfig,
    Plan,
    detokenize,
    plan_body,
    prompt_bytes_limit,
    tokenize,
)
from specloop.services.api.schemas import ApiError, error_response, not_found, read_body, validation_message
from specloop.services.api.streaming import (
    CLIENT_CLOSED,
    SSE_HEADERS,
    ClientGone,
    ClosingStream,
    Fanout,
    Progress,
    Shapes,
    collect,
    open_choices,
    stream_events,
)
from specloop.services.metrics.federate import FEDERATE_TIMEOUT_S, federated
from specloop.services.protocol import Chunk, ErrorInfo

log = logging.getLogger("specloop.api")

SD_JOB = "specloop-actors"  # the job label of /sd/targets
SHUTTING_DOWN = "shutting_down"  # the code of a 503 from a draining replica


def package_version() -> str:
    try:
        return importlib.metadata.version("specloop")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


VERSION = package_version()


# -------------------------------------------------------------------------------------------- metrics


class NullMetrics:
    """The ApiMetrics interface (services/metrics/__init__.py), doing nothing."""

    def request(self, endpoint: str, status: int) -> None: ...
    def ttft(self, seconds: float) -> None: ...
    def itl(self, seconds: float) -> None: ...
    def request_time_per_output_token(self, seconds: float) -> None: ...
    def e2e(self, seconds: float) -> None: ...
    def queue_time(self, seconds: float) -> None: ...
    def prompt_tokens(self, n: int) -> None: ...
    def generated(self, n: int) -> None: ...
    def finished(self, reason: str) -> None: ...


def record(metrics, endpoint: str, status: int, call: Call | None = None) -> None:
    """The request's status; for an admitted one (vLLM's request metrics): its prompt tokens, per choice the
    time before a worker's slot took it (queue), and per choice TTFT (arrival → first token), each gap
    between two chunks that carried tokens (ITL), the mean time per output token after the first
    ((end − first token) / (tokens − 1)), its tokens and its finish reason; e2e when answered."""
    metrics.request(endpoint, status)
    if call is None:
        return
    progress = call.progress
    metrics.prompt_tokens(sum(call.plan.prompt_lens))
    for c, reason in zip(progress.choices, progress.finish_reasons()):
        # queue: planning and hand-off here, then the wait for a worker's cache slot (in its usage)
        metrics.queue_time(progress.sent_s - progress.arrival_s + (c.usage.queue_time_s if c.usage else 0.0))
        if c.first_token_s is not None:
            metrics.ttft(c.first_token_s - progress.arrival_s)
            if c.tokens > 1 and c.end_s is not None:
                metrics.request_time_per_output_token((c.end_s - c.first_token_s) / (c.tokens - 1))
        for gap in c.gaps_s:
            metrics.itl(gap)
        metrics.generated(c.tokens)
        metrics.finished(reason)
    if status == 200:
        metrics.e2e(time.perf_counter() - progress.arrival_s)


# ---------------------------------------------------------------------------------------- completions


# what a draining replica answers a new request with, and ends a request in flight with at the deadline
SHUTDOWN = ErrorInfo("this API replica is shutting down; retry the request", "overloaded_error", 503,
                     code=SHUTTING_DOWN)


@dataclass
class Call:
    """One admitted completion request: its plan, backend streams and progress."""

    endpoint: str
    plan: Plan
    fanout: Fanout
    progress: Progress
    drain_token: int | None = None  # in flight for the drain (services/api/drain.py) until closed
    closed: bool = False


class Completions:
    """`POST /v1/chat/completions` and `/v1/completions`: admit (read, plan, check the workers), open
    the choices, answer in full or as a stream, and close the call once."""

    def __init__(self, backend: Backend, tokenizer, cfg: ApiConfig, metrics, drain: Drain):
        self.backend, self.tokenizer, self.cfg, self.metrics, self.drain = backend, tokenizer, cfg, metrics, drain
        # parsing and tokenizing run here, one request at a time (a tokenizer is not safe to share between
        # threads), so that a large prompt never holds the event loop and the streams it serves
        self.planner = ThreadPoolExecutor(1, thread_name_prefix="specloop-planner")
        self.texts = TokenTexts(tokenizer)  # log-probabilities' token strings, decoded on the event loop

    async def __call__(self, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        try:
            plan = await self.admit(request, chat)
        except ApiError as err:
            record(self.metrics, request.url.path, err.status)
            closing = {"Connection": "close"} if err.code == SHUTTING_DOWN else None
            return error_response(err, self.cfg.retry_after_s, closing)
        call = Call(request.url.path, plan, Fanout(self.backend, plan.requests),
                    Progress.start(arrival, len(plan.requests)))
        call.drain_token = self.drain.enter(lambda: call.fanout.abort(Chunk(plan.id, error=SHUTDOWN)))
        response = None
        try:
            response = await self.answer(call, request)
            return response
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            if not isinstance(response, ClosingStream):  # a stream closes the call when it ends
                self.close(call)

    async def admit(self, request: Request, chat: bool) -> Plan:
        if self.drain.draining:
            raise ApiError.from_info(SHUTDOWN)
        raw = await read_body(request, self.cfg.max_body_bytes)
        plan = await self.run_planner(plan_body, raw, chat, self.cfg, self.tokenizer)
        if not await live_workers(self.backend):
            raise ApiError(503, "no worker is alive; retry later", "overloaded_error", code="no_worker")
        return plan

    async def run_planner(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.planner, fn, *args)

    async def answer(self, call: Call, request: Request) -> Response:
        """An early error as its status, the full answer, or the stream (which closes the call itself)."""
        call.fanout.watch(request)
        opened = await open_choices(call.fanout, call.progress)
        if call.progress.error is not None:
            return error_response(ApiError.from_info(call.progress.error), self.cfg.retry_after_s)
        if not call.plan.stream:
            await collect(call.fanout, call.progress)
            if call.progress.error is not None:
                return error_response(ApiError.from_info(call.progress.error), self.cfg.retry_after_s)
            return JSONResponse(self.shapes(call.plan).full(call.progress))
        call.fanout.unwatch()
        return ClosingStream(stream_events(self.shapes(call.plan), call.fanout, call.progress, opened),
                             lambda: self.close(call), media_type="text/event-stream", headers=SSE_HEADERS)

    def shapes(self, plan: Plan) -> Shapes:
        return Shapes(plan, self.cfg.model_id, self.texts)

    def close(self, call: Call) -> None:
        """The one exit of an admitted request: its backend streams stop, and it is recorded."""
        if call.closed:
            return
        call.closed = True
        call.fanout.close()
        assert call.drain_token is not None  # set in __call__ as soon as the Call is made
        self.drain.leave(call.drain_token)
        try:
            record(self.metrics, call.endpoint, call.progress.status, call)
        except Exception:  # a metric never fails the answer it measures
            log.exception("recording the metrics of %s failed", call.plan.id)


# ---------------------------------------------------------------------------------------------- the app


class DocsUrls(TypedDict, total=False):
    """FastAPI's documentation routes, passed as None to serve none of them."""

    docs_url: str | None
    redoc_url: str | None
    openapi_url: str | None


def create_app(backend: Backend, tokenizer, model_id: str, max_context: int, admin_router: APIRouter | None = None,
               metrics=None, default_max_tokens: int = DEFAULT_MAX_TOKENS, api_key: str | None = None,
               docs: bool = False, chat_template: str | None = None) -> FastAPI:
    """The API over `backend`. `tokenizer` is the verifier's (chat template, prompt encoding);
    `metrics` an ApiMetrics (services/metrics/__init__.py) or None (no /metrics, nothing recorded); `api_key`
    (when set) is asked of every /v1 route and /tokenize, /detokenize (services/api/auth.py); `docs`:
    serve /docs, /redoc and /openapi.json (off: 404); `chat_template`: the Jinja template of chat requests
    (--chat-template; None: the tokenizer's own)."""
    cfg = ApiConfig(model_id, max_context, default_max_tokens,
                    max_prompt_bytes=prompt_bytes_limit(tokenizer, max_context), chat_template=chat_template)
    hidden: DocsUrls = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="specloop", summary="OpenAI-compatible speculative decoding", version=VERSION, **hidden)
    app.state.api, app.state.drain = cfg, Drain()
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    add_error_handlers(app, cfg)
    completions = Completions(backend, tokenizer, cfg, metrics if metrics is not None else NullMetrics(),
                              app.state.drain)
    add_completion_routes(app, completions)
    add_token_routes(app, completions)
    add_status_routes(app, backend, cfg, app.state.drain)
    if metrics is not None:
        add_metrics_route(app, metrics, backend)
    if admin_router is not None:
        app.include_router(admin_router)
    return app


def add_error_handlers(app: FastAPI, cfg: ApiConfig) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_message(exc))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, cfg.retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown route, wrong method
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)
        return error_response(err, cfg.retry_after_s, exc.headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:  # logged by the server as well
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))


def add_completion_routes(app: FastAPI, completions: Completions) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)


def add_token_routes(app: FastAPI, completions: Completions) -> None:
    """/tokenize and /detokenize (vLLM's shapes), on the planner thread like a completion's prompt."""
    cfg, tokenizer = completions.cfg, completions.tokenizer

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        raw = await read_body(request, cfg.max_body_bytes)
        return await completions.run_planner(tokenize, raw, cfg, tokenizer)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        raw = await read_body(request, cfg.max_body_bytes)
        return await completions.run_planner(detokenize, raw, cfg, tokenizer)


def add_status_routes(app: FastAPI, backend: Backend, cfg: ApiConfig, drain: Drain) -> None:
    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [await model_card(backend, cfg)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        if model != cfg.model_id:
            raise not_found(model)
        return await model_card(backend, cfg)

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = await live_workers(backend)
        return JSONResponse({"status": "ok" if workers else "unavailable", "workers": workers},
                            status_code=200 if workers else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        ok = await backend_ready(backend)
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/sd/targets")
    async def sd_targets() -> list:
        targets = await backend.metrics_targets()
        return [{"targets": list(targets), "labels": {"job": SD_JOB}}] if targets else []


def add_metrics_route(app: FastAPI, metrics, backend: Backend | None = None,
                      timeout: float = FEDERATE_TIMEOUT_S) -> None:
    """GET /metrics: the API's own series (`metrics`) and those of every metrics endpoint behind `backend`
    (the workers', labelled `worker`, and the learner's: services/metrics/federate.py), each read within
    `timeout` s; GET /metrics?federate=false: the API's own only, for a Prometheus that also scrapes the
    endpoints listed at /sd/targets."""
    @app.get("/metrics")
    async def prometheus(federate: bool = True) -> Response:
        if federate and backend is not None:
            body, content_type = await federated(metrics, backend, timeout)
        else:
            body, content_type = metrics.render()
        return Response(body, media_type=content_type)


async def live_workers(backend: Backend) -> int:
    try:
        return len(await backend.workers())
    except Exception:
        log.exception("backend.workers() failed")
        return 0


async def backend_ready(backend: Backend) -> bool:
    try:
        return await backend.ready() and await live_workers(backend) > 0
    except Exception:
        log.exception("backend.ready() failed")
        return False


async def model_card(backend: Backend, cfg: ApiConfig) -> dict:
    try:
        workers = await backend.workers()
    except Exception:
        workers = []
    return {"id": cfg.model_id, "object": "model", "created": int(time.time()), "owned_by": "specloop",
            "max_model_len": cfg.max_context, "drafter_version": workers[0].drafter_version if workers else None,
            "weights": workers[0].weights if workers else None}


# ---------------------------------------------------------------------------------------------- serving


def api_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
               drain_timeout: float = DRAIN_TIMEOUT_S, log_level: str = "warning") -> DrainingServer:
    """A uvicorn server for `app` (`log_level`: uvicorn's, warning by default; its access log at info and
    below); `.run()` blocks until SIGTERM / SIGINT and the drain (services/api/drain.py),
    `.handle_exit(signal.SIGTERM, None)` starts the drain from anywhere, `.should_exit` stops it without one."""
    import uvicorn

    access_log = log_level in ("info", "debug", "trace")  # uvicorn logs each request at info
    # uvicorn types timeout_graceful_shutdown int | None, but uses it as asyncio.wait_for's timeout (a float works)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=drain_timeout)  # type: ignore[arg-type]
    return DrainingServer(config, app.state.drain, drain_timeout)


def run_api(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = DRAIN_TIMEOUT_S,
            log_level: str = "warning") -> None:
    """Serve `app` until SIGTERM / SIGINT, then drain (`specloop serve` / `specloop api`); `log_level`: uvicorn's."""
    api_server(app, host, port, drain_timeout, log_level).run()
