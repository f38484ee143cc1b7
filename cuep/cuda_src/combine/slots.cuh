// Where a combine round's data lands at the token's rank, and how that rank learns it has:
//   comb_recv[t, slot]   one slot per partial sum (kPartial: slot j = the sender's position among the token's
//                        destination ranks, plus D x (round & 1) in parity slots) or per choice (slot k)
//   comb_arrived         a count of 16-byte vectors landed per (parity, token), one counter per 128-byte line,
//                        signalled after the data (signal_add); re-armed one round ahead by notify
//   comb_poll            the bf16 partial sums of a round's first tokens, which the receiver polls word by word
//                        (no count, no fence on the critical path)
//   comb_ready           per sender, the rounds this rank lets in (readiness.cuh)
//   out[t] directly      direct_out: one call, partial sums, one destination rank: the send half finishes the token
#pragma once
#include "../ep.cuh"
#include "../formats.cuh"

namespace cuep {

// Per-token arrival counts of a warp's bulk-stored partial sums. Lane 0 issues every bulk store of its warp and
// holds this: an item's vector count is added to the receiver's comb_arrived[t] once its stores are complete. It is
// queued when the item's last slice has been issued and posted when the next item's last slice has (wait_group 1:
// every group but the newest is complete), so the warp rarely waits for NVLink.
// The count's release is at GPU scope for this rank's own tokens (signal_add).
struct Arrivals {
    int* ptr = nullptr;
    int vectors = 0;
    int rank = 0;  // the receiver
    __device__ __forceinline__ void queue(const EPParams& ep, int r, int* p, int n) {
        if (ptr) {
            put_bulk_wait<1>();  // every bulk put but the newest group is complete
            signal_add(ep, rank, ptr, vectors);
        }
        ptr = p;
        vectors = n;
        rank = r;
    }
    __device__ __forceinline__ void flush(const EPParams& ep) {
        put_bulk_wait<0>();
        if (ptr) signal_add(ep, rank, ptr, vectors);
        ptr = nullptr;
    }
};

// Token t's arrival count at rank r for round `round`: comb_arrived is [2 parities, T] counters (notify re-arms the
// other parity one round ahead, so no receive half ends with a re-arm), one per 128-byte line: packed, the 128
// counts of a decode round sat in 4 lines that every receive warp polled and every sender added to.
// cuep/config.py sizes the region: 32 int32 per token and parity.
constexpr int kArrivedStride = 32;
__device__ __forceinline__ int* arrived_base(const EPParams& ep, int r, int round) {
    return reinterpret_cast<int*>(remote(ep, r, ep.off_comb_arrived)) + (round & 1) * ep.max_tokens * kArrivedStride;
}
__device__ __forceinline__ int* arrived_counter(const EPParams& ep, int r, int round, int t) {
    return arrived_base(ep, r, round) + static_cast<long long>(t) * kArrivedStride;
}

// Direct output: in one cuep.combine call (kPhaseOneCall on every launch of it, cuep/ep.py) of a partial-sum round
// with one destination rank (one rank, or skip_a2a), every message is one of this rank's own tokens and its
// partial sum the token's only one: the send half finishes out[t] from its registers (finish_out_vector) instead
// of storing the partial into comb_recv / comb_poll for the receive half to read back (2 x N x H x 2 bytes of HBM:
// 117 MB of a 646 MB bf16 round at N = 4096, H = 7168, K = 8), with no arrival count; the receive half finishes only
// the tokens with no partial sum (no valid choice here). Both halves read the same bits, so they agree in
// phase-by-phase launches too; combine_async / combine_wait (no kPhaseOneCall) keep the round trip, so out is
// written only by combine_wait, with the residual it is given.
constexpr int kPhaseOneCall = kPhaseLocalX;  // combine: the send and receive phases of this round are one call
__device__ __forceinline__ bool direct_out(const EPParams& ep, const CombineArgs& a) {
    return a.mode == kPartial && n_dest_ranks(ep) == 1 && (a.phases & kPhaseOneCall) != 0;
}

// 8 consecutive values of a combine-dtype row as float, and back.
template <typename TC>
__device__ __forceinline__ void load8f(const TC* p, float (&v)[8]) {
    if constexpr (sizeof(TC) == 2) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        bf16x8_values(w, v);
    } else {
        const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
        f32x8_values(a, b, v);
    }
}
template <typename TC>
__device__ __forceinline__ void store8f(TC* p, const float (&v)[8]) {
    if constexpr (sizeof(TC) == 2) {
        *reinterpret_cast<uint4*>(p) = make_uint4(bf16x2_encode(v[0], v[1]), bf16x2_encode(v[2], v[3]),
                                                  bf16x2_encode(v[4], v[5]), bf16x2_encode(v[6], v[7]));
    } else {
        reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

// out[t] vector c = acc (the token's weighted expert rows, float32) + the shared expert's row (group 0, row t - sh_lo,
// for tokens in this rank's share [sh_lo, sh_hi): empty without a fused shared expert) + the residual, rounded once.
// The receive half's last step, and the send half's for the tokens it finishes itself (direct_out).
template <typename TC>
__device__ __forceinline__ void finish_out_vector(const EPParams& ep, const CombineArgs& a, int sh_lo, int sh_hi, int t,
                                                  int c, float (&acc)[8]) {
    const long long H = ep.hidden;
    if (sh_lo <= t && t < sh_hi) {
        float v[8];
        load8f(static_cast<const TC*>(a.expert_out) + (t - sh_lo) * H + 8 * c, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
    if (a.residual) {
        float v[8];
        load8f(static_cast<const TC*>(a.residual) + t * H + 8 * c, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
    store8f(static_cast<TC*>(a.out) + t * H + 8 * c, acc);
}

}  // namespace cuep
