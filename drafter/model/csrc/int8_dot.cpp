// int8 activations (rounded per row and group of 32) times int4 (`w4a8_mm`) or int8 (`w8a8_mm`) weight
// blocks, by integer dot products: AVX-512 VNNI, else AVX-512BW / AVX2 (AVX-VNNI where present), else
// lane by lane.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels.h"

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
static inline ivec iv_add(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
#if defined(__AVX512VNNI__)
static inline ivec iv_dot(ivec acc, ivec w, ivec x) { return _mm512_dpbusd_epi32(acc, w, x); }
// acc += w times the 4 bytes at x broadcast to every lane, read by the instruction itself ({1to16}): GCC would
// otherwise broadcast every row's quads once for all the tile's blocks and spill them (32 registers at 4 rows)
static inline ivec iv_dot_quad(ivec acc, ivec w, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}
#define SPECLOOP_DOT_QUAD 1
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
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
static inline ivec iv_lo(ivec v) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(v.a, m), _mm256_and_si256(v.b, m)};
}
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
static inline ivec iv_add(ivec a, ivec b) { return {_mm256_add_epi32(a.a, b.a), _mm256_add_epi32(a.b, b.b)}; }
static inline vf iv_float(ivec v) {
  const __m256 a = _mm256_cvtepi32_ps(v.a), b = _mm256_cvtepi32_ps(v.b);
  vf o; std::memcpy(&o, &a, 32); std::memcpy(reinterpret_cast<char*>(&o) + 32, &b, 32); return o;
}
#define SPECLOOP_W4A8 1
#if defined(__F16C__) && defined(__FMA__)
#define SPECLOOP_AVX2_TILES 1  // AVX2's 16 registers: the tiles below, not the AVX-512 ones
#endif
#endif

#if defined(SPECLOOP_W4A8)
static inline int32_t quad_at(const int8_t* x) {  // the 4 bytes at x as one lane's worth
  int32_t quad;
  std::memcpy(&quad, x, 4);
  return quad;
}
#if !defined(SPECLOOP_DOT_QUAD)
// acc += w times the 4 bytes at x broadcast to every lane (VNNI reads them in its own instruction, above)
static inline ivec iv_dot_quad(ivec acc, ivec w, const int8_t* x) { return iv_dot(acc, w, iv_bcast(quad_at(x))); }
#endif
#endif

#if defined(SPECLOOP_AVX2_TILES)
constexpr int UNIT = 1;  // blocks a thread's unit of work: a tile's blocks share no loads here, and single
                         // blocks split a product's outputs evenly between the threads
#else
constexpr int UNIT = TILE;
#endif

// Where group g of block b of a w4a8 weight starts, counted in groups (256 bytes of nibbles, 16 fp16 scales
// or minimums): w4a8_group(b, G) + g * IL. Blocks come in runs of IL with the run's groups interleaved
// ([G][IL]): the AVX-512 tile reads its 4 blocks group by group, so its weights are one contiguous stretch
// read in order, which it prefetches line by line 4 KB ahead (measured on an AMD EPYC, 2 threads, from
// memory: 0.70-0.84x the time of 4 block-major streams for 1-5 rows; interleaved without the prefetches,
// 0.7x for one row but up to 1.17x for two or more); the AVX2 and portable tiles go block by block (IL = 1:
// each block's groups in a row, as before).
#if defined(SPECLOOP_W4A8) && !defined(SPECLOOP_AVX2_TILES)
constexpr int IL = TILE;
#else
constexpr int IL = 1;
#endif
static inline int64_t w4a8_group(int64_t b, int64_t G) { return b / IL * IL * G + b % IL; }

#if defined(SPECLOOP_AVX2_TILES)
// AVX2 has 16 vector registers of 8 lanes, where the AVX-512 tile keeps a whole group's unpacked weights
// for 4 blocks (64 such registers' worth) and every row's outputs as 16-lane `vf`s (which GCC keeps in
// memory without AVX-512): measured on an AVX2-only EPYC, a 5-row product cost ~5 one-row ones. Here one
// block of 16 outputs at a time, its group's nibbles unpacked once for all rows (to the stack, re-read from
// L1 by each row), each row's 8 chunk products summed in int16 (|sum| <= 8 * 2 * 15 * 127 = 30,480: exact)
// and widened once, its outputs in explicit 8-lane registers. The integer sums are the AVX-512 tile's and
// the float operations per (row, output) the same, in the same order: the same bits as that code compiled
// for this CPU (checked against it), whatever the number of rows.
static inline __m256i bcast_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
static inline void h16x2(const uint16_t* p, __m256& a, __m256& b) {  // 16 fp16 -> lanes 0-7, 8-15
  a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// out (two halves of 16 outputs) += (d dx) * float(integer sums), as the AVX-512 tiles' vf code
static inline void acc_scaled(__m256* o, __m256i sa, __m256i sb, const __m256* d, float dx) {
  const __m256 vdx = _mm256_set1_ps(dx);
  o[0] = _mm256_fmadd_ps(_mm256_mul_ps(d[0], vdx), _mm256_cvtepi32_ps(sa), o[0]);
  o[1] = _mm256_fmadd_ps(_mm256_mul_ps(d[1], vdx), _mm256_cvtepi32_ps(sb), o[1]);
}

// One w4a8 group's float steps for a row's 16 outputs: out + (d dx) * its integer sums, then + m sx (`group_step`).
static inline void w4a8_step(__m256* o, __m256i sa, __m256i sb, const __m256* d, const __m256* m, float dx, float sx) {
  acc_scaled(o, sa, sb, d, dx);
  const __m256 vsx = _mm256_set1_ps(sx);
  o[0] = _mm256_fmadd_ps(m[0], vsx, o[0]);
  o[1] = _mm256_fmadd_ps(m[1], vsx, o[1]);
}

// Chunk j of the w4a8 group at p, its inputs 4j..4j+3 (low nibbles, h = 0) or 16+4j.. (high, h = 1), unpacked to
// bytes 0-15: outputs 0-7 in w[0], 8-15 in w[1].
static inline void unpack_chunk(const uint8_t* p, int j, int h, __m256i* w) {
  const __m256i nib = _mm256_set1_epi8(15);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32));
  w[0] = _mm256_and_si256(h ? _mm256_srli_epi16(a, 4) : a, nib);
  w[1] = _mm256_and_si256(h ? _mm256_srli_epi16(b, 4) : b, nib);
}

