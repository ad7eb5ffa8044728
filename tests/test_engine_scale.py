"""Decode at engine scale (SM90 GPU): up to 65536 query rows (B * next_n), all-zero context lengths,
zero-length rows anywhere, and no kernel compiled or loaded per batch size. Called the way vLLM and
SGLang call it (DeepGEMM's names, 2-D context lengths, num_sms from get_num_sms()) and with [B] lengths."""
import pytest
import torch

from conftest import assert_logits_match, requires_sm90

pytestmark = [requires_sm90, pytest.mark.gpu]

import deep_indexer as di  # noqa: E402
from deep_indexer import _C, deep_gemm, reference  # noqa: E402

DEV = "cuda"
H, D, BLOCK = 64, 128, 64


def engine_batch(B, next_n, max_len, two_d, zero_frac=0.2, seed=0, num_blocks=4096):
    """B sequences of random lengths in [0, max_len] (a fraction exactly 0, anywhere), blocks drawn at random
    from a shared cache of `num_blocks` blocks (each holding valid fp32 scales)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(0, 255, (num_blocks, BLOCK, 1, D + 4), dtype=torch.uint8, generator=g)
    scales = torch.rand(num_blocks, BLOCK, generator=g) * 0.02 + 0.001
    cache.view(num_blocks, -1)[:, BLOCK * D:] = scales.view(torch.uint8).view(num_blocks, -1)
    fp8 = cache.view(num_blocks, -1)[:, : BLOCK * D]
    fp8[(fp8 & 0x7F) == 0x7F] = 0  # no NaN bytes in e4m3
    lens = torch.randint(0, max_len + 1, (B,), generator=g, dtype=torch.int32)
    lens[torch.rand(B, generator=g) < zero_frac] = 0
    max_blocks = (max_len + BLOCK - 1) // BLOCK
    table = torch.randint(0, num_blocks, (B, max_blocks), generator=g, dtype=torch.int32)
    gd = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(B, next_n, H, D, generator=gd, device=DEV) * 2).to(torch.float8_e4m3fn)
    w = torch.randn(B * next_n, H, generator=gd, device=DEV)
    if two_d:  # row i of a window sees j < ctx[b, i] (engines' form)
        ctx = (lens[:, None] - next_n + 1 + torch.arange(next_n, dtype=torch.int32)).clamp(min=0).to(torch.int32)
    else:
        ctx = lens
    to = lambda t: t.to(DEV).contiguous()  # noqa: E731
    return to(q), to(cache), to(w), to(ctx), to(table), max_len + 3


def row_lengths(ctx, next_n, max_ctx):
    """Number of keys each output row sees, [B * next_n]."""
    c = ctx.cpu().long()
    ends = c if c.dim() == 2 else c[:, None] - next_n + 1 + torch.arange(next_n)
    return ends.clamp(0, max_ctx).reshape(-1)


@pytest.mark.parametrize("B,next_n,two_d", [(65536, 1, True), (32768, 2, True), (65536, 1, False), (16384, 4, False)])
def test_65536_rows(B, next_n, two_d):
    q, cache, w, ctx, table, max_ctx = engine_batch(B, next_n, 300, two_d, seed=B + next_n)
    meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, BLOCK, deep_gemm.get_num_sms())
    assert torch.equal(meta.cpu(), reference.paged_mqa_logits_metadata(ctx.cpu(), BLOCK, deep_gemm.get_num_sms()))
    out = torch.full((B * next_n, max_ctx), float("nan"), device=DEV)
    got = deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, max_ctx, True, out=out)
    torch.cuda.synchronize()
    # every row: exactly its own number of finite entries, the rest -inf (zero-length rows: all -inf)
    n = row_lengths(ctx, next_n, max_ctx)
    finite = torch.isfinite(got)
    assert torch.equal(finite.sum(1).cpu(), n)
    assert torch.equal((got == float("-inf")).sum(1).cpu(), max_ctx - n)
    # values: a random sample of sequences (first and last included) against the reference
    g = torch.Generator().manual_seed(1)
    seqs = torch.cat([torch.tensor([0, B - 1]), torch.randperm(B, generator=g)[:254]]).to(DEV)
    rows = (seqs[:, None] * next_n + torch.arange(next_n, device=DEV)).reshape(-1)
    q_seqs = q.view(torch.uint8)[seqs].view(torch.float8_e4m3fn)
    ref = reference.paged_mqa_logits(q_seqs, cache, w[rows], ctx[seqs], table[seqs], max_ctx)
    assert_logits_match(got[rows], ref, True, torch.float32, f"B={B}")


@pytest.mark.parametrize("B,next_n,two_d", [(65536, 1, True), (65536, 1, False), (16384, 4, True)])
def test_all_zero_context_lengths(B, next_n, two_d):
    q, cache, w, ctx, table, max_ctx = engine_batch(B, next_n, 100, two_d, seed=3)
    ctx.zero_()
    meta = di.get_paged_mqa_logits_metadata(ctx, BLOCK)
    assert torch.equal(meta.cpu(), reference.paged_mqa_logits_metadata(ctx.cpu(), BLOCK, meta.shape[0] - 1))
    got = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, True)
    assert (got == float("-inf")).all()
    meta = di.get_paged_mqa_logits_metadata(ctx, BLOCK, 1)  # one CTA, nothing to do
    got = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, False)
    torch.cuda.synchronize()


def test_no_kernel_per_batch_size():
    """After one call at a small and one at a large batch, other batch sizes load no further kernel."""
    sizes = [1, 2, 7, 64, 300, 1000, 4097, 20000, 65536]
    calls = []
    for B in (1, 65536):  # warm-up: the metadata has one variant for small batches and one for the rest
        calls.append(engine_batch(B, 1, 200, True, seed=B))
        q, cache, w, ctx, table, max_ctx = calls[-1]
        meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, BLOCK, deep_gemm.get_num_sms())
        deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, max_ctx)
    torch.cuda.synchronize()
    loaded = _C.num_loaded_kernels()
    for B in sizes:
        q, cache, w, ctx, table, max_ctx = engine_batch(B, 1, 200, True, seed=B + 7)
        meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, BLOCK, deep_gemm.get_num_sms())
        got = deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, max_ctx, True)
        assert torch.equal(torch.isfinite(got).sum(1).cpu(), row_lengths(ctx, 1, max_ctx))
    torch.cuda.synchronize()
    assert _C.num_loaded_kernels() == loaded, "a batch size loaded (or compiled) another kernel"
