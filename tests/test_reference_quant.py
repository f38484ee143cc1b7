"""cuep.reference.quant against docs/formats.md, re-derived independently with float64 arithmetic and ml_dtypes."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cuep.formats import FORMATS, SCALE_TILE_BYTES, ceil_div, swizzled_scale_offset
from cuep.reference.quant import (dequantize, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode,
                                  fp8_scales_as_float, ftz, pack_e2m1, quantize, swizzle_block_scales,
                                  unpack_e2m1, unswizzle_block_scales)

F32, F64, U8 = np.float32, np.float64, np.uint8
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3, E2M1, E8M0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu
TINY = 2.0**-126  # smallest normal float32

HIDDEN = {"bf16": (16, 32, 128, 256, 7168), "fp8": (128, 256, 7168), "nvfp4": (16, 32, 128, 256, 7168),
          "mxfp4": (32, 128, 256, 7168)}
CASES = [(fmt, h) for fmt, hs in HIDDEN.items() for h in hs]


# ---- independent re-derivation (float64 arithmetic rounded once to float32, ml_dtypes conversions) ---------
# Rounding an exact float64 +, *, / result of float32 operands to float32 gives the IEEE float32 result
# (53 >= 2 * 24 + 2), so these are the same operations as the contract's, done another way.
def _flush(a) -> np.ndarray:
    a = np.asarray(a, F32)
    return np.where(np.abs(a) < TINY, np.copysign(F32(0), a), a).astype(F32)


def _f32(a64) -> np.ndarray:
    """float64 -> float32 (RNE), then FTZ."""
    with np.errstate(all="ignore"):
        return _flush(np.asarray(a64, F64).astype(F32))


def _e4m3_bits(v32):
    return np.clip(v32, -448, 448).astype(E4M3).view(U8)


def _e2m1_bits(v32):
    return np.clip(v32, -6, 6).astype(E2M1).view(U8)


def _pack(codes):
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] + 16 * pairs[..., 1]).astype(U8)


def _unpack(payload):
    return np.stack([payload % 16, payload // 16], axis=-1).reshape(payload.shape[0], -1).astype(U8)


def _indep_quantize(x, fmt, g=1.0):
    n, h = x.shape
    if fmt == "bf16":
        if x.dtype == BF16:
            return x.view(U8).reshape(n, 2 * h), np.zeros((n, 0), U8)
        bits = x.view(np.uint32).astype(np.uint64)  # round to nearest even on the upper 16 bits (finite x)
        hi = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return hi.view(U8).reshape(n, 2 * h), np.zeros((n, 0), U8)
    block = FORMATS[fmt].block
    xf = _flush(x.astype(F32)).reshape(n, h // block, block).astype(F64)
    amax = np.abs(xf).max(axis=-1)
    with np.errstate(all="ignore"):
        if fmt == "fp8":
            s = _f32(np.maximum(amax, float(F32(1e-4))) / 448.0)
            q = _e4m3_bits(_f32(xf / s[..., None].astype(F64)))
            return q.reshape(n, h), s.view(U8).reshape(n, -1)
        if fmt == "nvfp4":
            g = float(F32(g))
            t = _f32(_f32(g * amax).astype(F64) / 6.0)
            sf = _e4m3_bits(t)
            sfv = sf.view(E4M3).astype(F64)
            r = _f32(g / sfv)
            codes = _e2m1_bits(_f32(xf * r[..., None].astype(F64)))
            codes[sfv == 0] = 0
            return _pack(codes.reshape(n, h)), sf
        # mxfp4: floor(log2(amax)) from frexp (amax = m * 2**k, m in [0.5, 1))
        _, k = np.frexp(amax)
        big_e = np.where(amax == 0, -127, k - 1)
        e = np.maximum(big_e - 2, -127)
        codes = _e2m1_bits(_f32(np.ldexp(xf, -e[..., None])))
        return _pack(codes.reshape(n, h)), (e + 127).astype(U8)


def _indep_dequantize(payload, scales, fmt, h, g=1.0):
    n = payload.shape[0]
    if fmt == "bf16":
        return payload.view(BF16).astype(F32).reshape(n, h)
    block = FORMATS[fmt].block
    with np.errstate(all="ignore"):
        if fmt == "fp8":
            q = payload.view(E4M3).astype(F64).reshape(n, -1, block)
            return _f32(q * scales.view(F32).astype(F64)[..., None]).reshape(n, h)
        q = _unpack(payload).view(E2M1).astype(F64).reshape(n, -1, block)
        if fmt == "nvfp4":
            sfv = scales.view(E4M3).astype(F64)[..., None]
            return _f32(_f32(q * sfv).astype(F64) / float(F32(g))).reshape(n, h)
        unit = scales.view(E8M0).astype(F64)[..., None]
        unit = np.where(unit < TINY, 0.0, unit)  # 2**-127 is a subnormal operand: flushed
        return _f32(q * unit).reshape(n, h)


def _random_rows(rng, n, h, dtype, lo=-3.0, hi=3.0):
    x = rng.standard_normal((n, h)) * 10.0 ** rng.uniform(lo, hi, size=(n, 1))
    x[rng.random((n, h)) < 0.01] *= 50.0  # a few outliers
    return x.astype(F32).astype(dtype)


def _blocks(payload, scales, fmt, h):
    """Per-block views: codes/values [N, nb, block] and scale bytes [N, nb, itemsize]."""
    f = FORMATS[fmt]
    n = payload.shape[0]
    codes = _unpack(payload) if f.packed else payload
    return codes.reshape(n, h // f.block, f.block), scales.reshape(n, h // f.block, f.scale_itemsize)


# ---- element helpers -------------------------------------------------------------------------------------
def _sample_f32(stride=4099):
    """Every stride-th float32 bit pattern, NaN removed, plus the e2m1/e4m3 ties and their neighbours."""
    v = np.arange(0, 2**32, stride, dtype=np.uint64).astype(np.uint32).view(F32)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10,
                     416.0, 448.0, 464.0, 480.0, 2.0**-126, 2.0**-149], F32)
    ties = np.concatenate([ties, np.nextafter(ties, F32(0)), np.nextafter(ties, F32(np.inf))])
    v = np.concatenate([v, ties, -ties, np.array([0.0, -0.0, np.inf, -np.inf], F32)])
    return v[~np.isnan(v)]


def test_e2m1_encode_matches_ml_dtypes():
    v = _sample_f32()
    got = e2m1_encode(v)
    assert got.dtype == U8 and got.shape == v.shape
    np.testing.assert_array_equal(got, _e2m1_bits(v))


def test_e2m1_encode_thresholds_and_signs():
    v = np.array([0.0, -0.0, -1e-30, 0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1e30, -np.inf,
                  -0.25, -5.0], F32)
    expected = [0x0, 0x8, 0x8, 0x0, 0x1, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7, 0x7, 0xF, 0x8, 0xE]
    np.testing.assert_array_equal(e2m1_encode(v), expected)
    # NaN: deterministic, the top magnitude with NaN's sign
    nan = np.array([np.nan, -np.nan], F32)
    np.testing.assert_array_equal(e2m1_encode(nan), [0x7 | (np.signbit(nan[0]) << 3), 0x7 | (np.signbit(nan[1]) << 3)])


# ---- the kernels' bit algorithms, emulated (scripts/check_exhaustive.py checks them over all inputs) ----------
def _exhaustive_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "check_exhaustive.py"
    spec = importlib.util.spec_from_file_location("check_exhaustive", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _e2m1_special_points() -> np.ndarray:
    thr = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 12.0,
                    2.0**-126, 2.0**-149, np.finfo(F32).max], F32)
    with np.errstate(over="ignore"):
        near = np.concatenate([thr, np.nextafter(thr, F32(0)), np.nextafter(thr, F32(np.inf))])
    bits = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x00000001,
                     0x807FFFFF, 0x00000000, 0x80000000], np.uint32).view(F32)
    return np.concatenate([near, -near, bits])


def test_e2m1_device_algorithm_matches_reference(rng):
    """The kernel's e2m1 (min/max, Veltkamp's split, a saturating add, one integer add) on 1e6 random bit patterns,
    1e6 values in the e2m1 range and the special points; `python scripts/check_exhaustive.py e2m1` does all 2**32."""
    chk = _exhaustive_script()
    v = np.concatenate([rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(F32),
                        rng.uniform(-7, 7, 1_000_000).astype(F32), _e2m1_special_points()])
    assert chk.check_e2m1(v) == 0
    # eight at a time, packed as the kernels store them (e2m1x8_encode)
    v8 = np.resize(np.concatenate([rng.uniform(-7, 7, 4000).astype(F32), _e2m1_special_points()]), (1000, 8))
    rng.shuffle(v8.reshape(-1))
    codes = e2m1_encode(v8).astype(np.uint32)
    want = np.bitwise_or.reduce(codes << (4 * np.arange(8, dtype=np.uint32)), axis=1)
    np.testing.assert_array_equal(chk.e2m1x8_device(v8), want)


def test_e2m1_pow2_device_algorithm_matches_reference():
    """mxfp4's e2m1 with the block's 2**-e folded into the three lines (formats.cuh E2m1Pow2) gives the reference's
    code of ftz(x * 2**-e) for every e in [-126, 125]: the grid's rounding edges times 2**e, their neighbours and
    4096 random values per e (`python scripts/check_exhaustive.py e2m1pow2`: 2**20). At e = -127 it would not (2**128
    overflows; x = 0 gives code 2), which is why the kernels multiply first in a warp holding such a block."""
    chk = _exhaustive_script()
    assert chk.run_e2m1_pow2(per_e=1 << 12) == 0
    assert chk.check_e2m1_pow2(np.array([0.0, 2.0**-126, 1.5 * 2.0**-125], F32), -127) > 0


def test_e2m1_bf16_pairs_algorithm_matches_reference(rng):
    """mxfp4 from bf16 with the lines on bf16 pairs (formats/elements.cuh E2m1Bf16x2Pow2, rounded to bf16, no
    flushing) gives the reference's code of ftz(ftz(x) * 2**-e) for every bf16 x at every e in [-100, 125] (the
    whole of `python scripts/check_exhaustive.py e2m1bf16`), and its packing (e2m1x8_pack_bf16's byte gathers) the
    reference's word. Below that range a subnormal x would count: at e = -126 it does, hence the kernels' float32
    path for a warp holding such a block."""
    chk = _exhaustive_script()
    assert chk.run_e2m1_bf16() == 0
    xbits = np.arange(1 << 16, dtype=np.uint32)
    with np.errstate(all="ignore"):
        flushed = e2m1_encode(ftz(ftz((xbits << np.uint32(16)).view(F32)) * F32(2.0**126)))
    assert (chk.e2m1_bf16_device(xbits, -126) != flushed).any()
    words = rng.integers(0, 2**32, (20000, 4), dtype=np.uint64).astype(np.uint32)
    e = rng.integers(chk.E2M1_BF16_MIN_E, 126, words.shape[0])
    x = (words.view(np.uint16).reshape(-1, 8).astype(np.uint32) << np.uint32(16)).view(F32)  # element 2i: low half
    with np.errstate(all="ignore"):
        codes = e2m1_encode(ftz(ftz(x) * np.ldexp(F32(1.0), -e)[:, None].astype(F32))).astype(np.uint32)
    finite = np.isfinite(x).all(axis=1)
    want = np.bitwise_or.reduce(codes << (4 * np.arange(8, dtype=np.uint32)), axis=1)
    np.testing.assert_array_equal(chk.e2m1x8_pack_bf16_device(words, e)[finite], want[finite])


def test_fp8_division_algorithm_is_the_ieee_quotient(rng):
    """The fp8 quantizer's x / s (RN(1/s), two FMA corrections, the sign of x) on 2**20 pairs of significands,
    a third of them with the quotient within a few ulps of a rounding midpoint; plus the quantizer's extremes.
    `python scripts/check_exhaustive.py fp8div` checks every divisor significand."""
    chk = _exhaustive_script()
    s = rng.integers(0x3F800000, 0x40000000, 4096, dtype=np.uint32).view(F32)
    assert chk.check_fp8div(chk.fp8div_dividends(rng, s, 256), s[:, None]) == 0
    # real scales: s = max(amax, 1e-4) / 448 with x in [-amax, amax], |x / s| >= 2**-11, at the range's ends
    amax = np.array([1e-4, 1.5e-4, 1.0, 448.0, 3e5, 1e30, np.finfo(F32).max], F32)
    s = (np.maximum(amax, F32(1e-4)) / F32(448)).astype(F32)
    x = np.concatenate([np.linspace(-1, 1, 2001), [2.0**-11 * 448, -(2.0**-11) * 448]]).astype(F32)
    x = (amax[:, None] * x[None, :]).astype(F32)
    assert chk.check_fp8div(x, s[:, None]) == 0
    zeros = np.array([0.0, -0.0], F32)
    got = chk.div_rn_by(zeros, np.array([1.0, 1.0], F32), np.array([1.0, 1.0], F32))
    np.testing.assert_array_equal(got.view(np.uint32), zeros.view(np.uint32))  # -0 / s = -0 (sign copied)


def test_e2m1_decode_table():
    codes = np.arange(16, dtype=U8)
    got = e2m1_decode(codes)
    np.testing.assert_array_equal(got.view(np.uint32), codes.view(E2M1).astype(F32).view(np.uint32))
    assert np.signbit(got[8]) and got[8] == 0
    with pytest.raises(ValueError, match="codes"):
        e2m1_decode(np.array([16], U8))


def _nearest_e4m3(v):
    """Round-to-nearest-even onto the 127 finite e4m3 magnitudes by search, saturating at 448."""
    mags = np.arange(127, dtype=U8).view(E4M3).astype(F64)  # codes 0..126 ascending, 0 .. 448
    a = np.abs(v.astype(F64))
    hi = np.clip(np.searchsorted(mags, a, side="left"), 0, 126)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - mags[lo], mags[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)) | (a >= 448)
    code = np.where(take_hi, hi, lo).astype(U8)
    return code | (np.signbit(v).astype(U8) << 7)


def test_e4m3_encode_nearest_even_saturating():
    v = _sample_f32()
    got = e4m3_encode(v)
    assert got.dtype == U8 and got.shape == v.shape
    np.testing.assert_array_equal(got, _nearest_e4m3(v))
    v = np.array([448, 460, 464, 1e30, np.inf, -np.inf, -500, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -0.0,
                  -1e-40], F32)
    np.testing.assert_array_equal(e4m3_encode(v),
                                  [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x38, 0x3A, 0x00, 0x02, 0x80, 0x80])


def test_e4m3_nan_stays_nan_deterministic():
    v = np.array([np.nan, -np.nan, 1.0], F32)
    a, b = e4m3_encode(v), e4m3_encode(v.copy())
    np.testing.assert_array_equal(a, b)
    assert np.isnan(e4m3_decode(a[:2])).all() and e4m3_decode(a[2:])[0] == 1.0


def test_e4m3_decode_all_bytes():
    u = np.arange(256, dtype=U8)
    got, want = e4m3_decode(u), u.view(E4M3).astype(F32)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.isnan(got[~finite]).all() and (~finite).sum() == 2


def test_ftz():
    v = np.array([1e-40, -1e-40, 2.0**-149, -(2.0**-127), TINY, -TINY, 0.0, -0.0, 1.0, np.inf, -np.inf, np.nan],
                 F32)
    got = ftz(v)
    np.testing.assert_array_equal(got[:4], 0.0)
    np.testing.assert_array_equal(np.signbit(got[:4]), [False, True, False, True])
    np.testing.assert_array_equal(got[4:11].view(np.uint32), v[4:11].view(np.uint32))
    assert np.isnan(got[11])
    assert v[0] != 0  # input untouched
    with pytest.raises(ValueError, match="float32"):
        ftz(np.zeros(3, F64))


def test_pack_unpack_e2m1(rng):
    assert pack_e2m1(np.array([[0x1, 0x2, 0xF, 0x8]], U8)).tolist() == [[0x21, 0x8F]]
    codes = rng.integers(0, 16, (5, 64), dtype=U8)
    packed = pack_e2m1(codes)
    assert packed.shape == (5, 32) and packed.dtype == U8
    np.testing.assert_array_equal(packed, _pack(codes))
    np.testing.assert_array_equal(unpack_e2m1(packed), codes)


def test_fp8_scales_as_float_is_a_view(rng):
    s = rng.random((3, 4), dtype=F32)
    b = s.view(U8)
    f = fp8_scales_as_float(b)
    assert f.dtype == F32 and f.shape == (3, 4) and np.shares_memory(f, b)
    np.testing.assert_array_equal(f, s)
    with pytest.raises(ValueError, match="scales"):
        fp8_scales_as_float(np.zeros((2, 6), U8))


# ---- quantize / dequantize on random rows ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16in"])
@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("fmt,h", CASES)
def test_quantize_bits_and_roundtrip(rng, fmt, h, n, dtype):
    f = FORMATS[fmt]
    x = _random_rows(rng, n, h, dtype)
    payload, scales = quantize(x, fmt)
    assert payload.dtype == U8 and payload.shape == (n, f.payload_bytes(h))
    assert scales.dtype == U8 and scales.shape == (n, f.scale_bytes(h))

    want_p, want_s = _indep_quantize(x, fmt)
    np.testing.assert_array_equal(payload, want_p)
    np.testing.assert_array_equal(scales, want_s)

    deq = dequantize(payload, scales, fmt, h)
    assert deq.dtype == F32 and deq.shape == (n, h)
    np.testing.assert_array_equal(deq.view(np.uint32), _indep_dequantize(payload, scales, fmt, h).view(np.uint32))
    _check_error_bound(x.astype(F32), deq, payload, scales, fmt, h)
    _check_reencode_stable(deq, payload, scales, fmt, h)


def _check_error_bound(x, deq, payload, scales, fmt, h, g=1.0):
    """Sound per-element bounds of |dequantize(quantize(x)) - x| (x already free of subnormals here)."""
    err = np.abs(deq.astype(F64) - x.astype(F64))
    ax = np.abs(x.astype(F64))
    if fmt == "bf16":
        assert (err <= ax * 2.0**-8).all()  # 8 significant bits, RNE
        return
    n, block = x.shape[0], FORMATS[fmt].block
    err, ax = err.reshape(n, -1, block), ax.reshape(n, -1, block)
    amax = ax.max(axis=-1, keepdims=True)
    if fmt == "fp8":
        s = scales.view(F32).astype(F64)[..., None]
        # e4m3: 3 mantissa bits -> relative 2**-4 on normals, 2**-10 absolute (in units of s) on subnormals
        bound = 2.0**-4 * ax + 2.0**-10 * s + 2.0**-20 * amax
        assert (err <= bound).all()
        assert (err.max(axis=-1) <= 2.0**-4 * amax[..., 0] + 2.0**-10 * s[..., 0]).all()
        return
    if fmt == "mxfp4":
        unit = scales.view(E8M0).astype(F64)[..., None]  # 2**e
        # v = x / 2**e lies in [0, 8): e2m1 error <= 0.25 below 1, <= |v| / 4 from 1 up (saturation 6..8 too)
        bound = np.maximum(0.25 * unit, ax / 4) * (1 + 2.0**-20)
        assert (err <= bound).all()
        assert (err.max(axis=-1) <= amax[..., 0] / 2).all()  # amax >= 2**(e+2): at most half of the block amax
        return
    g = float(F32(g))
    unit = scales.view(E4M3).astype(F64)[..., None] / g  # sfv / g: one e2m1 unit in x's scale
    slack = 2.0**-20 * (ax + unit)
    generic = np.maximum(np.maximum(ax / 4, 0.25 * unit), ax - 6 * unit)  # the last term: saturation
    assert (err <= generic + slack).all()
    # sf a normal e4m3, not saturated at 448: relative error <= 2**-4, so |v| <= 6.4 (little saturation)
    normal_sf = (unit * g >= 2.0**-6) & (g * amax / 6 <= 448)
    assert (err <= ax / 4 + 0.25 * unit + slack)[np.broadcast_to(normal_sf, err.shape)].all()
    zero_sf = unit[..., 0] == 0  # sf rounded to 0: g * amax / 6 <= 2**-10 (half the smallest e4m3 subnormal)
    assert (g * amax[..., 0][zero_sf] / 6 <= 2.0**-10 * (1 + 2.0**-20)).all()
    assert (deq.reshape(err.shape)[zero_sf] == 0).all()


def _check_reencode_stable(deq, payload, scales, fmt, h, g=1.0):
    """quantize(dequantize(q)) gives q back (fp8 scales up to float32 rounding), in the blocks where that holds."""
    p2, s2 = quantize(deq, fmt, g)
    if fmt == "bf16":
        np.testing.assert_array_equal(p2, payload)
        return
    if fmt == "fp8":
        np.testing.assert_array_equal(p2, payload)
        s1, s2f = scales.view(F32), s2.view(F32)
        assert (np.abs(s2f - s1) <= 2.0**-22 * s1).all()
        return
    c1, b1 = _blocks(payload, scales, fmt, h)
    c2, b2 = _blocks(p2, s2, fmt, h)
    if fmt == "mxfp4":
        ok = b1[..., 0] >= 27  # 2**e comfortably normal (e >= -100)
    else:
        sfv = b1[..., 0].view(E4M3).astype(F64)
        ok = (sfv >= 2.0**-6) | (sfv == 0)
    np.testing.assert_array_equal(c2[ok], c1[ok])
    np.testing.assert_array_equal(b2[ok], b1[ok])


@pytest.mark.parametrize("g", [1.0, 0.37, 1000.0, 2.0**-20])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16in"])
def test_nvfp4_global_scale(rng, g, dtype):
    x = _random_rows(rng, 8, 256, dtype, lo=-2, hi=2)
    payload, scales = quantize(x, "nvfp4", g)
    want_p, want_s = _indep_quantize(x, "nvfp4", g)
    np.testing.assert_array_equal(payload, want_p)
    np.testing.assert_array_equal(scales, want_s)
    deq = dequantize(payload, scales, "nvfp4", 256, g)
    np.testing.assert_array_equal(deq.view(np.uint32),
                                  _indep_dequantize(payload, scales, "nvfp4", 256, g).view(np.uint32))
    _check_error_bound(x.astype(F32), deq, payload, scales, "nvfp4", 256, g)
    _check_reencode_stable(deq, payload, scales, "nvfp4", 256, g)


def test_empty_rows():
    for fmt, f in FORMATS.items():
        p, s = quantize(np.zeros((0, 128), F32), fmt)
        assert p.shape == (0, f.payload_bytes(128)) and s.shape == (0, f.scale_bytes(128))
        assert dequantize(p, s, fmt, 128).shape == (0, 128)


# ---- edge rows -------------------------------------------------------------------------------------------
def test_signed_zeros_and_zero_blocks():
    h = 128
    x = np.zeros((2, h), F32)
    x[1, 1::2] = -0.0
    p, s = quantize(x, "fp8")
    np.testing.assert_array_equal(p[1], np.tile([0x00, 0x80], h // 2))
    np.testing.assert_array_equal(p[0], 0)
    np.testing.assert_array_equal(fp8_scales_as_float(s), F32(1e-4) / F32(448))  # the amax floor
    # nvfp4: sf = 0, and then the whole block is +0, -0 included
    p, s = quantize(x, "nvfp4")
    np.testing.assert_array_equal(p, 0)
    np.testing.assert_array_equal(s, 0)
    # mxfp4 has no such rule: scale byte 0 (e = -127), -0 keeps its sign bit
    p, s = quantize(x, "mxfp4")
    np.testing.assert_array_equal(s, 0)
    np.testing.assert_array_equal(p[0], 0)
    np.testing.assert_array_equal(p[1], 0x80)
    # bf16: the bytes of +-0
    p, _ = quantize(x, "bf16")
    np.testing.assert_array_equal(p[1].view(np.uint16), np.tile([0x0000, 0x8000], h // 2))
    for fmt in FORMATS:
        deq = dequantize(*quantize(x, fmt), fmt, h)
        np.testing.assert_array_equal(deq, 0)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16in"])
def test_subnormals_flushed_keeping_sign(rng, fmt, dtype):
    h = 256
    x = _random_rows(rng, 4, h, F32)
    sub = np.array([1e-40, -1e-40, 2.0**-149, -(2.0**-130), 2.0**-127], F32)
    x[0, :5] = sub  # among normals
    x[1, :] = np.resize(sub, h)  # a row of nothing but subnormals
    x = x.astype(dtype)
    flushed = np.where(np.abs(x.astype(F32)) < TINY, np.copysign(F32(0), x.astype(F32)), x.astype(F32))
    assert np.signbit(flushed[1, 1]) and flushed[1, 1] == 0
    p, s = quantize(x, fmt)
    p0, s0 = quantize(flushed, fmt)
    np.testing.assert_array_equal(p, p0)
    np.testing.assert_array_equal(s, s0)
    if fmt == "fp8":
        assert p[0, 1] == 0x80 and p[0, 0] == 0x00


def test_bf16_format_is_a_pure_conversion():
    x = np.array([[1e-40, -1e-40, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.0e38, np.inf, -np.inf, -0.0]], F32)
    p, s = quantize(x, "bf16")
    assert s.shape == (1, 0)
    np.testing.assert_array_equal(p.view(np.uint16), x.astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(p.view(np.uint16)[0, :4], [0x0001, 0x8001, 0x3F80, 0x3F82])  # subnormals kept
    nans = np.array([[0x7F800001, 0xFFA00000, 0x7FC00001, 0xFFFFFFFF] * 2], np.uint32).view(F32)
    np.testing.assert_array_equal(quantize(nans, "bf16")[0].view(np.uint16), [[0x7FC0, 0xFFC0] * 4])
    xb = np.random.default_rng(0).standard_normal((3, 16)).astype(BF16)
    p, _ = quantize(xb, "bf16")
    np.testing.assert_array_equal(p, xb.view(U8))
    np.testing.assert_array_equal(dequantize(p, _, "bf16", 16), xb.astype(F32))


def test_fp8_saturation_and_ties():
    x = np.zeros((1, 128), F32)
    vals = [448.0, -448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 0.5, 100.0, -1e-40]
    x[0, :len(vals)] = vals  # amax = 448 -> s = 1 exactly, x / s = x
    p, s = quantize(x, "fp8")
    assert fp8_scales_as_float(s)[0, 0] == 1.0
    np.testing.assert_array_equal(p[0, :len(vals)], [0x7E, 0xFE, 0x38, 0x3A, 0xB8, 0x00, 0x02, 0x30, 0x6C, 0x80])
    deq = dequantize(p, s, "fp8", 128)
    np.testing.assert_array_equal(deq[0, :3], [448.0, -448.0, 1.0])


def _bits(u32):
    return np.array([u32], np.uint32).view(F32)[0]


def test_fp8_divides_not_multiplies_by_reciprocal():
    # amax and x picked so that cvt(x / s) != cvt(x * (1 / s)): the contract's IEEE division decides the code
    x = np.zeros((1, 128), F32)
    x[0, 0], x[0, 1] = _bits(0x3FC20E89), _bits(0x3B6BA3F0)
    s = x[0, 0] / F32(448)
    assert e4m3_encode(x[0, 1] * (F32(1) / s)) == 0x39
    p, _ = quantize(x, "fp8")
    assert p[0, 1] == 0x38 == e4m3_encode(x[0, 1] / s)


def test_nvfp4_multiplies_by_g_over_sf():
    # g and x picked so that cvt(x * (g / sfv)) != cvt((x * g) / sfv): the contract's order decides the code
    g = _bits(0x3F729EE0)
    x = np.zeros((1, 16), F32)
    x[0, 0], x[0, 1] = 6.0, _bits(0x401E4595)
    p, s = quantize(x, "nvfp4", g)
    sfv = e4m3_decode(s)[0, 0]
    assert e2m1_encode((x[0, 1] * g) / sfv) == 4
    assert unpack_e2m1(p)[0, 1] == 5 == e2m1_encode(x[0, 1] * (g / sfv))


def test_nvfp4_scale_is_g_times_amax_then_divided_by_6():
    # (g * amax) / 6 and g * (amax / 6) round to different e4m3 scales here
    g, amax = _bits(0x3FFAE785), _bits(0x4050249F)
    assert e4m3_encode(g * (amax / F32(6))) == 0x39
    _, s = quantize(np.full((1, 16), amax, F32), "nvfp4", g)
    assert s[0, 0] == 0x38 == e4m3_encode((g * amax) / F32(6))


def test_dequantize_flushes_subnormal_results():
    # nvfp4: the smallest value, (0.5 * 2**-9) / 2**100 = 2**-110, is normal within the allowed global scales
    payload = pack_e2m1(np.array([[0x1, 0x9] + [0] * 14], U8))
    out = dequantize(payload, np.array([[0x01]], U8), "nvfp4", 16, 2.0**100)
    assert out[0, 0] == F32(2.0**-110) and out[0, 1] == F32(-(2.0**-110))
    # fp8: q * s with a subnormal product (and a subnormal s operand) -> 0
    s = np.array([[2.0**-120]], F32).view(U8)
    payload = np.zeros((1, 128), U8)
    payload[0, :3] = [0x01, 0x38, 0x7E]  # 2**-9, 1.0, 448
    out = dequantize(payload, s, "fp8", 128)
    assert out[0, 0] == 0 and out[0, 1] == F32(2.0**-120) and out[0, 2] == F32(448 * 2.0**-120)
    # a subnormal s is flushed as an operand (448 * 2**-130 would be normal)
    out = dequantize(payload, np.array([[2.0**-130]], F32).view(U8), "fp8", 128)
    np.testing.assert_array_equal(out, 0)


def test_fp8_relative_error_per_block(rng):
    x = _random_rows(rng, 16, 1024, F32, lo=-6, hi=6)
    p, s = quantize(x, "fp8")
    err = np.abs(dequantize(p, s, "fp8", 1024) - x).reshape(16, 8, 128).max(axis=-1)
    amax = np.abs(x).reshape(16, 8, 128).max(axis=-1)
    assert (err <= 2.0**-4 * amax).all()


def test_nvfp4_at_six_and_ties():
    x = np.zeros((1, 32), F32)
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, -6.0, 0.5, -1e-40, -0.1]
    x[0, :len(ties)] = ties  # amax 6, g 1: t = 1, sf = 1.0 (0x38), r = 1
    p, s = quantize(x, "nvfp4")
    assert s[0, 0] == 0x38 and s[0, 1] == 0  # second block all zero -> sf 0
    codes = unpack_e2m1(p)[0]
    np.testing.assert_array_equal(codes[:len(ties)], [0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x8, 0xE, 0xF, 0x1,
                                                      0x8, 0x8])
    np.testing.assert_array_equal(codes[16:], 0)


def test_nvfp4_huge_and_tiny_global_scale():
    x = np.array([np.linspace(-3, 3, 32)], F32)
    # huge g: t = g * amax / 6 far past 448 -> sf saturates at 448; x * (g / 448) saturates e2m1 at 6
    p, s = quantize(x, "nvfp4", 1e6)
    np.testing.assert_array_equal(s, 0x7E)
    want_p, _ = _indep_quantize(x, "nvfp4", 1e6)
    np.testing.assert_array_equal(p, want_p)
    codes = unpack_e2m1(p)[0]
    assert (codes[np.abs(x[0]) >= 0.01] & 7 == 7).all()
    # g * amax overflowing float32: still 448
    p, s = quantize(np.full((1, 16), 3e38, F32), "nvfp4", 1e30)
    np.testing.assert_array_equal(s, 0x7E)
    # tiny g: t below half the smallest e4m3 subnormal -> sf 0 -> every code +0, negatives included
    p, s = quantize(x, "nvfp4", 1e-6)
    np.testing.assert_array_equal(s, 0)
    np.testing.assert_array_equal(p, 0)
    np.testing.assert_array_equal(dequantize(p, s, "nvfp4", 32, 1e-6), 0)
    # just above that: sf is the smallest subnormal 2**-9
    g = float(F32(2.0**-10 * 1.01 * 6 / 3))
    _, s = quantize(x, "nvfp4", g)
    np.testing.assert_array_equal(s, 0x01)


@pytest.mark.parametrize("k", [-124, -100, -10, -1, 0, 1, 7, 100, 127])
def test_mxfp4_power_of_two_amax(k):
    amax = math.ldexp(1.0, k)
    x = np.zeros((1, 128), F32)
    x[0, :32] = amax * np.linspace(-1, 1, 32)   # amax exactly 2**k
    x[0, 32] = amax * 1.5                        # v = 6 exactly
    x[0, 64] = amax * 1.875                      # v = 7.5 -> saturates at 6
    x[0, 96] = -amax * 1.25                      # v = -5, a tie -> 4
    p, s = quantize(x, "mxfp4")
    np.testing.assert_array_equal(s[0], k - 2 + 127)  # exactly floor(log2(amax)) - 2
    codes = unpack_e2m1(p)[0]
    assert codes[31] == 6 and codes[0] == 0xE       # +-amax -> +-4
    assert codes[32] == 7 and codes[64] == 7 and codes[96] == 0xE
    deq = dequantize(p, s, "mxfp4", 128)
    assert deq[0, 31] == F32(amax) and deq[0, 32] == F32(amax * 1.5) and deq[0, 64] == F32(amax * 1.5)
    want_p, want_s = _indep_quantize(x, "mxfp4")
    np.testing.assert_array_equal(p, want_p)
    np.testing.assert_array_equal(s, want_s)


def test_mxfp4_smallest_scales():
    x = np.zeros((1, 128), F32)
    x[0, 0] = 2.0**-125         # E = -125 -> e = -127 (the floor), scale byte 0
    x[0, 32] = 2.0**-124        # E = -124 -> e = -126, scale byte 1
    x[0, 64] = 2.0**-126        # E = -126 -> e = -127
    p, s = quantize(x, "mxfp4")
    np.testing.assert_array_equal(s[0], [0, 1, 0, 0])
    codes = unpack_e2m1(p)[0]
    assert codes[0] == 6 and codes[32] == 6 and codes[64] == 4  # 2**-125 * 2**127 = 4, ..., 2**-126 * 2**127 = 2
    deq = dequantize(p, s, "mxfp4", 128)
    assert deq[0, 0] == 0 and deq[0, 64] == 0   # 2**-127 is a subnormal operand: flushed
    assert deq[0, 32] == F32(2.0**-124)
    np.testing.assert_array_equal(deq.view(np.uint32), _indep_dequantize(p, s, "mxfp4", 128).view(np.uint32))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_nonfinite_blocks_leave_other_blocks_exact(rng, fmt):
    h = 256
    f = FORMATS[fmt]
    x = _random_rows(rng, 4, h, F32)
    bad = x.copy()
    hits = [(0, 130), (1, 5), (2, 200), (3, 0), (3, 255)]
    for (r, c), v in zip(hits, [np.nan, np.inf, -np.inf, np.nan, np.inf]):
        bad[r, c] = v
    p_bad, s_bad = quantize(bad, fmt)
    p_bad2, s_bad2 = quantize(bad.copy(), fmt)
    np.testing.assert_array_equal(p_bad, p_bad2)  # deterministic
    np.testing.assert_array_equal(s_bad, s_bad2)
    p, s = quantize(x, fmt)
    if fmt == "bf16":
        keep = np.isfinite(bad)
        np.testing.assert_array_equal(p_bad.view(np.uint16)[keep], p.view(np.uint16)[keep])
        assert p_bad.view(np.uint16)[1, 5] == 0x7F80 and p_bad.view(np.uint16)[2, 200] == 0xFF80
        return
    nb = h // f.block
    finite = np.isfinite(bad).reshape(4, nb, f.block).all(axis=-1)
    assert (~finite).sum() == len(hits)
    pb = p_bad.reshape(4, nb, -1)
    sb = s_bad.reshape(4, nb, -1)
    np.testing.assert_array_equal(pb[finite], p.reshape(4, nb, -1)[finite])
    np.testing.assert_array_equal(sb[finite], s.reshape(4, nb, -1)[finite])
    deq_bad = dequantize(p_bad, s_bad, fmt, h).reshape(4, nb, f.block)
    np.testing.assert_array_equal(deq_bad[finite], dequantize(p, s, fmt, h).reshape(4, nb, f.block)[finite])


# ---- swizzled block scales -------------------------------------------------------------------------------
def _readable_swizzle(scales, row_offsets, fmt, h):
    f = FORMATS[fmt]
    k_tiles, n_scales = f.scale_k_tiles(h), f.n_scales(h)
    counts = np.diff(row_offsets)
    tiles = [ceil_div(int(c), 128) for c in counts]
    out = np.zeros(sum(tiles) * k_tiles * SCALE_TILE_BYTES, U8)
    tile_start = 0
    for g, n_g in enumerate(counts):
        for i in range(n_g):
            big_r = tile_start * 128 + i
            for c in range(n_scales):
                out[swizzled_scale_offset(big_r, c, k_tiles)] = scales[row_offsets[g] + i, c]
        tile_start += tiles[g]
    return out


GROUPS = [[0], [128], [129], [5, 0, 128, 129, 0, 300, 1], [0, 0, 0], [1, 127, 0, 256]]


@pytest.mark.parametrize("fmt,h", [("nvfp4", 16), ("nvfp4", 80), ("nvfp4", 7168), ("mxfp4", 32),
                                   ("mxfp4", 224), ("mxfp4", 7168)])
@pytest.mark.parametrize("counts", GROUPS + ["random"], ids=lambda c: str(c))
def test_swizzle_matches_definition(rng, fmt, h, counts):
    f = FORMATS[fmt]
    if counts == "random":
        counts = rng.integers(0, 260, 6) * (rng.random(6) < 0.7)
    if h == 7168 and np.sum(counts) > 300:
        counts = counts[:3]  # keep the per-element loop quick
    row_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = int(row_offsets[-1])
    scales = rng.integers(1, 256, (rows + 3, f.n_scales(h)), dtype=U8)  # nonzero: padding shows; 3 extra rows
    sw, offs = swizzle_block_scales(scales, row_offsets, fmt, h)
    k_tiles = f.scale_k_tiles(h)
    tiles = -(-np.diff(row_offsets.astype(np.int64)) // 128)
    assert sw.dtype == U8 and sw.ndim == 1 and sw.size == tiles.sum() * k_tiles * 512
    np.testing.assert_array_equal(sw, _readable_swizzle(scales, row_offsets, fmt, h))
    # scales_offsets: group g's first 128-row scale block is row_offsets[g] // 128 + scales_offsets[g]
    tile_start = np.cumsum(tiles) - tiles
    assert offs.dtype == np.uint32 and offs.shape == (len(counts),)
    np.testing.assert_array_equal(row_offsets[:-1] // 128 + offs.astype(np.int64), tile_start)
    np.testing.assert_array_equal(unswizzle_block_scales(sw, row_offsets, fmt, h), scales[:rows])


def test_swizzle_large_and_from_quantize(rng):
    h = 7168
    counts = np.array([40000, 0, 128, 129, 59743])
    row_offsets = np.concatenate([[0], np.cumsum(counts)])
    scales = rng.integers(0, 256, (int(row_offsets[-1]), h // 32), dtype=U8)
    sw, offs = swizzle_block_scales(scales, row_offsets, "mxfp4", h)
    np.testing.assert_array_equal(unswizzle_block_scales(sw, row_offsets, "mxfp4", h), scales)
    # spot-check some elements against the definition
    tile_start = np.cumsum(-(-counts // 128)) - (-(-counts // 128))
    for _ in range(200):
        g = int(rng.choice(np.flatnonzero(counts)))
        i, c = int(rng.integers(counts[g])), int(rng.integers(h // 32))
        off = swizzled_scale_offset(int(tile_start[g]) * 128 + i, c, h // 32 // 4)
        assert sw[off] == scales[row_offsets[g] + i, c]
    # quantize's scales go straight in
    x = _random_rows(rng, 10, 64, F32)
    _, s = quantize(x, "nvfp4")
    sw, _ = swizzle_block_scales(s, [0, 4, 10], "nvfp4", 64)
    assert sw.size == 2 * 1 * 512
    assert sw[swizzled_scale_offset(128 + 5, 3, 1)] == s[9, 3]
    # a larger buffer (dispatch capacity) unswizzles the same
    big = np.concatenate([sw, np.zeros(4096, U8)])
    np.testing.assert_array_equal(unswizzle_block_scales(big, [0, 4, 10], "nvfp4", 64), s)


def test_swizzle_errors():
    s = np.zeros((4, 2), U8)
    with pytest.raises(ValueError, match="fmt"):
        swizzle_block_scales(s, [0, 4], "fp8", 256)
    with pytest.raises(ValueError, match="fmt"):
        swizzle_block_scales(s, [0, 4], "int4", 32)
    with pytest.raises(ValueError, match="hidden"):
        swizzle_block_scales(s, [0, 4], "nvfp4", 40)
    with pytest.raises(ValueError, match="row_offsets"):
        swizzle_block_scales(s, [0, 3, 2], "nvfp4", 32)
    with pytest.raises(ValueError, match="row_offsets"):
        swizzle_block_scales(s, [1, 4], "nvfp4", 32)
    with pytest.raises(ValueError, match="row_offsets"):
        swizzle_block_scales(s, [[0, 4]], "nvfp4", 32)
    with pytest.raises(ValueError, match="scales"):
        swizzle_block_scales(s, [0, 5], "nvfp4", 32)
    with pytest.raises(ValueError, match="scales"):
        swizzle_block_scales(s, [0, 4], "nvfp4", 48)
    with pytest.raises(ValueError, match="swizzled"):
        unswizzle_block_scales(np.zeros(100, U8), [0, 4], "nvfp4", 32)


# ---- argument errors -------------------------------------------------------------------------------------
def test_quantize_errors():
    x = np.zeros((2, 128), F32)
    with pytest.raises(ValueError, match="fmt"):
        quantize(x, "fp16")
    with pytest.raises(ValueError, match="x"):
        quantize(np.zeros(128, F32), "fp8")
    with pytest.raises(ValueError, match="x"):
        quantize(np.zeros((2, 128), F64), "fp8")
    with pytest.raises(ValueError, match="x"):
        quantize([[0.0] * 128], "fp8")
    with pytest.raises(ValueError, match=r"x\.shape\[1\]"):
        quantize(np.zeros((2, 64), F32), "fp8")
    with pytest.raises(ValueError, match=r"x\.shape\[1\]"):
        quantize(np.zeros((2, 48), F32), "mxfp4")
    with pytest.raises(ValueError, match=r"x\.shape\[1\]"):
        quantize(np.zeros((2, 12), F32), "bf16")
    for g in (0.0, -1.0, np.inf, np.nan, 1e-300, 1e300, 1e-40, 2.0**-101, 2.0**101, "1", None, [1.0]):
        with pytest.raises(ValueError, match=r"global_scale.*\[2\*\*-100, 2\*\*100\]"):
            quantize(x, "nvfp4", g)
    for g in (2.0**-100, 2.0**100):  # the ends of the range are allowed
        quantize(x, "nvfp4", g)


def test_dequantize_errors():
    p, s = quantize(np.zeros((2, 128), F32), "nvfp4")
    with pytest.raises(ValueError, match="fmt"):
        dequantize(p, s, "nope", 128)
    with pytest.raises(ValueError, match="hidden"):
        dequantize(p, s, "nvfp4", 100)
    with pytest.raises(ValueError, match="payload"):
        dequantize(p[:, :10], s, "nvfp4", 128)
    with pytest.raises(ValueError, match="payload"):
        dequantize(p.astype(np.int8), s, "nvfp4", 128)
    with pytest.raises(ValueError, match="scales"):
        dequantize(p, s[:1], "nvfp4", 128)
    with pytest.raises(ValueError, match="scales"):
        dequantize(p, s[:, :3], "nvfp4", 128)
    with pytest.raises(ValueError, match="global_scale"):
        dequantize(p, s, "nvfp4", 128, 0.0)
    assert dequantize(p, s, "nvfp4", np.int64(128)).shape == (2, 128)
