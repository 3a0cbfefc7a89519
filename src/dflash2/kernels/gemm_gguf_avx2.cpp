// dflash2 CPU kernels for a GGUF file's own quantized blocks (models/gguf_blocks.py: Q4_0, Q4_1, Q5_0, Q8_0,
// Q4_K, Q6_K in one integer form), with activations quantized per row and block of 32 inputs; AVX2, and
// AVX512-VNNI where built with it (see below):
//
//   gguf_quantize_rows(x fp32 / bf16 [M, K], block) -> xq int8 [M, K], dx fp32 [M, K/block], bsum int32 [M, K/16]
//       per row m and block g of `block` inputs (32, or 256 for K-quants): amax = max |x|, dx = amax / 127 (fp32
//       division); xq = nearbyint(x / dx) (round half to even; 0 where amax == 0); bsum = sums of xq per 16.
//   gguf_matmul(xq, dx, bsum, packed weights ...) -> y fp32 [M, N]
//       per row m, output n, in order over the scale groups g (group blocks of 32: 1, or 8 for K-quants), from 0:
//         J = sum_{k in g} s[n, k/sub] * (u[n, k] - zero) * xq[m, k]     (int32, exact)
//         y = y + (A[n, g] * dx[m, g]) * float(J)                        (three fp32 roundings, no FMA)
//         with an offset:  T = sum_{b in g} c[n, b] * (sum of xq over b)  (int32, exact; c = 1 when absent)
//                          y = y + (C[n, g] * dx[m, g]) * float(T)
//
// ROW-COUNT INVARIANCE: the integer parts are exact, so their order is free; the fp32 part of each output is the
// fixed sequence above, whatever the number of rows in the call, the micro-kernel or the thread.  Row m of a
// 17-row call is therefore bitwise the row of a 1-row call, and the PyTorch reference (kernels/gguf_linear.py),
// which evaluates the same sequence, gives the same bits (tested).  Build with -ffp-contract=off.
//
// Packed layouts (kernels/gguf_linear.py), P = ceil(N / 8) panels of 8 outputs, B = K / 32 blocks:
//   4-bit codes: uint8 [P, B, 4, 32]: chunk c, byte 4o + i = u[8p+o, 32b+4c+i] | u[8p+o, 32b+16+4c+i] << 4
//     (chunk c holds step c in its low nibbles and step c + 4 in its high ones; step t = inputs 4t .. 4t+3)
//   5- and 6-bit codes: uint8 [P, B, 4 + HB, 32] (HB = bits - 4): the low 4 bits as above, then HB planes of the
//     high bits: step t's sit in plane (t HB) / 8 at bit (t HB) % 8 of byte 4o + i
//   Q8_0: uint8 [P, B, 8, 32]: step t, byte 4o + i = the signed byte of input 32b+4t+i of output 8p+o
//   sub-scales int8 [P, B, H, 8] (H = 32 / sub; absent: 1), c int8 [P, B, 8], A / C fp32 [P, B/group, 8].
// One 32-byte vector holds 4 consecutive inputs of 8 outputs, so _mm256_maddubs_epi16 + _mm256_madd_epi16 leave
// one int32 per output (no horizontal sums); each row broadcasts its 4 activation bytes (one VPBROADCASTD load from
// xq as it is: measured faster on Zen 4 than reading a pre-broadcast copy 8 times its size, 18.2 vs 13.9 tokens/s
// plain with the AVX2 build). A block's weights are unpacked once per group of up to 4 rows (VNNI pairs: 12). The
// zero-point and offset terms are int16 pair dot products of the per-output multipliers with each block's two
// activation half sums, accumulated over a scale group and applied once per group.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

// Built twice (kernels/gguf_linear.py): for AVX2 + FMA, and for AVX512-VNNI (-mavx512vnni -mavx512vl), where the
// integer sums use VPDPBUSD (u8 x s8 products summed by 4 into int32 lanes, one instruction; 256-bit in
// block_integers_dp) and up to 12 rows share an unpacked block of two panels (from gguf_pair_min_rows rows: 4 on
// every CPU, overridable with DFLASH2_GGUF_PAIR_ROWS; fewer rows take the 256-bit kernel, faster there; blocks of
// 32 without sub-scales, Q4_0 / Q4_1 / Q5_0 / Q8_0, from one row: plain_pair_rows). The integers are exact either
// way, so both builds give the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GGUF_VNNI 1
#else
#define GGUF_VNNI 0
#endif
// The third build adds -mamx-tile -mamx-int8 (gemm_gguf_amx.h): from 4 rows (kAmxRows) the block products run on
// tiles.
#if GGUF_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define GGUF_AMX 1
#else
#define GGUF_AMX 0
#endif
#include "chunked_for.h"
#if GGUF_VNNI
#include "tile_store.h"
#endif
#if GGUF_AMX
#include "amx_tiles.h"
#endif
#ifndef DFLASH2_GGUF_NS
#define DFLASH2_GGUF_NS dflash2_ggufkernels
#endif
#define DFLASH2_STR2(x) #x
#define DFLASH2_STR(x) DFLASH2_STR2(x)
#define DFLASH2_GGUF_NS_STR DFLASH2_STR(DFLASH2_GGUF_NS)

