// Whole rows: the row quantizer (warp_quantize_span / warp_quantize_row and the in-flight tuning), grid-stride
// (row, span) work items, and the expert groups of the swizzled scale layout.
#pragma once
#include "warp_quant.cuh"

namespace cuep {

// ---- the row quantizer ----------------------------------------------------------------------------------
// Quantize values [col0, col0 + kSteps * 256) of one row (clipped to `hidden`) into `payload_row`, scales to
// `sink`. All 32 lanes call it converged; col0 is a multiple of 256. All kSteps loads are issued before the
// first is used. bf16 "format": 16-byte bf16 stores, no scales.
//
// Lane layout: with an odd kSteps (and for bf16), lane l holds values [256 s + 8 l, +8) of step s; with an even
// kSteps the steps go in pairs and lane l holds values [512 p + 16 l, +16) of pair p, so a scale block spans
// half as many lanes (fp8 8, nvfp4 1, mxfp4 2): half the block-scale work per value, fewer shuffles, and 8- or
// 16-byte payload stores. Quantized formats have hidden % 16 == 0, so a lane's 16 values are all in or all out.
// GScale = float (the global scale g) or Nvfp4Table (g and its per-scale-byte reciprocals; warp_quantize).
template <int kFmt, int kN, class Sink>
__device__ __forceinline__ void warp_store_quantized(const QuantN<kFmt, kN>& q, uint8_t* dst, int col, bool valid,
                                                     const Sink& sink, int lane) {
    using Scale = typename FormatTraits<kFmt>::Scale;
    if (valid) store_words(dst, q.payload.w);
    sink.put(lane, int(unsigned(col) / unsigned(FormatTraits<kFmt>::kBlock)), valid ? q.scale : Scale(0), q.leader,
             valid);
}
template <int kFmt, int kN, class Sink, class GScale>
__device__ __forceinline__ void warp_encode(const float (&v)[kN], uint8_t* dst, int col, bool valid,
                                            const Sink& sink, GScale global_scale, int lane) {
    warp_store_quantized(warp_quantize<kFmt, kN>(v, global_scale), dst, col, valid, sink, lane);
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
template <int kFmt, int kN, class Source, class Sink, class GScale>
__device__ __forceinline__ void warp_span_group(const Source& src, const typename Source::Raw* raw, uint8_t* dst,
                                                int col, bool valid, const Sink& sink, GScale global_scale,
                                                int lane) {
    if constexpr (kFmt == kFmtMxfp4 && Source::kRawBf16) {  // bf16 pairs straight from the loads, where they serve
        uint4 x[kN / kLaneValues];
#pragma unroll
        for (int h = 0; h < kN / kLaneValues; ++h) x[h] = valid ? raw[h].w[0] : make_uint4(0u, 0u, 0u, 0u);
        QuantN<kFmt, kN> q;
        if (warp_quantize_mxfp4_bf16<kN>(x, &q)) {
            warp_store_quantized(q, dst, col, valid, sink, lane);
            return;
        }
    }
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
template <int kFmt, int kSteps, class Source, class Sink, class GScale>
__device__ __forceinline__ void warp_encode_span(const Source& src, const typename Source::Raw (&raw)[kSteps],
                                                 int col0, int hidden, uint8_t* __restrict__ payload_row,
                                                 const Sink& sink, GScale global_scale, int lane) {
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
template <int kFmt, int kSteps, class Source, class Sink, class GScale>
__device__ __forceinline__ void warp_quantize_span(const Source& src, int col0, int hidden,
                                                   uint8_t* __restrict__ payload_row, const Sink& sink,
                                                   GScale global_scale, int lane, bool prefetch_next = false) {
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
// (CUEP_PREFETCH / CUEP_INFLIGHT_BYTES / CUEP_QUANT_STEPS / CUEP_DISPATCH_ENCODE_STEPS are
// tuning constants: the defaults are the measured best; a benchmark harness builds variants of them through
// cuep._kernels.module(defines=...). They change speed, never results.)
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
// [w * items / n_warps, (w + 1) * items / n_warps), so chunks differ by at most one item (ceil(items / n_warps) per
// warp left the last warps idle: at 28672 items over 2112 warps the busiest SM had 3% more than the mean), and it
// walks along its rows, doing the per-row work (pointers, scale rows) once per row. Usage:
//   for (ChunkWalk cw(wg, rows, spans); cw.left > 0; cw.next_row()) { per-row setup (cw.row);
//       for (int k = cw.span; k < cw.end_span(); ++k) item (cw.row, k) }
struct ChunkWalk {
    int64_t row;
    int span;      // first span of `row` in this chunk
    int spans;
    int64_t left;  // items left, from (row, span) on
    __device__ __forceinline__ ChunkWalk(const WarpGrid& wg, int64_t rows, int n_spans) : spans(n_spans) {
        const int64_t items = rows * n_spans;
        const int64_t first = wg.warp * items / wg.n_warps;
        left = (wg.warp + 1) * items / wg.n_warps - first;
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
