"""The drafter interface: `propose()` k tokens per row, then `observe()` what the verifier kept.

Every drafter kind (drafter/kinds/table.py: pretrained LM, n-gram lookup, SD², DVI, EAGLE head) implements
all of `Drafter`, so neither the speculative step, the engine nor the serving worker knows which
one it drives: rows join (`start`, `join`), draft and learn the verdict (`propose`, `observe`), a
step over the first m slots of a pool sees only those rows (`narrow`, `widen`), and a new version
takes over a running one's rows on a hot swap (`adopt`, `refill`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from typing import Self  # Python 3.11: annotations only (the package runs on 3.10)

from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import RowParams, SamplingParams, argmax, sample, warp
from specloop.drafter.model.kv_cache import KVCache

GRAMMAR = "grammar"  # the source (`Proposal.sources`) of a row whose drafts are the tokens its grammar forces
FREE_SOURCES = frozenset({"suffix", GRAMMAR})  # speculators whose drafts cost no model pass: their rows teach the
#                                                controller nothing of what asking k earns, and are no replay records


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] int64 drafted tokens
    probs: torch.Tensor | None  # [B, k, V] q the tokens were drawn from; None at temperature 0
    logits: list[torch.Tensor] | None = None  # k × [B, V] raw drafter logits (kept, not copied, for logging)
    logit_rows: torch.Tensor | None = None  # the vocabulary ids `logits`' columns are, sorted (a head's draft
    #                                          vocabulary: [B, n] logits, n < V); None: the whole vocabulary
    steer: torch.Tensor | None = None  # [B, 3, d_verifier] SD² steering inputs this block was drafted with
    lengths: torch.Tensor | None = None  # [B] int64: row b drafted only its first lengths[b] tokens (None: all k);
    #                                      the rest are filler, never accepted, and the verify pass is cut to the
    #                                      longest
    confidence: torch.Tensor | None = None  # [B, k] the drafter's own estimate that the path up to i is accepted
    sources: list[str] | None = None  # [B] which speculator drafted each row (a mix of speculators; None: one)
    one_hot: bool = False  # deterministic drafts (a lookup): q is one-hot on each token, made only where the
    #                        rejection sampler's ops judge them (`speculative.drafted_q`), so probs stay None

    def logprobs(self) -> torch.Tensor:
        """[B, k] float32 log q(d_i), computed only when asked (replay logging), never in the step:
        from the warped q at T > 0, from softmax(logits) when greedy, 0 for a deterministic draft."""
        idx = self.tokens[..., None]
        if self.probs is not None:
            return self.probs.gather(-1, idx).squeeze(-1).clamp(min=1e-30).log()
        if self.logits:
            logp = torch.log_softmax(torch.stack(self.logits, dim=1).float(), dim=-1)
            if self.logit_rows is None:
                return logp.gather(-1, idx).squeeze(-1)
            col = columns(self.logit_rows, self.tokens.to(self.logit_rows.device))  # a token outside them: q = 0
            got = logp.gather(-1, col.clamp(min=0)[..., None].to(logp.device)).squeeze(-1)
            return torch.where(col.to(got.device) >= 0, got, torch.full_like(got, float("-inf")))
        return torch.zeros(self.tokens.shape)


def columns(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each token's column among the sorted vocabulary ids `rows` (-1 where it is not one of them)."""
    at = torch.searchsorted(rows, tokens).clamp(max=len(rows) - 1)
    return torch.where(rows[at] == tokens, at, torch.full_like(at, -1))


@dataclass
class VerifierView:
    """What a drafter may read of the verifier, computed by passes the verifier runs anyway."""

    cache: KVCache  # the verifier's KV cache (lens = committed tokens but the newest)
    features: dict[int, torch.Tensor]  # layer -> [B, hidden]: residual stream at the position that
    #                                    produced the newest committed token (the drafter's `verifier_layers`)
    recent: dict[int, torch.Tensor] | None = None  # layer -> [B, T, hidden]: the residual streams at the positions
    #   that produced the row's newest committed tokens, oldest first; row b's first recent_lens[b] are real
    #   (a verify pass: its block's n + 1 positions; a prefill: the prompt's last positions, up to the
    #   drafter's `feature_window`)
    recent_lens: torch.Tensor | None = None  # [B] int64


def steer_now(drafter) -> torch.Tensor | None:
    """What a block drafted now would be drafted from (a drafter's optional `steer_now`: the eagle head's
    feature, the eagle-3 head's window; its proposals' `steer`), for an observed record of a step left plain;
    None where the drafter keeps none (its records need none, or it cannot give observed records)."""
    fn = getattr(drafter, "steer_now", None)
    return None if fn is None else fn()


