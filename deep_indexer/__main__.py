"""Command line: `python -m deep_indexer {precompile,cache,bench,deep-gemm}`."""
from __future__ import annotations

import argparse
import os
import sys

from . import bench, deep_gemm as dg, jit


def _precompile(args) -> int:
    def progress(done: int, total: int, r: dict) -> None:
        status = "FAILED" if "error" in r else ("hit" if r.get("from_cache") else f"{r['seconds']:.1f}s")
        print(f"[{done}/{total}] {r['params']} {status}", file=sys.stderr, flush=True)

    try:
        results = jit.precompile(ops=args.ops, heads=args.heads, head_dims=args.head_dims, next_n=args.next_n,
                                 block_kv=args.block_kv, logits_dtypes=args.logits_dtypes, arch=args.arch,
                                 jobs=args.jobs, progress=None if args.quiet else progress,
                                 paged_inputs=args.paged_inputs)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    jit.print_table(results)
    failed = [r for r in results if "error" in r]
    spilled = [r for r in results if "error" not in r and (r["spill_stores"] or r["spill_loads"])]
    for r in failed:
        print(f"\nFAILED {r['params']}:\n{r['error']}", file=sys.stderr)
    hits = sum(1 for r in results if r.get("from_cache"))
    compiled = len(results) - len(failed)
    print(f"compiled {compiled} kernels ({hits} from cache), {len(spilled)} spilled")
    return 1 if failed or spilled else 0


def _cache(args) -> int:
    if args.action == "info":
        info = jit.cache_info()
        print(f"path: {info['path']}\nentries: {info['entries']}\nsize: {info['bytes'] / 2**20:.1f} MiB")
    else:
        print(f"removed {jit.cache_clear()} entries")
    return 0


def _bench(args) -> int:
    return bench.main(args)


def _deep_gemm(args) -> int:
    path = os.path.join(dg._site_dir(args.site_dir), dg.HOOK_FILE)
    if args.action == "enable":
        dg.enable_env_switch(args.site_dir)
        print(f"wrote {path}: Python processes of this environment started with {dg.HOOK_ENV}=1 now route "
              f"deep_gemm's indexer functions to deep_indexer; `python -m deep_indexer deep-gemm disable` removes it")
    elif args.action == "disable":
        print(f"removed {path}" if dg.disable_env_switch(args.site_dir) else f"not enabled (no {path})")
    else:
        on = os.path.exists(path)
        print(f"{'enabled' if on else 'not enabled'}: {path}; {dg.HOOK_ENV}={os.environ.get(dg.HOOK_ENV, '(unset)')}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deep_indexer", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    pc = sub.add_parser("precompile", help="compile kernel variants into the disk cache (no GPU needed with --arch)")
    pc.add_argument("--arch", default=None, help="target architecture (only sm_90a); default: the current GPU's "
                                                 "(needs one)")
    pc.add_argument("--ops", nargs="+", default=None, metavar="OP",
                    help=f"kernels to compile (default: all): {' '.join(jit.OPS)}")
    pc.add_argument("--heads", nargs="+", type=int, default=None, metavar="H",
                    help=f"indexer head counts (default: all of {' '.join(map(str, jit.HEADS))})")
    pc.add_argument("--head-dims", nargs="+", type=int, default=None, metavar="D",
                    help="head dims (default: every dim each op supports: prefill 32 64 128, decode 64 128, "
                         "training 64 128)")
    pc.add_argument("--next-n", nargs="+", type=int, default=None, metavar="N",
                    help=f"decode query tokens per sequence (default: all of {' '.join(map(str, jit.NEXT_N))})")
    pc.add_argument("--block-kv", nargs="+", type=int, default=None, metavar="B",
                    help=f"paged-cache block sizes in tokens (default: both of {' '.join(map(str, jit.BLOCK_KV))})")
    pc.add_argument("--logits-dtypes", nargs="+", default=None, metavar="DTYPE",
                    help=f"logits dtypes (default: both of {' '.join(jit.LOGITS_DTYPES)})")
    pc.add_argument("--paged-inputs", nargs="+", default=None, metavar="FORM",
                    help=f"decode input forms, q and paged cache in FP8 or FP4 (default: all of "
                         f"{' '.join(jit.PAGED_INPUTS)})")
    pc.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes (default: CPU count)")
    pc.add_argument("--quiet", action="store_true", help="no per-variant progress lines")
    pc.set_defaults(func=_precompile)

    cc = sub.add_parser("cache", help="inspect or clear the on-disk kernel cache (DI_JIT_CACHE_DIR, default "
                                      "~/.cache/deep_indexer)")
    cc.add_argument("action", choices=["info", "clear"],
                    help="info: the cache's path, entry count and size; clear: remove every entry (safe while "
                         "other processes run: they recompile)")
    cc.set_defaults(func=_cache)

    bp = sub.add_parser("bench", help="benchmark the standard shapes against the device's measured ceilings (`bench --help` lists them)")
    bench.add_arguments(bp)
    bp.set_defaults(func=_bench)

    dg = sub.add_parser("deep-gemm", help="the DI_DEEP_GEMM=1 switch: route `deep_gemm`'s indexer functions to "
                                          "deep_indexer in every process started with it")
    dg.add_argument("action", choices=["enable", "disable", "status"],
                    help="enable: write the startup hook; disable: remove it; status: whether it is written")
    dg.add_argument("--site-dir", default=None, help="where to write the hook (default: this environment's site-packages)")
    dg.set_defaults(func=_deep_gemm)

    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
