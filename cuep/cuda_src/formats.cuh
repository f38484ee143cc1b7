// cuep wire formats on the device: the bit-exact rules of docs/formats.md (the NumPy oracle is cuep.reference).
//
// Element primitives (e4m3, e2m1, bf16, powers of two, FTZ), the 128x4 swizzled scale offset, and a WARP-level
// quantizer that every kernel producing a quantized row reuses (quantize, fused_silu, and later dispatch):
//
//   each lane holds 8 consecutive values of a row (one 16-byte bf16 load, two for float32); a warp step covers
//   256 values; a scale block is an aligned group of lanes (fp8: 16 lanes, nvfp4: 2, mxfp4: 4); the block amax is
//   reduced with __shfl_xor_sync inside that group; every lane writes its own payload bytes and the block's first
//   lane (the leader) its scale.
//
// Arithmetic: every float32 multiply and divide of the contract is an explicit __fmul_rn / __fdiv_rn (and the
// double ones of fused_silu __dadd_rn / __ddiv_rn), IEEE round-to-nearest and never contracted into an FMA, so
// -fmad cannot change a result. CuPy compiles with -ftz=true: these, fabsf and fmaxf flush subnormal operands and
// results to zero of the same sign, which is the contract's FTZ policy (the PTX shows div.rn.ftz, mul.rn.ftz,
// max.ftz). Conversions the flag does not cover are done with bit operations (bf16, e4m3/e2m1 decode, ftz()).
#pragma once
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

// ---- e2m1 ---------------------------------------------------------------------------------------------------
// cvt_e2m1 of docs/formats.md: round to nearest even on {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6; the sign
// bit (0x8) is the sign bit of v (-0.0 and tiny negatives give 0x8); NaN gives magnitude 7, as the reference.
// The threshold rule is a round to nearest even on the grid of |v|'s range: [0, 2) has step 0.5 (codes 0..4),
// [2, 4) step 1 (codes 4..6), [4, 6] step 2 (codes 6..7). Adding 2**22 / 2**23 / 2**24 (whose ulp is that step)
// does the rounding in one float addition, and its ties to even are exactly the contract's even codes
// (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0). Checked against the
// reference over all 2**32 float32 bit patterns. fminf(NaN, 6) = 6 gives NaN the top code; fabsf flushes
// subnormals (ftz), which the thresholds send to 0 anyway.
__device__ __forceinline__ uint32_t e2m1_encode(float v) {
    const float a = fminf(fabsf(v), kE2m1Max);
    const bool lo = a < 2.0f, mid = a < 4.0f;
    const float magic = lo ? 0x1p22f : (mid ? 0x1p23f : 0x1p24f);
    const uint32_t first_code = lo ? 0u : (mid ? 2u : 4u);
    const float t = __fadd_rn(a, magic);
    return (__float_as_uint(t) - __float_as_uint(magic) + first_code) | (__float_as_uint(v) >> 28 & 8u);
}

