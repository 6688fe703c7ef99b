// Linear layers over weights packed once into column panels (y[M, N] = x[M, K] @ W[K, N]); the
// layout and the register tiles are in panel_linear.h.
#include <torch/types.h>

#include "panel_linear.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

using namespace mstar_cpu;

// An empty CPU tensor on 2 MiB-aligned memory advised for transparent huge pages: the packed
// weights are streamed from memory at every step, and with 4 KiB pages the TLB misses are a
// visible share of a batch-1 step. Falls back to a plain allocation.
torch::Tensor huge_page_empty(at::IntArrayRef sizes, const torch::TensorOptions& options) {
  constexpr size_t kHuge = size_t(2) << 20;
  int64_t numel = 1;
  for (auto n : sizes) numel *= n;
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (bytes < kHuge) return torch::empty(sizes, options);
  void* ptr = nullptr;
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  if (posix_memalign(&ptr, kHuge, rounded) != 0) return torch::empty(sizes, options);
  madvise(ptr, rounded, MADV_HUGEPAGE);  // advice only: ignored where THP is off
  return torch::from_blob(ptr, sizes, [](void* p) { std::free(p); }, options);
}

// w [K, N] (float32 or bfloat16) -> panels [ceil(N / 64), K, 64], same dtype, zero-padded.
// silu_mul: w holds [gate | up] (N = 2 I); panel j gets gate columns [32 j, 32 j + 32) then the
// same up columns, so the fused epilogue finds both halves in one panel.
// pairs (bfloat16 w, even K, a CPU with AVX512-BF16): panels [P, K / 2, 64, 2], each column's
// weights for k = 2i, 2i + 1 side by side, as the bf16 dot-product instruction reads them.
torch::Tensor pack(torch::Tensor w, bool silu_mul, bool pairs) {
  TORCH_CHECK(w.dim() == 2, "weight must be [in, out]");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16,
              "weight must be float32 or bfloat16");
  const int64_t K = w.size(0), N = w.size(1);
  TORCH_CHECK(!pairs || (kDotPairs && w.scalar_type() == torch::kBFloat16 && K % 2 == 0),
              "pair packing needs bfloat16 weights, an even input size and AVX512-BF16");
  torch::Tensor src = w;
  if (silu_mul) {
    TORCH_CHECK(N % 2 == 0, "silu_mul needs [gate | up] columns");
    const int64_t I = N / 2, half = kPanel / 2, blocks = (I + half - 1) / half;
    auto gate = torch::zeros({K, blocks * half}, w.options());
    auto up = torch::zeros({K, blocks * half}, w.options());
    gate.narrow(1, 0, I).copy_(w.narrow(1, 0, I));
    up.narrow(1, 0, I).copy_(w.narrow(1, I, I));
    src = torch::stack({gate.view({K, blocks, half}), up.view({K, blocks, half})}, 2)
              .reshape({K, blocks * kPanel});
  }
  const int64_t cols = src.size(1), panels = (cols + kPanel - 1) / kPanel;
  auto padded = torch::zeros({K, panels * kPanel}, w.options());
  padded.narrow(1, 0, cols).copy_(src);
  if (pairs) {
    auto out = huge_page_empty({panels, K / 2, kPanel, 2}, w.options());
    out.copy_(padded.view({K / 2, 2, panels, kPanel}).permute({2, 0, 3, 1}));
    return out;
  }
  auto out = huge_page_empty({panels, K, kPanel}, w.options());
  out.copy_(padded.view({K, panels, kPanel}).permute({1, 0, 2}));
  return out;
}

bool dot_pairs_available() { return kDotPairs; }

template <typename TY>
void linear_into(const torch::Tensor& x, const torch::Tensor& packed, torch::Tensor& y,
                 const Epilogue<TY>& ep) {
  const int64_t M = x.size(0), K = x.size(1);
  TY* yp = y.data_ptr<TY>();
  if (packed.dim() == 4) {
#if defined(__AVX512BF16__)
    if (amx_usable(K))
      run_amx(x.data_ptr<c10::BFloat16>(), M, K, packed.data_ptr<c10::BFloat16>(), packed.size(0), yp, ep);
    else
      run<true>(x.data_ptr<c10::BFloat16>(), M, K, packed.data_ptr<c10::BFloat16>(), packed.size(0), yp, ep);
#endif
  } else if (x.scalar_type() == torch::kFloat32) {
    dispatch_weight(x.data_ptr<float>(), M, K, packed, yp, ep);
  } else {
    dispatch_weight(x.data_ptr<c10::BFloat16>(), M, K, packed, yp, ep);
  }
}