template <int M, int TB>
static void w4a8_tile(const uint8_t* w, const uint16_t* d, const uint16_t* mn, int64_t nb, const int8_t* xq,
                      const float* dx, const float* sx, float* y, int64_t G, int64_t ldy) {
  for (int t = 0; t < TB; ++t) {
    __m256 out[M][2];
    for (int r = 0; r < M; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
    const int64_t at = w4a8_group(nb + t, G);  // IL = 1: + g
    for (int64_t g = 0; g < G; ++g) {
      alignas(32) __m256i wq[8][2];  // chunk j: inputs 4j..4j+3 (lo nibbles) and 16+4j.. (hi), outputs 0-7 | 8-15
      const uint8_t* p = w + (at + g) * 256;
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + 1024 + 64 * j), _MM_HINT_T0);
      for (int j = 0; j < 4; ++j) {
        unpack_chunk(p, j, 0, wq[j]);
        unpack_chunk(p, j, 1, wq[j + 4]);
      }
      __m256 dg[2], mg[2];
      h16x2(d + (at + g) * 16, dg[0], dg[1]);
      h16x2(mn + (at + g) * 16, mg[0], mg[1]);
      for (int r = 0; r < M; ++r) {
        const int8_t* xr = xq + (r * G + g) * 32;
        __m256i sa = _mm256_setzero_si256(), sb = _mm256_setzero_si256();
#if defined(__AVXVNNI__)
        for (int j = 0; j < 8; ++j) {
          const __m256i xb = bcast_quad(xr + 4 * j);
          sa = _mm256_dpbusd_avx_epi32(sa, wq[j][0], xb);
          sb = _mm256_dpbusd_avx_epi32(sb, wq[j][1], xb);
        }
#else
        for (int j = 0; j < 8; ++j) {
          const __m256i xb = bcast_quad(xr + 4 * j);
          sa = _mm256_add_epi16(sa, _mm256_maddubs_epi16(wq[j][0], xb));
          sb = _mm256_add_epi16(sb, _mm256_maddubs_epi16(wq[j][1], xb));
        }
        const __m256i one = _mm256_set1_epi16(1);
        sa = _mm256_madd_epi16(sa, one);
        sb = _mm256_madd_epi16(sb, one);
#endif
        w4a8_step(out[r], sa, sb, dg, mg, dx[r * G + g], sx[r * G + g]);
      }
    }
    for (int r = 0; r < M; ++r) {
      _mm256_storeu_ps(y + r * ldy + t * 16, out[r][0]);
      _mm256_storeu_ps(y + r * ldy + t * 16 + 8, out[r][1]);
    }
  }
}

