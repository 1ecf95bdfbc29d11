"""The rejection sampler of speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Glossary
- accepted token: a drafted token d_i kept because u_i < p_i(d_i) / q_i(d_i).
- recovered token: after the first rejection at position n, a token drawn from
  norm(max(0, p_n − q_n)); together with acceptance this makes the output distributed as p.
- bonus token: when all k drafts are accepted, a token drawn from p_k (the verifier's
  distribution after the last draft). Either way a block emits n + 1 tokens.

Symbols: p = verifier (target) probabilities, q = drafter probabilities, both already warped by
the same temperature / top-k / top-p. Pure functions: all randomness comes in as uniforms.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import torch

from specloop.drafter.decode.sampling import RowParams, SamplingParams, sample, tempered_rows
from specloop.drafter.model import kernels


@dataclass
class BlockOutcome:
    tokens: torch.Tensor  # [B, k+1] emitted tokens; only the first num_accepted + 1 are valid
    num_accepted: torch.Tensor  # [B] int64, n in [0, k]
    drafted: torch.Tensor | None = None  # [B] int64: drafts each row offered (None: k each; fewer for a
    #                                      self-limiting drafter, `Proposal.lengths`)
    sources: list[str] | None = None  # [B] the speculator that drafted each row (a mix: `Proposal.sources`)
    predicted: torch.Tensor | None = None  # [B] Σ_i P_i over each row's drafted positions: the drafts the
    #                                        drafter expected accepted (`Proposal.confidence`; None without)

    def accepted(self, b: int) -> int:
        """n of row b (read from host lists made once per outcome: a step's commit reads every row)."""
        return self._lists[1][b]

    def emitted(self, b: int) -> list[int]:
        """The n + 1 tokens row b gained in this block."""
        tokens, n = self._lists
        return tokens[b][: n[b] + 1]

    @cached_property
    def _lists(self) -> tuple[list[list[int]], list[int]]:
        return self.tokens.tolist(), self.num_accepted.tolist()  # an outcome is not written once made

    @cached_property
    def last_tokens(self) -> torch.Tensor:
        """[B] the token each row emitted last: the recovered or bonus token at index n (gathered once: the engine
        and a following drafter both read it; a plain step's is its one column)."""
        if self.tokens.shape[1] == 1:
            return self.tokens[:, 0]
        return self.tokens[torch.arange(len(self.tokens)), self.num_accepted]


@functools.lru_cache(maxsize=64)
def no_accepts(rows: int, device: torch.device) -> torch.Tensor:
    """[rows] int64 zeros: a plain step's accepted counts, made once per (rows, device) and shared (nothing writes an
    outcome's counts: a step's first op after the forward costs ~30 µs on a CPU, bench/README.md section 48)."""
    return torch.zeros(rows, dtype=torch.long, device=device)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, k] bool → [B] number of leading True values."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def _capped(n: torch.Tensor, limit: torch.Tensor | None) -> torch.Tensor:
    """Rows drafted fewer than k tokens (continuous batching: k per request) accept at most their own
    k; the position after it is that row's bonus."""
    return n if limit is None else torch.minimum(n, limit.to(n.device))


def greedy_verdict(
    draft_tokens: torch.Tensor,  # [B, k]
    target: torch.Tensor,  # [B, k+1] the verifier's argmax at `last` and after each draft (device or host)
    limit: torch.Tensor | None = None,  # [B] each row's own k (<= k); None: k for every row
) -> BlockOutcome:
    """Temperature 0. The verifier's argmax at every position is the token it would emit; drafts are
    accepted while they equal it, and the argmax after the last accepted draft is the bonus/recovered token.
    """
    if draft_tokens.shape[1] == 0:  # a plain step: nothing to compare (three launches fewer on a GPU)
        return BlockOutcome(tokens=target, num_accepted=no_accepts(len(target), target.device))
    if draft_tokens.device.type == "cpu" and target.device.type == "cpu":
        return _greedy_on_host(draft_tokens, target, limit)
    n = _capped(_leading_true(draft_tokens == target[:, :-1]), limit)
    return BlockOutcome(tokens=target, num_accepted=n)


