"""drafter/model/attention.py: the KV cache's dtype (`kv_dtype`); exact_attention's bit-identity lives in
test_decoder.py beside the decoder that runs it."""
from __future__ import annotations

import pytest
import torch

from specloop.drafter.model.attention import exact_attention, kv_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object: no GPU is touched


def test_the_cache_is_fp32_on_the_cpu_and_takes_a_half_precision_models_dtype_on_a_gpu(monkeypatch):
    monkeypatch.delenv("SPECLOOP_KV_CACHE_DTYPE", raising=False)
    assert kv_dtype(CPU, torch.bfloat16) == torch.float32  # the CPU's own kernels read fp32 keys
    assert kv_dtype(CPU, torch.float32) == torch.float32
    assert kv_dtype(CUDA, torch.bfloat16) == torch.bfloat16
    assert kv_dtype(CUDA, torch.float16) == torch.float16
    assert kv_dtype(CUDA, torch.float32) == torch.float32  # --weights fp32 keeps an fp32 cache


def test_the_environment_chooses_the_caches_dtype_and_a_wrong_value_is_refused(monkeypatch):
    monkeypatch.setenv("SPECLOOP_KV_CACHE_DTYPE", "float32")
    assert kv_dtype(CUDA, torch.bfloat16) == torch.float32
    monkeypatch.setenv("SPECLOOP_KV_CACHE_DTYPE", "bfloat16")
    assert kv_dtype(CPU, torch.float32) == torch.bfloat16
    monkeypatch.setenv("SPECLOOP_KV_CACHE_DTYPE", "fp8")
    with pytest.raises(ValueError, match="SPECLOOP_KV_CACHE_DTYPE must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        kv_dtype(CUDA, torch.bfloat16)


def test_a_bf16_cache_attends_as_its_values_upcast_to_fp32_do_within_bf16_rounding():
    # the same keys and values (bf16 ones upcast exactly) in either cache: only where attention rounds differs
    g = torch.Generator().manual_seed(0)
    B, T, H, Hkv, D, L = 2, 3, 4, 2, 16, 128
    q = torch.randn(B, T, H, D, generator=g).bfloat16()
    kc = torch.randn(B, Hkv, L, D, generator=g).bfloat16()
    vc = torch.randn(B, Hkv, L, D, generator=g).bfloat16()
    hidden = torch.zeros(B, 1, T, 1, L, dtype=torch.bool)
    hidden[..., 100:] = True
    half = exact_attention(q, kc, vc, hidden, D ** -0.5)
    full = exact_attention(q, kc.float(), vc.float(), hidden, D ** -0.5)
    assert half.dtype == full.dtype == torch.bfloat16
    assert torch.allclose(half.float(), full.float(), atol=3e-2, rtol=3e-2)
