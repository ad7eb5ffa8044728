"""Kernel-only durations (CUPTI, through torch.profiler) next to the event-timed call, per decode shape.

    python3 tools/kernel_time.py D1 D2 D5 [--iters 50] [--flush write|read] [--json FILE]

The benchmark times the whole call between two CUDA events, which includes the launch and the
event overhead (an empty kernel measures ~2.8 us that way on H200). This tool times the same calls
(cold L2, flushed like the benchmark) and reads each kernel's own GPU duration from the profiler,
so the two can be compared: median event time, median kernel duration, and the same for an empty
kernel (torch.cuda._sleep(0)). A shape is a benchmark id (D1..D7) or B:next_n:avg[:H].
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from deep_indexer import bench


def kernel_durations(fn, timer: bench.Timer, iters: int, match: str) -> list[float]:
    """GPU durations (us) of the kernels whose name contains `match`, one per call of fn."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            timer.flush_l2()
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and match in e.name:
            out.append(e.time_range.elapsed_us())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="+")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--flush", choices=("write", "read"), default="write")
    p.add_argument("--json", default="")
    a = p.parse_args()
    dev = torch.device("cuda")
    timer = bench.Timer(dev, a.flush)
    rows = []
    empty = lambda: torch.cuda._sleep(0)  # noqa: E731
    cases = [("empty kernel", empty, "spin")]  # at::cuda::sleep launches spin_kernel
    for sid in a.shapes:
        _, run = bench.decode_case(sid, dev)
        cases.append((sid, run, "paged_mqa_logits_kernel"))
    # All event timings first: once the profiler has run, CUPTI stays attached and slows every launch
    # (the host then falls behind the GPU and event times grow by tens of microseconds).
    events = [timer(run, iters=a.iters) for _, run, _ in cases]
    for (sid, run, match), ev in zip(cases, events):
        ks = kernel_durations(run, timer, a.iters, match)
        if not ks:
            print(f"{sid:>14}: no kernel named *{match}* in the profile")
            continue
        k = statistics.median(ks)
        rows.append({"shape": sid, "event_us": ev, "kernel_us": k, "kernels": len(ks)})
        print(f"{sid:>14}: event-timed {ev:7.1f} us   kernel only (CUPTI) {k:7.1f} us   "
              f"(min {min(ks):.1f}, {len(ks)} kernels)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "flush": a.flush, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
