// int4 weights x int8 activations with VNNI byte dot products: the int4 layers' compute-bound path
// (verification and prefill), where the bf16 kernel is held to one bf16 dot product per 2 weights.
//
// Arithmetic. A weight group g of 32 inputs of channel c holds w = s[c,g] q - m[c,g] with q in 0..15
// (GGUF Q4_K's own sub-blocks). Each row r of x is quantized in the same groups of 32:
// a[r,g] = max|x| / 127, p = round(x / a) in -127..127. Then, exactly in the algebra,
//   sum_{k in g} w_k x_k ~= a[r,g] (s[c,g] sum_k q_k p_k - m[c,g] sum_k p_k)
// The inner sum is an exact int32 (32 products of at most 15 * 127) from eight vpdpbusd, which take
// unsigned bytes (q) times signed bytes (p): no offset, no dequantization of the weights. Each
// group's result is scaled into an fp32 accumulator; sum_k p_k and a[r,g] depend on the row alone.
//
// Lanes are channels. One vpdpbusd multiplies 4 consecutive inputs of 16 channels (64 weight bytes)
// by the same 4 activation bytes broadcast to every lane, so a row's work per group of 16 channels is
// eight dot products plus four float operations, with nothing to reduce across lanes at the end
// (the bf16 kernel's lanes are inputs: 16 dot products per group, then a horizontal sum).
//
// Layout ("strips" of 16 channels, N padded to a multiple of 16, K a multiple of 32), one stream:
//   packed uint8 [N/16, K/32, 320]: per strip and group, 4 x 64 bytes of nibbles, then fp16 scales
//   [16] and fp16 minimums [16]. Nibble byte (t, c, j), t < 4, c < 16, j < 4, at 64 t + 4 c + j:
//   its low nibble is q[c, 4t + j] and its high nibble q[c, 16 + 4t + j] (inputs of the group).
//
// Batch invariance: a row's quantization and every instruction computing its outputs (the groups in
// order, the same float operations) are the same whatever the number of rows or the tile it lands in.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kStrip = 16;                    // channels per strip: one int32 lane each
constexpr int64_t kGroupBytes = 4 * 64 + 2 * 32;  // nibbles, then fp16 scales and minimums
constexpr int64_t kRowBlock = 64;

// x float [M, K] -> p int8 [M, K]; scale a float [M, K/32]; offset float [M, K/32] = a * sum(p).
void quantize_groups(const float* x, int64_t m, int64_t k, int8_t* p, float* scale, float* offset) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* in = x + r * k + g * kGroup;
        const __m512 first = _mm512_loadu_ps(in), second = _mm512_loadu_ps(in + 16);
        const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second)));
        const __m512 inverse = _mm512_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
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

// out[r, 16 S channels from strip0] for R rows: S strips side by side share each activation broadcast.
template <int S, int R>
void tile(const uint8_t* w, int64_t groups, const int8_t* p, const float* a, const float* offset, int64_t k,
          int64_t strip0, int64_t n, float* out) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[S][R];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block[S];
    __m512 scales[S], minimums[S];
    for (int s = 0; s < S; ++s) {
      block[s] = w + ((strip0 + s) * groups + g) * kGroupBytes;
      scales[s] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[s] + 256)));
      minimums[s] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[s] + 288)));
    }
    __m512i dot[S][R];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) dot[s][r] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      __m512i first[S], second[S];  // q[c, 4t + j] and q[c, 16 + 4t + j] of the 16 channels
      for (int s = 0; s < S; ++s) {
        const __m512i bytes = _mm512_loadu_si512(block[s] + 64 * t);
        first[s] = _mm512_and_si512(bytes, low_nibbles);
        second[s] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* row = p + r * k + g * kGroup;
        const __m512i x_first = broadcast4(row + 4 * t), x_second = broadcast4(row + 16 + 4 * t);
        for (int s = 0; s < S; ++s)
          dot[s][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[s][r], first[s], x_first), second[s], x_second);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 row_scale = _mm512_set1_ps(a[r * groups + g]);
      const __m512 row_offset = _mm512_set1_ps(offset[r * groups + g]);
      for (int s = 0; s < S; ++s) {
        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[s][r]), scales[s]);  // s * sum q p
        acc[s][r] = _mm512_fnmadd_ps(minimums[s], row_offset, _mm512_fmadd_ps(scaled, row_scale, acc[s][r]));
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t first = (strip0 + s) * kStrip;
    if (first >= n) break;
    const __mmask16 mask = first + kStrip <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - first)) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * n + first, mask, acc[s][r]);
  }
}

