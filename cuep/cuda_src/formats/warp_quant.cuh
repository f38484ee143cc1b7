// The warp-level quantizer every kernel that produces a quantized row reuses (quantize, fused_silu, dispatch):
// per-format traits, the block amax over a group of lanes, the encoders and dequantize8; then how a lane's 8 values
// are loaded (global memory, RowSource) and where the scales go (the sinks: none, per row, transposed, swizzled).
#pragma once
#include "elements.cuh"

namespace cuep {

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
// div_rn_by_nonneg: the quotient alone, for x >= 0 (+0 gives +0); div_rn_by: any x, its sign copied in.
__device__ __forceinline__ float div_rn_by_nonneg(float x, float s, float y) {
    const float q0 = __fmul_rn(x, y);
    const float q1 = __fmaf_rn(__fmaf_rn(-s, q0, x), y, q0);
    return __fmaf_rn(__fmaf_rn(-s, q1, x), y, q1);
}
__device__ __forceinline__ float div_rn_by(float x, float s, float y) {
    return __uint_as_float(__float_as_uint(div_rn_by_nonneg(x, s, y)) | (__float_as_uint(x) & kSignBit));
}

// nvfp4's block multiplier r = g / sfv for scale byte sf, sfv = float(sf) > 0 (sf = +0 gives no number: its
// block's codes are set to +0 by the caller). g in [2**-100, 2**100] keeps the quotient exact (see warp_quantize).
__device__ __forceinline__ float nvfp4_block_r(float g, uint32_t sf) {
    const float sfv = e4m3_to_float(sf);
    return div_rn_by_nonneg(g, sfv, rcp_rn_normal(sfv));
}

// g and nvfp4_block_r(g, sf) for every non-negative scale byte sf (0 .. 0x7E; 0x7F, NaN, cannot occur), in shared
// memory: a kernel that quantizes many blocks to nvfp4 fills it once (nvfp4_table_fill) and passes it as the
// global scale, so each block reads r instead of computing it (about ten instructions a block).
struct Nvfp4Table {
    float g;
    const float* r;  // [128]
};
__device__ __forceinline__ float global_scale_value(float g) { return g; }
__device__ __forceinline__ float global_scale_value(const Nvfp4Table& t) { return t.g; }
__device__ __forceinline__ float nvfp4_block_r(const Nvfp4Table& t, uint32_t sf) { return t.r[sf & 0x7Fu]; }
// All threads of the block call it; __syncthreads() before the first use of the table.
__device__ __forceinline__ void nvfp4_table_fill(float* r, float g) {
    for (int i = threadIdx.x; i < 128; i += blockDim.x) r[i] = i ? nvfp4_block_r(g, uint32_t(i)) : 0.0f;
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

// e2m1 codes of scaled(x_i), eight per word: biased (e2m1_biased, or E2m1Pow2 with the scaling folded in) of
// each pre(x_i).
template <int kN, class Pre, class Biased>
__device__ __forceinline__ void fp4_encode_with(const float (&v)[kN], const Pre& pre, const Biased& biased,
                                                uint32_t (&w)[kN / 8]) {
#pragma unroll
    for (int k = 0; k < kN / 8; ++k) {
        float y[kLaneValues];
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) y[i] = pre(v[8 * k + i]);
        w[k] = e2m1x8_pack(y, biased);
    }
}

// e2m1 codes of x_i * m (nvfp4: m = r, mxfp4: m = 2**-e), eight per word.
template <int kN>
__device__ __forceinline__ void fp4_encode(const float (&v)[kN], float m, uint32_t (&w)[kN / 8]) {
    fp4_encode_with(v, [m](float x) { return __fmul_rn(x, m); }, [](float y) { return e2m1_biased(y); }, w);
}

// e2m1 codes of x_i * 2**-e (mxfp4, e in [-126, 126]: E2m1Pow2), eight per word.
template <int kN>
__device__ __forceinline__ void fp4_encode_pow2(const float (&v)[kN], int e, uint32_t (&w)[kN / 8]) {
    fp4_encode_with(v, [](float x) { return x; }, E2m1Pow2(e), w);
}

// Quantize this lane's kN (8 or 16) consecutive values; a scale block is an aligned group of kBlock / kN lanes.
// Subnormal values need not be flushed first: they are read only through fabsf, fmaxf, div.rn.ftz / fma.rn.ftz /
// mul.rn.ftz, which flush them under -ftz=true as the contract's "flush x first" does.
// Called by ALL 32 lanes of the warp, converged: lanes whose values lie past the row pass zeros (their block is
// then entirely out of the row, since blocks are aligned lane groups) and discard the result.
template <int kFmt, int kN, class GScale>
__device__ __forceinline__ QuantN<kFmt, kN> warp_quantize(const float (&v)[kN], GScale gscale) {
    const float global_scale = global_scale_value(gscale);
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
        const float s = div_rn_by_nonneg(fmaxf(amax, kFp8AmaxFloor), kFp8Max, kFp8MaxRcp);  // >= 2.2e-7
        fp8_encode(v, s, rcp_rn_normal(s), q.payload.w);  // s is normal, in [2.2e-7, 7.6e35]
        q.scale = s;
    } else if constexpr (kFmt == kFmtNvfp4) {
        // t = (g * amax) / 6; sf = cvt_e4m3(t); sfv = float(sf); sfv == 0: codes +0; else r = g / sfv,
        // q_i = cvt_e2m1(x_i * r). g * amax is clamped to 4096 first: e4m3 saturates from t = 464 on, so sf is
        // the same, and the quotient stays finite; t below 2**-10 (where div_rn_by may be an ulp off) is code 0
        // either way. g in [2**-100, 2**100] (checked by the API) keeps g / sfv (sfv in [2**-9, 448]) exact.
        const float t = div_rn_by_nonneg(fminf(__fmul_rn(global_scale, amax), 4096.0f), kE2m1Max, kE2m1MaxRcp);
        const uint32_t sf = e4m3_encode(t);  // t >= 0: sf in [0, 0x7E]
        fp4_encode(v, nvfp4_block_r(gscale, sf), q.payload.w);
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
        // The multiply is folded into the e2m1 lines (fp4_encode_pow2, one instruction a value less) unless a
        // block of the warp has e = -127 (amax < 2**-124), whose 2**(1 - e) would overflow.
        if (__any_sync(0xFFFFFFFFu, e == -127))
            fp4_encode(v, pow2_from_biased(uint32_t(127 - e)), q.payload.w);
        else
            fp4_encode_pow2(v, e, q.payload.w);
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

// 8 values from raw loads: bf16 (one uint4) or float32 (two uint4), as they are (subnormals kept: the quantizers'
// arithmetic flushes them, see RowSource).
__device__ __forceinline__ void bf16x8_values(const uint4& w, float (&v)[kLaneValues]) {
    bf16x2_to_float(w.x, v[0], v[1]);
    bf16x2_to_float(w.y, v[2], v[3]);
    bf16x2_to_float(w.z, v[4], v[5]);
    bf16x2_to_float(w.w, v[6], v[7]);
}

__device__ __forceinline__ void f32x8_values(const uint4& a, const uint4& b, float (&v)[kLaneValues]) {
    unpack_f32x4(a, v);
    unpack_f32x4(b, v + 4);
}

// warp_quantize<kFmtMxfp4> of kN bf16 values given as their raw words x[kN / 8] (a bf16 row's loads), into *q:
// the same codes and scale, the e2m1 lines on bf16 pairs (E2m1Bf16x2Pow2: about half the instructions a value).
// Returns false, *q unset, when a block of the warp has e < kE2m1Bf16MinE (amax < 2**-98): the caller takes the
// float32 lines (warp-uniform). All 32 lanes, converged.
template <int kN>
__device__ __forceinline__ bool warp_quantize_mxfp4_bf16(const uint4 (&x)[kN / kLaneValues],
                                                         QuantN<kFmtMxfp4, kN>* q) {
    constexpr int kLanes = kMxfp4Block / kN;
    uint32_t m = 0u;  // |x| pairs, max.bf16x2 (a NaN gives the other operand)
#pragma unroll
    for (int h = 0; h < kN / kLaneValues; ++h)
        m = bf16x2_max(bf16x2_max(bf16x2_max(m, x[h].x & kBf16x2Abs), x[h].y & kBf16x2Abs),
                       bf16x2_max(x[h].z & kBf16x2Abs, x[h].w & kBf16x2Abs));
    // float32 max.ftz of the two halves: a subnormal amax counts as 0 (E = -127 either way)
    const float amax = group_amax<kLanes>(fmaxf(__uint_as_float(m << 16), __uint_as_float(m & 0xFFFF0000u)));
    const int e = max(int(__float_as_uint(amax) >> 23 & 0xFFu) - 129, -127);
    if (__any_sync(0xFFFFFFFFu, e < kE2m1Bf16MinE)) return false;
    q->leader = (threadIdx.x % kLanes) == 0;
    const E2m1Bf16x2Pow2 lines(e);
#pragma unroll
    for (int h = 0; h < kN / kLaneValues; ++h) q->payload.w[h] = e2m1x8_pack_bf16(x[h], lines);
    q->scale = uint8_t(e + 127);
    return true;
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

template <class T>
__device__ __forceinline__ void values8(const Raw8<T>& r, float (&v)[kLaneValues]) {
    if constexpr (sizeof(T) == 2)
        bf16x8_values(r.w[0], v);
    else
        f32x8_values(r.w[0], r.w[1], v);
}

// ---- sources: where a lane's 8 values come from ----------------------------------------------------------
// A Source has `Source at(col) const` (the source shifted to start at value col >= 0), `void prefetch(col) const`
// (L2 prefetch of the line(s) holding value col: this lane's values of a later span),
// `template <bool kL1> Raw load(col) const` (issue the loads of values [col, col + 8) of its row; kL1: through
// L1) and `void values(const Raw&, float (&)[8]) const` (turn them into the values to quantize);
// splitting the two lets warp_quantize_span keep several steps of loads in flight before the first use.
// kBf16ByCvt: the values are flushed and a NaN among them may become any bf16 NaN, so the bf16 "format" may use
// the hardware conversion (cvt.rn.bf16x2.f32) instead of bf16_encode.
// The values come as they are, subnormals kept: the quantizers read them only through max.ftz, div.rn.ftz,
// mul.rn.ftz and fma.rn.ftz (-ftz=true), which flush them to zero of the same sign exactly as the contract's "flush
// x first" does (quantize and dispatch tested with subnormal inputs; flushing here first cost a dispatch's encode
// two instructions a value), and the bf16 "format" must not flush at all.
template <class T>
struct RowSource {
    using Raw = Raw8<T>;
    static constexpr bool kBf16ByCvt = false;
    static constexpr bool kRawBf16 = sizeof(T) == 2;  // Raw is the values' bf16 bits (warp_quantize_mxfp4_bf16)
    const T* row;
    // The source of values [col, ...) of the row (col >= 0): loads relative to it use immediate offsets.
    __device__ __forceinline__ RowSource at(int col) const { return RowSource{row + unsigned(col)}; }
    // L2 prefetch of the line holding value col (this lane's values of a later span).
    __device__ __forceinline__ void prefetch(int col) const { prefetch_l2(row + col); }
    template <bool kL1 = false>
    __device__ __forceinline__ Raw load(int col) const { return load8<T, kL1>(row + col); }
    __device__ __forceinline__ void values(const Raw& r, float (&v)[kLaneValues]) const { values8(r, v); }
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
        if (row_base != nullptr && leader && c < n_cols)
            row_base[(c / kScaleTileCols) * kScaleTileBytes + c % kScaleTileCols] = valid ? s : uint8_t(0);
    }
};

}  // namespace cuep
