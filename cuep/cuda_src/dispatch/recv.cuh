// Dispatch, phase 3 (receive): lay out row_offsets / expert_ids / scales_offsets from the tally rows alone, pad the
// groups, then take the messages as their chunk flags land: metadata and bookkeeping (src_info, row weights, the
// handle combine reads), scales, and the copies of the payload to the token's other local experts' rows. A large
// round's scales are gathered in whole lines at its end (scales.cuh).
#pragma once
#include "layout.cuh"
#include "scales.cuh"
#include "staged.cuh"

namespace cuep {

// Padding of group g (rows s_offsets[g] .. s_offsets[g + 1], the first `used` - s_offsets[g] of them real), by
// threads [first_thread, first_thread + threads) of the block (default: all of it): fp8 rows up to the group's
// multiple of 4 (zero payload and scales, src_info (-1, -1)); fp4 the scale rows of the group's last tile past its
// last row. `defer`: a large round notes the padding for gather_scales instead of storing its scales.
template <int FMT>
__device__ void pad_group(const EPParams& ep, const DispatchArgs& a, const unsigned* s_offsets, const unsigned* s_tiles,
                          int g, unsigned used, bool defer, int first_thread = 0, int threads = 0) {
    const int tid = static_cast<int>(threadIdx.x) - first_thread;
    const int nthr = threads ? threads : static_cast<int>(blockDim.x);
    const unsigned begin = s_offsets[g], end = s_offsets[g + 1];
    if constexpr (FMT == kFmtFp8) {
        char* tokens = ep.local(ep.off_tokens);
        const long long pb = ep.payload_bytes;
        for (unsigned row = used; row < end; ++row) {
            for (long long b = tid; b < pb / 16; b += nthr)
                reinterpret_cast<int4*>(tokens + row * pb)[b] = make_int4(0, 0, 0, 0);
            if (defer) {
                if (tid == 0) scale_rows(ep)[row] = kPadScales;
            } else {
                for (int b = tid; b < ep.n_scales; b += nthr) store_scale_word<true>(ep, a, row, row, b, 0u);
            }
            if (tid == 0) {
                a.src_info[2LL * row] = -1;
                a.src_info[2LL * row + 1] = -1;
                a.row_src[row] = -1;
                a.row_weight[row] = 0.f;
            }
        }
    } else if constexpr (FMT == kFmtNvfp4 || FMT == kFmtMxfp4) {
        // Only the rows a tile may still hold from earlier rounds are zeroed: a.scale_tile_rows[t] bounds the rows
        // of tile t that may be nonzero (the rest are zero), so the group's last tile needs rows m .. that bound
        // (m: the group's rows in it), and the tile's bound becomes m (its full tiles': 128). (Zeroing every
        // padding row, 124 of 128 at decode, was most of an N = 128 nvfp4 round's stores: 14 MB at H = 7168.)
        const unsigned n = used - begin, tiles = (n + kScaleTileRows - 1) / kScaleTileRows;
        if (tiles == 0) return;
        const unsigned last = s_tiles[g] + tiles - 1, m = n - (tiles - 1) * kScaleTileRows;
        uint8_t* bound = a.scale_tile_rows;
        for (unsigned i = tid; i + 1 < tiles; i += nthr) bound[s_tiles[g] + i] = kScaleTileRows;
        if (defer) {  // gather_scales writes the whole tile, its padding rows zero
            for (unsigned i = tid; i < kScaleTileRows - m; i += nthr)
                scale_rows(ep)[static_cast<long long>(last) * kScaleTileRows + m + i] = kPadScales;
            if (tid == 0) bound[last] = static_cast<uint8_t>(m);
            return;
        }
        const unsigned stale = bound[last];
        // every padding thread has read the bound before it is lowered (named barrier 1: the padding threads only)
        asm volatile("bar.sync 1, %0;" ::"r"(nthr) : "memory");
        if (tid == 0 && stale != m) bound[last] = static_cast<uint8_t>(m);
        if (stale <= m) return;
        // Rows m .. stale - 1 of each (tile, kt) 512-byte block: quad j holds rows j, j + 32, j + 64, j + 96 (word
        // q: row j + 32 q). Consecutive threads on the quads those rows touch (at most 32 a block); a quad of
        // padding rows only is one store, else its padding words go one by one (the item warps store the real
        // rows' words meanwhile).
        const int k_tiles = static_cast<int>(ep.k_tiles), quads = kScaleTileBytes / 16;
        const int span = static_cast<int>(min(stale - m, static_cast<unsigned>(quads)));
        uint4* tile = reinterpret_cast<uint4*>(static_cast<uint8_t*>(a.scales_out) +
                                               static_cast<long long>(last) * k_tiles * kScaleTileBytes);
        for (int i = tid; i < k_tiles * span; i += nthr) {
            const int kt = i / span, j = static_cast<int>((m + i % span) % quads);
            unsigned words = 0;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const unsigned row = static_cast<unsigned>(j + quads * q);
                if (row >= m && row < stale) words |= 1u << q;
            }
            uint4* quad = tile + kt * quads + j;
            if (words == 0xFu) {
                *quad = make_uint4(0u, 0u, 0u, 0u);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    if (words >> q & 1u) store_u32_evict_last(reinterpret_cast<uint32_t*>(quad) + q, 0u);
            }
        }
    } else {
        (void)tid, (void)nthr, (void)begin, (void)end;
    }
}

