#!/usr/bin/env python3
"""Where the microseconds of a one-rank dispatch go, inside its one launch (issue 24, item 1).

    PYTHONPATH=. python3 benchmarks/trace_local.py                        # bf16 nvfp4, N = 1 32 128
    PYTHONPATH=. python3 benchmarks/trace_local.py --formats fp8 --tokens 16 --out out/trace
    PYTHONPATH=. python3 benchmarks/trace_local.py --formats nvfp4 --tokens 4096   # a larger round
    PYTHONPATH=. python3 benchmarks/trace_local.py --formats fp8 --tokens 1 32 --items   # + padding / item warps
    python3 benchmarks/trace_local.py --dry-run                           # build and list the points (no GPU)

A one-rank round is one launch, so ``python -m cuep.bench --floor --phases`` cannot split it. This script copies the
``cuep`` package to a work directory and adds trace points to the copy's one-rank path
(``cuda_src/dispatch/local.cuh``; the product is never changed): at each point thread 0 of every block (at the small
round's layout points, "team-": the first thread of the warps laying it out, the last 8 in a split layout) writes
``%globaltimer`` to a device array. The copy then runs in a child process (its own kernel cache entries, since the
source differs), H = 7168, K = 8, E = 256, one real rank, max_tokens_per_rank = max(``--tokens``), so
small_batch_tokens is min(that, 256): N up to it takes the small round (POINTS: the book, the scan, the items), a
larger N the larger round (LARGE_POINTS: the count, its grid barrier, the items, the deferred scale gather).
``--items`` adds warp points to the small round (ITEM_POINTS: lane 0 of every warp passing one keeps the latest
time, so each is the block's last warp there): the padding's start and end, each item's start, encode, payload and
scale stores and end (an atomic each, so these perturb the round a little more). Per format and N, after untimed
warm-up rounds, ``--reps`` dispatches each after a combine (as in a model), every point's time after its block's
entry, the median over blocks (and the slowest block), median over the reps. A point is that thread's view, except
where it follows a barrier (then it is the block's or the team's). The points themselves cost a little (two stores
each); the untraced launch around them (entry and drain) is the rest of ``cuep.bench --floor``'s figure.

Each point is placed by an anchor, a line of the source it goes before or after; when the source changes and an
anchor no longer matches exactly once, the build stops and names it (tests/test_trace_local_cpu.py checks them
against the current tree on every CI run, and compiles the traced copy). Output: a table per (format, N), and
``trace_local.json`` under ``--out``. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACED_FILE = "cuda_src/dispatch/local.cuh"
MAX_BLOCKS = 1024
SLOTS = 24  # trace words per block
H, K, E = 7168, 8, 256

# (point, what it marks, anchor, where, guard): the point's code goes "before" or "after" the anchor (which must
# occur exactly once in TRACED_FILE), "inside" it (after its first line), or "sync-before" / "sync-after" (a block
# barrier, then the point), or "warp-before" / "warp-after" (lane 0 of every warp passing it, the latest time kept:
# the block's last warp there); `guard` keeps a point in code both rounds share (its barrier too) to its own round.
# In the order a block passes them.
SCANNED = "    if (lays_out) local_scan_groups<FMT, Team>(ep, s_shared_n, count_of, s_offsets, s_tiles, &s_tiles_end);\n"  # both
JOINED = "    if (kMaySplit) __syncthreads();  // the item warps join: the layout and s_failed are the block's\n"
PLACED = "    // 4. (deferred) The scales in whole lines"  # both rounds: the items loop is done
POINTS = [  # the small round (dispatch_local with kBook)
    ("entry", "the block starts the placement", "    const int failed = kBook ? read_failed(ep) : 0;\n", "before", "kBook"),
    ("ids issued", "the book's first top-k loads issued", "    load(0);\n    meanwhile();\n", "team-inside", ""),
    ("prepared", "the warp's first item planned, its loads issued", "    meanwhile();\n", "team-after", ""),
    ("masks cleared", "barrier: expert masks zeroed", "    Team::sync();\n    for (int t0 = 0; t0 < N; t0 += kLoads * per_pass) {\n", "team-inside", ""),
    ("book done", "barrier: every choice in its expert's mask", "        layout = smem + small_book_bytes(ep);\n", "team-before", ""),
    ("groups scanned", "barrier: the groups' first rows (and scale tiles)", SCANNED, "team-after", "kBook"),
    ("layout joined", "barrier: (split) the item warps' first items encoded", JOINED, "after", "kBook"),
    ("items placed", "barrier: the block's rows, scales and metadata stored", PLACED, "sync-before", "kBook"),
]
# --items: warp points of the small round's padding and items (inserted before its "items placed")
ITEM_POINTS = [
    ("pad start", "the block's last warp at the padding", "    if (warp >= pad_warp)\n        for (int g = blockIdx.x;",
     "warp-before", "kBook"),
    ("padded", "the last padding warp done (stores issued)", "    // 3. Items: encode the chunk once", "warp-before",
     "kBook && warp >= pad_warp"),
    ("item start", "the last item warp at its item", "        const bool prepared = kPrepares && item == item0;",
     "warp-before", "kBook"),
    ("encoded", "the last item warp encoded its chunk (or not, bf16)",
     "        // the token's rows (lane k: choice k's row, or -1)", "warp-before", "kBook"),
    ("payload stored", "the last item warp's payload stores issued", "        if (sb && defer) {\n", "warp-before",
     "kBook"),
    ("scales placed", "the last item warp's scale stores issued",
     "        if (ch == 0) {\n            if (row >= 0) {\n", "warp-before", "kBook"),
    ("item done", "the last item warp's metadata stored",
     "        __syncwarp();  // the staging is reused by the warp's next item\n", "warp-after", "kBook"),
]


def small_points(items: bool = False) -> list:
    """The small round's points, in slot order: POINTS, with ITEM_POINTS before its last (``--items``)."""
    return POINTS[:-1] + ITEM_POINTS + POINTS[-1:] if items else POINTS


