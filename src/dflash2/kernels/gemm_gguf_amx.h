// The Intel AMX-INT8 path of gemm_gguf_avx2.cpp (included there, inside its namespace, in the build made with
// -mamx-tile -mamx-int8 on top of AVX512-VNNI; used from kAmxRows rows): the integer sums run on tiles instead
// of VPDPBUSD; the fp32 steps are the VNNI pair kernel's.
//
// Why: with VPDPBUSD each row costs 8 instructions per block of 32 inputs and 16 outputs, so verifying 9 rows costs
// about 9 times the arithmetic of one and the forward stops being memory-bound. One TDPBSUD multiplies up to 16
// rows of activation bytes by a block's 32 x 16 weight codes at once; what stays per row is an add per block
// (kinds without sub-scales) or per scale group (the folded K-quants), so a block's cost grows slowly with the rows.
//
// Per panel pair (p, q: 16 outputs, as in gemm_gguf_vnni.h), scale group and chunk of <= 16 rows:
//   B tile of block b (8 rows x 64 bytes, the layout TDPB*D wants: row t = inputs 4t .. 4t + 3 of the 16 outputs)
//     = the block's codes widened to bytes with the zero point subtracted (u - zero: signed where zero > 0), made
//     for the whole group before its first tile load (a tile load right after the stores it reads waits for them);
//   A tile = the rows' 32 activation bytes of the block, read from xq where they lie (stride K);
//   P_b = A . B (int32 [rows, 16]: sum_k (u - zero) x per output, exact), stored; per row J += P_b;
//   with an offset, T = sum_b A_b . O_b accumulates in a tile over the group, O_b the block's offset multipliers
//     c_b (1 for Q4_1) repeated down its 8 rows (one 64-byte row loaded with stride 0): T = sum_b c_b sum_k x.
// Q4_K and Q6_K fold their sub-scales into B instead (tile_pair_rows); kinds with sub-scales run on tiles only
// folded. J and T are the exact integers of the pair kernel (the zero point folded into the codes instead
// of subtracted as zero * sums of x), and the fp32 steps per output are its sequence, so the result is the same bits
// as the VNNI and AVX2 builds (tested, and self-checked at load).

// Rows from which gguf_matmul takes the tiles (fewer: the 256-bit panels or the VNNI pairs), every block kind. Q4_K
// took them from 2 rows until 2026-12-05 (one [17920, 1536] layer, 2 / 3 rows: 0.83 / 0.85 ms on tiles against 0.97
// / 1.01 on the pairs, before the panels and pairs prefetched their codes); since, the panels are faster there:
// whole 1.5B forwards (Emerald Rapids Xeon, 200 cached, alternating builds in one process) at 2 / 3 rows 52.2 / 54.4
// -> 49.4 / 51.0 ms and 62.8 / 65.1 -> 52.4 / 52.3 in a phase where a neighbour shared the tile unit.
constexpr int kAmxRows = 4;
constexpr int kTileRows = 16;
constexpr int kMaxGroup = 8;  // blocks per scale group (K-quants: 8)

// Tiles 0 / 3: P (rows x 16 int32); 1 / 4: A (rows x 32 bytes); 2 / 5: B (8 rows x 64); 6: T (rows x 16 int32);
// 7: O (as B). Even blocks use tiles 0-2 and odd ones 3-5, so two blocks' tile work can be in flight. Folded (k = 64,
// two blocks per product): 0 / 3 the group's C0 / C1, 1 / 4 A (rows x 64 bytes), 2 / 5 and 6 / 7 the low / high
// digits' B (16 rows x 64), alternating by pair of blocks.
// k: the inputs of one tile product (32 for a block, 64 for two folded blocks).
inline void gguf_tile_config(int rows, int k) {
  TileConfig cfg;
  const bool folded = k == 64;
  for (int t : {0, 3, 6}) { cfg.rows[t] = static_cast<uint8_t>(rows); cfg.colsb[t] = 64; }
  for (int t : {1, 4}) { cfg.rows[t] = static_cast<uint8_t>(rows); cfg.colsb[t] = static_cast<uint16_t>(k); }
  for (int t : {2, 5, 7}) { cfg.rows[t] = static_cast<uint8_t>(k / 4); cfg.colsb[t] = 64; }
  if (folded) cfg.rows[6] = 16;
  _tile_loadconfig(&cfg);
}

