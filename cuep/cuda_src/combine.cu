// cuep combine: expert outputs go back to the ranks their tokens came from and are summed with the router weights.
//
// One kernel, three phases (bits of `phases`, as in dispatch.cu):
//   notify  re-arm the other round parity's arrival counts, and tell every rank which rounds it may now send
//           here (see "readiness" below: partial sums in parity slots may come one round ahead)
//   send    wait until every destination is ready, then, by mode:
//             kPartial    (weights rode along at dispatch) one float32-accumulated partial sum per (token,
//                         destination rank) over this rank's experts, into slot j of the source's comb_recv[t]
//                         (plus ranks x (round & 1) in parity slots), j = this rank's position among the token's
//                         destination ranks
//             kWeighted / kUnreduced  one row per (token, k) into slot k
//           every piece of data, once its stores are complete, adds its 16-byte vector count to the destination's
//           comb_arrived[round & 1][t]; except that the bf16 partial sums of tokens t < P_POLL_TOKENS in parity
//           slots go to comb_poll with no count (the receiver polls the data: "polled partial sums" below)
//   recv    tokens in order, each as soon as its comb_arrived count says all its slots have landed (polled tokens:
//           each vector as it lands; so in a fused launch the sums overlap the incoming stream): out[t] = the sum
//           of the slots (weighted by topk_weights in kWeighted), plus the shared expert's row and the residual;
//           or the unreduced [N, K(+1), H]. Outside parity slots the last block then lets the next round in.
#include "ep.cuh"
#include "formats.cuh"

using namespace cuep;

constexpr int kCombineThreads = 512;
// bf16 partial sums read the expert rows through a per-warp cp.async ring of kCombineRing stages (a stage: 4 rows x
// 64 vectors = 4 KiB), so each warp keeps the rows of its next pieces in flight while it sums the current one;
// cuep/ep.py gives the launch kCombineRing x 4 KiB x 16 warps of dynamic shared memory (_COMBINE_RING; 0: the
// register loads). Without that much shared memory the kernel uses the register loads.
#ifndef CUEP_COMBINE_RING
#define CUEP_COMBINE_RING 2
#endif
constexpr int kCombineRing = CUEP_COMBINE_RING;
constexpr int kCombinePieceBytes = 4 * 2 * 32 * 16;
constexpr int kCombineRingBytes = kCombineRing * kCombinePieceBytes * (kCombineThreads / 32);
// Work items are (message or token, chunk of the row); chunk_units() sizes the chunks so that even a small decode
// batch spreads over every SM while a large one keeps whole rows per warp.
enum CombineMode : int { kPartial = 0, kWeighted = 1, kUnreduced = 2 };

