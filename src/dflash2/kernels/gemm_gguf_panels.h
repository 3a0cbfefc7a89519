// The 256-bit micro-kernel of gemm_gguf_avx2.cpp (included there, inside its namespace): one panel of 8 outputs,
// 1-4 rows per call (Panels). AVX2 + FMA: VPMADDUBSW + VPMADDWD per block of 32 inputs (block_integers); where the
// build has AVX512-VNNI (+ VL), 256-bit VPDPBUSD instead (block_integers_dp). The same exact integers either way,
// and per output the fp32 sequence of the file's header, so every build gives the same bits.

// fp32 -> bf16 bits as c10::BFloat16 rounds (to nearest, ties to even; NaN -> 0x7FC0), in the low half of each lane.
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i even = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(even, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// Row `row`'s outputs 8p .. 8p + nv - 1: the bias added (fp32, as y.add_(bias) after the product), stored as fp32 or
// bf16 (as y.to(bf16)): the same bits as the product stored, then those two operations.
inline void store_panel(const Args& a, int64_t row, int64_t p, int64_t nv, __m256 v) {
  const Output& o = a.out;
  const int64_t col = p * kPanel;
  alignas(32) float part[kPanel] = {};
  if (o.bias != nullptr) {
    std::memcpy(part, o.bias + col, nv * sizeof(float));
    v = _mm256_add_ps(v, _mm256_load_ps(part));
  }
  if (o.round_bf16) v = _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
  if (o.yb != nullptr) {
    const __m256i r = bf16_bits(v);
    alignas(16) uint16_t h[kPanel];
    _mm_store_si128(reinterpret_cast<__m128i*>(h),
                    _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    std::memcpy(o.yb + row * o.ld + col, h, nv * sizeof(uint16_t));
  } else {
    _mm256_store_ps(part, v);
    std::memcpy(o.y + row * o.ld + col, part, nv * sizeof(float));
  }
}

// The 4 activation bytes of inputs k .. k+3 of a row, broadcast to the 8 int32 lanes (one load: VPBROADCASTD).
inline __m256i xload(const int8_t* row, int64_t k) {
  int32_t four;
  std::memcpy(&four, row + k, 4);
  return _mm256_set1_epi32(four);
}

// Keeps an accumulator in a register at this point of the loop. Without it GCC 12 computed every product of a block
// for all rows first and added them up afterwards, so with 3-4 rows the products (and the accumulators across
// blocks) did not fit AVX2's 16 vector registers: 30-75 vector spills in each 3- or 4-row micro-kernel.
// An empty asm ties each row's update to its step; it emits no instruction and changes no value.
inline void in_register(__m256i& v) { asm volatile("" : "+x"(v)); }

// 8 int8 -> 8 int32 lanes whose two int16 halves both hold the value (a _mm256_madd_epi16 multiplier).
inline __m256i dup16(const int8_t* p) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

// lanes (lo[o], hi[o]) as int16 pairs.
inline __m256i pair16(const int8_t* lo, const int8_t* hi) {
  const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo)));
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi)));
  return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(b, 16));
}

