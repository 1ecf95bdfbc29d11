"""Drafter registry: immutable versions, the champion alias, pin and rollback.

A *version* is an immutable set of drafter weights plus its metadata
(`VersionInfo`): parent, learner step, objective, loss and `sim_acceptance`
(Σ min(p, q) per position, averaged over held-out recent replay records). The
learner publishes versions; publishing never changes what serves. The
*champion* is the version that serves by default; `promote` moves it behind a
gate, `pin` freezes it, `rollback` returns to the previous champion.

Storage. Weights always live in the folder, written atomically (temporary file
in the same folder, then `os.replace`):

    ROOT/versions/<id>/weights.safetensors
    ROOT/versions/<id>/info.json

Metadata has two backends behind one small interface:

- folder (embedded default): ROOT/champion.json holds
  {"champion", "pinned", "history", "generation"}; ROOT/events.jsonl is the
  append-only event log; ROOT/next_id is the id counter. Every change happens
  under an fcntl lock on ROOT/.lock, so threads and processes share one registry.
- Redis (`redis_url`): keys f"{prefix}:registry:*" — `info` (hash id → JSON),
  `state` (JSON of the alias state), `events` (list), `next_id` (INCR). Every committed alias
  change is also written to ROOT/champion.json, from which a Redis restarted empty gets the
  champion and the pin back (versions' info.json likewise), so the gate is never bypassed.
  Alias changes are WATCH/MULTI transactions, so two processes cannot interleave.

Promotion gate (`promote`): stored weights with NaN/inf are always refused,
even with force=True. Otherwise, unless force: refused while pinned (a forced
promotion moves the pin to the new champion), refused
when `sim_acceptance` is NaN, or (when there is a champion) None or lower than
the champion's. Every promote, refusal and rollback is an event, also logged on
the "specloop.registry" logger.

Nothing is pickled: weights are safetensors, metadata is JSON (non-finite
floats are written as the strings "nan", "inf", "-inf").
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("specloop.registry")

VERSION_RE = re.compile(r"v[0-9]{4,}")  # always used with fullmatch
WEIGHTS = "weights.safetensors"
EVENT_LOG_BYTES = 4 * 2**20  # events.jsonl is rotated past this size (one old file kept)
EVENT_LOG_ENTRIES = 20_000  # events kept in Redis
INFO = "info.json"


class RegistryError(ValueError):
    """A bad version id, an unknown version, or an operation the registry refuses."""


class UnknownVersion(RegistryError):
    """No such version was published."""


class UnservableVersion(RegistryError):
    """A version whose weights are missing, unreadable (a truncated or corrupt file) or not finite:
    never handed to a drafter, whoever asks."""


# ---------------------------------------------------------------- dataclasses


def _float_out(x: float | None) -> float | str | None:
    """JSON-safe float: non-finite values become "nan" / "inf" / "-inf"."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


def _float_in(x: float | str | None) -> float | None:
    return None if x is None else float(x)


@dataclass
class VersionInfo:
    id: str
    parent: str | None
    created: float  # unix time
    learner_step: int
    objective: str  # "base", "kl", "klrl", "lk", ...
    loss: float | None
    sim_acceptance: float | None  # Σ min(p, q) on held-out replay records, mean per position
    kind: str  # drafter kind: "pretrained", "sd2", "dvi", "eagle"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["loss"], d["sim_acceptance"] = _float_out(self.loss), _float_out(self.sim_acceptance)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "VersionInfo":
        missing = [f.name for f in fields(cls) if f.name not in d and f.name != "extra"]
        if missing:
            raise RegistryError(f"version info lacks {', '.join(missing)}")
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["loss"], kw["sim_acceptance"] = _float_in(kw["loss"]), _float_in(kw["sim_acceptance"])
        return cls(**kw)


@dataclass
class PromotionResult:
    promoted: bool
    version: str
    reason: str  # why promoted / refused, human readable
    champion: str | None  # champion after the call