// x [M, K] float32 or bfloat16 contiguous; packed from `pack`; n_out output columns (N, or N / 2
// with silu_mul); residual [M, n_out] of the output's dtype, or none. The output has x's dtype
// (pair-packed weights: x is rounded to bfloat16 first); accumulation is float32 either way.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n_out, bool silu_mul,
                     c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> bias, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "input must be contiguous [rows, in]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "input must be float32 or bfloat16");
  const bool pairs = packed.dim() == 4;
  TORCH_CHECK(packed.is_contiguous() &&
                  ((!pairs && packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1)) ||
                   (pairs && packed.size(2) == kPanel && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1))),
              "packed weight does not match the input size");
  TORCH_CHECK(n_out >= 1 && n_out <= packed.size(0) * kPanel / (silu_mul ? 2 : 1),
              "output columns out of range");
  const auto out_dtype = x.scalar_type();
  auto input = pairs ? x.to(torch::kBFloat16) : x;
  auto y = torch::empty({x.size(0), n_out}, x.options().dtype(out_dtype));
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    TORCH_CHECK(!silu_mul, "silu_mul and residual do not combine");
    TORCH_CHECK(residual->scalar_type() == out_dtype && residual->is_contiguous() &&
                    residual->size(0) == x.size(0) && residual->size(1) == n_out,
                "residual must be contiguous [rows, out] of the input's dtype");
  }
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(!silu_mul, "a bias does not combine with silu_mul");
    TORCH_CHECK(bias->scalar_type() == out_dtype && bias->is_contiguous() && bias->dim() == 1 &&
                    bias->size(0) == n_out,
                "bias must be contiguous [out] of the input's dtype");
  }
  TORCH_CHECK(!gelu || (out_dtype == torch::kFloat32 && !silu_mul && !has_res),
              "gelu needs a float32 output without silu_mul or a residual");
  if (x.size(0) == 0) return y;
  if (out_dtype == torch::kFloat32) {
    Epilogue<float> ep{silu_mul, has_res ? residual->data_ptr<float>() : nullptr, n_out,
                       has_bias ? bias->data_ptr<float>() : nullptr, gelu};
    linear_into(input, packed, y, ep);
  } else {
    Epilogue<c10::BFloat16> ep{silu_mul, has_res ? residual->data_ptr<c10::BFloat16>() : nullptr, n_out,
                               has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr};
    linear_into(input, packed, y, ep);
  }
  return y;
}

// torch.argmax(linear(x, packed, n_out), -1) without storing the product: float32 x and a float32
// packed weight (not silu_mul). Each output value is the one `linear` computes (same tiles, same
// accumulation order), so the index is the same as the stored product's argmax, row by row, in any
// batch and at any thread count.
torch::Tensor linear_argmax(torch::Tensor x, torch::Tensor packed, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "linear_argmax: input must be contiguous float32 [rows, in]");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == torch::kFloat32 &&
                  packed.size(2) == kPanel && packed.size(1) == x.size(1),
              "linear_argmax: needs a float32 packed weight matching the input size");
  TORCH_CHECK(n_out >= 1 && n_out <= packed.size(0) * kPanel, "linear_argmax: output columns out of range");
  const int64_t M = x.size(0), panels = packed.size(0);
  auto out = torch::empty({M}, x.options().dtype(torch::kInt64));
  if (M == 0) return out;
  const int64_t run_len = panel_run_len(panels);
  const int64_t runs = (panels + run_len - 1) / run_len;
  std::vector<float> best(runs * M, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> at(runs * M, -1), nan(runs * M, std::numeric_limits<int64_t>::max());
  ArgmaxSink sink{best.data(), at.data(), nan.data(), M, run_len};
  Epilogue<float> ep{false, nullptr, n_out, nullptr, false, &sink};
  dispatch_weight(x.data_ptr<float>(), M, x.size(1), packed, static_cast<float*>(nullptr), ep);
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    float b = -std::numeric_limits<float>::infinity();
    int64_t a = -1, first_nan = std::numeric_limits<int64_t>::max();
    for (int64_t k = 0; k < runs; ++k) {  // runs in column order: a later equal value does not win
      const int64_t slot = k * M + r;
      first_nan = std::min(first_nan, nan[slot]);
      if (at[slot] >= 0 && best[slot] > b) {
        b = best[slot];
        a = at[slot];
      }
    }
    // torch.argmax: the first NaN if any; else the first maximum (a row of -inf only: column 0)
    op[r] = first_nan != std::numeric_limits<int64_t>::max() ? first_nan : (a >= 0 ? a : 0);
  }
  return out;
}

bool tile_unit_available(int64_t in_features) { return amx_usable(in_features); }
