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
* an initialised ``torch.distributed`` (torch already imported by the script, ``init_process_group`` called):
  its rank, world size and key-value store (:class:`_TorchStore`, keys under ``cuep/``); cuep then listens on no
  port of its own. cuep never imports torch itself.
* otherwise the torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
  and :class:`_Store`, a small TCP all-gather written with the standard library (``socket`` + ``selectors``), so
  ``python -m cuep.run`` needs nothing installed. ``cupyx.distributed`` has a store too, but it is private API.

Nodes: the ranks ``0..R-1`` of a group form ``n_nodes`` nodes of ``G = gpus_per_node`` consecutive ranks (rank
``r`` on node ``r // G``). Within a node the ranks reach each other's memory through CUDA IPC (NVLink); between nodes
they need a network transport. The layout is declared (``init_distributed(gpus_per_node=G)``, ``python -m cuep.run
--gpus-per-node G``) or taken from the launcher or the hosts (see :func:`_node_layout`), so tests may run several
"nodes" on one host, even on one GPU: the layout, not the hardware, decides which path a byte takes.

Faults: every collective is bounded. A rank that dies (its connection closes) or does not arrive within the
timeout is named in a :class:`EPError` on every rank (``.rank``, ``.reason``). After a timeout the group goes on:
the failed collective is spent on every rank (one that arrives late gets the same error), so the ranks are in step
again once each has seen it (``Buffer.reset()`` on every rank). After a death every later collective raises at once.
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import selectors
import socket
import struct
import sys
import time
import weakref
from dataclasses import dataclass, field

MAX_RANKS = 8
log = logging.getLogger("cuep")


class EPError(RuntimeError):
    """A failed dispatch/combine round or collective: a device-side timeout, bad routing input, or a peer process
    that died or did not arrive at a host-side barrier.

    Attributes:
        rank: the rank at fault (the one that died, did not arrive, or was waited for on the device); None when
            no peer is at fault (bad routing input).
        ranks: every rank at fault (several can miss one barrier).
        reason: ``"died"`` (its process or connection is gone: the group cannot go on), ``"timeout"`` (did not
            arrive in time: ``buf.reset()`` on every rank re-arms) or ``"invalid"`` (bad routing input).

    A ``RuntimeError`` like the rest of cuep's runtime failures, deliberately not a ``TimeoutError``: that is an
    ``OSError``, whose constructor gives a second argument errno meaning, and a death is no timeout.
    """

    def __init__(self, message: str, *, rank: int | None = None, ranks=None, reason: str | None = None):
        super().__init__(message)
        self.ranks = tuple(ranks) if ranks is not None else ((rank,) if rank is not None else ())
        self.rank = rank if rank is not None else (self.ranks[0] if self.ranks else None)
        self.reason = reason

    def __reduce__(self):  # keeps the attributes through pickling (multiprocessing, logging handlers)
        return (functools.partial(EPError, rank=self.rank, ranks=self.ranks, reason=self.reason), self.args)


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
        gpus_per_node: ranks per node, G: the nodes are blocks of G consecutive ranks (rank r on node r // G). It
            divides ``n_ranks``; None (the default) becomes ``n_ranks``, one node. Kind ``"local"`` is one process,
            so one node: G must be ``n_ranks``. Only ranks of one node share memory through CUDA IPC.
    """

    devices: list[int]
    ranks: list[int]
    n_ranks: int
    kind: str = "local"
    phase_barrier: bool = False
    gpus_per_node: int | None = None
    _comm: object = field(default=None, repr=False)          # _Store or _MpiComm (kind "ipc")
    _opened: dict = field(default_factory=dict, repr=False)  # IPC-mapped peer pointer -> device
    _closed: bool = field(default=False, repr=False)

    def __post_init__(self):
        if self.gpus_per_node is None:
            self.gpus_per_node = self.n_ranks
        g = self.gpus_per_node
        if isinstance(g, bool) or not hasattr(g, "__index__"):
            raise TypeError(f"gpus_per_node={g!r} must be an int (ranks per node) or None (one node)")
        g = self.gpus_per_node = int(g)
        if g < 1 or self.n_ranks % g:
            raise ValueError(f"gpus_per_node={g} must be at least 1 and divide n_ranks={self.n_ranks} (nodes of "
                             f"gpus_per_node consecutive ranks)")
        if self.kind == "local" and g != self.n_ranks:
            raise ValueError(f"gpus_per_node={g}: a group of kind 'local' is one process, so one node of all "
                             f"n_ranks={self.n_ranks} ranks; several nodes need one process per rank "
                             f"(cuep.init_distributed)")

    # ---- the node layout ------------------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        """Nodes of the group: ``n_ranks // gpus_per_node``."""
        return self.n_ranks // self.gpus_per_node

    @property
    def node(self) -> int:
        """This process's node (the node of ``ranks[0]``; kind ``"local"``: 0, the only one)."""
        return self.node_of(self.ranks[0])

    def node_of(self, rank: int) -> int:
        """The node of global rank ``rank`` (``rank // gpus_per_node``)."""
        if isinstance(rank, bool) or not hasattr(rank, "__index__") or not 0 <= int(rank) < self.n_ranks:
            raise ValueError(f"rank={rank!r} must be an int in 0..{self.n_ranks - 1} (n_ranks={self.n_ranks})")
        return int(rank) // self.gpus_per_node

    def node_ranks(self, node: int | None = None) -> list[int]:
        """The global ranks of ``node`` (default this process's node), in order: ``gpus_per_node`` consecutive."""
        if node is None:
            node = self.node
        if isinstance(node, bool) or not hasattr(node, "__index__") or not 0 <= int(node) < self.n_nodes:
            raise ValueError(f"node={node!r} must be an int in 0..{self.n_nodes - 1} (n_nodes={self.n_nodes})")
        first = int(node) * self.gpus_per_node
        return list(range(first, first + self.gpus_per_node))

    @property
    def shares_devices(self) -> bool:
        """Several ranks of this process on one device (the protocol then runs rank by rank, phase by phase)."""
        return len(set(self.devices)) < len(self.devices)

    @property
    def n_local(self) -> int:
        return len(self.devices)

    # ---- the transport: what Buffer needs from the processes of the group -----------------------------------
    def allgather(self, data: bytes, timeout_s: float | None = None) -> list[bytes]:
        """Every process's ``data``, in process order (for kind ``"ipc"`` the index is the global rank).

        Collective: every process of the group must call it. Kind ``"local"`` has one process: ``[data]``.
        ``timeout_s``: bound on the wait (default the rendezvous timeout of :func:`init_distributed`).

        Raises:
            EPError: a rank died or did not arrive within the timeout (named; see the module docstring).
        """
        if self.kind == "local":
            return [bytes(data)]
        self._check_open()
        return self._comm.allgather(bytes(data), timeout_s)

    def barrier(self, timeout_s: float | None = None) -> None:
        """Return once every process of the group has called it (kind ``"local"``: at once). Raises as
        :meth:`allgather`."""
        if self.kind != "local":
            self._check_open()
            self._comm.barrier(timeout_s)

    def broadcast(self, data: bytes, root: int = 0, timeout_s: float | None = None) -> bytes:
        """Rank ``root``'s ``data`` on every process. Collective, through :meth:`allgather`: every process passes
        bytes, but only the root's travel (the others may pass ``b""``). Kind ``"local"``: ``data`` itself.

        Raises:
            ValueError: ``root`` not a rank of the group.
            EPError: as :meth:`allgather`.
        """
        if isinstance(root, bool) or not hasattr(root, "__index__") or not 0 <= int(root) < self.n_ranks:
            raise ValueError(f"root={root!r} must be an int in 0..{self.n_ranks - 1} (n_ranks={self.n_ranks})")
        if self.kind == "local":
            return bytes(data)
        root = int(root)
        return self.allgather(bytes(data) if self.ranks[0] == root else b"", timeout_s)[root]

    def share_buffers(self, mems: list) -> list[int]:
        """Base address of every rank's symmetric allocation as this process sees it (index = global rank).

        Args:
            mems: this process's ``cupy.cuda.Memory`` allocations, one per local rank (direct ``cudaMalloc``s:
                an IPC handle names the base of an allocation, never a sub-allocation of CuPy's pool).

        Kind ``"local"``: the pointers themselves (peer access is enabled). Kind ``"ipc"``: collective over the
        whole group; the 64-byte ``cudaIpcGetMemHandle`` of this rank's allocation is all-gathered and the handle
        of every peer on this process's node (:meth:`node_ranks`) is opened with ``cudaIpcOpenMemHandle`` (lazy
        peer access). IPC does not cross hosts: a rank of another node gets base 0 (reach it through the
        network transport). Release them with :meth:`release_buffers`.
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
                mine = set(self.node_ranks())
                for rank, handle in enumerate(handles):
                    if rank == me:
                        bases.append(own)
                        continue
                    if rank not in mine:  # another node: no IPC, even when it runs on this host
                        bases.append(0)
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
        """Close the peer mappings :meth:`share_buffers` opened for ``bases`` (own memory is the caller's).

        Not collective, and it never waits for a peer: a survivor of a dead rank releases its mappings too. Every
        mapping is forgotten; one the driver fails to close (its exporter died, say) is logged, not raised.
        """
        if not self._opened:
            return
        import cupy

        for ptr in bases:
            dev = self._opened.pop(int(ptr), None)
            if dev is None:
                continue
            try:
                with cupy.cuda.Device(dev):
                    cupy.cuda.runtime.ipcCloseMemHandle(int(ptr))
            except Exception as e:  # noqa: BLE001 (closing the others matters more)
                log.warning("cuep: closing the IPC mapping %#x on GPU %d failed: %s", int(ptr), dev, e)

    def close(self) -> None:
        """Close every peer mapping still open and the rendezvous connections. Not collective; idempotent; also
        run at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        try:
            self.release_buffers(list(self._opened))
            nv = sys.modules.get("cuep.nvshmem")  # several nodes: NVSHMEM lives as long as the group
            if nv is not None and nv.is_initialized():
                nv.shutdown()
        finally:
            if self._comm is not None:
                self._comm.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this cuep group was closed (group.close())")

    def __repr__(self) -> str:
        extra = f", gpus_per_node={self.gpus_per_node}" if self.n_nodes > 1 else ""
        extra += ", phase_barrier=True" if self.phase_barrier else ""
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
    backend: str           # "tcp" (cuep's store), "mpi" (mpi4py) or "torch" (torch.distributed's store)
    addr: str | None = None
    port: int | None = None
    local_world_size: int | None = None  # LOCAL_WORLD_SIZE: ranks per node as the launcher sees it, if it says


def _int_var(env, name: str) -> int:
    value = env.get(name)
    if value is None:
        raise ValueError(f"environment variable {name} is not set; {_HOW}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _local_world_size(env) -> int | None:
    """``LOCAL_WORLD_SIZE`` (set by torchrun and ``python -m cuep.run``: ranks per node), or None when unset."""
    if "LOCAL_WORLD_SIZE" not in env:
        return None
    n = _int_var(env, "LOCAL_WORLD_SIZE")
    if n < 1:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE={n} must be at least 1")
    return n


def _launch_env(env=None) -> _LaunchEnv:
    """Read rank, world size, local rank and the rendezvous address from the launcher's environment variables.

    torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``) win when
    all four of the first are set: cuep's TCP store. Otherwise mpirun's (``OMPI_COMM_WORLD_RANK``/``SIZE``/
    ``LOCAL_RANK``, or ``PMI_RANK``/``PMI_SIZE``): mpi4py. ``LOCAL_RANK`` defaults to the rank (one node).
    ``LOCAL_WORLD_SIZE``, if set, is the launcher's ranks per node (a hint for :func:`_node_layout`).
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
        out = _LaunchEnv(rank, world, local, "tcp", addr, port, _local_world_size(env))
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    else:
        rank, world = _int_var(env, mpi[0]), _int_var(env, mpi[1])
        local_var = next((v for v in _MPI_LOCAL_VARS if v in env), None)
        local = _int_var(env, local_var) if local_var else rank
        out = _LaunchEnv(rank, world, local, "mpi", local_world_size=_local_world_size(env))
        names = (mpi[0], mpi[1], local_var or mpi[0])
    if world < 1:
        raise ValueError(f"environment variable {names[1]}={world} must be at least 1")
    if not 0 <= rank < world:
        raise ValueError(f"environment variable {names[0]}={rank} must be in 0..{world - 1} ({names[1]}={world})")
    if local < 0:
        raise ValueError(f"environment variable {names[2]}={local} must not be negative")
    return out


_DECLARE = "declare the nodes with init_distributed(gpus_per_node=G) or `python -m cuep.run --gpus-per-node G`"


def _check_gpus_per_node(g, world_size: int, name: str = "gpus_per_node") -> int:
    """``g`` as ranks per node of ``world_size`` ranks: an int in 1..MAX_RANKS that divides ``world_size``."""
    if isinstance(g, bool) or not hasattr(g, "__index__"):
        raise TypeError(f"{name}={g!r} must be an int (ranks per node) or None (from the launcher or the hosts)")
    g = int(g)
    if g < 1:
        raise ValueError(f"{name}={g} must be at least 1")
    if world_size % g:
        raise ValueError(f"{name}={g} must divide the world size {world_size} (nodes of {name} consecutive ranks)")
    if g > MAX_RANKS:
        raise ValueError(f"{name}={g} exceeds {MAX_RANKS} (MAX_RANKS, the NVLink domain cuep supports per node)")
    return g


def _spanning_node(hosts: list[str], g: int) -> tuple[int, list[str]] | None:
    """The first node of ``g`` consecutive ranks whose ranks run on several hosts, and those hosts; None if none."""
    for first in range(0, len(hosts), g):
        names = sorted(set(hosts[first:first + g]))
        if len(names) > 1:
            return first // g, names
    return None


def _node_layout(world_size: int, hosts: list[str], gpus_per_node: int | None = None,
                 local_world_size: int | None = None) -> int:
    """G, the ranks per node of a group of ``world_size`` ranks (node k holds ranks ``k*G .. k*G + G - 1``).

    Taken from the first that says:

    1. ``gpus_per_node``, as declared (several nodes may then share a host, even a GPU: for tests);
    2. ``local_world_size`` (the launcher's ``LOCAL_WORLD_SIZE``), when it divides ``world_size`` and no node it
       makes spans two hosts (else, ignored with a warning);
    3. the hosts: the ranks of one host form a node, so each host must run one consecutive block of ranks, every
       host as many.

    Whatever the source, no node may span hosts (CUDA IPC does not cross them), and a node holds 1..MAX_RANKS (8)
    ranks, so a group of more than 8 ranks must form several nodes.

    Args:
        world_size: ranks in the group.
        hosts: host name of every rank, ``[world_size]``, index = rank.
        gpus_per_node: the declared ranks per node, or None.
        local_world_size: the launcher's ranks per node, or None.

    Raises:
        TypeError: ``gpus_per_node`` not an int.
        ValueError: naming the source and the rule it breaks: G < 1, G not dividing ``world_size``, G > 8, a node
            spanning hosts, or hosts whose ranks are not consecutive blocks of equal size.
    """
    if len(hosts) != world_size:
        raise ValueError(f"hosts has {len(hosts)} entries for {world_size} ranks")
    if gpus_per_node is not None:
        g = _check_gpus_per_node(gpus_per_node, world_size)
        span = _spanning_node(hosts, g)
        if span is not None:
            node, names = span
            raise ValueError(f"gpus_per_node={g} puts ranks {node * g}..{node * g + g - 1} (node {node}) on hosts "
                             f"{', '.join(names)}: a node may not span hosts (CUDA IPC does not cross them); the "
                             f"hosts run {_host_blocks(hosts)}")
        return g
    if local_world_size is not None:
        lws = int(local_world_size)
        if lws >= 1 and world_size % lws == 0 and _spanning_node(hosts, lws) is None:
            return _check_gpus_per_node(lws, world_size, "LOCAL_WORLD_SIZE")
        log.warning("cuep: LOCAL_WORLD_SIZE=%d does not fit WORLD_SIZE=%d on hosts %s (it must divide the world "
                    "size, and no node may span hosts); the hosts decide the nodes", lws, world_size,
                    _host_blocks(hosts))
    blocks: list[tuple[str, int]] = []  # (host, ranks) of each run of consecutive ranks on one host
    for host in hosts:
        if blocks and blocks[-1][0] == host:
            blocks[-1] = (host, blocks[-1][1] + 1)
        else:
            blocks.append((host, 1))
    rule = (f"with no declared layout the ranks of each host form a node, so each host must run one consecutive "
            f"block of ranks, every host as many; {_DECLARE}")
    names = [h for h, _ in blocks]
    twice = next((h for h in names if names.count(h) > 1), None)
    if twice is not None:
        ranks = [r for r, h in enumerate(hosts) if h == twice]
        raise ValueError(f"the ranks of host {twice} ({_ranks(ranks)}) are not consecutive: {rule}")
    sizes = {n for _, n in blocks}
    if len(sizes) > 1:
        raise ValueError(f"the hosts run different numbers of ranks ({_host_blocks(hosts)}): {rule}")
    g = sizes.pop()
    if g > MAX_RANKS:
        where = "one host" if len(blocks) == 1 else f"each of {len(blocks)} hosts"
        raise ValueError(f"WORLD_SIZE={world_size}: {where} runs {g} ranks, one node, and a node holds at most "
                         f"{MAX_RANKS} ranks (MAX_RANKS, the NVLink domain cuep supports per node); for more ranks "
                         f"{_DECLARE} (at most {MAX_RANKS})")
    return g


def _host_blocks(hosts: list[str]) -> str:
    """``a: ranks 0..3, b: ranks 4..7`` (each run of consecutive ranks on one host)."""
    out, first = [], 0
    for r in range(1, len(hosts) + 1):
        if r == len(hosts) or hosts[r] != hosts[first]:
            out.append(f"{hosts[first]}: rank{'s' if r - first > 1 else ''} "
                       f"{first if r - first == 1 else f'{first}..{r - 1}'}")
            first = r
    return ", ".join(out)


def _default_device(local_rank: int, n_visible: int) -> int:
    """``LOCAL_RANK`` modulo the visible devices: one rank per GPU, or several ranks per GPU when there are more
    ranks than GPUs (protocol testing; the group then runs with :attr:`Group.phase_barrier`)."""
    return local_rank % n_visible


def _torch_distributed():
    """``torch.distributed`` when the script has imported torch and initialised a process group, else None.

    cuep never imports torch: a script that has not imported it cannot have a process group.
    """
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 (a half-imported or stubbed torch: use cuep's own rendezvous)
        return None


def _connect(env: _LaunchEnv, timeout_s: float, dist=None):
    """The rendezvous of this process: a :class:`_TorchStore`, an :class:`_MpiComm` or a :class:`_Store`."""
    if env.backend == "torch":
        return _TorchStore(dist.distributed_c10d._get_default_store(), env.rank, env.world_size, timeout_s)
    if env.backend == "mpi":
        return _MpiComm(env)
    return _Store(env.rank, env.world_size, env.addr, env.port, timeout_s)


RENDEZVOUS = ("auto", "torch", "env")


def init_distributed(device: int | None = None, timeout_s: float = 60.0, *, rendezvous: str = "auto",
                     gpus_per_node: int | None = None) -> Group:
    """This process as one rank of a group of one process per GPU (buffers shared through CUDA IPC within a node).

    Collective: every process of the group calls it. The chosen device becomes the current CUDA device of this
    process. Rank, group size and rendezvous come from:

    * an initialised ``torch.distributed`` process group, when the script has imported torch and called
      ``torch.distributed.init_process_group`` (any backend, e.g. gloo or nccl) before this: its rank, world size
      and key-value store (keys under ``cuep/``; cuep opens no port). ``LOCAL_RANK`` (default the rank) picks the
      device. A store cannot tell a dead rank from a slow one: a dead peer is named when the wait times out.
    * otherwise the launcher's environment (``python -m cuep.run``, torchrun or mpirun; see :func:`_launch_env`):
      cuep's own TCP store on ``MASTER_PORT`` (a dead peer is named at once), or mpi4py.

    The node layout (:attr:`Group.gpus_per_node`: nodes of G consecutive ranks) comes from ``gpus_per_node``, else
    the launcher's ``LOCAL_WORLD_SIZE`` when it divides the world size and fits the hosts, else the hosts (the
    ranks of one host form a node); see :func:`_node_layout`. Ranks may run on several hosts (each host one or
    more nodes; a node never spans hosts), and the group may exceed 8 ranks when it forms several nodes of at most
    8.

    Args:
        device: CUDA device of this rank; default ``LOCAL_RANK`` modulo the visible devices. More ranks than
            GPUs put several ranks on one GPU: every round then runs phase by phase with host barriers between
            (:attr:`Group.phase_barrier`), which is for tests only.
        timeout_s: bound on every rendezvous step (connecting, all-gathers and barriers; a round's own barriers
            are bounded by its ``Buffer``'s ``timeout_s``); a rank that does not show up within it is named
            (mpi4py has no timeouts). Use the same value on every rank.
        rendezvous: ``"auto"`` (torch.distributed's store when initialised, else the environment), ``"torch"``
            (require an initialised torch.distributed) or ``"env"`` (never torch's; cuep's store must then listen
            on a port torch does not use: ``CUEP_STORE_PORT``).
        gpus_per_node: ranks per node, 1..8, dividing the world size; the same on every rank. Declaring it lets
            one host (even one GPU) run several nodes, for tests. Default: from the launcher or the hosts.

    Returns:
        ``Group(kind="ipc")`` with one local rank; its :meth:`Group.close` (also run at exit) releases the IPC
        mappings and the rendezvous.

    Raises:
        TypeError: ``gpus_per_node`` not an int.
        ValueError: a launcher variable missing or malformed (named); an unknown device; a node layout that breaks
            a rule (named with its source: ``gpus_per_node`` below 1, not dividing the world size, above 8 or
            not the same on every rank; a node spanning hosts; hosts whose ranks are not consecutive blocks of
            equal size; one node of more than 8 ranks).
        RuntimeError: no GPU, or ``rendezvous="torch"`` without an initialised torch.distributed.
        TimeoutError: a rank that never connected to cuep's store (named).
        EPError: a rank that died or did not arrive at an all-gather (named).
    """
    if rendezvous not in RENDEZVOUS:
        raise ValueError(f"rendezvous={rendezvous!r} must be one of {', '.join(map(repr, RENDEZVOUS))}")
    dist = _torch_distributed() if rendezvous != "env" else None
    if rendezvous == "torch" and dist is None:
        raise RuntimeError("rendezvous='torch' needs an initialised torch.distributed: import torch and call "
                           "torch.distributed.init_process_group(...) before cuep.init_distributed")
    if dist is not None:
        rank = dist.get_rank()
        local = _int_var(os.environ, "LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
        env = _LaunchEnv(rank, dist.get_world_size(), local, "torch",
                         local_world_size=_local_world_size(os.environ))
    else:
        env = _launch_env()
    if not (timeout_s > 0 and timeout_s < float("inf")):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    if gpus_per_node is not None:  # what needs no peer is checked before any GPU or connection
        gpus_per_node = _check_gpus_per_node(gpus_per_node, env.world_size)
    n_dev = _require_gpu("cuep.init_distributed")
    import cupy

    dev = _default_device(env.local_rank, n_dev) if device is None else int(device)
    if not 0 <= dev < n_dev:
        raise ValueError(f"device={dev} does not exist: {n_dev} GPU(s) are visible (ids 0..{n_dev - 1})")
    cupy.cuda.Device(dev).use()
    bus = cupy.cuda.runtime.deviceGetPCIBusId(dev)
    comm = _connect(env, timeout_s, dist)
    try:
        me = json.dumps({"host": socket.gethostname(), "bus": bus.lower(), "device": dev,
                         "gpus_per_node": gpus_per_node, "local_world_size": env.local_world_size}).encode()
        peers = [json.loads(b) for b in comm.allgather(me)]
        declared = [p["gpus_per_node"] for p in peers]
        odd = [r for r, g in enumerate(declared) if g != declared[0]]
        if odd:
            raise ValueError(f"gpus_per_node differs between ranks (rank 0: {declared[0]}, rank {odd[0]}: "
                             f"{declared[odd[0]]}); every rank must pass the same")
        told = {p["local_world_size"] for p in peers}  # the launcher's hint counts only when every rank has it
        hosts = [p["host"] for p in peers]
        g = _node_layout(env.world_size, hosts, declared[0], told.pop() if len(told) == 1 else None)
        gpus = [(p["host"], p["bus"]) for p in peers]  # bus ids repeat across hosts
    except BaseException:
        comm.close()
        raise
    group = Group(devices=[dev], ranks=[env.rank], n_ranks=env.world_size, kind="ipc",
                  phase_barrier=len(set(gpus)) < len(gpus), gpus_per_node=g, _comm=comm)
    atexit.register(_close_group_at_exit, weakref.ref(group))  # a weak reference: never keeps a group alive
    return group


def _close_group_at_exit(ref) -> None:
    group = ref()
    if group is not None:
        try:
            group.close()
        except Exception:  # noqa: BLE001 (interpreter exit: nothing left to tell)
            pass


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

    def allgather(self, data: bytes, timeout_s: float | None = None) -> list[bytes]:
        return [bytes(b) for b in self.comm.allgather(bytes(data))]  # MPI collectives have no timeout

    def barrier(self, timeout_s: float | None = None) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        pass  # mpi4py finalises MPI at exit


# ---- the TCP store -----------------------------------------------------------------------------------------
_MAGIC = b"CUEP"
_HELLO = struct.Struct("!4sII")   # magic, rank, world size (client -> rank 0), answered by _MAGIC
_FRAME = struct.Struct("!BIQ")    # frame kind, collective sequence number (0: the group itself), payload bytes
_LEN = struct.Struct("!Q")
# frame kinds: a rank's data for a collective (-> rank 0); rank 0's answer with everybody's data; rank 0's verdict
# that a collective failed (JSON: ranks, reason, detail, fatal); a rank that gave up waiting for rank 0 (-> rank 0)
_DATA, _REPLY, _FAIL, _ABANDON = 1, 2, 3, 4


def _verdict_grace(timeout_s: float) -> float:
    """How much longer than ``timeout_s`` a rank waits for rank 0's verdict before it blames rank 0: rank 0 times a
    collective from its own arrival, and the verdict naming the late rank must reach the others first."""
    return min(max(0.5, 0.25 * timeout_s), 5.0)


class _Torn(ConnectionError):
    """A frame stopped midway: the byte stream is out of step for good."""


def _next_collective(comm, what: str) -> tuple[int, str]:
    """Number the next collective of ``comm`` (a :class:`_Store` or :class:`_TorchStore`): (its sequence number, its
    name for messages). Every rank numbers its collectives the same way, even one that fails, so they stay in step."""
    if comm._closed:
        raise RuntimeError(f"rank {comm.rank}: this rendezvous was closed")
    comm._seq += 1
    return comm._seq, f"{what} #{comm._seq}"


class _Store:
    """All-gather and barrier among ``world_size`` processes over TCP; rank 0 serves, the others connect.

    Rank 0 listens on ``addr:port`` and keeps one connection per peer. An all-gather is one frame from every peer
    to rank 0 and one reply with everybody's bytes (index = rank); a barrier is an all-gather of nothing.
    Collectives are numbered; every rank must call them in the same order (as with any collective).

    Faults. Rank 0 waits on every peer at once (``selectors``), so the first to fail is the one named:

    * a peer whose connection closes *died*: rank 0 sends every other peer a failure frame naming it, and from
      then on every collective on every rank raises at once (the group cannot go on). Rank 0's own death is seen
      by the others as its connection closing.
    * a peer missing when rank 0's deadline passes did *not arrive*: rank 0 sends every peer (the late one too)
      a failure frame for that collective. The collective is spent on every rank, and a rank that reaches it late
      reads the same failure, so the ranks are in step for the next one.
    * rank 0 itself late: a peer waits ``timeout_s`` plus :func:`_verdict_grace`, then tells rank 0 it gave up;
      rank 0 fails that collective when it gets there, naming itself, as the peers did.

    Every failure is a :class:`EPError` naming the rank(s) at fault (``.rank``, ``.ranks``, ``.reason``).
    Connecting (the constructor) raises ``TimeoutError`` naming a rank that never connected.
    """

    def __init__(self, rank: int, world_size: int, addr: str, port: int, timeout_s: float = 60.0):
        self.rank, self.world_size, self.addr, self.port = rank, world_size, addr, port
        self.timeout_s = float(timeout_s)
        self._seq = 0
        self._fatal: dict | None = None              # a failure that ended the group (a death)
        self._closed = False
        self._listener = None
        self._peers: dict[int, socket.socket] = {}   # rank 0: rank -> connection
        self._server: socket.socket | None = None     # others: the connection to rank 0
        self._sel: selectors.BaseSelector | None = None  # rank 0: the live peers' connections
        self._inbox: dict[int, dict[int, bytes]] = {}    # rank 0: rank -> {seq: data} that came before rank 0
        self._abandoned: dict[int, int] = {}             # rank 0: seq -> first rank that gave up waiting for it
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
                detail = (f"rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} never connected to "
                          f"{self.addr}:{self.port} within {self.timeout_s:g} s (WORLD_SIZE={self.world_size}; "
                          f"did every rank start?)")
                # the ranks already connected learn whom the group is missing at their first collective
                self._tell_all(_FAIL, 0, dict(ranks=missing, reason="timeout", detail=detail, fatal=True))
                raise TimeoutError(f"rank 0: {detail}")
            lst.settimeout(left)
            try:
                conn, _ = lst.accept()
            except TimeoutError:
                continue
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                magic, rank, world = _HELLO.unpack(_recv_exact(conn, _HELLO.size, deadline))
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
        self._sel = selectors.DefaultSelector()
        for rank, conn in self._peers.items():
            self._sel.register(conn, selectors.EVENT_READ, rank)
            self._inbox[rank] = {}

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
                ack = _recv_exact(conn, len(_MAGIC), deadline)
            except TimeoutError:
                conn.close()
                raise TimeoutError(f"rank {self.rank}: rank 0's rendezvous at {where} did not answer within "
                                   f"{self.timeout_s:g} s") from None
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
    def allgather(self, data: bytes, timeout_s: float | None = None, what: str = "all-gather") -> list[bytes]:
        """Every rank's ``data`` (index = rank). Collective, bounded by ``timeout_s`` (default the store's).

        Raises:
            EPError: a rank died or did not arrive in time (named; see the class docstring).
        """
        data = bytes(data)
        seq, what = _next_collective(self, what)
        if self.world_size == 1:
            return [data]
        if self._fatal is not None:
            raise self._error(what, self._fatal)
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if not t > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        failure = self._gather(seq, data, t) if self.rank == 0 else self._exchange(seq, data, t)
        if isinstance(failure, list):
            return failure
        if failure.get("fatal"):
            self._fatal = failure
        raise self._error(what, failure)

    def barrier(self, timeout_s: float | None = None) -> None:
        """Return once every rank has called it. Collective, bounded like :meth:`allgather`."""
        self.allgather(b"", timeout_s, "barrier")

    def _error(self, what: str, failure: dict) -> EPError:
        if failure.get("fatal"):
            hint = "the group cannot go on: close the Buffer and the group"
        else:
            hint = ("the collective is spent on every rank (a rank that reaches it late gets this error too); "
                    "call Buffer.reset() on every rank to go on")
        return EPError(f"rank {self.rank}: {what} failed: {failure['detail']}; {hint}", ranks=failure["ranks"],
                       reason=failure["reason"])

    # rank 0 -------------------------------------------------------------------------------------------------------
    def _gather(self, seq: int, data: bytes, t: float):
        """Rank 0's side of collective ``seq``: everybody's data, or the failure (a dict) it told every peer."""
        deadline = time.monotonic() + t
        self._pump(0.0, seq)  # what the peers sent while rank 0 was elsewhere
        while True:
            failure = self._fatal or self._abandon_failure(seq, t)
            if failure is not None:
                break
            missing = sorted(r for r in self._peers if seq not in self._inbox[r])
            if not missing:
                self._pump(0.0, seq)  # a peer that gave up on rank 0 just before it came: fail as that peer did
                failure = self._fatal or self._abandon_failure(seq, t)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                failure = dict(ranks=missing, reason="timeout", fatal=False,
                               detail=f"rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} did not reach it "
                                      f"within {t:g} s (timeout_s={t:g}; hung, or too slow)")
                break
            self._pump(left, seq)
        if failure is not None:
            for inbox in self._inbox.values():  # the data of the ranks that did arrive is of no use now
                inbox.pop(seq, None)
            self._tell_all(_FAIL, seq, failure)
            return failure
        parts = [data] + [self._inbox[r].pop(seq) for r in range(1, self.world_size)]
        body = b"".join(_LEN.pack(len(p)) + p for p in parts)
        reply = _FRAME.pack(_REPLY, seq, len(body)) + body
        for rank, conn in list(self._peers.items()):
            try:
                conn.settimeout(self.timeout_s)
                conn.sendall(reply)
            except OSError as e:  # gone after it arrived: the next collective fails, naming it
                self._died(rank, f"rank {rank} closed its connection ({e})")
        return parts

    def _abandon_failure(self, seq: int, t: float) -> dict | None:
        who = self._abandoned.pop(seq, None)
        if who is None:
            return None
        return dict(ranks=[0], reason="timeout", fatal=False,
                    detail=f"rank 0 did not reach it within {t:g} s (timeout_s={t:g}; rank {who} gave up waiting "
                           f"for it; hung, or too slow)")

    def _pump(self, wait_s: float, seq: int) -> None:
        """Read the peers' frames: wait up to ``wait_s`` for the first, then take whatever else is there."""
        while self._fatal is None:
            events = self._sel.select(wait_s)
            if not events:
                return
            wait_s = 0.0
            for key, _ in events:
                if self._fatal is None:
                    self._read_peer(key.data, seq)

    def _read_peer(self, rank: int, seq: int) -> None:
        conn = self._peers[rank]
        try:
            kind, s, payload = _read_frame(conn, time.monotonic() + self.timeout_s, self.timeout_s)
        except (OSError, TimeoutError) as e:
            why = "a frame stopped midway" if isinstance(e, _Torn) else "its process exited or was killed"
            self._died(rank, f"rank {rank} closed its connection ({why})")
            return
        if kind == _DATA:
            if s >= seq:
                self._inbox[rank][s] = payload
            # else: a late arrival at a collective that failed; its failure frame is already on the way
        elif kind == _ABANDON:
            if s >= seq:
                self._abandoned.setdefault(s, rank)
        else:
            self._died(rank, f"rank {rank} sent frame kind {kind}, which only rank 0 sends")

    def _died(self, rank: int, detail: str) -> None:
        if self._fatal is None:
            self._fatal = dict(ranks=[rank], reason="died", fatal=True, detail=detail)
        conn = self._peers.pop(rank, None)
        if conn is not None:
            self._sel.unregister(conn)
            conn.close()

    def _tell_all(self, kind: int, seq: int, failure: dict) -> None:
        """Send every live peer a frame; a peer that cannot take it is past telling."""
        payload = json.dumps(failure).encode()
        frame = _FRAME.pack(kind, seq, len(payload)) + payload
        for conn in list(self._peers.values()):
            try:
                conn.settimeout(2.0)
                conn.sendall(frame)
            except OSError:
                pass

    # the other ranks ----------------------------------------------------------------------------------------------
    def _exchange(self, seq: int, data: bytes, t: float):
        """A peer's side of collective ``seq``: everybody's data, or the failure (a dict)."""
        conn = self._server
        deadline = time.monotonic() + t + _verdict_grace(t)
        gone = dict(ranks=[0], reason="died", fatal=True,
                    detail="rank 0 closed its connection (its process exited or was killed)")
        sent = True
        try:
            conn.settimeout(max(1e-3, deadline - time.monotonic()))
            conn.sendall(_FRAME.pack(_DATA, seq, len(data)) + data)
        except TimeoutError:  # part of the frame may be out: the stream is out of step for good
            return dict(ranks=[0], reason="timeout", fatal=True,
                        detail=f"rank 0 did not take this rank's {len(data)} bytes within {t:g} s")
        except OSError:  # rank 0 is gone, but it may have left a verdict (naming the rank that died first)
            sent, deadline = False, time.monotonic() + 1.0
        while True:
            try:
                kind, s, payload = _read_frame(conn, deadline, self.timeout_s)
            except TimeoutError:
                if not sent:
                    return gone
                try:  # so that rank 0 fails this collective too when it gets there, naming itself as we do
                    conn.settimeout(1.0)
                    conn.sendall(_FRAME.pack(_ABANDON, seq, 0))
                except OSError:
                    pass
                grace = _verdict_grace(t)
                return dict(ranks=[0], reason="timeout", fatal=False,
                            detail=f"rank 0 did not complete it within {t:g} s + {grace:g} s (timeout_s={t:g}; "
                                   f"rank 0 hung, or too slow)")
            except OSError:
                return gone
            if kind == _FAIL:
                failure = json.loads(payload)
                # 0: the group never formed; an older collective's failure matters only if it ended the group
                if s in (0, seq) or failure.get("fatal"):
                    return failure
            if s < seq:
                continue  # the answer to a collective this rank gave up on
            if kind != _REPLY or s != seq:
                return dict(ranks=[0], reason="died", fatal=True,
                            detail=f"rank 0 answered collective #{s} (kind {kind}) to #{seq}: out of step")
            parts, off = [], 0
            for _ in range(self.world_size):
                (size,) = _LEN.unpack_from(payload, off)
                parts.append(payload[off + _LEN.size: off + _LEN.size + size])
                off += _LEN.size + size
            return parts

    def close(self) -> None:
        """Drop every connection (idempotent). Peers then see this rank as gone (``reason="died"``)."""
        self._closed = True
        for s in [self._listener, self._server, *self._peers.values()]:
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        if self._sel is not None:
            self._sel.close()
        self._listener, self._server, self._peers, self._sel = None, None, {}, None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _read_frame(conn: socket.socket, deadline: float, patience: float) -> tuple[int, int, bytes]:
    """The next frame (kind, seq, payload). ``TimeoutError`` if none began before ``deadline``; once one has, the
    rest must follow within ``patience`` seconds (else :class:`_Torn`). ``ConnectionError``: the peer is gone."""
    head = _recv_exact(conn, 1, deadline)
    until = time.monotonic() + patience
    try:
        head += _recv_exact(conn, _FRAME.size - 1, until)
        kind, seq, n = _FRAME.unpack(head)
        return kind, seq, _recv_exact(conn, n, until)
    except TimeoutError:
        raise _Torn("a frame stopped midway") from None


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes before ``deadline`` (else ``TimeoutError``); ``ConnectionError`` if the peer closes."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        conn.settimeout(left)
        try:
            k = conn.recv_into(view[got:])
        except TimeoutError:
            raise TimeoutError("timed out") from None
        except OSError as e:
            raise ConnectionError(f"connection lost: {e}") from None
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


# ---- torch.distributed's store -------------------------------------------------------------------------------
class _TorchStore:
    """All-gather and barrier through the key-value store of an initialised ``torch.distributed`` process group
    (``set`` / ``wait`` / ``get`` / ``check``; keys ``cuep/<collective>/<rank>``), so cuep listens on no port.

    A store cannot tell a dead rank from a slow one: a rank whose key is missing when the wait times out is named
    as not arriving (``reason="timeout"``). The rank that times out marks the collective failed
    (``cuep/<collective>/failed``) and a rank that completes it afterwards raises the same error (best effort: one
    that completes in the instant before the mark is set succeeds). Each rank deletes its key of collective q - 1
    once it has completed q (every rank has read it then).
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float = 60.0, prefix: str = "cuep/"):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.prefix = float(timeout_s), prefix
        self._seq = 0
        self._closed = False

    def _key(self, seq: int, who) -> str:
        return f"{self.prefix}{seq}/{who}"

    def allgather(self, data: bytes, timeout_s: float | None = None, what: str = "all-gather") -> list[bytes]:
        """Every rank's ``data`` (index = rank); raises :class:`EPError` naming the ranks that did not arrive."""
        import datetime

        data = bytes(data)
        seq, what = _next_collective(self, what)
        if self.world_size == 1:
            return [data]
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        keys = [self._key(seq, r) for r in range(self.world_size)]
        failed = self._key(seq, "failed")
        try:
            self.store.set(keys[self.rank], b"\x01" + data)  # never empty: a present key always has a byte
            try:
                self.store.wait(keys, datetime.timedelta(seconds=t))
            except Exception:  # noqa: BLE001 (torch raises a RuntimeError subclass on a timeout)
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                if not missing:
                    raise
                failure = dict(ranks=missing, reason="timeout",
                               detail=f"rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} did not reach it "
                                      f"within {t:g} s (timeout_s={t:g}; hung, died or too slow: torch's store "
                                      f"cannot tell)")
                self.store.set(failed, json.dumps(failure).encode())
                raise self._error(what, failure) from None
            parts = [bytes(self.store.get(k))[1:] for k in keys]
            if self.store.check([failed]):
                raise self._error(what, json.loads(bytes(self.store.get(failed))))
        except EPError:
            raise
        except Exception as e:  # noqa: BLE001 (the store itself failed: its server may be gone)
            raise EPError(f"rank {self.rank}: {what} failed: torch.distributed's store failed ({type(e).__name__}: "
                          f"{e}); the process that serves it may have died", reason="died") from e
        if seq > 1:
            try:
                self.store.delete_key(self._key(seq - 1, self.rank))
            except Exception:  # noqa: BLE001 (a store without delete: the keys stay, harmless)
                pass
        return parts

    def barrier(self, timeout_s: float | None = None) -> None:
        self.allgather(b"", timeout_s, "barrier")

    def _error(self, what: str, failure: dict) -> EPError:
        return EPError(f"rank {self.rank}: {what} failed: {failure['detail']}; the collective is spent on every rank: "
                       f"call Buffer.reset() on every rank to go on", ranks=failure["ranks"], reason=failure["reason"])

    def close(self) -> None:
        self._closed = True  # the store is torch's: it stays open


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