namespace {

constexpr int64_t kPanel = 8;

enum Kind { kNib4 = 0, kNib5 = 1, kNib6 = 2, kSigned = 3 };

// Bytes of one packed block (32 inputs of 8 outputs): the nibbles and the high-bit planes, or Q8_0's signed bytes.
constexpr int64_t block_bytes(int kind) { return kind == kSigned ? 256 : 128 + 32 * kind; }

// How many blocks ahead of the unpacking the codes are prefetched, per micro-kernel: each thread streams its panels'
// blocks, and the hardware prefetcher alone leaves the unpacking waiting for memory (samples pile up on each block's
// first load). A forward of the 1.5B target at 1 / 4 / 9 rows (Intel Xeon (AMX, model 207), the kernel without and
// with the prefetch in one process): 256-bit panels (gguf@avx2) 16 ahead 80 / 108 -> 53 / 80 ms (4 ahead: 88 / 122
// -> 73 / 113; 32: 90 / 126 -> 60 / 107); 512-bit pairs (gguf@vnni) 16 ahead 50 / 61 / 77 -> 40 / 45 / 63 ms (8:
// 52 / 63 / 85 -> 42 / 52 / 77; 32: 64 / 78 / 109 -> 56 / 64 / 104); tiles (gguf@amx) 8 ahead (16: 2 rows faster,
// 9 slower).
constexpr int64_t kPanelsAhead = 16;
constexpr int64_t kPairsAhead = 16;
constexpr int64_t kTilesAhead = 8;  // (gemm_gguf_amx.h)

// The cache lines of one block's codes at `codes` into L1 (past the weights' end: a no-op, prefetches never fault).
template <int KIND>
inline void prefetch_block(const uint8_t* codes) {
  for (int64_t off = 0; off < block_bytes(KIND); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(codes + off), _MM_HINT_T0);
}

// Where a product's [M, n_out] outputs go: fp32 (y) or bf16 (yb, rounded to nearest even as c10::BFloat16) rows
// `ld` elements apart, each output with its bias (fp32 [n_out], or null) added before it is stored.
struct Output {
  float* y = nullptr;
  uint16_t* yb = nullptr;
  int64_t ld = 0;
  const float* bias = nullptr;
  bool round_bf16 = false;  // y's values rounded to bf16 (what yb would hold, widened: bf16 outputs handed on as fp32)
};

struct Args {
  const uint8_t* w;
  const float* A;       // [P, G, 8]
  const float* C;       // [P, G, 8] or null
  const int8_t* s;      // [P, B, H, 8] or null
  const int8_t* cm;     // [P, B, 8] or null
  const int8_t* xq;     // [M, K]: the quantized activations
  const float* dx;      // [M, G]: one activation scale per scale group (32 or 256 inputs)
  const int32_t* bs;    // [M, 2B]
  const int32_t* bp;    // [M, B]: each block's two half sums as int16 pairs (bs[2b] low, bs[2b + 1] high)
  int64_t K, B, G, group, N;
  int zshift;           // log2(zero), -1 for zero == 0
  Output out;
  const int16_t* xsum = nullptr;  // [M, B] each block's sum of xq (block_sums), where a kernel asked for it
  const int32_t* zb = nullptr;    // [M, B] -(each block's sum of xq) << the zero point's shift (plain_pair_rows)
};

// Each row's sums of its activation bytes over each block of 32 (|sum| <= 32 * 127: int16), from the half sums
// (Args::bs): the offset term's operand where two blocks share a VPDPWSSD (the AMX build's folded Q4_K, the pairs).
inline std::vector<int16_t> block_sums(const int32_t* half_sums, int64_t M, int64_t B) {
  std::vector<int16_t> sums(static_cast<size_t>(M * B));
  for (int64_t i = 0; i < M * B; ++i) sums[i] = static_cast<int16_t>(half_sums[2 * i] + half_sums[2 * i + 1]);
  return sums;
}

// The codes of panels p and q `ahead` blocks past block b (past the panels' end: those of the next pair, p + 1 and
// q + 1, which this thread reads next within its chunk: paired_panels pairs panel i with panel i + ceil(P / 2), and
// panel p + 1's blocks follow panel p's, so the address runs on into them; past the weights' end a no-op). Until
// 2026-12-07 the address was ((p + 1) * B + (b + ahead) % B): the same for B > ahead, but an integer division per
// block and pair; without it the 1.5B target's 113 gguf layers at 9 rows took 0.95-0.96 of the time (AMD EPYC Zen 4,
// 1 thread, CPU time, medians of 11 / 21 interleaved rounds; 1 and 4 rows within +-1.3%).
// Always inlined: GCC 12 finds a prefetch "const" (it writes no memory), so an out-of-line copy of this function
// counted as const too and its calls were deleted as unused: the pairs ran with no prefetch at all.
template <int KIND>
__attribute__((always_inline)) inline void prefetch_pair(const Args& a, int64_t p, int64_t q, int64_t b,
                                                        int64_t ahead) {
  const uint8_t* w0 = a.w + (p * a.B + b + ahead) * block_bytes(KIND);
  const uint8_t* w1 = a.w + (q * a.B + b + ahead) * block_bytes(KIND);
  for (int64_t off = 0; off < block_bytes(KIND); off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + off), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + off), _MM_HINT_T0);
  }
}

