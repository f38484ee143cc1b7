#!/usr/bin/env python3
"""What one eager call's host time is made of: the CPU cost of its pieces, each timed alone (issue 24, item 4).

    PYTHONPATH=. python3 benchmarks/launch_floor.py [--reps 2000] [--spin-ms 200]

Every piece runs ``--reps`` times behind one spin kernel (the GPU stays busy, so no launch waits) and the median
of ``--batches`` batches of per-call means is printed: Python's own call, CuPy's current-stream lookup, a driver
launch of an empty kernel with an 8-byte and a 544-byte parameter (cuep's dispatch struct) on the legacy default
stream and on a non-blocking stream, CuPy's RawKernel call, and cuep's host steps on a one-rank buffer (argument
checks, buffer check, result records, the prepared launch's packing, the one-rank launch through cuLaunchKernel
and as a programmatic dependent through cuLaunchKernelEx, whole calls). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SRC = r"""
struct Big { long long v[68]; };
extern "C" __global__ void lf_empty(long long a) { if (a == -12345) asm volatile("trap;"); }
extern "C" __global__ void lf_big(Big b) { if (b.v[0] == -12345) asm volatile("trap;"); }
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--spin-ms", type=float, default=300.0)
    p.add_argument("--tokens", type=int, default=1)
    a = p.parse_args(argv)
    os.environ.setdefault("CUEP_LOG", "0")
    import cupy
    from cupy_backends.cuda.api import driver
    import ml_dtypes

    import cuep
    from cuep import ep
    from host_cost import Spin

    mod = cupy.RawModule(code=SRC)
    empty, big = mod.get_function("lf_empty"), mod.get_function("lf_big")
    raw8 = (ctypes.c_char * 8)()
    raw_big = (ctypes.c_char * 544)()
    argv8 = (ctypes.c_void_p * 1)(ctypes.addressof(raw8))
    argv_big = (ctypes.c_void_p * 1)(ctypes.addressof(raw_big))
    p8, p_big = ctypes.addressof(argv8), ctypes.addressof(argv_big)
    fe, fb = empty.kernel.ptr if hasattr(empty, "kernel") else empty.ptr, big.kernel.ptr if hasattr(big, "kernel") else big.ptr
    launch = driver.launchKernel
    s_null = cupy.cuda.Stream.null.ptr
    nb = cupy.cuda.Stream(non_blocking=True)
    s_nb = nb.ptr
    get_stream = cupy.cuda.get_current_stream
    getdev = cupy.cuda.runtime.getDevice

    H, K, E, N = 7168, 8, 256, a.tokens
    cfg = cuep.EPConfig(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=max(N, 128), n_gpus_per_node=1)
    buf = cuep.Buffer(cuep.init([0]), cfg)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((N, H), np.float32).astype(bf16))
    ids = cupy.asarray(np.argsort(rng.random((N, E)), axis=1)[:, :K].astype(np.int32))
    w = cupy.asarray(rng.random((N, K), np.float32))
    eo = cupy.zeros((cfg.capacity, H), np.uint16).view(bf16)
    d = cuep.dispatch(buf, x, ids, w)
    cuep.combine(buf, eo, d)
    buf.synchronize()
    host = ep._host(buf)
    threads, smem = ep._dispatch_launch(buf, staged=False)
    prep = ep._prepared(buf, 0, "dispatch.cu:cuep_dispatch_local_bf16_from_bf16", threads, smem)
    call = (x.data.ptr, ids.data.ptr, w.data.ptr)
    tail = (N, 1.0, 15, 0)

    def f_pass():
        pass

    pieces = {
        "python call (pass)": f_pass,
        "cupy get_current_stream().ptr": lambda: get_stream().ptr,
        "runtime.getDevice()": getdev,
        "launch empty 8 B, null stream": lambda: launch(fe, 1, 1, 1, 32, 1, 1, 0, s_null, p8, 0),
        "launch empty 8 B, non-blocking stream": lambda: launch(fe, 1, 1, 1, 32, 1, 1, 0, s_nb, p8, 0),
        "launch empty 544 B, null stream": lambda: launch(fb, 1, 1, 1, 32, 1, 1, 0, s_null, p_big, 0),
        "launch empty 544 B, 132 x 512 threads": lambda: launch(fb, 132, 1, 1, 512, 1, 1, 0, s_null, p_big, 0),
        "cupy RawKernel call empty (1 arg)": lambda: empty((1,), (32,), (np.int64(1),)),
        "ep._check_buffer": lambda: ep._check_buffer(buf, "x"),
        "buf.check()": buf.check,
        "ep._check_array(x)": lambda: ep._check_array(x, "x", 0, (bf16, ep._F32), 2, "[N, H]"),
        "ep._validate_dispatch": lambda: ep._validate_dispatch(host, [x], [ids], [w], 1.0),
        "ep._rows_ptr(x)": lambda: ep._rows_ptr(x, N, x.shape[1], host.x_dtypes, 0, 15),
        "Dispatched(*fixed, n, ids, has_w, buf, seq)": lambda: ep.Dispatched(*host.results[0], N, ids, True, buf, 1),
        "ep._as_list(x) x3": lambda: (ep._as_list(x, 1, "x"), ep._as_list(ids, 1, "i"), ep._as_list(w, 1, "w")),
        "ep._check_nothing_pending": lambda: ep._check_nothing_pending(buf, "c"),
        "launch plan lookup (cached)": lambda: host.plans.get((0, 7, "bf16", 1)),
        "x.data.ptr x3": lambda: (x.data.ptr, ids.data.ptr, w.data.ptr),
        "prepared: pack the call's fields": lambda: prep.call.pack_into(prep.raw, prep.call_offset, *call, *tail),
        "prepared launch (dispatch one-rank)": lambda: prep.launch_call(buf.num_sms, *call, *tail),
        "ep._dispatch_launch (cached)": lambda: ep._dispatch_launch(buf, staged=False),
        "ep._prepared (cached)": lambda: ep._prepared(buf, 0, "dispatch.cu:cuep_dispatch_local_bf16_from_bf16",
                                                      threads, smem),
    }

    def whole_dispatch():
        cuep.dispatch(buf, x, ids, w)

    def whole_pair():
        dd = cuep.dispatch(buf, x, ids, w)
        cuep.combine(buf, eo, dd)

    def async_pair():
        dd = cuep.dispatch(buf, x, ids, w)
        cuep.combine_async(buf, eo, dd)
        cuep.combine_wait(buf, eo, dd)

    from cuep import _kernels

    real_launch = _kernels._launch_raw

    def stubbed(fn):
        def run():
            _kernels._launch_raw = lambda *a: None
            try:
                fn()
            finally:
                _kernels._launch_raw = real_launch
        return run

    # the one-rank launch both ways: cuLaunchKernel (CuPy's driver binding) and cuLaunchKernelEx as a programmatic
    # dependent (ctypes), which cuep uses for it
    pieces["prepared launch, plain (cuLaunchKernel)"] = lambda: _kernels._launch_raw(
        prep.func, buf.num_sms, prep.block, prep.smem, prep.argv_ptr, None, 0)
    pieces["prepared launch, dependent (cuLaunchKernelEx)"] = lambda: _kernels._launch_raw(
        prep.func, buf.num_sms, prep.block, prep.smem, prep.argv_ptr, None, 0, prep.dependent)
    pieces["cuep.dispatch (whole)"] = whole_dispatch
    pieces["cuep.dispatch (launch stubbed)"] = stubbed(whole_dispatch)
    pieces["cuep.dispatch + combine (whole)"] = whole_pair
    pieces["cuep.dispatch + combine (launch stubbed)"] = stubbed(whole_pair)
    pieces["dispatch + combine_async + combine_wait"] = async_pair

    spin = Spin(a.spin_ms)
    clock = time.perf_counter
    res = {}
    for name, fn in pieces.items():
        for _ in range(50):
            fn()
        cupy.cuda.Device().synchronize()
        means = []
        for _ in range(a.batches):
            spin.start()
            t0 = clock()
            for _ in range(a.reps):
                fn()
            t1 = clock()
            busy = spin.still_busy()
            cupy.cuda.Device().synchronize()
            buf.check()
            means.append((t1 - t0) / a.reps * 1e6)
            if not busy:
                print(f"WARNING {name}: the GPU went idle (raise --spin-ms)")
        res[name] = (statistics.median(means), min(means))
        print(f"[launch_floor] {name}: {res[name][0]:.2f} us", flush=True)
    buf.close()
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"\nhost us per call (median of {a.batches} batches of {a.reps}, min), GPU busy, {dev}, N={N}")
    w0 = max(len(k) for k in res)
    for k, (m, lo) in res.items():
        print(f"{k.ljust(w0)}  {m:7.2f}  {lo:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
