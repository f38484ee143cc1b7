"""Inputs and timed callables: cuep dispatch / combine / round trip and the NCCL baseline for one (format, N).

Inputs are fresh random data (never zeros): bf16 tokens whose magnitudes span several octaves (as the EP tests
draw them), uniform top-k routing with K distinct experts, random weights. Several input *sets* are drawn and the
timed runs rotate among them, so neither the routing nor the data repeat run after run. Tokens are drawn on the
GPU; routing on the host (the byte accounting and the NCCL layout need it there).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import nccl as nccl_mod
from .traffic import Traffic, combine_message_bytes, dispatch_message_bytes, expected_rows, mean_traffic, \
    op_traffic, pair_counts


@dataclass
class Inputs:
    """One N's inputs on every device, shared by every format. Lists are [set][rank]."""

    n_tokens: int
    hidden: int
    top_k: int
    n_experts: int
    devices: list[int]
    ids_host: list[list[np.ndarray]]
    weights_host: list[list[np.ndarray]]
    x: list[list] = field(default_factory=list)
    ids: list[list] = field(default_factory=list)
    weights: list[list] = field(default_factory=list)

    @property
    def n_sets(self) -> int:
        return len(self.ids_host)

    def pairs(self) -> list[np.ndarray]:
        """``P`` of every set (see :mod:`cuep.bench.traffic`)."""
        return [pair_counts(ids, self.n_experts) for ids in self.ids_host]


def bf16_dtype():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def random_bf16(gen, shape, octaves: bool = True, rows: int | None = None, chunk: int = 8192):
    """Random bf16 [n, h] on the current device: normal values, each row scaled by 2**k with k in [-6, 6) if
    ``octaves``; rounded to nearest even from float32 with bit arithmetic (no dependence on CuPy's casts).

    Only the first ``rows`` rows are drawn (default all); the rest stay uninitialised (for outputs of which only
    a prefix is ever read). Drawn ``chunk`` rows at a time, so the float32 temporaries stay small.
    """
    import cupy

    n, h = shape
    out = cupy.empty((n, h), dtype=cupy.uint16)
    rows = n if rows is None else min(rows, n)
    for a in range(0, rows, chunk):
        b = min(rows, a + chunk)
        x = gen.standard_normal((b - a, h), dtype=cupy.float32)
        if octaves:
            x *= cupy.exp2(cupy.floor(gen.random((b - a, 1), dtype=cupy.float32) * 12) - 6)
        u = x.view(cupy.uint32)
        out[a:b] = ((u + cupy.uint32(0x7FFF) + ((u >> 16) & cupy.uint32(1))) >> 16).astype(cupy.uint16)
    return out.view(bf16_dtype())


def random_bytes(gen, n: int, nbytes: int):
    """uint8 [n, nbytes] random bytes on the current device (stand-in for already-encoded message rows)."""
    import cupy

    return (gen.random((n, nbytes), dtype=cupy.float32) * 256).astype(cupy.uint8)


def host_routing(n_ranks: int, n_tokens: int, top_k: int, n_experts: int, *, n_sets: int = 2,
                 seed: int = 0) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    """The routing :func:`make_inputs` draws, on the host only: (topk_ids, topk_weights), each [set][rank] of
    int32 / float32 [n_tokens, top_k] (so a plan can count bytes without a GPU)."""
    from .traffic import random_routing

    rng = np.random.default_rng(seed)
    ids_h = [[random_routing(rng, n_tokens, n_experts, top_k) for _ in range(n_ranks)] for _ in range(n_sets)]
    w_h = [[rng.random((n_tokens, top_k)).astype(np.float32) for _ in range(n_ranks)] for _ in range(n_sets)]
    return ids_h, w_h


