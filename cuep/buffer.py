"""``cuep.Buffer``: the init step. Symmetric memory on every rank, peer pointer tables, counters, outputs.

One allocation per rank (a direct ``cudaMalloc`` through ``cupy.cuda.Memory``, so it can also be shared through
CUDA IPC), carved into the regions ``EPConfig.buffer_regions`` names; the same offsets on every rank, so a peer's
region is its base address plus the offset. A small int64 parameter struct per rank (sizes, offsets, the peer
base table: ``EPParams`` in ``cuda_src/ep/params.cuh``, built by :mod:`cuep.params`) is part of every kernel's
by-value argument.

Who sees which base address is the group's business (:meth:`cuep.Group.share_buffers`): the pointers themselves
when one process drives every rank, CUDA IPC mappings when each rank is its own process. With one process per
rank, creating a buffer and :meth:`Buffer.reset` are collective (every rank calls them).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import math
import weakref
from dataclasses import dataclass

import numpy as np

from .config import EPConfig
from .formats import SCALE_TILE_ROWS
from .group import EPError, Group  # EPError lives with the group (the lower module), which raises it too
from .params import ep_params

log = logging.getLogger("cuep")

MAX_TOP_K = 32  # one warp lane per top-k choice
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
ERROR_STATUS = {1: "timed out waiting", 2: "expert id out of range", 3: "same expert twice in one token's top-k"}
KERNEL_NAMES = {1: "dispatch (send)", 2: "dispatch (receive)", 3: "combine (send)", 4: "combine (receive)",
                5: "dispatch (send, multi-node)", 6: "dispatch (forward, multi-node)",
                7: "dispatch (receive, multi-node)", 8: "combine (send, multi-node)",
                9: "combine (forward, multi-node)", 10: "combine (receive, multi-node)"}


@dataclass
class _Rank:
    """Everything one rank owns on its device."""

    rank: int
    device: int
    mem: object                 # cupy.cuda.Memory: the symmetric allocation
    params: object              # numpy structured array [1] of cuep.params.EP_PARAMS_DTYPE (EPParams)
    err_host: np.ndarray        # int32 [4] view of host-mapped memory: status, kernel, expert, src
    err_host_ptr: int
    # dispatch outputs (persistent, reused every round)
    tokens: object
    scales: object
    row_offsets: object
    expert_ids: object
    scales_offsets: object
    src_info: object
    row_src: object
    row_weight: object
    msg_rows: object
    msg_token: object
    msg_j: object
    msg_count: object
    # combine outputs (persistent)
    combined: object = None
    combined_unreduced: object = None
    node: object = None         # cuep.internode.NodeState with n_nodes > 1 (mem is then None)
    err_status: object = None   # memoryview of err_host: its status word read as a Python int (Buffer.check)
    scale_tile_rows: object = None  # fp4: uint8 [scale tiles], rows of each tile of `scales` that may be nonzero

    @property
    def base(self) -> int:
        return int(self.mem.ptr)


def _host_mapped_int32(n: int) -> tuple[int, int, np.ndarray]:
    """Pinned, device-mapped host memory: (host ptr, device ptr, numpy view). The host reads it without a sync."""
    import cupy

    rt = cupy.cuda.runtime
    ptr = rt.hostAlloc(4 * n, 2)  # cudaHostAllocMapped
    dptr = ptr  # unified virtual addressing (every 64-bit CUDA platform): the device sees the same address
    arr = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(ptr))
    arr[:] = 0
    return ptr, dptr, arr


class Buffer:
    """Symmetric communication memory and persistent outputs for one EP group (the ``ep_init`` step).

    Args:
        group: from :func:`cuep.init` (one process, all GPUs) or :func:`cuep.init_distributed` (one process per
            GPU; then every rank creates its buffer with the same ``cfg``, collectively).
        cfg: the group's sizes; ``cfg.n_ranks`` must equal ``group.n_ranks``.
        timeout_s: how long a device-side wait spins before it gives up and reports which rank it waited for.
        num_sms: blocks per kernel (one per SM); default all SMs of the device.

    The outputs of ``dispatch`` and ``combine`` live here and are reused: a result is valid until the next call
    of the same kind on this buffer. Memory is reported (log line) before it is allocated. :meth:`close` (also
    run at interpreter exit) unmaps the peers' memory and frees this process's.
    """

    # class defaults, so every call reads one attribute: set by close(), and by ep._before_launch when a round's
    # host-side barrier failed
    _closed = False
    _host_error = None
    _torch = False  # never a torch call's result: cuep.interop's argument scan reads this instead of missing

    def __init__(self, group: Group, cfg: EPConfig, *, timeout_s: float = 5.0, num_sms: int | None = None):
        import cupy

        if not isinstance(group, Group):
            raise TypeError(f"group must be a cuep.Group (from cuep.init() or cuep.init_distributed()), got "
                            f"{type(group).__name__}; call cuep.Buffer(group, cfg)")
        if not isinstance(cfg, EPConfig):
            raise TypeError(f"cfg must be a cuep.EPConfig, got {type(cfg).__name__}; call cuep.Buffer(group, cfg)")
        if group._closed:
            raise RuntimeError("group was closed (group.close()); create a new one with cuep.init() or "
                               "cuep.init_distributed()")
        if cfg.n_nodes > 1:
            from . import internode, nvshmem

            internode.check_config(cfg, group)
            nvshmem.require(f"cfg.n_nodes={cfg.n_nodes} (a Buffer across nodes)")
        if cfg.n_ranks != group.n_ranks:
            raise ValueError(f"cfg.n_ranks={cfg.n_ranks} (n_gpus_per_node x n_nodes) must equal the group's "
                             f"{group.n_ranks} ranks")
        if cfg.n_gpus_per_node != group.gpus_per_node:  # a one-node buffer over several nodes would write to 0
            raise ValueError(f"cfg.n_gpus_per_node={cfg.n_gpus_per_node} (n_nodes={cfg.n_nodes}), but the group is "
                             f"{group.n_nodes} node(s) of {group.gpus_per_node} rank(s): build the EPConfig with "
                             f"n_gpus_per_node={group.gpus_per_node}, n_nodes={group.n_nodes}")
        if cfg.top_k > MAX_TOP_K:
            raise ValueError(f"top_k={cfg.top_k} exceeds the kernels' limit of {MAX_TOP_K}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float, np.integer, np.floating)) \
                or not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, (int, np.integer))):
            raise ValueError(f"num_sms={num_sms!r} must be an int (blocks per kernel) or None (every SM)")
        self.group, self.cfg, self.timeout_s = group, cfg, float(timeout_s)
        self._launch_cache: dict = {}  # launch shapes per kernel family, computed once (device queries are slow)
        self._ranks: list[_Rank] = []
        self._mapped: list[int] = []
        self._bases: list[int] = []
        self._launched: set[str] = set()  # kernel files launched on this buffer (ep._before_launch)
        # the order of round halves (ep.py, _check_nothing_pending); "local": the latest dispatch took the one-rank
        # kernels, so its fused combine does too
        self._rounds = {"dispatches": 0, "pending": None, "local": False}
        theirs = group.allgather(repr(cfg).encode())  # symmetric offsets need the same cfg on every rank
        odd = [r for r, c in enumerate(theirs) if c != theirs[0]]
        if odd:
            raise ValueError(f"rank(s) {odd} built their Buffer with a different EPConfig than rank 0: "
                             f"{theirs[odd[0]].decode()} vs {theirs[0].decode()}")
        dev0 = group.devices[0]
        sms = cupy.cuda.Device(dev0).attributes["MultiProcessorCount"]
        self.num_sms = int(num_sms) if num_sms else sms
        if not 1 <= self.num_sms <= sms:
            raise ValueError(f"num_sms={num_sms} must be in 1..{sms} (the device's multiprocessors)")
        gib = 2**30
        if cfg.n_nodes > 1:
            self._init_nodes()
            return
        log.info("cuep: allocating %.3f GiB symmetric + %.3f GiB outputs per rank on %d rank(s)",
                 cfg.buffer_bytes / gib, cfg.output_bytes / gib, group.n_local)
        for rank, dev in zip(group.ranks, group.devices):
            with cupy.cuda.Device(dev):
                self._ranks.append(self._alloc_rank(rank, dev))
        self._bases = group.share_buffers([r.mem for r in self._ranks])
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit)
        self._write_params()
        self.reset()  # collective: no rank writes into a peer before every peer's memory is initialised

    # ---- set-up --------------------------------------------------------------------------------------------
    def _init_nodes(self) -> None:
        """Several nodes (one process per rank): NVSHMEM initialised once per process (UID bootstrap through the
        group), this rank's heap (:mod:`cuep.internode`), outputs in device memory. Collective."""
        import cupy

        from . import internode, nvshmem

        cfg, group = self.cfg, self.group
        rank, dev = group.ranks[0], group.devices[0]
        with cupy.cuda.Device(dev):
            free = cupy.cuda.runtime.memGetInfo()[0]
        need = internode.heap_bytes(cfg) + cfg.output_bytes
        if need > free:
            raise MemoryError(f"rank {rank}: a Buffer across nodes needs {internode.describe(cfg)} and "
                              f"{cfg.output_bytes / 2**30:.2f} GiB of outputs, GPU {dev} has {free / 2**30:.2f} GiB "
                              f"free: lower max_tokens_per_rank (the combine stage grows as n_nodes x T x top_k x H)")
        internode.heap_need_env(cfg)
        info = nvshmem.init(group, dev)
        self._nvshmem = True
        with cupy.cuda.Device(dev):
            internode.load_kernels()  # the first use compiles (the transport is known once built)
        #: how remote puts travel: "ibgda" (GPU-initiated) or "proxy" (NVSHMEM's CPU proxy thread)
        self.transport = nvshmem.device_transport()
        log.info("cuep: %s + %.3f GiB outputs; NVSHMEM %s, %s transport between nodes%s", internode.describe(cfg),
                 cfg.output_bytes / 2**30, info.get("version"), self.transport,
                 "" if self.transport == "ibgda" else " (remote puts through NVSHMEM's CPU proxy thread; "
                 "docs/internode.md says how to get IBGDA)")
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit)
        with cupy.cuda.Device(dev):
            r = self._alloc_rank(rank, dev, node=True)
            self._ranks.append(r)
            r.node = internode.NodeState(self, r)
        self.reset()

    def _alloc_rank(self, rank: int, dev: int, node: bool = False) -> _Rank:
        import cupy
        import ml_dtypes

        cfg = self.cfg
        H = cfg.hidden
        try:
            # several nodes: the symmetric memory is NVSHMEM's heap (cuep.internode); tokens is a plain output
            mem = cupy.cuda.Memory(cfg.capacity * cfg.payload_bytes if node else cfg.buffer_bytes)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(f"rank {rank} on GPU {dev}: cannot allocate {cfg.buffer_bytes / 2**30:.2f} GiB of "
                              f"symmetric memory ({cfg.describe()}); lower max_tokens_per_rank") from e
        hptr, dptr, err = _host_mapped_int32(4)
        self._mapped.append(hptr)
        ptr = cupy.cuda.MemoryPointer(mem, 0 if node else cfg.buffer_regions["tokens"][0])
        if cfg.fmt.name == "bf16":
            tokens = cupy.ndarray((cfg.capacity, H), dtype=ml_dtypes.bfloat16, memptr=ptr)
        else:
            tokens = cupy.ndarray((cfg.capacity, cfg.payload_bytes), dtype=cupy.uint8, memptr=ptr)
        if cfg.fmt.name == "fp8":
            scales = cupy.zeros(cfg.scales_shape, dtype=cupy.float32)
        elif cfg.fmt.swizzled_scales:
            scales = cupy.zeros(cfg.scales_shape, dtype=cupy.uint8)
        else:
            scales = None
        G, S, T, K = cfg.n_groups, cfg.n_source_ranks, cfg.max_tokens_per_rank, cfg.top_k
        if node:  # the intranode combine's message tables: unused
            S = T = 0
        return _Rank(
            rank=rank, device=dev, mem=mem, params=None,
            err_host=err, err_host_ptr=dptr, err_status=memoryview(err).cast("B").cast("i"), tokens=tokens,
            scales=scales,
            row_offsets=cupy.zeros(G + 1, dtype=cupy.uint32), expert_ids=cupy.zeros(G, dtype=cupy.int32),
            scales_offsets=cupy.zeros(G, dtype=cupy.uint32) if cfg.fmt.swizzled_scales else None,
            src_info=cupy.full((cfg.capacity, 2), -1, dtype=cupy.int32),
            row_src=cupy.full(cfg.capacity, -1, dtype=cupy.int32),
            row_weight=cupy.zeros(cfg.capacity, dtype=cupy.float32),
            msg_rows=cupy.full(2 * S * T * K, -1, dtype=cupy.int32), msg_token=cupy.zeros(S * T, dtype=cupy.int32),
            msg_j=cupy.zeros(S * T, dtype=cupy.int32), msg_count=cupy.zeros(S, dtype=cupy.int32),
            scale_tile_rows=cupy.zeros(cfg.swizzled_scale_tiles, dtype=cupy.uint8)
            if cfg.fmt.swizzled_scales and not node else None)  # (several nodes: cuep.internode pads every row)

    def _peer_bases(self) -> list[int]:
        """Base address of every rank's symmetric allocation as this process sees it, indexed by global rank and
        padded to the kernels' 8 slots (the group shared them: :meth:`cuep.Group.share_buffers`)."""
        return list(self._bases) + [0] * (8 - len(self._bases))

    def _write_params(self) -> None:
        cfg, m = self.cfg, self.cfg.message
        regions = cfg.buffer_regions
        bases = self._peer_bases()
        for r in self._ranks:
            v = dict(
                rank=r.rank, n_ranks=cfg.n_ranks, n_src=cfg.n_source_ranks, src_index=0 if cfg.skip_a2a else r.rank,
                n_local=cfg.n_local_experts, n_experts=cfg.n_experts, top_k=cfg.top_k, hidden=cfg.hidden,
                max_tokens=cfg.max_tokens_per_rank, payload_bytes=cfg.payload_bytes, scale_bytes=m.scale_bytes,
                row_align=cfg.fmt.row_align, n_scales=cfg.n_scales, k_tiles=cfg.scale_k_tiles if cfg.n_scales else 0,
                n_groups=cfg.n_groups, shared=int(cfg.fused_shared_expert), skip_a2a=int(cfg.skip_a2a),
                ar_size=cfg.allreduce_world_size, ar_index=r.rank % cfg.allreduce_world_size,
                capacity=cfg.capacity, meta_bytes=m.meta_bytes, meta_ids=m.topk_ids_offset,
                meta_w=m.topk_weights_offset, meta_rows=m.topk_rows_offset, meta_scales=m.scales_offset,
                combine_itemsize=cfg.combine_itemsize, small_tokens=cfg.small_batch_tokens,
                stage_record=cfg.stage_record_bytes, timeout_ns=int(self.timeout_s * 1e9), err_ptr=r.err_host_ptr,
                **{f"off_{k}": regions[k][0] for k in ("tokens", "comb_recv", "meta", "tally",
                                                       "comb_ready", "comb_arrived", "counters",
                                                       "scratch", "stage", "comb_poll", "scale_rows")},
                poll_tokens=cfg.combine_poll_tokens, peer_base=bases)
            r.params = ep_params(v)

    # ---- state ---------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run: the memory is freed and every call on the buffer raises."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this cuep.Buffer was closed (buf.close()), its memory is freed; create a new "
                               "cuep.Buffer(group, cfg) for more rounds")

    def reset(self) -> None:
        """Re-arm every rank (counts empty, flags and counters zero, error cleared). Synchronises the devices.

        Call it on every rank after an error, when no round is in flight, and after writing into a dispatch
        output's fp4 ``scales`` (a round zeroes only the padding rows earlier rounds wrote). With one process per
        rank it is collective: a barrier before (no peer still writes here) and after (no peer writes before every
        rank is re-armed).
        """
        import cupy

        self._check_open()
        cfg = self.cfg
        reg = cfg.buffer_regions
        for r in self._ranks:  # this rank's own work first, so the barrier below means "every rank is idle"
            with cupy.cuda.Device(r.device):
                cupy.cuda.Device().synchronize()
        self.group.barrier()
        for r in self._ranks:
            with cupy.cuda.Device(r.device):
                cupy.cuda.Device().synchronize()
                if r.node is not None:  # several nodes: signals and private state (cuep.internode)
                    from . import nvshmem

                    nvshmem.barrier_all()  # no put of a failed round still in flight lands after the re-arm
                    r.node.rearm()
                    cupy.cuda.Device().synchronize()
                    r.err_host[:] = 0
                    continue
                rt = cupy.cuda.runtime
                # meta holds the per-message chunk flags (round stamps): stale ones must not match a restarted round
                for name in ("meta", "tally", "comb_ready", "comb_arrived", "counters", "stage"):
                    off, size = reg[name]
                    rt.memset(r.base + off, 0, size)
                off, size = reg["comb_poll"]  # all ones: "not landed" for the polling receiver
                if size:
                    rt.memset(r.base + off, 0xFF, size)
                if r.scale_tile_rows is not None:  # any row of a scale tile may be nonzero: the next rounds zero them
                    r.scale_tile_rows.fill(SCALE_TILE_ROWS)
                cupy.cuda.Device().synchronize()
            r.err_host[:] = 0
        self._rounds["pending"] = None  # a half left pending by a failed round is gone with it
        self.group.barrier()
        self._host_error = None  # every rank is re-armed: rounds may run again (see check)

    def check(self) -> None:
        """Raise :class:`EPError` if a round failed and :meth:`reset` has not run since: a kernel of a local rank
        reported a failure (reads host-mapped memory; no synchronisation, so it sees failures of kernels that
        have already run), or a host-side barrier of a round failed (one process per rank: a peer died or did not
        arrive; :class:`EPError` names it). Raises ``RuntimeError`` after :meth:`close`."""
        if self._closed:
            self._check_open()
        for r in self._ranks:
            if not r.err_status[0]:  # the status word: nothing more to read while it is 0 (every call reads it)
                continue
            status, kernel, expert, src = (int(v) for v in r.err_host)
            if status:
                what = ERROR_STATUS.get(status, f"error {status}")
                if status == 1:
                    whom = f"source/peer rank {src}" if src >= 0 else "data from a peer"
                    if src >= 0 and self.cfg.n_nodes > 1:
                        whom += f" (node {src // self.cfg.n_gpus_per_node})"
                    detail = (f"rank {r.rank} {KERNEL_NAMES.get(kernel, kernel)} {what} for {whom} "
                              f"(after {self.timeout_s:g} s): a peer did not take part in this round, or died")
                    at_fault, reason = (src if src >= 0 else None), "timeout"
                else:
                    detail = (f"rank {r.rank} {KERNEL_NAMES.get(kernel, kernel)}: {what} (expert id {expert}, "
                              f"token {src}); that choice was skipped")
                    at_fault, reason = None, "invalid"
                raise EPError(f"{detail}. Call buffer.reset() on every rank before the next round.", rank=at_fault,
                              reason=reason)
        failed = self._host_error  # set by ep._before_launch when a round's barrier failed
        if failed is not None:
            raise EPError(f"rank {self.group.ranks[0]}: a round on this buffer failed ({failed}); call buffer.reset() "
                          f"on every rank before the next round", ranks=failed.ranks, reason=failed.reason)

    def synchronize(self) -> None:
        """Wait for every local rank's device (all its streams: CuPy's current one, and torch's current one, which
        calls with torch tensors launch on), then :meth:`check`."""
        import cupy

        self._check_open()
        for dev in dict.fromkeys(r.device for r in self._ranks):
            cupy.cuda.Device(dev).synchronize()
        self.check()

    def close(self) -> None:
        """Unmap the peers' memory (IPC handles), free this process's (also at exit and garbage collection).

        Not collective, and it never waits for a peer, so a rank whose peer died closes too. With one process per
        rank, close after the last round has completed on every rank (e.g. after a ``group.barrier()``): a peer
        still running a round would write into freed memory.
        Arrays that still reference the buffer's outputs keep that device memory alive.
        """
        import cupy

        self._closed = True
        hook, self._atexit = getattr(self, "_atexit", None), None
        if hook is not None:
            atexit.unregister(hook)
        bases, self._bases = getattr(self, "_bases", []), []
        for r in getattr(self, "_ranks", []):  # this rank's kernels (bounded waits) end before their memory goes
            try:
                with cupy.cuda.Device(r.device):
                    cupy.cuda.Device().synchronize()
            except Exception:  # noqa: BLE001 (a failed device: free what can be freed)
                pass
        try:
            if bases:
                self.group.release_buffers(bases)
            self._close_nodes()
        finally:
            for p in getattr(self, "_mapped", []):
                try:
                    cupy.cuda.runtime.freeHost(p)
                except Exception:
                    pass
            self._mapped = []
            self._ranks = []  # drops the last references to the cupy.cuda.Memory allocations: cudaFree

    def _close_nodes(self) -> None:
        """Several nodes: free the NVSHMEM heap (collective in NVSHMEM: every rank closes; skipped after a peer died,
        the process's exit releases it). NVSHMEM itself ends with the group (``Group.close``)."""
        if not getattr(self, "_nvshmem", False):
            return
        self._nvshmem = False
        failed = getattr(self, "_host_error", None)
        if failed is not None and getattr(failed, "reason", None) == "died":
            log.warning("cuep: a peer died; NVSHMEM's heap and state are left to the process's exit")
            return
        for r in getattr(self, "_ranks", []):
            if r.node is not None:
                r.node.free()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Buffer({self.group!r}, {self.cfg.describe()})"


def _close_at_exit(ref) -> None:
    """atexit hook of one buffer (a weak reference: the hook never keeps a buffer alive)."""
    buf = ref()
    if buf is not None:
        try:
            buf.close()
        except Exception:
            pass
