// A dispatched row's block scales in the output layouts (fp8: float32 [n_scales, capacity]; nvfp4 / mxfp4: the
// 128x4-tiled bytes a block-scaled GEMM reads): placed per row as each message lands (decode), or noted per row
// and gathered in whole lines once a large round's messages are in (gather_scales).
#pragma once
#include "../ep.cuh"
#include "../formats.cuh"

namespace cuep {

// Scale row of local row `row` of group g in the 128x4 tiled layout.
__device__ __forceinline__ long long swizzle_row(const unsigned* s_tile_start, const unsigned* s_row_offsets, int g,
                                                 long long row) {
    return static_cast<long long>(s_tile_start[g]) * kScaleTileRows + (row - s_row_offsets[g]);
}

// 128-row scale tiles (fp4): each group g (rows s_offsets[g] .. s_offsets[g + 1]) starts a fresh one; its first
// tile s_tiles[g] by a warp's prefix sum, 32 groups a pass; *tiles_end: the tiles used. One warp (lanes 0 .. 31).
// (Thread 0 alone, a group after the other, took 2.6 us of every fp4 receive's layout: 2 x H200, N = 1 trace,
// layout done at 8.8 us against 6.0 for bf16.)
__device__ __forceinline__ void scan_scale_tiles(const unsigned* s_offsets, int G, unsigned* s_tiles,
                                                 unsigned* tiles_end) {
    const int ln = static_cast<int>(threadIdx.x % kWarp);
    unsigned carry = 0;
    for (int g0 = 0; g0 < G; g0 += kWarp) {
        const int g = g0 + ln;
        const unsigned n = g < G ? (s_offsets[g + 1] - s_offsets[g] + kScaleTileRows - 1) / kScaleTileRows : 0u;
        unsigned incl = n;
        for (int o = 1; o < kWarp; o <<= 1) {
            const unsigned v = __shfl_up_sync(0xffffffffu, incl, o);
            if (ln >= o) incl += v;
        }
        if (g < G) s_tiles[g] = carry + incl - n;
        carry += __shfl_sync(0xffffffffu, incl, kWarp - 1);
    }
    if (ln == 0) *tiles_end = carry;
}
// fp4: the 4-byte unit of the 128x4 tiled layout, a row's scales 4 kt .. 4 kt + 3 of its plain bytes `src` (zero
// past n_scales).
__device__ __forceinline__ uint32_t scale_word(const uint8_t* src, int kt, int n_scales) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < kScaleTileCols; ++i) {
        const int c = kt * kScaleTileCols + i;
        if (c < n_scales) word |= uint32_t(src[c]) << (8 * i);
    }
    return word;
}

// Word c of a row's plain scale bytes `src` (fp8: scale c; fp4: scales 4c .. 4c + 3, zero past n_scales, whole-word
// loads where `src` is 4-byte aligned), and its store to the output layout (fp8 row `row`, fp4 scale row).
template <bool kFp8>
__device__ __forceinline__ uint32_t plain_scale_word(const uint8_t* src, int c, int n_scales, bool aligned) {
    if (kFp8) return reinterpret_cast<const uint32_t*>(src)[c];
    if (!aligned) return scale_word(src, c, n_scales);
    uint32_t w = reinterpret_cast<const uint32_t*>(src)[c];
    const int have = n_scales - c * kScaleTileCols;  // (bytes past the scales: message padding)
    if (have < kScaleTileCols) w &= (1u << (8 * have)) - 1u;
    return w;
}
template <bool kFp8>
__device__ __forceinline__ void store_scale_word(const EPParams& ep, const DispatchArgs& a, long long row,
                                                 long long scale_row, int c, uint32_t w) {
    if (kFp8) {
        store_u32_evict_last(static_cast<uint32_t*>(a.scales_out) + static_cast<long long>(c) * ep.capacity + row, w);
    } else {
        const int k_tiles = static_cast<int>(ep.k_tiles);
        store_u32_evict_last(static_cast<uint8_t*>(a.scales_out) +
                                 swizzled_scale_offset(scale_row, c * kScaleTileCols, k_tiles), w);
    }
}

