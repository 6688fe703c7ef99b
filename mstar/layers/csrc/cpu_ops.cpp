// CPU kernels of the Llama-style blocks: linear layers over weights packed once into column panels
// (y[M, N] = x[M, K] @ W[K, N]), RMSNorm, and the rotary embedding applied in place.
//
// The weight is stored as panels of kPanel (64) output columns, each panel [K][64] contiguous
// (zero-padded past N), so a panel streams from memory in one pass and stays in L2 while every
// row group of the batch uses it. Each output element is ONE accumulator updated by k ascending,
// acc = fma(x[r][k], w[k][c], acc), starting from zero: a row's result is the same bits whatever
// the other rows of the batch are, whatever row group or thread computes it and however many
// threads there are (for one build of this file). Weights may be float32 or bfloat16 (widened to
// float32 on load); inputs float32 or bfloat16; accumulation float32; the output has the input's
// dtype. With bfloat16 weights packed in pairs (`pack(..., pairs=true)`, a CPU with AVX512-BF16)
// the multiply-adds are the CPU's bf16 dot products (two k per instruction, half the traffic).
//
// Epilogues fused into the store: `silu_mul` (panels interleave 32 gate and 32 up columns; the
// output is silu(gate) * up, N/2 columns), `residual` (y += residual, element by element), `bias`,
// and `gelu` (float32: gelu(y + bias), vec_math.h).
#include <torch/extension.h>

#include "parallel.h"
#include "vec_math.h"

#include <immintrin.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kPanel = 64;
constexpr int64_t kVec = 16;
constexpr int64_t kRows = 6;         // rows per register tile (6 x 64 columns = 24 accumulators)
constexpr int64_t kRowChunk = 60;    // rows per task: tasks are (panels, row chunk)
constexpr int64_t kPanelRun = 8;     // at most this many consecutive panels per task

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

// SiLU g / (1 + e^-g) lane by lane, with e = e^-|g| from exp_nonpositive (vec_math.h, a few ulp): g / (1 + e)
// for g >= 0, g e / (1 + e) for g < 0 (e^-g would overflow there). A NaN stays NaN. Below g = -87 the
// result is a tiny g * 2^-126 instead of an underflowing one (and -inf gives -inf, not NaN).
inline vf16 silu_vec(vf16 g) {
  const vf16 e = mstar_vec::exp_nonpositive<vf16, vi16>(g < 0.0f ? g : -g);
  return (g < 0.0f ? g * e : g) / (1.0f + e);
}

// `linear_argmax`'s output: instead of storing a row, each task keeps, per (run of panels, row),
// the best value of its columns so far, its column (the first of equal values: panels and columns
// are visited in order and only a greater value replaces it) and its first NaN column; the runs
// are then reduced in column order, which is torch.argmax over the row as `linear` would store it.
struct ArgmaxSink {
  float* best;       // [runs, M], -inf at first
  int64_t* at;       // [runs, M], -1: no value above -inf yet
  int64_t* nan;      // [runs, M], INT64_MAX: no NaN
  int64_t M;
  int64_t run_len;   // panels per run
};

template <typename TY>
struct Epilogue {
  bool silu_mul;
  const TY* residual;  // [M, n_out] or null
  int64_t n_out;       // columns of the output
  const TY* bias = nullptr;  // [n_out] or null: added to the product as stored (then the residual, if any)
  bool gelu = false;         // float32 output only, no residual: gelu(product + bias) (vec_math.h)
  ArgmaxSink* argmax = nullptr;  // float32 output, no other epilogue: row maxima instead of a store
};

