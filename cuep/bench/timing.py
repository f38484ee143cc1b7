"""CUDA-event timing of one callable that launches work on several GPUs at once.

The method (``METHOD.md``): warm up first (compiles, NCCL connections and allocations stay out of the numbers);
then several **series** of many runs, each run bracketed by a CUDA event pair on every device's current stream,
and the **median** per device. Two series time the same thing twice: the spread between their medians is the
noise, printed beside every figure. Every run synchronises every device before the next.

* **cold** runs write a buffer of twice the L2 size on every device before the run (inputs and buffers start
  outside L2); **warm** runs do not. Both are reported; cold is the headline.
* **Start gate.** One process launches for all GPUs one after another, so without care GPU 0 starts tens of
  microseconds before GPU 3 and its time includes waiting for the others. Before each run every device gets a
  tiny gate kernel that spins (bounded) on host-mapped memory; the run's launches queue behind it and the host
  releases all devices at once, after every gate has arrived. The per-device times are then device times of one
  round that started together. Every launch of a run is queued before the release, so the host's launch
  overhead (Python, argument checks) is not in the times: they are what the GPUs spend, as a CUDA-graph replay
  would see it (``python -m cuep.bench --no-gate`` measures as launched). If a callable synchronises the host
  inside its launches the gate would block it; the gate then times out and the measurement is repeated ungated
  (``gated: false`` in the result).
* ``round_us``: per run, the longest device time (when the slowest GPU finished); its median is the round's time.

``fn(i)`` and ``setup(i)`` get the run index, so callers can rotate among several input sets; ``setup`` runs
untimed before each run (and is synchronised), e.g. the dispatch a timed combine needs.
"""
from __future__ import annotations

import ctypes
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

log = logging.getLogger("cuep.bench")

MODES = ("cold", "warm")
GATE_TIMEOUT_S = 20.0


class GateTimeout(RuntimeError):
    """A start gate was not released in time (the callable probably synchronised the host)."""


@dataclass
class Timing:
    """The times of one mode (cold or warm) of one measurement.

    Attributes:
        runs_us: [series][device][run] CUDA-event times in microseconds.
        gated: whether the runs started behind the start gate.
    """

    runs_us: list[list[list[float]]]
    gated: bool = True
    devices: list[int] = field(default_factory=list)

    @property
    def n_devices(self) -> int:
        return len(self.runs_us[0]) if self.runs_us else 0

    def device_runs(self, d: int) -> list[float]:
        """All runs of device index ``d``, every series."""
        return [t for s in self.runs_us for t in s[d]]

    @property
    def median_us(self) -> list[float]:
        """Median per device over every run of every series."""
        return [statistics.median(self.device_runs(d)) for d in range(self.n_devices)]

    @property
    def min_us(self) -> list[float]:
        return [min(self.device_runs(d)) for d in range(self.n_devices)]

    @property
    def round_runs_us(self) -> list[float]:
        """Per run, the longest device time (the round ends when the slowest GPU does)."""
        return [max(s[d][i] for d in range(len(s))) for s in self.runs_us for i in range(len(s[0]))]

    @property
    def round_us(self) -> float:
        return statistics.median(self.round_runs_us)

    @property
    def series_median_us(self) -> list[list[float]]:
        """[series][device] medians."""
        return [[statistics.median(dev) for dev in s] for s in self.runs_us]

    @property
    def noise(self) -> float:
        """Largest relative spread between the series' medians over devices: (max - min) / overall median."""
        if len(self.runs_us) < 2:
            return float("nan")
        per_series = self.series_median_us
        med = self.median_us
        return max((max(s[d] for s in per_series) - min(s[d] for s in per_series)) / med[d]
                   if med[d] > 0 else 0.0 for d in range(self.n_devices))

    def as_dict(self) -> dict:
        return {"median_us": self.median_us, "min_us": self.min_us, "round_us": self.round_us,
                "noise": self.noise, "series_median_us": self.series_median_us, "gated": self.gated,
                "runs": len(self.runs_us[0][0]) * len(self.runs_us) if self.runs_us else 0}


