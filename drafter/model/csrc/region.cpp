// A w4a8 decoder layer in one parallel region (`layer_region`): the threads go through the layer's steps
// together, a barrier between steps that read what another thread wrote, instead of one parallel region
// a step with the serial parts (RMSNorm, the activations' int8 rounding, RoPE of a single token), tensor
// allocations and the interpreter between them on one thread while the others wait.
//
// Every value is computed by the same function, in the same order, as the step-by-step path (`layer`'s
// `rms_norm`, `w4a8_linear`, `attend`, `silu_mul` and torch's adds): only which thread computes it and
// when change, so the output and the cache are the same bits (tests/drafter/model/test_kernels.py).
// What each thread takes: an even share of the step's units (rows, groups of 32 values, heads, blocks of
// 16 outputs), the products split by blocks rather than by tiles of 4, so that a 576-wide product's 36
// blocks go 18 and 18 instead of 20 and 16.
#include <omp.h>

#include "kernels.h"

namespace {

// The share [a, b) of n units that thread `tid` of `nt` takes: contiguous, even to one unit.
struct Share {
  int64_t a, b;
  Share(int64_t n, int tid, int nt) : a(n * tid / nt), b(n * (tid + 1) / nt) {}
};

// One step's buffers, carved from one allocation (floats; the int8 activations in their own stretch).
struct Work {
  float *hn, *dx, *sx, *qkv, *q, *att, *y, *h, *gu;
  int8_t* xq;
};

W4A8 w4a8_of(const torch::Tensor& w, const torch::Tensor& d, const torch::Tensor& mn, int64_t K, const char* what) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8 && d.is_contiguous() && mn.is_contiguous() &&
              d.scalar_type() == torch::kHalf && mn.scalar_type() == torch::kHalf, "layer: ", what, ": w4a8 parts");
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K / 32 * 256 && d.size(1) == K / 32, "layer: ", what, ": input width");
  return W4A8{w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
              reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>()), w.size(0), K};
}

// Group g of row r of rows [R, K] rounded to int8 as the next product's activations (xq, dx, sx).
void round_group(const float* rows, int64_t K, int64_t r, int64_t g, Work& k) {
  const int64_t G = K / 32;
  quantize_group_q8(rows + r * K + g * 32, k.xq + r * K + g * 32, k.dx + r * G + g, k.sx + r * G + g, nullptr);
}

// Rows [r0, r1) of x [R, n]: RMSNorm into hn, then rounded to int8 for the next product.
void norm_rows(const float* x, const float* w, int64_t n, float eps, const Share& rows, Work& k) {
  for (int64_t r = rows.a; r < rows.b; ++r) {
    rms_norm_row(x + r * n, w, n, eps, k.hn + r * n);
    for (int64_t g = 0; g < n / 32; ++g) round_group(k.hn, n, r, g, k);
  }
}

// A product's blocks in `blocks` into k.y, then out = res + y over them (outputs below n): torch's `x + y`.
void product_add(const W4A8& L, int64_t R, const Share& blocks, const float* res, float* out, int64_t n, Work& k) {
  const int64_t ldy = L.NB * 16;
  w4a8_blocks(L, R, k.xq, k.dx, k.sx, k.y, ldy, blocks.a, blocks.b);
  const int64_t j0 = blocks.a * 16, j1 = std::min(blocks.b * 16, n);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = j0; j < j1; ++j) out[r * n + j] = res[r * n + j] + k.y[r * ldy + j];
}

}  // namespace

