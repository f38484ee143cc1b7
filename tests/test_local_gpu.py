"""The one-rank kernels (cuda_src/dispatch/local.cuh, combine/local.cuh): a group of one rank runs a fused dispatch
without protocol (one launch: a small round up to small_batch_tokens tokens, a larger one above), and its combine
(fused or halves) sums straight from expert_out. Every output against cuep.reference, mixed with protocol rounds (the
dispatch halves) on the same buffer, every combine mode, bad routing reported, and a CUDA graph replay."""
from __future__ import annotations

import numpy as np
import pytest

import cuep
from cuep import reference as ref
from ep_check import BF16, check_dispatch, make_inputs, random_tokens, random_values, run_round, slow_copy, to_devices

FORMATS = ["bf16", "fp8", "nvfp4", "mxfp4"]


def make(**kw):
    cfg = cuep.EPConfig(**{**dict(hidden=1024, top_k=8, n_experts=32, max_tokens_per_rank=48, n_gpus_per_node=1,
                                  small_batch_tokens=32), **kw})
    return cfg, cuep.Buffer(cuep.init([0]), cfg, timeout_s=5.0)


def local_launches(buf, op: str = "dispatch") -> int:
    """How many one-rank kernels of ``op`` this buffer has prepared (one per kernel variant used), the split
    layout's aside (:func:`split_launches`)."""
    host = buf._launch_cache.get("host")
    return sum(1 for key in (host.launches if host else {})
               if f":cuep_{op}_local_" in key[1] and ":cuep_dispatch_local_split_" not in key[1])


def split_launches(buf) -> int:
    """How many split-layout kernels (a small round that encodes, N <= 32: cuep_dispatch_local_split_*) this buffer
    has prepared."""
    host = buf._launch_cache.get("host")
    return sum(1 for key in (host.launches if host else {}) if ":cuep_dispatch_local_split_" in key[1])


def splits(buf) -> bool:
    """Whether any small round of this buffer that encodes may take the split layout's kernels (cuep/ep.py
    _split_fits: the block has the warps for it and the round's items fit the others)."""
    return any(buf._launch_cache["host"].split_fits)


NARROW, WIDE, F32 = "cuep_combine_local_bf16", "cuep_combine_local_wide_bf16", "cuep_combine_local_f32"


def combine_kernels(buf) -> set:
    """The one-rank combine kernels this buffer has prepared: bf16 takes WIDE (8 rows in flight) for rounds whose
    items are whole tokens or chunks of >= 96 vectors (ep._combine_local_name; at H = 1024 on 132 x 16 warps whole
    tokens only: N = 0, and N >= 1057), else NARROW."""
    host = buf._launch_cache.get("host")
    return {key[1].split(":")[1] for key in (host.launches if host else {}) if ":cuep_combine_local_" in key[1]}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared_expert"])
def test_local_rounds_match_reference(fmt, shared, rng):
    cfg, buf = make(dispatch_format=fmt, fused_shared_expert=shared)
    # 0, 1, some, exactly small_batch_tokens (small); 33 and 48 > 32 (larger); the halves: protocol
    for n in (1, 0, 7, 32, 48, 33, 32, 1):
        run_round(buf, cfg, rng, [n], weights_at="dispatch")
    run_round(buf, cfg, rng, [32], weights_at="combine", residual=True)
    run_round(buf, cfg, rng, [20], weights_at=None)
    run_round(buf, cfg, rng, [20], skew=True, dtype=np.dtype(np.float32))
    run_round(buf, cfg, rng, [12], async_halves=True)  # two launches: the protocol's halves
    run_round(buf, cfg, rng, [12], bare=True)
    # small rounds that encode split (from f32; quantized from bf16 too), the others plain; larger rounds
    assert (local_launches(buf), split_launches(buf)) == ((2, 1) if fmt == "bf16" else (1, 2))
    assert combine_kernels(buf) == {NARROW, WIDE}  # WIDE for the round of 0 tokens
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_larger_local_rounds(fmt, rng):
    # small rounds off: every fused round takes the larger one-rank kernel (count, the last block lays out, place;
    # scales placed per row: below the gather's size), skewed routing too
    cfg, buf = make(dispatch_format=fmt, small_batch_tokens=0, max_tokens_per_rank=300, fused_shared_expert=True)
    for n, skew in ((300, False), (0, False), (1, False), (257, True), (64, False)):
        run_round(buf, cfg, rng, [n], skew=skew)
    run_round(buf, cfg, rng, [100], weights_at="combine", residual=True)
    run_round(buf, cfg, rng, [100], weights_at=None)
    assert local_launches(buf) == 1 and combine_kernels(buf) == {NARROW, WIDE}  # WIDE: N = 0
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)], ids=["from_bf16", "from_f32"])
def test_local_rounds_edge_inputs(fmt, dtype, rng):
    # Subnormal inputs count as zeros of their sign (the encoders' ftz arithmetic flushes them: no flush pass), the
    # bf16 format keeps them: tokens with subnormals, signed zeros and tiny blocks (ep_check.edge_tokens) through
    # small rounds (split up to 32 tokens, plain above) and larger ones; nvfp4 at other global scales too
    cfg, buf = make(dispatch_format=fmt, max_tokens_per_rank=300, fused_shared_expert=True)
    for n in (1, 20, 48, 300):
        run_round(buf, cfg, rng, [n], dtype=dtype, edge=True)
    for g in ((0.125, 3.0e4) if fmt == "nvfp4" else ()):
        run_round(buf, cfg, rng, [20], dtype=dtype, edge=True, global_scale=g)
        run_round(buf, cfg, rng, [300], dtype=dtype, edge=True, global_scale=g)
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, hidden", [("fp8", 7168), ("nvfp4", 7168), ("mxfp4", 7168), ("fp8", 7296),
                                         ("nvfp4", 7200), ("mxfp4", 7200)])
