#!/usr/bin/env python3
"""The Python part of an eager call's host cost, without a GPU (issue 24, item 4): what remains of a call once the
driver's launch is taken out.

    python benchmarks/host_python.py                      # this tree's cuep
    python benchmarks/host_python.py --base HEAD~1        # before / after in one process, alternating
    python benchmarks/host_python.py --base-dir ../old    # a baseline package directory (no git needed)

CuPy arrays are stand-ins holding the fields cuep's checks read (dtype, contiguity, shape, size, data.ptr,
device), the launch (``cuep._kernels._launch_raw``) does nothing, and a one-rank Buffer is assembled without
allocating (its kernels are never compiled). Timed, H = 7168, K = 8, E = 256, N = 128: dispatch + combine,
dispatch_async + dispatch_wait, dispatch + combine_async + combine_wait (bf16 and nvfp4 buffers),
ops.quantize and ops.dequantize with ``out=`` (fp8, nvfp4), ops.swizzle_block_scales with ``out=`` (nvfp4, E
groups) and ops.fused_silu with ``out=`` (fp8, nvfp4; capacity N K, 4 groups).
Medians over interleaved runs, us per case (the calls it names); on a GPU machine add the launch of each call
(``benchmarks/launch_floor.py``) and compare with ``benchmarks/host_cost.py``, which times the real calls.
Nothing is asserted.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
H, K, E, T, N = 7168, 8, 256, 4096, 128


class _Mem:
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr: int, device_id: int = 0):
        self.ptr, self.device_id = ptr, device_id


class StandIn:
    """The fields of a cupy.ndarray that cuep's argument checks read (and their messages: strides, device); each
    gets its own address, ``offset`` bytes past a 16 MiB boundary (tests/test_host_path_cpu.py uses them too)."""

    __slots__ = ("_shape", "dtype", "_c_contiguous", "size", "data")
    _next = [1 << 32]

    def __init__(self, shape, dtype, *, device: int = 0, offset: int = 0, contiguous: bool = True):
        self._shape, self.dtype, self._c_contiguous = tuple(shape), np.dtype(dtype), contiguous
        self.size = int(np.prod(self._shape))
        StandIn._next[0] += 1 << 24
        self.data = _Mem(StandIn._next[0] + offset, device)

    shape = property(lambda self: self._shape)
    ndim = property(lambda self: len(self._shape))
    strides = property(lambda self: (0,) * len(self._shape))
    device = property(lambda self: types.SimpleNamespace(id=self.data.device_id))

    def __len__(self) -> int:
        return self._shape[0]

    def __getitem__(self, s):
        return StandIn((len(range(*s.indices(self._shape[0]))),) + self._shape[1:], self.dtype)


class StandInRuntime:
    """cupy.cuda.runtime's current device, as a class attribute."""

    device = 0

    @classmethod
    def getDevice(cls) -> int:
        return cls.device

    @classmethod
    def setDevice(cls, d: int) -> None:
        cls.device = d


class StandInDevice:
    """``with cupy.cuda.Device(d):``, doing nothing."""

    def __init__(self, *a):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


STAND_IN_CUPY = types.SimpleNamespace(ndarray=StandIn, cuda=types.SimpleNamespace(runtime=StandInRuntime,
                                                                                    Device=StandInDevice))


