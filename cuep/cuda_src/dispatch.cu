// cuep dispatch: every token goes once to each rank holding one of its top-k experts, stored straight into that
// rank's expert-major output (the row of the first local expert it chose there), with a small metadata record;
// the receiver copies it to the rows of its other local experts and builds row_offsets, src_info and the scales.
//
// One kernel, three phases (bits of `phases`), so the fused call, the async/wait halves and ranks simulated on
// one GPU share a single code path:
//   notify  reserve every (token, k) row slot with atomics and every (token, rank) message slot in token order,
//           then publish the histogram, the token count and the message count to every destination (the
//           histograms are also the readiness handshake: a rank publishes only once its previous round is fully
//           consumed)
//   send    wait for every rank's histogram, derive every destination's row layout, then one warp per token:
//           encode it once (shared memory, or straight from x for bf16), store it to each destination rank, and
//           set the message's chunk flags last
//   recv    lay out row_offsets / expert_ids / scales_offsets from the histograms alone, then place each message
//           as its chunk flags land (metadata, scales, copies to the token's other local experts) and zero the
//           padding; the copies overlap the incoming stream
// A small round (decode: at most small_batch_tokens tokens on this rank) skips notify's atomics and grid barrier and
// the wait for every rank's histogram: the send warps store each token at once to its own slot of a staging area at
// each destination, block 0 computes the bookkeeping meanwhile and publishes it, and the receiver copies each
// token to its rows (see "small rounds" below).
#include "ep.cuh"
#include "formats.cuh"

using namespace cuep;

constexpr int kDispatchThreads = 512;
#ifndef CUEP_DISPATCH_ENCODE_STEPS
#define CUEP_DISPATCH_ENCODE_STEPS 4
#endif
constexpr int kEncodeSteps = CUEP_DISPATCH_ENCODE_STEPS;  // 256-value spans per encode step of a sending warp

