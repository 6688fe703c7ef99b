// Qwen3-Omni's Code2Wav vocoder kernels (float32): SnakeBeta, stride-1 convolutions of few or
// 16-multiple output channels, a residual unit in one pass, and a transposed convolution's
// interleaving of its taps.
#include <torch/types.h>

#include "parallel.h"
#include "vec.h"

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

// ---- SnakeBeta --------------------------------------------------------------------------------
// sin(u) for |u| < kSinExact: u = k*pi + r with k = round(u / pi) (pi in two parts, fused
// multiply-adds), r in [-pi/2, pi/2]; sin(r) by its Taylor polynomial through r^13 (truncation
// < 1e-9 there), negated for odd k. Within a few float ulps of sinf; larger |u| take std::sin.
constexpr float kSinExact = 1.0e5f;

template <typename V, typename VI>
inline V sin_vec(V u) {
  const V k = (u * 0.318309886183790671f + 12582912.0f) - 12582912.0f;  // round to nearest
  V r = u - k * 3.14159274101257324f;
  r = r + k * 8.74227766e-08f;  // pi = 3.14159274101257324 - 8.74227766e-08
  const V r2 = r * r;
  V p = V{} + 1.6059043836821614e-10f;
  p = p * r2 - 2.5052108385441720e-08f;
  p = p * r2 + 2.7557319223985893e-06f;
  p = p * r2 - 1.9841269841269841e-04f;
  p = p * r2 + 8.3333333333333333e-03f;
  p = p * r2 - 1.6666666666666667e-01f;
  const V s = r + r * r2 * p;
  const VI odd = __builtin_convertvector(k, VI) & 1;
  return odd != 0 ? -s : s;
}

// A lane with |u| > kSinExact (past sin_vec's range reduction), or a NaN.
inline bool any_beyond_sin_range(vreg u) {
#if defined(__AVX512F__)
  if constexpr (sizeof(vreg) == 64)  // one compare into a mask (the lane loop below: ~20 instructions)
    return _mm512_cmp_ps_mask(_mm512_abs_ps(reinterpret_cast<__m512>(u)), _mm512_set1_ps(kSinExact), _CMP_NLE_UQ) != 0;
#endif
  const vreg_i big = (u > kSinExact) | (u < -kSinExact) | (u != u);
  bool any_big = false;
  for (int l = 0; l < kRegLanes; ++l) any_big |= big[l] != 0;
  return any_big;
}

// SnakeBeta of one register of a channel's steps: v + inv_beta * sin(alpha v)^2; the register goes
// through std::sin when a lane is beyond sin_vec's range.
inline vreg snake_reg(vreg v, float al, float be) {
  const vreg u = v * al;
  vreg s;
  if (!any_beyond_sin_range(u)) {
    s = sin_vec<vreg, vreg_i>(u);
  } else {
    for (int l = 0; l < kRegLanes; ++l) s[l] = std::sin(u[l]);
  }
  return v + be * (s * s);
}

