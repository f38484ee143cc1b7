// Combine, phase 2 (send): wait until every destination lets this round in, then, by mode: kPartial, one
// float32-accumulated partial sum per (message, destination) over this rank's experts of the token, put with the
// bulk-copy engine (or polled words for a round's first tokens), or with direct_out (slots.cuh) finished into
// out[t] here; kWeighted / kUnreduced, each dispatched row back unchanged into slot k of its token. Every piece of
// data put is followed by its arrival count (signal_add), except polled words, which the receiver watches itself.
#pragma once
#include "readiness.cuh"

namespace cuep {

// The bf16 partial sums of phase_send through the cp.async ring: a warp's work is a sequence of pieces
// (item = (message, chunk); for each 64-vector slice of the chunk, the message's rows 4 at a time); the issue
// cursor runs kCombineRing - 1 pieces ahead of the compute cursor. Each lane copies and reads back only its own
// two vectors of each row (no warp sync). Slices go out with bulk puts (put_bulk), as in the register path.
// `wait_ready()` (all threads of the block, false on failure) is called once the first pieces' loads are in flight:
// the reads of the expert rows need no readiness, only the stores do (waiting first put an L2 round trip, 1 us, in
// front of the loads).
template <typename TC, class WaitReady>
__device__ bool send_partials_ring(const EPParams& ep, const CombineArgs& a, int round, const SourceInterleave& order,
                                   int kChunkVecs, int warp0, int warp_stride, TC* stage, WaitReady wait_ready) {
    const int slots0 = slot_base(ep, a.mode, round);
    const int K = static_cast<int>(ep.top_k), H = static_cast<int>(ep.hidden);
    const int rank = static_cast<int>(ep.rank);
    const long long T_max = ep.max_tokens;
    const int n_vec = H / 8, lane = threadIdx.x % kWarp;
    const bool direct = direct_out(ep, a);  // out[t] here, no partial sum put (slots.cuh)
    const int sh_lo = ep.shared ? shared_lo(ep, a.num_tokens) : 0, sh_hi = ep.shared ? shared_hi(ep, a.num_tokens) : 0;
    const int total = order.n_items;
    const TC* eo = static_cast<const TC*>(a.expert_out);
    extern __shared__ uint4 dyn_smem[];
    uint4* const ring = dyn_smem + (threadIdx.x / kWarp) * (kCombineRing * kCombinePieceBytes / 16);

    struct Cursor {
        int item;
        long long mi;
        int t, j;      // the message's token at its source, and this rank's partial slot for it
        int src;       // source rank of the message
        int row;       // lane < K: the message's row k = lane (-1: none)
        float w;
        unsigned mask;  // lanes with a row
        unsigned left;  // rows of the current slice not yet in a piece
        int c_begin, c0, c_end;  // current slice [c0, c0 + 64) of the chunk [c_begin, c_end) (vectors)
    };
    // Moves c to its first item at or after c.item that holds a message (c.item >= total: none left).
    auto load_item = [&](Cursor& c) {
        int s = 0, i = 0, ch = 0;
        while (c.item < total && !order.at(c.item, s, i, ch)) c.item += warp_stride;
        if (c.item >= total) return;
        c.src = s;
        c.mi = s * T_max + i;
        c.t = a.msg_token[c.mi];  // independent of the rows: in flight with them
        c.j = a.msg_j[c.mi];
        c.row = lane < K ? a.msg_rows[c.mi * K + lane] : -1;
        const float w = lane < K ? msg_weights(ep, a.msg_rows)[c.mi * K + lane] : 0.f;  // in flight with the row
        c.w = c.row >= 0 ? w : 0.f;
        c.mask = c.left = __ballot_sync(0xffffffffu, c.row >= 0);
        c.c_begin = c.c0 = ch * kChunkVecs;
        c.c_end = min(n_vec, (ch + 1) * kChunkVecs);
    };
    auto piece_rows = [&](const Cursor& c, int (&rk)[4], float (&wk)[4]) {
        unsigned mk = c.left;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const bool has = mk != 0;
            const int k = has ? __ffs(mk) - 1 : 0;
            mk &= mk - 1;
            rk[u] = __shfl_sync(0xffffffffu, c.row, k);
            wk[u] = __shfl_sync(0xffffffffu, c.w, k);
            if (!has) rk[u] = -1;
        }
    };
    auto advance = [&](Cursor& c) {
#pragma unroll
        for (int u = 0; u < 4; ++u) c.left &= c.left - 1;
        if (c.left != 0) return;
        c.c0 += 2 * kWarp;
        if (c.c0 < c.c_end) {
            c.left = c.mask;
        } else {
            c.item += warp_stride;
            if (c.item < total) load_item(c);
        }
    };

