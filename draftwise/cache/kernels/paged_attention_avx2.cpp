// Causal attention over a paged KV cache on AVX2 (8 lanes): the algorithm, the layouts and why one
// fixed order of arithmetic per query are in paged_attention.h, which this file ends by including.
// The same steps as the AVX-512 build, eight keys and eight lanes of D at a time; AVX2 has no
// masked operations, so partial blocks of keys go through lane masks (compare, blend, maskstore).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 8;

// exp(x) for x <= 0, 8 lanes: 2^n * p(r) with n = round(x log2 e), r = x - n ln 2 (in two parts),
// p a degree-6 polynomial (Taylor), |error| ~ 2 ulp; 2^n built in the exponent bits (n >= -126
// after the clamp, so it stays a normal float). The same instructions for every lane.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // below: exp underflows (the caller zeroes unused lanes)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// The lane sums of 8 vectors as one vector (lane j: the sum of v[j]'s 8 lanes), by a fixed network
// of horizontal adds (pairs, then pairs of pairs within 128-bit halves) and one add of the halves.
// Each sum involves its own vector's lanes only, in the same order for every j.
inline __m256 lane_sums(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 low = _mm256_hadd_ps(a, b), high = _mm256_hadd_ps(c, d);  // per half: v0..v3 | v4..v7 partials
  // lanes of low: [v0.lo v1.lo v2.lo v3.lo | v0.hi v1.hi v2.hi v3.hi], the same for high with v4..v7
  const __m256 los = _mm256_permute2f128_ps(low, high, 0x20), his = _mm256_permute2f128_ps(low, high, 0x31);
  return _mm256_add_ps(los, his);
}

// The sum and the maximum of a vector's 8 lanes, in a fixed order.
inline float reduce_add(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline float reduce_max(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// The dot products of q with 8 keys (rows of d floats), as one vector.
inline __m256 dots8(const float* q, const float* const keys[8], int64_t d) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += kLanes) {
    const __m256 qi = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(keys[j] + i), acc[j]);
  }
  return lane_sums(acc);
}

// One head's weighted sum over a block's value rows (u = 0..count-1): acc [Chunks x 8] += w[u] * v[u],
// u in order, the sums kept in registers over the block (a runtime number of chunks would keep
// them in memory: a load and a store per multiply-add).
template <int Chunks>
inline void weighted_rows(const float* const rows[kLanes], int64_t count, const float* w, int64_t offset, float* acc) {
  __m256 a[Chunks];
  for (int c = 0; c < Chunks; ++c) a[c] = _mm256_loadu_ps(acc + kLanes * c);
  for (int64_t u = 0; u < count; ++u) {
    const __m256 weight = _mm256_set1_ps(w[u]);
    const float* v = rows[u] + offset;
    for (int c = 0; c < Chunks; ++c) a[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + kLanes * c), a[c]);
  }
  for (int c = 0; c < Chunks; ++c) _mm256_storeu_ps(acc + kLanes * c, a[c]);
}

// All ones in the first `count` lanes (at least one), zeros after.
inline __m256i first_lanes(int64_t count) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count < kLanes ? count : kLanes)), index);
}

