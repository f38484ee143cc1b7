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
//           set the message's ready tag last
//   recv    lay out row_offsets / expert_ids / scales_offsets from the histograms alone, then place each message
//           as its ready tag lands (metadata, scales, copies to the token's other local experts) and zero the
//           padding; the copies overlap the incoming stream
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
    int* msg_rows;              // [n_src, T, K]
    int* msg_token;             // [n_src, T]
    int* msg_j;                 // [n_src, T] my position among the token's destination ranks
    int* msg_count;             // [n_src]
};

// Scale row of local row `row` of group g in the 128x4 tiled layout.
__device__ __forceinline__ long long swizzle_row(const unsigned* s_tile_start, const unsigned* s_row_offsets, int g,
                                                 long long row) {
    return static_cast<long long>(s_tile_start[g]) * kScaleTileRows + (row - s_row_offsets[g]);
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
        for (int kt = b_lo / kScaleTileCols + tid; kt < min(k_tiles, b_hi / kScaleTileCols); kt += nthreads) {
            uint32_t word = 0;
#pragma unroll
            for (int i = 0; i < kScaleTileCols; ++i) {
                const int c = kt * kScaleTileCols + i;
                if (c < n_scales) word |= uint32_t(src[c]) << (8 * i);
            }
            *reinterpret_cast<uint32_t*>(out + swizzled_scale_offset(scale_row, kt * kScaleTileCols, k_tiles)) = word;
        }
    }
}

// ---- message ready tags ----------------------------------------------------------------------------------
// A message (one token for one destination) may be sent by several warps, one per chunk. Each chunk, after its
// stores, adds to the message's 32-bit tag (system-scope fence, then the add): chunk 0 adds the round's stamp (bits
// 16-31) and the chunk count (bits 8-15), every chunk adds 1 (bits 0-7). The message is complete when the stamp
// is this round's and the count of chunks that landed equals the chunk count. The receiver re-arms the tags
// (zero) at the end of its round, before it publishes the next round's histogram, so no sender adds to a tag
// that is not zero-based.
constexpr int kMaxChunks = 255;
__device__ __forceinline__ unsigned message_stamp(int round) { return (static_cast<unsigned>(round) & 0x7FFFu) + 1u; }

// After a system-scope fence that orders the chunk's stores before it.
__device__ __forceinline__ void message_tag_add(int* tag, int round, int chunk, int n_chunks) {
    const unsigned add = 1u + (chunk == 0 ? (message_stamp(round) << 16) | (static_cast<unsigned>(n_chunks) << 8) : 0u);
    red_add_relaxed_sys(tag, static_cast<int>(add));
}

__device__ __forceinline__ bool message_complete(unsigned v, int round) {
    return (v >> 16) == message_stamp(round) && ((v >> 8) & 0xFFu) == (v & 0xFFu);
}

// A tally row, one per (source, parity), written by the source into each destination:
// [tokens the source sends to each expert (E) | the source's token count | messages it sends to this destination].
__device__ __forceinline__ int tally_len(const EP& ep) { return static_cast<int>(ep[P_N_EXPERTS]) + 2; }

