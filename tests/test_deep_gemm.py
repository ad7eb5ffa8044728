"""deep_indexer.deep_gemm: DeepGEMM's indexer API (names, argument order, defaults), its FP8 / FP4 input forms,
bf16 weights, set_num_sms / get_num_sms and install(). CPU tests first, GPU tests (SM90) at the end."""
import inspect
import subprocess
import sys
import types

import pytest
import torch

from conftest import assert_logits_match, requires_sm90

import deep_indexer as di
from deep_indexer import _C, deep_gemm, quant, reference

P = inspect.Parameter
POS, KW = P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY
REQ = P.empty
F32 = torch.float32

# DeepGEMM's indexer signatures: (name, kind, default) per argument, in order. Our extras are
# keyword-only and come last.
DEEP_GEMM_SIGNATURES = {
    "fp8_fp4_mqa_logits": [
        ("q", POS, REQ), ("kv", POS, REQ), ("weights", POS, REQ), ("cu_seq_len_k_start", POS, REQ),
        ("cu_seq_len_k_end", POS, REQ), ("clean_logits", POS, True), ("max_seqlen_k", POS, 0),
        ("logits_dtype", POS, F32),
        ("out", KW, None)],
    "get_paged_mqa_logits_metadata": [
        ("context_lens", POS, REQ), ("block_kv", POS, REQ), ("num_sms", POS, REQ), ("indices", POS, None),
        ("out", KW, None)],
    "fp8_fp4_paged_mqa_logits": [
        ("q", POS, REQ), ("kv_cache", POS, REQ), ("weights", POS, REQ), ("context_lens", POS, REQ),
        ("block_table", POS, REQ), ("schedule_meta", POS, REQ), ("max_context_len", POS, REQ),
        ("clean_logits", POS, False), ("logits_dtype", POS, F32), ("indices", POS, None),
        ("out", KW, None)],
    "fp8_mqa_logits": [
        ("q", POS, REQ), ("kv", POS, REQ), ("weights", POS, REQ), ("cu_seq_len_k_start", POS, REQ),
        ("cu_seq_len_k_end", POS, REQ), ("clean_logits", POS, True), ("max_seqlen_k", POS, 0),
        ("logits_dtype", KW, F32), ("out", KW, None)],
    "fp8_paged_mqa_logits": [
        ("q", POS, REQ), ("kv_cache", POS, REQ), ("weights", POS, REQ), ("context_lens", POS, REQ),
        ("block_table", POS, REQ), ("schedule_meta", POS, REQ), ("max_context_len", POS, REQ),
        ("clean_logits", POS, False), ("indices", POS, None),
        ("logits_dtype", KW, F32), ("out", KW, None)],
    "get_num_sms": [],
    "set_num_sms": [("new_num_sms", POS, REQ)],
}


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(DEEP_GEMM_SIGNATURES))
def test_signatures_are_deep_gemms(name):
    assert _params(getattr(deep_gemm, name)) == DEEP_GEMM_SIGNATURES[name]


def test_public_names():
    assert sorted(deep_gemm.__all__) == sorted(DEEP_GEMM_SIGNATURES)
    for name in ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "get_num_sms", "set_num_sms"):
        assert getattr(di, name) is getattr(deep_gemm, name)


# ------------------------------------------------------------------------------------ input forms
def _fp8(*shape):
    return torch.randn(*shape).to(torch.float8_e4m3fn)


