"""NumPy reference of the token wire formats (bf16, fp8, nvfp4, mxfp4): the exact bits of docs/formats.md.

Pure NumPy + ml_dtypes; the CUDA kernels reproduce these bytes bit for bit.

Policies (docs/formats.md is the contract; this module is its executable form):

* Arithmetic: every operation is an IEEE float32 operation in NumPy float32, in the contract's order: a division
  stays a division (fp8 ``x / s``), and nvfp4 multiplies by ``r = g / sfv`` because the contract says so.
  ``global_scale`` is rounded to float32 first.
* FTZ: the kernels run with ``-ftz=true``, so float32 subnormals are flushed to zero *of the same sign*. The
  quantizers flush the input first and the result of every float32 multiply/divide (and, in ``dequantize``, the
  float32 operands too, as the hardware does). The bf16 "format" does no arithmetic and flushes nothing: a bf16
  input is copied byte for byte, a float32 input is rounded to bf16 (subnormals kept, NaN -> 0x7FC0 / 0xFFC0).
* Rounding: every conversion rounds to nearest, ties to even, and saturates to the largest finite value of the
  target (448 for e4m3, 6 for e2m1); the e2m1 sign bit is the sign bit of the input (-0.0 -> 0x8).
* NaN / Inf: a NaN or +-Inf in a scale block makes that block's payload and scale unspecified; every other block
  of the row is exact. The bytes returned are still deterministic (NaN stays NaN through e4m3, e2m1 of NaN is
  the largest code with NaN's sign bit).
"""
from __future__ import annotations

import numbers

import ml_dtypes
import numpy as np

from ..formats import (E2M1_MAX, FP8_AMAX_FLOOR, FP8_MAX, GLOBAL_SCALE_MAX, GLOBAL_SCALE_MIN, SCALE_TILE_BYTES,
                       SCALE_TILE_COLS, SCALE_TILE_ROWS, check_hidden, get_format)

__all__ = [
    "quantize", "dequantize", "swizzle_block_scales", "unswizzle_block_scales",
    "e2m1_encode", "e2m1_decode", "pack_e2m1", "unpack_e2m1", "e4m3_encode", "e4m3_decode", "ftz",
    "fma_f32", "fp8_scales_as_float",
]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.float32
_SIGN = np.uint32(0x8000_0000)
_EXP = np.uint32(0x7F80_0000)

# e2m1 magnitudes by code 0..7; codes 8..15 are the negatives (code 8 is -0.0).
_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], _F32)
_E2M1_TABLE = np.concatenate([_E2M1_VALUES, -_E2M1_VALUES])


