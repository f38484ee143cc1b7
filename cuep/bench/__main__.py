"""``python -m cuep.bench``: cuep dispatch / combine against NCCL all-to-all and the NVLink limit, all local GPUs.

    python -m cuep.bench --out out/bench                 # standard shapes + sweep, every format, every GPU
    python -m cuep.bench --quick --out /tmp/smoke        # tiny sizes: a smoke test of the whole pipeline
    python -m cuep.bench --formats bf16 fp8 --no-sweep --num-sms 24 48 132
    python -m cuep.bench --dry-run                       # print the plan (works without a GPU)
    python -m cuep.bench --floor --out out/floor         # one GPU: each op against a copy of its bytes, host cost
    python -m cuep.bench --floor --phases --floor-n 128  # ... and a decode round split launch by launch

Measured per GPU (medians of CUDA-event times, cold L2; warm beside it): dispatch, combine and the round trip
of cuep and of an NCCL baseline for the same routing; send bandwidth (bytes leaving the GPU over NVLink) and
algorithm bandwidth (the "logical" figure: all bytes of the rank, its own included), their ratio to the measured
peer-copy ceiling, the speed-up over NCCL and cuep's SM count. With one GPU cuep runs as a single rank and the
NCCL baseline and peer ceilings are skipped. Writes ``bench.json`` and PNG plots (if matplotlib is installed)
to ``--out``.

``--floor`` is the single-GPU report (:mod:`cuep.bench.floor`): one rank on the first of ``--devices`` (every
expert local), dispatch in each ``--formats`` format and combine bf16 (weights at dispatch) at ``--floor-n`` tokens
(default 1 32 128 4096), each timed cold and warm with its launches queued, beside the floor (one copy kernel
reading the op's input bytes and writing its output bytes, timed the same way in the same run; the layout floor
adds the padding and whole scale tiles the output layout writes) and the host cost of one eager call
(dispatch, combine, their async / wait halves, cuep.ops quantize, dequantize, swizzle_block_scales and
fused_silu) measured with the GPU held so that no call waits on it; ``--phases`` adds the launch-by-launch split
of a decode round (notify / send / receive). Prints the tables (the main one last) and writes ``floor.json`` to
``--out``. ``--hidden``, ``--top-k``, ``--experts``, ``--formats``, ``--ops`` (dispatch, combine), ``--repeats``,
``--warmup``, ``--series``, ``--input-sets``, ``--seed``, ``--small-batch-tokens``, ``--num-sms`` (the first),
``--quick``, ``--dry-run`` and ``--from-json`` apply to it too.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

from ..formats import FORMATS

OPS = ("dispatch", "combine", "roundtrip")
NCCL_EXTRA_OPS = ("a2a_dispatch", "a2a_combine")  # NCCL's grouped send/recv alone, standard shapes only
STANDARD_SHAPES = {"prefill": 4096, "decode": 128}

DEFAULTS = dict(hidden=7168, top_k=8, experts=256, shapes=["prefill", "decode"], sweep_n=["1:8192"], repeats=30,
                sweep_repeats=10, warmup=3, series=2, ceiling_mib=1024, input_sets=2,
                floor_n=["1", "32", "128", "4096"], phases_n=["128"], host_calls=32, host_batches=8)
QUICK = dict(hidden=1024, top_k=8, experts=64, shapes=["prefill=256", "decode=16"], sweep_n=["1:64"], repeats=5,
             sweep_repeats=3, warmup=1, series=2, ceiling_mib=16, input_sets=2,
             floor_n=["1", "16", "64"], phases_n=["16"], host_calls=8, host_batches=2)
FLOOR_OPS = ("dispatch", "combine")


# ---- arguments ---------------------------------------------------------------------------------------------------
def _split(tokens) -> list[str]:
    """Tokens given as several arguments and/or comma-separated."""
    out = []
    for t in tokens or ():
        out += [p for p in str(t).split(",") if p]
    return out


def parse_formats(tokens) -> list[str]:
    fmts = _split(tokens)
    bad = [f for f in fmts if f not in FORMATS]
    if bad or not fmts:
        raise ValueError(f"--formats {bad or '(none)'}: choose from {sorted(FORMATS)}")
    return list(dict.fromkeys(fmts))


def parse_sweep(tokens) -> list[int]:
    """Ints and ``a:b`` ranges (the powers of two from a to b) -> sorted distinct N."""
    ns = set()
    for t in _split(tokens):
        if ":" in t:
            a, b = (int(v) for v in t.split(":", 1))
            if a < 1 or b < a:
                raise ValueError(f"--sweep-n range {t!r} must be lo:hi with 1 <= lo <= hi")
            p = 1 << max(0, math.ceil(math.log2(a)))
            while p <= b:
                ns.add(p)
                p *= 2
        else:
            n = int(t)
            if n < 1:
                raise ValueError(f"--sweep-n {n}: tokens per rank must be >= 1")
            ns.add(n)
    return sorted(ns)


def parse_shapes(tokens) -> dict[str, int]:
    """``prefill``, ``decode``, ``NAME=N`` or a bare ``N`` -> {name: N}; ``none`` alone: no standard shapes."""
    out = {}
    for t in _split(tokens):
        if t == "none":
            continue
        if "=" in t:
            name, n = t.split("=", 1)
            out[name] = int(n)
        elif t.isdigit():
            out[f"N{t}"] = int(t)
        elif t in STANDARD_SHAPES:
            out[t] = STANDARD_SHAPES[t]
        else:
            raise ValueError(f"--shapes {t!r}: use prefill, decode, NAME=N or N")
    if any(n < 1 for n in out.values()):
        raise ValueError("--shapes: tokens per rank must be >= 1")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuep.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", default="out/bench", help="directory for bench.json and the plots (default %(default)s)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), help="wire formats (default: all)")
    p.add_argument("--ops", nargs="+", default=list(OPS), help=f"which of {OPS} (default: all)")
    p.add_argument("--shapes", nargs="+", default=None,
                   help="standard shapes: prefill (N=4096), decode (N=128), NAME=N or N, or none (default: prefill "
                        "decode)")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True, help="sweep over N (default on)")
    p.add_argument("--sweep-n", nargs="+", default=None, help="sweep points: N values and lo:hi power-of-two ranges "
                                                            "(default 1:8192)")
    p.add_argument("--num-sms", nargs="+", type=int, default=None,
                   help="cuep SM counts to measure (default: all SMs of the device)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per series, standard shapes (default 30)")
    p.add_argument("--sweep-repeats", type=int, default=None, help="timed runs per series in the sweep (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs before each series (default 3)")
    p.add_argument("--series", type=int, default=None, help="independent series per figure; their spread is the "
                                                            "noise column (default 2)")
    p.add_argument("--input-sets", type=int, default=None, help="random input sets the runs rotate among (default 2)")
    p.add_argument("--hidden", type=int, default=None, help="H (default 7168)")
    p.add_argument("--top-k", type=int, default=None, help="K (default 8)")
    p.add_argument("--experts", type=int, default=None, help="E (default 256)")
    p.add_argument("--devices", nargs="+", default=None, help="CUDA device ids (default: all visible)")
    p.add_argument("--small-batch-tokens", type=int, default=None, metavar="N",
                   help="cuep's EPConfig.small_batch_tokens: rounds of at most N tokens per rank take the staged "
                        "(decode) protocol; 0: never (default: the EPConfig default, min(N of the case, 256))")
    p.add_argument("--ceiling-mib", type=int, default=None, help="copy size of the ceiling measurements (default 1024)")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL baseline")
    p.add_argument("--no-ceilings", action="store_true", help="skip the copy ceilings")
    p.add_argument("--no-gate", action="store_true",
                   help="time as the host launches (no start gate lining the GPUs up; includes launch skew)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few runs: a smoke test of everything")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    p.add_argument("--from-json", metavar="PATH", default=None,
                   help="measure nothing: print the tables of a saved bench.json and draw its plots into --out "
                        "(no GPU needed; e.g. where matplotlib is installed); with --floor, of a saved floor.json")
    g = p.add_argument_group("across nodes (--nodes; cuep.bench.internode_model)")
    g.add_argument("--nodes", type=int, nargs="+", default=None, metavar="M",
                   help="the network side of a multi-node round for M nodes of 8 GPUs: bytes per rank and time at "
                        "50 GB/s per NIC, with and without cuep's per-node deduplication (a model: no GPU or NIC "
                        "needed; --hidden / --top-k / --experts apply). A measured multi-node run is a script under "
                        "python -m cuep.run --gpus-per-node (docs/internode.md)")
    g = p.add_argument_group("single-GPU floor report (--floor; cuep.bench.floor)")
    g.add_argument("--floor", action="store_true",
                   help="one rank on one GPU: dispatch (each format) and combine bf16 against a copy kernel of the "
                        "same bytes (the floor), cold and warm, and the host cost of each eager call; writes "
                        "floor.json (the NCCL, ceiling and sweep options do not apply)")
    g.add_argument("--floor-n", nargs="+", default=None, metavar="N",
                   help="tokens per round (default 1 32 128 4096; --quick 1 16 64); lo:hi ranges as --sweep-n")
    g.add_argument("--max-tokens", type=int, default=None, metavar="T",
                   help="max_tokens_per_rank of the Buffers (default the largest --floor-n)")
    g.add_argument("--phases", action="store_true",
                   help="also time each op split into consecutive launches: fused, async + wait halves, and "
                        "notify / send / receive phases (at --phases-n)")
    g.add_argument("--phases-n", nargs="+", default=None, metavar="N",
                   help="N of the --phases split (default 128; --quick 16); each must be in --floor-n")
    g.add_argument("--host-calls", type=int, default=None,
                   help="host cost: timed calls per batch while the GPU is held (default 32)")
    g.add_argument("--host-batches", type=int, default=None, help="host cost: timed batches (default 8)")
    g.add_argument("--no-host", action="store_true", help="skip the host cost")
    return p


@dataclass
class Plan:
    """Everything a run will do, resolved from the arguments."""

    hidden: int
    top_k: int
    n_experts: int
    formats: list[str]
    ops: list[str]
    shapes: dict[str, int]
    sweep_n: list[int]
    num_sms: list
    repeats: int
    sweep_repeats: int
    warmup: int
    series: int
    input_sets: int
    ceiling_bytes: int
    devices: list | None
    out: str
    nccl: bool = True
    ceilings: bool = True
    gate: bool = True
    seed: int = 0
    quick: bool = False
    dry_run: bool = False
    from_json: str | None = None
    small_batch_tokens: int | None = None
    argv: list = field(default_factory=list)
    # --floor (cuep.bench.floor)
    floor: bool = False
    floor_n: list = field(default_factory=list)
    max_tokens: int | None = None
    host: bool = True
    host_calls: int = 32
    host_batches: int = 8
    phases: bool = False
    phases_n: list = field(default_factory=list)
    nodes: list = field(default_factory=list)  # --nodes: the across-nodes model (cuep.bench.internode_model)

    def points(self) -> list[dict]:
        """The N values to measure, standard shapes first: {"n", "shapes": [names], "repeats", "standard"}."""
        pts: dict[int, dict] = {}
        for name, n in self.shapes.items():
            pts.setdefault(n, {"n": n, "shapes": [], "repeats": self.repeats, "standard": True})["shapes"].append(name)
        for n in self.sweep_n:
            pt = pts.setdefault(n, {"n": n, "shapes": [], "repeats": self.sweep_repeats, "standard": False})
            pt["shapes"].append("sweep")
        std = [p for p in pts.values() if p["standard"]]
        rest = sorted((p for p in pts.values() if not p["standard"]), key=lambda p: p["n"])
        return std + rest

    def nccl_ops(self, standard: bool) -> list[str]:
        """NCCL ops at a point: the plan's ops, plus the grouped send/recv alone at standard shapes."""
        extra = [op for op in NCCL_EXTRA_OPS if standard and op[len("a2a_"):] in self.ops]
        return list(self.ops) + extra

    def n_measurements(self, with_nccl: bool) -> int:
        total = 0
        for pt in self.points():
            per_fmt = len(self.num_sms) * len(self.ops)
            if with_nccl:
                per_fmt += len(self.nccl_ops(pt["standard"]))
            total += per_fmt * len(self.formats)
        return total

    def check_config(self, n_ranks: int) -> None:
        """``ValueError`` if cuep cannot run this plan on ``n_ranks`` ranks (e.g. E not a multiple of R)."""
        from ..config import EPConfig

        n_max = max(p["n"] for p in self.points())
        for fmt in self.formats:
            EPConfig(hidden=self.hidden, top_k=self.top_k, n_experts=self.n_experts, max_tokens_per_rank=n_max,
                     n_gpus_per_node=n_ranks, dispatch_format=fmt)


