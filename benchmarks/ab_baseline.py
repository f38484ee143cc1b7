#!/usr/bin/env python3
"""In-process A/B of cuep's EP kernels: this working tree's cuep against a baseline commit's, on one GPU.

    python benchmarks/ab_baseline.py --base a60777d                  # the default run (about 2.5 min on an H100)
    python benchmarks/ab_baseline.py --base a60777d --formats bf16 fp8 --tokens 128 --ranks 1 --rounds 8
    python benchmarks/ab_baseline.py --base-dir /path/to/old/cuep     # baseline already extracted (no git)
    python benchmarks/ab_baseline.py --base a60777d --dry-run         # the plan, without touching a GPU

Two versions timed in different processes differ by more than most changes worth measuring, so both run in one
process: the baseline commit's ``cuep`` package is extracted (``git archive <base> cuep`` of the repository this
script lives in) into ``--work-dir`` (default ``<tmp>/cuep_ab/<sha>``: a stable path, so the next run finds its
kernels in CuPy's disk cache), renamed ``cuep_base``, its absolute ``import cuep`` statements rewritten to
``cuep_base``, and imported beside the working tree's ``cuep``. Both compile their kernels with ``cupy.RawModule``
at first use; every kernel file of both packages is compiled first, in parallel subprocesses that fill CuPy's disk
cache (``--no-precompile``: serially at first use).

Cases, all on GPU ``--device`` (default 0), H = 7168, K = 8, E = 256, max_tokens_per_rank = max(``--tokens``),
combine bf16: for each ``--ranks`` R (default 1 4) and ``--formats`` (default all four) a pair of Buffers,
baseline's and new's, alive together; R = 1 is one real rank (every expert local), R > 1 is R simulated ranks
sharing the GPU (``cuep.init([dev] * R)``; a round runs phase by phase, rank by rank, so those times mean little,
but base and new must agree). For each ``--tokens`` N (default 128 4096; the default small-round threshold min(T,
256) makes 128 a staged decode round and 4096 a direct one): random bf16 tokens (never zeros; ``--x-dtype float32``:
the same values as float32), K distinct random experts per token, random float32 weights, the same inputs for both
packages (``cuep.bench.cases.make_inputs``; the calls rotate among ``--input-sets`` sets). Ops: ``dispatch`` (fused
``cuep.dispatch`` with the weights) and ``combine`` (fused ``cuep.combine`` with the weights given at dispatch:
partial sums; timed after an untimed dispatch).

Correctness, once per case before timing: new's dispatch must equal baseline's (row_offsets, expert_ids,
scales_offsets identical; per rank the same rows as a multiset keyed by group, src_info and the row's bytes and
scales, since rows of one (expert, source) block arrive in any order; the row count the routing asks for), and
combine outputs must be bit-equal when both sides' expert outputs hold the same value for the same key. A
difference is printed as MISMATCH at once, marks the table and makes the exit status 1 (a slowdown table of a wrong
kernel is worthless).

Timing (``cuep.bench.timing`` of the new package): CUDA events around each call, behind a start gate (the host's
launch overhead stays out), ``--warmup`` untimed calls then ``--repeats`` timed ones per measurement; cold (L2
flushed by writing twice its size before each call, outside the timed region) is the headline, warm beside it
(``--no-warm`` drops it). Base and new alternate so drift hits both: per (ranks, format), ``--rounds`` rounds
(default 6); each allocates a fresh pair of Buffers and times every N and op on base and on new. Three things that
are not the code were seen to move an A/A run (the same kernels on both sides, H100) and are balanced out:

* the side measured second in a round: 1.5-4.5% slower at N = 128 combine. Who goes first (and whose Buffers are
  allocated first) alternates with the round (``--order base-first`` turns that off; keep ``--rounds`` even);
* where the Buffers lie in memory (the suspect for 0.5-3% biases that followed neither of the other two and were
  gone once the pairs were really re-allocated each round): fresh ones each round (``--no-rebuild`` keeps
  round 0's);
* where the kernel modules lie in memory: the module loaded second was 0.3% slower at N = 4096 bf16 dispatch and
  1-1.5% at N = 128 combine. One process cannot move them, so ``--passes`` (default 2) processes run the rounds,
  the first loading base's kernels first, the second new's (``--passes 1 --load-first new|base``: this process).

Per (package, case, op, mode): the median of every timed call of every pass. ``new/base``: their ratio; ``rounds``:
the range of the per-round ratios (a round's new median over its base median); ``noise``: the larger of the two
packages' spreads between their round medians ((max - min) / median). ``verdict``: SLOWER when new/base exceeds
1 + ``--tol`` (default 0.01) and every round's ratio exceeds 1; faster the other way round. An A/A run on an H100
(a60777d against a clean checkout of itself, 2 passes x 4 rounds) gave new/base 0.98-1.02 at N = 128 (round ratios
0.95-1.06) and 0.998-1.008 at N = 4096, no verdict: a SLOWER of 1-2% at N = 128 deserves a second run, or an A/A
run (``--base HEAD`` on a clean tree) beside it.

Output: progress lines; ``ab_baseline.json`` (every sample, the checks, memory, device, git state) under ``--out``
(default ``$OUT`` if set, else ``out/ab``; each pass's own JSON in ``pass<i>/``, rewritten after every case); the
table, printed last and saved as ``ab_baseline.txt``. Exit status 0; 1 on a mismatch or an error in a case; 2 on a
set-up error.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib
import io
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]   # the repository (and working tree) this script belongs to
BASE_NAME = "cuep_base"
HIDDEN, TOP_K, N_EXPERTS = 7168, 8, 256
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
OPS = ("dispatch", "combine")
LABELS = ("base", "new")
REWRITE_VERSION = 1     # bump when the extraction / rewriting changes: a cached extraction is then redone
JSON_NAME, TEXT_NAME = "ab_baseline.json", "ab_baseline.txt"


class AbError(RuntimeError):
    """A set-up problem (bad --base, no git, a package that does not import): printed, exit status 2."""


def log(msg: str) -> None:
    print(f"[ab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the baseline package ------------------------------------------------------------------------------------------
def _git(root: Path, *args: str, text: bool = True):
    try:
        return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=text).stdout
    except FileNotFoundError as e:
        raise AbError("git is not installed here: extract the baseline elsewhere and pass --base-dir") from e
    except subprocess.CalledProcessError as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        raise AbError(f"git {' '.join(args)} failed in {root}: {err.strip()}") from e


def resolve_commit(ref: str, root: Path = ROOT) -> str:
    """The full sha of commit ``ref`` in the repository at ``root``."""
    return _git(root, "rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}").strip()


# absolute imports of the package, as statements (a line each); relative imports (from . import x) need nothing
_FROM = re.compile(r"^([ \t]*)from[ \t]+cuep((?:\.\w+)*)[ \t]+import\b", re.M)
_IMPORT_AS = re.compile(r"^([ \t]*)import[ \t]+cuep((?:\.\w+)*)[ \t]+as[ \t]+(\w+)[ \t]*(#.*)?$", re.M)
_IMPORT_BARE = re.compile(r"^([ \t]*)import[ \t]+cuep[ \t]*(#.*)?$", re.M)
_IMPORT_SUB = re.compile(r"^([ \t]*)import[ \t]+cuep((?:\.\w+)+)[ \t]*(#.*)?$", re.M)
_IMPORT_LINE = re.compile(r"^[ \t]*import[ \t]+(.*)$", re.M)
_FROM_LEFT = re.compile(r"^[ \t]*from[ \t]+cuep(?:\.\w+)*[ \t]+import\b", re.M)


def rewrite_source(text: str, name: str = BASE_NAME) -> str:
    """``text`` with every absolute import of ``cuep`` made an import of ``name`` that binds the same local names:
    ``import cuep`` -> ``import name as cuep``, ``import cuep.x as y`` -> ``import name.x as y``,
    ``import cuep.x`` -> ``import name.x; import name as cuep``, ``from cuep[.x] import ...`` -> ``from name[.x]``."""
    comment = lambda m: f"  {m}" if m else ""  # noqa: E731
    text = _FROM.sub(lambda m: f"{m[1]}from {name}{m[2]} import", text)
    text = _IMPORT_AS.sub(lambda m: f"{m[1]}import {name}{m[2]} as {m[3]}{comment(m[4])}", text)
    text = _IMPORT_BARE.sub(lambda m: f"{m[1]}import {name} as cuep{comment(m[2])}", text)
    text = _IMPORT_SUB.sub(lambda m: f"{m[1]}import {name}{m[2]}; import {name} as cuep{comment(m[3])}", text)
    return text


def absolute_imports(text: str) -> list[str]:
    """Lines of ``text`` that still import ``cuep`` absolutely (forms :func:`rewrite_source` does not handle, such
    as ``import os, cuep``)."""
    bad = [m[0].strip() for m in _FROM_LEFT.finditer(text)]
    for m in _IMPORT_LINE.finditer(text):
        names = re.sub(r"[ \t]+as[ \t]+\w+", "", m[1].split("#", 1)[0].split(";", 1)[0])
        if any(n.strip() == "cuep" or n.strip().startswith("cuep.") for n in names.split(",")):
            bad.append(m[0].strip())
    return bad


def rewrite_package(pkg_dir: Path, name: str = BASE_NAME) -> list[str]:
    """Rewrite the absolute imports of every ``.py`` file under ``pkg_dir``; the files changed (relative paths).
    Raises :class:`AbError` if an absolute import of ``cuep`` is left (the baseline would run new code)."""
    changed, left = [], []
    for p in sorted(pkg_dir.rglob("*.py")):
        old = p.read_text()
        new = rewrite_source(old, name)
        if new != old:
            p.write_text(new)
            changed.append(p.relative_to(pkg_dir).as_posix())
        left += [f"{p.relative_to(pkg_dir).as_posix()}: {line}" for line in absolute_imports(new)]
    if left:
        raise AbError("the baseline package imports cuep absolutely in a form this script cannot rewrite:\n  "
                      + "\n  ".join(left))
    return changed


def _install(stage: Path, dest: Path, stamp: str) -> Path:
    """Move the staged extraction ``stage`` (holding ``cuep_base/``) to ``dest``, replacing an old one."""
    (stage / "EXTRACTED").write_text(stamp + "\n")
    if dest.exists():
        shutil.rmtree(dest, ignore_errors=True)
    try:
        stage.rename(dest)
    except OSError:  # another run installed it meanwhile
        shutil.rmtree(stage, ignore_errors=True)
        if not _fresh(dest, stamp):
            raise AbError(f"could not install the baseline extraction at {dest}")
    return dest


def _fresh(dest: Path, stamp: str) -> bool:
    marker = dest / "EXTRACTED"
    return marker.is_file() and marker.read_text().strip() == stamp and (dest / BASE_NAME / "__init__.py").is_file()


def default_work_dir() -> Path:
    return Path(tempfile.gettempdir()) / "cuep_ab"


def extract_baseline(ref: str, work_dir: Path | None = None, root: Path = ROOT) -> tuple[Path, str]:
    """``git archive <ref> cuep`` of the repository at ``root`` into ``work_dir/<sha>/cuep_base`` (imports
    rewritten); returns (the directory to put on ``sys.path``, the commit's sha). An extraction already there from
    the same sha and script version is reused (same path: CuPy's kernel cache hits)."""
    sha = resolve_commit(ref, root)
    work_dir = Path(work_dir or default_work_dir())
    work_dir.mkdir(parents=True, exist_ok=True)
    dest, stamp = work_dir / sha, f"{sha} rewrite-v{REWRITE_VERSION}"
    if _fresh(dest, stamp):
        return dest, sha
    data = _git(root, "archive", "--format=tar", sha, "cuep", text=False)
    stage = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}-", dir=work_dir))
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            try:
                tf.extractall(stage, filter="data")
            except TypeError:  # a Python without extraction filters
                tf.extractall(stage)
        if not (stage / "cuep" / "__init__.py").is_file():
            raise AbError(f"commit {sha[:12]} has no cuep/__init__.py")
        (stage / "cuep").rename(stage / BASE_NAME)
        rewrite_package(stage / BASE_NAME)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return _install(stage, dest, stamp), sha


def copy_base_dir(path: Path, work_dir: Path | None = None) -> tuple[Path, str]:
    """A baseline given as a directory: the package itself (holding ``__init__.py``) or a folder holding ``cuep/``;
    copied to ``work_dir/dir-<hash of its path>/cuep_base`` and rewritten (the original is left alone). Returns
    (the directory to put on ``sys.path``, a label)."""
    src = Path(path).resolve()
    if (src / "__init__.py").is_file():
        pkg = src
    elif (src / "cuep" / "__init__.py").is_file():
        pkg = src / "cuep"
    else:
        raise AbError(f"--base-dir {path}: neither a package (no __init__.py) nor a folder holding cuep/")
    work_dir = Path(work_dir or default_work_dir())
    work_dir.mkdir(parents=True, exist_ok=True)
    dest = work_dir / f"dir-{hashlib.sha1(str(pkg).encode()).hexdigest()[:12]}"
    stage = Path(tempfile.mkdtemp(prefix=".dir-", dir=work_dir))
    try:
        shutil.copytree(pkg, stage / BASE_NAME, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        rewrite_package(stage / BASE_NAME)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return _install(stage, dest, f"dir {pkg} rewrite-v{REWRITE_VERSION}"), f"dir:{pkg}"


def import_packages(base_parent: Path):
    """(baseline module ``cuep_base``, new module ``cuep`` of this working tree); both checked to come from where
    they should."""
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))
    new = importlib.import_module("cuep")
    if Path(new.__file__).resolve().parent != ROOT / "cuep":
        raise AbError(f"import cuep gave {new.__file__}, not this working tree's {ROOT / 'cuep'}")
    sys.path.insert(0, str(base_parent))
    try:
        base = importlib.import_module(BASE_NAME)
    except Exception as e:
        raise AbError(f"the baseline package at {base_parent / BASE_NAME} does not import: "
                      f"{type(e).__name__}: {e}") from e
    if Path(base.__file__).resolve().parent != (base_parent / BASE_NAME).resolve():
        raise AbError(f"import {BASE_NAME} gave {base.__file__}, not {base_parent / BASE_NAME}")
    return base, new


