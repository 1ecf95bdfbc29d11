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
//
// The threads meet at barriers of their own (`Barrier`), not OpenMP's: libgomp spins only ~100 times before it
// puts a waiting thread to sleep once the process holds more of its threads than it has CPUs, which a second
// thread that ever ran a parallel region is enough for (a Ray actor loads the model on its main thread and decodes
// on another): measured on 2 cores, a one-token step from such a thread took 12.7 ms against 5.2 ms, each of its
// ~300 barriers a sleep and a wake-up. A run of layers (`stack_region`, LayerStack) is one parallel region.
#include <omp.h>

#include <atomic>
#include <sched.h>

#include "kernels.h"

namespace {

// The share [a, b) of n units that thread `tid` of `nt` takes: contiguous, even to one unit.
struct Share {
  int64_t a, b;
  Share(int64_t n, int tid, int nt) : a(n * tid / nt), b(n * (tid + 1) / nt) {}
};

// A barrier for the `n` threads of one parallel region: the last to arrive opens the next generation; the others
// spin (a pause an iteration) for 30-100 µs (not at all with more threads than CPUs), then sleep on the generation
// (a futex: std::atomic::wait) until the last one wakes them, so that a thread the scheduler took away (more threads
// than cores, or another process's turn) costs the others a sleep, not a spin of a whole time slice. acq_rel on the count and release / acquire on the
// generation: what a thread wrote before the barrier is seen by every thread after it.
class Barrier {
 public:
  // Every thread of the region says how many they are before its first wait (all say the same: a region
  // nested in another one runs on fewer threads than asked for).
  void join(int n) { n_.store(n, std::memory_order_relaxed); }
  void wait() {
    const int g = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_.load(std::memory_order_relaxed) - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      gen_.notify_all();  // wakes the threads that stopped spinning (none: no system call)
      return;
    }
    for (int64_t i = 0, spins = n_.load(std::memory_order_relaxed) <= cpus() ? SPINS : 0; i < spins; ++i) {
      if (gen_.load(std::memory_order_acquire) != g) return;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    while (gen_.load(std::memory_order_acquire) == g) gen_.wait(g, std::memory_order_acquire);
  }

