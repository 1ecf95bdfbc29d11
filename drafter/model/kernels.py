"""specloop's own CPU kernels for the decode step (quantized products, attention, norms), built at run
time for this CPU.

The stock weight-only kernels (`torch._weight_int4pack_mm_for_cpu`, `torch._weight_int8pack_mm`)
compute every row of a call on its own: exact for verification, but a verify pass of 5 tokens
then streams the weights 5 times (measured: 3x a one-token step's int4 cost, 2x the int8 head's).
The kernels here read each tile of weights (64 outputs) from memory once for all rows of the call
(in chunks of 4 rows, the tile staying in L1 between chunks) and compute every row with the same
instructions in the same order whatever the number of rows, so a verify pass scores a token bit
for bit as a one-token step does, by construction:

- int4 (`q4_mm`): groups of 32 inputs, w = q · d + m with q in [0, 15] and fp16 d, m per (output,
  group) (GGUF Q4_1's own form); y[n] = Σ_g (d · Σ_{i in g} q x_i + m · Σ_{i in g} x_i), the inner sums
  in input order, the groups in order, fp32 throughout.
- int8 (`q8_mm`): per-output-channel symmetric int8, y[n] = scale[n] · Σ_i q x_i in input order.
- w4a8 (`w4a8_mm`): the int4 weights times activations rounded to int8 per row and group of 32
  (`quantized_rows`), integer dot products (AVX-512 VNNI, else AVX-512BW / AVX2 by |x| and sign),
  as llama.cpp multiplies Q4_1 by Q8_1; w8a8 (`w8a8_mm`): int8 blocks of 32 with an fp16 scale
  (GGUF Q8_0) likewise, and `w8a8_rows` looks rows of such a table up (an embedding).

The decode step around them is compiled too: `attend` (RoPE, the KV write and causal attention:
every query head over the keys up to its position through the same operations whichever query heads
share its KV head's loads, so exact across T, batch and threads by construction), `rms_norm`,
`silu_mul`, and `layer` (a whole decoder layer in one call).

Weights are laid out in blocks of 16 outputs ([N/16, K/2, 16] nibble pairs, [N/16, K, 16] int8),
so one vector of 16 lanes computes 16 outputs, 4 blocks a tile (independent accumulator chains);
threads split the tiles (each output is computed whole by one thread, so the thread count changes
no rounding).

The source is compiled once per CPU (`-march=native`, a build folder named by a digest of the
CPU's flags under torch's extension cache) with torch.utils.cpp_extension; where no compiler is
available `available()` is False and specloop.drafter.model.weights.quant uses the stock kernels. `_self_check()` runs at
load and refuses the build (falling back likewise) unless it computes the products and the attention
it should and multi-row calls equal row-alone calls bit for bit on this machine.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

LANES = 16  # outputs per weight block (one vector of fp32 lanes)
TILE = 4  # blocks per tile in the kernels: N is padded to a multiple of LANES * TILE
GROUP = 32  # int4 group size

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>

typedef float vf __attribute__((vector_size(64)));

static inline vf load_vf(const float* p) { vf v; std::memcpy(&v, p, 64); return v; }

// 16 bytes -> 16 floats, exactly (small integers), with the widest vectors this CPU has.
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf bytes_to_vf(__m128i b, bool is_signed) {
  const __m512i i = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  const __m512 f = _mm512_cvtepi32_ps(i);
  vf v; std::memcpy(&v, &f, 64); return v;
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vf bytes_to_vf(__m128i b, bool is_signed) {
  const __m128i hi8 = _mm_srli_si128(b, 8);
  const __m256 a = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  const __m256 c = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(hi8) : _mm256_cvtepu8_epi32(hi8));
  vf v; std::memcpy(&v, &a, 32); std::memcpy(reinterpret_cast<char*>(&v) + 32, &c, 32); return v;
}
#endif

#if defined(__AVX2__)
static inline void nibbles_to_vf(const uint8_t* p, vf& lo, vf& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  lo = bytes_to_vf(_mm_and_si128(b, m), false);
  hi = bytes_to_vf(_mm_and_si128(_mm_srli_epi16(b, 4), m), false);
}
static inline vf int8_to_vf(const int8_t* p) {
  return bytes_to_vf(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), true);
}
#else
static inline void nibbles_to_vf(const uint8_t* p, vf& lo, vf& hi) {
  for (int j = 0; j < 16; ++j) { lo[j] = (float)(p[j] & 15); hi[j] = (float)(p[j] >> 4); }
}
static inline vf int8_to_vf(const int8_t* p) {
  vf v;
  for (int j = 0; j < 16; ++j) v[j] = (float)p[j];
  return v;
}
#endif

// 16 fp16 values -> 16 floats (exact), F16C / AVX-512 where present.
static inline vf load_h16(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  vf v; std::memcpy(&v, &f, 64); return v;
#elif defined(__F16C__)
  const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  vf v; std::memcpy(&v, &a, 32); std::memcpy(reinterpret_cast<char*>(&v) + 32, &b, 32); return v;
#else
  vf v;
  for (int j = 0; j < 16; ++j) v[j] = c10::detail::fp16_ieee_to_fp32_value(p[j]);
  return v;
#endif
}

// A tile of TB blocks of 16 outputs (their weights stay in L1 while every row chunk passes), M rows.
// int4 groups of 32, w = q * d + m. Per output: the group's inputs summed in one chain in input
// order, then d * that + m * sum(x) added to the output's chain, groups in order.
template <int M, int TB>
static void q4_tile(const uint8_t* w, const uint16_t* d, const uint16_t* mn, const float* x, const float* xs,
                    float* y, int64_t K, int64_t ldy) {
  const int64_t G = K / 32, wstride = (K / 2) * 16, sstride = G * 16;
  vf out[M][TB];
  _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) out[r][t] = vf{};
  for (int64_t g = 0; g < G; ++g) {
    vf acc[M][TB];
    _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
      _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) acc[r][t] = vf{};
    for (int kk = 0; kk < 16; ++kk) {
      vf lo[TB], hi[TB];
      _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) nibbles_to_vf(w + t * wstride + g * 256 + kk * 16, lo[t], hi[t]);
      _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r) {
        const float x0 = x[r * K + g * 32 + 2 * kk], x1 = x[r * K + g * 32 + 2 * kk + 1];
        _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) {
          acc[r][t] = acc[r][t] + lo[t] * x0;
          acc[r][t] = acc[r][t] + hi[t] * x1;
        }
      }
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) {
      const vf dg = load_h16(d + t * sstride + g * 16), mg = load_h16(mn + t * sstride + g * 16);
      _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r) {
        out[r][t] = out[r][t] + dg * acc[r][t];
        out[r][t] = out[r][t] + mg * xs[r * G + g];
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) std::memcpy(y + r * ldy + t * 16, &out[r][t], 64);
}

// int8 tile: y = scale * sum q x, per output one chain over the inputs in order.
template <int M, int TB>
static void q8_tile(const int8_t* w, const float* s, const float* x, float* y, int64_t K, int64_t ldy) {
  vf acc[M][TB];
  _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) acc[r][t] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf q[TB];
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) q[t] = int8_to_vf(w + t * K * 16 + k * 16);
    _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r) {
      const float xk = x[r * K + k];
      _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) acc[r][t] = acc[r][t] + q[t] * xk;
    }
  }
  _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) {
    const vf sc = load_vf(s + t * 16);
    _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r) {
      const vf o = sc * acc[r][t];
      std::memcpy(y + r * ldy + t * 16, &o, 64);
    }
  }
}

template <typename F>
static void by_rows(int64_t rows, F&& f) {  // chunks of up to 4 rows, each through its own template
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1: f(r0, std::integral_constant<int, 1>{}); break;
      case 2: f(r0, std::integral_constant<int, 2>{}); break;
      case 3: f(r0, std::integral_constant<int, 3>{}); break;
      default: f(r0, std::integral_constant<int, 4>{}); break;
    }
  }
}

constexpr int TILE = 4;  // blocks of 16 outputs per tile: 64 outputs (N is padded to a multiple)

// f(first block, first row, rows as a compile-time constant) for every tile and row chunk: each
// tile on one thread (an output is computed whole by one thread), its row chunks one after another.
template <typename F>
static void over_tiles(int64_t NB, int64_t R, int64_t grain, F&& f) {
  at::parallel_for(0, NB / TILE, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0 * TILE; nb < b1 * TILE; nb += TILE)
      by_rows(R, [&](int64_t r0, auto m) { f(nb, r0, m); });
  });
}

// [..., K] in any float dtype -> (rows [R, K] fp32 contiguous, output shape [..., n])
static torch::Tensor rows_of(const torch::Tensor& x) {
  return x.reshape({-1, x.size(-1)}).to(torch::kFloat32).contiguous();
}
static torch::Tensor shaped(const torch::Tensor& y, const torch::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return (y.size(1) == n ? y : y.narrow(1, 0, n)).to(x.scalar_type()).reshape(sizes);
}

torch::Tensor q4_mm(torch::Tensor x_in, torch::Tensor w, torch::Tensor d, torch::Tensor mn) {
  // x [R, K] fp32; w [N/16, K/2, 16] uint8; d, mn [N/16, K/32, 16] fp16 -> [R, N] fp32
  const torch::Tensor x = rows_of(x_in);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8);
  const int64_t R = x.size(0), K = x.size(1), NB = w.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K / 2 && d.size(1) == G && NB % TILE == 0);
  auto y = torch::empty({R, NB * 16}, x.options());
  auto xs = torch::empty({R, G}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int i = 0; i < 32; ++i) s += xp[r * K + g * 32 + i];
      xsp[r * G + g] = s;
    }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  TORCH_CHECK(d.scalar_type() == torch::kHalf && mn.scalar_type() == torch::kHalf, "int4 scales: fp16");
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t ldy = NB * 16;
  over_tiles(NB, R, 1, [&](int64_t nb, int64_t r0, auto m) {
    q4_tile<decltype(m)::value, TILE>(wp + nb * (K / 2) * 16, dp + nb * G * 16, mp + nb * G * 16, xp + r0 * K,
                                      xsp + r0 * G, yp + r0 * ldy + nb * 16, K, ldy);
  });
  return y;
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor mn, int64_t n) {
  // x [..., K] (fp32 or bf16) -> [..., n] in x's dtype (products in fp32)
  return shaped(q4_mm(x, w, d, mn), x, n);
}

torch::Tensor q8_mm(torch::Tensor x_in, torch::Tensor w, torch::Tensor s) {
  // x [R, K] fp32; w [N/16, K, 16] int8; s [N/16, 16] fp32 -> [R, N] fp32
  const torch::Tensor x = rows_of(x_in);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kInt8);
  const int64_t R = x.size(0), K = x.size(1), NB = w.size(0);
  TORCH_CHECK(w.size(1) == K && NB % TILE == 0);
  auto y = torch::empty({R, NB * 16}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = NB * 16;
  over_tiles(NB, R, 4, [&](int64_t nb, int64_t r0, auto m) {
    q8_tile<decltype(m)::value, TILE>(wp + nb * K * 16, sp + nb * 16, xp + r0 * K, yp + r0 * ldy + nb * 16, K, ldy);
  });
  return y;
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor s, int64_t n) {
  return shaped(q8_mm(x, w, s), x, n);
}

// ---------------------------------------------------------------------------- w4a8
// int4 weights (groups of 32, w = q * d + m) times int8 activations (per row and group of 32:
// x ~ xq * dx, xq = round(x / dx) in [-127, 127], dx = max|x| / 127; sx = dx * sum(xq)), as
// llama.cpp multiplies Q4_1 by Q8_1: y[n] = sum_g (d dx) * sum_i q xq + m sx. The integer dot
// products are exact; per row the float operations are the same whatever the number of rows.
// Weights: [N/16, G, 4 chunks of 64 bytes]; in chunk j, lane l's 4 bytes b hold
// q[4j + b] | q[16 + 4j + b] << 4 of output l (the group's inputs 4j..4j+3 and 16+4j..16+4j+3).

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512i ivec;
static inline ivec iv_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline ivec iv_lo(ivec b) { return _mm512_and_si512(b, _mm512_set1_epi8(15)); }
static inline ivec iv_hi(ivec b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(15)); }
static inline ivec iv_zero() { return _mm512_setzero_si512(); }
static inline ivec iv_bcast(int32_t v) { return _mm512_set1_epi32(v); }
#if defined(__AVX512VNNI__)
static inline ivec iv_dot(ivec acc, ivec w, ivec x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
static inline ivec iv_dot(ivec acc, ivec w, ivec x) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
#endif
static inline vf iv_float(ivec a) { const __m512 f = _mm512_cvtepi32_ps(a); vf v; std::memcpy(&v, &f, 64); return v; }
#define SPECLOOP_W4A8 1
#elif defined(__AVX2__)
struct ivec { __m256i a, b; };
static inline ivec iv_load(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
static inline ivec iv_lo(ivec v) { const __m256i m = _mm256_set1_epi8(15); return {_mm256_and_si256(v.a, m), _mm256_and_si256(v.b, m)}; }
static inline ivec iv_hi(ivec v) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(_mm256_srli_epi16(v.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.b, 4), m)};
}
static inline ivec iv_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline ivec iv_bcast(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
static inline __m256i dot8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
static inline ivec iv_dot(ivec acc, ivec w, ivec x) { return {dot8(acc.a, w.a, x.a), dot8(acc.b, w.b, x.b)}; }
static inline vf iv_float(ivec v) {
  const __m256 a = _mm256_cvtepi32_ps(v.a), b = _mm256_cvtepi32_ps(v.b);
  vf o; std::memcpy(&o, &a, 32); std::memcpy(reinterpret_cast<char*>(&o) + 32, &b, 32); return o;
}
#define SPECLOOP_W4A8 1
#endif

#if defined(SPECLOOP_W4A8)
template <int M, int TB>
static void w4a8_tile(const uint8_t* w, const uint16_t* d, const uint16_t* mn, const int8_t* xq, const float* dx,
                      const float* sx, float* y, int64_t G, int64_t ldy) {
  vf out[M][TB];
  _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) out[r][t] = vf{};
  for (int64_t g = 0; g < G; ++g) {
    ivec wq[TB][8];
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
        const ivec b = iv_load(w + (t * G + g) * 256 + 64 * j);
        wq[t][j] = iv_lo(b);
        wq[t][j + 4] = iv_hi(b);
      }
    _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r) {
      int32_t quads[8];
      std::memcpy(quads, xq + (r * G + g) * 32, 32);
      ivec acc[TB];
      _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) acc[t] = iv_zero();
      _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
        const ivec xb = iv_bcast(quads[j]);
        _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) acc[t] = iv_dot(acc[t], wq[t][j], xb);
      }
      const float dxr = dx[r * G + g], sxr = sx[r * G + g];
      _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) {
        const vf dg = load_h16(d + (t * G + g) * 16) * dxr, mg = load_h16(mn + (t * G + g) * 16);
        out[r][t] = out[r][t] + dg * iv_float(acc[t]);
        out[r][t] = out[r][t] + mg * sxr;
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) std::memcpy(y + r * ldy + t * 16, &out[r][t], 64);
}
#else
// CPUs without AVX2: the same arithmetic, lane by lane (`portable_tile`).
template <typename W>  // weight(l, k): output l's integer weight at the group's input k
static inline vf lane_dots(const int8_t* xr, W&& weight) {
  vf acc;
  for (int l = 0; l < 16; ++l) {
    int32_t s = 0;  // exact in any order
    for (int k = 0; k < 32; ++k) s += weight(l, k) * xr[k];
    acc[l] = (float)s;
  }
  return acc;
}

// out[r][t] = step(out, group g's lane dot products, r, t, g) over the groups in order, then stored.
template <int M, int TB, typename Dot, typename Step>
static void portable_tile(int64_t G, float* y, int64_t ldy, Dot&& dot, Step&& step) {
  for (int r = 0; r < M; ++r)
    for (int t = 0; t < TB; ++t) {
      vf out = vf{};
      for (int64_t g = 0; g < G; ++g) out = step(out, dot(r, t, g), r, t, g);
      std::memcpy(y + r * ldy + t * 16, &out, 64);
    }
}

template <int M, int TB>
static void w4a8_tile(const uint8_t* w, const uint16_t* d, const uint16_t* mn, const int8_t* xq, const float* dx,
                      const float* sx, float* y, int64_t G, int64_t ldy) {
  portable_tile<M, TB>(G, y, ldy,
    [&](int r, int t, int64_t g) {
      const uint8_t* p = w + (t * G + g) * 256;
      return lane_dots(xq + (r * G + g) * 32, [&](int l, int k) {
        const uint8_t v = p[64 * ((k % 16) / 4) + 4 * l + k % 4];
        return k < 16 ? v & 15 : v >> 4;
      });
    },
    [&](vf out, vf acc, int r, int t, int64_t g) {
      const vf dg = load_h16(d + (t * G + g) * 16) * dx[r * G + g], mg = load_h16(mn + (t * G + g) * 16);
      out = out + dg * acc;
      return out + mg * sx[r * G + g];
    });
}
#endif

// Rows [R, K] fp32 -> int8 per group of 32 (round half to even), with dx and sx per (row, group).
static void quantize_rows_q8(const float* x, int64_t R, int64_t K, int8_t* xq, float* dx, float* sx,
                             int32_t* isum = nullptr) {
  const int64_t G = K / 32;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* v = x + r * K + g * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float dd = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int32_t q = (int32_t)std::nearbyint(v[i] * id);
        xq[r * K + g * 32 + i] = (int8_t)q;
        sum += q;
      }
      dx[r * G + g] = dd;
      sx[r * G + g] = dd * (float)sum;
      if (isum) isum[r * G + g] = sum;
    }
}

torch::Tensor w4a8_mm(torch::Tensor x_in, torch::Tensor w, torch::Tensor d, torch::Tensor mn) {
  // x [R, K]; w [N/16, K/32 * 256] uint8; d, mn [N/16, K/32, 16] fp16 -> [R, N] fp32
  const torch::Tensor x = rows_of(x_in);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8);
  const int64_t R = x.size(0), K = x.size(1), NB = w.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && w.size(1) == G * 256 && d.size(1) == G && NB % TILE == 0);
  auto xq = torch::empty({R, K}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({R, G}, x.options()), sx = torch::empty({R, G}, x.options());
  quantize_rows_q8(x.data_ptr<float>(), R, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  auto y = torch::empty({R, NB * 16}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  TORCH_CHECK(d.scalar_type() == torch::kHalf && mn.scalar_type() == torch::kHalf, "int4 scales: fp16");
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>());
  const float *dxp = dx.data_ptr<float>(), *sxp = sx.data_ptr<float>();
  const int8_t* qp = xq.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = NB * 16;
  over_tiles(NB, R, 1, [&](int64_t nb, int64_t r0, auto m) {
    w4a8_tile<decltype(m)::value, TILE>(wp + nb * G * 256, dp + nb * G * 16, mp + nb * G * 16, qp + r0 * K,
                                        dxp + r0 * G, sxp + r0 * G, yp + r0 * ldy + nb * 16, G, ldy);
  });
  return y;
}

torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor mn, int64_t n) {
  return shaped(w4a8_mm(x, w, d, mn), x, n);
}

// ---------------------------------------------------------------------------- w8a8
// int8 weights in blocks of 32 with an fp16 scale each (GGUF Q8_0: w = q * d) times int8 activations
// as in w4a8: y[n] = sum_g (d dx) * sum_i q xq (llama.cpp's Q8_0 x Q8_0). Weights: [N/16, G, 8 chunks
// of 64 bytes]; in chunk j, lane l's 4 bytes b hold q[4j + b] of output l (q in [-127, 127]).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static constexpr int32_t W8_OFFSET = 128;  // dpbusd multiplies unsigned by signed: (q + 128) * xq
static inline ivec iv_dot_s8(ivec acc, ivec w, ivec x) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), x);
}
#elif defined(__AVX512F__) && defined(__AVX512BW__)
static constexpr int32_t W8_OFFSET = 0;  // |x| times q with x's sign: no saturation for q, x in [-127, 127]
static inline ivec iv_dot_s8(ivec acc, ivec w, ivec x) {
  const __m512i sw = _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(x), _mm512_setzero_si512(), w);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(x), sw), _mm512_set1_epi16(1)));
}
#elif defined(__AVX2__)
static constexpr int32_t W8_OFFSET = 0;
static inline __m256i dot8_s8(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x)),
                                                 _mm256_set1_epi16(1)));
}
static inline ivec iv_dot_s8(ivec acc, ivec w, ivec x) { return {dot8_s8(acc.a, w.a, x.a), dot8_s8(acc.b, w.b, x.b)}; }
#endif

#if defined(SPECLOOP_W4A8)
template <int M, int TB>
static void w8a8_tile(const int8_t* w, const uint16_t* d, const int8_t* xq, const float* dx, const int32_t* isum,
                      float* y, int64_t G, int64_t ldy) {
  vf out[M][TB];
  _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) out[r][t] = vf{};
  for (int64_t g = 0; g < G; ++g) {
    _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r) {
      int32_t quads[8];
      std::memcpy(quads, xq + (r * G + g) * 32, 32);
      ivec acc[TB];
      _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) acc[t] = iv_zero();
      _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
        const ivec xb = iv_bcast(quads[j]);
        _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t)
          acc[t] = iv_dot_s8(acc[t], iv_load(reinterpret_cast<const uint8_t*>(w) + (t * G + g) * 512 + 64 * j), xb);
      }
      const float dxr = dx[r * G + g];
      const vf corr = vf{} + (float)(W8_OFFSET * isum[r * G + g]);  // exact: |value| < 2^24
      _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) {
        const vf dg = load_h16(d + (t * G + g) * 16) * dxr;
        out[r][t] = out[r][t] + dg * (iv_float(acc[t]) - corr);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) std::memcpy(y + r * ldy + t * 16, &out[r][t], 64);
}
#else
template <int M, int TB>
static void w8a8_tile(const int8_t* w, const uint16_t* d, const int8_t* xq, const float* dx, const int32_t* isum,
                      float* y, int64_t G, int64_t ldy) {
  portable_tile<M, TB>(G, y, ldy,
    [&](int r, int t, int64_t g) {
      const int8_t* p = w + (t * G + g) * 512;
      return lane_dots(xq + (r * G + g) * 32, [&](int l, int k) { return (int32_t)p[64 * (k / 4) + 4 * l + k % 4]; });
    },
    [&](vf out, vf acc, int r, int t, int64_t g) {
      return out + (load_h16(d + (t * G + g) * 16) * dx[r * G + g]) * acc;
    });
}
#endif

torch::Tensor w8a8_mm(torch::Tensor x_in, torch::Tensor w, torch::Tensor d) {
  // x [R, K]; w [N/16, K/32 * 512] int8; d [N/16, K/32, 16] fp16 -> [R, N] fp32
  const torch::Tensor x = rows_of(x_in);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kInt8 && d.scalar_type() == torch::kHalf);
  const int64_t R = x.size(0), K = x.size(1), NB = w.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && w.size(1) == G * 512 && d.size(1) == G && NB % TILE == 0);
  auto xq = torch::empty({R, K}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({R, G}, x.options()), sx = torch::empty({R, G}, x.options());
  auto isum = torch::empty({R, G}, x.options().dtype(torch::kInt32));
  quantize_rows_q8(x.data_ptr<float>(), R, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>(),
                   isum.data_ptr<int32_t>());
  auto y = torch::empty({R, NB * 16}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const float* dxp = dx.data_ptr<float>();
  const int32_t* ip = isum.data_ptr<int32_t>();
  const int8_t* qp = xq.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = NB * 16;
  over_tiles(NB, R, 4, [&](int64_t nb, int64_t r0, auto m) {
    w8a8_tile<decltype(m)::value, TILE>(wp + nb * G * 512, dp + nb * G * 16, qp + r0 * K, dxp + r0 * G, ip + r0 * G,
                                        yp + r0 * ldy + nb * 16, G, ldy);
  });
  return y;
}

torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, int64_t n) {
  return shaped(w8a8_mm(x, w, d), x, n);
}

// ---------------------------------------------------------------------------- attention
typedef int32_t vi __attribute__((vector_size(64)));

static inline vf splat(float a) { return vf{} + a; }

// Sum of 16 lanes in a fixed pairwise tree.
static inline float hsum(vf v) {
  float a[16];
  std::memcpy(a, &v, 64);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

// v[0..15] -> lane j = the sum of v[j]'s 16 lanes, all in one fixed tree of shuffles and adds
// (halves, quarters, pairs, lanes).
static inline vf fold(vf a, vf b, vi lo, vi hi) { return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi); }
static inline vf sum16(const vf* v) {
  const vi h_lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi h_hi = h_lo + 8;
  const vi q_lo = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi q_hi = q_lo + 4;
  const vi p_lo = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi p_hi = p_lo + 2;
  const vi e_lo = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi e_hi = e_lo + 1;
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold(v[2 * i], v[2 * i + 1], h_lo, h_hi);
  for (int i = 0; i < 4; ++i) b[i] = fold(a[2 * i], a[2 * i + 1], q_lo, q_hi);
  for (int i = 0; i < 2; ++i) c[i] = fold(b[2 * i], b[2 * i + 1], p_lo, p_hi);
  return fold(c[0], c[1], e_lo, e_hi);
}

// exp(x) for x <= 0 on 16 lanes (range reduction by ln 2, degree-6 polynomial: a few ulp);
// lanes below -87 (and -inf) give exactly 0.
static inline vf exp_neg(vf x) {
  const vf lo = splat(-87.0f);
  const vi under = x < lo;
  x = under ? lo : x;
  const vf fx = x * 1.44269504088896341f + 0.5f;
  vf nf = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
  nf = (nf > fx) ? nf - 1.0f : nf;  // floor
  vf r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const vi bits = (__builtin_convertvector(nf, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, 64);
  return under ? vf{} : p * scale;
}

// Rotate-half RoPE of one head (D floats) at one position into dst.
static inline void rope_head(const float* x, const float* c, const float* s, float* dst, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) dst[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = half; i < D; ++i) dst[i] = x[i] * c[i] + x[i - half] * s[i];
}

// Query heads that share one KV head (a row's head group, over one or more new tokens), query i over keys
// [0, Ls[i]): scores, softmax, values. Each query's result depends on (the query, its Ls[i] keys and values)
// alone, never on which other queries share the call, T, the batch or the thread: every query goes
// through the same operations in the same order as it would alone; the group only shares the loads
// (a chunk of keys is scored for every query while it is in L1, a value row feeds every query's
// accumulators, which also keeps the FMA units busy: one query alone is a chain of dependent adds).
template <int C16>  // D / 16, a compile-time constant
static void attend_group(const float* const* qs, float* const* outs, const int64_t* Ls, int n,
                         const float* K, const float* V, int64_t D, float scale, std::vector<float>& s) {
  constexpr int TQ = C16 >= 16 ? 1 : 24 / C16;  // queries whose accumulators stay in registers together
  int64_t Lmax = 0;
  for (int i = 0; i < n; ++i) Lmax = std::max(Lmax, Ls[i]);
  const int64_t Lp = (Lmax + 15) / 16 * 16;
  s.resize(n * Lp);
  for (int64_t j0 = 0; j0 < Lp; j0 += 16) {  // scores, 16 keys at a time: lanes, then keys, summed
    const float* kr[16];                      // in one fixed tree (`sum16`: lane jj is key jj's alone)
    for (int64_t jj = 0; jj < 16; ++jj) kr[jj] = K + std::min(j0 + jj, Lmax - 1) * D;  // tail: dropped
    for (int i = 0; i < n; ++i) {
      if (j0 >= Ls[i]) continue;
      vf qv[C16];
      for (int64_t c = 0; c < C16; ++c) qv[c] = load_vf(qs[i] + 16 * c);
      vf part[16];
      for (int64_t jj = 0; jj < 16; ++jj) {
        vf a = qv[0] * load_vf(kr[jj]);
        for (int64_t c = 1; c < C16; ++c) a = a + qv[c] * load_vf(kr[jj] + 16 * c);
        part[jj] = a;
      }
      const vf sc = sum16(part) * scale;
      std::memcpy(s.data() + i * Lp + j0, &sc, 64);
    }
  }
  float inv[64];
  for (int i = 0; i < n; ++i) {  // softmax numerators, each query over its own keys
    float* si = s.data() + i * Lp;
    const int64_t L = Ls[i], Li = (L + 15) / 16 * 16;
    float m = -INFINITY;
    for (int64_t j = 0; j < L; ++j) m = std::max(m, si[j]);  // a max is exact in any order
    for (int64_t j = L; j < Li; ++j) si[j] = -INFINITY;      // exp gives exactly 0 there
    vf total = vf{};
    for (int64_t j = 0; j < Li; j += 16) {
      const vf p = exp_neg(load_vf(si + j) - m);
      std::memcpy(si + j, &p, 64);
      total = total + p;
    }
    inv[i] = 1.0f / hsum(total);
  }
  for (int i0 = 0; i0 < n; i0 += TQ) {  // values: one chain per lane and query over the keys in order
    const int m = std::min(TQ, n - i0);
    int64_t lo = Lmax;
    for (int i = 0; i < m; ++i) lo = std::min(lo, Ls[i0 + i]);
    vf o[TQ][C16];
    for (int i = 0; i < m; ++i)
      for (int64_t c = 0; c < C16; ++c) o[i][c] = vf{};
    for (int64_t j = 0; j < lo; ++j) {  // keys every query of the tile sees
      const float* v = V + j * D;
      vf vv[C16];
      for (int64_t c = 0; c < C16; ++c) vv[c] = load_vf(v + 16 * c);
      for (int i = 0; i < m; ++i) {
        const float pj = s[(i0 + i) * Lp + j];
        for (int64_t c = 0; c < C16; ++c) o[i][c] = o[i][c] + pj * vv[c];
      }
    }
    for (int i = 0; i < m; ++i) {  // each query's own last keys (the causal tail), then its output
      for (int64_t j = lo; j < Ls[i0 + i]; ++j) {
        const float pj = s[(i0 + i) * Lp + j];
        const float* v = V + j * D;
        for (int64_t c = 0; c < C16; ++c) o[i][c] = o[i][c] + pj * load_vf(v + 16 * c);
      }
      for (int64_t c = 0; c < C16; ++c) {
        const vf y = o[i][c] * inv[i0 + i];
        std::memcpy(outs[i0 + i] + 16 * c, &y, 64);
      }
    }
  }
}

// ---------------------------------------------------------------------------- element-wise

// RMSNorm of every row of x [..., n] (any float dtype; n % 16 == 0) times w [n] -> fp32 [..., n]:
// the squares summed in one vector chain in order, lanes in a fixed tree; y = w * (x * r).
torch::Tensor rms_norm(torch::Tensor x_in, torch::Tensor w_in, double eps) {
  const torch::Tensor x = rows_of(x_in), w = w_in.to(torch::kFloat32).contiguous();
  const int64_t R = x.size(0), n = x.size(1);
  TORCH_CHECK(n % 16 == 0 && w.numel() == n, "rms_norm: width");
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t a, int64_t e) {
    for (int64_t r = a; r < e; ++r) {
      const float* xr = xp + r * n;
      vf acc = vf{};
      for (int64_t i = 0; i < n; i += 16) { const vf v = load_vf(xr + i); acc = acc + v * v; }
      const float inv = 1.0f / std::sqrt(hsum(acc) / (float)n + (float)eps);
      for (int64_t i = 0; i < n; i += 16) {
        const vf o = load_vf(wp + i) * (load_vf(xr + i) * inv);
        std::memcpy(yp + r * n + i, &o, 64);
      }
    }
  });
  return y.reshape(x_in.sizes()).to(x_in.scalar_type());
}

// SwiGLU's middle: gate_up [..., 2 I] (gate then up) -> silu(gate) * up [..., I] (I % 16 == 0).
torch::Tensor silu_mul(torch::Tensor x_in) {
  const torch::Tensor x = rows_of(x_in);
  const int64_t R = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(I % 16 == 0 && x.size(1) == 2 * I, "silu_mul: width");
  auto y = torch::empty({R, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 4, [&](int64_t a, int64_t e) {
    for (int64_t r = a; r < e; ++r)
      for (int64_t i = 0; i < I; i += 16) {
        const vf g = load_vf(xp + r * 2 * I + i), u = load_vf(xp + r * 2 * I + I + i);
        const vf neg = g < 0.0f ? g : -g;  // -|g|
        const vf e = exp_neg(neg);         // exp(-|g|)
        const vf s = (g < 0.0f ? e : vf{} + 1.0f) / (e + 1.0f);  // sigmoid(g)
        const vf o = g * s * u;
        std::memcpy(yp + r * I + i, &o, 64);
      }
  });
  auto sizes = x_in.sizes().vec();
  sizes.back() = I;
  return y.reshape(sizes).to(x_in.scalar_type());
}

// Causal attention of T new tokens per row over a KV cache, exact per query by construction.
// qkv [B, T, (H + 2 Hkv) D] (any float dtype): RoPE (rotate half, tables cos/sin [P, D] fp32) on q
// and k at positions lens[b] + t; k and v written into kc / vc [B, Hkv, C, D] fp32 there; every query
// attends keys 0 .. its own position. Returns [B, T, H D] fp32.
torch::Tensor attend(torch::Tensor qkv_in, torch::Tensor kc, torch::Tensor vc, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor lens_in, int64_t H, double scale_d) {
  const torch::Tensor qkv = qkv_in.to(torch::kFloat32).contiguous();
  const torch::Tensor lens = lens_in.to(torch::kInt64).contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), Hkv = kc.size(1), C = kc.size(2), D = kc.size(3);
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == torch::kFloat32 &&
              vc.scalar_type() == torch::kFloat32 && vc.sizes() == kc.sizes(), "KV cache: contiguous fp32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
              cos.size(1) == D, "RoPE tables: contiguous fp32 [P, D]");
  TORCH_CHECK((D == 32 || D == 64 || D == 128 || D == 256) && H % Hkv == 0 && qkv.size(2) == (H + 2 * Hkv) * D && lens.size(0) == B,
              "attend: shapes");
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 0 && lp[b] + T <= std::min(C, cos.size(0)), "KV cache full");
  const int64_t rep = H / Hkv, W = qkv.size(2);
  auto q = torch::empty({B, T, H, D}, qkv.options());
  auto out = torch::empty({B, T, H * D}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B * T, 8, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) {
      const int64_t b = i / T, pos = lp[b] + i % T;
      const float* x = xp + i * W;
      for (int64_t h = 0; h < H; ++h) rope_head(x + h * D, cp + pos * D, sp + pos * D, qp + (i * H + h) * D, D);
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t at_ = ((b * Hkv + g) * C + pos) * D;
        rope_head(x + (H + g) * D, cp + pos * D, sp + pos * D, kp + at_, D);
        std::memcpy(vp + at_, x + (H + Hkv + g) * D, D * sizeof(float));
      }
    }
  });
  const float scale = (float)scale_d;
  // Units of work: (row, KV head, a tile of its rep · T queries, token-major), each thread getting about
  // four units where the call has that many queries, at most 48 queries a unit (a query's result does
  // not depend on its tile).
  const int64_t nq = rep * T, threads = at::get_num_threads();
  const int64_t per = std::max<int64_t>(1, std::min<int64_t>(48, (B * H * T + 4 * threads - 1) / (4 * threads)));
  const int64_t tiles = (nq + per - 1) / per;
  at::parallel_for(0, B * Hkv * tiles, 1, [&](int64_t a, int64_t e) {
    std::vector<float> s;
    const float* qs[48];
    float* outs[48];
    int64_t Ls[48];
    for (int64_t u = a; u < e; ++u) {
      const int64_t tile = u % tiles, bg = u / tiles, b = bg / Hkv, g = bg % Hkv, base = (b * Hkv + g) * C * D;
      const int n = (int)std::min(per, nq - tile * per);
      for (int i = 0; i < n; ++i) {
        const int64_t qi = tile * per + i, t = qi / rep, h = g * rep + qi % rep, row = (b * T + t) * H + h;
        qs[i] = qp + row * D;
        outs[i] = op + row * D;
        Ls[i] = lp[b] + t + 1;
      }
      switch (D) {
        case 32: attend_group<2>(qs, outs, Ls, n, kp + base, vp + base, D, scale, s); break;
        case 64: attend_group<4>(qs, outs, Ls, n, kp + base, vp + base, D, scale, s); break;
        case 128: attend_group<8>(qs, outs, Ls, n, kp + base, vp + base, D, scale, s); break;
        default: attend_group<16>(qs, outs, Ls, n, kp + base, vp + base, D, scale, s); break;
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------- a whole layer

// One linear of a layer: kind 0 int4 (q4), 1 int8 (q8), 2 w4a8; a, b, c its packed tensors (c unused
// by int8); n its output width.
static torch::Tensor linear_of(const torch::Tensor& x, int64_t kind, const torch::Tensor& a, const torch::Tensor& b,
                               const torch::Tensor& c, int64_t n) {
  switch (kind) {
    case 0: return q4_linear(x, a, b, c, n);
    case 1: return q8_linear(x, a, b, n);
    default: return w4a8_linear(x, a, b, c, n);
  }
}

// A SwiGLU decoder layer in one call, by the same functions the step otherwise calls one by one
// (so the same bits): RMSNorm, q|k|v, attend (RoPE, KV write, attention), o + residual, RMSNorm,
// gate|up, SwiGLU, down + residual. x [B, T, hidden] fp32. kinds/dims: 4 linears (qkv, o, gate_up,
// down); parts: 3 tensors per linear.
torch::Tensor layer(torch::Tensor x, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                    std::vector<int64_t> kinds, std::vector<int64_t> dims, std::vector<torch::Tensor> parts,
                    torch::Tensor kc, torch::Tensor vc, torch::Tensor cos, torch::Tensor sin, torch::Tensor lens,
                    int64_t H, double scale) {
  TORCH_CHECK(kinds.size() == 4 && dims.size() == 4 && parts.size() == 12, "layer: 4 linears");
  auto lin = [&](const torch::Tensor& v, int i) {
    return linear_of(v, kinds[i], parts[3 * i], parts[3 * i + 1], parts[3 * i + 2], dims[i]);
  };
  const torch::Tensor qkv = lin(rms_norm(x, in_norm, eps), 0);
  const torch::Tensor h = x + lin(attend(qkv, kc, vc, cos, sin, lens, H, scale), 1);
  return h + lin(silu_mul(lin(rms_norm(h, post_norm, eps), 2)), 3);
}
"""


