// cuep wire formats on the device: the bit-exact rules of docs/formats.md (the NumPy oracle is cuep.reference).
//
// Element primitives (e4m3, e2m1, bf16, powers of two, FTZ, fused_silu's float32 silu), the 128x4 swizzled scale
// offset, and a WARP-level quantizer that every kernel producing a quantized row reuses (quantize, fused_silu,
// dispatch):
//
//   a warp step covers 256 values, 8 consecutive ones per lane (one 16-byte bf16 load, two for float32); with an
//   even number of steps per span (quantize, fused_silu) the steps go in pairs and each lane holds 16 consecutive
//   values instead (two adjacent 16-byte loads). A scale block is an aligned group of lanes (8 values per lane:
//   fp8 16 lanes, nvfp4 2, mxfp4 4; 16 per lane: fp8 8, nvfp4 1, mxfp4 2); the block amax is reduced with
//   __shfl_xor_sync inside that group; every lane writes its own payload bytes and the block's first lane (the
//   leader) its scale.
//
// Arithmetic: every float32 multiply, add and divide of the contract is an explicit __fmul_rn / __fadd_rn /
// __fsub_rn / __fdiv_rn, IEEE round-to-nearest and never contracted into an FMA, so -fmad cannot change a result;
// the only FMAs are the fp8 quotient's exact corrections (div_rn_by). CuPy compiles with -ftz=true: these, fabsf,
// fminf and fmaxf flush subnormal operands and results to zero of the same sign, which is the contract's FTZ policy
// (the PTX shows div.rn.ftz, mul.rn.ftz, max.ftz). Conversions the flag does not cover are done with bit operations
// or exact hardware conversions (bf16, e4m3/e2m1 decode, ftz()).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.cuh"

