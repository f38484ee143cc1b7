"""Several nodes over NVSHMEM, every PE on GPU 0 (one process each, through the launcher): dispatch/combine against
cuep.reference in every format, and the failure modes.

The node layout is declared (``python -m cuep.run --gpus-per-node G``), so puts to other "nodes" go through NVSHMEM
even though the PEs share one GPU; ranks of one node read each other's memory by load/store. Needs the nvshmem extra
(skipped without it).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuep import nvshmem

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
LAUNCH_TIMEOUT_S = 420

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not nvshmem.available(), reason=nvshmem.INSTALL_HINT),
              pytest.mark.timeout(LAUNCH_TIMEOUT_S + 120)]


def launch(n: int, g: int, worker: str, *args: str, expect_rc: int = 0) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "cuep.run", "-n", str(n), "--gpus-per-node", str(g), "--timeout",
           str(LAUNCH_TIMEOUT_S), str(HERE / worker), "--device", "0", *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S + 60)
    out = res.stdout + res.stderr
    assert res.returncode == expect_rc, f"{' '.join(cmd)} exited {res.returncode}:\n{out[-20000:]}"
    return out


def _passed(out: str, n: int) -> None:
    for r in range(n):
        assert f"[rank {r}] PASS" in out, f"rank {r} did not finish:\n{out[-20000:]}"


@pytest.mark.parametrize("n,g,formats", [(2, 1, "bf16,fp8,nvfp4,mxfp4"), (4, 2, "bf16,fp8,nvfp4,mxfp4"),
                                         (6, 2, "bf16,nvfp4")], ids=["2x1", "2x2", "3x2"])
def test_nodes_match_the_reference(n, g, formats):
    """Random and skewed routing, a node sending nothing, a full rank, every call style, reset mid-way."""
    _passed(launch(n, g, "internode_worker.py", "--formats", formats, "--rounds", "5"), n)


def test_nodes_moe_layer():
    """cuep.moe.moe_forward across 2 nodes x 2 GPUs, every format, against the dense NumPy layer."""
    _passed(launch(4, 2, "internode_worker.py", "--formats", "", "--moe"), 4)


@pytest.mark.parametrize("small", [0, 256], ids=["two-hop", "direct"])
def test_nodes_large_rounds_and_graph_replay(small):
    """N = max tokens = 256 all two-hop (small_batch_tokens 0) or all direct, and dispatch + combine captured in a
    CUDA graph and replayed with fresh inputs."""
    _passed(launch(4, 2, "internode_worker.py", "--formats", "fp8", "--rounds", "3", "--tokens", "256",
                   "--small", str(small), "--graph"), 4)


def test_missing_peer_is_a_timeout_error():
    """Rank 3 never sends: every other rank's wait ends in cuep.EPError (timeout) naming a peer, no hang."""
    out = launch(4, 2, "internode_worker.py", "--missing-peer", "3")
    for r in range(3):
        assert f"[rank {r}] EPError" in out and "timeout" in out, out[-20000:]
    _passed(out, 4)