def test_fp4_prefill_inputs_are_validated():
    # FP4 prefill inputs are accepted (folded into e4m3 for the FP8 kernel); malformed ones are clear errors
    q, kv = _fp8(4, 64, 128), (_fp8(16, 128), torch.rand(16))
    w, ks, ke = torch.rand(4, 64), torch.zeros(4, dtype=torch.int32), torch.full((4,), 16, dtype=torch.int32)
    packed = torch.randint(0, 255, (4, 64, 64), dtype=torch.uint8)
    sf = torch.full((4, 64), 0x7F7F7F7F, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"fp8_fp4_mqa_logits: q\[0\] \(FP4 codes\) must be uint8 or int8, got "
                                         r"torch.float8_e4m3fn"):
        deep_gemm.fp8_fp4_mqa_logits((q, torch.zeros(4, 64, dtype=torch.int32)), kv, w, ks, ke)
    with pytest.raises(ValueError, match=r"q has dtype torch.uint8 \(packed FP4\) but no scale words"):
        deep_gemm.fp8_fp4_mqa_logits((packed, None), kv, w, ks, ke)
    with pytest.raises(ValueError, match=r"q\[1\] \(FP4 scale words\) must be int32 \[4, 64\].*got torch.int32 \[4, 1\]"):
        deep_gemm.fp8_fp4_mqa_logits((packed, sf[:, :1]), kv, w, ks, ke)
    with pytest.raises(ValueError, match=r"q\[0\] \(FP4 codes\) must be \[S, H, D / 2\] with D in 32/64/128.*"
                                         r"\[4, 64, 48\]"):
        deep_gemm.fp8_fp4_mqa_logits((packed[..., :48], sf), kv, w, ks, ke)
    with pytest.raises(ValueError, match=r"weights must be float32/bfloat16/float16 \[4, 64\].*got torch.float32 \[4, 63\]"):
        deep_gemm.fp8_fp4_mqa_logits((packed, sf), kv, w[:, :63], ks, ke)
    with pytest.raises(ValueError, match=r"kv\[1\] \(FP4 scale words\) must be int32 \[16\]"):
        deep_gemm.fp8_fp4_mqa_logits((q, None), (packed[0, :16], torch.rand(16)), w, ks, ke)
    with pytest.raises(ValueError, match=r"kv\[0\] \(FP4 codes\) must be uint8 or int8, got torch.float8_e4m3fn"):
        deep_gemm.fp8_fp4_mqa_logits((q, None), (kv[0], torch.zeros(16, dtype=torch.int32)), w, ks, ke)
    with pytest.raises(ValueError, match="a tuple of 3"):
        deep_gemm.fp8_fp4_mqa_logits((q, None, None), kv, w, ks, ke)
    # well-formed FP4 inputs pass the fold (on CPU) and reach the kernel's own validation (needs CUDA tensors)
    k4 = quant.per_token_cast_to_fp4(torch.randn(16, 128))
    q4 = quant.per_token_cast_to_fp4(torch.randn(4, 64, 128))
    for qq, kk in (((q4[0].view(torch.int8), q4[1]), (k4[0].view(torch.int8), k4[1])), (q4, kv), ((q, None), k4)):
        with pytest.raises((ValueError, RuntimeError), match="CUDA|cuda"):
            deep_gemm.fp8_fp4_mqa_logits(qq, kk, w, ks, ke)


def test_fp4_paged_inputs_are_accepted_and_validated():
    # FP4 q and the FP4 cache (D / 2 + 4 bytes per token), in every combination with the FP8 forms, pass the
    # Python checks and reach the op's own validation (which needs CUDA tensors); malformed ones are clear errors
    q8 = _fp8(2, 1, 64, 128)
    q4 = quant.per_token_cast_to_fp4(torch.randn(2, 1, 64, 128))
    caches = (torch.zeros(4, 64, 1, 128 + 4, dtype=torch.uint8), torch.zeros(4, 64, 1, 64 + 4, dtype=torch.uint8))
    args = (torch.rand(2, 64), torch.ones(2, 1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
            torch.zeros(133, 2, dtype=torch.int32), 64)
    for q in ((q8, None), q8, q4, (q4[0].view(torch.int8), q4[1])):
        for cache in caches:
            for fn in (deep_gemm.fp8_fp4_paged_mqa_logits, deep_gemm.fp8_paged_mqa_logits):
                with pytest.raises(ValueError, match="CUDA|cuda"):
                    fn(q, cache, *args)
    with pytest.raises(ValueError, match=r"^deep_indexer.fp8_fp4_paged_mqa_logits: q\[1\] \(FP4 scale words\) must "
                                         r"be int32 \[2, 1, 64\].*got torch.int32 \[2, 1, 1\]"):
        deep_gemm.fp8_fp4_paged_mqa_logits((q4[0], q4[1][..., :1]), caches[1], *args)
    with pytest.raises(ValueError, match=r"^deep_indexer.fp8_paged_mqa_logits: q\[0\] \(FP4 codes\) must be uint8 or "
                                         r"int8, got torch.float8_e4m3fn"):
        deep_gemm.fp8_paged_mqa_logits((q8, q4[1]), caches[1], *args)
    with pytest.raises(ValueError, match=r"q has dtype torch.uint8 \(packed FP4\) but no scale words"):
        deep_gemm.fp8_fp4_paged_mqa_logits((q4[0], None), caches[1], *args)
    bad = torch.zeros(4, 64, 1, 100, dtype=torch.uint8)
    for q in ((q8, None), q4):
        with pytest.raises(ValueError, match=r"kv_cache rows must hold D \+ 4 = 132 bytes \(the FP8 cache\) or "
                                             r"D / 2 \+ 4 = 68 bytes \(the FP4 cache\) for D = 128.*got 100"):
            deep_gemm.fp8_fp4_paged_mqa_logits(q, bad, *args)


def test_fp8_inputs_reach_the_op_validation():
    # CPU tensors pass the FP8 checks and then fail in the op's own validation (needs CUDA tensors).
    q, kv = _fp8(4, 64, 128), (_fp8(16, 128), torch.rand(16))
    w = torch.rand(4, 64, dtype=torch.bfloat16)
    ks, ke = torch.zeros(4, dtype=torch.int32), torch.full((4,), 16, dtype=torch.int32)
    for call in (lambda: deep_gemm.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke),
                 lambda: deep_gemm.fp8_mqa_logits(q, kv, w, ks, ke, False)):
        with pytest.raises((ValueError, RuntimeError), match="CUDA|cuda"):
            call()


