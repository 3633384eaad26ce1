// decode_layers: the decoder layers of a llama-family model over one decode batch, in one call.
//
// The same ops the Python layer loop (common/model/llama.py's run_layers) calls, in its order and on the same
// tensors, reached through torch's dispatcher: rms_norm / add_rms_norm_ (and Qwen3's per-head q/k norms), the
// packed linears (our GEMM's packed_linear, tandem_gemm, loaded by the caller; or oneDNN's
// mkldnn::_linear_pointwise), rope_, store_kv, decode_attention and silu_and_mul (or, where the Python MLP takes it
// too, our kernel's gate/up projection and activation in one pass, packed_gate_up_silu). The output is bitwise the
// Python loop's. What the call saves is the Python between the ops (some twenty op and module calls a layer, a
// tenth of a decode forward at a few rows on 2 cores) and the model thread's need for the GIL while the layers run.
// An MoE layer (SparseMoeBlock) runs its router (linear, softmax, top-k, renormalization), the placement's local
// expert ids, its experts' one-call loop (below, or cpu_gemm's float32 one) and its gated shared expert the same way;
// the routing comes back for the expert recorder. common/model/cpu_layers.py decides when a batch may take this path.
//
// moe_experts: an MoE layer's expert loop (common/model/moe.py's Experts._grouped_loop) in one call, op for op, over
// the experts' packed copies for oneDNN's GEMM or ours (a float32 layer on ours has its own, fused op in
// cpu_gemm/gemm.cpp); moe.py decides when.

#include <algorithm>

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using OptionalTensor = std::optional<at::Tensor>;

// x @ W.T (+ bias) over a packed weight: our kernel's panels, or oneDNN's packed copy (called boxed, as Python does:
// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const OptionalTensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                                 c10::IValue("none"), c10::IValue(c10::List<std::optional<at::Scalar>>()),
                                 c10::IValue("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// Our kernel's packed_linear (tandem_gemm), looked up on first use: a machine on oneDNN may never load it.
at::Tensor our_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const OptionalTensor& bias) {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&)>(
      "tandem_gemm::packed_linear");
  return op.call(x, panels, n, bias);
}

// silu(gate) * up of x @ [gate; up].T in one pass of our kernel (tandem_gemm::packed_gate_up_silu).
at::Tensor our_gate_up_silu(const at::Tensor& x, const at::Tensor& panels, int64_t inter, at::ScalarType dtype) {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, std::optional<at::ScalarType>)>(
      "tandem_gemm::packed_gate_up_silu");
  return op.call(x, panels, inter, dtype);
}

// A packed linear and the MLP's gate/up projection with its activation, as PackedWeight.linear and gate_up_silu run
// them: oneDNN's GEMM or ours (the fused pass where the halves are whole panels), a widened 16-bit layer multiplying
// its input in float32 and rounding the output back.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const OptionalTensor& bias,
                         bool onednn, bool widened) {
  const at::Tensor in = widened ? x.to(at::kFloat) : x;
  return (onednn ? onednn_linear(in, packed, bias) : our_linear(in, packed, n, bias)).to(x.scalar_type());
}

at::Tensor packed_gate_up_silu(const at::Tensor& x, const at::Tensor& packed, int64_t inter, bool onednn,
                               bool widened) {
  static auto silu_and_mul = find_op<at::Tensor(const at::Tensor&)>("tandem_cpu::silu_and_mul");
  if (!onednn && inter % packed.size(2) == 0) {
    return our_gate_up_silu(widened ? x.to(at::kFloat) : x, packed, inter, x.scalar_type());
  }
  return silu_and_mul.call(packed_linear(x, packed, 2 * inter, OptionalTensor(), onednn, widened));
}

// moe.MLP.forward over packed gate/up [2I, H] and down [H, I] weights.
at::Tensor dense_mlp(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, int64_t inter,
                     bool onednn, bool widened) {
  return packed_linear(packed_gate_up_silu(x, gate_up, inter, onednn, widened), down, x.size(-1), OptionalTensor(),
                       onednn, widened);
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& local_ids, const at::Tensor& weights,
                       at::TensorList w13, at::TensorList w2, int64_t inter, bool onednn, bool widened);