// y = x + inv_beta[c] * sin(alpha[c] * x)^2 over x [B, C, T] (BigVGAN's SnakeBeta, Code2Wav's
// activation): one pass instead of five PyTorch operators; rows (b, c) in parallel.
// `left` [batch, channels, K] (optional): the output is [batch, channels, K + time], each row its
// `left` row (copied, not activated) then the activated x row: a causal convolution's input with
// its kept tail in front, without a separate concatenation pass.
torch::Tensor snake_beta(torch::Tensor x, torch::Tensor alpha, torch::Tensor inv_beta,
                         c10::optional<torch::Tensor> left) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "snake_beta: x must be contiguous float32 [batch, channels, time]");
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2);
  TORCH_CHECK(alpha.numel() == C && inv_beta.numel() == C && alpha.scalar_type() == torch::kFloat32 &&
                  inv_beta.scalar_type() == torch::kFloat32,
              "snake_beta: alpha and inv_beta must be float32 [channels]");
  torch::Tensor lc;
  int64_t K = 0;
  if (left.has_value()) {
    lc = left->contiguous();
    TORCH_CHECK(lc.dim() == 3 && lc.size(0) == B && lc.size(1) == C && lc.scalar_type() == torch::kFloat32,
                "snake_beta: left must be float32 [batch, channels, steps] matching x");
    K = lc.size(2);
  }
  auto a = alpha.contiguous(), ib = inv_beta.contiguous();
  auto y = torch::empty({B, C, K + T}, x.options());
  const float *xp = x.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = ib.data_ptr<float>();
  const float* lp = K ? lc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // tasks of up to 4096 steps of one row, or of whole rows adding up to about that many steps: a task
  // per row of a short row spent more on handing out the task than on the row itself
  const int64_t chunk = 4096, rows = B * C;
  const int64_t per_row = std::max<int64_t>(1, (T + chunk - 1) / chunk);
  const int64_t rows_per_task = per_row > 1 ? 1 : std::max<int64_t>(1, chunk / std::max<int64_t>(T, 1));
  const int64_t tasks = per_row > 1 ? rows * per_row : (rows + rows_per_task - 1) / rows_per_task;
  mstar_cpu::parallel_tasks(tasks, 16 * B * C * T, [&](int64_t task) {  // ~16 steps an element
    const int64_t first = per_row > 1 ? task / per_row : task * rows_per_task;
    const int64_t last = per_row > 1 ? first + 1 : std::min(rows, first + rows_per_task);
    const int64_t t0 = per_row > 1 ? (task % per_row) * chunk : 0, t1 = std::min(T, t0 + chunk);
    for (int64_t row = first; row < last; ++row) {
      const float al = ap[row % C], be = bp[row % C];
      const float* xr = xp + row * T;
      float* yr = yp + row * (K + T) + K;
      if (K && t0 == 0) std::memcpy(yr - K, lp + row * K, K * sizeof(float));
      int64_t t = t0;
      for (; t + kRegLanes <= t1; t += kRegLanes) {
        vreg v;
        std::memcpy(&v, xr + t, sizeof v);
        const vreg out = snake_reg(v, al, be);
        std::memcpy(yr + t, &out, sizeof out);
      }
      if (t < t1) {  // the last < 16 steps through the same vector code on a zero-padded copy, as the
        // fused convolutions load them: a step's value does not depend on where its row ends
        vreg v{};
        std::memcpy(&v, xr + t, (t1 - t) * sizeof(float));
        const vreg out = snake_reg(v, al, be);
        std::memcpy(yr + t, &out, (t1 - t) * sizeof(float));
      }
    }
  });
  return y;
}

// ---- narrow convolutions ----------------------------------------------------------------------
// y[b, o, t] = bias[o] + sum_{i, j} w[o, i, j] * x[b, i, t + j * dilation] over an already padded
// x [B, C_in, T + (K - 1) * dilation] (float32, contiguous), stride 1, no groups, C_out 1, 8 or a
// multiple of 16. For a vocoder's convolutions (oneDNN reorders few-channel tensors into its blocked
// layout and back at every call): 16 time steps per vector, up to 16 output channels' accumulators
// in registers, the terms added in (i, j) order, so a row's result never depends on the batch or
// the thread count. Tasks: (batch row, block of 16 outputs, block of steps). `snake_alpha` and
// `snake_inv_beta` ([in]): SnakeBeta (snake_beta's scales) applied to every input as it is loaded,
// instead of a pass writing the activated input (meant for kernel 1 and at most 16 outputs, where
// each input is loaded once).