# ------------------------------------------------------------------------------------ SM count
def test_set_num_sms_validates_and_resets():
    try:
        with pytest.raises(ValueError, match="num_sms must be in"):
            deep_gemm.set_num_sms(-1)
        with pytest.raises(TypeError, match="must be an int"):
            deep_gemm.set_num_sms(3.0)
        if not torch.cuda.is_available():
            deep_gemm.set_num_sms(7)
            assert deep_gemm.get_num_sms() == 7 and _C.get_num_sms(-1) == 7
            deep_gemm.set_num_sms(0)
            with pytest.raises(RuntimeError, match="no CUDA device"):
                deep_gemm.get_num_sms()
        else:
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            assert deep_gemm.get_num_sms() == sms
            with pytest.raises(ValueError, match=f"in \\[1, {sms}\\]"):
                deep_gemm.set_num_sms(sms + 1)
            deep_gemm.set_num_sms(sms - 2)
            assert deep_gemm.get_num_sms() == sms - 2
            deep_gemm.set_num_sms(0)
            assert deep_gemm.get_num_sms() == sms
    finally:
        _C.set_num_sms(0, -1)


# ------------------------------------------------------------------------------------ install()
@pytest.fixture
def clean_deep_gemm_module(monkeypatch):
    """Runs the test with no `deep_gemm` in sys.modules and restores the previous state after."""
    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    yield
    sys.modules.pop("deep_gemm", None)


def test_install_without_deep_gemm_registers_a_stand_in(clean_deep_gemm_module):
    try:
        import deep_gemm as real  # noqa: F401
        pytest.skip("a real deep_gemm is importable here")
    except ModuleNotFoundError:
        pass
    mod = deep_gemm.install()
    assert sys.modules["deep_gemm"] is mod and mod.__deep_indexer__
    import importlib.util

    assert importlib.util.find_spec("deep_gemm") is not None  # engines probe with find_spec
    from deep_gemm import fp8_fp4_mqa_logits, get_paged_mqa_logits_metadata  # noqa: F401

    assert fp8_fp4_mqa_logits is deep_gemm.fp8_fp4_mqa_logits
    assert sorted(n for n in vars(mod) if not n.startswith("_")) == sorted(deep_gemm.__all__)
    assert getattr(mod, "fp8_gemm_nt", None) is None  # how engines probe for optional symbols
    with pytest.raises(AttributeError, match="stand-in.*'fp8_gemm_nt' needs DeepGEMM"):
        mod.fp8_gemm_nt
    assert deep_gemm.install() is mod  # idempotent
    deep_gemm.uninstall()
    assert "deep_gemm" not in sys.modules