def _greedy_on_host(draft_tokens: torch.Tensor, target: torch.Tensor, limit: torch.Tensor | None) -> BlockOutcome:
    """`greedy_verdict` of host tensors compared as lists (a read each; the six ops of the tensor form each run cold
    after the layers, ~0.2 ms of a lookup step on two cores: bench/README.md section 57); the outcome's lists kept
    for its readers (`BlockOutcome.accepted`, `emitted`)."""
    drafts, choices = draft_tokens.tolist(), target.tolist()
    caps = [len(d) for d in drafts] if limit is None else limit.tolist()
    n = []
    for row, chosen, cap in zip(drafts, choices, caps):
        i, cap = 0, min(int(cap), len(row))
        while i < cap and row[i] == chosen[i]:
            i += 1
        n.append(i)
    outcome = BlockOutcome(tokens=target, num_accepted=torch.tensor(n, dtype=torch.long))
    outcome.__dict__["_lists"] = (choices, n)  # the cached property, already read
    return outcome


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, k] int64
    draft_probs: torch.Tensor,  # [B, k, V] q
    target_probs: torch.Tensor,  # [B, k+1, V] p
    uniforms: torch.Tensor,  # [B, k+1]: u_0..u_{k-1} accept tests, u_k samples the emitted token
    limit: torch.Tensor | None = None,  # [B] each row's own k (<= k); None: k for every row
) -> BlockOutcome:
    """Lossless acceptance for temperature > 0."""
    B, k = draft_tokens.shape
    if k == 0:  # a plain step: its token drawn from p alone, as the residual below would draw it (q = 0)
        return plain_sample(target_probs, uniforms)
    idx = draft_tokens[..., None]
    p_d = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, k] p_i(d_i)
    q_d = draft_probs.gather(-1, idx).squeeze(-1)  # [B, k] q_i(d_i)
    n = _capped(_leading_true(uniforms[:, :k] * q_d < p_d), limit)  # accept iff u < p/q
    rows = torch.arange(B, device=n.device)
    p_n = target_probs[rows, n]  # [B, V]
    q_n = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, draft_probs.shape[-1])], dim=1)[rows, n]  # q_k := 0
    if limit is not None:  # all of a row's own k accepted: a bonus, drawn from p alone
        q_n = torch.where((n == limit.to(n.device))[:, None], 0.0, q_n)
    residual = (p_n - q_n).clamp_(min=0)  # [B, V] norm(max(0, p − q)); equals p_n for the bonus
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q exactly: rejection was impossible
    residual = torch.where(empty, p_n, residual)
    emitted = sample(residual, uniforms[:, k])  # [B]
    tokens = torch.cat([draft_tokens, emitted[:, None]], dim=1)
    tokens[rows, n] = emitted
    return BlockOutcome(tokens=tokens, num_accepted=n)


def compiled_verdict(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                     params: SamplingParams | RowParams, uniforms: torch.Tensor,
                     limit: torch.Tensor | None = None, one_hot: bool = False) -> BlockOutcome | None:
    """A step's verdict (logits [B, k + 1, V]: the verifier's, not yet warped; k = 0 for a plain step) in one compiled
    call on the CPU: `rejection_sample`'s rule on sampled rows (p from the tempered logits, q as drafted; `one_hot`
    with no q: deterministic drafts, q one-hot on them, never made) and `greedy_verdict`'s on greedy rows, row by row
    (`kernels.rejection_rows`: the same verdicts up to float rounding, without warp's division and softmax over k + 1
    positions, the residual's passes and the draw's sequential cumulative sum: bench/README.md sections 49-50). None
    where it does not apply (top-k, top-p or min-p; q not fp32 on the CPU; a NaN): the caller warps and judges by
    ops."""
    t = tempered_rows(logits, params)
    plain = draft_tokens.shape[1] == 0  # nothing to judge against q
    cpu32 = draft_probs is not None and draft_probs.dtype == torch.float32 and draft_probs.device.type == "cpu"
    q_ok = plain or (one_hot if draft_probs is None else cpu32)
    if t is None or not q_ok:
        return None
    judged = kernels.rejection_rows(logits, t, draft_tokens, draft_probs, uniforms, limit)
    return None if judged is None else BlockOutcome(tokens=judged[0], num_accepted=judged[1])


def plain_sample(target_probs: torch.Tensor, uniforms: torch.Tensor) -> BlockOutcome:
    """The verdict on an empty draft: each row's token drawn from p_0 with u_0. The same bits as the general
    path's (its residual max(0, p − 0) is p, whose mass is positive), without its eight passes over the
    vocabulary (gathers, a [B, 1, V] zero q, clamp, sum, select, scatter: ~0.2 ms of a 5 ms step on the CPU)."""
    emitted = sample(target_probs[:, 0], uniforms[:, 0])
    return BlockOutcome(tokens=emitted[:, None], num_accepted=no_accepts(len(emitted), emitted.device))
