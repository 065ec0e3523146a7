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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

namespace shardserve {
namespace {

// s[t] = exp(s[t] - peak) for t < count; returns their sum.
inline float exp_and_sum(float* s, int64_t count, float peak) {
  int64_t t = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 top = _mm512_set1_ps(peak);
  __m512 sum = _mm512_setzero_ps();
  for (; t + 16 <= count; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), top));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 top = _mm256_set1_ps(peak);
  __m256 sum = _mm256_setzero_ps();
  for (; t + 8 <= count; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), top));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  total = reduce_add8(sum);
#endif
  for (; t < count; ++t) {
    s[t] = std::exp(s[t] - peak);
    total += s[t];
  }
  return total;
}

#if defined(__AVX512F__)
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

// (the values' step with AVX-512 is block_values_group, below: every head of the group over a block at once)
#elif defined(__AVX2__) && defined(__FMA__)
// The same two steps in 8-lane vectors. AVX2 has 16 vector registers: q is read from L1 (a memory
// operand of the FMA) rather than held, and the value rows are accumulated 64 lanes at a time.
template <typename T, int D>
inline void block_scores(const float* q, const T* block, int64_t count, float* scores) {
  for (int64_t i = 0; i < count; ++i) {
    const T* k = block + i * D;
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(q), widen8(k));
    for (int c = 1; c < D / 8; ++c) sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), widen8(k + 8 * c), sum);
    scores[i] = reduce_add8(sum);
  }
}

template <typename T, int D>
inline void block_values(const float* probs, const T* block, int64_t count, float* acc) {
  constexpr int kPart = D < 64 ? D : 64;  // lanes accumulated in registers per pass over the rows
  for (int part = 0; part < D; part += kPart) {
    __m256 av[kPart / 8];
    for (int c = 0; c < kPart / 8; ++c) av[c] = _mm256_loadu_ps(acc + part + 8 * c);
    for (int64_t i = 0; i < count; ++i) {
      const T* v = block + i * D + part;
      const __m256 p = _mm256_set1_ps(probs[i]);
      for (int c = 0; c < kPart / 8; ++c) av[c] = _mm256_fmadd_ps(p, widen8(v + 8 * c), av[c]);
    }
    for (int c = 0; c < kPart / 8; ++c) _mm256_storeu_ps(acc + part + 8 * c, av[c]);
  }
}
#endif

#if defined(__AVX512F__)
// acc[h] += sum_i probs[h * prob_stride + i] * value_i for NH heads of a group over the `count` rows of one block:
// each value row widened once for all NH heads, the NH accumulators in registers.
template <typename T, int D, int NH>
inline void block_values_heads(const float* probs, int64_t prob_stride, const T* block, int64_t count, float* acc) {
  __m512 av[NH][D / 16];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < D / 16; ++c) av[h][c] = _mm512_loadu_ps(acc + h * D + 16 * c);
  for (int64_t i = 0; i < count; ++i) {
    __m512 v[D / 16];
    for (int c = 0; c < D / 16; ++c) v[c] = widen16(block + i * D + 16 * c);
    for (int h = 0; h < NH; ++h) {
      const __m512 p = _mm512_set1_ps(probs[h * prob_stride + i]);
      for (int c = 0; c < D / 16; ++c) av[h][c] = _mm512_fmadd_ps(p, v[c], av[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(acc + h * D + 16 * c, av[h][c]);
}

// block_values_heads for every head of a group, kValueHeads<D> at a time (their accumulators and a widened row
// within 24 of the 32 vector registers).
template <int D>
constexpr int kValueHeads = D >= 128 ? 2 : 4;

template <typename T, int D>
inline void block_values_group(const float* probs, int64_t prob_stride, const T* block, int64_t count, float* acc,
                               int64_t group) {
  constexpr int kHeads = kValueHeads<D>;
  int64_t g = 0;
  for (; g + kHeads <= group; g += kHeads)
    block_values_heads<T, D, kHeads>(probs + g * prob_stride, prob_stride, block, count, acc + g * D);
  for (; g < group; ++g) block_values_heads<T, D, 1>(probs + g * prob_stride, prob_stride, block, count, acc + g * D);
}
#endif

#if defined(__AVX512BF16__)
// scores[g * prob_stride + i] = scale * (q_g . key_i) for a full block of 16 bfloat16 keys and every head of the
// group, with the products of bfloat16 pairs summed in float32 by vdpbf16ps (each product exact, as the widened
// FMA's are; the sums in another order): one vector of partial sums per key, the 16 keys' vectors summed into one
// vector of 16 scores by sum_lanes16. Rows past `count` are read (they are inside the block) but not stored.
template <int D>
inline void block_scores_bf16(const c10::BFloat16* query, int64_t group, const c10::BFloat16* block, int64_t count,
                              float scale, float* scores, int64_t prob_stride) {
  const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
  for (int64_t g = 0; g < group; ++g) {
    __m512bh q[D / 32];
    for (int c = 0; c < D / 32; ++c)
      q[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(query + g * D + 32 * c));
    __m512 partial[16];
    for (int i = 0; i < 16; ++i) {
      const c10::BFloat16* k = block + i * D;
      __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k)));
      for (int c = 1; c < D / 32; ++c)
        sum = _mm512_dpbf16_ps(sum, q[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + 32 * c)));
      partial[i] = sum;
    }
    _mm512_mask_storeu_ps(scores + g * prob_stride, live, _mm512_mul_ps(sum_lanes16(partial), _mm512_set1_ps(scale)));
  }
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
// hardware prefetcher, which follows address streams, can't guess where the next one starts. Decode asks
// kAhead blocks ahead (a task reads its K blocks, then its V blocks): with the K/V of a batch read from memory,
// not the cache, 4 blocks ahead took 0.84x the time of 1 (96 sequences x 576 tokens over 8 layers' 256 MiB
// caches, Intel Xeon with AMX, docs/BENCHMARKS.md "Decode attention from memory"); 8 no better.
// The lines are asked for into L2 (locality 2, PREFETCHT1), not L1 (3): the engine at concurrency 100 made
// 1.03-1.06x the tokens a second with it, on fresh and on reused blocks (docs/BENCHMARKS.md, "Decode attention
// from memory").
constexpr int64_t kAhead = 4;