// The tile intrinsics are asm statements without a memory clobber (see gemm_amx.cpp): keep the buffer stores
// before the tile loads that read them, and the tile stores before the vector loads.
inline void tile_barrier() { asm volatile("" ::: "memory"); }

// Block b of panels p, q widened to one byte per code, minus the zero point: out[t] = step t's 64 bytes (inputs
// 4t .. 4t + 3 of the 16 outputs, panel p in bytes 0-31), the B operand's layout.
template <int KIND>
inline void widen_pair_block(const Args& a, int64_t p, int64_t q, int64_t b, bool has_zero, __m512i zero,
                             uint8_t (*out)[64]) {
  auto put = [&](int t, __m512i v) { _mm512_store_si512(reinterpret_cast<__m512i*>(out[t]), v); };
  if constexpr (KIND == kSigned) {
    const uint8_t* w0 = a.w + (p * a.B + b) * block_bytes(KIND);
    const uint8_t* w1 = a.w + (q * a.B + b) * block_bytes(KIND);
    for (int t = 0; t < 8; ++t) put(t, load_pair(w0 + 32 * t, w1 + 32 * t));
  } else {
    pair_codes<KIND>(a, p, q, b, [&](int c, __m512i lo, __m512i hi) {
      if (has_zero) {
        lo = _mm512_sub_epi8(lo, zero);
        hi = _mm512_sub_epi8(hi, zero);
      }
      put(c, lo);
      put(c + 4, hi);
    });
  }
}

// Q4_K's block b of panels p, q widened with each output's sub-scale folded in (the B operands of a folded scale
// group): s = 16 s1 + s0 (s <= 63), low[t] = s0 * u and high[t] = s1 * u, each <= 225 and so a byte. One VPMULLW
// scales two codes at once: in a 16-bit word u0 + 256 u1, s0 * u0 < 256 never carries into the high byte.
inline void widen_folded_block(const Args& a, int64_t p, int64_t q, int64_t b, uint8_t (*low)[64],
                               uint8_t (*high)[64]) {
  const __m512i s = int8_pair(a.s + (p * a.B + b) * 8, a.s + (q * a.B + b) * 8);  // per output (lane), 0..63
  auto in_both_words = [](__m512i v) { return _mm512_or_si512(v, _mm512_slli_epi32(v, 16)); };
  const __m512i s0 = in_both_words(_mm512_and_si512(s, _mm512_set1_epi32(15)));
  const __m512i s1 = in_both_words(_mm512_srli_epi32(s, 4));
  auto put = [](uint8_t* out, __m512i v) { _mm512_store_si512(reinterpret_cast<__m512i*>(out), v); };
  pair_codes<kNib4>(a, p, q, b, [&](int c, __m512i lo, __m512i hi) {
    put(low[c], _mm512_mullo_epi16(lo, s0));
    put(low[c + 4], _mm512_mullo_epi16(hi, s0));
    put(high[c], _mm512_mullo_epi16(lo, s1));
    put(high[c + 4], _mm512_mullo_epi16(hi, s1));
  });
}

// Byte 4n + i of the result (i = 0..3) = byte n of `both` (16 bytes, one per output of a pair of panels: panel p's 8
// then q's): each output's byte in the four bytes of its 32-bit lane, one VPSHUFB per 128-bit lane.
inline __m512i per_output_bytes(__m128i both) {
  alignas(64) static constexpr int8_t kIndex[64] = {  // (VPSHUFB indexes within each 128-bit lane)
      0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
      4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7,
      8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11,
      12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15};
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(both),
                             _mm512_load_si512(reinterpret_cast<const __m512i*>(kIndex)));
}

