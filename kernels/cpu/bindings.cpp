// The Python module of shardserve's native CPU kernels (kernels/cpu_native.py builds and loads it).

#include <torch/extension.h>

#include <vector>

namespace shardserve {
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale);
at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                   const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale);
bool prefill_supported(int64_t head_dim, int64_t block_size);
bool prefill_amx_available();
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual);
at::Tensor silu_and_mul(const at::Tensor& x);
std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                         const at::Tensor& cos_sin_cache);
at::Tensor sample_tokens(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                         const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniforms);
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping);
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
bool amx_linear_available();
at::Tensor amx_weight_tiles(const at::Tensor& weight);
at::Tensor amx_small_batch_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t out,
                                  const c10::optional<at::Tensor>& bias);
at::Tensor packed_linear_split_rows(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus);
}  // namespace shardserve

// The kernels run without the GIL, as torch's own ops do: the serving loop's Python (the replica's event loop, Ray's
// threads) can then run during a step's attention instead of waiting for it, and the step's thread does not wait for
// theirs at its next kernel. They touch no Python object (their arguments are held by the caller's frame).
namespace {
const auto kNoGil = py::call_guard<py::gil_scoped_release>();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "vector_isa",
      [] {
#if defined(__AVX512F__)
        return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
        return "avx2";
#else
        return "scalar";
#endif
      },
      "The vector code this build runs: avx512, avx2 or scalar (plain C++)");
  m.def("paged_decode_attention", &shardserve::paged_decode_attention, kNoGil, "Paged decode attention");
  m.def("prefill_amx_available", &shardserve::prefill_amx_available,
        "Whether bfloat16 prefill attention (head_dim 64 or 128) runs on AMX tiles here");
  m.def("paged_prefill_attention", &shardserve::paged_prefill_attention, kNoGil, "Paged prefill attention, causal chunks");
  m.def("prefill_supported", &shardserve::prefill_supported,
        "Whether paged_prefill_attention takes this head_dim and block_size");
  m.def("rms_norm", &shardserve::rms_norm, kNoGil, "RMSNorm, optionally after a residual add: [out] or [out, sum]");
  m.def("silu_and_mul", &shardserve::silu_and_mul, kNoGil, "silu(gate) * up over [tokens, 2 * d]");
  m.def("sample_tokens", &shardserve::sample_tokens, kNoGil,
        "One token per row: temperature, top-k, top-p, min-p, inverse-transform draw (kernels/sampling.py)");
  m.def("apply_token_bitmask", &shardserve::apply_token_bitmask, kNoGil,
        "In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is clear (kernels/bitmask.py)");
  m.def("rotary_embedding", &shardserve::rotary_embedding, kNoGil, "Rotary embedding of query and key: [query, key]");
  m.def("write_kv_cache", &shardserve::write_kv_cache, kNoGil,
        "In place: key and value rows into their slots of the paged cache, slot -1 skipped (kernels/cache.py)");
  m.def("small_batch_linear", &shardserve::small_batch_linear, kNoGil,
        "x W^T (+ b) for a few rows of x, W [out, in] as it is (kernels/linear.py)", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
  m.def("amx_linear_available", &shardserve::amx_linear_available,
        "Whether amx_small_batch_linear runs here (an AMX build, and Linux lets the process use the tiles)");
  m.def("amx_weight_tiles", &shardserve::amx_weight_tiles, kNoGil,
        "A bfloat16 W [out, in] laid out as amx_small_batch_linear's tiles (kernels/linear.py)");
  m.def("amx_small_batch_linear", &shardserve::amx_small_batch_linear, kNoGil,
        "x W^T (+ b) for up to 128 bfloat16 rows of x on AMX tiles (W read from memory once), W as "
        "amx_weight_tiles laid it out",
        py::arg("x"), py::arg("tiles"), py::arg("out"), py::arg("bias") = py::none());
  m.def("packed_linear_split_rows", &shardserve::packed_linear_split_rows, kNoGil,
        "oneDNN's product on a packed weight, x's rows cut into one part per thread, each on its thread alone "
        "(kernels/linear.py)", py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("bind_omp_threads", &shardserve::bind_omp_threads,
        "The calling thread's OpenMP team: thread i bound to cpus[i]; returns the core each runs on (kernels/cpu_threads.py)");
}