namespace cuep {

// ---- constants (mirrored in cuep/formats.py; a CPU test checks they agree) ------------------------------
constexpr int kFp8Block = 128;           // values per fp8 scale
constexpr float kFp8Max = 448.0f;        // largest finite e4m3
constexpr float kFp8AmaxFloor = 1e-4f;   // fp8 amax floor: s = max(amax, floor) / 448
constexpr int kNvfp4Block = 16;          // values per nvfp4 (e4m3) scale
constexpr int kMxfp4Block = 32;          // values per mxfp4 (e8m0) scale
constexpr float kE2m1Max = 6.0f;         // largest e2m1
constexpr float kFp8MaxRcp = 0x1.24924ap-9f;   // RN(1 / 448), for the division by 448 (div_rn_by)
constexpr float kE2m1MaxRcp = 0x1.555556p-3f;  // RN(1 / 6)
constexpr int kScaleTileRows = 128;      // swizzled block scales: 128 rows x 4 columns per 512-byte tile
constexpr int kScaleTileCols = 4;
constexpr int kScaleTileBytes = 512;
static_assert(kScaleTileBytes == kScaleTileRows * kScaleTileCols, "a scale tile is 128 x 4 bytes");

constexpr int kLaneValues = 8;                    // values per lane per warp step (16 bytes of bf16)
constexpr int kWarpSpan = kWarp * kLaneValues;    // values per warp step: 256
constexpr int kOpsThreads = 256;                  // threads per block of the ops kernels (cuep/ops.py: _THREADS)
constexpr int kMaxGroups = 4096;                  // most expert groups the swizzled-scale kernels take (smem)

enum FormatId : int { kFmtBf16 = 0, kFmtFp8 = 1, kFmtNvfp4 = 2, kFmtMxfp4 = 3 };

// ---- bits ---------------------------------------------------------------------------------------------
constexpr uint32_t kSignBit = 0x80000000u;
constexpr uint32_t kExpMask = 0x7F800000u;

// Flush a float32 subnormal to zero of the same sign (what -ftz=true does to operands and results).
__device__ __forceinline__ float ftz(float x) {
    const uint32_t b = __float_as_uint(x);
    return (b & kExpMask) ? x : __uint_as_float(b & kSignBit);
}

// 2**(biased - 127) built from its bits, biased in [0, 255]: 0 gives +0 (2**-127 is a subnormal, which an FTZ
// operand is), 255 gives +Inf. Exact: no arithmetic.
__device__ __forceinline__ float pow2_from_biased(uint32_t biased) { return __uint_as_float(biased << 23); }

// ---- bf16 -----------------------------------------------------------------------------------------------
__device__ __forceinline__ float bf16_to_float(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

// float32 -> bf16 bits, round to nearest even, subnormals kept, overflow to Inf; NaN -> 0x7FC0 / 0xFFC0 by its
// sign (what ml_dtypes does). Integer arithmetic, so no flag (ftz, fmad) can touch it.
__device__ __forceinline__ uint32_t bf16_encode(float x) {
    const uint32_t b = __float_as_uint(x);
    if ((b & ~kSignBit) > kExpMask) return (b >> 16 & 0x8000u) | 0x7FC0u;
    return (b + 0x7FFFu + (b >> 16 & 1u)) >> 16;
}

// Two bf16 from one little-endian word: element 0 in the low half.
__device__ __forceinline__ void bf16x2_to_float(uint32_t w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
}

__device__ __forceinline__ uint32_t bf16x2_encode(float lo, float hi) {
    return bf16_encode(lo) | bf16_encode(hi) << 16;
}

// ---- e4m3 (float8_e4m3fn) ---------------------------------------------------------------------------------
// cvt_e4m3 of two values: round to nearest even, saturating to +-448 (NaN stays NaN); `lo` in the low byte.
__device__ __forceinline__ uint32_t e4m3x2_encode(float lo, float hi) {
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ uint32_t e4m3_encode(float v) {
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// e4m3 byte -> float32, exact (0x7F / 0xFF are NaN).
__device__ __forceinline__ float e4m3_decode(uint32_t b) {
    const uint32_t sign = (b & 0x80u) << 24, exp = b >> 3 & 0xFu, man = b & 7u;
    if ((b & 0x7Fu) == 0x7Fu) return __uint_as_float(sign | 0x7FC00000u);
    if (exp == 0) return __uint_as_float(sign | __float_as_uint(__fmul_rn(float(man), 0x1p-9f)));  // man * 2**-9
    return __uint_as_float(sign | (exp + 120u) << 23 | man << 20);  // bias 7 -> bias 127
}

// e4m3 byte -> float32 by the hardware conversion (F2FP e4m3 -> f16, then f16 -> f32: two instructions, exact for
// every finite code; a NaN code gives some NaN).
__device__ __forceinline__ float e4m3_to_float(uint32_t b) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
}

// ---- e2m1 ---------------------------------------------------------------------------------------------------
// cvt_e2m1 of docs/formats.md: round to nearest even on {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6; the sign
// bit (0x8) is the sign bit of v (-0.0 and tiny negatives give 0x8); NaN gives magnitude 7, as the reference.
//
// Magnitude, with a = min(|v|, 6) (FMNMX.FTZ: NaN -> 6, Inf -> 6, subnormal -> 0), from float32 operations that
// round once each and exactly where the grid does, plus one integer add (no compare, no select):
//   big   = the code of w = max(a, 1): for w >= 1 the grid's steps (0.5 in [1, 2), 1 in [2, 4), 2 in [4, 6]) are
//           one kept mantissa bit, so w rounded to 2 significant bits, ties to even (Veltkamp's split with
//           C = 2**22 + 1: hi = w*C - (w*C - w)), is the rounded value, hi in {1, 1.5, 2, 3, 4, 6}, and
//           bits(hi) >> 22 = 252 + code (1.0 -> 2 ... 6.0 -> 7);
//   small = min(a, 1) + 2**22 (FADD.SAT, then an add whose ulp is the step 0.5, ties to even: 0.25 -> 0,
//           0.75 -> 1.0): bits(small) = 0x4A800000 + code (0, 1 or 2);
//   code  = (big code) + (small code) - 2: a < 1 has big code 2, a >= 1 has small code 2.
// Identical to cuep.reference.quant.e2m1_encode over all 2**32 float32 bit patterns: scripts/check_exhaustive.py
// (e2m1) runs a NumPy emulation of exactly these operations over all of them. __fmul_rn / __fsub_rn / __fadd_rn
// are never contracted into an FMA; w, hi and the sums are normal numbers (FTZ changes nothing).
constexpr uint32_t kE2m1Bias = 252u + 0x4A800000u + 2u;  // e2m1_biased(v) - kE2m1Bias = the magnitude code

// code + kE2m1Bias (mod 2**32), magnitude only: the sign is added by the callers.
__device__ __forceinline__ uint32_t e2m1_biased(float v) {
    const float a = fminf(fabsf(v), kE2m1Max);
    const float w = fmaxf(a, 1.0f);
    const float wc = __fmul_rn(w, 4194305.0f);                      // w * (2**22 + 1), exact range: w <= 6
    const float hi = __fsub_rn(wc, __fsub_rn(wc, w));                // w rounded to 2 significant bits (RNE)
    const float small = __fadd_rn(__saturatef(a), 0x1p22f);          // FADD.SAT: min(a, 1), then the 0.5 step
    return (__float_as_uint(hi) >> 22) + __float_as_uint(small);     // one LEA.HI
}

__device__ __forceinline__ uint32_t e2m1_encode(float v) {
    return (e2m1_biased(v) - kE2m1Bias) | (__float_as_uint(v) >> 28 & 8u);
}

// Eight codes packed into a word, element i in nibble i (element 2i in the low nibble of byte i). The biased
// magnitudes are summed into place (the bias of all eight cancels in one constant, no carries: each code <= 7);
// the sign bits are gathered with funnel shifts of the raw bits (the top nibble of each, masked once).
__device__ __forceinline__ uint32_t e2m1x8_encode(const float (&v)[kLaneValues]) {
    uint32_t mag = 0u - kE2m1Bias * 0x11111111u;
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i) mag += e2m1_biased(v[i]) << (4 * i);
    uint32_t sign = __float_as_uint(v[kLaneValues - 1]) >> 28;
#pragma unroll
    for (int i = kLaneValues - 2; i >= 0; --i) sign = __funnelshift_l(__float_as_uint(v[i]), sign, 4);
    return mag | (sign & 0x88888888u);
}

// e2m1 code (0..15) -> float32, exact (code 8 is -0.0).
__device__ __forceinline__ float e2m1_decode(uint32_t code) {
    const uint32_t exp = code >> 1 & 3u, man = code & 1u;
    const uint32_t mag = exp ? ((exp + 126u) << 23 | man << 22) : (man ? 0x3F000000u : 0u);  // 0x3F000000 = 0.5
    return __uint_as_float((code & 8u) << 28 | mag);
}

// ---- silu (fused SwiGLU) ------------------------------------------------------------------------------------
// sv = silu(g) = g * sigmoid(g) in float32 exactly as docs/formats.md ("Fused SwiGLU") and
// cuep.reference.ep.silu_f32 compute it: every operation rounded to nearest even and flushed (-ftz=true), the
// FMAs rounded once (__fmaf_rn; NumPy emulates them exactly: cuep.reference.quant.fma_f32). Within 3.4 float32
// ulp of the exact silu wherever that exceeds 2**-118 in magnitude (g above about -87.2); below, within 2**-119.
//   x   = max(-|g|, -88)                    (NaN g: -88)
//   t   = fma(x, log2e, 1.5 * 2**23)        n = t - 1.5 * 2**23 = rint(x * log2e) in [-127, 0], ties to even
//   r   = fma(n, -ln2_lo, fma(n, -ln2_hi, x))
//   p   = Horner with FMAs: c6, c5, c4, c3, c2, 1, 1  (e**r on |r| <= 0.35)
//   e   = p * 2**n, 2**n from the bits of t: (bits(t) << 23) + bits(1.0) = (n + 127) << 23 (n = -127: +0)
//   s   = RN(1 / (1 + e))                   (1 + e in [1, 2]: rcp_rn_normal)
//   sv  = (g < 0 ? g * e : g) * s           (sigmoid(-|g|) = e * s)
// About 20 instructions and no division or branch (the IEEE division alone was about 10 with its slow path).
constexpr float kSiluXMin = -88.0f;                  // rint(-88 * log2e) = -127: 2**n = +0
constexpr float kSiluLog2e = 0x1.715476p+0f;         // 1.44269504f
constexpr float kSiluRint = 0x1.8p+23f;              // 1.5 * 2**23: adding it rounds to an integer
constexpr float kSiluLn2Hi = 0x1.63p-1f;             // 0.693359375 (9 bits: n * ln2_hi exact)
constexpr float kSiluLn2Lo = -0x1.bd0106p-13f;       // -2.12194440e-4
constexpr float kSiluC6 = 0x1.6a1a8ep-10f;           // minimax e**r on |r| <= 0.35 (relative error 3.3e-9)
constexpr float kSiluC5 = 0x1.123fb6p-7f;
constexpr float kSiluC4 = 0x1.555916p-5f;
constexpr float kSiluC3 = 0x1.55548ap-3f;
constexpr float kSiluC2 = 0x1.fffffcp-2f;

// RN(1/d) for a normal d whose exponent is not extreme (|d| in [2**-124, 2**124]): the hardware estimate and one
// Newton step, CUDA's own rcp.rn.f32 fast path (it takes a slow path only outside that range). tests/test_ops_gpu.py
// checks it against __frcp_rn for every d of the ranges cuep uses.
__device__ __forceinline__ float rcp_rn_normal(float d) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
    return __fmaf_rn(y, __fmaf_rn(-d, y, 1.0f), y);
}

__device__ __forceinline__ float silu_f32(float g) {
    const float x = fmaxf(-fabsf(g), kSiluXMin);
    const float t = __fmaf_rn(x, kSiluLog2e, kSiluRint);
    const float n = __fsub_rn(t, kSiluRint);
    const float r = __fmaf_rn(n, -kSiluLn2Lo, __fmaf_rn(n, -kSiluLn2Hi, x));
    float p = kSiluC6;
    p = __fmaf_rn(p, r, kSiluC5);
    p = __fmaf_rn(p, r, kSiluC4);
    p = __fmaf_rn(p, r, kSiluC3);
    p = __fmaf_rn(p, r, kSiluC2);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    const float e = __fmul_rn(p, __uint_as_float((__float_as_uint(t) << 23) + 0x3F800000u));
    const float s = rcp_rn_normal(__fadd_rn(1.0f, e));
    return __fmul_rn(g < 0.0f ? __fmul_rn(g, e) : g, s);
}

// ---- swizzled (128x4 tiled) block scales ---------------------------------------------------------------
// Byte offset of scale (row, col) in the 128x4-tiled layout (docs/formats.md; cuep.formats.swizzled_scale_offset).
__host__ __device__ __forceinline__ constexpr int64_t swizzled_scale_offset(int64_t row, int col, int k_tiles) {
    return ((row / kScaleTileRows) * k_tiles + col / kScaleTileCols) * kScaleTileBytes + (row % 32) * 16 +
           ((row % kScaleTileRows) / 32) * 4 + col % kScaleTileCols;
}

// ---- formats --------------------------------------------------------------------------------------------
template <int kFmt>
struct FormatTraits;

template <>
struct FormatTraits<kFmtBf16> {
    static constexpr int kBlock = 0;
    static constexpr bool kPacked = false;
    using Payload = uint4;      // 8 bf16
    using Scale = uint8_t;      // (none)
};
template <>
struct FormatTraits<kFmtFp8> {
    static constexpr int kBlock = kFp8Block;
    static constexpr bool kPacked = false;
    using Payload = uint2;      // 8 e4m3 bytes
    using Scale = float;        // s
};
template <>
struct FormatTraits<kFmtNvfp4> {
    static constexpr int kBlock = kNvfp4Block;
    static constexpr bool kPacked = true;
    using Payload = uint32_t;   // 8 e2m1 codes, element 2i in the low nibble of byte i
    using Scale = uint8_t;      // e4m3
};
template <>
struct FormatTraits<kFmtMxfp4> {
    static constexpr int kBlock = kMxfp4Block;
    static constexpr bool kPacked = true;
    using Payload = uint32_t;
    using Scale = uint8_t;      // e8m0: e + 127
};

// Payload byte offset of value `col` (>= 0) of a row.
template <int kFmt>
__device__ __forceinline__ int64_t payload_offset(int64_t col) {
    return kFmt == kFmtBf16 ? col * 2 : (FormatTraits<kFmt>::kPacked ? (col >> 1) : col);
}

// amax over an aligned group of kLanes lanes (butterfly: every lane of the group ends with the same value).
// Non-NaN inputs are >= 0, so the max is exact whatever the order.
template <int kLanes>
__device__ __forceinline__ float group_amax(float a) {
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

// x / s rounded to nearest even (the contract's IEEE division), given y = RN(1/s), s > 0 normal, for the fp8
// quantizer: q0 = RN(x * y) is within 1.5 ulp of x / s; one Markstein correction q1 = q0 + (x - s q0) y (FMAs)
// is faithful (within 1 ulp); with a faithful q and y = RN(1/s) the remainder x - s q1 is exact and the second
// correction q2 = RN(q1 + (x - s q1) y) is RN(x / s) (Markstein's theorem). Holds while the remainders do not
// underflow: always when |x / s| >= 2**-11 (s >= 2.2e-7); below that e4m3 rounds both to a zero, whose sign
// is the sign of x (copied in: a -0 numerator gives +0 through the FMAs). Five FMA-pipe instructions instead of
// a division's ten (MUFU.RCP, FCHK, branch); scripts/check_exhaustive.py fp8div checks it on 2**31 pairs.
// x subnormal: mul.ftz / fma.ftz flush it, as the contract's flushed x.
__device__ __forceinline__ float div_rn_by(float x, float s, float y) {
    const float q0 = __fmul_rn(x, y);
    const float q1 = __fmaf_rn(__fmaf_rn(-s, q0, x), y, q0);
    const float q2 = __fmaf_rn(__fmaf_rn(-s, q1, x), y, q1);
    return __uint_as_float(__float_as_uint(q2) | (__float_as_uint(x) & kSignBit));
}

// The encoded payload of kN values (fp8: kN bytes, nvfp4 / mxfp4: kN / 2 bytes), as little-endian words.
template <int kFmt, int kN>
struct PayloadWords {
    static constexpr int kWords = kFmt == kFmtFp8 ? kN / 4 : kN / 8;
    uint32_t w[kWords];
};

template <int kFmt, int kN>
struct QuantN {
    PayloadWords<kFmt, kN> payload;            // this lane's kN values, encoded
    typename FormatTraits<kFmt>::Scale scale;  // its block's scale (the same in every lane of the block)
    bool leader;                               // first lane of its block: the one that stores the scale
};

// e4m3 bytes of x_i / s (fp8), four per word.
template <int kN>
__device__ __forceinline__ void fp8_encode(const float (&v)[kN], float s, float y, uint32_t (&w)[kN / 4]) {
#pragma unroll
    for (int k = 0; k < kN / 4; ++k)
        w[k] = e4m3x2_encode(div_rn_by(v[4 * k], s, y), div_rn_by(v[4 * k + 1], s, y)) |
               e4m3x2_encode(div_rn_by(v[4 * k + 2], s, y), div_rn_by(v[4 * k + 3], s, y)) << 16;
}

// e2m1 codes of x_i * m (nvfp4: m = r, mxfp4: m = 2**-e), eight per word.
template <int kN>
__device__ __forceinline__ void fp4_encode(const float (&v)[kN], float m, uint32_t (&w)[kN / 8]) {
#pragma unroll
    for (int k = 0; k < kN / 8; ++k) {
        float y[kLaneValues];
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) y[i] = __fmul_rn(v[8 * k + i], m);
        w[k] = e2m1x8_encode(y);
    }
}

// Quantize this lane's kN (8 or 16) consecutive values; a scale block is an aligned group of kBlock / kN lanes.
// Subnormal values need not be flushed first: they are read only through fabsf, fmaxf, div.rn.ftz / fma.rn.ftz /
// mul.rn.ftz, which flush them under -ftz=true as the contract's "flush x first" does.
// Called by ALL 32 lanes of the warp, converged: lanes whose values lie past the row pass zeros (their block is
// then entirely out of the row, since blocks are aligned lane groups) and discard the result.
template <int kFmt, int kN>
__device__ __forceinline__ QuantN<kFmt, kN> warp_quantize(const float (&v)[kN], float global_scale) {
    static_assert(kFmt == kFmtFp8 || kFmt == kFmtNvfp4 || kFmt == kFmtMxfp4, "a scaled format");
    constexpr int kLanes = FormatTraits<kFmt>::kBlock / kN;
    static_assert(kLanes >= 1 && kLanes * kN == FormatTraits<kFmt>::kBlock, "whole blocks per lane group");
    QuantN<kFmt, kN> q;
    q.leader = (threadIdx.x % kLanes) == 0;
    float a = fabsf(v[0]);  // abs.ftz / max.ftz: subnormals count as 0, as the contract's flushed x
#pragma unroll
    for (int i = 1; i < kN; ++i) a = fmaxf(a, fabsf(v[i]));
    const float amax = group_amax<kLanes>(a);

    // The block-scale divisions are correctly rounded without a division instruction (div_rn_by with a hardware
    // reciprocal refined to RN(1/d), rcp_rn_normal): no slow-path branch in the hot loop.
    if constexpr (kFmt == kFmtFp8) {
        // s = max(amax, 1e-4) / 448; q_i = cvt_e4m3(x_i / s), the correctly rounded quotient (div_rn_by).
        const float s = div_rn_by(fmaxf(amax, kFp8AmaxFloor), kFp8Max, kFp8MaxRcp);  // quotient >= 2.2e-7
        fp8_encode(v, s, rcp_rn_normal(s), q.payload.w);  // s is normal, in [2.2e-7, 7.6e35]
        q.scale = s;
    } else if constexpr (kFmt == kFmtNvfp4) {
        // t = (g * amax) / 6; sf = cvt_e4m3(t); sfv = float(sf); sfv == 0: codes +0; else r = g / sfv,
        // q_i = cvt_e2m1(x_i * r). g * amax is clamped to 4096 first: e4m3 saturates from t = 464 on, so sf is
        // the same, and the quotient stays finite; t below 2**-10 (where div_rn_by may be an ulp off) is code 0
        // either way. g in [2**-100, 2**100] (checked by the API) keeps g / sfv (sfv in [2**-9, 448]) exact.
        const float t = div_rn_by(fminf(__fmul_rn(global_scale, amax), 4096.0f), kE2m1Max, kE2m1MaxRcp);
        const uint32_t sf = e4m3_encode(t);
        const float sfv = e4m3_to_float(sf);
        fp4_encode(v, div_rn_by(global_scale, sfv, rcp_rn_normal(sfv)), q.payload.w);
        if (!(sf & 0x7Fu)) {  // sfv == 0 (sf is +0: t >= 0): the block's codes are +0
#pragma unroll
            for (int k = 0; k < kN / 8; ++k) q.payload.w[k] = 0u;
        }
        q.scale = uint8_t(sf);
    } else {
        // E = unbiased exponent of amax (amax = 0 gives -127); e = max(E - 2, -127); scale byte e + 127;
        // q_i = cvt_e2m1(x_i * 2**-e), 2**-e exact and normal (e in [-127, 126]).
        const int big_e = int(__float_as_uint(amax) >> 23 & 0xFFu) - 127;
        const int e = max(big_e - 2, -127);
        fp4_encode(v, pow2_from_biased(uint32_t(127 - e)), q.payload.w);
        q.scale = uint8_t(e + 127);
    }
    return q;
}

// Store the words of a payload (4, 8 or 16 bytes, aligned to their size) with one instruction.
template <int kWords>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[kWords]) {
    if constexpr (kWords == 1)
        *reinterpret_cast<uint32_t*>(dst) = w[0];
    else if constexpr (kWords == 2)
        *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    else
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Decode this lane's 8 values (per-lane, no warp cooperation): fp8 q * s; nvfp4 (q * sfv) / g; mxfp4 q * 2**e
// (scale byte 0 gives 2**-127, a subnormal: an FTZ operand, so 0).
template <int kFmt>
__device__ __forceinline__ void dequantize8(const typename FormatTraits<kFmt>::Payload& p,
                                            typename FormatTraits<kFmt>::Scale scale, float global_scale,
                                            float (&v)[kLaneValues]) {
    if constexpr (kFmt == kFmtBf16) {
        bf16x2_to_float(p.x, v[0], v[1]);
        bf16x2_to_float(p.y, v[2], v[3]);
        bf16x2_to_float(p.z, v[4], v[5]);
        bf16x2_to_float(p.w, v[6], v[7]);
    } else if constexpr (kFmt == kFmtFp8) {
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) {
            const uint32_t w = i < 4 ? p.x : p.y;
            v[i] = __fmul_rn(e4m3_decode(w >> (8 * (i % 4)) & 0xFFu), scale);
        }
    } else if constexpr (kFmt == kFmtNvfp4) {
        const float sfv = e4m3_decode(scale);
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i)
            v[i] = __fdiv_rn(__fmul_rn(e2m1_decode(p >> (4 * i) & 0xFu), sfv), global_scale);
    } else {
        const float m = pow2_from_biased(scale);
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) v[i] = __fmul_rn(e2m1_decode(p >> (4 * i) & 0xFu), m);
    }
}

