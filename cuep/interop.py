"""PyTorch interop without a torch dependency: torch CUDA tensors in, torch tensors out, on torch's stream.

cuep's public calls (:func:`cuep.dispatch`, :func:`cuep.combine` and their async/wait halves, :mod:`cuep.ops`,
:func:`cuep.moe.moe_forward` and :func:`cuep.moe.route`) take torch tensors through :func:`torch_aware` (the EP
calls, ``ops.quantize`` and ``ops.fused_silu`` once their common CuPy call is ruled out). A call none of whose arguments
is a torch tensor (nor a :class:`cuep.Dispatched` made by a torch call) goes straight through; torch is never
imported here (a tensor can only exist once its user has imported torch, so ``sys.modules`` is asked first). A call
with torch tensors runs in *torch mode*:

* every torch CUDA tensor becomes a zero-copy CuPy view (same memory, shape and strides, so cuep's own checks still
  see a non-contiguous input); a tensor on the CPU is refused, naming the argument;
* every launch goes to torch's current stream of its device (made CuPy's current stream for the call), so cuep is
  ordered with the torch work around it, and the call can be captured by ``torch.cuda.graph``;
* CuPy allocations inside the call (ops outputs, temporaries) come from torch's caching allocator, so they are
  stream-ordered with torch and, under capture, come from the graph's private pool (``cudaMalloc`` is not allowed
  while a graph is being captured);
* results come back as torch tensors (lists stay lists, tuples stay tuples), zero-copy: a dispatch's outputs are
  views of the buffer, made once per buffer and reused, so a call under capture converts nothing new.

Without an argument :class:`cuep.Buffer` a torch call runs on the device of its first tensor, as torch ops do.
Unsigned 16/32/64-bit CuPy arrays (``row_offsets``, ``scales_offsets``) come back as the signed torch dtype of the
same size (same bits; the values are below 2**31), since torch's wider unsigned dtypes have few kernels. There is
no autograd: results never require grad.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
import warnings
import weakref

import ml_dtypes
import numpy as np

__all__ = ["torch_aware", "is_torch_tensor", "as_cupy", "as_torch"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_SIGNED = {np.dtype(np.uint16): np.dtype(np.int16), np.dtype(np.uint32): np.dtype(np.int32),
           np.dtype(np.uint64): np.dtype(np.int64)}
# Attributes of a buffer rank (cuep.buffer._Rank) that calls return views of: converted to torch once, then reused.
_PERSISTENT = ("tokens", "scales", "row_offsets", "expert_ids", "src_info", "scales_offsets", "combined",
               "combined_unreduced")
_DISPATCHED_FIELDS = ("tokens", "scales", "row_offsets", "expert_ids", "src_info", "scales_offsets")


# ---- detection (the hot path: no torch import, a few isinstance checks) -------------------------------------------
def _tensor_type():
    """torch.Tensor if torch has been imported by anyone, else None (then no argument can be a tensor)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def is_torch_tensor(a) -> bool:
    """Whether ``a`` is a torch tensor (without importing torch)."""
    tensor = _tensor_type()
    return tensor is not None and isinstance(a, tensor)


# Per argument type, for the torch.Tensor in _KINDS_OF: 0 never torch (a CuPy array, a str, None, a number: no
# _torch attribute and no instance dict to hold one), 1 look at the value (a tensor, a list or tuple, a Dispatched
# with its _torch flag, any object that may carry one). One dict lookup per argument on the hot path instead of
# isinstance and a getattr that misses (which costs an exception inside).
_KINDS: dict = {}
_KINDS_OF: list = [None]


def _kind(t, tensor) -> int:
    if _KINDS_OF[0] is not tensor:
        _KINDS.clear()
        _KINDS_OF[0] = tensor
    k = _KINDS[t] = int(issubclass(t, (tensor, list, tuple)) or hasattr(t, "_torch") or t.__dictoffset__ != 0)
    return k


