// dflash2 CPU kernels for weight-only quantized linear layers, fp32 activations and accumulation:
//   int8_linear: y[M, N] = (x[M, K] @ Q[N, K]^T) * scale[N] (+ bias[N]), Q int8, one scale per output.
//   int4_linear: y[M, N] = x[M, K] @ (float(Q) * scale[n, k / 32])^T (+ bias[N]), Q in [-8, 7],
//                one fp32 scale per output and group of 32 k.
//
// Packed layouts (built in quant_linear.py): P = ceil(N / 16) panels of 16 output features (rows
// past N are zero).  int8: [P, K, 16] int8, at step k of panel p the 16 bytes are Q[16p + j, k].
// int4: [P, K/2, 16] uint8, byte (p, i, j) holds Q[16p + j, 2i] + 8 in its low nibble and
// Q[16p + j, 2i + 1] + 8 in its high nibble; scales [P, K/32, 16] fp32.  The inner loop over k reads
// a panel contiguously; weights are converted to fp32 in registers (int8, up to 32 rows) or one k
// slice at a time into an L1 buffer shared by every row of the call (more rows, and int4).
//
// ROW-COUNT INVARIANCE (what keeps speculative verification exactly lossless): every output
// element y[m, n] is computed by the same sequence of fp32 operations whatever M is and whichever
// micro-kernel / thread computes it:
//     acc = 0;  for k = 0 .. K-1:  acc = fma(x[m, k], w[n, k], acc)     (in order)
//     int8: w = float(Q), then y = acc * scale[n];  int4: w = float(Q) * scale[n, k / 32]
//     y = y + bias[n]                                                   (separate roundings)
// Micro-kernels differ only in how many rows (MR) and panels (NP) they keep in flight, never in
// the order of the sum (no split accumulators; k blocking parks the accumulator in memory, which
// is exact), so row m of the result is bitwise the same for M = 1 and M = 16.  Independent chains
// for the FMA latency come from rows and panels, not from splitting k.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include "chunked_for.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;      // outputs per panel
constexpr int64_t kGroup = 2;       // panels walked together (1- and 2-row calls use both at once)
constexpr int64_t kPrefetch = 1024; // software prefetch distance in bytes of one panel

