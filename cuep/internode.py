"""Multi-node dispatch and combine (``cfg.n_nodes > 1``): the host side of ``cuda_src/nvshmem/internode.cu``.

A :class:`cuep.Buffer` with several nodes keeps one NVSHMEM symmetric allocation per rank (the "heap": signals,
send rows, the rows and headers a forwarder receives from other nodes, combine staging) and the usual outputs in
device memory. Node peers' heaps are reached by load/store through NVSHMEM's own peer mapping (``nvshmem_ptr``:
CUDA IPC underneath); other nodes only through NVSHMEM puts with signals. The node layout (``group.gpus_per_node``,
``cfg.n_gpus_per_node``), not the hardware, decides which path a byte takes: PEs sharing one GPU still put to
"remote" nodes through NVSHMEM. The protocol: ``docs/internode.md``.

A round is several launches per rank (dispatch: send, relay, count, offsets, place; combine: send, relay, recv);
``dispatch_async`` runs the send, ``dispatch_wait`` the rest. When ranks share a GPU (tests) a host barrier
precedes every launch that waits on a peer.
"""
from __future__ import annotations

import logging
import struct

import numpy as np

from .params import pointer

log = logging.getLogger("cuep")

MAX_NODE_GPUS = 8        # kMaxNodeGpus: entries of node_heap
MAX_NODES = 32           # node masks are 32-bit
CHUNK = 128              # kChunk: tokens per (source, chunk) work unit
THREADS = 512
KERNEL_FILE = "internode.cu"
MODE_PARTIAL, MODE_WEIGHTED, MODE_UNREDUCED = 0, 1, 2
STATE_BASE = 16          # S_EXP_ROWS: the int64 state before the per-node expectations

#: NodeParams' int64 fields in the C struct's order (node_heap[MAX_NODE_GPUS] follows).
NODE_PARAMS_FIELDS = (
    "rank", "n_ranks", "gpus_per_node", "n_nodes", "node", "local",
    "n_local", "n_experts", "top_k", "hidden", "max_tokens",
    "payload_bytes", "scale_bytes", "row_bytes", "hdr_bytes",
    "row_align", "n_scales", "k_tiles", "n_groups", "shared", "capacity", "n_chunks",
    "combine_itemsize", "comb_slots", "small_tokens", "skip_a2a", "ar_size", "ar_index",
    "timeout_ns", "err_ptr", "state_ptr", "scratch_ptr", "row_of_ptr",
    "heap",
    "off_sig", "off_x_send", "off_hdr_send", "off_x_recv", "off_hdr_recv", "off_stage", "off_c_send", "off_c_recv",
    "off_x_dir",
)
NODE_PARAMS_DTYPE = np.dtype([(f, np.int64) for f in NODE_PARAMS_FIELDS] +
                             [("node_heap", np.int64, (MAX_NODE_GPUS,))], align=True)
_PTR = np.uint64
NODE_DISPATCH_ARGS_DTYPE = np.dtype([
    ("x", _PTR), ("topk_ids", _PTR), ("topk_weights", _PTR), ("tokens", _PTR), ("scales_out", _PTR),
    ("row_offsets", _PTR), ("expert_ids", _PTR), ("scales_offsets", _PTR), ("src_info", _PTR), ("row_src", _PTR),
    ("num_tokens", np.int32), ("global_scale", np.float32)], align=True)
NODE_COMBINE_ARGS_DTYPE = np.dtype([
    ("expert_out", _PTR), ("topk_ids", _PTR), ("topk_weights", _PTR), ("residual", _PTR), ("out", _PTR),
    ("num_tokens", np.int32), ("mode", np.int32)], align=True)
DISPATCH_CALL_DTYPE = np.dtype([("p", NODE_PARAMS_DTYPE), ("a", NODE_DISPATCH_ARGS_DTYPE)], align=True)
COMBINE_CALL_DTYPE = np.dtype([("p", NODE_PARAMS_DTYPE), ("a", NODE_COMBINE_ARGS_DTYPE)], align=True)