def test_install_patches_only_the_indexer_names_of_a_real_deep_gemm(clean_deep_gemm_module, tmp_path, monkeypatch):
    pkg = tmp_path / "deep_gemm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "calls = []\n"
        "def fp8_gemm_nt(*a): return 'gemm'\n"
        "def fp8_mqa_logits(*a): return 'dg'\n"
        "def fp8_fp4_mqa_logits(*a): return 'dg'\n"
        "def get_paged_mqa_logits_metadata(*a): return 'dg'\n"
        "def set_num_sms(n): calls.append(n)\n"
        "def get_num_sms(): return calls[-1] if calls else 132\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = deep_gemm.install()
    import deep_gemm as imported

    assert imported is mod and not getattr(mod, "__deep_indexer__", False)
    assert mod.fp8_gemm_nt() == "gemm"  # GEMMs untouched
    for name in ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "fp8_mqa_logits", "fp8_paged_mqa_logits",
                 "get_paged_mqa_logits_metadata"):
        assert getattr(mod, name) is getattr(deep_gemm, name), name
    # set_num_sms sets both libraries' count (validated by deep_indexer against the device when one exists)
    n = 5
    try:
        mod.set_num_sms(n)
        assert mod.calls == [n] and _C.get_num_sms(-1) == n and mod.get_num_sms() == n
    finally:
        _C.set_num_sms(0, -1)
    assert deep_gemm.install() is mod
    deep_gemm.uninstall()
    assert mod.fp8_mqa_logits() == "dg" and mod.get_paged_mqa_logits_metadata() == "dg"
    assert not hasattr(mod, "fp8_fp4_paged_mqa_logits")  # DeepGEMM did not have it: removed again
    mod.set_num_sms(9)
    assert mod.calls[-1] == 9 and _C.get_num_sms(-1) == 0  # DeepGEMM's own set_num_sms again


def test_install_in_a_fresh_process():
    code = ("import deep_indexer.deep_gemm as dg; dg.install(); import deep_gemm; "
            "from deep_gemm import fp8_fp4_paged_mqa_logits as f; print(f.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "deep_indexer.deep_gemm"  # a real DeepGEMM may print first


def test_env_switch(tmp_path):
    site_dir = str(tmp_path)
    r = subprocess.run([sys.executable, "-m", "deep_indexer", "deep-gemm", "enable", "--site-dir", site_dir],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wrote" in r.stdout, r.stderr
    probe = (f"import site, sys; site.addsitedir({site_dir!r}); m = sys.modules.get('deep_gemm'); "
             "print(getattr(m, 'fp8_fp4_mqa_logits', None).__module__ if m else None, 'torch' in sys.modules)")
    import os

    on = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, DI_DEEP_GEMM="1"), capture_output=True,
                        text=True, timeout=120)
    assert on.stdout.strip().splitlines()[-1].split() == ["deep_indexer.deep_gemm", "True"], on.stderr
    env = {k: v for k, v in os.environ.items() if k != "DI_DEEP_GEMM"}
    off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert off.stdout.split() == ["None", "False"], off.stderr  # without the variable: nothing imported
    r = subprocess.run([sys.executable, "-m", "deep_indexer", "deep-gemm", "disable", "--site-dir", site_dir],
                       capture_output=True, text=True, timeout=120)
    assert "removed" in r.stdout and not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------ GPU
DEV = "cuda"


