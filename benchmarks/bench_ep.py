"""cuep dispatch, combine and round trip at the standard shapes, on all local GPUs (pytest-benchmark).

    pytest benchmarks/bench_ep.py --benchmark-only        # CUDA-event numbers in extra_info
    python -m cuep.bench                                  # the full run: NCCL baseline, ceilings, sweep, plots

Shapes (TARGETS.md): prefill N = 4096 tokens per rank and decode N = 128, H = 7168, K = 8, E = 256, one rank per
visible GPU (a single GPU runs one rank: every token stays local). Formats bf16, fp8, nvfp4, mxfp4.

Timing is :mod:`cuep.bench.timing`, the CLI's: CUDA events on every GPU, a start gate that lines the GPUs up,
warm-up, two series of runs, medians; cold (L2 flushed before each run) and warm. Those numbers go to
``benchmark.extra_info``: ``cuda_event_median_us`` (per GPU, cold), ``round_us`` (slowest GPU), the warm
figures, the noise between the two series, send and algorithm GB/s (byte accounting of
:mod:`cuep.bench.traffic`), their ratio to the measured peer-copy ceiling, and cuep's SM count.
pytest-benchmark's own figure is a host clock around one synchronised round (launch overhead included). No timing
is asserted: benchmarks print and save numbers.
"""
from __future__ import annotations

import os
import sys

import pytest

try:
    import cuep
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import cuep

import cupy  # noqa: E402

from cuep.bench import cases, ceilings, report, timing  # noqa: E402

HIDDEN, TOP_K, EXPERTS = 7168, 8, 256
SHAPES = {"prefill": 4096, "decode": 128}
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
OPS = ("dispatch", "combine", "roundtrip")
REPEATS, WARMUP, SERIES = 20, 3, 2
CEILING_BYTES = 256 << 20


def _n_gpus() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount() if cupy.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


class _Env:
    """Everything shared by the cases of this module: the group, streams, gate, flusher, inputs, ceilings."""

    def __init__(self) -> None:
        self.devices = list(range(_n_gpus()))
        self.group = cuep.init(self.devices)
        self.streams = timing.use_private_streams(self.devices)
        self.gate = timing.StartGate(self.devices)
        self.flusher = timing.L2Flusher(self.devices)
        self._inputs: dict[int, cases.Inputs] = {}
        self.ceilings = (ceilings.measure_ceilings(self.devices, CEILING_BYTES, gate=self.gate)
                         if len(self.devices) > 1 else None)
        props = cupy.cuda.runtime.getDeviceProperties(self.devices[0])
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]

    def inputs(self, n: int) -> cases.Inputs:
        if n not in self._inputs:
            self._inputs.clear()  # one N at a time: the cases are ordered by shape
            self._inputs[n] = cases.make_inputs(self.devices, n, HIDDEN, TOP_K, EXPERTS, n_sets=2, seed=n)
        return self._inputs[n]

    def close(self) -> None:
        self._inputs.clear()
        self.gate.close()


@pytest.fixture(scope="module")
def env():
    if _n_gpus() < 1:
        pytest.skip("needs an NVIDIA GPU")
    e = _Env()
    yield e
    e.close()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ep(benchmark, env, shape, fmt, op):
    n = SHAPES[shape]
    inputs = env.inputs(n)
    case = cases.CuepCase(env.group, inputs, fmt)
    try:
        check = case.check()
        fn = getattr(case, op)
        setup = case.setup_combine if op == "combine" else None
        t = timing.measure(fn, env.devices, repeats=REPEATS, warmup=WARMUP, series=SERIES, setup=setup,
                           flusher=env.flusher, gate=env.gate, after_series=case.buf.check)
        tr = cases.traffic_of(op, case.cfg, inputs.pairs())
        rec = report.fill_derived({"bytes": tr.as_dict(), "cold": t["cold"].as_dict(), "warm": t["warm"].as_dict()},
                                  env.ceilings)
        r2 = lambda v: None if v is None else [round(x, 3) for x in v]  # noqa: E731
        benchmark.extra_info.update({
            "op": op, "fmt": fmt, "shape": shape, "N": n, "H": HIDDEN, "K": TOP_K, "E": EXPERTS,
            "n_gpus": len(env.devices), "device": env.device_name, "num_sms": case.num_sms, "check": check,
            "cuda_event_median_us": r2(rec["time_us"]), "round_us": round(rec["round_us"], 2),
            "warm_median_us": r2(rec["warm"]["median_us"]), "warm_round_us": round(rec["warm"]["round_us"], 2),
            "noise": round(rec["noise"], 4), "gated": rec["cold"]["gated"],
            "send_bytes": tr.as_dict()["send"], "algo_bytes": tr.as_dict()["algo"],
            "send_GBps": r2(rec["send_gbps"]), "algo_GBps": r2(rec["algo_gbps"]),
            "of_peer_copy": r2(rec["of_peer_copy"]), "of_all_pairs": r2(rec["of_all_pairs"])})

        state = {"i": 0}

        def before():
            if setup is not None:
                setup(state["i"])
                timing.synchronize(env.devices)

        def once():
            fn(state["i"])
            timing.synchronize(env.devices)
            state["i"] += 1

        benchmark.pedantic(once, setup=before, rounds=10, iterations=1, warmup_rounds=2)
        case.buf.check()
    finally:
        case.close()
        for dev in env.devices:
            with cupy.cuda.Device(dev):
                cupy.get_default_memory_pool().free_all_blocks()
