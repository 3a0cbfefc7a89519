// dflash2 CPU kernel on Intel AMX: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and W in bf16, fp32 accumulation.
//
// Why: on 2 cores the AVX2/AVX-512 kernel (gemm_avx2.cpp) does one fp32 FMA per weight and row, so a call of 17
// rows (verifying 16 drafts) costs about 3x a call of 1 row.  One AMX TDPBF16PS multiplies a 16 x 32 bf16 tile of
// x by a 32 x 16 tile of W (8192 multiply-adds) in about 16 cycles: a 1 KiB weight tile is consumed faster than
// memory delivers it for any row count up to 16, so verification costs what decoding costs.
//
// Packed layout (built by amx.py: pack_weight_amx): bf16 [P, S, 16, 32], P = ceil(N / 16) panels of 16 outputs,
// S = Kp / 32 k steps (Kp = K rounded up to 32, zero padded).  Element [p, s, r, 2c + h] = W[16p + c, 32s + 2r + h]:
// row r of the 1 KiB block (p, s) is the VNNI pair row the B operand of TDPBF16PS wants (16 outputs x 2 k).
//
// Row-count invariance (what makes speculation lossless in bf16): every output y[m, n] is the same sequence of
// TDPBF16PS updates of one accumulator, k step 0, 1, ..., S - 1, whatever the number of rows, the row block it
// falls in and the thread that computes it (each element of a TDPBF16PS result depends only on its own row of
// A and column of B).  The caller pads x with zero rows to a block of M <= 16 rows or a multiple of 16.
//
// Threads: panels are split into groups of 4 (four accumulator tiles share one tile of x), groups are split
// across threads; each thread loads its own tile configuration (tile state is per thread) and releases it.
// More than 16 rows: two row blocks at a time share each weight tile (2 panels x 2 row blocks = four C tiles), so
// the weights are read once per two row blocks instead of once per block (the second read came from L2, or
// further for the down projection's 1.1 MiB groups); the same k order per accumulator, so the same bits.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx_tiles.h"
#include "chunked_for.h"
#include "tile_store.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;      // outputs per panel (columns of a C tile)
constexpr int64_t kStep = 32;       // k per tile step (bf16 columns of an A tile)
constexpr int64_t kRows = 16;       // rows per A / C tile
constexpr int64_t kGroup = 4;       // panels sharing one A tile (C tiles 0..3)
constexpr int64_t kBlock = kPanel * kStep;  // bf16 elements of one packed (panel, k step) block: 1 KiB

