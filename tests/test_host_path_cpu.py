"""The short host path of an eager call (ep._dispatch_single, ep._combine_single) against the general one, without
a GPU: CuPy arrays are stand-ins with the fields the checks read, launches are recorded instead of run. The torch
short paths (ep._dispatch_single_torch, ep._combine_single_torch, dispatch_wait's, ops._quantize_torch,
ops._fused_silu_torch) against the CuPy ones, with a stand-in torch module whose tensors have the stand-in arrays'
addresses.

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
    """Stand-in CuPy for cuep.ep; every launch recorded as (kernel name, grid, block, smem, parameter bytes, whether
    a programmatic dependent launch)."""
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
    log = []
    by_argv = {}
    init = _kernels.PreparedLaunch.__init__

    def register(self, *a, **kw):  # (each prepared launch by its argument array's address)
        init(self, *a, **kw)
        by_argv[self.argv_ptr] = self

    monkeypatch.setattr(_kernels.PreparedLaunch, "__init__", register)
    STREAMS.clear()

    def launch_raw(func, grid, block, smem, argv_ptr, stream=None, device=-1, dependent=None):  # (torch: stream)
        log.append((names[func], grid, block, smem, bytes(by_argv[argv_ptr].raw), dependent is not None))
        if stream is not None:
            STREAMS.append(stream)

    monkeypatch.setattr(_kernels, "_launch_raw", launch_raw)
    return log


STREAMS: list = []  # the stream handle of each recorded torch launch


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
        # a fused one-rank call takes a one-rank kernel, launched as a programmatic dependent; no other launch is
        name, dependent = l_short[0][0], l_short[0][5]
        assert ("_local_" in name) == dependent == (ranks == 1 and phases == ep._PHASES_ALL)


def combine_inputs(n: int, weights_at_dispatch: bool, combine_weights: bool, residual: bool) -> tuple:
    """(x, topk_ids, dispatch weights, combine weights, residual) of a combine case (the cases give a residual
    only with combine weights)."""
    x, ids, w = inputs(n, weights_at_dispatch)
    cw = FakeArray((n, K), np.float32) if combine_weights else None
    res = FakeArray((n, H), BF16) if residual else None
    return x, ids, w, cw, res


@pytest.mark.parametrize("weights_at_dispatch", [True, False])
@pytest.mark.parametrize("combine_weights, residual", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("ranks", [1, 2])
def test_short_combine_launches_what_the_general_path_does(launches, weights_at_dispatch, combine_weights, residual,
                                                          ranks):
    x, ids, w, cw, res = combine_inputs(16, weights_at_dispatch, combine_weights, residual)
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
        # the one-rank combine (after a fused one-rank dispatch) is a programmatic dependent, the protocol's not
        assert all(("_local_" in name) == dependent == (ranks == 1) for name, *_, dependent in l_short)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_short_dispatch_wait_launches_what_the_general_path_does(launches, fmt, ranks):
    x, ids, w = inputs(16)
    buf = make_buffer(fmt, ranks)
    send = ep.PHASE_NOTIFY | ep.PHASE_SEND
    ep._dispatch_wait_general.__wrapped__(ep._dispatch(buf, x, ids, w, 1.0, send)[0])
    d = ep._dispatch(buf, x, ids, w, 1.0, send)[0]
    (r_general, r_short), (l_general, l_short), (s_general, s_short) = both_paths(
        buf, lambda: ep._dispatch_wait_general.__wrapped__(d), lambda: ep._dispatch_wait_single(d, False), launches)
    assert r_general is r_short is d and len(l_short) == 1 and l_general == l_short and s_general == s_short
    assert s_short["pending"] is None
    # nothing pending, an earlier dispatch's result, a torch call's flag, another current device, a failed buffer
    assert ep._dispatch_wait_single(d, False) is NotImplemented
    ep._dispatch(buf, x, ids, w, 1.0, send)
    assert ep._dispatch_wait_single(d, False) is NotImplemented
    buf._rounds["pending"] = None
    d = ep._dispatch_single(buf, x, ids, w, 1.0, send)
    launches.clear()
    assert ep._dispatch_wait_single(d, True) is NotImplemented
    _Runtime.device = 1
    assert ep._dispatch_wait_single(d, False) is NotImplemented
    _Runtime.device = 0
    host = ep._host(buf)
    host.status[0] = 1
    assert ep._dispatch_wait_single(d, False) is NotImplemented
    host.status[0] = 0
    assert launches == [] and buf._rounds["pending"] is not None
    assert ep._dispatch_wait_single(d, False) is d and len(launches) == 1 and buf._rounds["pending"] is None


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
        (FakeArray((), BF16), ids, w, 1.0),                          # 0-d (no len(): the general path says so)
        (FakeArray((8, H, 1), BF16), ids, w, 1.0),                   # 3-d
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
    for args in bad_dispatch[:8] + bad_dispatch[9:-3]:  # the wrong ones: the general path names what is wrong
        with pytest.raises((TypeError, ValueError), match="x|topk|global_scale"):
            ep._dispatch(buf, *args, all_)
    bad_combine = [
        (FakeArray((), BF16), d, None, None),                            # 0-d
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


# ---- the torch short path -----------------------------------------------------------------------------------------
class _TorchDtype:
    def __init__(self, name: str):
        self.name = name


def _fake_torch() -> types.ModuleType:
    """What the torch short path reads of torch: Tensor, strided, dtypes, the current stream's handle."""
    torch = types.ModuleType("torch")
    for name in ("bfloat16", "float32", "float16", "int32", "int64", "uint8"):
        setattr(torch, name, _TorchDtype(name))
    torch.strided, torch.sparse_coo = object(), object()

    class Tensor:
        def __init__(self, like, dtype, *, device: int = 0, contiguous: bool = True, layout=None, offset: int = 0):
            self.shape, self.dtype, self.device_index = tuple(like.shape), dtype, device
            self.ptr, self.contiguous = like.data.ptr + offset, contiguous
            self.layout = torch.strided if layout is None else layout

        def dim(self) -> int:
            return len(self.shape)

        def size(self, i: int) -> int:
            return self.shape[i]

        def is_contiguous(self) -> bool:
            return self.contiguous

        @property
        def is_cuda(self) -> bool:
            return self.device_index >= 0

        def get_device(self) -> int:
            return self.device_index

        def data_ptr(self) -> int:
            return self.ptr

    torch.Tensor = Tensor
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda dev: 0x5000 + dev)
    torch.device = lambda kind, index: (kind, index)
    torch.made = []  # the stand-in arrays behind each torch.empty

    def empty(shape, dtype, device):
        assert device == ("cuda", 0)
        a = FakeArray(shape, np.uint8)
        torch.made.append(a)
        return Tensor(a, dtype)

    torch.empty = empty
    return torch


@pytest.fixture
def torch(monkeypatch, launches):
    """A stand-in torch in sys.modules; the buffer's torch views are markers (no real tensors here)."""
    import sys

    from cuep import interop

    fake = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(interop, "_bindings", [None])
    monkeypatch.setattr(interop, "_persistent_view", lambda r, attr: None if getattr(r, attr) is None
                        else ("torch view", attr))
    monkeypatch.setattr(interop, "_buffer_view", lambda buf, a: ("torch view of", a))
    return fake


def as_tensors(torch, *arrays):
    kinds = {BF16: torch.bfloat16, np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}
    return tuple(None if a is None else torch.Tensor(a, kinds[a.dtype]) for a in arrays)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("small", [None, 16])