def _prefill(S, SKV, H, D, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(S, H, D, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn)
    kv = quant.per_token_cast_to_fp8(torch.randn(SKV, D, device=DEV, generator=g))
    w = torch.randn(S, H, device=DEV, generator=g)
    ks = torch.randint(-SKV // 4, SKV, (S,), device=DEV, generator=g).to(torch.int32)
    ke = (ks + torch.randint(-SKV // 8, SKV, (S,), device=DEV, generator=g)).to(torch.int32)
    return q, kv, w, ks, ke


def _paged(B, next_n, H, D, block_kv, seed, max_len=900):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len, (B,), generator=g)
    lens[0] = 0
    keys = [torch.randn(int(n), D, generator=g).to(DEV) for n in lens]
    cache, table, ctx = quant.pack_paged_kv_cache(keys, block_kv, generator=g)
    q = (torch.randn(B, next_n, H, D, generator=g) * 2).to(DEV).to(torch.float8_e4m3fn)
    w = torch.randn(B * next_n, H, generator=g).to(DEV)
    # the engines' form: 2-D context lengths [B, next_n], row i of the window sees j < ctx - next_n + i + 1
    ctx2 = (ctx[:, None] - next_n + 1 + torch.arange(next_n, device=DEV)[None]).clamp(min=0).to(torch.int32)
    return q, cache, w, ctx2.contiguous(), table, int(lens.max()) + 3


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,D", [(32, 64), (64, 128)])
def test_gpu_prefill_deep_gemm_call(wdtype, H, D):
    q, kv, w, ks, ke = _prefill(203, 1777, H, D, seed=H + D)
    w = w.to(wdtype)
    ref = reference.mqa_logits(q, kv, w.float(), ks, ke, True)
    got = deep_gemm.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, clean_logits=True, max_seqlen_k=0,
                                       logits_dtype=torch.float32)
    assert_logits_match(got, ref, True, torch.float32, f"weights {wdtype}")
    got = deep_gemm.fp8_mqa_logits(q, kv, w, ks, ke, False)  # the older name, positional
    assert_logits_match(got, ref, False, torch.float32, "fp8_mqa_logits")


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("next_n", [1, 2])
def test_gpu_decode_deep_gemm_call(wdtype, next_n):
    q, cache, w, ctx, table, max_ctx = _paged(37, next_n, 64, 128, 64, seed=next_n)
    w = w.to(wdtype)
    ref = reference.paged_mqa_logits(q, cache, w.float(), ctx, table, max_ctx)
    meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, 64, deep_gemm.get_num_sms())
    got = deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, max_ctx, clean_logits=True,
                                             logits_dtype=torch.float32)
    assert_logits_match(got, ref, True, torch.float32, f"weights {wdtype}")
    got = deep_gemm.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, False)
    assert_logits_match(got, ref, False, torch.float32, "fp8_paged_mqa_logits")


@requires_sm90
@pytest.mark.gpu
def test_gpu_set_num_sms_caps_the_grids():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        deep_gemm.set_num_sms(7)
        q, cache, w, ctx, table, max_ctx = _paged(29, 1, 64, 128, 64, seed=5)
        meta = di.get_paged_mqa_logits_metadata(ctx, 64)  # default num_sms: the cap
        assert meta.shape == (8, 2)
        got = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, True)
        assert_logits_match(got, reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx), True, F32, "decode")
        q, kv, w, ks, ke = _prefill(1100, 3000, 64, 128, seed=9)  # more q blocks than 7 SMs
        got = di.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, True)
        assert_logits_match(got, reference.mqa_logits(q, kv, w, ks, ke), True, F32, "prefill")
    finally:
        deep_gemm.set_num_sms(0)
    assert deep_gemm.get_num_sms() == sms


@requires_sm90
@pytest.mark.gpu
def test_gpu_bf16_weights_under_cuda_graph():
    q, kv, w, ks, ke = _prefill(64, 900, 64, 128, seed=3)
    w16 = w.to(torch.bfloat16)
    out = torch.full((64, 900), float("nan"), device=DEV)
    deep_gemm.fp8_fp4_mqa_logits((q, None), kv, w16, ks, ke, True, out=out)  # warm-up (loads the kernel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        deep_gemm.fp8_fp4_mqa_logits((q, None), kv, w16, ks, ke, True, out=out)
    w16.copy_(torch.randn_like(w).to(torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_logits_match(out, reference.mqa_logits(q, kv, w16.float(), ks, ke), True, F32, "graph replay")


@requires_sm90
@pytest.mark.gpu
def test_gpu_deep_gemm_names_under_torch_compile():
    q, cache, w, ctx, table, max_ctx = _paged(19, 2, 64, 128, 64, seed=11)
    w16 = w.to(torch.bfloat16)

    def step(q, cache, w, ctx, table):
        meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, 64, 132)
        return deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, max_ctx, True)

    eager = step(q, cache, w16, ctx, table)
    compiled = torch.compile(step, fullgraph=True)(q, cache, w16, ctx, table)
    assert torch.equal(compiled, eager)
    assert_logits_match(eager, reference.paged_mqa_logits(q, cache, w16.float(), ctx, table, max_ctx), True, F32)
