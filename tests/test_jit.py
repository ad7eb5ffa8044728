"""CPU tests of the C++ JIT: code generation, the disk cache (hits, concurrency, corruption),
resource parsing, error messages, and the compile-only CLI. No GPU needed (--arch sm_90a)."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import deep_indexer as di
from deep_indexer import _C, _env, jit

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLEAN_F32 = {"elem_bytes": 4}


def _entries(cache: pathlib.Path):
    k = cache / "kernels"
    return sorted(p for p in k.iterdir() if p.is_dir()) if k.is_dir() else []


def test_codegen_instantiates_the_template(isolated_cache):
    r = _C.precompile_variant("clean_logits", CLEAN_F32, "sm_90a")
    assert r["params"] == "clean_logits<float32>" and r["from_cache"] is False
    (entry,) = _entries(isolated_cache)
    src = (entry / "kernel.cu").read_text()
    assert "#include <deep_indexer/logits/clean_logits.cuh>" in src
    assert "&deep_indexer::clean_logits_kernel<4, 512>" in src
    meta = (entry / "meta.txt").read_text()
    assert "symbol=_ZN12deep_indexer19clean_logits_kernelILi4ELi512EEEvPvlliiPKiS3_" in meta
    assert (entry / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"


def test_second_use_hits_the_cache(isolated_cache):
    first = _C.precompile_variant("clean_logits", CLEAN_F32, "sm_90a")
    second = _C.precompile_variant("clean_logits", CLEAN_F32, "sm_90a")
    assert not first["from_cache"] and second["from_cache"]
    assert second["seconds"] < first["seconds"]
    assert len(_entries(isolated_cache)) == 1


def test_corrupt_entry_is_rebuilt(isolated_cache):
    _C.precompile_variant("clean_logits", CLEAN_F32, "sm_90a")
    (entry,) = _entries(isolated_cache)
    cubin = entry / "kernel.cubin"
    good = cubin.read_bytes()
    cubin.write_bytes(good[: len(good) // 2])  # truncated, as after a crash mid-write elsewhere
    r = _C.precompile_variant("clean_logits", CLEAN_F32, "sm_90a")
    assert r["from_cache"] is False
    (entry2,) = _entries(isolated_cache)
    rebuilt = cubin.read_bytes()
    assert entry2 == entry and rebuilt[:4] == b"\x7fELF" and len(rebuilt) == len(good)
    import hashlib

    assert f"cubin_sha256={hashlib.sha256(rebuilt).hexdigest()}" in (entry / "meta.txt").read_text()
    assert _C.precompile_variant("clean_logits", CLEAN_F32, "sm_90a")["from_cache"]


def test_two_processes_compile_the_same_kernel(isolated_cache):
    code = textwrap.dedent("""
        import deep_indexer, sys
        from deep_indexer import _C
        r = _C.precompile_variant("mqa_logits", {"num_heads": 32, "head_dim": 64, "elem_bytes": 2}, "sm_90a")
        print("OK", r["from_cache"])
    """)
    env = dict(os.environ, DI_JIT_CACHE_DIR=str(isolated_cache))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.startswith("OK")
    (entry,) = _entries(isolated_cache)  # exactly one published entry
    assert (entry / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
    tmp = isolated_cache / "tmp"
    assert not tmp.exists() or not any(tmp.iterdir())  # no leftovers
    assert _C.precompile_variant("mqa_logits", {"num_heads": 32, "head_dim": 64, "elem_bytes": 2}, "sm_90a")["from_cache"]


def test_key_covers_included_headers(tmp_path):
    """Editing any header the kernel includes (recursively) changes the key; others do not."""
    inc = tmp_path / "include"
    import shutil

    shutil.copytree(ROOT / "include", inc)
    src = "#include <deep_indexer/logits/clean_logits.cuh>\n"
    src_ptx = "#include <deep_indexer/common/ptx.cuh>\n"
    old = _C.nvcc_path()  # noqa: F841  (resolve before switching folders)
    from deep_indexer._paths import cutlass_include_dir, include_dir

    try:
        _C.configure_jit(str(inc), "")
        k1, kp1 = _C.cache_key(src), _C.cache_key(src_ptx)
        (inc / "deep_indexer" / "common" / "wgmma_fp8.cuh").write_text((inc / "deep_indexer" / "common" / "wgmma_fp8.cuh").read_text() + "\n// x\n")
        k2, kp2 = _C.cache_key(src), _C.cache_key(src_ptx)
        assert k1 == k2  # clean_logits.cuh does not include wgmma_fp8.cuh
        assert kp1 != kp2  # ptx.cuh includes it
        assert _C.cache_key(src + " ") != k2  # the generated code itself
    finally:
        _C.configure_jit(str(include_dir()), cutlass_include_dir())


def test_parse_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z1kv\n"
           "    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 1 barriers, 1040 bytes smem\n")
    assert _C.parse_ptxas_log(log) == (168, 24, 8, 12, 1040)


def _run(code: str, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)


def test_missing_nvcc_is_a_clear_error(tmp_path):
    r = _run("import deep_indexer; from deep_indexer import _C; _C.precompile_variant('clean_logits', {'elem_bytes': 4}, 'sm_90a')",
             DI_NVCC=str(tmp_path / "no-nvcc"), DI_JIT_CACHE_DIR=str(tmp_path / "c"))
    assert r.returncode != 0
    assert "DI_NVCC" in r.stderr and "not an executable nvcc" in r.stderr


def test_compile_error_shows_compiler_output(isolated_cache):
    with pytest.raises(RuntimeError, match=r"nvcc failed to compile broken(.|\n)*undefined_symbol_xyz"):
        _C.compile_source("broken", "__global__ void k() { undefined_symbol_xyz(); }\n", "sm_90a")


def test_unwritable_cache_falls_back_with_warning(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # running as root: use a path that cannot be created instead
        target = "/proc/deep_indexer_cache"
    else:
        target = str(ro / "cache")
    tmp = tmp_path / "tmp"  # the fallback folder goes under TMPDIR: this test's, not the machine's
    tmp.mkdir()
    r = _run("import deep_indexer; from deep_indexer import _C; print(_C.precompile_variant('clean_logits', {'elem_bytes': 2}, 'sm_90a')['registers'])",
             DI_JIT_CACHE_DIR=target, TMPDIR=str(tmp))
    assert r.returncode == 0, r.stderr
    assert "cannot be written" in r.stderr and "DI_JIT_CACHE_DIR" in r.stderr
    assert str(tmp / f"deep_indexer-{os.getuid()}") in r.stderr
    assert any((tmp / f"deep_indexer-{os.getuid()}" / "kernels").iterdir())


def test_unsupported_arch_and_op():
    with pytest.raises(ValueError, match="sm_90a"):
        _C.precompile_variant("clean_logits", CLEAN_F32, "sm_80")
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        _C.precompile_variant("nope", {}, "sm_90a")
    with pytest.raises(ValueError, match="unsupported head count"):
        jit.variants(ops=["mqa_logits"], heads=[48])


def test_no_gpu_is_a_clear_error():
    ok, why = _C.driver_available()
    if ok:
        pytest.skip("a CUDA driver is present")
    assert "driver" in why
    with pytest.raises(RuntimeError, match="no NVIDIA driver"):
        _C.device_info(0)


def test_variant_enumeration():
    assert len(jit.variants(ops=["clean_logits"])) == 2
    assert len(jit.variants(ops=["mqa_logits"])) == 4 * 3 * 2
    # next_n 1..8 x heads x dims x block_kv x dtypes x context_lens forms, + varlen for next_n = 1, x the 4 input
    # forms (FP8 / FP4 q x FP8 / FP4 cache)
    assert len(jit.variants(ops=["paged_mqa_logits"])) == 4 * (8 * 4 * 2 * 2 * 2 * 2 + 4 * 2 * 2 * 2 * 2)
    assert len(jit.variants(ops=["paged_mqa_logits"], head_dims=[32, 64])) == 4 * (8 * 4 * 1 * 2 * 2 * 2 + 4 * 2 * 2 * 2)
    assert len(jit.variants(ops=["paged_mqa_logits"], next_n=[5, 8])) == 4 * 2 * 4 * 2 * 2 * 2 * 2
    fp8 = jit.variants(ops=["paged_mqa_logits"], paged_inputs=["fp8"])
    assert len(fp8) == 8 * 4 * 2 * 2 * 2 * 2 + 4 * 2 * 2 * 2 * 2
    assert not any(k in ("q_fp4", "kv_fp4") for v in fp8 for k, _ in v.params)  # the FP8 variants' params as before
    forms = {name: jit.variants(ops=["paged_mqa_logits"], next_n=[2], heads=[64], paged_inputs=[name])
             for name in ("fp4", "fp8q-fp4kv", "fp4q-fp8kv")}
    assert {name: {(dict(v.params).get("q_fp4", 0), dict(v.params).get("kv_fp4", 0)) for v in vs}
            for name, vs in forms.items()} == {"fp4": {(1, 1)}, "fp8q-fp4kv": {(0, 1)}, "fp4q-fp8kv": {(1, 0)}}
    with pytest.raises(ValueError, match=r"unsupported paged input form \['fp6'\]"):
        jit.variants(ops=["paged_mqa_logits"], paged_inputs=["fp6"])
    assert len(jit.variants(ops=["paged_mqa_logits_metadata"])) == 8 * 2  # small and general
    assert len(jit.variants(ops=["fp4_fold"])) == 4  # D = 32, 64, 96, 128
    assert len(jit.variants(ops=["fp4_fold"], head_dims=[64, 128])) == 2
    assert len(jit.variants(ops=["fp4_prefill_fold"])) == 3  # D = 32, 64, 128


def test_cli_precompile_and_cache(isolated_cache):
    env = dict(os.environ, DI_JIT_CACHE_DIR=str(isolated_cache))
    cmd = [sys.executable, "-m", "deep_indexer", "precompile", "--arch", "sm_90a", "--ops", "clean_logits", "--jobs", "2"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "compiled 2 kernels (0 from cache), 0 spilled"
    assert "[2/2]" in r.stderr  # progress
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.stdout.strip().splitlines()[-1] == "compiled 2 kernels (2 from cache), 0 spilled"
    info = subprocess.run([sys.executable, "-m", "deep_indexer", "cache", "info"], env=env, capture_output=True, text=True)
    assert "entries: 2" in info.stdout and str(isolated_cache) in info.stdout
    clear = subprocess.run([sys.executable, "-m", "deep_indexer", "cache", "clear"], env=env, capture_output=True, text=True)
    assert "removed 2 entries" in clear.stdout
    bad = subprocess.run([sys.executable, "-m", "deep_indexer", "precompile", "--arch", "sm_90a", "--ops", "bogus"],
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unsupported op ['bogus']" in bad.stderr


def test_python_precompile_api(isolated_cache):
    res = di.precompile(ops=["paged_mqa_logits_metadata"], next_n=[1, 2], arch="sm_90a", jobs=2)
    assert [r["params"] for r in res] == ["paged_mqa_metadata<next_n=1,small>", "paged_mqa_metadata<next_n=1,any>",
                                          "paged_mqa_metadata<next_n=2,small>", "paged_mqa_metadata<next_n=2,any>"]
    assert all("error" not in r and r["spill_stores"] == 0 for r in res)
    assert di.cache_info()["entries"] == 4


# Template parameters that only change the epilogue or the indexing (not the register / shared-memory
# budget): the default run compiles one member of each group of variants that differ only in these.
_LIGHT_PARAMS = ("block_kv", "elem_bytes", "context_lens_2d", "q_fp4")


def sample_variants(variants: list) -> list:
    """A deterministic subset of `variants` (the same every run): one variant per op and combination of
    the heavy parameters (heads, head dims, next_n, forms, ...), the light ones rotating through their
    combinations from group to group; then whatever is needed so that every value of every parameter of
    every op appears at least once."""
    groups: dict = {}
    for v in variants:
        groups.setdefault((v.op, tuple(p for p in v.params if p[0] not in _LIGHT_PARAMS)), []).append(v)
    picked = [g[i % len(g)] for i, g in enumerate(groups.values())]
    seen = {(v.op, p) for v in picked for p in v.params}
    for v in variants:
        if any((v.op, p) not in seen for p in v.params):
            picked.append(v)
            seen |= {(v.op, p) for p in v.params}
    return picked


def test_variant_sample_covers_every_op_and_value():
    every = jit.variants()
    sample = sample_variants(every)
    assert sample == sample_variants(every)  # deterministic
    assert {v.op for v in sample} == set(jit.OPS)
    assert {(v.op, p) for v in sample for p in v.params} == {(v.op, p) for v in every for p in v.params}
    assert len(sample) < len(every) // 3


_ALL_VARIANTS = os.environ.get(_env.TEST_ALL_VARIANTS, "")


@pytest.mark.skipif(_ALL_VARIANTS == "0", reason="DI_TEST_ALL_VARIANTS=0")
def test_every_variant_compiles_without_spills(isolated_cache):
    """Kernel variants compile for sm_90a without spills, into a temporary cache (the user's kernel
    cache is left alone), os.cpu_count() nvcc processes at a time. The slow test of the CPU suite.
    Default: the deterministic sample of sample_variants() (every op, every value of every parameter);
    DI_TEST_ALL_VARIANTS=1: every registered variant; DI_TEST_ALL_VARIANTS=0: skipped."""
    every = jit.variants()
    todo = every if _ALL_VARIANTS == "1" else sample_variants(every)
    print(f"compiling {len(todo)} of {len(every)} kernel variants (DI_TEST_ALL_VARIANTS=1: all)")
    res = jit.compile_variants(todo, arch="sm_90a")
    assert len(res) == len(todo)
    assert all(r["from_cache"] is False for r in res if "error" not in r)
    failed = [(r["params"], r["error"][:500]) for r in res if "error" in r]
    assert not failed
    spilled = [r["params"] for r in res if r["spill_stores"] or r["spill_loads"] or r["stack_frame"]]
    assert not spilled
    serialized = [r["params"] for r in res if any("serializ" in w for w in r["warnings"])]
    assert not serialized


def test_cli_options_have_help():
    """Every option and positional argument of precompile, cache and deep-gemm says what it does."""
    import argparse

    from deep_indexer.__main__ import parser

    subs = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for cmd in ("precompile", "cache", "deep-gemm"):
        for action in subs.choices[cmd]._actions:
            assert action.help, f"{cmd} {action.option_strings or action.dest}: no help text"
