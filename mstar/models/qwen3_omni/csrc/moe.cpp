// Qwen3-Omni's sparse MoE block (thinker and talker): every routed expert of a token batch in one
// call, over expert weights packed by the core extension's `pack` (panel_linear.h's layout; both
// extensions are built with the same flags, so the layouts agree).
#include <torch/types.h>

#include "panel_linear.h"

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

namespace {

// One expert's linear (weights `packed[e]`) over M contiguous rows of x, as `linear` multiplies them.
template <typename T>
void expert_linear(const T* x, int64_t M, int64_t K, const torch::Tensor& packed, int64_t e, T* y,
                   const Epilogue<T>& ep) {
  const int64_t panels = packed.size(1), per_expert = packed.numel() / packed.size(0);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const c10::BFloat16* w = packed.data_ptr<c10::BFloat16>() + e * per_expert;
    if (packed.dim() == 5) {  // pair-packed
#if defined(__AVX512BF16__)
      if (amx_usable(K))
        run_amx(x, M, K, w, panels, y, ep);
      else
        run<true>(x, M, K, w, panels, y, ep);
#endif
      return;
    }
    run<false>(x, M, K, w, panels, y, ep);
  } else {
    run<false>(x, M, K, packed.data_ptr<float>() + e * per_expert, panels, y, ep);
  }
}

// Token t's row of the MoE output: its k experts' rows of y (row_of[pair]), each scaled by its
// weight and rounded to T, summed into a zero row by expert id ascending, rounded to T after every
// add: the bits of the grouped loop's `out.index_add_(0, rows, y * w)` over the experts in order.
// A product and the add after it are two roundings, as in PyTorch: no fused multiply-adds here.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void sum_expert_outputs(const T* y, const T* wts, const int64_t* ids, const int64_t* row_of, int64_t t, int64_t k,
                        int64_t H, float* acc, T* o) {
  int64_t order[16];
  const int64_t n = std::min<int64_t>(k, 16);
  for (int64_t j = 0; j < n; ++j) order[j] = t * k + j;
  std::sort(order, order + n, [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::fill(acc, acc + H, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const T* yr = y + row_of[order[j]] * H;
    const float w = scalar(wts[order[j]]);
    for (int64_t h = 0; h < H; ++h) acc[h] = as_stored(acc[h] + as_stored(scalar(yr[h]) * w, o), o);
  }
  for (int64_t h = 0; h < H; ++h) put(acc[h], o + h);
}
#pragma GCC pop_options

template <typename T>
void moe_rows(const T* x, const T* wts, const int64_t* ids, int64_t tokens, int64_t k, int64_t H, int64_t I,
              int64_t E, const torch::Tensor& gate_up, const torch::Tensor& down, T* out) {
  // the (token, choice) pairs grouped by expert, tokens ascending within an expert (a counting sort)
  const int64_t pairs = tokens * k;
  std::vector<int64_t> start(E + 1, 0), token_of(pairs), row_of(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t r = fill[ids[p]]++;
    token_of[r] = p / k;
    row_of[p] = r;
  }
  // tasks: (expert, up to kRowChunk of its rows); a task gathers its rows, then runs gate/up with
  // SiLU-mul and down on them whole (inside the parallel region `run` works inline, on this thread)
  std::vector<std::array<int64_t, 3>> tasks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = start[e]; r < start[e + 1]; r += kRowChunk)
      tasks.push_back({e, r, std::min(start[e + 1], r + kRowChunk)});
  const torch::TensorOptions opts = torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  const torch::Tensor gathered = torch::empty({pairs, H}, opts), hidden = torch::empty({pairs, I}, opts),
                      down_out = torch::empty({pairs, H}, opts);
  T* xg = gathered.data_ptr<T>();
  T* hg = hidden.data_ptr<T>();
  T* yg = down_out.data_ptr<T>();
  const Epilogue<T> ep_up{true, nullptr, I}, ep_down{false, nullptr, H};
  mstar_cpu::parallel_tasks(static_cast<int64_t>(tasks.size()), pairs * 3 * H * I, [&](int64_t t) {
    const auto [e, r0, r1] = tasks[t];
    for (int64_t r = r0; r < r1; ++r) std::memcpy(xg + r * H, x + token_of[r] * H, sizeof(T) * H);
    expert_linear(xg + r0 * H, r1 - r0, H, gate_up, e, hg + r0 * I, ep_up);
    expert_linear(hg + r0 * I, r1 - r0, I, down, e, yg + r0 * H, ep_down);
  });
  // each token: its experts' outputs summed (`sum_expert_outputs`)
  constexpr int64_t kTokenChunk = 16;
  mstar_cpu::parallel_tasks((tokens + kTokenChunk - 1) / kTokenChunk, pairs * H, [&](int64_t chunk) {
    std::vector<float> acc(H);
    for (int64_t t = chunk * kTokenChunk; t < std::min(tokens, (chunk + 1) * kTokenChunk); ++t)
      sum_expert_outputs(yg, wts, ids, row_of.data(), t, k, H, acc.data(), out + t * H);
  });
}

}  // namespace