LARGE_POINTS = [  # the larger round (dispatch_local_large, dispatch_local without kBook)
    ("entry", "the block starts the round", "    __shared__ int s_gen, s_ok;\n", "before", ""),
    ("counted", "barrier: the block's tokens counted, its histogram atomics done", "    local_count(ep, a, local_hist(ep, parity), s_count);\n", "after", ""),
    ("first encoded", "thread 0's warp planned (quantized: encoded) its first item", "        prepare();\n        if (!counted()) return;\n", "inside", ""),
    ("all counted", "barrier: every block's count in (the grid barrier)", "        if (!counted()) return;\n", "after", ""),
    ("groups scanned", "barrier: the groups' first rows (and scale tiles)", SCANNED, "after", "!kBook"),
    ("items placed", "barrier: the block's rows (and scale records) stored", PLACED, "sync-before", "!kBook"),
    ("all noted", "(deferred scales) warp 0 of the block: every warp's records in", "        gather_scales<FMT>(ep, a, 0,", "before", ""),
    ("gathered", "(deferred scales) barrier: the block's scale tiles stored", "static_cast<int>(blockIdx.x), grid_warps, lane);\n", "sync-after", ""),
]
LARGE_BASE = 16  # the larger round's slots: LARGE_BASE + its point's index

# Every point first loads a shared word and reads the timer only if it differs from a value it never holds: the
# timer read then waits for that load, and a load waits for the barrier before it. (A plain timer read right after
# __syncthreads issued before the barrier released the warp, BAR.SYNC.DEFER_BLOCKING: an N = 1 split round's item
# warps read "joined" 0.7 us before the layout they joined was scanned, though a flag set after the scan was seen
# past the barrier in 2640 of 2640 block rounds.)
HEADER = f"""
#ifndef CUEP_TRACE_LOCAL
#define CUEP_TRACE_LOCAL
extern "C" {{ __device__ unsigned long long cuep_trace_local[{MAX_BLOCKS} * {SLOTS}]; }}
__device__ __forceinline__ bool cuep_trace_gate() {{ __shared__ int w_; return *(volatile int*)&w_ != 0x5EED7ACE; }}
#define CUEP_TP(i) do {{ if (threadIdx.x == 0 && blockIdx.x < {MAX_BLOCKS} && cuep_trace_gate()) {{ unsigned long long g_; \\
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_)); cuep_trace_local[blockIdx.x * {SLOTS} + (i)] = g_; }} }} while (0)
#define CUEP_TPT(i) do {{ if (Team::tid() == 0 && blockIdx.x < {MAX_BLOCKS} && cuep_trace_gate()) {{ unsigned long long g_; \\
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_)); cuep_trace_local[blockIdx.x * {SLOTS} + (i)] = g_; }} }} while (0)
#define CUEP_TW(i) do {{ if (threadIdx.x % 32 == 0 && blockIdx.x < {MAX_BLOCKS} && cuep_trace_gate()) {{ unsigned long long g_; \\
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_)); atomicMax(&cuep_trace_local[blockIdx.x * {SLOTS} + (i)], g_); }} }} while (0)
#endif
"""


