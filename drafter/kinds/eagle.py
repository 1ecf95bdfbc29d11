"""A feature-level draft head on the verifier's last layer (EAGLE-style; Li et al. 2024).

The verifier's residual stream after its last layer, f_t, at the position that produced the newest
committed token x_{t+1}, already holds what the verifier knows about the context. The head
predicts the next such feature from it and the embedding of x_{t+1},

    z_{t+1} = W_in [rms(f_t) ⊙ a; rms(e(x_{t+1})) ⊙ b]
    z_{t+1} = z_{t+1} + W_down (silu(W_gate n) ⊙ W_up n),   n = rms(z_{t+1}) ⊙ c

and reads the next token through the verifier's own final norm and LM head (its rows over the
FR-Spec draft vocabulary: specloop.drafter.model.vocab), q(x_{t+2}) = softmax(W_head rms(z_{t+1})). Draft i + 1
feeds z back in place of f, with the token just drafted (no attention and no KV cache of its own:
one MLP block per draft, which is where it differs from EAGLE's one decoder layer).

What it reuses from the verifier: the features (captured by passes the verifier runs anyway, plain
steps included: `follows_plain`), the token embedding and the LM head rows (quantized as the
verifier's own linears). What it trains: everything in `FeatureHead` (offline by
`specloop.trainer.students.EagleStudent` on the verifier's features and distributions, unrolled over the
draft depth as at inference; online from replay records, whose `steer` holds f_t).
"""
from __future__ import annotations

import copy
import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from specloop.drafter.decode.proposer import (
    Choice,
    Proposal,
    VerifierView,
    choose,
    first_rows,
    stack_proposal,
    with_rows,
)
from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import RowParams, SamplingParams, argmax
from specloop.drafter.kinds.sd2 import MANIFEST
from specloop.drafter.model import kernels
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.graph import Replay
from specloop.drafter.model.vocab import expand
from specloop.drafter.model.weights.linears import linear
from specloop.drafter.model.weights.own_linears import kernel_linears
from specloop.drafter.model.weights.quant import quantize_like

HEAD_FILE = "eagle_head.safetensors"


@dataclass
class EagleConfig:
    hidden: int  # the verifier's width d
    intermediate: int = 768  # the head's MLP width
    layer: int = -1  # 0-based verifier layer whose output feeds the head (-1: the last)
    eps: float = 1e-5