// One task: output steps [t0, t1) of one batch row for CO output channels; CO known at compile
// time keeps every output channel's accumulator in a register. wt: weights as [in][kernel][ws]
// (ws >= CO: a block of a wider convolution's outputs starts at wt + its first output).
// sa / sb (optional): each input channel's SnakeBeta scales, applied to its inputs as they are loaded.
template <int CO>
void narrow_conv_rows(const float* xr, const float* wt, const float* b, float* yr, int64_t CI, int64_t K,
                      int64_t L, int64_t T, int64_t dilation, int64_t t0, int64_t t1, int64_t ws = CO,
                      const float* rr = nullptr, const float* sa = nullptr, const float* sb = nullptr) {
  // 16 steps (NS register-wide vectors) at a time, outputs in groups of G whose accumulators fit
  // the registers (AVX2: 4 outputs x 2 vectors, 6 loads per 8 multiply-adds)
  constexpr int NS = kVec / kRegLanes;
  constexpr int G = NS == 1 ? CO : (CO < 4 ? CO : 4);
  int64_t t = t0;
  if constexpr (CO == 1) {
    // one output: a single accumulator would chain every multiply-add on the one before (its
    // latency, not the unit's throughput, bounds it); four blocks of 16 steps at a time give four
    // independent chains. Each output's terms are still added in (i, j) order: the same bits
    constexpr int U = 4 * NS;
    auto blocks = [&](auto snake) {  // snake: std::true_type when the SnakeBeta is fused (no branch inside)
      for (; t + 4 * kVec <= t1; t += 4 * kVec) {
        vreg acc[U];
        for (int u = 0; u < U; ++u) acc[u] = vreg{} + b[0];
        for (int64_t i = 0; i < CI; ++i)
          for (int64_t j = 0; j < K; ++j) {
            const float* xs = xr + i * L + t + j * dilation;
            const float wv = wt[(i * K + j) * ws];
#pragma GCC unroll 16
            for (int u = 0; u < U; ++u) {
              vreg v;
              std::memcpy(&v, xs + u * kRegLanes, sizeof(vreg));
              if constexpr (decltype(snake)::value) v = snake_reg(v, sa[i], sb[i]);
              acc[u] += wv * v;
            }
          }
        for (int u = 0; u < U; ++u) {
          if (rr != nullptr) {
            vreg r;
            std::memcpy(&r, rr + t + u * kRegLanes, sizeof(vreg));
            acc[u] = acc[u] + r;
          }
          std::memcpy(yr + t + u * kRegLanes, &acc[u], sizeof(vreg));
        }
      }
    };
    if (sa != nullptr) blocks(std::true_type{});
    else blocks(std::false_type{});
  }
  for (; t + kVec <= t1; t += kVec) {
    for (int o0 = 0; o0 < CO; o0 += G) {
      vreg acc[G][NS];
      for (int o = 0; o < G; ++o)
        for (int n = 0; n < NS; ++n) acc[o][n] = vreg{} + b[o0 + o];
      for (int64_t i = 0; i < CI; ++i)
        for (int64_t j = 0; j < K; ++j) {
          vreg v[NS];
          for (int n = 0; n < NS; ++n) std::memcpy(&v[n], xr + i * L + t + j * dilation + n * kRegLanes, sizeof(vreg));
          if (sa != nullptr)
            for (int n = 0; n < NS; ++n) v[n] = snake_reg(v[n], sa[i], sb[i]);
          const float* wo = wt + (i * K + j) * ws + o0;
          for (int o = 0; o < G; ++o)
            for (int n = 0; n < NS; ++n) acc[o][n] += wo[o] * v[n];
        }
      if (rr != nullptr)  // the fused residual: one add after the sum, as y + residual would round
        for (int o = 0; o < G; ++o)
          for (int n = 0; n < NS; ++n) {
            vreg r;
            std::memcpy(&r, rr + (o0 + o) * T + t + n * kRegLanes, sizeof(vreg));
            acc[o][n] = acc[o][n] + r;
          }
      for (int o = 0; o < G; ++o)
        for (int n = 0; n < NS; ++n) std::memcpy(yr + (o0 + o) * T + t + n * kRegLanes, &acc[o][n], sizeof(vreg));
    }
  }
  if (t < t1) {
    // the last < 16 steps: the same vector code over a zero-padded copy of their inputs, so every
    // output step is computed alike wherever it falls (and a short input is not left to scalar code)
    const int64_t n = t1 - t, reach = (K - 1) * dilation, lb = kVec + reach;
    std::vector<float> xb(CI * lb, 0.0f), yb(CO * kVec);
    for (int64_t i = 0; i < CI; ++i) std::memcpy(xb.data() + i * lb, xr + i * L + t, (n + reach) * sizeof(float));
    narrow_conv_rows<CO>(xb.data(), wt, b, yb.data(), CI, K, lb, kVec, dilation, 0, kVec, ws, nullptr, sa, sb);
    for (int o = 0; o < CO; ++o) std::memcpy(yr + o * T + t, yb.data() + o * kVec, n * sizeof(float));
    if (rr != nullptr)
      for (int o = 0; o < CO; ++o)
        for (int64_t i = 0; i < n; ++i) yr[o * T + t + i] = yr[o * T + t + i] + rr[o * T + t + i];
  }
}