 private:
  static constexpr int64_t SPINS = 2000;  // a pause is ~40-140 cycles: 30-100 µs on current x86 cores
  // the CPUs this process may run on: with more threads than that, some are always waiting for a core, and a
  // spinning thread only delays them (no spin then: straight to sleep)
  static int cpus() {
    static const int n = [] {
      cpu_set_t set;
      return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    }();
    return n;
  }
  std::atomic<int> n_{1};
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> gen_{0};
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

// A w4a8 layer ready to run: its weights, norms, attention and where its input and output rows are.
struct Plan {
  W4A8 qkv, o, gu, down;
  Attn a;
  const float *x, *w1, *w2;
  float* out;
  int64_t R, Hd, I, HD, ldq, ldgu;
  float eps;
};

// The floats of a layer's step buffers (`carve`).
int64_t work_floats(const Plan& L) {
  const int64_t wide = std::max({L.Hd, L.I, L.HD}), R = L.R;
  return R * (wide + 2 * (wide / 32) + L.ldq + 2 * L.HD + std::max(L.o.NB, L.down.NB) * 16 + L.Hd + L.ldgu) +
         (R * wide + 3) / 4;
}

Work carve(float* p, const Plan& L) {
  const int64_t wide = std::max({L.Hd, L.I, L.HD}), R = L.R;
  auto take = [&](int64_t n) { float* at = p; p += n; return at; };
  Work k;
  k.hn = take(R * wide); k.dx = take(R * wide / 32); k.sx = take(R * wide / 32); k.qkv = take(R * L.ldq);
  k.q = take(R * L.HD); k.att = take(R * L.HD); k.y = take(R * std::max(L.o.NB, L.down.NB) * 16); k.h = take(R * L.Hd);
  k.gu = take(R * L.ldgu); k.xq = reinterpret_cast<int8_t*>(p);
  return k;
}

// Checks a layer's tensors and makes its plan (x and out: [B, T, hidden] fp32; the attention's buffers in `k`,
// filled in by `with_work`).
Plan plan_of(const torch::Tensor& x, const torch::Tensor& nw1, const torch::Tensor& nw2, double eps_d,
             const std::vector<int64_t>& dims, const std::vector<torch::Tensor>& parts, const torch::Tensor& kc,
             const torch::Tensor& vc, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& lens,
             int64_t H, double scale, const torch::Tensor& out, int nt, const Attn* like = nullptr) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "layer: x [B, T, hidden] fp32");
  const int64_t B = x.size(0), T = x.size(1), Hd = x.size(2), R = B * T;
  const int64_t Hkv = kc.size(1), D = kc.size(3), I = dims[2] / 2, Wq = (H + 2 * Hkv) * D;
  TORCH_CHECK(Hd % 32 == 0 && nw1.numel() == Hd && nw2.numel() == Hd && dims[0] == Wq && dims[1] == Hd &&
              dims[2] == 2 * I && I % 32 == 0 && dims[3] == Hd && (H * D) % 32 == 0, "layer: widths");
  Plan L{w4a8_of(parts[0], parts[1], parts[2], Hd, "qkv"), w4a8_of(parts[3], parts[4], parts[5], H * D, "o"),
         w4a8_of(parts[6], parts[7], parts[8], Hd, "gate_up"), w4a8_of(parts[9], parts[10], parts[11], I, "down"),
         Attn{}, x.data_ptr<float>(), nw1.data_ptr<float>(), nw2.data_ptr<float>(), out.data_ptr<float>(),
         R, Hd, I, H * D, 0, 0, (float)eps_d};
  TORCH_CHECK(L.qkv.NB * 16 >= Wq && L.o.NB * 16 >= Hd && L.gu.NB * 16 >= 2 * I && L.down.NB * 16 >= Hd, "layer: outputs");
  check_attend(Wq, kc, vc, cos, sin, lens, B, T, H);
  L.ldq = L.qkv.NB * 16;
  L.ldgu = L.gu.NB * 16;
  // the attention's buffers are the step buffers' (`with_work` points them there)
  L.a = attn_of(nullptr, L.ldq, cos.data_ptr<float>(), sin.data_ptr<float>(), nullptr, kc.data_ptr(), vc.data_ptr(),
                kv_of(kc), nullptr, lens.data_ptr<int64_t>(), B, T, H, Hkv, kc.size(2), D,
                (float)scale, nt, like);
  return L;
}

Attn with_work(Attn a, const Work& k) {
  a.x = k.qkv;
  a.q = k.q;
  a.out = k.att;
  return a;
}

// Thread `tid` of `n` through a layer's ten steps, a barrier between steps that read what another thread wrote; `au`:
// its units of the attention (`attn_span`).
void run_layer(const Plan& L, Work& k, int tid, int n, const Span& au, Barrier& bar) {
  static thread_local std::vector<float> s;  // scores
  const Attn a = with_work(L.a, k);
  const int64_t R = L.R, GA = L.HD / 32, GI = L.I / 32;
  norm_rows(L.x, L.w1, L.Hd, L.eps, Share(R, tid, n), k);
  bar.wait();
  const Share qb(L.qkv.NB, tid, n);
  w4a8_blocks(L.qkv, R, k.xq, k.dx, k.sx, k.qkv, L.ldq, qb.a, qb.b);
  bar.wait();
  const Share ru(R * (a.H + a.Hkv), tid, n);
  for (int64_t u = ru.a; u < ru.b; ++u) rope_unit(a, u);
  bar.wait();
  for (int64_t u = au.a; u < au.b; ++u) attn_unit(a, u, s);
  bar.wait();
  const Share ag(R * GA, tid, n);  // the attention's rows rounded group by group
  for (int64_t u = ag.a; u < ag.b; ++u) round_group(k.att, L.HD, u / GA, u % GA, k);
  bar.wait();
  product_add(L.o, R, Share(L.o.NB, tid, n), L.x, k.h, L.Hd, k);
  bar.wait();
  norm_rows(k.h, L.w2, L.Hd, L.eps, Share(R, tid, n), k);
  bar.wait();
  const Share gb(L.gu.NB, tid, n);
  w4a8_blocks(L.gu, R, k.xq, k.dx, k.sx, k.gu, L.ldgu, gb.a, gb.b);
  bar.wait();
  const Share sg(R * GI, tid, n);  // SwiGLU and the rounding for down, group by group
  for (int64_t u = sg.a; u < sg.b; ++u) {
    const int64_t r = u / GI, g = u % GI;
    silu_mul_span(k.gu + r * L.ldgu + g * 32, k.gu + r * L.ldgu + L.I + g * 32, k.hn + r * L.I + g * 32, 32);
    round_group(k.hn, L.I, r, g, k);
  }
  bar.wait();
  product_add(L.down, R, Share(L.down.NB, tid, n), k.h, L.out, L.Hd, k);
}