// Write one row's scales (plain per-row bytes `src`) into the dispatch output layout; pad columns of swizzled
// tiles are written as zero. Called by `nthreads` threads (a warp or a block), `tid` in [0, nthreads).
// Only scale columns [b_lo, b_hi) (fp4: whole tiles of 4) when given.
template <int FMT>
__device__ void place_row_scales(const EPParams& ep, const DispatchArgs& a, long long row, long long scale_row,
                                 const uint8_t* src, int tid, int nthreads, int b_lo = 0, int b_hi = 1 << 30) {
    const int n_scales = static_cast<int>(ep.n_scales);
    if constexpr (FMT == kFmtFp8) {
        float* out = static_cast<float*>(a.scales_out);
        const float* s = reinterpret_cast<const float*>(src);
        for (int b = b_lo + tid; b < min(n_scales, b_hi); b += nthreads)  // (plain: store_scale_word's hint
            out[static_cast<long long>(b) * ep.capacity + row] = s[b];       // spilled cuep_dispatch_fp8_from_bf16)
    } else if constexpr (FMT == kFmtNvfp4 || FMT == kFmtMxfp4) {
        // One 4-byte word per 128x4 tile (its 4 columns of this row are contiguous): a quarter of the stores of
        // byte-wise writes (each store goes to a sector other rows also write, which is what costs).
        const int k_tiles = static_cast<int>(ep.k_tiles);
        for (int kt = b_lo / kScaleTileCols + tid; kt < min(k_tiles, b_hi / kScaleTileCols); kt += nthreads)
            store_scale_word<false>(ep, a, row, scale_row, kt, scale_word(src, kt, n_scales));
    }
}

// Write one token's scales (plain per-row bytes `src`, 4-byte aligned) to each of its local rows in the dispatch
// output layout, by a warp: every lane loads its words of the scales once, into registers, then stores them to
// each row. (place_row_scales per row re-loaded them row after row, behind the previous row's stores, which may
// alias them: at N = 128 nvfp4, 112 words a row, that serial chain was 3.4 of the dispatch's 36.5 us. Loading the
// first piece before the fan-out and storing it after gained nothing and spilled 84-112 bytes of registers: 1-4 us
// slower.) `rows` is the mask of lanes whose choice has a row here (warp-uniform); row_of(k, row, scale_row) gives
// lane k's row and scale row (it shuffles: every lane calls it).
template <int FMT, typename RowOf>
__device__ __forceinline__ void place_token_scales(const EPParams& ep, const DispatchArgs& a, unsigned rows, RowOf row_of,
                                                   const uint8_t* src, int lane) {
    if constexpr (FMT == kFmtFp8 || FMT == kFmtNvfp4 || FMT == kFmtMxfp4) {
        constexpr int kRegs = 4;
        constexpr bool kFp8 = FMT == kFmtFp8;
        const int n_scales = static_cast<int>(ep.n_scales);
        const int n_words = kFp8 ? n_scales : static_cast<int>(ep.k_tiles);
        const bool aligned = (reinterpret_cast<uintptr_t>(src) & 3) == 0;
        for (int base = 0; base < n_words; base += kRegs * kWarp) {
            uint32_t w[kRegs];
#pragma unroll
            for (int j = 0; j < kRegs; ++j) {
                const int c = base + j * kWarp + lane;
                w[j] = c < n_words ? plain_scale_word<kFp8>(src, c, n_scales, aligned) : 0u;
            }
            for (unsigned rest = rows; rest; rest &= rest - 1) {
                long long row, scale_row;
                row_of(__ffs(rest) - 1, row, scale_row);
#pragma unroll
                for (int j = 0; j < kRegs; ++j) {
                    const int c = base + j * kWarp + lane;
                    if (c < n_words) store_scale_word<kFp8>(ep, a, row, scale_row, c, w[j]);
                }
            }
        }
    }
}

