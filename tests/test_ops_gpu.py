"""cuep.ops on the GPU against the NumPy contract (cuep.reference), bit for bit; plus the device helpers' self tests.

Every GPU test is marked ``gpu`` (skipped without one). The argument-check tests at the top need no GPU: the ops
validate before touching the device, so numpy inputs and bad format names fail the same way on a CPU machine.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cuep import _kernels, formats, ops  # noqa: E402
from cuep.reference import ep as ref_ep  # noqa: E402
from cuep.reference import quant as ref  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
POISON = 0xA5
QUANT_FORMATS = ("fp8", "nvfp4", "mxfp4")
ALL_FORMATS = ("bf16",) + QUANT_FORMATS
DTYPES = (F32, BF16)
DTYPE_IDS = ("f32", "bf16")


# ---- helpers -------------------------------------------------------------------------------------------------
def to_dev(a: np.ndarray) -> "cupy.ndarray":
    """Host array -> device (bf16 travels as its uint16 bits)."""
    if a.dtype == BF16:
        return cupy.asarray(np.ascontiguousarray(a).view(np.uint16)).view(BF16)
    return cupy.asarray(a)


def to_host(a: "cupy.ndarray") -> np.ndarray:
    if a.dtype == BF16:
        return a.view(np.uint16).get().view(BF16)
    return a.get()


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bits of a host array, for exact comparisons (-0.0 != +0.0, NaN payloads)."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(bits(got) != bits(want))
    if bad.size:
        i = np.unravel_index(bad[0], got.shape)
        pytest.fail(f"{what}: {bad.size} of {got.size} differ; first at {i}: got {got[i]!r} "
                    f"(bits {bits(got)[i]:#x}), want {want[i]!r} (bits {bits(want)[i]:#x})")


def assert_same_floats(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Bitwise, except that any NaN equals any NaN."""
    got, want = np.asarray(got), np.asarray(want)
    both_nan = np.isnan(got) & np.isnan(want)
    assert_same_bits(np.where(both_nan, np.float32(0), got), np.where(both_nan, np.float32(0), want), what)


