"""The user's first hour, the part that needs no GPU: EPConfig, cuep.reference, the launcher's variables, a
machine without a GPU, and the argument checks that run before any device is touched (NumPy arrays where CuPy
arrays belong, the Buffer left out, a closed Buffer). Each case is one mistake; the message must name the argument,
what was expected and what was given. The GPU half is tests/test_errors_gpu.py.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import cuep
from cuep import moe, ops
from cuep import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
STD = dict(hidden=256, top_k=2, n_experts=8, max_tokens_per_rank=16, n_gpus_per_node=2)


# ---- EPConfig ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(hidden="7168"), ValueError, r"hidden='7168' must be a positive int"),
    (dict(hidden=256.0), ValueError, r"hidden=256\.0 must be a positive int"),
    (dict(hidden=100), ValueError, r"hidden=100 must be a positive multiple of 8 \(the group of format 'bf16'\)"),
    (dict(hidden=192, dispatch_format="fp8"), ValueError, r"hidden=192 must be a positive multiple of 128"),
    (dict(hidden=272, dispatch_format="nvfp4"), ValueError,
     r"hidden=272 must be a multiple of 32 for dispatch_format='nvfp4': a dispatched row \(136 bytes\)"),
    (dict(top_k=0), ValueError, r"top_k=0 must be a positive int"),
    (dict(top_k=9), ValueError, r"top_k=9 must be <= n_experts=8"),
    (dict(n_experts=7), ValueError, r"n_experts=7 must be a multiple of the number of ranks 2"),
    (dict(max_tokens_per_rank=-1), ValueError, r"max_tokens_per_rank=-1 must be a positive int"),
    (dict(n_gpus_per_node=16, n_experts=16), ValueError, r"n_gpus_per_node=16 exceeds 8"),
    (dict(dispatch_format="fp16"), ValueError, r"dispatch_format='fp16' is not a wire format; choose one of"),
    (dict(combine_dtype="float16"), ValueError, r"combine_dtype='float16' must be one of \['bfloat16', 'float32'\]"),
    (dict(n_nodes=0), ValueError, r"n_nodes=0 must be a positive int"),
])
def test_epconfig_mistakes(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cuep.EPConfig(**{**STD, **kwargs})


def test_epconfig_missing_argument_names_it():
    with pytest.raises(TypeError, match="n_gpus_per_node"):
        cuep.EPConfig(hidden=256, top_k=2, n_experts=8, max_tokens_per_rank=16)  # type: ignore[call-arg]


# ---- cuep.reference -----------------------------------------------------------------------------------------------
@pytest.fixture
def inputs():
    rng = np.random.default_rng(0)
    cfg = cuep.EPConfig(**STD)
    xs = [rng.standard_normal((16, 256)).astype(BF16) for _ in range(2)]
    ids = [np.argsort(rng.random((16, 8)), axis=1)[:, :2].astype(np.int32) for _ in range(2)]
    ws = [rng.random((16, 2)).astype(np.float32) for _ in range(2)]
    return cfg, xs, ids, ws


@pytest.mark.parametrize("mistake, match", [
    (lambda cfg, xs, ids: ref.dispatch(xs[:1], ids, cfg), r"tokens has 1 entries; expected one per rank \(2\)"),
    (lambda cfg, xs, ids: ref.dispatch(xs[0], ids, cfg), r"tokens must be a list of 2 per-rank arrays"),
    (lambda cfg, xs, ids: ref.dispatch([x.astype(np.float16) for x in xs], ids, cfg),
     r"tokens\[0\] has dtype float16; expected float32 or bfloat16"),
    (lambda cfg, xs, ids: ref.dispatch(xs, [i.astype(np.int64) for i in ids], cfg),
     r"topk_ids\[0\] has dtype int64; expected int32"),
    (lambda cfg, xs, ids: ref.dispatch([np.zeros((17, 256), BF16)] * 2, [np.zeros((17, 2), np.int32)] * 2, cfg),
     r"tokens\[0\] has 17 tokens > max_tokens_per_rank=16"),
    (lambda cfg, xs, ids: ref.dispatch([x[:, :128] for x in xs], ids, cfg),
     r"tokens\[0\] has shape \(16, 128\); expected \[N, hidden=256\]"),
    (lambda cfg, xs, ids: ref.dispatch(xs, [i[:, :1] for i in ids], cfg),
     r"topk_ids\[0\] has shape \(16, 1\); expected \[N=16, top_k=2\]"),
    (lambda cfg, xs, ids: ref.dispatch(xs, [np.full((16, 2), 8, np.int32)] * 2, cfg),
     r"topk_ids\[0\]\[0, 0\] = 8 is outside \[0, n_experts=8\)"),
    (lambda cfg, xs, ids: ref.dispatch(xs, ids, None), r"cfg must be an EPConfig, got NoneType"),
], ids=["list-short", "bare-array", "float16", "ids-int64", "N>T", "H-mismatch", "ids-shape", "ids-range", "cfg"])
def test_reference_dispatch_mistakes(inputs, mistake, match):
    cfg, xs, ids, _ = inputs
    with pytest.raises(ValueError, match=match):
        mistake(cfg, xs, ids)


@pytest.mark.parametrize("mistake, match", [
    (lambda cfg, d, ys, ws: ref.combine(ys, d, [w.astype(np.float64) for w in ws], cfg),
     r"topk_weights\[0\] has dtype float64; expected float32"),
    (lambda cfg, d, ys, ws: ref.combine([y[:1] for y in ys], d, ws, cfg),
     r"expert_out\[0\] has shape \(1, 256\); expected \[>= \d+ rows"),
    (lambda cfg, d, ys, ws: ref.combine(ys[:1], d, ws, cfg), r"expert_out has 1 entries; expected one per rank"),
    (lambda cfg, d, ys, ws: ref.combine(ys, d, [w[:, :1] for w in ws], cfg),
     r"topk_weights\[0\] has shape \(16, 1\); expected \[N, top_k=2\]"),
    (lambda cfg, d, ys, ws: ref.combine(ys, ys, ws, cfg), r"dispatched\[0\] must be a Dispatched, got ndarray"),
    (lambda cfg, d, ys, ws: ref.combine([y.astype(np.float16) for y in ys], d, ws, cfg),
     r"expert_out\[0\] has dtype float16; expected float32 or bfloat16"),
], ids=["weights-float64", "eo-too-few-rows", "eo-list-short", "weights-shape", "not-dispatched", "eo-float16"])
def test_reference_combine_mistakes(inputs, mistake, match):
    cfg, xs, ids, ws = inputs
    d = ref.dispatch(xs, ids, cfg)
    ys = [np.zeros((di.n_rows, 256), BF16) for di in d]
    with pytest.raises(ValueError, match=match):
        mistake(cfg, d, ys, ws)


@pytest.mark.parametrize("mistake, match", [
    (lambda: ref.quantize(np.zeros((2, 256), np.float32), "fp16"), r"fmt='fp16' is not a wire format"),
    (lambda: ref.quantize([[1.0] * 128], "fp8"), r"x must be a numpy array, got list"),
    (lambda: ref.quantize(np.zeros((2, 256), np.float64), "fp8"), r"x must be float32 or bfloat16, got dtype float64"),
    (lambda: ref.quantize(np.zeros(256, np.float32), "fp8"), r"x must be 2-D \[N, H\], got shape \(256,\)"),
    (lambda: ref.fused_silu(np.zeros((4, 3), np.float32), np.array([0, 4])), r"h has shape \(4, 3\); expected"),
    (lambda: ref.fused_silu(np.zeros((4, 16), np.float32), np.array([0, 5])),
     r"row_offsets\[-1\]=5 exceeds the rows of h \(4\)"),
    (lambda: ref.swizzle_block_scales(np.zeros((4, 8), np.uint8), np.array([0, 4]), "fp8", 128),
     r"fmt='fp8' has no swizzled block scales"),
], ids=["fmt", "list", "float64", "1-D", "silu-odd", "silu-ro", "swizzle-fmt"])
def test_reference_ops_mistakes(mistake, match):
    with pytest.raises(ValueError, match=match):
        mistake()


# ---- launcher variables and machines without a GPU -------------------------------------------------------------
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUEP_STORE_PORT",
                "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.fixture
def clean_env(monkeypatch):
    for v in _LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_init_distributed_without_launcher_names_the_variables_and_the_launcher(clean_env):
    with pytest.raises(ValueError, match=r"RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set.*"
                                         r"python -m cuep\.run -n N"):
        cuep.init_distributed()


@pytest.mark.parametrize("env, match", [
    (dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"), r"MASTER_PORT is not set.*python -m cuep\.run"),
    (dict(RANK="zero", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
     r"environment variable RANK='zero' is not an integer"),
    (dict(RANK="2", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
     r"RANK=2 must be in 0\.\.1 \(WORLD_SIZE=2\)"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="99999"), r"MASTER_PORT='99999' is not a "
                                                                                   r"TCP port"),
    (dict(RANK="0", WORLD_SIZE="9", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", gpus_per_node=9),
     r"gpus_per_node=9.*8"),
], ids=["no-port", "rank-not-int", "rank-too-big", "bad-port", "node-too-big"])
def test_init_distributed_bad_variables(clean_env, env, match):
    env = dict(env)
    kw = {"gpus_per_node": env.pop("gpus_per_node")} if "gpus_per_node" in env else {}
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        cuep.init_distributed(**kw)


@pytest.fixture
def no_gpu(monkeypatch):
    import cupy

    monkeypatch.setattr(cupy.cuda, "is_available", lambda: False)


def test_init_without_gpu_points_to_the_reference(no_gpu):
    with pytest.raises(RuntimeError, match=r"cuep\.init needs an NVIDIA GPU.*none is visible.*cuep\.reference"):
        cuep.init()


def test_init_distributed_without_gpu_points_to_the_reference(no_gpu, clean_env):
    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        clean_env.setenv(k, v)
    with pytest.raises(RuntimeError, match=r"cuep\.init_distributed needs an NVIDIA GPU.*cuep\.reference"):
        cuep.init_distributed()


@pytest.mark.parametrize("devices", [0, "0", [0, "1"], [0.0]])
def test_init_devices_must_be_a_list_of_ids(devices):
    with pytest.raises(TypeError, match=r"devices.*must .*CUDA device ids, e\.g\. \[0, 1\]"):
        cuep.init(devices)


# ---- checks that run before any device is touched ------------------------------------------------------------------
def _group(n_ranks: int = 2) -> cuep.Group:
    """A group as cuep.init would return it; Buffer's argument checks run before it touches a device."""
    return cuep.Group(devices=[0] * n_ranks, ranks=list(range(n_ranks)), n_ranks=n_ranks)