#include "gemm_gguf_panels.h"
#if GGUF_VNNI
#include "gemm_gguf_vnni.h"
#endif

// The micro-kernel instantiation for (kind, sub-scales h, offset kind, rows): Family::fn<MR, KIND, H, OFF> is the
// function, for 1 .. Family::kRows rows (the 256-bit panels of gemm_gguf_panels.h, the 512-bit pairs of
// gemm_gguf_vnni.h, the tiles of gemm_gguf_amx.h).
template <class Family, int KIND, int H, int OFF, int... I>
typename Family::Fn pick_rows(int mr, std::integer_sequence<int, I...>) {
  static constexpr typename Family::Fn table[] = {Family::template fn<I + 1, KIND, H, OFF>...};
  return table[std::clamp(mr, 1, Family::kRows) - 1];
}

template <class Family, int KIND, int H>
typename Family::Fn pick_off(int off, int mr) {
  constexpr auto rows = std::make_integer_sequence<int, Family::kRows>{};
  switch (off) {
    case 2: return pick_rows<Family, KIND, H, 2>(mr, rows);
    case 1: return pick_rows<Family, KIND, H, 1>(mr, rows);
    default: return pick_rows<Family, KIND, H, 0>(mr, rows);
  }
}

template <class Family, int KIND>
typename Family::Fn pick_h(int h, int off, int mr) {
  switch (h) {
    case 2: return pick_off<Family, KIND, 2>(off, mr);
    case 1: return pick_off<Family, KIND, 1>(off, mr);
    default: return pick_off<Family, KIND, 0>(off, mr);
  }
}

template <class Family>
typename Family::Fn pick(int kind, int h, int off, int mr) {
  switch (kind) {
    case kNib4: return pick_h<Family, kNib4>(h, off, mr);
    case kNib5: return pick_h<Family, kNib5>(h, off, mr);
    case kNib6: return pick_h<Family, kNib6>(h, off, mr);
    default: return pick_h<Family, kSigned>(h, off, mr);
  }
}

// Rows per call when `remaining` rows are left: as few calls of <= max_rows rows as possible, evenly sized.
inline int rows_for_call(int64_t remaining, int max_rows) {
  const int64_t calls = (remaining + max_rows - 1) / max_rows;
  return static_cast<int>((remaining + calls - 1) / calls);
}

// 8 consecutive activations as fp32 lanes (bf16 widens exactly).
inline __m256 load_x8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_x8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// A scale group's d = amax / 127 into d_out; true for an all-zero group (amax 0), whose codes and sums are set here.
inline bool all_zero(float amax, int64_t block, int8_t* dst, float* d_out, int32_t* sums) {
  *d_out = amax / 127.0f;
  if (amax != 0.0f) return false;
  std::memset(dst, 0, block);
  std::fill(sums, sums + block / 16, 0);
  return true;
}