@dataclass
class AliasState:
    """What serves: the champion, the pin, the champion history and a change counter."""

    champion: str | None = None
    pinned: str | None = None
    history: list[str] = field(default_factory=list)  # previous champions, most recent last
    generation: int = 0  # +1 on every champion / pin change

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | None) -> "AliasState":
        return cls(**json.loads(text)) if text else cls()

    def token(self) -> str:
        return f"{self.champion or '-'}:{self.generation}"

    def changed(self, **kw) -> "AliasState":
        base = asdict(self) | kw
        base["generation"] = self.generation + 1
        return AliasState(**base)


# A decision runs against the current alias state (under the lock / WATCH) and
# returns the new state (None: unchanged) and the event to log (None: nothing).
Decision = Callable[[AliasState], "tuple[AliasState | None, dict | None]"]


# ---------------------------------------------------------------- file helpers


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write through a temporary file in the same folder, fsync, then os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, no shared storage (safetensors refuses tied tensors)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise RegistryError(f"weights must map str to torch.Tensor, got {name!r}: {type(t).__name__}")
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return out


def _nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating tensors holding NaN or inf."""
    return [n for n, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]


def _fmt(x: float | None) -> str:
    return "None" if x is None else f"{x:.4f}"


def _version_number(vid: str) -> int:
    return int(vid[1:])


# ---------------------------------------------------------------- backends


class _FolderMeta:
    """Metadata in ROOT: champion.json, events.jsonl, next_id, all under ROOT/.lock."""

    def __init__(self, root: Path, versions: Path):
        self.root, self.versions = root, versions
        self.alias = root / "champion.json"
        self.event_log = root / "events.jsonl"
        self.counter = root / "next_id"
        self.lock_path = root / ".lock"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        # flock is per open file description: a fresh open() also excludes other threads.
        with open(self.lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def allocate(self) -> int:
        with self._locked():
            last = int(self.counter.read_text()) if self.counter.exists() else 0
            on_disk = [_version_number(p.name) for p in self.versions.iterdir() if VERSION_RE.fullmatch(p.name)]
            n = max([last, *on_disk]) + 1
            _atomic_write_text(self.counter, str(n))
            return n

    def save_info(self, info: VersionInfo) -> None:
        pass  # info.json in the version folder is the record

    def forget_info(self, vid: str) -> None:
        pass  # deleting the folder forgets it

    def load_info(self, vid: str) -> VersionInfo | None:
        path = self.versions / vid / INFO
        return VersionInfo.from_dict(json.loads(path.read_text())) if path.is_file() else None

    def all_infos(self) -> list[VersionInfo]:
        ids = [p.name for p in self.versions.iterdir() if VERSION_RE.fullmatch(p.name)]
        infos = (self.load_info(v) for v in ids)
        return [i for i in infos if i is not None]

    def read_state(self) -> AliasState:
        try:
            return AliasState.from_json(self.alias.read_text())
        except FileNotFoundError:
            return AliasState()

    def update(self, decide: Decision) -> tuple[AliasState, dict | None]:
        with self._locked():
            state = self.read_state()
            new, event = decide(state)
            if new is not None:
                _atomic_write_text(self.alias, new.to_json())
            if event is not None:
                self._append(event)
            return (new or state), event

    def append_event(self, event: dict) -> None:
        with self._locked():
            self._append(event)

    def _append(self, event: dict) -> None:
        """One write(2) of a whole line on an O_APPEND descriptor (a crash leaves at most one torn last
        line, which readers skip and the next append ends); past EVENT_LOG_BYTES the log is rotated to
        events.jsonl.1 (one old file kept)."""
        line = (json.dumps(event) + "\n").encode()
        if self.event_log.exists() and self.event_log.stat().st_size > EVENT_LOG_BYTES:
            os.replace(self.event_log, self.event_log.with_name(self.event_log.name + ".1"))
        fd = os.open(self.event_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size and not _ends_with_newline(self.event_log):
                line = b"\n" + line  # a torn line before it: end it, so this one parses
            os.write(fd, line)
        finally:
            os.close(fd)

    def read_events(self, limit: int | None) -> list[dict]:
        files = [self.event_log.with_name(self.event_log.name + ".1"), self.event_log]
        lines = [s for f in files if f.exists() for s in f.read_text(errors="replace").splitlines()]
        events = _parsed_events(lines)
        return events[-limit:] if limit else events


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _parsed_events(lines: list[str]) -> list[dict]:
    """The events of a log's lines; a line that does not parse (torn by a crash) is skipped and logged."""
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if isinstance(event, dict):
            events.append(event)
        elif line.strip():
            log.warning("skipped a malformed event-log line: %.80r", line)
    return events


