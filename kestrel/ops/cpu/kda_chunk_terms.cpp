// kestrel_cpu::kda_chunk_terms: the intra-chunk terms of KDA's chunked prefill (kestrel.ops.torch.kda's
// IntraChunkTerms, which _intra_chunk_terms computes in ~150 torch ops) for B chunks of H heads, float32, one task
// per chunk and head.
//
// With G the cumulative log decay from the chunk start (G_i = g_0 + ... + g_i, per key channel d) and i, j < C:
//   attn_qk[i, j] = sum_d q[i,d] k[j,d] exp(G[i,d] - G[j,d]) for j <= i, else 0;  attn_kk alike with k's rows, j < i
//   A[i, j] = beta_i attn_kk[i, j];  (I + A) [W | U] = diag(beta) [k exp(G) | v], solved by forward substitution
//   q_decayed = q exp(G);  keys_to_end = k exp(G_last - G);  decay_total = exp(G_last)
// Rows are scored in blocks of one vector of tokens (8 with AVX2, 16 with AVX-512) by one product, since
// exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) for the block's first token r: its rows decayed to r (<= 1) against
// the keys j < r scaled by exp(G_r - G_j) <= 1 and its own keys by exp(G_r - G_j) <= exp(MAX_SPAN), so nothing
// overflows. A block whose decay spans more than MAX_SPAN (Kimi-Linear's unbounded gate) scores its own keys through
// the elementwise exponents instead (keys and G transposed, a vector of j per step).
// As in the torch terms, decay factors below exp(-30) and couplings below 1e-15 in magnitude are exactly zero (no
// subnormal numbers in the products). exp is ATen's exp_u20 (within 20 ulp of float32's).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace kda_chunk_terms_kernel {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t LANES = Vec::size();
constexpr float NEGLIGIBLE_LOG_DECAY = -30.f;  // kestrel.ops.torch.kda's
constexpr float NEGLIGIBLE = 1e-15f;
constexpr float MAX_SPAN = 40.f;               // a block whose decay spans at most this is scored as one product
constexpr int64_t TILE = 4;                    // vectors of keys per pass of a row's product

// exp(x), exactly zero where x <= floor; x is taken as at most MAX_SPAN (lanes above it, which callers discard,
// stay finite).
inline Vec factor(const Vec& x, float floor = NEGLIGIBLE_LOG_DECAY) {
  const Vec e = at::vec::clamp(x, Vec(floor), Vec(MAX_SPAN)).exp_u20();
  return Vec::blendv(Vec(0.f), e, x > Vec(floor));
}

// y[d] = x[d] * factor(to[d] - from[d], floor) * scale for d < n (from null: zeros).
inline void decayed(const float* x, const float* to, const float* from, float scale, float* y, int64_t n,
                    float floor = NEGLIGIBLE_LOG_DECAY) {
  for (int64_t d = 0; d < n; d += LANES) {
    const int64_t m = std::min(LANES, n - d);
    const Vec exponent = from ? Vec::loadu(to + d, m) - Vec::loadu(from + d, m) : Vec::loadu(to + d, m);
    (Vec::loadu(x + d, m) * factor(exponent, floor) * Vec(scale)).store(y + d, m);
  }
}

// y[d] -= sum_j a[j] x[j * stride + d] for j < count (j ascending), d < T * LANES, y held in registers.
template <int64_t T>
inline void subtract_tile(float* y, const float* a, const float* x, int64_t stride, int64_t count) {
  Vec acc[T];
  for (int64_t t = 0; t < T; ++t) acc[t] = Vec::loadu(y + t * LANES);
  for (int64_t j = 0; j < count; ++j) {
    if (a[j] == 0.f) continue;
    const Vec c(a[j]);
    for (int64_t t = 0; t < T; ++t) acc[t] = at::vec::fnmadd(c, Vec::loadu(x + j * stride + t * LANES), acc[t]);
  }
  for (int64_t t = 0; t < T; ++t) acc[t].store(y + t * LANES);
}

// subtract_tile over d < n (TILE vectors at a time, then the rest at once).
void subtract_rows(float* y, const float* a, const float* x, int64_t stride, int64_t count, int64_t n) {
  int64_t d = 0;
  for (; d + TILE * LANES <= n; d += TILE * LANES) subtract_tile<TILE>(y + d, a, x + d, stride, count);
  const int64_t rest = (n - d) / LANES;
  if (rest == 3) subtract_tile<3>(y + d, a, x + d, stride, count);
  if (rest == 2) subtract_tile<2>(y + d, a, x + d, stride, count);
  if (rest == 1) subtract_tile<1>(y + d, a, x + d, stride, count);
  for (d += rest * LANES; d < n; ++d)
    for (int64_t j = 0; j < count; ++j) y[d] -= a[j] * x[j * stride + d];
}

