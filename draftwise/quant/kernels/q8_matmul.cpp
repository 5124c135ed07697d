// int4 and int8 weights x int8 activations with VNNI byte dot products: the quantized layers'
// compute-bound path (verification and prefill), where a bf16 kernel is held to one bf16 dot
// product per 2 weights and, for int4, to dequantizing every weight first.
//
// Activations. Each row of x is quantized in groups of 32 inputs: a[r,g] = max|x| / 127,
// p = round(x / a) in -127..127; sum_k p_k per group is kept (as offset[r,g] = a[r,g] sum_k p_k).
//
// int4 weights. A group g of 32 inputs of channel c holds w = s[c,g] q - m[c,g], q in 0..15 (GGUF
// Q4_K's own sub-blocks). Exactly in the algebra,
//   sum_{k in g} w_k x_k ~= a[r,g] (s[c,g] sum_k q_k p_k - m[c,g] sum_k p_k)
// The inner sum is an exact int32 (32 products of at most 15 * 127) from eight vpdpbusd, which take
// unsigned bytes (q) times signed bytes (p): no dequantization of the weights.
//
// int8 weights. w = s[c] v, v in -127..127, stored as v + 128 (unsigned for vpdpbusd); then
//   sum_k w_k x_k ~= s[c] (sum_g a[r,g] sum_{k in g} (v_k + 128) p_k - 128 sum_g offset[r,g])
// the last sum depending on the row alone (its `correction`, summed once per row in a fixed order).
//
// GGUF's super-block formats, exactly as the file holds them (256 inputs a super-block):
// Q4_K: w = (d sc_j) q - (dmin m_j) over sub-blocks j of 32, d and dmin fp16, sc_j and m_j 6-bit;
//   as int4 above, the group's scale and minimum made exactly in float from the integers.
// Q6_K: w = (d sc_h) (q - 32) over sub-blocks h of 16, q in 0..63, sc_h int8, d fp16; a group of 32
//   is two sub-blocks, so its two halves get a dot product each:
//   sum_{k in g} w_k x_k ~= a[r,g] sum_h d sc_h (sum_{k in h} q_k p_k - 32 sum_{k in h} p_k)
//   the integer sum begun at the row's -32 sum p of the half (kept per row and half-group), so the
//   vpdpbusd add q p onto it and nothing is subtracted afterwards.
//
// Lanes are channels. One vpdpbusd multiplies 4 consecutive inputs of 16 channels (64 weight bytes)
// by the same 4 activation bytes broadcast to every lane, so a row's work per group of 16 channels is
// eight dot products plus two to four float operations, with nothing to reduce across lanes at the
// end (a kernel whose lanes are inputs needs a scaled add per group and channel, then a horizontal sum).
//
// Layouts ("strips" of 16 channels, N padded to a multiple of 16, K a multiple of 32), one stream each:
//   int4: uint8 [N/16, K/32, 320]: per strip and group, 4 x 64 bytes of nibbles, then fp16 scales
//         [16] and fp16 minimums [16]. Nibble byte (t, c, j), t < 4, c < 16, j < 4, at 64 t + 4 c + j:
//         its low nibble is q[c, 4t + j], its high nibble q[c, 16 + 4t + j] (inputs of the group).
//   int8: uint8 [N/16, K/32, 512]: byte (h, t, c, j) at 256 h + 64 t + 4 c + j holds v[c, 16h + 4t + j]
//         + 128; the channel scales float [N] apart.
//   q4k:  uint8 [N/16, K/256, 2368]: per strip and super-block fp16 d [16] and dmin [16], then per
//         group of 32 the int4 nibbles as above and uint8 sc [16], m [16] (288 bytes): 4.625 bits a weight.
//   q6k:  uint8 [N/16, K/256, 3360]: per strip and super-block fp16 d [16], then per group (416 bytes)
//         the low 4 bits of q as int4's nibbles, 64 bytes at 4 c + j holding the high 2 bits of
//         q[c, 4t + j] at bits 2t, 2t + 1 (t < 4), 64 more for q[c, 16 + 4t + j], then int8 sc [2 (half)]
//         [16 (channel)]: 6.5625 bits a weight, Q6_K's own.
//
// Batch invariance: a row's quantization and every instruction computing its outputs (the groups in
// order, the same float operations) are the same whatever the number of rows or the tile it lands in.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <limits>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kStrip = 16;                    // channels per strip: one int32 lane each
constexpr int64_t kRowBlock = 64;
// Software prefetch of the weight stream, by tile height. Few rows (decoding, short verification):
// into L2, 8 groups ahead; into L1 they were dropped or evicted before use and the loads stalled
// (measured on the AMD EPYC of 2026-11-26, 2 threads, a 151936x1536 layer at one row: int4 strips
// 5.05 -> 3.90 ms, int8 6.36 -> 5.16 ms, Q6_K 7.76 -> 4.88 ms). Many rows: 16 groups ahead, into
// the cache level the format names (`kManyRowsHint`), measured at 8 and 16 rows on weights streamed
// from memory: L1 for the nibble formats, int4 and Q4_K (L2 measured 0.91-1.01x and 0.77-0.88x: the
// tile's loads then wait on L2); L2 for the wider groups, Q6_K's 416 bytes and int8's 512 (1.07-1.24x
// and 1.18-1.32x: 16 of them ahead crowd the tile's activations out of L1).
// Where "few" ends is the format's (`kFewRows`): 4 rows, except Q4_K, which takes the many-rows
// prefetch from 3 rows (measured on the AMD EPYC of 2026-11-30, weights streamed, two builds
// interleaved in one process: 17920x1536 1.02-1.08x at 3-4 rows, 1536x8960 1.16-1.27x; a 4-row
// tile had cost more than a 5-row one, and so had a whole 4-token pass of the 1.5B. The int4
// strips measured 0.86-0.90x that way at 3-4 rows on the 0.5B's 9728x896: they keep 4.)
#ifndef PREFETCH_FEW_ROWS_GROUPS
#define PREFETCH_FEW_ROWS_GROUPS 8
#endif
#ifndef PREFETCH_MANY_ROWS_GROUPS
#define PREFETCH_MANY_ROWS_GROUPS 16
#endif