@pytest.mark.parametrize("make, exc, match", [
    (lambda cfg: cuep.Buffer(cfg, _group()), TypeError, r"group must be a cuep\.Group .*got EPConfig"),
    (lambda cfg: cuep.Buffer(_group(), None), TypeError, r"cfg must be a cuep\.EPConfig, got NoneType"),
    (lambda cfg: cuep.Buffer(_group(3), cfg), ValueError, r"cfg\.n_ranks=2 .*must equal the group's 3 ranks"),
    (lambda cfg: cuep.Buffer(cuep.Group(devices=[0], ranks=[0], n_ranks=2, kind="ipc", gpus_per_node=1), cfg),
     ValueError, r"cfg\.n_gpus_per_node=2 \(n_nodes=1\), but the group is 2 node\(s\) of 1 rank\(s\): build the "
                 r"EPConfig with n_gpus_per_node=1, n_nodes=2"),
    (lambda cfg: cuep.Buffer(_group(), cfg, timeout_s=0), ValueError, r"timeout_s=0 must be a positive number"),
    (lambda cfg: cuep.Buffer(_group(), cfg, timeout_s="5"), ValueError, r"timeout_s='5' must be a positive"),
    (lambda cfg: cuep.Buffer(_group(), cuep.EPConfig(**{**STD, "top_k": 33, "n_experts": 64})), ValueError,
     r"top_k=33 exceeds the kernels' limit of 32"),
    (lambda cfg: cuep.Buffer(_group(), cuep.EPConfig(**{**STD, "n_gpus_per_node": 1, "n_nodes": 2})),
     RuntimeError, r"n_nodes=2: several nodes need one process per rank"),
], ids=["swapped", "cfg-none", "n-ranks", "node-layout", "timeout-0", "timeout-str", "top-k", "n-nodes"])
def test_buffer_mistakes_before_the_gpu(make, exc, match):
    with pytest.raises(exc, match=match):
        make(cuep.EPConfig(**STD))