def _any_torch(values, tensor, items: bool) -> bool:
    """Whether one of ``values`` is a torch tensor or a torch call's Dispatched (``items``: also one item of a list
    or tuple among them). A plain loop: this runs on every call with torch imported, torch arguments or not."""
    kinds = _KINDS if _KINDS_OF[0] is tensor else {}
    for v in values:
        t = type(v)
        k = kinds.get(t)
        if k is None:
            k = _kind(t, tensor)
        if not k:
            continue
        if t is not tuple and t is not list and (isinstance(v, tensor) or getattr(v, "_torch", False) is True):
            return True
        if items and isinstance(v, (list, tuple)) and _any_torch(v, tensor, False):
            return True
    return False


def _wants_torch(args, kwargs) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    tensor = getattr(torch, "Tensor", None)
    if tensor is None:
        return False
    return _any_torch(args, tensor, True) or (bool(kwargs) and _any_torch(kwargs.values(), tensor, True))


# ---- dtypes -----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _dtype_maps():
    """(torch dtype -> numpy dtype, numpy dtype -> torch dtype) for the dtypes cuep can meet."""
    torch = sys.modules["torch"]
    to_np = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
             torch.bfloat16: _BF16, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
             torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.bool_}
    for name, dt in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
        if hasattr(torch, name):
            to_np[getattr(torch, name)] = dt
    # one-byte float formats travel as their bytes (cuep's fp8 / fp4 payloads and scales are uint8)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2"):
        if hasattr(torch, name):
            to_np[getattr(torch, name)] = np.uint8
    to_np = {k: np.dtype(v) for k, v in to_np.items()}
    to_torch = {np.dtype(v): k for k, v in ((torch.float32, np.float32), (torch.float64, np.float64),
                                            (torch.float16, np.float16), (torch.int8, np.int8),
                                            (torch.int16, np.int16), (torch.int32, np.int32),
                                            (torch.int64, np.int64), (torch.uint8, np.uint8),
                                            (torch.bool, np.bool_))}
    return to_np, to_torch


# ---- torch -> CuPy ------------------------------------------------------------------------------------------------
def as_cupy(t, name: str = "tensor"):
    """A zero-copy CuPy view of a torch CUDA tensor: same memory, shape and strides (bytes), on the tensor's device.

    The view keeps the tensor alive. bfloat16 becomes ``ml_dtypes.bfloat16``; float8 / float4 tensors become uint8
    (their bytes). Raises ``TypeError`` naming ``name`` for a CPU tensor or a dtype cuep has no use for.
    """
    import cupy

    if not t.is_cuda:
        raise TypeError(f"{name} is a torch tensor on the {t.device.type.upper()}; cuep runs on the GPU: move it "
                        f"with .cuda() (or .to('cuda:N'))")
    dtype = _dtype_maps()[0].get(t.dtype)
    if dtype is None:
        raise TypeError(f"{name} has torch dtype {t.dtype}, which cuep does not take (bfloat16, float32, integer or "
                        f"uint8 tensors)")
    dev, shape, size = t.get_device(), tuple(t.shape), t.numel()
    if t.is_contiguous():  # the usual case: CuPy's default (C) strides, which it builds faster than given ones
        span, strides = size * dtype.itemsize, None
    else:
        elems = t.stride()
        span = (1 + sum((n - 1) * s for n, s in zip(shape, elems))) * dtype.itemsize if size else 0
        strides = tuple(s * dtype.itemsize for s in elems)
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), span, t, dev)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0), strides=strides)