// recv: wait for every source, then lay the round out. Blocks [first_block, grid) take part (see dispatch_kernel).
template <int FMT>
__device__ void phase_recv(const EPParams& ep, const DispatchArgs& a, int round, char* smem, int first_block,
                           bool local_from_x) {
    const int block = static_cast<int>(blockIdx.x) - first_block, n_blocks = static_cast<int>(gridDim.x) - first_block;
    const int E = static_cast<int>(ep.n_experts), K = static_cast<int>(ep.top_k);
    const int L = static_cast<int>(ep.n_local), rank = static_cast<int>(ep.rank);
    const int n_src = static_cast<int>(ep.n_src), G = static_cast<int>(ep.n_groups);
    const int sh = static_cast<int>(ep.shared), me = static_cast<int>(ep.src_index);
    const int par = round & 1;
    const long long pb = ep.payload_bytes, T_max = ep.max_tokens;
    int* ctr = ep.counters();

    __shared__ int s_ok;
    __shared__ int s_scan[32];
    __shared__ int s_msg_count[kMaxRanks], s_msg_total, s_msg_most, s_all_staged;

    // The layout needs only the histograms (they arrive before any data); messages are then placed one by one
    // as their chunk flags land, so the copies below overlap the incoming stream.
    const int E1 = tally_len(ep);
    int* s_tally = reinterpret_cast<int*>(smem);
    unsigned* s_offsets = reinterpret_cast<unsigned*>(s_tally + n_src * E1);
    unsigned* s_tiles = s_offsets + align_up(G + 1, 4);
    uint16_t* s_msg_tok = reinterpret_cast<uint16_t*>(s_tiles + G);  // [n_src, small_tokens] (staged sources)
    const int S = static_cast<int>(ep.small_tokens);
    __shared__ unsigned s_tiles_end;
    if (!load_tallies(ep, round, s_tally, K_DISPATCH_RECV, &s_ok)) return;
    if (threadIdx.x == 0) {
        s_offsets[0] = 0;
        if (sh) s_offsets[1] = shared_rows(ep, s_tally, rank);
        s_msg_total = s_msg_most = 0;
        s_all_staged = 1;
        for (int s = 0; s < n_src; ++s) {
            s_msg_count[s] = s_tally[s * E1 + E + 1];
            s_msg_total += s_msg_count[s];
            s_msg_most = max(s_msg_most, s_msg_count[s]);
            s_all_staged &= staged_source(ep, s_tally, s) ? 1 : 0;
        }
    }
    // A staged source's messages: its tokens that come here, in token order (message i of source s is token
    // s_msg_tok[s * S + i]), from the token mask of its book row. A warp per source, 32 mask words per pass.
    {
        const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
        const uint32_t stamp = static_cast<uint32_t>(round) + 1;
        for (int s = threadIdx.x / kWarp; s < n_src; s += n_warps) {
            if (!staged_source(ep, s_tally, s)) continue;
            const uint64_t* row = book_row(ep, rank, par, s);
            const int n_words = (s_tally[s * E1 + E] + 31) / 32;
            int carry = 0;
            for (int w0 = 0; w0 < n_words; w0 += kWarp) {
                const int w = w0 + lane;
                uint32_t word = 0;
                if (w < n_words && !wait_stamped(ep, row + w, stamp, K_DISPATCH_RECV, s, word)) s_ok = 0;
                const int n = __popc(word);
                int incl = n;
                for (int o = 1; o < kWarp; o <<= 1) {
                    const int v = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += v;
                }
                for (int i = carry + incl - n; word; word &= word - 1, ++i)
                    s_msg_tok[s * S + i] = static_cast<uint16_t>(32 * w + __ffs(word) - 1);
                carry += __shfl_sync(0xffffffffu, incl, kWarp - 1);
            }
        }
    }
    __syncthreads();
    if (!s_ok) return;
    scan_rank_groups(ep, s_tally, rank, s_scan, [&](int, int l, int start, int size) {
        s_offsets[sh + l] = start;
        if (l == L - 1) s_offsets[sh + L] = start + size;
    });
    constexpr bool kTiled = FMT == kFmtNvfp4 || FMT == kFmtMxfp4;
    if (kTiled && threadIdx.x < kWarp) scan_scale_tiles(s_offsets, G, s_tiles, &s_tiles_end);
    __syncthreads();
    if (block == 0) {
        for (int g = threadIdx.x; g <= G; g += blockDim.x) {
            a.row_offsets[g] = s_offsets[g];
            if (g < G) {
                a.expert_ids[g] = sh ? (g == 0 ? L : g - 1) : g;
                if (kTiled && a.scales_offsets) a.scales_offsets[g] = s_tiles[g] - s_offsets[g] / kScaleTileRows;
            }
        }
        if (threadIdx.x < n_src) a.msg_count[threadIdx.x] = s_tally[threadIdx.x * E1 + E + 1];
    }

    // Messages, one warp each: metadata, scales, and the copies for the other local experts the token chose.
    char* tokens = ep.local(ep.off_tokens);
    const int total = s_msg_total;
    const int lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    // Work items are (message, chunk of the payload): the first chunk also places the metadata and scales,
    // every chunk copies its part of the payload to the token's other local experts' rows.
    // Bytes of payload per work item: at most 2 KiB when messages outnumber the warps (prefill; measured: whole
    // 14 KiB rows per warp left the fan-out 30% slower on H100 than 2 KiB chunks); otherwise one item per warp
    // (decode: with 2 KiB chunks a warp placed a second item after its first, 4 us of a 2-GPU N = 128 dispatch).
    const long long recv_warps = static_cast<long long>(n_blocks) * n_warps;
    const long long kFanoutChunk = total <= recv_warps ? chunk_units(total, pb, kWarp * 16, recv_warps)
                                                       : min(chunk_units(total, pb, kWarp * 16, recv_warps),
                                                             2048LL);
    using FanoutVectors = WarpVectors<4>;  // the chunk goes through registers 2 KiB at a time
    const int n_chunks = static_cast<int>((pb + kFanoutChunk - 1) / kFanoutChunk);
    // Items are claimed in order with an atomic (lane 0), so blocks that finish sending early, or receive-only
    // blocks, take whatever is next: the fan-out follows the incoming stream. The order interleaves the sources
    // (message slots fill in roughly the order the senders send), so no warp waits for one source while messages
    // of the others have landed (in source order: 4 x H200 fused dispatch 615 us against a 506 us send half).
    // A round whose sources were all staged (decode) has about one item per warp: warp w takes items w, w + warps,
    // ... (consecutive items on different SMs), with no atomics. The counter is this round's parity's; the other
    // parity's was last used by the previous round (an earlier launch) and is zeroed here for the next.
    const bool all_staged = s_all_staged != 0;
    const int recv_warp = (threadIdx.x / kWarp) * n_blocks + block, n_recv_warps = n_blocks * n_warps;
    int* next_item = ctr + C_RECV_ITEM + par;
    if (block == 0 && threadIdx.x == 0) ctr[C_RECV_ITEM + (par ^ 1)] = ctr[C_RECV_NOTED + (par ^ 1)] = 0;
    // A large round's scales are gathered from the messages at its end (gather_scales) once they span
    // kGatherScalesFrom bytes. (The fused shared
    // expert's rows, group 0, are placed by the send phase, directly.)
    const long long scale_out_bytes = kTiled ? static_cast<long long>(s_tiles_end) * kScaleTileRows * ep.k_tiles * 4
                                             : static_cast<long long>(s_offsets[G]) * ep.n_scales * 4;
    const bool defer = FMT != kFmtBf16 && ep.scale_bytes && !all_staged &&
                       scale_out_bytes >= kGatherScalesFrom;
    auto claim = [&](int prev) {
        if (all_staged) return prev < 0 ? recv_warp : prev + n_recv_warps;
        return __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(next_item, 1) : 0, 0);
    };
    // Padding: fp8 rows up to each group's multiple of 4; fp4 scale tiles past each group's last row. Before the
    // messages: it needs only the layout, so it fills the wait for the first flags (at decode the receive blocks
    // wait several microseconds for the first message; padding after the messages was on the round's critical path).
    for (int g = block; g < G; g += n_blocks) {
        unsigned used;
        if (sh && g == 0) used = shared_tokens(ep, s_tally, rank);
        else {
            int n = 0;
            for (int s = 0; s < n_src; ++s) n += s_tally[s * E1 + rank * L + (g - sh)];
            used = s_offsets[g] + n;
        }
        pad_group<FMT>(ep, a, s_offsets, s_tiles, g, used, defer && g >= sh);
    }
    const SourceInterleave order{s_msg_count, n_src, n_chunks, 0, n_src * s_msg_most * n_chunks};
    for (int item = claim(-1); item < order.n_items; item = claim(item)) {
        int s, i, ch;
        if (!order.at(item, s, i, ch)) continue;
        // A small round's message sits in the staging area (record t for token t) and its rows in the source's book
        // row, which block 0 publishes while the data move: the rows and the bookkeeping outputs (but the weights,
        // which ride in the record's metadata) are done before the payload's flags are waited for, so mostly the
        // copies follow it. A large round's metadata is in the meta region and its payload already in the row of
        // the token's first local expert: everything waits for the flags.
        const bool staged = staged_source(ep, s_tally, s);
        const char* meta = message_meta(ep, rank, staged, par, s, staged ? s_msg_tok[s * S + i] : i);
        // local_from_x: my own tokens come from x (bf16, this launch's input), not from a staged record: their
        // fan-out need not wait for the NVLink stores' fence, so it overlaps the incoming stream
        const bool from_x = local_from_x && staged && s == me;
        auto wait_payload = [&]() {
            if (from_x) return true;
            const bool ok = warp_wait_chunk_flags(message_flags(ep, meta), message_flag_count(ep), round, ep,
                                                  K_DISPATCH_RECV, s, lane);
            return ok;
        };
        int t, id = -1, row = -1;
        float w = 0.f;
        if (staged) {
            t = s_msg_tok[s * S + i];
            bool ok = true;
            if (lane < K) {
                const uint64_t* book = book_row(ep, rank, par, s) + book_mask_words(ep);
                const long long c = static_cast<long long>(t) * K + lane;
                const uint32_t stamp = static_cast<uint32_t>(round) + 1;
                uint32_t v = 0;
                ok = wait_stamped(ep, book + c, stamp, K_DISPATCH_RECV, s, v);
                id = static_cast<int>(v & 0xFFFFu);
                if (id != kNoExpert && id / L == rank)
                    row = s_offsets[sh + id - rank * L] + rows_before(ep, s_tally, s, id) + static_cast<int>(v >> 16);
            }
            if (!__all_sync(0xffffffffu, ok)) break;
        } else {
            if (!wait_payload()) break;
            t = *reinterpret_cast<const int*>(meta);
            if (lane < K) {
                id = reinterpret_cast<const uint16_t*>(meta + ep.meta_ids)[lane];
                row = reinterpret_cast<const int*>(meta + ep.meta_rows)[lane];
                w = reinterpret_cast<const float*>(meta + ep.meta_w)[lane];
            }
        }
        const uint8_t* scales = reinterpret_cast<const uint8_t*>(meta + ep.meta_scales);
        const int src_rank = ep.skip_a2a ? rank : s;
        const long long mi = s * T_max + i;
        unsigned local = __ballot_sync(0xffffffffu, row >= 0);
        const int first = local ? __ffs(local) - 1 : 0;
        const int first_row = __shfl_sync(0xffffffffu, row, first);
        // the payload's source, and the local rows it still has to reach (staged: all of them)
        const char* payload = from_x   ? static_cast<const char*>(a.x) + static_cast<long long>(t) * pb
                              : staged ? staged_payload(ep, meta)
                                       : tokens + first_row * pb;
        const unsigned copy_to = from_x ? local : staged ? local : local & (local - 1);
        // This chunk of the payload to every row it still has to reach, 2 KiB at a time: loaded once into
        // registers, stored to each row (a copy per row re-loaded it behind the previous row's stores).
        auto fan_out = [&]() {
            const long long off = static_cast<long long>(ch) * kFanoutChunk;
            const int n = static_cast<int>(min(kFanoutChunk, pb - off));
            for (int b = 0; copy_to && b < n; b += FanoutVectors::kBytes) {
                const int nb = min(FanoutVectors::kBytes, n - b);
                FanoutVectors v;
                v.load(payload + off + b, nb, lane);
                for (unsigned rest = copy_to; rest; rest &= rest - 1)
                    v.store(tokens + __shfl_sync(0xffffffffu, row, __ffs(rest) - 1) * pb + off + b, nb, lane);
            }
        };
        if (ch != 0) {  // payload chunk only
            if (staged && !wait_payload()) break;
            fan_out();
            continue;
        }
        if (lane < K) a.msg_rows[mi * K + lane] = row;
        if (lane < K && row >= 0) {
            a.src_info[2LL * row] = t;
            a.src_info[2LL * row + 1] = lane;
            a.row_src[row] = src_rank;
            if (!staged) {  // staged: the weight rides with the payload (below)
                a.row_weight[row] = w;
                msg_weights(ep, a.msg_rows)[mi * K + lane] = w;
            }
        }
        // My position among the token's destination ranks in top-k order (its partial-sum slot in combine):
        // the number of distinct ranks of valid choices whose first choice comes before mine. All lanes shuffle.
        const bool repeat = warp_repeats_earlier(id, lane, K);
        const bool valid = lane < K && id < E && !repeat;
        const unsigned valid_mask = __ballot_sync(0xffffffffu, valid);
        const bool is_new_rank = !ep.skip_a2a && warp_first_of_rank(id / L, valid_mask, lane, K);
        const unsigned new_ranks = __ballot_sync(0xffffffffu, is_new_rank && lane < first);
        if (lane == 0) {
            a.msg_token[mi] = t;
            a.msg_j[mi] = __popc(new_ranks);
        }
        if (staged) {
            if (!wait_payload()) break;
            if (lane < K && row >= 0) {
                const float wm = !from_x          ? reinterpret_cast<const float*>(meta + ep.meta_w)[lane]
                                 : a.topk_weights ? a.topk_weights[static_cast<long long>(t) * K + lane]
                                                  : 0.f;
                a.row_weight[row] = wm;
                msg_weights(ep, a.msg_rows)[mi * K + lane] = wm;
            }
        }
        if (ep.scale_bytes) {
            auto row_of = [&](int k, long long& rk, long long& srow) {
                rk = __shfl_sync(0xffffffffu, row, k);
                const int g = sh + __shfl_sync(0xffffffffu, id, k) - rank * L;
                srow = kTiled ? swizzle_row(s_tiles, s_offsets, g, rk) : rk;
            };
            if (!defer) {
                place_token_scales<FMT>(ep, a, local, row_of, scales, lane);
            } else {
                for (unsigned rest = local; rest; rest &= rest - 1) {
                    long long rk, srow;
                    row_of(__ffs(rest) - 1, rk, srow);
                    if (lane == 0) scale_rows(ep)[srow] = scale_ref(ep, scales);
                }
            }
        }
        fan_out();
    }

    // The scales, once every receive block has noted its rows' (and padding's): the rows after the shared expert's
    // (fp8) or their scale tiles (fp4), in whole lines.
    if (defer) {
        if (!blocks_barrier(ep, ctr + C_RECV_NOTED + par, n_blocks, K_DISPATCH_RECV, &s_ok)) return;
        const unsigned lo = kTiled ? s_tiles[sh] : s_offsets[sh], hi = kTiled ? s_tiles_end : s_offsets[G];
        gather_scales<FMT>(ep, a, lo, hi, recv_warp, n_recv_warps, lane);
    }

    // The round ends here: the chunk flags need no re-arming, and the block that entered last advances the round
    // (dispatch_kernel). (The end-of-round count and re-arm took 2 us of a 2-GPU decode dispatch, 8 us of a
    // prefill one.)
}

}  // namespace cuep
