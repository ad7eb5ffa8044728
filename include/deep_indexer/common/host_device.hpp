// DI_HOST_DEVICE: marks the constexpr layout functions that host code (g++, no CUDA headers) and
// kernels both call.
#pragma once

#ifdef __CUDACC__
#define DI_HOST_DEVICE __host__ __device__
#else
#define DI_HOST_DEVICE
#endif
