// Where a dispatch round's rows go, derived identically by every sender and the receiver from the tally rows alone:
// each local expert's group of rows (padded to the format's row alignment; the fused shared expert's group first),
// and inside a group one block per source in source order, each source's rows in the order its notify reserved
// them. Also the rank-private scratch notify fills for send: each choice's slot, each message's slot.
#pragma once
#include "messages.cuh"

namespace cuep {

// Rows of local expert group (rank r, local expert l) and the shared group of rank r, padded to the row alignment
// (a power of two: cuep.formats.Format checks it; a mask, not a division, on the decode layout's critical path).
__device__ __forceinline__ int padded(long long n, const EPParams& ep) {
    const int a = static_cast<int>(ep.row_align);
    return (static_cast<int>(n) + a - 1) & -a;
}
// Tokens in rank r's shared group: its share of its token count, which is the last column of its tally row (with
// skip_a2a the only row is mine; a share smaller than all N needs skip_a2a, so r is then this rank).
__device__ __forceinline__ int shared_tokens(const EPParams& ep, const int* s_tally, int r) {
    if (!ep.shared) return 0;
    const int n = s_tally[(ep.skip_a2a ? 0 : r) * tally_len(ep) + ep.n_experts];
    return ep.ar_size > 1 ? shared_hi(ep, n) - shared_lo(ep, n) : n;
}
__device__ __forceinline__ int shared_rows(const EPParams& ep, const int* s_tally, int r) {
    return ep.shared ? padded(shared_tokens(ep, s_tally, r), ep) : 0;
}

// Rows of one destination rank r, in expert order: for each local expert (thread-strided), its padded group size,
// scanned. `emit(e, group_start)` receives each expert's first row at rank r (shared-expert rows come first).
template <typename Emit>
__device__ void scan_rank_groups(const EPParams& ep, const int* s_tally, int r, int* s_scan, Emit emit) {
    const int L = static_cast<int>(ep.n_local), E1 = tally_len(ep);
    const int n_src = static_cast<int>(ep.n_src);
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
__device__ __forceinline__ int rows_before(const EPParams& ep, const int* s_tally, int src, int e) {
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



// Per-call scratch private to the rank: each choice's slot inside its (expert, my source index) block, each
// (token, destination rank)'s message slot inside its token range, each token's destination ranks (bit mask), and
// per token range its first message slot at each destination. Filled by notify, read by send.
__device__ __forceinline__ int* scratch_pos(const EPParams& ep) { return reinterpret_cast<int*>(ep.local(ep.off_scratch)); }
__device__ __forceinline__ int* scratch_slot(const EPParams& ep) { return scratch_pos(ep) + ep.max_tokens * ep.top_k; }
__device__ __forceinline__ int* scratch_rank_masks(const EPParams& ep) { return scratch_slot(ep) + ep.max_tokens * kMaxRanks; }
__device__ __forceinline__ int* scratch_range_base(const EPParams& ep) { return scratch_rank_masks(ep) + ep.max_tokens; }
// Tokens per notify range: block b of notify numbers tokens [b x len, (b + 1) x len) (0 in a round without tokens,
// which has no send items). Notify and send run on the same grid (cuep/ep.py: one block per SM of the buffer).
__device__ __forceinline__ int notify_range_len(int num_tokens) {
    const int n_ranges = min(static_cast<int>(gridDim.x), kNotifyRanges);
    return (num_tokens + n_ranges - 1) / n_ranges;
}

}  // namespace cuep
