// The gated MLP activation of kestrel.ops.torch.moe.GLUActivation on float32 vectors (kestrel.ops.cpu): SiLU(g) * u
// or SiTU-GLU, beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta). Shared by glu.cpp and the routed
// experts' expert_mlp (expert_matvec.cpp), so that both compute it alike.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>

namespace kestrel_glu {

using Vec = at::vec::Vectorized<float>;

template <bool SITU>
inline Vec activation(const Vec& g, const Vec& u, const Vec& beta, const Vec& linear_beta) {
  const Vec one(1.f), sigmoid = one / (one + g.neg().exp());
  if constexpr (SITU) return beta * (g / beta).tanh() * sigmoid * (linear_beta * (u / linear_beta).tanh());
  return g * sigmoid * u;
}

// y[i] = act(g[i], u[i]) for i < width.
inline void activate_row(const float* g, const float* u, float* y, int64_t width, bool situ, const Vec& beta,
                         const Vec& linear_beta) {
  for (int64_t i = 0; i < width; i += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), width - i);
    const Vec a = Vec::loadu(g + i, n), c = Vec::loadu(u + i, n);
    (situ ? activation<true>(a, c, beta, linear_beta) : activation<false>(a, c, beta, linear_beta)).store(y + i, n);
  }
}

}  // namespace kestrel_glu
