// The records a dispatch round writes into its destinations, and their signals:
//   tally rows   one per (parity, source) at each destination: the source's expert histogram, token count and
//                message count, every entry stamped with the round (signal_stamped: no fence needed)
//   messages     one per (token, destination rank): a metadata record (the token, its top-k ids, rows and weights,
//                its scales) followed by one chunk flag per piece of the payload; a large round's payload goes
//                straight to the row of the token's first local expert there, a small round's into a staging
//                record after the flags. Each chunk's flag is set after fence_puts, so a receiver that sees every
//                flag of a message with this round's stamp sees all of it.
// Nothing here is re-armed between rounds: stamps only grow.
#pragma once
#include "../ep.cuh"

namespace cuep {

// ---- message chunk flags --------------------------------------------------------------------------------
// A message (one token for one destination) may be sent by several warps, one per chunk. Every record (a large
// round's metadata record, a small round's staging record) has a flag per chunk: after its stores and a
// system-scope fence, each chunk stores chunk_flag (the round's stamp and the chunk count). The message is complete
// when flag 0 carries this round's stamp and the chunk count n, and flags 1..n-1 the stamp. Nothing re-arms the
// flags (a stale flag carries an older round's stamp), so no round has an end-of-round count or a last block.
// (Large rounds had a 32-bit tag that every chunk added to, re-armed by the receive phase's last block: the count and
// the re-arm took the last 8 us of a 2 x H200 N = 4096 dispatch.)
constexpr int kMaxChunks = 255;

// A staged chunk's flag: the round's stamp (bits 8-30, never 0, so a zeroed flag is no round's) | the chunk count.
__device__ __forceinline__ unsigned chunk_stamp(int round) { return (static_cast<unsigned>(round) & 0x7FFFFFu) + 1u; }
__device__ __forceinline__ int chunk_flag(int round, int n_chunks) {
    return static_cast<int>(chunk_stamp(round) << 8 | static_cast<unsigned>(n_chunks));
}

// Wait (bounded; all lanes) until every chunk of a staged message has landed: flag 0 carries this round's stamp
// and the chunk count n, and flags 1..n-1 carry the stamp (each lane acquires its own flags, then the warp
// barrier orders every lane's reads after them). `n_flags`: the record's flags (>= any chunk count). False
// (after recording whom it waited for) on timeout or once the rank has failed.
__device__ bool warp_wait_chunk_flags(const int* flags, int n_flags, int round, const EPParams& ep, int kernel, int src,
                                      int lane) {
    const unsigned stamp = chunk_stamp(round);
    SpinClock clock;  // lane 0's
    for (;;) {
        const unsigned v = lane < n_flags ? static_cast<unsigned>(poll_flag(flags + lane)) : 0u;
        const unsigned f0 = __shfl_sync(0xffffffffu, v, 0);
        bool landed = false;
        if ((f0 >> 8) == stamp) {
            const int n = static_cast<int>(f0 & 0xFFu);
            landed = __all_sync(0xffffffffu, lane >= n || (v >> 8) == stamp);
            for (int j0 = kWarp; landed && j0 < n; j0 += kWarp) {
                const int j = j0 + lane;
                landed = __all_sync(0xffffffffu,
                                    j >= n || (static_cast<unsigned>(poll_flag(flags + j)) >> 8) == stamp);
            }
        }
        if (landed) break;
        const int stop = lane == 0 && clock.stop(ep, kernel, src);
        if (__shfl_sync(0xffffffffu, stop, 0)) return false;
        __nanosleep(32);
    }
    __syncwarp();
    return true;
}


// A tally row, one per (source, parity), written by the source into each destination:
// [tokens the source sends to each expert (E) | the source's token count | messages it sends to this destination].
// Each entry is one 64-bit store of (round + 1) << 32 | value, so the receiver takes an entry as soon as it carries
// the round's stamp: no system fence and no flag behind the row (a fence issued while the GPU's data was already
// on NVLink took 10-20 us). A tally row is also the readiness handshake: a rank publishes it only once it has
// consumed its previous round (stream order), and the stamps of one (row, parity) only grow.
__device__ __forceinline__ int tally_len(const EPParams& ep) { return static_cast<int>(ep.n_experts) + 2; }
__device__ __forceinline__ uint64_t* tally_row(const EPParams& ep, int rank, int par, int src) {
    return reinterpret_cast<uint64_t*>(remote(ep, rank, ep.off_tally)) + (par * ep.n_src + src) * tally_len(ep);
}
__device__ __forceinline__ uint64_t tally_entry(int round, int value) {
    return (static_cast<uint64_t>(round) + 1) << 32 | static_cast<uint32_t>(value);
}

// Publish [hist | num_tokens | n_msgs[dest]] of this round to every destination (all threads of the block).
__device__ void publish_tallies(const EPParams& ep, int round, const int* hist, int num_tokens, const int (&n_msgs)[8]) {
    const int E = static_cast<int>(ep.n_experts), E1 = tally_len(ep), me = static_cast<int>(ep.src_index);
    const int n_dest = n_dest_ranks(ep);
    for (int d = 0; d < n_dest; ++d) {
        const int r = dest_rank(ep, d);
        uint64_t* dst = tally_row(ep, r, round & 1, me);
        int msgs = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) msgs = i == r ? n_msgs[i] : msgs;
        for (int e = threadIdx.x; e < E1; e += blockDim.x)
            signal_stamped(r, dst + e, tally_entry(round, e < E ? hist[e] : (e == E ? num_tokens : msgs)));
    }
}

