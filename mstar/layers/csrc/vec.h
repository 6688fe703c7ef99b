// Vector types and loads shared by the CPU kernels of every extension (core and model-specific).
// Vectors are GCC vector types; `vreg` is the register-wide one (16 floats with AVX-512, else 8).
#pragma once

#include <torch/types.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace mstar_cpu {

constexpr int64_t kVec = 16;

typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef uint16_t vu8 __attribute__((vector_size(16)));
typedef uint32_t vu32x8 __attribute__((vector_size(32)));

inline vf16 load(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf16 load(const c10::BFloat16* p) {  // 16 bf16 -> float32: the raw bits shifted up
#if defined(__AVX512F__)
  // one zero-extending load (GCC, tuned for 256-bit vectors, split the generic widening in two)
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  vu16 raw;
  std::memcpy(&raw, p, sizeof raw);
  vu32 wide = __builtin_convertvector(raw, vu32) << 16;
#endif
  vf16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf8 load8(const c10::BFloat16* p) {  // 8 bf16 -> float32
  vu8 raw;
  std::memcpy(&raw, p, sizeof raw);
  vu32x8 wide = __builtin_convertvector(raw, vu32x8) << 16;
  vf8 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline float scalar(float x) { return x; }
inline float scalar(c10::BFloat16 x) { return static_cast<float>(x); }
inline void put(float v, float* y) { *y = v; }
inline void put(float v, c10::BFloat16* y) { *y = c10::BFloat16(v); }  // round to nearest even

// The register-wide vector: 16 floats with AVX-512, else 8 (on AVX2 GCC turned selects and
// conversions of a 16-float vector into scalar code through the stack).
#if defined(__AVX512F__)
typedef vf16 vreg;
typedef vi16 vreg_i;
#else
typedef vf8 vreg;
typedef int32_t vreg_i __attribute__((vector_size(32)));
#endif
constexpr int64_t kRegLanes = sizeof(vreg) / sizeof(float);

inline vreg load_reg(const float* p) {
  vreg v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#if defined(__AVX512F__)
inline vreg load_reg(const c10::BFloat16* p) { return load(p); }
#else
inline vreg load_reg(const c10::BFloat16* p) { return load8(p); }
#endif

}  // namespace mstar_cpu
