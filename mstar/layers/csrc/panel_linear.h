// The panel linear's internals: packing layout, register tiles, epilogues and the task loop
// (`run`), shared by `linear.cpp` and model-specific kernels that multiply packed weights inline
// (a sparse MoE block's experts).
//
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
#pragma once

#include <torch/types.h>

#include "parallel.h"
#include "vec.h"
#include "vec_math.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace mstar_cpu {

constexpr int64_t kPanel = 64;
constexpr int64_t kRows = 6;         // rows per register tile (6 x 64 columns = 24 accumulators)
constexpr int64_t kRowChunk = 60;    // rows per task: tasks are (panels, row chunk)
constexpr int64_t kPanelRun = 8;     // at most this many consecutive panels per task

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
//
// The loop works on a local copy of the accumulators. `acc` belongs to the caller, whose store
// epilogue takes its address; the input rows are floats, which may alias a float vector's memory,
// so on `acc` itself GCC cannot prove the loads from x leave it unchanged and may keep some tiles'
// accumulators in memory, storing all of them at every k (it did for the 4-row tile of a 16-row batch
// in one build and not in another, depending only on what else the translation unit held). A copy
// whose address never escapes is promoted to registers whatever the surrounding code.
#if defined(__AVX512F__)
template <int R, typename TX, typename TW>
inline void accumulate(const TX* x, int64_t ldx, int64_t n, const TW* panel, vf16 (&acc)[R][4],
                       const Ahead& ahead) {
  vf16 a[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = acc[r][j];
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
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = scalar(x[r * ldx + k]);
      a[r][0] += xv * w0;
      a[r][1] += xv * w1;
      a[r][2] += xv * w2;
      a[r][3] += xv * w3;
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = a[r][j];
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
        // hardware prefetchers alone run too little ahead of a decode step's multiplies). Tasks
        // taking other panels run on other threads, so a task fetches only its own.
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
inline bool amx_granted() {
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

inline bool amx_usable(int64_t K) { return K % kTileK == 0 && amx_granted(); }
#else
template <typename TY>
void run_amx(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, TY*, const Epilogue<TY>&) {}
inline bool amx_usable(int64_t) { return false; }
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

}  // namespace mstar_cpu
