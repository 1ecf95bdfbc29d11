// `attend`: RoPE, the KV-cache write and causal attention of T new tokens per row, each query computed
// alone over its keys (exact across T, batch and threads by construction).
#include "kernels.h"

#include <type_traits>

// How far ahead of its use a key or value row is asked for (a hint: no value depends on it). A step's cache
// comes from memory, not from L2 (the layers' weights pass in between), and the scores and value sums do not
// overlap their loads with their arithmetic by themselves: asked for 32 keys ahead, a 1,000-token context's step
// is 8 % cheaper, a 2,000-token one's 13-15 % (bench/README.md section 59; nothing measurable at 50-300).
constexpr int64_t AHEAD = 32;
static inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o, 0, 3);
}

// A KV cache holds fp32, or bf16 / fp16 (`--kv-cache-dtype bfloat16 | float16`: half the bytes a step reads). A
// 16-bit element widens to fp32 exactly (bf16: a shift; fp16: F16C's conversion), so every step after the load is
// the fp32 cache's, on the values the cache holds. Keys and values are rounded once, when written (to nearest
// even, as torch rounds).
enum Kv { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };
static inline Kv kv_of(const torch::Tensor& cache) {
  const auto t = cache.scalar_type();
  return t == torch::kBFloat16 ? KV_BF16 : t == torch::kHalf ? KV_F16 : KV_F32;
}
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
static inline bf16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fc0};  // NaN: torch's quiet NaN
  return {static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
static inline f16_t to_f16(float f) {
#if defined(__F16C__)
  return {static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
#else
  return {c10::detail::fp16_ieee_from_fp32_value(f)};
#endif
}
static inline void put(bf16_t& d, float f) { d = to_bf16(f); }
static inline void put(f16_t& d, float f) { d = to_f16(f); }
// f(a null KT*) with KT the cache's element type: the one place a kernel's template meets `kv`.
template <typename F>
static inline void by_kv(Kv kv, F&& f) {
  switch (kv) {
    case KV_BF16: f(static_cast<const bf16_t*>(nullptr)); break;
    case KV_F16: f(static_cast<const f16_t*>(nullptr)); break;
    default: f(static_cast<const float*>(nullptr)); break;
  }
}
static inline vf load16(const float* p) { return load_vf(p); }
static inline vf load16(const f16_t* p) { return load_h16(reinterpret_cast<const uint16_t*>(p)); }
static inline vf load16(const bf16_t* p) {
  typedef uint16_t vh __attribute__((vector_size(32)));
  typedef uint32_t vu __attribute__((vector_size(64)));
  vh h;
  std::memcpy(&h, p, 32);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, 64);
  return v;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 load8(const f16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int j = 0; j < 8; ++j) f[j] = c10::detail::fp16_ieee_to_fp32_value(p[j].bits);
  return _mm256_load_ps(f);
#endif
}

// `attend_group`'s three steps (`scores16`, `exp_row`, `values`), for AVX2 and for 16-lane vectors.
//
// AVX2 (16 registers of 8 lanes): GCC keeps a 16-lane vector (`vf`) in memory where the CPU has no 64-byte
// registers, so the vf versions (after #else) move every value through the stack (measured: 3.5x slower
// than the code below on an AVX2-only EPYC). Here the same steps on explicit 8-lane registers: scores 8 keys at
// a time, each key's first fold (lanes i and i + 8) one add, then the 8 x 8 block transposed so that the
// remaining folds of `sum16`'s tree (i and i + 4, then + 2, then + 1) add whole registers; the softmax's
// exp (`exp_neg_of` on 8 lanes) and sum as `exp_neg` and `hsum`; the values 16 or 32 dims a pass. Each query is
// still computed alone by the same operations whatever shares its call: exact across T by construction.
static inline __m256 tree8(const __m256* t) {  // lane j: t[j]'s lanes folded as sum16 folds them
  const __m256 a0 = _mm256_unpacklo_ps(t[0], t[1]), a1 = _mm256_unpackhi_ps(t[0], t[1]);
  const __m256 a2 = _mm256_unpacklo_ps(t[2], t[3]), a3 = _mm256_unpackhi_ps(t[2], t[3]);
  const __m256 a4 = _mm256_unpacklo_ps(t[4], t[5]), a5 = _mm256_unpackhi_ps(t[4], t[5]);
  const __m256 a6 = _mm256_unpacklo_ps(t[6], t[7]), a7 = _mm256_unpackhi_ps(t[6], t[7]);
  const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
  const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
  const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
  const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
  // r_i: lane j = t[j]'s lane i
  const __m256 r0 = _mm256_permute2f128_ps(b0, b4, 0x20), r4 = _mm256_permute2f128_ps(b0, b4, 0x31);
  const __m256 r1 = _mm256_permute2f128_ps(b1, b5, 0x20), r5 = _mm256_permute2f128_ps(b1, b5, 0x31);
  const __m256 r2 = _mm256_permute2f128_ps(b2, b6, 0x20), r6 = _mm256_permute2f128_ps(b2, b6, 0x31);
  const __m256 r3 = _mm256_permute2f128_ps(b3, b7, 0x20), r7 = _mm256_permute2f128_ps(b3, b7, 0x31);
  const __m256 c0 = _mm256_add_ps(r0, r4), c1 = _mm256_add_ps(r1, r5), c2 = _mm256_add_ps(r2, r6),
               c3 = _mm256_add_ps(r3, r7);
  return _mm256_add_ps(_mm256_add_ps(c0, c2), _mm256_add_ps(c1, c3));
}
// `hsum`'s tree over 16 lanes held as lanes 0-7 (a) and 8-15 (b).
static inline float hsum8x2(__m256 a, __m256 b) {
  const __m256 t = _mm256_add_ps(a, b);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
}

// The value sums of MQ queries (a compile-time count, so their accumulators stay in registers: MQ W8 + W8 + 1
// of the 16) for 8 W8 of the D dims from d0, over the keys in order: each lane's chain of adds the same whatever
// the tile or the dims beside it. s, Ls, inv, outs: the first query's. Not inlined: inside the attention's one big
// function GCC kept some of these accumulators on the stack (a store and reload per key). Every loop over the
// queries and dims unrolled: where one was left a loop, GCC 12 kept `o` in memory and stored each accumulator
// after each key's FMA (12 stores a key at MQ 6: a prefill's value sums at half their FMA rate on a Zen 3).
template <int MQ, int W8, typename KT>
__attribute__((noinline)) static void values_tile(const float* s, int64_t Lp, const int64_t* Ls, const float* inv,
                                                  float* const* outs, const KT* V, int64_t D, int64_t d0) {
  int64_t lo = Ls[0];
  _Pragma("GCC unroll 8") for (int i = 1; i < MQ; ++i) lo = std::min(lo, Ls[i]);
  __m256 o[MQ][W8];
  _Pragma("GCC unroll 8") for (int i = 0; i < MQ; ++i)
    _Pragma("GCC unroll 8") for (int w = 0; w < W8; ++w) o[i][w] = _mm256_setzero_ps();
  const KT* v = V + d0;
  for (int64_t j = 0; j < lo; ++j) {  // keys every query of the tile sees
    if (j + AHEAD < lo) prefetch_bytes(v + (j + AHEAD) * D, W8 * 8 * sizeof(KT));
    __m256 vv[W8];
    _Pragma("GCC unroll 8") for (int w = 0; w < W8; ++w) vv[w] = load8(v + j * D + 8 * w);
    _Pragma("GCC unroll 8") for (int i = 0; i < MQ; ++i) {
      const __m256 p = _mm256_broadcast_ss(s + i * Lp + j);
      _Pragma("GCC unroll 8") for (int w = 0; w < W8; ++w) o[i][w] = _mm256_fmadd_ps(p, vv[w], o[i][w]);
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < MQ; ++i) {  // each query's own last keys (causal tail), its output
    for (int64_t j = lo; j < Ls[i]; ++j) {
      const __m256 p = _mm256_broadcast_ss(s + i * Lp + j);
      _Pragma("GCC unroll 8") for (int w = 0; w < W8; ++w)
        o[i][w] = _mm256_fmadd_ps(p, load8(v + j * D + 8 * w), o[i][w]);
    }
    const __m256 r = _mm256_set1_ps(inv[i]);
    _Pragma("GCC unroll 8") for (int w = 0; w < W8; ++w)
      _mm256_storeu_ps(outs[i] + d0 + 8 * w, _mm256_mul_ps(o[i][w], r));
  }
}

// A query's scores against 8 keys kr[0..7], times scale, into dst: per key the lanes' products in one
// FMA chain over D, its 16 lanes then folded as `sum16` folds them.
template <int C16, typename KT>
static inline void scores8(const __m256* qa, const __m256* qb, const KT* const* kr, float scale, float* dst) {
  __m256 t1[8];
  for (int jj = 0; jj < 8; ++jj) {
    const KT* k = kr[jj];
    __m256 a = _mm256_mul_ps(qa[0], load8(k)), b = _mm256_mul_ps(qb[0], load8(k + 8));
    for (int c = 1; c < C16; ++c) {
      a = _mm256_fmadd_ps(qa[c], load8(k + 16 * c), a);
      b = _mm256_fmadd_ps(qb[c], load8(k + 16 * c + 8), b);
    }
    t1[jj] = _mm256_add_ps(a, b);
  }
  _mm256_storeu_ps(dst, _mm256_mul_ps(tree8(t1), _mm256_set1_ps(scale)));
}

template <int C16, typename KT>
static inline void scores16(const float* q, const KT* const* kr, float scale, float* dst) {
  __m256 qa[C16], qb[C16];
  for (int c = 0; c < C16; ++c) {
    qa[c] = _mm256_loadu_ps(q + 16 * c);
    qb[c] = _mm256_loadu_ps(q + 16 * c + 8);
  }
  scores8<C16>(qa, qb, kr, scale, dst);
  scores8<C16>(qa, qb, kr + 8, scale, dst + 8);
}

static inline float exp_row(float* si, int64_t Li, float m) {
  __m256 ta = _mm256_setzero_ps(), tb = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t j = 0; j < Li; j += 16) {
    const __m256 pa = exp_neg_of<vn, vni>(_mm256_sub_ps(_mm256_loadu_ps(si + j), mv));
    const __m256 pb = exp_neg_of<vn, vni>(_mm256_sub_ps(_mm256_loadu_ps(si + j + 8), mv));
    _mm256_storeu_ps(si + j, pa);
    _mm256_storeu_ps(si + j + 8, pb);
    ta = _mm256_add_ps(ta, pa);
    tb = _mm256_add_ps(tb, pb);
  }
  return hsum8x2(ta, tb);
}

template <int C16, typename KT>
static void values(const float* s, int64_t Lp, const int64_t* Ls, const float* inv, float* const* outs, int n,
                   const KT* V, int64_t D) {
  for (int i0 = 0; i0 < n;) {  // tiles of 6 or 4 queries 16 dims at a time, of 2 or 1 query 32 dims at a time
    const int left = n - i0, mq = left >= 6 ? 6 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    const float* si = s + i0 * Lp;
    for (int64_t d0 = 0; d0 < D; d0 += mq <= 2 ? 32 : 16) {  // D = 16 C16, C16 even
      switch (mq) {
        case 6: values_tile<6, 2, KT>(si, Lp, Ls + i0, inv + i0, outs + i0, V, D, d0); break;
        case 4: values_tile<4, 2, KT>(si, Lp, Ls + i0, inv + i0, outs + i0, V, D, d0); break;
        case 2: values_tile<2, 4, KT>(si, Lp, Ls + i0, inv + i0, outs + i0, V, D, d0); break;
        default: values_tile<1, 4, KT>(si, Lp, Ls + i0, inv + i0, outs + i0, V, D, d0); break;
      }
    }
    i0 += mq;
  }
}
#else  // 16-lane vectors (AVX-512, or lane by lane)
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

// One query's scores against 16 keys kr[0..15], times scale, into dst: per key the lanes' products in one
// chain over D, the 16 keys' lanes then folded together by `sum16`.
template <int C16, typename KT>
static inline void scores16(const float* q, const KT* const* kr, float scale, float* dst) {
  vf qv[C16];
  for (int64_t c = 0; c < C16; ++c) qv[c] = load_vf(q + 16 * c);
  vf part[16];
  for (int64_t jj = 0; jj < 16; ++jj) {
    vf a = qv[0] * load16(kr[jj]);
    for (int64_t c = 1; c < C16; ++c) a = a + qv[c] * load16(kr[jj] + 16 * c);
    part[jj] = a;
  }
  const vf sc = sum16(part) * scale;
  std::memcpy(dst, &sc, 64);
}

// si[0..Li) -> exp(si - m) in place (Li a multiple of 16); returns their sum (lane chains, then `hsum`).
static inline float exp_row(float* si, int64_t Li, float m) {
  vf total = vf{};
  for (int64_t j = 0; j < Li; j += 16) {
    const vf p = exp_neg(load_vf(si + j) - m);
    std::memcpy(si + j, &p, 64);
    total = total + p;
  }
  return hsum(total);
}

// The value sums of MQ queries (a compile-time count: their MQ C16 accumulators stay in registers, with the
// C16 of a value row beside them; with a count known only at run time GCC kept them on the stack, a load and
// a store a product), over the keys in order: each lane's chain of adds the same whatever the tile.
// s, Ls, inv, outs: the first query's.
template <int C16, int MQ, typename KT>
__attribute__((noinline)) static void values_tile(const float* s, int64_t Lp, const int64_t* Ls, const float* inv,
                                                  float* const* outs, const KT* V, int64_t D) {
  int64_t lo = Ls[0];
  for (int i = 1; i < MQ; ++i) lo = std::min(lo, Ls[i]);
  vf o[MQ][C16];
  for (int i = 0; i < MQ; ++i)
    for (int c = 0; c < C16; ++c) o[i][c] = vf{};
  for (int64_t j = 0; j < lo; ++j) {  // keys every query of the tile sees
    const KT* v = V + j * D;
    if (j + AHEAD < lo) prefetch_bytes(v + AHEAD * D, D * sizeof(KT));
    vf vv[C16];
    for (int c = 0; c < C16; ++c) vv[c] = load16(v + 16 * c);
    for (int i = 0; i < MQ; ++i) {
      const float pj = s[i * Lp + j];
      for (int c = 0; c < C16; ++c) o[i][c] = o[i][c] + pj * vv[c];
    }
  }
  for (int i = 0; i < MQ; ++i) {  // each query's own last keys (the causal tail), then its output
    for (int64_t j = lo; j < Ls[i]; ++j) {
      const float pj = s[i * Lp + j];
      const KT* v = V + j * D;
      for (int c = 0; c < C16; ++c) o[i][c] = o[i][c] + pj * load16(v + 16 * c);
    }
    for (int c = 0; c < C16; ++c) {
      const vf y = o[i][c] * inv[i];
      std::memcpy(outs[i] + 16 * c, &y, 64);
    }
  }
}

// Queries [0, n) in tiles of MQ, the n % MQ left in one smaller tile.
template <int C16, int MQ, typename KT>
static void values_by(const float* s, int64_t Lp, const int64_t* Ls, const float* inv, float* const* outs, int n,
                      const KT* V, int64_t D) {
  int i0 = 0;
  for (; i0 + MQ <= n; i0 += MQ) values_tile<C16, MQ>(s + i0 * Lp, Lp, Ls + i0, inv + i0, outs + i0, V, D);
  if constexpr (MQ > 1)
    if (i0 < n) values_by<C16, MQ - 1>(s + i0 * Lp, Lp, Ls + i0, inv + i0, outs + i0, n - i0, V, D);
}

// Each query's values over its keys, in tiles of up to 24 / C16 queries.
template <int C16, typename KT>
static void values(const float* s, int64_t Lp, const int64_t* Ls, const float* inv, float* const* outs, int n,
                   const KT* V, int64_t D) {
  values_by<C16, C16 >= 16 ? 1 : 24 / C16>(s, Lp, Ls, inv, outs, n, V, D);
}
#endif

// Rotate-half RoPE of one head (D floats) at one position into dst.
static inline void rope_head(const float* x, const float* c, const float* s, float* dst, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) dst[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = half; i < D; ++i) dst[i] = x[i] * c[i] + x[i - half] * s[i];
}

