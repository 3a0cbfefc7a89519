// dflash2 CPU kernel on AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and W in bf16, fp32 accumulation.
//
// Why: CPUs with AVX512-BF16 but no AMX (AMD Zen 4 / Zen 5, Cooper Lake) have VDPBF16PS, which multiplies 16 pairs
// of bf16 and adds both products to 16 fp32 lanes in one instruction.  The AVX2 / AVX-512 kernel (gemm_avx2.cpp)
// widens every weight to fp32 and does one FMA per weight and row, so a call of 7 rows (verifying a tree of 6
// drafts) costs 1.5x a call of 1 row there; with one VDPBF16PS per pair of weights and row, the rows up to about 8
// stay inside the time that reading the weights takes.
//
// Packed layout: the AMX one (amx.py: pack_weight_amx), bf16 [P, S, 16, 32], element [p, s, r, 2c + h] =
// W[16p + c, 32s + 2r + h]: row r of block (p, s) is the pair row VDPBF16PS wants as its weight operand (lane c
// holds W[c, k] and W[c, k + 1]); the x operand is the 32-bit word x[m, k .. k + 1] broadcast to every lane.
//
// Row-count invariance (what makes speculation lossless in bf16): every output y[m, n] is one accumulator updated by
// VDPBF16PS over the k pairs 0, 1, ..., Kp / 2 - 1 in order, whatever the number of rows, the row block it falls in,
// the k chunk (accumulators spill to fp32 memory between chunks, which is exact) and the thread; the bias is added
// after the sum.  x is padded with zero columns to Kp (a multiple of 32) by the caller.
//
// Threads: panels are split into groups (one broadcast of x feeds the group's 2-4 panels, `blocking_for`), groups
// are split across threads.  Each group runs its row blocks over k chunks of 64 steps (up to 256 KiB of weights for
// the group: a second row block reads them from L2).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include "chunked_for.h"
#include "tile_store.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;              // outputs per panel (fp32 lanes of one accumulator)
constexpr int64_t kStep = 32;               // k per packed block
constexpr int64_t kPairs = kStep / 2;       // pair rows per packed block
constexpr int64_t kBlock = kPanel * kStep;  // bf16 elements of one packed (panel, k step) block: 1 KiB
constexpr int kMaxRows = 6;                 // rows per register block over 4 panels
constexpr int64_t kChunk = 64;              // k steps per chunk (the group's weights of a chunk: 256 KiB)

inline int32_t pair_at(const uint16_t* x) {  // the bf16 pair x[0], x[1] as one 32-bit word (x[0] in the low half)
  int32_t word;
  std::memcpy(&word, x, sizeof(word));
  return word;
}

