"""The drafter registry's metadata backends: the alias state (champion, pin, history) with
compare-and-set updates, the event log, the version-id counter and (Redis) the versions' info.

- `FolderMeta` (embedded default): ROOT/champion.json, ROOT/events.jsonl (rotated past
  EVENT_LOG_BYTES), ROOT/next_id, every change under an fcntl lock on ROOT/.lock.
- `RedisMeta`: keys f"{prefix}:registry:*", alias changes as WATCH/MULTI transactions, every committed
  alias state mirrored to ROOT/champion.json (a Redis restarted empty gets it back).

Also the Redis namespace of a registry folder (`redis_namespace`) and `forget_namespace`.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, cast

from specloop.services.registry.types import (
    INFO,
    VERSION_RE,
    AliasState,
    Decision,
    VersionInfo,
    atomic_write_text,
    version_number,
)

log = logging.getLogger("specloop.registry")

EVENT_LOG_BYTES = 4 * 2**20  # events.jsonl is rotated past this size (one old file kept)
EVENT_LOG_ENTRIES = 20_000  # events kept in Redis


class FolderMeta:
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
            on_disk = [version_number(p.name) for p in self.versions.iterdir() if VERSION_RE.fullmatch(p.name)]
            n = max([last, *on_disk]) + 1
            atomic_write_text(self.counter, str(n))
            return n

    def save_info(self, info: VersionInfo) -> None:
        pass  # info.json in the version folder is the record

    def forget_info(self, vid: str) -> None:
        pass  # deleting the folder forgets it

    def load_info(self, vid: str) -> VersionInfo | None:
        path = self.versions / vid / INFO
        return VersionInfo.from_dict(json.loads(path.read_text())) if path.is_file() else None

    def all_infos(self) -> list[VersionInfo]:
        infos = (self.load_info(v) for v in self.indexed())
        return [i for i in infos if i is not None]

    def indexed(self) -> list[str]:
        return [p.name for p in self.versions.iterdir() if VERSION_RE.fullmatch(p.name)]

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
                atomic_write_text(self.alias, new.to_json())
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
        events = parsed_events(lines)
        return events[-limit:] if limit else events


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def parsed_events(lines: list[str]) -> list[dict]:
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


class RedisMeta:
    """Metadata in Redis under f"{prefix}:registry:*"; alias changes are WATCH/MULTI transactions."""

    CONNECT_TIMEOUT_S, TIMEOUT_S = 1.0, 2.0

    def __init__(self, url: str, prefix: str, mirror: Path):
        import redis

        self.mirror = mirror  # the alias state as last committed, in the registry folder: a Redis that
        # restarts empty gets it back (the champion and the pin survive, the gate keeps comparing)
        self._watch_error = redis.WatchError
        # Timeouts on every call: a Redis that hangs fails a registry call in seconds, never holds it.
        # decode_responses=True: every reply is str, though redis-py types them bytes | str (hence the casts)
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

    def indexed(self) -> list[str]:
        return list(cast("list[str]", self.r.hkeys(self.k_info)))

    def read_state(self) -> AliasState:
        raw = cast("str | None", self.r.get(self.k_state))
        mirrored = self._mirrored() if raw is None else None
        if mirrored is not None:
            self.r.set(self.k_state, mirrored.to_json(), nx=True)
            log.warning("registry alias restored from %s (Redis had lost it)", self.mirror)
            raw = cast("str | None", self.r.get(self.k_state))
        return AliasState.from_json(raw)

    def _mirrored(self) -> AliasState | None:
        try:
            return AliasState.from_json(self.mirror.read_text())
        except (OSError, ValueError, TypeError):
            return None

    def _mirror(self, state: AliasState) -> None:
        old = self._mirrored()
        if old is None or state.generation >= old.generation:
            atomic_write_text(self.mirror, state.to_json())

    def update(self, decide: Decision) -> tuple[AliasState, dict | None]:
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.k_state)
                    raw = cast("str | None", pipe.get(self.k_state))  # watched: immediate mode, the value
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
        return parsed_events(cast("list[str]", self.r.lrange(self.k_events, -limit if limit else 0, -1)))


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