// J (int32 per output) of MR rows over block b of panel p; S0 / S1: the sub-scale multipliers of each half.
template <int MR, int KIND, int H>
inline void block_integers(const Args& a, int64_t p, int64_t b, const int8_t* const* xr, __m256i S0, __m256i S1,
                           __m256i* J) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (KIND == kNib4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t* wp = a.w + (p * a.B + b) * 128;
    if constexpr (H == 2) {  // two halves with their own sub-scales: two int16 sums per row
      __m256i a0[MR], a1[MR];
      for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * c));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int r = 0; r < MR; ++r) {  // <= 4 x 2 x 15 x 127 per int16 lane: no overflow
          a0[r] = _mm256_add_epi16(a0[r], _mm256_maddubs_epi16(lo, xload(xr[r], 32 * b + 4 * c)));
          a1[r] = _mm256_add_epi16(a1[r], _mm256_maddubs_epi16(hi, xload(xr[r], 32 * b + 16 + 4 * c)));
          in_register(a0[r]);
          in_register(a1[r]);
        }
      }
      for (int r = 0; r < MR; ++r)
        J[r] = _mm256_add_epi32(_mm256_madd_epi16(a0[r], S0), _mm256_madd_epi16(a1[r], S1));
    } else {  // one sub-scale per block: one int16 sum per row, <= 8 x 2 x 15 x 127 = 30480 (no overflow)
      __m256i acc[MR];
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * c));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int r = 0; r < MR; ++r) {
          acc[r] = _mm256_add_epi16(acc[r], _mm256_add_epi16(
              _mm256_maddubs_epi16(lo, xload(xr[r], 32 * b + 4 * c)),
              _mm256_maddubs_epi16(hi, xload(xr[r], 32 * b + 16 + 4 * c))));
          in_register(acc[r]);
        }
      }
      for (int r = 0; r < MR; ++r) J[r] = _mm256_madd_epi16(acc[r], S0);
    }
  } else if constexpr (KIND == kNib5 || KIND == kNib6) {  // low nibbles + a plane of the high bits (<= 63)
    constexpr int HB = KIND == kNib5 ? 1 : 2;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i hmask = _mm256_set1_epi8(HB == 1 ? 1 : 3);
    const uint8_t* wp = a.w + (p * a.B + b) * (128 + 32 * HB);
    const __m256i plane0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 128));
    const __m256i plane1 =
        HB == 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 160)) : plane0;
    // step t's high bits: plane (t * HB) / 8, shifted right by (t * HB) % 8, moved to bits 4..
    auto high = [&](int t) {
      const __m256i plane = (t * HB) / 8 == 0 ? plane0 : plane1;
      const __m256i h = _mm256_and_si256(_mm256_srli_epi16(plane, (t * HB) % 8), hmask);
      return _mm256_slli_epi16(h, 4);
    };
    for (int r = 0; r < MR; ++r) J[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int c = 0; c < 4; c += 2) {  // chunks c, c + 1: steps c, c + 1 (first half) and c + 4, c + 5 (second)
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * c));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * c + 32));
      const __m256i lo0 = _mm256_or_si256(_mm256_and_si256(v0, low4), high(c));
      const __m256i lo1 = _mm256_or_si256(_mm256_and_si256(v1, low4), high(c + 1));
      const __m256i hi0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low4), high(c + 4));
      const __m256i hi1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low4), high(c + 5));
      for (int r = 0; r < MR; ++r) {  // two steps per int16 sum: <= 2 x 2 x 63 x 127 = 32004
        const __m256i t0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xload(xr[r], 32 * b + 4 * c)),
                                            _mm256_maddubs_epi16(lo1, xload(xr[r], 32 * b + 4 * c + 4)));
        const __m256i t1 = _mm256_add_epi16(_mm256_maddubs_epi16(hi0, xload(xr[r], 32 * b + 16 + 4 * c)),
                                            _mm256_maddubs_epi16(hi1, xload(xr[r], 32 * b + 16 + 4 * c + 4)));
        J[r] = _mm256_add_epi32(J[r], _mm256_add_epi32(_mm256_madd_epi16(t0, S0), _mm256_madd_epi16(t1, S1)));
        in_register(J[r]);
      }
    }
  } else {  // signed bytes: |w| * sign(x, w), <= 2 x 128 x 127 per step
    for (int r = 0; r < MR; ++r) J[r] = _mm256_setzero_si256();
    const uint8_t* wp = a.w + (p * a.B + b) * 256;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * t));
      const __m256i av = _mm256_abs_epi8(v);
      for (int r = 0; r < MR; ++r) {
        const __m256i sx = _mm256_sign_epi8(xload(xr[r], 32 * b + 4 * t), v);
        J[r] = _mm256_add_epi32(J[r], _mm256_madd_epi16(_mm256_maddubs_epi16(av, sx), ones));
        in_register(J[r]);
      }
    }
  }
}