namespace {

// Bulk (TMA) stores of a warp's partial sums: the warp writes a slice into its shared-memory buffer and one lane
// hands it to the copy engine, so a warp never waits for the NVLink write before it loads the next rows (with
// plain stores the loads and the NVLink writes of the send half did not overlap: 333 us send half on 2 x H200
// against 205 us without the loads and 248 us without the remote writes).
__device__ __forceinline__ void bulk_store(void* gdst, const void* ssrc, int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gdst),
                 "r"(static_cast<unsigned>(__cvta_generic_to_shared(ssrc))), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Generic shared-memory writes before the copy engine reads them.
__device__ __forceinline__ void fence_shared_for_bulk() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Per-token arrival counts of a warp's bulk-stored partial sums. Lane 0 issues every bulk store of its warp and
// holds this: an item's vector count is added to the receiver's comb_arrived[t] once its stores are complete. It is
// queued when the item's last slice has been issued and posted when the next item's last slice has (wait_group 1:
// every group but the newest is complete), so the warp rarely waits for NVLink.
// The release before the add is at GPU scope for this rank's own tokens (release_add_count).
struct Arrivals {
    int* ptr = nullptr;
    int vectors = 0;
    bool local = false;    // the receiver is this GPU
    bool relaxed = false;  // measurement knob kKnobCombineRelaxedCount (no ordering guarantee)
    bool sys_local = false;  // measurement knob kKnobCombineSysLocal: system scope for local counts too
    __device__ __forceinline__ void post() {
        asm volatile("fence.proxy.async.global;" ::: "memory");  // the copy engine's writes before the count
        if (relaxed) red_add_relaxed_sys(ptr, vectors);
        else release_add_count(ptr, vectors, local && !sys_local);
    }
    __device__ __forceinline__ void queue(int* p, int n, bool is_local) {
        if (ptr) {
            asm volatile("cp.async.bulk.wait_group 1;" ::: "memory");
            post();
        }
        ptr = p;
        vectors = n;
        local = is_local;
    }
    __device__ __forceinline__ void flush() {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        if (ptr) post();
        ptr = nullptr;
    }
};

// Token t's arrival count at rank r for round `round`: comb_arrived is [2 parities, T] counters (notify re-arms the
// other parity one round ahead, so no receive half ends with a re-arm), one per 128-byte line: packed, the 128
// counts of a decode round sat in 4 lines that every receive warp polled and every sender added to.
// cuep/config.py sizes the region for the largest stride (CUEP_ARRIVED_STRIDE=1 packs them, for measurements).
#ifndef CUEP_ARRIVED_STRIDE
#define CUEP_ARRIVED_STRIDE 32
#endif
constexpr int kArrivedStride = CUEP_ARRIVED_STRIDE;  // int32 counters per token and parity (<= 32)
static_assert(kArrivedStride >= 1 && kArrivedStride <= 32, "comb_arrived holds 32 ints per token and parity");
__device__ __forceinline__ int* arrived_base(const EP& ep, int r, int round) {
    return reinterpret_cast<int*>(ep.peer(r, ep[P_OFF_COMB_ARRIVED])) + (round & 1) * ep[P_MAX_TOKENS] * kArrivedStride;
}
__device__ __forceinline__ int* arrived_counter(const EP& ep, int r, int round, int t) {
    return arrived_base(ep, r, round) + static_cast<long long>(t) * kArrivedStride;
}

struct CombineArgs {
    const void* expert_out;     // [capacity, H] combine dtype: row i is the expert output of dispatched row i
    const int* src_info;        // [capacity, 2]
    const int* row_src;         // [capacity]
    const float* row_weight;    // [capacity]
    const int* msg_rows;        // [n_src, T, K] rows, then their weights (msg_weights)
    const int* msg_token;       // [n_src, T]
    const int* msg_j;           // [n_src, T]
    const int* msg_count;       // [n_src]
    const unsigned* row_offsets;  // [G + 1]
    const int* topk_ids;        // [N, K] of this rank's tokens (as passed to dispatch)
    const float* topk_weights;  // [N, K] (kWeighted) or nullptr
    const void* residual;       // [N, H] or nullptr
    void* out;                  // [N, H] or [N, K (+1), H]
    int num_tokens;
    int mode;
    int phases;                 // the launch's phase and knob bits
};

// 8 consecutive values of a combine-dtype row as float, and back.
template <typename TC>
__device__ __forceinline__ void load8f(const TC* p, float (&v)[8]) {
    if constexpr (sizeof(TC) == 2) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        bf16x8_values<false>(w, v);
    } else {
        const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
        f32x8_values<false>(a, b, v);
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
__device__ __forceinline__ bool parity_slots(const EP& ep, int mode) {
    return mode == kPartial && 2 * n_dest_ranks(ep) <= ep[P_TOP_K];
}
__device__ __forceinline__ int slot_base(const EP& ep, int mode, int round) {
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
__device__ __forceinline__ bool poll_token(const EP& ep, const CombineArgs& a, int t) {
    return sizeof(TC) == 2 && t < ep[P_POLL_TOKENS] && parity_slots(ep, a.mode) && !(a.phases & kKnobCombineNoPoll);
}
// Slot j (the sender's position among the token's destination ranks) of token t's polled partial sums at rank r.
__device__ __forceinline__ uint16_t* poll_slot(const EP& ep, int r, int round, int t, int j) {
    const long long row = ((round & 1) * ep[P_POLL_TOKENS] + t) * n_dest_ranks(ep) + j;
    return reinterpret_cast<uint16_t*>(ep.peer(r, ep[P_OFF_COMB_POLL])) + row * ep[P_HIDDEN];
}
constexpr unsigned long long kNotLanded = ~0ull;
__device__ __forceinline__ void store8_polled(uint16_t* p, const float (&v)[8]) {
    using u64 = unsigned long long;
    const u64 lo = bf16x2_encode(v[0], v[1]) | static_cast<u64>(bf16x2_encode(v[2], v[3])) << 32;
    const u64 hi = bf16x2_encode(v[4], v[5]) | static_cast<u64>(bf16x2_encode(v[6], v[7])) << 32;
    asm volatile("st.relaxed.sys.global.v2.b64 [%0], {%1, %2};" ::"l"(p), "l"(lo), "l"(hi) : "memory");
}
// This lane's vector of a polled slot once both its words have landed, as floats; then the vector is all ones again.
// False on timeout or once the rank has failed.
__device__ __forceinline__ bool take_polled(const EP& ep, uint16_t* p, float (&v)[8]) {
    unsigned long long lo, hi;
    SpinClock clock;
    while (true) {
        asm volatile("ld.relaxed.sys.global.v2.b64 {%0, %1}, [%2];" : "=l"(lo), "=l"(hi) : "l"(p) : "memory");
        if (lo != kNotLanded && hi != kNotLanded) break;
        if (clock.stop(ep, K_COMBINE_RECV, -1)) return false;
        __nanosleep(32);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(~0u, ~0u, ~0u, ~0u);
    bf16x8_values<false>(make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                                    static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32)), v);
    return true;
}

// Tell every rank that sends to this one that it may send rounds < `value` ("any", or parity-slot readiness).
// Threads 0..senders-1 of one block; a release, cumulative over the block barrier before it.
__device__ __forceinline__ void publish_ready(const EP& ep, int value, bool parity) {
    if (threadIdx.x < n_dest_ranks(ep)) {
        const int r = dest_rank(ep, threadIdx.x);
        uint64_t* flag = reinterpret_cast<uint64_t*>(ep.peer(r, ep[P_OFF_COMB_READY])) + (parity ? ep[P_N_RANKS] : 0) +
                         ep[P_RANK];
        store_release_u64(flag, static_cast<uint64_t>(value));
    }
}

// notify (block 0), receiver side of round q: re-arm the other parity's arrival counts and item counter (their
// last round, q - 1, is over: this launch comes after its receive half), then publish readiness: "any" for round q
// unless the end of round q - 1 did, and in parity slots for round q + 1 (its slots are not round q's): that one is
// not urgent, so in a launch that also sends, block 0 publishes it after its sends (publish_parity_ready; here it
// delayed block 0's first item by 2 us).
__device__ __forceinline__ void publish_parity_ready(const EP& ep, int round, int mode) {
    if (!parity_slots(ep, mode)) return;
    __syncthreads();  // every re-arming store of phase_notify before the flags (release, cumulative)
    publish_ready(ep, round + 2, true);
}
__device__ void phase_notify(const EP& ep, int round, int mode, bool defer_parity, int num_tokens) {
    if (blockIdx.x != 0) return;
    int* ctr = ep.counters();
    // Only the tokens of the other parity's last round (q - 1) can have nonzero counts: a decode round in a buffer
    // sized for prefill re-arms its N lines, not T (C_ARRIVED_N: this round's N, for the re-arm at round q + 1).
    const int n_arm = ctr[C_ARRIVED_N + ((round + 1) & 1)];
    int* arrived = arrived_base(ep, static_cast<int>(ep[P_RANK]), round + 1);
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

// The bf16 partial sums of phase_send through the cp.async ring: a warp's work is a sequence of pieces
// (item = (message, chunk); for each 64-vector slice of the chunk, the message's rows 4 at a time); the issue
// cursor runs kCombineRing - 1 pieces ahead of the compute cursor. Each lane copies and reads back only its own
// two vectors of each row (no warp sync). Slices go out with bulk stores (bulk_store), as in the register path.
// `wait_ready()` (all threads of the block, false on failure) is called once the first pieces' loads are in flight:
// the reads of the expert rows need no readiness, only the stores do (waiting first put an L2 round trip, 1 us, in
// front of the loads).
template <typename TC, class WaitReady>
__device__ bool send_partials_ring(const EP& ep, const CombineArgs& a, int round, const SourceInterleave& order,
                                   int kChunkVecs, int warp0, int warp_stride, TC* stage, WaitReady wait_ready) {
    const int slots0 = slot_base(ep, a.mode, round);
    const int K = static_cast<int>(ep[P_TOP_K]), H = static_cast<int>(ep[P_HIDDEN]);
    const int rank = static_cast<int>(ep[P_RANK]);
    const long long T_max = ep[P_MAX_TOKENS];
    const int n_vec = H / 8, lane = threadIdx.x % kWarp;
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
    arrivals.relaxed = (a.phases & kKnobCombineRelaxedCount) != 0;
    arrivals.sys_local = (a.phases & kKnobCombineSysLocal) != 0;
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
#ifdef CUEP_AB_COMBINE_NO_LOADS  // measurement knob only (wrong results): the partial sums without their loads
            continue;
#endif
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
    CUEP_TRACE_LATEST(ep, lane == 0 && warp0 < total, 30);
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
        CUEP_TRACE_LATEST(ep, lane == 0 && first_piece, 31);
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
                bf16x8_values<false>(slot[(2 * u) * kWarp + lane], v);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc_a[i] += wk[u] * v[i];
            }
            if (cb < at.c_end) {
                bf16x8_values<false>(slot[(2 * u + 1) * kWarp + lane], v);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc_b[i] += wk[u] * v[i];
            }
        }
        if (__popc(at.left) <= 4) {  // the slice's last piece: send its partial sums
            const int t = at.t, j = at.j + slots0;
#ifdef CUEP_AB_COMBINE_LOCAL  // measurement knob only (wrong results): every partial to this rank's own buffer
            const int r = rank;
#else
            const int r = ep[P_SKIP_A2A] ? rank : at.src;
#endif
            if (poll_token<TC>(ep, a, t)) {  // straight from registers, no count (the receiver polls the data)
                uint16_t* pd = poll_slot(ep, r, round, t, at.j);
                if (ca < at.c_end) store8_polled(pd + 8 * ca, acc_a);
                if (cb < at.c_end) store8_polled(pd + 8 * cb, acc_b);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc_a[i] = acc_b[i] = 0.f;
                advance(at);
                continue;
            }
            TC* dst = reinterpret_cast<TC*>(ep.peer(r, ep[P_OFF_COMB_RECV])) + (static_cast<long long>(t) * K + j) * H;
            if (lane == 0) bulk_wait_read();  // the previous slice has left the buffer
            __syncwarp();
            if (ca < at.c_end) store8f(stage + 8 * lane, acc_a);
            if (cb < at.c_end) store8f(stage + 8 * (lane + kWarp), acc_b);
            fence_shared_for_bulk();
            __syncwarp();
            if (lane == 0) {
                bulk_store(dst + 8 * at.c0, stage, (min(at.c_end, at.c0 + 2 * kWarp) - at.c0) * 8 * int(sizeof(TC)));
                if (at.c0 + 2 * kWarp >= at.c_end)
                    arrivals.queue(arrived_counter(ep, r, round, t), at.c_end - at.c_begin, r == rank);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) acc_a[i] = acc_b[i] = 0.f;
        }
        advance(at);
    }
    cp_async_wait<0>();
#ifdef CUEP_AB_TRACE  // the last slice issued (4), its stores complete (9), then the count behind its fences (11)
    CUEP_TRACE_LATEST(ep, lane == 0 && warp0 < total, 4);
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    CUEP_TRACE_LATEST(ep, lane == 0 && warp0 < total, 9);
#endif
    if (lane == 0) arrivals.flush();
    CUEP_TRACE_LATEST(ep, lane == 0 && warp0 < total, 11);
    return true;
}

