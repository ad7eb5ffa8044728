#include "compiler.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>

#include "../utils/env.hpp"
#include "../utils/exception.hpp"
#include "../utils/fs.hpp"
#include "../utils/sha256.hpp"

namespace deep_indexer::jit {

namespace stdfs = std::filesystem;

namespace {

bool debug() { return env::get_int(env::kDebug) != 0; }

// Number written just before `token` in `text` (after `from`), or -1.
int number_before(const std::string& text, const std::string& token, size_t from, size_t to) {
  const size_t pos = text.find(token, from);
  if (pos == std::string::npos || pos >= to) return -1;
  size_t end = pos;
  while (end > from && text[end - 1] == ' ') --end;
  size_t begin = end;
  while (begin > from && std::isdigit(static_cast<unsigned char>(text[begin - 1]))) --begin;
  if (begin == end) return -1;
  return std::atoi(text.substr(begin, end - begin).c_str());
}

// Project headers included by `text` (quoted or <deep_indexer/...>), resolved to files.
std::vector<stdfs::path> includes_of(const std::string& text, const stdfs::path& self_dir,
                                     const stdfs::path& include_dir) {
  std::vector<stdfs::path> out;
  size_t pos = 0;
  while ((pos = text.find("#include", pos)) != std::string::npos) {
    const size_t eol = std::min(text.find('\n', pos), text.size());
    const std::string line = text.substr(pos, eol - pos);
    pos = eol;
    const size_t open = line.find_first_of("<\"");
    if (open == std::string::npos) continue;
    const char close_ch = line[open] == '<' ? '>' : '"';
    const size_t close = line.find(close_ch, open + 1);
    if (close == std::string::npos) continue;
    const std::string target = line.substr(open + 1, close - open - 1);
    std::error_code ec;
    for (const stdfs::path& base : {self_dir, include_dir}) {
      if (base.empty()) continue;
      const stdfs::path candidate = base / target;
      if (stdfs::is_regular_file(candidate, ec)) {
        out.push_back(stdfs::weakly_canonical(candidate, ec));
        break;
      }
    }
  }
  return out;
}

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

constexpr const char* kMetaFile = "meta.txt";
constexpr const char* kCubinFile = "kernel.cubin";

std::string meta_value(const std::string& meta, const std::string& field) {
  const std::string prefix = field + "=";
  size_t pos = 0;
  while (pos < meta.size()) {
    const size_t eol = std::min(meta.find('\n', pos), meta.size());
    if (meta.compare(pos, prefix.size(), prefix) == 0) return meta.substr(pos + prefix.size(), eol - pos - prefix.size());
    pos = eol + 1;
  }
  return "";
}

// Loads a finished cache entry; returns nullptr when it is missing or corrupt.
std::shared_ptr<CompiledKernel> load_entry(const stdfs::path& dir) {
  std::string meta, cubin, log;
  if (!fs::read_file(dir / kMetaFile, &meta) || !fs::read_file(dir / kCubinFile, &cubin)) return nullptr;
  if (cubin.size() < 4 || cubin.compare(0, 4, "\x7f" "ELF") != 0) return nullptr;
  if (meta_value(meta, "cubin_sha256") != sha256_hex(cubin)) return nullptr;
  auto k = std::make_shared<CompiledKernel>();
  k->dir = dir;
  k->cubin = std::move(cubin);
  k->symbol = meta_value(meta, "symbol");
  if (k->symbol.empty()) return nullptr;
  fs::read_file(dir / "ptxas.log", &log);
  k->usage = parse_ptxas_log(log);
  return k;
}

}  // namespace

ResourceUsage parse_ptxas_log(const std::string& log) {
  ResourceUsage u;
  size_t pos = 0;
  while (pos < log.size()) {
    const size_t eol = std::min(log.find('\n', pos), log.size());
    const std::string line = log.substr(pos, eol - pos);
    if (line.find("arning") != std::string::npos) u.warnings.push_back(line);
    int v;
    if ((v = number_before(log, " registers", pos, eol)) >= 0) u.registers = v;
    if ((v = number_before(log, " bytes smem", pos, eol)) >= 0) u.static_smem = v;
    if ((v = number_before(log, " bytes stack frame", pos, eol)) >= 0) u.stack_frame = v;
    if ((v = number_before(log, " bytes spill stores", pos, eol)) >= 0) u.spill_stores = v;
    if ((v = number_before(log, " bytes spill loads", pos, eol)) >= 0) u.spill_loads = v;
    pos = eol + 1;
  }
  return u;
}

std::string find_entry_symbol(const std::string& elf) {
  auto rd = [&](size_t off, size_t n) -> uint64_t {
    DI_CHECK(off + n <= elf.size(), "deep_indexer: truncated cubin");
    uint64_t v = 0;
    std::memcpy(&v, elf.data() + off, n);
    return v;
  };
  DI_CHECK(elf.size() > 64 && elf.compare(0, 4, "\x7f" "ELF") == 0 && elf[4] == 2, "deep_indexer: not an ELF64 cubin");
  const uint64_t shoff = rd(0x28, 8);
  const uint64_t shentsize = rd(0x3A, 2), shnum = rd(0x3C, 2);
  std::string fallback;
  for (uint64_t i = 0; i < shnum; ++i) {
    const uint64_t sh = shoff + i * shentsize;
    if (rd(sh + 4, 4) != 2 /*SHT_SYMTAB*/) continue;
    const uint64_t sym_off = rd(sh + 0x18, 8), sym_size = rd(sh + 0x20, 8), link = rd(sh + 0x28, 4);
    const uint64_t entsize = rd(sh + 0x38, 8);
    const uint64_t str_off = rd(shoff + link * shentsize + 0x18, 8);
    for (uint64_t s = 0; entsize != 0 && s < sym_size / entsize; ++s) {
      const uint64_t sym = sym_off + s * entsize;
      const uint64_t name_off = rd(sym, 4);
      const uint8_t info = static_cast<uint8_t>(rd(sym + 4, 1)), other = static_cast<uint8_t>(rd(sym + 5, 1));
      if ((info & 0xF) != 2 /*STT_FUNC*/ || (info >> 4) == 0 /*local*/) continue;
      const std::string name(elf.c_str() + str_off + name_off);
      if (other & 0x10 /*STO_CUDA_ENTRY*/) return name;
      if (fallback.empty()) fallback = name;
    }
  }
  DI_CHECK(!fallback.empty(), "deep_indexer: the cubin defines no kernel");
  return fallback;
}

Compiler& Compiler::instance() {
  static Compiler compiler;
  return compiler;
}

void Compiler::configure(const CompilerConfig& config) {
  std::lock_guard<std::mutex> lock(mutex_);
  config_ = config;
}

CompilerConfig Compiler::config() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return config_;
}