// Row `row` of a panel's products (64 columns from col0) into its run's running maximum. The
// panel's maximum is found with vector compares; only a panel holding a NaN, a new maximum or the
// output's last columns is scanned element by element.
inline void argmax_update(const vf16 (&acc)[4], int64_t col0, int64_t row, int64_t n_out, const ArgmaxSink& sink) {
  const int64_t slot = (col0 / kPanel) / sink.run_len * sink.M + row;
  float& best = sink.best[slot];
  const int64_t n = std::min<int64_t>(kPanel, n_out - col0);
  if (n == kPanel) {
    const vf16 m01 = acc[0] > acc[1] ? acc[0] : acc[1], m23 = acc[2] > acc[3] ? acc[2] : acc[3];
    const vf16 m = m01 > m23 ? m01 : m23;
    const vi16 odd = (acc[0] != acc[0]) | (acc[1] != acc[1]) | (acc[2] != acc[2]) | (acc[3] != acc[3]);
    float top = m[0];
    bool any_nan = odd[0] != 0;
    for (int l = 1; l < kVec; ++l) {
      top = m[l] > top ? m[l] : top;
      any_nan |= odd[l] != 0;
    }
    if (!any_nan && !(top > best)) return;
  }
  float out[kPanel];
  std::memcpy(out, acc, sizeof out);
  int64_t& at = sink.at[slot];
  int64_t& nan = sink.nan[slot];
  for (int64_t c = 0; c < n; ++c) {
    const float v = out[c];
    if (v != v) {
      if (col0 + c < nan) nan = col0 + c;
    } else if (v > best) {
      best = v;
      at = col0 + c;
    }
  }
}

inline void put(float v, float* y) { *y = v; }
inline void put(float v, c10::BFloat16* y) { *y = c10::BFloat16(v); }  // round to nearest even
// v as the output dtype holds it (bfloat16: rounded to nearest even, widened back)
inline float as_stored(float v, const float*) { return v; }
inline float as_stored(float v, const c10::BFloat16*) { return static_cast<float>(c10::BFloat16(v)); }

// Row r of a tile's accumulators (64 columns of panel output from col0) stored with the epilogue.
template <typename TY>
inline void store_row(const vf16 (&acc)[4], int64_t col0, TY* yr, const TY* res, const Epilogue<TY>& ep) {
  float out[kPanel];
  std::memcpy(out, acc, sizeof out);
  if constexpr (std::is_same_v<TY, float>) {
    if (ep.gelu) {  // (product + bias), then GELU, a register at a time; the columns past n_out are dropped
      const int64_t n = std::min<int64_t>(kPanel, ep.n_out - col0);
      float b[kPanel] = {0};
      if (ep.bias != nullptr) std::memcpy(b, ep.bias + col0, sizeof(float) * n);
      vf16 g[4];
      for (int v = 0; v < 4; ++v) {
        vf16 bv;
        std::memcpy(&bv, b + v * kVec, sizeof bv);
        g[v] = mstar_vec::gelu_erf<vf16, vi16>(acc[v] + bv);
      }
      std::memcpy(out, g, sizeof out);
      std::memcpy(yr + col0, out, sizeof(float) * n);
      return;
    }
  }
  if (ep.silu_mul) {  // columns [0, 32) are gate, [32, 64) up, of output columns col0/2 + [0, 32)
    const int64_t c0 = col0 / 2, n = std::min<int64_t>(kPanel / 2, ep.n_out - c0);
    const vf16 act[2] = {silu_vec(acc[0]) * acc[2], silu_vec(acc[1]) * acc[3]};
    std::memcpy(out, act, sizeof act);
    for (int64_t c = 0; c < n; ++c) put(out[c], yr + c0 + c);
  } else {
    const int64_t n = std::min<int64_t>(kPanel, ep.n_out - col0);
    if (res != nullptr && ep.bias != nullptr) {  // (product as stored + bias, stored) + residual
      for (int64_t c = 0; c < n; ++c)
        put(as_stored(as_stored(out[c], yr) + scalar(ep.bias[col0 + c]), yr) + scalar(res[col0 + c]), yr + col0 + c);
    } else if (res != nullptr) {
      for (int64_t c = 0; c < n; ++c) put(out[c] + scalar(res[col0 + c]), yr + col0 + c);
    } else if (ep.bias != nullptr) {  // the product as stored, plus the bias: y.add_(bias) after the store
      for (int64_t c = 0; c < n; ++c) put(as_stored(out[c], yr) + scalar(ep.bias[col0 + c]), yr + col0 + c);
    } else {
      for (int64_t c = 0; c < n; ++c) put(out[c], yr + col0 + c);
    }
  }
}

// Four cache lines (one float32 panel row, or one bf16 pair row) into L2, for a later block.
inline void prefetch_row(const char* p) {
  for (int b = 0; b < 256; b += 64) __builtin_prefetch(p + b, 0, 2);
}