namespace {

struct DispatchArgs {
    const void* x;              // [N, H] bf16 or float32
    const int* topk_ids;        // [N, K]
    const float* topk_weights;  // [N, K] or nullptr
    int num_tokens;
    float global_scale;
    // outputs (local)
    void* scales_out;           // fp8: float32 [n_scales, capacity]; fp4: swizzled bytes; bf16: unused
    unsigned* row_offsets;      // [G + 1]
    int* expert_ids;            // [G]
    unsigned* scales_offsets;   // [G] (fp4 formats)
    int* src_info;              // [capacity, 2]
    int* row_src;               // [capacity] source rank of each row, -1 for padding
    float* row_weight;          // [capacity]
    int* msg_rows;              // [n_src, T, K] rows, then [n_src, T, K] their weights (msg_weights)
    int* msg_token;             // [n_src, T]
    int* msg_j;                 // [n_src, T] my position among the token's destination ranks
    int* msg_count;             // [n_src]
};

// Scale row of local row `row` of group g in the 128x4 tiled layout.
__device__ __forceinline__ long long swizzle_row(const unsigned* s_tile_start, const unsigned* s_row_offsets, int g,
                                                 long long row) {
    return static_cast<long long>(s_tile_start[g]) * kScaleTileRows + (row - s_row_offsets[g]);
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

// Write one row's scales (plain per-row bytes `src`) into the dispatch output layout; pad columns of swizzled
// tiles are written as zero. Called by `nthreads` threads (a warp or a block), `tid` in [0, nthreads).
// Only scale columns [b_lo, b_hi) (fp4: whole tiles of 4) when given.
template <int FMT>
__device__ void place_row_scales(const EP& ep, const DispatchArgs& a, long long row, long long scale_row,
                                 const uint8_t* src, int tid, int nthreads, int b_lo = 0, int b_hi = 1 << 30) {
    const int n_scales = static_cast<int>(ep[P_N_SCALES]);
    if constexpr (FMT == kFmtFp8) {
        float* out = static_cast<float*>(a.scales_out);
        const float* s = reinterpret_cast<const float*>(src);
        for (int b = b_lo + tid; b < min(n_scales, b_hi); b += nthreads)
            out[static_cast<long long>(b) * ep[P_CAPACITY] + row] = s[b];
    } else if constexpr (FMT == kFmtNvfp4 || FMT == kFmtMxfp4) {
        // One 4-byte word per 128x4 tile (its 4 columns of this row are contiguous): a quarter of the stores of
        // byte-wise writes (each store goes to a sector other rows also write, which is what costs).
        uint8_t* out = static_cast<uint8_t*>(a.scales_out);
        const int k_tiles = static_cast<int>(ep[P_K_TILES]);
        for (int kt = b_lo / kScaleTileCols + tid; kt < min(k_tiles, b_hi / kScaleTileCols); kt += nthreads)
            *reinterpret_cast<uint32_t*>(out + swizzled_scale_offset(scale_row, kt * kScaleTileCols, k_tiles)) =
                scale_word(src, kt, n_scales);
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
__device__ __forceinline__ void place_token_scales(const EP& ep, const DispatchArgs& a, unsigned rows, RowOf row_of,
                                                   const uint8_t* src, int lane) {
    if constexpr (FMT == kFmtFp8 || FMT == kFmtNvfp4 || FMT == kFmtMxfp4) {
        constexpr int kRegs = 4;
        constexpr bool kFp8 = FMT == kFmtFp8;
        const int n_scales = static_cast<int>(ep[P_N_SCALES]);
        const int k_tiles = static_cast<int>(ep[P_K_TILES]);
        const int n_words = kFp8 ? n_scales : k_tiles;
        const bool aligned = (reinterpret_cast<uintptr_t>(src) & 3) == 0;
        for (int base = 0; base < n_words; base += kRegs * kWarp) {
            uint32_t w[kRegs];
#pragma unroll
            for (int j = 0; j < kRegs; ++j) {
                const int c = base + j * kWarp + lane;
                w[j] = 0u;
                if (c >= n_words) continue;
                if (kFp8 || !aligned) {
                    w[j] = kFp8 ? reinterpret_cast<const uint32_t*>(src)[c] : scale_word(src, c, n_scales);
                } else {  // a word of 4 scale bytes; bytes past n_scales (message padding) read as zero
                    w[j] = reinterpret_cast<const uint32_t*>(src)[c];
                    const int have = n_scales - c * kScaleTileCols;
                    if (have < kScaleTileCols) w[j] &= (1u << (8 * have)) - 1u;
                }
            }
            for (unsigned rest = rows; rest; rest &= rest - 1) {
                long long row, scale_row;
                row_of(__ffs(rest) - 1, row, scale_row);
#pragma unroll
                for (int j = 0; j < kRegs; ++j) {
                    const int c = base + j * kWarp + lane;
                    if (c >= n_words) continue;
                    if constexpr (kFp8)
                        static_cast<uint32_t*>(a.scales_out)[static_cast<long long>(c) * ep[P_CAPACITY] + row] = w[j];
                    else
                        *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(a.scales_out) +
                                                     swizzled_scale_offset(scale_row, c * kScaleTileCols, k_tiles)) =
                            w[j];
                }
            }
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
__device__ __forceinline__ uint32_t* scale_rows(const EP& ep) {
    return reinterpret_cast<uint32_t*>(ep.local(ep[P_OFF_SCALE_ROWS]));
}
__device__ __forceinline__ uint32_t scale_ref(const EP& ep, const uint8_t* scales) {
    return static_cast<uint32_t>((scales - reinterpret_cast<const uint8_t*>(ep.local(0))) / 4);
}

// Bytes of a round's scales in the output layout from which the receive gathers them at the round's end (below,
// the half-written sectors mostly stay in L2 until full). 2 x H200, cold us, direct / gathered (scripts/ab_knobs.py
// --knobs 0x10 0x20, twelfth session): fp8 N = 1024 78.8 / 78.6, 2048 118.6 / 112.5, 4096 202.2 / 175.9, 8192
// 436.9 / 303.2; nvfp4 N = 512 57.6 / 51.7, 1024 76.5 / 64.8, 4096 197.7 / 149.6; mxfp4 N = 512 48.7 / 50.0,
// 1024 66.0 / 62.1, 4096 148.6 / 138.3 (about 0.9, 1.8, 3.7, 7.3, 14.7 MB of fp8 scales at N = 512 .. 8192; fp4
// counts each group's padded tiles, 3.7 MB for mxfp4 at N = 512).
constexpr long long kGatherScalesFrom = 2 << 20;

// Output rows [lo, hi) (fp8) or scale tiles [lo, hi) (fp4) from the messages' scales, warp w of n_warps taking
// every n_warps-th piece, every load of a piece issued before its stores. fp8: a piece is 32 rows, lane l row
// 32 p + l, its scales 16 at a time (four 16-byte loads), scale b of the 32 rows stored as one 128-byte line. fp4:
// a piece is a 128-row scale tile and 16 k-tiles; lane l takes rows l, l + 32, l + 64, l + 96, 4 words (16 bytes)
// of each row a load, and stores bytes 16 l .. 16 l + 15 of each (tile, kt) 512-byte block. Loads bypass L1 (peers
// wrote the messages).
template <int FMT>
__device__ void gather_scales(const EP& ep, const DispatchArgs& a, unsigned lo, unsigned hi, int warp, int n_warps,
                              int lane) {
    if (hi <= lo) return;
    const uint32_t* rows = scale_rows(ep);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(ep.local(0));
    const int n_scales = static_cast<int>(ep[P_N_SCALES]);
    if constexpr (FMT == kFmtFp8) {
        const long long cap = ep[P_CAPACITY];
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
        const int k_tiles = static_cast<int>(ep[P_K_TILES]), n_kg = (k_tiles + 15) / 16;
        const bool whole_words = n_scales % 4 == 0;  // else the last word of a row has bytes past the scales
        for (long long item = warp; item < static_cast<long long>(hi - lo) * n_kg; item += n_warps) {
            const long long T = lo + item / n_kg;
            const int kt0 = static_cast<int>(item % n_kg) * 16;
            uint32_t v[4][16];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint32_t ref = rows[T * kScaleTileRows + lane + 32 * q];
                const uint8_t* src = base + 4LL * ref;
#pragma unroll
                for (int k = 0; k < 16; ++k) v[q][k] = 0u;
                if (ref == kPadScales) continue;
                if (whole_words && ref % 4 == 0) {  // 16-byte aligned rows
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (kt0 + 4 * j < k_tiles) {
                            const uint4 w = __ldcg(reinterpret_cast<const uint4*>(src) + kt0 / 4 + j);
                            v[q][4 * j] = w.x, v[q][4 * j + 1] = w.y, v[q][4 * j + 2] = w.z, v[q][4 * j + 3] = w.w;
                        }
                } else {
#pragma unroll
                    for (int k = 0; k < 16; ++k)
                        for (int i = 0; i < kScaleTileCols; ++i) {
                            const int c = (kt0 + k) * kScaleTileCols + i;
                            if (kt0 + k < k_tiles && c < n_scales) v[q][k] |= uint32_t(__ldcg(src + c)) << (8 * i);
                        }
                }
            }
            uint8_t* out = static_cast<uint8_t*>(a.scales_out) + (T * k_tiles + kt0) * kScaleTileBytes + lane * 16;
#pragma unroll
            for (int k = 0; k < 16; ++k)
                if (kt0 + k < k_tiles)
                    *reinterpret_cast<uint4*>(out + k * kScaleTileBytes) = make_uint4(v[0][k], v[1][k], v[2][k], v[3][k]);
        }
    }
}

// ---- message chunk flags --------------------------------------------------------------------------------
// A message (one token for one destination) may be sent by several warps, one per chunk. Every record (a large
// round's metadata record, a small round's staging record) has a flag per chunk: after its stores and a
// system-scope fence, each chunk stores chunk_flag (the round's stamp and the chunk count). The message is complete
// when flag 0 carries this round's stamp and the chunk count n, and flags 1..n-1 the stamp. Nothing re-arms the
// flags (a stale flag carries an older round's stamp), so no round has an end-of-round count or a last block.
// (Large rounds had a 32-bit tag that every chunk added to, re-armed by the receive phase's last block: the count and
// the re-arm took the last 8 us of a 2 x H200 N = 4096 dispatch.)
constexpr int kMaxChunks = 255;

// A staged chunk's flag: the round's stamp (bits 8-30, never 0, so a zeroed flag is no round's) | the chunk count.
__device__ __forceinline__ unsigned chunk_stamp(int round) { return (static_cast<unsigned>(round) & 0x7FFFFFu) + 1u; }
__device__ __forceinline__ int chunk_flag(int round, int n_chunks) {
    return static_cast<int>(chunk_stamp(round) << 8 | static_cast<unsigned>(n_chunks));
}

// Wait (bounded; all lanes) until every chunk of a staged message has landed: flag 0 carries this round's stamp
// and the chunk count n, and flags 1..n-1 carry the stamp (each lane acquires its own flags, then the warp
// barrier orders every lane's reads after them). `n_flags`: the record's flags (>= any chunk count). False
// (after recording whom it waited for) on timeout or once the rank has failed.
__device__ bool warp_wait_chunk_flags(const int* flags, int n_flags, int round, const EP& ep, int kernel, int src,
                                      int lane, unsigned sleep_ns) {
    const unsigned stamp = chunk_stamp(round);
    SpinClock clock;  // lane 0's
    for (;;) {
        const unsigned v = lane < n_flags ? static_cast<unsigned>(load_acquire_sys_i32(flags + lane)) : 0u;
        const unsigned f0 = __shfl_sync(0xffffffffu, v, 0);
        bool landed = false;
        if ((f0 >> 8) == stamp) {
            const int n = static_cast<int>(f0 & 0xFFu);
            landed = __all_sync(0xffffffffu, lane >= n || (v >> 8) == stamp);
            for (int j0 = kWarp; landed && j0 < n; j0 += kWarp) {
                const int j = j0 + lane;
                landed = __all_sync(0xffffffffu,
                                    j >= n || (static_cast<unsigned>(load_acquire_sys_i32(flags + j)) >> 8) == stamp);
            }
        }
        if (landed) break;
        const int stop = lane == 0 && clock.stop(ep, kernel, src);
        if (__shfl_sync(0xffffffffu, stop, 0)) return false;
        __nanosleep(sleep_ns);
    }
    __syncwarp();
    return true;
}

// A tally row, one per (source, parity), written by the source into each destination:
// [tokens the source sends to each expert (E) | the source's token count | messages it sends to this destination].
// Each entry is one 64-bit store of (round + 1) << 32 | value, so the receiver takes an entry as soon as it carries
// the round's stamp: no system fence and no flag behind the row (a fence issued while the GPU's data was already
// on NVLink took 10-20 us). A tally row is also the readiness handshake: a rank publishes it only once it has
// consumed its previous round (stream order), and the stamps of one (row, parity) only grow.
__device__ __forceinline__ int tally_len(const EP& ep) { return static_cast<int>(ep[P_N_EXPERTS]) + 2; }
__device__ __forceinline__ uint64_t* tally_row(const EP& ep, int rank, int par, int src) {
    return reinterpret_cast<uint64_t*>(ep.peer(rank, ep[P_OFF_TALLY])) + (par * ep[P_N_SRC] + src) * tally_len(ep);
}
__device__ __forceinline__ uint64_t tally_entry(int round, int value) {
    return (static_cast<uint64_t>(round) + 1) << 32 | static_cast<uint32_t>(value);
}

// Publish [hist | num_tokens | n_msgs[dest]] of this round to every destination (all threads of the block).
__device__ void publish_tallies(const EP& ep, int round, const int* hist, int num_tokens, const int (&n_msgs)[8]) {
    const int E = static_cast<int>(ep[P_N_EXPERTS]), E1 = tally_len(ep), me = static_cast<int>(ep[P_SRC_INDEX]);
    const int n_dest = n_dest_ranks(ep);
    for (int d = 0; d < n_dest; ++d) {
        const int r = dest_rank(ep, d);
        uint64_t* dst = tally_row(ep, r, round & 1, me);
        int msgs = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) msgs = i == r ? n_msgs[i] : msgs;
        for (int e = threadIdx.x; e < E1; e += blockDim.x)
            store_relaxed_u64(dst + e, tally_entry(round, e < E ? hist[e] : (e == E ? num_tokens : msgs)));
    }
}

// Wait (bounded) for every source's tally row of this round and copy the values into shared memory. All threads
// of the block; false (after recording whom it waited for) on timeout or once the rank has failed.
__device__ bool load_tallies(const EP& ep, int round, int* s_tally, int kernel, int* s_ok, unsigned sleep_ns = 64) {
    const int E1 = tally_len(ep), n_src = static_cast<int>(ep[P_N_SRC]);
    const uint64_t* tally = tally_row(ep, static_cast<int>(ep[P_RANK]), round & 1, 0);
    const uint32_t stamp = static_cast<uint32_t>(round) + 1;
    if (threadIdx.x == 0) *s_ok = 1;
    __syncthreads();
    SpinClock clock;  // one for all of this thread's entries
    for (int i = threadIdx.x; i < n_src * E1; i += blockDim.x) {
        uint64_t v;
        while (static_cast<uint32_t>((v = load_acquire_u64(tally + i)) >> 32) != stamp) {
            if (clock.stop(ep, kernel, i / E1)) {
                *s_ok = 0;
                break;
            }
            __nanosleep(sleep_ns);
        }
        if (!*reinterpret_cast<volatile int*>(s_ok)) break;
        s_tally[i] = static_cast<int>(static_cast<uint32_t>(v));
    }
    __syncthreads();
    return *s_ok != 0;
}

// Rows of local expert group (rank r, local expert l) and the shared group of rank r, padded to the row alignment.
__device__ __forceinline__ int padded(long long n, const EP& ep) {
    const long long a = ep[P_ROW_ALIGN];
    return static_cast<int>((n + a - 1) / a * a);
}
__device__ __forceinline__ int shared_rows(const EP& ep, const int* s_tally, int r) {
    // The token count of rank r is the last column of its tally row (with skip_a2a, the only row is mine).
    if (!ep[P_SHARED]) return 0;
    const int idx = ep[P_SKIP_A2A] ? 0 : r;
    return padded(s_tally[idx * tally_len(ep) + ep[P_N_EXPERTS]], ep);
}

// Rows of one destination rank r, in expert order: for each local expert (thread-strided), its padded group size,
// scanned. `emit(e, group_start)` receives each expert's first row at rank r (shared-expert rows come first).
template <typename Emit>
__device__ void scan_rank_groups(const EP& ep, const int* s_tally, int r, int* s_scan, Emit emit) {
    const int L = static_cast<int>(ep[P_N_LOCAL]), E1 = tally_len(ep);
    const int n_src = static_cast<int>(ep[P_N_SRC]);
    int carry = shared_rows(ep, s_tally, r);
    for (int l0 = 0; l0 < L; l0 += blockDim.x) {
        const int l = l0 + threadIdx.x;
        const int e = r * L + l;
        int size = 0;
        if (l < L) {
            int n = 0;
            for (int s = 0; s < n_src; ++s) n += s_tally[s * E1 + e];
            size = padded(n, ep);
        }
        int total;
        const int incl = block_inclusive_scan(size, s_scan, &total);
        if (l < L) emit(e, l, carry + incl - size, size);
        carry += total;
    }
    __syncthreads();
}

// Sum of tallies of sources before `src` for expert e: where src's block of rows starts inside e's group.
__device__ __forceinline__ int rows_before(const EP& ep, const int* s_tally, int src, int e) {
    const int E1 = tally_len(ep);
    int n = 0;
    for (int s = 0; s < src; ++s) n += s_tally[s * E1 + e];
    return n;
}

// Message slots in token order: the slot of (token t, rank r) is the number of earlier tokens that go to r
// (`masks[t]`: the token's destination ranks). Each destination then holds a source's messages in token order, and
// the combine, which goes through them in slot order, returns every source's tokens roughly in order.
// Called by all threads of the block; `store(t, r, slot)` for every message; n_msgs[r] (every thread): the
// messages to rank r. Each warp takes a contiguous range of kBatch x 32 tokens per pass (lane = token; coalesced
// loads, all issued at once): per-rank counts by ballot, a prefix over the warps, then the slots. (One thread per
// contiguous range, loading its tokens one by one, took 15 us at N = 4096.) kBatch: tokens per lane and pass.
template <int kBatch, class Store>
__device__ void assign_message_slots(const int* masks, int n_tokens, int R, int (&n_msgs)[8], Store store) {
    __shared__ int s_counts[32 * 8];
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
    const unsigned lanes_before = (1u << lane) - 1u;
#pragma unroll
    for (int r = 0; r < 8; ++r) n_msgs[r] = 0;
    for (int base = 0; base < n_tokens; base += kBatch * kWarp * n_warps) {
        const int t0 = base + warp * kBatch * kWarp + lane;
        unsigned m[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) m[j] = t0 + j * kWarp < n_tokens ? masks[t0 + j * kWarp] : 0u;
        __syncthreads();  // the previous pass is done with s_counts
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            int c = 0;
#pragma unroll
            for (int j = 0; j < kBatch; ++j) c += __popc(__ballot_sync(0xffffffffu, (m[j] >> r) & 1u));
            if (lane == 0) s_counts[warp * 8 + r] = c;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            if (r >= R) break;
            int run = n_msgs[r], total = 0;
            for (int w = 0; w < n_warps; ++w) {
                const int c = s_counts[w * 8 + r];
                run += w < warp ? c : 0;
                total += c;
            }
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                const bool to_r = (m[j] >> r) & 1u;
                const unsigned b = __ballot_sync(0xffffffffu, to_r);
                if (to_r) store(t0 + j * kWarp, r, run + __popc(b & lanes_before));
                run += __popc(b);
            }
            n_msgs[r] += total;
        }
    }
    __syncthreads();
}

// ---- small rounds (decode): the staged protocol ----------------------------------------------------------------
// A round in which this rank sends at most P_SMALL_TOKENS tokens does not wait for any bookkeeping before its data
// moves. Token t goes to record t of this source's staging area at each destination it has a valid choice on
// (records of meta | payload, two parities): each send warp finds its token's destinations from its own top-k row.
// Meanwhile block 0 (notify) computes the round's bookkeeping in shared memory, in token order: the histogram,
// each destination's token mask and each choice's position in its (expert, this source) block, and publishes them
// (the tally row and a book row per destination, stamped entries). The receiver lays its rows out from the
// histograms, lists each source's messages from the token masks (message i of source s: its i-th token that comes
// here, as a large round's message slots), and copies each payload to its rows (block start + position). The only
// wait before sending is that every destination has finished the round before last (whose staging parity this
// round reuses): the destination's histogram of the previous round, normally long there. (Until the sixth
// session every send block computed the whole book itself before its first store: 7 us of a 2-GPU decode.)
__device__ __forceinline__ bool small_round(const EP& ep, int num_tokens) {
    return ep[P_SMALL_TOKENS] > 0 && num_tokens <= ep[P_SMALL_TOKENS];
}
// A source's round is staged iff its token count (tally column E) was small: the receiver's view of the same rule.
__device__ __forceinline__ bool staged_source(const EP& ep, const int* s_tally, int s) {
    return ep[P_SMALL_TOKENS] > 0 && s_tally[s * tally_len(ep) + ep[P_N_EXPERTS]] <= ep[P_SMALL_TOKENS];
}
// Bytes of a record before its payload: metadata, then chunk flags (a meta record is just that).
__device__ __forceinline__ long long record_head_bytes(const EP& ep) { return ep[P_STAGE_RECORD] - ep[P_PAYLOAD_BYTES]; }

// The metadata record of message slot i of source s in rank `rank`'s buffer, followed by the message's chunk flags
// (message_flags). Staged (a small round): record i (the token index) of the staging area at parity par: metadata,
// chunk flags, payload (staged_payload). Direct: record i (the message slot) of the meta region, metadata (its first
// int is the token) and chunk flags; the payload went to the row of the token's first local expert.
__device__ __forceinline__ char* message_meta(const EP& ep, int rank, bool staged, int par, int s, int i) {
    if (staged)
        return ep.peer(rank, ep[P_OFF_STAGE]) + ((par * ep[P_N_SRC] + s) * ep[P_SMALL_TOKENS] + i) * ep[P_STAGE_RECORD];
    const long long stride = record_head_bytes(ep);
    return ep.peer(rank, ep[P_OFF_META]) + (s * ep[P_MAX_TOKENS] + i) * stride;
}
__device__ __forceinline__ int* message_flags(const EP& ep, const char* meta) {
    return reinterpret_cast<int*>(const_cast<char*>(meta) + ep[P_META_BYTES]);
}
__device__ __forceinline__ char* staged_payload(const EP& ep, const char* meta) {
    return const_cast<char*>(meta) + record_head_bytes(ep);
}
// Chunk flags of a record: one per 256-value span of the hidden size (cuep/config.py: stage_flag_bytes).
__device__ __forceinline__ int message_flag_count(const EP& ep) {
    return static_cast<int>((ep[P_HIDDEN] + kWarpSpan - 1) / kWarpSpan);
}

// A small round's book row, one per (parity, source) in each destination, after the staging records (the stage
// region; cuep/config.py sizes it), entries stamped like the tally's:
//   [ceil(S / 32)]  the source's token mask for this destination (word w, bit b: token 32 w + b comes here),
//   [S * K]         choice c of the source's [N, K] table: its expert (kNoExpert if not valid) | its position in
//                   the (expert, source) block << 16,
// S = small_tokens. The receiver has a message's rows before its payload lands; the router weights ride in the
// staging record's metadata (a second [S * K] of weights made the book row twice as long, and the book is what
// the receiver waits for first).
__device__ __forceinline__ int book_mask_words(const EP& ep) { return static_cast<int>((ep[P_SMALL_TOKENS] + 31) / 32); }
__device__ __forceinline__ int book_len(const EP& ep) {
    return book_mask_words(ep) + static_cast<int>(ep[P_SMALL_TOKENS] * ep[P_TOP_K]);
}
__device__ __forceinline__ uint64_t* book_row(const EP& ep, int rank, int par, int s) {
    char* books = ep.peer(rank, ep[P_OFF_STAGE]) + 2 * ep[P_N_SRC] * ep[P_SMALL_TOKENS] * ep[P_STAGE_RECORD];
    return reinterpret_cast<uint64_t*>(books) + (par * ep[P_N_SRC] + s) * book_len(ep);
}

// Spin (this thread, acquire, bounded) until the stamped entry *p carries `stamp`; its value in `value`. False
// (after recording whom it waited for) on timeout or once the rank has failed.
__device__ __forceinline__ bool wait_stamped(const EP& ep, const uint64_t* p, uint32_t stamp, int kernel, int src,
                                             uint32_t& value, unsigned sleep_ns = 32) {
    uint64_t v;
    SpinClock clock;
    while (static_cast<uint32_t>((v = load_acquire_u64(p)) >> 32) != stamp) {
        if (clock.stop(ep, kernel, src)) return false;
        __nanosleep(sleep_ns);
    }
    value = static_cast<uint32_t>(v);
    return true;
}

constexpr uint16_t kNoExpert = 0xFFFF;

// Block 0's bookkeeping of a small round, in shared memory (sizes: small_book_bytes; cuep/ep.py mirrors it).
struct SmallBook {
    uint16_t* expert;  // [N*K] the choice's expert if valid, else kNoExpert
    uint16_t* pos;     // [N*K] its position in the (expert, this source) block at the destination (token order)
    unsigned* words;   // [8 * ceil(D / 32)] each destination rank's token mask (bit t % 32 of word t / 32)
    int* mask;         // [N] the token's destination ranks
    unsigned* bits;    // [E * ceil(D / 32)] each expert's token mask (which tokens chose it)
    int* hist;         // [E] tokens to each expert
    int* n_msgs;       // [8] messages to each rank
};

__device__ __forceinline__ SmallBook small_book(const EP& ep, char* smem) {
    const long long D = ep[P_SMALL_TOKENS], K = ep[P_TOP_K], E = ep[P_N_EXPERTS], W = (D + 31) / 32;
    SmallBook b;
    char* p = smem;
    b.expert = reinterpret_cast<uint16_t*>(p); p += align_up(2 * D * K);
    b.pos = reinterpret_cast<uint16_t*>(p); p += align_up(2 * D * K);
    b.words = reinterpret_cast<unsigned*>(p); p += align_up(4 * kMaxRanks * W);
    b.mask = reinterpret_cast<int*>(p); p += align_up(4 * D);
    b.bits = reinterpret_cast<unsigned*>(p); p += align_up(4 * E * W);
    b.hist = reinterpret_cast<int*>(p); p += align_up(4 * E);
    b.n_msgs = reinterpret_cast<int*>(p);
    return b;
}
__device__ __forceinline__ long long small_book_bytes(const EP& ep) {
    const long long D = ep[P_SMALL_TOKENS], K = ep[P_TOP_K], E = ep[P_N_EXPERTS], W = (D + 31) / 32;
    return 2 * align_up(2 * D * K) + align_up(4 * kMaxRanks * W) + align_up(4 * D) + align_up(4 * E * W) +
           align_up(4 * E) + 4 * kMaxRanks;
}

// Fill the book (all threads of the block; ends with a block barrier). `report`: this block records bad choices.
// A thread per choice throughout, so the whole book is three passes with a barrier after each (the first version,
// 16 token ranges counted warp by warp after a __match_any_sync pass, took 4 us after the ids landed):
//   1. the ids into shared memory (out-of-range ones marked), the masks cleared;
//   2. each choice's validity (no earlier choice of its token with the same expert, skip_a2a's locality), then
//      atomicOr of the token into its expert's token mask and of the expert's rank into the token's rank mask;
//   3. positions: the popcount of the expert's token mask below the token; the histogram: the mask's popcount.
__device__ void small_bookkeeping(const EP& ep, const DispatchArgs& a, const SmallBook& b, bool report) {
    const int E = static_cast<int>(ep[P_N_EXPERTS]), K = static_cast<int>(ep[P_TOP_K]);
    const int L = static_cast<int>(ep[P_N_LOCAL]), R = static_cast<int>(ep[P_N_RANKS]);
    const int N = a.num_tokens, NK = N * K;
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
    // parameters in registers: the loops below store to shared memory through generic pointers and may report
    // errors, after which the compiler would reload every ep[] (this mattered when the block was in global memory)
    const bool skip = ep[P_SKIP_A2A] != 0;
    const int my_rank = static_cast<int>(ep[P_RANK]);
    const int W = (N + 31) / 32;  // words of a token mask this round (the arrays are sized for small_tokens)
    // 1. Every id at once (coalesced, independent loads); out-of-range ones marked. The masks cleared.
    for (int c = threadIdx.x; c < NK; c += blockDim.x) {
        const int v = a.topk_ids[c];
        const bool ok = v >= 0 && v < E;
        if (!ok && report) report_error(ep, kStatusBadExpertId, K_DISPATCH_SEND, v, c / K);
        b.expert[c] = ok ? static_cast<uint16_t>(v) : kNoExpert;
    }
    for (int i = threadIdx.x; i < E * W; i += blockDim.x) b.bits[i] = 0u;
    for (int t = threadIdx.x; t < N; t += blockDim.x) b.mask[t] = 0;
    __syncthreads();
    CUEP_TRACE(ep, report, 18);
    // 2. Validity and the masks. b.pos carries the validity to pass 3 (b.expert must stay intact until every
    // thread has compared its choice with the earlier ones).
    for (int c = threadIdx.x; c < NK; c += blockDim.x) {
        const int t = c / K, k = c - t * K, e = b.expert[c];
        bool valid = e != kNoExpert;
        bool repeat = false;
        for (int j = 0; valid && j < k; ++j) repeat |= b.expert[t * K + j] == e;
        if (report && valid && repeat && (!skip || e / L == my_rank))
            report_error(ep, kStatusDuplicateExpert, K_DISPATCH_SEND, e, t);
        valid = valid && !repeat && (!skip || e / L == my_rank);
        if (valid) {
            atomicOr(b.bits + e * W + t / 32, 1u << (t % 32));
            atomicOr(b.mask + t, 1 << (e / L));
        }
        b.pos[c] = valid ? 1 : 0;
    }
    __syncthreads();
    CUEP_TRACE(ep, report, 19);
    // 3. Positions in token order (the earlier tokens of the expert's mask), the histogram.
    for (int c = threadIdx.x; c < NK; c += blockDim.x) {
        if (!b.pos[c]) {
            b.expert[c] = kNoExpert;
            continue;
        }
        const int t = c / K, e = b.expert[c];
        const unsigned* m = b.bits + e * W;
        int pos = __popc(m[t / 32] & ((1u << (t % 32)) - 1u));
        for (int w = 0; w < t / 32; ++w) pos += __popc(m[w]);
        b.pos[c] = static_cast<uint16_t>(pos);
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int n = 0;
        for (int w = 0; w < W; ++w) n += __popc(b.bits[e * W + w]);
        b.hist[e] = n;
    }
    CUEP_TRACE(ep, report, 21);
    // 4. Each destination's token mask (a warp per 32 tokens, a ballot per rank), then its message count.
    const int stride = static_cast<int>((ep[P_SMALL_TOKENS] + 31) / 32);
    __syncthreads();
    for (int w = warp; w < W; w += n_warps) {
        const int t = w * kWarp + lane;
        const unsigned m = t < N ? static_cast<unsigned>(b.mask[t]) : 0u;
        for (int r = 0; r < R; ++r) {
            const unsigned word = __ballot_sync(0xffffffffu, (m >> r) & 1u);
            if (lane == 0) b.words[r * stride + w] = word;
        }
    }
    __syncthreads();
    if (threadIdx.x < kMaxRanks) {
        int m = 0;
        for (int w = 0; static_cast<int>(threadIdx.x) < R && w < W; ++w)
            m += __popc(b.words[threadIdx.x * stride + w]);
        b.n_msgs[threadIdx.x] = m;
    }
    __syncthreads();
}

// Publish the book rows of a small round to every destination (all threads of the block; after the tallies).
__device__ void publish_small_book(const EP& ep, const DispatchArgs& a, int round, const SmallBook& b) {
    const int K = static_cast<int>(ep[P_TOP_K]), me = static_cast<int>(ep[P_SRC_INDEX]);
    const int n_dest = n_dest_ranks(ep);
    const int stride = book_mask_words(ep), n_words = (a.num_tokens + 31) / 32, NK = a.num_tokens * K;
    for (int d = 0; d < n_dest; ++d) {
        const int r = dest_rank(ep, d);
        uint64_t* row = book_row(ep, r, round & 1, me);
        for (int i = threadIdx.x; i < n_words; i += blockDim.x)
            store_relaxed_u64(row + i, tally_entry(round, static_cast<int>(b.words[r * stride + i])));
        for (int c = threadIdx.x; c < NK; c += blockDim.x) {
            const unsigned e = b.expert[c], pos = e != kNoExpert ? b.pos[c] : 0u;
            store_relaxed_u64(row + stride + c, tally_entry(round, static_cast<int>(e | pos << 16)));
        }
    }
}

// A small round may write into a destination once it has finished the round before last (whose staging parity
// and tally row this round reuses): its tally row of the previous round is here (stamp >= round). All threads.
// `early`: the rows' first entries of both parities ([parity][source], acquired at kernel entry beside the entry
// counters' load, dispatch_kernel), or nullptr: when they already say so there is nothing to wait for (the usual
// case: a fused round's receive read those very rows), which saves a dependent L2 round trip before the first store.
__device__ __forceinline__ bool small_round_ready(const EP& ep, int round, int* s_ok, const uint64_t* early) {
    if (early) {
        const int n_src = static_cast<int>(ep[P_N_SRC]);
        bool ready = true;
        for (int s = 0; s < n_src; ++s)
            ready = ready && (early[((round + 1) & 1) * n_src + s] >> 32) >= static_cast<uint64_t>(round);
        if (ready) {
            if (threadIdx.x == 0) *s_ok = 1;  // as block_wait_flags leaves it (the caller syncs before reading it)
            return true;
        }
    }
    const uint64_t* rows = tally_row(ep, static_cast<int>(ep[P_RANK]), (round + 1) & 1, 0);
    return block_wait_flags(rows, static_cast<int>(ep[P_N_SRC]),
                            [round](uint64_t v) { return (v >> 32) >= static_cast<uint64_t>(round); }, ep,
                            K_DISPATCH_SEND, s_ok, tally_len(ep));
}

// ---- phases ---------------------------------------------------------------------------------------------------

// Per-call scratch private to the rank: each choice's slot inside its (expert, my source index) block, each
// (token, destination rank)'s message slot inside its token range, each token's destination ranks (bit mask), and
// per token range its first message slot at each destination. Filled by notify, read by send.
__device__ __forceinline__ int* scratch_pos(const EP& ep) { return reinterpret_cast<int*>(ep.local(ep[P_OFF_SCRATCH])); }
__device__ __forceinline__ int* scratch_slot(const EP& ep) { return scratch_pos(ep) + ep[P_MAX_TOKENS] * ep[P_TOP_K]; }
__device__ __forceinline__ int* scratch_rank_masks(const EP& ep) { return scratch_slot(ep) + ep[P_MAX_TOKENS] * kMaxRanks; }
__device__ __forceinline__ int* scratch_range_base(const EP& ep) { return scratch_rank_masks(ep) + ep[P_MAX_TOKENS]; }
// Tokens per notify range: block b of notify numbers tokens [b x len, (b + 1) x len) (0 in a round without tokens,
// which has no send items). Notify and send run on the same grid (cuep/ep.py: one block per SM of the buffer).
__device__ __forceinline__ int notify_range_len(int num_tokens) {
    const int n_ranges = min(static_cast<int>(gridDim.x), kNotifyRanges);
    return (num_tokens + n_ranges - 1) / n_ranges;
}

// notify: one warp per token, lane k = choice k. Reserve every slot with an atomic (the histogram is the slot
// counter); each block takes a contiguous token range and numbers its messages in token order; the last block
// turns the ranges' message counts into their first slots and publishes the histogram to every destination.
__device__ void phase_notify(const EP& ep, const DispatchArgs& a, int round, int* s_flag, char* smem,
                             const uint64_t* early_ready) {
    const int E = static_cast<int>(ep[P_N_EXPERTS]), K = static_cast<int>(ep[P_TOP_K]);
    const int L = static_cast<int>(ep[P_N_LOCAL]);
    int* ctr = ep.counters();
    int* hist = ctr + C_HIST;
    int* pos = scratch_pos(ep);
    int* slot = scratch_slot(ep);
    int* masks = scratch_rank_masks(ep);
    if (small_round(ep, a.num_tokens)) {
        // Small round: no atomics and no grid barrier. Block 0 computes the book (reporting bad choices) and
        // publishes the tally and the book rows; in a fused launch it sends nothing (the other send blocks store
        // the tokens meanwhile, needing no book).
        if (blockIdx.x != 0) return;
        __shared__ int s_ok;
        const SmallBook book = small_book(ep, smem);
        small_bookkeeping(ep, a, book, /*report=*/true);  // writes nothing outside the block: before the wait
        CUEP_TRACE(ep, true, 1);
        if (!small_round_ready(ep, round, &s_ok, early_ready)) return;
        CUEP_TRACE(ep, true, 22);
        int n_msgs[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) n_msgs[i] = book.n_msgs[i];
        publish_tallies(ep, round, book.hist, a.num_tokens, n_msgs);
        publish_small_book(ep, a, round, book);
        // (with knob kKnobTallyWait the send blocks start only once these stores are issued: a plain flag, no
        // release; nothing depends on the order, the receiver checks every entry's stamp)
        __syncthreads();
        if (threadIdx.x == 0) *reinterpret_cast<volatile int*>(ep.counters() + C_SMALL_TALLY) = round + 1;
        CUEP_TRACE(ep, true, 2);
        return;
    }
    // Lanes in segments of W (a power of two >= K), one token each, lane k of a segment = choice k: repeats and
    // first choices per rank found with shuffles inside the segment. Block b takes token range b (contiguous, at
    // most kNotifyRanges ranges). (A warp per token, lanes K..31 idle, took 11 us at N = 4096 on 2 x H200, 18.5 at
    // 8192: two and four passes of dependent loads and atomics.)
    const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    const int R = static_cast<int>(ep[P_N_RANKS]);
    const int n_ranges = min(static_cast<int>(gridDim.x), kNotifyRanges);
    const int range_len = notify_range_len(a.num_tokens);
    const int lo = min(a.num_tokens, static_cast<int>(blockIdx.x) * range_len);
    const int hi = static_cast<int>(blockIdx.x) < n_ranges ? min(a.num_tokens, lo + range_len) : lo;
    const int W = K <= 1 ? 1 : 1 << (32 - __clz(K - 1)), per_warp = kWarp / W;
    const int seg = lane / W, k = lane % W;
    const unsigned seg_bits = W == kWarp ? 0xffffffffu : (1u << W) - 1u;
    for (int t0 = lo + static_cast<int>(threadIdx.x) / kWarp * per_warp; t0 < hi; t0 += n_warps * per_warp) {
        const int t = t0 + seg;
        const bool choice = t < hi && k < K;
        const long long i = static_cast<long long>(t) * K + k;
        const int e = choice ? a.topk_ids[i] : -1;
        const bool in_range = choice && e >= 0 && e < E;
        const bool repeat = warp_repeats_earlier(e, k, K, W);
        if (choice && !in_range) report_error(ep, kStatusBadExpertId, K_DISPATCH_SEND, e, t);
        const bool local_ok = !ep[P_SKIP_A2A] || (in_range && e / L == ep[P_RANK]);
        if (in_range && repeat && local_ok) report_error(ep, kStatusDuplicateExpert, K_DISPATCH_SEND, e, t);
        const bool valid = in_range && !repeat && local_ok;
        const unsigned valid_mask = (__ballot_sync(0xffffffffu, valid) >> (seg * W)) & seg_bits;
        const int r = valid ? e / L : -1;
        const bool first = warp_first_of_rank(r, valid_mask, k, K, W);
        if (valid) pos[i] = atomicAdd(hist + e, 1);
        // The ranks the token goes to (one message each), for the slots below.
        unsigned to_ranks = first ? 1u << r : 0u;
        for (int o = 1; o < W; o <<= 1) to_ranks |= __shfl_xor_sync(0xffffffffu, to_ranks, o, W);
        if (k == 0 && t < hi) masks[t] = static_cast<int>(to_ranks);
    }
    // Message slots in token order inside the range (atomics gave the choices' slots in scheduling order); the
    // range's message count per destination for the last block. (The last block numbering all N tokens alone took
    // 7.3 us of a 2 x H200 N = 4096 dispatch.)
    __syncthreads();  // the block's masks
    int n_msgs[8];    // messages to each rank: of the range, then (last block) of the round
    if (static_cast<int>(blockIdx.x) < n_ranges) {
        assign_message_slots<1>(masks + lo, hi - lo, R, n_msgs, [slot, lo](int t, int r, int v) {
            slot[static_cast<long long>(lo + t) * kMaxRanks + r] = v;
        });
        if (threadIdx.x < kMaxRanks) {
            int c = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) c = i == static_cast<int>(threadIdx.x) ? n_msgs[i] : c;
            scratch_range_base(ep)[blockIdx.x * kMaxRanks + threadIdx.x] = c;
        }
    }
    CUEP_TRACE(ep, blockIdx.x == 0, 1);
    CUEP_TRACE_LATEST(ep, threadIdx.x == 0, 6);
    if (!last_block_done(ctr + C_DONE_NOTIFY, s_flag, /*peer_writes=*/false)) return;
    CUEP_TRACE(ep, true, 11);
    // Last block: each range's first slot at each destination (exclusive scan of the range counts, in place; warp
    // r scans destination r, each lane kNotifyRanges / 32 consecutive ranges), and the round's message counts.
    {
        __shared__ int s_msgs[kMaxRanks];
        int* base = scratch_range_base(ep);
        const int r = static_cast<int>(threadIdx.x) / kWarp;
        if (r < R) {
            constexpr int kPer = kNotifyRanges / kWarp;
            int c[kPer], sum = 0;
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
                const int g = lane * kPer + j;
                c[j] = g < n_ranges ? base[g * kMaxRanks + r] : 0;
                sum += c[j];
            }
            int incl = sum;
            for (int o = 1; o < kWarp; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            int run = incl - sum;
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
                const int g = lane * kPer + j;
                if (g < n_ranges) base[g * kMaxRanks + r] = run;
                run += c[j];
            }
            if (lane == kWarp - 1) s_msgs[r] = incl;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 8; ++i) n_msgs[i] = i < R ? s_msgs[i] : 0;
    }
    CUEP_TRACE(ep, true, 12);
    // Publish [hist | num_tokens | messages for you] to every destination's tally row for me; re-arm the histogram.
    // The fence: this rank's send blocks read the scratch slots once they see their own tally row.
    __threadfence();
    publish_tallies(ep, round, hist, a.num_tokens, n_msgs);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    if (threadIdx.x == 0) ctr[C_DONE_NOTIFY] = 0;
    CUEP_TRACE(ep, true, 2);
}

