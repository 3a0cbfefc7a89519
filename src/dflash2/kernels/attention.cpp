// dflash2 CPU kernel: row-invariant scaled dot-product attention with grouped-query heads.
//
// out[b, h, t, :] = sum_j p_j v_j / sum_j p_j,  p_j = 2^(s_j - max s),  s_j = (q[b, h, t] . k_j) * scale * log2(e)
// where j runs over the keys that query row (b, t) may see, IN SLOT ORDER: slot s of batch row b is visible when
// mask[b, t, s] is true (no mask: all) and, for a causal call, s <= S - T + t.
//
// Invariance by construction: the arithmetic for one output row depends only on q[b, h, t] and the ordered list of
// its visible keys/values -- not on T, S, B, the masked-out slots, the slot numbers themselves, the other heads or
// rows, or the thread count:
//   * visible keys are compacted into a list first; every reduction over keys is indexed by the position j in that
//     list (never by the slot): the max is exact, the sum of p keeps 8 lanes (j mod 8) added in order and folded by
//     one fixed tree, and each output element is one in-order fp32 FMA chain over j;
//   * each dot product over Dh is one fixed chain of 8-float FMAs (chunk c = 0, 1, ...) folded by the same tree;
//   * 2^x is one vectorised polynomial evaluated lane by lane (the tail of a row is padded, never scalar code);
//   * work items are whole (b, kv head, t) rows; threads only choose which items they run.
// Two rows with the same query and the same visible key sequence therefore give bitwise the same output: a query
// attended alone (decoding), in a verification block, in a tree (its ancestors), in a padded ragged batch or in a
// chunked prefill.  fp32 accumulation throughout; fp32, bf16 or fp16 inputs (q, k and v of one dtype); fp32 output.
// Built for AVX2 + FMA (+ F16C, which every AVX2 CPU has): every x86-64 machine that runs the packed linear kernel
// runs this one with the same bits. Where the CPU has AVX-512 the same chains run two per 512-bit vector (the
// 16-lane functions below, chosen at run time): the same bits at about twice the throughput.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include "chunked_for.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 8;
constexpr int kMaxGroup = 8;  // query heads handled per pass over a kv head's keys

// ---- loads: 8 elements as fp32 ----
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float load1(const float* p) { return *p; }
inline float load1(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline float load1(const c10::Half* p) { return static_cast<float>(*p); }

// One fixed folding tree for 8 lanes: (l0+l4, l1+l5, l2+l6, l3+l7) -> (.. + ..) -> one.
inline float fold8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 2^x lane by lane for x <= 0 (Cephes exp2f polynomial, ~2 ulp); x < -126 gives exactly 0.
inline __m256 exp2_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);  // [-0.5, 0.5]
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

struct Strides {
  int64_t b, h, t;  // element strides of batch, head, row (query) or slot (keys / values); the last dim is contiguous
};

struct MaskStrides {
  int64_t b, t, s;  // element strides of the mask's batch row, query row and slot (0 where broadcast)
};

// Scores of GB query heads against every listed key: s[g * ld + j] = fold8(chain over c of q[g, c] * k_j[c]) * alpha.
template <int GB, typename T>
void scores(const float* q, int64_t dh, const T* k, int64_t k_slot_stride, const int32_t* idx, int64_t n,
            float alpha, float* s, int64_t ld) {
  const int64_t chunks = dh / kLanes;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {  // two keys per step: independent chains hide the FMA latency
    const T* k0 = k + idx[j] * k_slot_stride;
    const T* k1 = k + idx[j + 1] * k_slot_stride;
    __m256 a0[GB], a1[GB];
    for (int g = 0; g < GB; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256 x0 = load8(k0 + c * kLanes), x1 = load8(k1 + c * kLanes);
      for (int g = 0; g < GB; ++g) {
        const __m256 qc = _mm256_loadu_ps(q + g * dh + c * kLanes);
        a0[g] = _mm256_fmadd_ps(qc, x0, a0[g]);
        a1[g] = _mm256_fmadd_ps(qc, x1, a1[g]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      s[g * ld + j] = fold8(a0[g]) * alpha;
      s[g * ld + j + 1] = fold8(a1[g]) * alpha;
    }
  }
  for (; j < n; ++j) {  // same chain as above, one key
    const T* k0 = k + idx[j] * k_slot_stride;
    __m256 a0[GB];
    for (int g = 0; g < GB; ++g) a0[g] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256 x0 = load8(k0 + c * kLanes);
      for (int g = 0; g < GB; ++g) a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dh + c * kLanes), x0, a0[g]);
    }
    for (int g = 0; g < GB; ++g) s[g * ld + j] = fold8(a0[g]) * alpha;
  }
}

