"""vLLM's names for a worker's speculative-decoding and scheduler series (`VllmWorkerSeries`), so that a
dashboard built for vLLM reads specloop unchanged: `vllm:spec_decode_num_drafts_total`,
`vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`, `vllm:num_requests_running`,
`vllm:num_requests_waiting`. Labelled `model_name` only (vLLM's label; no `drafter_version`): the
worker's totals over every drafter version, fed by `WorkerMetrics` from the same calls as its
`specloop:` counterparts, with the same meaning (a block drafts k > 0 tokens, n of them accepted)."""
from __future__ import annotations

from specloop.drafter.decode.stats import AcceptanceStats
from specloop.services.metrics.export import Exporter

VLLM_PREFIX = "vllm:"


class VllmWorkerSeries:
    """vLLM-named series in `exporter`'s registry, bound to its `model_name`."""

    def __init__(self, exporter: Exporter):
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()):
            return exporter._counter(name, doc, labels, prefix=VLLM_PREFIX)

        self.drafts = counter("spec_decode_num_drafts", "Verified blocks that drafted (k > 0), every drafter "
                              "version (specloop:spec_decode_num_drafts_total by version).")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens (sum of k), every drafter version.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Accepted drafted tokens, every drafter version.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Blocks whose draft at this "
                                        "0-based position was accepted, every drafter version.", ("position",))
        self.per_pos: list = []
        self.running = exporter._gauge("num_requests_running", "Requests holding a cache slot.", prefix=VLLM_PREFIX)
        self.waiting = exporter._gauge("num_requests_waiting", "Requests queued for a cache slot.",
                                       prefix=VLLM_PREFIX)

    def add(self, stats: AcceptanceStats) -> None:
        """Blocks of one step (any drafter version)."""
        self.drafts.inc(stats.drafts)
        self.draft_tokens.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        while len(self.per_pos) < len(stats.accepted_per_position):  # every drafted position exists, even at 0
            self.per_pos.append(self.accepted_per_pos.labels(str(len(self.per_pos))))
        for child, count in zip(self.per_pos, stats.accepted_per_position):
            if count:
                child.inc(count)

    def load(self, queued: int, running: int) -> None:
        self.waiting.set(queued)
        self.running.set(running)
