// kestrel_cpu::kda_state_step_: one token of KDA's delta rule for N sequences, their states updated in place in the
// pool (kestrel.ops.cpu).
//
// Per sequence n and head h, with S its state [K, V] (zeros where use_state[n] is false, whatever the slot holds):
//   S <- diag(exp(g)) S;  S <- S + (beta k) (v - k^T S)^T;  o = scale q^T S.
// Each (n, h) is one task: a first pass over S takes u = k^T diag(exp(g)) S, a second decays and updates S where it
// lies and takes o from the new rows as they are written, so the state crosses memory once each way (a 64 KiB
// float32 state at K = V = 128 stays in the core's cache between the passes).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

at::Tensor kda_state_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots,
                          const at::Tensor& use_state, double scale) {
  const int64_t num_seqs = q.size(0), heads = q.size(1), key_dim = q.size(2), value_dim = v.size(2);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &g, &v, &beta, &state})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "kda_state_step_: q, k, v, g, beta and state must be contiguous float32");
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes() && v.size(0) == num_seqs && v.size(1) == heads &&
              beta.size(0) == num_seqs && beta.size(1) == heads && state.dim() == 4 && state.size(1) == heads &&
              state.size(2) == key_dim && state.size(3) == value_dim,
              "kda_state_step_: q, k, g [N, H, K], v [N, H, V], beta [N, H], state [slots, H, K, V]");
  TORCH_CHECK(value_dim % Vec::size() == 0, "kda_state_step_: V must be a multiple of ", Vec::size());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == num_seqs && use_state.scalar_type() == at::kBool &&
              use_state.numel() == num_seqs, "kda_state_step_: slots int64 [N], use_state bool [N]");
  const at::Tensor slot_ids = slots.contiguous(), keep = use_state.contiguous();
  const int64_t* slot = slot_ids.data_ptr<int64_t>();
  for (int64_t n = 0; n < num_seqs; ++n)
    TORCH_CHECK(slot[n] >= 0 && slot[n] < state.size(0), "kda_state_step_: slot ", slot[n], " out of range");
  at::Tensor o = at::empty({num_seqs, heads, value_dim}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(),
              *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const bool* kept = keep.data_ptr<bool>();
  float *sp = state.data_ptr<float>(), *op = o.data_ptr<float>();
  const int64_t blocks = value_dim / Vec::size(), state_size = key_dim * value_dim;
  at::parallel_for(0, num_seqs * heads, 1, [&](int64_t first, int64_t last) {
    std::vector<Vec> residual(blocks), out(blocks);
    std::vector<float> decay(key_dim);
    for (int64_t task = first; task < last; ++task) {
      const int64_t n = task / heads, h = task % heads, row = task * key_dim;
      const float* qt = qp + row;
      const float* kt = kp + row;
      const float* vt = vp + task * value_dim;
      float* s = sp + (slot[n] * heads + h) * state_size;
      for (int64_t i = 0; i < key_dim; ++i) decay[i] = std::exp(gp[row + i]);
      for (int64_t b = 0; b < blocks; ++b) residual[b] = Vec::loadu(vt + b * Vec::size());
      if (kept[n]) {                                  // residual = v - k^T diag(decay) S
        for (int64_t i = 0; i < key_dim; ++i) {
          const Vec weight(kt[i] * decay[i]);
          for (int64_t b = 0; b < blocks; ++b)
            residual[b] = residual[b] - weight * Vec::loadu(s + i * value_dim + b * Vec::size());
        }
      }
      const float beta_t = bp[task];
      for (int64_t b = 0; b < blocks; ++b) out[b] = Vec(0.f);
      for (int64_t i = 0; i < key_dim; ++i) {         // S_i = decay_i S_i + beta k_i residual; o += scale q_i S_i
        const Vec keep_i(kept[n] ? decay[i] : 0.f), update(beta_t * kt[i]), read(static_cast<float>(scale) * qt[i]);
        for (int64_t b = 0; b < blocks; ++b) {
          float* at_row = s + i * value_dim + b * Vec::size();
          const Vec old = kept[n] ? Vec::loadu(at_row) : Vec(0.f);
          const Vec updated = at::vec::fmadd(update, residual[b], keep_i * old);
          updated.store(at_row);
          out[b] = at::vec::fmadd(read, updated, out[b]);
        }
      }
      for (int64_t b = 0; b < blocks; ++b) out[b].store(op + task * value_dim + b * Vec::size());
    }
  });
  return o;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("kda_state_step_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor slots, "
        "Tensor use_state, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("kda_state_step_", &kda_state_step); }
