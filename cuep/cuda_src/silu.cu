// Fused SwiGLU (cuep.ops.fused_silu): y = silu(gate) * up of the rows below row_offsets[G], written as bf16 or
// quantized for the down-projection GEMM. Bit-exact to cuep.reference.fused_silu (docs/formats.md): silu is the
// float32 algorithm of formats.cuh (silu_f32: range reduction, a degree-6 polynomial, 2**n from bits, one IEEE
// division); y = sv * up, a float32 multiply (FTZ); then bf16(y) or the quantizer of formats.cuh with I = H.
//
// h [capacity, 2I] (bf16 or float32): gate half then up half per row, or interleaved gate/up element by element.
// The row count is read ON THE DEVICE from row_offsets[G] (no host sync): rows at or past it are neither read nor
// written, so the grid is sized for `capacity` and idle warps simply find no work.
// Outputs: bf16 [capacity, I]; fp8 payload [capacity, I] + float32 scales [I/128, capacity] (transposed);
// nvfp4/mxfp4 payload [capacity, I/2] + 128x4 swizzled scales (max_tiles = ceil(capacity/128) + G row tiles) +
// scales_offsets uint32 [G]; every block computes the group geometry in shared memory, block 0 writes
// scales_offsets, and the padding rows of every used tile are zeroed in the same launch.
#include "common.cuh"
#include "formats.cuh"

namespace cuep {

// Four resident blocks (32 warps) per SM: at most 64 registers per thread.
#ifndef CUEP_SILU_MIN_BLOCKS
#define CUEP_SILU_MIN_BLOCKS 4
#endif
constexpr int kSiluMinBlocks = CUEP_SILU_MIN_BLOCKS;

// silu(gate) * up for one value. gate and up are not flushed first: every operation that reads them (max.ftz,
// div.rn.ftz, mul.rn.ftz) flushes a subnormal operand to zero of the same sign, which is the contract's
// "flushed first".
__device__ __forceinline__ float swiglu(float gate, float up) { return __fmul_rn(silu_f32(gate), up); }

// Source of y values for the row quantizer: issues the gate and up loads, then computes y (inputs flushed first).
template <class T, bool kInterleaved>
struct SwigluSource {
    struct Raw {
        Raw8<T> a, b;  // halves: gate, up; interleaved: values [2col, 2col + 8), [2col + 8, 2col + 16)
    };
    static constexpr bool kBf16ByCvt = true;  // y is flushed; a NaN y may become any bf16 NaN (docs/formats.md)
    const T* gate;  // halves: the row's gate half; interleaved: the row
    const T* up;    // halves: the row's up half (gate + I); interleaved: unused
    __device__ __forceinline__ SwigluSource at(int col) const {
        const unsigned c = unsigned(col);
        if constexpr (kInterleaved)
            return SwigluSource{gate + 2 * c, up};
        else
            return SwigluSource{gate + c, up + c};
    }
    __device__ __forceinline__ void prefetch(int col) const {
        if constexpr (kInterleaved) {
            prefetch_l2(gate + 2 * col);
        } else {
            prefetch_l2(gate + col);
            prefetch_l2(up + col);
        }
    }
    template <bool kL1 = false>
    __device__ __forceinline__ Raw load(int col) const {
        if constexpr (kInterleaved)
            return Raw{load8<T, kL1>(gate + 2 * col), load8<T, kL1>(gate + 2 * col + kLaneValues)};
        else
            return Raw{load8<T, kL1>(gate + col), load8<T, kL1>(up + col)};
    }
    __device__ __forceinline__ void values(const Raw& r, float (&y)[kLaneValues]) const {
        float a[kLaneValues], b[kLaneValues];
        values8<false>(r.a, a);  // flushed by the arithmetic (swiglu)
        values8<false>(r.b, b);
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) {
            if constexpr (kInterleaved) {
                const float* pair = i < kLaneValues / 2 ? a + 2 * i : b + 2 * (i - kLaneValues / 2);
                y[i] = swiglu(pair[0], pair[1]);
            } else {
                y[i] = swiglu(a[i], b[i]);
            }
        }
    }
};

