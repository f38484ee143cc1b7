// Dispatch of a one-rank group (every expert local), all phases in one call: there is no other rank to count with
// or wait for, so no flags, fences, readiness or round counters.
//   small round (N <= small_batch_tokens), one launch: every block lays the round out by itself from topk_ids (the
//     round's book, in shared memory: local_book) and places its share of the rows;
//   larger rounds, one launch (dispatch_local_large): every block counts its own range of tokens (local_count: in
//     shared memory, then one atomic per expert on the round's histogram gives the block's first position in each
//     group); once every block has counted (a grid barrier) each block lays the groups out from the histogram
//     itself, as a small round does from its book, and places its share of the rows. A larger round whose output
//     scales span kGatherScalesFrom bytes stores each token's scales once, in its record of the meta region, notes
//     every row's (scale_rows, as the protocol's large rounds do) and gathers them into the output in whole lines
//     once every warp has noted its last item's (a grid-wide count on C_LOCAL_NOTED, zeroed before the count's
//     barrier).
// Outputs as the protocol's (rows of an expert in any order, padding, scales). Each choice's position in its group
// goes to local_choice_pos for the one-rank combine (combine/local.cuh); the protocol's combine handle is not
// written: a one-rank round's combine, fused or in halves, is the one-rank combine.
#pragma once
#include "recv.cuh"
#include "send.cuh"

