"""A worker's Prometheus metrics fed from its serving loop (`attach_metrics`): spec-decode counts,
tokens, load, step times and the controller's choices on every step, swaps, rollbacks, load failures,
replay-logging totals and registry reachability as they change."""
from __future__ import annotations

import time

from specloop.drafter.decode.requests import RowUpdate


def attach_metrics(loop, metrics) -> None:
    """Feed a `specloop.services.metrics.WorkerMetrics` from every step of `loop`'s worker (one call per step);
    `loop`: a `specloop.services.worker.serving_loop.ServingLoop` (its worker, queue and running count)."""
    worker, seen = loop.worker, {"swaps": 0, "rollbacks": 0, "failures": 0, "records_at": 0.0, "estimates_at": 0.0,
                             "registry_at": 0.0}
    metrics.serving(worker.version)

    def on_step(updates: list[RowUpdate], engine, version: str) -> None:
        metrics.blocks(version, [u.k for u in updates], [u.accepted for u in updates])
        mixed = [(u.speculator, u.k, u.accepted) for u in updates if u.speculator is not None]
        if mixed:
            metrics.speculators(version, mixed)
        metrics.generated(sum(len(u.new_tokens) for u in updates))
        metrics.load(len(loop.waiting), loop.running)
        if worker.prefix_cache is not None:  # its totals: the admissions since the last step counted there
            cache = worker.prefix_cache.stats()
            metrics.prefix_cache(cache.queries, cache.hits)
        metrics.step(engine.timing.forward_s, engine.timing.total_s)
        if engine.timing.choice is not None:
            metrics.chosen_k(version, engine.timing.choice.k)
        if engine is worker.engine and time.monotonic() - seen["estimates_at"] > 1.0:
            seen["estimates_at"] = time.monotonic()
            metrics.estimates(engine.controller.estimates(max(1, engine.running)))
        for s in worker.swaps.since(seen["swaps"]):
            metrics.swap(s.old, s.new)
        for _ in worker.rollbacks.since(seen["rollbacks"]):
            metrics.rollback()
        for _ in worker.load_failures.since(seen["failures"]):
            metrics.load_failed()
        seen.update(swaps=worker.swaps.total, rollbacks=worker.rollbacks.total, failures=worker.load_failures.total)

        if worker.logger is not None and time.monotonic() - seen["records_at"] > 1.0:
            seen["records_at"] = time.monotonic()
            rec = worker.logger.stats()
            metrics.records(rec.logged, rec.dropped, rec.observed)
        if worker.watcher is not None and time.monotonic() - seen["registry_at"] > 1.0:
            seen["registry_at"] = time.monotonic()
            metrics.registry_reachable(not worker.watcher.down)

    worker.on_step.append(on_step)
