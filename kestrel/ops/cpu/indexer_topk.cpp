// kestrel_cpu::indexer_topk: the lightning indexer's top-k positions for T query tokens, read straight from the
// paged index-key cache, without ever holding a token's scores over its whole context (kestrel.ops.cpu).
//
// I[t, s] = sum_h w[t, h] (relu(q[t, h] . k[s]) * D^-0.5) over the positions s <= positions[t] of its sequence;
// each dot product is one fused multiply-add per d from zero, d ascending, and the heads are summed the same way,
// h ascending: the order of the batch-invariant products (kestrel.ops.batch_invariant), so the scores equal the
// torch reference's under `invariant()` bit for bit, and never depend on the batch.
//
// Keys are read KEY_BLOCK positions at a time, converted to float (FP8 ones times their scale, then rounded to q's
// dtype, as `read_rows` dequantizes them) and transposed, kt [D, KEY_BLOCK], so that a vector holds one
// coordinate of consecutive keys: each query token of a tile (up to QUERY_TILE consecutive tokens of one sequence,
// which see the same keys) then scores a block with broadcast query values and no horizontal sums. The kept
// candidates of each token are those above its running threshold (the topk-th best so far: positions come in
// ascending order, so a later equal score never outranks a kept one); a full candidate buffer is cut back to the
// topk best by a partial selection. Tiles run in parallel; with fewer tiles than threads, each tile's positions are
// split into segments whose candidates are merged (each segment's topk hold every overall winner from it).
// A tile of one token (a decode step's) scores V keys at a time transposed in registers instead (float keys of one
// page straight from the cache): no transposed block to write and read back, the same sums in the same order.
// The result: [T, topk] int64 positions, best first (higher score, then earlier position: a stable descending sort's
// order, `kestrel.ops.torch.indexer.topk_positions`), -1 after the last where a token sees fewer than topk keys.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace indexer_topk_kernel {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int64_t KEY_BLOCK = 256;          // positions transposed at a time (a multiple of 4 vectors)
constexpr int64_t QUERY_TILE = 128;         // tokens that share each transposed block
constexpr int64_t MIN_SEGMENT = 4096;       // fewest positions worth a segment of their own

struct Candidate {
  float score;
  int64_t position;
};

bool better(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.position < b.position);
}

// One token's best positions so far, offered in ascending position order.
class Best {
 public:
  explicit Best(int64_t topk) : topk_(topk) { kept_.reserve(2 * topk); }

  // The scores of positions first, first + 1, ... (count of them).
  void offer_all(const float* scores, int64_t count, int64_t first) {
    int64_t j = 0;
    for (; j + V <= count; j += V) {                 // most vectors hold no score above the threshold
      const Vec above = Vec::loadu(scores + j) > Vec(threshold_);
      if (above.zero_mask() != (1 << V) - 1) offer_each(scores, j, j + V, first);
    }
    offer_each(scores, j, count, first);
  }

  // The topk best (or all), in no particular order.
  std::vector<Candidate>& finish() {
    if (static_cast<int64_t>(kept_.size()) > topk_) cut();
    return kept_;
  }

 private:
  void offer_each(const float* scores, int64_t begin, int64_t end, int64_t first) {
    for (int64_t j = begin; j < end; ++j) {
      if (!(scores[j] > threshold_)) continue;
      kept_.push_back({scores[j], first + j});
      if (static_cast<int64_t>(kept_.size()) == 2 * topk_) cut();
    }
  }

  void cut() {
    std::nth_element(kept_.begin(), kept_.begin() + topk_ - 1, kept_.end(), better);
    kept_.resize(topk_);
    threshold_ = kept_.back().score;
  }

  int64_t topk_;
  float threshold_ = -std::numeric_limits<float>::infinity();
  std::vector<Candidate> kept_;
};

#if defined(CPU_CAPABILITY_AVX512)
using Register = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using Register = __m256;
#else
using Register = Vec;
#endif

