"""The short host path of an eager call (ep._dispatch_single, ep._combine_single) against the general one, without
a GPU: CuPy arrays are stand-ins with the fields the checks read, launches are recorded instead of run.

For every case the short path must launch the same kernel with the same parameter bytes and leave the buffer's
round state as the general path does; wherever it cannot (a wrong argument, a failed or closed buffer, a half
pending, another current device) it must do nothing and hand the call to the general path, which raises with its
message or handles the case.
"""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cuep import _kernels, ep, params
from cuep.buffer import Buffer, _Rank
from cuep.config import EPConfig

BF16 = np.dtype(ml_dtypes.bfloat16)
H, K, E, T = 256, 2, 8, 64


def _stand_ins():
    spec = importlib.util.spec_from_file_location("host_python", Path(__file__).parents[1] / "benchmarks" /
                                                  "host_python.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_hp = _stand_ins()  # benchmarks/host_python.py: the stand-in arrays, runtime and cupy module
FakeArray, _Runtime = _hp.StandIn, _hp.StandInRuntime


@pytest.fixture
def launches(monkeypatch):
    """Stand-in CuPy for cuep.ep; every launch recorded as (kernel name, grid, block, smem, parameter bytes)."""
    monkeypatch.setattr(ep, "_cupy", _hp.STAND_IN_CUPY)
    monkeypatch.setattr(ep, "_ND", FakeArray)
    monkeypatch.setattr(ep, "_runtime", _Runtime)
    monkeypatch.setattr(_Runtime, "device", 0)
    names = {}

    def kernel(name, smem):
        fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=len(names) + 1))
        names[fn.kernel.ptr] = name
        return fn

    monkeypatch.setattr(ep, "_kernel", kernel)
    monkeypatch.setattr(_kernels, "_launch_raw", lambda *a: None)
    log = []
    launch_call = _kernels.PreparedLaunch.launch_call

    def record(self, grid, *values):
        launch_call(self, grid, *values)
        log.append((names[self.func], grid, self.block, self.smem, bytes(self.raw)))

    monkeypatch.setattr(_kernels.PreparedLaunch, "launch_call", record)
    return log


def make_buffer(fmt: str = "bf16", ranks: int = 1, small: int | None = None) -> Buffer:
    cfg = EPConfig(hidden=H, top_k=K, n_experts=E, n_gpus_per_node=ranks, max_tokens_per_rank=T,
                   dispatch_format=fmt, small_batch_tokens=small)
    buf = object.__new__(Buffer)
    buf.group = types.SimpleNamespace(kind="local", shares_devices=False, phase_barrier=False, devices=[0],
                                      ranks=[0])
    buf.cfg, buf.timeout_s, buf.num_sms = cfg, 5.0, 4
    buf._launch_cache = {("dispatch", True): (256, 4096), ("dispatch", False): (256, 4096)}
    buf._launched, buf._rounds = set(), {"dispatches": 0, "pending": None, "local": False}
    err = np.zeros(4, np.int32)

    def a(*shape):
        return FakeArray(shape, np.uint8)

    r = _Rank(rank=0, device=0, mem=None, params=np.zeros(1, params.EP_PARAMS_DTYPE), err_host=err, err_host_ptr=0,
              tokens=a(8, 8), scales=a(8), row_offsets=a(8), expert_ids=a(8), scales_offsets=a(8), src_info=a(8),
              row_src=a(8), row_weight=a(8), msg_rows=a(8), msg_token=a(8), msg_j=a(8), msg_count=a(8),
              err_status=memoryview(err).cast("B").cast("i"))
    r.combined = FakeArray((T, H), BF16)
    r.combined_unreduced = FakeArray((T, K, H), BF16)
    buf._ranks = [r]
    return buf


def inputs(n: int, weights: bool = True, dtype=BF16):
    return (FakeArray((n, H), dtype), FakeArray((n, K), np.int32),
            FakeArray((n, K), np.float32) if weights else None)


def state(buf: Buffer, d) -> tuple:
    fields = None if d is None else (d.num_tokens, d._has_weights, d._seq, d._topk_ids is not None, d.rank)
    return dict(buf._rounds), fields


