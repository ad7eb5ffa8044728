#include "fs.hpp"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "exception.hpp"

namespace deep_indexer::fs {

bool read_file(const stdfs::path& path, std::string* out) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  out->clear();
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out->append(buf, n);
  const bool ok = std::ferror(f) == 0;
  std::fclose(f);
  return ok;
}

void write_file(const stdfs::path& path, const std::string& data) {
  FILE* f = std::fopen(path.c_str(), "wb");
  DI_CHECK(f != nullptr, "deep_indexer: cannot write {}: {}", path.string(), std::strerror(errno));
  const size_t n = std::fwrite(data.data(), 1, data.size(), f);
  const bool ok = (n == data.size()) && std::fflush(f) == 0;
  std::fclose(f);
  DI_CHECK(ok, "deep_indexer: short write to {}", path.string());
}

stdfs::path make_temp_dir(const stdfs::path& parent, const std::string& prefix) {
  std::error_code ec;
  stdfs::create_directories(parent, ec);
  std::string templ = (parent / (prefix + "XXXXXX")).string();
  DI_CHECK(mkdtemp(templ.data()) != nullptr, "deep_indexer: cannot create a temporary folder in {}: {}",
           parent.string(), std::strerror(errno));
  return stdfs::path(templ);
}

// NOTES: POSIX nftw, not std::filesystem::remove_all: inside a process that loaded libtorch the
// latter can bind to libtorch's own exported copy, built against another libstdc++, and crash
// (seen with torch 2.11 + CUDA 13: SIGSEGV in remove_all).
void remove_all_quiet(const stdfs::path& path) {
  nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) -> int {
        ::remove(p);
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

bool is_writable_dir(const stdfs::path& dir) {
  std::error_code ec;
  stdfs::create_directories(dir, ec);
  if (!stdfs::is_directory(dir, ec)) return false;
  return access(dir.c_str(), W_OK | X_OK) == 0;
}

ProcessResult run_command(const std::string& command) {
  ProcessResult result;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    result.output = std::string("popen failed: ") + std::strerror(errno);
    return result;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) result.output.append(buf, n);
  const int status = pclose(pipe);
  result.exit_code = (status != -1 && WIFEXITED(status)) ? WEXITSTATUS(status) : -1;
  return result;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "'\\''";
    else out.push_back(c);
  }
  out.push_back('\'');
  return out;
}

}  // namespace deep_indexer::fs
