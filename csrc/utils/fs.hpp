// Small file-system and process helpers for the JIT (no iostreams: locale-dependent streams crashed on one toolchain).
#pragma once
#include <filesystem>
#include <string>

namespace deep_indexer::fs {

namespace stdfs = std::filesystem;

// Whole-file read; returns false when the file cannot be opened.
bool read_file(const stdfs::path& path, std::string* out);
// Whole-file write (truncates); throws DIError on failure.
void write_file(const stdfs::path& path, const std::string& data);
// A fresh, uniquely named directory under `parent` (created); throws DIError on failure.
stdfs::path make_temp_dir(const stdfs::path& parent, const std::string& prefix);
// Best-effort recursive removal; never throws.
void remove_all_quiet(const stdfs::path& path);
// True when `dir` exists (or can be created) and a file can be created in it.
bool is_writable_dir(const stdfs::path& dir);

struct ProcessResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr, interleaved
};
// Runs `command` through /bin/sh, capturing stdout + stderr.
ProcessResult run_command(const std::string& command);
// Quotes a string for /bin/sh.
std::string shell_quote(const std::string& s);

}  // namespace deep_indexer::fs
