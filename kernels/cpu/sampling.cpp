// Token selection on CPU, kernels/sampling.py's contract: temperature, top-k, top-p, min-p and an
// inverse-transform draw with one counter-based uniform per row. A row without filters is two passes
// over its logits (the max; then exp, stored, with float64 partial sums per 256-token chunk) and a
// walk over the chunk sums to the one chunk the draw lands in. A small top-k gathers its few candidates
// in one vectorised pass (bounded by the maxima of 16-token groups) and finishes the row on them; else
// top-k and top-p find their threshold by radix selection over the logits' order-preserving integer
// keys (a histogram of the top 11 bits, then the next 11 among the one bucket that holds the threshold,
// then the last 10), not by sorting.
// Rows run in parallel on ATen's thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "common.h"

namespace shardserve {
namespace {

constexpr int64_t kChunk = 256;  // tokens per float64 partial sum
constexpr float kMinExponent = -87.f;  // exp below this underflows float32's normal range: weight 0

// Order-preserving: a < b as floats (not NaN) iff order_key(a) < order_key(b) as unsigned integers.
inline uint32_t order_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

inline float key_value(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
  m = reduce_max8(acc);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

int64_t first_index_of(const float* x, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] == value) return i;
  }
  return 0;  // a row of NaNs
}

// The largest logit v such that the elements with logit >= v weigh at least `target` (weight 1 each
// when `weights` is null: top-k's count; else weights[i]: top-p's mass). -inf when nothing reaches it.
float select_threshold(const float* x, const float* weights, int64_t n, double target) {
  static constexpr int kShifts[3] = {21, 10, 0};
  static constexpr int kWidths[3] = {11, 11, 10};
  std::vector<double> histogram(1 << 11);
  std::vector<int32_t> candidates, next;
  double above = 0.0;  // weight of the elements above the bucket being refined
  uint32_t prefix = 0;  // the key bits fixed so far
  for (int round = 0; round < 3; ++round) {
    const int shift = kShifts[round];
    const uint32_t num_buckets = 1u << kWidths[round];
    std::fill(histogram.begin(), histogram.begin() + num_buckets, 0.0);
    auto count = [&](int64_t i) {
      const double w = weights != nullptr ? weights[i] : 1.0;
      if (w > 0.0 && x[i] == x[i]) histogram[(order_key(x[i]) >> shift) & (num_buckets - 1)] += w;
    };
    if (round == 0) {
      for (int64_t i = 0; i < n; ++i) count(i);
    } else {
      for (int32_t i : candidates) count(i);
    }
    int64_t chosen = -1;
    double heavier = 0.0;  // weight of this round's buckets above `chosen`
    for (int64_t b = num_buckets - 1; b >= 0; --b) {
      if (above + heavier + histogram[b] >= target) {
        chosen = b;
        break;
      }
      heavier += histogram[b];
    }
    if (chosen < 0) return -std::numeric_limits<float>::infinity();  // rounding: keep everything
    above += heavier;
    prefix |= static_cast<uint32_t>(chosen) << shift;
    if (round == 2) break;
    const uint32_t fixed = ~0u << shift;
    next.clear();
    auto collect = [&](int64_t i) {
      const bool weighs = weights == nullptr || weights[i] > 0.f;
      if (weighs && x[i] == x[i] && (order_key(x[i]) & fixed) == prefix) next.push_back(static_cast<int32_t>(i));
    };
    if (round == 0) {
      for (int64_t i = 0; i < n; ++i) collect(i);
    } else {
      for (int32_t i : candidates) collect(i);
    }
    candidates.swap(next);
  }
  return key_value(prefix);
}

// e[i] = exp((x[i] - max) / T) where x[i] >= floor, else 0; float64 sums per chunk; returns the total.
double fill_probs(const float* x, int64_t n, float max, float inv_temperature, float floor, float* e,
                  double* chunk_sums) {
  double total = 0.0;
  for (int64_t begin = 0, c = 0; begin < n; begin += kChunk, ++c) {
    const int64_t end = std::min(n, begin + kChunk);
    double sum = 0.0;
    int64_t i = begin;
#if defined(__AVX512F__)
    const __m512 vmax = _mm512_set1_ps(max), vinv = _mm512_set1_ps(inv_temperature);
    const __m512 vfloor = _mm512_set1_ps(floor), vmin_exp = _mm512_set1_ps(kMinExponent);
    __m512d acc = _mm512_setzero_pd();
    for (; i + 16 <= end; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __m512 arg = _mm512_mul_ps(_mm512_sub_ps(v, vmax), vinv);
      const __mmask16 keep =
          _mm512_cmp_ps_mask(v, vfloor, _CMP_GE_OQ) & _mm512_cmp_ps_mask(arg, vmin_exp, _CMP_GE_OQ);
      const __m512 p = _mm512_maskz_mov_ps(keep, exp16(arg));
      _mm512_storeu_ps(e + i, p);
      const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1));
      acc = _mm512_add_pd(acc, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(p)), _mm512_cvtps_pd(high)));
    }
    sum = _mm512_reduce_add_pd(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vmax = _mm256_set1_ps(max), vinv = _mm256_set1_ps(inv_temperature);
    const __m256 vfloor = _mm256_set1_ps(floor), vmin_exp = _mm256_set1_ps(kMinExponent);
    __m256d acc = _mm256_setzero_pd();
    for (; i + 8 <= end; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 arg = _mm256_mul_ps(_mm256_sub_ps(v, vmax), vinv);
      const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, vfloor, _CMP_GE_OQ), _mm256_cmp_ps(arg, vmin_exp, _CMP_GE_OQ));
      const __m256 p = _mm256_and_ps(keep, exp8(arg));
      _mm256_storeu_ps(e + i, p);
      acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(p)),
                                             _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1))));
    }
    const __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(acc), _mm256_extractf128_pd(acc, 1));
    sum = _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