inline void prefetch_block(const void* block, int64_t bytes) {
  const char* p = static_cast<const char*>(block);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 2);
}

// D > 0: head_dim known at compile time, AVX-512 or AVX2 code where the build has it; D == 0: any head_dim.
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
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if constexpr (D > 0) return block_scores<T, D>(q, block, count, scores);
#endif
    block_scores_any(q, block, count, scores, dim);
  };
  auto add_values = [&](const float* probs, const T* block, int64_t count, float* acc) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)  // (AVX-512: block_values_group, below)
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
      const int64_t blocks = (context + block_size - 1) / block_size;
      for (int64_t start = 0; start < context; start += block_size) {
        const T* block = keys + static_cast<int64_t>(table[start / block_size]) * block_size * dim;
        const int64_t count = std::min(block_size, context - start);
        const int64_t ahead = start / block_size + kAhead;  // the K blocks, then the V blocks
        if (ahead < blocks)
          prefetch_block(keys + static_cast<int64_t>(table[ahead]) * block_size * dim, block_bytes);
        else if (ahead - blocks < blocks)
          prefetch_block(values + static_cast<int64_t>(table[ahead - blocks]) * block_size * dim, block_bytes);
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16> && D > 0) {
          if (block_size == 16) {
            block_scores_bf16<D>(q_in, group, block, count, scale, scores.data() + start, context);
            continue;
          }
        }
#endif
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
        const int64_t ahead = start / block_size + kAhead;
        if (ahead < blocks)
          prefetch_block(values + static_cast<int64_t>(table[ahead]) * block_size * dim, block_bytes);
#if defined(__AVX512F__)
        if constexpr (D > 0) {
          block_values_group<T, D>(scores.data() + start, context, block, count, acc.data(), group);
          continue;
        }
#endif
        for (int64_t g = 0; g < group; ++g) add_values(scores.data() + g * context + start, block, count, acc.data() + g * dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = denominator[g] > 0.f ? 1.f / denominator[g] : 0.f;  // an empty context gives zeros
        for (int64_t d = 0; d < dim; ++d) store(acc[g * dim + d] * inv, q_out + g * dim + d);
      }
    }
  });
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Prefill attention: each sequence's chunk of queries against its cached context (which ends with
// the chunk's own K/V), causally: query i of a chunk of q_len sits at position context - q_len + i
// and sees keys 0 .. that position. Flash-attention style, float32 throughout, vectorised over
// query rows: a task is (sequence, KV head, tile of up to kQueryTile chunk positions) for every query
// head of the group, R = group * tile rows packed densely and kept transposed ([dim][R]; a short chunk,
// such as a speculative verification of 5 positions, fills one or two row vectors, not one per head), so for each key
// block (16 keys) and a vector of rows (16 with AVX-512, 8 with AVX2) the scores are FMA chains over
// dim, the online softmax is plain vector arithmetic (one lane per row), and the output accumulates
// with the block's values broadcast from a float copy. head_dim: any multiple of 16 up to kMaxDim;
// block size 16.
constexpr int64_t kQueryTile = 64;  // a multiple of 16
constexpr int64_t kKeys = 16;
constexpr int64_t kMaxDim = 256;

#if defined(__AVX512F__)
constexpr int64_t kRowLanes = 16;

// One key block's K and V rows as float32 ([kKeys][dim] each), zeros past `count`.
template <typename T>
inline void widen_block(const T* kb, const T* vb, int64_t count, int64_t dim, float* keys, float* values) {
  for (int64_t j = 0; j < kKeys; ++j) {
    for (int64_t d = 0; d < dim; d += 16) {
      const bool live = j < count;
      _mm512_storeu_ps(keys + j * dim + d, live ? widen16(kb + j * dim + d) : _mm512_setzero_ps());
      _mm512_storeu_ps(values + j * dim + d, live ? widen16(vb + j * dim + d) : _mm512_setzero_ps());
    }
  }
}