// Which rows of the next block a tile fetches: row k at its iteration k, for k = phase, phase + every,
// ... (the block's tiles share the rows, so the fetches spread over the whole block).
struct Ahead {
  const char* rows = nullptr;  // the next block's first row, or null
  int64_t phase = 0, every = 1;
};

// Rows [0, R) of x times one panel [K][64]: one float32 multiply-add per (row, column, k), k
// ascending. R is a template argument so the accumulators live in registers; every row's
// arithmetic is the same for any R.
#if defined(__AVX512F__)
template <int R, typename TX, typename TW>
inline void accumulate(const TX* x, int64_t ldx, int64_t n, const TW* panel, vf16 (&acc)[R][4],
                       const Ahead& ahead) {
  int64_t fetch = ahead.rows != nullptr ? ahead.phase : n;
  for (int64_t k = 0; k < n; ++k) {
    const TW* w = panel + k * kPanel;
    if (k == fetch) {
      prefetch_row(ahead.rows + k * kPanel * static_cast<int64_t>(sizeof(TW)));
      fetch += ahead.every;
    }
    vf16 w0 = load(w), w1 = load(w + kVec), w2 = load(w + 2 * kVec), w3 = load(w + 3 * kVec);
    // keep the panel's row in registers: otherwise the compiler re-reads it from memory for every
    // row of the tile (one load per multiply-add), and loads, not multiply-adds, bound the loop
    asm("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
    for (int r = 0; r < R; ++r) {
      const float xv = scalar(x[r * ldx + k]);
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
      acc[r][2] += xv * w2;
      acc[r][3] += xv * w3;
    }
  }
}
#else
// Without AVX-512 a 16-float vector takes two of the 16 ymm registers, and a tile of R rows x 64
// columns (8R accumulators) does not fit: the panel is walked in column strips narrow enough that
// R rows' accumulators, the strip's weights and the broadcast input fit (R = 1: 64 columns, 2: 32,
// 3 and more: 16, 2R + 3 registers). Each output element still gets its products in k order.
constexpr int64_t kStreamFirstBytes = 512 << 10;  // panels up to this size are streamed by one row first
constexpr int64_t kStripPrefetchRows = 16;  // panel rows prefetched ahead of the first strip
template <int R>
constexpr int kStripVecs = R == 1 ? 8 : R == 2 ? 4 : 2;  // 8-float vectors per row per strip

template <int R, typename TX, typename TW>
inline void accumulate(const TX* x, int64_t ldx, int64_t K, const TW* panel, vf16 (&acc)[R][4], const Ahead&) {
  constexpr int NV = kStripVecs<R>;
  float out[R][kPanel];
  for (int r = 0; r < R; ++r) std::memcpy(out[r], acc[r], sizeof out[r]);
  for (int s = 0; s < kPanel / (8 * NV); ++s) {
    vf8 a[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) std::memcpy(&a[r][v], &out[r][s * 8 * NV + 8 * v], sizeof(vf8));
    for (int64_t k = 0; k < K; ++k) {
      const TW* w = panel + k * kPanel + s * 8 * NV;
      if (NV < 8 && s == 0 && k + kStripPrefetchRows < K) {  // the first strip fetches the panel from memory for the rest: whole
        // rows ahead, since the strip itself touches only every other or every fourth cache line
        const char* ahead = reinterpret_cast<const char*>(panel + (k + kStripPrefetchRows) * kPanel);
        for (int64_t b = 0; b < static_cast<int64_t>(kPanel * sizeof(TW)); b += 64) __builtin_prefetch(ahead + b);
      }
      vf8 wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = load8(w + 8 * v);
      for (int r = 0; r < R; ++r) {
        const float xv = scalar(x[r * ldx + k]);
        for (int v = 0; v < NV; ++v) a[r][v] += xv * wv[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) std::memcpy(&out[r][s * 8 * NV + 8 * v], &a[r][v], sizeof(vf8));
  }
  for (int r = 0; r < R; ++r) std::memcpy(acc[r], out[r], sizeof out[r]);
}
#endif

#if defined(__AVX512BF16__)
constexpr bool kDotPairs = true;
// bfloat16 x and a pair-packed panel [K/2][64][2]: per (row, column), acc += x[2i] w[2i] +
// x[2i+1] w[2i+1] for i ascending (the CPU's bf16 dot-product instruction, vdpbf16ps).
template <int R>
inline void accumulate_pairs(const c10::BFloat16* x, int64_t ldx, int64_t n, const c10::BFloat16* panel,
                             vf16 (&acc)[R][4], const Ahead& ahead) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) std::memcpy(&a[r][j], &acc[r][j], sizeof(vf16));
  int64_t fetch = ahead.rows != nullptr ? ahead.phase : n;
  for (int64_t i = 0; i < n / 2; ++i) {
    const c10::BFloat16* w = panel + i * 2 * kPanel;
    if (i == fetch) {
      prefetch_row(ahead.rows + i * 2 * kPanel * static_cast<int64_t>(sizeof(c10::BFloat16)));
      fetch += ahead.every;
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * i, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      a[r][0] = _mm512_dpbf16_ps(a[r][0], xv, w0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], xv, w1);
      a[r][2] = _mm512_dpbf16_ps(a[r][2], xv, w2);
      a[r][3] = _mm512_dpbf16_ps(a[r][3], xv, w3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) std::memcpy(&acc[r][j], &a[r][j], sizeof(vf16));
}
#else
constexpr bool kDotPairs = false;
#endif

// The panel's input rows are taken kBlockK at a time: every row tile of a task runs over one block
// before the next block, so a block read from memory by the first tile is still in L1 for the others
// (16 KiB of float32 rows), and the memory stream continues while those tiles compute. A tile's
// accumulators wait between blocks in a buffer as float32 values, so each output element is still
// one accumulator updated in k order: the same bits as one pass, for any block size. Without
// AVX-512 the strips already keep the panel in L2, and one block covers the whole panel.
#if defined(__AVX512F__)
constexpr int64_t kBlockK = 64;
#else
constexpr int64_t kBlockK = INT64_MAX;
#endif

// One tile: rows [r0, r0 + R) of x over the panel's input rows [k0, k1); the accumulators come from
// `keep` (zeros at k0 = 0) and go back there, or through the epilogue into y after the last block.
template <bool Pairs, typename TX, typename TW, typename TY>
struct Tile {
  const TX* x;
  int64_t K;
  const Epilogue<TY>& ep;

  template <int R>
  void rows(int64_t r0, int64_t k0, int64_t k1, const TW* panel, int64_t col0, TY* y,
            float (*keep)[kPanel], const Ahead& ahead = Ahead{}) const {
    vf16 acc[R][4];
    for (int r = 0; r < R; ++r) {
      if (k0 == 0) {
        for (int j = 0; j < 4; ++j) acc[r][j] = vf16{};
      } else {
        std::memcpy(acc[r], keep[r], sizeof acc[r]);
      }
    }
    const TX* xr = x + r0 * K + k0;
    const TW* block = panel + k0 * kPanel;  // pair-packed panels: pair row k0 / 2, the same offset
#if defined(__AVX512BF16__)
    if constexpr (Pairs) {
      accumulate_pairs<R>(xr, K, k1 - k0, block, acc, ahead);
    } else {
      accumulate<R>(xr, K, k1 - k0, block, acc, ahead);
    }
#else
    accumulate<R>(xr, K, k1 - k0, block, acc, ahead);
#endif
    if (k1 < K) {
      for (int r = 0; r < R; ++r) std::memcpy(keep[r], acc[r], sizeof acc[r]);
      return;
    }
    if (ep.argmax != nullptr) {
      for (int r = 0; r < R; ++r) argmax_update(acc[r], col0, r0 + r, ep.n_out, *ep.argmax);
      return;
    }
    for (int r = 0; r < R; ++r) {
      const TY* res = ep.residual ? ep.residual + (r0 + r) * ep.n_out : nullptr;
      store_row(acc[r], col0, y + (r0 + r) * ep.n_out, res, ep);
    }
  }
};

// Consecutive panels a task takes (the same for `linear` and `linear_argmax`'s per-run maxima).
inline int64_t panel_run_len(int64_t panels) {
  const int64_t threads = std::max(1, at::get_num_threads());
  return std::clamp<int64_t>(panels / (8 * threads), 1, kPanelRun);
}

template <bool Pairs, typename TX, typename TW, typename TY>
void run(const TX* x, int64_t M, int64_t K, const TW* packed, int64_t panels, TY* y,
         const Epilogue<TY>& ep) {
  // rows split evenly into chunks of at most kRowChunk (a multiple of the tile height)
  const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
  const int64_t per_chunk = ((M + chunks - 1) / chunks + kRows - 1) / kRows * kRows;
  const Tile<Pairs, TX, TW, TY> tile{x, K, ep};
  // a task is (a run of consecutive panels, one row chunk): many panels (a vocabulary head) go in runs
  // of up to kPanelRun, which lie end to end in memory, so the last block of one panel fetches the
  // first of the next; which thread runs a task does not change its bits
  const int64_t run_len = ep.argmax != nullptr ? ep.argmax->run_len : panel_run_len(panels);
  const int64_t runs = (panels + run_len - 1) / run_len;
  mstar_cpu::parallel_tasks(runs * chunks, M * K * panels * kPanel, [&](int64_t task) {
    const int64_t first = (task / chunks) * run_len, last = std::min(panels, first + run_len);
    const int64_t chunk = task % chunks;
    const int64_t row_start = chunk * per_chunk, row_end = std::min(M, row_start + per_chunk);
    const TW* end = packed + last * K * kPanel;  // past the task's panels
    alignas(64) float keep[kRowChunk][kPanel];  // the tiles' accumulators between blocks
    for (int64_t p = first; p < last; ++p) {
      const TW* panel = packed + p * K * kPanel;
      const int64_t col0 = p * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += std::min(kBlockK, K - k0)) {
        const int64_t k1 = k0 + std::min(kBlockK, K - k0);
        int64_t r = row_start;
#if !defined(__AVX512F__)
        // the strips of a multi-row tile read every other or every fourth cache line of the panel,
        // which memory serves slowly: one row alone first streams the whole panel in order (into L2)
        // for the rest
        if (row_end - r > 1 && K * kPanel * static_cast<int64_t>(sizeof(TW)) <= kStreamFirstBytes) {
          tile.template rows<1>(r, k0, k1, panel, col0, y, keep + (r - row_start));
          ++r;
        }
#endif
        // the block's tiles fetch as many rows again (the next block, of this panel or the run's next)
        // into L2 while they compute, each a share of the rows spread over its iterations (the
        // hardware prefetchers alone run too little ahead: 11.4 -> 8.8 ms for a 16-row decode step's
        // multiplies on a 2-core AVX-512 Xeon). Tasks taking other panels run on other threads, so a
        // task fetches only its own.
        Ahead ahead;
        const TW* next = panel + k1 * kPanel;
        if (kBlockK < K && next + (k1 - k0) * kPanel <= end) {
          ahead.rows = reinterpret_cast<const char*>(next);
          ahead.every = (row_end - r + kRows - 1) / kRows;
        }
        for (; r + kRows <= row_end; r += kRows, ++ahead.phase)
          tile.template rows<kRows>(r, k0, k1, panel, col0, y, keep + (r - row_start), ahead);
        float (*kr)[kPanel] = keep + (r - row_start);
        switch (row_end - r) {  // the last 1..5 rows as one tile
          case 0: break;
          case 1: tile.template rows<1>(r, k0, k1, panel, col0, y, kr, ahead); break;
          case 2: tile.template rows<2>(r, k0, k1, panel, col0, y, kr, ahead); break;
          case 3: tile.template rows<3>(r, k0, k1, panel, col0, y, kr, ahead); break;
          case 4: tile.template rows<4>(r, k0, k1, panel, col0, y, kr, ahead); break;
          default: tile.template rows<5>(r, k0, k1, panel, col0, y, kr, ahead); break;
        }
      }
    }
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Pair-packed bf16 panels through the CPU's tile unit (AMX): a panel's pair rows [K/2][64][2] are
// already the layout its bf16 tile multiply reads (B[k/2][n][2]), four tiles of 16 columns each.
// Rows go 16 at a time (the last group copied into a zero-padded buffer); each 32 inputs are one
// tile multiply-add into float32 accumulator tiles, in k order. An output row's value depends only
// on its own input row and the weights, so a row's bits are the same alone, in any batch and on any
// thread (the padding rows are computed and dropped). The unit flushes bf16 subnormals to zero and
// sums a tile's 32 products in its own order, so its results differ from the AVX512-BF16 path by
// rounding: on a machine with the unit every bf16 pair-packed linear takes it, whatever its size.
constexpr int64_t kTileK = 32;  // bf16 inputs per tile multiply
constexpr int64_t kAmxAhead = 2;  // steps of kTileK inputs the weight rows are fetched ahead

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The OS must grant a process the tile data state once (Linux 5.16 and later); false where it won't.
bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
  }();
  return granted;
}

template <typename TY>
void run_amx(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* packed, int64_t panels, TY* y,
             const Epilogue<TY>& ep) {
  const int64_t groups = (M + 15) / 16;
  // a task is (panel, up to 4 row groups): the panel stays in L2 for the task's later groups
  constexpr int64_t kGroupsPerTask = 4;
  const int64_t row_tasks = (groups + kGroupsPerTask - 1) / kGroupsPerTask;
  mstar_cpu::parallel_tasks(panels * row_tasks, M * K * panels * kPanel, [&](int64_t task) {
    const int64_t p = task / row_tasks, g0 = (task % row_tasks) * kGroupsPerTask;
    TileConfig cfg;
    for (int t = 0; t < 7; ++t) {  // tiles 0-3: accumulators; 4: inputs; 5, 6: weights
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    const c10::BFloat16* panel = packed + p * K * kPanel;
    alignas(64) float out[4][16][16];
    std::vector<c10::BFloat16> padded;
    for (int64_t g = g0; g < std::min(groups, g0 + kGroupsPerTask); ++g) {
      const int64_t r0 = g * 16, n = std::min<int64_t>(16, M - r0);
      const c10::BFloat16* a = x + r0 * K;
      if (n < 16) {  // the last rows, zero-padded to a whole tile
        padded.assign(16 * K, c10::BFloat16(0.0f));
        std::memcpy(padded.data(), a, sizeof(c10::BFloat16) * n * K);
        a = padded.data();
      }
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < K; k += kTileK) {
        const c10::BFloat16* b = panel + k * kPanel;  // pair row k / 2: 16 rows of 256 bytes
        if (g == g0 && k + kAmxAhead * kTileK < K) {  // the first group reads the panel from memory
          const char* ahead = reinterpret_cast<const char*>(b + kAmxAhead * kTileK * kPanel);
          for (int64_t line = 0; line < kTileK * kPanel * 2; line += 64) __builtin_prefetch(ahead + line, 0, 2);
        }
        _tile_loadd(4, a + k, K * sizeof(c10::BFloat16));
        _tile_loadd(5, b, 2 * kPanel * sizeof(c10::BFloat16));
        _tile_loadd(6, b + 32, 2 * kPanel * sizeof(c10::BFloat16));
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, b + 64, 2 * kPanel * sizeof(c10::BFloat16));
        _tile_loadd(6, b + 96, 2 * kPanel * sizeof(c10::BFloat16));
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, out[0], 64);
      _tile_stored(1, out[1], 64);
      _tile_stored(2, out[2], 64);
      _tile_stored(3, out[3], 64);
      for (int64_t r = 0; r < n; ++r) {
        vf16 acc[4];
        for (int j = 0; j < 4; ++j) std::memcpy(&acc[j], out[j][r], sizeof acc[j]);
        const TY* res = ep.residual ? ep.residual + (r0 + r) * ep.n_out : nullptr;
        store_row(acc, p * kPanel, y + (r0 + r) * ep.n_out, res, ep);
      }
    }
    _tile_release();
  });
}

bool amx_usable(int64_t K) { return K % kTileK == 0 && amx_granted(); }
#else
template <typename TY>
void run_amx(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, TY*, const Epilogue<TY>&) {}
bool amx_usable(int64_t) { return false; }
#endif

template <typename TX, typename TY>
void dispatch_weight(const TX* x, int64_t M, int64_t K, const torch::Tensor& packed, TY* y,
                     const Epilogue<TY>& ep) {
  const int64_t panels = packed.size(0);
  if (packed.scalar_type() == torch::kFloat32)
    run<false>(x, M, K, packed.data_ptr<float>(), panels, y, ep);
  else
    run<false>(x, M, K, packed.data_ptr<c10::BFloat16>(), panels, y, ep);
}

}  // namespace

