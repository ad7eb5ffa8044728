// Host side of the decode kernels: the schedule (include/deep_indexer/logits/paged_mqa_metadata.cuh) and
// the paged logits (include/deep_indexer/logits/paged_mqa_logits.cuh).
#pragma once
#include "../jit/kernel_runtime.hpp"
#include "../jit/tma.hpp"
#include "heuristics_sm90.hpp"
#include "mqa_logits.hpp"

namespace deep_indexer {

struct PagedMqaMetadataRuntime : jit::KernelRuntime<PagedMqaMetadataRuntime> {
  struct Params {
    int next_n;  // row width of a 2-D context_lens (1 for [B])
    bool small;  // the single-chunk variant (batch <= kPagedMqaMetadataSmallBatch)
    int threads() const { return small ? kPagedMqaMetadataSmallThreads : kPagedMqaMetadataThreads; }
  };
  static const char* kernel_name() { return "paged_mqa_logits_metadata"; }
  static const char* header() { return "deep_indexer/logits/paged_mqa_metadata.cuh"; }
  static std::string name(const Params& p) {
    return fmt::format("paged_mqa_metadata<next_n={},{}>", p.next_n, p.small ? "small" : "any");
  }
  static std::string instantiation(const Params& p) {
    return fmt::format("&deep_indexer::paged_mqa_metadata_kernel<{}, {}, {}>", p.next_n, p.threads(),
                       p.small ? "false" : "true");
  }
  static unsigned smem_bytes(const Params&) { return 0; }

  static void launch(const Params& p, const int* context_lens, int batch_size, int num_sms, int* schedule, int device,
                     CUstream stream) {
    DI_CHECK(!p.small || batch_size <= kPagedMqaMetadataSmallBatch, "metadata: batch {} too large for the small variant",
             batch_size);
    const CUfunction f = function(p, device, stream);
    jit::LaunchConfig cfg;
    cfg.grid = 1;
    cfg.block = static_cast<unsigned>(p.threads());
    cfg.pdl = true;
    jit::launch(f, cfg, stream, context_lens, batch_size, num_sms, schedule);
  }
};

struct PagedMqaLogitsRuntime : jit::KernelRuntime<PagedMqaLogitsRuntime> {
  struct Params {
    int next_n, num_heads, head_dim, block_kv, elem_bytes;
    bool context_lens_2d;
    bool varlen = false;  // indices given (next_n == 1): block-table row = first row of the run
    bool q_fp4 = false;   // q: FP4 codes [rows, D / 2] + int32 scale words [rows]
    bool kv_fp4 = false;  // the paged cache: D / 2 code bytes + an int32 scale word per key
    PagedMqaLogitsLayout layout() const {
      return sm90::paged_mqa_logits_layout(next_n, num_heads, head_dim, block_kv, elem_bytes, q_fp4, kv_fp4);
    }
  };

  static const char* kernel_name() { return "paged_mqa_logits"; }
  static const char* header() { return "deep_indexer/logits/paged_mqa_logits.cuh"; }
  static std::string name(const Params& p) {
    const PagedMqaLogitsLayout l = p.layout();
    return fmt::format("paged_mqa_logits<next_n={},H={},D={},block={},stages={},wgs={},ctx{}d,{}{}{}{}{}>", p.next_n,
                       p.num_heads, p.head_dim, p.block_kv, l.num_kv_stages, l.num_math_wgs(),
                       p.context_lens_2d ? 2 : 1, p.elem_bytes == 4 ? "float32" : "bfloat16",
                       l.split_relu ? ",split_relu" : "", p.varlen ? ",varlen" : "", p.q_fp4 ? ",q_fp4" : "",
                       p.kv_fp4 ? ",kv_fp4" : "");
  }
  static std::string instantiation(const Params& p) {
    const PagedMqaLogitsLayout l = p.layout();
    // (the trailing flags are spelled out only when set: the FP8 instantiations keep their names)
    const std::string flags = p.q_fp4 || p.kv_fp4 ? fmt::format(", {}, {}, {}", p.varlen, p.q_fp4, p.kv_fp4)
                                                  : std::string(p.varlen ? ", true" : "");
    return fmt::format("&deep_indexer::paged_mqa_logits_kernel<{}, {}, {}, {}, {}, {}, {}, {}, {}{}>", p.next_n,
                       p.num_heads, p.head_dim, p.block_kv, l.num_kv_stages, l.num_math_wgs(),
                       p.context_lens_2d ? "true" : "false", out_type_name(p.elem_bytes), l.split_relu, flags);
  }
  static unsigned smem_bytes(const Params& p) { return p.layout().smem_bytes(); }

