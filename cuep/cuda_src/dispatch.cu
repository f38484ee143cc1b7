// cuep dispatch: every token goes once to each rank holding one of its top-k experts, stored straight into that
// rank's expert-major output (the row of the first local expert it chose there), with a small metadata record;
// the receiver copies it to the rows of its other local experts and builds row_offsets, src_info and the scales.
//
// One kernel, three phases (kPhase* bits of DispatchArgs.phases), so the fused call, the async/wait halves and
// ranks simulated on one GPU share a single code path:
//   notify  dispatch/notify.cuh  reserve row and message slots, publish the tally rows (histogram, token count,
//                                message count) to every destination: the readiness handshake too
//   send    dispatch/send.cuh    wait for every rank's tally row, derive every destination's row layout, then one
//                                warp per (token, chunk): encode once, put to each destination, fence, chunk flags
//   recv    dispatch/recv.cuh    lay out the groups from the tally rows, pad, then place each message as its
//                                chunk flags land (metadata, scales, copies to the token's other local experts)
// A small round (decode: at most small_batch_tokens tokens on this rank) takes the staged protocol
// (dispatch/staged.cuh): no wait for the other ranks' histograms before the data moves. In a one-rank group a
// fused call takes no protocol at all (dispatch/local.cuh, its own kernels: cuep_dispatch_local_*).
// Records and signals: dispatch/messages.cuh; row layout: dispatch/layout.cuh; scales: dispatch/scales.cuh; every
// cross-rank access goes through the transport seam (ep/transport.cuh).
#include "ep.cuh"
#include "formats.cuh"

namespace cuep {
constexpr int kDispatchThreads = 512;
#ifndef CUEP_DISPATCH_ENCODE_STEPS
#define CUEP_DISPATCH_ENCODE_STEPS 4
#endif
constexpr int kEncodeSteps = CUEP_DISPATCH_ENCODE_STEPS;  // 256-value spans per encode step of a sending warp
}  // namespace cuep

#include "dispatch/notify.cuh"
#include "dispatch/recv.cuh"
#include "dispatch/send.cuh"
#include "dispatch/local.cuh"

namespace cuep {

// A small fused round sends from 6/16 of the blocks; the others only receive. In-process A/B, 2 x H200, N = 128,
// cold: 8/16 26.4 us, 6/16 25.4, 5/16 25.2-25.5, 4/16 25.5, 3/16 26.3 (bf16); fp8 8/16 28.7, 6/16 27.7-28.0, 5/16
// 28.4: the receive blocks' fan-out, not the send, was short of SMs.
constexpr int kSmallSendSixteenths = 6;

// A large fused round's receive-only blocks, in eighths of the grid, so the fan-out runs while tokens are still
// being sent. In-process A/B, 2 x H200, N = 4096, cold us, 3/8, 4/8, 5/8, 6/8 of the blocks receiving: bf16 286,
// 270, 256, 241 (7/8: 301); fp8 222, 214, 212, 240; nvfp4 228, 225, 226, 244. On two ranks a bf16 token fans out to
// about four rows here, so the copies, not the NVLink stores, want the SMs; a quantized round encodes in the send
// blocks and copies half the bytes or less. 4 x H200: unmeasured (one half). (Every block sending first: 347 us
// against 293 with half receiving.)
template <int FMT, typename T>
__device__ __forceinline__ int large_recv_eighths(const EPParams& ep) {
    return FMT == kFmtBf16 && sizeof(T) == 2 && ep.n_ranks <= 2 ? 6 : 4;
}

template <int FMT, typename T>
__device__ __forceinline__ void dispatch_kernel(const EPParams& ep, const DispatchArgs& a) {
    extern __shared__ __align__(16) char smem[];
    __shared__ int s_flag;
    const int phases = a.phases;
    int* ctr = ep.counters();
    // A small round's readiness rows (small_round_ready), both parities, loaded by warp 1 while thread 0 loads the
    // entry counters (the barrier in load_entry_counters publishes them).
    __shared__ uint64_t s_early_ready[2 * kMaxRanks];
    const bool early = (phases & (kPhaseNotify | kPhaseSend)) && small_round(ep, a.num_tokens);
    if (early && threadIdx.x >= kWarp && threadIdx.x < kWarp + 2 * ep.n_src) {
        const int l = static_cast<int>(threadIdx.x) - kWarp, n_src = static_cast<int>(ep.n_src);
        s_early_ready[l] = poll_u64(tally_row(ep, static_cast<int>(ep.rank), l / n_src, l % n_src));
    }
    // The error flag and the rounds in one load per block. Rounds are read once at entry: the block that entered
    // last advances them only after every block started.
    const EntryCounters entry = load_entry_counters(ep);
    if (entry.status == kStatusTimeout) return;
    const int send_round = entry.disp_round, recv_round = entry.recv_round;
    const int entered = count_entry(ep, C_ENTER_DISPATCH);
    if (phases & kPhaseNotify) phase_notify(ep, a, send_round, &s_flag, smem, early ? s_early_ready : nullptr);
    const bool small = small_round(ep, a.num_tokens);
    const bool fused = (phases & kPhaseRecv) && (phases & kPhaseSend);
    const int send_blocks = fused && small ? max(1, static_cast<int>(gridDim.x) * kSmallSendSixteenths / 16)
                                           : send_block_count(phases, large_recv_eighths<FMT, T>(ep));
    // One call with x moving a small bf16 round: this rank's own tokens go from x to its rows (kPhaseLocalX)
    const bool local_from_x = FMT == kFmtBf16 && sizeof(T) == 2 && (phases & kPhaseLocalX) && a.x != nullptr && small;
    if (phases & kPhaseSend)
        phase_send<FMT, T>(ep, a, send_round, smem, send_blocks, (phases & kPhaseNotify) != 0, local_from_x,
                           early ? s_early_ready : nullptr);
    // A small round's fused launch: the blocks that sent do not receive; the receive-only blocks place the few
    // messages of a decode round (a sender that went on to receive first loaded every tally and laid the round
    // out again, 2 us after its last send, for items long taken).
    const int first_recv = (phases & kPhaseSend) && send_blocks < static_cast<int>(gridDim.x) && small ? send_blocks : 0;
    if ((phases & kPhaseRecv) && static_cast<int>(blockIdx.x) >= first_recv)
        phase_recv<FMT>(ep, a, recv_round, smem, first_recv, local_from_x);
    // The block that entered last advances the rounds of the phases this launch ran.
    if (last_to_enter(ep, C_ENTER_DISPATCH, entered)) {
        if (phases & kPhaseSend) ctr[C_DISP_ROUND] = send_round + 1;
        if (phases & kPhaseRecv) ctr[C_RECV_ROUND] = recv_round + 1;
    }
}

}  // namespace cuep

