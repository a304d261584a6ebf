// kestrel_cpu::paged_mla: absorbed-form MLA attention straight from the paged latent cache, dense or over the
// indexer's selected positions (kestrel.ops.cpu; the math is kestrel.ops.torch.paged_attention.paged_mla_decode's).
//
// Query token t (sequence seq_index[t], at positions[t]) attends to its visible rows: positions 0..positions[t], or
// those of selected[t] at or before it. Each row (float32, bfloat16, or FP8 E4M3 times its scale, widened to float32
// as read_rows does) is read where it lies once per token and head block; every head of the block takes its score
// scale * q[t, h] . row and folds the row's first value_dim values into an online softmax (a running maximum, the
// sum of exponentials and the weighted values, rescaled when the maximum grows). No [T, S, Dk] gather and no [T, H,
// S] score matrix: a token's work is its visible rows times its heads. A token with no visible row gets zeros.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace paged_mla_kernel {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();

struct Problem {
  const float* q;            // [T, H, Dk]
  const void* values;        // [R, Dk]
  const float* scales;       // [R] (FP8 rows) or null
  const int64_t* table;      // [N, P]
  const int64_t* seq;        // [T]
  const int64_t* position;   // [T]
  const int64_t* selected;   // [T, K] or null
  int64_t columns, page_size, heads, dim, value_dim, listed;
  float scale;
};

inline float dot(const float* a, const float* b, int64_t n) {
  Vec total(0.f);
  int64_t i = 0;
  for (; i + V <= n; i += V) total = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), total);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out = out * keep + weight * row over n values.
inline void fold(float* out, float keep, float weight, const float* row, int64_t n) {
  int64_t i = 0;
  for (; i + V <= n; i += V)
    at::vec::fmadd(Vec(weight), Vec::loadu(row + i), Vec::loadu(out + i) * Vec(keep)).store(out + i);
  for (; i < n; ++i) out[i] = out[i] * keep + weight * row[i];
}

// Heads [h0, h1) of token t into out [T, H, value_dim].
template <typename Value>
void attend(const Problem& pb, int64_t t, int64_t h0, int64_t h1, float* out, std::vector<float>& row,
            std::vector<float>& maximum, std::vector<float>& total) {
  const int64_t heads = h1 - h0, position = pb.position[t];
  const int64_t* table_row = pb.table + pb.seq[t] * pb.columns;
  const Value* values = static_cast<const Value*>(pb.values);
  float* o = out + (t * pb.heads + h0) * pb.value_dim;
  std::fill(o, o + heads * pb.value_dim, 0.f);
  std::fill(maximum.begin(), maximum.begin() + heads, -std::numeric_limits<float>::infinity());
  std::fill(total.begin(), total.begin() + heads, 0.f);
  const auto visit = [&](int64_t p) {
    const int64_t r = table_row[p / pb.page_size] * pb.page_size + p % pb.page_size;
    const Value* source = values + r * pb.dim;
    const float* v = row.data();
    if constexpr (std::is_same_v<Value, float>) {
      v = source;                                  // float32 rows are read in place
    } else if constexpr (std::is_same_v<Value, c10::Float8_e4m3fn>) {
      const float s = pb.scales[r];
      for (int64_t d = 0; d < pb.dim; ++d) row[d] = static_cast<float>(source[d]) * s;
    } else {
      for (int64_t d = 0; d < pb.dim; ++d) row[d] = static_cast<float>(source[d]);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float score = pb.scale * dot(pb.q + (t * pb.heads + h0 + h) * pb.dim, v, pb.dim);
      float keep = 1.f;
      if (score > maximum[h]) {
        keep = std::exp(maximum[h] - score);       // 0 for the first row
        maximum[h] = score;
      }
      const float weight = std::exp(score - maximum[h]);
      total[h] = total[h] * keep + weight;
      fold(o + h * pb.value_dim, keep, weight, v, pb.value_dim);
    }
  };
  if (pb.selected) {
    for (int64_t j = 0; j < pb.listed; ++j) {
      const int64_t p = pb.selected[t * pb.listed + j];
      if (p >= 0 && p <= position) visit(p);
    }
  } else {
    for (int64_t p = 0; p <= position; ++p) visit(p);
  }
  for (int64_t h = 0; h < heads; ++h) {
    if (total[h] == 0.f) continue;               // no visible row: zeros
    const Vec inverse(1.f / total[h]);
    float* y = o + h * pb.value_dim;
    int64_t i = 0;
    for (; i + V <= pb.value_dim; i += V) (Vec::loadu(y + i) * inverse).store(y + i);
    for (; i < pb.value_dim; ++i) y[i] /= total[h];
  }
}

