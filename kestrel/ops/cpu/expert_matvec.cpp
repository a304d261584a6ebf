// kestrel_cpu::expert_matvec: out[p] = w[expert[p]] @ x[p] for P token-expert pairs, each expert's rows read once
// for all of its pairs (kestrel.ops.cpu).
//
// The pairs are grouped by expert on the host; the tasks (an expert in use, a slice of its output rows) run in
// parallel. A task walks its rows ROWS at a time: each chunk of those rows is loaded (and widened from bfloat16)
// once and multiplied into the vectors of up to MAX_PAIRS pairs, accumulated in float32 registers.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

using at::vec::Vectorized;
using Chunk = at::vec::VectorizedN<float, 2>;
constexpr int64_t STEP = Chunk::size();  // input elements per chunk
constexpr int ROWS = 4;                  // output rows per register block
constexpr int MAX_PAIRS = 4;             // pairs per register block
constexpr int64_t TASK_ROWS = 64;        // the most output rows per task

// The first n <= STEP elements at p, zeros after them (VectorizedN::loadu fills a missing half with ones).
inline Chunk load(const float* p, int64_t n) {
  constexpr int64_t half = Vectorized<float>::size();
  Chunk c(0.f);
  c[0] = Vectorized<float>::loadu(p, std::min(n, half));
  if (n > half) c[1] = Vectorized<float>::loadu(p + half, n - half);
  return c;
}
inline Chunk load(const at::BFloat16* p, int64_t n) {
  return at::vec::convert<float, 2, at::BFloat16, 1>(Vectorized<at::BFloat16>::loadu(p, n));
}

inline float sum(const Chunk& c) {
  return at::vec::vec_reduce_all<float>([](Vectorized<float>& a, Vectorized<float>& b) { return a + b; },
                                        c[0] + c[1]);
}

// Rows [row, row + R) of w ([out_dim, in]) times x's rows pairs[0..NP): out[pairs[j], row + r].
template <int R, int NP, typename W>
void block(const W* w, const float* x, const int64_t* pairs, float* out, int64_t in, int64_t out_dim,
           int64_t row) {
  Chunk acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = Chunk(0.f);
  for (int64_t k = 0; k < in; k += STEP) {
    const int64_t n = std::min(STEP, in - k);  // a short last chunk loads zeros past n
    Chunk xs[NP];
    for (int j = 0; j < NP; ++j) xs[j] = load(x + pairs[j] * in + k, n);
    for (int r = 0; r < R; ++r) {
      const W* chunk = w + (row + r) * in + k;
      if constexpr (sizeof(W) == 2)  // the next block's chunk: 1.4-1.5x faster in bfloat16, slower in float32
        __builtin_prefetch(chunk + ROWS * in, 0, 0);
      const Chunk weights = load(chunk, n);
      for (int j = 0; j < NP; ++j) acc[r][j] = at::vec::fmadd(weights, xs[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) out[pairs[j] * out_dim + row + r] = sum(acc[r][j]);
}

template <int R, typename W>
void rows_times_pairs(const W* w, const float* x, const int64_t* pairs, int64_t num_pairs, float* out, int64_t in,
                      int64_t out_dim, int64_t row) {
  int64_t j = 0;
  for (; j + MAX_PAIRS <= num_pairs; j += MAX_PAIRS) block<R, MAX_PAIRS>(w, x, pairs + j, out, in, out_dim, row);
  switch (num_pairs - j) {
    case 3: block<R, 3>(w, x, pairs + j, out, in, out_dim, row); break;
    case 2: block<R, 2>(w, x, pairs + j, out, in, out_dim, row); break;
    case 1: block<R, 1>(w, x, pairs + j, out, in, out_dim, row); break;
  }
}

template <typename W>
void expert_rows(const W* w, const float* x, const int64_t* pairs, int64_t num_pairs, float* out, int64_t in,
                 int64_t out_dim, int64_t begin, int64_t end) {
  int64_t row = begin;
  for (; row + ROWS <= end; row += ROWS) rows_times_pairs<ROWS>(w, x, pairs, num_pairs, out, in, out_dim, row);
  for (; row < end; ++row) rows_times_pairs<1>(w, x, pairs, num_pairs, out, in, out_dim, row);
}

// Every task (an expert in use, a slice of task_rows of its output rows) in parallel.
template <typename W>
void run_tasks(const W* w, const float* x, float* out, int64_t in, int64_t out_dim, const std::vector<int64_t>& order,
               const std::vector<int64_t>& start, const std::vector<int64_t>& used, int64_t task_rows) {
  const int64_t slices = (out_dim + task_rows - 1) / task_rows;
  at::parallel_for(0, static_cast<int64_t>(used.size()) * slices, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t e = used[t / slices], begin = (t % slices) * task_rows;
      expert_rows(w + e * out_dim * in, x, order.data() + start[e], start[e + 1] - start[e], out, in, out_dim, begin,
                  std::min(begin + task_rows, out_dim));
    }
  });
}

at::Tensor expert_matvec(const at::Tensor& x, const at::Tensor& expert, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "expert_matvec: x must be a contiguous float32 [P, in]");
  TORCH_CHECK(expert.dim() == 1 && expert.scalar_type() == at::kLong && expert.size(0) == x.size(0),
              "expert_matvec: expert must be int64 [P]");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == x.size(1) && w.is_contiguous() &&
              (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "expert_matvec: w must be a contiguous float32 or bfloat16 [E, out, in]");
  const int64_t num_pairs = x.size(0), in = x.size(1), num_experts = w.size(0), out_dim = w.size(1);
  at::Tensor out = at::empty({num_pairs, out_dim}, x.options());
  const at::Tensor ids = expert.contiguous();
  const int64_t* ex = ids.data_ptr<int64_t>();
  // The pairs grouped by expert (a counting sort): group e is order[start[e] .. start[e + 1]).
  std::vector<int64_t> start(num_experts + 1, 0), order(num_pairs);
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(ex[p] >= 0 && ex[p] < num_experts, "expert_matvec: expert id ", ex[p], " out of range");
    ++start[ex[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1), used;
  for (int64_t p = 0; p < num_pairs; ++p) order[next[ex[p]]++] = p;
  for (int64_t e = 0; e < num_experts; ++e)
    if (start[e + 1] > start[e]) used.push_back(e);
  // Row slices of at most TASK_ROWS, smaller while there would be fewer than 4 tasks per thread.
  int64_t task_rows = TASK_ROWS;
  while (task_rows > ROWS && static_cast<int64_t>(used.size()) * ((out_dim + task_rows - 1) / task_rows) <
                                 4 * at::get_num_threads())
    task_rows /= 2;
  if (w.scalar_type() == at::kFloat)
    run_tasks(w.data_ptr<float>(), x.data_ptr<float>(), out.data_ptr<float>(), in, out_dim, order, start, used,
              task_rows);
  else
    run_tasks(w.data_ptr<at::BFloat16>(), x.data_ptr<float>(), out.data_ptr<float>(), in, out_dim, order, start,
              used, task_rows);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) { m.def("expert_matvec(Tensor x, Tensor expert, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("expert_matvec", &expert_matvec); }
