// kestrel_cpu::linear_dots: x [M, in] @ w [out, in]^T (+ bias [out]) -> [M, out] in float32 for a few rows of x
// (M <= MAX_ROWS: a decode step of a few sequences), as dot products along the input dim (kestrel.ops.cpu).
//
// A tile of R weight rows is loaded a vector of inputs at a time and multiplied into R x M vector accumulators
// against the same inputs of each row of x; each accumulator is then summed across its lanes, and the inputs past
// the last whole vector are added one by one. Every weight is read once, as part of a whole vector, and the weight
// stays row-major, as the checkpoint has it. A column-major weight (stored [in, out], as kestrel.layers.linear holds
// small ones for MKL) is read by rows of that storage instead: each input k adds x[m, k] times its row to vectors of
// outputs, k ascending from zero. Either way an output's summation order depends on `in` only: not on M, on the
// other rows or on the threads. Tasks of whole tiles of weight rows (or output columns) run in parallel.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

namespace linear_dots_kernel {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int64_t MAX_ROWS = 4;
// the fewest weights (32 KiB) per parallel task: small products run on one thread
constexpr int64_t TASK_WEIGHTS = 8192;

inline float lanes_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// out[m, n] for weight rows n in [n, n + R) and the M rows of x (row stride xs).
template <int M, int R>
void tile(const float* w, const float* x, int64_t xs, int64_t in, const float* bias, float* out, int64_t out_dim,
          int64_t n) {
  const int64_t body = in - in % V;
  Vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = Vec(0.f);
  for (int64_t k = 0; k < body; k += V) {
    Vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = Vec::loadu(x + m * xs + k);
    for (int r = 0; r < R; ++r) {
      const Vec weight = Vec::loadu(w + (n + r) * in + k);
      for (int m = 0; m < M; ++m) acc[r][m] = at::vec::fmadd(weight, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float sum = lanes_sum(acc[r][m]);
      for (int64_t k = body; k < in; ++k) sum += w[(n + r) * in + k] * x[m * xs + k];
      out[m * out_dim + n + r] = sum + (bias ? bias[n + r] : 0.f);
    }
}

// Weight rows [begin, end) times the M rows of x.
template <int M>
void dots(const float* w, const float* x, int64_t xs, int64_t in, const float* bias, float* out, int64_t out_dim,
          int64_t begin, int64_t end) {
  // Weight rows per tile: R x M accumulators, M inputs and a weight within the vector registers (32 with AVX-512,
  // 16 with AVX2); one row of x takes 8, whose 8 weight streams read from memory faster than 4 (measured: the
  // 437M K3's [4096, 1024] at one thread 22 against 18 GB/s).
  constexpr int R = M == 1 ? 8 : V == 16 || M <= 2 ? 4 : 2;
  int64_t n = begin;
  for (; n + R <= end; n += R) tile<M, R>(w, x, xs, in, bias, out, out_dim, n);
  for (; n < end; ++n) tile<M, 1>(w, x, xs, in, bias, out, out_dim, n);
}

// Column-major weight (wt [in, out] stored): outputs [n, n + J vectors) (the last of them `last` wide) of the M rows
// of x, each the sum over k ascending of x[m, k] wt[k, .], then the bias.
template <int M, int J>
void columns_tile(const float* wt, const float* x, int64_t xs, int64_t in, const float* bias, float* out,
                  int64_t out_dim, int64_t n, int64_t last) {
  Vec acc[M][J];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = Vec(0.f);
  for (int64_t k = 0; k < in; ++k) {
    const float* row = wt + k * out_dim + n;
    for (int j = 0; j < J; ++j) {
      const Vec weight = j + 1 < J || last == V ? Vec::loadu(row + j * V) : Vec::loadu(row + j * V, last);
      for (int m = 0; m < M; ++m) acc[m][j] = at::vec::fmadd(weight, Vec(x[m * xs + k]), acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) {
      const int64_t count = j + 1 < J ? V : last;
      Vec result = acc[m][j];
      if (bias) result = result + Vec::loadu(bias + n + j * V, count);
      result.store(out + m * out_dim + n + j * V, count);
    }
}

// Outputs [begin, end) of the M rows of x by a column-major weight.
template <int M>
void columns(const float* wt, const float* x, int64_t xs, int64_t in, const float* bias, float* out, int64_t out_dim,
             int64_t begin, int64_t end) {
  constexpr int J = M == 1 ? 8 : M == 2 ? 4 : 2;         // M x J accumulators, M inputs and a weight in registers
  int64_t n = begin;
  for (; n + J * V <= end; n += J * V) columns_tile<M, J>(wt, x, xs, in, bias, out, out_dim, n, V);
  for (; n < end; n += V) columns_tile<M, 1>(wt, x, xs, in, bias, out, out_dim, n, std::min(V, end - n));
}

at::Tensor linear_dots(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) <= MAX_ROWS && x.stride(1) == 1,
              "linear_dots: x must be float32 [M, in] with M <= 4 and contiguous rows");
  const bool column_major = w.dim() == 2 && !w.is_contiguous() && w.t().is_contiguous();
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && (w.is_contiguous() || column_major) &&
                  w.size(1) == x.size(1),
              "linear_dots: w must be a row- or column-major float32 [out, in] with x's inputs");
  const int64_t rows = x.size(0), in = x.size(1), out_dim = w.size(0);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->sizes() == at::IntArrayRef({out_dim})),
              "linear_dots: bias must be a contiguous float32 [out]");
  at::Tensor out = at::empty({rows, out_dim}, x.options());
  const float* weights = w.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const float* xs = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = x.stride(0), grain = std::max<int64_t>(8, TASK_WEIGHTS / std::max<int64_t>(in, 1));
  // Outputs [begin, end) of x's rows by `kernel`, instantiated for their count (M = 1 to 4).
  const auto by_rows = [&](auto kernel, int64_t begin, int64_t end) {
    switch (rows) {
      case 0: break;
      case 1: kernel.template operator()<1>(begin, end); break;
      case 2: kernel.template operator()<2>(begin, end); break;
      case 3: kernel.template operator()<3>(begin, end); break;
      default: kernel.template operator()<4>(begin, end); break;
    }
  };
  if (column_major) {                                     // tasks of whole vectors of outputs
    const auto kernel = [&]<int M>(int64_t begin, int64_t end) {
      columns<M>(weights, xs, stride, in, b, o, out_dim, begin, end);
    };
    at::parallel_for(0, (out_dim + V - 1) / V, std::max<int64_t>(1, grain / V), [&](int64_t first, int64_t last) {
      by_rows(kernel, first * V, std::min(last * V, out_dim));
    });
  } else {
    const auto kernel = [&]<int M>(int64_t begin, int64_t end) {
      dots<M>(weights, xs, stride, in, b, o, out_dim, begin, end);
    };
    at::parallel_for(0, out_dim, grain, [&](int64_t begin, int64_t end) { by_rows(kernel, begin, end); });
  }
  return out;
}

}  // namespace linear_dots_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) { m.def("linear_dots(Tensor x, Tensor w, Tensor? bias=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("linear_dots", &linear_dots_kernel::linear_dots); }
