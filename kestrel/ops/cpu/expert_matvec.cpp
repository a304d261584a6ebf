// kestrel_cpu::expert_matvec: out[p] = w[expert[p]] @ x[p] for P token-expert pairs, each expert's rows read once
// for all of its pairs (kestrel.ops.cpu). The weights are float32, bfloat16 or MXFP4 (kestrel.quant.mxfp4's layout:
// E2M1 codes two per byte, low nibble first, and an E8M0 scale per block of 32 inputs), read where they lie.
//
// The pairs are grouped by expert on the host; the tasks (an expert in use, a slice of its output rows) run in
// parallel. A task walks its rows ROWS at a time: each chunk of those rows is loaded (widened from bfloat16, or
// decoded from MXFP4 in registers) once and multiplied into the vectors of up to MAX_PAIRS pairs, accumulated in
// float32 registers.
//
// kestrel_cpu::expert_mlp: a token's routed experts whole, sum_j weights[t, j] * w2[e] act(w1[e] z[t], w3[e] z[t])
// over its experts e = ids[t, j], in one call: the products as expert_matvec computes them, the activation as glu
// does (glu.h), the weighted sum in float32, j ascending (what moe_experts_native's torch ops computed around them).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "glu.h"

namespace expert_matvec_kernel {

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

// E2M1 code -> value (bit 3 the sign), and E8M0 scale byte -> 2^(byte - 127) (0xFF: NaN), as kestrel.quant.mxfp4.
alignas(64) constexpr float E2M1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                        -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
const std::array<float, 256> E8M0 = [] {
  std::array<float, 256> scales;
  for (int s = 0; s < 255; ++s) scales[s] = std::ldexp(1.f, s - 127);
  scales[255] = std::numeric_limits<float>::quiet_NaN();
  return scales;
}();
constexpr int64_t MXFP4_BLOCK = 32;
static_assert(MXFP4_BLOCK % STEP == 0, "a chunk must lie within one MXFP4 block");

// The STEP values whose codes are the STEP / 2 bytes at p, times scale, in split order: the low nibbles' values (the
// chunk's even inputs) in c[0], the high nibbles' (its odd inputs) in c[1]; x's chunks are read split alike
// (split_chunks), so that no shuffle puts the values back in order. The scale multiplies the 16-entry table once.
// Against unpacking the codes back into order (AVX-512, 2 threads, hot, one token's top 4 of the 437M K3's experts):
// [512, 512] 81-94 against 104-109 us, [512, 256] 61-65 against 68-72; level at 128 pairs.
inline Chunk decode_mxfp4(const uint8_t* p, float scale) {
  Chunk c(0.f);
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(STEP == 32);
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 table = _mm512_mul_ps(_mm512_load_ps(E2M1), _mm512_set1_ps(scale));
  c[0] = _mm512_permutexvar_ps(codes, table);  // the permutation reads the low 4 bits of each index
  c[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
#elif defined(CPU_CAPABILITY_AVX2)
  static_assert(STEP == 16);
  const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 magnitudes = _mm256_mul_ps(_mm256_load_ps(E2M1), _mm256_set1_ps(scale));
  for (int half = 0; half < 2; ++half) {
    const __m256i code = half ? _mm256_srli_epi32(codes, 4) : codes;
    const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(code, 3), 31));  // bit 3
    c[half] = _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, code), sign);  // reads the low 3 bits
  }
#else
  constexpr int64_t half = Vectorized<float>::size();
  alignas(64) float values[STEP];
  for (int64_t i = 0; i < half; ++i) {
    values[i] = E2M1[p[i] & 0x0F] * scale;
    values[half + i] = E2M1[p[i] >> 4] * scale;
  }
  c[0] = Vectorized<float>::loadu(values);
  c[1] = Vectorized<float>::loadu(values + half);
#endif
  return c;
}

// x [P, in] (in a multiple of STEP) with each chunk's even inputs first, then its odd ones: decode_mxfp4's order.
std::vector<float> split_chunks(const float* x, int64_t num_pairs, int64_t in) {
  std::vector<float> split(num_pairs * in);
  for (int64_t k = 0; k < num_pairs * in; k += STEP)
    for (int64_t i = 0; i < STEP / 2; ++i) {
      split[k + i] = x[k + 2 * i];
      split[k + STEP / 2 + i] = x[k + 2 * i + 1];
    }
  return split;
}

// One expert's weight [out_dim, in], float32 or bfloat16; row(r).load(k, n) is row r's chunk of n <= STEP inputs
// from k.
template <typename T>
struct DenseRows {
  static constexpr bool PREFETCH = sizeof(T) == 2;  // the next block's chunk: 1.4-1.5x faster in bfloat16, slower
                                                     // in float32
  const T* w;
  int64_t in;
  DenseRows expert(int64_t e, int64_t out_dim) const { return {w + e * out_dim * in, in}; }
  struct Row {
    const T* w;
    Chunk load(int64_t k, int64_t n) const { return expert_matvec_kernel::load(w + k, n); }
    void prefetch(int64_t k) const { __builtin_prefetch(w + k, 0, 0); }
  };
  Row row(int64_t r) const { return {w + r * in}; }
};

