"""The drafter registry's versions on disk: ROOT/versions/<id>/{weights.safetensors, info.json},
written atomically, ids unique and increasing, weights checked finite on every load.

`VersionStore` is the base of `specloop.services.registry.registry.Registry`, which adds the alias state (champion,
pin, rollback), the promotion gate and pruning."""
from __future__ import annotations

import builtins
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specloop.services.registry.meta import FolderMeta, RedisMeta
from specloop.services.registry.types import (
    INFO,
    VERSION_RE,
    WEIGHTS,
    RegistryError,
    UnknownVersion,
    UnservableVersion,
    VersionInfo,
    atomic_write,
    atomic_write_text,
    float_in,
    new_event,
    version_number,
)

log = logging.getLogger("specloop.registry")


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


class VersionStore:
    """Published versions of the drafter in ROOT/versions, their metadata in a `FolderMeta` or a
    `RedisMeta` (`self._meta`), which also holds the alias state and the event log."""

    @staticmethod
    def redis_timeout_s() -> float:
        """The longest a registry call waits on a Redis that does not answer."""
        return RedisMeta.TIMEOUT_S

    def __init__(self, root: str | Path, redis_url: str | None = None, prefix: str = "specloop"):
        self.root = Path(root).resolve()
        self.versions = self.root / "versions"
        self.versions.mkdir(parents=True, exist_ok=True)
        self._folders = FolderMeta(self.root, self.versions)  # the versions themselves: the source of truth
        self._meta = RedisMeta(redis_url, prefix, self.root / "champion.json") if redis_url else self._folders
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
            loss=float_in(loss), sim_acceptance=float_in(sim_acceptance), kind=kind, extra=extra,
        )
        try:
            atomic_write(folder / WEIGHTS, lambda tmp: save_file(stored, tmp, metadata={"version": vid}))
            atomic_write_text(folder / INFO, json.dumps(info.to_dict(), indent=1))
        except Exception as exc:  # a full disk: no half-written version is left behind
            shutil.rmtree(folder, ignore_errors=True)
            raise RegistryError(f"could not write version {vid} to {folder}: {exc}") from exc
        self._meta.save_info(info)
        self._record(new_event("publish", vid, f"{objective} step {learner_step}", parent=parent))
        return info

    def _new_folder(self, attempts: int = 10_000) -> tuple[str, Path]:
        """A fresh id and its folder. An id not above every folder's (the counter was lost with a Redis
        that keeps nothing on disk; older versions may have been pruned) is skipped: ids stay unique
        and increasing."""
        newest = max((version_number(p.name) for p in self.versions.iterdir() if VERSION_RE.fullmatch(p.name)),
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

    def list(self) -> list[VersionInfo]:
        """Every published version, oldest first. The version folders are the source of truth (a
        version whose folder holds its info.json exists); Redis is their index, reconciled here: a
        version it lost (data loss, a kill between the two writes) is indexed again, one whose folder
        is gone is dropped from it."""
        on_disk = {i.id: i for i in self._folders.all_infos()}
        indexed = on_disk.keys() if self._meta is self._folders else set(self._meta.indexed())
        for vid in sorted(on_disk.keys() - indexed):
            self._meta.save_info(on_disk[vid])
        for vid in sorted(indexed - on_disk.keys()):
            self._meta.forget_info(vid)
        return sorted(on_disk.values(), key=lambda i: version_number(i.id))

    # ---- events and checks

    def note(self, kind: str, version: str | None, reason: str, **extra) -> None:
        """Log an event of another component (the learner's canary verdicts) beside the registry's own."""
        self._record(new_event(kind, version, reason, **extra))

    def _record(self, event: dict) -> None:
        self._meta.append_event(event)
        self._log(event)

    @staticmethod
    def _log(event: dict) -> None:
        level = logging.WARNING if event["event"] in ("refuse", "rollback") else logging.INFO
        log.log(level, "%s %s: %s", event["event"], event["version"], event["reason"])

    # builtins.list: `list` is the method above in this class's scope
    def _nonfinite_tensors(self, version_id: str, weights: dict | None = None) -> builtins.list[str]:
        if version_id not in self._finite:  # weights are immutable: checked once per version
            self._finite[version_id] = _nonfinite(self._read_weights(version_id) if weights is None else weights)
        return self._finite[version_id]
