// Decode attention over the paged KV cache, read in place through the block tables (CPU).
//
// One query token per row. Work is split into tasks (a row, or a range of its kv heads when there
// are fewer rows than threads); one thread computes a whole task, and each query head's arithmetic
// follows a fixed order that depends only on its row's context length and the head layout:
//   scores[h][t] = dot(q[h], k[t])            16 lane-wise partial sums, then a fixed tree
//   m[h] = max_t scores[h][t];  p = exp(scores - m);  l[h] = sum_t p[h][t]   (16 lanes, fixed tree)
//   out[h] = (sum_t p[h][t] * v[t]) / l[h]    t ascending, element by element
// So a row's output is the same bits in any batch, at any position and with any thread count
// (for one build of this file). Sums are written as explicit 16-lane vectors (GCC vector
// extensions) or elementwise loops, never left for the compiler to reassociate.
#include <torch/types.h>

#include "parallel.h"
#include "vec_math.h"

#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int kLanes = 16;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint16_t raw;
  std::memcpy(&raw, &x, sizeof raw);
  uint32_t bits = static_cast<uint32_t>(raw) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 lanes as one vector (GCC vector extension: lane-wise arithmetic, whatever the target width).
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

// p[0..16) as floats, loaded as one vector: filling a float array element by element and copying it
// into the vector made GCC (tuned for a Xeon, 256-bit vectors preferred) store two halves and load the
// whole, a store-forwarding stall on every load.
inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 lanes as floats: the raw bits widened and shifted up (exact). VH / VW: the 16- and 32-bit
// unsigned vectors of VF's lane count.
template <typename VF, typename VH, typename VW>
inline VF widen_bf16(const c10::BFloat16* p) {
  VH raw;
  std::memcpy(&raw, p, sizeof raw);
  const VW wide = __builtin_convertvector(raw, VW) << 16;
  VF v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

#if defined(__AVX512F__)
// One zero-extending load and a shift: GCC (tuned for 256-bit vectors) split the vector-extension
// widening into two 8-lane conversions and an insert.
inline vf16 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  vf16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}
#else
inline vf16 load16(const c10::BFloat16* p) {
  typedef uint16_t vu16 __attribute__((vector_size(32)));
  typedef uint32_t vu32 __attribute__((vector_size(64)));
  return widen_bf16<vf16, vu16, vu32>(p);
}
#endif