// The runtime compiles this file a wire format at a time (cuep/_kernels.py PARTS): -DCUEP_DISPATCH_FORMAT_<NAME>
// keeps that format's kernels only (CUEP_IF_<name>); with no such macro the file holds every kernel.
#if defined(CUEP_DISPATCH_FORMAT_BF16) || defined(CUEP_DISPATCH_FORMAT_FP8) || defined(CUEP_DISPATCH_FORMAT_NVFP4) || \
    defined(CUEP_DISPATCH_FORMAT_MXFP4)
#define CUEP_DISPATCH_ONE_FORMAT 1
#endif
#if !defined(CUEP_DISPATCH_ONE_FORMAT) || defined(CUEP_DISPATCH_FORMAT_BF16)
#define CUEP_IF_bf16(...) __VA_ARGS__
#else
#define CUEP_IF_bf16(...)
#endif
#if !defined(CUEP_DISPATCH_ONE_FORMAT) || defined(CUEP_DISPATCH_FORMAT_FP8)
#define CUEP_IF_fp8(...) __VA_ARGS__
#else
#define CUEP_IF_fp8(...)
#endif
#if !defined(CUEP_DISPATCH_ONE_FORMAT) || defined(CUEP_DISPATCH_FORMAT_NVFP4)
#define CUEP_IF_nvfp4(...) __VA_ARGS__
#else
#define CUEP_IF_nvfp4(...)
#endif
#if !defined(CUEP_DISPATCH_ONE_FORMAT) || defined(CUEP_DISPATCH_FORMAT_MXFP4)
#define CUEP_IF_mxfp4(...) __VA_ARGS__
#else
#define CUEP_IF_mxfp4(...)
#endif

// Every kernel takes one DispatchParams (ep/params.cuh) by value; cuep/params.py builds it. Each kernel family below
// has one entry per (wire format, input dtype): CUEP_EACH_DISPATCH(X) calls X(format name, source name, format, T)
// for the formats of this compile.
#define CUEP_EACH_DISPATCH(X)                                                                                \
    CUEP_IF_bf16(X(bf16, bf16, kFmtBf16, cuep::bf16_t))                                                      \
    CUEP_IF_bf16(X(bf16, f32, kFmtBf16, float))                                                              \
    CUEP_IF_fp8(X(fp8, bf16, kFmtFp8, cuep::bf16_t))                                                         \
    CUEP_IF_fp8(X(fp8, f32, kFmtFp8, float))                                                                 \
    CUEP_IF_nvfp4(X(nvfp4, bf16, kFmtNvfp4, cuep::bf16_t))                                                   \
    CUEP_IF_nvfp4(X(nvfp4, f32, kFmtNvfp4, float))                                                           \
    CUEP_IF_mxfp4(X(mxfp4, bf16, kFmtMxfp4, cuep::bf16_t))                                                   \
    CUEP_IF_mxfp4(X(mxfp4, f32, kFmtMxfp4, float))

