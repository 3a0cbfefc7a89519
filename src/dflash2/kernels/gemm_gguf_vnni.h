// The AVX512-VNNI micro-kernels of gemm_gguf_avx2.cpp (included there, inside its namespace, when built with
// -mavx512vnni; pair_rows from gguf_pair_min_rows rows: 4 on every CPU, overridable with DFLASH2_GGUF_PAIR_ROWS;
// fewer rows take the 256-bit kernel, faster there; plain_pair_rows, at the end, for blocks of 32 without
// sub-scales at every row count): two panels (16 outputs) per 64-byte vector, so each row's broadcast
// activation bytes, VPDPBUSD and per-block bookkeeping serve twice the outputs of the 256-bit path. Lanes 0-7 are
// panel p's outputs, lanes 8-15 panel q's, each lane the 256-bit path's lane: the same exact integers and the same
// fp32 sequence per output (y = y + (A * dx) * float(J), then the offset term), so the same bits (tested against the
// reference).

// Panel p's 32 bytes at p0 in the low half, panel q's at p1 in the high half.
inline __m512i load_pair(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}

// VPTERNLOGD's immediate for a | (b & c).
constexpr int kOrAnd = 0xF8;

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

// Row `row`'s outputs of panels p (lanes 0-7) and q (lanes 8-15) where `keep` holds, as store_panel: the bias
// added, stored as fp32 or bf16, or rounded to bf16 and stored as fp32 (the same rounding: bf16_bits16).
inline void store_pair(const Args& a, int64_t row, int64_t p, int64_t q, __mmask16 keep, __m512 v) {
  const Output& o = a.out;
  const int64_t c0 = p * kPanel, c1 = q * kPanel;
  const __mmask8 k0 = static_cast<__mmask8>(keep), k1 = static_cast<__mmask8>(keep >> 8);
  if (o.bias != nullptr)
    v = _mm512_add_ps(v, _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_maskz_loadu_ps(k0, o.bias + c0)),
                                            _mm256_maskz_loadu_ps(k1, o.bias + c1), 1));
  __m512 f = v;
  if (o.yb != nullptr || o.round_bf16) {
    const __m512i r = bf16_bits16(v);  // (tile_store.h)
    if (o.yb != nullptr) {
      const __m256i h = _mm512_cvtepi32_epi16(r);
      _mm_mask_storeu_epi16(o.yb + row * o.ld + c0, k0, _mm256_castsi256_si128(h));
      _mm_mask_storeu_epi16(o.yb + row * o.ld + c1, k1, _mm256_extracti128_si256(h, 1));
      return;
    }
    f = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));  // the bf16 value widened back to fp32
  }
  _mm256_mask_storeu_ps(o.y + row * o.ld + c0, k0, _mm512_castps512_ps256(f));
  _mm256_mask_storeu_ps(o.y + row * o.ld + c1, k1, _mm512_extractf32x8_ps(f, 1));
}

inline __m512i xload16(const int8_t* row, int64_t k) {
  int32_t four;
  std::memcpy(&four, row + k, 4);
  return _mm512_set1_epi32(four);
}

// acc + VPDPBUSD of the codes with the 4 activation bytes at row + k broadcast, the broadcast folded into the
// instruction's memory operand ({1to16}; GCC keeps a separate VPBROADCASTD for _mm512_set1_epi32): one instruction
// per row and step instead of two.
inline __m512i dpbusd_x(__m512i acc, __m512i codes, const int8_t* row, int64_t k) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*reinterpret_cast<const int32_t*>(row + k)));
  return acc;
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
  auto with_high = [&](__m512i codes, int t) {  // codes | step t's high bits, moved to bits 4 .. 4 + HB - 1
    const __m512i plane = (t * HB) / 8 == 0 ? plane0 : plane1;
    const int at = (t * HB) % 8;  // where they lie in the plane's bytes
    // A 16-bit shift: the bits it moves in from the word's other byte land outside bits 4 .. 4 + HB - 1.
    const __m512i moved = at <= 4 ? _mm512_slli_epi16(plane, 4 - at) : _mm512_srli_epi16(plane, at - 4);
    return _mm512_ternarylogic_epi32(codes, moved, _mm512_set1_epi8(((1 << HB) - 1) << 4), kOrAnd);
  };
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i v = load_pair(w0 + 32 * c, w1 + 32 * c);
    __m512i lo = _mm512_and_si512(v, low4);
    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if constexpr (HB > 0) {
      lo = with_high(lo, c);
      hi = with_high(hi, c + 4);
    }
    step(c, lo, hi);
  }
}

