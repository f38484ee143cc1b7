// cuep combine: expert outputs go back to the ranks their tokens came from and are summed with the router weights.
//
// One kernel, three phases (bits of `phases`, as in dispatch.cu):
//   notify  tell every rank this rank may now receive its combine data (its previous combine is fully read)
//   send    wait until every destination is ready, then, by mode:
//             kPartial    (weights rode along at dispatch) one float32-accumulated partial sum per (token,
//                         destination rank) over this rank's experts, into slot j of the source's comb_recv[t],
//                         j = this rank's position among the token's destination ranks
//             kWeighted / kUnreduced  one row per (token, k) into slot k
//           the last block signals every destination
//   recv    wait for every rank, then out[t] = the sum of the slots (weighted by topk_weights in kWeighted),
//           plus the shared expert's row and the residual; or the unreduced [N, K(+1), H]
#include "ep.cuh"
#include "formats.cuh"

using namespace cuep;

constexpr int kCombineThreads = 512;
enum CombineMode : int { kPartial = 0, kWeighted = 1, kUnreduced = 2 };

namespace {

struct CombineArgs {
    const void* expert_out;     // [capacity, H] combine dtype: row i is the expert output of dispatched row i
    const int* src_info;        // [capacity, 2]
    const int* row_src;         // [capacity]
    const float* row_weight;    // [capacity]
    const int* msg_rows;        // [n_src, T, K]
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

__device__ __forceinline__ int n_dest_ranks(const EP& ep) { return ep[P_SKIP_A2A] ? 1 : static_cast<int>(ep[P_N_RANKS]); }
__device__ __forceinline__ int dest_rank(const EP& ep, int d) { return ep[P_SKIP_A2A] ? static_cast<int>(ep[P_RANK]) : d; }

__device__ void phase_notify(const EP& ep, int round) {
    if (blockIdx.x != 0) return;
    const int rank = static_cast<int>(ep[P_RANK]);
    if (threadIdx.x < n_dest_ranks(ep)) {
        const int r = dest_rank(ep, threadIdx.x);
        uint64_t* flag = reinterpret_cast<uint64_t*>(ep.peer(r, ep[P_OFF_COMB_READY])) + rank;
        store_release_u64(flag, static_cast<uint64_t>(round) + 1);
    }
}

template <typename TC>
__device__ void phase_send(const EP& ep, const CombineArgs& a, int round, int* s_flag) {
    const int K = static_cast<int>(ep[P_TOP_K]), H = static_cast<int>(ep[P_HIDDEN]);
    const int rank = static_cast<int>(ep[P_RANK]), n_src = static_cast<int>(ep[P_N_SRC]);
    const long long T_max = ep[P_MAX_TOKENS];
    int* ctr = ep.counters();
    __shared__ int s_ok;
    const int n_dest = n_dest_ranks(ep);
    const uint64_t* ready = reinterpret_cast<const uint64_t*>(ep.local(ep[P_OFF_COMB_READY])) + dest_rank(ep, 0);
    if (!block_wait_flags_eq(ready, n_dest, static_cast<uint64_t>(round) + 1, ep, K_COMBINE_SEND, &s_ok)) return;

    const TC* eo = static_cast<const TC*>(a.expert_out);
    const int n_vec = H / 8;
    if (a.mode == kPartial) {
        __shared__ int s_start[kMaxRanks + 1];
        if (threadIdx.x == 0) {
            s_start[0] = 0;
            for (int s = 0; s < n_src; ++s) s_start[s + 1] = s_start[s] + a.msg_count[s];
        }
        __syncthreads();
        for (int m = blockIdx.x; m < s_start[n_src]; m += gridDim.x) {
            int s = 0;
            while (m >= s_start[s + 1]) ++s;
            const long long mi = s * T_max + (m - s_start[s]);
            const int* rows = a.msg_rows + mi * K;
            const int t = a.msg_token[mi], j = a.msg_j[mi];
            const int r = ep[P_SKIP_A2A] ? rank : s;
            TC* dst = reinterpret_cast<TC*>(ep.peer(r, ep[P_OFF_COMB_RECV])) + (static_cast<long long>(t) * K + j) * H;
            for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int k = 0; k < K; ++k) {
                    const int row = rows[k];
                    if (row < 0) continue;
                    const float w = a.row_weight[row];
                    float v[8];
                    load8f(eo + static_cast<long long>(row) * H + 8 * c, v);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] += w * v[i];
                }
                store8f(dst + 8 * c, acc);
            }
        }
    } else {
        const int n_rows = static_cast<int>(a.row_offsets[ep[P_N_GROUPS]]);
        for (int row = blockIdx.x; row < n_rows; row += gridDim.x) {
            const int src = a.row_src[row], k = a.src_info[2LL * row + 1];
            if (src < 0 || k >= K) continue;  // padding, or the shared expert (stays local)
            const int t = a.src_info[2LL * row];
            TC* dst = reinterpret_cast<TC*>(ep.peer(src, ep[P_OFF_COMB_RECV])) + (static_cast<long long>(t) * K + k) * H;
            block_copy16(dst, eo + static_cast<long long>(row) * H, static_cast<long long>(H) * sizeof(TC), threadIdx.x,
                         blockDim.x);
        }
    }
    if (!last_block_done(ctr + C_DONE_CSEND, s_flag)) return;
    if (threadIdx.x < n_dest) {
        const int r = dest_rank(ep, threadIdx.x);
        fence_sys();
        store_release_u64(reinterpret_cast<uint64_t*>(ep.peer(r, ep[P_OFF_COMB_COUNT])) + rank, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        ctr[C_DONE_CSEND] = 0;
        ctr[C_COMB_ROUND] = round + 1;
    }
}