def _a16(n: int) -> int:
    return -(-n // 16) * 16


def _a256(n: int) -> int:
    return -(-n // 256) * 256


def row_bytes(cfg) -> int:
    """Bytes of one token on the wire and in x_send: payload, then its block scales (16-byte aligned parts)."""
    return _a16(cfg.payload_bytes) + _a16(cfg.fmt.scale_bytes(cfg.hidden))


def header_bytes(cfg) -> int:
    """A source's header: its token count (16 bytes), then per token K int32 ids and K float32 weights."""
    return _a16(16 + cfg.max_tokens_per_rank * 8 * cfg.top_k)


def n_signals(cfg) -> int:
    """uint64 signals per heap: hdr, rows, relay [2][M] each, own [2], stage [2], crecv [2][M], direct [2][R]."""
    return 8 * cfg.n_nodes + 4 + 2 * cfg.n_ranks


def heap_regions(cfg) -> dict[str, tuple[int, int]]:
    """(offset, bytes) of each region of a rank's symmetric heap allocation; the same on every rank.

    sig: the signals; x_send [2, T, row] (my encoded tokens, by round parity); hdr_send [2, header];
    x_recv [2, M, T, row] and hdr_recv [2, M, header] (what node n's peer with my local index sent me, as
    forwarder); stage [2, M, T, K, H] (combine: node peers' partial sums or rows of the tokens I forward);
    c_send [2, M, T, H] (a forwarder's summed rows, the source of its puts); c_recv [2, T, max(K, M), H] (the
    rows each node returns to my tokens); x_dir [2, R, S, row] (a small round's rows, put straight to me by
    each source on another node; S = ``small_batch_tokens``). Combine areas in the combine dtype.
    """
    M, T, K, H = cfg.n_nodes, cfg.max_tokens_per_rank, cfg.top_k, cfg.hidden
    cs, rb, hb = cfg.combine_itemsize, row_bytes(cfg), header_bytes(cfg)
    sizes = [("sig", 8 * n_signals(cfg)), ("x_send", 2 * T * rb), ("hdr_send", 2 * hb), ("x_recv", 2 * M * T * rb),
             ("hdr_recv", 2 * M * hb), ("stage", 2 * M * T * K * H * cs), ("c_send", 2 * M * T * H * cs),
             ("c_recv", 2 * T * max(K, M) * H * cs), ("x_dir", 2 * cfg.n_ranks * cfg.small_batch_tokens * rb)]
    if cfg.skip_a2a:  # nothing crosses ranks: only my own rows and header
        sizes = [(name, size if name in ("sig", "x_send", "hdr_send") else 0) for name, size in sizes]
    out, off = {}, 0
    for name, size in sizes:
        out[name] = (off, size)
        off += _a256(size)
    return out


def heap_bytes(cfg) -> int:
    """Symmetric heap bytes one rank allocates (the sum of :func:`heap_regions`)."""
    off, size = list(heap_regions(cfg).values())[-1]
    return off + _a256(size)


def n_chunks(cfg) -> int:
    """(source, chunk) work units per source: max_tokens_per_rank in chunks of CHUNK tokens."""
    return -(-cfg.max_tokens_per_rank // CHUNK)


def scratch_ints(cfg) -> int:
    """int32 of a rank's private scratch: per source its token count, per (source, chunk, local expert) its rows
    and first row, per group its first fp4 scale tile."""
    R, L = cfg.n_ranks, cfg.n_local_experts
    return R + 2 * R * n_chunks(cfg) * L + cfg.n_groups


def check_config(cfg, group) -> None:
    """What the multi-node kernels need of ``cfg`` and ``group`` (ValueError / RuntimeError naming the limit)."""
    if group.kind != "ipc":
        raise RuntimeError(f"cfg.n_nodes={cfg.n_nodes}: several nodes need one process per rank (NVSHMEM has one PE "
                           f"per process): start the ranks with python -m cuep.run / torchrun / mpirun and call "
                           f"cuep.init_distributed(), not cuep.init()")
    G = getattr(group, "gpus_per_node", cfg.n_gpus_per_node)
    if G != cfg.n_gpus_per_node:
        raise ValueError(f"cfg.n_gpus_per_node={cfg.n_gpus_per_node} but the group's nodes have {G} ranks each "
                         f"(init_distributed(gpus_per_node=...) or the launcher's LOCAL_WORLD_SIZE)")
    if cfg.n_gpus_per_node > MAX_NODE_GPUS:
        raise ValueError(f"cfg.n_gpus_per_node={cfg.n_gpus_per_node}: at most {MAX_NODE_GPUS} GPUs per node")
    if cfg.n_nodes > MAX_NODES:
        raise ValueError(f"cfg.n_nodes={cfg.n_nodes}: at most {MAX_NODES} nodes")
    if (THREADS // 32) * cfg.n_local_experts * 4 > 48 * 1024:
        raise ValueError(f"n_local_experts={cfg.n_local_experts}: the multi-node kernels keep a per-warp histogram of "
                         f"the local experts in shared memory (at most {48 * 1024 // 64} local experts)")


class NodeState:
    """One rank's multi-node resources: the heap, the private state, scratch and row table, the parameter record."""

    def __init__(self, buf, rank) -> None:
        import cupy

        from . import nvshmem

        cfg, group = buf.cfg, buf.group
        self.heap = nvshmem.alloc(heap_bytes(cfg))
        self.heap_ptr = int(self.heap.data.ptr)
        G = cfg.n_gpus_per_node
        node, local = rank.rank // G, rank.rank % G
        peers = []
        for j in range(G):
            pe = node * G + j
            addr = self.heap_ptr if pe == rank.rank else nvshmem.peer_address(self.heap, pe)
            if not addr:
                raise RuntimeError(f"rank {rank.rank}: NVSHMEM cannot map node peer {pe}'s memory for load/store "
                                   f"(nvshmem_ptr is null): the GPUs of one node must reach each other over NVLink "
                                   f"or PCIe peer access")
            peers.append(addr)
        self.state = cupy.zeros(STATE_BASE + 4 * cfg.n_nodes + 2 * cfg.n_ranks, dtype=cupy.int64)
        self.scratch = cupy.zeros(scratch_ints(cfg), dtype=cupy.int32)
        self.row_of = cupy.full(cfg.n_ranks * cfg.max_tokens_per_rank * cfg.top_k, -1, dtype=cupy.int32)
        self.regions = regions = heap_regions(cfg)
        v = dict(
            rank=rank.rank, n_ranks=cfg.n_ranks, gpus_per_node=G, n_nodes=cfg.n_nodes, node=node, local=local,
            n_local=cfg.n_local_experts, n_experts=cfg.n_experts, top_k=cfg.top_k, hidden=cfg.hidden,
            max_tokens=cfg.max_tokens_per_rank, payload_bytes=cfg.payload_bytes,
            scale_bytes=cfg.fmt.scale_bytes(cfg.hidden), row_bytes=row_bytes(cfg), hdr_bytes=header_bytes(cfg),
            row_align=cfg.fmt.row_align, n_scales=cfg.n_scales, k_tiles=cfg.scale_k_tiles if cfg.n_scales else 0,
            n_groups=cfg.n_groups, shared=int(cfg.fused_shared_expert), capacity=cfg.capacity,
            n_chunks=n_chunks(cfg), combine_itemsize=cfg.combine_itemsize, comb_slots=max(cfg.top_k, cfg.n_nodes),
            small_tokens=cfg.small_batch_tokens, skip_a2a=int(cfg.skip_a2a), ar_size=cfg.allreduce_world_size,
            ar_index=rank.rank % cfg.allreduce_world_size,
            timeout_ns=int(buf.timeout_s * 1e9), err_ptr=rank.err_host_ptr, state_ptr=pointer(self.state),
            scratch_ptr=pointer(self.scratch), row_of_ptr=pointer(self.row_of), heap=self.heap_ptr,
            **{f"off_{k}": regions[k][0] for k in ("sig", "x_send", "hdr_send", "x_recv", "hdr_recv", "stage",
                                                  "c_send", "c_recv", "x_dir")})
        rec = np.zeros(1, NODE_PARAMS_DTYPE)
        for f in NODE_PARAMS_FIELDS:
            rec[f] = v[f]
        rec["node_heap"][0, :G] = peers
        self.params = rec
        self.launches: dict = {}  # prepared launches per (kernel, shared memory): internode._prepared

    def rearm(self) -> None:
        """Zero the signals and the private state (Buffer.reset, between its barriers)."""
        import cupy

        off, size = self.regions["sig"]
        cupy.cuda.runtime.memset(self.heap_ptr + off, 0, size)
        self.state.fill(0)
        self.row_of.fill(-1)

    def free(self) -> None:
        from . import nvshmem

        if self.heap is not None:
            nvshmem.free(self.heap)
            self.heap = None


def heap_need_env(cfg) -> int:
    """Set NVSHMEM's heap size (``NVSHMEM_SYMMETRIC_SIZE``, unless the user set it) to what a Buffer of ``cfg``
    needs plus 64 MiB for NVSHMEM's own, before NVSHMEM is initialised; returns the size in use."""
    from . import nvshmem

    return nvshmem.heap_bytes_needed_env(heap_bytes(cfg) + (64 << 20))


# ---- launches ----------------------------------------------------------------------------------------------------
def load_kernels():
    """The multi-node kernels' module on the current device (built on first use: NVRTC + nvJitLink, ~10 s)."""
    from . import nvshmem

    return nvshmem.load(KERNEL_FILE, first_kernel="cuep_nd_relay")


_DISPATCH_PACK = struct.Struct("<10Qif")  # NodeDispatchArgs: 10 pointers, num_tokens, global_scale
_COMBINE_PACK = struct.Struct("<5Qii")    # NodeCombineArgs: 5 pointers, num_tokens, mode


def _prepared(buf, name: str, smem: int = 0):
    """The prepared launch (:class:`cuep._kernels.PreparedLaunch`) of kernel ``name`` for this buffer's rank: its
    NodeParams written once, only the call's fields packed per launch. Made on first use, then reused."""
    ns = buf._ranks[0].node
    key = (name, smem)
    launch = ns.launches.get(key)
    if launch is None:
        from ._kernels import PreparedLaunch, allow_dynamic_smem

        fn = load_kernels().get_function(name)
        allow_dynamic_smem(fn, smem)
        dtype, pack = (COMBINE_CALL_DTYPE, _COMBINE_PACK) if name.startswith("cuep_nc_") else \
            (DISPATCH_CALL_DTYPE, _DISPATCH_PACK)
        launch = ns.launches[key] = PreparedLaunch(fn, THREADS, smem, dtype.itemsize, (0,), pack,
                                                    dtype.fields["a"][1])
        launch.write(dtype.fields["p"][1], ns.params.tobytes())
    return launch


def _wait_for_peers(buf) -> None:
    """Before a launch that waits on a peer: when ranks share a GPU, every rank's queued work is done and every rank
    is here (ep._before_launch); on the first launch of this buffer, every rank has compiled the kernels."""
    from .ep import _before_launch

    _before_launch(buf, "nvshmem/" + KERNEL_FILE)


def _smem_hist(cfg) -> int:
    return (THREADS // 32) * cfg.n_local_experts * 4


def dispatch(buf, x, topk_ids, topk_weights, global_scale: float, num_tokens: int, send: bool, recv: bool) -> None:
    """Launch this rank's dispatch kernels: the send half (``send``), the receive half (``recv``), or both."""
    cfg = buf.cfg
    r = buf._ranks[0]
    args = (pointer(x), pointer(topk_ids), pointer(topk_weights), pointer(r.tokens), pointer(r.scales),
            pointer(r.row_offsets), pointer(r.expert_ids), pointer(r.scales_offsets), pointer(r.src_info),
            pointer(r.row_src), num_tokens, global_scale)
    grid = buf.num_sms
    fmt = cfg.fmt.name
    if send:
        src = "bf16" if x.dtype.itemsize == 2 else "f32"
        _wait_for_peers(buf)
        _prepared(buf, f"cuep_nd_send_{fmt}_from_{src}")(grid, *args)
    if recv:
        smem = _smem_hist(cfg)
        _wait_for_peers(buf)
        _prepared(buf, "cuep_nd_relay")(grid, *args)
        _wait_for_peers(buf)
        _prepared(buf, "cuep_nd_count", smem)(grid, *args)
        _prepared(buf, "cuep_nd_offsets")(1, *args)
        _prepared(buf, f"cuep_nd_place_{fmt}", smem)(grid, *args)


def combine(buf, expert_out, topk_ids, topk_weights, residual, out, num_tokens: int, mode: int, send: bool,
            recv: bool) -> None:
    """Launch this rank's combine kernels: the send half, the receive half (relay and sum), or both."""
    cfg = buf.cfg
    args = (pointer(expert_out), pointer(topk_ids), pointer(topk_weights), pointer(residual), pointer(out),
            num_tokens, mode)
    grid = buf.num_sms
    cdt = "bf16" if cfg.combine_dtype == "bfloat16" else "f32"
    recv_smem = 4 * cfg.n_nodes
    if cfg.skip_a2a:  # nothing crosses ranks: the receive half does it all
        if recv:
            _wait_for_peers(buf)
            _prepared(buf, f"cuep_nc_recv_{cdt}", recv_smem)(grid, *args)
        return
    if send:
        _wait_for_peers(buf)
        _prepared(buf, f"cuep_nc_send_{cdt}", 4 * (cfg.n_ranks + 1))(grid, *args)
    if recv:
        _wait_for_peers(buf)
        _prepared(buf, f"cuep_nc_relay_{cdt}")(grid, *args)
        _wait_for_peers(buf)
        _prepared(buf, f"cuep_nc_recv_{cdt}", recv_smem)(grid, *args)


def describe(cfg) -> str:
    """One line: the heap a rank takes and how it splits."""
    gib = 2**30
    parts = ", ".join(f"{k} {v[1] / 2**20:.1f}" for k, v in heap_regions(cfg).items())
    return f"{heap_bytes(cfg) / gib:.3f} GiB NVSHMEM heap per rank ({parts} MiB)"

