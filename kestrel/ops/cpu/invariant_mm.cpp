// kestrel_cpu::invariant_mm: a [M, K] @ b [K, N] -> [M, N] (or batched: [B, M, K] @ [B, K, N]) in float32, each
// output summed in one fixed order whatever M, N and the thread count are (kestrel.ops.batch_invariant).
//
// out[m, n] = fma(a[m, K-1], b[K-1, n], ... fma(a[m, 1], b[1, n], fma(a[m, 0], b[0, n], 0))): one fused multiply-add
// per input, k ascending, from zero. linear_rows computes exactly this too (its lanes are rows of x, these are
// columns of b, and fma is symmetric in its factors), so the two agree bit for bit. Zero terms appended to the sum
// (keys past a sequence's end, whose probabilities are zero) leave it unchanged, so padding never changes a row.
//
// b's rows must be contiguous (b.stride(1) == 1): a tile of R rows of a times MB vectors of a row of b, R x MB
// accumulators in registers; at every k each a[m, k] is broadcast against the MB vectors of b[k]. Columns past the
// last whole vector are summed one by one by scalar fused multiply-adds, which round as the vector lanes do.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace invariant_mm_kernel {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int MB = 4;                           // vectors of b's columns per tile
constexpr int R = V == 16 ? 6 : 3;              // rows of a per tile: R * MB accumulators, half the registers or so
constexpr int64_t BLOCK = MB * V;               // columns per task

// out[r, c] for the RT rows of a at its pointer (row stride lda, column stride ka) and the `width` <= BLOCK columns of
// b at its pointer (row stride ldb): whole vectors of columns in registers, the columns past them one by one (the
// scalar fma rounds as a vector lane's does).
template <int RT>
void tile(const float* a, int64_t lda, int64_t ka, const float* b, int64_t ldb, int64_t k_dim, int64_t width,
          float* out, int64_t ldo) {
  Vec acc[RT][MB];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < MB; ++j) acc[r][j] = Vec(0.f);
  const int vectors = static_cast<int>(width / V);
  for (int64_t k = 0; k < k_dim; ++k) {
    Vec bs[MB];
    const float* row = b + k * ldb;
    for (int j = 0; j < vectors; ++j) bs[j] = Vec::loadu(row + j * V);
    for (int r = 0; r < RT; ++r) {
      const Vec x(a[r * lda + k * ka]);
      for (int j = 0; j < vectors; ++j) acc[r][j] = at::vec::fmadd(x, bs[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < vectors; ++j) acc[r][j].store(out + r * ldo + j * V);
  for (int64_t c = vectors * V; c < width; ++c)
    for (int r = 0; r < RT; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < k_dim; ++k) sum = std::fma(a[r * lda + k * ka], b[k * ldb + c], sum);
      out[r * ldo + c] = sum;
    }
}

// tile<count> for count <= RT rows: the last tile's rows, all in one pass over the panel of b.
template <int RT>
void tile_rows(int64_t count, const float* a, int64_t lda, int64_t ka, const float* b, int64_t ldb, int64_t k_dim,
               int64_t width, float* out, int64_t ldo) {
  if constexpr (RT > 1) {
    if (count < RT) return tile_rows<RT - 1>(count, a, lda, ka, b, ldb, k_dim, width, out, ldo);
  }
  tile<RT>(a, lda, ka, b, ldb, k_dim, width, out, ldo);
}

at::Tensor invariant_mm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == b.dim() && (a.dim() == 2 || (a.dim() == 3 && a.size(0) == b.size(0))) &&
              a.size(-1) == b.size(-2), "invariant_mm: a [M, K] and b [K, N], or a [B, M, K] and b [B, K, N]");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, "invariant_mm: float32 only");
  TORCH_CHECK(b.stride(-1) == 1 || b.size(-1) <= 1, "invariant_mm: b's rows must be contiguous");
  const bool batched = a.dim() == 3;
  const int64_t batch = batched ? a.size(0) : 1, rows = a.size(-2), k_dim = a.size(-1), cols = b.size(-1);
  at::Tensor out = batched ? at::empty({batch, rows, cols}, a.options()) : at::empty({rows, cols}, a.options());
  if (out.numel() == 0) return out;
  if (k_dim == 0) return out.zero_();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t lda = a.stride(-2), ka = a.stride(-1), ldb = b.stride(-2);
  const int64_t a_batch = batched ? a.stride(0) : 0, b_batch = batched ? b.stride(0) : 0;
  const int64_t blocks = (cols + BLOCK - 1) / BLOCK, row_tiles = (rows + R - 1) / R;
  at::parallel_for(0, batch * blocks * row_tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      // Row tiles innermost: consecutive tasks multiply the same panel of b's columns, which stays in cache.
      const int64_t item = task / (blocks * row_tiles), within = task % (blocks * row_tiles);
      const int64_t column = (within / row_tiles) * BLOCK, row = (within % row_tiles) * R;
      const int64_t width = std::min(BLOCK, cols - column), count = std::min<int64_t>(R, rows - row);
      const float* at_a = ap + item * a_batch + row * lda;
      const float* at_b = bp + item * b_batch + column;
      float* at_out = op + (item * rows + row) * cols + column;
      tile_rows<R>(count, at_a, lda, ka, at_b, ldb, k_dim, width, at_out, cols);
    }
  });
  return out;
}

}  // namespace invariant_mm_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) { m.def("invariant_mm(Tensor a, Tensor b) -> Tensor"); }

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("invariant_mm", &invariant_mm_kernel::invariant_mm); }
