"""The user's first hour: every common mistake with the GPU API raises a clear Python exception before any launch.

Two ranks are simulated on GPU 0 (``cuep.init([0, 0])``). Each parametrized case is one mistake and checks the
exception type and a message that names the argument, what was expected and what was given. The last test runs
a normal round on the same buffer: none of the bad calls launched anything or left state behind.
Mistakes that need no GPU (EPConfig, cuep.reference, launcher variables) are in tests/test_errors_cpu.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import cuep
from cuep import moe, ops
from ep_check import BF16, make_inputs, run_round, to_devices

pytestmark = pytest.mark.gpu

H, K, E, T = 256, 2, 8, 16


def _cfg():
    return cuep.EPConfig(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T, n_gpus_per_node=2)


@pytest.fixture(scope="module")
def c():
    """One buffer (two ranks on GPU 0), valid inputs, a finished round's Dispatched (dispatched without weights)
    and a Dispatched of a second buffer."""
    import cupy

    cfg = _cfg()
    buf = cuep.Buffer(cuep.init([0, 0]), cfg, timeout_s=5.0)
    rng = np.random.default_rng(1234)
    xs, ids, ws = make_inputs(rng, cfg, [T, T])
    gx, gids, gws = to_devices(buf.group, xs), to_devices(buf.group, ids), to_devices(buf.group, ws)
    ys = [cupy.zeros((cfg.capacity, H), BF16) for _ in range(2)]
    d = cuep.dispatch(buf, gx, gids)
    cuep.combine(buf, ys, d)
    buf.synchronize()
    other = cuep.Buffer(cuep.init([0, 0]), cfg, timeout_s=5.0)
    d_other = cuep.dispatch(other, gx, gids)
    cuep.combine(other, ys, d_other)
    other.synchronize()
    yield SimpleNamespace(cfg=cfg, buf=buf, gx=gx, gids=gids, gws=gws, ys=ys, d=d, d_other=d_other, xs=xs,
                          ids=ids, ws=ws, rng=rng)
    other.close()


def _cp():
    import cupy

    return cupy


def _swap0(lst, value):
    """The list with entry 0 replaced."""
    return [value] + list(lst[1:])


# (call(c), exception, regex); every regex names the argument and the expected / given value.
DISPATCH_CASES = [
    pytest.param(lambda c: cuep.dispatch(c.buf, c.xs, c.gids), TypeError,
                 r"x\[rank 0\] is a numpy\.ndarray.*cupy\.asarray", id="x-numpy"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, c.ids), TypeError,
                 r"topk_ids\[rank 0\] is a numpy\.ndarray.*GPU 0.*cupy\.asarray", id="ids-numpy"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, c.gids, c.ws), TypeError,
                 r"topk_weights\[rank 0\] is a numpy\.ndarray.*cupy\.asarray", id="weights-numpy"),
    pytest.param(lambda c: cuep.dispatch(c.buf, [list(range(H))] * 2, c.gids), TypeError,
                 r"x\[rank 0\] must be a cupy\.ndarray on GPU 0, got list", id="x-list-of-lists"),
    pytest.param(lambda c: cuep.dispatch(c.buf, [g.astype(np.float16) for g in c.gx], c.gids), TypeError,
                 r"x\[rank 0\] has dtype float16; expected bfloat16 or float32.*astype", id="x-float16"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, [g.astype(np.int64) for g in c.gids]), TypeError,
                 r"topk_ids\[rank 0\] has dtype int64; expected int32", id="ids-int64"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, c.gids, [g.astype(np.float64) for g in c.gws]), TypeError,
                 r"topk_weights\[rank 0\] has dtype float64; expected float32", id="weights-float64"),
    pytest.param(lambda c: cuep.dispatch(c.buf, [_cp().zeros((T + 1, H), BF16)] * 2,
                                         [_cp().zeros((T + 1, K), np.int32)] * 2), ValueError,
                 rf"x\[rank 0\] has {T + 1} tokens.*max_tokens_per_rank={T}", id="N>T"),
    pytest.param(lambda c: cuep.dispatch(c.buf, [g[:, :128].copy() for g in c.gx], c.gids), ValueError,
                 rf"x\[rank 0\] has shape \({T}, 128\).*cfg\.hidden is {H}", id="H-mismatch"),
    pytest.param(lambda c: cuep.dispatch(c.buf, [g.reshape(-1) for g in c.gx], c.gids), ValueError,
                 r"x\[rank 0\] must be 2-D \[N, H\], got shape", id="x-1d"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, [g[:, :1].copy() for g in c.gids]), ValueError,
                 rf"topk_ids\[rank 0\] has shape \({T}, 1\); expected \({T}, {K}\)", id="ids-shape"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, c.gids, [g[1:].copy() for g in c.gws]), ValueError,
                 rf"topk_weights\[rank 0\] has shape \({T - 1}, {K}\); expected \({T}, {K}\)", id="weights-shape"),
    pytest.param(lambda c: cuep.dispatch(c.buf, [_cp().asfortranarray(g) for g in c.gx], c.gids), ValueError,
                 r"x\[rank 0\] must be C-contiguous.*ascontiguousarray", id="x-fortran"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, [_cp().repeat(g, 2, axis=1)[:, ::2] for g in c.gids]),
                 ValueError, r"topk_ids\[rank 0\] must be C-contiguous", id="ids-strided"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx[:1], c.gids[:1]), ValueError,
                 r"x has 1 entries; this process drives 2 rank", id="list-too-short"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, c.gids + c.gids), ValueError,
                 r"topk_ids has 4 entries; this process drives 2 rank", id="ids-list-too-long"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx[0], c.gids[0]), TypeError,
                 r"x must be a list of 2 arrays \(one per local rank\), got ndarray", id="bare-array-2-ranks"),
    pytest.param(lambda c: cuep.dispatch(c.gx, c.gids, c.gws), TypeError,
                 r"cuep\.dispatch: the first argument must be the cuep\.Buffer.*got list", id="no-buffer"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, c.gids, global_scale=0.0), ValueError,
                 r"global_scale=0\.0 must be a finite positive number", id="global-scale"),
    pytest.param(lambda c: cuep.dispatch(c.buf, c.gx, [_cp().full((T, K), E, np.int32)] * 2, validate=True),
                 ValueError, rf"topk_ids\[rank 0\]\[0, 0\] = {E} is outside \[0, {E}\)", id="ids-out-of-range"),
    pytest.param(lambda c: cuep.dispatch_async(c.buf, c.xs, c.gids), TypeError,
                 r"x\[rank 0\] is a numpy\.ndarray", id="async-x-numpy"),
    pytest.param(lambda c: cuep.dispatch_wait(c.gx), TypeError,
                 r"dispatch_wait takes what dispatch_async returned.*got ndarray", id="wait-not-dispatched"),
    pytest.param(lambda c: cuep.dispatch_wait([]), TypeError,
                 r"dispatch_wait takes what dispatch_async returned", id="wait-empty"),
    pytest.param(lambda c: cuep.dispatch_wait(c.d[:1]), ValueError,
                 r"dispatch_wait got results for rank\(s\) \[0\]; this process drives rank\(s\) \[0, 1\]",
                 id="wait-partial"),
    pytest.param(lambda c: cuep.dispatch_wait([c.d[0], c.d_other[1]]), ValueError,
                 r"dispatch_wait got Dispatched results of different buffers", id="wait-mixed-buffers"),
]

COMBINE_CASES = [
    pytest.param(lambda c: cuep.combine(c.buf, [y.get() for y in c.ys], c.d), TypeError,
                 r"expert_out\[rank 0\] is a numpy\.ndarray.*cupy\.asarray", id="eo-numpy"),
    pytest.param(lambda c: cuep.combine(c.buf, [y.astype(np.float32) for y in c.ys], c.d), TypeError,
                 r"expert_out\[rank 0\] has dtype float32; expected bfloat16 \(cfg\.combine_dtype='bfloat16'\)",
                 id="eo-float32"),
    pytest.param(lambda c: cuep.combine(c.buf, [y[:8] for y in c.ys], c.d), ValueError,
                 rf"expert_out\[rank 0\] has shape \(8, {H}\); expected at least \(\d+, {H}\).*cfg\.capacity",
                 id="eo-too-few-rows"),
    pytest.param(lambda c: cuep.combine(c.buf, [y[:, :128].copy() for y in c.ys], c.d), ValueError,
                 r"expert_out\[rank 0\] has shape \(\d+, 128\); expected at least", id="eo-H-mismatch"),
    pytest.param(lambda c: cuep.combine(c.buf, [_cp().asfortranarray(y) for y in c.ys], c.d), ValueError,
                 r"expert_out\[rank 0\] must be C-contiguous", id="eo-fortran"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys[:1], c.d), ValueError,
                 r"expert_out has 1 entries; this process drives 2 rank", id="eo-list-too-short"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.d_other), ValueError,
                 r"dispatched\[rank 0\] was returned by a different cuep\.Buffer", id="dispatched-other-buffer"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.d[::-1]), ValueError,
                 r"dispatched\[rank 0\] is the result of rank 1", id="dispatched-swapped"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.gx), TypeError,
                 r"dispatched\[rank 0\] must be the cuep\.Dispatched.*got ndarray", id="dispatched-not-dispatched"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.d[:1]), ValueError,
                 r"dispatched has 1 entries", id="dispatched-list-too-short"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.d, residual=[_cp().zeros((T, H), BF16)] * 2), ValueError,
                 r"residual\[rank 0\].*no topk_weights.*pass topk_weights", id="residual-without-weights"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.d, c.gws, residual=[_cp().zeros((T - 1, H), BF16)] * 2),
                 ValueError, rf"residual\[rank 0\] has shape \({T - 1}, {H}\); expected \({T}, {H}\)",
                 id="residual-shape"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.d, c.gws, residual=[_cp().zeros((T, H), np.float32)] * 2),
                 TypeError, r"residual\[rank 0\] has dtype float32; expected bfloat16", id="residual-dtype"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.d, [g.astype(np.float64) for g in c.gws]), TypeError,
                 r"topk_weights\[rank 0\] has dtype float64; expected float32", id="weights-float64"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.d, c.ws), TypeError,
                 r"topk_weights\[rank 0\] is a numpy\.ndarray", id="weights-numpy"),
    pytest.param(lambda c: cuep.combine(c.buf, c.ys, c.d, [g[:, :1].copy() for g in c.gws]), ValueError,
                 rf"topk_weights\[rank 0\] has shape \({T}, 1\); expected \({T}, {K}\)", id="weights-shape"),
    pytest.param(lambda c: cuep.combine(c.ys, c.d, c.gws), TypeError,
                 r"cuep\.combine: the first argument must be the cuep\.Buffer", id="no-buffer"),
    pytest.param(lambda c: cuep.combine_async(c.buf, [y[:8] for y in c.ys], c.d), ValueError,
                 r"expert_out\[rank 0\] has shape \(8, ", id="async-eo-too-few-rows"),
    pytest.param(lambda c: cuep.combine_wait(c.buf, c.ys, c.d_other), ValueError,
                 r"dispatched\[rank 0\] was returned by a different cuep\.Buffer", id="wait-other-buffer"),
]

OPS_CASES = [
    pytest.param(lambda c: ops.quantize(np.ones((4, H), np.float32), "fp8"), TypeError,
                 r"x must be a cupy\.ndarray, got numpy\.ndarray.*cupy\.asarray", id="quantize-numpy"),
    pytest.param(lambda c: ops.quantize(_cp().ones((4, H), np.float16), "fp8"), TypeError,
                 r"x must have dtype float32 or bfloat16, got float16", id="quantize-float16"),
    pytest.param(lambda c: ops.quantize(_cp().ones((4, 100), np.float32), "fp8"), ValueError,
                 r"x\.shape\[1\]=100 must be a positive multiple of 128", id="quantize-H"),
    pytest.param(lambda c: ops.quantize(_cp().ones((4, H), np.float32), "fp16"), ValueError,
                 r"fmt='fp16' is not a wire format", id="quantize-fmt"),
    pytest.param(lambda c: ops.quantize(_cp().ones((4, H), np.float32), "fp8", out=[_cp().empty(1)] * 3),
                 TypeError, r"out must be a tuple of 2 cupy arrays, got list of 3", id="quantize-out-len"),
    pytest.param(lambda c: ops.dequantize(_cp().zeros((4, H), np.uint8), _cp().zeros((4, 2), np.uint8), "fp8", H),
                 ValueError, rf"scales must have shape \[4, 8\], got \(4, 2\)", id="dequantize-scales-shape"),
    pytest.param(lambda c: ops.dequantize(_cp().zeros((4, H), np.uint8), np.zeros((4, 8), np.uint8), "fp8", H),
                 TypeError, r"scales must be a cupy\.ndarray, got numpy\.ndarray", id="dequantize-numpy"),
    pytest.param(lambda c: ops.swizzle_block_scales(_cp().zeros((8, 8), np.uint8), _cp().zeros(2, np.float32),
                                                    "nvfp4", 128), TypeError,
                 r"row_offsets must have dtype int32 or uint32 or int64 or uint64, got float32", id="swizzle-ro"),
    pytest.param(lambda c: ops.fused_silu(_cp().ones((8, 2 * H + 1), np.float32), _cp().zeros(2, np.int32)),
                 ValueError, r"h must be \[capacity, 2I\] with an even width", id="silu-odd"),
    pytest.param(lambda c: ops.fused_silu(_cp().ones((8, 4 * H), np.float32)[:, ::2], _cp().zeros(2, np.int32)),
                 ValueError, r"h must be C-contiguous", id="silu-strided"),
    pytest.param(lambda c: ops.fused_silu(_cp().ones((8, 2 * H), np.float32), np.array([0, 8], np.int32)),
                 TypeError, r"row_offsets must be a cupy\.ndarray, got numpy\.ndarray", id="silu-ro-numpy"),
]


def _weights(c):
    if not hasattr(c, "weights"):
        c.weights = moe.init_weights(c.cfg, 64, seed=0, devices=c.buf.group.devices)
    return c.weights


MOE_CASES = [
    pytest.param(lambda c: moe.moe_forward(c.buf, c.xs, _weights(c)), TypeError,
                 r"x\[rank 0\] is a numpy\.ndarray.*cupy\.asarray", id="x-numpy"),
    pytest.param(lambda c: moe.moe_forward(c.buf, [g.astype(np.float16) for g in c.gx], _weights(c)), TypeError,
                 r"x\[rank 0\] has dtype float16; expected bfloat16 or float32", id="x-float16"),
    pytest.param(lambda c: moe.moe_forward(c.buf, [_cp().zeros((T + 1, H), BF16)] * 2, _weights(c)), ValueError,
                 rf"x\[rank 0\] has {T + 1} tokens.*max_tokens_per_rank={T}", id="N>T"),
    pytest.param(lambda c: moe.moe_forward(c.buf, [g[:, :128].copy() for g in c.gx], _weights(c)), ValueError,
                 rf"x\[rank 0\] must be a cupy \[N, {H}\] array.*got shape \({T}, 128\)", id="H-mismatch"),
    pytest.param(lambda c: moe.moe_forward(c.buf, c.gx, [w.to_numpy() for w in _weights(c)]), ValueError,
                 r"weights\[rank 0\]\.w_gate_up must be a cupy array on GPU 0, got a numpy\.ndarray.*init_weights",
                 id="weights-on-host"),
    pytest.param(lambda c: moe.moe_forward(c.buf, c.gx, _weights(c)[:1]), ValueError,
                 r"weights has 1 entries; this process drives 2 rank", id="weights-list-too-short"),
    pytest.param(lambda c: moe.moe_forward(c.gx, c.gx, _weights(c)), TypeError,
                 r"moe_forward: the first argument must be the cuep\.Buffer", id="no-buffer"),
]


@pytest.mark.parametrize("call, exc, match", DISPATCH_CASES)
def test_dispatch_mistakes(c, call, exc, match):
    with pytest.raises(exc, match=match):
        call(c)


@pytest.mark.parametrize("call, exc, match", COMBINE_CASES)
def test_combine_mistakes(c, call, exc, match):
    with pytest.raises(exc, match=match):
        call(c)


@pytest.mark.parametrize("call, exc, match", OPS_CASES)
def test_ops_mistakes(c, call, exc, match):
    with pytest.raises(exc, match=match):
        call(c)


@pytest.mark.parametrize("call, exc, match", MOE_CASES)
def test_moe_mistakes(c, call, exc, match):
    with pytest.raises(exc, match=match):
        call(c)


def test_buffer_mistakes(c):
    group = cuep.init([0, 0])
    with pytest.raises(ValueError, match=r"cfg\.n_ranks=1 .* must equal the group's 2 ranks"):
        cuep.Buffer(group, cuep.EPConfig(H, K, E, T, n_gpus_per_node=1))
    with pytest.raises(TypeError, match=r"group must be a cuep\.Group .*got EPConfig"):
        cuep.Buffer(c.cfg, group)
    with pytest.raises(ValueError, match=r"num_sms=100000 must be in 1\.\."):
        cuep.Buffer(group, c.cfg, num_sms=100000)
    with pytest.raises(ValueError, match=r"devices \[99\] do not exist: \d+ GPU\(s\) are visible"):
        cuep.init([0, 99])


def test_closed_buffer_refuses_every_call(c):
    import cupy

    buf = cuep.Buffer(cuep.init([0, 0]), c.cfg)
    buf.close()
    assert buf.closed
    ys = [cupy.zeros((c.cfg.capacity, H), BF16)] * 2
    for call in (lambda: cuep.dispatch(buf, c.gx, c.gids), lambda: cuep.dispatch_async(buf, c.gx, c.gids),
                 lambda: cuep.combine(buf, ys, c.d), lambda: buf.synchronize(), lambda: buf.reset(),
                 lambda: buf.check(), lambda: moe.moe_forward(buf, c.gx, _weights(c))):
        with pytest.raises(RuntimeError, match=r"cuep\.Buffer was closed \(buf\.close\(\)\).*new cuep\.Buffer"):
            call()
    buf.close()  # idempotent


def test_dispatched_of_a_closed_buffer(c):
    buf = cuep.Buffer(cuep.init([0, 0]), c.cfg)
    d = cuep.dispatch(buf, c.gx, c.gids)
    cuep.combine(buf, c.ys, d)
    buf.synchronize()
    buf.close()
    with pytest.raises(RuntimeError, match=r"cuep\.Buffer was closed"):
        cuep.dispatch_wait(d)
    with pytest.raises(RuntimeError, match=r"cuep\.Buffer was closed"):
        cuep.combine(buf, c.ys, d)


@pytest.mark.multigpu
def test_arrays_on_another_gpu_are_refused(c):
    import cupy

    with cupy.cuda.Device(1):
        x1 = cupy.asarray(c.xs[0])
        y1 = cupy.zeros((c.cfg.capacity, H), BF16)
    with pytest.raises(ValueError, match=r"x\[rank 0\] is on GPU 1; this rank runs on GPU 0.*cupy\.cuda\.Device\(0\)"):
        cuep.dispatch(c.buf, _swap0(c.gx, x1), c.gids)
    with pytest.raises(ValueError, match=r"expert_out\[rank 0\] is on GPU 1; this rank runs on GPU 0"):
        cuep.combine(c.buf, _swap0(c.ys, y1), c.d)
    with cupy.cuda.Device(0):
        with pytest.raises(ValueError, match=r"x is on device 1, but the current device is 0.*Device\(1\)"):
            ops.quantize(x1, "bf16")


def test_zz_a_normal_round_still_works_after_the_bad_calls(c):
    """Runs last in this module (definition order): nothing above launched a kernel or left state behind."""
    c.buf.check()
    run_round(c.buf, c.cfg, c.rng, [T, T])
    run_round(c.buf, c.cfg, c.rng, [T, 3], weights_at="combine", residual=True, async_halves=True)
