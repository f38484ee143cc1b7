// Element codecs of the wire formats, bit-exact with docs/formats.md: the constants (mirrored in cuep/formats.py),
// bf16, e4m3 and e2m1 encode / decode, powers of two, FTZ, fused_silu's float32 silu, and the 128x4 swizzled
// scale offset. Every float32 operation of the contract is an explicit round-to-nearest intrinsic (formats.cuh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include "../common.cuh"

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
// Magnitude, with a = min(|v|, 6) (FMNMX.FTZ: NaN -> 6, Inf -> 6, subnormal -> 0): the code is linear in a on each
// of the grid's three step sizes, code = 2a on [0, 2], a + 2 on [2, 4], a / 2 + 4 on [4, 6], and the smallest of
// the three lines everywhere (they meet at a = 2 and a = 4). Each line plus M = 1.5 * 2**23 (ulp 1) is rounded
// once to an integer, ties to even (one FMA or add: 2a and a / 2 are exact), and rounding commutes with the min
// (monotone), so min(t1, t2, t3) = M + code and its bits are bits(M) + code; a tie on a line is a tie between two
// grid values and goes to the even code, as the grid's round-to-nearest-even does.
// Identical to cuep.reference.quant.e2m1_encode over all 2**32 float32 bit patterns: scripts/check_exhaustive.py
// (e2m1) runs a NumPy emulation of exactly these operations over all of them. The sums are normal numbers (FTZ
// changes nothing).
constexpr uint32_t kE2m1Bias = 0x4B400000u;  // bits(1.5 * 2**23): e2m1_biased(v) - kE2m1Bias = the magnitude code

// code + kE2m1Bias (mod 2**32), magnitude only: the sign is added by the callers. 3 FP ops and 2 FMNMX a value
// (the split it replaces took 5 and a LEA.HI).
__device__ __forceinline__ uint32_t e2m1_biased(float v) {
    const float a = fminf(fabsf(v), kE2m1Max);
    const float t1 = __fmaf_rn(a, 2.0f, 0x1.8p+23f);         // rint(2a) + M
    const float t2 = __fadd_rn(a, 0x1.8p+23f + 2.0f);        // rint(a + 2) + M
    const float t3 = __fmaf_rn(a, 0.5f, 0x1.8p+23f + 4.0f);  // rint(a / 2 + 4) + M
    return __float_as_uint(fminf(fminf(t1, t2), t3));
}

__device__ __forceinline__ uint32_t e2m1_encode(float v) {
    return (e2m1_biased(v) - kE2m1Bias) | (__float_as_uint(v) >> 28 & 8u);
}

// The magnitude of x * 2**-e without the multiply (mxfp4: 2**-e is the block's exact multiplier), for e in
// [-126, 126]: a = min(|x|, 6 * 2**e) and the three lines take 2**-e into their FMAs (2a -> a * 2**(1-e), ...).
// Scaling by a power of two is exact and monotone, so a * 2**-e = min(|x| * 2**-e, 6) exactly and each FMA rounds
// the same sum as e2m1_biased's; where the reference's product x * 2**-e is subnormal (flushed to 0: code 0),
// the FMA's exact product is below 2**-126 and the sum rounds to M (code 0) too. e = -127 needs 2**128: callers
// multiply first there (e2m1_biased). e = 126 (a non-finite block: unspecified) gives some code.
struct E2m1Pow2 {
    float clamp, m2, m1, mh;  // 6 * 2**e, 2**(1-e), 2**-e, 2**(-1-e)
    __device__ __forceinline__ explicit E2m1Pow2(int e)
        : clamp(__uint_as_float(uint32_t(e + 129) << 23 | 0x400000u)),
          m2(pow2_from_biased(uint32_t(128 - e))),
          m1(pow2_from_biased(uint32_t(127 - e))),
          mh(pow2_from_biased(uint32_t(126 - e))) {}
    __device__ __forceinline__ uint32_t operator()(float x) const {
        const float a = fminf(fabsf(x), clamp);
        const float t1 = __fmaf_rn(a, m2, 0x1.8p+23f);
        const float t2 = __fmaf_rn(a, m1, 0x1.8p+23f + 2.0f);
        const float t3 = __fmaf_rn(a, mh, 0x1.8p+23f + 4.0f);
        return __float_as_uint(fminf(fminf(t1, t2), t3));
    }
};