def _cpu_digest() -> str:
    """A digest of what the build depends on: the CPU's flags, the machine, the source, torch."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    text = "|".join((flags, platform.machine(), torch.__version__, _SOURCE))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@functools.cache
def _module():
    """The compiled extension, or None (no compiler, a failed build, or SPECLOOP_KERNELS=stock)."""
    if os.environ.get("SPECLOOP_KERNELS", "auto") == "stock":
        return None
    name = f"specloop_kernels_{_cpu_digest()}"
    try:
        from torch.utils.cpp_extension import load_inline

        _announce_first_build(name)
        mod = load_inline(name=name, cpp_sources=[_SOURCE], functions=["q4_mm", "q8_mm", "q4_linear", "q8_linear", "attend", "rms_norm", "silu_mul", "w4a8_mm", "w4a8_linear", "w8a8_mm", "w8a8_linear", "layer"],
                          extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"],
                          extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the stock kernels
        log.warning("specloop kernels not built (%s: %s); using torch's stock int4/int8 kernels and the eager "
                    "decode step (no w4a8)", type(e).__name__, e)
        return None
    if not _self_check(mod):
        log.warning("specloop kernels failed their self-check on this CPU (wrong values, or a row rounded "
                    "differently beside other rows); using torch's stock int4/int8 kernels and the eager decode "
                    "step (no w4a8)")
        return None
    return mod


def _announce_first_build(name: str) -> None:
    """Say so on stderr when this CPU's build is not cached yet (a ~30 s pause otherwise unexplained)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        built = any(Path(_get_build_directory(name, verbose=False)).glob("*.so"))
    except Exception:  # noqa: BLE001 - only a message depends on it
        built = True
    if not built:
        print("specloop: building its CPU kernels for this CPU (once, ~40 s)...", file=sys.stderr, flush=True)