// Many rows of one block (a prefill, a verify pass or batch of 8 rows or more): the tile above unpacks a group
// for every 4 rows and re-reads its 16 registers of weights from the stack for each row. Here half a group's
// unpacked weights (8 registers: inputs 4j..4j+3 or 16+4j.., j < 4) stay in registers while MR rows take their
// products; each row's int16 sums of the first half wait in L1 for the second (|sum| <= 30,480 as in the
// tile). The integer sums are the tile's (exact in any order) and each (row, output)'s float steps the same in
// the same order: the same bits. The four products of a layer: 16-750 rows 0.74-0.78x the tile's time, 8 rows
// 0.82x (bench/README.md section 61).
template <int MR>
static void w4a8_rows(const uint8_t* w, const uint16_t* d, const uint16_t* mn, int64_t nb, const int8_t* xq,
                      const float* dx, const float* sx, float* y, int64_t G, int64_t ldy) {
  const __m256i one = _mm256_set1_epi16(1);
  alignas(32) __m256 out[MR][2];
  alignas(32) __m256i half[MR][2];  // each row's int16 sums over the group's first 16 inputs
  for (int r = 0; r < MR; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  const int64_t at = w4a8_group(nb, G);  // IL = 1: + g
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = w + (at + g) * 256;
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + 1024 + 64 * j), _MM_HINT_T0);
    __m256 dg[2], mg[2];
    h16x2(d + (at + g) * 16, dg[0], dg[1]);
    h16x2(mn + (at + g) * 16, mg[0], mg[1]);
    for (int h = 0; h < 2; ++h) {
      __m256i wq[4][2];  // chunk j of this half, outputs 0-7 | 8-15
      for (int j = 0; j < 4; ++j) unpack_chunk(p, j, h, wq[j]);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = xq + (r * G + g) * 32 + 16 * h;
        __m256i pa[4], pb[4];
        for (int j = 0; j < 4; ++j) {
          const __m256i xb = bcast_quad(xr + 4 * j);
          pa[j] = _mm256_maddubs_epi16(wq[j][0], xb);
          pb[j] = _mm256_maddubs_epi16(wq[j][1], xb);
        }
        __m256i sa = _mm256_add_epi16(_mm256_add_epi16(pa[0], pa[2]), _mm256_add_epi16(pa[1], pa[3]));
        __m256i sb = _mm256_add_epi16(_mm256_add_epi16(pb[0], pb[2]), _mm256_add_epi16(pb[1], pb[3]));
        if (h == 0) {
          half[r][0] = sa, half[r][1] = sb;
          continue;
        }
        sa = _mm256_madd_epi16(_mm256_add_epi16(half[r][0], sa), one);
        sb = _mm256_madd_epi16(_mm256_add_epi16(half[r][1], sb), one);
        w4a8_step(out[r], sa, sb, dg, mg, dx[r * G + g], sx[r * G + g]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(y + r * ldy, out[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, out[r][1]);
  }
}

// Rows [0, R) of block nb in runs of 16, then one of 8, by `w4a8_rows`; returns how many. The last 0-7 rows are
// the tile's: inside a forward, 2-3 rows by `w4a8_rows` took 1.11-1.13x the tile's time and 4-6 rows 0.98-1.04x
// (their weights come from memory; a standalone product read the opposite).
static int64_t w4a8_many(const uint8_t* w, const uint16_t* d, const uint16_t* mn, int64_t K, int64_t nb, int64_t R,
                         const int8_t* xq, const float* dx, const float* sx, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  int64_t r = 0;
  for (; r + 16 <= R; r += 16) w4a8_rows<16>(w, d, mn, nb, xq + r * K, dx + r * G, sx + r * G, y + r * ldy, G, ldy);
  if (r + 8 <= R) {
    w4a8_rows<8>(w, d, mn, nb, xq + r * K, dx + r * G, sx + r * G, y + r * ldy, G, ldy);
    r += 8;
  }
  return r;
}
#elif defined(SPECLOOP_W4A8)
// One group's part of a row's 16 outputs: out + (d dx) * its integer sums + m sx (the AMX tile below runs the same).
static inline vf group_step(vf out, ivec sums, vf d, vf mg, float dx, float sx) {
  const vf dg = d * dx;
  out = out + dg * iv_float(sums);
  return out + mg * sx;
}

// w8a8's: out + (d dx) * its group's sums (the AMX tile below runs the same).
static inline vf w8_step(vf out, vf sums, vf d, float dx) {
  const vf dg = d * dx;
  return out + dg * sums;
}

// Group by group, and in each group block by block: one block's nibbles unpacked (8 registers) serve every row
// before the next block's are read, so that the weights, the rows' integer sums and their outputs (M x TB) fit
// AVX-512's 32 registers. Unpacking every block of the group first (32 registers for the weights alone) had GCC
// spill them and the outputs to the stack: ~150 moves to 128 dot products a group at 4 rows (2 threads of an AMD
// EPYC: 8 rows cost 1.95x one row's product, bench/README.md section 58). The float operations per (row, output)
// are the same, in the same order (by group): the same bits.
template <int M, int TB>
static void w4a8_tile(const uint8_t* w, const uint16_t* d, const uint16_t* mn, int64_t nb, const int8_t* xq,
                      const float* dx, const float* sx, float* y, int64_t G, int64_t ldy) {
  vf out[M][TB];
  int64_t at[TB];
  _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) at[t] = w4a8_group(nb + t, G);
  _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) out[r][t] = vf{};
  for (int64_t g = 0; g < G; ++g) {
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) {
      const uint8_t* p = w + (at[t] + g * IL) * 256;
      _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) __builtin_prefetch(p + 4096 + 64 * j);  // 4 KB ahead
      ivec wq[8];
      _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
        const ivec b = iv_load(p + 64 * j);
        wq[j] = iv_lo(b);
        wq[j + 4] = iv_hi(b);
      }
      const vf dt = load_h16(d + (at[t] + g * IL) * 16), mg = load_h16(mn + (at[t] + g * IL) * 16);
      _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r) {
        const int8_t* xr = xq + (r * G + g) * 32;
        ivec acc = iv_zero(), acc2 = iv_zero();  // two chains of dependent dot products, not one of 8 (exact sums)
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
          acc = iv_dot_quad(acc, wq[j], xr + 4 * j);
          acc2 = iv_dot_quad(acc2, wq[j + 4], xr + 16 + 4 * j);
        }
        out[r][t] = group_step(out[r][t], iv_add(acc, acc2), dt, mg, dx[r * G + g], sx[r * G + g]);
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
static void w4a8_tile(const uint8_t* w, const uint16_t* d, const uint16_t* mn, int64_t nb, const int8_t* xq,
                      const float* dx, const float* sx, float* y, int64_t G, int64_t ldy) {
  portable_tile<M, TB>(G, y, ldy,
    [&](int r, int t, int64_t g) {
      const uint8_t* p = w + (w4a8_group(nb + t, G) + g) * 256;  // IL = 1
      return lane_dots(xq + (r * G + g) * 32, [&](int l, int k) {
        const uint8_t v = p[64 * ((k % 16) / 4) + 4 * l + k % 4];
        return k < 16 ? v & 15 : v >> 4;
      });
    },
    [&](vf out, vf acc, int r, int t, int64_t g) {
      const int64_t at = w4a8_group(nb + t, G) + g;
      const vf dg = load_h16(d + at * 16) * dx[r * G + g], mg = load_h16(mn + at * 16);
      out = out + dg * acc;
      return out + mg * sx[r * G + g];
    });
}
#endif

// ---------------------------------------------------------------------------- int8 products on AMX tiles
// Intel Xeons since Sapphire Rapids multiply int8 matrices in tile registers (AMX-INT8): one TDPBSUD makes 16
// rows' integer sums over a group's 32 inputs for a block's 16 outputs (16 x 16 x 32 products), where the vector tile
// spends 128 VNNI dot products. The rows' group is the A tile as it lies in xq (16 rows of 32 bytes, K apart); a w4a8
// block's group of nibbles, unpacked, is the B tile as it is (row j: inputs 4j..4j+3 of each of the 16 outputs, the
// vector tile's wq[j]), a w8a8 block's group of bytes is one as it is stored (TDPBSSD); the sums come out as 16 rows
// of 16 int32, each row the vector tile's `acc` (exact integers either way), and the float step after them is the
// same function (`group_step`, `w8_step`): the same bits for every row, with or without the tiles
// (tests/drafter/model/test_kernels.py). Runs of 16 rows go through here (a prompt's prefill, a batch's verify pass:
// `amx_rows`); the rows left over and every call on a CPU without AMX, through the vector tiles.
static std::atomic<bool> amx_wanted{true};  // set_amx: off to time or test the vector tiles alone

