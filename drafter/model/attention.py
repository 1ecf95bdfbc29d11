"""The decoder's reference attention path (torch's ops, where specloop.drafter.model.kernels do not serve):
`exact_attention`, bit for bit the same for a query whatever the pass's length, batch or attended key
blocks; the rotary embedding (`_rope`); where a step's new tokens go (`StepPositions`); and the
constants of the KV cache's layout (`KEY_BLOCK`, `KV_DTYPE`, `QUERY_CHUNK`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Keys are attended in whole blocks of this many positions (the KV cache's capacity is a multiple).
KEY_BLOCK = 64
# The KV cache and attention on the CPU, in every weight mode (bf16 keys and values are upcast exactly): fp32
# batched products cost a third of bf16 ones at decode shapes there, and no per-step conversion. On a GPU the
# cache takes the model's dtype (`kv_dtype`). The CPU's own kernels also read a bf16 cache where one is asked for
# (SPECLOOP_KV_CACHE_DTYPE=bfloat16 or float16): widened exactly in registers, half the bytes a long context's step
# reads.
KV_DTYPE = torch.float32
CPU_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the CPU's own kernels read (16 bits: widened)
KV_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}  # KV_CACHE_ENV's values
KV_CACHE_ENV = "SPECLOOP_KV_CACHE_DTYPE"  # (`specloop serve --kv-cache-dtype` sets it in a worker's process)
# Queries are attended at most this many tokens per call (longer passes, i.e. prefills, go in chunks).
QUERY_CHUNK = 16


def kv_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a decoder whose activations are `dtype` on `device`. "auto" (the default;
    SPECLOOP_KV_CACHE_DTYPE=float32 / bfloat16 / float16 chooses): fp32 on the CPU (the checkpoint's own
    attention), on a GPU the model's own dtype, as its keys and values come out of the projections: a bf16
    model's cache in bf16 holds the same values as an fp32 one (a bf16 key upcasts exactly) in half the bytes a
    step reads (at batch 8
    and 512 cached tokens, a SmolLM2-1.7B step reads 1.8 GB of fp32 KV beside 3.4 GB of weights).
    What changes is where attention rounds: its products and softmax in the cache's dtype. The graph step
    is exact by construction whatever that dtype (its plain step and verify pass share every shape)."""
    wanted = os.environ.get(KV_CACHE_ENV, "auto")
    if wanted not in KV_DTYPES:
        raise ValueError(f"SPECLOOP_KV_CACHE_DTYPE must be one of {', '.join(KV_DTYPES)}, got {wanted!r}")
    chosen = KV_DTYPES[wanted]
    if chosen is not None:
        return chosen
    return KV_DTYPE if device.type == "cpu" or dtype not in (torch.bfloat16, torch.float16) else dtype


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def exact_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, hidden: torch.Tensor,
                    scale: float, wide: bool = False) -> torch.Tensor:
    """Causal attention of q [B, T, H, D] over the cache (kc/vc [B, H_kv, capacity, D]) → [B, T, H, D],
    computed so that a query's output does not depend on T, on the batch, or on how many whole key
    blocks are attended: a verify pass of k+1 tokens scores every token bit for bit as the one-token
    step at its position does, and rows of different lengths share a batch exactly.

    How (the reduction structure is fixed by construction, not by the call's shape):
    - a pass of T tokens makes, for every token, the very products a one-token step makes (same
      shapes, same batch of rows and KV heads), one token after another: a BLAS may round a product
      by its shape (on AMD EPYC, one product with 5+ query columns rounds otherwise than one with 3),
      so no token's product is ever widened by another's;
    - scores are [rep, D] @ [D, L] per (row, KV head): the token's head group as rows, the keys as
      columns, each score a dot product over D alone;
    - keys are taken in whole blocks of KEY_BLOCK; positions a query may not see (`hidden`
      [B, 1, T, 1, L]: the causal tail and the stale rest of the last block) score -inf, so their
      probabilities are exactly 0 and appended blocks add exact zeros to every sum; the softmax runs
      over the keys in fp32 (a max is exact in any order; a sum over appended zeros is unchanged);
    - values are summed per key block (probs[rep, KEY_BLOCK] @ values[KEY_BLOCK, D] in fp32, one
      fixed inner length), and the blocks' sums are added in a fixed pairwise tree over a
      power-of-two count: zero blocks appended at the end leave every addition as it was (one product
      over all L keys is not enough: the BLAS splits a long reduction by its length);
    - queries go in chunks of at most QUERY_CHUNK tokens, which bounds a long prefill's temporaries.
    `wide` (a prefill on a GPU: `attend_wide`) gives all of that up for one product over every query.
    tests/drafter/model/test_decoder.py checks the bit-identity on the CPU that runs the suite (T 1..9, batches
    1/3/8, ragged rows, long prefills, every weight mode): that a product's result depends on its
    shape and operands alone, whatever the number of key columns, is a property of the machine's
    BLAS, which that test keeps honest.
    """
    T = q.shape[1]
    if wide:
        return attend_wide(q, kc, vc, hidden, scale)
    if T <= QUERY_CHUNK:
        return _attend(q, kc, vc, hidden, scale)
    return torch.cat([_attend(q[:, a : a + QUERY_CHUNK], kc, vc, hidden[:, :, a : a + QUERY_CHUNK], scale)
                      for a in range(0, T, QUERY_CHUNK)], dim=1)