inline __m256 load8(const int8_t* p) {  // 8 int8 -> 8 fp32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// acc tile: MR rows x (NP * 16) outputs, leading dimension ldt.
template <int MR, int NP>
inline void micro_kernel(const int8_t* __restrict__ w, int64_t pstride,  // NP panels, pstride apart
                         const float* __restrict__ x, int64_t ldx, int64_t K,
                         float* __restrict__ tile, int64_t ldt) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();

#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 3) == 0) {
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * pstride + k * kPanel + kPrefetch),
                     _MM_HINT_T0);
    }
    __m256 wv[NP][2];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const int8_t* src = w + j * pstride + k * kPanel;
      wv[j][0] = load8(src);
      wv[j][1] = load8(src + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        acc[r][j][0] = _mm256_fmadd_ps(xb, wv[j][0], acc[r][j][0]);
        acc[r][j][1] = _mm256_fmadd_ps(xb, wv[j][1], acc[r][j][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      _mm256_storeu_ps(tile + r * ldt + j * kPanel, acc[r][j][0]);
      _mm256_storeu_ps(tile + r * ldt + j * kPanel + 8, acc[r][j][1]);
    }
}

template <int MR>
inline void rows_over_panels(const int8_t* w, int64_t pstride, int64_t np, const float* x,
                             int64_t ldx, int64_t K, float* tile, int64_t ldt) {
  // 1- and 2-row calls take two panels at once (4 / 8 independent FMA chains); the rest one.
  constexpr int kNP = MR <= 2 ? 2 : 1;
  int64_t j = 0;
  for (; j + kNP <= np; j += kNP)
    micro_kernel<MR, kNP>(w + j * pstride, pstride, x, ldx, K, tile + j * kPanel, ldt);
  for (; j < np; ++j) micro_kernel<MR, 1>(w + j * pstride, pstride, x, ldx, K, tile + j * kPanel, ldt);
}

inline void dispatch(int mr, const int8_t* w, int64_t pstride, int64_t np, const float* x,
                     int64_t ldx, int64_t K, float* tile, int64_t ldt) {
  switch (mr) {
    case 6: rows_over_panels<6>(w, pstride, np, x, ldx, K, tile, ldt); break;
    case 5: rows_over_panels<5>(w, pstride, np, x, ldx, K, tile, ldt); break;
    case 4: rows_over_panels<4>(w, pstride, np, x, ldx, K, tile, ldt); break;
    case 3: rows_over_panels<3>(w, pstride, np, x, ldx, K, tile, ldt); break;
    case 2: rows_over_panels<2>(w, pstride, np, x, ldx, K, tile, ldt); break;
    default: rows_over_panels<1>(w, pstride, np, x, ldx, K, tile, ldt); break;
  }
}

// fp32 micro-kernel over NP panel slices already converted to fp32 (wf: NP x [klen x 16], wstride
// apart, in L1).  The chain continues from the tile when resume is set: storing and reloading an
// fp32 accumulator is exact, so the k-blocked sum is the same in-order FMA chain as the direct path.
template <int MR, int NP>
inline void micro_f32(const float* __restrict__ wf, int64_t wstride, const float* __restrict__ x,
                      int64_t ldx, int64_t klen, float* __restrict__ tile, int64_t ldt, bool resume) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
        acc[r][j][h] = resume ? _mm256_loadu_ps(tile + r * ldt + j * kPanel + 8 * h) : _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < klen; ++k) {
    __m256 wv[NP][2];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      wv[j][0] = _mm256_load_ps(wf + j * wstride + k * kPanel);
      wv[j][1] = _mm256_load_ps(wf + j * wstride + k * kPanel + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) {
        acc[r][j][0] = _mm256_fmadd_ps(xb, wv[j][0], acc[r][j][0]);
        acc[r][j][1] = _mm256_fmadd_ps(xb, wv[j][1], acc[r][j][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(tile + r * ldt + j * kPanel + 8 * h, acc[r][j][h]);
}

template <int MR>
inline void rows_over_slices(const float* wf, int64_t wstride, int64_t np, const float* x,
                             int64_t ldx, int64_t klen, float* tile, int64_t ldt, bool resume) {
  if (MR <= 2 && np == 2) {  // few rows: both panels at once for 4 / 8 independent chains
    micro_f32<MR, 2>(wf, wstride, x, ldx, klen, tile, ldt, resume);
    return;
  }
  for (int64_t j = 0; j < np; ++j)
    micro_f32<MR, 1>(wf + j * wstride, wstride, x, ldx, klen, tile + j * kPanel, ldt, resume);
}

inline void dispatch_f32(int mr, const float* wf, int64_t wstride, int64_t np, const float* x,
                         int64_t ldx, int64_t klen, float* tile, int64_t ldt, bool resume) {
  switch (mr) {
    case 6: rows_over_slices<6>(wf, wstride, np, x, ldx, klen, tile, ldt, resume); break;
    case 5: rows_over_slices<5>(wf, wstride, np, x, ldx, klen, tile, ldt, resume); break;
    case 4: rows_over_slices<4>(wf, wstride, np, x, ldx, klen, tile, ldt, resume); break;
    case 3: rows_over_slices<3>(wf, wstride, np, x, ldx, klen, tile, ldt, resume); break;
    case 2: rows_over_slices<2>(wf, wstride, np, x, ldx, klen, tile, ldt, resume); break;
    default: rows_over_slices<1>(wf, wstride, np, x, ldx, klen, tile, ldt, resume); break;
  }
}

// Rows per call when `remaining` rows are left: as few calls of <= 6 rows as possible, evenly
// sized (16 -> 6, 5, 5).  This changes only the speed, never the arithmetic of a row.
inline int rows_for_call(int64_t remaining) {
  const int64_t calls = (remaining + 5) / 6;
  return static_cast<int>((remaining + calls - 1) / calls);
}

constexpr int64_t kKc = 128;  // k steps per converted slice (kGroup x 8 KiB of fp32)
constexpr int64_t kMc = 48;   // rows per block of the k-blocked path
constexpr int64_t kDirectRows = 32;  // int8 calls of up to this many rows convert in registers

// y = tile (* scale) (+ bias), two separate roundings as in the fallback; scale may be null.
inline void store_scaled(const float* tile, int64_t ldt, int64_t rows, float* y, int64_t N,
                         int64_t n0, int64_t nv, const float* scale, const float* bias) {
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = y + r * N + n0;
    const float* src = tile + r * ldt;
    for (int64_t j = 0; j < nv; ++j) {
      float v = src[j];
      if (scale != nullptr) v = v * scale[n0 + j];
      if (bias != nullptr) v = v + bias[n0 + j];
      dst[j] = v;
    }
  }
}

// Up to kDirectRows rows of int8: panels straight into registers, full K per call of <= 6 rows
// (measured faster than converting through the L1 buffer for the row counts of verification).
inline void int8_group_direct(const int8_t* wq, const float* scale, const float* bias,
                              const float* x, int64_t M, int64_t K, float* y, int64_t N,
                              int64_t g0, int64_t np) {
  alignas(32) float tile[6 * kGroup * kPanel];
  const int64_t ldt = kGroup * kPanel;
  const int64_t pstride = K * kPanel;
  const int64_t n0 = g0 * kPanel;
  for (int64_t m = 0; m < M;) {
    const int mr = rows_for_call(M - m);
    dispatch(mr, wq + g0 * pstride, pstride, np, x + m * K, K, K, tile, ldt);
    store_scaled(tile, ldt, mr, y + m * N, N, n0, std::min<int64_t>(np * kPanel, N - n0), scale, bias);
    m += mr;
  }
}

// Converts klen k steps of panel p, from k0, to fp32 [klen x 16] (int8: the integer values).
struct Int8Slices {
  const int8_t* w;
  int64_t K;
  void operator()(int64_t p, int64_t k0, int64_t klen, float* wf) const {
    const int8_t* wp = w + (p * K + k0) * kPanel;
    for (int64_t k = 0; k < klen; ++k) {
      const int8_t* src = wp + k * kPanel;
      if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetch), _MM_HINT_T0);
      _mm256_store_ps(wf + k * kPanel, load8(src));
      _mm256_store_ps(wf + k * kPanel + 8, load8(src + 8));
    }
  }
};

