// Causal attention of any number of queries over a paged KV cache, fp32, on the CPU, with one fixed
// order of arithmetic per query: a query's result depends on its own row's keys and values and its
// position, never on how many other queries or rows share the call.
//
// Why: speculation is lossless bit for bit only if verifying k tokens computes what k one-token
// steps compute. A batched SDPA call rounds differently with the number of queries in it (its GEMM
// takes other kernels for small M), so until now each query was a call of its own, from Python:
// 28 layers x (k + 1) x rows calls per step. Here every query of a step is one task of one call, for
// decode, verification, draft catch-up and prefill alike, and the keys are read in place through
// the rows' block tables (no gather into a contiguous copy).
//
// Per query n (row b, position p) and head h (kv head g = h / (Hq / Hkv)); one task per (n, g) runs
// the group's heads together, so each block of keys and values is read once for all of them:
//   s_t = scale * <q_n,h , k_b,t,g>          t = 0..p   (dot over D in 16-lane blocks, lanes summed in a fixed tree)
//   m = max_t s_t,  e_t = exp(s_t - m) (16 at a time),  l = sum of the e_t (16 lanes, then a fixed tree)
//   out_n,h = (sum_t e_t v_b,t,g) / l        (accumulated in t order, 16 lanes of D at a time)
//
// Layouts (all contiguous)
//   q            float [N, Hq, D]       D a multiple of 16
//   keys, values float [slots, Hkv, D]   one layer's paged storage, slots = blocks x block_size
//   block_tables int64 [B, W]            each row's blocks in position order: key position t of row b is in
//                                        slot block_tables[b, t / block_size] * block_size + t % block_size
//   query_rows   int64 [N]               the row of each query
//   positions    int64 [N]               the position of each query (it sees keys 0..position)
//   path_start   int64 [N]               token trees (else both empty): key positions t >= path_start[n] of
//   path         int64 [N, T]            query n are read from position path[n, t - path_start[n]] (its
//                                        ancestors in the tree, then itself, stored wherever the pass put them)
//   out          float [N, Hq, D]
//
// A tree node at depth d thus attends exactly the keys a chain query at the same position attends in a
// chain made of its ancestors, in the same order, with the same arithmetic: verifying a tree computes,
// along every root path, what verifying that path alone computes, bit for bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

// exp(x) for x <= 0, 16 lanes: 2^n * p(r) with n = round(x log2 e), r = x - n ln 2 (in two parts),
// p a degree-6 polynomial (Taylor), |error| ~ 2 ulp; exactly the same instructions for every lane.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // below: exp underflows (the caller zeroes unused lanes)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The lane sums of 16 vectors as one vector (lane j: the sum of v[j]'s 16 lanes), by a fixed
// network of shuffles and adds: 256-bit halves, then 128-bit quarters, then within quarters. Each
// sum involves its own vector's lanes only, in the same order for every j.
inline __m512 lane_sums(const __m512 v[16]) {
  __m512 halves[8], quarters[4];
  for (int k = 0; k < 8; ++k) {  // [a.q0+a.q2, a.q1+a.q3, b.q0+b.q2, b.q1+b.q3]
    halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // quarter m: the 4-float partial of v[4k + m]
    quarters[k] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], 0xDD));
  }
  const __m512 x = _mm512_add_ps(_mm512_unpacklo_ps(quarters[0], quarters[1]),
                                 _mm512_unpackhi_ps(quarters[0], quarters[1]));
  const __m512 y = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2], quarters[3]),
                                 _mm512_unpackhi_ps(quarters[2], quarters[3]));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));  // lane 4m + k: v[4k + m]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// The dot products of q with 16 keys (rows of d floats), as one vector.
inline __m512 dots16(const float* q, const float* const keys[16], int64_t d) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 qi = _mm512_loadu_ps(q + i);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(keys[j] + i), acc[j]);
  }
  return lane_sums(acc);
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