// Up to kTile queries of one row over their keys, for the `group` heads sharing kv head `kv_head`
// (each query's q rows consecutive): query i attends key indices 0..last[i], key index t being key
// position first + t, read through the tree path from path_start on (one query a tile where there is
// a window or a tree). Each block of 8 keys and of 8 values is looked up and read once for every
// query and head while it is in L1; each query's and head's arithmetic, and its order, is that of
// the query and head alone (the key pointers past a query's last index point at valid keys of the
// tile; their lanes are masked, and a lane's dot product involves its own key only), so a query's
// result never depends on the tile it lands in.
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
  const int64_t width = (tile_last + kLanes) / kLanes * kLanes;  // score slots per head
  float* scores[kTile];  // per query [group, width], then its sums [group, d]
  float* acc_store[kTile];
  for (int64_t i = 0; i < count; ++i) {
    scores[i] = scratch + i * group * (width + d);
    acc_store[i] = scores[i] + group * width;
  }
  const float* block[8];
  __m256 maxima[kTile][64];
  for (int64_t i = 0; i < count; ++i)
    for (int64_t h = 0; h < group; ++h) maxima[i][h] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t <= tile_last; t += kLanes) {  // 8 key positions at a time (past a query's last: masked)
    const int64_t tile_left = tile_last + 1 - t;
    for (int j = 0; j < 8; ++j) block[j] = keys + slot(t + (j < tile_left ? j : tile_left - 1)) * stride + kv_head * d;
    for (int64_t i = 0; i < count; ++i) {
      if (t > last[i]) continue;
      const __m256i lanes = first_lanes(last[i] + 1 - t);
      for (int64_t h = 0; h < group; ++h) {
        const __m256 s = _mm256_mul_ps(_mm256_set1_ps(scale), dots8(q[i] + h * d, block, d));
        _mm256_maskstore_ps(scores[i] + h * width + t, lanes, s);
        maxima[i][h] = _mm256_blendv_ps(maxima[i][h], _mm256_max_ps(maxima[i][h], s), _mm256_castsi256_ps(lanes));
      }
    }
  }
  float totals[kTile][64];
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t h = 0; h < group; ++h) {
      const __m256 max_vec = _mm256_set1_ps(reduce_max(maxima[i][h]));
      __m256 sums = _mm256_setzero_ps();
      for (int64_t t = 0; t <= last[i]; t += kLanes) {
        const __m256i lanes = first_lanes(last[i] + 1 - t);
        float* row = scores[i] + h * width + t;
        const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(row, lanes), max_vec)),
                                       _mm256_castsi256_ps(lanes));
        _mm256_maskstore_ps(row, lanes, e);
        sums = _mm256_add_ps(sums, e);
      }
      totals[i][h] = reduce_add(sums);
    }
    for (int64_t j = 0; j < group * d; ++j) acc_store[i][j] = 0.0f;
  }
  const int64_t chunks = d / kLanes;
  const float* rows[kLanes];  // the block's value rows, looked up once for every query and head
  for (int64_t t = 0; t <= tile_last; t += kLanes) {  // each output lane accumulates over t in order
    const int64_t tile_end = t + kLanes <= tile_last + 1 ? t + kLanes : tile_last + 1;
    for (int64_t u = t; u < tile_end; ++u) rows[u - t] = values + slot(u) * stride + kv_head * d;
    for (int64_t i = 0; i < count; ++i) {
      if (t > last[i]) continue;
      const int64_t end = t + kLanes <= last[i] + 1 ? t + kLanes : last[i] + 1;
      for (int64_t h = 0; h < group; ++h) {
        const float* w = scores[i] + h * width + t;
        float* acc = acc_store[i] + h * d;
        int64_t c = 0;  // eight chunks at a time (eight accumulators and a value fit AVX2's 16 registers), then the rest
        for (; c + 8 <= chunks; c += 8) weighted_rows<8>(rows, end - t, w, kLanes * c, acc + kLanes * c);
        if (c + 4 <= chunks) weighted_rows<4>(rows, end - t, w, kLanes * c, acc + kLanes * c), c += 4;
        if (c + 2 <= chunks) weighted_rows<2>(rows, end - t, w, kLanes * c, acc + kLanes * c), c += 2;
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t h = 0; h < group; ++h) {
      const __m256 norm = _mm256_set1_ps(totals[i][h]);
      for (int64_t c = 0; c < chunks; ++c) {
        _mm256_storeu_ps(out[i] + h * d + kLanes * c,
                         _mm256_div_ps(_mm256_loadu_ps(acc_store[i] + h * d + kLanes * c), norm));
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