// An empty CPU tensor on 2 MiB-aligned memory advised for transparent huge pages: the packed
// weights are streamed from memory at every step, and with 4 KiB pages the TLB misses cost ~10%
// at batch 1 (measured on a 2-core AVX-512 machine). Falls back to a plain allocation.
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

// A sparse MoE block's router over logits [T, E] (float32 or bfloat16): per token the softmax in float32
// (e^(l - max) by std::exp, summed in expert order, each divided by the sum), its k largest
// probabilities in descending order (a tie goes to the lower expert id), divided by their sum (summed
// largest first) when `normalize`; (weights [T, k] in the logits' dtype, expert ids [T, k] int64).
// One pass instead of torch.softmax, topk, sum, div and a cast; within a few float32 ulp of them (the
// same expert ids but for near ties), and a token's result does not depend on the other tokens.
template <typename T>
void route_rows(const T* lp, int64_t tokens, int64_t E, int64_t k, bool normalize, T* wp, int64_t* ip) {
  mstar_cpu::parallel_tasks((tokens + 63) / 64, tokens * E * 8, [&](int64_t task) {
    std::vector<float> p(E);
    std::vector<int64_t> order(E);
    for (int64_t t = task * 64; t < std::min(tokens, task * 64 + 64); ++t) {
      const T* l = lp + t * E;
      float m = -INFINITY;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, scalar(l[e]));
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(scalar(l[e]) - m));
      for (int64_t e = 0; e < E; ++e) {
        p[e] /= sum;
        order[e] = e;
      }
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
        return p[a] > p[b] || (p[a] == p[b] && a < b);
      });
      float top = 0.0f;
      for (int64_t j = 0; j < k; ++j) top += p[order[j]];
      for (int64_t j = 0; j < k; ++j) {
        put(normalize ? p[order[j]] / top : p[order[j]], wp + t * k + j);
        ip[t * k + j] = order[j];
      }
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor logits, int64_t k, bool normalize) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16),
              "moe_route: logits must be contiguous float32 or bfloat16 [tokens, experts]");
  const int64_t tokens = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "moe_route: k must be in [1, experts]");
  auto weights = torch::empty({tokens, k}, logits.options());
  auto ids = torch::empty({tokens, k}, logits.options().dtype(torch::kInt64));
  if (logits.scalar_type() == torch::kFloat32)
    route_rows(logits.data_ptr<float>(), tokens, E, k, normalize, weights.data_ptr<float>(), ids.data_ptr<int64_t>());
  else
    route_rows(logits.data_ptr<c10::BFloat16>(), tokens, E, k, normalize, weights.data_ptr<c10::BFloat16>(),
               ids.data_ptr<int64_t>());
  return {weights, ids};
}

