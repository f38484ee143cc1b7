"""Routing and byte accounting of one dispatch/combine round (pure NumPy, no GPU).

Every figure counts **messages**: a token travels once to each *distinct* rank that holds at least one of its top-k
experts (cuep's design, ``ep_semantics.md`` "Design notes for speed"), and combine mirrors it with one partial sum
per (token, rank). With ``P[s, d]`` = tokens of source rank ``s`` that have at least one expert on rank ``d``:

* dispatch message = payload + scale bytes of the wire format (``cfg.payload_bytes + cfg.message.scale_bytes``;
  cuep's small metadata record and the NCCL baseline's 16-byte row padding are not counted);
* combine message = ``hidden x combine itemsize`` (one partial sum in the combine dtype);
* **send bytes** of rank ``r`` (what crosses NVLink out of GPU ``r``):
  dispatch ``m_d * sum_{d != r} P[r, d]``; combine ``m_c * sum_{s != r} P[s, r]`` (rank ``r`` returns partial
  sums for the tokens it received);
* **algorithm bytes** of rank ``r`` (the "logical" figure of ``TARGETS.md``, the rank's own tokens included):
  dispatch ``m_d * sum_s P[s, r]`` (all bytes received); combine ``m_c * sum_s P[s, r]`` (all partial sums sent);
* a round trip adds the two.

Bandwidth = bytes / the GPU's median time. With one rank ``P = [[N]]``: no send bytes, algorithm bytes ``N x m``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

OPS = ("dispatch", "combine", "roundtrip")


def random_routing(rng: np.random.Generator, n: int, n_experts: int, top_k: int) -> np.ndarray:
    """int32 [n, K]: K distinct experts per token, uniform (as ``tests/ep_check.py`` draws them)."""
    return np.argsort(rng.random((n, n_experts)), axis=1)[:, :top_k].astype(np.int32)


def rank_mask(topk_ids: np.ndarray, n_experts: int, n_ranks: int) -> np.ndarray:
    """bool [N, R]: token t has at least one of its experts on rank d (expert e lives on rank e // (E / R))."""
    ids = np.asarray(topk_ids)
    n = ids.shape[0]
    mask = np.zeros((n, n_ranks), dtype=bool)
    if n:
        mask[np.arange(n)[:, None], ids // (n_experts // n_ranks)] = True
    return mask


def pair_counts(topk_ids: list[np.ndarray], n_experts: int) -> np.ndarray:
    """int64 [R, R]: ``P[s, d]`` = tokens of rank s with at least one expert on rank d (R = len(topk_ids))."""
    R = len(topk_ids)
    return np.stack([rank_mask(ids, n_experts, R).sum(axis=0) for ids in topk_ids]).astype(np.int64)


def dispatch_message_bytes(cfg) -> int:
    """Bytes of one dispatch message: the wire format's payload plus its scales."""
    return int(cfg.payload_bytes + cfg.message.scale_bytes)


def combine_message_bytes(cfg) -> int:
    """Bytes of one combine message: a partial sum of ``hidden`` values in the combine dtype."""
    return int(cfg.hidden * cfg.combine_itemsize)


@dataclass(frozen=True)
class Traffic:
    """Bytes one round moves, per rank.

    Attributes:
        send: int64 [R], bytes that leave GPU r for other GPUs.
        algo: int64 [R], the logical bytes of rank r (its own included).
    """

    send: np.ndarray
    algo: np.ndarray

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.send + other.send, self.algo + other.algo)

    def as_dict(self) -> dict:
        return {"send": [int(v) for v in self.send], "algo": [int(v) for v in self.algo]}


def dispatch_traffic(P: np.ndarray, message_bytes: int) -> Traffic:
    """send[r] = m * sum_{d != r} P[r, d]; algo[r] = m * sum_s P[s, r]."""
    P = np.asarray(P, dtype=np.int64)
    diag = np.diag(P)
    return Traffic(message_bytes * (P.sum(axis=1) - diag), message_bytes * P.sum(axis=0))


def combine_traffic(P: np.ndarray, message_bytes: int) -> Traffic:
    """send[r] = m * sum_{s != r} P[s, r]; algo[r] = m * sum_s P[s, r]."""
    P = np.asarray(P, dtype=np.int64)
    diag = np.diag(P)
    return Traffic(message_bytes * (P.sum(axis=0) - diag), message_bytes * P.sum(axis=0))


def op_traffic(op: str, P: np.ndarray, dispatch_bytes: int, combine_bytes: int) -> Traffic:
    """Traffic of ``op`` in :data:`OPS` (a round trip is dispatch + combine)."""
    if op == "dispatch":
        return dispatch_traffic(P, dispatch_bytes)
    if op == "combine":
        return combine_traffic(P, combine_bytes)
    if op == "roundtrip":
        return dispatch_traffic(P, dispatch_bytes) + combine_traffic(P, combine_bytes)
    raise ValueError(f"op={op!r} must be one of {OPS}")


def mean_traffic(items: list[Traffic]) -> Traffic:
    """Per-rank mean over input sets (the timed runs rotate among them)."""
    return Traffic(np.mean([t.send for t in items], axis=0), np.mean([t.algo for t in items], axis=0))


def expected_rows(topk_ids: list[np.ndarray], n_experts: int, rank: int, row_align: int = 1) -> int:
    """``row_offsets[-1]`` that a dispatch to ``rank`` must produce: per local expert, the rows that chose it from
    every source, padded up to ``row_align`` (fp8 pads each group to 4). A cheap check that the timed round did
    the work the routing asks for."""
    R = len(topk_ids)
    L = n_experts // R
    counts = np.zeros(L, dtype=np.int64)
    for ids in topk_ids:
        ids = np.asarray(ids).ravel()
        local = ids[ids // L == rank] - rank * L
        counts += np.bincount(local, minlength=L)
    return int((-(-counts // row_align) * row_align).sum())


# ---- the floor of an op on one GPU (python -m cuep.bench --floor) --------------------------------------------------
FLOOR_OPS = ("dispatch", "combine")
ROW_META_BYTES = 8   # per dispatched row: src_info (token, slot), 2 x int32; combine reads a row's token and weight


def _round16(n: float) -> int:
    return int(-(-int(math.ceil(n)) // 16) * 16)


def floor_bytes(op: str, cfg, topk_ids: np.ndarray) -> dict:
    """Bytes the floor copy of ``op`` reads and writes, for one rank holding every expert (``cfg.n_ranks == 1``).

    With N tokens, ``rows = N x K`` (each choice is a row: every expert is local), H hidden, bf16 input:

    * **dispatch** reads x (``2 N H``), topk_ids and topk_weights (``4 N K`` each); writes every row's payload and
      scales in the wire format (``cfg.payload_bytes + cfg.message.scale_bytes``) and its ``src_info``
      (``ROW_META_BYTES``), plus ``row_offsets``, ``expert_ids`` (and ``scales_offsets`` for nvfp4 / mxfp4), 4
      bytes per group each (row_offsets one more);
    * **combine** (bf16, weights given at dispatch) reads every row of ``expert_out`` (``rows x H x itemsize``)
      and per row its token and weight (``ROW_META_BYTES``); writes the output ``[N, H]``.

    ``write_layout`` is what the output layout makes the dispatch write besides: fp8 pads each expert's rows to a
    multiple of 4 (padding rows get zero payload, zero scales and ``src_info``); nvfp4 / mxfp4 write every 128x4
    scale tile a group uses in full (``ceil(rows_e / 128)`` tiles of ``k_tiles x 512`` bytes per expert e) instead
    of the rows' scale bytes. Equal to ``write`` for bf16 and for combine. Each figure is rounded up to 16 bytes
    (the copy moves 16-byte vectors).

    Returns ``{"read", "write", "write_layout", "rows", "padded_rows", "scale_tiles"}``.
    """
    from ..formats import SCALE_TILE_BYTES, SCALE_TILE_ROWS

    if op not in FLOOR_OPS:
        raise ValueError(f"op={op!r} must be one of {FLOOR_OPS}")
    if cfg.n_ranks != 1:
        raise ValueError(f"floor_bytes counts one rank holding every expert; cfg has {cfg.n_ranks} ranks")
    ids = np.asarray(topk_ids)
    n, k = ids.shape if ids.ndim == 2 else (0, cfg.top_k)
    H, G = cfg.hidden, cfg.n_groups
    rows = int(ids.size)
    counts = np.bincount(ids.ravel().astype(np.int64), minlength=cfg.n_experts) if rows else \
        np.zeros(cfg.n_experts, np.int64)
    if op == "combine":
        read = rows * (H * cfg.combine_itemsize + ROW_META_BYTES)
        write = n * H * cfg.combine_itemsize
        return {"read": _round16(read), "write": _round16(write), "write_layout": _round16(write), "rows": rows,
                "padded_rows": rows, "scale_tiles": 0}
    fmt = cfg.fmt
    payload, scales = int(cfg.payload_bytes), int(cfg.message.scale_bytes)
    meta = 4 * (G + 1) + 4 * G + (4 * G if fmt.swizzled_scales else 0)
    read = n * H * 2 + 2 * 4 * n * k
    write = rows * (payload + scales + ROW_META_BYTES) + meta
    align = int(fmt.row_align)
    padded = int((-(-counts // align) * align).sum())
    tiles = int((-(-counts // SCALE_TILE_ROWS)).sum()) if fmt.swizzled_scales else 0
    if fmt.swizzled_scales:
        layout = padded * (payload + ROW_META_BYTES) + tiles * fmt.scale_k_tiles(H) * SCALE_TILE_BYTES + meta
    else:
        layout = padded * (payload + scales + ROW_META_BYTES) + meta
    return {"read": _round16(read), "write": _round16(write), "write_layout": _round16(layout), "rows": rows,
            "padded_rows": padded, "scale_tiles": tiles}