def _place(out: str, name: str, anchor: str, where: str, guard: str, slot: int) -> str:
    n = out.count(anchor)
    if n != 1:
        raise ValueError(f"trace point {name!r}: its anchor occurs {n} times in {TRACED_FILE} (want 1): "
                         f"{anchor!r}; update POINTS / LARGE_POINTS in benchmarks/trace_local.py to the source")
    tp = f"CUEP_TP({slot});"
    if where.startswith("warp-"):  # lane 0 of each warp, the latest time kept
        tp, where = f"CUEP_TW({slot});", where[len("warp-"):]
    if where.startswith("team-"):  # by the first thread of the warps laying the round out (dispatch_local's team)
        tp, where = f"CUEP_TPT({slot});", where[len("team-"):]
    if where.startswith("sync-"):  # a barrier, then the point: one barrier in each round (the guard is constexpr)
        tp = f"__syncthreads(); {tp}"
    if guard:
        tp = f"if ({guard}) {{ {tp} }}"
    if where == "inside":  # after the anchor's first line
        first, rest = anchor.split("\n", 1)
        code = first + f"\n    {tp}\n" + rest
    elif where.endswith("after"):  # after, sync-after (the block's last warp is done)
        code = anchor + f"    {tp}\n"
    else:  # before, sync-before
        code = f"    {tp}\n" + anchor
    return out.replace(anchor, code)


def traced_source(src: str, items: bool = False) -> str:
    """``src`` (TRACED_FILE's text) with the trace header and every point (``items``: ITEM_POINTS too); ValueError
    naming a missing anchor."""
    out = src
    for i, (name, _, anchor, where, guard) in enumerate(small_points(items)):
        out = _place(out, name, anchor, where, guard, i)
    for i, (name, _, anchor, where, guard) in enumerate(LARGE_POINTS):
        out = _place(out, name, anchor, where, guard, LARGE_BASE + i)
    marker = "#pragma once\n"
    if out.count(marker) != 1:
        raise ValueError(f"{TRACED_FILE} has no single '#pragma once' to put the trace header after")
    return out.replace(marker, marker + HEADER)


def build(work: Path, items: bool = False) -> Path:
    """Copy ROOT/cuep to ``work``/cuep with the points added; returns the copy's package directory."""
    dst = work / "cuep"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(ROOT / "cuep", dst, ignore=shutil.ignore_patterns("__pycache__"))
    path = dst / TRACED_FILE
    path.write_text(traced_source(path.read_text(), items))
    return dst


