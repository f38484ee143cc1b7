"""The NumPy reference of dispatch / combine / fused_silu against brute-force restatements of the contract."""
from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from cuep.config import EPConfig
from cuep.reference.ep import (SILU_LN2_HI, SILU_LN2_LO, SILU_LOG2E, SILU_POLY, Dispatched, combine, dispatch,
                               fused_silu, silu_f32)
from cuep.reference.quant import dequantize, fma_f32, quantize, swizzle_block_scales, unswizzle_block_scales

FORMATS = ["bf16", "fp8", "nvfp4", "mxfp4"]
H = 256
T = 24
E = 16


# ---- arranging inputs ----------------------------------------------------------------------------------------
def make_cfg(fmt="bf16", n_ranks=2, top_k=2, n_experts=E, shared=False, skip=False, hidden=H, tokens=T,
             combine_dtype="bfloat16", allreduce=1):
    return EPConfig(hidden=hidden, top_k=top_k, n_experts=n_experts, max_tokens_per_rank=tokens,
                    n_gpus_per_node=n_ranks, dispatch_format=fmt, combine_dtype=combine_dtype,
                    fused_shared_expert=shared, skip_a2a=skip, allreduce_world_size=allreduce)


def share(cfg, r, n):
    """The contract's shared-expert share of rank r holding n tokens: position p = r % A in its all-reduce group,
    tokens [p * n // A, (p + 1) * n // A) (all n tokens when A = 1)."""
    A = cfg.allreduce_world_size
    p = r % A
    return range(p * n // A, (p + 1) * n // A)


def route(rng, n, k, e, hot=None):
    """int32 [n, k] top-k ids without duplicates (argsort of random scores); ``hot`` wins most rows."""
    scores = rng.random((n, e))
    if hot is not None:
        scores[:, hot] += 0.9 * (rng.random(n) < 0.9)
    return np.argsort(-scores, axis=1)[:, :k].astype(np.int32)


def token_counts(n_ranks, cfg_tokens, rng):
    """Rank 0 empty, the last rank full (N = T), the others random (a single rank alternates by test)."""
    if n_ranks == 1:
        return [int(rng.choice([0, cfg_tokens, rng.integers(1, cfg_tokens)]))]
    counts = [int(rng.integers(1, cfg_tokens)) for _ in range(n_ranks)]
    counts[0], counts[-1] = 0, cfg_tokens
    return counts


def make_inputs(cfg, rng, counts=None, skewed=False, dtype=np.float32):
    R = cfg.n_ranks
    counts = token_counts(R, cfg.max_tokens_per_rank, rng) if counts is None else counts
    if cfg.skip_a2a:  # every rank holds the same tokens (as after an all-gather)
        n = counts[-1]
        x = (rng.standard_normal((n, cfg.hidden)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
        ids = route(rng, n, cfg.top_k, cfg.n_experts, hot=1 if skewed else None)
        xs, idss = [x.astype(dtype)] * R, [ids] * R
    else:
        xs, idss = [], []
        for n in counts:
            x = (rng.standard_normal((n, cfg.hidden)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
            xs.append(x.astype(dtype))
            idss.append(route(rng, n, cfg.top_k, cfg.n_experts, hot=1 if skewed else None))
    return xs, idss


def expected_blocks(cfg, xs, ids):
    """Brute force: per receiving rank, per group, the (src rank, t, k) rows in canonical order."""
    R, L, K = cfg.n_ranks, cfg.n_local_experts, cfg.top_k
    want = {(r, l): [] for r in range(R) for l in range(L)}
    for s in range(R):
        for t in range(xs[s].shape[0]):
            for k in range(K):
                e = int(ids[s][t, k])
                if cfg.skip_a2a and e // L != s:
                    continue
                want[(e // L, e % L)].append((s, t, k))
    out = []
    for r in range(R):
        groups = [[(r, t, K) for t in share(cfg, r, xs[r].shape[0])]] if cfg.fused_shared_expert else []
        groups += [want[(r, l)] for l in range(L)]
        out.append(groups)
    return out


def per_row_scales(d: Dispatched, cfg):
    """The dispatch scales back as uint8 [rows, scale_bytes] (the quantize layout)."""
    rows = d.n_rows
    if cfg.fmt.name == "bf16":
        return np.zeros((rows, 0), np.uint8)
    if cfg.fmt.name == "fp8":
        return np.ascontiguousarray(d.scales.T).view(np.uint8)
    return unswizzle_block_scales(d.scales, d.row_offsets, cfg.fmt.name, cfg.hidden)


def payload_bytes(d: Dispatched):
    t = np.ascontiguousarray(d.tokens)
    return t.view(np.uint8).reshape(t.shape[0], t.shape[1] * t.dtype.itemsize)


def dequantized(d: Dispatched, cfg, gs=1.0):
    """Identity experts: the dispatched tokens decoded to float32 [rows, H]."""
    return dequantize(payload_bytes(d), per_row_scales(d, cfg), cfg.fmt.name, cfg.hidden, gs)


def check_dispatch(out, cfg, xs, ids, gs=1.0):
    """Every invariant of one dispatch result against the brute-force expectation."""
    R, K, fmt = cfg.n_ranks, cfg.top_k, cfg.fmt
    assert isinstance(out, list) and len(out) == R
    blocks = expected_blocks(cfg, xs, ids)
    enc = [quantize(x, fmt.name, gs) if x.shape[0] else None for x in xs]
    seen = []
    for r, d in enumerate(out):
        ro = d.row_offsets
        assert ro.dtype == np.uint32 and ro.shape == (cfg.n_groups + 1,) and ro[0] == 0
        assert np.all(np.diff(ro.astype(np.int64)) >= 0)
        counts = np.array([len(g) for g in blocks[r]])
        padded = -(-counts // fmt.row_align) * fmt.row_align
        np.testing.assert_array_equal(np.diff(ro.astype(np.int64)), padded)
        rows = int(ro[-1])
        assert rows <= cfg.capacity
        want_ids = list(range(cfg.n_local_experts))
        if cfg.fused_shared_expert:
            want_ids = [cfg.shared_expert_id] + want_ids
        assert d.expert_ids.dtype == np.int32 and d.expert_ids.tolist() == want_ids

        # canonical order, padding rows (-1, -1)
        want_rank = np.full(rows, -1, np.int32)
        want_info = np.full((rows, 2), -1, np.int32)
        for g, group in enumerate(blocks[r]):
            for i, (s, t, k) in enumerate(group):
                want_rank[ro[g] + i], want_info[ro[g] + i] = s, (t, k)
        assert d.src_info.dtype == np.int32 and d.src_rank.dtype == np.int32
        np.testing.assert_array_equal(d.src_rank, want_rank)
        np.testing.assert_array_equal(d.src_info, want_info)
        valid = want_rank >= 0
        seen += [(int(s), int(t), int(k)) for s, (t, k) in zip(d.src_rank[valid], d.src_info[valid])]
        if cfg.skip_a2a:
            assert set(d.src_rank[valid].tolist()) <= {r}

        # payload and scales: the sender's quantize bytes; padding rows zero
        pb = payload_bytes(d)
        sc = per_row_scales(d, cfg)
        assert pb.shape == (rows, fmt.payload_bytes(cfg.hidden)) and sc.shape == (rows, fmt.scale_bytes(cfg.hidden))
        if fmt.name == "bf16":
            assert d.tokens.dtype == ml_dtypes.bfloat16 and d.scales is None and d.scales_offsets is None
        elif fmt.name == "fp8":
            assert d.tokens.dtype == np.uint8 and d.scales.dtype == np.float32
            assert d.scales.shape == (cfg.hidden // 128, rows) and d.scales_offsets is None
        else:
            assert d.tokens.dtype == np.uint8 and d.scales.dtype == np.uint8 and d.scales.ndim == 1
            sw, so = swizzle_block_scales(sc, ro, fmt.name, cfg.hidden)
            np.testing.assert_array_equal(d.scales, sw)
            assert d.scales_offsets.dtype == np.uint32
            np.testing.assert_array_equal(d.scales_offsets, so)
        assert not pb[~valid].any() and not sc[~valid].any()
        for s in range(R):
            sel = np.flatnonzero(want_rank == s)
            if sel.size:
                np.testing.assert_array_equal(pb[sel], enc[s][0][want_info[sel, 0]])
                np.testing.assert_array_equal(sc[sel], enc[s][1][want_info[sel, 0]])

    # every (src_rank, t, k) exactly once, over all ranks
    want_all = []
    for s in range(R):
        for t in range(xs[s].shape[0]):
            if cfg.fused_shared_expert and t in share(cfg, s, xs[s].shape[0]):
                want_all.append((s, t, K))
            for k in range(K):
                if not cfg.skip_a2a or int(ids[s][t, k]) // cfg.n_local_experts == s:
                    want_all.append((s, t, k))
    assert len(seen) == len(set(seen))
    assert sorted(seen) == sorted(want_all)


def expert_scale(cfg, r, d: Dispatched):
    """Per-row multiplier of a toy expert: 1 + e/8 for routed expert e, 0.5 for the shared expert."""
    mult = np.zeros(d.n_rows, np.float32)
    L = cfg.n_local_experts
    for g in range(cfg.n_groups):
        a, b = int(d.row_offsets[g]), int(d.row_offsets[g + 1])
        eid = int(d.expert_ids[g])
        mult[a:b] = 0.5 if (cfg.fused_shared_expert and g == 0) else 1 + (r * L + eid) / 8
    return mult


# ---- dispatch ------------------------------------------------------------------------------------------------
GRID = [(fmt, R, K, shared, skip) for fmt in FORMATS for R in (1, 2, 4) for K in (1, 8)
        for shared in (False, True) for skip in (False, True)]


@pytest.mark.parametrize("fmt,R,K,shared,skip", GRID)
def test_dispatch_contract(fmt, R, K, shared, skip, rng):
    cfg = make_cfg(fmt, R, K, shared=shared, skip=skip)
    for skewed in (False, True):
        xs, ids = make_inputs(cfg, rng, skewed=skewed)
        gs = 3.0 if fmt == "nvfp4" else 1.0
        check_dispatch(dispatch(xs, ids, cfg, global_scale=gs), cfg, xs, ids, gs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dispatch_bf16_input_empty_and_full(fmt, rng):
    cfg = make_cfg(fmt, 4, 8, shared=True)
    xs, ids = make_inputs(cfg, rng, counts=[0, T, 0, T], dtype=ml_dtypes.bfloat16)
    check_dispatch(dispatch(xs, ids, cfg), cfg, xs, ids)
    xs, ids = make_inputs(cfg, rng, counts=[0, 0, 0, 0])
    out = dispatch(xs, ids, cfg)
    assert all(d.n_rows == 0 and d.tokens.shape[0] == 0 for d in out)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shared", [False, True])
def test_capacity_bounds_worst_case(fmt, shared, rng):
    """All tokens of every rank choose all L experts of rank 0 (plus others): rank 0 receives the most rows."""
    R, K, n_exp = 2, 6, 8  # L = 4 <= K
    cfg = make_cfg(fmt, R, K, n_experts=n_exp, shared=shared, tokens=63)
    L = cfg.n_local_experts
    ids = [np.stack([np.concatenate([np.arange(L), L + rng.permutation(L)[:K - L]]) for _ in range(63)])
           .astype(np.int32) for _ in range(R)]
    xs = [rng.standard_normal((63, H)).astype(np.float32) for _ in range(R)]
    out = dispatch(xs, ids, cfg)
    check_dispatch(out, cfg, xs, ids)
    routed = R * 63 * min(K, L)
    assert out[0].n_rows >= routed + (63 if shared else 0)
    assert out[0].n_rows <= cfg.capacity


def test_dispatch_skip_a2a_ignores_other_ranks_tokens(rng):
    cfg = make_cfg("fp8", 2, 4, skip=True)
    xs, ids = make_inputs(cfg, rng, counts=[T, T])
    a = dispatch(xs, ids, cfg)
    b = dispatch([xs[0], np.zeros_like(xs[1])], [ids[0], np.zeros_like(ids[1]) + np.arange(4, dtype=np.int32)],
                 cfg)
    for f in ("tokens", "scales", "row_offsets", "src_info", "src_rank"):
        np.testing.assert_array_equal(getattr(a[0], f), getattr(b[0], f))


# ---- combine -------------------------------------------------------------------------------------------------
# error bound of one decoded element relative to |x| and to the amax of its token row
TOL = {"bf16": (2**-8, 0.0), "fp8": (2**-4, 2**-8), "nvfp4": (0.25, 0.1), "mxfp4": (0.25, 0.35)}


@pytest.mark.parametrize("fmt,R,K,shared,skip", [g for g in GRID if g[2] == 8 or g[1] == 2])
def test_combine_identity_experts(fmt, R, K, shared, skip, rng):
    cfg = make_cfg(fmt, R, K, shared=shared, skip=skip)
    xs, ids = make_inputs(cfg, rng, skewed=bool(R % 2))
    gs = 0.5 if fmt == "nvfp4" else 1.0
    disp = dispatch(xs, ids, cfg, global_scale=gs)
    eo = [dequantized(d, cfg, gs) for d in disp]
    w = [rng.uniform(0.0, 1.0, (x.shape[0], K)).astype(np.float32) for x in xs]
    out = combine(eo, disp, w, cfg)
    L = cfg.n_local_experts
    for r in range(R):
        x = xs[r].astype(np.float32)
        xq = dequantize(*quantize(xs[r], fmt, gs), fmt, H, gs) if x.shape[0] else x
        local = (ids[r] // L == r) if skip else np.ones_like(ids[r], bool)
        wsum = (w[r].astype(np.float64) * local).sum(1, keepdims=True) + (1.0 if shared else 0.0)
        assert out[r].dtype == np.float32 and out[r].shape == x.shape
        # exact algebra of the identity experts, up to float32 accumulation
        np.testing.assert_allclose(out[r], xq * wsum, rtol=2e-6, atol=1e-30)
        # and close to the unquantized tokens within the format's error
        a, b = TOL[fmt]
        amax = np.abs(x).max(1, keepdims=True) if x.size else 0
        assert np.all(np.abs(out[r] - x * wsum) <= (a * np.abs(x) + b * amax) * wsum + 1e-30)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("eo_dtype", [np.float32, ml_dtypes.bfloat16])
def test_combine_unreduced(fmt, shared, skip, eo_dtype, rng):
    R, K = 4, 8
    cfg = make_cfg(fmt, R, K, shared=shared, skip=skip)
    xs, ids = make_inputs(cfg, rng)
    disp = dispatch(xs, ids, cfg)
    # toy experts that tell the rows apart: row * (1 + e / 8) (0.5 for the shared expert), 3 spare rows of NaN
    eo = []
    for r, d in enumerate(disp):
        y = (dequantized(d, cfg) * expert_scale(cfg, r, d)[:, None]).astype(eo_dtype)
        eo.append(np.concatenate([y, np.full((3, H), np.nan, eo_dtype)]))
    # num_tokens: with skip_a2a and no shared expert, a token with no local expert leaves no row to count
    out = combine(eo, disp, None, cfg, num_tokens=[x.shape[0] for x in xs] if skip else None)
    L = cfg.n_local_experts
    for r in range(R):
        n = xs[r].shape[0]
        assert out[r].dtype == np.float32 and out[r].shape == (n, K + int(shared), H)
        xq = dequantize(*quantize(xs[r], fmt), fmt, H) if n else np.zeros((0, H), np.float32)
        for k in range(K):
            want = (xq * (1 + ids[r][:, k:k + 1].astype(np.float32) / 8)).astype(eo_dtype).astype(np.float32)
            if skip:
                want = np.where((ids[r][:, k] // L == r)[:, None], want, 0)
            np.testing.assert_array_equal(out[r][:, k], want)
        if shared:
            np.testing.assert_array_equal(out[r][:, K], (xq * 0.5).astype(eo_dtype).astype(np.float32))
    # the weighted output is the weighted sum of the unreduced slots
    w = [rng.uniform(-1, 1, (x.shape[0], K)).astype(np.float32) for x in xs]
    red = combine(eo, disp, w, cfg)
    for r in range(R):
        want = (out[r][:, :K] * w[r][:, :, None].astype(np.float64)).sum(1)
        if shared:
            want = want + out[r][:, K]
        np.testing.assert_allclose(red[r], want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("shared", [False, True])
def test_skip_a2a_partial_sums_add_up(fmt, R, shared, rng):
    K = 8
    full_cfg = make_cfg(fmt, R, K, shared=shared)
    skip_cfg = make_cfg(fmt, R, K, shared=shared, skip=True)
    xs, ids = make_inputs(skip_cfg, rng, skewed=True)  # identical tokens on every rank
    w = [rng.uniform(0, 1, (xs[0].shape[0], K)).astype(np.float32)] * R

    def run(cfg):
        disp = dispatch(xs, ids, cfg)
        eo = [dequantized(d, cfg) * expert_scale(cfg, r, d)[:, None] for r, d in enumerate(disp)]
        return combine(eo, disp, w, cfg)

    full, part = run(full_cfg), run(skip_cfg)
    total = np.sum(part, axis=0, dtype=np.float64)
    want = full[0].astype(np.float64)
    if shared:  # every rank adds the shared expert (weight 1) to its partial sum: R copies after the all-reduce
        xq = dequantize(*quantize(xs[0], fmt), fmt, H)
        want = want + (R - 1) * 0.5 * xq.astype(np.float64)
    np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-4)


def test_combine_epilogue_and_num_tokens(rng):
    cfg = make_cfg("bf16", 2, 2, skip=True)
    xs, ids = make_inputs(cfg, rng, counts=[T, T])
    disp = dispatch(xs, ids, cfg)
    eo = [dequantized(d, cfg) for d in disp]
    residual = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(2)]
    w = [np.ones((T, 2), np.float32)] * 2
    plain = combine(eo, disp, w, cfg)
    withep = combine(eo, disp, w, cfg, epilogue=lambda out, r: out + residual[r])
    for r in range(2):
        np.testing.assert_array_equal(withep[r], plain[r] + residual[r])
    with pytest.raises(ValueError, match="num_tokens"):
        combine(eo, disp, None, cfg)
    unred = combine(eo, disp, None, cfg, num_tokens=[T, T])
    assert unred[0].shape == (T, 2, H)
    np.testing.assert_allclose(unred[0].sum(1), plain[0], rtol=1e-6)


# ---- allreduce_world_size: the shared expert split over each all-reduce group ---------------------------------
AR_GRID = [(fmt, A, K) for fmt in FORMATS for A in (2, 4) for K in (1, 8)]


def skip_inputs(cfg, rng, n, skewed=False):
    """Every rank holds the same n tokens (skip_a2a), random and never zero."""
    return make_inputs(cfg, rng, counts=[n] * cfg.n_ranks, skewed=skewed)


@pytest.mark.parametrize("fmt,A,K", AR_GRID)
def test_dispatch_contract_allreduce(fmt, A, K, rng):
    """Group 0 of rank r holds exactly the tokens of its share, in order, padded like any group; the rest of the
    layout is unchanged. N = T, N < A and N = 0."""
    cfg = make_cfg(fmt, 4, K, shared=True, skip=True, allreduce=A)
    gs = 3.0 if fmt == "nvfp4" else 1.0
    for n in (T, 3, 1, 0):
        xs, ids = skip_inputs(cfg, rng, n, skewed=n == T)
        out = dispatch(xs, ids, cfg, global_scale=gs)
        check_dispatch(out, cfg, xs, ids, gs)
        for r, d in enumerate(out):
            lo, hi = (r % A) * n // A, (r % A + 1) * n // A
            assert cfg.shared_expert_share(r, n) == (lo, hi)
            align = cfg.fmt.row_align
            assert int(d.row_offsets[1]) == -(-(hi - lo) // align) * align
            assert d.expert_ids[0] == cfg.shared_expert_id
            rows = np.arange(hi - lo)
            np.testing.assert_array_equal(d.src_info[rows], np.stack([lo + rows, np.full(hi - lo, K)], 1))
            np.testing.assert_array_equal(d.src_rank[rows], np.full(hi - lo, r))
            pad = np.arange(hi - lo, int(d.row_offsets[1]))
            assert (d.src_info[pad] == -1).all() and (d.src_rank[pad] == -1).all()


@pytest.mark.parametrize("A,n,sizes", [
    (2, T, [12, 12]), (2, 5, [2, 3]), (2, 1, [0, 1]), (2, 0, [0, 0]),
    (4, T, [6, 6, 6, 6]), (4, 7, [1, 2, 2, 2]), (4, 3, [0, 1, 1, 1]), (4, 1, [0, 0, 0, 1]), (4, 0, [0, 0, 0, 0]),
])
def test_shared_expert_share_sizes(A, n, sizes, rng):
    """Each group's shares tile [0, N) in rank order (both groups of R = 4 alike); dispatch's group 0 holds that
    many rows."""
    cfg = make_cfg("bf16", 4, 2, shared=True, skip=True, allreduce=A)
    xs, ids = skip_inputs(cfg, rng, n)
    out = dispatch(xs, ids, cfg)
    for g in range(4 // A):
        ranks = range(g * A, g * A + A)
        shares = [cfg.shared_expert_share(r, n) for r in ranks]
        assert [hi - lo for lo, hi in shares] == sizes
        assert shares[0][0] == 0 and shares[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
        assert [int(out[r].row_offsets[1]) for r in ranks] == sizes


@pytest.mark.parametrize("fmt,A,K", AR_GRID)
def test_allreduce_group_sums_shared_expert_once(fmt, A, K, rng):
    """The all-reduce over each group of A ranks of the partial outputs (toy experts: row x (1 + e/8), shared 0.5)
    equals the dense sum over the group's local experts plus the shared expert once; over all ranks, the full
    combine plus one shared expert per group."""
    R = 4
    cfg = make_cfg(fmt, R, K, shared=True, skip=True, allreduce=A)
    full_cfg = make_cfg(fmt, R, K, shared=True)
    L = cfg.n_local_experts
    for n in (T, 3, 0):
        xs, ids = skip_inputs(cfg, rng, n, skewed=n == T)
        w = [rng.uniform(0.1, 1, (n, K)).astype(np.float32)] * R

        def run(c):
            disp = dispatch(xs, ids, c)
            eo = [dequantized(d, c) * expert_scale(c, r, d)[:, None] for r, d in enumerate(disp)]
            return combine(eo, disp, w, c)

        part = run(cfg)
        xq = dequantize(*quantize(xs[0], fmt), fmt, H).astype(np.float64) if n else np.zeros((0, H))
        owner = ids[0] // L
        for g in range(R // A):
            ranks = range(g * A, g * A + A)
            total = np.sum([part[r] for r in ranks], axis=0, dtype=np.float64)
            in_group = (owner >= g * A) & (owner < g * A + A)
            mult = (w[0] * (1 + ids[0].astype(np.float64) / 8) * in_group).sum(1, keepdims=True)
            np.testing.assert_allclose(total, xq * (mult + 0.5), rtol=1e-5, atol=1e-5)
        everything = np.sum(part, axis=0, dtype=np.float64)
        want = run(full_cfg)[0].astype(np.float64) + (R // A - 1) * 0.5 * xq
        np.testing.assert_allclose(everything, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("A", [2, 4])
def test_combine_unreduced_allreduce(fmt, A, rng):
    """Slot K of the unreduced output is the shared-expert row for the tokens of the rank's share and zero for the
    others; the weighted output adds it to those tokens only (bit for bit what A = 1 gives inside the share, and
    the A = 1 output without the shared expert outside it)."""
    R, K = 4, 8
    cfg = make_cfg(fmt, R, K, shared=True, skip=True, allreduce=A)
    one = make_cfg(fmt, R, K, shared=True, skip=True)
    xs, ids = skip_inputs(cfg, rng, T)
    w = [rng.uniform(-1, 1, (T, K)).astype(np.float32)] * R

    def experts(c, disp, shared_mult=0.5):
        eo = []
        for r, d in enumerate(disp):
            m = expert_scale(c, r, d)
            m[int(d.row_offsets[0]):int(d.row_offsets[1])] = shared_mult
            eo.append((dequantized(d, c) * m[:, None]).astype(ml_dtypes.bfloat16))
        return eo

    disp, disp1 = dispatch(xs, ids, cfg), dispatch(xs, ids, one)
    eo, eo1 = experts(cfg, disp), experts(one, disp1)
    with pytest.raises(ValueError, match="num_tokens is required with allreduce_world_size"):
        combine(eo, disp, None, cfg)
    unred = combine(eo, disp, None, cfg, num_tokens=[T] * R)
    unred1 = combine(eo1, disp1, None, one)
    red, red1 = combine(eo, disp, w, cfg), combine(eo1, disp1, w, one)
    red1_no_shared = combine(experts(one, disp1, 0.0), disp1, w, one)
    xq = dequantize(*quantize(xs[0], fmt), fmt, H)
    for r in range(R):
        lo, hi = (r % A) * T // A, (r % A + 1) * T // A
        inside = np.zeros(T, bool)
        inside[lo:hi] = True
        assert unred[r].shape == (T, K + 1, H)
        np.testing.assert_array_equal(unred[r][:, :K], unred1[r][:, :K])
        shared_row = (xq * 0.5).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(unred[r][:, K], np.where(inside[:, None], shared_row, 0))
        np.testing.assert_array_equal(red[r][inside], red1[r][inside])
        np.testing.assert_array_equal(red[r][~inside], red1_no_shared[r][~inside])


def test_combine_rejects_shared_rows_outside_the_share(rng):
    """dispatched from an allreduce_world_size = 1 round holds every token's shared row: combine with A = 2 names
    the share it breaks; and the other way round, the missing shared rows."""
    R, K = 4, 2
    cfg = make_cfg("bf16", R, K, shared=True, skip=True, allreduce=2)
    one = make_cfg("bf16", R, K, shared=True, skip=True)
    xs, ids = skip_inputs(cfg, rng, 5)
    w = [np.ones((5, K), np.float32)] * R
    disp1 = dispatch(xs, ids, one)
    with pytest.raises(ValueError, match=r"shared-expert row outside its share \[0, 2\)"):
        combine([dequantized(d, one) for d in disp1], disp1, w, cfg)
    disp = dispatch(xs, ids, cfg)
    with pytest.raises(ValueError, match=r"shared-expert share \[0, 5\) has no shared-expert row"):
        combine([dequantized(d, cfg) for d in disp], disp, w, one)


# ---- fused SwiGLU --------------------------------------------------------------------------------------------
def silu_mul64(h, inter, interleaved):
    g, u = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, :inter], h[:, inter:])
    g, u = g.astype(np.float64), u.astype(np.float64)
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("h_dtype", [np.float32, ml_dtypes.bfloat16])
def test_fused_silu(fmt, interleaved, h_dtype, rng):
    inter = 256
    row_offsets = np.array([0, 5, 5, 140, 200], np.uint32)  # an empty group, a group over one 128-row tile
    rows = int(row_offsets[-1])
    h = (rng.standard_normal((rows + 13, 2 * inter)) * 3).astype(h_dtype)
    h_nan = h.copy()
    h_nan[rows:] = np.nan
    gs = 2.0 if fmt == "nvfp4" else 1.0
    a = fused_silu(h, row_offsets, fmt, interleaved, gs)
    b = fused_silu(h_nan, row_offsets, fmt, interleaved, gs)
    for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        np.testing.assert_array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))

    ref = silu_mul64(h[:rows], inter, interleaved)
    g, u = (h[:rows, 0::2], h[:rows, 1::2]) if interleaved else (h[:rows, :inter], h[:rows, inter:])
    y32 = silu_f32(np.ascontiguousarray(g, dtype=np.float32)) * u.astype(np.float32)
    if fmt == "bf16":
        assert a.dtype == ml_dtypes.bfloat16 and a.shape == (rows, inter)
        np.testing.assert_array_equal(a.astype(np.float32), y32.astype(ml_dtypes.bfloat16).astype(np.float32))
        np.testing.assert_allclose(a.astype(np.float64), ref, rtol=2**-8, atol=1e-6)
        return
    payload, scale_rows = quantize(y32, fmt, gs)
    if fmt == "fp8":
        p, s = a
        assert p.shape == (rows, inter) and s.dtype == np.float32 and s.shape == (inter // 128, rows)
        got_scales = np.ascontiguousarray(s.T).view(np.uint8)
    else:
        p, s, so = a
        assert p.shape == (rows, inter // 2) and s.dtype == np.uint8 and so.dtype == np.uint32
        sw, so_want = swizzle_block_scales(scale_rows, row_offsets, fmt, inter)
        np.testing.assert_array_equal(s, sw)
        np.testing.assert_array_equal(so, so_want)
        got_scales = unswizzle_block_scales(s, row_offsets, fmt, inter)
    np.testing.assert_array_equal(p, payload)
    np.testing.assert_array_equal(got_scales, scale_rows)
    deq = dequantize(p, got_scales, fmt, inter, gs).astype(np.float64)
    a_tol, b_tol = TOL[fmt]
    amax = np.abs(ref).max(1, keepdims=True)
    assert np.all(np.abs(deq - ref) <= a_tol * np.abs(ref) + b_tol * amax + 1e-6)


# ---- silu in float32 (docs/formats.md, "Fused SwiGLU") ----------------------------------------------------------
SILU_SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 17.0, -17.0, 20.0, -20.0, 87.0, -87.0, 87.5, -87.5,
                         88.0, -88.0, 88.37626, -88.37626, 88.37627, -88.37627, 88.5, -88.5, 89.0, -89.0, 100.0,
                         -100.0, 1e-30, -1e-30, 1e-38, -1e-38, 1e-40, -1e-40, 2.0**-126, -(2.0**-126), 1e20, -1e20,
                         3e38, -3e38, np.finfo(np.float32).max, -np.finfo(np.float32).max, np.inf], np.float32)


def _f32_rn(v: Fraction) -> np.float32:
    """An exact rational rounded once to float32 (nearest, ties to even), flushed; overflow gives +-Inf."""
    if v == 0:
        return np.float32(0.0)
    sign, v = (-1 if v < 0 else 1), abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e > v:
        e -= 1
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    if e < -126:  # FTZ: below the normal range (the rounding could reach 2**-126 only from within half an ulp)
        q = v / Fraction(2) ** -149
        return np.float32(sign * 0.0) if q < 2**23 - Fraction(1, 2) else np.float32(sign * 2.0**-126)
    ulp = Fraction(2) ** (e - 23)
    q = v / ulp
    m = q.numerator // q.denominator
    rem = q - m
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and m % 2):
        m += 1
    out = sign * m * ulp
    return np.float32(sign * np.inf) if abs(out) > Fraction(float(np.finfo(np.float32).max)) else np.float32(out)


def _fma_scalar(a, b, c) -> np.float32:
    """fma of float32 scalars from exact rationals (finite, normal operands)."""
    return _f32_rn(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _silu_scalar(g: np.float32) -> np.float32:
    """The contract's silu written out one float32 scalar operation at a time, FMAs from exact rationals (no
    arrays, no helpers of the package), to check that silu_f32 is exactly that sequence of operations."""
    tiny = np.float32(2.0**-126)

    def f(a):  # FTZ of one float32 scalar
        a = np.float32(a)
        return np.float32(np.copysign(np.float32(0.0), a)) if abs(a) < tiny else a

    g = f(g)
    x = np.float32(max(-abs(g), np.float32(-88.0))) if not np.isnan(g) else np.float32(-88.0)
    rint = np.float32(1.5 * 2**23)
    n = np.float32(_fma_scalar(x, SILU_LOG2E, rint) - rint)
    r = _fma_scalar(n, -SILU_LN2_LO, _fma_scalar(n, -SILU_LN2_HI, x)) if n != 0 else x
    p = SILU_POLY[0]
    for c in SILU_POLY[1:]:
        p = _fma_scalar(p, r, c) if r != 0 else c
    e = f(p * np.float32(np.ldexp(np.float32(1.0), int(n)))) if n > -127 else np.float32(0.0)
    s = f(np.float32(1.0) / f(np.float32(1.0) + e))
    num = f(g * e) if g < 0 else g
    return f(num * s)


def test_fma_f32_is_exact(rng):
    """fma_f32 equals the exactly computed a * b + c rounded once, including cases where naive float64 rounds
    twice (a * b on a float32 midpoint, c far below it) and cancellation (c close to -a * b)."""
    n = 400
    a = (rng.standard_normal(n) * 4).astype(np.float32)
    b = (rng.standard_normal(n) * 4).astype(np.float32)
    c_near = (-(a.astype(np.float64) * b)).astype(np.float32)
    cases = [(a, b, (rng.standard_normal(n) * 8).astype(np.float32)), (a, b, c_near),
             (a, b, (c_near * (1 + rng.standard_normal(n).astype(np.float32) * np.float32(1e-6))).astype(np.float32))]
    for x, y, z in cases:
        got = fma_f32(x, y, z)
        want = np.array([_fma_scalar(x[i], y[i], z[i]) for i in range(n)], np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    m = np.float32(1 + 2**-12)  # m * m = 1 + 2**-11 + 2**-24: a float32 midpoint
    t = np.float32(2.0**-80)
    assert fma_f32(m, m, t)[0] == np.float32(1 + 2**-11 + 2**-23)  # naive float64 gives 1 + 2**-11
    assert fma_f32(m, m, -t)[0] == np.float32(1 + 2**-11)
    with np.errstate(all="ignore"):
        sp = fma_f32(np.array([np.inf, 1e-40, 1.0, -0.0], np.float32), np.array([0.0, 1e10, -1e-40, 1.0], np.float32),
                     np.array([1.0, 0.0, -0.0, -0.0], np.float32))
    assert np.isnan(sp[0]) and sp[1] == 0 and sp[2] == 0 and np.signbit(sp[2]) and np.signbit(sp[3])


def test_silu_f32_is_the_contract_sequence(rng):
    g = np.concatenate([SILU_SPECIAL, rng.uniform(-100, 100, 300).astype(np.float32),
                        (rng.standard_normal(100) * 3).astype(np.float32)])
    got = silu_f32(g)
    with np.errstate(all="ignore"):
        want = np.array([_silu_scalar(v) for v in g], np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_silu_f32_accuracy(rng):
    """Within 3.4 float32 ulp (the contract's bound) of float64 silu where that exceeds 2**-118 in magnitude; below
    that (g below about -87.2), within 2**-119 absolute and of the right sign."""
    g = np.concatenate([rng.uniform(-100, 100, 1_000_000), rng.uniform(-2, 2, 200_000),
                        rng.standard_normal(200_000) * 8, np.linspace(-90, -85, 100_001),
                        SILU_SPECIAL[np.isfinite(SILU_SPECIAL)]]).astype(np.float32)
    sv = silu_f32(g).astype(np.float64)
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):
        exact = g64 / (1.0 + np.exp(-g64))
        ulp = np.maximum(np.spacing(np.abs(exact.astype(np.float32))).astype(np.float64), 2.0**-149)
    small = np.abs(exact) <= 2.0**-118
    err = np.abs(sv - exact) / ulp
    assert err[~small].max() <= 3.4, f"max error {err[~small].max():.3f} ulp at g={g[~small][np.argmax(err[~small])]}"
    assert np.all(np.abs(sv[small] - exact[small]) <= 2.0**-119)
    assert np.all(np.signbit(sv) == np.signbit(exact))
    # flushed subnormal gates, saturated ends, non-finite inputs (torch's silu gives NaN for -Inf too)
    with np.errstate(all="ignore"):
        sp = silu_f32(np.array([1e-40, -1e-40, 3e38, -3e38, -88.37627, np.inf, -np.inf, np.nan], np.float32))
    assert sp[0] == 0 and not np.signbit(sp[0]) and sp[1] == 0 and np.signbit(sp[1])
    assert sp[2] == np.float32(3e38) and sp[3] == 0 and np.signbit(sp[3]) and sp[4] == 0 and np.signbit(sp[4])
    assert sp[5] == np.inf and np.isnan(sp[6]) and np.isnan(sp[7])
    assert silu_f32(np.zeros((3, 4), np.float32)).shape == (3, 4)


def test_silu_f32_validation():
    with pytest.raises(ValueError, match="float32"):
        silu_f32(np.zeros(4, np.float64))


def test_fused_silu_ftz_and_extremes():
    inter = 128
    h = np.zeros((4, 2 * inter), np.float32)
    h[0, :inter] = -1000.0          # exp overflow: silu -> -0
    h[0, inter:] = 1.0
    h[1, :inter] = 1e-39            # subnormal gate -> 0
    h[1, inter:] = 5.0
    h[2, :inter] = 100.0
    h[2, inter:] = 1e-40            # subnormal up is flushed before the multiply
    h[3, :inter] = 2.0
    h[3, inter:] = 3.0
    out = fused_silu(h, np.array([0, 4], np.uint32)).astype(np.float32)
    assert np.all(out[:3] == 0) and np.all(np.signbit(out[0]))
    np.testing.assert_allclose(out[3], 2 / (1 + np.exp(-2.0)) * 3, rtol=2**-8)


# ---- validation ----------------------------------------------------------------------------------------------
def test_dispatch_validation(rng):
    cfg = make_cfg("fp8", 2, 2)
    xs, ids = make_inputs(cfg, rng, counts=[3, 4])
    with pytest.raises(ValueError, match="tokens has 1 entries"):
        dispatch(xs[:1], ids, cfg)
    with pytest.raises(ValueError, match="topk_ids has 3 entries"):
        dispatch(xs, ids + ids[:1], cfg)
    with pytest.raises(ValueError, match=r"tokens\[1\] has shape"):
        dispatch([xs[0], xs[1][:, :128]], ids, cfg)
    with pytest.raises(ValueError, match=r"tokens\[0\] has dtype float64"):
        dispatch([xs[0].astype(np.float64), xs[1]], ids, cfg)
    with pytest.raises(ValueError, match=r"tokens\[0\] has 25 tokens > max_tokens_per_rank"):
        big = np.zeros((T + 1, H), np.float32)
        dispatch([big, xs[1]], [np.zeros((T + 1, 2), np.int32) + np.arange(2, dtype=np.int32), ids[1]], cfg)
    with pytest.raises(ValueError, match=r"topk_ids\[1\] has shape"):
        dispatch(xs, [ids[0], ids[1][:2]], cfg)
    with pytest.raises(ValueError, match=r"topk_ids\[0\] has dtype int64"):
        dispatch(xs, [ids[0].astype(np.int64), ids[1]], cfg)
    for bad in (-1, E):
        b = ids[1].copy()
        b[2, 1] = bad
        with pytest.raises(ValueError, match=rf"topk_ids\[1\]\[2, 1\] = {bad} is outside \[0, n_experts"):
            dispatch(xs, [ids[0], b], cfg)
    b = ids[0].copy()
    b[1] = [5, 5]
    with pytest.raises(ValueError, match=r"topk_ids\[0\] row 1 names the same expert twice"):
        dispatch(xs, [b, ids[1]], cfg)
    with pytest.raises(ValueError, match="cfg must be an EPConfig"):
        dispatch(xs, ids, None)
    with pytest.raises(ValueError, match="tokens must be a list"):
        dispatch(xs[0], ids, cfg)


def test_combine_validation(rng):
    cfg = make_cfg("bf16", 2, 2)
    xs, ids = make_inputs(cfg, rng, counts=[3, 4])
    disp = dispatch(xs, ids, cfg)
    eo = [dequantized(d, cfg) for d in disp]
    w = [np.ones((3, 2), np.float32), np.ones((4, 2), np.float32)]
    with pytest.raises(ValueError, match="expert_out has 1 entries"):
        combine(eo[:1], disp, w, cfg)
    with pytest.raises(ValueError, match="dispatched has 1 entries"):
        combine(eo, disp[:1], w, cfg)
    with pytest.raises(ValueError, match=r"expert_out\[0\] has shape"):
        combine([eo[0][:1], eo[1]], disp, w, cfg)
    with pytest.raises(ValueError, match=r"expert_out\[1\] has dtype float64"):
        combine([eo[0], eo[1].astype(np.float64)], disp, w, cfg)
    with pytest.raises(ValueError, match=r"topk_weights\[0\] has shape"):
        combine(eo, disp, [np.ones((3, 3), np.float32), w[1]], cfg)
    with pytest.raises(ValueError, match=r"topk_weights\[1\] has dtype float64"):
        combine(eo, disp, [w[0], w[1].astype(np.float64)], cfg)
    with pytest.raises(ValueError, match="does not match"):  # weights for fewer tokens than dispatched
        combine(eo, disp, [w[0][:2], w[1]], cfg)
    with pytest.raises(ValueError, match="has no row"):  # weights for more tokens than dispatched
        combine(eo, disp, [np.ones((5, 2), np.float32), w[1]], cfg)
    with pytest.raises(ValueError, match="epilogue returned shape"):
        combine(eo, disp, w, cfg, epilogue=lambda out, r: out[:1])


def test_fused_silu_validation():
    h = np.zeros((8, 512), np.float32)
    with pytest.raises(ValueError, match="h has shape"):
        fused_silu(h[:, :511], np.array([0, 8], np.uint32))
    with pytest.raises(ValueError, match="h has dtype"):
        fused_silu(h.astype(np.float64), np.array([0, 8], np.uint32))
    with pytest.raises(ValueError, match="exceeds the rows of h"):
        fused_silu(h, np.array([0, 9], np.uint32))
    with pytest.raises(ValueError, match="non-decreasing"):
        fused_silu(h, np.array([0, 6, 4], np.uint32))
    with pytest.raises(ValueError, match="multiple of 128"):
        fused_silu(np.zeros((8, 2 * 64), np.float32), np.array([0, 8], np.uint32), "fp8")
    with pytest.raises(ValueError, match="fmt"):
        fused_silu(h, np.array([0, 8], np.uint32), "int8")


def test_ep_check_random_values_are_fresh_finite_and_reproducible():
    """tests/ep_check.random_values (a round's expert outputs and residuals): both dtypes, every value finite,
    nonzero and normal, magnitudes in [1/8, 2), both signs, every bf16 value of that range (1024) or nearly all draws
    distinct (float32), the same draws from the same seed."""
    from ep_check import random_values

    for dt in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)):
        v = random_values(np.random.default_rng(7), 64, 256, dt)
        f = v.astype(np.float32)
        assert v.dtype == dt and v.shape == (64, 256)
        assert np.isfinite(f).all() and (np.abs(f) >= 0.125).all() and (np.abs(f) < 2).all()
        assert 0.4 < (f > 0).mean() < 0.6 and len(np.unique(f)) >= (1024 if dt.itemsize == 2 else 16000)
        again = random_values(np.random.default_rng(7), 64, 256, dt)
        assert np.array_equal(v.view(np.uint16 if dt.itemsize == 2 else np.uint32),
                              again.view(np.uint16 if dt.itemsize == 2 else np.uint32))


@pytest.mark.parametrize("dtype", [np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)], ids=["bf16", "f32"])
def test_ep_check_edge_tokens_dispatch_as_signed_zeros(dtype, rng):
    """tests/ep_check.edge_tokens (the GPU rounds' edge inputs): finite, with subnormals of the dtype (scattered and
    whole 32-value blocks) and zeros of both signs. The reference dispatches them in every quantized format exactly
    as the same tokens with each subnormal a zero of its sign (the contract's flush, which the GPU encoders get from
    their ftz arithmetic alone); the bf16 format keeps them."""
    from ep_check import edge_tokens

    x = edge_tokens(rng, T, H, dtype)
    f = x.astype(np.float32)
    sub = (f != 0) & (np.abs(f) < np.finfo(np.float32).tiny)
    assert x.dtype == dtype and np.isfinite(f).all() and 0.05 < sub.mean() < 0.5
    assert any(sub[:, c:c + 32].all() for c in range(0, H, 32))  # a block of subnormals only
    assert np.signbit(f[f == 0]).any() and not np.signbit(f[f == 0]).all()
    flushed = np.where(sub, np.copysign(np.float32(0), f), f).astype(dtype)
    for fmt in FORMATS:
        cfg = make_cfg(fmt, n_ranks=1, top_k=4)
        ids = route(rng, T, cfg.top_k, cfg.n_experts)
        for gs in ((1.0, 0.125, 3.0e4) if fmt == "nvfp4" else (1.0,)):
            a, b = dispatch([x], [ids], cfg, global_scale=gs)[0], dispatch([flushed], [ids], cfg, global_scale=gs)[0]
            same = (np.array_equal(a.tokens.view(np.uint8), b.tokens.view(np.uint8))
                    and (a.scales is None or np.array_equal(a.scales.view(np.uint8), b.scales.view(np.uint8))))
            assert same == (fmt != "bf16"), (fmt, gs)