def both_paths(buf: Buffer, general, short, launches: list) -> tuple:
    """Run ``general`` then, from the same round state, ``short`` on ``buf``: (their results, their launches, the
    round state each left)."""
    before = dict(buf._rounds)
    launches.clear()
    r_general = general()
    after_general, launched_general = dict(buf._rounds), list(launches)
    buf._rounds.clear()
    buf._rounds.update(before)
    launches.clear()
    r_short = short()
    return (r_general, r_short), (launched_general, list(launches)), (after_general, dict(buf._rounds))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("ranks, small", [(1, None), (1, 16), (2, None)])
@pytest.mark.parametrize("n", [1, 16, 64])
@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_short_dispatch_launches_what_the_general_path_does(launches, fmt, ranks, small, n, weights, dtype):
    x, ids, w = inputs(n, weights, dtype)
    for phases in (ep._PHASES_ALL, ep.PHASE_NOTIFY | ep.PHASE_SEND):
        buf = make_buffer(fmt, ranks, small)
        buf._launch_cache["host"] = ep._host(buf)
        assert ep._dispatch_single(buf, x, ids, w, 1.0, phases) is None  # no launch prepared yet: general path
        ep._dispatch(buf, x, ids, w, 1.0, phases)
        buf._rounds["pending"] = None
        (d_general, d_short), (l_general, l_short), (s_general, s_short) = both_paths(
            buf, lambda: ep._dispatch(buf, x, ids, w, 0.5, phases)[0],
            lambda: ep._dispatch_single(buf, x, ids, w, 0.5, phases), launches)
        assert d_short is not None and len(l_general) == len(l_short) == 1
        assert l_general == l_short and s_general == s_short
        assert d_short == d_general  # every field (dataclass equality), the buffer and topk_ids included


