"""Where the time of one dispatch and one combine goes inside the kernels (development aid; decode shapes).

Needs the measurement knob: CUEP_EXTRA_DEFINES="CUEP_AB_TRACE=1" python scripts/trace_ep.py [--tokens 128]
[--format bf16] [--rounds 30]. Every round starts all GPUs together behind cuep.bench's start gate; thread 0 of
one block per phase records %globaltimer at the points below (ep.cuh: CUEP_TRACE); the table gives the median
over rounds of each point's time after the kernel's first point, per rank (us).
"""
import argparse

import cupy
import numpy as np

import cuep
from cuep.bench import cases, timing

POINTS = {
    0: "dispatch entry (block 0)", 1: "notify: block 0's tokens done (small: book)",
    2: "notify: last block published (small: block 0)",
    3: "send: histograms acquired (first send block) (small: ready)",
    4: "send: layout done (first send block) (small: = 3)", 5: "send: first send block's items done",
7: "recv: layout done (last block)", 8: "recv: last block's items done",
    9: "recv: padding done (last block)", 10: "recv: scale rows noted, barrier passed (last block)",
    22: "small notify: destinations ready (after the book)", 18: "small book: ids loaded",
    19: "small book: validity and masks", 21: "small book: positions and histogram",
    28: "send: latest block's items start", 23: "send: latest warp's items done",
    29: "recv: latest block's layout done", 24: "recv: latest warp's chunk flags seen",
    25: "recv: latest warp's item done", 26: "recv: latest block done (before the count)",
    27: "recv: latest block's scales gathered",
    12: "combine entry (block 0)", 13: "send: destinations ready (block 0)", 14: "send: block 0's items done",
    30: "send: latest warp's first rows issued", 31: "send: latest warp's first rows landed",
    11: "send: latest warp's partials arrived (posted)", 6: "recv: latest warp's arrival count seen", 15: "send: latest block done", 16: "recv: last block's tokens done", 20: "recv: latest block's tokens done",
    17: "recv: last block published readiness (not in parity slots)",
}


# the combine's own meaning of points that the dispatch uses too (the two kernels' traces are read apart)
DISPATCH_POINTS = {6: "notify: latest block's tokens done", 11: "notify: last block entered (grid barrier)",
                   12: "notify: message slots assigned (last block)"}
COMBINE_POINTS = {4: "send: latest warp's last store issued", 9: "send: latest warp's stores complete",
                  6: "recv: latest warp's slots landed (polled: summed)"}


def read_trace(buf, r):
    cfg = buf.cfg
    off = cfg.buffer_regions["counters"][0] + 4 * (32 + cfg.n_experts)
    out = np.zeros(32, dtype=np.uint32)
    with cupy.cuda.Device(r.device):
        cupy.cuda.runtime.memcpy(out.ctypes.data, r.base + off, 128, cupy.cuda.runtime.memcpyDeviceToHost)
        cupy.cuda.runtime.memset(r.base + off, 0, 128)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--format", default="bf16")
    p.add_argument("--rounds", type=int, default=30)
    a = p.parse_args()
    g = cuep.init()
    cfg = cuep.EPConfig(7168, 8, 256, a.tokens, g.n_ranks, dispatch_format=a.format)
    buf = cuep.Buffer(g, cfg)
    inp = cases.make_inputs(g.devices, a.tokens, 7168, 8, 256, n_sets=1)
    xs, ids, ws = inp.x[0], inp.ids[0], inp.weights[0]
    eo = []
    for d in g.devices:
        with cupy.cuda.Device(d):
            eo.append(cases.random_bf16(cupy.random.default_rng(d), (cfg.capacity, 7168), octaves=False))
    gate = timing.StartGate(g.devices)
    traces = {(r.rank, op): [] for r in buf._ranks for op in ("d", "c")}
    d = None
    for i in range(a.rounds + 3):
        for op in ("d", "c"):
            gate.launch()
            if op == "d":
                d = cuep.dispatch(buf, xs, ids, ws)
            else:
                cuep.combine(buf, eo, d)
            gate.release()
            timing.synchronize(g.devices)
            buf.check()
            for r in buf._ranks:
                t = read_trace(buf, r)
                if i >= 3:
                    traces[r.rank, op].append(t)
    gate.close()
    print(f"{g.n_ranks} GPUs, N={a.tokens}, {a.format}: median us after the kernel's first point, per rank")
    print(f"{'point':45s}" + "".join(f"  rank {r.rank:d}" for r in buf._ranks))
    for op, first, pts in (("d", 0, [0, 18, 19, 21, 1, 6, 11, 12, 22] + [2, 3, 4, 28, 5, 23, 7, 29, 24, 8, 25, 9, 26]), ("c", 12, [12, 13, 30, 31, 14, 4, 9, 11, 15, 6, 16, 20, 17])):
        for k in pts:
            row = []
            for r in buf._ranks:
                ts = np.array(traces[r.rank, op])
                dt = ((ts[:, k] - ts[:, first]) & 0xFFFFFFFF).astype(np.int64)
                ok = ts[:, k] != 0
                row.append(f"{np.median(dt[ok]) / 1e3:8.1f}" if ok.any() else "       -")
            name = COMBINE_POINTS.get(k, POINTS[k]) if op == "c" else DISPATCH_POINTS.get(k, POINTS[k])
            print(f"{k:2d} {name:42s}" + "".join(row))


if __name__ == "__main__":
    main()
