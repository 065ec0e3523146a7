// A linear layer's matrix product for a few rows of activations, y = x W^T (+ b), reading W as it is
// ([out, in], row-major, float32 or bfloat16). At batch 1-8 a decode step's matrix products are
// matrix-vector products bound by how fast W streams from memory; oneDNN's packed product and torch's
// F.linear read it at about half of what two cores can stream (docs/BENCHMARKS.md, "On the AVX2 EPYC" and
// "Linears at batch 1-128: the native products on a second copy of the weight"). Here each thread streams its own rows
// of W, four at a time, asking for the rows ahead, and multiplies them with every activation row while they are in L1,
// accumulating in float32 (one vector accumulator per output, its lanes summed at the end: a summation order of its
// own, as oneDNN's is).

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Optional.h>

#include <vector>

namespace shardserve {
namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
template <typename T>
inline Vec vload(const T* p) { return widen16(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
template <typename T>
inline Vec vload(const T* p) { return widen8(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return reduce_add8(v); }
#endif

constexpr int64_t kRowsPerBlock = 4;
// W's rows are asked for kPrefetchRows ahead of the block being multiplied, into L2 (PREFETCHT1): a layer's weight is
// read once a step, from memory, and the hardware prefetcher alone left the product at ~10 GB/s. The demo model's 121
// products of a decode step at batch 1, bfloat16, from memory, on the Intel Xeon with AMX: 25.2 ms without, 16.4 with
// (oneDNN's packed products: 22.1); 16 rows ahead no better, PREFETCHNTA slower (docs/BENCHMARKS.md, "Linears at
// batch 1-128: the native products on a second copy of the weight"). A prefetch past the weight's end is dropped (it
// never faults).
constexpr int64_t kPrefetchRows = 8;

// The cache line at byte `offset` of each of the kRowsPerBlock rows (of `row_bytes` each) from `ahead` on, into L2.
inline void prefetch_rows(const char* ahead, int64_t row_bytes, int64_t offset) {
  for (int64_t k = 0; k < kRowsPerBlock; ++k) __builtin_prefetch(ahead + k * row_bytes + offset, 0, 2);
}

#if defined(__AVX512BF16__)
// linear_rows for bfloat16 x and W on CPUs with AVX512-BF16: 32 weights a load, their products with x's pairs summed
// in float32 by vdpbf16ps (each product exact, as the widened FMA's), without widening W first.
inline __m512bh bf16_load32(const c10::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// NT activation rows against kRowsPerBlock rows of W: W's rows are read once, each load feeding NT dot products.
template <int NT>
inline void dot_block_bf16(const c10::BFloat16* const* xs, const c10::BFloat16* const* ws, int64_t in, int64_t vec_end,
                           const char* ahead, float (*sums)[kRowsPerBlock]) {
  constexpr int64_t kPairs = 32;
  __m512 acc[NT][kRowsPerBlock];
  for (int t = 0; t < NT; ++t)
    for (int64_t k = 0; k < kRowsPerBlock; ++k) acc[t][k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < vec_end; i += kPairs) {
    if (ahead != nullptr) prefetch_rows(ahead, in * 2, i * 2);
    __m512bh xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = bf16_load32(xs[t] + i);
    for (int64_t k = 0; k < kRowsPerBlock; ++k) {
      const __m512bh wv = bf16_load32(ws[k] + i);
      for (int t = 0; t < NT; ++t) acc[t][k] = _mm512_dpbf16_ps(acc[t][k], wv, xv[t]);
    }
  }
  alignas(64) float lanes[NT * kRowsPerBlock];  // each accumulator's lanes summed
  if constexpr (NT * kRowsPerBlock == 16) {  // the 16 sums at once (one horizontal sum each costs 8 steps)
    _mm512_store_ps(lanes, sum_lanes16(&acc[0][0]));
  } else {
    for (int t = 0; t < NT; ++t)
      for (int64_t k = 0; k < kRowsPerBlock; ++k) lanes[t * kRowsPerBlock + k] = _mm512_reduce_add_ps(acc[t][k]);
  }
  for (int t = 0; t < NT; ++t)
    for (int64_t k = 0; k < kRowsPerBlock; ++k) {
      float s = lanes[t * kRowsPerBlock + k];
      for (int64_t i = vec_end; i < in; ++i) s += load(ws[k][i]) * load(xs[t][i]);
      sums[t][k] = s;
    }
}

#endif

// Output rows [begin, end) of every activation row: y[t, r] = sum_i x[t, i] W[r, i] (+ b[r]).
template <typename T>
void linear_rows(const T* x, const T* w, const T* bias, T* y, int64_t m, int64_t in, int64_t out, int64_t begin,
                 int64_t end) {
  int64_t r = begin;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const int64_t vec_end = in - in % kLanes;
  for (; r + kRowsPerBlock <= end; r += kRowsPerBlock) {
    const T* w0 = w + r * in;
    const T* w1 = w0 + in;
    const T* w2 = w1 + in;
    const T* w3 = w2 + in;
    int64_t t = 0;
    for (; t + 2 <= m; t += 2) {  // two activation rows at once: each W load feeds two FMAs
      const T* xa = x + t * in;
      const T* xb = xa + in;
      Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
      Vec b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
      const char* ahead = reinterpret_cast<const char*>(w0 + kPrefetchRows * in);
      for (int64_t i = 0; i < vec_end; i += kLanes) {
        if (t == 0 && (i * sizeof(T)) % 64 == 0) prefetch_rows(ahead, in * sizeof(T), i * sizeof(T));
        const Vec xav = vload(xa + i);
        const Vec xbv = vload(xb + i);
        Vec wv = vload(w0 + i);
        a0 = vfma(wv, xav, a0);
        b0 = vfma(wv, xbv, b0);
        wv = vload(w1 + i);
        a1 = vfma(wv, xav, a1);
        b1 = vfma(wv, xbv, b1);
        wv = vload(w2 + i);
        a2 = vfma(wv, xav, a2);
        b2 = vfma(wv, xbv, b2);
        wv = vload(w3 + i);
        a3 = vfma(wv, xav, a3);
        b3 = vfma(wv, xbv, b3);
      }
      float sa[kRowsPerBlock] = {vsum(a0), vsum(a1), vsum(a2), vsum(a3)};
      float sb[kRowsPerBlock] = {vsum(b0), vsum(b1), vsum(b2), vsum(b3)};
      const T* ws[kRowsPerBlock] = {w0, w1, w2, w3};
      for (int64_t i = vec_end; i < in; ++i) {
        const float xai = load(xa[i]), xbi = load(xb[i]);
        for (int64_t k = 0; k < kRowsPerBlock; ++k) {
          sa[k] += load(ws[k][i]) * xai;
          sb[k] += load(ws[k][i]) * xbi;
        }
      }
      for (int64_t k = 0; k < kRowsPerBlock; ++k) {
        const float b = bias != nullptr ? load(bias[r + k]) : 0.f;
        store(sa[k] + b, y + t * out + r + k);
        store(sb[k] + b, y + (t + 1) * out + r + k);
      }
    }
    for (; t < m; ++t) {
      const T* xt = x + t * in;
      Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
      const char* ahead = reinterpret_cast<const char*>(w0 + kPrefetchRows * in);
      for (int64_t i = 0; i < vec_end; i += kLanes) {
        if ((i * sizeof(T)) % 64 == 0) prefetch_rows(ahead, in * sizeof(T), i * sizeof(T));
        const Vec xv = vload(xt + i);
        a0 = vfma(vload(w0 + i), xv, a0);
        a1 = vfma(vload(w1 + i), xv, a1);
        a2 = vfma(vload(w2 + i), xv, a2);
        a3 = vfma(vload(w3 + i), xv, a3);
      }
      float s[kRowsPerBlock] = {vsum(a0), vsum(a1), vsum(a2), vsum(a3)};
      for (int64_t i = vec_end; i < in; ++i) {
        const float xi = load(xt[i]);
        s[0] += load(w0[i]) * xi;
        s[1] += load(w1[i]) * xi;
        s[2] += load(w2[i]) * xi;
        s[3] += load(w3[i]) * xi;
      }
      for (int64_t k = 0; k < kRowsPerBlock; ++k) {
        store(bias != nullptr ? s[k] + load(bias[r + k]) : s[k], y + t * out + r + k);
      }
    }
  }
#endif
  for (; r < end; ++r) {  // the rows left over (and every row where the build has no vector code)
    const T* wr = w + r * in;
    for (int64_t t = 0; t < m; ++t) {
      const T* xt = x + t * in;
      float s = 0.f;
      for (int64_t i = 0; i < in; ++i) s += load(wr[i]) * load(xt[i]);
      store(bias != nullptr ? s + load(bias[r]) : s, y + t * out + r);
    }
  }
}

#if defined(__AVX512BF16__)
// linear_rows for bfloat16 on CPUs with AVX512-BF16: blocks of kRowsPerBlock rows of W by dot_block_bf16.
void linear_rows_bf16(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
                      int64_t m, int64_t in, int64_t out, int64_t begin, int64_t end) {
  const int64_t vec_end = in - in % 32;
  int64_t r = begin;
  for (; r + kRowsPerBlock <= end; r += kRowsPerBlock) {
    const c10::BFloat16* ws[kRowsPerBlock] = {w + r * in, w + (r + 1) * in, w + (r + 2) * in, w + (r + 3) * in};
    const char* ahead = reinterpret_cast<const char*>(ws[0] + kPrefetchRows * in);
    for (int64_t t = 0; t < m;) {
      const c10::BFloat16* xs[4] = {x + t * in, x + (t + 1) * in, x + (t + 2) * in, x + (t + 3) * in};
      float sums[4][kRowsPerBlock];
      const char* pf = t == 0 ? ahead : nullptr;  // the next blocks of W are asked for on the first pass only
      const int64_t nt = m - t >= 4 ? 4 : m - t >= 2 ? 2 : 1;
      if (nt == 4) dot_block_bf16<4>(xs, ws, in, vec_end, pf, sums);
      else if (nt == 2) dot_block_bf16<2>(xs, ws, in, vec_end, pf, sums);
      else dot_block_bf16<1>(xs, ws, in, vec_end, pf, sums);
      for (int64_t u = 0; u < nt; ++u)
        for (int64_t k = 0; k < kRowsPerBlock; ++k)
          store(bias != nullptr ? sums[u][k] + load(bias[r + k]) : sums[u][k], y + (t + u) * out + r + k);
      t += nt;
    }
  }
  linear_rows(x, w, bias, y, m, in, out, r, end);  // the rows left over (fewer than a block)
}
#endif

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The small-batch product on AMX tiles (bfloat16, 1-128 activation rows): one tile multiply takes 16 rows x 32 of `in`
// against 32 x 16 outputs, and every block of 16 rows multiplies a tile of W while it is in L2, so W comes from memory
// once at any row count; up to ~64 rows that read is what the product costs, past it the tile multiplies add up (the
// vector code above does ~4 rows' worth of arithmetic per W load, and past 4 rows it is slower than oneDNN's). W is
// laid out once, at load, as B operands (amx_weight_tiles): [out / 16 tiles][in / 32 steps][16 pairs of `in`][16
// outputs][2], zero-padded, so that each tile of 16 outputs is one contiguous stream and the threads share the tiles
// out evenly.
constexpr int64_t kTileOut = 16, kTileIn = 32;
constexpr int64_t kAmxMaxRows = 128;  // row blocks the kernel takes: any number, so this bounds only the copy of x
constexpr int64_t kTileElems = 16 * 32;  // bfloat16s a tile
// bytes of each tile's stream asked for ahead of the step being multiplied, into L2: one step of 32 columns (none,
// two, four or eight steps measured alike or slower)
constexpr int64_t kTileAheadBytes = kTileElems * 2;

inline void prefetch_tile(const uint16_t* step, const char* last) {
  const char* ahead = reinterpret_cast<const char*>(step) + kTileAheadBytes;
  for (int64_t off = 0; off < kTileElems * 2 && ahead + off < last; off += 64) __builtin_prefetch(ahead + off, 0, 2);
}

// Output tile `tile`'s 16 float32 sums of row r, plus the bias, stored as bfloat16 outputs of y's row r.
inline void store_tile_row(const float* sums, int64_t tile, int64_t r, int64_t out, const c10::BFloat16* bias,
                           c10::BFloat16* y) {
  const int64_t col = tile * kTileOut;
  const int64_t live = std::min<int64_t>(kTileOut, out - col);
  for (int64_t n = 0; n < live; ++n)
    store(bias != nullptr ? sums[n] + load(bias[col + n]) : sums[n], y + r * out + col + n);
}
#endif

}  // namespace

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_batch_linear: x [m, in] and weight [out, in]");
  TORCH_CHECK(x.size(1) == weight.size(1), "small_batch_linear: x has ", x.size(1), " columns, weight ",
              weight.size(1));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "small_batch_linear: x and weight dtypes differ");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == weight.size(0) && bias->scalar_type() == weight.scalar_type()),
              "small_batch_linear: bias must be [out] in the weight's dtype");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t m = xc.size(0), in = xc.size(1), out = wc.size(0);
  at::Tensor y = at::empty({m, out}, xc.options());
  dispatch_float(xc, "small_batch_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = xc.data_ptr<T>();
    const T* wp = wc.data_ptr<T>();
    const T* bp = bc.defined() ? bc.data_ptr<T>() : nullptr;
    T* yp = y.data_ptr<T>();
    // whole blocks of rows to each thread (the grain: at least 16 blocks, 64 rows, a thread)
    const int64_t blocks = (out + kRowsPerBlock - 1) / kRowsPerBlock;
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        linear_rows_bf16(xp, wp, bp, yp, m, in, out, begin * kRowsPerBlock, std::min(out, end * kRowsPerBlock));
        return;
      }
#endif
      linear_rows(xp, wp, bp, yp, m, in, out, begin * kRowsPerBlock, std::min(out, end * kRowsPerBlock));
    });
  });
  return y;
}