// Per row: J += block b's integers of panels p, q (sum_h s_h * sum u x over its halves, inputs 0-15 / 16-31, with
// the sub-scales S0 / S1; the zero-point term is pair_rows' once per group). One accumulator per row where the block
// has at most one sub-scale (none: straight into J), two where its halves have their own: few registers per row,
// so 8 rows run without spilling their sums.
template <int MR, int KIND, int H>
inline void pair_block_accumulate(const Args& a, int64_t p, int64_t q, int64_t b, const int8_t* const* xr,
                                  __m512i S0, __m512i S1, __m512i* J) {
  if constexpr (KIND == kSigned) {  // |w| (u8) times x negated where w < 0; Q8_0: no zero point, no sub-scales
    const uint8_t* w0 = a.w + (p * a.B + b) * 256;
    const uint8_t* w1 = a.w + (q * a.B + b) * 256;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i v = load_pair(w0 + 32 * t, w1 + 32 * t);
      const __m512i av = _mm512_abs_epi8(v);
      const __mmask64 neg = _mm512_movepi8_mask(v);
      for (int r = 0; r < MR; ++r) {
        const __m512i x = xload16(xr[r], 32 * b + 4 * t);
        J[r] = _mm512_dpbusd_epi32(J[r], av, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
      }
    }
  } else if constexpr (H == 0) {  // two chains per row: J alone, one chain over the whole row, waited on itself
    __m512i second[MR];
    for (int r = 0; r < MR; ++r) second[r] = _mm512_setzero_si512();
    pair_codes<KIND>(a, p, q, b, [&](int c, __m512i lo, __m512i hi) {
      for (int r = 0; r < MR; ++r) {
        J[r] = dpbusd_x(J[r], lo, xr[r], 32 * b + 4 * c);
        second[r] = dpbusd_x(second[r], hi, xr[r], 32 * b + 16 + 4 * c);
      }
    });
    for (int r = 0; r < MR; ++r) J[r] = _mm512_add_epi32(J[r], second[r]);
  } else if constexpr (H == 1) {
    __m512i acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
    pair_codes<KIND>(a, p, q, b, [&](int c, __m512i lo, __m512i hi) {
      for (int r = 0; r < MR; ++r) {
        acc[r] = dpbusd_x(acc[r], lo, xr[r], 32 * b + 4 * c);
        acc[r] = dpbusd_x(acc[r], hi, xr[r], 32 * b + 16 + 4 * c);
      }
    });
    for (int r = 0; r < MR; ++r) J[r] = _mm512_add_epi32(J[r], _mm512_mullo_epi32(acc[r], S0));
  } else {
    __m512i a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
    pair_codes<KIND>(a, p, q, b, [&](int c, __m512i lo, __m512i hi) {
      for (int r = 0; r < MR; ++r) {
        a0[r] = _mm512_dpbusd_epi32(a0[r], lo, xload16(xr[r], 32 * b + 4 * c));
        a1[r] = _mm512_dpbusd_epi32(a1[r], hi, xload16(xr[r], 32 * b + 16 + 4 * c));
      }
    });
    for (int r = 0; r < MR; ++r)
      J[r] = _mm512_add_epi32(J[r], _mm512_add_epi32(_mm512_mullo_epi32(a0[r], S0), _mm512_mullo_epi32(a1[r], S1)));
  }
}

// int32 lanes holding small values -> the int16 pair (lo, hi) in each lane (a VPDPWSSD operand).
inline __m512i pair16_512(__m512i lo, __m512i hi) {
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(hi, 16));
}

constexpr int64_t kMaxPairGroup = 8;  // blocks per scale group (K-quants: 8)