// max_j s[j] over j < n (n >= 1). The max is exact, so its order is free: four 8-lane chains (a scalar chain of
// dependent max operations cost ~4 cycles per score, about a quarter of a 9-row verification's attention at 600
// slots), then the lanes, then the tail. With a NaN score the output is NaN whatever this returns.
inline float max_of(const float* s, int64_t n) {
  float m = s[0];
  int64_t j = 0;
  if (n >= 32) {
    __m256 m0 = _mm256_loadu_ps(s), m1 = _mm256_loadu_ps(s + 8), m2 = _mm256_loadu_ps(s + 16),
           m3 = _mm256_loadu_ps(s + 24);
    for (j = 32; j + 32 <= n; j += 32) {
      m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + j));
      m1 = _mm256_max_ps(m1, _mm256_loadu_ps(s + j + 8));
      m2 = _mm256_max_ps(m2, _mm256_loadu_ps(s + j + 16));
      m3 = _mm256_max_ps(m3, _mm256_loadu_ps(s + j + 24));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (float v : lanes) m = std::max(m, v);
  }
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// Scores -> p = 2^(s - max) in place (pad lanes up to ld hold -inf -> 0); returns sum p (8 lanes j mod 8, folded).
inline float softmax_weights(float* s, int64_t n, int64_t ld) {
  const float m = max_of(s, n);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < ld; j += kLanes) {
    const __m256 p = exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  return fold8(sum);
}

// out[g, d] = (chain over j of p[g, j] * v_j[d]) / sum[g], for DB * 8 dims at a time.
template <int GB, int DB, typename T>
void weighted_values(const float* p, int64_t ld, const float* sums, const T* v, int64_t v_slot_stride,
                     const int32_t* idx, int64_t n, int64_t dh, float* out, int64_t out_head_stride) {
  for (int64_t d0 = 0; d0 < dh; d0 += DB * kLanes) {
    __m256 acc[GB][DB];
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < DB; ++u) acc[g][u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const T* vj = v + idx[j] * v_slot_stride + d0;
      __m256 x[DB];
      for (int u = 0; u < DB; ++u) x[u] = load8(vj + u * kLanes);
      for (int g = 0; g < GB; ++g) {
        const __m256 pj = _mm256_broadcast_ss(p + g * ld + j);
        for (int u = 0; u < DB; ++u) acc[g][u] = _mm256_fmadd_ps(pj, x[u], acc[g][u]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      const __m256 denom = _mm256_set1_ps(sums[g]);
      for (int u = 0; u < DB; ++u)
        _mm256_storeu_ps(out + g * out_head_stride + d0 + u * kLanes, _mm256_div_ps(acc[g][u], denom));
    }
  }
}

template <int GB, typename T>
void head_group(const float* q, int64_t dh, const T* k, int64_t ks, const T* v, int64_t vs, const int32_t* idx,
                int64_t n, float alpha, float* s, int64_t ld, float* out, int64_t out_head_stride) {
  scores<GB>(q, dh, k, ks, idx, n, alpha, s, ld);
  float sums[GB];
  for (int g = 0; g < GB; ++g) {
    for (int64_t j = n; j < ld; ++j) s[g * ld + j] = -INFINITY;
    sums[g] = softmax_weights(s + g * ld, n, ld);
  }
  // The dims per pass change the register use only: each output element is the same chain either way.
  if (dh % 16 == 0 && GB <= 6) {
    weighted_values<GB, 2>(s, ld, sums, v, vs, idx, n, dh, out, out_head_stride);
  } else {
    weighted_values<GB, 1>(s, ld, sums, v, vs, idx, n, dh, out, out_head_stride);
  }
}

// ---- the same arithmetic on 16 lanes (AVX-512, where the CPU has it) ------------------------------------------
// Every value above is a chain of lane-wise operations on 8 lanes; these functions run the same chains with two
// chains per 512-bit vector, so each output is bitwise what the 8-lane functions give (tested: lanes=8 vs 16):
//   * scores: keys j and j + 1 in the two halves (chunk c of each key in one vector), q's chunk broadcast to both;
//     each half folded by fold8's tree (l_i + l_(i+4), then lanes 0 + 2 / 1 + 3, then 0 + 1);
//   * softmax weights: 2^x on 16 lanes, the sum kept on 8 lanes (j mod 8), the two halves added in j order;
//   * weighted values: 16 dims per vector, each element the same in-order FMA chain over j.
#define DFLASH2_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}

// 8 elements of a and 8 of b as fp32 lanes 0-7 and 8-15.
DFLASH2_AVX512 inline __m512 load_two8(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
DFLASH2_AVX512 inline __m256i two128(const void* a, const void* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}
DFLASH2_AVX512 inline __m512 load_two8(const c10::BFloat16* a, const c10::BFloat16* b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(two128(a, b)), 16));
}
DFLASH2_AVX512 inline __m512 load_two8(const c10::Half* a, const c10::Half* b) {
  return _mm512_cvtph_ps(two128(a, b));
}
// 16 consecutive elements as fp32: load_two8(p, p + 8) in one 256-bit load (no lane insert).
DFLASH2_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
DFLASH2_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
DFLASH2_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// fold8 on both halves at once: lane 0 holds the fold of lanes 0-7, lane 8 the fold of lanes 8-15.
DFLASH2_AVX512 inline __m512 fold8_halves(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));  // l_i + l_(i+4)
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));       // (0 + 2), (1 + 3)
  return _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));    // 0 + 1
}