// Q6_K's block b of panels p, q widened with each output's sub-scale folded in (the B operands of a folded scale
// group with 16-bit products): v = s_h * (u - zero) (|v| <= 128 * 63: an int16; s_h the output's sub-scale of the
// block's half h) split into its bytes, v = 256 hi + lo (lo unsigned, hi signed), low[t] = lo and high[t] = hi.
// VPMADDUBSW makes the products of one byte of each word: with s_h at the even (odd) byte of each word of an output's
// lane and 0 at the other, a word of maddubs(u, ...) is s_h * u of its even (odd) code (|s_h u| <= 128 * 63, no
// saturation), and - zero s_h makes it v. Then the low bytes are even v & 0xFF | odd v << 8 and the high bytes
// even v >> 8 | odd v & 0xFF00, one VPTERNLOGD each: 8 vector operations per 64 codes (sign-extending the even and
// odd codes apart and multiplying each took 11).
inline void widen_folded16_block(const Args& a, int64_t p, int64_t q, int64_t b, int zero_point, uint8_t (*low)[64],
                                 uint8_t (*high)[64]) {
  const int8_t* s0 = a.s + (p * a.B + b) * 16;
  const int8_t* s1 = a.s + (q * a.B + b) * 16;
  struct Half {
    __m512i even, odd, offset;  // s_h at the even / odd byte of each word and 0 at the other; zero * s_h in each word
  };
  const __m512i zero_bytes = _mm512_set1_epi16(static_cast<int16_t>(zero_point));  // (zero, 0) in each word
  const __m512i low_byte = _mm512_set1_epi16(0x00FF), high_byte = _mm512_set1_epi16(static_cast<int16_t>(0xFF00));
  auto half = [&](const int8_t* sp, const int8_t* sq) {  // the sub-scales of one half of the block, 8 per panel
    const __m512i s = per_output_bytes(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp)),
                                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sq))));
    return Half{_mm512_and_si512(s, low_byte), _mm512_and_si512(s, high_byte), _mm512_maddubs_epi16(zero_bytes, s)};
  };
  const Half h0 = half(s0, s1), h1 = half(s0 + 8, s1 + 8);
  auto put = [&](int t, __m512i codes, const Half& h) {
    const __m512i even = _mm512_sub_epi16(_mm512_maddubs_epi16(codes, h.even), h.offset);
    const __m512i odd = _mm512_sub_epi16(_mm512_maddubs_epi16(codes, h.odd), h.offset);
    _mm512_store_si512(reinterpret_cast<__m512i*>(low[t]),
                       _mm512_ternarylogic_epi32(_mm512_slli_epi16(odd, 8), even, low_byte, kOrAnd));
    _mm512_store_si512(reinterpret_cast<__m512i*>(high[t]),
                       _mm512_ternarylogic_epi32(_mm512_srli_epi16(even, 8), odd, high_byte, kOrAnd));
  };
  pair_codes<kNib6>(a, p, q, b, [&](int c, __m512i lo, __m512i hi) {  // steps 0-3: the first half, 4-7 the second
    put(c, lo, h0);
    put(c + 4, hi, h1);
  });
}

// Block b's offset multipliers of panels p, q, one per output's lane.
inline __m512i offset_mults(const Args& a, int64_t p, int64_t q, int64_t b) {
  const __m128i c = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.cm + (p * a.B + b) * 8)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.cm + (q * a.B + b) * 8)));
  return _mm512_cvtepu8_epi32(c);
}

// The same, each repeated in the 4 bytes of its output's lane.
inline __m512i offset_row(const Args& a, int64_t p, int64_t q, int64_t b) {
  return _mm512_mullo_epi32(offset_mults(a, p, q, b), _mm512_set1_epi32(0x01010101));
}

