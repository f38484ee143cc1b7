"""What the hardware gives, measured on the machine at hand: the limits cuep's bandwidth is compared with.

* ``peer_copy_gbps[a][b]``: ``cudaMemcpyPeerAsync`` of one large buffer from GPU a to GPU b, one pair at a time
  (``TARGETS.md``'s "peer-copy ceiling": 397 GB/s on the H200 x4 machine).
* ``all_pairs_gbps[a]``: the all-to-all pattern (every GPU sends to and receives from all others at once), as an
  EP kernel does it: one copy kernel per GPU on every SM (``cuep_bench_a2a_copy``: 16-byte loads and stores, 8 KiB
  pieces with the destinations interleaved); bytes leaving GPU a over its time. On 4 x H200 about 350 GB/s.
* ``all_pairs_copy_engine_gbps[a]``: the same pattern with ``cudaMemcpyPeerAsync``, each pair on its own stream of
  the source GPU (on 4 x H200 only 200-235 GB/s: the copy engines do worse than SMs at this).
* ``local_copy_gbps[a]``: ``cudaMemcpyAsync`` device-to-device on GPU a, bytes read plus bytes written.

Copies are far larger than L2, so only warm runs are taken; the start gate of :mod:`cuep.bench.timing` lines the
GPUs up for the all-pairs figure.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from . import timing


def _gbps(nbytes: float, us: float) -> float:
    return nbytes / (us * 1e3) if us > 0 else float("nan")


def peer_copy_matrix(devices: Sequence[int], nbytes: int, *, repeats: int, warmup: int) -> np.ndarray:
    """[R, R] GB/s of ``cudaMemcpyPeerAsync`` from devices[a] to devices[b], one pair at a time (NaN diagonal)."""
    import cupy

    R = len(devices)
    out = np.full((R, R), np.nan)
    src = {}
    for dev in devices:
        with cupy.cuda.Device(dev):
            src[dev] = cupy.cuda.Memory(nbytes)
            cupy.cuda.runtime.memset(src[dev].ptr, 0x5A, nbytes)
    for b, db in enumerate(devices):
        with cupy.cuda.Device(db):
            dst = cupy.cuda.Memory(nbytes)
        for a, da in enumerate(devices):
            if a == b:
                continue

            def run(_i, da=da, db=db, dst=dst):
                with cupy.cuda.Device(da):
                    cupy.cuda.runtime.memcpyPeerAsync(dst.ptr, db, src[da].ptr, da, nbytes,
                                                      cupy.cuda.get_current_stream().ptr)

            # one device: nothing to line up, so no start gate
            t = timing.measure(run, [da], repeats=repeats, warmup=warmup, modes=("warm",), gate=False)["warm"]
            out[a, b] = _gbps(nbytes, t.median_us[0])
    return out


def all_pairs(devices: Sequence[int], nbytes: int, *, repeats: int, warmup: int,
              gate: timing.StartGate | None) -> np.ndarray:
    """[R] GB/s leaving each GPU while every ordered pair copies ``nbytes`` at once."""
    import cupy

    R = len(devices)
    src, dst, streams, fork, join = {}, {}, {}, {}, {}
    for a, da in enumerate(devices):
        with cupy.cuda.Device(da):
            src[da] = cupy.cuda.Memory(nbytes)
            cupy.cuda.runtime.memset(src[da].ptr, 0x3C, nbytes)
            fork[da] = cupy.cuda.Event(disable_timing=True)
            for db in devices:
                if db != da:
                    streams[da, db] = cupy.cuda.Stream(non_blocking=True)
                    join[da, db] = cupy.cuda.Event(disable_timing=True)
        for db in devices:
            if db != da:
                with cupy.cuda.Device(db):
                    dst[da, db] = cupy.cuda.Memory(nbytes)

    def run(_i):
        for da in devices:
            with cupy.cuda.Device(da):
                main = cupy.cuda.get_current_stream()
                fork[da].record(main)
                for db in devices:
                    if db == da:
                        continue
                    s = streams[da, db]
                    s.wait_event(fork[da])
                    cupy.cuda.runtime.memcpyPeerAsync(dst[da, db].ptr, db, src[da].ptr, da, nbytes, s.ptr)
                    join[da, db].record(s)
                for db in devices:
                    if db != da:
                        main.wait_event(join[da, db])

    t = timing.measure(run, devices, repeats=repeats, warmup=warmup, modes=("warm",),
                       gate=gate if gate is not None else False)["warm"]
    return np.array([_gbps((R - 1) * nbytes, us) for us in t.median_us])


A2A_THREADS = 512   # cuep_bench_a2a_copy's block size
A2A_CHUNK = 8192    # bytes per work item


def all_pairs_kernel(devices: Sequence[int], nbytes: int, *, repeats: int, warmup: int,
                     gate: timing.StartGate | None) -> np.ndarray:
    """[R] GB/s leaving each GPU while every GPU copies ``nbytes`` to every other at once with an SM kernel."""
    import cupy

    from . import kernels

    R = len(devices)
    src, dst, tables = {}, {}, {}
    for da in devices:
        with cupy.cuda.Device(da):
            src[da] = cupy.cuda.Memory(nbytes)
            cupy.cuda.runtime.memset(src[da].ptr, 0x4B, nbytes)
            for db in devices:
                if db != da:
                    with cupy.cuda.Device(db):
                        dst[da, db] = cupy.cuda.Memory(nbytes)
    for da in devices:
        with cupy.cuda.Device(da):
            peers = [db for db in devices if db != da]
            tables[da] = (cupy.asarray([src[da].ptr] * len(peers), dtype=np.uint64),
                          cupy.asarray([dst[da, db].ptr for db in peers], dtype=np.uint64))

    def run(_i):
        for da in devices:
            with cupy.cuda.Device(da):
                s, d = tables[da]
                blocks = kernels._sm_count(da)
                kernels.function("cuep_bench_a2a_copy")((blocks,), (A2A_THREADS,), (
                    s, d, np.int32(R - 1), np.int64(nbytes), np.int32(A2A_CHUNK), np.int32(0)))

    t = timing.measure(run, devices, repeats=repeats, warmup=warmup, modes=("warm",),
                       gate=gate if gate is not None else False)["warm"]
    return np.array([_gbps((R - 1) * nbytes, us) for us in t.median_us])


def local_copy(devices: Sequence[int], nbytes: int, *, repeats: int, warmup: int,
               gate: timing.StartGate | None) -> np.ndarray:
    """[R] GB/s of a device-to-device ``cudaMemcpyAsync`` on each GPU, bytes read + bytes written."""
    import cupy

    bufs = {}
    for dev in devices:
        with cupy.cuda.Device(dev):
            bufs[dev] = (cupy.cuda.Memory(nbytes), cupy.cuda.Memory(nbytes))
            cupy.cuda.runtime.memset(bufs[dev][0].ptr, 0x69, nbytes)

    def run(_i):
        for dev in devices:
            with cupy.cuda.Device(dev):
                s, d = bufs[dev]
                cupy.cuda.runtime.memcpyAsync(d.ptr, s.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                              cupy.cuda.get_current_stream().ptr)

    t = timing.measure(run, devices, repeats=repeats, warmup=warmup, modes=("warm",),
                       gate=gate if gate is not None else False)["warm"]
    return np.array([_gbps(2 * nbytes, us) for us in t.median_us])


def measure_ceilings(devices: Sequence[int], nbytes: int, *, repeats: int = 10, warmup: int = 2,
                     gate: timing.StartGate | None = None, peers: bool = True) -> dict:
    """Every ceiling as a JSON-ready dict. ``peers=False`` (one GPU) measures only the local copy.

    Keys: ``bytes``, ``local_copy_gbps`` [R]; with peers also ``peer_copy_gbps`` [R][R] (null diagonal),
    ``peer_copy_per_gpu_gbps`` [R] (median over the GPU's outgoing pairs), ``all_pairs_gbps`` [R] (SM kernel) and
    ``all_pairs_copy_engine_gbps`` [R].
    """
    out: dict = {"bytes": int(nbytes), "devices": list(devices)}
    out["local_copy_gbps"] = local_copy(devices, nbytes, repeats=repeats, warmup=warmup, gate=gate).tolist()
    if peers and len(devices) > 1:
        m = peer_copy_matrix(devices, nbytes, repeats=repeats, warmup=warmup)
        out["peer_copy_gbps"] = [[None if np.isnan(v) else float(v) for v in row] for row in m]
        out["peer_copy_per_gpu_gbps"] = [float(np.nanmedian(row)) for row in m]
        out["all_pairs_gbps"] = all_pairs_kernel(devices, nbytes, repeats=repeats, warmup=warmup, gate=gate).tolist()
        out["all_pairs_copy_engine_gbps"] = all_pairs(devices, nbytes, repeats=repeats, warmup=warmup,
                                                      gate=gate).tolist()
    else:
        out["skipped_peers"] = "one GPU: no peer copies"
    return out
