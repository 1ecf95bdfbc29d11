"""Operator commands: `specloop drafter list|status|pin|unpin|rollback` and `specloop buffer stats`.

They talk HTTP to a running specloop's admin API (services/api/admin.py) at --url (default
$SPECLOOP_URL, else http://127.0.0.1:8000) with the token --token (default $SPECLOOP_ADMIN_TOKEN).
Readable tables by default; --json prints the server's JSON for scripts.

Exit codes: 0 done; 2 bad input (an empty version, a bad URL, a request the server calls malformed:
HTTP 400); 1 refused or unreachable (any other HTTP error, with the server's message; a connection
error). Errors are one line on stderr: `specloop: error: ...`.

Sub-apps of the one `specloop` app (services/cli/main.py). Kept free of torch and the registry: they only speak HTTP.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Callable
from urllib.parse import urlsplit

import httpx
import typer

from specloop.services.cli.runtime import EXIT_REFUSED, EXIT_USAGE, CommandError

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 10.0


class OperatorError(CommandError):
    """A command that cannot be done: one line on stderr and its exit code (specloop.services.cli.runtime.run)."""


@dataclass(frozen=True)
class Target:
    """Where the service is and how to talk to it."""

    url: str
    token: str | None
    as_json: bool


# ---------------------------------------------------------------- HTTP


def check_url(url: str) -> str:
    """`url` without a trailing slash; OperatorError (exit 2) unless it is http(s)://HOST[:PORT][/PATH]."""
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError as exc:
        raise OperatorError(f"bad --url {url!r}: {exc}", EXIT_USAGE) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OperatorError(f"bad --url {url!r}: expected http(s)://HOST[:PORT]", EXIT_USAGE)
    return url.strip().rstrip("/")


def make_target(url: str, token: str | None, as_json: bool) -> Target:
    token = (token or "").strip() or None
    if token is not None and not token.isascii():
        raise OperatorError("the admin token must be ASCII", EXIT_USAGE)
    return Target(check_url(url), token, as_json)


