// Errors raised by deep_indexer's C++ side. pybind11 turns them into Python exceptions:
// DIError -> RuntimeError, DIValueError -> ValueError.
#pragma once
#include <stdexcept>
#include <string>

#ifndef FMT_HEADER_ONLY
#define FMT_HEADER_ONLY
#endif
#include <fmt/format.h>

namespace deep_indexer {

class DIError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class DIValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace deep_indexer

#define DI_CHECK(cond, ...)                                                          \
  do {                                                                               \
    if (!(cond)) throw ::deep_indexer::DIError(fmt::format(__VA_ARGS__));            \
  } while (0)

#define DI_CHECK_ARG(cond, ...)                                                      \
  do {                                                                               \
    if (!(cond)) throw ::deep_indexer::DIValueError(fmt::format(__VA_ARGS__));       \
  } while (0)