def make_inputs(devices: list[int], n_tokens: int, hidden: int, top_k: int, n_experts: int, *, n_sets: int = 2,
                seed: int = 0, x_dtype: str = "bfloat16") -> Inputs:
    """Draw ``n_sets`` input sets for every device (see the module docstring). ``x_dtype="float32"``: the same
    tokens (bf16 values) as float32 arrays, for the kernels that encode from float32 input."""
    import cupy

    if x_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"x_dtype={x_dtype!r} must be 'bfloat16' or 'float32'")

    ids_h, w_h = host_routing(len(devices), n_tokens, top_k, n_experts, n_sets=n_sets, seed=seed)
    inp = Inputs(n_tokens, hidden, top_k, n_experts, list(devices), ids_h, w_h)
    for k in range(n_sets):
        xs, ids, ws = [], [], []
        for r, dev in enumerate(devices):
            with cupy.cuda.Device(dev):
                gen = cupy.random.default_rng(seed * 1000003 + k * 101 + r)
                x = random_bf16(gen, (n_tokens, hidden))
                if x_dtype == "float32":  # exact: a bf16 value is the high half of its float32
                    x = (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
                xs.append(x)
                ids.append(cupy.asarray(ids_h[k][r]))
                ws.append(cupy.asarray(w_h[k][r]))
        inp.x.append(xs)
        inp.ids.append(ids)
        inp.weights.append(ws)
    return inp


def traffic_of(op: str, cfg, pairs: list[np.ndarray]) -> Traffic:
    """Mean per-rank traffic of ``op`` over the input sets (``a2a_dispatch``/``a2a_combine`` count as the
    dispatch/combine they are part of)."""
    base = {"a2a_dispatch": "dispatch", "a2a_combine": "combine"}.get(op, op)
    return mean_traffic([op_traffic(base, P, dispatch_message_bytes(cfg), combine_message_bytes(cfg))
                         for P in pairs])


class CuepCase:
    """cuep on every device for one format and N: a :class:`cuep.Buffer` sized for exactly this N.

    Combine is timed on its own after an untimed dispatch (``setup_combine``); topk weights are given at
    dispatch, so combine returns one partial sum per (token, rank) (cuep's reduced combine traffic).
    """

    def __init__(self, group, inputs: Inputs, fmt: str, *, num_sms: int | None = None, timeout_s: float = 10.0,
                 seed: int = 1, small_batch_tokens: int | None = None) -> None:
        import cupy

        import cuep

        self.inputs = inputs
        n_max = max(inputs.n_tokens, 1)
        self.cfg = cuep.EPConfig(hidden=inputs.hidden, top_k=inputs.top_k, n_experts=inputs.n_experts,
                                 max_tokens_per_rank=n_max, n_gpus_per_node=group.n_ranks, dispatch_format=fmt,
                                 small_batch_tokens=None if small_batch_tokens is None else
                                 min(small_batch_tokens, n_max))
        self.buf = cuep.Buffer(group, self.cfg, timeout_s=timeout_s, num_sms=num_sms)
        self.group = group
        # expert outputs: [capacity, H] as combine requires; only the rows a dispatch of these inputs can fill are
        # ever read, so only those are drawn
        self.expert_out = []
        for r, dev in enumerate(group.devices):
            used = max(expected_rows(ids, self.cfg.n_experts, r, self.cfg.fmt.row_align) for ids in inputs.ids_host)
            with cupy.cuda.Device(dev):
                gen = cupy.random.default_rng(seed * 7919 + r)
                self.expert_out.append(random_bf16(gen, (self.cfg.capacity, self.cfg.hidden), octaves=False,
                                                   rows=used))
        self._handle = None

    @property
    def num_sms(self) -> int:
        return int(self.buf.num_sms)

    def dispatch(self, i: int) -> None:
        import cuep

        k = i % self.inputs.n_sets
        self._handle = cuep.dispatch(self.buf, self.inputs.x[k], self.inputs.ids[k], self.inputs.weights[k])

    setup_combine = dispatch

    def combine(self, i: int) -> None:
        import cuep

        cuep.combine(self.buf, self.expert_out, self._handle)

    def roundtrip(self, i: int) -> None:
        self.dispatch(i)
        self.combine(i)

    def check(self) -> str:
        """One round trip of set 0 (which also compiles every kernel before any timing): every rank's dispatched
        row count must be what the routing asks for. "ok" or a message."""
        import cupy

        self.dispatch(0)
        self.buf.synchronize()
        bad = []
        for r, d in enumerate(self._handle):
            with cupy.cuda.Device(self.group.devices[r]):
                got = int(d.row_offsets[-1].get())
            want = expected_rows(self.inputs.ids_host[0], self.cfg.n_experts, r, self.cfg.fmt.row_align)
            if got != want:
                bad.append(f"rank {r}: {got} rows, routing asks for {want}")
        self.combine(0)
        self.buf.synchronize()
        return "ok" if not bad else "; ".join(bad)

    def close(self) -> None:
        self._handle = None
        self.buf.close()
        self.buf = None
        self.expert_out = []


def nccl_case(comms, inputs: Inputs, cfg, expert_out: list, seed: int = 2):
    """The NCCL baseline for the same inputs: bf16 messages are the tokens themselves; other formats send random
    bytes of the encoded size (payload + scales, padded to 16 bytes), quantization not timed."""
    import cupy

    layouts = [nccl_mod.nccl_layout(ids, ws, inputs.n_experts) for ids, ws in zip(inputs.ids_host,
                                                                                  inputs.weights_host)]
    row_bytes = nccl_mod.message_row_bytes(dispatch_message_bytes(cfg))
    rows = []
    for k in range(inputs.n_sets):
        per_rank = []
        for r, dev in enumerate(inputs.devices):
            with cupy.cuda.Device(dev):
                if cfg.fmt.name == "bf16" and row_bytes == 2 * cfg.hidden:
                    per_rank.append(inputs.x[k][r])
                else:
                    gen = cupy.random.default_rng(seed * 1000003 + k * 101 + r)
                    per_rank.append(random_bytes(gen, inputs.n_tokens, row_bytes))
        rows.append(per_rank)
    return nccl_mod.NcclCase(comms, layouts, rows, expert_out, cfg.hidden)


def check_nccl(case, inputs: Inputs, samples: int = 32, seed: int = 3) -> str:
    """Run dispatch and combine of set 0 once and compare sampled rows with the host's expectation."""
    import cupy

    rng = np.random.default_rng(seed)
    case.dispatch(0)
    case.combine(0)
    for dev in inputs.devices:
        with cupy.cuda.Device(dev):
            cupy.cuda.get_current_stream().synchronize()
    lay = case.layouts[0]
    R, devs = lay.n_ranks, inputs.devices
    problems = []

    def host_rows(r, arr, idx) -> np.ndarray:
        """Rows ``idx`` of rank r's device array, on the host (only those rows travel)."""
        with cupy.cuda.Device(devs[r]):
            return cupy.asnumpy(arr[cupy.asarray(np.asarray(idx, dtype=np.int64))])

    for r in range(R):
        roff = lay.recv_offsets(r)
        n_rows = len(lay.unperm[r])
        if n_rows == 0:
            continue
        picks = rng.choice(n_rows, size=min(samples, n_rows), replace=False)
        got_rows = host_rows(r, case.dispatched_rows(0, r), picks)
        for i, got in zip(picks, got_rows):
            m = int(lay.unperm[r][i])
            s = int(np.searchsorted(roff, m, side="right") - 1)
            t = int(lay.perm[s][lay.send_offsets(s)[r] + (m - roff[s])])
            want = host_rows(s, case.rows16[0][s], [t])[0].view(np.uint8)
            if not np.array_equal(got.view(np.uint8), want):
                problems.append(f"dispatch rank {r} row {i}")
                break
    # combine: out[s][t] = sum over the ranks r holding t of the bf16 partial sum_i w_i * expert_out_r[row_i]
    for s in range(R):
        n = len(lay.final_seg[s]) - 1
        if n == 0:
            continue
        so = lay.send_offsets(s)
        picks = rng.choice(n, size=min(4, n), replace=False)
        outs = host_rows(s, case.combined(0, s), picks).astype(np.float32)
        for t, got in zip(picks, outs):
            want = np.zeros(case.hidden, np.float32)
            for r in range(R):
                block = lay.perm[s][so[r]:so[r + 1]]  # tokens of s sent to r, ascending
                j = int(np.searchsorted(block, t))
                if j >= len(block) or block[j] != t:
                    continue
                m = int(lay.recv_offsets(r)[s] + j)
                a, b = int(lay.comb_seg[r][m]), int(lay.comb_seg[r][m + 1])
                eo = host_rows(r, case.expert_out[r], lay.comb_rows[r][a:b])
                part = (lay.comb_weights[r][a:b, None] * eo.astype(np.float32)).sum(axis=0)
                want += part.astype(bf16_dtype()).astype(np.float32)
            scale = max(1.0, float(np.abs(want).max()))
            if not np.allclose(got, want, rtol=2e-2, atol=2e-2 * scale):
                problems.append(f"combine rank {s} token {t}")
                break
    return "ok" if not problems else "MISMATCH: " + ", ".join(problems)
