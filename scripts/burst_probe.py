"""The floor of a decode send half (development aid): every GPU pushes a burst of `bytes` to the next GPU at once
with cuep_bench_burst (bench.cu), 2 KiB items one warp each, for each mode (stores; stores + system fence + ready
tag per item; the same without loads), block count and size. Prints the gated CUDA-event round time (median of the
slowest GPU, warm and cold) and the kernel's own span (first entry to last item end, globaltimer).

usage: python scripts/burst_probe.py [--kib 256 1792] [--blocks 33 66 132]
"""
import argparse

import cupy
import numpy as np

import cuep
from cuep.bench import kernels, timing


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kib", type=int, nargs="+", default=[128, 512, 1792, 4096])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 33, 66, 132])
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--modes", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    g = cuep.init()
    devs = list(g.devices)
    R = len(devs)
    most = max(a.kib) << 10
    src, dst, tags, span = {}, {}, {}, {}
    for d in devs:
        with cupy.cuda.Device(d):
            src[d] = cupy.arange(most // 4, dtype=np.int32)
            dst[d] = cupy.zeros(most // 4, dtype=np.int32)
            tags[d] = cupy.zeros(most // a.chunk + 1, dtype=np.uint32)
            span[d] = cupy.zeros(2, dtype=np.uint64)
    gate = timing.StartGate(devs)
    rows = []
    for mode in a.modes:
        for kib in a.kib:
            nbytes = kib << 10
            for blocks in a.blocks:
                spans = []

                def reset(_i):
                    for d in devs:
                        with cupy.cuda.Device(d):
                            span[d][0] = np.uint64(2**64 - 1)
                            span[d][1] = 0

                def run(_i):
                    for i, d in enumerate(devs):
                        peer = devs[(i + 1) % R]
                        with cupy.cuda.Device(d):
                            kernels.function("cuep_bench_burst")(
                                (blocks,), (512,), (src[d], dst[peer], np.int64(nbytes), np.int32(a.chunk),
                                                    np.int32(mode), tags[peer], span[d]))

                def collect():
                    for d in devs:
                        with cupy.cuda.Device(d):
                            s = span[d].get()
                            spans.append((int(s[1]) - int(s[0])) / 1e3)

                t = timing.measure(run, devs, repeats=a.repeats, warmup=2, series=1, setup=reset, gate=gate)
                # the span of the last timed run (a warm one: setup resets it before every run)
                collect()
                rows.append((mode, kib, blocks, t["warm"].round_us, t["cold"].round_us, float(np.median(spans))))
                print(f"mode {mode} {kib:5d} KiB blocks {blocks:4d}: warm {t['warm'].round_us:6.1f} us "
                      f"cold {t['cold'].round_us:6.1f} us span {np.median(spans):6.1f} us", flush=True)
    gate.close()
    print("mode  KiB  blocks  warm_us  cold_us  span_us  GB/s(cold)")
    for mode, kib, blocks, w, c, s in rows:
        print(f"{mode:4d} {kib:5d} {blocks:6d} {w:8.1f} {c:8.1f} {s:8.1f} {(kib << 10) / (c * 1e3):10.1f}")


if __name__ == "__main__":
    main()