class _RedisMeta:
    """Metadata in Redis under f"{prefix}:registry:*"; alias changes are WATCH/MULTI transactions."""

    CONNECT_TIMEOUT_S, TIMEOUT_S = 1.0, 2.0

    def __init__(self, url: str, prefix: str, mirror: Path):
        import redis

        self.mirror = mirror  # the alias state as last committed, in the registry folder: a Redis that
        # restarts empty gets it back (the champion and the pin survive, the gate keeps comparing)
        self._watch_error = redis.WatchError
        # Timeouts on every call: a Redis that hangs fails a registry call in seconds, never holds it.
        self.r = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=self.CONNECT_TIMEOUT_S,
                                      socket_timeout=self.TIMEOUT_S)
        key = f"{prefix}:registry"
        self.k_info, self.k_state = f"{key}:info", f"{key}:state"
        self.k_events, self.k_counter = f"{key}:events", f"{key}:next_id"

    def allocate(self) -> int:
        return int(self.r.incr(self.k_counter))

    def save_info(self, info: VersionInfo) -> None:
        self.r.hset(self.k_info, info.id, json.dumps(info.to_dict()))

    def forget_info(self, vid: str) -> None:
        self.r.hdel(self.k_info, vid)

    def load_info(self, vid: str) -> VersionInfo | None:
        raw = self.r.hget(self.k_info, vid)
        return VersionInfo.from_dict(json.loads(raw)) if raw else None

    def all_infos(self) -> list[VersionInfo]:
        return [VersionInfo.from_dict(json.loads(v)) for v in self.r.hvals(self.k_info)]

    def read_state(self) -> AliasState:
        raw = self.r.get(self.k_state)
        if raw is None and self._mirrored() is not None:
            self.r.set(self.k_state, self._mirrored().to_json(), nx=True)
            log.warning("registry alias restored from %s (Redis had lost it)", self.mirror)
            raw = self.r.get(self.k_state)
        return AliasState.from_json(raw)

    def _mirrored(self) -> AliasState | None:
        try:
            return AliasState.from_json(self.mirror.read_text())
        except (OSError, ValueError, TypeError):
            return None

    def _mirror(self, state: AliasState) -> None:
        old = self._mirrored()
        if old is None or state.generation >= old.generation:
            _atomic_write_text(self.mirror, state.to_json())

    def update(self, decide: Decision) -> tuple[AliasState, dict | None]:
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.k_state)
                    raw = pipe.get(self.k_state)
                    state = AliasState.from_json(raw) if raw is not None else (self._mirrored() or AliasState())
                    new, event = decide(state)
                    pipe.multi()
                    if new is not None:
                        pipe.set(self.k_state, new.to_json())
                    if event is not None:
                        pipe.rpush(self.k_events, json.dumps(event))
                        pipe.ltrim(self.k_events, -EVENT_LOG_ENTRIES, -1)
                    pipe.execute()
                    if new is not None:
                        self._mirror(new)
                    return (new or state), event
                except self._watch_error:
                    continue  # another process changed the alias: decide again

    def append_event(self, event: dict) -> None:
        with self.r.pipeline() as pipe:
            pipe.rpush(self.k_events, json.dumps(event))
            pipe.ltrim(self.k_events, -EVENT_LOG_ENTRIES, -1)
            pipe.execute()

    def read_events(self, limit: int | None) -> list[dict]:
        return _parsed_events(self.r.lrange(self.k_events, -limit if limit else 0, -1))


# ---------------------------------------------------------------- registry


def _event(kind: str, version: str | None, reason: str, **more) -> dict:
    return {"time": time.time(), "event": kind, "version": version, "reason": reason, **more}