#endif
    for (; i < end; ++i) {
      const float arg = (x[i] - max) * inv_temperature;
      e[i] = x[i] >= floor && arg >= kMinExponent ? std::exp(arg) : 0.f;
      sum += e[i];
    }
    chunk_sums[c] = sum;
    total += sum;
  }
  return total;
}

// Zero e[i] where x[i] < floor or e[i] < min_p (e is relative to the largest, so that is min-p);
// refresh the chunk sums; returns the new total.
double apply_floor(const float* x, int64_t n, float floor, float min_p, float* e, double* chunk_sums) {
  double total = 0.0;
  for (int64_t begin = 0, c = 0; begin < n; begin += kChunk, ++c) {
    const int64_t end = std::min(n, begin + kChunk);
    double sum = 0.0;
    for (int64_t i = begin; i < end; ++i) {
      e[i] = x[i] >= floor && e[i] >= min_p ? e[i] : 0.f;
      sum += e[i];
    }
    chunk_sums[c] = sum;
    total += sum;
  }
  return total;
}

// The first token whose running mass (float64, vocabulary order) passes target.
int64_t draw(const float* e, int64_t n, const double* chunk_sums, double target) {
  double cumulative = 0.0;
  for (int64_t begin = 0, c = 0; begin < n; begin += kChunk, ++c) {
    if (cumulative + chunk_sums[c] <= target) {
      cumulative += chunk_sums[c];
      continue;
    }
    const int64_t end = std::min(n, begin + kChunk);
    for (int64_t i = begin; i < end; ++i) {
      cumulative += e[i];
      if (cumulative > target) return i;
    }
    // the chunk's sum (another summation order) crossed, its elements did not: on to the next chunk
  }
  for (int64_t i = n - 1; i >= 0; --i) {  // rounding left the target at the very end
    if (e[i] > 0.f) return i;
  }
  return 0;
}

// For a small top-k: the k-th largest logit and the indices at or above it (vocabulary order), without
// a pass of scalar work over the row. The maxima of 16-token groups bound it from below (the k largest
// group maxima are k distinct logits), so only the tokens at or above the k-th largest group maximum
// can be among the top k: they are gathered in one vectorised pass and selected among. False when k is
// too large for that bound (more than the number of groups / 4): the caller uses radix selection.
bool top_k_candidates(const float* x, int64_t n, int64_t k, std::vector<float>& scratch,
                      std::vector<int32_t>& candidates, float* threshold) {
  const int64_t num_groups = n / 16;
  if (k > num_groups / 4) return false;
  scratch.resize(num_groups);
#if defined(__AVX512F__)
  for (int64_t g = 0; g < num_groups; ++g) scratch[g] = _mm512_reduce_max_ps(_mm512_loadu_ps(x + 16 * g));
#elif defined(__AVX2__) && defined(__FMA__)
  for (int64_t g = 0; g < num_groups; ++g)
    scratch[g] = reduce_max8(_mm256_max_ps(_mm256_loadu_ps(x + 16 * g), _mm256_loadu_ps(x + 16 * g + 8)));
#else
  for (int64_t g = 0; g < num_groups; ++g) scratch[g] = *std::max_element(x + 16 * g, x + 16 * g + 16);
#endif
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
  const float bound = scratch[k - 1];
  candidates.clear();
  for (int64_t i = 0; i < n; ++i) {  // compilers vectorise the compare; the pushes are rare
    if (x[i] >= bound) candidates.push_back(static_cast<int32_t>(i));
  }
  scratch.resize(candidates.size());
  for (size_t j = 0; j < candidates.size(); ++j) scratch[j] = x[candidates[j]];
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
  *threshold = scratch[k - 1];
  size_t kept = 0;
  for (int32_t i : candidates) {
    if (x[i] >= *threshold) candidates[kept++] = i;
  }
  candidates.resize(kept);
  return true;
}