// One scale group of `block` inputs (a multiple of 16): amax, d = amax / 127, q = nearbyint(x / d) clamped to
// [-127, 127] (0 where amax == 0), sums of q per 16. Vector division and rounding are the scalar operations lane
// by lane (IEEE division, round half to even), so the result is the reference's bit for bit (max / min keep the
// scalar std::max / std::min operand order, so a NaN input is treated alike).
template <typename T>
void quantize_group(const T* src, int64_t block, int8_t* dst, float* d_out, int32_t* sums) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t j = 0; j < block; j += 8) vmax = _mm256_max_ps(_mm256_and_ps(load_x8(src + j), abs_mask), vmax);
  alignas(32) float lane[8];
  _mm256_store_ps(lane, vmax);
  float amax = 0.0f;
  for (float v : lane) amax = std::max(amax, v);
  if (all_zero(amax, block, dst, d_out, sums)) return;
  const __m256 vd = _mm256_set1_ps(*d_out), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int64_t j = 0; j < block; j += 16) {
    __m256i q[2];
    for (int half = 0; half < 2; ++half) {
      const __m256 r = _mm256_round_ps(_mm256_div_ps(load_x8(src + j + 8 * half), vd),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[half] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));  // NaN -> -127, as the reference
    }
    const __m256i sum8 = _mm256_add_epi32(q[0], q[1]);
    const __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    const __m128i sum2 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
    sums[j / 16] = _mm_cvtsi128_si32(_mm_add_epi32(sum2, _mm_shuffle_epi32(sum2, 0xB1)));
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);  // 16 int16 in order
    const __m128i w8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), w8);
  }
}

#if GGUF_VNNI
// 16 consecutive activations as fp32 lanes (bf16 widens exactly).
inline __m512 load_x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_x16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// quantize_group on 16 lanes (the AVX-512 builds): the same operations lane by lane, so the same bits. The amax's
// lanes only hold |x| (MAXPS keeps its second operand, the running max, where |x| is NaN), and a max is exact, so
// one reduction of 16 lanes gives the 8-lane fold's value. The sums per 16 come from the stored codes: VPDPBUSD
// with bytes of 1 sums 4 codes per int32 lane, two in-lane shuffles add the 4 lanes of each 16, and VPCOMPRESSD
// keeps one lane per 16. One thread, 9 x 13568 bf16 inputs (a 9-row pass's four quantizations of a 1.5B layer) on the
// Intel Xeon (AMX, model 207): 0.59 ns per input on 8 lanes, 0.42 here. (Multiplying by 1 / d where that provably
// rounds like the quotient, dividing elsewhere, measured 0.39: not kept.)
template <typename T>
void quantize_group16(const T* src, int64_t block, int8_t* dst, float* d_out, int32_t* sums) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t j = 0; j < block; j += 16) vmax = _mm512_max_ps(_mm512_and_ps(load_x16(src + j), abs_mask), vmax);
  const float amax = _mm512_reduce_max_ps(vmax);
  if (all_zero(amax, block, dst, d_out, sums)) return;
  const __m512 vd = _mm512_set1_ps(*d_out), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t j = 0; j < block; j += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(load_x16(src + j), vd),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));  // NaN -> -127
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm512_cvtepi32_epi8(q));
  }
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t j = 0; j < block; j += 64) {  // (block is 32 or 256: a last 32 takes half a vector)
    const __mmask64 keep = block - j >= 64 ? ~__mmask64{0} : (__mmask64{1} << (block - j)) - 1;
    const __m512i codes = _mm512_maskz_loadu_epi8(keep, dst + j);
    __m512i s4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, codes);  // sums of 4 codes
    s4 = _mm512_add_epi32(s4, _mm512_shuffle_epi32(s4, _MM_PERM_CDAB));
    s4 = _mm512_add_epi32(s4, _mm512_shuffle_epi32(s4, _MM_PERM_BADC));  // each lane: its 16's sum
    const int64_t n16 = std::min<int64_t>(4, (block - j) / 16);
    _mm_mask_storeu_epi32(sums + j / 16, static_cast<__mmask8>((1u << n16) - 1),
                          _mm512_castsi512_si128(_mm512_maskz_compress_epi32(0x1111, s4)));
  }
}
#endif

template <typename T>
void quantize_all(const T* xp, int64_t M, int64_t G, int64_t block, int8_t* qp, float* dp, int32_t* bp) {
  at::parallel_for(0, M * G, std::max<int64_t>(1, 8192 / block), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
#if GGUF_VNNI
      quantize_group16(xp + i * block, block, qp + i * block, dp + i, bp + i * (block / 16));
#else
      quantize_group(xp + i * block, block, qp + i * block, dp + i, bp + i * (block / 16));
#endif
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_quantize_rows(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous(),
              "gguf_quantize_rows: x must be a contiguous fp32 or bf16 CPU [M, K] tensor");
  TORCH_CHECK(block == 32 || block == 256, "gguf_quantize_rows: block must be 32 or 256, got ", block);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % block == 0, "gguf_quantize_rows: K must be a multiple of ", block, ", got ", K);
  const int64_t G = K / block;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, G}, f32);
  at::Tensor bs = at::empty({M, K / 16}, x.options().dtype(at::kInt));
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dp = dx.data_ptr<float>();
  int32_t* bp = bs.data_ptr<int32_t>();
  if (x.scalar_type() == at::kFloat) {
    quantize_all(x.data_ptr<float>(), M, G, block, qp, dp, bp);
  } else {
    quantize_all(x.data_ptr<c10::BFloat16>(), M, G, block, qp, dp, bp);
  }
  return {xq, dx, bs};
}

