"""cuep.interop without torch or a GPU: calls without tensors go straight through (and never import torch), and the
torch side (detection, zero-copy views, dtypes, errors, results) is exercised with a stand-in ``torch`` module.

The stand-in holds what interop reads of a tensor (device, dtype, shape, stride, numel, data_ptr, is_cuda,
get_device, is_contiguous); CuPy builds array
objects over device addresses without touching the GPU, so the views can be checked here. What needs the device
(streams, torch's allocator, real tensors) is in tests/test_torch_gpu.py.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import types
import weakref
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cuep
from cuep import ep, interop, ops

ROOT = Path(__file__).resolve().parents[1]
BF16 = np.dtype(ml_dtypes.bfloat16)


# ---- a stand-in torch -------------------------------------------------------------------------------------------
class _Dtype:
    def __init__(self, name: str, itemsize: int):
        self.name, self.itemsize = name, itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _Device:
    def __init__(self, kind: str, index: int | None = None):
        self.type, self.index = kind, index


def _fake_torch() -> types.ModuleType:
    torch = types.ModuleType("torch")
    sizes = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "int16": 2, "int32": 4,
             "int64": 8, "uint8": 1, "bool": 1, "uint32": 4, "float8_e4m3fn": 1, "complex64": 8}
    for name, size in sizes.items():
        setattr(torch, name, _Dtype(name, size))

    class Tensor:
        """What interop reads of a tensor: a device address, shape and strides in elements."""

        def __init__(self, shape, dtype, device=("cuda", 0), ptr=0x7F0000000000, strides=None):
            self.shape, self.dtype, self.device, self.ptr = tuple(shape), dtype, _Device(*device), ptr
            c = [1] * len(self.shape)
            for i in range(len(self.shape) - 2, -1, -1):
                c[i] = c[i + 1] * self.shape[i + 1]
            self._strides = tuple(strides) if strides is not None else tuple(c)

        def stride(self):
            return self._strides

        def numel(self) -> int:
            return int(np.prod(self.shape))

        def data_ptr(self) -> int:
            return self.ptr

        @property
        def is_cuda(self) -> bool:
            return self.device.type == "cuda"

        def get_device(self) -> int:
            return self.device.index if self.is_cuda else -1

        def is_contiguous(self) -> bool:
            c, want = 1, []
            for n in reversed(self.shape):
                want.insert(0, c)
                c *= n
            return all(n == 1 or s == w for n, s, w in zip(self.shape, self._strides, want))

    torch.Tensor = Tensor
    return torch


@pytest.fixture
def torch(monkeypatch):
    fake = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    interop._dtype_maps.cache_clear()
    yield fake
    interop._dtype_maps.cache_clear()


# ---- no torch: straight through ----------------------------------------------------------------------------------
PROBE = """
import json, sys
import numpy as np
import cuep, cuep.moe
from cuep import interop

out = {"wants": interop._wants_torch((np.zeros(3), [np.zeros(2)]), {"x": None}),
       "is_tensor": interop.is_torch_tensor(np.zeros(1))}
x = np.zeros((4, 2), np.float32)
r = np.ones((2, 3), np.float32)
ids, w = cuep.moe.route(x, r, 2)  # the host path of a decorated function: NumPy in, NumPy out
out["route"] = [type(ids).__module__, type(w).__module__, list(ids.shape)]
try:
    cuep.ops.quantize(x, "bf16")
except TypeError as e:
    out["ops_error"] = str(e)
