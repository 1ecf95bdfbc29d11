"""Log-probabilities of emitted tokens (the OpenAI `logprobs` / `top_logprobs` of a request).

"Raw" log-probabilities, as vLLM reports them by default: the log-softmax of the verifier's logits
before temperature / top-k / top-p. Emitted token j of a block (accepted drafts 0..n−1, then the
recovered or bonus token n) is scored by the verify pass's logits at block index j, which are the
logits plain decoding computes for that token: speculation on or off, the same numbers.

Computed only for the rows that asked (`Scoring`), after the verdict, from logits the step has
anyway; a step where no row asked computes nothing.

A prompt's own tokens (`prompt_scores`: OpenAI's `echo` with `logprobs`, vLLM's prompt log-probabilities, what
evaluation harnesses score) come from a pass of their own over the prompt, in chunks of `PROMPT_CHUNK` positions
(so that no more than one chunk's logits is ever held), in a one-row cache of the prompt's length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenScore:
    """One emitted token: its log-probability and the `top` most likely tokens at its position,
    (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Scoring:
    """The rows of one step whose emitted tokens are scored; `speculative_step` fills in the rest."""

    rows: list[int]  # batch rows that asked
    top: int  # the most alternatives any of them asked for
    logprob: torch.Tensor | None = None  # [R, k+1] float32 log p(emitted token j) per asking row
    top_ids: torch.Tensor | None = None  # [R, k+1, top] int64
    top_logprobs: torch.Tensor | None = None  # [R, k+1, top] float32

    def fill(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """logits [B, k+1, V]: the verify pass's raw logits; tokens [B, k+1]: the block's emitted tokens."""
        idx = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
        lp = torch.log_softmax(logits[idx].float(), dim=-1)  # [R, k+1, V]
        self.logprob = lp.gather(-1, tokens.to(lp.device)[idx][..., None]).squeeze(-1).cpu()
        if self.top:
            values, ids = lp.topk(min(self.top, lp.shape[-1]), dim=-1)
            self.top_logprobs, self.top_ids = values.cpu(), ids.cpu()

    def scores(self, row: int, tokens: list[int], top: int) -> list[TokenScore]:
        """The first len(tokens) emitted tokens of batch row `row`, with `top` alternatives each."""
        i = self.rows.index(row)
        assert self.logprob is not None  # fill() ran before any row is scored
        out = []
        for j, t in enumerate(tokens):
            alts: list[tuple[int, float]] = []
            if top:  # a row that asked for alternatives: fill() kept the step's (self.top >= top)
                assert self.top_ids is not None and self.top_logprobs is not None
                alts = list(zip(self.top_ids[i, j, :top].tolist(), self.top_logprobs[i, j, :top].tolist()))
            out.append(TokenScore(t, float(self.logprob[i, j]), alts))
        return out


PROMPT_CHUNK = 128  # positions a prompt-scoring pass runs: its logits are [PROMPT_CHUNK, vocabulary] floats


@torch.inference_mode()
def prompt_scores(lean, prompt: list[int], top: int, chunk: int = PROMPT_CHUNK) -> list[TokenScore]:
    """Each prompt token after the first, scored by the verifier given the tokens before it: prompt[j] for
    j = 1..n-1 by the logits at position j - 1, with `top` alternatives (the first token has no context: OpenAI's
    `token_logprobs[0]` is null). `lean`: the verifier's LeanDecoder; one row, a cache it owns."""
    cache = lean.new_cache(1, len(prompt))
    out: list[TokenScore] = []
    for start in range(0, len(prompt) - 1, chunk):
        ids = prompt[start: min(start + chunk, len(prompt) - 1)]
        logits = lean.forward(cache, torch.tensor([ids], device=lean.device)).logits[0]  # [T, V]
        lp = torch.log_softmax(logits.float(), dim=-1)
        following = torch.tensor(prompt[start + 1: start + 1 + len(ids)], device=lp.device)
        chosen = lp.gather(-1, following[:, None]).squeeze(-1).tolist()
        alts: list[list[tuple[int, float]]] = [[] for _ in ids]
        if top:
            values, where = lp.topk(min(top, lp.shape[-1]), dim=-1)
            alts = [list(zip(i, v)) for i, v in zip(where.tolist(), values.tolist())]
        out += [TokenScore(t, c, a) for t, c, a in zip(following.tolist(), chosen, alts)]
    return out


def scoring_for(asked: dict[int, int]) -> Scoring | None:
    """row -> alternatives asked for (0..); None when no row asked (the default path computes nothing)."""
    return Scoring(sorted(asked), max(asked.values())) if asked else None
