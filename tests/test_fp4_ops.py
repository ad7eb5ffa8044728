"""FP4 prefill inputs in the logits ops: the fast fold (quant.fold_fp4_to_e4m3) against fp4_to_e4m3_folded,
the ops' FP4 argument handling and messages (CPU), then the SM90 kernels on FP4 inputs against the
reference on the dequantized inputs (GPU, at the end)."""
from __future__ import annotations

import inspect

import pytest
import torch

from conftest import assert_logits_match, calc_diff, requires_sm90

import deep_indexer as di
from deep_indexer import deep_gemm, ops, quant, reference

FP8 = torch.float8_e4m3fn


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _same_fold(codes, sf):
    vals, base, exact = quant.fp4_to_e4m3_folded(codes, sf)
    fv, fb = quant.fold_fp4_to_e4m3(codes, sf)
    assert fv.dtype == FP8 and fb.dtype == torch.int32 and fv.shape == vals.shape and fb.shape == base.shape
    assert torch.equal(_bits(fv), _bits(vals)), "fold values differ from fp4_to_e4m3_folded"
    assert torch.equal(fb, base)
    return fv, fb, exact


def _pack(code: torch.Tensor) -> torch.Tensor:
    return code[..., 0::2] | (code[..., 1::2] << 4)


def _sf(exps) -> torch.Tensor:
    e = torch.as_tensor(exps, dtype=torch.uint8)
    return e.view(torch.int32).squeeze(-1)


