// Loaded kernels and launches. A Kernel wraps one compiled cubin and its per-device CUfunction;
// kernels live in a process-wide map keyed by their generated source, so the hot path of an op
// is: generate source (a short string), one map lookup, one atomic load, cuLaunchKernelEx.
#pragma once
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "compiler.hpp"
#include "driver.hpp"
#include "../utils/env.hpp"

namespace deep_indexer::jit {

constexpr int kMaxDevices = 64;

struct DeviceInfo {
  int device = -1;
  int num_sms = 0;
  int cc_major = 0, cc_minor = 0;
  int max_smem_per_block_optin = 0;
  int l2_bytes = 0;
  CUcontext context = nullptr;  // the primary context (the one PyTorch uses)
};

// Cached per device, thread-safe. Throws DIError for a bad index.
const DeviceInfo& device_info(int device);
// Throws a clear DIError unless `device` is an SM90 (Hopper) GPU.
const DeviceInfo& require_sm90(int device);
// Makes the device's primary context current on this thread (cheap when it already is).
void make_current(int device);

struct LaunchConfig {
  unsigned grid = 1, block = 128;
  unsigned smem = 0;
  unsigned cluster = 1;
  // Programmatic stream serialization (PDL): the kernel may start while the previous kernel of the
  // stream finishes; only for kernels that call ptx::grid_dependency_wait() before any global
  // access. DI_PDL=0 turns it off for every launch.
  bool pdl = false;
};

class Kernel {
 public:
  explicit Kernel(std::shared_ptr<const CompiledKernel> compiled) : compiled_(std::move(compiled)) {}
  ~Kernel();
  Kernel(const Kernel&) = delete;
  Kernel& operator=(const Kernel&) = delete;

  const CompiledKernel& compiled() const { return *compiled_; }
  // The CUfunction in `device`'s primary context, loading the module on first use (its dynamic
  // shared-memory limit is raised to the device maximum then). If `stream` is being captured and
  // the module is not loaded yet, throws (no module load inside a CUDA-graph capture).
  CUfunction function(int device, CUstream stream);
  // Seconds the last module load took (host overhead report).
  double load_seconds() const { return load_seconds_; }

 private:
  std::shared_ptr<const CompiledKernel> compiled_;
  std::mutex mutex_;
  std::array<std::atomic<CUfunction>, kMaxDevices> functions_{};
  std::array<CUmodule, kMaxDevices> modules_{};
  double load_seconds_ = 0;
};

// True when `stream` is being captured into a CUDA graph.
bool is_capturing(CUstream stream);

// The process-wide kernel for `source` (compiled or fetched from the disk cache on first use).
// While `stream` is being captured, a kernel that is not in memory yet is an error, never a compile.
std::shared_ptr<Kernel> get_kernel(const std::string& name, const std::string& source, CUstream stream);

// Number of kernels in the in-memory map (for tests/diagnostics).
size_t num_loaded_kernels();

// The driver's form of a LaunchConfig (its cluster and PDL attributes). Not copyable: config.attrs
// points into the object.
struct DriverLaunchConfig {
  CUlaunchAttribute attrs[2];
  CUlaunchConfig config{};
  DriverLaunchConfig(const LaunchConfig& cfg, CUstream stream) {
    config.gridDimX = cfg.grid;
    config.gridDimY = config.gridDimZ = 1;
    config.blockDimX = cfg.block;
    config.blockDimY = config.blockDimZ = 1;
    config.sharedMemBytes = cfg.smem;
    config.hStream = stream;
    config.attrs = attrs;
    config.numAttrs = 0;
    if (cfg.cluster > 1) {
      attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
      attrs[0].value.clusterDim.x = cfg.cluster;
      attrs[0].value.clusterDim.y = attrs[0].value.clusterDim.z = 1;
      config.numAttrs = 1;
    }
    if (cfg.pdl && env::get_int(env::kPdl, 1) != 0) {
      attrs[config.numAttrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[config.numAttrs].value.programmaticStreamSerializationAllowed = 1;
      ++config.numAttrs;
    }
  }
  DriverLaunchConfig(const DriverLaunchConfig&) = delete;
  DriverLaunchConfig& operator=(const DriverLaunchConfig&) = delete;
};

template <typename... Args>
void launch(CUfunction func, const LaunchConfig& cfg, CUstream stream, const Args&... args) {
  void* params[] = {const_cast<void*>(static_cast<const void*>(&args))...};
  const DriverLaunchConfig l(cfg, stream);
  DI_CU_CHECK(driver::api().cuLaunchKernelEx(&l.config, func, params, nullptr));
}

// Clusters of cfg.cluster CTAs of `func` (launched as cfg) that the device runs at once
// (cuOccupancyMaxActiveClusters).
inline int max_active_clusters(CUfunction func, const LaunchConfig& cfg, CUstream stream) {
  const DriverLaunchConfig l(cfg, stream);
  int n = 0;
  DI_CU_CHECK(driver::api().cuOccupancyMaxActiveClusters(&n, func, &l.config));
  return n;
}

}  // namespace deep_indexer::jit
