// Element-wise math on GCC vector-extension registers, shared by the extension's kernels.
//
// exp2_nonpositive(x) = 2^x for x <= 0, lane by lane: x clamped to -126 (2^-126 vanishes in any sum
// whose largest term is 1), n = round(x), r = x - n in [-1/2, 1/2] (exact), 2^r by a degree-6
// polynomial (a relative-error fit made for this file: ~1.3 ulp in float32 with fused
// multiply-adds), times 2^n. With AVX-512 the rounding and the scaling are single instructions.
// exp_nonpositive(x) = e^x for x <= 0 the same way, its reduction done in the natural base.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace mstar_vec {

constexpr float kExp2C[7] = {1.0f, 0.6931472f, 0.24022646f, 0.055503286f, 0.009618489f, 0.001339993f,
                             0.00015345792f};

template <typename V>
inline V exp2_poly(V r) {
  V p = V{} + kExp2C[6];
  p = p * r + kExp2C[5];
  p = p * r + kExp2C[4];
  p = p * r + kExp2C[3];
  p = p * r + kExp2C[2];
  p = p * r + kExp2C[1];
  return p * r + kExp2C[0];
}

// V: a float vector type, VI: its int32 twin (same lane count).
// n, rounded to the nearest integer, of x (no NaN, |x| < 2^22); its float value.
template <typename V>
inline V round_nearest(V x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64)
    return reinterpret_cast<V>(_mm512_roundscale_ps(reinterpret_cast<__m512>(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  return (x + magic) - magic;
}

// p * 2^n for an integer-valued n in [-126, 0], exact.
template <typename V, typename VI>
inline V times_pow2(V p, V n) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64)
    return reinterpret_cast<V>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#endif
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// With AVX-512 the clamp is max(x, -126), which also takes a NaN to -126 (its second operand).
template <typename V, typename VI>
inline V exp2_nonpositive(V x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) {
    x = reinterpret_cast<V>(_mm512_max_ps(reinterpret_cast<__m512>(x), _mm512_set1_ps(-126.0f)));
  } else {
    x = x < -126.0f ? V{} - 126.0f : x;
  }
#else
  x = x < -126.0f ? V{} - 126.0f : x;
#endif
  const V n = round_nearest(x);
  return times_pow2<V, VI>(exp2_poly(x - n), n);
}

// e^x for x <= 0 lane by lane (x clamped to -126 ln 2, where e^x vanishes beside 1): n = round(x log2 e),
// r = x - n ln 2 with ln 2 in two parts (Cody and Waite: n times the first part is exact), so r is
// accurate to a few ulp of itself however large n; then 2^(r log2 e) by the polynomial, times 2^n.
// Scaling x by log2 e first would lose |x log2 e| * 2^-24 of the exponent (4e-6 relative at x = -70).
template <typename V, typename VI>
inline V exp_nonpositive(V x) {
  constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606820309417e-6f, kLog2e = 1.44269504088896341f;
  const V lo = V{} - 87.33654475f;  // 126 ln 2
  x = x < lo ? lo : x;
  const V n = round_nearest(x * kLog2e);
  const V r = (x - n * kLn2Hi) - n * kLn2Lo;
  return times_pow2<V, VI>(exp2_poly(r * kLog2e), n);
}

// GELU (the erf form, x * (1 + erf(x / sqrt 2)) / 2) lane by lane, with erf by Abramowitz and Stegun
// 7.1.26 (absolute error below 1.5e-7, the formula PyTorch's vectorised erf uses too): for z = |x| /
// sqrt 2, 1 - erf(z) = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) e^(-z^2), t = 1 / (1 + p z). A negative
// x takes that tail directly (no cancellation in 1 + erf).
template <typename V, typename VI>
inline V gelu_erf(V x) {
  const V z = (x < 0.0f ? -x : x) * 0.70710678118654752f;
  const V t = 1.0f / (1.0f + 0.3275911f * z);
  V poly = 1.061405429f * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  const V tail = poly * t * exp2_nonpositive<V, VI>(-(z * z) * 1.44269504088896341f);
  const V half = 0.5f * x;
  return x < 0.0f ? half * tail : half * (2.0f - tail);
}

}  // namespace mstar_vec