// Rows m0 .. m0 + MR - 1 of panels p and q (lanes 0-7 and 8-15; q = p: a last, lone panel), the outputs in `keep`
// stored. Per scale group: first the blocks' integers J of every row (the hot loop: only
// the rows' sums live), then per row the zero-point and offset terms, int16 pair dot products of the blocks'
// multipliers (kept from the first pass) with the row's half sums, and the group's fp32 steps.
template <int MR, int KIND, int H, int OFF>
void pair_rows(const Args& a, int64_t p, int64_t q, int64_t m0, __mmask16 keep) {
  __m512 yv[MR];
  const int8_t* xr[MR];
  for (int r = 0; r < MR; ++r) {
    yv[r] = _mm512_setzero_ps();
    xr[r] = a.xq + (m0 + r) * a.K;
  }
  const bool zero = a.zshift >= 0;
  const __m128i shift = _mm_cvtsi32_si128(zero ? a.zshift : 0);
  const __m512i ones = _mm512_set1_epi16(1);
  __m512i spair[kMaxPairGroup], cpair[kMaxPairGroup];  // per block: (s_0, s_1) and (c, c) as int16 pairs
  __m512i cmult[kMaxPairGroup];  // per block: c (OFF == 2)
  const bool two = OFF == 2 && a.xsum != nullptr;  // the offset term two blocks per VPDPWSSD (an even group)
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t b0 = g * a.group;
    __m512i Jg[MR];
    for (int r = 0; r < MR; ++r) Jg[r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < a.group; ++j) {
      const int64_t b = b0 + j;
      prefetch_pair<KIND>(a, p, q, b, kPairsAhead);
      __m512i S0 = _mm512_set1_epi32(1), S1 = S0;
      if constexpr (H == 1) {
        S0 = S1 = int8_pair(a.s + (p * a.B + b) * 8, a.s + (q * a.B + b) * 8);
      } else if constexpr (H == 2) {
        const int8_t* s0 = a.s + (p * a.B + b) * 16;
        const int8_t* s1 = a.s + (q * a.B + b) * 16;
        S0 = int8_pair(s0, s1);
        S1 = int8_pair(s0 + 8, s1 + 8);
      }
      // (the pairs only where they are used: Q4_K has no zero point and takes the offset two blocks at a time)
      if (zero) spair[j] = pair16_512(S0, S1);
      if constexpr (OFF == 2) cmult[j] = int8_pair(a.cm + (p * a.B + b) * 8, a.cm + (q * a.B + b) * 8);
      if (!two) cpair[j] = OFF == 2 ? pair16_512(cmult[j], cmult[j]) : ones;  // c * bsum_0 + c * bsum_1
      pair_block_accumulate<MR, KIND, H>(a, p, q, b, xr, S0, S1, Jg);
    }
    if (two)  // (c_2i, c_2i+1) per output, with each row's (X_2i, X_2i+1): the same T, half the VPDPWSSD
      for (int64_t i = 0; i < a.group / 2; ++i) cpair[i] = pair16_512(cmult[2 * i], cmult[2 * i + 1]);
    const __m512 Av = float_pair(a.A + (p * a.G + g) * kPanel, a.A + (q * a.G + g) * kPanel);
    __m512 Cv = _mm512_setzero_ps();
    if constexpr (OFF != 0) Cv = float_pair(a.C + (p * a.G + g) * kPanel, a.C + (q * a.G + g) * kPanel);
    for (int r = 0; r < MR; ++r) {
      const int32_t* bp = a.bp + (m0 + r) * a.B + b0;  // the blocks' half sums as int16 pairs
      __m512i J = Jg[r];
      if (zero) {  // J -= zero * sum_b sum_h s_h * bsum_h
        __m512i Z = _mm512_setzero_si512();
        for (int64_t j = 0; j < a.group; ++j) Z = _mm512_dpwssd_epi32(Z, spair[j], _mm512_set1_epi32(bp[j]));
        J = _mm512_sub_epi32(J, _mm512_sll_epi32(Z, shift));
      }
      const __m512 d = _mm512_set1_ps(a.dx[(m0 + r) * a.G + g]);
      yv[r] = _mm512_add_ps(yv[r], _mm512_mul_ps(_mm512_mul_ps(Av, d), _mm512_cvtepi32_ps(J)));
      if constexpr (OFF != 0) {  // T = sum_b c_b * (bsum_0 + bsum_1)
        __m512i T = _mm512_setzero_si512();
        if (two) {
          const int16_t* xs = a.xsum + (m0 + r) * a.B + b0;
          for (int64_t i = 0; i < a.group / 2; ++i) {
            int32_t both;
            std::memcpy(&both, xs + 2 * i, 4);
            T = _mm512_dpwssd_epi32(T, cpair[i], _mm512_set1_epi32(both));
          }
        } else {
          for (int64_t j = 0; j < a.group; ++j) T = _mm512_dpwssd_epi32(T, cpair[j], _mm512_set1_epi32(bp[j]));
        }
        yv[r] = _mm512_add_ps(yv[r], _mm512_mul_ps(_mm512_mul_ps(Cv, d), _mm512_cvtepi32_ps(T)));
      }
    }
  }
  for (int r = 0; r < MR; ++r) store_pair(a, m0 + r, p, q, keep, yv[r]);
}

// Panels p and q in one 512-bit vector, 1-12 rows per call (gemm_gguf_avx2.cpp's pick: 9 rows in one call, whose
// split as 5 + 4 unpacked every block twice: one Q6_K [1536, 8960] layer, 9 rows, 0.99 -> 0.83 ms).
struct Pairs {
  using Fn = void (*)(const Args&, int64_t, int64_t, int64_t, __mmask16);
  static constexpr int kRows = 12;
  template <int MR, int KIND, int H, int OFF>
  static constexpr Fn fn = &pair_rows<MR, KIND, H, OFF>;
};