class Registry:
    """Versions of the drafter, the champion alias, pin and rollback (see the module docstring)."""

    @staticmethod
    def redis_timeout_s() -> float:
        """The longest a registry call waits on a Redis that does not answer."""
        return _RedisMeta.TIMEOUT_S

    def __init__(self, root: str | Path, redis_url: str | None = None, prefix: str = "specloop"):
        self.root = Path(root).resolve()
        self.versions = self.root / "versions"
        self.versions.mkdir(parents=True, exist_ok=True)
        self._meta = (_RedisMeta(redis_url, prefix, self.root / "champion.json") if redis_url
                      else _FolderMeta(self.root, self.versions))
        self._finite: dict[str, list[str]] = {}  # version → non-finite tensor names (weights are immutable)

    # ---- ids and paths

    def _folder(self, version_id: object) -> Path:
        """The version's folder; RegistryError unless the id is well formed and stays inside ROOT/versions."""
        if not isinstance(version_id, str) or not VERSION_RE.fullmatch(version_id):
            raise RegistryError(f"bad version id {version_id!r}: expected 'v' and at least 4 digits, e.g. 'v0001'")
        path = (self.versions / version_id).resolve()
        if path.parent != self.versions:
            raise RegistryError(f"version id {version_id!r} resolves outside {self.versions}")
        return path

    # ---- versions

    def publish(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        parent: str | None,
        learner_step: int,
        objective: str,
        loss: float | None,
        sim_acceptance: float | None,
        kind: str,
        extra: dict | None = None,
    ) -> VersionInfo:
        """Store a new immutable version (does not promote it)."""
        if parent is not None:
            self.get(parent)
        extra = dict(extra or {})
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RegistryError(f"extra must be plain JSON: {e}") from None
        stored = _storable(tensors)
        vid, folder = self._new_folder()
        info = VersionInfo(
            id=vid, parent=parent, created=time.time(), learner_step=int(learner_step), objective=objective,
            loss=_float_in(loss), sim_acceptance=_float_in(sim_acceptance), kind=kind, extra=extra,
        )
        try:
            _atomic_write(folder / WEIGHTS, lambda tmp: save_file(stored, tmp, metadata={"version": vid}))
            _atomic_write_text(folder / INFO, json.dumps(info.to_dict(), indent=1))
        except Exception as exc:  # a full disk: no half-written version is left behind
            shutil.rmtree(folder, ignore_errors=True)
            raise RegistryError(f"could not write version {vid} to {folder}: {exc}") from exc
        self._meta.save_info(info)
        self._record(_event("publish", vid, f"{objective} step {learner_step}", parent=parent))
        return info

    def _new_folder(self, attempts: int = 10_000) -> tuple[str, Path]:
        """A fresh id and its folder. An id not above every folder's (the counter was lost with a Redis
        that keeps nothing on disk; older versions may have been pruned) is skipped: ids stay unique
        and increasing."""
        newest = max((_version_number(p.name) for p in self.versions.iterdir() if VERSION_RE.fullmatch(p.name)),
                     default=0)
        for _ in range(attempts):
            n = self._meta.allocate()
            if n <= newest:
                continue
            vid = f"v{n:04d}"
            folder = self._folder(vid)
            try:
                folder.mkdir()
                return vid, folder
            except FileExistsError:
                continue
        raise RegistryError(f"no free version id in {self.root} after {attempts} attempts")

    def get(self, version_id: str) -> VersionInfo:
        folder = self._folder(version_id)
        info = self._meta.load_info(version_id)
        if info is None and (folder / INFO).is_file():  # metadata lost (a Redis without persistence restarted)
            info = VersionInfo.from_dict(json.loads((folder / INFO).read_text()))
        if info is None:
            raise UnknownVersion(f"unknown version {version_id}")
        return info

    def load_weights(self, version_id: str) -> dict[str, torch.Tensor]:
        """The version's weights: UnknownVersion, or UnservableVersion when they are missing, unreadable
        or hold NaN / inf (checked on every load: a refused version is never served by any path)."""
        weights = self._read_weights(version_id)
        bad = self._nonfinite_tensors(version_id, weights)
        if bad:
            raise UnservableVersion(f"{version_id} has non-finite weights in {', '.join(bad[:5])}")
        return weights

    def _read_weights(self, version_id: str) -> dict[str, torch.Tensor]:
        self.get(version_id)
        path = self._folder(version_id) / WEIGHTS
        if not path.is_file():
            raise UnservableVersion(f"weights of {version_id} are missing at {path}")
        try:
            return load_file(path)
        except Exception as exc:  # safetensors' own error type (a truncated or corrupt file) is not exported
            raise UnservableVersion(f"weights of {version_id} are unreadable ({path}): {exc}") from None

    def prune(self, keep: int) -> list[str]:
        """Delete the versions older than the newest `keep`, except the champion, the pin and those a
        rollback may return to (the history's last `keep`, which is trimmed to them); returns the ids
        deleted. Bounded disk for a learner that publishes all day."""
        if keep < 1:
            raise RegistryError(f"keep must be >= 1, got {keep}")
        older = [v.id for v in self.list()[:-keep]]
        doomed: list[str] = []

        def decide(now: AliasState):  # under the lock: a version promoted meanwhile is protected
            protected = {now.champion, now.pinned, *now.history[-keep:]}
            doomed[:] = [v for v in older if v not in protected]
            history = [h for h in now.history[-keep:] if h not in doomed]
            if not doomed and history == now.history:
                return None, None
            return (now.changed(history=history) if history != now.history else None), _event(
                "prune", None, f"kept the newest {keep} versions, the champion, the pin and the rollback history",
                deleted=list(doomed))

        self._update(decide)
        for vid in doomed:
            self._meta.forget_info(vid)
            shutil.rmtree(self._folder(vid), ignore_errors=True)
            self._finite.pop(vid, None)
        return doomed

    def list(self) -> list[VersionInfo]:
        """Every published version, oldest first."""
        return sorted(self._meta.all_infos(), key=lambda i: _version_number(i.id))

    # ---- alias state

    def champion(self) -> str | None:
        return self._meta.read_state().champion

    def previous_champions(self) -> list[str]:
        return list(self._meta.read_state().history)

    def pinned(self) -> str | None:
        return self._meta.read_state().pinned

    def state_token(self) -> str:
        """Changes whenever the champion or the pin changes; cheap enough to poll every step."""
        return self.alias().token()

    def alias(self) -> AliasState:
        """Champion, pin, history and generation in one read."""
        return self._meta.read_state()

    def events(self, limit: int | None = None) -> list[dict]:
        """The event log, oldest first (the last `limit` events when given)."""
        return [] if limit is not None and limit <= 0 else self._meta.read_events(limit)

    # ---- changes

    def promote(self, version_id: str, *, force: bool = False) -> PromotionResult:
        """Make `version_id` the champion if it passes the gate (module docstring)."""
        info = self.get(version_id)
        bad = self._nonfinite_tensors(version_id)

        def decide(state: AliasState):
            reason = self._refusal(info, state, bad, force)
            if reason:
                return None, _event("refuse", version_id, reason, champion=state.champion)
            history = state.history + [state.champion] if state.champion else state.history
            why = self._promotion_reason(info, state, force)
            pinned = version_id if state.pinned else None  # a forced promotion through a pin moves the pin
            return state.changed(champion=version_id, pinned=pinned, history=history), _event(
                "promote", version_id, why, previous=state.champion, forced=force
            )

        state, event = self._update(decide)
        return PromotionResult(event["event"] == "promote", version_id, event["reason"], state.champion)

    def pin(self, version_id: str | None = None) -> str:
        """Pin the champion, or make `version_id` the champion and pin it; returns the pinned id."""
        if version_id is not None:
            self.get(version_id)
            bad = self._nonfinite_tensors(version_id)
            if bad:
                raise RegistryError(f"cannot pin {version_id}: non-finite weights in {', '.join(bad[:5])}")

        def decide(state: AliasState):
            target = version_id or state.champion
            if target is None:
                raise RegistryError("nothing to pin: there is no champion yet")
            if state.champion == target and state.pinned == target:
                return None, None
            history = state.history
            if state.champion and state.champion != target:
                history = history + [state.champion]
            return state.changed(champion=target, pinned=target, history=history), _event(
                "pin", target, "operator pin", previous=state.champion
            )

        return self._update(decide)[0].pinned

    def unpin(self) -> None:
        def decide(state: AliasState):
            if state.pinned is None:
                return None, None
            return state.changed(pinned=None), _event("unpin", state.pinned, "operator unpin")

        self._update(decide)

    def rollback(self, reason: str, expected: str | None = None) -> str:
        """Champion := the previous champion; refused while pinned or with no history, and, given
        `expected`, unless the champion is still `expected` (compare-and-set: several workers judging
        one bad version roll it back once, not once each). Returns the new champion."""

        def decide(state: AliasState):
            if expected is not None and state.champion != expected:
                why = f"rollback refused: the champion is {state.champion}, not {expected} ({reason})"
                return None, _event("refuse", expected, why)
            if state.pinned:
                why = f"rollback refused: pinned to {state.pinned}; unpin first ({reason})"
                return None, _event("refuse", state.champion, why)
            if not state.history:
                return None, _event("refuse", state.champion, f"rollback refused: no previous champion ({reason})")
            back = state.history[-1]
            return state.changed(champion=back, history=state.history[:-1]), _event(
                "rollback", back, reason, previous=state.champion
            )

        state, event = self._update(decide)
        if event["event"] != "rollback":
            raise RegistryError(event["reason"])
        return state.champion

    # ---- internals

    def _update(self, decide: Decision) -> tuple[AliasState, dict | None]:
        state, event = self._meta.update(decide)
        if event is not None:
            self._log(event)
        return state, event

    def _record(self, event: dict) -> None:
        self._meta.append_event(event)
        self._log(event)

    @staticmethod
    def _log(event: dict) -> None:
        level = logging.WARNING if event["event"] in ("refuse", "rollback") else logging.INFO
        log.log(level, "%s %s: %s", event["event"], event["version"], event["reason"])

    def _nonfinite_tensors(self, version_id: str, weights: dict | None = None) -> list[str]:
        if version_id not in self._finite:  # weights are immutable: checked once per version
            self._finite[version_id] = _nonfinite(self._read_weights(version_id) if weights is None else weights)
        return self._finite[version_id]

    def _refusal(self, info: VersionInfo, state: AliasState, bad: list[str], force: bool) -> str | None:
        """Why `info` may not become champion now, or None."""
        if bad:
            return f"{info.id} has non-finite weights (NaN/inf) in {', '.join(bad[:5])}"
        if info.id == state.champion:
            return f"{info.id} is already the champion"
        if force:
            return None
        if state.pinned:
            return f"pinned to {state.pinned}"
        sim = info.sim_acceptance
        if sim is not None and math.isnan(sim):
            return f"{info.id} has sim_acceptance NaN"
        if state.champion is None:
            return None
        if sim is None:
            return f"{info.id} has no sim_acceptance to compare with champion {state.champion}"
        best = self._champion_acceptance(info, state.champion)
        if best is not None and not math.isnan(best) and sim < best:
            return f"{info.id} sim_acceptance {_fmt(sim)} < champion {state.champion} sim_acceptance {_fmt(best)}"
        return None

    def _champion_acceptance(self, info: VersionInfo, champion: str) -> float | None:
        """The champion's simulated acceptance to beat: measured on the candidate's own held-out
        records when the learner recorded it (extra["baseline"] = {"version", "sim_acceptance"}),
        so that traffic drift between the two measurements cannot decide; else its stored figure."""
        baseline = info.extra.get("baseline") or {}
        if baseline.get("version") == champion and baseline.get("sim_acceptance") is not None:
            return float(baseline["sim_acceptance"])
        return self.get(champion).sim_acceptance

    def _promotion_reason(self, info: VersionInfo, state: AliasState, force: bool) -> str:
        if force:
            return f"forced promotion of {info.id} (acceptance and pin checks skipped)"
        if state.champion is None:
            return f"{info.id} is the first champion"
        best = self._champion_acceptance(info, state.champion)
        return f"{info.id} sim_acceptance {_fmt(info.sim_acceptance)} >= champion {state.champion} {_fmt(best)}"


def redis_namespace(folder: str | Path, base: str = "specloop") -> str:
    """The Redis key namespace of one registry folder: its version metadata and its replay stream
    (a reused folder resumes both)."""
    return f"{base}:{hashlib.sha1(str(Path(folder).resolve()).encode()).hexdigest()[:12]}"


def forget_namespace(redis_url: str, namespace: str) -> int:
    """Delete every key under `namespace` (a throwaway run's stream and metadata); how many."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*"))
        return client.delete(*keys) if keys else 0
    except redis.RedisError:
        return 0
    finally:
        client.close()
