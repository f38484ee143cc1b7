"""The SM-driven all-to-all ceiling on the local GPUs (development aid for the EP kernels' NVLink limits).

Every GPU copies `--mib` MiB to every other GPU at once with cuep_bench_a2a_copy (bench.cu), for each mode
(push loads+stores, stores only, TMA bulk stores; pull), block count and chunk size; prints GB/s leaving each GPU
(median over GPUs; start gate, CUDA events, medians). usage: python scripts/a2a_probe.py [--mib 64]
"""
import argparse

import cupy
import numpy as np

import cuep
from cuep import _kernels
from cuep.bench import kernels, timing


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=48)
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 66, 132, 264])
    p.add_argument("--chunks", type=int, nargs="+", default=[2048, 8192, 14336])
    p.add_argument("--modes", nargs="+", default=["push", "push-store", "push-bulk", "pull"])
    a = p.parse_args()
    g = cuep.init()
    devs = g.devices
    R = len(devs)
    nbytes = a.mib << 20
    send, recv = {}, {}
    for d in devs:
        with cupy.cuda.Device(d):
            send[d] = cupy.full(nbytes // 4, 7, dtype=np.int32)
            recv[d] = cupy.zeros((R, nbytes // 4), dtype=np.int32)  # slot s: from source s
    ptrs = {}
    for i, d in enumerate(devs):
        with cupy.cuda.Device(d):
            peers = [j for j in range(R) if j != i]
            push_src = [send[d].data.ptr] * (R - 1)
            push_dst = [recv[devs[j]][i].data.ptr for j in peers]
            pull_src = [send[devs[j]].data.ptr for j in peers]
            pull_dst = [recv[d][j].data.ptr for j in peers]
            ptrs[d] = {"push": (cupy.asarray(push_src, dtype=np.uint64), cupy.asarray(push_dst, dtype=np.uint64)),
                       "pull": (cupy.asarray(pull_src, dtype=np.uint64), cupy.asarray(pull_dst, dtype=np.uint64))}
    gate = timing.StartGate(devs)
    rows = []
    for mode in a.modes:
        kind = "pull" if mode == "pull" else "push"
        code = {"push": 0, "pull": 0, "push-store": 1, "push-bulk": 2}[mode]
        for chunk in a.chunks:
            if code == 2 and chunk > 8192:
                continue
            for blocks in a.blocks:
                smem = 16 * 8192 if code == 2 else 0

                def run(_i):
                    for d in devs:
                        with cupy.cuda.Device(d):
                            s, t = ptrs[d][kind]
                            kernels.function("cuep_bench_a2a_copy")(
                                (blocks,), (512,), (s, t, np.int32(R - 1), np.int64(nbytes), np.int32(chunk),
                                                    np.int32(code)), shared_mem=smem)

                for d in devs:
                    with cupy.cuda.Device(d):
                        _kernels.allow_dynamic_smem(kernels.function("cuep_bench_a2a_copy"), smem)
                t = timing.measure(run, devs, repeats=8, warmup=2, series=1, modes=("warm",), gate=gate)["warm"]
                gbps = [(R - 1) * nbytes / (us * 1e3) for us in t.median_us]
                rows.append((mode, chunk, blocks, float(np.median(gbps)), min(gbps)))
                print(f"{mode:11s} chunk {chunk:6d} blocks {blocks:4d}: {np.median(gbps):6.1f} GB/s out per GPU "
                      f"(min {min(gbps):6.1f})", flush=True)
    best = max(rows, key=lambda r: r[3])
    print(f"best: {best}")
    gate.close()


if __name__ == "__main__":
    main()
