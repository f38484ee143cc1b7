"""cuep.moe without a GPU: the router, the weights' sharding, properties of the dense reference, and the layer's
expert glue (dispatch layout -> dequantize -> grouped GEMMs -> SwiGLU) run on cuep.reference's dispatch/combine.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import cuep
from cuep import moe
from cuep import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
FORMATS = ["bf16", "fp8", "nvfp4", "mxfp4"]


def make_cfg(R=2, fmt="bf16", shared=True, **kw):
    return cuep.EPConfig(**{**dict(hidden=256, top_k=2, n_experts=8, max_tokens_per_rank=32, n_gpus_per_node=R,
                                   dispatch_format=fmt, fused_shared_expert=shared), **kw})


def tokens(rng, n, h):
    return rng.standard_normal((n, h)).astype(BF16)


def mlp(x, w_gate_up, w_down):
    """An independent float64 SwiGLU expert."""
    h = x.astype(np.float64) @ w_gate_up.astype(np.float64)
    i = h.shape[1] // 2
    return (h[:, :i] / (1 + np.exp(-h[:, :i])) * h[:, i:]) @ w_down.astype(np.float64)


def rel_err(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# ---- router -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_route_picks_the_top_k_logits_with_weights_summing_to_one(top_k, rng):
    x = tokens(rng, 40, 64)
    router = rng.standard_normal((64, 8)).astype(np.float32)
    ids, w = moe.route(x, router, top_k)
    assert ids.shape == w.shape == (40, top_k) and ids.dtype == np.int32 and w.dtype == np.float32
    assert ids.flags.c_contiguous and w.flags.c_contiguous
    assert all(len(set(row)) == top_k for row in ids.tolist())
    logits = x.astype(np.float32) @ router
    chosen = np.take_along_axis(logits, ids, axis=1)
    for t in range(40):
        others_t = np.delete(logits[t], ids[t])
        assert others_t.size == 0 or chosen[t].min() >= others_t.max()
    np.testing.assert_array_equal(chosen, -np.sort(-chosen, axis=1))  # best first
    assert (w > 0).all()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
    p = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    want = np.take_along_axis(p, ids, axis=1)
    np.testing.assert_allclose(w, want / want.sum(1, keepdims=True), rtol=1e-5)


def test_route_of_no_tokens(rng):
    ids, w = moe.route(np.zeros((0, 64), BF16), rng.standard_normal((64, 8)).astype(np.float32), 2)
    assert ids.shape == w.shape == (0, 2) and ids.dtype == np.int32 and w.dtype == np.float32
    with pytest.raises(ValueError, match="top_k"):
        moe.route(tokens(rng, 2, 64), rng.standard_normal((64, 8)).astype(np.float32), 9)


# ---- weights ----------------------------------------------------------------------------------------------------
def test_init_weights_shapes_and_sharding():
    cfg2, cfg1 = make_cfg(R=2), make_cfg(R=1)
    w2, w1 = moe.init_weights(cfg2, 64, seed=3), moe.init_weights(cfg1, 64, seed=3)
    L = cfg2.n_local_experts
    assert len(w2) == 2 and len(w1) == 1
    for w in w2:
        assert w.w_gate_up.shape == (L + 1, 256, 128) and w.w_gate_up.dtype == BF16
        assert w.w_down.shape == (L + 1, 64, 256) and w.w_down.dtype == BF16
        assert w.router.shape == (256, 8) and w.router.dtype == np.float32
        assert (w.n_held, w.hidden, w.intermediate) == (L + 1, 256, 64)
    # the same model for any number of ranks: rank r holds global experts r*L .. r*L+L-1, then the shared one
    for r in range(2):
        for l in range(L):
            np.testing.assert_array_equal(w2[r].w_gate_up[l], w1[0].w_gate_up[r * L + l])
            np.testing.assert_array_equal(w2[r].w_down[l], w1[0].w_down[r * L + l])
        np.testing.assert_array_equal(w2[r].w_gate_up[L], w1[0].w_gate_up[cfg1.shared_expert_id])
        np.testing.assert_array_equal(w2[r].router, w1[0].router)
    assert not np.array_equal(w2[0].w_gate_up[0], w2[0].w_gate_up[1])
    no_shared = moe.init_weights(make_cfg(R=2, shared=False), 64, seed=3)
    assert no_shared[0].n_held == L
    np.testing.assert_array_equal(no_shared[1].w_down, w2[1].w_down[:L])
    assert [w.n_held for w in moe.init_weights(cfg2, 64, seed=3, ranks=[1])] == [L + 1]


def test_init_weights_rejects_bad_arguments():
    cfg = make_cfg()
    for bad in (0, 12, 2.0, True):
        with pytest.raises(ValueError, match="intermediate"):
            moe.init_weights(cfg, bad)
    with pytest.raises(ValueError, match="seed"):
        moe.init_weights(cfg, 64, seed=-1)
    with pytest.raises(ValueError, match="ranks"):
        moe.init_weights(cfg, 64, ranks=[2])
    with pytest.raises(ValueError, match="devices"):
        moe.init_weights(cfg, 64, devices=[0])


def test_moe_weights_is_frozen_and_checks_shapes():
    w = moe.init_weights(make_cfg(), 64)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.router = None
    with pytest.raises(ValueError, match="w_down"):
        moe.MoEWeights(w.w_gate_up, w.w_down[:, :32], w.router)
    with pytest.raises(ValueError, match="router"):
        moe.MoEWeights(w.w_gate_up, w.w_down, w.router[:8])
    with pytest.raises(TypeError, match="w_gate_up"):
        moe.MoEWeights(w.w_gate_up.astype(np.float32), w.w_down, w.router)
    assert w.to_numpy().w_down is not None


# ---- the dense reference ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True])
def test_reference_with_identical_experts_is_one_expert(shared, rng):
    """Every routed expert the same: the renormalised weights sum to 1, so the output is that one expert."""
    cfg = make_cfg(R=2, shared=shared)
    w = moe.init_weights(cfg, 64, seed=1)
    L = cfg.n_local_experts
    up, down = w[0].w_gate_up[0], w[0].w_down[0]
    same = [moe.MoEWeights(np.stack([up] * L + list(wr.w_gate_up[L:])), np.stack([down] * L + list(wr.w_down[L:])),
                           wr.router) for wr in w]
    xs = [tokens(rng, 20, 256), tokens(rng, 7, 256)]
    out = moe.moe_reference(xs, same, cfg)
    for r, x in enumerate(xs):
        want = mlp(x, up, down)
        if shared:
            want = want + mlp(x, w[r].w_gate_up[L], w[r].w_down[L])
        assert out[r].dtype == np.float32 and out[r].shape == x.shape
        np.testing.assert_allclose(out[r], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_reference_is_the_routed_weighted_sum(rng):
    """Each token's output is sum_k w_k * expert_{id_k}(x) with (ids, w) from route (no shared expert)."""
    cfg = make_cfg(R=2, shared=False, top_k=3)
    w = moe.init_weights(cfg, 64, seed=2)
    xs = [tokens(rng, 9, 256), tokens(rng, 5, 256)]
    out = moe.moe_reference(xs, w, cfg)
    L = cfg.n_local_experts
    for r, x in enumerate(xs):
        ids, tw = moe.route(x, w[r].router, cfg.top_k)
        want = np.zeros((x.shape[0], 256))
        for t in range(x.shape[0]):
            for k in range(cfg.top_k):
                owner, local = divmod(int(ids[t, k]), L)
                want[t] += tw[t, k] * mlp(x[t:t + 1], w[owner].w_gate_up[local], w[owner].w_down[local])[0]
        np.testing.assert_allclose(out[r], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_reference_ignores_experts_a_token_did_not_choose(rng):
    cfg = make_cfg(R=2)
    w = moe.init_weights(cfg, 64, seed=4)
    xs = [tokens(rng, 24, 256), tokens(rng, 24, 256)]
    base = moe.moe_reference(xs, w, cfg)
    e = 5  # global expert 5: rank 1, local expert 1
    owner, local = divmod(e, cfg.n_local_experts)
    up = w[owner].w_gate_up.copy()
    up[local] = (up[local].astype(np.float32) * 3).astype(BF16)
    w2 = list(w)
    w2[owner] = moe.MoEWeights(up, w[owner].w_down, w[owner].router)
    changed = moe.moe_reference(xs, w2, cfg)
    for r, x in enumerate(xs):
        chose = (moe.route(x, w[r].router, cfg.top_k)[0] == e).any(axis=1)
        assert chose.any() and not chose.all()
        np.testing.assert_array_equal(changed[r][~chose], base[r][~chose])
        assert (np.abs(changed[r][chose] - base[r][chose]).max(axis=1) > 0).all()


def test_reference_does_not_depend_on_the_sharding(rng):
    x = tokens(rng, 24, 256)
    outs = []
    for R in (1, 2, 4):
        cfg = make_cfg(R=R)
        out = moe.moe_reference(np.split(x, R), moe.init_weights(cfg, 64, seed=9), cfg)
        outs.append(np.concatenate(out))
    for other in outs[1:]:  # the same math; only the GEMMs' blocking differs with the number of tokens per rank
        np.testing.assert_allclose(other, outs[0], rtol=1e-5, atol=1e-5 * np.abs(outs[0]).max())


def test_shared_expert_adds_its_output(rng):
    xs = [tokens(rng, 11, 256), tokens(rng, 3, 256)]
    with_s, without = make_cfg(shared=True), make_cfg(shared=False)
    ws = moe.init_weights(with_s, 64, seed=5)
    a = moe.moe_reference(xs, ws, with_s)
    b = moe.moe_reference(xs, moe.init_weights(without, 64, seed=5), without)
    L = with_s.n_local_experts
    for r, x in enumerate(xs):
        want = mlp(x, ws[r].w_gate_up[L], ws[r].w_down[L])
        np.testing.assert_allclose(a[r] - b[r], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_reference_sees_the_quantized_tokens(fmt, rng):
    """The experts see the dispatch format's values: close to bf16 for fp8, coarser for fp4, never identical."""
    xs = [tokens(rng, 16, 256), tokens(rng, 16, 256)]
    cfg_q, cfg_b = make_cfg(fmt=fmt), make_cfg(fmt="bf16")
    w = moe.init_weights(cfg_b, 64, seed=6)
    q, b = moe.moe_reference(xs, w, cfg_q), moe.moe_reference(xs, w, cfg_b)
    for r in range(2):
        err = rel_err(q[r], b[r])
        assert 0 < err < (0.06 if fmt == "fp8" else 0.3), err


def test_reference_handles_a_rank_without_tokens(rng):
    cfg = make_cfg()
    out = moe.moe_reference([tokens(rng, 0, 256), tokens(rng, 4, 256)], moe.init_weights(cfg, 64), cfg)
    assert out[0].shape == (0, 256) and out[1].shape == (4, 256)


def test_reference_rejects_bad_arguments(rng):
    cfg = make_cfg()
    w = moe.init_weights(cfg, 64)
    xs = [tokens(rng, 4, 256)] * 2
    with pytest.raises(ValueError, match="x must be a list of 2"):
        moe.moe_reference(xs[:1], w, cfg)
    with pytest.raises(ValueError, match="weights"):
        moe.moe_reference(xs, moe.init_weights(make_cfg(shared=False), 64), cfg)
    with pytest.raises(ValueError, match=r"x\[1\]"):
        moe.moe_reference([xs[0], tokens(rng, 4, 128)], w, cfg)
    with pytest.raises(TypeError, match="cfg"):
        moe.moe_reference(xs, w, None)


# ---- the layer's expert glue on cuep.reference ----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shared", [False, True])
def test_layer_glue_on_reference_dispatch_matches_dense(fmt, shared, rng):
    """route -> reference.dispatch -> moe's expert step (dequantize, GEMM loop, SwiGLU) -> reference.combine gives
    the dense reference up to bf16 GEMM roundings: the path moe_forward takes, with the GPU kernels replaced."""
    cfg = cuep.EPConfig(hidden=512, top_k=4, n_experts=16, max_tokens_per_rank=64, n_gpus_per_node=4,
                        dispatch_format=fmt, fused_shared_expert=shared)
    w = moe.init_weights(cfg, 256, seed=7)
    xs = [tokens(rng, n, 512) for n in (64, 0, 17, 40)]
    routed = [moe.route(x, wr.router, cfg.top_k) for x, wr in zip(xs, w)]
    d = ref.dispatch(xs, [r[0] for r in routed], cfg)
    ys = [moe._expert_outputs(di, wr, cfg, 1.0, np.full((di.n_rows, 512), np.nan, np.float32))
          for di, wr in zip(d, w)]
    got = ref.combine(ys, d, [r[1] for r in routed], cfg)
    want = moe.moe_reference(xs, w, cfg)
    for r in (0, 2, 3):
        assert rel_err(got[r], want[r]) < 1e-2
    assert got[1].shape == (0, 512)


@pytest.mark.parametrize("fmt, hidden", [("fp8", 256), ("nvfp4", 160), ("mxfp4", 96)])
def test_scale_rows_undo_the_dispatch_scale_layout(fmt, hidden, rng):
    """Groups of several 128-row tiles, empty groups and fp8 padding rows: every row gets its token's scales."""
    cfg = cuep.EPConfig(hidden=hidden, top_k=2, n_experts=6, max_tokens_per_rank=300, n_gpus_per_node=2,
                        dispatch_format=fmt, fused_shared_expert=True)
    xs = [tokens(rng, 300, hidden), tokens(rng, 77, hidden)]
    ids = []
    for x in xs:  # expert 2 (rank 0) never chosen: an empty group
        choice = np.argsort(-rng.random((x.shape[0], 6)), axis=1)
        ids.append(np.array([[e for e in row if e != 2][:2] for row in choice], np.int32))
    d = ref.dispatch(xs, ids, cfg)
    enc = [ref.quantize(x, fmt)[1] for x in xs]
    for r, di in enumerate(d):
        rows = di.n_rows
        assert rows > 2 * 128
        got = moe._scale_rows(di, rows, cfg)
        assert got.dtype == np.uint8 and got.shape == (rows, cfg.fmt.scale_bytes(hidden))
        real = di.src_rank >= 0
        want = np.zeros_like(got)
        want[real] = np.stack([enc[s][t] for s, t in zip(di.src_rank[real], di.src_info[real, 0])])
        np.testing.assert_array_equal(got, want)
