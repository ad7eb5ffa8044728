"""Many threads and many GPUs: concurrent calls from several threads, per-device runtime state."""
import threading

import pytest
import torch

import deep_indexer as di
from deep_indexer import quant, reference

from conftest import assert_logits_match, requires_sm90

pytestmark = [requires_sm90]


def _prefill_inputs(dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    S, SKV, H, D = 96, 2000, 64, 128
    q = torch.randn(S, H, D, device=dev, generator=g).to(torch.float8_e4m3fn)
    k, sc = quant.per_token_cast_to_fp8(torch.randn(SKV, D, device=dev, generator=g))
    w = torch.randn(S, H, device=dev, generator=g)
    ks = torch.randint(0, SKV // 2, (S,), device=dev, generator=g).to(torch.int32)
    ke = (ks + torch.randint(0, SKV, (S,), device=dev, generator=g)).to(torch.int32)
    return q, (k, sc), w, ks, ke


def _decode_inputs(dev, seed):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(int(n), 128, generator=g).to(dev) for n in torch.randint(0, 3000, (6,), generator=g)]
    cache, table, ctx = quant.pack_paged_kv_cache(keys, 64, generator=g)
    q = torch.randn(6, 2, 64, 128, generator=g).to(dev).to(torch.float8_e4m3fn)
    return q, cache, torch.randn(12, 64, generator=g).to(dev), ctx, table, 3005


def _check_device(dev, seed, errors):
    try:
        with torch.cuda.device(dev):
            stream = torch.cuda.Stream(dev)
            with torch.cuda.stream(stream):
                for it in range(5):
                    q, kv, w, ks, ke = _prefill_inputs(dev, seed + it)
                    out = di.fp8_mqa_logits(q, kv, w, ks, ke, True)
                    ref = reference.mqa_logits(q, kv, w, ks, ke)
                    qd, cache, wd, ctx, table, max_ctx = _decode_inputs(dev, seed + it)
                    meta = di.get_paged_mqa_logits_metadata(ctx, 64)
                    logits = di.fp8_paged_mqa_logits(qd, cache, wd, ctx, table, meta, max_ctx, True)
                    ref_d = reference.paged_mqa_logits(qd, cache, wd, ctx, table, max_ctx)
                    stream.synchronize()
                    assert_logits_match(out, ref, True, torch.float32, f"prefill on {dev}")
                    assert_logits_match(logits, ref_d, True, torch.float32, f"decode on {dev}")
    except Exception as e:  # noqa: BLE001 - re-raised in the main thread
        errors.append(e)


def test_concurrent_threads_one_device():
    errors: list = []
    threads = [threading.Thread(target=_check_device, args=(torch.device("cuda", 0), 100 * t, errors)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_every_device_and_threads_across_devices():
    errors: list = []
    devs = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    threads = [threading.Thread(target=_check_device, args=(d, 7 * i, errors)) for i, d in enumerate(devs * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
