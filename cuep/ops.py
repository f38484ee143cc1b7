"""Single-GPU ops on CuPy arrays: quantize / dequantize token rows, swizzle block scales, fused SwiGLU.

Every op reproduces :mod:`cuep.reference` bit for bit (``docs/formats.md``). Arguments are checked before any
launch (``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, layout, device or value, each
naming the argument). Kernels come from ``cuep/cuda_src`` through :mod:`cuep._kernels` (compiled once per process
and device); grids are sized from the SM count and the kernels' occupancy, and the kernels stride over the work.

``fused_silu`` and ``swizzle_block_scales`` read the row count from ``row_offsets[-1]`` on the device: nothing is
copied back to the host, so they can run inside a CUDA graph or right after ``dispatch`` without a sync.
"""
from __future__ import annotations

# cupy is imported inside the functions that use it (as in buffer.py and ep.py): `import cuep` stays cheap and
# loads no CUDA library.
import math

import ml_dtypes
import numpy as np

from . import _kernels
from . import ep as _ep
from .ep import _rows_ptr
from .params import c_contiguous
from .interop import tensor_ptr, torch_aware, torch_bindings
from .formats import (FORMATS, GLOBAL_SCALE_MAX, GLOBAL_SCALE_MIN, SCALE_TILE_BYTES, SCALE_TILE_ROWS, Format,
                      ceil_div, check_hidden, get_format)

__all__ = ["quantize", "dequantize", "swizzle_block_scales", "fused_silu"]

_THREADS = 256        # kOpsThreads in cuda_src/formats.cuh (a CPU test checks they agree)
_MAX_GROUPS = 4096    # kMaxGroups in cuda_src/formats.cuh: row_offsets of the swizzled layouts live in shared memory
_WARP = 32
_SILU_STAGE_BYTES = 4096  # kSiluStageBytes in cuda_src/silu.cu: one span of gate and up per warp
_SILU_STAGES = 2          # kSiluStages in cuda_src/silu.cu
_SILU_THREADS = 512       # kSiluThreads in cuda_src/silu.cu: one block of 16 warps per SM
_QUANTIZE_THREADS = 1024  # kQuantizeThreads in cuda_src/quantize.cu: one block of 32 warps per SM
_QUANTIZE_WARPS = _QUANTIZE_THREADS // 32
_LANE_VALUES = 8      # values per lane per warp step
_INT32_MAX = 2**31 - 1

_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_U32 = np.dtype(np.uint32)
_ROW_OFFSET_DTYPES = tuple(np.dtype(t) for t in (np.int32, np.uint32, np.int64, np.uint64))
_DTYPE_SUFFIX = {_BF16: "bf16", _F32: "f32"}
_X_DTYPES = (_F32, _BF16)
_U8S, _U32S, _F32S = (_U8,), (_U32,), (_F32,)
_RO32 = _ROW_OFFSET_DTYPES[:2]  # row_offsets the kernels read as they are (int32, uint32)
# keys hold the format's name and the dtype's number: hashing a frozen dataclass or a dtype costs per call
_quantize_plans: dict[tuple, tuple] = {}  # (format name, H, dtype.num, device) -> quantize's sizes and launch
_silu_plans: dict[tuple, tuple] = {}      # fused_silu's output shapes and launch per argument signature
_dequantize_plans: dict[tuple, tuple] = {}  # (format name, H, device) -> dequantize's sizes and launch
_swizzle_plans: dict[tuple, tuple] = {}     # (format name, H, rows, G, device) -> swizzle's sizes and launch


_cupy = None
_ND = None  # cupy.ndarray, bound with the module (the checks' fast path compares the type by identity)
_runtime = None  # cupy.cuda.runtime, bound with the module


def _cp():
    """The cupy module, imported on first use (``import cuep`` loads no CUDA library; an ``import`` statement per
    call would cost a microsecond of the call's host time)."""
    global _cupy, _ND, _runtime
    if _cupy is None:
        import cupy

        _ep._cp()  # (the short paths' argument tests: ep._rows_ptr)
        _cupy, _ND, _runtime = cupy, cupy.ndarray, cupy.cuda.runtime
    return _cupy


def _device() -> int:
    """The current device's id (one runtime call; every op asks once and passes it to the checks)."""
    return _cp().cuda.runtime.getDevice()


# ---- argument checks ------------------------------------------------------------------------------------------
def _check_array(a, argname: str, dtypes, ndim: int, shape=None, align: int = 16, dev: int | None = None) -> None:
    """Type, dtype, ndim, exact shape (None entries are free), C-contiguity, device and alignment of a CuPy array.

    ``align``: the start address must be a multiple of it (16: the kernels move rows and scales with 16-byte
    vectors; 0: the dtype's itemsize). Fresh CuPy/torch allocations are 256-byte aligned; a view at an odd offset
    of a larger allocation is not, and a misaligned load would be a fatal device fault rather than an exception.
    ``dev``: the current device if the caller already asked for it.
    O(1) host work: attributes CuPy stores, no objects built unless a check fails; a right argument passes one
    test per property (the host cost of a call).
    """
    if type(a) is _ND and a.ndim == ndim and a.dtype in dtypes and a._c_contiguous and (shape is None
                                                                                           or a.shape == shape):
        mem = a.data
        if mem.device_id == (_device() if dev is None else dev) and not mem.ptr % (align or a.dtype.itemsize):
            return
    cupy = _cp()
    if not isinstance(a, cupy.ndarray):
        if isinstance(a, np.ndarray):
            raise TypeError(f"{argname} must be a cupy.ndarray, got numpy.ndarray (host memory): move it to the GPU "
                            f"first with cupy.asarray(...)")
        raise TypeError(f"{argname} must be a cupy.ndarray, got {type(a).__name__} (convert it with cupy.asarray)")
    if a.dtype not in dtypes:  # a dtype equals its scalar type too; the message spells them as dtypes
        dtypes = tuple(np.dtype(d) for d in dtypes)
        raise TypeError(f"{argname} must have dtype {' or '.join(str(d) for d in dtypes)}, got {a.dtype} "
                        f"(convert with .astype(...))")
    if a.ndim != ndim:
        raise ValueError(f"{argname} must be {ndim}-D, got shape {a.shape}")
    if shape is not None:
        got = a.shape
        for k in range(min(len(got), len(shape))):
            if shape[k] is not None and got[k] != shape[k]:
                want_s = ", ".join("*" if w is None else str(w) for w in shape)
                raise ValueError(f"{argname} must have shape [{want_s}], got {a.shape}")
    if not c_contiguous(a):
        raise ValueError(f"{argname} must be C-contiguous (the kernels ignore strides); use cupy.ascontiguousarray")
    mem = a.data
    if dev is None:
        dev = _device()
    if mem.device_id != dev:
        raise ValueError(f"{argname} is on device {a.device.id}, but the current device is {dev}: call the op "
                         f"inside `with cupy.cuda.Device({a.device.id}):`, or copy the array to device {dev}")
    align = align or a.dtype.itemsize
    if a.size and mem.ptr % align:
        raise ValueError(f"{argname} starts at address {a.data.ptr:#x}, not on a {align}-byte boundary (the kernels "
                         f"read it with {align}-byte loads): pass a fresh array, e.g. a .copy()")