// `layer` for four w4a8 linears (qkv, o, gate_up, down), x [B, T, hidden] fp32: see the top of this file.
torch::Tensor layer_region(const torch::Tensor& x_in, const torch::Tensor& in_norm, const torch::Tensor& post_norm,
                           double eps_d, const std::vector<int64_t>& dims, const std::vector<torch::Tensor>& parts,
                           const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& cos,
                           const torch::Tensor& sin, const torch::Tensor& lens_in, int64_t H, double scale) {
  const torch::Tensor x = x_in.contiguous(), lens = lens_in.to(torch::kInt64).contiguous();
  const torch::Tensor nw1 = in_norm.to(torch::kFloat32).contiguous(), nw2 = post_norm.to(torch::kFloat32).contiguous();
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32, "layer: x [B, T, hidden] fp32");
  const int64_t B = x.size(0), T = x.size(1), Hd = x.size(2), R = B * T;
  const int64_t Hkv = kc.size(1), D = kc.size(3), I = dims[2] / 2, Wq = (H + 2 * Hkv) * D;
  TORCH_CHECK(Hd % 32 == 0 && nw1.numel() == Hd && nw2.numel() == Hd && dims[0] == Wq && dims[1] == Hd &&
              dims[2] == 2 * I && I % 32 == 0 && dims[3] == Hd && (H * D) % 32 == 0, "layer: widths");
  const W4A8 Lqkv = w4a8_of(parts[0], parts[1], parts[2], Hd, "qkv"), Lo = w4a8_of(parts[3], parts[4], parts[5], H * D, "o"),
             Lgu = w4a8_of(parts[6], parts[7], parts[8], Hd, "gate_up"), Ld = w4a8_of(parts[9], parts[10], parts[11], I, "down");
  TORCH_CHECK(Lqkv.NB * 16 >= Wq && Lo.NB * 16 >= Hd && Lgu.NB * 16 >= 2 * I && Ld.NB * 16 >= Hd, "layer: outputs");
  check_attend(Wq, kc, vc, cos, sin, lens, B, T, H);

  const int64_t wide = std::max({Hd, I, H * D}), ldq = Lqkv.NB * 16, ldgu = Lgu.NB * 16;
  const int64_t floats = R * (wide + 2 * (wide / 32) + ldq + 2 * H * D + std::max(Lo.NB, Ld.NB) * 16 + Hd + ldgu) +
                         (R * wide + 3) / 4;
  auto buf = torch::empty({floats}, x.options());
  auto out = torch::empty_like(x);
  Work k;
  float* p = buf.data_ptr<float>();
  auto take = [&](int64_t n) { float* at = p; p += n; return at; };
  k.hn = take(R * wide); k.dx = take(R * wide / 32); k.sx = take(R * wide / 32); k.qkv = take(R * ldq);
  k.q = take(R * H * D); k.att = take(R * H * D); k.y = take(R * std::max(Lo.NB, Ld.NB) * 16); k.h = take(R * Hd);
  k.gu = take(R * ldgu); k.xq = reinterpret_cast<int8_t*>(p);
  const float eps = (float)eps_d;
  const float *xp = x.data_ptr<float>(), *w1 = nw1.data_ptr<float>(), *w2 = nw2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int nt = at::get_num_threads();
  const Attn a = attn_of(k.qkv, ldq, cos.data_ptr<float>(), sin.data_ptr<float>(), k.q, kc.data_ptr<float>(),
                         vc.data_ptr<float>(), k.att, lens.data_ptr<int64_t>(), B, T, H, Hkv, kc.size(2), D,
                         (float)scale, nt);
  const int64_t GA = H * D / 32, GI = I / 32;

#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    static thread_local std::vector<float> s;  // scores
    norm_rows(xp, w1, Hd, eps, Share(R, tid, n), k);
#pragma omp barrier
    const Share qb(Lqkv.NB, tid, n);
    w4a8_blocks(Lqkv, R, k.xq, k.dx, k.sx, k.qkv, ldq, qb.a, qb.b);
#pragma omp barrier
    const Share ru(R * (H + Hkv), tid, n);
    for (int64_t u = ru.a; u < ru.b; ++u) rope_unit(a, u);
#pragma omp barrier
    const Share au(B * Hkv * a.tiles, tid, n);
    for (int64_t u = au.a; u < au.b; ++u) attn_unit(a, u, s);
#pragma omp barrier
    const Share ag(R * GA, tid, n);  // the attention's rows rounded group by group
    for (int64_t u = ag.a; u < ag.b; ++u) round_group(k.att, H * D, u / GA, u % GA, k);
#pragma omp barrier
    product_add(Lo, R, Share(Lo.NB, tid, n), xp, k.h, Hd, k);
#pragma omp barrier
    norm_rows(k.h, w2, Hd, eps, Share(R, tid, n), k);
#pragma omp barrier
    const Share gb(Lgu.NB, tid, n);
    w4a8_blocks(Lgu, R, k.xq, k.dx, k.sx, k.gu, ldgu, gb.a, gb.b);
#pragma omp barrier
    const Share sg(R * GI, tid, n);  // SwiGLU and the rounding for down, group by group
    for (int64_t u = sg.a; u < sg.b; ++u) {
      const int64_t r = u / GI, g = u % GI;
      silu_mul_span(k.gu + r * ldgu + g * 32, k.gu + r * ldgu + I + g * 32, k.hn + r * I + g * 32, 32);
      round_group(k.hn, I, r, g, k);
    }
#pragma omp barrier
    product_add(Ld, R, Share(Ld.NB, tid, n), k.h, op, Hd, k);
  }
  return out;
}
