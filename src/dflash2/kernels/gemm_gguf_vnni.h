// The AVX512-VNNI micro-kernel of gemm_gguf_avx2.cpp (included there, inside its namespace, when built with
// -mavx512vnni; used from 5 rows): two panels (16 outputs) per 64-byte vector, so each row's broadcast activation
// bytes, VPDPBUSD and per-block bookkeeping serve twice the outputs of the 256-bit path. Lanes 0-7 are panel p's
// outputs, lanes 8-15 panel p + 1's, each lane the 256-bit path's lane: the same exact integers and the same fp32
// sequence per output (y = y + (A * dx) * float(J), then the offset term), so the same bits (tested against the
// reference).

// Panel p's 32 bytes at `off` in the low half, panel p + 1's in the high half.
inline __m512i load_pair(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}

// 8 int8 of each panel -> 16 int32 lanes.
inline __m512i int8_pair(const int8_t* p0, const int8_t* p1) {
  const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)));
  return _mm512_cvtepi8_epi32(both);
}

inline __m512 float_pair(const float* p0, const float* p1) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(p0))),
                                             _mm256_castps_pd(_mm256_loadu_ps(p1)), 1));
}

// Row `row`'s outputs 8p .. 8p + 15 where `keep` holds (lanes 8-15: panel p + 1's), as store_panel: the bias
// added, stored as fp32 or bf16, or rounded to bf16 and stored as fp32 (the same rounding: bf16_bits16).
inline void store_pair(const Args& a, int64_t row, int64_t p, __mmask16 keep, __m512 v) {
  const Output& o = a.out;
  const int64_t col = p * kPanel;
  if (o.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, o.bias + col));
  if (o.yb != nullptr || o.round_bf16) {
    const __m512i r = bf16_bits16(v);  // (tile_store.h)
    if (o.yb == nullptr) {  // the bf16 value widened back to fp32
      _mm512_mask_storeu_ps(o.y + row * o.ld + col, keep, _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)));
      return;
    }
    _mm256_mask_storeu_epi16(o.yb + row * o.ld + col, keep, _mm512_cvtepi32_epi16(r));
  } else {
    _mm512_mask_storeu_ps(o.y + row * o.ld + col, keep, v);
  }
}

inline __m512i xload16(const int8_t* row, int64_t k) {
  int32_t four;
  std::memcpy(&four, row + k, 4);
  return _mm512_set1_epi32(four);
}

// The codes of block b of panels p, q (4- to 6-bit kinds), one byte each: step(c, lo, hi) for chunks c = 0..3, lo
// holding step c (inputs 4c .. 4c + 3) and hi step c + 4 of the 16 outputs (panel p's in the low 32 bytes).
template <int KIND, class Step>
inline void pair_codes(const Args& a, int64_t p, int64_t q, int64_t b, Step&& step) {
  constexpr int HB = KIND == kNib4 ? 0 : (KIND == kNib5 ? 1 : 2);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* w0 = a.w + (p * a.B + b) * block_bytes(KIND);
  const uint8_t* w1 = a.w + (q * a.B + b) * block_bytes(KIND);
  __m512i plane0 = _mm512_setzero_si512(), plane1 = _mm512_setzero_si512();
  if constexpr (HB > 0) plane0 = load_pair(w0 + 128, w1 + 128);
  if constexpr (HB == 2) plane1 = load_pair(w0 + 160, w1 + 160);
  auto high = [&](int t) {  // step t's high bits at bits 4..
    const __m512i plane = (t * HB) / 8 == 0 ? plane0 : plane1;
    const __m512i h = _mm512_and_si512(_mm512_srli_epi16(plane, (t * HB) % 8), _mm512_set1_epi8((1 << HB) - 1));
    return _mm512_slli_epi16(h, 4);
  };
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i v = load_pair(w0 + 32 * c, w1 + 32 * c);
    __m512i lo = _mm512_and_si512(v, low4);
    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if constexpr (HB > 0) {
      lo = _mm512_or_si512(lo, high(c));
      hi = _mm512_or_si512(hi, high(c + 4));
    }
    step(c, lo, hi);
  }
}

// Per row: the int32 sums of the two halves of block b (inputs 0-15 / 16-31) of panels p, q times their
// sub-scales (S0 / S1): J = sum_h s_h * sum u x, block_integers' J, for 16 outputs (the zero-point term is
// pair_rows' once per group).
template <int MR, int KIND, int H>
inline void pair_block_integers(const Args& a, int64_t p, int64_t q, int64_t b, const int8_t* const* xr,
                                __m512i S0, __m512i S1, __m512i* J) {
  __m512i a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
  if constexpr (KIND == kSigned) {  // |w| (u8) times x negated where w < 0
    const uint8_t* w0 = a.w + (p * a.B + b) * 256;
    const uint8_t* w1 = a.w + (q * a.B + b) * 256;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i v = load_pair(w0 + 32 * t, w1 + 32 * t);
      const __m512i av = _mm512_abs_epi8(v);
      const __mmask64 neg = _mm512_movepi8_mask(v);
      for (int r = 0; r < MR; ++r) {
        const __m512i x = xload16(xr[r], 32 * b + 4 * t);
        a0[r] = _mm512_dpbusd_epi32(a0[r], av, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
      }
    }
    for (int r = 0; r < MR; ++r) J[r] = a0[r];  // Q8_0: no zero point, no sub-scales
    return;
  } else {
    pair_codes<KIND>(a, p, q, b, [&](int c, __m512i lo, __m512i hi) {
      for (int r = 0; r < MR; ++r) {
        a0[r] = _mm512_dpbusd_epi32(a0[r], lo, xload16(xr[r], 32 * b + 4 * c));
        a1[r] = _mm512_dpbusd_epi32(a1[r], hi, xload16(xr[r], 32 * b + 16 + 4 * c));
      }
    });
  }
  for (int r = 0; r < MR; ++r) {
    if constexpr (H == 2) {
      J[r] = _mm512_add_epi32(_mm512_mullo_epi32(a0[r], S0), _mm512_mullo_epi32(a1[r], S1));
    } else {
      J[r] = _mm512_add_epi32(a0[r], a1[r]);
      if constexpr (H == 1) J[r] = _mm512_mullo_epi32(J[r], S0);
    }
  }
}