stdfs::path Compiler::cache_dir() {
  const std::string requested = env::get_str(env::kCacheDir);
  const char* home = std::getenv("HOME");
  const stdfs::path wanted = !requested.empty()
                                 ? stdfs::path(requested)
                                 : stdfs::path(home ? home : "/tmp") / ".cache" / "deep_indexer";
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cache_dir_.empty() && cache_dir_.parent_path() == wanted) return cache_dir_;
  stdfs::path dir = wanted;
  if (!fs::is_writable_dir(dir)) {
    const stdfs::path fallback = stdfs::temp_directory_path() / ("deep_indexer-" + std::to_string(getuid()));
    std::fprintf(stderr,
                 "deep_indexer: warning: the JIT cache folder %s cannot be written; using %s instead "
                 "(set %s to a writable folder)\n",
                 wanted.c_str(), fallback.c_str(), env::kCacheDir);
    DI_CHECK(fs::is_writable_dir(fallback), "deep_indexer: neither {} nor {} can be written: set {}",
             wanted.string(), fallback.string(), env::kCacheDir);
    dir = fallback;
  }
  cache_dir_ = dir / "kernels";
  std::error_code ec;
  stdfs::create_directories(cache_dir_, ec);
  return cache_dir_;
}

std::string Compiler::nvcc_path() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!nvcc_path_.empty()) return nvcc_path_;
  }
  std::vector<std::string> candidates;
  const std::string explicit_path = env::get_str(env::kNvcc);
  if (!explicit_path.empty()) {
    DI_CHECK(access(explicit_path.c_str(), X_OK) == 0, "deep_indexer: {}={} is not an executable nvcc",
             env::kNvcc, explicit_path);
    candidates.push_back(explicit_path);
  }
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    const std::string home = env::get_str(var);
    if (!home.empty()) candidates.push_back(home + "/bin/nvcc");
  }
  candidates.push_back("/usr/local/cuda/bin/nvcc");
  const std::string path_env = env::get_str("PATH");
  for (size_t b = 0; b <= path_env.size();) {
    const size_t e = std::min(path_env.find(':', b), path_env.size());
    if (e > b) candidates.push_back(path_env.substr(b, e - b) + "/nvcc");
    b = e + 1;
  }
  for (const std::string& c : candidates) {
    if (access(c.c_str(), X_OK) == 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      nvcc_path_ = c;
      return c;
    }
  }
  throw DIError(fmt::format(
      "deep_indexer: nvcc (CUDA 12.3+ for sm_90a) was not found; kernels are compiled on first use. "
      "Install the CUDA toolkit, or point {} (or CUDA_HOME) at it",
      env::kNvcc));
}