const float* opt_float(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() && t->numel() > 0 ? t->data_ptr<float>() : nullptr;
}

const int8_t* opt_int8(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() && t->numel() > 0 ? t->data_ptr<int8_t>() : nullptr;
}

#if GGUF_VNNI
// The outputs of panels p (lanes 0-7) and q (lanes 8-15; q = p: a lone panel, stored once) that exist.
inline __mmask16 pair_keep(const Args& a, int64_t p, int64_t q) {
  const int64_t nv0 = std::min<int64_t>(kPanel, a.N - p * kPanel);
  const int64_t nv1 = q == p ? 0 : std::min<int64_t>(kPanel, a.N - q * kPanel);
  return static_cast<__mmask16>(((1u << nv0) - 1) | (((1u << nv1) - 1) << 8));
}
#endif

#if GGUF_AMX
#include "gemm_gguf_amx.h"
#endif

#if GGUF_VNNI
// From how many rows the panels go in pairs (fewer: the 256-bit micro-kernel). 4, set from Python
// (gguf_linear.pair_min_rows; platform.gguf_pair_min_rows says what was measured where; DFLASH2_GGUF_PAIR_ROWS
// overrides it).
std::atomic<int64_t> pair_min_rows{4};

// Blocks of 32 with one scale each and no sub-scales (Q4_0, Q4_1, Q5_0, Q8_0): plain_pair_rows's kinds, paired
// from one row on (pair_min_rows is the K-quants').
inline bool plain_blocks(int kind, int h, int off, int64_t group) {
  return group == 1 && h == 0 && off < 2 && kind != kNib6;
}

// plain_pair_rows for (kind, offset kind 0 / 1, rows).
template <int KIND>
PlainPairs::Fn pick_plain_kind(int off, int mr) {
  constexpr auto rows = std::make_integer_sequence<int, PlainPairs::kRows>{};
  return off == 1 ? pick_rows<PlainPairs, KIND, 0, 1>(mr, rows) : pick_rows<PlainPairs, KIND, 0, 0>(mr, rows);
}

inline PlainPairs::Fn pick_plain(int kind, int off, int mr) {
  switch (kind) {
    case kNib4: return pick_plain_kind<kNib4>(off, mr);
    case kNib5: return pick_plain_kind<kNib5>(off, mr);
    default: return pick_plain_kind<kSigned>(off, mr);
  }
}

// All rows over panels in pairs (gemm_gguf_vnni.h): panel i with panel i + ceil(P / 2), far apart in memory (an odd
// P's middle panel alone, stored once). Panels i and i + 1 in one vector, the pairing until 2026-12-06, read two
// streams a few KB apart, which streamed at half the speed of one panel on the AMD EPYC Zen 4 (one Q4_K [8960,
// 1536] row from memory, 1 thread: 70 cycles per pair of blocks, 36 for the 256-bit panels one after the other);
// paired far apart: 34, and 9 rows 150 -> 124, a Q6_K [1536, 8960] row 64 -> 52 (this pairing needs no other layout).
void paired_panels(const Args& args, int kind, int h, int off, int64_t M, int64_t P, int64_t grain) {
  const int64_t half = (P + 1) / 2;
  Args a = args;
  std::vector<int16_t> xsum;
  if (off == 2 && a.group % 2 == 0) {  // (Q4_K: the offset term two blocks per VPDPWSSD)
    xsum = block_sums(a.bs, M, a.B);
    a.xsum = xsum.data();
  }
  const bool plain = plain_blocks(kind, h, off, a.group);
  std::vector<int32_t> zb;
  if (plain) {  // each row's block sums (the offset term), and minus them shifted (the zero point's term)
    xsum = block_sums(a.bs, M, a.B);
    a.xsum = xsum.data();
    const int shift = kind == kSigned ? 7 : a.zshift;  // (Q8_0's codes go in as w + 128)
    zb.resize(static_cast<size_t>(M * a.B));
    for (int64_t i = 0; i < M * a.B; ++i) zb[i] = shift < 0 ? 0 : -(int32_t{xsum[i]} * (int32_t{1} << shift));
    a.zb = zb.data();
  }
  chunked_for(half, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i, q = i + half < P ? i + half : i;
      const __mmask16 keep = pair_keep(a, p, q);
      for (int64_t m = 0; m < M;) {
        const int mr = rows_for_call(M - m, Pairs::kRows);
        if (plain) {
          pick_plain(kind, off, mr)(a, p, q, m, keep);
        } else {
          pick<Pairs>(kind, h, off, mr)(a, p, q, m, keep);
        }
        m += mr;
      }
    }
  });
}
#endif

