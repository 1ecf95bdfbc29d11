"""`specloop generate`: load a verifier/drafter pair, decode a prompt file, report per-request stats."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from specloop.drafter.decode.controller import Controller
from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.grammar import GrammarCompiler, GrammarSpec, check
from specloop.drafter.decode.requests import Generation, StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.decode.stats import AcceptanceStats
from specloop.drafter.kinds.table import DRAFTER_KINDS, build_drafter, check_speculators
from specloop.drafter.model.loading import load_model
from specloop.services.prompts import encode, load_prompts


@dataclass
class GenerateConfig:
    verifier: Path
    prompts: Path
    drafter: Path | None = None
    drafter_kind: str = "pretrained"
    k: int | None = None  # draft length per block; None = auto (drafter.decode.controller chooses it step by step)
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 1
    stop: tuple[str, ...] = ()
    no_speculation: bool = False
    limit: int | None = None
    weights: str = "auto"  # the verifier's weight mode (drafter.model.weights.quant; auto = as stored / its manifest)
    drafter_weights: str = "fp32"
    speculators: tuple[str, ...] = ()  # beside the drafter, chosen per step and row (specloop.drafter.kinds.mix)
    grammar: GrammarSpec | None = None  # structured output for every answer (--json-schema, --regex, --grammar-file)

    def __post_init__(self):
        check_speculators(self.drafter_kind, self.speculators)
        if self.k is not None and self.k < 1:
            raise ValueError(f"--k must be auto or >= 1, got {self.k}")
        if self.drafter_kind not in DRAFTER_KINDS:
            raise ValueError(f"unknown drafter kind {self.drafter_kind!r}; choose one of {', '.join(DRAFTER_KINDS)}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")

    @property
    def draft_len(self) -> int | None:
        """k (None: auto), or 0 when the verifier decodes alone."""
        return 0 if self.no_speculation else self.k

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.max_tokens, self.stop, self.seed)


@dataclass
class RunSummary:
    k: int | None  # None: auto
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    totals: AcceptanceStats | None = None

    def __post_init__(self):
        self.totals = self.totals or AcceptanceStats(self.k or 0)  # positions grow with the blocks merged in

    def add(self, gen: Generation) -> None:
        self.requests += 1
        self.tokens += len(gen.token_ids)
        assert self.totals is not None  # set in __post_init__
        self.totals.merge(gen.stats)

    def to_dict(self) -> dict:
        t = self.totals
        assert t is not None  # set in __post_init__
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "block_efficiency": t.block_efficiency,
            "acceptance_rate": t.acceptance_rate() or 0.0,
            "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(t.accepted_per_position,
                                                                           t.drafted_per_position)],
            "mean_k": t.drafted / t.blocks if t.blocks else 0.0,  # drafts per block (k = auto: the chosen ones)
        }


def final_text(tokenizer, gen: Generation, stop: tuple[str, ...]) -> str:
    """Decoded text, cut before the first stop string it contains."""
    text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def run_generate(cfg: GenerateConfig, progress: bool = True, summary: RunSummary | None = None) -> Iterator[dict]:
    """Yield one result dict per prompt, in file order (the `--json` contract of docs/usage.md)."""
    verifier = load_model(cfg.verifier, weights=cfg.weights)
    print(f"verifier {cfg.verifier} served as {verifier.served}", file=sys.stderr, flush=True)
    drafter = None if cfg.no_speculation else build_drafter(cfg.drafter_kind, verifier, cfg.drafter,
                                                            cfg.drafter_weights, cfg.speculators)
    records = load_prompts(cfg.prompts, cfg.limit)
    encoded = [encode(verifier.tokenizer, r) for r in records]
    tok = verifier.tokenizer
    rule = StopRule(verifier.eos_ids, lambda ids: tok.decode(ids, skip_special_tokens=True))
    k = cfg.draft_len
    grammars = None
    if cfg.grammar is not None:  # checked against this tokenizer: a GrammarError (exit 2) before any prompt
        grammars = GrammarCompiler(tok, verifier.lean.vocab_size, frozenset(verifier.eos_ids))
        check(cfg.grammar, grammars.tokenizer)
    controller = Controller()  # one for the run: what it measured on a batch serves the next ones
    summary = summary if summary is not None else RunSummary(k)
    bar = tqdm(total=len(records), desc="generate", unit="prompt", disable=not progress)
    for lo in range(0, len(records), cfg.batch_size):
        batch = encoded[lo : lo + cfg.batch_size]
        t0 = time.perf_counter()
        gens = generate(verifier.lean, drafter, batch, cfg.sampling, k, rule, first_request=lo, controller=controller,
                        grammar=cfg.grammar, grammars=grammars)
        summary.seconds += time.perf_counter() - t0
        for rec, gen in zip(records[lo : lo + cfg.batch_size], gens):
            summary.add(gen)
            yield {
                "id": rec.id,
                "token_ids": gen.token_ids,
                "text": final_text(tok, gen, cfg.stop),
                "finish_reason": gen.finish_reason,
                "stats": gen.stats.to_dict(),
            }
        bar.update(len(batch))
    bar.close()