// How an MoE model's layers run their experts in decode_layers: the arguments of SparseMoeBlock's (common/model/moe.py)
// router and placement, one entry a layer, and every layer's local experts' packed copies one layer after another.
struct MoeArgs {
  at::TensorList router, physical_of, replicas, local_of_physical, w13, w2;
  int64_t inter, top_k;
  bool norm_topk_prob, routing_in_fp32;
  int64_t experts_op;  // 1: our kernel's float32 call (tandem_gemm::moe_experts), 2: this library's moe_experts
  bool onednn, widened;  // the experts' GEMM, for experts_op 2
  // Qwen2-MoE's shared expert, one a layer or none: a dense MLP on the attention's GEMM, and its sigmoid gate.
  at::TensorList shared_gate_up, shared_down, shared_gate;
  int64_t shared_inter;
  bool dense_onednn, dense_widened;
};

// SparseMoeBlock.forward for the l-th MoE layer: its shared expert, route (SparseMoeBlock.route), map each (token, k)
// to its local expert (local_ids), run the experts (Experts._grouped), add the gated shared expert. The routing ids
// come back through `ids` for the caller's expert recorder.
at::Tensor moe_mlp(const at::Tensor& x, int64_t l, const MoeArgs& moe, std::vector<at::Tensor>& ids) {
  static auto fused = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                                         at::TensorList, int64_t)>("tandem_gemm::moe_experts");
  const at::Tensor shared = moe.shared_gate_up.empty() ? at::Tensor()
                                                      : dense_mlp(x, moe.shared_gate_up[l], moe.shared_down[l],
                                                                  moe.shared_inter, moe.dense_onednn,
                                                                  moe.dense_widened);
  const at::Tensor logits = at::linear(x, moe.router[l]);
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [weights, routed] = at::topk(probs, moe.top_k, -1);
  if (moe.norm_topk_prob) weights.div_(weights.sum({-1}, true));
  if (!moe.routing_in_fp32) weights = weights.to(logits.scalar_type());
  ids.push_back(routed);
  // local_ids: token t's copy of expert e is its t % replicas[e]-th, held here at local_of_physical[that copy].
  const at::Tensor physical = moe.physical_of[l].contiguous(), replicas = moe.replicas[l].contiguous(),
                   local_of = moe.local_of_physical[l].contiguous(), flat = routed.contiguous();
  at::Tensor local = at::empty_like(flat);
  const int64_t* e = flat.data_ptr<int64_t>();
  const int64_t *copies = replicas.data_ptr<int64_t>(), *of = physical.data_ptr<int64_t>(),
                *held = local_of.data_ptr<int64_t>();
  int64_t* mapped = local.data_ptr<int64_t>();
  const int64_t width = physical.size(1);
  for (int64_t i = 0; i < flat.numel(); ++i) {
    mapped[i] = held[of[e[i] * width + (i / moe.top_k) % copies[e[i]]]];
  }
  const int64_t num = static_cast<int64_t>(moe.w13.size() / moe.router.size());
  const at::TensorList w13 = moe.w13.slice(l * num, num), w2 = moe.w2.slice(l * num, num);
  const at::Tensor out = moe.experts_op == 1 ? fused.call(x, local, weights, w13, w2, moe.inter)
                                             : moe_experts(x, local, weights, w13, w2, moe.inter, moe.onednn,
                                                           moe.widened);
  return shared.defined() ? out + at::sigmoid(at::linear(x, moe.shared_gate[l])) * shared : out;
}