#if defined(SPECLOOP_DOT_QUAD) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SPECLOOP_AMX 1
constexpr int64_t AMX_ROWS = 16;

// Linux lends the tile registers to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, kernel
// 5.16+); refused (an older kernel, a hypervisor that hides them): the vector tiles.
static bool amx_permitted() {
  static const bool ok = [] {
    constexpr long REQ = 0x1023, GET = 0x1022, XTILEDATA = 18;
    unsigned long granted = 0;
    return syscall(SYS_arch_prctl, REQ, XTILEDATA) == 0 && syscall(SYS_arch_prctl, GET, &granted) == 0 &&
           ((granted >> XTILEDATA) & 1) != 0;
  }();
  return ok;
}

// tileloadd with the memory it reads made known to the compiler (GCC's _tile_loadd names none: the stores that fill
// a tile's buffer could be dropped or moved past it).
#define AMX_LOAD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void*)(base)), "r"((long)(stride)) : "memory")

// The tile shapes `int8_amx` uses, loaded for the calling thread while alive and released after (a thread holding
// tile state has it saved and restored at every switch). tmm0, tmm3: 16 rows of a group (32 bytes a row); tmm1, tmm2:
// a block's group of weights (8 rows of 64 bytes); tmm4, tmm5: a block's 16 x 16 int32 sums. Two of each, taken in
// turn group by group: each of `rows` rows (16, or the 8-15 of a call that has no more).
class TileScope {
 public:
  explicit TileScope(int rows = AMX_ROWS) {
    alignas(64) uint8_t cfg[64] = {};
    cfg[0] = 1;  // palette 1
    auto shape = [&](int t, int rows, int bytes) { cfg[16 + 2 * t] = (uint8_t)bytes, cfg[48 + t] = (uint8_t)rows; };
    shape(0, rows, 32);
    shape(3, rows, 32);
    shape(1, 8, 64);
    shape(2, 8, 64);
    shape(4, rows, 64);
    shape(5, rows, 64);
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// Blocks nb..nb + TB - 1's weights unpacked as B tiles, [TB][G][512] bytes: row j of a group's tile (64 bytes) is
// the vector tile's wq[j], inputs 4j..4j+3 (j < 4: the low nibbles of chunk j; 16 + 4(j - 4).. the high ones). Once a
// tile of blocks, for all its runs of 16 rows.
static void unpack_w4a8(const uint8_t* w, int64_t nb, int TB, int64_t G, __m512i* wt) {
  for (int t = 0; t < TB; ++t) {
    const int64_t at = w4a8_group(nb + t, G);
    for (int64_t g = 0; g < G; ++g, wt += 8) {
      const uint8_t* p = w + (at + g * IL) * 256;
      for (int j = 0; j < 4; ++j) {
        const ivec b = iv_load(p + 64 * j);
        wt[j] = iv_lo(b);
        wt[j + 4] = iv_hi(b);
      }
    }
  }
}

// One group's product for 16 rows into sums tile c: A tile a from the rows' 32 bytes (K apart), B tile b from the
// block's group (512 bytes); `op` tdpbsud for w4a8's unsigned nibbles, tdpbssd for w8a8's signed bytes.
#define AMX_PRODUCT(op, a, b, c, rows, weights, K) \
  do {                                              \
    AMX_LOAD(a, rows, K);                           \
    AMX_LOAD(b, weights, 64);                       \
    _tile_zero(c);                                  \
    op(c, a, b);                                    \
  } while (0)

// Group g's sums for the 16 rows (a row each) scaled into their outputs: `group_step` (w4a8) or `w8_step` (w8a8).
// Unrolled, so that the outputs stay in registers (an array indexed at run time would live on the stack, and the tile
// instructions' memory clobbers would have every output stored and reloaded around each of them).
template <bool W8>
__attribute__((always_inline)) static inline void amx_scale(vf (&out)[AMX_ROWS], const int32_t* sums, vf dt, vf mg,
                                                           const float* dx, const float* sx, int64_t G,
                                                           int m = AMX_ROWS) {
  _Pragma("GCC unroll 16") for (int r = 0; r < AMX_ROWS; ++r) {
    if (r >= m) break;  // a call's 8-15 rows (`TileScope`)
    const ivec s = iv_load(reinterpret_cast<const uint8_t*>(sums + 16 * r));
    out[r] = W8 ? w8_step(out[r], iv_float(s), dt, dx[r * G]) : group_step(out[r], s, dt, mg, dx[r * G], sx[r * G]);
  }
}

// 16 rows (xq, dx, sx at the first row; rows K bytes / G groups apart) times TB blocks of 16 outputs into y: what the
// vector tile writes for these rows. The blocks' groups as B tiles in `bt`, [TB][G][512] bytes: w4a8's unpacked
// (`unpack_w4a8`, blocks nb.. of its weight), w8a8's as they are stored. The scales of block t's group g at
// d[(first(t) + g * step) * 16] (and w4a8's minimums at mn[...]): w4a8 first(t) = `w4a8_group(nb + t, G)`, step IL;
// w8a8 (d at block nb) t * G, step 1.
// Block by block, the 16 rows' outputs in registers, the groups in order. The groups' tile products alternate
// between two sets of tiles (even groups: tmm0, 1 -> 4; odd: tmm3, 2 -> 5), so that group g's product is issued before
// group g - 1's sums are stored and group g - 2's scaled (4 small buffers in L1).
// M: the rows, 16 (or 8-15 where the tiles were shaped so: `TileScope(M)`).
template <bool W8>
static void int8_amx(const uint8_t* bt, int TB, const uint16_t* d, const uint16_t* mn, int64_t nb, const int8_t* xq,
                     const float* dx, const float* sx, float* y, int64_t G, int64_t ldy, int64_t K, int M = AMX_ROWS) {
  alignas(64) int32_t sums[4][AMX_ROWS * 16];
  const int64_t step = W8 ? 1 : IL;
  for (int t = 0; t < TB; ++t) {
    const uint8_t* w = bt + t * G * 512;
    const int64_t at = W8 ? t * G : w4a8_group(nb + t, G);
    vf out[AMX_ROWS];
    _Pragma("GCC unroll 16") for (int r = 0; r < AMX_ROWS; ++r) out[r] = vf{};
#define AMX_SCALE(g)                                                                                            \
  amx_scale<W8>(out, sums[(g) & 3], load_h16(d + (at + (g) * step) * 16),                                       \
                W8 ? vf{} : load_h16(mn + (at + (g) * step) * 16), dx + (g), sx + (g), G, M)
#define AMX_GROUP(a, b, c, g)                                          \
  do {                                                                  \
    if (W8) AMX_PRODUCT(_tile_dpbssd, a, b, c, xq + (g) * 32, w + (g) * 512, K); \
    else AMX_PRODUCT(_tile_dpbsud, a, b, c, xq + (g) * 32, w + (g) * 512, K);    \
  } while (0)
    AMX_GROUP(0, 1, 4, 0);
    for (int64_t g = 1; g < G; g += 2) {  // groups g - 1 (even) and g (odd)
      AMX_GROUP(3, 2, 5, g);
      _tile_stored(4, sums[(g - 1) & 3], 64);
      if (g >= 2) AMX_SCALE(g - 2);
      if (g + 1 < G) AMX_GROUP(0, 1, 4, g + 1);
      _tile_stored(5, sums[g & 3], 64);
      AMX_SCALE(g - 1);
    }
    if (G % 2) {  // the last group is even: its product made, not stored
      _tile_stored(4, sums[(G - 1) & 3], 64);
      if (G >= 2) AMX_SCALE(G - 2);
    }
    AMX_SCALE(G - 1);
#undef AMX_GROUP
#undef AMX_SCALE
    for (int r = 0; r < M; ++r) std::memcpy(y + r * ldy + t * 16, &out[r], 64);
  }
}

#else
constexpr int64_t AMX_ROWS = 16;
static bool amx_permitted() { return false; }
#endif

#if !defined(SPECLOOP_AVX2_TILES)
// Where the tiles are AVX-512's (or lane by lane), they take every row.
static int64_t w4a8_many(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, const int8_t*,
                         const float*, const float*, float*, int64_t) {
  return 0;
}
#endif

// Whether w4a8 and w8a8 products run their rows on AMX tiles: wanted, built for a CPU that has them, and lent.
static bool amx_active() { return amx_wanted.load(std::memory_order_relaxed) && amx_permitted(); }

// The rows [0, n) of an R-row product that go through `int8_amx`: whole runs of 16, from `least` rows on (none
// without AMX). w4a8 from 32: at 16 rows unpacking a tile's weights once costs what the tiles save; w8a8's bytes are
// B tiles as they are stored, from 16 (bench/README.md section 60).
static int64_t amx_rows(int64_t R, int64_t least) {
  return amx_active() && R >= least ? R / AMX_ROWS * AMX_ROWS : 0;
}

// The rows past an R-row w8a8 product's runs of 16 (RA of them) that go through the tiles too: 8-15 of them (fewer
// cost the tiles more than the vector tiles), none without AMX. Where RA is 0 (a verify pass of 8-15 tokens' LM head)
// on tiles shaped for that many rows; else as one more run of 16, the last 16 rows, which computes some rows of the
// run before again (the same bits, written again).
static int amx_tail(int64_t R, int64_t RA) { return amx_active() && R - RA >= AMX_ROWS / 2 ? (int)(R - RA) : 0; }

bool set_amx(bool on) {
  amx_wanted.store(on, std::memory_order_relaxed);
  return amx_active();
}

bool amx_in_use() { return amx_active(); }

// One group of 32 fp32 values -> int8 (round half to even) with its dx = max|v| / 127 and sx = dx * sum(q).
static inline void quantize_group_q8(const float* v, int8_t* xq, float* dx, float* sx, int32_t* isum) {
  vn m = vn{};  // max |v| lane by lane: exact in any order; a NaN is passed over, as std::max(amax, NaN) passes it
  for (int i = 0; i < 32; i += NL) {  // (a scalar max is one dependent vmaxss a value: 23 % of a prefill's layer)
    const vn a = (vn)((vni)load_vn(v + i) & 0x7fffffff);
    m = a > m ? a : m;
  }
  float amax = 0.f;
  for (int l = 0; l < NL; ++l) amax = std::max(amax, m[l]);
  const float dd = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) {
    const int32_t q = (int32_t)std::nearbyint(v[i] * id);
    xq[i] = (int8_t)q;
    sum += q;
  }
  *dx = dd;
  *sx = dd * (float)sum;
  if (isum) *isum = sum;
}

// Rows [R, K] fp32 -> int8 per group of 32, with dx and sx per (row, group).
static void quantize_rows_q8(const float* x, int64_t R, int64_t K, int8_t* xq, float* dx, float* sx,
                             int32_t* isum = nullptr) {
  const int64_t G = K / 32;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      quantize_group_q8(x + r * K + g * 32, xq + r * K + g * 32, dx + r * G + g, sx + r * G + g,
                        isum ? isum + r * G + g : nullptr);
}

// A packed w4a8 weight as the region of a layer reads it (`w4a8_mm`'s layout).
struct W4A8 {
  const uint8_t* w;
  const uint16_t* d;
  const uint16_t* mn;
  int64_t NB, K;  // blocks of 16 outputs, inputs
};

// Output blocks [b0, b1) of every row of a w4a8 product (activations quantized: xq [R, K], dx / sx
// [R, K / 32]) into y (row stride ldy): whole tiles of UNIT blocks where the range holds them, single
// blocks at its ends. Each output is the same bits as `w4a8_mm`'s (a block's arithmetic does not depend
// on the tile or the rows beside it).
static void w4a8_blocks(const W4A8& L, int64_t R, const int8_t* xq, const float* dx, const float* sx, float* y,
                        int64_t ldy, int64_t b0, int64_t b1) {
  const int64_t G = L.K / 32, RA = amx_rows(R, 2 * AMX_ROWS);
#if defined(SPECLOOP_AMX)
  std::optional<TileScope> tiles;
  if (RA) tiles.emplace();
  std::vector<__m512i> wt(RA ? UNIT * G * 8 : 0);  // a tile's weights unpacked (`unpack_w4a8`)
#endif
  auto run = [&](int64_t nb, auto tb) {
    constexpr int TB = decltype(tb)::value;
#if defined(SPECLOOP_AMX)
    if (RA) unpack_w4a8(L.w, nb, TB, G, wt.data());
    for (int64_t r0 = 0; r0 < RA; r0 += AMX_ROWS)
      int8_amx<false>(reinterpret_cast<const uint8_t*>(wt.data()), TB, L.d, L.mn, nb, xq + r0 * L.K, dx + r0 * G,
                      sx + r0 * G, y + r0 * ldy + nb * 16, G, ldy, L.K);
#endif
    const int64_t RM = RA + w4a8_many(L.w, L.d, L.mn, L.K, nb, R - RA, xq + RA * L.K, dx + RA * G, sx + RA * G,
                                      y + RA * ldy + nb * 16, ldy);  // AVX2: TB = UNIT = 1
    by_rows(R - RM, [&](int64_t r, auto m) {
      const int64_t r0 = RM + r;
      w4a8_tile<decltype(m)::value, TB>(L.w, L.d, L.mn, nb, xq + r0 * L.K, dx + r0 * G, sx + r0 * G,
                                        y + r0 * ldy + nb * 16, G, ldy);
    });
  };
  int64_t nb = b0;
  for (; nb < b1 && (nb % UNIT != 0 || nb + UNIT > b1); ++nb) run(nb, std::integral_constant<int, 1>{});
  for (; nb + UNIT <= b1; nb += UNIT) run(nb, std::integral_constant<int, UNIT>{});
  for (; nb < b1; ++nb) run(nb, std::integral_constant<int, 1>{});
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
  const W4A8 L{wp, dp, mp, NB, K};
  at::parallel_for(0, NB / UNIT, TILE / UNIT, [&](int64_t t0, int64_t t1) {  // whole tiles a thread
    w4a8_blocks(L, R, qp, dxp, sxp, yp, ldy, t0 * UNIT, t1 * UNIT);
  });
  return y;
}

// The blocks a run of `w4a8_group`'s interleaved groups holds (kernels.pack_w4a8 lays the weights out so).
int64_t w4a8_interleave() { return IL; }

torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor mn, int64_t n) {
  return shaped(w4a8_mm(x, w, d, mn), x, n);
}

