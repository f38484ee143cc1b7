"""Turn measurements into what people read: text tables, one JSON document, PNG plots (if matplotlib is there).

A result record (one system, op, format and N; lists are per GPU, in the order of ``meta.devices``)::

    {"system": "cuep" | "nccl", "op": "dispatch" | "combine" | "roundtrip" | "a2a_dispatch" | "a2a_combine",
     "format", "n_tokens", "shapes": ["prefill", "sweep", ...], "hidden", "top_k", "n_experts", "n_ranks",
     "num_sms": int | None (NCCL picks its own), "message_bytes": {"dispatch", "combine"},
     "bytes": {"send": [...], "algo": [...]}, "cold": Timing.as_dict(), "warm": Timing.as_dict(),
     "time_us": [...] (cold medians), "round_us": float (cold), "noise": float (cold),
     "send_gbps": [...], "algo_gbps": [...] (cold), "send_gbps_warm", "algo_gbps_warm",
     "of_peer_copy": [...] | None, "of_all_pairs": [...] | None, "speedup_vs_nccl": [...] | None,
     "round_speedup_vs_nccl": float | None, "check": "ok" | message}
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Iterable, Sequence

JSON_NAME = "bench.json"
PLOT_NAMES = ("bandwidth_vs_n.png", "latency_vs_n.png")

# TARGETS.md, 4 x H200, H = 7168, K = 8, E = 256: (op, format, N) -> target microseconds
TARGETS_US = {("dispatch", "bf16", 4096): 420.0, ("dispatch", "fp8", 4096): 230.0, ("combine", "bf16", 4096): 420.0,
              ("dispatch", "bf16", 128): 20.0, ("dispatch", "fp8", 128): 20.0, ("combine", "bf16", 128): 20.0}
TARGET_SHAPE = {"hidden": 7168, "top_k": 8, "n_experts": 256, "n_ranks": 4}


# ---- numbers ---------------------------------------------------------------------------------------------------
def gbps(nbytes: Sequence[float], us: Sequence[float]) -> list[float]:
    """Per GPU bytes / time in GB/s (1e9 bytes per second)."""
    return [b / (t * 1e3) if t > 0 else float("nan") for b, t in zip(nbytes, us)]


def ratio(num: Sequence[float] | None, den: Sequence[float] | None) -> list[float] | None:
    if num is None or den is None:
        return None
    return [a / b if b and not math.isnan(b) else float("nan") for a, b in zip(num, den)]


def fill_derived(rec: dict, ceilings: dict | None) -> dict:
    """Add the headline fields (cold times, GB/s, ceiling ratios) to a record that has ``bytes``, ``cold``,
    ``warm``."""
    cold, warm = rec["cold"], rec.get("warm") or rec["cold"]
    rec["time_us"] = list(cold["median_us"])
    rec["round_us"] = cold["round_us"]
    rec["noise"] = cold["noise"]
    rec["send_gbps"] = gbps(rec["bytes"]["send"], cold["median_us"])
    rec["algo_gbps"] = gbps(rec["bytes"]["algo"], cold["median_us"])
    rec["send_gbps_warm"] = gbps(rec["bytes"]["send"], warm["median_us"])
    rec["algo_gbps_warm"] = gbps(rec["bytes"]["algo"], warm["median_us"])
    peer = (ceilings or {}).get("peer_copy_per_gpu_gbps")
    allp = (ceilings or {}).get("all_pairs_gbps")
    rec["of_peer_copy"] = ratio(rec["send_gbps"], peer)
    rec["of_all_pairs"] = ratio(rec["send_gbps"], allp)
    rec.setdefault("speedup_vs_nccl", None)
    rec.setdefault("round_speedup_vs_nccl", None)
    return rec


def attach_speedups(results: list[dict]) -> None:
    """cuep records get ``speedup_vs_nccl`` (per GPU, NCCL time / cuep time) from the NCCL record of the same op,
    format and N."""
    nccl = {(r["op"], r["format"], r["n_tokens"]): r for r in results if r["system"] == "nccl"}
    for r in results:
        if r["system"] != "cuep":
            continue
        n = nccl.get((r["op"], r["format"], r["n_tokens"]))
        if n is None:
            continue
        r["speedup_vs_nccl"] = [a / b if b > 0 else float("nan") for a, b in zip(n["time_us"], r["time_us"])]
        r["round_speedup_vs_nccl"] = n["round_us"] / r["round_us"] if r["round_us"] > 0 else float("nan")


# ---- text ------------------------------------------------------------------------------------------------------
def _fmt(v, spec: str = ".1f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return format(v, spec)
    return str(v)


def _pct(v, digits: int = 0) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.{digits}f}%"


def table(rows: Iterable[Sequence], header: Sequence[str]) -> str:
    """Right-aligned columns, a dashed rule under the header."""
    rows = [tuple(str(c) for c in r) for r in rows]
    cols = list(zip(header, *rows)) if rows else [(h,) for h in header]
    widths = [max(len(c) for c in col) for col in cols]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])


RESULT_HEADER = ("system", "op", "format", "N", "GPU", "SMs", "us cold", "us warm", "noise", "send GB/s",
                 "algo GB/s", "of peer", "of all-pairs", "x NCCL")


def result_rows_per_gpu(results: list[dict], devices: Sequence[int]) -> list[tuple]:
    rows = []
    for r in results:
        for g, dev in enumerate(devices):
            pick = lambda key: None if r.get(key) is None else r[key][g]  # noqa: E731
            rows.append((r["system"], r["op"], r["format"], r["n_tokens"], dev, _fmt(r.get("num_sms")),
                         _fmt(r["time_us"][g]), _fmt(r["warm"]["median_us"][g]), _pct(r["noise"], 1),
                         _fmt(r["send_gbps"][g], ".0f"), _fmt(r["algo_gbps"][g], ".0f"), _pct(pick("of_peer_copy")),
                         _pct(pick("of_all_pairs")), _fmt(pick("speedup_vs_nccl"), ".2f")))
    return rows


SUMMARY_HEADER = ("system", "op", "format", "N", "SMs", "round us", "warm us", "noise", "send GB/s", "algo GB/s",
                  "of peer", "of all-pairs", "x NCCL")


def result_rows_summary(results: list[dict]) -> list[tuple]:
    """One row per record: the round time (slowest GPU) and the GPUs' mean bandwidth at that time."""
    rows = []
    for r in results:
        send = statistics.fmean(r["bytes"]["send"]) / (r["round_us"] * 1e3) if r["round_us"] > 0 else float("nan")
        algo = statistics.fmean(r["bytes"]["algo"]) / (r["round_us"] * 1e3) if r["round_us"] > 0 else float("nan")
        # each GPU's send bandwidth at the round time, over its own ceiling (peer copy; all pairs), GPU mean
        def at_round(key):
            return (statistics.fmean(f * t / r["round_us"] for f, t in zip(r[key], r["time_us"]))
                    if r.get(key) and r["round_us"] > 0 else None)

        rows.append((r["system"], r["op"], r["format"], r["n_tokens"], _fmt(r.get("num_sms")), _fmt(r["round_us"]),
                     _fmt(r["warm"]["round_us"]), _pct(r["noise"], 1), _fmt(send, ".0f"), _fmt(algo, ".0f"),
                     _pct(at_round("of_peer_copy")), _pct(at_round("of_all_pairs")),
                     _fmt(r.get("round_speedup_vs_nccl"), ".2f")))
    return rows


