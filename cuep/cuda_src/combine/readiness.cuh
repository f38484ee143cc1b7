// Combine, phase 1 (notify) and the readiness protocol: when may a rank send round q to this one, parity slots
// (two rounds in a row never share a slot, so a round's receive needs no end-of-round count), and the polled
// partial sums of a round's first tokens.
#pragma once
#include "slots.cuh"

namespace cuep {

// ---- readiness: when may a rank send round q to this one? -------------------------------------------------
// Parity slots: a partial-sum round (kPartial) whose partials fit twice in a token's K slots (2 x destination ranks
// <= top_k) puts round q's partial j of token t in slot j + D x (q & 1), D = destination ranks. Two rounds in a
// row never share a slot, so at the start of round q (notify) the receiver, whose round q - 1 is over, re-arms the
// other parity and already lets everyone send round q + 1: the receive half ends with its last token, without an
// end-of-round count (that count, re-arm and publication took 3.5 us of a 2-GPU decode combine). Other rounds
// (weighted, unreduced, or 2 D > K) use slots 0..K-1 and publish readiness for the next round at their end.
// comb_ready is uint64 [2][R]: [0][s] = "any" readiness from rank s, [1][s] = parity-slot readiness; a value v lets
// rounds < v be sent. A round q in parity slots may be sent once either reaches q + 1, any other round once "any"
// does. C_CREADY remembers the last "any" value this rank published.
__device__ __forceinline__ bool parity_slots(const EPParams& ep, int mode) {
    return mode == kPartial && 2 * n_dest_ranks(ep) <= ep.top_k;
}
__device__ __forceinline__ int slot_base(const EPParams& ep, int mode, int round) {
    return parity_slots(ep, mode) ? n_dest_ranks(ep) * (round & 1) : 0;
}

// ---- polled partial sums: the receiver watches the data, not a count ------------------------------------------
// A count behind the data needs a system-scope release before it (MEMBAR.SYS: 2.2 us of a 2-GPU decode combine,
// with nothing of the warp outstanding), then travels to the receiver (3 us to be seen). Tokens t < P_POLL_TOKENS of
// a bf16 round in parity slots skip both: their partial sums go to comb_poll, whose 8-byte words are all ones until
// written (no bf16 partial sum holds 0xFFFF: bf16_encode turns NaN into 0x7FC0 / 0xFFC0). The sender stores each
// 16-byte vector as two relaxed system-scope 8-byte words; an aligned 8-byte access is single-copy atomic, so a
// receiver that reads a word other than all ones reads the whole word as written, in any order of the words, with no
// fence on either side. The receiver sets each vector back to all ones once read: the slot's next writer (round
// q + 2, same parity) waits for the readiness that this rank publishes at the start of round q + 1, after this launch.
template <typename TC>
__device__ __forceinline__ bool poll_token(const EPParams& ep, const CombineArgs& a, int t) {
    return sizeof(TC) == 2 && t < ep.poll_tokens && parity_slots(ep, a.mode);
}
// Slot j (the sender's position among the token's destination ranks) of token t's polled partial sums at rank r.
__device__ __forceinline__ uint16_t* poll_slot(const EPParams& ep, int r, int round, int t, int j) {
    const long long row = ((round & 1) * ep.poll_tokens + t) * n_dest_ranks(ep) + j;
    return reinterpret_cast<uint16_t*>(remote(ep, r, ep.off_comb_poll)) + row * ep.hidden;
}
constexpr unsigned long long kNotLanded = ~0ull;
__device__ __forceinline__ void store8_polled(int r, uint16_t* p, const float (&v)[8]) {
    using u64 = unsigned long long;
    const u64 lo = bf16x2_encode(v[0], v[1]) | static_cast<u64>(bf16x2_encode(v[2], v[3])) << 32;
    const u64 hi = bf16x2_encode(v[4], v[5]) | static_cast<u64>(bf16x2_encode(v[6], v[7])) << 32;
    put_words_polled(r, p, lo, hi);
}
// This lane's vector of a polled slot once both its words have landed, as floats; then the vector is all ones again.
// False on timeout or once the rank has failed.
__device__ __forceinline__ bool take_polled(const EPParams& ep, uint16_t* p, float (&v)[8]) {
    unsigned long long lo, hi;
    SpinClock clock;
    while (true) {
        poll_words(p, lo, hi);
        if (lo != kNotLanded && hi != kNotLanded) break;
        if (clock.stop(ep, K_COMBINE_RECV, -1)) return false;
        __nanosleep(32);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(~0u, ~0u, ~0u, ~0u);
    bf16x8_values(make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                             static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32)), v);
    return true;
}

// Tell every rank that sends to this one that it may send rounds < `value` ("any", or parity-slot readiness).
// Threads 0..senders-1 of one block; a release, cumulative over the block barrier before it.
__device__ __forceinline__ void publish_ready(const EPParams& ep, int value, bool parity) {
    if (threadIdx.x < n_dest_ranks(ep)) {
        const int r = dest_rank(ep, threadIdx.x);
        uint64_t* flag = reinterpret_cast<uint64_t*>(remote(ep, r, ep.off_comb_ready)) + (parity ? ep.n_ranks : 0) +
                         ep.rank;
        signal_release(r, flag, static_cast<uint64_t>(value));
    }
}

// notify (block 0), receiver side of round q: re-arm the other parity's arrival counts and item counter (their
// last round, q - 1, is over: this launch comes after its receive half), then publish readiness: "any" for round q
// unless the end of round q - 1 did, and in parity slots for round q + 1 (its slots are not round q's): that one is
// not urgent, so in a launch that also sends, block 0 publishes it after its sends (publish_parity_ready; here it
// delayed block 0's first item by 2 us).
__device__ __forceinline__ void publish_parity_ready(const EPParams& ep, int round, int mode) {
    if (!parity_slots(ep, mode)) return;
    __syncthreads();  // every re-arming store of phase_notify before the flags (release, cumulative)
    publish_ready(ep, round + 2, true);
}
__device__ void phase_notify(const EPParams& ep, int round, int mode, bool defer_parity, int num_tokens) {
    if (blockIdx.x != 0) return;
    int* ctr = ep.counters();
    // Only the tokens of the other parity's last round (q - 1) can have nonzero counts: a decode round in a buffer
    // sized for prefill re-arms its N lines, not T (C_ARRIVED_N: this round's N, for the re-arm at round q + 1).
    const int n_arm = ctr[C_ARRIVED_N + ((round + 1) & 1)];
    int* arrived = arrived_base(ep, static_cast<int>(ep.rank), round + 1);
    for (int t = threadIdx.x; t < n_arm; t += blockDim.x) arrived[static_cast<long long>(t) * kArrivedStride] = 0;
    if (threadIdx.x == 0) ctr[C_ARRIVED_N + (round & 1)] = num_tokens;
    const bool parity = parity_slots(ep, mode);
    // "any" readiness for this round: not needed after a parity round (it let this round in already) nor after a
    // round that published it at its end (C_CREADY); needed in the first round after a reset
    const bool publish_any = ctr[C_CREADY] < round + 1 && (!parity || round == 0);
    if (threadIdx.x == 0) ctr[C_CRECV_ITEM + ((round + 1) & 1)] = 0;
    if (publish_any) {
        __syncthreads();
        publish_ready(ep, round + 1, false);
        if (threadIdx.x == 0) ctr[C_CREADY] = round + 1;
    }
    if (!defer_parity) publish_parity_ready(ep, round, mode);
}

}  // namespace cuep