// ---- global memory ----------------------------------------------------------------------------------------
// 16-byte read-only streaming load (the data is not written while the kernel runs).
__device__ __forceinline__ uint4 load16_nc(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The same through L1 (allocating): for the 16-values-per-lane layout, whose two 16-byte loads per lane share a
// 32-byte sector (the second load of each sector hits L1 instead of going back to L2).
__device__ __forceinline__ uint4 load16_nc_l1(const void* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Ask L2 to fetch the 128-byte line holding p from memory (a hint: no registers, nothing to wait for). Each lane
// asks for its own values of the warp's next span, so DRAM has that span's requests in flight while the warp still
// works on the current one.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ void unpack_f32x4(const uint4& w, float* v) {
    v[0] = __uint_as_float(w.x);
    v[1] = __uint_as_float(w.y);
    v[2] = __uint_as_float(w.z);
    v[3] = __uint_as_float(w.w);
}

// 8 values from raw loads: bf16 (one uint4) or float32 (two uint4), optionally FTZ-flushed.
template <bool kFlush>
__device__ __forceinline__ void bf16x8_values(const uint4& w, float (&v)[kLaneValues]) {
    bf16x2_to_float(w.x, v[0], v[1]);
    bf16x2_to_float(w.y, v[2], v[3]);
    bf16x2_to_float(w.z, v[4], v[5]);
    bf16x2_to_float(w.w, v[6], v[7]);
    if constexpr (kFlush) {
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) v[i] = ftz(v[i]);
    }
}

