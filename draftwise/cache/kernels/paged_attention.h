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
//   s_t = scale * <q_n,h , k_b,t,g>          t = 0..p   (dot over D in L-lane blocks, lanes summed in a fixed tree)
//   m = max_t s_t,  e_t = exp(s_t - m) (L at a time),  l = sum of the e_t (L lanes, then a fixed tree)
//   out_n,h = (sum_t e_t v_b,t,g) / l        (accumulated in t order, L lanes of D at a time)
// L = 16 lanes on AVX-512, 8 on AVX2: the two builds round differently, each the same for every query.
//
// Layouts (all contiguous)
//   q            float [N, Hq, D]       D a multiple of 16
//   keys, values float [slots, Hkv, D]   one layer's paged storage, slots = blocks x block_size
//   block_tables int64 [B, W]            each row's blocks in position order: key position t of row b is in
//                                        slot block_tables[b, t / block_size] * block_size + t % block_size
//   query_rows   int64 [N]               the row of each query
//   positions    int64 [N]               the position of each query (it sees keys 0..position; with a sliding
//                                        window w > 0, keys position - w + 1..position)
//   path_start   int64 [N]               token trees (else both empty): key positions t >= path_start[n] of
//   path         int64 [N, T]            query n are read from position path[n, t - path_start[n]] (its
//                                        ancestors in the tree, then itself, stored wherever the pass put them)
//   out          float [N, Hq, D]
//
// A tree node at depth d thus attends exactly the keys a chain query at the same position attends in a
// chain made of its ancestors, in the same order, with the same arithmetic: verifying a tree computes,
// along every root path, what verifying that path alone computes, bit for bit.

// This file is the entry point every build shares (argument checks; one task per query and kv head,
// split across threads; the Python binding). A build (paged_attention_avx512.cpp,
// paged_attention_avx2.cpp) defines, in an anonymous namespace, before including it, kTile and
//   void attend_tile(int64_t count, const float* const q[kTile], const int64_t last[kTile], const float* keys,
//                    const float* values, const int64_t* blocks, int64_t block_size, int64_t first,
//                    const int64_t* path, int64_t path_start, int64_t kv_head, int64_t num_kv_heads,
//                    int64_t group, int64_t d, float scale, float* scratch, float* const out[kTile]);
// up to kTile queries of one row, query i over the row's key indices 0..last[i] (key index t is key
// position first + t, read through the tree path from path_start on), for the `group` heads sharing
// kv head `kv_head` (their q rows consecutive), each with the bits it would have alone; scratch holds
// kTile x group x ((largest last) + 1 rounded up to 16) scores and kTile x group x d sums.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor block_tables,
                              int64_t block_size, torch::Tensor query_rows, torch::Tensor positions,
                              torch::Tensor path_start, torch::Tensor path, double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32 && values.dtype() == torch::kFloat32,
              "paged_attention: fp32 only");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous() && block_tables.is_contiguous(),
              "paged_attention: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3 && keys.sizes() == values.sizes() &&
              keys.size(2) == q.size(2), "paged_attention: q [N, H, D], keys and values [slots, Hkv, D]");
  TORCH_CHECK(block_tables.dim() == 2 && block_size > 0 && keys.size(0) % block_size == 0,
              "paged_attention: block_tables [B, W] over slots in blocks of block_size");
  for (const torch::Tensor* index : {&block_tables, &query_rows, &positions})
    TORCH_CHECK(index->scalar_type() == torch::kInt64 && index->is_contiguous(),
                "paged_attention: block_tables, query_rows and positions must be contiguous int64");
  TORCH_CHECK(query_rows.numel() == q.size(0) && positions.numel() == q.size(0),
              "paged_attention: query_rows and positions must hold one entry per query");
  const int64_t num_queries = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv_heads = keys.size(1), table_width = block_tables.size(1) * block_size;
  TORCH_CHECK(d % 16 == 0 && d <= 256, "paged_attention: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_attention: heads must group over kv heads");
  {
    const int64_t num_blocks = keys.size(0) / block_size, entries = block_tables.numel();
    const int64_t* entry = block_tables.data_ptr<int64_t>();
    for (int64_t i = 0; i < entries; ++i)
      TORCH_CHECK(entry[i] >= 0 && entry[i] < num_blocks, "paged_attention: a block table entry past the cache");
    const int64_t* rows = query_rows.data_ptr<int64_t>();
    for (int64_t n = 0; n < num_queries; ++n)
      TORCH_CHECK(rows[n] >= 0 && rows[n] < block_tables.size(0), "paged_attention: a query row past the block tables");
  }
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
  TORCH_CHECK(!tree || (path.dim() == 2 && path.scalar_type() == torch::kInt64 && path.is_contiguous() &&
                        path.size(0) == num_queries && path_start.scalar_type() == torch::kInt64 &&
                        path_start.is_contiguous() && path_start.numel() == num_queries),
              "paged_attention: path must be contiguous int64 [N, T] with path_start [N]");
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
  TORCH_CHECK(window >= 0, "paged_attention: a negative window");
  // Tiles: up to kTile consecutive queries of one row (a prompt, a verification) read each block of
  // keys once for all (chains without a window; others one query a tile). Every query's arithmetic is
  // its own alone either way, so a query's result never depends on the tile it lands in.
  std::vector<int64_t> tile_starts;
  for (int64_t n = 0; n < num_queries;) {
    tile_starts.push_back(n);
    int64_t count = 1;
    while (!tree && window == 0 && count < kTile && n + count < num_queries && row_ptr[n + count] == row_ptr[n]) ++count;
    n += count;
  }
  tile_starts.push_back(num_queries);
  const int64_t tiles = static_cast<int64_t>(tile_starts.size()) - 1;
  at::parallel_for(0, tiles * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kTile * group * ((table_width + 15) / 16 * 16 + d));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / tiles, tile = task % tiles;  // kv head major: each thread gets whole heads where it can
      const int64_t n0 = tile_starts[tile], count = tile_starts[tile + 1] - n0;
      const int64_t* table = table_ptr + row_ptr[n0] * block_tables.size(1);
      const float* qs[kTile];
      float* outs[kTile];
      int64_t last[kTile];
      int64_t first = 0;  // (a tile of several queries has no window)
      for (int64_t i = 0; i < count; ++i) {
        const int64_t n = n0 + i;
        qs[i] = q_ptr + (n * num_heads + g * group) * d;
        outs[i] = out_ptr + (n * num_heads + g * group) * d;
        first = window > 0 && pos_ptr[n] >= window ? pos_ptr[n] - window + 1 : 0;
        last[i] = pos_ptr[n] - first;
      }
      attend_tile(count, qs, last, k_ptr, v_ptr, table, block_size, first, tree ? path_ptr + n0 * path_width : nullptr,
                  tree ? start_ptr[n0] : 0, g, num_kv_heads, group, d, static_cast<float>(scale), scratch.data(), outs);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache, batch-invariant (fp32)");
  // entry points for the fused decoder layer (model/kernels/decoder_layer.cpp), which calls this very code
  m.attr("entry_points") = pybind11::dict(
      pybind11::arg("paged_attention") = pybind11::capsule(reinterpret_cast<void*>(&paged_attention)));
}