void matmul_into(const at::Tensor& xq, const at::Tensor& dx, const at::Tensor& bsum, const at::Tensor& packed,
                 const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                 const c10::optional<at::Tensor>& sub_scales, const c10::optional<at::Tensor>& offset_mult,
                 int64_t bits, bool is_signed, int64_t zero, int64_t sub, int64_t group, int64_t n_out,
                 const Output& out) {
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2 && xq.is_contiguous(), "gguf_matmul: bad xq");
  const int64_t M = xq.size(0), K = xq.size(1), B = K / 32;
  TORCH_CHECK(group >= 1 && B % group == 0, "gguf_matmul: blocks ", B, " not a multiple of group ", group);
  TORCH_CHECK(K % 32 == 0 && dx.numel() == M * (B / group) && bsum.numel() == M * 2 * B && dx.is_contiguous() &&
                  bsum.is_contiguous() && dx.scalar_type() == at::kFloat && bsum.scalar_type() == at::kInt,
              "gguf_matmul: dx / bsum do not match xq (dx: one scale per group of ", group, " blocks)");
  TORCH_CHECK(is_signed ? bits == 8 : (bits >= 4 && bits <= 6), "gguf_matmul: unsupported codes: ", bits,
              is_signed ? " bits, signed" : " bits");
  const int kind = is_signed ? kSigned : (bits == 4 ? kNib4 : (bits == 5 ? kNib5 : kNib6));
  const int64_t P = packed.size(0), G = B / group;
  const int64_t per_block = block_bytes(kind);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == P * B * per_block,
              "gguf_matmul: packed weight must be a contiguous uint8 [P, B, ", per_block / 32, ", 32] tensor");
  TORCH_CHECK(n_out > (P - 1) * kPanel && n_out <= P * kPanel, "gguf_matmul: ", n_out, " outputs in ", P, " panels");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == P * G * kPanel,
              "gguf_matmul: scale must be fp32 [P, B/group, 8]");
  const float* C = opt_float(offset);
  const int8_t* s = opt_int8(sub_scales);
  const int8_t* cm = opt_int8(offset_mult);
  const int h = s == nullptr ? 0 : static_cast<int>(32 / sub);
  TORCH_CHECK(s == nullptr || ((sub == 16 || sub == 32) && sub_scales->numel() == P * B * h * kPanel),
              "gguf_matmul: sub-scales must be int8 [P, B, 32/sub, 8]");
  TORCH_CHECK(C == nullptr || offset->numel() == P * G * kPanel, "gguf_matmul: offset must be fp32 [P, B/group, 8]");
  TORCH_CHECK(cm == nullptr || (C != nullptr && offset_mult->numel() == P * B * kPanel),
              "gguf_matmul: offset multipliers must be int8 [P, B, 8] and come with an offset");
  TORCH_CHECK(zero == 0 || zero == 8 || zero == 16 || zero == 32, "gguf_matmul: zero point ", zero);
  const int off = C == nullptr ? 0 : (cm == nullptr ? 1 : 2);
  if (M == 0) return;
  // Each block's two half sums (|.| <= 16 * 127) as one int16 pair: the zero-point and offset terms' operand.
  at::Tensor bpair = at::empty({M, B}, bsum.options());
  const int32_t* bs = bsum.data_ptr<int32_t>();
  int32_t* bp = bpair.data_ptr<int32_t>();
  for (int64_t i = 0; i < M * B; ++i)
    bp[i] = static_cast<int32_t>((static_cast<uint32_t>(bs[2 * i]) & 0xFFFFu) |
                                 (static_cast<uint32_t>(bs[2 * i + 1]) << 16));
  Args a{packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), C, s, cm, xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
         bs, bp, K, B, G, group, n_out,
         zero == 0 ? -1 : (zero == 8 ? 3 : (zero == 16 ? 4 : 5)), out};
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, K));
#if GGUF_AMX
  if (tiles_take(kind, h, off) && M >= kAmxRows && group <= kMaxGroup && gguf_amx_granted()) {
    tile_panels(a, kind, h, off, M, P, std::max<int64_t>(1, grain / 2));
    return;
  }