template <bool kFlush>
__device__ __forceinline__ void f32x8_values(const uint4& a, const uint4& b, float (&v)[kLaneValues]) {
    unpack_f32x4(a, v);
    unpack_f32x4(b, v + 4);
    if constexpr (kFlush) {
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) v[i] = ftz(v[i]);
    }
}

// Element types of the inputs: bf16 is carried as its bits.
using bf16_t = uint16_t;

// Raw 16-byte words holding 8 values of T (one for bf16, two for float32).
template <class T>
struct Raw8 {
    static constexpr int kWords = int(sizeof(T)) * kLaneValues / 16;
    uint4 w[kWords];
};

template <class T, bool kL1 = false>
__device__ __forceinline__ Raw8<T> load8(const T* p) {
    Raw8<T> r;
#pragma unroll
    for (int i = 0; i < Raw8<T>::kWords; ++i)
        r.w[i] = kL1 ? load16_nc_l1(reinterpret_cast<const uint4*>(p) + i)
                     : load16_nc(reinterpret_cast<const uint4*>(p) + i);
    return r;
}

template <bool kFlush, class T>
__device__ __forceinline__ void values8(const Raw8<T>& r, float (&v)[kLaneValues]) {
    if constexpr (sizeof(T) == 2)
        bf16x8_values<kFlush>(r.w[0], v);
    else
        f32x8_values<kFlush>(r.w[0], r.w[1], v);
}