// e2m1 code (0..15) -> float32, exact (code 8 is -0.0).
__device__ __forceinline__ float e2m1_decode(uint32_t code) {
    const uint32_t exp = code >> 1 & 3u, man = code & 1u;
    const uint32_t mag = exp ? ((exp + 126u) << 23 | man << 22) : (man ? 0x3F000000u : 0u);  // 0x3F000000 = 0.5
    return __uint_as_float((code & 8u) << 28 | mag);
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

template <int kFmt>
constexpr int kLanesPerBlock = FormatTraits<kFmt>::kBlock / kLaneValues;  // fp8 16, nvfp4 2, mxfp4 4

// Payload byte offset of value `col` of a row.
template <int kFmt>
__device__ __forceinline__ int64_t payload_offset(int64_t col) {
    return kFmt == kFmtBf16 ? col * 2 : (FormatTraits<kFmt>::kPacked ? col / 2 : col);
}

// amax over an aligned group of kLanes lanes (butterfly: every lane of the group ends with the same value).
// Non-NaN inputs are >= 0, so the max is exact whatever the order.
template <int kLanes>
__device__ __forceinline__ float group_amax(float a) {
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

template <int kFmt>
struct Quant8 {
    typename FormatTraits<kFmt>::Payload payload;  // this lane's 8 values, encoded
    typename FormatTraits<kFmt>::Scale scale;      // its block's scale (the same in every lane of the block)
    bool leader;                                   // first lane of its block: the one that stores the scale
};

// Quantize this lane's 8 values. Subnormal values need not be flushed first: they are read only through fabsf,
// fmaxf, __fdiv_rn and __fmul_rn, which flush them under -ftz=true as the contract's "flush x first" does.
// Called by ALL 32 lanes of the warp, converged: lanes whose values lie past the row pass zeros (their block is
// then entirely out of the row, since blocks are aligned lane groups) and discard the result.
template <int kFmt>
__device__ __forceinline__ Quant8<kFmt> warp_quantize8(const float (&v)[kLaneValues], float global_scale) {
    static_assert(kFmt == kFmtFp8 || kFmt == kFmtNvfp4 || kFmt == kFmtMxfp4, "a scaled format");
    constexpr int kLanes = kLanesPerBlock<kFmt>;
    Quant8<kFmt> q;
    q.leader = (threadIdx.x % kLanes) == 0;
    float a = fabsf(v[0]);  // abs.ftz / max.ftz: subnormals count as 0, as the contract's flushed x
#pragma unroll
    for (int i = 1; i < kLaneValues; ++i) a = fmaxf(a, fabsf(v[i]));
    const float amax = group_amax<kLanes>(a);

    if constexpr (kFmt == kFmtFp8) {
        // s = max(amax, 1e-4) / 448; q_i = cvt_e4m3(x_i / s) (IEEE divisions, never a reciprocal multiply).
        const float s = __fdiv_rn(fmaxf(amax, kFp8AmaxFloor), kFp8Max);
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = e4m3x2_encode(__fdiv_rn(v[2 * i], s), __fdiv_rn(v[2 * i + 1], s));
        q.payload = make_uint2(w[0] | w[1] << 16, w[2] | w[3] << 16);
        q.scale = s;
    } else if constexpr (kFmt == kFmtNvfp4) {
        // t = (g * amax) / 6; sf = cvt_e4m3(t); sfv = float(sf); sfv == 0: codes +0; else r = g / sfv,
        // q_i = cvt_e2m1(x_i * r).
        const float t = __fdiv_rn(__fmul_rn(global_scale, amax), kE2m1Max);
        const uint32_t sf = e4m3_encode(t);
        const float sfv = e4m3_decode(sf);
        uint32_t codes = 0;
        if (sfv != 0.0f) {
            const float r = __fdiv_rn(global_scale, sfv);
#pragma unroll
            for (int i = 0; i < kLaneValues; ++i) codes |= e2m1_encode(__fmul_rn(v[i], r)) << (4 * i);
        }
        q.payload = codes;
        q.scale = uint8_t(sf);
    } else {
        // E = unbiased exponent of amax (amax = 0 gives -127); e = max(E - 2, -127); scale byte e + 127;
        // q_i = cvt_e2m1(x_i * 2**-e), 2**-e exact and normal (e in [-127, 126]).
        const int big_e = int(__float_as_uint(amax) >> 23 & 0xFFu) - 127;
        const int e = max(big_e - 2, -127);
        const float m = pow2_from_biased(uint32_t(127 - e));
        uint32_t codes = 0;
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) codes |= e2m1_encode(__fmul_rn(v[i], m)) << (4 * i);
        q.payload = codes;
        q.scale = uint8_t(e + 127);
    }
    return q;
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

template <class T>
__device__ __forceinline__ Raw8<T> load8(const T* p) {
    Raw8<T> r;
#pragma unroll
    for (int i = 0; i < Raw8<T>::kWords; ++i) r.w[i] = load16_nc(reinterpret_cast<const uint4*>(p) + i);
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
// A Source has `Raw load(col) const` (issue the loads of values [col, col + 8) of its row) and
// `void values(const Raw&, float (&)[8]) const` (turn them into the values to quantize); splitting the two lets
// warp_quantize_span keep several steps of loads in flight before the first use.
// kFlush: flush subnormal inputs with bit operations. The quantizers do not need it: they read values only through
// max.ftz, div.rn.ftz and mul.rn.ftz (-ftz=true), which flush them to zero of the same sign exactly as the
// contract's "flush x first" does (tested with subnormal inputs); the bf16 "format" must not flush at all.
template <class T, bool kFlush>
struct RowSource {
    using Raw = Raw8<T>;
    const T* row;
    __device__ __forceinline__ Raw load(int col) const { return load8(row + col); }
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
        if (leader && valid) base[c * ld + row] = s;
    }
};

// nvfp4 / mxfp4 dispatch / fused_silu layout: 128x4 tiles. The 4 scales of one tile row (columns 4k..4k+3) are
// gathered with shuffles and stored as one 4-byte word by the lane of column 4k; columns past H/block come from
// lanes past the row, whose scale is 0, so the padding columns of every written row are zero-filled here.
// `enabled` = false (a row outside every group: bad row_offsets) writes nothing.
template <int kFmt>
struct SwizzledScales {
    uint8_t* base;
    int64_t scale_row;  // R
    int k_tiles;
    bool enabled;
    __device__ __forceinline__ void put(int lane, int c, uint8_t s, bool, bool valid) const {
        constexpr int kLanes = kLanesPerBlock<kFmt>;
        constexpr int kGroupLanes = kScaleTileCols * kLanes;
        const int first = lane & ~(kGroupLanes - 1);
        uint32_t word = 0;
#pragma unroll
        for (int k = 0; k < kScaleTileCols; ++k)
            word |= uint32_t(__shfl_sync(0xffffffffu, uint32_t(s), first + k * kLanes)) << (8 * k);
        if (enabled && valid && lane == first)
            *reinterpret_cast<uint32_t*>(base + swizzled_scale_offset(scale_row, c, k_tiles)) = word;
    }
};

// ---- the row quantizer ----------------------------------------------------------------------------------
// Quantize values [col0, col0 + kSteps * 256) of one row (clipped to `hidden`) into `payload_row`, scales to
// `sink`. All 32 lanes call it converged; col0 is a multiple of 256. All kSteps loads are issued before the
// first is used. bf16 "format": 16-byte bf16 stores, no scales.
template <int kFmt, int kSteps, class Source, class Sink>
__device__ __forceinline__ void warp_quantize_span(const Source& src, int col0, int hidden,
                                                   uint8_t* __restrict__ payload_row, const Sink& sink,
                                                   float global_scale, int lane) {
    typename Source::Raw raw[kSteps];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
        const int col = col0 + s * kWarpSpan + lane * kLaneValues;
        if (col < hidden) raw[s] = src.load(col);
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
        const int base = col0 + s * kWarpSpan;
        if (base >= hidden) break;  // warp-uniform
        const int col = base + lane * kLaneValues;
        const bool valid = col < hidden;
        float v[kLaneValues];
        if (valid) {
            src.values(raw[s], v);
        } else {
#pragma unroll
            for (int i = 0; i < kLaneValues; ++i) v[i] = 0.0f;
        }
        uint8_t* dst = payload_row + payload_offset<kFmt>(col);
        if constexpr (kFmt == kFmtBf16) {
            if (valid)
                *reinterpret_cast<uint4*>(dst) = make_uint4(bf16x2_encode(v[0], v[1]), bf16x2_encode(v[2], v[3]),
                                                            bf16x2_encode(v[4], v[5]), bf16x2_encode(v[6], v[7]));
        } else {
            const Quant8<kFmt> q = warp_quantize8<kFmt>(v, global_scale);
            if (valid) *reinterpret_cast<typename FormatTraits<kFmt>::Payload*>(dst) = q.payload;
            sink.put(lane, col / FormatTraits<kFmt>::kBlock,
                     valid ? q.scale : typename FormatTraits<kFmt>::Scale(0), q.leader, valid);
        }
    }
}

// Convenience: a whole row (col0 = 0 .. hidden) by one warp.
template <int kFmt, int kSteps, class Source, class Sink>
__device__ __forceinline__ void warp_quantize_row(const Source& src, int hidden, uint8_t* __restrict__ payload_row,
                                                  const Sink& sink, float global_scale, int lane) {
    for (int col0 = 0; col0 < hidden; col0 += kSteps * kWarpSpan)
        warp_quantize_span<kFmt, kSteps>(src, col0, hidden, payload_row, sink, global_scale, lane);
}

// Steps per span so that each lane keeps about kInFlightBytes of loads in flight.
constexpr int kInFlightBytes = 64;
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