def test_larger_local_rounds_gather_scales(fmt, hidden, rng):
    # output scales of 2 MiB and more (dispatch/scales.cuh kGatherScalesFrom): each token's scales stored once, every
    # row's noted, gathered into the layout in whole lines once every warp of the grid has noted its rows; rounds
    # in a row (that count re-armed), a shared expert, skewed routing, float32 input, then a small round and one under
    # the gather's size on the same buffer. Rows of 57 fp8 scales (7296) and of 450 / 225 fp4 scale bytes (7200) are
    # not whole 16-byte loads / 4-byte words: the gather's word- and byte-wise paths
    cfg, buf = make(dispatch_format=fmt, hidden=hidden, n_experts=32, max_tokens_per_rank=1600, small_batch_tokens=16,
                    fused_shared_expert=True)
    for n, skew, dtype in ((1600, False, None), (1500, True, None), (1280, False, np.dtype(np.float32)),
                           (16, False, None), (100, False, None)):
        kw = {} if dtype is None else {"dtype": dtype}
        run_round(buf, cfg, rng, [n], skew=skew, **kw)
    assert local_launches(buf) == 2 and split_launches(buf) == 1  # larger from bf16 / f32; N = 16 split
    assert combine_kernels(buf) == {NARROW, WIDE}  # WIDE: 1280-1600 tokens
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("hidden", [1024, 7168], ids=["direct_scales", "gathered_scales"])
def test_fp4_padding_zeroed_across_rounds(fmt, hidden, rng):
    # Scales not poisoned between rounds: each round zeroes only the padding rows the rounds before may have left in
    # its tiles (scale_tile_rows), so rounds of every kind in a row, growing and shrinking, must keep every padding
    # byte of the used tiles zero (check_dispatch) and every tile's rows past its bound zero (the whole output).
    # Small rounds, larger ones (7168: scales gathered), the protocol's halves, skewed routing (full tiles), then
    # scales written by hand and Buffer.reset (every tile's bound back to 128).
    cfg, buf = make(dispatch_format=fmt, hidden=hidden, n_experts=32, max_tokens_per_rank=600, small_batch_tokens=32,
                    fused_shared_expert=True)
    for n, kw in ((600, {}), (1, {}), (32, {}), (5, {}), (300, {"skew": True}), (2, {}), (17, {"async_halves": True}),
                  (600, {"skew": True}), (0, {}), (48, {}), (1, {})):
        run_round(buf, cfg, rng, [n], poison_scales=False, **kw)
    buf._ranks[0].scales.fill(0x5A)  # a caller writing into the scales: reset re-arms the bounds
    buf.reset()
    for n in (3, 300, 1):
        run_round(buf, cfg, rng, [n], poison_scales=False)
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [5, 40, 1200])
def test_local_combine_halves(n, rng):
    # after a one-rank dispatch (bf16: every N takes one, small and larger), combine_async launches nothing and
    # combine_wait sums: bit-identical to a fused combine (the protocol's halves round a partial sum to bf16 first);
    # 1200 tokens are whole-token items (the combine kernel with 8 rows in flight), each checked against the reference
    import cupy

    cfg, buf = make(dispatch_format="bf16", fused_shared_expert=True, max_tokens_per_rank=max(48, n))
    run_round(buf, cfg, rng, [n], weights_at="combine", residual=True)
    xs, ids, ws = make_inputs(rng, cfg, [n])
    gx, gids, gws = to_devices(buf.group, xs), to_devices(buf.group, ids), to_devices(buf.group, ws)
    eo = to_devices(buf.group, [random_tokens(rng, cfg.capacity, cfg.hidden)])[0]
    res = gx[0].copy()
    for weights_at in ("dispatch", "combine", None):
        d = cuep.dispatch(buf, gx, gids, gws if weights_at == "dispatch" else None)
        w = gws if weights_at == "combine" else None
        r = [res] if weights_at else None
        fused = cuep.combine(buf, [eo], d, w, residual=r)[0].copy()
        cuep.combine_async(buf, [eo], d, w, residual=r)
        halves = cuep.combine_wait(buf, [eo], d, w, residual=r)[0]
        buf.synchronize()
        np.testing.assert_array_equal(halves.view(cupy.uint16).get(), fused.view(cupy.uint16).get())
    assert combine_kernels(buf) == ({WIDE} if n > buf.num_sms * 8 else {NARROW})  # whole tokens: N > grid warps / 2
    buf.close()