template <int kFmt, class T, bool kInterleaved>
__device__ __forceinline__ void fused_silu_rows(const T* __restrict__ h, const int* __restrict__ row_offsets,
                                                int n_groups, int64_t capacity, int inter,
                                                uint8_t* __restrict__ out, uint8_t* __restrict__ scales,
                                                uint32_t* __restrict__ scales_offsets, int64_t max_tiles,
                                                float global_scale) {
    using Src = SwigluSource<T, kInterleaved>;
    constexpr int kSteps = kStepsFor<typename Src::Raw>;
    constexpr int kSpan = kSteps * kWarpSpan;
    constexpr bool kSwizzled = kFmt == kFmtNvfp4 || kFmt == kFmtMxfp4;
    const WarpGrid wg;
    const int spans = (inter + kSpan - 1) / kSpan;
    const int64_t out_row_bytes = payload_offset<kFmt>(inter);

    SwizzleGroups sg{};
    int k_tiles = 0;
    int64_t rows;
    if constexpr (kSwizzled) {
        extern __shared__ int smem[];
        __shared__ int scratch[kWarp];
        sg.row_offsets = smem;
        sg.tile_start = smem + n_groups + 1;
        load_swizzle_groups(sg, row_offsets, n_groups, capacity, scratch, scales_offsets);
        k_tiles = (inter / FormatTraits<kFmt>::kBlock + kScaleTileCols - 1) / kScaleTileCols;
        rows = sg.row_offsets[n_groups];
    } else {
        rows = min(int64_t(max(row_offsets[n_groups], 0)), capacity);
    }

    int g = -1;  // the group of `row` (swizzled scales): rows only grow along a warp's chunk, so scan forward
    if (spans > 0) {
        for (ChunkWalk cw(wg, rows, spans); cw.left > 0; cw.next_row()) {
            const int64_t row = cw.row;
            const T* hrow = h + row * 2 * int64_t(inter);
            const Src src{hrow, hrow + inter};
            uint8_t* prow = out + row * out_row_bytes;
            const int end = cw.end_span();
            if constexpr (kFmt == kFmtBf16) {
                for (int k = cw.span; k < end; ++k)
                    warp_quantize_span<kFmt, kSteps>(src, k * kSpan, inter, prow, NoScales{}, global_scale, wg.lane,
                                                     kPrefetchNextSpan && k + 1 < end);
            } else if constexpr (kFmt == kFmtFp8) {
                const TransposedScales sink{reinterpret_cast<float*>(scales), capacity, row};
                for (int k = cw.span; k < end; ++k)
                    warp_quantize_span<kFmt, kSteps>(src, k * kSpan, inter, prow, sink, global_scale, wg.lane,
                                                     kPrefetchNextSpan && k + 1 < end);
            } else {
                if (g < 0) g = sg.find(int(row));
                while (g + 1 < n_groups && sg.row_offsets[g + 1] <= row) ++g;  // = sg.find(row), valid offsets
                const int local = int(row) - sg.row_offsets[g];
                const int64_t scale_row = int64_t(sg.tile_start[g]) * kScaleTileRows + local;
                const bool ok = local >= 0 && local < sg.rows_of(g) && scale_row / kScaleTileRows < max_tiles;
                const SwizzledScales<kFmt> sink(scales, scale_row, k_tiles, ok);
                for (int k = cw.span; k < end; ++k)
                    warp_quantize_span<kFmt, kSteps>(src, k * kSpan, inter, prow, sink, global_scale, wg.lane,
                                                     kPrefetchNextSpan && k + 1 < end);
            }
        }
    }
    if constexpr (kSwizzled) zero_swizzle_padding_rows(sg, scales, k_tiles, max_tiles);
}

}  // namespace cuep

using cuep::bf16_t;
using cuep::kFmtBf16;
using cuep::kFmtFp8;
using cuep::kFmtMxfp4;
using cuep::kFmtNvfp4;
using cuep::kOpsThreads;
using cuep::kSiluMinBlocks;

// ---- one kernel per (output format, input dtype, layout): fused_silu_<fmt>_<dtype>[_interleaved] -----------
// Arguments (all formats): h, row_offsets int32 [G+1], G, capacity, I, out (payload or bf16), scales (fp8:
// float32 [I/128, capacity]; fp4: uint8 swizzled; bf16: unused), scales_offsets (fp4: uint32 [G]; else unused),
// max_tiles (fp4), global_scale (nvfp4). Dynamic shared memory (fp4): 2 * (G + 1) ints.
#define CUEP_SILU_ARGS(T)                                                                                        \
    const T *__restrict__ h, const int *__restrict__ row_offsets, int n_groups, long long capacity, int inter, \
        uint8_t *__restrict__ out, uint8_t *__restrict__ scales, uint32_t *__restrict__ scales_offsets,        \
        long long max_tiles, float global_scale
#define CUEP_SILU_CALL(FMT, T, IL)                                                                              \
    cuep::fused_silu_rows<FMT, T, IL>(h, row_offsets, n_groups, capacity, inter, out, scales, scales_offsets,   \
                                      max_tiles, global_scale)
#define CUEP_SILU_KERNEL(NAME, FMT, T, IL)                                                                      \
    extern "C" __global__ void __launch_bounds__(kOpsThreads, kSiluMinBlocks) NAME(CUEP_SILU_ARGS(T)) {         \
        CUEP_SILU_CALL(FMT, T, IL);                                                                             \
    }

CUEP_SILU_KERNEL(fused_silu_bf16_bf16, kFmtBf16, bf16_t, false)
CUEP_SILU_KERNEL(fused_silu_bf16_bf16_interleaved, kFmtBf16, bf16_t, true)
CUEP_SILU_KERNEL(fused_silu_bf16_f32, kFmtBf16, float, false)
CUEP_SILU_KERNEL(fused_silu_bf16_f32_interleaved, kFmtBf16, float, true)
CUEP_SILU_KERNEL(fused_silu_fp8_bf16, kFmtFp8, bf16_t, false)
CUEP_SILU_KERNEL(fused_silu_fp8_bf16_interleaved, kFmtFp8, bf16_t, true)
CUEP_SILU_KERNEL(fused_silu_fp8_f32, kFmtFp8, float, false)
CUEP_SILU_KERNEL(fused_silu_fp8_f32_interleaved, kFmtFp8, float, true)
CUEP_SILU_KERNEL(fused_silu_nvfp4_bf16, kFmtNvfp4, bf16_t, false)
CUEP_SILU_KERNEL(fused_silu_nvfp4_bf16_interleaved, kFmtNvfp4, bf16_t, true)
CUEP_SILU_KERNEL(fused_silu_nvfp4_f32, kFmtNvfp4, float, false)
CUEP_SILU_KERNEL(fused_silu_nvfp4_f32_interleaved, kFmtNvfp4, float, true)
CUEP_SILU_KERNEL(fused_silu_mxfp4_bf16, kFmtMxfp4, bf16_t, false)
CUEP_SILU_KERNEL(fused_silu_mxfp4_bf16_interleaved, kFmtMxfp4, bf16_t, true)
CUEP_SILU_KERNEL(fused_silu_mxfp4_f32, kFmtMxfp4, float, false)
CUEP_SILU_KERNEL(fused_silu_mxfp4_f32_interleaved, kFmtMxfp4, float, true)