def random_rows(rng: np.random.Generator, n: int, h: int, dtype=F32) -> np.ndarray:
    """Fresh nonzero values whose 8-value groups span many binades: normal x a per-row power of ten x a per-group
    power of two."""
    x = rng.standard_normal((n, h), dtype=np.float32)
    x[x == 0] = 1.0
    row = 10.0 ** rng.uniform(-12, 12, size=(n, 1))
    grp = np.repeat(2.0 ** rng.integers(-8, 9, size=(n, h // 8)), 8, axis=1)
    return (x * row * grp).astype(np.float32).astype(dtype)


def poisoned(shape, dtype) -> "cupy.ndarray":
    a = cupy.empty(shape, dtype)
    a.view(np.uint8)[...] = POISON
    return a


def poison_bits(dtype) -> int:
    return int.from_bytes(bytes([POISON]) * np.dtype(dtype).itemsize, "little")


# ---- no GPU needed -----------------------------------------------------------------------------------------------
def _cuh_constants(name: str) -> dict[str, str]:
    """The constexpr constants of a header, or of every header in a folder (``"formats"``)."""
    path = _kernels.SRC_DIR / name
    text = "".join(p.read_text() for p in sorted(path.glob("*.cuh"))) if path.is_dir() else path.read_text()
    return dict(re.findall(r"constexpr\s+(?:int|float|double|int64_t|uint64_t)\s+(k\w+)\s*=\s*([^;]+);", text))


def test_formats_cuh_constants_match_python():
    c = _cuh_constants("formats")
    assert int(c["kFp8Block"]) == formats.FP8_BLOCK
    assert float(c["kFp8Max"].rstrip("f")) == formats.FP8_MAX
    assert np.float32(c["kFp8AmaxFloor"].rstrip("f")) == np.float32(formats.FP8_AMAX_FLOOR)
    assert int(c["kNvfp4Block"]) == formats.NVFP4_BLOCK
    assert int(c["kMxfp4Block"]) == formats.MXFP4_BLOCK
    assert float(c["kE2m1Max"].rstrip("f")) == formats.E2M1_MAX
    assert int(c["kScaleTileRows"]) == formats.SCALE_TILE_ROWS
    assert int(c["kScaleTileCols"]) == formats.SCALE_TILE_COLS
    assert int(c["kScaleTileBytes"]) == formats.SCALE_TILE_BYTES
    assert int(c["kOpsThreads"]) == ops._THREADS
    assert int(c["kMaxGroups"]) == ops._MAX_GROUPS
    from cuep import ep as ep_mod
    assert int(_cuh_constants("combine.cu")["kCombineRing"]) == ep_mod._COMBINE_RING
    assert eval(_cuh_constants("combine.cu")["kCombinePieceBytes"]) == ep_mod._COMBINE_PIECE_BYTES
    assert ep_mod._THREADS == int(_cuh_constants("combine.cu")["kCombineThreads"])
    silu = _cuh_constants("silu.cu")
    assert int(silu["kSiluStageBytes"]) == ops._SILU_STAGE_BYTES
    assert int(silu["kSiluStages"]) == ops._SILU_STAGES
    assert int(silu["kSiluThreads"]) == ops._SILU_THREADS
    assert int(_cuh_constants("quantize.cu")["kQuantizeThreads"]) == ops._QUANTIZE_THREADS


def test_silu_constants_match_reference():
    """formats/elements.cuh's silu_f32 constants (hex float literals) are the reference's float32 constants, bit for bit."""
    c = _cuh_constants("formats/elements.cuh")

    def f32(name):
        return np.float32(float.fromhex(c[name].rstrip("f")) if "0x" in c[name] else float(c[name].rstrip("f")))

    assert f32("kSiluXMin") == ref_ep.SILU_X_MIN
    pairs = [("kSiluLog2e", ref_ep.SILU_LOG2E), ("kSiluLn2Hi", ref_ep.SILU_LN2_HI), ("kSiluLn2Lo", ref_ep.SILU_LN2_LO),
             ("kSiluC6", ref_ep.SILU_POLY[0]), ("kSiluC5", ref_ep.SILU_POLY[1]), ("kSiluC4", ref_ep.SILU_POLY[2]),
             ("kSiluC3", ref_ep.SILU_POLY[3]), ("kSiluC2", ref_ep.SILU_POLY[4])]
    for name, want in pairs:
        assert f32(name).view(np.uint32) == np.float32(want).view(np.uint32), name
    assert f32("kSiluRint") == ref_ep.SILU_RINT == np.float32(1.5 * 2**23)


def test_bad_format_names_fail_before_the_gpu():
    x = np.zeros((2, 128), np.float32)
    with pytest.raises(ValueError, match="fmt"):
        ops.quantize(x, "fp9")
    with pytest.raises(ValueError, match="fmt"):
        ops.dequantize(x, x, "int4", 128)
    with pytest.raises(ValueError, match="fmt"):
        ops.swizzle_block_scales(x, x, "fp8", 128)
    with pytest.raises(ValueError, match="out_fmt"):
        ops.fused_silu(x, x, out_fmt="e5m2")


def test_numpy_inputs_are_refused_before_the_gpu():
    x = np.ones((2, 128), np.float32)
    with pytest.raises(TypeError, match="x must be a cupy.ndarray"):
        ops.quantize(x, "fp8")
    with pytest.raises(TypeError, match="payload"):
        ops.dequantize(np.zeros((2, 128), np.uint8), np.zeros((2, 4), np.uint8), "fp8", 128)
    with pytest.raises(TypeError, match="scales"):
        ops.swizzle_block_scales(np.zeros((2, 8), np.uint8), np.zeros(2, np.int32), "nvfp4", 128)
    with pytest.raises(TypeError, match="h must be a cupy.ndarray"):
        ops.fused_silu(x, np.array([0, 2], np.int32))


def test_bad_hidden_fails_before_the_gpu():
    with pytest.raises(ValueError, match="hidden"):
        ops.dequantize(np.zeros((2, 64), np.uint8), np.zeros((2, 4), np.uint8), "fp8", 64)
    with pytest.raises(ValueError, match="hidden"):
        ops.swizzle_block_scales(np.zeros((2, 8), np.uint8), np.zeros(2, np.int32), "mxfp4", 48)


# ---- quantize ------------------------------------------------------------------------------------------------
SHAPES = [(1, 128), (7, 384), (33, 7168), (5, 8192), (16384, 128), (1000, 1152), (3, 1040), (2, 96), (129, 160)]


def _fits(fmt: str, h: int) -> bool:
    return h % formats.FORMATS[fmt].group == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{h}" for n, h in SHAPES])
def test_quantize_matches_reference(rng, shape, fmt, dtype):
    n, h = shape
    if not _fits(fmt, h):
        pytest.skip(f"H={h} is not a multiple of {fmt}'s group")
    x = random_rows(rng, n, h, dtype)
    g = float(np.float32(rng.choice([1.0, 0.3716, 448.0 * 6 / 1e3]))) if fmt == "nvfp4" else 1.0
    want_p, want_s = ref.quantize(x, fmt, g)
    got_p, got_s = ops.quantize(to_dev(x), fmt, g)
    assert got_p.dtype == np.uint8 and got_s.dtype == np.uint8
    assert_same_bits(got_p.get(), want_p, f"{fmt} payload")
    assert_same_bits(got_s.get(), want_s, f"{fmt} scales")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantize_into_out(rng, fmt):
    x = random_rows(rng, 9, 256)
    f = formats.FORMATS[fmt]
    out = (poisoned((9, f.payload_bytes(256)), np.uint8), poisoned((9, f.scale_bytes(256)), np.uint8))
    got = ops.quantize(to_dev(x), fmt, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    want_p, want_s = ref.quantize(x, fmt)
    assert_same_bits(out[0].get(), want_p, "payload")
    assert_same_bits(out[1].get(), want_s, "scales")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantize_zero_rows(fmt):
    p, s = ops.quantize(cupy.zeros((0, 256), np.float32), fmt)
    f = formats.FORMATS[fmt]
    assert p.shape == (0, f.payload_bytes(256)) and s.shape == (0, f.scale_bytes(256))


def _e4m3_grid() -> np.ndarray:
    """All finite non-negative e4m3 values, ascending."""
    v = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.sort(v)


def _edge_rows(fmt: str) -> np.ndarray:
    """Rows of 256 float32 values hitting the rounding ties, thresholds, zeros, subnormals and maxima of `fmt`."""
    f32 = np.float32
    tiny = np.finfo(f32).tiny
    big = np.finfo(f32).max
    sub = np.array([1e-40, -1e-40, 1e-45, -1e-45, tiny / 2, -tiny / 2], f32)
    rows = []
    if fmt == "fp8":
        grid = _e4m3_grid()
        mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(f32)  # exact ties between e4m3 values
        # amax 448 -> s = 1, so x / s = x: the ties themselves; +- alternate.
        for lo in range(0, mids.size, 127):
            r = np.resize(mids[lo:lo + 127], 127) * np.where(np.arange(127) % 2, -1, 1).astype(f32)
            rows.append(np.concatenate([[f32(448.0)], r, [f32(-448.0)], np.resize(-r, 127)]))
        rows.append(np.concatenate([np.resize(sub, 128), [big], np.resize(np.array([big, -big, 0.0, -0.0], f32),
                                                                           127)]))
        rows.append(np.concatenate([np.resize(np.array([1e-5, -2e-5, 0.0, -0.0], f32), 128),     # amax < floor
                                    np.resize(np.array([1e-4, -0.0, tiny, -tiny], f32), 128)]))
    elif fmt in ("nvfp4", "mxfp4"):
        thr = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], f32)
        near = np.concatenate([thr, np.nextafter(thr, f32(0)), np.nextafter(thr, f32(10)),
                               np.array([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, 5.5, 5.9999995], f32)])
        vals = np.concatenate([near, -near, [-0.0, -1e-30]]).astype(f32)
        # Blocks of 16 whose amax is 6 (nvfp4 with g = 1: t = 1, r = 1; mxfp4: e = 0, scale 1): x * 1 = x.
        blocks = []
        for i in range(0, vals.size, 15):
            b = np.resize(vals[i:i + 15], 15)
            blocks.append(np.concatenate([[f32(6.0) if i % 2 == 0 else f32(-6.0)], b]))
        r = np.concatenate(blocks)
        rows.append(np.resize(r, 256))
        rows.append(np.resize(np.roll(r, 16), 256))
        rows.append(np.concatenate([np.resize(sub, 32), np.resize(np.array([big, -big, tiny], f32), 32),
                                    np.resize(np.array([-0.0, 0.0], f32), 32), np.resize(-sub, 32),
                                    np.resize(np.array([tiny, 2 * tiny, -tiny], f32), 32),
                                    np.resize(np.array([1e30, -3e38, 1.0], f32), 32),
                                    np.resize(np.array([2.0**-124, -2.0**-125, 2.0**-126], f32), 32),
                                    np.resize(np.array([448.0 * 6, 1e-3, -5e-4], f32), 32)]))
    else:  # bf16: float32 -> bf16 ties, the overflow edge, subnormals kept
        b = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0xFF7F8000,
                      0x00008000, 0x00018000, 0x807FFFFF, 0x00000001, 0x80000000, 0x00000000, 0x3F80C000,
                      0x3F804000, 0x00800000], np.uint32)
        rows.append(np.resize(b, 256).view(f32))
    return np.stack(rows).astype(f32)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantize_edge_values(fmt):
    x = _edge_rows(fmt)
    for g in ([1.0, 0.125, 3.0e4] if fmt == "nvfp4" else [1.0]):
        want_p, want_s = ref.quantize(x, fmt, g)
        got_p, got_s = ops.quantize(to_dev(x), fmt, g)
        assert_same_bits(got_p.get(), want_p, f"{fmt} g={g} payload")
        assert_same_bits(got_s.get(), want_s, f"{fmt} g={g} scales")
    if fmt != "bf16":  # the same values as bf16 input (those that overflow bf16 replaced by its max)
        xb = x.astype(BF16)
        xf = xb.astype(np.float32)
        xb[np.isinf(xf)] = (np.sign(xf[np.isinf(xf)]) * float(ml_dtypes.finfo(BF16).max)).astype(BF16)
        want_p, want_s = ref.quantize(xb, fmt)
        got_p, got_s = ops.quantize(to_dev(xb), fmt)
        assert_same_bits(got_p.get(), want_p, f"{fmt} bf16 payload")
        assert_same_bits(got_s.get(), want_s, f"{fmt} bf16 scales")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_quantize_mxfp4_every_block_exponent(rng, dtype):
    """mxfp4 at every finite block exponent (amax from 2**-126 to near the float32 max, and 0): the e2m1 lines
    scaled by 2**-e (E2m1Pow2; from bf16 on bf16 pairs, E2m1Bf16x2Pow2, where every block of the warp has
    e >= -100) and the multiply-first path (e = -127: rows with E <= -125) give the reference's codes at each
    rounding edge (the grid's midpoints times 2**e and their neighbours, in the input's precision), for values
    whose product is subnormal (code 0, sign kept) and for random values of the block's range."""
    f32 = np.float32
    thr = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    blocks = [np.zeros(32, f32)]
    for big_e in range(-126, 128):
        e = max(big_e - 2, -127)
        amax = f32(2.0 ** big_e * rng.uniform(1, 1.99))
        mid = (thr * 2.0 ** e).astype(f32)
        if dtype == BF16:  # the midpoints' bf16 neighbours
            below = ((mid.view(np.uint32) - (1 << 16)) & 0xFFFF0000).view(f32)
            above = ((mid.view(np.uint32) + (1 << 16)) & 0xFFFF0000).view(f32)
        else:
            below, above = np.nextafter(mid, f32(0)), np.nextafter(mid, f32(np.inf))
        b = np.concatenate([[amax], mid, below, above,
                            [2.0 ** -126, -3 * 2.0 ** -126],
                            2.0 ** (e + rng.uniform(-8, 2.99, 8))]).astype(f32)
        b *= np.where(rng.random(32) < 0.5, f32(-1), f32(1))
        if dtype == BF16:  # (values past bf16's largest would round to Inf)
            b = np.clip(b, -f32(ml_dtypes.finfo(BF16).max), f32(ml_dtypes.finfo(BF16).max))
        blocks.append(b)
    x = np.concatenate(blocks)
    # rows of 1024: every lane of a warp's 512-value step has values (a lane past the row counts as a zero block)
    x = np.concatenate([x, np.zeros(-x.size % 1024, f32)]).reshape(-1, 1024)
    x = np.concatenate([x, np.roll(x, 4 * 32)])  # the e = -127 blocks beside others in other warps too
    x = x.astype(dtype)
    assert np.isfinite(x.astype(f32)).all()
    want_p, want_s = ref.quantize(x, "mxfp4")
    got_p, got_s = ops.quantize(to_dev(x), "mxfp4")
    assert_same_bits(got_s.get(), want_s, "mxfp4 scales")
    assert_same_bits(got_p.get(), want_p, "mxfp4 payload")
    assert set(np.unique(want_s)) >= set(range(0, 253)), "every scale byte e + 127 in [0, 252] is tested"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantize_nonfinite_leaves_other_blocks_exact(rng, fmt, dtype):
    n, h = 24, 1024
    x = random_rows(rng, n, h, F32)
    bad = rng.random((n, h)) < 0.004
    x[bad] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), size=int(bad.sum()))
    x = x.astype(dtype)
    want_p, want_s = ref.quantize(x, fmt)
    got_p, got_s = ops.quantize(to_dev(x), fmt)
    got_p, got_s = got_p.get(), got_s.get()
    f = formats.FORMATS[fmt]
    if fmt == "bf16":  # no blocks: every finite value exact
        ok = np.isfinite(x.astype(np.float32))
        assert_same_bits(got_p.view(np.uint16)[ok], want_p.view(np.uint16)[ok], "bf16 finite values")
        return
    finite_block = np.isfinite(x.astype(np.float32)).reshape(n, h // f.block, f.block).all(axis=-1)
    assert (~finite_block).any() and finite_block.any()
    pb = f.payload_bytes(f.block)
    gp = got_p.reshape(n, -1, pb)[finite_block]
    wp = want_p.reshape(n, -1, pb)[finite_block]
    assert_same_bits(gp, wp, "payload of finite blocks")
    sb = f.scale_itemsize
    assert_same_bits(got_s.reshape(n, -1, sb)[finite_block], want_s.reshape(n, -1, sb)[finite_block],
                     "scales of finite blocks")


# ---- dequantize ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("shape", [(1, 128), (37, 7168), (4096, 256), (3, 8192), (5, 160)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequantize_matches_reference(rng, fmt, shape):
    n, h = shape
    if not _fits(fmt, h):
        pytest.skip(f"H={h} is not a multiple of {fmt}'s group")
    g = 0.8125 if fmt == "nvfp4" else 1.0
    p, s = ref.quantize(random_rows(rng, n, h), fmt, g)
    want = ref.dequantize(p, s, fmt, h, g)
    got = ops.dequantize(cupy.asarray(p), cupy.asarray(s), fmt, h, g)
    assert got.dtype == np.float32 and got.shape == (n, h)
    assert_same_bits(got.get(), want, f"{fmt} dequantize")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_dequantize_every_code_and_scale(rng, fmt):
    """Random payload bytes and scale bytes (every e8m0 byte, every e4m3 scale byte incl. NaN and subnormals)."""
    f = formats.FORMATS[fmt]
    n, h = 256, 512
    p = rng.integers(0, 256, size=(n, f.payload_bytes(h)), dtype=np.uint8)
    if fmt == "fp8":
        sf = (10.0 ** rng.uniform(-30, 30, size=(n, h // 128))).astype("<f4")
        sf[0, 0] = np.finfo(np.float32).tiny
        s = sf.view(np.uint8)
    else:
        s = rng.integers(0, 256, size=(n, f.n_scales(h)), dtype=np.uint8)
        s[: 256 // f.n_scales(h) + 1].reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    for g in ([1.0, 1e-3, 1e30] if fmt == "nvfp4" else [1.0]):
        want = ref.dequantize(p, s, fmt, h, g)
        got = ops.dequantize(cupy.asarray(p), cupy.asarray(s), fmt, h, g)
        assert_same_floats(got.get(), want, f"{fmt} g={g}")


@pytest.mark.gpu
def test_dequantize_bf16_widens(rng):
    x = random_rows(rng, 5, 64, BF16)
    p, s = ref.quantize(x, "bf16")
    got = ops.dequantize(cupy.asarray(p), cupy.asarray(s), "bf16", 64)
    assert_same_bits(got.get(), x.astype(np.float32))


# ---- swizzled block scales --------------------------------------------------------------------------------------
ROW_OFFSETS = [
    [0, 5],
    [0, 128],
    [0, 0, 129, 129, 300, 556, 557],
    [0, 1, 2, 3, 4, 200, 455],
    [0, 0, 0],
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,hidden", [("nvfp4", 7168), ("nvfp4", 144), ("mxfp4", 160), ("mxfp4", 8192),
                                        ("nvfp4", 16)])
@pytest.mark.parametrize("offsets", ROW_OFFSETS, ids=lambda o: f"G{len(o) - 1}-rows{o[-1]}")
@pytest.mark.parametrize("ro_dtype", [np.int32, np.uint32, np.int64])
def test_swizzle_block_scales_matches_reference(rng, fmt, hidden, offsets, ro_dtype):
    f = formats.FORMATS[fmt]
    ro = np.array(offsets, ro_dtype)
    rows_cap = int(ro[-1]) + 37
    scales = rng.integers(1, 256, size=(rows_cap, f.n_scales(hidden)), dtype=np.uint8)
    want_sw, want_off = ref.swizzle_block_scales(scales, ro, fmt, hidden)
    k_tiles, n_groups = f.scale_k_tiles(hidden), ro.size - 1
    size = (-(-rows_cap // 128) + n_groups) * k_tiles * 512
    out = (poisoned((size,), np.uint8), poisoned((n_groups,), np.uint32))
    got_sw, got_off = ops.swizzle_block_scales(cupy.asarray(scales), cupy.asarray(ro), fmt, hidden, out=out)
    assert got_sw is out[0] and got_off is out[1]
    got_sw = got_sw.get()
    assert_same_bits(got_sw[: want_sw.size], want_sw, "used tiles")
    assert (got_sw[want_sw.size:] == POISON).all(), "bytes past the used tiles were written"
    assert_same_bits(got_off.get(), want_off, "scales_offsets")


@pytest.mark.gpu
def test_swizzle_block_scales_default_output_shape():
    scales = cupy.ones((300, 448), np.uint8)
    sw, off = ops.swizzle_block_scales(scales, cupy.asarray(np.array([0, 100, 300], np.int32)), "nvfp4", 7168)
    assert sw.shape == ((3 + 2) * 112 * 512,) and sw.dtype == np.uint8
    assert off.shape == (2,) and off.dtype == np.uint32


# ---- fused SwiGLU --------------------------------------------------------------------------------------------
def _silu_input(rng, cap: int, inter: int, dtype, rows: int) -> np.ndarray:
    gate = (rng.standard_normal((cap, inter)) * 4).astype(np.float32)
    gate.reshape(-1)[:: 97] = rng.choice(np.array([0.0, -0.0, 1e-40, -1e-40, 20.0, -20.0, 88.0, -90.0, -104.0,
                                                   -750.0, 1e20, -1e20, 18.0, -95.0], np.float32),
                                         size=gate.reshape(-1)[::97].size)
    # |y| stays far below float32's max: an Inf y would make its scale block unspecified.
    up = (rng.standard_normal((cap, inter)) * 10.0 ** rng.uniform(-6, 6, size=(cap, 1))).astype(np.float32)
    up.reshape(-1)[:: 89] = np.float32(1e-40)
    h = np.concatenate([gate, up], axis=1).astype(dtype)
    h[rows:] = np.nan  # never read
    return h


def _interleave(h: np.ndarray) -> np.ndarray:
    inter = h.shape[1] // 2
    out = np.empty_like(h)
    out[:, 0::2] = h[:, :inter]
    out[:, 1::2] = h[:, inter:]
    return out


SILU_CASES = [  # (capacity, I, row_offsets)
    (300, 256, [0, 5, 5, 133, 260]),
    (40, 7168, [0, 37]),
    (200, 384, [0, 0, 128, 129]),
    (130, 160, [0, 3, 3, 3, 130]),
    (64, 144, [0, 64]),
    (16, 128, [0, 0]),
    # the most groups (their offsets fill 32 KiB of shared memory next to the kernel's static ring)
    (600, 256, [0] + sorted(np.random.default_rng(7).integers(0, 591, 4095).tolist()) + [591]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("out_fmt", ALL_FORMATS)
@pytest.mark.parametrize("case", SILU_CASES, ids=lambda c: f"cap{c[0]}-I{c[1]}-G{len(c[2]) - 1}")
def test_fused_silu_matches_reference(rng, case, out_fmt, dtype, interleaved):
    _check_fused_silu(rng, case, out_fmt, dtype, interleaved)


@pytest.mark.gpu
@pytest.mark.parametrize("out_fmt", ["fp8", "nvfp4", "mxfp4"])
def test_fused_silu_warp_shares_split_row_sets(rng, out_fmt):
    """Enough rows that each warp's share holds several (row set, span) items and starts and ends inside one: the
    members of a split set are computed, and their scales (fp4 padding zeros included) written, exactly once."""
    _check_fused_silu(rng, (3000, 2048, [0, 1000, 1000, 2900]), out_fmt, BF16, False)


def _check_fused_silu(rng, case, out_fmt, dtype, interleaved):
    cap, inter, offsets = case
    f = formats.FORMATS[out_fmt]
    if inter % f.group:
        pytest.skip(f"I={inter} is not a multiple of {out_fmt}'s group")
    ro = np.array(offsets, np.int32)
    rows, n_groups = int(ro[-1]), ro.size - 1
    h = _silu_input(rng, cap, inter, dtype, rows)
    if interleaved:
        h = _interleave(h)
    g = 0.5 if out_fmt == "nvfp4" else 1.0
    want = ref_ep.fused_silu(h, ro, out_fmt, interleaved, g)

    if out_fmt == "bf16":
        out = poisoned((cap, inter), BF16)
    elif out_fmt == "fp8":
        out = (poisoned((cap, inter), np.uint8), poisoned((inter // 128, cap), np.float32))
    else:
        size = (-(-cap // 128) + n_groups) * f.scale_k_tiles(inter) * 512
        out = (poisoned((cap, inter // 2), np.uint8), poisoned((size,), np.uint8),
               poisoned((n_groups,), np.uint32))
    got = ops.fused_silu(to_dev(h), cupy.asarray(ro), out_fmt, interleaved, g, out=out)

    if out_fmt == "bf16":
        assert got is out
        y = to_host(got)
        assert_same_bits(y[:rows], want, "bf16 rows")
        assert (bits(y[rows:]) == poison_bits(np.uint16)).all(), "rows past row_offsets[-1] were written"
        return
    payload = got[0].get()
    assert_same_bits(payload[:rows], want[0], "payload rows")
    assert (payload[rows:] == POISON).all(), "payload rows past row_offsets[-1] were written"
    scales = got[1].get()
    if out_fmt == "fp8":
        assert_same_bits(scales[:, :rows], want[1], "fp8 scales [I/128, rows]")
        assert (bits(scales[:, rows:]) == poison_bits(np.float32)).all(), "scales past the rows were written"
    else:
        assert_same_bits(scales[: want[1].size], want[1], "swizzled scales of the used tiles")
        assert (scales[want[1].size:] == POISON).all(), "bytes past the used tiles were written"
        assert_same_bits(got[2].get(), want[2], "scales_offsets")


@pytest.mark.gpu
@pytest.mark.parametrize("out_fmt", ALL_FORMATS)
def test_fused_silu_default_outputs(rng, out_fmt):
    cap, inter = 100, 256
    ro = np.array([0, 60, 90], np.int64)
    h = _silu_input(rng, cap, inter, BF16, 90)
    got = ops.fused_silu(to_dev(h), cupy.asarray(ro), out_fmt, False, 1.0)
    want = ref_ep.fused_silu(h, ro, out_fmt)
    if out_fmt == "bf16":
        assert got.shape == (cap, inter) and got.dtype == BF16
        assert_same_bits(to_host(got)[:90], want)
        return
    f = formats.FORMATS[out_fmt]
    assert got[0].shape == (cap, f.payload_bytes(inter)) and got[0].dtype == np.uint8
    assert_same_bits(got[0].get()[:90], want[0])
    if out_fmt == "fp8":
        assert got[1].shape == (inter // 128, cap) and got[1].dtype == np.float32
        assert_same_bits(got[1].get()[:, :90], want[1])
    else:
        assert got[1].shape == ((1 + 2) * f.scale_k_tiles(inter) * 512,)
        assert got[2].shape == (2,) and got[2].dtype == np.uint32
        assert_same_bits(got[1].get()[: want[1].size], want[1])


@pytest.mark.gpu
def test_fused_silu_reads_the_row_count_on_the_device(rng):
    """Same arrays, new row_offsets contents, no host involvement: the second call sees the new count."""
    cap, inter = 64, 256
    h = _silu_input(rng, cap, inter, F32, cap)
    ro = cupy.asarray(np.array([0, 10], np.int32))
    out = poisoned((cap, inter), BF16)
    ops.fused_silu(to_dev(h), ro, "bf16", out=out)
    ro[1] = 20
    ops.fused_silu(to_dev(h), ro, "bf16", out=out)
    y = to_host(out)
    assert_same_bits(y[:20], ref_ep.fused_silu(h, np.array([0, 20]), "bf16"))
    assert (bits(y[20:]) == poison_bits(np.uint16)).all()


# ---- argument checks on the GPU ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_short_paths_match_the_reference(rng, fmt, monkeypatch):
    """A signature's second call takes the op's short path (each full body raises if called): quantize,
    dequantize, swizzle_block_scales (fp4) and fused_silu on fresh inputs, outputs poisoned first, bit for bit."""
    n, h = 37, 7168
    f = formats.FORMATS[fmt]
    g = 0.6875 if fmt == "nvfp4" else 1.0
    case = (300, 256, [0, 5, 5, 133, 260])
    ro_np = np.array([0, 3, 3, 20, 37], np.int32)
    ro = cupy.asarray(ro_np)
    size = (-(-n // 128) + 4) * f.scale_k_tiles(h) * 512

    def run():
        x = random_rows(rng, n, h, BF16)
        want_p, want_s = ref.quantize(x, fmt, g)
        out = (poisoned((n, f.payload_bytes(h)), np.uint8), poisoned((n, f.scale_bytes(h)), np.uint8))
        assert ops.quantize(to_dev(x), fmt, g, out=out) == out
        assert_same_bits(out[0].get(), want_p, "quantize payload")
        assert_same_bits(out[1].get(), want_s, "quantize scales")
        back = poisoned((n, h), np.float32)
        assert ops.dequantize(*out, fmt, h, g, out=back) is back
        assert_same_bits(back.get(), ref.dequantize(want_p, want_s, fmt, h, g), "dequantize")
        if f.swizzled_scales:
            sw = (poisoned((size,), np.uint8), poisoned((4,), np.uint32))
            assert ops.swizzle_block_scales(out[1], ro, fmt, h, out=sw) == sw
            want_sw, want_off = ref.swizzle_block_scales(want_s, ro_np, fmt, h)
            got_sw = sw[0].get()
            assert_same_bits(got_sw[: want_sw.size], want_sw, "swizzled tiles")
            assert (got_sw[want_sw.size:] == POISON).all(), "bytes past the used tiles were written"
            assert_same_bits(sw[1].get(), want_off, "scales_offsets")
        _check_fused_silu(rng, case, fmt, BF16, False)

    run()  # the full paths, which make the plans

    def full(*a, **k):
        raise AssertionError("the full path ran")

    for name in ("_quantize", "_dequantize_general", "_swizzle_general", "_fused_silu"):
        monkeypatch.setattr(ops, name, full)
    run()


@pytest.mark.gpu
def test_quantize_bad_arguments():
    x = cupy.ones((4, 256), np.float32)
    with pytest.raises(TypeError, match="x must have dtype"):
        ops.quantize(x.astype(np.float16), "fp8")
    with pytest.raises(ValueError, match="x must be 2-D"):
        ops.quantize(x.reshape(-1), "fp8")
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.quantize(cupy.ones((4, 512), np.float32)[:, ::2], "fp8")
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.quantize(cupy.ones((256, 4), np.float32).T, "bf16")
    with pytest.raises(ValueError, match=r"x.shape\[1\]"):
        ops.quantize(cupy.ones((4, 200), np.float32), "fp8")
    with pytest.raises(ValueError, match=r"x.shape\[1\]"):
        ops.quantize(cupy.ones((4, 48), np.float32), "mxfp4")
    for g in (0.0, -1.0, float("nan"), float("inf"), True, "x", 1e-45, 2.0**-101, 2.0**101):
        with pytest.raises(ValueError, match="global_scale"):
            ops.quantize(x, "nvfp4", g)
    with pytest.raises(ValueError, match="payload"):
        ops.quantize(x, "fp8", out=(cupy.empty((4, 255), np.uint8), cupy.empty((4, 8), np.uint8)))
    with pytest.raises(TypeError, match="scales"):
        ops.quantize(x, "fp8", out=(cupy.empty((4, 256), np.uint8), cupy.empty((4, 2), np.float32)))
    with pytest.raises(TypeError, match="out"):
        ops.quantize(x, "fp8", out=cupy.empty((4, 256), np.uint8))


@pytest.mark.gpu
def test_dequantize_bad_arguments():
    p, s = cupy.zeros((4, 256), np.uint8), cupy.zeros((4, 8), np.uint8)
    with pytest.raises(ValueError, match="payload"):
        ops.dequantize(p[:, :128], s, "fp8", 256)
    with pytest.raises(ValueError, match="scales"):
        ops.dequantize(p, s[:3], "fp8", 256)
    with pytest.raises(TypeError, match="scales"):
        ops.dequantize(p, s.view(np.int8), "fp8", 256)
    with pytest.raises(ValueError, match="hidden"):
        ops.dequantize(p, s, "fp8", 100)
    with pytest.raises(ValueError, match="out"):
        ops.dequantize(p, s, "fp8", 256, out=cupy.empty((4, 128), np.float32))


@pytest.mark.gpu
def test_fused_silu_bad_arguments():
    h = cupy.ones((8, 512), np.float32)
    ro = cupy.asarray(np.array([0, 8], np.int32))
    with pytest.raises(ValueError, match="even width"):
        ops.fused_silu(cupy.ones((8, 257), np.float32), ro)
    with pytest.raises(ValueError, match="under 2 GiB"):
        ops.fused_silu(cupy.empty((0, 2**29), np.float32), ro)
    with pytest.raises(ValueError, match=r"\(I\)"):
        ops.fused_silu(cupy.ones((8, 2 * 192), np.float32), ro, "fp8")
    with pytest.raises(TypeError, match="h must have dtype"):
        ops.fused_silu(h.astype(np.float64), ro)
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.fused_silu(cupy.ones((8, 1024), np.float32)[:, ::2], ro)
    with pytest.raises(TypeError, match="row_offsets"):
        ops.fused_silu(h, ro.astype(np.float32))
    with pytest.raises(ValueError, match="row_offsets"):
        ops.fused_silu(h, ro[:1])
    with pytest.raises(ValueError, match="row_offsets"):
        ops.fused_silu(h, cupy.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="row_offsets"):
        ops.fused_silu(h, cupy.zeros(ops._MAX_GROUPS + 2, np.int32), "nvfp4")
    with pytest.raises(ValueError, match="global_scale"):
        ops.fused_silu(h, ro, "nvfp4", global_scale=0.0)
    with pytest.raises(ValueError, match="out"):
        ops.fused_silu(h, ro, "bf16", out=cupy.empty((4, 256), BF16))
    with pytest.raises(TypeError, match="out"):
        ops.fused_silu(h, ro, "fp8", out=cupy.empty((8, 256), np.uint8))
    with pytest.raises(ValueError, match="scales"):
        ops.fused_silu(h, ro, "fp8", out=(cupy.empty((8, 256), np.uint8), cupy.empty((8, 2), np.float32)))


@pytest.mark.gpu
def test_swizzle_block_scales_bad_arguments():
    s = cupy.zeros((10, 8), np.uint8)
    ro = cupy.asarray(np.array([0, 10], np.int32))
    with pytest.raises(ValueError, match="fmt"):
        ops.swizzle_block_scales(s, ro, "bf16", 128)
    with pytest.raises(ValueError, match="scales"):
        ops.swizzle_block_scales(s, ro, "nvfp4", 256)
    with pytest.raises(TypeError, match="row_offsets"):
        ops.swizzle_block_scales(s, ro.astype(np.int16), "nvfp4", 128)


@pytest.mark.multigpu
def test_arrays_on_another_device_are_refused():
    with cupy.cuda.Device(1):
        x = cupy.ones((4, 256), np.float32)
    with cupy.cuda.Device(0):
        with pytest.raises(ValueError, match="device"):
            ops.quantize(x, "fp8")


# ---- device helpers (common.cuh, formats.cuh) -----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("nthreads", [32, 96, 256, 1024])
@pytest.mark.parametrize("units", [1, 3, 31, 1001, 4099])
@pytest.mark.parametrize("offset", [0, 16, 48])
def test_block_copy16(rng, nthreads, units, offset):
    n = 16 * units
    src_buf = cupy.asarray(rng.integers(0, 256, size=n + 64, dtype=np.uint8))
    dst_buf = poisoned((n + 96,), np.uint8)
    ops._selftest_block_copy16(dst_buf[offset + 32: offset + 32 + n], src_buf[offset: offset + n], nthreads)
    d, s = dst_buf.get(), src_buf.get()
    assert_same_bits(d[offset + 32: offset + 32 + n], s[offset: offset + n])
    assert (d[: offset + 32] == POISON).all() and (d[offset + 32 + n:] == POISON).all()


@pytest.mark.gpu
@pytest.mark.parametrize("warp", [0, 3])
@pytest.mark.parametrize("units", [1, 33, 517])
def test_warp_copy16(rng, warp, units):
    n = 16 * units
    src = cupy.asarray(rng.integers(0, 256, size=n, dtype=np.uint8))
    dst = poisoned((n,), np.uint8)
    ops._selftest_warp_copy16(dst, src, warp, 128)
    assert_same_bits(dst.get(), src.get())


@pytest.mark.gpu
@pytest.mark.parametrize("nthreads", [32, 64, 96, 224, 512, 992, 1024])
def test_block_inclusive_scan(rng, nthreads):
    v = rng.integers(-1000, 1000, size=nthreads, dtype=np.int32)
    scans, totals = ops._selftest_block_scan(cupy.asarray(v))
    scans, totals = scans.get(), totals.get()
    assert_same_bits(scans[0], np.cumsum(v).astype(np.int32))
    assert_same_bits(scans[1], np.cumsum(2 * v + 1).astype(np.int32))
    assert (totals[:, 0] == v.sum()).all() and (totals[:, 1] == (2 * v + 1).sum()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("last", [True, False])
def test_signal_completion_then_wait(last):
    value, matched, _ = ops._selftest_signal_wait(n_payload=64, count=123456789, last=last, timeout_ns=2 * 10**9)
    assert value == 123456789
    if last:  # a release store orders the payload before the count
        assert matched == 64


@pytest.mark.gpu
def test_wait_not_empty_times_out():
    value, ns = ops._selftest_wait_timeout(timeout_ns=200_000)
    assert value == 2**64 - 1
    assert 200_000 <= ns < 10**9


@pytest.mark.gpu
def test_align_up_and_ceil_div(rng):
    n = rng.integers(0, 2**40, size=1000, dtype=np.int64)
    n[:5] = [0, 1, 15, 16, 17]
    a = rng.choice(np.array([1, 7, 16, 128, 256, 4096], np.int64), size=1000)
    up, cd = ops._selftest_align_up(cupy.asarray(n), cupy.asarray(a))
    assert_same_bits(up.get(), (n + a - 1) // a * a)
    assert_same_bits(cd.get(), (n + a - 1) // a)


@pytest.mark.gpu
def test_element_encoders(rng):
    b = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    v = np.concatenate([b.view(np.float32), _edge_rows("fp8").ravel(), _edge_rows("nvfp4").ravel(),
                        _edge_rows("bf16").ravel(), np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0,
                                                              448.0, 464.0, 1e9, -0.0], np.float32)])
    v = v.astype(np.float32)
    e4m3, e2m1, bf16, flushed = (a.get() for a in ops._selftest_encode(cupy.asarray(v)))
    with np.errstate(all="ignore"):
        assert_same_bits(bf16, v.astype(BF16).view(np.uint16), "bf16")
        num = ~np.isnan(v)  # e4m3 of NaN is a NaN code either way; +-Inf saturates to +-448
        assert_same_bits(e4m3[num], ref.e4m3_encode(v)[num], "e4m3")
        assert_same_bits(e2m1, ref.e2m1_encode(v), "e2m1")
        assert_same_bits(flushed, ref.ftz(v), "ftz")


# ---- formats.cuh's arithmetic primitives, called directly (float32 results, bit for bit) ------------------------
_PRIMITIVES_SRC = r"""
#include "formats.cuh"
extern "C" __global__ void t_silu(const float* g, float* out, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = cuep::silu_f32(g[i]);
}
extern "C" __global__ void t_e2m1x8(const float* v, unsigned* out, long long n) {  // n words, 8 values each
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) {
        float w[8];
        for (int k = 0; k < 8; ++k) w[k] = v[8 * i + k];
        out[i] = cuep::e2m1x8_encode(w);
    }
}
extern "C" __global__ void t_e2m1x8_bf16(const uint4* w, const int* e, unsigned* out, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = cuep::e2m1x8_pack_bf16(w[i], cuep::E2m1Bf16x2Pow2(e[i]));
}
extern "C" __global__ void t_fp8div(const float* x, const float* s, float* out, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = cuep::div_rn_by(x[i], s[i], __frcp_rn(s[i]));
}
"""


@pytest.fixture(scope="module")
def primitives():
    mod = cupy.RawModule(code=_PRIMITIVES_SRC, options=_kernels.compile_options())
    return {k: mod.get_function(k) for k in ("t_silu", "t_e2m1x8", "t_e2m1x8_bf16", "t_fp8div")}


def _launch1d(kernel, n, *args):
    kernel(((n + 255) // 256,), (256,), (*args, np.int64(n)))


@pytest.mark.gpu
def test_silu_f32_device_matches_reference(rng, primitives):
    """cuep::silu_f32 against cuep.reference.ep.silu_f32 on 2**20 random bit patterns, 2**21 values in [-100, 100]
    and [-1, 1], and the special points."""
    special = np.array([0.0, -0.0, 87.0, -87.0, 88.0, -88.0, 88.37626, -88.37626, 88.37627, -88.37627, 88.5, -88.5,
                        89.0, -89.0, 1e-30, -1e-30, 1e-40, -1e-40, 3e38, -3e38, np.inf, -np.inf, np.nan], np.float32)
    g = np.concatenate([rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        rng.uniform(-100, 100, 1 << 20).astype(np.float32),
                        rng.uniform(-1, 1, 1 << 20).astype(np.float32), special])
    out = cupy.empty(g.size, np.float32)
    _launch1d(primitives["t_silu"], g.size, cupy.asarray(g), out)
    assert_same_floats(out.get(), ref_ep.silu_f32(g), "silu_f32")


@pytest.mark.gpu
def test_e2m1x8_device_matches_reference(rng, primitives):
    """cuep::e2m1x8_encode (the quantizers' packed e2m1) on 2**22 random bit patterns and 2**22 values in the e2m1
    range, NaN/Inf/-0/subnormals included, against the reference codes packed low nibble first."""
    v = np.concatenate([rng.integers(0, 2**32, 1 << 22, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        rng.uniform(-7, 7, 1 << 22).astype(np.float32)])
    edges = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1e-40, 0.0], np.float32)
    v[: 8 * edges.size] = np.repeat(np.concatenate([edges, -edges]), 4)[: 8 * edges.size]
    out = cupy.empty(v.size // 8, np.uint32)
    _launch1d(primitives["t_e2m1x8"], v.size // 8, cupy.asarray(v), out)
    codes = ref.e2m1_encode(v).astype(np.uint32).reshape(-1, 8)
    want = np.bitwise_or.reduce(codes << (4 * np.arange(8, dtype=np.uint32)), axis=1)
    assert_same_bits(out.get(), want, "e2m1x8")


@pytest.mark.gpu
def test_e2m1x8_bf16_pairs_every_bf16_at_every_exponent(primitives):
    """cuep::e2m1x8_pack_bf16 (mxfp4 from bf16: the lines on bf16 pairs) on every bf16 bit pattern at every e in
    [kE2m1Bf16MinE, 125]: the reference's codes of ftz(ftz(x) * 2**-e), packed low nibble first (NaN and Inf
    included: the float32 lines' code 7 with x's sign, as the reference)."""
    e_min = -100  # kE2m1Bf16MinE
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint32).reshape(-1, 4)  # 8 bf16 a row
    es = np.arange(e_min, 126, dtype=np.int32)
    w = np.tile(words, (es.size, 1))
    e = np.repeat(es, words.shape[0])
    out = cupy.empty(w.shape[0], np.uint32)
    _launch1d(primitives["t_e2m1x8_bf16"], w.shape[0], cupy.asarray(w), cupy.asarray(e), out)
    x = (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(np.float32)
    pow2 = np.ldexp(np.float32(1), -es).astype(np.float32)[:, None]
    with np.errstate(all="ignore"):
        codes = ref.e2m1_encode(ref.ftz(ref.ftz(x)[None, :] * pow2))
    codes = codes.astype(np.uint32).reshape(-1, 8)
    want = np.bitwise_or.reduce(codes << (4 * np.arange(8, dtype=np.uint32)), axis=1)
    assert_same_bits(out.get(), want, "e2m1x8 from bf16 pairs")


@pytest.mark.gpu
def test_fp8_division_device_is_the_ieee_quotient(rng, primitives):
    """cuep::div_rn_by (RN(1/s), two FMA corrections) against NumPy's float32 x / s on 2**22 pairs: random, near
    rounding midpoints, few-bit quotients, over the fp8 quantizer's range of s (2.2e-7 .. 7.6e35)."""
    s = np.exp(rng.uniform(np.log(2.3e-7), np.log(7.5e35), 1 << 14)).astype(np.float32)
    s64 = s[:, None].astype(np.float64)
    q = rng.integers(0x3B000000, 0x43E00000, (s.size, 96), dtype=np.uint32).view(np.float32)  # 2**-9 .. 448
    mid = q.astype(np.float64) + np.spacing(q).astype(np.float64) / 2                        # rounding midpoints
    near = (s64 * mid).astype(np.float32)
    near = (near.view(np.int32) + rng.integers(-3, 4, near.shape, dtype=np.int32)).view(np.float32)
    x = np.concatenate([(s64 * rng.uniform(-448, 448, (s.size, 96))).astype(np.float32),      # |x / s| <= 448
                        (s64 * (rng.integers(-3584, 3585, (s.size, 64)) / 8.0)).astype(np.float32),  # few bits
                        near * np.where(rng.random(near.shape) < 0.5, -1, 1).astype(np.float32)], axis=1)
    x[:, 0], x[:, 1] = 0.0, -0.0
    ss = np.broadcast_to(s[:, None], x.shape).astype(np.float32)
    out = cupy.empty(x.size, np.float32)
    _launch1d(primitives["t_fp8div"], x.size, cupy.asarray(x.ravel()), cupy.asarray(ss.ravel()), out)
    with np.errstate(all="ignore"):
        want = ref.ftz(x.ravel() / ss.ravel())
    assert_same_bits(out.get(), want, "x / s")


@pytest.mark.gpu
def test_element_decoders():
    e4m3, e2m1 = (a.get() for a in ops._selftest_decode())
    codes = np.arange(256, dtype=np.uint8)
    assert_same_floats(e4m3, ref.e4m3_decode(codes), "e4m3")
    assert_same_bits(e2m1, ref.e2m1_decode(codes & 15), "e2m1")


@pytest.mark.gpu
def test_swizzled_offset_matches_python(rng):
    k_tiles = 7
    rows = rng.integers(0, 5000, size=4000, dtype=np.int64)
    cols = rng.integers(0, 4 * k_tiles, size=4000, dtype=np.int32)
    got = ops._selftest_swizzled_offset(cupy.asarray(rows), cupy.asarray(cols), k_tiles).get()
    want = np.array([formats.swizzled_scale_offset(int(r), int(c), k_tiles) for r, c in zip(rows, cols)])
    assert_same_bits(got, want.astype(np.int64))


@pytest.mark.gpu
def test_device_constants_match_python():
    c = ops._selftest_constants()
    assert c["FP8_BLOCK"] == formats.FP8_BLOCK and c["FP8_MAX"] == formats.FP8_MAX
    assert np.float32(c["FP8_AMAX_FLOOR"]) == np.float32(formats.FP8_AMAX_FLOOR)
    assert c["NVFP4_BLOCK"] == formats.NVFP4_BLOCK and c["MXFP4_BLOCK"] == formats.MXFP4_BLOCK
    assert c["E2M1_MAX"] == formats.E2M1_MAX
    assert (c["SCALE_TILE_ROWS"], c["SCALE_TILE_COLS"], c["SCALE_TILE_BYTES"]) == (
        formats.SCALE_TILE_ROWS, formats.SCALE_TILE_COLS, formats.SCALE_TILE_BYTES)
    assert c["ALIGN"] == formats.ALIGN and c["OPS_THREADS"] == ops._THREADS


@pytest.mark.gpu
def test_rcp_rn_normal_is_correctly_rounded_for_every_d_in_1_2():
    """The reciprocal inside silu (hardware estimate + one Newton step) is RN(1 / d) for all 2**23 + 1 float32
    d in [1, 2] (the only range silu gives it), checked against NumPy."""
    d = (1.0 + np.arange(2**23 + 1, dtype=np.float64) * 2.0**-23).astype(np.float32)
    _, rcp = ops._selftest_silu(cupy.asarray(d))
    assert_same_bits(rcp.get(), np.float32(1.0) / d, "rcp")


def _f32_bits(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("mode, lo, hi", [
    (0, 0, _f32_bits(np.inf)),                           # fp8 s = max(x, 1e-4) / 448: every finite x >= 0
    (1, 0, _f32_bits(np.inf)),                           # nvfp4 sf = cvt_e4m3(x / 6): every finite x >= 0
    (2, _f32_bits(2.0**-23), _f32_bits(2.0**120)),       # RN(1 / s) for every fp8 scale s
], ids=["fp8-scale", "nvfp4-scale", "fp8-reciprocal"])
def test_quantizer_scale_arithmetic_equals_ieee_division(mode, lo, hi):
    """The quantizers' block scales are computed without a division instruction; exhaustively, they equal the IEEE
    (flushed) division of the contract."""
    bad, at = ops._selftest_scale_divisions(mode, lo, hi - lo)
    assert bad == 0, f"{bad} mismatches; first at bits {lo + at:#x}"


@pytest.mark.gpu
def test_nvfp4_global_scale_over_block_scale_equals_ieee_division(rng):
    """r = g / sfv for every nonzero e4m3 block scale and 2**24 global scales g spread over the allowed
    [2**-100, 2**100] (and its ends)."""
    lo, hi = _f32_bits(formats.GLOBAL_SCALE_MIN), _f32_bits(formats.GLOBAL_SCALE_MAX)
    g = np.concatenate([[lo, hi, _f32_bits(1.0)], rng.integers(lo, hi + 1, 2**24 - 3)]).astype(np.uint32)
    bad, at = ops._selftest_scale_divisions(3, 0, g.size * 126, cupy.asarray(g.view(np.float32)))
    assert bad == 0, f"{bad} mismatches; first at g={g.view(np.float32)[at // 126]!r}, e4m3 code {1 + at % 126}"


@pytest.mark.gpu
def test_silu_f32_kernel_is_the_reference(rng):
    """formats.cuh silu_f32 against cuep.reference.ep.silu_f32, bit for bit, on random, dense-tail and edge gates
    (NaN gates give NaN on both sides)."""
    specials = np.array([0.0, -0.0, 1.0, -1.0, 87.0, -87.0, -87.2, -87.34, -87.5, -88.0, -88.5, 89.0, -89.0, 1e-30,
                         -1e-30, 1e-40, -1e-40, 2.0**-126, -(2.0**-126), 1e20, -1e20, 3e38, -3e38, np.inf, -np.inf,
                         np.nan], np.float32)
    g = np.concatenate([specials, rng.uniform(-100, 100, 1_000_000), rng.standard_normal(1_000_000) * 4,
                        np.linspace(-88.5, -86.5, 200_001), rng.uniform(-1e-3, 1e-3, 100_000)]).astype(np.float32)
    silu, _ = ops._selftest_silu(cupy.asarray(g))
    got = silu.get()
    with np.errstate(all="ignore"):
        want = ref_ep.silu_f32(g)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert_same_bits(got[~nan], want[~nan], "silu")