// Returns the MoE layers' routing, [MoE layers, T, top_k] logical expert ids (empty where there are none).
at::Tensor decode_layers(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin, at::TensorList input_norm,
                   at::TensorList post_norm, double eps, at::TensorList qkv, at::TensorList qkv_bias, at::TensorList o,
                   at::TensorList gate_up, at::TensorList down, at::IntArrayRef out_features, bool onednn,
                   bool widened, at::TensorList k_buffers, at::TensorList v_buffers, const at::Tensor& loc,
                   const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                   int64_t num_heads, int64_t num_kv_heads, double sm_scale, at::ArrayRef<double> k_scales,
                   at::ArrayRef<double> v_scales, at::TensorList q_norm, at::TensorList k_norm,
                   at::IntArrayRef sparse_layers, at::TensorList router, at::TensorList physical_of,
                   at::TensorList replicas, at::TensorList local_of_physical, at::TensorList experts_w13,
                   at::TensorList experts_w2, int64_t moe_inter, int64_t top_k, bool norm_topk_prob,
                   bool routing_in_fp32, int64_t experts_op, bool experts_onednn, bool experts_widened,
                   at::TensorList shared_gate_up, at::TensorList shared_down, at::TensorList shared_gate,
                   int64_t shared_inter) {
  static auto rms_norm = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("tandem_cpu::rms_norm");
  static auto add_rms_norm = find_op<at::Tensor(at::Tensor, const at::Tensor&, const at::Tensor&, double)>(
      "tandem_cpu::add_rms_norm_");
  auto linear = [onednn, widened](const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                  const OptionalTensor& bias) {
    return packed_linear(x, packed, n, bias, onednn, widened);
  };
  static auto rope = find_op<void(at::Tensor, const at::Tensor&, const at::Tensor&)>("tandem_cpu::rope_");
  static auto store_kv = find_op<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&)>("tandem_cpu::store_kv");
  static auto attention = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                                             double)>("tandem_cpu::decode_attention");

  const int64_t layers = static_cast<int64_t>(input_norm.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layers: hidden must be a contiguous [T, H]");
  TORCH_CHECK(out_features.size() == 4, "decode_layers: out_features is [qkv, o, gate_up, down]");
  for (auto count : {post_norm.size(), qkv.size(), o.size(), k_buffers.size(), v_buffers.size(), k_scales.size(),
                     v_scales.size()}) {
    TORCH_CHECK(static_cast<int64_t>(count) == layers, "decode_layers: one entry a layer in every list");
  }
  // Each layer's MLP: a dense one (gate_up and down, one a dense layer) or an MoE block (sparse_layers[l] 1: router
  // and placement one an MoE layer, experts_op 1 or 2).
  TORCH_CHECK(static_cast<int64_t>(sparse_layers.size()) == layers, "decode_layers: one MLP kind a layer");
  const int64_t sparse = std::count(sparse_layers.begin(), sparse_layers.end(), 1);
  TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == layers - sparse &&
                  static_cast<int64_t>(down.size()) == layers - sparse,
              "decode_layers: one gate_up and one down a dense layer");
  for (auto count : {router.size(), physical_of.size(), replicas.size(), local_of_physical.size()}) {
    TORCH_CHECK(static_cast<int64_t>(count) == sparse, "decode_layers: one router and placement an MoE layer");
  }
  TORCH_CHECK(sparse == 0 || ((experts_op == 1 || experts_op == 2) && !experts_w13.empty() &&
                              experts_w13.size() == experts_w2.size() && experts_w13.size() % sparse == 0),
              "decode_layers: as many experts' copies every MoE layer, and their op");
  TORCH_CHECK(shared_gate_up.empty() || (static_cast<int64_t>(shared_gate_up.size()) == sparse &&
                                         shared_down.size() == shared_gate_up.size() &&
                                         shared_gate.size() == shared_gate_up.size()),
              "decode_layers: no shared experts, or one (gate_up, down, gate) an MoE layer");
  const MoeArgs moe{router, physical_of, replicas, local_of_physical, experts_w13, experts_w2, moe_inter, top_k,
                    norm_topk_prob, routing_in_fp32, experts_op, experts_onednn, experts_widened, shared_gate_up,
                    shared_down, shared_gate, shared_inter, onednn, widened};
  std::vector<at::Tensor> routed;
  int64_t moe_layer = 0, dense_layer = 0;
  TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == layers,
              "decode_layers: qkv_bias is empty or one a layer");
  TORCH_CHECK(q_norm.size() == k_norm.size() && (q_norm.empty() || static_cast<int64_t>(q_norm.size()) == layers),
              "decode_layers: q_norm and k_norm are both empty or one a layer each");
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
  const int64_t tokens = hidden.size(0), head_dim = k_buffers[0].size(2);
  at::Tensor pending;
  for (int64_t l = 0; l < layers; ++l) {
    // DecoderLayer.forward: the previous MLP output joins the residual stream in the input norm's pass.
    at::Tensor normed = pending.defined() ? add_rms_norm.call(hidden, pending, input_norm[l], eps)
                                          : rms_norm.call(hidden, input_norm[l], eps);
    // Attention.forward: q, k and v in one GEMM, q and k rotated in one pass, then the cpu backend's decode.
    const OptionalTensor bias = qkv_bias.empty() ? OptionalTensor() : OptionalTensor(qkv_bias[l]);
    at::Tensor heads = linear(normed, qkv[l], out_features[0], bias).view({tokens, -1, head_dim});
    at::Tensor q = heads.slice(1, 0, num_heads), k = heads.slice(1, num_heads, num_heads + num_kv_heads);
    if (q_norm.empty()) {
      rope.call(heads.slice(1, 0, num_heads + num_kv_heads), cos, sin);  // q and k in one pass
    } else {  // Qwen3: each head of q and k normed (new tensors), then rotated one after the other
      q = rms_norm.call(q, q_norm[l], eps);
      k = rms_norm.call(k, k_norm[l], eps);
      rope.call(q, cos, sin);
      rope.call(k, cos, sin);
    }
    store_kv.call(k_buffers[l], v_buffers[l], loc, k, heads.slice(1, num_heads + num_kv_heads));
    at::Tensor attended = attention.call(q, k_buffers[l], v_buffers[l], req_to_token, req_pool_indices, seq_lens,
                                         sm_scale, k_scales[l], v_scales[l]);
    at::Tensor projected =
        linear(attended.view({tokens, num_heads * head_dim}), o[l], out_features[1], OptionalTensor());
    // The MLP over the post-attention norm, whose pass adds the attention output into the residual stream.
    at::Tensor mlp_in = add_rms_norm.call(hidden, projected, post_norm[l], eps);
    if (sparse_layers[l]) {
      pending = moe_mlp(mlp_in, moe_layer++, moe, routed);
    } else {
      pending = dense_mlp(mlp_in, gate_up[dense_layer], down[dense_layer], out_features[2] / 2, onednn, widened);
      ++dense_layer;
    }
  }
  hidden.add_(pending);  // run_layers: the last MLP output
  return sparse ? at::stack(routed) : at::empty({0}, hidden.options().dtype(at::kLong));
}