def test_buffer_on_a_closed_group():
    g = _group()
    g.close()
    with pytest.raises(RuntimeError, match=r"group was closed \(group\.close\(\)\); create a new one"):
        cuep.Buffer(g, cuep.EPConfig(**STD))


def _closed_buffer() -> cuep.Buffer:
    buf = object.__new__(cuep.Buffer)  # what buf.close() leaves behind, without allocating on a GPU
    buf.close()
    return buf


@pytest.mark.parametrize("call", [
    lambda b: cuep.dispatch(b, [], []), lambda b: cuep.dispatch_async(b, [], []),
    lambda b: cuep.combine(b, [], []), lambda b: cuep.combine_async(b, [], []), lambda b: cuep.combine_wait(b, [], []),
    lambda b: b.check(), lambda b: b.synchronize(), lambda b: b.reset(), lambda b: moe.moe_forward(b, [], []),
], ids=["dispatch", "dispatch_async", "combine", "combine_async", "combine_wait", "check", "synchronize", "reset",
        "moe_forward"])
def test_closed_buffer_refuses_every_call(call):
    buf = _closed_buffer()
    assert buf.closed
    with pytest.raises(RuntimeError, match=r"cuep\.Buffer was closed \(buf\.close\(\)\).*new cuep\.Buffer"):
        call(buf)


