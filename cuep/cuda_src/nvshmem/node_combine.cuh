// Multi-node combine: send (partial sums or rows into the forwarder's stage on this node), relay (a forwarder
// sums and puts one row per token and node back), recv (the source sums the nodes' rows) (docs/internode.md).
#pragma once
#include "node_common.cuh"

namespace cuep {
namespace node {

// ================================================================================================================
// combine
// ================================================================================================================
template <class C>
__device__ __forceinline__ float to_f32(C v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<uint16_t>(uint16_t v) { return __uint_as_float(static_cast<unsigned>(v) << 16); }
template <class C>
__device__ __forceinline__ C from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ uint16_t from_f32<uint16_t>(float v) { return static_cast<uint16_t>(bf16_encode(v)); }

// Per (source, token): my partial sum (kPartial) or my rows (otherwise) into the token's forwarder's stage.
template <class C>
__device__ void combine_send(const CombineCall& c) {
    extern __shared__ int s_prefix[];  // [R + 1] token prefix over sources
    const NodeParams& p = c.p;
    const NodeCombineArgs& a = c.a;
    if (failed(p)) return;
    const long long q = state(p)[S_CROUND];
    const int cpar = static_cast<int>(q & 1);
    const int dpar = static_cast<int>((state(p)[S_DROUND] - 1) & 1);
    const int K = static_cast<int>(p.top_k), E = static_cast<int>(p.n_experts), H = static_cast<int>(p.hidden);
    const int R = static_cast<int>(p.n_ranks), G = static_cast<int>(p.gpus_per_node), M = static_cast<int>(p.n_nodes);
    const long long T = p.max_tokens;
    const int lane = lane_id();
    if (threadIdx.x == 0) {
        int at = 0;
        for (int s = 0; s < R; ++s) {
            s_prefix[s] = at;
            at += scr_src_n(p)[s];
        }
        s_prefix[R] = at;
    }
    __syncthreads();
    const int* row_of = reinterpret_cast<const int*>(p.row_of_ptr);
    const C* eo = static_cast<const C*>(a.expert_out);
    for (int item = global_warp(); item < s_prefix[R]; item += n_global_warps()) {
        int s = 0;
        while (s_prefix[s + 1] <= item) ++s;
        const int t = item - s_prefix[s];
        const SourceView v = source_view(p, s, dpar);
        const int* ids = hdr_ids(v.hdr, t, K);
        bool here = false, on_node = false;
        int grank = 0;
        if (lane < K && valid_choice(ids, lane, K, E)) {
            const int r = rank_of_expert(p, ids[lane]);
            here = r == p.rank;
            on_node = node_of_rank(p, r) == p.node;
            grank = on_node ? 1 << (r % G) : 0;
        }
        const unsigned mine = __ballot_sync(0xffffffffu, here);
        if (!mine) continue;
        const unsigned node_ranks = __reduce_or_sync(0xffffffffu, static_cast<unsigned>(grank));
        const int f = s % G, n = s / G;
        C* stage = reinterpret_cast<C*>(p.node_heap[f] + p.off_stage) +
                   ((static_cast<long long>(cpar) * M + n) * T + t) * K * H;
        if (a.mode == kPartial) {
            const int slot = __popc(node_ranks & ((1u << p.local) - 1u));
            const float* w = hdr_weights(v.hdr, t, K);
            for (int col = lane; col < H; col += kWarp) {
                float acc = 0.f;
                for (unsigned m = mine; m; m &= m - 1) {
                    const int k = __ffs(m) - 1;
                    const long long row = row_of[(static_cast<long long>(s) * T + t) * K + k];
                    acc = __fadd_rn(acc, __fmul_rn(w[k], to_f32<C>(eo[row * H + col])));
                }
                stage[static_cast<long long>(slot) * H + col] = from_f32<C>(acc);
            }
        } else {
            for (unsigned m = mine; m; m &= m - 1) {
                const int k = __ffs(m) - 1;
                const long long row = row_of[(static_cast<long long>(s) * T + t) * K + k];
                warp_copy16(stage + static_cast<long long>(k) * H, eo + row * H, static_cast<long long>(H) * sizeof(C), lane);
            }
        }
    }
    if (last_block(p, D_CSEND) && threadIdx.x == 0) {
        for (int j = 0; j < G; ++j) {
            unsigned long long* cnt = reinterpret_cast<unsigned long long*>(sigs(p, p.node_heap[j]) + sig_stage(p, cpar));
            asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(cnt), "l"(1ull) : "memory");
        }
        *reinterpret_cast<volatile long long*>(state(p) + S_CROUND) = q + 1;
    }
}

// A forwarder: per (source node, token) with experts on my node, one summed row (kPartial) or its rows, put back to
// the source; then +1 to every source it serves.
template <class C>
__device__ void combine_relay(const CombineCall& c) {
    const NodeParams& p = c.p;
    const NodeCombineArgs& a = c.a;
    if (failed(p)) return;
    const long long q = state(p)[S_CROUND] - 1;
    const int cpar = static_cast<int>(q & 1);
    const int dpar = static_cast<int>((state(p)[S_DROUND] - 1) & 1);
    const int K = static_cast<int>(p.top_k), E = static_cast<int>(p.n_experts), H = static_cast<int>(p.hidden);
    const int G = static_cast<int>(p.gpus_per_node), M = static_cast<int>(p.n_nodes);
    const long long T = p.max_tokens, KM = p.comb_slots;
    const int lane = lane_id();
    __shared__ int s_ok;
    uint64_t* sg = sigs(p, p.heap);
    if (threadIdx.x == 0)
        s_ok = wait_ge(p, sg + sig_stage(p, cpar), static_cast<uint64_t>(G) * static_cast<uint64_t>((q >> 1) + 1),
                       K_CRELAY, -1);
    __syncthreads();
    if (!s_ok) return;
    const long long row_bytes = static_cast<long long>(H) * sizeof(C);
    for (long long item = global_warp(); item < static_cast<long long>(M) * T; item += n_global_warps()) {
        const int n = static_cast<int>(item / T), t = static_cast<int>(item % T);
        const int s = n * G + static_cast<int>(p.local);
        if (t >= scr_src_n(p)[s]) continue;
        const SourceView v = source_view(p, s, dpar);
        const int* ids = hdr_ids(v.hdr, t, K);
        bool on_node = false;
        int grank = 0;
        if (lane < K && valid_choice(ids, lane, K, E)) {
            const int r = rank_of_expert(p, ids[lane]);
            on_node = node_of_rank(p, r) == p.node;
            grank = on_node ? 1 << (r % G) : 0;
        }
        const unsigned mine = __ballot_sync(0xffffffffu, on_node);
        if (!mine) continue;
        const C* stage = reinterpret_cast<const C*>(p.heap + p.off_stage) +
                         ((static_cast<long long>(cpar) * M + n) * T + t) * K * H;
        C* dst_base = reinterpret_cast<C*>(p.heap + p.off_c_recv) + (static_cast<long long>(cpar) * T + t) * KM * H;
        uint64_t* sig = sg + sig_crecv(p, cpar, static_cast<int>(p.node));
        if (a.mode == kPartial) {
            const int n_slots = __popc(__reduce_or_sync(0xffffffffu, static_cast<unsigned>(grank)));
            C* out = reinterpret_cast<C*>(p.heap + p.off_c_send) + (static_cast<long long>(cpar) * M + n) * T * H + t * H;
            for (int col = lane; col < H; col += kWarp) {
                float acc = 0.f;
                for (int j = 0; j < n_slots; ++j) acc = __fadd_rn(acc, to_f32<C>(stage[static_cast<long long>(j) * H + col]));
                out[col] = from_f32<C>(acc);
            }
            __threadfence_system();
            __syncwarp();
            nvshmemx_putmem_signal_nbi_warp(dst_base + p.node * H, out, row_bytes, sig, 1, NVSHMEM_SIGNAL_ADD, s);
        } else {
            __syncwarp();
            for (unsigned m = mine; m; m &= m - 1) {
                const int k = __ffs(m) - 1;
                nvshmemx_putmem_signal_nbi_warp(dst_base + static_cast<long long>(k) * H, stage + static_cast<long long>(k) * H,
                                                row_bytes, sig, 1, NVSHMEM_SIGNAL_ADD, s);
            }
        }
    }
    if (last_block(p, D_CRELAY) && threadIdx.x == 0) {
        for (int n = 0; n < M; ++n)
            nvshmemx_signal_op(sg + sig_crecv(p, cpar, static_cast<int>(p.node)), 1, NVSHMEM_SIGNAL_ADD,
                               n * G + static_cast<int>(p.local));
    }
}

// kUnreduced: token t's rows into its K slots of `o` (slot k from row_k(k) where bit k of `has`, else zeros), then
// the shared expert's row into slot K when the layout has one (`srow`, or zeros where null). One warp.
template <class C, class RowK>
__device__ __forceinline__ void copy_to_slots(C* o, int K, int H, unsigned has, RowK row_k, bool with_shared,
                                              const C* srow) {
    const int lane = lane_id();
    for (int k = 0; k < K; ++k) {
        const C* row = ((has >> k) & 1u) ? row_k(k) : nullptr;
        for (int col = lane; col < H; col += kWarp) o[static_cast<long long>(k) * H + col] = row ? row[col] : from_f32<C>(0.f);
    }
    if (with_shared)
        for (int col = lane; col < H; col += kWarp) o[static_cast<long long>(K) * H + col] = srow ? srow[col] : from_f32<C>(0.f);
}

// skip_a2a: nothing crossed ranks; my tokens' rows are all here. Per token: the rows of my local experts (weighted
// and summed in k order, or copied into their slots), the shared expert's row for the tokens of my share, residual.
template <class C>
__device__ void combine_local(const CombineCall& c) {
    const NodeParams& p = c.p;
    const NodeCombineArgs& a = c.a;
    const int K = static_cast<int>(p.top_k), E = static_cast<int>(p.n_experts), H = static_cast<int>(p.hidden);
    const long long T = p.max_tokens;
    const int N = a.num_tokens, lane = lane_id(), me = static_cast<int>(p.rank);
    const int dpar = static_cast<int>((state(p)[S_DROUND] - 1) & 1);
    const char* hdr = reinterpret_cast<const char*>(p.heap + p.off_hdr_send + dpar * p.hdr_bytes);
    const int* row_of = reinterpret_cast<const int*>(p.row_of_ptr);
    const C* eo = static_cast<const C*>(a.expert_out);
    const C* res = static_cast<const C*>(a.residual);
    C* out = static_cast<C*>(a.out);
    const int lo = shared_lo(p, N), hi = shared_hi(p, N);
    const int n_slots_out = K + static_cast<int>(p.shared);
    for (int t = global_warp(); t < N; t += n_global_warps()) {
        const int* ids = a.topk_ids + static_cast<long long>(t) * K;
        const bool local = lane < K && valid_choice(ids, lane, K, E) && rank_of_expert(p, ids[lane]) == me;
        const unsigned mine = __ballot_sync(0xffffffffu, local);
        const bool shared = p.shared && t >= lo && t < hi;
        const C* srow = shared ? eo + static_cast<long long>(t - lo) * H : nullptr;
        if (a.mode == kUnreduced) {
            const auto row_k = [&](int k) {
                return eo + static_cast<long long>(row_of[(static_cast<long long>(me) * T + t) * K + k]) * H;
            };
            copy_to_slots<C>(out + static_cast<long long>(t) * n_slots_out * H, K, H, mine, row_k, p.shared, srow);
            continue;
        }
        const float* w = a.mode == kPartial ? hdr_weights(hdr, t, K) : a.topk_weights + static_cast<long long>(t) * K;
        for (int col = lane; col < H; col += kWarp) {
            float acc = 0.f;
            for (unsigned m = mine; m; m &= m - 1) {
                const int k = __ffs(m) - 1;
                const long long row = row_of[(static_cast<long long>(me) * T + t) * K + k];
                acc = __fadd_rn(acc, __fmul_rn(w[k], to_f32<C>(eo[row * H + col])));
            }
            if (shared) acc = __fadd_rn(acc, to_f32<C>(srow[col]));
            if (res) acc = __fadd_rn(acc, to_f32<C>(res[static_cast<long long>(t) * H + col]));
            out[static_cast<long long>(t) * H + col] = from_f32<C>(acc);
        }
    }
}

// The source: wait for every node, then sum (kPartial: node partials in node order; kWeighted: rows in k order with
// my weights), add the shared expert's row (group 0, row t) and the residual; kUnreduced: copy rows into slots.
template <class C>
__device__ void combine_recv(const CombineCall& c) {
    extern __shared__ int s_cnt[];  // [M] rows expected from each node this round
    const NodeParams& p = c.p;
    const NodeCombineArgs& a = c.a;
    if (failed(p)) return;
    if (p.skip_a2a) {
        combine_local<C>(c);
        return;
    }
    const long long q = state(p)[S_CROUND] - 1;
    const int cpar = static_cast<int>(q & 1);
    const int K = static_cast<int>(p.top_k), E = static_cast<int>(p.n_experts), H = static_cast<int>(p.hidden);
    const int M = static_cast<int>(p.n_nodes);
    const long long T = p.max_tokens, KM = p.comb_slots;
    const int N = a.num_tokens;
    const int lane = lane_id();
    for (int m = threadIdx.x; m < M; m += blockDim.x) s_cnt[m] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < N * K; i += blockDim.x) {  // the choices the nodes send rows for
        const int t = i / K, k = i % K;
        const int* ids = a.topk_ids + static_cast<long long>(t) * K;
        if (!valid_choice(ids, k, K, E)) continue;
        const int m = node_of_rank(p, rank_of_expert(p, ids[k]));
        if (a.mode == kPartial) {  // one row per (token, node): count it at its first choice on that node
            bool first = true;
            for (int j = 0; j < k; ++j)
                first &= !(valid_choice(ids, j, K, E) && node_of_rank(p, rank_of_expert(p, ids[j])) == m);
            if (!first) continue;
        }
        atomicAdd(s_cnt + m, 1);
    }
    __syncthreads();
    uint64_t* sg = sigs(p, p.heap);
    __shared__ int s_ok;
    if (threadIdx.x == 0) s_ok = 1;
    __syncthreads();
    for (int m = threadIdx.x; m < M; m += blockDim.x) {
        const uint64_t want = static_cast<uint64_t>(exp_crecv(p)[cpar * M + m] + s_cnt[m] + 1);
        if (!wait_put_signal(p, sg + sig_crecv(p, cpar, m), want, K_CRECV,
                             m * static_cast<int>(p.gpus_per_node) + static_cast<int>(p.local)))
            s_ok = 0;
    }
    __syncthreads();
    if (!s_ok) return;
    const C* eo = static_cast<const C*>(a.expert_out);
    const C* recv = reinterpret_cast<const C*>(p.heap + p.off_c_recv) + static_cast<long long>(cpar) * T * KM * H;
    const C* res = static_cast<const C*>(a.residual);
    C* out = static_cast<C*>(a.out);
    const int n_slots_out = K + static_cast<int>(p.shared);
    for (int t = global_warp(); t < N; t += n_global_warps()) {
        const int* ids = a.topk_ids + static_cast<long long>(t) * K;
        int node_k = -1;  // lane k < K: the node of a valid choice
        if (lane < K && valid_choice(ids, lane, K, E)) node_k = node_of_rank(p, rank_of_expert(p, ids[lane]));
        const unsigned valid = __ballot_sync(0xffffffffu, node_k >= 0);
        // node mask (partial: one row per node)
        const unsigned nodes = __reduce_or_sync(0xffffffffu, node_k >= 0 ? 1u << node_k : 0u);
        const C* trow = recv + static_cast<long long>(t) * KM * H;
        if (a.mode == kUnreduced) {
            const auto row_k = [&](int k) { return trow + static_cast<long long>(k) * H; };
            copy_to_slots<C>(out + static_cast<long long>(t) * n_slots_out * H, K, H, valid, row_k, p.shared,
                             eo + static_cast<long long>(t) * H);
            continue;
        }
        for (int col = lane; col < H; col += kWarp) {
            float acc = 0.f;
            if (a.mode == kPartial) {
                for (unsigned m = nodes; m; m &= m - 1)
                    acc = __fadd_rn(acc, to_f32<C>(trow[static_cast<long long>(__ffs(m) - 1) * H + col]));
            } else {
                for (unsigned m = valid; m; m &= m - 1) {
                    const int k = __ffs(m) - 1;
                    acc = __fadd_rn(acc, __fmul_rn(a.topk_weights[static_cast<long long>(t) * K + k],
                                                   to_f32<C>(trow[static_cast<long long>(k) * H + col])));
                }
            }
            if (p.shared) acc = __fadd_rn(acc, to_f32<C>(eo[static_cast<long long>(t) * H + col]));
            if (res) acc = __fadd_rn(acc, to_f32<C>(res[static_cast<long long>(t) * H + col]));
            out[static_cast<long long>(t) * H + col] = from_f32<C>(acc);
        }
    }
    if (last_block(p, D_CRECV) && threadIdx.x == 0)
        for (int m = 0; m < M; ++m) exp_crecv(p)[cpar * M + m] += s_cnt[m] + 1;
}

}  // namespace node
}  // namespace cuep
