// Paged decode attention for the CPU: one query token per sequence against its cached K/V.
//
// The torch reference (kernels/attention.py) gathers every sequence's K blocks into a new tensor,
// runs a batched matmul and a float softmax, then sums value rows with embedding_bag: three passes
// over memory and several allocations per layer. This kernel reads each cached K and V row once,
// straight out of its block, for all the query heads that share it (grouped-query attention), and
// keeps scores and the output accumulator in a small float buffer per (sequence, KV head) task.
// Tasks run on ATen's thread pool (the same OpenMP threads torch's own ops use).
//
// Layouts (see kernels/cache.py):
//   query        [num_seqs, num_heads, head_dim]                       float32 or bfloat16
//   kv_cache     [2, num_kv_heads, num_blocks, block_size, head_dim]   same dtype as query
//   block_tables [num_seqs, max_blocks] int32; context_lens [num_seqs] int32 (including this token)
//   returns      [num_seqs, num_heads, head_dim], the query's dtype
// Scores, softmax and accumulation are float32, like the reference.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(float x) { return x; }

inline float load(at::BFloat16 x) {
  // bfloat16 is the top half of a float32: widening is a shift, which the compiler vectorises.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void store(float value, float* out) { *out = value; }

inline void store(float value, at::BFloat16* out) { *out = at::BFloat16(value); }  // round to nearest even

// s[t] = exp(s[t] - peak) for t < count; returns their sum. With AVX-512: exp(x) = 2^n * 2^f with
// n = round(x * log2 e) and |f| <= 1/2, 2^f = e^(f ln 2) by its Taylor series to degree 6 (relative
// error ~1e-7, float32's own); glibc's scalar expf would otherwise be most of this kernel's time.
inline float exp_and_sum(float* s, int64_t count, float peak) {
  int64_t t = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2 = _mm512_set1_ps(0.693147180559945309f);
  const __m512 c2 = _mm512_set1_ps(1.f / 2), c3 = _mm512_set1_ps(1.f / 6), c4 = _mm512_set1_ps(1.f / 24);
  const __m512 c5 = _mm512_set1_ps(1.f / 120), c6 = _mm512_set1_ps(1.f / 720), one = _mm512_set1_ps(1.f);
  const __m512 floor_ = _mm512_set1_ps(-126.f), top = _mm512_set1_ps(peak);
  __m512 sum = _mm512_setzero_ps();
  for (; t + 16 <= count; t += 16) {
    const __m512 y = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), top), log2e), floor_);
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 z = _mm512_mul_ps(_mm512_sub_ps(y, n), ln2);
    __m512 p = _mm512_fmadd_ps(c6, z, c5);
    p = _mm512_fmadd_ps(p, z, c4);
    p = _mm512_fmadd_ps(p, z, c3);
    p = _mm512_fmadd_ps(p, z, c2);
    p = _mm512_fmadd_ps(p, z, one);
    p = _mm512_fmadd_ps(p, z, one);
    const __m512 e = _mm512_scalef_ps(p, n);
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; t < count; ++t) {
    s[t] = std::exp(s[t] - peak);
    total += s[t];
  }
  return total;
}

#if defined(__AVX512F__)
// 16 elements of a cached row as float32 (bfloat16 is the top half of a float32: a shift).
template <typename T>
inline __m512 widen16(const T* src) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(src));
  }
}

// scores[i] = q . key_i for the `count` rows of one block; q (scaled, float32) stays in registers.
template <typename T, int D>
inline void block_scores(const float* q, const T* block, int64_t count, float* scores) {
  __m512 qv[D / 16];
  for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int64_t i = 0; i < count; ++i) {
    const T* k = block + i * D;
    __m512 sum = _mm512_mul_ps(qv[0], widen16(k));
    for (int c = 1; c < D / 16; ++c) sum = _mm512_fmadd_ps(qv[c], widen16(k + 16 * c), sum);
    scores[i] = _mm512_reduce_add_ps(sum);
  }
}

// acc += sum_i probs[i] * value_i over the `count` rows of one block; acc stays in registers.
template <typename T, int D>
inline void block_values(const float* probs, const T* block, int64_t count, float* acc) {
  __m512 av[D / 16];
  for (int c = 0; c < D / 16; ++c) av[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t i = 0; i < count; ++i) {
    const T* v = block + i * D;
    const __m512 p = _mm512_set1_ps(probs[i]);
    for (int c = 0; c < D / 16; ++c) av[c] = _mm512_fmadd_ps(p, widen16(v + 16 * c), av[c]);
  }
  for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(acc + 16 * c, av[c]);
}
#endif

// The same two steps for any head_dim, in plain C++.
template <typename T>
inline void block_scores_any(const float* q, const T* block, int64_t count, float* scores, int64_t dim) {
  for (int64_t i = 0; i < count; ++i) {
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) dot += q[d] * load(block[i * dim + d]);
    scores[i] = dot;
  }
}

template <typename T>
inline void block_values_any(const float* probs, const T* block, int64_t count, float* acc, int64_t dim) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t d = 0; d < dim; ++d) acc[d] += probs[i] * load(block[i * dim + d]);
}

