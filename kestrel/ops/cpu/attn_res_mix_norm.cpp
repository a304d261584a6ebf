// kestrel_cpu::attn_res_mix_norm: AttnRes's softmax mix over depth and the RMSNorm after it, for float32 sources
// [S, T, D] (kestrel.ops.cpu; the math is kestrel.ops.torch.attn_res's).
//
// Per token t (one task per range of tokens): for each source i, one pass over v_i = sources[i, t] takes sum v^2
// and <v, mix_norm_weight * proj_weight>, whose product with rsqrt(mean v^2 + mix_eps) is source i's logit; a
// softmax over the S logits weighs a second pass that sums the sources into out[t]; with norm_weight, a third pass
// scales the mix by rsqrt(mean mix^2 + norm_eps) * norm_weight. The eager torch ops it replaces are ~14 per call
// (and the stacked sources' float32 copy), twice per layer of a decode step.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace attn_res_mix_norm_kernel {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();

inline float lanes_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

at::Tensor attn_res_mix_norm(const at::Tensor& sources, const at::Tensor& mix_norm_weight,
                             const at::Tensor& proj_weight, double mix_eps,
                             const std::optional<at::Tensor>& norm_weight, double norm_eps) {
  TORCH_CHECK(sources.dim() == 3 && sources.scalar_type() == at::kFloat && sources.is_contiguous(),
              "attn_res_mix_norm: sources must be a contiguous float32 [S, T, D]");
  const int64_t num_sources = sources.size(0), tokens = sources.size(1), dim = sources.size(2);
  TORCH_CHECK(num_sources >= 1, "attn_res_mix_norm: sources must hold at least one source");
  for (const at::Tensor* w : {&mix_norm_weight, &proj_weight})
    TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->sizes() == at::IntArrayRef({dim}),
                "attn_res_mix_norm: mix_norm_weight, proj_weight and norm_weight must be contiguous float32 [D]");
  TORCH_CHECK(!norm_weight || (norm_weight->scalar_type() == at::kFloat && norm_weight->is_contiguous() &&
                               norm_weight->sizes() == at::IntArrayRef({dim})),
              "attn_res_mix_norm: mix_norm_weight, proj_weight and norm_weight must be contiguous float32 [D]");
  std::vector<float> w(dim);  // the logit's weight: mix_norm_weight * proj_weight
  const float *mw = mix_norm_weight.data_ptr<float>(), *pw = proj_weight.data_ptr<float>();
  for (int64_t d = 0; d < dim; ++d) w[d] = mw[d] * pw[d];
  at::Tensor out = at::empty({tokens, dim}, sources.options());
  const float* src = sources.data_ptr<float>();
  const float* nw = norm_weight ? norm_weight->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int64_t body = dim - dim % V;
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / std::max<int64_t>(dim * num_sources, 1)),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> logits(num_sources);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < num_sources; ++i) {
        const float* v = src + (i * tokens + t) * dim;
        Vec squares(0.f), dots(0.f);
        for (int64_t d = 0; d < body; d += V) {
          const Vec x = Vec::loadu(v + d);
          squares = at::vec::fmadd(x, x, squares);
          dots = at::vec::fmadd(x, Vec::loadu(w.data() + d), dots);
        }
        float ss = lanes_sum(squares), dot = lanes_sum(dots);
        for (int64_t d = body; d < dim; ++d) {
          ss += v[d] * v[d];
          dot += v[d] * w[d];
        }
        logits[i] = dot / std::sqrt(ss / dim + static_cast<float>(mix_eps));
      }
      const float top = *std::max_element(logits.begin(), logits.end());
      float total = 0.f;
      for (float& l : logits) total += (l = std::exp(l - top));
      float* y = o + t * dim;
      std::fill(y, y + dim, 0.f);
      for (int64_t i = 0; i < num_sources; ++i) {
        const float p = logits[i] / total;
        const float* v = src + (i * tokens + t) * dim;
        for (int64_t d = 0; d < body; d += V)
          at::vec::fmadd(Vec(p), Vec::loadu(v + d), Vec::loadu(y + d)).store(y + d);
        for (int64_t d = body; d < dim; ++d) y[d] += p * v[d];
      }
      if (!nw) continue;
      Vec squares(0.f);
      for (int64_t d = 0; d < body; d += V) {
        const Vec x = Vec::loadu(y + d);
        squares = at::vec::fmadd(x, x, squares);
      }
      float ss = lanes_sum(squares);
      for (int64_t d = body; d < dim; ++d) ss += y[d] * y[d];
      const float r = 1.f / std::sqrt(ss / dim + static_cast<float>(norm_eps));
      for (int64_t d = 0; d < dim; ++d) y[d] = y[d] * r * nw[d];
    }
  });
  return out;
}

}  // namespace attn_res_mix_norm_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("attn_res_mix_norm(Tensor sources, Tensor mix_norm_weight, Tensor proj_weight, float mix_eps, "
        "Tensor? norm_weight, float norm_eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("attn_res_mix_norm", &attn_res_mix_norm_kernel::attn_res_mix_norm); }