// One query over its row's keys for the `group` heads sharing kv head `kv_head` (their q rows are
// consecutive). The heads go through each block of 16 keys (and values) while it is in L1; each
// head's arithmetic, and its order, is that of the head alone.
void attend_group(const float* q, const float* keys, const float* values, const int64_t* blocks, int64_t block_size,
                  int64_t position, const int64_t* path, int64_t path_start, int64_t kv_head, int64_t num_kv_heads,
                  int64_t group, int64_t d, float scale, float* scratch, float* out) {
  auto slot = [&](int64_t t) {
    const int64_t stored = (path != nullptr && t >= path_start) ? path[t - path_start] : t;
    return blocks[stored / block_size] * block_size + stored % block_size;
  };
  const int64_t stride = num_kv_heads * d;  // between consecutive slots
  const int64_t width = (position + 16) / 16 * 16;  // score slots per head
  float* scores = scratch;  // [group, width]
  float* acc_store = scratch + group * width;  // [group, d]
  const float* block[16];
  __m512 maxima[64];
  for (int64_t h = 0; h < group; ++h) maxima[h] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t <= position; t += 16) {  // 16 key positions at a time (past the position: ignored)
    const int64_t left = position + 1 - t;
    const __mmask16 lanes = first_lanes(left);
    for (int j = 0; j < 16; ++j) block[j] = keys + slot(t + (j < left ? j : left - 1)) * stride + kv_head * d;
    for (int64_t h = 0; h < group; ++h) {
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(scale), dots16(q + h * d, block, d));
      _mm512_mask_storeu_ps(scores + h * width + t, lanes, s);
      maxima[h] = _mm512_mask_max_ps(maxima[h], lanes, maxima[h], s);
    }
  }
  float totals[64];
  for (int64_t h = 0; h < group; ++h) {
    const __m512 max_vec = _mm512_set1_ps(_mm512_reduce_max_ps(maxima[h]));
    __m512 sums = _mm512_setzero_ps();
    for (int64_t t = 0; t <= position; t += 16) {
      const __mmask16 lanes = first_lanes(position + 1 - t);
      float* row = scores + h * width + t;
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row), max_vec));
      _mm512_mask_storeu_ps(row, lanes, e);
      sums = _mm512_mask_add_ps(sums, lanes, sums, e);
    }
    totals[h] = _mm512_reduce_add_ps(sums);
  }
  const int64_t chunks = d / 16;
  for (int64_t i = 0; i < group * d; ++i) acc_store[i] = 0.0f;
  __m512 acc[16];  // head_dim up to 256
  for (int64_t t = 0; t <= position; t += 16) {  // each output lane accumulates over t in order
    const int64_t end = t + 16 <= position + 1 ? t + 16 : position + 1;
    for (int64_t h = 0; h < group; ++h) {
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_loadu_ps(acc_store + h * d + 16 * c);
      for (int64_t u = t; u < end; ++u) {
        const __m512 weight = _mm512_set1_ps(scores[h * width + u]);
        const float* v = values + slot(u) * stride + kv_head * d;
        for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + 16 * c), acc[c]);
      }
      for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc_store + h * d + 16 * c, acc[c]);
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const __m512 norm = _mm512_set1_ps(totals[h]);
    for (int64_t c = 0; c < chunks; ++c) {
      _mm512_storeu_ps(out + h * d + 16 * c, _mm512_div_ps(_mm512_loadu_ps(acc_store + h * d + 16 * c), norm));
    }
  }
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor block_tables,
                              int64_t block_size, torch::Tensor query_rows, torch::Tensor positions,
                              torch::Tensor path_start, torch::Tensor path, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32 && values.dtype() == torch::kFloat32,
              "paged_attention: fp32 only");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous() && block_tables.is_contiguous(),
              "paged_attention: contiguous tensors only");
  const int64_t num_queries = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv_heads = keys.size(1), table_width = block_tables.size(1) * block_size;
  TORCH_CHECK(d % 16 == 0 && d <= 256, "paged_attention: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention: heads must group over kv heads");
  auto out = torch::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = keys.data_ptr<float>();
  const float* v_ptr = values.data_ptr<float>();
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* row_ptr = query_rows.data_ptr<int64_t>();
  const int64_t* pos_ptr = positions.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t group = num_heads / num_kv_heads;
  const bool tree = path.numel() > 0;
  const int64_t path_width = tree ? path.size(1) : 0;
  const int64_t* start_ptr = tree ? path_start.data_ptr<int64_t>() : nullptr;
  const int64_t* path_ptr = tree ? path.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(!tree || (path.is_contiguous() && path.size(0) == num_queries && path_start.numel() == num_queries),
              "paged_attention: path must be [N, T] with path_start [N]");
  for (int64_t n = 0; n < num_queries; ++n) {
    TORCH_CHECK(pos_ptr[n] >= 0 && pos_ptr[n] < table_width, "paged_attention: a position past its row's block table");
    if (tree) {
      TORCH_CHECK(start_ptr[n] >= 0 && pos_ptr[n] - start_ptr[n] < path_width, "paged_attention: a path too short");
      for (int64_t t = start_ptr[n]; t <= pos_ptr[n]; ++t) {
        const int64_t stored = path_ptr[n * path_width + t - start_ptr[n]];
        TORCH_CHECK(stored >= 0 && stored < table_width, "paged_attention: a path entry past its row's block table");
      }
    }
  }
  TORCH_CHECK(group <= 64, "paged_attention: at most 64 query heads per kv head");
  at::parallel_for(0, num_queries * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(group * ((table_width + 15) / 16 * 16 + d));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / num_kv_heads, g = task % num_kv_heads;
      const int64_t first_head = n * num_heads + g * group;
      attend_group(q_ptr + first_head * d, k_ptr, v_ptr, table_ptr + row_ptr[n] * block_tables.size(1), block_size,
                   pos_ptr[n], tree ? path_ptr + n * path_width : nullptr, tree ? start_ptr[n] : 0, g, num_kv_heads,
                   group, d, static_cast<float>(scale), scratch.data(), out_ptr + first_head * d);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache, batch-invariant (fp32)");
}