namespace cuep {

// A launch takes the one-rank round when the group is one rank and the launch runs every phase.
__device__ __forceinline__ bool local_round(const EPParams& ep, int phases) {
    constexpr int kAll = kPhaseNotify | kPhaseSend | kPhaseRecv;
    return ep.n_ranks == 1 && (phases & kAll) == kAll;
}

// Shared memory of the placement: (small: the book) the groups' first rows [G + 1], first scale tiles [G], (larger:
// each local expert's row count [L], also the count's histogram), then one encode staging per warp (cuep/ep.py
// _local_layout_bytes).
__device__ __forceinline__ long long local_layout_bytes(const EPParams& ep, bool book) {
    return (book ? small_book_bytes(ep) : 0LL) + align_up(4 * (ep.n_groups + 1)) + align_up(4 * ep.n_groups) +
           (book ? 0LL : align_up(4 * ep.n_local));
}
// A larger round's histogram, by the parity of its generation (C_LOCAL_GEN at entry): expert e's count at
// [e x kLocalHistStride], after the protocol's histogram. The round re-arms the other parity's for the next one.
__device__ __forceinline__ int* local_hist(const EPParams& ep, int parity) {
    return ep.counters() + C_HIST + ep.n_experts * (1LL + static_cast<long long>(parity) * kLocalHistStride);
}
// Where a larger round that gathers its scales keeps token t's (its record's scales in the meta region, which a
// one-rank group's messages never use).
__device__ __forceinline__ uint8_t* local_scale_record(const EPParams& ep, int t) {
    return reinterpret_cast<uint8_t*>(message_meta(ep, static_cast<int>(ep.rank), false, 0, 0, t) + ep.meta_scales);
}

// The groups' first rows (shared expert first, each group padded to the row alignment) from the row count of each
// local expert (`count(l)`), and for fp4 their first scale tiles (each group starts a fresh 128-row tile). All
// threads of the block, a group each per pass, two barriers a pass: a warp scan, each warp's sum to shared memory,
// then every warp scans those sums itself (its offset and the pass's total) and writes its groups. fp4 scans rows
// and tiles together (packed: rows low, tiles high; two scans took 0.35 us more of an N = 1 round). (The block scan
// of common.cuh, three barriers and a fourth to publish the layout: bf16 N = 1 / 32 rounds 2.1-2.8% longer, nvfp4
// 0.7-1.2%, H100, cold.) *tiles_end (fp4): the scale tiles used.
template <bool kWide>
struct ScanWord {
    using type = unsigned;
};
template <>
struct ScanWord<true> {
    using type = unsigned long long;
};
template <int FMT, class Team, class Count>
__device__ void local_scan_groups(const EPParams& ep, int shared_n, Count count, unsigned* s_offsets,
                                  unsigned* s_tiles, unsigned* tiles_end) {
    constexpr bool kTiled = FMT == kFmtNvfp4 || FMT == kFmtMxfp4;
    using V = typename ScanWord<kTiled>::type;
    auto rows_of = [](V v) { return static_cast<unsigned>(v & 0xffffffffu); };
    auto tiles_of = [](V v) { return static_cast<unsigned>(static_cast<unsigned long long>(v) >> 32); };
    const int L = static_cast<int>(ep.n_local), sh = static_cast<int>(ep.shared);
    const int lane = threadIdx.x % kWarp, warp = Team::warp(), n_warps = Team::n_warps();
    __shared__ V s_sums[32];
    unsigned carry = sh ? padded(shared_n, ep) : 0;
    unsigned tile_carry = (carry + kScaleTileRows - 1) / kScaleTileRows;
    if (Team::tid() == 0) {
        s_offsets[0] = 0;
        if (sh) s_offsets[1] = carry;
        if (kTiled && sh) s_tiles[0] = 0;  // the shared group's (without it, the loop's l = 0 writes it)
    }
    for (int l0 = 0; l0 < L; l0 += Team::nthreads()) {
        const int l = l0 + Team::tid();
        const unsigned size = l < L ? padded(count(l), ep) : 0u;
        const unsigned tiles = kTiled ? (size + kScaleTileRows - 1) / kScaleTileRows : 0u;
        V incl = kTiled ? static_cast<V>(size | static_cast<unsigned long long>(tiles) << 32) : static_cast<V>(size);
#pragma unroll
        for (int o = 1; o < kWarp; o <<= 1) {
            const V n = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += n;
        }
        if (lane == kWarp - 1) s_sums[warp] = incl;
        Team::sync();
        V sums = lane < n_warps ? s_sums[lane] : V(0);
#pragma unroll
        for (int o = 1; o < kWarp; o <<= 1) {
            const V n = __shfl_up_sync(0xffffffffu, sums, o);
            if (lane >= o) sums += n;
        }
        const V before = __shfl_sync(0xffffffffu, sums, warp > 0 ? warp - 1 : 0);
        const V total = __shfl_sync(0xffffffffu, sums, n_warps - 1);
        if (warp > 0) incl += before;
        if (l < L) {
            s_offsets[sh + l + 1] = carry + rows_of(incl);
            if (kTiled) s_tiles[sh + l] = tile_carry + tiles_of(incl) - tiles;
        }
        carry += rows_of(total);
        if (kTiled) tile_carry += tiles_of(total);
        if (kTiled && Team::tid() == 0 && l0 + static_cast<int>(Team::nthreads()) >= L) *tiles_end = tile_carry;
        Team::sync();  // (s_sums is reused by the next pass; after the last, the layout is complete)
    }
}

// ---- small rounds: the book ----------------------------------------------------------------------------------
// A small round's book for one rank, the same in every block (positions come from per-expert token masks, not from
// atomics, so that every block agrees), in the SmallBook's shared memory (its expert and bits arrays):
//   0. the masks cleared while the ids load (and `meanwhile()`, work that needs no book), a barrier;
//   1. a W-lane segment per token (W a power of two >= K, lane k = choice k): its token's bit set in its expert's
//      mask, the validity test with shuffles only in a warp with a repeat or a bad id (block 0 reports bad choices),
//      the choice's expert (kNoExpert if not valid); a barrier.
// The group scan that follows reads the counts from the masks (mask_tokens), and each item its choices' positions
// (the earlier tokens in the expert's mask: mask_tokens_before). (A pass here storing every position before the
// scan: H200 A/B, cold, N = 128 1.03x every format, nvfp4 N = 1 / 32 1.03x / 1.04x, bf16 N = 1 1.00x.)
// (The protocol's small_bookkeeping also fills per-rank token masks and message counts a one-rank round does not use,
// in four passes with a barrier after each.)
template <class Team, class Meanwhile>
__device__ void local_book(const EPParams& ep, const DispatchArgs& a, const SmallBook& b, Meanwhile meanwhile) {
    const int E = static_cast<int>(ep.n_experts), K = static_cast<int>(ep.top_k);
    const int L = static_cast<int>(ep.n_local), rank = static_cast<int>(ep.rank);
    const int N = a.num_tokens, lane = threadIdx.x % kWarp;
    const bool report = blockIdx.x == 0;
    const int words = (N + 31) / 32;
    const ChoiceLanes cl(K, lane);
    const int W = cl.W, per_warp = cl.per_warp, seg = cl.seg, k = cl.k;
    const int per_pass = static_cast<int>(Team::n_warps()) * per_warp;  // tokens per pass of the team
    const int t_first = static_cast<int>(Team::warp()) * per_warp + seg;
    constexpr int kLoads = 4;  // passes whose ids are loaded together
    int ids[kLoads];
    auto load = [&](int t0) {
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
            const int t = t0 + u * per_pass + t_first;
            ids[u] = t < N && k < K ? a.topk_ids[t * K + k] : -1;
        }
    };
    load(0);
    meanwhile();
    for (int i = Team::tid(); i < E * words; i += Team::nthreads()) b.bits[i] = 0u;
    Team::sync();
    for (int t0 = 0; t0 < N; t0 += kLoads * per_pass) {
        if (t0) load(t0);
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
            if (t0 + u * per_pass >= N) break;  // the block's tokens are done (the same for every thread)
            const int t = t0 + u * per_pass + t_first;
            const bool choice = t < N && k < K;
            const int e = ids[u];
            // An in-range choice sets its token's bit in its expert's mask at once; the bit found already set means
            // another lane of the token chose the same expert. Only a warp holding such a repeat or a bad id takes
            // the exact test (warp_choice_valid: the first choice wins, errors reported); the bit is the same either
            // way. (The exact test for every choice, K shuffles each, was 0.1-0.15 us of the layout's critical path.)
            const bool in_range = choice && e >= 0 && e < E && (!ep.skip_a2a || e / L == rank);
            const unsigned bit = 1u << (t % 32);
            const bool seen = in_range && (atomicOr(b.bits + e * words + t / 32, bit) & bit);
            bool valid = in_range;
            if (__any_sync(0xffffffffu, (choice && !in_range) || seen))
                valid = warp_choice_valid(ep, e, choice, k, K, W, t, report);
            if (choice) b.expert[t * K + k] = valid ? static_cast<uint16_t>(e) : kNoExpert;
        }
    }
    Team::sync();
}

