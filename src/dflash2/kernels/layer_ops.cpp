// dflash2 CPU kernels for the small per-layer operations of the decoder, each one call instead of 5-14 PyTorch
// operations (at one row a decode step is dominated by the per-operation overhead of these, not their arithmetic):
//
//   rms_norm(x [..., D], w [D], eps) -> y [..., D]      (fp32 or bf16; x, w and y of one dtype)
//       per row: ss = sum_d x_f32[d]^2 in one fixed order (8 fp32 lanes over d = 8i + lane, D % 8 == 0, then the
//       lanes as ((0+4)+(2+6))+((1+5)+(3+7))); r = 1 / sqrt(ss / D + eps); n = round(x_f32 * r); y = round(w * n)
//       (round: to the dtype; the identity for fp32). What HF's Qwen2 / Llama RMSNorm computes, with the sum of
//       squares in this order instead of PyTorch's (a row's result depends on that row only).
//   qkv_rope(qkv [B, T, (H + 2 Hkv) Dh], cos [B', 1, T, Dh], sin [B', 1, T, Dh], H, Hkv) -> q, k, v
//       q [B, H, T, Dh] and k [B, Hkv, T, Dh] with the rotary embedding of the half-split layout applied, v
//       [B, Hkv, T, Dh] copied (B' = B or 1). Per head row x (i < Dh / 2, j = i + Dh / 2):
//         out[i] = round(round(x[i] * cos[i]) + round(-x[j] * sin[i]))
//         out[j] = round(round(x[j] * cos[j]) + round(x[i] * sin[j]))
//       bit for bit PyTorch's q * cos + rotate_half(q) * sin in the same dtype (each operation rounded on its own).
//   silu_mul(gu [..., 2I]) -> [..., I]   (fp32 or bf16, I % 8 == 0)
//       with gate = gu[..., :I], up = gu[..., I:]: out = round(round(silu(gate)) * up), what PyTorch's
//       F.silu(gate) * up computes in the dtype, with silu(g) = g / (1 + exp(-g)) in fp32 from an exp of its own
//       (exp8 below: a fixed polynomial, within ~2 ulp), so the same bits on every AVX2 machine (not always
//       PyTorch's last bit, whose exp depends on the CPU's ATen build).
//
// Build with -ffp-contract=off (no multiply-add fused behind the code's back).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using c10::BFloat16;

inline float load_f32(const float* p) { return *p; }
inline float load_f32(const BFloat16* p) { return static_cast<float>(*p); }
inline void store(float* p, float v) { *p = v; }
inline void store(BFloat16* p, float v) { *p = BFloat16(v); }  // round to nearest even
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const BFloat16*) { return static_cast<float>(BFloat16(v)); }

// 8 consecutive values as fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// fp32 lanes rounded to the nearest bf16 (ties to even), as fp32; NaN stays NaN. The scalar c10::BFloat16(float).
inline __m256 round8(__m256 v, const float*) { return v; }
inline __m256 round8(__m256 v, const BFloat16*) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm256_blendv_ps(rounded, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// 8 lanes already exact in the destination dtype.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(BFloat16* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

template <typename T>
float sum_of_squares(const T* x, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  alignas(32) float lane[8];
  _mm256_store_ps(lane, acc);
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t m0, int64_t m1, int64_t d, float eps) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* row = x + m * d;
    T* out = y + m * d;
    const float r = 1.0f / std::sqrt(sum_of_squares(row, d) / static_cast<float>(d) + eps);
    const __m256 rv = _mm256_set1_ps(r);
    for (int64_t i = 0; i < d; i += 8) {  // d % 8 == 0
      const __m256 n = round8(_mm256_mul_ps(load8(row + i), rv), row);
      store8(out + i, round8(_mm256_mul_ps(load8(w + i), n), row));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.dim() >= 1 && input.scalar_type() == weight.scalar_type(), "rms_norm: x and w of one dtype");
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  const int64_t d = x.size(-1), m = d == 0 ? 0 : x.numel() / d;
  TORCH_CHECK(w.numel() == d && d % 8 == 0, "rms_norm: w must have D entries, D a multiple of 8");
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 32768 / d);  // rows per task: one row stays on the calling thread
  if (x.scalar_type() == at::kFloat) {
    const float *px = x.data_ptr<float>(), *pw = w.data_ptr<float>();
    float* py = y.data_ptr<float>();
    at::parallel_for(0, m, grain, [&](int64_t a, int64_t b) { rms_norm_rows(px, pw, py, a, b, d, e); });
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: fp32 or bf16");
    const BFloat16 *px = x.data_ptr<BFloat16>(), *pw = w.data_ptr<BFloat16>();
    BFloat16* py = y.data_ptr<BFloat16>();
    at::parallel_for(0, m, grain, [&](int64_t a, int64_t b) { rms_norm_rows(px, pw, py, a, b, d, e); });
  }
  return y;
}

