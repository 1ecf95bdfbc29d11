"""The API port's `/metrics` as one exposition (`federated`): the API's own series and those of every
metrics endpoint behind its backend, so that one scrape of the API port sees the whole server. The
endpoints are what `/sd/targets` lists (each live worker's, and the learner's); a worker's samples are
labelled `worker` with its name (its series carry no worker label of their own, `specloop:worker_info`
aside, so two workers' would collide), the learner's are left as they are (there is one).

Every endpoint's text exposition is read over HTTP, all of them at once, within one deadline for the
lot (`FEDERATE_TIMEOUT_S`, asking the backend for the endpoints included). One that does not answer in
time, answers an error or something the parser refuses is left out of this answer and counted in the
API's own `specloop:metrics_scrape_errors_total{target}` (the worker's name, or the endpoint's
host:port): a scrape of the API never fails nor waits longer for it. The texts are parsed with
prometheus_client's parser and merged family by family (HELP and TYPE once, the API's own first; a
family whose type disagrees with the one already there is dropped), and a sample whose name and labels
were already given is dropped: the answer is always one valid exposition. An endpoint that this
process serves from the API's own registry (exporters sharing one registry in one process: tests,
embedded servers) is not read: its series are the API's own already.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Iterable

import httpx
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from specloop.services.metrics.export import served_registry

log = logging.getLogger("specloop.metrics")

FEDERATE_TIMEOUT_S = 2.0  # the most a scrape of the API waits for the endpoints behind it
WORKER_LABEL = "worker"  # added to a worker's samples (the label of specloop:worker_info)
ACCEPT = "text/plain;version=0.0.4"  # what serve_metrics answers whatever is asked


@dataclass(frozen=True)
class Target:
    """A metrics endpoint behind the API: its host:port and, for a worker, the worker's name."""

    address: str
    worker: str | None = None

    @property
    def name(self) -> str:
        """The `target` label of a scrape error."""
        return self.worker or self.address


class _Families(Collector):
    """Parsed metric families, for `generate_latest`."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def _remaining(deadline: float) -> float:
    return max(deadline - asyncio.get_running_loop().time(), 0.0)


async def _within(awaitable, deadline: float, what: str):
    """The awaitable's result, or None when it failed or the deadline passed."""
    try:
        return await asyncio.wait_for(awaitable, _remaining(deadline))
    except Exception as exc:  # noqa: BLE001 - a scrape goes on without it
        log.warning("/metrics: %s left out: %r", what, exc)
        return None


async def discover(backend, deadline: float) -> list[Target]:
    """The live workers' endpoints (named) and the other endpoints `metrics_targets` lists (the learner)."""
    infos, listed = await asyncio.gather(_within(backend.workers(), deadline, "the workers' endpoints"),
                                         _within(backend.metrics_targets(), deadline, "the learner's endpoint"))
    targets = {info.metrics_url: Target(info.metrics_url, info.name) for info in infos or () if info.metrics_url}
    for address in listed or ():
        targets.setdefault(address, Target(address))
    return list(targets.values())


def parse(text: str) -> list[Metric]:
    """The families of one text exposition (ValueError when it is not one)."""
    return list(text_string_to_metric_families(text))


async def read(client: httpx.AsyncClient, target: Target, deadline: float) -> list[Metric] | None:
    """The families `target` exposes, or None when it did not answer in time or answered nothing readable."""
    async def get() -> str:
        reply = await client.get(f"http://{target.address}/metrics", headers={"Accept": ACCEPT})
        reply.raise_for_status()
        return reply.text

    text = await _within(get(), deadline, f"the metrics of {target.name} ({target.address})")
    if text is None:
        return None
    try:
        return await asyncio.to_thread(parse, text)
    except Exception as exc:  # noqa: BLE001 - not an exposition: left out
        log.warning("/metrics: the metrics of %s (%s) do not parse: %r", target.name, target.address, exc)
        return None


def exposed_name(family: Metric) -> str:
    """The name on a family's HELP and TYPE lines (a counter's ends in _total, the parser's family name not)."""
    return family.name + "_total" if family.type == "counter" else family.name


def merge(own: list[Metric], parts: list[tuple[Target, list[Metric]]]) -> bytes:
    """One text exposition of `own` and every part's families (a worker's samples labelled `worker`)."""
    families: dict[str, Metric] = {}
    seen: set[tuple[str, tuple]] = set()
    for worker, parsed in [(None, own), *((t.worker, p) for t, p in parts)]:
        for family in parsed:
            name = exposed_name(family)
            have = families.get(name)
            if have is not None and have.type != family.type:
                log.warning("/metrics: %s is a %s here and a %s at worker %s: left out", name, have.type,
                            family.type, worker)
                continue
            samples = []
            for s in family.samples:
                if worker is not None and WORKER_LABEL not in s.labels:
                    s = s._replace(labels={**s.labels, WORKER_LABEL: worker})
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in seen:
                    seen.add(key)
                    samples.append(s)
            if have is None:
                family.samples = samples
                families[name] = family
            else:
                have.samples.extend(samples)
    return generate_latest(_Families(list(families.values())))


async def federated(metrics, backend, timeout: float = FEDERATE_TIMEOUT_S) -> tuple[bytes, str]:
    """(the text exposition, its content type) of `metrics` (an ApiMetrics: its own series, and the scrape
    errors it counts) and of every metrics endpoint behind `backend`, read within `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    own_registry = getattr(metrics, "registry", None)
    targets = [t for t in await discover(backend, deadline)
               if own_registry is None or served_registry(t.address) is not own_registry]
    parts: list[tuple[Target, list[Metric]]] = []
    if targets:
        async with httpx.AsyncClient(trust_env=False) as client:
            read_all = await asyncio.gather(*(read(client, t, deadline) for t in targets))
        for target, families in zip(targets, read_all):
            if families is None:
                metrics.scrape_failed(target.name)
            else:
                parts.append((target, families))
    body, content_type = metrics.render()  # after the errors were counted: this answer shows them
    if not parts:
        return body, content_type
    own = await asyncio.to_thread(parse, body.decode())
    return await asyncio.to_thread(merge, own, parts), content_type