// ---- larger rounds: the count ----------------------------------------------------------------------------------
// Every block its own range of tokens ([b x len, (b + 1) x len), len = ceil(N / blocks)), up to kPasses passes of
// the block at a time: a W-lane segment per token (W a power of two >= K, lane k = choice k), validity with shuffles
// (bad choices reported and skipped), each valid choice's place among the block's choices of its expert from a
// shared-memory atomic (s_hist: the local experts' counts), then one atomic per expert the block chose on the
// round's histogram `hist` (local_hist) gives the block's first position in each group: each choice's position
// goes to local_choice_pos (-1 for the others). (An atomic per choice on a packed histogram, 32768 at N = 4096,
// took 7.5 us on an H100.)
__device__ void local_count(const EPParams& ep, const DispatchArgs& a, int* hist, int* s_hist) {
    const int K = static_cast<int>(ep.top_k), N = a.num_tokens, L = static_cast<int>(ep.n_local);
    const int first = static_cast<int>(ep.rank) * L, lane = threadIdx.x % kWarp;
    int* pos = local_choice_pos(ep);
    const ChoiceLanes cl(K, lane);
    const int W = cl.W, per_warp = cl.per_warp, seg = cl.seg, k = cl.k;
    const int per_pass = static_cast<int>(blockDim.x / kWarp) * per_warp;  // tokens per pass of the block
    const int len = (N + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
    const int t_lo = min(N, static_cast<int>(blockIdx.x) * len), t_hi = min(N, t_lo + len);
    const int t_first = static_cast<int>(threadIdx.x / kWarp) * per_warp + seg;
    constexpr int kPasses = 4;
    for (int t0 = t_lo; t0 < t_hi; t0 += kPasses * per_pass) {
        int e[kPasses], lp[kPasses];
#pragma unroll
        for (int u = 0; u < kPasses; ++u) {
            const int t = t0 + u * per_pass + t_first;
            e[u] = t < t_hi && k < K ? a.topk_ids[static_cast<long long>(t) * K + k] : -1;
        }
        for (int l = threadIdx.x; l < L; l += blockDim.x) s_hist[l] = 0;
        __syncthreads();
#pragma unroll
        for (int u = 0; u < kPasses; ++u) {
            lp[u] = -1;
            if (t0 + u * per_pass >= t_hi) break;  // the block's tokens are done (the same for every thread)
            const int t = t0 + u * per_pass + t_first;
            const bool choice = t < t_hi && k < K;
            if (warp_choice_valid(ep, e[u], choice, k, K, W, t)) lp[u] = atomicAdd(s_hist + e[u] - first, 1);
        }
        __syncthreads();
        for (int l = threadIdx.x; l < L; l += blockDim.x) {
            const int n = s_hist[l];
            if (n) s_hist[l] = atomicAdd(hist + static_cast<long long>(first + l) * kLocalHistStride, n);
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < kPasses; ++u) {
            const int t = t0 + u * per_pass + t_first;
            if (t < t_hi && k < K)
                pos[static_cast<long long>(t) * K + k] = lp[u] >= 0 ? s_hist[e[u] - first] + lp[u] : -1;
        }
        __syncthreads();  // s_hist is read before the next pass clears it
    }
}

// ---- placement (both) ------------------------------------------------------------------------------------------
// kBook: a small round, the book built here; otherwise the counts local_count left (the histogram of `parity`, each
// choice's position in local_choice_pos) once `counted()` (all threads; false: give up) says every block's are in;
// a larger nvfp4 round also gets its kernel's table of r per scale byte (`nvfp4_r`, Nvfp4Table), published.
// kSplit: a small round laid out split (a kernel of its own, cuep_dispatch_local_split_*: the host launches it for
// a round that encodes of at most kSplitTokens tokens, cuep/ep.py _route).
constexpr int kSplitTokens = 32;
template <int FMT, typename T, bool kBook, bool kSplit, class Counted>
__device__ void dispatch_local(const EPParams& ep, const DispatchArgs& a, char* smem, int parity, Counted counted,
                               const float* nvfp4_r = nullptr) {
    const int K = static_cast<int>(ep.top_k), H = static_cast<int>(ep.hidden), G = static_cast<int>(ep.n_groups);
    const int L = static_cast<int>(ep.n_local), rank = static_cast<int>(ep.rank);
    const int sh = static_cast<int>(ep.shared), N = a.num_tokens, words = (N + 31) / 32;
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
    constexpr bool kTiled = FMT == kFmtNvfp4 || FMT == kFmtMxfp4;
    using S = typename FormatTraits<FMT>::Scale;

    // (a small round: thread 0 loads the failed flag now, the block checks it once the layout is built)
    const int failed = kBook ? read_failed(ep) : 0;
    // Items (token, chunk of whole 256-value spans), one warp each, consecutive items on different blocks (step 3);
    // their plan (a small round's once its ids are on their way: `plan`).
    const int n_spans = (H + kWarpSpan - 1) / kWarpSpan;
    const int grid_warps = static_cast<int>(gridDim.x) * n_warps;
    // A small round's padding goes to the warps of a block that have no item when at least kMinPadWarps have none
    // (step 2); a quantized small round whose items would leave fewer takes chunks of whole encode steps, as few as
    // make room. (N = 128: 4 spans a chunk, 4-5% faster; at N = 1 and 32, which have the room, 4-10% slower.)
    // A quantized larger round's chunks are whole encode steps too (rounded up: a 7-span chunk is one 4-span step
    // and three of one span, each waiting on its loads): H100, N = 384 .. 1024, every format 1.7-5.8% faster cold.
    constexpr int kMinPadWarps = 4;
    // A small round with at most twice as many (token, chunk) pairs as blocks splits each pair's rows over 1 << lp
    // items (part p places choices k with k % (1 << lp) == p; the shared-expert row and the combine's positions:
    // part 0): a warp storing its chunk to all 8 rows of an N = 1 token took 0.64 us and its block ended 1.2 us
    // after the others. H100 A/B, warm: N = 1 .. 4 (8 parts) bf16 7% faster, fp8 / nvfp4 / mxfp4 3-5%; N = 5, 8
    // (4 parts) 3-5%; N = 16 (2 parts) 0.97-0.99 warm, 0.98-1.02 cold, so not taken; N >= 32 unchanged.
    // lp comes with the host's plan (bits kPartsShift.. of its chunks field; cuep/ep.py _small_round_chunks).
    constexpr int kPartsShift = 28;
    int spans_per_chunk = 1, n_chunks = 1, n_items = 0, lp = 0;
    auto whole_steps = [](int spans) { return (spans + kEncodeSteps - 1) / kEncodeSteps * kEncodeSteps; };
    // A small round's chunks come from the host (a.chunk_plan, cuep/ep.py _small_round_chunks: the rule above for
    // this grid, worked out once per N): its five dependent divisions here held every warp's first loads back, 3-7%
    // of an N = 1 / 32 round (H100). A plan that does not cover the row exactly (none given) falls back to a span
    // per chunk (at most kMaxChunks a token): right at any N, only slower.
    auto plan = [&]() {
        if constexpr (kBook) {
            if (take_chunk_plan(a.chunk_plan & ~(7 << kPartsShift), n_spans, &spans_per_chunk, &n_chunks)) {
                lp = (a.chunk_plan >> kPartsShift) & 7;
            } else {
                spans_per_chunk = (n_spans + kMaxChunks - 1) / kMaxChunks;
                n_chunks = (n_spans + spans_per_chunk - 1) / spans_per_chunk;
            }
        } else {
            spans_per_chunk = max(chunk_units<int>(N, n_spans, 1, grid_warps),
                                  (n_spans + kMaxChunks - 1) / kMaxChunks);
            if (FMT != kFmtBf16) spans_per_chunk = whole_steps(spans_per_chunk);
            n_chunks = (n_spans + spans_per_chunk - 1) / spans_per_chunk;
        }
        n_items = N * n_chunks << lp;  // (fits an int: chunks and parts split a token only while warps outnumber it)
    };
    if (!kBook) plan();
    const long long pb = ep.payload_bytes;
    const int sb = static_cast<int>(ep.scale_bytes);
    const long long staging = align_up(pb) + align_up(sb);
    uint8_t* s_payload = reinterpret_cast<uint8_t*>(smem + local_layout_bytes(ep, kBook)) + warp * staging;
    uint8_t* s_scales = s_payload + align_up(pb);
    using Vectors = WarpVectors<4>;
    constexpr bool kFromX = FMT == kFmtBf16 && sizeof(T) == 2;  // the payload is x itself
    // A larger nvfp4 round's blocks read their multiplier r from the table its kernel filled (`nvfp4_r`,
    // Nvfp4Table) instead of computing it (about ten instructions a 16-value block): H200 A/B, cold, N = 1024 ..
    // 8192, two runs, 0.983x-0.999x. (A small round's first encode runs before any barrier could publish a table.)
    auto encode = [&](const T* x_row, int c_lo, int c_hi) {
        if constexpr (FMT == kFmtNvfp4 && !kBook)
            encode_chunk<FMT, T>(x_row, c_lo, c_hi, H, s_payload, s_scales, Nvfp4Table{a.global_scale, nvfp4_r},
                                 lane);
        else
            encode_chunk<FMT, T>(x_row, c_lo, c_hi, H, s_payload, s_scales, a.global_scale, lane);
    };
    const int item0 = warp * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x);
    // A warp starts its first item before the layout (none of it needs the layout): a small round its weights and,
    // bf16 from bf16, its first payload vectors into registers, other formats its chunk of x into L1 for the encode
    // (encoding there held the book's barrier back: slower at N = 128); a larger quantized round its weights and
    // the encode itself, while the other blocks count. (Done after the layout, these loads were half of an N = 1
    // round's time past it. A larger bf16 round prefetching its chunk into L2 was 1.5% slower at N = 4096.)
    constexpr bool kEncodedEarly = !kBook && !kFromX;
    constexpr bool kPrepares = kBook || kEncodedEarly;
    // Split layout (kSplit): in a small round that encodes (not bf16 from bf16) of at most kSplitTokens tokens, the
    // last kBookWarps warps lay the round out among themselves (LastWarpsTeam: their own barrier) while the others
    // encode their first item (the host takes these kernels only when every item of the round lies on those warps,
    // cuep/ep.py _split_fits: a team warp's first item would have no weights loaded; at H = 7168 on 132 SMs a
    // decode round has at most 7 items a block), and the block meets once the layout is built. (Otherwise the item
    // warps only prefetch their chunk during the layout and encode it after: 0.5-0.7 us of an N = 1 round, fp8 /
    // nvfp4.) H200 A/B against the plain kernel: N = 1 .. 32 fp8 1-6%, nvfp4 / mxfp4 7-10% faster, cold and warm.
    // Not taken: larger rounds, whose book and encodes are longer (5-11% slower: the book gets half the warps and
    // shares the issue slots with the encodes); the choice made at run time in one kernel body (every larger small
    // round 4-5% slower). The teams are static (LayoutTeam): the kernels that never split compile exactly as
    // without this option.
    constexpr bool kMaySplit = kSplit && kBook && !kFromX;
    constexpr int kBookWarps = 8;
    using Team = typename LayoutTeam<kMaySplit, kBookWarps>::type;
    const bool lays_out = !kMaySplit || warp >= n_warps - kBookWarps;
    const bool early = kEncodedEarly || (kMaySplit && !lays_out);
    Vectors v0;
    float w0 = 0.f;
    auto prepare = [&]() {
        plan();
        if (!kPrepares || item0 >= n_items) return;
        const int t = (item0 >> lp) / n_chunks, ch = (item0 >> lp) % n_chunks;
        const ChunkBytes<FMT> cb(ch, spans_per_chunk, n_chunks, H, pb, sb);
        const T* x_row = static_cast<const T*>(a.x) + static_cast<long long>(t) * H;
        if constexpr (kFromX) {
            v0.load(reinterpret_cast<const uint8_t*>(x_row) + cb.p_lo,
                    static_cast<int>(min(static_cast<long long>(Vectors::kBytes), cb.p_hi - cb.p_lo)), lane);
        } else if (early) {
            encode(x_row, cb.c_lo, cb.c_hi);
        } else {
            const char* lo = reinterpret_cast<const char*>(x_row + cb.c_lo);
            const char* hi = reinterpret_cast<const char*>(x_row + cb.c_hi);
            for (const char* line = lo + 128 * lane; line < hi; line += 128 * kWarp)
                asm volatile("prefetch.global.L1 [%0];" ::"l"(line));
        }
        if (ch == 0 && lane < K && a.topk_weights) w0 = a.topk_weights[static_cast<long long>(t) * K + lane];
    };

    // 1. The layout: the book (block 0 reports bad choices) or the histogram; the groups' rows and scale tiles (block
    // 0 writes the outputs' offsets).
    // (split: the last kBookWarps warps lay out, the item warps join at the block barrier after the scan)
    __shared__ int s_shared_lo, s_shared_n, s_failed;
    if (lays_out && Team::tid() == 0) {
        s_shared_lo = sh ? shared_lo(ep, N) : 0;
        s_shared_n = sh ? shared_hi(ep, N) - shared_lo(ep, N) : 0;
    }
    SmallBook book{};
    char* layout = smem;
    if constexpr (kBook) {
        book = small_book(ep, smem);
        if constexpr (kMaySplit) {
            if (lays_out) {
                local_book<Team>(ep, a, book, plan);
            } else {
                prepare();
            }
        } else {
            local_book<Team>(ep, a, book, prepare);
        }
        layout = smem + small_book_bytes(ep);
    }
    unsigned* s_offsets = reinterpret_cast<unsigned*>(layout);
    unsigned* s_tiles = s_offsets + align_up(4 * (ep.n_groups + 1)) / 4;
    int* s_count = reinterpret_cast<int*>(s_tiles + align_up(4 * ep.n_groups) / 4);  // (larger rounds)
    if constexpr (!kBook) {
        prepare();
        if (!counted()) return;
        const int* hist = local_hist(ep, parity);
        for (int l = threadIdx.x; l < L; l += blockDim.x)
            s_count[l] = __ldcg(hist + static_cast<long long>(rank * L + l) * kLocalHistStride);
        __syncthreads();
    }
    auto count_of = [&](int l) {
        return kBook ? mask_tokens(book.bits + (rank * L + l) * words, words) : s_count[l];
    };
    __shared__ unsigned s_tiles_end;  // (fp4) the scale tiles used
    note_failed(failed == kStatusTimeout, &s_failed);
    if (lays_out) local_scan_groups<FMT, Team>(ep, s_shared_n, count_of, s_offsets, s_tiles, &s_tiles_end);
    if (kMaySplit) __syncthreads();  // the item warps join: the layout and s_failed are the block's
    if (kBook && s_failed) return;  // (nothing stored yet)
    if (blockIdx.x == 0) {
        for (int g = threadIdx.x; g <= G; g += blockDim.x) {
            a.row_offsets[g] = s_offsets[g];
            if (g < G) {
                a.expert_ids[g] = sh ? (g == 0 ? L : g - 1) : g;
                if (kTiled && a.scales_offsets) a.scales_offsets[g] = s_tiles[g] - s_offsets[g] / kScaleTileRows;
            }
        }
    }
    // A larger round's scales, when they span kGatherScalesFrom bytes of the output: noted per row and gathered at
    // the end (the same decision in every block: it reads the shared layout).
    bool defer = false;
    if constexpr (!kBook && FMT != kFmtBf16) {
        const long long out_bytes = kTiled ? static_cast<long long>(s_tiles_end) * kScaleTileRows * ep.k_tiles * 4
                                           : static_cast<long long>(s_offsets[G]) * ep.n_scales * 4;
        defer = out_bytes >= kGatherScalesFrom;
    }

    // 2. Padding, a group per block: by the whole block or, in a small round whose items leave at least
    // kMinPadWarps of the block's warps without one, by those, while the others start their items at once. (By the
    // last 4 warps, some with items: N = 1 / 32 nvfp4 7% faster, N = 128 5% slower; a warp-sized unit at a time
    // taken from a counter by whichever warp came free: 1.3-1.5x slower, each unit waiting on its atomic.)
    int pad_warp = 0;  // the block's first padding warp
    if constexpr (kBook) {
        const int b = static_cast<int>(blockIdx.x), busy = n_items > b ? (n_items - b + gridDim.x - 1) / gridDim.x : 0;
        if (n_warps - busy >= kMinPadWarps) pad_warp = busy;  // warps [0, busy) have an item
    }
    if (warp >= pad_warp)
        for (int g = blockIdx.x; g < G; g += gridDim.x) {
            const unsigned used = s_offsets[g] + (sh && g == 0 ? s_shared_n : count_of(g - sh));
            pad_group<FMT>(ep, a, s_offsets, s_tiles, g, used, defer, pad_warp * kWarp, (n_warps - pad_warp) * kWarp);
        }

    // 3. Items: encode the chunk once (staging; bf16 from bf16 goes straight from x) and store it to each row of
    // the token (and its shared-expert row), with its scales; the chunk 0 item writes the rows' metadata.
    char* tokens = ep.local(ep.off_tokens);
    int* pos_out = local_choice_pos(ep);
    bool arrived = false;  // (deferred scales) the warp's records and notes are in
    for (int item = item0; item < n_items; item += grid_warps) {
        const bool prepared = kPrepares && item == item0;  // (its weights, first vectors or encode: prepare())
        const int part = item & ((1 << lp) - 1), t = (item >> lp) / n_chunks, ch = (item >> lp) % n_chunks;
        const ChunkBytes<FMT> cb(ch, spans_per_chunk, n_chunks, H, pb, sb);
        const int c_lo = cb.c_lo, c_hi = cb.c_hi, s_lo = cb.s_lo, s_hi = cb.s_hi;
        const bool last = cb.last;
        const long long p_lo = cb.p_lo, p_hi = cb.p_hi;
        const T* x_row = static_cast<const T*>(a.x) + static_cast<long long>(t) * H;
        const bool shared = sh && part == 0 && t >= s_shared_lo && t < s_shared_lo + s_shared_n;
        // lane k: choice k's position in its group (-1: none): a small round's from the book's masks, a larger
        // round's local_count's
        int p = -1, e = 0;
        if (lane < K) {
            if constexpr (kBook) {
                e = book.expert[t * K + lane];
                p = e != kNoExpert ? mask_tokens_before(book.bits + e * words, t) : -1;
            } else {
                p = pos_out[static_cast<long long>(t) * K + lane];
                if (p >= 0) e = a.topk_ids[static_cast<long long>(t) * K + lane];
            }
        }
        if (kBook && ch == 0 && part == 0 && lane < K) pos_out[t * K + lane] = p;  // for the one-rank combine
        if ((lane & ((1 << lp) - 1)) != part) p = -1;  // another part's row
        const unsigned rows = __ballot_sync(0xffffffffu, p >= 0);
        if (!rows && !shared) continue;
        const uint8_t* payload;
        if constexpr (kFromX) {
            payload = reinterpret_cast<const uint8_t*>(x_row);
        } else {
            if (!(early && prepared))
                encode(x_row, c_lo, c_hi);
            payload = s_payload;
        }
        // the token's rows (lane k: choice k's row, or -1) and its row in the shared group (which starts at row 0)
        const int g = sh + e - rank * L;
        const int row = p >= 0 ? static_cast<int>(s_offsets[g]) + p : -1;
        const int srow = t - s_shared_lo;
        if (sb && defer) {
            // the chunk's scale bytes into the token's record (whole words when the row's scales are), its rows'
            // scale rows noted once (chunk 0), before its payload: the warp's last item then tells the gather it
            // is done (arrives on C_LOCAL_NOTED) and stores its rows while the gather runs. Records and the notes
            // are stored evict-last: the gather reads them back after the round's payload stream, which would
            // otherwise push them out of L2.
            uint8_t* rec = local_scale_record(ep, t);
            const int s_end = last ? sb : s_hi;
            if (sb % 4 == 0) {
                for (int b = s_lo + 4 * lane; b < s_end; b += 4 * kWarp)
                    store_u32_evict_last(rec + b, *reinterpret_cast<const uint32_t*>(s_scales + b));
            } else {
                for (int b = s_lo + lane; b < s_end; b += kWarp) rec[b] = s_scales[b];
            }
            if (ch == 0) {
                const uint32_t ref = scale_ref(ep, rec);
                if (row >= 0) {
                    const long long at = kTiled ? swizzle_row(s_tiles, s_offsets, g, row) : row;
                    store_u32_evict_last(scale_rows(ep) + at, ref);
                }
                if (shared && lane == 0) scale_rows(ep)[srow] = ref;
            }
            if (item + grid_warps >= n_items) {
                warp_arrive(ep.counters() + C_LOCAL_NOTED, lane);
                arrived = true;
            }
        }
        for (long long b = p_lo; b < p_hi; b += Vectors::kBytes) {
            const int n = static_cast<int>(min(static_cast<long long>(Vectors::kBytes), p_hi - b));
            Vectors v;
            if (kFromX && prepared && b == p_lo)
                v = v0;
            else
                v.load(payload + b, n, lane);
            for (unsigned rest = rows; rest; rest &= rest - 1)
                v.store(tokens + __shfl_sync(0xffffffffu, row, __ffs(rest) - 1) * pb + b, n, lane);
            if (shared) v.store(tokens + srow * pb + b, n, lane);
        }
        if (sb && !defer) {
            // the chunk's scale words (fp8 scales, fp4 k-tiles of 4) to the token's rows, a (row, word) pair per lane
            constexpr int kPerWord = FMT == kFmtFp8 ? 1 : kScaleTileCols;
            const int w_lo = s_lo / int(sizeof(S)) / kPerWord;
            const int w_hi = last ? (1 << 30) : s_hi / int(sizeof(S)) / kPerWord;
            const int scale_row = row >= 0 && kTiled ? static_cast<int>(swizzle_row(s_tiles, s_offsets, g, row)) : row;
            place_chunk_scales<FMT>(ep, a, K, row, scale_row, s_scales, w_lo, w_hi, lane);
            if (shared)
                place_row_scales<FMT>(ep, a, srow, srow, s_scales, lane, kWarp, w_lo * kPerWord,
                                      last ? (1 << 30) : w_hi * kPerWord);
        }
        if (ch == 0) {
            if (row >= 0) {
                a.src_info[2LL * row] = t;
                a.src_info[2LL * row + 1] = lane;
                a.row_src[row] = rank;
                a.row_weight[row] = !a.topk_weights ? 0.f
                                    : prepared ? w0
                                               : a.topk_weights[static_cast<long long>(t) * K + lane];
            }
            if (shared && lane == 0) {
                a.src_info[2LL * srow] = t;
                a.src_info[2LL * srow + 1] = K;
                a.row_src[srow] = rank;
                a.row_weight[srow] = 1.f;
            }
        }
        __syncwarp();  // the staging is reused by the warp's next item
    }

    // 4. (deferred) The scales in whole lines, once every warp of the grid has stored its tokens' scale records and
    // noted its rows' (a warp's last rows may still be in flight: the gather reads neither).
    if (defer) {
        if (!arrived) warp_arrive(ep.counters() + C_LOCAL_NOTED, lane);
        if (!warp_wait(ep, ep.counters() + C_LOCAL_NOTED, grid_warps, K_DISPATCH_SEND, lane)) return;
        gather_scales<FMT>(ep, a, 0, kTiled ? s_tiles_end : s_offsets[G], warp * static_cast<int>(gridDim.x) +
                           static_cast<int>(blockIdx.x), grid_warps, lane);
    }
}

