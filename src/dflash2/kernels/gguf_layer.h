// A whole decoder layer over GGUF blocks in one call (included by gemm_gguf_avx2.cpp; kernels/gguf_layer.py).
//
// gguf_layer(x, cos, sin, keys, values, length, layer, mask) runs what models/decoder.py's DecoderLayer computes for
// one request's static KV cache, causal without a mask (plain decoding, chain verification, prefill) or with an
// explicit bool mask (tree verification), making the same calls in the same order -- rms_norm and qkv_rope
// (layer_ops), the layer's four gguf_linear calls, the cache write, attention_rows (the row-invariant attention
// kernel) with the same mask and causal flag, the bf16 / fp32 adds,
// silu_mul (layer_ops) -- so the same bits; it only leaves out the ~25 Python round trips per layer (~6 ms of a ~40 ms
// one-row step of the 1.5B target on 2 Zen 4 cores). The other ops are reached through the dispatcher: their
// extensions must be loaded first (kernels/gguf_layer.py checks).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>

#include <cmath>

namespace {

struct GgufLayer : torch::CustomClassHolder {
  at::Tensor attn_norm, ffn_norm;  // [D], the model dtype
  double eps = 0;
  c10::intrusive_ptr<GgufWeights> wqkv, wo, gate_up, down;
  int64_t heads = 0, kv_heads = 0;

  void set(at::Tensor attn_norm_, at::Tensor ffn_norm_, double eps_, c10::intrusive_ptr<GgufWeights> wqkv_,
           c10::intrusive_ptr<GgufWeights> wo_, c10::intrusive_ptr<GgufWeights> gate_up_,
           c10::intrusive_ptr<GgufWeights> down_, int64_t heads_, int64_t kv_heads_) {
    TORCH_CHECK(gate_up_->out_features % 2 == 0 && down_->in_features == gate_up_->out_features / 2,
                "GgufLayer: gate/up must hold 2 x the down projection's inputs");
    attn_norm = attn_norm_, ffn_norm = ffn_norm_, eps = eps_;
    wqkv = wqkv_, wo = wo_, gate_up = gate_up_, down = down_;
    heads = heads_, kv_heads = kv_heads_;
  }
};

using NormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using RopeFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              int64_t, int64_t);
using SiluMulFn = at::Tensor(const at::Tensor&, int64_t);
using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const c10::optional<at::Tensor>&, bool, double, int64_t);

struct LayerOps {
  c10::TypedOperatorHandle<NormFn> rms_norm;
  c10::TypedOperatorHandle<RopeFn> qkv_rope;
  c10::TypedOperatorHandle<SiluMulFn> silu_mul;
  c10::TypedOperatorHandle<AttentionFn> attention;
};

const LayerOps& layer_ops() {  // found once, at the first call (the Python side has loaded their extensions)
  static const LayerOps ops{
      c10::Dispatcher::singleton().findSchemaOrThrow("dflash2_layer_ops::rms_norm", "").typed<NormFn>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("dflash2_layer_ops::qkv_rope", "").typed<RopeFn>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("dflash2_layer_ops::silu_mul", "").typed<SiluMulFn>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("dflash2_attention::attention_rows", "").typed<AttentionFn>()};
  return ops;
}

// One cache's attention (CachedAttention.attend + kernels/attention.invariant_attention): the new keys / values k, v
// [B, H_kv, T, Dh] written at [length, length + T) of keys / values [B, H_kv, capacity, Dh], then q [B, H, T, Dh]
// attended over slots [0, length + T) with the causal rule, or where mask [B or 1, T or 1, length + T] (bool, the
// Python layer's [B or 1, 1, T or 1, S] mask without its head axis, as invariant_attention passes it) says -> [B, H,
// T, Dh] in q's dtype.
at::Tensor cached_attention(const LayerOps& ops, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& keys, const at::Tensor& values, int64_t length,
                            const c10::optional<at::Tensor>& mask = c10::nullopt) {
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(), "gguf_layer: cache [B, H_kv, S, Dh]");
  const int64_t seq = q.size(2), end = length + seq;
  TORCH_CHECK(end <= keys.size(2), "KV cache overflow: ", end, " slots needed, capacity ", keys.size(2));
  keys.slice(2, length, end).copy_(k);
  values.slice(2, length, end).copy_(v);
  const at::Tensor k_all = keys.slice(2, 0, end), v_all = values.slice(2, 0, end);
  const double scale = 1.0 / std::sqrt(double(q.size(-1)));
  at::Tensor out;
  if (mask.has_value()) {  // an explicit mask (trees): CachedAttention.attend passes it with is_causal false
    out = ops.attention.call(q, k_all, v_all, mask, false, scale, 0);
  } else {
    // Query t sees slots up to S - T + t: the kernel's causal rule, what the Python layer's mask says
    // (models/decoder.causal_mask), so the same keys in the same order and the same bits, without making the mask
    // (~20 us per layer at 9 rows).
    out = ops.attention.call(q, k_all, v_all, c10::nullopt, seq > 1, scale, 0);
  }
  return out.scalar_type() != q.scalar_type() ? out.to(q.scalar_type()) : out;  // fp32 -> x's dtype
}

