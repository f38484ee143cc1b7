// Multi-node dispatch: send (encode once, one put per remote node, header, own_ready), relay (a forwarder
// republishes each remote node's complete round for its node peers), count, offsets, place (docs/internode.md).
#pragma once
#include "node_common.cuh"

namespace cuep {
namespace node {

// ================================================================================================================
// dispatch: send
// ================================================================================================================
template <int FMT, class X>
__device__ void dispatch_send(const DispatchCall& c) {
    const NodeParams& p = c.p;
    const NodeDispatchArgs& a = c.a;
    if (failed(p)) return;
    const long long q = state(p)[S_DROUND];
    const int par = static_cast<int>(q & 1);
    const int K = static_cast<int>(p.top_k), E = static_cast<int>(p.n_experts), H = static_cast<int>(p.hidden);
    const int G = static_cast<int>(p.gpus_per_node), M = static_cast<int>(p.n_nodes);
    const int me_node = static_cast<int>(p.node);
    const long long T = p.max_tokens;
    char* hdr = reinterpret_cast<char*>(p.heap + p.off_hdr_send + par * p.hdr_bytes);
    char* rows = reinterpret_cast<char*>(p.heap + p.off_x_send + par * T * p.row_bytes);
    const int lane = lane_id();
    using S = typename FormatTraits<FMT>::Scale;
    const bool direct = is_direct(p, a.num_tokens) && !p.skip_a2a;
    for (long long t = global_warp(); t < a.num_tokens; t += n_global_warps()) {
        uint8_t* row = reinterpret_cast<uint8_t*>(rows + t * p.row_bytes);
        const X* x_row = reinterpret_cast<const X*>(a.x) + t * H;
        if constexpr (FMT == kFmtBf16 && sizeof(X) == 2) {
            warp_copy16(row, x_row, 2LL * H, lane);
        } else {
            const RowSource<X> src{x_row};
            const RowScales<S> sink{reinterpret_cast<S*>(row + p.payload_bytes)};
            for (int col0 = 0; col0 < H; col0 += kWarpSpan) {
                if constexpr (FMT == kFmtBf16)
                    warp_quantize_span<FMT, 1>(src, col0, H, row, NoScales{}, a.global_scale, lane);
                else
                    warp_quantize_span<FMT, 1>(src, col0, H, row, sink, a.global_scale, lane);
            }
        }
        const int* ids = a.topk_ids + t * K;
        unsigned nodes = 0;
        int dst_rank = -1;  // a small round: lane k's rank on another node, unless an earlier lane has it
        if (lane < K) {
            int* hid = const_cast<int*>(hdr_ids(hdr, t, K));
            float* hw = const_cast<float*>(hdr_weights(hdr, t, K));
            hid[lane] = ids[lane];
            hw[lane] = a.topk_weights ? a.topk_weights[t * K + lane] : 0.f;
            if (valid_choice(ids, lane, K, E)) {
                const int r = rank_of_expert(p, ids[lane]);
                nodes = 1u << node_of_rank(p, r);
                if (direct && node_of_rank(p, r) != me_node) {
                    dst_rank = r;
                    for (int j = 0; j < lane; ++j)
                        if (valid_choice(ids, j, K, E) && rank_of_expert(p, ids[j]) == r) dst_rank = -1;
                }
            } else {
                const int e = ids[lane];
                report(p, (e < 0 || e >= E) ? 2 : 3, K_SEND, e, static_cast<int>(t));
            }
        }
        nodes = p.skip_a2a ? 0u : __reduce_or_sync(0xffffffffu, nodes) & ~(1u << me_node);
        if (direct) {  // straight to each rank on another node that holds one of its experts
            unsigned dsts = __ballot_sync(0xffffffffu, dst_rank >= 0);
            if (dsts) {
                __threadfence_system();
                __syncwarp();
            }
            for (; dsts; dsts &= dsts - 1) {
                const int r = __shfl_sync(0xffffffffu, dst_rank, __ffs(dsts) - 1);
                char* dst = const_cast<char*>(direct_rows(p, static_cast<int>(p.rank), par)) + t * p.row_bytes;
                nvshmemx_putmem_signal_nbi_warp(dst, row, p.row_bytes, sigs(p, p.heap) + sig_direct(p, par, static_cast<int>(p.rank)),
                                                1, NVSHMEM_SIGNAL_ADD, r);
            }
        } else if (nodes) {
            __threadfence_system();  // the row's stores, before the transport reads them
            __syncwarp();
            for (int m = 0; m < M; ++m) {
                if (!((nodes >> m) & 1u)) continue;
                char* dst = reinterpret_cast<char*>(p.heap + p.off_x_recv +
                                                    ((static_cast<long long>(par) * M + me_node) * T + t) * p.row_bytes);
                nvshmemx_putmem_signal_nbi_warp(dst, row, p.row_bytes, sigs(p, p.heap) + sig_rows(p, par, me_node), 1,
                                                NVSHMEM_SIGNAL_ADD, m * G + static_cast<int>(p.local));
            }
        }
    }
    if (last_block(p, D_SEND)) {  // the header to every other node (a warp each), then "my rows are here"
        if (threadIdx.x == 0) *reinterpret_cast<int*>(hdr) = a.num_tokens;
        __threadfence_system();
        __syncthreads();
        const size_t bytes = 16 + static_cast<size_t>(a.num_tokens) * 8 * K;
        for (int m = threadIdx.x / kWarp; m < M && !p.skip_a2a; m += blockDim.x / kWarp) {
            if (m == me_node) continue;
            char* dst = reinterpret_cast<char*>(p.heap + p.off_hdr_recv + (static_cast<long long>(par) * M + me_node) * p.hdr_bytes);
            nvshmemx_putmem_signal_nbi_warp(dst, hdr, bytes, sigs(p, p.heap) + sig_hdr(p, par, me_node),
                                            static_cast<uint64_t>(q + 1), NVSHMEM_SIGNAL_SET,
                                            m * G + static_cast<int>(p.local));
        }
        if (threadIdx.x == 0) {
            store_release_u64(sigs(p, p.heap) + sig_own(p, par), static_cast<uint64_t>(q + 1));
            *reinterpret_cast<volatile long long*>(state(p) + S_DROUND) = q + 1;
        }
    }
}

// ================================================================================================================
// dispatch: relay (a forwarder), count, offsets, place
// ================================================================================================================
__device__ void dispatch_relay(const DispatchCall& c) {
    const NodeParams& p = c.p;
    if (failed(p)) return;
    const long long q = state(p)[S_DROUND] - 1;
    const int par = static_cast<int>(q & 1);
    const int K = static_cast<int>(p.top_k), E = static_cast<int>(p.n_experts);
    const int M = static_cast<int>(p.n_nodes), G = static_cast<int>(p.gpus_per_node);
    const int lane = lane_id();
    const int n = global_warp();
    if (n >= M || n == p.node || p.skip_a2a) return;
    uint64_t* sg = sigs(p, p.heap);
    const int src = n * G + static_cast<int>(p.local);
    int ok = 1;
    if (lane == 0) ok = wait_put_signal(p, sg + sig_hdr(p, par, n), static_cast<uint64_t>(q + 1), K_RELAY, src);
    if (!__shfl_sync(0xffffffffu, ok, 0)) return;
    __syncwarp();
    const char* hdr = reinterpret_cast<const char*>(p.heap + p.off_hdr_recv + (static_cast<long long>(par) * M + n) * p.hdr_bytes);
    const int n_tok = hdr_n(hdr);
    int rows = 0;
    for (int t0 = is_direct(p, n_tok) ? n_tok : 0; t0 < n_tok; t0 += kWarp) {  // a small round: no rows here
        const int t = t0 + lane;
        bool here = false;
        if (t < n_tok) {
            const int* ids = hdr_ids(hdr, t, K);
            for (int k = 0; k < K; ++k)
                here |= valid_choice(ids, k, K, E) && node_of_rank(p, rank_of_expert(p, ids[k])) == p.node;
        }
        rows += __popc(__ballot_sync(0xffffffffu, here));
    }
    if (lane == 0) {
        long long* expect = state(p) + S_EXP_ROWS + par * M + n;
        const long long want = *expect + rows;
        *expect = want;
        if (wait_put_signal(p, sg + sig_rows(p, par, n), static_cast<uint64_t>(want), K_RELAY, src))
            store_release_u64(sg + sig_relay(p, par, n), static_cast<uint64_t>(q + 1));
    }
}

// Rows per (source, chunk, local expert): one warp per (source, chunk), a histogram in shared memory per warp.
__device__ void dispatch_count(const DispatchCall& c) {
    extern __shared__ int s_hist_all[];
    const NodeParams& p = c.p;
    if (failed(p)) return;
    const long long q = state(p)[S_DROUND] - 1;
    const int par = static_cast<int>(q & 1);
    const int K = static_cast<int>(p.top_k), E = static_cast<int>(p.n_experts), L = static_cast<int>(p.n_local);
    const int R = static_cast<int>(p.n_ranks), NC = static_cast<int>(p.n_chunks);
    const int lane = lane_id();
    int* s_hist = s_hist_all + (threadIdx.x / kWarp) * L;
    for (int u = global_warp(); u < R * NC; u += n_global_warps()) {
        const int s = u / NC, ch = u % NC;
        if (p.skip_a2a && s != p.rank) {  // skip_a2a: only my own tokens
            if (ch == 0 && lane == 0) scr_src_n(p)[s] = 0;
            for (int l = lane; l < L; l += kWarp) scr_cnt(p)[static_cast<long long>(u) * L + l] = 0;
            continue;
        }
        const SourceView v = source_view(p, s, par);
        int ok = 1;
        if (lane == 0) ok = wait_ge(p, v.ready, static_cast<uint64_t>(q + 1), K_RECV, s);
        if (!__shfl_sync(0xffffffffu, ok, 0)) return;
        __syncwarp();
        const int n_tok = hdr_n(v.hdr);
        if (ch == 0 && v.remote && is_direct(p, n_tok)) {  // a small round's rows come straight here: wait for them
            int rows = 0;
            for (int t0 = 0; t0 < n_tok; t0 += kWarp) {
                const int t = t0 + lane;
                bool mine = false;
                if (t < n_tok) {
                    const int* ids = hdr_ids(v.hdr, t, K);
                    for (int k = 0; k < K; ++k) mine |= valid_choice(ids, k, K, E) && rank_of_expert(p, ids[k]) == p.rank;
                }
                rows += __popc(__ballot_sync(0xffffffffu, mine));
            }
            if (lane == 0) {
                long long* expect = exp_direct(p) + par * p.n_ranks + s;
                *expect += rows;
                ok = wait_put_signal(p, sigs(p, p.heap) + sig_direct(p, par, s), static_cast<uint64_t>(*expect),
                                     K_RECV, s);
            }
            if (!__shfl_sync(0xffffffffu, ok, 0)) return;
            __syncwarp();
        }
        if (ch == 0 && lane == 0) scr_src_n(p)[s] = n_tok;
        for (int l = lane; l < L; l += kWarp) s_hist[l] = 0;
        __syncwarp();
        const int t_end = min(n_tok, (ch + 1) * kChunk);
        for (int t = ch * kChunk + lane; t < t_end; t += kWarp) {
            const int* ids = hdr_ids(v.hdr, t, K);
            for (int k = 0; k < K; ++k)
                if (valid_choice(ids, k, K, E) && rank_of_expert(p, ids[k]) == p.rank) atomicAdd(s_hist + ids[k] % L, 1);
        }
        __syncwarp();
        int* cnt = scr_cnt(p) + static_cast<long long>(u) * L;
        for (int l = lane; l < L; l += kWarp) cnt[l] = s_hist[l];
        __syncwarp();
    }
}

// One block: group sizes (padded), row offsets, expert ids, fp4 tile starts and scales_offsets, and the first row
// of every (source, chunk, local expert) block: sources in rank order inside a group, chunks in token order.
__device__ void dispatch_offsets(const DispatchCall& c) {
    __shared__ int s_scan[32];
    const NodeParams& p = c.p;
    const NodeDispatchArgs& a = c.a;
    if (failed(p) || blockIdx.x != 0) return;
    const int L = static_cast<int>(p.n_local), R = static_cast<int>(p.n_ranks), NC = static_cast<int>(p.n_chunks);
    const int sh = static_cast<int>(p.shared), n_groups = static_cast<int>(p.n_groups);
    const long long align = p.row_align;
    const int* cnt = scr_cnt(p);
    int* base = scr_base(p);
    int* tile_start = scr_tile_start(p);
    int carry = 0, tiles = 0;
    for (int g0 = 0; g0 < n_groups; g0 += blockDim.x) {
        const int g = g0 + threadIdx.x;
        int size = 0;
        if (g < n_groups) {
            long long n = 0;
            if (sh && g == 0) {
                n = shared_hi(p, a.num_tokens) - shared_lo(p, a.num_tokens);
            } else if (g < n_groups) {
                const int l = g - sh;
                for (int u = 0; u < R * NC; ++u) n += cnt[static_cast<long long>(u) * L + l];
            }
            size = static_cast<int>((n + align - 1) / align * align);
        }
        int total, ttotal;
        const int incl = block_inclusive_scan(size, s_scan, &total);
        const int tl = (size + kScaleTileRows - 1) / kScaleTileRows;
        const int tincl = block_inclusive_scan(tl, s_scan, &ttotal);
        if (g < n_groups) {
            const int start = carry + incl - size;
            a.row_offsets[g] = static_cast<unsigned>(start);
            a.expert_ids[g] = (sh && g == 0) ? L : g - sh;
            const int ts = tiles + tincl - tl;
            tile_start[g] = ts;
            if (a.scales_offsets) a.scales_offsets[g] = static_cast<unsigned>(ts - start / kScaleTileRows);
            if (!(sh && g == 0)) {  // the first row of each (source, chunk) block of local expert l
                const int l = g - sh;
                int at = start;
                for (int u = 0; u < R * NC; ++u) {
                    base[static_cast<long long>(u) * L + l] = at;
                    at += cnt[static_cast<long long>(u) * L + l];
                }
            }
        }
        carry += total;
        tiles += ttotal;
    }
    if (threadIdx.x == 0) a.row_offsets[n_groups] = static_cast<unsigned>(carry);
}

// One row's scales (plain per-row bytes `src`) into the output layout at output row `row` of group g.
template <int FMT>
__device__ __forceinline__ void place_scales(const NodeParams& p, const NodeDispatchArgs& a, long long row, int g,
                                             const uint8_t* src, int lane) {
    const int n_scales = static_cast<int>(p.n_scales);
    if constexpr (FMT == kFmtFp8) {
        float* out = static_cast<float*>(a.scales_out);
        for (int b = lane; b < n_scales; b += kWarp)
            out[static_cast<long long>(b) * p.capacity + row] = src ? reinterpret_cast<const float*>(src)[b] : 0.f;
    } else if constexpr (FMT == kFmtNvfp4 || FMT == kFmtMxfp4) {
        uint8_t* out = static_cast<uint8_t*>(a.scales_out);
        const int k_tiles = static_cast<int>(p.k_tiles);
        const long long scale_row = static_cast<long long>(scr_tile_start(p)[g]) * kScaleTileRows +
                                    (row - static_cast<long long>(a.row_offsets[g]));
        for (int col = lane; col < k_tiles * kScaleTileCols; col += kWarp)
            out[swizzled_scale_offset(scale_row, col, k_tiles)] = (src && col < n_scales) ? src[col] : uint8_t(0);
    }
}

// Copy one row (payload, scales) from a source row to output row `row` of group g, and its bookkeeping.
template <int FMT>
__device__ __forceinline__ void place_row(const NodeParams& p, const NodeDispatchArgs& a, const char* src_row,
                                          long long row, int g, int s, int t, int k, int lane) {
    warp_copy16(a.tokens + row * p.payload_bytes, src_row, p.payload_bytes, lane);
    if constexpr (FMT != kFmtBf16)
        place_scales<FMT>(p, a, row, g, reinterpret_cast<const uint8_t*>(src_row) + p.payload_bytes, lane);
    if (lane == 0) {
        a.src_info[2 * row] = t;
        a.src_info[2 * row + 1] = k;
        a.row_src[row] = s;
    }
}

// Work units: (source, chunk) for the routed rows, then (chunk) of my own tokens for the shared expert's group,
// then one per group for its padding (fp8 rows past a group's end, fp4 scale-tile rows past it).
template <int FMT>
__device__ void dispatch_place(const DispatchCall& c) {
    extern __shared__ int s_next_all[];
    const NodeParams& p = c.p;
    const NodeDispatchArgs& a = c.a;
    if (failed(p)) return;
    const long long q = state(p)[S_DROUND] - 1;
    const int par = static_cast<int>(q & 1);
    const int K = static_cast<int>(p.top_k), E = static_cast<int>(p.n_experts), L = static_cast<int>(p.n_local);
    const int R = static_cast<int>(p.n_ranks), NC = static_cast<int>(p.n_chunks), sh = static_cast<int>(p.shared);
    const int n_groups = static_cast<int>(p.n_groups);
    const long long T = p.max_tokens;
    const int lane = lane_id();
    int* s_next = s_next_all + (threadIdx.x / kWarp) * L;
    int* row_of = reinterpret_cast<int*>(p.row_of_ptr);
    const int n_routed = R * NC, n_shared = sh ? NC : 0;
    for (int u = global_warp(); u < n_routed + n_shared + n_groups; u += n_global_warps()) {
        if (u < n_routed) {
            const int s = u / NC, ch = u % NC;
            const SourceView v = source_view(p, s, par);  // ready: count waited for it
            const int n_tok = scr_src_n(p)[s];
            const int* base = scr_base(p) + static_cast<long long>(u) * L;
            for (int l = lane; l < L; l += kWarp) s_next[l] = base[l];
            __syncwarp();
            const int t_end = min(n_tok, (ch + 1) * kChunk);
            for (int t = ch * kChunk; t < t_end; ++t) {
                const int* ids = hdr_ids(v.hdr, t, K);
                int row = -1;
                if (lane < K && valid_choice(ids, lane, K, E) && rank_of_expert(p, ids[lane]) == p.rank) {
                    row = s_next[ids[lane] % L];
                    s_next[ids[lane] % L] = row + 1;  // distinct experts: one lane per l
                }
                unsigned mine = __ballot_sync(0xffffffffu, row >= 0);
                const char* src_row = source_rows(p, v, s, par, n_tok) + static_cast<long long>(t) * p.row_bytes;
                while (mine) {
                    const int k = __ffs(mine) - 1;
                    mine &= mine - 1;
                    const int r = __shfl_sync(0xffffffffu, row, k);
                    const int l = __shfl_sync(0xffffffffu, lane < K ? ids[lane] % L : 0, k);
                    place_row<FMT>(p, a, src_row, r, l + sh, s, t, k, lane);
                    if (lane == 0) row_of[(static_cast<long long>(s) * T + t) * K + k] = r;
                }
                __syncwarp();
            }
        } else if (u < n_routed + n_shared) {  // shared expert: my tokens lo .. hi-1 in order, rows 0.. of group 0
            const int ch = u - n_routed;
            const char* rows = reinterpret_cast<const char*>(p.heap + p.off_x_send + par * T * p.row_bytes);
            const int lo = shared_lo(p, a.num_tokens), hi = shared_hi(p, a.num_tokens);
            const int t_end = min(hi, lo + (ch + 1) * kChunk);
            for (int t = lo + ch * kChunk; t < t_end; ++t)
                place_row<FMT>(p, a, rows + static_cast<long long>(t) * p.row_bytes, t - lo, 0,
                               static_cast<int>(p.rank), t, K, lane);
        } else {  // padding of group g
            const int g = u - n_routed - n_shared;
            const long long lo = a.row_offsets[g], hi = a.row_offsets[g + 1];
            long long used = 0;
            if (sh && g == 0) {
                used = shared_hi(p, a.num_tokens) - shared_lo(p, a.num_tokens);
            } else {
                for (int w = 0; w < n_routed; ++w) used += scr_cnt(p)[static_cast<long long>(w) * L + (g - sh)];
            }
            for (long long r = lo + used; r < hi; ++r) {  // fp8 row padding: zero payload and scales
                for (long long b = lane; b < p.payload_bytes; b += kWarp) a.tokens[r * p.payload_bytes + b] = 0;
                place_scales<FMT>(p, a, r, g, nullptr, lane);
                if (lane == 0) {
                    a.src_info[2 * r] = -1;
                    a.src_info[2 * r + 1] = -1;
                    a.row_src[r] = -1;
                }
            }
            if constexpr (FMT == kFmtNvfp4 || FMT == kFmtMxfp4) {  // scale-tile rows past the group's end
                const long long n_rows = hi - lo, tiles = (n_rows + kScaleTileRows - 1) / kScaleTileRows;
                for (long long r = lo + n_rows; r < lo + tiles * kScaleTileRows; ++r) place_scales<FMT>(p, a, r, g, nullptr, lane);
            }
        }
    }
}

}  // namespace node
}  // namespace cuep