// Copy the tallies of parity `par` from this rank's buffer into shared memory (after the flags were acquired).
__device__ void load_tallies(const EP& ep, int par, int* s_tally) {
    const int E1 = tally_len(ep), n_src = static_cast<int>(ep[P_N_SRC]);
    const int* tally = reinterpret_cast<const int*>(ep.local(ep[P_OFF_TALLY])) + par * n_src * E1;
    for (int i = threadIdx.x; i < n_src * E1; i += blockDim.x) s_tally[i] = tally[i];
    __syncthreads();
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

// Sum of tallies of sources before `me` for expert e: where my block of rows starts inside e's group.
__device__ __forceinline__ int rows_before_me(const EP& ep, const int* s_tally, int e) {
    const int E1 = tally_len(ep), me = static_cast<int>(ep[P_SRC_INDEX]);
    int n = 0;
    for (int s = 0; s < me; ++s) n += s_tally[s * E1 + e];
    return n;
}

// ---- phases ---------------------------------------------------------------------------------------------------

// Per-call scratch private to the rank: each choice's slot inside its (expert, my source index) block, each
// (token, destination rank)'s message slot, and each token's destination ranks (bit mask). Filled by notify, read
// by send.
__device__ __forceinline__ int* scratch_pos(const EP& ep) { return reinterpret_cast<int*>(ep.local(ep[P_OFF_SCRATCH])); }
__device__ __forceinline__ int* scratch_slot(const EP& ep) { return scratch_pos(ep) + ep[P_MAX_TOKENS] * ep[P_TOP_K]; }
__device__ __forceinline__ int* scratch_rank_masks(const EP& ep) { return scratch_slot(ep) + ep[P_MAX_TOKENS] * kMaxRanks; }

// notify: one thread per (token, k). Reserve every slot with an atomic (the histogram is the slot counter),
// then the last block publishes the histogram to every destination with the round's flag.
__device__ void phase_notify(const EP& ep, const DispatchArgs& a, int round, int* s_flag) {
    const int E = static_cast<int>(ep[P_N_EXPERTS]), K = static_cast<int>(ep[P_TOP_K]);
    const int L = static_cast<int>(ep[P_N_LOCAL]);
    int* ctr = ep.counters();
    int* hist = ctr + C_HIST;
    int* pos = scratch_pos(ep);
    int* slot = scratch_slot(ep);
    int* masks = scratch_rank_masks(ep);
    // One warp per token, lane k = choice k: repeats and first choices per rank found with shuffles.
    const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    for (int t = (threadIdx.x / kWarp) * gridDim.x + blockIdx.x; t < a.num_tokens; t += gridDim.x * n_warps) {
        const long long i = static_cast<long long>(t) * K + lane;
        const int e = lane < K ? a.topk_ids[i] : -1;
        const bool in_range = lane < K && e >= 0 && e < E;
        bool repeat = false;
        for (int k2 = 0; k2 < K; ++k2) {
            const int v = __shfl_sync(0xffffffffu, e, k2);
            if (k2 < lane && v == e) repeat = true;
        }
        if (lane < K && !in_range) report_error(ep, kStatusBadExpertId, K_DISPATCH_SEND, e, t);
        const bool local_ok = !ep[P_SKIP_A2A] || (in_range && e / L == ep[P_RANK]);
        if (in_range && repeat && local_ok) report_error(ep, kStatusDuplicateExpert, K_DISPATCH_SEND, e, t);
        const bool valid = in_range && !repeat && local_ok;
        const unsigned valid_mask = __ballot_sync(0xffffffffu, valid);
        const int r = valid ? e / L : -1;
        bool first = valid;
        for (int k2 = 0; k2 < K; ++k2) {
            const int v = __shfl_sync(0xffffffffu, r, k2);
            if (k2 < lane && ((valid_mask >> k2) & 1u) && v == r) first = false;
        }
        if (valid) pos[i] = atomicAdd(hist + e, 1);
        // The ranks the token goes to (one message each), for the slots below.
        const unsigned to_ranks = __reduce_or_sync(0xffffffffu, first ? 1u << r : 0u);
        if (lane == 0) masks[t] = static_cast<int>(to_ranks);
    }
    CUEP_TRACE(ep, blockIdx.x == 0, 1);
    if (!last_block_done(ctr + C_DONE_NOTIFY, s_flag, /*peer_writes=*/false)) return;
    // Last block. Message slots in token order: the slot of (t, r) is the number of earlier tokens that go to r
    // (atomics gave them in scheduling order). Each destination then holds a source's messages in token order,
    // and the combine, which goes through them in slot order, returns every source's tokens roughly in order.
    const int R = static_cast<int>(ep[P_N_RANKS]);
    int n_msgs[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // messages to each rank so far, then in all
    {
        // Each warp takes a contiguous range of kBatch x 32 tokens per pass (lane = token; coalesced loads, all
        // issued at once): per-rank counts by ballot, a prefix over the warps, then the slots. (One thread per
        // contiguous range, loading its tokens one by one, took 15 us at N = 4096.)
        constexpr int kBatch = 8;
        __shared__ int s_counts[32 * 8];
        const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
        const unsigned lanes_before = (1u << lane) - 1u;
        for (int base = 0; base < a.num_tokens; base += kBatch * kWarp * n_warps) {
            const int t0 = base + warp * kBatch * kWarp + lane;
            unsigned m[kBatch];
#pragma unroll
            for (int j = 0; j < kBatch; ++j) m[j] = t0 + j * kWarp < a.num_tokens ? masks[t0 + j * kWarp] : 0u;
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
                    if (to_r)
                        slot[static_cast<long long>(t0 + j * kWarp) * kMaxRanks + r] = run + __popc(b & lanes_before);
                    run += __popc(b);
                }
                n_msgs[r] += total;
            }
        }
    }
    // Publish [hist | num_tokens | messages for you] to every destination's tally row for me, then the flag;
    // re-arm the histogram.
    const int par = round & 1, n_src = static_cast<int>(ep[P_N_SRC]), E1 = tally_len(ep);
    const int me = static_cast<int>(ep[P_SRC_INDEX]);
    const int n_dest = ep[P_SKIP_A2A] ? 1 : R;
    for (int d = 0; d < n_dest; ++d) {
        const int r = ep[P_SKIP_A2A] ? static_cast<int>(ep[P_RANK]) : d;
        int* dst = reinterpret_cast<int*>(ep.peer(r, ep[P_OFF_TALLY])) + (par * n_src + me) * E1;
        int msgs = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) msgs = i == r ? n_msgs[i] : msgs;
        for (int e = threadIdx.x; e < E1; e += blockDim.x) dst[e] = e < E ? hist[e] : (e == E ? a.num_tokens : msgs);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    if (threadIdx.x == 0) ctr[C_DONE_NOTIFY] = 0;
    __syncthreads();
    if (threadIdx.x < n_dest) {
        const int r = ep[P_SKIP_A2A] ? static_cast<int>(ep[P_RANK]) : threadIdx.x;
        fence_sys();
        uint64_t* flag = reinterpret_cast<uint64_t*>(ep.peer(r, ep[P_OFF_HIST_FLAG])) + par * n_src + me;
        store_release_u64(flag, static_cast<uint64_t>(round) + 1);
    }
    CUEP_TRACE(ep, true, 2);
}