std::string Compiler::nvcc_version() {
  const std::string nvcc = nvcc_path();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!nvcc_version_.empty()) return nvcc_version_;
  }
  const fs::ProcessResult r = fs::run_command(fs::shell_quote(nvcc) + " --version");
  DI_CHECK(r.exit_code == 0, "deep_indexer: `{} --version` failed:\n{}", nvcc, r.output);
  const size_t rel = r.output.find("release ");
  std::string version = rel == std::string::npos ? r.output : r.output.substr(rel);
  version = version.substr(0, version.find('\n'));
  std::lock_guard<std::mutex> lock(mutex_);
  nvcc_version_ = version;
  return version;
}

std::vector<std::string> Compiler::flags(const std::string& arch) const {
  DI_CHECK_ARG(arch == "sm_90a", "deep_indexer: unsupported arch '{}': the kernels target sm_90a (Hopper) only", arch);
  std::vector<std::string> f = {"-std=c++17", "-O3", "--expt-relaxed-constexpr", "-DNDEBUG", "-lineinfo",
                                "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-cubin"};
  const std::string ccbin = env::get_str(env::kNvccCcbin);
  if (!ccbin.empty()) f.insert(f.end(), {"-ccbin", ccbin});
  // DI_JIT_EXTRA_FLAGS (e.g. -DDI_KERNEL_TRACE); hashed into the cache key with the other flags.
  const std::string extra = env::get_str(env::kExtraFlags);
  for (size_t i = 0; i < extra.size();) {
    const size_t j = extra.find(' ', i);
    const std::string tok = extra.substr(i, j == std::string::npos ? std::string::npos : j - i);
    if (!tok.empty()) f.push_back(tok);
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return f;
}

std::string Compiler::headers_digest(const std::string& source) {
  const CompilerConfig cfg = config();
  DI_CHECK(!cfg.include_dir.empty(), "deep_indexer: the JIT include folder is not configured (import deep_indexer first)");
  Sha256 h;
  std::set<stdfs::path> seen;
  std::vector<stdfs::path> todo = includes_of(source, cfg.include_dir, cfg.include_dir);
  while (!todo.empty()) {
    const stdfs::path p = todo.back();
    todo.pop_back();
    if (!seen.insert(p).second) continue;
    std::string text;
    DI_CHECK(fs::read_file(p, &text), "deep_indexer: cannot read header {}", p.string());
    for (auto& inc : includes_of(text, p.parent_path(), cfg.include_dir)) todo.push_back(inc);
  }
  for (const stdfs::path& p : seen) {  // std::set: sorted, so the digest is order-independent
    std::string text;
    fs::read_file(p, &text);
    h.update(p.lexically_relative(cfg.include_dir).string()).update(text);
  }
  if (!cfg.cutlass_include_dir.empty()) {
    std::string version;
    fs::read_file(cfg.cutlass_include_dir / "cutlass" / "version.h", &version);
    h.update(version);
  }
  return h.hex_digest();
}

std::string Compiler::cache_key(const std::string& source, const std::string& arch) {
  Sha256 h;
  h.update(source).update(arch).update(join(flags(arch), " ")).update(nvcc_version()).update(headers_digest(source));
  return h.hex_digest();
}

std::shared_ptr<const CompiledKernel> Compiler::build(const std::string& name, const std::string& source,
                                                      const std::string& arch) {
  const std::string key = cache_key(source, arch);
  std::promise<std::shared_ptr<const CompiledKernel>> promise;
  std::shared_future<std::shared_ptr<const CompiledKernel>> future;
  bool owner = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = in_flight_.find(key);
    if (it != in_flight_.end()) {
      future = it->second;
    } else {
      future = promise.get_future().share();
      in_flight_.emplace(key, future);
      owner = true;
    }
  }
  if (!owner) return future.get();
  try {
    auto result = build_uncached(name, source, arch, key);
    promise.set_value(result);
  } catch (...) {
    promise.set_exception(std::current_exception());
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_.erase(key);
  }
  return future.get();
}

