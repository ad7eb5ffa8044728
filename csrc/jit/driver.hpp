// The CUDA driver API, loaded from libcuda at run time: the extension links no CUDA library, so
// it builds and imports against a CPU-only torch, and fails with a clear error only when a kernel
// is actually needed on a machine without a driver.
#pragma once
#include <cuda.h>

#include <string>

#include "../utils/exception.hpp"

namespace deep_indexer::driver {

#define DI_DRIVER_FUNCTIONS(X)                                                            \
  X(cuInit) X(cuDriverGetVersion) X(cuGetErrorName) X(cuGetErrorString) X(cuDeviceGet)    \
  X(cuDeviceGetCount) X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxRetain)                 \
  X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuModuleLoadData) X(cuModuleUnload)             \
  X(cuModuleGetFunction) X(cuFuncSetAttribute) X(cuFuncGetAttribute) X(cuLaunchKernelEx)  \
  X(cuTensorMapEncodeTiled) X(cuStreamIsCapturing) X(cuOccupancyMaxActiveClusters)

struct Api {
#define DI_DECLARE_FN(name) decltype(&::name) name = nullptr;
  DI_DRIVER_FUNCTIONS(DI_DECLARE_FN)
#undef DI_DECLARE_FN
};

// Loads libcuda once (thread-safe) and calls cuInit; throws DIError if no driver is present.
const Api& api();

// True when libcuda can be loaded and initialised (no exception).
bool available(std::string* why = nullptr);

std::string error_string(CUresult res);

}  // namespace deep_indexer::driver

#define DI_CU_CHECK(expr)                                                                         \
  do {                                                                                            \
    const CUresult _res = (expr);                                                                 \
    if (_res != CUDA_SUCCESS)                                                                     \
      throw ::deep_indexer::DIError(fmt::format("CUDA driver error {} in {} ({}:{})",             \
                                                ::deep_indexer::driver::error_string(_res), #expr, \
                                                __FILE__, __LINE__));                             \
  } while (0)
