"""What a speculative step decided before it runs: the contract between the engine that plans a step
(drafter/decode/engine.py `Engine._plan`) and the step that runs it (drafter/decode/speculative.py
`speculative_step`), as vLLM's SpecDecodeMetadata is between its scheduler and its rejection sampler.

B is the number of rows the step runs over (the engine: its pool's occupied prefix m), k the most drafts
any row is asked for. Row b with its own k_b <= k draws 2 k_b + 1 uniforms from its own stream, as it
would decoded alone: the first k_b drive its drafting (`u_draft[b, :k_b]`), the next k_b its accept tests
(`u_accept[b, :k_b]`), the last its emitted token (`u_accept[b, k]`); the other columns are unused filler.
A step that verifies fewer than k drafts (a cut draft, a lookup that found none) reads its accept
uniforms from `accept_uniforms(cut)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specloop.drafter.decode.controller import Choice
from specloop.drafter.decode.sampling import RowParams, SamplingParams
from specloop.drafter.decode.shaping import StepShaper


@dataclass(frozen=True)
class StepPlan:
    """One step's decisions, fixed before its draft, verify and commit (never written after)."""

    active: torch.Tensor  # [B] bool: rows holding a request (the others ride along, their cache never advances)
    k: int  # drafts asked of the drafter per row: the widest row's k (0: a plain step, the verifier alone)
    params: SamplingParams | RowParams  # the sampling transform: one for every row, or one per row
    u_draft: torch.Tensor | None = None  # [B, k] float: drafting uniforms, on the host (None when greedy)
    u_accept: torch.Tensor | None = None  # [B, k + 1] float: columns [0, k) the accept tests, column k the emitted
    #                                       token's (None when greedy)
    limit: torch.Tensor | None = None  # [B] int64: row b accepts at most limit[b] <= k drafts (None: every row k)
    lookup: bool = False  # free drafts only (`Drafter.lookup`, or `forced`: no model pass), up to k per row
    confidence_cut: bool = False  # the controller's `cut` may shorten each row's draft by its confidence
    shaper: StepShaper | None = None  # rows' sampling controls and grammars (None: no row has any)
    forced: tuple[list[int], ...] | None = None  # [B] the tokens each row's grammar forces next, drafted free where
    #                                              the row's own draft is shorter (None: none anywhere, or not offered)
    # the engine's bookkeeping, not read by the step itself
    m: int = 0  # rows [0, m) of the pool the step runs over (the occupied prefix): B = m
    live: tuple[int, ...] = ()  # the occupied slots, ascending (each < m)
    row_k: tuple[int, ...] = ()  # [B] each row's own k (0: an empty slot, or a row decoded plain)
    choice: Choice | None = None  # the controller's k for the auto rows (None: no auto row, or no drafter)

    @classmethod
    def from_uniforms(cls, active: torch.Tensor, k: int, params: SamplingParams | RowParams,
                      uniforms: torch.Tensor | None, **fields) -> StepPlan:
        """A plan from uniforms [B, 2k + 1] in the layout above (a row's 2k + 1 draws in a row:
        `specloop.drafter.decode.sampling.draw_uniforms`); None when greedy."""
        u_draft, u_accept = (None, None) if uniforms is None else (uniforms[:, :k], uniforms[:, k:])
        return cls(active, k, params, u_draft, u_accept, **fields)

    def accept_uniforms(self, cut: int) -> torch.Tensor | None:
        """[B, cut + 1] the accept uniforms of a block verifying only its first cut <= k drafts: their tests,
        then the emitted token's."""
        if self.u_accept is None:
            return None
        return torch.cat([self.u_accept[:, :cut], self.u_accept[:, self.k:]], dim=1)
