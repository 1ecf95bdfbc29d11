"""An independent pretrained LM as drafter, with its own KV cache rolled back on rejection."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from specloop.drafter.decode.prefix_cache import PrefixCache, prefill_cached
from specloop.drafter.decode.proposer import Proposal, VerifierView, choose, first_rows, stack_proposal, with_rows
from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import RowParams, SamplingParams
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.kv_cache import pad_right, prefill, prefill_rows

if TYPE_CHECKING:
    from typing import Self  # Python 3.11: annotations only (the package runs on 3.10)


class PretrainedDrafter:
    """Drafts autoregressively with a small LM sharing the verifier's vocabulary.

    Its cache holds committed tokens except `pending` (1 or 2 per row: the bonus token, and the
    k-th draft when all k were accepted), which are fed first at the next proposal.
    """

    kind = "pretrained"
    verifier_layers: tuple[int, ...] = ()
    record_layers: tuple[int, ...] = ()
    follows_plain = False  # its cache misses the tokens of plain steps
    graph_width = 2  # its widest decode pass (the pending tokens): model.graph runs its LM at this width
    graph_biased = False  # its LM's passes carry per-layer MLP biases (`block_bias`: the steered kinds)
    prefix_cache: PrefixCache | None = None  # its LM's prompt prefixes (an engine with prefix caching hands one over)

    def __init__(self, lean: LeanDecoder):
        self.lean = lean

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView | None = None) -> None:
        self.cache, _ = prefill(self.lean, prompts, capacity)
        self.pending = [[p[-1]] for p in prompts]

    def join(self, slots: list[int], prompts: list[list[int]], view: VerifierView | None = None) -> None:
        """New requests take rows `slots` (continuous batching): prefill their prompts there (through its prefix
        cache where it has one: drafter/decode/prefix_cache.py)."""
        if self.prefix_cache is None:
            prefill_rows(self.lean, self.cache, slots, prompts)
        else:
            prefill_cached(self.lean, self.cache, slots, prompts, self.prefix_cache)
        for s, p in zip(slots, prompts):
            self.pending[s] = [p[-1]]

    def propose(self, k: int, params: SamplingParams | RowParams, uniforms: torch.Tensor | None) -> Proposal:
        self._base = self.cache.lens  # forward() rebinds lens, never writes it in place
        tokens, self._n_pending = pad_right(self.pending)
        steer = self.block_inputs()
        bias = self.block_bias(steer)
        chained = self._chained(tokens, k, bias) if params.greedy and k else None
        if chained is not None:
            chained.steer = steer
            return chained
        steps = []
        for i in range(k):
            n_new = self._n_pending if i == 0 else None
            out = self.lean.forward(self.cache, tokens, n_new=n_new, last_only=True, mlp_up_bias=bias)
            steps.append(choose(out.logits[:, -1], params, None if uniforms is None else uniforms[:, i]))
            tokens = steps[-1].token[:, None]
        proposal = stack_proposal(steps, params)
        proposal.steer = steer
        return proposal

    def _chained(self, tokens: torch.Tensor, k: int, bias: list[torch.Tensor] | None) -> Proposal | None:
        """A greedy block as one captured graph of k passes (its LM on the graph backend, replaying its own
        graphs: model.graph.GraphDecoder.draft_chain), the same drafts as the loop; None: the loop."""
        chain = getattr(self.lean, "draft_chain", None)
        out = None if chain is None else chain(self.cache, tokens, self._n_pending, k, bias)
        if out is None:
            return None
        drafts, logits = out
        return Proposal(tokens=drafts, probs=None, logits=list(logits.unbind(1)))

    def block_bias(self, steer: torch.Tensor | None) -> list[torch.Tensor] | None:
        """Per-layer MLP up-projection bias for this block from its steering inputs (steered kinds);
        None for a plain LM."""
        return None

    def block_inputs(self) -> torch.Tensor | None:
        """[B, 3, d_verifier] steering inputs of this block (steered kinds); None for a plain LM."""
        return None

    def narrow(self, m: int) -> Self:
        view = copy.copy(self)
        view.cache, view.pending = first_rows(self.cache, m), first_rows(self.pending, m)
        return view

    def widen(self, view: Self, m: int) -> None:
        self.cache, self.pending = with_rows(self.cache, view.cache, m), with_rows(self.pending, view.pending, m)

    def adopt(self, old: Self) -> None:
        """Continue `old`'s rows with these weights, keeping its KV cache (computed with the old
        weights: stale until those positions are rewritten, which costs acceptance, never output)."""
        self.cache, self.pending = old.cache, old.pending

    def refill(self, old: Self, histories: list[list[int]]) -> None:
        """Continue `old`'s rows with a KV cache recomputed by these weights from each row's
        committed tokens (one prefill: exact, at the cost of a stall)."""
        PretrainedDrafter.start(self, histories, old.cache.capacity)

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView | None = None) -> None:
        n = outcome.num_accepted
        k = outcome.tokens.shape[1] - 1
        in_cache = self._base + self._n_pending + n.clamp(max=k - 1)
        self.cache.lens = torch.where(active, in_cache, self._base)
        for b in torch.nonzero(active).flatten().tolist():
            nb = outcome.accepted(b)
            first = nb - 1 if nb == k else nb  # all accepted: d_k never went through the drafter
            self.pending[b] = outcome.emitted(b)[first:]
