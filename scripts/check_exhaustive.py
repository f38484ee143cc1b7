"""Exhaustive CPU checks of the bit tricks the CUDA quantizers use instead of the contract's plain operations.

    python scripts/check_exhaustive.py e2m1             # all 2**32 float32 bit patterns (about 2 minutes)
    python scripts/check_exhaustive.py fp8div [--per-s 256] [--s-step 1]   # 2**23 / s_step divisors x per_s pairs
    python scripts/check_exhaustive.py silu             # every g with |g| in [85, 89], 2**24 random patterns
    python scripts/check_exhaustive.py e2m1pow2         # mxfp4's fused lines: every e, 2**20 values each
    python scripts/check_exhaustive.py e2m1bf16         # mxfp4 from bf16 on bf16 pairs: every x, every e

* ``e2m1``: ``e2m1_device`` below is a NumPy emulation, operation for operation, of ``e2m1_biased`` /
  ``e2m1_encode`` in cuep/cuda_src/formats.cuh (fminf of FTZ operands, three lines rounded once each to an
  integer by adding 1.5 * 2**23, their minimum). It must equal :func:`cuep.reference.quant.e2m1_encode` on every
  float32 bit pattern: NaN, Inf, subnormals and -0 included.
* ``fp8div``: ``div_rn_by`` below emulates, exactly, the kernel's ``div_rn_by(x, s, y)`` (y = RN(1/s); q0 = RN(x y);
  two FMA corrections; the sign of x copied onto the result), used for the fp8 quantizer's ``x / s``. Its result
  depends only on the significands of x and s (nothing underflows or overflows for |x / s| >= 2**-11 and the s of
  the fp8 quantizer, s in [2.2e-7, 7.6e35]), so x and s are taken in [1, 2): for every divisor significand (all
  2**23 with --s-step 1) it checks --per-s dividends: random ones, ones whose quotient lies within a few ulps of a
  rounding midpoint (the hard cases of division), and exact quotients. It must equal the IEEE quotient RN(x / s).
  The argument that two corrections suffice (the first gives a faithful quotient; then Markstein's theorem) is in
  formats.cuh; this checks the algebra and the emulation.

* ``silu``: ``silu_device`` below emulates formats.cuh ``silu_f32`` as the kernel computes it (ax = min(|g|, 88)
  read negated by the FMAs; e = p * 2**n as an integer add to p's exponent field, a subnormal e read as +0 by its
  flushing consumers). It must equal :func:`cuep.reference.ep.silu_f32` bit for bit: on every float32 g with
  |g| in [85, 89] (where n <= -122 and the add's result can be subnormal or wrap) and on random bit patterns.

* ``e2m1pow2``: ``e2m1_pow2_device`` emulates formats.cuh ``E2m1Pow2`` (mxfp4: the block's 2**-e folded into the
  three lines' FMAs, |x| clamped at 6 * 2**e). It must give the reference's code of ftz(x * 2**-e) for every
  e in [-126, 125] (e = -127 multiplies first in the kernel): the grid's rounding edges times 2**e and random x.

* ``e2m1bf16``: ``e2m1_bf16_device`` emulates formats/elements.cuh ``E2m1Bf16x2Pow2`` (mxfp4 from bf16: the same
  lines on bf16 pairs, rounded to bf16, no flushing), for every bf16 x at every e in [-100, 125] (the kernels
  take the float32 lines for a warp holding a smaller e).

tests/test_reference_quant.py imports this file and runs both on samples (1e6 values and the special points).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuep.reference import e2m1_encode, ftz  # noqa: E402

F32 = np.float32
F64 = np.float64
U32 = np.uint32


# ---- e2m1 ------------------------------------------------------------------------------------------------------
E2M1_BIAS = U32(0x4B400000)  # kE2m1Bias of formats.cuh: bits(M), M = 1.5 * 2**23


def e2m1_biased(v: np.ndarray) -> np.ndarray:
    """formats.cuh ``e2m1_biased``: code + E2M1_BIAS (uint32, modulo 2**32), magnitude only."""
    M = F32(1.5 * 2.0**23)
    with np.errstate(all="ignore"):
        a = np.fmin(ftz(np.abs(v)), F32(6.0))         # FMNMX.FTZ |v|, 6: NaN -> 6, subnormal -> 0
        t1 = a * F32(2.0) + M                          # fma(a, 2, M): 2a is exact, one rounding
        t2 = a + (M + F32(2.0))
        t3 = a * F32(0.5) + (M + F32(4.0))             # fma(a, 0.5, M + 4): a / 2 is exact, one rounding
        t = np.minimum(np.minimum(t1, t2), t3)
    return t.view(U32)


def e2m1_device(v: np.ndarray) -> np.ndarray:
    """formats.cuh ``e2m1_encode``: float32 -> e2m1 codes (uint8)."""
    v = np.ascontiguousarray(v, dtype=F32)
    return ((e2m1_biased(v) - E2M1_BIAS) | ((v.view(U32) >> U32(28)) & U32(8))).astype(np.uint8)


def e2m1x8_device(v: np.ndarray) -> np.ndarray:
    """formats.cuh ``e2m1x8_encode``: float32 [..., 8] -> one uint32 word per 8 values (value i in nibble i)."""
    v = np.ascontiguousarray(v, dtype=F32)
    mag = np.full(v.shape[:-1], (-int(E2M1_BIAS) * 0x11111111) % (1 << 32), U32)
    sign = v[..., 7].view(U32) >> U32(28)
    with np.errstate(over="ignore"):
        for i in range(8):
            mag = mag + (e2m1_biased(v[..., i]) << U32(4 * i))
    for i in range(6, -1, -1):  # __funnelshift_l(bits(v_i), sign, 4) = (sign << 4) | (bits(v_i) >> 28)
        sign = (sign << U32(4)) | (v[..., i].view(U32) >> U32(28))
    return mag | (sign & U32(0x88888888))


def check_e2m1(values: np.ndarray) -> int:
    """Mismatches between e2m1_device and the reference on `values` (float32); prints the first few."""
    got, want = e2m1_device(values), e2m1_encode(values)
    bad = np.flatnonzero(got != want)
    for i in bad[:5]:
        print(f"  e2m1 mismatch: bits {values.view(U32)[i]:#010x} ({values[i]!r}): device {got[i]}, "
              f"reference {want[i]}")
    return int(bad.size)


def run_e2m1(chunk_log2: int = 24) -> int:
    step = 1 << chunk_log2
    bad = 0
    t0 = time.time()
    for start in range(0, 1 << 32, step):
        bits = np.arange(start, start + step, dtype=np.uint64).astype(U32)
        bad += check_e2m1(bits.view(F32))
    print(f"e2m1: {bad} mismatches over all 2**32 float32 bit patterns ({time.time() - t0:.0f} s)")
    return bad


# ---- fp8 division ----------------------------------------------------------------------------------------------
def _rn32_sum(c: np.ndarray, p: np.ndarray) -> np.ndarray:
    """RN32(c + p) for float64 arrays holding exact values (c a float32 value, p any float64): the sum is split
    exactly into hi + lo (TwoSum), hi rounded to float32, except that a hi exactly halfway between two float32
    values goes the way lo points (the only case where rounding twice could differ)."""
    hi = c + p
    bb = hi - c
    lo = (c - (hi - bb)) + (p - bb)
    r = hi.astype(F32)
    mid = (hi.view(np.uint64) & np.uint64((1 << 29) - 1)) == np.uint64(1 << 28)
    fix = mid & (lo != 0)
    if fix.any():
        h, l = hi[fix], lo[fix]
        half = np.spacing(np.abs(h).astype(F32)).astype(F64) / 2
        a, b = (h - half).astype(F32), (h + half).astype(F32)   # the two float32 neighbours (exact)
        r[fix] = np.where(l > 0, np.maximum(a, b), np.minimum(a, b))
    return r


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """RN32(a * b + c) for float32 arrays, one rounding (fma.rn.f32; the product is exact in float64)."""
    return _rn32_sum(c.astype(F64), a.astype(F64) * b.astype(F64))


def div_rn_by(x: np.ndarray, s: np.ndarray, y: np.ndarray) -> np.ndarray:
    """formats.cuh ``div_rn_by``: x / s from y = RN(1/s), two Markstein corrections, sign of x copied (no FTZ
    here: callers keep every intermediate normal)."""
    q0 = (x.astype(F64) * y.astype(F64)).astype(F32)
    q1 = fma32(fma32(-s, q0, x), y, q0)
    q2 = fma32(fma32(-s, q1, x), y, q1)
    return (q2.view(U32) | (x.view(U32) & U32(0x80000000))).view(F32)


def rn_div(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """RN32(x / s): the float64 quotient of two float32 values is never within 2**-53 (relative) of a float32
    rounding midpoint unless it is one, so rounding it to float32 rounds the exact quotient."""
    return (x.astype(F64) / s.astype(F64)).astype(F32)


def rn_recip(s: np.ndarray) -> np.ndarray:
    return (1.0 / s.astype(F64)).astype(F32)


def fp8div_dividends(rng: np.random.Generator, s: np.ndarray, per_s: int) -> np.ndarray:
    """[len(s), per_s] dividends in [1, 2) for the divisors s: a third random, a third with x / s within a few
    ulps of a float32 rounding midpoint, a third with x / s (nearly) a float32 value with few significant bits."""
    n = s.size
    k1, k2 = per_s // 3, per_s // 3
    k3 = per_s - k1 - k2
    x1 = rng.integers(0x3F800000, 0x40000000, (n, k1), dtype=np.uint32).view(F32)
    q = rng.integers(0x3F000000, 0x40000000, (n, k2), dtype=np.uint32).view(F32)       # quotients in [0.5, 2)
    m = q.astype(F64) + np.spacing(q).astype(F64) / 2                                  # midpoints
    x2 = (s[:, None].astype(F64) * m).astype(F32)
    x2 = (x2.view(np.int32) + rng.integers(-3, 4, (n, k2), dtype=np.int32)).view(F32)
    qs = (rng.integers(1, 1 << 6, (n, k3)).astype(F64) / 32.0).astype(F32)            # few-bit quotients
    x3 = (s[:, None].astype(F64) * qs).astype(F32)
    x3 = (x3.view(np.int32) + rng.integers(-1, 2, (n, k3), dtype=np.int32)).view(F32)
    x = np.concatenate([x1, x2, x3], axis=1)
    # fold into [1, 2) by powers of two (exact): only the significand matters
    e = (x.view(np.uint32) >> np.uint32(23)).astype(np.int64) - 127
    return (x.view(np.uint32) - (e.astype(np.uint32) << np.uint32(23))).view(F32)


def check_fp8div(x: np.ndarray, s: np.ndarray) -> int:
    """Mismatches of div_rn_by against RN(x / s) for broadcastable float32 x, s (s > 0 normal)."""
    x, s = np.broadcast_arrays(np.asarray(x, F32), np.asarray(s, F32))
    x, s = np.ascontiguousarray(x), np.ascontiguousarray(s)
    got, want = div_rn_by(x, s, rn_recip(s)), rn_div(x, s)
    bad = np.flatnonzero(got.view(U32) != want.view(U32))
    for i in bad[:5]:
        print(f"  fp8div mismatch: x {x.flat[i]!r} s {s.flat[i]!r}: {got.flat[i]!r} != {want.flat[i]!r}")
    return int(bad.size)


def run_fp8div(per_s: int, s_step: int, seed: int = 0, batch: int = 1 << 14) -> int:
    rng = np.random.default_rng(seed)
    s_all = np.arange(0x3F800000, 0x40000000, s_step, dtype=np.uint32).view(F32)
    bad = total = 0
    t0 = time.time()
    for i in range(0, s_all.size, batch):
        s = s_all[i:i + batch]
        x = fp8div_dividends(rng, s, per_s)
        bad += check_fp8div(x, s[:, None])
        total += x.size
        if (i // batch) % 64 == 0:
            print(f"  {total:.3g} pairs, {bad} mismatches, {time.time() - t0:.0f} s", flush=True)
    print(f"fp8div: {bad} mismatches over {total} (x, s) pairs ({s_all.size} divisors; {time.time() - t0:.0f} s)")
    return bad


# ---- silu ------------------------------------------------------------------------------------------------------
def silu_device(g: np.ndarray) -> np.ndarray:
    """formats.cuh ``silu_f32``, operation for operation (every float op FTZ, as -ftz=true)."""
    from cuep.reference.ep import (SILU_LN2_HI, SILU_LN2_LO, SILU_LOG2E, SILU_POLY, SILU_RINT, SILU_X_MIN)
    from cuep.reference.quant import fma_f32

    g = np.ascontiguousarray(g, dtype=F32)
    with np.errstate(all="ignore"):
        ax = np.fmin(ftz(np.abs(g)), -SILU_X_MIN)                      # FMNMX.FTZ |g|, 88: NaN -> 88
        t = fma_f32(-ax, SILU_LOG2E, SILU_RINT)
        n = t - SILU_RINT
        r = fma_f32(n, -SILU_LN2_LO, fma_f32(n, -SILU_LN2_HI, -ax))
        p = np.full_like(r, SILU_POLY[0])
        for c in SILU_POLY[1:]:
            p = fma_f32(p, r, c)
        e = (p.view(U32) + (t.view(U32) << U32(23))).view(F32)          # integer add: may be a subnormal
        e = ftz(e)                                                      # as its consumers (add.ftz, mul.ftz) read it
        s = ftz(F32(1.0) / ftz(F32(1.0) + e))
        gf = ftz(g)
        num = np.where(gf < 0, ftz(gf * e), gf)
        return ftz(num * s)


def run_silu(n_random: int = 1 << 24, seed: int = 0) -> int:
    from cuep.reference.ep import silu_f32

    lo, hi = np.array([85.0, 89.0], dtype=F32).view(U32)
    mags = np.arange(lo, hi + 1, dtype=np.uint64).astype(U32)
    rnd = np.random.default_rng(seed).integers(0, 1 << 32, size=n_random, dtype=np.uint64).astype(U32)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 1, 0x80000001,
                        0x007FFFFF, 0x807FFFFF, 0x00800000, 0x80800000], dtype=U32)
    bad = 0
    t0 = time.time()
    for bits in (mags, mags | U32(0x80000000), rnd, special):
        g = bits.view(F32)
        for i in range(0, g.size, 1 << 22):
            a, b = silu_device(g[i:i + (1 << 22)]).view(U32), silu_f32(g[i:i + (1 << 22)]).view(U32)
            nan = np.isnan(a.view(F32)) & np.isnan(b.view(F32))
            wrong = (a != b) & ~nan
            if wrong.any():
                j = int(np.flatnonzero(wrong)[0])
                print(f"silu mismatch at g bits {int(bits[i + j]):#010x}: {int(a[j]):#010x} != {int(b[j]):#010x}")
                bad += int(wrong.sum())
    print(f"silu: {2 * mags.size + rnd.size + special.size} values, {bad} mismatches, {time.time() - t0:.0f} s")
    return bad

# ---- mxfp4: 2**-e folded into the e2m1 lines ------------------------------------------------------------------
def e2m1_pow2_device(x: np.ndarray, e: np.ndarray) -> np.ndarray:
    """formats.cuh ``E2m1Pow2(e)(x)`` then the sign of x: the e2m1 code of x * 2**-e without the multiply (mxfp4,
    e in [-126, 126]): a = min(|x|, 6 * 2**e) (FMNMX.FTZ), the three lines as FMAs with 2**(1-e), 2**-e, 2**(-1-e),
    their minimum. x and e broadcast; uint8 codes."""
    x = np.ascontiguousarray(x, dtype=F32)
    e = np.asarray(e, dtype=np.int64)
    M = F32(1.5 * 2.0**23)
    pow2 = lambda k: (np.asarray(k, np.int64).astype(U32) << U32(23)).view(F32)  # noqa: E731 (pow2_from_biased)
    clamp = ((np.asarray(e + 129, np.int64).astype(U32) << U32(23)) | U32(0x400000)).view(F32)
    with np.errstate(all="ignore"):
        a = np.fmin(ftz(np.abs(x)), clamp)
        t1 = fma32(a, np.broadcast_to(pow2(128 - e), a.shape), np.full(a.shape, M))
        t2 = fma32(a, np.broadcast_to(pow2(127 - e), a.shape), np.full(a.shape, M + F32(2.0)))
        t3 = fma32(a, np.broadcast_to(pow2(126 - e), a.shape), np.full(a.shape, M + F32(4.0)))
        t = np.fmin(np.fmin(t1, t2), t3)  # FMNMX: a NaN operand gives the other (none arises for e <= 125)
    return ((t.view(U32) - E2M1_BIAS) | ((x.view(U32) >> U32(28)) & U32(8))).astype(np.uint8)


def check_e2m1_pow2(x: np.ndarray, e: np.ndarray) -> int:
    """Mismatches between e2m1_pow2_device(x, e) and the reference's mxfp4 codes e2m1(ftz(ftz(x) * 2**-e)), for
    finite x (a NaN or Inf makes its block unspecified) and e in [-126, 125] (x, e broadcast)."""
    x, e = np.broadcast_arrays(np.asarray(x, F32), np.asarray(e, np.int64))
    ok = np.isfinite(x)
    x, e = np.ascontiguousarray(x[ok]), np.ascontiguousarray(e[ok])
    with np.errstate(all="ignore"):
        want = e2m1_encode(ftz(ftz(x) * np.ldexp(F32(1.0), -e).astype(F32)))
    got = e2m1_pow2_device(x, e)
    bad = np.flatnonzero(got != want)
    for i in bad[:5]:
        print(f"  e2m1 pow2 mismatch: e = {e[i]}, x bits {x.view(U32)[i]:#010x} ({x[i]!r}): device {got[i]}, "
              f"reference {want[i]}")
    return int(bad.size)


def run_e2m1_pow2(per_e: int = 1 << 20, seed: int = 0) -> int:
    """Every e in [-126, 125]: the rounding edges of the grid times 2**e and their neighbours, and per_e random
    values spread over 2**(e-30) .. 2**(e+4) (products from flushed to saturated)."""
    rng = np.random.default_rng(seed)
    thr = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0], np.float64)
    bad, t0 = 0, time.time()
    for e in range(-126, 126):
        with np.errstate(all="ignore"):
            mid = (thr * 2.0**e).astype(F32)
            edges = np.concatenate([mid, np.nextafter(mid, F32(0)), np.nextafter(mid, F32(np.inf))])
            rnd = (rng.uniform(1, 2, per_e) * np.exp2(rng.integers(e - 30, e + 4, per_e))).astype(F32)
        v = np.concatenate([edges, rnd, [F32(2.0**-126), F32(0.0)]])
        v = v * np.where(rng.random(v.size) < 0.5, F32(-1), F32(1))
        bad += check_e2m1_pow2(v, e)
    print(f"e2m1 pow2: {bad} mismatches, every e in [-126, 125], {per_e} random values each "
          f"({time.time() - t0:.0f} s)")
    return bad


# ---- mxfp4 from bf16: the lines on bf16 pairs ------------------------------------------------------------------
U16 = np.uint16
E2M1_BF16_MIN_E = -100  # kE2m1Bf16MinE of formats/elements.cuh


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    """float64 values of bf16 bit patterns (exact; NaN stays NaN)."""
    with np.errstate(invalid="ignore"):  # (signaling NaN patterns)
        return (np.asarray(bits, np.uint32) << U32(16)).view(F32).astype(F64)


def e2m1_bf16_device(xbits: np.ndarray, e: np.ndarray) -> np.ndarray:
    """formats/elements.cuh ``E2m1Bf16x2Pow2(e)`` on one bf16 value (bits ``xbits``) and its sign: a = min.bf16x2(
    |x|, 6 * 2**e) (a NaN operand gives the other; no flushing), each line fma.rn.bf16x2(a, 2**k, M + c), M = 192,
    rounded once to bf16 (ulp 1 on [128, 256): rint of the exact sum, which float64 holds wherever it is within 2**-9
    of a tie), their minimum. xbits and e broadcast; uint8 codes."""
    xbits = np.asarray(xbits, np.uint32)
    e = np.asarray(e, np.int64)
    mag = _bf16_value(xbits & U32(0x7FFF))
    clamp = 6.0 * np.exp2(e.astype(F64))
    with np.errstate(invalid="ignore"):
        a = np.where(np.isnan(mag), clamp, np.minimum(mag, clamp))
    t = np.minimum(np.minimum(np.rint(a * np.exp2(1.0 - e) + 192.0), np.rint(a * np.exp2(-e.astype(F64)) + 194.0)),
                   np.rint(a * np.exp2(-1.0 - e) + 196.0))
    return ((t - 192.0).astype(np.uint32) | ((xbits >> U32(12)) & U32(8))).astype(np.uint8)


def e2m1x8_pack_bf16_device(words: np.ndarray, e: np.ndarray) -> np.ndarray:
    """formats/elements.cuh ``e2m1x8_pack_bf16``: words [..., 4] uint32 (8 bf16, element 2i in the low half of word
    i) -> [...] uint32 codes, nibble i = element i, through the kernel's byte gathers (PRMT 0x6420 / 0x7531), bias
    and shifts, with the lines of ``e2m1_bf16_device`` (e broadcast over the leading axes)."""
    w = np.asarray(words, np.uint32)
    e = np.asarray(e, np.int64)[..., None]

    def lines(x):  # bits 0x4340 + code of both halves
        lo = e2m1_bf16_device(x & U32(0xFFFF), e).astype(np.uint32) & U32(7)
        hi = e2m1_bf16_device(x >> U32(16), e).astype(np.uint32) & U32(7)
        return (U32(0x4340) + lo) | ((U32(0x4340) + hi) << U32(16))

    def perm(a, b, sel):  # __byte_perm(a, b, sel) for selectors of byte indices 0..7 (no sign replication)
        src = np.stack([(a >> U32(8 * k)) & U32(0xFF) for k in range(4)] +
                       [(b >> U32(8 * k)) & U32(0xFF) for k in range(4)])
        out = np.zeros(a.shape, np.uint32)
        for byte in range(4):
            out |= src[(sel >> (4 * byte)) & 7] << U32(8 * byte)
        return out

    t = lines(w)
    lo = perm(t[..., 0], t[..., 1], 0x6420) - U32(0x40404040)
    hi = perm(t[..., 2], t[..., 3], 0x6420) - U32(0x40404040)
    lo |= (perm(w[..., 0], w[..., 1], 0x7531) >> U32(4)) & U32(0x08080808)
    hi |= (perm(w[..., 2], w[..., 3], 0x7531) >> U32(4)) & U32(0x08080808)
    return perm(lo | (lo >> U32(4)), hi | (hi >> U32(4)), 0x6420)


def run_e2m1_bf16(e_step: int = 1) -> int:
    """Every bf16 x (all 2**16 patterns; NaN and Inf give the float32 lines' code 7 with x's sign) and every e in
    [kE2m1Bf16MinE, 125] (every e_step-th): the code of ``e2m1_bf16_device`` against the reference's code of
    ftz(ftz(x) * 2**-e) (x from bf16: exact in float32)."""
    xbits = np.arange(1 << 16, dtype=np.uint32)
    x = (xbits << U32(16)).view(F32)
    bad, t0 = 0, time.time()
    for e in range(E2M1_BF16_MIN_E, 126, e_step):
        with np.errstate(all="ignore"):
            want = e2m1_encode(ftz(ftz(x) * np.ldexp(F32(1.0), -e).astype(F32)))
        got = e2m1_bf16_device(xbits, e)
        wrong = np.flatnonzero(got != want)
        for i in wrong[:5]:
            print(f"  e2m1 bf16 mismatch: e = {e}, x bits {int(xbits[i]):#06x}: device {got[i]}, reference {want[i]}")
        bad += int(wrong.size)
    n_e = len(range(E2M1_BF16_MIN_E, 126, e_step))
    print(f"e2m1 bf16: {bad} mismatches, all 2**16 bf16 x at {n_e} e ({time.time() - t0:.0f} s)")
    return bad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("e2m1", help="all 2**32 float32 bit patterns")
    d = sub.add_parser("fp8div", help="the fp8 quantizer's division")
    d.add_argument("--per-s", type=int, default=256, help="dividends per divisor (default 256)")
    d.add_argument("--s-step", type=int, default=1, help="take every n-th divisor significand (default 1: all)")
    d.add_argument("--seed", type=int, default=0)
    sub.add_parser("silu", help="fused_silu's silu_f32 (the |g| in [85, 89] range and random patterns)")
    sub.add_parser("e2m1pow2", help="mxfp4's e2m1 lines with 2**-e folded in, every e")
    sub.add_parser("e2m1bf16", help="mxfp4 from bf16: the lines on bf16 pairs, every bf16 x at every e")
    a = p.parse_args()
    if a.what == "e2m1bf16":
        return 1 if run_e2m1_bf16() else 0
    if a.what == "silu":
        return 1 if run_silu() else 0
    if a.what == "e2m1pow2":
        return 1 if run_e2m1_pow2() else 0
    bad = run_e2m1() if a.what == "e2m1" else run_fp8div(a.per_s, a.s_step, a.seed)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
