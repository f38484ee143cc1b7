// Routing rules shared by dispatch and combine: which ranks a round writes to, which top-k choices are valid
// (in range, not a repeat, local with skip_a2a), and a rank's position among a token's destination ranks. Dispatch
// applies them when it sends, combine again when it sums: both read the same topk_ids row the same way.
#pragma once
#include "params.cuh"
#include "state.cuh"

namespace cuep {

// The ranks a round writes to: every rank, or with skip_a2a only this one (d = 0). dest_rank(ep, d): the d-th.
__device__ __forceinline__ int n_dest_ranks(const EPParams& ep) {
    return ep.skip_a2a ? 1 : static_cast<int>(ep.n_ranks);
}
__device__ __forceinline__ int dest_rank(const EPParams& ep, int d) {
    return ep.skip_a2a ? static_cast<int>(ep.rank) : d;
}

// msg_rows [n_src, T, K] (the row of each message's choice k, -1 if none here) is followed by the router weight of
// each of those choices (float, same shape), so combine reads a message's rows and weights together instead of the
// weight behind the row (row_weight[row]: one more dependent load before a decode combine's first expert row).
__device__ __forceinline__ float* msg_weights(const EPParams& ep, int* msg_rows) {
    return reinterpret_cast<float*>(msg_rows + ep.n_src * ep.max_tokens * ep.top_k);
}
__device__ __forceinline__ const float* msg_weights(const EPParams& ep, const int* msg_rows) {
    return reinterpret_cast<const float*>(msg_rows + ep.n_src * ep.max_tokens * ep.top_k);
}

// A warp's lanes as segments of W lanes, a token each (W: the power of two >= K; lane k of a segment holds choice
// k, k < K): log2 W, W, tokens per warp, this lane's segment and slot. (Shifts and masks, not divisions: they sit
// on the decode layout's critical path.) The dispatch's count (notify), the one-rank count and book.
struct ChoiceLanes {
    int lw, W, per_warp, seg, k;
    __device__ __forceinline__ ChoiceLanes(int K, int lane)
        : lw(K <= 1 ? 0 : 32 - __clz(K - 1)), W(1 << lw), per_warp(kWarp >> lw), seg(lane >> lw), k(lane & (W - 1)) {}
};

// A warp holding one token's top-k row, lane k = choice k (k < K): does an earlier lane hold the same value v?
// (All lanes take part.) With `width` W < 32 (a power of two >= K) each W-lane segment holds its own token and
// `lane` is the lane's index in its segment.
__device__ __forceinline__ bool warp_repeats_earlier(int v, int lane, int K, int width = kWarp) {
    bool repeat = false;
    for (int k2 = 0; k2 < K; ++k2) {
        const int u = __shfl_sync(0xffffffffu, v, k2, width);
        if (k2 < lane && u == v) repeat = true;
    }
    return repeat;
}
// Is this lane's choice valid (`choice`: the lane holds one, slot k of token t in a W-lane segment as above): its
// expert id in range, no earlier choice of the token with the same expert, and with skip_a2a on this rank. With
// `report`, a bad id or a repeat is recorded (kStatusBadExpertId / kStatusDuplicateExpert) and so skipped. (All
// lanes take part: the repeat test shuffles.) The dispatch's count (notify), and the one-rank count and book.
__device__ __forceinline__ bool warp_choice_valid(const EPParams& ep, int e, bool choice, int k, int K, int W, int t,
                                                  bool report = true) {
    const int E = static_cast<int>(ep.n_experts), L = static_cast<int>(ep.n_local);
    const bool in_range = choice && e >= 0 && e < E;
    const bool repeat = warp_repeats_earlier(e, k, K, W);
    if (report && choice && !in_range) report_error(ep, kStatusBadExpertId, K_DISPATCH_SEND, e, t);
    const bool local_ok = !ep.skip_a2a || (in_range && e / L == static_cast<int>(ep.rank));
    if (report && in_range && repeat && local_ok) report_error(ep, kStatusDuplicateExpert, K_DISPATCH_SEND, e, t);
    return in_range && !repeat && local_ok;
}
// Is this lane's choice, valid by `valid_mask`, the first valid one of its rank `rank_of` (no earlier valid lane
// with the same rank)? (All lanes take part; `width` and `lane` as above, `valid_mask` the segment's own bits.)
__device__ __forceinline__ bool warp_first_of_rank(int rank_of, unsigned valid_mask, int lane, int K,
                                                   int width = kWarp) {
    bool first = (valid_mask >> lane) & 1u;
    for (int k2 = 0; k2 < K; ++k2) {
        const int u = __shfl_sync(0xffffffffu, rank_of, k2, width);
        if (k2 < lane && ((valid_mask >> k2) & 1u) && u == rank_of) first = false;
    }
    return first;
}

// Is top-k choice k of this token a valid expert for this call (in range, not a repeat; with skip_a2a, local)?
__device__ __forceinline__ bool valid_choice(const EPParams& ep, const int* ids_row, int k) {
    const int e = ids_row[k];
    if (e < 0 || e >= ep.n_experts) return false;
    for (int j = 0; j < k; ++j)
        if (ids_row[j] == e) return false;
    if (ep.skip_a2a && e / ep.n_local != ep.rank) return false;
    return true;
}

// The fused shared expert's tokens of this rank: all N, or with allreduce_world_size A > 1 its share [lo, hi) of
// them (position p = rank % A takes [p N / A, (p + 1) N / A)), so the all-reduce after a skip_a2a combine sums each
// token's shared expert once. Row i of the shared group is token lo + i.
__device__ __forceinline__ int shared_lo(const EPParams& ep, int n) {
    return static_cast<int>(ep.ar_index * n / ep.ar_size);
}
__device__ __forceinline__ int shared_hi(const EPParams& ep, int n) {
    return static_cast<int>((ep.ar_index + 1) * n / ep.ar_size);
}

// A one-rank round (dispatch/local.cuh, combine/local.cuh): each choice's position in its group (its row is the
// group's first row + it; -1: no row), int32 [T, K] in the rank-private scratch (the protocol's choice slots, which
// a one-rank round does not use). The one-rank dispatch writes it, the one-rank combine of the round reads it.
__device__ __forceinline__ int* local_choice_pos(const EPParams& ep) {
    return reinterpret_cast<int*>(ep.local(ep.off_scratch));
}

}  // namespace cuep