// The block of keys start .. start + count - 1 against rows r0 .. r0 + 15: one online-softmax step.
inline void attend_block(const float* q_t, const float* keys, const float* values, int64_t start, int64_t count,
                         const int32_t* row_pos, float* row_max, float* row_sum, float* out_t, int64_t rows,
                         int64_t dim, int64_t r0) {
  const __m512i pos = _mm512_loadu_si512(row_pos + r0);
  if (!_mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(start)))) return;  // none sees it
  __m512 p[kKeys];
  for (int j = 0; j < kKeys; ++j) p[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 qd = _mm512_loadu_ps(q_t + d * rows + r0);
    for (int j = 0; j < kKeys; ++j) p[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(keys[j * dim + d]), p[j]);
  }
  // Online softmax, one lane per row. Key j counts for a row if it exists and is not after it.
  const __m512 old_max = _mm512_loadu_ps(row_max + r0);
  __m512 new_max = old_max;
  __mmask16 visible[kKeys];
  for (int j = 0; j < kKeys; ++j) {
    visible[j] = j < count ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(start + j)), pos) : 0;
    new_max = _mm512_mask_max_ps(new_max, visible[j], new_max, p[j]);
  }
  // Rows that have seen no key yet keep -inf: subtract 0 instead (their lanes are all masked).
  const __m512 shift = _mm512_mask_mov_ps(new_max, _mm512_cmp_ps_mask(new_max, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                          _mm512_setzero_ps());
  const __m512 rescale = exp16(_mm512_sub_ps(old_max, shift));  // ~0 where old_max is -inf
  __m512 total = _mm512_mul_ps(_mm512_loadu_ps(row_sum + r0), rescale);
  for (int j = 0; j < kKeys; ++j) {
    p[j] = _mm512_maskz_mov_ps(visible[j], exp16(_mm512_sub_ps(p[j], shift)));
    total = _mm512_add_ps(total, p[j]);
  }
  _mm512_storeu_ps(row_max + r0, new_max);
  _mm512_storeu_ps(row_sum + r0, total);
  for (int64_t d = 0; d < dim; ++d) {
    float* o_d = out_t + d * rows + r0;
    __m512 o = _mm512_mul_ps(_mm512_loadu_ps(o_d), rescale);
    for (int j = 0; j < kKeys; ++j) o = _mm512_fmadd_ps(p[j], _mm512_set1_ps(values[j * dim + d]), o);
    _mm512_storeu_ps(o_d, o);
  }
}
#else  // AVX2 and FMA
constexpr int64_t kRowLanes = 8;

template <typename T>
inline void widen_block(const T* kb, const T* vb, int64_t count, int64_t dim, float* keys, float* values) {
  for (int64_t j = 0; j < kKeys; ++j) {
    for (int64_t d = 0; d < dim; d += 8) {
      const bool live = j < count;
      _mm256_storeu_ps(keys + j * dim + d, live ? widen8(kb + j * dim + d) : _mm256_setzero_ps());
      _mm256_storeu_ps(values + j * dim + d, live ? widen8(vb + j * dim + d) : _mm256_setzero_ps());
    }
  }
}