// GCC's tile intrinsics are asm statements without a memory clobber: the compiler does not know that a tile load
// reads the buffer just written (it may drop those stores as dead) or that a tile store writes the buffer read next.
// A compiler barrier around them keeps that order.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// Tiles 0..3: C (rows x 16 fp32), 4: A (rows x 32 bf16), 5..7: B (16 pair rows x 32 bf16).
inline void load_config(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Two row blocks of rows0 / rows1 rows: tiles 0, 1: C of block 0 (panels 0, 1); 2, 3: C of block 1; 4, 5: A of
// blocks 0, 1; 6, 7: B.
inline void load_config_pair(int rows0, int rows1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(rows0);
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(rows1);
  cfg.rows[6] = cfg.rows[7] = 16;
  _tile_loadconfig(&cfg);
}

// The tile configuration of this thread, reloaded only when a block of rows has another row count (a last block of
// fewer than 16 rows: each C row depends on its A row only, so a block's row count changes no output bit) or when
// it switches between one and two row blocks.
struct TileRowsConfig {
  int current = -1;
  void ensure(int rows) {
    if (rows != current) load_config(rows);
    current = rows;
  }
  void ensure_pair(int rows0, int rows1) {
    const int code = 1000 + 32 * rows0 + rows1;
    if (code != current) load_config_pair(rows0, rows1);
    current = code;
  }
};

// Rows of the block of rows starting at mb.
inline int block_rows(int64_t m_out, int64_t mb) { return static_cast<int>(std::min<int64_t>(kRows, m_out - mb)); }

// One group of NP panels (NP <= 4) for one block of rows: C_j = sum_s A_s B_{j,s}, stored as fp32 [rows, 16] each.
template <int NP>
inline void group_block(const uint16_t* __restrict__ wg,  // first panel of the group, k step 0
                        int64_t panel_stride,               // elements between consecutive panels
                        const uint16_t* __restrict__ xb,   // first row of the block, k = 0
                        int64_t ldx, int64_t steps, float* __restrict__ out /* [NP][16][16] */) {
  if (NP > 0) _tile_zero(0);
  if (NP > 1) _tile_zero(1);
  if (NP > 2) _tile_zero(2);
  if (NP > 3) _tile_zero(3);
  const int64_t xstride = ldx * 2;  // bytes between rows of x
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, xb + s * kStep, xstride);
    const uint16_t* w = wg + s * kBlock;
    if (NP > 0) { _tile_loadd(5, w, 64); _tile_dpbf16ps(0, 4, 5); }
    if (NP > 1) { _tile_loadd(6, w + panel_stride, 64); _tile_dpbf16ps(1, 4, 6); }
    if (NP > 2) { _tile_loadd(7, w + 2 * panel_stride, 64); _tile_dpbf16ps(2, 4, 7); }
    if (NP > 3) { _tile_loadd(5, w + 3 * panel_stride, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  if (NP > 0) _tile_stored(0, out, 64);
  if (NP > 1) _tile_stored(1, out + kRows * kPanel, 64);
  if (NP > 2) _tile_stored(2, out + 2 * kRows * kPanel, 64);
  if (NP > 3) _tile_stored(3, out + 3 * kRows * kPanel, 64);
  memory_barrier();
}

inline void run_group(int np, const uint16_t* wg, int64_t panel_stride, const uint16_t* xb, int64_t ldx,
                      int64_t steps, float* out) {
  switch (np) {
    case 4: group_block<4>(wg, panel_stride, xb, ldx, steps, out); break;
    case 3: group_block<3>(wg, panel_stride, xb, ldx, steps, out); break;
    case 2: group_block<2>(wg, panel_stride, xb, ldx, steps, out); break;
    default: group_block<1>(wg, panel_stride, xb, ldx, steps, out); break;
  }
}

// NP panels (1 or 2) for two row blocks (load_config_pair): C_bj = sum_s A_bs B_js, each B tile loaded once for
// both blocks; stored as fp32 [rows, 16] at out0 + j * 256 (block 0) and out1 + j * 256 (block 1).
template <int NP>
inline void pair_blocks(const uint16_t* __restrict__ wp, int64_t panel_stride, const uint16_t* __restrict__ xb0,
                        const uint16_t* __restrict__ xb1, int64_t ldx, int64_t steps, float* __restrict__ out0,
                        float* __restrict__ out1) {
  _tile_zero(0);
  _tile_zero(2);
  if (NP > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int64_t xstride = ldx * 2;
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, xb0 + s * kStep, xstride);
    _tile_loadd(5, xb1 + s * kStep, xstride);
    const uint16_t* w = wp + s * kBlock;
    _tile_loadd(6, w, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (NP > 1) {
      _tile_loadd(7, w + panel_stride, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out0, 64);
  _tile_stored(2, out1, 64);
  if (NP > 1) {
    _tile_stored(1, out0 + kRows * kPanel, 64);
    _tile_stored(3, out1 + kRows * kPanel, 64);
  }
  memory_barrier();
}

// int8 weights (weight-only, per-output scale): the int8 blocks are widened to bf16 in the kernel (an int8 q in
// [-127, 127] is exact in bf16) and multiplied like bf16 weights; the scale and the bias are applied after the sum, as
// two roundings.  The widening costs the same for 1 or 16 rows, so int8 verification, like bf16, costs about the
// bytes read.  Widening is a table lookup: the high and low bytes of bf16(|q|) come from two 128-entry byte tables
// (VPERMI2B), the sign bit of q is put back, and the two bytes are interleaved into words.  The interleave works
// within 128-bit lanes, so pack_int8_amx stores each 64-byte chunk in the order that makes the words come out in
// order (see kInt8Order in amx.py).
struct Bf16ByteTables {
  __m512i hi0, hi1, lo0, lo1;  // bytes of bf16(i) for i = 0..63 (…0) and 64..127 (…1)
};

inline Bf16ByteTables make_tables() {
  alignas(64) uint8_t hi[128], lo[128];
  for (int i = 0; i < 128; ++i) {
    const float f = static_cast<float>(i);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    hi[i] = static_cast<uint8_t>(bits >> 24);
    lo[i] = static_cast<uint8_t>(bits >> 16);  // exact: an integer below 128 has at most 7 significant bits
  }
  return {_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo), _mm512_load_si512(lo + 64)};
}

inline void widen_int8(const int8_t* __restrict__ q, uint16_t* __restrict__ out, int64_t n,
                       const Bf16ByteTables& t) {  // n % 64 == 0
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < n; i += 64) {
    const __m512i v = _mm512_loadu_si512(q + i);
    const __m512i mag = _mm512_abs_epi8(v);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, mag, t.hi1), v, sign, 0xF8);  // a|(b&c)
    const __m512i lo = _mm512_permutex2var_epi8(t.lo0, mag, t.lo1);
    _mm512_storeu_si512(out + i, _mm512_unpacklo_epi8(lo, hi));
    _mm512_storeu_si512(out + i + 32, _mm512_unpackhi_epi8(lo, hi));
  }
}

