"""An EAGLE-3-style draft head: three verifier layers fused, one decoder layer over its own window.

The verifier's residual streams after a low, a middle and a high layer at the position that
produced committed token x_t are fused into one feature, g_t = W_fuse [rms(l_t); rms(m_t); rms(h_t)],
and paired with the token's embedding into the head's input for that position,

    u_t = W_in [rms(g_t); rms(e(x_t))].

One decoder layer (attention over the head's own inputs u of the last `window` committed positions,
with a learned bias per head and distance in place of rotary positions, then a SwiGLU MLP) turns
the newest u into z, read through the verifier's final norm and LM head rows (the FR-Spec draft
vocabulary: specloop.drafter.model.vocab) as the distribution of the next token. Draft i + 1 feeds z back as the
next position's feature, with the token just drafted: its input joins the window for the drafts
after it (Li et al. 2025, EAGLE-3; what differs from specloop.drafter.kinds.eagle: three layers instead of the
last, and attention over a window instead of one MLP step on one feature).

Training runs the same chains ("training-time test"): at depth j a position attends to the true
inputs up to j − 1 positions back and to its own chain's j − 1 predicted ones (`ttt_logits`), so
drafts after the first learn from the inputs they will see.

What a drafter keeps per row: the window's raw verifier features and tokens (weight-independent,
so a hot swap recomputes the rest: `adopt`), and their keys and values under the current weights.
The raw window is also what a replay record carries (`steer`), so the learner trains on it.
"""
from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from specloop.drafter.decode.proposer import Choice, Proposal, VerifierView, first_rows, stack_proposal, with_rows
from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import RowParams, SamplingParams
from specloop.drafter.kinds.eagle import chain_to_capture, chained_proposal, head_rows, pick
from specloop.drafter.kinds.sd2 import MANIFEST
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.graph import Replay
from specloop.drafter.model.weights.linears import linear
from specloop.drafter.model.weights.quant import quantize_like

HEAD_FILE = "eagle3_head.safetensors"
MAX_DRAFT = 16  # the distance bias covers window + MAX_DRAFT positions (longer drafts share its last entry)


@dataclass
class Eagle3Config:
    hidden: int  # the verifier's width d
    layers: list[int] = field(default_factory=list)  # the three 0-based verifier layers fused (low, middle, high)
    heads: int = 8  # attention heads of the head's decoder layer (hidden / heads each)
    window: int = 16  # committed positions the attention sees
    intermediate: int = 768  # MLP width
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def default_layers(num_layers: int) -> list[int]:
    """Low, middle and high: EAGLE-3's choice of an early, a middle and a late layer."""
    return [num_layers // 8, num_layers // 2, num_layers - 1]


@dataclass
class Weights:
    """The head's tensors as one forward reads them: matrices as raw tensors (training, autograd) or
    as the verifier's own prepared linears (serving, model.weights.quant); norms and the bias as tensors."""

    fuse: Any
    fc: Any
    qkv: Any
    o: Any
    gate_up: Any
    down: Any
    norm_layers: torch.Tensor  # [3, d]
    norm_feature: torch.Tensor
    norm_token: torch.Tensor
    norm_attn: torch.Tensor
    norm_mlp: torch.Tensor
    norm_out: torch.Tensor
    bias: torch.Tensor  # [heads, window + MAX_DRAFT]: attention logit added by distance
    cfg: Eagle3Config
    exact: bool = True  # serving: every row's result independent of the others (specloop.drafter.model.weights.linears)

    def lin(self, x: torch.Tensor, w) -> torch.Tensor:
        return linear(x, w, exact=self.exact)

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), self.cfg.eps)


# ----------------------------------------------------------------------------- the layer, as pure functions


def fuse(w: Weights, raw: torch.Tensor) -> torch.Tensor:
    """[..., 3d] raw verifier features (low, middle, high) → g [..., d]."""
    parts = raw.chunk(len(w.cfg.layers), dim=-1)
    return w.lin(torch.cat([w.rms(p, n) for p, n in zip(parts, w.norm_layers)], dim=-1), w.fuse)


