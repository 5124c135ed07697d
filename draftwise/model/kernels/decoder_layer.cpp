// A whole decoder layer as one native call on the CPU: the same kernels the Python layer calls
// (RMSNorm, the low-bit or float matmuls, rotary, the KV write, paged attention, SiLU-gated
// product), in the same order on the same tensors, so the results are the same bits; what goes is
// the Python and dispatcher overhead between them (~100 tensor operations a layer, a sixth of a
// 1.5B step on two cores, a third of a 0.5B draft token).
//
// The kernels live in their own extensions (the matmuls in quant, the layer ops here in model,
// attention in cache), each compiled with its own flags; they hand their entry points over as
// capsules, so this file calls exactly the compiled code the Python path calls.

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>
#include <vector>

namespace py = pybind11;

namespace {

using Int4Q8 = torch::Tensor (*)(torch::Tensor x, torch::Tensor strips, int64_t n);
using Int8Q8 = torch::Tensor (*)(torch::Tensor x, torch::Tensor strips, torch::Tensor scales, int64_t n);
using Int4Bf16 = torch::Tensor (*)(torch::Tensor x, torch::Tensor nibbles, torch::Tensor scale_min, int64_t n);
using Int8Bf16 = torch::Tensor (*)(torch::Tensor x, torch::Tensor weight, torch::Tensor scales);
using RmsNorm = torch::Tensor (*)(torch::Tensor x, torch::Tensor weight, double eps);
using Rotary = torch::Tensor (*)(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
using SiluMul = torch::Tensor (*)(torch::Tensor gate_up);
using PagedAttention = torch::Tensor (*)(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                         torch::Tensor block_tables, int64_t block_size, torch::Tensor query_rows,
                                         torch::Tensor positions, torch::Tensor path_start, torch::Tensor path,
                                         double scale, int64_t window);

void* pointer(const py::capsule& capsule) { return capsule.get_pointer(); }

// rows float [M, K] times a weight prepacked for oneDNN (model/onednn_linear.py): a single row goes
// through oneDNN's GEMM as two, as the Python layer does (its GEMV rounds differently).
torch::Tensor onednn_linear(const torch::Tensor& rows, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t m = rows.size(0);
  torch::jit::Stack stack{m == 1 ? rows.expand({2, -1}) : rows, packed,
                          bias.defined() ? c10::IValue(bias) : c10::IValue(),
                          std::string("none"), c10::List<c10::optional<at::Scalar>>(), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  const torch::Tensor out = stack[0].toTensor();
  return m == 1 ? out.narrow(0, 0, 1) : out;
}

// Each new token's keys and values to its slot: keys, values [slots, Hkv, D] float, contiguous (one
// layer's storage); k [B, Hkv, S, D] contiguous (the rotary's output), v [B, S, Hkv, D] (a view of the
// QKV output, D contiguous); slots [B*S]. What the Python layer's index_copy_ stores (a copy), without
// two dispatched operations a layer.
void write_kv(const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& slots, const torch::Tensor& k,
              const torch::Tensor& v) {
  const int64_t b = k.size(0), heads = k.size(1), s = k.size(2), d = k.size(3), count = keys.size(0);
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && values.scalar_type() == torch::kFloat32 && keys.is_contiguous() &&
                  values.is_contiguous() && k.is_contiguous() && v.stride(3) == 1 && slots.numel() == b * s &&
                  slots.scalar_type() == torch::kLong && slots.is_contiguous(),
              "write_kv: float32 contiguous storage, keys [B, Hkv, S, D], values [B, S, Hkv, D], slots [B*S]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* keys_out = keys.data_ptr<float>();
  float* values_out = values.data_ptr<float>();
  for (int64_t n = 0; n < b * s; ++n)
    TORCH_CHECK(slot[n] >= 0 && slot[n] < count, "write_kv: slot ", slot[n], " out of range");
  for (int64_t n = 0; n < b * s; ++n) {  // (every slot checked first: a bad one writes nothing)
    const int64_t bi = n / s, si = n % s;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(keys_out + (slot[n] * heads + h) * d, kp + ((bi * heads + h) * s + si) * d, d * sizeof(float));
      std::memcpy(values_out + (slot[n] * heads + h) * d, vp + bi * v.stride(0) + si * v.stride(1) + h * v.stride(2),
                  d * sizeof(float));
    }
  }
}

// One linear layer: how the Python module computes it (`kind`), on which tensors.
struct Linear {
  std::string kind;  // "float", "onednn", "int4_q8", "int8_q8", "int4_bf16", "int8_bf16", "q4k_q8", "q6k_q8"
  void* function = nullptr;  // the matmul's entry point (the quantized kinds)
  std::vector<torch::Tensor> tensors;  // float: weight [N, K]; onednn: the prepacked weight; the others: packed weight (and scales)
  torch::Tensor bias;  // [N] or undefined
  int64_t out_features = 0;

  // x float [M, K] contiguous -> [M, N] float
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == "float") return at::linear(x, tensors[0], bias);
    if (kind == "onednn") return onednn_linear(x, tensors[0], bias);
    torch::Tensor out;
    if (kind == "int4_q8" || kind == "q4k_q8" || kind == "q6k_q8") {
      out = reinterpret_cast<Int4Q8>(function)(x, tensors[0], out_features);
    } else if (kind == "int8_q8") {
      out = reinterpret_cast<Int8Q8>(function)(x, tensors[0], tensors[1], out_features);
    } else if (kind == "int4_bf16") {
      out = reinterpret_cast<Int4Bf16>(function)(x.to(torch::kBFloat16).contiguous(), tensors[0], tensors[1], out_features);
    } else {  // int8_bf16
      out = reinterpret_cast<Int8Bf16>(function)(x.to(torch::kBFloat16).contiguous(), tensors[0], tensors[1]);
    }
    return bias.defined() ? out + bias : out;
  }
};

