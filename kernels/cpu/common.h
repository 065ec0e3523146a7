// Shared by the native CPU kernels: dtype loads and stores, and a vectorised exp.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace shardserve {

// Calls body(static_cast<T*>(nullptr)) with T the tensor's dtype, float or c10::BFloat16; any other
// dtype is an error that names `what`.
template <typename F>
void dispatch_float(const at::Tensor& x, const char* what, F&& body) {
  if (x.scalar_type() == at::kFloat) {
    body(static_cast<float*>(nullptr));
  } else if (x.scalar_type() == at::kBFloat16) {
    body(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, what, ": float32 or bfloat16 only, got ", x.scalar_type());
  }
}

inline float load(float x) { return x; }

inline float load(c10::BFloat16 x) {
  // bfloat16 is the top half of a float32: widening is a shift, which the compiler vectorises.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void store(float value, float* out) { *out = value; }

inline void store(float value, c10::BFloat16* out) { *out = c10::BFloat16(value); }  // round to nearest even

#if defined(__AVX512F__)
// 16 elements as float32 (bfloat16 is the top half of a float32: a shift).
template <typename T>
inline __m512 widen16(const T* src) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(src));
  }
}

// 16 float32 lanes stored as T (bfloat16: rounded to nearest even, as c10::BFloat16(float) rounds).
template <typename T>
inline void narrow16(T* dst, __m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
  } else {
    _mm512_storeu_ps(reinterpret_cast<float*>(dst), v);
  }
}

// 16 lanes as T would hold them, back in float32.
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    alignas(64) c10::BFloat16 tmp[16];
    narrow16(tmp, v);
    return widen16(tmp);
  } else {
    return v;
  }
}

// exp(x) for 16 lanes (x up to ~88; above, inf): 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, and 2^f = e^(f ln 2)
// by its Taylor series to degree 6 (relative error ~1e-7, float32's own). Below 2^-126 it returns
// 2^-126, not 0: callers zero the lanes that must not count. glibc's scalar expf would otherwise be
// most of these kernels' time.
inline __m512 exp16(__m512 x) {
  const __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 z = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.f / 720), z, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.f / 2));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace shardserve
