#!/usr/bin/env python3
"""Host (CPU) cost of one eager cuep call, measured while the GPU is busy, so no call ever waits on it (issue 24).

    PYTHONPATH=. python3 benchmarks/host_cost.py                     # this tree's cuep, H=7168 K=8 E=256
    PYTHONPATH=. python3 benchmarks/host_cost.py --base HEAD         # before (HEAD) / after (working tree), one run
    PYTHONPATH=. python3 benchmarks/host_cost.py --small             # H=256 K=2 E=8: quick, small buffers

Each batch first queues a spin kernel (one block polling ``clock64`` for ``--spin-ms``) on the current stream, then
runs ``--rounds`` rounds behind it, timing every call with ``time.perf_counter``: dispatch, combine (with the weights
given at dispatch), dispatch_async, dispatch_wait, combine_async, combine_wait, and on one rank ``ops.quantize``
(fp8, ``out=`` given) and ``ops.fused_silu`` (fp8, ``out=`` given, I = H/2). A batch whose spin kernel had ended
before its last call is reported (the GPU went idle: raise ``--spin-ms``). Cases: ranks 1 (one real rank) and
2 (two simulated ranks on one GPU, phase by phase), N in ``--tokens`` (default 1 128 4096), ``--formats``
(default bf16); ``--import-torch`` imports torch first (a torch program's case), ``--torch-tensors`` passes every
array as a torch tensor (the calls run in torch mode). Splitting a call's cost: ``--no-launch`` replaces the driver
launch (``cuep._kernels._launch_raw``) by a no-op in the timed batches (the Python part alone; the buffers are reset
after each batch, whose rounds ran nothing), ``--cold-mib M`` writes M MiB of host memory before each timed call,
outside its timing (the CPU caches cold, as when a model's other work runs between calls). The table (median us
per call; min beside it) is printed last. ``--base REF`` also times the commit REF's cuep, extracted and imported as
``cuep_base`` by benchmarks/ab_baseline.py, alternating with this tree's in every batch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SPIN_SRC = r"""
extern "C" __global__ void host_cost_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { __nanosleep(2000); }
}
"""
CALLS = ("dispatch", "combine", "dispatch_async", "dispatch_wait", "combine_async", "combine_wait", "quantize",
         "fused_silu")


class Spin:
    """Keeps the GPU busy: ``start()`` queues one long kernel; ``still_busy()`` tells whether it is still running."""

    def __init__(self, ms: float):
        import cupy

        self.kernel = cupy.RawKernel(SPIN_SRC, "host_cost_spin")
        khz = cupy.cuda.Device().attributes["ClockRate"]
        self.cycles = int(ms * khz)
        self.done = cupy.cuda.Event(disable_timing=True)

    def start(self) -> None:
        self.kernel((1,), (32,), (np.int64(self.cycles),))
        self.done.record()

    def still_busy(self) -> bool:
        return not self.done.done


class Case:
    """One package's buffer and inputs for ``ranks`` ranks on GPU ``dev`` and each N."""

    def __init__(self, pkg, ranks: int, fmt: str, tokens: list[int], dims: tuple[int, int, int], dev: int, seed: int,
                 torch_tensors: bool = False):
        import cupy
        import ml_dtypes

        H, K, E = dims
        self.pkg, self.ranks = pkg, ranks
        cfg = pkg.EPConfig(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=max(tokens), n_gpus_per_node=ranks,
                           dispatch_format=fmt)
        self.buf = pkg.Buffer(pkg.init([dev] * ranks), cfg)
        rng = np.random.default_rng(seed)
        bf16 = np.dtype(ml_dtypes.bfloat16)
        self.inputs = {}
        with cupy.cuda.Device(dev):
            self.expert_out = [cupy.zeros((cfg.capacity, H), np.uint16).view(bf16) for _ in range(ranks)]
            for n in tokens:
                xs = [cupy.asarray(rng.standard_normal((n, H), np.float32).astype(bf16)) for _ in range(ranks)]
                ids = [cupy.asarray(np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int32))
                       for _ in range(ranks)]
                ws = [cupy.asarray(rng.random((n, K), np.float32)) for _ in range(ranks)]
                I = H // 2
                h = cupy.asarray(rng.standard_normal((n, 2 * I), np.float32).astype(bf16))
                ops = dict(x=xs[0], q_out=(cupy.empty((n, H), np.uint8), cupy.empty((n, 4 * (H // 128)), np.uint8)),
                           h=h, ro=cupy.asarray(np.array([0, n], np.uint32)),
                           s_out=(cupy.empty((n, I), np.uint8), cupy.empty((I // 128, n), np.float32)))
                if torch_tensors:  # the same arrays as torch tensors (zero-copy views): calls run in torch mode
                    t = pkg.interop.as_torch
                    xs, ids, ws = [t(a) for a in xs], [t(a) for a in ids], [t(a) for a in ws]
                    ops = {k: tuple(t(a) for a in v) if isinstance(v, tuple) else t(v) for k, v in ops.items()}
                self.inputs[n] = (xs, ids, ws, ops)
            if torch_tensors:
                self.expert_out = [pkg.interop.as_torch(a) for a in self.expert_out]

    def close(self) -> None:
        self.buf.close()

    def round(self, n: int, times: dict | None, with_ops: bool, before=None) -> None:
        """One round of every call at N = n; each call's seconds appended to ``times[call]`` (None: untimed);
        ``before()`` runs before each call, untimed."""
        pkg, buf = self.pkg, self.buf
        xs, ids, ws, ops = self.inputs[n]
        one = self.ranks == 1
        x, i, w, eo = (xs[0], ids[0], ws[0], self.expert_out[0]) if one else (xs, ids, ws, self.expert_out)
        clock = time.perf_counter

        def timed(name, fn, *a, **kw):
            if before is not None:
                before()
            t0 = clock()
            r = fn(*a, **kw)
            t1 = clock()
            if times is not None:
                times[name].append(t1 - t0)
            return r

        d = timed("dispatch", pkg.dispatch, buf, x, i, w)
        timed("combine", pkg.combine, buf, eo, d)
        d = timed("dispatch_async", pkg.dispatch_async, buf, x, i, w)
        timed("dispatch_wait", pkg.dispatch_wait, d)
        timed("combine_async", pkg.combine_async, buf, eo, d)
        timed("combine_wait", pkg.combine_wait, buf, eo, d)
        if with_ops:
            timed("quantize", pkg.ops.quantize, ops["x"], "fp8", out=ops["q_out"])
            timed("fused_silu", pkg.ops.fused_silu, ops["h"], ops["ro"], "fp8", out=ops["s_out"])


def measure(pkgs: dict, args) -> tuple[dict, list[str]]:
    """{(label, ranks, fmt, N, call): [seconds]} and warnings."""
    import cupy

    dims = (256, 2, 8) if args.small else (7168, 8, 256)
    spin = Spin(args.spin_ms)
    cold = bytearray(args.cold_mib << 20) if args.cold_mib else None
    ones = b"\x01" * (len(cold) // 64) if cold else b""

    def before() -> None:  # one byte of every 64-byte line written: the CPU caches hold this, not the last call
        cold[::64] = ones

    kernels = {label: sys.modules[f"{pkg.__name__}._kernels"] for label, pkg in pkgs.items()}
    results: dict = {}
    warnings: list[str] = []
    for ranks in args.ranks:
        for fmt in args.formats:
            cases = {label: Case(pkg, ranks, fmt, args.tokens, dims, args.device, args.seed, args.torch_tensors)
                     for label, pkg in pkgs.items()}
            try:
                for n in args.tokens:
                    with_ops = ranks == 1
                    for c in cases.values():  # compile and warm up, untimed
                        c.round(n, None, with_ops)
                        c.round(n, None, with_ops)
                    cupy.cuda.Device(args.device).synchronize()
                    times = {label: {call: [] for call in CALLS} for label in cases}
                    for b in range(args.batches):
                        order = list(cases) if b % 2 == 0 else list(cases)[::-1]
                        for label in order:
                            spin.start()
                            real = kernels[label]._launch_raw
                            if args.no_launch:
                                kernels[label]._launch_raw = lambda *a, **kw: None
                            try:
                                for _ in range(args.rounds):
                                    cases[label].round(n, times[label], with_ops, before if cold else None)
                            finally:
                                kernels[label]._launch_raw = real
                            if not spin.still_busy() and not args.no_launch:
                                warnings.append(f"{label} ranks={ranks} {fmt} N={n} batch {b}: the GPU went idle "
                                                f"before the last call (raise --spin-ms)")
                            cases[label].buf.synchronize()
                            if args.no_launch:  # the host's round state ran ahead of the GPU's: re-arm
                                cases[label].buf.reset()
                    for label in cases:
                        for call, v in times[label].items():
                            if v:
                                results[(label, ranks, fmt, n, call)] = v
                    print(f"[host_cost] ranks={ranks} {fmt} N={n}: " + ", ".join(
                        f"{label} dispatch {1e6 * statistics.median(times[label]['dispatch']):.1f} us"
                        for label in cases), flush=True)
            finally:
                for c in cases.values():
                    c.close()
    return results, warnings


def table(results: dict, labels: list[str]) -> str:
    keys = sorted({k[1:] for k in results}, key=lambda k: (k[0], k[1], CALLS.index(k[3]), k[2]))
    head = ["call", "ranks", "fmt", "N"] + [f"{lb} us (min)" for lb in labels]
    if len(labels) == 2:
        head.append(f"{labels[1]}/{labels[0]}")
    rows = [head]
    for ranks, fmt, n, call in keys:
        row = [call, str(ranks), fmt, str(n)]
        meds = []
        for lb in labels:
            v = results.get((lb, ranks, fmt, n, call))
            meds.append(statistics.median(v) if v else float("nan"))
            row.append(f"{1e6 * meds[-1]:.1f} ({1e6 * min(v):.1f})" if v else "-")
        if len(labels) == 2:
            row.append(f"{meds[1] / meds[0]:.2f}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="also time this commit's cuep (git archive, as cuep_base)")
    p.add_argument("--base-dir", help="also time the cuep package in this directory")
    p.add_argument("--small", action="store_true", help="H=256, K=2, E=8 instead of H=7168, K=8, E=256")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 4096])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--formats", nargs="+", default=["bf16"])
    p.add_argument("--rounds", type=int, default=20, help="rounds per batch (behind one spin kernel)")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--spin-ms", type=float, default=100.0)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every sample here")
    p.add_argument("--no-launch", action="store_true",
                   help="timed calls launch nothing (the driver launch a no-op): the Python part of each call")
    p.add_argument("--cold-mib", type=int, default=0, metavar="M",
                   help="write M MiB of host memory before each timed call (untimed): CPU caches cold")
    p.add_argument("--import-torch", action="store_true",
                   help="import torch first, as a torch program has (the arguments stay CuPy arrays): every call "
                        "then looks at its arguments for tensors")
    p.add_argument("--torch-tensors", action="store_true",
                   help="pass every array as a torch tensor (zero-copy views of the same memory): a torch program's "
                        "calls, in torch mode (cuep.interop)")
    args = p.parse_args(argv)
    if args.import_torch or args.torch_tensors:
        import torch  # noqa: F401

    os.environ.setdefault("CUEP_LOG", "0")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ab_baseline as ab
    import cupy

    pkgs = ab.labelled_packages(args.base, args.base_dir)
    with cupy.cuda.Device(args.device):
        results, warnings = measure(pkgs, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"|".join(map(str, k)): v for k, v in results.items()}))
    for w in warnings:
        print("WARNING:", w)
    dev = cupy.cuda.runtime.getDeviceProperties(args.device)["name"].decode()
    print(f"\nhost us per call (median of {args.batches} x {args.rounds}; min in brackets), GPU busy, {dev}, "
          f"{'H=256 K=2 E=8' if args.small else 'H=7168 K=8 E=256'}"
          f"{', torch tensors' if args.torch_tensors else ', torch imported' if args.import_torch else ''}"
          f"{', launches stubbed (Python only)' if args.no_launch else ''}"
          f"{f', {args.cold_mib} MiB written before each call' if args.cold_mib else ''}")
    print(table(results, list(pkgs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
