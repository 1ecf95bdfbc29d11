// The element-wise steps of a layer (`rms_norm`, `silu_mul`), a whole decoder layer in one call
// (`layer`; region.cpp: its w4a8 form in one parallel region), and the Python module's bindings (the
// functions kernels.h declares).
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"

// ---------------------------------------------------------------------------- sampling

// torch's searchsorted(right=True) on one sorted row: the first index in [0, n) whose value exceeds v (n: none),
// the same comparisons in the same order (a NaN compares as torch's loop compares it).
static inline int64_t upper_bound_as_torch(const float* row, int64_t n, float v) {
  int64_t start = 0, end = n;
  while (start < end) {
    const int64_t mid = start + ((end - start) >> 1);
    if (!(row[mid] > v)) start = mid + 1; else end = mid;
  }
  return start;
}

// Inverse-CDF draws, one a row: probs [N, V] fp32 (need not sum to 1), u [N] -> [N] int64, the bits of
// `sampling.sample_by_ops` in one call instead of its ten ops (each cold after a forward): the cumulative sums
// as torch's CPU cumsum makes them (a double accumulator, each stored as a float), the target
// min(u * total, the float below total) in fp32 (a NaN propagating as torch.minimum's), the first index whose
// cumulative mass exceeds it, at most V - 1.
torch::Tensor sample_rows(torch::Tensor probs_in, torch::Tensor u_in) {
  TORCH_CHECK(probs_in.dim() == 2 && probs_in.scalar_type() == torch::kFloat32, "sample_rows: probs [N, V] fp32");
  const torch::Tensor probs = probs_in.contiguous(), u = u_in.reshape({-1}).to(torch::kFloat32).contiguous();
  const int64_t N = probs.size(0), V = probs.size(1);
  TORCH_CHECK(u.numel() == N && V > 0, "sample_rows: one uniform a row");
  auto out = torch::empty({N}, torch::kInt64);
  const float *pp = probs.data_ptr<float>(), *up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t a, int64_t e) {
    thread_local std::vector<float> cdf;  // kept between calls: no allocation (nor page faults) a step
    if ((int64_t)cdf.size() < V) cdf.resize(V);
    for (int64_t r = a; r < e; ++r) {
      double acc = 0.0;
      for (int64_t i = 0; i < V; ++i) { acc += pp[r * V + i]; cdf[i] = static_cast<float>(acc); }
      const float total = cdf[V - 1], below = std::nextafter(total, 0.0f), scaled = up[r] * total;
      const float target = std::isnan(scaled) || std::isnan(below) ? std::numeric_limits<float>::quiet_NaN()
                                                                     : (scaled < below ? scaled : below);
      op[r] = std::min(upper_bound_as_torch(cdf.data(), V, target), V - 1);
    }
  });
  return out;
}

// A step's sampled verdict in one call on the CPU (`rejection_rows`, plain or drafting), from the tempered weights
// exp((x - max) / t) of each position (the layers' own exp, 0 below e^-87; a NaN or no finite max: the row is not
// judged here and the caller takes the ops path), summed by blocks of SAMPLE_BLOCK in a fixed order (lanes in fp32,
// blocks in double). A draw: the target min(u * total, the float below total) in fp32, the block whose running sum
// first exceeds it found from the block sums, then the token inside it by a running sum (the block's last where
// rounding leaves none). The same verdicts as `sampling.warp` then `rejection.rejection_sample` except where a
// uniform falls within float rounding of an edge; each row computed alone, without a tensor a pass (bench/README.md
// sections 49-50).
constexpr int64_t SAMPLE_BLOCK = 256;

struct Scratch {  // a thread's buffers, kept between calls: no allocation (nor page faults) a step
  std::vector<float> w, r;  // a position's tempered weights, the residual
  std::vector<double> sums, rsums;  // their block sums
  void fit(int64_t V) {
    if ((int64_t)w.size() < V) { w.resize(V); r.resize(V); }
    const int64_t nb = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    if ((int64_t)sums.size() < nb) { sums.resize(nb); rsums.resize(nb); }
  }
};

