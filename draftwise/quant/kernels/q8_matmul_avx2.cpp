// int4 and int8 weights x int8 activations on AVX2 (no VNNI): the quantized layers' native path on
// CPUs without AVX-512 (AMD Zen 2/3, Intel before Ice Lake). The weights are in the strips of
// q8_matmul.cpp (the same packing, the same packed-weight cache); activations are quantized the same
// way (groups of 32, a = max|x| / 127, p = round(x / a) in -127..127, offset = a sum p).
//
// A strip's 16 channels are two vectors of 8 int32 lanes here ("halves"). Byte dot products come
// from vpmaddubsw (unsigned bytes x signed bytes, adjacent pairs summed to int16) and vpmaddwd
// (int16 pairs summed to int32):
//
// int4: q in 0..15 (unsigned) times p (signed). A pair sums to at most 2 x 15 x 127 = 3,810, so the
//   four steps of a group (16 products per int16 lane) stay below 30,480: exact in int16, widened
//   once per group. Then, as on AVX-512, sum_k w_k x_k ~= a (s sum q p) - m offset.
// int8: stored v + 128; here v = byte ^ 0x80 (signed), and v p = |v| (sign(v) p), the unsigned
//   |v| <= 127 times the signed sign(v) p: a pair sums to at most 2 x 127 x 127 = 32,258, exact in
//   int16, widened every step. The dot product sum v p needs no correction term:
//   sum_k w_k x_k ~= s[c] sum_g a[r,g] sum_{k in g} v_k p_k.
//
// Batch invariance: a row's quantization and every instruction computing its outputs (the groups in
// order, the same float operations) are the same whatever the number of rows or the tile it lands in.
// This build rounds differently from the AVX-512 one (int8: no correction term); a process uses one.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kStrip = 16;  // channels per strip (two halves of 8 lanes)
constexpr int64_t kHalf = 8;
constexpr int64_t kRowBlock = 64;
constexpr int64_t kPrefetchGroups = 16;

// The largest |x| of 32 floats, and the sum of 8 int32 lanes, each in a fixed order.
inline float reduce_max_abs(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a), _mm256_andnot_ps(sign, b)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, c), _mm256_andnot_ps(sign, d)));
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline int32_t reduce_add(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_unpackhi_epi64(x, x));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 1));
  return _mm_cvtsi128_si32(x);
}

// Whether any of 32 floats is NaN or infinite (x * 0 is NaN exactly for those).
inline bool any_not_finite(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 products = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(a, zero), _mm256_mul_ps(b, zero)),
                                        _mm256_add_ps(_mm256_mul_ps(c, zero), _mm256_mul_ps(d, zero)));
  return _mm256_movemask_ps(_mm256_cmp_ps(products, products, _CMP_UNORD_Q)) != 0;
}

// x float [M, K] -> p int8 [M, K]; scale a float [M, K/32]; offset float [M, K/32] = a * sum(p).
// A group holding NaN or inf gets p = 0 and a NaN scale and offset: every output it reaches is NaN,
// as in a float matmul (a NaN would otherwise drop out of the max and leave a finite answer).
void quantize_groups(const float* x, int64_t m, int64_t k, int8_t* p, float* scale, float* offset) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* in = x + r * k + g * kGroup;
        const __m256 v0 = _mm256_loadu_ps(in), v1 = _mm256_loadu_ps(in + 8);
        const __m256 v2 = _mm256_loadu_ps(in + 16), v3 = _mm256_loadu_ps(in + 24);
        if (any_not_finite(v0, v1, v2, v3)) {
          std::memset(p + r * k + g * kGroup, 0, kGroup);
          scale[r * groups + g] = offset[r * groups + g] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        const float max_abs = reduce_max_abs(v0, v1, v2, v3);
        // (below 1e-30 a group is zeros for every purpose: 127 / max_abs would overflow to inf, and 0 * inf is NaN)
        const __m256 inverse = _mm256_set1_ps(max_abs > 1e-30f ? 127.0f / max_abs : 0.0f);
        const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inverse));  // nearest, |.| <= 127
        const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inverse));
        const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inverse));
        const __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inverse));
        // int32 -> int8 in input order: packs work within 128-bit lanes, a permute puts them back
        const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
        const __m256i bytes = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + r * k + g * kGroup), bytes);
        const float a = max_abs / 127.0f;
        scale[r * groups + g] = a;
        const int32_t sum = reduce_add(_mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3)));
        offset[r * groups + g] = a * static_cast<float>(sum);
      }
    }
  });
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm256_set1_epi32(word);
}

