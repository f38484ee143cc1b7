"""``benchmarks/trace_local.py`` without a GPU: its trace points (both rounds') still find their anchors in the
current one-rank dispatch source (with --items too), a missing anchor is named, and the traced copy compiles for
sm_90 like the runtime's kernels."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cuep import _kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace_local():
    spec = importlib.util.spec_from_file_location("trace_local", ROOT / "benchmarks" / "trace_local.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("items", [False, True], ids=["points", "with_item_warps"])
def test_every_point_lands_once(trace_local, items):
    src = (ROOT / "cuep" / trace_local.TRACED_FILE).read_text()
    out = trace_local.traced_source(src, items)
    small = trace_local.small_points(items)
    for i, point in enumerate(small):  # thread 0's points, or (warp-) every warp's lane 0's
        macro = {"warp": "CUEP_TW", "team": "CUEP_TPT"}.get(point[3].split("-")[0], "CUEP_TP")
        assert out.count(f"{macro}({i});") == 1, point[0]
    for i in range(len(trace_local.LARGE_POINTS)):
        assert out.count(f"CUEP_TP({trace_local.LARGE_BASE + i});") == 1, trace_local.LARGE_POINTS[i][0]
    assert len(small) <= trace_local.LARGE_BASE  # the two rounds' slots do not overlap
    assert trace_local.LARGE_BASE + len(trace_local.LARGE_POINTS) <= trace_local.SLOTS
    n_points = len(small) + len(trace_local.LARGE_POINTS)
    assert out.count("CUEP_TP(") + out.count("CUEP_TPT(") + out.count("CUEP_TW(") == n_points + 3  # (+ the macros)
    assert out.count("cuep_trace_local[") == 4  # declared once, written by each macro
    # the product's source is not touched
    assert "CUEP_TP" not in (ROOT / "cuep" / trace_local.TRACED_FILE).read_text()


def test_a_missing_anchor_is_named(trace_local):
    src = (ROOT / "cuep" / trace_local.TRACED_FILE).read_text()
    name, _, anchor = trace_local.POINTS[3][:3]
    with pytest.raises(ValueError, match=f"trace point '{name}': its anchor occurs 0 times"):
        trace_local.traced_source(src.replace(anchor, anchor.replace("Team::sync()", "__syncwarp()")))


def test_dry_run_builds_the_copy(trace_local, tmp_path, capsys):
    assert trace_local.main(["--dry-run", "--work-dir", str(tmp_path)]) == 0
    traced = (tmp_path / "cuep" / trace_local.TRACED_FILE).read_text()
    n_points = len(trace_local.POINTS) + len(trace_local.LARGE_POINTS)
    assert traced.count("CUEP_TP(") + traced.count("CUEP_TPT(") == n_points + 2
    assert traced.count("CUEP_TW(") == 1  # (defined; warp points only with --items)
    listed = capsys.readouterr().out
    assert all(p[0] in listed for p in trace_local.POINTS + trace_local.LARGE_POINTS)


def test_traced_copy_compiles_for_sm90(trace_local, tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc not found: CI must compile the traced copy (install the CUDA 13 toolkit)")
        pytest.skip("nvcc not found")
    pkg = trace_local.build(tmp_path, items=True)  # (every point: thread 0's and the warp points)
    src_dir = str(_kernels.SRC_DIR)
    cmd = [a.replace(src_dir, str(pkg / "cuda_src")) for a in _kernels.nvcc_command("dispatch.cu",
                                                                                     out=str(tmp_path / "k.cubin"))]
    cmd[0] = nvcc
    assert str(pkg / "cuda_src" / "dispatch.cu") in cmd
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