def attend_wide(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, hidden: torch.Tensor,
                scale: float) -> torch.Tensor:
    """`exact_attention`'s inputs and output, all T queries in one product per step (scores, softmax, values):
    a few kernels where the exact form launches two per token, per layer. For a prefill on a GPU, where no
    later pass is compared with this one bit for bit: the graph backend's decode steps run their own static
    step (specloop.drafter.model.graph), and its plain and speculative decoding share the prefill. The bench
    on an H200 (bench/README.md section 25) found the per-token form taking ~35 % of the reference pair's time
    at batch 1, ~70 % at batch 8 (15,000 products for 16 prompts)."""
    B, T, H, D = q.shape
    Hkv, L = kc.shape[1], hidden.shape[-1]
    rep = H // Hkv
    queries = q.view(B, T, Hkv, rep, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, T * rep, D).to(kc.dtype)
    scores = torch.matmul(queries, kc[:, :, :L].transpose(-1, -2)).view(B, Hkv, T, rep, L) * scale
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).view(B, Hkv, T * rep, L)
    out = torch.matmul(probs, vc[:, :, :L])  # [B, Hkv, T rep, D]
    return out.to(q.dtype).view(B, Hkv, T, rep, D).permute(0, 2, 1, 3, 4).reshape(B, T, H, D)


def _attend(q, kc, vc, hidden, scale):
    B, T, H, D = q.shape
    Hkv, L = kc.shape[1], hidden.shape[-1]
    rep, n = H // Hkv, L // KEY_BLOCK
    keys = kc[:, :, :L].reshape(B * Hkv, L, D).transpose(1, 2)  # [B Hkv, D, L], a view
    queries = q.view(B, T, Hkv, rep, D).transpose(1, 2).reshape(B * Hkv, T, rep, D).to(kc.dtype)
    scores = torch.stack([torch.bmm(queries[:, t], keys) for t in range(T)], 1)  # [B Hkv, T, rep, L]
    scores = scores.view(B, Hkv, T, rep, L).mul_(scale).masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B * Hkv, T, rep, n, KEY_BLOCK).transpose(2, 3)
    values = vc[:, :, :L].reshape(B * Hkv * n, KEY_BLOCK, D)  # [B Hkv n, blk, D]
    parts = torch.stack([torch.bmm(probs[:, t].reshape(B * Hkv * n, rep, KEY_BLOCK), values).view(B * Hkv, n, rep, D)
                         for t in range(T)], 1)  # [B Hkv, T, n, rep, D]
    out = _sum_over_key_blocks(parts.float())  # [B Hkv, T, rep, D]; a bf16 cache's block sums added in fp32
    return out.to(q.dtype).view(B, Hkv, T, rep, D).transpose(1, 2).reshape(B, T, H, D)


def _sum_over_key_blocks(parts: torch.Tensor) -> torch.Tensor:
    """Σ over dim 2 of parts [..., T, n, rep, D] (one value sum per key block) in a fixed pairwise tree
    over the n blocks padded with zeros to a power of two → [..., T, rep, D]."""
    n = parts.shape[2]
    width = 1 << (n - 1).bit_length()
    if width > n:
        pad = list(parts.shape)
        pad[2] = width - n
        parts = torch.cat([parts, parts.new_zeros(pad)], dim=2)
    while parts.shape[2] > 1:
        parts = parts[:, :, 0::2] + parts[:, :, 1::2]
    return parts[:, :, 0]


@dataclass
class StepPositions:
    """Where a step's new tokens go. The eager attention's fields (rows .. sin) are None where
    specloop.drafter.model.kernels.attend runs, which needs `lens` alone."""
    rows: torch.Tensor | None  # [B, T] row index of every new token
    pos: torch.Tensor | None  # [B, T] absolute position of every new token
    mask: torch.Tensor | None  # [B, 1, T, 1, L] True where a key is hidden from the query (L: whole key blocks)
    cos: torch.Tensor | None  # [B, T, 1, D]
    sin: torch.Tensor | None
    max_len: int  # L: keys attended this step
    lens: torch.Tensor  # [B] host int64: valid positions per row before the step (new tokens go from here)
    wide: bool = False  # attend all queries in one product (`attend_wide`: a prefill on a GPU)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half convention (x: [B, T, H, D], cos/sin: [B, T, 1, D])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
