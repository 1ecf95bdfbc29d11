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

Modules: `specloop.services.registry.types` (errors, records, atomic writes), `specloop.services.registry.meta` (the
folder and Redis metadata backends, the event log, Redis namespaces), `specloop.services.registry.versions`
(versions on disk: publish, get, load weights, list) and this one (`Registry`: pruning, the alias
state, promote / pin / unpin / rollback and the gate). Every name is importable from here.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import replace

from specloop.services.registry.types import (
    AliasState,
    Decision,
    PromotionResult,
    RegistryError,
    VersionInfo,
    new_event,
    version_number,
)
from specloop.services.registry.versions import VersionStore


def _pruned(version_id: str, state: AliasState) -> str | None:
    return f"{version_id} is being pruned" if version_id in state.pruning else None


def _fmt(x: float | None) -> str:
    return "None" if x is None else f"{x:.4f}"


class Registry(VersionStore):
    """Versions of the drafter (`VersionStore`), the champion alias, pin and rollback (see the module
    docstring)."""

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
            doomed[:] = sorted({v for v in older if v not in protected} | set(now.pruning), key=version_number)
            history = [h for h in now.history[-keep:] if h not in doomed]
            if not doomed and history == now.history:
                return None, None
            # marked in the same change: from now on pin and promote refuse them (`_refusal`, `pin`)
            marked = replace(now.changed(history=history) if history != now.history else now, pruning=list(doomed))
            return marked, new_event("prune", None, f"kept the newest {keep} versions, the champion, the pin and "
                                                    "the rollback history", deleted=list(doomed))

        self._update(decide)
        for vid in doomed:
            self._meta.forget_info(vid)
            shutil.rmtree(self._folder(vid), ignore_errors=True)
            self._finite.pop(vid, None)
        if doomed:  # deleted: unmark (a prune killed before this point is finished by the next one)
            self._update(lambda now: (replace(now, pruning=[v for v in now.pruning if v not in doomed]), None))
        return doomed

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
            reason = self._refusal(info, state, bad, force) or _pruned(version_id, state)
            if reason:
                return None, new_event("refuse", version_id, reason, champion=state.champion)
            history = state.history + [state.champion] if state.champion else state.history
            why = self._promotion_reason(info, state, force)
            pinned = version_id if state.pinned else None  # a forced promotion through a pin moves the pin
            return state.changed(champion=version_id, pinned=pinned, history=history), new_event(
                "promote", version_id, why, previous=state.champion, forced=force
            )

        state, event = self._update(decide)
        assert event is not None  # decide always gives a promotion or a refusal
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
            if why := _pruned(target, state):
                raise RegistryError(why)
            if state.champion == target and state.pinned == target:
                return None, None
            history = state.history
            if state.champion and state.champion != target:
                history = history + [state.champion]
            return state.changed(champion=target, pinned=target, history=history), new_event(
                "pin", target, "operator pin", previous=state.champion
            )

        pinned = self._update(decide)[0].pinned
        assert pinned is not None  # decide pinned the target, or found it pinned already
        return pinned

    def unpin(self) -> None:
        def decide(state: AliasState):
            if state.pinned is None:
                return None, None
            return state.changed(pinned=None), new_event("unpin", state.pinned, "operator unpin")

        self._update(decide)

    def rollback(self, reason: str, expected: str | None = None) -> str:
        """Champion := the previous champion; refused while pinned or with no history, and, given
        `expected`, unless the champion is still `expected` (compare-and-set: several workers judging
        one bad version roll it back once, not once each). Returns the new champion."""

        def decide(state: AliasState):
            if expected is not None and state.champion != expected:
                why = f"rollback refused: the champion is {state.champion}, not {expected} ({reason})"
                return None, new_event("refuse", expected, why)
            if state.pinned:
                why = f"rollback refused: pinned to {state.pinned}; unpin first ({reason})"
                return None, new_event("refuse", state.champion, why)
            if not state.history:
                return None, new_event("refuse", state.champion, f"rollback refused: no previous champion ({reason})")
            back = state.history[-1]
            return state.changed(champion=back, history=state.history[:-1]), new_event(
                "rollback", back, reason, previous=state.champion
            )

        state, event = self._update(decide)
        assert event is not None  # decide always gives a rollback or a refusal
        if event["event"] != "rollback":
            raise RegistryError(event["reason"])
        assert state.champion is not None  # a previous champion, from the history
        return state.champion

    # ---- internals

    def _update(self, decide: Decision) -> tuple[AliasState, dict | None]:
        state, event = self._meta.update(decide)
        if event is not None:
            self._log(event)
        return state, event

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
