"""The drafter registry's records: errors, version ids, `VersionInfo`, `PromotionResult`, the alias
state (`AliasState`) and the atomic-write and event helpers that the metadata backends, the version
store and the registry share (see `specloop.services.registry.registry` for the whole design)."""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

VERSION_RE = re.compile(r"v[0-9]{4,}")  # always used with fullmatch
WEIGHTS = "weights.safetensors"
INFO = "info.json"


class RegistryError(ValueError):
    """A bad version id, an unknown version, or an operation the registry refuses."""


class UnknownVersion(RegistryError):
    """No such version was published."""


class UnservableVersion(RegistryError):
    """A version whose weights are missing, unreadable (a truncated or corrupt file) or not finite:
    never handed to a drafter, whoever asks."""


# ---------------------------------------------------------------- dataclasses


def float_out(x: float | None) -> float | str | None:
    """JSON-safe float: non-finite values become "nan" / "inf" / "-inf"."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


def float_in(x: float | str | None) -> float | None:
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
        d["loss"], d["sim_acceptance"] = float_out(self.loss), float_out(self.sim_acceptance)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "VersionInfo":
        missing = [f.name for f in fields(cls) if f.name not in d and f.name != "extra"]
        if missing:
            raise RegistryError(f"version info lacks {', '.join(missing)}")
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["loss"], kw["sim_acceptance"] = float_in(kw["loss"]), float_in(kw["sim_acceptance"])
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
    pruning: list[str] = field(default_factory=list)  # versions `prune` is deleting: never pinned or promoted

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


# ---------------------------------------------------------------- helpers


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Write through a temporary file in the same folder, fsync, then os.replace. `write(tmp)`'s
    result is ignored."""
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


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def version_number(vid: str) -> int:
    return int(vid[1:])


def new_event(kind: str, version: str | None, reason: str, **more) -> dict:
    return {"time": time.time(), "event": kind, "version": version, "reason": reason, **more}
