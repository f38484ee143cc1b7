"""The rendezvous of one process per GPU, on the CPU: cuep's TCP store, the launcher variables, the local group.

Store tests start real processes (multiprocessing, spawn) that talk over localhost; every one is bounded by a
timeout, and the failures they provoke must name the rank or variable at fault.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import socket
import threading
import time

import pytest

import cuep
from cuep.group import Group, _default_device, _launch_env, _LaunchEnv, _Store
from cuep.run import free_port
from conftest import N_GPUS

SPAWN = mp.get_context("spawn")


# ---- processes (top level, so spawn can import them) -----------------------------------------------------------
def _payload(rank: int, i: int) -> bytes:
    return [f"rank {rank}".encode(), b"", bytes([rank]) * (1 << 20) + b"end", b"x" * rank][i % 4]


def _store_rank(rank, n, port, timeout_s, rounds, leave_after_connect, idle_s, q):
    """One rank: connect, ``rounds`` all-gathers each followed by a barrier; report the result or the error."""
    try:
        store = _Store(rank, n, "127.0.0.1", port, timeout_s)
        if leave_after_connect:
            store.close()
            q.put((rank, "left", ""))
            return
        time.sleep(idle_s)
        digests = []
        for i in range(rounds):
            got = store.allgather(_payload(rank, i))
            digests.append([hashlib.sha256(g).hexdigest() for g in got])
            store.barrier()
        store.close()
        q.put((rank, "ok", digests))
    except Exception as e:  # noqa: BLE001 (the parent asserts on the type and message)
        q.put((rank, type(e).__name__, str(e)))


def run_ranks(n, ranks, timeout_s=20.0, rounds=4, leave=(), idle=None, wait_s=60.0):
    """Start ``ranks`` of an ``n``-rank store; return {rank: (outcome, detail)}."""
    port = free_port()
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=_store_rank, args=(r, n, port, timeout_s, rounds, r in leave,
                                                     (idle or {}).get(r, 0.0), q)) for r in ranks]
    for p in procs:
        p.start()
    out = {}
    try:
        deadline = time.monotonic() + wait_s
        while len(out) < len(procs):
            rank, outcome, detail = q.get(timeout=max(0.1, deadline - time.monotonic()))
            out[rank] = (outcome, detail)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return out


# ---- the store -------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 4])
def test_store_allgather_and_barrier_across_processes(n):
    out = run_ranks(n, range(n))
    want = [[hashlib.sha256(_payload(r, i)).hexdigest() for r in range(n)] for i in range(4)]
    for r in range(n):
        assert out[r] == ("ok", want), f"rank {r}: {out[r]}"


@pytest.mark.timeout(60)
def test_store_names_the_rank_that_never_connected():
    out = run_ranks(3, [0, 1], timeout_s=1.5)
    assert out[0][0] == "TimeoutError" and "rank 2 never connected" in out[0][1], out[0]
    assert "WORLD_SIZE=3" in out[0][1]
    # rank 1 was connected and waiting: rank 0 drops it at once rather than letting it wait out its own clock
    assert out[1][0] == "ConnectionError" and "rank 0 closed its connection" in out[1][1], out[1]


@pytest.mark.timeout(60)
def test_store_names_the_rank_that_left():
    out = run_ranks(3, range(3), timeout_s=20, leave={2})
    assert out[2][0] == "left"
    assert out[0][0] == "ConnectionError" and "rank 2 closed its connection" in out[0][1], out[0]
    assert out[1][0] == "ConnectionError" and "rank 0" in out[1][1], out[1]


@pytest.mark.timeout(60)
def test_store_names_the_rank_that_is_late_for_a_collective():
    out = run_ranks(3, range(3), timeout_s=1.5, idle={1: 3.0})
    assert out[0][0] == "TimeoutError" and "rank 1 to reach all-gather #1" in out[0][1], out[0]
    assert "timeout_s=1.5" in out[0][1]


@pytest.mark.timeout(30)
def test_store_without_rank_0_times_out_naming_the_address():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"rank 1: could not reach rank 0's rendezvous at 127.0.0.1:{port}"):
        _Store(1, 2, "127.0.0.1", port, timeout_s=1.0)
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(30)
def test_store_of_one_rank_needs_no_network():
    s = _Store(0, 1, "no-such-host.invalid", 1, timeout_s=0.1)
    assert s.allgather(b"abc") == [b"abc"]
    s.barrier()
    s.close()


@pytest.mark.timeout(30)
def test_store_rejects_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"rank 0 cannot serve cuep's rendezvous on 127.0.0.1:{port}"):
            _Store(0, 2, "127.0.0.1", port, timeout_s=1.0)


@pytest.mark.timeout(30)
def test_store_refuses_a_stranger_at_the_port():
    """Something else listens there (torchrun's own store, say): a clear error, not a hang."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]

        def answer():
            conn, _ = srv.accept()
            conn.recv(64)
            conn.sendall(b"HTTP")
            time.sleep(1)
            conn.close()

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(RuntimeError, match="not cuep's rank 0"):
            _Store(1, 2, "127.0.0.1", port, timeout_s=5.0)


# ---- launcher variables ----------------------------------------------------------------------------------------
TORCH = dict(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def test_env_torchrun_variables():
    assert _launch_env(TORCH) == _LaunchEnv(1, 4, 1, "tcp", "127.0.0.1", 29500)
    no_local = {k: v for k, v in TORCH.items() if k != "LOCAL_RANK"}
    assert _launch_env(no_local).local_rank == 1  # one node: the rank


def test_env_store_port_beside_torchruns_agent_store_or_as_told():
    assert _launch_env({**TORCH, "TORCHELASTIC_USE_AGENT_STORE": "True"}).port == 29501
    assert _launch_env({**TORCH, "TORCHELASTIC_USE_AGENT_STORE": "False"}).port == 29500
    assert _launch_env({**TORCH, "TORCHELASTIC_USE_AGENT_STORE": "True", "CUEP_STORE_PORT": "4000"}).port == 4000


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_env_names_the_missing_variable(missing):
    env = {k: v for k, v in TORCH.items() if k != missing}
    with pytest.raises(ValueError, match=rf"environment variable {missing} is not set.*cuep.run"):
        _launch_env(env)


def test_env_without_any_launcher():
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set.*python -m cuep.run"):
        _launch_env({"PATH": "/usr/bin"})


@pytest.mark.parametrize("change, match", [
    ({"RANK": "one"}, r"RANK='one' is not an integer"),
    ({"WORLD_SIZE": "2.5"}, r"WORLD_SIZE='2.5' is not an integer"),
    ({"RANK": "4"}, r"RANK=4 must be in 0..3 \(WORLD_SIZE=4\)"),
    ({"RANK": "-1"}, r"RANK=-1 must be in 0..3"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, r"WORLD_SIZE=0 must be at least 1"),
    ({"LOCAL_RANK": "-2"}, r"LOCAL_RANK=-2 must not be negative"),
    ({"MASTER_PORT": "70000"}, r"MASTER_PORT='70000' is not a TCP port"),
    ({"CUEP_STORE_PORT": "0"}, r"CUEP_STORE_PORT='0' is not a TCP port"),
    ({"MASTER_ADDR": " "}, r"MASTER_ADDR is empty"),
])
def test_env_names_the_malformed_variable(change, match):
    with pytest.raises(ValueError, match=match):
        _launch_env({**TORCH, **change})


def test_env_mpirun():
    ompi = dict(OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="2")
    assert _launch_env(ompi) == _LaunchEnv(2, 4, 2, "mpi")
    assert _launch_env(dict(PMI_RANK="3", PMI_SIZE="4")) == _LaunchEnv(3, 4, 3, "mpi")
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_RANK=5 must be in 0..3 \(OMPI_COMM_WORLD_SIZE=4\)"):
        _launch_env({**ompi, "OMPI_COMM_WORLD_RANK": "5"})
    # the torchrun-style variables win when all of them are there (a script that exports them under mpirun)
    assert _launch_env({**ompi, **TORCH}).backend == "tcp"
    # ...but a partial set does not hide mpirun's
    assert _launch_env({**ompi, "RANK": "2"}).backend == "mpi"


def test_default_device_wraps_ranks_onto_the_visible_gpus():
    assert [_default_device(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    assert _default_device(3, 8) == 3


def test_init_distributed_checks_the_environment_first(monkeypatch):
    for v in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"):
        cuep.init_distributed()
    for k, v in {**TORCH, "RANK": "0", "WORLD_SIZE": "9"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="WORLD_SIZE=9: a node-local group holds at most 8 ranks"):
        cuep.init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="timeout_s"):
        cuep.init_distributed(timeout_s=0)


@pytest.mark.skipif(N_GPUS > 0, reason="checks the no-GPU message")
def test_init_distributed_without_a_gpu_says_so(monkeypatch):
    for k, v in {**TORCH, "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match="cuep.init_distributed needs an NVIDIA GPU"):
        cuep.init_distributed()


# ---- the group's transport seam ----------------------------------------------------------------------------------
class _Mem:
    def __init__(self, ptr):
        self.ptr = ptr


def test_local_group_transport_is_trivial():
    g = Group(devices=[0, 0, 1], ranks=[0, 1, 2], n_ranks=3)
    assert g.allgather(b"cfg") == [b"cfg"]
    g.barrier()
    assert g.share_buffers([_Mem(0x1000), _Mem(0x2000), _Mem(0x3000)]) == [0x1000, 0x2000, 0x3000]
    with pytest.raises(ValueError, match="share_buffers got 2 allocation"):
        g.share_buffers([_Mem(1), _Mem(2)])
    g.release_buffers([0x1000])
    g.close()
    assert not g.phase_barrier and g.shares_devices


class _FakeComm:
    def __init__(self):
        self.calls, self.closed = [], False

    def allgather(self, data):
        self.calls.append(data)
        return [data, data]

    def barrier(self):
        self.calls.append("barrier")

    def close(self):
        self.closed = True


def test_ipc_group_delegates_to_its_rendezvous_and_refuses_use_after_close():
    comm = _FakeComm()
    g = Group(devices=[0], ranks=[1], n_ranks=2, kind="ipc", phase_barrier=True, _comm=comm)
    assert g.allgather(b"x") == [b"x", b"x"]
    g.barrier()
    assert comm.calls == [b"x", "barrier"]
    assert "phase_barrier=True" in repr(g)
    g.close()
    g.close()  # idempotent
    assert comm.closed
    with pytest.raises(RuntimeError, match="closed"):
        g.barrier()


# ---- launch ordering (cuep.ep) -------------------------------------------------------------------------------
class _FakeBuffer:
    def __init__(self, group):
        self.group, self._ranks, self._launched = group, [object()] * group.n_local, set()


def test_launch_order_fused_or_phase_by_phase():
    from cuep.ep import PHASE_NOTIFY as N, PHASE_RECV as V, PHASE_SEND as S, _before_launch, _launch_order

    every = N | S | V
    multi_gpu = _FakeBuffer(Group(devices=[0, 1], ranks=[0, 1], n_ranks=2))
    assert _launch_order(multi_gpu, every) == [(0, every), (1, every)]
    one_gpu = _FakeBuffer(Group(devices=[0, 0], ranks=[0, 1], n_ranks=2))
    assert _launch_order(one_gpu, every) == [(0, N), (1, N), (0, S), (1, S), (0, V), (1, V)]
    assert _launch_order(one_gpu, N | S) == [(0, N), (1, N), (0, S), (1, S)]
    # one process per rank on its own GPU: the fused kernel; on a shared GPU: one launch per phase
    comm = _FakeComm()
    ipc = _FakeBuffer(Group(devices=[0], ranks=[1], n_ranks=2, kind="ipc", _comm=comm))
    assert _launch_order(ipc, every) == [(0, every)]
    shared = _FakeBuffer(Group(devices=[0], ranks=[1], n_ranks=2, kind="ipc", phase_barrier=True, _comm=comm))
    assert _launch_order(shared, every) == [(0, N), (0, S), (0, V)]
    assert _launch_order(shared, V) == [(0, V)]
    # fused IPC: one barrier per kernel file, after its first compile, none afterwards
    _before_launch(ipc, "dispatch.cu")
    _before_launch(ipc, "dispatch.cu")
    _before_launch(ipc, "combine.cu")
    assert comm.calls == ["barrier", "barrier"]
    _before_launch(multi_gpu, "dispatch.cu")  # one process: nothing to wait for
    assert comm.calls == ["barrier", "barrier"]