// send: every rank's layout from the histograms, then one warp per token: encode it once (shared memory, or
// straight from x for bf16) and store it to each destination rank it goes to.
template <int FMT, typename T>
__device__ void phase_send(const EP& ep, const DispatchArgs& a, int round, char* smem, int send_blocks,
                           bool book_ready, bool local_from_x, const uint64_t* early_ready, int knobs) {
    const int E = static_cast<int>(ep[P_N_EXPERTS]), K = static_cast<int>(ep[P_TOP_K]);
    const int L = static_cast<int>(ep[P_N_LOCAL]), H = static_cast<int>(ep[P_HIDDEN]);
    const int R = static_cast<int>(ep[P_N_RANKS]), rank = static_cast<int>(ep[P_RANK]);
    const int n_src = static_cast<int>(ep[P_N_SRC]), me = static_cast<int>(ep[P_SRC_INDEX]);
    const int par = round & 1;
    int* ctr = ep.counters();
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;

    __shared__ int s_ok;
    __shared__ int s_scan[32];

    // Blocks past `send_blocks` only receive (fused launch): they go straight to the end-of-phase barrier. In a
    // small round block 0 computed the book in this launch's notify phase (book_ready): the other blocks send.
    const bool small = small_round(ep, a.num_tokens);
    const int first_sender = small && book_ready && send_blocks > 1 ? 1 : 0;
    const int n_senders = send_blocks - first_sender;
    if (static_cast<int>(blockIdx.x) >= send_blocks || static_cast<int>(blockIdx.x) < first_sender) goto done;
    {
    // shared memory: (tallies | per-expert bases) or a small round's book (notify) | one encoded token per warp
    const long long tally_bytes = align_up(4LL * n_src * tally_len(ep));
    const long long fixed = max(tally_bytes + align_up(4LL * E), ep[P_SMALL_TOKENS] > 0 ? small_book_bytes(ep) : 0LL);
    int* s_tally = reinterpret_cast<int*>(smem);
    int* s_base = reinterpret_cast<int*>(smem + tally_bytes);
    const long long pb = ep[P_PAYLOAD_BYTES];
    const int sb = static_cast<int>(ep[P_SCALE_BYTES]);
    const long long staging = align_up(pb) + align_up(sb);
    uint8_t* s_payload = reinterpret_cast<uint8_t*>(smem + fixed) + warp * staging;
    uint8_t* s_scales = s_payload + align_up(pb);
    // Items (token, chunk of whole 256-value spans): see 2. below.
    const int n_spans = (H + kWarpSpan - 1) / kWarpSpan;
    const int spans_per_chunk = static_cast<int>(max(
        chunk_units(a.num_tokens, n_spans, 1, static_cast<long long>(n_senders) * n_warps),
        static_cast<long long>((n_spans + kMaxChunks - 1) / kMaxChunks)));
    const int n_chunks = (n_spans + spans_per_chunk - 1) / spans_per_chunk;
    if (small) {
        // 0s. The warp's first item's chunk of x and top-k row into L2 while the readiness wait below runs: both are
        // cold in a decode round, and nothing but the stores needs the wait (knob kKnobNoPrefetch: without).
        const int item0 = warp * n_senders + static_cast<int>(blockIdx.x) - first_sender;
        if (!(knobs & kKnobNoPrefetch) && item0 < a.num_tokens * n_chunks) {
            const int t = item0 / n_chunks, ch = item0 % n_chunks;
            const int c_lo = ch * spans_per_chunk * kWarpSpan, c_hi = min(H, c_lo + spans_per_chunk * kWarpSpan);
            const char* x_lo = static_cast<const char*>(a.x) + (static_cast<long long>(t) * H + c_lo) * sizeof(T);
            for (int b = 128 * lane; b < (c_hi - c_lo) * static_cast<int>(sizeof(T)); b += 128 * kWarp)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(x_lo + b));
            if (lane == kWarp - 1)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(a.topk_ids + static_cast<long long>(t) * K));
        }
        // 1s. Every destination is ready (small_round_ready). No book: a token's record is its index, and each
        // warp finds its token's destinations itself. The send blocks do not wait for block 0's tally and book
        // stores (2 x H200, N = 128 bf16: 29.1-29.4 us against 32.4-32.8 with the wait; knob kKnobTallyWait
        // restores it): the receiver waits for the tallies, the book rows and each message's chunk flags anyway.
        if (!small_round_ready(ep, round, &s_ok, early_ready)) return;
        CUEP_TRACE(ep, static_cast<int>(blockIdx.x) == first_sender, 3);
        if (warp == 0 && (knobs & kKnobTallyWait) &&
            !warp_wait_until(ctr + C_SMALL_TALLY, [round](int v) { return v >= round + 1; }, ep, K_DISPATCH_SEND,
                             -1, lane))
            s_ok = 0;
        __syncthreads();
        if (!s_ok) return;
    } else {
        // 1. Every source's histogram of this round (also: every destination is ready for it).
        if (!load_tallies(ep, round, s_tally, K_DISPATCH_SEND, &s_ok)) return;
        CUEP_TRACE(ep, blockIdx.x == 0, 3);
        const int n_dest = n_dest_ranks(ep);
        for (int d = 0; d < n_dest; ++d) {
            const int r = dest_rank(ep, d);
            scan_rank_groups(ep, s_tally, r, s_scan, [&](int e, int, int start, int) {
                s_base[e] = start + rows_before(ep, s_tally, me, e);
            });
        }
    }

    CUEP_TRACE(ep, static_cast<int>(blockIdx.x) == first_sender, 4);
    CUEP_TRACE_LATEST(ep, threadIdx.x == 0, 28);
    // 2. Items (token, chunk of whole 256-value spans), one warp each; lane k holds top-k choice k. A prefill batch
    // keeps one chunk (one warp) per token; a decode batch spreads each token over several warps (one warp
    // storing a whole token to every destination was what a small batch waited for). Every chunk sets its flag in
    // the message's record (chunk_flag) last, so the receiver knows when all of a message has landed.
    const int* pos = scratch_pos(ep);
    const int* slots = scratch_slot(ep);
    const int* range_base = scratch_range_base(ep);
    const int range_len = small ? 1 : notify_range_len(a.num_tokens);
    // The message slot of (token t, destination d): a small round's staging record is the token's index, a large
    // round's slot is notify's slot inside the token's range plus the range's first slot.
    auto message_slot = [&](int t, int d) -> int {
        return small ? t
                     : slots[static_cast<long long>(t) * kMaxRanks + d] + range_base[(t / range_len) * kMaxRanks + d];
    };
    using S = typename FormatTraits<FMT>::Scale;
    using SendVectors = WarpVectors<4>;
    // Consecutive items go to different blocks (SMs) first, so a small batch still spreads over the GPU.
    for (int item = warp * n_senders + blockIdx.x - first_sender; item < a.num_tokens * n_chunks;
         item += n_senders * n_warps) {
        const int t = item / n_chunks, ch = item % n_chunks;
        const int c_lo = ch * spans_per_chunk * kWarpSpan, c_hi = min(H, c_lo + spans_per_chunk * kWarpSpan);
        const bool last = ch == n_chunks - 1;
        // the chunk's bytes of the payload and of the per-row scales (16- and 8-byte aligned)
        const long long p_lo = payload_offset<FMT>(c_lo), p_hi = last ? pb : payload_offset<FMT>(c_hi);
        const int s_lo = FMT == kFmtBf16 ? 0 : int(sizeof(S)) * (c_lo / max(1, FormatTraits<FMT>::kBlock));
        const int s_hi = FMT == kFmtBf16 ? 0 : (last ? static_cast<int>(align_up(sb)) :
                                                int(sizeof(S)) * (c_hi / max(1, FormatTraits<FMT>::kBlock)));
        const T* x_row = static_cast<const T*>(a.x) + static_cast<long long>(t) * H;
        // bf16 input goes out as it is: the chunk's first 2 KiB are loaded before the top-k row, so the two loads
        // (both cold in a decode round) are in flight together instead of one after the other
        constexpr bool kDirectPayload = FMT == kFmtBf16 && sizeof(T) == 2;
        SendVectors first_pass;
        if constexpr (kDirectPayload)
            first_pass.load(reinterpret_cast<const uint8_t*>(x_row) + p_lo,
                            static_cast<int>(min(static_cast<long long>(SendVectors::kBytes), p_hi - p_lo)), lane);
        const int* ids = a.topk_ids + static_cast<long long>(t) * K;
        int e = -1, r = -1, row = -1;
        float w = 0.f;
        if (lane < K) {
            e = ids[lane];
            if (small) {  // a choice on the destination (the book row tells the receiver its expert and position)
                if (valid_choice(ep, ids, lane)) {
                    r = e / L;
                    row = 0;
                }
            } else if (valid_choice(ep, ids, lane)) {
                r = e / L;
                row = s_base[e] + pos[static_cast<long long>(t) * K + lane];
            }
            if (a.topk_weights) w = a.topk_weights[static_cast<long long>(t) * K + lane];
        }
        // Encode the chunk once: quantized formats (and bf16 from float32) into this warp's staging, at the
        // offsets of the whole row; bf16 goes straight from x.
        const uint8_t* payload;
        if constexpr (kDirectPayload) {
            payload = reinterpret_cast<const uint8_t*>(x_row);
        } else {
            // Four spans per step while they last (4 loads in flight per lane: one span at a time left the
            // encode waiting on each load), then one at a time.
            const RowSource<T, FMT != kFmtBf16> src{x_row};
            const RowScales<S> row_scales{reinterpret_cast<S*>(s_scales)};
            int col0 = c_lo;
            for (; col0 + kEncodeSteps * kWarpSpan <= c_hi; col0 += kEncodeSteps * kWarpSpan) {
                if constexpr (FMT == kFmtBf16)
                    warp_quantize_span<FMT, kEncodeSteps>(src, col0, H, s_payload, NoScales{}, a.global_scale, lane);
                else
                    warp_quantize_span<FMT, kEncodeSteps>(src, col0, H, s_payload, row_scales, a.global_scale, lane);
            }
            for (; col0 < c_hi; col0 += kWarpSpan) {
                if constexpr (FMT == kFmtBf16)
                    warp_quantize_span<FMT, 1>(src, col0, H, s_payload, NoScales{}, a.global_scale, lane);
                else
                    warp_quantize_span<FMT, 1>(src, col0, H, s_payload, row_scales, a.global_scale, lane);
            }
            payload = s_payload;
            __syncwarp();
        }
        // Destinations in a rotated order (from the token's index): the warps of every GPU then write to every
        // destination at once. With d = 0, 1, ... in every warp, all GPUs began by writing to rank 0, one
        // destination took three GPUs' traffic at a time, and the 4-GPU send half ran at 210 GB/s against the
        // 350 GB/s of an all-to-all copy kernel. With local_from_x my own tokens are not staged here: my receive
        // phase takes them from x.
        const unsigned allowed = local_from_x ? ~(1u << rank) : ~0u;
        unsigned sent = 0;  // destinations of this item
        int n_dst = 0;      // how many; lane j < n_dst holds the payload address of the j-th (in the order below)
        unsigned long long lane_dst = 0;
        for (int i = 0; i < R; ++i) {
            const int d = (t + rank + i) % R;
            if (!((allowed >> d) & 1u)) continue;
            const unsigned mask = __ballot_sync(0xffffffffu, r == d);
            if (!mask) continue;
            sent |= 1u << d;
            const int first = __ffs(mask) - 1;
            const int first_row = __shfl_sync(0xffffffffu, row, first);
            char* meta = message_meta(ep, d, small, par, me, message_slot(t, d));
            char* dst = small ? staged_payload(ep, meta) : ep.peer(d, ep[P_OFF_TOKENS]) + first_row * pb;
            if (lane == n_dst) lane_dst = reinterpret_cast<unsigned long long>(dst);
            ++n_dst;
            if (ch == 0) {  // a staged record needs only the weights: its token and rows are in the book row
                if (lane == 0 && !small) *reinterpret_cast<int*>(meta) = t;
                if (lane < K) {
                    reinterpret_cast<float*>(meta + ep[P_META_W])[lane] = w;
                    if (!small) {
                        reinterpret_cast<uint16_t*>(meta + ep[P_META_IDS])[lane] = static_cast<uint16_t>(e);
                        reinterpret_cast<int*>(meta + ep[P_META_ROWS])[lane] = r == d ? row : -1;
                    }
                }
            }
            for (int b = s_lo + 8 * lane; b < s_hi; b += 8 * kWarp)
                *reinterpret_cast<uint2*>(meta + ep[P_META_SCALES] + b) = *reinterpret_cast<const uint2*>(s_scales + b);
        }
        if (ep[P_SHARED]) {  // my own token is also row t of my shared-expert group 0
            if (lane == n_dst) lane_dst = reinterpret_cast<unsigned long long>(ep.local(ep[P_OFF_TOKENS]) + t * pb);
            ++n_dst;
        }
        // The chunk's payload, 2 KB at a time: loaded once, stored to every destination (a copy per destination
        // loaded it again behind the previous destination's stores).
        for (long long b = p_lo; n_dst && b < p_hi; b += SendVectors::kBytes) {
            const int n = static_cast<int>(min(static_cast<long long>(SendVectors::kBytes), p_hi - b));
            SendVectors v;
            if (kDirectPayload && b == p_lo) v = first_pass;
            else v.load(payload + b, n, lane);
            for (int j = 0; j < n_dst; ++j)
                v.store(reinterpret_cast<char*>(__shfl_sync(0xffffffffu, lane_dst, j)) + b, n, lane);
        }
        // The chunk sets its flag in each destination's record last: the warp's stores above happen before the
        // flags (warp barrier, then one system-scope fence for all destinations: a release per destination waited
        // for each destination's stores in turn, 5 us of a 2-GPU decode dispatch).
        __syncwarp();
        if (lane == 0 && sent) {
            if (!(knobs & kKnobDispatchNoFence)) fence_sys();  // (knob: measurement only, unordered)
            for (unsigned m = sent; m; m &= m - 1) {
                const int d = __ffs(m) - 1;
                char* meta = message_meta(ep, d, small, par, me, message_slot(t, d));
                store_relaxed_sys_i32(message_flags(ep, meta) + ch, chunk_flag(round, n_chunks));
            }
        }
        if (ep[P_SHARED]) {
            // My own token is row t of my shared-expert group 0 (its payload went with the destinations' above).
            const long long srow = t;
            if (sb) place_row_scales<FMT>(ep, a, srow, srow, s_scales, lane, kWarp, s_lo / int(sizeof(S)),
                                          last ? (1 << 30) : s_hi / int(sizeof(S)));
            if (lane == 0 && ch == 0) {
                a.src_info[2 * srow] = t;
                a.src_info[2 * srow + 1] = K;
                a.row_src[srow] = rank;
                a.row_weight[srow] = 1.f;
            }
        }
        __syncwarp();  // the staging is reused by the warp's next item
    }

    CUEP_TRACE(ep, static_cast<int>(blockIdx.x) == first_sender, 5);
    CUEP_TRACE_LATEST(ep, lane == 0, 23);
    }