def labelled_packages(base: str | None = None, base_dir: str | None = None) -> dict:
    """The packages a host-cost tool times, by label, each with its ``ops`` module loaded: this tree's ``cuep``
    alone, or with ``--base`` (a commit) / ``--base-dir`` (a directory) the baseline first, then ``"new"``."""
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))
    if base or base_dir:
        parent, desc = extract_baseline(base) if base else copy_base_dir(Path(base_dir))
        old, new = import_packages(parent)
        pkgs = {f"base {desc[:12]}": old, "new": new}
    else:
        pkgs = {"cuep": importlib.import_module("cuep")}
    for pkg in pkgs.values():
        pkg.ops = importlib.import_module(pkg.__name__ + ".ops")
    return pkgs


def check_module_origins(base_parent: Path) -> list[str]:
    """Loaded ``cuep_base.*`` / ``cuep.*`` modules whose file is not in their own package (should be none)."""
    wrong = []
    homes = {BASE_NAME: (base_parent / BASE_NAME).resolve(), "cuep": (ROOT / "cuep").resolve()}
    for name, mod in list(sys.modules.items()):
        top = name.split(".", 1)[0]
        f = getattr(mod, "__file__", None)
        if top in homes and f and homes[top] not in Path(f).resolve().parents:
            wrong.append(f"{name}: {f}")
    return wrong


