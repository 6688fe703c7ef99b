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
#include <torch/extension.h>

#include "parallel.h"

#include <algorithm>
#include <type_traits>
#include <cstdint>
#include <cstring>
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

template <typename T>
inline vf16 load16(const T* p) {  // p[0..16) as floats
  float f[kLanes];
  for (int l = 0; l < kLanes; ++l) f[l] = to_float(p[l]);
  vf16 v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

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

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * poly(r), r = x - n ln2, |r| <= ln2/2.
// Written with elementwise operations only, so the loop over keys vectorises; within ~2 ulp of expf.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
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
  for (int64_t t = 0; t < ctx; ++t) {
    if (t + kPrefetchKeys < ctx)
      prefetch(kc + slot_of(table, t + kPrefetchKeys, ly.block_size) * row_stride + g0 * d, span);
    const T* k = kc + slot_of(table, t, ly.block_size) * row_stride + g0 * d;
    for (int64_t h = 0; h < heads; ++h) scores[h * ctx + t] = dot(q + h * d, k + (h / ly.group) * d, d);
  }
  std::vector<float> inv(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * ctx;
    float m = s[0];
    for (int64_t t = 1; t < ctx; ++t) m = s[t] > m ? s[t] : m;
    for (int64_t t = 0; t < ctx; ++t) s[t] = exp_nonpositive(s[t] - m);
    inv[h] = 1.0f / sum(s, ctx);
  }
  std::memset(out, 0, sizeof(float) * heads * d);
  // out[h] += p[h][t] * v[t] for t ascending; four keys per pass over `out` (the same sums in the
  // same order as one key at a time: ((o + p0 v0) + p1 v1) + ...)
  int64_t t = 0;
  for (; t + 4 <= ctx; t += 4) {
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
      for (int64_t i = 0; i < d; ++i)
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
  // every task runs whole on one thread, whichever thread that is
  mstar_cpu::parallel_tasks(rows * parts, [&](int64_t task) {
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

// One decode step of a batch whose rows are all single-token causal appends: the new k / v rows
// are stored at `slots` (int64 [T], all >= 0), then every row attends over its cache as
// `paged_decode` (its queries scaled first). q, k, v: float32 or bfloat16 (one dtype; rows may be
// strided views of a packed projection's output). Returns [T, Hq, D] in q's dtype.
torch::Tensor decode_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor slots, torch::Tensor tables, torch::Tensor ctx,
                          double scale) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kBFloat16) && k.scalar_type() == dt &&
                  v.scalar_type() == dt,
              "q, k, v must share one dtype, float32 or bfloat16");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k_cache.dim() == 4 &&
                  k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k / v must be [tokens, kv_heads, head_dim] of the cache's heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dtype() == v_cache.dtype() &&
                  (k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim], float32 or bfloat16");
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == q.size(0) && slots.scalar_type() == torch::kInt64 &&
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
  const float s = static_cast<float>(scale);
  auto queries = dt == torch::kFloat32 ? scaled_queries<float>(q, s) : scaled_queries<c10::BFloat16>(q, s);
  auto out = paged_decode(queries, k_cache, v_cache, tables, ctx);
  return dt == torch::kFloat32 ? out : out.to(dt);
}
