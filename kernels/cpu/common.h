// Shared by the native CPU kernels: dtype loads and stores, and a vectorised exp.
// Vector code: AVX-512 (16 float lanes) where the build has it, else AVX2 with FMA (8 lanes: AMD Zen 2
// and 3, Intel before Skylake-SP), else plain C++ (kernels/cpu_native.py names the build's target).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
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

// The sums of 16 vectors' lanes: out[i] = v[i][0] + ... + v[i][15], in 45 shuffles and adds (a horizontal sum per
// vector takes 8 on a dependent chain). Within each 128-bit lane first, then across the four lanes.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 quarter[4];  // quarter[j], 128-bit lane L, element k: v[4j + k]'s elements 4L .. 4L + 3 summed
  for (int j = 0; j < 4; ++j) {
    const __m512* w = v + 4 * j;
    const __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    quarter[j] = _mm512_add_ps(_mm512_shuffle_ps(a01, a23, 0x44), _mm512_shuffle_ps(a01, a23, 0xEE));
  }
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(quarter[0], quarter[1], 0x44),
                                   _mm512_shuffle_f32x4(quarter[0], quarter[1], 0xEE));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(quarter[2], quarter[3], 0x44),
                                   _mm512_shuffle_f32x4(quarter[2], quarter[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
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
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX2 versions of the above, 8 lanes at a time.

// 8 elements as float32.
template <typename T>
inline __m256 widen8(const T* src) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(src));
  }
}

// The float32 bits of v rounded to bfloat16 (nearest even, as c10::BFloat16(float) rounds; NaN to
// its quiet NaN 0x7FC0): the bfloat16 in the top half, zeros below. Integer compares only, which
// -ffast-math can't fold away.
inline __m256i bf16_rounded_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i is_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  return _mm256_and_si256(_mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), is_nan),
                          _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
}

// 8 float32 lanes stored as T.
template <typename T>
inline void narrow8(T* dst, __m256 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i top = _mm256_srli_epi32(bf16_rounded_bits(v), 16);  // 0 .. 0xFFFF: packus keeps it
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
  } else {
    _mm256_storeu_ps(reinterpret_cast<float*>(dst), v);
  }
}

// 8 lanes as T would hold them, back in float32.
template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm256_castsi256_ps(bf16_rounded_bits(v));
  } else {
    return v;
  }
}

// The sum and the maximum of 8 lanes.
inline float reduce_add8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline float reduce_max8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// exp16's method for 8 lanes. scalef's p * 2^n is p * 2^(n/2) * 2^(n - n/2), both powers built in
// the exponent bits and normal for n in -126 .. 128 (y is clamped there; 128 overflows to inf), so it
// rounds once, as scalef does.
inline __m256 exp8(__m256 x) {
  __m256 y = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(-126.f));
  y = _mm256_min_ps(y, _mm256_set1_ps(128.f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 z = _mm256_mul_ps(_mm256_sub_ps(y, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.f / 720), z, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.f / 2));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.f));
  const __m256i n_int = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(n_int, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 two_to_half = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 two_to_rest =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(n_int, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, two_to_half), two_to_rest);
}
#endif

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Linux gives a process the AMX tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 all 16 rows x 64 bytes: the one configuration of the AMX kernels (paged_attention.cpp, linear.cpp), which
// say what each tile holds. A thread's configuration stays until it loads another.
inline void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

#endif

}  // namespace shardserve
