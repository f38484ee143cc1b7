"""Faults with one process per rank: a rank killed or hung in the middle of a round, a device-side timeout, and
the rendezvous through an initialised torch.distributed.

Each multi-process test starts ``python -m cuep.run -n 3 tests/fault_worker.py`` with every rank on GPU 0 (the
phase-by-phase mode with host barriers) and a 2 s buffer timeout; the launcher and every subprocess are bounded.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cuep
from ep_check import run_round

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "fault_worker.py"
LAUNCH_TIMEOUT_S = 150


def launch(n: int, *worker_args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    # --grace-s well past the survivors' timeouts: they must finish on their own, never be stopped
    cmd = [sys.executable, "-m", "cuep.run", "-n", str(n), "--timeout", str(LAUNCH_TIMEOUT_S), "--grace-s", "60",
           str(WORKER), *worker_args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S + 30)


def _out(res) -> str:
    return f"exit {res.returncode}\n{res.stdout[-20000:]}\n{res.stderr[-5000:]}"


@pytest.mark.gpu
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("victim", [2, 0])
def test_a_rank_killed_mid_round_is_named_by_every_other_rank(victim):
    """The victim SIGKILLs itself between dispatch_async and dispatch_wait: the others raise cuep.EPError naming it
    (reason "died"), close buffer and group (no IPC mapping left) and exit 0; the launcher names the dead rank and
    exits with its status."""
    res = launch(3, "--mode", "kill", "--victim", str(victim))
    out = _out(res)
    assert res.returncode == 128 + 9, out
    assert f"cuep.run: rank {victim} was killed by SIGKILL (status 137)" in res.stderr, out
    assert f"[rank {victim}] VICTIM rank {victim}: SIGKILL now" in res.stdout, out
    for r in {0, 1, 2} - {victim}:
        assert f"[rank {r}] FAULT rank {r}: EPError rank={victim} reason=died" in res.stdout, out
        assert f"[rank {r}] CLOSED rank {r}" in res.stdout and f"[rank {r}] PASS" in res.stdout, out
        assert f"cuep.run: rank {r} exited with status 0" in res.stderr, out
    assert "stopped by cuep.run" not in res.stderr, out


@pytest.mark.gpu
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_that_stops_calling_is_named_and_the_group_recovers(victim):
    """The victim sleeps for three timeouts mid-round: every rank (the victim too, arriving late) raises
    cuep.EPError naming it (reason "timeout"); the buffer refuses rounds until reset(), and after reset() on every
    rank rounds are bit-exact against the reference again."""
    res = launch(3, "--mode", "hang", "--victim", str(victim))
    out = _out(res)
    assert res.returncode == 0, out
    for r in range(3):
        assert f"[rank {r}] FAULT rank {r}: EPError rank={victim} reason=timeout" in res.stdout, out
        assert f"[rank {r}] rank {r}: 3 rounds after reset() match the reference" in res.stdout, out
        assert f"[rank {r}] PASS" in res.stdout, out


@pytest.mark.gpu
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_init_distributed_reuses_torch_distributed():
    pytest.importorskip("torch")
    res = launch(2, "--mode", "torch")
    out = _out(res)
    assert res.returncode == 0, out
    for r in range(2):
        assert f"[rank {r}] Group(kind='ipc', n_ranks=2" in res.stdout and "rendezvous=_TorchStore" in res.stdout, out
        assert f"[rank {r}] rank {r}: 3 rounds through torch.distributed's store match the reference" in res.stdout
        assert f"[rank {r}] PASS" in res.stdout, out


@pytest.mark.gpu
def test_a_device_timeout_refuses_every_call_until_reset(rng):
    """One process, two ranks on GPU 0: only rank 0's send half runs, its wait for rank 1 times out on the device.
    The error names rank 1 (``.rank``, reason "timeout"); every call refuses to run until reset(); then rounds
    are exact again."""
    from test_ep_gpu import rank0_alone

    cfg, buf, gx, gids = rank0_alone(0, 3, rng)
    with pytest.raises(cuep.EPError, match="timed out.*rank 1") as got:
        buf.check()
    assert (got.value.rank, got.value.reason) == (1, "timeout")
    for call in (lambda: cuep.dispatch(buf, gx, gids), lambda: cuep.dispatch_async(buf, gx, gids),
                 buf.synchronize):
        with pytest.raises(cuep.EPError, match="rank 1"):
            call()
    buf.reset()
    buf.check()
    for n in ([16, 16], [3, 16]):
        run_round(buf, cfg, rng, n)