    Arrivals arrivals;  // lane 0's
    Cursor at{};
    at.item = warp0;
    if (at.item < total) load_item(at);
    Cursor ahead = at;
    int istage = 0, cstage = 0;
    auto issue = [&]() {
        if (ahead.item >= total) return;
        int rk[4];
        float wk[4];
        piece_rows(ahead, rk, wk);
        uint4* slot = ring + istage * (kCombinePieceBytes / 16);
        const int ca = ahead.c0 + lane, cb = ca + kWarp;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (rk[u] < 0) continue;
            const TC* src = eo + static_cast<long long>(rk[u]) * H;
            if (ca < ahead.c_end) cp_async16(slot + (2 * u) * kWarp + lane, src + 8 * ca);
            if (cb < ahead.c_end) cp_async16(slot + (2 * u + 1) * kWarp + lane, src + 8 * cb);
        }
        if (++istage == kCombineRing) istage = 0;
        advance(ahead);
    };
#pragma unroll
    for (int j = 0; j < kCombineRing - 1; ++j) {
        issue();
        cp_async_commit();
    }
    if (!wait_ready()) {
        cp_async_wait<0>();
        return false;
    }
    float acc_a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, acc_b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    bool first_piece = true;
    while (at.item < total) {
        issue();
        cp_async_commit();
        cp_async_wait<kCombineRing - 1>();  // this lane's copies of the piece `at` have landed
        first_piece = false;
        int rk[4];
        float wk[4];
        piece_rows(at, rk, wk);
        const uint4* slot = ring + cstage * (kCombinePieceBytes / 16);
        if (++cstage == kCombineRing) cstage = 0;
        const int ca = at.c0 + lane, cb = ca + kWarp;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (rk[u] < 0) continue;
            float v[8];
            if (ca < at.c_end) {
                bf16x8_values(slot[(2 * u) * kWarp + lane], v);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc_a[i] += wk[u] * v[i];
            }
            if (cb < at.c_end) {
                bf16x8_values(slot[(2 * u + 1) * kWarp + lane], v);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc_b[i] += wk[u] * v[i];
            }
        }
        if (__popc(at.left) <= 4) {  // the slice's last piece: send its partial sums
            const int t = at.t, j = at.j + slots0;
            const int r = ep.skip_a2a ? rank : at.src;
            if (direct) {  // this rank's own token and its only partial sum: finished here, no put, no count
                if (ca < at.c_end) finish_out_vector<TC>(ep, a, sh_lo, sh_hi, t, ca, acc_a);
                if (cb < at.c_end) finish_out_vector<TC>(ep, a, sh_lo, sh_hi, t, cb, acc_b);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc_a[i] = acc_b[i] = 0.f;
                advance(at);
                continue;
            }
            if (poll_token<TC>(ep, a, t)) {  // straight from registers, no count (the receiver polls the data)
                uint16_t* pd = poll_slot(ep, r, round, t, at.j);
                if (ca < at.c_end) store8_polled(r, pd + 8 * ca, acc_a);
                if (cb < at.c_end) store8_polled(r, pd + 8 * cb, acc_b);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc_a[i] = acc_b[i] = 0.f;
                advance(at);
                continue;
            }
            TC* dst = reinterpret_cast<TC*>(remote(ep, r, ep.off_comb_recv)) + (static_cast<long long>(t) * K + j) * H;
            if (lane == 0) put_bulk_wait_read();  // the previous slice has left the buffer
            __syncwarp();
            if (ca < at.c_end) store8f(stage + 8 * lane, acc_a);
            if (cb < at.c_end) store8f(stage + 8 * (lane + kWarp), acc_b);
            fence_shared_for_bulk();
            __syncwarp();
            if (lane == 0) {
                put_bulk(r, dst + 8 * at.c0, stage, (min(at.c_end, at.c0 + 2 * kWarp) - at.c0) * 8 * int(sizeof(TC)));
                if (at.c0 + 2 * kWarp >= at.c_end)
                    arrivals.queue(ep, r, arrived_counter(ep, r, round, t), at.c_end - at.c_begin);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) acc_a[i] = acc_b[i] = 0.f;
        }
        advance(at);
    }
    cp_async_wait<0>();
    if (lane == 0) arrivals.flush(ep);
    return true;
}

