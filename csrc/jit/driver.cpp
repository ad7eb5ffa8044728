#include "driver.hpp"

#include <dlfcn.h>

#include <mutex>

namespace deep_indexer::driver {

namespace {

#define DI_STR2(x) #x
#define DI_STR(x) DI_STR2(x)

struct Loaded {
  Api api;
  std::string error;  // empty when usable
};

Loaded load() {
  Loaded out;
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) handle = dlopen("libcuda.so", RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    out.error = "the CUDA driver (libcuda.so.1) could not be loaded: this machine has no NVIDIA driver";
    return out;
  }
  // cuda.h maps some names to versioned symbols (e.g. cuCtxGetCurrent stays, cuModuleGetFunction
  // stays, cuDevicePrimaryCtxRetain stays); DI_STR expands those macros before stringifying.
#define DI_LOAD_FN(name)                                                                   \
  out.api.name = reinterpret_cast<decltype(out.api.name)>(dlsym(handle, DI_STR(name)));    \
  if (out.api.name == nullptr) {                                                           \
    out.error = std::string("libcuda has no symbol ") + DI_STR(name) + ": the driver is too old"; \
    return out;                                                                            \
  }
  DI_DRIVER_FUNCTIONS(DI_LOAD_FN)
#undef DI_LOAD_FN
  const CUresult res = out.api.cuInit(0);
  if (res != CUDA_SUCCESS) {
    const char* name = nullptr;
    out.api.cuGetErrorName(res, &name);
    out.error = std::string("cuInit failed (") + (name ? name : "?") + "): no usable GPU";
  }
  return out;
}

const Loaded& loaded() {
  static const Loaded instance = load();  // C++11 magic statics: thread-safe once
  return instance;
}

}  // namespace

const Api& api() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw DIError("deep_indexer: " + l.error);
  return l.api;
}

bool available(std::string* why) {
  const Loaded& l = loaded();
  if (why != nullptr) *why = l.error;
  return l.error.empty();
}

std::string error_string(CUresult res) {
  const Loaded& l = loaded();
  const char* name = nullptr;
  const char* desc = nullptr;
  if (l.api.cuGetErrorName != nullptr) l.api.cuGetErrorName(res, &name);
  if (l.api.cuGetErrorString != nullptr) l.api.cuGetErrorString(res, &desc);
  return fmt::format("{} ({})", name ? name : std::to_string(static_cast<int>(res)), desc ? desc : "");
}

}  // namespace deep_indexer::driver