// ---- a larger round in one launch -------------------------------------------------------------------------------
// Count, then a grid barrier on the count of the round's parity (C_LOCAL_GEN's at entry), which also picks its
// histogram. Before counting, the last block re-arms the other parity's count and histogram (the previous round,
// their last user, has ended) and the scale-gather barrier (no block reaches it before every block has counted);
// after the barrier, when every block has read C_LOCAL_GEN, block 0 advances it. Between arriving and waiting each
// warp starts its first item (dispatch_local's prepare); then every block lays the groups out and places its share.
template <int FMT, typename T>
__device__ void dispatch_local_large(const EPParams& ep, const DispatchArgs& a, char* smem) {
    int* ctr = ep.counters();
    __shared__ int s_gen, s_ok;
    __shared__ float s_nvfp4_r[FMT == kFmtNvfp4 ? 128 : 1];  // nvfp4: r per scale byte, published by the barrier below
    if constexpr (FMT == kFmtNvfp4) nvfp4_table_fill(s_nvfp4_r, a.global_scale);
    if (threadIdx.x == 0) s_gen = load_acquire_i32(ctr + C_LOCAL_GEN);
    __syncthreads();
    const int parity = s_gen & 1;
    if (blockIdx.x == gridDim.x - 1) {  // (the block with the fewest tokens to count)
        int* other = local_hist(ep, parity ^ 1);
        for (int e = threadIdx.x; e < ep.n_experts; e += blockDim.x)
            other[static_cast<long long>(e) * kLocalHistStride] = 0;
        if (threadIdx.x == 0) {
            ctr[C_LOCAL_COUNTED + (parity ^ 1)] = 0;
            ctr[C_LOCAL_NOTED] = 0;
        }
    }
    int* s_count = reinterpret_cast<int*>(smem + align_up(4 * (ep.n_groups + 1)) + align_up(4 * ep.n_groups));
    local_count(ep, a, local_hist(ep, parity), s_count);
    blocks_arrive(ctr + C_LOCAL_COUNTED + parity);
    // (the placement starts its first items, then waits here)
    dispatch_local<FMT, T, false, false>(ep, a, smem, parity, [&]() {
        if (!blocks_wait(ep, ctr + C_LOCAL_COUNTED + parity, static_cast<int>(gridDim.x), K_DISPATCH_SEND, &s_ok))
            return false;
        if (blockIdx.x == 0 && threadIdx.x == 0) ctr[C_LOCAL_GEN] = s_gen + 1;  // (the next launch reads it)
        return true;
    }, s_nvfp4_r);
}

}  // namespace cuep
