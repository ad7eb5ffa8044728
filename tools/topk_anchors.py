"""Side-by-side timing of `topk_indices` against DeepSelect's and FlashInfer's Hopper top-k, in one process.

    python tools/topk_anchors.py --ds-lib DIR/libdeepselect.so --fi-lib DIR/libfitopk.so \
        [--shapes K-V4F K-D5 ...] [--dtypes float32 bfloat16] [--forms "" "DI_TOPK_RESIDENT=1" ...] [--json F]

The anchors are sm_90a builds behind a C ABI (not part of deep_indexer; DeepSelect needs its `ds_ctypes.py`
next to the library). Rows are the bench's top-k shapes (`deep_indexer.bench.TOPK_SHAPES`), cast to the
dtype; each library gets the same rows (DeepSelect in its padded row layout) and is timed by the bench's
method (cold L2, CUDA events, median), the calls of one shape alternated round by round. `--forms` times
deep_indexer once per list of KEY=VALUE switches (colon-separated; "" is the default heuristic).
FlashInfer's kernel takes float32 only. On float32 rows the index sets are compared with the first form's
(they must be equal: every library breaks ties to the smaller index there); bfloat16 rows have many ties at
the k-th value, which DeepSelect breaks in its own order, so only the set sizes are checked.
"""
import argparse
import ctypes
import importlib.util
import json
import os
import sys

import torch

import deep_indexer as di
from deep_indexer.bench import TOPK_SHAPES, Timer, topk_case


def load_ds(path):
    spec = importlib.util.spec_from_file_location("ds_ctypes", os.path.join(os.path.dirname(path), "ds_ctypes.py"))
    os.environ["DS_TOPK_LIB"] = path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def with_env(env: str, fn):
    pairs = [p.split("=", 1) for p in env.split(":") if p]

    def call():
        old = {k: os.environ.get(k) for k, _ in pairs}
        os.environ.update(dict(pairs))
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ds-lib", help="libdeepselect.so (ds_ctypes.py beside it)")
    p.add_argument("--fi-lib", help="libfitopk.so")
    p.add_argument("--shapes", nargs="+", default=list(TOPK_SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--forms", nargs="+", default=[""], help="deep_indexer switch sets, KEY=V[:KEY=V]; '' = default")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    timer = Timer(dev)
    ds = load_ds(args.ds_lib) if args.ds_lib else None
    fi = ctypes.CDLL(args.fi_lib) if args.fi_lib else None
    fi_state = torch.zeros(1 << 20, dtype=torch.uint8, device=dev) if fi else None
    results = []
    for sid in args.shapes:
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            x = topk_case(sid, dev, seed=1)
            logits = x["logits"].to(dtype)
            rows, n, k = x["rows"], x["n"], x["k"]
            ks, ke = x["ks"], x["ke"]
            out = torch.empty(rows, k, dtype=torch.int32, device=dev)
            calls, names, outs = [], [], []
            for form in args.forms:
                calls.append(with_env(form, lambda: di.topk_indices(logits, k, ks, ke, out=out)))
                names.append("di" + (f"[{form}]" if form else ""))
                outs.append(out)
            if ds is not None:
                xd = ds.empty_input(rows, n, dtype)
                xd.copy_(logits)
                ds_out = ds.empty_output(rows, k)
                calls.append(lambda: ds.topk(xd, k, lengths=ke, out=ds_out))
                names.append("deepselect")
                outs.append(ds_out)
            if fi is not None and dtype == torch.float32:
                lf = logits if logits.stride(1) == 1 else logits.contiguous()
                fi_out = torch.empty(rows, k, dtype=torch.int32, device=dev)
                offs = torch.zeros(rows, dtype=torch.int32, device=dev)
                lens = ke.clone()
                P = ctypes.c_void_p
                calls.append(lambda: fi.fi_topk_ragged(P(lf.data_ptr()), P(fi_out.data_ptr()), P(offs.data_ptr()),
                                                       P(lens.data_ptr()), ctypes.c_uint(rows), ctypes.c_uint(k),
                                                       ctypes.c_uint(lf.stride(0)), P(fi_state.data_ptr()), 1, 1,
                                                       P(torch.cuda.current_stream().cuda_stream)))
                names.append("flashinfer")
                outs.append(fi_out)
            # Checks: every library's sets against the first form of deep_indexer's.
            calls[0]()
            ref = torch.sort(out, dim=1).values
            check = {}
            for c, name, o in zip(calls, names, outs):
                c()
                got = torch.sort(o, dim=1).values
                if dtype == torch.float32 or name.startswith("di"):
                    check[name] = bool(torch.equal(got, ref))
                else:
                    check[name] = bool(torch.equal((got >= 0).sum(1), (ref >= 0).sum(1)))
            us = timer.alternated(calls, args.iters)
            r = {"id": sid, "dtype": dt, "shape": x["shape"], "us": dict(zip(names, us)), "same_sets": check}
            results.append(r)
            line = "  ".join(f"{nm} {t:7.1f}" + ("" if check[nm] else " (DIFF)") for nm, t in zip(names, us))
            print(f"{sid:9s} {dt:8s} {line}", flush=True)
            del x, logits
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