// Blocks of 32 inputs with one scale each and no sub-scales (group 1, H 0: Q4_0, Q4_1, Q5_0, Q8_0; the PARD
// drafter's Q4_0), panels p and q (lanes 0-7 and 8-15), rows m0 .. m0 + MR - 1, from one row on. pair_rows ran these
// until 2026-12-07 (and the 256-bit panels below 4 rows), but with a scale group of one block its per-group work
// cost as much as the products: the zero-point term (zero x the block's activation sum, one integer per row for all
// 16 lanes) was a VPDPWSSD + shift + subtract per row and block, and with the group's length known only at run time
// GCC kept the rows' sums on the stack (a store after every VPDPBUSD). Here each row's sum starts at -(block sum <<
// zero shift) (Args::zb, one broadcast), takes the block's 8 VPDPBUSD in one chain (two chains measured the same at
// 1-4 rows), and the fp32 steps follow in registers: per row and block 8 products + 4 fp32 operations. The offset
// term of Q4_1 (c = 1) is the block sum itself (Args::xsum). Q8_0's signed codes go in as w + 128 (XOR 0x80, once
// per block for all rows) with zero point 128, instead of pair_rows' per-row sign fix. The same exact integers and
// the same fp32 sequence per output, so the same bits. The 0.5B drafter's 24 layers on the AMD EPYC Zen 4, one
// thread, CPU time (docs/kernels.md, 2026-12-07): 1 / 4 / 9 rows 12.2 / 23.2 / 43.2 -> 10.4 / 15.0 / 23.6 ms.
template <int MR, int KIND, int OFF>
void plain_pair_rows(const Args& a, int64_t p, int64_t q, int64_t m0, __mmask16 keep) {
  __m512 yv[MR];
  const int8_t* xr[MR];
  const int32_t* zr[MR];
  for (int r = 0; r < MR; ++r) {
    yv[r] = _mm512_setzero_ps();
    xr[r] = a.xq + (m0 + r) * a.K;
    zr[r] = a.zb + (m0 + r) * a.B;
  }
  constexpr int64_t bytes = block_bytes(KIND);
  for (int64_t b = 0; b < a.B; ++b) {
    prefetch_pair<KIND>(a, p, q, b, kPairsAhead);
    __m512i J[MR];
    for (int r = 0; r < MR; ++r) J[r] = _mm512_set1_epi32(zr[r][b]);
    if constexpr (KIND == kSigned) {
      const uint8_t* w0 = a.w + (p * a.B + b) * bytes;
      const uint8_t* w1 = a.w + (q * a.B + b) * bytes;
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m512i u = _mm512_xor_si512(load_pair(w0 + 32 * t, w1 + 32 * t), _mm512_set1_epi8(char(0x80)));
        for (int r = 0; r < MR; ++r) J[r] = dpbusd_x(J[r], u, xr[r], 32 * b + 4 * t);
      }
    } else {
      pair_codes<KIND>(a, p, q, b, [&](int c, __m512i lo, __m512i hi) {
        for (int r = 0; r < MR; ++r) {
          J[r] = dpbusd_x(J[r], lo, xr[r], 32 * b + 4 * c);
          J[r] = dpbusd_x(J[r], hi, xr[r], 32 * b + 16 + 4 * c);
        }
      });
    }
    const __m512 Av = float_pair(a.A + (p * a.B + b) * kPanel, a.A + (q * a.B + b) * kPanel);
    __m512 Cv = _mm512_setzero_ps();
    if constexpr (OFF != 0) Cv = float_pair(a.C + (p * a.B + b) * kPanel, a.C + (q * a.B + b) * kPanel);
    for (int r = 0; r < MR; ++r) {
      const __m512 d = _mm512_set1_ps(a.dx[(m0 + r) * a.B + b]);
      yv[r] = _mm512_add_ps(yv[r], _mm512_mul_ps(_mm512_mul_ps(Av, d), _mm512_cvtepi32_ps(J[r])));
      if constexpr (OFF != 0) {  // T = the block's activation sum (c = 1)
        const __m512 T = _mm512_set1_ps(static_cast<float>(a.xsum[(m0 + r) * a.B + b]));
        yv[r] = _mm512_add_ps(yv[r], _mm512_mul_ps(_mm512_mul_ps(Cv, d), T));
      }
    }
  }
  for (int r = 0; r < MR; ++r) store_pair(a, m0 + r, p, q, keep, yv[r]);
}

struct PlainPairs {
  using Fn = Pairs::Fn;
  static constexpr int kRows = Pairs::kRows;
  template <int MR, int KIND, int H, int OFF>
  static constexpr Fn fn = &plain_pair_rows<MR, KIND, OFF>;
};