def ceilings_text(ceil: dict | None, devices: Sequence[int]) -> str:
    if not ceil:
        return "ceilings: not measured"
    lines = [f"ceilings ({ceil['bytes'] / 2**20:.0f} MiB copies, warm, median):"]
    rows = []
    for g, dev in enumerate(devices):
        rows.append((dev, _fmt(ceil["local_copy_gbps"][g], ".0f"),
                     _fmt(ceil.get("peer_copy_per_gpu_gbps", [None] * len(devices))[g], ".0f"),
                     _fmt(ceil.get("all_pairs_gbps", [None] * len(devices))[g], ".0f"),
                     _fmt(ceil.get("all_pairs_copy_engine_gbps", [None] * len(devices))[g], ".0f")))
    lines.append(table(rows, ("GPU", "local copy GB/s (r+w)", "peer copy GB/s (1 pair)",
                              "all pairs GB/s out (SM kernel)", "all pairs (copy engines)")))
    if "peer_copy_gbps" in ceil:
        m = ceil["peer_copy_gbps"]
        lines.append("peer copy GB/s, row = from, column = to:")
        lines.append(table([(devices[a], *(_fmt(v, ".0f") for v in row)) for a, row in enumerate(m)],
                           ("from\\to", *(str(d) for d in devices))))
    if "skipped_peers" in ceil:
        lines.append(f"(peer ceilings skipped: {ceil['skipped_peers']})")
    return "\n".join(lines)


def targets_text(results: list[dict]) -> str | None:
    """TARGETS.md's rows next to the measured round times (4 GPUs, H=7168, K=8, E=256 only)."""
    rows = []
    for r in results:
        if r["system"] != "cuep" or any(r.get(k) != v for k, v in TARGET_SHAPE.items()):
            continue
        t = TARGETS_US.get((r["op"], r["format"], r["n_tokens"]))
        if t is not None:
            rows.append((r["op"], r["format"], r["n_tokens"], _fmt(r.get("num_sms")), _fmt(r["round_us"]), _fmt(t),
                         "yes" if r["round_us"] <= t else "no"))
    if not rows:
        return None
    return "TARGETS.md (4 GPUs):\n" + table(rows, ("op", "format", "N", "SMs", "round us", "target us", "met"))


