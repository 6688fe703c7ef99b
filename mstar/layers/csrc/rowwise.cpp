// Row-wise CPU kernels: RMSNorm and LayerNorm, the rotary embedding in place (half-split and
// adjacent pairs) and the row argmax (greedy sampling).
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

namespace {
#if defined(__AVX512F__)
// 16 floats rounded as c10::BFloat16(float) rounds one (to nearest even; a NaN becomes 0x7FC0), kept
// as floats (the rounded values) or stored as bf16.
inline vu32 bf16_bits(vf16 v) {
  vu32 u;
  std::memcpy(&u, &v, sizeof u);
  const vu32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (v != v) ? vu32{} + 0x7FC0u : rounded;
}
inline vf16 round_as(vf16 v, const float*) { return v; }
inline vf16 round_as(vf16 v, const c10::BFloat16*) {
  const vu32 wide = bf16_bits(v) << 16;
  vf16 r;
  std::memcpy(&r, &wide, sizeof r);
  return r;
}
inline void store(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }
inline void store(c10::BFloat16* p, vf16 v) {
  const vu16 narrow = __builtin_convertvector(bf16_bits(v), vu16);
  std::memcpy(p, &narrow, sizeof narrow);
}
constexpr bool kVectorRows = true;
#else
template <typename T>
inline vf16 round_as(vf16 v, const T*) { return v; }
template <typename T>
inline void store(T*, vf16) {}
constexpr bool kVectorRows = false;  // AVX2: GCC's code for a 16-float vector went through the stack
#endif
}  // namespace

// RMSNorm of each row of x [T, H] (float32 or bfloat16; weight of the same dtype), in float32:
// weight * (x * rsqrt(mean(x^2) + eps)), the result in x's dtype (bfloat16: the normalised row is
// rounded, then multiplied by the weight and rounded again, as the reference's bf16 module does).
// The sum of squares is 16 lane-wise partial sums folded in a fixed tree (the same order for every
// row). With AVX-512 the lanes are one vector and the row is normalised 16 elements at a time (the
// same operations per element as the scalar loops, which GCC left scalar for bf16).
// Input row t is at xp + (t / group) * group_stride + (t % group) * H (a plain matrix: group 1,
// group_stride H; per-head rows of a [T, heads, H] view of a wider tensor: group heads); the output
// rows are contiguous.
template <typename T>
void rms_norm_rows(const T* xp, const T* wp, T* op, int64_t T_, int64_t H, float e, int64_t group = 1,
                   int64_t group_stride = -1) {
  if (group_stride < 0) group_stride = group * H;
  mstar_cpu::parallel_tasks((T_ + 15) / 16, T_ * H, [&](int64_t task) {
    for (int64_t t = task * 16; t < std::min(T_, task * 16 + 16); ++t) {
      const T* row = xp + (t / group) * group_stride + (t % group) * H;
      float lanes[kVec] = {0};
      int64_t i = 0;
      if constexpr (kVectorRows) {
        vf16 acc = {0};
        for (; i + kVec <= H; i += kVec) {
          const vf16 v = load(row + i);
          acc += v * v;
        }
        std::memcpy(lanes, &acc, sizeof acc);
      } else {
        for (; i + kVec <= H; i += kVec)
          for (int64_t l = 0; l < kVec; ++l) lanes[l] += scalar(row[i + l]) * scalar(row[i + l]);
      }
      for (int64_t l = 0; i < H; ++i, ++l) lanes[l] += scalar(row[i]) * scalar(row[i]);
      for (int64_t w = kVec / 2; w >= 1; w /= 2)
        for (int64_t l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      const float inv = 1.0f / std::sqrt(lanes[0] / static_cast<float>(H) + e);
      T* o = op + t * H;
      int64_t j = 0;
      if constexpr (kVectorRows) {
        for (; j + kVec <= H; j += kVec) {
          const vf16 normed = round_as(load(row + j) * inv, o);
          store(o + j, load(wp + j) * normed);
        }
      }
      for (; j < H; ++j) {
        T normed;
        put(scalar(row[j]) * inv, &normed);
        put(scalar(wp[j]) * scalar(normed), o + j);
      }
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  // [tokens, hidden] contiguous, or [tokens, heads, head_dim] whose heads lie one after another in
  // each token's row of a wider tensor (per-head q/k norms over a view of a fused projection): no copy
  const bool heads = x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.stride(0) >= x.size(1) * x.size(2);
  TORCH_CHECK((x.dim() == 2 && x.is_contiguous()) || heads,
              "input must be a contiguous [tokens, hidden] or a [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "input must be float32 or bfloat16");
  const int64_t H = x.size(x.dim() - 1), group = heads ? x.size(1) : 1, rows = x.numel() / std::max<int64_t>(H, 1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] of the input's dtype");
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t stride = heads ? x.stride(0) : group * H;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat32)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, H, e, group, stride);
  else
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                  rows, H, e, group, stride);
  return out;
}

// LayerNorm of each row of x [T, H] (float32): (x - mean) * rstd * weight + bias, rstd =
// 1 / sqrt(var + eps), var = mean((x - mean)^2) (two passes). Both sums are 16 lane-wise partial sums
// folded in a fixed tree, so a row's result is the same bits in any batch; it is within float32
// rounding of PyTorch's LayerNorm (which sums in another order), not its bits.
void layer_norm_rows(const float* xp, const float* wp, const float* bp, float* op, int64_t T_, int64_t H, float e) {
  mstar_cpu::parallel_tasks((T_ + 15) / 16, 2 * T_ * H, [&](int64_t task) {
    for (int64_t t = task * 16; t < std::min(T_, task * 16 + 16); ++t) {
      const float* row = xp + t * H;
      auto lane_sum = [&](auto term) {  // sum over the row of term(x), 16 lanes then a fixed tree
        float lanes[kVec] = {0};
        int64_t i = 0;
        vf16 acc = {0};
        for (; i + kVec <= H; i += kVec) acc += term(load(row + i));
        std::memcpy(lanes, &acc, sizeof acc);
        for (int64_t l = 0; i < H; ++i, ++l) lanes[l] += term(vf16{} + row[i])[0];
        for (int64_t w = kVec / 2; w >= 1; w /= 2)
          for (int64_t l = 0; l < w; ++l) lanes[l] += lanes[l + w];
        return lanes[0];
      };
      const float mean = lane_sum([](vf16 v) { return v; }) / static_cast<float>(H);
      const float var = lane_sum([mean](vf16 v) { return (v - mean) * (v - mean); }) / static_cast<float>(H);
      const float rstd = 1.0f / std::sqrt(var + e);
      float* o = op + t * H;
      int64_t j = 0;
      for (; j + kVec <= H; j += kVec) {
        const vf16 y = (load(row + j) - mean) * rstd * load(wp + j) + load(bp + j);
        std::memcpy(o + j, &y, sizeof y);
      }
      for (; j < H; ++j) o[j] = (row[j] - mean) * rstd * wp[j] + bp[j];
    }
  });
}

torch::Tensor layer_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "input must be contiguous float32 [rows, hidden]");
  for (const auto* p : {&weight, &bias})
    TORCH_CHECK(p->dim() == 1 && p->size(0) == x.size(1) && p->is_contiguous() && p->scalar_type() == torch::kFloat32,
                "weight and bias must be float32 [hidden]");
  auto out = torch::empty_like(x);
  layer_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(), out.data_ptr<float>(),
                  x.size(0), x.size(1), static_cast<float>(eps));
  return out;
}