// V rows of V floats (src, rows ld apart) transposed: out[j] holds column j, a coordinate of V consecutive keys.
// In registers where ATen's vectors are AVX-512 or AVX2 (its transpose_mxn takes ~4x as long with masked loads and
// stores).
inline void transpose(const float* src, int64_t ld, Register* out) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
  for (int i = 0; i < 16; i += 2) {                   // rows i, i + 1 interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {                   // r[i + j]: rows i..i+3 of column j of each 128-bit lane
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int g = 0; g < 16; g += 8)                     // lanes of rows g..g+3 and g+4..g+7 gathered
    for (int j = 0; j < 4; ++j) {
      t[g + j] = _mm512_shuffle_f32x4(r[g + j], r[g + 4 + j], 0x88);
      t[g + 4 + j] = _mm512_shuffle_f32x4(r[g + j], r[g + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {                       // and the two halves of the rows
    out[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    out[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  for (int i = 0; i < 8; i += 2) {                    // rows i, i + 1 interleaved
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {                    // r[i + j]: rows i..i+3 of column j of each 128-bit lane
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {                       // and the two halves of the rows
    out[j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x20);
    out[4 + j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x31);
  }
#else
  float column[V];
  for (int64_t j = 0; j < V; ++j) {
    for (int64_t i = 0; i < V; ++i) column[i] = src[i * ld + j];
    out[j] = Vec::loadu(column);
  }
#endif
}

// Every FP8 E4M3 code's value.
const std::array<float, 256> FP8_VALUES = [] {
  std::array<float, 256> values;
  for (int code = 0; code < 256; ++code)
    values[code] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
  return values;
}();

// A key's stored value as a float (FP8 through the table of its codes).
template <typename Key>
inline float widen(Key key) {
  if constexpr (std::is_same_v<Key, c10::Float8_e4m3fn>) return FP8_VALUES[key.x];
  else return static_cast<float>(key);
}

// Where the paged index keys of a sequence (its page table row `table`) are.
template <typename Key>
struct Keys {
  const Key* data;                         // [R, D]
  const float* scales;                     // [R] (FP8 keys) or null
  const int64_t* table;
  int64_t page_size, dim;

  // Positions first..first + n - 1 as float rows out [n, D]: scaled (FP8), then rounded to the query's dtype
  // (Round), as `read_rows` dequantizes them.
  template <typename Round>
  void convert(int64_t first, int64_t n, float* out) const {
    int64_t page = first / page_size, offset = first % page_size;
    for (int64_t i = 0; i < n; ++i, ++offset, out += dim) {
      if (offset == page_size) offset = 0, ++page;
      const int64_t index = table[page] * page_size + offset;
      const Key* key = data + index * dim;
      const float scale = scales ? scales[index] : 1.f;
      for (int64_t d = 0; d < dim; ++d)
        out[d] = static_cast<float>(static_cast<Round>(scales ? widen(key[d]) * scale : widen(key[d])));
    }
  }

  // Positions first..first + n - 1 (n <= GROUP) as float rows [n, D]: in place where they are a whole GROUP of
  // float keys in one page that need no rounding (a reader may then read all GROUP rows), else converted into
  // buffer [GROUP, D].
  template <typename Round, int64_t GROUP>
  const float* rows(int64_t first, int64_t n, float* buffer) const {
    if constexpr (std::is_same_v<Key, float> && std::is_same_v<Round, float>) {
      if (n == GROUP && first % page_size + n <= page_size)
        return reinterpret_cast<const float*>(data) + (table[first / page_size] * page_size + first % page_size) * dim;
    }
    convert<Round>(first, n, buffer);
    return buffer;
  }

  // Asks for the rows of positions first..first + n - 1 ahead of their use. Inlined: GCC finds a function of
  // prefetches free of side effects and drops calls of it.
  [[gnu::always_inline]] void prefetch(int64_t first, int64_t n) const {
    int64_t page = first / page_size, offset = first % page_size;
    for (int64_t i = 0; i < n; ++i, ++offset) {
      if (offset == page_size) offset = 0, ++page;
      const char* bytes = reinterpret_cast<const char*>(data + (table[page] * page_size + offset) * dim);
      for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(Key)); b += 64) __builtin_prefetch(bytes + b, 0, 0);
    }
  }
};

// The positions [first, last) as floats into kt [D, KEY_BLOCK], 16 keys at a time (Keys::rows), transposed V x V.
template <typename Key, typename Round>
void load_block(const Keys<Key>& keys, int64_t first, int64_t last, float* rows, float* kt) {
  const int64_t dim = keys.dim;
  for (int64_t s0 = first; s0 < last; s0 += 16) {
    const int64_t n = std::min<int64_t>(16, last - s0);
    keys.prefetch(s0 + 16, std::max<int64_t>(0, std::min<int64_t>(16, last - s0 - 16)));
    const float* source = keys.template rows<Round, 16>(s0, n, rows);
    float* column = kt + (s0 - first);
    int64_t d0 = 0;
    if (n == 16)
      for (; d0 + V <= dim; d0 += V)
        for (int64_t i0 = 0; i0 < 16; i0 += V) {
          Register out[V];
          transpose(source + i0 * dim + d0, dim, out);
          for (int64_t j = 0; j < V; ++j) Vec(out[j]).store(column + (d0 + j) * KEY_BLOCK + i0);
        }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = d0; d < dim; ++d) column[d * KEY_BLOCK + i] = source[i * dim + d];
  }
}

// scores[u][j] = I of token u (q [Q][H, D], w [Q][H]) for the block's first `count` keys (kt [D, KEY_BLOCK]), 4
// vectors of keys at a time, each loaded once for the Q tokens.
template <int Q>
void score_block(const float* const* q, const float* const* w, const float* kt, int64_t heads, int64_t dim,
                 float scale, int64_t count, float (*scores)[KEY_BLOCK]) {
  const Vec zero(0.f), scale_v(scale);
  for (int64_t j0 = 0; j0 < count; j0 += 4 * V) {
    Vec total[Q][4];
    for (int u = 0; u < Q; ++u)
      for (int i = 0; i < 4; ++i) total[u][i] = zero;
    for (int64_t h = 0; h < heads; ++h) {
      Vec dot[Q][4];
      for (int u = 0; u < Q; ++u)
        for (int i = 0; i < 4; ++i) dot[u][i] = zero;
      for (int64_t d = 0; d < dim; ++d) {
        const float* row = kt + d * KEY_BLOCK + j0;
        const Vec k0 = Vec::loadu(row), k1 = Vec::loadu(row + V), k2 = Vec::loadu(row + 2 * V),
                  k3 = Vec::loadu(row + 3 * V);
        for (int u = 0; u < Q; ++u) {
          const Vec qd(q[u][h * dim + d]);
          dot[u][0] = at::vec::fmadd(qd, k0, dot[u][0]);
          dot[u][1] = at::vec::fmadd(qd, k1, dot[u][1]);
          dot[u][2] = at::vec::fmadd(qd, k2, dot[u][2]);
          dot[u][3] = at::vec::fmadd(qd, k3, dot[u][3]);
        }
      }
      for (int u = 0; u < Q; ++u) {
        const Vec wh(w[u][h]);
        for (int i = 0; i < 4; ++i)
          total[u][i] = at::vec::fmadd(at::vec::maximum(dot[u][i], zero) * scale_v, wh, total[u][i]);
      }
    }
    for (int u = 0; u < Q; ++u)
      for (int i = 0; i < 4; ++i) total[u][i].store(scores[u] + j0 + i * V);
  }
}

// Tokens scored together: as many as the vector registers hold accumulators for (32 with AVX-512, 16 otherwise).
constexpr int PAIR = V == 16 ? 2 : 1;

struct Tile {
  int64_t first, count, seq, end;          // tokens [first, first + count) of sequence seq; positions < end
};

struct Problem {
  const std::vector<Tile>& tiles;
  int64_t segments;                        // per tile
  const float *q, *w;                      // [T, H, D], [T, H]
  const void* keys;                        // [R, D]
  const float* scales;                     // [R] (FP8 keys) or null
  const int64_t *table, *positions;        // [N, width], [T]
  int64_t width, page_size, heads, dim, topk;

  template <typename Key>
  Keys<Key> keys_of(int64_t seq) const {
    return {static_cast<const Key*>(keys), scales, table + seq * width, page_size, dim};
  }
};

// One token's scores (q [H, D], w [H]) of V keys (rows [V, D], rows ld apart), D in blocks of V transposed in
// registers: each key's dot products one fused multiply-add per d from zero, d ascending, its heads summed h
// ascending, as score_block sums. acc: [H] scratch.
void score_keys(const float* rows, int64_t ld, const float* q, const float* w, int64_t heads, int64_t dim,
                float scale, Vec* acc, float* scores) {
  const Vec zero(0.f);
  for (int64_t h = 0; h < heads; ++h) acc[h] = zero;
  int64_t d0 = 0;
  for (; d0 + V <= dim; d0 += V) {
    Register column[V];
    transpose(rows + d0, ld, column);
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + h * dim + d0;
      Vec a = acc[h];
      for (int64_t j = 0; j < V; ++j) a = at::vec::fmadd(Vec(qh[j]), Vec(column[j]), a);
      acc[h] = a;
    }
  }
  for (; d0 < dim; ++d0) {                             // a D that is no multiple of V
    float values[V];
    for (int64_t i = 0; i < V; ++i) values[i] = rows[i * ld + d0];
    const Vec column = Vec::loadu(values);
    for (int64_t h = 0; h < heads; ++h) acc[h] = at::vec::fmadd(Vec(q[h * dim + d0]), column, acc[h]);
  }
  Vec total = zero;
  const Vec scale_v(scale);
  for (int64_t h = 0; h < heads; ++h)
    total = at::vec::fmadd(at::vec::maximum(acc[h], zero) * scale_v, Vec(w[h]), total);
  total.store(scores);
}

// A one-token tile's candidates among positions [lo, hi), V keys at a time.
template <typename Key, typename Round>
void scan_one(const Problem& p, const Tile& tile, int64_t lo, int64_t hi, Best& best) {
  const int64_t t = tile.first;
  const float *q = p.q + t * p.heads * p.dim, *w = p.w + t * p.heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(p.dim));
  const Keys<Key> keys = p.keys_of<Key>(tile.seq);
  std::vector<float> rows(V * p.dim, 0.f);
  std::vector<Vec> acc(p.heads);
  float scores[V];
  constexpr int64_t AHEAD = 4 * V;                     // keys prefetched ahead of their scores
  hi = std::min(hi, p.positions[t] + 1);
  for (int64_t s0 = lo; s0 < hi; s0 += V) {
    const int64_t n = std::min<int64_t>(V, hi - s0);
    keys.prefetch(s0 + AHEAD, std::max<int64_t>(0, std::min<int64_t>(V, hi - s0 - AHEAD)));
    score_keys(keys.template rows<Round, V>(s0, n, rows.data()), p.dim, q, w, p.heads, p.dim, scale, acc.data(),
               scores);
    best.offer_all(scores, n, s0);
  }
}

// The tile's tokens' candidates among positions [lo, hi).
template <typename Key, typename Round>
void scan(const Problem& p, const Tile& tile, int64_t lo, int64_t hi, std::vector<Best>& best) {
  std::vector<float> kt(p.dim * KEY_BLOCK, 0.f), rows(16 * p.dim);
  float scores[PAIR][KEY_BLOCK];
  const float scale = 1.f / std::sqrt(static_cast<float>(p.dim));
  const Keys<Key> keys = p.keys_of<Key>(tile.seq);
  for (int64_t first = lo; first < hi; first += KEY_BLOCK) {
    const int64_t last = std::min(first + KEY_BLOCK, hi);
    load_block<Key, Round>(keys, first, last, rows.data(), kt.data());
    for (int64_t i = 0; i < tile.count; i += PAIR) {
      const int64_t together = std::min<int64_t>(PAIR, tile.count - i);
      const float* q[PAIR];
      const float* w[PAIR];
      int64_t count[PAIR], most = 0;
      for (int64_t u = 0; u < together; ++u) {
        const int64_t t = tile.first + i + u;
        q[u] = p.q + t * p.heads * p.dim;
        w[u] = p.w + t * p.heads;
        count[u] = std::min(last, p.positions[t] + 1) - first;
        most = std::max(most, count[u]);
      }
      if (most <= 0) continue;
      if (together == PAIR) score_block<PAIR>(q, w, kt.data(), p.heads, p.dim, scale, most, scores);
      else score_block<1>(q, w, kt.data(), p.heads, p.dim, scale, most, scores);
      for (int64_t u = 0; u < together; ++u)
        best[i + u].offer_all(scores[u], std::max<int64_t>(count[u], 0), first);
    }
  }
}

// found[t * segments + segment]: token t's best candidates in each segment of its tile's positions.
template <typename Key, typename Round>
void run(const Problem& p, std::vector<std::vector<Candidate>>& found) {
  at::parallel_for(0, static_cast<int64_t>(p.tiles.size()) * p.segments, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const Tile& tile = p.tiles[unit / p.segments];
      const int64_t segment = unit % p.segments;
      const int64_t share = (tile.end + 16 * p.segments - 1) / (16 * p.segments) * 16;   // whole groups of 16
      const int64_t lo = std::min(segment * share, tile.end), hi = std::min(lo + share, tile.end);
      std::vector<Best> best(tile.count, Best(p.topk));
      if (tile.count == 1) scan_one<Key, Round>(p, tile, lo, hi, best[0]);
      else scan<Key, Round>(p, tile, lo, hi, best);
      for (int64_t i = 0; i < tile.count; ++i) found[(tile.first + i) * p.segments + segment] = best[i].finish();
    }
  });
}