template <typename T>
inline vf16 load_tail(const T* p, int64_t n) {  // p[0..n), n < 16, then zeros
  float f[kLanes] = {0};
  for (int64_t l = 0; l < n; ++l) f[l] = to_float(p[l]);
  vf16 v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

// The lanes folded in a fixed tree: (l + l+8), then (l + l+4), (l + l+2), (0 + 1).
inline float fold(vf16 a) {
  vf8 s8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

#if defined(__AVX512F__)
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  vf16 acc = {0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) acc += load16(q + i) * load16(k + i);
  if (i < d) acc += load_tail(q + i, d - i) * load_tail(k + i, d - i);
  return fold(acc);
}

inline float sum(const float* x, int64_t n) {
  vf16 acc = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load16(x + i);
  if (i < n) acc += load_tail(x + i, n - i);
  return fold(acc);
}

// dot() of one query with 16 keys at once: each key's 16 lane-wise partial sums exactly as dot() forms
// them, then the 16 folds together, pairs of vectors combined lane-wise so that every key's lanes are
// added in fold()'s tree ((l + l+8), (l + l+4), then (0 + 2) + (1 + 3)): the same 16 floats as 16
// dot() calls, with half the shuffles a key and no scalar tail. keys[j] + off: key j's row.
template <typename T>
__attribute__((always_inline)) inline vf16 dot16(const float* q, const T* const* keys, int64_t off, int64_t d) {
  vf16 a[kLanes];
  for (int j = 0; j < kLanes; ++j) a[j] = vf16{0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const vf16 qv = load16(q + i);
    for (int j = 0; j < kLanes; ++j) a[j] += qv * load16(keys[j] + off + i);
  }
  if (i < d) {
    const vf16 qv = load_tail(q + i, d - i);
    for (int j = 0; j < kLanes; ++j) a[j] += qv * load_tail(keys[j] + off + i, d - i);
  }
  vf16 b[8];  // b[m]: lanes [0, 8) key 2m's (l + l+8), [8, 16) key 2m+1's
  for (int m = 0; m < 8; ++m)
    b[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  vf16 c[4];  // c[m]: 4 lanes per key (s8[l] + s8[l+4]) for keys 4m .. 4m+3
  for (int m = 0; m < 4; ++m)
    c[m] = __builtin_shufflevector(b[2 * m], b[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * m], b[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  vf16 e[2];  // e[m]: 2 lanes per key (s4[0] + s4[2], s4[1] + s4[3]) for keys 8m .. 8m+7
  for (int m = 0; m < 2; ++m)
    e[m] = __builtin_shufflevector(c[2 * m], c[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * m], c[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
constexpr bool kDot16 = true;
#else
// The same 16 lanes as two 8-float halves (GCC's code for a 16-float vector on AVX2 went through
// the stack): lanes [0, 8) in lo, [8, 16) in hi, and the fold's first step is lo + hi.
inline vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf8 load8(const c10::BFloat16* p) {
  typedef uint16_t vu8 __attribute__((vector_size(16)));
  typedef uint32_t vu32x8 __attribute__((vector_size(32)));
  return widen_bf16<vf8, vu8, vu32x8>(p);
}

inline float fold(vf8 lo, vf8 hi) {
  const vf8 s8 = lo + hi;
  const vf4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  vf8 lo = {0}, hi = {0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    lo += load8(q + i) * load8(k + i);
    hi += load8(q + i + 8) * load8(k + i + 8);
  }
  if (i < d) {
    float qt[kLanes] = {0}, kt[kLanes] = {0};
    for (int64_t l = 0; l < d - i; ++l) {
      qt[l] = q[i + l];
      kt[l] = to_float(k[i + l]);
    }
    lo += load8(qt) * load8(kt);
    hi += load8(qt + 8) * load8(kt + 8);
  }
  return fold(lo, hi);
}

inline float sum(const float* x, int64_t n) {
  vf8 lo = {0}, hi = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    lo += load8(x + i);
    hi += load8(x + i + 8);
  }
  if (i < n) {
    float t[kLanes] = {0};
    std::memcpy(t, x + i, sizeof(float) * (n - i));
    lo += load8(t);
    hi += load8(t + 8);
  }
  return fold(lo, hi);
}
template <typename T>
inline vf16 dot16(const float*, const T* const*, int64_t, int64_t) { return vf16{}; }
constexpr bool kDot16 = false;  // AVX2: one key at a time
#endif

typedef int32_t vi16 __attribute__((vector_size(64)));
typedef int32_t vi8 __attribute__((vector_size(32)));

// exp(x) for x <= 0 (softmax after subtracting the max), lane by lane: 2^n * poly(r), r = x - n ln2,
// |r| <= ln2/2; within ~2 ulp of expf. Written on vectors because GCC does not vectorise a scalar
// loop of it for every target (on an AVX2 build it stayed scalar).
// V is the register-wide vector (16 floats with AVX-512, else 8: a 16-float select on AVX2 was
// split into scalar code), VI its int32 twin.
template <typename V, typename VI>
inline V exp_nonpositive_v(V x) {
  const V lo = V{} - 87.0f, magic = V{} + 12582912.0f;
  x = x < lo ? lo : x;
  const V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  V p = V{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
typedef vf16 vexp;
typedef vi16 vexp_i;
#else
typedef vf8 vexp;
typedef vi8 vexp_i;
#endif
constexpr int64_t kExpLanes = sizeof(vexp) / sizeof(float);

inline float exp_nonpositive(float x) { return exp_nonpositive_v<vexp, vexp_i>(vexp{} + x)[0]; }

// s[j] = exp(s[j] - m) for j in [0, n), a register's lanes at a time; the last partial group goes
// through a padded copy, so every element takes the same vector instructions wherever it sits.
inline void exp_shifted(float* s, int64_t n, float m) {
  int64_t j = 0;
  for (; j + kExpLanes <= n; j += kExpLanes) {
    vexp v;
    std::memcpy(&v, s + j, sizeof v);
    v = exp_nonpositive_v<vexp, vexp_i>(v - m);
    std::memcpy(s + j, &v, sizeof v);
  }
  if (j < n) {
    float tail[kExpLanes] = {0};
    std::memcpy(tail, s + j, sizeof(float) * (n - j));
    vexp v;
    std::memcpy(&v, tail, sizeof v);
    v = exp_nonpositive_v<vexp, vexp_i>(v - m);
    std::memcpy(tail, &v, sizeof v);
    std::memcpy(s + j, tail, sizeof(float) * (n - j));
  }
}

// max(p[0..n)), n >= 1: lane-wise maxima, then the lanes and the tail (a maximum is the same in
// any order).
inline float max_of(const float* p, int64_t n) {
  float m = p[0];
  int64_t j = 0;
  if (n >= kExpLanes) {
    vexp mv;
    std::memcpy(&mv, p, sizeof mv);
    for (j = kExpLanes; j + kExpLanes <= n; j += kExpLanes) {
      vexp v;
      std::memcpy(&v, p + j, sizeof v);
      mv = v > mv ? v : mv;
    }
    for (int64_t l = 0; l < kExpLanes; ++l) m = mv[l] > m ? mv[l] : m;
  }
  for (; j < n; ++j) m = p[j] > m ? p[j] : m;
  return m;
}

// 2^x for x <= 0 (vec_math.h), for the block kernel's softmax: its scores are in log2 units (the
// queries carry log2 e).
inline vf16 exp2_nonpositive(vf16 x) { return mstar_vec::exp2_nonpositive<vf16, vi16>(x); }
inline vf8 exp2_nonpositive(vf8 x) { return mstar_vec::exp2_nonpositive<vf8, vi8>(x); }

inline float exp2_nonpositive(float x) { return exp2_nonpositive(vexp{} + x)[0]; }

// The largest lane of a register, halving in a tree (the same value in any order).
inline float max_lanes(vf8 a) {
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3), c = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const vf4 m4 = b > c ? b : c;
  const float x = m4[0] > m4[2] ? m4[0] : m4[2], y = m4[1] > m4[3] ? m4[1] : m4[3];
  return x > y ? x : y;
}
inline float max_lanes(vf16 a) {
  const vf8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
  const vf8 c = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  return max_lanes(b > c ? b : c);
}

// The lanes of a register folded in a fixed tree.
inline float fold_lanes(vf16 a) { return fold(a); }
inline float fold_lanes(vf8 a) {
  const vf4 s4 = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

struct Layout {
  int64_t block_size, kv_heads, head_dim, group, table_width;
};

constexpr int64_t kPrefetchKeys = 4;  // how many keys ahead the next keys are prefetched

inline int64_t slot_of(const int64_t* table, int64_t t, int64_t block_size) {
  return table[t / block_size] * block_size + t % block_size;
}

template <typename T>
inline void prefetch(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(p + i);
}

// One task: kv heads [g0, g1) of one row (each with its `group` query heads) over `ctx` keys.
// Which heads share a task only decides what is read together: a head's arithmetic is the same.
template <typename T>
void attend_task(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t ctx,
                 int64_t g0, int64_t g1, const Layout& ly, float* out, std::vector<float>& scores) {
  const int64_t d = ly.head_dim, heads = (g1 - g0) * ly.group, span = (g1 - g0) * d;
  const int64_t row_stride = ly.kv_heads * d;  // elements between two keys' rows in the cache
  scores.assign(heads * ctx, 0.0f);
  int64_t t = 0;
  if constexpr (kDot16) {  // 16 keys at a time, each head's 16 scores folded together (dot16)
    const T* rows[kLanes];
    for (; t + kLanes <= ctx; t += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) rows[j] = kc + slot_of(table, t + j, ly.block_size) * row_stride + g0 * d;
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = t + kLanes + h; j < std::min(ctx, t + 2 * kLanes); j += heads)  // the next group, spread
          prefetch(kc + slot_of(table, j, ly.block_size) * row_stride + g0 * d, span);
        const vf16 s16 = dot16(q + h * d, rows, (h / ly.group) * d, d);
        std::memcpy(scores.data() + h * ctx + t, &s16, sizeof s16);
      }
    }
  }
  for (; t < ctx; ++t) {
    if (t + kPrefetchKeys < ctx)
      prefetch(kc + slot_of(table, t + kPrefetchKeys, ly.block_size) * row_stride + g0 * d, span);
    const T* k = kc + slot_of(table, t, ly.block_size) * row_stride + g0 * d;
    for (int64_t h = 0; h < heads; ++h) scores[h * ctx + t] = dot(q + h * d, k + (h / ly.group) * d, d);
  }
  std::vector<float> inv(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * ctx;
    const float m = max_of(s, ctx);  // a maximum is the same in any order; one at a time was a serial chain
    exp_shifted(s, ctx, m);
    inv[h] = 1.0f / sum(s, ctx);
  }
  std::memset(out, 0, sizeof(float) * heads * d);
  // out[h] += p[h][t] * v[t] for t ascending; four keys per pass over `out` (the same sums in the
  // same order as one key at a time: ((o + p0 v0) + p1 v1) + ...)
  for (t = 0; t + 4 <= ctx; t += 4) {
    if (t + 4 + kPrefetchKeys <= ctx)
      for (int64_t j = 0; j < 4; ++j)
        prefetch(vc + slot_of(table, t + kPrefetchKeys + j, ly.block_size) * row_stride + g0 * d, span);
    const T* v[4];
    for (int64_t j = 0; j < 4; ++j) v[j] = vc + slot_of(table, t + j, ly.block_size) * row_stride + g0 * d;
    for (int64_t h = 0; h < heads; ++h) {
      const float* p = scores.data() + h * ctx + t;
      const int64_t kv = (h / ly.group) * d;
      const T *v0 = v[0] + kv, *v1 = v[1] + kv, *v2 = v[2] + kv, *v3 = v[3] + kv;
      float* o = out + h * d;
      int64_t i = 0;
      if constexpr (kDot16) {  // whole vectors (GCC's own vectorisation of the loop below used half-width ones)
        for (; i + kLanes <= d; i += kLanes) {
          vf16 acc;
          std::memcpy(&acc, o + i, sizeof acc);
          acc = (((acc + p[0] * load16(v0 + i)) + p[1] * load16(v1 + i)) + p[2] * load16(v2 + i)) +
                p[3] * load16(v3 + i);
          std::memcpy(o + i, &acc, sizeof acc);
        }
      }
      for (; i < d; ++i)
        o[i] = (((o[i] + p[0] * to_float(v0[i])) + p[1] * to_float(v1[i])) + p[2] * to_float(v2[i])) +
               p[3] * to_float(v3[i]);
    }
  }
  for (; t < ctx; ++t) {
    const T* v = vc + slot_of(table, t, ly.block_size) * row_stride + g0 * d;
    for (int64_t h = 0; h < heads; ++h) {
      const float p = scores[h * ctx + t];
      const T* vh = v + (h / ly.group) * d;
      float* o = out + h * d;
      for (int64_t i = 0; i < d; ++i) o[i] = o[i] + p * to_float(vh[i]);
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < d; ++i) out[h * d + i] *= inv[h];
}

template <typename T>
void attend_rows(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& tables, const torch::Tensor& ctx, torch::Tensor& out) {
  const int64_t rows = q.size(0), q_heads = q.size(1);
  const Layout ly{k_cache.size(1), k_cache.size(2), k_cache.size(3), q_heads / k_cache.size(2),
                  tables.size(1)};
  // a row's kv heads are split into `parts` tasks only when there are fewer rows than threads
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::min<int64_t>(ly.kv_heads, std::max<int64_t>(1, (threads + rows - 1) / rows));
  const int64_t per_part = (ly.kv_heads + parts - 1) / parts;
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  int64_t keys = 0;  // the rows' context lengths: the call's work is keys * q_heads * head_dim * 2
  for (int64_t r = 0; r < rows; ++r) keys += cp[r];
  // every task runs whole on one thread, whichever thread that is
  mstar_cpu::parallel_tasks(rows * parts, 2 * keys * q_heads * ly.head_dim, [&](int64_t task) {
    thread_local std::vector<float> scores;
    {
      const int64_t r = task / parts, g0 = (task % parts) * per_part;
      const int64_t g1 = std::min(ly.kv_heads, g0 + per_part);
      if (g0 >= g1) return;
      const int64_t off = (r * q_heads + g0 * ly.group) * ly.head_dim;
      attend_task<T>(qp + off, kp, vp, tp + r * ly.table_width, cp[r], g0, g1, ly, op + off, scores);
    }
  });
}

}  // namespace

// queries [rows, q_heads, head_dim] float32 (already scaled); caches [blocks, block_size, kv_heads,
// head_dim] float32 or bfloat16, contiguous; tables int64 [rows, width]; ctx int64 [rows], >= 1.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor ctx) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "queries must be contiguous float32 [rows, q_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == v_cache.dtype(),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim] of one dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "head_dim / head counts of queries and cache disagree");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.is_contiguous() &&
                  tables.scalar_type() == torch::kInt64 && ctx.scalar_type() == torch::kInt64 &&
                  ctx.is_contiguous() && ctx.numel() == q.size(0),
              "tables must be int64 [rows, width], ctx int64 [rows]");
  auto out = torch::empty_like(q);
  if (k_cache.scalar_type() == torch::kFloat32) {
    attend_rows<float>(q, k_cache, v_cache, tables, ctx, out);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16, "cache dtype must be float32 or bfloat16");
    attend_rows<c10::BFloat16>(q, k_cache, v_cache, tables, ctx, out);
  }
  return out;
}

namespace {

// rows [T, H, D] (unit stride inside a row) -> cache rows at `slots`, converted to the cache dtype
// (bfloat16: rounded to nearest even, as Tensor.to does).
template <typename TS, typename TC>
void store_rows(const torch::Tensor& rows, torch::Tensor& cache, const int64_t* slots) {
  const int64_t T = rows.size(0), n = rows.size(1) * rows.size(2), stride = rows.stride(0);
  const TS* src = rows.data_ptr<TS>();
  TC* dst = cache.data_ptr<TC>();
  for (int64_t t = 0; t < T; ++t) {
    const TS* s = src + t * stride;
    TC* d = dst + slots[t] * n;
    if constexpr (std::is_same_v<TS, TC>) {
      std::memcpy(d, s, sizeof(TC) * n);
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<TC>(static_cast<float>(s[i]));
    }
  }
}

template <typename TS>
void store_both(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                const int64_t* slots) {
  if (k_cache.scalar_type() == torch::kFloat32) {
    store_rows<TS, float>(k, k_cache, slots);
    store_rows<TS, float>(v, v_cache, slots);
  } else {
    store_rows<TS, c10::BFloat16>(k, k_cache, slots);
    store_rows<TS, c10::BFloat16>(v, v_cache, slots);
  }
}

// float32 queries [T, Hq, D], contiguous: q * scale element by element (as torch.mul).
template <typename TS>
torch::Tensor scaled_queries(const torch::Tensor& q, float scale) {
  const int64_t T = q.size(0), n = q.size(1) * q.size(2), stride = q.stride(0);
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kFloat32));
  const TS* src = q.data_ptr<TS>();
  float* dst = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < n; ++i) dst[t * n + i] = static_cast<float>(src[t * stride + i]) * scale;
  return out;
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), what,
              " must be [tokens, heads, head_dim] with contiguous rows");
}

}  // namespace