// The send phase of one of the first `send_blocks` blocks. Returns false if the wait for the destinations failed.
// `early_count`: msg_count as loaded at kernel entry (combine_kernel), or nullptr.
template <typename TC>
__device__ bool send_items(const EPParams& ep, const CombineArgs& a, int round, int send_blocks, const int* early_count) {
    const int K = static_cast<int>(ep.top_k), H = static_cast<int>(ep.hidden);
    const int rank = static_cast<int>(ep.rank), n_src = static_cast<int>(ep.n_src);
    const long long T_max = ep.max_tokens;
    __shared__ int s_ok;
    const int n_dest = n_dest_ranks(ep);
    // every destination lets round `round` in (phase_notify): "any" readiness, or parity-slot readiness
    const uint64_t* ready = reinterpret_cast<const uint64_t*>(ep.local(ep.off_comb_ready)) + dest_rank(ep, 0);
    const long long par_off = parity_slots(ep, a.mode) ? ep.n_ranks : 0;
    const uint64_t want = static_cast<uint64_t>(round) + 1;
    auto wait_ready = [&]() {
        if (threadIdx.x == 0) s_ok = 1;
        __syncthreads();
        if (threadIdx.x < n_dest) {
            SpinClock clock;
            while (poll_u64(ready + threadIdx.x) < want &&
                   poll_u64(ready + par_off + threadIdx.x) < want) {
                if (clock.stop(ep, K_COMBINE_SEND, dest_rank(ep, threadIdx.x))) {
                    s_ok = 0;
                    break;
                }
                __nanosleep(64);
            }
        }
        __syncthreads();
        return s_ok != 0;
    };
    // the bf16 partial sums through the load ring wait for the destinations only once their loads are in flight
    bool ring = false;
    if constexpr (sizeof(TC) == 2 && kCombineRing > 1)
        ring = a.mode == kPartial && dynamic_smem_bytes() >= unsigned(kCombineRingBytes);
    if (!ring && !wait_ready()) return false;

    const TC* eo = static_cast<const TC*>(a.expert_out);
    const int n_vec = H / 8;
    const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    const int warp0 = (threadIdx.x / kWarp) * send_blocks + blockIdx.x, warp_stride = send_blocks * n_warps;
    if (a.mode == kPartial) {
        const bool direct = direct_out(ep, a);  // out[t] here, no partial sum put (slots.cuh)
        const int sh_lo = ep.shared ? shared_lo(ep, a.num_tokens) : 0;
        const int sh_hi = ep.shared ? shared_hi(ep, a.num_tokens) : 0;
        __shared__ int s_count[kMaxRanks], s_total, s_most;
        if (threadIdx.x == 0) {
            s_total = s_most = 0;
            for (int s = 0; s < n_src; ++s) {
                s_count[s] = early_count ? early_count[s] : a.msg_count[s];
                s_total += s_count[s];
                s_most = max(s_most, s_count[s]);
            }
        }
        __syncthreads();
        // One warp per received message: the float32 sum of its rows here, weighted, sent back as one partial.
        __shared__ alignas(128) TC s_stage[kCombineThreads / kWarp][2 * kWarp * 8];
        TC* const stage = s_stage[threadIdx.x / kWarp];
        const int kChunkVecs = static_cast<int>(chunk_units(s_total, n_vec, kWarp));
        const int n_chunks = (n_vec + kChunkVecs - 1) / kChunkVecs;
        // Items interleaved over the sources, so every GPU writes to every destination at once (in source order
        // every GPU wrote to rank 0 first: the 4-GPU send half ran at 190 GB/s, 494 us -> 856 us).
        const SourceInterleave order{s_count, n_src, n_chunks, (rank + 1) % n_src, n_src * s_most * n_chunks};
        bool done = false;
        if constexpr (sizeof(TC) == 2 && kCombineRing > 1) {
            if (ring) {
                if (!send_partials_ring(ep, a, round, order, kChunkVecs, warp0, warp_stride, stage, wait_ready))
                    return false;
                done = true;
            }
        }
        Arrivals arrivals;  // lane 0's
        for (int item = warp0; !done && item < order.n_items; item += warp_stride) {
            int s, i, ch;
            if (!order.at(item, s, i, ch)) continue;
            const long long mi = s * T_max + i;
            const int row = lane < K ? a.msg_rows[mi * K + lane] : -1;
            const float wk_all = lane < K ? msg_weights(ep, a.msg_rows)[mi * K + lane] : 0.f;
            const float w = row >= 0 ? wk_all : 0.f;
            const unsigned rows_mask = __ballot_sync(0xffffffffu, row >= 0);
            const int t = a.msg_token[mi], j = a.msg_j[mi] + slot_base(ep, a.mode, round);
            const int r = ep.skip_a2a ? rank : s;
            TC* dst = reinterpret_cast<TC*>(remote(ep, r, ep.off_comb_recv)) + (static_cast<long long>(t) * K + j) * H;
            const int c_end = min(n_vec, (ch + 1) * kChunkVecs);
            // Two vectors per lane and up to kRegRows rows per step: 8 independent 16-byte loads in flight per lane
            // (the combine was latency-bound per SM: on 2 x H200 its time scaled with 1 / SMs). float32 rows are
            // twice the bytes: 2 rows a step keep the same bytes in flight and the kernel within 128 registers.
            constexpr int kRegRows = sizeof(TC) == 2 ? 4 : 2;
            for (int c0 = ch * kChunkVecs; c0 < c_end; c0 += 2 * kWarp) {
                const int ca = c0 + lane, cb = ca + kWarp;
                float acc_a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, acc_b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                unsigned mk = rows_mask;
                while (mk) {
                    int rk[kRegRows];
                    float wk[kRegRows];
#pragma unroll
                    for (int u = 0; u < kRegRows; ++u) {
                        const bool has = mk != 0;
                        const int k = has ? __ffs(mk) - 1 : 0;
                        mk &= mk - 1;
                        rk[u] = __shfl_sync(0xffffffffu, row, k);
                        wk[u] = __shfl_sync(0xffffffffu, w, k);
                        if (!has) rk[u] = -1;
                    }
                    // the rows' raw vectors in flight together (registers: 2 x kRegRows x 16 bytes per lane, and
                    // for float32 twice that), then each converted as it is summed
                    Raw8<TC> va[kRegRows], vb[kRegRows];
#pragma unroll
                    for (int u = 0; u < kRegRows; ++u) {
                        if (rk[u] >= 0 && ca < c_end) va[u] = load8(eo + static_cast<long long>(rk[u]) * H + 8 * ca);
                        if (rk[u] >= 0 && cb < c_end) vb[u] = load8(eo + static_cast<long long>(rk[u]) * H + 8 * cb);
                    }
#pragma unroll
                    for (int u = 0; u < kRegRows; ++u) {
                        if (rk[u] < 0) continue;
                        float v[8];
                        values8(va[u], v);
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc_a[i] += wk[u] * v[i];
                        values8(vb[u], v);
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc_b[i] += wk[u] * v[i];
                    }
                }
                if (direct) {  // this rank's own token and its only partial sum: finished here, no put, no count
                    if (ca < c_end) finish_out_vector<TC>(ep, a, sh_lo, sh_hi, t, ca, acc_a);
                    if (cb < c_end) finish_out_vector<TC>(ep, a, sh_lo, sh_hi, t, cb, acc_b);
                    continue;
                }
                if (poll_token<TC>(ep, a, t)) {  // straight from registers, no count (the receiver polls the data)
                    uint16_t* pd = poll_slot(ep, r, round, t, a.msg_j[mi]);
                    if (ca < c_end) store8_polled(r, pd + 8 * ca, acc_a);
                    if (cb < c_end) store8_polled(r, pd + 8 * cb, acc_b);
                    continue;
                }
                // The slice [c0, min(c_end, c0 + 64)) vectors is contiguous in dst: stage it, one bulk store.
                if (lane == 0) put_bulk_wait_read();  // the previous slice has left the buffer
                __syncwarp();
                if (ca < c_end) store8f(stage + 8 * lane, acc_a);
                if (cb < c_end) store8f(stage + 8 * (lane + kWarp), acc_b);
                fence_shared_for_bulk();
                __syncwarp();
                if (lane == 0) {
                    put_bulk(r, dst + 8 * c0, stage, (min(c_end, c0 + 2 * kWarp) - c0) * 8 * int(sizeof(TC)));
                    if (c0 + 2 * kWarp >= c_end)
                        arrivals.queue(ep, r, arrived_counter(ep, r, round, t), c_end - ch * kChunkVecs);
                }
            }
        }
        if (lane == 0) arrivals.flush(ep);
    } else {
        // One warp per dispatched row: the row goes back unchanged into slot k of its token.
        const int n_rows = static_cast<int>(a.row_offsets[ep.n_groups]);
        const int kChunkVecs = static_cast<int>(chunk_units(n_rows, n_vec, kWarp));
        const int n_chunks = (n_vec + kChunkVecs - 1) / kChunkVecs;
        for (int item = warp0; item < n_rows * n_chunks; item += warp_stride) {
            const int row = item / n_chunks, ch = item % n_chunks;
            const int src = a.row_src[row], k = a.src_info[2LL * row + 1];
            if (src < 0 || k >= K) continue;  // padding, or the shared expert (stays local)
            const int t = a.src_info[2LL * row];
            const long long first = static_cast<long long>(ch) * kChunkVecs * 8;
            const long long n = min(static_cast<long long>(kChunkVecs) * 8, static_cast<long long>(H) - first);
            TC* dst = reinterpret_cast<TC*>(remote(ep, src, ep.off_comb_recv)) + (static_cast<long long>(t) * K + k) * H;
            put_copy(src, dst + first, eo + static_cast<long long>(row) * H + first, n * sizeof(TC), lane);
            __syncwarp();  // every lane's puts before lane 0's count
            if (lane == 0) signal_add(ep, src, arrived_counter(ep, src, round, t), static_cast<int>(n / 8));
        }
    }
    return true;
}

// send: the first `send_blocks` blocks move the data (in a fused launch the others go straight to receiving).
// No end-of-phase count: the block that entered the kernel last advances the round (combine_kernel).
template <typename TC>
__device__ void phase_send(const EPParams& ep, const CombineArgs& a, int round, int send_blocks, const int* early_count) {
    if (static_cast<int>(blockIdx.x) < send_blocks && !send_items<TC>(ep, a, round, send_blocks, early_count)) return;
}

}  // namespace cuep
