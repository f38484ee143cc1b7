// Combine of a one-rank group after a one-rank dispatch (dispatch/local.cuh), fused or as combine_wait (a one-rank
// combine_async has nothing to send): every expert row is already here, so each token is summed straight from
// expert_out through the rows of its choices (row_offsets[group] + the position dispatch noted, local_choice_pos).
// No readiness, no slots, no counters. The arithmetic is the protocol's, in the same order (a partial sum's rows in
// k order, accumulated in float32, then the shared expert's row and the residual, rounded once; kWeighted the same
// with combine's weights; kUnreduced the rows as they are), so the outputs are bit-identical to the protocol's and
// to cuep.reference.
#pragma once
#include "slots.cuh"

namespace cuep {

// One 8-value vector of an expert row: kFloats, widened at the load (8 floats); else kept as loaded (bf16 16 bytes,
// float32 32) and widened when summed, which 8 rows in flight need to fit the registers.
template <typename TC, bool kFloats>
struct RowVector {
    float f[kFloats ? 8 : 1];
    uint4 w[kFloats ? 1 : sizeof(TC) == 2 ? 1 : 2];
    __device__ __forceinline__ void load(const TC* p) {
        if constexpr (kFloats) {
            load8f(p, f);
        } else {
            w[0] = reinterpret_cast<const uint4*>(p)[0];
            if constexpr (sizeof(TC) != 2) w[1] = reinterpret_cast<const uint4*>(p)[1];
        }
    }
    __device__ __forceinline__ void values(float (&v)[8]) const {
        if constexpr (kFloats) {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = f[i];
        } else if constexpr (sizeof(TC) == 2) {
            bf16x8_values(w[0], v);
        } else {
            f32x8_values(w[0], w[1], v);
        }
    }
};

// kRows: rows' loads in flight per warp, 4, or 8 in the kernel for long items (cuep/ep.py _combine_local_name: whole
// tokens, or chunks of at least 96 vectors): H200, N = 4096, 155.8 -> 141.9 us (bf16; 4 kept the HBM waiting).
template <typename TC, int kRows>
__device__ void combine_local(const EPParams& ep, const CombineArgs& a) {
    const int K = static_cast<int>(ep.top_k), H = static_cast<int>(ep.hidden), N = a.num_tokens;
    const int n_vec = H / 8, lane = threadIdx.x % kWarp;
    const bool shared = ep.shared != 0;
    const TC* eo = static_cast<const TC*>(a.expert_out);
    TC* out = static_cast<TC*>(a.out);
    const int* pos = local_choice_pos(ep);
    const int L = static_cast<int>(ep.n_local), first = static_cast<int>(ep.rank) * L - (shared ? 1 : 0);
    // items (token, chunk of 16-byte vectors), one warp each, consecutive items on different blocks; the chunks
    // from the host (a.chunk_plan, cuep/ep.py _combine_chunks, once per N: chunk_units for this grid), as the
    // one-rank dispatch has them: their divisions here held the first loads back. A plan that does not cover
    // the row exactly (none given): a token a warp, right at any N, only slower.
    int chunk_vecs = n_vec, n_chunks = 1;
    take_chunk_plan(a.chunk_plan, n_vec, &chunk_vecs, &n_chunks);
    const long long grid_warps = static_cast<long long>(gridDim.x) * (blockDim.x / kWarp);
    // lane k: choice k's position and expert, both loaded at once (neither address depends on the other); the
    // warp's first item's before the barrier below, so that they travel with row_offsets
    const int n_items = N * n_chunks;  // (fits an int: chunks split a token only while warps outnumber tokens)
    const int* ids = a.topk_ids;
    int item = static_cast<int>(threadIdx.x / kWarp * gridDim.x + blockIdx.x);
    auto choice = [pos, ids, n_chunks, n_items, K, lane](int it, int& p, int& e) {
        const bool here = lane < K && it < n_items;
        const long long c = static_cast<long long>(it / n_chunks) * K + lane;
        p = here ? pos[c] : -1;
        e = here ? ids[c] : 0;
    };
    int p_next, e_next;
    choice(item, p_next, e_next);
    // Thread 0 loads the failed flag once its warp's first loads are issued and compares it after the barrier below,
    // before any store (read_failed). (has_failed at entry, compared at once, held warp 0's loads back a load's
    // latency: this order took 0.975-0.997x the time cold on an H200 at N = 1, 32, 128, the same warm.)
    const int failed = read_failed(ep);
    // (the shared expert's tokens: after the first loads, which its 64-bit divisions held back)
    const int sh_lo = shared ? shared_lo(ep, N) : 0, sh_hi = shared ? shared_hi(ep, N) : 0;
    // the groups' first rows, in shared memory (cuep/ep.py gives G + 1 words)
    extern __shared__ unsigned s_offsets[];
    for (int g = threadIdx.x; g <= ep.n_groups; g += blockDim.x) s_offsets[g] = a.row_offsets[g];
    __shared__ int s_failed;
    note_failed(failed == kStatusTimeout, &s_failed);
    __syncthreads();
    if (s_failed) return;
    for (; item < n_items; item += static_cast<int>(grid_warps)) {
        const int t = item / n_chunks, ch = item % n_chunks;
        const int c_begin = ch * chunk_vecs, c_end = min(n_vec, c_begin + chunk_vecs);
        const int row = p_next >= 0 ? static_cast<int>(s_offsets[e_next - first]) + p_next : -1;  // lane k: choice k's
        choice(item + static_cast<int>(grid_warps), p_next, e_next);  // the warp's next item's, in flight meanwhile
        const unsigned valid = __ballot_sync(0xffffffffu, row >= 0);
        if (a.mode == kUnreduced) {
            const int width = K + (shared ? 1 : 0), span = c_end - c_begin;
            TC* o = out + static_cast<long long>(t) * width * H;
            for (int i = lane; i < width * span; i += kWarp) {
                const int k = i / span, c = c_begin + i % span;
                float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                if (k < K) {
                    if ((valid >> k) & 1u) {  // (lanes diverge here: the row again from its parts, L1-resident)
                        const long long ck = static_cast<long long>(t) * K + k;
                        const long long rk = s_offsets[a.topk_ids[ck] - first] + pos[ck];
                        load8f(eo + rk * H + 8 * c, v);
                    }
                } else if (sh_lo <= t && t < sh_hi) {  // shared expert: group 0, row t - sh_lo
                    load8f(eo + static_cast<long long>(t - sh_lo) * H + 8 * c, v);
                }
                store8f(o + static_cast<long long>(k) * H + 8 * c, v);
            }
            continue;
        }
        // kPartial: the weights given at dispatch (row_weight); kWeighted: combine's
        const float w = row < 0 ? 0.f
                        : a.mode == kPartial ? a.row_weight[row]
                                             : a.topk_weights[static_cast<long long>(t) * K + lane];
        for (int c0 = c_begin; c0 < c_end; c0 += kWarp) {
            const int c = c0 + lane;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (unsigned mk = valid; mk;) {  // kRows rows' loads in flight, summed in k order
                int rk[kRows], kk[kRows];
                float wk[kRows];
                RowVector<TC, kRows == 4> v[kRows];
#pragma unroll
                for (int u = 0; u < kRows; ++u) {
                    kk[u] = mk ? __ffs(mk) - 1 : 0;
                    rk[u] = mk ? __shfl_sync(0xffffffffu, row, kk[u]) : -1;
                    if (mk) mk &= mk - 1;
                }
#pragma unroll
                for (int u = 0; u < kRows; ++u)
                    if (rk[u] >= 0 && c < c_end) v[u].load(eo + static_cast<long long>(rk[u]) * H + 8 * c);
                // the weights after the rows' loads are issued (a partial's weight is read through its row: its load
                // then overlaps theirs)
#pragma unroll
                for (int u = 0; u < kRows; ++u) wk[u] = __shfl_sync(0xffffffffu, w, kk[u]);
#pragma unroll
                for (int u = 0; u < kRows; ++u) {
                    if (rk[u] < 0 || c >= c_end) continue;
                    float f[8];
                    v[u].values(f);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] += wk[u] * f[i];
                }
            }
            if (c < c_end) finish_out_vector<TC>(ep, a, sh_lo, sh_hi, t, c, acc);
        }
    }
}

}  // namespace cuep
