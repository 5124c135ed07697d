// Weight-only int4 / int8 matrix multiply for a few rows: each weight is dequantized once and used
// for every row of the input, with AVX-512 BF16 dot products (Zen 4, Sapphire Rapids and later).
//
// Why: PyTorch's packed CPU kernels cost ~1.6x a single row at 4 rows and ~3.2x at 8, because they
// redo the dequantization per row. Verifying k drafted tokens is a forward over k+1 rows, so that
// growth decides whether speculation can pay on a CPU. Here the per-weight work is shared and only
// one bf16 dot-product instruction per 32 weights is added per row.
//
// Every output row is computed by the same sequence of instructions whatever the number of rows,
// so results are bit-identical between a one-row decode step and the same row inside a verification
// pass or a batch (the engine's batch invariance rests on this).
//
// Layouts
//   x        bf16  [M, K]        activations, K a multiple of 64
//   int4:    channels in quads (N padded to a multiple of 4), K a multiple of 64, in pairs of
//            groups (a, b) of 32 weights. nibbles uint8 [N/4, K/64, 4, 32]: byte j holds a's weight j
//            in its low nibble and b's weight j in its high one. scale_min fp16 [N/4, K/64, 4, 4]:
//            scale a, scale b, minimum a, minimum b. weight = scale * q - minimum, rounded to bf16.
//            A quad is read as one sequential stream (separate per-channel streams ran at half the
//            speed once the weights no longer fit in cache), and fp16 scales keep the bytes low:
//            at one row the kernel is bound by memory traffic.
//   int8:    weights int8 [N, K] row-major, scales float [N]; weight = scale * q.
//   out      float [M, N]
//
// int4 and int8 weights x int8 activations (VNNI): q8_matmul.cpp.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32;
constexpr int kMaxRows = 8;  // rows per register tile

// The 64 weights of a pair of int4 groups as bf16: one 32-entry table (scale * i - minimum for
// i < 16 of group a, then of group b) looked up by q (a) and 16 + q (b).
// scale_min: scale a, scale b, minimum a, minimum b (fp16 bits).
inline void dequant_int4_pair(const uint8_t* packed, const uint16_t* scale_min,
                              __m512 iota, __m512bh& first, __m512bh& second) {
  const uint16_t* scales = scale_min;
  const uint16_t* minimums = scale_min + 2;
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed)));  // 32 x u16
  const __m512i index_a = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
  const __m512i index_b = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), _mm512_set1_epi16(16));
  const __m512 table_a = _mm512_fmsub_ps(iota, _mm512_set1_ps(_cvtsh_ss(scales[0])), _mm512_set1_ps(_cvtsh_ss(minimums[0])));
  const __m512 table_b = _mm512_fmsub_ps(iota, _mm512_set1_ps(_cvtsh_ss(scales[1])), _mm512_set1_ps(_cvtsh_ss(minimums[1])));
  const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(table_b, table_a));  // low half = a
  first = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(index_a, table));
  second = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(index_b, table));
}

// The 32 weights of one int8 group as bf16 (integers up to 127 are exact in bf16).
inline __m512bh dequant_int8_group(const int8_t* weights) {
  const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(weights))));
  const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(weights + 16))));
  return _mm512_cvtne2ps_pbh(second, first);  // low half = first
}

inline __m512bh load_bf16x32(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

struct Int4Weights {
  const uint8_t* nibbles;
  const uint16_t* scale_min;  // fp16 bits
  int64_t groups;  // K / 32, even
  int64_t channels;  // N rounded up to a multiple of 4
  void pair(int64_t channel, int64_t g, __m512 iota, __m512bh& first, __m512bh& second) const {
    const int64_t at = ((channel / 4) * (groups / 2) + g / 2) * 4 + channel % 4;  // [N/4, K/64, 4]
    dequant_int4_pair(nibbles + at * kGroup, scale_min + at * 4, iota, first, second);
  }
  float finish(int64_t, float sum) const { return sum; }
};

struct Int8Weights {
  const int8_t* weights;
  const float* scales;
  int64_t groups;
  int64_t channels;
  void pair(int64_t channel, int64_t g, __m512, __m512bh& first, __m512bh& second) const {
    first = dequant_int8_group(weights + (channel * groups + g) * kGroup);
    second = dequant_int8_group(weights + (channel * groups + g + 1) * kGroup);
  }
  float finish(int64_t channel, float sum) const { return scales[channel] * sum; }
};

// out[r, c] for R rows starting at x and C channels from c_first (channels past n are computed
// on channel n - 1 and not written): each channel's weights dequantized once per group for all rows.
// One accumulator per (row, channel), groups summed in order: a row's result never depends on R or C.
template <int C, int R, typename Weights>
void tile(const Weights& w, const at::BFloat16* x, int64_t k, int64_t c_first, float* out, int64_t n) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t channel[C];
  for (int c = 0; c < C; ++c) channel[c] = std::min(c_first + c, w.channels - 1);
  __m512 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; g += 2) {
    __m512bh first[C], second[C];
    for (int c = 0; c < C; ++c) w.pair(channel[c], g, iota, first[c], second[c]);
    for (int r = 0; r < R; ++r) {
      const __m512bh x_first = load_bf16x32(x + r * k + g * kGroup);
      const __m512bh x_second = load_bf16x32(x + r * k + (g + 1) * kGroup);
      for (int c = 0; c < C; ++c) acc[c][r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[c][r], x_first, first[c]), x_second, second[c]);
    }
  }
  for (int c = 0; c < C && c_first + c < n; ++c)
    for (int r = 0; r < R; ++r) out[r * n + c_first + c] = w.finish(channel[c], _mm512_reduce_add_ps(acc[c][r]));
}

