#!/usr/bin/env python3
"""Where a kernel's cycles go, from Nsight Compute (issue 24, items 2 and 5): instructions per warp, the cycles a
warp spends per issued instruction by stall reason, how busy the issue slots are, and the SM issue bound.

    PYTHONPATH=. python3 benchmarks/ncu_profile.py                    # decode: one-rank dispatch + combine
    PYTHONPATH=. python3 benchmarks/ncu_profile.py --formats fp8 --tokens 1 32 --out out/ncu
    PYTHONPATH=. python3 benchmarks/ncu_profile.py --ops --formats nvfp4 mxfp4 fp8 --tokens 32768   # fused SwiGLU
    PYTHONPATH=. python3 benchmarks/ncu_profile.py --timeline --formats mxfp4 --tokens 4096   # DRAM / L2 over time
    python3 benchmarks/ncu_profile.py --parse report.txt [--sms 132]   # a saved ncu report, no GPU
    python3 benchmarks/ncu_profile.py --parse-timeline pm.csv          # a saved PM sampling export, no GPU
    python3 benchmarks/ncu_profile.py --dry-run                        # the ncu command lines, no GPU

Each case runs in a child process under ``ncu`` (found on PATH, under $CUDA_HOME or /usr/local/cuda):
* decode (default): one real rank, H = 7168, K = 8, E = 256, weights at dispatch; 14 rounds of ``cuep.dispatch`` +
  ``cuep.combine``, the 11th round's two kernels profiled with the caches as the rounds left them (warm, as the
  bench's warm figures); ``--tokens`` are N per round;
* ``--floor``: as decode, with the floor copy of each round's dispatch (``cuep.bench --floor``'s layout bytes)
  after its combine, profiled too: DRAM bytes and throughput beside the op's;
* ``--timeline``: as ``--floor``, the dispatch and its floor copy sampled over time instead (Nsight Compute's PM
  sampling, every ``--interval-ns``): DRAM read / write, L2 and SM-to-L2 throughput and the issue rate, each as a
  share of its peak, per sample from the kernel's first active one; a round whose reads and writes take turns
  shows here, where the whole-kernel averages blur it;
* ``--ops``: ``cuep.ops.fused_silu`` from bf16 (benchmarks/bench_ops.py's case: I = 7168, 8 groups), the third call
  profiled with the caches flushed (cold, as bench_ops); ``--tokens`` are rows.
Clocks are left as they run (``--clock-control none``). Per kernel it prints the duration, instructions per warp, the
cycles per issued instruction (the sum of ncu's per-issue stall ratios, "selected" = the issue itself) and its
largest parts, the issue slots' busy share of active cycles, and the issue bound: warp instructions / (4 a cycle x
SMs) against the elapsed cycles (a kernel at 1.0 issues every cycle of every sub-partition). Raw reports and
``ncu_profile.json`` go under ``--out``. Nothing is asserted; figures: BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H, K, E = 7168, 8, 256
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
DECODE_ROUNDS, DECODE_SKIP = 14, 20  # rounds run; kernels skipped before the profiled dispatch + combine
OPS_CALLS, OPS_SKIP = 4, 2
STALL = "smsp__average_warps_issue_stalled_"
METRICS = (
    "gpu__time_duration.sum", "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
    "smsp__inst_executed.sum", "sm__cycles_elapsed.avg", "smsp__cycles_active.avg",
    "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__warps_active.avg.pct_of_peak_sustained_active",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum", "dram__bytes_write.sum",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "regex:" + STALL + r".*_per_issue_active\.ratio",
)
_HEADER = re.compile(r"^\s{2}(\S+) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context")
_METRIC = re.compile(r"^\s{4}([a-z][a-z0-9_.]*)\s+(?:(\S+)\s+)?([0-9][0-9,]*(?:\.[0-9]+)?)\s*$")
# ncu prints sizes and times in the unit it finds readable: byte metrics are kept in bytes, times in us
_SCALE = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0,
          "us": 1.0, "msecond": 1e3, "ms": 1e3}


@dataclass
class KernelReport:
    """One profiled launch: its name, grid and block sizes, and every metric ncu printed (name -> value)."""
    name: str
    grid: int
    block: int
    metrics: dict[str, float] = field(default_factory=dict)


def parse_report(text: str) -> list[KernelReport]:
    """The kernels of an ncu text report (``ncu --metrics ...``'s default output), in the order printed."""
    out: list[KernelReport] = []
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            g = [int(v) for v in m.groups()[1:]]
            out.append(KernelReport(m.group(1), g[0] * g[1] * g[2], g[3] * g[4] * g[5]))
            continue
        m = _METRIC.match(line)
        if m and out:
            out[-1].metrics[m.group(1)] = float(m.group(3).replace(",", "")) * _SCALE.get(m.group(2) or "", 1.0)
    return out


def summarize(k: KernelReport, sms: int, top: int = 6) -> dict:
    """Derived figures of one launch (see the module doc). Raises KeyError naming a metric the report lacks."""
    m = k.metrics
    for need in ("smsp__inst_executed.sum", "sm__cycles_elapsed.avg"):
        if need not in m:
            raise KeyError(f"{k.name}: the report has no {need}")
    warps = k.grid * k.block // 32
    stalls = {name[len(STALL):-len("_per_issue_active.ratio")]: v for name, v in m.items()
              if name.startswith(STALL) and name.endswith("_per_issue_active.ratio")}
    inst = m["smsp__inst_executed.sum"]
    bound_cycles = inst / (4 * sms)
    largest = sorted(((r, v) for r, v in stalls.items() if r != "selected" and v >= 0.05), key=lambda rv: -rv[1])
    return {
        "kernel": k.name, "grid": k.grid, "block": k.block, "us": m.get("gpu__time_duration.sum"),
        "warp_instructions": inst, "instructions_per_warp": inst / warps if warps else 0.0,
        "cycles_per_instruction": sum(stalls.values()) if stalls else None,
        "stalls": dict(largest[:top]),
        "issue_busy_pct": m.get("smsp__issue_active.avg.pct_of_peak_sustained_active"),
        "issue_bound_cycles": bound_cycles, "elapsed_cycles": m["sm__cycles_elapsed.avg"],
        "of_issue_bound": bound_cycles / m["sm__cycles_elapsed.avg"],
        "dram_pct": m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
        "dram_mb": (m["dram__bytes_read.sum"] / 1e6, m["dram__bytes_write.sum"] / 1e6)
        if "dram__bytes_read.sum" in m and "dram__bytes_write.sum" in m else None,
    }


def format_table(rows: list[dict]) -> str:
    """The printed table: one line per launch, its case first."""
    head = (f"{'case':20s} {'kernel':36s} {'us':>8s} {'inst/warp':>10s} {'cyc/inst':>8s} {'issue %':>7s} "
            f"{'of bound':>8s} {'dram %':>6s} {'MB read/written':>15s}  largest stalls (cycles per issued instruction)")
    lines = [head, "-" * len(head)]
    for r in rows:
        cpi = "-" if r["cycles_per_instruction"] is None else f"{r['cycles_per_instruction']:.2f}"
        busy = "-" if r["issue_busy_pct"] is None else f"{r['issue_busy_pct']:.1f}"
        us = "-" if r["us"] is None else f"{r['us']:.2f}"
        stalls = ", ".join(f"{k} {v:.2f}" for k, v in r["stalls"].items())
        dram = "-" if r.get("dram_pct") is None else f"{r['dram_pct']:.1f}"
        mb = "-" if r.get("dram_mb") is None else "%.1f / %.1f" % tuple(r["dram_mb"])
        lines.append(f"{r.get('case', '')[:20]:20s} {r['kernel'][:36]:36s} {us:>8s} {r['instructions_per_warp']:10.1f} "
                     f"{cpi:>8s} {busy:>7s} {r['of_issue_bound']:8.2f} {dram:>6s} {mb:>15s}  {stalls}")
    return "\n".join(lines)


# PM sampling series (``--timeline``): the column whose name contains the key, shown under the label
TIMELINE_SERIES = (("dram read", "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"),
                   ("dram write", "dramc__write_throughput.avg.pct_of_peak_sustained_elapsed"),
                   ("dram", "dramc__throughput.avg.pct_of_peak_sustained_elapsed"),
                   ("l2", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
                   ("sm->l2", "lts__t_sector_throughput_srcunit_tex.avg.pct_of_peak_sustained_elapsed"),
                   ("issue", "sm__inst_executed_realtime.avg.pct_of_peak_sustained_elapsed"))
_ACTIVE = "sm__cycles_active.avg"


def _samples(cell: str) -> list[float] | None:
    """The per-sample values of a PM sampling cell ("total (v; v; ...)"), or None for a cell without them."""
    if "(" not in cell or not cell.endswith(")"):
        return None
    body = cell[cell.index("(") + 1:-1]
    return [float(v.strip().replace(",", "")) for v in body.split(";") if v.strip()]


def parse_timeline(text: str, interval_ns: float = 1000) -> list[dict]:
    """Kernels of a PM sampling export (``ncu --import R --page raw --print-metric-instances values --csv``): per
    kernel its name, ``us`` (its duration, when exported), ``interval_us`` (the sampler's, from the export, else
    ``interval_ns``: ncu may lengthen the interval asked for) and, from its first to its last sample with SM
    cycles active, ``t_us`` (each sample's start after the first) and each TIMELINE_SERIES label's values (% of
    peak). Raises ValueError when the export lacks a series or the active cycles."""
    import csv
    import io

    table = list(csv.reader(io.StringIO(text)))
    head = next((i for i, r in enumerate(table) if "Kernel Name" in r), None)
    if head is None:
        raise ValueError("not a PM sampling export: no 'Kernel Name' column")
    names = table[head]

    def column(key: str) -> int:
        hits = [i for i, n in enumerate(names) if n.endswith(key)]
        if not hits:
            raise ValueError(f"the export has no {key} column")
        return hits[0]

    cols = {label: column(key) for label, key in TIMELINE_SERIES}
    active_col, name_col = column(_ACTIVE), names.index("Kernel Name")
    optional = {key: next((i for i, n in enumerate(names) if n == key), None)
                for key in ("profiler__pmsampler_interval_time", "gpu__time_duration.sum")}

    def number(row: list[str], key: str) -> float | None:
        i = optional[key]
        cell = row[i].split("(")[0].strip().replace(",", "") if i is not None and i < len(row) else ""
        return float(cell) if cell else None
    out = []
    for row in table[head + 1:]:
        active = _samples(row[active_col]) if len(row) > active_col else None
        if not active:
            continue  # (the units row)
        on = [i for i, v in enumerate(active) if v > 0]
        lo, hi = (on[0], on[-1]) if on else (0, -1)
        series = {}
        for label, c in cols.items():
            vals = _samples(row[c]) or []
            series[label] = vals[lo:hi + 1]
        step = number(row, "profiler__pmsampler_interval_time") or interval_ns / 1e3
        out.append({"kernel": row[name_col], "us": number(row, "gpu__time_duration.sum"), "interval_us": step,
                    "t_us": [round((i - lo) * step, 3) for i in range(lo, hi + 1)], **series})
    return out


def timeline_summary(k: dict) -> dict:
    """One kernel's timeline in a few numbers: samples, mean DRAM / L2 %, and the samples with DRAM below half."""
    dram, l2 = k["dram"], k["l2"]
    n = len(dram)
    return {"kernel": k["kernel"], "samples": n, "dram_mean": sum(dram) / n if n else 0.0,
            "l2_mean": sum(l2) / n if n else 0.0, "dram_below_half": sum(1 for v in dram if v < 50)}


def format_timeline(kernels: list[dict], case: str = "") -> str:
    """The kernels' timelines side by side: one line per sample, "read / write / L2 / SM->L2 / issue" (% of peak)
    per kernel, then each kernel's summary."""
    head = f"{'t us':>6s}  " + "  ".join(f"{k['kernel'][:30]:30s}" for k in kernels)
    lines = [f"{case}: PM samples, DRAM read / write, L2, SM->L2, issue (% of peak)" if case else "", head]
    for i in range(max((len(k["t_us"]) for k in kernels), default=0)):
        t = next(k["t_us"][i] for k in kernels if i < len(k["t_us"]))
        cells = []
        for k in kernels:
            if i < len(k["t_us"]):
                cells.append(f"{k['dram read'][i]:5.1f} {k['dram write'][i]:5.1f} {k['l2'][i]:5.1f} "
                             f"{k['sm->l2'][i]:5.1f} {k['issue'][i]:5.1f}")
            else:
                cells.append("")
            cells[-1] = f"{cells[-1]:30s}"
        lines.append(f"{t:6.1f}  " + "  ".join(cells))
    for k in kernels:
        sm = timeline_summary(k)
        us = "" if k.get("us") is None else f"{k['us']:.1f} us, "
        lines.append(f"  {sm['kernel'][:40]}: {us}{sm['samples']} samples of {k['interval_us']:g} us, DRAM "
                     f"{sm['dram_mean']:.1f}% on average, L2 {sm['l2_mean']:.1f}%, {sm['dram_below_half']} samples "
                     f"with DRAM below 50%")
    return "\n".join(line for line in lines if line)


def find_ncu() -> str:
    """The ncu executable: PATH, then $CUDA_HOME/bin, then /usr/local/cuda/bin. Raises FileNotFoundError."""
    for cand in (shutil.which("ncu"), os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "ncu"),
                 "/usr/local/cuda/bin/ncu"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise FileNotFoundError("ncu (Nsight Compute) not found on PATH, under $CUDA_HOME/bin or /usr/local/cuda/bin")


def ncu_command(ncu: str, op: str, fmt: str, n: int, report: Path | None = None, interval_ns: int = 1000) -> list[str]:
    """The ncu command line profiling one case (``op`` "decode", "floor", "timeline" or "silu") of this script's
    child mode; "timeline" writes the PM sampling report to ``report`` (.ncu-rep)."""
    if op == "decode":
        regex, skip, count, cache = "regex:cuep_(dispatch|combine)_local", DECODE_SKIP, 2, "none"
    elif op == "timeline":  # (the floor child; its dispatch and floor copy match: two kernels a round)
        regex, skip, count, cache = "regex:cuep_dispatch_local|cuep_bench_floor_copy", DECODE_SKIP, 2, "none"
    elif op == "floor":  # (the three kernels of each round)
        regex, skip, count = "regex:cuep_(dispatch|combine)_local|cuep_bench_floor_copy", DECODE_SKIP // 2 * 3, 3
        cache = "none"
    else:
        regex, skip, count, cache = f"regex:fused_silu_{fmt}_", OPS_SKIP, 1, "all"
    what = ["--metrics", ",".join(METRICS)]
    if op == "timeline":
        what = ["--section", "PmSampling", "--pm-sampling-interval", str(interval_ns), "-f", "-o", str(report)]
    return [ncu, "--cache-control", cache, "--clock-control", "none", "-k", regex, "--launch-skip", str(skip),
            "--launch-count", str(count), *what,
            sys.executable, str(Path(__file__).resolve()), "--child", "floor" if op == "timeline" else op, fmt, str(n)]


def child(op: str, fmt: str, n: int) -> None:
    """The profiled workload (run under ncu)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cupy

    if op == "silu":
        import bench_ops

        case = bench_ops.silu_case(fmt, n, H)
        for _ in range(OPS_CALLS):
            case.run()
        cupy.cuda.runtime.deviceSynchronize()
        return
    import cuep
    from cuep.bench.cases import make_inputs, random_bf16

    cfg = cuep.EPConfig(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=max(n, 128), n_gpus_per_node=1,
                        dispatch_format=fmt)
    buf = cuep.Buffer(cuep.init([0]), cfg)
    inp = make_inputs([0], n, H, K, E, n_sets=1, seed=1)  # the bench's inputs: fresh random rows and routing
    x, ids, w = inp.x[0][0], inp.ids[0][0], inp.weights[0][0]
    eo = random_bf16(cupy.random.default_rng(2), (cfg.capacity, H))
    floor = None
    if op == "floor":  # after each round, the floor copy of its dispatch (the output layout's bytes)
        from cuep.bench import kernels
        from cuep.bench.traffic import floor_bytes

        fb = floor_bytes("dispatch", cfg, cupy.asnumpy(ids))
        src, dst = cupy.cuda.Memory(fb["read"]), cupy.cuda.Memory(fb["write_layout"])
        cupy.cuda.runtime.memset(src.ptr, 0x5B, src.size)
        floor = lambda: kernels.floor_copy(src, dst, fb["read"], fb["write_layout"])  # noqa: E731
    for _ in range(DECODE_ROUNDS):
        cuep.combine(buf, eo, cuep.dispatch(buf, x, ids, w))
        if floor:
            floor()
    buf.synchronize()
    buf.close()


def run_timeline(ncu: str, cases: list[tuple[str, int]], out: Path | None, interval_ns: int, timeout_s: float) -> int:
    """--timeline: per case, ncu's PM sampling of a dispatch and its floor copy, exported to CSV (kept under
    ``out``), parsed and printed; ``ncu_timeline.json`` under ``out``."""
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        where = out or Path(tmp)
        for i, (fmt, n) in enumerate(cases, 1):
            label = f"{fmt} N={n}"
            print(f"[ncu_profile] {i}/{len(cases)} timeline {label}", flush=True)
            report = where / f"pm_{fmt}_{n}.ncu-rep"
            try:
                r = subprocess.run(ncu_command(ncu, "timeline", fmt, n, report, interval_ns), capture_output=True,
                                   text=True, timeout=timeout_s, cwd=ROOT)
                csv_text = subprocess.run([ncu, "--import", str(report), "--page", "raw", "--print-metric-instances",
                                           "values", "--csv"], capture_output=True, text=True, timeout=timeout_s,
                                          cwd=ROOT).stdout if report.exists() else ""
            except subprocess.TimeoutExpired:
                print(f"[ncu_profile] {label}: no result within {timeout_s} s", file=sys.stderr)
                continue
            try:
                kernels = parse_timeline(csv_text, interval_ns)
            except ValueError as e:
                print(f"[ncu_profile] {label}: ncu rc {r.returncode}: {e}\n{r.stderr[-2000:]}", file=sys.stderr)
                continue
            if out:
                (out / f"pm_{fmt}_{n}.csv").write_text(csv_text)
                report.unlink(missing_ok=True)
            print(format_timeline(kernels, label), flush=True)
            results[label] = {"interval_ns_asked": interval_ns, "kernels": kernels}
    if out and results:
        (out / "ncu_timeline.json").write_text(json.dumps(results))
        print(f"wrote {out / 'ncu_timeline.json'}")
    return 0 if results else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", action="store_true", help="profile cuep.ops.fused_silu instead of dispatch + combine")
    p.add_argument("--floor", action="store_true",
                   help="also profile, after each round, the floor copy of its dispatch (layout bytes; cuep.bench)")
    p.add_argument("--timeline", action="store_true",
                   help="sample the dispatch and its floor copy over time (PM sampling): DRAM, L2, issue")
    p.add_argument("--interval-ns", type=int, default=1000,
                   help="PM sampling interval asked of ncu (default %(default)s ns; ncu may lengthen it: H200 1.5 us)")
    p.add_argument("--parse-timeline", nargs="+", metavar="CSV", help="print saved PM sampling exports; no GPU")
    p.add_argument("--formats", nargs="+", choices=FORMATS, help="default: bf16 fp8 nvfp4 (--ops: nvfp4 mxfp4 fp8)")
    p.add_argument("--tokens", type=int, nargs="+", help="N per case (default: 1 128; --ops: 32768 rows)")
    p.add_argument("--sms", type=int, help="SMs for the issue bound (default: the GPU's, or 132 with --parse)")
    p.add_argument("--parse", nargs="+", metavar="REPORT", help="summarize saved ncu text reports; no GPU")
    p.add_argument("--out", help="folder for the raw reports and ncu_profile.json")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per ncu run (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the ncu command lines and exit")
    p.add_argument("--child", nargs=3, metavar=("OP", "FMT", "N"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        op, fmt, n = a.child
        child(op, fmt, int(n))
        return 0
    if a.interval_ns < 100:
        p.error(f"--interval-ns must be >= 100 (got {a.interval_ns})")
    if a.parse_timeline:
        for path in a.parse_timeline:
            print(format_timeline(parse_timeline(Path(path).read_text(), a.interval_ns), Path(path).stem))
        return 0
    if a.parse:
        rows = []
        for path in a.parse:
            for k in parse_report(Path(path).read_text()):
                rows.append({"case": Path(path).stem, **summarize(k, a.sms or 132)})
        print(format_table(rows))
        return 0
    if a.ops and (a.floor or a.timeline):
        p.error("--floor and --timeline profile dispatch rounds; they do not go with --ops")
    op = "silu" if a.ops else "timeline" if a.timeline else "floor" if a.floor else "decode"
    formats = a.formats or (["nvfp4", "mxfp4", "fp8"] if a.ops else ["bf16", "fp8", "nvfp4"])
    tokens = a.tokens or ([32768] if a.ops else [1, 128])
    if any(n < 1 for n in tokens):
        p.error(f"--tokens must be >= 1 (got {tokens})")
    try:
        ncu = find_ncu()
    except FileNotFoundError as e:
        if not a.dry_run:
            print(f"ncu_profile: {e}", file=sys.stderr)
            return 2
        ncu = "ncu"
    cases = [(fmt, n) for fmt in formats for n in tokens]
    if a.dry_run:
        for fmt, n in cases:
            print(" ".join(ncu_command(ncu, op, fmt, n, Path(f"pm_{fmt}_{n}.ncu-rep"), a.interval_ns)))
        return 0
    sms = a.sms
    if sms is None:
        import cupy

        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    if op == "timeline":
        return run_timeline(ncu, cases, out, a.interval_ns, a.timeout_s)
    rows = []
    for i, (fmt, n) in enumerate(cases, 1):
        label = f"{op} {fmt} N={n}"
        print(f"[ncu_profile] {i}/{len(cases)} {label}", flush=True)
        try:
            r = subprocess.run(ncu_command(ncu, op, fmt, n), capture_output=True, text=True, timeout=a.timeout_s,
                               cwd=ROOT)
        except subprocess.TimeoutExpired:
            print(f"[ncu_profile] {label}: no result within {a.timeout_s} s", file=sys.stderr)
            continue
        if out:
            (out / f"ncu_{op}_{fmt}_{n}.txt").write_text(r.stdout + r.stderr)
        kernels = parse_report(r.stdout)
        if r.returncode or not kernels:
            print(f"[ncu_profile] {label}: ncu rc {r.returncode}, {len(kernels)} kernels\n{r.stderr[-2000:]}",
                  file=sys.stderr)
            continue
        rows += [{"case": f"{fmt} N={n}", **summarize(k, sms)} for k in kernels]
    print(f"\nNsight Compute, {sms} SMs ({'cold' if op == 'silu' else 'warm'} caches, clocks as they run):")
    print(format_table(rows))
    if out:
        (out / "ncu_profile.json").write_text(json.dumps({"op": op, "sms": sms, "rows": rows}, indent=1))
        print(f"wrote {out / 'ncu_profile.json'}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