// send: every rank's layout from the histograms, then one warp per token: encode it once (shared memory, or
// straight from x for bf16) and store it to each destination rank it goes to.
template <int FMT, typename T>
__device__ void phase_send(const EP& ep, const DispatchArgs& a, int round, char* smem, int* s_flag, int send_blocks) {
    const int E = static_cast<int>(ep[P_N_EXPERTS]), K = static_cast<int>(ep[P_TOP_K]);
    const int L = static_cast<int>(ep[P_N_LOCAL]), H = static_cast<int>(ep[P_HIDDEN]);
    const int R = static_cast<int>(ep[P_N_RANKS]), rank = static_cast<int>(ep[P_RANK]);
    const int n_src = static_cast<int>(ep[P_N_SRC]), me = static_cast<int>(ep[P_SRC_INDEX]);
    const int par = round & 1;
    int* ctr = ep.counters();
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;

    __shared__ int s_ok;
    __shared__ int s_scan[32];

    // Blocks past `send_blocks` only receive (fused launch): they go straight to the end-of-phase barrier.
    if (static_cast<int>(blockIdx.x) >= send_blocks) goto done;
    {
    // 1. Every source's histogram of this round (also: every destination is ready for it).
    const uint64_t* flags = reinterpret_cast<const uint64_t*>(ep.local(ep[P_OFF_HIST_FLAG])) + par * n_src;
    if (!block_wait_flags_eq(flags, n_src, static_cast<uint64_t>(round) + 1, ep, K_DISPATCH_SEND, &s_ok)) return;
    CUEP_TRACE(ep, blockIdx.x == 0, 3);
    // shared memory: tallies | per-expert bases | one encoded token per warp (16-byte aligned parts)
    int* s_tally = reinterpret_cast<int*>(smem);
    const long long tally_bytes = align_up(4LL * n_src * tally_len(ep));
    int* s_base = reinterpret_cast<int*>(smem + tally_bytes);
    const long long pb = ep[P_PAYLOAD_BYTES];
    const int sb = static_cast<int>(ep[P_SCALE_BYTES]);
    const long long staging = align_up(pb) + align_up(sb);
    uint8_t* s_payload = reinterpret_cast<uint8_t*>(smem + tally_bytes + align_up(4LL * E)) +
                         warp * staging;
    uint8_t* s_scales = s_payload + align_up(pb);
    load_tallies(ep, par, s_tally);
    const int n_dest = ep[P_SKIP_A2A] ? 1 : R;
    for (int d = 0; d < n_dest; ++d) {
        const int r = ep[P_SKIP_A2A] ? rank : d;
        scan_rank_groups(ep, s_tally, r, s_scan, [&](int e, int, int start, int) {
            s_base[e] = start + rows_before_me(ep, s_tally, e);
        });
    }

    CUEP_TRACE(ep, blockIdx.x == 0, 4);
    // 2. Items (token, chunk of whole 256-value spans), one warp each; lane k holds top-k choice k. A prefill batch
    // keeps one chunk (one warp) per token; a decode batch spreads each token over several warps (one warp
    // storing a whole token to every destination was what a small batch waited for). Every chunk counts itself
    // into the message's ready tag (message_tag_*), so the receiver knows when all of a message has landed.
    const int* pos = scratch_pos(ep);
    const int* slots = scratch_slot(ep);
    const long long T_max = ep[P_MAX_TOKENS];
    const int n_spans = (H + kWarpSpan - 1) / kWarpSpan;
    const int spans_per_chunk = static_cast<int>(max(
        chunk_units(a.num_tokens, n_spans, 1, static_cast<long long>(send_blocks) * n_warps),
        static_cast<long long>((n_spans + kMaxChunks - 1) / kMaxChunks)));
    const int n_chunks = (n_spans + spans_per_chunk - 1) / spans_per_chunk;
    using S = typename FormatTraits<FMT>::Scale;
    // Consecutive items go to different blocks (SMs) first, so a small batch still spreads over the GPU.
    for (int item = warp * send_blocks + blockIdx.x; item < a.num_tokens * n_chunks; item += send_blocks * n_warps) {
        const int t = item / n_chunks, ch = item % n_chunks;
        const int c_lo = ch * spans_per_chunk * kWarpSpan, c_hi = min(H, c_lo + spans_per_chunk * kWarpSpan);
        const bool last = ch == n_chunks - 1;
        // the chunk's bytes of the payload and of the per-row scales (16- and 8-byte aligned)
        const long long p_lo = payload_offset<FMT>(c_lo), p_hi = last ? pb : payload_offset<FMT>(c_hi);
        const int s_lo = FMT == kFmtBf16 ? 0 : int(sizeof(S)) * (c_lo / max(1, FormatTraits<FMT>::kBlock));
        const int s_hi = FMT == kFmtBf16 ? 0 : (last ? static_cast<int>(align_up(sb)) :
                                                int(sizeof(S)) * (c_hi / max(1, FormatTraits<FMT>::kBlock)));
        const int* ids = a.topk_ids + static_cast<long long>(t) * K;
        int e = -1, r = -1, row = -1;
        float w = 0.f;
        if (lane < K) {
            e = ids[lane];
            if (valid_choice(ep, ids, lane)) {
                r = e / L;
                row = s_base[e] + pos[static_cast<long long>(t) * K + lane];
            }
            if (a.topk_weights) w = a.topk_weights[static_cast<long long>(t) * K + lane];
        }
        // Encode the chunk once: quantized formats (and bf16 from float32) into this warp's staging, at the
        // offsets of the whole row; bf16 goes straight from x.
        const T* x_row = static_cast<const T*>(a.x) + static_cast<long long>(t) * H;
        const uint8_t* payload;
        if constexpr (FMT == kFmtBf16 && sizeof(T) == 2) {
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
        // 350 GB/s of an all-to-all copy kernel.
        unsigned sent = 0;  // destinations of this item
        for (int i = 0; i < R; ++i) {
            const int d = (t + rank + i) % R;
            const unsigned mask = __ballot_sync(0xffffffffu, r == d);
            if (!mask) continue;
            sent |= 1u << d;
            const int first = __ffs(mask) - 1;
            const int first_row = __shfl_sync(0xffffffffu, row, first);
            const int slot = slots[static_cast<long long>(t) * kMaxRanks + d];
            warp_copy16(ep.peer(d, ep[P_OFF_TOKENS]) + first_row * pb + p_lo, payload + p_lo, p_hi - p_lo, lane);
            char* meta = ep.peer(d, ep[P_OFF_META]) + (me * T_max + slot) * ep[P_META_BYTES];
            if (ch == 0) {
                if (lane == 0) *reinterpret_cast<int*>(meta) = t;
                if (lane < K) {
                    reinterpret_cast<uint16_t*>(meta + ep[P_META_IDS])[lane] = static_cast<uint16_t>(e);
                    reinterpret_cast<float*>(meta + ep[P_META_W])[lane] = w;
                    reinterpret_cast<int*>(meta + ep[P_META_ROWS])[lane] = r == d ? row : -1;
                }
            }
            for (int b = s_lo + 8 * lane; b < s_hi; b += 8 * kWarp)
                *reinterpret_cast<uint2*>(meta + ep[P_META_SCALES] + b) = *reinterpret_cast<const uint2*>(s_scales + b);
        }
        // The chunk counts itself into each destination's ready tag last: the warp's stores above happen before
        // the tags (warp barrier, then one system-scope fence for all destinations: a release per destination
        // waited for each destination's stores in turn, 5 us of a 2-GPU decode dispatch).
        __syncwarp();
        if (lane == 0 && sent) {
            fence_sys();
            for (unsigned m = sent; m; m &= m - 1) {
                const int d = __ffs(m) - 1;
                const int slot = slots[static_cast<long long>(t) * kMaxRanks + d];
                char* meta = ep.peer(d, ep[P_OFF_META]) + (me * T_max + slot) * ep[P_META_BYTES];
                message_tag_add(reinterpret_cast<int*>(meta) + 1, round, ch, n_chunks);
            }
        }
        if (ep[P_SHARED]) {
            // My own token is row t of my shared-expert group 0 (its scales too).
            const long long srow = t;
            warp_copy16(ep.local(ep[P_OFF_TOKENS]) + srow * pb + p_lo, payload + p_lo, p_hi - p_lo, lane);
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

    CUEP_TRACE(ep, blockIdx.x == 0, 5);
    }
done:
    // 3. Last block: advance the round (every message already carries its own ready tag).
    if (!last_block_done(ctr + C_DONE_SEND, s_flag, /*peer_writes=*/false)) return;
    CUEP_TRACE(ep, true, 6);
    if (threadIdx.x == 0) {
        ctr[C_DONE_SEND] = 0;
        ctr[C_DISP_ROUND] = round + 1;
    }
}

// recv: wait for every source, then lay the round out.
template <int FMT>
__device__ void phase_recv(const EP& ep, const DispatchArgs& a, int round, char* smem, int* s_flag) {
    const int E = static_cast<int>(ep[P_N_EXPERTS]), K = static_cast<int>(ep[P_TOP_K]);
    const int L = static_cast<int>(ep[P_N_LOCAL]), rank = static_cast<int>(ep[P_RANK]);
    const int n_src = static_cast<int>(ep[P_N_SRC]), G = static_cast<int>(ep[P_N_GROUPS]);
    const int sh = static_cast<int>(ep[P_SHARED]);
    const int par = round & 1;
    const long long pb = ep[P_PAYLOAD_BYTES], T_max = ep[P_MAX_TOKENS];
    int* ctr = ep.counters();

    __shared__ int s_ok;
    __shared__ int s_scan[32];
    __shared__ int s_msg_count[kMaxRanks], s_msg_total, s_msg_most;

    // The layout needs only the histograms (they arrive before any data); messages are then placed one by one
    // as their ready tags land, so the copies below overlap the incoming stream.
    const uint64_t* flags = reinterpret_cast<const uint64_t*>(ep.local(ep[P_OFF_HIST_FLAG])) + par * n_src;
    if (!block_wait_flags_eq(flags, n_src, static_cast<uint64_t>(round) + 1, ep, K_DISPATCH_RECV, &s_ok)) return;
    const int E1 = tally_len(ep);
    int* s_tally = reinterpret_cast<int*>(smem);
    unsigned* s_offsets = reinterpret_cast<unsigned*>(s_tally + n_src * E1);
    unsigned* s_tiles = s_offsets + align_up(G + 1, 4);
    load_tallies(ep, par, s_tally);
    if (threadIdx.x == 0) {
        s_offsets[0] = 0;
        if (sh) s_offsets[1] = shared_rows(ep, s_tally, rank);
        s_msg_total = s_msg_most = 0;
        for (int s = 0; s < n_src; ++s) {
            s_msg_count[s] = s_tally[s * E1 + E + 1];
            s_msg_total += s_msg_count[s];
            s_msg_most = max(s_msg_most, s_msg_count[s]);
        }
    }
    __syncthreads();
    scan_rank_groups(ep, s_tally, rank, s_scan, [&](int, int l, int start, int size) {
        s_offsets[sh + l] = start;
        if (l == L - 1) s_offsets[sh + L] = start + size;
    });
    constexpr bool kTiled = FMT == kFmtNvfp4 || FMT == kFmtMxfp4;
    if (kTiled && threadIdx.x == 0) {  // 128-row scale tiles (fp4): each group starts a fresh one
        unsigned tiles = 0;
        for (int g = 0; g < G; ++g) {
            s_tiles[g] = tiles;
            tiles += (s_offsets[g + 1] - s_offsets[g] + kScaleTileRows - 1) / kScaleTileRows;
        }
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int g = threadIdx.x; g <= G; g += blockDim.x) {
            a.row_offsets[g] = s_offsets[g];
            if (g < G) {
                a.expert_ids[g] = sh ? (g == 0 ? L : g - 1) : g;
                if (kTiled && a.scales_offsets) a.scales_offsets[g] = s_tiles[g] - s_offsets[g] / kScaleTileRows;
            }
        }
        if (threadIdx.x < n_src) a.msg_count[threadIdx.x] = s_tally[threadIdx.x * E1 + E + 1];
    }

    CUEP_TRACE(ep, blockIdx.x == gridDim.x - 1, 7);
    // Messages, one warp each: metadata, scales, and the copies for the other local experts the token chose.
    char* tokens = ep.local(ep[P_OFF_TOKENS]);
    const int total = s_msg_total;
    const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    // Work items are (message, chunk of the payload): the first chunk also places the metadata and scales,
    // every chunk copies its part of the payload to the token's other local experts' rows.
    // Bytes of payload per work item: at most 2 KiB even for prefill (measured: whole 14 KiB rows per warp left
    // the fan-out 30% slower on H100 than 2 KiB chunks), smaller when there are few messages.
    const long long kFanoutChunk = min(chunk_units(total, pb, kWarp * 16), 2048LL);
    const int n_chunks = static_cast<int>((pb + kFanoutChunk - 1) / kFanoutChunk);
    // Items are claimed in order with an atomic (lane 0), so blocks that finish sending early, or receive-only
    // blocks, take whatever is next: the fan-out follows the incoming stream. The order interleaves the sources
    // (message slots fill in roughly the order the senders send), so no warp waits for one source while messages
    // of the others have landed (in source order: 4 x H200 fused dispatch 615 us against a 506 us send half).
    int* next_item = ctr + C_RECV_ITEM;
    (void)n_warps;
    const SourceInterleave order{s_msg_count, n_src, n_chunks, 0, n_src * s_msg_most * n_chunks};
    for (int item = __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(next_item, 1) : 0, 0); item < order.n_items;
         item = __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(next_item, 1) : 0, 0)) {
        int s, i, ch;
        if (!order.at(item, s, i, ch)) continue;
        const char* meta = ep.local(ep[P_OFF_META]) + (s * T_max + i) * ep[P_META_BYTES];
        if (!warp_wait_until(reinterpret_cast<const int*>(meta) + 1,
                             [round](int v) { return message_complete(static_cast<unsigned>(v), round); }, ep,
                             K_DISPATCH_RECV, s, lane))
            break;
        const int t = *reinterpret_cast<const int*>(meta);
        const uint8_t* scales = reinterpret_cast<const uint8_t*>(meta + ep[P_META_SCALES]);
        const int src_rank = ep[P_SKIP_A2A] ? rank : s;
        const long long mi = s * T_max + i;
        int id = -1, row = -1;
        float w = 0.f;
        if (lane < K) {
            id = reinterpret_cast<const uint16_t*>(meta + ep[P_META_IDS])[lane];
            row = reinterpret_cast<const int*>(meta + ep[P_META_ROWS])[lane];
            w = reinterpret_cast<const float*>(meta + ep[P_META_W])[lane];
        }
        unsigned local = __ballot_sync(0xffffffffu, row >= 0);
        const int first = local ? __ffs(local) - 1 : 0;
        const int first_row = __shfl_sync(0xffffffffu, row, first);
        if (ch != 0) {  // payload chunk only
            const long long off = static_cast<long long>(ch) * kFanoutChunk;
            const long long n = min(static_cast<long long>(kFanoutChunk), pb - off);
            for (unsigned rest = local & (local - 1); rest; rest &= rest - 1) {
                const int rk = __shfl_sync(0xffffffffu, row, __ffs(rest) - 1);
                warp_copy16(tokens + rk * pb + off, tokens + first_row * pb + off, n, lane);
            }
            continue;
        }
        if (lane < K) a.msg_rows[mi * K + lane] = row;
        if (lane < K && row >= 0) {
            a.src_info[2LL * row] = t;
            a.src_info[2LL * row + 1] = lane;
            a.row_src[row] = src_rank;
            a.row_weight[row] = w;
        }
        // My position among the token's destination ranks in top-k order (its partial-sum slot in combine):
        // the number of distinct ranks of valid choices whose first choice comes before mine. All lanes shuffle.
        bool valid = lane < K && id < E;
        for (int k2 = 0; k2 < K; ++k2) {
            const int v = __shfl_sync(0xffffffffu, id, k2);
            if (k2 < lane && v == id) valid = false;
        }
        const unsigned valid_mask = __ballot_sync(0xffffffffu, valid);
        bool is_new_rank = valid && !ep[P_SKIP_A2A];
        for (int k2 = 0; k2 < K; ++k2) {
            const int v = __shfl_sync(0xffffffffu, id, k2);
            if (k2 < lane && ((valid_mask >> k2) & 1u) && v / L == id / L) is_new_rank = false;
        }
        const unsigned new_ranks = __ballot_sync(0xffffffffu, is_new_rank && lane < first);
        if (lane == 0) {
            a.msg_token[mi] = t;
            a.msg_j[mi] = __popc(new_ranks);
        }
        while (local) {
            const int k = __ffs(local) - 1;
            local &= local - 1;
            const int rk = __shfl_sync(0xffffffffu, row, k);
            const int g = sh + __shfl_sync(0xffffffffu, id, k) - rank * L;
            if (ep[P_SCALE_BYTES])
                place_row_scales<FMT>(ep, a, rk, kTiled ? swizzle_row(s_tiles, s_offsets, g, rk) : rk, scales, lane,
                                      kWarp);
            if (k != first)
                warp_copy16(tokens + rk * pb, tokens + first_row * pb, min(static_cast<long long>(kFanoutChunk), pb), lane);
        }
    }

    CUEP_TRACE(ep, blockIdx.x == gridDim.x - 1, 8);
    // Padding: fp8 rows up to each group's multiple of 4; fp4 scale tiles past each group's last row.
    for (int g = blockIdx.x; g < G; g += gridDim.x) {
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
                for (int b = threadIdx.x; b < ep[P_N_SCALES]; b += blockDim.x) out[b * ep[P_CAPACITY] + row] = 0.f;
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
            for (long long i = threadIdx.x; i < static_cast<long long>(pad_end - n) * k_tiles; i += blockDim.x) {
                const long long srow = static_cast<long long>(s_tiles[g]) * kScaleTileRows + n + i / k_tiles;
                *reinterpret_cast<uint32_t*>(
                    out + swizzled_scale_offset(srow, static_cast<int>(i % k_tiles) * kScaleTileCols, k_tiles)) = 0u;
            }
        }
    }

    CUEP_TRACE(ep, blockIdx.x == gridDim.x - 1, 9);
    // Last block: re-arm the ready tags of this round's messages, then advance the round.
    if (!last_block_done(ctr + C_DONE_RECV, s_flag, /*peer_writes=*/false)) return;
    for (int s = 0; s < n_src; ++s)
        for (int i = threadIdx.x; i < s_msg_count[s]; i += blockDim.x)
            reinterpret_cast<int*>(ep.local(ep[P_OFF_META]) + (s * T_max + i) * ep[P_META_BYTES])[1] = 0;
    if (threadIdx.x == 0) {
        ctr[C_DONE_RECV] = 0;
        ctr[C_RECV_ITEM] = 0;
        ctr[C_RECV_ROUND] = round + 1;
    }
    CUEP_TRACE(ep, true, 10);
}

}  // namespace