// Scale words [w_lo, w_hi) (fp8: scales; fp4: k-tiles of 4) of one token chunk, from its plain scale bytes `src`
// (4-byte aligned, the whole row's indexing; bytes past n_scales read as zero) to each of the token's rows, by a
// warp, one (row, word) pair per lane at a time: lane k < n_slots holds slot k's row and scale row (row -1: none).
// (An H100 N = 1 nvfp4 round, 8 rows of 4 words a chunk: row by row, each row's words loaded again behind the
// previous row's stores, 2.1 us of the item; the words loaded once, then stored row by row (place_token_scales),
// 1.2 us, each row's pass waiting on its shuffles and shared loads; by pairs, 0.4 us.)
template <int FMT>
__device__ __forceinline__ void place_chunk_scales(const EPParams& ep, const DispatchArgs& a, int n_slots, int row,
                                                   int scale_row, const uint8_t* src, int w_lo, int w_hi, int lane) {
    if constexpr (FMT == kFmtFp8 || FMT == kFmtNvfp4 || FMT == kFmtMxfp4) {
        constexpr bool kFp8 = FMT == kFmtFp8;
        const int n_scales = static_cast<int>(ep.n_scales);
        const int n_w = min(kFp8 ? n_scales : static_cast<int>(ep.k_tiles), w_hi) - w_lo, pairs = n_slots * n_w;
        for (int i0 = 0; i0 < pairs; i0 += kWarp) {
            const int i = i0 + lane;
            const int k = i < pairs ? i / n_w : 0, c = w_lo + (i < pairs ? i - k * n_w : 0);
            const int r = __shfl_sync(0xffffffffu, row, k), sr = __shfl_sync(0xffffffffu, scale_row, k);
            if (i < pairs && r >= 0)
                store_scale_word<kFp8>(ep, a, r, sr, c, plain_scale_word<kFp8>(src, c, n_scales, true));
        }
    }
}

// ---- scales of large rounds: gathered from the messages, in whole lines ---------------------------------
// The output layouts put a row's scales in a column (fp8: [n_scales, capacity]; fp4: 128x4 tiles, 16 bytes apart),
// so a row placed alone writes 4 bytes into each of n_scales 32-byte sectors that other rows, placed at other times
// by other warps, fill later. Under a large round's fan-out stream those sectors left L2 half written (2 x H200,
// N = 8192 fp8: 437 us against 292 with no scales placed; an L2 evict-last policy on them: 387). A large round's
// receive therefore only notes, per row (fp8) or scale row (fp4), where its message's scales are (scale_rows: the
// scales' byte offset from this rank's buffer base / 4, kPadScales for a padding row), and once every receive block
// is done (blocks_barrier) the blocks gather the scales from the messages (their meta or staging records, which no
// sender rewrites before this launch ends) into the output in tiles whose stores fill whole lines. (Staging each
// row's scales row-major in a region of the output's size, then transposing it, wrote the scales one more time:
// fp8 N = 8192 322.6 us, 309.5 without the transposition.)
constexpr uint32_t kPadScales = 0xFFFFFFFFu;
__device__ __forceinline__ uint32_t* scale_rows(const EPParams& ep) {
    return reinterpret_cast<uint32_t*>(ep.local(ep.off_scale_rows));
}
__device__ __forceinline__ uint32_t scale_ref(const EPParams& ep, const uint8_t* scales) {
    return static_cast<uint32_t>((scales - reinterpret_cast<const uint8_t*>(ep.local(0))) / 4);
}

// Bytes of a round's scales in the output layout from which the receive gathers them at the round's end (below,
// the half-written sectors mostly stay in L2 until full). 2 x H200, cold us, direct / gathered (in-process A/B of
// both variants): fp8 N = 1024 78.8 / 78.6, 2048 118.6 / 112.5, 4096 202.2 / 175.9, 8192
// 436.9 / 303.2; nvfp4 N = 512 57.6 / 51.7, 1024 76.5 / 64.8, 4096 197.7 / 149.6; mxfp4 N = 512 48.7 / 50.0,
// 1024 66.0 / 62.1, 4096 148.6 / 138.3 (about 0.9, 1.8, 3.7, 7.3, 14.7 MB of fp8 scales at N = 512 .. 8192; fp4
// counts each group's padded tiles, 3.7 MB for mxfp4 at N = 512).
constexpr long long kGatherScalesFrom = 2 << 20;