@pytest.mark.parametrize("weights_at_dispatch", [True, False])
@pytest.mark.parametrize("combine_weights, residual", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("ranks", [1, 2])
def test_short_combine_launches_what_the_general_path_does(launches, weights_at_dispatch, combine_weights, residual,
                                                          ranks):
    n = 16
    if residual and not (combine_weights or weights_at_dispatch):
        return
    x, ids, w = inputs(n, weights_at_dispatch)
    cw = FakeArray((n, K), np.float32) if combine_weights else None
    res = FakeArray((n, H), BF16) if residual else None
    buf = make_buffer("bf16", ranks)
    d = ep._dispatch(buf, x, ids, w, 1.0, ep._PHASES_ALL)[0]
    eo = FakeArray((buf.cfg.capacity, H), BF16)
    ep._combine(buf, eo, d, cw, res, ep._PHASES_ALL)  # the general path makes the output view and launches once
    ep._combine(buf, eo, d, cw, res, ep.PHASE_NOTIFY | ep.PHASE_SEND)
    ep._combine(buf, eo, d, cw, res, ep.PHASE_RECV)
    for phases in (ep._PHASES_ALL, ep.PHASE_NOTIFY | ep.PHASE_SEND, ep.PHASE_RECV):
        (o_general, o_short), (l_general, l_short), (s_general, s_short) = both_paths(
            buf, lambda: ep._combine(buf, eo, d, cw, res, phases)[0],
            lambda: ep._combine_single(buf, eo, d, cw, res, phases), launches)
        assert o_short is o_general
        assert l_general == l_short and s_general == s_short
        # one-rank rounds: combine_async has nothing to send; otherwise every half launches
        assert len(l_short) == (0 if ranks == 1 and phases == ep.PHASE_NOTIFY | ep.PHASE_SEND else 1)


def test_short_paths_leave_every_other_case_to_the_general_path(launches):
    buf = make_buffer("bf16")
    x, ids, w = inputs(8)
    d = ep._dispatch(buf, x, ids, w, 1.0, ep._PHASES_ALL)[0]
    eo = FakeArray((buf.cfg.capacity, H), BF16)
    ep._combine(buf, eo, d, None, None, ep._PHASES_ALL)
    launches.clear()
    before = dict(buf._rounds)
    all_ = ep._PHASES_ALL
    bad_dispatch = [
        (FakeArray((8, H), np.float16), ids, w, 1.0),               # dtype
        (FakeArray((8, H + 8), BF16), ids, w, 1.0),                  # hidden
        (FakeArray((8, H), BF16, offset=8), ids, w, 1.0),           # alignment
        (FakeArray((8, H), BF16, contiguous=False), ids, w, 1.0),   # strides
        (FakeArray((8, H), BF16, device=1), ids, w, 1.0),           # device
        (FakeArray((T + 1, H), BF16), FakeArray((T + 1, K), np.int32), None, 1.0),  # too many tokens
        (FakeArray((0, H), BF16), FakeArray((0, K), np.int32), None, 1.0),         # no tokens
        (x, FakeArray((8, K + 1), np.int32), w, 1.0),                # ids shape
        (x, FakeArray((8, K), np.int64), w, 1.0),                    # ids dtype
        (x, FakeArray((7, K), np.int32), w, 1.0),                    # ids rows
        (x, ids, FakeArray((8, K), np.float64), 1.0),                # weights dtype
        (x, ids, FakeArray((8, K), np.float32, offset=2), 1.0),     # weights alignment
        (x, ids, w, 0.0), (x, ids, w, 2.0 ** 101), (x, ids, w, 1),   # global scale (an int: general path)
        ([x], [ids], [w], 1.0),                                      # lists
    ]
    for args in bad_dispatch:
        assert ep._dispatch_single(buf, *args, all_) is None
    for args in bad_dispatch[:6] + bad_dispatch[7:-3]:  # the wrong ones: the general path names what is wrong
        with pytest.raises((TypeError, ValueError), match="x|topk|global_scale"):
            ep._dispatch(buf, *args, all_)
    bad_combine = [
        (FakeArray((buf.cfg.capacity - 1, H), BF16), d, None, None),  # rows
        (FakeArray((buf.cfg.capacity, H), np.float32), d, None, None),  # dtype
        (eo, d, FakeArray((8, K), np.float32), FakeArray((8, H + 8), BF16)),  # residual shape
        (eo, d, None, FakeArray((8, H), np.float32)),                   # residual dtype
        (eo, d, FakeArray((9, K), np.float32), None),                   # weights rows
        (eo, [d], None, None), (eo, "d", None, None),                   # not a Dispatched
    ]
    for args in bad_combine:
        assert ep._combine_single(buf, *args, all_) is None
    for args in bad_combine[:-2] + bad_combine[-1:]:  # ([d] is right: a list of one rank's result)
        with pytest.raises((TypeError, ValueError), match="expert_out|dispatched|topk_weights|residual"):
            ep._combine(buf, *args, all_)
    unweighted = make_buffer("bf16")
    d2 = ep._dispatch(unweighted, x, ids, None, 1.0, all_)[0]
    ep._combine(unweighted, eo, d2, None, None, all_)
    residual = FakeArray((8, H), BF16)  # a residual needs weights (at dispatch or here)
    assert ep._combine_single(unweighted, eo, d2, None, residual, all_) is None
    with pytest.raises(ValueError, match="residual"):
        ep._combine(unweighted, eo, d2, None, residual, all_)
    launches.clear()
    assert ep._combine_single(buf, eo, d, None, None, ep.PHASE_RECV) is None  # no combine_async pending
    _Runtime.device = 1
    assert ep._dispatch_single(buf, x, ids, w, 1.0, all_) is None
    assert ep._combine_single(buf, eo, d, None, None, all_) is None
    _Runtime.device = 0
    buf._ranks[0].err_host[0] = 2  # a kernel reported a failure
    assert ep._dispatch_single(buf, x, ids, w, 1.0, all_) is None
    assert ep._combine_single(buf, eo, d, None, None, all_) is None
    buf._ranks[0].err_host[0] = 0
    buf._host_error = RuntimeError("a peer did not arrive")
    assert ep._dispatch_single(buf, x, ids, w, 1.0, all_) is None
    del buf._host_error
    buf._rounds["pending"] = ("dispatch", 1)
    assert ep._dispatch_single(buf, x, ids, w, 1.0, all_) is None
    assert ep._combine_single(buf, eo, d, None, None, all_) is None
    buf._rounds["pending"] = None
    other = make_buffer("bf16")
    assert ep._combine_single(other, eo, d, None, None, all_) is None  # d belongs to buf
    buf._closed = True
    assert ep._dispatch_single(buf, x, ids, w, 1.0, all_) is None
    del buf._closed
    assert launches == [] and buf._rounds == before
    assert ep._dispatch_single(buf, x, ids, w, 1.0, all_) is not None and len(launches) == 1  # and now it may
