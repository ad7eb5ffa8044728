#include "runtime.hpp"

#include <chrono>
#include <cstdio>
#include <unordered_map>

#include "../utils/env.hpp"

namespace deep_indexer::jit {

namespace {

struct DeviceSlot {
  std::once_flag once;
  DeviceInfo info;
};

std::array<DeviceSlot, kMaxDevices>& device_slots() {
  static std::array<DeviceSlot, kMaxDevices> slots;
  return slots;
}

}  // namespace

int device_count() {
  static const int count = [] {
    int n = 0;
    DI_CU_CHECK(driver::api().cuDeviceGetCount(&n));
    return n;
  }();
  return count;
}

const DeviceInfo& device_info(int device) {
  const auto& api = driver::api();
  const int count = device_count();
  DI_CHECK_ARG(device >= 0 && device < count && device < kMaxDevices,
               "deep_indexer: CUDA device {} does not exist ({} visible)", device, count);
  DeviceSlot& slot = device_slots()[device];
  std::call_once(slot.once, [&] {
    CUdevice dev;
    DI_CU_CHECK(api.cuDeviceGet(&dev, device));
    DeviceInfo& d = slot.info;
    auto attr = [&](CUdevice_attribute a) {
      int v = 0;
      DI_CU_CHECK(api.cuDeviceGetAttribute(&v, a, dev));
      return v;
    };
    d.num_sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    d.cc_major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    d.cc_minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    d.max_smem_per_block_optin = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    d.l2_bytes = attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
    DI_CU_CHECK(api.cuDevicePrimaryCtxRetain(&d.context, dev));
    d.device = device;
  });
  return slot.info;
}

const DeviceInfo& require_sm90(int device) {
  const DeviceInfo& d = device_info(device);
  DI_CHECK(d.cc_major == 9 && d.cc_minor == 0,
           "deep_indexer: cuda:{} has compute capability {}.{}; the kernels need an SM90 (Hopper: H100/H200/H800/H20) GPU",
           device, d.cc_major, d.cc_minor);
  return d;
}

void make_current(int device) {
  const DeviceInfo& d = device_info(device);
  CUcontext cur = nullptr;
  const auto& api = driver::api();
  DI_CU_CHECK(api.cuCtxGetCurrent(&cur));
  if (cur != d.context) DI_CU_CHECK(api.cuCtxSetCurrent(d.context));
}

bool is_capturing(CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  DI_CU_CHECK(driver::api().cuStreamIsCapturing(stream, &status));
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

Kernel::~Kernel() {
  // Modules are left loaded at exit: unloading from a static destructor can race the driver's own
  // teardown. Kernels are only destroyed at process exit (the map below owns them for the run).
}

CUfunction Kernel::function(int device, CUstream stream) {
  CUfunction f = functions_[device].load(std::memory_order_acquire);
  if (f != nullptr) return f;
  DI_CHECK(!is_capturing(stream),
           "deep_indexer: kernel {} is not loaded on cuda:{} and the stream is being captured into a CUDA graph. "
           "Run the op once with the same shapes/options before capturing (warm-up); "
           "deep_indexer.precompile() fills the disk cache ahead of time",
           compiled_->name, device);
  std::lock_guard<std::mutex> lock(mutex_);
  const auto& api = driver::api();
  make_current(device);
  f = functions_[device].load(std::memory_order_relaxed);
  if (f != nullptr) return f;
  const auto t0 = std::chrono::steady_clock::now();
  CUmodule module;
  DI_CU_CHECK(api.cuModuleLoadData(&module, compiled_->cubin.data()));
  DI_CU_CHECK(api.cuModuleGetFunction(&f, module, compiled_->symbol.c_str()));
  int static_smem = 0;
  DI_CU_CHECK(api.cuFuncGetAttribute(&static_smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f));
  DI_CU_CHECK(api.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     device_info(device).max_smem_per_block_optin - static_smem));
  modules_[device] = module;
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  functions_[device].store(f, std::memory_order_release);
  return f;
}

namespace {

struct KernelMap {
  std::mutex mutex;
  std::unordered_map<std::string, std::shared_ptr<Kernel>> kernels;
};

KernelMap& kernel_map() {
  static auto* map = new KernelMap();  // leaked on purpose: outlives every caller at exit
  return *map;
}

}  // namespace

std::shared_ptr<Kernel> get_kernel(const std::string& name, const std::string& source, CUstream stream) {
  KernelMap& map = kernel_map();
  // One entry per (source, DI_JIT_EXTRA_FLAGS): the flags change the binary.
  const std::string key = source + "\n// DI_JIT_EXTRA_FLAGS=" + env::get_str(env::kExtraFlags);
  {
    std::lock_guard<std::mutex> lock(map.mutex);
    auto it = map.kernels.find(key);
    if (it != map.kernels.end()) return it->second;
  }
  DI_CHECK(!is_capturing(stream),
           "deep_indexer: kernel {} is not compiled/loaded yet and the stream is being captured into a CUDA graph. "
           "Run the op once with the same shapes/options before capturing (warm-up); "
           "deep_indexer.precompile() fills the disk cache ahead of time",
           name);
  // Compile outside the map lock (the compiler de-duplicates concurrent builds of one key).
  auto kernel = std::make_shared<Kernel>(Compiler::instance().build(name, source));
  std::lock_guard<std::mutex> lock(map.mutex);
  return map.kernels.emplace(key, std::move(kernel)).first->second;
}

size_t num_loaded_kernels() {
  KernelMap& map = kernel_map();
  std::lock_guard<std::mutex> lock(map.mutex);
  return map.kernels.size();
}

}  // namespace deep_indexer::jit