// The largest of x[0, n) (NaNs passed over; -inf if none), as the scalar loop `m = max(m, x[j])` finds it:
// a max is exact in any order, so NL lanes' maxima and then theirs (that loop, one compare a key in a chain
// of dependent compares, was a fifth of the attention's time).
static inline float max_of(const float* x, int64_t n) {
  vn mv = vn{} - INFINITY;
  int64_t j = 0;
  for (; j + NL <= n; j += NL) {
    const vn v = load_vn(x + j);
    mv = (mv < v) ? v : mv;  // a NaN in v leaves the lane as it was
  }
  float m = -INFINITY;
  for (int l = 0; l < NL; ++l) m = std::max(m, mv[l]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// Query heads that share one KV head (a row's head group, over one or more new tokens), query i over keys
// [0, Ls[i]): scores, softmax, values. Each query's result depends on (the query, its Ls[i] keys and values)
// alone, never on which other queries share the call, T, the batch or the thread: every query goes
// through the same operations in the same order as it would alone; the group only shares the loads
// (a chunk of keys is scored for every query while it is in L1, a value row feeds every query's
// accumulators, which also keeps the FMA units busy: one query alone is a chain of dependent adds).
template <int C16, typename KT>
static void attend_group(const float* const* qs, float* const* outs, const int64_t* Ls, int n,
                         const KT* K, const KT* V, int64_t D, float scale, std::vector<float>& s) {
  int64_t Lmax = 0;
  for (int i = 0; i < n; ++i) Lmax = std::max(Lmax, Ls[i]);
  const int64_t Lp = (Lmax + 15) / 16 * 16;
  s.resize(n * Lp);
  for (int64_t j0 = 0; j0 < Lp; j0 += 16) {  // scores, 16 keys at a time: lanes, then keys, summed
    const KT* kr[16];                         // in one fixed tree (`sum16`: lane jj is key jj's alone)
    for (int64_t jj = 0; jj < 16; ++jj) kr[jj] = K + std::min(j0 + jj, Lmax - 1) * D;  // tail: dropped
    if (j0 + AHEAD < Lmax)
      prefetch_bytes(K + (j0 + AHEAD) * D, std::min<int64_t>(16, Lmax - j0 - AHEAD) * D * sizeof(KT));
    for (int i = 0; i < n; ++i)
      if (j0 < Ls[i]) scores16<C16>(qs[i], kr, scale, s.data() + i * Lp + j0);
  }
  float inv[64];
  for (int i = 0; i < n; ++i) {  // softmax numerators, each query over its own keys
    float* si = s.data() + i * Lp;
    const int64_t L = Ls[i], Li = (L + 15) / 16 * 16;
    const float m = max_of(si, L);
    for (int64_t j = L; j < Li; ++j) si[j] = -INFINITY;      // exp gives exactly 0 there
    inv[i] = 1.0f / exp_row(si, Li, m);
  }
  values<C16>(s.data(), Lp, Ls, inv, outs, n, V, D);  // one chain per lane and query over the keys in order
}

// One call's attention, as its units of work read it: qkv rows [B T, (H + 2 Hkv) D] at stride W, queries
// after RoPE q [B T H, D], the cache kc / vc [B, Hkv, C, D], out [B T, H D], each row's length before the
// call lens [B]; `per` queries of a KV head's group make one unit of the attention, `tiles` units a group. The
// cache's elements: `kv`.
struct Attn {
  const float *x, *cos, *sin;
  float* q;
  void *kc, *vc;
  float* out;
  const int64_t* lens;
  int64_t B, T, H, Hkv, C, D, W, per, tiles;
  float scale;
  Kv kv;
};

// sum of q / rep over q in [0, n) (integer division)
static inline int64_t steps_below(int64_t n, int64_t rep) {
  const int64_t k = n / rep;
  return rep * k * (k - 1) / 2 + k * (n - rep * k);
}

// f(unit, thread, its cost) for every unit in order. A unit's cost is in keys read: each of its queries' keys
// (query qi of a row is token qi / rep's, over lens[b] + qi / rep + 1 keys) and the tile's own pass over the
// row's keys and values (once for all its queries). Each unit goes to the thread whose even share of the
// whole cost holds the unit's middle: every thread takes a contiguous run of units about even in cost (rows of
// different lengths, tiles of different sizes), not in count. Which thread computes a query changes none of
// its bits.
template <typename F>
static void by_owner(const Attn& a, int nt, F&& f) {
  const int64_t rep = a.H / a.Hkv, nq = rep * a.T;
  const auto cost = [&](int64_t t, int64_t L0) {  // tile t of a row of L0 - 1 cached tokens
    const int64_t q0 = t * a.per, q1 = std::min(nq, q0 + a.per);
    return (q1 - q0 + 1) * L0 + (q1 - 1) / rep + steps_below(q1, rep) - steps_below(q0, rep);
  };
  int64_t total = 0;
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t t = 0; t < a.tiles; ++t) total += a.Hkv * cost(t, a.lens[b] + 1);
  int64_t done = 0, u = 0;
  int owner = 0;
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t g = 0; g < a.Hkv; ++g)
      for (int64_t t = 0; t < a.tiles; ++t, ++u) {
        const int64_t c = cost(t, a.lens[b] + 1);
        while (owner < nt - 1 && (2 * done + c) * nt >= 2 * total * (owner + 1)) ++owner;  // the middle's share
        f(u, owner, c);
        done += c;
      }
}