// Ask for a block's cache lines ahead of use: a sequence's blocks lie anywhere in the cache, so the
// hardware prefetcher, which follows address streams, can't guess where the next one starts.
inline void prefetch_block(const void* block, int64_t bytes) {
  const char* p = static_cast<const char*>(block);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 3);
}

// D > 0: head_dim known at compile time, AVX-512 code where the build has it; D == 0: any head_dim.
// One task is one (sequence, KV head): every query head of the group reads the same blocks, one
// block at a time, so a block is fetched from memory once and re-read from L1 by the other heads.
template <typename T, int D>
void decode_attention(
    const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
    const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t num_blocks, int64_t block_size, int64_t max_blocks, int64_t dim_runtime, float scale) {
  const int64_t dim = D > 0 ? D : dim_runtime;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_stride = num_blocks * block_size * dim;  // one KV head's part of the cache

  auto scores_of = [&](const float* q, const T* block, int64_t count, float* scores) {
#if defined(__AVX512F__)
    if constexpr (D > 0) return block_scores<T, D>(q, block, count, scores);
#endif
    block_scores_any(q, block, count, scores, dim);
  };
  auto add_values = [&](const float* probs, const T* block, int64_t count, float* acc) {
#if defined(__AVX512F__)
    if constexpr (D > 0) return block_values<T, D>(probs, block, count, acc);
#endif
    block_values_any(probs, block, count, acc, dim);
  };

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * dim), acc(group * dim), scores, denominator(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads;
      const int64_t kv_head = task % num_kv_heads;
      const int64_t context = context_lens[seq];
      const int32_t* table = block_tables + seq * max_blocks;
      const T* keys = key_cache + kv_head * head_stride;
      const T* values = value_cache + kv_head * head_stride;
      const T* q_in = query + (seq * num_heads + kv_head * group) * dim;
      T* q_out = out + (seq * num_heads + kv_head * group) * dim;

      for (int64_t i = 0; i < group * dim; ++i) q[i] = load(q_in[i]) * scale;
      scores.resize(group * context);
      const int64_t block_bytes = block_size * dim * static_cast<int64_t>(sizeof(T));
      for (int64_t start = 0; start < context; start += block_size) {
        const T* block = keys + static_cast<int64_t>(table[start / block_size]) * block_size * dim;
        const int64_t count = std::min(block_size, context - start);
        if (start + block_size < context)
          prefetch_block(keys + static_cast<int64_t>(table[start / block_size + 1]) * block_size * dim, block_bytes);
        else
          prefetch_block(values + static_cast<int64_t>(table[0]) * block_size * dim, block_bytes);
        for (int64_t g = 0; g < group; ++g) scores_of(q.data() + g * dim, block, count, scores.data() + g * context + start);
      }

      // Softmax per head; the normalisation is applied to the output at the end.
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * context;
        float peak = -INFINITY;
        for (int64_t t = 0; t < context; ++t) peak = std::max(peak, s[t]);
        denominator[g] = exp_and_sum(s, context, peak);
      }

      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < context; start += block_size) {
        const T* block = values + static_cast<int64_t>(table[start / block_size]) * block_size * dim;
        const int64_t count = std::min(block_size, context - start);
        if (start + block_size < context)
          prefetch_block(values + static_cast<int64_t>(table[start / block_size + 1]) * block_size * dim, block_bytes);
        for (int64_t g = 0; g < group; ++g) add_values(scores.data() + g * context + start, block, count, acc.data() + g * dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = denominator[g] > 0.f ? 1.f / denominator[g] : 0.f;  // an empty context gives zeros
        for (int64_t d = 0; d < dim; ++d) store(acc[g * dim + d] * inv, q_out + g * dim + d);
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, at::Tensor& out, double scale) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const T* keys = kv_cache.data_ptr<T>();
  const T* values = keys + num_kv_heads * num_blocks * block_size * dim;
  auto run = [&](auto dim_constant) {
    decode_attention<T, decltype(dim_constant)::value>(
        query.data_ptr<T>(), keys, values, block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
        out.data_ptr<T>(), num_seqs, num_heads, num_kv_heads, num_blocks, block_size, block_tables.size(1), dim,
        static_cast<float>(scale));
  };
  if (dim == 64) {
    run(std::integral_constant<int, 64>{});
  } else if (dim == 128) {
    run(std::integral_constant<int, 128>{});
  } else {
    run(std::integral_constant<int, 0>{});
  }
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "paged_decode_attention: bad shapes");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "paged_decode_attention: query and cache dtypes differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0, "paged_decode_attention: heads not a multiple of KV heads");
  TORCH_CHECK(query.size(2) == kv_cache.size(4), "paged_decode_attention: head_dim differs from the cache's");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and context_lens must be int32");
  TORCH_CHECK(kv_cache.is_contiguous(), "paged_decode_attention: the cache must be contiguous");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float>(q, kv_cache, tables, lens, out, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_dim<at::BFloat16>(q, kv_cache, tables, lens, out, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