// fn(v, c, s) for heads [0, heads) of each row t of y [T, >= heads * D]: v the head's D values, c / s
// row t's tables; rows in tasks of 16.
template <typename T, typename Fn>
void each_head(T* yp, const T* cp, const T* sp, int64_t T_, int64_t stride, int64_t heads, int64_t D, const Fn& fn) {
  mstar_cpu::parallel_tasks((T_ + 15) / 16, T_ * heads * D, [&](int64_t task) {
    for (int64_t t = task * 16; t < std::min(T_, task * 16 + 16); ++t)
      for (int64_t h = 0; h < heads; ++h) fn(yp + t * stride + h * D, cp + t * D, sp + t * D);
  });
}

// The rotary embedding applied in place to heads [0, heads) of each row of y [T, >= heads * D]
// (q and k heads side by side, as the packed q/k/v projection writes them): with a = y[i] and
// b = y[i + D/2], y[i] = a cos[i] - b sin[i], y[i + D/2] = b cos[i + D/2] + a sin[i + D/2]
// (float32 arithmetic; y and the tables float32, or all bfloat16 with the results rounded).
template <typename T>
void rotary_rows(T* yp, const T* cp, const T* sp, int64_t T_, int64_t stride, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  each_head(yp, cp, sp, T_, stride, heads, D, [half](T* v, const T* c, const T* s) {
    int64_t i = 0;
    if constexpr (kVectorRows) {  // 16 pairs at a time, the same operations per element
      for (; i + kVec <= half; i += kVec) {
        const vf16 a = load(v + i), b = load(v + i + half);
        store(v + i, a * load(c + i) - b * load(s + i));
        store(v + i + half, b * load(c + i + half) + a * load(s + i + half));
      }
    }
    for (; i < half; ++i) {
      const float a = scalar(v[i]), b = scalar(v[i + half]);
      put(a * scalar(c[i]) - b * scalar(s[i]), v + i);
      put(b * scalar(c[i + half]) + a * scalar(s[i + half]), v + i + half);
    }
  });
}

void rotary_(torch::Tensor y, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t D) {
  const auto dt = y.scalar_type();
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && (dt == torch::kFloat32 || dt == torch::kBFloat16) &&
                  y.size(1) >= heads * D && D % 2 == 0,
              "rotary: y must be float32 or bfloat16 [tokens, >= heads * head_dim] with unit column stride");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == y.size(0) &&
                  cos.size(1) == D && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == dt && sin.scalar_type() == dt,
              "rotary: cos / sin must be contiguous [tokens, head_dim] of y's dtype");
  if (dt == torch::kFloat32)
    rotary_rows(y.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.size(0), y.stride(0), heads, D);
  else
    rotary_rows(y.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(),
                y.size(0), y.stride(0), heads, D);
}

