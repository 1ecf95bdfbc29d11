"""Sampling parameters, the logits → probabilities transform, and inverse-CDF sampling.

The same `warp` is applied to the verifier's and the drafter's logits, so that the distribution
speculative decoding preserves is exactly the verifier's after temperature, top-k and top-p.
Randomness enters only as uniforms drawn from per-request `torch.Generator`s (`draw_uniforms`):
request i of a run owns the stream seeded from (seed, i), so its samples do not depend on what
else shares its batch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specloop.drafter.model import kernels

MIN_TEMPERATURE = 0.01  # a temperature in (0, this) samples at this one (as vLLM clamps it): logits / 1e-40 overflow


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy; (0, MIN_TEMPERATURE) is raised to MIN_TEMPERATURE
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int = 0
    ignore_eos: bool = False  # vLLM's: EOS does not end the request (it is emitted as any token)
    min_p: float = 0.0  # 0 = off; else tokens below min_p × the most likely token's probability are dropped
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request as EOS does (not emitted; even with ignore_eos)

    def __post_init__(self):
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN fails the first test
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class RowParams:
    """The sampling transforms of a batch whose rows belong to different requests (continuous
    batching). Rows with equal (temperature, top-k, top-p) are warped together by the scalar path,
    so each row gets bit for bit what it would get decoded alone."""

    rows: tuple[SamplingParams, ...]  # one per batch row (empty slots: the greedy default)

    @property
    def greedy(self) -> bool:
        """Every row greedy: the whole step takes the temperature-0 path."""
        return all(p.greedy for p in self.rows)

    @property
    def greedy_rows(self) -> torch.Tensor:
        """[B] bool."""
        return torch.tensor([p.greedy for p in self.rows])

    def groups(self) -> dict[SamplingParams, torch.Tensor]:
        """Sampled rows by transform: a representative SamplingParams → row indices [R]."""
        by: dict[tuple, list[int]] = {}
        for b, p in enumerate(self.rows):
            if not p.greedy:
                by.setdefault(warp_key(p), []).append(b)
        return {SamplingParams(t, k, tp, min_p=mp): torch.tensor(rows) for (t, k, tp, mp), rows in by.items()}


def warp_key(p: SamplingParams) -> tuple[float, int, float, float]:
    """What `warp` reads of a SamplingParams: rows with equal keys are warped together."""
    return (p.temperature, p.top_k, p.top_p, p.min_p)


def warp(logits: torch.Tensor, params: SamplingParams | RowParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, min-p and top-p (vLLM's order). logits: [B, ..., V] → float32.
    With RowParams, greedy rows get softmax(logits) (temperature 1: what their log q is logged from)."""
    if isinstance(params, RowParams):
        return _warp_rows(logits, params)
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


def _warp_rows(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    greedy = params.greedy_rows.to(logits.device)
    out[greedy] = torch.softmax(logits[greedy].float(), dim=-1)
    for group, rows in params.groups().items():
        out[rows.to(logits.device)] = warp(logits[rows.to(logits.device)], group)
    return out


TOP_P_FIRST = 64  # the most likely tokens a CPU top-p looks at first (most nuclei are smaller); ×8 while too few
TOP_P_MARGIN = 1e-4  # the candidates hold the nucleus once their last one's mass before it is top_p + this


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the top-1 always).

    The tokens in descending order of p, each kept while the mass before it is under top_p. On the CPU only the
    most likely `TOP_P_FIRST` (then 8×, ...) are ordered, as long as the mass before the last of them is top_p
    and a margin (far above the float error of the sums) in every row: no token after it is kept, and the kept
    tokens, their order and their partial sums are those of the whole vocabulary sorted (a sort of 49k
    probabilities took 3.3 ms, a 5 ms step's worth, against 0.1 ms for the 64 largest). On a GPU, one sort: no
    host read between the step's kernels."""
    vocab = probs.shape[-1]
    take = vocab if probs.device.type != "cpu" else min(TOP_P_FIRST, vocab)
    while True:
        top, order = probs.sort(dim=-1, descending=True) if take >= vocab else probs.topk(take, dim=-1)
        mass_before = top.cumsum(dim=-1) - top
        if take >= vocab or bool((mass_before[..., -1] >= top_p + TOP_P_MARGIN).all()):
            break
        take = min(vocab, 8 * take)
    kept = torch.zeros_like(probs).scatter_(-1, order, top.masked_fill(mass_before >= top_p, 0.0))
    return kept / kept.sum(dim=-1, keepdim=True)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), the same indices (the first of equal maxima; a NaN counts as the largest): float
    logits on the CPU through numpy, whose argmax is vectorised. torch's CPU argmax (2.13) is not: 87 µs over a
    49,152-token vocabulary against numpy's 7, 1.74 ms against 0.16 at [8, 5, V] (bench/README.md section 48)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64) or logits.requires_grad:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.contiguous().numpy().argmax(axis=-1))


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: [N, V] (need not sum to 1), u: [N] in [0, 1) → [N] int64. On the CPU in one
    compiled call (`kernels.sample_rows`: the same bits as `sample_by_ops`'s ten ops, each of which runs cold after
    a forward; ~30 µs a sampled step less on 2 cores, bench/README.md section 48)."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2 and u.device.type == "cpu":
        drawn = kernels.sample_rows(probs, u)
        if drawn is not None:
            return drawn
    return sample_by_ops(probs, u)


def tempered_rows(logits: torch.Tensor, params: SamplingParams | RowParams) -> torch.Tensor | None:
    """[B] each row's temperature (0: greedy) where the compiled verdict (`rejection.compiled_verdict`) can judge the
    rows of `logits` [B, ...]: fp32 on the CPU, every row greedy or at a temperature alone (no top-k, top-p or min-p);
    else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return None
    rows = params.rows if isinstance(params, RowParams) else (params,) * len(logits)
    if len(rows) != len(logits) or any(p.top_k or p.top_p < 1.0 or p.min_p > 0 for p in rows if not p.greedy):
        return None
    return _temperatures(tuple(p.temperature for p in rows))


@functools.lru_cache(maxsize=64)
def _temperatures(values: tuple[float, ...]) -> torch.Tensor:
    """The rows' temperatures as a tensor, shared by the steps of a batch (a tuple of a few floats a key)."""
    return torch.tensor(values, dtype=torch.float32)


def sample_by_ops(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample` in torch ops (any device: on a GPU no host read)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None].to(cdf.device, cdf.dtype) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def make_generators(seed: int, n: int, start: int = 0) -> list[torch.Generator]:
    """One generator per request; request i is seeded from (seed, i)."""
    return [torch.Generator().manual_seed(_mix(seed, start + i)) for i in range(n)]


def _mix(seed: int, index: int) -> int:
    """A 63-bit seed from the pair (seed, index) (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def draw_uniforms(generators: list[torch.Generator], n: int) -> torch.Tensor:
    """[B, n] uniforms, row b from generators[b]."""
    return torch.stack([torch.rand(n, generator=g) for g in generators])