// Up to 8 rows on four channels: as one 4-channel tile for up to 4 rows (enough independent
// accumulator chains to hide the dot product's latency), else as two 2-channel tiles (16 accumulators).
template <typename Weights>
void quad(int rows, const Weights& w, const at::BFloat16* x, int64_t k, int64_t c_first, float* out, int64_t n) {
  switch (rows) {
    case 1: return tile<4, 1>(w, x, k, c_first, out, n);
    case 2: return tile<4, 2>(w, x, k, c_first, out, n);
    case 3: return tile<4, 3>(w, x, k, c_first, out, n);
    case 4: return tile<4, 4>(w, x, k, c_first, out, n);
    case 5: return tile<4, 5>(w, x, k, c_first, out, n);
    case 6: return tile<4, 6>(w, x, k, c_first, out, n);
  }
  for (int64_t c = c_first; c < std::min(c_first + 4, n); c += 2) {
    switch (rows) {
      case 5: tile<2, 5>(w, x, k, c, out, n); break;
      case 6: tile<2, 6>(w, x, k, c, out, n); break;
      case 7: tile<2, 7>(w, x, k, c, out, n); break;
      default: tile<2, 8>(w, x, k, c, out, n); break;
    }
  }
}

constexpr int64_t kRowBlock = 64;

// over_quad(first_row, rows, first_channel) for every block of rows and channel quad: quads split
// across threads, large M (prefill) in blocks of rows so x stays in cache.
template <typename OverQuad>
void over_quads(int64_t m, int64_t n, OverQuad over_quad) {
  const int64_t quads = (n + 3) / 4;
  for (int64_t row0 = 0; row0 < m; row0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, m - row0);
    at::parallel_for(0, quads, 8, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) over_quad(row0, block, 4 * q);
    });
  }
}

// One quad's weights dequantized to bf16 once, for passes of more than one row tile (prefill, long
// verifications): each further tile then reads them instead of dequantizing again. The bf16 values
// are those `Weights::pair` computes on the fly and every (row, channel) still sums its groups in
// order, so a row's result is bit for bit the one the unbuffered tiles give.
template <typename Weights>
struct DequantizedQuad {
  const Weights& w;
  at::BFloat16* buffer;  // [4 (channels of the quad), K]
  int64_t first;  // the quad's first channel
  int64_t k;
  int64_t groups;
  int64_t channels;

  DequantizedQuad(const Weights& weights, at::BFloat16* buffer, int64_t first, int64_t k)
      : w(weights), buffer(buffer), first(first), k(k), groups(weights.groups), channels(weights.channels) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t slot = 0; slot < 4; ++slot) {
      const int64_t channel = std::min(first + slot, channels - 1);
      for (int64_t g = 0; g < groups; g += 2) {
        __m512bh a, b;
        w.pair(channel, g, iota, a, b);
        _mm512_storeu_si512(buffer + slot * k + g * kGroup, reinterpret_cast<__m512i>(a));
        _mm512_storeu_si512(buffer + slot * k + (g + 1) * kGroup, reinterpret_cast<__m512i>(b));
      }
    }
  }
  void pair(int64_t channel, int64_t g, __m512, __m512bh& a, __m512bh& b) const {
    const at::BFloat16* at = buffer + (channel - first) * k + g * kGroup;  // channel is clamped: in the quad
    a = load_bf16x32(at);
    b = load_bf16x32(at + kGroup);
  }
  float finish(int64_t channel, float sum) const { return w.finish(channel, sum); }
};

