"""GPU correctness suite (needs an SM90 GPU; skipped cleanly otherwise).

Every kernel is compared with deep_indexer.reference on the dequantized inputs: fp32 logits to a
relative diff < 1e-5, bf16 logits < 1e-3, -inf masks identical, outputs poisoned before the run.
"""
import pytest
import torch

from conftest import requires_sm90

pytestmark = [requires_sm90, pytest.mark.gpu]

import deep_indexer as di  # noqa: E402
from deep_indexer import reference  # noqa: E402

DEV = "cuda"


# ------------------------------------------------------------------------------------ clean_logits
def _random_ranges(groups: int, n: int, gen: torch.Generator):
    ks = torch.randint(-n // 4, n + 3, (groups,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(-n // 4, n + 3, (groups,), generator=gen, dtype=torch.int32)
    return ks, ke


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("with_ks", [True, False])
@pytest.mark.parametrize("m,n,pad", [(8, 1, 0), (12, 7, 1), (36, 131, 3), (64, 4099, 5), (24, 65536, 0)])
def test_clean_logits(dtype, next_n, with_ks, m, n, pad):
    m = m // next_n * next_n
    gen = torch.Generator().manual_seed(m * 1000 + n + next_n)
    ks, ke = _random_ranges(m // next_n, n, gen)
    base = torch.randn(m, n + pad, generator=gen).to(dtype)
    expected = reference.clean_logits(base.clone()[:, :n], ks if with_ks else None, ke, next_n)
    buf = base.to(DEV)
    view = buf[:, :n]  # padded rows: the padding must stay untouched
    out = di.clean_logits(view, ks.to(DEV) if with_ks else None, ke.to(DEV), next_n)
    assert out.data_ptr() == view.data_ptr()
    torch.testing.assert_close(view.cpu(), expected, rtol=0, atol=0, equal_nan=False)
    if pad:
        assert torch.equal(buf[:, n:].cpu(), base[:, n:])


def test_clean_logits_empty_and_misaligned():
    gen = torch.Generator().manual_seed(7)
    di.clean_logits(torch.empty(0, 5, device=DEV), None, torch.empty(0, dtype=torch.int32, device=DEV))
    # bf16 rows starting at odd 2-byte offsets (stride 133): exercises scalar head/tail paths
    base = torch.randn(16, 133, generator=gen).to(torch.bfloat16)
    ks, ke = _random_ranges(16, 131, gen)
    expected = reference.clean_logits(base.clone()[:, 1:132], ks, ke, 1)
    dev = base.to(DEV)
    di.clean_logits(dev[:, 1:132], ks.to(DEV), ke.to(DEV), 1)
    assert torch.equal(dev[:, 1:132].cpu(), expected)
    assert torch.equal(dev[:, 0].cpu(), base[:, 0]) and torch.equal(dev[:, 132].cpu(), base[:, 132])


def test_extra_flags_change_the_loaded_kernel(isolated_cache, monkeypatch):
    # DI_JIT_EXTRA_FLAGS is part of the kernel's identity in the process too, not only on disk:
    # changing it mid-process must load the other binary (A/B tools rely on this).
    from deep_indexer import _C

    x = torch.randn(8, 40, device=DEV)
    ke = torch.full((8,), 5, dtype=torch.int32, device=DEV)
    monkeypatch.delenv("DI_JIT_EXTRA_FLAGS", raising=False)
    di.clean_logits(x, None, ke)
    before = _C.num_loaded_kernels()
    monkeypatch.setenv("DI_JIT_EXTRA_FLAGS", "-DDI_TEST_UNUSED_MACRO=1")
    di.clean_logits(x, None, ke)
    assert _C.num_loaded_kernels() == before + 1
    assert torch.isinf(x[:, 5:]).all() and torch.isfinite(x[:, :5]).all()
    monkeypatch.delenv("DI_JIT_EXTRA_FLAGS")
    di.clean_logits(x, None, ke)
    assert _C.num_loaded_kernels() == before + 1


def test_clean_logits_rejects_bad_inputs():
    x = torch.randn(4, 8, device=DEV)
    ke = torch.full((4,), 3, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="cu_seq_len_k_end must have dtype"):
        di.clean_logits(x, None, ke.long())
    with pytest.raises(ValueError, match="must be on cuda:0"):
        di.clean_logits(x, None, ke.cpu())
    with pytest.raises(ValueError, match="next_n"):
        di.clean_logits(x, None, ke, 3)


# ------------------------------------------------------------------------------------ shared checks
from conftest import assert_logits_match  # noqa: E402

from deep_indexer import quant  # noqa: E402

def poisoned(shape, dtype, pad=0):
    buf = torch.full((shape[0], shape[1] + pad), float("nan"), dtype=dtype, device=DEV)
    return buf[:, : shape[1]]


# ------------------------------------------------------------------------------------ prefill
def make_prefill(S, SKV, H, D, pattern="random", seed=0, weights_pad=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(S, H, D, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn)
    k, k_scale = quant.per_token_cast_to_fp8(torch.randn(SKV, D, device=DEV, generator=g))
    w = torch.randn(S, H + weights_pad, device=DEV, generator=g)[:, :H]
    i = torch.arange(S, device=DEV)
    if pattern == "causal":
        ks, ke = torch.zeros_like(i), SKV - S + i + 1
    elif pattern == "cp":
        half, cp = max(S // 2, 1), max(SKV // max(S, 1), 1)
        idx = cp // 3
        ks = torch.zeros_like(i)
        ke = torch.where(i < half, idx * half + i, (2 * cp - 1 - idx) * half + (i - half)) + 1
    elif pattern == "packed":  # several sequences packed: each row sees its own sequence's prefix
        seq = torch.div(i, max(S // 3, 1), rounding_mode="floor")
        start = seq * (SKV // 3)
        ks, ke = start, start + (i - seq * max(S // 3, 1)) * max(SKV // max(S, 1), 1) + 1
    else:  # random, with empty rows, ks > ke, negative ks, ke > SKV
        ks = torch.randint(-SKV // 4, SKV, (S,), device=DEV, generator=g)
        ke = ks + torch.randint(-SKV // 8, SKV, (S,), device=DEV, generator=g)
    return q, (k, k_scale), w, ks.to(torch.int32), ke.to(torch.int32)


MQA_CONFIGS = [(h, d) for h in (16, 32, 64, 128) for d in (32, 64, 128)]


@pytest.mark.parametrize("H,D", MQA_CONFIGS)
@pytest.mark.parametrize("dtype,clean", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True),
                                         (torch.bfloat16, False)])
def test_mqa_logits_all_configs(H, D, dtype, clean, monkeypatch):
    S, SKV = 77, 1299
    # clean: the -inf fill in the kernel's idle producer warps (1) and in the separate pass (0)
    for fused in ("1", "0") if clean else ("0",):
        monkeypatch.setenv("DI_MQA_FUSED_CLEAN", fused)
        for pattern in ("random", "causal"):
            q, kv, w, ks, ke = make_prefill(S, SKV, H, D, pattern, seed=H * D + clean)
            out = poisoned((S, SKV), dtype, pad=3)
            got = di.fp8_mqa_logits(q, kv, w, ks, ke, clean, logits_dtype=dtype, out=out)
            assert got.data_ptr() == out.data_ptr()
            ref = reference.mqa_logits(q, kv, w, ks, ke)
            assert_logits_match(got, ref, clean, dtype, f"H={H} D={D} {pattern} fused_clean={fused}")


@pytest.mark.parametrize("H,D", MQA_CONFIGS)
@pytest.mark.parametrize("split", ["0", "1"])
def test_mqa_logits_epilogue_forms(H, D, split, monkeypatch):
    # Both epilogue forms on every (H, D): relu on the CUDA cores (0) and the linear half of relu
    # on the tensor cores from fp8 pieces of sum_h w q (1). q spans a wide dynamic range and the
    # weights both signs, so that the pieces' residuals matter; every element is held to a bound.
    monkeypatch.setenv("DI_MQA_SPLIT_RELU", split)
    for S, SKV, seed in ((77, 1299, 1), (5, 65, 2), (130, 700, 3)):
        q, kv, w, ks, ke = make_prefill(S, SKV, H, D, "random", seed=seed * 1000 + H * D)
        g = torch.Generator(device=DEV).manual_seed(seed)
        spread = torch.exp(2 * torch.randn(S, H, 1, device=DEV, generator=g))  # per-head magnitudes
        q = (torch.randn(S, H, D, device=DEV, generator=g) * spread).clamp(-448, 448).to(torch.float8_e4m3fn)
        for dtype in (torch.float32, torch.bfloat16):
            out = poisoned((S, SKV), dtype, pad=1)
            di.fp8_mqa_logits(q, kv, w, ks, ke, True, logits_dtype=dtype, out=out)
            ref = reference.mqa_logits(q, kv, w, ks, ke)
            assert_logits_match(out, ref, True, dtype, f"H={H} D={D} S={S} split_relu={split}")
            if dtype == torch.float32:
                valid = torch.isfinite(ref)
                err = (out.float() - ref.to(DEV).float())[valid].abs().max()
                assert err <= 1e-3 * ref[valid].abs().max(), f"H={H} D={D} S={S}: max error {float(err):.3g}"


def compressed_ranges(S, SKV, M, seed):
    """ks/ke with rows shorter and longer than M, empty rows (ks >= ke, ks >= SKV), negative ks and
    ke > SKV: random starts, lengths around M."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    ks = torch.randint(-M // 2, SKV, (S,), device=DEV, generator=g)
    ke = ks + torch.randint(-M // 4, 2 * M + 2, (S,), device=DEV, generator=g)
    ks[: S // 8], ke[: S // 8] = 7, 7  # empty
    ks[S // 8: S // 6] = SKV + 3       # starts past the keys: empty
    ks[-3:], ke[-3:] = -5, SKV + 10     # the whole key range (longer than M when M < SKV)
    ks[-4], ke[-4] = 10, 10 + M         # exactly M keys (when they exist)
    return ks.to(torch.int32), ke.to(torch.int32)


@pytest.mark.parametrize("H,D", MQA_CONFIGS)
@pytest.mark.parametrize("split", ["0", "1"])
def test_mqa_logits_compressed_all_configs(H, D, split, monkeypatch):
    # Compressed logits [S, M]: column c of row i = key max(ks[i], 0) + c, written by the kernel
    # (poisoned out); rows shorter and longer than M, both epilogue forms, both clean paths.
    monkeypatch.setenv("DI_MQA_SPLIT_RELU", split)
    S, SKV = 77, 1299
    for M in (1, 100, 333):
        q, kv, w, _, _ = make_prefill(S, SKV, H, D, seed=H * D + M)
        ks, ke = compressed_ranges(S, SKV, M, seed=M + H)
        ref = reference.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=M)
        assert (ref[:, -1].isfinite()).any() and (~ref[:, 0].isfinite()).any()  # long rows and empty rows
        for dtype in (torch.float32, torch.bfloat16):
            for clean, fused in ((True, "1"), (True, "0"), (False, "0")):
                monkeypatch.setenv("DI_MQA_FUSED_CLEAN", fused)
                out = poisoned((S, M), dtype, pad=5)
                got = di.fp8_mqa_logits(q, kv, w, ks, ke, clean, max_seqlen_k=M, logits_dtype=dtype, out=out)
                assert got.data_ptr() == out.data_ptr()
                assert_logits_match(out, ref, clean, dtype, f"H={H} D={D} M={M} clean={clean} fused={fused}")
                # nothing past the row's M columns (the padding stays poisoned)
                assert torch.isnan(out.as_strided((S, 5), (out.stride(0), 1), M).float()).all()


@pytest.mark.parametrize("H,D", [(32, 64), (64, 128), (16, 32), (128, 128)])
def test_mqa_logits_compressed_matches_full_width(H, D):
    # The compressed output is the full-width one shifted per row (same kernel arithmetic: bitwise),
    # causal and packed patterns, bf16 weights, allocated outputs with padded rows.
    for S, SKV, pattern in ((300, 3000, "packed"), (513, 2048, "causal"), (2048, 4096, "causal")):
        q, kv, w, ks, ke = make_prefill(S, SKV, H, D, pattern, seed=S + H)
        w = w.to(torch.bfloat16)
        full = di.fp8_mqa_logits(q, kv, w, ks, ke, True)
        lo = ks.clamp(min=0).long()
        hi = ke.clamp(max=SKV).long()
        M = int((hi - lo).clamp(min=0).max())
        for m in (M, max(M // 3, 1)):
            comp = di.fp8_mqa_logits(q, kv, w, ks, ke, True, max_seqlen_k=m)
            assert comp.shape == (S, m) and comp.stride(1) == 1 and comp.stride(0) >= m
            n = (hi - lo).clamp(min=0, max=m)
            cols = torch.arange(m, device=DEV)
            valid = cols[None, :] < n[:, None]
            idx = (lo[:, None] + cols[None, :]).clamp(max=SKV - 1)
            want = torch.where(valid, full.gather(1, idx), torch.full_like(comp, float("-inf")))
            assert torch.equal(comp.view(torch.int32), want.view(torch.int32)), f"H={H} D={D} S={S} M={m}"
            ref = reference.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=m)
            assert_logits_match(comp, ref, True, torch.float32, f"H={H} D={D} S={S} M={m}")


@pytest.mark.parametrize("H,D", MQA_CONFIGS)
@pytest.mark.parametrize("wgs", ["2", "3"])
def test_mqa_logits_math_wgs(H, D, wgs, monkeypatch):
    # Every math warpgroup count (DI_MQA_MATH_WGS) on every (H, D) it supports, both epilogue forms,
    # the fused and the separate -inf fill, full-width and compressed logits, bf16 weights.
    monkeypatch.setenv("DI_MQA_MATH_WGS", wgs)
    S, SKV = 150, 1299
    q, kv, w, ks, ke = make_prefill(S, SKV, H, D, seed=H * D + int(wgs))
    ref = reference.mqa_logits(q, kv, w, ks, ke)
    cks, cke = compressed_ranges(S, SKV, 200, seed=int(wgs))
    wb = w.to(torch.bfloat16)
    cref = reference.mqa_logits(q, kv, wb, cks, cke, max_seqlen_k=200)
    for split in ("0", "1"):
        monkeypatch.setenv("DI_MQA_SPLIT_RELU", split)
        for fused in ("0", "1"):
            monkeypatch.setenv("DI_MQA_FUSED_CLEAN", fused)
            what = f"H={H} D={D} wgs={wgs} split={split} fused={fused}"
            out = poisoned((S, SKV), torch.float32, pad=2)
            di.fp8_mqa_logits(q, kv, w, ks, ke, True, out=out)
            assert_logits_match(out, ref, True, torch.float32, what)
            out = poisoned((S, 200), torch.bfloat16, pad=2)
            di.fp8_mqa_logits(q, kv, wb, cks, cke, True, max_seqlen_k=200, logits_dtype=torch.bfloat16, out=out)
            assert_logits_match(out, cref, True, torch.bfloat16, what + " compressed")


@pytest.mark.parametrize("wgs", ["2", "3"])
@pytest.mark.parametrize("H,D", [(32, 64), (16, 32), (64, 128)])
def test_mqa_logits_persistent_many_blocks(H, D, wgs, monkeypatch):
    # 5 CTAs walking many q blocks each: the q stages, the KV ring and the k-scale prefetch wrap
    # many times.
    monkeypatch.setenv("DI_MQA_MATH_WGS", wgs)
    old = di.get_num_sms()
    di.set_num_sms(5)
    try:
        for pattern in ("causal", "random"):
            S, SKV = 700, 2300
            q, kv, w, ks, ke = make_prefill(S, SKV, H, D, pattern=pattern, seed=H + D + int(wgs))
            out = poisoned((S, SKV), torch.float32, pad=2)
            di.fp8_mqa_logits(q, kv, w, ks, ke, True, out=out)
            assert_logits_match(out, reference.mqa_logits(q, kv, w, ks, ke), True, torch.float32,
                                f"H={H} D={D} wgs={wgs} {pattern}")
    finally:
        di.set_num_sms(old)


@pytest.mark.parametrize("H,D", MQA_CONFIGS)
def test_mqa_logits_bf16_weights(H, D):
    S, SKV = 77, 1299
    q, kv, w, ks, ke = make_prefill(S, SKV, H, D, seed=H + D, weights_pad=3)
    w = w.to(torch.bfloat16)  # padded rows, unit inner stride
    out = poisoned((S, SKV), torch.float32, pad=1)
    di.fp8_mqa_logits(q, kv, w, ks, ke, True, out=out)
    assert_logits_match(out, reference.mqa_logits(q, kv, w, ks, ke), True, torch.float32, f"H={H} D={D}")


def test_mqa_logits_compressed_edge_cases():
    # every row empty; M larger than SKV; a single column; S = 0
    q, kv, w, _, _ = make_prefill(40, 500, 64, 128, seed=9)
    ks = torch.full((40,), 50, dtype=torch.int32, device=DEV)
    out = poisoned((40, 64), torch.float32)
    di.fp8_mqa_logits(q, kv, w, ks, ks - 1, True, max_seqlen_k=64, out=out)
    assert (out == float("-inf")).all()
    ks, ke = torch.full_like(ks, -10), torch.full_like(ks, 10_000)
    got = di.fp8_mqa_logits(q, kv, w, ks, ke, True, max_seqlen_k=777)
    assert got.shape == (40, 777)
    assert_logits_match(got, reference.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=777), True, torch.float32)
    assert torch.isneginf(got[:, 500:]).all() and torch.isfinite(got[:, :500]).all()
    got = di.fp8_mqa_logits(q, kv, w, ks, ke, True, max_seqlen_k=1)
    assert_logits_match(got, reference.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=1), True, torch.float32)
    q, kv, w, ks, ke = make_prefill(0, 100, 64, 128)
    assert di.fp8_mqa_logits(q, kv, w, ks, ke, max_seqlen_k=9).shape == (0, 9)


def test_prefill_compressed_cuda_graph_replay():
    S, SKV, M = 200, 3000, 700
    q, kv, w, _, _ = make_prefill(S, SKV, 64, 128, seed=21)
    ks, ke = compressed_ranges(S, SKV, M, seed=1)
    out = torch.empty(S, M, device=DEV)
    di.fp8_mqa_logits(q, kv, w, ks, ke, True, max_seqlen_k=M, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        di.fp8_mqa_logits(q, kv, w, ks, ke, True, max_seqlen_k=M, out=out)
    for seed in (2, 3):
        nks, nke = compressed_ranges(S, SKV, M, seed=seed)
        ks.copy_(nks), ke.copy_(nke)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_logits_match(out, reference.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=M), True, torch.float32)


@pytest.mark.parametrize("S,SKV,pattern", [(1, 1, "causal"), (1, 300, "random"), (3, 64, "causal"), (5, 65, "random"),
                                           (129, 4097, "causal"), (256, 2048, "cp"), (300, 3000, "packed"),
                                           (1000, 777, "random"), (2048, 8192, "causal")])
def test_mqa_logits_shapes(S, SKV, pattern):
    q, kv, w, ks, ke = make_prefill(S, SKV, 64, 128, pattern, seed=S + SKV, weights_pad=5)
    got = di.fp8_mqa_logits(q, kv, w, ks, ke, True)  # padded weights rows; allocated output
    assert got.stride(1) == 1 and got.stride(0) >= SKV
    ref = reference.mqa_logits(q, kv, w, ks, ke)
    assert_logits_match(got, ref, True, torch.float32, f"S={S} SKV={SKV}")


def test_mqa_logits_empty_and_edge_ranges():
    q, kv, w, ks, ke = make_prefill(0, 100, 64, 128)
    assert di.fp8_mqa_logits(q, kv, w, ks, ke).shape == (0, 100)
    q, kv, w, ks, ke = make_prefill(40, 500, 32, 64, seed=3)
    ks[:10], ke[:10] = 50, 40      # ks > ke: empty
    ks[10:20], ke[10:20] = -30, 10  # negative ks
    ks[20:30], ke[20:30] = 450, 10_000  # ke > SKV
    ks[30:], ke[30:] = 0, 0
    out = poisoned((40, 500), torch.float32)
    di.fp8_mqa_logits(q, kv, w, ks, ke, True, out=out)
    assert_logits_match(out, reference.mqa_logits(q, kv, w, ks, ke), True, torch.float32)
    assert (out[:10] == float("-inf")).all() and (out[30:] == float("-inf")).all()


def test_mqa_logits_deterministic():
    q, kv, w, ks, ke = make_prefill(512, 4096, 64, 128, "causal", seed=11)
    a = di.fp8_mqa_logits(q, kv, w, ks, ke)
    for _ in range(3):
        b = di.fp8_mqa_logits(q, kv, w, ks, ke)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_mqa_logits_int64_offsets():
    """An output of more than 2^31 elements: rows whose offsets pass 2^31 are checked."""
    S, SKV = 8200, 262_000  # 2.15e9 elements
    q, kv, w, _, _ = make_prefill(S, SKV, 64, 128, seed=5)
    i = torch.arange(S, device=DEV, dtype=torch.int32)
    ks = (SKV - 300 - (S - 1 - i) // 64).to(torch.int32)
    ke = (ks + 200).to(torch.int32)
    out = di.fp8_mqa_logits(q, kv, w, ks, ke, True)
    rows = torch.tensor([0, S // 2, S - 2, S - 1], device=DEV)
    assert int(rows[-1]) * out.stride(0) > 2**31
    ref = reference.mqa_logits(q[rows], kv, w[rows], ks[rows], ke[rows])
    assert_logits_match(out[rows], ref, True, torch.float32, "int64")
    del out


# ------------------------------------------------------------------------------------ decode
def make_paged(B, next_n, H, D, block_kv, max_len=1500, seed=0, two_d=False, zero_some=True, stride_pad=0,
               num_blocks=None):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len, (B,), generator=g)
    if zero_some and B > 2:
        lens[1] = 0
        lens[2] = min(next_n - 1, max_len)  # shorter than the speculative window
    keys = [torch.randn(int(n), D, generator=g).to(DEV) for n in lens]
    row = block_kv * (D + 4)
    cache, table, ctx = quant.pack_paged_kv_cache(keys, block_kv, block_stride=row + stride_pad, generator=g,
                                                  num_blocks=num_blocks or int(sum((lens + block_kv - 1) // block_kv)) + 3)
    q = (torch.randn(B, next_n, H, D, generator=g) * 2).to(DEV).to(torch.float8_e4m3fn)
    w = torch.randn(B * next_n, H, generator=g).to(DEV)
    if two_d:  # per-row lengths, each row seeing a different (random) prefix
        ctx = (ctx[:, None] - torch.randint(0, 3, (B, next_n), generator=g).to(DEV)).clamp(min=0).to(torch.int32)
    max_ctx = int(lens.max()) + 5 if B else 1
    return q, cache, w, ctx.contiguous(), table, max_ctx


def run_paged(q, cache, w, ctx, table, max_ctx, clean, dtype, num_sms=None, pad=0):
    block_kv = cache.shape[1]
    meta = di.get_paged_mqa_logits_metadata(ctx, block_kv, num_sms)
    out = poisoned((q.shape[0] * q.shape[1], max_ctx), dtype, pad=pad)
    got = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, clean, logits_dtype=dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    return got


PAGED_CONFIGS = [(n, h, d, b) for n in (1, 2, 3, 4) for h in (16, 32, 64, 128) for d in (64, 128) for b in (32, 64)]


@pytest.mark.parametrize("next_n,H,D,block_kv", PAGED_CONFIGS)
@pytest.mark.parametrize("two_d", [False, True])
def test_paged_mqa_logits_all_configs(next_n, H, D, block_kv, two_d):
    seed = next_n * 1000 + H * 10 + D + block_kv + two_d
    q, cache, w, ctx, table, max_ctx = make_paged(7, next_n, H, D, block_kv, seed=seed, two_d=two_d,
                                                  stride_pad=16 * (seed % 3))
    ref = reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx)
    for dtype, clean in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, True)):
        got = run_paged(q, cache, w, ctx, table, max_ctx, clean, dtype, pad=clean)
        assert_logits_match(got, ref, clean, dtype, f"next_n={next_n} H={H} D={D} block={block_kv} 2d={two_d}")


@pytest.mark.parametrize("wgs,next_n,H", [(2, 2, 64), (2, 1, 128), (2, 4, 32), (3, 1, 64), (3, 2, 16), (4, 2, 64)])
@pytest.mark.parametrize("num_sms", [None, 5])
def test_paged_math_wg_override(wgs, next_n, H, num_sms, monkeypatch):
    """DI_PAGED_MATH_WGS: other warpgroup counts, including two tiles in flight per warpgroup (2 WGs
    for N <= 128, 3 for N <= 64); few SMs make every CTA switch sequences many times mid-pipeline."""
    monkeypatch.setenv("DI_PAGED_MATH_WGS", str(wgs))
    q, cache, w, ctx, table, max_ctx = make_paged(64, next_n, H, 128, 64, max_len=3000,
                                                  seed=wgs * 100 + next_n * 10 + H)
    got = run_paged(q, cache, w, ctx, table, max_ctx, True, torch.float32, num_sms=num_sms)
    assert_logits_match(got, reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx), True, torch.float32)


SPLIT_CONFIGS = [(n, h, 128, 64) for n in (1, 2, 3, 4) for h in (16, 32, 64, 128)] + \
    [(2, 64, 64, 32), (3, 128, 64, 32), (4, 16, 64, 32), (1, 128, 64, 64)]


@pytest.mark.parametrize("next_n,H,D,block_kv", SPLIT_CONFIGS)
@pytest.mark.parametrize("split", ["0", "1"])
def test_paged_epilogue_forms(next_n, H, D, block_kv, split, monkeypatch):
    """Both decode epilogue forms (DI_PAGED_SPLIT_RELU: relu on the CUDA cores, or its linear half from
    per-sequence fp8 pieces of sum_h w q on the tensor cores, where the layout takes it). 5 SMs: every
    CTA switches sequences (and rebuilds its pieces) many times; q spans a wide dynamic range; every
    element is bounded."""
    monkeypatch.setenv("DI_PAGED_SPLIT_RELU", split)
    q, cache, w, ctx, table, max_ctx = make_paged(24, next_n, H, D, block_kv, max_len=700,
                                                  seed=next_n * 100 + H + D + block_kv)
    g = torch.Generator().manual_seed(H + next_n)
    wide = torch.randn(q.shape, generator=g) * torch.exp(2 * torch.randn(*q.shape[:3], 1, generator=g))
    q = wide.clamp(-448, 448).to(DEV).to(torch.float8_e4m3fn)
    got = run_paged(q, cache, w, ctx, table, max_ctx, True, torch.float32, num_sms=5)
    ref = reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx)
    assert_logits_match(got, ref, True, torch.float32, f"next_n={next_n} H={H} D={D} split_relu={split}")
    valid = torch.isfinite(ref)
    err = (got.float() - ref.to(DEV).float())[valid].abs().max()
    assert err <= 1e-3 * ref[valid].abs().max(), f"max error {float(err):.3g}"


def test_paged_math_wg_override_that_cannot_fit(monkeypatch):
    monkeypatch.setenv("DI_PAGED_MATH_WGS", "4")  # 4 WGs cannot hold N = 256 accumulators
    q, cache, w, ctx, table, max_ctx = make_paged(3, 4, 64, 128, 64, max_len=100, seed=3)
    with pytest.raises(ValueError, match=r"unsupported configuration next_n=4 H=64 D=128 block_kv=64 \(4 math WGs\)"):
        run_paged(q, cache, w, ctx, table, max_ctx, False, torch.float32)


@pytest.mark.parametrize("B,max_len,num_sms", [(1, 40000, None), (64, 9000, None), (3, 5, 7), (33, 3000, 1),
                                               (100, 2000, 300), (128, 2500, 9), (129, 2500, 9), (4096, 300, None)])
def test_paged_mqa_logits_batches(B, max_len, num_sms):
    q, cache, w, ctx, table, max_ctx = make_paged(B, 2, 64, 128, 64, max_len=max_len, seed=B)
    got = run_paged(q, cache, w, ctx, table, max_ctx, True, torch.float32, num_sms=num_sms)
    assert_logits_match(got, reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx), True, torch.float32)


@pytest.mark.parametrize("B,next_n,max_len,num_sms,two_d,block_kv", [
    (1, 1, 40000, None, False, 64), (1, 2, 70000, 7, True, 32), (3, 1, 5000, 1, False, 64), (64, 1, 9000, None, False, 64),
    (200, 2, 60, 300, False, 32), (256, 3, 3000, None, True, 64), (257, 1, 2000, None, False, 64)])
def test_paged_work_split_forms(B, next_n, max_len, num_sms, two_d, block_kv, monkeypatch):
    """The two ways the decode kernel deals its work (DI_PAGED_TILE_SPLIT: the schedule's 256-token segments, or
    64-token tiles counted from context_lens, up to 256 sequences) give the reference's logits and the same
    bits: ranges starting and ending mid-segment, more CTAs than tiles, one CTA for everything, empty and
    short sequences, and a batch past the tile split's limit (the schedule then)."""
    q, cache, w, ctx, table, max_ctx = make_paged(B, next_n, 64, 128, block_kv, max_len=max_len, seed=B + next_n,
                                                  two_d=two_d)
    ref = reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx)
    got = {}
    for split in ("0", "1"):
        monkeypatch.setenv("DI_PAGED_TILE_SPLIT", split)
        got[split] = run_paged(q, cache, w, ctx, table, max_ctx, True, torch.float32, num_sms=num_sms)
        assert_logits_match(got[split], ref, True, torch.float32, f"tile_split={split}")
    assert torch.equal(got["0"].view(torch.int32), got["1"].view(torch.int32))


def test_paged_block_table_narrower_than_a_sequence():
    """A block table too narrow for its longest sequence (a caller error) reads no entry past its width
    (block 0 stands in): the call completes, and the sequences the table covers are exact."""
    q, cache, w, ctx, table, max_ctx = make_paged(5, 1, 64, 128, 64, max_len=3000, seed=21, zero_some=False)
    order = torch.argsort(ctx.cpu(), descending=True)
    longest, others = int(order[0]), order[1:].to(DEV)
    if int(ctx[longest]) // 64 == int(ctx[others].max()) // 64:
        pytest.skip("no sequence needs more blocks than the others")
    narrow = table[:, : (int(ctx[others].max()) + 63) // 64].clone()
    got = run_paged(q, cache, w, ctx, narrow, max_ctx, True, torch.float32)
    torch.cuda.synchronize()
    ref = reference.paged_mqa_logits(q[others], cache, w[others], ctx[others], narrow[others], max_ctx)
    assert_logits_match(got[others], ref, True, torch.float32, "covered rows")


def test_paged_all_zero_lengths_and_allocation():
    q, cache, w, ctx, table, max_ctx = make_paged(5, 1, 64, 128, 64, seed=9)
    ctx.zero_()
    got = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, di.get_paged_mqa_logits_metadata(ctx, 64), 77, True)
    assert got.shape == (5, 77) and got.stride(1) == 1 and (got == float("-inf")).all()


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("block_kv", [32, 64])
@pytest.mark.parametrize("B,num_sms", [(1, 132), (7, 132), (64, 132), (300, 7), (1024, 132), (1025, 132), (4096, 132),
                                       (5000, 132), (5, 1), (1, 1000), (0, 132)])
def test_paged_metadata_matches_cpu_reference(B, num_sms, block_kv, two_d):
    g = torch.Generator().manual_seed(B * num_sms + block_kv)
    lens = torch.randint(0, 70000, (B, 3) if two_d else (B,), generator=g, dtype=torch.int32)
    lens[torch.rand(lens.shape, generator=g) < 0.1] = 0
    got = di.get_paged_mqa_logits_metadata(lens.to(DEV), block_kv, num_sms)
    want = reference.paged_mqa_logits_metadata(lens, block_kv, num_sms)
    assert torch.equal(got.cpu(), want)


def test_paged_deterministic():
    q, cache, w, ctx, table, max_ctx = make_paged(64, 2, 64, 128, 64, max_len=8000, seed=4)
    a = run_paged(q, cache, w, ctx, table, max_ctx, True, torch.float32)
    b = run_paged(q, cache, w, ctx, table, max_ctx, True, torch.float32)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_paged_cuda_graph_replay_with_new_inputs():
    """metadata + logits captured once, replayed with new lengths, block tables, q, weights and cache."""
    B, next_n, H, D, block_kv, max_ctx, nb = 16, 2, 64, 128, 64, 4096, 1100
    mk = lambda seed: make_paged(B, next_n, H, D, block_kv, max_len=max_ctx - 10, seed=seed, num_blocks=nb)
    q, cache, w, ctx, table, _ = mk(1)
    table_buf = torch.zeros(B, max_ctx // block_kv, dtype=torch.int32, device=DEV)
    table_buf[:, : table.shape[1]] = table
    out = torch.empty(B * next_n, max_ctx, device=DEV)
    meta = torch.empty(torch.cuda.get_device_properties(0).multi_processor_count + 1, 2, dtype=torch.int32, device=DEV)

    def step():
        di.get_paged_mqa_logits_metadata(ctx, block_kv, out=meta)
        di.fp8_paged_mqa_logits(q, cache, w, ctx, table_buf, meta, max_ctx, True, out=out)

    step()  # warm-up (loads the kernels)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        q2, cache2, w2, ctx2, table2, _ = mk(100 + seed)
        q.copy_(q2), cache.copy_(cache2), w.copy_(w2), ctx.copy_(ctx2)
        table_buf.zero_()
        table_buf[:, : table2.shape[1]] = table2
        out.fill_(float("nan"))
        graph.replay()
        ref = reference.paged_mqa_logits(q, cache, w, ctx, table2, max_ctx)
        assert_logits_match(out, ref, True, torch.float32, f"replay {seed}")


def test_prefill_cuda_graph_replay_with_new_inputs():
    S, SKV, H, D = 256, 4096, 64, 128
    q, kv, w, ks, ke = make_prefill(S, SKV, H, D, "causal", seed=2)
    out = torch.empty(S, SKV, device=DEV)
    di.fp8_mqa_logits(q, kv, w, ks, ke, True, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        di.fp8_mqa_logits(q, kv, w, ks, ke, True, out=out)
    for seed in range(2):
        q2, kv2, w2, ks2, ke2 = make_prefill(S, SKV, H, D, "random", seed=50 + seed)
        q.copy_(q2), kv[0].copy_(kv2[0]), kv[1].copy_(kv2[1]), w.copy_(w2), ks.copy_(ks2), ke.copy_(ke2)
        out.fill_(float("nan"))
        graph.replay()
        assert_logits_match(out, reference.mqa_logits(q, kv, w, ks, ke), True, torch.float32, f"replay {seed}")


def test_capture_of_an_unloaded_kernel_is_a_clear_error():
    """In a fresh process nothing is loaded: capturing a first call raises, telling to warm up."""
    import subprocess
    import sys

    code = (
        "import torch, deep_indexer as di\n"
        "lens = torch.full((3, 4), 5, dtype=torch.int32, device='cuda')\n"
        "g = torch.cuda.CUDAGraph()\n"
        "try:\n"
        "    with torch.cuda.graph(g):\n"
        "        di.get_paged_mqa_logits_metadata(lens, 32, 3)\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
        "di.get_paged_mqa_logits_metadata(lens, 32, 3); torch.cuda.synchronize(); print('USABLE')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "RAISED" in r.stdout and "warm-up" in r.stdout, r.stdout + r.stderr
    assert "USABLE" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------------ decode: next_n 5..8
LONG_MTP_CONFIGS = [(n, h, d, b) for n in (5, 6, 7, 8) for h in (16, 32, 64, 128) for d in (64, 128) for b in (32, 64)]


@pytest.mark.parametrize("next_n,H,D,block_kv", LONG_MTP_CONFIGS)
@pytest.mark.parametrize("two_d", [False, True])
def test_paged_long_mtp_all_configs(next_n, H, D, block_kv, two_d):
    """next_n 5..8 (several q chunks per tile, one q slot where two do not fit); 5 SMs so that every CTA
    switches sequences many times."""
    seed = next_n * 1000 + H * 10 + D + block_kv + two_d
    q, cache, w, ctx, table, max_ctx = make_paged(9, next_n, H, D, block_kv, max_len=1200, seed=seed, two_d=two_d,
                                                  stride_pad=16 * (seed % 3))
    ref = reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx)
    for dtype, clean, sms in ((torch.float32, False, None), (torch.float32, True, 5), (torch.bfloat16, True, None)):
        got = run_paged(q, cache, w, ctx, table, max_ctx, clean, dtype, num_sms=sms, pad=clean)
        assert_logits_match(got, ref, clean, dtype, f"next_n={next_n} H={H} D={D} block={block_kv} 2d={two_d}")


@pytest.mark.parametrize("next_n,H", [(5, 16), (8, 16), (5, 32), (7, 32)])
def test_paged_long_mtp_split_relu(next_n, H, monkeypatch):
    """The tensor-core linear half of relu (DI_PAGED_SPLIT_RELU=1) on the single-chunk next_n 5..8 shapes."""
    monkeypatch.setenv("DI_PAGED_SPLIT_RELU", "1")
    q, cache, w, ctx, table, max_ctx = make_paged(12, next_n, H, 128, 64, max_len=700, seed=next_n * 10 + H)
    got = run_paged(q, cache, w, ctx, table, max_ctx, True, torch.float32, num_sms=4)
    assert_logits_match(got, reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx), True, torch.float32)


# ------------------------------------------------------------------------------------ decode: varlen (indices)
def make_varlen(runs, H, D, block_kv, seed=0, max_len=900, causal=True, zero_rows=()):
    """A varlen batch: `runs` lists the rows of each request (consecutive runs of equal ids). Row r of a
    run of n rows over a request of L keys sees L - n + 1 + r keys (causal) or a random prefix. Only the
    run's first row of the block table is real; the other rows hold garbage the kernel must not read.
    Ids are random int32 (negative and huge too), distinct between neighbouring runs."""
    g = torch.Generator().manual_seed(seed)
    R = sum(runs)
    lens = [int(torch.randint(max(n, 1), max_len, (1,), generator=g)) for n in runs]
    keys = [torch.randn(L, D, generator=g).to(DEV) for L in lens]
    cache, req_table, _ = quant.pack_paged_kv_cache(keys, block_kv, generator=g,
                                                    num_blocks=sum((L + block_kv - 1) // block_kv for L in lens) + 5)
    table = torch.randint(-2**31, 2**31 - 1, (R, req_table.shape[1]), generator=g, dtype=torch.int32).to(DEV)
    ids, ctx, prev = [], [], None
    r = 0
    for i, (n, L) in enumerate(zip(runs, lens)):
        table[r] = req_table[i]
        rid = prev
        while rid == prev:
            rid = int(torch.randint(-2**31, 2**31 - 1, (1,), generator=g))
        prev = rid
        for j in range(n):
            ids.append(rid)
            ctx.append(L - n + 1 + j if causal else int(torch.randint(0, L + 1, (1,), generator=g)))
        r += n
    ctx = torch.tensor(ctx, dtype=torch.int32)
    for z in zero_rows:
        ctx[z] = 0
    q = (torch.randn(R, 1, H, D, generator=g) * 2).to(DEV).to(torch.float8_e4m3fn)
    w = torch.randn(R, H, generator=g).to(DEV)
    return q, cache, w, ctx.to(DEV), table, torch.tensor(ids, dtype=torch.int32, device=DEV), max(lens) + 3


def run_varlen(q, cache, w, ctx, table, ids, max_ctx, clean, dtype, num_sms=None):
    meta = di.get_paged_mqa_logits_metadata(ctx, cache.shape[1], num_sms, indices=ids)
    out = poisoned((q.shape[0], max_ctx), dtype)
    got = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, clean, logits_dtype=dtype, indices=ids,
                                  out=out)
    assert got.data_ptr() == out.data_ptr()
    return got


VARLEN_RUNS = {
    "ones": [1] * 9,
    "twos": [2] * 6,
    "fives": [5] * 4,
    "mixed": [1, 3, 2, 7, 1, 1, 4, 2, 5, 1],
    "long_run": [40, 1, 70, 3],  # runs longer than a 32-id look-back window
}


@pytest.mark.parametrize("runs", list(VARLEN_RUNS), ids=list(VARLEN_RUNS))
@pytest.mark.parametrize("H,D,block_kv", [(64, 128, 64), (32, 64, 32), (16, 128, 32), (128, 64, 64)])
@pytest.mark.parametrize("two_d", [False, True])
def test_paged_varlen(runs, H, D, block_kv, two_d):
    runs = VARLEN_RUNS[runs]
    R = sum(runs)
    zero = [0, R // 2, R - 1] if R > 3 else []
    q, cache, w, ctx, table, ids, max_ctx = make_varlen(runs, H, D, block_kv, seed=R * 7 + H + D + block_kv,
                                                        causal=not two_d, zero_rows=zero)
    if two_d:
        ctx = ctx[:, None].contiguous()
    ref = reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx, indices=ids)
    for dtype, clean, sms in ((torch.float32, True, None), (torch.float32, False, 3), (torch.bfloat16, True, 1)):
        got = run_varlen(q, cache, w, ctx, table, ids, max_ctx, clean, dtype, num_sms=sms)
        assert_logits_match(got, ref, clean, dtype, f"varlen {runs} H={H} D={D} block={block_kv}")


def test_paged_varlen_matches_flattened_batch():
    """A varlen batch equals the same rows as independent sequences with the run's block-table row repeated."""
    runs = [3, 1, 4, 1, 5]
    q, cache, w, ctx, table, ids, max_ctx = make_varlen(runs, 64, 128, 64, seed=5)
    starts = torch.repeat_interleave(torch.tensor([sum(runs[:i]) for i in range(len(runs))]), torch.tensor(runs))
    flat_table = table[starts.to(DEV)].contiguous()
    got = run_varlen(q, cache, w, ctx, table, ids, max_ctx, True, torch.float32)
    want = run_paged(q, cache, w, ctx, flat_table, max_ctx, True, torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_paged_varlen_equal_ids_apart_are_separate_runs():
    """Equal ids that are not consecutive are separate requests (each run reads its own first row)."""
    q, cache, w, ctx, table, ids, max_ctx = make_varlen([2, 3, 2], 64, 128, 64, seed=6)
    ids[5:] = ids[0]  # run 0 and run 2 share an id but run 1 lies between them
    ref = reference.paged_mqa_logits(q, cache, w, ctx, table, max_ctx, indices=ids)
    got = run_varlen(q, cache, w, ctx, table, ids, max_ctx, True, torch.float32)
    assert_logits_match(got, ref, True, torch.float32)


def test_paged_varlen_cuda_graph_replay_with_new_ids():
    """metadata + logits captured once with indices, replayed with new ids, run shapes, lengths and tables."""
    H, D, block_kv, R, max_ctx = 64, 128, 64, 24, 1024
    shapes = [[1] * 24, [3, 5, 2, 8, 1, 5], [24], [2] * 12]
    mk = lambda i: make_varlen(shapes[i], H, D, block_kv, seed=50 + i, max_len=max_ctx - 5, zero_rows=[i])
    q, cache, w, ctx, table, ids, _ = mk(0)
    nb = 2 * R * (max_ctx // block_kv)
    cache_buf = torch.zeros(nb, block_kv, 1, D + 4, dtype=torch.uint8, device=DEV)
    table_buf = torch.zeros(R, max_ctx // block_kv, dtype=torch.int32, device=DEV)
    out = torch.empty(R, max_ctx, device=DEV)
    meta = torch.empty(torch.cuda.get_device_properties(0).multi_processor_count + 1, 2, dtype=torch.int32, device=DEV)

    def load(i):
        q2, cache2, w2, ctx2, table2, ids2, _ = mk(i)
        q.copy_(q2), w.copy_(w2), ctx.copy_(ctx2), ids.copy_(ids2)
        cache_buf[: cache2.shape[0]].copy_(cache2)
        table_buf.zero_()
        table_buf[:, : table2.shape[1]] = table2
        return table2

    def step():
        di.get_paged_mqa_logits_metadata(ctx, block_kv, indices=ids, out=meta)
        di.fp8_paged_mqa_logits(q, cache_buf, w, ctx, table_buf, meta, max_ctx, True, indices=ids, out=out)

    load(0)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(1, len(shapes)):
        table2 = load(i)
        out.fill_(float("nan"))
        graph.replay()
        ref = reference.paged_mqa_logits(q, cache_buf, w, ctx, table2, max_ctx, indices=ids)
        assert_logits_match(out, ref, True, torch.float32, f"replay {shapes[i]}")


# ------------------------------------------------------------------------------------ decode: engine scale
@pytest.mark.parametrize("next_n,two_d", [(1, False), (2, True), (8, True), (8, False)])
def test_paged_65536_rows(next_n, two_d):
    """65536 q rows (B * next_n), short and zero lengths anywhere: the schedule equals the CPU reference
    bit for bit, every row's -inf mask is exact, and sampled rows match the reference."""
    B = 65536 // next_n
    q, cache, w, ctx, table, max_ctx = make_paged(B, next_n, 32, 64, 64, max_len=300, seed=next_n, two_d=two_d)
    g = torch.Generator().manual_seed(next_n)
    zero = torch.rand(B, generator=g) < 0.2
    ctx[zero.to(DEV)] = 0
    meta = di.get_paged_mqa_logits_metadata(ctx, 64)
    assert torch.equal(meta.cpu(), reference.paged_mqa_logits_metadata(ctx.cpu(), 64, meta.shape[0] - 1))
    out = poisoned((B * next_n, max_ctx), torch.float32)
    got = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, True, out=out)
    ends = ctx.long() if two_d else ctx.long()[:, None] - next_n + 1 + torch.arange(next_n, device=DEV)
    ends = ends.reshape(-1).clamp(0, max_ctx)
    cols = torch.arange(max_ctx, device=DEV)
    assert torch.equal(torch.isneginf(got), cols[None, :] >= ends[:, None])
    seqs = torch.cat([torch.arange(0, 64), torch.randint(0, B, (64,), generator=g), torch.arange(B - 64, B)]).unique()
    rows = (seqs[:, None] * next_n + torch.arange(next_n)).reshape(-1).to(DEV)
    s = seqs.to(DEV)
    ref = reference.paged_mqa_logits(q[s], cache, w[rows], ctx[s], table[s], max_ctx)
    assert_logits_match(got[rows], ref, True, torch.float32, "sampled rows")


def test_paged_varlen_65536_rows():
    """65536 varlen rows in runs of 1..8 with zero-length rows: the mask of every row is exact and sampled
    runs match the reference."""
    g = torch.Generator().manual_seed(65536)
    runs, total = [], 0
    while total < 65536:
        n = min(int(torch.randint(1, 9, (1,), generator=g)), 65536 - total)
        runs.append(n)
        total += n
    q, cache, w, ctx, table, ids, max_ctx = make_varlen(runs, 32, 64, 64, seed=1, max_len=200)
    ctx[(torch.rand(65536, generator=g) < 0.1).to(DEV)] = 0
    got = run_varlen(q, cache, w, ctx, table, ids, max_ctx, True, torch.float32)
    cols = torch.arange(max_ctx, device=DEV)
    assert torch.equal(torch.isneginf(got), cols[None, :] >= ctx.long().clamp(0, max_ctx)[:, None])
    starts = torch.tensor([0] + runs[:-1]).cumsum(0)
    pick = torch.cat([torch.arange(0, 16), torch.randint(0, len(runs), (32,), generator=g),
                      torch.arange(len(runs) - 16, len(runs))]).unique()
    rows = torch.cat([torch.arange(int(starts[i]), int(starts[i]) + runs[i]) for i in pick]).to(DEV)
    sub_ids = ids[rows].clone()
    ref = reference.paged_mqa_logits(q[rows], cache, w[rows], ctx[rows], table[rows], max_ctx, indices=sub_ids)
    assert_logits_match(got[rows], ref, True, torch.float32, "sampled runs")


@pytest.mark.parametrize("B,next_n", [(1, 1), (5, 3), (4096, 2), (16384, 1), (8192, 8)])
@pytest.mark.parametrize("varlen", [False, True])
def test_paged_all_zero_lengths_at_scale(B, next_n, varlen):
    """All-zero context lengths at any batch size: an all-(B, 0) schedule and an all -inf output."""
    if varlen:
        B, next_n = B * next_n, 1
    ctx = torch.zeros(B, next_n, dtype=torch.int32, device=DEV)
    ids = torch.arange(B, dtype=torch.int32, device=DEV) // 3 if varlen else None
    meta = di.get_paged_mqa_logits_metadata(ctx, 64, indices=ids)
    assert (meta[:, 0] == B).all() and (meta[:, 1] == 0).all()
    q = torch.randn(B, next_n, 32, 64, device=DEV).to(torch.float8_e4m3fn)
    cache = torch.randint(0, 255, (3, 64, 1, 68), dtype=torch.uint8, device=DEV)
    table = torch.randint(-5, 5, (B, 2), dtype=torch.int32, device=DEV)
    out = poisoned((B * next_n, 100), torch.float32)
    di.fp8_paged_mqa_logits(q, cache, torch.randn(B * next_n, 32, device=DEV), ctx, table, meta, 100, True,
                            indices=ids, out=out)
    assert torch.isneginf(out).all()
