"""``python -m cuep.bench --floor``: one GPU, each op beside its floor (a plain copy of its bytes) and its host cost.

    python -m cuep.bench --floor --out out/floor                 # H=7168 K=8 E=256, N = 1 32 128 4096
    python -m cuep.bench --floor --floor-n 128 --formats bf16 fp8 --phases
    python -m cuep.bench --floor --dry-run                       # the plan and every case's bytes (no GPU)
    python -m cuep.bench --floor --from-json out/floor/floor.json

One real rank (``cuep.init([device])``: every expert local, nothing crosses NVLink). Per wire format one
:class:`cuep.Buffer` sized for the largest N (``--max-tokens``), as a model sizes it for prefill and runs decode
rounds in it (with the default ``small_batch_tokens`` N <= 256 takes the staged protocol, larger N the direct
one). Ops: ``cuep.dispatch`` of bf16 tokens in every ``--formats`` format, with topk_weights; ``cuep.combine`` bf16
with the weights given at dispatch (timed after an untimed bf16 dispatch). For every (op, format, N):

* **GPU time**, :mod:`cuep.bench.timing`: CUDA events around the call, behind the start gate (every launch is
  queued before the GPU starts, so the host's cost is not in it), ``--warmup`` untimed runs then ``--series`` x
  ``--repeats`` timed ones, medians; **cold** flushes L2 before each run, **warm** does not (the previous run's
  inputs are still in L2). The runs rotate among ``--input-sets`` random input sets.
* **floor**: one copy kernel (``cuep_bench_floor_copy`` in ``cuda_src/bench.cu``: grid-stride 16-byte vectors,
  4 in flight per thread, 4 blocks of 512 threads per SM at most) that reads the op's input bytes and writes its
  output bytes, timed the same way right after the op. The bytes (:func:`cuep.bench.traffic.floor_bytes`):
  dispatch reads x ``[N, H]`` bf16, topk_ids and topk_weights, and writes ``N x K`` rows of payload + scales in
  the wire format, 8 bytes of ``src_info`` per row and the per-group ``row_offsets`` / ``expert_ids`` /
  ``scales_offsets``; combine reads ``N x K`` rows of expert_out and 8 bytes per row (its token and weight) and
  writes ``[N, H]``. ``x floor`` = GPU time / floor time (cold over cold, warm over warm); 1 / x is the share of
  the floor's bandwidth reached. **layout floor**: the same copy with the bytes the output layout makes a
  dispatch write besides (fp8 rows padded to 4 per expert; nvfp4 / mxfp4 every used 128x4 scale tile written in
  full: at N = 128, H = 7168 about 4.4x the rows' own bytes for nvfp4): what no kernel honouring the layout can
  beat.
* **host cost**: CPU wall time (``time.perf_counter``) of one eager Python call while the GPU is held by a
  spinning gate kernel (:class:`cuep.bench.timing.StartGate`, bounded), so no call can wait on the GPU: per batch
  the gate is queued, ``--host-calls`` calls are made and timed one by one, the gate is released and the GPU
  drained before the next batch; one untimed batch first, then ``--host-batches`` timed ones; median (and p90)
  per call. A call that blocks the host (a synchronisation) makes the gate time out: its figures are marked
  ``blocked``. Calls: ``cuep.dispatch`` and ``cuep.combine`` (the main table's column), ``dispatch_async`` /
  ``dispatch_wait``, ``combine_async`` / ``combine_wait``, ``cuep.ops.quantize`` (fp8 / nvfp4 / mxfp4 of x
  ``[N, H]``), ``dequantize`` and ``swizzle_block_scales`` (fp4) of its output, and ``cuep.ops.fused_silu`` (h
  ``[N K, 2H]`` bf16, E groups), the ops with ``out=`` given. The
  untimed work between timed calls (combine's dispatch) is queued behind the gate too. ``launch only``: a bare
  launch of an empty kernel shaped like the dispatch's, the part of a call's host time that is the driver's, not
  Python's (it differs between hosts: 3.9 us on one H100 host, 6.5 on another). **x launch**: before every timed
  call the same bare launch is timed too, and each call's median is given over the bare launch's of its own
  batches, a ratio that holds across hosts and through a passing burst of host load (one such burst, after a
  Buffer's memory is freed, doubles every call's time for about 0.1 s). ``python_call_ns`` (in ``meta``, printed
  over the table): this interpreter's speed, an empty Python call's ns before and after the host figures (one
  H200 host ran 21 ns in one process and 37 in the next, and every call's Python part with it).
* **back to back**: ``CHAIN_CALLS`` calls of the op captured in one CUDA graph, the graph's replay timed (warm,
  behind the gate) and divided by the calls, beside as many floor copies captured and timed the same way: what a
  model that replays its decode step as a graph sees (a graph starts each kernel sooner after the one before
  than separate launches do, so the fixed cost of a call shrinks; the floor's shrinks as much). Combine repeats
  the sum of one dispatch of input set 0 (one rank: it only reads the dispatch's outputs).
* ``--phases`` (at ``--phases-n``, default 128): where a decode round's microseconds go. Each op is timed as
  consecutive launches with a CUDA event between them: fused and halves (``*_async`` then ``*_wait``) as cuep
  runs them (on one rank: the one-rank kernels, no protocol), and phases: the protocol's notify, send, receive as
  three launches of the same kernel with one phase bit each, as cuep runs ranks that share a GPU (built from
  ``cuep.ep``'s private launch helpers like ``tests/test_ep_gpu.py``'s ``rank0_alone``; the kernels have no
  switch for it; the combine phases after the protocol's dispatch phases).

Checks: before timing, each (format, N)'s dispatch must give the row count the routing asks for, and every series
ends with ``buf.check()`` (device errors, timeouts). Output: progress on stderr; the host-cost table of the other
calls, the phases table, then the main table (op, format, N, GPU us cold / warm, floor us cold / warm, x floor,
layout floor, host us) last; ``floor.json`` under ``--out`` with every run. Nothing is asserted about timings.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable, Sequence

import numpy as np

from . import traffic
from .report import _fmt, table

JSON_NAME = "floor.json"
FLOOR_N = [1, 32, 128, 4096]
QUICK_FLOOR_N = [1, 16, 64]
PHASES_N = [128]
QUICK_PHASES_N = [16]
CHAIN_CALLS = 16                          # calls of one back-to-back run
HOST_CALLS, HOST_BATCHES = 32, 8          # per batch at most 2 x 32 launches queue behind the gate
QUICK_HOST_CALLS, QUICK_HOST_BATCHES = 8, 2
HOST_GATE_TIMEOUT_S = 5.0                 # a batch takes milliseconds; a call that waits on the GPU trips this
SPLITS = ("fused", "halves", "phases")

FLOOR_HEADER = ("op", "format", "N", "GPU us cold", "GPU us warm", "floor us cold", "floor us warm",
                "x floor cold", "x floor warm", "layout floor us warm", "x layout warm", "host us")
LAUNCH_FLOOR_CALL = "launch only (empty kernel)"  # the host table's row of kernels.launch_floor
_LAUNCH_REF = "(bare launch)"  # host_cost's label of its reference launch
HOST_HEADER = ("call", "format", "N", "host us median", "x launch", "p10", "p90", "calls", "note")
PHASES_HEADER = ("op", "format", "N", "split", "launch", "us cold", "us warm")
CHAIN_HEADER = ("op", "format", "N", "us warm (one call)", "us per call (graph)", "floor us per call (graph)",
                "x floor")


def log(msg: str) -> None:
    print(f"[cuep.bench --floor {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- plan --------------------------------------------------------------------------------------------------------
def ops_of(plan) -> list[tuple[str, str]]:
    """(op, format) cases of one N: dispatch in each plan format, then combine (bf16 dispatch, bf16 combine)."""
    out = [("dispatch", f) for f in plan.formats] if "dispatch" in plan.ops else []
    if "combine" in plan.ops:
        out.append(("combine", "bf16"))
    return out


def buffer_formats(plan) -> list[str]:
    """The Buffers a run makes, in order: one per dispatch format, plus bf16 for combine."""
    fmts = [f for op, f in ops_of(plan) if op == "dispatch"]
    if "combine" in plan.ops and "bf16" not in fmts:
        fmts.append("bf16")
    return fmts


def max_tokens(plan) -> int:
    return int(plan.max_tokens or max(plan.floor_n))


def _cfg(plan, fmt: str, n_max: int | None = None):
    from ..config import EPConfig

    T = n_max or max_tokens(plan)
    sbt = None if plan.small_batch_tokens is None else min(plan.small_batch_tokens, T)
    return EPConfig(hidden=plan.hidden, top_k=plan.top_k, n_experts=plan.n_experts, max_tokens_per_rank=T,
                    n_gpus_per_node=1, dispatch_format=fmt, small_batch_tokens=sbt)


def case_bytes(plan, op: str, fmt: str, n: int) -> dict:
    """:func:`cuep.bench.traffic.floor_bytes` of the routing a run draws for N (set 0 for ``read``/``write``, the
    mean over the input sets for ``write_layout``, which depends on how the rows fall on the experts)."""
    from .cases import host_routing

    cfg = _cfg(plan, fmt)
    ids_h, _ = host_routing(1, n, plan.top_k, plan.n_experts, n_sets=plan.input_sets, seed=plan.seed + n)
    per_set = [traffic.floor_bytes(op, cfg, ids[0]) for ids in ids_h]
    out = dict(per_set[0])
    out["write_layout"] = traffic._round16(statistics.fmean(b["write_layout"] for b in per_set))
    return out


def check_plan(plan) -> None:
    """``ValueError`` if cuep cannot run the plan (a format's group does not divide H, N > max tokens, ...)."""
    T = max_tokens(plan)
    if max(plan.floor_n) > T:
        raise ValueError(f"--floor-n {max(plan.floor_n)} exceeds --max-tokens {T}")
    for fmt in buffer_formats(plan):
        _cfg(plan, fmt)
    bad = [n for n in plan.phases_n if n > T]
    if plan.phases and bad:
        raise ValueError(f"--phases-n {bad} exceeds --max-tokens {T}")


def describe(plan) -> str:
    """The plan, the memory of its largest Buffer and the bytes of every case (no GPU needed)."""
    T = max_tokens(plan)
    cases = ops_of(plan)
    lines = [f"single-GPU floor report: H={plan.hidden}, K={plan.top_k}, E={plan.n_experts}, one rank (every expert "
             f"local), Buffers sized for {T} tokens",
             f"N: {', '.join(map(str, plan.floor_n))}; cases per N: "
             + ", ".join(f"{op} {f}" for op, f in cases),
             f"runs: {plan.series} series x {plan.repeats} after {plan.warmup} warm-up, cold and warm L2, "
             f"{plan.input_sets} input sets; floor copies timed the same way",
             "host cost: " + (f"{plan.host_batches} batches x {plan.host_calls} calls behind a held GPU (+1 warm-up "
                              f"batch)" if plan.host else "off"),
             "phases: " + (f"N = {', '.join(map(str, plan.phases_n))} ({', '.join(SPLITS)})" if plan.phases
                           else "off")]
    try:
        big = max((_cfg(plan, f) for f in buffer_formats(plan)), key=lambda c: c.total_bytes)
        eo = big.capacity * big.hidden * 2 if "combine" in plan.ops else 0
        lines.append(f"largest Buffer ({big.fmt.name}): {big.total_bytes / 2**30:.2f} GiB (+ expert_out "
                     f"{eo / 2**30:.2f} GiB)")
        rows = []
        for n in plan.floor_n:
            for op, f in cases:
                b = case_bytes(plan, op, f, n)
                rows.append((op, f, n, b["read"], b["write"], b["write_layout"], b["rows"], b["padded_rows"],
                             b["scale_tiles"]))
        lines.append("bytes of each floor copy (set 0; layout: mean over the input sets):")
        lines.append(table(rows, ("op", "format", "N", "read", "write", "write (layout)", "rows", "padded rows",
                                  "scale tiles")))
    except ValueError as e:
        lines.append(f"configuration problem: {e}")
    lines.append(f"measurements: {len(plan.floor_n) * len(cases)} (op, format, N) cases")
    return "\n".join(lines)


# ---- measurement helpers -----------------------------------------------------------------------------------------
def host_stats(samples_us: Sequence[float]) -> dict:
    """Median, p10, p90, mean, min of per-call host times (us)."""
    s = sorted(float(v) for v in samples_us)
    if not s:
        return {"median_us": None, "p10_us": None, "p90_us": None, "mean_us": None, "min_us": None, "calls": 0}
    q = lambda p: s[min(len(s) - 1, max(0, int(math.ceil(p * len(s))) - 1))]  # noqa: E731  (nearest rank)
    return {"median_us": statistics.median(s), "p10_us": q(0.1), "p90_us": q(0.9), "mean_us": statistics.fmean(s),
            "min_us": s[0], "calls": len(s)}


def python_call_ns(reps: int = 100_000, repeat: int = 5) -> float:
    """This interpreter's speed now: ns per call of an empty Python function (best of ``repeat`` runs of
    ``reps``), the unit a call's Python part scales with when a host runs faster or slower."""
    import timeit

    return min(timeit.repeat("f()", setup="f = lambda: None", number=reps, repeat=repeat)) / reps * 1e9


def host_cost(step: Callable[[int, Callable], object], dev: int, *, calls: int, batches: int,
              gate_timeout_s: float = HOST_GATE_TIMEOUT_S, after: Callable[[], object] | None = None,
              launch_ref: Callable[[], object] | None = None) -> dict:
    """Host time of the calls ``step`` makes while the GPU is held: ``{label: host_stats | {"blocked"}}``.

    ``step(i, timed)`` queues one iteration; ``timed(label, fn)`` calls ``fn()`` between two ``perf_counter``
    reads and returns its result (work outside ``timed`` is queued but not counted). Per batch: a gate kernel is
    queued, ``calls`` iterations run, the gate is released and the device drained; batch 0 is not counted.
    ``blocked`` is True if a gate timed out (a call waited for the GPU, so its time is not a launch cost).
    ``launch_ref``: a bare launch, timed before each iteration; each label then also gets ``launch_us`` (its
    median) and ``x_launch`` (the label's median over it): the call against a launch taken in the same moments,
    which neither the host's speed nor a passing burst of its load moves much (a host whose bare launch costs
    6.5 us instead of 3.9 runs every call slower in proportion).
    """
    from . import timing

    samples: dict[str, list[float]] = defaultdict(list)
    blocked = False
    gate = timing.StartGate([dev], timeout_s=gate_timeout_s)
    try:
        for b in range(batches + 1):
            keep = b > 0

            def timed(label, fn, keep=keep):
                t0 = time.perf_counter()
                out = fn()
                t1 = time.perf_counter()
                if keep:
                    samples[label].append((t1 - t0) * 1e6)
                return out

            gate.launch()
            try:
                for j in range(calls):
                    if launch_ref is not None:
                        timed(_LAUNCH_REF, launch_ref)
                    step(b * calls + j, timed)
            finally:
                gate.release()  # also when a call raised: never leave the GPU spinning
            timing.synchronize([dev])
            try:
                gate.check()
            except timing.GateTimeout:
                blocked = True
            if after is not None:
                after()
    finally:
        gate.close()
    ref = samples.pop(_LAUNCH_REF, None)
    out = {label: host_stats(v) | {"blocked": blocked} for label, v in samples.items()}
    if ref:
        ref_us = statistics.median(ref)
        for st in out.values():
            st["launch_us"] = ref_us
            st["x_launch"] = st["median_us"] / ref_us if st["median_us"] is not None and ref_us > 0 else None
    return out


def _segment_series(launches, dev, *, runs, warmup, flush, gate, setup, start_index) -> list[list[float]]:
    """[segment][run] us: ``launches`` (callables of the run index) back to back, a CUDA event between each."""
    import cupy

    from . import timing

    with cupy.cuda.Device(dev):
        events = [cupy.cuda.Event() for _ in range(len(launches) + 1)]
    times: list[list[float]] = [[] for _ in launches]
    for j in range(warmup + runs):
        i = start_index + j
        if setup is not None:
            setup(i)
            timing.synchronize([dev])
        if flush is not None:
            flush.next_value()
            flush.flush(dev)
        if gate is not None:
            gate.launch()
        try:
            with cupy.cuda.Device(dev):
                events[0].record()
                for k, fn in enumerate(launches):
                    fn(i)
                    events[k + 1].record()
        finally:
            if gate is not None:
                gate.release()
        events[-1].synchronize()
        if gate is not None:
            gate.check()
        if j >= warmup:
            for k in range(len(launches)):
                times[k].append(cupy.cuda.get_elapsed_time(events[k], events[k + 1]) * 1e3)
    return times


def measure_segments(launches: Sequence[Callable[[int], object]], dev: int, *, repeats: int, warmup: int,
                     series: int, setup=None, flusher=None, gate=None, after_series=None) -> dict:
    """``{mode: [Timing per launch] + [Timing of their sum]}`` for cold and warm (as :func:`timing.measure`)."""
    from . import timing

    out = {}
    start = 0
    for mode in timing.MODES:
        per = [[] for _ in range(len(launches) + 1)]  # [segment][series][device=1][run]
        for _ in range(series):
            t = _segment_series(launches, dev, runs=repeats, warmup=warmup,
                                flush=flusher if mode == "cold" else None, gate=gate, setup=setup, start_index=start)
            start += warmup + repeats
            for k, runs in enumerate(t):
                per[k].append([runs])
            per[-1].append([[sum(v) for v in zip(*t)]])
            if after_series is not None:
                after_series()
        out[mode] = [timing.Timing(p, gated=gate is not None, devices=[dev]) for p in per]
    return out


# ---- the per-(format, N) callables ------------------------------------------------------------------------------
class _Case:
    """One Buffer and one N's inputs (bare arrays: the single-rank call a process per GPU makes)."""

    def __init__(self, buf, inputs, expert_out=None) -> None:
        self.buf, self.inputs, self.expert_out = buf, inputs, expert_out
        self.handle = None

    def args(self, i: int):
        k = i % self.inputs.n_sets
        return self.inputs.x[k][0], self.inputs.ids[k][0], self.inputs.weights[k][0]

    def dispatch(self, i: int):
        import cuep

        self.handle = cuep.dispatch(self.buf, *self.args(i))
        return self.handle

    def combine(self, i: int):
        import cuep

        return cuep.combine(self.buf, self.expert_out, self.handle)

    def expected_rows(self, i: int) -> int:
        cfg = self.buf.cfg
        return traffic.expected_rows(self.inputs.ids_host[i % self.inputs.n_sets], cfg.n_experts, 0,
                                     cfg.fmt.row_align)

    def rows_now(self) -> int:
        return int(self.buf._ranks[0].row_offsets[-1].get())

    def check(self) -> str:
        """Dispatch (and combine, with expert_out) of set 0: the row count the routing asks for. "ok" or a
        message. Also compiles the kernels before any timing."""
        self.dispatch(0)
        self.buf.synchronize()
        got, want = self.rows_now(), self.expected_rows(0)
        if self.expert_out is not None:
            self.combine(0)
            self.buf.synchronize()
        return "ok" if got == want else f"dispatch gave {got} rows, the routing asks for {want}"

    def protocol_dispatch(self, i: int):
        """The untimed dispatch before a phase-split combine, whose launches read the protocol's combine handle: a
        ``cuep.dispatch`` (for the handle object; on one rank it takes the one-rank kernels, which write no protocol
        handle), then the protocol's three dispatch phases over the same outputs."""
        from .. import ep as ep_mod

        self.dispatch(i)
        launch = _dispatch_phase_launcher(self.buf)
        for bit in (ep_mod.PHASE_NOTIFY, ep_mod.PHASE_SEND, ep_mod.PHASE_RECV):
            launch(*self.args(i), bit)

    # -- splits of one op into consecutive launches (--phases) --
    def dispatch_splits(self) -> dict[str, list[tuple[str, Callable[[int], object]]]]:
        import cuep

        from .. import ep as ep_mod

        state = {}

        def async_half(i):
            state["d"] = cuep.dispatch_async(self.buf, *self.args(i))

        launch = _dispatch_phase_launcher(self.buf)

        def phase(bit):
            return lambda i: launch(*self.args(i), bit)

        return {"fused": [("dispatch", self.dispatch)],
                "halves": [("dispatch_async", async_half), ("dispatch_wait", lambda i: cuep.dispatch_wait(state["d"]))],
                "phases": [("notify", phase(ep_mod.PHASE_NOTIFY)), ("send", phase(ep_mod.PHASE_SEND)),
                           ("recv", phase(ep_mod.PHASE_RECV))]}

    def combine_splits(self) -> dict[str, list[tuple[str, Callable[[int], object]]]]:
        import cuep

        from .. import ep as ep_mod

        launch = _combine_phase_launcher(self.buf)

        def phase(bit):
            return lambda i: launch(self.expert_out, self.handle, bit)

        return {"fused": [("combine", self.combine)],
                "halves": [("combine_async", lambda i: cuep.combine_async(self.buf, self.expert_out, self.handle)),
                           ("combine_wait", lambda i: cuep.combine_wait(self.buf, self.expert_out, self.handle))],
                "phases": [("notify", phase(ep_mod.PHASE_NOTIFY)), ("send", phase(ep_mod.PHASE_SEND)),
                           ("recv", phase(ep_mod.PHASE_RECV))]}


def _dispatch_phase_launcher(buf):
    """``launch(x, ids, weights, phase_bit)``: one phase of a ``cuep.dispatch`` of bf16 x on rank 0 of ``buf`` as
    its own launch, exactly as ``cuep.ep._dispatch`` launches the phases of ranks that share a GPU (the same
    kernel, shared memory and arguments; PHASE_LOCAL_X since the call both sends and receives). Uses cuep.ep's
    private helpers as ``tests/test_ep_gpu.py::rank0_alone`` does; the host's round bookkeeping is not touched."""
    import cupy

    from .. import ep as ep_mod, params

    cfg, r = buf.cfg, buf._ranks[0]
    threads, smem = ep_mod._dispatch_launch(buf, staged=cfg.fmt.name != "bf16")
    with cupy.cuda.Device(r.device):
        fn = ep_mod._kernel(f"dispatch.cu:cuep_dispatch_{cfg.fmt.name}_from_bf16", smem)
    outs = ep_mod._dispatch_outputs(r)

    def launch(x, ids, weights, bit):
        with cupy.cuda.Device(r.device):
            ep_mod._launch(fn, buf, threads, smem, params.DISPATCH_PARAMS_DTYPE, r.params, x=params.pointer(x),
                           topk_ids=params.pointer(ids), topk_weights=params.pointer(weights),
                           num_tokens=int(x.shape[0]), global_scale=1.0, phases=bit | ep_mod.PHASE_LOCAL_X,
                           chunk_plan=0, **outs)

    return launch


def _combine_phase_launcher(buf):
    """``launch(expert_out, dispatched, phase_bit)``: one phase of a bf16 ``cuep.combine`` with the weights given
    at dispatch (MODE_PARTIAL) on rank 0 of ``buf``, as ``cuep.ep._combine`` launches the phases of ranks that
    share a GPU. The output is the rank's persistent ``combined`` array (a fused combine must have run once)."""
    import cupy

    from .. import ep as ep_mod, params

    r = buf._ranks[0]
    if buf.cfg.combine_dtype != "bfloat16" or r.combined is None:
        raise RuntimeError("the combine phases need a bf16 combine that has run once on this buffer")
    fns = {}
    with cupy.cuda.Device(r.device):
        for smem in (0, ep_mod.COMBINE_RING_BYTES):
            fns[smem] = ep_mod._kernel("combine.cu:cuep_combine_bf16", smem)
    p = params.pointer

    def launch(expert_out, d, bit):
        smem = ep_mod.COMBINE_RING_BYTES if bit & ep_mod.PHASE_SEND else 0
        with cupy.cuda.Device(r.device):
            ep_mod._launch(fns[smem], buf, ep_mod._THREADS, smem, params.COMBINE_PARAMS_DTYPE, r.params,
                           expert_out=p(expert_out), src_info=p(r.src_info), row_src=p(r.row_src),
                           row_weight=p(r.row_weight), msg_rows=p(r.msg_rows), msg_token=p(r.msg_token),
                           msg_j=p(r.msg_j), msg_count=p(r.msg_count), row_offsets=p(r.row_offsets),
                           topk_ids=p(d._topk_ids), topk_weights=0, residual=0, out=p(r.combined),
                           num_tokens=d.num_tokens, mode=ep_mod.MODE_PARTIAL,
                           phases=bit | ep_mod.PHASE_LOCAL_X, chunk_plan=0)  # as cuep.combine launches each phase

    return launch


# ---- records -----------------------------------------------------------------------------------------------------
def _timing_dict(t) -> dict:
    return t.as_dict() | {"runs_us": t.runs_us}


def fill_derived(rec: dict) -> dict:
    """Headline fields of a main-table record (``gpu``, ``floor``, optional ``floor_layout`` and ``host``)."""
    med = lambda d, mode: d[mode]["median_us"][0] if d else None  # noqa: E731
    div = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    rec["us_cold"], rec["us_warm"] = med(rec["gpu"], "cold"), med(rec["gpu"], "warm")
    rec["floor_us_cold"], rec["floor_us_warm"] = med(rec["floor"], "cold"), med(rec["floor"], "warm")
    rec["x_floor_cold"] = div(rec["us_cold"], rec["floor_us_cold"])
    rec["x_floor_warm"] = div(rec["us_warm"], rec["floor_us_warm"])
    lay = rec.get("floor_layout")
    rec["layout_us_warm"] = med(lay, "warm") if lay else rec["floor_us_warm"]
    rec["x_layout_warm"] = div(rec["us_warm"], rec["layout_us_warm"])
    moved = rec["bytes"]["read"] + rec["bytes"]["write"]
    rec["floor_gbps_warm"] = div(moved / 1e3, rec["floor_us_warm"])
    rec["host_us"] = (rec.get("host") or {}).get("median_us")
    ch = rec.get("chain")
    rec["chain_us"] = med(ch, "warm") / ch["calls"] if ch else None
    rec["chain_floor_us"] = med(ch, "floor_warm") / ch["calls"] if ch else None
    rec["x_floor_chain"] = div(rec["chain_us"], rec["chain_floor_us"])
    return rec


def floor_rows(results: list[dict]) -> list[tuple]:
    rows = []
    for r in results:
        host = _fmt(r.get("host_us"))
        if (r.get("host") or {}).get("x_launch") is not None:
            host += f" ({r['host']['x_launch']:.1f}x launch)"
        if r.get("host") and r["host"].get("blocked"):
            host += " (blocked)"
        rows.append((r["op"], r["format"], r["n_tokens"], _fmt(r["us_cold"]), _fmt(r["us_warm"]),
                     _fmt(r["floor_us_cold"]), _fmt(r["floor_us_warm"]), _fmt(r["x_floor_cold"], ".2f"),
                     _fmt(r["x_floor_warm"], ".2f"), _fmt(r["layout_us_warm"]), _fmt(r["x_layout_warm"], ".2f"),
                     host))
    return rows


def chain_rows(results: list[dict]) -> list[tuple]:
    return [(r["op"], r["format"], r["n_tokens"], _fmt(r["us_warm"]), _fmt(r.get("chain_us")),
             _fmt(r.get("chain_floor_us")), _fmt(r.get("x_floor_chain"), ".2f"))
            for r in results if r.get("chain_us") is not None]


def host_rows(host: list[dict]) -> list[tuple]:
    return [(h["call"], h["format"], h["n_tokens"], _fmt(h["median_us"]), _fmt(h.get("x_launch"), ".2f"),
             _fmt(h["p10_us"]), _fmt(h["p90_us"]), h["calls"], "blocked: waited on the GPU" if h.get("blocked")
             else "") for h in host]


def phases_rows(phases: list[dict]) -> list[tuple]:
    rows = []
    for p in phases:
        for s in p["segments"]:
            rows.append((p["op"], p["format"], p["n_tokens"], p["split"], s["name"], _fmt(s["cold_us"]),
                         _fmt(s["warm_us"])))
        if len(p["segments"]) > 1:
            rows.append((p["op"], p["format"], p["n_tokens"], p["split"], "sum", _fmt(p["total_cold_us"]),
                         _fmt(p["total_warm_us"])))
    return rows


def print_report(doc: dict) -> None:
    for n in doc["meta"].get("notes", []):
        print(f"note: {n}")
    if doc.get("host"):
        ns = doc["meta"].get("python_call_ns")
        speed = f"; an empty Python call {' / '.join(f'{v:.0f}' for v in ns)} ns before / after" if ns else ""
        print(f"\nhost cost of one eager call, GPU held (us per call{speed}):")
        print(table(host_rows(doc["host"]), HOST_HEADER))
    if doc.get("phases"):
        print("\nper launch, a round split into consecutive launches (median us; sum = per-run sum):")
        print(table(phases_rows(doc["phases"]), PHASES_HEADER))
    if any(r.get("chain_us") is not None for r in doc["results"]):
        print(f"\nback to back: {CHAIN_CALLS} calls in one CUDA graph, replayed warm, GPU us per call, beside a graph "
              f"of as many floor copies:")
        print(table(chain_rows(doc["results"]), CHAIN_HEADER))
    for e in doc.get("errors", []):
        print(f"ERROR {e}")
    for r in doc["results"]:
        if r["check"] != "ok":
            print(f"CHECK FAILED {r['op']} {r['format']} N={r['n_tokens']}: {r['check']}")
    gpu = (doc["meta"].get("gpus") or [{"name": "GPU"}])[0]["name"]
    cfg = doc.get("config", {})
    print(f"\none rank on {gpu}, H={cfg.get('hidden')} K={cfg.get('top_k')} E={cfg.get('n_experts')}: GPU time "
          f"(median, launches queued; cold = L2 flushed) against the floor copy of the same bytes, same run; "
          f"host = one eager call, GPU held:")
    print(table(floor_rows(doc["results"]), FLOOR_HEADER))


# ---- the run -----------------------------------------------------------------------------------------------------
def run(plan) -> tuple[dict, int]:
    """Measure everything in ``plan`` on one GPU; (JSON document, exit status)."""
    import cupy

    import cuep

    from . import cases, kernels, timing
    from .__main__ import run_meta

    dev = (plan.devices or [0])[0]
    devs = [dev]
    notes = [f"one rank on GPU {dev} (cuep.init([{dev}])): every expert is local, nothing crosses NVLink"]
    if plan.devices and len(plan.devices) > 1:
        notes.append(f"--floor uses only the first of --devices {plan.devices}")
    for n in notes:
        log(n)
    group = cuep.init(devs)
    streams = timing.use_private_streams(devs)  # kept alive while timing
    gate = timing.StartGate(devs)
    flusher = timing.L2Flusher(devs)
    T = max_tokens(plan)
    doc = {"meta": run_meta("python -m cuep.bench --floor", plan.argv, devs, 1, notes),
           "config": {"hidden": plan.hidden, "top_k": plan.top_k, "n_experts": plan.n_experts, "max_tokens": T,
                      "floor_n": list(plan.floor_n), "formats": list(plan.formats), "ops": list(plan.ops),
                      "repeats": plan.repeats, "warmup": plan.warmup, "series": plan.series,
                      "input_sets": plan.input_sets, "seed": plan.seed, "small_batch_tokens": plan.small_batch_tokens,
                      "host_calls": plan.host_calls, "host_batches": plan.host_batches, "host": plan.host,
                      "phases": plan.phases, "phases_n": list(plan.phases_n)},
           "results": [], "host": [], "phases": [], "errors": []}
    kw = dict(repeats=plan.repeats, warmup=plan.warmup, series=plan.series, flusher=flusher, gate=gate)
    hkw = dict(calls=plan.host_calls, batches=plan.host_batches)
    if plan.host:  # every call's host time beside a bare launch timed in the same moments (x launch)
        doc["meta"]["python_call_ns"] = [python_call_ns()]
        with cupy.cuda.Device(dev):
            bare, sms = kernels.launch_floor(), kernels._sm_count(dev)
        hkw["launch_ref"] = lambda: bare(sms, 0)
    inputs: dict[int, object] = {}
    scratch: dict[str, object] = {}

    def inputs_for(n):
        if n not in inputs:
            inputs[n] = cases.make_inputs(devs, n, plan.hidden, plan.top_k, plan.n_experts,
                                          n_sets=plan.input_sets, seed=plan.seed + n)
        return inputs[n]

    def scratch_mem(key, nbytes):
        """A copy buffer of at least ``nbytes`` (grown, never shrunk); sources hold a non-zero pattern."""
        m = scratch.get(key)
        if m is None or m.size < nbytes:
            scratch[key] = None
            with cupy.cuda.Device(dev):
                m = cupy.cuda.Memory(max(16, nbytes))
                cupy.cuda.runtime.memset(m.ptr, 0x5B if key == "src" else 0, m.size)
            scratch[key] = m
        return m

    def floor_timing(read, write):
        src, dst = scratch_mem("src", read), scratch_mem("dst", write)
        t = timing.measure(lambda i: kernels.floor_copy(src, dst, read, write), devs, **kw)
        return {"read_bytes": read, "write_bytes": write, "cold": _timing_dict(t["cold"]),
                "warm": _timing_dict(t["warm"])}

    def chain_timing(op_fn, setup, read, write, after):
        """Replays of a CUDA graph of CHAIN_CALLS calls (warm), and of one of as many floor copies."""
        src, dst = scratch_mem("src", read), scratch_mem("dst", write)
        ckw = dict(kw, modes=("warm",))
        # (the graph holds input set 0's arrays: combine's untimed dispatch before each replay is set 0's too, or
        # the captured combine would read another routing's row positions with set 0's expert ids)
        setup0 = None if setup is None else (lambda i: setup(0))
        if setup0 is not None:
            setup0(0)
        op_graph = _captured(lambda: [op_fn(0) for _ in range(CHAIN_CALLS)], dev)
        floor_graph = _captured(lambda: [kernels.floor_copy(src, dst, read, write)
                                         for _ in range(CHAIN_CALLS)], dev)
        t = timing.measure(lambda i: op_graph.launch(), devs, setup=setup0, after_series=after, **ckw)
        f = timing.measure(lambda i: floor_graph.launch(), devs, **ckw)
        return {"calls": CHAIN_CALLS, "warm": _timing_dict(t["warm"]), "floor_warm": _timing_dict(f["warm"])}

    def host_entry(call, fmt, n, stats):
        doc["host"].append({"call": call, "format": fmt, "n_tokens": n} | stats)

    fmts = buffer_formats(plan)
    cases_ = ops_of(plan)
    total = len(plan.floor_n) * len(cases_)
    done = 0
    try:
        for fmt in fmts:
            ops_here = [op for op, f in cases_ if f == fmt and (op == "dispatch" or fmt == "bf16")]
            do_dispatch = ("dispatch", fmt) in cases_
            do_combine = "combine" in ops_here
            buf = eo = None
            try:
                cfg = _cfg(plan, fmt)
                log(f"phase: {fmt} Buffer for {T} tokens ({cfg.total_bytes / 2**30:.2f} GiB)")
                buf = cuep.Buffer(group, cfg, timeout_s=10.0,
                                  num_sms=plan.num_sms[0] if plan.num_sms else None)
                if do_combine:
                    used = T * plan.top_k  # bf16 rows: no padding
                    with cupy.cuda.Device(dev):
                        eo = cases.random_bf16(cupy.random.default_rng(plan.seed * 7919 + 1),
                                               (cfg.capacity, cfg.hidden), octaves=False, rows=used)
                for n in plan.floor_n:
                    case = _Case(buf, inputs_for(n), eo)
                    try:
                        check = case.check()
                        if check != "ok":
                            log(f"{fmt} N={n}: CHECK FAILED: {check}")
                        todo = (["dispatch"] if do_dispatch else []) + (["combine"] if do_combine else [])
                        for op in todo:
                            setup = case.dispatch if op == "combine" else None
                            t = timing.measure(getattr(case, op), devs, setup=setup, after_series=buf.check, **kw)
                            b = case_bytes(plan, op, fmt, n)
                            rec = {"op": op, "format": fmt, "n_tokens": n, "hidden": plan.hidden,
                                   "top_k": plan.top_k, "n_experts": plan.n_experts, "max_tokens": T,
                                   "num_sms": int(buf.num_sms), "check": check, "bytes": b,
                                   "gpu": {"cold": _timing_dict(t["cold"]), "warm": _timing_dict(t["warm"])},
                                   "floor": floor_timing(b["read"], b["write"]),
                                   "floor_layout": floor_timing(b["read"], b["write_layout"])
                                   if b["write_layout"] != b["write"] else None, "host": None,
                                   "chain": chain_timing(getattr(case, op), setup, b["read"], b["write"],
                                                         buf.check)}
                            if plan.host:
                                if op == "dispatch":
                                    h = host_cost(lambda i, timed: timed("cuep.dispatch",
                                                                         lambda: case.dispatch(i)),
                                                  dev, after=buf.check, **hkw)
                                else:
                                    def step(i, timed):
                                        case.dispatch(i)
                                        timed("cuep.combine", lambda: case.combine(i))
                                    h = host_cost(step, dev, after=buf.check, **hkw)
                                rec["host"] = next(iter(h.values()))
                                host_entry(f"cuep.{op}", fmt, n, rec["host"])
                            doc["results"].append(fill_derived(rec))
                            done += 1
                            log(f"[{done}/{total}] {op} {fmt} N={n}: {rec['us_warm']:.1f} us warm, floor "
                                f"{rec['floor_us_warm']:.1f} us, x{rec['x_floor_warm']:.2f}"
                                + (f", host {rec['host_us']:.1f} us" if rec["host_us"] is not None else ""))
                        if plan.host:
                            _host_halves(case, do_dispatch, do_combine, dev, hkw, fmt, n, host_entry)
                        if plan.phases and n in plan.phases_n:
                            _phases(case, do_dispatch, do_combine, dev, kw, fmt, n, doc)
                    except Exception as e:  # noqa: BLE001  (record it, go on with the next case)
                        doc["errors"].append({"format": fmt, "n_tokens": n, "error": f"{type(e).__name__}: {e}"})
                        log(f"{fmt} N={n}: {type(e).__name__}: {e}")
                        _recover(buf)
            except Exception as e:  # noqa: BLE001
                doc["errors"].append({"format": fmt, "error": f"{type(e).__name__}: {e}"})
                log(f"{fmt}: {type(e).__name__}: {e}")
            finally:
                timing.synchronize(devs)
                if buf is not None:
                    buf.close()
                del eo
                with cupy.cuda.Device(dev):
                    cupy.get_default_memory_pool().free_all_blocks()
        if plan.host:
            try:
                _host_launch_floor(dev, hkw, host_entry)
            except Exception as e:  # noqa: BLE001
                doc["errors"].append({"call": "launch floor", "error": f"{type(e).__name__}: {e}"})
                log(f"launch floor: {type(e).__name__}: {e}")
            for n in plan.floor_n:
                try:
                    _host_ops(plan, inputs_for(n), dev, hkw, n, host_entry)
                    with cupy.cuda.Device(dev):
                        cupy.get_default_memory_pool().free_all_blocks()  # h and the outputs of fused_silu
                except Exception as e:  # noqa: BLE001
                    doc["errors"].append({"call": "cuep.ops", "n_tokens": n, "error": f"{type(e).__name__}: {e}"})
                    log(f"ops N={n}: {type(e).__name__}: {e}")
            doc["meta"]["python_call_ns"].append(python_call_ns())
    finally:
        gate.close()
        timing.synchronize(devs)
        with cupy.cuda.Device(dev):
            cupy.cuda.Stream.null.use()  # back to the default stream; ours can go now
        streams.clear()
    bad = [r for r in doc["results"] if r["check"] != "ok"]
    return doc, 1 if doc["errors"] or bad else 0


def _captured(fn: Callable[[], object], dev: int):
    """``fn``'s launches on the current stream of ``dev``, captured into a ``cupy.cuda.graph.Graph`` (replayed on
    that stream by ``graph.launch()``)."""
    import cupy

    with cupy.cuda.Device(dev):
        stream = cupy.cuda.get_current_stream()
        stream.synchronize()
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph


def _recover(buf) -> None:
    """After a failed case: drain the device and re-arm the buffer for the next one."""
    try:
        buf.synchronize()
    except Exception:  # noqa: BLE001
        pass
    try:
        buf.reset()
    except Exception:  # noqa: BLE001
        pass


def _host_halves(case, do_dispatch, do_combine, dev, hkw, fmt, n, host_entry) -> None:
    import cuep

    if do_dispatch:
        def step(i, timed):
            d = timed("cuep.dispatch_async", lambda: cuep.dispatch_async(case.buf, *case.args(i)))
            case.handle = timed("cuep.dispatch_wait", lambda: cuep.dispatch_wait(d))

        for call, stats in host_cost(step, dev, after=case.buf.check, **hkw).items():
            host_entry(call, fmt, n, stats)
    if do_combine:
        def step(i, timed):
            case.dispatch(i)
            timed("cuep.combine_async", lambda: cuep.combine_async(case.buf, case.expert_out, case.handle))
            timed("cuep.combine_wait", lambda: cuep.combine_wait(case.buf, case.expert_out, case.handle))

        for call, stats in host_cost(step, dev, after=case.buf.check, **hkw).items():
            host_entry(call, "bf16", n, stats)


def _host_launch_floor(dev, hkw, host_entry) -> None:
    """Host cost of the bare launch every call is timed beside (``hkw["launch_ref"]``: ``kernels.launch_floor``,
    shaped like cuep's), timed alone: what Python cannot cut from a call."""
    ref = hkw["launch_ref"]
    st = host_cost(lambda i, timed: timed("l", ref), dev, **(hkw | {"launch_ref": None}))
    host_entry(LAUNCH_FLOOR_CALL, "-", 0, st["l"])


def _host_ops(plan, inputs, dev, hkw, n, host_entry) -> None:
    """Host cost of cuep.ops.quantize (x [N, H]), dequantize (its output), swizzle_block_scales (its fp4 scales,
    E groups) and fused_silu (h [N K, 2H] bf16, E groups), ``out=`` given."""
    import cupy

    from .. import ops
    from .cases import bf16_dtype

    x = inputs.x[0][0]
    with cupy.cuda.Device(dev):
        ro_x = cupy.asarray(np.linspace(0, n, plan.n_experts + 1).astype(np.int32))
        for fmt in [f for f in plan.formats if f != "bf16"]:
            out = ops.quantize(x, fmt)
            st = host_cost(lambda i, timed, fmt=fmt, out=out: timed("q", lambda: ops.quantize(x, fmt, out=out)),
                           dev, **hkw)
            host_entry("cuep.ops.quantize", fmt, n, st["q"])
            back = ops.dequantize(*out, fmt, plan.hidden)
            st = host_cost(lambda i, timed, fmt=fmt, out=out, back=back: timed(
                "d", lambda: ops.dequantize(*out, fmt, plan.hidden, out=back)), dev, **hkw)
            host_entry("cuep.ops.dequantize", fmt, n, st["d"])
            if fmt in ("nvfp4", "mxfp4"):
                sw = ops.swizzle_block_scales(out[1], ro_x, fmt, plan.hidden)
                st = host_cost(lambda i, timed, fmt=fmt, out=out, sw=sw: timed(
                    "w", lambda: ops.swizzle_block_scales(out[1], ro_x, fmt, plan.hidden, out=sw)), dev, **hkw)
                host_entry("cuep.ops.swizzle_block_scales", fmt, n, st["w"])
        rows = n * plan.top_k
        h = cupy.zeros((rows, 2 * plan.hidden), dtype=bf16_dtype())
        ro = cupy.asarray(np.linspace(0, rows, plan.n_experts + 1).astype(np.int32))
        for fmt in plan.formats:
            out = ops.fused_silu(h, ro, fmt)
            st = host_cost(lambda i, timed, fmt=fmt, out=out: timed("s", lambda: ops.fused_silu(h, ro, fmt,
                                                                                               out=out)),
                           dev, **hkw)
            host_entry("cuep.ops.fused_silu", fmt, n, st["s"])


def _phases(case, do_dispatch, do_combine, dev, kw, fmt, n, doc) -> None:
    """The splits of each op (fused, halves, phases), timed as consecutive launches; a phase-split dispatch is
    checked for the row count first."""
    todo = []
    if do_dispatch:
        todo.append(("dispatch", case.dispatch_splits(), None))
    if do_combine:
        todo.append(("combine", case.combine_splits(), case.dispatch))
    for op, splits, setup in todo:
        for split in SPLITS:
            launches = splits[split]
            if op == "combine" and split == "phases":
                setup = case.protocol_dispatch  # the combine phases are the protocol's: so must its handle be
            if op == "dispatch" and split == "phases":
                for _, fn in launches:
                    fn(0)
                case.buf.synchronize()
                got, want = case.rows_now(), case.expected_rows(0)
                if got != want:
                    raise RuntimeError(f"phase-split dispatch {fmt} N={n}: {got} rows, the routing asks for {want}")
            t = measure_segments([fn for _, fn in launches], dev, setup=setup, after_series=case.buf.check, **kw)
            segs = [{"name": name, "cold_us": t["cold"][k].median_us[0], "warm_us": t["warm"][k].median_us[0],
                     "cold": _timing_dict(t["cold"][k]), "warm": _timing_dict(t["warm"][k])}
                    for k, (name, _) in enumerate(launches)]
            doc["phases"].append({"op": op, "format": fmt, "n_tokens": n, "split": split, "segments": segs,
                                  "total_cold_us": t["cold"][-1].median_us[0],
                                  "total_warm_us": t["warm"][-1].median_us[0]})


def main(plan) -> int:
    """``python -m cuep.bench --floor``: dry run, re-print of a saved JSON, or the measurement."""
    import json

    from . import report

    if plan.from_json:
        doc = json.loads(open(plan.from_json).read())
        print_report(doc)
        return 0
    try:
        check_plan(plan)
    except ValueError as e:
        print(f"python -m cuep.bench --floor: {e}", file=sys.stderr)
        return 2
    if plan.dry_run:
        print(describe(plan))
        return 0
    try:
        import cupy

        has_gpu = cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        has_gpu = False
    if not has_gpu:
        print("python -m cuep.bench --floor needs an NVIDIA GPU; none is visible. --dry-run prints the plan "
              "without one.", file=sys.stderr)
        return 2
    print(describe(plan), flush=True)
    doc, status = run(plan)
    print_report(doc)
    path = report.write_json(doc, plan.out, JSON_NAME)
    print(f"\nwrote {path}")
    return status
