// dflash2 CPU kernel: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W pre-packed as bf16.
//
// Packed layout (built in packed_linear.py, see pack_weight()): a bf16 tensor [P, K, 16] with
// P = ceil(N / 16) panels of 16 output features (rows of W past N are zero padding).  Within
// one k step of panel p the 16 bf16 values are interleaved so that the 32-bit word i holds
//     low half  = W[16p + i,     k]
//     high half = W[16p + 8 + i, k]          (i = 0..7)
// One 32-byte load then gives both halves as fp32 with a single ALU op each:
//     (word << 16)          -> fp32 of W[16p + i, k]
//     (word & 0xFFFF0000)   -> fp32 of W[16p + 8 + i, k]
// and the inner loop over k reads the panel contiguously.
//
// Each micro-kernel call computes a tile of MR activation rows x 16 outputs over a range of k,
// broadcasting x[m, k] (fp32) and doing one FMA per (row, half).  MR <= 6 keeps the 2*MR
// accumulators plus the two weight vectors and a broadcast in the 16 ymm registers; small MR
// splits k across KU independent accumulator sets to hide the FMA latency.  Accumulation is
// fp32 throughout.  Work is split across threads by panels (chunks from a shared counter,
// chunked_for.h); the arithmetic done for one output element does not depend on the split, so
// results are identical for any thread count.
//
// AVX-512 (chosen at run time when the CPU has it): calls of 4..12 rows use a micro-kernel with one zmm
// accumulator per row (16 outputs): the 32-byte panel step is widened with one zero-extension and one shift,
// so the lanes hold the outputs in the interleaved order (W0, W8, W1, W9, ...), put back in order when the tile
// is stored.  Each output is still one in-order fp32 FMA chain over k, so both instruction sets give bitwise
// the same results (tested), and which one a call of m rows uses never changes its arithmetic.  Calls of 1..3
// rows stay on AVX2: they are bound by memory, and two ymm chains per row hide the FMA latency better there.

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

constexpr int64_t kPanel = 16;  // outputs per panel
constexpr int64_t kPrefetchK = 64;  // software prefetch distance in k steps (64 * 32 B = 2 KiB)

template <int MR, int KU, int U>
inline void micro_kernel(const uint16_t* __restrict__ wp,  // panel at k0: 16 bf16 per k
                         const uint16_t* pf,                // prefetched in step with wp
                         const float* __restrict__ x,      // x + m0 * ldx + k0
                         int64_t ldx, int64_t klen,
                         float* __restrict__ tile,         // MR x 16 fp32, ld 16
                         bool accumulate) {
  // U: k unroll (amortises the loop/address arithmetic); KU accumulator sets, used in turn.
  static_assert(U % KU == 0, "KU must divide U");
  __m256 acc[KU][MR][2];
  const float* xr[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) xr[r] = x + r * ldx;
  // A k block after the first continues the chain it left in the tile, so every output is ONE in-order fp32
  // FMA chain over k whatever the row count (row-count invariance: verifying k drafts rounds like decoding).
#pragma GCC unroll 8
  for (int u = 0; u < KU; ++u)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const bool resume = accumulate && u == 0;
      acc[u][r][0] = resume ? _mm256_loadu_ps(tile + r * kPanel) : _mm256_setzero_ps();
      acc[u][r][1] = resume ? _mm256_loadu_ps(tile + r * kPanel + 8) : _mm256_setzero_ps();
    }
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));

  int64_t k = 0;
  for (; k + U <= klen; k += U) {
    // One 64-byte line per 2 k steps.
#pragma GCC unroll 4
    for (int u = 0; u < U; u += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + (k + u) * kPanel), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m256i raw =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (k + u) * kPanel));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, hi_mask));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 xb = _mm256_broadcast_ss(xr[r] + k + u);
        acc[u % KU][r][0] = _mm256_fmadd_ps(xb, w0, acc[u % KU][r][0]);
        acc[u % KU][r][1] = _mm256_fmadd_ps(xb, w1, acc[u % KU][r][1]);
      }
    }
  }
  for (; k < klen; ++k) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + k * kPanel));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, hi_mask));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xr[r] + k);
      acc[0][r][0] = _mm256_fmadd_ps(xb, w0, acc[0][r][0]);
      acc[0][r][1] = _mm256_fmadd_ps(xb, w1, acc[0][r][1]);
    }
  }
#pragma GCC unroll 8
  for (int u = 1; u < KU; ++u)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      acc[0][r][0] = _mm256_add_ps(acc[0][r][0], acc[u][r][0]);
      acc[0][r][1] = _mm256_add_ps(acc[0][r][1], acc[u][r][1]);
    }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* t = tile + r * kPanel;
    _mm256_storeu_ps(t, acc[0][r][0]);
    _mm256_storeu_ps(t + 8, acc[0][r][1]);
  }
}

#define DFLASH2_AVX512 __attribute__((target("avx512f")))

