"""The NCCL baseline for the same routing: permute, grouped send/recv with variable splits, unpermute.

Dispatch (per rank, each GPU on its own stream, one process driving all GPUs with
``cupy.cuda.nccl.NcclCommunicator.initAll``):

1. **permute**: gather the rank's message rows grouped by destination rank (a token appears once per distinct
   destination rank, tokens ascending inside a destination) -- ``cupy.take`` of the rows by a precomputed index,
   i.e. a stable sort by destination rank;
2. **all-to-all**: ``nccl.groupStart()``, ``send``/``recv`` of each (source, destination) block, ``groupEnd()``;
3. **unpermute**: ``cupy.take`` of the received rows into cuep's expert-major layout (group by local expert, then
   source rank, then token; a token that chose two local experts fills two rows).

Combine mirrors it with the same message counts: on the expert rank a weighted segment sum reduces each received
token's expert rows into one partial sum, already in send order; grouped send/recv back; at home a segment sum adds
each token's partial sums (at most one per rank). Sums accumulate in float32, rows are bf16.

What this baseline is given for free, so the comparison favours NCCL:
* the layout (split sizes on the host, the permutation indices) is computed before timing from the routing; a
  real NCCL path would need a count exchange and a host synchronisation every round;
* quantized formats travel as pre-encoded message rows (payload + scales, padded to 16 bytes): quantization
  is not timed; cuep quantizes inside dispatch;
* the unpermuted rows keep their scales inline (no fp8 transpose, no 128x4 scale swizzle, no per-group padding).
The rows are moved as ``complex128`` (16-byte elements), so every ``take`` is a 16-byte-vector copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .traffic import rank_mask

ROW_ALIGN = 16  # bytes: message rows are padded to it so they can move as 16-byte elements


# ---- the layout (pure NumPy) ---------------------------------------------------------------------------------
@dataclass
class NcclLayout:
    """Every index the NCCL path needs for one routing of R ranks (host arrays, all int32 unless said).

    Attributes:
        counts: int64 [R, R]: messages from rank s to rank d (``P`` of :mod:`cuep.bench.traffic`).
        perm: per rank s, [sum_d counts[s, d]]: token of each send slot, grouped by destination rank.
        unperm: per rank r, [rows_r]: received message of each expert-major output row.
        row_expert: per rank r, [rows_r]: local expert of each output row (for checks).
        comb_rows, comb_weights (float32), comb_seg: per rank r, CSR over its received messages (in receive order,
            which is also the order combine sends them back): the output rows of each message and their weights.
        final_rows, final_seg: per rank s, CSR over its tokens: the rows of its combine receive buffer (grouped by
            expert rank, tokens ascending) holding the token's partial sums.
    """

    counts: np.ndarray
    perm: list
    unperm: list
    row_expert: list
    comb_rows: list
    comb_weights: list
    comb_seg: list
    final_rows: list
    final_seg: list

    @property
    def n_ranks(self) -> int:
        return self.counts.shape[0]

    def send_offsets(self, s: int) -> np.ndarray:
        """[R + 1] start of each destination's block in rank s's send buffer (= its combine receive buffer)."""
        return np.concatenate([[0], np.cumsum(self.counts[s])]).astype(np.int64)

    def recv_offsets(self, r: int) -> np.ndarray:
        """[R + 1] start of each source's block in rank r's receive buffer (= its combine send buffer)."""
        return np.concatenate([[0], np.cumsum(self.counts[:, r])]).astype(np.int64)


def _csr(groups: np.ndarray, n_groups: int) -> np.ndarray:
    """int32 [n_groups + 1] offsets of a group-sorted array."""
    return np.concatenate([[0], np.cumsum(np.bincount(groups, minlength=n_groups))]).astype(np.int32)


def nccl_layout(topk_ids: list[np.ndarray], topk_weights: list[np.ndarray], n_experts: int) -> NcclLayout:
    """The NCCL path's indices for one routing (one [N_r, K] array per rank)."""
    R = len(topk_ids)
    L = n_experts // R
    masks = [rank_mask(ids, n_experts, R) for ids in topk_ids]
    counts = np.stack([m.sum(axis=0) for m in masks]).astype(np.int64)
    # position of token t among the tokens of s bound for d: pos[s][t, d]
    pos = [np.cumsum(m, axis=0) - 1 for m in masks]
    perm = [np.concatenate([np.nonzero(m[:, d])[0] for d in range(R)]).astype(np.int32) for m in masks]

    unperm, row_expert, comb_rows, comb_weights, comb_seg = [], [], [], [], []
    for r in range(R):
        roff = np.concatenate([[0], np.cumsum(counts[:, r])])
        le, src, tok, msg, w = [], [], [], [], []
        for s, ids in enumerate(topk_ids):
            t, k = np.nonzero(ids // L == r)
            le.append(ids[t, k] - r * L)
            src.append(np.full(t.shape, s))
            tok.append(t)
            msg.append(roff[s] + pos[s][t, r])
            w.append(np.asarray(topk_weights[s], dtype=np.float32)[t, k])
        le, src, tok, msg, w = (np.concatenate(a) if a else np.zeros(0) for a in (le, src, tok, msg, w))
        order = np.lexsort((tok, src, le))  # expert-major: local expert, then source rank, then token
        msg_sorted = msg[order].astype(np.int64)
        unperm.append(msg_sorted.astype(np.int32))
        row_expert.append(le[order].astype(np.int32))
        # combine: rows of each received message (stable: rows stay ascending inside a message)
        by_msg = np.argsort(msg_sorted, kind="stable")
        comb_rows.append(by_msg.astype(np.int32))
        comb_weights.append(w[order][by_msg].astype(np.float32))
        comb_seg.append(_csr(msg_sorted, int(roff[-1])))

    final_rows, final_seg = [], []
    for s, m in enumerate(masks):
        soff = np.concatenate([[0], np.cumsum(counts[s])])
        t, d = np.nonzero(m)  # token-major, ranks ascending inside a token
        final_rows.append((soff[d] + pos[s][t, d]).astype(np.int32))
        final_seg.append(_csr(t, m.shape[0]))
    return NcclLayout(counts, perm, unperm, row_expert, comb_rows, comb_weights, comb_seg, final_rows, final_seg)


def simulate(layout: NcclLayout, rows: list[np.ndarray], expert_out: list[np.ndarray] | None = None):
    """Run the NCCL path in NumPy (the same index arithmetic the GPUs use): a check of the layout.

    Args:
        rows: per rank, [N_r, W] message rows. expert_out: per rank, [rows_r, H] float32 expert outputs.

    Returns:
        (dispatched, combined): per rank the expert-major rows [rows_r, W]; per rank [N_r, H] float32 (or None).
    """
    R = layout.n_ranks
    send = [rows[s][layout.perm[s]] for s in range(R)]
    recv = []
    for r in range(R):
        recv.append(np.concatenate([send[s][layout.send_offsets(s)[r]:layout.send_offsets(s)[r + 1]]
                                    for s in range(R)]))
    dispatched = [recv[r][layout.unperm[r]] for r in range(R)]
    if expert_out is None:
        return dispatched, None
    partial = []
    for r in range(R):
        seg, rws, w = layout.comb_seg[r], layout.comb_rows[r], layout.comb_weights[r]
        out = np.zeros((len(seg) - 1, expert_out[r].shape[1]), np.float32)
        for m in range(len(seg) - 1):
            sl = slice(seg[m], seg[m + 1])
            out[m] = (w[sl, None] * expert_out[r][rws[sl]]).sum(axis=0)
        partial.append(out)
    combined = []
    for s in range(R):
        back = np.concatenate([partial[r][layout.recv_offsets(r)[s]:layout.recv_offsets(r)[s + 1]]
                               for r in range(R)])
        seg, rws = layout.final_seg[s], layout.final_rows[s]
        combined.append(np.stack([back[rws[seg[t]:seg[t + 1]]].sum(axis=0) for t in range(len(seg) - 1)])
                        if len(seg) > 1 else np.zeros((0, back.shape[1]), np.float32))
    return dispatched, combined


def message_row_bytes(message_bytes: int) -> int:
    """A message row as the NCCL path stores it: padded up to 16 bytes."""
    return -(-message_bytes // ROW_ALIGN) * ROW_ALIGN


# ---- the GPU path ----------------------------------------------------------------------------------------------
def available() -> tuple[bool, str]:
    """(True, version) if NCCL loads through CuPy, else (False, why)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
        if not getattr(nccl, "available", False):
            return False, "cupy.cuda.nccl is not available (install nvidia-nccl-cu13)"
        return True, str(nccl.get_version())
    except Exception as e:  # noqa: BLE001  (any failure to load means no baseline)
        return False, f"cupy.cuda.nccl failed to load: {e}"


class NcclComms:
    """One communicator per device (``NcclCommunicator.initAll``), created once and reused by every case."""

    def __init__(self, devices: list[int]) -> None:
        from cupy.cuda import nccl

        self.nccl = nccl
        self.devices = list(devices)
        self.comms = nccl.NcclCommunicator.initAll(self.devices)

    def exchange(self, blocks: list[tuple[int, int, int, int, int]]) -> None:
        """One grouped send/recv round. ``blocks``: (src rank, dst rank, send ptr, recv ptr, nbytes) for every
        nonzero (source, destination) block; each side posts its half on its device's current stream."""
        import cupy

        nccl = self.nccl
        u8 = getattr(nccl, "NCCL_UINT8", 1)
        nccl.groupStart()
        try:
            for s, d, sptr, rptr, nbytes in blocks:
                with cupy.cuda.Device(self.devices[s]):
                    self.comms[s].send(sptr, nbytes, u8, d, cupy.cuda.get_current_stream().ptr)
                with cupy.cuda.Device(self.devices[d]):
                    self.comms[d].recv(rptr, nbytes, u8, s, cupy.cuda.get_current_stream().ptr)
        finally:
            nccl.groupEnd()

    def close(self) -> None:
        for c in self.comms:
            c.destroy()
        self.comms = []


class NcclCase:
    """The NCCL path for one (format, N) on every device, over several input sets (runs rotate among them).

    Args:
        comms: the communicators.
        layouts: one :class:`NcclLayout` per input set.
        message_rows: per set, per rank: device array [N_r, row_bytes] of message rows (any dtype, C-contiguous,
            row bytes a multiple of 16): bf16 tokens for bf16, random bytes of the encoded size otherwise.
        expert_out: per rank: bf16 [>= rows_r, H] device array (random expert outputs).
        hidden: H.
    """

    def __init__(self, comms: NcclComms, layouts: list[NcclLayout], message_rows: list[list], expert_out: list,
                 hidden: int) -> None:
        import cupy

        self.comms, self.layouts, self.hidden = comms, layouts, hidden
        devs = comms.devices
        R = len(devs)
        self.n_sets = len(layouts)
        self.rows16 = [[m.view(cupy.complex128).reshape(m.shape[0], -1) for m in per_rank]
                       for per_rank in message_rows]
        W = self.rows16[0][0].shape[1]
        self.row_bytes = 16 * W
        self.expert_out = expert_out
        max_send = [max(int(l.counts[r].sum()) for l in layouts) for r in range(R)]
        max_recv = [max(int(l.counts[:, r].sum()) for l in layouts) for r in range(R)]
        max_rows = [max(len(l.unperm[r]) for l in layouts) for r in range(R)]
        max_tok = [max(len(l.final_seg[r]) - 1 for l in layouts) for r in range(R)]
        bf16 = expert_out[0].dtype
        self.send, self.recv, self.out, self.c_send, self.c_recv, self.c_out = [], [], [], [], [], []
        self.idx = [[None] * R for _ in layouts]
        for r, dev in enumerate(devs):
            with cupy.cuda.Device(dev):
                self.send.append(cupy.empty((max(max_send[r], 1), W), cupy.complex128))
                self.recv.append(cupy.empty((max(max_recv[r], 1), W), cupy.complex128))
                self.out.append(cupy.empty((max(max_rows[r], 1), W), cupy.complex128))
                self.c_send.append(cupy.empty((max(max_recv[r], 1), hidden), bf16))
                self.c_recv.append(cupy.empty((max(max_send[r], 1), hidden), bf16))
                self.c_out.append(cupy.empty((max(max_tok[r], 1), hidden), bf16))
                for k, l in enumerate(layouts):
                    self.idx[k][r] = {name: cupy.asarray(getattr(l, name)[r]) for name in
                                      ("perm", "unperm", "comb_rows", "comb_weights", "comb_seg", "final_rows",
                                       "final_seg")}
        # combine runs the same blocks backwards: rank r returns P[s, r] partial sums to s (counts transposed)
        self._blocks_d = [self._blocks(l.counts, self.send, self.recv, self.row_bytes) for l in layouts]
        self._blocks_c = [self._blocks(l.counts.T, self.c_send, self.c_recv, 2 * hidden) for l in layouts]

    @staticmethod
    def _blocks(counts: np.ndarray, send: list, recv: list, row_bytes: int) -> list[tuple[int, int, int, int, int]]:
        """(src, dst, send ptr, recv ptr, nbytes) of every nonzero block: block s -> d starts at row
        sum_{d' < d} counts[s, d'] of s's send buffer and row sum_{s' < s} counts[s', d] of d's receive buffer."""
        counts = np.asarray(counts, dtype=np.int64)
        R = counts.shape[0]
        soff = np.cumsum(counts, axis=1) - counts
        roff = np.cumsum(counts, axis=0) - counts
        out = []
        for s in range(R):
            for d in range(R):
                n = int(counts[s, d])
                if n:
                    out.append((s, d, send[s].data.ptr + int(soff[s, d]) * row_bytes,
                                recv[d].data.ptr + int(roff[s, d]) * row_bytes, n * row_bytes))
        return out

    # ---- the timed callables (fn(i) rotates among input sets) ------------------------------------------------
    def _permute(self, k: int) -> None:
        import cupy

        for r, dev in enumerate(self.comms.devices):
            n = int(self.layouts[k].counts[r].sum())
            if n:
                with cupy.cuda.Device(dev):
                    cupy.take(self.rows16[k][r], self.idx[k][r]["perm"], axis=0, out=self.send[r][:n])

    def _unpermute(self, k: int) -> None:
        import cupy

        for r, dev in enumerate(self.comms.devices):
            n = len(self.layouts[k].unperm[r])
            if n:
                with cupy.cuda.Device(dev):
                    cupy.take(self.recv[r], self.idx[k][r]["unperm"], axis=0, out=self.out[r][:n])

    def _reduce_experts(self, k: int) -> None:
        import cupy

        from . import kernels

        for r, dev in enumerate(self.comms.devices):
            ix = self.idx[k][r]
            with cupy.cuda.Device(dev):
                kernels.segment_sum_bf16(self.expert_out[r], ix["comb_rows"], ix["comb_seg"],
                                         len(self.layouts[k].comb_seg[r]) - 1, self.c_send[r],
                                         weights=ix["comb_weights"])

    def _reduce_home(self, k: int) -> None:
        import cupy

        from . import kernels

        for r, dev in enumerate(self.comms.devices):
            ix = self.idx[k][r]
            with cupy.cuda.Device(dev):
                kernels.segment_sum_bf16(self.c_recv[r], ix["final_rows"], ix["final_seg"],
                                         len(self.layouts[k].final_seg[r]) - 1, self.c_out[r])

    def a2a_dispatch(self, i: int) -> None:
        """The grouped send/recv of dispatch alone."""
        self.comms.exchange(self._blocks_d[i % self.n_sets])

    def a2a_combine(self, i: int) -> None:
        """The grouped send/recv of combine alone."""
        self.comms.exchange(self._blocks_c[i % self.n_sets])

    def dispatch(self, i: int) -> None:
        k = i % self.n_sets
        self._permute(k)
        self.comms.exchange(self._blocks_d[k])
        self._unpermute(k)

    def combine(self, i: int) -> None:
        k = i % self.n_sets
        self._reduce_experts(k)
        self.comms.exchange(self._blocks_c[k])
        self._reduce_home(k)

    def roundtrip(self, i: int) -> None:
        self.dispatch(i)
        self.combine(i)

    def dispatched_rows(self, k: int, r: int):
        """Rank r's expert-major rows after :meth:`dispatch` of set k (device array [rows_r, W] complex128)."""
        return self.out[r][: len(self.layouts[k].unperm[r])]

    def combined(self, k: int, r: int):
        """Rank r's combined tokens after :meth:`combine` of set k (device bf16 [N_r, H])."""
        return self.c_out[r][: len(self.layouts[k].final_seg[r]) - 1]