# ---- kernels compiled in parallel ----------------------------------------------------------------------------------
_COMPILE = ("import importlib, sys; sys.path.insert(0, sys.argv[1]); "
            "k = importlib.import_module(sys.argv[2] + '._kernels'); "
            "k.module(sys.argv[3], part=sys.argv[4]) if len(sys.argv) > 4 else k.module(sys.argv[3])")


def compile_units(kernels, formats=None) -> list[tuple[str, str | None]]:
    """The (file, part) units a package's loader ``kernels`` (its ``_kernels`` module) compiles at run time: its
    kernel_units (a file in its PARTS a part at a time; parts of a format not in ``formats`` left out), or, for a
    package older than parts, every file whole (None)."""
    units = getattr(kernels, "kernel_units", None)
    if units is None:
        return [(f, None) for f in kernels.kernel_files()]
    return [(f, p) for f, p in units() if p is None or formats is None or p in formats]


def precompile(pkgs: dict, jobs: int, timeout_s: float = 1200.0, formats=None) -> None:
    """Compile every kernel unit (:func:`compile_units`: a file, or a part of one) of each package in its own
    subprocess (``jobs`` at a time) through the package's own loader, which fills CuPy's disk cache: the first use
    in this process then loads the binary. Best effort: a failure is reported and the kernel is compiled again at
    first use (where a real error then surfaces)."""
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "0") not in ("", "0"):
        log("precompile skipped: CUPY_CACHE_IN_MEMORY is set (nothing would reach the disk cache)")
        return
    todo = []
    for label, (mod, path_entry) in pkgs.items():
        try:
            units = compile_units(importlib.import_module(mod.__name__ + "._kernels"), formats)
        except Exception as e:  # noqa: BLE001
            log(f"precompile of {label} skipped ({type(e).__name__}: {e})")
            continue
        units.sort(key=lambda u: (not u[0].startswith(("dispatch", "combine")), u[1] is not None, u))  # long first
        todo += [(label, mod.__name__, str(path_entry), u) for u in units]
    if not todo:
        return
    env = dict(os.environ, CUEP_LOG="0")
    log(f"precompiling {len(todo)} kernel units of {', '.join(pkgs)} in up to {jobs} processes "
        f"(CuPy disk cache) ...")
    t0 = time.perf_counter()
    waiting, running, done = list(todo), [], {label: [] for label in pkgs}
    while waiting or running:
        while waiting and len(running) < jobs:
            label, name, entry, (f, part) = waiting.pop(0)
            err_file = tempfile.TemporaryFile()
            p = subprocess.Popen([sys.executable, "-c", _COMPILE, entry, name, f, *([part] if part else [])],
                                 env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=err_file)
            f = f if part is None else f"{f}[{part}]"
            running.append((p, err_file, label, f, time.perf_counter()))
        time.sleep(0.2)
        for item in list(running):
            p, err_file, label, f, start = item
            if p.poll() is None and time.perf_counter() - start < timeout_s:
                continue
            if p.poll() is None:
                p.kill()
                p.wait()
                err = f"timed out after {timeout_s:.0f} s"
            elif p.returncode:
                err_file.seek(0)
                err = err_file.read().decode(errors="replace").strip()[-600:] or f"exit status {p.returncode}"
            else:
                err = ""
            err_file.close()
            running.remove(item)
            done[label].append((f, time.perf_counter() - t0, err))
            if err:
                log(f"precompile {label} {f} failed (compiled again at first use): {err}")
    for label, items in done.items():
        if items:
            log(f"{label} kernels compiled: {len(items)} units, {max(t for _, t, _ in items):.0f} s")


# ---- statistics and the table --------------------------------------------------------------------------------------
def _median(v):
    return statistics.median(v) if v else float("nan")


def summarize(results: dict, checks: dict, tol: float = 0.01) -> list[dict]:
    """Rows of the table from ``results[(ranks, fmt, n, op, mode)][label]`` = per-round lists of samples (us) and
    ``checks[(ranks, fmt, n)]`` = "ok" or a problem."""
    rows = []
    for key in results:
        ranks, fmt, n, op, mode = key
        per = results[key]
        if not all(per.get(lab) for lab in LABELS):
            continue
        rec = {"ranks": ranks, "format": fmt, "n_tokens": n, "op": op, "mode": mode,
               "check": checks.get((ranks, fmt, n), "not checked")}
        round_meds = {}
        for lab in LABELS:
            samples = [t for rnd in per[lab] for t in rnd]
            meds = [_median(rnd) for rnd in per[lab]]
            round_meds[lab] = meds
            mid = _median(samples)
            rec[lab] = {"median_us": mid, "min_us": min(samples), "round_median_us": meds,
                        "noise": (max(meds) - min(meds)) / mid if len(meds) > 1 and mid > 0 else float("nan")}
        rec["ratio"] = rec["new"]["median_us"] / rec["base"]["median_us"]
        rr = [b and a / b for a, b in zip(round_meds["new"], round_meds["base"])]
        rec["round_ratios"] = rr
        rec["noise"] = max(rec["base"]["noise"], rec["new"]["noise"])
        verdict = ""
        if rec["ratio"] > 1 + tol and min(rr) > 1:
            verdict = "SLOWER"
        elif rec["ratio"] < 1 - tol and max(rr) < 1:
            verdict = "faster"
        rec["verdict"] = verdict
        rows.append(rec)
    return rows


