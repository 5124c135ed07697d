// Quantized weights in the int8-activation kernels' strips (q8_matmul.cpp: GGUF Q4_K and Q6_K, int4 with
// fp16 scales and minimums per group, int8 with a scale per channel) times bf16 activations on AMX
// tiles: the prompt's kernel. A prompt pass has many rows, so each strip of 16 channels is
// dequantized once to bf16 (exact scales, then rounded) and reused by every tile of rows, and the
// fp32 sums stay in the tiles across the whole K: the weights' own scales are already inside the
// bf16 values, so nothing has to leave a tile every 32 inputs (what held AMX's int8 path back).
//
// Layout of a dequantized strip, as TDPBF16PS reads B: per group of 32 inputs a 16 x 64-byte tile,
// row p holding the 16 channels' weights of inputs 2p and 2p + 1 side by side (channel c at bytes
// 4c, 4c + 2).
//
// Per pair of strips and 32 rows: C[2 row tiles][2 strips] accumulate over the K/32 groups in order
// (A = the rows' bf16 inputs, B = the strip's group), so every row's outputs are the same sequence of
// tile products whatever the number of rows, the tile it lands in or the threads: rows are
// independent (rows past M are zeros and their sums dropped).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <vector>

namespace {

constexpr int64_t kGroup = 32, kStrip = 16, kSuper = 256, kRowTile = 16;
constexpr int64_t kTileBytes = 1024;  // one dequantized group of a strip: 16 pairs x 16 channels x 2 bf16
constexpr int64_t kQ4KBlockBytes = 64 + 8 * 288, kQ6KBlockBytes = 32 + 8 * 416;  // per super-block of 256
constexpr int64_t kInt4GroupBytes = 4 * 64 + 2 * 32, kInt8GroupBytes = 512;  // per group of 32

struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

bool tiles_permitted() {  // Linux hands out the tile state on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static std::once_flag once;
  static bool permitted = false;
  std::call_once(once, [] { permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0; });
  return permitted;
}

void load_tile_config() {  // C tiles 0-3 (16 x 16 fp32), A tiles 4-5 (16 x 32 bf16), B tiles 6-7 (16 pairs x 16)
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// w0, w1: the 16 channels' weights of two consecutive inputs -> one B tile row (pairs per channel)
inline void store_pair(uint16_t* row, __m512 w0, __m512 w1) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w1, w0));  // w0 [0..15], w1 [16..31]
  _mm512_storeu_si512(row, _mm512_permutexvar_epi16(interleave, both));
}

inline __m512 bytes_as_floats(const uint8_t* bytes, bool is_signed) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw));
}

inline __m512 fp16_as_floats(const uint8_t* bytes) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
}

// The 4-bit value of input 4t + j (high = false) or 16 + 4t + j (high = true) of each channel: the
// 64 nibble bytes of t read as 16 lanes of 4 bytes (lane c = channel c, byte j).
template <int J, int High>
inline __m512i nibble(__m512i lanes) {
  return _mm512_and_si512(_mm512_srli_epi32(lanes, 8 * J + 4 * High), _mm512_set1_epi32(0x0F));
}

// One half (inputs 16 half + 0..15) of a Q4_K group: 8 rows of its B tile
template <int Half>
inline void q4k_half(const uint8_t* group, __m512 scales, __m512 minimums, uint16_t* tile) {
  for (int t = 0; t < 4; ++t) {
    const __m512i lanes = _mm512_loadu_si512(group + 64 * t);
    const __m512 w0 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(nibble<0, Half>(lanes)), scales, minimums);
    const __m512 w1 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(nibble<1, Half>(lanes)), scales, minimums);
    const __m512 w2 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(nibble<2, Half>(lanes)), scales, minimums);
    const __m512 w3 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(nibble<3, Half>(lanes)), scales, minimums);
    store_pair(tile + (8 * Half + 2 * t) * 32, w0, w1);  // inputs 16 half + 4t + 0, 1
    store_pair(tile + (8 * Half + 2 * t + 1) * 32, w2, w3);  // inputs 16 half + 4t + 2, 3
  }
}

