// Combine, phase 3 (receive): tokens in order, each as soon as its arrival count says every slot has landed
// (polled tokens: each vector as it lands): out[t] = the sum of its slots (weighted by topk_weights in kWeighted),
// plus the shared expert's row and the residual; or the unreduced [N, K (+1), H]. With direct_out (slots.cuh) the
// send half has finished every token that has a partial sum, and only the others are left here. Outside parity
// slots the last block then lets the next round in.
#pragma once
#include "readiness.cuh"

namespace cuep {

// The receive item of this warp when the items (token, chunk) are no more than the grid's warps: item w for warp
// w = warp * grid + block, -1 if it has none; -2 when there are more items than warps (claimed dynamically).
__device__ __forceinline__ int recv_static_item(const CombineArgs& a, int n_vec) {
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / kWarp);
    const int kChunkVecs = static_cast<int>(chunk_units(a.num_tokens, n_vec, kWarp));
    const long long items = static_cast<long long>(a.num_tokens) * ((n_vec + kChunkVecs - 1) / kChunkVecs);
    if (items > warps) return -2;
    const long long w = static_cast<long long>(threadIdx.x / kWarp) * gridDim.x + blockIdx.x;
    return w < items ? static_cast<int>(w) : -1;
}

template <typename TC>
__device__ void phase_recv(const EPParams& ep, const CombineArgs& a, int round, int* s_flag) {
    const int K = static_cast<int>(ep.top_k), H = static_cast<int>(ep.hidden);
    const int L = static_cast<int>(ep.n_local);
    const bool shared = ep.shared != 0;
    // the tokens whose shared-expert row is here: all, or this rank's share (allreduce_world_size), row t - sh_lo
    const int sh_lo = shared ? shared_lo(ep, a.num_tokens) : 0, sh_hi = shared ? shared_hi(ep, a.num_tokens) : 0;
    int* ctr = ep.counters();
    int* arrived = arrived_base(ep, static_cast<int>(ep.rank), round);
    const int slots0 = slot_base(ep, a.mode, round);
    const TC* recv = reinterpret_cast<const TC*>(ep.local(ep.off_comb_recv));
    const TC* eo = static_cast<const TC*>(a.expert_out);
    TC* out = static_cast<TC*>(a.out);
    const int n_vec = H / 8, E = static_cast<int>(ep.n_experts);
    const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    // One warp per token, lane k = top-k choice k (the same validity rules as dispatch, with shuffles). Items
    // (token, chunk) are claimed in token order with an atomic (lane 0): the senders return every source's
    // tokens roughly in order (dispatch gives message slots in token order), and blocks that finish sending
    // early, or receive-only blocks, take whatever is next.
    const int kChunkVecs = static_cast<int>(chunk_units(a.num_tokens, n_vec, kWarp));
    const int n_chunks = (n_vec + kChunkVecs - 1) / kChunkVecs;
    // When every item has a warp of its own (decode), warp w takes item w (recv_static_item): no claim atomics, a
    // thousand of which on one address came all at once when the send half ended.
    const int static_item = recv_static_item(a, n_vec);
    int* next_item = ctr + C_CRECV_ITEM + (round & 1);  // notify re-arms the other one
    auto claim = [&](int prev) {
        if (static_item >= -1) return prev == -2 ? static_item : a.num_tokens * n_chunks;  // one item, then done
        return __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(next_item, 1) : 0, 0);
    };
    // out[t] vector c = acc (the summed slots) + the shared expert's row + the residual
    auto finish_vector = [&](int t, int c, float (&acc)[8]) { finish_out_vector<TC>(ep, a, sh_lo, sh_hi, t, c, acc); };
    // the send half finished every token with a partial sum itself (slots.cuh): only tokens without one are left
    const bool direct = direct_out(ep, a);
    (void)n_warps;
    bool ok = true;
    for (int item = claim(-2); item >= 0 && item < a.num_tokens * n_chunks; item = claim(item)) {
        const int t = item / n_chunks, ch = item % n_chunks;
        const int c_begin = ch * kChunkVecs, c_end = min(n_vec, c_begin + kChunkVecs);
        const int e = lane < K ? a.topk_ids[static_cast<long long>(t) * K + lane] : -1;
        const bool repeat = warp_repeats_earlier(e, lane, K);
        const bool valid = lane < K && e >= 0 && e < E && (!ep.skip_a2a || e / L == ep.rank) && !repeat;
        const unsigned valid_mask = __ballot_sync(0xffffffffu, valid);
        const bool first_of_rank = warp_first_of_rank(e / L, valid_mask, lane, K);
        // partial sums: one per destination rank of the token (with skip_a2a, one if any choice was local)
        const int n_partials = __popc(__ballot_sync(0xffffffffu, first_of_rank));
        if (direct && n_partials != 0) continue;  // out[t] is the send half's (direct_out): nothing landed here
        const float w = (a.mode == kWeighted && valid) ? a.topk_weights[static_cast<long long>(t) * K + lane] : 0.f;
        // Wait until every slot of the token has landed: each is n_vec vectors (partials: one slot per
        // destination rank; rows: one per valid choice).
        const int n_slots = a.mode == kPartial ? n_partials : __popc(valid_mask);
        const bool polled = poll_token<TC>(ep, a, t);
        if (!polled && !warp_wait_value(arrived + static_cast<long long>(t) * kArrivedStride, n_slots * n_vec, ep,
                                      K_COMBINE_RECV, -1, lane)) {
            ok = false;
            break;
        }
        const TC* slots = recv + (static_cast<long long>(t) * K + slots0) * H;
        if (polled) {
            // each 16-byte vector of the token's partial sums as soon as it has landed (in slot order, as below)
            uint16_t* base = poll_slot(ep, static_cast<int>(ep.rank), round, t, 0);
            bool lane_ok = true;
            for (int c = c_begin + lane; lane_ok && c < c_end; c += kWarp) {
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int j = 0; j < n_partials; ++j) {
                    float v[8];
                    if (!take_polled(ep, base + static_cast<long long>(j) * H + 8 * c, v)) {
                        lane_ok = false;
                        break;
                    }
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] += v[i];
                }
                if (!lane_ok) break;
                finish_vector(t, c, acc);
            }
            if (!__all_sync(0xffffffffu, lane_ok)) {
                ok = false;
                break;
            }
        } else if (a.mode == kUnreduced) {
            const int width = K + (shared ? 1 : 0);
            TC* o = out + static_cast<long long>(t) * width * H;
            const int span = c_end - c_begin;
            for (int i = lane; i < width * span; i += kWarp) {
                const int k = i / span, c = c_begin + i % span;
                float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                if (k < K) {
                    if ((valid_mask >> k) & 1u) load8f(slots + static_cast<long long>(k) * H + 8 * c, v);
                } else {
                    if (sh_lo <= t && t < sh_hi)  // shared expert: group 0, row t - sh_lo
                        load8f(eo + static_cast<long long>(t - sh_lo) * H + 8 * c, v);
                }
                store8f(o + static_cast<long long>(k) * H + 8 * c, v);
            }
        } else {
            // The slots to sum (partials: the first n_partials; weighted: the valid choices), 4 loads in flight.
            const unsigned slot_mask = a.mode == kPartial ? (n_partials >= 32 ? 0xffffffffu : (1u << n_partials) - 1u)
                                                          : valid_mask;
            for (int c0 = c_begin; c0 < c_end; c0 += kWarp) {
                const int c = c0 + lane;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                unsigned mk = slot_mask;
                while (mk) {
                    int jk[4];
                    float wk[4], v[4][8];
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        jk[u] = mk ? __ffs(mk) - 1 : -1;
                        if (mk) mk &= mk - 1;
                        wk[u] = a.mode == kWeighted ? __shfl_sync(0xffffffffu, w, jk[u] < 0 ? 0 : jk[u]) : 1.f;
                    }
#pragma unroll
                    for (int u = 0; u < 4; ++u)
                        if (jk[u] >= 0 && c < c_end) load8f(slots + static_cast<long long>(jk[u]) * H + 8 * c, v[u]);
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        if (jk[u] < 0 || c >= c_end) continue;
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc[i] += wk[u] * v[u][i];
                    }
                }
                if (c >= c_end) continue;
                finish_vector(t, c, acc);
            }
        }
    }
    if (!ok) return;
    // Parity slots: the next round was let in at this round's start (phase_notify); nothing to count.
    if (parity_slots(ep, a.mode)) return;
    // Last block: every slot has been read, so every sender may send the next round now: it finds the flag long
    // there when its combine starts, instead of waiting an NVLink round trip for the next launch's notify (2 us of
    // a 2-GPU decode combine). (This round's arrival counts and item counter are re-armed by the next round's
    // notify, one round ahead of their next use.)
    if (!last_block_done(ctr + C_DONE_CRECV, s_flag)) return;
    if (threadIdx.x == 0) {
        ctr[C_DONE_CRECV] = 0;
        ctr[C_CREADY] = round + 2;
    }
    publish_ready(ep, round + 2, false);
}

}  // namespace cuep