@pytest.mark.gpu
def test_local_combine_long_chunks(rng):
    # H = 7168, N = 200 on 132 x 16 warps: chunks of 96 vectors split each token, so the bf16 combine takes the kernel
    # with 8 rows in flight on split tokens; every mode against the reference (132 SMs: H100 and H200)
    cfg, buf = make(dispatch_format="bf16", hidden=7168, max_tokens_per_rank=200, fused_shared_expert=True)
    run_round(buf, cfg, rng, [200], weights_at="dispatch")
    run_round(buf, cfg, rng, [200], weights_at="combine", residual=True)
    run_round(buf, cfg, rng, [200], weights_at=None)
    if buf.num_sms == 132:
        assert combine_kernels(buf) == {WIDE}
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared_expert"])
def test_local_rounds_float32_combine(shared, rng):
    cfg, buf = make(dispatch_format="nvfp4", combine_dtype="float32", fused_shared_expert=shared)
    for n, weights_at, residual in ((9, "dispatch", False), (32, "combine", True), (3, None, False),
                                    (40, "dispatch", True), (1, "dispatch", True)):
        run_round(buf, cfg, rng, [n], weights_at=weights_at, residual=residual)
    assert combine_kernels(buf) == {F32}
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "bf16"])
def test_split_layout_only_where_items_fit(fmt, rng):
    """A small round whose items would reach the last 8 warps (they lay the round out instead of preparing a first
    item) takes the plain kernel (cuep/ep.py _split_fits): H = 12288 at N = 32 (1536 items, more than 8 x 132
    warps) and a grid of 2 blocks at N = 32; N = 1 still splits. Weights at dispatch (a prepared item's), each
    round against the reference; bf16 from float32 (the split kernels encode it too)."""
    for hidden, num_sms in ((12288, None), (1024, 2)):
        cfg = cuep.EPConfig(hidden=hidden, top_k=8, n_experts=32, max_tokens_per_rank=32, n_gpus_per_node=1,
                            small_batch_tokens=32, dispatch_format=fmt)
        buf = cuep.Buffer(cuep.init([0]), cfg, timeout_s=5.0, num_sms=num_sms)
        kw = {"dtype": np.dtype(np.float32)} if fmt == "bf16" else {}
        for n in (1, 32, 5, 1):
            run_round(buf, cfg, rng, [n], weights_at="dispatch", **kw)
        fits = buf._launch_cache["host"].split_fits
        if hidden == 12288 and buf.num_sms < 132:
            buf.close()
            continue  # (a smaller GPU: the item counts differ; the rounds above are still checked)
        if fmt == "bf16" and hidden == 12288:  # a float32 row's staging (24 KiB) leaves 9 warps a block: no split
            assert not any(fits) and split_launches(buf) == 0 and local_launches(buf) == 1
        else:
            assert fits[1] and not fits[32]
            assert split_launches(buf) == 1 and local_launches(buf) == 1
        buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_local_rounds_other_shapes(fmt, rng):
    # top_k = 1 and 2, many experts with few tokens each (most groups empty), a wide row (several chunks per token),
    # a row so wide that the block has too few warps for the split layout (its small rounds take the plain kernel)
    for kw in (dict(top_k=1, n_experts=8), dict(top_k=2, n_experts=256, hidden=2048),
               dict(top_k=8, n_experts=64, hidden=7168, max_tokens_per_rank=128, small_batch_tokens=128),
               dict(top_k=2, n_experts=16, hidden=32768, max_tokens_per_rank=40)):
        cfg, buf = make(dispatch_format=fmt, **kw)
        for n in (1, 5, cfg.small_batch_tokens):
            run_round(buf, cfg, rng, [n])
        wide = kw["hidden"] > 7168 if "hidden" in kw else False
        assert splits(buf) is not wide
        assert split_launches(buf) == (0 if wide else 1)
        assert local_launches(buf) == (1 if wide or cfg.small_batch_tokens > 32 else 0)
        buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared_expert"])