// k / v rows [T, kv_heads, head_dim] (float32 or bfloat16, one dtype; rows may be strided views) stored
// into the caches at `slots` (int64 [T], each in the cache), converted to the cache's dtype as
// Tensor.to converts (bfloat16: round to nearest even): index_copy_ of the rows into the flat caches.
void store_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  check_rows(k, "k");
  check_rows(v, "v");
  const auto dt = k.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kBFloat16) && v.scalar_type() == dt && k.sizes() == v.sizes(),
              "k and v must be float32 or bfloat16 rows of one dtype and shape");
  TORCH_CHECK(k_cache.dim() == 4 && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3) &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dtype() == v_cache.dtype() &&
                  (k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim] of k's heads, float32 or bfloat16");
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == k.size(0) && slots.scalar_type() == torch::kInt64 &&
                  slots.is_contiguous(),
              "slots must be int64 [tokens]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot ", sp[t], " is outside the cache");
  if (dt == torch::kFloat32)
    store_both<float>(k, v, k_cache, v_cache, sp);
  else
    store_both<c10::BFloat16>(k, v, k_cache, v_cache, sp);
}

// One decode step of a batch whose rows are all single-token causal appends: the new k / v rows
// are stored at `slots` (int64 [T], all >= 0), then every row attends over its cache as
// `paged_decode` (its queries scaled first). q, k, v: float32 or bfloat16 (one dtype; rows may be
// strided views of a packed projection's output). Returns [T, Hq, D] in q's dtype.
torch::Tensor decode_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor slots, torch::Tensor tables, torch::Tensor ctx,
                          double scale) {
  check_rows(q, "q");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kBFloat16) && k.scalar_type() == dt && k.size(0) == q.size(0),
              "q, k, v must share one dtype, float32 or bfloat16, and their tokens");
  store_kv_(k, v, k_cache, v_cache, slots);  // checks k, v, the caches and the slots
  const float s = static_cast<float>(scale);
  auto queries = dt == torch::kFloat32 ? scaled_queries<float>(q, s) : scaled_queries<c10::BFloat16>(q, s);
  auto out = paged_decode(queries, k_cache, v_cache, tables, ctx);
  return dt == torch::kFloat32 ? out : out.to(dt);
}

