// The small per-layer operations of a decoder layer, each as one call: RMSNorm, rotary embedding,
// SiLU-gated product (AVX-512, or AVX2 where that is all the CPU has). Op by op from Python they cost ~30 dispatched tensor operations per layer,
// several milliseconds a step on a 2-core CPU (a fifth of a 0.5B draft model's step); here one each.
//
// Every row is computed by the same instructions in the same order whatever the number of rows
// (sums over a row in 16 fixed lanes, then the lanes in a fixed order), so a token's result does not
// depend on how many tokens share the pass: the batch invariance speculation's losslessness rests on.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cmath>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGrain = 16;  // rows per thread task: small passes stay on one thread

}  // namespace

// x float [M, H] -> weight * x / sqrt(mean(x^2) + eps), float [M, H].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32 [M, H]");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be contiguous float32 [H]");
  const int64_t m = x.size(0), h = x.size(1);
  TORCH_CHECK(h % kLanes == 0, "H must be a multiple of ", kLanes);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * h;
      float lanes[kLanes] = {};
      for (int64_t i = 0; i < h; i += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) lanes[l] += row[i + l] * row[i + l];
      float sum = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
      const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(h) + static_cast<float>(eps));
      for (int64_t i = 0; i < h; ++i) op[r * h + i] = wp[i] * (row[i] * inverse);
    }
  });
  return out;
}

// x float [B, H, S, D] (any strides, D contiguous), cos and sin float [B, 1, S, D] contiguous ->
// x * cos + rotate_half(x) * sin, contiguous [B, H, S, D]; rotate_half(x) = (-x[D/2:], x[:D/2]).
torch::Tensor apply_rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == torch::kFloat32 && x.stride(3) == 1, "x must be float32 [B, H, S, D], D contiguous");
  const int64_t b = x.size(0), heads = x.size(1), s = x.size(2), d = x.size(3), half = d / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
              sin.scalar_type() == torch::kFloat32 && cos.numel() == b * s * d && sin.numel() == b * s * d,
              "cos and sin must be contiguous float32 [B, 1, S, D]");
  auto out = torch::empty({b, heads, s, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rows = b * heads * s;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bi = row / (heads * s), hi = row / s % heads, si = row % s;
      const float* in = xp + bi * x.stride(0) + hi * x.stride(1) + si * x.stride(2);
      const float* c = cp + (bi * s + si) * d;
      const float* sn = sp + (bi * s + si) * d;
      float* o = op + row * d;
      for (int64_t i = 0; i < half; ++i) o[i] = in[i] * c[i] + (-in[i + half]) * sn[i];
      for (int64_t i = half; i < d; ++i) o[i] = in[i] * c[i] + in[i - half] * sn[i];
    }
  });
  return out;
}

#if defined(__AVX512F__)

namespace {

// e^x for 16 floats: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by Cephes' degree-6 polynomial
// (within ~2 ulp), times 2^n. The same instructions for every element: elementwise results never
// depend on how a tensor is split into vectors or across threads.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(e, n);
}

}  // namespace

// gate_up float [M, 2I] -> silu(gate) * up = gate / (1 + e^-gate) * up, float [M, I] (gate = the
// first I columns).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.is_contiguous(),
              "gate_up must be contiguous float32 [M, 2I]");
  const int64_t m = gate_up.size(0), i = gate_up.size(1) / 2;
  auto out = torch::empty({m, i}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t vectors = (i + kLanes - 1) / kLanes;
  at::parallel_for(0, m * vectors, 256, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int64_t r = v / vectors, column = v % vectors * kLanes;
      const __mmask16 mask = column + kLanes <= i ? 0xFFFF : static_cast<__mmask16>((1u << (i - column)) - 1);
      const __m512 gate = _mm512_maskz_loadu_ps(mask, in + r * 2 * i + column);
      const __m512 up = _mm512_maskz_loadu_ps(mask, in + r * 2 * i + i + column);
      const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
      _mm512_mask_storeu_ps(op + r * i + column, mask, _mm512_mul_ps(silu, up));
    }
  });
  return out;
}

#else  // AVX2

namespace {

// e^x for 8 floats: the AVX-512 build's steps (Cephes' polynomial), 2^n built in the exponent bits.
// Over the clamped range the two builds agree on silu: where they differ (2^n below the smallest
// normal float) e^x is added to 1.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_max_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                            _mm256_setzero_si256());
  return _mm256_mul_ps(e, _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23)));
}

constexpr int64_t kLanes8 = 8;

}  // namespace

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.is_contiguous(),
              "gate_up must be contiguous float32 [M, 2I]");
  const int64_t m = gate_up.size(0), i = gate_up.size(1) / 2;
  auto out = torch::empty({m, i}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t vectors = (i + kLanes8 - 1) / kLanes8;
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  at::parallel_for(0, m * vectors, 256, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int64_t r = v / vectors, column = v % vectors * kLanes8;
      const int left = static_cast<int>(i - column < kLanes8 ? i - column : kLanes8);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), index);
      const __m256 gate = _mm256_maskload_ps(in + r * 2 * i + column, mask);
      const __m256 up = _mm256_maskload_ps(in + r * 2 * i + i + column, mask);
      const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
      _mm256_maskstore_ps(op + r * i + column, mask, _mm256_mul_ps(silu, up));
    }
  });
  return out;
}

#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row of x float [M, H]");
  m.def("apply_rotary", &apply_rotary, "rotary embedding of x [B, H, S, D] by cos, sin [B, 1, S, D]");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of gate_up [M, 2I]");
  // entry points for the fused decoder layer (model/kernels/decoder_layer.cpp), which calls this very code
  m.attr("entry_points") = pybind11::dict(
      pybind11::arg("rms_norm") = pybind11::capsule(reinterpret_cast<void*>(&rms_norm)),
      pybind11::arg("apply_rotary") = pybind11::capsule(reinterpret_cast<void*>(&apply_rotary)),
      pybind11::arg("silu_mul") = pybind11::capsule(reinterpret_cast<void*>(&silu_mul)));
}
