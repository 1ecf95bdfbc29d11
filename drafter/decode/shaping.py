"""The usual sampling controls and structured output, applied to the verifier's logits row by row, losslessly under
speculation.

Each transform here is a function of a row's tokens so far: logit_bias (added), min_tokens (EOS and stop_token_ids
masked until that many tokens are out), repetition_penalty (vLLM's: positive logits of prompt and output tokens divided,
negative ones multiplied), frequency and presence penalties (per occurrence and once, over output tokens), and a
grammar's mask (drafter/decode/grammar.py). At a block's position j the row's tokens so far are its committed
tokens followed by drafts[:j], exactly as if the drafts before j had been accepted, which is the only case in which
position j's verdict is ever read: the verdict (greedy argmax or the rejection sampler) then preserves the shaped
distribution, the one the verifier alone would sample from with the same controls. The drafter's own q needs no
shaping for that (the sampler is lossless for any q the drafts were drawn from); a grammar only cuts drafts at the
first token it refuses, which p would refuse anyway.

min_p is a warp (drafter/decode/sampling.py), applied with temperature, top-k and top-p to both p and q.
Rows without controls cost nothing: a step with none has no `StepShaper`. A shaped step transforms its shaped rows
together ([R, k + 1, V] at once); only grammar masks are computed row by row (llguidance).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specloop.drafter.decode.grammar import RowGrammar

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Controls:
    """A request's controls (vLLM's semantics and neutral values)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0  # EOS and the request's stop_token_ids are masked until this many tokens are out

    def __post_init__(self):
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def neutral(self) -> bool:
        return self == Controls()

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class RowShaping:
    """One running request's shaping state: its controls, the counts of its output tokens, the prompt's tokens
    (for the repetition penalty) and its grammar. Owned by the engine's `LiveRequest`; advanced by `commit`."""

    def __init__(self, controls: Controls, prompt: list[int], vocab_size: int, ends: frozenset[int],
                 grammar: RowGrammar | None = None):
        """`ends`: the tokens that end the request (EOS and its stop_token_ids), masked before min_tokens."""
        self.controls, self.grammar, self.vocab_size = controls, grammar, vocab_size
        self.out = 0  # output tokens so far
        self.counts = torch.zeros(vocab_size)  # [V] occurrences in the output
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] (read by the repetition penalty only)
        if controls.repetition_penalty != 1.0:
            self.prompt_seen[torch.tensor([t for t in prompt if 0 <= t < vocab_size], dtype=torch.long)] = True
        self.ends = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
        self.ends[torch.tensor([t for t in ends if 0 <= t < vocab_size], dtype=torch.long)] = True
        self.bias = torch.zeros(vocab_size)  # [V]
        for t, b in controls.logit_bias:
            if 0 <= t < vocab_size:
                self.bias[t] += b

    def valid_drafts(self, drafts: list[int]) -> int:
        """How many of `drafts` this row may verify (a grammar refuses the rest)."""
        return len(drafts) if self.grammar is None else self.grammar.valid_prefix(drafts)

    def allowed(self, drafts: list[int], J: int) -> torch.Tensor | None:
        """[J, V] bool: what the grammar allows at positions 0..J−1 (None without one); positions past the
        drafts it allows are never read, and allow everything."""
        if self.grammar is None:
            return None
        valid = self.grammar.valid_prefix(drafts[: J - 1])
        out = torch.ones(J, self.vocab_size, dtype=torch.bool)
        out[: valid + 1] = self.grammar.masks(drafts[:valid])
        out[~out.any(dim=-1)] = self.ends  # nothing left: only the end
        return out

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens this row's grammar forces next (none without one)."""
        return [] if self.grammar is None else self.grammar.forced(limit)

    def commit(self, tokens: list[int]) -> None:
        """The tokens the request committed this step (as the stop rule kept them)."""
        self.out += len(tokens)
        if tokens:
            self.counts.index_add_(0, torch.tensor(tokens), torch.ones(len(tokens)))
        if self.grammar is not None:
            self.grammar.commit(tokens)


@dataclass(frozen=True)
class StepShaper:
    """The shaping of one step's rows (None where a row has none): what `speculative_step` applies, every row at
    once (the grammar masks row by row)."""

    rows: tuple[RowShaping | None, ...]  # [B]

    def draft_limits(self, drafts: torch.Tensor) -> torch.Tensor | None:
        """[B] how many of each row's drafts [B, k] may be verified (None: every draft: no row has a grammar)."""
        if not any(r is not None and r.grammar is not None for r in self.rows):
            return None
        host = drafts.cpu().tolist()
        return torch.tensor([len(d) if r is None else r.valid_drafts(d) for r, d in zip(self.rows, host)])

    def forced(self, limit: int) -> tuple[list[int], ...] | None:
        """[B] up to `limit` tokens each row's grammar forces next (None: no row has any)."""
        rows = tuple([] if r is None else r.forced(limit) for r in self.rows)
        return rows if any(rows) else None

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The verifier's logits [B, J, V] at a block's positions (`drafts` [B, J − 1] the tokens before positions
        1..J−1, as if accepted), shaped row by row → float32 [B, J, V] (unshaped rows as they are)."""
        index = [b for b, r in enumerate(self.rows) if r is not None]
        rows = [r for r in self.rows if r is not None]
        out = logits.float().clone()
        if rows:
            dev = logits.device
            at = torch.tensor(index, device=dev)
            out[at] = shape(out[at], drafts.to(dev)[at], rows)
        return out


def shape(x: torch.Tensor, drafts: torch.Tensor, rows: list[RowShaping]) -> torch.Tensor:
    """x [R, J, V] float32 of the rows `rows`, drafts [R, J − 1] → shaped [R, J, V] (vLLM's order: logit bias,
    min_tokens, penalties; then the grammar)."""
    J, V = x.shape[1:]
    dev = x.device
    stack = lambda name: torch.stack([getattr(r, name) for r in rows]).to(dev)  # noqa: E731
    per_row = lambda values: torch.tensor(values, device=dev, dtype=torch.float32)[:, None, None]  # noqa: E731
    x = x + stack("bias")[:, None]
    held = torch.tensor([[r.out + j < r.controls.min_tokens for j in range(J)] for r in rows], device=dev)
    if held.any():
        x = x.masked_fill(held[:, :, None] & stack("ends")[:, None], NEG_INF)
    if any(r.controls.penalised for r in rows):
        counts = stack("counts")[:, None] + drafted_counts(drafts, J, V)  # [R, J, V] the output so far
        rep = per_row([r.controls.repetition_penalty for r in rows])
        seen = stack("prompt_seen")[:, None] | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = (x - per_row([r.controls.frequency_penalty for r in rows]) * counts
             - per_row([r.controls.presence_penalty for r in rows]) * (counts > 0).float())
    host = drafts.cpu().tolist()
    for i, r in enumerate(rows):
        allowed = r.allowed(host[i], J)
        if allowed is not None:
            x[i] = x[i].masked_fill(~allowed.to(dev), NEG_INF)
    return x


def drafted_counts(drafts: torch.Tensor, J: int, V: int) -> torch.Tensor:
    """[R, J, V]: at position j, how often each token occurs in drafts[:, :j] (the drafts before it)."""
    added = torch.zeros(len(drafts), J, V, device=drafts.device)
    if J > 1:
        added[:, 1:].scatter_(2, drafts[:, : J - 1, None].long(), 1.0)
    return added.cumsum(dim=1)