def cases(pkg) -> dict:
    """{label: a function making one pair of calls} on stand-ins, for the package ``pkg`` (cuep or cuep_base)."""
    import ml_dtypes

    name = pkg.__name__
    ep, ops, kernels, params, buffer, config = (importlib.import_module(f"{name}.{m}") for m in (
        "ep", "ops", "_kernels", "params", "buffer", "config"))
    ep._cupy, ep._ND, ops._cupy, ops._ND = STAND_IN_CUPY, StandIn, STAND_IN_CUPY, StandIn
    for mod in (ep, ops):
        if hasattr(mod, "_runtime"):
            mod._runtime = StandInRuntime
    kernels._launch_raw = lambda *a: None
    fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=1))
    ep._kernel = lambda kernel_name, smem: fn
    bf16 = ml_dtypes.bfloat16
    out = {}

    def one(fmt: str) -> None:
        cfg = config.EPConfig(hidden=H, top_k=K, n_experts=E, n_gpus_per_node=1, max_tokens_per_rank=T,
                              dispatch_format=fmt)
        buf = object.__new__(buffer.Buffer)
        buf.group = types.SimpleNamespace(kind="local", shares_devices=False, phase_barrier=False, devices=[0])
        buf.cfg, buf.timeout_s, buf.num_sms = cfg, 5.0, 132
        buf._launch_cache = {("dispatch", True): (512, 65536), ("dispatch", False): (512, 65536)}
        buf._launched, buf._rounds = set(), {"dispatches": 0, "pending": None, "local": False}
        err = np.zeros(4, np.int32)
        a = StandIn((8,), np.uint8)
        r = buffer._Rank(rank=0, device=0, mem=None, params=np.zeros(1, params.EP_PARAMS_DTYPE), err_host=err,
                         err_host_ptr=0, tokens=a, scales=a, row_offsets=a, expert_ids=a, scales_offsets=a,
                         src_info=a, row_src=a, row_weight=a, msg_rows=a, msg_token=a, msg_j=a, msg_count=a,
                         err_status=memoryview(err).cast("B").cast("i"))
        r.combined = StandIn((T, H), bf16)
        buf._ranks = [r]
        x, ids, w = StandIn((N, H), bf16), StandIn((N, K), np.int32), StandIn((N, K), np.float32)
        eo = StandIn((cfg.capacity, H), bf16)
        last = {}

        def dispatch_combine():
            last["d"] = d = pkg.dispatch(buf, x, ids, w)
            pkg.combine(buf, eo, d)

        def async_wait():
            last["d"] = pkg.dispatch_wait(pkg.dispatch_async(buf, x, ids, w))

        def combine_halves():
            d = pkg.dispatch(buf, x, ids, w)
            pkg.combine_async(buf, eo, d)
            pkg.combine_wait(buf, eo, d)

        out[f"{fmt} dispatch + combine"] = dispatch_combine
        if fmt == "bf16":
            out["bf16 dispatch_async + dispatch_wait"] = async_wait
            out["bf16 dispatch + combine_async + combine_wait"] = combine_halves

    for fmt in ("bf16", "nvfp4"):
        one(fmt)
    sig = "PPPqif"
    for fmt in ("fp8", "nvfp4"):
        launch = kernels.PreparedLaunch(fn, 512, 0, 8 * len(sig), tuple(range(0, 8 * len(sig), 8)),
                                        kernels.slot_struct(sig))
        ops._prepared[("quantize.cu", f"quantize_{fmt}_bf16", 0, 0)] = (launch, 1024, sig)
        f = pkg.formats.FORMATS[fmt]
        xq = StandIn((N, H), bf16)
        outs = (StandIn((N, f.payload_bytes(H)), np.uint8), StandIn((N, f.scale_bytes(H)), np.uint8))
        out[f"ops.quantize {fmt} (out=)"] = lambda xq=xq, fmt=fmt, outs=outs: pkg.ops.quantize(xq, fmt, out=outs)
        launch = kernels.PreparedLaunch(fn, 256, 0, 8 * len(sig), tuple(range(0, 8 * len(sig), 8)),
                                        kernels.slot_struct(sig))
        ops._prepared[("quantize.cu", f"dequantize_{fmt}", 0, 0)] = (launch, 1024, sig)
        back = StandIn((N, H), np.float32)
        out[f"ops.dequantize {fmt} (out=)"] = lambda fmt=fmt, outs=outs, back=back: pkg.ops.dequantize(
            *outs, fmt, H, out=back)
    sig = "PqiPiPPq"
    ro_x = StandIn((E + 1,), np.int32)
    f = pkg.formats.FORMATS["nvfp4"]
    smem = 2 * (E + 1) * 4
    launch = kernels.PreparedLaunch(fn, 256, smem, 8 * len(sig), tuple(range(0, 8 * len(sig), 8)),
                                    kernels.slot_struct(sig))
    ops._prepared[("quantize.cu", "swizzle_block_scales", 0, smem)] = (launch, 1024, sig)
    sw = (StandIn((ops._swizzle_tiles(N, E) * f.scale_k_tiles(H) * pkg.formats.SCALE_TILE_BYTES,), np.uint8),
          StandIn((E,), np.uint32))
    sc = StandIn((N, f.scale_bytes(H)), np.uint8)
    out["ops.swizzle_block_scales nvfp4 (out=)"] = lambda: pkg.ops.swizzle_block_scales(sc, ro_x, "nvfp4", H, out=sw)
    sig = "PPiqiPPPqf"
    cap, groups = N * K, 4
    for fmt in ("fp8", "nvfp4"):
        f = pkg.formats.FORMATS[fmt]
        smem = ops._silu_ring_bytes() + (2 * (groups + 1) * 4 if f.swizzled_scales else 0)
        launch = kernels.PreparedLaunch(fn, 512, smem, 8 * len(sig), tuple(range(0, 8 * len(sig), 8)),
                                        kernels.slot_struct(sig))
        ops._prepared[("silu.cu", f"fused_silu_{fmt}_bf16", 0, smem)] = (launch, 1024, sig)
        hs, ro = StandIn((cap, 2 * H), bf16), StandIn((groups + 1,), np.uint32)
        if fmt == "fp8":
            outs = (StandIn((cap, H), np.uint8), StandIn((f.n_scales(H), cap), np.float32))
        else:
            tiles = ops._swizzle_tiles(cap, groups) * f.scale_k_tiles(H) * pkg.formats.SCALE_TILE_BYTES
            outs = (StandIn((cap, f.payload_bytes(H)), np.uint8), StandIn((tiles,), np.uint8),
                    StandIn((groups,), np.uint32))
        out[f"ops.fused_silu {fmt} (out=)"] = lambda hs=hs, ro=ro, fmt=fmt, outs=outs: pkg.ops.fused_silu(
            hs, ro, fmt, out=outs)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="also time this commit's cuep (git archive, as cuep_base)")
    p.add_argument("--base-dir", help="also time the cuep package in this directory")
    p.add_argument("--reps", type=int, default=2000, help="calls per timed run (default %(default)s)")
    p.add_argument("--runs", type=int, default=15, help="timed runs per case and package (default %(default)s)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ab_baseline as ab

    pkgs = ab.labelled_packages(args.base, args.base_dir)
    timed = {label: cases(pkg) for label, pkg in pkgs.items()}
    for fns in timed.values():
        for f in fns.values():
            f(), f()
    samples = {(label, case): [] for label in timed for case in timed[label]}
    clock = time.perf_counter
    for run in range(args.runs):
        order = list(timed) if run % 2 == 0 else list(timed)[::-1]
        for case in timed[order[0]]:
            for label in order:
                f = timed[label][case]
                t = clock()
                for _ in range(args.reps):
                    f()
                samples[(label, case)].append((clock() - t) / args.reps * 1e6)
    labels = list(timed)
    width = max(len(c) for c in timed[labels[0]])
    print(f"\nPython host path, launches stubbed, N = {N}, H = {H}, K = {K}, E = {E} (median us per case: the calls it names, "
          f"{sys.version.split()[0]}):")
    print(f"{'case':{width}s}  " + "  ".join(f"{lb:>18s}" for lb in labels) + ("  new/base" if len(labels) == 2 else ""))
    for case in timed[labels[0]]:
        meds = [statistics.median(samples[(lb, case)]) for lb in labels]
        row = f"{case:{width}s}  " + "  ".join(f"{m:18.2f}" for m in meds)
        if len(labels) == 2:
            row += f"  {meds[1] / meds[0]:8.2f}"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