// One strip's weights, group by group, as halves of 8 channels. `dot` gives a half's integer dot
// products of the group with one row (8 int32); `accumulate` scales them in.
struct Int4Strips {
  static constexpr int64_t kGroupBytes = 4 * 64 + 2 * 32;  // nibbles, then fp16 scales and minimums
  const uint8_t* packed;
  __m256 scales[2], minimums[2];
  void start(const uint8_t* block) {
    for (int half = 0; half < 2; ++half) {
      scales[half] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 256 + 16 * half)));
      minimums[half] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 288 + 16 * half)));
    }
  }
  // The step-t weights of a half: inputs 4t + j (first) and 16 + 4t + j (second), 8 channels x 4.
  static void load(const uint8_t* block, int half, int t, __m256i& first, __m256i& second) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * t + 32 * half));
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    first = _mm256_and_si256(bytes, low_nibbles);
    second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
  }
  // int16 partial sums of one step (exact: see above), added over the group's four steps.
  static __m256i step(__m256i partial, __m256i first, __m256i second, __m256i x_first, __m256i x_second) {
    return _mm256_add_epi16(partial, _mm256_add_epi16(_mm256_maddubs_epi16(first, x_first),
                                                      _mm256_maddubs_epi16(second, x_second)));
  }
  static __m256i widen(__m256i partial) { return _mm256_madd_epi16(partial, _mm256_set1_epi16(1)); }
  __m256 accumulate(int half, __m256 acc, __m256i dot, __m256 row_scale, __m256 row_offset) const {
    const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), scales[half]);  // s * sum q p
    return _mm256_fnmadd_ps(minimums[half], row_offset, _mm256_fmadd_ps(scaled, row_scale, acc));
  }
  __m256 finish(int64_t, __m256 acc) const { return acc; }
};

struct Int8Strips {
  static constexpr int64_t kGroupBytes = 512;
  const uint8_t* packed;
  const float* channel_scales;  // [N padded to 16]
  void start(const uint8_t*) {}
  // The signed weights v of a half at step t (inputs 4t + j, then 16 + 4t + j).
  static void load(const uint8_t* block, int half, int t, __m256i& first, __m256i& second) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    first = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * t + 32 * half)), flip);
    second = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 256 + 64 * t + 32 * half)), flip);
  }
  // |v| (sign(v) p) in int16 pairs (exact), widened to int32 at once (two steps could overflow int16).
  static __m256i step(__m256i partial, __m256i first, __m256i second, __m256i x_first, __m256i x_second) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i a = _mm256_maddubs_epi16(_mm256_abs_epi8(first), _mm256_sign_epi8(x_first, first));
    const __m256i b = _mm256_maddubs_epi16(_mm256_abs_epi8(second), _mm256_sign_epi8(x_second, second));
    return _mm256_add_epi32(partial, _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones)));
  }
  static __m256i widen(__m256i partial) { return partial; }
  __m256 accumulate(int, __m256 acc, __m256i dot, __m256 row_scale, __m256) const {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), row_scale, acc);
  }
  __m256 finish(int64_t first_channel, __m256 acc) const {
    return _mm256_mul_ps(_mm256_loadu_ps(channel_scales + first_channel), acc);
  }
};

struct Rows {  // the quantized activations of a tile's first row
  const int8_t* p;
  const float* a;
  const float* offset;
  int64_t k, groups;
};

