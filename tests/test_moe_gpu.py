"""cuep.moe.moe_forward on the GPU against the dense NumPy reference cuep.moe.moe_reference.

`gpu` tests simulate R = 1, 2, 4 ranks on one GPU (``cuep.init([0] * R)``); `multigpu` runs one rank per GPU on
all of them. Inputs are fresh random tokens (never zeros) at realistic small sizes; the tolerance is that of bf16
GEMMs (relative Frobenius error per rank), since the reference applies the dispatch format's quantization to the
expert inputs bit for bit as the GPU does.
"""
from __future__ import annotations

import numpy as np
import pytest

import cuep
import cuep.moe as moe
from conftest import N_GPUS
from ep_check import BF16, to_devices

H, I, E, K, T = 512, 256, 16, 4, 64
TOL = 2e-2


def groups():
    out = [pytest.param([0] * R, id=f"sim{R}", marks=pytest.mark.gpu) for R in (1, 2, 4)]
    out.append(pytest.param("all", id="all_gpus",
                            marks=[pytest.mark.multigpu, pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs")]))
    return out


def make(devices, fmt, shared, **kw):
    devices = list(range(min(N_GPUS, 8))) if devices == "all" else devices  # a node-local group: <= 8 ranks
    R = len(devices)
    n_experts = E if E % R == 0 else 4 * R
    cfg = cuep.EPConfig(**{**dict(hidden=H, top_k=K, n_experts=n_experts, max_tokens_per_rank=T,
                                  n_gpus_per_node=R, dispatch_format=fmt, fused_shared_expert=shared), **kw})
    return cfg, cuep.Buffer(cuep.init(devices), cfg, timeout_s=10.0)


def check_layer(buf, cfg, weights, rng, n_tokens, global_scale=1.0):
    """One moe_forward call on fresh tokens, compared with moe_reference on every rank; returns the timings."""
    xs = [rng.standard_normal((n, cfg.hidden)).astype(BF16) for n in n_tokens]
    timings = {}
    out = moe.moe_forward(buf, to_devices(buf.group, xs), weights, global_scale=global_scale, timings=timings)
    want = moe.moe_reference(xs, [w.to_numpy() for w in weights], cfg, global_scale=global_scale)
    for r, (o, w) in enumerate(zip(out, want)):
        assert o.dtype == BF16 and o.shape == (n_tokens[r], cfg.hidden), (o.dtype, o.shape)
        got = o.get().astype(np.float32)
        assert np.isfinite(got).all(), f"rank {r}: non-finite output"
        if w.size:
            err = float(np.linalg.norm(got - w) / np.linalg.norm(w))
            assert err < TOL, f"rank {r} ({cfg.fmt.name}): relative Frobenius error {err:.2e}"
    return timings


@pytest.mark.parametrize("devices", groups())
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "routed_only"])
def test_moe_forward_matches_dense_reference(devices, fmt, shared, rng):
    cfg, buf = make(devices, fmt, shared)
    weights = moe.init_weights(cfg, I, seed=int(rng.integers(2**31)), devices=buf.group.devices)
    R = cfg.n_ranks
    timings = check_layer(buf, cfg, weights, rng, [T] * R)
    assert set(moe.PHASES) <= set(timings) and "total" in timings
    assert all(v >= 0 for v in timings.values()), timings
    # the same buffer again, with token counts that differ between ranks
    check_layer(buf, cfg, weights, rng, [T - 3 * r for r in range(R)])


@pytest.mark.gpu
def test_moe_forward_with_a_rank_without_tokens(rng):
    cfg, buf = make([0, 0], "fp8", True)
    weights = moe.init_weights(cfg, I, seed=1, devices=buf.group.devices)
    check_layer(buf, cfg, weights, rng, [0, T])
    check_layer(buf, cfg, weights, rng, [T, 0])


@pytest.mark.gpu
def test_moe_forward_nvfp4_global_scale_and_float32_combine(rng):
    cfg, buf = make([0, 0], "nvfp4", True, combine_dtype="float32")
    weights = moe.init_weights(cfg, I, seed=2, devices=buf.group.devices)
    xs = [rng.standard_normal((T, H)).astype(BF16) for _ in range(2)]
    out = moe.moe_forward(buf, to_devices(buf.group, xs), weights, global_scale=4.0)
    want = moe.moe_reference(xs, [w.to_numpy() for w in weights], cfg, global_scale=4.0)
    for o, w in zip(out, want):
        assert o.dtype == np.float32
        assert np.linalg.norm(o.get() - w) / np.linalg.norm(w) < TOL


@pytest.mark.gpu
def test_route_on_gpu_matches_numpy(rng):
    """The GPU router picks the same experts as the reference's (the layer comparison relies on it)."""
    import cupy

    x = rng.standard_normal((T, H)).astype(BF16)
    router = (rng.standard_normal((H, E)) / np.sqrt(H)).astype(np.float32)
    ids, w = moe.route(cupy.asarray(x), cupy.asarray(router), K)
    ids_ref, w_ref = moe.route(x, router, K)
    assert isinstance(ids, cupy.ndarray) and ids.dtype == np.int32 and w.dtype == np.float32
    np.testing.assert_array_equal(ids.get(), ids_ref)
    np.testing.assert_allclose(w.get(), w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_moe_forward_rejects_bad_arguments(rng):
    import cupy

    cfg, buf = make([0, 0], "bf16", True)
    weights = moe.init_weights(cfg, I, seed=3, devices=buf.group.devices)
    xs = to_devices(buf.group, [rng.standard_normal((8, H)).astype(BF16) for _ in range(2)])
    with pytest.raises(ValueError, match="weights has 1"):
        moe.moe_forward(buf, xs, weights[:1])
    with pytest.raises(ValueError, match="cupy array on GPU"):
        moe.moe_forward(buf, xs, [w.to_numpy() for w in weights])
    no_shared = moe.init_weights(cuep.EPConfig(H, K, E, T, 2), I, devices=buf.group.devices)
    with pytest.raises(ValueError, match="shared expert"):
        moe.moe_forward(buf, xs, no_shared)
    with pytest.raises(ValueError, match=r"x\[rank 1\]"):
        moe.moe_forward(buf, [xs[0], cupy.zeros((8, H // 2), BF16)], weights)
    skip_cfg, skip_buf = make([0, 0], "bf16", False, skip_a2a=True)
    with pytest.raises(ValueError, match="skip_a2a"):
        moe.moe_forward(skip_buf, xs, moe.init_weights(skip_cfg, I, devices=skip_buf.group.devices))
    check_layer(buf, cfg, weights, rng, [T, T])  # nothing was launched by the calls above