// The experts of a sparse MoE block over a flat token batch: x [T, H]; weights [T, k] (x's dtype) and
// expert ids [T, k] (int64) from the router; gate_up [E, ...] each expert's [gate | up] packed by
// `pack(..., silu_mul=true)`, down [E, ...] each expert's down projection packed by `pack`, stacked,
// of x's dtype; `inter` the experts' intermediate size. Returns sum_j weights[t, j] * expert_j(x[t])
// with every expert a SwiGLU, the same bits as multiplying each expert's rows through `linear` and
// adding them with `index_add_` expert by expert (a row's bits do not depend on the batch).
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor weights, torch::Tensor experts, torch::Tensor gate_up,
                          torch::Tensor down, int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "input must be contiguous [tokens, hidden]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "input must be float32 or bfloat16");
  const int64_t tokens = x.size(0), H = x.size(1);
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == tokens && experts.scalar_type() == torch::kInt64 &&
                  experts.is_contiguous(), "expert ids must be contiguous int64 [tokens, k]");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == x.scalar_type() &&
                  weights.is_contiguous(), "weights must be contiguous [tokens, k] of the input's dtype");
  const int64_t E = gate_up.size(0), k = experts.size(1);
  TORCH_CHECK(k >= 1 && k <= 16, "1 to 16 experts per token");
  auto packed_ok = [&](const torch::Tensor& p, int64_t in) {
    if (!p.is_contiguous() || p.scalar_type() != x.scalar_type() || p.size(0) != E) return false;
    if (p.dim() == 4) return p.size(2) == in && p.size(3) == kPanel;
    return p.dim() == 5 && kDotPairs && p.size(2) * 2 == in && p.size(3) == kPanel && p.size(4) == 2;
  };
  TORCH_CHECK(inter >= 1 && packed_ok(gate_up, H) && gate_up.size(1) * kPanel >= 2 * inter,
              "gate_up must be [experts, panels, hidden, 64] (or pair-packed) of the input's dtype");
  TORCH_CHECK(down.size(0) == E && packed_ok(down, inter) && down.size(1) * kPanel >= H,
              "down must be [experts, panels, inter, 64] (or pair-packed) of the input's dtype");
  auto ids = experts.data_ptr<int64_t>();
  for (int64_t p = 0; p < tokens * k; ++p) TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "expert id out of range");
  auto out = torch::empty_like(x);
  if (tokens == 0) return out;
  if (x.scalar_type() == torch::kFloat32)
    moe_rows(x.data_ptr<float>(), weights.data_ptr<float>(), ids, tokens, k, H, inter, E, gate_up, down,
             out.data_ptr<float>());
  else
    moe_rows(x.data_ptr<c10::BFloat16>(), weights.data_ptr<c10::BFloat16>(), ids, tokens, k, H, inter, E, gate_up,
             down, out.data_ptr<c10::BFloat16>());
  return out;
}