// The send phase of one of the first `send_blocks` blocks. Returns false if the wait for the destinations failed.
// `early_count`: msg_count as loaded at kernel entry (combine_kernel), or nullptr.
template <typename TC>
__device__ bool send_items(const EP& ep, const CombineArgs& a, int round, int send_blocks, const int* early_count) {
    const int K = static_cast<int>(ep[P_TOP_K]), H = static_cast<int>(ep[P_HIDDEN]);
    const int rank = static_cast<int>(ep[P_RANK]), n_src = static_cast<int>(ep[P_N_SRC]);
    const long long T_max = ep[P_MAX_TOKENS];
    __shared__ int s_ok;
    const int n_dest = n_dest_ranks(ep);
    // every destination lets round `round` in (phase_notify): "any" readiness, or parity-slot readiness
    const uint64_t* ready = reinterpret_cast<const uint64_t*>(ep.local(ep[P_OFF_COMB_READY])) + dest_rank(ep, 0);
    const long long par_off = parity_slots(ep, a.mode) ? ep[P_N_RANKS] : 0;
    const uint64_t want = static_cast<uint64_t>(round) + 1;
    auto wait_ready = [&]() {
        if (threadIdx.x == 0) s_ok = 1;
        __syncthreads();
        if (threadIdx.x < n_dest) {
            SpinClock clock;
            while (load_acquire_u64(ready + threadIdx.x) < want &&
                   load_acquire_u64(ready + par_off + threadIdx.x) < want) {
                if (clock.stop(ep, K_COMBINE_SEND, dest_rank(ep, threadIdx.x))) {
                    s_ok = 0;
                    break;
                }
                __nanosleep(64);
            }
        }
        __syncthreads();
        CUEP_TRACE(ep, blockIdx.x == 0, 13);
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
        arrivals.relaxed = (a.phases & kKnobCombineRelaxedCount) != 0;
        arrivals.sys_local = (a.phases & kKnobCombineSysLocal) != 0;
        for (int item = warp0; !done && item < order.n_items; item += warp_stride) {
            int s, i, ch;
            if (!order.at(item, s, i, ch)) continue;
            const long long mi = s * T_max + i;
            const int row = lane < K ? a.msg_rows[mi * K + lane] : -1;
            const float wk_all = lane < K ? msg_weights(ep, a.msg_rows)[mi * K + lane] : 0.f;
            const float w = row >= 0 ? wk_all : 0.f;
            const unsigned rows_mask = __ballot_sync(0xffffffffu, row >= 0);
            const int t = a.msg_token[mi], j = a.msg_j[mi] + slot_base(ep, a.mode, round);
#ifdef CUEP_AB_COMBINE_LOCAL  // measurement knob only (wrong results): every partial to this rank's own buffer
            const int r = rank;
#else
            const int r = ep[P_SKIP_A2A] ? rank : s;
#endif
            TC* dst = reinterpret_cast<TC*>(ep.peer(r, ep[P_OFF_COMB_RECV])) + (static_cast<long long>(t) * K + j) * H;
            const int c_end = min(n_vec, (ch + 1) * kChunkVecs);
            // Two vectors per lane and up to 4 rows per step: 8 independent 16-byte loads in flight per lane (the
            // combine was latency-bound per SM: on 2 x H200 its time scaled with 1 / SMs).
            for (int c0 = ch * kChunkVecs; c0 < c_end; c0 += 2 * kWarp) {
                const int ca = c0 + lane, cb = ca + kWarp;
                float acc_a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, acc_b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                unsigned mk = rows_mask;
                while (mk) {
                    int rk[4];
                    float wk[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const bool has = mk != 0;
                        const int k = has ? __ffs(mk) - 1 : 0;
                        mk &= mk - 1;
                        rk[u] = __shfl_sync(0xffffffffu, row, k);
                        wk[u] = __shfl_sync(0xffffffffu, w, k);
                        if (!has) rk[u] = -1;
                    }
                    float va[4][8], vb[4][8];
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
#ifdef CUEP_AB_COMBINE_NO_LOADS  // measurement knob only (wrong results): the partial sums without their loads
#pragma unroll
                        for (int i = 0; i < 8; ++i) va[u][i] = vb[u][i] = float(ca + i);
                        continue;
#endif
                        if (rk[u] >= 0 && ca < c_end) load8f(eo + static_cast<long long>(rk[u]) * H + 8 * ca, va[u]);
                        if (rk[u] >= 0 && cb < c_end) load8f(eo + static_cast<long long>(rk[u]) * H + 8 * cb, vb[u]);
                    }
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        if (rk[u] < 0) continue;
#pragma unroll
                        for (int i = 0; i < 8; ++i) {
                            acc_a[i] += wk[u] * va[u][i];
                            acc_b[i] += wk[u] * vb[u][i];
                        }
                    }
                }
                if (poll_token<TC>(ep, a, t)) {  // straight from registers, no count (the receiver polls the data)
                    uint16_t* pd = poll_slot(ep, r, round, t, a.msg_j[mi]);
                    if (ca < c_end) store8_polled(pd + 8 * ca, acc_a);
                    if (cb < c_end) store8_polled(pd + 8 * cb, acc_b);
                    continue;
                }
                // The slice [c0, min(c_end, c0 + 64)) vectors is contiguous in dst: stage it, one bulk store.
                if (lane == 0) bulk_wait_read();  // the previous slice has left the buffer
                __syncwarp();
                if (ca < c_end) store8f(stage + 8 * lane, acc_a);
                if (cb < c_end) store8f(stage + 8 * (lane + kWarp), acc_b);
                fence_shared_for_bulk();
                __syncwarp();
                if (lane == 0) {
                    bulk_store(dst + 8 * c0, stage, (min(c_end, c0 + 2 * kWarp) - c0) * 8 * int(sizeof(TC)));
                    if (c0 + 2 * kWarp >= c_end)
                        arrivals.queue(arrived_counter(ep, r, round, t), c_end - ch * kChunkVecs, r == rank);
                }
            }
        }
        if (lane == 0) arrivals.flush();
    } else {
        // One warp per dispatched row: the row goes back unchanged into slot k of its token.
        const int n_rows = static_cast<int>(a.row_offsets[ep[P_N_GROUPS]]);
        const int kChunkVecs = static_cast<int>(chunk_units(n_rows, n_vec, kWarp));
        const int n_chunks = (n_vec + kChunkVecs - 1) / kChunkVecs;
        for (int item = warp0; item < n_rows * n_chunks; item += warp_stride) {
            const int row = item / n_chunks, ch = item % n_chunks;
            const int src = a.row_src[row], k = a.src_info[2LL * row + 1];
            if (src < 0 || k >= K) continue;  // padding, or the shared expert (stays local)
            const int t = a.src_info[2LL * row];
            const long long first = static_cast<long long>(ch) * kChunkVecs * 8;
            const long long n = min(static_cast<long long>(kChunkVecs) * 8, static_cast<long long>(H) - first);
            TC* dst = reinterpret_cast<TC*>(ep.peer(src, ep[P_OFF_COMB_RECV])) + (static_cast<long long>(t) * K + k) * H;
            warp_copy16(dst + first, eo + static_cast<long long>(row) * H + first, n * sizeof(TC), lane);
            __syncwarp();  // every lane's stores before lane 0's fence and count
            if (lane == 0) {
                release_add_count(arrived_counter(ep, src, round, t), static_cast<int>(n / 8),
                                  src == static_cast<int>(ep[P_RANK]) && !(a.phases & kKnobCombineSysLocal));
            }
        }
    }
    return true;
}

