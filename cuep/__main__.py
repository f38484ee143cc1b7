"""``python -m cuep``: one dispatch/combine round on all local GPUs, checked against the NumPy reference.

Without a GPU it says so and runs the reference on the CPU with simulated ranks instead.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _routing(rng, n, cfg):
    return np.argsort(-rng.random((n, cfg.n_experts)), axis=1)[:, : cfg.top_k].astype(np.int32)


def _table(rows: list[tuple], header: tuple) -> str:
    cols = list(zip(header, *rows))
    widths = [max(len(str(c)) for c in col) for col in cols]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])


def run_cpu(args) -> int:
    import ml_dtypes

    from . import EPConfig
    from . import reference as ref

    cfg = EPConfig(hidden=args.hidden, top_k=args.top_k, n_experts=args.experts, max_tokens_per_rank=args.tokens,
                   n_gpus_per_node=args.ranks, dispatch_format=args.format)
    rng = np.random.default_rng()
    xs = [rng.standard_normal((args.tokens, cfg.hidden)).astype(ml_dtypes.bfloat16) for _ in range(cfg.n_ranks)]
    ids = [_routing(rng, args.tokens, cfg) for _ in range(cfg.n_ranks)]
    ws = [rng.random((args.tokens, cfg.top_k)).astype(np.float32) for _ in range(cfg.n_ranks)]
    t0 = time.perf_counter()
    d = ref.dispatch(xs, ids, cfg)
    deq = [ref.dequantize(*(_payload_scales(di, cfg)), cfg.fmt.name, cfg.hidden) for di in d]
    out = ref.combine(deq, d, ws, cfg)
    dt = time.perf_counter() - t0
    rows = []
    for r in range(cfg.n_ranks):
        want = xs[r].astype(np.float32) * ws[r].sum(1, keepdims=True)
        err = float(np.linalg.norm(out[r] - want) / np.linalg.norm(want))
        counts = np.diff(d[r].row_offsets)
        rows.append((r, args.tokens, int(d[r].row_offsets[-1]), int(counts.min()), int(counts.max()), f"{err:.2e}"))
    print(cfg.describe())
    print(_table(rows, ("rank", "tokens", "rows recv", "min/expert", "max/expert", "rel err")))
    print(f"reference round (dispatch + identity experts + combine) on the CPU: {dt:.2f} s")
    return 0


def _payload_scales(d, cfg):
    """A reference Dispatched's rows as (payload, per-row scales) for dequantize (identity experts)."""
    from .reference import unswizzle_block_scales

    rows = d.n_rows
    payload = np.ascontiguousarray(d.tokens).view(np.uint8).reshape(rows, -1)
    if cfg.fmt.name == "bf16":
        scales = np.zeros((rows, 0), np.uint8)
    elif cfg.fmt.name == "fp8":
        scales = np.ascontiguousarray(d.scales.T).view(np.uint8).reshape(rows, -1)
    else:
        scales = unswizzle_block_scales(d.scales, d.row_offsets, cfg.fmt.name, cfg.hidden)
    return payload, scales


