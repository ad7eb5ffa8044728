"""Kernel-only (CUPTI) durations of decode shapes under different launch patterns, to tell whether a
kernel itself runs slower after the GPU has idled (clock / power state) than back to back:

    python3 tools/power_probe.py D3 D4 [--iters 30] [--rounds 2] [--flush write|read]

Patterns (every call after an L2 flush):
    b2b   : flush, call, flush, call, ... all enqueued, one synchronize at the end (busy GPU)
    sync  : flush, call, synchronize (the GPU idles while the host launches the next iteration;
            the event-timed bench works this way)
    slack : flush, 100 us GPU-side wait (torch.cuda._sleep), call, synchronize
Prints the median kernel duration per pattern and round. With --events: event-timed medians (as
the bench) instead, for sync and for sync plus a host-side pause of --gaps microseconds after each
iteration (the GPU idles longer between calls: a lower average power); --prewarm-ms N first runs N ms of
back-to-back calls (as the bench's warm-up of short calls did before 2026-11-22f).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from deep_indexer import bench


def durations(fn, timer: bench.Timer, iters: int, pattern: str) -> list:
    before = (lambda: torch.cuda._sleep(200_000)) if pattern == "slack" else None
    return bench.kernel_durations(fn, timer, iters, "paged_mqa_logits_kernel", before=before,
                                  sync_each=pattern != "b2b")


def event_times(fn, timer: bench.Timer, iters: int, gap_us: float) -> list:
    def pause() -> None:
        t = time.perf_counter() + gap_us * 1e-6
        while time.perf_counter() < t:
            pass

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    return timer.times(fn, iters, after=pause if gap_us else None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flush", choices=("write", "read"), default="write")
    ap.add_argument("--events", action="store_true")
    ap.add_argument("--gaps", type=float, nargs="+", default=[0, 200, 1000])
    ap.add_argument("--prewarm-ms", type=float, nargs="+", default=[0])
    a = ap.parse_args()
    dev = torch.device("cuda")
    timer = bench.Timer(dev, a.flush, host_slack_us=0)
    patterns = ["b2b", "sync", "slack"]
    for sid in a.shapes:
        _, run = bench.decode_case(sid, dev)
        if a.events:
            for rnd in range(a.rounds):
                for pw in a.prewarm_ms:
                    cells = []
                    for g in a.gaps:
                        if pw:
                            t = time.perf_counter() + pw * 1e-3
                            while time.perf_counter() < t:
                                run()
                            torch.cuda.synchronize()
                        d = event_times(run, timer, a.iters, g)
                        cells.append(f"gap {g:g} us {statistics.median(d):6.1f} (min {min(d):6.1f})")
                    print(f"{sid} events round {rnd} prewarm {pw:g} ms: " + " | ".join(cells), flush=True)
            continue
        for rnd in range(a.rounds):
            order = patterns[rnd % 3:] + patterns[:rnd % 3]
            cells = []
            for p in order:
                d = durations(run, timer, a.iters, p)
                cells.append(f"{p} {statistics.median(d):6.1f} (min {min(d):6.1f} max {max(d):6.1f})")
            print(f"{sid} round {rnd}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
