// The structured-output mask on CPU, kernels/bitmask.py's contract: logits[rows[i], t] = -inf wherever bit t
// of bitmask[i] is clear. A word of all ones (every token of its 32 allowed, the common case inside a
// JSON string) is skipped with one compare; any other word is two masked stores of -inf with AVX-512,
// four blends with AVX2 (32 branch-free selects without either).

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace shardserve {

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be [rows, vocab] float32 with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt, "apply_token_bitmask: bitmask must be int32 2-D");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: rows must be int64 [", bitmask.size(0), "]");
  const int64_t vocab = logits.size(1), num_rows = logits.size(0);
  const int64_t words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask: ", words, " words cannot cover ", vocab, " tokens");
  const at::Tensor mask = bitmask.contiguous(), row_ids = rows.contiguous();
  const int32_t* mask_data = mask.data_ptr<int32_t>();
  const int64_t* row_data = row_ids.data_ptr<int64_t>();
  float* logits_data = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(row_data[i] >= 0 && row_data[i] < num_rows, "apply_token_bitmask: row ", row_data[i], " out of range");
  }
  // one thread: 0.56 ms at 100 x 32,000 random bits; ATen's pool cost more than that on 2 busy cores
  for (int64_t i = 0; i < rows.size(0); ++i) {
    float* x = logits_data + row_data[i] * stride;
    const int32_t* row_mask = mask_data + i * words;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t word = static_cast<uint32_t>(row_mask[w]);
      if (word == 0xFFFFFFFFu) continue;
      float* chunk = x + w * 32;
      const int64_t n = std::min<int64_t>(32, vocab - w * 32);
      if (n == 32) {
#if defined(__AVX512F__)
        // two masked stores of -inf where the bits are clear: nothing is read
        const __m512 fill = _mm512_set1_ps(neg_inf);
        _mm512_mask_storeu_ps(chunk, static_cast<__mmask16>(~word & 0xFFFFu), fill);
        _mm512_mask_storeu_ps(chunk + 16, static_cast<__mmask16>(~word >> 16), fill);
#elif defined(__AVX2__)
        // bit j shifted up to lane j's sign bit, which blendv reads: set keeps the logit, clear takes -inf
        const __m256 fill = _mm256_set1_ps(neg_inf);
        const __m256i bits = _mm256_set1_epi32(static_cast<int32_t>(word));
        for (int q = 0; q < 4; ++q) {
          const __m256i to_sign = _mm256_setr_epi32(31 - 8 * q, 30 - 8 * q, 29 - 8 * q, 28 - 8 * q, 27 - 8 * q,
                                                    26 - 8 * q, 25 - 8 * q, 24 - 8 * q);
          const __m256 keep = _mm256_castsi256_ps(_mm256_sllv_epi32(bits, to_sign));
          _mm256_storeu_ps(chunk + 8 * q, _mm256_blendv_ps(fill, _mm256_loadu_ps(chunk + 8 * q), keep));
        }
#else
        for (int j = 0; j < 32; ++j) chunk[j] = ((word >> j) & 1u) ? chunk[j] : neg_inf;
#endif
      } else {
        for (int64_t j = 0; j < n; ++j) chunk[j] = ((word >> j) & 1u) ? chunk[j] : neg_inf;
      }
    }
  }
}

}  // namespace shardserve