done:
    // No end-of-phase count: every message carries its own chunk flags, and the block that entered the kernel last
    // advances the round (dispatch_kernel).
    return;
}

// recv: wait for every source, then lay the round out. Blocks [first_block, grid) take part (see dispatch_kernel).
template <int FMT>
__device__ void phase_recv(const EP& ep, const DispatchArgs& a, int round, char* smem, int first_block,
                           bool local_from_x, int knobs) {
    const int block = static_cast<int>(blockIdx.x) - first_block, n_blocks = static_cast<int>(gridDim.x) - first_block;
    const int E = static_cast<int>(ep[P_N_EXPERTS]), K = static_cast<int>(ep[P_TOP_K]);
    const int L = static_cast<int>(ep[P_N_LOCAL]), rank = static_cast<int>(ep[P_RANK]);
    const int n_src = static_cast<int>(ep[P_N_SRC]), G = static_cast<int>(ep[P_N_GROUPS]);
    const int sh = static_cast<int>(ep[P_SHARED]), me = static_cast<int>(ep[P_SRC_INDEX]);
    const int par = round & 1;
    const long long pb = ep[P_PAYLOAD_BYTES], T_max = ep[P_MAX_TOKENS];
    int* ctr = ep.counters();

    __shared__ int s_ok;
    __shared__ int s_scan[32];
    __shared__ int s_msg_count[kMaxRanks], s_msg_total, s_msg_most, s_all_staged;

    // The layout needs only the histograms (they arrive before any data); messages are then placed one by one
    // as their chunk flags land, so the copies below overlap the incoming stream.
    const int E1 = tally_len(ep);
    int* s_tally = reinterpret_cast<int*>(smem);
    unsigned* s_offsets = reinterpret_cast<unsigned*>(s_tally + n_src * E1);
    unsigned* s_tiles = s_offsets + align_up(G + 1, 4);
    uint16_t* s_msg_tok = reinterpret_cast<uint16_t*>(s_tiles + G);  // [n_src, small_tokens] (staged sources)
    const int S = static_cast<int>(ep[P_SMALL_TOKENS]);
    __shared__ unsigned s_tiles_end;
    const unsigned sleep_ns = poll_sleep_ns(knobs, 32);
    if (!load_tallies(ep, round, s_tally, K_DISPATCH_RECV, &s_ok, 2 * sleep_ns)) return;
    if (threadIdx.x == 0) {
        s_offsets[0] = 0;
        if (sh) s_offsets[1] = shared_rows(ep, s_tally, rank);
        s_msg_total = s_msg_most = 0;
        s_all_staged = 1;
        for (int s = 0; s < n_src; ++s) {
            s_msg_count[s] = s_tally[s * E1 + E + 1];
            s_msg_total += s_msg_count[s];
            s_msg_most = max(s_msg_most, s_msg_count[s]);
            s_all_staged &= staged_source(ep, s_tally, s) ? 1 : 0;
        }
    }
    // A staged source's messages: its tokens that come here, in token order (message i of source s is token
    // s_msg_tok[s * S + i]), from the token mask of its book row. A warp per source, 32 mask words per pass.
    {
        const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
        const uint32_t stamp = static_cast<uint32_t>(round) + 1;
        for (int s = threadIdx.x / kWarp; s < n_src; s += n_warps) {
            if (!staged_source(ep, s_tally, s)) continue;
            const uint64_t* row = book_row(ep, rank, par, s);
            const int n_words = (s_tally[s * E1 + E] + 31) / 32;
            int carry = 0;
            for (int w0 = 0; w0 < n_words; w0 += kWarp) {
                const int w = w0 + lane;
                uint32_t word = 0;
                if (w < n_words && !wait_stamped(ep, row + w, stamp, K_DISPATCH_RECV, s, word, sleep_ns)) s_ok = 0;
                const int n = __popc(word);
                int incl = n;
                for (int o = 1; o < kWarp; o <<= 1) {
                    const int v = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += v;
                }
                for (int i = carry + incl - n; word; word &= word - 1, ++i)
                    s_msg_tok[s * S + i] = static_cast<uint16_t>(32 * w + __ffs(word) - 1);
                carry += __shfl_sync(0xffffffffu, incl, kWarp - 1);
            }
        }
    }
    __syncthreads();
    if (!s_ok) return;
    scan_rank_groups(ep, s_tally, rank, s_scan, [&](int, int l, int start, int size) {
        s_offsets[sh + l] = start;
        if (l == L - 1) s_offsets[sh + L] = start + size;
    });
    constexpr bool kTiled = FMT == kFmtNvfp4 || FMT == kFmtMxfp4;
    if (kTiled && threadIdx.x < kWarp) {
        // 128-row scale tiles (fp4): each group starts a fresh one; its first tile by a warp's prefix sum, 32 groups
        // a pass. (Thread 0 alone, a group after the other, took 2.6 us of every fp4 receive's layout: 2 x H200,
        // N = 1 trace, layout done at 8.8 us against 6.0 for bf16.)
        const int ln = static_cast<int>(threadIdx.x);
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
        if (ln == 0) s_tiles_end = carry;
    }
    __syncthreads();
    if (block == 0) {
        for (int g = threadIdx.x; g <= G; g += blockDim.x) {
            a.row_offsets[g] = s_offsets[g];
            if (g < G) {
                a.expert_ids[g] = sh ? (g == 0 ? L : g - 1) : g;
                if (kTiled && a.scales_offsets) a.scales_offsets[g] = s_tiles[g] - s_offsets[g] / kScaleTileRows;
            }
        }
        if (threadIdx.x < n_src) a.msg_count[threadIdx.x] = s_tally[threadIdx.x * E1 + E + 1];
    }

    CUEP_TRACE(ep, block == n_blocks - 1, 7);
    CUEP_TRACE_LATEST(ep, threadIdx.x == 0, 29);
    // Messages, one warp each: metadata, scales, and the copies for the other local experts the token chose.
    char* tokens = ep.local(ep[P_OFF_TOKENS]);
    const int total = s_msg_total;
    const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    // Work items are (message, chunk of the payload): the first chunk also places the metadata and scales,
    // every chunk copies its part of the payload to the token's other local experts' rows.
    // Bytes of payload per work item: at most 2 KiB when messages outnumber the warps (prefill; measured: whole
    // 14 KiB rows per warp left the fan-out 30% slower on H100 than 2 KiB chunks); otherwise one item per warp
    // (decode: with 2 KiB chunks a warp placed a second item after its first, 4 us of a 2-GPU N = 128 dispatch).
    const long long recv_warps = static_cast<long long>(n_blocks) * n_warps;
    const long long kFanoutChunk = total <= recv_warps ? chunk_units(total, pb, kWarp * 16, recv_warps)
                                                       : min(chunk_units(total, pb, kWarp * 16, recv_warps),
                                                             (knobs & kKnobFanoutWholeRows) ? pb : 2048LL);
    using FanoutVectors = WarpVectors<4>;  // the chunk goes through registers 2 KiB at a time
    const int n_chunks = static_cast<int>((pb + kFanoutChunk - 1) / kFanoutChunk);
    // Items are claimed in order with an atomic (lane 0), so blocks that finish sending early, or receive-only
    // blocks, take whatever is next: the fan-out follows the incoming stream. The order interleaves the sources
    // (message slots fill in roughly the order the senders send), so no warp waits for one source while messages
    // of the others have landed (in source order: 4 x H200 fused dispatch 615 us against a 506 us send half).
    // A round whose sources were all staged (decode) has about one item per warp: warp w takes items w, w + warps,
    // ... (consecutive items on different SMs), with no atomics. The counter is this round's parity's; the other
    // parity's was last used by the previous round (an earlier launch) and is zeroed here for the next.
    const bool all_staged = s_all_staged != 0;
    const int recv_warp = (threadIdx.x / kWarp) * n_blocks + block, n_recv_warps = n_blocks * n_warps;
    int* next_item = ctr + C_RECV_ITEM + par;
    if (block == 0 && threadIdx.x == 0) ctr[C_RECV_ITEM + (par ^ 1)] = ctr[C_RECV_NOTED + (par ^ 1)] = 0;
    // A large round's scales are gathered from the messages at its end (gather_scales) once they span
    // kGatherScalesFrom bytes (knobs: kKnobDirectScales never, kKnobGatheredScales always). (The fused shared
    // expert's rows, group 0, are placed by the send phase, directly.)
    const long long scale_out_bytes = kTiled ? static_cast<long long>(s_tiles_end) * kScaleTileRows * ep[P_K_TILES] * 4
                                             : static_cast<long long>(s_offsets[G]) * ep[P_N_SCALES] * 4;
    const bool defer = FMT != kFmtBf16 && ep[P_SCALE_BYTES] && !all_staged && !(knobs & kKnobDirectScales) &&
                       (scale_out_bytes >= kGatherScalesFrom || (knobs & kKnobGatheredScales));
    auto claim = [&](int prev) {
        if (all_staged) return prev < 0 ? recv_warp : prev + n_recv_warps;
        return __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(next_item, 1) : 0, 0);
    };
    // Padding: fp8 rows up to each group's multiple of 4; fp4 scale tiles past each group's last row. Before the
    // messages: it needs only the layout, so it fills the wait for the first flags (at decode the receive blocks
    // wait several microseconds for the first message; padding after the messages was on the round's critical path).
    for (int g = block; g < G; g += n_blocks) {
        const unsigned begin = s_offsets[g], end = s_offsets[g + 1];
        unsigned used = end;
        if (sh && g == 0) used = s_tally[(ep[P_SKIP_A2A] ? 0 : rank) * E1 + E];
        else {
            int n = 0;
            for (int s = 0; s < n_src; ++s) n += s_tally[s * E1 + rank * L + (g - sh)];
            used = begin + n;
        }
        if constexpr (FMT == kFmtFp8) {
            for (unsigned row = used; row < end; ++row) {
                for (long long b = threadIdx.x; b < pb / 16; b += blockDim.x)
                    reinterpret_cast<int4*>(tokens + row * pb)[b] = make_int4(0, 0, 0, 0);
                float* out = static_cast<float*>(a.scales_out);
                if (defer && g >= sh) {
                    if (threadIdx.x == 0) scale_rows(ep)[row] = kPadScales;
                } else {
                    for (int b = threadIdx.x; b < ep[P_N_SCALES]; b += blockDim.x) out[b * ep[P_CAPACITY] + row] = 0.f;
                }
                if (threadIdx.x == 0) {
                    a.src_info[2LL * row] = -1;
                    a.src_info[2LL * row + 1] = -1;
                    a.row_src[row] = -1;
                    a.row_weight[row] = 0.f;
                }
            }
        } else if constexpr (FMT == kFmtNvfp4 || FMT == kFmtMxfp4) {
            const unsigned n = used - begin;
            const unsigned pad_end = (n + kScaleTileRows - 1) / kScaleTileRows * kScaleTileRows;
            const int k_tiles = static_cast<int>(ep[P_K_TILES]);
            uint8_t* out = static_cast<uint8_t*>(a.scales_out);
            if (defer && g >= sh) {
                for (unsigned i = threadIdx.x; i < pad_end - n; i += blockDim.x)
                    scale_rows(ep)[static_cast<long long>(s_tiles[g]) * kScaleTileRows + n + i] = kPadScales;
            } else if (pad_end > n) {
                // The group's last tile, rows n % 128 .. 127, block by block, consecutive threads on consecutive
                // 16-byte quads: quad j of a (tile, kt) 512-byte block holds rows j, j + 32, j + 64, j + 96 (word q:
                // row j + 32 q). A quad of padding rows only is one store; otherwise its padding words go one by one
                // (the message warps store the real rows' words meanwhile). (A word per (row, kt) in row order went
                // 512 bytes apart: 1.7 M scattered stores, most of a 2 x H200 N = 128 nvfp4 dispatch's 80 us.)
                uint4* tile = reinterpret_cast<uint4*>(
                    out + (static_cast<long long>(s_tiles[g]) + n / kScaleTileRows) * k_tiles * kScaleTileBytes);
                const int first = static_cast<int>(n % kScaleTileRows), quads = kScaleTileBytes / 16;
                for (int i = threadIdx.x; i < k_tiles * quads; i += blockDim.x) {
                    const int j = i % quads;
                    if (j >= first) {
                        tile[i] = make_uint4(0u, 0u, 0u, 0u);
                    } else {
#pragma unroll
                        for (int q = 1; q < 4; ++q)
                            if (j + 32 * q >= first) reinterpret_cast<uint32_t*>(tile + i)[q] = 0u;
                    }
                }
            }
        }
    }
    const SourceInterleave order{s_msg_count, n_src, n_chunks, 0, n_src * s_msg_most * n_chunks};
    for (int item = claim(-1); item < order.n_items; item = claim(item)) {
        int s, i, ch;
        if (!order.at(item, s, i, ch)) continue;
        // A small round's message sits in the staging area (record t for token t) and its rows in the source's book
        // row, which block 0 publishes while the data move: the rows and the bookkeeping outputs (but the weights,
        // which ride in the record's metadata) are done before the payload's flags are waited for, so mostly the
        // copies follow it. A large round's metadata is in the meta region and its payload already in the row of
        // the token's first local expert: everything waits for the flags.
        const bool staged = staged_source(ep, s_tally, s);
        const char* meta = message_meta(ep, rank, staged, par, s, staged ? s_msg_tok[s * S + i] : i);
        // local_from_x: my own tokens come from x (bf16, this launch's input), not from a staged record: their
        // fan-out need not wait for the NVLink stores' fence, so it overlaps the incoming stream
        const bool from_x = local_from_x && staged && s == me;
        auto wait_payload = [&]() {
            if (from_x) return true;
            const bool ok = warp_wait_chunk_flags(message_flags(ep, meta), message_flag_count(ep), round, ep,
                                                  K_DISPATCH_RECV, s, lane, sleep_ns);
            CUEP_TRACE_LATEST(ep, lane == 0, 24);
            return ok;
        };
        int t, id = -1, row = -1;
        float w = 0.f;
        if (staged) {
            t = s_msg_tok[s * S + i];
            bool ok = true;
            if (lane < K) {
                const uint64_t* book = book_row(ep, rank, par, s) + book_mask_words(ep);
                const long long c = static_cast<long long>(t) * K + lane;
                const uint32_t stamp = static_cast<uint32_t>(round) + 1;
                uint32_t v = 0;
                ok = wait_stamped(ep, book + c, stamp, K_DISPATCH_RECV, s, v, sleep_ns);
                id = static_cast<int>(v & 0xFFFFu);
                if (id != kNoExpert && id / L == rank)
                    row = s_offsets[sh + id - rank * L] + rows_before(ep, s_tally, s, id) + static_cast<int>(v >> 16);
            }
            if (!__all_sync(0xffffffffu, ok)) break;
        } else {
            if (!wait_payload()) break;
            t = *reinterpret_cast<const int*>(meta);
            if (lane < K) {
                id = reinterpret_cast<const uint16_t*>(meta + ep[P_META_IDS])[lane];
                row = reinterpret_cast<const int*>(meta + ep[P_META_ROWS])[lane];
                w = reinterpret_cast<const float*>(meta + ep[P_META_W])[lane];
            }
        }
        const uint8_t* scales = reinterpret_cast<const uint8_t*>(meta + ep[P_META_SCALES]);
        const int src_rank = ep[P_SKIP_A2A] ? rank : s;
        const long long mi = s * T_max + i;
        unsigned local = __ballot_sync(0xffffffffu, row >= 0);
        const int first = local ? __ffs(local) - 1 : 0;
        const int first_row = __shfl_sync(0xffffffffu, row, first);
        // the payload's source, and the local rows it still has to reach (staged: all of them)
        const char* payload = from_x   ? static_cast<const char*>(a.x) + static_cast<long long>(t) * pb
                              : staged ? staged_payload(ep, meta)
                                       : tokens + first_row * pb;
        const unsigned copy_to = from_x ? local : (knobs & kKnobNoFanout) ? 0u : staged ? local : local & (local - 1);
        // This chunk of the payload to every row it still has to reach, 2 KiB at a time: loaded once into
        // registers, stored to each row (a copy per row re-loaded it behind the previous row's stores).
        auto fan_out = [&]() {
            const long long off = static_cast<long long>(ch) * kFanoutChunk;
            const int n = static_cast<int>(min(kFanoutChunk, pb - off));
            for (int b = 0; copy_to && b < n; b += FanoutVectors::kBytes) {
                const int nb = min(FanoutVectors::kBytes, n - b);
                FanoutVectors v;
                v.load(payload + off + b, nb, lane);
                for (unsigned rest = copy_to; rest; rest &= rest - 1)
                    v.store(tokens + __shfl_sync(0xffffffffu, row, __ffs(rest) - 1) * pb + off + b, nb, lane);
            }
            CUEP_TRACE_LATEST(ep, lane == 0, 25);
        };
        if (ch != 0) {  // payload chunk only
            if (staged && !wait_payload()) break;
            fan_out();
            continue;
        }
        if (lane < K) a.msg_rows[mi * K + lane] = row;
        if (lane < K && row >= 0) {
            a.src_info[2LL * row] = t;
            a.src_info[2LL * row + 1] = lane;
            a.row_src[row] = src_rank;
            if (!staged) {  // staged: the weight rides with the payload (below)
                a.row_weight[row] = w;
                msg_weights(ep, a.msg_rows)[mi * K + lane] = w;
            }
        }
        // My position among the token's destination ranks in top-k order (its partial-sum slot in combine):
        // the number of distinct ranks of valid choices whose first choice comes before mine. All lanes shuffle.
        const bool repeat = warp_repeats_earlier(id, lane, K);
        const bool valid = lane < K && id < E && !repeat;
        const unsigned valid_mask = __ballot_sync(0xffffffffu, valid);
        const bool is_new_rank = !ep[P_SKIP_A2A] && warp_first_of_rank(id / L, valid_mask, lane, K);
        const unsigned new_ranks = __ballot_sync(0xffffffffu, is_new_rank && lane < first);
        if (lane == 0) {
            a.msg_token[mi] = t;
            a.msg_j[mi] = __popc(new_ranks);
        }
        if (staged) {
            if (!wait_payload()) break;
            if (lane < K && row >= 0) {
                const float wm = !from_x          ? reinterpret_cast<const float*>(meta + ep[P_META_W])[lane]
                                 : a.topk_weights ? a.topk_weights[static_cast<long long>(t) * K + lane]
                                                  : 0.f;
                a.row_weight[row] = wm;
                msg_weights(ep, a.msg_rows)[mi * K + lane] = wm;
            }
        }
        if (ep[P_SCALE_BYTES] && !(knobs & kKnobNoRowScales)) {
            auto row_of = [&](int k, long long& rk, long long& srow) {
                rk = __shfl_sync(0xffffffffu, row, k);
                const int g = sh + __shfl_sync(0xffffffffu, id, k) - rank * L;
                srow = kTiled ? swizzle_row(s_tiles, s_offsets, g, rk) : rk;
            };
            if (!defer) {
                place_token_scales<FMT>(ep, a, local, row_of, scales, lane);
            } else {
                for (unsigned rest = local; rest; rest &= rest - 1) {
                    long long rk, srow;
                    row_of(__ffs(rest) - 1, rk, srow);
                    if (lane == 0) scale_rows(ep)[srow] = scale_ref(ep, scales);
                }
            }
        }
        fan_out();
    }

    CUEP_TRACE(ep, block == n_blocks - 1, 8);
    // The scales, once every receive block has noted its rows' (and padding's): the rows after the shared expert's
    // (fp8) or their scale tiles (fp4), in whole lines.
    if (defer) {
        if (!blocks_barrier(ep, ctr + C_RECV_NOTED + par, n_blocks, K_DISPATCH_RECV, &s_ok)) return;
        CUEP_TRACE(ep, block == n_blocks - 1, 10);
        const unsigned lo = kTiled ? s_tiles[sh] : s_offsets[sh], hi = kTiled ? s_tiles_end : s_offsets[G];
        gather_scales<FMT>(ep, a, lo, hi, recv_warp, n_recv_warps, lane);
        CUEP_TRACE_LATEST(ep, threadIdx.x == 0, 27);
    }

    CUEP_TRACE(ep, block == n_blocks - 1, 9);
    CUEP_TRACE_LATEST(ep, threadIdx.x == 0, 26);
    // The round ends here: the chunk flags need no re-arming, and the block that entered last advances the round
    // (dispatch_kernel). (The end-of-round count and re-arm took 2 us of a 2-GPU decode dispatch, 8 us of a
    // prefill one.)
}

}  // namespace