// A Q4_K strip's K inputs -> K/32 B tiles: w = (d sc) q - (dmin m)
void dequantize_q4k(const uint8_t* strip, int64_t k, uint16_t* out) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const uint8_t* block = strip + (g / 8) * kQ4KBlockBytes;
    const uint8_t* group = block + 64 + (g % 8) * 288;
    const __m512 scales = _mm512_mul_ps(fp16_as_floats(block), bytes_as_floats(group + 256, false));
    const __m512 minimums = _mm512_mul_ps(fp16_as_floats(block + 32), bytes_as_floats(group + 272, false));
    uint16_t* tile = out + g * (kTileBytes / 2);
    q4k_half<0>(group, scales, minimums, tile);
    q4k_half<1>(group, scales, minimums, tile);
  }
}

// One half (inputs 16 half + 0..15, sub-block h = half) of a Q6_K group: 8 rows of its B tile
template <int Half>
inline void q6k_half(const uint8_t* group, __m512 d, uint16_t* tile) {
  const __m512 scales = _mm512_mul_ps(d, bytes_as_floats(group + 384 + 16 * Half, true));
  const __m512 offset = _mm512_mul_ps(scales, _mm512_set1_ps(-32.0f));
  const __m512i high_lanes = _mm512_loadu_si512(group + 256 + 64 * Half);
  const __m512i two_bits = _mm512_set1_epi32(0x30);
  for (int t = 0; t < 4; ++t) {
    const __m512i lanes = _mm512_loadu_si512(group + 64 * t);
    // high bits of input (t, j) at bits 8j + 2t of the lane, moved to bits 4-5: shift by 8j + 2t - 4
    const __m512i high = t >= 2 ? _mm512_srli_epi32(high_lanes, 2 * t - 4) : _mm512_slli_epi32(high_lanes, 4 - 2 * t);
    __m512 w[4];
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_ternarylogic_epi32(nibble<0, Half>(lanes), high, two_bits, 0xF8)), scales, offset);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_ternarylogic_epi32(nibble<1, Half>(lanes), _mm512_srli_epi32(high, 8), two_bits, 0xF8)), scales, offset);
    w[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_ternarylogic_epi32(nibble<2, Half>(lanes), _mm512_srli_epi32(high, 16), two_bits, 0xF8)), scales, offset);
    w[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_ternarylogic_epi32(nibble<3, Half>(lanes), _mm512_srli_epi32(high, 24), two_bits, 0xF8)), scales, offset);
    store_pair(tile + (8 * Half + 2 * t) * 32, w[0], w[1]);
    store_pair(tile + (8 * Half + 2 * t + 1) * 32, w[2], w[3]);
  }
}

// A Q6_K strip's K inputs -> K/32 B tiles: w = (d sc_h) (q - 32), q = low nibble | high 2 bits << 4
void dequantize_q6k(const uint8_t* strip, int64_t k, uint16_t* out) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const uint8_t* block = strip + (g / 8) * kQ6KBlockBytes;
    const uint8_t* group = block + 32 + (g % 8) * 416;
    const __m512 d = fp16_as_floats(block);
    uint16_t* tile = out + g * (kTileBytes / 2);
    q6k_half<0>(group, d, tile);
    q6k_half<1>(group, d, tile);
  }
}

// An int4 strip's K inputs -> K/32 B tiles: w = s q - m, fp16 s and m per channel and group (the
// nibbles laid out as Q4_K's)
void dequantize_int4(const uint8_t* strip, int64_t k, uint16_t* out) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const uint8_t* group = strip + g * kInt4GroupBytes;
    const __m512 scales = fp16_as_floats(group + 256), minimums = fp16_as_floats(group + 288);
    uint16_t* tile = out + g * (kTileBytes / 2);
    q4k_half<0>(group, scales, minimums, tile);
    q4k_half<1>(group, scales, minimums, tile);
  }
}