bool amx_linear_available() {
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

// W [out, in] bfloat16 as amx_small_batch_linear's B tiles (the layout is described with kTileOut).
at::Tensor amx_weight_tiles(const at::Tensor& weight) {
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "amx_weight_tiles: bfloat16 [out, in]");
  const at::Tensor w = weight.contiguous();
  const int64_t out = w.size(0), in = w.size(1);
  const int64_t tiles_out = (out + kTileOut - 1) / kTileOut, steps = (in + kTileIn - 1) / kTileIn;
  at::Tensor tiles = at::zeros({tiles_out, steps, 16, 32}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(tiles.data_ptr<c10::BFloat16>());
  at::parallel_for(0, tiles_out, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t n = 0; n < kTileOut && tile * kTileOut + n < out; ++n) {
        const uint16_t* row = src + (tile * kTileOut + n) * in;
        for (int64_t c = 0; c < in; ++c)  // column c: step c / 32, pair (c % 32) / 2, element c % 2
          dst[((tile * steps + c / kTileIn) * 16 + (c % kTileIn) / 2) * 32 + n * 2 + c % 2] = row[c];
      }
  });
  return tiles;
#else
  TORCH_CHECK(false, "amx_weight_tiles: this build has no AMX code");
#endif
}

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

// One block of 16 rows of x as a tile multiply's A operand: where its rows start and their stride, in bfloat16s.
struct RowBlock {
  const uint16_t* rows;
  int64_t stride;
};