// The units [a, b) thread `tid` of `nt` takes (`by_owner`).
struct Span {
  int64_t a = 0, b = 0;
};
static Span attn_span(const Attn& a, int tid, int nt) {
  if (nt == 1) return {0, a.B * a.Hkv * a.tiles};
  Span s;
  bool any = false;
  by_owner(a, nt, [&](int64_t u, int owner, int64_t) {
    if (owner != tid) return;
    if (!any) s.a = u;
    any = true;
    s.b = u + 1;
  });
  return s;
}

// The cost of the busiest of `nt` threads (owners come in order: one running sum).
static int64_t busiest(const Attn& a, int nt) {
  int64_t most = 0, sum = 0;
  int at = 0;
  by_owner(a, nt, [&](int64_t, int owner, int64_t c) {
    if (owner != at) sum = 0, at = owner;
    sum += c;
    most = std::max(most, sum);
  });
  return most;
}

// Units of work: (row, KV head, a tile of its rep · T queries, token-major), at most 48 queries a tile (a
// query's result does not depend on its tile). About four units a thread, unless a count of tiles near that
// (as even as they can be) leaves the busiest thread less to do: fewer tiles read the keys fewer times, more
// spread them over the threads (`busiest`; with 3 KV heads on 2 threads, a 4-token pass's 12 queries a head
// go 6 + 6, not 5 + 5 + 2). `like`: a plan of the same shapes and lengths to take the tiles from (a stack's
// layers).
static Attn attn_of(const float* x, int64_t W, const float* cos, const float* sin, float* q, void* kc, void* vc,
                    Kv kv, float* out, const int64_t* lens, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                    int64_t C, int64_t D, float scale, int64_t threads, const Attn* like = nullptr) {
  const int64_t nq = H / Hkv * T, nt = std::max<int64_t>(1, threads);
  const int64_t per0 = std::max<int64_t>(1, std::min<int64_t>(48, (B * H * T + 4 * nt - 1) / (4 * nt)));
  Attn a{x, cos, sin, q, kc, vc, out, lens, B, T, H, Hkv, C, D, W, per0, (nq + per0 - 1) / per0, scale, kv};
  if (like) {
    a.per = like->per, a.tiles = like->tiles;
    return a;
  }
  if (nt == 1) return a;
  Attn best = a;
  int64_t least = busiest(a, (int)nt);
  for (int64_t tiles = std::max((nq + 47) / 48, a.tiles - 2); tiles <= std::min(nq, a.tiles + 2); ++tiles) {
    Attn c = a;
    c.per = (nq + tiles - 1) / tiles;
    c.tiles = (nq + c.per - 1) / c.per;
    if (c.tiles != tiles || (c.per == a.per && c.tiles == a.tiles)) continue;  // the same as another count
    const int64_t m = busiest(c, (int)nt);
    if (m < least) least = m, best = c;
  }
  return best;
}