// acc + the sums of adjacent int16 products of a and b in each int32 lane (VPDPWSSD with VNNI, else VPMADDWD + add).
inline __m256i dot16_add(__m256i acc, __m256i a, __m256i b) {
#if GGUF_VNNI
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

#if GGUF_VNNI
// block_integers with 256-bit VPDPBUSD (AVX512-VNNI + VL): u8 x s8 products summed by 4 straight into int32 lanes,
// so each row's int16 adds and the VPMADDWD that widened them go; the sub-scales then multiply the int32 sums of
// each half (VPMULLD, shared by the rows' lanes). The same exact integers as block_integers, so the same bits.
template <int MR, int KIND, int H>
inline void block_integers_dp(const Args& a, int64_t p, int64_t b, const int8_t* const* xr, __m256i S0, __m256i S1,
                              __m256i* J) {
  __m256i a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
  if constexpr (KIND == kSigned) {  // |w| (u8) times x with w's sign
    const uint8_t* wp = a.w + (p * a.B + b) * 256;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * t));
      const __m256i av = _mm256_abs_epi8(v);
      for (int r = 0; r < MR; ++r)
        a0[r] = _mm256_dpbusd_epi32(a0[r], av, _mm256_sign_epi8(xload(xr[r], 32 * b + 4 * t), v));
    }
    for (int r = 0; r < MR; ++r) J[r] = a0[r];
    return;
  } else {
    constexpr int HB = KIND == kNib4 ? 0 : (KIND == kNib5 ? 1 : 2);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t* wp = a.w + (p * a.B + b) * (128 + 32 * HB);
    __m256i plane0 = _mm256_setzero_si256(), plane1 = _mm256_setzero_si256();
    if constexpr (HB > 0) plane0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 128));
    if constexpr (HB == 2) plane1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 160));
    auto high = [&](int t) {  // step t's high bits at bits 4..
      const __m256i plane = (t * HB) / 8 == 0 ? plane0 : plane1;
      const __m256i h = _mm256_and_si256(_mm256_srli_epi16(plane, (t * HB) % 8), _mm256_set1_epi8((1 << HB) - 1));
      return _mm256_slli_epi16(h, 4);
    };
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * c));
      __m256i lo = _mm256_and_si256(v, low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (HB > 0) {
        lo = _mm256_or_si256(lo, high(c));
        hi = _mm256_or_si256(hi, high(c + 4));
      }
      for (int r = 0; r < MR; ++r) {
        a0[r] = _mm256_dpbusd_epi32(a0[r], lo, xload(xr[r], 32 * b + 4 * c));
        a1[r] = _mm256_dpbusd_epi32(a1[r], hi, xload(xr[r], 32 * b + 16 + 4 * c));
      }
    }
    if constexpr (H == 0) {
      for (int r = 0; r < MR; ++r) J[r] = _mm256_add_epi32(a0[r], a1[r]);
    } else if constexpr (H == 1) {  // one sub-scale for both halves: the low int16 half of S0 (dup16)
      const __m256i s0 = _mm256_srai_epi32(_mm256_slli_epi32(S0, 16), 16);
      for (int r = 0; r < MR; ++r) J[r] = _mm256_mullo_epi32(_mm256_add_epi32(a0[r], a1[r]), s0);
    } else {  // the sub-scales: the low int16 half of S0 / S1 (dup16), sign-extended
      const __m256i s0 = _mm256_srai_epi32(_mm256_slli_epi32(S0, 16), 16);
      const __m256i s1 = _mm256_srai_epi32(_mm256_slli_epi32(S1, 16), 16);
      for (int r = 0; r < MR; ++r)
        J[r] = _mm256_add_epi32(_mm256_mullo_epi32(a0[r], s0), _mm256_mullo_epi32(a1[r], s1));
    }
  }
}

#endif

