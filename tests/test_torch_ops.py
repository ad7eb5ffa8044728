"""torch.ops.deep_indexer.*: schemas, fake implementations (CPU, no GPU needed), and on an SM90 GPU
torch.library.opcheck, fake-vs-real strides and an indexer module under torch.compile(fullgraph=True)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import deep_indexer as di
from deep_indexer import quant, reference
from deep_indexer.torch_ops import padded_row_stride

from conftest import requires_sm90

OPS = torch.ops.deep_indexer
FP8 = torch.float8_e4m3fn


def test_schemas_declare_mutation():
    assert "Tensor(a0!) logits" in str(OPS.clean_logits.default._schema)
    for name in ("fp8_mqa_logits_out", "fp8_paged_mqa_logits_out", "get_paged_mqa_logits_metadata_out"):
        schema = str(getattr(OPS, name).default._schema)
        assert "!) out" in schema and schema.endswith("-> ()"), schema
    for name in ("fp8_mqa_logits", "fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata"):
        assert "!" not in str(getattr(OPS, name).default._schema)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_outputs_have_real_layout(dtype):
    with FakeTensorMode():
        dev = "cuda"
        q = torch.empty(7, 64, 128, dtype=FP8, device=dev)
        k = torch.empty(1000, 128, dtype=FP8, device=dev)
        i32 = lambda *s: torch.empty(*s, dtype=torch.int32, device=dev)
        out = OPS.fp8_mqa_logits(q, k, torch.empty(1000, device=dev), torch.empty(7, 64, device=dev), i32(7), i32(7),
                                 True, dtype)
        assert out.shape == (7, 1000) and out.dtype == dtype and out.stride() == (padded_row_stride(1000, dtype), 1)
        out = OPS.fp8_mqa_logits(q, k, torch.empty(1000, device=dev), torch.empty(7, 64, device=dev), i32(7), i32(7),
                                 True, dtype, 333)  # compressed: [S, max_seqlen_k]
        assert out.shape == (7, 333) and out.dtype == dtype and out.stride() == (padded_row_stride(333, dtype), 1)
        qd = torch.empty(3, 2, 64, 128, dtype=FP8, device=dev)
        cache = torch.empty(10, 64, 1, 132, dtype=torch.uint8, device=dev)
        meta = OPS.get_paged_mqa_logits_metadata(i32(3), 64, 132)
        assert meta.shape == (133, 2) and meta.dtype == torch.int32
        logits = OPS.fp8_paged_mqa_logits(qd, cache, torch.empty(6, 64, device=dev), i32(3), i32(3, 4), meta, 999,
                                          False, dtype)
        assert logits.shape == (6, 999) and logits.stride() == (padded_row_stride(999, dtype), 1)
        # varlen (indices) and next_n = 8
        ids = i32(5)
        meta = OPS.get_paged_mqa_logits_metadata(i32(5), 64, 132, ids)
        logits = OPS.fp8_paged_mqa_logits(torch.empty(5, 1, 64, 128, dtype=FP8, device=dev), cache,
                                          torch.empty(5, 64, device=dev), i32(5), i32(5, 4), meta, 999, False, dtype,
                                          ids)
        assert logits.shape == (5, 999) and logits.stride() == (padded_row_stride(999, dtype), 1)
        logits = OPS.fp8_paged_mqa_logits(torch.empty(3, 8, 64, 128, dtype=FP8, device=dev), cache,
                                          torch.empty(24, 64, device=dev), i32(3, 8), i32(3, 4), meta, 999, False, dtype)
        assert logits.shape == (24, 999)


# ------------------------------------------------------------------------------------ GPU
DEV = "cuda"


def _prefill(S=64, SKV=1024, H=64, D=128):
    q = torch.randn(S, H, D, device=DEV).to(FP8)
    k, sc = quant.per_token_cast_to_fp8(torch.randn(SKV, D, device=DEV))
    i = torch.arange(S, device=DEV, dtype=torch.int32)
    return q, k, sc, torch.randn(S, H, device=DEV), torch.zeros_like(i), (SKV - S + i + 1).to(torch.int32)


def _decode(B=4, next_n=2, H=64, D=128, block_kv=64):
    keys = [torch.randn(int(n), D, device=DEV) for n in torch.randint(1, 3000, (B,))]
    cache, table, ctx = quant.pack_paged_kv_cache(keys, block_kv)
    q = torch.randn(B, next_n, H, D, device=DEV).to(FP8)
    return q, cache, torch.randn(B * next_n, H, device=DEV), ctx, table, 3000


# opcheck's schema sub-test multiplies the inputs, which torch does not implement for fp8.
_UTILS = ("test_faketensor", "test_aot_dispatch_dynamic")


@requires_sm90
def test_opcheck_all_ops():
    q, k, sc, w, ks, ke = _prefill()
    torch.library.opcheck(OPS.fp8_mqa_logits, (q, k, sc, w, ks, ke, True, torch.float32), test_utils=_UTILS)
    torch.library.opcheck(OPS.fp8_mqa_logits_out, (q, k, sc, w, ks, ke, True, torch.empty(64, 1024, device=DEV)),
                          test_utils=_UTILS)
    torch.library.opcheck(OPS.fp8_mqa_logits, (q, k, sc, w, ks, ke, True, torch.float32, 300), test_utils=_UTILS)
    torch.library.opcheck(OPS.fp8_mqa_logits_out, (q, k, sc, w, ks, ke, True, torch.empty(64, 300, device=DEV), 300),
                          test_utils=_UTILS)
    qd, cache, wd, ctx, table, max_ctx = _decode()
    torch.library.opcheck(OPS.get_paged_mqa_logits_metadata, (ctx, 64, None))
    meta = OPS.get_paged_mqa_logits_metadata(ctx, 64, None)
    torch.library.opcheck(OPS.get_paged_mqa_logits_metadata_out, (ctx, 64, torch.empty_like(meta)))
    # clean_logits=True: with False the entries outside the ranges are unspecified and opcheck compares them
    torch.library.opcheck(OPS.fp8_paged_mqa_logits, (qd, cache, wd, ctx, table, meta, max_ctx, True, torch.bfloat16),
                          test_utils=_UTILS)
    torch.library.opcheck(OPS.fp8_paged_mqa_logits_out,
                          (qd, cache, wd, ctx, table, meta, max_ctx, True, torch.empty(8, max_ctx, device=DEV)),
                          test_utils=_UTILS)
    torch.library.opcheck(OPS.clean_logits, (torch.randn(64, 1024, device=DEV), None, ke))
    # varlen: rows of request ids [7, 7, 3, 3, 3, 9, 1, 1]; each run reads its first row's block-table row
    ids = torch.tensor([7, 7, 3, 3, 3, 9, 1, 1], dtype=torch.int32, device=DEV)
    qv, wv = qd.reshape(8, 1, *qd.shape[2:]).contiguous(), wd
    ctxv = torch.randint(0, int(ctx.min()) + 1, (8,), dtype=torch.int32, device=DEV)
    tablev = table.repeat_interleave(2, dim=0).contiguous()
    torch.library.opcheck(OPS.get_paged_mqa_logits_metadata, (ctxv, 64, None, ids))
    metav = OPS.get_paged_mqa_logits_metadata(ctxv, 64, None, ids)
    torch.library.opcheck(OPS.fp8_paged_mqa_logits,
                          (qv, cache, wv, ctxv, tablev, metav, max_ctx, True, torch.float32, ids), test_utils=_UTILS)
    torch.library.opcheck(OPS.fp8_paged_mqa_logits_out,
                          (qv, cache, wv, ctxv, tablev, metav, max_ctx, True, torch.empty(8, max_ctx, device=DEV), ids),
                          test_utils=_UTILS)


@requires_sm90
def test_real_outputs_match_fake_layout():
    q, k, sc, w, ks, ke = _prefill(SKV=1000)
    out = OPS.fp8_mqa_logits(q, k, sc, w, ks, ke, True, torch.bfloat16)
    assert out.stride() == (padded_row_stride(1000, torch.bfloat16), 1)
    out = OPS.fp8_mqa_logits(q, k, sc, w, ks, ke, True, torch.float32, 333)
    assert out.shape == (q.shape[0], 333) and out.stride() == (padded_row_stride(333, torch.float32), 1)


class Indexer(torch.nn.Module):
    """A decode step of the indexer as a model calls it: metadata, logits, top-k."""

    def forward(self, q, cache, w, ctx, table, max_ctx: int, k: int):
        meta = di.get_paged_mqa_logits_metadata(ctx, cache.shape[1])
        logits = di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, True)
        return logits, logits.topk(k, dim=-1).indices


class Prefill(torch.nn.Module):
    def forward(self, q, k, sc, w, ks, ke):
        out = torch.empty(q.shape[0], k.shape[0], device=q.device)
        di.fp8_mqa_logits(q, (k, sc), w, ks, ke, True, out=out)
        return di.clean_logits(out * 2, ks, ke)


@requires_sm90
def test_torch_compile_fullgraph_matches_eager():
    args = _decode()
    eager_logits, _ = Indexer()(*args, 16)
    logits, idx = torch.compile(Indexer(), fullgraph=True)(*args, 16)
    assert torch.equal(logits, eager_logits)
    ref = reference.paged_mqa_logits(*args[:5], args[5])
    assert torch.equal(torch.isinf(logits), torch.isinf(ref))
    p = _prefill()
    assert torch.equal(torch.compile(Prefill(), fullgraph=True)(*p), Prefill()(*p))
