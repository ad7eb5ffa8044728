// Environment switches (all documented in README.md, "Environment switches").
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

// Names of the switches, in one place.
constexpr const char* kCacheDir = "DI_JIT_CACHE_DIR";      // disk cache location (default ~/.cache/deep_indexer)
constexpr const char* kDebug = "DI_JIT_DEBUG";             // 1: log compiles, cache hits, loads, heuristics
constexpr const char* kPrintCommand = "DI_JIT_PRINT_COMPILER_COMMAND";  // 1: print each nvcc command line
constexpr const char* kPtxasVerbose = "DI_JIT_PTXAS_VERBOSE";  // 1: print ptxas resource usage of each compile
constexpr const char* kDumpSass = "DI_JIT_DUMP_SASS";      // 1: write kernel.sass next to the cubin (needs cuobjdump)
constexpr const char* kFailOnSpills = "DI_JIT_FAIL_ON_SPILLS";  // 1: a kernel with local-memory spills is an error
constexpr const char* kNvcc = "DI_NVCC";                   // path of nvcc (else $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, PATH)
constexpr const char* kNvccCcbin = "DI_NVCC_CCBIN";        // host compiler nvcc should use (-ccbin)
constexpr const char* kPdl = "DI_PDL";                     // 0: no programmatic dependent launches
constexpr const char* kExtraFlags = "DI_JIT_EXTRA_FLAGS";  // extra nvcc flags (space-separated), part of the cache key
constexpr const char* kCutlassInclude = "DI_CUTLASS_INCLUDE";  // override of the CUTLASS/CuTe include folder

}  // namespace deep_indexer::env