#endif
#if GGUF_VNNI
  // Panels in pairs (16 outputs per vector) from pair_min_rows rows, plain blocks at every row count; fewer take the
  // 256-bit micro-kernel below.
  if ((M >= pair_min_rows.load(std::memory_order_relaxed) || plain_blocks(kind, h, off, group)) &&
      group <= kMaxPairGroup) {
    paired_panels(a, kind, h, off, M, P, std::max<int64_t>(1, grain / 2));
    return;
  }
#endif
  chunked_for(P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nv = std::min<int64_t>(kPanel, n_out - p * kPanel);
      for (int64_t m = 0; m < M;) {
        const int mr = rows_for_call(M - m, Panels::kRows);
        pick<Panels>(kind, h, off, mr)(a, p, m, nv);
        m += mr;
      }
    }
  });
}

// The product as fp32 [M, n_out] (the op: tests, the self-check and the Python reference path call it).
at::Tensor gguf_matmul(const at::Tensor& xq, const at::Tensor& dx, const at::Tensor& bsum, const at::Tensor& packed,
                       const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                       const c10::optional<at::Tensor>& sub_scales, const c10::optional<at::Tensor>& offset_mult,
                       int64_t bits, bool is_signed, int64_t zero, int64_t sub, int64_t group, int64_t n_out) {
  at::Tensor y = at::empty({xq.size(0), n_out}, dx.options());
  matmul_into(xq, dx, bsum, packed, scale, offset, sub_scales, offset_mult, bits, is_signed, zero, sub, group, n_out,
              Output{y.data_ptr<float>(), nullptr, n_out, nullptr});
  return y;
}

// ---- a whole linear layer in one call --------------------------------------------------------------------------
// GgufWeights holds a layer's runs of rows (each one gguf_matmul's weights) and its fp32 bias; gguf_linear(x, w)
// computes what the Python path of CpuLinear.forward computes -- each distinct activation block quantized once, one
// gguf_matmul per run, the runs concatenated, the bias added, the result in x's dtype -- with the same bits: each
// run's micro-kernels add its part of the bias to their fp32 outputs and store them at the run's columns, rounded
// to bf16 for bf16 rows (store_panel / store_pair), so there is no concatenation, bias pass or dtype copy (at 9 rows
// of the 1.5B target those were ~4 ms of an ~80 ms step on the Intel Xeon (AMX)). gguf_layer.h builds on it.

constexpr int64_t kRowBlock = 256;  // rows per kernel call, as packed_linear.ROW_BLOCK (bounds the temporaries)

struct GgufRun {
  at::Tensor packed, scale;
  c10::optional<at::Tensor> offset, sub_scales, offset_mult;
  int64_t bits, zero, sub, group, n_out;
  bool is_signed;
};

struct GgufWeights : torch::CustomClassHolder {
  std::vector<GgufRun> runs;
  c10::optional<at::Tensor> bias;  // fp32 [N]
  int64_t in_features = 0, out_features = 0;

  void add_run(at::Tensor packed, at::Tensor scale, c10::optional<at::Tensor> offset,
               c10::optional<at::Tensor> sub_scales, c10::optional<at::Tensor> offset_mult, int64_t bits,
               bool is_signed, int64_t zero, int64_t sub, int64_t group, int64_t n_out) {
    const int64_t k = packed.size(1) * 32;
    TORCH_CHECK(runs.empty() || k == in_features, "GgufWeights: runs of different input widths");
    in_features = k;
    out_features += n_out;
    runs.push_back({packed, scale, offset, sub_scales, offset_mult, bits, zero, sub, group, n_out, is_signed});
  }

  void set_bias(at::Tensor b) {
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == out_features && b.is_contiguous(),
                "GgufWeights: the bias must be a contiguous fp32 [", out_features, "] tensor");
    bias = b;
  }
};

// Rows x (fp32 / bf16 [M, K]) through every run into y (fp32 / bf16 [M, N], contiguous): each run's outputs
// written in place at its columns with its part of the bias, in y's dtype (fp32 y: rounded to bf16 if round_bf16).
void linear_rows(const at::Tensor& x, const GgufWeights& w, at::Tensor& y, bool round_bf16) {
  std::vector<std::pair<int64_t, std::tuple<at::Tensor, at::Tensor, at::Tensor>>> quantized;  // block -> rows
  const bool bf16 = y.scalar_type() == at::kBFloat16;
  const int64_t ld = y.size(1);
  const float* bias = w.bias.has_value() ? w.bias->data_ptr<float>() : nullptr;
  int64_t col = 0;
  for (const GgufRun& r : w.runs) {
    const int64_t block = 32 * r.group;
    auto hit = std::find_if(quantized.begin(), quantized.end(), [&](const auto& e) { return e.first == block; });
    if (hit == quantized.end()) {
      quantized.emplace_back(block, gguf_quantize_rows(x, block));
      hit = quantized.end() - 1;
    }
    const auto& [xq, dx, bs] = hit->second;
    Output out{nullptr, nullptr, ld, bias != nullptr ? bias + col : nullptr, round_bf16};
    if (bf16) {
      out.yb = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()) + col;
    } else {
      out.y = y.data_ptr<float>() + col;
    }
    matmul_into(xq, dx, bs, r.packed, r.scale, r.offset, r.sub_scales, r.offset_mult, r.bits, r.is_signed, r.zero,
                r.sub, r.group, r.n_out, out);
    col += r.n_out;
  }
}