// Wait (bounded) for every source's tally row of this round and copy the values into shared memory. All threads
// of the block; false (after recording whom it waited for) on timeout or once the rank has failed.
__device__ bool load_tallies(const EPParams& ep, int round, int* s_tally, int kernel, int* s_ok) {
    const int E1 = tally_len(ep), n_src = static_cast<int>(ep.n_src);
    const uint64_t* tally = tally_row(ep, static_cast<int>(ep.rank), round & 1, 0);
    const uint32_t stamp = static_cast<uint32_t>(round) + 1;
    if (threadIdx.x == 0) *s_ok = 1;
    __syncthreads();
    SpinClock clock;  // one for all of this thread's entries
    for (int i = threadIdx.x; i < n_src * E1; i += blockDim.x) {
        uint64_t v;
        while (static_cast<uint32_t>((v = poll_u64(tally + i)) >> 32) != stamp) {
            if (clock.stop(ep, kernel, i / E1)) {
                *s_ok = 0;
                break;
            }
            __nanosleep(64);
        }
        if (!*reinterpret_cast<volatile int*>(s_ok)) break;
        s_tally[i] = static_cast<int>(static_cast<uint32_t>(v));
    }
    __syncthreads();
    return *s_ok != 0;
}


// ---- small rounds (decode): the staged protocol ----------------------------------------------------------------
// A round in which this rank sends at most P_SMALL_TOKENS tokens does not wait for any bookkeeping before its data
// moves. Token t goes to record t of this source's staging area at each destination it has a valid choice on
// (records of meta | payload, two parities): each send warp finds its token's destinations from its own top-k row.
// Meanwhile block 0 (notify) computes the round's bookkeeping in shared memory, in token order: the histogram,
// each destination's token mask and each choice's position in its (expert, this source) block, and publishes them
// (the tally row and a book row per destination, stamped entries). The receiver lays its rows out from the
// histograms, lists each source's messages from the token masks (message i of source s: its i-th token that comes
// here, as a large round's message slots), and copies each payload to its rows (block start + position). The only
// wait before sending is that every destination has finished the round before last (whose staging parity this
// round reuses): the destination's histogram of the previous round, normally long there. (Until the sixth
// session every send block computed the whole book itself before its first store: 7 us of a 2-GPU decode.)
__device__ __forceinline__ bool small_round(const EPParams& ep, int num_tokens) {
    return ep.small_tokens > 0 && num_tokens <= ep.small_tokens;
}
// A source's round is staged iff its token count (tally column E) was small: the receiver's view of the same rule.
__device__ __forceinline__ bool staged_source(const EPParams& ep, const int* s_tally, int s) {
    return ep.small_tokens > 0 && s_tally[s * tally_len(ep) + ep.n_experts] <= ep.small_tokens;
}
// Bytes of a record before its payload: metadata, then chunk flags (a meta record is just that).
__device__ __forceinline__ long long record_head_bytes(const EPParams& ep) { return ep.stage_record - ep.payload_bytes; }

// The metadata record of message slot i of source s in rank `rank`'s buffer, followed by the message's chunk flags
// (message_flags). Staged (a small round): record i (the token index) of the staging area at parity par: metadata,
// chunk flags, payload (staged_payload). Direct: record i (the message slot) of the meta region, metadata (its first
// int is the token) and chunk flags; the payload went to the row of the token's first local expert.
__device__ __forceinline__ char* message_meta(const EPParams& ep, int rank, bool staged, int par, int s, int i) {
    if (staged)
        return remote(ep, rank, ep.off_stage) + ((par * ep.n_src + s) * ep.small_tokens + i) * ep.stage_record;
    const long long stride = record_head_bytes(ep);
    return remote(ep, rank, ep.off_meta) + (s * ep.max_tokens + i) * stride;
}
__device__ __forceinline__ int* message_flags(const EPParams& ep, const char* meta) {
    return reinterpret_cast<int*>(const_cast<char*>(meta) + ep.meta_bytes);
}
__device__ __forceinline__ char* staged_payload(const EPParams& ep, const char* meta) {
    return const_cast<char*>(meta) + record_head_bytes(ep);
}
// Chunk flags of a record: one per 256-value span of the hidden size (cuep/config.py: stage_flag_bytes).
__device__ __forceinline__ int message_flag_count(const EPParams& ep) {
    return static_cast<int>((ep.hidden + kWarpSpan - 1) / kWarpSpan);
}

}  // namespace cuep