// ---- sources: where a lane's 8 values come from ----------------------------------------------------------
// A Source has `Source at(col) const` (the source shifted to start at value col >= 0), `void prefetch(col) const`
// (L2 prefetch of the line(s) holding value col: this lane's values of a later span),
// `template <bool kL1> Raw load(col) const` (issue the loads of values [col, col + 8) of its row; kL1: through
// L1) and `void values(const Raw&, float (&)[8]) const` (turn them into the values to quantize);
// splitting the two lets warp_quantize_span keep several steps of loads in flight before the first use.
// kBf16ByCvt: the values are flushed and a NaN among them may become any bf16 NaN, so the bf16 "format" may use
// the hardware conversion (cvt.rn.bf16x2.f32) instead of bf16_encode.
// kFlush: flush subnormal inputs with bit operations. The quantizers do not need it: they read values only through
// max.ftz, div.rn.ftz and mul.rn.ftz (-ftz=true), which flush them to zero of the same sign exactly as the
// contract's "flush x first" does (tested with subnormal inputs); the bf16 "format" must not flush at all.
template <class T, bool kFlush>
struct RowSource {
    using Raw = Raw8<T>;
    static constexpr bool kBf16ByCvt = false;
    const T* row;
    // The source of values [col, ...) of the row (col >= 0): loads relative to it use immediate offsets.
    __device__ __forceinline__ RowSource at(int col) const { return RowSource{row + unsigned(col)}; }
    // L2 prefetch of the line holding value col (this lane's values of a later span).
    __device__ __forceinline__ void prefetch(int col) const { prefetch_l2(row + col); }
    template <bool kL1 = false>
    __device__ __forceinline__ Raw load(int col) const { return load8<T, kL1>(row + col); }
    __device__ __forceinline__ void values(const Raw& r, float (&v)[kLaneValues]) const { values8<kFlush>(r, v); }
};