// The scores of two keys from their chains' accumulator (lanes 0-7, 8-15): out[0], out[1] = fold8 * alpha.
DFLASH2_AVX512 inline void put_pair(__m512 acc, float alpha, float* out) {
  const __m512 f = fold8_halves(acc);
  out[0] = _mm512_cvtss_f32(f) * alpha;
  out[1] = _mm_cvtss_f32(_mm512_extractf32x4_ps(f, 2)) * alpha;
}

// The scores of four keys from two pairs' accumulators (a: keys 0, 1; b: keys 2, 3), reduced side by side with
// fold8's tree: out[0..3] = fold8 * alpha. The 128-bit quarters of a and b are regrouped so that quarter k holds
// key k's lanes 0-3 (P) and 4-7 (Q); then P + Q (l_i + l_(i+4)), lanes (0 + 2), (1 + 3), then 0 + 1: each key's
// sum in lane 4k, the same additions in the same order as put_pair's, for a third of its operations.
DFLASH2_AVX512 inline void put_quad(__m512 a, __m512 b, float alpha, float* out) {
  const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 r = _mm512_add_ps(u, _mm512_permute_ps(u, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512 scaled = _mm512_mul_ps(r, _mm512_set1_ps(alpha));
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, scaled)));
}

template <int GB, typename T>
DFLASH2_AVX512 void scores16(const float* q, int64_t dh, const T* k, int64_t k_slot_stride, const int32_t* idx,
                             int64_t n, float alpha, float* s, int64_t ld) {
  const int64_t chunks = dh / kLanes;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {  // two pairs of keys per step: each q broadcast serves two multiply-adds
    const T* k0 = k + idx[j] * k_slot_stride;
    const T* k1 = k + idx[j + 1] * k_slot_stride;
    const T* k2 = k + idx[j + 2] * k_slot_stride;
    const T* k3 = k + idx[j + 3] * k_slot_stride;
    __m512 a[GB], b[GB];
    for (int g = 0; g < GB; ++g) a[g] = b[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 x = load_two8(k0 + c * kLanes, k1 + c * kLanes);
      const __m512 y = load_two8(k2 + c * kLanes, k3 + c * kLanes);
      for (int g = 0; g < GB; ++g) {
        const __m512 qc = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * dh + c * kLanes));
        a[g] = _mm512_fmadd_ps(qc, x, a[g]);
        b[g] = _mm512_fmadd_ps(qc, y, b[g]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      put_quad(a[g], b[g], alpha, s + g * ld + j);
    }
  }
  for (; j + 2 <= n; j += 2) {
    const T* k0 = k + idx[j] * k_slot_stride;
    const T* k1 = k + idx[j + 1] * k_slot_stride;
    __m512 a[GB];
    for (int g = 0; g < GB; ++g) a[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 x = load_two8(k0 + c * kLanes, k1 + c * kLanes);
      for (int g = 0; g < GB; ++g)
        a[g] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * dh + c * kLanes)), x, a[g]);
    }
    for (int g = 0; g < GB; ++g) put_pair(a[g], alpha, s + g * ld + j);
  }
  if (j < n) scores<GB>(q, dh, k, k_slot_stride, idx + j, n - j, alpha, s + j, ld);  // a last key: 8 lanes
}