// The same for rows r0 .. r0 + 7, in two online-softmax steps of 8 keys: 16 score vectors would not
// fit AVX2's 16 registers beside the query and broadcast ones.
inline void attend_block(const float* q_t, const float* keys, const float* values, int64_t start, int64_t count,
                         const int32_t* row_pos, float* row_max, float* row_sum, float* out_t, int64_t rows,
                         int64_t dim, int64_t r0) {
  constexpr int kStep = 8;
  const __m256i pos = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_pos + r0));
  const __m256i neg_inf_bits = _mm256_castps_si256(_mm256_set1_ps(-INFINITY));
  for (int64_t first = 0; first < count; first += kStep) {
    // A row sees key k where k <= its position, i.e. k - 1 < position; later keys are seen by fewer rows.
    const int32_t key0 = static_cast<int32_t>(start + first);
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(pos, _mm256_set1_epi32(key0 - 1))))) return;
    const float* k_step = keys + first * dim;
    const float* v_step = values + first * dim;
    __m256 p[kStep];
    for (int j = 0; j < kStep; ++j) p[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m256 qd = _mm256_loadu_ps(q_t + d * rows + r0);
      for (int j = 0; j < kStep; ++j) p[j] = _mm256_fmadd_ps(qd, _mm256_set1_ps(k_step[j * dim + d]), p[j]);
    }
    const __m256 old_max = _mm256_loadu_ps(row_max + r0);
    __m256 new_max = old_max;
    __m256 visible[kStep];  // all-ones lanes where the key counts for the row
    for (int j = 0; j < kStep; ++j) {
      visible[j] = first + j < count
                       ? _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos, _mm256_set1_epi32(key0 + j - 1)))
                       : _mm256_setzero_ps();
      new_max = _mm256_blendv_ps(new_max, _mm256_max_ps(new_max, p[j]), visible[j]);
    }
    // -inf found by its bits (an integer compare, which -ffast-math can't fold away): subtract 0 there.
    const __m256 unseen = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_castps_si256(new_max), neg_inf_bits));
    const __m256 shift = _mm256_andnot_ps(unseen, new_max);
    const __m256 rescale = exp8(_mm256_sub_ps(old_max, shift));  // ~0 where old_max is -inf
    __m256 total = _mm256_mul_ps(_mm256_loadu_ps(row_sum + r0), rescale);
    for (int j = 0; j < kStep; ++j) {
      p[j] = _mm256_and_ps(visible[j], exp8(_mm256_sub_ps(p[j], shift)));
      total = _mm256_add_ps(total, p[j]);
    }
    _mm256_storeu_ps(row_max + r0, new_max);
    _mm256_storeu_ps(row_sum + r0, total);
    for (int64_t d = 0; d < dim; ++d) {
      float* o_d = out_t + d * rows + r0;
      __m256 o = _mm256_mul_ps(_mm256_loadu_ps(o_d), rescale);
      for (int j = 0; j < kStep; ++j) o = _mm256_fmadd_ps(p[j], _mm256_set1_ps(v_step[j * dim + d]), o);
      _mm256_storeu_ps(o_d, o);
    }
  }
}
#endif

template <typename T>
void prefill_attention(
    const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
    const int32_t* query_start_loc, const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t num_blocks, int64_t max_blocks, int64_t dim, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_stride = num_blocks * kKeys * dim;
  const int64_t rows = group * kQueryTile;

  struct Task { int64_t seq, kv_head, first; };  // first: the tile's first query, 0-based in the chunk
  std::vector<Task> tasks;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = query_start_loc[seq + 1] - query_start_loc[seq];
    for (int64_t first = 0; first < q_len; first += kQueryTile)
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) tasks.push_back({seq, kv_head, first});
  }
  if (tasks.empty()) return;
  // Later tiles see more keys: deal tasks out round-robin so each thread gets a fair mix.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t worker_begin, int64_t worker_end) {
    std::vector<float> q_t(dim * rows), out_t(dim * rows), keys(kKeys * dim), values(kKeys * dim);
    std::vector<float> row_max(rows), row_sum(rows);
    std::vector<int32_t> row_pos(rows);
    for (int64_t worker = worker_begin; worker < worker_end; ++worker) {
      for (size_t t = worker; t < tasks.size(); t += workers) {
        const Task task = tasks[t];
        const int64_t q_start = query_start_loc[task.seq];
        const int64_t q_len = query_start_loc[task.seq + 1] - q_start;
        const int64_t context = context_lens[task.seq];
        const int64_t tile = std::min(kQueryTile, q_len - task.first);
        const int32_t* table = block_tables + task.seq * max_blocks;
        const T* key_head = key_cache + task.kv_head * head_stride;
        const T* value_head = value_cache + task.kv_head * head_stride;

        // Row r = g * tile + i: query head kv_head * group + g at chunk position first + i; the rows past
        // group * tile, up to a whole vector, are padding (they see no key). `rows` stays the buffers' stride.
        const int64_t live_rows = group * tile;
        const int64_t used_rows = (live_rows + kRowLanes - 1) / kRowLanes * kRowLanes;
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t i = 0; i < tile; ++i) {
            const int64_t r = g * tile + i;
            const T* src = query + ((q_start + task.first + i) * num_heads + task.kv_head * group + g) * dim;
            for (int64_t d = 0; d < dim; ++d) q_t[d * rows + r] = load(src[d]) * scale;
            row_pos[r] = static_cast<int32_t>(context - q_len + task.first + i);
          }
        }
        for (int64_t r = live_rows; r < used_rows; ++r) {
          for (int64_t d = 0; d < dim; ++d) q_t[d * rows + r] = 0.f;
          row_pos[r] = -1;
        }
        for (int64_t d = 0; d < dim; ++d) std::fill_n(out_t.begin() + d * rows, used_rows, 0.f);
        std::fill_n(row_max.begin(), used_rows, -INFINITY);
        std::fill_n(row_sum.begin(), used_rows, 0.f);
        const int64_t last_pos = context - q_len + task.first + tile - 1;

        for (int64_t start = 0; start <= last_pos; start += kKeys) {
          const int64_t count = std::min(kKeys, context - start);
          const int64_t block = table[start / kKeys];
          widen_block(key_head + block * kKeys * dim, value_head + block * kKeys * dim, count, dim, keys.data(),
                      values.data());
          for (int64_t r0 = 0; r0 < used_rows; r0 += kRowLanes)
            attend_block(q_t.data(), keys.data(), values.data(), start, count, row_pos.data(), row_max.data(),
                         row_sum.data(), out_t.data(), rows, dim, r0);
        }
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t i = 0; i < tile; ++i) {
            const int64_t r = g * tile + i;
            const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
            T* dst = out + ((q_start + task.first + i) * num_heads + task.kv_head * group + g) * dim;
            for (int64_t d = 0; d < dim; ++d) store(out_t[d * rows + r] * inv, dst + d);
          }
        }
      }
    }
  });
}
#endif