def available() -> bool:
    return _module() is not None


def _self_check(mod) -> bool:
    """The build computes what it should (against a float64 product of the same weights) and every row
    count 1..9 gives each row exactly what it gets alone (the property verification needs)."""
    g = torch.Generator().manual_seed(0)
    N, K = 2 * TILE * LANES, 96
    q4 = torch.randint(0, 16, (N, K), generator=g)
    d, m = torch.rand(N, K // GROUP, generator=g).half().float(), torch.randn(N, K // GROUP, generator=g).half().float()
    q8, s = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8), torch.rand(N, generator=g)
    w4 = q4.double() * d.double().repeat_interleave(GROUP, 1) + m.double().repeat_interleave(GROUP, 1)
    w8 = q8.double() * s.double()[:, None]
    packed4, packed8 = pack_q4(q4, d, m), pack_q8(q8, s)
    x = torch.randn(9, K, generator=g)
    packed48 = pack_w4a8(q4, d, m)
    b8 = torch.rand(N, K // GROUP, generator=g).half().float()  # Q8_0-style blocks: w = q · d per 32
    packed88 = pack_w8a8(q8, b8)
    w88 = q8.double() * b8.double().repeat_interleave(GROUP, 1)
    xq, dx, _ = quantized_rows(x)
    x48 = (xq.double().view(9, -1, GROUP) * dx.double()[..., None]).view(9, K)  # the activations w4a8 multiplies
    for call, w, xs in ((lambda rows: mod.q4_mm(rows, *packed4), w4, x), (lambda rows: mod.q8_mm(rows, *packed8), w8, x),
                        (lambda rows: mod.w4a8_mm(rows, *packed48), w4, x48),
                        (lambda rows: mod.w8a8_mm(rows, *packed88), w88, x48)):
        alone = torch.cat([call(x[i : i + 1].contiguous()) for i in range(9)])
        exact = xs.double() @ w.t()
        if not torch.allclose(alone.double(), exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max())):
            return False
        if not all(torch.equal(call(x[:R].contiguous()), alone[:R]) for R in range(2, 10)):
            return False
    return _attention_checks(mod, g)