constexpr int kSmallSendSixteenths = 6;

// A large fused round's receive-only blocks, in eighths of the grid (knob bits 27-29: another share), so the
// fan-out runs while tokens are still being sent. In-process A/B, 2 x H200, N = 4096, cold us, 3/8, 4/8, 5/8, 6/8
// of the blocks receiving: bf16 286, 270, 256, 241 (7/8: 301); fp8 222, 214, 212, 240; nvfp4 228, 225, 226, 244.
// On two ranks a bf16 token fans out to about four rows here, so the copies, not the NVLink stores, want the SMs;
// a quantized round encodes in the send blocks and copies half the bytes or less. 4 x H200: unmeasured (one half,
// as before). (Every block sending first, second session: 347 us against 293 with half receiving.)
template <int FMT, typename T>
__device__ __forceinline__ int large_recv_eighths(const EP& ep) {
    return FMT == kFmtBf16 && sizeof(T) == 2 && ep[P_N_RANKS] <= 2 ? 6 : 4;
}

template <int FMT, typename T>
__device__ void dispatch_kernel(const EPParams& params, DispatchArgs a, int phases) {
    extern __shared__ __align__(16) char smem[];
    __shared__ int s_flag;
    const EP ep{params.v};
    int* ctr = ep.counters();
    // A small round's readiness rows (small_round_ready), both parities, loaded by warp 1 while thread 0 loads the
    // entry counters (the barrier in load_entry_counters publishes them).
    __shared__ uint64_t s_early_ready[2 * kMaxRanks];
    const bool early = (phases & (kPhaseNotify | kPhaseSend)) && !(phases & kKnobNoEarlyLoads) &&
                       small_round(ep, a.num_tokens);
    if (early && threadIdx.x >= kWarp && threadIdx.x < kWarp + 2 * ep[P_N_SRC]) {
        const int l = static_cast<int>(threadIdx.x) - kWarp, n_src = static_cast<int>(ep[P_N_SRC]);
        s_early_ready[l] = load_acquire_u64(tally_row(ep, static_cast<int>(ep[P_RANK]), l / n_src, l % n_src));
    }
    // The error flag and the rounds in one load per block. Rounds are read once at entry: the last block of a
    // phase advances them only after every block started.
    const EntryCounters entry = load_entry_counters(ep);
    if (entry.status == kStatusTimeout) return;
    const int send_round = entry.disp_round, recv_round = entry.recv_round;
    const int entered = count_entry(ep, C_ENTER_DISPATCH);
    CUEP_TRACE(ep, blockIdx.x == 0, 0);
    if (phases & kPhaseNotify) phase_notify(ep, a, send_round, &s_flag, smem, early ? s_early_ready : nullptr);
    // A small fused round sends from 6/16 of the blocks (knob bits 10-14: another share). In-process A/B, 2 x H200,
    // N = 128, cold: 8/16 26.4 us, 6/16 25.4, 5/16 25.2-25.5, 4/16 25.5, 3/16 26.3 (bf16); fp8 8/16 28.7, 6/16
    // 27.7-28.0, 5/16 28.4: the receive blocks' fan-out, not the send, was short of SMs.
    const int knob_sixteenths = (phases >> kKnobSmallSendShift) & 31;
    const int small_sixteenths = knob_sixteenths ? min(knob_sixteenths, 16) : kSmallSendSixteenths;
    const bool fused = (phases & kPhaseRecv) && (phases & kPhaseSend);
    const int send_blocks = fused && small_round(ep, a.num_tokens)
                                ? max(1, static_cast<int>(gridDim.x) * small_sixteenths / 16)
                                : send_block_count(phases, large_recv_eighths<FMT, T>(ep));
    // One call with x moving a small bf16 round: this rank's own tokens go from x to its rows (kPhaseLocalX)
    const bool local_from_x = FMT == kFmtBf16 && sizeof(T) == 2 && (phases & kPhaseLocalX) &&
                              !(phases & kKnobNoLocalX) && a.x != nullptr && small_round(ep, a.num_tokens);
    if (phases & kPhaseSend)
        phase_send<FMT, T>(ep, a, send_round, smem, send_blocks, (phases & kPhaseNotify) != 0, local_from_x,
                           early ? s_early_ready : nullptr, phases);
    // A small round's fused launch: the blocks that sent do not receive; the receive-only blocks place the few
    // messages of a decode round (a sender that went on to receive first loaded every tally and laid the round
    // out again, 2 us after its last send, for items long taken). Knob kKnobSendersReceive keeps them receiving.
    const int first_recv = (phases & kPhaseSend) && send_blocks < static_cast<int>(gridDim.x) &&
                                   small_round(ep, a.num_tokens) && !(phases & kKnobSendersReceive)
                               ? send_blocks
                               : 0;
    if ((phases & kPhaseRecv) && static_cast<int>(blockIdx.x) >= first_recv)
        phase_recv<FMT>(ep, a, recv_round, smem, first_recv, local_from_x, phases);
    // The block that entered last advances the rounds of the phases this launch ran.
    if (last_to_enter(ep, C_ENTER_DISPATCH, entered)) {
        if (phases & kPhaseSend) ctr[C_DISP_ROUND] = send_round + 1;
        if (phases & kPhaseRecv) ctr[C_RECV_ROUND] = recv_round + 1;
    }
}

