#!/usr/bin/env python3
"""GPU time of one-rank decode calls queued eagerly back to back, as a model's layers queue them: this tree's cuep,
or a baseline's and this tree's in one process, alternating.

    python benchmarks/eager_chain.py                          # this tree's cuep
    python benchmarks/eager_chain.py --base HEAD~1            # before / after in one process
    python benchmarks/eager_chain.py --base-dir ../old/cuep   # a baseline package directory (no git needed)

One real rank (every expert local), H = 7168, K = 8, E = 256, max_tokens_per_rank 4096. Per (format, N): ``--calls``
calls (``dispatch``, ``dispatch`` then ``combine`` with the weights given at dispatch, and with ``--ops``
``ops.quantize`` of x to fp8 and ``ops.fused_silu`` to fp8 of [N K, 2 H] rows, outputs given) queued behind a start gate
(``cuep.bench.timing.StartGate``: the host's launch cost stays out), one CUDA event before the first and one after
the last, nothing between them (``python -m cuep.bench --floor`` puts an event around each call, and its chain is a
CUDA graph): us per call, median of ``--repeats``. What a call gains from the kernel before it ending early (the
one-rank kernels launch as programmatic dependents) shows here. Nothing is asserted; outputs are not checked
(``tests/test_local_gpu.py`` checks these calls).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H, K, E, T = 7168, 8, 256, 4096


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="also time this commit's cuep (git archive, as cuep_base)")
    p.add_argument("--base-dir", help="also time the cuep package in this directory")
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"], help="dispatch formats (default %(default)s)")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 128], help="N (default %(default)s)")
    p.add_argument("--calls", type=int, default=16, help="calls queued between the two events (default %(default)s)")
    p.add_argument("--repeats", type=int, default=15, help="timed chains per case and package (default %(default)s)")
    p.add_argument("--ops", action="store_true", help="also chains of ops.quantize and ops.fused_silu (fp8)")
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)
    if args.calls < 1 or args.repeats < 1 or min(args.tokens) < 1 or max(args.tokens) > T:
        p.error(f"--calls and --repeats must be >= 1, --tokens in [1, {T}]")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ab_baseline as ab
    import cupy

    pkgs = ab.labelled_packages(args.base, args.base_dir)
    from cuep.bench.cases import make_inputs
    from cuep.bench.timing import StartGate

    dev = args.device
    cupy.cuda.Device(dev).use()
    gate = StartGate([dev])
    ops_kinds = ("quantize fp8", "fused_silu fp8") if args.ops else ()  # (timed with the first format's Buffers)

    def kinds_of(fmt: str) -> tuple:
        return ("dispatch", "dispatch + combine") + (ops_kinds if fmt == args.formats[0] else ())
    res: dict = {}
    d = None
    for fmt in args.formats:
        bufs = {}
        for label, pkg in pkgs.items():
            cfg = pkg.EPConfig(hidden=H, top_k=K, n_experts=E, n_gpus_per_node=1, max_tokens_per_rank=T,
                               dispatch_format=fmt)
            bufs[label] = (pkg, pkg.Buffer(pkg.init([dev]), cfg, timeout_s=5.0), cfg)
        for n in args.tokens:
            inp = make_inputs([dev], n, H, K, E, n_sets=1)
            x, ids, w = inp.x[0][0], inp.ids[0][0], inp.weights[0][0]
            eos = {}
            for label, (pkg, buf, cfg) in bufs.items():
                eos[label] = eo = cupy.zeros((cfg.capacity, H), dtype=x.dtype)
                for _ in range(3):  # compile, prepare the launches, warm up
                    pkg.combine(buf, eo, pkg.dispatch(buf, x, ids, w))
            if ops_kinds and fmt == args.formats[0]:  # (the same arrays for both packages, never read)
                from cuep.formats import FORMATS

                f8 = FORMATS["fp8"]
                q_out = (cupy.empty((n, f8.payload_bytes(H)), cupy.uint8), cupy.empty((n, f8.scale_bytes(H)),
                                                                                      cupy.uint8))
                h = cupy.zeros((n * K, 2 * H), dtype=x.dtype)
                ro = cupy.asarray([0, n * K], dtype=cupy.int32)
                s_out = (cupy.empty((n * K, H), cupy.uint8), cupy.empty((f8.n_scales(H), n * K), cupy.float32))
                for pkg, _, _ in bufs.values():
                    for _ in range(3):
                        pkg.ops.quantize(x, "fp8", out=q_out)
                        pkg.ops.fused_silu(h, ro, "fp8", out=s_out)
            cupy.cuda.runtime.deviceSynchronize()
            for kind in kinds_of(fmt):
                for rep in range(args.repeats):
                    for label in (list(bufs) if rep % 2 == 0 else list(bufs)[::-1]):
                        pkg, buf, _ = bufs[label]
                        eo = eos[label]
                        start, end = cupy.cuda.Event(), cupy.cuda.Event()
                        gate.launch()
                        start.record()
                        try:
                            for _ in range(args.calls):
                                if kind == "quantize fp8":
                                    pkg.ops.quantize(x, "fp8", out=q_out)
                                elif kind == "fused_silu fp8":
                                    pkg.ops.fused_silu(h, ro, "fp8", out=s_out)
                                else:
                                    d = pkg.dispatch(buf, x, ids, w)
                                    if kind != "dispatch":
                                        pkg.combine(buf, eo, d)
                            end.record()
                        finally:
                            gate.release()
                        end.synchronize()
                        # the last Dispatched goes here, not at the next chain's first call: one that outlives its
                        # Buffer's close() frees that Buffer's memory when dropped (cudaFree waits for the device,
                        # which a held start gate never lets finish)
                        d = None
                        gate.check()
                        res.setdefault((fmt, n, kind, label), []).append(
                            cupy.cuda.get_elapsed_time(start, end) * 1e3 / args.calls)
            print(f"[eager_chain] {fmt} N={n} done", file=sys.stderr, flush=True)
        for _, buf, _ in bufs.values():
            buf.close()
    gate.close()
    labels = list(pkgs)
    name = cupy.cuda.runtime.getDeviceProperties(dev)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"\nus a call, {args.calls} calls queued eagerly back to back (median of {args.repeats}), {name}, "
          f"H={H} K={K} E={E}, one rank")
    head = ["format", "N", "calls"] + labels + (["new/base"] if len(labels) == 2 else [])
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---" for _ in head) + " |")
    for fmt in args.formats:
        for n in args.tokens:
            for kind in kinds_of(fmt):
                meds = [statistics.median(res[(fmt, n, kind, lb)]) for lb in labels]
                row = [fmt, str(n), kind] + [f"{m:.2f}" for m in meds]
                if len(meds) == 2:
                    row.append(f"{meds[1] / meds[0]:.3f}")
                print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