// x [..., K] -> [..., N] in x's dtype; with float_out and bf16 x, the bf16 outputs widened to fp32 in the same pass
// (what gguf_linear(x, w).float() gives, without the second pass: the logits of the model's head).
at::Tensor gguf_linear(const at::Tensor& x, const c10::intrusive_ptr<GgufWeights>& w, bool float_out = false) {
  TORCH_CHECK(x.device().is_cpu(), "gguf_linear runs on CPU only (got input on ", x.device(), ")");
  TORCH_CHECK(!w->runs.empty(), "gguf_linear: no weights");
  const int64_t k = w->in_features, n = w->out_features;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "gguf_linear: expected last dim ", k, ", got ", x.sizes());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  // bf16 rows are read as they are (their widening is exact) and give bf16 outputs; any other dtype goes through
  // fp32 (outputs fp32, then x's dtype)
  at::Tensor rows = x.reshape({-1, k});
  rows = rows.scalar_type() == at::kBFloat16 ? rows.contiguous() : rows.to(at::kFloat).contiguous();
  const int64_t m = rows.size(0);
  const bool widen = float_out && rows.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({m, n}, rows.options().dtype(widen ? at::kFloat : rows.scalar_type()));
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    at::Tensor part = y.slice(0, r0, std::min(m, r0 + kRowBlock));
    linear_rows(rows.slice(0, r0, std::min(m, r0 + kRowBlock)), *w, part, widen);
  }
  y = y.view(shape);
  if (!widen && y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());  // (fp16 and others: via fp32)
  return float_out ? y.to(at::kFloat) : y;
}

// rows > 0: the panels go in pairs from `rows` rows on; returns the setting (0: a build without the pairs).
int64_t gguf_pair_min_rows(int64_t rows) {
#if GGUF_VNNI
  if (rows > 0) pair_min_rows.store(rows, std::memory_order_relaxed);
  return pair_min_rows.load(std::memory_order_relaxed);
#else
  return 0;
#endif
}

// True where this build multiplies on AMX tiles (the AMX build, the tile state granted by Linux).
bool gguf_tiles() {
#if GGUF_AMX
  return gguf_amx_granted();
#else
  return false;
#endif
}

}  // namespace

#include "gguf_layer.h"

TORCH_LIBRARY(DFLASH2_GGUF_NS, m) {
  m.class_<GgufWeights>("GgufWeights")
      .def(torch::init<>())
      .def("add_run", &GgufWeights::add_run)
      .def("set_bias", &GgufWeights::set_bias);
  m.def("gguf_linear(Tensor x, __torch__.torch.classes." DFLASH2_GGUF_NS_STR ".GgufWeights w, bool float_out=False) "
        "-> Tensor",
        &gguf_linear);
  m.class_<GgufLayer>("GgufLayer").def(torch::init<>()).def("set", &GgufLayer::set);
  m.def("gguf_layer(Tensor x, Tensor cos, Tensor sin, Tensor keys, Tensor values, int length, "
        "__torch__.torch.classes." DFLASH2_GGUF_NS_STR ".GgufLayer layer, Tensor? mask=None) -> Tensor",
        &gguf_layer);
  m.def("gguf_layer_segments(Tensor x, Tensor cos, Tensor sin, Tensor[] keys, Tensor[] values, int[] lengths, "
        "int[] seq, __torch__.torch.classes." DFLASH2_GGUF_NS_STR ".GgufLayer layer) -> Tensor",
        &gguf_layer_segments);
  m.def("gguf_quantize_rows(Tensor x, int block) -> (Tensor, Tensor, Tensor)", &gguf_quantize_rows);
  m.def("gguf_tiles() -> bool", &gguf_tiles);
  m.def("gguf_pair_min_rows(int rows=0) -> int", &gguf_pair_min_rows);
  m.def("gguf_matmul(Tensor xq, Tensor dx, Tensor bsum, Tensor packed, Tensor scale, Tensor? offset, "
        "Tensor? sub_scales, Tensor? offset_mult, int bits, bool is_signed, int zero, int sub, int group, "
        "int n_out) -> Tensor",
        &gguf_matmul);
}