#define CUEP_DISPATCH(NAME, FMT, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(kDispatchThreads) NAME(                                    \
        const __grid_constant__ EPParams params, const void* x, const int* topk_ids,                        \
        const float* topk_weights,                                                                          \
        int num_tokens, float global_scale, void* scales_out, unsigned* row_offsets, int* expert_ids,       \
        unsigned* scales_offsets, int* src_info, int* row_src, float* row_weight, int* msg_rows,            \
        int* msg_token, int* msg_j, int* msg_count, int phases) {                                           \
        DispatchArgs a{x, topk_ids, topk_weights, num_tokens, global_scale, scales_out, row_offsets,        \
                       expert_ids, scales_offsets, src_info, row_src, row_weight, msg_rows, msg_token,      \
                       msg_j, msg_count};                                                                   \
        dispatch_kernel<FMT, T>(params, a, phases);                                                         \
    }

CUEP_DISPATCH(cuep_dispatch_bf16_from_bf16, kFmtBf16, bf16_t)
CUEP_DISPATCH(cuep_dispatch_bf16_from_f32, kFmtBf16, float)
CUEP_DISPATCH(cuep_dispatch_fp8_from_bf16, kFmtFp8, bf16_t)
CUEP_DISPATCH(cuep_dispatch_fp8_from_f32, kFmtFp8, float)
CUEP_DISPATCH(cuep_dispatch_nvfp4_from_bf16, kFmtNvfp4, bf16_t)
CUEP_DISPATCH(cuep_dispatch_nvfp4_from_f32, kFmtNvfp4, float)
CUEP_DISPATCH(cuep_dispatch_mxfp4_from_bf16, kFmtMxfp4, bf16_t)
CUEP_DISPATCH(cuep_dispatch_mxfp4_from_f32, kFmtMxfp4, float)