def test_fewest_token_local_rounds(fmt, shared, rng):
    """The fewest tokens a small round can have, where a round's choices fit one warp's lanes (N <= 32 / W, W the
    power of two >= K): every N up to that limit and the first two past it, top_k 8, 3 and 1, skewed routing (most
    choices on few experts), weights at combine with a residual, each against the reference."""
    for top_k, limit in ((8, 4), (3, 8), (1, 32)):
        cfg, buf = make(dispatch_format=fmt, fused_shared_expert=shared, top_k=top_k)
        for n in list(range(limit + 3)) + [1]:
            run_round(buf, cfg, rng, [n], weights_at="dispatch")
        run_round(buf, cfg, rng, [limit], skew=True)
        run_round(buf, cfg, rng, [2], weights_at="combine", residual=True)
        buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_shape_row_parts(fmt, rng):
    """The decode shape (H = 7168, K = 8, E = 256) at every N whose rows the host splits over parts (8, 4, 2 parts
    while the (token, chunk) pairs are at most twice the blocks; cuep/ep.py _small_round_chunks) and past it, a
    shared expert, weights at dispatch and at combine, each round against the reference."""
    cfg, buf = make(dispatch_format=fmt, hidden=7168, n_experts=256, max_tokens_per_rank=64, small_batch_tokens=64,
                    fused_shared_expert=True)
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 33, 64, 1):
        run_round(buf, cfg, rng, [n], weights_at="dispatch")
    run_round(buf, cfg, rng, [6], weights_at="combine", residual=True)
    assert local_launches(buf) == 1 and split_launches(buf) == (fmt != "bf16")  # quantized N <= 32: split
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("n, bad_token, dup_token", [(8, 3, 5), (3, 2, 1)], ids=["small", "tiny"])
@pytest.mark.parametrize("bad", ["out_of_range", "duplicate"])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])  # nvfp4: the split layout's book reports them
def test_local_round_reports_bad_routing(rng, fmt, bad, n, bad_token, dup_token):
    cfg, buf = make(dispatch_format=fmt)
    xs, ids, ws = make_inputs(rng, cfg, [n])
    if bad == "out_of_range":
        ids[0][bad_token, 2] = cfg.n_experts + 5
        want = rf"expert id out of range \(expert id {cfg.n_experts + 5}, token {bad_token}\)"
    else:
        ids[0][dup_token, 3] = ids[0][dup_token, 1]
        want = rf"same expert twice in one token's top-k \(expert id {int(ids[0][dup_token, 1])}, token {dup_token}\)"
    gx, gids, gws = to_devices(buf.group, xs), to_devices(buf.group, ids), to_devices(buf.group, ws)
    with pytest.raises(cuep.EPError, match=want):
        cuep.dispatch(buf, gx, gids, gws)
        buf.synchronize()
    assert (local_launches(buf), split_launches(buf)) == ((1, 0) if fmt == "bf16" else (0, 1))
    buf.reset()
    run_round(buf, cfg, rng, [n])  # a good round after reset
    buf.close()