// R rows x NP panels over k steps [s0, s1): acc [R][group][16] fp32 in memory, zeroed by the caller before s = 0.
template <int R, int NP>
inline void row_block(const uint16_t* __restrict__ wg, int64_t panel_stride, const uint16_t* __restrict__ xb,
                      int64_t ldx, int64_t s0, int64_t s1, float* __restrict__ acc, int64_t group) {
  __m512 c[R][NP];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NP; ++j) c[m][j] = _mm512_loadu_ps(acc + (m * group + j) * kPanel);
  for (int64_t s = s0; s < s1; ++s) {
    const uint16_t* w = wg + s * kBlock;
    const uint16_t* xs = xb + s * kStep;
    for (int64_t r = 0; r < kPairs; ++r) {
      __m512bh b[NP];
      for (int j = 0; j < NP; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * panel_stride + r * kStep);
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair_at(xs + m * ldx + 2 * r));
        for (int j = 0; j < NP; ++j) c[m][j] = _mm512_dpbf16_ps(c[m][j], a, b[j]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(acc + (m * group + j) * kPanel, c[m][j]);
}

// A register block of ``rows`` rows, R <= rows <= HI, dispatched at run time (the accumulators live in registers,
// so the row count is a template argument).
template <int NP, int R, int HI>
inline void run_rows(int rows, const uint16_t* wg, int64_t panel_stride, const uint16_t* xb, int64_t ldx,
                     int64_t s0, int64_t s1, float* acc, int64_t group) {
  if constexpr (R < HI) {
    if (rows > R) return run_rows<NP, R + 1, HI>(rows, wg, panel_stride, xb, ldx, s0, s1, acc, group);
  }
  row_block<R, NP>(wg, panel_stride, xb, ldx, s0, s1, acc, group);
}

// How a call's rows are blocked.  Up to 13 rows (a chain of 8 drafts, a tree of 12) go in ONE register block, so
// the weights stream from memory once while the products run: up to 6 rows over 4 panels per broadcast of x (24
// accumulators), 7-9 rows over 3 panels (27), 10-13 over 2 (26).  With blocks of 6 rows a 9-row call read its
// weights from memory for the first block and from L2 for the second, after it: the two times added up (AMD EPYC
// Zen 4, every linear layer of the 1.5B from memory, 2 threads: 9 rows 1.15 -> 1.06x one row, 13 rows 1.43 -> 1.27x;
// 2026-12-06).  More rows (prefill): blocks of 6 over 4 panels, the fewest broadcasts per product, a chunk's weights
// read again from L2 for each block.
struct Blocking {
  int64_t group;  // panels per broadcast of x
  int rows;       // rows per register block
};

inline Blocking blocking_for(int64_t m) {
  if (m <= kMaxRows) return {4, kMaxRows};
  if (m <= 9) return {3, 9};
  if (m <= 13) return {2, 13};
  return {4, kMaxRows};
}

inline void run_block(int np, int rows, const uint16_t* wg, int64_t panel_stride, const uint16_t* xb, int64_t ldx,
                      int64_t s0, int64_t s1, float* acc, int64_t group) {
  if (rows <= kMaxRows) {
    switch (np) {
      case 4: return run_rows<4, 1, 6>(rows, wg, panel_stride, xb, ldx, s0, s1, acc, group);
      case 3: return run_rows<3, 1, 6>(rows, wg, panel_stride, xb, ldx, s0, s1, acc, group);
      case 2: return run_rows<2, 1, 6>(rows, wg, panel_stride, xb, ldx, s0, s1, acc, group);
      default: return run_rows<1, 1, 6>(rows, wg, panel_stride, xb, ldx, s0, s1, acc, group);
    }
  }
  if (rows <= 13) {
    if (np == 3) return run_rows<3, 7, 9>(rows, wg, panel_stride, xb, ldx, s0, s1, acc, group);
    if (np == 2) return run_rows<2, 7, 13>(rows, wg, panel_stride, xb, ldx, s0, s1, acc, group);
    return run_rows<1, 7, 13>(rows, wg, panel_stride, xb, ldx, s0, s1, acc, group);
  }
  __builtin_unreachable();
}

at::Tensor dpbf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t m_out, int64_t n_out, bool bf16_out) {
  const char* name = "dpbf16_linear";
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), name,
              ": x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kPanel &&
                  packed.size(3) == kStep && packed.is_contiguous(),
              name, ": the weight must be a contiguous bf16 [P, S, 16, 32] tensor");
  const int64_t Kp = x.size(1), P = packed.size(0), S = packed.size(1);
  TORCH_CHECK(Kp == S * kStep, name, ": x has ", Kp, " columns, the weight ", S * kStep);
  TORCH_CHECK(m_out <= x.size(0), name, ": m_out ", m_out, " > rows ", x.size(0));
  TORCH_CHECK(n_out > (P - 1) * kPanel && n_out <= P * kPanel, name, ": out_features ", n_out, " does not match ",
              P, " panels");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out, name,
                ": bias must be a contiguous fp32 [N] tensor");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m_out, n_out}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (m_out == 0 || n_out == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const RowsOut yp = rows_out(y);  // fp32 or bf16 outputs (tile_store.h)
  const int64_t stride = S * kBlock;  // elements between consecutive panels
  const Blocking blocking = blocking_for(m_out);
  const int64_t group = blocking.group;
  const int64_t groups = (P + group - 1) / group;
  chunked_threads(groups, 1, [&](Chunks& chunks) {  // (groups in chunks, each a contiguous stream)
    std::vector<float> acc(static_cast<size_t>(m_out * group * kPanel));  // [m_out][group][16]
    chunks.each([&](int64_t g) {
      const int64_t p0 = g * group;
      const int np = static_cast<int>(std::min(group, P - p0));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s0 = 0; s0 < S; s0 += kChunk) {
        const int64_t s1 = std::min(S, s0 + kChunk);
        for (int64_t mb = 0; mb < m_out; mb += blocking.rows) {
          const int rows = static_cast<int>(std::min<int64_t>(blocking.rows, m_out - mb));
          run_block(np, rows, wp + p0 * stride, stride, xp + mb * Kp, Kp, s0, s1, acc.data() + mb * group * kPanel,
                    group);
        }
      }
      for (int64_t m = 0; m < m_out; ++m) {
        for (int j = 0; j < np; ++j) {
          const int64_t n0 = (p0 + j) * kPanel;
          const int64_t nv = std::min<int64_t>(kPanel, n_out - n0);
          store_outputs(acc.data() + (m * group + j) * kPanel, nv, nullptr, bp, yp, m, n0);
        }
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(dflash2_dpbf16, m) {
  m.def("dpbf16_linear(Tensor x, Tensor packed, Tensor? bias, int m_out, int n_out, bool bf16_out=False) -> Tensor",
        &dpbf16_linear);
}