template <int MR, int U>
DFLASH2_AVX512 inline void micro_kernel_512(const uint16_t* __restrict__ wp, const uint16_t* pf,
                                            const float* __restrict__ x, int64_t ldx, int64_t klen,
                                            float* __restrict__ tile, bool accumulate) {
  // lane j of an accumulator holds output (j >> 1) + 8 * (j & 1) of the panel (the packed interleave)
  const __m512i to_lanes = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m512i to_outputs = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  __m512 acc[MR];
  const float* xr[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    xr[r] = x + r * ldx;
    acc[r] = accumulate ? _mm512_permutexvar_ps(to_lanes, _mm512_loadu_ps(tile + r * kPanel))
                        : _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + U <= klen; k += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; u += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + (k + u) * kPanel), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (k + u) * kPanel));
      const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k + u]), w, acc[r]);
    }
  }
  for (; k < klen; ++k) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + k * kPanel));
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k]), w, acc[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(tile + r * kPanel, _mm512_permutexvar_ps(to_outputs, acc[r]));
}

DFLASH2_AVX512 void dispatch_512(int mr, const uint16_t* wp, const uint16_t* pf, const float* x, int64_t ldx,
                                 int64_t klen, float* tile, bool accumulate) {
  switch (mr) {
    case 12: micro_kernel_512<12, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 11: micro_kernel_512<11, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 10: micro_kernel_512<10, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 9: micro_kernel_512<9, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 8: micro_kernel_512<8, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 7: micro_kernel_512<7, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 6: micro_kernel_512<6, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 5: micro_kernel_512<5, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    default: micro_kernel_512<4, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
  }
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// How a block of rows is cut into micro-kernel calls of 1..6 rows: the split that minimises the
// estimated cost, in cycles per k step for each call size (measured on Zen 3; a 4-row call keeps
// exactly the 8 FMAs in flight that hide the FMA latency and runs nearly at peak, 5 rows suffer
// from register pressure, 6 rows need the most broadcasts per FMA).
constexpr int kMaxCall = 12;  // rows per micro-kernel call (AVX-512; AVX2 calls take at most 6)

struct RowPlan {
  int count = 0;
  int rows[64];
};

// Estimated cycles per k step of one call of r rows (index r).  AVX2: measured on Zen 3.  AVX-512: two FMA
// ports of 4-cycle latency want 8 independent chains, so 4..8 rows cost about the same; beyond 8 the FMAs
// dominate (half a cycle per row); calls of 1..3 rows go to AVX2 (see the top of the file).
constexpr float kCostAvx2[kMaxCall + 1] = {0.f, 2.2f, 3.0f, 4.2f, 4.3f, 6.3f, 6.6f, 1e9f, 1e9f, 1e9f, 1e9f, 1e9f, 1e9f};
constexpr float kCostAvx512[kMaxCall + 1] = {0.f, 2.2f, 3.0f, 4.2f, 4.2f, 4.3f, 4.4f, 4.5f, 4.6f, 5.0f, 5.5f, 6.0f, 6.5f};

inline RowPlan plan_rows(int64_t m, const float* cost) {
  float best[65];
  int pick[65];
  best[0] = 0.f;
  for (int64_t i = 1; i <= m; ++i) {
    best[i] = 1e30f;
    for (int r = 1; r <= kMaxCall && r <= i; ++r) {
      const float c = best[i - r] + cost[r];
      if (c < best[i]) {
        best[i] = c;
        pick[i] = r;
      }
    }
  }
  RowPlan plan;
  for (int64_t i = m; i > 0; i -= pick[i]) plan.rows[plan.count++] = pick[i];
  return plan;
}

inline void dispatch(int mr, const uint16_t* wp, const uint16_t* pf, const float* x,
                     int64_t ldx, int64_t klen, float* tile, bool accumulate) {
  switch (mr) {
    case 6: micro_kernel<6, 1, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 5: micro_kernel<5, 1, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 4: micro_kernel<4, 1, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    case 3: micro_kernel<3, 1, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    // One accumulator set for every row count (KU = 1): splitting k over several sets would round 1- and 2-row
    // calls differently from the others.
    case 2: micro_kernel<2, 1, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
    default: micro_kernel<1, 1, 4>(wp, pf, x, ldx, klen, tile, accumulate); break;
  }
}

// Row block / k block sizes.  A thread walks its panels in memory order (the weight stream stays
// contiguous, which the hardware prefetcher needs).  For one panel, rows go in blocks of up to
// kMc.  A block cut into several micro-kernel calls walks K in kKc steps: an 8 KiB slice of the
// panel is read from memory by the first call and from L1 by the others, and the accumulators
// of every call are parked in a small tile buffer between k steps.  A block of <= 6 rows (one
// call) does all of K at once.
constexpr int64_t kMc = 48;
static_assert(kMc <= 64, "RowPlan holds at most 64 calls");
constexpr int64_t kKc = 256;

// Panel p (16 outputs starting at n0 = 16p), all M rows.
inline void panel_all_rows(const uint16_t* wpanel, const float* x, int64_t M, int64_t K,
                           float* y, int64_t N, const float* bias, int64_t p, int64_t mc,
                           int64_t kc, const RowPlan& full, const RowPlan& tail, bool wide) {
  const int64_t n0 = p * kPanel;
  const int64_t nv = std::min<int64_t>(kPanel, N - n0);
  alignas(64) float tile[kMc * kPanel];
  for (int64_t mb = 0; mb < M; mb += mc) {
    const int64_t me = std::min(M, mb + mc);
    const RowPlan& plan = me - mb == mc ? full : tail;
    const int64_t kstep = plan.count == 1 ? K : kc;
    for (int64_t k0 = 0; k0 < K; k0 += kstep) {
      const int64_t klen = std::min(kstep, K - k0);
      // Prefetch: the first chunk streams this k slice from memory, prefetching kPrefetchK
      // steps ahead; the later chunks (which find the slice in L1) prefetch the next slice, so
      // memory traffic overlaps their compute.  Past the end of the panel the next slice is
      // the start of panel p + 1, the next one this thread usually works on.
      const uint16_t* wk = wpanel + k0 * kPanel;
      int64_t m = mb;
      for (int c = 0; c < plan.count; ++c) {
        const int mr = plan.rows[c];
        const uint16_t* pf = c == 0 ? wk + kPrefetchK * kPanel : wk + klen * kPanel;
        if (wide && mr >= 4) {
          dispatch_512(mr, wk, pf, x + m * K + k0, K, klen, tile + (m - mb) * kPanel, k0 > 0);
        } else {
          dispatch(mr, wk, pf, x + m * K + k0, K, klen, tile + (m - mb) * kPanel, k0 > 0);
        }
        m += mr;
      }
    }
    for (int64_t m = mb; m < me; ++m) {
      float* dst = y + m * N + n0;
      const float* src = tile + (m - mb) * kPanel;
      if (bias != nullptr) {
        for (int64_t j = 0; j < nv; ++j) dst[j] = src[j] + bias[n0 + j];
      } else {
        std::memcpy(dst, src, nv * sizeof(float));
      }
    }
  }
}

// isa: 0 = the widest the CPU has, 1 = AVX2 only (benchmarks and the AVX-512 vs AVX2 identity test).
at::Tensor packed_linear_tuned(const at::Tensor& x, const at::Tensor& packed,
                               const c10::optional<at::Tensor>& bias, int64_t n_out,
                               int64_t mc_opt, int64_t kc_opt, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "packed_linear: x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == kPanel && packed.is_contiguous(),
              "packed_linear: packed weight must be a contiguous bf16 [P, K, 16] tensor");
  const int64_t M = x.size(0);
  const int64_t K = x.size(1);
  const int64_t P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed_linear: K mismatch (x has ", K, ", weight has ",
              packed.size(1), ")");
  TORCH_CHECK(n_out > (P - 1) * kPanel && n_out <= P * kPanel,
              "packed_linear: out_features ", n_out, " does not match ", P, " panels");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == n_out,
                "packed_linear: bias must be a contiguous fp32 [N] tensor");
    bias_ptr = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0 || n_out == 0) return y;
  if (K == 0) {
    if (bias_ptr) {
      y.copy_(bias->unsqueeze(0).expand({M, n_out}));
    } else {
      y.zero_();
    }
    return y;
  }

  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();

  const int64_t mc = std::min(M, mc_opt > 0 ? std::min(mc_opt, kMc) : kMc);
  const bool wide = isa == 0 && cpu_has_avx512();
  const float* cost = wide ? kCostAvx512 : kCostAvx2;
  const RowPlan full = plan_rows(mc, cost);
  const RowPlan tail = plan_rows(M % mc == 0 ? mc : M % mc, cost);
  const int64_t kc = kc_opt > 0 ? kc_opt : kKc;
  // Threads take chunks of consecutive panels from a shared counter rather than fixed halves:
  // on a busy machine a worker that starts late (or is preempted) then costs little, as the
  // others take its share.  Each chunk is a contiguous stretch of the packed weight.  Which
  // thread computes a panel does not change its arithmetic, so results do not depend on it.
  const int64_t work_per_panel = K * std::max<int64_t>(M, 4);  // ~ cycles
  const int64_t min_chunk = std::max<int64_t>(1, (int64_t{1} << 16) / work_per_panel);
  chunked_for(P, min_chunk, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      panel_all_rows(wp + p * K * kPanel, xp, M, K, yp, n_out, bias_ptr, p, mc, kc, full, tail, wide);
    }
  });
  return y;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t n_out) {
  return packed_linear_tuned(x, packed, bias, n_out, 0, 0, 0);
}

}  // namespace

TORCH_LIBRARY(dflash2_kernels, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n_out) -> Tensor",
        &packed_linear);
  // Same with explicit row-block / k-block sizes (<= 0: default) and instruction set, for benchmarks and tests.
  m.def(
      "packed_linear_tuned(Tensor x, Tensor packed, Tensor? bias, int n_out, int mc, int kc, int isa) "
      "-> Tensor",
      &packed_linear_tuned);
}
