// quantize / dequantize token rows (cuep.ops.quantize, cuep.ops.dequantize) and the 128x4 scale swizzle
// (cuep.ops.swizzle_block_scales). Bit-exact to cuep.reference (docs/formats.md).
//
// Work: one warp per (row, span) item, grid-stride; a span is kSteps warp steps of 256 values, so every lane has
// kSteps 16-byte loads in flight before its first use. Launch: blocks of kQuantizeThreads, grid from the SM count.
#include "common.cuh"
#include "formats.cuh"

namespace cuep {

// x [n_rows, hidden] (T = bf16_t or float) -> payload uint8 [n_rows, payload_bytes], scales uint8
// [n_rows, scale_bytes] (fp8 float32, nvfp4 e4m3, mxfp4 e8m0). bf16 format: payload = bf16 of x (no flush).
template <int kFmt, class T>
__device__ __forceinline__ void quantize_rows(const T* __restrict__ x, uint8_t* __restrict__ payload,
                                              uint8_t* __restrict__ scales, int64_t n_rows, int hidden,
                                              float global_scale) {
    using Src = RowSource<T>;  // see RowSource: the quantizers' arithmetic flushes, bf16 must not
    using Scale = typename FormatTraits<kFmt>::Scale;
#ifndef CUEP_QUANT_STEPS
#define CUEP_QUANT_STEPS 2
#endif
    constexpr int kSteps = CUEP_QUANT_STEPS;  // 2: 16 values per lane (paired steps); the next span prefetched into L2
    constexpr int kSpan = kSteps * kWarpSpan;
    const WarpGrid wg;
    const int spans = (hidden + kSpan - 1) / kSpan;
    const int64_t payload_bytes = payload_offset<kFmt>(hidden);
    int64_t scale_bytes = 0;
    if constexpr (kFmt != kFmtBf16) scale_bytes = int64_t(hidden / FormatTraits<kFmt>::kBlock) * sizeof(Scale);
    if (spans == 0) return;
    for (ChunkWalk cw(wg, n_rows, spans); cw.left > 0; cw.next_row()) {
        const Src src{x + cw.row * hidden};
        uint8_t* prow = payload + cw.row * payload_bytes;
        const int end = cw.end_span();
        for (int k = cw.span; k < end; ++k) {
            const bool prefetch = kPrefetchNextSpan && k + 1 < end;
            if constexpr (kFmt == kFmtBf16) {
                warp_quantize_span<kFmt, kSteps>(src, k * kSpan, hidden, prow, NoScales{}, global_scale, wg.lane,
                                                 prefetch);
            } else {
                const RowScales<Scale> sink{reinterpret_cast<Scale*>(scales + cw.row * scale_bytes)};
                warp_quantize_span<kFmt, kSteps>(src, k * kSpan, hidden, prow, sink, global_scale, wg.lane,
                                                 prefetch);
            }
        }
    }
}

// payload + per-row scales -> float32 [n_rows, hidden]; per lane 8 values, two 16-byte stores.
template <int kFmt>
__device__ __forceinline__ void dequantize_rows(const uint8_t* __restrict__ payload,
                                                const uint8_t* __restrict__ scales, float* __restrict__ out,
                                                int64_t n_rows, int hidden, float global_scale) {
    using Payload = typename FormatTraits<kFmt>::Payload;
    using Scale = typename FormatTraits<kFmt>::Scale;
    constexpr int kSteps = 4;
    constexpr int kSpan = kSteps * kWarpSpan;
    constexpr int kBlock = kFmt == kFmtBf16 ? 1 : FormatTraits<kFmt>::kBlock;
    const WarpGrid wg;
    const int spans = (hidden + kSpan - 1) / kSpan;
    const int64_t payload_bytes = payload_offset<kFmt>(hidden);
    const int64_t n_scales = kFmt == kFmtBf16 ? 0 : hidden / kBlock;
    const int64_t items = n_rows * spans;
    for (int64_t it = wg.warp; it < items; it += wg.n_warps) {
        const int64_t row = it / spans;
        const int col0 = int(it - row * spans) * kSpan;
        const uint8_t* prow = payload + row * payload_bytes;
        const Scale* srow = reinterpret_cast<const Scale*>(scales) + row * n_scales;
        Payload p[kSteps];
        Scale s[kSteps];
#pragma unroll
        for (int k = 0; k < kSteps; ++k) {
            const int col = col0 + k * kWarpSpan + wg.lane * kLaneValues;
            if (col < hidden) {
                p[k] = *reinterpret_cast<const Payload*>(prow + payload_offset<kFmt>(col));
                if constexpr (kFmt == kFmtBf16) s[k] = Scale(0); else s[k] = srow[col / kBlock];
            }
        }
        float* orow = out + row * hidden;
#pragma unroll
        for (int k = 0; k < kSteps; ++k) {
            const int col = col0 + k * kWarpSpan + wg.lane * kLaneValues;
            if (col < hidden) {
                float v[kLaneValues];
                dequantize8<kFmt>(p[k], s[k], global_scale, v);
                float4* o = reinterpret_cast<float4*>(orow + col);
                o[0] = make_float4(v[0], v[1], v[2], v[3]);
                o[1] = make_float4(v[4], v[5], v[6], v[7]);
            }
        }
    }
}

// Per-row block scales uint8 [>= rows, n_scales] -> 128x4 tiles (uint8 [max_tiles * k_tiles * 512]) and
// scales_offsets uint32 [G]; rows = row_offsets[G] read on the device. One thread per (row, 4-column tile row):
// reads 4 bytes (0 past n_scales), writes one word. Padding rows of every used tile are zeroed; bytes of unused
// tiles are not touched. Dynamic shared memory: 2 * (G + 1) ints.
__device__ __forceinline__ void swizzle_scales(const uint8_t* __restrict__ scales, int64_t scale_rows, int n_scales,
                                               const int* __restrict__ row_offsets, int n_groups,
                                               uint8_t* __restrict__ out, uint32_t* __restrict__ scales_offsets,
                                               int64_t max_tiles) {
    extern __shared__ int smem[];
    __shared__ int scratch[kWarp];
    SwizzleGroups sg;
    sg.row_offsets = smem;
    sg.tile_start = smem + n_groups + 1;
    load_swizzle_groups(sg, row_offsets, n_groups, scale_rows, scratch, scales_offsets);
    const int k_tiles = (n_scales + kScaleTileCols - 1) / kScaleTileCols;
    const int64_t rows = sg.row_offsets[n_groups];
    const int64_t items = rows * k_tiles;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
        const int row = int(i / k_tiles), kt = int(i - int64_t(row) * k_tiles);
        const int g = sg.find(row);
        const int local = row - sg.row_offsets[g];
        if (local < 0 || local >= sg.rows_of(g)) continue;  // bad row_offsets: write nothing
        const int64_t scale_row = int64_t(sg.tile_start[g]) * kScaleTileRows + local;
        if (scale_row / kScaleTileRows >= max_tiles) continue;
        const uint8_t* src = scales + int64_t(row) * n_scales;
        uint32_t word = 0;
#pragma unroll
        for (int c = 0; c < kScaleTileCols; ++c) {
            const int col = kt * kScaleTileCols + c;
            if (col < n_scales) word |= uint32_t(src[col]) << (8 * c);
        }
        *reinterpret_cast<uint32_t*>(out + swizzled_scale_offset(scale_row, kt * kScaleTileCols, k_tiles)) = word;
    }
    zero_swizzle_padding_rows(sg, out, k_tiles, max_tiles);
}

}  // namespace cuep