template <int MR, int KIND, int H, int OFF>
void panel_rows(const Args& a, int64_t p, int64_t m0, int64_t nv) {
  __m256 yv[MR];
  const int8_t* xr[MR];
  for (int r = 0; r < MR; ++r) {
    yv[r] = _mm256_setzero_ps();
    xr[r] = a.xq + (m0 + r) * a.K;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const bool zero = a.zshift >= 0;
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t b0 = g * a.group, b1 = (g + 1) * a.group;
    __m256i Jg[MR];
    for (int r = 0; r < MR; ++r) Jg[r] = _mm256_setzero_si256();
    for (int64_t b = b0; b < b1; ++b) {
      prefetch_block<KIND>(a.w + (p * a.B + b + kPanelsAhead) * block_bytes(KIND));  // (then panel p + 1's)
      __m256i S0 = ones, S1 = ones;
      if constexpr (H == 1) {
        S0 = S1 = dup16(a.s + (p * a.B + b) * 8);
      } else if constexpr (H == 2) {
        const int8_t* sp = a.s + (p * a.B + b) * 16;
        S0 = dup16(sp);
        S1 = dup16(sp + 8);
      }
      __m256i J[MR];
#if GGUF_VNNI
      block_integers_dp<MR, KIND, H>(a, p, b, xr, S0, S1, J);
#else
      block_integers<MR, KIND, H>(a, p, b, xr, S0, S1, J);
#endif
      for (int r = 0; r < MR; ++r) Jg[r] = _mm256_add_epi32(Jg[r], J[r]);
    }
    // The zero-point and offset terms read no codes: a second, short pass over the group's multipliers, so the
    // codes' loop above keeps one accumulator per row live, not three (AVX2 has 16 vector registers).
    __m256i Tg[MR];
    if (zero || OFF != 0) {
      __m256i Zg[MR];
      for (int r = 0; r < MR; ++r) Zg[r] = Tg[r] = _mm256_setzero_si256();
      for (int64_t b = b0; b < b1; ++b) {
        __m256i Spair = ones, CM = ones;  // CM: c as an int16 pair (c, c) per output: c * bsum_0 + c * bsum_1
        if constexpr (H == 1) Spair = dup16(a.s + (p * a.B + b) * 8);
        if constexpr (H == 2) Spair = pair16(a.s + (p * a.B + b) * 16, a.s + (p * a.B + b) * 16 + 8);
        if constexpr (OFF == 2) CM = dup16(a.cm + (p * a.B + b) * 8);
        for (int r = 0; r < MR; ++r) {
          // the block's half sums as an int16 pair; the zero-point and offset terms are pair dot products with it
          const __m256i bpair = _mm256_set1_epi32(a.bp[(m0 + r) * a.B + b]);
          if (zero) Zg[r] = dot16_add(Zg[r], Spair, bpair);  // sum_h s_h * bsum_h
          if constexpr (OFF != 0) Tg[r] = dot16_add(Tg[r], CM, bpair);
        }
      }
      if (zero) {  // J -= zero * sum_b sum_h s_h * bsum_h, once per group
        const __m128i shift = _mm_cvtsi32_si128(a.zshift);
        for (int r = 0; r < MR; ++r) Jg[r] = _mm256_sub_epi32(Jg[r], _mm256_sll_epi32(Zg[r], shift));
      }
    }
    const __m256 Av = _mm256_loadu_ps(a.A + (p * a.G + g) * kPanel);
    __m256 Cv = _mm256_setzero_ps();
    if constexpr (OFF != 0) Cv = _mm256_loadu_ps(a.C + (p * a.G + g) * kPanel);
    for (int r = 0; r < MR; ++r) {
      const __m256 d = _mm256_set1_ps(a.dx[(m0 + r) * a.G + g]);
      yv[r] = _mm256_add_ps(yv[r], _mm256_mul_ps(_mm256_mul_ps(Av, d), _mm256_cvtepi32_ps(Jg[r])));
      if constexpr (OFF != 0)
        yv[r] = _mm256_add_ps(yv[r], _mm256_mul_ps(_mm256_mul_ps(Cv, d), _mm256_cvtepi32_ps(Tg[r])));
    }
  }
  for (int r = 0; r < MR; ++r) store_panel(a, m0 + r, p, nv, yv[r]);
}

struct Panels {  // one panel of 8 outputs, 1-4 rows per call
  using Fn = void (*)(const Args&, int64_t, int64_t, int64_t);
  static constexpr int kRows = 4;
  template <int MR, int KIND, int H, int OFF>
  static constexpr Fn fn = &panel_rows<MR, KIND, H, OFF>;
};
