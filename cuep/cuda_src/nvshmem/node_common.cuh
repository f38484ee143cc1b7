// The multi-node kernels' shared plumbing: the parameter structs (cuep/internode.py mirrors them), the private
// state, the signals in the symmetric heap, errors and bounded waits, routing rules, headers and where a source's
// data is read from (SourceView). Included by internode.cu only (it needs NVSHMEM's headers first).
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common.cuh"
#include "formats.cuh"

namespace cuep {
namespace node {

constexpr int kMaxNodeGpus = 8;
constexpr int kChunk = 128;  // tokens per (source, chunk) work unit of count / place

// One rank's multi-node buffer (cuep/internode.py: NODE_PARAMS_FIELDS, same order; all int64).
struct NodeParams {
    long long rank, n_ranks, gpus_per_node, n_nodes, node, local;
    long long n_local, n_experts, top_k, hidden, max_tokens;
    long long payload_bytes, scale_bytes, row_bytes, hdr_bytes;  // a row: payload | scales (each 16-aligned)
    long long row_align, n_scales, k_tiles, n_groups, shared, capacity, n_chunks;
    long long combine_itemsize, comb_slots;  // comb_slots = max(top_k, n_nodes)
    long long small_tokens;  // a source with at most this many tokens puts its rows straight to each rank (0: never)
    long long skip_a2a;      // every rank holds the same tokens and keeps its own: nothing crosses ranks
    long long ar_size, ar_index;  // the shared expert's tokens split over ar_size ranks (skip_a2a): my share
    long long timeout_ns, err_ptr, state_ptr, scratch_ptr, row_of_ptr;
    long long heap;  // my symmetric heap (the local address of the symmetric object)
    long long off_sig, off_x_send, off_hdr_send, off_x_recv, off_hdr_recv, off_stage, off_c_send, off_c_recv;
    long long off_x_dir;  // [2][R][small_tokens][row] rows a small round's sources put straight to me
    long long node_heap[kMaxNodeGpus];  // node peers' heaps (by local index) as this GPU maps them (nvshmem_ptr)
};

struct NodeDispatchArgs {
    const void* x;              // [N, H] bf16 or float32
    const int* topk_ids;        // [N, K]
    const float* topk_weights;  // [N, K] or nullptr
    uint8_t* tokens;            // [capacity, payload]
    void* scales_out;           // fp8 float32 [n_scales, capacity]; fp4 tiled bytes; bf16 unused
    unsigned* row_offsets;      // [n_groups + 1]
    int* expert_ids;            // [n_groups]
    unsigned* scales_offsets;   // [n_groups] (fp4)
    int* src_info;              // [capacity, 2]
    int* row_src;               // [capacity]
    int num_tokens;
    float global_scale;
};

enum Mode : int { kPartial = 0, kWeighted = 1, kUnreduced = 2 };

struct NodeCombineArgs {
    const void* expert_out;     // [capacity, H] combine dtype
    const int* topk_ids;        // [N, K] my tokens (as dispatched)
    const float* topk_weights;  // [N, K] (kWeighted) or nullptr
    const void* residual;       // [N, H] or nullptr
    void* out;                  // [N, H] or [N, K (+1), H]
    int num_tokens;
    int mode;
};

struct DispatchCall {
    NodeParams p;
    NodeDispatchArgs a;
};
struct CombineCall {
    NodeParams p;
    NodeCombineArgs a;
};

// ---- state (int64, private to the rank; zeroed by Buffer.reset) --------------------------------------------
enum State : int {
    S_ERROR = 0,        // nonzero once a kernel of this rank failed (first reporter wins)
    S_DROUND = 1,       // dispatch rounds sent
    S_CROUND = 2,       // combine rounds sent
    S_DONE = 3,         // [8] blocks done, per kernel (the last one finishes the kernel)
    S_EXP_ROWS = 16,    // [2][M] rows the relay expects from each node, cumulative, by parity
};
__device__ __forceinline__ long long* state(const NodeParams& p) { return reinterpret_cast<long long*>(p.state_ptr); }
__device__ __forceinline__ long long* exp_crecv(const NodeParams& p) {  // [2][M] combine rows expected per node
    return state(p) + S_EXP_ROWS + 2 * p.n_nodes;
}
__device__ __forceinline__ long long* exp_direct(const NodeParams& p) {  // [2][R] direct rows expected per source
    return state(p) + S_EXP_ROWS + 4 * p.n_nodes;
}
// Kernel ids (ErrorRecord.kernel; cuep/buffer.py KERNEL_NAMES)
enum Kernel : int { K_SEND = 5, K_RELAY = 6, K_RECV = 7, K_CSEND = 8, K_CRELAY = 9, K_CRECV = 10 };
enum Done : int { D_SEND = 0, D_PLACE = 1, D_CSEND = 2, D_CRELAY = 3, D_CRECV = 4 };

// ---- signals (uint64 in the symmetric heap) ----------------------------------------------------------------
//   hdr [2][M]    a remote node's header landed (set to round + 1)
//   rows [2][M]   rows from a remote node (count; cumulative)
//   relay [2][M]  forwarder: node n's rows and header of this round are here (round + 1), for node peers
//   own [2]       my x_send rows and header of this round are written (round + 1), for node peers
//   stage [2]     node peers done writing this combine round into my stage (count; cumulative)
//   crecv [2][M]  combine rows from node m (count; cumulative)
__device__ __forceinline__ uint64_t* sigs(const NodeParams& p, long long base) {
    return reinterpret_cast<uint64_t*>(base + p.off_sig);
}
__device__ __forceinline__ long long sig_hdr(const NodeParams& p, int par, int n) { return par * p.n_nodes + n; }
__device__ __forceinline__ long long sig_rows(const NodeParams& p, int par, int n) {
    return 2 * p.n_nodes + par * p.n_nodes + n;
}
__device__ __forceinline__ long long sig_relay(const NodeParams& p, int par, int n) {
    return 4 * p.n_nodes + par * p.n_nodes + n;
}
__device__ __forceinline__ long long sig_own(const NodeParams& p, int par) { return 6 * p.n_nodes + par; }
__device__ __forceinline__ long long sig_stage(const NodeParams& p, int par) { return 6 * p.n_nodes + 2 + par; }
__device__ __forceinline__ long long sig_crecv(const NodeParams& p, int par, int m) {
    return 6 * p.n_nodes + 4 + par * p.n_nodes + m;
}
__device__ __forceinline__ long long sig_direct(const NodeParams& p, int par, int s) {  // [2][R] direct rows (count)
    return 8 * p.n_nodes + 4 + par * p.n_ranks + s;
}
// The shared expert's tokens of this rank, [lo, hi) of its N (all of them unless skip_a2a splits them).
__device__ __forceinline__ int shared_lo(const NodeParams& p, int n) {
    return static_cast<int>(p.ar_index * n / p.ar_size);
}
__device__ __forceinline__ int shared_hi(const NodeParams& p, int n) {
    return static_cast<int>((p.ar_index + 1) * n / p.ar_size);
}
// A round of `n_tok` tokens from a source on another node is small: its rows come straight to every rank.
__device__ __forceinline__ bool is_direct(const NodeParams& p, int n_tok) { return n_tok <= p.small_tokens; }

// ---- errors and bounded waits ------------------------------------------------------------------------------
__device__ __forceinline__ void report(const NodeParams& p, int status, int kernel, int expert, int src) {
    if (atomicCAS(reinterpret_cast<unsigned long long*>(state(p) + S_ERROR), 0ull,
                  static_cast<unsigned long long>(status)) == 0ull)
        write_error_record(reinterpret_cast<ErrorRecord*>(p.err_ptr), status, kernel, expert, src);
}
__device__ __forceinline__ bool failed(const NodeParams& p) {
    return *reinterpret_cast<volatile long long*>(state(p) + S_ERROR) == kStatusTimeout;
}
// Spin (this thread) until *sig >= want (acquire, system scope), at most timeout_ns; false (recorded) otherwise.
__device__ bool wait_ge(const NodeParams& p, const uint64_t* sig, uint64_t want, int kernel, int src) {
    uint64_t t0 = 0, checked = 0;
    while (load_acquire_u64(sig) < want) {
        const uint64_t now = global_timer_ns();
        if (t0 == 0) t0 = checked = now;
        if (now - checked > 1000) {
            if (failed(p)) return false;
            checked = now;
        }
        if (now - t0 > static_cast<uint64_t>(p.timeout_ns)) {
            report(p, kStatusTimeout, kernel, -1, src);
            return false;
        }
        __nanosleep(64);
    }
    return true;
}
// The same for a signal that NVSHMEM puts write (my own heap, a symmetric address): once it holds, NVSHMEM's own
// wait (which returns at once) makes the data the signal announces visible here; on platforms where the proxy
// transport must flush the NIC's writes into GPU memory (NVSHMEM's "CST at target"), that step does it.
__device__ bool wait_put_signal(const NodeParams& p, const uint64_t* sig, uint64_t want, int kernel, int src) {
    if (!wait_ge(p, sig, want, kernel, src)) return false;
    nvshmem_signal_wait_until(const_cast<uint64_t*>(sig), NVSHMEM_CMP_GE, want);
    return true;
}

// Every block calls it at its end (all threads): true in every thread of the last block to finish, whose reads then
// see every other block's writes (each block fences before it counts itself done). Resets the count for the next
// launch.
__device__ __forceinline__ bool last_block(const NodeParams& p, int which) {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        unsigned long long* c = reinterpret_cast<unsigned long long*>(state(p) + S_DONE + which);
        s_last = atomicAdd(c, 1ull) == gridDim.x - 1;
        if (s_last) {
            __threadfence_system();
            *c = 0;
        }
    }
    __syncthreads();
    return s_last;
}

// ---- routing ---------------------------------------------------------------------------------------------------
// Choice k of a token is taken when its expert is in range and not chosen by an earlier k (the sender reports the
// bad ones; every reader applies the same rule, so all agree on the rows).
__device__ __forceinline__ bool valid_choice(const int* ids, int k, int K, int E) {
    const int e = ids[k];
    if (e < 0 || e >= E) return false;
    for (int j = 0; j < k; ++j)
        if (ids[j] == e) return false;
    return true;
}
__device__ __forceinline__ int rank_of_expert(const NodeParams& p, int e) { return e / static_cast<int>(p.n_local); }
__device__ __forceinline__ int node_of_rank(const NodeParams& p, int r) { return r / static_cast<int>(p.gpus_per_node); }

// A header: int n at 0, then per token K ids and K weights (int32 / float32).
__device__ __forceinline__ const int* hdr_ids(const char* hdr, long long t, int K) {
    return reinterpret_cast<const int*>(hdr + 16 + t * 8 * K);
}
__device__ __forceinline__ const float* hdr_weights(const char* hdr, long long t, int K) {
    return reinterpret_cast<const float*>(hdr + 16 + t * 8 * K + 4 * K);
}
__device__ __forceinline__ int hdr_n(const char* hdr) { return *reinterpret_cast<const volatile int*>(hdr); }

// Where source s's header, rows and readiness flag of dispatch parity `par` are, as this rank reads them: on my
// node, the source's own x_send / header (flag: its own); from another node, my node's forwarder's copy (flag: the
// forwarder's relay flag for that node).
// A small round (is_direct) from another node puts its rows straight into my x_dir: source_rows() says where.
struct SourceView {
    const char* hdr;
    const char* rows;
    const uint64_t* ready;
    bool remote;
};
__device__ __forceinline__ SourceView source_view(const NodeParams& p, int s, int par) {
    const int G = static_cast<int>(p.gpus_per_node), M = static_cast<int>(p.n_nodes);
    const int n = s / G, f = s % G;
    const long long base = p.node_heap[f];
    const long long T = p.max_tokens;
    SourceView v;
    if (n == p.node) {
        v.hdr = reinterpret_cast<const char*>(base + p.off_hdr_send + par * p.hdr_bytes);
        v.rows = reinterpret_cast<const char*>(base + p.off_x_send + par * T * p.row_bytes);
        v.ready = sigs(p, base) + sig_own(p, par);
    } else {
        v.hdr = reinterpret_cast<const char*>(base + p.off_hdr_recv + (static_cast<long long>(par) * M + n) * p.hdr_bytes);
        v.rows = reinterpret_cast<const char*>(base + p.off_x_recv + (static_cast<long long>(par) * M + n) * T * p.row_bytes);
        v.ready = sigs(p, base) + sig_relay(p, par, n);
    }
    v.remote = n != p.node;
    return v;
}
__device__ __forceinline__ const char* direct_rows(const NodeParams& p, int s, int par) {
    return reinterpret_cast<const char*>(p.heap + p.off_x_dir +
                                         (static_cast<long long>(par) * p.n_ranks + s) * p.small_tokens * p.row_bytes);
}
__device__ __forceinline__ const char* source_rows(const NodeParams& p, const SourceView& v, int s, int par, int n_tok) {
    return v.remote && is_direct(p, n_tok) ? direct_rows(p, s, par) : v.rows;
}

// ---- scratch (private, device memory; cuep/internode.py scratch_bytes) ---------------------------------------
//   src_n [R]                 tokens of each source this round
//   cnt   [R][NC][L]          rows per (source, chunk, local expert)
//   base  [R][NC][L]          first row of each
//   group [n_groups + 1]      row offsets (copy), then tile_start [n_groups] (fp4)
__device__ __forceinline__ int* scr_src_n(const NodeParams& p) { return reinterpret_cast<int*>(p.scratch_ptr); }
__device__ __forceinline__ int* scr_cnt(const NodeParams& p) { return scr_src_n(p) + p.n_ranks; }
__device__ __forceinline__ int* scr_base(const NodeParams& p) {
    return scr_cnt(p) + p.n_ranks * p.n_chunks * p.n_local;
}
__device__ __forceinline__ int* scr_tile_start(const NodeParams& p) {
    return scr_base(p) + p.n_ranks * p.n_chunks * p.n_local;
}

__device__ __forceinline__ int lane_id() { return threadIdx.x % kWarp; }
__device__ __forceinline__ int global_warp() { return (blockIdx.x * blockDim.x + threadIdx.x) / kWarp; }
__device__ __forceinline__ int n_global_warps() { return gridDim.x * blockDim.x / kWarp; }

}  // namespace node
}  // namespace cuep
