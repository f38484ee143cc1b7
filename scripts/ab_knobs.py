"""In-process A/B of the EP kernels' runtime measurement knobs (development aid).

Builds differ from process to process by +-0.5 us at decode sizes, more than most changes worth measuring; knobs
that the kernels read at run time (``CUEP_EP_KNOBS`` bits, ep.cuh kKnob*) can instead be alternated inside one
process on one buffer: variant A, B, A, B, ... each a short gated measurement (cuep.bench.timing), and the median
over rounds of each variant's median. Decode shapes (H = 7168, K = 8, E = 256).

Usage: python scripts/ab_knobs.py --knobs 0 0x80000 [--tokens 128] [--rounds 8] [--op dispatch|combine|both]
"""
import argparse
import statistics

import cupy

import cuep
from cuep import ep as ep_mod
from cuep.bench import cases, timing


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--knobs", nargs="+", required=True, help="knob words to alternate, e.g. 0 0x80000")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--format", default="bf16")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--op", choices=("dispatch", "combine", "both"), default="dispatch")
    a = p.parse_args()
    knobs = [int(k, 0) for k in a.knobs]
    g = cuep.init()
    devs = list(g.devices)
    inp = cases.make_inputs(devs, a.tokens, 7168, 8, 256, n_sets=1)
    case = cases.CuepCase(g, inp, a.format)
    case.check()
    ops = {"dispatch": [("dispatch", case.dispatch, None)], "combine": [("combine", case.combine, case.setup_combine)]}
    ops["both"] = ops["dispatch"] + ops["combine"]
    res = {(k, name, m): [] for k in knobs for name, _, _ in ops[a.op] for m in ("warm", "cold")}
    for rnd in range(a.rounds):
        for k in knobs:
            ep_mod._KNOBS = k
            for name, fn, setup in ops[a.op]:
                t = timing.measure(fn, devs, repeats=a.repeats, series=1, setup=setup)
                for m in ("warm", "cold"):
                    res[k, name, m].append(t[m].round_us)
        print(f"round {rnd + 1}/{a.rounds} done", flush=True)
    ep_mod._KNOBS = 0
    case.buf.check()
    case.close()
    print(f"{len(devs)} GPU(s), N={a.tokens}, {a.format}: median over {a.rounds} alternating rounds of each round's "
          f"median (us, slowest GPU); min-max in brackets")
    for name, _, _ in ops[a.op]:
        for k in knobs:
            w, c = res[k, name, "warm"], res[k, name, "cold"]
            print(f"{name:9s} knobs {k:#8x}  warm {statistics.median(w):6.2f} [{min(w):.1f}-{max(w):.1f}]  "
                  f"cold {statistics.median(c):6.2f} [{min(c):.1f}-{max(c):.1f}]")


if __name__ == "__main__":
    main()