// x float [M, K] -> p int8 [M, K]; scale a float [M, K/32]; offset float [M, K/32] = a * sum(p).
// A group holding NaN or inf (x * 0 is NaN exactly for those) gets p = 0 and a NaN scale and offset:
// every output it reaches is NaN, as in a float matmul.
void quantize_groups(const float* x, int64_t m, int64_t k, int8_t* p, float* scale, float* offset) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* in = x + r * k + g * kGroup;
        const __m512 first = _mm512_loadu_ps(in), second = _mm512_loadu_ps(in + 16);
        const __m512 zero = _mm512_setzero_ps();
        const __m512 products = _mm512_add_ps(_mm512_mul_ps(first, zero), _mm512_mul_ps(second, zero));
        if (_mm512_cmp_ps_mask(products, products, _CMP_UNORD_Q) != 0) {
          std::memset(p + r * k + g * kGroup, 0, kGroup);
          scale[r * groups + g] = offset[r * groups + g] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second)));
        // (below 1e-30 a group is zeros for every purpose: 127 / max_abs would overflow to inf)
        const __m512 inverse = _mm512_set1_ps(max_abs > 1e-30f ? 127.0f / max_abs : 0.0f);
        const __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(first, inverse));  // nearest, |.| <= 127
        const __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(second, inverse));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p + r * k + g * kGroup), _mm512_cvtepi32_epi8(low));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p + r * k + g * kGroup + 16), _mm512_cvtepi32_epi8(high));
        const float a = max_abs / 127.0f;
        scale[r * groups + g] = a;
        offset[r * groups + g] = a * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(low, high)));
      }
    }
  });
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm512_set1_epi32(word);
}

// One strip's weights group by group. `load` gives the step-t weight bytes of the group's inputs
// 4t + j (first) and 16 + 4t + j (second); `accumulate` scales the group's integer dot products in.
template <int64_t GroupBytes>
struct PlainGroups {  // a strip's groups one after another, nothing per super-block
  static constexpr int64_t kGroupBytes = GroupBytes;
  static constexpr bool kHalves = false;
  static constexpr auto kManyRowsHint = _MM_HINT_T0;
  static constexpr int kFewRows = 4;  // tiles of up to this many rows prefetch as few rows do
  static const uint8_t* group_data(const uint8_t* packed, int64_t strip, int64_t groups, int64_t g) {
    return packed + (strip * groups + g) * kGroupBytes;
  }
};