class Drafter(Protocol):
    kind: str
    verifier_layers: tuple[int, ...]  # hidden states it needs from the verifier (SD² steering)
    record_layers: tuple[int, ...]  # residual streams a replay record needs to recompute its forward (DVI)
    follows_plain: bool  # plain steps (k = 0) keep it up to date: it reads only the verifier's features and tokens

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView) -> None:
        """Begin a batch: remember (or prefill) each row's prompt; capacity bounds its length."""

    def join(self, slots: list[int], prompts: list[list[int]], view: VerifierView) -> None:
        """Rows `slots` restart with new prompts (continuous batching); view.features are the new rows' only."""

    def propose(self, k: int, params: SamplingParams | RowParams, uniforms: torch.Tensor | None) -> Proposal:
        """Draft k tokens per row; uniforms [B, k] drive sampling at temperature > 0."""

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView) -> None:
        """Take the verifier's verdict; rows where active [B] is False are finished."""

    def narrow(self, m: int) -> Self:
        """A shallow copy that sees only rows [0, m) of the per-row state: a step over the occupied prefix
        of a slot pool costs what m rows cost. KV caches and tensors are views (in-place writes reach
        this drafter); `widen` takes back what the step rebound. Built with `first_rows`."""

    def widen(self, view: Self, m: int) -> None:
        """After a step on `view` (= self.narrow(m)): its rows [0, m) become these rows [0, m) (`with_rows`)."""

    def adopt(self, old: Self) -> None:
        """A hot swap: continue `old`'s rows (same kind, other weights) with its per-row state as it is."""

    def refill(self, old: Self, histories: list[list[int]]) -> None:
        """A hot swap: continue `old`'s rows with per-row state these weights recompute from each row's
        committed tokens (histories[b], ending with the token the next step starts from)."""


def first_rows(value, m: int):
    """Rows [0, m) of one piece of per-row state: a KV cache, a dict of tensors, a list or a tensor."""
    if isinstance(value, KVCache):
        return KVCache([k[:m] for k in value.keys], [v[:m] for v in value.values], value.lens[:m].clone())
    if isinstance(value, dict):
        return {key: t[:m] for key, t in value.items()}
    return value[:m]  # list (a copy of the first m entries) or tensor (a view)


def with_rows(pool, view, m: int):
    """The pool's state with rows [0, m) taken from the view (`first_rows`' inverse after a step).
    Tensors are rebuilt, never written in place: the pool's may be inference tensors (made inside a
    forward pass)."""
    if isinstance(pool, KVCache):
        pool.lens = torch.cat([view.lens, pool.lens[m:]])
        return pool
    if isinstance(pool, dict):
        return {key: torch.cat([view[key], t[m:]]) for key, t in pool.items()}
    if isinstance(pool, list):
        pool[:m] = view
        return pool
    return torch.cat([view, pool[m:]])


def stack_proposal(steps: list["Choice"], params: SamplingParams | RowParams) -> Proposal:
    """k per-step choices ([B] tokens, [B, V] distributions, [B, V] logits) → one Proposal."""
    probs = None
    if not params.greedy:
        drawn = []
        for c in steps:
            assert c.probs is not None  # `choose` keeps the distribution of every non-greedy draw
            drawn.append(c.probs)
        probs = torch.stack(drawn, dim=1)
    return Proposal(
        tokens=torch.stack([c.token for c in steps], dim=1),
        probs=probs,
        logits=[c.logits for c in steps],
    )


@dataclass
class Choice:
    """One drafted position for every row."""

    token: torch.Tensor  # [B] int64
    probs: torch.Tensor | None  # [B, V] warped q; None when greedy
    logits: torch.Tensor  # [B, V] the raw logits it was chosen from


def choose(logits: torch.Tensor, params: SamplingParams | RowParams, u: torch.Tensor | None) -> Choice:
    """Next token per row from [B, V] logits: argmax when greedy, else a draw from warp(logits)
    (per row with RowParams: greedy rows take the argmax)."""
    if params.greedy:
        return Choice(argmax(logits), None, logits)
    assert u is not None  # uniforms are drawn for every non-greedy step
    q = warp(logits, params)
    token = sample(q, u)
    if isinstance(params, RowParams):
        token = torch.where(params.greedy_rows.to(token.device), argmax(logits), token)
    return Choice(token, q, logits)