torch::Tensor narrow_conv1d(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t dilation,
                            c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> snake_alpha,
                            c10::optional<torch::Tensor> snake_inv_beta) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "narrow_conv1d: x must be contiguous float32 [batch, in, steps]");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat32 && w.size(1) == x.size(1) &&
                  (w.size(0) == 1 || w.size(0) == 8 || (w.size(0) > 0 && w.size(0) % 16 == 0)) && dilation >= 1,
              "narrow_conv1d: w must be float32 [out (1, 8 or a multiple of 16), in, kernel] matching x");
  const int64_t B = x.size(0), CI = x.size(1), CO = w.size(0), K = w.size(2);
  const int64_t L = x.size(2), T = L - (K - 1) * dilation;
  TORCH_CHECK(T >= 1, "narrow_conv1d: input shorter than the kernel's reach");
  auto wt = w.permute({1, 2, 0}).contiguous();  // [in, kernel, out]
  std::vector<float> b(CO, 0.0f);
  if (bias.has_value()) {
    auto bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == CO && bc.scalar_type() == torch::kFloat32, "narrow_conv1d: bias must be float32 [out]");
    std::memcpy(b.data(), bc.data_ptr<float>(), CO * sizeof(float));
  }
  torch::Tensor res;
  if (residual.has_value()) {  // y = conv(x) + residual, in the same store
    res = residual->contiguous();
    TORCH_CHECK(res.dim() == 3 && res.size(0) == B && res.size(1) == CO && res.size(2) == T &&
                    res.scalar_type() == torch::kFloat32,
                "narrow_conv1d: residual must be float32 [batch, out, steps of the output]");
  }
  const float* rp = residual.has_value() ? res.data_ptr<float>() : nullptr;
  torch::Tensor sa, sb;  // SnakeBeta of the inputs, fused (the scales of snake_beta)
  TORCH_CHECK(snake_alpha.has_value() == snake_inv_beta.has_value(), "narrow_conv1d: snake needs alpha and inv_beta");
  if (snake_alpha.has_value()) {
    sa = snake_alpha->contiguous();
    sb = snake_inv_beta->contiguous();
    TORCH_CHECK(sa.numel() == CI && sb.numel() == CI && sa.scalar_type() == torch::kFloat32 &&
                    sb.scalar_type() == torch::kFloat32,
                "narrow_conv1d: snake alpha and inv_beta must be float32 [in]");
  }
  const float* sap = sa.defined() ? sa.data_ptr<float>() : nullptr;
  const float* sbp = sb.defined() ? sb.data_ptr<float>() : nullptr;
  auto y = torch::empty({B, CO, T}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = wt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // tasks: (batch row, block of 16 outputs, block of steps); wider convolutions take shorter step
  // blocks, so a task's input rows stay in the L2 across its taps
  const int64_t blocks = CO >= 16 ? CO / 16 : 1;
  const int64_t chunk = CO > 16 ? std::max<int64_t>(256, ((int64_t{1} << 16) / std::max<int64_t>(CI, 1)) & ~int64_t{15})
                                : 4096;
  const int64_t per_row = (T + chunk - 1) / chunk, per_batch = blocks * per_row;
  mstar_cpu::parallel_tasks(B * per_batch, B * CO * CI * K * T, [&](int64_t task) {
    const int64_t row = task / per_batch, blk = task % per_batch / per_row;
    const int64_t t0 = (task % per_row) * chunk, t1 = std::min(T, t0 + chunk);
    const float* xr = xp + row * CI * L;
    float* yr = yp + row * CO * T;
    const float* rr = rp != nullptr ? rp + row * CO * T : nullptr;
    if (CO == 1) narrow_conv_rows<1>(xr, wp, b.data(), yr, CI, K, L, T, dilation, t0, t1, 1, rr, sap, sbp);
    else if (CO == 8) narrow_conv_rows<8>(xr, wp, b.data(), yr, CI, K, L, T, dilation, t0, t1, 8, rr, sap, sbp);
    else narrow_conv_rows<16>(xr, wp + blk * 16, b.data() + blk * 16, yr + blk * 16 * T, CI, K, L, T, dilation,
                              t0, t1, CO, rr != nullptr ? rr + blk * 16 * T : nullptr, sap, sbp);
  });
  return y;
}

