"""Dispatch and combine: the functional API over a :class:`cuep.Buffer`.

Every call takes one array per local rank (a list; a bare array when the process drives a single rank, as with
one process per GPU) and returns the same. Launches for all local devices go out back to back, each on its
device's current stream; there is no host synchronisation inside a round, so dispatch -> grouped GEMM -> combine
can be captured in a CUDA graph. With one process per GPU each process launches its own rank's fused kernel and
the kernels meet through the peers' memory.

When several ranks share one device (protocol testing) a fused kernel could spin waiting for a rank whose kernel
cannot run until it finishes, so the phases (notify, send, receive) run as separate launches:

* one process, several ranks per device: every rank's notify, then every rank's send, then every rank's receive,
  in that order on the device's stream (the stream orders them);
* one process per rank, processes sharing a GPU (:attr:`cuep.Group.phase_barrier`): before each phase every
  process synchronises its stream and waits at a host barrier, so each phase starts only once every rank has
  finished the previous one, the same order as above. Tests only: slow, and not capturable in a CUDA graph.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from . import _kernels
from . import interop as _interop
from .buffer import Buffer
from .interop import tensor_ptr, torch_aware, torch_bindings
from .params import (CALL_FIELDS, COMBINE_PARAMS_DTYPE, DISPATCH_PARAMS_DTYPE, c_contiguous, call_struct,
                     kernel_argument, launch_record, pointer)
from .formats import GLOBAL_SCALE_MAX, GLOBAL_SCALE_MIN, ceil_div

PHASE_NOTIFY, PHASE_SEND, PHASE_RECV = 1, 2, 4
# with PHASE_SEND | PHASE_RECV in one call: a small bf16 round's local tokens go from x to their rows, unstaged;
# in combine, a partial-sum round with one destination rank finishes its tokens in the send half
PHASE_LOCAL_X = 8
_PHASES_ALL = PHASE_NOTIFY | PHASE_SEND | PHASE_RECV
MODE_PARTIAL, MODE_WEIGHTED, MODE_UNREDUCED = 0, 1, 2
_THREADS = 512
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_F32S, _I32S = (_F32,), (_I32,)
_new_object = object.__new__

_cupy = None
_ND = None  # cupy.ndarray, bound with the module by _cp()
_runtime = None  # cupy.cuda.runtime, bound with the module by _cp()


def _cp():
    """The cupy module (imported on first use, so ``import cuep`` loads no CUDA library; an ``import`` statement
    per call would cost a microsecond)."""
    global _cupy, _ND, _runtime
    if _cupy is None:
        import cupy

        _cupy, _ND, _runtime = cupy, cupy.ndarray, cupy.cuda.runtime
    return _cupy


@dataclass(slots=True)
class Dispatched:
    """One rank's dispatch result (arrays live in the buffer and are reused by its next dispatch).

    Attributes:
        tokens: [capacity, H] bfloat16 (bf16), [capacity, H] uint8 (fp8, e4m3 bits) or [capacity, H/2] uint8
            (nvfp4/mxfp4, two e2m1 per byte). Rows ``row_offsets[-1]`` and past are left as they were.
        scales: fp8 float32 [H/128, capacity]; nvfp4/mxfp4 uint8 128x4-tiled block scales (padding 0: a round
            zeroes only what earlier rounds wrote, so after writing into them call ``buf.reset()``); bf16 None.
        row_offsets: uint32 [n_groups + 1]: group g holds rows row_offsets[g] .. row_offsets[g+1].
        expert_ids: int32 [n_groups]: local expert of each group (the shared expert is id L, group 0).
        src_info: int32 [capacity, 2]: (token index on the source rank, top-k slot k) per row; (t, K) for
            shared-expert rows, (-1, -1) for padding.
        scales_offsets: uint32 [n_groups] for nvfp4/mxfp4 (group g's first scale tile is
            row_offsets[g] // 128 + scales_offsets[g]), else None.
        rank: the rank this result belongs to; num_tokens: tokens it dispatched.

    A dispatch with torch tensors gives torch views of the same arrays (uint32 ones as int32): :mod:`cuep.interop`.
    """

    tokens: object
    scales: object
    row_offsets: object
    expert_ids: object
    src_info: object
    scales_offsets: object
    rank: int
    num_tokens: int
    _topk_ids: object = field(default=None, repr=False)
    _has_weights: bool = field(default=False, repr=False)
    _buffer: Buffer | None = field(default=None, repr=False)
    _seq: int = field(default=0, repr=False)  # which dispatch of its buffer made it (1, 2, ...): see _rounds
    _torch: bool = field(default=False, repr=False)  # made by a torch call: the fields above are torch views


def _as_list(v, n: int, name: str) -> list:
    if n == 1 and type(v) is _ND:  # one rank, a bare array: the common case first
        return [v]
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise ValueError(f"{name} has {len(v)} entries; this process drives {n} rank(s), one array each")
        return list(v)
    if n == 1:
        return [v]
    raise TypeError(f"{name} must be a list of {n} arrays (one per local rank), got {type(v).__name__}")


def _check_buffer(buf, call: str) -> None:
    """``buf`` is an open :class:`Buffer` (the first argument of every call; a common slip is to leave it out)."""
    if type(buf) is Buffer and not buf._closed:
        return
    if not isinstance(buf, Buffer):
        raise TypeError(f"{call}: the first argument must be the cuep.Buffer of the group (cuep.Buffer(group, cfg)), "
                        f"got {type(buf).__name__}")
    buf._check_open()


# ---- the order of round halves (host-side state, checked before any launch) --------------------------------------
# A buffer runs one round half at a time. ``buf._rounds`` holds "dispatches" (how many dispatches this buffer has
# launched; each Dispatched keeps its number in ``_seq``) and "pending": None, ("dispatch", seq) after dispatch_async,
# or ("combine", seq, modes, expert_out addresses) after combine_async. The rules:
#   * dispatch, dispatch_async, combine and combine_async need nothing pending;
#   * dispatch_wait needs the pending dispatch_async and takes exactly its results;
#   * combine_wait needs the pending combine_async, on the same dispatched results, expert_out arrays and weights mode;
#   * combine / combine_async take the results of this buffer's latest dispatch (earlier ones were overwritten);
#   * buf.reset() forgets a pending half (after an error).
# Without these a wrong order would launch a receive that waits, on the device, for a send that never comes.
def _pending_name(p) -> str:
    return ("a dispatch_async (finish it with cuep.dispatch_wait(pending))" if p[0] == "dispatch" else
            "a combine_async (finish it with cuep.combine_wait(buf, expert_out, dispatched, ...), same arguments)")


def _check_nothing_pending(buf: Buffer, call: str) -> None:
    p = buf._rounds["pending"]
    if p is not None:
        raise RuntimeError(f"{call}: {_pending_name(p)} is still pending on this buffer; a buffer runs one round "
                           f"half at a time (use a second cuep.Buffer to overlap rounds; after an error, "
                           f"buf.reset() clears it)")


def _dtype_names(dtypes) -> str:
    return " or ".join(str(np.dtype(d)) for d in dtypes)


def _check_array(a, name: str, device: int, dtypes, ndim: int, layout: str = "", hint: str = "", align: int = 16):
    """Type, device, ndim, dtype, C-contiguity and alignment of one rank's CuPy array; every message names ``name``,
    what was expected, what was given and what to do. ``layout`` (e.g. ``"[N, H]"``) describes the axes; ``hint`` is
    appended to the dtype message (where the expected dtype comes from); ``align``: the bytes the start address
    must be a multiple of (16 for rows the kernels move with 16-byte vectors, 4 for int32/float32 read one by one;
    a misaligned address would be a fatal device fault, not an exception).

    O(1) host work: attributes CuPy stores (the memory pointer's device and address, the contiguity flag), no
    objects built unless a check fails; a right argument passes the first two tests (the host cost of a call)."""
    if type(a) is _ND and a.ndim == ndim and a.dtype in dtypes and a._c_contiguous:
        mem = a.data
        if mem.device_id == device and not mem.ptr % align:
            return
    if not isinstance(a, _cp().ndarray):
        if isinstance(a, np.ndarray):
            raise TypeError(f"{name} is a numpy.ndarray (host memory); pass a CuPy array on GPU {device}: "
                            f"`with cupy.cuda.Device({device}): {name.split('[')[0]} = cupy.asarray(...)`")
        raise TypeError(f"{name} must be a cupy.ndarray on GPU {device}, got {type(a).__name__} "
                        f"(convert it with cupy.asarray on that device)")
    mem = a.data
    if mem.device_id != device:
        raise ValueError(f"{name} is on GPU {a.device.id}; this rank runs on GPU {device}: copy it there with "
                         f"`with cupy.cuda.Device({device}): a = a.copy()`")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D{' ' + layout if layout else ''}, got shape {a.shape}")
    if a.dtype not in dtypes:
        want = _dtype_names(dtypes)
        raise TypeError(f"{name} has dtype {a.dtype}; expected {want}{' ' + hint if hint else ''} "
                        f"(convert with .astype(...))")
    if not c_contiguous(a):
        raise ValueError(f"{name} must be C-contiguous, got strides {a.strides} (use cupy.ascontiguousarray)")
    if a.size and mem.ptr % align:
        raise ValueError(f"{name} starts at address {a.data.ptr:#x}, not on a {align}-byte boundary (the kernels "
                         f"read it with {align}-byte loads): pass a fresh array, e.g. {name.split('[')[0]}.copy()")


@functools.lru_cache(maxsize=1)
def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _launch_order(buf: Buffer, phases: int):
    """(rank index, phase bits) in launch order: fused per rank, or phase by phase when ranks share a device
    (in this process, or across processes: :attr:`cuep.Group.phase_barrier`)."""
    ranks = range(len(buf._ranks))
    if not (buf.group.shares_devices or buf.group.phase_barrier):
        return [(i, phases) for i in ranks]
    return [(i, p) for p in (PHASE_NOTIFY, PHASE_SEND, PHASE_RECV) if phases & p for i in ranks]


def _before_launch(buf: Buffer, source: str) -> None:
    """The host-side ordering one process per rank needs before a launch of a kernel from ``source``.

    * :attr:`cuep.Group.phase_barrier` (ranks share a GPU): finish this rank's queued work, then wait until every
      rank has, so this phase never waits on a peer phase that is still queued behind another process's kernel.
    * otherwise, the first launch from ``source`` on this buffer: a barrier after compiling, so that no rank's
      bounded device-side wait runs out while a peer is still compiling the same kernels.

    The first barrier for ``source`` waits as long as the rendezvous does (a peer may still be compiling); the
    later ones are part of a round and bounded by ``buf.timeout_s``, like the device-side waits. A failed barrier
    (a peer died or did not arrive: :class:`cuep.EPError` naming it) marks the buffer failed: it refuses rounds
    until ``buf.reset()`` (:meth:`cuep.Buffer.check`).
    """
    group = buf.group
    if group.kind != "ipc":
        return
    first = source not in buf._launched
    if not (group.phase_barrier or first):
        return
    from .group import EPError

    if group.phase_barrier:
        import cupy

        with cupy.cuda.Device(group.devices[0]):
            cupy.cuda.get_current_stream().synchronize()
    buf._launched.add(source)
    try:
        group.barrier(None if first else buf.timeout_s)
    except EPError as e:
        buf._host_error = e
        raise


def _dispatch_launch(buf: Buffer, staged: bool) -> tuple[int, int]:
    """(threads per block, dynamic shared memory) of the dispatch kernel.

    The send phase keeps every source's tallies and the per-expert bases (or a small round's bookkeeping, the
    larger of the two) in shared memory, plus, when the token
    must be encoded (a quantized format, or bf16 from float32), one staging area per warp; warps are cut so the
    block still fits the device's shared memory.
    """
    cached = buf._launch_cache.get(("dispatch", staged))
    if cached:
        return cached
    import cupy

    cfg = buf.cfg
    tally = _a16(4 * cfg.n_source_ranks * (cfg.n_experts + 2))  # tally rows: E counts, tokens, messages
    fixed = max(tally + _a16(4 * cfg.n_experts), _small_book_bytes(cfg), _local_layout_bytes(cfg))
    staging = _a16(cfg.payload_bytes) + _a16(cfg.message.scale_bytes) if staged else 0
    limit = cupy.cuda.Device(buf._ranks[0].device).attributes["MaxSharedMemoryPerBlockOptin"] - 2048
    warps = _THREADS // 32
    if staging:
        warps = min(warps, (limit - fixed) // staging)
        if warps < 1:
            raise ValueError(f"hidden={cfg.hidden}: one encoded token ({staging} B) does not fit in shared memory "
                             f"next to the tallies ({fixed} B); dispatch bf16 input or a smaller hidden size")
    # receive phase: tallies, group offsets, scale tiles, and each staged source's message tokens (uint16)
    recv = tally + 4 * (-(-(cfg.n_groups + 1) // 4) * 4 + cfg.n_groups) + 2 * cfg.n_source_ranks * cfg.small_batch_tokens
    buf._launch_cache[("dispatch", staged)] = out = (32 * warps, max(fixed + warps * staging, recv))
    return out


def _local_layout_bytes(cfg) -> int:
    """Shared memory before the per-warp staging of a one-rank group's placement (dispatch/local.cuh:
    local_layout_bytes): a small round's book, then the groups' first rows [G + 1] and first scale tiles [G]; a
    larger round's the same without the book, with the local experts' row counts [L]. 0 for several ranks."""
    if cfg.n_ranks != 1:
        return 0
    groups = _a16(4 * (cfg.n_groups + 1)) + _a16(4 * cfg.n_groups)
    small = _small_book_bytes(cfg) + groups if cfg.small_batch_tokens else 0
    return max(small, _local_groups_bytes(cfg))


def _local_groups_bytes(cfg) -> int:
    """Shared memory of a larger one-rank round's layout (the placement before its staging): the groups' first rows
    [G + 1] and first scale tiles [G], the local experts' row counts [L] (before them, the count's histogram)."""
    return _a16(4 * (cfg.n_groups + 1)) + _a16(4 * cfg.n_groups) + _a16(4 * cfg.n_local_experts)


def _a16(n: int) -> int:
    """``n`` rounded up to 16 bytes: the kernels align every part of their shared memory so."""
    return -(-n // 16) * 16


def _small_book_bytes(cfg) -> int:
    """Shared memory of a small round's bookkeeping (small_book_bytes in dispatch.cu; block 0 computes it in notify):
    per choice its expert and position (uint16), per rank a token mask (ceil(D / 32) words), per token its rank
    mask, per expert a token mask (ceil(D / 32) words), the histogram, 8 message counts. 0 when small rounds are
    off."""
    D, K, E = cfg.small_batch_tokens, cfg.top_k, cfg.n_experts
    if not D:
        return 0
    W = -(-D // 32)
    return 2 * _a16(2 * D * K) + _a16(4 * 8 * W) + _a16(4 * D) + _a16(4 * E * W) + _a16(4 * E) + 4 * 8


def _blocks(buf: Buffer, threads: int) -> int:
    """Blocks per EP kernel: one per SM of ``buf.num_sms``.

    Fewer blocks for small rounds was measured slower (N=16 decode: 62 us against 32 us in a graph on H100): the
    receive-side copies to a token's other local experts need many SMs even when there are few messages. The fused
    kernel needs all blocks co-resident, which one block per SM guarantees.
    """
    return buf.num_sms


# A small one-rank round's chunks (cuda_src/dispatch/local.cuh: dispatch_local's plan), worked out here once per N
# and passed in DispatchArgs.chunk_plan: the kernel's constants they follow (tests/test_host_path_cpu.py checks them).
_WARP_SPAN = 256      # kWarpSpan (formats/elements.cuh): values per warp step
_ENCODE_STEPS = 4     # kEncodeSteps (dispatch.cu): spans per encode step
_MAX_CHUNKS = 255     # kMaxChunks (dispatch/messages.cuh)
_MIN_PAD_WARPS = 4    # kMinPadWarps (dispatch/local.cuh): a block's warps left free for padding
_PARTS_SHIFT = 28     # kPartsShift (dispatch/local.cuh): where a small round's plan keeps log2 of its parts


def _chunk_units(items: int, units: int, align: int, warps: int) -> int:
    """chunk_units (cuda_src/ep/sync.cuh) on the host: the chunk size, in units and a multiple of ``align``, that
    cuts each of ``items`` rows of ``units`` units so that ``warps`` warps all get work (whole rows when items
    outnumber warps)."""
    per = max(1, min(warps // items if items > 0 else 1, ceil_div(units, align)))  # chunks a row
    return ceil_div(ceil_div(units, per), align) * align


def _pack_plan(per: int, units: int) -> int:
    """A chunk plan as the kernels take it (take_chunk_plan, cuda_src/ep/sync.cuh): ``per | chunks << 16`` for
    chunks of ``per`` units over a row of ``units``; 0 (the kernels' fallback) when either does not fit its field."""
    chunks = ceil_div(units, per)
    return per | chunks << 16 if per < 1 << 16 and chunks < 1 << 15 else 0


def _small_round_chunks(n: int, hidden: int, blocks: int, warps: int, quantized: bool, top_k: int = 1) -> int:
    """How a small one-rank round of ``n`` tokens cuts each token row into items (one warp each) on a grid of
    ``blocks`` x ``warps`` warps: ``spans | chunks << 16 | log2(parts) << 28`` (spans of 256 values per chunk,
    items per (token, chunk), chunks per token).

    Chunks split a token only while warps outnumber tokens (at most kMaxChunks per token); a quantized round whose
    items would leave fewer than kMinPadWarps warps of a block free for padding takes chunks of whole encode steps,
    as few as make that room. While the (token, chunk) pairs are at most twice the blocks, each pair's rows are split
    over parts (a power of two, at most ``top_k``, at most 8 items a block, and leaving a quantized round its
    padding room). The kernel takes any plan that covers the row exactly.
    """
    n_spans = ceil_div(hidden, _WARP_SPAN)
    grid_warps = blocks * warps
    spans = max(_chunk_units(n, n_spans, 1, grid_warps), ceil_div(n_spans, _MAX_CHUNKS))
    if quantized:
        room = grid_warps - _MIN_PAD_WARPS * blocks
        max_chunks = min(room // n, n_spans) if n > 0 else n_spans
        if max_chunks > 0 and ceil_div(n_spans, spans) > max_chunks:
            spans = ceil_div(ceil_div(n_spans, max_chunks), _ENCODE_STEPS) * _ENCODE_STEPS
    plan = _pack_plan(spans, n_spans)
    pairs = n * ceil_div(n_spans, spans)
    if plan and 0 < pairs <= 2 * blocks:
        most = min(top_k, grid_warps // pairs, 8 * blocks // pairs, 32)
        if quantized:
            most = min(most, (grid_warps - _MIN_PAD_WARPS * blocks) // pairs)
        if most > 1:
            plan |= (most.bit_length() - 1) << _PARTS_SHIFT
    return plan


def _combine_chunks(n: int, hidden: int, blocks: int, warps: int) -> int:
    """How the one-rank combine (cuda_src/combine/local.cuh) cuts each of ``n`` output rows into items (one warp
    each) on a grid of ``blocks`` x ``warps`` warps, as chunk_units cuts them: ``vectors | chunks << 16`` (16-byte
    vectors per chunk, a multiple of 32; chunks per token)."""
    n_vec = hidden // 8
    return _pack_plan(_chunk_units(n, n_vec, 32, blocks * warps), n_vec)


def _combine_chunks_of(buf, host, n: int) -> int:
    """:func:`_combine_chunks` of this buffer's launches (``buf.num_sms`` blocks of _THREADS), kept per N."""
    c = host.combine_chunks.get(n)
    if c is None:
        c = host.combine_chunks[n] = _combine_chunks(n, host.hidden, buf.num_sms, _THREADS // 32)
    return c


#: The one-rank bf16 combine keeps 8 rows' loads in flight from this many 16-byte vectors an item (3 a lane) on.
#: H200 A/B (one rank, H = 7168): N = 151-1024, chunks of 96-448 vectors, 1.04x-1.15x faster than 4 rows, cold and
#: warm; N = 1-128 (32-64 vectors) level cold, 1-2% slower warm (docs/bench/h200x1/c014947/).
_WIDE_COMBINE_VECTORS = 96


def _combine_local_name(host, plan: int) -> str:
    """The one-rank combine kernel of a round whose chunk plan (:func:`_combine_chunks_of`) is ``plan``: the one
    with 8 rows' loads in flight (cuda_src/combine/local.cuh kRows) where every item is a whole token (one chunk a
    token, or no plan: a token a warp) or a chunk of at least _WIDE_COMBINE_VECTORS vectors, and the combine dtype
    is bf16, else the one with 4."""
    wide = plan >> 16 <= 1 or (plan & 0xFFFF) >= _WIDE_COMBINE_VECTORS
    return host.combine_wide if host.combine_wide and wide else host.combine_names[True]


_COMBINE_RING = 2                # kCombineRing in cuda_src/combine.cu (stages of the bf16 partial-sum load ring)
_COMBINE_PIECE_BYTES = 4 * 2 * 32 * 16  # kCombinePieceBytes: 4 rows x 64 vectors of 16 bytes
#: Dynamic shared memory of combine's bf16 load ring (kCombineRingBytes: every bf16 partial-sum send needs it).
COMBINE_RING_BYTES = _COMBINE_RING * _COMBINE_PIECE_BYTES * (_THREADS // 32)


def _launch(fn, buf: Buffer, threads: int, smem: int, params_dtype, ep, **call) -> None:
    """Launch ``fn`` with its one by-value struct: ``ep`` (the rank's EPParams record) and the call's fields by
    name (:func:`cuep.params.launch_record`)."""
    rec = launch_record(params_dtype, ep, **call)
    fn((_blocks(buf, threads),), (threads,), (kernel_argument(rec),), shared_mem=smem)


class _Host:
    """What a buffer's calls need on the host, worked out once per buffer (the host cost of a call: issue 24):
    argument names per rank (for messages), sizes read from the config, the launch order per phase set, and the
    prepared launches (:class:`cuep._kernels.PreparedLaunch`) per (rank, kernel, shared memory)."""

    __slots__ = ("names", "orders", "launches", "hidden", "top_k", "max_tokens", "capacity", "fmt", "cdt",
                 "combine_suffix", "where", "views", "one_rank", "small", "chunks", "combine_chunks",
                 "offsets_smem", "results", "plans", "combine_names", "combine_wide", "devices", "x_dtypes", "cdts",
                 "split_fits", "ipc", "recv_name", "recv_launch", "single", "status", "torch_results",
                 "torch_views", "steps", "combine_steps")

    def __init__(self, buf: Buffer):
        cfg = buf.cfg
        self.names = []
        for r in buf._ranks:
            tag = f"[rank {r.rank}]"
            self.names.append({"tag": tag, **{a: f"{a}{tag}" for a in ("x", "topk_ids", "topk_weights",
                                                                        "expert_out", "residual")}})
        self.orders: dict = {}
        self.launches: dict = {}
        self.views: dict = {}  # combine outputs' leading-row views, per (rank, mode, N)
        self.hidden, self.top_k, self.max_tokens = cfg.hidden, cfg.top_k, cfg.max_tokens_per_rank
        self.capacity, self.fmt = cfg.capacity, cfg.fmt.name
        self.cdt = _bf16() if cfg.combine_dtype == "bfloat16" else _F32
        self.devices = tuple(r.device for r in buf._ranks)
        self.x_dtypes, self.cdts = (_bf16(), _F32), (self.cdt,)
        self.ipc = buf.group.kind == "ipc"  # one process per rank: host barriers around launches (_before_launch)
        self.recv_name = f"dispatch.cu:cuep_dispatch_{self.fmt}_from_bf16"  # dispatch_wait's kernel
        self.recv_launch = None  # its prepared launch on a one-rank buffer (_dispatch_wait_single)
        # the calls' short path (_dispatch_single): one local rank of a one-node group, one launch per call
        self.single = len(buf._ranks) == 1 and buf._ranks[0].node is None and not (
            buf.group.shares_devices or buf.group.phase_barrier)
        self.status = buf._ranks[0].err_status  # its status word: nonzero after a failure (Buffer.check)
        self.combine_suffix = "bf16" if cfg.combine_dtype == "bfloat16" else "f32"
        self.where = f"(cfg.combine_dtype={cfg.combine_dtype!r})"
        # a one-rank group's fused calls take the one-rank kernels (a small round or a larger one, any format)
        self.one_rank, self.small = cfg.n_ranks == 1, cfg.small_batch_tokens
        # per N <= min(small, _SPLIT_TOKENS): whether a small round that encodes may take the split layout's kernel
        self.split_fits = _split_fits(buf, cfg.hidden, self.small, self.fmt != "bf16", cfg.top_k) \
            if self.one_rank and self.small else ()
        self.offsets_smem = _a16(4 * (cfg.n_groups + 1))  # the one-rank combine's copy of row_offsets
        # a Dispatched's first fields per rank (its persistent outputs and rank), the launches of each dispatch
        # route (_dispatch_plan), the combine kernel after a protocol / one-rank dispatch
        self.results = [(r.tokens, r.scales, r.row_offsets, r.expert_ids, r.src_info, r.scales_offsets, r.rank)
                        for r in buf._ranks]
        self.plans: dict = {}
        self.steps: dict = {}  # the one-rank short path's launch per (phases, src) and N (_dispatch_step)
        self.combine_steps: dict = {}  # its combine's per (phases, mode, N) (_combine_step)
        self.chunks: dict = {}  # a small one-rank round's chunk plan per N (_small_round_chunks), per input dtype
        self.combine_chunks: dict = {}  # the one-rank combine's per N (_combine_chunks_of)
        self.torch_results = None  # (the torch short path) torch views of results[0], and of combine's views
        self.torch_views: dict = {}
        self.combine_names = {local: f"combine.cu:cuep_combine_{'local_' if local else ''}{self.combine_suffix}"
                              for local in (False, True)}
        # the one-rank combine with 8 rows in flight, for rounds of long items (bf16 only: _combine_local_name)
        self.combine_wide = "combine.cu:cuep_combine_local_wide_bf16" if self.combine_suffix == "bf16" else None

    def order(self, buf: Buffer, phases: int) -> list:
        o = self.orders.get(phases)
        if o is None:
            o = self.orders[phases] = _launch_order(buf, phases)
        return o


def _host(buf: Buffer) -> _Host:
    h = buf._launch_cache.get("host")
    if h is None:
        h = buf._launch_cache["host"] = _Host(buf)
    return h


def _combine_fixed(r) -> dict:
    """A rank's arrays that every combine launch reads, as CombineArgs pointer fields."""
    return {name: pointer(getattr(r, name)) for name in (
        "src_info", "row_src", "row_weight", "msg_rows", "msg_token", "msg_j", "msg_count", "row_offsets")}


def _prepared(buf: Buffer, i: int, name: str, threads: int, smem: int):
    """The prepared launch of kernel ``file.cu:name`` for local rank ``i``, made on first use on the rank's device
    (the current one), then reused by every call: the rank's EPParams and fixed arrays are packed once; a call
    packs its own fields, the start of the struct (``launch.launch_call(grid, *values)``: params.CALL_FIELDS)."""
    host = _host(buf)
    key = (i, name, smem)
    hit = host.launches.get(key)
    if hit is not None:
        return hit
    from ._kernels import PreparedLaunch
    from .params import span_struct

    r = buf._ranks[i]
    kind = "dispatch" if name.startswith("dispatch.cu:") else "combine"
    dtype = DISPATCH_PARAMS_DTYPE if kind == "dispatch" else COMBINE_PARAMS_DTYPE
    fixed = _dispatch_outputs(r) if kind == "dispatch" else _combine_fixed(r)
    pack, offset, names = call_struct(dtype)
    call = CALL_FIELDS[kind]
    if names[:len(call)] != call or set(names[len(call):]) != set(fixed):
        raise RuntimeError(f"cuep.params {kind} call fields {names}: not {call} then the fixed {sorted(fixed)}")
    fn = _kernel(name, smem)
    launch = PreparedLaunch(fn, threads, smem, dtype.itemsize, (0,), pack, offset)
    launch.write(dtype.fields["ep"][1], r.params.tobytes())
    launch.pack.pack_into(launch.raw, offset, *(fixed.get(n, 0) for n in names))
    launch.set_call(*span_struct(dtype, call))
    if "_local_" in name:  # a one-rank kernel, which waits for the kernel before it first (await_previous_grid)
        launch.make_dependent(buf.num_sms)
    host.launches[key] = launch
    return launch


def _dispatch_plan(buf: Buffer, host: _Host, i: int, ph: int, src: str, route: int):
    """The prepared launch of local rank ``i``'s dispatch of phases ``ph`` from ``src`` input by ``route``: 0 the
    protocol's kernel; 1 a small one-rank round; 2 a larger one-rank round; 3 a small one laid out split
    (cuda_src/dispatch/local.cuh).
    Worked out once per key, then reused."""
    key = (i, ph, src, route)
    launch = host.plans.get(key)
    if launch is None:
        threads, smem = _dispatch_launch(buf, staged=host.fmt != "bf16" or src != "bf16")
        kind = ("", "local_", "local_large_", "local_split_")[route]
        launch = host.plans[key] = _prepared(buf, i, f"dispatch.cu:cuep_dispatch_{kind}{host.fmt}_from_{src}",
                                             threads, smem)
        if route & 1 and src not in host.chunks:  # (small rounds: 1, 3)
            host.chunks[src] = [_small_round_chunks(n, host.hidden, buf.num_sms, threads // 32, host.fmt != "bf16",
                                                    host.top_k) for n in range(host.small + 1)]
    return launch


def _dispatch_outputs(r) -> dict:
    """A rank's dispatch outputs and handle arrays as DispatchArgs pointer fields."""
    return {name: pointer(getattr(r, attr)) for name, attr in (
        ("scales_out", "scales"), ("row_offsets", "row_offsets"), ("expert_ids", "expert_ids"),
        ("scales_offsets", "scales_offsets"), ("src_info", "src_info"), ("row_src", "row_src"),
        ("row_weight", "row_weight"), ("msg_rows", "msg_rows"), ("msg_token", "msg_token"), ("msg_j", "msg_j"),
        ("msg_count", "msg_count"), ("scale_tile_rows", "scale_tile_rows"))}


def _kernel(name: str, smem: int):
    """The kernel ``file.cu:name`` for the current device, allowed ``smem`` bytes of dynamic shared memory."""
    file, fname = name.split(":")
    fn = _kernels.function(file, fname)
    _kernels.allow_dynamic_smem(fn, smem)
    return fn


def _check_global_scale(global_scale) -> None:
    # a float in range as float64 is in range as float32 too (the bounds are powers of two, rounding is monotonic)
    if type(global_scale) is float and GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX:
        return
    if isinstance(global_scale, (bool, np.bool_)) or not (
            isinstance(global_scale, (int, float, np.integer, np.floating)) and math.isfinite(global_scale)
            and GLOBAL_SCALE_MIN <= np.float32(global_scale) <= GLOBAL_SCALE_MAX):
        raise ValueError(f"global_scale={global_scale!r} must be a finite positive number in [2**-100, 2**100] "
                         "(nvfp4's global scale, as float32)")


def _rows_ptr(a, rows: int, cols: int, dtypes, device: int, mask: int) -> int:
    """The device address of ``a`` if it is a C-contiguous [rows, cols] CuPy array (rows, cols > 0: an address
    that is never 0) of one of ``dtypes`` on ``device`` whose address has no bit of ``mask`` set, else 0: the common
    case of an argument in a few reads of CuPy's stored fields (ndim, size and len fix the shape without building
    the shape tuple). 0 sends the caller to the full checks, which raise with a message (or accept what this test
    leaves to them, e.g. 0 rows). (:func:`cuep.interop.tensor_ptr` is the same test for a torch tensor.)"""
    if type(a) is not _ND or not rows or a.dtype not in dtypes or not a._c_contiguous or a.ndim != 2 \
            or len(a) != rows or a.size != rows * cols:
        return 0
    m = a.data
    ptr = m.ptr
    return ptr if m.device_id == device and not ptr & mask else 0


def _validate_dispatch(host: _Host, xs: list, ids: list, ws: list, global_scale) -> list:
    """Check dispatch's arguments (before any launch) and return each rank's token count."""
    if type(global_scale) is not float or not GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX:
        _check_global_scale(global_scale)
    hidden, top_k, x_dtypes = host.hidden, host.top_k, host.x_dtypes
    ns = []
    for i, dev in enumerate(host.devices):
        x, t, w = xs[i], ids[i], ws[i]
        n = len(x) if type(x) is _ND and x.ndim == 2 else 0
        if not (n <= host.max_tokens and _rows_ptr(x, n, hidden, x_dtypes, dev, 15)
                and _rows_ptr(t, n, top_k, _I32S, dev, 3) and (w is None or _rows_ptr(w, n, top_k, _F32S, dev, 3))):
            n = _check_dispatch_args(host, i, x, t, w)
        ns.append(n)
    return ns


def _check_dispatch_args(host: _Host, i: int, x, t, w) -> int:
    """The full checks of local rank ``i``'s dispatch arguments, each failure a message naming the argument and
    what it should be; returns the rank's token count."""
    names, dev = host.names[i], host.devices[i]
    _check_array(x, names["x"], dev, host.x_dtypes, 2, "[N, H]")
    n, h = x.shape
    if h != host.hidden:
        raise ValueError(f"{names['x']} has shape {x.shape}: {h} columns, but cfg.hidden is {host.hidden}")
    if n > host.max_tokens:
        raise ValueError(f"{names['x']} has {n} tokens (shape {x.shape}), more than cfg.max_tokens_per_rank="
                         f"{host.max_tokens}: split the batch, or build the Buffer with a larger "
                         f"max_tokens_per_rank")
    _check_array(t, names["topk_ids"], dev, _I32S, 2, "[N, top_k]", align=4)
    if t.shape != (n, host.top_k):
        raise ValueError(f"{names['topk_ids']} has shape {t.shape}; expected ({n}, {host.top_k}) = "
                         f"(tokens of {names['x']}, top_k)")
    if w is not None:
        _check_array(w, names["topk_weights"], dev, _F32S, 2, "[N, top_k]", align=4)
        if w.shape != (n, host.top_k):
            raise ValueError(f"{names['topk_weights']} has shape {w.shape}; expected ({n}, {host.top_k}) = "
                             f"(tokens of {names['x']}, top_k)")
    return n


def _validate_ids(buf: Buffer, ids: list) -> None:
    """Host-side check of routing values (synchronises): ids in [0, E), no expert twice in a token's row."""
    import cupy

    E = buf.cfg.n_experts
    for r, a in zip(buf._ranks, ids):
        if a.size == 0:
            continue
        with cupy.cuda.Device(r.device):
            bad = cupy.argwhere((a < 0) | (a >= E))
            if bad.size:
                t, k = (int(v) for v in bad[0].get())
                raise ValueError(f"topk_ids[rank {r.rank}][{t}, {k}] = {int(a[t, k].get())} is outside [0, {E}) "
                                 f"(n_experts)")
            srt = cupy.sort(a, axis=1)
            dup = cupy.argwhere(srt[:, 1:] == srt[:, :-1])
            if dup.size:
                t, k = (int(v) for v in dup[0].get())
                raise ValueError(f"topk_ids[rank {r.rank}][{t}] chooses expert {int(srt[t, k].get())} twice; each "
                                 f"token's top-k experts must be distinct")


_SPLIT_TOKENS = 32  # kSplitTokens (cuda_src/dispatch/local.cuh): the largest small round laid out split
_SPLIT_BOOK_WARPS = 8  # kBookWarps there: the warps that lay a split round out


def _route(host: _Host, phases: int, n: int, src: str) -> int:
    """Which kernel a rank's dispatch launch takes: 0 the protocol; one rank's fused call
    (cuda_src/dispatch/local.cuh) 1 a small round (n <= small_batch_tokens), 2 a larger one, 3 a small round laid
    out split (it encodes: not bf16 from bf16; n <= _SPLIT_TOKENS; its items fit the item warps: _split_fits)."""
    if not (host.one_rank and phases == _PHASES_ALL):
        return 0
    if not (host.small and n <= host.small):
        return 2
    return 3 if n <= _SPLIT_TOKENS and (host.fmt != "bf16" or src != "bf16") and host.split_fits[n] else 1


def _split_fits(buf: Buffer, hidden: int, small: int, quantized: bool, top_k: int) -> tuple:
    """Per N = 0 .. min(small, _SPLIT_TOKENS): whether a small one-rank round of N tokens may take the split
    layout's kernel. The block needs 2 x kBookWarps warps or more, and every item of the round's chunk plan
    (:func:`_small_round_chunks`; item i on warp i // blocks) must lie on the warps before the last kBookWarps: only
    those prepare their first item (its weights, its encode) while the others lay the round out."""
    threads, _ = _dispatch_launch(buf, staged=True)  # (a round that encodes: staged, from bf16 or f32 alike)
    warps, blocks = threads // 32, buf.num_sms
    item_warps = (warps - _SPLIT_BOOK_WARPS) * blocks
    return tuple(warps >= 2 * _SPLIT_BOOK_WARPS and _small_round_items(n, hidden, blocks, warps, quantized, top_k)
                 <= item_warps for n in range(min(small, _SPLIT_TOKENS) + 1))


def _small_round_items(n: int, hidden: int, blocks: int, warps: int, quantized: bool, top_k: int) -> int:
    """The items (warps' work units) of a small one-rank round of ``n`` tokens, as the kernel reads its chunk plan
    (take_chunk_plan; no plan: a span a chunk, at most kMaxChunks a token)."""
    plan = _small_round_chunks(n, hidden, blocks, warps, quantized, top_k)
    n_spans = ceil_div(hidden, _WARP_SPAN)
    per, chunks = plan & 0xFFFF, (plan & ~(7 << _PARTS_SHIFT)) >> 16
    if per < 1 or chunks < 1 or (chunks - 1) * per >= n_spans or chunks * per < n_spans:
        return n * ceil_div(n_spans, ceil_div(n_spans, _MAX_CHUNKS))  # (the kernel's fallback: no parts either)
    return n * chunks << (plan >> _PARTS_SHIFT & 7)


def _with_one_call(phases: int) -> int:
    """``phases`` plus PHASE_LOCAL_X when one call both sends and receives: every launch of such a call says so,
    so a rank's send and receive phases agree on it (dispatch: local tokens from x; combine: a partial-sum round
    with one destination rank finishes its tokens in the send half)."""
    return phases | PHASE_LOCAL_X if phases & PHASE_SEND and phases & PHASE_RECV else phases


def _single_host(buf):
    """The buffer's :class:`_Host` when a call may take the short path (one local rank of a one-node group, an
    open buffer with no failure, launches prepared by an earlier call), else None."""
    if type(buf) is not Buffer or buf._closed:
        return None
    host = buf._launch_cache.get("host")
    if host is None or not host.single or host.status[0] or buf._host_error is not None:
        return None
    return host


def _dispatch_single(buf, x, topk_ids, topk_weights, global_scale, phases: int):
    """A dispatch call's common case in few steps, the same launch as :func:`_dispatch`: one local rank (bare
    arrays, the rank's device current), an open buffer with no failure and nothing pending, arguments right and a
    launch already prepared. Returns the :class:`Dispatched`, or None (nothing done) for :func:`_dispatch`, which
    handles every other case and raises with a message. (One function, few attribute reads: every Python call
    and lookup here is part of the call's host cost.)"""
    if type(buf) is not Buffer or buf._closed:
        return None
    host = buf._launch_cache.get("host")
    if host is None or not host.single or host.status[0] or buf._host_error is not None:
        return None
    rounds = buf._rounds
    if rounds["pending"] is not None or type(x) is not _ND or x.ndim != 2 or type(global_scale) is not float \
            or not GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX:
        return None
    n, dev, w = len(x), host.devices[0], topk_weights
    xp = _rows_ptr(x, n, host.hidden, host.x_dtypes, dev, 15) if 0 < n <= host.max_tokens else 0
    ip = _rows_ptr(topk_ids, n, host.top_k, _I32S, dev, 3) if xp else 0
    wp = _rows_ptr(w, n, host.top_k, _F32S, dev, 3) if ip and w is not None else 0
    if not ip or w is not None and not wp:
        return None
    dt = x.dtype
    return _dispatch_round(buf, host, phases, "bf16" if dt is host.x_dtypes[0] or dt == host.x_dtypes[0] else "f32", n,
                           dev, None, host.results[0], xp, ip, wp, global_scale, topk_ids, w is not None)


def _dispatch_round(buf, host, phases: int, src: str, n: int, dev: int, stream, fixed: tuple, x_ptr: int,
                    ids_ptr: int, w_ptr: int, global_scale: float, topk_ids, has_weights: bool):
    """The one-local-rank dispatch's launch (from ``src`` input, on ``stream``: None is CuPy's current on ``dev``,
    a handle a torch call's) and the round's bookkeeping, once :func:`_dispatch_single` or
    :func:`_dispatch_single_torch` has tested the arguments; returns the :class:`Dispatched` (``fixed``: its first
    fields, the rank's persistent outputs as CuPy arrays or torch views), or None when the launch is not prepared
    or ``dev`` is not current (nothing done)."""
    steps = host.steps.get((phases, src))
    step = steps[n] if steps is not None else None
    if step is None:
        step = _dispatch_step(buf, host, phases, src, n)
        if step is None:
            return None
    launch, ph, chunks, local = step
    if (not local and host.ipc and "dispatch.cu" not in buf._launched) or _runtime.getDevice() != dev:
        return None
    rounds = buf._rounds
    seq = rounds["dispatches"] + 1
    # the Dispatched, filled in place (half the time of calling its dataclass __init__ with 13 arguments)
    d = _new_object(Dispatched)
    d.tokens, d.scales, d.row_offsets, d.expert_ids, d.src_info, d.scales_offsets, d.rank = fixed
    d.num_tokens, d._topk_ids, d._has_weights, d._buffer, d._seq = n, topk_ids, has_weights, buf, seq
    d._torch = stream is not None
    # launch.launch_call(...) without its call: the call's span packed, then the launch
    launch.call.pack_into(launch.raw, launch.call_offset, x_ptr, ids_ptr, w_ptr, n, global_scale, ph, chunks)
    _kernels._launch_raw(launch.func, buf.num_sms, launch.block, launch.smem, launch.argv_ptr, stream, dev,
                         launch.dependent)
    rounds["local"] = local
    rounds["dispatches"] = seq
    if not phases & PHASE_RECV:
        rounds["pending"] = ("dispatch", seq)
    return d


def _chunk_plan(host, src: str, n: int, route: int) -> int:
    """The chunk plan a dispatch launch of ``route`` passes: a small one-rank round's (routes 1 and 3, made with
    its launch by :func:`_dispatch_plan`), else 0."""
    return host.chunks[src][n] if route & 1 else 0


def _dispatch_step(buf, host, phases: int, src: str, n: int):
    """A one-local-rank dispatch call's launch for (``phases``, ``src`` input, ``n`` tokens): (prepared launch,
    the phases it is launched with, its chunk plan, whether it is a one-rank kernel), kept per (phases, src) in a
    list indexed by N once the launch is prepared (the first call of a route takes :func:`_dispatch`); None before
    that."""
    route = _route(host, phases, n, src)
    launch = host.plans.get((0, phases, src, route))
    if launch is None:
        return None
    steps = host.steps.get((phases, src))
    if steps is None:
        steps = host.steps[(phases, src)] = [None] * (host.max_tokens + 1)
    step = steps[n] = (launch, _with_one_call(phases), _chunk_plan(host, src, n, route), route != 0)
    return step


def _dispatch(buf: Buffer, x, topk_ids, topk_weights, global_scale: float, phases: int, validate: bool = False):
    call = "cuep.dispatch" if phases & PHASE_RECV else "cuep.dispatch_async"
    recv = bool(phases & PHASE_RECV)
    if type(buf) is not Buffer or buf._closed:
        _check_buffer(buf, "cuep.dispatch")
    buf.check()
    host = _host(buf)
    n = len(host.devices)
    xs, ids = _as_list(x, n, "x"), _as_list(topk_ids, n, "topk_ids")
    ws = _as_list(topk_weights, n, "topk_weights") if topk_weights is not None else [None] * n
    ns = _validate_dispatch(host, xs, ids, ws, global_scale)
    rounds = buf._rounds
    if rounds["pending"] is not None:
        _check_nothing_pending(buf, call)
    if validate:
        _validate_ids(buf, ids)
    bf16 = _bf16()
    seq = rounds["dispatches"] + 1  # this dispatch's number (counted once it has launched)
    # positional (the field order of Dispatched): tokens .. rank, num_tokens, _topk_ids, _has_weights, _buffer, _seq
    results = [Dispatched(*host.results[i], ns[i], ids[i], ws[i] is not None, buf, seq) for i in range(n)]
    local_x = _with_one_call(phases) & PHASE_LOCAL_X  # the call's, on each of its launches (a phase apiece, shared)
    if buf._ranks[0].node is not None:  # several nodes (one rank per process): cuep.internode
        from . import internode

        internode.dispatch(buf, xs[0], ids[0], ws[0], float(global_scale), ns[0],
                           send=bool(phases & PHASE_SEND), recv=bool(phases & PHASE_RECV))
        phases = 0  # launched
    runtime = _runtime or _cp().cuda.runtime
    home = dev = runtime.getDevice()
    rounds["local"] = False  # whether this round took the one-rank kernels (its combine then does too)
    try:
        for i, ph in (host.order(buf, phases) if phases else ()):
            if host.devices[i] != dev:
                dev = host.devices[i]
                runtime.setDevice(dev)
            x, w, num = xs[i], ws[i], ns[i]
            dt = x.dtype
            src = "bf16" if dt is bf16 or dt == bf16 else "f32"
            route = _route(host, ph, num, src)
            launch = host.plans.get((i, ph, src, route)) or _dispatch_plan(buf, host, i, ph, src, route)
            if route:
                rounds["local"] = True
            else:
                if host.ipc:
                    _before_launch(buf, "dispatch.cu")  # after the plan: the first one compiles
            launch.launch_call(buf.num_sms, x.data.ptr, ids[i].data.ptr, 0 if w is None else w.data.ptr, num,
                               global_scale, ph | local_x, _chunk_plan(host, src, num, route))
    finally:
        if dev != home:
            runtime.setDevice(home)
    rounds["dispatches"] = seq
    if not recv:
        rounds["pending"] = ("dispatch", seq)
    return results


# ---- the torch short path -----------------------------------------------------------------------------------------
# A torch call of the common case (one local rank, torch CUDA tensors, the conditions of _dispatch_single /
# _combine_single) reads the tensors' fields and launches on torch's current stream without torch mode's CuPy views
# and stream switch (cuep.interop); results are the buffer's torch views, made once. Anything else: torch mode.
def _ptr(a) -> int:
    """The device address of a CuPy array or a torch tensor (a Dispatched's topk_ids: either)."""
    return a.data.ptr if type(a) is _ND else a.data_ptr()


def _torch_results(buf, host) -> tuple:
    """A torch Dispatched's first fields: the torch views of the rank's persistent outputs, and its rank."""
    res = host.torch_results
    if res is None:
        from .interop import _DISPATCHED_FIELDS, _persistent_view

        r = buf._ranks[0]
        res = host.torch_results = tuple(_persistent_view(r, f) for f in _DISPATCHED_FIELDS) + (r.rank,)
    return res


def _dispatch_single_torch(buf, x, topk_ids, topk_weights, global_scale, phases: int):
    """:func:`_dispatch_single` for torch tensors: the same launch, on torch's current stream; a Dispatched of
    torch views. None: nothing done (torch mode takes the call)."""
    host = _single_host(buf)
    if host is None or buf._rounds["pending"] is not None or _runtime is None or type(global_scale) is not float \
            or not GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX:
        return None
    tb = torch_bindings()
    if type(x) is not tb.tensor:
        return None
    shp = x.shape
    if len(shp) != 2:
        return None
    n, dev, w = shp[0], host.devices[0], topk_weights
    ids_shape = (n, host.top_k)
    xp = tensor_ptr(x, tb, None, tb.x_dtypes, dev, 15) if 0 < n <= host.max_tokens and shp[1] == host.hidden else 0
    ip = tensor_ptr(topk_ids, tb, ids_shape, tb.i32s, dev, 3) if xp else 0
    if not ip:
        return None
    wp = 0 if w is None else tensor_ptr(w, tb, ids_shape, tb.f32s, dev, 3)
    if w is not None and not wp:
        return None
    return _dispatch_round(buf, host, phases, "bf16" if x.dtype is tb.bf16 else "f32", n, dev, tb.stream(dev),
                           _torch_results(buf, host), xp, ip, wp, global_scale, topk_ids, w is not None)


def _dispatch_torch(buf, x, topk_ids, topk_weights, global_scale, validate):
    if validate:
        return NotImplemented
    d = _dispatch_single_torch(buf, x, topk_ids, topk_weights, global_scale, _PHASES_ALL)
    return NotImplemented if d is None else d


def _dispatch_async_torch(buf, x, topk_ids, topk_weights, global_scale, validate):
    if validate:
        return NotImplemented
    d = _dispatch_single_torch(buf, x, topk_ids, topk_weights, global_scale, PHASE_NOTIFY | PHASE_SEND)
    return NotImplemented if d is None else d


def _dispatch_wait_single(pending, torch: bool):
    """dispatch_wait's short path for a Dispatched of one local rank made by a torch call (``torch``: the receive
    launch on torch's stream) or a CuPy one (on CuPy's current stream); NotImplemented for anything else."""
    if type(pending) is not Dispatched or bool(pending._torch) != torch:
        return NotImplemented
    buf = pending._buffer
    if type(buf) is not Buffer or buf._closed:
        return NotImplemented
    host = buf._launch_cache.get("host")
    if host is None or not host.single or host.status[0] or buf._host_error is not None or host.ipc:
        return NotImplemented
    rounds = buf._rounds
    p = rounds["pending"]
    if p is None or p[0] != "dispatch" or pending._seq != p[1] or pending.rank != host.results[0][6]:
        return NotImplemented
    launch = host.recv_launch
    if launch is None:  # (the receive kernel's launch, prepared by the first dispatch_wait)
        launch = host.recv_launch = host.launches.get((0, host.recv_name, _dispatch_launch(buf, False)[1]))
    if launch is None or _runtime.getDevice() != host.devices[0]:
        return NotImplemented
    if torch:
        launch.launch_call_on(torch_bindings().stream(host.devices[0]), buf.num_sms, 0, 0, 0, pending.num_tokens, 1.0,
                              PHASE_RECV, 0)
    else:  # (launch.launch_call without its call, as in _dispatch_single)
        launch.call.pack_into(launch.raw, launch.call_offset, 0, 0, 0, pending.num_tokens, 1.0, PHASE_RECV, 0)
        _kernels._launch_raw(launch.func, buf.num_sms, launch.block, launch.smem, launch.argv_ptr, None,
                             host.devices[0], launch.dependent)
    rounds["pending"] = None
    return pending


def _dispatch_wait_torch(pending):
    return _dispatch_wait_single(pending, True)


def _combine_single_torch(buf, expert_out, dispatched, topk_weights, residual, phases: int):
    """:func:`_combine_single` for torch tensors: the same launch, on torch's current stream; the output as the
    buffer's torch view. None: nothing done (torch mode takes the call)."""
    host = _single_host(buf)
    if host is None or _runtime is None:
        return None
    rounds, d, eo, w, rs = buf._rounds, dispatched, expert_out, topk_weights, residual
    tb = torch_bindings()
    if type(d) is not Dispatched or d._buffer is not buf or d._seq != rounds["dispatches"] \
            or type(eo) is not tb.tensor:
        return None
    shp, N, dev = eo.shape, d.num_tokens, host.devices[0]
    if len(shp) != 2:
        return None
    cdts = tb.x_dtypes[:1] if host.combine_suffix == "bf16" else tb.f32s
    eo_ptr = tensor_ptr(eo, tb, None, cdts, dev, 15) if shp[0] >= host.capacity and shp[1] == host.hidden else 0
    if not eo_ptr:
        return None
    wp = rp = 0  # the addresses of the optional tensors (0: not given)
    if w is not None:
        wp = tensor_ptr(w, tb, (N, host.top_k), tb.f32s, dev, 3) if N > 0 else 0
        if not wp:
            return None
    if rs is not None:
        rp = tensor_ptr(rs, tb, (N, host.hidden), cdts, dev, 15) if N > 0 and (w is not None or d._has_weights) else 0
        if not rp:
            return None
    mode = MODE_WEIGHTED if w is not None else MODE_PARTIAL if d._has_weights else MODE_UNREDUCED
    if not _combine_half_in_order(rounds, phases, mode, eo_ptr):
        return None
    view = host.views.get((0, mode, N))
    hit = host.torch_views.get((mode, N))
    if view is None or hit is None or hit[0] is not view:
        from .interop import _buffer_view

        out = _buffer_view(buf, view) if view is not None else None
        if out is None:
            return None
        hit = host.torch_views[(mode, N)] = (view, out)
    if not _combine_single_launch(buf, host, phases, mode, tb.stream(dev), eo_ptr, _ptr(d._topk_ids), wp, rp,
                                  view.data.ptr, N):
        return None
    return hit[1]


def _combine_torch(buf, expert_out, dispatched, topk_weights, residual):
    out = _combine_single_torch(buf, expert_out, dispatched, topk_weights, residual, _PHASES_ALL)
    return NotImplemented if out is None else out


def _combine_async_torch(buf, expert_out, dispatched, topk_weights, residual):
    out = _combine_single_torch(buf, expert_out, dispatched, topk_weights, residual, PHASE_NOTIFY | PHASE_SEND)
    return NotImplemented if out is None else None


def _combine_wait_torch(buf, expert_out, dispatched, topk_weights, residual):
    out = _combine_single_torch(buf, expert_out, dispatched, topk_weights, residual, PHASE_RECV)
    return NotImplemented if out is None else out


# The public calls try their common case first (one local rank, CuPy arrays or torch tensors, a prepared launch:
# _dispatch_single / _dispatch_single_torch, _combine_single / _combine_single_torch), a direct call with no argument
# scan; everything else (several local ranks, the first call of a shape, errors and their messages) goes to their
# _general function, which torch_aware wraps.
def _is_tensor(a) -> bool:
    """Whether ``a`` is a tensor of the torch module cuep's torch calls bound (none before the first torch call)."""
    tb = _interop._bindings[0]
    return tb is not None and type(a) is tb.tensor


def _combine_either(buf, expert_out, dispatched, topk_weights, residual, phases: int):
    """:func:`_combine_single` for CuPy arrays, :func:`_combine_single_torch` for torch tensors, else None."""
    if type(expert_out) is _ND:
        return _combine_single(buf, expert_out, dispatched, topk_weights, residual, phases)
    return _combine_single_torch(buf, expert_out, dispatched, topk_weights, residual, phases) \
        if _is_tensor(expert_out) else None


def dispatch(buf: Buffer, x, topk_ids, topk_weights=None, *, global_scale: float = 1.0, validate: bool = False):
    """Send every token to the ranks of its top-k experts and lay them out expert-major (one launch per rank).

    Args:
        buf: the group's :class:`Buffer`.
        x: per local rank, [N, H] bfloat16 or float32 (N <= max_tokens_per_rank; may differ between ranks, may be 0).
        topk_ids: per local rank, int32 [N, K], values in [0, E), no expert twice in a row (a bad choice is
            skipped and reported as :class:`cuep.buffer.EPError` at the next call or ``buf.synchronize()``).
        topk_weights: per local rank, float32 [N, K], optional: given here, they ride along and combine reduces
            each token over a rank's experts before sending it back (less traffic).
        global_scale: nvfp4 global scale g (scales are e4m3(g * amax / 6)).
        validate: check the routing values on the host first and raise ``ValueError`` before any launch (this
            synchronises; without it a bad choice is skipped on the device and reported at the next call).

    Returns:
        list of :class:`Dispatched`, one per local rank (a single one if ``x`` was a bare array).

    Raises ``RuntimeError`` before any launch while a :func:`dispatch_async` or :func:`combine_async` on ``buf``
    awaits its wait half. ``x`` must start on a 16-byte boundary, ``topk_ids`` / ``topk_weights`` on a 4-byte one
    (any fresh CuPy or torch allocation does; ``ValueError`` otherwise).
    """
    if not validate:
        d = _dispatch_single(buf, x, topk_ids, topk_weights, global_scale, _PHASES_ALL) if type(x) is _ND else \
            _dispatch_single_torch(buf, x, topk_ids, topk_weights, global_scale, _PHASES_ALL) if _is_tensor(x) else None
        if d is not None:
            return d
    return _dispatch_general(buf, x, topk_ids, topk_weights, global_scale, validate)


@torch_aware(fast=_dispatch_torch)
def _dispatch_general(buf, x, topk_ids, topk_weights, global_scale, validate):
    res = _dispatch(buf, x, topk_ids, topk_weights, global_scale, _PHASES_ALL, validate)
    return res if isinstance(x, (list, tuple)) else res[0]


def dispatch_async(buf: Buffer, x, topk_ids, topk_weights=None, *, global_scale: float = 1.0,
                   validate: bool = False):
    """The send half of :func:`dispatch`: returns at once; pass the result to :func:`dispatch_wait`.

    Order (checked on the host before any launch, ``RuntimeError`` otherwise): nothing may be pending on ``buf``
    (no dispatch_async without its dispatch_wait, no combine_async without its combine_wait), and nothing but
    :func:`dispatch_wait` may run on ``buf`` until it has been called (``buf.reset()`` forgets the pending half).
    """
    if not validate:
        send = PHASE_NOTIFY | PHASE_SEND
        d = _dispatch_single(buf, x, topk_ids, topk_weights, global_scale, send) if type(x) is _ND else \
            _dispatch_single_torch(buf, x, topk_ids, topk_weights, global_scale, send) if _is_tensor(x) else None
        if d is not None:
            return d
    return _dispatch_async_general(buf, x, topk_ids, topk_weights, global_scale, validate)


@torch_aware(fast=_dispatch_async_torch)
def _dispatch_async_general(buf, x, topk_ids, topk_weights, global_scale, validate):
    res = _dispatch(buf, x, topk_ids, topk_weights, global_scale, PHASE_NOTIFY | PHASE_SEND, validate)
    return res if isinstance(x, (list, tuple)) else res[0]


def dispatch_wait(pending):
    """The receive half: waits (on the device, bounded) for every source and builds the outputs.

    Takes exactly what the pending :func:`dispatch_async` returned, once (``RuntimeError`` when no dispatch_async
    is pending, e.g. a second dispatch_wait or the results of a synchronous dispatch; ``ValueError`` for an earlier
    dispatch's results). Returns ``pending``, now valid for :func:`combine`.
    """
    out = _dispatch_wait_single(pending, pending._torch) if type(pending) is Dispatched else NotImplemented
    return out if out is not NotImplemented else _dispatch_wait_general(pending)


@torch_aware(fast=_dispatch_wait_torch)
def _dispatch_wait_general(pending):
    items = list(pending) if isinstance(pending, (list, tuple)) else [pending]
    ordered = _pending_in_order(items)
    if ordered is None:
        ordered = _check_pending(items)
    buf = ordered[0]._buffer
    host = _host(buf)
    if buf._ranks[0].node is not None:  # several nodes: cuep.internode
        from . import internode

        internode.dispatch(buf, None, None, None, 1.0, ordered[0].num_tokens, send=False, recv=True)
        buf._rounds["pending"] = None
        return pending
    threads, smem = _dispatch_launch(buf, False)
    runtime = _runtime or _cp().cuda.runtime
    home = dev = runtime.getDevice()
    try:
        for i, ph in host.order(buf, PHASE_RECV):
            if host.devices[i] != dev:
                dev = host.devices[i]
                runtime.setDevice(dev)
            launch = host.launches.get((i, host.recv_name, smem)) or _prepared(buf, i, host.recv_name, threads,
                                                                                smem)
            if host.ipc:
                _before_launch(buf, "dispatch.cu")
            launch.launch_call(buf.num_sms, 0, 0, 0, ordered[i].num_tokens, 1.0, ph, 0)
    finally:
        if dev != home:
            runtime.setDevice(home)
    buf._rounds["pending"] = None
    return pending


def _pending_in_order(items: list):
    """``items`` when they are the pending dispatch_async's results of an open buffer with nothing wrong, one per
    local rank in rank order (the common case, checked in a few reads), else None (:func:`_check_pending`)."""
    d = items[0] if items else None
    if type(d) is not Dispatched:
        return None
    buf = d._buffer
    if type(buf) is not Buffer or buf._closed:
        return None
    buf.check()  # raises after a failed round, as the full checks would
    p = buf._rounds["pending"]
    if p is None or p[0] != "dispatch" or len(items) != len(buf._ranks):
        return None
    for d, r in zip(items, buf._ranks):
        if type(d) is not Dispatched or d._buffer is not buf or d._seq != p[1] or d.rank != r.rank:
            return None
    return items


def _check_pending(items: list) -> list:
    """The full checks of what dispatch_wait was given, each failure a message; returns the results ordered by
    local rank."""
    bad = next((d for d in items if not isinstance(d, Dispatched)), None) if items else items
    if bad is not None:
        raise TypeError(f"dispatch_wait takes what dispatch_async returned (a cuep.Dispatched, or the list of them), "
                        f"got {type(bad).__name__}")
    buf = items[0]._buffer
    if any(d._buffer is not buf for d in items):
        raise ValueError("dispatch_wait got Dispatched results of different buffers; pass the list one "
                         "dispatch_async call returned")
    _check_buffer(buf, "cuep.dispatch_wait")
    buf.check()
    by_rank = {d.rank: d for d in items}
    missing = [r.rank for r in buf._ranks if r.rank not in by_rank]
    if missing or len(items) != len(buf._ranks):
        raise ValueError(f"dispatch_wait got results for rank(s) {[d.rank for d in items]}; this process drives "
                         f"rank(s) {[r.rank for r in buf._ranks]}: pass the whole list dispatch_async returned")
    p = buf._rounds["pending"]
    if p is None or p[0] != "dispatch":
        now = "nothing is pending" if p is None else f"{_pending_name(p)} is pending"
        raise RuntimeError(f"cuep.dispatch_wait: no dispatch_async is pending on this buffer ({now}): call it once "
                           f"per dispatch_async, on what dispatch_async returned (not on dispatch's results)")
    if any(d._seq != p[1] for d in items):
        raise ValueError("dispatch_wait got the results of an earlier dispatch; pass what the pending "
                         "dispatch_async returned")
    return [by_rank[r.rank] for r in buf._ranks]


def _persistent_empty(shape: tuple, dtype):
    """An output that lives as long as the buffer, from CuPy's default memory pool: never from the allocator of
    the call (a torch call allocates from torch's caching allocator; under ``torch.cuda.graph`` capture that is the
    graph's private pool, and the array would die with the graph)."""
    import cupy

    dtype = np.dtype(dtype)
    return cupy.ndarray(shape, dtype, cupy.get_default_memory_pool().malloc(math.prod(shape) * dtype.itemsize))


_COMBINE_CALLS = {PHASE_RECV: "cuep.combine_wait", PHASE_NOTIFY | PHASE_SEND: "cuep.combine_async"}


def _combine_out(buf: Buffer, host: _Host, i: int, mode: int, N: int):
    """Local rank ``i``'s combine output of ``N`` tokens: leading rows of its persistent array (allocated on first
    use), the view made once per (rank, mode, N)."""
    key = (i, mode, N)
    out = host.views.get(key)
    if out is not None:
        return out
    r = buf._ranks[i]
    cfg = buf.cfg
    with _cp().cuda.Device(r.device):
        T, H, K = cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k
        if mode == MODE_UNREDUCED:
            if r.combined_unreduced is None:
                r.combined_unreduced = _persistent_empty((T, K + int(cfg.fused_shared_expert), H), host.cdt)
            out = r.combined_unreduced[:N]
        else:
            if r.combined is None:
                r.combined = _persistent_empty((T, H), host.cdt)
            out = r.combined[:N]
    if len(host.views) >= 256:  # many distinct token counts: keep the cache small
        host.views.clear()
    host.views[key] = out
    return out


def _check_combine_args(buf: Buffer, host: _Host, i: int, d, eo, w, res) -> int:
    """The full checks of local rank ``i``'s combine arguments, each failure a message naming the argument and
    what it should be; returns the rank's combine mode."""
    names, dev, r = host.names[i], host.devices[i], buf._ranks[i]
    if not isinstance(d, Dispatched):
        raise TypeError(f"dispatched{names['tag']} must be the cuep.Dispatched that dispatch returned for rank "
                        f"{r.rank}, got {type(d).__name__}")
    if d._buffer is not buf:
        raise ValueError(f"dispatched{names['tag']} was returned by a different cuep.Buffer; combine on the "
                         f"buffer that dispatched it")
    if d.rank != r.rank:
        raise ValueError(f"dispatched{names['tag']} is the result of rank {d.rank}; pass the list dispatch "
                         f"returned, in its order (entry i belongs to local rank i)")
    if d._seq != buf._rounds["dispatches"]:
        raise ValueError(f"dispatched{names['tag']} is the result of an earlier dispatch on this buffer, whose "
                         f"outputs the latest dispatch overwrote: combine the latest dispatch's results")
    _check_array(eo, names["expert_out"], dev, host.cdts, 2, "[capacity, H]", host.where)
    shape = eo.shape
    if shape[0] < host.capacity or shape[1] != host.hidden:
        raise ValueError(f"{names['expert_out']} has shape {shape}; expected at least ({host.capacity}, "
                         f"{host.hidden}) = (cfg.capacity, hidden): row i is the output of dispatched row i, so "
                         f"allocate cfg.capacity rows")
    N = d.num_tokens
    if w is not None:
        _check_array(w, names["topk_weights"], dev, _F32S, 2, "[N, top_k]", align=4)
        if w.shape != (N, host.top_k):
            raise ValueError(f"{names['topk_weights']} has shape {w.shape}; expected ({N}, {host.top_k}) = "
                             f"(tokens dispatched by rank {r.rank}, top_k)")
        mode = MODE_WEIGHTED
    else:
        mode = MODE_PARTIAL if d._has_weights else MODE_UNREDUCED
    if res is not None:
        if mode == MODE_UNREDUCED:
            raise ValueError(f"{names['residual']} is added to the weighted sum, but there are no topk_weights "
                             f"(not given to dispatch nor to combine): pass topk_weights, or leave residual out")
        _check_array(res, names["residual"], dev, host.cdts, 2, "[N, H]", host.where)
        if res.shape != (N, host.hidden):
            raise ValueError(f"{names['residual']} has shape {res.shape}; expected ({N}, {host.hidden}) = "
                             f"(tokens dispatched by rank {r.rank}, hidden)")
    return mode


def _combine_single(buf, expert_out, dispatched, topk_weights, residual, phases: int):
    """A combine call's common case in few steps, the same launch as :func:`_combine` (see
    :func:`_dispatch_single`): one local rank, the latest dispatch's result, right arguments, the round half in
    order, the output view and the launch already made. Returns the output, or None (nothing done) for
    :func:`_combine`."""
    if type(buf) is not Buffer or buf._closed:
        return None
    host = buf._launch_cache.get("host")
    if host is None or not host.single or host.status[0] or buf._host_error is not None:
        return None
    rounds, d, eo, w, rs = buf._rounds, dispatched, expert_out, topk_weights, residual
    if type(d) is not Dispatched or d._buffer is not buf or d._torch or d._seq != rounds["dispatches"] \
            or type(eo) is not _ND or eo.ndim != 2:
        return None
    rows, N, dev, cdts = len(eo), d.num_tokens, host.devices[0], host.cdts
    eo_ptr = _rows_ptr(eo, rows, host.hidden, cdts, dev, 15) if rows >= host.capacity else 0
    wp = _rows_ptr(w, N, host.top_k, _F32S, dev, 3) if eo_ptr and w is not None else 0
    rp = _rows_ptr(rs, N, host.hidden, cdts, dev, 15) if eo_ptr and rs is not None and (w is not None
                                                                                          or d._has_weights) else 0
    if not eo_ptr or w is not None and not wp or rs is not None and not rp:
        return None
    mode = MODE_WEIGHTED if w is not None else MODE_PARTIAL if d._has_weights else MODE_UNREDUCED
    p = rounds["pending"]
    if phases == PHASE_RECV:  # a second half after its own first half (the same mode and expert_out)
        if p is None or p[0] != "combine" or p[2] != [mode] or p[3] != [eo_ptr]:
            return None
    elif p is not None:  # a fused call or a first half: nothing pending
        return None
    out = host.views.get((0, mode, N))
    if out is None:
        return None
    step = host.combine_steps.get((phases, mode, N, rounds["local"]))
    if step is None or step[0] is None:  # (the first call of a key, or a one-rank round's first half)
        return out if _combine_single_launch(buf, host, phases, mode, None, eo_ptr, _ptr(d._topk_ids), wp, rp,
                                             out.data.ptr, N) else None
    launch, ph, chunks = step
    if (host.ipc and "combine.cu" not in buf._launched) or _runtime.getDevice() != dev:
        return None
    launch.call.pack_into(launch.raw, launch.call_offset, eo_ptr, d._topk_ids.data.ptr, wp, rp, out.data.ptr, N,
                          mode, ph, chunks)  # (launch.launch_call without its call, as in _dispatch_single)
    _kernels._launch_raw(launch.func, buf.num_sms, launch.block, launch.smem, launch.argv_ptr, None, dev,
                         launch.dependent)
    rounds["pending"] = ("combine", rounds["dispatches"], [mode], [eo_ptr]) if phases == PHASE_NOTIFY | PHASE_SEND \
        else None
    return out


def _combine_half_in_order(rounds, phases: int, mode: int, eo_ptr: int) -> bool:
    """Whether a one-rank combine call may go now: a fused call or a first half with nothing pending, a second
    half after its own first half (the same mode and expert_out)."""
    p = rounds["pending"]
    if phases == PHASE_RECV:
        return p is not None and p[0] == "combine" and p[2] == [mode] and p[3] == [eo_ptr]
    return p is None


def _combine_single_launch(buf, host, phases: int, mode: int, stream, eo_ptr: int, ids_ptr: int, w_ptr: int,
                           rs_ptr: int, out_ptr: int, N: int) -> bool:
    """The one-rank combine's launch (none for a one-rank round's first half: the second does it all) on
    ``stream`` (None: CuPy's current), then the round's pending half; False: the launch is not prepared or the
    device is not current (nothing done)."""
    rounds = buf._rounds
    key = (phases, mode, N, rounds["local"])
    step = host.combine_steps.get(key) or _combine_step(buf, host, key)
    if step is None:
        return False
    launch, ph, chunks = step
    if launch is not None:
        if (host.ipc and "combine.cu" not in buf._launched) or _runtime.getDevice() != host.devices[0]:
            return False
        values = (eo_ptr, ids_ptr, w_ptr, rs_ptr, out_ptr, N, mode, ph, chunks)
        if stream is None:
            launch.launch_call(buf.num_sms, *values)
        else:
            launch.launch_call_on(stream, buf.num_sms, *values)
    rounds["pending"] = ("combine", rounds["dispatches"], [mode], [eo_ptr]) \
        if phases == PHASE_NOTIFY | PHASE_SEND else None
    return True


def _combine_kernel(buf, host, ph: int, mode: int, local: bool, n: int) -> tuple[str, int, int]:
    """(kernel, dynamic shared memory, chunk plan) of a combine launch of phases ``ph`` and ``mode`` for a round
    of ``n`` tokens on a rank: the one-rank kernels after a one-rank dispatch (``local``), else the protocol's,
    with the bf16 partial-sum send's load ring."""
    if local:
        chunks = _combine_chunks_of(buf, host, n)
        return _combine_local_name(host, chunks), host.offsets_smem, chunks
    ring = ph & PHASE_SEND and mode == MODE_PARTIAL and host.combine_suffix == "bf16"
    return host.combine_names[False], COMBINE_RING_BYTES if ring else 0, 0


def _combine_step(buf, host, key: tuple):
    """A one-local-rank combine call's launch for ``key`` = (phases, mode, N, whether the round took the one-rank
    kernels): (prepared launch, the phases it is launched with, its chunk plan), or (None, 0, 0) for a one-rank
    round's first half (the second does it all); kept per key once the launch is prepared (the first call takes
    :func:`_combine`); None before that."""
    phases, mode, N, local = key
    ph = 0 if local and not phases & PHASE_RECV else phases
    if not ph:
        step = (None, 0, 0)
    else:
        name, smem, chunks = _combine_kernel(buf, host, ph, mode, local, N)
        launch = host.launches.get((0, name, smem))
        if launch is None:
            return None
        step = (launch, _with_one_call(ph), chunks)
    host.combine_steps[key] = step
    return step


def _combine(buf: Buffer, expert_out, dispatched, topk_weights, residual, phases: int):
    call = _COMBINE_CALLS.get(phases, "cuep.combine")
    if type(buf) is not Buffer or buf._closed:
        _check_buffer(buf, "cuep.combine")
    buf.check()
    rounds = buf._rounds
    host = _host(buf)
    n = len(host.devices)
    ds = _as_list(dispatched, n, "dispatched")
    eos = _as_list(expert_out, n, "expert_out")
    ws = _as_list(topk_weights, n, "topk_weights") if topk_weights is not None else [None] * n
    res = _as_list(residual, n, "residual") if residual is not None else [None] * n
    cdts, seq = host.cdts, rounds["dispatches"]
    hidden, top_k, capacity = host.hidden, host.top_k, host.capacity
    outs, modes = [], []
    for i, dev in enumerate(host.devices):
        d, eo, w, rs = ds[i], eos[i], ws[i], res[i]
        # the common case in a few reads of stored fields (_rows_ptr); the full checks, with messages, otherwise
        rows = len(eo) if type(eo) is _ND and eo.ndim == 2 else 0
        if type(d) is Dispatched and d._buffer is buf and d._seq == seq and d.rank == host.results[i][-1] \
                and rows >= capacity and _rows_ptr(eo, rows, hidden, cdts, dev, 15) \
                and (w is None or _rows_ptr(w, d.num_tokens, top_k, _F32S, dev, 3)) \
                and (rs is None or (w is not None or d._has_weights)
                     and _rows_ptr(rs, d.num_tokens, hidden, cdts, dev, 15)):
            mode = MODE_WEIGHTED if w is not None else MODE_PARTIAL if d._has_weights else MODE_UNREDUCED
        else:
            mode = _check_combine_args(buf, host, i, d, eo, w, rs)
        N = d.num_tokens
        out = host.views.get((i, mode, N))
        outs.append(out if out is not None else _combine_out(buf, host, i, mode, N))
        modes.append(mode)
    p = rounds["pending"]  # the order of halves, once the arguments are known to be right
    if phases != PHASE_RECV:
        if p is not None:
            _check_nothing_pending(buf, call)
    else:
        if p is None or p[0] != "combine":
            now = "nothing is pending" if p is None else f"{_pending_name(p)} is pending"
            raise RuntimeError(f"cuep.combine_wait: no combine_async is pending on this buffer ({now}): call "
                               f"combine_async first, then combine_wait once with the same arguments")
        if modes != p[2]:
            raise ValueError(f"{call}: topk_weights were given to one of combine_async and combine_wait but not to "
                             f"the other: pass combine_wait the same arguments as combine_async")
        if [pointer(e) for e in eos] != p[3]:
            raise ValueError(f"{call}: expert_out is not the array(s) given to combine_async (the receive reads "
                             f"them too): pass combine_wait the same arguments as combine_async")
    # after a one-rank dispatch (rounds["local"]) no protocol either (cuda_src/combine/local.cuh): the fused call
    # and combine_wait sum every token; combine_async has nothing to send and launches nothing
    local = rounds["local"]
    if local and not phases & PHASE_RECV:
        phases = 0
    one_call = _with_one_call(phases) & PHASE_LOCAL_X  # the call's, on each launch (combine/slots.cuh direct_out)
    if buf._ranks[0].node is not None:  # several nodes: cuep.internode
        from . import internode

        d = ds[0]
        internode.combine(buf, eos[0], d._topk_ids, ws[0], res[0], outs[0], d.num_tokens, modes[0],
                          send=bool(phases & PHASE_SEND), recv=bool(phases & PHASE_RECV))
        phases = 0  # launched
    runtime = _runtime or _cp().cuda.runtime
    home = dev = runtime.getDevice()
    try:
        for i, ph in (host.order(buf, phases) if phases else ()):
            d = ds[i]
            if host.devices[i] != dev:
                dev = host.devices[i]
                runtime.setDevice(dev)
            mode = modes[i]
            name, smem, chunks = _combine_kernel(buf, host, ph, mode, local, d.num_tokens)
            launch = host.launches.get((i, name, smem)) or _prepared(buf, i, name, _THREADS, smem)
            if host.ipc:
                _before_launch(buf, "combine.cu")
            w, rs = ws[i], res[i]
            launch.launch_call(buf.num_sms, eos[i].data.ptr, _ptr(d._topk_ids), 0 if w is None else w.data.ptr,
                               0 if rs is None else rs.data.ptr, outs[i].data.ptr, d.num_tokens, mode,
                               ph | one_call, chunks)
    finally:
        if dev != home:
            runtime.setDevice(home)
    # combine_async leaves its half pending (with what its receive must see again); combine_wait finishes it
    rounds["pending"] = ("combine", rounds["dispatches"], modes, [pointer(e) for e in eos]) \
        if call == "cuep.combine_async" else None
    return outs


def combine(buf: Buffer, expert_out, dispatched, topk_weights=None, *, residual=None):
    """Send expert outputs back to their tokens' ranks and sum them (one launch per rank).

    Args:
        expert_out: per local rank, [capacity, H] in the combine dtype: row i is the expert output of dispatched
            row i (rows past ``row_offsets[-1]`` are not read).
        dispatched: the list :func:`dispatch` returned (this buffer's latest dispatch; with :func:`dispatch_async`,
            after :func:`dispatch_wait`).
        topk_weights: per local rank, float32 [N, K]. None: use the weights given at dispatch, or, if none were
            given there, return the unreduced [N, K, H] (shared expert in slot K when fused).
        residual: per local rank, [N, H] in the combine dtype, added to the reduced output (epilogue).

    Returns:
        per local rank, [N, H] (or [N, K (+1), H]) in the combine dtype; reused by the next combine.
        Sums accumulate in float32. With ``fused_shared_expert`` the shared group's row t is added with weight 1.

    A CUDA graph holds the arrays of its capture: replay a captured combine only after a dispatch of the same
    ``topk_ids`` array (captured with it, or run with it before the replay). The host checks that pair each eager
    call; a replay skips them, and a combine reading another dispatch's rows may fault.
    """
    out = _combine_either(buf, expert_out, dispatched, topk_weights, residual, _PHASES_ALL)
    return out if out is not None else _combine_general(buf, expert_out, dispatched, topk_weights, residual)


@torch_aware(fast=_combine_torch)
def _combine_general(buf, expert_out, dispatched, topk_weights, residual):
    outs = _combine(buf, expert_out, dispatched, topk_weights, residual, _PHASES_ALL)
    return outs if isinstance(dispatched, (list, tuple)) else outs[0]


def combine_async(buf: Buffer, expert_out, dispatched, topk_weights=None, *, residual=None):
    """The send half of :func:`combine`; :func:`combine_wait` with the same arguments finishes it.

    Nothing may be pending on ``buf`` (``RuntimeError``), and ``dispatched`` must be the results of its latest
    dispatch (``ValueError``); until :func:`combine_wait`, nothing else may run on ``buf``.
    """
    if _combine_either(buf, expert_out, dispatched, topk_weights, residual, PHASE_NOTIFY | PHASE_SEND) is None:
        _combine_async_general(buf, expert_out, dispatched, topk_weights, residual)


@torch_aware(fast=_combine_async_torch)
def _combine_async_general(buf, expert_out, dispatched, topk_weights, residual):
    _combine(buf, expert_out, dispatched, topk_weights, residual, PHASE_NOTIFY | PHASE_SEND)


def combine_wait(buf: Buffer, expert_out, dispatched, topk_weights=None, *, residual=None):
    """The receive half of :func:`combine`: waits for every rank and returns the summed outputs.

    Needs the pending :func:`combine_async` (``RuntimeError`` otherwise: combine_wait without combine_async, or
    twice) and the same ``dispatched``, ``expert_out`` arrays and ``topk_weights`` (given or not) (``ValueError``).
    """
    out = _combine_either(buf, expert_out, dispatched, topk_weights, residual, PHASE_RECV)
    return out if out is not None else _combine_wait_general(buf, expert_out, dispatched, topk_weights, residual)


@torch_aware(fast=_combine_wait_torch)
def _combine_wait_general(buf, expert_out, dispatched, topk_weights, residual):
    outs = _combine(buf, expert_out, dispatched, topk_weights, residual, PHASE_RECV)
    return outs if isinstance(dispatched, (list, tuple)) else outs[0]
