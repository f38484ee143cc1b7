#!/usr/bin/env python3
"""What one launch costs on the GPU, by the kernel's shape: the part of a decode round's time that is not its work
(issue 24, item 2).

    PYTHONPATH=. python3 benchmarks/launch_gpu.py [--reps 300] [--device 0]

Every row is the GPU time of one launch timed as ``python -m cuep.bench --floor`` times an op: a CUDA event before
and after it, queued behind a start gate (``cuep.bench.timing.StartGate``: the host's launch cost stays out), median
of ``--reps`` after 20 untimed. Kernels: an empty one (one warp; one 512-thread block per SM, the one-rank kernels'
grid), an empty one with a parameter block the size of cuep's dispatch parameters (544 bytes) that reads one 8-byte
field from each of its first k 64-byte lines (k = 0, 1, 3, 5, 9: what each new line of parameters costs the first
warp that reaches it), one that asks for 200 KiB of dynamic shared memory, and the floor copy of
``cuep.bench --floor`` (``cuep.bench.kernels.floor_copy``) of a one-rank bf16 dispatch's bytes at N = 1 and 128
(14400 bytes read, 116816 written; 1843200 and 14690320). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARAM_LINES = (0, 1, 3, 5, 9)
SRC = r"""
struct Params { long long v[PARAM_WORDS]; };  // cuep's DispatchParams' size (-DPARAM_WORDS)
extern "C" __global__ void lg_empty(long long a) { if (a == -12345) asm volatile("trap;"); }
extern "C" __global__ void lg_smem(long long a) {
    extern __shared__ int sm[];
    if (a == -12345) { sm[threadIdx.x] = 1; asm volatile("trap;"); }
}
template <int kLines>
__device__ __forceinline__ void lg_lines(const Params& p) {
    long long s = 0;
#pragma unroll
    for (int i = 0; i < kLines; ++i) s += p.v[8 * i];
    if (s == -12345) asm volatile("trap;");
}
""" + "".join(f'extern "C" __global__ void lg_lines_{k}(const __grid_constant__ Params p) {{ lg_lines<{k}>(p); }}\n'
              for k in PARAM_LINES)
FLOOR_CASES = (("floor copy, bf16 dispatch N = 1", 14400, 116816), ("floor copy, bf16 dispatch N = 128", 1843200,
                                                                    14690320))


def param_words() -> int:
    """8-byte words of cuep's DispatchParams (the probe's parameter block)."""
    from cuep import params

    return params.DISPATCH_PARAMS_DTYPE.itemsize // 8


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=300, help="timed launches per row (default %(default)s)")
    p.add_argument("--device", type=int, default=0)
    a = p.parse_args(argv)
    if a.reps < 1:
        p.error(f"--reps {a.reps}: must be >= 1")
    import cupy
    import numpy as np

    from cuep.bench import kernels as bench_kernels
    from cuep.bench.timing import StartGate

    cupy.cuda.Device(a.device).use()
    sms = cupy.cuda.Device(a.device).attributes["MultiProcessorCount"]
    print(f"[launch_gpu] compiling the probe kernels on GPU {a.device} ...", flush=True)
    mod = cupy.RawModule(code=SRC, options=("--std=c++17", f"-DPARAM_WORDS={param_words()}"))
    gate = StartGate([a.device])
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def timed(launch) -> float:
        launch()  # (first use: module load, function lookup; outside the gate, which must not wait on the host)
        cupy.cuda.get_current_stream().synchronize()
        out = []
        for i in range(a.reps + 20):
            gate.launch()
            start.record()
            launch()
            end.record()
            gate.release()
            end.synchronize()
            gate.check()
            if i >= 20:
                out.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
        return statistics.median(out)

    one = (np.int64(1),)
    params = np.zeros(1, dtype=np.dtype([("v", np.int64, (param_words(),))]))[0]
    empty = mod.get_function("lg_empty")
    rows = [("empty, 1 x 32 threads", timed(lambda: empty((1,), (32,), one))),
            (f"empty, {sms} x 512", timed(lambda: empty((sms,), (512,), one)))]
    for k in PARAM_LINES:
        fn = mod.get_function(f"lg_lines_{k}")
        rows.append((f"{8 * param_words()} B parameters, {k} lines read, {sms} x 512", timed(lambda: fn((sms,), (512,), (params,)))))
    smem = mod.get_function("lg_smem")
    smem.max_dynamic_shared_size_bytes = 200 << 10
    rows.append((f"200 KiB dynamic shared memory, {sms} x 512",
                 timed(lambda: smem((sms,), (512,), one, shared_mem=200 << 10))))
    for label, read, write in FLOOR_CASES:
        src, dst = cupy.ones(read // 4, np.uint32), cupy.empty(write // 4, np.uint32)
        rows.append((label, timed(lambda: bench_kernels.floor_copy(src, dst, read, write))))
    gate.close()
    name = cupy.cuda.runtime.getDeviceProperties(a.device)["name"].decode()
    print(f"\nGPU us of one launch (event before and after, behind a start gate), median of {a.reps}, {name}")
    print("| kernel | us |\n| --- | --- |")
    for label, us in rows:
        print(f"| {label} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