def _attention_checks(mod, g: torch.Generator) -> bool:
    """`attend` against a float64 softmax attention, and a 7-token pass equal bit for bit to seven
    one-token steps (rows of different lengths in one batch)."""
    B, H, Hkv, D, C = 2, 4, 2, 32, 64
    cos, sin = torch.rand(C, D, generator=g), torch.rand(C, D, generator=g)
    x = torch.randn(B, 7, (H + 2 * Hkv) * D, generator=g)
    lens = torch.tensor([0, 9])

    def run(chunks):
        kc, vc = torch.zeros(B, Hkv, C, D), torch.zeros(B, Hkv, C, D)
        outs, at = [], lens.clone()
        for part in chunks:
            outs.append(mod.attend(part, kc, vc, cos, sin, at, H, 0.3))
            at = at + part.shape[1]
        return torch.cat(outs, 1)

    whole = run([x])
    if not torch.equal(whole, run([x[:, t : t + 1] for t in range(7)])):
        return False
    half = D // 2
    rope = lambda t, p: t * cos[p, None] + torch.cat([-t[..., half:], t[..., :half]], -1) * sin[p, None]  # noqa: E731
    for b in range(B):
        n, p = int(lens[b]), torch.arange(int(lens[b]), int(lens[b]) + 7)
        qkv = x[b].double().view(7, H + 2 * Hkv, D)
        q, k = rope(qkv[:, :H], p), rope(qkv[:, H : H + Hkv], p).repeat_interleave(H // Hkv, 1)
        v = qkv[:, H + Hkv :].repeat_interleave(H // Hkv, 1)
        k = torch.cat([k.new_zeros(n, H, D), k]).transpose(0, 1)  # [H, n + 7, D] (zero keys before: lens)
        v = torch.cat([v.new_zeros(n, H, D), v]).transpose(0, 1)
        scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * 0.3  # [H, 7, n + 7]
        scores = scores.masked_fill(torch.ones(7, n + 7, dtype=torch.bool).triu(n + 1), float("-inf"))
        ref = (scores.softmax(-1) @ v).transpose(0, 1).reshape(7, H * D)
        if not torch.allclose(whole[b].double(), ref, rtol=1e-4, atol=1e-5):
            return False
    return True


# ----------------------------------------------------------------------------- layouts


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `w4a8_mm` multiplies, computed as it does: x [R, K] fp32 → (xq [R, K] int8, dx [R, K/32],
    sx [R, K/32]) with dx = max|x| / 127 per group of 32, xq = round-half-even(x · (127 / max|x|)),
    sx = dx · Σ xq. For tests and the load-time self-check."""
    groups = x.float().view(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inv[..., None]).to(torch.int8)
    dx = amax / 127.0
    return xq.view_as(x), dx, dx * xq.sum(-1, dtype=torch.int32).float()


def _padded(*per_output: torch.Tensor) -> list[torch.Tensor]:
    """Tensors of N rows each (one per output) with zero rows appended up to a multiple of one tile."""
    pad = -per_output[0].shape[0] % (LANES * TILE)
    return [torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t for t in per_output]


def _half(t: torch.Tensor) -> torch.Tensor:
    """Group scales / minimums as the kernels store them: fp16 (a GGUF's own are fp16: exact)."""
    h = t.to(torch.float16)
    if not torch.isfinite(h).all():
        raise ValueError("int4 group scales / minimums beyond fp16's range")
    return h


def pack_q4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] integers in [0, 15], scale / minimum [N, K/32] → (nibbles [N'/16, K/2, 16] uint8,
    d, m [N'/16, K/32, 16] fp16), N' = N rounded up to 64 (zero outputs)."""
    K = q.shape[1]
    q, scale, minimum = _padded(q.to(torch.uint8), _half(scale), _half(minimum))
    pairs = q.view(-1, LANES, K // 2, 2)
    nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(1, 2).contiguous()
    lanes = lambda t: t.view(-1, LANES, t.shape[1]).transpose(1, 2).contiguous()  # noqa: E731
    return nibbles, lanes(scale), lanes(minimum)


def pack_w4a8(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] integers in [0, 15], scale / minimum [N, K/32] → (bytes [N'/16, K/32 · 256] uint8, d, m
    [N'/16, K/32, 16] fp16), N' = N rounded up to 64: per group, chunk j (of 4) holds for each of 16
    outputs its inputs 4j..4j+3 (low nibbles) and 16+4j..16+4j+3 (high nibbles)."""
    K = q.shape[1]
    q, scale, minimum = _padded(q.to(torch.uint8), _half(scale), _half(minimum))
    G = K // GROUP
    quads = q.view(-1, LANES, G, 2, 4, 4)  # block, lane, group, half, chunk j, byte b
    packed = (quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(-1, G * 256)
    lanes = lambda t: t.view(-1, LANES, G).transpose(1, 2).contiguous()  # noqa: E731
    return packed.contiguous(), lanes(scale), lanes(minimum)


def pack_w8a8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8 in [-127, 127], scale [N, K/32] (GGUF Q8_0: w = q · d) → (bytes [N'/16, K/32 · 512]
    int8, d [N'/16, K/32, 16] fp16), N' = N rounded up to 64: per group, chunk j (of 8) holds for each
    of 16 outputs its inputs 4j..4j+3."""
    K = q.shape[1]
    if int(q.min()) < -127:
        raise ValueError("int8 blocks need q in [-127, 127]")
    q, scale = _padded(q.to(torch.int8), _half(scale))
    G = K // GROUP
    packed = q.view(-1, LANES, G, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, G * 512)
    return packed.contiguous(), scale.view(-1, LANES, G).transpose(1, 2).contiguous()


def w8a8_rows(packed: torch.Tensor, d: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of the weight `pack_w8a8` packed, as q · d in fp32 → [*ids.shape, K]:
    an embedding lookup from the blocks, without a float copy of the table."""
    G = d.shape[1]
    flat = ids.reshape(-1)
    block, lane = flat // LANES, flat % LANES
    q = packed.view(-1, G, 8, LANES, 4)[block, :, :, lane]  # [n, G, 8, 4]
    scale = d[block, :, lane].float()  # [n, G]
    rows = q.float().view(-1, G, GROUP) * scale[..., None]
    return rows.view(*ids.shape, G * GROUP)


def w8a8_mm(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [R, K] → [R, N'] fp32 (`pack_w8a8`'s layout): int8 blocks times int8 activations."""
    return _module().w8a8_mm(x, packed, d)


def unpack_w4a8(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, N: int):
    """`pack_w4a8`'s inverse: (q [N, K] uint8, scale [N, K/32], minimum [N, K/32])."""
    G = d.shape[1]
    b = packed.view(-1, G, 4, LANES, 4)  # block, group, chunk, lane, byte
    q = torch.stack([b & 15, b >> 4], dim=2)  # block, group, half, chunk, lane, byte
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(-1, G * GROUP)[:N]
    rows = lambda t: t.transpose(1, 2).reshape(-1, G)[:N]  # noqa: E731
    return q, rows(d), rows(m)


def w4a8_mm(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [R, K] → [R, N'] fp32 (`pack_w4a8`'s layout): int4 weights times int8 activations."""
    return _module().w4a8_mm(x, packed, d, m)


def unpack_q4(nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor, N: int):
    """`pack_q4`'s inverse: (q [N, K] uint8, scale [N, K/32], minimum [N, K/32])."""
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1)  # [N'/16, K/2, 16, 2]
    q = q.permute(0, 2, 1, 3).reshape(-1, nibbles.shape[1] * 2)[:N]
    rows = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1])[:N]  # noqa: E731
    return q, rows(d), rows(m)


def pack_q8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scales [N] → ([N'/16, K, 16] int8, [N'/16, 16] fp32), N' = N rounded up to 64."""
    K = q.shape[1]
    q, scales = _padded(q, scales.float())
    return q.view(-1, LANES, K).transpose(1, 2).contiguous(), scales.view(-1, LANES).contiguous()


def q4_mm(x: torch.Tensor, nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [R, K] → [R, N'] fp32 (`pack_q4`'s layout)."""
    return _module().q4_mm(x, nibbles, d, m)


def q8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [R, K] → [R, N'] fp32 (`pack_q8`'s layout)."""
    return _module().q8_mm(x, q, scales)


def attend(qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           lens: torch.Tensor, n_heads: int, scale: float) -> torch.Tensor:
    """One layer's attention for T new tokens per row, in one call: qkv [B, T, (H + 2 H_kv) D] → RoPE
    (rotate half; cos / sin [P, D] fp32) on queries and keys at positions lens[b] + t, keys and values
    written into the cache (kc / vc [B, H_kv, C, D] fp32), causal attention → [B, T, H D] fp32.

    Exact by construction: each query head is computed alone over keys 0 .. its position (scores
    one dot product per key with the lanes summed in a fixed tree, an exact max, exp by one
    polynomial, the values summed key by key in order), so a token's output is the same bits
    whatever T, the batch, the other rows' lengths or the thread count."""
    return _module().attend(qkv, kc, vc, cos, sin, lens, n_heads, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (a multiple of 16), computed in fp32, each row alone."""
    return _module().rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 I] (gate, then up), computed in fp32."""
    return _module().silu_mul(gate_up)


def layer(*args) -> torch.Tensor:
    """A whole decoder layer in one call (specloop.drafter.model.decoder builds the arguments: `LeanDecoder._layer_args`)."""
    return _module().layer(*args)


def linear_op(kind: str):
    """The compiled `q4_linear` / `q8_linear`: x [..., K] → [..., n] in x's dtype, in one call (what a
    decode step calls ~120 times: no Python between the conversions and the product)."""
    return getattr(_module(), f"{kind}_linear")
