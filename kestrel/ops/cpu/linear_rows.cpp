// kestrel_cpu::linear_rows: x [M, in] @ w [out, in]^T (+ bias [out]) -> [M, out] in float32, reading w from memory
// once for up to MAX_CHUNK rows of x (kestrel.ops.cpu).
//
// The rows of x lie across a vector's lanes: x is copied transposed into xt [in, Mp] (Mp: M padded to whole
// vectors, zeros past M). A tile of R weight rows is multiplied into R x MB accumulators (MB vectors of x's rows
// each): at every input k, the MB vectors of xt[k] are loaded and each weight w[n, k] is broadcast into MB fused
// multiply-adds. Each weight is used M times from a register, no horizontal sums are needed, and the weight stays
// row-major, as the checkpoint has it. While a tile is multiplied, the next tile's rows (contiguous) are prefetched
// in address order. Panels of PANEL weight rows run in parallel; more than MAX_CHUNK rows of x go by chunks.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>

namespace linear_rows_kernel {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
// Accumulator vectors per tile: half of the vector registers (32 with AVX-512, 16 otherwise), the rest hold xt[k]
// and the broadcast weight.
constexpr int ACCUMULATORS = V == 16 ? 16 : 8;
constexpr int MAX_MB = 4;                       // vectors of x rows per chunk
constexpr int64_t MAX_CHUNK = MAX_MB * V;       // rows of x per chunk
constexpr int64_t LINE = 64 / sizeof(float);    // floats per cache line
constexpr int64_t PANEL = 64;                   // weight rows per panel

// out [R, MB * V]: R weight rows from w (row stride in) times MB vectors of xt's rows (xt [in, MB * V]); next:
// the rows to prefetch meanwhile.
template <int MB, int R>
void tile(const float* w, const float* next, const float* xt, int64_t in, float* out) {
  constexpr int64_t mp = MB * V;
  Vec acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MB; ++j) acc[r][j] = Vec(0.f);
  for (int64_t line = 0; line < in; line += LINE) {
    if (next)
      for (int r = 0; r < R; ++r) __builtin_prefetch(next + line * R + r * LINE, 0, 2);  // sequentially
    const int64_t end = std::min(line + LINE, in);
    for (int64_t k = line; k < end; ++k) {
      Vec xs[MB];
      for (int j = 0; j < MB; ++j) xs[j] = Vec::loadu(xt + k * mp + j * V);
      for (int r = 0; r < R; ++r) {
        const Vec weight(w[r * in + k]);
        for (int j = 0; j < MB; ++j) acc[r][j] = at::vec::fmadd(weight, xs[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MB; ++j) acc[r][j].store(out + r * MB * V + j * V);
}

// Weight rows [begin, end) times one chunk of rows of x (xt [in, MB * V], rows of them real) into out [rows,
// out_dim]: a panel of PANEL weight rows at a time, R rows per tile, into a panel buffer [PANEL, MB * V] that is
// then written out by rows of x (PANEL contiguous outputs each, where storing each tile's outputs column by column
// would touch rows lines of out whose addresses alias in the L1 cache).
template <int MB>
void rows_times_chunk(const float* w, const float* xt, int64_t in, const float* bias, float* out, int64_t rows,
                      int64_t out_dim, int64_t begin, int64_t end) {
  constexpr int R = std::bit_floor(static_cast<unsigned>(ACCUMULATORS / MB));
  constexpr int64_t mp = MB * V;
  alignas(64) float panel[PANEL * mp];
  for (int64_t first = begin; first < end; first += PANEL) {
    const int64_t last = std::min(first + PANEL, end);
    int64_t n = first;
    for (; n + R <= last; n += R)
      tile<MB, R>(w + n * in, n + 2 * R <= end ? w + (n + R) * in : nullptr, xt, in, panel + (n - first) * mp);
    for (; n < last; ++n) tile<MB, 1>(w + n * in, nullptr, xt, in, panel + (n - first) * mp);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t i = 0; i < last - first; ++i)
        out[m * out_dim + first + i] = panel[i * mp + m] + (bias ? bias[first + i] : 0.f);
  }
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_rows: x must be float32 [M, in]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x.size(1),
              "linear_rows: w must be a contiguous float32 [out, in] with x's inputs");
  const int64_t num_rows = x.size(0), in = x.size(1), out_dim = w.size(0);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->sizes() == at::IntArrayRef({out_dim})),
              "linear_rows: bias must be a contiguous float32 [out]");
  at::Tensor out = at::empty({num_rows, out_dim}, x.options());
  const float* weights = w.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const float* xs = x.data_ptr<float>();
  const int64_t row_stride = x.stride(0), col_stride = x.stride(1);
  for (int64_t first = 0; first < num_rows; first += MAX_CHUNK) {
    const int64_t rows = std::min(MAX_CHUNK, num_rows - first), mb = (rows + V - 1) / V, mp = mb * V;
    // xt [in, mp]: this chunk's rows of x transposed, zeros past them.
    const at::Tensor xt = at::empty({in, mp}, x.options());
    float* t = xt.data_ptr<float>();
    for (int64_t k = 0; k < in; ++k)
      for (int64_t m = 0; m < mp; ++m) t[k * mp + m] = m < rows ? xs[(first + m) * row_stride + k * col_stride] : 0.f;
    float* o = out.data_ptr<float>() + first * out_dim;
    const int64_t panels = (out_dim + PANEL - 1) / PANEL;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      const int64_t from = begin * PANEL, to = std::min(end * PANEL, out_dim);
      switch (mb) {
        case 1: rows_times_chunk<1>(weights, t, in, b, o, rows, out_dim, from, to); break;
        case 2: rows_times_chunk<2>(weights, t, in, b, o, rows, out_dim, from, to); break;
        case 3: rows_times_chunk<3>(weights, t, in, b, o, rows, out_dim, from, to); break;
        default: rows_times_chunk<4>(weights, t, in, b, o, rows, out_dim, from, to); break;
      }
    });
  }
  return out;
}

}  // namespace linear_rows_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) { m.def("linear_rows(Tensor x, Tensor w, Tensor? bias=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("linear_rows", &linear_rows_kernel::linear_rows); }
