"""Runs one benchmark shape's op a few times, for a profiler (ncu) to pick a launch:
    ncu --kernel-name regex:paged_mqa --launch-skip 2 --launch-count 1 python3 tools/profile_shape.py D1
    ncu --kernel-name regex:mqa_logits_kernel --launch-skip 2 --launch-count 1 python3 tools/profile_shape.py 4096:32768:causal:32:64
    ncu --kernel-name regex:topk_kernel --launch-skip 2 --launch-count 1 python3 tools/profile_shape.py K-D5
"""
from __future__ import annotations

import sys

import torch

import deep_indexer  # noqa: F401  (loads the extension)
from deep_indexer import bench


def main(sid: str, calls: int = 4) -> None:
    dev = torch.device("cuda")
    if sid in bench.TOPK_SHAPES:
        run = bench.topk_run(bench.topk_case(sid, dev, seed=1))
    elif bench.is_prefill_shape(sid):  # P1..P5, P2c or S:SKV:pattern[:H[:D[:max_seqlen_k]]]
        _, run = bench.prefill_case(sid, dev)
    else:
        _, run = bench.decode_case(sid, dev)
    for _ in range(calls):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1])
