"""``benchmarks/ab_baseline.py`` without a GPU: the baseline's extraction (git archive of HEAD, imports rewritten to
``cuep_base``, importable beside ``cuep``), ``--dry-run``, and the comparison and table code on synthetic data."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "ab_baseline.py"


def _load():
    spec = importlib.util.spec_from_file_location("ab_baseline", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ab = _load()
needs_git = pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                               reason="needs git and the repository's history")


def test_rewrite_source_forms():
    src = ("import cuep\n"
           "    import cuep  # noqa\n"
           "import cuep.bench.cases as cases\n"
           "import cuep.bench\n"
           "from cuep import EPConfig\n"
           "from cuep.bench.timing import measure\n"
           "from . import ep\n"
           "import cuepx\n"
           "import cuep_base\n")
    out = ab.rewrite_source(src)
    assert out.splitlines() == ["import cuep_base as cuep",
                                "    import cuep_base as cuep  # noqa",
                                "import cuep_base.bench.cases as cases",
                                "import cuep_base.bench; import cuep_base as cuep",
                                "from cuep_base import EPConfig",
                                "from cuep_base.bench.timing import measure",
                                "from . import ep",
                                "import cuepx",
                                "import cuep_base"]
    assert ab.absolute_imports(out) == []
    assert ab.absolute_imports("import os, cuep\n") == ["import os, cuep"]
    assert ab.absolute_imports("from cuep.ops import quantize\n")


@needs_git
def test_extract_head_imports_as_cuep_base(tmp_path):
    parent, sha = ab.extract_baseline("HEAD", tmp_path)
    assert len(sha) == 40 and parent == tmp_path / sha
    pkg = parent / ab.BASE_NAME
    assert (pkg / "__init__.py").is_file() and (pkg / "cuda_src").is_dir() and not (parent / "cuep").exists()
    for p in pkg.rglob("*.py"):
        assert ab.absolute_imports(p.read_text()) == [], p
    if "import cuep\n" in (REPO / "cuep" / "bench" / "cases.py").read_text():  # as of this test's writing
        assert "import cuep_base as cuep" in (pkg / "bench" / "cases.py").read_text()
    # reused, not extracted again
    stamp = (parent / "EXTRACTED").stat().st_mtime_ns
    assert ab.extract_baseline(sha, tmp_path) == (parent, sha)
    assert (parent / "EXTRACTED").stat().st_mtime_ns == stamp
    # a fresh interpreter imports it under its new name, never touching the working tree's cuep, and no CUDA
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import cuep_base, cuep_base.bench.cases, "
            "cuep_base.bench.timing\n"
            "assert 'cuep' not in sys.modules, 'imported the working tree'\n"
            "assert cuep_base.__file__.startswith(sys.argv[1])\n"
            "cfg = cuep_base.EPConfig(hidden=7168, top_k=8, n_experts=256, max_tokens_per_rank=128, "
            "n_gpus_per_node=2, dispatch_format='fp8')\n"
            "print(cfg.total_bytes)")
    res = subprocess.run([sys.executable, "-c", code, str(parent)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.strip()) > 0


@needs_git
def test_bad_base_is_a_clear_error(tmp_path):
    with pytest.raises(ab.AbError, match="rev-parse"):
        ab.extract_baseline("no-such-revision-xyz", tmp_path)


def _dry_run(tmp_path, *src):
    cmd = [sys.executable, str(SCRIPT), *src, "--dry-run", "--work-dir", str(tmp_path / "work"),
           "--formats", "bf16", "nvfp4", "--tokens", "128", "512", "--ranks", "1", "2", "--out", str(tmp_path / "o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@needs_git
def test_dry_run(tmp_path):
    out = _dry_run(tmp_path, "--base", "HEAD")
    assert "dry run: no GPU touched" in out
    assert "T = max(--tokens) = 512" in out
    for case in ("R=1 bf16", "R=1 nvfp4", "R=2 bf16", "R=2 nvfp4"):
        assert case in out
    assert "GiB per rank" in out and "timed + warm-up calls" in out
    assert not (tmp_path / "o").exists()  # nothing written by a dry run


@needs_git
def test_dry_run_base_dir(tmp_path):
    parent, _ = ab.extract_baseline("HEAD", tmp_path / "x")
    out = _dry_run(tmp_path, "--base-dir", str(parent / ab.BASE_NAME))
    assert "baseline: dir:" in out and "dry run: no GPU touched" in out


# ---- comparison and table, on the host --------------------------------------------------------------------------
def _side(rng, ro, src_info, tokens, scales, order):
    """One package's rank outputs, rows of each group permuted by ``order``."""
    return {"row_offsets": ro, "expert_ids": np.arange(len(ro) - 1, dtype=np.int32), "scales_offsets": None,
            "src_info": src_info[order], "tokens": tokens[order],
            "scales": None if scales is None else scales[order]}