struct Int4Strips : PlainGroups<4 * 64 + 2 * 32> {  // nibbles, then fp16 scales and minimums
  const uint8_t* packed;
  __m512 scales, minimums;
  void start(const uint8_t* block, int64_t) {
    scales = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 256)));
    minimums = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 288)));
  }
  static void load(const uint8_t* block, int t, __m512i& first, __m512i& second) {
    const __m512i bytes = _mm512_loadu_si512(block + 64 * t), low_nibbles = _mm512_set1_epi8(0x0F);
    first = _mm512_and_si512(bytes, low_nibbles);
    second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
  }
  __m512 accumulate(__m512 acc, __m512i dot, __m512 row_scale, __m512 row_offset) const {
    const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scales);  // s * sum q p
    return _mm512_fnmadd_ps(minimums, row_offset, _mm512_fmadd_ps(scaled, row_scale, acc));
  }
  __m512 finish(int64_t, __m512 acc, float) const { return acc; }
};

struct Int8Strips : PlainGroups<512> {
  static constexpr auto kManyRowsHint = _MM_HINT_T1;
  const uint8_t* packed;
  const float* channel_scales;  // [N padded to 16]
  void start(const uint8_t*, int64_t) {}
  static void load(const uint8_t* block, int t, __m512i& first, __m512i& second) {
    first = _mm512_loadu_si512(block + 64 * t);
    second = _mm512_loadu_si512(block + 256 + 64 * t);
  }
  __m512 accumulate(__m512 acc, __m512i dot, __m512 row_scale, __m512) const {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), row_scale, acc);
  }
  __m512 finish(int64_t first_channel, __m512 acc, float correction) const {
    return _mm512_mul_ps(_mm512_loadu_ps(channel_scales + first_channel), _mm512_sub_ps(acc, _mm512_set1_ps(correction)));
  }
};

// A strip's super-blocks one after another: a header, then eight groups of Group bytes.
template <int64_t Header, int64_t Group>
struct SuperBlocks {
  static constexpr int64_t kHeaderBytes = Header, kBlockBytes = Header + 8 * Group;
  static constexpr int64_t kGroupBytes = Group;  // (the prefetch distance's unit)
  static constexpr auto kManyRowsHint = _MM_HINT_T0;
  static constexpr int kFewRows = 4;  // tiles of up to this many rows prefetch as few rows do
  static const uint8_t* group_data(const uint8_t* packed, int64_t strip, int64_t groups, int64_t g) {
    return packed + (strip * (groups / 8) + g / 8) * kBlockBytes + Header + (g % 8) * Group;
  }
  static const uint8_t* header(const uint8_t* block, int64_t g) { return block - Header - (g % 8) * Group; }
};

inline __m512 unsigned_bytes(const uint8_t* bytes) {  // 16 bytes 0..255 -> float
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
}

inline __m512 signed_bytes(const uint8_t* bytes) {  // 16 bytes -128..127 -> float
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
}

struct Q4KStrips : SuperBlocks<64, 4 * 64 + 2 * 16> {
  static constexpr bool kHalves = false;
  static constexpr int kFewRows = 2;
  const uint8_t* packed;
  __m512 d, dmin, scales, minimums;
  void start(const uint8_t* block, int64_t g) {
    if (g % 8 == 0) {
      const uint8_t* head = header(block, g);
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head)));
      dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head + 32)));
    }
    scales = _mm512_mul_ps(d, unsigned_bytes(block + 256));  // exact: 11 x 6 significant bits
    minimums = _mm512_mul_ps(dmin, unsigned_bytes(block + 272));
  }
  static void load(const uint8_t* block, int t, __m512i& first, __m512i& second) { Int4Strips::load(block, t, first, second); }
  __m512 accumulate(__m512 acc, __m512i dot, __m512 row_scale, __m512 row_offset) const {
    const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scales);  // s * sum q p
    return _mm512_fnmadd_ps(minimums, row_offset, _mm512_fmadd_ps(scaled, row_scale, acc));
  }
  __m512 finish(int64_t, __m512 acc, float) const { return acc; }
};