// line_q[j], line_k[j] = sum_d row_q[d] keys[d * P + j], sum_d row_k[d] keys[d * P + j] for j < T * LANES.
template <int64_t T>
inline void product_tile(const float* row_q, const float* row_k, const float* keys, int64_t P, int64_t K,
                         float* line_q, float* line_k) {
  Vec sum_q[T], sum_k[T];
  for (int64_t t = 0; t < T; ++t) sum_q[t] = sum_k[t] = Vec(0.f);
  for (int64_t d = 0; d < K; ++d) {
    const Vec a(row_q[d]), b(row_k[d]);
    for (int64_t t = 0; t < T; ++t) {
      const Vec key = Vec::loadu(keys + d * P + t * LANES);
      sum_q[t] = at::vec::fmadd(a, key, sum_q[t]);
      sum_k[t] = at::vec::fmadd(b, key, sum_k[t]);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    sum_q[t].store(line_q + t * LANES);
    sum_k[t].store(line_k + t * LANES);
  }
}

// One chunk and head's scratch: G [C, K] by rows; G and k transposed [K, P] (P: C rounded up to whole vectors, the
// padding zero); keys scaled by exp(G_r - G_j) for a block's first token r, transposed [K, P]; one row's two
// decayed rows [2, K] and scores [2, P]; attn_kk [C, C].
struct Scratch {
  int64_t padded;
  std::vector<float> G, GT, kT, keys, rows, line, kk;
  Scratch(int64_t C, int64_t K)
      : padded((C + LANES - 1) / LANES * LANES), G(C * K), GT(K * padded, 0.f), kT(K * padded, 0.f),
        keys(K * padded), rows(2 * K), line(2 * padded), kk(C * C) {}
};

// Rows i in [r, r + n) scored against the keys of their own block through the elementwise exponents (a vector of
// keys j per step): lanes j in [r, r + LANES) of line_q and line_k.
void score_block(const float* q, const float* k, Scratch& s, int64_t K, int64_t r, int64_t i) {
  const int64_t P = s.padded;
  Vec sum_q(0.f), sum_k(0.f);
  for (int64_t d = 0; d < K; ++d) {
    const Vec keys = Vec::loadu(&s.kT[d * P + r]) * factor(Vec(s.G[i * K + d]) - Vec::loadu(&s.GT[d * P + r]));
    sum_q = at::vec::fmadd(Vec(q[i * K + d]), keys, sum_q);
    sum_k = at::vec::fmadd(Vec(k[i * K + d]), keys, sum_k);
  }
  sum_q.store(&s.line[r]);
  sum_k.store(&s.line[P + r]);
}

// The scores of rows i in [r, r + n) (r a multiple of LANES, n <= LANES) into qk [C, C] and s.kk: one product of
// the rows decayed to r and the keys j < r scaled by exp(G_r - G_j) <= 1, and, where the block's decay spans at most
// MAX_SPAN, the keys of the block too (scaled by exp(G_r - G_j) <= exp(MAX_SPAN)); else those elementwise.
void score_rows(const float* q, const float* k, Scratch& s, int64_t C, int64_t K, int64_t r, int64_t n, float* qk) {
  const int64_t P = s.padded;
  const float* G_r = &s.G[r * K];
  float span = 0.f;
  for (int64_t d = 0; d < K; ++d) span = std::max(span, G_r[d] - s.G[(r + n - 1) * K + d]);
  const bool one_product = span <= MAX_SPAN;
  const int64_t width = one_product ? r + LANES : r;           // keys in the product
  for (int64_t d = 0; d < K; ++d) {
    const Vec to(G_r[d]);
    for (int64_t j = 0; j < width; j += LANES)
      (Vec::loadu(&s.kT[d * P + j]) * factor(to - Vec::loadu(&s.GT[d * P + j]))).store(&s.keys[d * P + j]);
  }
  // rows decayed to r: exponents >= -span, so kept whole in one product (no flush: nothing is subnormal)
  const float floor = one_product ? -std::numeric_limits<float>::infinity() : NEGLIGIBLE_LOG_DECAY;
  float *row_q = s.rows.data(), *row_k = row_q + K, *line_q = s.line.data(), *line_k = line_q + P;
  for (int64_t i = r; i < r + n; ++i) {
    decayed(q + i * K, &s.G[i * K], G_r, 1.f, row_q, K, floor);
    decayed(k + i * K, &s.G[i * K], G_r, 1.f, row_k, K, floor);
    int64_t j = 0;
    for (; j + TILE * LANES <= width; j += TILE * LANES)
      product_tile<TILE>(row_q, row_k, &s.keys[j], P, K, line_q + j, line_k + j);
    const int64_t rest = (width - j) / LANES;
    if (rest == 3) product_tile<3>(row_q, row_k, &s.keys[j], P, K, line_q + j, line_k + j);
    if (rest == 2) product_tile<2>(row_q, row_k, &s.keys[j], P, K, line_q + j, line_k + j);
    if (rest == 1) product_tile<1>(row_q, row_k, &s.keys[j], P, K, line_q + j, line_k + j);
    if (!one_product) score_block(q, k, s, K, r, i);
    std::copy(line_q, line_q + i + 1, qk + i * C);              // j <= i (the rest stays zero)
    std::copy(line_k, line_k + i, &s.kk[i * C]);                 // j < i
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_chunk_terms(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta) {
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4 && beta.dim() == 3,
              "kda_chunk_terms: q, k, g must be [B, H, C, K], v [B, H, C, V] and beta [B, H, C]");
  const int64_t B = q.size(0), H = q.size(1), C = q.size(2), K = q.size(3), V = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes() && v.size(0) == B && v.size(1) == H &&
              v.size(2) == C && beta.size(0) == B && beta.size(1) == H && beta.size(2) == C,
              "kda_chunk_terms: q, k, g must be [B, H, C, K], v [B, H, C, V] and beta [B, H, C]");
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "kda_chunk_terms: the operands must be contiguous float32");
  const auto options = q.options();
  at::Tensor q_decayed = at::empty({B, H, C, K}, options), attn_qk = at::zeros({B, H, C, C}, options),
             keys_to_values = at::empty({B, H, C, K}, options), values = at::empty({B, H, C, V}, options),
             keys_to_end = at::empty({B, H, C, K}, options), decay_total = at::empty({B, H, K}, options);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(),
              *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *qd = q_decayed.data_ptr<float>(), *qkp = attn_qk.data_ptr<float>(), *wp = keys_to_values.data_ptr<float>(),
        *up = values.data_ptr<float>(), *ep = keys_to_end.data_ptr<float>(), *tp = decay_total.data_ptr<float>();
  if (C == 0) return {q_decayed, attn_qk, keys_to_values, values, keys_to_end, decay_total};
  at::parallel_for(0, B * H, 1, [&](int64_t first, int64_t last) {
    Scratch s(C, K);
    const int64_t P = s.padded;
    const std::vector<float> ones(K, 1.f);
    for (int64_t task = first; task < last; ++task) {
      const float *qt = qp + task * C * K, *kt = kp + task * C * K, *gt = gp + task * C * K, *bt = bp + task * C;
      float *qk = qkp + task * C * C, *w = wp + task * C * K, *u = up + task * C * V;
      for (int64_t i = 0; i < C; ++i) {               // G, by rows and transposed, and k transposed
        for (int64_t d = 0; d < K; ++d) {
          const float cumulative = (i ? s.G[(i - 1) * K + d] : 0.f) + gt[i * K + d];
          s.G[i * K + d] = s.GT[d * P + i] = cumulative;
          s.kT[d * P + i] = kt[i * K + d];
        }
      }
      const float* G_last = &s.G[(C - 1) * K];
      for (int64_t i = 0; i < C; ++i) {
        const float* G_i = &s.G[i * K];
        decayed(qt + i * K, G_i, nullptr, 1.f, qd + (task * C + i) * K, K);
        decayed(kt + i * K, G_i, nullptr, bt[i], w + i * K, K);
        decayed(kt + i * K, G_last, G_i, 1.f, ep + (task * C + i) * K, K);
        for (int64_t e = 0; e < V; ++e) u[i * V + e] = bt[i] * vp[(task * C + i) * V + e];
      }
      decayed(ones.data(), G_last, nullptr, 1.f, tp + task * K, K);
      for (int64_t r = 0; r < C; r += LANES) score_rows(qt, kt, s, C, K, r, std::min(LANES, C - r), qk);
      for (int64_t i = 1; i < C; ++i) {               // (I + A) [W | U] = diag(beta) [k exp(G) | v], row by row
        float* a = &s.kk[i * C];                      // A[i, j < i], negligible couplings zero
        for (int64_t j = 0; j < i; ++j) a[j] = std::abs(bt[i] * a[j]) > NEGLIGIBLE ? bt[i] * a[j] : 0.f;
        subtract_rows(w + i * K, a, w, K, i, K);
        subtract_rows(u + i * V, a, u, V, i, V);
      }
    }
  });
  return {q_decayed, attn_qk, keys_to_values, values, keys_to_end, decay_total};
}

}  // namespace kda_chunk_terms_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("kda_chunk_terms(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("kda_chunk_terms", &kda_chunk_terms_kernel::kda_chunk_terms); }