// 2^x for x <= 0 on 16 lanes (exp2_nonpositive's operations).
DFLASH2_AVX512 inline __m512 exp2_nonpositive16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-126.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

DFLASH2_AVX512 inline float softmax_weights16(float* s, int64_t n, int64_t ld) {
  const float m = max_of(s, n);
  const __m512 mv = _mm512_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 * kLanes <= ld; j += 2 * kLanes) {
    const __m512 p = exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(p));             // lanes j .. j + 7
    sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps(p, 1));          // then j + 8 .. j + 15
  }
  if (j < ld) {  // a last 8 (ld is a multiple of 8)
    const __m256 p = exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm512_castps512_ps256(mv)));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  return fold8(sum);
}

template <int GB, int DB, typename T>
DFLASH2_AVX512 void weighted_values16(const float* p, int64_t ld, const float* sums, const T* v, int64_t v_slot_stride,
                                      const int32_t* idx, int64_t n, int64_t dh, float* out, int64_t out_head_stride) {
  for (int64_t d0 = 0; d0 < dh; d0 += DB * 2 * kLanes) {
    __m512 acc[GB][DB];
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < DB; ++u) acc[g][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const T* vj = v + idx[j] * v_slot_stride + d0;
      __m512 x[DB];
      for (int u = 0; u < DB; ++u) x[u] = load16(vj + u * 2 * kLanes);
      for (int g = 0; g < GB; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * ld + j]);
        for (int u = 0; u < DB; ++u) acc[g][u] = _mm512_fmadd_ps(pj, x[u], acc[g][u]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      const __m512 denom = _mm512_set1_ps(sums[g]);
      for (int u = 0; u < DB; ++u)
        _mm512_storeu_ps(out + g * out_head_stride + d0 + u * 2 * kLanes, _mm512_div_ps(acc[g][u], denom));
    }
  }
}

template <int GB, typename T>
DFLASH2_AVX512 void head_group16(const float* q, int64_t dh, const T* k, int64_t ks, const T* v, int64_t vs,
                                 const int32_t* idx, int64_t n, float alpha, float* s, int64_t ld, float* out,
                                 int64_t out_head_stride) {
  scores16<GB>(q, dh, k, ks, idx, n, alpha, s, ld);
  float sums[GB];
  for (int g = 0; g < GB; ++g) {
    for (int64_t j = n; j < ld; ++j) s[g * ld + j] = -INFINITY;
    sums[g] = softmax_weights16(s + g * ld, n, ld);
  }
  if (dh % (8 * kLanes) == 0 && GB <= 6) {  // (the dims per pass change the register use only)
    weighted_values16<GB, 4>(s, ld, sums, v, vs, idx, n, dh, out, out_head_stride);
  } else if (dh % (4 * kLanes) == 0) {
    weighted_values16<GB, 2>(s, ld, sums, v, vs, idx, n, dh, out, out_head_stride);
  } else {
    weighted_values16<GB, 1>(s, ld, sums, v, vs, idx, n, dh, out, out_head_stride);
  }
}