struct Q6KStrips : SuperBlocks<32, 4 * 64 + 2 * 64 + 2 * 16> {
  static constexpr bool kHalves = true;
  static constexpr auto kManyRowsHint = _MM_HINT_T1;
  const uint8_t* packed;
  __m512 d, first_scales, second_scales;  // d sc_h per channel, for the group's halves
  __m512i first_high, second_high;  // the group's high bits
  void start(const uint8_t* block, int64_t g) {
    if (g % 8 == 0) d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header(block, g))));
    first_scales = _mm512_mul_ps(d, signed_bytes(block + 384));  // exact: 11 x 8 significant bits
    second_scales = _mm512_mul_ps(d, signed_bytes(block + 400));
    first_high = _mm512_loadu_si512(block + 256);
    second_high = _mm512_loadu_si512(block + 320);
  }
  // bits 2t, 2t + 1 of each byte moved to bits 4-5 (16-bit shifts: what crosses a byte lands
  // outside bits 4-5, masked off later); t is a constant once the caller's loop is unrolled
  static __m512i high_at_bit4(__m512i high, int t) {
    switch (t) {
      case 0: return _mm512_slli_epi16(high, 4);
      case 1: return _mm512_slli_epi16(high, 2);
      case 2: return high;
      default: return _mm512_srli_epi16(high, 2);
    }
  }
  // q of inputs 4t + j (first) and 16 + 4t + j (second): low nibbles | high bits at bits 4-5
  void load(const uint8_t* block, int t, __m512i& first, __m512i& second) const {
    const __m512i bytes = _mm512_loadu_si512(block + 64 * t), low_nibbles = _mm512_set1_epi8(0x0F);
    const __m512i high_bits = _mm512_set1_epi8(0x30);
    // ternary logic 0xF8: a | (b & c)
    first = _mm512_ternarylogic_epi32(_mm512_and_si512(bytes, low_nibbles), high_at_bit4(first_high, t), high_bits, 0xF8);
    second = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles),
                                       high_at_bit4(second_high, t), high_bits, 0xF8);
  }
  // dots: sum (q - 32) p over the group's halves (each begun at the row's -32 sum p)
  __m512 accumulate_halves(__m512 acc, __m512i first_dot, __m512i second_dot, __m512 row_scale) const {
    const __m512 first = _mm512_cvtepi32_ps(first_dot);  // exact: |.| <= 16 * 32 * 127
    const __m512 second = _mm512_cvtepi32_ps(second_dot);
    return _mm512_fmadd_ps(_mm512_fmadd_ps(first, first_scales, _mm512_mul_ps(second, second_scales)), row_scale, acc);
  }
  __m512 finish(int64_t, __m512 acc, float) const { return acc; }
};

struct Rows {  // the quantized activations of a tile's first row
  const int8_t* p;
  const float* a;
  const float* offset;
  const float* correction;  // int8 weights only
  const int32_t* half_offsets;  // Q6_K only: -32 sum p per half-group [K/16]
  int64_t k, groups;
};