def make_plan(argv=None) -> Plan:
    """Parse ``argv`` into a :class:`Plan` (``SystemExit`` with a message on bad arguments)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    base = QUICK if a.quick else DEFAULTS
    pick = lambda name, attr=None: getattr(a, attr or name) if getattr(a, attr or name) is not None else base[name]  # noqa: E731
    try:
        formats = parse_formats(a.formats)
        ops = _split(a.ops)
        bad = [o for o in ops if o not in OPS]
        if bad or not ops:
            raise ValueError(f"--ops {bad or '(none)'}: choose from {OPS}")
        shapes = parse_shapes(pick("shapes"))
        sweep_n = parse_sweep(pick("sweep_n")) if a.sweep else []
        devices = [int(d) for d in _split(a.devices)] if a.devices else None
        if devices is not None and len(set(devices)) != len(devices):
            raise ValueError(f"--devices {devices}: each GPU once (several ranks on one GPU is for protocol tests)")
        for name in ("repeats", "sweep_repeats", "series", "input_sets", "hidden", "top_k", "experts", "ceiling_mib"):
            if pick(name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if pick("warmup") < 0:
            raise ValueError("--warmup must be >= 0")
        if a.small_batch_tokens is not None and a.small_batch_tokens < 0:
            raise ValueError("--small-batch-tokens must be >= 0 (0: never the staged protocol)")
        if a.num_sms is not None and any(n < 1 for n in a.num_sms):
            raise ValueError("--num-sms values must be >= 1")
        if not shapes and not sweep_n and not a.floor:
            raise ValueError("nothing to measure: no --shapes and --no-sweep")
        floor_n = parse_sweep(pick("floor_n")) if a.floor else []
        phases_n = parse_sweep(pick("phases_n")) if a.floor and a.phases else []
        if a.floor:
            ops = [o for o in ops if o in FLOOR_OPS]
            if not ops:
                raise ValueError(f"--floor measures {FLOOR_OPS}: --ops names none of them")
            if [n for n in phases_n if n not in floor_n]:
                raise ValueError(f"--phases-n {phases_n}: each must be one of --floor-n {floor_n}")
            if a.max_tokens is not None and a.max_tokens < max(floor_n):
                raise ValueError(f"--max-tokens {a.max_tokens} is below the largest --floor-n {max(floor_n)}")
            for name in ("host_calls", "host_batches"):
                if pick(name) < 1:
                    raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    except ValueError as e:
        parser.error(str(e))
    return Plan(hidden=pick("hidden"), top_k=pick("top_k"), n_experts=pick("experts"), formats=formats, ops=ops,
                shapes=shapes, sweep_n=sweep_n, num_sms=list(a.num_sms) if a.num_sms else [None],
                repeats=pick("repeats"), sweep_repeats=pick("sweep_repeats"), warmup=pick("warmup"),
                series=pick("series"), input_sets=pick("input_sets"), ceiling_bytes=pick("ceiling_mib") << 20,
                devices=devices, out=a.out, nccl=not a.no_nccl, ceilings=not a.no_ceilings, gate=not a.no_gate,
                seed=a.seed, quick=a.quick, dry_run=a.dry_run, from_json=a.from_json,
                small_batch_tokens=a.small_batch_tokens, argv=list(sys.argv[1:] if argv is None else argv),
                floor=a.floor, floor_n=floor_n, max_tokens=a.max_tokens, host=not a.no_host,
                host_calls=pick("host_calls"), host_batches=pick("host_batches"), phases=a.phases, phases_n=phases_n,
                nodes=list(a.nodes or []))


def describe_plan(plan: Plan, n_ranks: int) -> str:
    """What the run will do, with the per-GPU memory of its largest case."""
    from ..config import EPConfig

    lines = [f"shape: H={plan.hidden}, K={plan.top_k}, E={plan.n_experts}, {n_ranks} rank(s); formats "
             f"{', '.join(plan.formats)}; ops {', '.join(plan.ops)}",
             "standard shapes: " + (", ".join(f"{k} N={v}" for k, v in plan.shapes.items()) or "none"),
             "sweep N: " + (", ".join(map(str, plan.sweep_n)) or "off"),
             f"runs: {plan.series} series x {plan.repeats} (sweep {plan.sweep_repeats}) after {plan.warmup} warm-up, "
             f"cold and warm L2, {plan.input_sets} input sets; start gate {'on' if plan.gate else 'off'}",
             f"cuep SMs: {', '.join('all' if n is None else str(n) for n in plan.num_sms)}; NCCL baseline: "
             f"{'yes' if plan.nccl and n_ranks > 1 else 'no'}; ceilings: {'yes' if plan.ceilings else 'no'}"]
    pts = plan.points()
    if pts:
        n_max = max(p["n"] for p in pts)
        try:
            cfg = EPConfig(hidden=plan.hidden, top_k=plan.top_k, n_experts=plan.n_experts, max_tokens_per_rank=n_max,
                           n_gpus_per_node=n_ranks, dispatch_format="bf16")
            eo = cfg.capacity * cfg.hidden * 2
            lines.append(f"largest case (bf16, N={n_max}): about {(cfg.total_bytes + eo) / 2**30:.1f} GiB per GPU "
                         f"for cuep (+ NCCL buffers)")
        except ValueError as e:
            lines.append(f"configuration problem: {e}")
    lines.append(f"measurements: {plan.n_measurements(plan.nccl and n_ranks > 1)}")
    return "\n".join(lines)


# ---- progress and logs -------------------------------------------------------------------------------------------
class Progress:
    """tqdm on stderr when it is installed, else one stderr line per finished measurement."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True, leave=True)
        except ImportError:
            self.bar = None

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def update(self, desc: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(desc[:60])
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {desc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_progress: Progress | None = None


def log(msg: str) -> None:
    """A log line on stderr (through the progress bar when one is running)."""
    line = f"[cuep.bench {time.strftime('%H:%M:%S')}] {msg}"
    if _progress is not None:
        _progress.write(line)
    else:
        print(line, file=sys.stderr, flush=True)


# ---- the run -----------------------------------------------------------------------------------------------------
def run_meta(tool: str, argv, devices: list[int], n_ranks: int, notes: list[str], gpus=None, **extra) -> dict:
    """The "meta" block of a bench JSON: tool, argv, time, versions (cuep, CuPy, CUDA, Python), devices and notes."""
    import cupy

    import cuep

    return {"tool": tool, "argv": argv, "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "cuep_version": cuep.__version__, "cupy_version": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cupy.cuda.runtime.driverGetVersion(), "python": platform.python_version(),
            "devices": devices, "gpus": _device_info(devices) if gpus is None else gpus, "n_ranks": n_ranks,
            **extra, "notes": notes}


def _device_info(devices: list[int]) -> list[dict]:
    import cupy

    out = []
    for d in devices:
        props = cupy.cuda.runtime.getDeviceProperties(d)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        attrs = cupy.cuda.Device(d).attributes
        out.append({"id": d, "name": name, "sms": int(attrs["MultiProcessorCount"]),
                    "l2_bytes": int(attrs.get("L2CacheSize", 0)), "memory_bytes": int(props["totalGlobalMem"])})
    return out


def _record(system, op, fmt, point, plan, cfg, n_ranks, num_sms, traffic, timings, check) -> dict:
    from .traffic import combine_message_bytes, dispatch_message_bytes

    return {"system": system, "op": op, "format": fmt, "n_tokens": point["n"], "shapes": list(point["shapes"]),
            "hidden": plan.hidden, "top_k": plan.top_k, "n_experts": plan.n_experts, "n_ranks": n_ranks,
            "num_sms": num_sms, "message_bytes": {"dispatch": dispatch_message_bytes(cfg),
                                                  "combine": combine_message_bytes(cfg)},
            "bytes": {"send": [float(v) for v in traffic.send], "algo": [float(v) for v in traffic.algo]},
            "cold": timings["cold"].as_dict() | {"runs_us": timings["cold"].runs_us},
            "warm": timings["warm"].as_dict() | {"runs_us": timings["warm"].runs_us}, "check": check}


def run(plan: Plan) -> tuple[dict, int]:
    """Measure everything in ``plan`` on the GPUs; (JSON document, exit status)."""
    global _progress
    import cupy

    import cuep

    from . import cases, ceilings, nccl, report, timing

    devices = plan.devices if plan.devices is not None else list(range(cupy.cuda.runtime.getDeviceCount()))
    R = len(devices)
    notes = []
    log(f"phase: set-up on GPU(s) {devices}")
    group = cuep.init(devices)
    streams = timing.use_private_streams(devices)
    gate = timing.StartGate(devices) if plan.gate else None
    if R == 1:
        notes.append("one GPU: cuep runs as a single rank (n_gpus_per_node=1), every token stays on this GPU; "
                     "no NCCL baseline and no peer-copy ceilings (send bandwidth is 0 by definition)")
    if not plan.gate:
        notes.append("start gate off: device times include the host's launch skew between GPUs")
    for n in notes:
        log(n)
    info = _device_info(devices)
    doc = {"meta": run_meta("python -m cuep.bench", plan.argv, devices, R, notes, gpus=info, gated=plan.gate),
           "config": asdict(plan) | {"points": plan.points()}, "ceilings": None, "nccl": None, "results": [],
           "errors": []}

    # ceilings
    if plan.ceilings:
        log(f"phase: copy ceilings ({plan.ceiling_bytes >> 20} MiB)")
        doc["ceilings"] = ceilings.measure_ceilings(devices, plan.ceiling_bytes, gate=gate, peers=R > 1)
        print(report.ceilings_text(doc["ceilings"], devices), flush=True)

    # NCCL
    comms = None
    if not plan.nccl:
        doc["nccl"] = {"skipped": "--no-nccl"}
    elif R < 2:
        doc["nccl"] = {"skipped": "one GPU: no NCCL baseline"}
        log("NCCL baseline skipped: it needs two or more GPUs")
    else:
        ok, ver = nccl.available()
        if ok:
            log(f"phase: NCCL {ver} communicators on {R} GPUs")
            comms = nccl.NcclComms(devices)
            doc["nccl"] = {"version": ver}
        else:
            doc["nccl"] = {"skipped": ver}
            log(f"NCCL baseline skipped: {ver}")

    total = plan.n_measurements(comms is not None)
    log(f"phase: measuring ({total} measurements)")
    _progress = Progress(total)
    results, errors = doc["results"], doc["errors"]
    flusher = timing.L2Flusher(devices)
    try:
        for point in plan.points():
            n = point["n"]
            log(f"phase: N={n} ({', '.join(point['shapes'])}): drawing {plan.input_sets} input sets")
            inputs = cases.make_inputs(devices, n, plan.hidden, plan.top_k, plan.n_experts, n_sets=plan.input_sets,
                                       seed=plan.seed + n)
            pairs = inputs.pairs()
            kw = dict(repeats=point["repeats"], warmup=plan.warmup, series=plan.series, flusher=flusher,
                      gate=gate if gate is not None else False)
            for fmt in plan.formats:
                expert_out, cfg = None, None
                for sms in plan.num_sms:
                    ccase = None
                    try:
                        ccase = cases.CuepCase(group, inputs, fmt, num_sms=sms,
                                               small_batch_tokens=plan.small_batch_tokens)
                        cfg = ccase.cfg
                        expert_out = expert_out or ccase.expert_out
                        check = ccase.check()
                        if check != "ok":
                            log(f"cuep {fmt} N={n}: CHECK FAILED: {check}")
                        for op in plan.ops:
                            fn = getattr(ccase, op)
                            setup = ccase.setup_combine if op == "combine" else None
                            t = timing.measure(fn, devices, setup=setup, after_series=ccase.buf.check, **kw)
                            rec = _record("cuep", op, fmt, point, plan, cfg, R, ccase.num_sms,
                                          cases.traffic_of(op, cfg, pairs), t, check)
                            results.append(report.fill_derived(rec, doc["ceilings"]))
                            _progress.update(f"cuep {op} {fmt} N={n} SMs={ccase.num_sms}: "
                                             f"{rec['round_us']:.1f} us")
                    except Exception as e:  # noqa: BLE001  (record it, go on with the next case)
                        errors.append({"system": "cuep", "format": fmt, "n_tokens": n, "num_sms": sms,
                                       "error": f"{type(e).__name__}: {e}"})
                        log(f"cuep {fmt} N={n} SMs={sms}: {type(e).__name__}: {e}")
                    finally:
                        if ccase is not None:
                            ccase.close()
                if comms is not None and expert_out is not None:
                    ncase = None
                    try:
                        ncase = cases.nccl_case(comms, inputs, cfg, expert_out)
                        check = cases.check_nccl(ncase, inputs)
                        if check != "ok":
                            log(f"NCCL {fmt} N={n}: CHECK FAILED: {check}")
                        for op in plan.nccl_ops(point["standard"]):
                            t = timing.measure(getattr(ncase, op), devices, **kw)
                            rec = _record("nccl", op, fmt, point, plan, cfg, R, None,
                                          cases.traffic_of(op, cfg, pairs), t, check)
                            results.append(report.fill_derived(rec, doc["ceilings"]))
                            _progress.update(f"nccl {op} {fmt} N={n}: {rec['round_us']:.1f} us")
                    except Exception as e:  # noqa: BLE001
                        errors.append({"system": "nccl", "format": fmt, "n_tokens": n,
                                       "error": f"{type(e).__name__}: {e}"})
                        log(f"NCCL {fmt} N={n}: {type(e).__name__}: {e}")
                    finally:
                        del ncase
                del expert_out
                for dev in devices:
                    with cupy.cuda.Device(dev):
                        cupy.get_default_memory_pool().free_all_blocks()
            del inputs
    finally:
        _progress.close()
        _progress = None
        if comms is not None:
            comms.close()
        if gate is not None:
            gate.close()
        timing.synchronize(devices)
        for dev, stream in zip(devices, streams):
            with cupy.cuda.Device(dev):
                cupy.cuda.Stream.null.use()  # back to the default stream; ours go with this frame

    report.attach_speedups(results)
    bad_checks = [r for r in results if r["check"] != "ok"]
    status = 1 if errors or bad_checks else 0
    return doc, status


def print_report(doc: dict) -> None:
    from . import report

    results, devices = doc["results"], doc["meta"]["devices"]
    std = [r for r in results if any(s != "sweep" for s in r["shapes"])]
    sweep = [r for r in results if "sweep" in r["shapes"]]
    for n in doc["meta"]["notes"]:
        print(f"note: {n}")
    if std:
        print("\nstandard shapes, per GPU (cold L2 medians; GB/s = bytes / that GPU's time):")
        print(report.table(report.result_rows_per_gpu(std, devices), report.RESULT_HEADER))
    if sweep:
        print("\nsweep (round time = slowest GPU; GB/s = mean bytes per GPU / round time):")
        print(report.table(report.result_rows_summary(sweep), report.SUMMARY_HEADER))
    t = report.targets_text(results)
    if t:
        print("\n" + t)
    for e in doc["errors"]:
        print(f"ERROR {e}")
    bad = [r for r in results if r["check"] != "ok"]
    for r in bad:
        print(f"CHECK FAILED {r['system']} {r['op']} {r['format']} N={r['n_tokens']}: {r['check']}")


def write_outputs(doc: dict, out_dir: str) -> None:
    """Plots of ``doc`` into ``out_dir`` (or the reason there are none)."""
    from . import report

    meta = doc.get("meta", {})
    cfgd = doc.get("config", {})
    gpu = (meta.get("gpus") or [{"name": "GPU"}])[0]["name"]
    title = (f"cuep vs NCCL, {meta.get('n_ranks', '?')} x {gpu}, H={cfgd.get('hidden')} K={cfgd.get('top_k')} "
             f"E={cfgd.get('n_experts')}")
    plots = report.plot_sweep(doc["results"], out_dir, doc.get("ceilings"), title=title)
    if isinstance(plots, str):
        print(plots)
    else:
        for p in plots:
            print(f"wrote {p}")


def main(argv=None) -> int:
    plan = make_plan(argv)
    if plan.nodes:
        from . import internode_model

        internode_model.main(["--nodes", *map(str, plan.nodes), "--hidden", str(plan.hidden), "--top-k",
                              str(plan.top_k), "--experts", str(plan.n_experts)])
        return 0
    if plan.floor:
        from . import floor

        return floor.main(plan)
    if plan.from_json:
        import json

        from . import report

        doc = json.loads(open(plan.from_json).read())
        if doc.get("ceilings"):
            print(report.ceilings_text(doc["ceilings"], doc["meta"]["devices"]))
        print_report(doc)
        write_outputs(doc, plan.out)
        return 0
    try:
        import cupy

        has_gpu = cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
        n_visible = cupy.cuda.runtime.getDeviceCount() if has_gpu else 0
    except Exception:  # noqa: BLE001
        has_gpu, n_visible = False, 0
    n_ranks = len(plan.devices) if plan.devices is not None else (n_visible or 4)
    if plan.dry_run:
        print(describe_plan(plan, n_ranks))
        if not has_gpu:
            print(f"(no GPU here: memory and counts assume {n_ranks} ranks)")
        return 0
    if not has_gpu:
        print("python -m cuep.bench needs an NVIDIA GPU; none is visible (cupy.cuda.is_available() is False). "
              "--dry-run prints the plan without one.", file=sys.stderr)
        return 2
    try:
        plan.check_config(n_ranks)
        sms = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount,
                                                   (plan.devices or [0])[0])
        too_many = [n for n in plan.num_sms if n is not None and n > sms]
        if too_many:
            raise ValueError(f"--num-sms {too_many}: the GPU has {sms} SMs")
    except ValueError as e:
        print(f"python -m cuep.bench: {e} (on {n_ranks} GPU(s); see --experts, --hidden, --devices)",
              file=sys.stderr)
        return 2
    print(describe_plan(plan, n_ranks), flush=True)
    doc, status = run(plan)
    print_report(doc)
    from . import report

    path = report.write_json(doc, plan.out)
    print(f"\nwrote {path}")
    write_outputs(doc, plan.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