def test_compare_rank_matches_permuted_rows():
    rng = np.random.default_rng(0)
    ro = np.array([0, 4, 4, 10], np.uint32)
    rows = 10
    si = np.stack([rng.integers(0, 50, rows), rng.integers(0, 8, rows)], axis=1).astype(np.int32)
    si[3] = (-1, -1)  # a padding row
    si[5] = si[6]     # the same (token, k) from two sources: told apart by the bytes
    tok = rng.integers(0, 256, (rows, 36), dtype=np.uint8)
    sc = rng.integers(0, 256, (rows, 7), dtype=np.uint8)  # row bytes not a multiple of 4
    ident = np.arange(rows)
    shuf = np.array([2, 0, 3, 1, 9, 4, 8, 5, 7, 6])  # rows moved only inside their groups
    side = {"base": _side(rng, ro, si, tok, sc, ident), "new": _side(rng, ro, si, tok, sc, shuf)}
    probs, perms = ab.compare_rank(np, side, 0, rows)
    assert probs == []
    np.testing.assert_array_equal(side["base"]["tokens"][perms["base"]], side["new"]["tokens"][perms["new"]])

    bad = {k: dict(v) for k, v in side.items()}
    bad["new"]["tokens"] = bad["new"]["tokens"].copy()
    bad["new"]["tokens"][7, 3] ^= 1
    probs, _ = ab.compare_rank(np, bad, 0, rows)
    assert probs and "rows differ" in probs[0]

    bad = {k: dict(v) for k, v in side.items()}
    bad["new"]["row_offsets"] = np.array([0, 4, 5, 10], np.uint32)
    probs, _ = ab.compare_rank(np, bad, 0, rows)
    assert any("row_offsets differ" in p for p in probs)

    probs, _ = ab.compare_rank(np, side, 1, rows + 2)
    assert any("the routing asks for" in p for p in probs)


def test_rows_differ_and_hash():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (40, 12), dtype=np.uint8)
    b = a.copy()
    b[[3, 17]] ^= 0x10
    assert ab.rows_differ(np, a, b, chunk_bytes=24) == 2
    idx = np.arange(40)[::-1].copy()
    assert ab.rows_differ(np, a, a[idx], idx, np.arange(40)) == 0
    h = ab.row_hash(np, a, 1)
    assert h.dtype == np.uint64 and len(set(h.tolist())) == 40
    np.testing.assert_array_equal(ab.row_hash(np, a, 1, chunk_bytes=64), h)


def test_summary_and_table():
    results = {}
    for n, base, new in ((128, 20.0, 21.0), (4096, 100.0, 100.2)):
        for op in ab.OPS:
            for mode, f in (("cold", 1.0), ("warm", 0.8)):
                results[(1, "bf16", n, op, mode)] = {
                    "base": [[base * f + 0.01 * i for i in range(5)] for _ in range(3)],
                    "new": [[new * f + 0.01 * i for i in range(5)] for _ in range(3)]}
    checks = {(1, "bf16", 128): "ok", (1, "bf16", 4096): "rank 0: 3 of 10 rows differ"}
    rows = ab.summarize(results, checks)
    assert len(rows) == 8
    r = next(x for x in rows if x["n_tokens"] == 128 and x["mode"] == "cold" and x["op"] == "dispatch")
    assert r["ratio"] == pytest.approx(21.02 / 20.02) and r["verdict"] == "SLOWER" and r["check"] == "ok"
    r = next(x for x in rows if x["n_tokens"] == 4096 and x["mode"] == "cold")
    assert r["verdict"] == "" and r["check"].startswith("rank 0")
    text = ab.format_table(rows, "header")
    lines = text.splitlines()
    assert lines[0] == "header" and len(lines) == 3 + 4 + 1
    assert "MISMATCH" in lines[-2] and "SLOWER" in lines[3] and "geometric mean" in lines[-1]


def test_merge_passes():
    def doc(base, new, status, gated):
        return {"meta": {"base": "b", "new": "n", "gated": {"base": gated, "new": True}},
                "samples": [{"ranks": 1, "format": "fp8", "n_tokens": 128, "op": "dispatch", "mode": "cold",
                             "rounds_us": {"base": [[base]], "new": [[new]]}}],
                "checks": [{"ranks": 1, "format": "fp8", "n_tokens": 128, "status": status,
                            "problems": [] if status == "ok" else ["rank 0 row_offsets differ"]}],
                "errors": [], "memory": []}

    merged, results, checks = ab.merge_docs([doc(10.0, 11.0, "ok", True), doc(12.0, 13.0, "MISMATCH", False)])
    assert results[(1, "fp8", 128, "dispatch", "cold")] == {"base": [[10.0], [12.0]], "new": [[11.0], [13.0]]}
    assert checks[(1, "fp8", 128)] == "rank 0 row_offsets differ"
    assert merged["meta"]["gated"] == {"base": False, "new": True}
    assert [c["pass"] for c in merged["checks"]] == [0, 1]


def test_child_argv_round_trips():
    args = ab.parse_args(["--base", "HEAD", "--formats", "fp8", "--tokens", "64", "--ranks", "2", "--no-warm",
                          "--rounds", "2", "--x-dtype", "float32"])
    argv = ab.child_argv(args, Path("/tmp/x"), "HEAD = abc", "new", Path("/tmp/o"))
    child = ab.parse_args(argv[2:])
    assert child.child and child.passes == 1 and child.load_first == "new" and not child.precompile
    assert ab.parse_args(["--base", "HEAD"]).x_dtype == "bfloat16"
    for name in ("formats", "tokens", "ranks", "ops", "x_dtype", "repeats", "rounds", "warmup", "warm", "gate",
                 "input_sets", "seed", "tol", "timeout_s", "device", "order", "rebuild"):
        assert getattr(child, name) == getattr(args, name), name


def test_compile_units_follow_each_packages_loader():
    """This tree's loader compiles dispatch.cu a format at a time (only the formats the run measures); a baseline
    older than parts compiles every file whole."""
    from types import SimpleNamespace

    from cuep import _kernels

    units = ab.compile_units(_kernels, ["fp8"])
    assert ("dispatch.cu", "fp8") in units and ("combine.cu", None) in units
    assert not any(f == "dispatch.cu" and p != "fp8" for f, p in units)
    assert ab.compile_units(_kernels) == _kernels.kernel_units()
    old = SimpleNamespace(kernel_files=lambda: ["combine.cu", "dispatch.cu"])
    assert ab.compile_units(old, ["fp8"]) == [("combine.cu", None), ("dispatch.cu", None)]