// The max of x [V]; false where it holds a NaN or no finite max.
static inline bool row_max(const float* x, int64_t V, float& m) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t vec = V / NL * NL;
  vn mx = vn{} + ninf;
  vni bad = {};
  for (int64_t i = 0; i < vec; i += NL) {
    const vn v = load_vn(x + i);
    bad |= v != v;
    mx = v > mx ? v : mx;
  }
  m = ninf;
  bool nan = false;
  for (int l = 0; l < NL; ++l) { nan |= bad[l] != 0; m = std::max(m, mx[l]); }
  for (int64_t i = vec; i < V; ++i) { nan |= x[i] != x[i]; m = std::max(m, x[i]); }
  return !nan && std::isfinite(m);
}

// out[i] = f(i) over [0, V) (fv: the NL values from i, fs: the value at i, for a tail) and out's block sums (lanes in
// fp32, each block in double); the total.
template <typename FV, typename FS>
static inline double blockwise(int64_t V, float* out, double* sums, FV fv, FS fs) {
  const int64_t nb = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK, full = V / SAMPLE_BLOCK * SAMPLE_BLOCK;
  for (int64_t b = 0; b < full / SAMPLE_BLOCK; ++b) {
    vn acc = {};
    for (int64_t i = b * SAMPLE_BLOCK; i < (b + 1) * SAMPLE_BLOCK; i += NL) {
      const vn v = fv(i);
      std::memcpy(out + i, &v, sizeof(vn));
      acc += v;
    }
    double sum = 0.0;
    for (int l = 0; l < NL; ++l) sum += acc[l];
    sums[b] = sum;
  }
  if (full < V) {
    double sum = 0.0;
    for (int64_t i = full; i < V; ++i) sum += (out[i] = fs(i));
    sums[nb - 1] = sum;
  }
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) total += sums[b];
  return total;
}

// w = exp((x - m) * inv) and its block sums; the total.
static inline double tempered(const float* x, int64_t V, float m, float inv, float* w, double* sums) {
  const vn mv = vn{} + m, iv = vn{} + inv;
  return blockwise(V, w, sums, [&](int64_t i) { return exp_neg_of<vn, vni>((load_vn(x + i) - mv) * iv); },
                   [&](int64_t i) {
                     const float z = (x[i] - m) * inv;
                     return z < -87.0f ? 0.0f : std::exp(z);
                   });
}

// r = max(0, w * scale - q) (the residual norm(max(0, p - q)) before its norm) and its block sums; the total. q null:
// one-hot on the draft d (a lookup's), so r is w * scale but at d.
static inline double residual(const float* w, float scale, const float* q, int64_t d, int64_t V, float* r,
                              double* sums) {
  const vn sv = vn{} + scale, zero = {};
  if (q == nullptr) {
    double total = blockwise(V, r, sums, [&](int64_t i) { return load_vn(w + i) * sv; },
                             [&](int64_t i) { return w[i] * scale; });
    const float at = std::max(0.0f, w[d] * scale - 1.0f);
    sums[d / SAMPLE_BLOCK] -= (double)r[d] - at;
    total -= (double)r[d] - at;
    r[d] = at;
    return total;
  }
  return blockwise(V, r, sums, [&](int64_t i) {
                     const vn v = load_vn(w + i) * sv - load_vn(q + i);
                     return v > zero ? v : zero;
                   },
                   [&](int64_t i) { return std::max(0.0f, w[i] * scale - q[i]); });
}

// The inverse-CDF draw from weights w [V] (block sums `sums`, their total) with u.
static inline int64_t draw_weights(const float* w, const double* sums, int64_t V, double total, float u) {
  const int64_t nb = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
  const float tf = static_cast<float>(total), below = std::nextafter(tf, 0.0f), scaled = u * tf;
  const float target = std::isnan(scaled) ? std::numeric_limits<float>::quiet_NaN() : (scaled < below ? scaled : below);
  double before = 0.0;
  int64_t b = 0;
  for (; b < nb - 1 && !(static_cast<float>(before + sums[b]) > target); ++b) before += sums[b];
  const int64_t lo = b * SAMPLE_BLOCK, hi = std::min(V, lo + SAMPLE_BLOCK);
  for (int64_t i = lo; i < hi; ++i) {
    before += w[i];
    if (static_cast<float>(before) > target) return i;
  }
  return hi - 1;
}

