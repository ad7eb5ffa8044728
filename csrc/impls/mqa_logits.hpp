// Host side of the prefill kernel (include/deep_indexer/logits/mqa_logits.cuh).
#pragma once
#include "../jit/kernel_runtime.hpp"
#include "../jit/tma.hpp"
#include "heuristics_sm90.hpp"

namespace deep_indexer {

inline const char* out_type_name(int elem_bytes) { return elem_bytes == 4 ? "float" : "__nv_bfloat16"; }

struct MqaLogitsRuntime : jit::KernelRuntime<MqaLogitsRuntime> {
  struct Params {
    int num_heads, head_dim, elem_bytes;
    int in_bytes = 1;  // 1: fp8 q / k with k scales; 2: bf16 (the training forward)
    MqaLogitsLayout layout() const { return sm90::mqa_logits_layout(num_heads, head_dim, elem_bytes, in_bytes); }
  };

  static const char* kernel_name() { return "mqa_logits"; }
  static const char* header() { return "deep_indexer/logits/mqa_logits.cuh"; }
  static std::string name(const Params& p) {
    const MqaLogitsLayout l = p.layout();
    return fmt::format("mqa_logits<H={},D={},wgs={},stages={},{}{}{}>", p.num_heads, p.head_dim, l.num_math_wgs(),
                       l.num_kv_stages, p.elem_bytes == 4 ? "float32" : "bfloat16", l.split_relu ? ",split_relu" : "",
                       p.in_bytes == 2 ? ",bf16_in" : "");
  }
  static std::string instantiation(const Params& p) {
    const MqaLogitsLayout l = p.layout();
    return fmt::format("&deep_indexer::mqa_logits_kernel_wgs<{}, {}, {}, {}, {}, {}, {}>", p.num_heads, p.head_dim,
                       l.num_kv_stages, out_type_name(p.elem_bytes), l.num_math_wgs(), l.split_relu, p.in_bytes);
  }
  static unsigned smem_bytes(const Params& p) { return p.layout().smem_bytes(); }

  struct Args {
    Params params;
    const void* q;  // [S*H, D] fp8 (bf16 when params.in_bytes == 2)
    const void* k;  // [SKV, D] fp8 (bf16)
    const float* k_scale;  // [SKV]; unused for bf16
    const void* weights;  // [S, H] float32, or bfloat16 when weights_bf16
    int64_t weights_stride;
    bool weights_bf16;
    const int *ks, *ke;
    void* logits;
    int64_t logits_stride;
    int seq_len, seq_len_kv;
    int max_seqlen_k;  // 0: [S, SKV] logits; > 0: compressed [S, max_seqlen_k] (see mqa_logits.cuh)
    bool clean;  // warps 1..3 of the producer warpgroup write -inf outside each row's range
  };

  static void launch(const Args& a, int device, int num_sms, CUstream stream) {
    if (a.seq_len == 0) return;
    const Params& p = a.params;
    const MqaLogitsLayout l = p.layout();
    const CUfunction f = function(p, device, stream);
    const uint64_t q_rows = static_cast<uint64_t>(a.seq_len) * p.num_heads, k_rows = static_cast<uint64_t>(a.seq_len_kv);
    const bool bf16 = p.in_bytes == 2;
    const CUtensorMap tmap_q =
        bf16 ? jit::make_bf16_rows_map(a.q, q_rows, static_cast<uint64_t>(p.head_dim), l.q_box_rows(), "q")
             : jit::make_kmajor_fp8_map(a.q, q_rows, l.swizzle_bytes(), l.q_box_rows(), "q");
    const CUtensorMap tmap_k =
        bf16 ? jit::make_bf16_rows_map(a.k, k_rows, static_cast<uint64_t>(p.head_dim), l.k_box_rows(), "k")
             : jit::make_kmajor_fp8_map(a.k, k_rows, l.swizzle_bytes(), l.k_box_rows(), "k");
    jit::LaunchConfig cfg;
    cfg.grid = sm90::mqa_logits_grid(l, a.seq_len, num_sms);
    cfg.block = l.num_threads();
    cfg.smem = l.smem_bytes();
    cfg.pdl = true;
    jit::launch(f, cfg, stream, tmap_q, tmap_k, a.k_scale, a.weights, a.weights_stride,
                static_cast<int>(a.weights_bf16), a.ks, a.ke, a.logits, a.logits_stride, a.seq_len, a.seq_len_kv,
                a.max_seqlen_k, static_cast<int>(a.clean));
  }
};

}  // namespace deep_indexer
