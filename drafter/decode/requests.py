"""What a request is and what it gets, in the engine's terms (drafter/decode/engine.py): a request, the
update one step gives it, its finished generation, and the rule that ends it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specloop.drafter.decode.grammar import GrammarSpec
from specloop.drafter.decode.logprobs import TokenScore
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.decode.shaping import Controls
from specloop.drafter.decode.stats import AcceptanceStats


@dataclass
class EngineRequest:
    id: str
    prompt: list[int]  # token ids (>= 1)
    params: SamplingParams
    k: int | None  # this request's draft length; 0 = the verifier alone; None = auto (the controller's, per step)
    stream: int = 0  # draws from the stream seeded by (params.seed, stream)
    logprobs: int | None = None  # None: none; n >= 0: each emitted token's log-probability and n alternatives
    controls: Controls = Controls()  # penalties, logit_bias, min_tokens (drafter/decode/shaping.py)
    grammar: GrammarSpec | None = None  # structured output (drafter/decode/grammar.py; the engine needs `grammars`)


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS or a stop string) or "length"
    stats: AcceptanceStats
    logprobs: list[TokenScore] | None = None  # one per token id, when the request asked for them
    drafter_versions: list[str] = field(default_factory=list)  # versions that drafted it (noted by a serving
    #                                                            worker: the engine knows drafters, not versions)


STOP_MARGIN = 4  # characters beyond the longest stop string a tail decode must hold


@dataclass
class StopRule:
    """When a request ends: EOS, a stop string (params.stop), or params.max_tokens, whichever first."""

    eos_ids: frozenset[int] = frozenset()
    decode: Callable[[list[int]], str] | None = None  # needed only for stop strings

    def extend(self, gen: Generation, new: list[int], params: SamplingParams) -> None:
        """Append tokens one at a time, as plain decoding would, stopping where it would stop."""
        for t in new:
            if (t in self.eos_ids and not params.ignore_eos) or t in params.stop_token_ids:
                gen.finish_reason = "stop"
                return
            gen.token_ids.append(t)
            if params.stop and self.completes_stop(gen.token_ids, params.stop):
                gen.finish_reason = "stop"
                return
            if len(gen.token_ids) >= params.max_tokens:
                gen.finish_reason = "length"
                return

    def completes_stop(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the newest token completes a stop string in the text of `tokens`, decoding only a
        tail: a new match ends in the newest token's text, so it lies within the last (longest stop)
        characters of the text before it, plus that token's. The tail grows (doubling) until its text
        before the newest token holds that many characters and a margin (a character cut at the
        tail's start, a decoder's leading-space rule), or covers every token: exact, and linear in the
        output where decoding the whole text at every token was quadratic."""
        assert self.decode is not None  # set wherever requests carry stop strings
        need = max(map(len, stop)) + STOP_MARGIN
        n = min(len(tokens), need + 1)
        while True:
            head = tokens[-n:-1]
            if n >= len(tokens) or len(self.decode(head)) >= need:
                text = self.decode(tokens[-n:])
                return any(s in text for s in stop)
            n = min(len(tokens), 2 * n)




@dataclass
class RowUpdate:
    """What one step gave one request."""

    id: str
    slot: int
    new_tokens: list[int]  # committed this step (cut at EOS / stop / max tokens)
    k: int  # drafts of this request's block (its own k, or the controller's choice; 0: the verifier alone)
    accepted: int  # drafts accepted in this block
    finish_reason: str | None  # set on the request's last step
    logprobs: list[TokenScore] | None = None  # one per new token, when the request asked for them
    generation: Generation | None = None  # the whole generation, on the request's last update
    speculator: str | None = None  # who drafted this block, in a mix of speculators (kinds.mix); else None