Linear make_linear(const std::string& kind, const py::object& function, std::vector<torch::Tensor> tensors,
                   c10::optional<torch::Tensor> bias, int64_t out_features) {
  TORCH_CHECK(kind == "float" || kind == "onednn" || kind == "int4_q8" || kind == "int8_q8" || kind == "int4_bf16" || kind == "int8_bf16" ||
                  kind == "q4k_q8" || kind == "q6k_q8",
              "unknown linear kind ", kind);
  Linear linear;
  linear.kind = kind;
  if (kind != "float" && kind != "onednn") linear.function = pointer(function.cast<py::capsule>());
  linear.tensors = std::move(tensors);
  if (bias.has_value()) linear.bias = *bias;
  linear.out_features = out_features;
  return linear;
}

// What one forward pass reads and writes of the paged KV cache (every layer the same).
struct Pass {
  PagedAttention attention;
  torch::Tensor keys, values;  // [L, slots, Hkv, D]
  torch::Tensor write_slots;  // [B*S]
  torch::Tensor block_tables;  // [B, W]
  int64_t block_size;
  torch::Tensor query_rows, positions, path_start, path;  // [B*S], [B*S], [B*S] or [0], [B*S, T] or [0]
};

struct Layer {
  RmsNorm rms_norm;
  Rotary rotary;
  SiluMul silu_mul;
  torch::Tensor input_norm, post_attention_norm, q_norm, k_norm;  // [H], [H], [D] or undefined
  double eps;
  Linear qkv, o, gate_up, down;
  int64_t layer_index, num_heads, num_kv_heads, head_dim, window;
  double scale;

  // x [B, S, H] contiguous, cos and sin [B, 1, S, D] -> the layer's output [B, S, H]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const Pass& pass) const {
    const int64_t b = x.size(0), s = x.size(1), hidden = x.size(2), n = b * s, d = head_dim;
    const int64_t q_size = num_heads * d, kv_size = num_kv_heads * d;
    const torch::Tensor residual = x.reshape({n, hidden});  // [N, H]