#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SHARDSERVE_AMX 1
// Prefill attention for bfloat16 on AMX tiles (Intel Sapphire Rapids and later): the two matrix products of
// attention, Q K^T and P V, run as tile multiplies (16 x 32 by 32 x 16 bfloat16 -> float32 per instruction)
// instead of AVX-512 FMAs, which is what let torch's own attention (oneDNN) beat the vector kernel above there.
//
// A task is one (sequence, KV head) chunk, so its keys and values are laid out once for the tiles and shared by
// every query head of the group and every 16-row tile of the chunk:
//   keys:   for each 16 keys and 32 dims, the B operand of Q K^T: 16 rows (dim pairs) x 16 keys x 2 bfloat16s
//           (one gather of a dim pair's 16 keys per row);
//   values: for each 32 keys and 16 dims, the B operand of P V: 16 rows (key pairs) x 16 dims x 2 bfloat16s
//           (one two-source permute of a key pair's rows per 16 dims);
// values zero past the context. The chunk's rows, (query head of the group, position) head by head, are cut into
// tiles of 16: a long chunk's tile is 16 positions of one head, a short chunk (a speculative verification of a few
// positions) packs every head of the group into one tile. For each tile: the scores of every key its last row sees
// (the rows are the A operand, read from `query` with its row stride where they are 16 positions of one head, else
// through a zero-padded copy), each row's softmax in float32 on AVX-512 (scaled, causal, past-the-context keys at
// zero weight), the weights rounded to bfloat16 as the A operand of P V (as torch's bfloat16 attention rounds
// them), and the output normalised by the float32 sums. Every tile is 16 rows x 64 bytes: one configuration
// (common.h load_tile_config). Scores, weights and outputs stay in this thread's buffers. Tiles (the intrinsics take
// their numbers as literals): Q K^T: scores 6, keys 7, the query's 32-dim parts 2-5; P V: outputs 0-3 (16 dims
// each), weights 4, values 5.

// One cache block's 16 keys (`count` of them live) as the B operands of Q K^T, D / 32 of them: row w of part p is
// the dim pair 16 p + w of each key, one 32-bit gather per row; keys past `count` zero.
template <int D>
inline void keys_as_tiles(const uint16_t* block, int64_t count, uint32_t* dst) {
  const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(D / 2));
  const __mmask16 live = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(block);
  for (int w = 0; w < D / 2; ++w)
    _mm512_storeu_si512(dst + (w / 16) * 256 + (w % 16) * 16,
                        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, stride, words + w, 4));
}