// ---- bf16 dot products (AVX512-BF16, bf16 q / k / v) -------------------------------------------------------
// Where the CPU has AVX512-BF16 and q, k, v are bf16 (a bf16 model's attention), the products run on VDPBF16PS: each
// instruction adds two bf16 products per fp32 lane (exact products, fp32 sums), twice the multiply-adds of an fp32
// FMA per instruction. Per query row, still one fixed order over its list of visible keys (so a row's result does
// not depend on the other rows: decoding, verification and trees agree bit for bit), but another order than the
// fp32 chains above (so other bits than the AVX2 / AVX-512 fp32 paths; the bf16 kernel is chosen per CPU, as the
// bf16 linear layers' VDPBF16PS kernel is):
//   * scores: keys j and j + 1 in the two halves of a vector, 16 dims per VDPBF16PS (lane i of a half: dims 2i,
//     2i + 1 of the chunk), chunks in order, each half folded by fold8's tree, times alpha;
//   * the softmax weights p_j = 2^(s_j - max) as above, then rounded to bf16 (to nearest even; they are in (0, 1],
//     normal or exactly 0); the denominator is the sum of the rounded weights (8 lanes j mod 8, folded by fold8);
//   * values: keys j, j + 1 in the two bf16 halves of each lane (a last odd key with weight 0), 32 dims per pair
//     of VDPBF16PS, key pairs in order; then divided by the denominator.
// The weights' rounding to bf16 is the one precision this path gives up against the fp32 chains (relative 2^-9 per
// weight, the same as the bf16 output's own rounding); the tests compare it with SDPA in fp64.
#define DFLASH2_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool has_avx512bf16() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
}

// 16 bf16 of a and 16 of b in the two halves (keys j, j + 1 of a score step).
DFLASH2_AVX512BF16 inline __m512bh two16(const c10::BFloat16* a, const c10::BFloat16* b) {
  return (__m512bh)_mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// 16 bf16 of q broadcast to both halves.
DFLASH2_AVX512BF16 inline __m512bh both16(const c10::BFloat16* q) {
  return (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}

template <int GB>
DFLASH2_AVX512BF16 void scores_bf16(const c10::BFloat16* q, int64_t dh, const c10::BFloat16* k, int64_t ks,
                                    const int32_t* idx, int64_t n, float alpha, float* s, int64_t ld) {
  const int64_t chunks = dh / 16;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {  // two pairs of keys per step: each q chunk serves two products
    const c10::BFloat16* k0 = k + idx[j] * ks;
    const c10::BFloat16* k1 = k + idx[j + 1] * ks;
    const c10::BFloat16* k2 = k + idx[j + 2] * ks;
    const c10::BFloat16* k3 = k + idx[j + 3] * ks;
    __m512 a[GB], b[GB];
    for (int g = 0; g < GB; ++g) a[g] = b[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh x = two16(k0 + 16 * c, k1 + 16 * c), y = two16(k2 + 16 * c, k3 + 16 * c);
      for (int g = 0; g < GB; ++g) {
        const __m512bh qc = both16(q + g * dh + 16 * c);
        a[g] = _mm512_dpbf16_ps(a[g], qc, x);
        b[g] = _mm512_dpbf16_ps(b[g], qc, y);
      }
    }
    for (int g = 0; g < GB; ++g) put_quad(a[g], b[g], alpha, s + g * ld + j);
  }
  for (; j < n; j += 2) {  // a last pair, or a last key (in both halves; the second score dropped)
    const c10::BFloat16* k0 = k + idx[j] * ks;
    const c10::BFloat16* k1 = k + idx[j + 1 < n ? j + 1 : j] * ks;
    __m512 a[GB];
    for (int g = 0; g < GB; ++g) a[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh x = two16(k0 + 16 * c, k1 + 16 * c);
      for (int g = 0; g < GB; ++g) a[g] = _mm512_dpbf16_ps(a[g], both16(q + g * dh + 16 * c), x);
    }
    for (int g = 0; g < GB; ++g) {
      float two[2];
      put_pair(a[g], alpha, two);
      s[g * ld + j] = two[0];
      if (j + 1 < n) s[g * ld + j + 1] = two[1];
    }
  }
}

// Scores -> weights rounded to bf16 (w[j], pad lanes up to ld + 2 hold 0); returns the sum of the rounded weights.
DFLASH2_AVX512BF16 inline float softmax_weights_bf16(float* s, int64_t n, int64_t ld, uint16_t* w) {
  const float m = max_of(s, n);
  const __m512 mv = _mm512_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < ld; j += 2 * kLanes) {  // (ld is a multiple of 16 here)
    const __m512 p = exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), r);
    const __m512 pr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(pr));     // lanes j .. j + 7
    sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps(pr, 1));  // then j + 8 .. j + 15
  }
  w[ld] = w[ld + 1] = 0;
  return fold8(sum);
}