def format_table(rows: list[dict], header: str = "") -> str:
    """The cold rows with the warm figures beside them, one line per (ranks, format, N, op)."""
    warm = {(r["ranks"], r["format"], r["n_tokens"], r["op"]): r for r in rows if r["mode"] == "warm"}
    cold = [r for r in rows if r["mode"] == "cold"]
    lines = [header] if header else []
    lines.append(f"{'R':>2} {'format':6} {'N':>5} {'op':8} | {'base us':>8} {'new us':>8} {'new/base':>8} "
                 f"{'rounds':>11} {'noise':>6} {'verdict':7} | {'warm base':>9} {'new':>8} {'new/base':>8} | check")
    lines.append("-" * len(lines[-1]))
    for r in cold:
        w = warm.get((r["ranks"], r["format"], r["n_tokens"], r["op"]))
        rr = r["round_ratios"]
        warm_txt = (f"{w['base']['median_us']:9.2f} {w['new']['median_us']:8.2f} {w['ratio']:8.3f}" if w
                    else f"{'':9} {'':8} {'':8}")
        check = r["check"] if r["check"] == "ok" or r["check"].startswith("not ") else "MISMATCH"
        lines.append(f"{r['ranks']:>2} {r['format']:6} {r['n_tokens']:>5} {r['op']:8} | "
                     f"{r['base']['median_us']:8.2f} {r['new']['median_us']:8.2f} {r['ratio']:8.3f} "
                     f"{min(rr):5.3f}-{max(rr):5.3f} {100 * r['noise']:5.1f}% {r['verdict']:7} | {warm_txt} | {check}")
    if cold:
        gm = math.exp(sum(math.log(r["ratio"]) for r in cold) / len(cold))
        slower = [r for r in cold if r["verdict"] == "SLOWER"]
        lines.append(f"cold new/base geometric mean {gm:.3f} over {len(cold)} rows; SLOWER: "
                     + (", ".join(f"R={r['ranks']} {r['format']} N={r['n_tokens']} {r['op']} {r['ratio']:.3f}"
                                  for r in slower) or "none"))
    return "\n".join(lines)


# ---- one case on the GPU -------------------------------------------------------------------------------------------
class Runner:
    """One package's timed callables on its Buffer (the cuep.bench.timing ``fn(i)`` form; i picks the input set)."""

    def __init__(self, pkg, buf, inputs, expert_out) -> None:
        self.pkg, self.buf, self.inputs, self.expert_out = pkg, buf, inputs, expert_out
        self.handle = None

    def dispatch(self, i: int) -> None:
        k = i % self.inputs.n_sets
        inp = self.inputs
        self.handle = self.pkg.dispatch(self.buf, inp.x[k], inp.ids[k], inp.weights[k])

    setup_combine = dispatch

    def combine(self, i: int) -> None:
        self.pkg.combine(self.buf, self.expert_out, self.handle)