// The plans' layers one after the other in one parallel region (a barrier between layers: the next reads every
// row of the last's output), through one set of step buffers.
void run_plans(const std::vector<Plan>& plans, const torch::Tensor& like) {
  int64_t floats = 0;
  for (const Plan& L : plans) floats = std::max(floats, work_floats(L));
  auto buf = torch::empty({floats}, like.options());
  const int nt = at::get_num_threads();
  Barrier bar;
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    bar.join(n);
    Span au;  // the thread's attention units, even in cost: worked out again only where a layer's units differ
    for (size_t l = 0; l < plans.size(); ++l) {
      Work k = carve(buf.data_ptr<float>(), plans[l]);
      const Attn& a = plans[l].a;
      const Attn& b = plans[l ? l - 1 : 0].a;  // the same lens and H in every layer of a stack
      if (l == 0 || a.per != b.per || a.tiles != b.tiles || a.Hkv != b.Hkv) au = attn_span(a, tid, n);
      if (l) bar.wait();
      run_layer(plans[l], k, tid, n, au, bar);
    }
  }
}

}  // namespace

// Layers of a LayerStack that are all w4a8 (`region_layer`), in one parallel region: layer l's output is layer
// l + 1's input; the same bits as one region a layer. Returns the last layer's output.
torch::Tensor stack_region(const torch::Tensor& x_in, const std::vector<const torch::Tensor*>& in_norms,
                           const std::vector<const torch::Tensor*>& post_norms, double eps,
                           const std::vector<const std::vector<int64_t>*>& dims,
                           const std::vector<const std::vector<torch::Tensor>*>& parts,
                           const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                           const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& lens_in, int64_t H,
                           double scale) {
  const torch::Tensor lens = lens_in.to(torch::kInt64).contiguous();
  const int nt = at::get_num_threads();
  std::vector<torch::Tensor> held;  // the layers' inputs and outputs, and their norms as fp32 (alive until the end)
  std::vector<Plan> plans;
  torch::Tensor x = x_in.contiguous();
  for (size_t i = 0; i < keys.size(); ++i) {
    const torch::Tensor nw1 = in_norms[i]->to(torch::kFloat32).contiguous(),
                        nw2 = post_norms[i]->to(torch::kFloat32).contiguous();
    auto out = torch::empty_like(x);
    const bool same = i > 0 && keys[i].sizes() == keys[0].sizes();  // the first layer's tiles (the same lengths)
    plans.push_back(plan_of(x, nw1, nw2, eps, *dims[i], *parts[i], keys[i], values[i], cos, sin, lens, H, scale, out, nt,
                            same ? &plans[0].a : nullptr));
    held.insert(held.end(), {x, nw1, nw2});
    x = out;
  }
  run_plans(plans, x);
  return x;
}

// `layer` for four w4a8 linears (qkv, o, gate_up, down), x [B, T, hidden] fp32: see the top of this file.
torch::Tensor layer_region(const torch::Tensor& x_in, const torch::Tensor& in_norm, const torch::Tensor& post_norm,
                           double eps_d, const std::vector<int64_t>& dims, const std::vector<torch::Tensor>& parts,
                           const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& cos,
                           const torch::Tensor& sin, const torch::Tensor& lens_in, int64_t H, double scale) {
  return stack_region(x_in, {&in_norm}, {&post_norm}, eps_d, {&dims}, {&parts}, {kc}, {vc}, cos, sin, lens_in, H, scale);
}
