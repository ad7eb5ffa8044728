// Per-call device context of an op: the device of its inputs (checked to be SM90), its primary
// context made current, and PyTorch's current stream on that device.
#pragma once
#include <ATen/Tensor.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "../jit/runtime.hpp"

namespace deep_indexer {

struct OpDevice {
  int device;
  CUstream stream;
  const jit::DeviceInfo* info;
};

inline OpDevice op_device(const at::Tensor& t) {
  const int device = t.device().index();
  const jit::DeviceInfo& info = jit::require_sm90(device);
  jit::make_current(device);
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
  return {device, static_cast<CUstream>(stream.native_handle()), &info};
}

}  // namespace deep_indexer