out["torch"] = "torch" in sys.modules
print(json.dumps(out))
"""


def test_calls_without_tensors_go_straight_through_and_never_import_torch():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["wants"] is False and got["is_tensor"] is False
    assert got["route"] == ["numpy", "numpy", [4, 2]]
    assert "numpy.ndarray" in got["ops_error"], got["ops_error"]  # CuPy's own message, not rewritten
    assert not got["torch"], "a call without torch tensors imported torch"


def test_public_calls_keep_their_names_and_docs():
    for fn in (cuep.moe.moe_forward, cuep.moe.route):
        assert fn.__wrapped__.__name__ == fn.__name__ and fn.__doc__ == fn.__wrapped__.__doc__
    # these try their common CuPy call themselves, then hand the rest to a torch_aware function
    for fn, general in ((cuep.dispatch, ep._dispatch_general), (cuep.dispatch_async, ep._dispatch_async_general),
                        (cuep.dispatch_wait, ep._dispatch_wait_general), (cuep.combine, ep._combine_general),
                        (cuep.combine_async, ep._combine_async_general),
                        (cuep.combine_wait, ep._combine_wait_general), (cuep.ops.quantize, ops._quantize_general),
                        (cuep.ops.fused_silu, ops._fused_silu_general), (cuep.ops.dequantize, ops._dequantize_general),
                        (cuep.ops.swizzle_block_scales, ops._swizzle_general)):
        assert fn.__doc__.strip() and not hasattr(fn, "__wrapped__") and general.__module__ == fn.__module__
        assert callable(general.__wrapped__)  # torch_aware's wrapper of the general body


# ---- with a torch module ----------------------------------------------------------------------------------------
def test_detection_finds_tensors_in_arguments_and_lists(torch):
    t = torch.Tensor((2, 2), torch.float32)
    assert interop.is_torch_tensor(t) and not interop.is_torch_tensor(np.zeros(2))
    assert interop._wants_torch((None, [np.zeros(1), t]), {})
    assert interop._wants_torch((), {"residual": t})
    assert interop._wants_torch(((np.zeros(1), t),), {})
    assert not interop._wants_torch((np.zeros(1), [np.zeros(1)]), {"out": None})
    marked = types.SimpleNamespace(_torch=True)  # a Dispatched made by a torch call
    assert interop._wants_torch(([marked],), {}) and interop._wants_torch((marked,), {})
    assert not interop._wants_torch((types.SimpleNamespace(_torch=False),), {})


def test_detection_cache_per_type_is_exact(torch):
    """The per-type scan cache: a type that cannot carry _torch is skipped, every other is looked at per value,
    and a fresh torch module (another Tensor class) starts a fresh cache."""
    class Slotted:
        __slots__ = ("a",)

    class Plain:
        pass

    for _ in range(2):  # the second round reads the cache
        assert not interop._wants_torch((Slotted(), np.zeros(1), "fmt", 1.0, None), {"out": (np.zeros(1),)})
        p = Plain()
        assert not interop._wants_torch((p,), {})
        p._torch = True  # an instance dict can carry the flag: Plain is scanned per value
        assert interop._wants_torch((p,), {})
    assert not interop._wants_torch((Slotted(),), {})
    other = _fake_torch()  # another torch: its Tensor is new to the cache
    sys.modules["torch"] = other
    assert interop._wants_torch((other.Tensor((1,), other.float32),), {})
    assert not interop._wants_torch((torch.Tensor((1,), torch.float32),), {})


@pytest.mark.parametrize("name, want", [("float32", np.float32), ("bfloat16", BF16), ("int32", np.int32),
                                        ("int64", np.int64), ("uint8", np.uint8), ("uint32", np.uint32),
                                        ("float8_e4m3fn", np.uint8)])
def test_as_cupy_is_a_view_of_the_same_memory(torch, name, want):
    dt = getattr(torch, name)
    t = torch.Tensor((3, 5), dt, device=("cuda", 0), ptr=0x7F0000001000)
    a = interop.as_cupy(t, "x")
    want = np.dtype(want)
    assert a.dtype == want and a.shape == (3, 5) and a.data.ptr == t.ptr and a.device.id == 0
    assert a.strides == (5 * want.itemsize, want.itemsize) and a.flags.c_contiguous
    alive = weakref.ref(t)
    del t
    gc.collect()
    assert alive() is not None  # the view keeps the tensor alive
    del a
    gc.collect()
    assert alive() is None


def test_as_cupy_keeps_strides_and_device(torch):
    t = torch.Tensor((4, 6), torch.float32, device=("cuda", 1), strides=(1, 4))  # a transposed [6, 4]
    a = interop.as_cupy(t, "x")
    assert a.strides == (4, 16) and not a.flags.c_contiguous and a.device.id == 1
    assert a.data.mem.size == (3 * 1 + 5 * 4 + 1) * 4  # the span the strides reach
    empty = interop.as_cupy(torch.Tensor((0, 6), torch.int32, ptr=0), "ids")
    assert empty.shape == (0, 6) and empty.size == 0


def test_as_cupy_refuses_cpu_tensors_and_foreign_dtypes(torch):
    with pytest.raises(TypeError, match=r"x\[1\] is a torch tensor on the CPU.*\.cuda\(\)"):
        interop.as_cupy(torch.Tensor((2, 2), torch.float32, device=("cpu", None)), "x[1]")
    with pytest.raises(TypeError, match=r"topk_weights has torch dtype torch\.complex64"):
        interop.as_cupy(torch.Tensor((2, 2), torch.complex64), "topk_weights")


def test_torch_messages_name_the_torch_remedies():
    msg = interop._torch_message("x[rank 0] must be C-contiguous, got strides (2, 4) (use cupy.ascontiguousarray)")
    assert "tensor.contiguous()" in msg and "cupy.ascontiguousarray" in msg
    msg = interop._torch_message("x has dtype float16; expected bfloat16 or float32 (convert with .astype(...))")
    assert "tensor.to(dtype)" in msg
    msg = interop._torch_message("x[rank 1] is on GPU 1; this rank runs on GPU 0: copy it there with "
                                 "`with cupy.cuda.Device(0): a = a.copy()`")
    assert "t.to('cuda:0')" in msg and "cupy.cuda.Device(0)" in msg
    assert "or a torch CUDA tensor" in interop._torch_message("h must be a cupy.ndarray, got list")


def test_torch_call_converts_arguments_and_results(torch, monkeypatch):
    """The plumbing of a torch call (streams and allocator stubbed out: they need the device)."""
    import contextlib

    seen = {}
    monkeypatch.setattr(interop, "_torch_mode", lambda devices, home: (seen.update(devices=devices, home=home),
                                                                       contextlib.nullcontext())[1])
    monkeypatch.setattr(interop, "as_torch", lambda a: ("torch view", a.shape))

    @interop.torch_aware
    def op(x, ys, *, out=None, scale=1.0):
        import cupy
        assert isinstance(x, cupy.ndarray) and isinstance(ys, list) and all(isinstance(y, cupy.ndarray) for y in ys)
        return (x, [x[:1]], out, scale)

    x = torch.Tensor((2, 4), torch.float32, device=("cuda", 1))
    ys = [torch.Tensor((3,), torch.int32, device=("cuda", 1))]
    o = torch.Tensor((2, 4), torch.float32, device=("cuda", 1))
    res = op(x, ys, out=o, scale=2.0)
    assert type(res) is tuple and res[0] is x  # an argument given back is the caller's own tensor
    assert res[1] == [("torch view", (1, 4))] and res[2] is o and res[3] == 2.0
    assert seen == {"devices": [1], "home": 1}  # no Buffer: the device of the first tensor
    with pytest.raises(TypeError, match=r"ys\[0\] is a torch tensor on the CPU"):
        op(x, [torch.Tensor((3,), torch.int32, device=("cpu", None))])


def test_torch_call_rewrites_argument_errors(torch, monkeypatch):
    import contextlib

    monkeypatch.setattr(interop, "_torch_mode", lambda devices, home: contextlib.nullcontext())

    @interop.torch_aware
    def op(x):
        raise ValueError("x must be C-contiguous (use cupy.ascontiguousarray)")

    with pytest.raises(ValueError, match=r"tensor\.contiguous\(\)"):
        op(torch.Tensor((2, 2), torch.float32))
    with pytest.raises(ValueError, match=r"^x must be C-contiguous \(use cupy\.ascontiguousarray\)$"):
        op(np.zeros(2))  # no tensor: the message is CuPy's


def test_moe_weights_hold_torch_tensors_as_cupy_views(torch):
    import cupy

    G, H, I, E = 2, 16, 8, 4
    w = cuep.moe.MoEWeights(torch.Tensor((G, H, 2 * I), torch.bfloat16), torch.Tensor((G, I, H), torch.bfloat16),
                            torch.Tensor((H, E), torch.float32))
    assert all(isinstance(a, cupy.ndarray) for a in (w.w_gate_up, w.w_down, w.router))
    assert w.w_gate_up.dtype == BF16 and w.router.dtype == np.float32 and w.n_held == G and w.intermediate == I