// The rest of a row whose top-k left few candidates: top-p, min-p and the draw over them alone.
int64_t sample_candidates(const float* x, const std::vector<int32_t>& candidates, float max, float inv_temperature,
                          float top_p, float min_p, double uniform, std::vector<float>& e) {
  e.resize(candidates.size());
  double total = 0.0;
  for (size_t j = 0; j < candidates.size(); ++j) {
    e[j] = std::exp((x[candidates[j]] - max) * inv_temperature);
    total += e[j];
  }
  float floor = -std::numeric_limits<float>::infinity();
  if (top_p < 1.f) {  // the smallest head by probability holding top_p of the mass (ties with its last stay)
    std::vector<int32_t> order(candidates.size());
    for (size_t j = 0; j < order.size(); ++j) order[j] = static_cast<int32_t>(j);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[candidates[a]] > x[candidates[b]]; });
    const double target = static_cast<double>(top_p) * total;
    double mass = 0.0;
    for (int32_t j : order) {
      mass += e[j];
      if (mass >= target) {
        floor = x[candidates[j]];
        break;
      }
    }
  }
  total = 0.0;
  for (size_t j = 0; j < candidates.size(); ++j) {
    if (x[candidates[j]] < floor || e[j] < min_p) e[j] = 0.f;
    total += e[j];
  }
  const double target = uniform * total;
  double cumulative = 0.0;
  for (size_t j = 0; j < candidates.size(); ++j) {
    cumulative += e[j];
    if (cumulative > target) return candidates[j];
  }
  for (size_t j = candidates.size(); j-- > 0;) {  // rounding left the target at the very end
    if (e[j] > 0.f) return candidates[j];
  }
  return candidates.empty() ? 0 : candidates.back();
}

struct RowScratch {
  std::vector<float> e;  // [vocab] the row's unnormalised kept probabilities
  std::vector<double> chunk_sums;
  std::vector<float> values;  // top-k selection
  std::vector<int32_t> candidates;
};

int64_t sample_row(const float* x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                   double uniform, RowScratch& scratch) {
  const float max = row_max(x, vocab);
  if (temperature == 0.f) return first_index_of(x, vocab, max);
  float floor = -std::numeric_limits<float>::infinity();
  if (top_k > 0 && top_k < vocab) {
    if (top_k_candidates(x, vocab, top_k, scratch.values, scratch.candidates, &floor)) {
      return sample_candidates(x, scratch.candidates, max, 1.f / temperature, top_p, min_p, uniform, scratch.values);
    }
    floor = select_threshold(x, nullptr, vocab, static_cast<double>(top_k));
  }
  float* e = scratch.e.data();
  double* chunk_sums = scratch.chunk_sums.data();
  double total = fill_probs(x, vocab, max, 1.f / temperature, floor, e, chunk_sums);
  if (top_p < 1.f) floor = std::max(floor, select_threshold(x, e, vocab, static_cast<double>(top_p) * total));
  if (top_p < 1.f || min_p > 0.f) total = apply_floor(x, vocab, floor, min_p, e, chunk_sums);
  return draw(e, vocab, chunk_sums, uniform * total);
}

void check_row_param(const at::Tensor& t, int64_t rows, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == rows, "sample_tokens: ", name, " must be [", rows, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, "sample_tokens: ", name, " must be ", dtype, ", got ", t.scalar_type());
}

}  // namespace

at::Tensor sample_tokens(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                         const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "sample_tokens: logits must be [rows, vocab] float32, got ", logits.sizes(), " ", logits.scalar_type());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_row_param(temperature, rows, at::kFloat, "temperature");
  check_row_param(top_k, rows, at::kInt, "top_k");
  check_row_param(top_p, rows, at::kFloat, "top_p");
  check_row_param(min_p, rows, at::kFloat, "min_p");
  check_row_param(uniforms, rows, at::kDouble, "uniforms");
  const at::Tensor x = logits.contiguous();
  const at::Tensor temp = temperature.contiguous(), k = top_k.contiguous(), p = top_p.contiguous();
  const at::Tensor mp = min_p.contiguous(), u = uniforms.contiguous();
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x_data = x.data_ptr<float>();
  const float* temp_data = temp.data_ptr<float>();
  const int32_t* k_data = k.data_ptr<int32_t>();
  const float* p_data = p.data_ptr<float>();
  const float* mp_data = mp.data_ptr<float>();
  const double* u_data = u.data_ptr<double>();
  int64_t* out_data = out.data_ptr<int64_t>();
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    RowScratch scratch;
    scratch.e.resize(vocab);
    scratch.chunk_sums.resize(num_chunks);
    for (int64_t r = begin; r < end; ++r) {
      out_data[r] = sample_row(x_data + r * vocab, vocab, temp_data[r], k_data[r], p_data[r], mp_data[r], u_data[r],
                               scratch);
    }
  });
  return out;
}

}  // namespace shardserve