// ---- sinks: where the scales go -------------------------------------------------------------------------
// A Sink has `put(lane, col_block, scale, leader, valid)`, called by all 32 lanes converged after each warp step;
// `valid` says this lane's values lie inside the row; `scale` is 0 where !valid.
struct NoScales {
    template <class S>
    __device__ __forceinline__ void put(int, int, S, bool, bool) const {}
};

// Scales contiguous per row (message layout, quantize()): fp8 float32, fp4 one byte per block.
template <class S>
struct RowScales {
    S* row;
    __device__ __forceinline__ void put(int, int c, S s, bool leader, bool valid) const {
        if (leader && valid) row[c] = s;
    }
};

// fp8 dispatch / fused_silu layout: float32 [H/128, ld], scales[c, row].
struct TransposedScales {
    float* base;
    int64_t ld;
    int64_t row;
    __device__ __forceinline__ void put(int, int c, float s, bool leader, bool valid) const {
#ifdef CUEP_AB_NO_SCALE_STORES
        return;
#endif
        if (leader && valid) base[c * ld + row] = s;
    }
};

// nvfp4 / mxfp4 dispatch / fused_silu layout: 128x4 tiles. Each block's leader lane stores its scale byte (the
// four bytes of a tile row come from four lanes of the same store instruction); the row part of the offset is
// computed once. Columns past H/block inside the last tile (padding) get 0 from the lanes past the row.
// `enabled` = false (a row outside every group: bad row_offsets) writes nothing.
template <int kFmt>
struct SwizzledScales {
    uint8_t* row_base;  // base + swizzled_scale_offset(R, 0, k_tiles); nullptr: write nothing
    int n_cols;         // k_tiles * 4
    __device__ __forceinline__ SwizzledScales(uint8_t* base, int64_t scale_row, int k_tiles, bool enabled)
        : row_base(enabled ? base + swizzled_scale_offset(scale_row, 0, k_tiles) : nullptr),
          n_cols(k_tiles * kScaleTileCols) {}
    __device__ __forceinline__ void put(int, int c, uint8_t s, bool leader, bool valid) const {
#ifdef CUEP_AB_NO_SCALE_STORES  // measurement knob only (wrong results): the cost of the scale stores
        return;
#endif
        if (row_base != nullptr && leader && c < n_cols)
            row_base[(c / kScaleTileCols) * kScaleTileBytes + c % kScaleTileCols] = valid ? s : uint8_t(0);
    }
};

// ---- the row quantizer ----------------------------------------------------------------------------------
// Quantize values [col0, col0 + kSteps * 256) of one row (clipped to `hidden`) into `payload_row`, scales to
// `sink`. All 32 lanes call it converged; col0 is a multiple of 256. All kSteps loads are issued before the
// first is used. bf16 "format": 16-byte bf16 stores, no scales.
//
// Lane layout: with an odd kSteps (and for bf16), lane l holds values [256 s + 8 l, +8) of step s; with an even
// kSteps the steps go in pairs and lane l holds values [512 p + 16 l, +16) of pair p, so a scale block spans
// half as many lanes (fp8 8, nvfp4 1, mxfp4 2): half the block-scale work per value, fewer shuffles, and 8- or
// 16-byte payload stores. Quantized formats have hidden % 16 == 0, so a lane's 16 values are all in or all out.
template <int kFmt, int kN, class Sink>
__device__ __forceinline__ void warp_encode(const float (&v)[kN], uint8_t* dst, int col, bool valid,
                                            const Sink& sink, float global_scale, int lane) {
    using Scale = typename FormatTraits<kFmt>::Scale;
    const QuantN<kFmt, kN> q = warp_quantize<kFmt, kN>(v, global_scale);
    if (valid) store_words(dst, q.payload.w);
    sink.put(lane, int(unsigned(col) / unsigned(FormatTraits<kFmt>::kBlock)), valid ? q.scale : Scale(0), q.leader,
             valid);
}

template <bool kCvt>
__device__ __forceinline__ void store_bf16x8(uint8_t* dst, const float (&v)[kLaneValues]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (kCvt) {
            const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);  // F2FP.BF16.F32.PACK_AB
            w[i] = *reinterpret_cast<const uint32_t*>(&b);
        } else {
            w[i] = bf16x2_encode(v[2 * i], v[2 * i + 1]);
        }
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// One (paired) step: turn the raw loads into this lane's kN values (zeros when !valid), encode, store.
template <int kFmt, int kN, class Source, class Sink>
__device__ __forceinline__ void warp_span_group(const Source& src, const typename Source::Raw* raw, uint8_t* dst,
                                                int col, bool valid, const Sink& sink, float global_scale,
                                                int lane) {
    float v[kN];
    if (valid) {
#pragma unroll
        for (int h = 0; h < kN / kLaneValues; ++h) {
            float a[kLaneValues];
            src.values(raw[h], a);
#pragma unroll
            for (int i = 0; i < kLaneValues; ++i) v[kLaneValues * h + i] = a[i];
        }
    } else {
#pragma unroll
        for (int i = 0; i < kN; ++i) v[i] = 0.0f;
    }
    if constexpr (kFmt == kFmtBf16) {
        if (valid) store_bf16x8<Source::kBf16ByCvt>(dst, v);
    } else {
        warp_encode<kFmt, kN>(v, dst, col, valid, sink, global_scale, lane);
    }
}