// One row's verdict (`rejection_rows`; k = 0: a plain step's token): tok [K1] and its accepted count, false where it
// is not judged here.
static bool judge_row(const float* x, int64_t V, int64_t k, int64_t kb, float t, const int64_t* d, const float* q,
                      const float* u, int64_t* tok, int64_t& n, Scratch& s) {
  float m;
  n = 0;
  if (t == 0.0f) {  // greedy: the argmax at every position, drafts accepted while they equal it
    for (int64_t i = 0; i <= k; ++i) {
      if (!row_max(x + i * V, V, m)) return false;
      tok[i] = std::find(x + i * V, x + (i + 1) * V, m) - (x + i * V);
    }
    while (n < kb && d[n] == tok[n]) ++n;
    return true;
  }
  s.fit(V);
  const float inv = 1.0f / t;
  float* w = s.w.data();
  double* sums = s.sums.data();
  double total = 0.0;
  int64_t at = -1;  // the position whose weights w holds
  for (int64_t i = 0; i < kb; ++i) {  // accept draft i iff u_i * q_i(d_i) < p_i(d_i)
    if (d[i] < 0 || d[i] >= V || !row_max(x + i * V, V, m)) return false;
    total = tempered(x + i * V, V, m, inv, w, sums);
    at = i;
    const float p = static_cast<float>(w[d[i]] / total);
    if (!(u[i] * (q ? q[i * V + d[i]] : 1.0f) < p)) break;
    ++n;
  }
  if (at != n) {  // every draft accepted: the bonus position's weights
    if (!row_max(x + n * V, V, m)) return false;
    total = tempered(x + n * V, V, m, inv, w, sums);
  }
  int64_t emitted;
  if (n < kb) {  // a rejection: norm(max(0, p_n - q_n)), or p_n where that has no mass (p == q)
    const float* qn = q ? q + n * V : nullptr;
    const double rest = residual(w, static_cast<float>(1.0 / total), qn, d[n], V, s.r.data(), s.rsums.data());
    emitted = rest > 0.0 ? draw_weights(s.r.data(), s.rsums.data(), V, rest, u[k])
                         : draw_weights(w, sums, V, total, u[k]);
  } else {
    emitted = draw_weights(w, sums, V, total, u[k]);
  }
  for (int64_t i = 0; i < k; ++i) tok[i] = d[i];
  tok[n] = emitted;
  tok[k] = emitted;
  return true;
}

// Steps' verdicts in one call: logits [B, k + 1, V] fp32, t [B] (0: greedy), drafts [B, k] int64 (k = 0: a plain
// step, its token drawn or its argmax), q [B, k, V] fp32 (what they were drawn from; empty: one-hot on the drafts, a
// lookup's), u [B, k + 1], limit [B] (each row's own k <= k; empty: k) -> (tokens [B, k + 1], accepted [B], every
// row judged). `rejection.rejection_sample`'s rule, row by row.
std::tuple<torch::Tensor, torch::Tensor, bool> rejection_rows(torch::Tensor logits_in, torch::Tensor t_in,
                                                              torch::Tensor d_in, torch::Tensor q_in,
                                                              torch::Tensor u_in, torch::Tensor limit_in) {
  TORCH_CHECK(logits_in.dim() == 3 && logits_in.scalar_type() == torch::kFloat32 &&
              q_in.scalar_type() == torch::kFloat32, "rejection_rows: fp32 logits [B, k + 1, V] and q");
  const int64_t B = logits_in.size(0), K1 = logits_in.size(1), V = logits_in.size(2), k = K1 - 1;
  const torch::Tensor x = logits_in.contiguous(), t = t_in.reshape({-1}).to(torch::kFloat32).contiguous(),
                      d = d_in.to(torch::kInt64).contiguous(), q = q_in.contiguous(),
                      u = u_in.to(torch::kFloat32).contiguous(), limit = limit_in.to(torch::kInt64).contiguous();
  TORCH_CHECK(k >= 0 && t.numel() == B && d.numel() == B * k && (q.numel() == 0 || q.numel() == B * k * V) &&
              u.numel() == B * K1 && (limit.numel() == 0 || limit.numel() == B), "rejection_rows: shapes");
  auto tokens = torch::empty({B, K1}, torch::kInt64);
  auto accepted = torch::empty({B}, torch::kInt64);
  const float *xp = x.data_ptr<float>(), *tp = t.data_ptr<float>(), *up = u.data_ptr<float>();
  const float* qp = q.numel() ? q.data_ptr<float>() : nullptr;
  const int64_t *dp = d.data_ptr<int64_t>(), *lp = limit.numel() ? limit.data_ptr<int64_t>() : nullptr;
  int64_t *op = tokens.data_ptr<int64_t>(), *np = accepted.data_ptr<int64_t>();
  std::vector<char> judged(B, 0);
  at::parallel_for(0, B, 1, [&](int64_t a, int64_t e) {
    thread_local Scratch scratch;
    for (int64_t b = a; b < e; ++b) {
      const int64_t kb = lp ? std::max<int64_t>(0, std::min(lp[b], k)) : k;
      const float* qb = qp ? qp + b * k * V : nullptr;
      judged[b] = judge_row(xp + b * K1 * V, V, k, kb, tp[b], dp + b * k, qb, up + b * K1, op + b * K1, np[b], scratch);
    }
  });
  return {tokens, accepted, std::all_of(judged.begin(), judged.end(), [](char v) { return v != 0; })};
}