def row_hash(xp, rows, seed: int, chunk_bytes: int = 1 << 28):
    """uint64 [n] hash of each row of the 2-D uint8 array ``rows`` (a random linear form of its 32-bit words, mod
    2**64): equal rows hash equal; different rows collide with negligible probability."""
    import numpy as np

    rows = xp.ascontiguousarray(rows)
    n, nb = rows.shape
    if nb % 4:
        rows = xp.concatenate([rows, xp.zeros((n, 4 - nb % 4), dtype=xp.uint8)], axis=1)
    words = rows.view(xp.uint32)
    w = words.shape[1]
    mult = xp.asarray(np.random.default_rng(seed).integers(0, 2**63, size=w, dtype=np.uint64) * np.uint64(2)
                      + np.uint64(1))
    out = xp.zeros(n, dtype=xp.uint64)
    step = max(1, chunk_bytes // (8 * max(w, 1)))
    for a in range(0, n, step):
        out[a:a + step] = (words[a:a + step].astype(xp.uint64) * mult).sum(axis=1, dtype=xp.uint64)
    return out


def rows_differ(xp, a, b, ia=None, ib=None, chunk_bytes: int = 1 << 28) -> int:
    """How many rows of ``a[ia]`` and ``b[ib]`` (2-D, equal shapes; index arrays optional) differ, compared a chunk
    of rows at a time so no full gathered copy is made."""
    n = a.shape[0] if ia is None else int(ia.shape[0])
    step = max(1, chunk_bytes // max(1, a[:1].nbytes))
    bad = 0
    for s in range(0, n, step):
        ca = a[s:s + step] if ia is None else a[ia[s:s + step]]
        cb = b[s:s + step] if ib is None else b[ib[s:s + step]]
        bad += int((ca != cb).reshape(ca.shape[0], -1).any(axis=1).sum())
    return bad


def compare_rank(xp, side: dict, rank: int, expected_rows: int) -> tuple[list[str], dict]:
    """Compare one rank's dispatch outputs of the two packages.

    ``side[label]`` holds, on the host: ``row_offsets``, ``expert_ids``, ``scales_offsets`` (or None),
    ``src_info`` [rows, 2]; on the device (``xp``): ``tokens`` [rows, bytes] and ``scales`` [rows, bytes] (or None),
    uint8, rows = row_offsets[-1]. Returns (problems, {label: row permutation on the device}) where the
    permutations put both sides' rows in one order (by group, source token, slot, row hash).
    """
    import numpy as np

    a, b = side["base"], side["new"]
    probs = []
    for f in ("row_offsets", "expert_ids", "scales_offsets"):
        if (a[f] is None) != (b[f] is None) or (a[f] is not None and not np.array_equal(a[f], b[f])):
            probs.append(f"rank {rank} {f} differ")
    for lab in LABELS:
        got = int(side[lab]["row_offsets"][-1])
        if got != expected_rows:
            probs.append(f"rank {rank} {lab}: {got} rows, the routing asks for {expected_rows}")
    if probs:
        return probs, {}
    rows = int(a["row_offsets"][-1])
    perms, keys = {}, {}
    for lab in LABELS:
        s = side[lab]
        g = np.searchsorted(np.asarray(s["row_offsets"][1:], np.int64), np.arange(rows), side="right")
        h = row_hash(xp, s["tokens"], 1)
        if s["scales"] is not None:
            h = h ^ row_hash(xp, s["scales"], 2)
        h = xp.asnumpy(h) if hasattr(xp, "asnumpy") else np.asarray(h)
        t, k = s["src_info"][:, 0].astype(np.int64), s["src_info"][:, 1].astype(np.int64)
        order = np.lexsort((h, k, t, g))
        keys[lab] = (g[order], t[order], k[order], h[order])
        perms[lab] = xp.asarray(order)
    differ = np.zeros(rows, bool)
    for ka, kb in zip(keys["base"], keys["new"]):
        differ |= ka != kb
    if differ.any():
        i = int(np.argmax(differ))
        probs.append(f"rank {rank}: {int(differ.sum())} of {rows} rows differ (as sets keyed by group, src_info "
                     f"and bytes; first: group {keys['base'][0][i]}, src_info base ({keys['base'][1][i]}, "
                     f"{keys['base'][2][i]}) new ({keys['new'][1][i]}, {keys['new'][2][i]}))")
        return probs, perms
    for f in ("tokens", "scales"):
        if a[f] is None:
            continue
        n_bad = rows_differ(xp, a[f], b[f], perms["base"], perms["new"])
        if n_bad:
            probs.append(f"rank {rank}: {n_bad} rows' {f} differ")
    return probs, perms


def _scale_rows(d, cfg, rows: int, unswizzle):
    """A Dispatched's block scales as uint8 [rows, bytes] on the device (fp8 columns, fp4 tiles unswizzled on the
    host), or None for bf16."""
    import cupy

    if d.scales is None or cfg.fmt.name == "bf16":
        return None
    if cfg.fmt.name == "fp8":
        return cupy.ascontiguousarray(d.scales[:, :rows].T).view(cupy.uint8)
    ro = d.row_offsets.get()
    host = unswizzle(d.scales.get().reshape(-1), ro, cfg.fmt.name, cfg.hidden)
    return cupy.asarray(host)


def check_case(pkgs: dict, bufs: dict, cfgs: dict, inputs, expert_out: list, seed: int) -> list[str]:
    """One dispatch + combine of input set 0 on both packages; problems (empty: identical). ``expert_out`` (per
    rank, [capacity, H] bf16) is overwritten."""
    import cupy

    from cuep.bench import cases as bcases, traffic
    from cuep.reference.quant import unswizzle_block_scales

    ds = {}
    for lab in LABELS:
        ds[lab] = pkgs[lab].dispatch(bufs[lab], inputs.x[0], inputs.ids[0], inputs.weights[0])
        bufs[lab].synchronize()
    R = len(ds["new"])
    probs, perms = [], []
    for r in range(R):
        side = {}
        for lab in LABELS:
            d, cfg = ds[lab][r], cfgs[lab]
            ro = d.row_offsets.get()
            rows = int(ro[-1])
            side[lab] = {"row_offsets": ro, "expert_ids": d.expert_ids.get(),
                         "scales_offsets": None if d.scales_offsets is None else d.scales_offsets.get(),
                         "src_info": d.src_info[:rows].get(),
                         "tokens": d.tokens[:rows].view(cupy.uint8).reshape(rows, -1),
                         "scales": _scale_rows(d, cfg, rows, unswizzle_block_scales)}
        want = traffic.expected_rows(inputs.ids_host[0], cfgs["new"].n_experts, r, cfgs["new"].fmt.row_align)
        p, perm = compare_rank(cupy, side, r, want)
        probs += p
        perms.append(perm)
        del side
    if probs:
        return probs + ["combine not compared (the dispatches differ)"]
    # combine: the same value for the same (group, source token, slot) key on both sides, outputs bit-equal. The
    # timed runs' expert outputs are reused (their values do not matter to the timing): filled for base, combined,
    # refilled in the new side's row order, combined again
    gen = cupy.random.default_rng(seed)
    vals = [bcases.random_bf16(gen, (max(int(p["base"].size), 1), HIDDEN), octaves=False)[:int(p["base"].size)]
            for p in perms]
    outs = {}
    for lab in LABELS:
        for r in range(R):
            expert_out[r].view(cupy.uint16)[perms[r][lab]] = vals[r].view(cupy.uint16)
        got = pkgs[lab].combine(bufs[lab], expert_out, ds[lab])
        bufs[lab].synchronize()
        outs[lab] = [o.view(cupy.uint16).copy() for o in got]
    for r in range(R):
        a, b = outs["base"][r], outs["new"][r]
        if a.shape != b.shape:
            probs.append(f"rank {r}: combine output shapes {a.shape} vs {b.shape}")
            continue
        n_bad = rows_differ(cupy, a, b)
        if n_bad:
            probs.append(f"rank {r}: combine differs in {n_bad} of {a.shape[0]} tokens")
    del vals, outs
    cupy.get_default_memory_pool().free_all_blocks()
    return probs


# ---- the run -------------------------------------------------------------------------------------------------------
def cfg_kwargs(ranks: int, fmt: str, t_max: int) -> dict:
    return dict(hidden=HIDDEN, top_k=TOP_K, n_experts=N_EXPERTS, max_tokens_per_rank=t_max, n_gpus_per_node=ranks,
                dispatch_format=fmt)


def memory_lines(pkgs: dict, args) -> list[tuple[int, str, dict, str]]:
    """(ranks, format, {label: cfg}, text) of every Buffer pair, sizes from each package's EPConfig."""
    t_max = max(args.tokens)
    out = []
    for ranks in args.ranks:
        for fmt in args.formats:
            cfgs = {lab: pkgs[lab].EPConfig(**cfg_kwargs(ranks, fmt, t_max)) for lab in pkgs}
            per = {lab: ranks * c.total_bytes for lab, c in cfgs.items()}
            eo = ranks * max(c.capacity for c in cfgs.values()) * HIDDEN * 2
            gib = 2**-30
            text = (f"R={ranks} {fmt:5} T={t_max}: Buffer {cfgs['new'].total_bytes * gib:.2f} GiB per rank "
                    f"(base {cfgs['base'].total_bytes * gib:.2f}) x {ranks}; both packages "
                    f"{sum(per.values()) * gib:.2f} GiB + expert outputs {eo * gib:.2f} GiB on the GPU; small rounds "
                    f"<= {cfgs['new'].small_batch_tokens} tokens")
            out.append((ranks, fmt, cfgs, text))
    return out


def plan_text(args, base_desc: str, pkgs: dict) -> str:
    lines = [f"baseline: {base_desc}", f"new: working tree {ROOT} ({_git_state()})",
             f"shape H={HIDDEN} K={TOP_K} E={N_EXPERTS}, T = max(--tokens) = {max(args.tokens)}, combine bf16, "
             f"formats {' '.join(args.formats)}, ranks {' '.join(map(str, args.ranks))} "
             f"(R > 1: simulated on GPU {args.device}), N {' '.join(map(str, args.tokens))}, ops {' '.join(args.ops)}",
             f"timing: {args.passes} process(es) x {args.rounds} rounds x (base, new) x {args.repeats} timed calls "
             f"(+{args.warmup} warm-up) per op and mode ({'cold, warm' if args.warm else 'cold'}); {args.input_sets} "
             f"input sets; order {args.order}; Buffers {'new each round' if args.rebuild else 'kept'}; start gate "
             f"{'on' if args.gate else 'off'}"]
    for *_, text in memory_lines(pkgs, args):
        lines.append("  " + text)
    n_modes = 2 if args.warm else 1
    calls = (len(args.ranks) * len(args.formats) * len(args.tokens) * len(args.ops) * 2 * args.passes * args.rounds
             * n_modes * (args.repeats + args.warmup))
    lines.append(f"{calls} timed + warm-up calls in all; json and table to {args.out}")
    return "\n".join(lines)


def _git_state() -> str:
    try:
        head = _git(ROOT, "rev-parse", "--short=12", "HEAD").strip()
        dirty = _git(ROOT, "status", "--porcelain", "--", "cuep").splitlines()
        return f"HEAD {head}" + (f", {len(dirty)} changed path(s) under cuep/" if dirty else ", cuep/ clean")
    except AbError as e:
        return f"git state unknown ({e})"


def device_info(dev: int) -> dict:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(dev)
    name = props["name"]
    return {"id": dev, "name": name.decode() if isinstance(name, bytes) else str(name),
            "sms": int(props["multiProcessorCount"]), "l2_bytes": int(props["l2CacheSize"]),
            "memory_bytes": int(props["totalGlobalMem"]), "cupy": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "cuda_driver": cupy.cuda.runtime.driverGetVersion()}


def run(args, pkgs: dict, base_desc: str, base_parent: Path) -> int:
    import cupy

    from cuep.bench import cases as bcases, timing, traffic

    dev = args.device
    cupy.cuda.Device(dev).use()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"meta": {"tool": "benchmarks/ab_baseline.py", "argv": sys.argv[1:],
                    "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "base": base_desc, "new": f"working tree {ROOT} ({_git_state()})", "device": device_info(dev),
                    "python": platform.python_version(), "numpy": __import__("numpy").__version__,
                    "shape": {"hidden": HIDDEN, "top_k": TOP_K, "n_experts": N_EXPERTS,
                              "max_tokens_per_rank": max(args.tokens)},
                    "settings": {k: v for k, v in vars(args).items() if k not in ("dry_run",)}},
           "memory": [], "checks": [], "errors": [], "samples": [], "table": []}
    results: dict = {}   # (ranks, fmt, n, op, mode) -> {label: [round samples]}
    checks: dict = {}    # (ranks, fmt, n) -> "ok" | problems
    gated = {lab: True for lab in LABELS}
    modes = ("cold", "warm") if args.warm else ("cold",)
    mems = {(r, f): (cfgs, text) for r, f, cfgs, text in memory_lines(pkgs, args)}
    first_use = set()

    def save() -> None:
        doc["samples"] = [{"ranks": k[0], "format": k[1], "n_tokens": k[2], "op": k[3], "mode": k[4],
                           "rounds_us": v} for k, v in results.items()]
        (out_dir / JSON_NAME).write_text(json.dumps(doc, indent=1, default=str))

    def first_check(case, bufs, cfgs, inp, expert_out) -> bool:
        """Compile / warm both packages on first use, then compare their outputs; True on a mismatch."""
        tag = f"R={case[0]} {case[1]} N={case[2]}"
        for lab in (LABELS if args.load_first == "base" else LABELS[::-1]):
            if lab not in first_use:
                log(f"compiling {'baseline' if lab == 'base' else 'new'} kernels (first use; from CuPy's disk cache "
                    f"if precompiled) ...")
                t0 = time.perf_counter()
                rn = Runner(pkgs[lab], bufs[lab], inp, expert_out)
                rn.dispatch(0)
                rn.combine(0)
                bufs[lab].synchronize()
                first_use.add(lab)
                log(f"{lab}: first dispatch + combine done in {time.perf_counter() - t0:.1f} s")
        probs = check_case(pkgs, bufs, cfgs, inp, expert_out, args.seed + case[2])
        checks[case] = "ok" if not probs else "; ".join(probs)
        doc["checks"].append({"ranks": case[0], "format": case[1], "n_tokens": case[2],
                              "status": "ok" if not probs else "MISMATCH", "problems": probs})
        if probs:
            log(f"!!!!!!!! MISMATCH {tag}: base and new differ:\n    " + "\n    ".join(probs))
        else:
            log(f"{tag}: dispatch and combine identical between base and new")
        return bool(probs)

    streams = timing.use_private_streams([dev])
    gate = timing.StartGate([dev]) if args.gate else None
    flusher = timing.L2Flusher([dev])
    failed = False
    try:
        for ranks in args.ranks:
            devices = [dev] * ranks
            groups = {lab: pkgs[lab].init(devices) for lab in LABELS}
            inputs = {n: bcases.make_inputs(devices, n, HIDDEN, TOP_K, N_EXPERTS, n_sets=args.input_sets,
                                            seed=args.seed + 7919 * ranks + n, x_dtype=args.x_dtype)
                      for n in args.tokens}
            for fmt in args.formats:
                cfgs, text = mems[(ranks, fmt)]
                bufs, expert_out, runners, rn = {}, [], None, None

                def close_buffers():
                    for b in bufs.values():
                        try:
                            b.close()
                        except Exception:  # noqa: BLE001
                            pass
                    bufs.clear()
                    cupy.get_default_memory_pool().free_all_blocks()

                try:
                    cupy.get_default_memory_pool().free_all_blocks()
                    free, total = cupy.cuda.runtime.memGetInfo()
                    need = sum(ranks * c.total_bytes for c in cfgs.values()) + \
                        ranks * max(c.capacity for c in cfgs.values()) * HIDDEN * 2
                    log(f"case {text}; GPU free {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
                    doc["memory"].append({"ranks": ranks, "format": fmt, "need_bytes": need, "free_bytes": free,
                                          "total_bytes_per_rank": {lab: c.total_bytes for lab, c in cfgs.items()}})
                    if need > 0.95 * free:
                        raise MemoryError(f"this case needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free: "
                                          f"lower --tokens or --ranks")
                    cap = max(c.capacity for c in cfgs.values())
                    used = max(traffic.expected_rows(ids, N_EXPERTS, r, cfgs["new"].fmt.row_align)
                               for inp in inputs.values() for ids in inp.ids_host for r in range(ranks))
                    gen = cupy.random.default_rng(args.seed + 17)
                    expert_out = [bcases.random_bf16(gen, (cap, HIDDEN), octaves=False, rows=used)
                                  for _ in range(ranks)]
                    for rnd in range(args.rounds):
                        # who is allocated and measured first alternates with the round (--order alternate), so
                        # neither the order inside a round nor the Buffers' placement in memory favours one side
                        order = LABELS if args.order == "base-first" or rnd % 2 == 0 else LABELS[::-1]
                        if rnd == 0 or args.rebuild:
                            close_buffers()
                            for lab in order:
                                bufs[lab] = pkgs[lab].Buffer(groups[lab], cfgs[lab], timeout_s=args.timeout_s)
                        for n in args.tokens:
                            case = (ranks, fmt, n)
                            if rnd == 0:
                                failed |= first_check(case, bufs, cfgs, inputs[n], expert_out)
                            # (the runners hold the last results, which hold the Buffer's memory: dropped below,
                            # so a rebuilt pair can take the other one's place)
                            runners = {lab: Runner(pkgs[lab], bufs[lab], inputs[n], expert_out) for lab in LABELS}
                            for op in args.ops:
                                for lab in order:
                                    rn = runners[lab]
                                    t = timing.measure(getattr(rn, op), [dev], repeats=args.repeats,
                                                       warmup=args.warmup, series=1, modes=modes,
                                                       setup=rn.setup_combine if op == "combine" else None,
                                                       flusher=flusher, gate=gate if gate is not None else False,
                                                       after_series=bufs[lab].check)
                                    for mode in modes:
                                        results.setdefault(case + (op, mode), {l2: [] for l2 in LABELS})[lab].append(
                                            [float(v) for v in t[mode].runs_us[0][0]])
                                        gated[lab] &= t[mode].gated
                                    del t
                            runners = rn = None
                    for n in args.tokens:
                        case = (ranks, fmt, n)
                        rows = [r for r in summarize({k: v for k, v in results.items() if k[:3] == case}, checks,
                                                     args.tol) if r["mode"] == "cold"]
                        log(f"R={ranks} {fmt} N={n} cold: "
                            + "; ".join(f"{r['op']} base {r['base']['median_us']:.2f} new {r['new']['median_us']:.2f}"
                                        f" us ({r['ratio']:.3f}{' ' + r['verdict'] if r['verdict'] else ''})"
                                        for r in rows))
                except Exception as e:  # noqa: BLE001  (record it, go on with the next case)
                    failed = True
                    doc["errors"].append({"ranks": ranks, "format": fmt, "error": f"{type(e).__name__}: {e}"})
                    log(f"!!!!!!!! ERROR R={ranks} {fmt}: {type(e).__name__}: {e}")
                finally:
                    expert_out, runners, rn = [], None, None
                    close_buffers()
                    save()
            for g in groups.values():
                g.close()
            del inputs
            cupy.get_default_memory_pool().free_all_blocks()
    finally:
        if gate is not None:
            gate.close()
        timing.synchronize([dev])
        cupy.cuda.Stream.null.use()
        del streams
        wrong = check_module_origins(base_parent)
        if wrong:
            failed = True
            doc["errors"].append({"error": "modules loaded from the wrong package", "modules": wrong})
            log("!!!!!!!! modules loaded from the wrong package: " + "; ".join(wrong))
        doc["meta"]["gated"] = gated
        save()
        if not args.child:
            report(doc, results, checks, args, out_dir)
    return 1 if failed else 0


def report(doc: dict, results: dict, checks: dict, args, out_dir: Path) -> None:
    """Write the JSON and the table (``ab_baseline.json`` / ``.txt`` in ``out_dir``); print the table last."""
    rows = summarize(results, checks, args.tol)
    doc["samples"] = [{"ranks": k[0], "format": k[1], "n_tokens": k[2], "op": k[3], "mode": k[4], "rounds_us": v}
                      for k, v in results.items()]
    doc["table"] = rows
    (out_dir / JSON_NAME).write_text(json.dumps(doc, indent=1, default=str))
    meta = doc["meta"]
    n_rounds = max((len(v["base"]) for v in results.values()), default=0)
    gated = meta.get("gated", {})
    passes = meta.get("passes")
    header = (f"A/B on {meta.get('device', {}).get('name', '?')}: base {meta['base']} vs new {meta['new']}; "
              f"median CUDA-event us over {n_rounds} rounds"
              + (f" ({len(passes)} processes, kernels loaded base first / new first)" if passes else "")
              + f" x {args.repeats} calls; cold = L2 flushed"
              + ("; x float32" if args.x_dtype == "float32" else "")
              + ("" if all(gated.values()) else " (some measurements ungated)")
              + ("; R > 1: simulated ranks on one GPU" if any(r > 1 for r in args.ranks) else ""))
    table = format_table(rows, header)
    mism = [f"R={k[0]} {k[1]} N={k[2]}: {v}" for k, v in checks.items() if v != "ok"]
    errs = [f"{'R=%s %s: ' % (e['ranks'], e['format']) if 'ranks' in e else ''}{e['error']}" for e in doc["errors"]]
    if mism:
        table += "\nMISMATCH (base and new disagree; these timings are of a wrong kernel):\n  " + "\n  ".join(mism)
    if errs:
        table += "\nERRORS:\n  " + "\n  ".join(errs)
    (out_dir / TEXT_NAME).write_text(table + "\n")
    log(f"wrote {out_dir / JSON_NAME} and {out_dir / TEXT_NAME}")
    print("\n" + table, flush=True)


def merge_docs(docs: list[dict]) -> tuple[dict, dict, dict]:
    """The passes' JSON documents as one: (doc, results, checks); each pass's rounds follow the previous pass's."""
    results: dict = {}
    checks: dict = {}
    out = {"meta": dict(docs[0]["meta"]) if docs else {}, "memory": [], "checks": [], "errors": [], "passes": []}
    gated: dict = {}
    for i, d in enumerate(docs):
        for smp in d.get("samples", []):
            key = (smp["ranks"], smp["format"], smp["n_tokens"], smp["op"], smp["mode"])
            per = results.setdefault(key, {lab: [] for lab in LABELS})
            for lab in LABELS:
                per[lab] += smp["rounds_us"][lab]
        for c in d.get("checks", []):
            key = (c["ranks"], c["format"], c["n_tokens"])
            status = "ok" if c["status"] == "ok" else "; ".join(c["problems"])
            if checks.get(key, "ok") == "ok":
                checks[key] = status
            out["checks"].append(dict(c, **{"pass": i}))
        out["errors"] += [dict(e, **{"pass": i}) for e in d.get("errors", [])]
        out["memory"] += [dict(m, **{"pass": i}) for m in d.get("memory", [])]
        for lab, v in d.get("meta", {}).get("gated", {}).items():
            gated[lab] = gated.get(lab, True) and v
    out["meta"]["gated"] = gated
    return out, results, checks


def child_argv(args, base_parent: Path, base_desc: str, load_first: str, out: Path) -> list[str]:
    """The command line of one pass: this run's settings, one process, kernels of ``load_first`` loaded first."""
    flag = lambda name, on: f"--{name}" if on else f"--no-{name}"  # noqa: E731
    return [sys.executable, str(Path(__file__).resolve()), "--child", "--base-parent", str(base_parent),
            "--base-desc", base_desc, "--formats", *args.formats, "--tokens", *map(str, args.tokens),
            "--ranks", *map(str, args.ranks), "--ops", *args.ops, "--x-dtype", args.x_dtype,
            "--repeats", str(args.repeats),
            "--rounds", str(args.rounds), "--warmup", str(args.warmup), flag("warm", args.warm),
            flag("gate", args.gate), "--input-sets", str(args.input_sets), "--seed", str(args.seed),
            "--tol", str(args.tol), "--timeout-s", str(args.timeout_s), "--device", str(args.device),
            "--order", args.order, flag("rebuild", args.rebuild), "--load-first", load_first, "--passes", "1",
            "--no-precompile", "--out", str(out)]


def run_passes(args, base_parent: Path, base_desc: str) -> int:
    """``--passes`` processes, kernels loaded base first then new first in turn (where a module lands in memory
    moves some cases by 1-3%: one process cannot cancel it), merged into one table."""
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs, status = [], 0
    for i in range(args.passes):
        load_first = LABELS[i % 2]
        pdir = out_dir / f"pass{i}"
        if (pdir / JSON_NAME).exists():
            (pdir / JSON_NAME).unlink()
        log(f"pass {i + 1}/{args.passes} (a fresh process; {load_first} kernels loaded first) ...")
        rc = subprocess.run(child_argv(args, base_parent, base_desc, load_first, pdir), cwd=os.getcwd()).returncode
        status = max(status, rc)
        if (pdir / JSON_NAME).exists():
            docs.append(json.loads((pdir / JSON_NAME).read_text()))
            docs[-1]["meta"]["load_first"] = load_first
        else:
            log(f"!!!!!!!! pass {i + 1} wrote no results (exit status {rc})")
    if not docs:
        return 1
    doc, results, checks = merge_docs(docs)
    doc["meta"]["argv"] = sys.argv[1:]
    doc["meta"]["passes"] = [{"load_first": d["meta"]["load_first"], "dir": str(out_dir / f"pass{i}")}
                             for i, d in enumerate(docs)]
    if len(docs) < args.passes:
        doc["errors"].append({"error": f"only {len(docs)} of {args.passes} passes wrote results"})
    report(doc, results, checks, args, out_dir)
    return 1 if status or doc["errors"] or any(v != "ok" for v in checks.values()) else 0


# ---- the command line ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/ab_baseline.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--base", help="baseline commit (any git revision of this repository), e.g. a60777d")
    src.add_argument("--base-dir", help="baseline cuep package directory (or a folder holding cuep/), no git needed")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS, help="dispatch formats")
    p.add_argument("--tokens", nargs="+", type=int, default=[128, 4096],
                   help="tokens per rank N; max_tokens_per_rank = the largest (default 128 4096)")
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 4],
                   help="ranks per case: 1 real, more simulated on one GPU (default 1 4)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--x-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the dispatched tokens x (float32: the kernels that encode from float32; the same "
                        "values either way)")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per op, package and round (default 30)")
    p.add_argument("--rounds", type=int, default=6, help="alternating base/new rounds per pass; even, so each side "
                                                          "goes first equally often (default 6)")
    p.add_argument("--order", choices=("alternate", "base-first"), default="alternate",
                   help="who is allocated and measured first in a round: alternate (base in even rounds, new in odd "
                        "ones; default) or base-first")
    p.add_argument("--load-first", choices=LABELS, default="base",
                   help="whose kernels are loaded onto the GPU first (default base)")
    p.add_argument("--rebuild", action=argparse.BooleanOptionalAction, default=True,
                   help="new Buffers every round, allocated in the round's order (default on)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before each measurement (default 3)")
    p.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                   help="also time warm (L2 not flushed) calls (default on)")
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=True,
                   help="start gate: launches queue behind a spinning kernel, so host overhead stays out (default on)")
    p.add_argument("--input-sets", type=int, default=2, help="random input sets the calls rotate among (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=0.01, help="ratio margin of the SLOWER / faster verdict (default 0.01)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="Buffer device-side wait timeout (default 10)")
    p.add_argument("--device", type=int, default=0, help="CUDA device (default 0)")
    p.add_argument("--out", default=None, help="output directory (default $OUT if set, else out/ab)")
    p.add_argument("--work-dir", default=None, help="where the baseline is extracted (default <tmp>/cuep_ab)")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile both packages' kernel files in parallel subprocesses first (default on)")
    p.add_argument("--jobs", type=int, default=None, help="precompile processes (default: CPU count)")
    p.add_argument("--passes", type=int, default=2,
                   help="processes the rounds are split over, kernels loaded base first / new first in turn "
                        "(default 2; 1: this process only, --load-first decides)")
    p.add_argument("--dry-run", action="store_true", help="extract and import both packages, print the plan; no GPU")
    # one pass of a multi-process run (child_argv): the baseline already prepared, no table printed
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--base-parent", help=argparse.SUPPRESS)
    p.add_argument("--base-desc", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    args.formats = list(dict.fromkeys(args.formats))
    args.ops = list(dict.fromkeys(args.ops))
    args.tokens = list(dict.fromkeys(args.tokens))
    args.ranks = list(dict.fromkeys(args.ranks))
    if any(n < 1 for n in args.tokens):
        p.error("--tokens must be >= 1")
    if any(not 1 <= r <= 8 or N_EXPERTS % r for r in args.ranks):
        p.error(f"--ranks must be in 1..8 and divide E={N_EXPERTS}")
    if args.repeats < 1 or args.rounds < 1 or args.warmup < 0 or args.input_sets < 1 or args.passes < 1:
        p.error("--repeats, --rounds, --input-sets, --passes must be >= 1 and --warmup >= 0")
    if args.base is None and args.base_dir is None and args.base_parent is None:
        p.error("give the baseline: --base COMMIT or --base-dir PATH")
    if args.out is None:
        args.out = os.environ.get("OUT") or str(Path("out") / "ab")
    args.jobs = args.jobs or os.cpu_count() or 4
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.base_parent is not None:
            base_parent, base_desc = Path(args.base_parent), args.base_desc or args.base_parent
        elif args.base is not None:
            log(f"extracting baseline {args.base} (git archive of {ROOT}) ...")
            base_parent, sha = extract_baseline(args.base, args.work_dir)
            base_desc = f"{args.base} = {sha[:12]}"
        else:
            base_parent, base_desc = copy_base_dir(Path(args.base_dir), args.work_dir)
        base, new = import_packages(base_parent)
        pkgs = {"base": base, "new": new}
        if not args.child:
            log(f"baseline package: {base_parent / BASE_NAME}")
            print(plan_text(args, base_desc, pkgs), flush=True)
        if args.dry_run:
            log("dry run: no GPU touched")
            return 0
        if args.precompile:
            precompile({"base": (base, base_parent), "new": (new, ROOT)}, args.jobs, formats=args.formats)
    except AbError as e:
        print(f"ab_baseline: {e}", file=sys.stderr)
        return 2
    if args.passes > 1 and not args.child:
        return run_passes(args, base_parent, base_desc)
    return run(args, pkgs, base_desc, base_parent)


if __name__ == "__main__":
    sys.exit(main())