// The lane layout of a span of kSteps steps (see "the row quantizer" above): raw load j = kH * g + h of a lane
// holds values [col_l + g * kGroupSpan + h * 8, +8), col_l = col0 + lane * kN.
template <int kFmt, int kSteps>
struct SpanLayout {
    static constexpr bool kPairs = kFmt != kFmtBf16 && kSteps % 2 == 0;
    static constexpr int kN = kPairs ? 2 * kLaneValues : kLaneValues;  // values per lane per (paired) step
    static constexpr int kH = kN / kLaneValues;                        // raw loads per lane per (paired) step
    static constexpr int kGroups = kSteps / kH;
    static constexpr int kGroupSpan = kWarp * kN;
    static constexpr int kGroupBytes = int(kFmt == kFmtBf16 ? 2 * kGroupSpan
                                                            : (FormatTraits<kFmt>::kPacked ? kGroupSpan / 2
                                                                                           : kGroupSpan));
    __host__ __device__ static constexpr int offset(int j) { return (j / kH) * kGroupSpan + (j % kH) * kLaneValues; }
};

// Encode and store one span from its raw loads (raw[j] as SpanLayout says; loads of lanes or groups past the row
// may hold anything). All 32 lanes call it converged.
template <int kFmt, int kSteps, class Source, class Sink>
__device__ __forceinline__ void warp_encode_span(const Source& src, const typename Source::Raw (&raw)[kSteps],
                                                 int col0, int hidden, uint8_t* __restrict__ payload_row,
                                                 const Sink& sink, float global_scale, int lane) {
    using L = SpanLayout<kFmt, kSteps>;
    const int col_l = col0 + lane * L::kN;
    uint8_t* dst = payload_row + payload_offset<kFmt>(col_l);
    if (col0 + kSteps * kWarpSpan <= hidden) {  // warp-uniform: the whole span lies in the row (the usual case)
#pragma unroll
        for (int g = 0; g < L::kGroups; ++g)
            warp_span_group<kFmt, L::kN>(src, raw + L::kH * g, dst + g * L::kGroupBytes, col_l + g * L::kGroupSpan,
                                         true, sink, global_scale, lane);
        return;
    }
#pragma unroll
    for (int g = 0; g < L::kGroups; ++g) {
        if (col0 + g * L::kGroupSpan >= hidden) break;  // warp-uniform
        const int col = col_l + g * L::kGroupSpan;
        warp_span_group<kFmt, L::kN>(src, raw + L::kH * g, dst + g * L::kGroupBytes, col, col < hidden, sink,
                                     global_scale, lane);
    }
}

