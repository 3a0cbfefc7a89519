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
// AVX2 + FMA (+ F16C, which every AVX2 CPU has) only, no AVX-512: every x86-64 machine that runs the packed linear
// kernel runs this one with the same bits.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// Scores -> p = 2^(s - max) in place (pad lanes up to ld hold -inf -> 0); returns sum p (8 lanes j mod 8, folded).
inline float softmax_weights(float* s, int64_t n, int64_t ld) {
  float m = s[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
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

template <typename T>
void run_group(int gb, const float* q, int64_t dh, const T* k, int64_t ks, const T* v, int64_t vs, const int32_t* idx,
               int64_t n, float alpha, float* s, int64_t ld, float* out, int64_t ohs) {
  switch (gb) {
    case 1: return head_group<1>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
    case 2: return head_group<2>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
    case 3: return head_group<3>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
    case 4: return head_group<4>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
    case 5: return head_group<5>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
    case 6: return head_group<6>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
    case 7: return head_group<7>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
    default: return head_group<8>(q, dh, k, ks, v, vs, idx, n, alpha, s, ld, out, ohs);
  }
}

template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask, MaskStrides ms,
                    bool causal, float scale, at::Tensor& out) {
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
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_item);
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    std::vector<int32_t> idx(S);
    const int64_t ld_max = (S + kLanes - 1) / kLanes * kLanes;
    std::vector<float> s(kMaxGroup * std::max<int64_t>(ld_max, kLanes));
    std::vector<float> qf(kMaxGroup * dh);
    for (int64_t item = i0; item < i1; ++item) {
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
      const int64_t ld = std::max<int64_t>(kLanes, (n + kLanes - 1) / kLanes * kLanes);
      for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup) {
        const int gb = static_cast<int>(std::min<int64_t>(kMaxGroup, G - g0));
        const int64_t h0 = hk * G + g0;
        float* o = op + ((b * H + h0) * T_ + t) * dh;
        if (n == 0) {  // no visible key: zeros (torch gives NaN)
          for (int g = 0; g < gb; ++g) std::fill(o + g * T_ * dh, o + g * T_ * dh + dh, 0.0f);
          continue;
        }
        for (int g = 0; g < gb; ++g) {
          const T* qr = qp + b * qs.b + (h0 + g) * qs.h + t * qs.t;
          for (int64_t d = 0; d < dh; ++d) qf[g * dh + d] = load1(qr + d);
        }
        run_group<T>(gb, qf.data(), dh, kb, ks.t, vb, vs.t, idx.data(), n, alpha, s.data(), ld, o, T_ * dh);
      }
    }
  });
}

// q [B, H, T, Dh], k / v [B, H_kv, S, Dh] (bf16 or fp32, one dtype; any strides with a contiguous last dim);
// mask: bool [B or 1, T or 1, S] with any strides (None: all slots); causal: also hide slots past S - T + t.
// Returns fp32 [B, H, T, Dh].
at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, bool causal, double scale) {
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
  at::Tensor out = at::empty({B, H, T_, dh}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    attention_impl<float>(q, k, v, mp, ms, causal, static_cast<float>(scale), out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attention_impl<c10::BFloat16>(q, k, v, mp, ms, causal, static_cast<float>(scale), out);
  } else {
    attention_impl<c10::Half>(q, k, v, mp, ms, causal, static_cast<float>(scale), out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(dflash2_attention, m) {
  m.def("attention_rows(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor",
        &attention_rows);
}
