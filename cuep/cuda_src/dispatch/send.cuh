// Dispatch, phase 2 (send): every destination's row layout from the tally rows (large round) or no layout at all
// (small round: staging records), then items of (token, chunk): encode the chunk once (shared memory, or straight
// from x for bf16), put it to each destination rank that holds one of the token's experts, put the metadata and
// scales, fence_puts, and set the chunk's flag at each destination.
#pragma once
#include "layout.cuh"
#include "scales.cuh"
#include "staged.cuh"

namespace cuep {

// Chunk `ch` of `n_chunks` of a row (chunks of `spans` whole 256-value spans): its values [c_lo, c_hi) and its bytes
// of the payload [p_lo, p_hi) and of the row's scales [s_lo, s_hi) (16- and 8-byte aligned; the last chunk takes
// the rest of both). Shared by the protocol's send and the one-rank placement (local.cuh).
template <int FMT>
struct ChunkBytes {
    int c_lo, c_hi;
    bool last;
    long long p_lo, p_hi;
    int s_lo, s_hi;
    __device__ __forceinline__ ChunkBytes(int ch, int spans, int n_chunks, int H, long long pb, int sb) {
        using S = typename FormatTraits<FMT>::Scale;
        c_lo = ch * spans * kWarpSpan;
        c_hi = min(H, c_lo + spans * kWarpSpan);
        last = ch == n_chunks - 1;
        p_lo = payload_offset<FMT>(c_lo);
        p_hi = last ? pb : payload_offset<FMT>(c_hi);
        s_lo = FMT == kFmtBf16 ? 0 : int(sizeof(S)) * (c_lo / max(1, FormatTraits<FMT>::kBlock));
        s_hi = FMT == kFmtBf16 ? 0 : (last ? static_cast<int>(align_up(sb)) :
                                      int(sizeof(S)) * (c_hi / max(1, FormatTraits<FMT>::kBlock)));
    }
};

// Encode values [c_lo, c_hi) of the row x_row (c_lo a multiple of 256; c_hi too, or H) into a warp's staging:
// payload bytes at their offsets in the whole row, scales as the row's plain scale bytes. All 32 lanes; ends with
// __syncwarp. Four spans per step while they last (4 loads in flight per lane: one span at a time left the encode
// waiting on each load), each step asking L2 for the next one while it encodes, then one at a time. (One-rank
// N = 4096 on an H100, per-block trace: the next step's prefetch cut the early whole-token encode from 15.3 to
// 14.9 us and the round by about 1 us in every quantized format; the whole chunk prefetched up front instead made
// that encode 3 us slower, its requests queued ahead of the loads.) global_scale: g (float), or g with nvfp4's
// multiplier per scale byte (Nvfp4Table).
template <int FMT, typename T, class GScale>
__device__ __forceinline__ void encode_chunk(const T* x_row, int c_lo, int c_hi, int H, uint8_t* s_payload,
                                             uint8_t* s_scales, GScale global_scale, int lane) {
    using S = typename FormatTraits<FMT>::Scale;
    const RowSource<T> src{x_row};
    const RowScales<S> row_scales{reinterpret_cast<S*>(s_scales)};
    // about 64 bytes of x in flight per lane: 4 spans of bf16, 2 of float32
    constexpr int kSteps = sizeof(T) == 2 ? kEncodeSteps : kEncodeSteps / 2;
    int col0 = c_lo;
    for (; col0 + kSteps * kWarpSpan <= c_hi; col0 += kSteps * kWarpSpan) {
        if constexpr (FMT == kFmtBf16)
            warp_quantize_span<FMT, kSteps>(src, col0, H, s_payload, NoScales{}, global_scale, lane);
        else
            warp_quantize_span<FMT, kSteps>(src, col0, H, s_payload, row_scales, global_scale, lane,
                                            col0 + kSteps * kWarpSpan < c_hi);
    }
    for (; col0 < c_hi; col0 += kWarpSpan) {
        if constexpr (FMT == kFmtBf16)
            warp_quantize_span<FMT, 1>(src, col0, H, s_payload, NoScales{}, global_scale, lane);
        else
            warp_quantize_span<FMT, 1>(src, col0, H, s_payload, row_scales, global_scale, lane);
    }
    __syncwarp();
}

// send: every rank's layout from the histograms, then one warp per token: encode it once (shared memory, or
// straight from x for bf16) and store it to each destination rank it goes to.
template <int FMT, typename T>
__device__ void phase_send(const EPParams& ep, const DispatchArgs& a, int round, char* smem, int send_blocks,
                           bool book_ready, bool local_from_x, const uint64_t* early_ready) {
    const int E = static_cast<int>(ep.n_experts), K = static_cast<int>(ep.top_k);
    const int L = static_cast<int>(ep.n_local), H = static_cast<int>(ep.hidden);
    const int R = static_cast<int>(ep.n_ranks), rank = static_cast<int>(ep.rank);
    const int n_src = static_cast<int>(ep.n_src), me = static_cast<int>(ep.src_index);
    const int par = round & 1;
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
    const long long fixed = max(tally_bytes + align_up(4LL * E), ep.small_tokens > 0 ? small_book_bytes(ep) : 0LL);
    int* s_tally = reinterpret_cast<int*>(smem);
    int* s_base = reinterpret_cast<int*>(smem + tally_bytes);
    const long long pb = ep.payload_bytes;
    const int sb = static_cast<int>(ep.scale_bytes);
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
        // cold in a decode round, and nothing but the stores needs the wait.
        const int item0 = warp * n_senders + static_cast<int>(blockIdx.x) - first_sender;
        if (item0 < a.num_tokens * n_chunks) {
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
        // stores (2 x H200, N = 128 bf16: 29.1-29.4 us against 32.4-32.8 with the wait): the receiver waits for
        // the tallies, the book rows and each message's chunk flags anyway.
        if (!small_round_ready(ep, round, &s_ok, early_ready)) return;
    } else {
        // 1. Every source's histogram of this round (also: every destination is ready for it).
        if (!load_tallies(ep, round, s_tally, K_DISPATCH_SEND, &s_ok)) return;
        const int n_dest = n_dest_ranks(ep);
        for (int d = 0; d < n_dest; ++d) {
            const int r = dest_rank(ep, d);
            scan_rank_groups(ep, s_tally, r, s_scan, [&](int e, int, int start, int) {
                s_base[e] = start + rows_before(ep, s_tally, me, e);
            });
        }
    }

    // 2. Items (token, chunk of whole 256-value spans), one warp each; lane k holds top-k choice k. A prefill batch
    // keeps one chunk (one warp) per token; a decode batch spreads each token over several warps (one warp
    // storing a whole token to every destination was what a small batch waited for). Every chunk sets its flag in
    // the message's record (chunk_flag) last, so the receiver knows when all of a message has landed.
    const int* pos = scratch_pos(ep);
    const int* slots = scratch_slot(ep);
    const int* range_base = scratch_range_base(ep);
    const int range_len = small ? 1 : notify_range_len(a.num_tokens);
    // the tokens whose shared-expert row this rank holds (allreduce_world_size: its share)
    // (in shared memory: read only when a shared expert is fused, they would hold two registers through the loop)
    __shared__ int s_shared_lo, s_shared_hi;
    if (threadIdx.x == 0) {
        s_shared_lo = ep.shared ? shared_lo(ep, a.num_tokens) : 0;
        s_shared_hi = ep.shared ? shared_hi(ep, a.num_tokens) : 0;
    }
    __syncthreads();
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
        const ChunkBytes<FMT> cb(ch, spans_per_chunk, n_chunks, H, pb, sb);
        const int c_lo = cb.c_lo, c_hi = cb.c_hi, s_lo = cb.s_lo, s_hi = cb.s_hi;
        const bool last = cb.last;
        const long long p_lo = cb.p_lo, p_hi = cb.p_hi;
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
            encode_chunk<FMT, T>(x_row, c_lo, c_hi, H, s_payload, s_scales, a.global_scale, lane);
            payload = s_payload;
        }
        // Destinations in a rotated order (from the token's index): the warps of every GPU then write to every
        // destination at once. With d = 0, 1, ... in every warp, all GPUs began by writing to rank 0, one
        // destination took three GPUs' traffic at a time, and the 4-GPU send half ran at 210 GB/s against the
        // 350 GB/s of an all-to-all copy kernel. With local_from_x my own tokens are not staged here: my receive
        // phase takes them from x.
        const unsigned allowed = local_from_x ? ~(1u << rank) : ~0u;
        unsigned sent = 0;  // destinations of this item
        int n_dst = 0;      // how many; lane j < n_dst holds the payload's PutTarget at the j-th, in order
        PutTarget lane_dst = 0;
        for (int i = 0; i < R; ++i) {
            const int d = (t + rank + i) % R;
            if (!((allowed >> d) & 1u)) continue;
            const unsigned mask = __ballot_sync(0xffffffffu, r == d);
            if (!mask) continue;
            sent |= 1u << d;
            const int first = __ffs(mask) - 1;
            const int first_row = __shfl_sync(0xffffffffu, row, first);
            char* meta = message_meta(ep, d, small, par, me, message_slot(t, d));
            char* dst = small ? staged_payload(ep, meta) : remote(ep, d, ep.off_tokens) + first_row * pb;
            if (lane == n_dst) lane_dst = put_target(d, dst);
            ++n_dst;
            if (ch == 0) {  // a staged record needs only the weights: its token and rows are in the book row
                if (lane == 0 && !small) put_value(d, reinterpret_cast<int*>(meta), t);
                if (lane < K) {
                    put_value(d, reinterpret_cast<float*>(meta + ep.meta_w) + lane, w);
                    if (!small) {
                        put_value(d, reinterpret_cast<uint16_t*>(meta + ep.meta_ids) + lane, static_cast<uint16_t>(e));
                        put_value(d, reinterpret_cast<int*>(meta + ep.meta_rows) + lane, r == d ? row : -1);
                    }
                }
            }
            for (int b = s_lo + 8 * lane; b < s_hi; b += 8 * kWarp)
                put_value(d, reinterpret_cast<uint2*>(meta + ep.meta_scales + b),
                          *reinterpret_cast<const uint2*>(s_scales + b));
        }
        if (ep.shared && s_shared_lo <= t && t < s_shared_hi) {
            // my own token is also a row of my shared-expert group 0 (row t - lo of my share)
            if (lane == n_dst) lane_dst = put_target(rank, ep.local(ep.off_tokens) + (t - s_shared_lo) * pb);
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
                put_vectors(__shfl_sync(0xffffffffu, lane_dst, j), b, v, n, lane);
        }
        // The chunk sets its flag in each destination's record last: the warp's puts above happen before the
        // flags (warp barrier, then one fence_puts for all destinations: a release per destination waited for each
        // destination's stores in turn, 5 us of a 2-GPU decode dispatch).
        __syncwarp();
        if (lane == 0 && sent) {
            fence_puts();
            for (unsigned m = sent; m; m &= m - 1) {
                const int d = __ffs(m) - 1;
                char* meta = message_meta(ep, d, small, par, me, message_slot(t, d));
                signal_flag(d, message_flags(ep, meta) + ch, chunk_flag(round, n_chunks));
            }
        }
        if (ep.shared && s_shared_lo <= t && t < s_shared_hi) {
            // My own token is row t - lo of my shared-expert group 0 (its payload went with the destinations').
            const long long srow = t - s_shared_lo;
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

    }
done:
    // No end-of-phase count: every message carries its own chunk flags, and the block that entered the kernel last
    // advances the round (dispatch_kernel).
    return;
}

}  // namespace cuep
