// cuep combine: expert outputs go back to the ranks their tokens came from and are summed with the router weights.
//
// One kernel, three phases (kPhase* bits of CombineArgs.phases, as in dispatch.cu):
//   notify  combine/readiness.cuh  re-arm the other round parity's arrival counts, and tell every rank which
//                                  rounds it may now send here (partial sums in parity slots: one round ahead)
//   send    combine/send.cuh       wait until every destination is ready, then put the data by mode (kPartial:
//                                  one float32-accumulated partial sum per (token, destination rank) over this
//                                  rank's experts; kWeighted / kUnreduced: each row into slot k), each piece
//                                  followed by its arrival count (polled partial sums: none)
//   recv    combine/recv.cuh       tokens in order as their slots land: the weighted sum, plus the shared expert
//                                  and the residual; or the unreduced [N, K (+1), H]
// A fused combine after a one-rank dispatch takes its own kernels (combine/local.cuh: no protocol).
// Where the data lands and how arrival is counted: combine/slots.cuh; every cross-rank access goes through the
// transport seam (ep/transport.cuh).
#include "ep.cuh"
#include "formats.cuh"

namespace cuep {
constexpr int kCombineThreads = 512;
// bf16 partial sums read the expert rows through a per-warp cp.async ring of kCombineRing stages (a stage: 4 rows x
// 64 vectors = 4 KiB), so each warp keeps the rows of its next pieces in flight while it sums the current one;
// cuep/ep.py gives the launch kCombineRing x 4 KiB x 16 warps of dynamic shared memory (_COMBINE_RING). Without
// that much shared memory the kernel uses register loads.
constexpr int kCombineRing = 2;
constexpr int kCombinePieceBytes = 4 * 2 * 32 * 16;
constexpr int kCombineRingBytes = kCombineRing * kCombinePieceBytes * (kCombineThreads / 32);
}  // namespace cuep

#include "combine/local.cuh"
#include "combine/recv.cuh"
#include "combine/send.cuh"

namespace cuep {

template <typename TC>
__device__ __forceinline__ void combine_kernel(const EPParams& ep, const CombineArgs& a) {
    __shared__ int s_flag;
    const int phases = a.phases;
    // The message counts, loaded by warp 1 while thread 0 loads the entry counters (the barrier in
    // load_entry_counters publishes them): the partial sums' first rows depend on them.
    __shared__ int s_early_count[kMaxRanks];
    const bool early = (phases & kPhaseSend) != 0;
    if (early && threadIdx.x >= kWarp && threadIdx.x < kWarp + ep.n_src)
        s_early_count[threadIdx.x - kWarp] = a.msg_count[threadIdx.x - kWarp];
    // the error flag and the round in one load per block (as in dispatch_kernel)
    const EntryCounters entry = load_entry_counters(ep);
    if (entry.status == kStatusTimeout) return;
    const int round = entry.comb_round, recv_round = entry.crecv_round;
    const int entered = count_entry(ep, C_ENTER_COMBINE);
    if (phases & kPhaseNotify) phase_notify(ep, round, a.mode, (phases & kPhaseSend) != 0, a.num_tokens);
    if ((phases & kPhaseRecv) && (phases & kPhaseSend) && threadIdx.x % kWarp < static_cast<unsigned>(ep.top_k)) {
        // the receive item's top-k row into L2 now, so the receive half does not start with a cold load
        const int n_vec = static_cast<int>(ep.hidden / 8), item = recv_static_item(a, n_vec);
        if (item >= 0) {
            const int kChunkVecs = static_cast<int>(chunk_units(a.num_tokens, n_vec, kWarp));
            const int t = item / ((n_vec + kChunkVecs - 1) / kChunkVecs);
            prefetch_l2(a.topk_ids + static_cast<long long>(t) * ep.top_k + threadIdx.x % kWarp);
        }
    }
    // Every block sends first (blocks done sending take up the receiving): receive-only blocks, which would overlap
    // the sums with the incoming stream, measured slower. 4 x H200, N = 4096 bf16: none 535 us, 1/8 547, 2/8 537,
    // 4/8 571; 2 x H200: none 272, 1/8 276, 2/8 288, 4/8 363.
    if (phases & kPhaseSend) phase_send<TC>(ep, a, round, send_block_count(phases, 0), early ? s_early_count : nullptr);
    if ((phases & kPhaseNotify) && (phases & kPhaseSend) && blockIdx.x == 0) publish_parity_ready(ep, round, a.mode);
    if (phases & kPhaseRecv) phase_recv<TC>(ep, a, recv_round, &s_flag);
    // The block that entered last advances the rounds of the phases this launch ran.
    if (last_to_enter(ep, C_ENTER_COMBINE, entered)) {
        if (phases & kPhaseSend) ep.counters()[C_COMB_ROUND] = round + 1;
        if (phases & kPhaseRecv) ep.counters()[C_CRECV_COUNT] = recv_round + 1;
    }
}

}  // namespace cuep

// Every kernel takes one CombineParams (ep/params.cuh) by value; cuep/params.py builds it.
#define CUEP_COMBINE(NAME, TC)                                                                               \
    extern "C" __global__ void __launch_bounds__(cuep::kCombineThreads)                                      \
        NAME(const __grid_constant__ cuep::CombineParams params) {                                           \
        const cuep::CombineArgs call = params.call; /* in registers: immutable through every fence */         \
        cuep::combine_kernel<TC>(params.ep, call);                                                            \
    }

CUEP_COMBINE(cuep_combine_bf16, cuep::bf16_t)
CUEP_COMBINE(cuep_combine_f32, float)

// The one-rank combine (combine/local.cuh), a kernel of its own: cuep/ep.py launches it for a fused combine after a
// one-rank dispatch (cuep_dispatch_local_*) of the same round, as a programmatic dependent (await_previous_grid).
// cuep_combine_local_wide_bf16 keeps 8 rows' loads in flight, for rounds whose items are whole tokens.
#define CUEP_COMBINE_LOCAL(NAME, TC, ROWS)                                                                   \
    extern "C" __global__ void __launch_bounds__(cuep::kCombineThreads, 1)                                   \
        NAME(const __grid_constant__ cuep::CombineParams params) {                                           \
        cuep::await_previous_grid();                                                                         \
        const cuep::CombineArgs call = params.call;                                                          \
        if (params.ep.n_ranks == 1) cuep::combine_local<TC, ROWS>(params.ep, call); /* (checks failed) */    \
    }

CUEP_COMBINE_LOCAL(cuep_combine_local_bf16, cuep::bf16_t, 4)
CUEP_COMBINE_LOCAL(cuep_combine_local_wide_bf16, cuep::bf16_t, 8)
CUEP_COMBINE_LOCAL(cuep_combine_local_f32, float, 4)