// ---------------------------------------------------------------------------- element-wise

// RMSNorm of one row xr [n] (n % 16 == 0) times w [n] into yr: the squares summed in one vector chain in
// order, lanes in a fixed tree; y = w * (x * r). What `rms_norm` and the layer's region compute per row.
static inline void rms_norm_row(const float* xr, const float* wp, int64_t n, float eps, float* yr) {
  vn acc[16 / NL] = {};  // lane l of the 16: acc[l / NL][l % NL]
  for (int64_t i = 0; i < n; i += 16)
    for (int c = 0; c < 16 / NL; ++c) { const vn v = load_vn(xr + i + c * NL); acc[c] = acc[c] + v * v; }
  float lanes[16];
  std::memcpy(lanes, acc, 64);
  const float inv = 1.0f / std::sqrt(hsum16(lanes) / (float)n + eps);
  for (int64_t i = 0; i < n; i += NL) store_vn(yr + i, load_vn(wp + i) * (load_vn(xr + i) * inv));
}

// silu(g) * u for count values (count % NL == 0) into y, lane by lane.
static inline void silu_mul_span(const float* g_in, const float* u_in, float* y, int64_t count) {
  for (int64_t i = 0; i < count; i += NL) {
    const vn g = load_vn(g_in + i), u = load_vn(u_in + i);
    const vn neg = g < 0.0f ? g : -g;          // -|g|
    const vn e = exp_neg_of<vn, vni>(neg);    // exp(-|g|)
    const vn s = (g < 0.0f ? e : vn{} + 1.0f) / (e + 1.0f);  // sigmoid(g)
    store_vn(y + i, g * s * u);
  }
}

// RMSNorm of every row of x [..., n] (any float dtype; n % 16 == 0) times w [n] -> fp32 [..., n].
torch::Tensor rms_norm(torch::Tensor x_in, torch::Tensor w_in, double eps) {
  const torch::Tensor x = rows_of(x_in), w = w_in.to(torch::kFloat32).contiguous();
  const int64_t R = x.size(0), n = x.size(1);
  TORCH_CHECK(n % 16 == 0 && w.numel() == n, "rms_norm: width");
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t a, int64_t e) {
    for (int64_t r = a; r < e; ++r) rms_norm_row(xp + r * n, wp, n, (float)eps, yp + r * n);
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
    for (int64_t r = a; r < e; ++r) silu_mul_span(xp + r * 2 * I, xp + r * 2 * I + I, yp + r * I, I);
  });
  auto sizes = x_in.sizes().vec();
  sizes.back() = I;
  return y.reshape(sizes).to(x_in.scalar_type());
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