// ---------------------------------------------------------------------------- w8a8
// int8 weights in blocks of 32 with an fp16 scale each (GGUF Q8_0: w = q * d) times int8 activations
// as in w4a8: y[n] = sum_g (d dx) * sum_i q xq (llama.cpp's Q8_0 x Q8_0). Weights: [N/16, G, 8 chunks
// of 64 bytes]; in chunk j, lane l's 4 bytes b hold q[4j + b] of output l (q in [-127, 127]).
// s8_ready(w) once per weight vector, then s8_dot_quad(acc, ready, x) per row: acc += q times the 4 bytes at x in
// every lane (iv_dot_s8: the same with x broadcast already).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static constexpr int32_t W8_OFFSET = 128;  // dpbusd multiplies unsigned by signed: (q + 128) * xq
static inline ivec s8_ready(ivec w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); }
static inline ivec iv_dot_s8(ivec acc, ivec ready, ivec x) { return _mm512_dpbusd_epi32(acc, ready, x); }
#elif defined(__AVX512F__) && defined(__AVX512BW__)
static constexpr int32_t W8_OFFSET = 0;  // |x| times q with x's sign: no saturation for q, x in [-127, 127]
static inline ivec s8_ready(ivec w) { return w; }
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
static inline ivec s8_ready(ivec w) { return w; }
static inline ivec iv_dot_s8(ivec acc, ivec w, ivec x) { return {dot8_s8(acc.a, w.a, x.a), dot8_s8(acc.b, w.b, x.b)}; }
#endif
#if defined(SPECLOOP_W4A8)
static inline ivec s8_dot_quad(ivec acc, ivec ready, const int8_t* x) {
#if defined(SPECLOOP_DOT_QUAD)
  return iv_dot_quad(acc, ready, x);  // dpbusd with the quad read by the instruction
#else
  return iv_dot_s8(acc, ready, iv_bcast(quad_at(x)));
#endif
}
#endif

