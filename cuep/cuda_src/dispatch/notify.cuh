// Dispatch, phase 1 (notify): reserve every (token, k) row slot and every (token, destination) message slot, then
// publish the tally row (histogram, token count, message count) to every destination. The tally rows are also the
// readiness handshake: a rank publishes round q only after its own round q - 1 was received (stream order).
#pragma once
#include "layout.cuh"
#include "staged.cuh"

namespace cuep {

// notify: one warp per token, lane k = choice k. Reserve every slot with an atomic (the histogram is the slot
// counter); each block takes a contiguous token range and numbers its messages in token order; the last block
// turns the ranges' message counts into their first slots and publishes the histogram to every destination.
__device__ void phase_notify(const EPParams& ep, const DispatchArgs& a, int round, int* s_flag, char* smem,
                             const uint64_t* early_ready) {
    const int E = static_cast<int>(ep.n_experts), K = static_cast<int>(ep.top_k);
    const int L = static_cast<int>(ep.n_local);
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
        if (!small_round_ready(ep, round, &s_ok, early_ready)) return;
        int n_msgs[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) n_msgs[i] = book.n_msgs[i];
        publish_tallies(ep, round, book.hist, a.num_tokens, n_msgs);
        publish_small_book(ep, a, round, book);
        return;
    }
    // Lanes in segments of W (a power of two >= K), one token each, lane k of a segment = choice k: repeats and
    // first choices per rank found with shuffles inside the segment. Block b takes token range b (contiguous, at
    // most kNotifyRanges ranges). (A warp per token, lanes K..31 idle, took 11 us at N = 4096 on 2 x H200, 18.5 at
    // 8192: two and four passes of dependent loads and atomics.)
    const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    const int R = static_cast<int>(ep.n_ranks);
    const int n_ranges = min(static_cast<int>(gridDim.x), kNotifyRanges);
    const int range_len = notify_range_len(a.num_tokens);
    const int lo = min(a.num_tokens, static_cast<int>(blockIdx.x) * range_len);
    const int hi = static_cast<int>(blockIdx.x) < n_ranges ? min(a.num_tokens, lo + range_len) : lo;
    const ChoiceLanes cl(K, lane);
    const int W = cl.W, per_warp = cl.per_warp, seg = cl.seg, k = cl.k;
    const unsigned seg_bits = W == kWarp ? 0xffffffffu : (1u << W) - 1u;
    for (int t0 = lo + static_cast<int>(threadIdx.x) / kWarp * per_warp; t0 < hi; t0 += n_warps * per_warp) {
        const int t = t0 + seg;
        const bool choice = t < hi && k < K;
        const long long i = static_cast<long long>(t) * K + k;
        const int e = choice ? a.topk_ids[i] : -1;
        const bool valid = warp_choice_valid(ep, e, choice, k, K, W, t);
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
    if (!last_block_done(ctr + C_DONE_NOTIFY, s_flag)) return;
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
    // Publish [hist | num_tokens | messages for you] to every destination's tally row for me; re-arm the histogram.
    // The fence: this rank's send blocks read the scratch slots once they see their own tally row.
    __threadfence();
    publish_tallies(ep, round, hist, a.num_tokens, n_msgs);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    if (threadIdx.x == 0) ctr[C_DONE_NOTIFY] = 0;
}

}  // namespace cuep