// RoPE unit u of B T (H + Hkv): token i's head u % (H + Hkv), a query head rotated into q, a KV head's key
// rotated and its value copied into the cache at the token's position.
static void rope_unit(const Attn& a, int64_t u) {
  const int64_t i = u / (a.H + a.Hkv), h = u % (a.H + a.Hkv), b = i / a.T, pos = a.lens[b] + i % a.T, D = a.D;
  const float* x = a.x + i * a.W;
  if (h < a.H) {
    rope_head(x + h * D, a.cos + pos * D, a.sin + pos * D, a.q + (i * a.H + h) * D, D);
    return;
  }
  const int64_t g = h - a.H, at_ = ((b * a.Hkv + g) * a.C + pos) * D;
  const float* v = x + (a.H + a.Hkv + g) * D;
  if (a.kv == KV_F32) {
    rope_head(x + h * D, a.cos + pos * D, a.sin + pos * D, static_cast<float*>(a.kc) + at_, D);
    std::memcpy(static_cast<float*>(a.vc) + at_, v, D * sizeof(float));
    return;
  }
  float k[256];  // D <= 256 (check_attend); a 16-bit cache: rounded once, as stored
  rope_head(x + h * D, a.cos + pos * D, a.sin + pos * D, k, D);
  by_kv(a.kv, [&](auto tag) {
    using KT = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    if constexpr (!std::is_same_v<KT, float>) {
      KT *kd = static_cast<KT*>(a.kc) + at_, *vd = static_cast<KT*>(a.vc) + at_;
      for (int64_t i = 0; i < D; ++i) put(kd[i], k[i]), put(vd[i], v[i]);
    }
  });
}