#if defined(SPECLOOP_AVX2_TILES)
// As w4a8's AVX2 tile: one block of 16 outputs at a time, every row's sums widened to int32 chunk by chunk
// (a signed pair's sum reaches 2 * 127 * 127: no room for more in int16).
template <int M, int TB>
static void w8a8_tile(const int8_t* w, const uint16_t* d, const int8_t* xq, const float* dx, const int32_t* isum,
                      float* y, int64_t G, int64_t ldy) {
  (void)isum;  // W8_OFFSET is 0 here: no correction
  for (int t = 0; t < TB; ++t) {
    __m256 out[M][2];
    for (int r = 0; r < M; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* p = w + (t * G + g) * 512;
      __m256 dg[2];
      h16x2(d + (t * G + g) * 16, dg[0], dg[1]);
      for (int r = 0; r < M; ++r) {
        const int8_t* xr = xq + (r * G + g) * 32;
        __m256i sa = _mm256_setzero_si256(), sb = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i xb = bcast_quad(xr + 4 * j);
          sa = dot8_s8(sa, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j)), xb);
          sb = dot8_s8(sb, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32)), xb);
        }
        acc_scaled(out[r], sa, sb, dg, dx[r * G + g]);
      }
    }
    for (int r = 0; r < M; ++r) {
      _mm256_storeu_ps(y + r * ldy + t * 16, out[r][0]);
      _mm256_storeu_ps(y + r * ldy + t * 16 + 8, out[r][1]);
    }
  }
}
#elif defined(SPECLOOP_W4A8)
// As w4a8's AVX-512 tile: block by block within a group, one block's 8 weight vectors (made ready once) serving every
// row; the float operations per (row, output) the same, in the same order.
template <int M, int TB>
static void w8a8_tile(const int8_t* w, const uint16_t* d, const int8_t* xq, const float* dx, const int32_t* isum,
                      float* y, int64_t G, int64_t ldy) {
  vf out[M][TB];
  _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r)
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) out[r][t] = vf{};
  for (int64_t g = 0; g < G; ++g) {
    _Pragma("GCC unroll 8") for (int t = 0; t < TB; ++t) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(w) + (t * G + g) * 512;
      ivec wr[8];
      _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) wr[j] = s8_ready(iv_load(p + 64 * j));
      const vf dt = load_h16(d + (t * G + g) * 16);
      _Pragma("GCC unroll 8") for (int r = 0; r < M; ++r) {
        const int8_t* xr = xq + (r * G + g) * 32;
        ivec acc = iv_zero(), acc2 = iv_zero();  // two chains of dependent dot products (exact sums)
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
          acc = s8_dot_quad(acc, wr[j], xr + 4 * j);
          acc2 = s8_dot_quad(acc2, wr[j + 4], xr + 16 + 4 * j);
        }
        const vf corr = vf{} + (float)(W8_OFFSET * isum[r * G + g]);  // exact: |value| < 2^24, as is the difference
        out[r][t] = w8_step(out[r][t], iv_float(iv_add(acc, acc2)) - corr, dt, dx[r * G + g]);
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