def _check_global_scale(global_scale) -> float | np.float32:
    """nvfp4's g, in [2**-100, 2**100] (as cuep.reference checks it), for a float32 kernel parameter (packing
    rounds a Python float to float32 as numpy does)."""
    if type(global_scale) is float and GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX:
        # the usual case, one comparison: both bounds are float32 values, so the rounded g stays inside them
        # (returned as is: building a numpy scalar would cost more than the rest of the check)
        return global_scale
    msg = f"global_scale={global_scale!r} must be a float in [2**-100, 2**100] (nvfp4's global scale)"
    # a number, not a string that np.float32 would parse, nor a bool (as cuep.reference and cuep.dispatch check it)
    if isinstance(global_scale, (bool, np.bool_)) or not isinstance(global_scale, (int, float, np.integer,
                                                                                   np.floating)):
        raise ValueError(msg)
    try:
        with np.errstate(all="ignore"):
            g = np.float32(global_scale)
    except (TypeError, ValueError):
        raise ValueError(msg) from None
    if not GLOBAL_SCALE_MIN <= g <= GLOBAL_SCALE_MAX:
        raise ValueError(msg)
    return g


def _check_hidden_arg(f: Format, hidden, argname: str = "hidden") -> int:
    if isinstance(hidden, np.integer):
        hidden = int(hidden)
    if isinstance(hidden, bool):
        raise ValueError(f"{argname}={hidden!r} must be a positive int")
    check_hidden(f, hidden, argname)
    if hidden > _INT32_MAX // 2:
        raise ValueError(f"{argname}={hidden} is too large")
    return hidden


def _check_out_tuple(out, argname: str, n: int) -> tuple:
    if not isinstance(out, (tuple, list)) or len(out) != n:
        got = f"{type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise TypeError(f"{argname} must be a tuple of {n} cupy arrays, got {got}")
    return tuple(out)


def _check_row_offsets(row_offsets, capacity_name: str, capacity: int, dev: int | None = None
                       ) -> tuple[cupy.ndarray, int]:
    """row_offsets [G+1] of any 32/64-bit integer dtype -> (int32 view or copy on the device, G)."""
    _check_array(row_offsets, "row_offsets", _ROW_OFFSET_DTYPES, 1, dev=dev)
    n_groups = row_offsets.size - 1
    if n_groups < 1:
        raise ValueError(f"row_offsets must hold G + 1 >= 2 offsets, got shape {row_offsets.shape}")
    if n_groups > _MAX_GROUPS:
        raise ValueError(f"row_offsets has G={n_groups} groups; at most {_MAX_GROUPS} are supported")
    if capacity > _INT32_MAX:
        raise ValueError(f"{capacity_name}={capacity} rows exceed int32")
    if row_offsets.dtype.itemsize == 4:
        ro = row_offsets   # the kernels read it as int32: uint32 offsets < 2**31 read the same
    else:
        ro = row_offsets.astype(np.int32)  # a device-side cast: no host sync
    return ro, n_groups


# ---- launch helpers -------------------------------------------------------------------------------------------
_sm_count: dict[int, int] = {}
_occupancy: dict[tuple[str, str, int, int], int] = {}


def _kernel(filename: str, name: str):
    return _kernels.function(filename, name)


def _grid(filename: str, name: str, kernel, work_blocks: int, smem: int = 0, threads: int = _THREADS) -> int:
    """Blocks (of ``threads``) for a grid-stride kernel: enough for the work, at most what fits on the GPU at
    once."""
    import cupy
    from cupy.cuda import driver

    dev = cupy.cuda.Device().id
    sms = _sm_count.get(dev)
    if sms is None:
        sms = _sm_count[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    key = (filename, name, dev, smem)
    occ = _occupancy.get(key)
    if occ is None:
        occ = _occupancy[key] = max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr,
                                                                                        threads, smem))
    return max(1, min(int(work_blocks), sms * occ))


