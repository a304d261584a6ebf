// kestrel_cpu::rms_norm: x * rsqrt(mean x^2 + eps) * weight over the last dim of float32 rows (kestrel.ops.cpu; the
// math is kestrel.layers.norm.rms_norm's, whose torch ops are ~8 per call). x [M, D] may have strided rows.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace rms_norm_kernel {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && (x.size(1) <= 1 || x.stride(1) == 1),
              "rms_norm: x must be float32 rows [M, D] with contiguous values");
  const int64_t rows = x.size(0), dim = x.size(1), stride = x.stride(0);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == dim,
              "rms_norm: weight must be a contiguous float32 [D]");
  at::Tensor out = at::empty({rows, dim}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t body = dim - dim % V;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* v = xp + r * stride;
      float* y = op + r * dim;
      Vec squares(0.f);
      for (int64_t d = 0; d < body; d += V) {
        const Vec a = Vec::loadu(v + d);
        squares = at::vec::fmadd(a, a, squares);
      }
      float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, squares);
      for (int64_t d = body; d < dim; ++d) ss += v[d] * v[d];
      const float inverse = 1.f / std::sqrt(ss / dim + static_cast<float>(eps));
      for (int64_t d = 0; d < body; d += V) (Vec::loadu(v + d) * Vec(inverse) * Vec::loadu(w + d)).store(y + d);
      for (int64_t d = body; d < dim; ++d) y[d] = v[d] * inverse * w[d];
    }
  });
  return out;
}

}  // namespace rms_norm_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("rms_norm", &rms_norm_kernel::rms_norm); }
