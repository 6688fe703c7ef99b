// Linears over weights kept in llama.cpp's block-quantized formats (Q8_0, Q4_0, Q4_1), multiplied
// as stored: y[M, N] = x[M, K] @ W[K, N] with W never widened to float32 in memory.
//
// Formats (32 weights of one output column per block, along K): Q8_0 w = d q, q in [-127, 127];
// Q4_0 w = d (q - 8), q in [0, 15]; Q4_1 w = d q + m, q in [0, 15]; d and m float16.
//
// Packed layout (`mstar.layers.quant.pack_quantized` builds it): panels of 64 output columns,
// each panel's blocks contiguous, block b of panel p at packed[p][b]:
//   Q8_0: [8 quads][64 columns][4] unsigned bytes q + 128 (2048), then d[64] float16
//   Q4_x: [4 quad pairs][64 columns][4] bytes, the low nibble of byte t quad 2j's k = 8j + t, the
//         high nibble quad 2j + 1's k = 8j + 4 + t (1024), then d[64] float16 (Q4_1: then m[64])
// so one 64-byte load holds 16 columns x 4 inputs, the operand layout of the CPU's u8 x s8 dot
// product (AVX512-VNNI vpdpbusd): the same bytes per weight as the file.
//
// The input is quantized per row and block of 32 as llama.cpp does (dx = max|x| / 127,
// xq = round-to-nearest-even(x / dx)), then per (row, column, block) the integer dot product
// s = sum q_w xq is exact, whatever instructions compute it, and a column's float32 accumulator
// takes the blocks in order:
//   Q8_0: acc += (d dx) (s - 128 sum xq)      Q4_0: acc += (d dx) (s - 8 sum xq)
//   Q4_1: acc += (d dx) s, then acc += m (dx sum xq)
// So each output depends only on its own row and the weights: the same bits in any batch, on any
// thread, with or without VNNI (for one build). The epilogues (silu_mul, residual, bias) are the
// panel linear's (panel_linear.h); silu_mul panels hold 32 gate then 32 up columns.
#include <torch/types.h>

#include "panel_linear.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

using namespace mstar_cpu;

torch::Tensor huge_page_empty(at::IntArrayRef sizes, const torch::TensorOptions& options);  // linear.cpp

