"""One process per rank (CUDA IPC), through the launcher: dispatch/combine against cuep.reference.

Each test starts ``python -m cuep.run -n N tests/ipc_worker.py``; every rank checks its own outputs and the
launcher fails if any rank does. `gpu`: all ranks share GPU 0 (the phase-by-phase mode with host barriers,
:attr:`cuep.Group.phase_barrier`). `multigpu`: one rank per GPU (the fused kernels, as in production).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import N_GPUS

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "ipc_worker.py"
LAUNCH_TIMEOUT_S = 600


def launch(n: int, *worker_args: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "cuep.run", "-n", str(n), "--timeout", str(LAUNCH_TIMEOUT_S), str(WORKER),
           *worker_args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S + 60)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}:\n{out[-20000:]}"
    for r in range(n):
        assert f"[rank {r}] PASS" in res.stdout, f"rank {r} did not finish:\n{out[-20000:]}"
    return out


@pytest.mark.gpu
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 120)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_ipc_ranks_sharing_one_gpu(n):
    launch(n, "--device", "0", "--expect-phase-barrier", str(int(n > 1)), "--formats", "bf16,fp8")


@pytest.mark.gpu
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 120)
def test_ipc_block_scaled_formats_sharing_one_gpu():
    launch(2, "--device", "0", "--formats", "nvfp4,mxfp4", "--rounds", "4")


@pytest.mark.multigpu
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 120)
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs")
def test_ipc_one_rank_per_gpu():
    """n = min(4, GPUs) ranks, LOCAL_RANK -> GPU (the default device): the fused single-launch path."""
    launch(min(4, N_GPUS), "--expect-phase-barrier", "0", "--formats", "bf16,fp8,nvfp4,mxfp4")