// A SwiGLU decoder layer step by step, by the functions a step otherwise calls one by one (so the same
// bits): RMSNorm, q|k|v, attend (RoPE, KV write, attention), o + residual, RMSNorm, gate|up, SwiGLU,
// down + residual. x [B, T, hidden] fp32. kinds/dims: 4 linears (qkv, o, gate_up, down); parts: 3
// tensors per linear.
torch::Tensor layer_by_ops(torch::Tensor x, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
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

// A SwiGLU decoder layer in one call: four w4a8 linears and fp32 activations in one parallel region
// (region.cpp), any other kind step by step; the same bits either way.
torch::Tensor layer(torch::Tensor x, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                    std::vector<int64_t> kinds, std::vector<int64_t> dims, std::vector<torch::Tensor> parts,
                    torch::Tensor kc, torch::Tensor vc, torch::Tensor cos, torch::Tensor sin, torch::Tensor lens,
                    int64_t H, double scale) {
  TORCH_CHECK(kinds.size() == 4 && dims.size() == 4 && parts.size() == 12, "layer: 4 linears");
  if (region_layer(kinds, x))
    return layer_region(x, in_norm, post_norm, eps, dims, parts, kc, vc, cos, sin, lens, H, scale);
  return layer_by_ops(x, in_norm, post_norm, eps, kinds, dims, parts, kc, vc, cos, sin, lens, H, scale);
}

// Greedy picks over rows of logits [B, V] fp32 (a draft head's, `pick_greedy`): each row's first maximal index and
// its softmax probability 1 / Σ exp(x - max) (the sampled verdict's tempered weights at t = 1, whose weight at the
// max is exactly 1), in one call instead of an argmax and torch's gather, logsumexp and exp (~110 µs warm over 8,192
// logits on two cores). (col [B] int64, p [B] fp32), or nothing where a row holds a NaN or no finite max (the
// caller takes the ops path).
std::vector<torch::Tensor> greedy_rows(torch::Tensor logits_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == torch::kFloat32, "greedy_rows: logits [B, V] fp32");
  const torch::Tensor x = logits_in.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "greedy_rows: an empty row");
  auto col = torch::empty({B}, torch::kInt64);
  auto p = torch::empty({B}, torch::kFloat32);
  thread_local Scratch s;
  s.fit(V);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r) {
    const float* row = xp + r * V;
    float m;
    if (!row_max(row, V, m)) return {};
    col.data_ptr<int64_t>()[r] = std::find(row, row + V, m) - row;
    p.data_ptr<float>()[r] = static_cast<float>(1.0 / tempered(row, V, m, 1.0f, s.w.data(), s.sums.data()));
  }
  return {col, p};
}

// ---------------------------------------------------------------------------- the eagle head's draft

// One draft of the eagle head (drafter/kinds/eagle.py) in one call, by the functions its step-by-step path calls
// with specloop's kernels (so the same bits): from the feature z [B, d] and the drafted token's embedding e [B, d],
// x = fc([rms(z); rms(e)]), z' = x + down(silu(gate) * up) with [gate; up] = gate_up(rms(x)), and the logits over
// the head's vocabulary rows, head(rms(z')). norms: feature, token, mlp, out; kinds / dims / parts: fc, gate_up,
// down, head as `layer`'s. In situ the head's dozen ops each crossed the interpreter and torch's dispatch cold after a
// verifier step (bench/README.md section 56). Returns (z', logits).
std::vector<torch::Tensor> head_draft(torch::Tensor z, torch::Tensor e, std::vector<torch::Tensor> norms, double eps,
                                      std::vector<int64_t> kinds, std::vector<int64_t> dims,
                                      std::vector<torch::Tensor> parts) {
  TORCH_CHECK(norms.size() == 4 && kinds.size() == 4 && dims.size() == 4 && parts.size() == 12,
              "head_draft: 4 norms, 4 linears");
  auto lin = [&](const torch::Tensor& v, int i) {
    return linear_of(v, kinds[i], parts[3 * i], parts[3 * i + 1], parts[3 * i + 2], dims[i]);
  };
  const torch::Tensor x = lin(torch::cat({rms_norm(z, norms[0], eps), rms_norm(e, norms[1], eps)}, -1), 0);
  const torch::Tensor next = x + lin(silu_mul(lin(rms_norm(x, norms[2], eps), 1)), 2);
  return {next, lin(rms_norm(next, norms[3], eps), 3)};
}

// ---------------------------------------------------------------------------- a stack of layers

// Every layer's `layer` arguments held once (weights, norms, RoPE tables), so that a step calls the C++ once
// a run of layers instead of once a layer from Python (the interpreter and the argument conversions took
// ~5 us a layer). Holds references to the tensors: the decoder builds a new stack when a weight changes.
struct LayerStack {
  std::vector<torch::Tensor> in_norms, post_norms;
  std::vector<std::vector<int64_t>> kinds, dims;
  std::vector<std::vector<torch::Tensor>> parts;
  torch::Tensor cos, sin;
  double eps, scale;
  int64_t H;