// One key pair's value rows (either may be null: past the context, zeros) as row `pair` of the B operands of P V:
// for each 16 dims g, the 16 (first, second) bfloat16 pairs, at dst + g * 256 words.
template <int D>
inline void value_pair_as_tiles(const uint16_t* first, const uint16_t* second, int64_t pair, uint32_t* dst) {
  // output lane 2 d takes the first row's dim d, lane 2 d + 1 the second's (+ 16 for the upper 16 of 32 dims)
  alignas(64) static const uint16_t kLower[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kUpper[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lower = _mm512_load_si512(kLower), upper = _mm512_load_si512(kUpper);
  for (int half = 0; half < D / 32; ++half) {
    const __m512i a = first ? _mm512_loadu_si512(first + half * 32) : _mm512_setzero_si512();
    const __m512i b = second ? _mm512_loadu_si512(second + half * 32) : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + (2 * half) * 256 + pair * 16, _mm512_permutex2var_epi16(a, lower, b));
    _mm512_storeu_si512(dst + (2 * half + 1) * 256 + pair * 16, _mm512_permutex2var_epi16(a, upper, b));
  }
}

template <int D>
void prefill_attention_amx(const c10::BFloat16* query, const c10::BFloat16* key_cache,
                           const c10::BFloat16* value_cache, const int32_t* block_tables,
                           const int32_t* query_start_loc, const int32_t* context_lens, c10::BFloat16* out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                           int64_t max_blocks, float scale) {
  constexpr int kParts = D / 32;   // Q K^T: 32 dims per tile multiply
  constexpr int kGroups = D / 16;  // P V: 16 output dims per tile
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_stride = num_blocks * kKeys * D;
  const int64_t row_stride = num_heads * D;  // between one query token's rows of `query` and `out`

  struct Task { int64_t seq, kv_head, cost; };
  std::vector<Task> tasks;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = query_start_loc[seq + 1] - query_start_loc[seq];
    if (q_len == 0) continue;
    // the keys' and values' layout costs about what a tile of rows does over them
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
      tasks.push_back({seq, kv_head, (group * q_len + 16) * context_lens[seq]});
  }
  if (tasks.empty()) return;
  // Longest first, each thread taking the next when it is free: chunks differ in length.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    load_tile_config();
    std::vector<uint32_t> keys_t;       // [key chunk of 16][part][16 dim pairs][16 keys]
    std::vector<uint32_t> value_pairs;  // [key chunk of 32][dim group][16 key pairs][16 dims]
    std::vector<float> scores;          // [16 rows][keys, padded to 32]
    std::vector<uint16_t> weights;      // [16 rows][keys, padded to 32] bfloat16
    alignas(64) uint16_t q_pad[16 * D];
    alignas(64) float outputs[16][16 * kGroups];
    float sums[16];
    int64_t row_head[16], row_pos[16];  // a tile's rows: query head, position in the chunk
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      const Task task = tasks[t];
      const int64_t q_start = query_start_loc[task.seq];
      const int64_t q_len = query_start_loc[task.seq + 1] - q_start;
      const int64_t context = context_lens[task.seq];
      const int32_t* table = block_tables + task.seq * max_blocks;
      const uint16_t* key_head = reinterpret_cast<const uint16_t*>(key_cache + task.kv_head * head_stride);
      const uint16_t* value_head = reinterpret_cast<const uint16_t*>(value_cache + task.kv_head * head_stride);
      const int64_t padded = (context + 31) / 32 * 32;

      // The keys as B operands of Q K^T (the chunks of 16 that hold a key), the values as B operands of P V
      // (every chunk of 32, zero past the context).
      keys_t.resize(padded * D / 2);
      value_pairs.resize(padded * D / 2);
      // (blocks asked for kAhead ahead, as decode does: the K blocks, then the V blocks)
      const int64_t blocks = (context + kKeys - 1) / kKeys, block_bytes = kKeys * D * 2;
      for (int64_t c = 0; c < blocks; ++c) {
        const int64_t ahead = c + kAhead;
        if (ahead < blocks)
          prefetch_block(key_head + static_cast<int64_t>(table[ahead]) * kKeys * D, block_bytes);
        else if (ahead - blocks < blocks)
          prefetch_block(value_head + static_cast<int64_t>(table[ahead - blocks]) * kKeys * D, block_bytes);
        keys_as_tiles<D>(key_head + static_cast<int64_t>(table[c]) * kKeys * D, std::min(kKeys, context - c * kKeys),
                         keys_t.data() + c * kParts * 256);
      }
      for (int64_t key = 0; key < padded; key += 2) {
        auto row = [&](int64_t k) -> const uint16_t* {
          return k < context ? value_head + static_cast<int64_t>(table[k / kKeys]) * kKeys * D + k % kKeys * D
                             : nullptr;
        };
        if (key % kKeys == 0 && key / kKeys + kAhead < blocks)
          prefetch_block(value_head + static_cast<int64_t>(table[key / kKeys + kAhead]) * kKeys * D, block_bytes);
        value_pair_as_tiles<D>(row(key), row(key + 1), key % 32 / 2, value_pairs.data() + (key / 32) * kGroups * 256);
      }
      scores.resize(16 * padded);
      weights.resize(16 * padded);

      const int64_t total_rows = group * q_len;  // row r: head kv_head * group + r / q_len, position r % q_len
      for (int64_t first_row = 0; first_row < total_rows; first_row += 16) {
        const int64_t rows = std::min<int64_t>(16, total_rows - first_row);
        int64_t last_pos = 0;
        for (int64_t i = 0; i < rows; ++i) {
          row_head[i] = task.kv_head * group + (first_row + i) / q_len;
          row_pos[i] = (first_row + i) % q_len;
          last_pos = std::max(last_pos, row_pos[i]);
        }
        const int64_t seen = context - q_len + last_pos + 1;  // keys the tile's last row sees
        const int64_t chunks16 = (seen + 15) / 16, chunks32 = (seen + 31) / 32;

        // The rows as A operands: straight from `query` where they are 16 positions of one head, else a
        // zero-padded copy (no read past `query`).
        const c10::BFloat16* q_rows = query + (q_start + row_pos[0]) * row_stride + row_head[0] * D;
        int64_t q_stride = row_stride * 2;
        if (rows < 16 || row_head[0] != row_head[15]) {
          for (int64_t i = 0; i < 16; ++i) {
            if (i < rows)
              std::memcpy(q_pad + i * D, query + (q_start + row_pos[i]) * row_stride + row_head[i] * D, D * 2);
            else
              std::fill_n(q_pad + i * D, D, uint16_t{0});
          }
          q_rows = reinterpret_cast<const c10::BFloat16*>(q_pad);
          q_stride = D * 2;
        }
        _tile_loadd(2, q_rows, q_stride);
        _tile_loadd(3, q_rows + 32, q_stride);
        if constexpr (kParts > 2) {
          _tile_loadd(4, q_rows + 64, q_stride);
          _tile_loadd(5, q_rows + 96, q_stride);
        }
        for (int64_t c = 0; c < chunks16; ++c) {
          const uint32_t* k = keys_t.data() + c * kParts * 256;
          _tile_zero(6);
          _tile_loadd(7, k, 64);
          _tile_dpbf16ps(6, 2, 7);
          _tile_loadd(7, k + 256, 64);
          _tile_dpbf16ps(6, 3, 7);
          if constexpr (kParts > 2) {
            _tile_loadd(7, k + 512, 64);
            _tile_dpbf16ps(6, 4, 7);
            _tile_loadd(7, k + 768, 64);
            _tile_dpbf16ps(6, 5, 7);
          }
          _tile_stored(6, scores.data() + c * 16, padded * 4);
        }

        // Softmax of each row over the keys it sees, in float32; weights in bfloat16, zero elsewhere up to the
        // tile's last chunk of 32 (a padding row's weights are whatever is there: its outputs are not read).
        for (int64_t i = 0; i < rows; ++i) {
          float* s = scores.data() + i * padded;
          uint16_t* w = weights.data() + i * padded;
          const int64_t visible = context - q_len + row_pos[i] + 1;
          __m512 peak = _mm512_set1_ps(-INFINITY);
          int64_t k = 0;
          for (; k + 16 <= visible; k += 16) peak = _mm512_max_ps(peak, _mm512_loadu_ps(s + k));
          if (k < visible) {
            const __mmask16 m = static_cast<__mmask16>((1u << (visible - k)) - 1);
            peak = _mm512_mask_max_ps(peak, m, peak, _mm512_maskz_loadu_ps(m, s + k));
          }
          const float top = _mm512_reduce_max_ps(peak);
          const __m512 top_v = _mm512_set1_ps(top), scale_v = _mm512_set1_ps(scale);
          __m512 total = _mm512_setzero_ps();
          for (k = 0; k < chunks32 * 32; k += 16) {
            const int64_t left = visible - k;
            const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
            // (scores past chunks16 * 16 were not computed this tile: masked, never read as numbers)
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + k), top_v), scale_v)));
            total = _mm512_add_ps(total, e);
            narrow16(reinterpret_cast<c10::BFloat16*>(w + k), e);
          }
          sums[i] = _mm512_reduce_add_ps(total);
        }

        // P V, 4 output tiles (64 dims) at a time.
        for (int64_t pass = 0; pass < kGroups; pass += 4) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t c = 0; c < chunks32; ++c) {
            const uint32_t* v = value_pairs.data() + (c * kGroups + pass) * 256;
            _tile_loadd(4, weights.data() + c * 32, padded * 2);
            _tile_loadd(5, v, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(5, v + 256, 64);
            _tile_dpbf16ps(1, 4, 5);
            _tile_loadd(5, v + 512, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, v + 768, 64);
            _tile_dpbf16ps(3, 4, 5);
          }
          _tile_stored(0, &outputs[0][0], sizeof(outputs[0]));
          _tile_stored(1, &outputs[0][16], sizeof(outputs[0]));
          _tile_stored(2, &outputs[0][32], sizeof(outputs[0]));
          _tile_stored(3, &outputs[0][48], sizeof(outputs[0]));
          for (int64_t i = 0; i < rows; ++i) {
            const __m512 inv = _mm512_set1_ps(sums[i] > 0.f ? 1.f / sums[i] : 0.f);
            c10::BFloat16* dst = out + (q_start + row_pos[i]) * row_stride + row_head[i] * D + pass * 16;
            for (int64_t d = 0; d < 64; d += 16) narrow16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(&outputs[i][d]), inv));
          }
        }
      }
    }
    _tile_release();
  });
}
#endif  // AMX

}  // namespace

