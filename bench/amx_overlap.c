// Micro-benchmark behind bench/README.md section 60: what AMX tile instructions cost on this CPU, and whether they
// overlap with the AVX-512 float steps that scale a w4a8 product's integer sums (the kernels' `group_step`: convert,
// d * dx, two FMAs a row of 16 outputs). Each figure is ns per "group": one 16 x 16 x 32 tile product, its loads or
// its store, or 16 rows' float steps. Needs AMX-INT8 and Linux 5.16+.
//
//     gcc -O2 -march=native -o /tmp/amx_overlap bench/amx_overlap.c && /tmp/amx_overlap
#include <immintrin.h>
#include <stdalign.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define LOAD(t, b, s) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void*)(b)), "r"((long)(s)) : "memory")
#define N 1000000L

static alignas(64) int8_t rows[16 * 576];  // 16 rows of a 576-wide activation, a group at a time
static alignas(64) uint8_t weights[64][512];
static alignas(64) int32_t sums[4][256];
static float dx[256], sx[256];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// 16 rows' float steps on group sums s, as group_step (the outputs `out` in registers: a macro, not a function)
#define scale(s)                                                                                          \
  do {                                                                                                    \
    const int32_t* s_ = (s);                                                                              \
    const __m512 d = _mm512_set1_ps(0.5f), m = _mm512_set1_ps(0.25f);                                     \
    for (int r = 0; r < 16; ++r) {                                                                        \
      const __m512 dg = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * 16]));                                     \
      out[r] = _mm512_fmadd_ps(dg, _mm512_cvtepi32_ps(_mm512_load_si512(s_ + 16 * r)), out[r]);           \
      out[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * 16]), out[r]);                                    \
    }                                                                                                     \
  } while (0)

#define REPORT(what, body)                              \
  do {                                                  \
    const double t0 = now();                            \
    for (long i = 0; i < N; i += 2) { body; }           \
    printf("%-30s %6.2f ns a group\n", what, (now() - t0) / N * 1e9); \
  } while (0)

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    puts("no AMX tiles lent to this process");
    return 1;
  }
  alignas(64) uint8_t cfg[64] = {1};
  for (int t = 0; t < 8; ++t) cfg[16 + 2 * t] = 64, cfg[48 + t] = 16;
  cfg[16 + 0] = cfg[16 + 6] = 32;  // tmm0, tmm3: 16 rows of 32 bytes
  cfg[48 + 1] = cfg[48 + 2] = 8;   // tmm1, tmm2: 8 rows of 64 bytes
  _tile_loadconfig(cfg);
  __m512 out[16];
  for (int r = 0; r < 16; ++r) out[r] = _mm512_setzero_ps();
  memset(rows, 1, sizeof rows);
  memset(weights, 1, sizeof weights);
  LOAD(0, rows, 576);
  LOAD(3, rows, 576);
  LOAD(1, weights[0], 64);
  LOAD(2, weights[1], 64);
  REPORT("float steps", scale(sums[i & 3]); scale(sums[(i + 1) & 3]));
  REPORT("tile products", _tile_dpbsud(4, 0, 1); _tile_dpbsud(5, 3, 2));
  REPORT("tile products + float steps",
         _tile_dpbsud(4, 0, 1); scale(sums[i & 3]); _tile_dpbsud(5, 3, 2); scale(sums[(i + 1) & 3]));
  REPORT("tile stores", _tile_stored(4, sums[i & 3], 64); _tile_stored(5, sums[(i + 1) & 3], 64));
  REPORT("tile stores + float steps", _tile_stored(4, sums[i & 3], 64); scale(sums[(i + 2) & 3]);
         _tile_stored(5, sums[(i + 1) & 3], 64); scale(sums[(i + 3) & 3]));
  REPORT("tile loads", LOAD(0, rows + (i & 15) * 32, 576); LOAD(1, weights[i & 63], 64);
         LOAD(3, rows + ((i + 1) & 15) * 32, 576); LOAD(2, weights[(i + 1) & 63], 64));
  REPORT("tile loads + float steps", LOAD(0, rows + (i & 15) * 32, 576); LOAD(1, weights[i & 63], 64);
         scale(sums[i & 3]); LOAD(3, rows + ((i + 1) & 15) * 32, 576); LOAD(2, weights[(i + 1) & 63], 64);
         scale(sums[(i + 1) & 3]));
  _tile_release();
  // the same sums by VNNI: 8 vpdpbusd a row of 16 outputs, 128 a group (8 independent chains)
  __m512i a0 = _mm512_set1_epi32(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  REPORT("VNNI dot products (128)", for (int k = 0; k < 32; ++k) {
    a0 = _mm512_dpbusd_epi32(a0, w, x); a1 = _mm512_dpbusd_epi32(a1, w, x); a2 = _mm512_dpbusd_epi32(a2, w, x);
    a3 = _mm512_dpbusd_epi32(a3, w, x); a4 = _mm512_dpbusd_epi32(a4, w, x); a5 = _mm512_dpbusd_epi32(a5, w, x);
    a6 = _mm512_dpbusd_epi32(a6, w, x); a7 = _mm512_dpbusd_epi32(a7, w, x);
  });
  const __m512i all = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                       _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  __m512 total = _mm512_setzero_ps();
  for (int r = 0; r < 16; ++r) total = _mm512_add_ps(total, out[r]);
  printf("(checksums %g %d)\n", _mm512_reduce_add_ps(total), _mm512_reduce_add_epi32(all));
  return 0;
}