// TDPBSSD where the B bytes are signed (Q8_0, codes minus a zero point), else TDPBSUD (unsigned codes).
#define GGUF_TILE_DP(signed_b, c, x, w) \
  do {                                  \
    if (signed_b) {                     \
      _tile_dpbssd(c, x, w);            \
    } else {                            \
      _tile_dpbsud(c, x, w);            \
    }                                   \
  } while (0)

// One tile product into tiles TC (P), TA (A), TB (B): P = A . B stored to `out` (int32 [rows, 16]); with an
// offset also T (tile 6) += A . O (tile 7 holds the block's offset row, read with stride 0). A macro: GCC's tile
// intrinsics paste the tile number into the instruction, so it must be a literal.
#define GGUF_TILE_PRODUCT(TC, TA, TB, offset, xb, K, w, orow, signed_b, out) \
  do {                                                                        \
    _tile_zero(TC);                                                           \
    _tile_loadd(TA, xb, K);                                                   \
    _tile_loadd(TB, w, 64);                                                   \
    GGUF_TILE_DP(signed_b, TC, TA, TB);                                       \
    if (offset) {                                                             \
      _tile_loadd(7, orow, 0);                                                \
      _tile_dpbsud(6, TA, 7);                                                 \
    }                                                                         \
    _tile_stored(TC, out, 64);                                                \
  } while (0)

// Two folded blocks (K = 64 inputs): A (tile TA) times the low digits' B (tile TL) into C0 (tile 0) and times the
// high digits' B (tile TH) into C1 (tile 3), both accumulating over the scale group, so nothing is stored per
// block. The B operands of blocks j, j + 1 lie one after the other (16 rows of 64 bytes). The high digits are
// unsigned for Q4_K, signed for Q6_K (signed_high). The offset term is vector work in `finish` (a third product
// would cost half again).
#define GGUF_TILE_FOLDED(TA, TL, TH, xb, K, low, high, signed_high) \
  do {                                                             \
    _tile_loadd(TA, xb, K);                                        \
    _tile_loadd(TL, low, 64);                                      \
    _tile_dpbsud(0, TA, TL);                                       \
    _tile_loadd(TH, high, 64);                                     \
    GGUF_TILE_DP(signed_high, 3, TA, TH);                          \
  } while (0)

// Whether a block kind takes the folded path: Q4_K (4-bit codes, a sub-scale per block, offsets; two 4-bit digits
// of the sub-scale, J = 16 C1 + C0) or Q6_K (6-bit codes, a sub-scale per half block, no offset; the two bytes of
// 16-bit products, J = 256 C1 + C0).
constexpr bool folded_kind(int kind, int h, int off) {
  return (kind == kNib4 && h == 1 && off == 2) || (kind == kNib6 && h == 2 && off == 0);
}

// Whether a block kind runs on tiles: without sub-scales (Q4_0, Q4_1, Q5_0, Q8_0) or folded (Q4_K, Q6_K).
constexpr bool tiles_take(int kind, int h, int off) { return h == 0 || folded_kind(kind, h, off); }

// Block j's tile product for one chunk of rows (xb: the chunk's first row at the block's first input) into prod,
// int32 [rows, 16]: even blocks take tiles 0-2 and odd ones 3-5 (two blocks in flight).
template <bool OFFSET>
inline void tile_block(const int8_t* xb, int64_t K, int j, bool signed_b, const uint8_t (*wide)[64],
                       const uint8_t* orow, int32_t* prod) {
  if ((j & 1) == 0) {
    GGUF_TILE_PRODUCT(0, 1, 2, OFFSET, xb, K, wide[0], orow, signed_b, prod);
  } else {
    GGUF_TILE_PRODUCT(3, 4, 5, OFFSET, xb, K, wide[0], orow, signed_b, prod);
  }
}

// The rows of one call on tiles: x (xq, or a copy padded with zero rows to a multiple of `rows` when there are more
// than 16 rows), `rows` per tile chunk (all of them up to 16, else as few chunks of <= 16 as can hold them, evenly
// sized), `pass` rows per pass (a multiple of `rows`, <= kPassRows).
struct TileRows {
  const int8_t* x;
  int rows, pass;
  const int16_t* xsum;  // folded only: each row's sum of x over each block, [rows, B]
};