@pytest.mark.gpu
def test_local_round_in_a_cuda_graph(rng):
    import cupy

    cfg, buf = make(dispatch_format="fp8")
    n = 16
    xs, ids, ws = make_inputs(rng, cfg, [n])
    gx, gids, gws = to_devices(buf.group, xs), to_devices(buf.group, ids), to_devices(buf.group, ws)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuep.dispatch(buf, gx, gids, gws)  # compile and prepare outside the capture
        stream.synchronize()
        stream.begin_capture()
        d = cuep.dispatch(buf, gx, gids, gws)
        graph = stream.end_capture()
    # fresh routing and tokens into the captured arrays, then replay: the outputs follow the new inputs
    for _ in range(3):
        xs2, ids2, ws2 = make_inputs(rng, cfg, [n])
        for dst, src in ((gx, xs2), (gids, ids2), (gws, ws2)):
            dst[0][...] = to_devices(buf.group, src)[0]
        with stream:
            graph.launch()
            stream.synchronize()
        want = ref.dispatch([np.asarray(xs2[0])], ids2, cfg)[0]
        rows = int(d[0].row_offsets[-1].get())
        assert rows == want.n_rows
        np.testing.assert_array_equal(d[0].row_offsets.get(), want.row_offsets)
        got_rows = {(int(t), int(k)): d[0].tokens[i].get().tobytes()
                    for i, (t, k) in enumerate(d[0].src_info[:rows].get()) if t >= 0}
        want_rows = {(int(t), int(k)): np.asarray(want.tokens[i]).tobytes()
                     for i, (t, k) in enumerate(want.src_info[:rows]) if t >= 0}
        assert got_rows == want_rows
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_dependent_launches_wait_for_the_kernel_before(fmt, rng):
    # The one-rank kernels are launched as programmatic dependents (cuep/_kernels.py DependentLaunch): scheduled while
    # the kernel before them finishes. Here that kernel spins 50 us, then writes the round's inputs (x, ids, weights;
    # expert_out before a combine) and reads the previous round's outputs (tokens; the combined rows) that the
    # launch overwrites: every round exact, every snapshot the round before's.
    import cupy

    cfg, buf = make(dispatch_format=fmt)
    n_max = cfg.max_tokens_per_rank
    gx = cupy.zeros((n_max, cfg.hidden), dtype=random_tokens(rng, 1, 8).dtype)
    gids, gws = cupy.zeros((n_max, cfg.top_k), np.int32), cupy.zeros((n_max, cfg.top_k), np.float32)
    g_eo = cupy.zeros((cfg.capacity, cfg.hidden), dtype=gx.dtype)
    # a first round allocates the combined rows and prepares the launches: every round below takes the short path
    run_round(buf, cfg, rng, [5])
    prev_tokens, prev_out = buf._ranks[0].tokens.get().tobytes(), buf._ranks[0].combined.get().tobytes()
    for n in (1, 32, 48, 17, 1, 40):
        xs, ids, ws = make_inputs(rng, cfg, [n])
        want = ref.dispatch([np.asarray(xs[0])], ids, cfg)
        sx, sids, sws = cupy.asarray(xs[0]), cupy.asarray(ids[0]), cupy.asarray(ws[0])
        x, i_, w = gx[:n], gids[:n], gws[:n]
        d_tokens = buf._ranks[0].tokens
        snap_tokens = cupy.empty_like(d_tokens)
        keep = slow_copy((d_tokens, snap_tokens), (sx, x), (sids, i_), (sws, w))
        d = cuep.dispatch(buf, x, i_, w)
        buf.synchronize()
        del keep
        assert snap_tokens.get().tobytes() == prev_tokens  # read before this round's dispatch overwrote it
        perm = check_dispatch(buf, [d], want, cfg)[0]
        prev_tokens = d_tokens.get().tobytes()
        eo_ref = [random_values(rng, want[0].n_rows, cfg.hidden, gx.dtype)]
        full = np.full((cfg.capacity, cfg.hidden), np.nan, dtype=gx.dtype)
        full[:want[0].n_rows] = eo_ref[0][perm]
        s_eo = cupy.asarray(full)
        out_rows = buf._ranks[0].combined
        snap_out = cupy.empty_like(out_rows)
        keep = slow_copy((out_rows, snap_out), (s_eo, g_eo))
        out = cuep.combine(buf, g_eo, d)
        buf.synchronize()
        del keep
        assert snap_out.get().tobytes() == prev_out
        prev_out = out_rows.get().tobytes()
        want_c = ref.combine(eo_ref, want, ws, cfg, num_tokens=[n])[0]
        np.testing.assert_allclose(out.get().astype(np.float32), want_c, rtol=2e-2,
                                   atol=2e-2 * max(1.0, float(np.abs(want_c).max())))
    host = buf._launch_cache["host"]
    dependents = {key[1] for key, launch in host.launches.items() if launch.dependent is not None}
    assert dependents and all("_local_" in name for name in dependents), dependents
    buf.close()