// One half (inputs 16 half + 0..15) of an int8 group: byte (t, c, j) of the half holds v[c, 16 half + 4t + j] + 128
template <int Half>
inline void int8_half(const uint8_t* group, __m512 scales, uint16_t* tile) {
  const __m512i byte = _mm512_set1_epi32(0xFF), bias = _mm512_set1_epi32(128);
  for (int t = 0; t < 4; ++t) {
    const __m512i lanes = _mm512_loadu_si512(group + 256 * Half + 64 * t);
    __m512 w[4];
    for (int j = 0; j < 4; ++j) {  // exact: 8 x 8 significant bits (a bf16 scale)
      const __m512i v = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(lanes, 8 * j), byte), bias);
      w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(v), scales);
    }
    store_pair(tile + (8 * Half + 2 * t) * 32, w[0], w[1]);
    store_pair(tile + (8 * Half + 2 * t + 1) * 32, w[2], w[3]);
  }
}

// An int8 strip's K inputs -> K/32 B tiles: w = s[c] v
void dequantize_int8(const uint8_t* strip, const float* channel_scales, int64_t k, uint16_t* out) {
  const __m512 scales = _mm512_loadu_ps(channel_scales);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const uint8_t* group = strip + g * kInt8GroupBytes;
    uint16_t* tile = out + g * (kTileBytes / 2);
    int8_half<0>(group, scales, tile);
    int8_half<1>(group, scales, tile);
  }
}

enum class Format { q4k, q6k, int4, int8 };

// A format's strip: its bytes for K inputs, the multiple K must be, and its dequantization
struct Strips {
  Format format;
  const uint8_t* packed;
  const float* channel_scales;  // int8 only: [N padded to 16]
  int64_t k;
  int64_t k_multiple() const { return format == Format::q4k || format == Format::q6k ? kSuper : kGroup; }
  int64_t strip_bytes() const {
    switch (format) {
      case Format::q4k: return k / kSuper * kQ4KBlockBytes;
      case Format::q6k: return k / kSuper * kQ6KBlockBytes;
      case Format::int4: return k / kGroup * kInt4GroupBytes;
      default: return k / kGroup * kInt8GroupBytes;
    }
  }
  void dequantize(int64_t strip, uint16_t* out) const {
    const uint8_t* data = packed + strip * strip_bytes();
    switch (format) {
      case Format::q4k: dequantize_q4k(data, k, out); break;
      case Format::q6k: dequantize_q6k(data, k, out); break;
      case Format::int4: dequantize_int4(data, k, out); break;
      default: dequantize_int8(data, channel_scales + strip * kStrip, k, out); break;
    }
  }
};