template <typename TC>
__device__ void phase_recv(const EP& ep, const CombineArgs& a, int* s_flag) {
    const int K = static_cast<int>(ep[P_TOP_K]), H = static_cast<int>(ep[P_HIDDEN]);
    const int L = static_cast<int>(ep[P_N_LOCAL]), R = static_cast<int>(ep[P_N_RANKS]);
    const bool shared = ep[P_SHARED] != 0;
    int* ctr = ep.counters();
    __shared__ int s_ok;
    __shared__ uint64_t s_vals[kMaxRanks];
    __shared__ int s_valid[64], s_rank_first[64];
    __shared__ float s_w[64];
    __shared__ int s_nj;
    const int n_dest = n_dest_ranks(ep);
    uint64_t* counts = reinterpret_cast<uint64_t*>(ep.local(ep[P_OFF_COMB_COUNT])) + dest_rank(ep, 0);
    if (!block_wait_not_empty(counts, n_dest, s_vals, ep, K_COMBINE_RECV, &s_ok)) return;

    const TC* recv = reinterpret_cast<const TC*>(ep.local(ep[P_OFF_COMB_RECV]));
    const TC* eo = static_cast<const TC*>(a.expert_out);
    const TC* res = static_cast<const TC*>(a.residual);
    TC* out = static_cast<TC*>(a.out);
    const int n_vec = H / 8;
    for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
        const int* ids = a.topk_ids + static_cast<long long>(t) * K;
        if (threadIdx.x < K) {
            const int k = threadIdx.x;
            const bool v = valid_choice(ep, ids, k);
            s_valid[k] = v;
            s_w[k] = (a.mode == kWeighted && v) ? a.topk_weights[static_cast<long long>(t) * K + k] : 0.f;
            // first valid choice of its rank: counts the token's destination ranks for the partial sums
            int first = v;
            for (int k2 = 0; k2 < k && first; ++k2)
                if (valid_choice(ep, ids, k2) && ids[k2] / L == ids[k] / L) first = 0;
            s_rank_first[k] = first;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int nj = 0;
            for (int k = 0; k < K; ++k) nj += s_rank_first[k];
            s_nj = nj;
        }
        __syncthreads();
        const TC* slots = recv + static_cast<long long>(t) * K * H;
        if (a.mode == kUnreduced) {
            const int width = K + (shared ? 1 : 0);
            TC* o = out + static_cast<long long>(t) * width * H;
            for (int i = threadIdx.x; i < width * n_vec; i += blockDim.x) {
                const int k = i / n_vec, c = i % n_vec;
                float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                if (k < K) {
                    if (s_valid[k]) load8f(slots + static_cast<long long>(k) * H + 8 * c, v);
                } else {
                    load8f(eo + static_cast<long long>(t) * H + 8 * c, v);  // shared expert: group 0, row t
                }
                store8f(o + static_cast<long long>(k) * H + 8 * c, v);
            }
        } else {
            const int n_slots = a.mode == kPartial ? s_nj : K;
            for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int j = 0; j < n_slots; ++j) {
                    if (a.mode == kWeighted && !s_valid[j]) continue;
                    const float w = a.mode == kWeighted ? s_w[j] : 1.f;
                    float v[8];
                    load8f(slots + static_cast<long long>(j) * H + 8 * c, v);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] += w * v[i];
                }
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
            }
        }
        __syncthreads();
    }
    (void)R;
    if (!last_block_done(ctr + C_DONE_CRECV, s_flag, /*peer_writes=*/false)) return;
    if (threadIdx.x < n_dest) counts[threadIdx.x] = kEmpty;
    if (threadIdx.x == 0) ctr[C_DONE_CRECV] = 0;
}

}  // namespace

template <typename TC>
__device__ void combine_kernel(const long long* params, const CombineArgs& a, int phases) {
    __shared__ int s_flag;
    const EP ep{params};
    if (has_failed(ep)) return;
    const int round = *reinterpret_cast<volatile int*>(ep.counters() + C_COMB_ROUND);
    __syncthreads();
    if (phases & kPhaseNotify) phase_notify(ep, round);
    if (phases & kPhaseSend) phase_send<TC>(ep, a, round, &s_flag);
    if (phases & kPhaseRecv) phase_recv<TC>(ep, a, &s_flag);
}

#define CUEP_COMBINE(NAME, TC)                                                                               \
    extern "C" __global__ void __launch_bounds__(kCombineThreads) NAME(                                      \
        const long long* params, const void* expert_out, const int* src_info, const int* row_src,            \
        const float* row_weight, const int* msg_rows, const int* msg_token, const int* msg_j,                \
        const int* msg_count, const unsigned* row_offsets, const int* topk_ids, const float* topk_weights,   \
        const void* residual, void* out, int num_tokens, int mode, int phases) {                             \
        const CombineArgs a{expert_out, src_info, row_src, row_weight, msg_rows, msg_token, msg_j,           \
                            msg_count, row_offsets, topk_ids, topk_weights, residual, out, num_tokens, mode}; \
        combine_kernel<TC>(params, a, phases);                                                               \
    }

CUEP_COMBINE(cuep_combine_bf16, bf16_t)
CUEP_COMBINE(cuep_combine_f32, float)
