"""Who the ranks are and how they reach each other's memory.

Two ways to run, one set of kernels:

* one process driving all local GPUs (:func:`init`, the Jupyter way): peer access between every pair of devices,
  and every call takes and returns one array per rank;
* one process per GPU (:func:`init_distributed`, started by ``python -m cuep.run``, torchrun or mpirun): each
  process drives one rank, and the symmetric buffers are shared through ``cudaIpcGetMemHandle`` /
  ``cudaIpcOpenMemHandle``.

A group may also place several ranks on one device (``init(devices=[0, 0, 0, 0])``): the kernels then run rank by
rank on one stream. That is for testing the multi-rank protocol on a single GPU, not for speed. The same holds
for one process per rank when several processes share a GPU (see :attr:`Group.phase_barrier`).

Rendezvous (how the processes of an IPC group find each other and swap their 64-byte memory handles):

* started by mpirun (``OMPI_COMM_WORLD_*`` or ``PMI_*`` set, no torchrun variables): ``mpi4py``'s
  ``allgather``, as established EP libraries do. It needs an MPI runtime and mpi4py, which a machine started
  through mpirun has.
* otherwise the torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
  and :class:`_Store`, a small TCP all-gather written with the standard library (``socket`` + ``struct``), so
  ``python -m cuep.run`` needs nothing installed. ``cupyx.distributed`` has a store too, but it is private API;
  torch's ``TCPStore`` would make torch a dependency.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import time
from dataclasses import dataclass, field

MAX_RANKS = 8


@dataclass
class Group:
    """The ranks of an expert-parallel group as seen from this process.

    Attributes:
        devices: CUDA device of each rank this process drives (one entry per local rank).
        ranks: global rank of each local rank.
        n_ranks: ranks in the whole group.
        kind: ``"local"`` (one process drives every rank) or ``"ipc"`` (one process per rank).
        phase_barrier: IPC ranks share a physical GPU (tests only): every phase of a round is a separate launch,
            and before each one the process synchronises its stream and waits at a host barrier for every rank.
            A fused kernel would spin waiting for a peer process's kernel, which without MPS may not run beside
            it on the same GPU. Host synchronisation makes this mode unusable inside a CUDA graph capture.
    """

    devices: list[int]
    ranks: list[int]
    n_ranks: int
    kind: str = "local"
    phase_barrier: bool = False
    _comm: object = field(default=None, repr=False)          # _Store or _MpiComm (kind "ipc")
    _opened: dict = field(default_factory=dict, repr=False)  # IPC-mapped peer pointer -> device
    _closed: bool = field(default=False, repr=False)

    @property
    def shares_devices(self) -> bool:
        """Several ranks of this process on one device (the protocol then runs rank by rank, phase by phase)."""
        return len(set(self.devices)) < len(self.devices)

    @property
    def n_local(self) -> int:
        return len(self.devices)

    # ---- the transport: what Buffer needs from the processes of the group -----------------------------------
    def allgather(self, data: bytes) -> list[bytes]:
        """Every process's ``data``, in process order (for kind ``"ipc"`` the index is the global rank).

        Collective: every process of the group must call it. Kind ``"local"`` has one process: ``[data]``.
        """
        if self.kind == "local":
            return [bytes(data)]
        self._check_open()
        return self._comm.allgather(bytes(data))

    def barrier(self) -> None:
        """Return once every process of the group has called it (kind ``"local"``: at once)."""
        if self.kind != "local":
            self._check_open()
            self._comm.barrier()

    def share_buffers(self, mems: list) -> list[int]:
        """Base address of every rank's symmetric allocation as this process sees it (index = global rank).

        Args:
            mems: this process's ``cupy.cuda.Memory`` allocations, one per local rank (direct ``cudaMalloc``s:
                an IPC handle names the base of an allocation, never a sub-allocation of CuPy's pool).

        Kind ``"local"``: the pointers themselves (peer access is enabled). Kind ``"ipc"``: collective; the
        64-byte ``cudaIpcGetMemHandle`` of this rank's allocation is all-gathered and every peer's is opened
        with ``cudaIpcOpenMemHandle`` (lazy peer access). Release them with :meth:`release_buffers`.
        """
        if len(mems) != self.n_local:
            raise ValueError(f"share_buffers got {len(mems)} allocation(s); this process drives {self.n_local} "
                             f"rank(s), one allocation each")
        if self.kind == "local":
            bases = [0] * self.n_ranks
            for rank, mem in zip(self.ranks, mems):
                bases[rank] = int(mem.ptr)
            return bases
        import cupy

        self._check_open()
        rt = cupy.cuda.runtime
        me, dev, own = self.ranks[0], self.devices[0], int(mems[0].ptr)
        with cupy.cuda.Device(dev):
            handles = self.allgather(rt.ipcGetMemHandle(own))
            bases, opened = [], []
            try:
                for rank, handle in enumerate(handles):
                    if rank == me:
                        bases.append(own)
                        continue
                    ptr = int(rt.ipcOpenMemHandle(handle, 1))  # cudaIpcMemLazyEnablePeerAccess
                    opened.append(ptr)
                    bases.append(ptr)
            except Exception:
                for ptr in opened:
                    rt.ipcCloseMemHandle(ptr)
                raise
        self._opened.update({ptr: dev for ptr in opened})
        return bases

    def release_buffers(self, bases: list[int]) -> None:
        """Close the peer mappings :meth:`share_buffers` opened for ``bases`` (own memory is the caller's)."""
        if not self._opened:
            return
        import cupy

        for ptr in bases:
            dev = self._opened.pop(int(ptr), None)
            if dev is not None:
                with cupy.cuda.Device(dev):
                    cupy.cuda.runtime.ipcCloseMemHandle(int(ptr))

    def close(self) -> None:
        """Close every peer mapping still open and the rendezvous connections. Not collective; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.release_buffers(list(self._opened))
        finally:
            if self._comm is not None:
                self._comm.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this cuep group was closed (group.close())")

    def __repr__(self) -> str:
        extra = ", phase_barrier=True" if self.phase_barrier else ""
        return f"Group(kind={self.kind!r}, n_ranks={self.n_ranks}, ranks={self.ranks}, devices={self.devices}{extra})"


# ---- one process, all GPUs ---------------------------------------------------------------------------------
def _enable_peer_access(devices: list[int]) -> None:
    import cupy

    rt = cupy.cuda.runtime
    distinct = sorted(set(devices))
    for a in distinct:
        for b in distinct:
            if a == b:
                continue
            if not rt.deviceCanAccessPeer(a, b):
                raise RuntimeError(f"GPU {a} cannot access GPU {b} directly (no NVLink/PCIe peer path); cuep's "
                                   f"single-process mode needs peer access between every pair of devices")
            with cupy.cuda.Device(a):
                try:
                    rt.deviceEnablePeerAccess(b)
                except rt.CUDARuntimeError as e:  # already enabled is fine
                    if "PeerAccessAlreadyEnabled" not in str(e) and "already" not in str(e).lower():
                        raise


def _require_gpu(what: str) -> int:
    import cupy

    if not cupy.cuda.is_available():
        raise RuntimeError(f"{what} needs an NVIDIA GPU and driver; none is visible (cupy.cuda.is_available() is "
                           "False). cuep.reference runs the same contract on the CPU.")
    return cupy.cuda.runtime.getDeviceCount()


def init(devices: list[int] | None = None) -> Group:
    """A group of one rank per device, all driven by this process (peer access enabled between every pair).

    Args:
        devices: CUDA device ids, rank i on ``devices[i]``; default all visible devices. Repeating a device puts
            several ranks on it (protocol testing on one GPU).

    Raises:
        RuntimeError: no GPU, or a pair of devices without peer access.
        ValueError: an empty list, more than 8 ranks, or an unknown device id.
    """
    if devices is not None:
        if isinstance(devices, (int, str)) or not hasattr(devices, "__iter__"):
            raise TypeError(f"devices must be a list of CUDA device ids, e.g. [0, 1] (or None for all GPUs), got "
                            f"{devices!r}")
        devices = list(devices)
        if any(isinstance(d, bool) or not hasattr(d, "__index__") for d in devices):
            raise TypeError(f"devices={devices!r} must hold int CUDA device ids, e.g. [0, 1]")
    n_dev = _require_gpu("cuep.init")
    if devices is None:
        devices = list(range(n_dev))
    devices = [int(d) for d in devices]
    if not devices:
        raise ValueError("devices must name at least one GPU")
    if len(devices) > MAX_RANKS:
        raise ValueError(f"devices has {len(devices)} entries; a node-local group holds at most {MAX_RANKS} ranks")
    bad = [d for d in devices if not 0 <= d < n_dev]
    if bad:
        raise ValueError(f"devices {bad} do not exist: {n_dev} GPU(s) are visible (ids 0..{n_dev - 1})")
    _enable_peer_access(devices)
    return Group(devices=devices, ranks=list(range(len(devices))), n_ranks=len(devices), kind="local")


# ---- one process per GPU -----------------------------------------------------------------------------------
_TORCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_MPI_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))
_MPI_LOCAL_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
_HOW = ("start one process per GPU with `python -m cuep.run -n N script.py` (or torchrun, which sets RANK, "
        "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; or mpirun with mpi4py installed)")


@dataclass(frozen=True)
class _LaunchEnv:
    """What the launcher told this process (see :func:`_launch_env`)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str           # "tcp" (cuep's store) or "mpi" (mpi4py)
    addr: str | None = None
    port: int | None = None


def _int_var(env, name: str) -> int:
    value = env.get(name)
    if value is None:
        raise ValueError(f"environment variable {name} is not set; {_HOW}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _launch_env(env=None) -> _LaunchEnv:
    """Read rank, world size, local rank and the rendezvous address from the launcher's environment variables.

    torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``) win when
    all four of the first are set: cuep's TCP store. Otherwise mpirun's (``OMPI_COMM_WORLD_RANK``/``SIZE``/
    ``LOCAL_RANK``, or ``PMI_RANK``/``PMI_SIZE``): mpi4py. ``LOCAL_RANK`` defaults to the rank (one node).
    The store listens on ``MASTER_PORT``, unless ``CUEP_STORE_PORT`` names another port; under torchrun's agent
    store (``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun already serves ``MASTER_PORT``) on ``MASTER_PORT + 1``.

    Raises:
        ValueError: naming the variable that is missing or malformed.
    """
    env = os.environ if env is None else env
    mpi = next((pair for pair in _MPI_VARS if pair[0] in env and pair[1] in env), None)
    if all(v in env for v in _TORCH_VARS) or mpi is None:
        missing = [v for v in _TORCH_VARS if v not in env]
        if missing:
            raise ValueError(f"environment variable{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                             f"{'are' if len(missing) > 1 else 'is'} not set: cuep.init_distributed finds the "
                             f"other ranks through them; {_HOW}")
        rank, world = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        local = _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        addr = env["MASTER_ADDR"].strip()
        if not addr:
            raise ValueError("environment variable MASTER_ADDR is empty; it must name rank 0's host")
        if "CUEP_STORE_PORT" in env:
            port_var, port = "CUEP_STORE_PORT", _int_var(env, "CUEP_STORE_PORT")
        else:
            port_var, port = "MASTER_PORT", _int_var(env, "MASTER_PORT")
            if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                port += 1
        if not 1 <= port <= 65535:
            raise ValueError(f"environment variable {port_var}={env[port_var]!r} is not a TCP port (1..65535)")
        out = _LaunchEnv(rank, world, local, "tcp", addr, port)
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    else:
        rank, world = _int_var(env, mpi[0]), _int_var(env, mpi[1])
        local_var = next((v for v in _MPI_LOCAL_VARS if v in env), None)
        local = _int_var(env, local_var) if local_var else rank
        out = _LaunchEnv(rank, world, local, "mpi")
        names = (mpi[0], mpi[1], local_var or mpi[0])
    if world < 1:
        raise ValueError(f"environment variable {names[1]}={world} must be at least 1")
    if not 0 <= rank < world:
        raise ValueError(f"environment variable {names[0]}={rank} must be in 0..{world - 1} ({names[1]}={world})")
    if local < 0:
        raise ValueError(f"environment variable {names[2]}={local} must not be negative")
    return out


def _default_device(local_rank: int, n_visible: int) -> int:
    """``LOCAL_RANK`` modulo the visible devices: one rank per GPU, or several ranks per GPU when there are more
    ranks than GPUs (protocol testing; the group then runs with :attr:`Group.phase_barrier`)."""
    return local_rank % n_visible


def _connect(env: _LaunchEnv, timeout_s: float):
    """The rendezvous of this process: a :class:`_Store` or an :class:`_MpiComm`."""
    if env.backend == "mpi":
        return _MpiComm(env)
    return _Store(env.rank, env.world_size, env.addr, env.port, timeout_s)


def init_distributed(device: int | None = None, timeout_s: float = 60.0) -> Group:
    """This process as one rank of a group of one process per GPU (buffers shared through CUDA IPC).

    Collective: every process of the group calls it. Rank, group size and rendezvous come from the launcher's
    environment (``python -m cuep.run``, torchrun or mpirun; see :func:`_launch_env`). The chosen device becomes
    the current CUDA device of this process.

    Args:
        device: CUDA device of this rank; default ``LOCAL_RANK`` modulo the visible devices. More ranks than
            GPUs put several ranks on one GPU: every round then runs phase by phase with host barriers between
            (:attr:`Group.phase_barrier`), which is for tests only.
        timeout_s: bound on every rendezvous step (connecting, all-gathers and barriers) of the TCP store; a rank
            that does not show up within it is named in a ``TimeoutError`` (mpi4py has no timeouts).

    Returns:
        ``Group(kind="ipc")`` with one local rank; its :meth:`Group.close` releases the rendezvous.

    Raises:
        ValueError: a launcher variable missing or malformed (named), more than 8 ranks, an unknown device.
        RuntimeError: no GPU, or ranks on different hosts (cuep's transport is NVLink within one node).
        TimeoutError, ConnectionError: a rank that never showed up, or left.
    """
    env = _launch_env()
    if not (timeout_s > 0 and timeout_s < float("inf")):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    if env.world_size > MAX_RANKS:
        raise ValueError(f"WORLD_SIZE={env.world_size}: a node-local group holds at most {MAX_RANKS} ranks")
    n_dev = _require_gpu("cuep.init_distributed")
    import cupy

    dev = _default_device(env.local_rank, n_dev) if device is None else int(device)
    if not 0 <= dev < n_dev:
        raise ValueError(f"device={dev} does not exist: {n_dev} GPU(s) are visible (ids 0..{n_dev - 1})")
    cupy.cuda.Device(dev).use()
    bus = cupy.cuda.runtime.deviceGetPCIBusId(dev)
    comm = _connect(env, timeout_s)
    try:
        me = json.dumps({"host": socket.gethostname(), "bus": bus.lower(), "device": dev}).encode()
        peers = [json.loads(b) for b in comm.allgather(me)]
        hosts = sorted({p["host"] for p in peers})
        if len(hosts) > 1:
            raise RuntimeError(f"the ranks run on {len(hosts)} hosts ({', '.join(hosts)}); cuep's IPC transport "
                               f"reaches peers over NVLink within one node only")
        gpus = [p["bus"] for p in peers]
    except BaseException:
        comm.close()
        raise
    return Group(devices=[dev], ranks=[env.rank], n_ranks=env.world_size, kind="ipc",
                 phase_barrier=len(set(gpus)) < len(gpus), _comm=comm)


class _MpiComm:
    """The rendezvous through mpi4py (``COMM_WORLD``), when mpirun started the processes."""

    def __init__(self, env: _LaunchEnv):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError("this process was started by mpirun (OMPI_COMM_WORLD_RANK / PMI_RANK is set), and "
                              "cuep then exchanges its IPC handles with mpi4py, which is not installed: "
                              "`pip install mpi4py`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT to use "
                              "cuep's own TCP store") from e
        self.comm = MPI.COMM_WORLD
        if (self.comm.Get_rank(), self.comm.Get_size()) != (env.rank, env.world_size):
            raise RuntimeError(f"MPI says rank {self.comm.Get_rank()} of {self.comm.Get_size()}, the environment "
                               f"rank {env.rank} of {env.world_size}")

    def allgather(self, data: bytes) -> list[bytes]:
        return [bytes(b) for b in self.comm.allgather(bytes(data))]

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        pass  # mpi4py finalises MPI at exit


# ---- the TCP store -----------------------------------------------------------------------------------------
_MAGIC = b"CUEP"
_HELLO = struct.Struct("!4sII")   # magic, rank, world size (client -> rank 0), answered by _MAGIC
_HEADER = struct.Struct("!IQ")    # collective sequence number, payload bytes
_LEN = struct.Struct("!Q")


class _Store:
    """All-gather and barrier among ``world_size`` processes over TCP; rank 0 serves, the others connect.

    Rank 0 listens on ``addr:port`` and keeps one connection per peer. An all-gather is one message from every
    peer to rank 0 and one reply with everybody's bytes (index = rank); a barrier is an all-gather of nothing.
    Every step has a deadline (``timeout_s``): a rank that never connects, never reaches a collective, or closes
    its connection is named in the error, and rank 0 then drops every connection so the others fail fast too.

    Collectives are numbered; every rank must call them in the same order (as with any collective).
    """

    def __init__(self, rank: int, world_size: int, addr: str, port: int, timeout_s: float = 60.0):
        self.rank, self.world_size, self.addr, self.port = rank, world_size, addr, port
        self.timeout_s = float(timeout_s)
        self._seq = 0
        self._listener = None
        self._peers: dict[int, socket.socket] = {}   # rank 0: rank -> connection
        self._server: socket.socket | None = None     # others: the connection to rank 0
        if world_size == 1:
            return
        try:
            if rank == 0:
                self._serve()
            else:
                self._join()
        except BaseException:
            self.close()
            raise

    # ---- connecting --------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(self.addr, self.port, type=socket.SOCK_STREAM)[0]
            lst = socket.socket(family, kind, proto)
            self._listener = lst
            lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lst.bind(sockaddr)
            lst.listen(self.world_size)
        except OSError as e:
            raise RuntimeError(f"rank 0 cannot serve cuep's rendezvous on {self.addr}:{self.port} ({e}); "
                               f"MASTER_ADDR must be an address of rank 0's host and MASTER_PORT a free port "
                               f"(CUEP_STORE_PORT overrides the port)") from e
        while len(self._peers) < self.world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(1, self.world_size) if r not in self._peers]
                raise TimeoutError(f"rank 0: rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} never "
                                   f"connected to {self.addr}:{self.port} within {self.timeout_s:g} s "
                                   f"(WORLD_SIZE={self.world_size}; did every rank start?)")
            lst.settimeout(left)
            try:
                conn, _ = lst.accept()
            except TimeoutError:
                continue
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                magic, rank, world = _HELLO.unpack(_recv_exact(conn, _HELLO.size, deadline, "a hello"))
            except (OSError, struct.error):
                conn.close()
                continue
            if magic != _MAGIC:
                conn.close()  # not one of ours (a port scan, a stale client): ignore it
                continue
            if world != self.world_size:
                conn.close()
                raise RuntimeError(f"rank {rank} has WORLD_SIZE={world}, rank 0 has {self.world_size}")
            if not 1 <= rank < self.world_size or rank in self._peers:
                conn.close()
                raise RuntimeError(f"two processes claim rank {rank} (or it is out of range 1..{self.world_size - 1})"
                                   f"; every process needs its own RANK")
            conn.sendall(_MAGIC)
            self._peers[rank] = conn
        lst.close()
        self._listener = None

    def _join(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        where = f"{self.addr}:{self.port}"
        last = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: could not reach rank 0's rendezvous at {where} (MASTER_ADDR:"
                                   f"MASTER_PORT) within {self.timeout_s:g} s ({last}); is rank 0 running?")
            try:
                conn = socket.create_connection((self.addr, self.port), timeout=min(left, 2.0))
            except OSError as e:  # not listening yet: retry until the deadline
                last = e
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(_HELLO.pack(_MAGIC, self.rank, self.world_size))
                ack = _recv_exact(conn, len(_MAGIC), deadline, f"rank 0's answer at {where}")
            except BaseException:
                conn.close()
                raise
            if ack != _MAGIC:
                conn.close()
                raise RuntimeError(f"rank {self.rank}: what listens at {where} is not cuep's rank 0 (torchrun's own "
                                   f"store? set CUEP_STORE_PORT to a free port on every rank)")
            self._server = conn
            return

    # ---- collectives -------------------------------------------------------------------------------------------
    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (index = rank). Collective, bounded by ``timeout_s``."""
        data = bytes(data)
        self._seq += 1
        seq = self._seq
        if self.world_size == 1:
            return [data]
        deadline = time.monotonic() + self.timeout_s
        what = f"all-gather #{seq}"
        try:
            if self.rank == 0:
                parts = [data]
                for rank in range(1, self.world_size):
                    conn = self._peers[rank]
                    got_seq, n = _HEADER.unpack(_recv_exact(conn, _HEADER.size, deadline,
                                                            f"rank {rank} to reach {what}", rank))
                    if got_seq != seq:
                        raise RuntimeError(f"rank {rank} is at all-gather #{got_seq}, rank 0 at #{seq}: the ranks "
                                           f"called collectives in different orders")
                    parts.append(_recv_exact(conn, n, deadline, f"rank {rank}'s data for {what}", rank))
                reply = _HEADER.pack(seq, self.world_size) + b"".join(_LEN.pack(len(p)) + p for p in parts)
                for rank in range(1, self.world_size):
                    self._peers[rank].settimeout(max(1e-3, deadline - time.monotonic()))
                    self._peers[rank].sendall(reply)
                return parts
            conn = self._server
            conn.settimeout(max(1e-3, deadline - time.monotonic()))
            conn.sendall(_HEADER.pack(seq, len(data)) + data)
            got_seq, n = _HEADER.unpack(_recv_exact(conn, _HEADER.size, deadline, f"rank 0 to complete {what} "
                                                    f"(a rank may be missing or slow)", 0))
            if got_seq != seq or n != self.world_size:
                raise RuntimeError(f"rank {self.rank}: rank 0 answered all-gather #{got_seq} to #{seq}")
            parts = []
            for _ in range(n):
                (size,) = _LEN.unpack(_recv_exact(conn, _LEN.size, deadline, f"rank 0's reply to {what}", 0))
                parts.append(_recv_exact(conn, size, deadline, f"rank 0's reply to {what}", 0))
            return parts
        except (TimeoutError, ConnectionError) as e:
            self.close()  # peers blocked on this rank now see a closed connection instead of waiting out the clock
            raise type(e)(f"rank {self.rank}: {e} (timeout_s={self.timeout_s:g})") from None
        except BaseException:
            self.close()
            raise

    def barrier(self) -> None:
        """Return once every rank has called it. Collective, bounded by ``timeout_s``."""
        self.allgather(b"")

    def close(self) -> None:
        """Drop every connection (idempotent). Ranks still waiting on this one get a ``ConnectionError``."""
        for s in [self._listener, self._server, *self._peers.values()]:
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        self._listener, self._server, self._peers = None, None, {}

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _recv_exact(conn: socket.socket, n: int, deadline: float, what: str, peer: int | None = None) -> bytes:
    """Exactly ``n`` bytes before ``deadline``; a timeout or a closed connection names ``what`` was awaited."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out waiting for {what}")
        conn.settimeout(left)
        try:
            k = conn.recv_into(view[got:])
        except TimeoutError:
            raise TimeoutError(f"timed out waiting for {what}") from None
        except OSError as e:
            k, err = 0, e
        else:
            err = None
        if k == 0:
            who = f"rank {peer}" if peer is not None else "the peer"
            raise ConnectionError(f"{who} closed its connection (exited or failed?) while waiting for {what}"
                                  + (f": {err}" if err else ""))
        got += k
    return bytes(buf)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
