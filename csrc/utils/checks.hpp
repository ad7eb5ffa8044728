// One small helper for validating tensors. Every failure raises ValueError naming the op, the
// argument, and the expected vs actual value. Shape/dtype/stride checks come before the device
// check, so they can be exercised with CPU tensors.
#pragma once
#include <ATen/Tensor.h>
#include <c10/core/ScalarType.h>

#include <initializer_list>
#include <string>

#include "exception.hpp"

namespace deep_indexer {

inline std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

class TensorCheck {
 public:
  // Any value < 0 in an expected shape matches any size.
  static constexpr int64_t kAny = -1;

  TensorCheck(const char* op, const at::Tensor& t, const char* name) : op_(op), t_(t), name_(name) {
    DI_CHECK_ARG(t.defined(), "{}: {} must be a tensor, got None", op_, name_);
  }

  TensorCheck& dtype(c10::ScalarType expected) {
    DI_CHECK_ARG(t_.scalar_type() == expected, "{}: {} must have dtype {}, got {}", op_, name_,
                 c10::toString(expected), c10::toString(t_.scalar_type()));
    return *this;
  }

  TensorCheck& dtype_in(std::initializer_list<c10::ScalarType> allowed) {
    std::string names;
    for (auto a : allowed) {
      if (t_.scalar_type() == a) return *this;
      names += (names.empty() ? "" : " or ") + std::string(c10::toString(a));
    }
    throw DIValueError(fmt::format("{}: {} must have dtype {}, got {}", op_, name_, names,
                                   c10::toString(t_.scalar_type())));
  }

  TensorCheck& ndim(int64_t expected) {
    DI_CHECK_ARG(t_.dim() == expected, "{}: {} must be {}-D, got shape {}", op_, name_, expected,
                 shape_str(t_.sizes()));
    return *this;
  }

  TensorCheck& shape(std::initializer_list<int64_t> expected) {
    bool ok = t_.dim() == static_cast<int64_t>(expected.size());
    std::string want = "[";
    int64_t i = 0;
    for (int64_t e : expected) {
      want += (i ? ", " : "") + (e < 0 ? std::string("*") : std::to_string(e));
      if (ok && e >= 0 && t_.size(i) != e) ok = false;
      ++i;
    }
    DI_CHECK_ARG(ok, "{}: {} must have shape {}], got {}", op_, name_, want, shape_str(t_.sizes()));
    return *this;
  }

  TensorCheck& contiguous() {
    DI_CHECK_ARG(t_.is_contiguous(), "{}: {} must be contiguous, got strides {} for shape {}", op_, name_,
                 shape_str(t_.strides()), shape_str(t_.sizes()));
    return *this;
  }

  // stride(-1) == 1 (rows may be padded).
  TensorCheck& unit_inner_stride() {
    DI_CHECK_ARG(t_.dim() == 0 || t_.size(-1) <= 1 || t_.stride(-1) == 1,
                 "{}: {} must have stride 1 in its last dimension, got strides {}", op_, name_,
                 shape_str(t_.strides()));
    return *this;
  }

  // Rows (dim 0) non-overlapping and ordered: stride(0) >= size(1) for a 2-D row-major view.
  TensorCheck& row_major_2d() {
    unit_inner_stride();
    DI_CHECK_ARG(t_.size(0) <= 1 || t_.stride(0) >= t_.size(1), "{}: {} rows overlap: stride(0) = {} < size(1) = {}",
                 op_, name_, t_.stride(0), t_.size(1));
    return *this;
  }

  // Base address aligned to `bytes` (TMA needs 16).
  TensorCheck& aligned(int64_t bytes) {
    DI_CHECK_ARG(reinterpret_cast<uintptr_t>(t_.data_ptr()) % bytes == 0,
                 "{}: {} must start at a {}-byte aligned address (got offset {} mod {}); pass a fresh or "
                 ".clone()d tensor",
                 op_, name_, bytes, reinterpret_cast<uintptr_t>(t_.data_ptr()) % bytes, bytes);
    return *this;
  }

  TensorCheck& cuda() {
    DI_CHECK_ARG(t_.device().is_cuda(), "{}: {} must be on a CUDA device, got {}", op_, name_, t_.device().str());
    return *this;
  }

  TensorCheck& on(const c10::Device& device) {
    DI_CHECK_ARG(t_.device() == device, "{}: {} must be on {} (like the other inputs), got {}", op_, name_,
                 device.str(), t_.device().str());
    return *this;
  }

 private:
  const char* op_;
  const at::Tensor& t_;
  const char* name_;
};

}  // namespace deep_indexer