// Lane pairs (lanes 2i and 2i + 1) reading 32 bytes at byte `off` of each of their two rows' scales (ref: the lane's
// own row's, kPadScales: none, read as zero; 16-byte aligned): each lane half `lane & 1` of both rows, so that every
// request asks L2 for whole 32-byte sectors (a lane reading both halves of its own row asked twice for each); `load`
// false: zeros. pair_swap then gives each lane its own row's 32 bytes: the pair swaps the halves that belong to the
// other lane.
struct PairHalves {
    uint4 even, odd;  // half lane & 1 of the even lane's row, of the odd lane's row
};
__device__ __forceinline__ PairHalves pair_load(const uint8_t* base, uint32_t ref, long long off, bool load, int lane) {
    const int odd = lane & 1;
    const uint32_t ref_pair = __shfl_xor_sync(0xffffffffu, ref, 1);
    const uint32_t ref_even = odd ? ref_pair : ref, ref_odd = odd ? ref : ref_pair;
    PairHalves h{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
    if (load && ref_even != kPadScales) h.even = __ldcg(reinterpret_cast<const uint4*>(base + 4LL * ref_even + off) + odd);
    if (load && ref_odd != kPadScales) h.odd = __ldcg(reinterpret_cast<const uint4*>(base + 4LL * ref_odd + off) + odd);
    return h;
}
__device__ __forceinline__ void pair_swap(const PairHalves& h, int lane, uint32_t* words) {
    const int odd = lane & 1;
    const uint4 keep = odd ? h.odd : h.even, give = odd ? h.even : h.odd;
    uint4 got;
    got.x = __shfl_xor_sync(0xffffffffu, give.x, 1);
    got.y = __shfl_xor_sync(0xffffffffu, give.y, 1);
    got.z = __shfl_xor_sync(0xffffffffu, give.z, 1);
    got.w = __shfl_xor_sync(0xffffffffu, give.w, 1);
    const uint4 first = odd ? got : keep, second = odd ? keep : got;
    words[0] = first.x, words[1] = first.y, words[2] = first.z, words[3] = first.w;
    words[4] = second.x, words[5] = second.y, words[6] = second.z, words[7] = second.w;
}

// Output rows [lo, hi) (fp8) or scale tiles [lo, hi) (fp4) from the messages' scales, warp w of n_warps taking
// every n_warps-th piece, every load of a piece issued before its stores. fp8: a piece is 32 rows, lane l row
// 32 p + l, its scales 16 at a time (four 16-byte loads), scale b of the 32 rows stored as one 128-byte line. fp4:
// a piece is a 128-row scale tile and 8 k-tiles; lane l takes rows l, l + 32, l + 64, l + 96 and stores bytes
// 16 l .. 16 l + 15 of each (tile, kt) 512-byte block; the rows are read by lane pairs (pair_load) where every row of
// the piece is 16-byte aligned with whole words of scales, else each lane reads its own. Loads bypass L1 (peers
// wrote the messages).
template <int FMT>
__device__ void gather_scales(const EPParams& ep, const DispatchArgs& a, unsigned lo, unsigned hi, int warp, int n_warps,
                              int lane) {
    if (hi <= lo) return;
    const uint32_t* rows = scale_rows(ep);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(ep.local(0));
    const int n_scales = static_cast<int>(ep.n_scales);
    if constexpr (FMT == kFmtFp8) {
        const long long cap = ep.capacity;
        uint32_t* out = static_cast<uint32_t*>(a.scales_out);
        const unsigned p0 = lo / 32, n_pieces = (hi + 31) / 32 - p0;
        for (unsigned p = p0 + warp; p < p0 + n_pieces; p += n_warps) {
            const unsigned r = p * 32 + lane;
            if (r < lo || r >= hi) continue;
            const uint32_t ref = rows[r];
            const uint32_t* src = reinterpret_cast<const uint32_t*>(base + 4LL * ref);
            const bool vec = ref != kPadScales && (ref % 4 == 0) && n_scales % 4 == 0;  // 16-byte aligned rows
            for (int b0 = 0; b0 < n_scales; b0 += 16) {
                uint32_t v[16];
#pragma unroll
                for (int j = 0; j < 16; ++j) v[j] = 0u;
                if (vec) {
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (b0 + 4 * j < n_scales) {
                            const uint4 q = __ldcg(reinterpret_cast<const uint4*>(src + b0) + j);
                            v[4 * j] = q.x, v[4 * j + 1] = q.y, v[4 * j + 2] = q.z, v[4 * j + 3] = q.w;
                        }
                } else if (ref != kPadScales) {
#pragma unroll
                    for (int j = 0; j < 16; ++j)
                        if (b0 + j < n_scales) v[j] = __ldcg(src + b0 + j);
                }
#pragma unroll
                for (int j = 0; j < 16; ++j)
                    if (b0 + j < n_scales) out[(b0 + j) * cap + r] = v[j];
            }
        }
    } else {
        // k-tiles per piece: 8 (H100, one rank, cold, in-process A/B against 16: nvfp4 N = 4096 89.9 -> 88.6 us,
        // N = 8192 168.5 -> 167.2, mxfp4 unchanged; 4 no better: the gather is bound by its stores, not its latency;
        // H200: 16 by two pair loads a row, 0.99x-1.02x)
        constexpr int kKt = 8;
        const int k_tiles = static_cast<int>(ep.k_tiles), n_kg = (k_tiles + kKt - 1) / kKt;
        const bool whole_words = n_scales % 4 == 0;  // else the last word of a row has bytes past the scales
        const int odd = lane & 1;
        auto aligned = [](uint32_t ref) { return ref == kPadScales || ref % 4 == 0; };  // 16-byte aligned rows
        for (long long item = warp; item < static_cast<long long>(hi - lo) * n_kg; item += n_warps) {
            const long long T = lo + item / n_kg;
            const int kt0 = static_cast<int>(item % n_kg) * kKt;
            uint32_t ref[4], v[4][kKt];
            bool vec = whole_words;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                ref[q] = rows[T * kScaleTileRows + lane + 32 * q];
                vec = vec && aligned(ref[q]);
            }
            if (__all_sync(0xffffffffu, vec)) {
                PairHalves h[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) h[q] = pair_load(base, ref[q], 4LL * kt0, kt0 + 4 * odd < k_tiles, lane);
#pragma unroll
                for (int q = 0; q < 4; ++q) pair_swap(h[q], lane, v[q]);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const uint8_t* src = base + 4LL * ref[q];
#pragma unroll
                    for (int k = 0; k < kKt; ++k) v[q][k] = 0u;
                    if (ref[q] == kPadScales) continue;
                    if (whole_words && ref[q] % 4 == 0) {
#pragma unroll
                        for (int j = 0; j < kKt / 4; ++j)
                            if (kt0 + 4 * j < k_tiles) {
                                const uint4 w = __ldcg(reinterpret_cast<const uint4*>(src) + kt0 / 4 + j);
                                v[q][4 * j] = w.x, v[q][4 * j + 1] = w.y, v[q][4 * j + 2] = w.z, v[q][4 * j + 3] = w.w;
                            }
                    } else {
#pragma unroll
                        for (int k = 0; k < kKt; ++k)
                            for (int i = 0; i < kScaleTileCols; ++i) {
                                const int c = (kt0 + k) * kScaleTileCols + i;
                                if (kt0 + k < k_tiles && c < n_scales) v[q][k] |= uint32_t(__ldcg(src + c)) << (8 * i);
                            }
                    }
                }
            }
            uint8_t* out = static_cast<uint8_t*>(a.scales_out) + (T * k_tiles + kt0) * kScaleTileBytes + lane * 16;
#pragma unroll
            for (int k = 0; k < kKt; ++k)
                if (kt0 + k < k_tiles)
                    *reinterpret_cast<uint4*>(out + k * kScaleTileBytes) = make_uint4(v[0][k], v[1][k], v[2][k], v[3][k]);
        }
    }
}

}  // namespace cuep