@pytest.mark.parametrize("call, name", [
    (lambda x: cuep.dispatch(x, [x], [x]), "cuep.dispatch"), (lambda x: cuep.dispatch_async(x, x, x), "cuep.dispatch"),
    (lambda x: cuep.combine(x, x, x), "cuep.combine"), (lambda x: cuep.combine_wait(x, x, x), "cuep.combine"),
    (lambda x: moe.moe_forward(x, x, x), "moe_forward"),
], ids=["dispatch", "dispatch_async", "combine", "combine_wait", "moe_forward"])
def test_buffer_left_out(call, name):
    """cuep.dispatch(x, topk_ids, topk_weights): the Buffer is missing."""
    x = np.zeros((4, 256), BF16)
    with pytest.raises(TypeError, match=rf"{re.escape(name)}: the first argument must be the cuep\.Buffer .*got "
                                        rf"ndarray"):
        call(x)


def test_dispatch_wait_takes_what_dispatch_async_returned():
    with pytest.raises(TypeError, match=r"dispatch_wait takes what dispatch_async returned .*got ndarray"):
        cuep.dispatch_wait(np.zeros(3))


def test_numpy_where_cupy_belongs_says_cupy_asarray():
    from cuep.ep import _bf16, _check_array

    with pytest.raises(TypeError, match=r"x\[rank 1\] is a numpy\.ndarray \(host memory\); pass a CuPy array on "
                                        r"GPU 3: `with cupy\.cuda\.Device\(3\): x = cupy\.asarray\(\.\.\.\)`"):
        _check_array(np.zeros((4, 256), BF16), "x[rank 1]", 3, (_bf16(),), 2)
    with pytest.raises(TypeError, match=r"topk_ids\[rank 0\] must be a cupy\.ndarray on GPU 0, got list"):
        _check_array([[0, 1]], "topk_ids[rank 0]", 0, (np.dtype(np.int32),), 2)


@pytest.mark.parametrize("call, arg", [
    (lambda: ops.quantize(np.ones((2, 128), np.float32), "fp8"), "x"),
    (lambda: ops.dequantize(np.zeros((2, 128), np.uint8), np.zeros((2, 4), np.uint8), "fp8", 128), "payload"),
    (lambda: ops.swizzle_block_scales(np.zeros((2, 8), np.uint8), np.zeros(2, np.int32), "nvfp4", 128), "scales"),
    (lambda: ops.fused_silu(np.ones((2, 256), np.float32), np.array([0, 2], np.int32)), "h"),
], ids=["quantize", "dequantize", "swizzle", "fused_silu"])
def test_ops_numpy_inputs_say_cupy_asarray(call, arg):
    with pytest.raises(TypeError, match=rf"^{arg} must be a cupy\.ndarray, got numpy\.ndarray \(host memory\): .*"
                                        rf"cupy\.asarray"):
        call()


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(devices=0), TypeError, r"devices must be a list of CUDA device ids, one per rank"),
    (dict(devices=[0]), ValueError, r"devices has 1 entries; expected one per rank \(2\)"),
    (dict(intermediate=100), ValueError, r"intermediate=100 must be a positive multiple of 8"),
])
def test_init_weights_mistakes(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        moe.init_weights(cuep.EPConfig(**STD), **{"intermediate": 64, **kwargs})