// The 32 dims of an accumulator pair back in order: lo holds dims 8L .. 8L + 3 of each 128-bit lane L, hi 8L + 4 ..
// 8L + 7 (what VPUNPCKLWD / VPUNPCKHWD made of the two keys' rows).
DFLASH2_AVX512BF16 inline void store_dims32(__m512 lo, __m512 hi, __m512 denom, float* out) {
  const __m512 t0 = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));  // lo.L0 lo.L1 hi.L0 hi.L1
  const __m512 t1 = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
  _mm512_storeu_ps(out, _mm512_div_ps(_mm512_shuffle_f32x4(t0, t0, _MM_SHUFFLE(3, 1, 2, 0)), denom));
  _mm512_storeu_ps(out + 16, _mm512_div_ps(_mm512_shuffle_f32x4(t1, t1, _MM_SHUFFLE(3, 1, 2, 0)), denom));
}

// out[g, d] = (chain over key pairs of w_j v_j[d] + w_j+1 v_j+1[d]) / sums[g], DB * 32 dims per pass.
template <int GB, int DB>
DFLASH2_AVX512BF16 void weighted_values_bf16(const uint16_t* w, int64_t ld, const float* sums, const c10::BFloat16* v,
                                             int64_t vs, const int32_t* idx, int64_t n, int64_t dh, float* out,
                                             int64_t ohs) {
  for (int64_t d0 = 0; d0 < dh; d0 += DB * 32) {
    __m512 lo[GB][DB], hi[GB][DB];
    for (int g = 0; g < GB; ++g)
      for (int u = 0; u < DB; ++u) lo[g][u] = hi[g][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 2) {
      const c10::BFloat16* v0 = v + idx[j] * vs + d0;
      const c10::BFloat16* v1 = v + idx[j + 1 < n ? j + 1 : j] * vs + d0;  // (a last odd key: weight 0)
      __m512bh xl[DB], xh[DB];
      for (int u = 0; u < DB; ++u) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * u), b = _mm512_loadu_si512(v1 + 32 * u);
        xl[u] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        xh[u] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < GB; ++g) {
        uint32_t pair;
        std::memcpy(&pair, w + g * (ld + 2) + j, 4);
        const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int u = 0; u < DB; ++u) {
          lo[g][u] = _mm512_dpbf16_ps(lo[g][u], pj, xl[u]);
          hi[g][u] = _mm512_dpbf16_ps(hi[g][u], pj, xh[u]);
        }
      }
    }
    for (int g = 0; g < GB; ++g) {
      const __m512 denom = _mm512_set1_ps(sums[g]);
      for (int u = 0; u < DB; ++u) store_dims32(lo[g][u], hi[g][u], denom, out + g * ohs + d0 + 32 * u);
    }
  }
}

// s: GB rows of ld floats (ld a multiple of 16); w: GB rows of ld + 2 bf16 weights.
template <int GB>
DFLASH2_AVX512BF16 void head_group_bf16(const c10::BFloat16* q, int64_t dh, const c10::BFloat16* k, int64_t ks,
                                        const c10::BFloat16* v, int64_t vs, const int32_t* idx, int64_t n, float alpha,
                                        float* s, uint16_t* w, int64_t ld, float* out, int64_t ohs) {
  scores_bf16<GB>(q, dh, k, ks, idx, n, alpha, s, ld);
  float sums[GB];
  for (int g = 0; g < GB; ++g) {
    for (int64_t j = n; j < ld; ++j) s[g * ld + j] = -INFINITY;
    sums[g] = softmax_weights_bf16(s + g * ld, n, ld, w + g * (ld + 2));
  }
  if (dh % 64 == 0 && GB <= 6) {  // (the dims per pass change the register use only)
    weighted_values_bf16<GB, 2>(w, ld, sums, v, vs, idx, n, dh, out, ohs);
  } else {
    weighted_values_bf16<GB, 1>(w, ld, sums, v, vs, idx, n, dh, out, ohs);
  }
}

