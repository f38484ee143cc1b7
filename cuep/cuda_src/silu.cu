// Fused SwiGLU (cuep.ops.fused_silu): y = silu(gate) * up of the rows below row_offsets[G], written as bf16 or
// quantized for the down-projection GEMM. Bit-exact to cuep.reference.fused_silu (docs/formats.md): silu is the
// float32 algorithm of formats.cuh (silu_f32: range reduction, a degree-6 polynomial with FMAs, 2**n from bits, a
// correctly rounded reciprocal of 1 + e**-|g|); y = sv * up, a float32 multiply (FTZ); then bf16(y) or the quantizer
// of formats.cuh with I = H.
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

// One block of 16 warps per SM, up to 128 registers per thread, so the compiler keeps many independent values of
// the long silu + quantize chain in flight. One block, not two of 8 warps: the warp scheduler favours the older of
// two resident blocks, which then finished its equal share of the items 20-30% of the kernel's time before the
// other, leaving the SM to 8 warps (too few to hide the chain's latency) for that tail; the warps of one block
// progress evenly (measured: BENCHMARKS.md, 1 x H200 ops).
constexpr int kSiluThreads = 512;

// The row loads go through a shared-memory ring (cp.async): each warp keeps the loads of its next
// kSiluStages - 1 spans in flight while it computes the current one, without holding registers for them (with
// register loads the compiler interleaves loads and arithmetic to fit 64 registers, and the warps stall on memory
// about half of the time). A stage is one span of gate and up: 2 x 1024 bf16 or 2 x 512 float32 = 4 KiB per warp,
// 32 (bf16) or 16 (float32) values per lane: the per-span work (cursor, cp.async issue, waits, addresses, scale
// write-out: about 100 instructions a lane) is paid once per 32 bf16 values instead of 16 (about 3 instructions per
// value less), and a warp has twice the bytes in flight (16 warps per SM: 64 KiB).
// cuep/ops.py sizes the dynamic shared memory from the same two numbers (_SILU_STAGES, _SILU_STAGE_BYTES).
constexpr int kSiluStages = 2;
constexpr int kSiluStageBytes = 4096;


// cp.async of the 16-byte pieces kP .. kN - 1 at offsets k * 512 from `to` / `from` (one lane's part of a whole
// stage range): the offsets are immediates of the instructions, so a whole range costs one address per side.
template <int kP, int kN>
__device__ __forceinline__ void copy_pieces(uint8_t* to, const uint8_t* from) {
    if constexpr (kP < kN) {
        asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%2], 16;" ::"r"(
                         static_cast<unsigned>(__cvta_generic_to_shared(to))),
                     "l"(from), "n"(kP * kWarp * 16)
                     : "memory");
        copy_pieces<kP + 1, kN>(to, from);
    }
}

// silu(gate) * up for one value. gate and up are not flushed first: every operation that reads them (max.ftz,
// setp.ftz, mul.rn.ftz) flushes a subnormal operand to zero of the same sign, which is the contract's
// "flushed first".
__device__ __forceinline__ float swiglu(float gate, float up) { return __fmul_rn(silu_f32(gate), up); }