// ------------------------------------------------------------------------------------------------
// Multi-token queries over the paged cache (prefill chunks, frame / image blocks), read in place.
//
// A sequence's queries attend to its first `ctx` cached keys (its new K/V are stored before the
// call): bidirectionally (query i sees keys [0, ctx)) or causally (query i of n sees keys
// [0, ctx - n + 1 + i)). Tasks are (sequence, query head, tile of up to kTileRows queries); one
// thread computes a task. Keys are taken in chunks of kChunk from key 0 (an online softmax over the
// chunks), and every query row's arithmetic depends only on its own query, its visible keys and
// that fixed chunking:
//   s[j]  = sum_d q'[d] * k[j][d]                  d ascending, one accumulator per (row, key), with
//                                                  q' = q * (scale * log2 e): scores in log2 units
//   chunk: m' = max(m, max_j s[j]);  p[j] = 2^(s[j] - m');  a = 2^(m - m')
//          l = l * a + sum_j p[j] (register lanes, fixed tree);  o = o * a, then o += p[j] * v[j], j ascending
//   out = o * (1 / l)
// so a row's output is the same bits whatever tile, batch or thread count computes it.
namespace {

constexpr int64_t kTileRows = 128;  // the most query rows per task (a sequence's rows split evenly)
constexpr int64_t kChunk = 128;    // keys per online-softmax step (a multiple of 32)
constexpr int64_t kRowGroup = 8;   // rows per register tile in the two products

constexpr int64_t kBlockPrefetchKeys = 16;  // keys prefetched ahead while a chunk is converted

struct BlockTask {
  int64_t seq, head, r0, r1;
};

#if defined(__AVX512F__)
// scores[r][j] = sum_d qt[r][d] * kt[d][j] for r in [0, R), j in [0, nk) rounded up to 32; d ascending.
// R = kRowGroup, or fewer for a tile's last rows (each row's arithmetic is its own: the same bits).
template <int R = kRowGroup>
inline void score_group(const float* qt, int64_t d, const float* kt, int64_t nk, float* scores) {
  for (int64_t jv = 0; jv < nk; jv += 2 * kLanes) {
    vf16 acc[R][2];
    for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf16{0};
    for (int64_t i = 0; i < d; ++i) {
      vf16 k0, k1;
      std::memcpy(&k0, kt + i * kChunk + jv, sizeof k0);
      std::memcpy(&k1, kt + i * kChunk + jv + kLanes, sizeof k1);
      for (int64_t r = 0; r < R; ++r) {
        const float qv = qt[r * d + i];
        acc[r][0] += qv * k0;
        acc[r][1] += qv * k1;
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      std::memcpy(scores + r * kChunk + jv, &acc[r][0], sizeof acc[r][0]);
      std::memcpy(scores + r * kChunk + jv + kLanes, &acc[r][1], sizeof acc[r][1]);
    }
  }
}

// o[r][c..c+16*NV) += sum_j p[r][j] * v[j][c..), j ascending over [0, nk), for R rows.
template <int NV, int R = kRowGroup>
inline void value_group(const float* p, const float* const* vr, int64_t d, int64_t nk, int64_t c, float* o) {
  vf16 acc[R][NV];
  for (int64_t r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) std::memcpy(&acc[r][v], o + r * d + c + v * kLanes, sizeof(vf16));
  for (int64_t j = 0; j < nk; ++j) {
    vf16 vv[NV];
    for (int v = 0; v < NV; ++v) std::memcpy(&vv[v], vr[j] + c + v * kLanes, sizeof(vf16));
    for (int64_t r = 0; r < R; ++r) {
      const float pr = p[r * kChunk + j];
      for (int v = 0; v < NV; ++v) acc[r][v] += pr * vv[v];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) std::memcpy(o + r * d + c + v * kLanes, &acc[r][v], sizeof(vf16));
}

// Both products for the group of rows from g: whole groups of kRowGroup, the tile's last rows (fewer
// than kRowGroup) as a group of their own size; the padding rows past them are not computed.
template <int R>
inline void group_products(const float* qt, const float* kt, const float* p, const float* const* vr, int64_t d,
                           int64_t nk, float* scores_or_null, float* o) {
  if (scores_or_null != nullptr) {
    score_group<R>(qt, d, kt, nk, scores_or_null);
    return;
  }
  int64_t c = 0;
  for (; c + 2 * kLanes <= d; c += 2 * kLanes) value_group<2, R>(p, vr, d, nk, c, o);
  if (c < d) value_group<1, R>(p, vr, d, nk, c, o);
}

inline void products_rows(int64_t rows, const float* qt, const float* kt, const float* p, const float* const* vr,
                          int64_t d, int64_t nk, float* scores_or_null, float* o) {
  switch (rows) {
    case 1: group_products<1>(qt, kt, p, vr, d, nk, scores_or_null, o); break;
    case 2: group_products<2>(qt, kt, p, vr, d, nk, scores_or_null, o); break;
    case 3: group_products<3>(qt, kt, p, vr, d, nk, scores_or_null, o); break;
    case 4: group_products<4>(qt, kt, p, vr, d, nk, scores_or_null, o); break;
    case 5: group_products<5>(qt, kt, p, vr, d, nk, scores_or_null, o); break;
    case 6: group_products<6>(qt, kt, p, vr, d, nk, scores_or_null, o); break;
    case 7: group_products<7>(qt, kt, p, vr, d, nk, scores_or_null, o); break;
    default: group_products<kRowGroup>(qt, kt, p, vr, d, nk, scores_or_null, o); break;
  }
}
constexpr bool kPartialGroups = true;
#else
// The same two products for a CPU without AVX-512 (16 ymm registers of 8 floats): the tile is
// 4 rows x 16 columns (8 accumulators, 2 loaded vectors, a broadcast), the row group in two halves.
// Each score / output element gets the same operations in the same order as above.
constexpr int64_t kHalfRows = kRowGroup / 2;

inline void score_group(const float* qt, int64_t d, const float* kt, int64_t nk, float* scores) {
  for (int64_t h = 0; h < kRowGroup; h += kHalfRows) {
    for (int64_t jv = 0; jv < nk; jv += 16) {
      vf8 acc[kHalfRows][2];
      for (int64_t r = 0; r < kHalfRows; ++r) acc[r][0] = acc[r][1] = vf8{0};
      for (int64_t i = 0; i < d; ++i) {
        vf8 k0, k1;
        std::memcpy(&k0, kt + i * kChunk + jv, sizeof k0);
        std::memcpy(&k1, kt + i * kChunk + jv + 8, sizeof k1);
        for (int64_t r = 0; r < kHalfRows; ++r) {
          const float qv = qt[(h + r) * d + i];
          acc[r][0] += qv * k0;
          acc[r][1] += qv * k1;
        }
      }
      for (int64_t r = 0; r < kHalfRows; ++r) {
        std::memcpy(scores + (h + r) * kChunk + jv, &acc[r][0], sizeof acc[r][0]);
        std::memcpy(scores + (h + r) * kChunk + jv + 8, &acc[r][1], sizeof acc[r][1]);
      }
    }
  }
}

template <int NV>  // NV 16-float column groups from c
inline void value_group(const float* p, const float* const* vr, int64_t d, int64_t nk, int64_t c, float* o) {
  for (int64_t h = 0; h < kRowGroup; h += kHalfRows) {
    for (int64_t cc = c; cc < c + NV * kLanes; cc += 16) {
      vf8 acc[kHalfRows][2];
      for (int64_t r = 0; r < kHalfRows; ++r)
        for (int v = 0; v < 2; ++v) std::memcpy(&acc[r][v], o + (h + r) * d + cc + 8 * v, sizeof(vf8));
      for (int64_t j = 0; j < nk; ++j) {
        vf8 v0, v1;
        std::memcpy(&v0, vr[j] + cc, sizeof v0);
        std::memcpy(&v1, vr[j] + cc + 8, sizeof v1);
        for (int64_t r = 0; r < kHalfRows; ++r) {
          const float pr = p[(h + r) * kChunk + j];
          acc[r][0] += pr * v0;
          acc[r][1] += pr * v1;
        }
      }
      for (int64_t r = 0; r < kHalfRows; ++r)
        for (int v = 0; v < 2; ++v) std::memcpy(o + (h + r) * d + cc + 8 * v, &acc[r][v], sizeof(vf8));
    }
  }
}
inline void products_rows(int64_t, const float*, const float*, const float*, const float* const*, int64_t, int64_t,
                          float*, float*) {}
constexpr bool kPartialGroups = false;  // AVX2: whole groups (the padding rows computed and dropped)
#endif

// kt[i][j] = key j's element i (kt: [d][kChunk]) for the chunk's nk keys (rows[j]: key j's row).
// On AVX-512: 16 keys x 16 elements at a time, as floats, transposed in registers (four rounds of
// two-source shuffles, each exchanging blocks of S between row pairs S apart); the rest one by one.
template <typename T>
inline void transpose_keys_scalar(const void* const* rows, int64_t j0, int64_t nk, int64_t d, float* kt) {
  for (int64_t j = j0; j < nk; ++j) {
    const T* k = static_cast<const T*>(rows[j]);
    for (int64_t i = 0; i < d; ++i) kt[i * kChunk + j] = to_float(k[i]);
  }
}

#if defined(__AVX512F__)
template <int S, std::size_t... E>
inline void exchange_round(vf16* r, std::index_sequence<E...>) {
  for (int i = 0; i < kLanes; ++i) {
    if (i & S) continue;
    const vf16 a = r[i], b = r[i + S];
    r[i] = __builtin_shufflevector(a, b, ((E & S) ? 16 + E - S : E)...);
    r[i + S] = __builtin_shufflevector(a, b, ((E & S) ? 16 + E : E + S)...);
  }
}

inline void transpose16(vf16* r) {
  constexpr auto lanes = std::make_index_sequence<kLanes>{};
  exchange_round<8>(r, lanes);
  exchange_round<4>(r, lanes);
  exchange_round<2>(r, lanes);
  exchange_round<1>(r, lanes);
}
#endif

template <typename T>
inline void transpose_keys(const void* const* rows, int64_t nk, int64_t d, float* kt) {
  int64_t j0 = 0;
#if defined(__AVX512F__)
  for (; j0 + kLanes <= nk; j0 += kLanes)  // d is a multiple of 16
    for (int64_t i0 = 0; i0 < d; i0 += kLanes) {
      vf16 r[kLanes];
      for (int j = 0; j < kLanes; ++j) r[j] = load16(static_cast<const T*>(rows[j0 + j]) + i0);
      transpose16(r);
      for (int i = 0; i < kLanes; ++i) std::memcpy(kt + (i0 + i) * kChunk + j0, &r[i], sizeof(vf16));
    }
#endif
  transpose_keys_scalar<T>(rows, j0, nk, d, kt);
}

struct BlockScratch {
  std::vector<float> qt, kt, vf, scores, o, m, l;
  std::vector<const float*> vr;  // each key's value row of the chunk (in the cache, or in vf)
  std::vector<const void*> kr;   // each key's key row of the chunk (in the cache)
};

// One row's softmax step over a chunk's scores p[0, nk) (log2 units), of which the first `valid`
// are its keys: m' = max(m, max p) (the first chunk: max p), p <- 2^(p - m') for the valid keys and 0
// for the rest, l <- l * 2^(m - m') + sum p (register lanes, then a fixed fold), o <- o * 2^(m - m').
inline void softmax_row(float* p, int64_t valid, int64_t nk, bool first, float& m, float& l, float* o,
                        int64_t d) {
  constexpr int64_t W = kExpLanes;
  vexp lane{};
  for (int64_t l = 0; l < W; ++l) lane[l] = static_cast<float>(l);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  vexp mv = vexp{} + neg_inf;
  int64_t j = 0;
  for (; j + W <= valid; j += W) {
    vexp v;
    std::memcpy(&v, p + j, sizeof v);
    mv = v > mv ? v : mv;
  }
  if (j < valid) {  // p has room for whole registers up to nk rounded up (a multiple of 32)
    vexp v;
    std::memcpy(&v, p + j, sizeof v);
    v = lane < static_cast<float>(valid - j) ? v : vexp{} + neg_inf;
    mv = v > mv ? v : mv;
  }
  const float mc = max_lanes(mv);
  const float m_new = first || mc > m ? mc : m;
  vexp acc{};
  for (j = 0; j < nk; j += W) {
    vexp v;
    std::memcpy(&v, p + j, sizeof v);
    v = exp2_nonpositive(v - m_new);
    if (j + W > valid) v = lane < static_cast<float>(valid - j) ? v : vexp{};
    acc += v;
    std::memcpy(p + j, &v, sizeof v);
  }
  const float chunk_sum = fold_lanes(acc);
  if (first) {
    l = chunk_sum;
  } else if (m_new == m) {  // a = 2^0 = 1 exactly: l * 1 + sum and o * 1 are these bits
    l = l + chunk_sum;
  } else {
    const float a = exp2_nonpositive(m - m_new);
    l = l * a + chunk_sum;
    for (int64_t i = 0; i < d; ++i) o[i] *= a;
  }
  m = m_new;
}

template <typename T>
void block_task(const BlockTask& tk, const float* q, const T* kc, const T* vc, const int64_t* table,
                int64_t ctx, int64_t n, bool causal, int64_t q_start, const Layout& ly, int64_t q_heads,
                float scale, float* out, BlockScratch& s) {
  const int64_t d = ly.head_dim, kvh = tk.head / ly.group, row_stride = ly.kv_heads * d, bs = ly.block_size;
  const int64_t rows = tk.r1 - tk.r0, padded = (rows + kRowGroup - 1) / kRowGroup * kRowGroup;
  s.qt.assign(padded * d, 0.0f);
  s.o.assign(padded * d, 0.0f);
  s.kt.resize(d * kChunk);
  s.vf.resize(kChunk * d);
  s.vr.resize(kChunk);
  s.kr.resize(kChunk);
  s.scores.resize(padded * kChunk);
  s.m.assign(padded, 0.0f);
  s.l.assign(padded, 0.0f);
  std::vector<int64_t> lim(padded, 0);
  const float qscale = scale * 1.44269504088896341f;  // scores in log2 units: softmax by 2^x
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + ((q_start + tk.r0 + r) * q_heads + tk.head) * d;
    for (int64_t i = 0; i < d; ++i) s.qt[r * d + i] = src[i] * qscale;
    lim[r] = causal ? ctx - n + 1 + tk.r0 + r : ctx;
  }
  const int64_t keys = causal ? ctx - n + tk.r1 : ctx;  // the most any row of the tile sees
  // key t's row: table[t / bs] * bs + t % bs; walked block by block (no division per key), the
  // prefetch cursor kBlockPrefetchKeys keys ahead of the read cursor
  int64_t blk = 0, off = 0, pblk = kBlockPrefetchKeys / bs, poff = kBlockPrefetchKeys % bs;
  for (int64_t c0 = 0; c0 < keys; c0 += kChunk) {
    const int64_t nk = std::min(kChunk, keys - c0);
    // this chunk's keys transposed ([d][kChunk]) and values ([kChunk][d]) as floats; the scores of
    // the columns past nk (left over from an earlier chunk) are never read
    for (int64_t j = 0; j < nk; ++j) {
      if (c0 + j + kBlockPrefetchKeys < keys) {  // across chunk ends too
        const int64_t ahead = (table[pblk] * bs + poff) * row_stride + kvh * d;
        prefetch(kc + ahead, d);
        prefetch(vc + ahead, d);
        if (++poff == bs) poff = 0, ++pblk;
      }
      const int64_t slot = (table[blk] * bs + off) * row_stride + kvh * d;
      if (++off == bs) off = 0, ++blk;
      s.kr[j] = kc + slot;
      const T* v = vc + slot;
      if constexpr (std::is_same_v<T, float>) {
        s.vr[j] = v;  // float32 values are read in place
      } else {
        for (int64_t i = 0; i < d; ++i) s.vf[j * d + i] = to_float(v[i]);
        s.vr[j] = s.vf.data() + j * d;
      }
    }
    transpose_keys<T>(s.kr.data(), nk, d, s.kt.data());
    for (int64_t g = 0; g < padded; g += kRowGroup) {
      if (kPartialGroups && rows - g < kRowGroup)
        products_rows(rows - g, s.qt.data() + g * d, s.kt.data(), nullptr, nullptr, d, nk,
                      s.scores.data() + g * kChunk, nullptr);
      else
        score_group(s.qt.data() + g * d, d, s.kt.data(), nk, s.scores.data() + g * kChunk);
    }
    for (int64_t r = 0; r < padded; ++r) {
      float* p = s.scores.data() + r * kChunk;
      const int64_t valid = r < rows ? std::min(nk, lim[r] - c0) : 0;
      if (valid <= 0) {
        std::fill(p, p + kChunk, 0.0f);
        continue;
      }
      softmax_row(p, valid, nk, c0 == 0, s.m[r], s.l[r], s.o.data() + r * d, d);
    }
    for (int64_t g = 0; g < padded; g += kRowGroup) {
      const float* p = s.scores.data() + g * kChunk;
      float* o = s.o.data() + g * d;
      if (kPartialGroups && rows - g < kRowGroup) {
        products_rows(rows - g, nullptr, nullptr, p, s.vr.data(), d, nk, nullptr, o);
        continue;
      }
      int64_t c = 0;
      for (; c + 2 * kLanes <= d; c += 2 * kLanes) value_group<2>(p, s.vr.data(), d, nk, c, o);
      if (c < d) value_group<1>(p, s.vr.data(), d, nk, c, o);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / s.l[r];
    float* dst = out + ((q_start + tk.r0 + r) * q_heads + tk.head) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = s.o[r * d + i] * inv;
  }
}

}  // namespace

// Attention of multi-token sequences over the paged cache, written into `out` (float32, q's shape):
// sequence i's queries are q[q_start[i], q_start[i] + q_len[i]) (float32 [T, Hq, D], contiguous,
// not yet scaled), its keys its first ctx[i] cached keys (ctx[i] >= q_len[i] >= 1) through row i of
// `tables`; causal[i] != 0: query j sees keys [0, ctx - q_len + 1 + j), else all ctx. head_dim must
// be a multiple of 16. Rows of `out` outside the sequences are left as they are.
void paged_block_(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor tables, torch::Tensor ctx, torch::Tensor q_start, torch::Tensor q_len,
                  torch::Tensor causal, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "queries must be contiguous float32 [tokens, q_heads, head_dim]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat32 && out.is_contiguous(),
              "out must be contiguous float32 of the queries' shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == v_cache.dtype() &&
                  (k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim], float32 or bfloat16");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0 && q.size(2) % kLanes == 0,
              "head_dim (a multiple of 16) / head counts of queries and cache disagree");
  const int64_t seqs = ctx.numel();
  for (const auto* t : {&ctx, &q_start, &q_len, &causal})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == seqs,
                "ctx, q_start, q_len and causal must be int64 [sequences]");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == seqs && tables.is_contiguous() &&
                  tables.scalar_type() == torch::kInt64,
              "tables must be int64 [sequences, width]");
  const Layout ly{k_cache.size(1), k_cache.size(2), k_cache.size(3), q.size(1) / k_cache.size(2),
                  tables.size(1)};
  const int64_t q_heads = q.size(1), capacity_blocks = k_cache.size(0);
  const int64_t *cp = ctx.data_ptr<int64_t>(), *sp = q_start.data_ptr<int64_t>(),
                *lp = q_len.data_ptr<int64_t>(), *fp = causal.data_ptr<int64_t>(),
                *tp = tables.data_ptr<int64_t>();
  std::vector<BlockTask> tasks;
  int64_t work = 0;  // query rows x keys x q_heads x head_dim x 2, over the sequences
  for (int64_t i = 0; i < seqs; ++i) {
    work += 2 * lp[i] * cp[i] * q_heads * ly.head_dim;
    TORCH_CHECK(lp[i] >= 1 && cp[i] >= lp[i] && sp[i] >= 0 && sp[i] + lp[i] <= q.size(0),
                "sequence ", i, ": bad q_start / q_len / ctx");
    const int64_t needed = (cp[i] + ly.block_size - 1) / ly.block_size;
    TORCH_CHECK(needed <= ly.table_width, "sequence ", i, ": block table too short");
    for (int64_t b = 0; b < needed; ++b)
      TORCH_CHECK(tp[i * ly.table_width + b] >= 0 && tp[i * ly.table_width + b] < capacity_blocks,
                  "sequence ", i, ": block id outside the cache");
    const int64_t tiles = (lp[i] + kTileRows - 1) / kTileRows, per_tile = (lp[i] + tiles - 1) / tiles;
    for (int64_t h = 0; h < q_heads; ++h)
      for (int64_t r0 = 0; r0 < lp[i]; r0 += per_tile)
        tasks.push_back({i, h, r0, std::min(lp[i], r0 + per_tile)});
  }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  auto run = [&](auto* kc, auto* vc) {
    mstar_cpu::parallel_tasks(static_cast<int64_t>(tasks.size()), work, [&](int64_t t) {
      thread_local BlockScratch scratch;
      const BlockTask& tk = tasks[t];
      block_task(tk, qp, kc, vc, tp + tk.seq * ly.table_width, cp[tk.seq], lp[tk.seq], fp[tk.seq] != 0,
                 sp[tk.seq], ly, q_heads, sc, op, scratch);
    });
  };
  if (k_cache.scalar_type() == torch::kFloat32)
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else
    run(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
}