namespace {

constexpr int64_t kQAhead = 4;  // blocks of a panel fetched ahead of the first tile's multiplies

constexpr int64_t kQBlock = 32;  // weights per block, along the input
constexpr int64_t kQRows = 4;    // rows per tile: 4 x 4 integer accumulators, plus the weights' registers

enum QuantKind : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

constexpr int64_t weight_bytes(int64_t kind) { return kind == kQ8_0 ? 32 * kPanel : 16 * kPanel; }
constexpr int64_t block_bytes(int64_t kind) { return weight_bytes(kind) + (kind == kQ4_1 ? 4 : 2) * kPanel; }

// The input rows quantized per block: values, scale and sum of the values.
struct QuantRows {
  const int8_t* q;      // [M, K]
  const float* d;       // [M, K / 32]
  const int32_t* sum;   // [M, K / 32]
  int64_t K, nb;
};

template <typename TX>
void quantize_rows(const TX* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* sum) {
  const int64_t nb = K / kQBlock;
  parallel_tasks(M, M * K * 4, [&](int64_t r) {
    for (int64_t b = 0; b < nb; ++b) {
      const TX* xb = x + r * K + b * kQBlock;
      int8_t* qb = q + r * K + b * kQBlock;
      float v[kQBlock];
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < kQBlock; ++i) {
        v[i] = scalar(xb[i]);
        finite &= std::isfinite(v[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      if (!finite) {  // the block's products are NaN, as a float32 multiply would make them (or inf)
        std::memset(qb, 0, kQBlock);
        d[r * nb + b] = std::numeric_limits<float>::quiet_NaN();
        sum[r * nb + b] = 0;
        continue;
      }
      const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
      int32_t s = 0;
      for (int64_t i = 0; i < kQBlock; ++i) {
        const int32_t qi = std::clamp(static_cast<int32_t>(std::nearbyint(v[i] * inv)), -127, 127);
        qb[i] = static_cast<int8_t>(qi);
        s += qi;
      }
      d[r * nb + b] = scale;
      sum[r * nb + b] = s;
    }
  });
}

// 16 float16 -> float32
inline vf16 load_half(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  vf16 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  uint16_t h[kVec];
  std::memcpy(h, p, sizeof h);
  vf16 out;
  for (int i = 0; i < kVec; ++i) out[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
  return out;
#endif
}

// One block's integer dot products: rows [0, R) of xq (block start, row stride ldx) against the
// block's 64 columns -> s[R][4] (16 columns each).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int R, int64_t Kind>
inline void dot_block(const uint8_t* w, const int8_t* x, int64_t ldx, vi16 (&s)[R][4]) {
  __m512i a[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) a[r][v] = _mm512_setzero_si512();
  if constexpr (Kind == kQ8_0) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i wv[4];
      for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(w + j * 256 + v * 64);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, x + r * ldx + 4 * j, sizeof quad);
        const __m512i xb = _mm512_set1_epi32(quad);
        for (int v = 0; v < 4; ++v) a[r][v] = _mm512_dpbusd_epi32(a[r][v], wv[v], xb);
      }
    }
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i lo[4], hi[4];
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_loadu_si512(w + j * 256 + v * 64);
        lo[v] = _mm512_and_si512(raw, low);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        int32_t qa, qb;
        std::memcpy(&qa, x + r * ldx + 8 * j, sizeof qa);
        std::memcpy(&qb, x + r * ldx + 8 * j + 4, sizeof qb);
        const __m512i xa = _mm512_set1_epi32(qa), xb = _mm512_set1_epi32(qb);
        for (int v = 0; v < 4; ++v) {
          a[r][v] = _mm512_dpbusd_epi32(a[r][v], lo[v], xa);
          a[r][v] = _mm512_dpbusd_epi32(a[r][v], hi[v], xb);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) std::memcpy(&s[r][v], &a[r][v], sizeof(vi16));
}
constexpr bool kIntegerDots = true;
#else
// Without VNNI: the same integer sums, in plain loops the compiler vectorizes.
template <int R, int64_t Kind>
inline void dot_block(const uint8_t* w, const int8_t* x, int64_t ldx, vi16 (&s)[R][4]) {
  int32_t acc[R][kPanel] = {};
  for (int j = 0; j < (Kind == kQ8_0 ? 8 : 4); ++j) {
    const uint8_t* wj = w + j * 256;
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = x + r * ldx + (Kind == kQ8_0 ? 4 * j : 8 * j);
      for (int c = 0; c < kPanel; ++c) {
        const uint8_t* wc = wj + c * 4;
        int32_t t = 0;
        for (int i = 0; i < 4; ++i) {
          if constexpr (Kind == kQ8_0) {
            t += int32_t(wc[i]) * xr[i];
          } else {
            t += int32_t(wc[i] & 0x0F) * xr[i] + int32_t(wc[i] >> 4) * xr[4 + i];
          }
        }
        acc[r][c] += t;
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(s[r], acc[r], sizeof acc[r]);
}
constexpr bool kIntegerDots = false;
#endif

// Rows [r0, r0 + R) against one panel (all its blocks), stored through the epilogue.
// `fetch_to`: the first tile of a task's panel fetches the panel's blocks kQAhead ahead, up to there
// (the panel's end, or the run's next panel's first blocks); later tiles find them in L2.
template <int R, int64_t Kind, typename TY>
void quant_tile(const QuantRows& xq, int64_t r0, const uint8_t* panel, int64_t col0, TY* y, const Epilogue<TY>& ep,
                const uint8_t* fetch_to = nullptr) {
  vf16 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = vf16{};
  for (int64_t b = 0; b < xq.nb; ++b) {
    const uint8_t* w = panel + b * block_bytes(Kind);
    if (fetch_to != nullptr) {
      const uint8_t* ahead = w + kQAhead * block_bytes(Kind);
      for (int64_t line = 0; line < block_bytes(Kind) && ahead + line < fetch_to; line += 64)
        __builtin_prefetch(ahead + line, 0, 2);
    }
    vi16 s[R][4];
    dot_block<R, Kind>(w, xq.q + r0 * xq.K + b * kQBlock, xq.K, s);
    vf16 dw[4], mw[4];
    for (int v = 0; v < 4; ++v) dw[v] = load_half(w + weight_bytes(Kind) + 32 * v);
    if constexpr (Kind == kQ4_1)
      for (int v = 0; v < 4; ++v) mw[v] = load_half(w + weight_bytes(Kind) + 2 * kPanel + 32 * v);
    for (int r = 0; r < R; ++r) {
      const float dx = xq.d[(r0 + r) * xq.nb + b];
      const int32_t xs = xq.sum[(r0 + r) * xq.nb + b];
      const int32_t shift = Kind == kQ8_0 ? 128 * xs : Kind == kQ4_0 ? 8 * xs : 0;
      for (int v = 0; v < 4; ++v) {
        const vf16 prod = __builtin_convertvector(s[r][v] - shift, vf16);
        acc[r][v] += (dw[v] * dx) * prod;
      }
      if constexpr (Kind == kQ4_1) {
        const float sx = dx * static_cast<float>(xs);
        for (int v = 0; v < 4; ++v) acc[r][v] += mw[v] * sx;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const TY* res = ep.residual ? ep.residual + (r0 + r) * ep.n_out : nullptr;
    store_row(acc[r], col0, y + (r0 + r) * ep.n_out, res, ep);
  }
}

template <int64_t Kind, typename TY>
void run_quant(const QuantRows& xq, int64_t M, const uint8_t* packed, int64_t panels, TY* y, const Epilogue<TY>& ep) {
  const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
  const int64_t per_chunk = ((M + chunks - 1) / chunks + kQRows - 1) / kQRows * kQRows;
  const int64_t run_len = panel_run_len(panels);
  const int64_t runs = (panels + run_len - 1) / run_len;
  const int64_t panel_bytes = xq.nb * block_bytes(Kind);
  // the work estimate counts multiply-adds as the float32 panel linear does: a decode step streams
  // the weights, and both threads get their share of the memory bandwidth
  parallel_tasks(runs * chunks, 4 * M * xq.K * panels * kPanel, [&](int64_t task) {
    const int64_t first = (task / chunks) * run_len, last = std::min(panels, first + run_len);
    const int64_t chunk = task % chunks;
    const int64_t row_start = chunk * per_chunk, row_end = std::min(M, row_start + per_chunk);
    const uint8_t* end = packed + last * panel_bytes;
    for (int64_t p = first; p < last; ++p) {
      const uint8_t* panel = packed + p * panel_bytes;
      const int64_t col0 = p * kPanel;
      int64_t r = row_start;
      const uint8_t* fetch = end;  // the first tile only
      for (; r + kQRows <= row_end; r += kQRows, fetch = nullptr)
        quant_tile<kQRows, Kind>(xq, r, panel, col0, y, ep, fetch);
      switch (row_end - r) {
        case 0: break;
        case 1: quant_tile<1, Kind>(xq, r, panel, col0, y, ep, fetch); break;
        case 2: quant_tile<2, Kind>(xq, r, panel, col0, y, ep, fetch); break;
        default: quant_tile<3, Kind>(xq, r, panel, col0, y, ep, fetch); break;
      }
    }
  });
}

template <typename TY>
void quant_into(const QuantRows& xq, int64_t M, int64_t kind, const torch::Tensor& packed, TY* y,
                const Epilogue<TY>& ep) {
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t panels = packed.size(0);
  switch (kind) {
    case kQ8_0: run_quant<kQ8_0>(xq, M, w, panels, y, ep); break;
    case kQ4_0: run_quant<kQ4_0>(xq, M, w, panels, y, ep); break;
    default: run_quant<kQ4_1>(xq, M, w, panels, y, ep); break;
  }
}

}  // namespace

bool quant_dots_available() { return kIntegerDots; }

// A copy of t in memory advised for transparent huge pages (linear.cpp's huge_page_empty): a decode
// step streams every packed weight, and 4 KiB pages cost TLB misses all along.
torch::Tensor to_huge_pages(torch::Tensor t) {
  auto out = huge_page_empty(t.sizes(), t.options());
  out.copy_(t);
  return out;
}

// x [M, K] float32 or bfloat16, contiguous (K a multiple of 32); packed [panels, K / 32, block
// bytes] uint8 from `mstar.layers.quant.pack_quantized` for `kind` (0 Q8_0, 1 Q4_0, 2 Q4_1); n_out
// output columns (N, or N / 2 with silu_mul). The output has x's dtype.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t n_out, bool silu_mul,
                           c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "input must be contiguous [rows, in]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "input must be float32 or bfloat16");
  TORCH_CHECK(kind >= kQ8_0 && kind <= kQ4_1, "unknown quantized kind ", kind);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kQBlock == 0, "the input size must be a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(1) == K / kQBlock && packed.size(2) == block_bytes(kind),
              "packed weight does not match the input size or kind");
  TORCH_CHECK(n_out >= 1 && n_out <= packed.size(0) * kPanel / (silu_mul ? 2 : 1), "output columns out of range");
  const auto dtype = x.scalar_type();
  auto y = torch::empty({M, n_out}, x.options());
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res)
    TORCH_CHECK(!silu_mul && residual->scalar_type() == dtype && residual->is_contiguous() &&
                    residual->size(0) == M && residual->size(1) == n_out,
                "residual must be contiguous [rows, out] of the input's dtype, without silu_mul");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(!silu_mul && bias->scalar_type() == dtype && bias->is_contiguous() && bias->dim() == 1 &&
                    bias->size(0) == n_out,
                "bias must be contiguous [out] of the input's dtype, without silu_mul");
  if (M == 0) return y;
  const int64_t nb = K / kQBlock;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * nb);
  std::vector<int32_t> sum(M * nb);
  if (dtype == torch::kFloat32)
    quantize_rows(x.data_ptr<float>(), M, K, q.data(), d.data(), sum.data());
  else
    quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, q.data(), d.data(), sum.data());
  const QuantRows xq{q.data(), d.data(), sum.data(), K, nb};
  if (dtype == torch::kFloat32) {
    Epilogue<float> ep{silu_mul, has_res ? residual->data_ptr<float>() : nullptr, n_out,
                       has_bias ? bias->data_ptr<float>() : nullptr};
    quant_into(xq, M, kind, packed, y.data_ptr<float>(), ep);
  } else {
    Epilogue<c10::BFloat16> ep{silu_mul, has_res ? residual->data_ptr<c10::BFloat16>() : nullptr, n_out,
                               has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr};
    quant_into(xq, M, kind, packed, y.data_ptr<c10::BFloat16>(), ep);
  }
  return y;
}
