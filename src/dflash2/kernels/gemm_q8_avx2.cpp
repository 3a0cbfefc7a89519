// dflash2 CPU kernel: y[M, N] = (x[M, K] @ Q[N, K]^T) * scale[N] (+ bias[N]) with Q int8
// (weight-only, symmetric, one fp32 scale per output feature).
//
// Packed layout (built in quant_linear.py, see pack_int8()): an int8 tensor [P, K, 16] with
// P = ceil(N / 16) panels of 16 output features (rows past N are zero).  At step k of panel p the
// 16 bytes are Q[16p + j, k] for j = 0..15, so the inner loop over k reads a panel contiguously
// and one 8-byte load + sign extension + int->float conversion gives 8 outputs' weights in fp32.
//
// ROW-COUNT INVARIANCE (what keeps speculative verification exactly lossless): every output
// element y[m, n] is computed by the same sequence of fp32 operations whatever M is and whichever
// micro-kernel / thread computes it:
//     acc = 0;  for k = 0 .. K-1:  acc = fma(x[m, k], float(Q[n, k]), acc)     (in order)
//     y = acc * scale[n];  y = y + bias[n]                                      (two roundings)
// Micro-kernels differ only in how many rows (MR) and panels (NP) they keep in flight, never in
// the order of the sum (no split accumulators, no k blocking), so row m of the result is bitwise
// the same for M = 1 and M = 16.  Independent accumulation chains for the FMA latency come from
// rows and panels, not from splitting k.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
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

// fp32 micro-kernel for 3+ rows over one panel slice that was converted to fp32 once (wf: klen x 16,
// in L1).  The chain continues from the tile when resume is set: storing and reloading an fp32
// accumulator is exact, so the k-blocked sum is the same in-order FMA chain as the direct path.
template <int MR>
inline void micro_f32(const float* __restrict__ wf, const float* __restrict__ x, int64_t ldx,
                      int64_t klen, float* __restrict__ tile, bool resume) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = resume ? _mm256_loadu_ps(tile + r * kPanel) : _mm256_setzero_ps();
    acc[r][1] = resume ? _mm256_loadu_ps(tile + r * kPanel + 8) : _mm256_setzero_ps();
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < klen; ++k) {
    const __m256 w0 = _mm256_load_ps(wf + k * kPanel);
    const __m256 w1 = _mm256_load_ps(wf + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(tile + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(tile + r * kPanel + 8, acc[r][1]);
  }
}

inline void dispatch_f32(int mr, const float* wf, const float* x, int64_t ldx, int64_t klen,
                         float* tile, bool resume) {
  switch (mr) {
    case 6: micro_f32<6>(wf, x, ldx, klen, tile, resume); break;
    case 5: micro_f32<5>(wf, x, ldx, klen, tile, resume); break;
    case 4: micro_f32<4>(wf, x, ldx, klen, tile, resume); break;
    case 3: micro_f32<3>(wf, x, ldx, klen, tile, resume); break;
    case 2: micro_f32<2>(wf, x, ldx, klen, tile, resume); break;
    default: micro_f32<1>(wf, x, ldx, klen, tile, resume); break;
  }
}

// Rows per call when `remaining` rows are left: as few calls of <= 6 rows as possible, evenly
// sized (16 -> 6, 5, 5).  This changes only the speed, never the arithmetic of a row.
inline int rows_for_call(int64_t remaining) {
  const int64_t calls = (remaining + 5) / 6;
  return static_cast<int>((remaining + calls - 1) / calls);
}

constexpr int64_t kKc = 256;  // k steps per converted slice (16 KiB of fp32)
constexpr int64_t kMc = 48;   // rows per block of the k-blocked path

inline void store_scaled(const float* tile, int64_t ldt, int64_t rows, float* y, int64_t N,
                         int64_t n0, int64_t nv, const float* scale, const float* bias) {
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = y + r * N + n0;
    const float* src = tile + r * ldt;
    for (int64_t j = 0; j < nv; ++j) {
      float v = src[j] * scale[n0 + j];  // rounded product, then the bias: same as the fallback
      if (bias != nullptr) v = v + bias[n0 + j];
      dst[j] = v;
    }
  }
}