# ------------------------------------------------------------------------------------ the fold
@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_fold_matches_the_definition_on_cast_inputs(d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(33, 8, d, generator=g) * torch.exp(torch.randn(33, 8, 1, generator=g) * 6)
    x[..., :3] *= 40  # outlier channels
    x[0, 0] = 0  # an all-zero token
    x[1, 1, : d // 2] = 0  # zero groups next to nonzero ones
    codes, sf = quant.per_token_cast_to_fp4(x)
    _, _, exact = _same_fold(codes, sf)
    assert exact.all()
    _same_fold(codes.view(torch.int8), sf)  # int8 codes: the same bytes


def test_fold_matches_the_definition_on_random_bytes_and_extreme_exponents():
    """Any code byte and any exponent byte (0..255, the padding bytes included): spans far beyond 14
    exponents, exponents 0 / 255, groups of zero codes above and below the others."""
    g = torch.Generator().manual_seed(1)
    for d in (32, 64, 128):
        codes = torch.randint(0, 256, (3000, d // 2), generator=g, dtype=torch.uint8)
        sf = torch.randint(-(2**31), 2**31, (3000,), generator=g, dtype=torch.int32)
        codes[::7, : d // 4] &= 0x88  # some groups of only +-0 codes
        _, _, exact = _same_fold(codes, sf)
        assert exact.any() and (d == 32 or (~exact).any())  # one group per token (D = 32): always exact
        # narrow spans around chosen centres: mostly exact, some at the edge
        for centre in (1, 20, 127, 240, 254):
            e = (centre + torch.randint(-9, 10, (3000, 4), generator=g)).clamp(0, 255).to(torch.uint8)
            _same_fold(codes, e.view(torch.int32).squeeze(-1))
    for e0, e1 in ((0, 0), (255, 255), (0, 255), (255, 0), (254, 1), (1, 254), (140, 126), (140, 125)):
        code = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
        _same_fold(_pack(code), _sf([[e0, e1, 127, 127]]))


def test_fold_span_limits_and_rounding():
    """A token whose nonzero groups span more than 14 exponents: its small groups' values are rounded to
    nearest e4m3 relative to the base (what the kernel then computes with; documented)."""
    code = torch.tensor([1, 3, 9, 15, 7, 2, 4, 5] * 16, dtype=torch.uint8).view(1, 128)
    for span, want in ((14, True), (15, False), (20, False), (40, False)):
        vals, base, exact = _same_fold(_pack(code), _sf([[140, 140 - span, 135, 140]]))
        assert exact.item() == want and base.item() == 134
        deq = quant.fp4_to_float(_pack(code), _sf([[140, 140 - span, 135, 140]]), torch.float64)
        rel = deq * 2.0 ** (127 - base.item())  # the values relative to the base: e4m3-rounded by the fold
        assert torch.equal(vals.double(), rel.to(FP8).double())
        # the groups that fit stay exact
        keep = torch.ones(128, dtype=torch.bool)
        keep[32:64] = False
        assert torch.equal(vals.double()[0, keep], rel[0, keep])


def test_fold_table_and_exp2_int():
    t = quant._fold_table(torch.device("cpu"))
    assert t.dtype == torch.int16 and t.numel() == 37 * 256
    e = torch.arange(-22, 255, dtype=torch.int32)
    assert torch.equal(quant.exp2_int(e).double(), torch.pow(2.0, (e - 127).double()))


def test_fold_traces_without_graph_breaks():
    """Plain torch ops without host syncs: torch.compile(fullgraph=True) traces the fold."""
    codes, sf = quant.per_token_cast_to_fp4(torch.randn(6, 4, 64))
    want = quant.fold_fp4_to_e4m3(codes, sf)
    got = torch.compile(quant.fold_fp4_to_e4m3, backend="eager", fullgraph=True)(codes, sf)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(got[1], want[1])


def test_ops_fold_under_inductor_matches_eager():
    """torch.compile (inductor, fullgraph) of the ops' FP4 handling gives the eager bytes (integer ops, the
    table gather and the dtype views compile)."""
    q = quant.per_token_cast_to_fp4(torch.randn(6, 4, 64))
    k = quant.per_token_cast_to_fp4(torch.randn(50, 64))
    w = torch.randn(6, 4)
    want = ops._prefill_inputs("fp8_mqa_logits", q, k, w)
    fn = torch.compile(lambda a, b, kc, ksf, w: ops._prefill_inputs("fp8_mqa_logits", (a, b), (kc, ksf), w),
                       fullgraph=True)
    got = fn(*q, *k, w)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(_bits(got[1][0]), _bits(want[1][0]))
    assert torch.equal(got[1][1], want[1][1]) and torch.equal(got[2], want[2])


# ------------------------------------------------------------------------------------ the ops' fold path (CPU)
def _fp4_prefill(s_len=9, h=16, d=128, skv=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_len, h, d, generator=g) * torch.exp(torch.randn(s_len, h, 1, generator=g) * 2)
    k = torch.randn(skv, d, generator=g) * torch.exp(torch.randn(skv, 1, generator=g) * 2)
    q[..., 7] *= 25
    k[:, 7] *= 25
    w = torch.randn(s_len, h, generator=g)
    ks = torch.randint(-5, skv // 2, (s_len,), generator=g, dtype=torch.int32)
    ke = ks + torch.randint(-3, skv, (s_len,), generator=g, dtype=torch.int32)
    return q, k, w, ks, ke


def _is_fp4(x) -> bool:
    return isinstance(x, tuple) and x[1] is not None and x[1].dtype == torch.int32


def reference_logits(q, kv, w, ks, ke, **kw):
    """The reference logits of the dequantized inputs in any combination of FP4 and FP8 forms.

    Both FP4 (or both FP8): reference.mqa_logits as is. Mixed: the FP4 operand is first written exactly in
    the FP8 form by the definition quant.fp4_to_e4m3_folded (float64; its exact mask is asserted), its base
    going into k_scale or, for q, into the weights (float64, then float32: exact) -- the same logits as on
    its dequantized values (tests/test_fp4.py::test_fold_gives_the_fp4_logits_through_the_fp8_path)."""
    if isinstance(q, tuple) and q[1] is None:
        q = q[0]
    if _is_fp4(q) == _is_fp4(kv):
        return reference.mqa_logits(q, kv, w, ks, ke, **kw)
    if _is_fp4(q):
        vals, base, exact = quant.fp4_to_e4m3_folded(*q)
        assert exact.all()
        q, w = vals, (w.double() * torch.pow(2.0, (base - 127).double())).float()
    else:
        vals, base, exact = quant.fp4_to_e4m3_folded(*kv)
        assert exact.all()
        kv = (vals, torch.pow(2.0, (base - 127).double()).float())
    return reference.mqa_logits(q, kv, w, ks, ke, **kw)


@pytest.mark.parametrize("form", ["fp4-fp4", "fp4-fp8", "fp8-fp4"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_ops_fold_gives_the_fp4_logits_through_the_fp8_reference(form, wdtype):
    """What the ops hand the FP8 kernel: through the FP8 reference it gives the reference logits of the FP4
    (dequantized) inputs bit for bit, in every combination of FP4 and FP8 operands."""
    q, k, w, ks, ke = _fp4_prefill(seed=len(form))
    w = w.to(wdtype)
    q_in = quant.per_token_cast_to_fp4(q) if form.startswith("fp4") else (q.clamp(-448, 448).to(FP8), None)
    kv_in = quant.per_token_cast_to_fp4(k) if form.endswith("fp4") else quant.per_token_cast_to_fp8(k)
    q8, kv8, w8 = ops._prefill_inputs("fp8_mqa_logits", q_in, kv_in, w)
    assert q8.dtype == FP8 and kv8[0].dtype == FP8 and kv8[1].dtype == torch.float32
    assert w8.dtype == (torch.float32 if form.startswith("fp4") else wdtype)
    want = reference_logits(q_in, kv_in, w.float(), ks, ke)
    got = reference.mqa_logits(q8, kv8, w8.float(), ks, ke)
    assert torch.equal(got, want)


def test_ops_fp8_inputs_pass_through_untouched():
    q, k, w, ks, ke = _fp4_prefill()
    q8, kv = q.clamp(-448, 448).to(FP8), quant.per_token_cast_to_fp8(k)
    for q_in in (q8, (q8, None), [q8, None]):
        got = ops._prefill_inputs("fp8_mqa_logits", q_in, kv, w)
        assert got[0] is q8 and got[1] is kv and got[2] is w


def _bad(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_native_ops_validate_fp4_inputs():
    q, k, w, ks, ke = _fp4_prefill(s_len=4, h=16, d=64, skv=16)
    q4, k4 = quant.per_token_cast_to_fp4(q), quant.per_token_cast_to_fp4(k)
    for name, fn in (("fp8_mqa_logits", lambda q_, kv_, w_=w: di.fp8_mqa_logits(q_, kv_, w_, ks, ke)),
                     ("fp8_mqa_topk_indices", lambda q_, kv_, w_=w: di.fp8_mqa_topk_indices(q_, kv_, w_, ks, ke, 4))):
        p = rf"^deep_indexer\.{name}: "
        _bad(lambda: fn((q4[0].float(), q4[1]), k4), ValueError,
             p + r"q\[0\] \(FP4 codes\) must be uint8 or int8, got torch.float32")
        _bad(lambda: fn((q4[0], q4[1].float()), k4), ValueError,
             p + r"q\[1\] \(FP4 scale words\) must be int32 \[4, 16\] \(\[S, H\].*got torch.float32 \[4, 16\]")
        _bad(lambda: fn((q4[0], q4[1][:3]), k4), ValueError, p + r"q\[1\].*must be int32 \[4, 16\].*got torch.int32 \[3, 16\]")
        _bad(lambda: fn((q4[0][..., :24], q4[1]), k4), ValueError,
             p + r"q\[0\] \(FP4 codes\) must be \[S, H, D / 2\] with D in 32/64/128.*got shape \[4, 16, 24\]")
        _bad(lambda: fn((q4[0][0], q4[1][0]), k4), ValueError, p + r"q\[0\] \(FP4 codes\) must be \[S, H, D / 2\]")
        _bad(lambda: fn((q4[0], None), k4), ValueError, p + r"q has dtype torch.uint8 \(packed FP4\) but no scale words")
        _bad(lambda: fn(q4[0], k4), ValueError, p + r"q has dtype torch.uint8 \(packed FP4\) but no scale words")
        _bad(lambda: fn((q4[0], "sf"), k4), TypeError, p + r"q must be two tensors \(codes, int32 scale words\), got str")
        _bad(lambda: fn(q4, k4, w[:, :15]), ValueError,
             p + r"weights must be float32/bfloat16/float16 \[4, 16\] \(\[S, H\] of the FP4 q\), got torch.float32 \[4, 15\]")
        _bad(lambda: fn(q4, k4, w.int()), ValueError, p + r"weights must be float32/bfloat16/float16.*got torch.int32")
        _bad(lambda: fn(q4, (k4[0], k4[1][:5])), ValueError,
             p + r"kv\[1\] \(FP4 scale words\) must be int32 \[16\] \(\[SKV\].*got torch.int32 \[5\]")
        _bad(lambda: fn(q4, (k4[0][:, :20], k4[1])), ValueError,
             p + r"kv\[0\] \(FP4 codes\) must be \[SKV, D / 2\] with D in 32/64/128.*got shape \[16, 20\]")
        _bad(lambda: fn(q4, (k4[0].unsqueeze(0), k4[1])), ValueError, p + r"kv\[0\] \(FP4 codes\) must be \[SKV, D / 2\]")
        _bad(lambda: fn(q4, (k4[0].float(), k4[1])), ValueError, p + r"kv\[0\] \(FP4 codes\) must be uint8 or int8")
        if torch.cuda.is_available():
            _bad(lambda: fn((q4[0], q4[1].cuda()), k4), ValueError, p + r"q\[1\] must be on q\[0\]'s device cpu, got cuda")
        # well-formed FP4 (uint8 or int8 codes) reaches the kernel's own checks (CPU tensors: needs CUDA)
        for qq, kk in ((q4, k4), ((q4[0].view(torch.int8), q4[1]), (k4[0].view(torch.int8), k4[1]))):
            _bad(lambda: fn(qq, kk), (ValueError, RuntimeError), "CUDA|cuda")
    _bad(lambda: di.fp8_mqa_logits((q4[0], q4[1], None), k4, w, ks, ke), TypeError,
         r"q must be a torch.Tensor, a tuple \(q, None\) or an FP4 tuple \(q_fp4, q_sf\), got a tuple of 3")


def test_deep_gemm_prefill_signature_unchanged():
    params = [(p.name, p.default) for p in inspect.signature(deep_gemm.fp8_fp4_mqa_logits).parameters.values()]
    assert params == [("q", inspect.Parameter.empty), ("kv", inspect.Parameter.empty),
                      ("weights", inspect.Parameter.empty), ("cu_seq_len_k_start", inspect.Parameter.empty),
                      ("cu_seq_len_k_end", inspect.Parameter.empty), ("clean_logits", True), ("max_seqlen_k", 0),
                      ("logits_dtype", torch.float32), ("out", None)]
    # (FP4 decode inputs: tests/test_fp4_decode.py)


# ------------------------------------------------------------------------------------ GPU (SM90)
DEV = "cuda"


def make_fp4_prefill(S, SKV, H, D, pattern="random", seed=0, kv_fp8=False, q_fp8=False):
    """FP4 (or FP8, for the mixed forms) prefill inputs on the GPU: q, kv as the ops take them, weights, ks, ke.
    q and k span a wide range per token (and outlier channels), so that the groups' exponents differ."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(S, H, D, device=DEV, generator=g) * torch.exp(torch.randn(S, H, 1, device=DEV, generator=g))
    k = torch.randn(SKV, D, device=DEV, generator=g) * torch.exp(torch.randn(SKV, 1, device=DEV, generator=g))
    q[..., 5] *= 8
    k[:, 5] *= 8
    w = torch.randn(S, H, device=DEV, generator=g)
    q_in = (q.clamp(-448, 448).to(FP8), None) if q_fp8 else quant.per_token_cast_to_fp4(q)
    kv = quant.per_token_cast_to_fp8(k) if kv_fp8 else quant.per_token_cast_to_fp4(k)
    i = torch.arange(S, device=DEV)
    if pattern == "causal":
        ks, ke = torch.zeros_like(i), SKV - S + i + 1
    else:  # random, with empty rows, ks > ke, negative ks, ke > SKV
        ks = torch.randint(-SKV // 4, SKV, (S,), device=DEV, generator=g)
        ke = ks + torch.randint(-SKV // 8, SKV, (S,), device=DEV, generator=g)
        ks[:3], ke[:3] = 7, 7  # empty rows
    return q_in, kv, w, ks.to(torch.int32), ke.to(torch.int32)


_ref = reference_logits


def _poisoned(shape, dtype, pad=0):
    return torch.full((shape[0], shape[1] + pad), float("nan"), dtype=dtype, device=DEV)[:, : shape[1]]


FORMS = {"fp4-fp4": {}, "fp4q-fp8kv": {"kv_fp8": True}, "fp8q-fp4kv": {"q_fp8": True}}


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("H,D", [(h, d) for h in (16, 32, 64, 128) for d in (64, 128)] + [(64, 32)])
@pytest.mark.parametrize("dtype,clean", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_gpu_fp4_mqa_logits(form, H, D, dtype, clean):
    S, SKV = 77, 1299
    for pattern in ("random", "causal"):
        q, kv, w, ks, ke = make_fp4_prefill(S, SKV, H, D, pattern, seed=H * D + clean, **FORMS[form])
        ref = _ref(q, kv, w, ks, ke)
        out = _poisoned((S, SKV), dtype, pad=3)
        got = di.fp8_mqa_logits(q, kv, w, ks, ke, clean, logits_dtype=dtype, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert_logits_match(got, ref, clean, dtype, f"{form} H={H} D={D} {pattern}")
        dg = deep_gemm.fp8_fp4_mqa_logits(q, kv, w, ks, ke, clean, 0, dtype)  # DeepGEMM's positional call
        assert_logits_match(dg, ref, clean, dtype, f"deep_gemm {form} H={H} D={D} {pattern}")
        if clean:
            assert torch.equal(dg.float().isneginf(), got.float().isneginf())


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("H,D", [(32, 64), (64, 128)])
def test_gpu_fp4_mqa_logits_compressed(form, H, D):
    S, SKV = 77, 1299
    for M in (1, 100, 333):
        q, kv, w, _, _ = make_fp4_prefill(S, SKV, H, D, seed=M + H, **FORMS[form])
        g = torch.Generator(device=DEV).manual_seed(M)
        ks = torch.randint(-M // 2, SKV, (S,), device=DEV, generator=g)
        ke = ks + torch.randint(-M // 4, 2 * M + 2, (S,), device=DEV, generator=g)
        ks[:9], ke[:9] = 7, 7  # empty
        ks[-3:], ke[-3:] = -5, SKV + 10  # the whole key range (longer than M)
        ks, ke = ks.to(torch.int32), ke.to(torch.int32)
        ref = _ref(q, kv, w, ks, ke, max_seqlen_k=M)
        for dtype in (torch.float32, torch.bfloat16):
            for clean in (True, False):
                out = _poisoned((S, M), dtype, pad=5)
                di.fp8_mqa_logits(q, kv, w, ks, ke, clean, max_seqlen_k=M, logits_dtype=dtype, out=out)
                assert_logits_match(out, ref, clean, dtype, f"{form} H={H} D={D} M={M} clean={clean}")
                assert torch.isnan(out.as_strided((S, 5), (out.stride(0), 1), M).float()).all()
                got = deep_gemm.fp8_fp4_mqa_logits(q, kv, w, ks, ke, clean, M, dtype)
                assert_logits_match(got, ref, clean, dtype, f"deep_gemm {form} M={M}")


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_fp4_deep_gemm_weights_and_int8_codes(wdtype):
    # DeepGEMM's own cast returns int8 codes: the same bytes
    q, kv, w, ks, ke = make_fp4_prefill(203, 1777, 64, 128, seed=3)
    w = w.to(wdtype)
    ref = _ref(q, kv, w.float(), ks, ke)
    q8 = (q[0].view(torch.int8), q[1])
    kv8 = (kv[0].view(torch.int8), kv[1])
    got = deep_gemm.fp8_fp4_mqa_logits(q8, kv8, w, ks, ke, clean_logits=True, max_seqlen_k=0,
                                       logits_dtype=torch.float32)
    assert_logits_match(got, ref, True, torch.float32, f"weights {wdtype}")
    got = deep_gemm.fp8_mqa_logits(q8, kv8, w, ks, ke, False)  # the older name
    assert_logits_match(got, ref, False, torch.float32, "fp8_mqa_logits")


@requires_sm90
@pytest.mark.gpu
def test_gpu_fp4_deterministic_and_exact_fold():
    q, kv, w, ks, ke = make_fp4_prefill(512, 4096, 64, 128, "causal", seed=11)
    a = di.fp8_mqa_logits(q, kv, w, ks, ke)
    b = di.fp8_mqa_logits(q, kv, w, ks, ke)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    # the GPU fold is the CPU fold, bit for bit
    for codes, sf in (q, kv):
        gv, gb = quant.fold_fp4_to_e4m3(codes, sf)
        cv, cb = quant.fold_fp4_to_e4m3(codes.cpu(), sf.cpu())
        assert torch.equal(gv.view(torch.uint8).cpu(), cv.view(torch.uint8)) and torch.equal(gb.cpu(), cb)
    # and the FP8 kernel on the folded inputs gives the same logits bit for bit
    q8, kv8, w8 = ops._prefill_inputs("fp8_mqa_logits", q, kv, w)
    c = di.fp8_mqa_logits(q8, kv8, w8, ks, ke)
    assert torch.equal(a.view(torch.int32), c.view(torch.int32))


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_fp4_prefill_inputs_one_launch_is_the_torch_form(form, wdtype, fresh_seed):
    """On SM90 the ops fold their FP4 operands in one fp4_prefill_fold launch: (q, kv, weights) are the torch
    form's (fold_fp4_to_e4m3_torch, weights.float() * exp2_int(base), k_scale = exp2_int(base)) bit for bit,
    with uint8 or int8 codes; an FP8 operand passes through untouched."""
    q, kv, w, _, _ = make_fp4_prefill(300, 2000, 64, 128, seed=int(torch.randint(2**31, ())), **FORMS[form])
    w = w.to(wdtype)
    for codes_dtype in (torch.uint8, torch.int8):
        q_in = (q[0].view(codes_dtype), q[1]) if _is_fp4(q) else q
        kv_in = (kv[0].view(codes_dtype), kv[1]) if _is_fp4(kv) else kv
        q8, kv8, w8 = ops._prefill_inputs("fp8_mqa_logits", q_in, kv_in, w)
        if _is_fp4(q):
            tv, tb = quant.fold_fp4_to_e4m3_torch(*q)
            assert torch.equal(_bits(q8), _bits(tv)) and q8.shape == tv.shape
            assert torch.equal(w8, w.float() * quant.exp2_int(tb))
        else:
            assert q8 is q[0] and w8 is w
        if _is_fp4(kv):
            tv, tb = quant.fold_fp4_to_e4m3_torch(*kv)
            assert torch.equal(_bits(kv8[0]), _bits(tv)) and torch.equal(kv8[1], quant.exp2_int(tb))
        else:
            assert kv8 is kv_in


@requires_sm90
@pytest.mark.gpu
def test_gpu_fp4_empty_and_edge_ranges():
    q, kv, w, ks, ke = make_fp4_prefill(40, 500, 32, 64, seed=3)
    ks[:10], ke[:10] = 50, 40
    ks[10:20], ke[10:20] = -30, 10
    ks[20:30], ke[20:30] = 450, 10_000
    ks[30:], ke[30:] = 0, 0
    out = _poisoned((40, 500), torch.float32)
    di.fp8_mqa_logits(q, kv, w, ks, ke, True, out=out)
    assert_logits_match(out, _ref(q, kv, w, ks, ke), True, torch.float32)
    assert (out[:10] == float("-inf")).all() and (out[30:] == float("-inf")).all()
    q, kv, w, ks, ke = make_fp4_prefill(0, 100, 64, 128)
    assert di.fp8_mqa_logits(q, kv, w, ks, ke).shape == (0, 100)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_gpu_fp4_mqa_topk_indices(form, logits_dtype):
    """fp8_mqa_topk_indices on FP4 inputs = topk_indices of fp8_mqa_logits on the same FP4 inputs."""
    S, SKV, k = 300, 3000, 64
    q, kv, w, ks, ke = make_fp4_prefill(S, SKV, 64, 128, seed=7, **FORMS[form])
    logits = di.fp8_mqa_logits(q, kv, w, ks, ke, False, logits_dtype=logits_dtype)
    want = di.topk_indices(logits, k, ks, ke)
    for chunk_rows in (None, 64):
        got = di.fp8_mqa_topk_indices(q, kv, w, ks, ke, k, logits_dtype=logits_dtype, chunk_rows=chunk_rows)
        assert torch.equal(got, want), f"chunk_rows={chunk_rows}"
    # and the logits themselves match the reference
    assert_logits_match(di.fp8_mqa_logits(q, kv, w, ks, ke, True, logits_dtype=logits_dtype),
                        _ref(q, kv, w, ks, ke), True, logits_dtype, form)


@requires_sm90
@pytest.mark.gpu
def test_gpu_fp4_cuda_graph_replay_with_new_inputs():
    """The fold is plain torch ops without host syncs: the whole FP4 call captures in a CUDA graph."""
    S, SKV, H, D = 256, 4096, 64, 128
    q, kv, w, ks, ke = make_fp4_prefill(S, SKV, H, D, "causal", seed=2)
    out = torch.empty(S, SKV, device=DEV)
    di.fp8_mqa_logits(q, kv, w, ks, ke, True, out=out)  # warm-up: loads the kernel, builds the fold table
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        di.fp8_mqa_logits(q, kv, w, ks, ke, True, out=out)
    for seed in range(2):
        q2, kv2, w2, ks2, ke2 = make_fp4_prefill(S, SKV, H, D, "random", seed=50 + seed)
        for dst, src in zip((*q, *kv, w, ks, ke), (*q2, *kv2, w2, ks2, ke2)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        assert_logits_match(out, _ref(q, kv, w, ks, ke), True, torch.float32, f"replay {seed}")


@requires_sm90
@pytest.mark.gpu
def test_gpu_fp4_under_torch_compile():
    q, kv, w, ks, ke = make_fp4_prefill(130, 900, 64, 128, seed=5)
    eager = di.fp8_mqa_logits(q, kv, w, ks, ke, True)  # (also builds the fold table outside the trace)

    def step(q_fp4, q_sf, k_fp4, k_sf, w, ks, ke):
        return di.fp8_mqa_logits((q_fp4, q_sf), (k_fp4, k_sf), w, ks, ke, True)

    compiled = torch.compile(step, fullgraph=True)(*q, *kv, w, ks, ke)
    assert torch.equal(compiled, eager)
    assert calc_diff(eager[eager.isfinite()], _ref(q, kv, w, ks, ke).to(DEV)[eager.isfinite()]) < 1e-5