using cuep::bf16_t;
using cuep::kFmtBf16;
using cuep::kFmtFp8;
using cuep::kFmtMxfp4;
using cuep::kFmtNvfp4;
using cuep::kOpsThreads;

// One block of 32 warps per SM (at most 64 registers per thread), not four of 8: the warp scheduler favours older
// blocks, so of several resident blocks with equal static shares of the items the oldest finished long before the
// youngest and the SM ran its tail with few warps; the warps of one block progress evenly (BENCHMARKS.md).
constexpr int kQuantizeThreads = 1024;

// ---- quantize: one kernel per (format, input dtype) -------------------------------------------------------
#define CUEP_QUANTIZE_BOUNDS __launch_bounds__(kQuantizeThreads, 1)
#define CUEP_QUANTIZE_ARGS(T)                                                                                    \
    const T *__restrict__ x, uint8_t *__restrict__ payload, uint8_t *__restrict__ scales, long long n_rows,    \
        int hidden, float global_scale
#define CUEP_QUANTIZE_CALL(FMT, T) cuep::quantize_rows<FMT, T>(x, payload, scales, n_rows, hidden, global_scale)

extern "C" __global__ void CUEP_QUANTIZE_BOUNDS quantize_bf16_f32(CUEP_QUANTIZE_ARGS(float)) {
    CUEP_QUANTIZE_CALL(kFmtBf16, float);
}
extern "C" __global__ void CUEP_QUANTIZE_BOUNDS quantize_fp8_bf16(CUEP_QUANTIZE_ARGS(bf16_t)) {
    CUEP_QUANTIZE_CALL(kFmtFp8, bf16_t);
}
extern "C" __global__ void CUEP_QUANTIZE_BOUNDS quantize_fp8_f32(CUEP_QUANTIZE_ARGS(float)) {
    CUEP_QUANTIZE_CALL(kFmtFp8, float);
}
extern "C" __global__ void CUEP_QUANTIZE_BOUNDS quantize_nvfp4_bf16(CUEP_QUANTIZE_ARGS(bf16_t)) {
    CUEP_QUANTIZE_CALL(kFmtNvfp4, bf16_t);
}
extern "C" __global__ void CUEP_QUANTIZE_BOUNDS quantize_nvfp4_f32(CUEP_QUANTIZE_ARGS(float)) {
    CUEP_QUANTIZE_CALL(kFmtNvfp4, float);
}
extern "C" __global__ void CUEP_QUANTIZE_BOUNDS quantize_mxfp4_bf16(CUEP_QUANTIZE_ARGS(bf16_t)) {
    CUEP_QUANTIZE_CALL(kFmtMxfp4, bf16_t);
}
extern "C" __global__ void CUEP_QUANTIZE_BOUNDS quantize_mxfp4_f32(CUEP_QUANTIZE_ARGS(float)) {
    CUEP_QUANTIZE_CALL(kFmtMxfp4, float);
}