// Output tiles first .. first + Count - 1 against Blocks (1 or 2) row blocks, over every step of `in`. Tiles: the sums
// 0-3 (C tile b * Count + t: row block b, output tile t), A 4 and 5 (one per row block), B 6 and 7 (alternating, so
// that a tile's next load does not wait for the multiply that reads it). With two row blocks each loaded tile feeds
// two multiplies (two output tiles at most); with one row block, up to four output tiles share its A.
template <int Blocks, int Count>
void tiles_amx(const RowBlock* block, const uint16_t* w, int64_t steps, int64_t first, bool ask_ahead,
               const char* last, int64_t m, int64_t first_row, int64_t out, const c10::BFloat16* bias,
               c10::BFloat16* y) {
  static_assert(Blocks * Count <= 4, "four C tiles");
  alignas(64) float c[16][16];
  const uint16_t* stream[Count];
  for (int t = 0; t < Count; ++t) stream[t] = w + (first + t) * steps * kTileElems;
  _tile_zero(0);
  if constexpr (Blocks * Count > 1) _tile_zero(1);
  if constexpr (Blocks * Count > 2) _tile_zero(2);
  if constexpr (Blocks * Count > 3) _tile_zero(3);
  for (int64_t k = 0; k < steps; ++k) {
    if (ask_ahead)
      for (int t = 0; t < Count; ++t) prefetch_tile(stream[t] + k * kTileElems, last);
    _tile_loadd(4, block[0].rows + k * kTileIn, block[0].stride * 2);
    if constexpr (Blocks == 2) _tile_loadd(5, block[1].rows + k * kTileIn, block[1].stride * 2);
    _tile_loadd(6, stream[0] + k * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (Blocks == 2 && Count == 1) _tile_dpbf16ps(1, 5, 6);
    if constexpr (Blocks == 2 && Count == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (Count > 1) {
      _tile_loadd(7, stream[1] + k * kTileElems, 64);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (Blocks == 2) _tile_dpbf16ps(3, 5, 7);
    }
    if constexpr (Count > 2) {
      _tile_loadd(6, stream[2] + k * kTileElems, 64);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (Count > 3) {
      _tile_loadd(7, stream[3] + k * kTileElems, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  for (int b = 0; b < Blocks; ++b)
    for (int t = 0; t < Count; ++t) {
      switch (b * Count + t) {
        case 0: _tile_stored(0, c, 64); break;
        case 1: _tile_stored(1, c, 64); break;
        case 2: _tile_stored(2, c, 64); break;
        default: _tile_stored(3, c, 64); break;
      }
      const int64_t row = first_row + 16 * b;
      for (int64_t i = 0; i < std::min<int64_t>(16, m - row); ++i)
        store_tile_row(c[i], first + t, row + i, out, bias, y);
    }
}

}  // namespace
#endif

// y = x W^T (+ b) for 1 to kAmxMaxRows bfloat16 rows of x, W as amx_weight_tiles laid it out (`out` its rows).
// Each thread takes its share of W's output tiles a pair at a time (four at a time for 16 rows or fewer) and runs every
// pair of row blocks over them: the first pair reads the pair's tiles from memory, the others from L2 (two output
// tiles over `in` = 1536 are 96 KB), so W comes from memory once whatever the row count.
at::Tensor amx_small_batch_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t out,
                                  const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(amx_permitted(), "amx_small_batch_linear: this process may not use AMX tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1 && x.size(0) <= kAmxMaxRows,
              "amx_small_batch_linear: x must be [1 <= m <= ", kAmxMaxRows, ", in], bfloat16");
  TORCH_CHECK(tiles.dim() == 4 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() &&
                  tiles.size(2) == 16 && tiles.size(3) == 32,
              "amx_small_batch_linear: tiles must be amx_weight_tiles' layout");
  const int64_t m = x.size(0), in = x.size(1), tiles_out = tiles.size(0), steps = tiles.size(1);
  TORCH_CHECK((in + kTileIn - 1) / kTileIn == steps && (out + kTileOut - 1) / kTileOut == tiles_out,
              "amx_small_batch_linear: x has ", in, " columns and ", out, " outputs; the tiles are of another shape");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out && bias->scalar_type() == at::kBFloat16),
              "amx_small_batch_linear: bias must be [out], bfloat16");
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const c10::BFloat16* bp = bc.defined() ? bc.data_ptr<c10::BFloat16>() : nullptr;
  // the A operands: whole blocks of 16 rows read from x where `in` is whole steps; a last block of fewer rows (or,
  // where `in` is not whole steps, every block) copied into zeroed rows of whole steps
  const at::Tensor xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  const int64_t a_stride = steps * kTileIn, blocks = (m + 15) / 16;
  const int64_t direct = a_stride == in ? m / 16 : 0;  // the row blocks read from x as it is
  std::vector<uint16_t> padded((blocks - direct) * 16 * a_stride, 0);
  for (int64_t r = direct * 16; r < m; ++r)
    std::copy(xp + r * in, xp + (r + 1) * in, padded.data() + (r - direct * 16) * a_stride);
  std::vector<RowBlock> block(blocks);
  for (int64_t b = 0; b < blocks; ++b)
    block[b] = b < direct ? RowBlock{xp + b * 16 * in, in}
                          : RowBlock{padded.data() + (b - direct) * 16 * a_stride, a_stride};
  at::Tensor y = at::empty({m, out}, x.options());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(tiles.data_ptr<c10::BFloat16>());
  at::parallel_for(0, tiles_out, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    const char* last = reinterpret_cast<const char*>(w + end * steps * kTileElems);
    if (blocks == 1) {
      int64_t tile = begin;
      for (; tile + 4 <= end; tile += 4) tiles_amx<1, 4>(block.data(), w, steps, tile, true, last, m, 0, out, bp, yp);
      switch (end - tile) {
        case 3: tiles_amx<1, 3>(block.data(), w, steps, tile, true, last, m, 0, out, bp, yp); break;
        case 2: tiles_amx<1, 2>(block.data(), w, steps, tile, true, last, m, 0, out, bp, yp); break;
        case 1: tiles_amx<1, 1>(block.data(), w, steps, tile, true, last, m, 0, out, bp, yp); break;
        default: break;
      }
      return;
    }
    for (int64_t tile = begin; tile < end; tile += 2) {
      const bool pair = tile + 1 < end;
      for (int64_t b = 0; b < blocks; b += 2) {
        const RowBlock* rows = block.data() + b;
        const bool ask_ahead = b == 0;  // later row blocks find the tiles in L2
        if (b + 1 < blocks && pair)
          tiles_amx<2, 2>(rows, w, steps, tile, ask_ahead, last, m, b * 16, out, bp, yp);
        else if (b + 1 < blocks)
          tiles_amx<2, 1>(rows, w, steps, tile, ask_ahead, last, m, b * 16, out, bp, yp);
        else if (pair)
          tiles_amx<1, 2>(rows, w, steps, tile, ask_ahead, last, m, b * 16, out, bp, yp);
        else
          tiles_amx<1, 1>(rows, w, steps, tile, ask_ahead, last, m, b * 16, out, bp, yp);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "amx_small_batch_linear: this build has no AMX code");
#endif
}

// oneDNN's product on a packed weight (torch's mkldnn::_linear_pointwise) with the rows of x cut into one part per
// thread, each part's product run by its thread alone: oneDNN runs single-threaded inside a parallel region.
// With 2 threads, oneDNN's own split of some products leaves one thread idle: bfloat16 on AMX, 384-1280 rows of a
// 1536 -> 576 product, 768-1024 of 576 -> 960, 384-768 of 576 -> 576 took as long on 1 thread as on 2
// (kernels/linear.py says where it is used). A row's result is oneDNN's whole product's up to the last bit of a few
// outputs (oneDNN may block a product of fewer rows differently).
at::Tensor packed_linear_split_rows(const at::Tensor& x, const at::Tensor& packed,
                                    const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "packed_linear_split_rows: x must be [m, in], contiguous");
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  const int64_t per = std::max<int64_t>(1, (rows + threads - 1) / threads);
  const int64_t parts = std::max<int64_t>(1, (rows + per - 1) / per);  // (5 rows on 4 threads: 3 parts of 2, 2, 1)
  std::vector<at::Tensor> outs(parts);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      const int64_t start = part * per;
      torch::jit::Stack stack;
      stack.emplace_back(x.narrow(0, start, std::min(per, rows - start)));
      stack.emplace_back(packed);
      stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
      stack.emplace_back(std::string("none"));
      stack.emplace_back(c10::List<c10::optional<c10::Scalar>>());
      stack.emplace_back(std::string(""));
      op.callBoxed(&stack);
      outs[part] = stack[0].toTensor();
    }
  });
  return parts == 1 ? outs[0] : at::cat(outs, 0);
}

}  // namespace shardserve