    const torch::Tensor qkv_out = qkv(rms_norm(residual, input_norm, eps));  // [N, Q + 2 KV]
    torch::Tensor q = qkv_out.narrow(1, 0, q_size).view({b, s, num_heads, d});
    torch::Tensor k = qkv_out.narrow(1, q_size, kv_size).view({b, s, num_kv_heads, d});
    const torch::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({b, s, num_kv_heads, d});
    if (q_norm.defined()) {
      q = rms_norm(q.reshape({-1, d}).contiguous(), q_norm, eps).view({b, s, num_heads, d});
      k = rms_norm(k.reshape({-1, d}).contiguous(), k_norm, eps).view({b, s, num_kv_heads, d});
    }
    q = rotary(q.transpose(1, 2), cos, sin);  // [B, Hq, S, D] contiguous
    k = rotary(k.transpose(1, 2), cos, sin);  // [B, Hkv, S, D] contiguous

    const torch::Tensor layer_keys = pass.keys.select(0, layer_index);  // [slots, Hkv, D]
    const torch::Tensor layer_values = pass.values.select(0, layer_index);
    write_kv(layer_keys, layer_values, pass.write_slots, k, v);
    const torch::Tensor queries = q.transpose(1, 2).reshape({n, num_heads, d}).contiguous();  // [N, Hq, D]
    const torch::Tensor attended = pass.attention(queries, layer_keys, layer_values, pass.block_tables, pass.block_size,
                                                  pass.query_rows, pass.positions, pass.path_start, pass.path,
                                                  scale, window);  // [N, Hq, D]
    const torch::Tensor after_attention = residual + o(attended.view({n, q_size}));  // [N, H]

    const torch::Tensor gate_up_out = gate_up(rms_norm(after_attention, post_attention_norm, eps));  // [N, 2I]
    const torch::Tensor out = after_attention + down(silu_mul(gate_up_out));  // [N, H]
    return out.view({b, s, hidden});
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Linear>(m, "Linear").def(py::init(&make_linear));
  py::class_<Pass>(m, "Pass")
      .def(py::init([](const py::capsule& attention, torch::Tensor keys, torch::Tensor values, torch::Tensor write_slots,
                       torch::Tensor block_tables, int64_t block_size, torch::Tensor query_rows, torch::Tensor positions,
                       torch::Tensor path_start, torch::Tensor path) {
        return Pass{reinterpret_cast<PagedAttention>(pointer(attention)), keys, values, write_slots, block_tables,
                    block_size, query_rows, positions, path_start, path};
      }));
  py::class_<Layer>(m, "Layer")
      .def(py::init([](const py::dict& layer_ops, torch::Tensor input_norm, torch::Tensor post_attention_norm,
                       c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double eps,
                       Linear qkv, Linear o, Linear gate_up, Linear down, int64_t layer_index, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, double scale, int64_t window) {
        Layer layer{reinterpret_cast<RmsNorm>(pointer(layer_ops["rms_norm"].cast<py::capsule>())),
                    reinterpret_cast<Rotary>(pointer(layer_ops["apply_rotary"].cast<py::capsule>())),
                    reinterpret_cast<SiluMul>(pointer(layer_ops["silu_mul"].cast<py::capsule>())),
                    input_norm, post_attention_norm, {}, {}, eps, qkv, o, gate_up, down,
                    layer_index, num_heads, num_kv_heads, head_dim, window, scale};
        if (q_norm.has_value()) layer.q_norm = *q_norm;
        if (k_norm.has_value()) layer.k_norm = *k_norm;
        return layer;
      }))
      .def("forward", &Layer::forward, py::call_guard<py::gil_scoped_release>(),
           "x [B, S, H], cos and sin [B, 1, S, D], the pass -> [B, S, H]");
}
