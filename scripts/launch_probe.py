"""What a kernel launch costs from event to event, and what makes it dearer (development aid).

On all local GPUs, gated CUDA-event times (cuep.bench.timing, median of the slowest GPU per run, warm and cold L2)
of kernels that return at once, varied one property at a time: the grid (1 block, or one 512-thread block per SM),
the dynamic shared memory (0, 19 KiB as a decode dispatch, 128 KiB as the bf16 combine's ring), a 352-byte
`__grid_constant__` parameter block (as EPParams); then the dispatch and combine kernels with no phase.

Usage: python scripts/launch_probe.py [--repeats 30] [--ep-only] (--ep-only: the dispatch and combine rows only)
"""
import argparse

import cupy
import numpy as np

import cuep
from cuep import ep as ep_mod
from cuep.bench import cases, timing

SRC = r"""
struct Params { long long v[44]; };
extern "C" __global__ void probe_empty(int* out) { if (out && threadIdx.x == 1024) out[0] = 1; }
extern "C" __global__ void probe_smem(int* out) {
    extern __shared__ int s[];
    if (threadIdx.x == 1024) { s[0] = 1; out[0] = s[0]; }
}
extern "C" __global__ void probe_param(const __grid_constant__ Params p, int* out) {
    if (p.v[0] == 12345 && out) out[0] = 1;
}
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--ep-only", action="store_true", help="only the dispatch and combine kernels (A/B runs)")
    a = p.parse_args()
    g = cuep.init()
    devs = list(g.devices)
    mods, outs = {}, {}
    for d in devs:
        with cupy.cuda.Device(d):
            mods[d] = cupy.RawModule(code=SRC)
            outs[d] = cupy.zeros(1, dtype=cupy.int32)
    n_sm = cupy.cuda.Device(devs[0]).attributes["MultiProcessorCount"]
    params = np.zeros(44, dtype=np.int64).view(np.dtype((np.void, 44 * 8)))[0]

    def launcher(name, grid, threads, smem=0, param=False):
        fns = {}
        for d in devs:
            with cupy.cuda.Device(d):
                fn = mods[d].get_function(name)
                if smem:
                    fn.max_dynamic_shared_size_bytes = smem
                fns[d] = fn

        def run(i):
            for d in devs:
                with cupy.cuda.Device(d):
                    args = (params, outs[d]) if param else (outs[d],)
                    fns[d]((grid,), (threads,), args, shared_mem=smem)
        return run

    rows = []
    for label, fn in () if a.ep_only else (
            ("empty, 1 block x 32", launcher("probe_empty", 1, 32)),
            (f"empty, {n_sm} x 512", launcher("probe_empty", n_sm, 512)),
            (f"{n_sm} x 512, 19 KiB dynamic smem", launcher("probe_smem", n_sm, 512, 19 * 1024)),
            (f"{n_sm} x 512, 64 KiB dynamic smem", launcher("probe_smem", n_sm, 512, 64 * 1024)),
            (f"{n_sm} x 512, 128 KiB dynamic smem", launcher("probe_smem", n_sm, 512, 128 * 1024)),
            (f"{n_sm} x 512, 352 B grid_constant", launcher("probe_param", n_sm, 512, 0, True))):
        t = timing.measure(fn, devs, repeats=a.repeats, series=1)
        rows.append((label, t["warm"].round_us, t["cold"].round_us))
    inp = cases.make_inputs(devs, 128, 7168, 8, 256, n_sets=1)
    case = cases.CuepCase(g, inp, "bf16")
    case.check()

    def no_phase_dispatch(i):
        ep_mod._dispatch(case.buf, inp.x[0], inp.ids[0], inp.weights[0], 1.0, 0)
    t = timing.measure(no_phase_dispatch, devs, repeats=a.repeats, series=1)
    rows.append(("dispatch kernel, no phase", t["warm"].round_us, t["cold"].round_us))
    for label, fn, setup in (("dispatch N=128", case.dispatch, None), ("combine N=128", case.combine, case.setup_combine)):
        t = timing.measure(fn, devs, repeats=a.repeats, series=1, setup=setup)
        rows.append((label, t["warm"].round_us, t["cold"].round_us))
    case.buf.check()
    case.close()
    print(f"{len(devs)} GPU(s) ({cupy.cuda.runtime.getDeviceProperties(devs[0])['name'].decode()}): "
          f"event-to-event round time (us, median of the slowest GPU)")
    print(f"{'':40s} {'warm':>8s} {'cold':>8s}")
    for name, w, c in rows:
        print(f"{name:40s} {w:8.1f} {c:8.1f}")


if __name__ == "__main__":
    main()
