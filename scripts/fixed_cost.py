"""What a small dispatch / combine costs before any data moves (development aid): on all local GPUs, gated CUDA-event
times (cuep.bench.timing, warm and cold, median of the slowest GPU per run) of

* an empty kernel of one block (the launch and event floor),
* the dispatch kernel with no phase (launch of the full grid, entry, exit),
* dispatch, combine and both at N = 1, 16 and 128 (H = 7168, K = 8, E = 256, bf16 unless --format),
* the dispatch's send half alone and its receive half alone (every message landed before it starts).

Usage: python scripts/fixed_cost.py [--format bf16] [--tokens 1 16 128] [--small-batch-tokens N]
"""
import argparse
import cupy

import cuep
from cuep import ep as ep_mod
from cuep.bench import cases, timing


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--format", default="bf16")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--small-batch-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    g = cuep.init()
    devs = list(g.devices)
    kernel = cupy.ElementwiseKernel("", "int32 y", "y = 1", "cuep_empty")
    outs = {}
    for d in devs:
        with cupy.cuda.Device(d):
            outs[d] = cupy.zeros(1, dtype=cupy.int32)

    def run_empty(i):
        for d in devs:
            with cupy.cuda.Device(d):
                kernel(outs[d])

    rows = []
    t = timing.measure(run_empty, devs, repeats=a.repeats, series=1)
    rows.append(("empty kernel (1 block)", t["warm"].round_us, t["cold"].round_us))
    for n in a.tokens:
        inp = cases.make_inputs(devs, n, 7168, 8, 256, n_sets=2)
        case = cases.CuepCase(g, inp, a.format, small_batch_tokens=a.small_batch_tokens)
        case.check()
        k = lambda i: i % inp.n_sets  # noqa: E731
        if n == a.tokens[0]:
            def no_phase(i):
                ep_mod._dispatch(case.buf, inp.x[k(i)], inp.ids[k(i)], inp.weights[k(i)], 1.0, 0)
            t = timing.measure(no_phase, devs, repeats=a.repeats, series=1)
            rows.append(("dispatch kernel, no phase", t["warm"].round_us, t["cold"].round_us))
        for name, fn, setup in (("dispatch", case.dispatch, None), ("combine", case.combine, case.setup_combine),
                                ("round trip", case.roundtrip, None)):
            t = timing.measure(fn, devs, repeats=a.repeats, series=1, setup=setup)
            rows.append((f"{name} N={n}", t["warm"].round_us, t["cold"].round_us))
        # the halves on their own: the send half (its receive half runs untimed before the next one), and the
        # receive half with every message already landed (its send half ran untimed, synchronised)
        pending = []

        def send_half(i):
            pending.append(cuep.dispatch_async(case.buf, inp.x[k(i)], inp.ids[k(i)], inp.weights[k(i)]))

        def finish(i):
            while pending:
                cuep.dispatch_wait(pending.pop())

        def recv_half(i):
            cuep.dispatch_wait(pending.pop())

        t = timing.measure(send_half, devs, repeats=a.repeats, series=1, setup=finish)
        finish(0)
        rows.append((f"dispatch send half N={n}", t["warm"].round_us, t["cold"].round_us))
        t = timing.measure(recv_half, devs, repeats=a.repeats, series=1, setup=send_half)
        rows.append((f"dispatch receive half N={n}", t["warm"].round_us, t["cold"].round_us))
        case.buf.check()
        case.close()
    print(f"{len(devs)} GPU(s), {a.format}, small_batch_tokens={a.small_batch_tokens}: round time (us, median)")
    print(f"{'':32s} {'warm':>8s} {'cold':>8s}")
    for name, w, c in rows:
        print(f"{name:32s} {w:8.1f} {c:8.1f}")


if __name__ == "__main__":
    main()
