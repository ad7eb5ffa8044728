"""Summarises the per-SASS-instruction warp-state samples that tools/decode_latency_experiments.sh
exports with NCU_SOURCE=1 (ncu --page source --csv --print-source sass):

    python3 tools/ncu_stalls.py ncu-D3-sass.csv [--top 30] [--range NAME=FIRST-LAST ...]

Prints the kernel's samples by stall reason, the instructions with the most samples (index, samples,
share, executions, SASS, main reasons) and, for each --range (instruction indices, inclusive), the
range's share and main reasons. Samples are per warp: a warp waiting at an instruction is counted
there, so a range's share is the share of warp time spent in it.
"""
from __future__ import annotations

import argparse
import collections
import csv


def load(path: str) -> list:
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    # row 0: kernel name; row 1: header; then one row per instruction
    hdr = table[1]
    col = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    rows = []
    for row in table[2:]:
        if len(row) < len(hdr):
            continue
        rows.append({
            "src": row[col["Source"]].strip(),
            "samples": int(row[col["Warp Stall Sampling (All Samples)"]] or 0),
            "exec": int(row[col["Instructions Executed"]] or 0),
            "reasons": {h[len("stall_"):]: int(row[col[h]] or 0) for h in reasons},
        })
    return rows


def top_reasons(counter: dict, n: int) -> str:
    return ", ".join(f"{k}:{v}" for k, v in sorted(counter.items(), key=lambda kv: -kv[1])[:n] if v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--range", action="append", default=[], help="NAME=FIRST-LAST (instruction indices)")
    a = ap.parse_args()
    rows = load(a.csv)
    total = sum(r["samples"] for r in rows) or 1
    by_reason = collections.Counter()
    for r in rows:
        by_reason.update(r["reasons"])
    print(f"{a.csv}: {len(rows)} instructions, {total} samples")
    for k, v in by_reason.most_common(10):
        print(f"  {k:18s} {v:8d} {v / total:6.1%}")
    print("top instructions (index samples share executions SASS reasons)")
    order = sorted(range(len(rows)), key=lambda i: -rows[i]["samples"])
    for i in order[:a.top]:
        r = rows[i]
        print(f"{i:6d} {r['samples']:7d} {r['samples'] / total:6.1%} {r['exec']:9d}  {r['src'][:58]:58s} "
              f"{top_reasons(r['reasons'], 3)}")
    for spec in a.range:
        name, span = spec.split("=", 1)
        lo, hi = (int(x) for x in span.split("-", 1))
        part = rows[lo:hi + 1]
        s = sum(r["samples"] for r in part)
        c = collections.Counter()
        for r in part:
            c.update(r["reasons"])
        print(f"range {name:14s} [{lo}, {hi}] {s:7d} {s / total:6.1%}  {top_reasons(c, 4)}")


if __name__ == "__main__":
    main()