def server_message(resp: httpx.Response) -> str:
    """The error message of an OpenAI-shaped error body, else FastAPI's detail, else the raw text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason_phrase
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]:
        return str(body["error"]["message"])
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return json.dumps(body)


def call(target: Target, method: str, path: str, body: dict | None = None) -> dict:
    """One admin request; its JSON answer, or OperatorError."""
    headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
    try:
        with httpx.Client(base_url=target.url, timeout=TIMEOUT_S) as client:
            resp = client.request(method, path, json=body, headers=headers)
    except httpx.ConnectError as exc:
        raise OperatorError(f"cannot connect to specloop at {target.url}: {exc}") from None
    except httpx.TimeoutException:
        raise OperatorError(f"specloop at {target.url} did not answer within {TIMEOUT_S:g} s") from None
    except httpx.InvalidURL as exc:
        raise OperatorError(f"bad --url {target.url!r}: {exc}", EXIT_USAGE) from None
    except httpx.HTTPError as exc:
        raise OperatorError(f"request to specloop at {target.url} failed: {exc}") from None
    if not resp.is_success:
        code = EXIT_USAGE if resp.status_code == 400 else EXIT_REFUSED
        raise OperatorError(f"HTTP {resp.status_code}: {server_message(resp)}", code)
    try:
        return resp.json()
    except ValueError:
        raise OperatorError(f"{target.url}{path} answered non-JSON: is this a specloop API?") from None


# ---------------------------------------------------------------- tables (pure)


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [headers, *rows])


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _num(x) -> str:
    if x is None:
        return "-"
    return f"{x:.4f}" if isinstance(x, (int, float)) else str(x)  # "nan" / "inf" arrive as strings


def _flags(row: dict) -> str:
    return ",".join(name for name in ("champion", "pinned") if row.get(name))


def format_versions(body: dict) -> str:
    rows = [
        [r["id"], r["parent"] or "-", _when(r["created"]), r["kind"], r["objective"], str(r["learner_step"]),
         _num(r["metrics"]["loss"]), _num(r["metrics"]["sim_acceptance"]), _flags(r)]
        for r in body["data"]
    ]
    if not rows:
        return "no drafter versions published yet"
    return table(["VERSION", "PARENT", "CREATED", "KIND", "OBJECTIVE", "STEP", "LOSS", "SIM_ACC", "FLAGS"], rows)


def format_alias(body: dict) -> str:
    pinned = " (pinned)" if body["pinned"] and body["pinned"] == body["champion"] else ""
    previous = ", ".join(reversed(body["previous_champions"])) or "-"
    return f"champion: {body['champion'] or '-'}{pinned}\nprevious champions (latest first): {previous}"


def format_status(body: dict) -> str:
    champion = body["champion"]
    workers = [[w["name"], w["drafter_version"], "" if w["drafter_version"] == champion else "not the champion"]
               for w in body["workers"]]
    events = [[_when(e.get("time")), e.get("event", "?"), e.get("version") or "-", e.get("reason", "")]
              for e in body["events"]]
    parts = [format_alias(body), "", table(["WORKER", "DRAFTER VERSION", "NOTE"], workers)]
    if events:
        parts += ["", "recent events (oldest first):", table(["TIME", "EVENT", "VERSION", "REASON"], events)]
    return "\n".join(parts)


def format_stats(body: dict) -> str:
    width = max(map(len, body), default=0)
    return "\n".join(f"{k.ljust(width)}  {'-' if v is None else v}" for k, v in body.items())


def after(action: str) -> Callable[[dict], str]:
    """A formatter for the answer to a change: what was done, then the alias state."""
    return lambda body: f"{action}\n{format_alias(body)}"


def show(target: Target, body: dict, fmt: Callable[[dict], str]) -> None:
    print(json.dumps(body, indent=2) if target.as_json else fmt(body))


# ---------------------------------------------------------------- commands

Url = Annotated[str, typer.Option("--url", envvar="SPECLOOP_URL", help="base URL of the specloop API")]
Token = Annotated[str | None, typer.Option("--token", envvar="SPECLOOP_ADMIN_TOKEN", show_default=False,
                                           help="admin token (the server's SPECLOOP_ADMIN_TOKEN)")]
AsJson = Annotated[bool, typer.Option("--json", envvar="SPECLOOP_JSON",
                                      help="print the server's JSON instead of a table")]

# sub-apps of specloop.services.cli.main's app (`specloop drafter ...`, `specloop buffer ...`)
drafter = typer.Typer(help="Operator: a running service's drafter registry.",
                      no_args_is_help=True)
buffer = typer.Typer(help="Operator: a running service's replay buffer.", no_args_is_help=True)


@drafter.command("list")
def list_versions(url: Url = DEFAULT_URL, token: Token = None, as_json: AsJson = False) -> None:
    """Every published version, oldest first, with its metrics and the champion / pinned flags."""
    target = make_target(url, token, as_json)
    show(target, call(target, "GET", "/admin/drafter/versions"), format_versions)


@drafter.command("status")
def status(url: Url = DEFAULT_URL, token: Token = None, as_json: AsJson = False,
           events: Annotated[int, typer.Option(min=0, max=1000, help="recent registry events to show")] = 10) -> None:
    """The champion, the pin, each live worker's drafter version and recent registry events."""
    target = make_target(url, token, as_json)
    show(target, call(target, "GET", f"/admin/drafter/status?events={events}"), format_status)


@drafter.command("pin")
def pin(version: Annotated[str, typer.Argument(metavar="VERSION", help="version id, e.g. v0002")],
        url: Url = DEFAULT_URL, token: Token = None, as_json: AsJson = False) -> None:
    """Make VERSION the champion and freeze it: the learner keeps training, nothing is promoted."""
    version = version.strip()
    if not version:
        raise OperatorError("VERSION must not be empty (e.g. v0002)", EXIT_USAGE)
    target = make_target(url, token, as_json)
    show(target, call(target, "POST", "/admin/drafter/pin", {"version": version}), after(f"pinned {version}"))


@drafter.command("unpin")
def unpin(url: Url = DEFAULT_URL, token: Token = None, as_json: AsJson = False) -> None:
    """Release the pin: better versions may be promoted again."""
    target = make_target(url, token, as_json)
    show(target, call(target, "POST", "/admin/drafter/unpin"), after("unpinned"))


@drafter.command("rollback")
def rollback(url: Url = DEFAULT_URL, token: Token = None, as_json: AsJson = False,
             reason: Annotated[str | None, typer.Option(help="why, for the event log")] = None) -> None:
    """Return to the previous champion (refused while pinned or with no previous champion)."""
    if reason is not None and not reason.strip():
        raise OperatorError("--reason must not be empty", EXIT_USAGE)
    target = make_target(url, token, as_json)
    body = None if reason is None else {"reason": reason}
    show(target, call(target, "POST", "/admin/drafter/rollback", body), after("rolled back"))


@buffer.command("stats")
def buffer_stats(url: Url = DEFAULT_URL, token: Token = None, as_json: AsJson = False) -> None:
    """Written, dropped, depth, pending and memory of the replay buffer."""
    target = make_target(url, token, as_json)
    show(target, call(target, "GET", "/admin/buffer/stats"), format_stats)
