// The host-device contract of the EP kernels: every kernel takes one struct by value (`__grid_constant__`, so its
// fields are read from the constant bank), built on the host by cuep/params.py. A CPU test compiles a file of
// static_asserts that checks every field's offset here against the NumPy dtypes there.
//
//   EPParams       one rank's buffer: sizes, region offsets, peers' base addresses (fixed for a Buffer's life)
//   DispatchArgs   one dispatch call: the inputs and the output arrays, token count, phases
//   CombineArgs    one combine call
//   DispatchParams = EPParams + DispatchArgs, CombineParams = EPParams + CombineArgs: the kernel arguments
#pragma once
#include "../common.cuh"

namespace cuep {

constexpr int kMaxRanks = 8;
// dispatch notify of a large round: tokens in at most this many contiguous ranges, one per block (config.py: scratch)
constexpr int kNotifyRanges = 256;

// One rank's symmetric buffer and group, all int64 (cuep/params.py: self_base, EP_PARAMS_FIELDS, peer_base, in this
// order). What the decode kernels read first leads, so that it spans the fewest 64-byte lines of the constant bank.
struct EPParams {
    long long self_base;         // peer_base[rank]: this rank's own buffer, without the indexed read
    long long rank;
    long long n_ranks;
    long long n_local;           // local experts per rank
    long long n_experts;
    long long top_k;
    long long hidden;
    long long n_groups;
    long long shared;            // fused shared expert: group 0 holds this rank's own tokens (its share of them)
    long long skip_a2a;
    long long ar_size;           // allreduce_world_size A: the shared expert's tokens split over A ranks (1: none)
    long long ar_index;          // this rank's position in its all-reduce group (rank % A)
    long long small_tokens;      // small_batch_tokens: a round of at most this many tokens is staged (0: off)
    long long row_align;
    long long payload_bytes;
    long long scale_bytes;       // scale bytes of one message
    long long n_scales;
    long long k_tiles;
    long long off_tokens;
    long long off_counters;
    long long off_scratch;       // private: per-choice slots [T, K], message slots [T, 8], rank masks [T], ranges
    long long off_scale_rows;    // private: where each row's scales are in a large dispatch round
    long long timeout_ns;
    long long err_ptr;           // ErrorRecord* in host-mapped memory
    long long n_src;             // source ranks a rank receives from: n_ranks, or 1 with skip_a2a
    long long src_index;         // my index in a receiver's per-source regions: rank, or 0 with skip_a2a
    long long max_tokens;
    long long capacity;
    long long meta_bytes;
    long long meta_ids;
    long long meta_w;
    long long meta_rows;
    long long meta_scales;
    long long combine_itemsize;
    long long stage_record;      // bytes of one staging record: meta | chunk flags | payload
    long long off_comb_recv;
    long long off_meta;
    long long off_tally;
    long long off_comb_ready;
    long long off_comb_arrived;
    long long off_stage;         // small rounds' messages [2 parities, n_src, small_tokens] x (meta | payload)
    long long off_comb_poll;     // bf16 partial sums of tokens < poll_tokens [2 parities, poll_tokens, dests, H]
    long long poll_tokens;       // EPConfig.combine_poll_tokens (0: no comb_poll)
    long long peer_base[kMaxRanks];  // base address of each rank's symmetric buffer, as this GPU maps it

    // This rank's own buffer (peers' buffers only through the transport: ep/transport.cuh).
    __device__ __forceinline__ char* local(long long off) const {
        return reinterpret_cast<char*>(self_base) + off;
    }
    __device__ __forceinline__ int* counters() const { return reinterpret_cast<int*>(local(off_counters)); }
    __device__ __forceinline__ ErrorRecord* err() const { return reinterpret_cast<ErrorRecord*>(err_ptr); }
};

// Phase bits of the dispatch and combine kernels: the same kernel runs any contiguous subset, so the fused call,
// the async/wait halves, and several ranks simulated on one GPU (phases launched rank by rank) share one code path.
constexpr int kPhaseNotify = 1;   // publish this round's histogram (dispatch) or readiness (combine)
constexpr int kPhaseSend = 2;     // move the data
constexpr int kPhaseRecv = 4;     // wait for it and lay it out
// dispatch: the send and receive phases of this round are one call with x (cuep.dispatch, not dispatch_async):
// a small bf16 round's receiver then takes its own tokens straight from x (local_from_x), and no sender stages them
constexpr int kPhaseLocalX = 8;

// One dispatch call (cuep/params.py: DISPATCH_ARGS_DTYPE).
struct DispatchArgs {
    // the call's own fields first (cuep/params.py CALL_FIELDS: one span, packed per call)
    const void* x;              // [N, H] bf16 or float32 (nullptr in a receive-only launch)
    const int* topk_ids;        // [N, K]
    const float* topk_weights;  // [N, K] or nullptr
    int num_tokens;
    float global_scale;         // nvfp4
    int phases;                 // kPhase* bits
    int chunk_plan;             // a small one-rank round's chunks, from the host (cuep/ep.py _small_round_chunks):
                                // spans per chunk | chunks per token << 16; 0 elsewhere
    // the rank's persistent arrays
    void* scales_out;           // fp8: float32 [n_scales, capacity]; fp4: swizzled bytes; bf16: unused
    unsigned* row_offsets;      // [G + 1]
    int* expert_ids;            // [G]
    unsigned* scales_offsets;   // [G] (fp4 formats)
    int* src_info;              // [capacity, 2]
    int* row_src;               // [capacity] source rank of each row, -1 for padding
    float* row_weight;          // [capacity]
    int* msg_rows;              // [n_src, T, K] rows, then [n_src, T, K] their weights (msg_weights)
    int* msg_token;             // [n_src, T]
    int* msg_j;                 // [n_src, T] my position among the token's destination ranks
    int* msg_count;             // [n_src]
    uint8_t* scale_tile_rows;   // fp4: [tiles of scales_out] rows of each 128-row tile that may be nonzero (the rest
                                // are zero: pad_group zeroes only a tile's stale rows); nullptr elsewhere
};

enum CombineMode : int { kPartial = 0, kWeighted = 1, kUnreduced = 2 };

// One combine call (cuep/params.py: COMBINE_ARGS_DTYPE), ordered as DispatchArgs.
struct CombineArgs {
    const void* expert_out;     // [capacity, H] combine dtype: row i is the expert output of dispatched row i
    const int* topk_ids;        // [N, K] of this rank's tokens (as passed to dispatch)
    const float* topk_weights;  // [N, K] (kWeighted) or nullptr
    const void* residual;       // [N, H] or nullptr
    void* out;                  // [N, H] or [N, K (+1), H]
    int num_tokens;
    int mode;                   // CombineMode
    int phases;                 // kPhase* bits
    int chunk_plan;             // a one-rank combine's chunks, from the host (cuep/ep.py _combine_chunks): vectors
                                // per chunk | chunks per token << 16; 0 elsewhere
    const int* src_info;        // [capacity, 2]
    const int* row_src;         // [capacity]
    const float* row_weight;    // [capacity]
    const int* msg_rows;        // [n_src, T, K] rows, then their weights (msg_weights)
    const int* msg_token;       // [n_src, T]
    const int* msg_j;           // [n_src, T]
    const int* msg_count;       // [n_src]
    const unsigned* row_offsets;  // [G + 1]
};

struct DispatchParams {
    EPParams ep;
    DispatchArgs call;
};
struct CombineParams {
    EPParams ep;
    CombineArgs call;
};

}  // namespace cuep
