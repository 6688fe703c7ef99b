// The core CPU extension's Python bindings: panel linears (linear.cpp), block-quantized linears
// (quant_linear.cpp), row-wise kernels
// (rowwise.cpp) and paged attention (paged_decode.cpp).
#include <torch/extension.h>

#include "parallel.h"

// linear.cpp
torch::Tensor pack(torch::Tensor w, bool silu_mul, bool pairs);
bool dot_pairs_available();
bool tile_unit_available(int64_t in_features);
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n_out, bool silu_mul,
                     c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> bias, bool gelu);
torch::Tensor linear_argmax(torch::Tensor x, torch::Tensor packed, int64_t n_out);

// quant_linear.cpp
bool quant_dots_available();
torch::Tensor to_huge_pages(torch::Tensor t);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t n_out, bool silu_mul,
                           c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> bias);

// rowwise.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor layer_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps);
void rotary_(torch::Tensor y, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t D);
void rotary_pairs_(torch::Tensor y, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t D);
torch::Tensor argmax_rows(torch::Tensor x);

// paged_decode.cpp
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor ctx);
void store_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
torch::Tensor decode_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor slots, torch::Tensor tables, torch::Tensor ctx,
                          double scale);
void paged_block_(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor tables, torch::Tensor ctx, torch::Tensor q_start, torch::Tensor q_len,
                  torch::Tensor causal, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_inline_work", [](int64_t work) { mstar_cpu::inline_work.store(work); },
        "calls of less estimated work than this run their tasks inline (parallel.h)");
  m.def("inline_work", [] { return mstar_cpu::inline_work.load(); }, "see set_inline_work");
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache");
  m.def("store_kv_", &store_kv_, "store k / v rows into the paged caches at flat slots (index_copy_ of the converted rows)");
  m.def("decode_step", &decode_step, "store new K/V rows, then decode attention (all rows single-token appends)");
  m.def("paged_block_", &paged_block_, "multi-token (causal or bidirectional) attention over a paged KV cache, into out");
  m.def("argmax_rows", &argmax_rows, "index of each row's maximum (torch.argmax semantics)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the rows of a float32 or bfloat16 matrix, or over the heads of [T, heads, D]");
  m.def("layer_norm", &layer_norm, "LayerNorm (with weight and bias) over the rows of a float32 matrix");
  m.def("rotary_", &rotary_, "rotary embedding, in place, over the first heads of each row");
  m.def("rotary_pairs_", &rotary_pairs_, "rotary embedding of adjacent channel pairs, in place, over the first heads of each row (float32; PyTorch's rounding)");
  m.def("pack", &pack, "pack a [in, out] weight into column panels", py::arg("w"), py::arg("silu_mul"),
        py::arg("pairs") = false);
  m.def("dot_pairs_available", &dot_pairs_available, "the bf16 dot-product path was compiled in");
  m.def("tile_unit_available", &tile_unit_available, "pair-packed linears with this input size run on the tile unit (AMX)",
        py::arg("in_features"));
  m.def("linear", &linear, "x @ W over a packed weight, with optional fused epilogues", py::arg("x"),
        py::arg("packed"), py::arg("n_out"), py::arg("silu_mul"), py::arg("residual"), py::arg("bias") = py::none(),
        py::arg("gelu") = false);
  m.def("quant_linear", &quant_linear, "x @ W over a block-quantized packed weight (Q8_0, Q4_0, Q4_1), as stored",
        py::arg("x"), py::arg("packed"), py::arg("kind"), py::arg("n_out"), py::arg("silu_mul"),
        py::arg("residual") = py::none(), py::arg("bias") = py::none());
  m.def("to_huge_pages", &to_huge_pages, "a copy of a tensor in memory advised for transparent huge pages");
  m.def("quant_dots_available", &quant_dots_available, "quantized linears use the CPU's u8 x s8 dot products (AVX512-VNNI)");
  m.def("linear_argmax", &linear_argmax, "argmax over the columns of x @ W (packed float32), row by row, without storing the product",
        py::arg("x"), py::arg("packed"), py::arg("n_out"));
}
