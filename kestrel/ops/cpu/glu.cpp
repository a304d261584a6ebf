// kestrel_cpu::glu: the gated MLP activation act(gate, up) of float32 rows (kestrel.ops.cpu; the math is
// kestrel.ops.torch.moe.GLUActivation's, whose torch ops are ~11 per call for SiTU): SiLU(gate) * up, or SiTU-GLU,
// beta tanh(gate / beta) sigmoid(gate) * linear_beta tanh(up / linear_beta). gate and up [M, I] may have strided
// rows (the columns of one fused product).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "glu.h"

namespace glu_kernel {

using kestrel_glu::Vec;

at::Tensor glu(const at::Tensor& gate, const at::Tensor& up, bool situ, double beta, double linear_beta) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.scalar_type() == at::kFloat &&
              up.scalar_type() == at::kFloat && (gate.size(1) <= 1 || (gate.stride(1) == 1 && up.stride(1) == 1)),
              "glu: gate and up must be float32 rows [M, I] with contiguous values");
  const int64_t rows = gate.size(0), width = gate.size(1);
  at::Tensor out = at::empty({rows, width}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  const float *gp = gate.data_ptr<float>(), *upp = up.data_ptr<float>();
  const int64_t g_stride = gate.stride(0), u_stride = up.stride(0);
  float* op = out.data_ptr<float>();
  const Vec b(static_cast<float>(beta)), lb(static_cast<float>(linear_beta));
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      kestrel_glu::activate_row(gp + r * g_stride, upp + r * u_stride, op + r * width, width, situ, b, lb);
  });
  return out;
}

}  // namespace glu_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("glu(Tensor gate, Tensor up, bool situ, float beta, float linear_beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("glu", &glu_kernel::glu); }
