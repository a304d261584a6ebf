// kestrel_cpu::kda_decode_step_: one decode token of a KDA layer for N sequences, from its q, k, v projections
// before the short conv to the gated output norm, the conv and recurrent states updated in place in their pools
// (kestrel.ops.cpu; the math is kestrel.ops.torch.kda_decode's, where the torch ops it replaces are ~45 per layer).
//
// Per sequence n and head h (one task), with C [W-1, 3HD] the conv state and S [D, D] the recurrent state of slot
// slots[n] (both read as zeros where use_state[n] is false, whatever the slot holds):
//   q, k, v = silu(the head's channels of the depthwise conv over the rows [C; x]);  C <- the last W-1 rows
//   q, k <- q, k / sqrt(|.|^2 + 1e-6);  g = the decay gate;  beta = sigmoid(beta_raw)
//   S <- diag(exp(g)) S;  S <- S + (beta k) (v - k^T S)^T;  o = scale q^T S
//   out = o * rsqrt(mean o^2 + eps) * norm_weight * sigmoid(out_gate)
// A first pass over S takes u = k^T diag(exp(g)) S, a second decays and updates S where it lies and takes o from the
// new rows as they are written, so the state crosses memory once each way.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

namespace kda_decode_step_kernel {

using Vec = at::vec::Vectorized<float>;
constexpr float L2_EPS = 1e-6f;  // kestrel.ops.torch.kda_decode.l2_normalize's

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// Whether t is float32 [rows, ...trailing] whose rows may be strided but hold their trailing dims contiguously.
bool rows_of(const at::Tensor& t, at::IntArrayRef trailing) {
  if (t.scalar_type() != at::kFloat || t.dim() != static_cast<int64_t>(trailing.size()) + 1) return false;
  int64_t stride = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != trailing[d - 1] || (t.size(d) > 1 && t.stride(d) != stride)) return false;
    stride *= t.size(d);
  }
  return true;
}