// A vocoder residual unit, out = x + conv_b(snake_b(conv_a(snake_a([left, x])))), in one pass over
// x [B, C, T] (float32): conv_a a causal kernel-K convolution (dilation d, left padding (K-1)*d taken
// from `left` [B, C, (K-1)*d], already activated, or zeros), conv_b kernel 1, both C -> C with C 8
// or a multiple of 16. The three-kernel form (snake_beta writing the padded activated input,
// narrow_conv1d, narrow_conv1d with the second SnakeBeta and the residual fused) writes and reads
// back two [B, C, T] intermediates; here a task (batch row, block of steps) activates its inputs
// into a scratch tile, convolves it into a second tile and runs the kernel-1 convolution from there,
// so only x is read and only the output written. Every value is the same bits as the three-kernel
// form: the activation goes register by register on the same step alignment as snake_beta (a
// register's lanes fall back to std::sin together), the convolutions through narrow_conv_rows with
// each output's terms in (i, j) order, the second activation on registers aligned as that kernel's.
// Returns (out, tail): tail [B, C, (K-1)*d] = the last steps of the activated padded input, the
// next chunk's `left`.
namespace {
// SnakeBeta of x steps [u0, u1) (u1 <= T) of one channel into dst[u - u0], register by register on
// snake_beta's alignment (registers start at multiples of the lane count; the row's last register
// is zero-padded past T).
inline void snake_span(const float* xc, int64_t T, int64_t u0, int64_t u1, float al, float be, float* dst) {
  int64_t u = u0 / kRegLanes * kRegLanes;
  auto partial = [&](int64_t at) {  // a register only partly inside [u0, u1) or past T
    vreg v{};
    std::memcpy(&v, xc + at, std::min<int64_t>(kRegLanes, T - at) * sizeof(float));
    const vreg a = snake_reg(v, al, be);
    const int64_t lo = std::max(at, u0), hi = std::min(at + kRegLanes, u1);
    std::memcpy(dst + (lo - u0), reinterpret_cast<const float*>(&a) + (lo - at), (hi - lo) * sizeof(float));
  };
  if (u < u0) {
    partial(u);
    u += kRegLanes;
  }
  for (; u + kRegLanes <= u1; u += kRegLanes) {
    vreg v;
    std::memcpy(&v, xc + u, sizeof v);
    const vreg a = snake_reg(v, al, be);
    std::memcpy(dst + (u - u0), &a, sizeof a);
  }
  if (u < u1) partial(u);
}

template <int CO>
void unit_convs(const float* s, int64_t span, float* yt, int64_t n, const float* wa, const float* ba,
                const float* wb, const float* bb, int64_t C, int64_t K, int64_t d, float* outr,
                const float* xr, int64_t T, const float* sa, const float* sb) {
  const int64_t blocks = CO == 8 ? 1 : C / 16;
  for (int64_t blk = 0; blk < blocks; ++blk)
    narrow_conv_rows<CO>(s, wa + blk * CO, ba + blk * CO, yt + blk * CO * n, C, K, span, n, d, 0, n, C);
  if (blocks > 1) {  // activated once, in place (each output block would load and activate every input)
    for (int64_t c = 0; c < C; ++c) snake_span(yt + c * n, n, 0, n, sa[c], sb[c], yt + c * n);
    sa = sb = nullptr;
  }
  for (int64_t blk = 0; blk < blocks; ++blk)
    narrow_conv_rows<CO>(yt, wb + blk * CO, bb + blk * CO, outr + blk * CO * T, C, 1, n, T, 1, 0, n, C,
                         xr + blk * CO * T, sa, sb);
}
}  // namespace