// The protocol (cuep_dispatch_<format>_from_<source>).
#define CUEP_DISPATCH(FMT_NAME, SRC_NAME, FMT, T)                                                            \
    extern "C" __global__ void __launch_bounds__(cuep::kDispatchThreads)                                     \
        cuep_dispatch_##FMT_NAME##_from_##SRC_NAME(const __grid_constant__ cuep::DispatchParams params) {    \
        const cuep::DispatchArgs call = params.call; /* in registers: immutable through every fence */       \
        cuep::dispatch_kernel<cuep::FMT, T>(params.ep, call);                                                 \
    }
CUEP_EACH_DISPATCH(CUEP_DISPATCH)

// The one-rank rounds (dispatch/local.cuh), kernels of their own so that neither path's registers limit the other's.
// cuep/ep.py launches them for a fused call when the group is one rank: a small round (cuep_dispatch_local_*) or a
// larger one (cuep_dispatch_local_large_*), one launch each, as programmatic dependents (await_previous_grid); a
// small round that encodes, of at most kSplitTokens tokens whose items fit the item warps (cuep/ep.py _split_fits),
// laid out split (cuep_dispatch_local_split_*: never bf16 from bf16, whose copy is the plain one's).
#define CUEP_LOCAL_KERNEL(NAME)                                                                              \
    extern "C" __global__ void __launch_bounds__(cuep::kDispatchThreads, 1)                                  \
        NAME(const __grid_constant__ cuep::DispatchParams params)
// A small round's kernel, plain (KIND local_, SPLIT false) or laid out split (local_split_, true).
#define CUEP_DISPATCH_LOCAL_SMALL(KIND, SPLIT, FMT_NAME, SRC_NAME, FMT, T)                                   \
    CUEP_LOCAL_KERNEL(cuep_dispatch_##KIND##FMT_NAME##_from_##SRC_NAME) {                                    \
        extern __shared__ __align__(16) char smem[];                                                         \
        cuep::await_previous_grid();                                                                         \
        const cuep::DispatchArgs call = params.call;                                                         \
        /* (the failed flag is checked inside, once the layout is built: its load then costs no latency) */     \
        if (cuep::local_round(params.ep, call.phases) && cuep::small_round(params.ep, call.num_tokens))       \
            cuep::dispatch_local<cuep::FMT, T, true, SPLIT>(params.ep, call, smem, 0, [] { return true; });   \
    }
#define CUEP_DISPATCH_LOCAL(FMT_NAME, SRC_NAME, FMT, T)                                                      \
    CUEP_DISPATCH_LOCAL_SMALL(local_, false, FMT_NAME, SRC_NAME, FMT, T)
#define CUEP_DISPATCH_LOCAL_SPLIT(FMT_NAME, SRC_NAME, FMT, T)                                                \
    CUEP_DISPATCH_LOCAL_SMALL(local_split_, true, FMT_NAME, SRC_NAME, FMT, T)
#define CUEP_DISPATCH_LOCAL_LARGE(FMT_NAME, SRC_NAME, FMT, T)                                                \
    CUEP_LOCAL_KERNEL(cuep_dispatch_local_large_##FMT_NAME##_from_##SRC_NAME) {                              \
        extern __shared__ __align__(16) char smem[];                                                         \
        cuep::await_previous_grid();                                                                         \
        const cuep::DispatchArgs call = params.call;                                                         \
        if (cuep::local_round(params.ep, call.phases) && !cuep::has_failed(params.ep))                       \
            cuep::dispatch_local_large<cuep::FMT, T>(params.ep, call, smem);                                  \
    }
CUEP_EACH_DISPATCH(CUEP_DISPATCH_LOCAL)
// (every entry of CUEP_EACH_DISPATCH but bf16 from bf16)
CUEP_IF_bf16(CUEP_DISPATCH_LOCAL_SPLIT(bf16, f32, kFmtBf16, float))
CUEP_IF_fp8(CUEP_DISPATCH_LOCAL_SPLIT(fp8, bf16, kFmtFp8, cuep::bf16_t))
CUEP_IF_fp8(CUEP_DISPATCH_LOCAL_SPLIT(fp8, f32, kFmtFp8, float))
CUEP_IF_nvfp4(CUEP_DISPATCH_LOCAL_SPLIT(nvfp4, bf16, kFmtNvfp4, cuep::bf16_t))
CUEP_IF_nvfp4(CUEP_DISPATCH_LOCAL_SPLIT(nvfp4, f32, kFmtNvfp4, float))
CUEP_IF_mxfp4(CUEP_DISPATCH_LOCAL_SPLIT(mxfp4, bf16, kFmtMxfp4, cuep::bf16_t))
CUEP_IF_mxfp4(CUEP_DISPATCH_LOCAL_SPLIT(mxfp4, f32, kFmtMxfp4, float))
CUEP_EACH_DISPATCH(CUEP_DISPATCH_LOCAL_LARGE)