// The rotary embedding of adjacent channel pairs (V-JEPA 2's), in place over heads [0, heads) of each
// row of y [T, >= heads * D] float32: with a = y[2i], b = y[2i + 1],
//   y[2i] = a * cos[2i] + (-b) * sin[2i],   y[2i + 1] = b * cos[2i + 1] + a * sin[2i + 1]
// each product rounded, then the sum: what PyTorch computes for x * cos + swapped * sin (two
// multiplies and an add, no fused multiply-add), so the bits are PyTorch's. GCC would contract the
// expression into fused multiply-adds: not in this function.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rotary_pairs_rows(float* yp, const float* cp, const float* sp, int64_t T_, int64_t stride, int64_t heads,
                       int64_t D) {
  each_head(yp, cp, sp, T_, stride, heads, D, [D](float* v, const float* c, const float* s) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const vf16 sign = {-1.0f, 1.0f, -1.0f, 1.0f, -1.0f, 1.0f, -1.0f, 1.0f,
                       -1.0f, 1.0f, -1.0f, 1.0f, -1.0f, 1.0f, -1.0f, 1.0f};
    for (; i + kVec <= D; i += kVec) {
      const vf16 x = load(v + i);
      const vf16 swapped = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14) * sign;
      const vf16 rc = x * load(c + i);
      const vf16 rs = swapped * load(s + i);
      const vf16 r = rc + rs;
      std::memcpy(v + i, &r, sizeof r);
    }
#endif
    for (; i < D; i += 2) {
      const float a = v[i], b = v[i + 1];
      const float r0c = a * c[i], r0s = -b * s[i];
      const float r1c = b * c[i + 1], r1s = a * s[i + 1];
      v[i] = r0c + r0s;
      v[i + 1] = r1c + r1s;
    }
  });
}
#pragma GCC pop_options

void rotary_pairs_(torch::Tensor y, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t D) {
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.scalar_type() == torch::kFloat32 && y.size(1) >= heads * D &&
                  D % 2 == 0,
              "rotary_pairs: y must be float32 [tokens, >= heads * head_dim] with unit column stride, head_dim even");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == y.size(0) && cos.size(1) == D &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32,
              "rotary_pairs: cos / sin must be contiguous float32 [tokens, head_dim]");
  rotary_pairs_rows(y.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.size(0), y.stride(0), heads, D);
}

// The index of each row's maximum (the first one on ties; the first NaN if there is one, as
// torch.argmax), x [B, V] float32 or bfloat16 contiguous, V >= 1; rows in parallel. One pass: each
// lane keeps its maximum and the first index holding it (a strictly greater value replaces both),
// then the smallest index among the lanes holding the row's maximum is the first one. A row with a
// NaN is scanned again for its first NaN.

template <typename T>
int64_t argmax_row(const T* row, int64_t V) {
  int64_t i = 0, arg = 0;
  float best = scalar(row[0]);
  bool any_nan = false;
  if (V >= kRegLanes) {
    vreg m = load_reg(row);
    vreg_i at, nan = m != m;
    for (int l = 0; l < kRegLanes; ++l) at[l] = l;
    vreg_i lane_at = at;
    for (i = kRegLanes; i + kRegLanes <= V; i += kRegLanes) {
      const vreg v = load_reg(row + i);
      lane_at += kRegLanes;
      nan |= (v != v);
      const vreg_i greater = v > m;
      m = greater ? v : m;
      at = greater ? lane_at : at;
    }
    best = m[0];
    for (int l = 1; l < kRegLanes; ++l) best = m[l] > best ? m[l] : best;
    arg = V;
    for (int l = 0; l < kRegLanes; ++l) {
      any_nan |= nan[l] != 0;
      if (m[l] == best && at[l] < arg) arg = at[l];
    }
  }
  for (; i < V; ++i) {  // the tail (or a row shorter than a vector): later indices win only if greater
    const float v = scalar(row[i]);
    any_nan |= v != v;
    if (v > best) {
      best = v;
      arg = i;
    }
  }
  if (any_nan) {
    for (int64_t j = 0; j < V; ++j) {
      const float v = scalar(row[j]);
      if (v != v) return j;
    }
  }
  return arg;
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) >= 1 &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "argmax_rows: x must be contiguous float32 or bfloat16 [rows, vocab]");
  const int64_t B = x.size(0), V = x.size(1);
  auto out = torch::empty({B}, x.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  if (x.scalar_type() == torch::kFloat32) {
    const float* xp = x.data_ptr<float>();
    mstar_cpu::parallel_tasks(B, B * V, [&](int64_t r) { op[r] = argmax_row(xp + r * V, V); });
  } else {
    const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
    mstar_cpu::parallel_tasks(B, B * V, [&](int64_t r) { op[r] = argmax_row(xp + r * V, V); });
  }
  return out;
}
