// Multi-node dispatch and combine (cfg.n_nodes > 1): NVSHMEM puts with signals between nodes, node peers' memory by
// load/store inside a node. Built by cuep/nvshmem.py (NVRTC + nvJitLink against NVSHMEM's device library, with a
// prelude that selects NVSHMEM's device transports); launched by cuep/internode.py. docs/internode.md has the
// protocol; in short, with G GPUs per node, M nodes, rank r = node * G + local:
//
//   dispatch  send    encode each token once into my x_send row; put it once to every other node that holds one of
//                     its experts, to the peer with my local index there (its "forwarder"), one put-with-signal
//                     (count +1) per row; then my header (token count, ids, weights) to every other node (signal set
//                     to the round); my own node reads x_send and the header in place (own_ready)
//             relay   a forwarder waits for each remote node's header and rows (the count it expects from the
//                     header) and republishes "source node n complete" for its node peers (relay flag)
//             count   every rank reads every source's header (in place on the node: the source's own, or the
//                     forwarder's copy) and counts its rows per (source, chunk of tokens, local expert)
//             offsets one block: group sizes, row offsets, each (source, chunk, expert)'s first row
//             place   copy each row (payload, scales into the output layout, src_info) from the node peer that
//                     holds it; pad groups; note where each (source, token, k) went (row_of) for combine
//   combine   send    each rank writes, per (source, token), its router-weighted partial sum (weights given to
//                     dispatch) or its rows (weights given to combine, or unreduced) into the token's forwarder's
//                     stage on this node, then counts itself done at every node peer
//             relay   a forwarder sums a token's node partials (or takes its rows) and puts one row per token (or per
//                     row) back to the source with a signal (count +1), then +1 "relay done" to every source it serves
//             recv    the source waits for every node's rows and sums them (plus shared expert and residual)
//
// Areas that peers write are double-buffered by round parity; every hop signals every round (even with no data),
// which orders round q + 2's writes after round q's reads (docs/internode.md: "Why parity suffices").
#include "node_combine.cuh"
#include "node_dispatch.cuh"

using cuep::node::CombineCall;
using cuep::node::DispatchCall;

#define CUEP_ND_SEND(FMT_NAME, FMT, SRC_NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(512) cuep_nd_send_##FMT_NAME##_from_##SRC_NAME(                 \
        const __grid_constant__ DispatchCall c) {                                                                \
        cuep::node::dispatch_send<cuep::FMT, T>(c);                                                              \
    }
CUEP_ND_SEND(bf16, kFmtBf16, bf16, cuep::bf16_t)
CUEP_ND_SEND(bf16, kFmtBf16, f32, float)
CUEP_ND_SEND(fp8, kFmtFp8, bf16, cuep::bf16_t)
CUEP_ND_SEND(fp8, kFmtFp8, f32, float)
CUEP_ND_SEND(nvfp4, kFmtNvfp4, bf16, cuep::bf16_t)
CUEP_ND_SEND(nvfp4, kFmtNvfp4, f32, float)
CUEP_ND_SEND(mxfp4, kFmtMxfp4, bf16, cuep::bf16_t)
CUEP_ND_SEND(mxfp4, kFmtMxfp4, f32, float)

extern "C" __global__ void __launch_bounds__(512) cuep_nd_relay(const __grid_constant__ DispatchCall c) {
    cuep::node::dispatch_relay(c);
}
extern "C" __global__ void __launch_bounds__(512) cuep_nd_count(const __grid_constant__ DispatchCall c) {
    cuep::node::dispatch_count(c);
}
extern "C" __global__ void __launch_bounds__(512) cuep_nd_offsets(const __grid_constant__ DispatchCall c) {
    cuep::node::dispatch_offsets(c);
}
#define CUEP_ND_PLACE(FMT_NAME, FMT)                                                                             \
    extern "C" __global__ void __launch_bounds__(512) cuep_nd_place_##FMT_NAME(const __grid_constant__ DispatchCall c) { \
        cuep::node::dispatch_place<cuep::FMT>(c);                                                                \
    }
CUEP_ND_PLACE(bf16, kFmtBf16)
CUEP_ND_PLACE(fp8, kFmtFp8)
CUEP_ND_PLACE(nvfp4, kFmtNvfp4)
CUEP_ND_PLACE(mxfp4, kFmtMxfp4)

#define CUEP_NC(NAME, C)                                                                                         \
    extern "C" __global__ void __launch_bounds__(512) cuep_nc_send_##NAME(const __grid_constant__ CombineCall c) { \
        cuep::node::combine_send<C>(c);                                                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(512) cuep_nc_relay_##NAME(const __grid_constant__ CombineCall c) { \
        cuep::node::combine_relay<C>(c);                                                                         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(512) cuep_nc_recv_##NAME(const __grid_constant__ CombineCall c) { \
        cuep::node::combine_recv<C>(c);                                                                          \
    }
CUEP_NC(bf16, uint16_t)
CUEP_NC(f32, float)
