"""Warm host overhead per op call (GPU idle, many calls) and first-call time in a fresh process
(cubin loaded from the disk cache). Run on the GPU machine after the cache is warm."""
import argparse
import json
import statistics
import subprocess
import sys
import time

import torch


def per_call_us(fn, calls=200, rounds=15) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def ops_under_test():
    import deep_indexer as di
    from deep_indexer.bench import decode_inputs, prefill_inputs

    dev = torch.device("cuda")
    out = {}
    logits = torch.randn(4, 256, device=dev)
    ke = torch.full((4,), 100, dtype=torch.int32, device=dev)
    out["clean_logits"] = lambda: di.clean_logits(logits, None, ke)
    if hasattr(di, "fp8_mqa_logits"):
        x = prefill_inputs(4, 256, "causal", 64, 128, dev)
        out["fp8_mqa_logits"] = lambda: di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], True)
    if hasattr(di, "fp8_paged_mqa_logits"):
        y = decode_inputs(2, 1, 256, 64, 128, 64, dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        meta = di.get_paged_mqa_logits_metadata(y["context_lens"], 64, sms)
        out["get_paged_mqa_logits_metadata"] = lambda: di.get_paged_mqa_logits_metadata(y["context_lens"], 64, sms)
        out["fp8_paged_mqa_logits"] = lambda: di.fp8_paged_mqa_logits(
            y["q"], y["kv_cache"], y["weights"], y["context_lens"], y["block_table"], meta, y["max_context_len"], False)
    return out


FIRST_CALL = """
import time, json
t0 = time.perf_counter()
import torch, deep_indexer as di
torch.zeros(1, device='cuda'); torch.cuda.synchronize()
t1 = time.perf_counter()
import sys; sys.path.insert(0, 'tools')
from host_overhead import ops_under_test
res = {'import_s': t1 - t0}
for name, fn in ops_under_test().items():
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
    res[name + '_first_call_s'] = time.perf_counter() - t
print(json.dumps(res))
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="overhead.json")
    a = p.parse_args()
    res = {"warm_us_per_call": {k: per_call_us(f) for k, f in ops_under_test().items()}}
    r = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True)
    res["fresh_process"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else r.stderr[-2000:]
    print(json.dumps(res, indent=1))
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
