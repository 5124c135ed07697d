// Causal attention over a paged KV cache on AVX-512 (16 lanes): the algorithm, the layouts and why
// one fixed order of arithmetic per query are in paged_attention.h, which this file ends by including.

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

// Two heads' weighted sums over the same value rows (value rows u = 0..count-1): acc0/acc1 [chunks x 16]
// += w0[u] * v[u] and w1[u] * v[u], u in order. Each value chunk is loaded once for both heads; each
// head's lanes see exactly the fused multiply-adds, in the order, of that head alone.
template <int Chunks>
inline void weighted_rows_pair(const float* const rows[16], int64_t count, const float* w0, const float* w1,
                               float* acc0, float* acc1) {
  __m512 a0[Chunks], a1[Chunks];
  for (int c = 0; c < Chunks; ++c) {
    a0[c] = _mm512_loadu_ps(acc0 + 16 * c);
    a1[c] = _mm512_loadu_ps(acc1 + 16 * c);
  }
  for (int64_t u = 0; u < count; ++u) {
    const __m512 weight0 = _mm512_set1_ps(w0[u]), weight1 = _mm512_set1_ps(w1[u]);
    const float* v = rows[u];
    for (int c = 0; c < Chunks; ++c) {
      const __m512 value = _mm512_loadu_ps(v + 16 * c);
      a0[c] = _mm512_fmadd_ps(weight0, value, a0[c]);
      a1[c] = _mm512_fmadd_ps(weight1, value, a1[c]);
    }
  }
  for (int c = 0; c < Chunks; ++c) {
    _mm512_storeu_ps(acc0 + 16 * c, a0[c]);
    _mm512_storeu_ps(acc1 + 16 * c, a1[c]);
  }
}

// Up to kTile queries of one row over their keys, for the `group` heads sharing kv head `kv_head`
// (each query's q rows consecutive): query i attends key indices 0..last[i], key index t being key
// position first + t, read through the tree path from path_start on (one query a tile where there is
// a window or a tree). Each block of 16 keys and of 16 values is looked up and read once for every
// query and head while it is in L1; each query's and head's arithmetic, and its order, is that of
// the query and head alone (the key pointers past a query's last index point at valid keys; their
// lanes are masked), so a query's result never depends on the tile it lands in.
// (Plain: key index t is key position t, no window or tree; the addressing alone differs.)
constexpr int64_t kTile = 4;