# ---- devices -------------------------------------------------------------------------------------------------
def synchronize(devices: Sequence[int]) -> None:
    """Wait for the current stream of every device."""
    import cupy

    for dev in devices:
        with cupy.cuda.Device(dev):
            cupy.cuda.get_current_stream().synchronize()


def use_private_streams(devices: Sequence[int]) -> list:
    """Make a fresh non-blocking stream current on every device (so nothing syncs with the legacy default
    stream) and return them; keep the list alive while timing."""
    import cupy

    streams = []
    for dev in devices:
        with cupy.cuda.Device(dev):
            s = cupy.cuda.Stream(non_blocking=True)
            s.use()
            streams.append(s)
    return streams


class L2Flusher:
    """Per device, a buffer of twice the L2 size; :meth:`flush` writes it on the current stream."""

    def __init__(self, devices: Sequence[int]) -> None:
        import cupy

        self.buffers = {}
        for dev in devices:
            with cupy.cuda.Device(dev):
                l2 = int(cupy.cuda.Device(dev).attributes.get("L2CacheSize", 64 << 20))
                self.buffers[dev] = cupy.cuda.Memory(max(2 * l2, 1 << 20))
        self._value = 0

    def flush(self, dev: int) -> None:
        import cupy

        mem = self.buffers[dev]
        with cupy.cuda.Device(dev):
            cupy.cuda.runtime.memsetAsync(mem.ptr, self._value, mem.size, cupy.cuda.get_current_stream().ptr)

    def next_value(self) -> None:
        self._value = (self._value + 1) & 0xFF  # a different byte each run: nothing can skip the writes


class StartGate:
    """Host-mapped counters and a spinning kernel per device that start the devices of one run together."""

    def __init__(self, devices: Sequence[int], timeout_s: float = GATE_TIMEOUT_S) -> None:
        import cupy

        rt = cupy.cuda.runtime
        self.devices = list(devices)
        self.timeout_s = float(timeout_s)
        n = len(self.devices)
        # [arrived x n | release | timed_out x n], uint32, pinned and mapped into every device (UVA: same address)
        self._ptr = rt.hostAlloc(4 * (2 * n + 1), rt.hostAllocPortable | rt.hostAllocMapped)
        self._words = (ctypes.c_uint32 * (2 * n + 1)).from_address(self._ptr)
        for i in range(2 * n + 1):
            self._words[i] = 0
        self._target = 0

    def _addr(self, word: int) -> int:
        return self._ptr + 4 * word

    def close(self) -> None:
        import cupy

        if self._ptr:
            synchronize(self.devices)
            cupy.cuda.runtime.freeHost(self._ptr)
            self._ptr = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def launch(self) -> None:
        """Queue one gate per device on its current stream (call before queueing the run)."""
        import cupy
        import numpy as np

        from . import kernels

        self._target += 1
        n = len(self.devices)
        for i, dev in enumerate(self.devices):
            with cupy.cuda.Device(dev):
                fn = kernels.function("cuep_bench_gate")
                fn((1,), (kernels.GATE_THREADS,),
                   (np.uint64(self._addr(i)), np.uint64(self._addr(n)), np.uint32(self._target),
                    np.uint64(int(self.timeout_s * 1e9)), np.uint64(self._addr(n + 1 + i))))

    def release(self) -> None:
        """Wait (bounded) until every gate has arrived, then release them all."""
        n = len(self.devices)
        deadline = time.perf_counter() + self.timeout_s
        while any(self._words[i] != self._target for i in range(n)):
            if time.perf_counter() > deadline:
                break
        self._words[n] = self._target

    def check(self) -> None:
        """Raise :class:`GateTimeout` if a gate of this run gave up waiting (call after synchronising)."""
        n = len(self.devices)
        late = [self.devices[i] for i in range(n) if self._words[n + 1 + i] == self._target]
        if late:
            raise GateTimeout(f"start gate timed out on GPU(s) {late}: the timed callable blocks the host "
                              f"(a host synchronisation inside it?)")