def entry(w: Weights, g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """A position's input u [..., d] from its feature g (fused or predicted) and its token's embedding e."""
    return w.lin(torch.cat([w.rms(g, w.norm_feature), w.rms(e, w.norm_token)], dim=-1), w.fc)


def qkv(w: Weights, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """u [..., d] → q, k, v [..., heads, head_dim]."""
    shape = (*u.shape[:-1], w.cfg.heads, w.cfg.head_dim)
    q, k, v = (t.reshape(shape) for t in w.lin(w.rms(u, w.norm_attn), w.qkv).chunk(3, dim=-1))
    return q, k, v


def finish(w: Weights, u: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The residual stream after attention ([..., heads, head_dim] mixed values) and the MLP: z [..., d]."""
    x = u + w.lin(attended.flatten(-2), w.o)
    gate, up = w.lin(w.rms(x, w.norm_mlp), w.gate_up).chunk(2, dim=-1)
    return x + w.lin(F.silu(gate) * up, w.down)


def distance_bias(w: Weights, distance: torch.Tensor) -> torch.Tensor:
    """[heads, *distance.shape]: the learned logit bias at these distances (clamped to the table)."""
    return w.bias[:, distance.clamp(0, w.bias.shape[1] - 1)]


def softmax_mix(scores: torch.Tensor, values: torch.Tensor, chain_scores: list, chain_values: list) -> torch.Tensor:
    """Attention over a key group every query shares (scores [..., Q, S], −inf where masked; values
    [..., S, hd]) and one key of each query's own chain per entry (scores [..., Q, 1], values [..., Q, hd])."""
    p = torch.softmax(torch.cat([scores, *chain_scores], dim=-1), dim=-1)
    S = scores.shape[-1]
    out = p[..., :S] @ values
    for c, v in enumerate(chain_values):
        out = out + p[..., S + c : S + c + 1] * v
    return out


# ----------------------------------------------------------------------------- the module (training, checkpoints)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, final_norm: torch.Tensor | None = None):
        super().__init__()
        d, i, n = cfg.hidden, cfg.intermediate, len(cfg.layers)
        if n != 3 or d % cfg.heads or cfg.window < 1:
            raise ValueError(f"an eagle3 head fuses 3 layers (not {n}), with heads dividing {d} and a window >= 1")
        self.cfg = cfg
        self.norm_layers = nn.Parameter(torch.ones(n, d))
        self.fuse = nn.Linear(n * d, d, bias=False)
        self.norm_feature, self.norm_token = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.norm_attn, self.norm_mlp = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate_up, self.down = nn.Linear(d, 2 * i, bias=False), nn.Linear(i, d, bias=False)
        self.bias = nn.Parameter(torch.zeros(cfg.heads, cfg.window + MAX_DRAFT))
        self.norm_out = nn.Parameter(torch.ones(d) if final_norm is None else final_norm.detach().float().clone())
        with torch.no_grad():  # the block starts close to the identity on fc's output
            self.o.weight.mul_(0.1)
            self.down.weight.mul_(0.1)

    def weights(self) -> Weights:
        """The module's own tensors (autograd-tracked), for `ttt_logits` and `chain`."""
        return Weights(self.fuse.weight, self.fc.weight, self.qkv.weight, self.o.weight, self.gate_up.weight,
                       self.down.weight, self.norm_layers, self.norm_feature,
                       self.norm_token, self.norm_attn, self.norm_mlp, self.norm_out, self.bias, self.cfg, exact=False)

    def save(self, out: Path, extra: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().contiguous().cpu() for n, p in self.state_dict().items()}, out / HEAD_FILE)
        (out / MANIFEST).write_text(json.dumps({"kind": "eagle3", "eagle3": asdict(self.cfg)} | extra, indent=2))

    @classmethod
    def load(cls, directory: Path) -> "Eagle3Head":
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
        if manifest.get("kind") != "eagle3":
            raise ValueError(f"{directory} holds a {manifest.get('kind')!r} checkpoint, not an eagle3 head")
        head = cls(Eagle3Config(**manifest["eagle3"]))
        state = load_file(Path(directory) / HEAD_FILE)
        missing = set(head.state_dict()) - set(state)
        if missing:
            raise ValueError(f"{directory}: eagle3 head file lacks {sorted(missing)}")
        head.load_state_dict(state)
        return head


def new_head3(lean: LeanDecoder, window: int = Eagle3Config.window,
              intermediate: int = Eagle3Config.intermediate) -> Eagle3Head:
    """An untrained head for the verifier `lean`, the same on every call (seeded initialisation)."""
    cfg = Eagle3Config(hidden=lean.hidden_size, layers=default_layers(lean.num_layers), heads=lean.n_heads,
                       window=window, intermediate=intermediate, eps=lean.eps)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Eagle3Head(cfg, lean.final_norm)


def check_layers(cfg: Eagle3Config, num_layers: int) -> tuple[int, ...]:
    if not all(0 <= i < num_layers for i in cfg.layers):
        raise ValueError(f"eagle3 head reads layers {cfg.layers}, outside the verifier's {num_layers}")
    return tuple(cfg.layers)


# ----------------------------------------------------------------------------- training-time test


def ttt_logits(w: Weights, prev: torch.Tensor, embedded: torch.Tensor, depth: torch.Tensor, head: torch.Tensor,
               max_depth: int) -> torch.Tensor:
    """Logits [B, T, rows of `head`] at every position t of windows of sequences, each from the chain
    of depth[b, t] drafts that ends there, as drafting runs it.

    prev [B, T, 3d]: raw features at t − 1 (what produced token t); embedded [B, T, d]: e(x_t).
    Depth 1 at t attends over the true inputs t − window + 1 .. t; depth j over the true ones up to
    t − j + 1 and its own chain's predicted inputs at t − j + 2 .. t (EAGLE-3's training-time test)."""
    T, W = prev.shape[1], w.cfg.window
    pos = torch.arange(T, device=prev.device)
    dist = pos[:, None] - pos[None, :]  # [T(query), T(key)]
    scale = 1.0 / math.sqrt(w.cfg.head_dim)
    u = entry(w, fuse(w, prev), embedded)
    q, k1, v1 = (t.transpose(1, 2) for t in qkv(w, u))  # [B, H, T, hd]
    chain_k, chain_v, picked = [], [], None
    for j in range(1, max_depth + 1):
        if j > 1:
            u = entry(w, _shift(z, 1), embedded)  # noqa: F821 - z: the previous draft's, set at the end of its iteration
            q, kj, vj = (t.transpose(1, 2) for t in qkv(w, u))
            chain_k.append(kj)
            chain_v.append(vj)
        seen = (dist >= j - 1) & (dist <= W + j - 2)  # true keys t − j − W + 2 .. t − j + 1
        scores = torch.where(seen, q @ k1.transpose(-1, -2) * scale + distance_bias(w, dist), float("-inf"))
        own_s, own_v = [], []
        for i, (ki, vi) in enumerate(zip(chain_k, chain_v), start=2):  # chain input i sits at t − j + i
            bias = distance_bias(w, torch.tensor([j - i], device=prev.device))[:, :, None]  # [H, 1, 1]
            own_s.append((q * _shift(ki, j - i, dim=2)).sum(-1, keepdim=True) * scale + bias)
            own_v.append(_shift(vi, j - i, dim=2))
        attended = softmax_mix(scores, v1, own_s, own_v).transpose(1, 2)  # [B, T, H, hd]
        z: torch.Tensor = finish(w, u, attended)  # read by the next depth
        picked = z if picked is None else torch.where((depth == j)[..., None], z, picked)
    assert picked is not None  # max_depth >= 1: the loop ran
    return w.lin(w.rms(picked, w.norm_out), head)


def _shift(x: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """x moved n positions later along `dim` (zeros in front)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, n))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - n)], dim=dim)


# ----------------------------------------------------------------------------- drafting chains


@dataclass
class Window:
    """Per row: the last `window` committed positions (oldest first, the newest at the end)."""

    raw: torch.Tensor  # [B, W, 3d] the verifier's features there (zeros where not valid)
    tokens: torch.Tensor  # [B, W] int64
    valid: torch.Tensor  # [B, W] bool
    keys: torch.Tensor  # [B, W, H, hd] under the current weights
    values: torch.Tensor
    newest: torch.Tensor  # [B, d] the head's input u at the newest position (draft 1's query)


def window_entries(w: Weights, raw: torch.Tensor, e: torch.Tensor):
    """Inputs u and their keys and values for raw features [..., 3d] and token embeddings [..., d]."""
    u = entry(w, fuse(w, raw), e)
    _, k, v = qkv(w, u)
    return u, k, v


def chain(w: Weights, win: Window, embed: Callable, head, m: int, next_tokens: Callable) -> list[torch.Tensor]:
    """Draft m positions from each row's window: logits [B, rows of head] per draft. next_tokens(i,
    logits) gives the tokens draft i + 1 reads (what was drafted; in training, what was logged)."""
    W, scale = win.keys.shape[1], 1.0 / math.sqrt(w.cfg.head_dim)
    device = win.keys.device
    base = torch.arange(W - 1, -1, -1, device=device)  # distance of window slot s from the newest position
    u, out, chain_k, chain_v = win.newest, [], [], []
    q = qkv(w, u)[0]
    for i in range(m):  # draft i + 1, at i positions past the newest
        if i:
            u = entry(w, z, embed(tokens))  # noqa: F821 - the previous draft's z and tokens
            q, kk, vv = qkv(w, u)
            chain_k.append(kk)
            chain_v.append(vv)
        qq = q[:, :, None]  # [B, H, 1, hd]: one query per row
        s = (qq @ win.keys.permute(0, 2, 3, 1)) * scale + distance_bias(w, base + i)[:, None]  # [B, H, 1, W]
        s = s.masked_fill(~win.valid[:, None, None], float("-inf"))
        own_s = [(qq * kc[:, :, None]).sum(-1, keepdim=True) * scale
                 + distance_bias(w, torch.tensor([i - c], device=device))[:, :, None]
                 for c, kc in enumerate(chain_k, 1)]
        own_v = [vc[:, :, None] for vc in chain_v]
        attended = softmax_mix(s, win.values.transpose(1, 2), own_s, own_v)[:, :, 0]  # [B, H, hd]
        z: torch.Tensor = finish(w, u, attended)  # z and tokens: read by the next draft
        out.append(w.lin(w.rms(z, w.norm_out), head))
        tokens: torch.Tensor = next_tokens(i, out[-1])  # noqa: F841 - read by the next draft
    return out


def shifted_in(old: torch.Tensor, new: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Each row's window [B, W, ...] after appending its first count[b] entries of new [B, N, ...]."""
    W = old.shape[1]
    both = torch.cat([old, new.to(old.dtype)], dim=1)
    idx = torch.arange(W, device=old.device)[None] + count.to(old.device)[:, None]  # [B, W]
    return both.gather(1, idx.view(*idx.shape, *([1] * (old.dim() - 2))).expand(-1, -1, *old.shape[2:]))


MATRICES = ("fuse", "fc", "qkv", "o", "gate_up", "down")
VECTORS = ("norm_layers", "norm_feature", "norm_token", "norm_attn", "norm_mlp", "norm_out", "bias")


def draft_chain(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, newest: torch.Tensor,
                embed: torch.Tensor, head: torch.Tensor, *tensors: torch.Tensor, cfg: Eagle3Config,
                vocab: torch.Tensor | None, depth: int, vocab_size: int):
    """`depth` greedy drafts for every row from its window (keys, values [S, W, H, hd], valid [S, W], newest [S, d]):
    (tokens [S, depth], confidence [S, depth], logits [S, depth, V]), the arithmetic of Eagle3Drafter.propose's loop
    as one function of tensors (the head's MATRICES then VECTORS, plain tensors), so that it compiles once for every
    head of these shapes (`compiled_chain`) and runs as one captured graph on a GPU."""
    w = Weights(**dict(zip(MATRICES + VECTORS, tensors)), cfg=cfg, exact=True)
    win = Window(raw=newest, tokens=valid, valid=valid, keys=keys, values=values, newest=newest)  # (raw, tokens unread)
    drafted: list[torch.Tensor] = []
    confidence: list[float | torch.Tensor] = []
    logits: list[torch.Tensor] = []

    def greedy(i: int, out: torch.Tensor) -> torch.Tensor:
        choice, p = pick(out, vocab, vocab_size, SamplingParams(), None)
        confidence.append((confidence[-1] if confidence else 1.0) * p)  # the drafts so far all taken
        drafted.append(choice.token)
        logits.append(choice.logits)
        return choice.token

    chain(w, win, lambda t: F.embedding(t, embed).to(newest.dtype), head, depth, greedy)
    return torch.stack(drafted, 1), torch.stack(cast(list[torch.Tensor], confidence), 1), torch.stack(logits, 1)


@functools.cache
def compiled_chain():
    """`draft_chain` compiled once per process (torch.compile keeps a graph per shapes), on first use."""
    return torch.compile(draft_chain, fullgraph=True, dynamic=False)


# ----------------------------------------------------------------------------- serving


class Eagle3Drafter:
    """Drafts k tokens per row with the head, from each row's window of committed positions."""

    kind = "eagle3"
    record_layers: tuple[int, ...] = ()
    follows_plain = True  # plain steps hand it the verifier's features too: its window is never behind

    def __init__(self, verifier: LeanDecoder, head: Eagle3Head, vocab: torch.Tensor | None = None):
        if head.cfg.hidden != verifier.hidden_size:
            raise ValueError(f"eagle3 head width {head.cfg.hidden} does not fit a {verifier.hidden_size}-wide verifier")
        self.lean, self.head_module = verifier, head.eval()
        self.verifier_layers = check_layers(head.cfg, verifier.num_layers)
        # the verifier passes each committed position's features (VerifierView.recent)
        self.feature_window = head.cfg.window
        self.vocab = None if vocab is None else vocab.to(verifier.device)
        self.w = self._prepared(head)
        self.head = quantize_like(verifier, head_rows(verifier, self.vocab))
        self.win: Window | None = None
        self.chain: Replay | None = None  # greedy drafts as one captured graph (`use_chain`), else the loop
        self._chain_key: tuple = ()  # what the chain was captured for (use_chain's arguments, the head's tensors)
        self._depth = 0

    def _prepared(self, head: Eagle3Head) -> Weights:
        """The head's matrices as the verifier's own linears are (model.weights.quant); the rest in its dtype."""
        w, dt = head.weights(), self.lean.dtype
        mats = {n: quantize_like(self.lean, getattr(w, n).detach().float())
                for n in ("fuse", "fc", "qkv", "o", "gate_up", "down")}
        vecs = {n: getattr(w, n).detach().to(self.lean.device, dt)
                for n in ("norm_layers", "norm_feature", "norm_token", "norm_attn", "norm_mlp", "norm_out", "bias")}
        return Weights(**mats, **vecs, cfg=head.cfg, exact=True)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lean.embed_tokens(tokens.reshape(-1, 1)).reshape(*tokens.shape, -1).to(self.lean.dtype)

    def _raw(self, recent: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([recent[i] for i in self.verifier_layers], dim=-1).to(self.lean.dtype)

    def _appended(self, win: Window, raw: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> Window:
        """`win` after each row's first count[b] new positions (raw [B, N, 3d], tokens [B, N])."""
        u, k, v = window_entries(self.w, raw, self._embed(tokens))
        last = (count - 1).clamp(min=0).to(u.device)
        newest = torch.where((count > 0).to(u.device)[:, None], u[torch.arange(len(u), device=u.device), last],
                             win.newest)
        return Window(shifted_in(win.raw, raw, count), shifted_in(win.tokens, tokens, count),
                      shifted_in(win.valid, torch.ones_like(tokens, dtype=torch.bool), count),
                      shifted_in(win.keys, k, count), shifted_in(win.values, v, count), newest)

    def _empty(self, rows: int) -> Window:
        cfg, dev, dt = self.w.cfg, self.lean.device, self.lean.dtype
        W, H, hd = cfg.window, cfg.heads, cfg.head_dim
        kv = torch.zeros(rows, W, H, hd, device=dev, dtype=dt)
        return Window(torch.zeros(rows, W, len(cfg.layers) * cfg.hidden, device=dev, dtype=dt),
                      torch.zeros(rows, W, dtype=torch.long, device=dev),
                      torch.zeros(rows, W, dtype=torch.bool, device=dev),
                      kv, kv.clone(), torch.zeros(rows, cfg.hidden, device=dev, dtype=dt))

    def _fresh(self, prompts: list[list[int]], view: VerifierView) -> Window:
        """Windows for new rows: the prompt's positions the prefill captured, else its last token alone
        (a zero feature, as the verifier has none for a prompt's first token)."""
        S, dev = len(prompts), self.lean.device
        if view.recent is None:
            got = torch.zeros(S, dtype=torch.long)
        else:
            assert view.recent_lens is not None  # set together with recent
            got = view.recent_lens.cpu()
        width = max(1, int(got.max()))
        if int(got.max()) == 0:
            raw = torch.zeros(S, 1, len(self.verifier_layers) * self.lean.hidden_size, device=dev,
                              dtype=self.lean.dtype)
        else:
            assert view.recent is not None  # got > 0 only where the view has recent features
            raw = self._raw(view.recent)[:, :width].clone()
            raw[(got == 0).to(dev)] = 0
        tokens = torch.zeros(S, width, dtype=torch.long)
        for b, (p, m) in enumerate(zip(prompts, got.tolist())):
            tokens[b, : max(m, 1)] = torch.tensor(p[len(p) - m :] if m else p[-1:], dtype=torch.long)
        return self._appended(self._empty(S), raw, tokens.to(dev), got.clamp(min=1))

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView) -> None:
        self.win = self._fresh(prompts, view)

    @torch.inference_mode()
    def join(self, slots: list[int], prompts: list[list[int]], view: VerifierView) -> None:
        fresh, idx = self._fresh(prompts, view), torch.tensor(slots, dtype=torch.long, device=self.lean.device)
        parts = []
        for old, new in zip(vars(self.win).values(), vars(fresh).values()):
            t = old.clone()
            t[idx] = new
            parts.append(t)
        self.win = Window(*parts)

    def use_chain(self, slots: int | None, depth: int = 0, compiled: bool = True) -> None:
        """Draft greedy blocks of up to `depth` tokens for an engine of `slots` rows through one captured graph
        (model.graph.Replay: on a GPU one launch where the loop launches a few dozen kernels a draft), or, with
        slots None, through the loop; the engine's graph backend asks (Engine._graph_drafter). One compiled
        function for every head of these shapes (`draft_chain`, the weights passed in): a version swapped in is
        captured again, not compiled again; a chain of the same slots, depth, compilation and tensors is kept
        (`eagle.chain_to_capture`)."""
        tensors = (self.lean.embed, self.head, *(getattr(self.w, n) for n in MATRICES + VECTORS))
        if not chain_to_capture(self, slots, depth, compiled, tensors):
            return
        assert slots is not None  # chain_to_capture says so
        fn = compiled_chain() if compiled else draft_chain
        cfg, vocab, vocab_size = self.w.cfg, self.vocab, self.lean.vocab_size
        dev, dt = self.lean.device, self.lean.dtype
        kv = (slots, cfg.window, cfg.heads, cfg.head_dim)
        buffers = [torch.zeros(kv, device=dev, dtype=dt), torch.zeros(kv, device=dev, dtype=dt),
                   torch.ones(slots, cfg.window, dtype=torch.bool, device=dev),  # rows past the engine's: finite
                   torch.zeros(slots, cfg.hidden, device=dev, dtype=dt)]
        with torch.inference_mode():
            self.chain = Replay(lambda *win: fn(*win, *tensors, cfg=cfg, vocab=vocab, depth=depth,
                                                vocab_size=vocab_size), buffers)

    def _chained(self, chain: Replay, k: int) -> Proposal:
        """A greedy block from the captured chain: its first k drafts for this engine's rows (copies: the next
        replay overwrites the graph's outputs)."""
        win = self.win
        assert win is not None  # start() ran
        return chained_proposal(chain(win.keys, win.values, win.valid, win.newest), len(win.newest), k, win.raw.float())

    @torch.inference_mode()
    def propose(self, k: int, params: SamplingParams | RowParams, uniforms: torch.Tensor | None) -> Proposal:
        assert self.win is not None  # start() ran
        captured = self.chain
        if params.greedy and captured is not None and 0 < k <= self._depth and len(self.win.newest) <= len(
                captured.buffers[0]):
            return self._chained(captured, k)
        steps: list[Choice] = []
        confidence: list[torch.Tensor] = []
        run: list[float | torch.Tensor] = [1.0]

        def drafted(i: int, logits: torch.Tensor) -> torch.Tensor:
            choice, p = pick(logits, self.vocab, self.lean.vocab_size, params,
                             None if uniforms is None else uniforms[:, i])
            steps.append(choice)
            so_far = run[0] * p
            run[0] = so_far
            confidence.append(so_far)  # the head's own probability that its drafts so far are all taken
            return choice.token.to(self.lean.device)

        chain(self.w, self.win, self._embed, self.head, k, drafted)
        proposal = stack_proposal(steps, params)
        proposal.steer = self.win.raw.float()  # what the block was drafted from (replay records)
        proposal.confidence = torch.stack(confidence, dim=1) if confidence else None
        return proposal

    def steer_now(self) -> torch.Tensor:
        """What a block drafted now starts from (its proposal's `steer`): an observed record's, on a step left plain."""
        assert self.win is not None  # start() ran
        return self.win.raw.float()

    @torch.inference_mode()
    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView) -> None:
        dev = self.lean.device
        if view.recent is None:  # only the newest position's features: the window gains that position alone
            raw, tokens, count = (self._raw({i: f[:, None] for i, f in view.features.items()}),
                                  outcome.last_tokens[:, None], active.long())
        else:
            width = min(outcome.tokens.shape[1], view.recent[self.verifier_layers[0]].shape[1])
            raw, tokens = self._raw(view.recent)[:, :width], outcome.tokens[:, :width]
            count = torch.where(active, outcome.num_accepted + 1, 0).clamp(max=width)
        assert self.win is not None  # start() ran
        self.win = self._appended(self.win, raw, tokens.to(dev), count.to(dev))

    def narrow(self, m: int) -> "Eagle3Drafter":
        view = copy.copy(self)
        view.win = Window(*(first_rows(t, m) for t in vars(self.win).values()))
        return view

    def widen(self, view: "Eagle3Drafter", m: int) -> None:
        self.win = Window(*(with_rows(a, b, m) for a, b in zip(vars(self.win).values(), vars(view.win).values())))

    @torch.inference_mode()
    def adopt(self, old: "Eagle3Drafter") -> None:
        """Continue `old`'s rows: the raw window is the verifier's, valid for any head; keys, values
        and the newest input are recomputed under these weights."""
        win = old.win
        assert win is not None  # `old` was started
        u, k, v = window_entries(self.w, win.raw, self._embed(win.tokens))
        self.win = Window(win.raw, win.tokens, win.valid, k, v, u[:, -1])

    def refill(self, old: "Eagle3Drafter", histories: list[list[int]]) -> None:
        self.adopt(old)
