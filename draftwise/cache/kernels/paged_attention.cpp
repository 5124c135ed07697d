// Causal attention of any number of queries over a paged KV cache, fp32, on the CPU, with one fixed
// order of arithmetic per query: a query's result depends on its own row's keys and values and its
// position, never on how many other queries or rows share the call.
//
// Why: speculation is lossless bit for bit only if verifying k tokens computes what k one-token
// steps compute. A batched SDPA call rounds differently with the number of queries in it (its GEMM
// takes other kernels for small M), so until now each query was a call of its own, from Python:
// 28 layers x (k + 1) x rows calls per step. Here every query of a step is one task of one call, for
// decode, verification, draft catch-up and prefill alike, and the keys are read in place through
// the rows' slot tables (no gather into a contiguous copy).
//
// Per query n (row b, position p) and head h (kv head g = h / (Hq / Hkv)):
//   s_t = scale * <q_n,h , k_b,t,g>          t = 0..p   (dot over D in 16-lane blocks, lanes summed in a fixed tree)
//   m = max_t s_t,  e_t = exp(s_t - m),  l = sum_t e_t (in t order)
//   out_n,h = (sum_t e_t v_b,t,g) / l        (accumulated in t order, 16 lanes of D at a time)
//
// Layouts (all contiguous)
//   q            float [N, Hq, D]       D a multiple of 16
//   keys, values float [slots, Hkv, D]   one layer's paged storage
//   key_slots    int64 [B, T]            the slot of each key position of each row (T > every query position)
//   query_rows   int64 [N]               the row of each query
//   positions    int64 [N]               the position of each query (it sees keys 0..position)
//   out          float [N, Hq, D]

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

void attend_one(const float* q, const float* keys, const float* values, const int64_t* slots, int64_t position,
                int64_t kv_head, int64_t num_kv_heads, int64_t d, float scale, float* scores, float* out) {
  const int64_t stride = num_kv_heads * d;  // between consecutive slots
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t <= position; ++t) {
    const float s = scale * dot(q, keys + slots[t] * stride + kv_head * d, d);
    scores[t] = s;
    max_score = s > max_score ? s : max_score;
  }
  float total = 0.0f;
  for (int64_t t = 0; t <= position; ++t) {
    scores[t] = std::exp(scores[t] - max_score);
    total += scores[t];
  }
  for (int64_t i = 0; i < d; i += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t t = 0; t <= position; ++t) {
      acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[t]), _mm512_loadu_ps(values + slots[t] * stride + kv_head * d + i),
                            acc);
    }
    _mm512_storeu_ps(out + i, _mm512_div_ps(acc, _mm512_set1_ps(total)));
  }
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor key_slots,
                              torch::Tensor query_rows, torch::Tensor positions, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32 && values.dtype() == torch::kFloat32,
              "paged_attention: fp32 only");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous() && key_slots.is_contiguous(),
              "paged_attention: contiguous tensors only");
  const int64_t num_queries = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv_heads = keys.size(1), table_width = key_slots.size(1);
  TORCH_CHECK(d % 16 == 0, "paged_attention: head_dim must be a multiple of 16");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention: heads must group over kv heads");
  auto out = torch::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = keys.data_ptr<float>();
  const float* v_ptr = values.data_ptr<float>();
  const int64_t* slot_ptr = key_slots.data_ptr<int64_t>();
  const int64_t* row_ptr = query_rows.data_ptr<int64_t>();
  const int64_t* pos_ptr = positions.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t group = num_heads / num_kv_heads;
  for (int64_t n = 0; n < num_queries; ++n) {
    TORCH_CHECK(pos_ptr[n] >= 0 && pos_ptr[n] < table_width, "paged_attention: a position outside its row's slots");
  }
  at::parallel_for(0, num_queries * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(table_width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / num_heads, h = task % num_heads;
      attend_one(q_ptr + (n * num_heads + h) * d, k_ptr, v_ptr, slot_ptr + row_ptr[n] * table_width, pos_ptr[n],
                 h / group, num_kv_heads, d, static_cast<float>(scale), scores.data(),
                 out_ptr + (n * num_heads + h) * d);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache, batch-invariant (fp32)");
}