  struct Args {
    Params params;
    const void* q;  // [B*next_n*H, D] fp8, or q_fp4: [B*next_n*H, D / 2] codes
    const int* q_sf = nullptr;  // q_fp4: int32 [B*next_n*H] scale words
    const uint8_t* kv_cache;
    int64_t num_blocks, block_stride_bytes;
    const float* weights;
    int64_t weights_stride;
    const int* context_lens;
    const int* block_table;
    int64_t block_table_stride;
    int block_table_cols;
    const int* schedule;
    int num_sms;
    void* logits;
    int64_t logits_stride;
    int batch_size, max_context_len;
    const int* indices = nullptr;  // varlen: int32 [batch_size] request ids
  };

  static void launch(const Args& a, int device, CUstream stream) {
    if (a.batch_size == 0 || a.max_context_len == 0) return;
    const Params& p = a.params;
    DI_CHECK(!p.varlen || (p.next_n == 1 && a.indices != nullptr), "paged_mqa_logits: varlen needs next_n = 1 and indices");
    const PagedMqaLogitsLayout l = p.layout();
    const CUfunction f = function(p, device, stream);
    const auto swz = jit::swizzle_for_row_bytes(l.swizzle_bytes());
    const auto u8 = CU_TENSOR_MAP_DATA_TYPE_UINT8;
    const uint64_t d = static_cast<uint64_t>(p.head_dim);
    // FP4 operands are bulk-copied by the kernel: their tensor maps stay unused (zero).
    CUtensorMap tmap_q{}, tmap_kv{};
    if (!l.q_staged())
      tmap_q = jit::make_kmajor_fp8_map(a.q, static_cast<uint64_t>(a.batch_size) * p.next_n * p.num_heads,
                                        l.swizzle_bytes(), l.q_box_rows(), "q");
    if (!p.kv_fp4)
      tmap_kv = jit::make_tensor_map<3>(
          a.kv_cache, u8, {d, static_cast<uint64_t>(p.block_kv), static_cast<uint64_t>(a.num_blocks)},
          {d, static_cast<uint64_t>(a.block_stride_bytes)},
          {static_cast<uint32_t>(d), static_cast<uint32_t>(p.block_kv), 1u}, swz, "kv_cache");
    jit::LaunchConfig cfg;
    cfg.grid = static_cast<unsigned>(a.num_sms);
    cfg.block = l.num_threads();
    cfg.smem = l.smem_bytes();
    cfg.pdl = true;
    jit::launch(f, cfg, stream, tmap_q, tmap_kv, a.kv_cache, a.block_stride_bytes, a.weights, a.weights_stride,
                a.context_lens, a.block_table, a.block_table_stride, a.block_table_cols, a.schedule, a.logits, a.logits_stride,
                a.batch_size, a.max_context_len, a.indices, static_cast<const uint8_t*>(a.q), a.q_sf,
                static_cast<int>(sm90::paged_mqa_tile_split(a.batch_size, a.max_context_len, a.num_sms)),
                static_cast<int>(sm90::paged_mqa_early_trigger(a.num_sms, jit::device_info(device).num_sms)));
  }
};

}  // namespace deep_indexer