std::vector<torch::Tensor> residual_unit(torch::Tensor x, c10::optional<torch::Tensor> left, torch::Tensor alpha_a,
                                         torch::Tensor inv_beta_a, torch::Tensor w_a, c10::optional<torch::Tensor> bias_a,
                                         int64_t dilation, torch::Tensor alpha_b, torch::Tensor inv_beta_b,
                                         torch::Tensor w_b, c10::optional<torch::Tensor> bias_b) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "residual_unit: x must be contiguous float32 [batch, channels, steps]");
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2);
  TORCH_CHECK((C == 8 || (C > 0 && C % 16 == 0)) && T >= 1, "residual_unit: channels must be 8 or a multiple of 16");
  TORCH_CHECK(w_a.dim() == 3 && w_a.size(0) == C && w_a.size(1) == C && w_a.scalar_type() == torch::kFloat32 &&
                  w_b.dim() == 3 && w_b.size(0) == C && w_b.size(1) == C && w_b.size(2) == 1 &&
                  w_b.scalar_type() == torch::kFloat32 && dilation >= 1,
              "residual_unit: weights must be float32 [C, C, K] and [C, C, 1]");
  const int64_t K = w_a.size(2), keep = (K - 1) * dilation;
  auto scales = [&](const torch::Tensor& t) {
    TORCH_CHECK(t.numel() == C && t.scalar_type() == torch::kFloat32, "residual_unit: snake scales must be float32 [C]");
    return t.contiguous();
  };
  auto a_a = scales(alpha_a), ib_a = scales(inv_beta_a), a_b = scales(alpha_b), ib_b = scales(inv_beta_b);
  auto bias = [&](const c10::optional<torch::Tensor>& b) {
    std::vector<float> v(C, 0.0f);
    if (b.has_value()) {
      auto bc = b->contiguous();
      TORCH_CHECK(bc.numel() == C && bc.scalar_type() == torch::kFloat32, "residual_unit: biases must be float32 [C]");
      std::memcpy(v.data(), bc.data_ptr<float>(), C * sizeof(float));
    }
    return v;
  };
  const std::vector<float> ba = bias(bias_a), bb = bias(bias_b);
  torch::Tensor lc;
  if (left.has_value()) {
    lc = left->contiguous();
    TORCH_CHECK(lc.dim() == 3 && lc.size(0) == B && lc.size(1) == C && lc.size(2) == keep &&
                    lc.scalar_type() == torch::kFloat32,
                "residual_unit: left must be float32 [batch, channels, (kernel - 1) * dilation]");
  }
  auto wa = w_a.permute({1, 2, 0}).contiguous(), wb = w_b.permute({1, 2, 0}).contiguous();  // [in, kernel, out]
  auto out = torch::empty({B, C, T}, x.options());
  auto tail = torch::empty({B, C, keep}, x.options());
  const float *xp = x.data_ptr<float>(), *lp = lc.defined() ? lc.data_ptr<float>() : nullptr;
  const float *sap = a_a.data_ptr<float>(), *sbp = ib_a.data_ptr<float>();
  const float *sa2 = a_b.data_ptr<float>(), *sb2 = ib_b.data_ptr<float>();
  const float *wap = wa.data_ptr<float>(), *wbp = wb.data_ptr<float>();
  float *op = out.data_ptr<float>(), *tp = tail.data_ptr<float>();
  // blocks of steps (a multiple of 16, so the second activation's registers fall where the
  // three-kernel form's do) whose tiles stay in L2: ~8K values of a block's outputs
  const int64_t block = std::clamp<int64_t>((int64_t{8192} / C) & ~int64_t{15}, 64, 1024);
  const int64_t per_row = (T + block - 1) / block;
  mstar_cpu::parallel_tasks(B * per_row, B * C * C * (K + 1) * T, [&](int64_t task) {
    const int64_t row = task / per_row, t0 = (task % per_row) * block, t1 = std::min(T, t0 + block);
    const int64_t n = t1 - t0, span = n + keep;
    thread_local std::vector<float> s, yt;  // the task's tiles (kept between calls: no allocation)
    if (s.size() < static_cast<size_t>(C * span)) s.resize(C * span);
    if (yt.size() < static_cast<size_t>(C * n)) yt.resize(C * n);
    const float* xr = xp + row * C * T;
    for (int64_t c = 0; c < C; ++c) {
      float* sr = s.data() + c * span;  // sr[j] = padded input step t0 + j: left for steps < keep
      const int64_t jl = std::min(span, std::max<int64_t>(0, keep - t0));
      if (lp != nullptr) std::memcpy(sr, lp + (row * C + c) * keep + t0, jl * sizeof(float));
      else std::fill(sr, sr + jl, 0.0f);
      snake_span(xr + c * T, T, t0 + jl - keep, t1, sap[c], sbp[c], sr + jl);  // x steps [t0 + jl - keep, t1)
      if (t1 == T) std::memcpy(tp + (row * C + c) * keep, sr + n, keep * sizeof(float));
    }
    float* outr = op + row * C * T + t0;
    if (C == 8) unit_convs<8>(s.data(), span, yt.data(), n, wap, ba.data(), wbp, bb.data(), C, K, dilation, outr,
                              xr + t0, T, sa2, sb2);
    else unit_convs<16>(s.data(), span, yt.data(), n, wap, ba.data(), wbp, bb.data(), C, K, dilation, outr,
                        xr + t0, T, sa2, sb2);
  });
  return {out, tail};
}