// out[r, 16 S channels from strip0] for R rows: S strips side by side share each activation broadcast.
template <typename Format, int S, int R>
void tile(const Format& w, const Rows& x, int64_t strip0, int64_t n, float* out) {
  constexpr int64_t bytes = Format::kGroupBytes;
  constexpr auto hint = R <= Format::kFewRows ? _MM_HINT_T1 : Format::kManyRowsHint;
  constexpr int64_t ahead = (R <= Format::kFewRows ? PREFETCH_FEW_ROWS_GROUPS : PREFETCH_MANY_ROWS_GROUPS) * bytes;
  const int64_t groups = x.groups;
  __m512 acc[S][R];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
  Format format[S];
  for (int s = 0; s < S; ++s) format[s] = w;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block[S];
    for (int s = 0; s < S; ++s) {
      block[s] = Format::group_data(w.packed, strip0 + s, groups, g);
      format[s].start(block[s], g);
      for (int64_t line = 0; line < bytes; line += 64)  // the stream ahead: loads then overlap the compute
        _mm_prefetch(reinterpret_cast<const char*>(block[s] + ahead + line), hint);
    }
    constexpr int kDots = Format::kHalves ? 2 : 1;  // one dot product per group, or one per half
    __m512i dot[S][R][kDots];  // a half's dot begins at its offset (-32 sum p): no subtraction per row after
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < kDots; ++h) {
        const __m512i start = Format::kHalves ? _mm512_set1_epi32(x.half_offsets[r * 2 * groups + 2 * g + h])
                                              : _mm512_setzero_si512();
        for (int s = 0; s < S; ++s) dot[s][r][h] = start;
      }
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      __m512i first[S], second[S];  // weights of inputs 4t + j and 16 + 4t + j, 16 channels
      for (int s = 0; s < S; ++s) format[s].load(block[s], t, first[s], second[s]);
      for (int r = 0; r < R; ++r) {
        const int8_t* row = x.p + r * x.k + g * kGroup;
        const __m512i x_first = broadcast4(row + 4 * t), x_second = broadcast4(row + 16 + 4 * t);
        for (int s = 0; s < S; ++s) {
          if constexpr (Format::kHalves) {
            dot[s][r][0] = _mm512_dpbusd_epi32(dot[s][r][0], first[s], x_first);
            dot[s][r][kDots - 1] = _mm512_dpbusd_epi32(dot[s][r][kDots - 1], second[s], x_second);
          } else {
            dot[s][r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[s][r][0], first[s], x_first), second[s], x_second);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 row_scale = _mm512_set1_ps(x.a[r * groups + g]);
      if constexpr (Format::kHalves) {
        for (int s = 0; s < S; ++s)
          acc[s][r] = format[s].accumulate_halves(acc[s][r], dot[s][r][0], dot[s][r][kDots - 1], row_scale);
      } else {
        const __m512 row_offset = _mm512_set1_ps(x.offset[r * groups + g]);
        for (int s = 0; s < S; ++s) acc[s][r] = format[s].accumulate(acc[s][r], dot[s][r][0], row_scale, row_offset);
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t first = (strip0 + s) * kStrip;
    if (first >= n) break;
    const __mmask16 mask = first + kStrip <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - first)) - 1);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + r * n + first, mask, w.finish(first, acc[s][r], x.correction ? x.correction[r] : 0.0f));
  }
}

// One tile of rows over strips [strip0, strip_end): 1-2 rows four strips at a time (enough
// independent dot-product chains at one row), 3-4 rows two at a time, 5-8 rows one at a time
// (registers: S * R int32 and as many fp32 accumulators).
template <typename Format>
void rows_over_strips(int rows, const Format& w, const Rows& x, int64_t strip0, int64_t strip_end, int64_t n,
                      float* out) {
  for (int64_t s = strip0; s < strip_end;) {
    const int64_t left = strip_end - s;
    const int width = rows <= 2 && left >= 4 ? 4 : rows <= 4 && left >= 2 ? 2 : 1;
    switch (width * 16 + rows) {
      case 4 * 16 + 1: tile<Format, 4, 1>(w, x, s, n, out); break;
      case 4 * 16 + 2: tile<Format, 4, 2>(w, x, s, n, out); break;
      case 2 * 16 + 1: tile<Format, 2, 1>(w, x, s, n, out); break;
      case 2 * 16 + 2: tile<Format, 2, 2>(w, x, s, n, out); break;
      case 2 * 16 + 3: tile<Format, 2, 3>(w, x, s, n, out); break;
      case 2 * 16 + 4: tile<Format, 2, 4>(w, x, s, n, out); break;
      case 1 * 16 + 1: tile<Format, 1, 1>(w, x, s, n, out); break;
      case 1 * 16 + 2: tile<Format, 1, 2>(w, x, s, n, out); break;
      case 1 * 16 + 3: tile<Format, 1, 3>(w, x, s, n, out); break;
      case 1 * 16 + 4: tile<Format, 1, 4>(w, x, s, n, out); break;
      case 1 * 16 + 5: tile<Format, 1, 5>(w, x, s, n, out); break;
      case 1 * 16 + 6: tile<Format, 1, 6>(w, x, s, n, out); break;
      case 1 * 16 + 7: tile<Format, 1, 7>(w, x, s, n, out); break;
      default: tile<Format, 1, 8>(w, x, s, n, out); break;
    }
    s += width;
  }
}