// Source of y values for the row quantizer (warp_encode_span): a row's gate and up values as fused_silu_rows
// stages them in shared memory, and y = swiglu(gate, up) from a lane's raw words (inputs flushed first). Stateless:
// the kernel copies the ranges itself.
template <class T, bool kInterleaved>
struct SwigluSource {
    struct Raw {
        Raw8<T> a, b;  // halves: gate, up; interleaved: values [2col, 2col + 8), [2col + 8, 2col + 16)
    };
    static constexpr bool kRawBf16 = false;  // (the values are computed)
    static constexpr bool kBf16ByCvt = true;  // y is flushed; a NaN y may become any bf16 NaN (docs/formats.md)
    // The span of values [col0, col0 + n) of a row as contiguous byte ranges (halves: gate then up, each n values,
    // range r at byte r * I * sizeof(T) + col0 * sizeof(T) of the row; interleaved: one range of 2n values at byte
    // 2 col0 sizeof(T)), copied into a stage buffer back to back; `stage_raw` reads a lane's raw words of value col
    // from that buffer.
    static constexpr int kRanges = kInterleaved ? 1 : 2;
    __host__ __device__ static constexpr int range_bytes(int n) { return (kInterleaved ? 2 : 1) * n * int(sizeof(T)); }
    __device__ __forceinline__ static int range_offset(int r, int inter) { return r * inter * int(sizeof(T)); }
    template <int kSpanValues>
    __device__ __forceinline__ static Raw stage_raw(const uint8_t* stage, int rel_col) {
        const uint4* a = reinterpret_cast<const uint4*>(stage + (kInterleaved ? 2 : 1) * rel_col * int(sizeof(T)));
        const uint4* b = kInterleaved
                             ? a + Raw8<T>::kWords
                             : reinterpret_cast<const uint4*>(stage + (kSpanValues + rel_col) * int(sizeof(T)));
        Raw r;
#pragma unroll
        for (int i = 0; i < Raw8<T>::kWords; ++i) {
            r.a.w[i] = a[i];
            r.b.w[i] = b[i];
        }
        return r;
    }
    __device__ __forceinline__ void values(const Raw& r, float (&y)[kLaneValues]) const {
        float a[kLaneValues], b[kLaneValues];
        values8(r.a, a);  // flushed by the arithmetic (swiglu)
        values8(r.b, b);
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

// The scales of one (row set, span) item, collected in the warp's shared-memory staging (see fused_silu_rows):
// fp8 float [kSpanBlocks][8] (block column in the span, member); fp4 uint8 [8][kSpanBlocks].
template <int kFmt, int kSpanBlocks>
struct StagedScales {
    uint8_t* staging;
    int member;
    int c0;  // the span's first block column
    template <class S>
    __device__ __forceinline__ void put(int, int c, S s, bool leader, bool valid) const {
        if (!leader || !valid) return;
        if constexpr (kFmt == kFmtFp8)
            reinterpret_cast<float*>(staging)[(c - c0) * 8 + member] = s;
        else
            staging[member * kSpanBlocks + (c - c0)] = uint8_t(s);
    }
};

template <int kFmt, class T, bool kInterleaved>
__device__ __forceinline__ void fused_silu_rows(const T* __restrict__ h, const int* __restrict__ row_offsets,
                                                int n_groups, int64_t capacity, int inter,
                                                uint8_t* __restrict__ out, uint8_t* __restrict__ scales,
                                                uint32_t* __restrict__ scales_offsets, int64_t max_tiles,
                                                float global_scale) {
    using Src = SwigluSource<T, kInterleaved>;
    constexpr int kSteps = kSiluStageBytes / (2 * kWarpSpan * int(sizeof(T)));  // bf16 4, float32 2: paired steps
    constexpr int kSpan = kSteps * kWarpSpan;
    constexpr bool kSwizzled = kFmt == kFmtNvfp4 || kFmt == kFmtMxfp4;
    const WarpGrid wg;
    const int spans = (inter + kSpan - 1) / kSpan;

    static_assert(2 * kSpan * int(sizeof(T)) == kSiluStageBytes, "a stage holds one span of gate and up");
    // Dynamic shared memory: the ring (kSiluStages stages per warp), then (fp4) the groups' row offsets.
    extern __shared__ uint4 smem[];
    constexpr int kRingBytes = kSiluStages * kSiluStageBytes * (kSiluThreads / kWarp);
    uint8_t* const ring = reinterpret_cast<uint8_t*>(smem) + int(threadIdx.x / kWarp) * kSiluStages * kSiluStageBytes;

    SwizzleGroups sg{};
    int k_tiles = 0;
    int64_t rows;
    __shared__ float nvfp4_r[kFmt == kFmtNvfp4 ? 128 : 1];  // nvfp4: r per scale byte (Nvfp4Table)
    if constexpr (kSwizzled) {
        __shared__ int scratch[kWarp];
        sg.row_offsets = reinterpret_cast<int*>(reinterpret_cast<uint8_t*>(smem) + kRingBytes);
        sg.tile_start = sg.row_offsets + n_groups + 1;
        if constexpr (kFmt == kFmtNvfp4) nvfp4_table_fill(nvfp4_r, global_scale);  // the barrier below publishes it
        load_swizzle_groups(sg, row_offsets, n_groups, capacity, scratch, scales_offsets);
        k_tiles = (inter / FormatTraits<kFmt>::kBlock + kScaleTileCols - 1) / kScaleTileCols;
        rows = sg.row_offsets[n_groups];
    } else {
        rows = min(int64_t(max(row_offsets[n_groups], 0)), capacity);
    }
    if (dynamic_smem_bytes() < unsigned(kRingBytes)) __trap();  // launched with too little shared memory
    if (spans == 0) return;

    // Work items are (row set, span). A row set is the rows whose scales share 32-byte sectors: fp8 8 consecutive
    // rows (scales [I/128, capacity]); fp4 the rows {2p, 2p + 1} + 32j (j < 4) of a 128-row scale tile, pair p
    // (a "set" is then tile * 16 + p, and rows past the group's end are its zero padding rows); bf16 one row.
    // The item's scales are collected in shared memory and written as whole sectors once all its rows are done:
    // single small scale stores into sectors other warps also write cost about 20% of the kernel's time.
    constexpr int kSetRows = kFmt == kFmtBf16 ? 1 : 8;
    constexpr int kSpanBlocks = kFmt == kFmtBf16 ? 1 : kSpan / FormatTraits<kFmt>::kBlock;  // scales per row
    const int64_t n_sets = kFmt == kFmtBf16 ? rows
                           : kFmt == kFmtFp8 ? (rows + kSetRows - 1) / kSetRows
                                             : int64_t(sg.tile_start[n_groups]) * 16;
    // A cursor over the warp's items and, inside an item, its pieces (one valid member row each). Row indices fit
    // int32 (capacity < 2**31) and a row of h is under 2 GiB (both checked on the host): each row's address is one
    // 32 x 32 -> 64-bit multiply-add.
    struct Cursor {
        int left;        // items left, the current one included
        int set;
        int span;
        int base;        // row of member 0 (fp4: the pair's first row)
        uint32_t valid;  // members that are rows
        uint32_t own;    // members of the item that are this warp's (see below)
        uint32_t todo;   // issue cursor: the valid owned members of the item not issued yet
        int g;           // fp4: the group of the set's tile (scanned forward)
    };
    auto member_row = [](int k) { return kSwizzled ? (k & 1) + 32 * (k >> 1) : k; };
    auto load_set = [&](Cursor& c) {
        if constexpr (kFmt == kFmtBf16) {
            c.base = c.set;
            c.valid = 1u;
        } else if constexpr (kFmt == kFmtFp8) {
            c.base = c.set * kSetRows;
            const int n = int(rows) - c.base;
            c.valid = n >= kSetRows ? 0xFFu : (1u << n) - 1u;
        } else {
            const int tile = c.set >> 4, pair = c.set & 15;
            if (c.g < 0) {  // the last group whose first tile is <= tile owns it (empty groups come before it)
                int lo = 0, hi = n_groups - 1;
                while (lo < hi) {
                    const int mid = (lo + hi + 1) >> 1;
                    if (sg.tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
                }
                c.g = lo;
            }
            while (c.g + 1 < n_groups && sg.tile_start[c.g + 1] <= tile) ++c.g;
            const int local = (tile - sg.tile_start[c.g]) * kScaleTileRows + 2 * pair;
            const int n = sg.rows_of(c.g);
            c.base = sg.row_offsets[c.g] + local;
            c.valid = 0u;
#pragma unroll
            for (int k = 0; k < kSetRows; ++k)
                if (local + member_row(k) < n) c.valid |= 1u << k;
        }
    };
    // The warp's share is the pieces [first, last) of all n_sets * spans * kSetRows (row set, span, member)
    // positions, padding members included: the shares differ by at most one piece (by whole items, 13 or 14 items a
    // warp, the warps of an SM ended up to 7% of the kernel's time apart). Its first and last items may be partly
    // another warp's: `owned` masks the members of the current item that are this warp's (it computes them and
    // writes their scales, padding zeros included).
    const int64_t n_pieces = n_sets * spans * kSetRows;
    const int64_t first = wg.warp * n_pieces / wg.n_warps, last = (wg.warp + 1) * n_pieces / wg.n_warps;
    const int64_t first_item = first / kSetRows;
    const int n_items = last > first ? int((last - 1) / kSetRows - first_item + 1) : 0;
    const uint32_t first_own = ~0u << int(first % kSetRows);                        // members of the first item
    const uint32_t last_own = ~0u >> (31 - int(last > first ? (last - 1) % kSetRows : 0));  // ... of the last
    auto owned = [&](const Cursor& c) -> uint32_t {
        if constexpr (kSetRows == 1) return ~0u;  // pieces are items
        return (c.left == n_items ? first_own : ~0u) & (c.left == 1 ? last_own : ~0u);
    };
    auto next_item = [&](Cursor& c) {
        if (--c.left <= 0) return;
        if (++c.span == spans) {
            c.span = 0;
            ++c.set;
            load_set(c);
        }
        c.own = owned(c);
    };
    auto settle = [&](Cursor& c) {  // the issue cursor to an item with a piece left to issue (or past the last)
        while (c.todo == 0u && c.left > 0) {
            next_item(c);
            c.todo = c.valid & c.own;
        }
    };

    const int first_set = int(first_item / spans);
    const int first_span = int(first_item - int64_t(first_set) * spans);
    Cursor issue_at{n_items, first_set, first_span, 0, 0u, 0u, 0u, -1};
    Cursor at = issue_at;  // the compute cursor: every item, with pieces or not
    if (n_items > 0) {
        load_set(at);
        at.own = owned(at);
        issue_at = at;
        issue_at.todo = at.valid & at.own;
        settle(issue_at);
    }

    // The loads of the next piece (coalesced 16-byte copies; the pieces of a row past its end are not copied).
    // This lane's 16-byte pieces are at lane * 16 + p * 512 of each range: one base address per range and
    // immediate offsets.
    constexpr int kSpanRangeBytes = Src::range_bytes(kSpan);  // bytes of one range of a whole span
    const uint8_t* const h_lane = reinterpret_cast<const uint8_t*>(h) + wg.lane * 16;
    const uint32_t h_row_bytes = 2u * uint32_t(inter) * uint32_t(sizeof(T));
    const int lane_left = Src::range_bytes(inter) - wg.lane * 16;  // bytes of a range from this lane's first piece
    uint32_t istage = 0, cstage = 0;  // byte offsets of the stages in the ring
    auto next_stage = [](uint32_t off) -> uint32_t {
        if constexpr (kSiluStages == 2) return off ^ kSiluStageBytes;
        return off + kSiluStageBytes == kSiluStages * kSiluStageBytes ? 0u : off + kSiluStageBytes;
    };
    auto issue = [&]() {
        if (issue_at.left <= 0) return;
        const int row = issue_at.base + member_row(__ffs(int(issue_at.todo)) - 1);
        const uint8_t* const from0 =
            h_lane + (uint64_t(uint32_t(row)) * h_row_bytes + uint32_t(issue_at.span * kSpanRangeBytes));
        const int left = lane_left - issue_at.span * kSpanRangeBytes;  // <= 0: none of this lane's pieces
        uint8_t* stage = ring + istage + wg.lane * 16;
        constexpr int kPieces = kSiluStageBytes / Src::kRanges / 16 / kWarp;  // per lane and range
        const bool whole = left > (kPieces - 1) * kWarp * 16;  // all of this lane's pieces: but in a short last span
#pragma unroll
        for (int r = 0; r < Src::kRanges; ++r) {
            const uint8_t* from = from0 + Src::range_offset(r, inter);
            uint8_t* to = stage + r * (kSiluStageBytes / Src::kRanges);
            if (whole) {
                copy_pieces<0, kPieces>(to, from);
            } else {
#pragma unroll
                for (int p = 0; p < kPieces; ++p)
                    if (p * kWarp * 16 < left) cp_async16(to + p * kWarp * 16, from + p * kWarp * 16);
            }
        }
        istage = next_stage(istage);
        issue_at.todo &= issue_at.todo - 1u;
        settle(issue_at);
    };
#pragma unroll
    for (int j = 0; j < kSiluStages - 1; ++j) {
        issue();
        cp_async_commit();
    }

    // This warp's scale staging: fp8 float [kSpanBlocks][8] (block column, member); fp4 uint8 [8][kSpanBlocks].
    constexpr int kStagingWords =
        kFmt == kFmtBf16 ? 1 : kSetRows * kSpanBlocks * int(sizeof(typename FormatTraits<kFmt>::Scale)) / 16;
    static_assert(kStagingWords <= kWarp, "one 16-byte word of the staging per lane at most");
    __shared__ uint4 staging_all[kSiluThreads / kWarp][kStagingWords];
    uint8_t* const staging = reinterpret_cast<uint8_t*>(staging_all[threadIdx.x / kWarp]);
    using L = SpanLayout<kFmt, kSteps>;
    const int n_cols = inter / max(FormatTraits<kFmt>::kBlock, 1);  // scale columns of a row

    const uint32_t out_row_bytes = uint32_t(payload_offset<kFmt>(inter));
    for (; at.left > 0; next_item(at)) {
        if constexpr (kSwizzled) {  // padding rows and columns past the row's scales stay 0
            if (wg.lane < kStagingWords) reinterpret_cast<uint4*>(staging)[wg.lane] = make_uint4(0u, 0u, 0u, 0u);
            __syncwarp();
        }
        for (uint32_t todo = at.valid & at.own; todo != 0u; todo &= todo - 1u) {
            const int k = __ffs(int(todo)) - 1;
            __syncwarp();  // every lane is done reading the stage the next issue overwrites
            issue();
            cp_async_commit();
            cp_async_wait<kSiluStages - 1>();  // this lane's copies of this piece have landed ...
            __syncwarp();                      // ... and every other lane's
            const uint8_t* stage = ring + cstage;
            cstage = next_stage(cstage);
            typename Src::Raw raw[kSteps];
#pragma unroll
            for (int j = 0; j < kSteps; ++j)
                raw[j] = Src::template stage_raw<kSpan>(stage, wg.lane * L::kN + L::offset(j));
            const int row = at.base + member_row(k);
            const Src src{};
            uint8_t* prow = out + uint64_t(uint32_t(row)) * out_row_bytes;
            const int col0 = at.span * kSpan;
            if constexpr (kFmt == kFmtBf16) {
                warp_encode_span<kFmt, kSteps>(src, raw, col0, inter, prow, NoScales{}, global_scale, wg.lane);
            } else {
                const StagedScales<kFmt, kSpanBlocks> sink{staging, k, at.span * kSpanBlocks};
                if constexpr (kFmt == kFmtNvfp4)
                    warp_encode_span<kFmt, kSteps>(src, raw, col0, inter, prow, sink,
                                                   Nvfp4Table{global_scale, nvfp4_r}, wg.lane);
                else
                    warp_encode_span<kFmt, kSteps>(src, raw, col0, inter, prow, sink, global_scale, wg.lane);
            }
        }
        if constexpr (kFmt != kFmtBf16) {
            __syncwarp();  // the item's scales are staged: write them as whole sectors
            const int c0 = at.span * kSpanBlocks;
            const uint32_t own = at.own;  // members whose scales (or padding zeros) this warp writes
            if constexpr (kFmt == kFmtFp8) {
                const int k = wg.lane % kSetRows;
#pragma unroll
                for (int cr0 = 0; cr0 < kSpanBlocks; cr0 += kWarp / kSetRows) {
                    const int cr = cr0 + wg.lane / kSetRows;
                    if (cr < kSpanBlocks && c0 + cr < n_cols && ((at.valid & own) >> k & 1u))
                        reinterpret_cast<float*>(scales)[(c0 + cr) * capacity + at.base + k] =
                            reinterpret_cast<const float*>(staging)[cr * kSetRows + k];
                }
            } else {
                constexpr int kSpanTiles = kSpanBlocks / kScaleTileCols;  // 128x4 tile columns per span
                const int tile = int(at.set >> 4), pair = int(at.set & 15), k = wg.lane % kSetRows;
#pragma unroll
                for (int t0 = 0; t0 < kSpanTiles; t0 += kWarp / kSetRows) {
                    const int tr = t0 + wg.lane / kSetRows, kt = at.span * kSpanTiles + tr;
                    if (tr < kSpanTiles && kt < k_tiles && tile < max_tiles && (own >> k & 1u))
                        *reinterpret_cast<uint32_t*>(scales + (int64_t(tile) * k_tiles + kt) * kScaleTileBytes +
                                                     (2 * pair + (k & 1)) * 16 + (k >> 1) * 4) =
                            *reinterpret_cast<const uint32_t*>(staging + k * kSpanBlocks + tr * kScaleTileCols);
                }
            }
            __syncwarp();  // staging is read before the next item overwrites it
        }
    }
    cp_async_wait<0>();
}

}  // namespace cuep

using cuep::bf16_t;
using cuep::kFmtBf16;
using cuep::kFmtFp8;
using cuep::kFmtMxfp4;
using cuep::kFmtNvfp4;
using cuep::kSiluThreads;

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
    extern "C" __global__ void __launch_bounds__(kSiluThreads, 1) NAME(CUEP_SILU_ARGS(T)) {                 \
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