# ---- the measurement -------------------------------------------------------------------------------------------
def _series(fn, devices, *, runs: int, warmup: int, flush: L2Flusher | None, gate: StartGate | None,
            setup: Callable[[int], object] | None, start_index: int) -> list[list[float]]:
    import cupy

    events = {}
    for dev in devices:
        with cupy.cuda.Device(dev):
            events[dev] = (cupy.cuda.Event(), cupy.cuda.Event())
    times: list[list[float]] = [[] for _ in devices]
    for j in range(warmup + runs):
        i = start_index + j
        if setup is not None:
            setup(i)
            synchronize(devices)
        if flush is not None:
            flush.next_value()
            for dev in devices:
                flush.flush(dev)
        if gate is not None:
            gate.launch()
        try:
            for dev in devices:
                with cupy.cuda.Device(dev):
                    events[dev][0].record()
            fn(i)
            for dev in devices:
                with cupy.cuda.Device(dev):
                    events[dev][1].record()
        finally:
            if gate is not None:
                gate.release()  # also when fn raised: never leave a device spinning
        for dev in devices:
            events[dev][1].synchronize()
        if gate is not None:
            gate.check()
        if j >= warmup:
            for k, dev in enumerate(devices):
                times[k].append(cupy.cuda.get_elapsed_time(*events[dev]) * 1e3)
    return times


def measure(fn: Callable[[int], object], devices: Sequence[int], *, repeats: int = 30, warmup: int = 3,
            series: int = 2, modes: Sequence[str] = MODES, setup: Callable[[int], object] | None = None,
            flusher: L2Flusher | None = None, gate: StartGate | bool | None = True,
            after_series: Callable[[], object] | None = None) -> dict[str, Timing]:
    """Time ``fn`` on ``devices``: ``{mode: Timing}`` for each of ``modes`` ("cold" flushes L2 before each run).

    Args:
        fn: launches one run on every device's current stream (``fn(i)``, i = run index); must not synchronise.
        devices: CUDA device ids the run touches (events on each).
        repeats: timed runs per series; warmup: untimed runs before each series; series: how many times the
            whole measurement is repeated (their spread is the noise).
        setup: untimed work before each run (synchronised before timing starts).
        flusher: the L2 flusher for "cold" (created here if None and needed).
        gate: a :class:`StartGate`, True (make one), or False/None (time as the host launches).
        after_series: called after every series (e.g. a buffer's error check).
    """
    if repeats < 1 or series < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, series={series} must be >= 1 and warmup={warmup} >= 0")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes {bad} unknown; choose from {MODES}")
    devices = list(devices)
    own_gate = gate is True
    gate_obj = StartGate(devices) if own_gate else (gate or None)
    if "cold" in modes and flusher is None:
        flusher = L2Flusher(devices)
    out: dict[str, Timing] = {}
    gated = gate_obj is not None
    try:
        start = 0
        for mode in modes:
            fl = flusher if mode == "cold" else None
            runs: list[list[list[float]]] = []
            while len(runs) < series:
                try:
                    runs.append(_series(fn, devices, runs=repeats, warmup=warmup, flush=fl,
                                        gate=gate_obj if gated else None, setup=setup, start_index=start))
                except GateTimeout as e:
                    if not gated:
                        raise
                    log.warning("%s; timing this case as the host launches it instead", e)
                    synchronize(devices)
                    gated, runs = False, []
                    continue
                start += warmup + repeats
                if after_series is not None:
                    after_series()
            out[mode] = Timing(runs, gated=gated, devices=devices)
    finally:
        if own_gate and gate_obj is not None:
            gate_obj.close()
    return out