template <typename KT>
static void attend_by_dim(const float* const* qs, float* const* outs, const int64_t* Ls, int n, const KT* K,
                          const KT* V, int64_t D, float scale, std::vector<float>& s) {
  switch (D) {
    case 32: attend_group<2>(qs, outs, Ls, n, K, V, D, scale, s); break;
    case 64: attend_group<4>(qs, outs, Ls, n, K, V, D, scale, s); break;
    case 128: attend_group<8>(qs, outs, Ls, n, K, V, D, scale, s); break;
    default: attend_group<16>(qs, outs, Ls, n, K, V, D, scale, s); break;
  }
}

// Attention unit u of B Hkv tiles (s: the caller's scratch for scores).
static void attn_unit(const Attn& a, int64_t u, std::vector<float>& s) {
  const float* qs[48];
  float* outs[48];
  int64_t Ls[48];
  const int64_t D = a.D, rep = a.H / a.Hkv, nq = rep * a.T;
  const int64_t tile = u % a.tiles, bg = u / a.tiles, b = bg / a.Hkv, g = bg % a.Hkv, base = (b * a.Hkv + g) * a.C * D;
  const int n = (int)std::min(a.per, nq - tile * a.per);
  for (int i = 0; i < n; ++i) {
    const int64_t qi = tile * a.per + i, t = qi / rep, h = g * rep + qi % rep, row = (b * a.T + t) * a.H + h;
    qs[i] = a.q + row * D;
    outs[i] = a.out + row * D;
    Ls[i] = a.lens[b] + t + 1;
  }
  by_kv(a.kv, [&](auto tag) {
    using KT = decltype(tag);
    attend_by_dim(qs, outs, Ls, n, static_cast<KT>(a.kc) + base, static_cast<KT>(a.vc) + base, D, a.scale, s);
  });
}