at::Tensor paged_mla(const at::Tensor& q, const at::Tensor& values, const std::optional<at::Tensor>& scales,
                     const at::Tensor& page_table, int64_t page_size, const at::Tensor& seq_index,
                     const at::Tensor& positions, double scale, int64_t value_dim,
                     const std::optional<at::Tensor>& selected) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_mla: q must be a contiguous float32 [T, H, Dk]");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const at::ScalarType dtype = values.scalar_type();
  const bool fp8 = dtype == at::kFloat8_e4m3fn;
  TORCH_CHECK(values.dim() == 2 && values.size(1) == dim && values.is_contiguous() &&
              (fp8 || dtype == at::kFloat || dtype == at::kBFloat16),
              "paged_mla: values must be contiguous float32, bfloat16 or FP8 E4M3 rows [R, Dk]");
  TORCH_CHECK(fp8 == scales.has_value() && (!fp8 || (scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                                                     scales->numel() == values.size(0))),
              "paged_mla: FP8 values need their float32 scales [R], other values none");
  TORCH_CHECK(page_table.dim() == 2 && page_table.scalar_type() == at::kLong && seq_index.scalar_type() == at::kLong &&
              positions.scalar_type() == at::kLong && seq_index.numel() == tokens && positions.numel() == tokens &&
              page_size > 0 && value_dim > 0 && value_dim <= dim,
              "paged_mla: page_table int64 [N, P], seq_index and positions int64 [T], 0 < value_dim <= Dk");
  TORCH_CHECK(!selected || (selected->dim() == 2 && selected->size(0) == tokens &&
                            selected->scalar_type() == at::kLong),
              "paged_mla: selected must be int64 [T, K]");
  const at::Tensor table = page_table.contiguous(), seq_t = seq_index.contiguous(), pos_t = positions.contiguous();
  const at::Tensor chosen = selected ? selected->contiguous() : at::Tensor();
  const int64_t *seq = seq_t.data_ptr<int64_t>(), *position = pos_t.data_ptr<int64_t>();
  const int64_t* table_data = table.data_ptr<int64_t>();
  const int64_t columns = table.size(1), pages = values.size(0) / page_size;
  std::vector<int64_t> reach(table.size(0), 0);         // positions each sequence's tokens may read
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(seq[t] >= 0 && seq[t] < table.size(0), "paged_mla: seq_index ", seq[t], " out of range");
    TORCH_CHECK(position[t] >= 0 && position[t] < columns * page_size, "paged_mla: position ", position[t],
                " outside the page table");
    reach[seq[t]] = std::max(reach[seq[t]], position[t] + 1);
  }
  for (int64_t n = 0; n < table.size(0); ++n)             // every row read lies in the cache
    for (int64_t c = 0; c * page_size < reach[n]; ++c) {
      const int64_t p = table_data[n * columns + c];
      TORCH_CHECK(p >= 0 && p < pages, "paged_mla: page ", p, " outside the cache");
    }
  at::Tensor out = at::empty({tokens, heads, value_dim}, q.options());
  const Problem pb{q.data_ptr<float>(), values.data_ptr(), fp8 ? scales->data_ptr<float>() : nullptr, table_data,
                   seq, position, selected ? chosen.data_ptr<int64_t>() : nullptr, columns, page_size, heads, dim,
                   value_dim, selected ? chosen.size(1) : 0, static_cast<float>(scale)};
  // Tasks: a token's heads in blocks, as many blocks as keep every thread busy when the tokens are few.
  const int64_t threads = at::get_num_threads();
  const int64_t blocks = std::min(heads, std::max<int64_t>(1, (threads + tokens - 1) / std::max<int64_t>(tokens, 1)));
  const int64_t block = (heads + blocks - 1) / blocks;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens * blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<float> row(dim), maximum(block), total(block);
    for (int64_t task = first; task < last; ++task) {
      const int64_t t = task / blocks, h0 = (task % blocks) * block, h1 = std::min(heads, h0 + block);
      if (h0 >= h1) continue;
      if (fp8) attend<c10::Float8_e4m3fn>(pb, t, h0, h1, o, row, maximum, total);
      else if (dtype == at::kBFloat16) attend<c10::BFloat16>(pb, t, h0, h1, o, row, maximum, total);
      else attend<float>(pb, t, h0, h1, o, row, maximum, total);
    }
  });
  return out;
}

}  // namespace paged_mla_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("paged_mla(Tensor q, Tensor values, Tensor? scales, Tensor page_table, int page_size, Tensor seq_index, "
        "Tensor positions, float scale, int value_dim, Tensor? selected) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("paged_mla", &paged_mla_kernel::paged_mla); }