std::shared_ptr<const CompiledKernel> Compiler::build_uncached(const std::string& name, const std::string& source,
                                                               const std::string& arch, const std::string& key) {
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  const stdfs::path root = cache_dir();
  std::string safe_name;
  for (char c : name) safe_name.push_back(std::isalnum(static_cast<unsigned char>(c)) ? c : '_');
  safe_name = safe_name.substr(0, 64);
  const stdfs::path final_dir = root / (safe_name + "-" + key.substr(0, 32));

  if (auto hit = load_entry(final_dir)) {
    hit->name = name;
    hit->key = key;
    hit->from_cache = true;
    hit->seconds = elapsed();
    if (debug()) std::fprintf(stderr, "deep_indexer: JIT cache hit %s (%s)\n", name.c_str(), final_dir.c_str());
    return hit;
  }

  // Compile in a private folder, then publish with one rename.
  const stdfs::path tmp = fs::make_temp_dir(root.parent_path() / "tmp", safe_name.substr(0, 32) + "-");
  try {
    fs::write_file(tmp / "kernel.cu", source);
    const CompilerConfig cfg = config();
    // Relative names from inside the folder keep the temp path out of the cubin's line info.
    std::string cmd = "cd " + fs::shell_quote(tmp.string()) + " && " + fs::shell_quote(nvcc_path()) +
                      " kernel.cu -o " + kCubinFile;
    for (const std::string& f : flags(arch)) cmd += " " + fs::shell_quote(f);
    cmd += " -I" + fs::shell_quote(cfg.include_dir.string());
    if (!cfg.cutlass_include_dir.empty()) cmd += " -I" + fs::shell_quote(cfg.cutlass_include_dir.string());
    if (env::get_int(env::kPrintCommand)) std::fprintf(stderr, "deep_indexer: JIT compile: %s\n", cmd.c_str());
    const fs::ProcessResult r = fs::run_command(cmd);
    if (r.exit_code != 0)
      throw DIError(fmt::format("deep_indexer: nvcc failed to compile {} (exit code {}).\nCommand: {}\nOutput:\n{}",
                                name, r.exit_code, cmd, r.output));
    std::string cubin;
    DI_CHECK(fs::read_file(tmp / kCubinFile, &cubin), "deep_indexer: nvcc produced no cubin for {}", name);
    fs::write_file(tmp / "ptxas.log", r.output);
    const ResourceUsage usage = parse_ptxas_log(r.output);
    if (env::get_int(env::kPtxasVerbose))
      std::fprintf(stderr, "deep_indexer: ptxas %s:\n%s\n", name.c_str(), r.output.c_str());
    if (usage.spills() && env::get_int(env::kFailOnSpills))
      throw DIError(fmt::format("deep_indexer: {} spills to local memory ({} B stores, {} B loads) and {}=1",
                                name, usage.spill_stores, usage.spill_loads, env::kFailOnSpills));
    const std::string symbol = find_entry_symbol(cubin);
    fs::write_file(tmp / kMetaFile, fmt::format("name={}\nkey={}\nsymbol={}\ncubin_sha256={}\nnvcc={}\n", name, key,
                                                symbol, sha256_hex(cubin), nvcc_version()));
    if (env::get_int(env::kDumpSass)) {
      const stdfs::path cuobjdump = stdfs::path(nvcc_path()).parent_path() / "cuobjdump";
      const auto d = fs::run_command(fs::shell_quote(cuobjdump.string()) + " -sass " +
                                     fs::shell_quote((tmp / kCubinFile).string()));
      if (d.exit_code == 0) fs::write_file(tmp / "kernel.sass", d.output);
      else std::fprintf(stderr, "deep_indexer: warning: SASS dump failed: %s\n", d.output.c_str());
    }
    // Publish. If another process published first, keep theirs when valid, else replace it.
    std::error_code ec;
    for (int attempt = 0; attempt < 3; ++attempt) {
      stdfs::rename(tmp, final_dir, ec);
      if (!ec) break;
      if (load_entry(final_dir)) break;  // a valid entry from another process
      const stdfs::path trash = fs::make_temp_dir(root.parent_path() / "tmp", "trash-");
      stdfs::rename(final_dir, trash / "old", ec);
      fs::remove_all_quiet(trash);
    }
    fs::remove_all_quiet(tmp);  // no-op when the rename succeeded
    auto k = load_entry(final_dir);
    DI_CHECK(k != nullptr, "deep_indexer: the JIT cache entry {} could not be published", final_dir.string());
    k->name = name;
    k->key = key;
    k->from_cache = false;
    k->seconds = elapsed();
    if (debug()) std::fprintf(stderr, "deep_indexer: JIT compiled %s in %.2f s\n", name.c_str(), k->seconds);
    return k;
  } catch (...) {
    fs::remove_all_quiet(tmp);
    throw;
  }
}

}  // namespace deep_indexer::jit