// int4: bytes [P, K/2, 16], byte (p, i, j) = (q[16p+j, 2i] + 8) | (q[16p+j, 2i+1] + 8) << 4, and
// fp32 scales [P, K/32, 16].  The fp32 weight is float(q) * scale (one rounding, as the fallback's
// dequantized weight); k0 and klen are multiples of 32.
struct Int4Slices {
  const uint8_t* w;
  const float* s;
  int64_t K;
  void operator()(int64_t p, int64_t k0, int64_t klen, float* wf) const {
    const uint8_t* wp = w + (p * K + k0) / 2 * kPanel;
    const float* sp = s + (p * K + k0) / 32 * kPanel;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i eight = _mm_set1_epi8(8);
    for (int64_t k = 0; k < klen; k += 2) {
      const uint8_t* src = wp + k / 2 * kPanel;
      if ((k & 7) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetch), _MM_HINT_T0);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, low4), eight);                     // k
      const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), low4), eight);  // k + 1
      const __m256 s0 = _mm256_loadu_ps(sp + k / 32 * kPanel);
      const __m256 s1 = _mm256_loadu_ps(sp + k / 32 * kPanel + 8);
      _mm256_store_ps(wf + k * kPanel, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), s0));
      _mm256_store_ps(wf + k * kPanel + 8,
                      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), s1));
      _mm256_store_ps(wf + (k + 1) * kPanel, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), s0));
      _mm256_store_ps(wf + (k + 1) * kPanel + 8,
                      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), s1));
    }
  }
};