def child(args) -> int:
    """Runs with the traced copy first on sys.path: time, trace, print, write JSON."""
    import numpy as np
    import cupy
    import ml_dtypes
    import cuep
    from cuep import _kernels

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(args.seed)
    results = {}
    for fmt in args.formats:
        cfg = cuep.EPConfig(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=max(args.tokens),
                            n_gpus_per_node=1, dispatch_format=fmt)
        buf = cuep.Buffer(cuep.init([args.device]), cfg)
        eo = cupy.asarray(rng.standard_normal((cfg.capacity, H), np.float32).astype(bf16))
        print(f"[trace] {fmt}: compiling / loading the traced kernels", file=sys.stderr, flush=True)
        trace = cupy.ndarray((MAX_BLOCKS * SLOTS,), cupy.uint64,
                             memptr=_kernels.module("dispatch.cu", part=fmt).get_global("cuep_trace_local"))
        for n in args.tokens:
            small = n <= cfg.small_batch_tokens
            points, base = (small_points(args.items), 0) if small else (LARGE_POINTS, LARGE_BASE)
            x = cupy.asarray(rng.standard_normal((n, H), np.float32).astype(bf16))
            ids = cupy.asarray(np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int32))
            w = cupy.asarray(rng.random((n, K), np.float32))
            for _ in range(args.warmup):
                cuep.combine(buf, eo, cuep.dispatch(buf, x, ids, w))
            cupy.cuda.Device().synchronize()
            per_rep = []
            for _ in range(args.reps):
                d = cuep.dispatch(buf, x, ids, w)
                trace.fill(0)
                cuep.combine(buf, eo, d)
                cuep.dispatch(buf, x, ids, w)
                cupy.cuda.Device().synchronize()
                a = trace.get().reshape(MAX_BLOCKS, SLOTS)[:buf.num_sms, base:base + len(points)].astype(np.int64)
                rel = (a - a[:, :1]) / 1e3  # us after the block's entry
                ok = a[:, 0] != 0
                per_rep.append([(float(np.median(rel[ok & (a[:, i] != 0), i])), float(rel[ok & (a[:, i] != 0), i].max()))
                                if (ok & (a[:, i] != 0)).any() else (float("nan"), float("nan"))
                                for i in range(len(points))])
            buf.check()
            med = [statistics.median(r[i][0] for r in per_rep) for i in range(len(points))]
            slow = [statistics.median(r[i][1] for r in per_rep) for i in range(len(points))]
            results[f"{fmt} N={n}"] = {"format": fmt, "N": n, "round": "small" if small else "larger",
                                       "points": [p[0] for p in points], "median_block_us": med,
                                       "slowest_block_us": slow}
            print(f"\n{fmt}, N = {n} ({'small' if small else 'larger'} round): us after the block's entry (median "
                  f"block / slowest block, median of {args.reps}; step = from the point before, median block; nan: "
                  f"not reached)")
            print(f"  {'point':16s} {'median':>7s} {'slowest':>8s} {'step':>6s}  marks")
            for i, (name, what, *_) in enumerate(points):
                step = med[i] - med[i - 1] if i else 0.0
                print(f"  {name:16s} {med[i]:7.2f} {slow[i]:8.2f} {step:6.2f}  {what}")
        buf.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": cupy.cuda.runtime.getDeviceProperties(args.device)["name"].decode(), "H": H, "K": K, "E": E,
            "reps": args.reps}
    (out / "trace_local.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\nwrote {out / 'trace_local.json'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "fp8", "nvfp4", "mxfp4"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 128])
    p.add_argument("--reps", type=int, default=25, help="traced dispatches per (format, N) (default 25)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "out/trace_local"))
    p.add_argument("--work-dir", default=None, help="where the traced copy goes (default <tmp>/cuep_trace_local)")
    p.add_argument("--items", action="store_true",
                   help="also the small round's warp points (padding, each item's encode, stores, scales)")
    p.add_argument("--dry-run", action="store_true", help="build the traced copy and list the points; no GPU")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    work = Path(args.work_dir or Path(tempfile.gettempdir()) / "cuep_trace_local")
    work.mkdir(parents=True, exist_ok=True)
    pkg = build(work, args.items)
    small = small_points(args.items)
    print(f"[trace] traced copy: {pkg} ({len(small) + len(LARGE_POINTS)} points in {TRACED_FILE})", file=sys.stderr)
    if args.dry_run:
        for title, points, base in (("small round", small, 0), ("larger round", LARGE_POINTS, LARGE_BASE)):
            print(f"{title}:")
            for i, (name, what, _, where, _) in enumerate(points):
                print(f"  {base + i:2d}  {name:16s} {where:11s} {what}")
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *(argv if argv is not None else sys.argv[1:])]
    return subprocess.run(cmd, env=env, timeout=1800).returncode


if __name__ == "__main__":
    sys.exit(main())