constexpr int kPassRows = 64;  // rows whose sums one pass keeps (4 tile chunks per widened group of blocks)

// A scale group's tile operands, made before its tiles: the codes widened (B tiles) and the offset rows (O).
struct GroupOperands {
  alignas(64) uint8_t wide[kMaxGroup][8][64];  // (folded: the low digits)
  alignas(64) uint8_t wide_high[kMaxGroup][8][64];  // folded only: the high digits
  alignas(64) uint8_t orow[kMaxGroup][64];
};

// Folded with offsets: a scale group's offset multipliers, blocks 2i, 2i + 1's as an int16 pair per output (read by
// the sums, not by the tiles).
struct GroupOffsets {
  __m512i C16[kMaxGroup / 2];
};

// One unit of tile work: a scale group g for one chunk of rows; its products, stored for the sums.
struct UnitSums {
  alignas(64) int32_t prod[kMaxGroup][kTileRows * 16];  // unfolded: [block of the group][row * 16 + output]
  alignas(64) int32_t c[2][kTileRows * 16];              // folded: C0, C1
  alignas(64) int32_t tsum[kTileRows * 16];              // unfolded: T, with an offset
};

// Rows m0 .. m0 + mr - 1 (mr <= kPassRows) of panels p and q: pair_rows' arithmetic with the integer sums from
// tiles. Each scale group's codes are widened once and serve every row chunk of the pass. The work runs as a
// software pipeline over units (group g, chunk c), in order: while unit u's blocks go to the tiles one by one, the
// next group's blocks are widened and the sums of unit u - 1 are made a slice of rows at a time, so the vector
// units work while the tile unit does (run one after the other, their times add up).
//
// Q4_K (4-bit codes, a sub-scale per block, offsets, no zero point) folds each block's sub-scale into its B operands
// instead: s = 16 s1 + s0 splits s * u into two bytes (widen_folded_block), and the group's integers J = 16 C1 + C0
// accumulate in two C tiles (C_d = sum_b A_b . (s_d u)_b, two blocks per product: K = 64) with no per-block tile
// store and no per-row, per-block multiply. The offset term T = sum_b c_b X_b is vector work (X_b: the row's sum
// of x over block b, made once per call; one VPDPWSSD per two blocks) instead of a third tile product: a tile
// product costs by its K, nearly whatever the rows. The same exact J and T, so the same bits, for two VPMULLW per
// 64 codes in the widening, which every row count shares. (One [17920, 1536] Q4_K layer in cache, 9 rows: 0.87 ->
// 0.74 ms.)
//
// Q6_K (6-bit codes minus 32, a sub-scale per 16 inputs, no offset) folds too, with 16-bit products: v = s * (u - 32)
// fits an int16 and splits into an unsigned low and a signed high byte (widen_folded16_block), J = 256 C1 + C0. Per
// block it replaces two K = 16 tile products, each with a tile store of every row, and two VPMULLD per row by four
// VPMULLW per 64 codes in the widening. Measured on an Emerald Rapids Xeon (2 cores), each category of the 1.5B's
// layers as a forward reads them, 9 rows: the head 14.3 -> 11.2 ms, the down projections (half Q6_K) 20.3 -> 18.4.
template <int KIND, int H, int OFF>
void tile_pair_rows(const Args& a, const TileRows& t, int64_t p, int64_t q, int64_t m0, int mr, __mmask16 keep) {
  constexpr bool kFold = folded_kind(KIND, H, OFF);
  constexpr bool kFold16 = kFold && KIND == kNib6;  // (the folded bytes of 16-bit products: J = 256 C1 + C0)
  // By group: the tile operands modulo 2 (group g + 1's are made while group g's tiles run; group g - 1's tiles have
  // all been issued), the offsets modulo 3 (the sums of group g - 1 still read theirs). The tile operands are 8 KB
  // a group, and with three of them (as until 2026-12-05) the working set of a 9-row Q4_K pass (operands, the rows'
  // activation bytes, the products, the weights prefetched) outgrew the 48 KB L1: measured on the Emerald Rapids
  // Xeon, all 28 gate / up projections from memory, 9 rows 26.5 -> 22.1 ms, 4 rows 21.0 -> 20.1.
  GroupOperands ops[2];
  GroupOffsets offsets[3];
  UnitSums sums[2];      // by unit, modulo 2
  alignas(64) float yacc[kPassRows][16];
  const int zero_point = a.zshift >= 0 ? 1 << a.zshift : 0;
  const __m512i zero = _mm512_set1_epi8(static_cast<char>(zero_point));
  const bool signed_b = KIND == kSigned || zero_point != 0;
  const int nb = static_cast<int>(a.group);
  const int chunks = (mr + t.rows - 1) / t.rows;
  const int64_t units = a.G * chunks;
  if constexpr (OFF == 1) {  // Q4_1: T = the sum of x over the block (c = 1)
    for (auto& o : ops)
      for (int j = 0; j < nb; ++j) _mm512_store_si512(reinterpret_cast<__m512i*>(o.orow[j]), _mm512_set1_epi8(1));
  }
  for (int r = 0; r < mr; ++r) _mm512_store_ps(yacc[r], _mm512_setzero_ps());

  auto make = [&](int64_t g, int j) {  // group g's block j: codes, offset row or multipliers
    GroupOperands& o = ops[g % 2];
    const int64_t b = g * a.group + j;
    if constexpr (kFold16) {
      widen_folded16_block(a, p, q, b, zero_point, o.wide[j], o.wide_high[j]);
    } else if constexpr (kFold) {
      widen_folded_block(a, p, q, b, o.wide[j], o.wide_high[j]);
    } else {
      widen_pair_block<KIND>(a, p, q, b, zero_point != 0, zero, o.wide[j]);
    }
    {  // the codes kTilesAhead blocks ahead (past the panels' end: the next pair's, read next by this thread):
       // the hardware prefetcher alone leaves the tiles waiting for memory. Written out here: the same prefetches
       // through prefetch_pair made the 4-row forward 16-26% slower (Intel Xeon (AMX), 2026-12-05, A/B runs)
      constexpr int64_t per_block = block_bytes(KIND);
      const int64_t ahead = b + kTilesAhead, next = ahead < a.B ? 0 : 2;
      const uint8_t* w0 = a.w + ((p + next) * a.B + ahead % a.B) * per_block;
      const uint8_t* w1 = a.w + ((q + next) * a.B + ahead % a.B) * per_block;
      for (int64_t off = 0; off < per_block; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + off), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w1 + off), _MM_HINT_T0);
      }
    }
    if constexpr (kFold) {  // (the sub-scales are in the B operands)
      if (OFF != 0 && (j & 1)) {
        offsets[g % 3].C16[j / 2] = pair16_512(offset_mults(a, p, q, b - 1), offset_mults(a, p, q, b));
      }
    } else if constexpr (OFF == 2) {
      _mm512_store_si512(reinterpret_cast<__m512i*>(o.orow[j]), offset_row(a, p, q, b));
    }
  };
  struct Unit {  // what the sums of one unit read, found once per unit (its rows are made in nb slices)
    const GroupOffsets* o;
    const UnitSums* us;
    int64_t g;
    int c0, rows;
    __m512 Av, Cv;
  };
  auto unit_of = [&](int64_t u) {
    Unit w;
    w.g = u / chunks;
    w.c0 = static_cast<int>(u % chunks) * t.rows;
    w.rows = std::min(t.rows, mr - w.c0);
    w.o = &offsets[w.g % 3];
    w.us = &sums[u % 2];
    w.Av = float_pair(a.A + (p * a.G + w.g) * kPanel, a.A + (q * a.G + w.g) * kPanel);
    w.Cv = _mm512_setzero_ps();
    if constexpr (OFF != 0) w.Cv = float_pair(a.C + (p * a.G + w.g) * kPanel, a.C + (q * a.G + w.g) * kPanel);
    return w;
  };
  auto finish = [&](const Unit& w, int i0, int i1) {  // rows i0 .. i1 - 1 of unit w's chunk: J, then the fp32 steps
    const int64_t g = w.g;
    const int c0 = w.c0;
    const GroupOffsets& o = *w.o;
    const UnitSums& us = *w.us;
    const __m512 Av = w.Av, Cv = w.Cv;
    for (int i = i0; i < i1; ++i) {
      const int64_t m = m0 + c0 + i;
      __m512i J = _mm512_setzero_si512();
      if constexpr (kFold) {  // J = 16 C1 + C0 (Q4_K), 256 C1 + C0 (Q6_K)
        const __m512i C0 = _mm512_load_si512(reinterpret_cast<const __m512i*>(us.c[0] + 16 * i));
        const __m512i C1 = _mm512_load_si512(reinterpret_cast<const __m512i*>(us.c[1] + 16 * i));
        J = _mm512_add_epi32(_mm512_slli_epi32(C1, kFold16 ? 8 : 4), C0);
      } else {
        for (int j = 0; j < nb; ++j) {
          J = _mm512_add_epi32(J, _mm512_load_si512(reinterpret_cast<const __m512i*>(us.prod[j] + 16 * i)));
        }
      }
      const __m512 d = _mm512_set1_ps(a.dx[m * a.G + g]);
      __m512 y = _mm512_load_ps(yacc[c0 + i]);
      y = _mm512_add_ps(y, _mm512_mul_ps(_mm512_mul_ps(Av, d), _mm512_cvtepi32_ps(J)));
      if constexpr (OFF != 0) {
        __m512i T = _mm512_setzero_si512();
        if constexpr (kFold) {  // T = sum_b c_b X_b over the group, two blocks per VPDPWSSD
          const int16_t* xs = t.xsum + m * a.B + g * nb;
          for (int j = 0; j < nb / 2; ++j) {
            int32_t both;
            std::memcpy(&both, xs + 2 * j, 4);
            T = _mm512_dpwssd_epi32(T, o.C16[j], _mm512_set1_epi32(both));
          }
        } else {
          T = _mm512_load_si512(reinterpret_cast<const __m512i*>(us.tsum + 16 * i));
        }
        y = _mm512_add_ps(y, _mm512_mul_ps(_mm512_mul_ps(Cv, d), _mm512_cvtepi32_ps(T)));
      }
      _mm512_store_ps(yacc[c0 + i], y);
    }
  };

  for (int j = 0; j < nb; ++j) make(0, j);
  for (int64_t u = 0; u < units; ++u) {
    const int64_t g = u / chunks;
    const int c0 = static_cast<int>(u % chunks) * t.rows;
    const bool make_next = c0 == 0 && g + 1 < a.G;
    Unit prev{};
    int cut[kMaxGroup + 1] = {};  // the rows of unit u - 1 made after block j: cut[j] .. cut[j + 1] - 1
    if (u > 0) {
      prev = unit_of(u - 1);
      for (int j = 0; j <= nb; ++j) cut[j] = prev.rows * j / nb;
    }
    const int8_t* xc = t.x + (m0 + c0) * a.K + 32 * g * a.group;
    const GroupOperands& o = ops[g % 2];
    UnitSums& us = sums[u % 2];
    if constexpr (kFold) {
      _tile_zero(0);
      _tile_zero(3);
    }
    if constexpr (OFF != 0 && !kFold) _tile_zero(6);
    for (int j = 0; j < nb; ++j) {
      tile_barrier();
      if constexpr (kFold) {  // blocks j - 1, j at odd j
        const int i = j - 1;
        if ((j & 3) == 1) {
          GGUF_TILE_FOLDED(1, 2, 5, xc + 32 * i, a.K, o.wide[i][0], o.wide_high[i][0], kFold16);
        } else if ((j & 3) == 3) {
          GGUF_TILE_FOLDED(4, 6, 7, xc + 32 * i, a.K, o.wide[i][0], o.wide_high[i][0], kFold16);
        }
      } else {
        tile_block<OFF != 0>(xc + 32 * j, a.K, j, signed_b, o.wide[j], o.orow[j], us.prod[j]);
      }
      tile_barrier();
      if (make_next) make(g + 1, j);
      if (u > 0) finish(prev, cut[j], cut[j + 1]);
    }
    if constexpr (kFold) {
      _tile_stored(0, us.c[0], 64);
      _tile_stored(3, us.c[1], 64);
    }
    if constexpr (OFF != 0 && !kFold) _tile_stored(6, us.tsum, 64);
  }
  tile_barrier();
  const Unit last = unit_of(units - 1);
  finish(last, 0, last.rows);
  for (int r = 0; r < mr; ++r) store_pair(a, m0 + r, p, q, keep, _mm512_load_ps(yacc[r]));
}