// out[rows, 16 S channels from strip0] (written, not added to) from the S dequantized strips
template <int S>
void strips_times_rows(const uint16_t* dequantized, const uint16_t* x, int64_t m_padded, int64_t m, int64_t k,
                       int64_t strip0, int64_t n, float* out) {
  alignas(64) float sums[kRowTile * kStrip];
  const int64_t groups = k / kGroup, strip_elements = groups * (kTileBytes / 2);
  for (int64_t r = 0; r < m_padded; r += 2 * kRowTile) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint16_t* a = x + r * k;  // the 32 rows' groups one after another: [K/32, 32, 32]
    for (int64_t g = 0; g < groups; ++g) {
      _tile_loadd(4, a + g * 2 * kTileBytes / 2, 64);
      _tile_loadd(5, a + g * 2 * kTileBytes / 2 + kTileBytes / 2, 64);
      _tile_loadd(6, dequantized + g * (kTileBytes / 2), 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (S == 2) {
        _tile_loadd(7, dequantized + strip_elements + g * (kTileBytes / 2), 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    for (int s = 0; s < S; ++s) {
      for (int half = 0; half < 2; ++half) {
        switch (2 * s + half) {  // (tile numbers must be constants)
          case 0: _tile_stored(0, sums, 64); break;
          case 1: _tile_stored(1, sums, 64); break;
          case 2: _tile_stored(2, sums, 64); break;
          default: _tile_stored(3, sums, 64); break;
        }
        const int64_t first_row = r + half * kRowTile, channel0 = (strip0 + s) * kStrip;
        const int64_t channels = std::min<int64_t>(kStrip, n - channel0);
        for (int64_t i = 0; i < kRowTile && first_row + i < m; ++i)
          std::memcpy(out + (first_row + i) * n + channel0, sums + i * kStrip, channels * sizeof(float));
      }
    }
  }
}

torch::Tensor prompt_matmul(torch::Tensor x, Strips w, const torch::Tensor& packed, int64_t n) {
  TORCH_CHECK(tiles_permitted(), "the kernel may not use AMX tiles here (arch_prctl refused)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a float32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), strips = (n + kStrip - 1) / kStrip;
  TORCH_CHECK(k == w.k && k % w.k_multiple() == 0, "K must be a multiple of ", w.k_multiple(), ", got ", k);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.numel() == strips * w.strip_bytes(),
              "packed must be contiguous uint8 holding ", strips, " strips of ", w.strip_bytes(), " bytes");
  const int64_t m_padded = (m + 2 * kRowTile - 1) / (2 * kRowTile) * (2 * kRowTile);
  auto rows = torch::zeros({m_padded, k}, torch::kBFloat16);  // [M padded to 32, K]
  rows.narrow(0, 0, m).copy_(x);  // (round to nearest even, row by row)
  // each block of 32 rows as A tiles: [M/32, K/32 (group), 32 (row), 32 (input)]
  rows = rows.view({m_padded / (2 * kRowTile), 2 * kRowTile, k / kGroup, kGroup}).transpose(1, 2).contiguous();
  auto out = torch::empty({m, n}, torch::kFloat32);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  const int64_t pairs = (strips + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t first, int64_t last) {
    load_tile_config();
    std::vector<uint16_t> dequantized(2 * (k / kGroup) * (kTileBytes / 2));
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t strip0 = 2 * pair, count = std::min<int64_t>(2, strips - strip0);
      for (int64_t s = 0; s < count; ++s) w.dequantize(strip0 + s, dequantized.data() + s * (k / kGroup) * (kTileBytes / 2));
      if (count == 2) strips_times_rows<2>(dequantized.data(), xb, m_padded, m, k, strip0, n, o);
      else strips_times_rows<1>(dequantized.data(), xb, m_padded, m, k, strip0, n, o);
    }
    _tile_release();
  });
  return out;
}

Strips strips_of(Format format, const torch::Tensor& x, const torch::Tensor& packed, const float* scales = nullptr) {
  return Strips{format, packed.data_ptr<uint8_t>(), scales, x.dim() == 2 ? x.size(1) : 0};
}

}  // namespace

torch::Tensor q4k_matmul_amx(torch::Tensor x, torch::Tensor packed, int64_t n) {
  return prompt_matmul(x, strips_of(Format::q4k, x, packed), packed, n);
}
torch::Tensor q6k_matmul_amx(torch::Tensor x, torch::Tensor packed, int64_t n) {
  return prompt_matmul(x, strips_of(Format::q6k, x, packed), packed, n);
}
torch::Tensor int4_matmul_amx(torch::Tensor x, torch::Tensor packed, int64_t n) {
  return prompt_matmul(x, strips_of(Format::int4, x, packed), packed, n);
}
torch::Tensor int8_matmul_amx(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t n) {
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == (n + kStrip - 1) / kStrip * kStrip,
              "scales must be contiguous float32 [N padded to a multiple of 16]");
  return prompt_matmul(x, strips_of(Format::int8, x, packed, scales.data_ptr<float>()), packed, n);
}

bool amx_usable() { return tiles_permitted(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4k_matmul_amx", &q4k_matmul_amx, "x float32 [M, K] times Q4_K strips on AMX: float32 [M, n]");
  m.def("q6k_matmul_amx", &q6k_matmul_amx, "x float32 [M, K] times Q6_K strips on AMX: float32 [M, n]");
  m.def("int4_matmul_amx", &int4_matmul_amx, "x float32 [M, K] times int4 strips on AMX: float32 [M, n]");
  m.def("int8_matmul_amx", &int8_matmul_amx, "x float32 [M, K] times int8 strips (channel scales [N16]) on AMX: float32 [M, n]");
  m.def("amx_usable", &amx_usable, "whether this process may use AMX tiles");
}