// 1-2 rows: int8 panels straight into registers, full K per call.
inline void panel_group_direct(const int8_t* wq, const float* scale, const float* bias,
                               const float* x, int64_t M, int64_t K, float* y, int64_t N,
                               int64_t g0, int64_t np) {
  alignas(32) float tile[2 * kGroup * kPanel];
  const int64_t ldt = kGroup * kPanel;
  const int64_t pstride = K * kPanel;
  dispatch(static_cast<int>(M), wq + g0 * pstride, pstride, np, x, K, K, tile, ldt);
  const int64_t n0 = g0 * kPanel;
  store_scaled(tile, ldt, M, y, N, n0, std::min<int64_t>(np * kPanel, N - n0), scale, bias);
}

// 3+ rows: per panel, each k slice is converted to fp32 once and reused by every row call.
inline void panel_blocked(const int8_t* wq, const float* scale, const float* bias, const float* x,
                          int64_t M, int64_t K, float* y, int64_t N, int64_t p) {
  alignas(32) float wf[kKc * kPanel];
  alignas(32) float tile[kMc * kPanel];
  const int8_t* wp = wq + p * K * kPanel;
  const int64_t n0 = p * kPanel;
  for (int64_t mb = 0; mb < M; mb += kMc) {
    const int64_t rows = std::min(kMc, M - mb);
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t klen = std::min(kKc, K - k0);
      for (int64_t k = 0; k < klen; ++k) {
        const int8_t* src = wp + (k0 + k) * kPanel;
        if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetch), _MM_HINT_T0);
        _mm256_store_ps(wf + k * kPanel, load8(src));
        _mm256_store_ps(wf + k * kPanel + 8, load8(src + 8));
      }
      for (int64_t m = 0; m < rows;) {
        const int mr = rows_for_call(rows - m);
        dispatch_f32(mr, wf, x + (mb + m) * K + k0, K, klen, tile + m * kPanel, k0 > 0);
        m += mr;
      }
    }
    store_scaled(tile, kPanel, rows, y + mb * N, N, n0, std::min<int64_t>(kPanel, N - n0), scale, bias);
  }
}

inline void panel_group(const int8_t* wq, const float* scale, const float* bias, const float* x,
                        int64_t M, int64_t K, float* y, int64_t N, int64_t g0, int64_t np) {
  if (M <= 2) {
    panel_group_direct(wq, scale, bias, x, M, K, y, N, g0, np);
    return;
  }
  for (int64_t p = g0; p < g0 + np; ++p) panel_blocked(wq, scale, bias, x, M, K, y, N, p);
}

void check_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                const c10::optional<at::Tensor>& bias, int64_t n_out) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "int8_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "int8_linear: x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.is_contiguous(),
              "int8_linear: packed weight must be a contiguous int8 [P, K, 16] tensor");
  const int64_t P = packed.size(0);
  TORCH_CHECK(packed.size(1) == x.size(1), "int8_linear: K mismatch (x has ", x.size(1),
              ", weight has ", packed.size(1), ")");
  TORCH_CHECK(n_out > (P - 1) * kPanel && n_out <= P * kPanel, "int8_linear: out_features ",
              n_out, " does not match ", P, " panels");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n_out,
              "int8_linear: scale must be a contiguous fp32 [N] tensor");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == n_out,
                "int8_linear: bias must be a contiguous fp32 [N] tensor");
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t n_out) {
  check_args(x, packed, scale, bias, n_out);
  const int64_t M = x.size(0);
  const int64_t K = x.size(1);
  const int64_t P = packed.size(0);
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0 || n_out == 0) return y;
  const float* bias_ptr =
      bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < n_out; ++n) y.data_ptr<float>()[m * n_out + n] = bias_ptr ? bias_ptr[n] : 0.f;
    return y;
  }
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();

  // Threads take chunks of consecutive panel groups from a shared counter (a late or preempted
  // worker costs little).  Which thread computes a panel does not change its arithmetic.
  const int64_t groups = (P + kGroup - 1) / kGroup;
  const int64_t work_per_group = K * kGroup * std::max<int64_t>(M, 4);
  const int64_t min_chunk = std::max<int64_t>(1, (int64_t{1} << 16) / work_per_group);
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups / min_chunk));
  const int64_t chunk = std::max(min_chunk, groups / (threads * 8));
  auto run = [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t g0 = q * kGroup;
      panel_group(wp, sp, bias_ptr, xp, M, K, yp, n_out, g0, std::min(kGroup, P - g0));
    }
  };
  if (threads <= 1) {
    run(0, groups);
  } else {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (;;) {
        const int64_t q0 = next.fetch_add(chunk, std::memory_order_relaxed);
        if (q0 >= groups) break;
        run(q0, std::min(groups, q0 + chunk));
      }
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(dflash2_qkernels, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n_out) -> Tensor",
        &int8_linear);
}