# ---- CuPy -> torch ------------------------------------------------------------------------------------------------
def as_torch(a):
    """A zero-copy torch view of a CuPy array, which it keeps alive.

    bfloat16 comes back as torch.bfloat16; uint16/32/64 as the signed torch dtype of the same size (same bits).
    Memory a torch call allocated is viewed through the torch tensor that holds it; any other memory through
    ``__cuda_array_interface__``.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # noqa: F811  (the caller asked for a torch tensor)
    view = _torch_block_view(torch, a)
    if view is not None:
        return view
    to_torch = _dtype_maps()[1]
    dt = a.dtype
    device = torch.device("cuda", a.device.id)
    if dt == _BF16:
        want, a = torch.bfloat16, a.view(np.int16)
    else:
        want = None
        if dt in _SIGNED:
            a = a.view(_SIGNED[dt])
        if a.dtype not in to_torch:
            raise TypeError(f"a CuPy array of dtype {dt} has no torch counterpart")
    if a.size == 0:  # a null data pointer: nothing to share
        t = torch.empty(a.shape, dtype=to_torch[a.dtype], device=device)
    else:
        t = torch.as_tensor(a, device=device)
    return t.view(want) if want is not None else t


def _torch_block_view(torch, a):
    """``a`` as a view of the torch tensor :func:`_torch_malloc` made for its memory (torch ops only: nothing asks
    the driver about the pointer, which matters under graph capture), or None when torch did not allocate it."""
    if a.size == 0:
        return None
    block = _torch_blocks.get(a.data.mem.ptr)
    if block is None:
        return None
    k = a.dtype.itemsize
    offset = a.data.ptr - a.data.mem.ptr
    if offset % k or block.numel() % k or any(s % k for s in a.strides):
        return None
    dt = torch.bfloat16 if a.dtype == _BF16 else _dtype_maps()[1].get(_SIGNED.get(a.dtype, a.dtype))
    if dt is None:
        return None
    return block.view(dt).as_strided(a.shape, [s // k for s in a.strides], offset // k)


def _rank_views(r) -> dict:
    """The torch views of one buffer rank's persistent outputs, made once (kept on the rank object)."""
    views = r.__dict__.get("_torch_views")
    if views is None:
        views = r.__dict__["_torch_views"] = {}
    return views


def _persistent_view(r, attr: str):
    arr = getattr(r, attr)
    if arr is None:
        return None
    hit = _rank_views(r).get(attr)
    if hit is None or hit[0] is not arr:
        hit = _rank_views(r)[attr] = (arr, as_torch(arr))
    return hit[1]


def _buffer_view(buf, a):
    """``a`` as a torch view if it is one of ``buf``'s persistent outputs or a leading-rows slice of one (combine's
    ``out[:N]``), from the cached views; else None."""
    if buf is None:
        return None
    base = a.base if a.base is not None else a
    for r in buf._ranks:
        for attr in _PERSISTENT:
            arr = getattr(r, attr, None)
            if arr is None or base is not arr:
                continue
            view = _persistent_view(r, attr)
            if a is arr:
                return view
            if a.data.ptr == arr.data.ptr and a.shape[1:] == arr.shape[1:] and a.strides == arr.strides:
                return view[: a.shape[0]]
    return None


def _to_torch_result(v, buf, originals: dict):
    import cupy

    from .ep import Dispatched

    if isinstance(v, cupy.ndarray):
        t = originals.get(id(v))  # an argument given back (``out=``): the caller's own tensor
        if t is not None:
            return t
        view = _buffer_view(buf, v)
        return view if view is not None else as_torch(v)
    if isinstance(v, Dispatched):
        if not v._torch:
            r = next(r for r in v._buffer._ranks if r.rank == v.rank)
            for name in _DISPATCHED_FIELDS:  # in place: the object stays the one the wait half will be given
                setattr(v, name, _persistent_view(r, name))
            v._torch = True
        return v
    if isinstance(v, (list, tuple)):
        return type(v)(_to_torch_result(e, buf, originals) for e in v)
    return v


# ---- the short paths' view of torch (cuep.ep, cuep.ops) -----------------------------------------------------------
class TorchBindings:
    """What the torch short paths take from the torch module, looked up once per module (:func:`torch_bindings`):
    the tensor type, the dtypes cuep takes, and a device's current stream handle (``stream(dev)``)."""

    __slots__ = ("module", "tensor", "strided", "bf16", "f32", "x_dtypes", "i32s", "f32s", "u8s", "stream",
                 "devices", "of_numpy")

    def __init__(self, torch):
        self.module, self.tensor, self.strided = torch, torch.Tensor, torch.strided
        self.bf16, self.f32 = torch.bfloat16, torch.float32
        self.x_dtypes, self.i32s, self.f32s, self.u8s = (torch.bfloat16, torch.float32), (torch.int32,), \
            (torch.float32,), (torch.uint8,)
        self.stream = raw_stream_getter(torch)
        self.devices: dict = {}  # id -> torch.device("cuda", id)
        # the torch dtype of a CuPy output dtype (unsigned as the signed dtype of its size, as results come back)
        self.of_numpy = {_BF16: torch.bfloat16, np.dtype(np.float32): torch.float32,
                         np.dtype(np.uint8): torch.uint8, np.dtype(np.uint32): torch.int32,
                         np.dtype(np.int32): torch.int32}

    def device(self, dev: int):
        d = self.devices.get(dev)
        if d is None:
            d = self.devices[dev] = self.module.device("cuda", dev)
        return d