template <bool Plain>
void attend_keys(int64_t count, const float* const q[kTile], const int64_t last[kTile], const float* keys,
                 const float* values, const int64_t* blocks, int64_t block_size, int64_t first, const int64_t* path,
                 int64_t path_start, int64_t kv_head, int64_t num_kv_heads, int64_t group, int64_t d, float scale,
                 float* scratch, float* const out[kTile]) {
  auto slot = [&](int64_t t) {
    if constexpr (Plain) return blocks[t / block_size] * block_size + t % block_size;
    const int64_t key = first + t;
    const int64_t stored = (path != nullptr && key >= path_start) ? path[key - path_start] : key;
    return blocks[stored / block_size] * block_size + stored % block_size;
  };
  int64_t tile_last = 0;  // the tile's last key index
  for (int64_t i = 0; i < count; ++i) tile_last = last[i] > tile_last ? last[i] : tile_last;
  const int64_t stride = num_kv_heads * d;  // between consecutive slots
  const int64_t width = (tile_last + 16) / 16 * 16;  // score slots per head
  float* scores[kTile];  // per query [group, width], then its sums [group, d]
  float* acc_store[kTile];
  for (int64_t i = 0; i < count; ++i) {
    scores[i] = scratch + i * group * (width + d);
    acc_store[i] = scores[i] + group * width;
  }
  const float* block[16];
  __m512 maxima[kTile][64];
  for (int64_t i = 0; i < count; ++i)
    for (int64_t h = 0; h < group; ++h) maxima[i][h] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t <= tile_last; t += 16) {  // 16 key positions at a time (past a query's last: masked)
    const int64_t tile_left = tile_last + 1 - t;
    for (int j = 0; j < 16; ++j) block[j] = keys + slot(t + (j < tile_left ? j : tile_left - 1)) * stride + kv_head * d;
    for (int64_t i = 0; i < count; ++i) {
      if (t > last[i]) continue;
      const __mmask16 lanes = first_lanes(last[i] + 1 - t);
      for (int64_t h = 0; h < group; ++h) {
        const __m512 s = _mm512_mul_ps(_mm512_set1_ps(scale), dots16(q[i] + h * d, block, d));
        _mm512_mask_storeu_ps(scores[i] + h * width + t, lanes, s);
        maxima[i][h] = _mm512_mask_max_ps(maxima[i][h], lanes, maxima[i][h], s);
      }
    }
  }
  float totals[kTile][64];
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t h = 0; h < group; ++h) {
      const __m512 max_vec = _mm512_set1_ps(_mm512_reduce_max_ps(maxima[i][h]));
      __m512 sums = _mm512_setzero_ps();
      for (int64_t t = 0; t <= last[i]; t += 16) {
        const __mmask16 lanes = first_lanes(last[i] + 1 - t);
        float* row = scores[i] + h * width + t;
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row), max_vec));
        _mm512_mask_storeu_ps(row, lanes, e);
        sums = _mm512_mask_add_ps(sums, lanes, sums, e);
      }
      totals[i][h] = _mm512_reduce_add_ps(sums);
    }
    for (int64_t j = 0; j < group * d; ++j) acc_store[i][j] = 0.0f;
  }
  const int64_t chunks = d / 16;
  __m512 acc[16];  // head_dim up to 256
  const float* rows[16];  // the block's value rows, looked up once for every query and head
  for (int64_t t = 0; t <= tile_last; t += 16) {  // each output lane accumulates over t in order
    const int64_t tile_end = t + 16 <= tile_last + 1 ? t + 16 : tile_last + 1;
    for (int64_t u = t; u < tile_end; ++u) rows[u - t] = values + slot(u) * stride + kv_head * d;
    for (int64_t i = 0; i < count; ++i) {
      if (t > last[i]) continue;
      const int64_t end = t + 16 <= last[i] + 1 ? t + 16 : last[i] + 1;
      int64_t h = 0;
      for (; h + 1 < group && (chunks == 8 || chunks == 4); h += 2) {  // heads in pairs: a value chunk read once
        float* acc0 = acc_store[i] + h * d;
        const float* w0 = scores[i] + h * width + t;
        if (chunks == 8) weighted_rows_pair<8>(rows, end - t, w0, w0 + width, acc0, acc0 + d);
        else weighted_rows_pair<4>(rows, end - t, w0, w0 + width, acc0, acc0 + d);
      }
      for (; h < group; ++h) {
        for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_loadu_ps(acc_store[i] + h * d + 16 * c);
        for (int64_t u = t; u < end; ++u) {
          const __m512 weight = _mm512_set1_ps(scores[i][h * width + u]);
          const float* v = rows[u - t];
          for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + 16 * c), acc[c]);
        }
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc_store[i] + h * d + 16 * c, acc[c]);
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t h = 0; h < group; ++h) {
      const __m512 norm = _mm512_set1_ps(totals[i][h]);
      for (int64_t c = 0; c < chunks; ++c) {
        _mm512_storeu_ps(out[i] + h * d + 16 * c, _mm512_div_ps(_mm512_loadu_ps(acc_store[i] + h * d + 16 * c), norm));
      }
    }
  }
}

void attend_tile(int64_t count, const float* const q[kTile], const int64_t last[kTile], const float* keys,
                 const float* values, const int64_t* blocks, int64_t block_size, int64_t first, const int64_t* path,
                 int64_t path_start, int64_t kv_head, int64_t num_kv_heads, int64_t group, int64_t d, float scale,
                 float* scratch, float* const out[kTile]) {
  if (first == 0 && path == nullptr)
    attend_keys<true>(count, q, last, keys, values, blocks, block_size, first, path, path_start, kv_head, num_kv_heads,
                      group, d, scale, scratch, out);
  else
    attend_keys<false>(count, q, last, keys, values, blocks, block_size, first, path, path_start, kv_head, num_kv_heads,
                       group, d, scale, scratch, out);
}

}  // namespace

#include "paged_attention.h"