# ---- element helpers -------------------------------------------------------------------------------------
def _require_f32(a, argname: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != _F32:
        raise ValueError(f"{argname} must be float32, got dtype {a.dtype}")
    return a



def fma_f32(a, b, c) -> np.ndarray:
    """``a * b + c`` rounded ONCE to float32 (nearest even), flushed: the CUDA ``fma.rn.ftz.f32`` / ``__fmaf_rn``.

    Exact emulation in float64: the product of two float32 is exact in float64; the sum is rounded to odd in
    float64 (the TwoSum error says whether it was exact and on which side the exact value lies), and a value
    rounded to odd with 53 >= 24 + 2 bits rounds to float32 exactly as the exact value would. Subnormal operands
    are flushed first and a subnormal result is flushed, as ``-ftz=true`` does.

    Args:
        a, b, c: float32 arrays (broadcast together) or float32 scalars.
    Returns:
        float32 array of the broadcast shape.
    """
    a64, b64, c64 = (ftz(np.atleast_1d(_require_f32(v, n))).astype(np.float64) for v, n in ((a, "a"), (b, "b"),
                                                                                             (c, "c")))
    with np.errstate(all="ignore"):  # Inf - Inf and NaN operands give NaN, as the hardware does
        p = a64 * b64
        s = p + c64
        v = s - p                        # TwoSum: err = (p + c) - s exactly, when s is finite
        err = (p - (s - v)) + (c64 - v)
        even = (s.view(np.uint64) & np.uint64(1)) == 0
        nudge = np.isfinite(s) & np.isfinite(err) & (err != 0) & even
        s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return ftz(s.astype(_F32))


def _require_u8(a, argname: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.uint8:
        raise ValueError(f"{argname} must be uint8, got dtype {a.dtype}")
    return a


def ftz(a: np.ndarray) -> np.ndarray:
    """Flush float32 subnormals to zero of the same sign (what ``-ftz=true`` does).

    Args:
        a: float32 array, any shape.
    Returns:
        float32 array of the same shape (a new array); normals, zeros, Inf and NaN are unchanged.
    """
    a = _require_f32(a, "a")
    bits = a.view(np.uint32)
    out = bits.copy()
    np.bitwise_and(out, _SIGN, out=out, where=(bits & _EXP) == 0)  # (a masked pass: 2.3x np.where's speed)
    return out.view(_F32)


def e2m1_encode(v: np.ndarray) -> np.ndarray:
    """cvt_e2m1: float32 -> e2m1 codes, round to nearest even on {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6.

    Args:
        v: float32 array, any shape.
    Returns:
        uint8 codes 0..15, same shape: bit 3 is the sign bit of ``v`` (so -0.0 gives 0x8), bits 0..2 the
        magnitude by the thresholds of docs/formats.md (NaN gives magnitude 7).
    """
    v = _require_f32(v, "v")
    a = np.abs(v)
    # Start from the top code and step down one for each threshold |v| sits at or below (ties go to the even
    # code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0).
    mag = np.full(v.shape, 7, np.uint8)
    for below, le in ((5.0, True), (3.5, False), (2.5, True), (1.75, False), (1.25, True), (0.75, False),
                      (0.25, True)):
        mag -= (a <= _F32(below)) if le else (a < _F32(below))
    sign = ((v.view(np.uint32) >> np.uint32(28)) & np.uint32(0x8)).astype(np.uint8)
    return mag | sign


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """e2m1 codes (uint8 0..15, any shape) -> float32 values of the same shape (code 8 is -0.0)."""
    codes = _require_u8(codes, "codes")
    if codes.size and codes.max() > 15:
        raise ValueError("codes must be e2m1 codes in 0..15")
    return _E2M1_TABLE[codes]


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """Pack e2m1 codes two per byte: uint8 [N, H] (H even, codes 0..15) -> uint8 [N, H/2].

    Element ``2i`` goes to the low nibble of byte ``i``, element ``2i + 1`` to the high nibble.
    """
    codes = _require_u8(codes, "codes")
    if codes.ndim < 1 or codes.shape[-1] % 2:
        raise ValueError(f"codes must have an even last dimension, got shape {codes.shape}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_e2m1`: uint8 [N, H/2] -> uint8 codes [N, H] (low nibble first)."""
    packed = _require_u8(packed, "packed")
    if packed.ndim < 1:
        raise ValueError("packed must have at least one dimension")
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def e4m3_encode(v: np.ndarray) -> np.ndarray:
    """cvt_e4m3: float32 -> float8_e4m3fn bytes, round to nearest even, saturating to +-448.

    Args:
        v: float32 array, any shape.
    Returns:
        uint8 array of the same shape (the e4m3fn bit patterns). +-Inf -> +-448; NaN -> NaN (0x7F / 0xFF by
        its sign bit).
    """
    v = _require_f32(v, "v")
    # np.clip propagates NaN, and ml_dtypes maps it to the e4m3fn NaN of the same sign.
    with np.errstate(invalid="ignore"):
        return np.clip(v, _F32(-FP8_MAX), _F32(FP8_MAX)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_decode(u8: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes (uint8, any shape) -> float32 values of the same shape (exact)."""
    u8 = _require_u8(u8, "u8")
    return u8.view(ml_dtypes.float8_e4m3fn).astype(_F32)


def fp8_scales_as_float(scales: np.ndarray) -> np.ndarray:
    """The fp8 scales as floats: uint8 [N, n] (n a multiple of 4, little-endian float32 bytes) -> float32
    [N, n/4], a view of ``scales`` (its last axis must be contiguous)."""
    scales = _require_u8(scales, "scales")
    if scales.ndim != 2 or scales.shape[1] % 4:
        raise ValueError(f"scales must be uint8 [N, 4*k], got shape {scales.shape}")
    return scales.view(np.dtype("<f4"))


def _pow2(exponent: np.ndarray) -> np.ndarray:
    """2**exponent as float32 built from its bits; exponent int in [-127, 128]. 2**-127 (a subnormal) gives 0,
    as an FTZ operand would; 2**128 gives Inf."""
    return ((exponent.astype(np.int64) + 127).astype(np.uint32) << np.uint32(23)).view(_F32)


# ---- argument checks -------------------------------------------------------------------------------------
def _check_global_scale(global_scale) -> np.float32:
    """global_scale as a float32; it must be a real number whose float32 lies in [2**-100, 2**100]."""
    ok = isinstance(global_scale, numbers.Real) and not isinstance(global_scale, bool)
    if ok:
        with np.errstate(all="ignore"):
            g = _F32(global_scale)
        ok = bool(GLOBAL_SCALE_MIN <= g <= GLOBAL_SCALE_MAX)
    if not ok:
        raise ValueError(f"global_scale={global_scale!r} must be a float in [2**-100, 2**100]")
    return g


def _check_u8_2d(a, argname: str, rows: int | None, cols: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != cols or (
            rows is not None and a.shape[0] != rows):
        shape = getattr(a, "shape", None)
        dtype = getattr(a, "dtype", type(a).__name__)
        want = f"[{'N' if rows is None else rows}, {cols}]"
        raise ValueError(f"{argname} must be a uint8 numpy array of shape {want}, got {dtype} {shape}")
    return a


# ---- quantize / dequantize -------------------------------------------------------------------------------
def quantize(x: np.ndarray, fmt: str, global_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Encode token rows in a wire format, bit for bit as docs/formats.md says.

    Args:
        x: float32 or ml_dtypes.bfloat16 numpy array [N, H]; H a multiple of the format's group.
        fmt: ``"bf16" | "fp8" | "nvfp4" | "mxfp4"``.
        global_scale: nvfp4's global scale g (rounded to float32; finite, > 0); checked but unused otherwise.
    Returns:
        ``(payload, scales)``: payload uint8 [N, payload_bytes(H)] (bf16: 2H bytes; fp8: H e4m3 bytes;
        nvfp4/mxfp4: H/2 bytes of packed e2m1 codes), scales uint8 [N, scale_bytes(H)] (fp8: H/128 float32
        little-endian; nvfp4: H/16 e4m3; mxfp4: H/32 e8m0; bf16: [N, 0]).
    Raises:
        ValueError: naming ``fmt``, ``x`` or ``global_scale``.
    """
    f = get_format(fmt, "fmt")
    if not isinstance(x, np.ndarray):
        raise ValueError(f"x must be a numpy array, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [N, H], got shape {x.shape}")
    if x.dtype != _F32 and x.dtype != _BF16:
        raise ValueError(f"x must be float32 or bfloat16, got dtype {x.dtype}")
    n, h = x.shape
    check_hidden(f, h, "x.shape[1]")
    g = _check_global_scale(global_scale)

    if f.name == "bf16":
        with np.errstate(invalid="ignore"):
            xb = x if x.dtype == _BF16 else x.astype(_BF16)  # RNE; NaN -> 0x7FC0 / 0xFFC0 by its sign
        return np.ascontiguousarray(xb).view(np.uint8).reshape(n, 2 * h), np.zeros((n, 0), np.uint8)

    xf = ftz(np.ascontiguousarray(x, dtype=_F32))
    blocks = xf.reshape(n, h // f.block, f.block)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(blocks), axis=-1)                               # [N, H/block]
        if f.name == "fp8":
            payload, scales = _quantize_fp8(blocks, amax)
        elif f.name == "nvfp4":
            payload, scales = _quantize_nvfp4(blocks, amax, g)
        else:
            payload, scales = _quantize_mxfp4(blocks, amax)
    return payload.reshape(n, f.payload_bytes(h)), scales.reshape(n, f.scale_bytes(h))


def _rows_of(blocks: np.ndarray) -> np.ndarray:
    """[N, nb, block] -> [N, nb * block]."""
    return blocks.reshape(blocks.shape[0], blocks.shape[1] * blocks.shape[2])


def _quantize_fp8(blocks: np.ndarray, amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = ftz(np.maximum(amax, _F32(FP8_AMAX_FLOOR)) / _F32(FP8_MAX))         # [N, nb]
    q = e4m3_encode(ftz(blocks / s[..., None]))                              # [N, nb, 128]
    return q, s.astype("<f4").view(np.uint8)


def _quantize_nvfp4(blocks: np.ndarray, amax: np.ndarray, g: np.float32) -> tuple[np.ndarray, np.ndarray]:
    t = ftz(ftz(g * amax) / _F32(E2M1_MAX))
    sf = e4m3_encode(t)                                                      # [N, nb] e4m3 bytes
    sfv = e4m3_decode(sf)
    r = ftz(g / sfv)
    codes = e2m1_encode(ftz(blocks * r[..., None]))
    codes[sfv == 0] = 0                                                      # whole block +0
    return pack_e2m1(_rows_of(codes)), sf


def _quantize_mxfp4(blocks: np.ndarray, amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    big_e = ((amax.view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32) - 127
    e = np.maximum(big_e - 2, -127)                                          # [-127, 126]
    codes = e2m1_encode(ftz(blocks * _pow2(-e)[..., None]))
    return pack_e2m1(_rows_of(codes)), (e + 127).astype(np.uint8)


def dequantize(payload: np.ndarray, scales: np.ndarray, fmt: str, hidden: int,
               global_scale: float = 1.0) -> np.ndarray:
    """Decode token rows, bit for bit as docs/formats.md says (float32 arithmetic, FTZ).

    fp8: ``q * s``; nvfp4: ``(q * sfv) / g``; mxfp4: ``q * 2**e`` (scale byte 0, i.e. 2**-127, is a subnormal
    and counts as 0); bf16: the bf16 values widened to float32 (exact, nothing flushed).

    Args:
        payload: uint8 [N, payload_bytes(hidden)] as :func:`quantize` returns it.
        scales: uint8 [N, scale_bytes(hidden)] (bf16: [N, 0]).
        fmt: ``"bf16" | "fp8" | "nvfp4" | "mxfp4"``.
        hidden: H.
        global_scale: nvfp4's g (rounded to float32; finite, > 0).
    Returns:
        float32 [N, hidden].
    Raises:
        ValueError: naming ``fmt``, ``hidden``, ``payload``, ``scales`` or ``global_scale``.
    """
    f = get_format(fmt, "fmt")
    hidden = int(hidden) if isinstance(hidden, np.integer) else hidden
    check_hidden(f, hidden, "hidden")
    payload = _check_u8_2d(payload, "payload", None, f.payload_bytes(hidden))
    n = payload.shape[0]
    scales = _check_u8_2d(scales, "scales", n, f.scale_bytes(hidden))
    g = _check_global_scale(global_scale)
    payload = np.ascontiguousarray(payload)
    scales = np.ascontiguousarray(scales)

    if f.name == "bf16":
        return payload.view(_BF16).astype(_F32)
    nb = f.n_scales(hidden)
    with np.errstate(all="ignore"):
        if f.name == "fp8":
            q = e4m3_decode(payload).reshape(n, nb, f.block)
            unit = ftz(fp8_scales_as_float(scales))[..., None]
            out = ftz(q * unit)
        else:
            q = e2m1_decode(unpack_e2m1(payload)).reshape(n, nb, f.block)
            if f.name == "nvfp4":
                out = ftz(ftz(q * e4m3_decode(scales)[..., None]) / g)
            else:
                out = ftz(q * _pow2(scales.astype(np.int32) - 127)[..., None])
    return out.reshape(n, hidden)


# ---- 128x4 tiled block scales ----------------------------------------------------------------------------
def _swizzle_geometry(row_offsets, fmt: str, hidden: int):
    """Check the arguments; return (format, row_offsets int64, dest scale row of every source row, row tiles,
    scales_offsets uint32)."""
    f = get_format(fmt, "fmt")
    if not f.swizzled_scales:
        raise ValueError(f"fmt={fmt!r} has no swizzled block scales; use 'nvfp4' or 'mxfp4'")
    hidden = int(hidden) if isinstance(hidden, np.integer) else hidden
    check_hidden(f, hidden, "hidden")
    ro = np.asarray(row_offsets)
    if ro.ndim != 1 or ro.size < 1 or not np.issubdtype(ro.dtype, np.integer):
        raise ValueError(f"row_offsets must be a 1-D integer array [G+1], got {ro.dtype} {ro.shape}")
    ro = ro.astype(np.int64)
    counts = np.diff(ro)
    if ro[0] != 0 or np.any(counts < 0):
        raise ValueError("row_offsets must start at 0 and never decrease")
    tiles = -(-counts // SCALE_TILE_ROWS)                                    # row tiles per group
    tile_start = np.cumsum(tiles) - tiles                                    # exclusive prefix sum
    dest = np.repeat(tile_start * SCALE_TILE_ROWS - ro[:-1], counts) + np.arange(ro[-1], dtype=np.int64)
    scales_offsets = (tile_start - ro[:-1] // SCALE_TILE_ROWS).astype(np.uint32)
    return f, ro, dest, int(tiles.sum()), scales_offsets


def swizzle_block_scales(scales: np.ndarray, row_offsets: np.ndarray, fmt: str,
                         hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """Lay per-row block scales out in the 128x4 tiles block-scaled grouped GEMMs read (docs/formats.md).

    Each group g (rows ``row_offsets[g] .. row_offsets[g+1]``) starts a fresh 128-row tile; local row i of
    group g is scale row ``R = tile_start[g] * 128 + i``, and scale (R, c) sits at
    ``((R // 128) * k_tiles + c // 4) * 512 + (R % 32) * 16 + ((R % 128) // 32) * 4 + c % 4``.

    Args:
        scales: uint8 [rows', H/block] per-row scales as :func:`quantize` returns them (nvfp4: e4m3, mxfp4:
            e8m0); rows' >= rows = row_offsets[-1], rows past it are ignored.
        row_offsets: integer [G+1], starting at 0, non-decreasing.
        fmt: ``"nvfp4" | "mxfp4"``.
        hidden: H.
    Returns:
        ``(swizzled, scales_offsets)``: swizzled uint8 1-D of exactly sum_g ceil(n_g/128) * k_tiles * 512
        bytes (padding 0); scales_offsets uint32 [G], ``tile_start[g] - row_offsets[g] // 128``.
    Raises:
        ValueError: naming ``fmt``, ``hidden``, ``row_offsets`` or ``scales``.
    """
    f, ro, dest, n_tiles, scales_offsets = _swizzle_geometry(row_offsets, fmt, hidden)
    n_scales, k_tiles = f.n_scales(hidden), f.scale_k_tiles(hidden)
    if (not isinstance(scales, np.ndarray) or scales.dtype != np.uint8 or scales.ndim != 2
            or scales.shape[1] != n_scales or scales.shape[0] < ro[-1]):
        raise ValueError(f"scales must be uint8 [>= {ro[-1]}, {n_scales}], got "
                         f"{getattr(scales, 'dtype', type(scales).__name__)} {getattr(scales, 'shape', None)}")
    padded = np.zeros((n_tiles * SCALE_TILE_ROWS, k_tiles * SCALE_TILE_COLS), np.uint8)
    padded[dest, :n_scales] = scales[: ro[-1]]
    # padded[rt*128 + rq*32 + r32, kt*4 + c] -> byte ((rt*k_tiles + kt)*32 + r32)*16 + rq*4 + c
    tiles = padded.reshape(n_tiles, 4, 32, k_tiles, SCALE_TILE_COLS).transpose(0, 3, 2, 1, 4)
    return np.ascontiguousarray(tiles).reshape(-1), scales_offsets


def unswizzle_block_scales(swizzled: np.ndarray, row_offsets: np.ndarray, fmt: str, hidden: int) -> np.ndarray:
    """Inverse of :func:`swizzle_block_scales`.

    Args:
        swizzled: uint8 1-D, at least sum_g ceil(n_g/128) * k_tiles * 512 bytes (bytes past that are ignored).
        row_offsets: integer [G+1], starting at 0, non-decreasing.
        fmt: ``"nvfp4" | "mxfp4"``.
        hidden: H.
    Returns:
        uint8 [row_offsets[-1], H/block], the per-row scales.
    """
    f, ro, dest, n_tiles, _ = _swizzle_geometry(row_offsets, fmt, hidden)
    n_scales, k_tiles = f.n_scales(hidden), f.scale_k_tiles(hidden)
    need = n_tiles * k_tiles * SCALE_TILE_BYTES
    if (not isinstance(swizzled, np.ndarray) or swizzled.dtype != np.uint8 or swizzled.ndim != 1
            or swizzled.size < need):
        raise ValueError(f"swizzled must be uint8 1-D of at least {need} bytes, got "
                         f"{getattr(swizzled, 'dtype', type(swizzled).__name__)} "
                         f"{getattr(swizzled, 'shape', None)}")
    tiles = swizzled[:need].reshape(n_tiles, k_tiles, 32, 4, SCALE_TILE_COLS).transpose(0, 3, 2, 1, 4)
    padded = tiles.reshape(n_tiles * SCALE_TILE_ROWS, k_tiles * SCALE_TILE_COLS)
    return padded[dest, :n_scales]
