"""deep_indexer.baseline (the plain-PyTorch stand-in for `bench --compare`): same API, reference results."""
from __future__ import annotations

import inspect

import pytest
import torch

import deep_indexer as di
from deep_indexer import baseline, quant, reference

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("name", ["fp8_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits",
                                  "clean_logits"])
def test_same_signature_as_the_package(name):
    ours = inspect.signature(getattr(di, name)).parameters
    theirs = inspect.signature(getattr(baseline, name)).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.values()]


def test_prefill_matches_reference_and_fills_out():
    S, SKV, H, D = 9, 70, 16, 32
    q = torch.randn(S, H, D).to(FP8)
    kv = quant.per_token_cast_to_fp8(torch.randn(SKV, D))
    w = torch.randn(S, H)
    ks = torch.randint(-5, SKV, (S,), dtype=torch.int32)
    ke = ks + torch.randint(-5, SKV, (S,), dtype=torch.int32)
    out = torch.full((S, SKV), float("nan"), dtype=torch.bfloat16)
    got = baseline.fp8_mqa_logits(q, kv, w, ks, ke, True, logits_dtype=torch.bfloat16, out=out)
    assert got is out
    assert torch.equal(got, reference.mqa_logits(q, kv, w, ks, ke, logits_dtype=torch.bfloat16))


def test_decode_matches_reference():
    B, next_n, H, D, bkv = 3, 2, 16, 64, 32
    keys = [torch.randn(n, D) for n in (40, 0, 77)]
    cache, table, ctx = quant.pack_paged_kv_cache(keys, bkv)
    q = torch.randn(B, next_n, H, D).to(FP8)
    w = torch.randn(B * next_n, H)
    meta = reference.paged_mqa_logits_metadata(ctx, bkv, 4)
    got = baseline.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, 80)
    assert torch.equal(got, reference.paged_mqa_logits(q, cache, w, ctx, table, 80))
    assert torch.equal(baseline.get_paged_mqa_logits_metadata(ctx, bkv, 4), meta)
