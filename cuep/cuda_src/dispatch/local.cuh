// Dispatch of a one-rank group (every expert local), a small round, all phases in one launch: there is no other
// rank to count with or wait for, so every block lays the round out by itself from topk_ids (the small round's
// book, in shared memory: small_bookkeeping) and places its share of the rows. No flags, no fences, no grid-wide
// wait, no counters: the round's cost is one launch, the book and the copies. The outputs and the combine handle
// are those of the protocol's small round (rows of an expert in token order), so the protocol's combine reads them
// unchanged; each choice's row also goes to local_choice_rows for the one-rank combine (combine/local.cuh).
#pragma once
#include "recv.cuh"
#include "send.cuh"

namespace cuep {

// A launch takes the one-rank round when the group is one rank, the round is small and the launch runs every phase
// (the async / wait halves of one round are two launches: they take the protocol).
__device__ __forceinline__ bool local_round(const EPParams& ep, int phases, int num_tokens) {
    constexpr int kAll = kPhaseNotify | kPhaseSend | kPhaseRecv;
    return ep.n_ranks == 1 && (phases & kAll) == kAll && small_round(ep, num_tokens);
}

// Shared memory of the one-rank round: the book, the groups' first rows [G + 1] and first scale tiles [G], then one
// encode staging per warp (cuep/ep.py _dispatch_launch sizes the launch for it: _LOCAL_* there).
__device__ __forceinline__ long long local_fixed_bytes(const EPParams& ep) {
    return small_book_bytes(ep) + align_up(4 * (ep.n_groups + 1)) + align_up(4 * ep.n_groups);
}

template <int FMT, typename T>
__device__ void dispatch_local(const EPParams& ep, const DispatchArgs& a, char* smem) {
    const int K = static_cast<int>(ep.top_k), H = static_cast<int>(ep.hidden), G = static_cast<int>(ep.n_groups);
    const int L = static_cast<int>(ep.n_local), rank = static_cast<int>(ep.rank);
    const int sh = static_cast<int>(ep.shared), N = a.num_tokens;
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
    constexpr bool kTiled = FMT == kFmtNvfp4 || FMT == kFmtMxfp4;
    using S = typename FormatTraits<FMT>::Scale;

    // Items (token, chunk of whole 256-value spans), one warp each, consecutive items on different blocks (3.).
    const int n_spans = (H + kWarpSpan - 1) / kWarpSpan;
    const long long grid_warps = static_cast<long long>(gridDim.x) * n_warps;
    const int spans_per_chunk = static_cast<int>(max(chunk_units(N, n_spans, 1, grid_warps),
                                                     static_cast<long long>((n_spans + kMaxChunks - 1) / kMaxChunks)));
    const int n_chunks = (n_spans + spans_per_chunk - 1) / spans_per_chunk;

    // 1. The book (block 0 reports bad choices), the groups' rows and scale tiles.
    const SmallBook book = small_book(ep, smem);
    small_bookkeeping(ep, a, book, /*report=*/blockIdx.x == 0);
    unsigned* s_offsets = reinterpret_cast<unsigned*>(smem + small_book_bytes(ep));
    unsigned* s_tiles = s_offsets + align_up(4 * (ep.n_groups + 1)) / 4;
    __shared__ int s_scan[32];
    __shared__ unsigned s_tiles_end;
    __shared__ int s_shared_lo, s_shared_n;
    if (threadIdx.x == 0) {
        s_shared_lo = sh ? shared_lo(ep, N) : 0;
        s_shared_n = sh ? shared_hi(ep, N) - shared_lo(ep, N) : 0;
    }
    __syncthreads();
    {
        int carry = sh ? padded(s_shared_n, ep) : 0;
        if (threadIdx.x == 0) s_offsets[0] = 0;
        for (int l0 = 0; l0 < L; l0 += blockDim.x) {
            const int l = l0 + threadIdx.x;
            const int size = l < L ? padded(book.hist[rank * L + l], ep) : 0;
            int total;
            const int incl = block_inclusive_scan(size, s_scan, &total);
            if (l < L) s_offsets[sh + l + 1] = carry + incl;
            carry += total;
        }
        if (sh && threadIdx.x == 0) s_offsets[1] = padded(s_shared_n, ep);
    }
    __syncthreads();
    if (kTiled && threadIdx.x < kWarp) scan_scale_tiles(s_offsets, G, s_tiles, &s_tiles_end);
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int g = threadIdx.x; g <= G; g += blockDim.x) {
            a.row_offsets[g] = s_offsets[g];
            if (g < G) {
                a.expert_ids[g] = sh ? (g == 0 ? L : g - 1) : g;
                if (kTiled && a.scales_offsets) a.scales_offsets[g] = s_tiles[g] - s_offsets[g] / kScaleTileRows;
            }
        }
        if (threadIdx.x == 0) a.msg_count[0] = book.n_msgs[0];
    }

    // 2. Padding, a group per block.
    for (int g = blockIdx.x; g < G; g += gridDim.x) {
        const unsigned used = s_offsets[g] + (sh && g == 0 ? s_shared_n : book.hist[rank * L + g - sh]);
        pad_group<FMT>(ep, a, s_offsets, s_tiles, g, used, false);
    }

    // 3. Items: encode the chunk once (staging; bf16 from bf16 goes straight from x) and store it to each row of the
    // token (and its shared-expert row), with its scales; the chunk 0 item writes the rows' metadata and the
    // token's message.
    const long long pb = ep.payload_bytes;
    const int sb = static_cast<int>(ep.scale_bytes);
    const long long staging = align_up(pb) + align_up(sb);
    uint8_t* s_payload = reinterpret_cast<uint8_t*>(smem + local_fixed_bytes(ep)) + warp * staging;
    uint8_t* s_scales = s_payload + align_up(pb);
    const int mask_stride = book_mask_words(ep);
    char* tokens = ep.local(ep.off_tokens);
    using Vectors = WarpVectors<4>;
    // (N * n_chunks is small: N <= small_batch_tokens, and chunks split a token only while warps outnumber tokens)
    for (int item = warp * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x); item < N * n_chunks;
         item += static_cast<int>(grid_warps)) {
        const int t = item / n_chunks, ch = item % n_chunks;
        const int c_lo = ch * spans_per_chunk * kWarpSpan, c_hi = min(H, c_lo + spans_per_chunk * kWarpSpan);
        const bool last = ch == n_chunks - 1;
        const long long p_lo = payload_offset<FMT>(c_lo), p_hi = last ? pb : payload_offset<FMT>(c_hi);
        const int s_lo = FMT == kFmtBf16 ? 0 : int(sizeof(S)) * (c_lo / max(1, FormatTraits<FMT>::kBlock));
        const int s_hi = FMT == kFmtBf16 ? 0 : (last ? static_cast<int>(align_up(sb)) :
                                                int(sizeof(S)) * (c_hi / max(1, FormatTraits<FMT>::kBlock)));
        const T* x_row = static_cast<const T*>(a.x) + static_cast<long long>(t) * H;
        const bool shared = sh && t >= s_shared_lo && t < s_shared_lo + s_shared_n;
        const bool any = (book.words[rank * mask_stride + t / 32] >> (t % 32)) & 1u;  // a row of an expert here
        if (!any && ch == 0 && lane < K) local_choice_rows(ep)[t * K + lane] = -1;  // for the one-rank combine
        if (!any && !shared) continue;
        const uint8_t* payload;
        if constexpr (FMT == kFmtBf16 && sizeof(T) == 2) {
            payload = reinterpret_cast<const uint8_t*>(x_row);
        } else {
            encode_chunk<FMT, T>(x_row, c_lo, c_hi, H, s_payload, s_scales, a.global_scale, lane);
            payload = s_payload;
        }
        // the token's rows (lane k: choice k's row, or -1) and its row in the shared group (which starts at row 0)
        int row = -1, g = -1;
        if (lane < K) {
            const int e = book.expert[t * K + lane];
            if (e != kNoExpert) {
                g = sh + e - rank * L;
                row = static_cast<int>(s_offsets[g]) + book.pos[t * K + lane];
            }
        }
        const unsigned rows = __ballot_sync(0xffffffffu, row >= 0);
        const int srow = t - s_shared_lo;
        for (long long b = p_lo; b < p_hi; b += Vectors::kBytes) {
            const int n = static_cast<int>(min(static_cast<long long>(Vectors::kBytes), p_hi - b));
            Vectors v;
            v.load(payload + b, n, lane);
            for (unsigned rest = rows; rest; rest &= rest - 1)
                v.store(tokens + __shfl_sync(0xffffffffu, row, __ffs(rest) - 1) * pb + b, n, lane);
            if (shared) v.store(tokens + srow * pb + b, n, lane);
        }
        if (sb) {
            const int b_lo = s_lo / int(sizeof(S)), b_hi = last ? (1 << 30) : s_hi / int(sizeof(S));
            for (unsigned rest = rows; rest; rest &= rest - 1) {
                const int k = __ffs(rest) - 1;
                const long long rk = __shfl_sync(0xffffffffu, row, k);
                const int gk = __shfl_sync(0xffffffffu, g, k);
                const long long scale_row = kTiled ? swizzle_row(s_tiles, s_offsets, gk, rk) : rk;
                place_row_scales<FMT>(ep, a, rk, scale_row, s_scales, lane, kWarp, b_lo, b_hi);
            }
            if (shared) place_row_scales<FMT>(ep, a, srow, srow, s_scales, lane, kWarp, b_lo, b_hi);
        }
        if (ch == 0) {
            if (lane < K) local_choice_rows(ep)[t * K + lane] = row;
            const float w = lane < K && a.topk_weights ? a.topk_weights[static_cast<long long>(t) * K + lane] : 0.f;
            if (row >= 0) {
                a.src_info[2LL * row] = t;
                a.src_info[2LL * row + 1] = lane;
                a.row_src[row] = rank;
                a.row_weight[row] = w;
            }
            if (rows) {  // the token's message: the i-th token with a row here (the book's token mask)
                const unsigned* words = book.words + rank * mask_stride;
                int before = 0;
                for (int j = lane; j < t / 32; j += kWarp) before += __popc(words[j]);
                const long long mi = __reduce_add_sync(0xffffffffu, before) +  // source 0: the only one
                                     __popc(words[t / 32] & ((1u << (t % 32)) - 1u));
                if (lane < K) {
                    a.msg_rows[mi * K + lane] = row;
                    if (row >= 0) msg_weights(ep, a.msg_rows)[mi * K + lane] = w;
                }
                if (lane == 0) {
                    a.msg_token[mi] = t;
                    a.msg_j[mi] = 0;
                }
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
}

}  // namespace cuep