// One expert's MXFP4 weight: codes [out_dim, in / 2], scales [out_dim, in / 32] (in a multiple of 32, so that every
// chunk is whole).
struct Mxfp4Rows {
  static constexpr bool PREFETCH = true;  // measured level with none on the 437M K3's experts
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t in;
  Mxfp4Rows expert(int64_t e, int64_t out_dim) const {
    return {codes + e * out_dim * in / 2, scales + e * out_dim * in / MXFP4_BLOCK, in};
  }
  struct Row {
    const uint8_t* codes;
    const uint8_t* scales;
    Chunk load(int64_t k, int64_t) const { return decode_mxfp4(codes + k / 2, E8M0[scales[k / MXFP4_BLOCK]]); }
    void prefetch(int64_t k) const { __builtin_prefetch(codes + k / 2, 0, 0); }
  };
  Row row(int64_t r) const { return {codes + r * in / 2, scales + r * in / MXFP4_BLOCK}; }
};

inline float sum(const Vectorized<float>& v) {
  return at::vec::vec_reduce_all<float>([](Vectorized<float>& a, Vectorized<float>& b) { return a + b; }, v);
}

// Rows [row, row + R) of one expert's weight w ([out_dim, in]) times x's rows pairs[0..NP): out[pairs[j], row + r].
template <int R, int NP, typename Rows>
void block(const Rows& w, const float* x, const int64_t* pairs, float* out, int64_t in, int64_t out_dim,
           int64_t row) {
  // The accumulators by chunk half (arrays of Chunk stayed on the stack, not in registers), rows addressed once per
  // block and whole chunks loaded unmasked: against indexing each load from (row, k) with a count, times 0.71-0.79 at
  // one token's top 4 of the 437M K3's MXFP4 experts [512, 512], 0.75-0.92 at 128 pairs, 0.82-0.98 in float32
  // (AVX-512, 2 threads, hot; both kernels in one process, alternating).
  Vectorized<float> acc[2][R][NP];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NP; ++j) acc[h][r][j] = Vectorized<float>(0.f);
  typename Rows::Row rows[R], next[R];  // this block's rows, and the next block's (to prefetch)
  for (int r = 0; r < R; ++r) {
    rows[r] = w.row(row + r);
    next[r] = w.row(row + r + ROWS);
  }
  // The chunk of n inputs from k into the accumulators (inlined where n is the constant STEP: no masked loads).
  const auto chunk = [&](int64_t k, int64_t n) __attribute__((always_inline)) {
    Chunk xs[NP];
    for (int j = 0; j < NP; ++j) xs[j] = load(x + pairs[j] * in + k, n);
    for (int r = 0; r < R; ++r) {
      if constexpr (Rows::PREFETCH) next[r].prefetch(k);
      const Chunk weights = rows[r].load(k, n);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < NP; ++j) acc[h][r][j] = at::vec::fmadd(weights[h], xs[j][h], acc[h][r][j]);
    }
  };
  int64_t k = 0;
  for (; k + STEP <= in; k += STEP) chunk(k, STEP);
  if (k < in) chunk(k, in - k);  // a short last chunk loads zeros past in
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) out[pairs[j] * out_dim + row + r] = sum(acc[0][r][j] + acc[1][r][j]);
}

template <int R, typename Rows>
void rows_times_pairs(const Rows& w, const float* x, const int64_t* pairs, int64_t num_pairs, float* out, int64_t in,
                      int64_t out_dim, int64_t row) {
  int64_t j = 0;
  for (; j + MAX_PAIRS <= num_pairs; j += MAX_PAIRS) block<R, MAX_PAIRS>(w, x, pairs + j, out, in, out_dim, row);
  switch (num_pairs - j) {
    case 3: block<R, 3>(w, x, pairs + j, out, in, out_dim, row); break;
    case 2: block<R, 2>(w, x, pairs + j, out, in, out_dim, row); break;
    case 1: block<R, 1>(w, x, pairs + j, out, in, out_dim, row); break;
  }
}

template <typename Rows>
void expert_rows(const Rows& w, const float* x, const int64_t* pairs, int64_t num_pairs, float* out, int64_t in,
                 int64_t out_dim, int64_t begin, int64_t end) {
  int64_t row = begin;
  for (; row + ROWS <= end; row += ROWS) rows_times_pairs<ROWS>(w, x, pairs, num_pairs, out, in, out_dim, row);
  for (; row < end; ++row) rows_times_pairs<1>(w, x, pairs, num_pairs, out, in, out_dim, row);
}