// int32 lanes holding small values -> the int16 pair (lo, hi) in each lane (a VPDPWSSD operand).
inline __m512i pair16_512(__m512i lo, __m512i hi) {
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(hi, 16));
}

// Rows m0 .. m0 + MR - 1 of panels p and q (p + 1; or p again for a last, lone panel), the outputs in `keep`
// stored (lane i: output 8p + i).
template <int MR, int KIND, int H, int OFF>
void pair_rows(const Args& a, int64_t p, int64_t q, int64_t m0, __mmask16 keep) {
  __m512 yv[MR];
  const int8_t* xr[MR];
  for (int r = 0; r < MR; ++r) {
    yv[r] = _mm512_setzero_ps();
    xr[r] = a.xq + (m0 + r) * a.K;
  }
  const bool zero = a.zshift >= 0;
  const __m512i ones = _mm512_set1_epi16(1);
  for (int64_t g = 0; g < a.G; ++g) {
    __m512i Jg[MR], Zg[MR], Tg[MR];
    for (int r = 0; r < MR; ++r) Jg[r] = Zg[r] = Tg[r] = _mm512_setzero_si512();
    for (int64_t b = g * a.group; b < (g + 1) * a.group; ++b) {
      __m512i S0 = _mm512_set1_epi32(1), S1 = S0, Spair = ones;  // Spair: (s_0, s_1) as int16 pairs
      if constexpr (H == 1) {
        S0 = S1 = int8_pair(a.s + (p * a.B + b) * 8, a.s + (q * a.B + b) * 8);
        Spair = pair16_512(S0, S0);
      } else if constexpr (H == 2) {
        const int8_t* s0 = a.s + (p * a.B + b) * 16;
        const int8_t* s1 = a.s + (q * a.B + b) * 16;
        S0 = int8_pair(s0, s1);
        S1 = int8_pair(s0 + 8, s1 + 8);
        Spair = pair16_512(S0, S1);
      }
      __m512i J[MR];
      pair_block_integers<MR, KIND, H>(a, p, q, b, xr, S0, S1, J);
      __m512i CM = ones;  // (c, c) per output: c * bsum_0 + c * bsum_1
      if constexpr (OFF == 2) {
        const __m512i c = int8_pair(a.cm + (p * a.B + b) * 8, a.cm + (q * a.B + b) * 8);
        CM = pair16_512(c, c);
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i bpair = _mm512_set1_epi32(a.bp[(m0 + r) * a.B + b]);  // the half sums as an int16 pair
        Jg[r] = _mm512_add_epi32(Jg[r], J[r]);
        if (zero) Zg[r] = _mm512_dpwssd_epi32(Zg[r], Spair, bpair);  // sum_h s_h * bsum_h
        if constexpr (OFF != 0) Tg[r] = _mm512_dpwssd_epi32(Tg[r], CM, bpair);
      }
    }
    if (zero) {  // J -= zero * sum_b sum_h s_h * bsum_h, once per group
      const __m128i shift = _mm_cvtsi32_si128(a.zshift);
      for (int r = 0; r < MR; ++r) Jg[r] = _mm512_sub_epi32(Jg[r], _mm512_sll_epi32(Zg[r], shift));
    }
    const __m512 Av = float_pair(a.A + (p * a.G + g) * kPanel, a.A + (q * a.G + g) * kPanel);
    __m512 Cv = _mm512_setzero_ps();
    if constexpr (OFF != 0) Cv = float_pair(a.C + (p * a.G + g) * kPanel, a.C + (q * a.G + g) * kPanel);
    for (int r = 0; r < MR; ++r) {
      const __m512 d = _mm512_set1_ps(a.dx[(m0 + r) * a.G + g]);
      yv[r] = _mm512_add_ps(yv[r], _mm512_mul_ps(_mm512_mul_ps(Av, d), _mm512_cvtepi32_ps(Jg[r])));
      if constexpr (OFF != 0)
        yv[r] = _mm512_add_ps(yv[r], _mm512_mul_ps(_mm512_mul_ps(Cv, d), _mm512_cvtepi32_ps(Tg[r])));
    }
  }
  for (int r = 0; r < MR; ++r) store_pair(a, m0 + r, p, keep, yv[r]);
}

struct Pairs {  // panels p and q in one 512-bit vector, 1-8 rows per call (gemm_gguf_avx2.cpp's pick), from 5 rows
  using Fn = void (*)(const Args&, int64_t, int64_t, int64_t, __mmask16);
  static constexpr int kRows = 8;
  template <int MR, int KIND, int H, int OFF>
  static constexpr Fn fn = &pair_rows<MR, KIND, H, OFF>;
};
