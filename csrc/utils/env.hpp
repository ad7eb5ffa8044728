// Environment switches read by the C++ side, named once (those read in Python: deep_indexer/_env.py);
// documented in docs/api.md (user-facing, or "Tuning and test switches").
#pragma once
#include <cstdlib>
#include <string>

namespace deep_indexer::env {

inline std::string get_str(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? std::string(v) : fallback;
}

inline int get_int(const char* name, int fallback = 0) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (end != v) ? static_cast<int>(x) : fallback;
}

// Every DI_* variable the C++ side reads is named here once; code reads them through these constants.
// User-facing switches are documented for users; tuning / test switches force one heuristic choice
// (heuristics_sm90.hpp) for A/B runs and tests, and are not meant for production settings.

// ---- user-facing: JIT, compiler and cache
constexpr const char* kCacheDir = "DI_JIT_CACHE_DIR";      // disk cache location (default ~/.cache/deep_indexer)
constexpr const char* kDebug = "DI_JIT_DEBUG";             // 1: log compiles, cache hits, loads, heuristics
constexpr const char* kPrintCommand = "DI_JIT_PRINT_COMPILER_COMMAND";  // 1: print each nvcc command line
constexpr const char* kPtxasVerbose = "DI_JIT_PTXAS_VERBOSE";  // 1: print ptxas resource usage of each compile
constexpr const char* kDumpSass = "DI_JIT_DUMP_SASS";      // 1: write kernel.sass next to the cubin (needs cuobjdump)
constexpr const char* kFailOnSpills = "DI_JIT_FAIL_ON_SPILLS";  // 1: a kernel with local-memory spills is an error
constexpr const char* kNvcc = "DI_NVCC";                   // path of nvcc (else $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, PATH)
constexpr const char* kNvccCcbin = "DI_NVCC_CCBIN";        // host compiler nvcc should use (-ccbin)
// extra nvcc flags (space-separated), part of the cache key; the device code knows two macros:
// -DDI_KERNEL_TRACE (per-CTA timelines of the decode and top-k kernels, read by tools/kernel_trace.py) and
// -DDI_TOPK_DEBUG (device checks of the top-k selection invariants, for tests)
constexpr const char* kExtraFlags = "DI_JIT_EXTRA_FLAGS";

// ---- user-facing: launches
constexpr const char* kPdl = "DI_PDL";                     // 0: no programmatic dependent launches

// ---- tuning / test: prefill logits (mqa_logits)
constexpr const char* kMqaMathWgs = "DI_MQA_MATH_WGS";        // 2 or 3: math warpgroups
constexpr const char* kMqaSplitRelu = "DI_MQA_SPLIT_RELU";    // 0 / 1: linear half of relu on the tensor cores off / on
constexpr const char* kMqaFusedClean = "DI_MQA_FUSED_CLEAN";  // 0 / 1: -inf fill by a separate kernel / in the kernel

// ---- tuning / test: decode logits (paged_mqa_logits)
constexpr const char* kPagedMathWgs = "DI_PAGED_MATH_WGS";      // 2..4: math warpgroups
constexpr const char* kPagedSplitRelu = "DI_PAGED_SPLIT_RELU";  // 0 / 1: split relu off / on (where the layout allows)
constexpr const char* kPagedKvStages = "DI_PAGED_KV_STAGES";    // KV ring depth cap (default 12)
constexpr const char* kPagedTileSplit = "DI_PAGED_TILE_SPLIT";  // 0 / 1: work dealt by the schedule's segments / by tiles (batch <= 256)

// ---- tuning / test: top-k
constexpr const char* kTopkCluster = "DI_TOPK_CLUSTER";    // 1, 2, 4, 8: CTAs per row of the buffered kernel (unsorted)
constexpr const char* kTopkWide = "DI_TOPK_WIDE";          // 0 / 1: buffered kernel's narrow / wide CTAs
constexpr const char* kTopkPacked = "DI_TOPK_PACKED";      // 0: buffered kernel's two-word survivors where one fits
constexpr const char* kTopkResident = "DI_TOPK_RESIDENT";  // 0 / 1: resident kernel never / wherever it fits
constexpr const char* kTopkResidentKeys = "DI_TOPK_RESIDENT_KEYS";        // resident keys per thread
constexpr const char* kTopkResidentThreads = "DI_TOPK_RESIDENT_THREADS";  // 256, 512, 1024: resident threads per CTA
constexpr const char* kTopkResidentCtasPerSm = "DI_TOPK_RESIDENT_CTAS_PER_SM";  // 2 / 1: resident form with 2 CTAs of 512 per SM wherever it fits / never

// ---- tuning / test: training kernels
constexpr const char* kTrainingTargetCluster = "DI_TRAINING_TARGET_CLUSTER";    // 1 / 2: target kernel's cluster size
constexpr const char* kTrainingDkSplits = "DI_TRAINING_DK_SPLITS";              // > 0: row ranges of the indexer dk kernel
constexpr const char* kTrainingPerHeadGroups = "DI_TRAINING_PER_HEAD_GROUPS";  // > 0: head groups of the per_head dk kernel

}  // namespace deep_indexer::env
