// Storing a kernel's fp32 sums as its outputs, shared by gemm_amx.cpp and gemm_dpbf16.cpp (AVX-512F); its bf16
// rounding (bf16_bits16) also by the gguf kernel's 512-bit builds (gemm_gguf_vnni.h).
//
// store_outputs(src, nv, scale, bias, out, col): outputs col .. col + nv - 1 (nv <= 16) of one row from the fp32
// sums src: v = src (* scale) (+ bias), each a rounding as the scalar expression, then stored as fp32 or rounded
// to bf16 (to nearest, ties to even; NaN -> 0x7FC0: c10::BFloat16's rounding, so what y.to(bf16) would give).
// Writing bf16 here saves the caller a pass over an fp32 [M, N] temporary (at 40 rows of the 1.5B target in bf16
// on the Intel Xeon (AMX) those conversions were ~50 ms of a ~220 ms forward).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// fp32 lanes -> their bf16 bits as c10::BFloat16 rounds them (to nearest, ties to even; NaN -> 0x7FC0), in the low
// half of each 32-bit lane.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i even = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(even, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

struct RowsOut {  // where the outputs go: fp32 rows or bf16 rows, `ld` elements apart
  float* y = nullptr;
  uint16_t* yb = nullptr;
  int64_t ld = 0;
};

// The rows of a contiguous fp32 or bf16 [M, N] output tensor.
inline RowsOut rows_out(const at::Tensor& y) {
  RowsOut out;
  out.ld = y.size(1);
  if (y.scalar_type() == at::kBFloat16) {
    out.yb = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  } else {
    out.y = y.data_ptr<float>();
  }
  return out;
}

inline void store_outputs(const float* src, int64_t nv, const float* scale, const float* bias, const RowsOut& out,
                          int64_t row, int64_t col) {
  const __mmask16 keep = static_cast<__mmask16>((1u << nv) - 1);
  __m512 v = _mm512_maskz_loadu_ps(keep, src);
  if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(keep, scale + col));
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + col));
  if (out.yb == nullptr) {
    _mm512_mask_storeu_ps(out.y + row * out.ld + col, keep, v);
    return;
  }
  const __m256i h = _mm512_cvtepi32_epi16(bf16_bits16(v));
  uint16_t* dst = out.yb + row * out.ld + col;
  if (nv == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  } else {
    alignas(32) uint16_t part[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(part), h);
    std::memcpy(dst, part, nv * sizeof(uint16_t));
  }
}