@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_torch_dispatch_launches_what_the_cupy_path_does(launches, torch, fmt, small, n, weights, dtype):
    x, ids, w = inputs(n, weights, dtype)
    tx, tids, tw = as_tensors(torch, x, ids, w)
    for phases in (ep._PHASES_ALL, ep.PHASE_NOTIFY | ep.PHASE_SEND):
        buf = make_buffer(fmt, 1, small)
        ep._dispatch(buf, x, ids, w, 1.0, phases)  # prepares the launch
        buf._rounds["pending"] = None
        (d_cupy, d_torch), (l_cupy, l_torch), (s_cupy, s_torch) = both_paths(
            buf, lambda: ep._dispatch_single(buf, x, ids, w, 0.5, phases),
            lambda: ep._dispatch_single_torch(buf, tx, tids, tw, 0.5, phases), launches)
        assert d_torch is not None and len(l_torch) == 1 and l_cupy == l_torch and s_cupy == s_torch
        assert STREAMS == [0x5000]  # torch's current stream of device 0
        assert d_torch._torch and d_torch._topk_ids is tids and d_torch.tokens == ("torch view", "tokens")
        assert (d_torch.num_tokens, d_torch._has_weights, d_torch._seq, d_torch.rank) == \
            (d_cupy.num_tokens, d_cupy._has_weights, d_cupy._seq, d_cupy.rank)
        STREAMS.clear()
        if phases != ep._PHASES_ALL:  # the wait half: the receive launch, on torch's stream
            (w_cupy, w_torch), (l_cupy, l_torch), (s_cupy, s_torch) = both_paths(
                buf, lambda: ep._dispatch_wait_general.__wrapped__(d_cupy), lambda: ep._dispatch_wait_torch(d_torch),
                launches)
            assert w_torch is d_torch and len(l_torch) == 1 and l_cupy == l_torch and s_cupy == s_torch
            assert STREAMS == [0x5000]
            STREAMS.clear()


@pytest.mark.parametrize("weights_at_dispatch", [True, False])
@pytest.mark.parametrize("combine_weights, residual", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("local", [True, False])
def test_torch_combine_launches_what_the_cupy_path_does(launches, torch, weights_at_dispatch, combine_weights,
                                                        residual, local):
    x, ids, w, cw, res = combine_inputs(16, weights_at_dispatch, combine_weights, residual)
    buf = make_buffer("bf16", 1)
    eo = FakeArray((buf.cfg.capacity, H), BF16)
    teo, tcw, tres, tids = as_tensors(torch, eo, cw, res, ids)
    phases = ep._PHASES_ALL if local else ep.PHASE_NOTIFY | ep.PHASE_SEND  # a one-rank round, or the protocol's
    d = ep._dispatch(buf, x, ids, w, 1.0, phases)[0]
    if not local:
        ep._dispatch_wait_general.__wrapped__(d)
    d._topk_ids = tids  # as the torch dispatch leaves it (the CuPy one's address: the same launch)
    ep._combine(buf, eo, d, cw, res, ep._PHASES_ALL)  # prepares the launches and the output view
    ep._combine(buf, eo, d, cw, res, ep.PHASE_NOTIFY | ep.PHASE_SEND)
    ep._combine(buf, eo, d, cw, res, ep.PHASE_RECV)
    for ph in (ep._PHASES_ALL, ep.PHASE_NOTIFY | ep.PHASE_SEND, ep.PHASE_RECV):
        if ph == ep.PHASE_RECV:  # its combine_async pending, as both paths leave it
            ep._combine_single(buf, eo, d, cw, res, ep.PHASE_NOTIFY | ep.PHASE_SEND)
        STREAMS.clear()
        (o_cupy, o_torch), (l_cupy, l_torch), (s_cupy, s_torch) = both_paths(
            buf, lambda: ep._combine_single(buf, eo, d, cw, res, ph),
            lambda: ep._combine_single_torch(buf, teo, d, tcw, tres, ph), launches)
        assert o_torch == ("torch view of", o_cupy)
        assert l_cupy == l_torch and s_cupy == s_torch
        assert len(l_torch) == (0 if local and ph == ep.PHASE_NOTIFY | ep.PHASE_SEND else 1)
        assert STREAMS == [0x5000] * len(l_torch)


def test_torch_short_path_leaves_every_other_case_to_torch_mode(launches, torch):
    buf = make_buffer("bf16")
    x, ids, w = inputs(8)
    tx, tids, tw = as_tensors(torch, x, ids, w)
    all_ = ep._PHASES_ALL
    assert ep._dispatch_single_torch(buf, tx, tids, tw, 1.0, all_) is None  # nothing prepared yet
    d = ep._dispatch(buf, x, ids, w, 1.0, all_)[0]
    eo = FakeArray((buf.cfg.capacity, H), BF16)
    ep._combine(buf, eo, d, None, None, all_)
    (teo,) = as_tensors(torch, eo)
    launches.clear()
    before = dict(buf._rounds)
    T = torch.Tensor
    bad_dispatch = [
        (T(x, torch.float16), tids, tw, 1.0),                     # dtype
        (T(x, torch.bfloat16, contiguous=False), tids, tw, 1.0),  # strides
        (T(x, torch.bfloat16, device=1), tids, tw, 1.0),          # device
        (T(x, torch.bfloat16, device=-1), tids, tw, 1.0),         # on the CPU
        (T(x, torch.bfloat16, layout=torch.sparse_coo), tids, tw, 1.0),  # layout
        (T(x, torch.bfloat16, offset=8), tids, tw, 1.0),          # alignment
        (tx, T(ids, torch.int64), tw, 1.0),                       # ids dtype
        (tx, tids, T(w, torch.float32, offset=2), 1.0),           # weights alignment
        (tx, ids, tw, 1.0), (x, tids, tw, 1.0),                   # a CuPy array among tensors
        ([tx], [tids], [tw], 1.0),                                # lists
        (tx, tids, tw, 0.0), (tx, tids, tw, 1),                   # global scale
    ]
    for args in bad_dispatch:
        assert ep._dispatch_single_torch(buf, *args, all_) is None
    assert ep._dispatch_torch(buf, tx, tids, tw, 1.0, True) is NotImplemented
    for args in [(T(eo, torch.float32), d, None, None), (teo, d, T(w, torch.float32, device=1), None),
                 (eo, d, None, None), (teo, [d], None, None)]:
        assert ep._combine_single_torch(buf, *args, all_) is None
    assert ep._combine_single_torch(buf, teo, d, None, None, ep.PHASE_RECV) is None  # no combine_async pending
    assert ep._dispatch_wait_torch(d) is NotImplemented  # not a torch result, nothing pending
    _Runtime.device = 1
    assert ep._dispatch_single_torch(buf, tx, tids, tw, 1.0, all_) is None
    assert ep._combine_single_torch(buf, teo, d, None, None, all_) is None
    _Runtime.device = 0
    assert launches == [] and buf._rounds == before
    assert ep._dispatch_single_torch(buf, tx, tids, tw, 1.0, all_) is not None and STREAMS == [0x5000]


@pytest.fixture
def ops_launches(monkeypatch, torch):
    """cuep.ops on stand-ins: every launch recorded as (grid, block, smem, parameter bytes, stream: None for CuPy's
    current one)."""
    from cuep import ops

    monkeypatch.setattr(ops, "_cupy", _hp.STAND_IN_CUPY)
    monkeypatch.setattr(ops, "_ND", FakeArray)
    monkeypatch.setattr(ops, "_runtime", _Runtime)
    monkeypatch.setattr(ep, "_ND", FakeArray)  # (ops' short paths test arguments with ep._rows_ptr)
    monkeypatch.setattr(ops, "_quantize_plans", {})
    monkeypatch.setattr(ops, "_silu_plans", {})
    monkeypatch.setattr(ops, "_dequantize_plans", {})
    monkeypatch.setattr(ops, "_swizzle_plans", {})
    by_argv = {}

    made = {}

    def prepare(filename, name, sig, dev, smem=0, threads=ops._THREADS):  # (once per kernel, as ops._prepare)
        key = (filename, name, dev, smem)
        if key not in made:
            fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=len(by_argv) + 1))
            launch = _kernels.PreparedLaunch(fn, threads, smem, 8 * len(sig), tuple(range(0, 8 * len(sig), 8)),
                                             _kernels.slot_struct(sig))
            by_argv[launch.argv_ptr] = made[key] = launch
        return made[key], 64

    monkeypatch.setattr(ops, "_prepare", prepare)
    log = []

    def launch_raw(func, grid, block, smem, argv_ptr, stream=None, device=-1, dependent=None):
        assert dependent is None  # (the ops' kernels are launched the plain way)
        log.append((func, grid, block, smem, bytes(by_argv[argv_ptr].raw), stream))

    monkeypatch.setattr(_kernels, "_launch_raw", launch_raw)
    return ops, log


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("given", [True, False])
def test_torch_quantize_launches_what_the_cupy_path_does(ops_launches, torch, fmt, dtype, given):
    from cuep.formats import FORMATS

    ops, log = ops_launches
    f, n = FORMATS[fmt], 24
    x = FakeArray((n, H), dtype)
    (tx,) = as_tensors(torch, x)
    assert ops._quantize_torch(tx, fmt, 0.5) is NotImplemented  # no plan yet: torch mode makes it
    p, s_ = FakeArray((n, f.payload_bytes(H)), np.uint8), FakeArray((n, f.scale_bytes(H)), np.uint8)
    ops._quantize(x, fmt, 0.5, out=(p, s_))  # makes the plan
    if given:
        out = (torch.Tensor(p, torch.uint8), torch.Tensor(s_, torch.uint8))
        got = ops._quantize_torch(tx, fmt, 0.5, out=out)
        assert got[0] is out[0] and got[1] is out[1]
    else:
        got = ops._quantize_torch(tx, fmt, 0.5)
        p, s_ = torch.made  # the CuPy path below writes to the same addresses
        assert [t.ptr for t in got] == [p.data.ptr, s_.data.ptr]
        assert got[0].shape == p.shape and got[1].shape == s_.shape and got[0].dtype is torch.uint8
    ops._quantize(x, fmt, 0.5, out=(p, s_))
    assert len(log) == 3 and log[1][:5] == log[2][:5] and log[1][5] == 0x5000 and log[2][5] is None