template <typename Weights>
torch::Tensor matmul(const Weights& w, const torch::Tensor& x, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1);
  auto out = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  over_quads(m, n, [&](int64_t row0, int64_t block, int64_t channel) {
    if (block <= kMaxRows) {  // one tile: dequantized on the fly
      quad(static_cast<int>(block), w, xp + row0 * k, k, channel, op + row0 * n, n);
      return;
    }
    thread_local std::vector<at::BFloat16> buffer;
    buffer.resize(4 * k);
    const DequantizedQuad<Weights> dequantized(w, buffer.data(), channel, k);
    for (int64_t r = 0; r < block; r += kMaxRows)
      quad(static_cast<int>(std::min<int64_t>(kMaxRows, block - r)), dequantized, xp + (row0 + r) * k, k, channel,
           op + (row0 + r) * n, n);
  });
  return out;
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(x.size(1) % (2 * kGroup) == 0, "K must be a multiple of 64, got ", x.size(1));
}

}  // namespace

torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor nibbles, torch::Tensor scale_min, int64_t n) {
  check_x(x);
  const int64_t groups = x.size(1) / kGroup, quads = (n + 3) / 4;
  TORCH_CHECK(nibbles.scalar_type() == torch::kUInt8 && nibbles.is_contiguous() &&
              nibbles.numel() == quads * 4 * x.size(1) / 2, "nibbles must be contiguous uint8 [N/4, K/64, 4, 32]");
  TORCH_CHECK(scale_min.scalar_type() == torch::kFloat16 && scale_min.is_contiguous() &&
              scale_min.numel() == quads * 4 * groups * 2, "scale_min must be contiguous float16 [N/4, K/64, 4, 4]");
  const Int4Weights w{nibbles.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>()),
                      groups, quads * 4};
  return matmul(w, x, n);
}

torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor weights, torch::Tensor scales) {
  check_x(x);
  const int64_t n = weights.size(0);
  TORCH_CHECK(weights.scalar_type() == torch::kInt8 && weights.is_contiguous() && weights.size(1) == x.size(1),
              "weights must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == n,
              "scales must be contiguous float32 [N]");
  const Int8Weights w{weights.data_ptr<int8_t>(), scales.data_ptr<float>(), x.size(1) / kGroup, n};
  return matmul(w, x, n);
}

// q8_matmul.cpp
torch::Tensor int4_matmul_q8(torch::Tensor x, torch::Tensor packed, int64_t n);
torch::Tensor int8_matmul_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t n);
torch::Tensor q4k_matmul_q8(torch::Tensor x, torch::Tensor packed, int64_t n);
torch::Tensor q6k_matmul_q8(torch::Tensor x, torch::Tensor packed, int64_t n);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_matmul", &int4_matmul, "x bf16 [M, K] @ int4 weights [N, K]^T -> float [M, N]");
  m.def("int8_matmul", &int8_matmul, "x bf16 [M, K] @ int8 weights [N, K]^T -> float [M, N]");
  m.def("int4_matmul_q8", &int4_matmul_q8, "x float [M, K], quantized to int8 per group of 32, @ int4 weights in strips -> float [M, N]");
  m.def("int8_matmul_q8", &int8_matmul_q8, "x float [M, K], quantized to int8 per group of 32, @ int8 weights in strips -> float [M, N]");
  m.def("q4k_matmul_q8", &q4k_matmul_q8, "x float [M, K], quantized to int8 per group of 32, @ Q4_K weights in strips -> float [M, N]");
  m.def("q6k_matmul_q8", &q6k_matmul_q8, "x float [M, K], quantized to int8 per group of 32, @ Q6_K weights in strips -> float [M, N]");
  // entry points for the fused decoder layer (model/kernels/decoder_layer.cpp), which calls this very code
  m.attr("entry_points") = pybind11::dict(
      pybind11::arg("int4_matmul") = pybind11::capsule(reinterpret_cast<void*>(&int4_matmul)),
      pybind11::arg("int8_matmul") = pybind11::capsule(reinterpret_cast<void*>(&int8_matmul)),
      pybind11::arg("int4_matmul_q8") = pybind11::capsule(reinterpret_cast<void*>(&int4_matmul_q8)),
      pybind11::arg("int8_matmul_q8") = pybind11::capsule(reinterpret_cast<void*>(&int8_matmul_q8)),
      pybind11::arg("q4k_matmul_q8") = pybind11::capsule(reinterpret_cast<void*>(&q4k_matmul_q8)),
      pybind11::arg("q6k_matmul_q8") = pybind11::capsule(reinterpret_cast<void*>(&q6k_matmul_q8)));
}
