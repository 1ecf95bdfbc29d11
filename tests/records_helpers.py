"""Helpers several test modules share (moved from test_records.py)."""
from __future__ import annotations

import dataclasses

import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.dvi import DraftHead, DVIConfig
from specloop.drafter.kinds.sd2 import steering_for
from specloop.trainer.records import ReplayRecord, RowTag, records_from_snapshot, snapshot

TOP_K = 16


K = 4


DVI_LAYERS = 2  # s: the head reads the residual stream after layer s (capture index s - 1)


@dataclasses.dataclass
class Logged:
    record: ReplayRecord
    n: int  # accepted drafts of the block
    history: list[int]  # committed tokens the block started from (ends with its first input)


class Tap:
    """generate() hooks that log every active row of every step, as the serving worker does."""

    def __init__(self, kind: str, top_k: int = TOP_K, context: int = 128, version: str = "v0", temperature: float = 0.0,
                 observe: bool = False):
        self.kind, self.top_k, self.context, self.version, self.temperature = kind, top_k, context, version, temperature
        self.observe = observe  # steps left plain are traced too (observed records, k = 0)
        self.logged: list[Logged] = []
        self.blocks: dict[int, int] = {}

    def swap(self, drafter, histories):
        return drafter

    def observes_plain(self) -> bool:
        return self.observe

    def traced(self, histories: list[list[int]], ids: list[str | None]):
        return lambda trace: self._on_step(trace, [list(h) for h in histories])

    def _on_step(self, trace, histories):
        rows = torch.nonzero(trace.active).flatten().tolist()
        tags = []
        for b in rows:
            tags.append(RowTag(f"req{b}", self.version, self.blocks.get(b, 0), histories[b][-self.context:], self.temperature))
            self.blocks[b] = self.blocks.get(b, 0) + 1
        records = records_from_snapshot(snapshot(trace, rows, self.top_k), tags, self.kind)
        for b, r in zip(rows, records):
            self.logged.append(Logged(r, int(trace.outcome.num_accepted[b]), histories[b]))


def perturbed_steering(verifier_hf, drafter_hf, std: float = 0.5, seed: int = 0):
    """SD² steering with non-zero W_s, so that the steering vector changes the drafts."""
    steering = steering_for(verifier_hf.config, drafter_hf.config)
    torch.nn.init.normal_(steering.w_s, std=std, generator=torch.Generator().manual_seed(seed))
    return steering


def perturbed_head(verifier_hf, std: float = 0.5, seed: int = 1, layers: int = DVI_LAYERS):
    """A DVI head whose LoRA adapters are non-zero (A is drawn from the global RNG: seed it)."""
    torch.manual_seed(seed)
    head = DraftHead(verifier_hf, DVIConfig(layers=layers))
    for name, p in head.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std, generator=torch.Generator().manual_seed(seed))
    return head


def log_blocks(verifier, drafter_obj, kind: str, prompts, k: int = K, max_tokens: int = 12, temperature: float = 0.0,
               **tap) -> list[Logged]:
    hooks = Tap(kind, temperature=temperature, **tap)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    generate(verifier.lean, drafter_obj, prompts, params, k, StopRule(), hooks=hooks)
    return hooks.logged