// A transposed convolution's output from its taps (`narrow_conv1d` of the input to k * C output
// channels, tap j of channel c at row j * C + c): z [B, k * C, L] -> y [B, C, L * r] with
// y[b, c, t * r + s] = z[b, s * C + c, t] when k == r, or, when k == 2r and r outputs are trimmed on
// each side, y[b, c, (t - 1) * r + s] = z[b, s * C + c, t] + z[b, (s + r) * C + c, t - 1] for t >= 1;
// then + bias[c] when given. One pass instead of an add of two strided views, a permuting copy and
// a bias add, each element rounded as those round it (the two taps' sum, then the bias).
torch::Tensor upsample_taps(torch::Tensor z, int64_t r, bool trimmed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(z.dim() == 3 && z.is_contiguous() && z.scalar_type() == torch::kFloat32 && r >= 1,
              "upsample_taps: z must be contiguous float32 [batch, taps * channels, steps], r >= 1");
  const int64_t k = trimmed ? 2 * r : r;
  TORCH_CHECK(z.size(1) % k == 0, "upsample_taps: z's rows must be ", k, " taps of the channels");
  const int64_t B = z.size(0), C = z.size(1) / k, L = z.size(2), steps = trimmed ? L - 1 : L;
  TORCH_CHECK(steps >= 0, "upsample_taps: no steps");
  torch::Tensor bc;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == C && bc.scalar_type() == torch::kFloat32, "upsample_taps: bias must be float32 [channels]");
  }
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  auto y = torch::empty({B, C, steps * r}, z.options());
  const float* zp = z.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  mstar_cpu::parallel_tasks(B * C, B * C * steps * r, [&](int64_t row) {
    const int64_t b = row / C, c = row % C;
    float* yr = yp + row * steps * r;
    const float* zb = zp + b * k * C * L;
    for (int64_t s = 0; s < r; ++s) {
      const float* now = zb + (s * C + c) * L;
      if (trimmed) {
        const float* before = zb + ((s + r) * C + c) * L;
        if (bp != nullptr) {
          const float bias_c = bp[c];
          for (int64_t t = 1; t <= steps; ++t) yr[(t - 1) * r + s] = (now[t] + before[t - 1]) + bias_c;
        } else {
          for (int64_t t = 1; t <= steps; ++t) yr[(t - 1) * r + s] = now[t] + before[t - 1];
        }
      } else if (bp != nullptr) {
        const float bias_c = bp[c];
        for (int64_t t = 0; t < steps; ++t) yr[t * r + s] = now[t] + bias_c;
      } else {
        for (int64_t t = 0; t < steps; ++t) yr[t * r + s] = now[t];
      }
    }
  });
  return y;
}