// A row's first maximum as numpy's argmax finds it (strictly greater replaces, so the first of equal maxima stays):
// its value, its index (-1: none yet) and whether a NaN was met (numpy's argmax would answer the first NaN: the
// caller reads that one from the logits).
struct SpanMax {
  float v;
  int64_t i;
  bool nan;
};
static inline SpanMax span_max_scalar(const float* y, int64_t c0, int64_t c1, SpanMax s) {
  for (int64_t c = c0; c < c1; ++c) {
    const float v = y[c];
    if (v != v) s.nan = true;
    if (s.i < 0 || v > s.v) { s.v = v; s.i = c; }
  }
  return s;
}

// `later` (indices after all of `first`'s) merged into `first`: it replaces only a strictly greater maximum.
static inline SpanMax merged(SpanMax first, SpanMax later) {
  first.nan = first.nan || later.nan;
  if (later.i >= 0 && (first.i < 0 || later.v > first.v)) first.v = later.v, first.i = later.i;
  return first;
}

// The same lane by lane (each lane keeps its first maximum; then the lanes' largest value at its smallest index), fed
// the outputs a few tiles at a time right after the tiles wrote them, while they are in L1: read at the end of a
// thread's share instead, after its weights streamed through the cache, 49,152 logits cost ~36 µs on two cores.
struct Lanes {
  vn best;
  vni at, bad;
  bool any = false;
  SpanMax tail{0.0f, -1, false};  // a row's last values past its whole vectors (n cuts a vector)

  void scan(const float* y, int64_t c0, int64_t c1) {  // columns [c0, c1) of row y; c0 a multiple of NL
    const int64_t ve = c0 + std::max<int64_t>(c1 - c0, 0) / NL * NL;
    vni iota;
    for (int l = 0; l < NL; ++l) iota[l] = l;
    int64_t c = c0;
    if (!any && c < ve) {
      best = load_vn(y + c), at = iota + (int32_t)c, bad = best != best, any = true;
      c += NL;
    }
    vn b = best;
    vni a = at, nan = bad;
    for (; c < ve; c += NL) {
      const vn v = load_vn(y + c);
      nan |= v != v;
      const vni gt = v > b;
      b = gt ? v : b;
      a = gt ? iota + (int32_t)c : a;
    }
    best = b, at = a, bad = nan;
    if (ve < c1) tail = span_max_scalar(y, ve, c1, tail);
  }

  SpanMax max() const {
    SpanMax s{0.0f, -1, false};
    for (int l = 0; any && l < NL; ++l) {
      s.nan = s.nan || bad[l] != 0;
      if (s.i < 0 || best[l] > s.v || (best[l] == s.v && at[l] < s.i)) s.v = best[l], s.i = at[l];
    }
    return merged(s, tail);
  }
};