// f(std::integral_constant<int, GB>{}) for a head group of gb = 1 .. 8 heads (more: 8), GB a template argument.
template <class F>
void with_group(int gb, F&& f) {
  switch (gb) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

void run_group_bf16(int gb, const c10::BFloat16* q, int64_t dh, const c10::BFloat16* k, int64_t ks,
                    const c10::BFloat16* v, int64_t vs, const int32_t* idx, int64_t n, float alpha, float* s,
                    uint16_t* w, int64_t ld, float* out, int64_t ohs) {
  with_group(gb, [&](auto group) {
    head_group_bf16<decltype(group)::value>(q, dh, k, ks, v, vs, idx, n, alpha, s, w, ld, out, ohs);
  });
}

template <int GB, typename T>
void head_group_any(bool wide, const float* q, int64_t dh, const T* k, int64_t ks, const T* v, int64_t vs,
                    const int32_t* idx, int64_t n, float alpha, float* s, int64_t ld, float* out, int64_t ohs) {
  if (wide) return head_group16<GB>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
  head_group<GB>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
}

// wide: the 16-lane functions (AVX-512, head dim a multiple of 16), else the 8-lane ones; the same bits.
template <typename T>
void run_group(bool wide, int gb, const float* q, int64_t dh, const T* k, int64_t ks, const T* v, int64_t vs,
               const int32_t* idx, int64_t n, float alpha, float* s, int64_t ld, float* out, int64_t ohs) {
  with_group(gb, [&](auto group) {
    head_group_any<decltype(group)::value>(wide, q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
  });
}

// dots: the bf16 dot-product functions (T = bf16 only), else wide / 8 lanes.
template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask, MaskStrides ms,
                    bool causal, float scale, bool wide, bool dots, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), dh = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  const int64_t G = H / Hkv;
  const Strides qs{q.stride(0), q.stride(1), q.stride(2)};
  const Strides ks{k.stride(0), k.stride(1), k.stride(2)};
  const Strides vs{v.stride(0), v.stride(1), v.stride(2)};
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const float alpha = scale * 1.4426950408889634f;  // log2(e): p = 2^(s * alpha - max)
  const int64_t items = B * Hkv * T_;
  // About 64K multiply-adds per thread hand-off at least; a decode step over ~100 slots stays on one thread.
  const int64_t per_item = std::max<int64_t>(1, S * G * dh * 2);
  // And a kv head's rows of a verification block or tree (up to 32 rows) in one chunk, where there are heads enough
  // to keep every thread busy: the thread that streamed the head's keys and values for its first row finds them in
  // its own caches for the next rows. Handed out one at a time, the rows had both threads read one head from memory
  // together, then the other (two vCPUs need not share an L3). Only which thread runs an item changes.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t head_rows = T_ <= 32 ? std::max<int64_t>(1, std::min<int64_t>(T_, T_ * B * Hkv / threads)) : 1;
  const int64_t grain = std::max<int64_t>(head_rows, (int64_t{1} << 16) / per_item);
  chunked_threads(items, grain, [&](Chunks& chunks) {  // (items in chunks: a slower core takes fewer)
    std::vector<int32_t> idx(S);
    const int64_t ld_max = (S + 2 * kLanes - 1) / (2 * kLanes) * 2 * kLanes;  // (a multiple of 16)
    std::vector<float> s(kMaxGroup * std::max<int64_t>(ld_max, 2 * kLanes));
    std::vector<float> qf(kMaxGroup * dh);
    std::vector<uint16_t> w(dots ? kMaxGroup * (ld_max + 2) : 0);  // the bf16 weights (dots)
    std::vector<T> qb(dots ? kMaxGroup * dh : 0);
    chunks.each([&](int64_t item) {
      const int64_t t = item % T_;
      const int64_t hk = (item / T_) % Hkv;
      const int64_t b = item / (T_ * Hkv);
      const int64_t limit = causal ? std::min<int64_t>(S, S - T_ + t + 1) : S;
      int64_t n = 0;
      const bool* mrow = mask ? mask + b * ms.b + t * ms.t : nullptr;
      for (int64_t slot = 0; slot < limit; ++slot)
        if (!mrow || mrow[slot * ms.s]) idx[n++] = static_cast<int32_t>(slot);
      const T* kb = kp + b * ks.b + hk * ks.h;
      const T* vb = vp + b * vs.b + hk * vs.h;
      const int64_t lane_step = dots ? 2 * kLanes : kLanes;
      const int64_t ld = std::max<int64_t>(lane_step, (n + lane_step - 1) / lane_step * lane_step);
      for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup) {
        const int gb = static_cast<int>(std::min<int64_t>(kMaxGroup, G - g0));
        const int64_t h0 = hk * G + g0;
        float* o = op + ((b * H + h0) * T_ + t) * dh;
        if (n == 0) {  // no visible key: zeros (torch gives NaN)
          for (int g = 0; g < gb; ++g) std::fill(o + g * T_ * dh, o + g * T_ * dh + dh, 0.0f);
          continue;
        }
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (dots) {
            for (int g = 0; g < gb; ++g)
              std::copy_n(qp + b * qs.b + (h0 + g) * qs.h + t * qs.t, dh, qb.data() + g * dh);
            run_group_bf16(gb, qb.data(), dh, kb, ks.t, vb, vs.t, idx.data(), n, alpha, s.data(), w.data(), ld, o,
                           T_ * dh);
            continue;
          }
        }
        for (int g = 0; g < gb; ++g) {
          const T* qr = qp + b * qs.b + (h0 + g) * qs.h + t * qs.t;
          for (int64_t d = 0; d < dh; ++d) qf[g * dh + d] = load1(qr + d);
        }
        run_group<T>(wide, gb, qf.data(), dh, kb, ks.t, vb, vs.t, idx.data(), n, alpha, s.data(), ld, o, T_ * dh);
      }
    });
  });
}

