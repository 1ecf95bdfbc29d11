// fp32 activations times quantized weights, every row through the same instructions whatever the
// number of rows: int4 (`q4_mm`, GGUF Q4_1 groups of 32: w = q * d + m) and int8 (`q8_mm`, one scale per
// output). Weights in blocks of 16 outputs (one vector), 4 blocks a tile, tiles split over threads.
#include "kernels.h"

// 16 bytes -> 16 floats, exactly (small integers), with the widest vectors this CPU has.
#if defined(__AVX512F__)
static inline vf bytes_to_vf(__m128i b, bool is_signed) {
  const __m512i i = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  const __m512 f = _mm512_cvtepi32_ps(i);
  vf v; std::memcpy(&v, &f, 64); return v;
}
#elif defined(__AVX2__)
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
      _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t)
        nibbles_to_vf(w + t * wstride + g * 256 + kk * 16, lo[t], hi[t]);
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