// The kernels read blocks straight from the table: check, before any read, that every block a
// sequence's context covers exists (entries past the context are never read and may be anything).
void check_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t block_size, int64_t num_blocks,
                  const char* what) {
  TORCH_CHECK(tables.dim() == 2 && lens.dim() == 1 && lens.size(0) == tables.size(0), what,
              ": block_tables [num_seqs, max_blocks] and context_lens [num_seqs] disagree");
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  const int64_t max_blocks = tables.size(1);
  for (int64_t seq = 0; seq < tables.size(0); ++seq) {
    const int64_t used = (static_cast<int64_t>(len[seq]) + block_size - 1) / block_size;
    TORCH_CHECK(len[seq] >= 0 && used <= max_blocks, what, ": context of ", len[seq], " tokens exceeds its ",
                max_blocks, "-block table");
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(table[seq * max_blocks + b] >= 0 && table[seq * max_blocks + b] < num_blocks, what,
                  ": block id ", table[seq * max_blocks + b], " outside the cache's ", num_blocks, " blocks");
  }
}

// What both attention kernels require of their inputs (the block tables are checked by check_tables).
void check_attention_inputs(const at::Tensor& query, const at::Tensor& kv_cache, const char* what) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, what, ": bad shapes");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), what, ": query and cache dtypes differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0, what, ": heads not a multiple of KV heads");
  TORCH_CHECK(query.size(2) == kv_cache.size(4), what, ": head_dim differs from the cache's");
  TORCH_CHECK(kv_cache.is_contiguous(), what, ": the cache must be contiguous");
}

