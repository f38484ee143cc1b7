// The staged protocol of small (decode) rounds: a round in which this rank sends at most small_tokens tokens sends
// each token at once to its own staging record at every destination, with no wait for the other ranks'
// histograms. Block 0 meanwhile computes the round's bookkeeping in shared memory (SmallBook) and publishes it as a
// book row per destination (stamped entries); the receiver reads a message's rows from the book and copies the
// staged payload to them.
#pragma once
#include "messages.cuh"

namespace cuep {

// A small round's book row, one per (parity, source) in each destination, after the staging records (the stage
// region; cuep/config.py sizes it), entries stamped like the tally's:
//   [ceil(S / 32)]  the source's token mask for this destination (word w, bit b: token 32 w + b comes here),
//   [S * K]         choice c of the source's [N, K] table: its expert (kNoExpert if not valid) | its position in
//                   the (expert, source) block << 16,
// S = small_tokens. The receiver has a message's rows before its payload lands; the router weights ride in the
// staging record's metadata (a second [S * K] of weights made the book row twice as long, and the book is what
// the receiver waits for first).
__device__ __forceinline__ int book_mask_words(const EPParams& ep) { return static_cast<int>((ep.small_tokens + 31) / 32); }
__device__ __forceinline__ int book_len(const EPParams& ep) {
    return book_mask_words(ep) + static_cast<int>(ep.small_tokens * ep.top_k);
}
__device__ __forceinline__ uint64_t* book_row(const EPParams& ep, int rank, int par, int s) {
    char* books = remote(ep, rank, ep.off_stage) + 2 * ep.n_src * ep.small_tokens * ep.stage_record;
    return reinterpret_cast<uint64_t*>(books) + (par * ep.n_src + s) * book_len(ep);
}


constexpr uint16_t kNoExpert = 0xFFFF;

// Block 0's bookkeeping of a small round, in shared memory (sizes: small_book_bytes; cuep/ep.py mirrors it).
struct SmallBook {
    uint16_t* expert;  // [N*K] the choice's expert if valid, else kNoExpert
    uint16_t* pos;     // [N*K] its position in the (expert, this source) block at the destination (token order)
    unsigned* words;   // [8 * ceil(D / 32)] each destination rank's token mask (bit t % 32 of word t / 32)
    int* mask;         // [N] the token's destination ranks
    unsigned* bits;    // [E * ceil(D / 32)] each expert's token mask (which tokens chose it)
    int* hist;         // [E] tokens to each expert
    int* n_msgs;       // [8] messages to each rank
};

// A token mask of `words` words (bit t % 32 of word t / 32): the tokens before t in it (a choice's position among its
// expert's tokens), and all of them.
__device__ __forceinline__ int mask_tokens_before(const unsigned* m, int t) {
    int n = __popc(m[t / 32] & ((1u << (t % 32)) - 1u));
    for (int w = 0; w < t / 32; ++w) n += __popc(m[w]);
    return n;
}
__device__ __forceinline__ int mask_tokens(const unsigned* m, int words) {
    int n = 0;
    for (int w = 0; w < words; ++w) n += __popc(m[w]);
    return n;
}

__device__ __forceinline__ SmallBook small_book(const EPParams& ep, char* smem) {
    const long long D = ep.small_tokens, K = ep.top_k, E = ep.n_experts, W = (D + 31) / 32;
    SmallBook b;
    char* p = smem;
    b.expert = reinterpret_cast<uint16_t*>(p); p += align_up(2 * D * K);
    b.pos = reinterpret_cast<uint16_t*>(p); p += align_up(2 * D * K);
    b.words = reinterpret_cast<unsigned*>(p); p += align_up(4 * kMaxRanks * W);
    b.mask = reinterpret_cast<int*>(p); p += align_up(4 * D);
    b.bits = reinterpret_cast<unsigned*>(p); p += align_up(4 * E * W);
    b.hist = reinterpret_cast<int*>(p); p += align_up(4 * E);
    b.n_msgs = reinterpret_cast<int*>(p);
    return b;
}
__device__ __forceinline__ long long small_book_bytes(const EPParams& ep) {
    const long long D = ep.small_tokens, K = ep.top_k, E = ep.n_experts, W = (D + 31) / 32;
    return 2 * align_up(2 * D * K) + align_up(4 * kMaxRanks * W) + align_up(4 * D) + align_up(4 * E * W) +
           align_up(4 * E) + 4 * kMaxRanks;
}

// Fill the book (all threads of the block; ends with a block barrier). `report`: this block records bad choices.
// A thread per choice throughout, so the whole book is three passes with a barrier after each (the first version,
// 16 token ranges counted warp by warp after a __match_any_sync pass, took 4 us after the ids landed):
//   1. the ids into shared memory (out-of-range ones marked), the masks cleared;
//   2. each choice's validity (no earlier choice of its token with the same expert, skip_a2a's locality), then
//      atomicOr of the token into its expert's token mask and of the expert's rank into the token's rank mask;
//   3. positions: the popcount of the expert's token mask below the token; the histogram: the mask's popcount.
__device__ void small_bookkeeping(const EPParams& ep, const DispatchArgs& a, const SmallBook& b, bool report) {
    const int E = static_cast<int>(ep.n_experts), K = static_cast<int>(ep.top_k);
    const int L = static_cast<int>(ep.n_local), R = static_cast<int>(ep.n_ranks);
    const int N = a.num_tokens, NK = N * K;
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
    // parameters in registers: the loops below store to shared memory through generic pointers and may report
    // errors, after which the compiler would reload every ep[] (this mattered when the block was in global memory)
    const bool skip = ep.skip_a2a != 0;
    const int my_rank = static_cast<int>(ep.rank);
    const int W = (N + 31) / 32;  // words of a token mask this round (the arrays are sized for small_tokens)
    // 1. Every id at once (coalesced, independent loads); out-of-range ones marked. The masks cleared.
    for (int c = threadIdx.x; c < NK; c += blockDim.x) {
        const int v = a.topk_ids[c];
        const bool ok = v >= 0 && v < E;
        if (!ok && report) report_error(ep, kStatusBadExpertId, K_DISPATCH_SEND, v, c / K);
        b.expert[c] = ok ? static_cast<uint16_t>(v) : kNoExpert;
    }
    for (int i = threadIdx.x; i < E * W; i += blockDim.x) b.bits[i] = 0u;
    for (int t = threadIdx.x; t < N; t += blockDim.x) b.mask[t] = 0;
    __syncthreads();
    // 2. Validity and the masks. b.pos carries the validity to pass 3 (b.expert must stay intact until every
    // thread has compared its choice with the earlier ones).
    for (int c = threadIdx.x; c < NK; c += blockDim.x) {
        const int t = c / K, k = c - t * K, e = b.expert[c];
        bool valid = e != kNoExpert;
        bool repeat = false;
        for (int j = 0; valid && j < k; ++j) repeat |= b.expert[t * K + j] == e;
        if (report && valid && repeat && (!skip || e / L == my_rank))
            report_error(ep, kStatusDuplicateExpert, K_DISPATCH_SEND, e, t);
        valid = valid && !repeat && (!skip || e / L == my_rank);
        if (valid) {
            atomicOr(b.bits + e * W + t / 32, 1u << (t % 32));
            atomicOr(b.mask + t, 1 << (e / L));
        }
        b.pos[c] = valid ? 1 : 0;
    }
    __syncthreads();
    // 3. Positions in token order (the earlier tokens of the expert's mask), the histogram.
    for (int c = threadIdx.x; c < NK; c += blockDim.x) {
        if (!b.pos[c]) {
            b.expert[c] = kNoExpert;
            continue;
        }
        const int t = c / K, e = b.expert[c];
        b.pos[c] = static_cast<uint16_t>(mask_tokens_before(b.bits + e * W, t));
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) b.hist[e] = mask_tokens(b.bits + e * W, W);
    // 4. Each destination's token mask (a warp per 32 tokens, a ballot per rank), then its message count.
    const int stride = static_cast<int>((ep.small_tokens + 31) / 32);
    __syncthreads();
    for (int w = warp; w < W; w += n_warps) {
        const int t = w * kWarp + lane;
        const unsigned m = t < N ? static_cast<unsigned>(b.mask[t]) : 0u;
        for (int r = 0; r < R; ++r) {
            const unsigned word = __ballot_sync(0xffffffffu, (m >> r) & 1u);
            if (lane == 0) b.words[r * stride + w] = word;
        }
    }
    __syncthreads();
    if (threadIdx.x < kMaxRanks) {
        int m = 0;
        for (int w = 0; static_cast<int>(threadIdx.x) < R && w < W; ++w)
            m += __popc(b.words[threadIdx.x * stride + w]);
        b.n_msgs[threadIdx.x] = m;
    }
    __syncthreads();
}

// Publish the book rows of a small round to every destination (all threads of the block; after the tallies).
__device__ void publish_small_book(const EPParams& ep, const DispatchArgs& a, int round, const SmallBook& b) {
    const int K = static_cast<int>(ep.top_k), me = static_cast<int>(ep.src_index);
    const int n_dest = n_dest_ranks(ep);
    const int stride = book_mask_words(ep), n_words = (a.num_tokens + 31) / 32, NK = a.num_tokens * K;
    for (int d = 0; d < n_dest; ++d) {
        const int r = dest_rank(ep, d);
        uint64_t* row = book_row(ep, r, round & 1, me);
        for (int i = threadIdx.x; i < n_words; i += blockDim.x)
            signal_stamped(r, row + i, tally_entry(round, static_cast<int>(b.words[r * stride + i])));
        for (int c = threadIdx.x; c < NK; c += blockDim.x) {
            const unsigned e = b.expert[c], pos = e != kNoExpert ? b.pos[c] : 0u;
            signal_stamped(r, row + stride + c, tally_entry(round, static_cast<int>(e | pos << 16)));
        }
    }
}

// A small round may write into a destination once it has finished the round before last (whose staging parity
// and tally row this round reuses): its tally row of the previous round is here (stamp >= round). All threads.
// `early`: the rows' first entries of both parities ([parity][source], acquired at kernel entry beside the entry
// counters' load, dispatch_kernel), or nullptr: when they already say so there is nothing to wait for (the usual
// case: a fused round's receive read those very rows), which saves a dependent L2 round trip before the first store.
__device__ __forceinline__ bool small_round_ready(const EPParams& ep, int round, int* s_ok, const uint64_t* early) {
    if (early) {
        const int n_src = static_cast<int>(ep.n_src);
        bool ready = true;
        for (int s = 0; s < n_src; ++s)
            ready = ready && (early[((round + 1) & 1) * n_src + s] >> 32) >= static_cast<uint64_t>(round);
        if (ready) {
            if (threadIdx.x == 0) *s_ok = 1;  // as block_wait_entries leaves it (the caller syncs before reading it)
            return true;
        }
    }
    const uint64_t* rows = tally_row(ep, static_cast<int>(ep.rank), (round + 1) & 1, 0);
    return block_wait_entries(rows, static_cast<int>(ep.n_src),
                              [round](uint64_t v) { return (v >> 32) >= static_cast<uint64_t>(round); }, ep,
                              K_DISPATCH_SEND, s_ok, tally_len(ep));
}

}  // namespace cuep
