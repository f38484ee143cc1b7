"""Where the time of a dispatch goes across real GPUs: fused, send half only, both halves (development aid).

Back-to-back rounds, wall time over many rounds after a warm-up (the GPUs stay busy, so host launch overhead
hides as long as a round is longer than the launches). usage: python scripts/phase_split.py [--tokens N]
"""
import argparse
import time

import cupy
import ml_dtypes
import numpy as np

import cuep


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--format", default="bf16")
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    g = cuep.init()
    cfg = cuep.EPConfig(7168, 8, 256, a.tokens, g.n_ranks, dispatch_format=a.format)
    buf = cuep.Buffer(g, cfg)
    rng = np.random.default_rng(0)
    xs, ids, ws, eo = [], [], [], []
    for d in g.devices:
        with cupy.cuda.Device(d):
            xs.append(cupy.asarray(rng.standard_normal((a.tokens, 7168)).astype(ml_dtypes.bfloat16)))
            ids.append(cupy.asarray(np.argsort(-rng.random((a.tokens, 256)), 1)[:, :8].astype(np.int32)))
            ws.append(cupy.asarray(rng.random((a.tokens, 8)).astype(np.float32)))
            eo.append(cupy.asarray(rng.standard_normal((cfg.capacity, 7168)).astype(ml_dtypes.bfloat16)))

    def sync():
        for d in g.devices:
            cupy.cuda.Device(d).synchronize()

    def timeit(fn):
        for _ in range(3):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            fn()
        sync()
        buf.check()
        return (time.perf_counter() - t0) / a.iters * 1e6

    d = cuep.dispatch(buf, xs, ids, ws)
    rows = [("dispatch fused", timeit(lambda: cuep.dispatch(buf, xs, ids, ws)))]
    # send halves alone leave the receive rounds behind: re-arm the buffer before the next experiment
    rows.append(("dispatch send half only", timeit(lambda: cuep.dispatch_async(buf, xs, ids, ws))))
    buf.reset()
    rows.append(("dispatch both halves", timeit(lambda: cuep.dispatch_wait(cuep.dispatch_async(buf, xs, ids, ws)))))
    buf.reset()
    d = cuep.dispatch(buf, xs, ids, ws)
    rows += [
        ("combine fused", timeit(lambda: cuep.combine(buf, eo, d))),
        ("combine send half only", timeit(lambda: cuep.combine_async(buf, eo, d))),
    ]
    buf.reset()
    d = cuep.dispatch(buf, xs, ids, ws)
    rows += [
        ("combine send half + wait", timeit(lambda: (cuep.combine_async(buf, eo, d), cuep.combine_wait(buf, eo, d)))),
    ]
    for name, us in rows:
        print(f"{g.n_ranks} GPUs N={a.tokens} {a.format}: {name:28s} {us:8.1f} us/round (wall, back to back)")


if __name__ == "__main__":
    main()