// Experts._grouped_loop over x [T, H]: local_ids [T, k] (-1: an expert held elsewhere), weights [T, k] (the
// routing weights, any float dtype), w13[e] / w2[e] expert e's packed gate/up [2I, H] and down [H, I] copies, all for
// one GEMM (onednn: oneDNN's, else our panels; widened: a 16-bit layer multiplied in float32). The rows of every
// expert's (token, k) pairs, in (token, k) order, expert after expert, are gathered once; each expert runs its MLP
// over its run of them; each output row is scaled by its routing weight and the rows are added into zeros in expert
// order by one index_add_, as the Python loop adds them.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& local_ids, const at::Tensor& weights,
                       at::TensorList w13, at::TensorList w2, int64_t inter, bool onednn, bool widened) {
  TORCH_CHECK(x.dim() == 2, "moe_experts: x must be [T, H], not ", x.sizes());
  TORCH_CHECK(local_ids.dim() == 2 && local_ids.size(0) == x.size(0) && local_ids.scalar_type() == at::kLong,
              "moe_experts: local_ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == local_ids.sizes() && at::isFloatingType(weights.scalar_type()),
              "moe_experts: weights must be floating point and shaped like local_ids");
  TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "moe_experts: one w13 and one w2 an expert");
  TORCH_CHECK(inter > 0, "moe_experts: inter must be positive");
  const int64_t experts = static_cast<int64_t>(w13.size()), hidden = x.size(1), top_k = local_ids.size(1);
  const at::Tensor ids = local_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> pairs(experts);  // each expert's (token, k) pairs, in order
  for (int64_t pair = 0; pair < ids.numel(); ++pair) {
    TORCH_CHECK(id[pair] >= -1 && id[pair] < experts, "moe_experts: local id ", id[pair], " is not -1 or one of the ",
                experts, " experts");
    if (id[pair] >= 0) pairs[id[pair]].push_back(pair);
  }
  // Every expert's pairs one after the other, and their tokens: the rows are gathered once, and each expert reads
  // its run of them (the loop's per-expert gathers, products and scatter inputs hold the same values).
  std::vector<int64_t> order, tokens;
  for (const auto& run : pairs) order.insert(order.end(), run.begin(), run.end());
  for (int64_t pair : order) tokens.push_back(pair / top_k);
  at::Tensor result = at::zeros_like(x);
  if (order.empty()) return result;
  const auto index = x.options().dtype(at::kLong);
  const int64_t total = static_cast<int64_t>(order.size());
  const at::Tensor pair_ids = at::from_blob(order.data(), {total}, index).clone();
  const at::Tensor token_ids = at::from_blob(tokens.data(), {total}, index).clone();
  const at::Tensor rows = x.index_select(0, token_ids);
  std::vector<at::Tensor> outs;
  int64_t first = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = static_cast<int64_t>(pairs[e].size());
    if (count == 0) continue;
    const at::Tensor act = packed_gate_up_silu(rows.narrow(0, first, count), w13[e], inter, onednn, widened);
    outs.push_back(packed_linear(act, w2[e], hidden, OptionalTensor(), onednn, widened));
    first += count;
  }
  // The loop scales each expert's rows by their routing weights, concatenates and rounds: elementwise, the same
  // values as scaling the concatenation.
  const at::Tensor scaled = at::cat(outs) * weights.reshape({-1}).index_select(0, pair_ids).unsqueeze(1);
  result.index_add_(0, token_ids, scaled.to(x.scalar_type()));
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("decode_layers(Tensor(a!) hidden, Tensor cos, Tensor sin, Tensor[] input_norm, Tensor[] post_norm, "
        "float eps, Tensor[] qkv, Tensor[] qkv_bias, Tensor[] o, Tensor[] gate_up, Tensor[] down, int[] out_features, "
        "bool onednn, bool widened, Tensor(b!)[] k_buffers, Tensor(c!)[] v_buffers, Tensor loc, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, int num_heads, int num_kv_heads, float sm_scale, float[] k_scales, "
        "float[] v_scales, Tensor[] q_norm, Tensor[] k_norm, int[] sparse_layers, Tensor[] router, "
        "Tensor[] physical_of, Tensor[] replicas, Tensor[] local_of_physical, Tensor[] experts_w13, "
        "Tensor[] experts_w2, int moe_inter, int top_k, bool norm_topk_prob, bool routing_in_fp32, int experts_op, "
        "bool experts_onednn, bool experts_widened, Tensor[] shared_gate_up, Tensor[] shared_down, "
        "Tensor[] shared_gate, int shared_inter) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor local_ids, Tensor weights, Tensor[] w13, Tensor[] w2, int inter, bool onednn, "
        "bool widened) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("moe_experts", &moe_experts);
}
// oneDNN's packed weights are MkldnnCPU tensors: a call that passes them dispatches on that key.
TORCH_LIBRARY_IMPL(tandem_cpu, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("moe_experts", &moe_experts);
}