// The shapes `attend` and the layer's region accept (qkv's width W), and room in the cache for T more.
static void check_attend(int64_t W, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& cos,
                         const torch::Tensor& sin, const torch::Tensor& lens, int64_t B, int64_t T, int64_t H) {
  const int64_t Hkv = kc.size(1), C = kc.size(2), D = kc.size(3);
  const auto kt = kc.scalar_type();
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() &&
              (kt == torch::kFloat32 || kt == torch::kBFloat16 || kt == torch::kHalf) && vc.scalar_type() == kt &&
              vc.sizes() == kc.sizes() && kc.size(0) >= B,
              "KV cache: contiguous, keys and values both fp32, bf16 or fp16");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
              sin.scalar_type() == torch::kFloat32 && cos.size(1) == D, "RoPE tables: contiguous fp32 [P, D]");
  TORCH_CHECK((D == 32 || D == 64 || D == 128 || D == 256) && H % Hkv == 0 && W == (H + 2 * Hkv) * D &&
              lens.size(0) == B, "attend: shapes");
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 0 && lp[b] + T <= std::min(C, cos.size(0)), "KV cache full");
}

// Causal attention of T new tokens per row over a KV cache, exact per query by construction.
// qkv [B, T, (H + 2 Hkv) D] (any float dtype): RoPE (rotate half, tables cos/sin [P, D] fp32) on q
// and k at positions lens[b] + t; k and v written into kc / vc [B, Hkv, C, D] (fp32, or bf16 / fp16 rounded to
// nearest even) there; every query
// attends keys 0 .. its own position. Returns [B, T, H D] fp32.
torch::Tensor attend(torch::Tensor qkv_in, torch::Tensor kc, torch::Tensor vc, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor lens_in, int64_t H, double scale_d) {
  const torch::Tensor qkv = qkv_in.to(torch::kFloat32).contiguous();
  const torch::Tensor lens = lens_in.to(torch::kInt64).contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), Hkv = kc.size(1), C = kc.size(2), D = kc.size(3);
  check_attend(qkv.size(2), kc, vc, cos, sin, lens, B, T, H);
  auto q = torch::empty({B, T, H, D}, qkv.options());
  auto out = torch::empty({B, T, H * D}, qkv.options());
  const Attn a = attn_of(qkv.data_ptr<float>(), qkv.size(2), cos.data_ptr<float>(), sin.data_ptr<float>(),
                         q.data_ptr<float>(), kc.data_ptr(), vc.data_ptr(), kv_of(kc),
                         out.data_ptr<float>(), lens.data_ptr<int64_t>(), B, T, H, Hkv, C, D, (float)scale_d,
                         at::get_num_threads());
  at::parallel_for(0, B * T * (H + Hkv), 8 * (H + Hkv), [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) rope_unit(a, u);
  });
  const int nt = at::get_num_threads();
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s;
    for (int64_t tid = t0; tid < t1; ++tid) {
      const Span sp = attn_span(a, (int)tid, nt);
      for (int64_t u = sp.a; u < sp.b; ++u) attn_unit(a, u, s);
    }
  });
  return out;
}
