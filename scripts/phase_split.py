"""Where the time of a dispatch goes across real GPUs: fused, send half only, both halves (development aid).

Back-to-back rounds, wall time over many rounds after a warm-up (the GPUs stay busy, so host launch overhead
hides as long as a round is longer than the launches). usage: python scripts/phase_split.py [--tokens N]
[--format F] [--iters I]. The measurement knobs of combine.cu (CUEP_EXTRA_DEFINES="CUEP_AB_COMBINE_LOCAL=1",
"CUEP_AB_COMBINE_NO_LOADS=1": wrong results, timing only) split its send half further.
"""
import argparse
import time

import cupy
import numpy as np

import cuep
from cuep.bench.cases import random_bf16


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--format", default="bf16")
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    g = cuep.init()
    cfg = cuep.EPConfig(7168, 8, 256, a.tokens, g.n_ranks, dispatch_format=a.format)
    buf = cuep.Buffer(g, cfg)
    # Inputs drawn on each GPU (the expert outputs are capacity x H: hundreds of millions of values at 4+ ranks,
    # far too slow to draw with NumPy).
    xs, ids, ws, eo = [], [], [], []
    for i, d in enumerate(g.devices):
        with cupy.cuda.Device(d):
            rng = cupy.random.default_rng(i)
            xs.append(random_bf16(rng, (a.tokens, 7168)))
            ids.append(cupy.argsort(-rng.random((a.tokens, 256), dtype=np.float32), axis=1)[:, :8].astype(np.int32))
            ws.append(rng.random((a.tokens, 8), dtype=np.float32))
            eo.append(random_bf16(rng, (cfg.capacity, 7168), octaves=False))

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
        print(f"{g.n_ranks} GPUs N={a.tokens} {a.format}: {name:28s} {us:8.1f} us/round (wall, back to back)",
              flush=True)


if __name__ == "__main__":
    main()