// x [R, K]; w [N/16, K/32 * 512] int8; d [N/16, K/32, 16] fp16 -> [R, N] fp32. With `choices` (R int64), also each
// row's argmax over its first n outputs, found tile by tile by the thread that wrote the tile, while it is in that
// thread's cache, then the tiles' maxima in order (the first of equal maxima; -1 for a row holding a NaN).
static torch::Tensor w8a8_product(const torch::Tensor& x_in, const torch::Tensor& w, const torch::Tensor& d, int64_t n,
                                  int64_t* choices) {
  const torch::Tensor x = rows_of(x_in);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kInt8 && d.scalar_type() == torch::kHalf);
  const int64_t R = x.size(0), K = x.size(1), NB = w.size(0), G = K / 32, T = NB / UNIT;
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
  const SpanMax none{0.0f, -1, false};
  struct Share {
    int64_t row, first;  // the share's first tile
    SpanMax max;
  };
  std::vector<Share> shares;  // each thread's share's maxima, a row each
  std::mutex taking;
  constexpr int64_t SCAN = 16;  // blocks of 16 outputs written, then scanned (1 KB a row: still in L1)
  const float* sxp = sx.data_ptr<float>();
  const int64_t RA = amx_rows(R, AMX_ROWS);  // rows whose sums come from AMX tiles (`int8_amx`)
  const int MT = amx_tail(R, RA);             // and the 8-15 after them (`amx_tail`)
  const int64_t RV = RA + MT;                 // rows from the vector tiles: [RV, R)
  const int M = RA ? (int)AMX_ROWS : MT;      // rows a tile holds
  at::parallel_for(0, T, 4 * TILE / UNIT, [&](int64_t t0, int64_t t1) {  // over_tiles<UNIT>'s split and order
#if defined(SPECLOOP_AMX)
    std::optional<TileScope> tiles;
    if (RV) tiles.emplace(M);
#endif
    std::vector<Lanes> lanes(choices ? R : 0);
    for (int64_t g0 = t0 * UNIT; g0 < t1 * UNIT; g0 += SCAN) {
      const int64_t g1 = std::min(g0 + SCAN, t1 * UNIT);
      for (int64_t nb = g0; nb < g1; nb += UNIT) {
#if defined(SPECLOOP_AMX)
        for (int64_t run = 0; run < RV; run += M) {
          const int64_t r0 = std::min(run, RV - M);  // runs of M rows, the last one ending at RV
          int8_amx<true>(reinterpret_cast<const uint8_t*>(wp + nb * G * 512), UNIT, dp + nb * G * 16, nullptr, nb,
                         qp + r0 * K, dxp + r0 * G, sxp + r0 * G, yp + r0 * ldy + nb * 16, G, ldy, K, M);
        }
#endif
        by_rows(R - RV, [&](int64_t r, auto m) {
          const int64_t r0 = RV + r;
          w8a8_tile<decltype(m)::value, UNIT>(wp + nb * G * 512, dp + nb * G * 16, qp + r0 * K, dxp + r0 * G,
                                              ip + r0 * G, yp + r0 * ldy + nb * 16, G, ldy);
        });
      }
      for (int64_t r = 0; choices && r < R; ++r) lanes[r].scan(yp + r * ldy, g0 * 16, std::min(g1 * 16, n));
    }
    if (!choices) return;
    std::lock_guard<std::mutex> hold(taking);
    for (int64_t r = 0; r < R; ++r) shares.push_back({r, t0, lanes[r].max()});
  });
  if (!choices) return y;
  std::sort(shares.begin(), shares.end(),
            [](const Share& a, const Share& b) { return a.row != b.row ? a.row < b.row : a.first < b.first; });
  std::vector<SpanMax> best(R, none);
  for (const Share& s : shares) best[s.row] = merged(best[s.row], s.max);  // in column order
  for (int64_t r = 0; r < R; ++r) choices[r] = best[r].nan ? -1 : best[r].i;
  return y;
}

torch::Tensor w8a8_mm(torch::Tensor x_in, torch::Tensor w, torch::Tensor d) { return w8a8_product(x_in, w, d, 0, nullptr); }

// `w8a8_linear` and each row's argmax over its n outputs (`w8a8_product`): a greedy step's choices without reading
// the logits back from the threads that wrote them (numpy's argmax over 49,152 logits after the LM head: ~160 µs cold
// on two cores, bench/README.md section 57). (y [..., n], choices [...] int64, whether no row held a NaN).
std::tuple<torch::Tensor, torch::Tensor, bool> w8a8_choose(torch::Tensor x, torch::Tensor w, torch::Tensor d,
                                                           int64_t n) {
  const int64_t R = x.numel() / x.size(-1);
  auto choices = torch::empty({R}, torch::kInt64);
  int64_t* cp = choices.data_ptr<int64_t>();
  const torch::Tensor y = shaped(w8a8_product(x, w, d, n, cp), x, n);
  bool every = true;
  for (int64_t r = 0; r < R; ++r) every = every && cp[r] >= 0;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return {y, choices.reshape(sizes), every};
}

torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, int64_t n) {
  return shaped(w8a8_mm(x, w, d), x, n);
}

// Rows `ids` (any shape, int64) of a `pack_w8a8` weight as q · d in fp32 -> [*ids.shape, K]: an embedding lookup,
// each value float(q) * float(d) (one product: the table's own values, as kernels.w8a8_rows_by_ops computes them)
// in one call where the step's first ops (index, divide, gather, scale) took ~0.15 ms on 2 cores.
torch::Tensor w8a8_rows(torch::Tensor w, torch::Tensor d, torch::Tensor ids_in) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kInt8 && d.is_contiguous() &&
              d.scalar_type() == torch::kHalf && d.dim() == 3 && d.size(2) == 16);
  const torch::Tensor ids = ids_in.reshape({-1}).to(torch::kInt64).contiguous();
  const int64_t G = d.size(1), K = G * 32, n = ids.numel(), N = w.size(0) * 16;
  TORCH_CHECK(w.size(1) == G * 512, "w8a8_rows: the weight's groups");
  auto y = torch::empty({n, K}, torch::kFloat32);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t id = ip[r], block = id / 16, lane = id % 16;
    TORCH_CHECK(id >= 0 && id < N, "w8a8_rows: id ", id, " outside the table's ", N, " rows");
    for (int64_t g = 0; g < G; ++g) {
      const float scale = static_cast<float>(dp[(block * G + g) * 16 + lane]);
      const int8_t* q = wp + block * G * 512 + g * 512 + lane * 4;  // chunk c of the group: + 64 c
      float* out = yp + r * K + g * 32;
      for (int c = 0; c < 8; ++c)
        for (int b = 0; b < 4; ++b) out[c * 4 + b] = static_cast<float>(q[c * 64 + b]) * scale;
    }
  }
  auto sizes = ids_in.sizes().vec();
  sizes.push_back(K);
  return y.view(sizes);
}