// RMSNorm of each row of x [T, H] (float32 or bfloat16; weight of the same dtype), in float32:
// weight * (x * rsqrt(mean(x^2) + eps)), the result in x's dtype (bfloat16: the normalised row is
// rounded, then multiplied by the weight and rounded again, as the reference's bf16 module does).
// The sum of squares is 16 lane-wise partial sums folded in a fixed tree (the same order for every
// row).
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

// The index of each row's maximum (the first one on ties; the first NaN if there is one, as
// torch.argmax), x [B, V] float32 or bfloat16 contiguous, V >= 1; rows in parallel. One pass: each
// lane keeps its maximum and the first index holding it (a strictly greater value replaces both),
// then the smallest index among the lanes holding the row's maximum is the first one. A row with a
// NaN is scanned again for its first NaN.
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
  // per row of 152 steps spent more on handing out the task than on the row (1.4 vs 0.3 ns a step)
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

// csrc/paged_decode.cpp (compiled into this extension)
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
  m.def("tile_unit_available", &amx_usable, "pair-packed linears with this input size run on the tile unit (AMX)",
        py::arg("in_features"));
  m.def("linear", &linear, "x @ W over a packed weight, with optional fused epilogues", py::arg("x"),
        py::arg("packed"), py::arg("n_out"), py::arg("silu_mul"), py::arg("residual"), py::arg("bias") = py::none(),
        py::arg("gelu") = false);
  m.def("linear_argmax", &linear_argmax, "argmax over the columns of x @ W (packed float32), row by row, without storing the product",
        py::arg("x"), py::arg("packed"), py::arg("n_out"));
  m.def("moe_route", &moe_route, "a sparse MoE router: softmax, top-k (normalised) over [tokens, experts] logits",
        py::arg("logits"), py::arg("k"), py::arg("normalize"));
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