// out[r, 16 S channels from strip0] for R rows: 2S halves side by side share each activation broadcast.
template <typename Format, int S, int R>
void tile(const Format& w, const Rows& x, int64_t strip0, int64_t n, float* out) {
  constexpr int H = 2 * S;
  constexpr int64_t bytes = Format::kGroupBytes;
  const int64_t groups = x.groups;
  __m256 acc[H][R];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  Format format[S];
  for (int s = 0; s < S; ++s) format[s] = w;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block[S];
    for (int s = 0; s < S; ++s) {
      block[s] = w.packed + ((strip0 + s) * groups + g) * bytes;
      format[s].start(block[s]);
      // The stream ahead, so that loads overlap the compute: this strip's own groups, and past its end
      // the groups of the strip in its place in the next tile (strip + S). (Past the end, the strip
      // after this one was fetched instead: for S = 2 the tile's other strip, already in flight, so a
      // short strip's next tile began on cache misses: 9728x896 took 1.18-1.25x as long at one row.)
      const int64_t ahead = g + kPrefetchGroups;
      const uint8_t* next = ahead < groups ? block[s] + kPrefetchGroups * bytes
                                           : w.packed + ((strip0 + s + S) * groups + ahead - groups) * bytes;
      for (int64_t line = 0; line < bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T0);
    }
    __m256i dot[H][R];
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) dot[h][r] = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) {
      __m256i first[H], second[H];
      for (int h = 0; h < H; ++h) Format::load(block[h / 2], h % 2, t, first[h], second[h]);
      for (int r = 0; r < R; ++r) {
        const int8_t* row = x.p + r * x.k + g * kGroup;
        const __m256i x_first = broadcast4(row + 4 * t), x_second = broadcast4(row + 16 + 4 * t);
        for (int h = 0; h < H; ++h) dot[h][r] = Format::step(dot[h][r], first[h], second[h], x_first, x_second);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 row_scale = _mm256_set1_ps(x.a[r * groups + g]);
      const __m256 row_offset = _mm256_set1_ps(x.offset[r * groups + g]);
      for (int h = 0; h < H; ++h)
        acc[h][r] = format[h / 2].accumulate(h % 2, acc[h][r], Format::widen(dot[h][r]), row_scale, row_offset);
    }
  }
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int h = 0; h < H; ++h) {
    const int64_t first = strip0 * kStrip + h * kHalf;
    if (first >= n) break;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n - first, kHalf))), index);
    for (int r = 0; r < R; ++r) _mm256_maskstore_ps(out + r * n + first, mask, w.finish(first, acc[h][r]));
  }
}

// One tile of rows over strips [strip0, strip_end): 1-2 rows two strips at a time, 3-8 rows one.
template <typename Format>
void rows_over_strips(int rows, const Format& w, const Rows& x, int64_t strip0, int64_t strip_end, int64_t n,
                      float* out) {
  for (int64_t s = strip0; s < strip_end;) {
    const int width = rows <= 2 && strip_end - s >= 2 ? 2 : 1;
    switch (width * 16 + rows) {
      case 2 * 16 + 1: tile<Format, 2, 1>(w, x, s, n, out); break;
      case 2 * 16 + 2: tile<Format, 2, 2>(w, x, s, n, out); break;
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
torch::Tensor matmul_q8(const torch::Tensor& x, Format w, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup, strip_count = (n + kStrip - 1) / kStrip;
  auto p = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto a = torch::empty({m, groups}, x.options());
  auto offset = torch::empty({m, groups}, x.options());
  quantize_groups(x.data_ptr<float>(), m, k, p.data_ptr<int8_t>(), a.data_ptr<float>(), offset.data_ptr<float>());
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
                          offset.data_ptr<float>() + row * groups, k, groups};
          rows_over_strips(static_cast<int>(std::min(kTileRows, block - r)), w, rows, first, last, n, outp + row * n);
        }
      }
    });
  }
  return out;
}

void check_q8(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t group_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kGroup == 0, "K must be a multiple of ", kGroup, ", got ", x.size(1));
  const int64_t strip_count = (n + kStrip - 1) / kStrip;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.numel() == strip_count * (x.size(1) / kGroup) * group_bytes,
              "packed must be contiguous uint8 [N/16, K/32, ", group_bytes, "]");
}

}  // namespace

torch::Tensor int4_matmul_q8(torch::Tensor x, torch::Tensor packed, int64_t n) {
  check_q8(x, packed, n, Int4Strips::kGroupBytes);
  return matmul_q8(x, Int4Strips{packed.data_ptr<uint8_t>(), {}, {}}, n);
}

torch::Tensor int8_matmul_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t n) {
  check_q8(x, packed, n, Int8Strips::kGroupBytes);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == (n + kStrip - 1) / kStrip * kStrip,
              "scales must be contiguous float32 [N padded to a multiple of 16]");
  return matmul_q8(x, Int8Strips{packed.data_ptr<uint8_t>(), scales.data_ptr<float>()}, n);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_matmul_q8", &int4_matmul_q8, "x float [M, K], quantized to int8 per group of 32, @ int4 weights in strips -> float [M, N]");
  m.def("int8_matmul_q8", &int8_matmul_q8, "x float [M, K], quantized to int8 per group of 32, @ int8 weights in strips -> float [M, N]");
  // entry points for the fused decoder layer (model/kernels/decoder_layer.cpp), which calls this very code
  m.attr("entry_points") = pybind11::dict(
      pybind11::arg("int4_matmul_q8") = pybind11::capsule(reinterpret_cast<void*>(&int4_matmul_q8)),
      pybind11::arg("int8_matmul_q8") = pybind11::capsule(reinterpret_cast<void*>(&int8_matmul_q8)));
}