template <typename T>
void rope_row(const T* x, const T* c, const T* s, T* out, int64_t dh) {
  const int64_t half = dh / 2;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = load8(x + i), b = load8(x + i + half);
    const __m256 lo = _mm256_add_ps(round8(_mm256_mul_ps(a, load8(c + i)), x),
                                    round8(_mm256_mul_ps(_mm256_xor_ps(b, sign), load8(s + i)), x));
    const __m256 hi = _mm256_add_ps(round8(_mm256_mul_ps(b, load8(c + i + half)), x),
                                    round8(_mm256_mul_ps(a, load8(s + i + half)), x));
    store8(out + i, round8(lo, x));
    store8(out + i + half, round8(hi, x));
  }
  for (; i < half; ++i) {
    const float a = load_f32(x + i), b = load_f32(x + i + half);
    const float lo = round_to(a * load_f32(c + i), x) + round_to(-b * load_f32(s + i), x);
    const float hi = round_to(b * load_f32(c + i + half), x) + round_to(a * load_f32(s + i + half), x);
    store(out + i, lo);
    store(out + i + half, hi);
  }
}

template <typename T>
void qkv_rope_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q, at::Tensor& k,
                   at::Tensor& v, int64_t h, int64_t hkv) {
  const int64_t batch = qkv.size(0), t = qkv.size(1), width = qkv.size(2), dh = q.size(3);
  const bool shared = cos.size(0) == 1;
  const T *px = qkv.data_ptr<T>(), *pc = cos.data_ptr<T>(), *ps = sin.data_ptr<T>();
  T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>();
  const int64_t heads = h + 2 * hkv;
  at::parallel_for(0, batch * t, std::max<int64_t>(1, 4096 / (heads * dh)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / t, tt = r % t;
      const T* row = px + r * width;
      const int64_t angle = ((shared ? 0 : b) * t + tt) * dh;
      for (int64_t hh = 0; hh < h; ++hh)
        rope_row(row + hh * dh, pc + angle, ps + angle, pq + ((b * h + hh) * t + tt) * dh, dh);
      for (int64_t hh = 0; hh < hkv; ++hh) {
        rope_row(row + (h + hh) * dh, pc + angle, ps + angle, pk + ((b * hkv + hh) * t + tt) * dh, dh);
        const T* src = row + (h + hkv + hh) * dh;
        T* dst = pv + ((b * hkv + hh) * t + tt) * dh;
        for (int64_t i = 0; i < dh; ++i) dst[i] = src[i];
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope(const at::Tensor& qkv_in, const at::Tensor& cos_in,
                                                        const at::Tensor& sin_in, int64_t h, int64_t hkv) {
  TORCH_CHECK(qkv_in.dim() == 3, "qkv_rope: qkv [B, T, W]");
  TORCH_CHECK(cos_in.dim() == 4 && cos_in.size(1) == 1 && sin_in.sizes() == cos_in.sizes(),
              "qkv_rope: cos / sin [B or 1, 1, T, Dh]");
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t batch = qkv.size(0), t = qkv.size(1), dh = cos.size(3);
  TORCH_CHECK(qkv.size(2) == (h + 2 * hkv) * dh && dh % 2 == 0, "qkv_rope: W must be (H + 2 Hkv) Dh, Dh even");
  TORCH_CHECK(cos.size(2) == t && (cos.size(0) == 1 || cos.size(0) == batch), "qkv_rope: cos / sin shape");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "qkv_rope: qkv, cos and sin of one dtype");
  at::Tensor q = at::empty({batch, h, t, dh}, qkv.options());
  at::Tensor k = at::empty({batch, hkv, t, dh}, qkv.options());
  at::Tensor v = at::empty({batch, hkv, t, dh}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    qkv_rope_impl<float>(qkv, cos, sin, q, k, v, h, hkv);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "qkv_rope: fp32 or bf16");
    qkv_rope_impl<BFloat16>(qkv, cos, sin, q, k, v, h, hkv);
  }
  return {q, k, v};
}

// exp(x) lane by lane (Cephes expf: Cody-Waite reduction by ln 2, degree-6 polynomial, ~2 ulp); x > 88.5 gives +inf,
// x < -88 gives 0 (the normal range's edge), NaN stays NaN.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.5f), lo = _mm256_set1_ps(-88.0f);
  const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 c = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), c);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
  y = _mm256_andnot_ps(under, y);
  return _mm256_blendv_ps(y, x, nan);
}

