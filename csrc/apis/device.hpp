// Per-call device context of an op: the device of its inputs (checked to be SM90), its primary
// context made current, and PyTorch's current stream on that device.
#pragma once
#include <ATen/Tensor.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>

#include "../jit/runtime.hpp"
#include "../utils/exception.hpp"

namespace deep_indexer {

struct OpDevice {
  int device;
  CUstream stream;
  const jit::DeviceInfo* info;  // the device's own properties
  int num_sms;                  // the SMs the ops use: info->num_sms, or the set_num_sms cap when smaller
};

namespace detail {

// Process-wide SM cap (0: none), set by set_num_sms.
inline std::atomic<int>& num_sms_cap() {
  static std::atomic<int> cap{0};
  return cap;
}

}  // namespace detail

// The SM count the ops use on `device`: the device's, or the set_num_sms cap when smaller.
inline int effective_num_sms(const jit::DeviceInfo& info) {
  const int cap = detail::num_sms_cap().load(std::memory_order_relaxed);
  return cap > 0 && cap < info.num_sms ? cap : info.num_sms;
}

// Sets the process-wide cap on the SMs the ops use (the default num_sms of the decode metadata and
// the size of the persistent grids). 0 removes it. `device` >= 0 validates n against that device.
inline void set_num_sms(int64_t n, int device) {
  DI_CHECK_ARG(n >= 0 && n <= 65536, "deep_indexer.set_num_sms: num_sms must be in [1, 65536] (0 resets), got {}", n);
  if (device >= 0 && n > 0) {
    const int sms = jit::device_info(device).num_sms;
    DI_CHECK_ARG(n <= sms, "deep_indexer.set_num_sms: num_sms must be in [1, {}] (the SMs of cuda:{}), got {}", sms,
                 device, n);
  }
  detail::num_sms_cap().store(static_cast<int>(n), std::memory_order_relaxed);
}

// The SM count the ops use on `device` (< 0: the cap itself, 0 when none is set).
inline int get_num_sms(int device) {
  if (device < 0) return detail::num_sms_cap().load(std::memory_order_relaxed);
  return effective_num_sms(jit::device_info(device));
}

inline OpDevice op_device(const at::Tensor& t) {
  const int device = t.device().index();
  const jit::DeviceInfo& info = jit::require_sm90(device);
  jit::make_current(device);
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
  return {device, static_cast<CUstream>(stream.native_handle()), &info, effective_num_sms(info)};
}

}  // namespace deep_indexer