// Eight codes packed into a word, element i in nibble i (element 2i in the low nibble of byte i). The biased
// magnitudes (biased(v_i): e2m1_biased or E2m1Pow2) are summed into place (the bias of all eight cancels in one
// constant, no carries: each code <= 7); the sign bits are gathered with funnel shifts of the raw bits (the top
// nibble of each, masked once).
template <class Biased>
__device__ __forceinline__ uint32_t e2m1x8_pack(const float (&v)[kLaneValues], const Biased& biased) {
    uint32_t mag = 0u - kE2m1Bias * 0x11111111u;
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i) mag += biased(v[i]) << (4 * i);
    uint32_t sign = __float_as_uint(v[kLaneValues - 1]) >> 28;
#pragma unroll
    for (int i = kLaneValues - 2; i >= 0; --i) sign = __funnelshift_l(__float_as_uint(v[i]), sign, 4);
    return mag | (sign & 0x88888888u);
}

__device__ __forceinline__ uint32_t e2m1x8_encode(const float (&v)[kLaneValues]) {
    return e2m1x8_pack(v, [](float x) { return e2m1_biased(x); });
}

// ---- mxfp4 from bf16: the e2m1 lines on bf16 pairs ---------------------------------------------------------
// E2m1Pow2's lines on two bf16 values at once (fma.rn / min.bf16x2), for bf16 x: a = min(|x|, 6 * 2**e) is exact
// in bf16, and each line a * 2**(1-e) + M (M = 1.5 * 2**7 = 192, bf16 ulp 1 on [128, 256), the sums at most 204) is
// rounded once to an integer, ties to even, as in float32: the minimum's bits are bits(M) + code in each half.
// min.bf16x2 returns the other operand for a NaN (|x| NaN: code 7, as the reference), so a NaN or Inf gives the
// float32 lines' code. bf16 arithmetic keeps subnormals (no FTZ): a subnormal x would count |x| * 2**-e where the
// contract flushes x to 0, so callers take this path only for e >= kE2m1Bf16MinE (then |x| * 2**-e < 2**-26: code
// 0 either way). scripts/check_exhaustive.py e2m1bf16 emulates it for every bf16 x and every such e.
constexpr int kE2m1Bf16MinE = -100;
__device__ __forceinline__ uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ uint32_t bf16x2_min(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("min.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ uint32_t bf16x2_max(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
constexpr uint32_t kBf16x2Abs = 0x7FFF7FFFu;
struct E2m1Bf16x2Pow2 {
    uint32_t clamp, m2, m1, mh;  // both halves: 6 * 2**e, 2**(1-e), 2**-e, 2**(-1-e) (e in [kE2m1Bf16MinE, 125])
    __device__ __forceinline__ static uint32_t both(uint32_t h) { return h | h << 16; }
    __device__ __forceinline__ explicit E2m1Bf16x2Pow2(int e)
        : clamp(both(uint32_t(e + 129) << 7 | 0x40u)),
          m2(both(uint32_t(128 - e) << 7)),
          m1(both(uint32_t(127 - e) << 7)),
          mh(both(uint32_t(126 - e) << 7)) {}
    // bf16 bits 0x4340 + code of each half's magnitude (x2: two bf16 values)
    __device__ __forceinline__ uint32_t operator()(uint32_t x2) const {
        const uint32_t a = bf16x2_min(x2 & kBf16x2Abs, clamp);
        const uint32_t t1 = bf16x2_fma(a, m2, 0x43404340u);
        const uint32_t t2 = bf16x2_fma(a, m1, 0x43424342u);
        const uint32_t t3 = bf16x2_fma(a, mh, 0x43444344u);
        return bf16x2_min(bf16x2_min(t1, t2), t3);
    }
};

// Eight e2m1 codes of 8 bf16 values (x: their raw words, element 2i in the low half of word i) times 2**-e, packed
// as e2m1x8_pack packs them: each code's low byte 0x40 + code gathered a byte per value (PRMT), the bias off, the
// sign (bit 7 of each value's high byte) to bit 3, then two bytes' nibbles into one.
__device__ __forceinline__ uint32_t e2m1x8_pack_bf16(const uint4& x, const E2m1Bf16x2Pow2& lines) {
    uint32_t lo = __byte_perm(lines(x.x), lines(x.y), 0x6420) - 0x40404040u;  // codes of values 0..3, a byte each
    uint32_t hi = __byte_perm(lines(x.z), lines(x.w), 0x6420) - 0x40404040u;  // values 4..7
    lo |= __byte_perm(x.x, x.y, 0x7531) >> 4 & 0x08080808u;
    hi |= __byte_perm(x.z, x.w, 0x7531) >> 4 & 0x08080808u;
    return __byte_perm(lo | lo >> 4, hi | hi >> 4, 0x6420);
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

//
// Two steps cost one instruction each instead of two (same bits):
// * ax = min(|g|, 88) = -x (one FMNMX with an |operand|; NaN -> 88); the FMAs read -ax (a free operand negation).
// * e = p * 2**n as one integer add of n to p's exponent field: bits(e) = bits(p) + (bits(t) << 23), since the low
//   bits of t are n + 2**22 and (bits(t) << 23) = n << 23 (mod 2**32). p is in [0.7, 1.42] (|r| <= 0.35), so for
//   n >= -125 the product is a normal float32 and the add is exact and equal to it. For n = -126 and p < 1 the product
//   is subnormal (flushed to +0) and the add gives the positive subnormal of the same bits; for n = -127 (only for
//   x in [-88, -87.68], where r >= 0.0297, so p >= 1) the product is +0 and the add gives a positive subnormal
//   (bits(p) - bits(1.0)). Both consumers of e (1 + e: add.ftz; g * e: mul.ftz) flush a subnormal operand to +0,
//   so every result equals the contract's (scripts/check_exhaustive.py silu checks all x in [-88, -85]).
__device__ __forceinline__ float silu_f32(float g) {
    const float ax = fminf(fabsf(g), -kSiluXMin);  // -x, x = max(-|g|, -88) of the contract
    const float t = __fmaf_rn(-ax, kSiluLog2e, kSiluRint);
    const float n = __fsub_rn(t, kSiluRint);
    const float r = __fmaf_rn(n, -kSiluLn2Lo, __fmaf_rn(n, -kSiluLn2Hi, -ax));
    float p = kSiluC6;
    p = __fmaf_rn(p, r, kSiluC5);
    p = __fmaf_rn(p, r, kSiluC4);
    p = __fmaf_rn(p, r, kSiluC3);
    p = __fmaf_rn(p, r, kSiluC2);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    const float e = __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));  // p * 2**n, see above
    const float s = rcp_rn_normal(__fadd_rn(1.0f, e));
    return __fmul_rn(g < 0.0f ? __fmul_rn(g, e) : g, s);
}

// ---- swizzled (128x4 tiled) block scales ---------------------------------------------------------------
// Byte offset of scale (row, col) in the 128x4-tiled layout (docs/formats.md; cuep.formats.swizzled_scale_offset).
__host__ __device__ __forceinline__ constexpr int64_t swizzled_scale_offset(int64_t row, int col, int k_tiles) {
    return ((row / kScaleTileRows) * k_tiles + col / kScaleTileCols) * kScaleTileBytes + (row % 32) * 16 +
           ((row % kScaleTileRows) / 32) * 4 + col % kScaleTileCols;
}

}  // namespace cuep