// One tile of rows over strips [strip0, strip_end): 1-2 rows four strips at a time (enough
// independent dot-product chains at one row), 3-4 rows two at a time, 5-8 rows one at a time
// (registers: S * R int32 and as many fp32 accumulators).
void rows_over_strips(int rows, const uint8_t* w, int64_t groups, const int8_t* p, const float* a,
                      const float* offset, int64_t k, int64_t strip0, int64_t strip_end, int64_t n, float* out) {
  for (int64_t s = strip0; s < strip_end;) {
    const int64_t left = strip_end - s;
    const int width = rows <= 2 && left >= 4 ? 4 : rows <= 4 && left >= 2 ? 2 : 1;
    switch (width * 16 + rows) {
      case 4 * 16 + 1: tile<4, 1>(w, groups, p, a, offset, k, s, n, out); break;
      case 4 * 16 + 2: tile<4, 2>(w, groups, p, a, offset, k, s, n, out); break;
      case 2 * 16 + 1: tile<2, 1>(w, groups, p, a, offset, k, s, n, out); break;
      case 2 * 16 + 2: tile<2, 2>(w, groups, p, a, offset, k, s, n, out); break;
      case 2 * 16 + 3: tile<2, 3>(w, groups, p, a, offset, k, s, n, out); break;
      case 2 * 16 + 4: tile<2, 4>(w, groups, p, a, offset, k, s, n, out); break;
      case 1 * 16 + 1: tile<1, 1>(w, groups, p, a, offset, k, s, n, out); break;
      case 1 * 16 + 2: tile<1, 2>(w, groups, p, a, offset, k, s, n, out); break;
      case 1 * 16 + 3: tile<1, 3>(w, groups, p, a, offset, k, s, n, out); break;
      case 1 * 16 + 4: tile<1, 4>(w, groups, p, a, offset, k, s, n, out); break;
      case 1 * 16 + 5: tile<1, 5>(w, groups, p, a, offset, k, s, n, out); break;
      case 1 * 16 + 6: tile<1, 6>(w, groups, p, a, offset, k, s, n, out); break;
      case 1 * 16 + 7: tile<1, 7>(w, groups, p, a, offset, k, s, n, out); break;
      default: tile<1, 8>(w, groups, p, a, offset, k, s, n, out); break;
    }
    s += width;
  }
}

}  // namespace

torch::Tensor int4_matmul_q8(torch::Tensor x, torch::Tensor packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup, strip_count = (n + kStrip - 1) / kStrip;
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of ", kGroup, ", got ", k);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.numel() == strip_count * groups * kGroupBytes, "packed must be contiguous uint8 [N/16, K/32, 320]");
  auto p = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto a = torch::empty({m, groups}, x.options());
  auto offset = torch::empty({m, groups}, x.options());
  quantize_groups(x.data_ptr<float>(), m, k, p.data_ptr<int8_t>(), a.data_ptr<float>(), offset.data_ptr<float>());
  auto out = torch::empty({m, n}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int8_t* pp = p.data_ptr<int8_t>();
  const float* ap = a.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  // Strips split across threads in chunks of four; within a chunk every tile of rows (a chunk's
  // weights stay in cache across the tiles); large M in blocks of rows so x stays in cache too.
  constexpr int64_t kTileRows = 8, kChunk = 4;
  for (int64_t row0 = 0; row0 < m; row0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, m - row0);
    const int64_t chunks = (strip_count + kChunk - 1) / kChunk;
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t first = chunk * kChunk, last = std::min(first + kChunk, strip_count);
        for (int64_t r = 0; r < block; r += kTileRows) {
          const int64_t row = row0 + r;
          const int rows = static_cast<int>(std::min(kTileRows, block - r));
          rows_over_strips(rows, w, groups, pp + row * k, ap + row * groups, op + row * groups, k, first, last, n,
                           outp + row * n);
        }
      }
    });
  }
  return out;
}