# ---- JSON --------------------------------------------------------------------------------------------------------
def _clean(v):
    """JSON-safe: NaN/Inf -> None, NumPy scalars and arrays -> Python."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        return _clean(v.tolist())
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


def write_json(doc: dict, out_dir: str | os.PathLike, name: str = JSON_NAME) -> Path:
    """Write ``doc`` to ``out_dir/name`` (default ``bench.json``; NaN as null) and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(_clean(doc), indent=1, allow_nan=False) + "\n")
    return path


# ---- plots -------------------------------------------------------------------------------------------------------
def _sweep_series(results: list[dict], system: str, op: str, fmt: str) -> list[dict]:
    return sorted((r for r in results if r["system"] == system and r["op"] == op and r["format"] == fmt
                   and "sweep" in r.get("shapes", ())), key=lambda r: r["n_tokens"])


def plot_sweep(results: list[dict], out_dir: str | os.PathLike, ceilings: dict | None = None,
               title: str = "") -> list[Path] | str:
    """Bandwidth and latency against N, cuep (solid) against NCCL (dashed), one colour per format.

    Returns the written paths, or a message saying why nothing was plotted (no matplotlib, no sweep).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plots (pip install matplotlib)"
    ops = [op for op in ("dispatch", "combine", "roundtrip") if any(_sweep_series(results, "cuep", op, f)
                                                                     for f in _formats(results))]
    if not ops:
        return "no sweep results: no plots"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    formats = _formats(results)
    colors = {f: c for f, c in zip(formats, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"))}
    multi = any(max(r["bytes"]["send"]) > 0 for r in results)
    peer = statistics.fmean(ceilings["peer_copy_per_gpu_gbps"]) if ceilings and "peer_copy_per_gpu_gbps" in ceilings \
        else None
    allp = statistics.fmean(ceilings["all_pairs_gbps"]) if ceilings and "all_pairs_gbps" in ceilings else None

    def series(system, op, fmt, key):
        s = _sweep_series(results, system, op, fmt)
        xs = [r["n_tokens"] for r in s]
        if key == "round_us":
            ys = [r["round_us"] for r in s]
        else:
            ys = [statistics.fmean(r["bytes"][key]) / (r["round_us"] * 1e3) for r in s]
        return xs, ys

    paths = []
    # bandwidth: algorithm GB/s (row 1) and, with several GPUs, NVLink send GB/s against the ceilings (row 2)
    nrows = 2 if multi else 1
    fig, axes = plt.subplots(nrows, len(ops), figsize=(5 * len(ops), 4 * nrows), squeeze=False)
    for j, op in enumerate(ops):
        for i, key in enumerate(("algo", "send")[:nrows]):
            ax = axes[i][j]
            for fmt in formats:
                for system, style in (("cuep", "-"), ("nccl", "--")):
                    xs, ys = series(system, op, fmt, key)
                    if xs:
                        ax.plot(xs, ys, style, marker="o", ms=3, color=colors[fmt], label=f"{system} {fmt}")
            if key == "send":
                if peer:
                    ax.axhline(peer, color="k", lw=0.8, ls=":", label="peer copy (1 pair)")
                if allp:
                    ax.axhline(allp, color="grey", lw=0.8, ls="-.", label="all pairs")
            _log2_n_axis(ax)
            ax.set_ylabel(f"{'algorithm' if key == 'algo' else 'send (NVLink)'} GB/s per GPU")
            ax.set_title(f"{op}: {'algorithm' if key == 'algo' else 'send'} bandwidth")
            ax.grid(True, which="both", alpha=0.3)
    for i in range(nrows):
        axes[i][-1].legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out / PLOT_NAMES[0], title))

    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for j, op in enumerate(ops):
        ax = axes[0][j]
        for fmt in formats:
            for system, style in (("cuep", "-"), ("nccl", "--")):
                xs, ys = series(system, op, fmt, "round_us")
                if xs:
                    ax.plot(xs, ys, style, marker="o", ms=3, color=colors[fmt], label=f"{system} {fmt}")
        _log2_n_axis(ax)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.set_ylabel("round time, us (median, cold L2)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out / PLOT_NAMES[1], title))
    return paths


def _save(fig, path, title: str | None):
    """Title, lay out, write and close one figure; returns its path."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _log2_n_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.set_xlabel("tokens per rank N")


def _formats(results: list[dict]) -> list[str]:
    seen = []
    for r in results:
        if r["format"] not in seen:
            seen.append(r["format"])
    return seen