// prefetch_next: this warp quantizes the next span of the row (col0 + kSteps * 256 ...) next: each lane asks L2
// for its values of it now (one prefetch per 8- or 16-value group, after this span's loads; lanes past the row's
// end ask for nothing).
template <int kFmt, int kSteps, class Source, class Sink>
__device__ __forceinline__ void warp_quantize_span(const Source& src, int col0, int hidden,
                                                   uint8_t* __restrict__ payload_row, const Sink& sink,
                                                   float global_scale, int lane, bool prefetch_next = false) {
    using L = SpanLayout<kFmt, kSteps>;
    const int col_l = col0 + lane * L::kN;  // this lane's first value
    const Source lsrc = src.at(col_l);      // this lane's values: the loads below take immediate offsets
    typename Source::Raw raw[kSteps];
    if (col0 + kSteps * kWarpSpan <= hidden) {  // warp-uniform: the whole span lies in the row (the usual case)
#pragma unroll
        for (int j = 0; j < kSteps; ++j) raw[j] = lsrc.template load<L::kPairs>(L::offset(j));
        if (prefetch_next) {
#pragma unroll
            for (int g = 0; g < L::kGroups; ++g) {  // only inside the row: the next span may be its short last one
                const int next = kSteps * kWarpSpan + g * L::kGroupSpan;
                if (col_l + next < hidden) lsrc.prefetch(next);
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < kSteps; ++j)
            if (col_l + (j / L::kH) * L::kGroupSpan < hidden) raw[j] = lsrc.template load<L::kPairs>(L::offset(j));
    }
    warp_encode_span<kFmt, kSteps>(src, raw, col0, hidden, payload_row, sink, global_scale, lane);
}

// Convenience: a whole row (col0 = 0 .. hidden) by one warp.
template <int kFmt, int kSteps, class Source, class Sink>
__device__ __forceinline__ void warp_quantize_row(const Source& src, int hidden, uint8_t* __restrict__ payload_row,
                                                  const Sink& sink, float global_scale, int lane) {
    for (int col0 = 0; col0 < hidden; col0 += kSteps * kWarpSpan)
        warp_quantize_span<kFmt, kSteps>(src, col0, hidden, payload_row, sink, global_scale, lane);
}

// The row loops (quantize, fused_silu) prefetch the next span of a row into L2 while the warp works on this one.
// (CUEP_PREFETCH / CUEP_INFLIGHT_BYTES / CUEP_QUANT_STEPS / CUEP_SILU_MIN_BLOCKS override the tuning knobs for A/B
// measurements through CUEP_EXTRA_DEFINES; the defaults are the measured best.)
#ifndef CUEP_PREFETCH
#define CUEP_PREFETCH 1
#endif
constexpr bool kPrefetchNextSpan = CUEP_PREFETCH != 0;

// Steps per span so that each lane keeps about kInFlightBytes of loads in flight.
#ifndef CUEP_INFLIGHT_BYTES
#define CUEP_INFLIGHT_BYTES 64
#endif
constexpr int kInFlightBytes = CUEP_INFLIGHT_BYTES;
template <class Raw>
constexpr int kStepsFor = int(sizeof(Raw)) >= kInFlightBytes ? 1 : kInFlightBytes / int(sizeof(Raw));

// ---- grid-stride work over (row, span) items, one warp per item ------------------------------------------
struct WarpGrid {
    int lane;
    int64_t warp;
    int64_t n_warps;
    __device__ __forceinline__ WarpGrid()
        : lane(threadIdx.x % kWarp),
          warp((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp),
          n_warps(int64_t(gridDim.x) * blockDim.x / kWarp) {}
};

// The (row, span) items (item = row * spans + span) in one contiguous chunk per warp: warp w takes items
// [w * per, (w + 1) * per), per = ceil(items / n_warps), so it walks along its rows and the per-row work (pointers,
// scale rows) is done once per row. Usage:
//   for (ChunkWalk cw(wg, rows, spans); cw.left > 0; cw.next_row()) { per-row setup (cw.row);
//       for (int k = cw.span; k < cw.end_span(); ++k) item (cw.row, k) }
struct ChunkWalk {
    int64_t row;
    int span;      // first span of `row` in this chunk
    int spans;
    int64_t left;  // items left, from (row, span) on
    __device__ __forceinline__ ChunkWalk(const WarpGrid& wg, int64_t rows, int n_spans) : spans(n_spans) {
        const int64_t items = rows * n_spans;
        const int64_t per = (items + wg.n_warps - 1) / wg.n_warps;
        const int64_t first = wg.warp * per;
        left = first < items ? min(per, items - first) : 0;
        row = left > 0 ? first / n_spans : 0;
        span = int(first - row * n_spans);
    }
    __device__ __forceinline__ int end_span() const { return int(min(int64_t(spans), span + left)); }
    __device__ __forceinline__ void next_row() {
        left -= end_span() - span;
        span = 0;
        ++row;
    }
};

// ---- expert groups of the swizzled layout (shared memory) -------------------------------------------------
// Each group g (rows row_offsets[g] .. row_offsets[g+1]) starts a fresh 128-row scale tile:
// tile_start[g] = sum_{j<g} ceil(n_j / 128). One block loads row_offsets (clamped to [0, capacity]) and computes
// tile_start with a block scan; all threads of the block must call it (it syncs). Returns the total tiles.
// `scales_offsets` (uint32 [G], tile_start[g] - row_offsets[g] / 128) is written when not null.
struct SwizzleGroups {
    int* row_offsets;  // smem [G + 1], clamped
    int* tile_start;   // smem [G + 1]; tile_start[G] = tiles used
    int n_groups;

    __device__ __forceinline__ int rows_of(int g) const { return max(row_offsets[g + 1] - row_offsets[g], 0); }
    __device__ __forceinline__ int tiles_of(int g) const { return (rows_of(g) + kScaleTileRows - 1) / kScaleTileRows; }

    // The group holding `row` (< row_offsets[G]): the last g < G with row_offsets[g] <= row.
    __device__ __forceinline__ int find(int row) const {
        int lo = 0, hi = n_groups - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (row_offsets[mid] <= row) lo = mid; else hi = mid - 1;
        }
        return lo;
    }
};

__device__ __forceinline__ void load_swizzle_groups(SwizzleGroups& sg, const int* __restrict__ row_offsets,
                                                    int n_groups, int64_t capacity, int* scan_scratch,
                                                    uint32_t* __restrict__ scales_offsets) {
    sg.n_groups = n_groups;
    const int cap = int(capacity);
    for (int g = threadIdx.x; g <= n_groups; g += blockDim.x) sg.row_offsets[g] = min(max(row_offsets[g], 0), cap);
    __syncthreads();
    int carry = 0;
    for (int g0 = 0; g0 < n_groups; g0 += blockDim.x) {
        const int g = g0 + int(threadIdx.x);
        const int tiles = g < n_groups ? sg.tiles_of(g) : 0;
        int total;
        const int incl = block_inclusive_scan(tiles, scan_scratch, &total);
        if (g < n_groups) sg.tile_start[g] = carry + incl - tiles;
        carry += total;
    }
    if (threadIdx.x == 0) sg.tile_start[n_groups] = carry;
    __syncthreads();
    if (scales_offsets != nullptr && blockIdx.x == 0)
        for (int g = threadIdx.x; g < n_groups; g += blockDim.x)
            scales_offsets[g] = uint32_t(sg.tile_start[g] - sg.row_offsets[g] / kScaleTileRows);
}

// Zero the padding rows (past each group's end) of every used tile; grid-stride over all threads of the grid.
// Padding columns of real rows are written by the row quantizer (SwizzledScales) or the swizzle kernel.
__device__ __forceinline__ void zero_swizzle_padding_rows(const SwizzleGroups& sg, uint8_t* __restrict__ scales,
                                                          int k_tiles, int64_t max_tiles) {
    const int64_t n = int64_t(sg.n_groups) * k_tiles * kScaleTileRows;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int j = int(i % kScaleTileRows);          // row inside the group's last tile
        const int64_t gk = i / kScaleTileRows;
        const int kt = int(gk % k_tiles), g = int(gk / k_tiles);
        const int rows = sg.rows_of(g), tiles = sg.tiles_of(g);
        if (tiles == 0 || (tiles - 1) * kScaleTileRows + j < rows) continue;
        const int64_t tile = int64_t(sg.tile_start[g]) + tiles - 1;
        if (tile >= max_tiles) continue;
        *reinterpret_cast<uint32_t*>(scales + swizzled_scale_offset(tile * kScaleTileRows + j, kt * kScaleTileCols,
                                                                    k_tiles)) = 0u;
    }
}

}  // namespace cuep
