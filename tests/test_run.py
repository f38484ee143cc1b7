"""``python -m cuep.run``, the launcher of one process per rank, on the CPU: tiny scripts as ranks.

Every test is bounded (pytest-timeout), and so is every launcher run (``subprocess.run(timeout=...)``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def launch(tmp_path, body: str, *launcher_args: str, script_args=(), env=None, timeout=60):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(body))
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = str(ROOT)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "cuep.run", *launcher_args, str(script), *script_args], cwd=ROOT,
                         env=e, capture_output=True, text=True, timeout=timeout)
    return res, time.monotonic() - t0


@pytest.mark.timeout(60)
def test_every_rank_runs_with_the_torchrun_variables_and_a_prefix(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS")}
    env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "7"  # set by the user: passed through as it is
    res, _ = launch(tmp_path, """
        import os, sys
        v = os.environ
        print("RANK", v["RANK"], "WORLD", v["WORLD_SIZE"], "LOCAL", v["LOCAL_RANK"], "ADDR", v["MASTER_ADDR"],
              "PORT", v["MASTER_PORT"], "NVLS", v["NCCL_NVLS_ENABLE"], v["NVSHMEM_DISABLE_NVLS"],
              v["TORCH_SYMM_MEM_DISABLE_MULTICAST"], "ARGS", *sys.argv[1:])
        print("err line", file=sys.stderr)
        sys.stdout.write("no newline at the end")
        """, "-n", "3", script_args=["-n", "5", "--flag"], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    ports = set()
    for r in range(3):
        mine = [ln for ln in lines if ln.startswith(f"[rank {r}] ")]
        assert len(mine) == 3, lines
        first = next(ln for ln in mine if "RANK" in ln).split()[2:]  # past "[rank r]"
        assert first[1:8:2] == [str(r), "3", str(r), "127.0.0.1"], first
        assert first[11:14] == ["0", "1", "7"] and first[14:] == ["ARGS", "-n", "5", "--flag"], first
        ports.add(first[9])
        assert f"[rank {r}] err line" in mine and f"[rank {r}] no newline at the end" in mine
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert res.stderr == ""


@pytest.mark.timeout(60)
def test_a_failing_rank_fails_the_launch_fast_with_its_status(tmp_path):
    res, dt = launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("rank 1 fails", flush=True)
            sys.exit(3)
        time.sleep(60)
        """, "-n", "3", "--grace-s", "1")
    assert res.returncode == 3, res.stdout + res.stderr
    assert dt < 20
    assert "[rank 1] rank 1 fails" in res.stdout
    assert "cuep.run: rank 1 exited with status 3; waiting up to 1 s (--grace-s) for ranks 0, 2 to finish" \
        in res.stderr
    assert "cuep.run: ranks 0, 2 still running 1 s after the first failure (--grace-s); stopping them" in res.stderr
    assert ("cuep.run: how every rank ended: rank 0 was killed by SIGTERM (status 143) (stopped by cuep.run); "
            "rank 1 exited with status 3; rank 2 was killed by SIGTERM (status 143) (stopped by cuep.run)") \
        in res.stderr


@pytest.mark.timeout(60)
def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(tmp_path):
    res, _ = launch(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """, "-n", "2", "--grace-s", "0.5")
    assert res.returncode == 128 + 9, res.stdout + res.stderr
    assert "cuep.run: rank 0 was killed by SIGKILL (status 137); waiting up to 0.5 s" in res.stderr


@pytest.mark.timeout(60)
def test_the_other_ranks_finish_on_their_own_within_the_grace_period(tmp_path):
    """A rank dies (SIGKILL); the others notice, clean up and exit 0 by themselves: the launcher names the dead
    rank, waits for them instead of stopping them, and still fails with the dead rank's status."""
    res, _ = launch(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "2":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1.5)
        print("finished", flush=True)
        """, "-n", "3", "--grace-s", "30")
    assert res.returncode == 137, res.stdout + res.stderr
    assert "cuep.run: rank 2 was killed by SIGKILL (status 137); waiting up to 30 s (--grace-s) for ranks 0, 1 " \
           "to finish" in res.stderr
    for r in (0, 1):
        assert f"[rank {r}] finished" in res.stdout
        assert f"cuep.run: rank {r} exited with status 0\n" in res.stderr
    assert "stopping" not in res.stderr and "stopped by" not in res.stderr
    assert ("how every rank ended: rank 0 exited with status 0; rank 1 exited with status 0; rank 2 was killed by "
            "SIGKILL (status 137)") in res.stderr


@pytest.mark.timeout(60)
def test_every_rank_is_reaped(tmp_path):
    """No zombies: after launch() returns, every rank's process has been waited for, the one that died, the one
    that ignores SIGTERM (stopped with SIGKILL) and the one that ends by itself."""
    import io

    from cuep.run import launch as run_launch

    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        rank = os.environ["RANK"]
        if rank == "1":
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(60)
        """))
    procs, out, err = [], io.StringIO(), io.StringIO()
    status = run_launch(3, [sys.executable, str(script)], timeout_s=30, out=out, err=err, grace_s=0.5, procs=procs)
    assert status == 137, err.getvalue()
    assert [p.returncode for p in procs] == [-9, -9, 0], err.getvalue()
    for p in procs:
        with pytest.raises(ChildProcessError):  # already reaped: not a child of this process any more
            os.waitpid(p.pid, os.WNOHANG)