// Whether bfloat16 prefill attention with this head_dim and block size runs on AMX tiles here (the build and the
// CPU have AMX, the OS lets the process use it, head_dim 64 or 128, blocks of 16 keys).
bool prefill_uses_amx(at::ScalarType dtype, int64_t head_dim, int64_t block_size) {
#if defined(SHARDSERVE_AMX)
  return dtype == at::kBFloat16 && (head_dim == 64 || head_dim == 128) && block_size == kKeys && amx_permitted();
#else
  return false;
#endif
}

bool prefill_amx_available() { return prefill_uses_amx(at::kBFloat16, 64, kKeys); }

bool prefill_supported(int64_t head_dim, int64_t block_size) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return head_dim % 16 == 0 && head_dim <= kMaxDim && block_size == kKeys;
#else
  return false;
#endif
}

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                   const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale) {
  check_attention_inputs(query, kv_cache, "paged_prefill_attention");
  TORCH_CHECK(prefill_supported(query.size(2), kv_cache.size(3)),
              "paged_prefill_attention: needs AVX-512 or AVX2, head_dim a multiple of 16 (<= 256) and block_size 16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "paged_prefill_attention: block_tables, query_start_loc and context_lens must be int32");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor starts = query_start_loc.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  check_tables(tables, lens, kv_cache.size(3), kv_cache.size(2), "paged_prefill_attention");
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) == tables.size(0) + 1, "paged_prefill_attention: query_start_loc "
              "must have num_seqs + 1 entries");
  {
    const int32_t* start = starts.data_ptr<int32_t>();
    const int32_t* len = lens.data_ptr<int32_t>();
    TORCH_CHECK(start[0] == 0 && start[tables.size(0)] == q.size(0), "paged_prefill_attention: query_start_loc "
                "must run from 0 to the number of query tokens");
    for (int64_t seq = 0; seq < tables.size(0); ++seq)
      TORCH_CHECK(start[seq + 1] >= start[seq] && start[seq + 1] - start[seq] <= len[seq],
                  "paged_prefill_attention: a chunk longer than its context, or query_start_loc not ascending");
  }
  at::Tensor out = at::empty_like(q);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2), dim = q.size(2);
  // the vector kernel
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* keys = kv_cache.data_ptr<T>();
    prefill_attention<T>(q.data_ptr<T>(), keys, keys + num_kv_heads * num_blocks * kKeys * dim,
                         tables.data_ptr<int32_t>(), starts.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                         out.data_ptr<T>(), tables.size(0), q.size(1), num_kv_heads, num_blocks, tables.size(1), dim,
                         static_cast<float>(scale));
  };
#if defined(SHARDSERVE_AMX)
  if (prefill_uses_amx(q.scalar_type(), dim, kv_cache.size(3))) {
    // every chunk on the tiles, the short ones (a speculative verification) too: their rows pack the group's
    // query heads into one tile, and the keys' and values' layout is vector code
    using BF16 = c10::BFloat16;
    const BF16* keys = kv_cache.data_ptr<BF16>();
    const BF16* values = keys + num_kv_heads * num_blocks * kKeys * dim;
    auto amx = [&](auto dim_constant) {
      prefill_attention_amx<decltype(dim_constant)::value>(
          q.data_ptr<BF16>(), keys, values, tables.data_ptr<int32_t>(), starts.data_ptr<int32_t>(),
          lens.data_ptr<int32_t>(), out.data_ptr<BF16>(), tables.size(0), q.size(1), num_kv_heads, num_blocks,
          tables.size(1), static_cast<float>(scale));
    };
    if (dim == 64) amx(std::integral_constant<int, 64>{});
    else amx(std::integral_constant<int, 128>{});
    return out;
  }
#endif
  dispatch_float(q, "paged_prefill_attention", run);
#endif
  return out;
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
  check_attention_inputs(query, kv_cache, "paged_decode_attention");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and context_lens must be int32");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  check_tables(tables, lens, kv_cache.size(3), kv_cache.size(2), "paged_decode_attention");
  TORCH_CHECK(lens.size(0) == q.size(0), "paged_decode_attention: one context length per query");
  at::Tensor out = at::empty_like(q);
  dispatch_float(q, "paged_decode_attention", [&](auto* tag) {
    dispatch_dim<std::remove_pointer_t<decltype(tag)>>(q, kv_cache, tables, lens, out, scale);
  });
  return out;
}

}  // namespace shardserve
