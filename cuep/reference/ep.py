"""NumPy reference of expert-parallel dispatch, combine and the fused SwiGLU (the oracle for the kernels).

All ranks are simulated in one process: every function takes and returns one array per rank (lists of length
``cfg.n_ranks``). Pure NumPy and ml_dtypes; quantization comes from :mod:`cuep.reference.quant`, so payload and
scale bytes are exactly those of ``docs/formats.md``.

Row order. The contract (``ep_semantics.md``) leaves the order of rows inside one (expert, source rank) block to
arrival order; the reference picks the **canonical order**: ascending source token index. GPU outputs are
therefore compared as sets keyed by (source rank, token, k), or after sorting each block the same way.

``skip_a2a``. Every rank holds the same tokens (for example after an all-gather), so rank ``r`` only receives
its *own* tokens that chose one of its *own* local experts: only source rank ``r`` appears in rank ``r``'s
dispatch output, and the tokens passed for the other ranks are validated but otherwise ignored for rank ``r``.
Combine then returns, on each rank, the partial sum over that rank's local experts; summing the partial sums
over the ranks (the later all-reduce) gives the full combine.

``allreduce_world_size`` (A). With ``skip_a2a`` and ``fused_shared_expert`` every rank would add the shared
expert of each of its tokens, so an all-reduce over A ranks would count it A times. With A > 1 the rank at
position p = rank % A of its all-reduce group (A consecutive ranks) takes only its share ``[lo, hi)`` of the
shared expert's tokens (:meth:`cuep.EPConfig.shared_expert_share`: lo = (p * N) // A, hi = ((p + 1) * N) // A):
group 0 holds tokens lo .. hi - 1 in order, and combine adds the shared expert to those tokens only, so the
all-reduce over the group adds each token's shared expert exactly once.

Reference outputs are trimmed to ``row_offsets[-1]`` rows; the kernels write ``cfg.capacity`` rows and leave
the rows past ``row_offsets[-1]`` untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import ml_dtypes
import numpy as np

from ..config import EPConfig
from ..formats import FP8_BLOCK, Format, get_format
from .quant import fma_f32, ftz, quantize, swizzle_block_scales

__all__ = ["Dispatched", "dispatch", "combine", "fused_silu"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


@dataclass
class Dispatched:
    """What one rank holds after dispatch: its rows grouped by local expert (expert-major).

    ``rows`` = ``row_offsets[-1]`` (the reference trims; the kernels' outputs have ``cfg.capacity`` rows).

    Attributes:
        tokens: payload per row. bf16: ``ml_dtypes.bfloat16 [rows, H]``; fp8: ``uint8 [rows, H]`` (e4m3 bytes);
            nvfp4/mxfp4: ``uint8 [rows, H/2]`` (two e2m1 codes per byte, element 2i in the low nibble).
        scales: ``None`` for bf16; fp8: ``float32 [H/128, rows]`` (transposed); nvfp4/mxfp4: ``uint8`` 1-D, the
            128x4 swizzled block scales of the groups (see ``docs/formats.md``).
        row_offsets: ``uint32 [n_groups + 1]``; group g holds rows ``row_offsets[g] .. row_offsets[g + 1]``
            (fp8: each group's count padded up to a multiple of ``cfg.fmt.row_align`` = 4).
        expert_ids: ``int32 [n_groups]``: the local expert of each group (``cfg.shared_expert_id`` = L for the
            fused shared-expert group 0).
        src_info: ``int32 [rows, 2]``: (token index on the source rank, top-k slot k); k = K marks a shared-expert
            row; padding rows are (-1, -1).
        src_rank: ``int32 [rows]``: the source rank of each row, -1 for padding rows.
        scales_offsets: ``uint32 [n_groups]`` for nvfp4/mxfp4 (group g's first 128-row scale block is
            ``row_offsets[g] // 128 + scales_offsets[g]``), else ``None``.
    """

    tokens: np.ndarray
    scales: Optional[np.ndarray]
    row_offsets: np.ndarray
    expert_ids: np.ndarray
    src_info: np.ndarray
    src_rank: np.ndarray
    scales_offsets: Optional[np.ndarray] = None

    @property
    def n_rows(self) -> int:
        """``row_offsets[-1]``: the rows in use (padding included)."""
        return int(self.row_offsets[-1])


# ---- validation ----------------------------------------------------------------------------------------------
def _check_cfg(cfg) -> None:
    if not isinstance(cfg, EPConfig):
        raise ValueError(f"cfg must be an EPConfig, got {type(cfg).__name__}")


def _check_list(name: str, value, n: int) -> list:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of {n} per-rank arrays (one per rank), got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries; expected one per rank ({n})")
    return list(value)


def _check_tokens(tokens, cfg: EPConfig) -> list[np.ndarray]:
    tokens = _check_list("tokens", tokens, cfg.n_ranks)
    out = []
    for r, x in enumerate(tokens):
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != cfg.hidden:
            raise ValueError(f"tokens[{r}] has shape {x.shape}; expected [N, hidden={cfg.hidden}]")
        if x.dtype not in (_F32, _BF16):
            raise ValueError(f"tokens[{r}] has dtype {x.dtype}; expected float32 or bfloat16")
        if x.shape[0] > cfg.max_tokens_per_rank:
            raise ValueError(f"tokens[{r}] has {x.shape[0]} tokens > max_tokens_per_rank="
                             f"{cfg.max_tokens_per_rank}")
        out.append(x)
    return out


def _check_topk_ids(topk_ids, n_tokens: Sequence[int], cfg: EPConfig) -> list[np.ndarray]:
    topk_ids = _check_list("topk_ids", topk_ids, cfg.n_ranks)
    out = []
    for r, ids in enumerate(topk_ids):
        ids = np.asarray(ids)
        if ids.shape != (n_tokens[r], cfg.top_k):
            raise ValueError(f"topk_ids[{r}] has shape {ids.shape}; expected [N={n_tokens[r]}, "
                             f"top_k={cfg.top_k}] (N from tokens[{r}])")
        if ids.dtype != _I32:
            raise ValueError(f"topk_ids[{r}] has dtype {ids.dtype}; expected int32")
        if ids.size:
            bad = (ids < 0) | (ids >= cfg.n_experts)
            if bad.any():
                t, k = map(int, np.argwhere(bad)[0])
                raise ValueError(f"topk_ids[{r}][{t}, {k}] = {int(ids[t, k])} is outside [0, n_experts="
                                 f"{cfg.n_experts})")
            s = np.sort(ids, axis=1)
            dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
            if dup.any():
                t = int(np.flatnonzero(dup)[0])
                raise ValueError(f"topk_ids[{r}] row {t} names the same expert twice: {ids[t].tolist()}")
        out.append(ids)
    return out


def _resolve_format(fmt) -> Format:
    if isinstance(fmt, Format):
        return fmt
    return get_format(fmt, "fmt")


# ---- encoding ------------------------------------------------------------------------------------------------
def _encode(x: np.ndarray, fmt: Format, hidden: int, global_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Quantize token rows once (the sender's send buffer): payload uint8 [N, P], scales uint8 [N, S]."""
    n = x.shape[0]
    if n == 0:
        return (np.zeros((0, fmt.payload_bytes(hidden)), np.uint8),
                np.zeros((0, fmt.scale_bytes(hidden)), np.uint8))
    payload, scales = quantize(x, fmt.name, global_scale)
    return np.ascontiguousarray(payload, dtype=np.uint8), np.ascontiguousarray(scales, dtype=np.uint8)


def _layout_scales(scale_rows: np.ndarray, row_offsets: np.ndarray, fmt: Format, hidden: int):
    """Per-row scale bytes uint8 [rows, S] -> the dispatch/fused_silu layout: (scales, scales_offsets)."""
    rows = scale_rows.shape[0]
    if fmt.name == "bf16":
        return None, None
    if fmt.name == "fp8":
        s = np.ascontiguousarray(scale_rows).view(np.float32).reshape(rows, hidden // FP8_BLOCK)
        return np.ascontiguousarray(s.T), None
    swz, offs = swizzle_block_scales(scale_rows, row_offsets, fmt.name, hidden)
    return np.asarray(swz, dtype=np.uint8), np.asarray(offs, dtype=np.uint32)


def _tokens_view(payload: np.ndarray, fmt: Format, hidden: int) -> np.ndarray:
    if fmt.name == "bf16":
        return np.ascontiguousarray(payload).view(_BF16).reshape(payload.shape[0], hidden)
    return payload


# ---- dispatch ------------------------------------------------------------------------------------------------
def dispatch(tokens: Sequence[np.ndarray], topk_ids: Sequence[np.ndarray], cfg: EPConfig,
             global_scale: float = 1.0) -> list[Dispatched]:
    """Dispatch every rank's tokens to the ranks of their top-k experts (all ranks simulated at once).

    Each token is quantized once on its source rank (``quantize(x, cfg.dispatch_format, global_scale)``), then
    copied into one row per chosen expert on the expert's rank (expert ``e`` lives on rank ``e // L`` as local
    expert ``e % L``). Rank r's output is expert-major: group g holds local expert g's rows (with
    ``cfg.fused_shared_expert``: group 0 is the shared expert holding rank r's own N_r tokens in order with
    ``src_info`` (t, K), and routed group g + 1 holds local expert g; with ``cfg.allreduce_world_size`` > 1 only
    the tokens of the rank's share, ``cfg.shared_expert_share(r, N_r)`` = [lo, hi): row i is token lo + i, with
    ``src_info`` (lo + i, K)). Inside a group: source rank 0's rows first,
    then rank 1, ...; inside one (expert, source rank) block, ascending source token (the canonical order). fp8:
    each group's row count is padded up to a multiple of ``cfg.fmt.row_align`` with zero rows
    (``src_info`` (-1, -1), ``src_rank`` -1, zero payload and scales). With ``cfg.skip_a2a`` rank r receives only
    its own tokens bound to its own local experts (the other ranks' tokens are ignored for rank r).

    Args:
        tokens: list of R arrays ``[N_r, H]``, float32 or ``ml_dtypes.bfloat16``; ``N_r <= T``, may be 0.
        topk_ids: list of R ``int32 [N_r, K]``, values in ``[0, E)``, no expert twice in a row.
        cfg: the group's :class:`~cuep.config.EPConfig`.
        global_scale: float32 global scale of nvfp4 (ignored by the other formats' math, passed through).

    Returns:
        list of R :class:`Dispatched` (one per receiving rank), trimmed to ``row_offsets[-1]`` rows.

    Raises:
        ValueError: naming the argument (list length, shape, dtype, N_r > T, ids outside [0, E), duplicates).
    """
    _check_cfg(cfg)
    xs = _check_tokens(tokens, cfg)
    ids = _check_topk_ids(topk_ids, [x.shape[0] for x in xs], cfg)
    fmt = cfg.fmt
    R, L, K, E, H = cfg.n_ranks, cfg.n_local_experts, cfg.top_k, cfg.n_experts, cfg.hidden
    align = fmt.row_align

    # Sender side: encode each token once; sort its (token, k) pairs by expert, ascending token inside an expert
    # (stable sort of the token-major flattening), so each (expert, source) block is a contiguous slice.
    encoded, by_expert, starts = [], [], []
    for s in range(R):
        encoded.append(_encode(xs[s], fmt, H, global_scale))
        flat = ids[s].reshape(-1)
        order = np.argsort(flat, kind="stable")
        by_expert.append(order)  # index t * K + k
        starts.append(np.searchsorted(flat[order], np.arange(E + 1)))

    outs = []
    for r in range(R):
        sources = [r] if cfg.skip_a2a else list(range(R))
        blocks: list[list[tuple[int, np.ndarray, np.ndarray]]] = []  # per group: (src rank, t, k) blocks
        if cfg.fused_shared_expert:
            lo, hi = cfg.shared_expert_share(r, xs[r].shape[0])
            blocks.append([(r, np.arange(lo, hi, dtype=np.int64), np.full(hi - lo, K, np.int64))])
        for l in range(L):
            e = r * L + l
            group = []
            for s in sources:
                sel = by_expert[s][starts[s][e]:starts[s][e + 1]]
                group.append((s, sel // K, sel % K))
            blocks.append(group)

        counts = np.array([sum(len(t) for _, t, _ in g) for g in blocks], dtype=np.int64)
        padded = -(-counts // align) * align
        row_offsets = np.zeros(len(blocks) + 1, np.int64)
        np.cumsum(padded, out=row_offsets[1:])
        rows = int(row_offsets[-1])

        src_info = np.full((rows, 2), -1, np.int32)
        src_rank = np.full(rows, -1, np.int32)
        for g, group in enumerate(blocks):
            at = int(row_offsets[g])
            for s, t, k in group:
                src_info[at:at + len(t), 0] = t
                src_info[at:at + len(t), 1] = k
                src_rank[at:at + len(t)] = s
                at += len(t)

        payload = np.zeros((rows, fmt.payload_bytes(H)), np.uint8)
        scale_rows = np.zeros((rows, fmt.scale_bytes(H)), np.uint8)
        for s in sources:
            sel = np.flatnonzero(src_rank == s)
            if sel.size:
                payload[sel] = encoded[s][0][src_info[sel, 0]]
                scale_rows[sel] = encoded[s][1][src_info[sel, 0]]

        row_offsets = row_offsets.astype(np.uint32)
        scales, scales_offsets = _layout_scales(scale_rows, row_offsets, fmt, H)
        expert_ids = np.arange(L, dtype=np.int32)
        if cfg.fused_shared_expert:
            expert_ids = np.concatenate([np.array([cfg.shared_expert_id], np.int32), expert_ids])
        outs.append(Dispatched(tokens=_tokens_view(payload, fmt, H), scales=scales, row_offsets=row_offsets,
                               expert_ids=expert_ids, src_info=src_info, src_rank=src_rank,
                               scales_offsets=scales_offsets))
    return outs


# ---- combine -------------------------------------------------------------------------------------------------
def combine(expert_out: Sequence[np.ndarray], dispatched: Sequence[Dispatched],
            topk_weights: Optional[Sequence[np.ndarray]], cfg: EPConfig,
            epilogue: Optional[Callable[[np.ndarray, int], np.ndarray]] = None,
            num_tokens: Optional[Sequence[int]] = None) -> list[np.ndarray]:
    """Send every expert output row back to its source token and reduce over the top-k choices.

    Row i of ``expert_out[d]`` is the expert output for row i of ``dispatched[d]``; it returns to token
    ``src_info[i, 0]`` of rank ``src_rank[i]`` as top-k slot ``src_info[i, 1]`` (slot K: the shared expert).
    With weights: ``out[t] = sum_k w[t, k] * row(t, k)`` accumulated in float32 over k = 0..K-1 in order (each
    product and sum flushed to zero like the kernels), then ``+ row(t, K)`` (the shared expert, weight 1) when
    ``cfg.fused_shared_expert`` (with ``cfg.allreduce_world_size`` > 1: only for the tokens t of the rank's
    share ``[lo, hi)``, from row t - lo of group 0; the other tokens get no addition at all). With ``cfg.skip_a2a``
    only the slots whose expert is local to the rank contribute: a partial sum for a later all-reduce. With
    ``fused_shared_expert`` and ``allreduce_world_size`` = 1 every rank adds the shared expert of every token, so
    an all-reduce over A ranks holds A copies of it; with ``allreduce_world_size`` = A each rank of an all-reduce
    group adds it for its share only, and the sum over the group's A ranks holds it exactly once. The reference
    returns float32; the kernels cast the same value to ``cfg.combine_dtype``.

    Args:
        expert_out: list of R arrays ``[rows_r or more, H]``, float32 or ``ml_dtypes.bfloat16``; rows past
            ``row_offsets[-1]`` and padding rows are ignored.
        dispatched: the list :func:`dispatch` returned.
        topk_weights: list of R ``float32 [N_r, K]``, or ``None`` for the unreduced output.
        cfg: the same :class:`~cuep.config.EPConfig` as dispatch.
        epilogue: optional ``epilogue(out, rank) -> array`` of the same shape, applied to each rank's final
            float32 output (e.g. ``lambda out, r: out + residual[r]``).
        num_tokens: optional list of R token counts N_r. Taken from ``topk_weights`` when given, else recovered
            from ``dispatched`` (every token has one k = 0 row, or one shared-expert row); required only with
            ``skip_a2a`` and no weights, unless there is a shared expert and ``allreduce_world_size`` = 1: a token
            routed to no local expert (and outside the rank's shared-expert share) leaves no trace.

    Returns:
        list of R float32 arrays: ``[N_r, H]`` with weights; without weights the unreduced ``[N_r, K, H]``
        (``[N_r, K + 1, H]`` with the fused shared expert, slot K = its row), zero in the slots that no row
        filled (with ``skip_a2a``, the experts that are not local; with ``allreduce_world_size`` > 1, slot K of
        the tokens outside the rank's share).

    Raises:
        ValueError: naming the argument whose list length, shape or dtype is wrong, or when ``dispatched``
            does not match ``topk_weights`` / ``num_tokens`` (a slot filled twice, missing without skip_a2a, or a
            shared-expert row missing or outside the rank's share).
    """
    _check_cfg(cfg)
    R, K, H = cfg.n_ranks, cfg.top_k, cfg.hidden
    dispatched = _check_list("dispatched", dispatched, R)
    expert_out = _check_list("expert_out", expert_out, R)
    for d, disp in enumerate(dispatched):
        if not isinstance(disp, Dispatched):
            raise ValueError(f"dispatched[{d}] must be a Dispatched, got {type(disp).__name__}")
    eo = []
    for d, y in enumerate(expert_out):
        y = np.asarray(y)
        rows = dispatched[d].n_rows
        if y.ndim != 2 or y.shape[1] != H or y.shape[0] < rows:
            raise ValueError(f"expert_out[{d}] has shape {y.shape}; expected [>= {rows} rows "
                             f"(dispatched[{d}].row_offsets[-1]), hidden={H}]")
        if y.dtype not in (_F32, _BF16):
            raise ValueError(f"expert_out[{d}] has dtype {y.dtype}; expected float32 or bfloat16")
        eo.append(y)

    weights = None
    if topk_weights is not None:
        weights = _check_list("topk_weights", topk_weights, R)
        for r, w in enumerate(weights):
            w = np.asarray(w)
            if w.ndim != 2 or w.shape[1] != K:
                raise ValueError(f"topk_weights[{r}] has shape {w.shape}; expected [N, top_k={K}]")
            if w.dtype != _F32:
                raise ValueError(f"topk_weights[{r}] has dtype {w.dtype}; expected float32")
            weights[r] = w

    n_tokens = _resolve_num_tokens(num_tokens, weights, dispatched, cfg)
    n_slots = K + int(cfg.fused_shared_expert)
    shares = [cfg.shared_expert_share(s, n_tokens[s]) for s in range(R)]  # the shared expert's tokens [lo, hi)

    # Gather: every row goes back to (source rank, token, slot).
    unreduced = [np.zeros((n_tokens[s], n_slots, H), np.float32) for s in range(R)]
    filled = [np.zeros((n_tokens[s], n_slots), np.int64) for s in range(R)]
    for d, disp in enumerate(dispatched):
        rows = disp.n_rows
        info = np.asarray(disp.src_info)[:rows]
        srank = np.asarray(disp.src_rank)[:rows]
        for s in range(R):
            sel = np.flatnonzero(srank == s)
            if sel.size == 0:
                continue
            if cfg.skip_a2a and s != d:
                raise ValueError(f"dispatched[{d}] holds rows of source rank {s}, impossible with skip_a2a")
            t, k = info[sel, 0], info[sel, 1]
            if t.min() < 0 or t.max() >= n_tokens[s] or k.min() < 0 or k.max() >= n_slots:
                raise ValueError(f"dispatched[{d}].src_info names a (token, k) outside [N={n_tokens[s]}, "
                                 f"{n_slots}] for source rank {s}: it does not match topk_weights/num_tokens")
            unreduced[s][t, k] = eo[d][sel].astype(np.float32)
            np.add.at(filled[s], (t, k), 1)
    for s in range(R):
        if (filled[s] > 1).any():
            raise ValueError(f"dispatched: some (token, k) of source rank {s} appears in more than one row")
        # Without skip_a2a every routed slot has exactly one row; the shared slot always has one.
        if not cfg.skip_a2a and (filled[s][:, :K] != 1).any():
            raise ValueError(f"dispatched: some (token, k) of source rank {s} has no row (does dispatched match "
                             f"topk_weights/num_tokens?)")
        if cfg.fused_shared_expert:
            lo, hi = shares[s]
            if (filled[s][lo:hi, K] != 1).any():
                raise ValueError(f"dispatched: some token of source rank {s} in its shared-expert share [{lo}, {hi})"
                                 f" has no shared-expert row")
            if filled[s][:lo, K].any() or filled[s][hi:, K].any():
                raise ValueError(f"dispatched: source rank {s} has a shared-expert row outside its share [{lo}, {hi})"
                                 f" (allreduce_world_size={cfg.allreduce_world_size})")

    outs = []
    for s in range(R):
        if weights is None:
            out = unreduced[s]
        else:
            w = weights[s]
            out = np.zeros((n_tokens[s], H), np.float32)
            for k in range(K):
                prod = ftz(w[:, k:k + 1] * unreduced[s][:, k])
                prod = np.where(filled[s][:, k:k + 1] > 0, prod, np.float32(0))
                out = ftz(out + prod)
            if cfg.fused_shared_expert:  # to the tokens of the rank's share only
                lo, hi = shares[s]
                out[lo:hi] = ftz(out[lo:hi] + unreduced[s][lo:hi, K])
        if epilogue is not None:
            res = np.asarray(epilogue(out, s))
            if res.shape != out.shape:
                raise ValueError(f"epilogue returned shape {res.shape} for rank {s}; expected {out.shape}")
            out = res.astype(np.float32, copy=False)
        outs.append(out)
    return outs


def _resolve_num_tokens(num_tokens, weights, dispatched: list[Dispatched], cfg: EPConfig) -> list[int]:
    R = cfg.n_ranks
    if num_tokens is not None:
        num_tokens = _check_list("num_tokens", num_tokens, R)
        n = []
        for r, v in enumerate(num_tokens):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= cfg.max_tokens_per_rank:
                raise ValueError(f"num_tokens[{r}]={v!r} must be an int in [0, max_tokens_per_rank="
                                 f"{cfg.max_tokens_per_rank}]")
            if weights is not None and weights[r].shape[0] != v:
                raise ValueError(f"num_tokens[{r}]={v} disagrees with topk_weights[{r}] ({weights[r].shape[0]} rows)")
            n.append(int(v))
        return n
    if weights is not None:
        for r, w in enumerate(weights):
            if w.shape[0] > cfg.max_tokens_per_rank:
                raise ValueError(f"topk_weights[{r}] has {w.shape[0]} rows > max_tokens_per_rank="
                                 f"{cfg.max_tokens_per_rank}")
        return [w.shape[0] for w in weights]
    if cfg.skip_a2a and not cfg.fused_shared_expert:
        raise ValueError("num_tokens is required with skip_a2a, no fused shared expert and no topk_weights: a "
                         "token routed to no local expert leaves no row to count")
    if cfg.allreduce_world_size > 1:
        raise ValueError(f"num_tokens is required with allreduce_world_size={cfg.allreduce_world_size} and no "
                         f"topk_weights: a rank holds shared-expert rows for its share of the tokens only, and a "
                         f"token outside it routed to no local expert leaves no row to count")
    # Every token has exactly one row with k = 0 (routed) or k = K (shared expert); count them per source rank.
    marker = cfg.top_k if cfg.fused_shared_expert else 0
    n = [0] * R
    for disp in dispatched:
        rows = disp.n_rows
        info = np.asarray(disp.src_info)[:rows]
        srank = np.asarray(disp.src_rank)[:rows]
        hit = (info[:, 1] == marker) & (srank >= 0)
        n = [n[s] + int(np.count_nonzero(hit & (srank == s))) for s in range(R)]
    return n


# ---- fused SwiGLU --------------------------------------------------------------------------------------------
# silu's float32 constants (docs/formats.md, "Fused SwiGLU"; cuep/cuda_src/formats.cuh silu_f32): exact float32
# values, spelled as their bits.
def _f32_bits(b: int) -> np.float32:
    return np.array([b], np.uint32).view(np.float32)[0]


SILU_X_MIN = np.float32(-88.0)          # rint(-88 * log2e) = -127: 2**n = +0, so e = +0
SILU_LOG2E = _f32_bits(0x3FB8AA3B)     # 1.44269504f
SILU_RINT = np.float32(1.5 * 2**23)    # adding it rounds to an integer
SILU_LN2_HI = _f32_bits(0x3F318000)    # 0.693359375
SILU_LN2_LO = _f32_bits(0xB95E8083)    # -2.12194440e-4f
SILU_POLY = tuple(_f32_bits(b) for b in (0x3AB50D47, 0x3C091FDB, 0x3D2AAC8B, 0x3E2AAA45, 0x3EFFFFFE)) + (
    np.float32(1.0), np.float32(1.0))  # c6, c5, c4, c3, c2, c1, c0 (Horner order)


def silu_f32(g: np.ndarray) -> np.ndarray:
    """silu(g) = g * sigmoid(g) in float32, bit for bit as the CUDA kernel computes it (docs/formats.md).

    Every operation is one IEEE float32 operation rounded to nearest even and flushed (FTZ) as ``-ftz=true`` does;
    ``fma`` rounds once (:func:`cuep.reference.quant.fma_f32`); g is flushed first::

        x   = max(-|g|, -88)                  (x in [-88, 0]; a NaN g gives -88)
        t   = fma(x, log2e, 1.5 * 2**23)      (n = t - 1.5 * 2**23 = rint(x * log2e), ties to even, in [-127, 0])
        r   = fma(n, -ln2_hi, x); r = fma(n, -ln2_lo, r)
        p   = c6; p = fma(p, r, c5); ...; p = fma(p, r, 1); p = fma(p, r, 1)
        e   = p * 2**n                        (e = e**-|g|; 2**n from the bits (n + 127) << 23: n = -127 gives +0)
        s   = 1 / (1 + e)                     (1 + e in [1, 2]: sigmoid(|g|))
        num = g * e if g < 0 else g           (sigmoid(-|g|) = e * s)
        sv  = num * s

    Args:
        g: float32 array, any shape.
    Returns:
        float32 array of the same shape.
    """
    if np.asarray(g).dtype != _F32:
        raise ValueError(f"g must be float32, got {np.asarray(g).dtype}")
    shape = np.shape(g)
    g = ftz(np.ascontiguousarray(g).reshape(-1))
    with np.errstate(all="ignore"):  # -Inf * 0 and NaN inputs
        x = np.fmax(-np.abs(g), SILU_X_MIN)
        t = fma_f32(x, SILU_LOG2E, SILU_RINT)
        n = t - SILU_RINT                                               # exact: an integer in [-127, 0]
        r = fma_f32(n, -SILU_LN2_LO, fma_f32(n, -SILU_LN2_HI, x))
        p = np.full_like(r, SILU_POLY[0])
        for c in SILU_POLY[1:]:
            p = fma_f32(p, r, c)
        pow2 = ((n.astype(np.int32) + 127).astype(np.uint32) << np.uint32(23)).view(_F32)
        e = ftz(p * pow2)
        s = ftz(np.float32(1.0) / ftz(np.float32(1.0) + e))
        num = np.where(g < 0, ftz(g * e), g)
        return ftz(num * s).reshape(shape)


def fused_silu(h: np.ndarray, row_offsets: np.ndarray, fmt="bf16", interleaved: bool = False,
               global_scale: float = 1.0):
    """``silu(gate) * up`` of the rows below ``row_offsets[-1]``, as bf16 or quantized for the down GEMM.

    Arithmetic (``docs/formats.md``, "Fused SwiGLU"): gate and up are read as float32 and flushed (FTZ);
    ``sv = silu_f32(gate)`` (range reduction, an FMA polynomial, a correctly rounded reciprocal: :func:`silu_f32`);
    ``y = sv * up`` as a float32 multiply, flushed; then ``bf16(y)`` (round to nearest even) or
    ``quantize(y, fmt, global_scale)``.

    Args:
        h: ``[rows_cap, 2I]`` float32 or ``ml_dtypes.bfloat16``: gate half then up half per row, or (interleaved)
            gate/up alternating element by element. Rows at or past ``row_offsets[-1]`` are never read.
        row_offsets: ``[G + 1]`` integer group offsets from dispatch (uint32); they also place the swizzled
            scales of nvfp4/mxfp4.
        fmt: ``"bf16" | "fp8" | "nvfp4" | "mxfp4"`` (or a :class:`~cuep.formats.Format`).
        interleaved: gate/up interleaved element by element instead of two halves.
        global_scale: float32 global scale of nvfp4.

    Returns:
        bf16: ``ml_dtypes.bfloat16 [rows, I]``; fp8: ``(payload uint8 [rows, I], scales float32 [I/128, rows])``;
        nvfp4/mxfp4: ``(payload uint8 [rows, I/2], swizzled scales uint8 1-D, scales_offsets uint32 [G])``,
        with ``rows = row_offsets[-1]``.

    Raises:
        ValueError: naming the argument (shape, dtype, odd width, I not a multiple of the format's group,
            row_offsets not monotone or past the rows of h).
    """
    f = _resolve_format(fmt)
    h = np.asarray(h)
    if h.ndim != 2 or h.shape[1] % 2:
        raise ValueError(f"h has shape {h.shape}; expected [rows, 2I]")
    if h.dtype not in (_F32, _BF16):
        raise ValueError(f"h has dtype {h.dtype}; expected float32 or bfloat16")
    inter = h.shape[1] // 2
    if f.quantized and inter % f.group:
        raise ValueError(f"h has I={inter} columns per half; format {f.name!r} needs a multiple of {f.group}")
    ro = np.asarray(row_offsets)
    if ro.ndim != 1 or ro.size < 1 or not np.issubdtype(ro.dtype, np.integer):
        raise ValueError(f"row_offsets must be a 1-D integer array [G + 1], got shape {ro.shape} dtype {ro.dtype}")
    ro = ro.astype(np.int64)
    if (ro < 0).any() or (np.diff(ro) < 0).any():
        raise ValueError("row_offsets must be non-negative and non-decreasing")
    rows = int(ro[-1])
    if rows > h.shape[0]:
        raise ValueError(f"row_offsets[-1]={rows} exceeds the rows of h ({h.shape[0]})")

    x = h[:rows].astype(np.float32)
    gate, up = (x[:, 0::2], x[:, 1::2]) if interleaved else (x[:, :inter], x[:, inter:])
    sv = silu_f32(np.ascontiguousarray(gate))
    up = ftz(np.ascontiguousarray(up))
    with np.errstate(all="ignore"):
        y = ftz(sv * up)

    if f.name == "bf16":
        return y.astype(_BF16)
    payload, scale_rows = _encode(y, f, inter, global_scale)
    scales, scales_offsets = _layout_scales(scale_rows, ro.astype(np.uint32), f, inter)
    if f.name == "fp8":
        return payload, scales
    return payload, scales, scales_offsets