def _silu_ring_bytes() -> int:
    """Dynamic shared memory of fused_silu's load ring per block (silu.cu: kSiluStages x kSiluStageBytes x warps)."""
    return _SILU_STAGES * _SILU_STAGE_BYTES * (_SILU_THREADS // _WARP)


_prepared: dict[tuple, tuple] = {}


def _prepare(filename: str, name: str, sig: str, dev: int, smem: int = 0, threads: int = _THREADS):
    """(launch, largest useful grid) of the grid-stride kernel ``filename:name`` on device ``dev`` (blocks of
    ``threads``), its C parameters in order as ``sig`` spells them (P a device pointer as an int, q int64, i int32,
    f float32).

    Prepared once per (kernel, device, shared memory) and reused: per call only the arguments are packed
    (:class:`cuep._kernels.PreparedLaunch`); ``launch(grid, *args)`` runs it on the current stream.
    """
    key = (filename, name, dev, smem)
    hit = _prepared.get(key)
    if hit is None:
        kern = _kernel(filename, name)
        _kernels.allow_dynamic_smem(kern, smem)
        max_grid = _grid(filename, name, kern, 2**31 - 1, smem, threads)
        slots = tuple(range(0, 8 * len(sig), 8))
        launch = _kernels.PreparedLaunch(kern, threads, smem, 8 * len(sig), slots, _kernels.slot_struct(sig))
        hit = _prepared[key] = (launch, max_grid, sig)
    launch, max_grid, want = hit
    if sig != want:
        raise RuntimeError(f"{filename}:{name} launched with parameters {sig!r}, earlier with {want!r}")
    return launch, max_grid


def _warp_item_blocks(n_rows: int, hidden: int, threads: int = _THREADS) -> int:
    """Blocks of ``threads`` that give every (row, warp step) its own warp: an upper bound on the useful grid."""
    warps = n_rows * ceil_div(hidden, _WARP * _LANE_VALUES)
    return ceil_div(warps, threads // _WARP)


def _swizzle_tiles(capacity: int, n_groups: int) -> int:
    """Row tiles the swizzled scales of `capacity` rows in `n_groups` groups can need (each group starts one)."""
    return ceil_div(capacity, SCALE_TILE_ROWS) + n_groups


# ---- quantize / dequantize --------------------------------------------------------------------------------------
# ---- the torch short paths of quantize and fused_silu -------------------------------------------------------------
# A torch call with bare CUDA tensors whose plan an earlier call made (so its shapes were checked then): the argument
# tests in a few reads, outputs from torch (or ``out``), the same launch on torch's current stream, no CuPy views
# (cuep.interop). Anything else returns NotImplemented: torch mode takes the call and raises with its messages.
def _x_dtype(t, tb):
    """The NumPy dtype of a float input tensor (bf16 / float32), else None."""
    return _BF16 if t.dtype is tb.bf16 else _F32 if t.dtype is tb.f32 else None


def _quantize_torch(x, fmt, global_scale=1.0, out=None):
    tb = torch_bindings()
    f = FORMATS.get(fmt) if type(fmt) is str else None
    if f is None or type(x) is not tb.tensor or type(global_scale) is not float \
            or not GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX or _cupy is None:
        return NotImplemented
    shp = x.shape
    if len(shp) != 2 or not shp[0]:
        return NotImplemented
    (n, h), dt = shp, _x_dtype(x, tb)
    dev = _cupy.cuda.runtime.getDevice()
    plan = _quantize_plans.get((f.name, h, dt.num, dev)) if dt is not None else None
    xp = tensor_ptr(x, tb, None, tb.x_dtypes, dev, 15) if plan is not None and plan[3] is not None else 0
    if not xp:
        return NotImplemented
    pbytes, sbytes, steps, (fn, max_grid) = plan
    if out is None:
        d = tb.device(dev)
        payload = tb.module.empty((n, pbytes), dtype=tb.module.uint8, device=d)
        scales = tb.module.empty((n, sbytes), dtype=tb.module.uint8, device=d)
        pp, sp = payload.data_ptr(), scales.data_ptr()
    elif type(out) is tuple and len(out) == 2:
        payload, scales = out
        pp = tensor_ptr(payload, tb, (n, pbytes), tb.u8s, dev, 15)
        sp = tensor_ptr(scales, tb, (n, sbytes), tb.u8s, dev, 15) if pp else 0
        if not sp:
            return NotImplemented
    else:
        return NotImplemented
    fn.launch_on(tb.stream(dev), min(ceil_div(n * steps, _QUANTIZE_THREADS // _WARP), max_grid), xp, pp, sp, n, h,
                 global_scale)
    return payload, scales


def _fused_silu_torch(h, row_offsets, out_fmt="bf16", interleaved=False, global_scale=1.0, out=None):
    tb = torch_bindings()
    f = FORMATS.get(out_fmt) if type(out_fmt) is str else None
    ro = row_offsets
    if f is None or type(h) is not tb.tensor or type(ro) is not tb.tensor or type(global_scale) is not float \
            or not GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX or _cupy is None:
        return NotImplemented
    shp, ro_shp = h.shape, ro.shape
    if len(shp) != 2 or not shp[0] or len(ro_shp) != 1:
        return NotImplemented
    (cap, width), dt, n_groups = shp, _x_dtype(h, tb), ro_shp[0] - 1
    dev = _cupy.cuda.runtime.getDevice()
    plan = _silu_plans.get((f.name, dt.num, cap, width, bool(interleaved), n_groups, dev)) if dt is not None \
        else None
    hp = tensor_ptr(h, tb, None, tb.x_dtypes, dev, 15) if plan is not None else 0
    rp = tensor_ptr(ro, tb, None, tb.i32s, dev, 15) if hp else 0
    if not rp:
        return NotImplemented
    shapes, _, fn, grid, max_tiles, _ = plan
    kinds = [tb.of_numpy[d] for _, d in shapes]
    if out is None:
        outs = [tb.module.empty(s, dtype=k, device=tb.device(dev)) for (s, _), k in zip(shapes, kinds)]
        ptrs = [t.data_ptr() for t in outs]
    else:
        outs = [out] if f.name == "bf16" else list(out) if type(out) is tuple else None
        if outs is None or len(outs) != len(shapes):
            return NotImplemented
        ptrs = []
        for t, (s, d), k in zip(outs, shapes, kinds):  # (a uint32 output: torch mode's dtype rules)
            ptr = tensor_ptr(t, tb, s, (k,), dev, 15) if d != _U32 else 0
            if not ptr:
                return NotImplemented
            ptrs.append(ptr)
    dummy = ptrs[0]  # unused pointer arguments still need a valid address
    fn.launch_on(tb.stream(dev), grid, hp, rp, n_groups, cap, width // 2, dummy,
                 ptrs[1] if len(ptrs) > 1 else dummy, ptrs[2] if len(ptrs) > 2 else dummy, max_tiles, global_scale)
    return outs[0] if f.name == "bf16" else tuple(outs)


# The public ops try the common call first: CuPy arrays and arguments of plain types (none of which can hold a
# tensor) go straight to the op's body, with no scan for torch tensors; anything else goes through torch_aware.
def _plain_out(out) -> bool:
    if out is None or type(out) is _ND:
        return True
    if type(out) is not tuple:
        return False
    for o in out:  # (a loop, not all() over a generator: half the cost per call)
        if type(o) is not _ND:
            return False
    return True


def quantize(x: cupy.ndarray, fmt: str, global_scale: float = 1.0, out=None) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Encode token rows in a wire format on the GPU, bit for bit as :func:`cuep.reference.quantize`.

    Args:
        x: cupy float32 or ``ml_dtypes.bfloat16`` [N, H], C-contiguous; H a multiple of the format's group
            (bf16 8, fp8 128, nvfp4 16, mxfp4 32).
        fmt: ``"bf16" | "fp8" | "nvfp4" | "mxfp4"``.
        global_scale: nvfp4's global scale g (finite, > 0; rounded to float32); checked but unused otherwise.
        out: optional ``(payload, scales)`` of the shapes and dtypes below, written in place.
    Returns:
        ``(payload, scales)``: payload uint8 [N, payload_bytes(H)] (bf16: 2H bytes; fp8: H e4m3 bytes; nvfp4 /
        mxfp4: H/2 bytes, two e2m1 codes per byte, element 2i in the low nibble); scales uint8
        [N, scale_bytes(H)] (fp8: H/128 float32, little-endian; nvfp4: H/16 e4m3; mxfp4: H/32 e8m0; bf16: [N, 0]).
    Raises:
        TypeError, ValueError: naming ``fmt``, ``x``, ``global_scale`` or ``out``.
    """
    if type(x) is _ND and type(fmt) is str:
        done = _quantize_short(x, fmt, global_scale, out)
        if done is not None:
            return done
        if type(global_scale) in (float, int) and _plain_out(out):
            return _quantize(x, fmt, global_scale, out)
    elif _ep._is_tensor(x):  # torch's short path without torch_aware's argument scan
        done = _quantize_torch(x, fmt, global_scale, out)
        if done is not NotImplemented:
            return done
    return _quantize_general(x, fmt, global_scale, out)


def _quantize_short(x, fmt: str, global_scale, out):
    """quantize's common case in few steps, the launch :func:`_quantize` makes: a plan an earlier call made (its
    shapes checked then), a float ``global_scale`` in range, ``out`` None or a tuple of two right arrays. Returns
    ``(payload, scales)``, or None (nothing done) for :func:`_quantize`, which handles every other case and raises
    with a message."""
    n = len(x) if x.ndim == 2 else 0
    if not n or type(global_scale) is not float or not GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX:
        return None
    h, dev = x.size // n, _runtime.getDevice()
    plan = _quantize_plans.get((fmt, h, x.dtype.num, dev))
    if plan is None or plan[3] is None:
        return None
    pbytes, sbytes, steps, (fn, max_grid) = plan
    xp = _rows_ptr(x, n, h, _X_DTYPES, dev, 15)
    if not xp:
        return None
    if out is None:
        payload, scales = _cupy.empty((n, pbytes), _U8), _cupy.empty((n, sbytes), _U8)
        pp, sp = payload.data.ptr, scales.data.ptr
    elif type(out) is tuple and len(out) == 2:
        payload, scales = out
        pp = _rows_ptr(payload, n, pbytes, _U8S, dev, 15)
        sp = _rows_ptr(scales, n, sbytes, _U8S, dev, 15) if pp else 0
        if not sp:
            return None
    else:
        return None
    fn.pack.pack_into(fn.raw, 0, xp, pp, sp, n, h, global_scale)  # (fn(grid, ...) without its call)
    _kernels._launch_raw(fn.func, min(-(-n * steps // _QUANTIZE_WARPS), max_grid), fn.block, fn.smem, fn.argv_ptr,
                         None, dev)
    return payload, scales


def _quantize(x, fmt, global_scale=1.0, out=None):
    # (the usual arguments pass with the fewest calls: each Python call is a tenth of a microsecond of the host cost)
    f = FORMATS.get(fmt) if type(fmt) is str else None
    if f is None:
        f = get_format(fmt, "fmt")  # raises, naming fmt
    _check_array(x, "x", _X_DTYPES, 2)
    dev = x.data.device_id  # the current device: the check compared them
    n, h = x.shape
    key = (f.name, h, x.dtype.num, dev)
    plan = _quantize_plans.get(key)
    if plan is None:  # once per (format, H, dtype, device): the sizes and the prepared launch
        check_hidden(f, h, "x.shape[1]")
        launch = None
        if not (f.name == "bf16" and x.dtype == _BF16):
            launch = _prepare("quantize.cu", f"quantize_{f.name}_{_DTYPE_SUFFIX[x.dtype]}", "PPPqif", dev,
                              threads=_QUANTIZE_THREADS)
        plan = _quantize_plans[key] = (f.payload_bytes(h), f.scale_bytes(h), ceil_div(h, _WARP * _LANE_VALUES),
                                       launch)
    g = global_scale if type(global_scale) is float and GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX \
        else _check_global_scale(global_scale)
    pbytes, sbytes, steps, launch = plan
    pshape, sshape = (n, pbytes), (n, sbytes)
    if out is None:
        cupy = _cp()
        payload, scales = cupy.empty(pshape, _U8), cupy.empty(sshape, _U8)
    else:
        payload, scales = out if type(out) is tuple and len(out) == 2 else _check_out_tuple(out, "out", 2)
        _check_array(payload, "out[0] (payload)", _U8S, 2, pshape, 16, dev)
        _check_array(scales, "out[1] (scales)", _U8S, 2, sshape, 16, dev)
    if n == 0:
        return payload, scales
    if launch is None:  # the bf16 "format" of bf16 input is the bytes themselves
        payload[...] = x.view(_U8)
        return payload, scales
    fn, max_grid = launch
    fn(min(ceil_div(n * steps, _QUANTIZE_THREADS // _WARP), max_grid), x.data.ptr, payload.data.ptr,
       scales.data.ptr, n, h, g)
    return payload, scales


_quantize_general = torch_aware(fast=_quantize_torch)(_quantize)


def dequantize(payload: cupy.ndarray, scales: cupy.ndarray, fmt: str, hidden: int, global_scale: float = 1.0,
               out=None) -> cupy.ndarray:
    """Decode token rows on the GPU, bit for bit as :func:`cuep.reference.dequantize`.

    fp8: ``q * s``; nvfp4: ``(q * sfv) / g``; mxfp4: ``q * 2**e`` (scale byte 0 counts as 0); bf16: widened.
    float32 arithmetic with FTZ.

    Args:
        payload: cupy uint8 [N, payload_bytes(hidden)], as :func:`quantize` returns it.
        scales: cupy uint8 [N, scale_bytes(hidden)] (bf16: [N, 0]).
        fmt: ``"bf16" | "fp8" | "nvfp4" | "mxfp4"``.
        hidden: H, a multiple of the format's group.
        global_scale: nvfp4's g (finite, > 0).
        out: optional cupy float32 [N, hidden].
    Returns:
        cupy float32 [N, hidden].
    Raises:
        TypeError, ValueError: naming the argument.
    """
    if type(payload) is _ND and type(scales) is _ND and type(fmt) is str and type(hidden) is int:
        done = _dequantize_short(payload, scales, fmt, hidden, global_scale, out)
        if done is not None:
            return done
    return _dequantize_general(payload, scales, fmt, hidden, global_scale, out)


def _dequantize(payload, scales, fmt, hidden, global_scale=1.0, out=None):
    cupy = _cp()
    f = get_format(fmt, "fmt")
    hidden = _check_hidden_arg(f, hidden)
    _check_array(payload, "payload", (_U8,), 2, (None, f.payload_bytes(hidden)))
    n = payload.shape[0]
    _check_array(scales, "scales", (_U8,), 2, (n, f.scale_bytes(hidden)))
    g = _check_global_scale(global_scale)
    if out is None:
        out = cupy.empty((n, hidden), _F32)
    else:
        _check_array(out, "out", (_F32,), 2, (n, hidden))
    if n == 0:
        return out
    dev = _device()
    fn, max_grid = _prepare("quantize.cu", f"dequantize_{f.name}", "PPPqif", dev)
    steps = ceil_div(hidden, _WARP * _LANE_VALUES)
    _dequantize_plans[(f.name, hidden, dev)] = (f.payload_bytes(hidden), f.scale_bytes(hidden), steps, fn, max_grid)
    fn(max(1, min(_warp_item_blocks(n, hidden), max_grid)), payload.data.ptr, scales.data.ptr, out.data.ptr, n,
       hidden, g)
    return out


_dequantize_general = torch_aware(_dequantize)


def _dequantize_short(payload, scales, fmt: str, hidden: int, global_scale, out):
    """dequantize's common case in few steps, the launch :func:`_dequantize` makes (as :func:`_quantize_short`);
    None (nothing done) for anything else."""
    n = len(payload) if payload.ndim == 2 else 0
    if not n or type(global_scale) is not float or not GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX:
        return None
    dev = _runtime.getDevice()
    plan = _dequantize_plans.get((fmt, hidden, dev))
    if plan is None:
        return None
    pbytes, sbytes, steps, fn, max_grid = plan
    pp = _rows_ptr(payload, n, pbytes, _U8S, dev, 15)
    sp = _rows_ptr(scales, n, sbytes, _U8S, dev, 15) if pp else 0
    if not sp:
        return None
    if out is None:
        out = _cupy.empty((n, hidden), _F32)
        op = out.data.ptr
    elif not _rows_ptr(out, n, hidden, _F32S, dev, 15):
        return None
    else:
        op = out.data.ptr
    fn.pack.pack_into(fn.raw, 0, pp, sp, op, n, hidden, global_scale)  # (fn(grid, ...) without its call)
    _kernels._launch_raw(fn.func, min(-(-n * steps // (_THREADS // _WARP)), max_grid), fn.block, fn.smem,
                         fn.argv_ptr, None, dev)
    return out


# ---- 128x4 swizzled block scales ------------------------------------------------------------------------------
def swizzle_block_scales(scales: cupy.ndarray, row_offsets: cupy.ndarray, fmt: str, hidden: int,
                         out=None) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Lay per-row block scales out in the 128x4 tiles of block-scaled grouped GEMMs, on the GPU.

    GPU version of :func:`cuep.reference.swizzle_block_scales`: each group g (rows ``row_offsets[g] ..
    row_offsets[g+1]``) starts a fresh 128-row tile. The row count ``row_offsets[-1]`` is read on the device, so
    the output is sized for the worst case; the bytes of the used tiles equal the reference's (padding rows and
    columns 0), the bytes past them are left as they were (uninitialised when ``out`` is None).

    Args:
        scales: cupy uint8 [rows', H/block] per-row scales (nvfp4 e4m3, mxfp4 e8m0), as :func:`quantize` returns
            them; rows at or past ``row_offsets[-1]`` (which must be <= rows') are ignored.
        row_offsets: cupy int32/uint32/int64/uint64 [G+1], starting at 0, non-decreasing, G <= 4096 (not checked
            on the host: invalid offsets give unspecified bytes, never an out-of-bounds write).
        fmt: ``"nvfp4" | "mxfp4"``.
        hidden: H.
        out: optional ``(swizzled, scales_offsets)`` of the shapes and dtypes below.
    Returns:
        ``(swizzled, scales_offsets)``: swizzled uint8 [(ceil(rows'/128) + G) * k_tiles * 512] with
        ``k_tiles = ceil(H/block/4)``; scales_offsets uint32 [G], ``tile_start[g] - row_offsets[g] // 128``.
    Raises:
        TypeError, ValueError: naming the argument.
    """
    if type(scales) is _ND and type(row_offsets) is _ND and type(fmt) is str and type(hidden) is int:
        done = _swizzle_short(scales, row_offsets, fmt, hidden, out)
        if done is not None:
            return done
    return _swizzle_general(scales, row_offsets, fmt, hidden, out)


def _swizzle(scales, row_offsets, fmt, hidden, out=None):
    cupy = _cp()
    f = get_format(fmt, "fmt")
    if not f.swizzled_scales:
        raise ValueError(f"fmt={fmt!r} has no swizzled block scales; use 'nvfp4' or 'mxfp4'")
    hidden = _check_hidden_arg(f, hidden)
    n_scales, k_tiles = f.n_scales(hidden), f.scale_k_tiles(hidden)
    _check_array(scales, "scales", (_U8,), 2, (None, n_scales))
    rows_cap = scales.shape[0]
    ro, n_groups = _check_row_offsets(row_offsets, "scales.shape[0]", rows_cap)
    max_tiles = _swizzle_tiles(rows_cap, n_groups)
    sw_shape = (max_tiles * k_tiles * SCALE_TILE_BYTES,)
    if out is None:
        swizzled, scales_offsets = cupy.empty(sw_shape, _U8), cupy.empty((n_groups,), _U32)
    else:
        swizzled, scales_offsets = _check_out_tuple(out, "out", 2)
        _check_array(swizzled, "out[0] (swizzled)", (_U8,), 1, sw_shape)
        _check_array(scales_offsets, "out[1] (scales_offsets)", (_U32,), 1, (n_groups,))
    smem = 2 * (n_groups + 1) * 4
    work = max(rows_cap * k_tiles, n_groups * k_tiles * SCALE_TILE_ROWS)
    dev = _device()
    fn, max_grid = _prepare("quantize.cu", "swizzle_block_scales", "PqiPiPPq", dev, smem)
    grid = max(1, min(ceil_div(work, _THREADS), max_grid))
    _swizzle_plans[(f.name, hidden, rows_cap, n_groups, dev)] = (n_scales, sw_shape[0], max_tiles, fn, grid)
    fn(grid, scales.data.ptr, rows_cap, n_scales, ro.data.ptr, n_groups, swizzled.data.ptr, scales_offsets.data.ptr,
       max_tiles)
    return swizzled, scales_offsets


_swizzle_general = torch_aware(_swizzle)


def _vector_ptr(a, size: int, dtypes, dev: int) -> int:
    """The device address of ``a`` if it is a contiguous 1-D CuPy array of ``size`` (> 0) elements of one of
    ``dtypes`` on ``dev``, 16-byte aligned, else 0 (as ep._rows_ptr for rows)."""
    if type(a) is not _ND or a.ndim != 1 or a.size != size or a.dtype not in dtypes or not a._c_contiguous:
        return 0
    mem = a.data
    ptr = mem.ptr
    return ptr if mem.device_id == dev and not ptr & 15 else 0


def _swizzle_short(scales, ro, fmt: str, hidden: int, out):
    """swizzle_block_scales' common case in few steps, the launch :func:`_swizzle` makes (as
    :func:`_quantize_short`; int32 / uint32 ``row_offsets``); None (nothing done) for anything else."""
    rows = len(scales) if scales.ndim == 2 else 0
    if not rows or ro.ndim != 1:
        return None
    n_groups, dev = ro.size - 1, _runtime.getDevice()
    plan = _swizzle_plans.get((fmt, hidden, rows, n_groups, dev))
    if plan is None:
        return None
    n_scales, sw_size, max_tiles, fn, grid = plan
    sp = _rows_ptr(scales, rows, n_scales, _U8S, dev, 15)
    rp = _vector_ptr(ro, n_groups + 1, _RO32, dev) if sp else 0
    if not rp:
        return None
    if out is None:
        swizzled, offsets = _cupy.empty((sw_size,), _U8), _cupy.empty((n_groups,), _U32)
    elif type(out) is tuple and len(out) == 2:
        swizzled, offsets = out
        if not _vector_ptr(swizzled, sw_size, _U8S, dev) or not _vector_ptr(offsets, n_groups, _U32S, dev):
            return None
    else:
        return None
    fn.pack.pack_into(fn.raw, 0, sp, rows, n_scales, rp, n_groups, swizzled.data.ptr, offsets.data.ptr, max_tiles)
    _kernels._launch_raw(fn.func, grid, fn.block, fn.smem, fn.argv_ptr, None, dev)
    return swizzled, offsets


# ---- fused SwiGLU ---------------------------------------------------------------------------------------------
def fused_silu(h: cupy.ndarray, row_offsets: cupy.ndarray, out_fmt: str = "bf16", interleaved: bool = False,
               global_scale: float = 1.0, out=None):
    """``silu(gate) * up`` of the rows below ``row_offsets[-1]``, as bf16 or quantized for the down GEMM.

    Bit for bit as :func:`cuep.reference.fused_silu`: gate and up flushed (FTZ), ``sv = g / (1 + exp(-g))`` by
    the float32 algorithm of ``docs/formats.md`` (within 3.4 ulp of the exact silu; NumPy reproduces every bit),
    ``y = sv * up`` in float32, then bf16 (RNE) or the quantizer of ``out_fmt``
    with H = I. The row count is read on the device (no host sync); rows at or past it are neither read nor
    written, in any output (pre-fill ``out`` if you need them defined).

    Args:
        h: cupy float32 or ``ml_dtypes.bfloat16`` [capacity, 2I], C-contiguous: gate half then up half per row, or
            (``interleaved``) gate/up alternating element by element. I a multiple of the format's group; a row
            under 2 GiB.
        row_offsets: cupy int32/uint32/int64/uint64 [G+1] group offsets from dispatch (0, non-decreasing,
            ``row_offsets[-1] <= capacity``, G <= 4096; not checked on the host: invalid offsets give unspecified
            bytes, never an out-of-bounds write). They place the swizzled scales of nvfp4/mxfp4.
        out_fmt: ``"bf16" | "fp8" | "nvfp4" | "mxfp4"``.
        interleaved: gate/up interleaved element by element instead of two halves.
        global_scale: nvfp4's global scale g (finite, > 0).
        out: optional preallocated outputs, the same shapes and dtypes as returned (an array for bf16, a tuple
            otherwise).
    Returns:
        bf16: cupy ``ml_dtypes.bfloat16`` [capacity, I];
        fp8: ``(payload uint8 [capacity, I], scales float32 [I/128, capacity])``;
        nvfp4 / mxfp4: ``(payload uint8 [capacity, I/2], scales uint8 [(ceil(capacity/128) + G) * k_tiles * 512],
        scales_offsets uint32 [G])``: 128x4 swizzled scales, ``k_tiles = ceil(I/block/4)``; every used tile is
        fully written (padding 0), the bytes past them are left as they were.
    Raises:
        TypeError, ValueError: naming the argument.
    """
    if type(h) is _ND and type(row_offsets) is _ND and type(out_fmt) is str and type(interleaved) is bool:
        done = _fused_silu_short(h, row_offsets, out_fmt, interleaved, global_scale, out)
        if done is not None:
            return done
        if type(global_scale) in (float, int) and _plain_out(out):
            return _fused_silu(h, row_offsets, out_fmt, interleaved, global_scale, out)
    elif _ep._is_tensor(h):  # torch's short path without torch_aware's argument scan
        done = _fused_silu_torch(h, row_offsets, out_fmt, interleaved, global_scale, out)
        if done is not NotImplemented:
            return done
    return _fused_silu_general(h, row_offsets, out_fmt, interleaved, global_scale, out)


def _fused_silu(h, row_offsets, out_fmt="bf16", interleaved=False, global_scale=1.0, out=None):
    # (the usual arguments pass with the fewest calls: each Python call is a tenth of a microsecond of the host cost)
    f = FORMATS.get(out_fmt) if type(out_fmt) is str else None
    if f is None:
        f = get_format(out_fmt, "out_fmt")  # raises, naming out_fmt
    _check_array(h, "h", _X_DTYPES, 2)
    dev = h.data.device_id  # the current device: the check compared them
    cap, width = h.shape
    ro, n_groups = _check_row_offsets(row_offsets, "h.shape[0] (capacity)", cap, dev)
    key = (f.name, h.dtype.num, cap, width, bool(interleaved), n_groups, dev)
    plan = _silu_plans.get(key)
    if plan is None:
        plan = _silu_plans[key] = _silu_plan(f, h, bool(interleaved), n_groups, dev)
    g = global_scale if type(global_scale) is float and GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX \
        else _check_global_scale(global_scale)
    shapes, checks, fn, grid, max_tiles, _ = plan
    if out is None:
        cupy = _cp()
        outs = [cupy.empty(s, d) for s, d in shapes]
    else:
        outs = (out,) if f.name == "bf16" else out if type(out) is tuple and len(out) == len(shapes) \
            else _check_out_tuple(out, "out", len(shapes))
        for a, (nm, dts, nd, s) in zip(outs, checks):
            _check_array(a, nm, dts, nd, s, 16, dev)
    result = outs[0] if f.name == "bf16" else tuple(outs)
    if cap == 0:
        return result
    dummy = outs[0]  # unused pointer arguments still need a valid array
    scales = outs[1] if len(outs) > 1 else dummy
    scales_offsets = outs[2] if len(outs) > 2 else dummy
    fn(grid, h.data.ptr, ro.data.ptr, n_groups, cap, width // 2, outs[0].data.ptr, scales.data.ptr,
       scales_offsets.data.ptr, max_tiles, g)
    return result


_fused_silu_general = torch_aware(fast=_fused_silu_torch)(_fused_silu)


def _fused_silu_short(h, ro, fmt: str, interleaved: bool, global_scale, out):
    """fused_silu's common case in few steps, the launch :func:`_fused_silu` makes: a plan an earlier call made
    (its shapes checked then), int32 / uint32 ``row_offsets``, a float ``global_scale`` in range, ``out`` None or
    right arrays. Returns the outputs, or None (nothing done) for :func:`_fused_silu`, which handles every other
    case and raises with a message."""
    cap = len(h) if h.ndim == 2 else 0
    if not cap or type(global_scale) is not float or not GLOBAL_SCALE_MIN <= global_scale <= GLOBAL_SCALE_MAX \
            or ro.ndim != 1 or ro.dtype not in _RO32 or not ro._c_contiguous:
        return None
    width, n_groups, dev = h.size // cap, ro.size - 1, _runtime.getDevice()
    plan = _silu_plans.get((fmt, h.dtype.num, cap, width, interleaved, n_groups, dev))
    if plan is None:
        return None
    shapes, _, fn, grid, max_tiles, short = plan
    hp = _rows_ptr(h, cap, width, _X_DTYPES, dev, 15)
    mem = ro.data
    rp = mem.ptr if hp and mem.device_id == dev else 0
    if not rp or rp & 15:
        return None
    if out is None:
        outs = [_cupy.empty(s, d) for s, d in shapes]
    else:
        outs = (out,) if len(shapes) == 1 else out if type(out) is tuple and len(out) == len(shapes) else None
        if outs is None:
            return None
        for a, (nd, rows, size, dts) in zip(outs, short):
            if type(a) is not _ND or a.ndim != nd or len(a) != rows or a.size != size or a.dtype not in dts \
                    or not a._c_contiguous:
                return None
            mem = a.data
            if mem.device_id != dev or mem.ptr & 15:
                return None
    p0 = outs[0].data.ptr
    fn.pack.pack_into(fn.raw, 0, hp, rp, n_groups, cap, width // 2, p0, outs[1].data.ptr if len(outs) > 1 else p0,
                      outs[2].data.ptr if len(outs) > 2 else p0, max_tiles, global_scale)  # (fn(grid, ...))
    _kernels._launch_raw(fn.func, grid, fn.block, fn.smem, fn.argv_ptr, None, dev)
    return outs[0] if len(shapes) == 1 else tuple(outs)


def _silu_plan(f: Format, h, interleaved: bool, n_groups: int, dev: int) -> tuple:
    """What fused_silu derives from its arguments' shapes, once per signature: (output shapes and dtypes, their
    checks (name in messages, dtypes, ndim, shape), the prepared launch, its grid, the swizzled layout's tile
    count)."""
    cap, width = h.shape
    if width % 2:
        raise ValueError(f"h must be [capacity, 2I] with an even width, got shape {h.shape}")
    inter = width // 2
    check_hidden(f, inter, "h.shape[1] // 2 (I)")
    row_bytes = width * h.dtype.itemsize
    if row_bytes >= 2**31:  # the kernel's row offsets are 32-bit
        raise ValueError(f"h.shape[1]={width}: a row of h must be under 2 GiB ({row_bytes} bytes)")
    if f.name == "bf16":
        shapes = (((cap, inter), _BF16),)
        names = ("out",)
    elif f.name == "fp8":
        shapes = (((cap, inter), _U8), ((f.n_scales(inter), cap), _F32))
    else:
        shapes = (((cap, f.payload_bytes(inter)), _U8),
                  ((_swizzle_tiles(cap, n_groups) * f.scale_k_tiles(inter) * SCALE_TILE_BYTES,), _U8),
                  ((n_groups,), _U32))
    if f.name != "bf16":
        names = tuple(f"out[{i}] ({n})" for i, n in enumerate(("payload", "scales", "scales_offsets")[:len(shapes)]))
    max_tiles = _swizzle_tiles(cap, n_groups) if f.swizzled_scales else 0
    smem = _silu_ring_bytes() + (2 * (n_groups + 1) * 4 if f.swizzled_scales else 0)
    name = f"fused_silu_{f.name}_{_DTYPE_SUFFIX[h.dtype]}" + ("_interleaved" if interleaved else "")
    work = _warp_item_blocks(cap, inter, _SILU_THREADS)
    if f.swizzled_scales:
        work = max(work, ceil_div(n_groups * f.scale_k_tiles(inter) * SCALE_TILE_ROWS, _SILU_THREADS))
    fn, max_grid = _prepare("silu.cu", name, "PPiqiPPPqf", dev, smem, _SILU_THREADS)
    checks = tuple((nm, (d,), len(s), s) for nm, (s, d) in zip(names, shapes))
    # the short path's test of each output: (ndim, rows, elements, dtypes); rows > 0, so together the exact shape
    short = tuple((len(s), s[0], math.prod(s), (d,)) for s, d in shapes)
    return shapes, checks, fn, max(1, min(work, max_grid)), max_tiles, short


# ---- self tests of the device helpers (private; tests/test_ops_gpu.py) ----------------------------------------
def _check_aligned16(a: cupy.ndarray, argname: str) -> None:
    if a.data.ptr % 16:
        raise ValueError(f"{argname} must start on a 16-byte boundary")


def _selftest_block_copy16(dst: cupy.ndarray, src: cupy.ndarray, nthreads: int) -> None:
    """common.cuh block_copy16 of all of ``src`` into ``dst`` (uint8 1-D, 16-byte aligned, size a multiple of 16)
    by one block of ``nthreads`` threads."""
    _check_array(src, "src", (_U8,), 1)
    _check_array(dst, "dst", (_U8,), 1, (src.size,))
    _check_aligned16(src, "src")
    _check_aligned16(dst, "dst")
    if src.size % 16:
        raise ValueError("src.size must be a multiple of 16")
    _kernel("selftest.cu", "selftest_block_copy16")((1,), (int(nthreads),), (dst, src, np.int64(src.size)))


def _selftest_warp_copy16(dst: cupy.ndarray, src: cupy.ndarray, warp: int, nthreads: int) -> None:
    """common.cuh warp_copy16 by warp ``warp`` of one block of ``nthreads`` threads."""
    _check_array(src, "src", (_U8,), 1)
    _check_array(dst, "dst", (_U8,), 1, (src.size,))
    _check_aligned16(src, "src")
    _check_aligned16(dst, "dst")
    _kernel("selftest.cu", "selftest_warp_copy16")((1,), (int(nthreads),),
                                                   (dst, src, np.int64(src.size), np.int32(warp)))


def _selftest_block_scan(values: cupy.ndarray) -> tuple[cupy.ndarray, cupy.ndarray]:
    """common.cuh block_inclusive_scan, twice in a row, by one block of ``values.size`` threads (32..1024, a
    multiple of 32). Returns (scans int32 [2, n]: of values and of 2*values+1; totals int32 [n, 2])."""
    import cupy
    _check_array(values, "values", (np.int32,), 1)
    n = values.size
    if n < 32 or n > 1024 or n % 32:
        raise ValueError(f"values.size={n} must be a multiple of 32 in [32, 1024]")
    scans = cupy.empty((2, n), np.int32)
    totals = cupy.empty((n, 2), np.int32)
    _kernel("selftest.cu", "selftest_block_scan")((1,), (n,), (values, scans, totals))
    return scans, totals


def _selftest_signal_wait(n_payload: int, count: int, last: bool, timeout_ns: int) -> tuple[int, int, int]:
    """signal_completion in one block, wait_not_empty_u64 + payload check in another.
    Returns (value seen, payload words matched, wait ns)."""
    import cupy
    slot = cupy.full((1,), np.uint64(2**64 - 1), np.uint64)
    payload = cupy.zeros((max(1, n_payload),), np.uint64)
    result = cupy.zeros((3,), np.uint64)
    _kernel("selftest.cu", "selftest_signal_wait")((2,), (32,), (slot, payload, np.int64(n_payload),
                                                                  np.uint64(count), np.int32(bool(last)),
                                                                  np.uint64(timeout_ns), result))
    v, ok, ns = (int(t) for t in result.get())
    return v, ok, ns


def _selftest_wait_timeout(timeout_ns: int) -> tuple[int, int]:
    """wait_not_empty_u64 on a slot nobody writes. Returns (value: kEmpty = 2**64-1 after the timeout, wait ns)."""
    import cupy
    slot = cupy.full((1,), np.uint64(2**64 - 1), np.uint64)
    result = cupy.zeros((3,), np.uint64)
    _kernel("selftest.cu", "selftest_wait_timeout")((1,), (32,), (slot, np.uint64(timeout_ns), result))
    r = result.get()
    return int(r[0]), int(r[2])


def _selftest_align_up(n: cupy.ndarray, a: cupy.ndarray) -> tuple[cupy.ndarray, cupy.ndarray]:
    """common.cuh align_up and ceil_div elementwise on int64 arrays. Returns (align_up, ceil_div)."""
    import cupy
    _check_array(n, "n", (np.int64,), 1)
    _check_array(a, "a", (np.int64,), 1, (n.size,))
    out = cupy.empty((n.size, 2), np.int64)
    if n.size:
        _kernel("selftest.cu", "selftest_align_up")((ceil_div(n.size, _THREADS),), (_THREADS,),
                                                    (n, a, out, np.int32(n.size)))
    return out[:, 0], out[:, 1]


def _selftest_encode(v: cupy.ndarray):
    """formats.cuh element encoders on float32 values. Returns (e4m3 uint8, e2m1 uint8 codes, bf16 uint16 bits,
    ftz float32), each the shape of ``v`` (1-D)."""
    import cupy
    _check_array(v, "v", (_F32,), 1)
    n = v.size
    e4m3, e2m1 = cupy.empty(n, _U8), cupy.empty(n, _U8)
    bf16, flushed = cupy.empty(n, np.uint16), cupy.empty(n, _F32)
    if n:
        _kernel("selftest.cu", "selftest_encode")((ceil_div(n, _THREADS),), (_THREADS,),
                                                  (v, e4m3, e2m1, bf16, flushed, np.int64(n)))
    return e4m3, e2m1, bf16, flushed


def _selftest_silu(v: cupy.ndarray) -> tuple[cupy.ndarray, cupy.ndarray]:
    """formats.cuh silu_f32 and rcp_rn_normal on float32 values: (silu, rcp), float32, the shape of ``v`` (1-D)."""
    import cupy
    _check_array(v, "v", (_F32,), 1)
    n = v.size
    silu, rcp = cupy.empty(n, _F32), cupy.empty(n, _F32)
    if n:
        _kernel("selftest.cu", "selftest_silu")((ceil_div(n, _THREADS),), (_THREADS,), (v, silu, rcp, np.int64(n)))
    return silu, rcp


def _selftest_scale_divisions(mode: int, first: int, count: int, gs: cupy.ndarray | None = None) -> tuple[int, int]:
    """selftest.cu selftest_scale_divisions: (mismatches, first mismatching index or 2**64 - 1) of the quantizers'
    division-free scale arithmetic against IEEE division over ``count`` inputs (see the kernel's comment)."""
    import cupy
    result = cupy.array([0, 2**64 - 1], np.uint64)
    gs = cupy.zeros(1, _F32) if gs is None else gs
    if mode == 3 and gs.size * 126 < count:
        raise ValueError("gs must hold count / 126 values")
    _kernel("selftest.cu", "selftest_scale_divisions")((4096,), (_THREADS,), (np.int32(mode), np.uint64(first),
                                                                                np.uint64(count), gs, result))
    bad, at = (int(v) for v in result.get())
    return bad, at


def _selftest_decode() -> tuple[cupy.ndarray, cupy.ndarray]:
    """formats.cuh decoders: (e4m3 of bytes 0..255, e2m1 of codes (0..255) & 15), float32 [256] each."""
    import cupy
    out = cupy.empty((256, 2), _F32)
    _kernel("selftest.cu", "selftest_decode")((1,), (256,), (out,))
    return out[:, 0], out[:, 1]


def _selftest_swizzled_offset(rows: cupy.ndarray, cols: cupy.ndarray, k_tiles: int) -> cupy.ndarray:
    """formats.cuh swizzled_scale_offset elementwise (rows int64, cols int32). Returns int64."""
    import cupy
    _check_array(rows, "rows", (np.int64,), 1)
    _check_array(cols, "cols", (np.int32,), 1, (rows.size,))
    out = cupy.empty(rows.size, np.int64)
    if rows.size:
        _kernel("selftest.cu", "selftest_swizzled_offset")((ceil_div(rows.size, _THREADS),), (_THREADS,),
                                                           (rows, cols, np.int32(k_tiles), out,
                                                            np.int32(rows.size)))
    return out


def _selftest_constants() -> dict[str, float]:
    """The constants of formats.cuh / common.cuh as the device sees them."""
    import cupy
    out = cupy.zeros(11, np.float64)
    _kernel("selftest.cu", "selftest_constants")((1,), (1,), (out,))
    keys = ("FP8_BLOCK", "FP8_MAX", "FP8_AMAX_FLOOR", "NVFP4_BLOCK", "MXFP4_BLOCK", "E2M1_MAX", "SCALE_TILE_ROWS",
            "SCALE_TILE_COLS", "SCALE_TILE_BYTES", "ALIGN", "OPS_THREADS")
    return dict(zip(keys, (float(v) for v in out.get())))