// Every task (an expert in use, a slice of task_rows of its output rows) in parallel; w holds all experts' weights.
template <typename Rows>
void run_tasks(const Rows& w, const float* x, float* out, int64_t in, int64_t out_dim,
               const std::vector<int64_t>& order, const std::vector<int64_t>& start, const std::vector<int64_t>& used,
               int64_t task_rows) {
  const int64_t slices = (out_dim + task_rows - 1) / task_rows;
  at::parallel_for(0, static_cast<int64_t>(used.size()) * slices, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t e = used[t / slices], begin = (t % slices) * task_rows;
      expert_rows(w.expert(e, out_dim), x, order.data() + start[e], start[e + 1] - start[e], out, in, out_dim, begin,
                  std::min(begin + task_rows, out_dim));
    }
  });
}

// The pairs grouped by expert (a counting sort): group e is order[start[e] .. start[e + 1]); used: the experts with
// pairs.
struct Groups {
  std::vector<int64_t> start, order, used;

  Groups(const int64_t* expert, int64_t num_pairs, int64_t num_experts, const char* op)
      : start(num_experts + 1, 0), order(num_pairs) {
    for (int64_t p = 0; p < num_pairs; ++p) {
      TORCH_CHECK(expert[p] >= 0 && expert[p] < num_experts, op, ": expert id ", expert[p], " out of range");
      ++start[expert[p] + 1];
    }
    for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < num_pairs; ++p) order[next[expert[p]]++] = p;
    for (int64_t e = 0; e < num_experts; ++e)
      if (start[e + 1] > start[e]) used.push_back(e);
  }
};

// Checks w ([E, out, in] float32 / bfloat16, or MXFP4 codes [E, out, in / 2] with scales [E, out, in / 32]).
void check_weight(const at::Tensor& w, const std::optional<at::Tensor>& scale, int64_t in, const char* op) {
  if (scale) {
    TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && in % MXFP4_BLOCK == 0 &&
                w.size(2) * 2 == in,
                op, ": MXFP4 weights must be contiguous uint8 [E, out, in / 2], in a multiple of 32");
    TORCH_CHECK(scale->scalar_type() == at::kByte && scale->is_contiguous() &&
                scale->sizes() == at::IntArrayRef({w.size(0), w.size(1), in / MXFP4_BLOCK}),
                op, ": MXFP4 scales must be contiguous uint8 [E, out, in / 32]");
  } else {
    TORCH_CHECK(w.dim() == 3 && w.size(2) == in && w.is_contiguous() &&
                (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
                op, ": weights must be contiguous float32 or bfloat16 [E, out, in] (or MXFP4 with scales)");
  }
}

// out [P, out] = w[expert[p]] @ x[p] for the pairs in groups (x [P, in] float32), the tasks run in parallel.
void multiply(const at::Tensor& w, const std::optional<at::Tensor>& scale, const float* x, int64_t num_pairs,
              int64_t in, const Groups& groups, float* out) {
  const int64_t out_dim = w.size(1);
  // Row slices of at most TASK_ROWS, smaller while there would be fewer than 4 tasks per thread.
  const int64_t used = static_cast<int64_t>(groups.used.size());
  int64_t task_rows = TASK_ROWS;
  while (task_rows > ROWS && used * ((out_dim + task_rows - 1) / task_rows) < 4 * at::get_num_threads())
    task_rows /= 2;
  if (scale)
    run_tasks(Mxfp4Rows{w.data_ptr<uint8_t>(), scale->data_ptr<uint8_t>(), in}, split_chunks(x, num_pairs, in).data(),
              out, in, out_dim, groups.order, groups.start, groups.used, task_rows);
  else if (w.scalar_type() == at::kFloat)
    run_tasks(DenseRows<float>{w.data_ptr<float>(), in}, x, out, in, out_dim, groups.order, groups.start,
              groups.used, task_rows);
  else
    run_tasks(DenseRows<at::BFloat16>{w.data_ptr<at::BFloat16>(), in}, x, out, in, out_dim, groups.order,
              groups.start, groups.used, task_rows);
}

at::Tensor expert_matvec(const at::Tensor& x, const at::Tensor& expert, const at::Tensor& w,
                         const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "expert_matvec: x must be a contiguous float32 [P, in]");
  TORCH_CHECK(expert.dim() == 1 && expert.scalar_type() == at::kLong && expert.size(0) == x.size(0),
              "expert_matvec: expert must be int64 [P]");
  const int64_t num_pairs = x.size(0), in = x.size(1);
  check_weight(w, scale, in, "expert_matvec");
  at::Tensor out = at::empty({num_pairs, w.size(1)}, x.options());
  const at::Tensor ids = expert.contiguous();
  const Groups groups(ids.data_ptr<int64_t>(), num_pairs, w.size(0), "expert_matvec");
  multiply(w, scale, x.data_ptr<float>(), num_pairs, in, groups, out.data_ptr<float>());
  return out;
}

