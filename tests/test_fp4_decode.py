"""FP4 decode inputs: q as (q_fp4, q_sf) and the FP4 paged cache (DeepGEMM's formats, docs/fp4.md), in every
combination with the FP8 forms. CPU: the reference on all four forms, the ops' argument checks and messages,
the fake (meta) implementations, the bench's FP4 rows. GPU (SM90, at the end): the decode kernel on FP4
inputs against the reference on the dequantized inputs (fp64), and everything around it (varlen, CUDA
graphs, torch.compile, the fused top-k, DeepGEMM's names)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import assert_logits_match, calc_diff, naive_logits, requires_sm90

import deep_indexer as di
from deep_indexer import _signatures, bench, deep_gemm, quant, reference
from deep_indexer.torch_ops import padded_row_stride

FP8 = torch.float8_e4m3fn
OPS = torch.ops.deep_indexer
# form: (q in FP4, cache in FP4)
FORMS = {"fp8": (False, False), "fp4": (True, True), "fp8q-fp4kv": (False, True), "fp4q-fp8kv": (True, False)}
FP4_FORMS = [f for f, (q4, kv4) in FORMS.items() if q4 or kv4]


# ------------------------------------------------------------------------------------ inputs
def _keys(n: int, d: int, g: torch.Generator, device="cpu") -> torch.Tensor:
    """Keys with per-token magnitudes spread over a few binades and an outlier channel (groups' exponents differ)."""
    k = torch.randn(n, d, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    k[:, 5] *= 8
    return k.to(device)


def _q_float(shape, g: torch.Generator) -> torch.Tensor:
    q = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    q[..., 5] *= 8
    return q


def _q_input(qf: torch.Tensor, q_fp4: bool, as_tuple: bool = True, code_dtype=torch.uint8):
    """q as the ops take it: (codes, q_sf) for FP4; (q_fp8, None) or q_fp8 for FP8."""
    if q_fp4:
        codes, sf = quant.per_token_cast_to_fp4(qf)
        return codes.view(code_dtype), sf
    q8 = qf.clamp(-448, 448).to(FP8)
    return (q8, None) if as_tuple else q8


def _pack(keys, block_kv: int, kv_fp4: bool, **kw):
    return (quant.pack_paged_kv_cache_fp4 if kv_fp4 else quant.pack_paged_kv_cache)(keys, block_kv, **kw)


def _parts(q) -> list:
    """The tensors of a q form."""
    if isinstance(q, tuple):
        return [t for t in q if t is not None]
    return [q]


def _codes(q) -> torch.Tensor:
    return q[0] if isinstance(q, tuple) else q


def _sel(q, idx):
    """Rows idx (of the batch dimension) of a q form."""
    if isinstance(q, tuple):
        return q[0][idx], (None if q[1] is None else q[1][idx])
    return q[idx]


# ------------------------------------------------------------------------------------ the reference (CPU)
def _dequant_q(q) -> torch.Tensor:
    if isinstance(q, tuple) and q[1] is not None:
        return quant.fp4_to_float(*q, torch.float64)
    return _codes(q).double()


def _dequant_keys(k: torch.Tensor, kv_fp4: bool) -> torch.Tensor:
    """The values a paged cache holds for keys k (the caches quantize with these casts)."""
    if kv_fp4:
        return quant.fp4_to_float(*quant.per_token_cast_to_fp4(k), torch.float64)
    k8, scale = quant.per_token_cast_to_fp8(k)
    return k8.double() * scale.double()[:, None]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("ctx2d", [False, True])
def test_reference_decode_every_form(form, ctx2d):
    """reference.paged_mqa_logits on FP8 or FP4 q with the FP8 or FP4 cache = the fp64 logits of the
    dequantized values (the cache layout told apart by its row bytes)."""
    q_fp4, kv_fp4 = FORMS[form]
    g = torch.Generator().manual_seed(len(form) + 10 * ctx2d)
    b_sz, next_n, h, d, bkv = 3, 2, 8, 128, 32
    lens = [45, 1, 70]
    keys = [_keys(n, d, g) for n in lens]
    cache, table, ctx = _pack(keys, bkv, kv_fp4, num_blocks=9, generator=g)
    assert cache.shape[-1] == (d // 2 if kv_fp4 else d) + 4
    q = _q_input(_q_float((b_sz, next_n, h, d), g), q_fp4, as_tuple=ctx2d)
    w = torch.randn(b_sz * next_n, h, generator=g)
    context = torch.stack([ctx - 3, ctx], 1).clamp_min(0).to(torch.int32) if ctx2d else ctx
    mcl = 75
    out = reference.paged_mqa_logits(q, cache, w, context, table, mcl, accum_dtype=torch.float64)
    qd = _dequant_q(q)
    for b in range(b_sz):
        kd = _dequant_keys(keys[b], kv_fp4)
        for i in range(next_n):
            end = int(context[b, i]) if ctx2d else int(ctx[b]) - next_n + 1 + i
            r = b * next_n + i
            exp = naive_logits(qd[b, i:i + 1], kd, w[r:r + 1], [(0, max(end, 0))], mcl)[0]
            assert torch.equal(torch.isinf(out[r]), torch.isinf(exp)), (b, i)
            fin = torch.isfinite(exp)
            assert fin.any() or end <= 0
            torch.testing.assert_close(out[r][fin].double(), exp[fin], rtol=1e-6, atol=1e-5)


def test_reference_decode_q_spellings_agree():
    """q, (q, None); uint8 / int8 codes: the same logits. FP4 q with the FP8 cache and FP8 q with the FP4 cache
    of the same keys differ from the all-FP8 logits only by the quantization."""
    g = torch.Generator().manual_seed(3)
    keys = [_keys(n, 64, g) for n in (30, 65)]
    qf = _q_float((2, 1, 16, 64), g)
    w = torch.randn(2, 16, generator=g)
    c8, table, ctx = quant.pack_paged_kv_cache(keys, 32, shuffle=False)
    c4, table4, _ = quant.pack_paged_kv_cache_fp4(keys, 32, shuffle=False)
    assert torch.equal(table[0, :1], table4[0, :1]) and torch.equal(table[1], table4[1])  # (the blocks in use)
    q8 = _q_input(qf, False, as_tuple=False)
    q4 = _q_input(qf, True)
    base = reference.paged_mqa_logits(q8, c8, w, ctx, table, 70)
    assert torch.equal(reference.paged_mqa_logits((q8, None), c8, w, ctx, table, 70), base)
    fp4 = reference.paged_mqa_logits(q4, c4, w, ctx, table, 70)
    assert torch.equal(reference.paged_mqa_logits((q4[0].view(torch.int8), q4[1]), c4, w, ctx, table, 70), fp4)
    for got in (fp4, reference.paged_mqa_logits(q4, c8, w, ctx, table, 70),
                reference.paged_mqa_logits(q8, c4, w, ctx, table, 70)):
        assert torch.equal(got.isinf(), base.isinf())
        fin = base.isfinite()
        assert 0 < calc_diff(got[fin], base[fin]) < 0.05  # FP4 differs, but is the same computation


# ------------------------------------------------------------------------------------ the ops' checks (CPU)
def _args(B=2, next_n=1, H=64, D=128, row=None):
    """The decode arguments after q: kv_cache (FP4 rows unless `row`), weights, ..., max_context_len (CPU)."""
    return (torch.zeros(4, 64, 1, row or D // 2 + 4, dtype=torch.uint8), torch.randn(B * next_n, H),
            torch.full((B,), 100, dtype=torch.int32), torch.zeros(B, 2, dtype=torch.int32),
            torch.zeros(5, 2, dtype=torch.int32), 128)


CALLERS = {
    "fp8_paged_mqa_logits": lambda q, *a: di.fp8_paged_mqa_logits(q, *a),
    "fp8_paged_mqa_topk_indices": lambda q, *a: di.fp8_paged_mqa_topk_indices(q, *a, 16),
    "fp8_fp4_paged_mqa_logits": lambda q, *a: deep_gemm.fp8_fp4_paged_mqa_logits(q, *a),
}


@pytest.mark.parametrize("name", list(CALLERS))
def test_fp4_decode_inputs_are_validated(name):
    """Malformed FP4 q forms and caches of neither layout raise errors naming the op, the argument, what it
    expects and what it got."""
    fn, p = CALLERS[name], rf"^deep_indexer\.{name}: "
    q4 = quant.per_token_cast_to_fp4(torch.randn(2, 1, 64, 128))
    q8 = torch.randn(2, 1, 64, 128).to(FP8)
    args = _args()

    def bad(q, exc, pattern, a=args):
        with pytest.raises(exc, match=pattern):
            fn(q, *a)

    bad((q4[0].float(), q4[1]), ValueError, p + r"q\[0\] \(FP4 codes\) must be uint8 or int8, got torch.float32")
    bad((q4[0], q4[1].float()), ValueError, p + r"q\[1\] \(FP4 scale words\) must be int32 \[2, 1, 64\] "
                                                r"\(\[B, next_n, H\]: one ue8m0 exponent per 32 values, packed "
                                                r"little-endian\), got torch.float32 \[2, 1, 64\]")
    bad((q4[0], q4[1][..., :3]), ValueError, p + r"q\[1\] \(FP4 scale words\) must be int32 \[2, 1, 64\].*"
                                                 r"got torch.int32 \[2, 1, 3\]")
    bad((q4[0], q4[1][:1]), ValueError, p + r"q\[1\].*must be int32 \[2, 1, 64\].*got torch.int32 \[1, 1, 64\]")
    bad(quant.per_token_cast_to_fp4(torch.randn(2, 1, 64, 32)), ValueError,
        p + r"q\[0\] \(FP4 codes\) must be \[B, next_n, H, D / 2\] with D in 64/128 \(two e2m1 codes per byte\), "
            r"got shape \[2, 1, 64, 16\]")
    bad((q4[0][0], q4[1][0]), ValueError, p + r"q\[0\] \(FP4 codes\) must be \[B, next_n, H, D / 2\].*got shape "
                                             r"\[1, 64, 64\]")
    for packed in (q4[0], (q4[0], None), q4[0].view(torch.int8)):
        bad(packed, ValueError, p + r"q has dtype torch.u?int8 \(packed FP4\) but no scale words: pass q = "
                                    r"\(q_fp4 \[B, next_n, H, D / 2\], q_sf \[B, next_n, H\] int32\)")
    bad((q4[0], "sf"), TypeError, p + r"q must be two tensors \(codes, int32 scale words\), got str")
    bad(("q", None), TypeError, p + r"q\[0\] must be a torch.Tensor, got str")
    # a cache whose rows fit neither layout for q's D (FP8: D + 4, FP4: D / 2 + 4)
    for q, src in ((q4, "q_fp4"), (q8, "q"), ((q8, None), "q")):
        bad(q, ValueError, p + rf"kv_cache rows must hold D \+ 4 = 132 bytes \(the FP8 cache\) or D / 2 \+ 4 = 68 "
                               rf"bytes \(the FP4 cache\) for D = 128 \(from {src}\), got 100 \(kv_cache shape "
                               rf"\[4, 64, 1, 100\]\)", a=_args(row=100))
    # wrong Python types: the signature's check
    bad((q4[0], q4[1], None), _signatures.ArgumentTypeError,
        r"q must be a torch.Tensor, a tuple \(q, None\) or an FP4 tuple \(q_fp4, q_sf\), got a tuple of 3")
    bad(None, _signatures.ArgumentTypeError, r"q must be a torch.Tensor, a tuple \(q, None\) or an FP4 tuple")
    if torch.cuda.is_available():
        bad((q4[0], q4[1].cuda()), ValueError, p + r"q\[1\] must be on q\[0\]'s device cpu, got cuda")


@pytest.mark.parametrize("name", list(CALLERS))
def test_well_formed_fp4_decode_inputs_reach_the_op(name):
    """Every q form (FP8, (FP8, None), FP4 with uint8 / int8 / float4_e2m1fn_x2 codes) with either cache passes
    the Python checks and reaches the op's own validation, which then wants CUDA tensors."""
    q4 = quant.per_token_cast_to_fp4(torch.randn(2, 1, 64, 128))
    q8 = torch.randn(2, 1, 64, 128).to(FP8)
    forms = [q8, (q8, None), q4, (q4[0].view(torch.int8), q4[1])]
    if hasattr(torch, "float4_e2m1fn_x2"):
        forms.append((q4[0].view(torch.float4_e2m1fn_x2), q4[1]))
    for q in forms:
        for row in (132, 68):
            with pytest.raises(ValueError, match="CUDA|cuda"):
                CALLERS[name](q, *_args(row=row))


def test_torch_ops_take_q_sf_and_fake_layouts():
    """torch.ops.deep_indexer.fp8_paged_mqa_logits(_out) take q_sf (None: FP8 q) last; the fake
    implementations give the real layout for FP4 codes and either cache and reject a cache of neither layout."""
    for name in ("fp8_paged_mqa_logits", "fp8_paged_mqa_logits_out"):
        schema = str(getattr(OPS, name).default._schema)
        assert "Tensor? indices=None, Tensor? q_sf=None) ->" in schema, schema
    with FakeTensorMode():
        dev = "cuda"
        i32 = lambda *s: torch.empty(*s, dtype=torch.int32, device=dev)
        codes = torch.empty(3, 2, 64, 64, dtype=torch.uint8, device=dev)
        q8 = torch.empty(3, 2, 64, 128, dtype=FP8, device=dev)
        w, meta = torch.empty(6, 64, device=dev), i32(133, 2)
        for dtype in (torch.float32, torch.bfloat16):
            for q, sf in ((codes, i32(3, 2, 64)), (q8, None)):
                for row in (68, 132):
                    cache = torch.empty(10, 64, 1, row, dtype=torch.uint8, device=dev)
                    logits = OPS.fp8_paged_mqa_logits(q, cache, w, i32(3), i32(3, 4), meta, 999, False, dtype, None, sf)
                    assert logits.shape == (6, 999) and logits.dtype == dtype
                    assert logits.stride() == (padded_row_stride(999, dtype), 1)
                    out = torch.empty(6, 999, dtype=dtype, device=dev)
                    assert OPS.fp8_paged_mqa_logits_out(q, cache, w, i32(3), i32(3, 4), meta, 999, False, out, None,
                                                        sf) is None
        bad = torch.empty(10, 64, 1, 100, dtype=torch.uint8, device=dev)
        with pytest.raises(ValueError, match=r"kv_cache rows must hold D \+ 4 = 132 bytes.*got 100"):
            OPS.fp8_paged_mqa_logits(codes, bad, w, i32(3), i32(3, 4), meta, 999, False, torch.float32, None,
                                     i32(3, 2, 64))


def test_bench_fp4_decode_rows():
    """The bench's FP4 decode rows: listed by --help and in their groups; their inputs are valid FP4 with the FP8
    inputs' lengths and block table; GB/s counts D / 2 + 4 bytes per key and per q head; the roofline is the
    larger of bytes / copy rate and 2 * next_n * H * D FLOPs per key / fp8 GEMM rate."""
    help_ids = bench.shape_help().split()
    want = [f"D{i}-FP4" for i in range(1, 10)] + ["V1-FP4", "KF-D5:512-FP4", "KF-D5:1024-FP4", "KF-D1-FP4",
                                                    "KF-P2-FP4"]
    assert all(i in help_ids for i in want), [i for i in want if i not in help_ids]
    assert "decode_fp4" in bench.shape_help() and "fused_topk_fp4" in bench.shape_help()
    groups = bench.shape_groups()
    assert set(groups["decode_fp4"]) == set(bench.FP4_DECODE_SHAPES) | {i for i in bench.fused_topk_fp4_ids()
                                                                          if i.startswith("KF-D")}
    assert "KF-D5:512-FP4" in groups["decode_fp4"] and "KF-P2-FP4" in groups["fused_topk_fp4"]
    B, nn, H, D = 5, 2, 16, 128
    x4 = bench.decode_inputs(B, nn, 300, H, D, 64, "cpu", seed=3, fp4=True)
    x8 = bench.decode_inputs(B, nn, 300, H, D, 64, "cpu", seed=3)
    assert torch.equal(x4["context_lens"], x8["context_lens"]) and torch.equal(x4["block_table"], x8["block_table"])
    keys = int(x4["context_lens"].sum())
    assert x4["kv_cache"].shape[-1] == 68 and isinstance(x4["q"], tuple)
    assert x8["bytes"] - x4["bytes"] == keys * (132 - 68) + B * nn * H * (128 - 68)
    assert x4["flops"] == x8["flops"] == 2 * nn * H * D * keys
    ref = reference.paged_mqa_logits(x4["q"], x4["kv_cache"], x4["weights"], x4["context_lens"], x4["block_table"],
                                     x4["max_context_len"])
    assert not ref.isnan().any() and ref.isfinite().sum() > B * nn * 100
    assert bench.roofline_us(x4, {"copy_GBps": 1e6, "fp8_gemm_TFLOPS": 1.0}) == x4["flops"] / 1e6
    assert bench.roofline_us(x4, {"copy_GBps": 1.0, "fp8_gemm_TFLOPS": 1e6}) == x4["bytes"] / 1e3
    assert bench.roofline_us(x4, {}) is None
    v = bench.varlen_inputs(B, nn, 300, H, D, 64, "cpu", seed=3, fp4=True)
    assert v["q"][0].shape == (B * nn, 1, H, D // 2) and v["q"][1].shape == (B * nn, 1, H)
    # tools/ab.py tells decode specs (own ones too, with "-FP4") from prefill ones
    for spec, prefill in (("128:2:8192-FP4", False), ("128:2:8192", False), ("D3-FP4", False),
                          ("4096:32768:causal", True), ("P2", True), ("4096:16384:cp:32:64", True)):
        assert bench.is_prefill_shape(spec) == prefill, spec


# ------------------------------------------------------------------------------------ GPU (SM90)
DEV = "cuda"
F32, BF16 = torch.float32, torch.bfloat16


def make_decode(B, next_n, H, D, block_kv, form, seed=0, max_len=1500, two_d=False, zero_some=True, stride_pad=0,
                num_blocks=None, code_dtype=torch.uint8):
    """Decode inputs of `form` on the GPU: (q as the ops take it, kv_cache, weights, context_lens, block_table,
    max_context_len). A zero-length sequence and one shorter than next_n when B > 2; FP8 q as (q, None) for odd
    seeds, else a plain tensor."""
    q_fp4, kv_fp4 = FORMS[form]
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len, (B,), generator=g)
    if zero_some and B > 2:
        lens[1] = 0
        lens[2] = min(next_n - 1, max_len)
    keys = [_keys(int(n), D, g, DEV) for n in lens]
    width = (D // 2 if kv_fp4 else D) + 4
    nb = num_blocks or int(sum((lens + block_kv - 1) // block_kv)) + 3
    cache, table, ctx = _pack(keys, block_kv, kv_fp4, block_stride=block_kv * width + stride_pad, generator=g,
                              num_blocks=nb)
    q = _q_input(_q_float((B, next_n, H, D), g).to(DEV), q_fp4, as_tuple=seed % 2 == 1, code_dtype=code_dtype)
    w = torch.randn(B * next_n, H, generator=g).to(DEV)
    if two_d:  # per-row lengths, each row seeing a different (random) prefix
        ctx = (ctx[:, None] - torch.randint(0, 3, (B, next_n), generator=g).to(DEV)).clamp(min=0).to(torch.int32)
    return q, cache, w, ctx.contiguous(), table, int(lens.max()) + 5


def make_varlen(runs, H, D, block_kv, form, seed=0, max_len=900, causal=True, zero_rows=()):
    """A varlen batch (indices) of `form`: `runs` rows per request, only each run's first block-table row real."""
    q_fp4, kv_fp4 = FORMS[form]
    g = torch.Generator().manual_seed(seed)
    R = sum(runs)
    lens = [int(torch.randint(max(n, 1), max_len, (1,), generator=g)) for n in runs]
    keys = [_keys(L, D, g, DEV) for L in lens]
    cache, req_table, _ = _pack(keys, block_kv, kv_fp4, generator=g,
                                num_blocks=sum((L + block_kv - 1) // block_kv for L in lens) + 5)
    table = torch.randint(-2**31, 2**31 - 1, (R, req_table.shape[1]), generator=g, dtype=torch.int32).to(DEV)
    ids, ctx, r = [], [], 0
    for i, (n, L) in enumerate(zip(runs, lens)):
        table[r] = req_table[i]
        ids += [7 * i - 2**30] * n  # neighbouring runs differ
        ctx += [L - n + 1 + j if causal else int(torch.randint(0, L + 1, (1,), generator=g)) for j in range(n)]
        r += n
    ctx = torch.tensor(ctx, dtype=torch.int32)
    for z in zero_rows:
        ctx[z] = 0
    q = _q_input(_q_float((R, 1, H, D), g).to(DEV), q_fp4)
    w = torch.randn(R, H, generator=g).to(DEV)
    return q, cache, w, ctx.to(DEV), table, torch.tensor(ids, dtype=torch.int32, device=DEV), max(lens) + 3


def _ref(q, cache, w, ctx, table, max_ctx, indices=None):
    """The reference logits of the dequantized inputs, accumulated in float64."""
    return reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx, accum_dtype=torch.float64, indices=indices)


def _poisoned(rows, cols, dtype, pad=0):
    return torch.full((rows, cols + pad), float("nan"), dtype=dtype, device=DEV)[:, :cols]


def run_decode(q, cache, w, ctx, table, max_ctx, clean, dtype, num_sms=None, pad=0, indices=None):
    """Metadata and logits into a NaN-filled `out` (row stride padded by `pad`, the padding checked untouched)."""
    meta = di.get_paged_mqa_logits_metadata(ctx, cache.shape[1], num_sms, indices=indices)
    rows = _codes(q).shape[0] * _codes(q).shape[1]
    out = _poisoned(rows, max_ctx, dtype, pad)
    got = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, clean, logits_dtype=dtype, indices=indices,
                                  out=out)
    assert got.data_ptr() == out.data_ptr()
    if pad and rows:
        assert torch.isnan(out.as_strided((rows, pad), (out.stride(0), 1), max_ctx).float()).all()
    return got


def check(got, ref, clean, dtype, what=""):
    """conftest's match (finite where the reference is, -inf masks with clean), and for float32 logits a relative
    diff below 1e-6 against the fp64 reference."""
    assert_logits_match(got, ref, clean, dtype, what)
    if dtype == F32:
        valid = torch.isfinite(ref).to(got.device)
        d = calc_diff(got[valid], ref.to(got.device)[valid])
        assert d < 1e-6, f"{what}: relative diff {d:.3g}"


HD = [(h, d) for h in (16, 32, 64, 128) for d in (64, 128)]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("H,D", HD)
def test_gpu_decode_fp4_configs(form, H, D):
    """Every head count and dim per form; next_n 1..8, block_kv 32 / 64 and [B] / [B, next_n] lengths rotate over
    the (H, D) pairs so that per form each next_n runs twice, with both block sizes and both length forms.
    Ragged lengths with a zero-length sequence and one shorter than next_n, block strides with padding, uint8
    and int8 codes; float32 (clean or not) and bf16 logits."""
    i = HD.index((H, D))
    for j, next_n in enumerate((1 + i, 1 + (i + 4) % 8)):
        block_kv = (32, 64)[(i + j) % 2]
        two_d = (i // 2 + j) % 2 == 1
        seed = 1000 * i + 100 * j + len(form)
        q, cache, w, ctx, table, max_ctx = make_decode(7, next_n, H, D, block_kv, form, seed=seed, two_d=two_d,
                                                       stride_pad=16 * (seed % 3),
                                                       code_dtype=(torch.uint8, torch.int8)[j])
        ref = _ref(q, cache, w, ctx, table, max_ctx)
        for dtype, clean in ((F32, False), (F32, True), (BF16, True)):
            got = run_decode(q, cache, w, ctx, table, max_ctx, clean, dtype, pad=3 if clean else 0)
            check(got, ref, clean, dtype, f"{form} next_n={next_n} H={H} D={D} block={block_kv} 2d={two_d}")


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("next_n,D", [(5, 64), (5, 128), (8, 64), (8, 128)])
def test_gpu_decode_fp4_forced_split_relu(form, next_n, D, monkeypatch):
    """The tensor-core linear half of relu forced (DI_PAGED_SPLIT_RELU=1) at H = 16 and next_n 5 / 8, where the
    pieces' columns leave the head weights in shared memory; 4 SMs, so that CTAs switch sequences."""
    monkeypatch.setenv("DI_PAGED_SPLIT_RELU", "1")
    q, cache, w, ctx, table, max_ctx = make_decode(9, next_n, 16, D, 64, form, seed=next_n * 10 + D + len(form))
    ref = _ref(q, cache, w, ctx, table, max_ctx)
    got = run_decode(q, cache, w, ctx, table, max_ctx, True, F32, num_sms=4)
    check(got, ref, True, F32, f"{form} next_n={next_n} D={D} split relu forced")


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("H,D,block_kv", [(64, 128, 64), (32, 64, 32)])
def test_gpu_decode_fp4_varlen(form, H, D, block_kv):
    runs = [1, 3, 2, 7, 1, 1, 4, 2, 5, 1, 40]
    R = sum(runs)
    for two_d in (False, True):
        q, cache, w, ctx, table, ids, max_ctx = make_varlen(runs, H, D, block_kv, form, seed=H + D + two_d,
                                                            causal=not two_d, zero_rows=[0, R // 2, R - 1])
        if two_d:
            ctx = ctx[:, None].contiguous()
        ref = _ref(q, cache, w, ctx, table, max_ctx, indices=ids)
        for dtype, clean, sms in ((F32, True, None), (F32, False, 3), (BF16, True, 1)):
            got = run_decode(q, cache, w, ctx, table, max_ctx, clean, dtype, num_sms=sms, indices=ids)
            check(got, ref, clean, dtype, f"varlen {form} H={H} D={D} block={block_kv} 2d={two_d}")


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
def test_gpu_decode_fp4_batches(form):
    """One long sequence, few SMs, and a large batch of short ragged contexts (every row computed, a sample of
    the sequences compared). One SM walking many sequences hands the q staging buffer from the math warpgroups
    (the first sequence's q rows, next_n * H <= 128) to the q producer (the rest)."""
    for B, next_n, max_len, num_sms in ((1, 1, 40000, None), (33, 3, 3000, 1), (40, 2, 2000, 1), (64, 2, 9000, None)):
        q, cache, w, ctx, table, max_ctx = make_decode(B, next_n, 64, 128, 64, form, seed=B, max_len=max_len)
        got = run_decode(q, cache, w, ctx, table, max_ctx, True, F32, num_sms=num_sms)
        check(got, _ref(q, cache, w, ctx, table, max_ctx), True, F32, f"{form} B={B} next_n={next_n}")
    B, next_n = 2048, 2
    q, cache, w, ctx, table, max_ctx = make_decode(B, next_n, 32, 128, 32, form, seed=7, max_len=200, two_d=True)
    got = run_decode(q, cache, w, ctx, table, max_ctx, True, F32)
    seqs = sorted(set(range(0, B, 97)) | {1, 2, B - 1})
    idx = torch.tensor(seqs, device=DEV)
    rows = torch.tensor([b * next_n + i for b in seqs for i in range(next_n)], device=DEV)
    ref = _ref(_sel(q, idx), cache, w[rows], ctx[idx], table[idx], max_ctx)
    check(got[rows], ref, True, F32, f"{form} B={B}")


@requires_sm90
@pytest.mark.gpu
def test_gpu_decode_fp4_zero_lengths_and_empty_shapes():
    for form in FORMS:
        q, cache, w, ctx, table, _ = make_decode(5, 2, 64, 128, 64, form, seed=9)
        meta = di.get_paged_mqa_logits_metadata(ctx, 64)
        ctx.zero_()
        got = run_decode(q, cache, w, ctx, table, 77, True, F32)
        assert (got == float("-inf")).all(), form
        empty = _sel(q, torch.arange(0, device=DEV))
        out = di.fp8_paged_mqa_logits(empty, cache, w[:0], ctx[:0], table[:0], meta, 50, True)
        assert out.shape == (0, 50), form
        out = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, 0, True)
        assert out.shape == (10, 0), form


def _folded_q(q, w):
    """An FP4 q as the FP8 q of its folded values (quant.fp4_to_e4m3_folded) and the weights times each
    (row, head)'s 2^(base - 127) (exact: powers of two within float32's range here)."""
    vals, base, _ = quant.fp4_to_e4m3_folded(*q)
    scale = torch.pow(2.0, (base - 127).double()).reshape(w.shape)
    return vals, (w.double() * scale).float()


def _folded_cache(cache):
    """An FP4 paged cache as the FP8 cache of its folded values: per key the e4m3 values and 2^(base - 127) as
    its float32 scale (the same blocks, block table and lengths)."""
    k_bytes, s_bytes = quant._kv_cache_views(cache, fp4=True)
    nb, bkv, c = k_bytes.shape
    d = 2 * c
    vals, base, _ = quant.fp4_to_e4m3_folded(k_bytes, s_bytes.contiguous().view(torch.int32).squeeze(-1))
    scale = torch.pow(2.0, (base - 127).double()).float()
    out = torch.empty(nb, bkv * (d + 4), dtype=torch.uint8, device=cache.device)
    out[:, : bkv * d] = vals.view(torch.uint8).reshape(nb, bkv * d)
    out[:, bkv * d:] = scale.contiguous().view(torch.uint8).reshape(nb, bkv * 4)
    return out.view(nb, bkv, 1, d + 4)


def _folded_ref(form, q, cache, w, ctx, table, max_ctx):
    """The reference on the folded values of every FP4 operand (what the kernel computes with)."""
    q_fp4, kv_fp4 = FORMS[form]
    if q_fp4:
        q, w = _folded_q(q, w)
    if kv_fp4:
        cache = _folded_cache(cache)
    return _ref(q, cache, w, ctx, table, max_ctx)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", FP4_FORMS)
def test_gpu_decode_fp4_wide_exponent_spans(form):
    """Rows (a key, or one head of a query) whose groups' scales span more than 14 binades. The kernel folds each
    row into e4m3 relative to its largest group holding a nonzero code (quant.fp4_to_e4m3_folded): values of the
    groups more than ~14 binades below it are rounded to nearest e4m3 there, down to +-0, so the logits are those
    of the folded values, not of the dequantized ones. (per_token_cast_to_fp4 of real activations stays far
    inside the exact range.) Compared with the reference on the folded values; all-zero rows and groups give
    finite logits; and where the small groups fold to zero, the logits are exactly 0 while the dequantized
    values' are not."""
    q_fp4, kv_fp4 = FORMS[form]
    g = torch.Generator().manual_seed(len(form))
    B, next_n, H, D, bkv = 9, 2, 64, 128, 64

    def spread(x):  # each group at 2^-12 .. 2^24 (spans up to 36 binades), some groups and some rows zero
        groups = x.unflatten(-1, (D // 32, 32))
        e = torch.randint(-12, 25, (*groups.shape[:-1], 1), generator=g).double()
        keep = torch.rand(*groups.shape[:-1], 1, generator=g) > 0.1
        keep &= torch.rand(*x.shape[:-1], 1, 1, generator=g) > 0.05
        return (groups.double() * torch.pow(2.0, e) * keep).flatten(-2).float()

    lens = torch.randint(1, 700, (B,), generator=g)
    lens[0] = 0
    keys = [(spread(torch.randn(int(n), D, generator=g)) if kv_fp4 else torch.randn(int(n), D, generator=g)).to(DEV)
            for n in lens]
    cache, table, ctx = _pack(keys, bkv, kv_fp4, generator=g, num_blocks=int(sum((lens + bkv - 1) // bkv)) + 2)
    qf = torch.randn(B, next_n, H, D, generator=g)
    q = _q_input((spread(qf) if q_fp4 else qf * 2).to(DEV), q_fp4)
    w = torch.randn(B * next_n, H, generator=g).to(DEV)
    if q_fp4:
        assert not quant.fp4_to_e4m3_folded(*q)[2].all()  # some rows are beyond the exact span
    if kv_fp4:
        assert not quant.fp4_to_e4m3_folded(*quant.per_token_cast_to_fp4(torch.cat(keys)))[2].all()
    max_ctx = int(lens.max()) + 5
    ref = _folded_ref(form, q, cache, w, ctx, table, max_ctx)
    for dtype, clean in ((F32, True), (F32, False), (BF16, True)):
        got = run_decode(q, cache, w, ctx, table, max_ctx, clean, dtype)
        check(got, ref, clean, dtype, f"{form} wide spans")

    # The small group folds to zero: q (or the keys) has group 0 at ~2^14 and group 1 at ~2^-8 (20+ binades
    # apart), and the other side is zero on group 0's dims, so only the small group meets nonzero values.
    B, next_n = 4, 1
    big, small = torch.zeros(B, next_n, H, D), torch.zeros(B, next_n, H, D)
    big[..., :32] = torch.randn(B, next_n, H, 32, generator=g) * 2.0**14
    small[..., 32:64] = torch.randn(B, next_n, H, 32, generator=g) * 2.0**-8
    other = torch.zeros(B, next_n, H, D)
    other[..., 32:64] = torch.randn(B, next_n, H, 32, generator=g)
    lens = torch.randint(50, 300, (B,), generator=g)
    kbig = [torch.zeros(int(n), D) for n in lens]
    kother = [torch.zeros(int(n), D) for n in lens]
    for kb, ko in zip(kbig, kother):
        kb[:, :32] = torch.randn(kb.shape[0], 32, generator=g) * 2.0**14
        kb[:, 32:64] = torch.randn(kb.shape[0], 32, generator=g) * 2.0**-8
        ko[:, 32:64] = torch.randn(ko.shape[0], 32, generator=g)
    wide_q = q_fp4  # the FP4 q is the wide side; else (fp8q-fp4kv) the keys are
    qf, keys = (big + small, kother) if wide_q else (other * 2, kbig)
    cache, table, ctx = _pack([k.to(DEV) for k in keys], bkv, kv_fp4, generator=g)
    q = _q_input(qf.to(DEV), q_fp4)
    w = torch.randn(B * next_n, H, generator=g).to(DEV)
    max_ctx = int(lens.max()) + 3
    deq, fold = _ref(q, cache, w, ctx, table, max_ctx), _folded_ref(form, q, cache, w, ctx, table, max_ctx)
    valid = deq.isfinite()
    assert (deq[valid] != 0).float().mean() > 0.9 and (fold[valid] == 0).all()
    got = run_decode(q, cache, w, ctx, table, max_ctx, True, F32)
    check(got, fold, True, F32, f"{form} folded to zero")
    assert (got[valid.to(DEV)] == 0).all()


@requires_sm90
@pytest.mark.gpu
def test_gpu_decode_fp4_bitwise_reproducible():
    for form in FORMS:
        q, cache, w, ctx, table, max_ctx = make_decode(64, 2, 64, 128, 64, form, seed=4, max_len=8000)
        a = run_decode(q, cache, w, ctx, table, max_ctx, True, F32)
        b = run_decode(q, cache, w, ctx, table, max_ctx, True, F32)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), form


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
def test_gpu_decode_fp4_cuda_graph_replay(form):
    """Metadata, logits and logits -> top-k captured once, replayed with new q (codes and scale words), weights,
    lengths, block tables and cache contents."""
    B, next_n, H, D, block_kv, max_ctx, nb, k = 16, 2, 64, 128, 64, 4096, 1100, 256
    mk = lambda seed: make_decode(B, next_n, H, D, block_kv, form, seed=seed, max_len=max_ctx - 10, num_blocks=nb)
    q, cache, w, ctx, table, _ = mk(1)
    table_buf = torch.zeros(B, max_ctx // block_kv, dtype=torch.int32, device=DEV)
    table_buf[:, : table.shape[1]] = table
    out = torch.empty(B * next_n, max_ctx, device=DEV)
    meta = torch.empty(torch.cuda.get_device_properties(0).multi_processor_count + 1, 2, dtype=torch.int32, device=DEV)
    ws = di.topk_workspace(B * next_n, max_ctx, device=DEV)
    idx = torch.empty(B * next_n, k, dtype=torch.int32, device=DEV)

    def step():
        di.get_paged_mqa_logits_metadata(ctx, block_kv, out=meta)
        di.fp8_paged_mqa_logits(q, cache, w, ctx, table_buf, meta, max_ctx, True, out=out)
        di.fp8_paged_mqa_topk_indices(q, cache, w, ctx, table_buf, meta, max_ctx, k, workspace=ws, out=idx)

    step()  # warm-up (loads the kernels)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(2):
        q2, cache2, w2, ctx2, table2, _ = mk(100 + seed)
        for dst, src in zip(_parts(q), _parts(q2)):
            dst.copy_(src)
        cache.copy_(cache2), w.copy_(w2), ctx.copy_(ctx2)
        table_buf.zero_()
        table_buf[:, : table2.shape[1]] = table2
        out.fill_(float("nan"))
        idx.fill_(-7)
        graph.replay()
        check(out, _ref(q, cache, w, ctx, table_buf, max_ctx), True, F32, f"{form} replay {seed}")
        assert torch.equal(idx, di.topk_indices(out, k, context_lens=ctx, next_n=next_n)), f"{form} replay {seed}"


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", FP4_FORMS)
def test_gpu_decode_fp4_torch_compile(form):
    """A decode step on FP4 inputs under torch.compile(fullgraph=True) gives the eager results bit for bit."""
    q, cache, w, ctx, table, max_ctx = make_decode(19, 2, 64, 128, 64, form, seed=11)
    qa, qb = q if isinstance(q, tuple) else (q, None)

    def step(qa, qb, cache, w, ctx, table):
        meta = di.get_paged_mqa_logits_metadata(ctx, cache.shape[1])
        logits = di.fp8_paged_mqa_logits((qa, qb), cache, w, ctx, table, meta, max_ctx, True)
        return logits, di.topk_indices(logits, 64, context_lens=ctx, next_n=2)

    eager = step(qa, qb, cache, w, ctx, table)
    compiled = torch.compile(step, fullgraph=True)(qa, qb, cache, w, ctx, table)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    check(eager[0], _ref(q, cache, w, ctx, table, max_ctx), True, F32, form)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
def test_gpu_decode_fp4_topk_indices(form):
    """fp8_paged_mqa_topk_indices on FP4 inputs = topk_indices of fp8_paged_mqa_logits on the same inputs: the
    same indices and values, with every index mode, sorted or not, and varlen batches."""
    q, cache, w, ctx, table, max_ctx = make_decode(33, 2, 64, 128, 64, form, seed=5, max_len=5000, two_d=True)
    meta = di.get_paged_mqa_logits_metadata(ctx, 64)
    for dtype in (F32, BF16):
        logits = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, False, logits_dtype=dtype)
        for k, srt, mode in ((512, False, "relative"), (2048, True, "slot"), (100, False, "absolute")):
            slot = mode == "slot"
            want = di.topk_indices(logits, k, context_lens=ctx, next_n=2, sorted=srt, index_mode=mode,
                                   block_table=table if slot else None, block_size=64 if slot else None,
                                   return_values=True)
            got = di.fp8_paged_mqa_topk_indices(q, cache, w, ctx, table, meta, max_ctx, k, sorted=srt,
                                                index_mode=mode, return_values=True, logits_dtype=dtype)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (form, dtype, k, mode)
    check(di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, True), _ref(q, cache, w, ctx, table, max_ctx),
          True, F32, form)
    q, cache, w, ctx, table, ids, max_ctx = make_varlen([1, 3, 2, 7, 1], 64, 128, 64, form, seed=6)
    meta = di.get_paged_mqa_logits_metadata(ctx, 64, indices=ids)
    logits = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, False, indices=ids)
    want = di.topk_indices(logits, 256, context_lens=ctx, index_mode="slot", block_table=table, block_size=64,
                           indices=ids)
    got = di.fp8_paged_mqa_topk_indices(q, cache, w, ctx, table, meta, max_ctx, 256, index_mode="slot", indices=ids)
    assert torch.equal(got, want), f"varlen {form}"


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", FP4_FORMS)
def test_gpu_decode_fp4_deep_gemm_names(form):
    """DeepGEMM's decode entry points on FP4 inputs: int8 codes (DeepGEMM's cast), bf16 weights, its argument
    names (keywords) and order (positional), the older name, and varlen batches through `indices`."""
    q, cache, w, ctx, table, max_ctx = make_decode(37, 2, 64, 128, 64, form, seed=2, two_d=True)
    q = (q[0].view(torch.int8), q[1]) if FORMS[form][0] else (_codes(q), None)
    w16 = w.to(torch.bfloat16)
    ref = _ref(q, cache, w16.float(), ctx, table, max_ctx)
    meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, 64, deep_gemm.get_num_sms())
    got = deep_gemm.fp8_fp4_paged_mqa_logits(q=q, kv_cache=cache, weights=w16, context_lens=ctx, block_table=table,
                                             schedule_meta=meta, max_context_len=max_ctx, clean_logits=True,
                                             logits_dtype=torch.float32)
    check(got, ref, True, F32, f"{form} keywords")
    got = deep_gemm.fp8_fp4_paged_mqa_logits(q, cache, w16, ctx, table, meta, max_ctx, False, torch.bfloat16)
    check(got, ref, False, BF16, f"{form} positional")
    got = deep_gemm.fp8_paged_mqa_logits(q, cache, w16, ctx, table, meta, max_ctx, True)
    check(got, ref, True, F32, f"{form} older name")
    q, cache, w, ctx, table, ids, max_ctx = make_varlen([2, 1, 4], 64, 128, 64, form, seed=8)
    meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, 64, deep_gemm.get_num_sms(), ids)
    got = deep_gemm.fp8_fp4_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, True, torch.float32, ids)
    check(got, _ref(q, cache, w, ctx, table, max_ctx, indices=ids), True, F32, f"{form} varlen")


@requires_sm90
@pytest.mark.gpu
def test_gpu_decode_fp4_code_dtypes_are_the_same_bytes():
    q, cache, w, ctx, table, max_ctx = make_decode(9, 3, 32, 128, 32, "fp4", seed=3)
    want = run_decode(q, cache, w, ctx, table, max_ctx, True, F32)
    views = [torch.int8] + ([torch.float4_e2m1fn_x2] if hasattr(torch, "float4_e2m1fn_x2") else [])
    for dt in views:
        got = run_decode((q[0].view(dt), q[1]), cache, w, ctx, table, max_ctx, True, F32)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), dt


@requires_sm90
@pytest.mark.gpu
def test_gpu_decode_fp4_opcheck():
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    for form in FP4_FORMS:
        q, cache, w, ctx, table, max_ctx = make_decode(4, 2, 64, 128, 64, form, seed=1, zero_some=False)
        qa, qb = q if isinstance(q, tuple) else (q, None)
        meta = OPS.get_paged_mqa_logits_metadata(ctx, 64, None)
        torch.library.opcheck(OPS.fp8_paged_mqa_logits,
                              (qa, cache, w, ctx, table, meta, max_ctx, True, F32, None, qb), test_utils=utils)
        torch.library.opcheck(OPS.fp8_paged_mqa_logits_out,
                              (qa, cache, w, ctx, table, meta, max_ctx, True, torch.empty(8, max_ctx, device=DEV),
                               None, qb), test_utils=utils)
