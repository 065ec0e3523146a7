// Fused CPU versions of the model's small per-token ops: RMSNorm (with the residual add before it),
// SiLU-and-multiply, and rotary embedding. Each is one pass over its rows on ATen's thread pool instead
// of the references' five to ten torch ops (each a full pass over memory and a dispatch). They compute
// what the references (kernels/norm.py, activation.py, rotary.py) compute, in the same order and with
// the same roundings to the tensor dtype between steps, in float32; only summation orders (the mean
// of squares) and exp (a polynomial, ~1e-7 relative) differ in the last bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace shardserve {
namespace {

// A value as the tensor dtype would hold it (float: itself; bfloat16: rounded to nearest even).
template <typename T>
inline float round_to(float value) {
  if constexpr (std::is_same_v<T, float>) {
    return value;
  } else {
    return load(T(value));
  }
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* residual, int64_t residual_stride, const T* weight, T* out,
                   T* sum_out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      const T* rr = residual != nullptr ? residual + r * residual_stride : nullptr;
      T* sr = sum_out != nullptr ? sum_out + r * hidden : nullptr;
      T* o = out + r * hidden;
      float squares = 0.f;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= hidden; i += 16) {
        __m512 v = widen16(xr + i);
        if (rr != nullptr) {  // x + residual, in the dtype: it is also the next residual
          v = round16<T>(_mm512_add_ps(v, widen16(rr + i)));
          narrow16(sr + i, v);
        }
        _mm512_storeu_ps(row.data() + i, v);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      squares = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
      __m256 acc = _mm256_setzero_ps();
      for (; i + 8 <= hidden; i += 8) {
        __m256 v = widen8(xr + i);
        if (rr != nullptr) {
          v = round8<T>(_mm256_add_ps(v, widen8(rr + i)));
          narrow8(sr + i, v);
        }
        _mm256_storeu_ps(row.data() + i, v);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      squares = reduce_add8(acc);
#endif
      for (; i < hidden; ++i) {
        float v = load(xr[i]);
        if (rr != nullptr) {
          const T sum = T(v + load(rr[i]));
          sr[i] = sum;
          v = load(sum);
        }
        row[i] = v;
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      i = 0;
#if defined(__AVX512F__)
      const __m512 scale = _mm512_set1_ps(inv);
      for (; i + 16 <= hidden; i += 16)
        narrow16(o + i, _mm512_mul_ps(widen16(weight + i), round16<T>(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), scale))));
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 scale = _mm256_set1_ps(inv);
      for (; i + 8 <= hidden; i += 8)
        narrow8(o + i, _mm256_mul_ps(widen8(weight + i), round8<T>(_mm256_mul_ps(_mm256_loadu_ps(row.data() + i), scale))));
#endif
      for (; i < hidden; ++i) o[i] = T(load(weight[i]) * round_to<T>(row[i] * inv));
    }
  });
}

constexpr float kLowestGate = -88.f;  // below it silu(gate) is 0 (exp(-gate) overflows float32)

template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + d;
      T* o = out + r * d;
      int64_t i = 0;
      // Below a gate of -88, exp(-g) is inf and -ffast-math's vector division (a reciprocal estimate and a
      // Newton step) makes g / inf NaN: silu is 0 there (it is under 1e-36). The compiler
      // vectorises the scalar loop below too, so it says so as well.
#if defined(__AVX512F__)
      const __m512 lowest = _mm512_set1_ps(kLowestGate);
      for (; i + 16 <= d; i += 16) {
        const __m512 g = widen16(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));  // exp(-g)
        const __m512 silu = round16<T>(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(g, lowest, _CMP_NLT_UQ),
                                                           _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e))));
        narrow16(o + i, _mm512_mul_ps(silu, widen16(up + i)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 lowest = _mm256_set1_ps(kLowestGate);
      for (; i + 8 <= d; i += 8) {
        const __m256 g = widen8(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));  // exp(-g)
        const __m256 silu = round8<T>(_mm256_and_ps(_mm256_cmp_ps(g, lowest, _CMP_NLT_UQ),
                                                    _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e))));
        narrow8(o + i, _mm256_mul_ps(silu, widen8(up + i)));
      }
#endif
      for (; i < d; ++i) {
        const float gi = load(gate[i]);
        o[i] = T(round_to<T>(gi < kLowestGate ? 0.f : gi / (1.f + std::exp(-gi))) * load(up[i]));
      }
    }
  });
}

// x1 * cos - x2 * sin and x2 * cos + x1 * sin, every product and difference rounded to the dtype
// as the reference's separate torch ops round them; cos and sin are rounded to the dtype first.
template <typename T>
void rotate_rows(const T* x, int64_t token_stride, int64_t heads, const int64_t* positions, const float* cos_sin,
                 T* out, int64_t tokens, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> cs(dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* src = cos_sin + positions[t] * dim;
      for (int64_t i = 0; i < dim; ++i) cs[i] = round_to<T>(src[i]);
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + t * token_stride + h * dim;
        T* oh = out + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(xh[i]), x2 = load(xh[i + half]), c = cs[i], s = cs[i + half];
          oh[i] = T(round_to<T>(x1 * c) - round_to<T>(x2 * s));
          oh[i + half] = T(round_to<T>(x2 * c) + round_to<T>(x1 * s));
        }
      }
    }
  });
}