  // Layers [first, first + keys.size()) over x with their caches keys / values (that run's own), rows at lens.
  torch::Tensor forward(torch::Tensor x, const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                        const torch::Tensor& lens, int64_t first) const {
    TORCH_CHECK(keys.size() == values.size() && first >= 0 && first + (int64_t)keys.size() <= (int64_t)parts.size(),
                "LayerStack: layers");
    bool region = !keys.empty();
    for (size_t i = 0; i < keys.size(); ++i) region = region && region_layer(kinds[first + i], x);
    if (region) {  // all w4a8: the run in one parallel region (region.cpp)
      std::vector<const torch::Tensor*> n1, n2;
      std::vector<const std::vector<int64_t>*> d;
      std::vector<const std::vector<torch::Tensor>*> p;
      for (size_t i = 0; i < keys.size(); ++i) {
        n1.push_back(&in_norms[first + i]);
        n2.push_back(&post_norms[first + i]);
        d.push_back(&dims[first + i]);
        p.push_back(&parts[first + i]);
      }
      return stack_region(x, n1, n2, eps, d, p, keys, values, cos, sin, lens, H, scale);
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      const size_t l = first + i;
      x = layer(x, in_norms[l], post_norms[l], eps, kinds[l], dims[l], parts[l], keys[i], values[i], cos, sin, lens, H,
                scale);
    }
    return x;
  }
};

// ---------------------------------------------------------------------------- the Python module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_mm", torch::wrap_pybind_function(q4_mm), "q4_mm");
  m.def("q8_mm", torch::wrap_pybind_function(q8_mm), "q8_mm");
  m.def("q4_linear", torch::wrap_pybind_function(q4_linear), "q4_linear");
  m.def("q8_linear", torch::wrap_pybind_function(q8_linear), "q8_linear");
  m.def("attend", torch::wrap_pybind_function(attend), "attend");
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
  m.def("w4a8_mm", torch::wrap_pybind_function(w4a8_mm), "w4a8_mm");
  m.def("w4a8_linear", torch::wrap_pybind_function(w4a8_linear), "w4a8_linear");
  m.def("w4a8_interleave", &w4a8_interleave, "w4a8_interleave");
  m.def("set_amx", &set_amx, "set_amx");
  m.def("amx_in_use", &amx_in_use, "amx_in_use");
  m.def("w8a8_mm", torch::wrap_pybind_function(w8a8_mm), "w8a8_mm");
  m.def("w8a8_linear", torch::wrap_pybind_function(w8a8_linear), "w8a8_linear");
  m.def("w8a8_choose", torch::wrap_pybind_function(w8a8_choose), "w8a8_choose");
  m.def("w8a8_rows", torch::wrap_pybind_function(w8a8_rows), "w8a8_rows");
  m.def("sample_rows", torch::wrap_pybind_function(sample_rows), "sample_rows");
  m.def("rejection_rows", torch::wrap_pybind_function(rejection_rows), "rejection_rows");
  m.def("layer", torch::wrap_pybind_function(layer), "layer");
  m.def("layer_by_ops", torch::wrap_pybind_function(layer_by_ops), "layer_by_ops");
  m.def("head_draft", torch::wrap_pybind_function(head_draft), "head_draft");
  m.def("greedy_rows", torch::wrap_pybind_function(greedy_rows), "greedy_rows");
  // module_local: two builds in one process (bench/step_cost.py --baseline) each register their own type
  pybind11::class_<LayerStack>(m, "LayerStack", pybind11::module_local())
      .def(pybind11::init([](std::vector<torch::Tensor> in_norms, std::vector<torch::Tensor> post_norms,
                             std::vector<std::vector<int64_t>> kinds, std::vector<std::vector<int64_t>> dims,
                             std::vector<std::vector<torch::Tensor>> parts, torch::Tensor cos, torch::Tensor sin,
                             double eps, int64_t H, double scale) {
             TORCH_CHECK(in_norms.size() == parts.size() && post_norms.size() == parts.size() &&
                         kinds.size() == parts.size() && dims.size() == parts.size(), "LayerStack: one entry a layer");
             return LayerStack{in_norms, post_norms, kinds, dims, parts, cos, sin, eps, scale, H};
           }))
      .def("forward", &LayerStack::forward);
}
