// The JIT compiler: turns a generated source (a tiny file that instantiates one kernel template)
// into an sm_90a cubin with nvcc, cached on disk.
//
// Cache key = sha256(generated source, every project header it includes (recursively), the nvcc
// flags, the nvcc version, the CUTLASS version header). Each entry is a folder
// <cache>/kernels/<name>-<key> holding kernel.cu, kernel.cubin, ptxas.log and meta.txt; it is
// written in a private temp folder and renamed into place, so any number of processes can share
// one cache. An entry whose cubin does not match its recorded hash is rebuilt.
#pragma once
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <future>
#include <string>
#include <vector>

namespace deep_indexer::jit {

// ptxas resource report of one kernel.
struct ResourceUsage {
  int registers = -1;
  int stack_frame = 0;
  int spill_stores = 0;
  int spill_loads = 0;
  int static_smem = 0;
  std::vector<std::string> warnings;  // ptxas warning lines (e.g. wgmma serialization)
  bool spills() const { return spill_stores > 0 || spill_loads > 0; }
};

struct CompiledKernel {
  std::string name;    // human-readable, e.g. "clean_logits<float,1>"
  std::string key;     // sha256 hex
  std::filesystem::path dir;
  std::string cubin;   // bytes
  std::string symbol;  // mangled entry name
  ResourceUsage usage;
  bool from_cache = false;
  double seconds = 0;  // compile (or cache load) time
};

struct CompilerConfig {
  std::filesystem::path include_dir;  // folder holding deep_indexer/*.cuh
  std::filesystem::path cutlass_include_dir;  // may be empty
};

class Compiler {
 public:
  static Compiler& instance();

  void configure(const CompilerConfig& config);
  CompilerConfig config() const;

  // Compiles `source` for `arch` (only "sm_90a"), or returns the cached cubin. Thread-safe: one
  // compile per key at a time in this process; other threads asking for it wait for its result.
  std::shared_ptr<const CompiledKernel> build(const std::string& name, const std::string& source,
                                              const std::string& arch = "sm_90a");

  std::filesystem::path cache_dir();  // resolved (with fallback), created
  std::string nvcc_path();
  std::string nvcc_version();
  std::vector<std::string> flags(const std::string& arch) const;
  // Key of a source without compiling it (exposed for tests).
  std::string cache_key(const std::string& source, const std::string& arch);

 private:
  Compiler() = default;
  std::shared_ptr<const CompiledKernel> build_uncached(const std::string& name, const std::string& source,
                                                       const std::string& arch, const std::string& key);
  std::string headers_digest(const std::string& source);

  mutable std::mutex mutex_;
  CompilerConfig config_;
  std::filesystem::path cache_dir_;
  std::string nvcc_path_, nvcc_version_;
  std::map<std::string, std::shared_future<std::shared_ptr<const CompiledKernel>>> in_flight_;
};

// Parses ptxas -v output (exposed for tests).
ResourceUsage parse_ptxas_log(const std::string& log);
// Entry-point symbol of a cubin (the single __global__ function it defines); throws if none.
std::string find_entry_symbol(const std::string& cubin);

}  // namespace deep_indexer::jit
