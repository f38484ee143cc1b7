"""Bandwidth of the single-GPU ops (cuep.ops) against a device-to-device copy, the ceiling they aim at.

    pytest benchmarks/bench_ops.py --benchmark-only          # pytest-benchmark (CUDA-event numbers in extra_info)
    python benchmarks/bench_ops.py [--n 4096 16384 32768] [--hidden 7168] [--iters 20] [--allocs 3]   # a table

Each case is timed with CUDA events around the launch (median of ``iters`` runs after warm-up; the L2 cache is flushed
before every run, so the numbers are cold-cache). The table builds each case ``allocs`` times, every build's buffers
held while the next is made so that each lands elsewhere in memory, and reports the median of the builds' medians with
their range: where the buffers lie moves some kernels by several percent (H200, quantize nvfp4 N = 32768: 157-158 us
in most placements, 165-174 us in one reproducible allocation order, with the same relative addresses; re-allocating
any one of its three buffers gave 157-159 us). Achieved bandwidth = (bytes read + bytes written) / time; the ratio is
against the best measured device-to-device copy (cudaMemcpyAsync and a CuPy copy kernel of a large buffer, also read +
written). No timing is asserted: benchmarks print and save numbers.

Cases: quantize to fp8 / nvfp4 / mxfp4 from bf16 and to bf16 from float32, x [N, H]; fused_silu from bf16
h [N, 2H] (I = H) to bf16 / fp8 / nvfp4 / mxfp4, all N rows in 8 expert groups, row count read on the device.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

try:
    import cuep  # noqa: F401
except ImportError:  # run as a script from a checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

from cuep import formats, ops  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
NS = (4096, 16384, 32768)
HIDDEN = 7168
N_GROUPS = 8
COPY_BYTES = 1 << 30


# ---- timing ------------------------------------------------------------------------------------------------------
class _L2Flusher:
    """Writes a buffer twice the L2 size, so each timed run starts cold."""

    def __init__(self) -> None:
        l2 = cupy.cuda.Device().attributes.get("L2CacheSize", 64 << 20)
        self.buf = cupy.empty(max(2 * l2, 1 << 20), np.uint8)

    def __call__(self) -> None:
        self.buf.fill(0)


def cuda_time_us(fn: Callable[[], object], iters: int = 20, warmup: int = 3, flush: _L2Flusher | None = None):
    """Median and all CUDA-event times (µs) of ``fn`` on the current stream."""
    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times)), times


# ---- cases -------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    op: str
    fmt: str
    n: int
    hidden: int
    nbytes: int                  # bytes read + bytes written
    run: Callable[[], object]


def _rand(shape, dtype, seed: int = 0) -> "cupy.ndarray":
    """Normal values, float32 or bf16 (rounded by cuep's own bf16 quantizer)."""
    x = cupy.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    if dtype == np.float32:
        return x
    payload, _ = ops.quantize(x, "bf16")
    return payload.view(BF16)


def quantize_case(fmt: str, n: int, hidden: int) -> Case:
    f = formats.FORMATS[fmt]
    dtype = np.float32 if fmt == "bf16" else BF16
    x = _rand((n, hidden), dtype)
    out = (cupy.empty((n, f.payload_bytes(hidden)), np.uint8), cupy.empty((n, f.scale_bytes(hidden)), np.uint8))
    nbytes = x.nbytes + out[0].nbytes + out[1].nbytes
    return Case("quantize", f"{fmt} <- {'f32' if dtype == np.float32 else 'bf16'}", n, hidden, nbytes,
                lambda: ops.quantize(x, fmt, out=out))


def silu_case(fmt: str, n: int, inter: int) -> Case:
    f = formats.FORMATS[fmt]
    h = _rand((n, 2 * inter), BF16)
    bounds = np.linspace(0, n, N_GROUPS + 1).astype(np.int32)
    row_offsets = cupy.asarray(bounds)
    counts = np.diff(bounds)
    if fmt == "bf16":
        out = cupy.empty((n, inter), BF16)
        written = out.nbytes
    elif fmt == "fp8":
        out = (cupy.empty((n, inter), np.uint8), cupy.empty((inter // 128, n), np.float32))
        written = out[0].nbytes + out[1].nbytes
    else:
        tiles = -(-n // 128) + N_GROUPS
        out = (cupy.empty((n, f.payload_bytes(inter)), np.uint8),
               cupy.empty((tiles * f.scale_k_tiles(inter) * formats.SCALE_TILE_BYTES,), np.uint8),
               cupy.empty((N_GROUPS,), np.uint32))
        used_tiles = int(sum(-(-int(c) // 128) for c in counts))
        written = out[0].nbytes + used_tiles * f.scale_k_tiles(inter) * formats.SCALE_TILE_BYTES + out[2].nbytes
    nbytes = h.nbytes + row_offsets.nbytes + written
    return Case("fused_silu", f"bf16 -> {fmt}", n, inter, nbytes,
                lambda: ops.fused_silu(h, row_offsets, fmt, out=out))


def copy_cases(nbytes: int = COPY_BYTES) -> list[Case]:
    src = cupy.ones(nbytes, np.uint8)
    dst = cupy.empty_like(src)
    src16, dst16 = src.view(np.uint64), dst.view(np.uint64)
    return [
        Case("copy", "cudaMemcpyAsync D2D", nbytes, 0, 2 * nbytes,  # n = bytes copied
             lambda: dst.data.copy_from_device_async(src.data, nbytes)),
        Case("copy", "cupy.copyto (uint64)", nbytes, 0, 2 * nbytes, lambda: cupy.copyto(dst16, src16)),
    ]


def all_cases(ns=NS, hidden: int = HIDDEN):
    """Every case, built one at a time (a case holds its buffers: drop it before taking the next)."""
    for n in ns:
        for fmt in ("fp8", "nvfp4", "mxfp4", "bf16"):
            yield lambda fmt=fmt, n=n: quantize_case(fmt, n, hidden)
        for fmt in ("bf16", "fp8", "nvfp4", "mxfp4"):
            yield lambda fmt=fmt, n=n: silu_case(fmt, n, hidden)


def measure(case: Case, iters: int, flush: _L2Flusher | None) -> dict:
    us, times = cuda_time_us(case.run, iters=iters, flush=flush)
    return {"median_us": us, "min_us": float(min(times)), "gbps": case.nbytes / us / 1e3, "bytes": case.nbytes,
            "iters": iters}


def measure_placements(make: Callable[[], Case], allocs: int, iters: int, flush: _L2Flusher | None) -> tuple:
    """``make()`` ``allocs`` times (each build's buffers kept while the next is made, so that every build lies
    elsewhere in memory), each build timed by :func:`measure`. Returns the case's key and a :func:`measure` dict
    whose ``median_us`` (and ``gbps``) is the median of the builds' medians, with ``alloc_us`` the builds' medians.
    The builds are dropped and the memory pool emptied before returning."""
    held, medians = [], []
    for _ in range(max(1, allocs)):
        held.append(make())
        medians.append(measure(held[-1], iters, flush)["median_us"])
    case = held[0]
    us = float(np.median(medians))
    res = {"median_us": us, "min_us": min(medians), "gbps": case.nbytes / us / 1e3, "bytes": case.nbytes,
           "iters": iters, "alloc_us": medians}
    key = (case.op, case.fmt, case.n, case.hidden)
    del held, case
    cupy.get_default_memory_pool().free_all_blocks()
    return key, res


# ---- pytest-benchmark ---------------------------------------------------------------------------------------------
try:
    import pytest
except ImportError:  # script use without pytest
    pytest = None

if pytest is not None:
    _HAS_GPU = cupy.cuda.is_available()

    @pytest.fixture(scope="module")
    def copy_gbps():
        if not _HAS_GPU:
            pytest.skip("needs an NVIDIA GPU")
        flush = _L2Flusher()
        return max(measure(c, 20, flush)["gbps"] for c in copy_cases())

    @pytest.fixture(scope="module")
    def flusher():
        return _L2Flusher()

    def _run(benchmark, case: Case, copy_gbps: float, flusher) -> None:
        m = measure(case, 20, flusher)
        device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        benchmark.extra_info.update({
            "op": case.op, "fmt": case.fmt, "N": case.n, "H": case.hidden, "device": device.decode()
            if isinstance(device, bytes) else device, "cuda_event_median_us": round(m["median_us"], 2),
            "cuda_event_min_us": round(m["min_us"], 2), "bytes": m["bytes"], "GBps": round(m["gbps"], 1),
            "copy_GBps": round(copy_gbps, 1), "fraction_of_copy": round(m["gbps"] / copy_gbps, 3)})

        def once():
            case.run()
            cupy.cuda.Device().synchronize()

        benchmark.pedantic(once, rounds=10, iterations=1, warmup_rounds=2)

    @pytest.mark.gpu
    @pytest.mark.parametrize("which", [0, 1], ids=["memcpy", "copy_kernel"])
    def test_copy(benchmark, copy_gbps, flusher, which):
        _run(benchmark, copy_cases()[which], copy_gbps, flusher)

    @pytest.mark.gpu
    @pytest.mark.parametrize("n", NS)
    @pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4", "bf16"])
    def test_quantize(benchmark, copy_gbps, flusher, fmt, n):
        _run(benchmark, quantize_case(fmt, n, HIDDEN), copy_gbps, flusher)

    @pytest.mark.gpu
    @pytest.mark.parametrize("n", NS)
    @pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
    def test_fused_silu(benchmark, copy_gbps, flusher, fmt, n):
        _run(benchmark, silu_case(fmt, n, HIDDEN), copy_gbps, flusher)


# ---- script ---------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=list(NS), help="token rows N")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="H (quantize) and I (fused_silu)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--allocs", type=int, default=3, help="builds of each case, each in its own memory")
    p.add_argument("--warm", action="store_true", help="do not flush L2 between runs")
    args = p.parse_args(argv)
    if not cupy.cuda.is_available():
        print("no GPU: nothing to measure", file=sys.stderr)
        return 1
    flush = None if args.warm else _L2Flusher()
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    allocs = max(1, args.allocs)
    print(f"device {dev.id}: {name}, {dev.attributes['MultiProcessorCount']} SMs; "
          f"{'warm' if args.warm else 'cold (L2 flushed)'}; median of {args.iters} calls, of {allocs} builds "
          f"(buffers placed anew) a case")
    rows = [((c.op, c.fmt, c.n, c.hidden), measure(c, args.iters, flush)) for c in copy_cases()]
    cupy.get_default_memory_pool().free_all_blocks()  # the copy's 2 GiB must not shape where the cases lie
    ceiling = max(m["gbps"] for _, m in rows)
    for make in all_cases(args.n, args.hidden):
        rows.append(measure_placements(make, allocs, args.iters, flush))
        print(f"  {rows[-1][0][0]} {rows[-1][0][1]} N = {rows[-1][0][2]} done", file=sys.stderr, flush=True)
    print(f"{'op':<11} {'format':<22} {'N':>10} {'H':>6} {'us':>10} {'GB/s':>8} {'of copy':>8}  builds' us")
    for (op, fmt, n, hidden), m in rows:
        spread = "" if "alloc_us" not in m else f"  {min(m['alloc_us']):.1f}-{max(m['alloc_us']):.1f}"
        print(f"{op:<11} {fmt:<22} {n:>10} {hidden:>6} {m['median_us']:>10.1f} {m['gbps']:>8.0f} "
              f"{m['gbps'] / ceiling:>8.1%}{spread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
