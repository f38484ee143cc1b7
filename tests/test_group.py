"""The rendezvous of one process per GPU, on the CPU: cuep's TCP store, the launcher variables, the local group.

Store tests start real processes (multiprocessing, spawn) that talk over localhost; every one is bounded by a
timeout, and the failures they provoke must name the rank or variable at fault.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time

import pytest

import cuep
from cuep.group import Group, _default_device, _launch_env, _LaunchEnv, _node_layout, _Store
from cuep.run import free_port
from conftest import N_GPUS

SPAWN = mp.get_context("spawn")


# ---- processes (top level, so spawn can import them) -----------------------------------------------------------
def _payload(rank: int, i: int) -> bytes:
    return [f"rank {rank}".encode(), b"", bytes([rank]) * (1 << 20) + b"end", b"x" * rank][i % 4]


def _digests(n: int, i: int) -> list[str]:
    return [hashlib.sha256(_payload(r, i)).hexdigest() for r in range(n)]


def _script_rank(rank, n, port, timeout_s, steps, q):
    """One rank of an ``n``-rank store running ``steps`` in order; reports one entry per all-gather.

    Steps: ``("gather", timeout_s or None)`` (an all-gather of :func:`_payload`), ``("sleep", s)``, ``("kill",)``
    (SIGKILL itself: it reports nothing), ``("close",)``. An all-gather's entry is ``("ok", digests)`` or
    ``(exception type, message, .rank, .reason)``.
    """
    try:
        store = _Store(rank, n, "127.0.0.1", port, timeout_s)
    except Exception as e:  # noqa: BLE001 (the parent asserts on the type and message)
        q.put((rank, [(type(e).__name__, str(e), None, None)]))
        return
    log, i = [], 0
    for step in steps:
        if step[0] == "sleep":
            time.sleep(step[1])
        elif step[0] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif step[0] == "close":
            store.close()
        else:
            i += 1
            try:
                got = store.allgather(_payload(rank, i), step[1])
                log.append(("ok", [hashlib.sha256(g).hexdigest() for g in got]))
            except Exception as e:  # noqa: BLE001
                log.append((type(e).__name__, str(e), getattr(e, "rank", None), getattr(e, "reason", None)))
    store.close()
    q.put((rank, log))


def run_script(n, steps, timeout_s=20.0, wait_s=60.0):
    """Start the ranks of ``steps`` ({rank: steps}) of an ``n``-rank store; {rank: log} of the ranks that report
    (a rank that kills itself does not; a rank missing from ``steps`` is never started)."""
    port = free_port()
    q = SPAWN.Queue()
    procs = {r: SPAWN.Process(target=_script_rank, args=(r, n, port, timeout_s, st, q)) for r, st in steps.items()}
    for p in procs.values():
        p.start()
    want = [r for r, st in steps.items() if ("kill",) not in st]
    out = {}
    try:
        deadline = time.monotonic() + wait_s
        while len(out) < len(want):
            rank, log = q.get(timeout=max(0.1, deadline - time.monotonic()))
            out[rank] = log
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return out


def gathers(k, timeout_s=None):
    return [("gather", timeout_s)] * k


# ---- the store -------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 4])
def test_store_allgather_across_processes(n):
    out = run_script(n, {r: gathers(5) for r in range(n)})
    for r in range(n):
        assert out[r] == [("ok", _digests(n, i)) for i in range(1, 6)], f"rank {r}: {out[r]}"


@pytest.mark.timeout(60)
def test_store_names_the_rank_that_never_connected():
    out = run_script(3, {0: gathers(1), 1: gathers(2)}, timeout_s=1.5)
    assert out[0][0][0] == "TimeoutError" and "rank 2 never connected" in out[0][0][1], out[0]
    assert "WORLD_SIZE=3" in out[0][0][1]
    # rank 1 was connected: rank 0 tells it whom the group misses, and the group stays failed
    for entry in out[1]:
        assert entry[0] == "EPError" and "rank 2 never connected" in entry[1] and entry[2:] == (2, "timeout"), out[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [1, 2])
def test_store_names_the_rank_that_died_mid_collective_on_every_rank(victim):
    """A peer dies while the others wait in an all-gather (rank 0 waits on every peer at once, so the other
    survivor hears of the death from rank 0 and names the dead rank, not rank 0); every later collective raises
    at once, naming it."""
    late = 3 - victim  # the other peer arrives after the death: it reads the verdict that was left for it
    steps = {0: gathers(3), victim: gathers(1) + [("sleep", 0.5), ("kill",)],
             late: gathers(1) + [("sleep", 2.0)] + gathers(2)}
    out = run_script(3, steps, timeout_s=30)
    for r in (0, late):
        assert out[r][0] == ("ok", _digests(3, 1)), out[r]
        for entry in out[r][1:]:
            assert entry[0] == "EPError" and entry[2:] == (victim, "died"), (r, out[r])
            assert f"rank {victim} closed its connection" in entry[1] and "cannot go on" in entry[1], entry


@pytest.mark.timeout(60)
def test_store_names_the_rank_that_closed_its_connection():
    out = run_script(3, {0: gathers(2), 1: gathers(2), 2: [("close",)]}, timeout_s=30)
    for r in (0, 1):
        assert [e[2:] for e in out[r]] == [(2, "died")] * 2, out[r]
        assert "rank 2 closed its connection" in out[r][0][1]


@pytest.mark.timeout(60)
def test_store_names_rank_0_when_it_dies():
    steps = {0: gathers(1) + [("sleep", 0.3), ("kill",)], 1: gathers(3), 2: gathers(3)}
    out = run_script(3, steps, timeout_s=30)
    for r in (1, 2):
        assert out[r][0] == ("ok", _digests(3, 1))
        assert [e[2:] for e in out[r][1:]] == [(0, "died")] * 2, out[r]
        assert "rank 0 closed its connection" in out[r][1][1]


@pytest.mark.timeout(60)
def test_store_survives_a_rank_that_is_late_for_a_collective():
    """Rank 1 stops calling for longer than the timeout: rank 0 and rank 2 raise naming it; rank 1 reaches the
    failed all-gather late and gets the same failure (its number is spent on every rank); the next all-gathers
    work on every rank."""
    steps = {0: gathers(1) + gathers(1, 1.0) + gathers(2), 2: gathers(1) + gathers(1, 1.0) + gathers(2),
             1: gathers(1) + [("sleep", 3.0)] + gathers(1, 1.0) + gathers(2)}
    out = run_script(3, steps, timeout_s=20)
    for r in range(3):
        log = out[r]
        assert log[0] == ("ok", _digests(3, 1)), (r, log)
        kind, msg, rank, reason = log[1]
        assert (kind, rank, reason) == ("EPError", 1, "timeout"), (r, log[1])
        assert "all-gather #2 failed: rank 1 did not reach it within 1 s" in msg and "timeout_s=1" in msg, msg
        assert "Buffer.reset()" in msg
        assert log[2:] == [("ok", _digests(3, 3)), ("ok", _digests(3, 4))], (r, log)


@pytest.mark.timeout(60)
def test_store_survives_rank_0_being_late():
    """Rank 0 itself stops calling: the others give up after the timeout (plus the grace for rank 0's verdict),
    naming rank 0, and tell it; rank 0 reaches the collective late and fails it too, naming itself."""
    steps = {0: gathers(1) + [("sleep", 3.0)] + gathers(1, 1.0) + gathers(2),
             1: gathers(1) + gathers(1, 1.0) + gathers(2), 2: gathers(1) + gathers(1, 1.0) + gathers(2)}
    out = run_script(3, steps, timeout_s=20)
    for r in range(3):
        log = out[r]
        assert log[0] == ("ok", _digests(3, 1)), (r, log)
        assert log[1][0] == "EPError" and log[1][2:] == (0, "timeout"), (r, log[1])
        assert "rank 0 did not" in log[1][1], log[1]
        assert log[2:] == [("ok", _digests(3, 3)), ("ok", _digests(3, 4))], (r, log)


@pytest.mark.timeout(60)
def test_store_names_every_rank_that_is_missing():
    steps = {0: gathers(1, 1.0) + gathers(1), 1: gathers(1, 1.0) + gathers(1),
             2: [("sleep", 2.5)] + gathers(1, 1.0) + gathers(1), 3: [("sleep", 2.5)] + gathers(1, 1.0) + gathers(1)}
    out = run_script(4, steps, timeout_s=20)
    for r in range(4):
        kind, msg, rank, reason = out[r][0]
        assert (kind, rank, reason) == ("EPError", 2, "timeout") and "ranks 2, 3 did not reach it" in msg, out[r]
        assert out[r][1] == ("ok", _digests(4, 2))


def test_ep_error_keeps_its_attributes_through_pickling():
    import pickle

    e = cuep.EPError("rank 1: barrier #3 failed", ranks=[2, 3], reason="timeout")
    assert isinstance(e, RuntimeError) and (e.rank, e.ranks, e.reason) == (2, (2, 3), "timeout")
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.rank, back.ranks, back.reason) == (str(e), 2, (2, 3), "timeout")
    assert cuep.EPError("bad routing", reason="invalid").rank is None
    assert cuep.buffer.EPError is cuep.EPError


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
    assert _launch_env({**TORCH, "LOCAL_WORLD_SIZE": "2"}).local_world_size == 2
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='two' is not an integer"):
        _launch_env({**TORCH, "LOCAL_WORLD_SIZE": "two"})
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
    for k, v in {**TORCH, "RANK": "0", "WORLD_SIZE": "12"}.items():
        monkeypatch.setenv(k, v)
    # a declared layout needs no peer: it is checked before any GPU or connection
    with pytest.raises(ValueError, match=r"gpus_per_node=5 must divide the world size 12"):
        cuep.init_distributed(gpus_per_node=5)
    with pytest.raises(ValueError, match=r"gpus_per_node=12 exceeds 8 \(MAX_RANKS"):
        cuep.init_distributed(gpus_per_node=12)
    with pytest.raises(ValueError, match=r"gpus_per_node=0 must be at least 1"):
        cuep.init_distributed(gpus_per_node=0)
    with pytest.raises(TypeError, match=r"gpus_per_node='4' must be an int"):
        cuep.init_distributed(gpus_per_node="4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=0 must be at least 1"):
        cuep.init_distributed()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
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
    def __init__(self, fail=None):
        self.calls, self.timeouts, self.closed, self.fail = [], [], False, fail

    def allgather(self, data, timeout_s=None):
        self.calls.append(data)
        return [data, data]

    def barrier(self, timeout_s=None):
        self.calls.append("barrier")
        self.timeouts.append(timeout_s)
        if self.fail is not None:
            raise self.fail

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
        self.timeout_s = 2.5


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


def _fake_cupy(monkeypatch):
    """Just enough of CuPy for the phase-barrier path of ep._before_launch (a stream sync) on a CPU machine."""
    import contextlib
    import types

    syncs = []
    stream = types.SimpleNamespace(synchronize=lambda: syncs.append(1))
    cuda = types.SimpleNamespace(Device=lambda dev: contextlib.nullcontext(), get_current_stream=lambda: stream)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return syncs


def test_phase_barriers_are_bounded_by_the_buffer_timeout_after_the_first(monkeypatch):
    """Ranks sharing a GPU meet before every phase: the first barrier of a kernel file waits as long as the
    rendezvous (a peer may still compile), the later ones, inside rounds, only the buffer's timeout_s."""
    from cuep.ep import _before_launch

    syncs = _fake_cupy(monkeypatch)
    comm = _FakeComm()
    shared = _FakeBuffer(Group(devices=[0], ranks=[1], n_ranks=2, kind="ipc", phase_barrier=True, _comm=comm))
    for source in ("dispatch.cu", "dispatch.cu", "dispatch.cu", "combine.cu", "combine.cu"):
        _before_launch(shared, source)
    assert comm.timeouts == [None, 2.5, 2.5, None, 2.5] and len(syncs) == 5


def test_a_failed_round_barrier_marks_the_buffer_failed(monkeypatch):
    from cuep.ep import _before_launch

    _fake_cupy(monkeypatch)
    err = cuep.EPError("rank 1: barrier #7 failed: rank 2 closed its connection", rank=2, reason="died")
    shared = _FakeBuffer(Group(devices=[0], ranks=[1], n_ranks=3, kind="ipc", phase_barrier=True,
                               _comm=_FakeComm(fail=err)))
    with pytest.raises(cuep.EPError) as got:
        _before_launch(shared, "dispatch.cu")
    assert got.value is err and shared._host_error is err  # Buffer.check refuses rounds until reset()


def test_buffer_check_refuses_rounds_after_a_host_side_failure():
    """Buffer.check on a buffer whose round barrier failed (built without a GPU: only the state check needs)."""
    buf = cuep.Buffer.__new__(cuep.Buffer)
    buf.group = Group(devices=[0], ranks=[1], n_ranks=3, kind="ipc", _comm=_FakeComm())
    buf._ranks = []
    buf.check()
    buf._host_error = cuep.EPError("rank 1: barrier #7 failed: rank 2 did not reach it", rank=2, reason="timeout")
    with pytest.raises(cuep.EPError, match=r"rank 1: a round on this buffer failed \(rank 1: barrier #7 .*reset\(\)") \
            as got:
        buf.check()
    assert (got.value.rank, got.value.reason) == (2, "timeout")


# ---- torch.distributed's store (a stand-in with the same set / wait / get / check / delete_key) ----------------
class _KVStore:
    """A thread-safe stand-in for a torch.distributed store (torch is not needed on the CPU)."""

    def __init__(self):
        self.data, self.cv = {}, threading.Condition()

    def set(self, key, value):
        with self.cv:
            self.data[key] = bytes(value)
            self.cv.notify_all()

    def get(self, key):
        with self.cv:
            return self.data[key]

    def check(self, keys):
        with self.cv:
            return all(k in self.data for k in keys)

    def wait(self, keys, timeout):
        with self.cv:
            if not self.cv.wait_for(lambda: all(k in self.data for k in keys), timeout.total_seconds()):
                raise RuntimeError("Wait timeout")

    def delete_key(self, key):
        with self.cv:
            return self.data.pop(key, None) is not None


def _torch_store_ranks(n, plan):
    """Run ``plan(rank, store)`` on ``n`` threads over one _KVStore; {rank: list of outcomes}."""
    from cuep.group import _TorchStore

    kv = _KVStore()
    out = {}

    def body(rank):
        store = _TorchStore(kv, rank, n, timeout_s=20)
        out[rank] = plan(rank, store)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(out) == n, out
    return out, kv


def _try(fn):
    try:
        return ("ok", fn())
    except cuep.EPError as e:
        return ("EPError", e.rank, e.reason, str(e))


@pytest.mark.timeout(60)
def test_torch_store_allgather_and_cleanup():
    def plan(rank, store):
        return [store.allgather(_payload(rank, i)) for i in range(1, 5)] + [store.barrier()]

    out, kv = _torch_store_ranks(3, plan)
    for r in range(3):
        assert out[r][:4] == [[_payload(q, i) for q in range(3)] for i in range(1, 5)]
    assert all(k.startswith("cuep/") for k in kv.data)
    assert sorted(kv.data) == [f"cuep/5/{r}" for r in range(3)]  # only the last collective's keys are left


@pytest.mark.timeout(60)
def test_torch_store_names_a_rank_that_did_not_arrive_and_goes_on():
    def plan(rank, store):
        log = [_try(lambda: store.allgather(_payload(rank, 1)))]
        if rank == 1:
            time.sleep(2.0)  # stops calling for longer than the timeout
        log.append(_try(lambda: store.allgather(_payload(rank, 2), timeout_s=0.5)))
        log.append(_try(lambda: store.allgather(_payload(rank, 3))))
        return log

    out, _ = _torch_store_ranks(3, plan)
    for r in range(3):
        assert out[r][0] == ("ok", [_payload(q, 1) for q in range(3)])
        assert out[r][1][:3] == ("EPError", 1, "timeout") and "rank 1 did not reach it" in out[r][1][3], out[r]
        assert out[r][2] == ("ok", [_payload(q, 3) for q in range(3)])


def test_init_distributed_takes_torch_distributed_only_when_initialised(monkeypatch):
    """Without torch imported, "auto" never looks for it (and never imports it); "torch" says what is missing."""
    from cuep.group import _torch_distributed

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert _torch_distributed() is None and "torch" not in sys.modules
    with pytest.raises(RuntimeError, match=r"rendezvous='torch' needs an initialised torch.distributed"):
        cuep.init_distributed(rendezvous="torch")
    with pytest.raises(ValueError, match=r"rendezvous='nccl' must be one of 'auto', 'torch', 'env'"):
        cuep.init_distributed(rendezvous="nccl")
    import types

    dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(distributed=dist))
    assert _torch_distributed() is None
    dist.is_initialized = lambda: True
    assert _torch_distributed() is dist