def run_gpu(args) -> int:
    import cupy
    import ml_dtypes

    import cuep
    from . import reference as ref

    n_dev = cupy.cuda.runtime.getDeviceCount()
    if n_dev == 1:
        print(f"One GPU found: simulating {args.ranks} ranks on it (the multi-rank protocol, phase by phase).")
        group = cuep.init([0] * args.ranks)
    else:
        group = cuep.init()
    cfg = cuep.EPConfig(hidden=args.hidden, top_k=args.top_k, n_experts=args.experts,
                        max_tokens_per_rank=args.tokens, n_gpus_per_node=group.n_ranks, dispatch_format=args.format)
    buf = cuep.Buffer(group, cfg)
    rng = np.random.default_rng()
    xs = [rng.standard_normal((args.tokens, cfg.hidden)).astype(ml_dtypes.bfloat16) for _ in range(cfg.n_ranks)]
    ids = [_routing(rng, args.tokens, cfg) for _ in range(cfg.n_ranks)]
    ws = [rng.random((args.tokens, cfg.top_k)).astype(np.float32) for _ in range(cfg.n_ranks)]
    def put(arrs):
        out = []
        for a, dv in zip(arrs, group.devices):
            with cupy.cuda.Device(dv):
                out.append(cupy.asarray(a))
        return out

    gx, gids, gws = put(xs), put(ids), put(ws)
    d = cuep.dispatch(buf, gx, gids, gws)
    buf.synchronize()
    want = ref.dispatch(xs, ids, cfg)
    eo = []
    for r, dv in enumerate(group.devices):
        with cupy.cuda.Device(dv):
            rows = int(d[r].row_offsets[-1].get())
            # identity experts: the dequantized rows (cuep.ops would do this on the GPU; the reference is exact)
            payload = d[r].tokens[:rows].get().view(np.uint8).reshape(rows, -1)
            if cfg.fmt.name == "bf16":
                deq = payload.view(ml_dtypes.bfloat16).astype(np.float32)
            else:
                sc = (np.ascontiguousarray(d[r].scales[:, :rows].get().T).view(np.uint8) if cfg.fmt.name == "fp8"
                      else ref.unswizzle_block_scales(d[r].scales.get(), d[r].row_offsets.get(), cfg.fmt.name,
                                                      cfg.hidden))
                deq = ref.dequantize(payload, sc, cfg.fmt.name, cfg.hidden)
            full = cupy.zeros((cfg.capacity, cfg.hidden), dtype=ml_dtypes.bfloat16)
            full[:rows] = cupy.asarray(deq.astype(ml_dtypes.bfloat16))
            eo.append(full)
    out = cuep.combine(buf, eo, d)
    buf.synchronize()
    rows_t = []
    for r in range(cfg.n_ranks):
        ok = np.array_equal(d[r].row_offsets.get(), want[r].row_offsets)
        ref_x = xs[r].astype(np.float32) * ws[r].sum(1, keepdims=True)
        o = out[r].get().astype(np.float32)
        err = float(np.linalg.norm(o - ref_x) / np.linalg.norm(ref_x))
        rows_t.append((r, group.devices[r], args.tokens, int(want[r].row_offsets[-1]),
                       "yes" if ok else "NO", f"{err:.2e}"))
    print(cfg.describe())
    print(_table(rows_t, ("rank", "GPU", "tokens", "rows recv", "layout = ref", "combine rel err")))
    return 0 if all(r[4] == "yes" for r in rows_t) else 1


def run_compile() -> int:
    import cuep

    t0 = time.perf_counter()
    times = cuep.compile_kernels(device=0)
    print(_table([(unit, f"{t:.1f}") for unit, t in times.items()], ("kernel unit", "s")))
    print(f"{len(times)} kernel units ready in {time.perf_counter() - t0:.1f} s (CuPy's disk cache keeps them)")
    return 0


def _no_gpu_to_compile() -> int:
    print("--compile needs an NVIDIA GPU: CuPy compiles for the device it finds (none here)", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cuep", description=__doc__)
    p.add_argument("--format", default="bf16", choices=["bf16", "fp8", "nvfp4", "mxfp4"])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--ranks", type=int, default=4, help="simulated ranks on the CPU")
    p.add_argument("--compile", action="store_true",
                   help="compile every kernel for GPU 0 (all formats, in parallel; CuPy's disk cache), then exit")
    args = p.parse_args(argv)
    import cupy

    has_gpu = cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    if args.compile:
        return run_compile() if has_gpu else _no_gpu_to_compile()
    if has_gpu:
        return run_gpu(args)
    print("No NVIDIA GPU found: running the NumPy reference on the CPU with "
          f"{args.ranks} simulated ranks instead.")
    return run_cpu(args)


if __name__ == "__main__":
    sys.exit(main())