at::Tensor indexer_topk(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& keys,
                        const std::optional<at::Tensor>& key_scales, const at::Tensor& page_table, int64_t page_size,
                        const at::Tensor& seq_index, const at::Tensor& positions, int64_t topk) {
  TORCH_CHECK(q.dim() == 3 && weights.dim() == 2 && weights.size(0) == q.size(0) && weights.size(1) == q.size(1) &&
              keys.dim() == 2 && keys.size(1) == q.size(2), "indexer_topk: q [T, H, D], weights [T, H], keys [R, D]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat, "indexer_topk: weights must be float32");
  const at::ScalarType key_dtype = keys.scalar_type(), query_dtype = q.scalar_type();
  const bool fp8 = key_dtype == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == key_scales.has_value(), "indexer_topk: FP8 keys need their scales, other keys none");
  TORCH_CHECK(query_dtype == at::kFloat || query_dtype == at::kBFloat16 || query_dtype == at::kHalf,
              "indexer_topk: q must be float32, bfloat16 or float16");
  TORCH_CHECK(fp8 || key_dtype == at::kFloat || key_dtype == at::kBFloat16 || key_dtype == at::kHalf,
              "indexer_topk: keys must be float32, bfloat16, float16 or FP8 E4M3");
  TORCH_CHECK(keys.is_contiguous() && page_table.scalar_type() == at::kLong && page_table.dim() == 2 &&
              seq_index.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
              seq_index.numel() == q.size(0) && positions.numel() == q.size(0) && page_size > 0 && topk > 0,
              "indexer_topk: contiguous keys, page_table int64 [N, P], seq_index and positions int64 [T]");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const at::Tensor qf = q.to(at::kFloat).contiguous(), w = weights.contiguous(), table = page_table.contiguous();
  const at::Tensor seq_t = seq_index.contiguous(), pos_t = positions.contiguous();
  const int64_t *seq = seq_t.data_ptr<int64_t>(), *position = pos_t.data_ptr<int64_t>();
  at::Tensor scales;
  if (fp8) {
    scales = key_scales->contiguous();
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == keys.size(0),
                "indexer_topk: key_scales float32 [R]");
  }

  std::vector<Tile> tiles;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(seq[t] >= 0 && seq[t] < table.size(0), "indexer_topk: seq_index ", seq[t], " out of range");
    TORCH_CHECK(position[t] < table.size(1) * page_size, "indexer_topk: position ", position[t],
                " past the page table");
    if (tiles.empty() || tiles.back().seq != seq[t] || tiles.back().count == QUERY_TILE)
      tiles.push_back({t, 0, seq[t], 0});
    tiles.back().count += 1;
    tiles.back().end = std::max(tiles.back().end, position[t] + 1);
  }
  std::vector<int64_t> reach(table.size(0), 0);           // positions read of each sequence
  for (const Tile& tile : tiles) reach[tile.seq] = std::max(reach[tile.seq], tile.end);
  const int64_t* table_data = table.data_ptr<int64_t>();
  for (int64_t n = 0; n < table.size(0); ++n)              // every row read is in the cache
    for (int64_t page = 0; page * page_size < reach[n]; ++page) {
      const int64_t p = table_data[n * table.size(1) + page];
      TORCH_CHECK(p >= 0 && (p + 1) * page_size <= keys.size(0), "indexer_topk: page ", p, " outside the cache");
    }
  const int64_t longest = reach.empty() ? 0 : *std::max_element(reach.begin(), reach.end());
  const int64_t threads = at::get_num_threads(), count = static_cast<int64_t>(tiles.size());
  const int64_t segments = count >= threads ? 1
      : std::max<int64_t>(1, std::min((threads + count - 1) / count, longest / MIN_SEGMENT));

  std::vector<std::vector<Candidate>> found(tokens * segments);
  const Problem problem{tiles, segments, qf.data_ptr<float>(), w.data_ptr<float>(), keys.data_ptr(),
                        fp8 ? scales.data_ptr<float>() : nullptr, table_data, position, table.size(1), page_size,
                        heads, dim, topk};
  // Keys in another dtype than q are rounded to q's after dequantizing, as read_rows does.
  const bool rounds = key_dtype != query_dtype;
  auto by_key = [&]<typename Key>() {
    if (rounds && query_dtype == at::kBFloat16) run<Key, c10::BFloat16>(problem, found);
    else if (rounds && query_dtype == at::kHalf) run<Key, c10::Half>(problem, found);
    else run<Key, float>(problem, found);
  };
  if (fp8) by_key.template operator()<c10::Float8_e4m3fn>();
  else if (key_dtype == at::kBFloat16) by_key.template operator()<c10::BFloat16>();
  else if (key_dtype == at::kHalf) by_key.template operator()<c10::Half>();
  else by_key.template operator()<float>();

  at::Tensor out = at::empty({tokens, topk}, page_table.options());
  int64_t* out_data = out.data_ptr<int64_t>();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::vector<Candidate> all;
      for (int64_t s = 0; s < segments; ++s) {
        const auto& part = found[t * segments + s];
        all.insert(all.end(), part.begin(), part.end());
      }
      const int64_t kept = std::min<int64_t>(topk, all.size());
      std::partial_sort(all.begin(), all.begin() + kept, all.end(), better);
      for (int64_t j = 0; j < topk; ++j) out_data[t * topk + j] = j < kept ? all[j].position : -1;
    }
  });
  return out;
}

}  // namespace indexer_topk_kernel

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("indexer_topk(Tensor q, Tensor weights, Tensor keys, Tensor? key_scales, Tensor page_table, int page_size, "
        "Tensor seq_index, Tensor positions, int topk) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("indexer_topk", &indexer_topk_kernel::indexer_topk); }