// x float [M, K] quantized, then every tile of rows over every strip: strips split across threads
// in chunks of four, within a chunk every tile of rows (the chunk's weights stay in cache across
// the tiles); large M in blocks of rows so x stays in cache too.
template <typename Format>
torch::Tensor matmul_q8(const torch::Tensor& x, Format w, int64_t n, bool with_correction) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup, strip_count = (n + kStrip - 1) / kStrip;
  auto p = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto a = torch::empty({m, groups}, x.options());
  auto offset = torch::empty({m, groups}, x.options());
  quantize_groups(x.data_ptr<float>(), m, k, p.data_ptr<int8_t>(), a.data_ptr<float>(), offset.data_ptr<float>());
  const float* offsets = offset.data_ptr<float>();
  std::vector<int32_t> half_offsets(Format::kHalves ? m * 2 * groups : 0);  // -32 sum p per half-group
  if constexpr (Format::kHalves) {
    const int8_t* q = p.data_ptr<int8_t>();
    for (int64_t i = 0; i < m * 2 * groups; ++i) {
      int32_t total = 0;
      for (int64_t j = 0; j < 16; ++j) total += q[16 * i + j];
      half_offsets[i] = -32 * total;
    }
  }
  std::vector<float> correction(with_correction ? m : 0);  // per row, its groups summed in order
  for (int64_t r = 0; r < static_cast<int64_t>(correction.size()); ++r) {
    float total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) total += 128.0f * offsets[r * groups + g];
    correction[r] = total;
  }
  auto out = torch::empty({m, n}, x.options());
  float* outp = out.data_ptr<float>();
  constexpr int64_t kTileRows = 8, kChunk = 4;
  for (int64_t row0 = 0; row0 < m; row0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, m - row0);
    const int64_t chunks = (strip_count + kChunk - 1) / kChunk;
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t first = chunk * kChunk, last = std::min(first + kChunk, strip_count);
        for (int64_t r = 0; r < block; r += kTileRows) {
          const int64_t row = row0 + r;
          const Rows rows{p.data_ptr<int8_t>() + row * k, a.data_ptr<float>() + row * groups,
                          offsets + row * groups, with_correction ? correction.data() + row : nullptr,
                          Format::kHalves ? half_offsets.data() + row * 2 * groups : nullptr, k, groups};
          rows_over_strips(static_cast<int>(std::min(kTileRows, block - r)), w, rows, first, last, n, outp + row * n);
        }
      }
    });
  }
  return out;
}

// group_bytes: per group of 32 inputs (block 32), or per super-block (block 256)
void check_q8(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t group_bytes, int64_t block = kGroup) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % block == 0, "K must be a multiple of ", block, ", got ", x.size(1));
  const int64_t strip_count = (n + kStrip - 1) / kStrip;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.numel() == strip_count * (x.size(1) / block) * group_bytes,
              "packed must be contiguous uint8 [N/16, K/", block, ", ", group_bytes, "]");
}

}  // namespace

torch::Tensor int4_matmul_q8(torch::Tensor x, torch::Tensor packed, int64_t n) {
  check_q8(x, packed, n, Int4Strips::kGroupBytes);
  return matmul_q8(x, Int4Strips{{}, packed.data_ptr<uint8_t>(), {}, {}}, n, false);
}

torch::Tensor int8_matmul_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t n) {
  check_q8(x, packed, n, Int8Strips::kGroupBytes);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == (n + kStrip - 1) / kStrip * kStrip,
              "scales must be contiguous float32 [N padded to a multiple of 16]");
  return matmul_q8(x, Int8Strips{{}, packed.data_ptr<uint8_t>(), scales.data_ptr<float>()}, n, true);
}

torch::Tensor q4k_matmul_q8(torch::Tensor x, torch::Tensor packed, int64_t n) {
  check_q8(x, packed, n, Q4KStrips::kBlockBytes, 256);
  return matmul_q8(x, Q4KStrips{{}, packed.data_ptr<uint8_t>(), {}, {}, {}, {}}, n, false);
}

torch::Tensor q6k_matmul_q8(torch::Tensor x, torch::Tensor packed, int64_t n) {
  check_q8(x, packed, n, Q6KStrips::kBlockBytes, 256);
  return matmul_q8(x, Q6KStrips{{}, packed.data_ptr<uint8_t>(), {}, {}, {}, {}, {}}, n, false);
}