// send: the first `send_blocks` blocks move the data (in a fused launch the others go straight to receiving).
// No end-of-phase count: the block that entered the kernel last advances the round (combine_kernel).
template <typename TC>
__device__ void phase_send(const EP& ep, const CombineArgs& a, int round, int send_blocks, const int* early_count) {
    if (static_cast<int>(blockIdx.x) < send_blocks && !send_items<TC>(ep, a, round, send_blocks, early_count)) return;
    CUEP_TRACE(ep, blockIdx.x == 0, 14);
    CUEP_TRACE_LATEST(ep, threadIdx.x == 0, 15);
}

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
__device__ void phase_recv(const EP& ep, const CombineArgs& a, int round, int* s_flag) {
    const int K = static_cast<int>(ep[P_TOP_K]), H = static_cast<int>(ep[P_HIDDEN]);
    const int L = static_cast<int>(ep[P_N_LOCAL]);
    const bool shared = ep[P_SHARED] != 0;
    int* ctr = ep.counters();
    int* arrived = arrived_base(ep, static_cast<int>(ep[P_RANK]), round);
    const int slots0 = slot_base(ep, a.mode, round);
    const TC* recv = reinterpret_cast<const TC*>(ep.local(ep[P_OFF_COMB_RECV]));
    const TC* eo = static_cast<const TC*>(a.expert_out);
    const TC* res = static_cast<const TC*>(a.residual);
    TC* out = static_cast<TC*>(a.out);
    const int n_vec = H / 8, E = static_cast<int>(ep[P_N_EXPERTS]);
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
    auto finish_vector = [&](int t, int c, float (&acc)[8]) {
        if (shared) {
            float v[8];
            load8f(eo + static_cast<long long>(t) * H + 8 * c, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] += v[i];
        }
        if (res) {
            float v[8];
            load8f(res + static_cast<long long>(t) * H + 8 * c, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] += v[i];
        }
        store8f(out + static_cast<long long>(t) * H + 8 * c, acc);
    };
    (void)n_warps;
    bool ok = true;
    for (int item = claim(-2); item >= 0 && item < a.num_tokens * n_chunks; item = claim(item)) {
        const int t = item / n_chunks, ch = item % n_chunks;
        const int c_begin = ch * kChunkVecs, c_end = min(n_vec, c_begin + kChunkVecs);
        const int e = lane < K ? a.topk_ids[static_cast<long long>(t) * K + lane] : -1;
        const bool repeat = warp_repeats_earlier(e, lane, K);
        const bool valid = lane < K && e >= 0 && e < E && (!ep[P_SKIP_A2A] || e / L == ep[P_RANK]) && !repeat;
        const unsigned valid_mask = __ballot_sync(0xffffffffu, valid);
        const bool first_of_rank = warp_first_of_rank(e / L, valid_mask, lane, K);
        // partial sums: one per destination rank of the token (with skip_a2a, one if any choice was local)
        const int n_partials = __popc(__ballot_sync(0xffffffffu, first_of_rank));
        const float w = (a.mode == kWeighted && valid) ? a.topk_weights[static_cast<long long>(t) * K + lane] : 0.f;
        // Wait until every slot of the token has landed: each is n_vec vectors (partials: one slot per
        // destination rank; rows: one per valid choice).
        const int n_slots = a.mode == kPartial ? n_partials : __popc(valid_mask);
        const bool polled = poll_token<TC>(ep, a, t);
        if (!polled && !warp_wait_tag(arrived + static_cast<long long>(t) * kArrivedStride, n_slots * n_vec, ep,
                                      K_COMBINE_RECV, -1, lane)) {
            ok = false;
            break;
        }
        CUEP_TRACE_LATEST(ep, lane == 0 && !polled, 6);
        const TC* slots = recv + (static_cast<long long>(t) * K + slots0) * H;
        if (polled) {
            // each 16-byte vector of the token's partial sums as soon as it has landed (in slot order, as below)
            uint16_t* base = poll_slot(ep, static_cast<int>(ep[P_RANK]), round, t, 0);
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
            CUEP_TRACE_LATEST(ep, lane == 0, 6);
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
                    load8f(eo + static_cast<long long>(t) * H + 8 * c, v);  // shared expert: group 0, row t
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
    CUEP_TRACE(ep, blockIdx.x == gridDim.x - 1, 16);
    CUEP_TRACE_LATEST(ep, threadIdx.x == 0, 20);
    // Parity slots: the next round was let in at this round's start (phase_notify); nothing to count.
    if (parity_slots(ep, a.mode)) return;
    // Last block: every slot has been read, so every sender may send the next round now: it finds the flag long
    // there when its combine starts, instead of waiting an NVLink round trip for the next launch's notify (2 us of
    // a 2-GPU decode combine). (This round's arrival counts and item counter are re-armed by the next round's
    // notify, one round ahead of their next use.)
    if (!last_block_done(ctr + C_DONE_CRECV, s_flag, /*peer_writes=*/false)) return;
    if (threadIdx.x == 0) {
        ctr[C_DONE_CRECV] = 0;
        ctr[C_CREADY] = round + 2;
    }
    publish_ready(ep, round + 2, false);
    CUEP_TRACE(ep, true, 17);
}

}  // namespace

template <typename TC>
__device__ void combine_kernel(const EPParams& params, const CombineArgs& a, int phases) {
    __shared__ int s_flag;
    const EP ep{params.v};
    // The message counts, loaded by warp 1 while thread 0 loads the entry counters (the barrier in
    // load_entry_counters publishes them): the partial sums' first rows depend on them.
    __shared__ int s_early_count[kMaxRanks];
    const bool early = (phases & kPhaseSend) && !(phases & kKnobNoEarlyLoads);
    if (early && threadIdx.x >= kWarp && threadIdx.x < kWarp + ep[P_N_SRC])
        s_early_count[threadIdx.x - kWarp] = a.msg_count[threadIdx.x - kWarp];
    // the error flag and the round in one load per block (as in dispatch_kernel)
    const EntryCounters entry = load_entry_counters(ep);
    if (entry.status == kStatusTimeout) return;
    const int round = entry.comb_round, recv_round = entry.crecv_round;
    const int entered = count_entry(ep, C_ENTER_COMBINE);
    CUEP_TRACE(ep, blockIdx.x == 0, 12);
    if (phases & kPhaseNotify) phase_notify(ep, round, a.mode, (phases & kPhaseSend) != 0, a.num_tokens);
    if ((phases & kPhaseRecv) && (phases & kPhaseSend) && threadIdx.x % kWarp < static_cast<unsigned>(ep[P_TOP_K])) {
        // the receive item's top-k row into L2 now, so the receive half does not start with a cold load
        const int n_vec = static_cast<int>(ep[P_HIDDEN] / 8), item = recv_static_item(a, n_vec);
        if (item >= 0) {
            const int kChunkVecs = static_cast<int>(chunk_units(a.num_tokens, n_vec, kWarp));
            const int t = item / ((n_vec + kChunkVecs - 1) / kChunkVecs);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(a.topk_ids + static_cast<long long>(t) * ep[P_TOP_K] +
                                                         threadIdx.x % kWarp));
        }
    }
    // Every block sends first (blocks done sending take up the receiving): receive-only blocks, which would overlap
    // the sums with the incoming stream, measured slower. 4 x H200, N = 4096 bf16: none 535 us, 1/8 547, 2/8 537,
    // 4/8 571; 2 x H200 (knob bits 27-29): none 272, 1/8 276, 2/8 288, 4/8 363.
    if (phases & kPhaseSend)
        phase_send<TC>(ep, a, round, send_block_count(phases, 0), early ? s_early_count : nullptr);
    if ((phases & kPhaseNotify) && (phases & kPhaseSend) && blockIdx.x == 0) publish_parity_ready(ep, round, a.mode);
    if (phases & kPhaseRecv) phase_recv<TC>(ep, a, recv_round, &s_flag);
    // The block that entered last advances the rounds of the phases this launch ran.
    if (last_to_enter(ep, C_ENTER_COMBINE, entered)) {
        if (phases & kPhaseSend) ep.counters()[C_COMB_ROUND] = round + 1;
        if (phases & kPhaseRecv) ep.counters()[C_CRECV_COUNT] = recv_round + 1;
    }
}

#define CUEP_COMBINE(NAME, TC)                                                                               \
    extern "C" __global__ void __launch_bounds__(kCombineThreads) NAME(                                      \
        const __grid_constant__ EPParams params, const void* expert_out, const int* src_info,                \
        const int* row_src,                                                                                  \
        const float* row_weight, const int* msg_rows, const int* msg_token, const int* msg_j,                \
        const int* msg_count, const unsigned* row_offsets, const int* topk_ids, const float* topk_weights,   \
        const void* residual, void* out, int num_tokens, int mode, int phases) {                             \
        const CombineArgs a{expert_out, src_info, row_src, row_weight, msg_rows, msg_token, msg_j,           \
                            msg_count, row_offsets, topk_ids, topk_weights, residual, out, num_tokens, mode, \
                            phases};                                                                     \
        combine_kernel<TC>(params, a, phases);                                                               \
    }

CUEP_COMBINE(cuep_combine_bf16, bf16_t)
CUEP_COMBINE(cuep_combine_f32, float)