@pytest.mark.timeout(60)
def test_a_failure_in_the_traceback_reaches_the_output(tmp_path):
    res, _ = launch(tmp_path, "raise SystemExit('worker broke: mismatch on rank')\n", "-n", "2")
    assert res.returncode == 1
    assert "worker broke: mismatch on rank" in res.stdout


@pytest.mark.timeout(60)
def test_the_timeout_stops_every_rank_even_one_that_ignores_sigterm(tmp_path):
    res, dt = launch(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("started", flush=True)
        time.sleep(120)
        """, "-n", "2", "--timeout", "1.5")
    assert res.returncode == 124, res.stdout + res.stderr
    assert dt < 20
    assert "cuep.run: timed out after 1.5 s (--timeout); stopping rank(s) 0, 1" in res.stderr
    assert "[rank 0] started" in res.stdout and "[rank 1] started" in res.stdout


@pytest.mark.timeout(60)
def test_the_ranks_meet_through_cueps_store(tmp_path):
    res, _ = launch(tmp_path, """
        from cuep.group import _connect, _launch_env
        env = _launch_env()
        store = _connect(env, timeout_s=20)
        got = store.allgather(f"hello from {env.rank}".encode())
        store.barrier()
        print("|".join(g.decode() for g in got))
        store.close()
        """, "-n", "4")
    assert res.returncode == 0, res.stdout + res.stderr
    want = "|".join(f"hello from {r}" for r in range(4))
    for r in range(4):
        assert f"[rank {r}] {want}" in res.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, match", [
    (["-n", "0"], "-n 0: a node-local cuep group has 1..8 ranks"),
    (["-n", "9"], "-n 9: a node-local cuep group has 1..8 ranks (more ranks need several nodes: --gpus-per-node G)"),
    (["-n", "2", "--timeout", "0"], "--timeout 0 must be positive"),
    (["-n", "2", "--grace-s", "-1"], "--grace-s -1 must not be negative"),
    (["-n", "6", "--gpus-per-node", "4"], "--gpus-per-node 4 must divide -n 6 (nodes of G consecutive ranks)"),
    (["-n", "18", "--gpus-per-node", "9"], "--gpus-per-node 9: a node holds 1..8 ranks"),
    (["-n", "4", "--gpus-per-node", "0"], "--gpus-per-node 0: a node holds 1..8 ranks"),
    (["-n", "0", "--gpus-per-node", "2"], "-n 0: a node-local cuep group has 1..8 ranks"),
    (["-n", "4", "--gpus-per-node", "two"], "argument --gpus-per-node: invalid int value: 'two'"),
])
def test_bad_launcher_arguments(tmp_path, args, match):
    res, _ = launch(tmp_path, "print('never')\n", *args)
    assert res.returncode == 2 and match in res.stderr and "never" not in res.stdout


@pytest.mark.timeout(60)
def test_a_missing_script_is_named(tmp_path):
    res = subprocess.run([sys.executable, "-m", "cuep.run", "-n", "2", str(tmp_path / "nope.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "nope.py" in res.stderr and "not found" in res.stderr


def test_rank_env_of_one_node_or_several():
    from cuep.run import rank_env

    one = rank_env(5, 8, 1234, base={"KEEP": "1", "NCCL_NVLS_ENABLE": "1"})
    assert {k: one[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")} == \
        dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="5", LOCAL_WORLD_SIZE="8", MASTER_PORT="1234")
    assert one["KEEP"] == "1" and one["NCCL_NVLS_ENABLE"] == "1" and one["NVSHMEM_DISABLE_NVLS"] == "1"
    nodes = [rank_env(r, 8, 1234, base={}, gpus_per_node=4) for r in range(8)]
    assert [e["LOCAL_RANK"] for e in nodes] == ["0", "1", "2", "3"] * 2
    assert {e["LOCAL_WORLD_SIZE"] for e in nodes} == {"4"} and {e["WORLD_SIZE"] for e in nodes} == {"8"}
    assert [e["RANK"] for e in nodes] == [str(r) for r in range(8)]
    assert rank_env(2, 3, 1, base={}, gpus_per_node=1)["LOCAL_RANK"] == "0"
    for bad in (3, 0):
        with pytest.raises(ValueError, match=rf"gpus_per_node={bad} must be at least 1 and divide n=8"):
            rank_env(0, 8, 1234, base={}, gpus_per_node=bad)


@pytest.mark.timeout(60)
def test_several_nodes_on_one_host_meet_and_agree_on_the_layout(tmp_path):
    """``-n 10 --gpus-per-node 5``: more than 8 ranks as two nodes; every rank gets its node's local rank and
    size, and the layout decision of init_distributed (from LOCAL_WORLD_SIZE, checked against the hosts it
    all-gathers through cuep's store) says two nodes of five."""
    res, _ = launch(tmp_path, """
        import os, socket
        from cuep.group import _connect, _launch_env, _node_layout
        env = _launch_env()
        store = _connect(env, timeout_s=20)
        hosts = [h.decode() for h in store.allgather(socket.gethostname().encode())]
        g = _node_layout(env.world_size, hosts, None, env.local_world_size)
        print("LOCAL", os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], "G", g, "NODE", env.rank // g)
        store.close()
        """, "-n", "10", "--gpus-per-node", "5")
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(10):
        assert f"[rank {r}] LOCAL {r % 5} 5 G 5 NODE {r // 5}" in res.stdout, res.stdout