// ---- dequantize: one kernel per format -------------------------------------------------------------------
#define CUEP_DEQUANTIZE_ARGS                                                                                     \
    const uint8_t *__restrict__ payload, const uint8_t *__restrict__ scales, float *__restrict__ out,          \
        long long n_rows, int hidden, float global_scale
#define CUEP_DEQUANTIZE_CALL(FMT) cuep::dequantize_rows<FMT>(payload, scales, out, n_rows, hidden, global_scale)

extern "C" __global__ void __launch_bounds__(kOpsThreads) dequantize_bf16(CUEP_DEQUANTIZE_ARGS) {
    CUEP_DEQUANTIZE_CALL(kFmtBf16);
}
extern "C" __global__ void __launch_bounds__(kOpsThreads) dequantize_fp8(CUEP_DEQUANTIZE_ARGS) {
    CUEP_DEQUANTIZE_CALL(kFmtFp8);
}
extern "C" __global__ void __launch_bounds__(kOpsThreads) dequantize_nvfp4(CUEP_DEQUANTIZE_ARGS) {
    CUEP_DEQUANTIZE_CALL(kFmtNvfp4);
}
extern "C" __global__ void __launch_bounds__(kOpsThreads) dequantize_mxfp4(CUEP_DEQUANTIZE_ARGS) {
    CUEP_DEQUANTIZE_CALL(kFmtMxfp4);
}

// ---- 128x4 scale swizzle ---------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kOpsThreads)
    swizzle_block_scales(const uint8_t* __restrict__ scales, long long scale_rows, int n_scales,
                         const int* __restrict__ row_offsets, int n_groups, uint8_t* __restrict__ out,
                         uint32_t* __restrict__ scales_offsets, long long max_tiles) {
    cuep::swizzle_scales(scales, scale_rows, n_scales, row_offsets, n_groups, out, scales_offsets, max_tiles);
}