// Panels [g0, g0 + np): each k slice is converted to fp32 once and reused by every row call.
template <class Slices>
inline void group_blocked(const Slices& slices, const float* scale, const float* bias, const float* x,
                          int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t np) {
  alignas(32) float wf[kGroup * kKc * kPanel];
  alignas(32) float tile[kMc * kGroup * kPanel];
  const int64_t ldt = kGroup * kPanel;
  const int64_t n0 = g0 * kPanel;
  for (int64_t mb = 0; mb < M; mb += kMc) {
    const int64_t rows = std::min(kMc, M - mb);
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t klen = std::min(kKc, K - k0);
      for (int64_t j = 0; j < np; ++j) slices(g0 + j, k0, klen, wf + j * kKc * kPanel);
      for (int64_t m = 0; m < rows;) {
        const int mr = rows_for_call(rows - m);
        dispatch_f32(mr, wf, kKc * kPanel, np, x + (mb + m) * K + k0, K, klen, tile + m * ldt, ldt, k0 > 0);
        m += mr;
      }
    }
    store_scaled(tile, ldt, rows, y + mb * N, N, n0, std::min<int64_t>(np * kPanel, N - n0), scale, bias);
  }
}

// Threads take chunks of consecutive panel groups from a shared counter (chunked_for.h: a late, preempted or slower
// worker costs little).  Which thread computes a panel does not change its arithmetic.
template <class Fn>
void for_panel_groups(int64_t P, int64_t M, int64_t K, const Fn& fn) {
  const int64_t groups = (P + kGroup - 1) / kGroup;
  const int64_t work_per_group = K * kGroup * std::max<int64_t>(M, 4);
  const int64_t min_chunk = std::max<int64_t>(1, (int64_t{1} << 16) / work_per_group);
  chunked_for(groups, min_chunk, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) fn(q * kGroup, std::min(kGroup, P - q * kGroup));
  });
}

// Checks shared by both formats; returns P.  `kstep`: packed k entries per k step (int8 1, int4 1/2).
int64_t check_args(const char* op, const at::Tensor& x, const at::Tensor& packed, at::ScalarType packed_type,
                   int64_t packed_k, const c10::optional<at::Tensor>& bias, int64_t n_out) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(packed.scalar_type() == packed_type && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.is_contiguous(),
              op, ": packed weight must be a contiguous ", packed_type, " [P, ", packed_k, ", 16] tensor");
  TORCH_CHECK(packed.size(1) == packed_k, op, ": K mismatch (x has ", x.size(1), ", weight has ",
              packed.size(1), " packed k entries, expected ", packed_k, ")");
  const int64_t P = packed.size(0);
  TORCH_CHECK(n_out > (P - 1) * kPanel && n_out <= P * kPanel, op, ": out_features ", n_out,
              " does not match ", P, " panels");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out, op,
                ": bias must be a contiguous fp32 [N] tensor");
  }
  return P;
}

inline const float* bias_data(const c10::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t n_out) {
  const int64_t P = check_args("int8_linear", x, packed, at::kChar, x.size(1), bias, n_out);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n_out,
              "int8_linear: scale must be a contiguous fp32 [N] tensor");
  TORCH_CHECK(x.size(1) > 0, "int8_linear: K must be > 0");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias_data(bias);
  float* yp = y.data_ptr<float>();
  const Int8Slices slices{wp, K};
  for_panel_groups(P, M, K, [&](int64_t g0, int64_t np) {
    if (M <= kDirectRows) {
      int8_group_direct(wp, sp, bp, xp, M, K, yp, n_out, g0, np);
    } else {
      group_blocked(slices, sp, bp, xp, M, K, yp, n_out, g0, np);
    }
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t n_out) {
  const int64_t K = x.size(1);
  TORCH_CHECK(K > 0 && K % 32 == 0, "int4_linear: K must be a positive multiple of 32, got ", K);
  const int64_t P = check_args("int4_linear", x, packed, at::kByte, K / 2, bias, n_out);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == P && scales.size(1) == K / 32 && scales.size(2) == kPanel,
              "int4_linear: scales must be a contiguous fp32 [P, K/32, 16] tensor");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* bp = bias_data(bias);
  float* yp = y.data_ptr<float>();
  const Int4Slices slices{packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), K};
  for_panel_groups(P, M, K, [&](int64_t g0, int64_t np) {
    group_blocked(slices, nullptr, bp, xp, M, K, yp, n_out, g0, np);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(dflash2_qkernels, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n_out) -> Tensor",
        &int8_linear);
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int n_out) -> Tensor",
        &int4_linear);
}