@pytest.mark.parametrize("fmt, given", [("bf16", True), ("bf16", False), ("fp8", True), ("fp8", False),
                                        ("nvfp4", False), ("mxfp4", False)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_torch_fused_silu_launches_what_the_cupy_path_does(ops_launches, torch, fmt, given, interleaved):
    ops, log = ops_launches
    cap, inter, groups = 40, 256, 3
    h = FakeArray((cap, 2 * inter), BF16)
    ro = FakeArray((groups + 1,), np.int32)
    th, tro = as_tensors(torch, h, ro)
    assert ops._fused_silu_torch(th, tro, fmt, interleaved) is NotImplemented  # no plan yet
    # a first CuPy call makes the plan; its outputs are stand-ins of the plan's shapes and dtypes
    shapes = ops._silu_plan(ops.get_format(fmt), h, interleaved, groups, 0)[0]
    outs = [FakeArray(s, d) for s, d in shapes]
    ops._fused_silu(h, ro, fmt, interleaved, 0.5, out=outs[0] if fmt == "bf16" else tuple(outs))
    kinds = {BF16: torch.bfloat16, np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32}
    if given:
        tout = [torch.Tensor(a, kinds[a.dtype]) for a in outs]
        got = ops._fused_silu_torch(th, tro, fmt, interleaved, 0.5, out=tout[0] if fmt == "bf16" else tuple(tout))
        assert (got is tout[0]) if fmt == "bf16" else list(got) == tout
    else:
        got = ops._fused_silu_torch(th, tro, fmt, interleaved, 0.5)
        outs = list(torch.made)
        got = [got] if fmt == "bf16" else list(got)
        assert [t.ptr for t in got] == [a.data.ptr for a in outs] and [t.shape for t in got] == [s for s, _ in shapes]
        for a, (s_, d) in zip(outs, shapes):  # the CuPy call below: stand-ins of the plan's dtypes, same addresses
            a.dtype = np.dtype(d)
    ops._fused_silu(h, ro, fmt, interleaved, 0.5, out=outs[0] if fmt == "bf16" else tuple(outs))
    assert len(log) == 3 and log[1][:5] == log[2][:5] and log[1][5] == 0x5000 and log[2][5] is None


def test_torch_ops_leave_every_other_case_to_torch_mode(ops_launches, torch):
    from cuep.formats import FORMATS

    ops, log = ops_launches
    f, n = FORMATS["fp8"], 8
    x = FakeArray((n, H), BF16)
    p, s_ = FakeArray((n, f.payload_bytes(H)), np.uint8), FakeArray((n, f.scale_bytes(H)), np.uint8)
    ops._quantize(x, "fp8", out=(p, s_))
    ops._quantize(FakeArray((0, H), BF16), "bf16",  # the bf16 plan (a copy: no launch)
                             out=(FakeArray((0, 2 * H), np.uint8), FakeArray((0, 0), np.uint8)))
    T = torch.Tensor
    tx, tp, ts = T(x, torch.bfloat16), T(p, torch.uint8), T(s_, torch.uint8)
    log.clear()
    bad = [((T(x, torch.float16), "fp8"), {}), ((T(x, torch.bfloat16, contiguous=False), "fp8"), {}),
           ((T(x, torch.bfloat16, device=1), "fp8"), {}), ((T(x, torch.bfloat16, offset=8), "fp8"), {}),
           ((tx, "fp9"), {}), ((tx, "bf16"), {}), ((tx, "fp8", 1), {}), ((tx, "fp8", 0.0), {}),
           ((tx, "fp8"), {"out": [tp, ts]}), ((tx, "fp8"), {"out": (tp,)}), ((tx, "fp8"), {"out": (ts, tp)}),
           ((tx, "fp8"), {"out": (p, s_)}), ((x, "fp8"), {})]
    for args, kw in bad:
        assert ops._quantize_torch(*args, **kw) is NotImplemented, (args, kw)
    _Runtime.device = 1
    assert ops._quantize_torch(tx, "fp8", out=(tp, ts)) is NotImplemented
    _Runtime.device = 0
    assert log == []
    assert ops._quantize_torch(tx, "fp8", out=(tp, ts)) == (tp, ts) and len(log) == 1
    h, ro = FakeArray((16, 512), BF16), FakeArray((3,), np.int32)
    ops._fused_silu(h, ro, "nvfp4", out=tuple(FakeArray(s, d) for s, d in
                                                         ops._silu_plan(ops.get_format("nvfp4"), h, False, 2, 0)[0]))
    log.clear()
    th = T(h, torch.bfloat16)
    outs = [T(FakeArray(s, d), k) for (s, d), k in zip(ops._silu_plan(ops.get_format("nvfp4"), h, False, 2, 0)[0],
                                                        (torch.uint8, torch.uint8, torch.int32))]
    for args, kw in [((th, T(ro, torch.int64)), {}), ((th, T(ro, torch.int32), "nvfp4"), {"out": tuple(outs)}),
                     ((th, T(ro, torch.int32), "nvfp4", True), {}), ((th, ro, "nvfp4"), {})]:
        assert ops._fused_silu_torch(*args, **kw) is NotImplemented, (args, kw)
    assert log == []


# ---- the CuPy short paths of quantize and fused_silu (ops._quantize_short, ops._fused_silu_short) ------------------
@pytest.fixture
def cupy_ops(ops_launches, monkeypatch):
    """ops_launches with a stand-in ``cupy.empty`` (outputs allocated by the call)."""
    ops, log = ops_launches
    monkeypatch.setattr(ops, "_cupy", types.SimpleNamespace(**vars(_hp.STAND_IN_CUPY),
                                                            empty=lambda shape, dtype: FakeArray(shape, dtype)))
    return ops, log


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("given", [True, False])
def test_short_quantize_launches_what_the_general_path_does(cupy_ops, fmt, dtype, given):
    from cuep.formats import FORMATS

    ops, log = cupy_ops
    f, n = FORMATS[fmt], 24
    x = FakeArray((n, H), dtype)
    out = (FakeArray((n, f.payload_bytes(H)), np.uint8), FakeArray((n, f.scale_bytes(H)), np.uint8))
    assert ops._quantize_short(x, fmt, 0.5, out if given else None) is None and log == []  # no plan yet
    ops._quantize(x, fmt, 0.5, out=out)  # makes the plan
    got = ops._quantize_short(x, fmt, 0.5, out if given else None)
    assert got is not None and (got == out if given else got[0].shape == out[0].shape and got[1].shape ==
                                out[1].shape and got[0].dtype == got[1].dtype == np.uint8)
    ops._quantize(x, fmt, 0.5, out=got)  # the general path with the short path's outputs: the same launch
    assert len(log) == 3 and log[1] == log[2]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("given", [True, False])
def test_short_fused_silu_launches_what_the_general_path_does(cupy_ops, fmt, interleaved, given):
    ops, log = cupy_ops
    cap, inter, groups = 40, 256, 3
    h, ro = FakeArray((cap, 2 * inter), BF16), FakeArray((groups + 1,), np.uint32)
    outs = tuple(FakeArray(s, d) for s, d in ops._silu_plan(ops.get_format(fmt), h, interleaved, groups, 0)[0])
    out = outs[0] if fmt == "bf16" else outs
    assert ops._fused_silu_short(h, ro, fmt, interleaved, 0.5, out if given else None) is None and log == []
    ops._fused_silu(h, ro, fmt, interleaved, 0.5, out=out)  # makes the plan
    got = ops._fused_silu_short(h, ro, fmt, interleaved, 0.5, out if given else None)
    got_all = (got,) if fmt == "bf16" else got
    assert (got is out) if given and fmt == "bf16" else (got == out) if given else \
        [(a.shape, a.dtype) for a in got_all] == [(a.shape, a.dtype) for a in outs]
    ops._fused_silu(h, ro, fmt, interleaved, 0.5, out=got)  # the general path with the short path's outputs
    assert len(log) == 3 and log[1] == log[2]


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("given", [True, False])
def test_short_dequantize_launches_what_the_general_path_does(cupy_ops, fmt, given):
    from cuep.formats import FORMATS

    ops, log = cupy_ops
    f, n = FORMATS[fmt], 24
    p, s_ = FakeArray((n, f.payload_bytes(H)), np.uint8), FakeArray((n, f.scale_bytes(H)), np.uint8)
    out = FakeArray((n, H), np.float32)
    assert ops._dequantize_short(p, s_, fmt, H, 0.5, out if given else None) is None and log == []  # no plan yet
    ops._dequantize(p, s_, fmt, H, 0.5, out=out)  # makes the plan
    got = ops._dequantize_short(p, s_, fmt, H, 0.5, out if given else None)
    assert (got is out) if given else (got.shape == out.shape and got.dtype == np.float32)
    ops._dequantize(p, s_, fmt, H, 0.5, out=got)  # the general path with the short path's output: the same launch
    assert len(log) == 3 and log[1] == log[2]
    bad = [(FakeArray((n, f.payload_bytes(H) + 16), np.uint8), s_, fmt, H, 0.5, out),
           (p, FakeArray((n + 1, f.scale_bytes(H)), np.uint8), fmt, H, 0.5, out),
           (p, s_, fmt, H, 1, out), (p, s_, fmt, 2 * H, 0.5, None), (p, s_, fmt, H, 0.5, FakeArray((n, H), BF16)),
           (p, s_, fmt, H, 0.5, FakeArray((n, H), np.float32, offset=4)), (p, s_, "bf16", H, 0.5, out),
           (FakeArray((n, f.payload_bytes(H)), np.uint8, device=1), s_, fmt, H, 0.5, out)]
    log.clear()
    for args in bad:
        assert ops._dequantize_short(*args) is None, args
    assert log == []


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("given", [True, False])
def test_short_swizzle_launches_what_the_general_path_does(cupy_ops, fmt, given):
    from cuep.formats import FORMATS, SCALE_TILE_BYTES

    ops, log = cupy_ops
    f, rows, groups = FORMATS[fmt], 40, 3
    sc, ro = FakeArray((rows, f.n_scales(H)), np.uint8), FakeArray((groups + 1,), np.int32)
    out = (FakeArray((ops._swizzle_tiles(rows, groups) * f.scale_k_tiles(H) * SCALE_TILE_BYTES,), np.uint8),
           FakeArray((groups,), np.uint32))
    assert ops._swizzle_short(sc, ro, fmt, H, out if given else None) is None and log == []  # no plan yet
    ops._swizzle(sc, ro, fmt, H, out=out)  # makes the plan
    got = ops._swizzle_short(sc, ro, fmt, H, out if given else None)
    assert got == out if given else [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in out]
    ops._swizzle(sc, ro, fmt, H, out=got)  # the general path with the short path's outputs: the same launch
    assert len(log) == 3 and log[1] == log[2]
    bad = [(sc, FakeArray((groups + 1,), np.int64), fmt, H, out), (sc, FakeArray((groups + 1,), np.int32, offset=4),
                                                                   fmt, H, out),
           (sc, FakeArray((groups + 2,), np.int32), fmt, H, out), (FakeArray((rows + 1, f.n_scales(H)), np.uint8), ro,
                                                                   fmt, H, out),
           (sc, ro, fmt, H, (out[0], FakeArray((groups,), np.int32))), (sc, ro, fmt, H, list(out)),
           (sc, ro, fmt, H, (FakeArray(out[0].shape, np.uint8, device=1), out[1])),
           (sc, ro, fmt, H, (FakeArray((out[0].size + 1,), np.uint8), out[1])), (sc, ro, "fp8", H, out)]
    log.clear()
    for args in bad:
        assert ops._swizzle_short(*args) is None, args
    assert log == []


def test_short_ops_leave_every_other_case_to_the_general_path(cupy_ops):
    from cuep.formats import FORMATS

    ops, log = cupy_ops
    f, n = FORMATS["nvfp4"], 8
    x = FakeArray((n, H), BF16)
    p, s_ = FakeArray((n, f.payload_bytes(H)), np.uint8), FakeArray((n, f.scale_bytes(H)), np.uint8)
    ops._quantize(x, "nvfp4", out=(p, s_))
    log.clear()
    bad = [(FakeArray((n, H), np.float16), "nvfp4", 1.0, None), (FakeArray((n, H), BF16, contiguous=False),
                                                                  "nvfp4", 1.0, None),
           (FakeArray((n, H), BF16, device=1), "nvfp4", 1.0, None), (FakeArray((n, H), BF16, offset=8), "nvfp4",
                                                                      1.0, None),
           (FakeArray((0, H), BF16), "nvfp4", 1.0, None), (FakeArray((n, 2 * H), BF16), "nvfp4", 1.0, None),
           (x, "fp8", 1.0, None), (x, "nvfp4", 1, None), (x, "nvfp4", 0.0, None), (x, "nvfp4", 2.0**101, None),
           (x, "nvfp4", 1.0, [p, s_]), (x, "nvfp4", 1.0, (p,)), (x, "nvfp4", 1.0, (s_, p)),
           (x, "nvfp4", 1.0, (p, FakeArray((n, f.scale_bytes(H)), np.uint8, offset=4))),
           (x, "nvfp4", 1.0, (FakeArray((n, f.payload_bytes(H)), np.uint8, device=1), s_)),
           (x, "nvfp4", 1.0, (FakeArray((n + 1, f.payload_bytes(H)), np.uint8), s_))]
    for args in bad:
        assert ops._quantize_short(*args) is None, args
    _Runtime.device = 1
    assert ops._quantize_short(x, "nvfp4", 1.0, (p, s_)) is None
    _Runtime.device = 0
    assert log == []
    assert ops._quantize_short(x, "nvfp4", 1.0, (p, s_)) == (p, s_) and len(log) == 1
    h, ro = FakeArray((16, 512), BF16), FakeArray((3,), np.int32)
    outs = tuple(FakeArray(s, d) for s, d in ops._silu_plan(ops.get_format("nvfp4"), h, False, 2, 0)[0])
    ops._fused_silu(h, ro, "nvfp4", out=outs)
    log.clear()
    wrong = [FakeArray(outs[0].shape, np.int8), FakeArray(outs[1].shape, np.uint8, offset=8),
             FakeArray(outs[2].shape, np.uint32, device=1)]
    for args in [(h, FakeArray((3,), np.int64), "nvfp4", False, 1.0, outs), (h, ro, "nvfp4", True, 1.0, outs),
                 (h, FakeArray((3,), np.int32, offset=4), "nvfp4", False, 1.0, outs),
                 (h, FakeArray((4,), np.int32), "nvfp4", False, 1.0, outs), (h, ro, "mxfp4", False, 1.0, outs),
                 (h, ro, "nvfp4", False, 1.0, outs[:2]), (h, ro, "nvfp4", False, 1.0, list(outs)),
                 (h, ro, "nvfp4", False, 1, outs), (FakeArray((16, 512), np.float32), ro, "nvfp4", False, 1.0, outs)]\
            + [(h, ro, "nvfp4", False, 1.0, outs[:i] + (a,) + outs[i + 1:]) for i, a in enumerate(wrong)]:
        assert ops._fused_silu_short(*args) is None, args
    assert log == []
    assert ops._fused_silu_short(h, ro, "nvfp4", False, 1.0, outs) == outs and len(log) == 1


# ---- a small one-rank round's chunks, worked out on the host (ep._small_round_chunks) ----------------------------
def test_small_round_chunks_use_the_kernels_constants():
    import re

    src = _kernels.SRC_DIR
    text = "".join(p.read_text() for p in sorted(src.rglob("*.cuh"))) + (src / "dispatch.cu").read_text()
    consts = dict(re.findall(r"constexpr\s+int\s+(k\w+)\s*=\s*(\d+)\s*;", text))
    assert int(consts["kMaxChunks"]) == ep._MAX_CHUNKS
    assert int(consts["kMinPadWarps"]) == ep._MIN_PAD_WARPS
    assert int(consts["kWarp"]) * int(consts["kLaneValues"]) == ep._WARP_SPAN
    assert int(re.search(r"#define CUEP_DISPATCH_ENCODE_STEPS (\d+)", text).group(1)) == ep._ENCODE_STEPS
    assert int(consts["kPartsShift"]) == ep._PARTS_SHIFT
    assert int(consts["kSplitTokens"]) == ep._SPLIT_TOKENS
    assert int(consts["kBookWarps"]) == ep._SPLIT_BOOK_WARPS
    local = (src / "dispatch" / "local.cuh").read_text()
    assert "take_chunk_plan(a.chunk_plan & ~(7 << kPartsShift), n_spans," in local
    assert "lp = (a.chunk_plan >> kPartsShift) & 7;" in local
    assert "const int p = plan & 0xffff, c = plan >> 16;" in (src / "ep" / "sync.cuh").read_text()  # unpacking


def test_small_round_chunks_known_cases():
    """H = 7168 (28 spans of 256 values) on 132 blocks x 16 warps: a chunk a span while the warps last; a quantized
    N = 128 round takes whole encode steps (4 spans, 7 chunks) to leave 4 warps a block for padding; few warps give
    whole tokens."""
    plan = ep._small_round_chunks
    assert plan(1, 7168, 132, 16, False) == 1 | 28 << 16
    assert plan(32, 7168, 132, 16, True) == 1 | 28 << 16
    assert plan(128, 7168, 132, 16, False) == 2 | 14 << 16
    assert plan(128, 7168, 132, 16, True) == 4 | 7 << 16
    assert plan(256, 7168, 1, 16, False) == 28 | 1 << 16
    assert plan(0, 7168, 132, 16, True) == 28 | 1 << 16  # (no tokens: one chunk, as the kernel had it)
    # top_k = 8: while the (token, chunk) pairs are at most twice the blocks, each pair's rows split over parts
    assert plan(1, 7168, 132, 16, False, 8) == 1 | 28 << 16 | 3 << 28
    assert plan(4, 7168, 132, 16, True, 8) == 1 | 28 << 16 | 3 << 28
    assert plan(5, 7168, 132, 16, False, 8) == 1 | 28 << 16 | 2 << 28  # 140 pairs: 4 parts (8 items a block)
    assert plan(10, 7168, 132, 16, False, 8) == 1 | 28 << 16  # 280 pairs: more than twice the blocks
    assert plan(1, 7168, 132, 16, False, 3) == 1 | 28 << 16 | 1 << 28  # parts: a power of two <= top_k
    assert plan(4, 7168, 132, 2, True, 8) == 1 | 28 << 16  # two warps a block: no padding room, no parts


def test_dispatch_route_by_round():
    """ep._route: the protocol's kernel unless one rank runs every phase; then a small round (N <= small_batch_tokens)
    takes the split layout's kernel when it encodes (not bf16 from bf16) and N <= _SPLIT_TOKENS, a larger round its
    own kernel; and each route's kernel is one dispatch.cu defines."""
    import re

    fits = (True,) * 33
    host = types.SimpleNamespace(one_rank=True, small=128, fmt="nvfp4", split_fits=fits)
    all_phases = ep._PHASES_ALL
    assert [ep._route(host, all_phases, n, "bf16") for n in (0, 1, 32, 33, 128, 129)] == [3, 3, 3, 1, 1, 2]
    assert ep._route(host, all_phases & ~ep.PHASE_RECV, 1, "bf16") == 0
    assert ep._route(types.SimpleNamespace(one_rank=False, small=128, fmt="nvfp4"), all_phases, 1, "bf16") == 0
    bf16 = types.SimpleNamespace(one_rank=True, small=128, fmt="bf16", split_fits=fits)
    assert ep._route(bf16, all_phases, 1, "bf16") == 1 and ep._route(bf16, all_phases, 1, "f32") == 3
    assert ep._route(types.SimpleNamespace(one_rank=True, small=0, fmt="fp8"), all_phases, 1, "bf16") == 2
    some = types.SimpleNamespace(one_rank=True, small=16, fmt="fp8", split_fits=(True,) * 9 + (False,) * 8)
    assert [ep._route(some, all_phases, n, "bf16") for n in (0, 8, 9, 16, 17)] == [3, 3, 1, 1, 2]
    src = (_kernels.SRC_DIR / "dispatch.cu").read_text()
    guarded = re.findall(r"^CUEP_IF_(\w+)\(CUEP_DISPATCH_LOCAL_SPLIT\((\w+), (\w+),", src, re.M)
    assert all(part == f for part, f, _ in guarded)  # each in its format's part (_kernels.PARTS)
    split = {(f, s) for _, f, s in guarded}
    assert split == {(f, s) for f in ("bf16", "fp8", "nvfp4", "mxfp4") for s in ("bf16", "f32")} - {("bf16", "bf16")}


def _items_by_kernel(plan: int, n: int, hidden: int) -> int:
    """A small round's item count as dispatch_local's plan() works it out from the packed plan (take_chunk_plan,
    else a span a chunk up to kMaxChunks a token, no parts), written out separately from ep._small_round_items."""
    spans_total = -(-hidden // 256)
    p, c = plan & 0xFFFF, (plan & ~(7 << 28)) >> 16
    if 1 <= p and 1 <= c and (c - 1) * p < spans_total <= c * p:
        return n * c * (1 << ((plan >> 28) & 7))
    per = -(-spans_total // 255)
    return n * -(-spans_total // per)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("hidden", [1024, 7168, 12288, 16384, 32768])
@pytest.mark.parametrize("blocks,warps", [(132, 16), (114, 16), (16, 16), (2, 16), (132, 12), (132, 8)])
def test_split_fits_keeps_items_off_the_layout_warps(quantized, hidden, blocks, warps):
    """ep._split_fits: a small round takes the split layout's kernel only if every item of its chunk plan lands on
    a warp below the last 8 (item i on warp i // blocks: those alone prepare their first item's weights and encode)
    and the block has 16 warps or more. The decode shape (H = 7168, 132 or 114 SMs, 16 warps) splits at every
    N <= 32; H = 12288 at N = 32 has 1536 items, more than 8 x 132: not split."""
    buf = object.__new__(Buffer)
    buf.num_sms, buf._launch_cache = blocks, {("dispatch", True): (32 * warps, 4096)}
    fits = ep._split_fits(buf, hidden, 128, quantized, 8)
    assert len(fits) == ep._SPLIT_TOKENS + 1
    assert ep._split_fits(buf, hidden, 5, quantized, 8) == fits[:6]  # small_batch_tokens < 32: up to it
    for n, ok in enumerate(fits):
        plan = ep._small_round_chunks(n, hidden, blocks, warps, quantized, 8)
        items = _items_by_kernel(plan, n, hidden)
        assert ep._small_round_items(n, hidden, blocks, warps, quantized, 8) == items
        last_warp = (items - 1) // blocks if items else -1
        assert ok == (warps >= 16 and last_warp < warps - 8), (n, items, last_warp)
    if warps < 16:
        assert not any(fits)
    if hidden == 7168 and blocks >= 114 and warps == 16:
        assert all(fits)
    if hidden == 12288 and blocks == 132 and warps == 16:
        assert fits[1] and not fits[32]


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("hidden", [8, 128, 256, 2048, 7168, 7200, 16384, 1 << 20])
@pytest.mark.parametrize("blocks,warps", [(1, 1), (1, 16), (16, 8), (132, 16), (132, 4)])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_small_round_chunks_cover_each_row_exactly(quantized, hidden, blocks, warps, top_k):
    """Every N of a small round: the chunks cover the row's spans exactly (as the kernel requires; otherwise it
    falls back), at most kMaxChunks a token, whole encode steps where quantization shortened them; parts only while
    the (token, chunk) pairs are at most twice the blocks, a power of two at most top_k, at most 8 items a block,
    the items within the warps (a quantized round's leaving kMinPadWarps a block)."""
    n_spans = -(-hidden // 256)
    grid_warps = blocks * warps
    for n in range(0, 257):
        packed = ep._small_round_chunks(n, hidden, blocks, warps, quantized, top_k)
        spans, chunks, parts = packed & 0xFFFF, packed >> 16 & 0xFFF, 1 << (packed >> 28 & 7)
        assert 0 < packed < 2**31 and parts <= 32 and packed >> 16 & 0xF00 == 0  # (bits 24..27 unused, 28..30 the parts)
        assert spans >= 1 and chunks >= 1 and (chunks - 1) * spans < n_spans <= chunks * spans, (n, packed)
        assert chunks <= ep._MAX_CHUNKS
        if n and chunks > 1:
            assert chunks <= max(1, grid_warps // n)  # no more chunks than the token's share of warps
        if parts > 1:
            assert n * chunks <= 2 * blocks and parts <= top_k and n * chunks * parts <= 8 * blocks
            assert n * chunks * parts <= grid_warps - (ep._MIN_PAD_WARPS * blocks if quantized else 0)


@pytest.mark.parametrize("hidden", [8, 128, 256, 2048, 7168, 7200, 16384])
@pytest.mark.parametrize("blocks,warps", [(1, 1), (1, 16), (16, 8), (132, 16)])
def test_combine_chunks_cover_each_row_exactly(hidden, blocks, warps):
    """The one-rank combine's chunks (ep._combine_chunks): whole warps of 16-byte vectors covering the row exactly,
    no more chunks a token than its share of warps; H = 7168 on 132 x 16: 896 vectors, a warp's 32 a chunk at N = 1,
    whole rows from N = 2112."""
    n_vec = hidden // 8
    for n in range(0, 4097, 7):
        packed = ep._combine_chunks(n, hidden, blocks, warps)
        vecs, chunks = packed & 0xFFFF, packed >> 16
        assert vecs % 32 == 0 and chunks >= 1 and (chunks - 1) * vecs < n_vec <= chunks * vecs, (n, packed)
        if n and chunks > 1:
            assert chunks <= max(1, blocks * warps // n)
    assert ep._combine_chunks(1, 7168, 132, 16) == 32 | 28 << 16
    assert ep._combine_chunks(2112, 7168, 132, 16) == 896 | 1 << 16
    assert "take_chunk_plan(a.chunk_plan, n_vec," in (_kernels.SRC_DIR / "combine" / "local.cuh").read_text()


def test_one_rank_combine_kernel_by_chunk_plan():
    """ep._combine_local_name: the one-rank bf16 combine takes the kernel with 8 rows in flight where its items are
    whole tokens (one chunk a token, or no plan) or chunks of at least 96 vectors (N = 151: 96), the one with 4 for
    shorter chunks (N = 1: 32 vectors, 150: 64); float32 always 4."""
    bf16 = types.SimpleNamespace(combine_wide="combine.cu:cuep_combine_local_wide_bf16",
                                 combine_names={True: "combine.cu:cuep_combine_local_bf16"})
    f32 = types.SimpleNamespace(combine_wide=None, combine_names={True: "combine.cu:cuep_combine_local_f32"})
    wide, narrow = bf16.combine_wide, bf16.combine_names[True]
    plan = {n: ep._combine_chunks(n, 7168, 132, 16) for n in (1, 128, 150, 151, 1056, 1057, 4096)}  # 1 chunk from 1057
    assert [plan[n] & 0xFFFF for n in plan] == [32, 64, 64, 96, 448, 896, 896]
    assert [ep._combine_local_name(bf16, plan[n]) for n in plan] == [narrow] * 3 + [wide] * 4
    assert ep._combine_local_name(bf16, 0) == wide  # no plan: the kernel takes a token a warp
    assert {ep._combine_local_name(f32, p) for p in [0, *plan.values()]} == {f32.combine_names[True]}
    src = (_kernels.SRC_DIR / "combine.cu").read_text()
    assert "CUEP_COMBINE_LOCAL(cuep_combine_local_wide_bf16, cuep::bf16_t, 8)" in src
    assert "CUEP_COMBINE_LOCAL(cuep_combine_local_bf16, cuep::bf16_t, 4)" in src


def test_one_rank_combine_launches_the_wide_kernel_for_whole_tokens(launches):
    """H = 256 on 4 x 16 warps: a row is one chunk at every N, so the one-rank combine (fused, and combine_wait)
    launches cuep_combine_local_wide_bf16 on the general and the short path alike."""
    x, ids, w, cw, res = combine_inputs(16, True, False, False)
    buf = make_buffer("bf16", 1)
    d = ep._dispatch(buf, x, ids, w, 1.0, ep._PHASES_ALL)[0]
    eo = FakeArray((buf.cfg.capacity, H), BF16)
    launches.clear()
    ep._combine(buf, eo, d, None, None, ep._PHASES_ALL)
    ep._combine_single(buf, eo, d, None, None, ep._PHASES_ALL)
    ep._combine_single(buf, eo, d, None, None, ep.PHASE_NOTIFY | ep.PHASE_SEND)
    ep._combine_single(buf, eo, d, None, None, ep.PHASE_RECV)
    assert [entry[0] for entry in launches] == ["combine.cu:cuep_combine_local_wide_bf16"] * 3


def forbid_torch_scan(monkeypatch) -> None:
    """torch_aware's argument scan (interop._wants_torch) raises from now on: a call that reaches it fails."""
    from cuep import interop

    def scan(*a):
        raise AssertionError("the torch argument scan ran")

    monkeypatch.setattr(interop, "_wants_torch", scan)


def same_launches_without_scan(monkeypatch, log, body, public) -> None:
    """``body()`` (the ops' own functions) and then, with torch_aware's scan forbidden from there on, ``public()``
    (the public calls): the two quantize + fused_silu calls launch exactly the same."""
    log.clear()
    body()
    direct = list(log)
    forbid_torch_scan(monkeypatch)
    log.clear()
    public()
    assert log == direct and len(direct) == 2


def ops_plans(ops, silu_fmt: str) -> tuple:
    """Stand-ins of a quantize call (fp8, 8 tokens, out given) and a fused_silu call (``silu_fmt``, 2 groups, out
    given), each run once through the op's body so that its plan exists: (x, payload, scales, h, row_offsets,
    fused_silu's outputs)."""
    from cuep.formats import FORMATS

    f, n = FORMATS["fp8"], 8
    x = FakeArray((n, H), BF16)
    p, s_ = FakeArray((n, f.payload_bytes(H)), np.uint8), FakeArray((n, f.scale_bytes(H)), np.uint8)
    h, ro = FakeArray((16, 512), BF16), FakeArray((3,), np.int32)
    silu_outs = tuple(FakeArray(s, d) for s, d in ops._silu_plan(ops.get_format(silu_fmt), h, False, 2, 0)[0])
    ops._quantize(x, "fp8", out=(p, s_))
    ops._fused_silu(h, ro, silu_fmt, out=silu_outs)
    return x, p, s_, h, ro, silu_outs


def prepare_every_launch(buf, x, ids, w, eo) -> None:
    """One general call of every dispatch and combine phase set on ``buf``, so each short path finds its launch."""
    for phases in (ep._PHASES_ALL, ep.PHASE_NOTIFY | ep.PHASE_SEND):
        d = ep._dispatch(buf, x, ids, w, 1.0, phases)[0]
        if phases != ep._PHASES_ALL:
            ep._dispatch_wait_general.__wrapped__(d)
        for ph in (ep._PHASES_ALL, ep.PHASE_NOTIFY | ep.PHASE_SEND, ep.PHASE_RECV):
            ep._combine(buf, eo, d, None, None, ph)


def test_public_calls_take_the_plain_path_before_the_torch_scan(launches, torch, monkeypatch):
    """With torch imported, a call of CuPy arrays in the common case launches through its short path
    (ep._dispatch_single, _combine_single, _dispatch_wait_single, tried by the public call first) without the
    argument scan, the same launch and round state as the short path itself; and the short paths take nothing with
    a torch argument: those calls go to the torch_aware general function (torch mode gives torch results)."""
    buf = make_buffer("bf16")
    x, ids, w = inputs(16)
    eo = FakeArray((buf.cfg.capacity, H), BF16)
    prepare_every_launch(buf, x, ids, w, eo)

    forbid_torch_scan(monkeypatch)
    for async_ in (False, True):
        def public():
            d = ep.dispatch_wait(ep.dispatch_async(buf, x, ids, w)) if async_ else ep.dispatch(buf, x, ids, w)
            out = ep.combine(buf, eo, d)
            assert ep.combine_async(buf, eo, d) is None
            assert ep.combine_wait(buf, eo, d) is out

        def short():
            if async_:
                d2 = ep._dispatch_single(buf, x, ids, w, 1.0, ep.PHASE_NOTIFY | ep.PHASE_SEND)
                assert ep._dispatch_wait_single(d2, False) is d2
            else:
                d2 = ep._dispatch_single(buf, x, ids, w, 1.0, ep._PHASES_ALL)
            for ph in (ep._PHASES_ALL, ep.PHASE_NOTIFY | ep.PHASE_SEND, ep.PHASE_RECV):
                ep._combine_single(buf, eo, d2, None, None, ph)

        _, (pub, sho), (after_pub, after_sho) = both_paths(buf, public, short, launches)
        assert pub == sho and after_pub == after_sho and len(pub) == (5 if async_ else 3)

    tx, tids, tw, teo = as_tensors(torch, x, ids, w, eo)
    general = []  # the calls handed on: (name, arguments)
    for name in ("_dispatch_general", "_dispatch_async_general", "_dispatch_wait_general", "_combine_general",
                 "_combine_async_general", "_combine_wait_general"):
        monkeypatch.setattr(ep, name, lambda *a, name=name: general.append((name, a)) or name)
    launches.clear()
    before = dict(buf._rounds)
    for args in [(tx, tids, tw), (x, tids, w), (x, ids, tw), ([x], [ids], [w])]:
        assert ep.dispatch(buf, *args) == "_dispatch_general"
        assert ep.dispatch_async(buf, *args) == "_dispatch_async_general"
    assert ep.dispatch(buf, x, ids, w, validate=True) == "_dispatch_general"
    assert general[-1] == ("_dispatch_general", (buf, x, ids, w, 1.0, True)) and len(general) == 9
    assert launches == [] and buf._rounds == before
    d = ep._dispatch_single(buf, x, ids, w, 1.0, ep._PHASES_ALL)
    launches.clear()
    before = dict(buf._rounds)
    general.clear()
    for fn in (ep.combine, ep.combine_async):
        fn(buf, teo, d)
        fn(buf, eo, d, tw)
    d._torch = True  # a torch dispatch's Dispatched: its combine returns torch tensors
    assert ep.combine(buf, eo, d) == "_combine_general" and ep.combine_wait(buf, eo, d) == "_combine_wait_general"
    assert ep.dispatch_wait(d) == "_dispatch_wait_general"
    assert [g[0] for g in general] == ["_combine_general"] * 2 + ["_combine_async_general"] * 2 + [
        "_combine_general", "_combine_wait_general", "_dispatch_wait_general"]
    assert general[1][1] == (buf, eo, d, tw, None)
    assert launches == [] and buf._rounds == before


def test_public_torch_calls_take_the_torch_short_path_without_the_scan(launches, torch, monkeypatch):
    """Once a torch call has bound the torch module (interop.torch_bindings), a public call with torch tensors in the
    common case launches through the torch short path directly (no argument scan, no general function), the same
    launches and round state as the short paths themselves; before that, it goes to the general function."""
    from cuep import interop

    buf = make_buffer("bf16")
    x, ids, w = inputs(16)
    eo = FakeArray((buf.cfg.capacity, H), BF16)
    tx, tids, tw, teo = as_tensors(torch, x, ids, w, eo)
    prepare_every_launch(buf, x, ids, w, eo)
    general = []
    for name in ("_dispatch_general", "_dispatch_async_general", "_dispatch_wait_general", "_combine_general",
                 "_combine_async_general", "_combine_wait_general"):
        monkeypatch.setattr(ep, name, lambda *a, name=name: general.append(name) or name)
    assert interop._bindings[0] is None and ep.dispatch(buf, tx, tids, tw) == "_dispatch_general"  # not bound yet
    interop.torch_bindings()
    general.clear()

    forbid_torch_scan(monkeypatch)
    for async_ in (False, True):
        def public():
            d = ep.dispatch_wait(ep.dispatch_async(buf, tx, tids, tw)) if async_ else ep.dispatch(buf, tx, tids, tw)
            assert d._torch and general == []
            out = ep.combine(buf, teo, d)
            assert ep.combine_async(buf, teo, d) is None and ep.combine_wait(buf, teo, d) is out

        def short():
            if async_:
                d2 = ep._dispatch_single_torch(buf, tx, tids, tw, 1.0, ep.PHASE_NOTIFY | ep.PHASE_SEND)
                assert ep._dispatch_wait_torch(d2) is d2
            else:
                d2 = ep._dispatch_single_torch(buf, tx, tids, tw, 1.0, ep._PHASES_ALL)
            for ph in (ep._PHASES_ALL, ep.PHASE_NOTIFY | ep.PHASE_SEND, ep.PHASE_RECV):
                ep._combine_single_torch(buf, teo, d2, None, None, ph)

        _, (pub, sho), (after_pub, after_sho) = both_paths(buf, public, short, launches)
        assert pub == sho and after_pub == after_sho and len(pub) == (5 if async_ else 3)
    assert general == []


def test_ops_plain_paths_call_the_op_without_the_torch_scan(ops_launches, torch, monkeypatch):
    """ops.quantize / ops.fused_silu with torch imported: a call of CuPy arrays and plain arguments goes straight to
    the op's body (the same launch as the body itself, no argument scan); any torch tensor, or an argument of
    another type (which could hold one), goes to the torch_aware general function, which scans."""
    ops, log = ops_launches
    x, p, s_, h, ro, silu_outs = ops_plans(ops, "nvfp4")

    def body():
        ops._quantize(x, "fp8", 0.5, out=(p, s_))
        ops._fused_silu(h, ro, "nvfp4", False, 2.0, out=silu_outs)

    def public():
        assert ops.quantize(x, "fp8", 0.5, out=(p, s_)) == (p, s_)
        assert ops.fused_silu(h, ro, "nvfp4", False, global_scale=2.0, out=silu_outs) == silu_outs

    same_launches_without_scan(monkeypatch, log, body, public)
    T = torch.Tensor
    tx, tp, th, tro = T(x, torch.bfloat16), T(p, torch.uint8), T(h, torch.bfloat16), T(ro, torch.int32)
    log.clear()
    monkeypatch.setattr(ops, "_quantize_general", lambda *a: ("general", a))
    monkeypatch.setattr(ops, "_fused_silu_general", lambda *a: ("general", a))
    for args, kw in [((tx, "fp8"), {}), ((x, "fp8"), {"out": (tp, s_)}), ((x, "fp8"), {"out": [p, s_]}),
                     ((x, "fp8", np.float32(1.0)), {}), ((x, T(x, torch.uint8)), {})]:
        got = ops.quantize(*args, **kw)
        assert got[0] == "general" and got[1][:len(args)] == args and len(got[1]) == 4, (args, kw)
    t_out = silu_outs[:2] + (T(ro, torch.int32),)
    for args, kw in [((th, ro), {}), ((h, tro), {}), ((h, ro, "nvfp4"), {"out": t_out}), ((h, ro, "nvfp4", 1), {}),
                     ((h, ro, "nvfp4", False, T(ro, torch.float32)), {})]:
        got = ops.fused_silu(*args, **kw)
        assert got[0] == "general" and got[1][:len(args)] == args and len(got[1]) == 6, (args, kw)
    assert log == []


def test_public_torch_ops_take_the_torch_short_path_without_the_scan(ops_launches, torch, monkeypatch):
    """ops.quantize / ops.fused_silu with torch tensors, once the torch module is bound: the torch short path
    directly (the same launch as calling it), no argument scan."""
    from cuep import interop

    ops, log = ops_launches
    x, p, s_, h, ro, silu_outs = ops_plans(ops, "fp8")
    T = torch.Tensor
    tx, tp, ts, th, tro = T(x, torch.bfloat16), T(p, torch.uint8), T(s_, torch.uint8), T(h, torch.bfloat16), \
        T(ro, torch.int32)
    t_outs = (T(silu_outs[0], torch.uint8), T(silu_outs[1], torch.float32))
    interop.torch_bindings()

    def body():
        assert ops._quantize_torch(tx, "fp8", 0.5, out=(tp, ts)) == (tp, ts)
        assert ops._fused_silu_torch(th, tro, "fp8", False, 2.0, out=t_outs) == t_outs

    def public():
        assert ops.quantize(tx, "fp8", 0.5, out=(tp, ts)) == (tp, ts)
        assert ops.fused_silu(th, tro, "fp8", False, global_scale=2.0, out=t_outs) == t_outs

    same_launches_without_scan(monkeypatch, log, body, public)


@pytest.mark.parametrize("combine_dtype", ["bfloat16", "float32"])
def test_combine_kernel_choice(combine_dtype):
    """ep._combine_kernel, the one choice of (kernel, shared memory, chunk plan) both combine paths launch: after a
    one-rank dispatch the one-rank kernel with its row offsets in shared memory and the round's chunk plan; else the
    protocol's kernel, with the load ring only where a bf16 partial-sum round sends."""
    buf = make_buffer("bf16", 2)
    buf.cfg = EPConfig(hidden=H, top_k=K, n_experts=E, n_gpus_per_node=2, max_tokens_per_rank=T,
                       combine_dtype=combine_dtype)
    host = ep._Host(buf)
    suffix = host.combine_suffix
    protocol = f"combine.cu:cuep_combine_{suffix}"
    ring = ep.COMBINE_RING_BYTES if suffix == "bf16" else 0
    send, recv = ep.PHASE_NOTIFY | ep.PHASE_SEND, ep.PHASE_RECV
    assert ep._combine_kernel(buf, host, send, ep.MODE_PARTIAL, False, 16) == (protocol, ring, 0)
    assert ep._combine_kernel(buf, host, ep._PHASES_ALL, ep.MODE_PARTIAL, False, 16) == (protocol, ring, 0)
    for mode in (ep.MODE_WEIGHTED, ep.MODE_UNREDUCED):
        assert ep._combine_kernel(buf, host, send, mode, False, 16) == (protocol, 0, 0)
    assert ep._combine_kernel(buf, host, recv, ep.MODE_PARTIAL, False, 16) == (protocol, 0, 0)
    chunks = ep._combine_chunks_of(buf, host, 16)
    assert ep._combine_kernel(buf, host, recv, ep.MODE_PARTIAL, True, 16) == (
        ep._combine_local_name(host, chunks), host.offsets_smem, chunks)


def test_dependent_launch_config_is_cuda_h_layout(monkeypatch):
    """A DependentLaunch's cuLaunchKernelEx arguments: CUlaunchConfig (grid, block, shared bytes, stream at byte 32,
    the attribute array, one attribute) then one CUlaunchAttribute (id 6, programmatic stream serialization, value
    1), as cuda.h lays them out; a launch writes its stream (and a new grid) and passes the same four arguments."""
    import ctypes
    import struct

    fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF00D))
    launch = _kernels.PreparedLaunch(fn, 512, 70000, 16, (0, 8), _kernels.slot_struct("Pi"))
    launch.make_dependent(132)
    dep = launch.dependent
    base = ctypes.addressof(dep.raw)
    assert (_kernels._LAUNCH_CONFIG.size, _kernels._LAUNCH_ATTRIBUTE.size, len(dep.raw)) == (56, 72, 128)
    cfg = struct.unpack_from("<7I4xQQI4x", dep.raw, 0)
    assert cfg == (132, 1, 1, 512, 1, 1, 70000, 0, base + 56, 1)
    assert struct.unpack_from("<Ii", dep.raw, 56) == (6, 0) and struct.unpack_from("<i", dep.raw, 64) == (1,)
    assert bytes(dep.raw[68:128]) == bytes(60)
    calls = []

    def driver(*args):
        calls.append(tuple(a if a is None else a.value for a in args) + (bytes(dep.raw),))
        return 0

    monkeypatch.setattr(_kernels, "_launch_ex", [driver])
    monkeypatch.setattr(_kernels, "_cuda", (None, None, RuntimeError))
    _kernels._launch_raw(launch.func, 132, 512, 70000, launch.argv_ptr, 0x5000, 0, dep)
    _kernels._launch_raw(launch.func, 66, 512, 70000, launch.argv_ptr, 0x6000, 0, dep)
    (c1, f1, a1, e1, raw1), (c2, f2, a2, e2, raw2) = calls
    assert (c1, f1, a1, e1) == (c2, f2, a2, e2) == (base, 0xF00D, launch.argv_ptr, None)
    assert struct.unpack_from("<IQ", raw1, 0)[0] == 132 and struct.unpack_from("<Q", raw1, 32) == (0x5000,)
    assert struct.unpack_from("<I", raw2, 0) == (66,) and struct.unpack_from("<Q", raw2, 32) == (0x6000,)
    assert raw1[56:] == raw2[56:]  # the attribute untouched

    def failing(*args):
        return 1  # CUDA_ERROR_INVALID_VALUE

    monkeypatch.setattr(_kernels, "_ensure_context", lambda: False)
    dep.call = None
    monkeypatch.setattr(_kernels, "_launch_ex", [failing])
    with pytest.raises(RuntimeError):
        _kernels._launch_raw(launch.func, 66, 512, 70000, launch.argv_ptr, 0x6000, 0, dep)