// group_block for int8 weights: each k step's blocks are widened into a 4 KiB buffer (L1) right before use.
template <int NP>
inline void group_block_int8(const int8_t* __restrict__ qg, int64_t panel_stride, const uint16_t* __restrict__ xb,
                             int64_t ldx, int64_t steps, uint16_t* __restrict__ buf, float* __restrict__ out,
                             const Bf16ByteTables& t) {
  if (NP > 0) _tile_zero(0);
  if (NP > 1) _tile_zero(1);
  if (NP > 2) _tile_zero(2);
  if (NP > 3) _tile_zero(3);
  const int64_t xstride = ldx * 2;
  for (int64_t s = 0; s < steps; ++s) {
    for (int j = 0; j < NP; ++j) widen_int8(qg + j * panel_stride + s * kBlock, buf + j * kBlock, kBlock, t);
    memory_barrier();
    _tile_loadd(4, xb + s * kStep, xstride);
    if (NP > 0) { _tile_loadd(5, buf, 64); _tile_dpbf16ps(0, 4, 5); }
    if (NP > 1) { _tile_loadd(6, buf + kBlock, 64); _tile_dpbf16ps(1, 4, 6); }
    if (NP > 2) { _tile_loadd(7, buf + 2 * kBlock, 64); _tile_dpbf16ps(2, 4, 7); }
    if (NP > 3) { _tile_loadd(5, buf + 3 * kBlock, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  if (NP > 0) _tile_stored(0, out, 64);
  if (NP > 1) _tile_stored(1, out + kRows * kPanel, 64);
  if (NP > 2) _tile_stored(2, out + 2 * kRows * kPanel, 64);
  if (NP > 3) _tile_stored(3, out + 3 * kRows * kPanel, 64);
  memory_barrier();
}

inline void run_group_int8_streamed(int np, const int8_t* qg, int64_t panel_stride, const uint16_t* xb, int64_t ldx,
                                    int64_t steps, uint16_t* buf, float* out, const Bf16ByteTables& t) {
  switch (np) {
    case 4: group_block_int8<4>(qg, panel_stride, xb, ldx, steps, buf, out, t); break;
    case 3: group_block_int8<3>(qg, panel_stride, xb, ldx, steps, buf, out, t); break;
    case 2: group_block_int8<2>(qg, panel_stride, xb, ldx, steps, buf, out, t); break;
    default: group_block_int8<1>(qg, panel_stride, xb, ldx, steps, buf, out, t); break;
  }
}

// Ask Linux for the AMX tile data state (off by default for a process).  True when AMX can be used.
bool amx_init() { return request_amx_tiles(); }

// One call's shapes, checked: x bf16 [Mp, Kp] (rows m_out <= Mp read; Kp zero padded to the weight's k steps),
// weight [P, S, 16, 32] (bf16, or int8 for amx_int8_linear), y fp32 [m_out, n_out].
struct Call {
  int64_t Mp, Kp, P, S, m_out, n_out;
  const float* bias;  // fp32 [n_out] or nullptr
  int64_t panel_stride() const { return S * kBlock; }  // elements between consecutive panels
  int64_t groups() const { return (P + kGroup - 1) / kGroup; }
};

Call check_call(const char* name, const at::Tensor& x, const at::Tensor& w, at::ScalarType w_type,
                const c10::optional<at::Tensor>& bias, int64_t m_out, int64_t n_out) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), name,
              ": x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(w.scalar_type() == w_type && w.dim() == 4 && w.size(2) == kPanel && w.size(3) == kStep &&
                  w.is_contiguous(),
              name, ": the weight must be a contiguous ", c10::toString(w_type), " [P, S, 16, 32] tensor");
  Call c{x.size(0), x.size(1), w.size(0), w.size(1), m_out, n_out, nullptr};
  TORCH_CHECK(c.Kp == c.S * kStep, name, ": x has ", c.Kp, " columns, the weight ", c.S * kStep);
  TORCH_CHECK(m_out <= c.Mp, name, ": m_out ", m_out, " > rows ", c.Mp);
  TORCH_CHECK(n_out > (c.P - 1) * kPanel && n_out <= c.P * kPanel, name, ": out_features ", n_out,
              " does not match ", c.P, " panels");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out, name,
                ": bias must be a contiguous fp32 [N] tensor");
    c.bias = bias->data_ptr<float>();
  }
  return c;
}

