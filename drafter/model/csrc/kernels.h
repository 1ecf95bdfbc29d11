// specloop's CPU kernels: what the sources share (the 16-lane float vector, fp16 loads, the tiling of
// outputs over threads, the tensor plumbing, exact-order reductions and exp) and the functions the
// Python module exposes. Built by drafter/model/kernels.py (torch.utils.cpp_extension,
// -march=native: the #if branches below pick the widest instructions this CPU has).
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float vf __attribute__((vector_size(64)));

static inline vf load_vf(const float* p) { vf v; std::memcpy(&v, p, 64); return v; }

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
template <int TB = TILE, typename F>
static void over_tiles(int64_t NB, int64_t R, int64_t grain, F&& f) {
  at::parallel_for(0, NB / TB, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0 * TB; nb < b1 * TB; nb += TB)
      by_rows(R, [&](int64_t r0, auto m) { f(nb, r0, m); });
  });
}

// [..., K] in any float dtype -> (rows [R, K] fp32 contiguous, output shape [..., n])
static inline torch::Tensor rows_of(const torch::Tensor& x) {
  return x.reshape({-1, x.size(-1)}).to(torch::kFloat32).contiguous();
}
static inline torch::Tensor shaped(const torch::Tensor& y, const torch::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return (y.size(1) == n ? y : y.narrow(1, 0, n)).to(x.scalar_type()).reshape(sizes);
}

// ---------------------------------------------------------------------------- exact-order float helpers
typedef int32_t vi __attribute__((vector_size(64)));

static inline vf splat(float a) { return vf{} + a; }

// Sum of 16 lanes in a fixed pairwise tree.
static inline float hsum16(float* a) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}
static inline float hsum(vf v) {
  float a[16];
  std::memcpy(a, &v, 64);
  return hsum16(a);
}

// The widest float vector this CPU holds in a register (`vn`, NL lanes): element-wise code written on it
// computes every lane as `vf` code would, without the memory round trips GCC gives 16-lane vectors where
// registers are 8 lanes (AVX2).
#if defined(__AVX512F__)
typedef vf vn;
typedef vi vni;
#else
typedef float vn __attribute__((vector_size(32)));
typedef int32_t vni __attribute__((vector_size(32)));
#endif
constexpr int NL = sizeof(vn) / sizeof(float);
static inline vn load_vn(const float* p) { vn v; std::memcpy(&v, p, sizeof(vn)); return v; }
static inline void store_vn(float* p, vn v) { std::memcpy(p, &v, sizeof(vn)); }

// exp(x) for x <= 0 lane by lane (range reduction by ln 2, degree-6 polynomial: a few ulp); lanes below
// -87 (and -inf) give exactly 0. V: a float vector type, VI its int32 twin.
template <typename V, typename VI>
static inline V exp_neg_of(V x) {
  const V lo = V{} - 87.0f;
  const VI under = x < lo;
  x = under ? lo : x;
  const V fx = x * 1.44269504088896341f + 0.5f;
  V nf = __builtin_convertvector(__builtin_convertvector(fx, VI), V);
  nf = (nf > fx) ? nf - 1.0f : nf;  // floor
  V r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const VI bits = (__builtin_convertvector(nf, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(V));
  return under ? V{} : p * scale;
}
static inline vf exp_neg(vf x) { return exp_neg_of<vf, vi>(x); }

// ---------------------------------------------------------------------------- the module's functions
// weight_only.cpp: fp32 activations times int4 (GGUF Q4_1 groups) / int8 (per output) weights
torch::Tensor q4_mm(torch::Tensor x_in, torch::Tensor w, torch::Tensor d, torch::Tensor mn);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor mn, int64_t n);
torch::Tensor q8_mm(torch::Tensor x_in, torch::Tensor w, torch::Tensor s);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor s, int64_t n);
// int8_dot.cpp: int8 activations times int4 / int8 blocks (integer dot products)
torch::Tensor w4a8_mm(torch::Tensor x_in, torch::Tensor w, torch::Tensor d, torch::Tensor mn);
torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor mn, int64_t n);
int64_t w4a8_interleave();
bool set_amx(bool on);  // int8 products' runs of 16 rows on AMX tiles (where the CPU has them); returns whether they are
bool amx_in_use();
torch::Tensor w8a8_mm(torch::Tensor x_in, torch::Tensor w, torch::Tensor d);
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, int64_t n);
std::tuple<torch::Tensor, torch::Tensor, bool> w8a8_choose(torch::Tensor x, torch::Tensor w, torch::Tensor d,
                                                           int64_t n);
torch::Tensor w8a8_rows(torch::Tensor w, torch::Tensor d, torch::Tensor ids);
// attention.cpp
torch::Tensor attend(torch::Tensor qkv_in, torch::Tensor kc, torch::Tensor vc, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor lens_in, int64_t H, double scale_d);
// layer.cpp
torch::Tensor rms_norm(torch::Tensor x_in, torch::Tensor w_in, double eps);
torch::Tensor silu_mul(torch::Tensor x_in);
torch::Tensor layer_by_ops(torch::Tensor x, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                           std::vector<int64_t> kinds, std::vector<int64_t> dims, std::vector<torch::Tensor> parts,
                           torch::Tensor kc, torch::Tensor vc, torch::Tensor cos, torch::Tensor sin, torch::Tensor lens,
                           int64_t H, double scale);
torch::Tensor layer(torch::Tensor x, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                    std::vector<int64_t> kinds, std::vector<int64_t> dims, std::vector<torch::Tensor> parts,
                    torch::Tensor kc, torch::Tensor vc, torch::Tensor cos, torch::Tensor sin, torch::Tensor lens,
                    int64_t H, double scale);
// region.cpp
// Whether a layer of these linear kinds and input runs in one parallel region (region.cpp): four w4a8 linears
// (kind 2), x [B, T, hidden] fp32.
static inline bool region_layer(const std::vector<int64_t>& kinds, const torch::Tensor& x) {
  return kinds.size() == 4 && std::all_of(kinds.begin(), kinds.end(), [](int64_t k) { return k == 2; }) &&
         x.scalar_type() == torch::kFloat32 && x.dim() == 3;
}
torch::Tensor stack_region(const torch::Tensor& x_in, const std::vector<const torch::Tensor*>& in_norms,
                           const std::vector<const torch::Tensor*>& post_norms, double eps,
                           const std::vector<const std::vector<int64_t>*>& dims,
                           const std::vector<const std::vector<torch::Tensor>*>& parts,
                           const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                           const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& lens_in, int64_t H,
                           double scale);
torch::Tensor layer_region(const torch::Tensor& x_in, const torch::Tensor& in_norm, const torch::Tensor& post_norm,
                           double eps_d, const std::vector<int64_t>& dims, const std::vector<torch::Tensor>& parts,
                           const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& cos,
                           const torch::Tensor& sin, const torch::Tensor& lens_in, int64_t H, double scale);
