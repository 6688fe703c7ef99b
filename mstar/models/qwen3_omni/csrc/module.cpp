// The Qwen3-Omni extension's Python bindings: the sparse MoE experts (moe.cpp) and the Code2Wav
// vocoder kernels (code2wav.cpp).
#include <torch/extension.h>

#include "parallel.h"

#include <vector>

// moe.cpp
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor weights, torch::Tensor experts, torch::Tensor gate_up,
                          torch::Tensor down, int64_t inter);

// code2wav.cpp
torch::Tensor snake_beta(torch::Tensor x, torch::Tensor alpha, torch::Tensor inv_beta, c10::optional<torch::Tensor> left);
torch::Tensor narrow_conv1d(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t dilation,
                            c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> snake_alpha,
                            c10::optional<torch::Tensor> snake_inv_beta);
std::vector<torch::Tensor> residual_unit(torch::Tensor x, c10::optional<torch::Tensor> left, torch::Tensor alpha_a,
                                         torch::Tensor inv_beta_a, torch::Tensor w_a, c10::optional<torch::Tensor> bias_a,
                                         int64_t dilation, torch::Tensor alpha_b, torch::Tensor inv_beta_b,
                                         torch::Tensor w_b, c10::optional<torch::Tensor> bias_b);
torch::Tensor upsample_taps(torch::Tensor z, int64_t r, bool trimmed, c10::optional<torch::Tensor> bias);

// This extension has its own copy of parallel.h's `inline_work` (a separate shared library): the
// kernel-lookup module sets both when asked.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_inline_work", [](int64_t work) { mstar_cpu::inline_work.store(work); },
        "calls of less estimated work than this run their tasks inline (parallel.h)");
  m.def("inline_work", [] { return mstar_cpu::inline_work.load(); }, "see set_inline_work");
  m.def("moe_experts", &moe_experts, "the SwiGLU experts of a sparse MoE block over routed tokens",
        py::arg("x"), py::arg("weights"), py::arg("experts"), py::arg("gate_up"), py::arg("down"), py::arg("inter"));
  m.def("narrow_conv1d", &narrow_conv1d, "stride-1 convolution of a padded input with 1, 8 or a multiple of 16 output channels",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("dilation") = 1, py::arg("residual") = py::none(),
        py::arg("snake_alpha") = py::none(), py::arg("snake_inv_beta") = py::none());
  m.def("residual_unit", &residual_unit,
        "x + conv_b(snake_b(conv_a(snake_a([left, x])))) in one pass (a vocoder residual unit); returns (out, tail)",
        py::arg("x"), py::arg("left"), py::arg("alpha_a"), py::arg("inv_beta_a"), py::arg("w_a"), py::arg("bias_a"),
        py::arg("dilation"), py::arg("alpha_b"), py::arg("inv_beta_b"), py::arg("w_b"), py::arg("bias_b"));
  m.def("upsample_taps", &upsample_taps, "a transposed convolution's output from its taps (narrow_conv1d), plus the bias",
        py::arg("z"), py::arg("r"), py::arg("trimmed"), py::arg("bias") = py::none());
  m.def("snake_beta", &snake_beta, "x + inv_beta * sin(alpha * x)^2 over [batch, channels, time]",
        py::arg("x"), py::arg("alpha"), py::arg("inv_beta"), py::arg("left") = py::none());
}