at::Tensor kda_decode_step(const at::Tensor& qkv, const at::Tensor& gate_raw, const at::Tensor& beta_raw,
                           const at::Tensor& out_gate, const at::Tensor& conv_weight, const at::Tensor& A_log,
                           const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                           std::optional<double> lower_bound, double norm_eps, at::Tensor& conv_pool,
                           at::Tensor& state_pool, const at::Tensor& slots, const at::Tensor& use_state,
                           double scale) {
  TORCH_CHECK(gate_raw.dim() == 3, "kda_decode_step_: gate_raw must be [N, H, D]");
  const int64_t num_seqs = qkv.size(0), heads = gate_raw.size(1), dim = gate_raw.size(2);
  const int64_t channels = 3 * heads * dim, width = conv_weight.size(-1), keep = width - 1;
  TORCH_CHECK(rows_of(qkv, {channels}) && rows_of(gate_raw, {heads, dim}) && rows_of(beta_raw, {heads}) &&
              rows_of(out_gate, {heads, dim}) && gate_raw.size(0) == num_seqs && beta_raw.size(0) == num_seqs &&
              out_gate.size(0) == num_seqs,
              "kda_decode_step_: qkv [N, 3*H*D], gate_raw and out_gate [N, H, D] and beta_raw [N, H] must be float32 "
              "rows with contiguous trailing dims");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&conv_weight, &A_log, &dt_bias, &norm_weight,
                                                                     &conv_pool, &state_pool})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "kda_decode_step_: the parameters and pools must be contiguous float32");
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == channels && width >= 1 && A_log.numel() == heads &&
              dt_bias.numel() == heads * dim && norm_weight.numel() == dim && conv_pool.dim() == 3 &&
              conv_pool.size(1) == keep && conv_pool.size(2) == channels && state_pool.dim() == 4 &&
              state_pool.size(0) == conv_pool.size(0) && state_pool.size(1) == heads && state_pool.size(2) == dim &&
              state_pool.size(3) == dim,
              "kda_decode_step_: conv_weight [3*H*D, W], A_log [H], dt_bias [H*D], norm_weight [D], conv_pool "
              "[slots, W-1, 3*H*D], state_pool [slots, H, D, D]");
  TORCH_CHECK(dim % Vec::size() == 0, "kda_decode_step_: D must be a multiple of ", Vec::size());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == num_seqs && use_state.scalar_type() == at::kBool &&
              use_state.numel() == num_seqs, "kda_decode_step_: slots int64 [N], use_state bool [N]");
  const at::Tensor slot_ids = slots.contiguous(), keep_state = use_state.contiguous();
  const int64_t* slot = slot_ids.data_ptr<int64_t>();
  for (int64_t n = 0; n < num_seqs; ++n)
    TORCH_CHECK(slot[n] >= 0 && slot[n] < state_pool.size(0), "kda_decode_step_: slot ", slot[n], " out of range");
  at::Tensor out = at::empty({num_seqs, heads, dim}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  const float *xp = qkv.data_ptr<float>(), *gp = gate_raw.data_ptr<float>(), *bp = beta_raw.data_ptr<float>(),
              *ogp = out_gate.data_ptr<float>(), *wp = conv_weight.data_ptr<float>(), *ap = A_log.data_ptr<float>(),
              *dtp = dt_bias.data_ptr<float>(), *nwp = norm_weight.data_ptr<float>();
  const int64_t x_row = qkv.stride(0), g_row = gate_raw.stride(0), b_row = beta_raw.stride(0),
                og_row = out_gate.stride(0);
  const bool* kept = keep_state.data_ptr<bool>();
  float *cp = conv_pool.data_ptr<float>(), *sp = state_pool.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t blocks = dim / Vec::size();
  at::parallel_for(0, num_seqs * heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> act(3 * dim), decay(dim);
    std::vector<Vec> residual(blocks), o(blocks);
    for (int64_t task = first; task < last; ++task) {
      const int64_t n = task / heads, h = task % heads;
      const bool fresh = !kept[n];
      float* conv_state = cp + slot[n] * keep * channels;
      for (int64_t part = 0; part < 3; ++part) {      // the conv of the head's q, k, v channels, its state shifted
        for (int64_t i = 0; i < dim; ++i) {
          const int64_t c = part * heads * dim + h * dim + i;
          const float* w = wp + c * width;
          const float x = xp[n * x_row + c];
          float y = w[keep] * x;
          for (int64_t j = 0; j < keep; ++j) {
            const float held = fresh ? 0.f : conv_state[j * channels + c];
            y += w[j] * held;
            if (j > 0) conv_state[(j - 1) * channels + c] = held;
          }
          if (keep > 0) conv_state[(keep - 1) * channels + c] = x;
          act[part * dim + i] = y * sigmoid(y);
        }
      }
      float* q = act.data();
      float* k = q + dim;
      const float* v = k + dim;
      for (float* t : std::initializer_list<float*>{q, k}) {
        float squares = 0.f;
        for (int64_t i = 0; i < dim; ++i) squares += t[i] * t[i];
        const float r = 1.f / std::sqrt(squares + L2_EPS);
        for (int64_t i = 0; i < dim; ++i) t[i] *= r;
      }
      const float rate = std::exp(ap[h]);
      const float* raw = gp + n * g_row + h * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float x = raw[i] + dtp[h * dim + i];
        const float g = lower_bound ? static_cast<float>(*lower_bound) * sigmoid(rate * x)
                                    : -rate * (x > 20.f ? x : std::log1p(std::exp(x)));    // torch's softplus
        decay[i] = std::exp(g);
      }
      const float beta = sigmoid(bp[n * b_row + h]);
      float* s = sp + (slot[n] * heads + h) * dim * dim;
      for (int64_t b = 0; b < blocks; ++b) residual[b] = Vec::loadu(v + b * Vec::size());
      if (!fresh) {                                   // residual = v - k^T diag(decay) S
        for (int64_t i = 0; i < dim; ++i) {
          const Vec weight(k[i] * decay[i]);
          for (int64_t b = 0; b < blocks; ++b)
            residual[b] = residual[b] - weight * Vec::loadu(s + i * dim + b * Vec::size());
        }
      }
      for (int64_t b = 0; b < blocks; ++b) o[b] = Vec(0.f);
      for (int64_t i = 0; i < dim; ++i) {             // S_i = decay_i S_i + beta k_i residual; o += scale q_i S_i
        const Vec keep_i(fresh ? 0.f : decay[i]), update(beta * k[i]), read(static_cast<float>(scale) * q[i]);
        for (int64_t b = 0; b < blocks; ++b) {
          float* row = s + i * dim + b * Vec::size();
          const Vec old = fresh ? Vec(0.f) : Vec::loadu(row);
          const Vec updated = at::vec::fmadd(update, residual[b], keep_i * old);
          updated.store(row);
          o[b] = at::vec::fmadd(read, updated, o[b]);
        }
      }
      float* y = op + task * dim;
      for (int64_t b = 0; b < blocks; ++b) o[b].store(y + b * Vec::size());
      float squares = 0.f;                            // the gated RMSNorm
      for (int64_t i = 0; i < dim; ++i) squares += y[i] * y[i];
      const float r = 1.f / std::sqrt(squares / dim + static_cast<float>(norm_eps));
      const float* gate = ogp + n * og_row + h * dim;
      for (int64_t i = 0; i < dim; ++i) y[i] = y[i] * r * nwp[i] * sigmoid(gate[i]);
    }
  });
  return out;
}

}  // namespace kda_decode_step_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("kda_decode_step_(Tensor qkv, Tensor gate_raw, Tensor beta_raw, Tensor out_gate, Tensor conv_weight, "
        "Tensor A_log, Tensor dt_bias, Tensor norm_weight, float? lower_bound, float norm_eps, Tensor(a!) conv_pool, "
        "Tensor(b!) state_pool, Tensor slots, Tensor use_state, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("kda_decode_step_", &kda_decode_step_kernel::kda_decode_step); }