_bindings: list = [None]


def torch_bindings() -> TorchBindings:
    """The :class:`TorchBindings` of the torch module imported now (a torch call: torch is in ``sys.modules``)."""
    torch = sys.modules["torch"]
    tb = _bindings[0]
    if tb is None or tb.module is not torch:
        tb = _bindings[0] = TorchBindings(torch)
    return tb


def tensor_ptr(t, tb: TorchBindings, shape, dtypes, device: int, mask: int) -> int:
    """The device address of ``t`` if it is a contiguous CUDA tensor of ``shape`` (a tuple; None: the caller has
    checked the shape) and one of ``dtypes`` on ``device`` whose address has no bit of ``mask`` set, else 0: a short
    path's argument test in a few reads (cuep.ep._rows_ptr's for torch; the callers' shapes have rows, so a tensor
    that passes has memory and a nonzero address). ``shape`` compares with ``t.shape`` in one read (``size(i)``
    costs more per call than the whole torch.Size); a CPU tensor's ``get_device()`` is -1."""
    if type(t) is tb.tensor and t.dtype in dtypes and t.layout is tb.strided \
            and (shape is None or t.shape == shape) and t.is_contiguous() and t.get_device() == device:
        ptr = t.data_ptr()
        if not ptr & mask:
            return ptr
    return 0


# ---- streams and allocations of a torch call ----------------------------------------------------------------------
_streams: dict[tuple[int, int], object] = {}
# device address -> the torch uint8 tensor _torch_malloc made there (gone with the tensor: torch reuses addresses)
_torch_blocks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def raw_stream_getter(torch):
    """A function of a device id giving torch's current stream's handle there: torch's own raw getter where it has
    one (no Stream object made per call), else through ``torch.cuda.current_stream``."""
    raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda dev: torch.cuda.current_stream(dev).cuda_stream)


def _cupy_stream(torch, dev: int):
    """torch's current stream of device ``dev`` as a CuPy stream object (cached per stream; CuPy never owns it)."""
    ptr = raw_stream_getter(torch)(dev)
    s = _streams.get((dev, ptr))
    if s is None:
        import cupy

        with warnings.catch_warnings():
            # CuPy 14 deprecates ExternalStream for Stream.from_external, but the Stream that makes destroys its
            # handle when collected (CuPy 14's stream.pyx), and this stream is torch's
            warnings.simplefilter("ignore", DeprecationWarning)
            s = _streams[(dev, ptr)] = cupy.cuda.ExternalStream(ptr, dev)
    return s


def _torch_malloc(nbytes: int):
    """A CuPy allocator over torch's caching allocator: the block is ordered on torch's current stream (the call's
    stream) and, under ``torch.cuda.graph`` capture, comes from the graph's private pool."""
    import cupy

    torch = sys.modules["torch"]
    dev = cupy.cuda.runtime.getDevice()
    t = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", dev))
    if nbytes:
        _torch_blocks[t.data_ptr()] = t
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, dev), 0)


@contextlib.contextmanager
def _torch_mode(devices: list[int], home: int | None):
    """CuPy's current stream of each device = torch's current stream, allocations from torch, and (``home``) the
    current device; all restored on exit, also on error. (The streams are set back directly: leaving CuPy's
    ``with stream`` restores the top of its stack, not a stream made current by ``.use()``.)"""
    import cupy

    torch = sys.modules["torch"]
    runtime = cupy.cuda.runtime
    current = runtime.getDevice()
    saved = []  # (device, its current stream before the call)
    try:
        for dev in devices:
            stream = _cupy_stream(torch, dev)
            if dev != current:
                runtime.setDevice(dev)
            saved.append((dev, cupy.cuda.get_current_stream()))
            stream.use()
            if dev != current:
                runtime.setDevice(current)
        if home is not None and home != current:
            runtime.setDevice(home)
        with cupy.cuda.using_allocator(_torch_malloc):
            yield
    finally:
        for dev, before in reversed(saved):
            runtime.setDevice(dev)
            before.use()
        runtime.setDevice(current)