# ---- the node layout -------------------------------------------------------------------------------------------
def test_group_layout_defaults_to_one_node():
    g = Group(devices=[0, 1, 2], ranks=[0, 1, 2], n_ranks=3)
    assert (g.gpus_per_node, g.n_nodes, g.node) == (3, 1, 0)
    assert g.node_ranks() == g.node_ranks(0) == [0, 1, 2] and [g.node_of(r) for r in range(3)] == [0, 0, 0]
    assert "gpus_per_node" not in repr(g)
    ipc = Group(devices=[0], ranks=[3], n_ranks=4, kind="ipc", _comm=_FakeComm())
    assert (ipc.gpus_per_node, ipc.n_nodes, ipc.node, ipc.node_ranks()) == (4, 1, 0, [0, 1, 2, 3])


@pytest.mark.parametrize("rank, node, mine", [(0, 0, [0, 1, 2, 3]), (5, 1, [4, 5, 6, 7]), (11, 2, [8, 9, 10, 11])])
def test_group_layout_of_several_nodes(rank, node, mine):
    g = Group(devices=[0], ranks=[rank], n_ranks=12, kind="ipc", gpus_per_node=4, _comm=_FakeComm())
    assert (g.gpus_per_node, g.n_nodes, g.node) == (4, 3, node)
    assert g.node_ranks() == mine
    assert [g.node_ranks(k) for k in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [g.node_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert "gpus_per_node=4" in repr(g)


def test_group_layout_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"gpus_per_node=3 must be at least 1 and divide n_ranks=8"):
        Group(devices=[0], ranks=[0], n_ranks=8, kind="ipc", gpus_per_node=3)
    with pytest.raises(ValueError, match=r"gpus_per_node=0 must be at least 1"):
        Group(devices=[0], ranks=[0], n_ranks=8, kind="ipc", gpus_per_node=0)
    with pytest.raises(TypeError, match=r"gpus_per_node=True must be an int"):
        Group(devices=[0], ranks=[0], n_ranks=2, kind="ipc", gpus_per_node=True)
    with pytest.raises(ValueError, match=r"gpus_per_node=1: a group of kind 'local' is one process, so one node"):
        Group(devices=[0, 0], ranks=[0, 1], n_ranks=2, gpus_per_node=1)
    g = Group(devices=[0], ranks=[1], n_ranks=4, kind="ipc", gpus_per_node=2, _comm=_FakeComm())
    with pytest.raises(ValueError, match=r"rank=4 must be an int in 0..3 \(n_ranks=4\)"):
        g.node_of(4)
    with pytest.raises(ValueError, match=r"rank=-1 must be"):
        g.node_of(-1)
    with pytest.raises(ValueError, match=r"node=2 must be an int in 0..1 \(n_nodes=2\)"):
        g.node_ranks(2)
    with pytest.raises(ValueError, match=r"node=True must be"):
        g.node_ranks(True)


class _RankComm(_FakeComm):
    """An all-gather as rank ``rank`` of ``n`` sees it: its own data at its index, ``others[r]`` elsewhere."""

    def __init__(self, rank, others):
        super().__init__()
        self.rank, self.others = rank, list(others)

    def allgather(self, data, timeout_s=None):
        self.calls.append(data)
        self.timeouts.append(timeout_s)
        return [data if r == self.rank else o for r, o in enumerate(self.others)]


def test_broadcast_sends_only_the_roots_bytes():
    root = Group(devices=[0], ranks=[1], n_ranks=3, kind="ipc", _comm=_RankComm(1, [b"", b"", b""]))
    assert root.broadcast(b"config", root=1, timeout_s=4.0) == b"config"
    assert root._comm.calls == [b"config"] and root._comm.timeouts == [4.0]
    other = Group(devices=[0], ranks=[2], n_ranks=3, kind="ipc", _comm=_RankComm(2, [b"zero", b"", b""]))
    assert other.broadcast(b"ignored") == b"zero"
    assert other._comm.calls == [b""]  # a non-root's bytes never travel
    local = Group(devices=[0, 0], ranks=[0, 1], n_ranks=2)
    assert local.broadcast(bytearray(b"abc"), root=1) == b"abc"
    for bad in (3, -1, True, "0"):
        with pytest.raises(ValueError, match=rf"root={bad!r} must be an int in 0..2 \(n_ranks=3\)"):
            other.broadcast(b"", root=bad)
    other.close()
    with pytest.raises(RuntimeError, match="closed"):
        other.broadcast(b"")


def _fake_ipc_cupy(monkeypatch):
    """Just enough of CuPy's runtime for Group.share_buffers / release_buffers (kind "ipc") on the CPU."""
    import contextlib
    import types

    log = {"opened": [], "closed": []}

    def open_handle(handle, flags):
        log["opened"].append(handle)
        return 0x9000 + handle[0]

    rt = types.SimpleNamespace(ipcGetMemHandle=lambda ptr: bytes([ptr >> 12]) * 64, ipcOpenMemHandle=open_handle,
                               ipcCloseMemHandle=lambda ptr: log["closed"].append(ptr))
    cuda = types.SimpleNamespace(Device=lambda dev: contextlib.nullcontext(), runtime=rt)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return log


@pytest.mark.parametrize("gpus_per_node, want", [(4, [0x9001, 0x9002, 0x3000, 0x9004]),  # one node: every peer
                                                 (2, [0, 0, 0x3000, 0x9004])])           # two: this node only
def test_share_buffers_opens_only_the_handles_of_this_node(monkeypatch, gpus_per_node, want):
    log = _fake_ipc_cupy(monkeypatch)
    handles = [bytes([k]) * 64 for k in (1, 2, 3, 4)]  # rank r's handle names 0x9000 + r + 1 once opened
    comm = _RankComm(2, handles)
    g = Group(devices=[0], ranks=[2], n_ranks=4, kind="ipc", gpus_per_node=gpus_per_node, _comm=comm)
    bases = g.share_buffers([_Mem(0x3000)])
    assert bases == want
    assert comm.calls == [bytes([3]) * 64]  # the all-gather is collective over the whole group either way
    assert log["opened"] == [h for r, h in enumerate(handles) if r != 2 and g.node_of(r) == g.node]
    g.release_buffers(bases)
    assert sorted(log["closed"]) == sorted(b for r, b in enumerate(want) if r != 2 and b)


@pytest.mark.parametrize("world, hosts, declared, lws, g", [
    (1, ["a"], None, None, 1),
    (4, ["a"] * 4, None, None, 4),                       # one host: one node
    (8, ["a"] * 8, None, None, 8),
    (16, ["a"] * 8 + ["b"] * 8, None, None, 8),          # more than 8 ranks as two nodes
    (6, ["a", "a", "b", "b", "c", "c"], None, None, 2),
    (4, ["a"] * 4, None, 2, 2),                          # the launcher says two nodes of two (cuep.run)
    (4, ["a"] * 4, 1, 2, 1),                             # the argument wins over the launcher
    (4, ["a"] * 4, 4, 2, 4),
    (16, ["a"] * 16, 8, None, 8),                        # declared: two nodes on one host
    (8, ["a"] * 4 + ["b"] * 4, 2, None, 2),              # a host may hold several nodes
    (8, ["a"] * 4 + ["b"] * 4, None, 8, 4),              # a LOCAL_WORLD_SIZE that spans hosts: the hosts decide
    (6, ["a"] * 6, None, 4, 6),                          # one that does not divide: the hosts decide
    (4, ["a", "a", "b", "b"], None, 2, 2),
    (4, ["a"] * 4, None, 4, 4),
])
def test_node_layout(world, hosts, declared, lws, g):
    assert _node_layout(world, hosts, declared, lws) == g


@pytest.mark.parametrize("world, hosts, declared, lws, exc, match", [
    (8, ["a"] * 8, 3, None, ValueError, r"gpus_per_node=3 must divide the world size 8"),
    (8, ["a"] * 8, 0, None, ValueError, r"gpus_per_node=0 must be at least 1"),
    (16, ["a"] * 16, 16, None, ValueError, r"gpus_per_node=16 exceeds 8 \(MAX_RANKS, the NVLink domain"),
    (4, ["a"] * 4, 2.0, None, TypeError, r"gpus_per_node=2.0 must be an int"),
    (4, ["a"] * 4, True, None, TypeError, r"gpus_per_node=True must be an int"),
    (9, ["a"] * 9, None, None, ValueError, r"WORLD_SIZE=9: one host runs 9 ranks, one node, and a node holds at "
                                           r"most 8 ranks .*gpus_per_node=G.*--gpus-per-node"),
    (9, ["a"] * 9, None, 9, ValueError, r"LOCAL_WORLD_SIZE=9 exceeds 8"),
    (32, ["a"] * 16 + ["b"] * 16, None, None, ValueError, r"each of 2 hosts runs 16 ranks, one node"),
    (4, ["a", "b", "a", "b"], None, None, ValueError, r"the ranks of host a \(0, 2\) are not consecutive: .*each "
                                                      r"host must run one consecutive block of ranks"),
    (6, ["a"] * 4 + ["b"] * 2, None, None, ValueError, r"the hosts run different numbers of ranks \(a: ranks 0..3, "
                                                       r"b: ranks 4..5\)"),
    (4, ["a"] * 3 + ["b"], 2, None, ValueError, r"gpus_per_node=2 puts ranks 2..3 \(node 1\) on hosts a, b: a node "
                                                r"may not span hosts \(CUDA IPC does not cross them\); the hosts run "
                                                r"a: ranks 0..2, b: rank 3"),
    (8, ["a"] * 4 + ["b"] * 4, 8, None, ValueError, r"gpus_per_node=8 puts ranks 0..7 \(node 0\) on hosts a, b"),
    (3, ["a"] * 2, None, None, ValueError, r"hosts has 2 entries for 3 ranks"),
])
def test_node_layout_errors_name_the_source_and_the_rule(world, hosts, declared, lws, exc, match):
    with pytest.raises(exc, match=match):
        _node_layout(world, hosts, declared, lws)


# ---- init_distributed end to end on the CPU: CuPy, the GPU check and the rendezvous are stand-ins ---------------
def _fake_init(monkeypatch, rank, hosts, *, buses=None, declared=None, lws=None, env_lws=None):
    """Run ``init_distributed`` as ``rank`` of ``len(hosts)`` on the CPU: the peers' all-gather entries come from
    ``hosts``, ``buses`` (PCI bus ids, default all one), ``declared`` (each rank's gpus_per_node, default this
    rank's) and ``lws`` (each rank's LOCAL_WORLD_SIZE, default this rank's)."""
    import json
    import types

    import cuep.group as cg

    world = len(hosts)
    for v in ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "CUEP_STORE_PORT", "LOCAL_WORLD_SIZE"]:
        monkeypatch.delenv(v, raising=False)
    for k, v in {**TORCH, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    if env_lws is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(env_lws))
    runtime = types.SimpleNamespace(deviceGetPCIBusId=lambda dev: "0000:1B:00.0")
    cuda = types.SimpleNamespace(Device=lambda dev: types.SimpleNamespace(use=lambda: None), runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(cg, "_require_gpu", lambda what: 1)
    comm = _FakeComm()

    def allgather(data, timeout_s=None):
        mine = json.loads(data)
        out = []
        for r in range(world):
            p = dict(mine, host=hosts[r], bus=(buses or ["0000:1b:00.0"] * world)[r])
            if declared is not None:
                p["gpus_per_node"] = declared[r]
            if lws is not None:
                p["local_world_size"] = lws[r]
            out.append(json.dumps(p).encode())
        return out

    comm.allgather = allgather
    monkeypatch.setattr(cg, "_connect", lambda env, timeout_s, dist: comm)
    return comm


@pytest.mark.parametrize("hosts, kw, g, phase_barrier", [
    (["a"] * 4, dict(env_lws=2), 2, True),                              # cuep.run --gpus-per-node 2 on one GPU
    (["a"] * 4, dict(gpus_per_node=1), 1, True),
    (["a"] * 4, dict(env_lws=4, buses=["0", "1", "2", "3"]), 4, False),  # one node of four GPUs
    (["a"] * 8 + ["b"] * 8, dict(buses=[str(i % 8) for i in range(16)]), 8, False),  # bus ids repeat across hosts
    (["a"] * 8 + ["b"] * 8, dict(env_lws=8, buses=[str(i % 8) for i in range(16)]), 8, False),
    (["a"] * 4, dict(env_lws=2, lws=[2, 2, 1, 2]), 4, True),  # the hint differs between ranks: the hosts decide
])
def test_init_distributed_takes_the_layout(monkeypatch, hosts, kw, g, phase_barrier):
    buses = kw.pop("buses", None)
    lws = kw.pop("lws", None)
    env_lws = kw.pop("env_lws", None)
    rank = len(hosts) - 1
    comm = _fake_init(monkeypatch, rank, hosts, buses=buses, lws=lws, env_lws=env_lws)
    group = cuep.init_distributed(rendezvous="env", **kw)
    assert (group.kind, group.ranks, group.n_ranks, group.gpus_per_node) == ("ipc", [rank], len(hosts), g)
    assert group.n_nodes == len(hosts) // g and group.node == rank // g
    assert group.phase_barrier is phase_barrier
    group.close()
    assert comm.closed


@pytest.mark.parametrize("hosts, kw, match", [
    (["a"] * 9, {}, r"WORLD_SIZE=9: one host runs 9 ranks, one node"),
    (["a", "b", "a", "b"], {}, r"the ranks of host a \(0, 2\) are not consecutive"),
    (["a", "a", "b", "b"], dict(gpus_per_node=4), r"gpus_per_node=4 puts ranks 0..3 \(node 0\) on hosts a, b"),
    (["a"] * 4, dict(gpus_per_node=2, declared=[2, 2, 1, 2]),
     r"gpus_per_node differs between ranks \(rank 0: 2, rank 2: 1\); every rank must pass the same"),
])
def test_init_distributed_refuses_a_bad_layout_and_closes_the_rendezvous(monkeypatch, hosts, kw, match):
    comm = _fake_init(monkeypatch, 1, hosts, declared=kw.pop("declared", None))
    with pytest.raises(ValueError, match=match):
        cuep.init_distributed(rendezvous="env", **kw)
    assert comm.closed