// q [B, H, T, Dh], k / v [B, H_kv, S, Dh] (bf16 or fp32, one dtype; any strides with a contiguous last dim);
// mask: bool [B or 1, T or 1, S] with any strides (None: all slots); causal: also hide slots past S - T + t.
// Returns fp32 [B, H, T, Dh].
// lanes: 16 (AVX-512), 8 (AVX2 + FMA): the same bits either way; 32: bf16 q / k / v on VDPBF16PS (AVX512-BF16, head
// dim a multiple of 32; bits of its own); 0: the fastest this CPU runs for the dtype.
at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, bool causal, double scale, int64_t lanes) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention_rows: q, k, v must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attention_rows: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attention_rows: q, k, v must share one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "attention_rows: fp32, bf16 or fp16");
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), dh = q.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == dh && v.size(3) == dh, "attention_rows: shapes");
  TORCH_CHECK(k.size(1) == v.size(1) && k.size(2) == v.size(2) && H % k.size(1) == 0, "attention_rows: heads");
  TORCH_CHECK(dh % kLanes == 0, "attention_rows: head dim must be a multiple of 8");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attention_rows: last dim must be contiguous");
  const int64_t S = k.size(2);
  TORCH_CHECK(S < (int64_t{1} << 31), "attention_rows: too many slots");
  MaskStrides ms{0, 0, 0};
  const bool* mp = nullptr;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 3, "attention_rows: mask must be bool [B', T', S]");
    TORCH_CHECK((m.size(0) == B || m.size(0) == 1) && (m.size(1) == T_ || m.size(1) == 1) && m.size(2) == S,
                "attention_rows: mask shape");
    ms = MaskStrides{m.size(0) == 1 ? 0 : m.stride(0), m.size(1) == 1 ? 0 : m.stride(1), m.stride(2)};
    mp = m.data_ptr<bool>();
  }
  TORCH_CHECK(lanes == 0 || lanes == 8 || (lanes == 16 && has_avx512()) ||
                  (lanes == 32 && has_avx512bf16() && q.scalar_type() == at::kBFloat16 && dh % 32 == 0),
              "attention_rows: lanes 0, 8, 16 (AVX-512) or 32 (AVX512-BF16 dot products: bf16, head dim a multiple "
              "of 32)");
  const bool dots = (lanes == 32 || (lanes == 0 && has_avx512bf16())) && q.scalar_type() == at::kBFloat16 &&
                    dh % 32 == 0;
  const bool wide = (lanes == 16 || (lanes == 0 && has_avx512())) && dh % (2 * kLanes) == 0;
  at::Tensor out = at::empty({B, H, T_, dh}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return out;
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    attention_impl<float>(q, k, v, mp, ms, causal, sc, wide, false, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attention_impl<c10::BFloat16>(q, k, v, mp, ms, causal, sc, wide, dots, out);
  } else {
    attention_impl<c10::Half>(q, k, v, mp, ms, causal, sc, wide, false, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(dflash2_attention, m) {
  m.def("attention_rows(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale, int lanes=0) -> Tensor",
        &attention_rows);
}