# ---- arguments ----------------------------------------------------------------------------------------------------
def _to_cupy_arg(v, name: str, tensor, originals: dict, devices: list):
    if isinstance(v, tensor):
        a = as_cupy(v, name)
        originals[id(a)] = v
        dev = a.data.device_id
        if dev not in devices:
            devices.append(dev)
        return a
    if isinstance(v, (list, tuple)):
        return type(v)(_to_cupy_arg(e, f"{name}[{i}]", tensor, originals, devices) for i, e in enumerate(v))
    return v


def _buffer_of(values):
    """The cuep.Buffer a call works on: an argument, or the buffer of a Dispatched argument."""
    from .buffer import Buffer

    for v in values:
        for e in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(e, Buffer):
                return e
            buf = getattr(e, "_buffer", None)
            if isinstance(buf, Buffer):
                return buf
    return None


# In torch mode, argument errors name torch's remedies next to CuPy's (the checks are shared with CuPy callers).
_HINTS = (
    ("must be a cupy.ndarray", "must be a cupy.ndarray or a torch CUDA tensor"),
    ("use cupy.ascontiguousarray", "use tensor.contiguous() or cupy.ascontiguousarray"),
    ("convert with .astype(...)", "convert with tensor.to(dtype) or array.astype(...)"),
)
_DEVICE_COPY = re.compile(r"`with cupy\.cuda\.Device\((\d+)\): a = a\.copy\(\)`")


def _torch_message(msg: str) -> str:
    for old, new in _HINTS:
        msg = msg.replace(old, new)
    return _DEVICE_COPY.sub(r"`t.to('cuda:\1')` (torch) or `with cupy.cuda.Device(\1): a = a.copy()`", msg)


def _call_torch(fn, names: tuple, args, kwargs):
    """``fn`` in torch mode; ``names``: its positional parameters' names (for messages)."""
    tensor = _tensor_type()
    originals: dict[int, object] = {}
    devices: list[int] = []
    args = [_to_cupy_arg(v, names[i] if i < len(names) else f"args[{i}]", tensor, originals, devices)
            for i, v in enumerate(args)]
    kwargs = {k: _to_cupy_arg(v, k, tensor, originals, devices) for k, v in kwargs.items()}
    buf = _buffer_of(args + list(kwargs.values()))
    home = None
    if buf is not None:
        devices = list(dict.fromkeys(list(buf.group.devices) + devices))
    elif devices:
        home = devices[0]
    try:
        with _torch_mode(devices, home):
            out = fn(*args, **kwargs)
            return _to_torch_result(out, buf, originals)
    except (TypeError, ValueError) as e:
        msg = _torch_message(str(e))
        if type(e) in (TypeError, ValueError) and msg != str(e):
            raise type(e)(msg).with_traceback(e.__traceback__) from None
        raise


def torch_aware(fn=None, *, fast=None):
    """Let ``fn`` take torch CUDA tensors (and return torch tensors, running on torch's current stream); a call
    without torch arguments goes straight to ``fn``. See the module docstring.

    ``fast``: a torch call's short path, tried first with the call's own arguments: its result, or
    ``NotImplemented`` to leave the call to torch mode (which then raises any error with its message). Used as
    ``@torch_aware`` or ``@torch_aware(fast=...)``. (cuep's EP calls and ops.quantize / ops.fused_silu try their
    common CuPy call before they reach the wrapper: the scan costs 0.5-1 us a call with torch imported.)
    """
    if fn is None:
        return functools.partial(torch_aware, fast=fast)
    names = tuple(p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _wants_torch(args, kwargs):
            return fn(*args, **kwargs)
        if fast is not None:
            out = fast(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return _call_torch(fn, names, args, kwargs)

    return call
