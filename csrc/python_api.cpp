// pybind11 module deep_indexer._C: the ops, the JIT configuration and compile-only entry points.
#include <torch/extension.h>

#include "apis/clean_logits.hpp"
#include "apis/fp4_fold.hpp"
#include "apis/mqa_logits.hpp"
#include "apis/paged_mqa_logits.hpp"
#include "apis/topk.hpp"
#include "apis/training_logits.hpp"
#include "apis/training_loss.hpp"
#include "jit/compiler.hpp"
#include "jit/runtime.hpp"
#include "utils/exception.hpp"

namespace py = pybind11;
using namespace deep_indexer;

namespace {

py::dict usage_dict(const jit::VariantReport& r) {
  py::dict d;
  d["kernel"] = r.kernel;
  d["params"] = r.params;
  d["registers"] = r.usage.registers;
  d["spill_stores"] = r.usage.spill_stores;
  d["spill_loads"] = r.usage.spill_loads;
  d["stack_frame"] = r.usage.stack_frame;
  d["smem_bytes"] = r.smem_bytes;
  d["seconds"] = r.seconds;
  d["from_cache"] = r.from_cache;
  d["warnings"] = r.usage.warnings;
  return d;
}

int param(const py::dict& p, const char* key) {
  DI_CHECK_ARG(p.contains(key), "precompile: missing parameter '{}'", key);
  return p[key].cast<int>();
}
// An optional parameter: `fallback` when absent.
int param_or(const py::dict& p, const char* key, int fallback) { return p.contains(key) ? p[key].cast<int>() : fallback; }

// The ops precompile_variant compiles, in the order deep_indexer.jit enumerates them.
constexpr const char* kPrecompileOps[] = {
    "clean_logits",          "mqa_logits",          "paged_mqa_logits",     "paged_mqa_logits_metadata",
    "topk",                  "training_logits",     "training_logits_stats", "training_target",
    "training_indexer_dk",   "training_indexer_dq", "training_per_head_rows", "training_per_head_dk",
    "fp4_fold",              "fp4_prefill_fold"};

// The compile-time values the kernels support: the one table deep_indexer.jit builds its variant list
// from (jit.variants() combines them per op; precompile_variant below parses and validates each).
py::dict variant_space() {
  py::dict d;
  py::list ops;
  for (const char* op : kPrecompileOps) ops.append(op);
  d["ops"] = ops;
  d["heads"] = py::make_tuple(16, 32, 64, 128);
  d["mqa_head_dims"] = py::make_tuple(32, 64, 128);
  d["paged_head_dims"] = py::make_tuple(64, 128);
  d["fp4_head_dims"] = py::make_tuple(32, 64, 96, 128);  // fp4_fold (FP4 q / kv -> e4m3, docs/fp4.md)
  d["fp4_prefill_head_dims"] = py::make_tuple(32, 64, 128);  // fp4_prefill_fold (the prefill kernel's dims)
  d["training_head_dims"] = py::make_tuple(64, 128);  // bf16 training kernels (deep_indexer.training)
  // attention q.k dims precompiled for the warm-up target (any multiple of 64 up to 576 compiles on use)
  d["training_target_head_dims"] = py::make_tuple(128, 192, 576);
  // (attention q.k dim, indexer dim) pairs of the per_head target within the register budget
  d["training_per_head_dims"] = py::make_tuple(py::make_tuple(64, 64), py::make_tuple(128, 64), py::make_tuple(192, 64));
  py::list next_n;
  for (int n = 1; n <= kMaxPagedNextN; ++n) next_n.append(n);
  d["next_n"] = py::tuple(next_n);
  d["block_kv"] = py::make_tuple(32, 64);
  // (q_fp4, kv_fp4) input forms of paged_mqa_logits: FP8 or FP4 q, FP8 or FP4 paged cache (docs/fp4.md)
  d["paged_input_forms"] = py::make_tuple(py::make_tuple(0, 0), py::make_tuple(1, 1), py::make_tuple(0, 1),
                                          py::make_tuple(1, 0));
  d["logits_elem_bytes"] = py::make_tuple(py::make_tuple("float32", 4), py::make_tuple("bfloat16", 2));
  // Resident top-k forms the heuristic takes (heuristics_sm90.hpp): (cluster, threads, CTAs per SM, the most
  // keys per thread it gives them for float32, for bfloat16: the register budget, and for one CTA per SM
  // without clusters at most default_one_cta_keys).
  py::list forms;
  for (const auto& [cluster, threads, per_sm] :
       {std::tuple{false, 1024, 1}, {true, 256, 1}, {true, 512, 1}, {true, 1024, 1}, {false, 512, 2}, {false, 256, 4}}) {
    auto most = [&](int elem_bytes) {
      const int budget = TopkResidentLayout::max_keys_per_thread(threads, cluster, elem_bytes, per_sm);
      return !cluster && per_sm == 1 ? std::min(budget, TopkResidentLayout::default_one_cta_keys(threads)) : budget;
    };
    forms.append(py::make_tuple(cluster ? 1 : 0, threads, per_sm, most(4), most(2)));
  }
  d["topk_resident_forms"] = forms;
  return d;
}

// Compiles one variant of `op` (no GPU needed). `params` holds the op's compile-time options.
py::dict precompile_variant(const std::string& op, const py::dict& params, const std::string& arch) {
  jit::VariantReport r;
  {
    if (op == "clean_logits") {
      CleanLogitsRuntime::Params p{param(params, "elem_bytes")};
      DI_CHECK_ARG(p.elem_bytes == 4 || p.elem_bytes == 2, "precompile: clean_logits elem_bytes must be 4 or 2");
      py::gil_scoped_release release;
      r = CleanLogitsRuntime::precompile(p, arch);
    } else if (op == "mqa_logits") {
      MqaLogitsRuntime::Params p{param(params, "num_heads"), param(params, "head_dim"), param(params, "elem_bytes")};
      p.layout();  // validates
      py::gil_scoped_release release;
      r = MqaLogitsRuntime::precompile(p, arch);
    } else if (op == "paged_mqa_logits") {
      PagedMqaLogitsRuntime::Params p{param(params, "next_n"),   param(params, "num_heads"),
                                      param(params, "head_dim"), param(params, "block_kv"),
                                      param(params, "elem_bytes"), param(params, "context_lens_2d") != 0,
                                      param_or(params, "varlen", 0) != 0,
                                      param_or(params, "q_fp4", 0) != 0,
                                      param_or(params, "kv_fp4", 0) != 0};
      DI_CHECK_ARG(!p.varlen || p.next_n == 1, "precompile: paged_mqa_logits varlen needs next_n = 1");
      p.layout();  // validates
      py::gil_scoped_release release;
      r = PagedMqaLogitsRuntime::precompile(p, arch);
    } else if (op == "paged_mqa_logits_metadata") {
      PagedMqaMetadataRuntime::Params p{param(params, "next_n"), param(params, "small") != 0};
      DI_CHECK_ARG(p.next_n >= 1 && p.next_n <= kMaxPagedNextN, "precompile: next_n must be in 1..{}", kMaxPagedNextN);
      py::gil_scoped_release release;
      r = PagedMqaMetadataRuntime::precompile(p, arch);
    } else if (op == "topk" && param_or(params, "resident", 0) != 0) {
      TopkResidentRuntime::Params p{param(params, "elem_bytes"), param(params, "keys_per_thread"),
                                    param(params, "cluster") != 0, param(params, "threads"),
                                    param_or(params, "ctas_per_sm", 1)};
      p.layout();  // validates
      py::gil_scoped_release release;
      r = TopkResidentRuntime::precompile(p, arch);
    } else if (op == "topk") {
      TopkRuntime::Params p{param(params, "elem_bytes"), param(params, "sorted") != 0, param(params, "cluster") != 0,
                            param(params, "wide") != 0, param_or(params, "packed", 0) != 0};
      p.layout();  // validates
      py::gil_scoped_release release;
      r = TopkRuntime::precompile(p, arch);
    } else if (op == "training_logits") {  // the prefill kernel's bf16 form (bf16_indexer_logits)
      MqaLogitsRuntime::Params p{param(params, "num_heads"), param(params, "head_dim"), 4, 2};
      p.layout();  // validates
      py::gil_scoped_release release;
      r = MqaLogitsRuntime::precompile(p, arch);
    } else if (op == "training_logits_stats") {
      TrainingLogitsStatsRuntime::Params p{param(params, "num_heads"), param(params, "head_dim")};
      p.layout();  // validates
      py::gil_scoped_release release;
      r = TrainingLogitsStatsRuntime::precompile(p, arch);
    } else if (op == "training_target") {
      TrainingTargetRuntime::Params p{param(params, "head_dim"), param(params, "cluster"),
                                      param_or(params, "lse", 0) != 0};
      p.layout();  // validates
      py::gil_scoped_release release;
      r = TrainingTargetRuntime::precompile(p, arch);
    } else if (op == "training_indexer_dk") {
      TrainingIndexerDkRuntime::Params p{param(params, "head_dim"), param(params, "loss") != 0,
                                         param_or(params, "mask", 0) != 0};
      training_indexer_bwd_layout(p.head_dim);  // validates
      py::gil_scoped_release release;
      r = TrainingIndexerDkRuntime::precompile(p, arch);
    } else if (op == "training_indexer_dq") {
      TrainingIndexerDqRuntime::Params p{param(params, "head_dim"),
                                         param_or(params, "masked", 0) != 0,
                                         param_or(params, "bf16_out", 0) != 0};
      training_indexer_bwd_layout(p.head_dim);  // validates
      py::gil_scoped_release release;
      r = TrainingIndexerDqRuntime::precompile(p, arch);
    } else if (op == "training_per_head_rows") {
      TrainingPerHeadRowsRuntime::Params p{param(params, "qk_dim"), param(params, "head_dim"), param(params, "bwd") != 0};
      training_per_head_layout(p.qk_dim, p.head_dim);  // validates
      py::gil_scoped_release release;
      r = TrainingPerHeadRowsRuntime::precompile(p, arch);
    } else if (op == "training_per_head_dk") {
      TrainingPerHeadDkRuntime::Params p{param(params, "qk_dim"), param(params, "head_dim")};
      training_per_head_layout(p.qk_dim, p.head_dim);  // validates
      py::gil_scoped_release release;
      r = TrainingPerHeadDkRuntime::precompile(p, arch);
    } else if (op == "fp4_fold") {
      Fp4FoldRuntime::Params p{param(params, "head_dim")};
      DI_CHECK_ARG(Fp4FoldRuntime::supported(p.head_dim), "precompile: fp4_fold head_dim must be 32, 64, 96 or 128");
      py::gil_scoped_release release;
      r = Fp4FoldRuntime::precompile(p, arch);
    } else if (op == "fp4_prefill_fold") {
      Fp4PrefillFoldRuntime::Params p{param(params, "head_dim")};
      DI_CHECK_ARG(Fp4FoldLayout::supported(p.head_dim), "precompile: fp4_prefill_fold head_dim must be 32, 64 or 128");
      py::gil_scoped_release release;
      r = Fp4PrefillFoldRuntime::precompile(p, arch);
    } else {
      std::string known;
      for (const char* name : kPrecompileOps) known += (known.empty() ? "" : ", ") + std::string(name);
      throw DIValueError(fmt::format("precompile: unknown op '{}' (known: {})", op, known));
    }
  }
  return usage_dict(r);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "deep_indexer C++/CUDA extension (JIT-compiled SM90 kernels)";
  py::register_exception<DIError>(m, "DIError", PyExc_RuntimeError);
  py::register_exception<DIValueError>(m, "DIValueError", PyExc_ValueError);

  m.def("configure_jit", [](const std::string& include_dir, const std::string& cutlass_include_dir) {
    jit::Compiler::instance().configure({include_dir, cutlass_include_dir});
  });
  m.def("cache_dir", [] { return jit::Compiler::instance().cache_dir().string(); });
  m.def("nvcc_path", [] { return jit::Compiler::instance().nvcc_path(); });
  m.def("nvcc_version", [] { return jit::Compiler::instance().nvcc_version(); });
  m.def("cache_key", [](const std::string& source, const std::string& arch) {
    return jit::Compiler::instance().cache_key(source, arch);
  }, py::arg("source"), py::arg("arch") = "sm_90a");
  m.def("compile_source", [](const std::string& name, const std::string& source, const std::string& arch) {
    std::shared_ptr<const jit::CompiledKernel> k;
    {
      py::gil_scoped_release release;
      k = jit::Compiler::instance().build(name, source, arch);
    }
    py::dict d;
    d["dir"] = k->dir.string();
    d["symbol"] = k->symbol;
    d["from_cache"] = k->from_cache;
    d["seconds"] = k->seconds;
    d["registers"] = k->usage.registers;
    return d;
  }, py::arg("name"), py::arg("source"), py::arg("arch") = "sm_90a");
  m.def("parse_ptxas_log", [](const std::string& log) {
    const jit::ResourceUsage u = jit::parse_ptxas_log(log);
    return py::make_tuple(u.registers, u.stack_frame, u.spill_stores, u.spill_loads, u.static_smem);
  });
  m.def("variant_space", &variant_space);
  m.def("precompile_variant", &precompile_variant, py::arg("op"), py::arg("params"), py::arg("arch") = "sm_90a");
  m.def("driver_available", [] {
    std::string why;
    const bool ok = driver::available(&why);
    return py::make_tuple(ok, why);
  });
  m.def("device_info", [](int device) {
    const jit::DeviceInfo& d = jit::device_info(device);
    py::dict r;
    r["num_sms"] = d.num_sms;
    r["cc"] = py::make_tuple(d.cc_major, d.cc_minor);
    r["max_smem_per_block_optin"] = d.max_smem_per_block_optin;
    r["l2_bytes"] = d.l2_bytes;
    return r;
  });
  m.def("num_loaded_kernels", &jit::num_loaded_kernels);
  m.def("set_num_sms", &deep_indexer::set_num_sms, py::arg("num_sms"), py::arg("device") = -1,
        "Caps the SMs the ops use (0 removes the cap); validated against `device` when >= 0.");
  m.def("get_num_sms", &deep_indexer::get_num_sms, py::arg("device") = -1,
        "The SM count the ops use on `device`; with device < 0 the cap itself (0: none).");

  m.def("clean_logits", &clean_logits, py::arg("logits"), py::arg("cu_seq_len_k_start"), py::arg("cu_seq_len_k_end"),
        py::arg("next_n") = 1);
  m.def("fp4_fold", &fp4_fold, py::arg("codes"), py::arg("sf"));
  m.def("fp4_prefill_fold", &fp4_prefill_fold, py::arg("q_codes"), py::arg("q_sf"), py::arg("weights"),
        py::arg("k_codes"), py::arg("k_sf"), py::arg("q_out") = py::none(), py::arg("weights_out") = py::none(),
        py::arg("k_out") = py::none(), py::arg("k_scale_out") = py::none());
  m.def("fp8_mqa_logits", &fp8_mqa_logits, py::arg("q"), py::arg("k"), py::arg("k_scale"), py::arg("weights"),
        py::arg("cu_seq_len_k_start"), py::arg("cu_seq_len_k_end"), py::arg("clean_logits"), py::arg("elem_bytes"),
        py::arg("out"), py::arg("max_seqlen_k") = 0);
  m.def("get_paged_mqa_logits_metadata", &get_paged_mqa_logits_metadata, py::arg("context_lens"), py::arg("block_kv"),
        py::arg("num_sms"), py::arg("out"), py::arg("indices") = py::none());
  m.def("fp8_paged_mqa_logits", &fp8_paged_mqa_logits, py::arg("q"), py::arg("kv_cache"), py::arg("weights"),
        py::arg("context_lens"), py::arg("block_table"), py::arg("schedule_meta"), py::arg("max_context_len"),
        py::arg("clean_logits"), py::arg("elem_bytes"), py::arg("out"), py::arg("indices") = py::none(),
        py::arg("q_sf") = py::none());
  m.def("topk_indices", &topk_indices, py::arg("logits"), py::arg("k"), py::arg("cu_seq_len_k_start"),
        py::arg("cu_seq_len_k_end"), py::arg("context_lens"), py::arg("next_n"), py::arg("sorted"),
        py::arg("index_mode"), py::arg("block_table"), py::arg("block_size"), py::arg("row_offset"),
        py::arg("return_values"), py::arg("out"), py::arg("out_values"), py::arg("indices") = py::none());
  m.def("bf16_indexer_logits", &bf16_indexer_logits, py::arg("q"), py::arg("k"), py::arg("weights"), py::arg("ks"),
        py::arg("ke"), py::arg("out"), py::arg("clean") = true);
  m.def("bf16_training_target", &bf16_training_target, py::arg("q"), py::arg("k"), py::arg("lse"), py::arg("ks"),
        py::arg("ke"), py::arg("p"), py::arg("plogp"), py::arg("mass"), py::arg("row_begin"), py::arg("row_end"),
        py::arg("softmax_scale"), py::arg("inv_heads"));
  m.def("bf16_attention_lse", &bf16_attention_lse, py::arg("q"), py::arg("k"), py::arg("ks"), py::arg("ke"),
        py::arg("lse_out"), py::arg("row_begin"), py::arg("row_end"), py::arg("softmax_scale"));
  m.def("bf16_indexer_logits_stats", &bf16_indexer_logits_stats, py::arg("q"), py::arg("k"), py::arg("weights"),
        py::arg("ks"), py::arg("ke"), py::arg("p"), py::arg("lse_out"), py::arg("pi_out"), py::arg("row_begin"),
        py::arg("row_end"));
  m.def("bf16_indexer_logits_bwd_dk", &bf16_indexer_logits_bwd_dk, py::arg("q"), py::arg("k"), py::arg("weights"),
        py::arg("ks"), py::arg("ke"), py::arg("vals"), py::arg("vals_row0"), py::arg("g"), py::arg("mass"),
        py::arg("lse_i"), py::arg("di_out"), py::arg("row_begin"), py::arg("row_end"), py::arg("key_begin"),
        py::arg("key_end"), py::arg("mask_out") = py::none(), py::arg("mask_row0") = 0);
  m.def("bf16_indexer_logits_bwd_dq", &bf16_indexer_logits_bwd_dq, py::arg("q"), py::arg("k"), py::arg("weights"),
        py::arg("ks"), py::arg("ke"), py::arg("di"), py::arg("di_row0"), py::arg("dq"), py::arg("dw"),
        py::arg("row_begin"), py::arg("row_end"), py::arg("mask") = py::none(), py::arg("mask_row0") = 0,
        py::arg("mask_key0") = 0, py::arg("mask_key1") = 0);
  m.def("bf16_per_head_fwd", &bf16_per_head_fwd, py::arg("q"), py::arg("k"), py::arg("q_i"), py::arg("k_i"),
        py::arg("ks"), py::arg("ke"), py::arg("lse"), py::arg("w"), py::arg("kl"), py::arg("lse_i"), py::arg("mass"),
        py::arg("softmax_scale"));
  m.def("bf16_per_head_bwd", &bf16_per_head_bwd, py::arg("q"), py::arg("k"), py::arg("q_i"), py::arg("k_i"),
        py::arg("ks"), py::arg("ke"), py::arg("lse"), py::arg("w"), py::arg("lse_i"), py::arg("mass"), py::arg("g"),
        py::arg("dq"), py::arg("dw"), py::arg("softmax_scale"));
  m.def("training_per_head_supported", [](int qk_dim, int head_dim) {
    return TrainingPerHeadLayout{qk_dim, head_dim}.valid();
  }, py::arg("qk_dim"), py::arg("head_dim"), "Whether the sm90 per_head kernels support attention dim qk_dim with "
        "indexer dim head_dim.");
}