// A 2-D row view with contiguous rows (any row stride), copying only when it has to.
at::Tensor rows_of(const at::Tensor& x) {
  return x.stride(-1) == 1 ? x : x.contiguous();
}

}  // namespace

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: bad shapes");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and input dtypes differ");
  const at::Tensor xs = rows_of(x);
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor sum;
  at::Tensor rs;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual differs from the input in shape or dtype");
    rs = rows_of(*residual);
    sum = at::empty({x.size(0), x.size(1)}, x.options());
  }
  dispatch_float(x, "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(xs.data_ptr<T>(), xs.stride(0), rs.defined() ? rs.data_ptr<T>() : nullptr,
                     rs.defined() ? rs.stride(0) : 0, w.data_ptr<T>(), out.data_ptr<T>(),
                     sum.defined() ? sum.data_ptr<T>() : nullptr, x.size(0), x.size(1), static_cast<float>(eps));
  });
  if (sum.defined()) return {out, sum};
  return {out};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "silu_and_mul: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: expects [tokens, 2 * d]");
  const at::Tensor xs = rows_of(x);
  const int64_t d = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), d}, x.options());
  dispatch_float(x, "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_and_mul_rows<T>(xs.data_ptr<T>(), xs.stride(0), out.data_ptr<T>(), x.size(0), d);
  });
  return out;
}

std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                         const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(query.device().is_cpu(), "rotary_embedding: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0) && query.size(2) == key.size(2),
              "rotary_embedding: expects query [tokens, heads, dim] and key [tokens, kv_heads, dim]");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "rotary_embedding: query and key dtypes differ");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.size(1) == query.size(2),
              "rotary_embedding: the cache must be float32 [max_position, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "rotary_embedding: positions must be int64");
  const at::Tensor pos = positions.contiguous();
  const at::Tensor cache = cos_sin_cache.contiguous();
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == query.size(0), "rotary_embedding: one position per token");
  for (int64_t t = 0; t < pos.size(0); ++t)
    TORCH_CHECK(pos.data_ptr<int64_t>()[t] >= 0 && pos.data_ptr<int64_t>()[t] < cache.size(0),
                "rotary_embedding: position ", pos.data_ptr<int64_t>()[t], " outside the cache's ", cache.size(0));
  std::vector<at::Tensor> outs;
  for (const at::Tensor* x : {&query, &key}) {
    // heads of a token contiguous (a view into the fused QKV output keeps them so); rows may stride
    const at::Tensor xs = (x->stride(2) == 1 && x->stride(1) == x->size(2)) ? *x : x->contiguous();
    at::Tensor out = at::empty(x->sizes(), x->options());
    dispatch_float(*x, "rotary_embedding", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      rotate_rows<T>(xs.data_ptr<T>(), xs.stride(0), x->size(1), pos.data_ptr<int64_t>(), cache.data_ptr<float>(),
                     out.data_ptr<T>(), x->size(0), x->size(2));
    });
    outs.push_back(out);
  }
  return outs;
}

// Each token's key and value rows into its slot of the paged cache [2, kv_heads, blocks, block_size, head_dim]
// (kernels/cache.py's layout); slot -1 is a padding token and is skipped. One pass, no gathers: the reference's
// mask, compaction and two index_copy_ calls cost ~60 us a layer at batch 1.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && kv_cache.device().is_cpu(), "write_kv_cache: CPU tensors only");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv_cache: the cache must be a contiguous [2, kv_heads, blocks, block_size, head_dim]");
  const int64_t heads = kv_cache.size(1), blocks = kv_cache.size(2), block_size = kv_cache.size(3),
                dim = kv_cache.size(4);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == heads && key.size(2) == dim,
              "write_kv_cache: key and value must be [tokens, kv_heads, head_dim] of the cache's shape");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "write_kv_cache: key, value and cache dtypes differ");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "write_kv_cache: one int64 slot per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t tokens = key.size(0), num_slots = blocks * block_size;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= -1 && sp[t] < num_slots, "write_kv_cache: slot ", sp[t], " outside the cache's ", num_slots);
  const at::Tensor kc = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor vc = value.stride(2) == 1 ? value : value.contiguous();
  const int64_t row_bytes = dim * kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const int64_t half = heads * num_slots * row_bytes;  // keys, then values
  for (const auto& [src, base] : {std::pair<const at::Tensor*, int64_t>{&kc, 0}, {&vc, half}}) {
    const char* data = static_cast<const char*>(src->data_ptr());
    const int64_t token_stride = src->stride(0) * src->element_size(), head_stride = src->stride(1) * src->element_size();
    for (int64_t t = 0; t < tokens; ++t) {
      if (sp[t] < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(cache + base + (h * num_slots + sp[t]) * row_bytes, data + t * token_stride + h * head_stride,
                    row_bytes);
      }
    }
  }
}

}  // namespace shardserve