// Columns [i0, i1) of one row (a multiple of 8 apart): dst = round(round(silu(gate)) * up).
template <typename T>
void silu_mul8(const T* gate, const T* up, T* dst, int64_t i0, int64_t i1) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = i0; i < i1; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 s = round8(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign)))), gate);
    store8(dst + i, round8(_mm256_mul_ps(s, load8(up + i)), gate));
  }
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t r0, int64_t r1, int64_t inter) {  // gu [rows, 2I] -> out [rows, I]
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = gu + r * 2 * inter;
    silu_mul8(gate, gate + inter, out + r * inter, 0, inter);
  }
}

// The same operations on 16 lanes (AVX-512, where the CPU has it): each lane's arithmetic is exp8 / silu_mul_rows'
// lane arithmetic instruction for instruction (IEEE division, the same fused and plain steps, rounding mode and
// integer bit operations), so the same bits at twice the width (tested: lanes=8 against lanes=16).
#define DFLASH2_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

DFLASH2_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
DFLASH2_AVX512 inline __m512 load16(const BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
DFLASH2_AVX512 inline __m512 round16(__m512 v, const float*) { return v; }
DFLASH2_AVX512 inline __m512 round16(__m512 v, const BFloat16*) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __m512 rounded = _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, v);
}
DFLASH2_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
DFLASH2_AVX512 inline void store16(BFloat16* p, __m512 v) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}

DFLASH2_AVX512 inline __m512 exp16(__m512 x) {  // exp8, 16 lanes
  const __m512 hi = _mm512_set1_ps(88.5f), lo = _mm512_set1_ps(-88.0f);
  const __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 c = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  y = _mm512_mask_blend_ps(over, y, _mm512_set1_ps(INFINITY));
  y = _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), y);
  return _mm512_mask_blend_ps(nan, y, x);
}

template <typename T>
DFLASH2_AVX512 void silu_mul_rows16(const T* gu, T* out, int64_t r0, int64_t r1, int64_t inter) {
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  const int64_t wide = inter / 16 * 16;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = gu + r * 2 * inter;
    const T* up = gate + inter;
    T* dst = out + r * inter;
    for (int64_t i = 0; i < wide; i += 16) {
      const __m512 g = load16(gate + i);
      const __m512 s = round16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_xor_ps(g, sign)))), gate);
      store16(dst + i, round16(_mm512_mul_ps(s, load16(up + i)), gate));
    }
    silu_mul8(gate, up, dst, wide, inter);  // a last 8
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}

// lanes: 16 (AVX-512), 8 (AVX2) or 0 (the widest this CPU runs); the same bits either way.
at::Tensor silu_mul(const at::Tensor& input, int64_t lanes) {
  const at::Tensor gu = input.contiguous();
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 16 == 0, "silu_mul: gu [..., 2I], I a multiple of 8");
  TORCH_CHECK(lanes == 0 || lanes == 8 || (lanes == 16 && has_avx512()), "silu_mul: lanes 0, 8 or 16 (AVX-512)");
  const bool wide = lanes == 16 || (lanes == 0 && has_avx512());
  const int64_t inter = gu.size(-1) / 2, rows = inter == 0 ? 0 : gu.numel() / (2 * inter);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, gu.options());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, inter));
  if (gu.scalar_type() == at::kFloat) {
    const float* pg = gu.data_ptr<float>();
    float* po = out.data_ptr<float>();
    at::parallel_for(0, rows, grain, [&](int64_t a, int64_t b) {
      wide ? silu_mul_rows16(pg, po, a, b, inter) : silu_mul_rows(pg, po, a, b, inter);
    });
  } else {
    TORCH_CHECK(gu.scalar_type() == at::kBFloat16, "silu_mul: fp32 or bf16");
    const BFloat16* pg = gu.data_ptr<BFloat16>();
    BFloat16* po = out.data_ptr<BFloat16>();
    at::parallel_for(0, rows, grain, [&](int64_t a, int64_t b) {
      wide ? silu_mul_rows16(pg, po, a, b, inter) : silu_mul_rows(pg, po, a, b, inter);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(dflash2_layer_ops, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("qkv_rope(Tensor qkv, Tensor cos, Tensor sin, int h, int hkv) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor gu, int lanes=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash2_layer_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("qkv_rope", &qkv_rope);
  m.impl("silu_mul", &silu_mul);
}
