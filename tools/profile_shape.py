"""Runs one benchmark shape's op a few times, for a profiler (ncu) to pick a launch:
    ncu --kernel-name regex:paged_mqa --launch-skip 2 --launch-count 1 python3 tools/profile_shape.py D1
"""
from __future__ import annotations

import sys

import torch

import deep_indexer as di
from deep_indexer import bench


def main(sid: str, calls: int = 4) -> None:
    dev = torch.device("cuda")
    if sid in bench.PREFILL_SHAPES:
        S, SKV, pat = bench.PREFILL_SHAPES[sid]
        x = bench.prefill_inputs(S, SKV, pat, 64, 128, dev)
        run = lambda: di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], True)
    else:
        _, run = bench.decode_case(sid, dev)
    for _ in range(calls):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1])