// The layer around its attention: attend(q, k, v) -> [B, H, T, Dh] gives the attention output of q, k, v
// [B, H(_kv), T, Dh] (one cache, or one per segment of the token axis).
template <class Attend>
at::Tensor layer_around(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const GgufLayer& layer,
                        const LayerOps& ops, Attend&& attend) {
  TORCH_CHECK(x.dim() == 3, "gguf_layer: x [B, T, D]");
  const int64_t batch = x.size(0), seq = x.size(1);
  const at::Tensor qkv = gguf_linear(ops.rms_norm.call(x, layer.attn_norm, layer.eps), layer.wqkv);
  auto [q, k, v] = ops.qkv_rope.call(qkv, cos, sin, layer.heads, layer.kv_heads);
  const at::Tensor out = attend(q, k, v);
  at::Tensor h = at::add(x, gguf_linear(out.transpose(1, 2).reshape({batch, seq, -1}), layer.wo));
  // feed-forward (decoder.FeedForward): down(silu(gate) * up)
  const at::Tensor gu = gguf_linear(ops.rms_norm.call(h, layer.ffn_norm, layer.eps), layer.gate_up);
  return at::add(h, gguf_linear(ops.silu_mul.call(gu, 0), layer.down));
}

// x [B, T, D]; cos / sin [B or 1, 1, T, Dh]; keys / values: this layer's cache [B, H_kv, capacity, Dh], slots
// [0, length) committed; mask: None (causal) or bool [B or 1, T or 1, length + T] -> x after the layer [B, T, D]
// (the new keys / values written at [length, length + T)).
at::Tensor gguf_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                      const at::Tensor& values, int64_t length, const c10::intrusive_ptr<GgufLayer>& layer,
                      const c10::optional<at::Tensor>& mask) {
  const LayerOps& ops = layer_ops();
  return layer_around(x, cos, sin, *layer, ops, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return cached_attention(ops, q, k, v, keys, values, length, mask);
  });
}

// Several sequences in one forward (models/decoder.SegmentedAttention): x [1, N, D] holds segment i's T_i = seq[i]
// new tokens after segment i - 1's; segment i attends to its own cache (keys[i] / values[i] [1, H_kv, capacity_i,
// Dh], lengths[i] committed), causally, as gguf_layer without a mask would for that segment alone. The linear layers
// read their weights once.
at::Tensor gguf_layer_segments(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               at::TensorList keys, at::TensorList values, at::IntArrayRef lengths,
                               at::IntArrayRef seq, const c10::intrusive_ptr<GgufLayer>& layer) {
  const LayerOps& ops = layer_ops();
  const size_t n = seq.size();
  TORCH_CHECK(keys.size() == n && values.size() == n && lengths.size() == n, "gguf_layer_segments: one cache, length "
              "and token count per segment");
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "gguf_layer_segments: x [1, N, D]");
  return layer_around(x, cos, sin, *layer, ops, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    at::Tensor out = at::empty_like(q);  // [1, H, N, Dh]
    int64_t start = 0;
    for (size_t i = 0; i < n; ++i) {
      const int64_t stop = start + seq[i];
      if (stop == start) continue;
      out.slice(2, start, stop).copy_(cached_attention(ops, q.slice(2, start, stop), k.slice(2, start, stop),
                                                       v.slice(2, start, stop), keys[i], values[i], lengths[i]));
      start = stop;
    }
    TORCH_CHECK(start == q.size(2), "gguf_layer_segments: segments of ", start, " tokens for ", q.size(2));
    return out;
  });
}

}  // namespace