// z [T, D] float32 (strided rows allowed), ids / weights [T, k] (int64 / float32); w1 and w3 [E, I, D] (w3 absent:
// w1 is both, [E, 2I, D], gate rows first), w2 [E, D, I], each float32, bfloat16 or MXFP4 with its scales -> [T, D].
at::Tensor expert_mlp(const at::Tensor& z, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w1,
                      const std::optional<at::Tensor>& w1_scale, const std::optional<at::Tensor>& w3,
                      const std::optional<at::Tensor>& w3_scale, const at::Tensor& w2,
                      const std::optional<at::Tensor>& w2_scale, bool situ, double beta, double linear_beta) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && (z.size(1) <= 1 || z.stride(1) == 1),
              "expert_mlp: z must be float32 rows [T, D] with contiguous values");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == z.size(0) && ids.scalar_type() == at::kLong &&
              weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "expert_mlp: ids int64 and weights float32 [T, k]");
  const int64_t tokens = z.size(0), top_k = ids.size(1), dim = z.size(1), pairs = tokens * top_k;
  check_weight(w1, w1_scale, dim, "expert_mlp");
  const int64_t inter = w3 ? w1.size(1) : w1.size(1) / 2;
  if (w3) {
    check_weight(*w3, w3_scale, dim, "expert_mlp");
    TORCH_CHECK(w3->sizes() == w1.sizes(), "expert_mlp: w1 and w3 must have one shape");
  } else {
    TORCH_CHECK(!w1_scale && w1.size(1) % 2 == 0, "expert_mlp: without w3, w1 is the dense [E, 2I, D] of both");
  }
  check_weight(w2, w2_scale, inter, "expert_mlp");
  TORCH_CHECK(w2.size(0) == w1.size(0) && w2.size(1) == dim, "expert_mlp: w2 must be [E, D, I]");

  const at::Tensor expert = ids.contiguous(), weight = weights.contiguous();
  const Groups groups(expert.data_ptr<int64_t>(), pairs, w1.size(0), "expert_mlp");
  std::vector<float> x(pairs * dim), gate_up(pairs * 2 * inter), hidden(pairs * inter), y(pairs * dim);
  const float* zs = z.data_ptr<float>();
  for (int64_t p = 0; p < pairs; ++p) std::copy_n(zs + p / top_k * z.stride(0), dim, x.data() + p * dim);  // its token
  // Each pair's gate and up: rows of [P, I] each (two products), or the halves of rows of [P, 2I] (w1 as both).
  const float *gate = gate_up.data(), *up = gate_up.data() + pairs * inter;
  int64_t stride = inter;
  if (w3) {
    multiply(w1, w1_scale, x.data(), pairs, dim, groups, gate_up.data());
    multiply(*w3, w3_scale, x.data(), pairs, dim, groups, gate_up.data() + pairs * inter);
  } else {
    multiply(w1, std::nullopt, x.data(), pairs, dim, groups, gate_up.data());
    up = gate + inter, stride = 2 * inter;
  }
  const kestrel_glu::Vec b(static_cast<float>(beta)), lb(static_cast<float>(linear_beta));
  for (int64_t p = 0; p < pairs; ++p)
    kestrel_glu::activate_row(gate + p * stride, up + p * stride, hidden.data() + p * inter, inter, situ, b, lb);
  multiply(w2, w2_scale, hidden.data(), pairs, inter, groups, y.data());

  at::Tensor out = at::zeros({tokens, dim}, z.options());
  float* o = out.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  using Vec = Vectorized<float>;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < top_k; ++j) {           // each product rounded, then added: the torch ops' order
      const Vec w(ws[t * top_k + j]);
      const float* yp = y.data() + (t * top_k + j) * dim;
      float* op = o + t * dim;
      for (int64_t d = 0; d < dim; d += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), dim - d);
        (Vec::loadu(op + d, n) + Vec::loadu(yp + d, n) * w).store(op + d, n);
      }
    }
  return out;
}

}  // namespace expert_matvec_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("expert_matvec(Tensor x, Tensor expert, Tensor w, Tensor? scale=None) -> Tensor");
  m.def("expert_mlp(Tensor z, Tensor ids, Tensor weights, Tensor w1, Tensor? w1_scale, Tensor? w3, Tensor? w3_scale, "
        "Tensor w2, Tensor? w2_scale, bool situ, float beta, float linear_beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) {
  m.impl("expert_matvec", &expert_matvec_kernel::expert_matvec);
  m.impl("expert_mlp", &expert_matvec_kernel::expert_mlp);
}