template <int FMT, typename T>
__device__ void dispatch_kernel(const long long* params, DispatchArgs a, int phases) {
    extern __shared__ __align__(16) char smem[];
    __shared__ int s_flag;
    const EP ep{params};
    if (has_failed(ep)) return;
    int* ctr = ep.counters();
    // Rounds are read once at entry: the last block of a phase advances them only after every block started.
    const int send_round = *reinterpret_cast<volatile int*>(ctr + C_DISP_ROUND);
    const int recv_round = *reinterpret_cast<volatile int*>(ctr + C_RECV_ROUND);
    __syncthreads();
    CUEP_TRACE(ep, blockIdx.x == 0, 0);
    if (phases & kPhaseNotify) phase_notify(ep, a, send_round, &s_flag);
    // In one fused launch half of the blocks only receive, so the fan-out runs while tokens are still being sent
    // (CUEP_RECV_BLOCK_DIV: 1 / share of receive-only blocks; 0 = every block sends first). 2 x H200, N = 4096
    // bf16: every block sending first 347 us, a quarter receiving 311 us, half 293 us.
#ifndef CUEP_RECV_BLOCK_DIV
#define CUEP_RECV_BLOCK_DIV 2
#endif
    if (phases & kPhaseSend)
        phase_send<FMT, T>(ep, a, send_round, smem, &s_flag, send_block_count(phases, CUEP_RECV_BLOCK_DIV));
    if (phases & kPhaseRecv) phase_recv<FMT>(ep, a, recv_round, smem, &s_flag);
}

#define CUEP_DISPATCH(NAME, FMT, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(kDispatchThreads) NAME(                                    \
        const long long* params, const void* x, const int* topk_ids, const float* topk_weights,            \
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