struct Tiles {  // the AMX family: one function per (kind, sub-scales, offset); rows are a run-time argument
  using Fn = void (*)(const Args&, const TileRows&, int64_t, int64_t, int64_t, int, __mmask16);
  static constexpr int kRows = 1;
  template <int KIND, int H, int OFF>
  static constexpr Fn tile_fn() {
    if constexpr (tiles_take(KIND, H, OFF)) {
      return &tile_pair_rows<KIND, H, OFF>;
    } else {
      return nullptr;
    }
  }
  template <int MR, int KIND, int H, int OFF>
  static constexpr Fn fn = tile_fn<KIND, H, OFF>();
};

// Linux grants the tile state to a process on request (amx_tiles.h): asked once.
inline bool gguf_amx_granted() {
  static const bool granted = request_amx_tiles();
  return granted;
}

// All rows over panels in pairs, on tiles, in passes of <= kPassRows rows, each pass in chunks of `rows` (TileRows).
// The tile configuration is per thread: loaded once, released at the end (chunked_threads).
void tile_panels(const Args& a, int kind, int h, int off, int64_t M, int64_t P, int64_t grain) {
  const Tiles::Fn fn = pick<Tiles>(kind, h, off, 1);
  TORCH_CHECK(fn != nullptr, "gguf amx: this block kind does not run on tiles");
  const int64_t chunks = (M + kTileRows - 1) / kTileRows;
  const int rows = static_cast<int>((M + chunks - 1) / chunks);
  const bool fold = folded_kind(kind, h, off);
  TileRows t{a.xq, rows, kPassRows / rows * rows, nullptr};
  std::vector<int16_t> xsum;
  TORCH_CHECK(!fold || a.group % 2 == 0, "gguf amx: a folded group has its blocks in pairs");
  if (fold && off != 0) {  // (Q4_K: the offset term's block sums)
    TORCH_CHECK(a.zshift < 0, "gguf amx: a folded group with offsets has no zero point");
    xsum = block_sums(a.bs, M, a.B);
    t.xsum = xsum.data();
  }
  std::vector<int8_t> padded;
  if (M % rows != 0) {  // (only with more than 16 rows)
    padded.assign(static_cast<size_t>(chunks * rows * a.K), 0);
    std::memcpy(padded.data(), a.xq, static_cast<size_t>(M * a.K));
    t.x = padded.data();
  }
  chunked_threads((P + 1) / 2, grain, [&](Chunks& chunks) {
    gguf_tile_config(t.rows, fold ? 64 : 32);
    chunks.each([&](int64_t i) {
      const int64_t p = 2 * i, q = std::min(p + 1, P - 1);
      const __mmask16 keep = pair_keep(a, p, q);
      for (int64_t m = 0; m < M;) {
        const int mr = static_cast<int>(std::min<int64_t>(t.pass, M - m));
        fn(a, t, p, q, m, mr, keep);
        m += mr;
      }
    });
    _tile_release();
  });
}