// The C tiles of one group and row block (out: [np][16][16]) into y: y = out (* scale) (+ bias), each a rounding,
// as fp32 or bf16 (tile_store.h).
inline void store_group(const float* out, int np, int64_t p0, int64_t mb, const Call& c, const float* scale,
                        const RowsOut& y) {
  const int64_t mv = block_rows(c.m_out, mb);
  for (int j = 0; j < np; ++j) {
    const int64_t n0 = (p0 + j) * kPanel;
    const int64_t nv = std::min<int64_t>(kPanel, c.n_out - n0);
    for (int64_t r = 0; r < mv; ++r) store_outputs(out + (j * kRows + r) * kPanel, nv, scale, c.bias, y, mb + r, n0);
  }
}

// Every row block of one group of np panels (weights at wg, consecutive panels `stride` apart) into y: two row blocks
// at a time while two remain (pair_blocks, two panels per pass), a last lone block as run_group. out: [2][4][16][16].
inline void group_rows(TileRowsConfig& config, int np, int64_t p0, const uint16_t* wg, const uint16_t* xp,
                       const Call& c, const float* scale, const RowsOut& y, float* out) {
  const int64_t stride = c.panel_stride();
  float* out1 = out + kGroup * kRows * kPanel;
  int64_t mb = 0;
  for (; mb + kRows < c.m_out; mb += 2 * kRows) {
    config.ensure_pair(kRows, block_rows(c.m_out, mb + kRows));
    const uint16_t* x0 = xp + mb * c.Kp;
    const uint16_t* x1 = x0 + kRows * c.Kp;
    for (int j = 0; j < np; j += 2) {
      const int64_t at = j * kRows * kPanel;
      if (np - j > 1) {
        pair_blocks<2>(wg + j * stride, stride, x0, x1, c.Kp, c.S, out + at, out1 + at);
      } else {
        pair_blocks<1>(wg + j * stride, stride, x0, x1, c.Kp, c.S, out + at, out1 + at);
      }
    }
    store_group(out, np, p0, mb, c, scale, y);
    store_group(out1, np, p0, mb + kRows, c, scale, y);
  }
  if (mb < c.m_out) {
    config.ensure(block_rows(c.m_out, mb));
    run_group(np, wg, stride, xp + mb * c.Kp, c.Kp, c.S, out);
    store_group(out, np, p0, mb, c, scale, y);
  }
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t m_out, int64_t n_out, bool bf16_out) {
  const Call c = check_call("amx_linear", x, packed, at::kBFloat16, bias, m_out, n_out);
  const at::Tensor y = at::empty({m_out, n_out}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const RowsOut yp = rows_out(y);  // fp32 or bf16 outputs (tile_store.h)
  if (m_out == 0 || n_out == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t stride = c.panel_stride();
  chunked_threads(c.groups(), 1, [&](Chunks& chunks) {  // (groups in chunks, each a contiguous stream)
    TileRowsConfig config;
    alignas(64) float out[2 * kGroup * kRows * kPanel];
    chunks.each([&](int64_t g) {
      const int64_t p0 = g * kGroup;
      const int np = static_cast<int>(std::min(kGroup, c.P - p0));
      group_rows(config, np, p0, wp + p0 * stride, xp, c, nullptr, yp, out);
    });
    _tile_release();
  });
  return y;
}

// int8: q int8 [P, S, 16, 32] (pack_int8_amx's chunk order), scale fp32 [N]; otherwise as amx_linear.
at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, int64_t m_out, int64_t n_out, bool bf16_out) {
  const Call c = check_call("amx_int8_linear", x, q, at::kChar, bias, m_out, n_out);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n_out,
              "amx_int8_linear: scale must be a contiguous fp32 [N] tensor");
  const at::Tensor y = at::empty({m_out, n_out}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const RowsOut yp = rows_out(y);  // fp32 or bf16 outputs (tile_store.h)
  if (m_out == 0 || n_out == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t stride = c.panel_stride();
  const Bf16ByteTables tables = make_tables();
  chunked_threads(c.groups(), 1, [&](Chunks& chunks) {
    TileRowsConfig config;
    alignas(64) float out[2 * kGroup * kRows * kPanel];
    // Decoding and verification (one row block) widen one k step at a time (4 KiB, in L1); more rows widen the
    // group's weights once: 4 panels x K x 16 x 2 B (1.1 MiB at K = 8960: stays in L2).
    const int64_t wide_elems = m_out <= kRows ? kGroup * kBlock : kGroup * stride;
    auto* wide = static_cast<uint16_t*>(std::aligned_alloc(64, wide_elems * sizeof(uint16_t)));
    TORCH_CHECK(wide != nullptr, "amx_int8_linear: out of memory");
    chunks.each([&](int64_t g) {
      const int64_t p0 = g * kGroup;
      const int np = static_cast<int>(std::min(kGroup, c.P - p0));
      const int8_t* qg = qp + p0 * stride;
      if (m_out <= kRows) {
        config.ensure(block_rows(m_out, 0));
        run_group_int8_streamed(np, qg, stride, xp, c.Kp, c.S, wide, out, tables);
        store_group(out, np, p0, 0, c, sp, yp);
        return;
      }
      widen_int8(qg, wide, np * stride, tables);
      memory_barrier();
      group_rows(config, np, p0, wide, xp, c, sp, yp, out);
    });
    std::free(wide);
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(dflash2_amx, m) {
  m.def("amx_int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias, int m_out, int n_out, "
        "bool bf16_out=False) -> Tensor", &amx_int8_linear);
  m.def("amx_init() -> bool", &amx_init);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int m_out, int n_out, bool bf16_out=False) -> Tensor",
        &amx_linear);
}