class FeatureHead(nn.Module):
    """z' = step(z, e): the predicted next feature; `logits(z, head)` reads a token distribution."""

    def __init__(self, cfg: EagleConfig, final_norm: torch.Tensor | None = None):
        super().__init__()
        d, i = cfg.hidden, cfg.intermediate
        self.cfg = cfg
        self.norm_feature = nn.Parameter(torch.ones(d))
        self.norm_token = nn.Parameter(torch.ones(d))
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.norm_mlp = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * i, bias=False)
        self.down = nn.Linear(i, d, bias=False)
        self.norm_out = nn.Parameter(torch.ones(d) if final_norm is None else final_norm.detach().float().clone())
        with torch.no_grad():
            self.down.weight.mul_(0.1)  # the block starts close to the identity on fc's output

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), self.cfg.eps)

    def step(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """z [..., d] (a verifier feature or a predicted one), e [..., d] token embedding → z' [..., d]."""
        x = self.fc(torch.cat([self._rms(z, self.norm_feature), self._rms(e, self.norm_token)], dim=-1))
        gate, up = self.gate_up(self._rms(x, self.norm_mlp)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def logits(self, z: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """[..., d] → [..., rows of `head`] through the head's output norm."""
        return F.linear(self._rms(z, self.norm_out), head.to(z.dtype))

    def save(self, out: Path, extra: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().contiguous().cpu() for n, p in self.state_dict().items()}, out / HEAD_FILE)
        (out / MANIFEST).write_text(json.dumps({"kind": "eagle", "eagle": asdict(self.cfg)} | extra, indent=2))

    @classmethod
    def load(cls, directory: Path) -> "FeatureHead":
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
        if manifest.get("kind") != "eagle":
            raise ValueError(f"{directory} holds a {manifest.get('kind')!r} checkpoint, not an eagle head")
        head = cls(EagleConfig(**manifest["eagle"]))
        state = load_file(Path(directory) / HEAD_FILE)
        missing = set(head.state_dict()) - set(state)
        if missing:
            raise ValueError(f"{directory}: eagle head file lacks {sorted(missing)}")
        head.load_state_dict(state)
        return head


def new_head(lean: LeanDecoder, intermediate: int = EagleConfig.intermediate) -> FeatureHead:
    """An untrained head for the verifier `lean` (output norm from the verifier's final norm), the
    same on every call (its random initialisation is seeded: two workers, or a worker and a learner,
    start from one head)."""
    cfg = EagleConfig(hidden=lean.hidden_size, intermediate=intermediate, eps=lean.eps)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return FeatureHead(cfg, lean.final_norm)


def head_rows(lean: LeanDecoder, vocab: torch.Tensor | None) -> torch.Tensor:
    """The verifier's LM head over the draft vocabulary (all of it for None), as floats."""
    head = lean.lm_head
    if vocab is not None and hasattr(head, "rows"):  # only those rows (the whole head in floats: 113 MB)
        return head.rows(vocab.to(lean.device)).float()
    weight = (head if isinstance(head, torch.Tensor) else head.dequantize()).float()
    return weight if vocab is None else weight[vocab.to(weight.device)]


def pick(logits: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int, params: SamplingParams | RowParams,
         u: torch.Tensor | None) -> tuple[Choice, torch.Tensor]:
    """A draft from a head's logits over the draft vocabulary: the choice (its logits expanded to the
    full vocabulary) and the head's own probability of the token chosen [B]."""
    if params.greedy:  # the argmax over the rows (`pick_greedy`), the row expanded only for the choice's logits
        c, p = pick_greedy(logits, vocab)
        return (c if vocab is None else Choice(c.token, None, expand(c.logits, vocab, vocab_size))), p
    logits = logits.float()
    norm = torch.logsumexp(logits, dim=-1)  # over the draft vocabulary, before it is expanded
    if vocab is not None:
        logits = expand(logits, vocab, vocab_size)
    c = choose(logits, params, u)
    return c, (logits.gather(-1, c.token[:, None].to(logits.device)).squeeze(-1) - norm).exp()


def pick_greedy(logits: torch.Tensor, vocab: torch.Tensor | None, fast: bool = False) -> tuple[Choice, torch.Tensor]:
    """`pick` for greedy drafts, over the draft vocabulary's rows alone: the same token (the first of equal maxima,
    the draft vocabulary sorted as the full one is) and the same probability, with no [B, V] row made for an argmax
    (in situ, after a verifier step, expanding 8,192 rows to 49,152 tokens cost a draft ~0.2 ms on two CPU cores:
    bench/README.md section 55). The choice's logits are the rows' (`Proposal.logit_rows`). `fast`: in one C++ call
    on the CPU (`kernels.greedy_rows`: the same token, the probability within float rounding of the ops'; a
    quantized head's loop, where no captured chain is to match it bit for bit; section 56)."""
    logits = logits.float()
    picked = kernels.greedy_rows(logits) if fast else None
    if picked is None:
        col = argmax(logits).to(logits.device)
        best = logits.gather(-1, col[:, None]).squeeze(-1)
        picked = col, (best - torch.logsumexp(logits, dim=-1)).exp()
    col, p = picked
    token = col if vocab is None else vocab[col.to(vocab.device)]
    return Choice(token, None, logits), p


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def head_step(z: torch.Tensor, e: torch.Tensor, w: tuple, eps: float) -> torch.Tensor:
    """The prepared head's step (EagleDrafter.weights): z [B, d] and the embedded token e [B, d] → z' [B, d]."""
    n_feature, n_token, n_mlp, fc, gate_up, down = w[:6]
    x = linear(torch.cat([_rms(z, n_feature, eps), _rms(e, n_token, eps)], dim=-1), fc)
    gate, up = linear(_rms(x, n_mlp, eps), gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, down)


def head_logits(z: torch.Tensor, w: tuple, eps: float) -> torch.Tensor:
    """The prepared head's logits over its vocabulary rows from a predicted feature z [B, d]."""
    norm_out, head = w[6:]
    return linear(_rms(z, norm_out, eps), head)


def one_call(w: tuple) -> tuple | None:
    """The prepared head `w` (EagleDrafter.weights) as `kernels.head_draft` takes it: (the op, the four norms in fp32,
    (kinds, widths, packed tensors) of fc, gate_up, down and the LM head rows), or None where a linear is not one of
    specloop's CPU kernel weights (float heads, a GPU) or the kernels are not built."""
    args = kernel_linears((w[3], w[4], w[5], w[7]))  # first: only such weights have built the kernels already
    op = None if args is None else kernels.head_draft_op()
    if op is None or args is None:
        return None
    return op, [n.float() for n in (*w[:3], w[6])], args


def draft_chain(z: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor, *w: torch.Tensor,
                vocab: torch.Tensor | None, depth: int, vocab_size: int, eps: float, one=None):
    """`depth` greedy drafts for every row: (tokens [S, depth], confidence [S, depth], logits [S, depth, V]),
    the arithmetic of EagleDrafter.propose's loop, as one function of tensors (compiled once for every head of
    these shapes: `compiled_chain`). `one`: the function each draft runs (default `draft_one`; compiled, one graph
    serves every draft of the chain: the loop between them is captured with them on a GPU)."""
    one = one or draft_one
    drafted, confidence, logits = [], [], []
    run = torch.ones(tokens.shape[0], dtype=torch.float32, device=tokens.device)
    for _ in range(depth):
        z, tokens, run, out = one(z, tokens, run, embed, *w, vocab=vocab, vocab_size=vocab_size, eps=eps)
        drafted.append(tokens)
        confidence.append(run)
        logits.append(out)
    return torch.stack(drafted, 1), torch.stack(confidence, 1), torch.stack(logits, 1)


def draft_one(z: torch.Tensor, tokens: torch.Tensor, run: torch.Tensor, embed: torch.Tensor, *w: torch.Tensor,
              vocab: torch.Tensor | None, vocab_size: int, eps: float):
    """One greedy draft of the chain: (the predicted feature, the token, the run of the chain's probabilities,
    its logits over the full vocabulary)."""
    z = head_step(z, F.embedding(tokens, embed).to(z.dtype), w, eps)
    choice, p = pick(head_logits(z, w, eps), vocab, vocab_size, SamplingParams(), None)
    return z, choice.token, run * p, choice.logits


@functools.cache
def compiled_chain():
    """`draft_chain` with its draft compiled once per process (torch.compile's own cache holds a graph per shapes),
    on first use: importing this module does not import the compiler. One draft compiled, not the unrolled chain:
    a first compile of k_max drafts cost ~3 s more on the CPU (bench/README.md section 36)."""
    return functools.partial(draft_chain, one=torch.compile(draft_one, fullgraph=True, dynamic=False))


def chain_to_capture(drafter, slots: int | None, depth: int, compiled: bool, tensors: tuple) -> bool:
    """`use_chain`'s bookkeeping, the same for every head (eagle, eagle-3): whether a chain is to be captured now for
    `slots` rows and `depth` drafts from the head's `tensors`. Not where the held one (`drafter.chain`) was captured for
    the same (each engine asks: `generate` makes one per batch, and a capture per engine cost the GPU's batch-1 runs
    one per request); nor where slots is None or a tensor is not a plain one (quantized heads run the verifier's own
    kernels): then the drafter drafts through its loop (`drafter.chain` None)."""
    key = (slots, depth, compiled, tuple(map(id, tensors)))
    if drafter.chain is not None and key == drafter._chain_key:
        return False
    drafter.chain, drafter._chain_key = None, key
    if slots is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    drafter._depth = depth
    return True


def chained_proposal(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], m: int, k: int,
                     steer: torch.Tensor) -> Proposal:
    """A greedy block from a captured chain's outputs (tokens, confidence, logits for every slot and depth): the first
    k drafts of the engine's m rows, copied (the next replay overwrites the graph's outputs)."""
    tokens, confidence, logits = out
    kept = logits[:m, :k].clone()
    return Proposal(tokens=tokens[:m, :k].clone(), probs=None, logits=list(kept.unbind(1)), steer=steer,
                    confidence=confidence[:m, :k].clone())


def feature_layer(cfg: EagleConfig, num_layers: int) -> int:
    """The 0-based verifier layer the head reads."""
    layer = cfg.layer if cfg.layer >= 0 else num_layers + cfg.layer
    if not 0 <= layer < num_layers:
        raise ValueError(f"eagle head reads layer {cfg.layer}, outside the verifier's {num_layers}")
    return layer


class EagleDrafter:
    """Drafts k tokens per row with the head, from the verifier's newest feature and committed token."""

    kind = "eagle"
    record_layers: tuple[int, ...] = ()
    follows_plain = True  # plain (k = 0) steps also hand it the verifier's features: never behind
    follows_lazily = True  # its state is the newest feature alone: a plain step it skipped is made up by following one

    def __init__(self, verifier: LeanDecoder, head: FeatureHead, vocab: torch.Tensor | None = None):
        if head.cfg.hidden != verifier.hidden_size:
            raise ValueError(f"eagle head width {head.cfg.hidden} does not fit a {verifier.hidden_size}-wide verifier")
        self.lean, self.head_module = verifier, head.eval()
        self.verifier_layers: tuple[int, ...] = (feature_layer(head.cfg, verifier.num_layers),)
        self.vocab = None if vocab is None else vocab.to(verifier.device)
        self.chain: Replay | None = None  # greedy drafts as one captured graph (`use_chain`), else the loop
        self._chain_key: tuple = ()  # what the chain was captured for (use_chain's arguments, the head's tensors)
        self._depth = 0  # the chain's drafts
        self._linears(head)

    def _linears(self, head: FeatureHead) -> None:
        """The head's matrices prepared as the verifier's own linears are (specloop.drafter.model.weights.quant)."""
        prep = lambda w: quantize_like(self.lean, w.detach().float())  # noqa: E731
        self.fc, self.gate_up, self.down = prep(head.fc.weight), prep(head.gate_up.weight), prep(head.down.weight)
        dt = self.lean.dtype
        self.norms = [p.detach().to(self.lean.device, dt) for p in (head.norm_feature, head.norm_token, head.norm_mlp)]
        self.norm_out = head.norm_out.detach().to(self.lean.device, dt)
        self.head = prep(head_rows(self.lean, self.vocab))
        self._one_call = one_call(self.weights())


    def weights(self) -> tuple:
        """The head as `head_step` / `head_logits` take it: (norms ×3, fc, gate_up, down, norm_out, lm head rows)."""
        return (*self.norms, self.fc, self.gate_up, self.down, self.norm_out, self.head)

    def step(self, z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One head step for [B] tokens from features z [B, d]."""
        e = self.lean.embed_tokens(tokens[:, None])[:, 0].to(z.dtype)
        return head_step(z, e, self.weights(), self.head_module.cfg.eps)

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView) -> None:
        self.feature = view.features[self.verifier_layers[0]].to(self.lean.dtype)
        self.last = torch.tensor([p[-1] for p in prompts], dtype=torch.long)

    def join(self, slots: list[int], prompts: list[list[int]], view: VerifierView) -> None:
        idx = torch.tensor(slots, dtype=torch.long)
        feature = self.feature.clone()
        feature[idx.to(feature.device)] = view.features[self.verifier_layers[0]].to(feature.dtype)
        self.feature = feature
        self.last[idx] = torch.tensor([p[-1] for p in prompts], dtype=torch.long)

    def _head(self, z: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next feature and its logits over the head's rows: in one C++ call where the head's linears are
        specloop's CPU kernels (`one_call`), else `head_step` then `head_logits`."""
        eps = self.head_module.cfg.eps
        if self._one_call is not None:
            op, norms, args = self._one_call
            e = self.lean.embed_tokens(tokens[:, None])[:, 0].to(z.dtype)
            return tuple(op(z, e, norms, eps, *args))
        z = self.step(z, tokens)
        return z, head_logits(z, self.weights(), eps)

    def _draft(self, z: torch.Tensor, tokens: torch.Tensor, params: SamplingParams | RowParams,
               u: torch.Tensor | None) -> tuple[torch.Tensor, Choice, torch.Tensor]:
        """One draft: the next feature, the choice read from it, the head's probability of the token chosen."""
        z, logits = self._head(z, tokens)
        if params.greedy:  # the rows' logits kept as they are (`Proposal.logit_rows`)
            choice, p = pick_greedy(logits, self.vocab, fast=self._one_call is not None)
        else:
            choice, p = pick(logits, self.vocab, self.lean.vocab_size, params, u)
        return z, choice, p

    def use_chain(self, slots: int | None, depth: int = 0, compiled: bool = True) -> None:
        """Draft greedy blocks of up to `depth` tokens for an engine of `slots` rows through one captured graph
        (model.graph.Replay: a CUDA graph replayed where the eager loop launches ~20 kernels per draft), or,
        with slots None, through the eager loop. The engine's graph backend asks (Engine._graph_drafter). The
        compiled chain is one function for every head of these shapes (`draft_chain`, its weights passed in):
        a version swapped in is captured again (milliseconds), not compiled again; a chain of the same slots, depth,
        compilation and tensors is kept (`chain_to_capture`)."""
        head = (self.lean.embed, *self.weights())
        if not chain_to_capture(self, slots, depth, compiled, head):
            return
        assert slots is not None  # chain_to_capture says so
        fn = compiled_chain() if compiled else draft_chain
        vocab, vocab_size, eps = self.vocab, self.lean.vocab_size, self.head_module.cfg.eps
        dev, dt = self.lean.device, self.lean.dtype
        with torch.inference_mode():
            self.chain = Replay(lambda z, tokens: fn(z, tokens, *head, vocab=vocab, depth=depth, vocab_size=vocab_size,
                                                     eps=eps),
                                [torch.zeros(slots, self.lean.hidden_size, dtype=dt, device=dev),
                                 torch.zeros(slots, dtype=torch.long, device=dev)])

    @torch.inference_mode()
    def propose(self, k: int, params: SamplingParams | RowParams, uniforms: torch.Tensor | None) -> Proposal:
        chain = self.chain
        if params.greedy and chain is not None and k <= self._depth and len(self.feature) <= len(chain.buffers[0]):
            return self._chained(chain, k)
        z, tokens, steps = self.feature, self.last, []
        confidence: list[torch.Tensor] = []
        run: float | torch.Tensor = 1.0
        for i in range(k):
            z, choice, p = self._draft(z, tokens, params, None if uniforms is None else uniforms[:, i])
            steps.append(choice)
            tokens, run = choice.token, run * p
            confidence.append(run)  # the head's own probability that its drafts so far are all taken
        proposal = stack_proposal(steps, params)
        proposal.logit_rows = self.vocab if params.greedy else None  # (`pick_greedy`'s logits are the rows')
        proposal.steer = self.feature[:, None].float()  # what the block was drafted from (replay records)
        proposal.confidence = torch.stack(confidence, dim=1) if confidence else None
        return proposal

    def steer_now(self) -> torch.Tensor:
        """What a block drafted now starts from (its proposal's `steer`): an observed record's, on a step left plain."""
        return self.feature[:, None].float()

    def _chained(self, chain: Replay, k: int) -> Proposal:
        """A greedy block from the captured chain: its first k drafts for this engine's rows (copies: the next
        replay overwrites the graph's outputs)."""
        return chained_proposal(chain(self.feature, self.last.to(self.lean.device)), len(self.feature), k,
                                self.feature[:, None].float())

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView) -> None:
        new = view.features[self.verifier_layers[0]].to(self.feature.dtype)
        if bool(active.all()):  # every row advanced (the common step): no selection to launch
            self.feature, self.last = new, outcome.last_tokens
            return
        self.feature = torch.where(active[:, None].to(new.device), new, self.feature)
        self.last = torch.where(active, outcome.last_tokens, self.last)

    def narrow(self, m: int) -> "EagleDrafter":
        view = copy.copy(self)
        view.feature, view.last = first_rows(self.feature, m), first_rows(self.last, m)
        return view

    def widen(self, view: "EagleDrafter", m: int) -> None:
        self.feature, self.last = with_rows(self.feature, view.feature, m), with_rows(self.last, view.last, m)

    def adopt(self, old: "EagleDrafter") -> None:
        """Continue `old`'s rows: its state is the verifier's, valid for any head."""
        self.feature, self.last = old.feature, old.last

    def refill(self, old: "EagleDrafter", histories: list[list[int]]) -> None:
        self.adopt(old)
