"""Quick CUDA-event timing of cuep dispatch/combine on the local GPUs (a development aid; cuep.bench is the tool).

usage: python scripts/time_ep.py [--ranks R] [--tokens N] [--format bf16] [--sim]
"""
import argparse

import cupy
import ml_dtypes
import numpy as np

import cuep


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--format", default="bf16")
    p.add_argument("--sim", action="store_true", help="all ranks on GPU 0")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    devs = [0] * a.ranks if a.sim else list(range(a.ranks))
    g = cuep.init(devs)
    cfg = cuep.EPConfig(a.hidden, 8, 256, a.tokens, a.ranks, dispatch_format=a.format)
    buf = cuep.Buffer(g, cfg)
    rng = np.random.default_rng(0)
    xs, ids, ws, eo = [], [], [], []
    for d in devs:
        with cupy.cuda.Device(d):
            xs.append(cupy.asarray(rng.standard_normal((a.tokens, a.hidden)).astype(ml_dtypes.bfloat16)))
            ids.append(cupy.asarray(np.argsort(-rng.random((a.tokens, 256)), 1)[:, :8].astype(np.int32)))
            ws.append(cupy.asarray(rng.random((a.tokens, 8)).astype(np.float32)))
            eo.append(cupy.asarray(rng.standard_normal((cfg.capacity, a.hidden)).astype(ml_dtypes.bfloat16)))

    def timeit(fn, stream=None):
        for _ in range(3):
            fn()
        buf.synchronize()
        if stream is not None:
            stream.synchronize()
        ts = []
        for _ in range(a.repeats):
            s, e = cupy.cuda.Event(), cupy.cuda.Event()
            s.record(stream)
            fn()
            e.record(stream)
            e.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(s, e) * 1e3)
        buf.check()
        return float(np.median(ts))

    d = cuep.dispatch(buf, xs, ids, ws)
    td = timeit(lambda: cuep.dispatch(buf, xs, ids, ws))
    tc = timeit(lambda: cuep.combine(buf, eo, d))
    ta = timeit(lambda: cuep.dispatch_async(buf, xs, ids, ws) and cuep.dispatch_wait(d))
    # The same through CUDA graphs (what decode loops use): host launch overhead out of the picture.
    tg_d = tg_c = float("nan")
    if len(set(devs)) == 1:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            cuep.dispatch(buf, xs, ids, ws)
            stream.synchronize()
            stream.begin_capture()
            for _ in range(10):
                cuep.dispatch(buf, xs, ids, ws)
            gd = stream.end_capture()
            stream.begin_capture()
            for _ in range(10):
                cuep.combine(buf, eo, d)
            gc = stream.end_capture()
            tg_d = timeit(lambda: gd.launch(stream), stream) / 10
            tg_c = timeit(lambda: gc.launch(stream), stream) / 10
            stream.begin_capture()
            for _ in range(10):
                cuep.dispatch_async(buf, xs, ids, ws)
                cuep.dispatch_wait(d)
            ga = stream.end_capture()
            stream.begin_capture()
            for _ in range(10):
                cuep.combine_async(buf, eo, d)
                cuep.combine_wait(buf, eo, d)
            gca = stream.end_capture()
            tg_a = timeit(lambda: ga.launch(stream), stream) / 10
            tg_ca = timeit(lambda: gca.launch(stream), stream) / 10
            print(f"  graph: dispatch as two halves {tg_a:.1f} us, combine as two halves {tg_ca:.1f} us")
            # phase split of the fused dispatch kernel: notify only, notify+send, all three
            from cuep import ep as ep_mod
            r0 = buf._ranks[0]
            threads, smem = ep_mod._dispatch_launch(buf, staged=cfg.fmt.name != "bf16")
            fn = ep_mod._kernel(f"dispatch.cu:cuep_dispatch_{cfg.fmt.name}_from_bf16", smem)
            z = ep_mod._NULL

            def launch(ph):
                fn((buf.num_sms,), (threads,), (r0.params, xs[0], ids[0], ws[0], np.int32(a.tokens), np.float32(1),
                                                r0.scales if r0.scales is not None else z, r0.row_offsets,
                                                r0.expert_ids, r0.scales_offsets if r0.scales_offsets is not None
                                                else z, r0.src_info, r0.row_src, r0.row_weight, r0.msg_rows,
                                                r0.msg_token, r0.msg_j, r0.msg_count, np.int32(ph)), shared_mem=smem)
            out = []
            for ph in (1, 3, 7):
                buf.reset()  # notify alone leaves the message-slot counters for send to re-arm
                stream.begin_capture()
                for _ in range(10):
                    launch(ph)
                gp = stream.end_capture()
                out.append(timeit(lambda: gp.launch(stream), stream) / 10)
            buf.reset()
            print(f"  graph: dispatch phases notify {out[0]:.1f} us, +send {out[1]:.1f} us, +recv {out[2]:.1f} us")
    rows = int(d[0].row_offsets[-1].get())
    print(f"ranks={a.ranks} sim={a.sim} N={a.tokens} H={a.hidden} fmt={a.format} sms={buf.num_sms} rows(rank0)={rows}: "
          f"dispatch {td:.1f} us (as two launches {ta:.1f} us; in a graph {tg_d:.1f} us), "
          f"combine {tc:.1f} us (in a graph {tg_c:.1f} us)")


if __name__ == "__main__":
    main()
