// cuep expert-parallel plumbing shared by dispatch.cu and combine.cu: the parameter block every EP kernel reads,
// the layout of one rank's symmetric buffer, and the transport seam (peer pointers).
//
// Transport seam: kernels reach a peer's buffer only through `peer_ptr(p, rank, offset)`. Today that is a table of
// peer base addresses (NVLink peer access in one process, cudaIpcOpenMemHandle across processes); a multi-node
// transport would replace this one function and the host code that fills the table.
#pragma once
#include "common.cuh"

namespace cuep {

// Indices into the int64 parameter block (EPParams) built by cuep/buffer.py (PARAM_FIELDS there lists the same
// names in the same order; a CPU test checks the two agree).
enum Param : int {
    P_RANK,
    P_N_RANKS,
    P_N_SRC,            // source ranks a rank receives from: n_ranks, or 1 with skip_a2a
    P_SRC_INDEX,        // my index in a receiver's per-source regions: rank, or 0 with skip_a2a
    P_N_LOCAL,
    P_N_EXPERTS,
    P_TOP_K,
    P_HIDDEN,
    P_MAX_TOKENS,
    P_PAYLOAD_BYTES,
    P_SCALE_BYTES,
    P_ROW_ALIGN,
    P_N_SCALES,
    P_K_TILES,
    P_N_GROUPS,
    P_SHARED,           // fused shared expert: group 0 holds this rank's own tokens
    P_SKIP_A2A,
    P_CAPACITY,
    P_META_BYTES,
    P_META_IDS,
    P_META_W,
    P_META_ROWS,
    P_META_SCALES,
    P_COMBINE_ITEMSIZE,
    P_SMALL_TOKENS,     // small_batch_tokens: a round of at most this many tokens takes the staged protocol (0: off)
    P_STAGE_RECORD,     // bytes of one staging record: meta | chunk flags | payload
    P_OFF_TOKENS,
    P_OFF_COMB_RECV,
    P_OFF_META,
    P_OFF_TALLY,
    P_OFF_COMB_READY,
    P_OFF_COMB_ARRIVED,
    P_OFF_COUNTERS,
    P_OFF_SCRATCH,      // private: per-choice slots [T, K], per-(token, rank) message slots [T, 8], rank masks [T]
    P_OFF_STAGE,        // small rounds' messages [2 parities, n_src, small_tokens] x (meta | payload)
    P_OFF_COMB_POLL,    // bf16 partial sums of tokens < P_POLL_TOKENS [2 parities, P_POLL_TOKENS, dest ranks, H]
    P_OFF_SCALE_ROWS,   // private: where each row's scales are in a large dispatch round (dispatch.cu)
    P_POLL_TOKENS,      // EPConfig.combine_poll_tokens (0: no comb_poll)
    P_TIMEOUT_NS,
    P_ERR_PTR,          // ErrorRecord* in host-mapped memory
    P_PEER_BASE,        // 8 entries: base address of each rank's symmetric buffer
    P_COUNT = P_PEER_BASE + 8
};

constexpr int kMaxRanks = 8;
// dispatch notify of a large round: tokens in at most this many contiguous ranges, one per block (config.py: scratch)
constexpr int kNotifyRanges = 256;

// The parameter block, passed to every EP kernel by value (`const __grid_constant__ EPParams`): its fields are
// read from the constant bank. (A pointer to it in global memory made every field a global load, and an acquire
// load, which every wait loop does, drops the L1 copy: after each wait, chains of dependent parameter loads
// (base address, then offset, ...) went to L2 again, 3 us of a one-token dispatch.)
struct EPParams {
    long long v[P_COUNT];
};

// Private int32 counters (offsets into the counters region).
enum Counter : int {
    C_SMALL_TALLY = 0,    // round + 1 once block 0 issued a small round's tally and book stores (kKnobTallyWait)
    C_CREADY = 1,         // the last "any" combine readiness value this rank published (combine.cu)
    C_ENTER_DISPATCH = 2, // blocks of the running dispatch kernel that read the rounds (count_entry)
    C_ENTER_COMBINE = 3,  // the same for combine
    C_RECV_NOTED = 4,     // [2] dispatch receive blocks done noting a large round's scale rows, by parity; 6-7: unused
    C_DISP_ROUND = 8,     // dispatch send rounds completed
    C_RECV_ROUND = 9,     // dispatch receive rounds completed
    C_COMB_ROUND = 10,    // combine send rounds completed
    C_ERROR = 11,         // nonzero once any kernel of this rank reported an error (first one wins)
    C_DONE_NOTIFY = 12,   // blocks done with a phase (last one finishes the phase and resets it)
    C_CRECV_COUNT = 13,   // combine receive rounds completed; 15: unused
    C_DONE_CRECV = 16,    // 14, 17: unused
    C_CRECV_ITEM = 18,    // [2] next receive work item to claim (combine receive phase), by round parity
    C_ARRIVED_N = 20,     // [2] tokens of the last combine round of each parity (their arrival counts to re-arm)
    C_RECV_ITEM = 22,     // [2] next receive work item to claim (dispatch receive phase), by round parity
    C_HIST = 32,          // [E] this round's expert histogram (atomics on it also reserve each choice's slot)
};

// Kernel ids recorded in ErrorRecord.kernel.
enum KernelId : int { K_DISPATCH_SEND = 1, K_DISPATCH_RECV = 2, K_COMBINE_SEND = 3, K_COMBINE_RECV = 4 };
// Extra error codes (status field) besides kStatusTimeout.
constexpr int kStatusBadExpertId = 2;
constexpr int kStatusDuplicateExpert = 3;

// Phase bits of the dispatch and combine kernels: the same kernel runs any contiguous subset, so the fused call,
// the async/wait halves, and several ranks simulated on one GPU (phases launched rank by rank) share one code path.
constexpr int kPhaseNotify = 1;   // publish this round's histogram (dispatch) or readiness (combine)
constexpr int kPhaseSend = 2;     // move the data
constexpr int kPhaseRecv = 4;     // wait for it and lay it out
// dispatch: the send and receive phases of this round are one call with x (cuep.dispatch, not dispatch_async):
// a small bf16 round's receiver then takes its own tokens straight from x (local_from_x), and no sender stages them
constexpr int kPhaseLocalX = 8;
// Measurement knobs, bits 4 and up of `phases` (CUEP_EP_KNOBS in the environment, read by cuep/ep.py; 0 in use):
// one build times both sides of a design choice.
// dispatch receive of a large round: scales placed straight into the output layout, never gathered at the round's
// end (dispatch.cu: gather_scales), or always gathered (default: from kGatherScalesFrom bytes of scales)
constexpr int kKnobDirectScales = 1 << 4;
constexpr int kKnobGatheredScales = 1 << 5;
constexpr int kKnobSendersReceive = 1 << 8;  // dispatch, small fused round: the send blocks receive too
constexpr int kKnobTallyWait = 1 << 9;       // dispatch, small round: send blocks wait for block 0's book stores
// dispatch, small fused round: v = bits 10-14 nonzero: v/16 of the blocks send (16: all, then they receive too)
constexpr int kKnobSmallSendShift = 10;
// dispatch receive: v = bits 16-18: the polls of tallies, book rows and chunk flags sleep 32 << v ns (64 << v for
// tallies) between loads instead of 32 (64)
constexpr int kKnobPollShift = 16;
constexpr int kKnobNoLocalX = 1 << 19;  // dispatch: ignore kPhaseLocalX (the local tokens are staged as the others)
constexpr int kKnobNoPrefetch = 1 << 20;  // dispatch, small round: no L2 prefetch of the first item before the wait
constexpr int kKnobNoEarlyLoads = 1 << 21;  // dispatch / combine: no loads issued beside the entry counters' load
// Measurement only, no ordering guarantee (the data and its count or flag may be seen in either order; results can be
// wrong): what the system-scope fence before a count or flag costs. Combine: the bf16 partial sums' arrival counts
// are posted with a relaxed add after the proxy fence, without the release (MEMBAR.SYS). Dispatch: the chunk flags
// without the fence before them.
constexpr int kKnobCombineRelaxedCount = 1 << 22;
constexpr int kKnobDispatchNoFence = 1 << 23;
constexpr int kKnobCombineSysLocal = 1 << 24;  // combine: a system-scope release before local arrival counts too
constexpr int kKnobCombineNoPoll = 1 << 25;    // combine: no polled partial sums (comb_poll): every token counted
// dispatch: the receive copies no received payload to its rows (measurement only: wrong rows; tokens from x still go)
constexpr int kKnobNoFanout = 1 << 26;
// dispatch receive, measurement only: no per-row scales placed (wrong scales); large rounds' items whole rows, not
// 2 KiB chunks
constexpr int kKnobNoRowScales = 1 << 15;
constexpr int kKnobFanoutWholeRows = 1 << 30;
// v = bits 27-29 nonzero: v/8 of the blocks only receive, in a large fused dispatch round (default: dispatch.cu
// large_recv_eighths) and in a fused combine (default: none)
constexpr int kKnobRecvShareShift = 27;
__device__ __forceinline__ unsigned poll_sleep_ns(int knobs, unsigned base) { return base << ((knobs >> kKnobPollShift) & 7); }

struct EP {
    const long long* p;
    __device__ __forceinline__ long long operator[](int i) const { return p[i]; }
    __device__ __forceinline__ char* local(long long off) const { return reinterpret_cast<char*>(p[P_PEER_BASE + p[P_RANK]]) + off; }
    __device__ __forceinline__ char* peer(int rank, long long off) const {
        return reinterpret_cast<char*>(p[P_PEER_BASE + rank]) + off;
    }
    __device__ __forceinline__ int* counters() const { return reinterpret_cast<int*>(local(p[P_OFF_COUNTERS])); }
    __device__ __forceinline__ ErrorRecord* err() const { return reinterpret_cast<ErrorRecord*>(p[P_ERR_PTR]); }
};

// The ranks a round writes to: every rank, or with skip_a2a only this one (d = 0). dest_rank(ep, d): the d-th.
__device__ __forceinline__ int n_dest_ranks(const EP& ep) {
    return ep[P_SKIP_A2A] ? 1 : static_cast<int>(ep[P_N_RANKS]);
}
__device__ __forceinline__ int dest_rank(const EP& ep, int d) {
    return ep[P_SKIP_A2A] ? static_cast<int>(ep[P_RANK]) : d;
}

// Measurement knob (CUEP_EXTRA_DEFINES="CUEP_AB_TRACE=1"; off: no code): thread 0 of one block records the low
// 32 bits of %globaltimer (ns) at the phase boundaries into 32 int32 counters after the histogram;
// scripts/trace_ep.py reads them and lists the points (dispatch and combine share the 32 slots).
#ifdef CUEP_AB_TRACE
#define CUEP_TRACE(ep, when, i)                                                                             \
    do {                                                                                                 \
        if (threadIdx.x == 0 && (when))                                                                  \
            (ep).counters()[C_HIST + (ep)[P_N_EXPERTS] + (i)] = static_cast<int>(global_timer_ns());      \
    } while (0)
// The latest time any caller (a thread for which `who` holds) reached point i: unsigned atomicMax (the script
// zeroes the points between rounds).
#define CUEP_TRACE_LATEST(ep, who, i)                                                                       \
    do {                                                                                                 \
        if (who)                                                                                         \
            atomicMax(reinterpret_cast<unsigned*>((ep).counters() + C_HIST + (ep)[P_N_EXPERTS] + (i)),    \
                      static_cast<unsigned>(global_timer_ns()));                                          \
    } while (0)
#else
#define CUEP_TRACE(ep, when, i) \
    do {                        \
    } while (0)
#define CUEP_TRACE_LATEST(ep, who, i) \
    do {                              \
    } while (0)
#endif

// Record an error once per rank: the first reporter wins the device-side flag and writes the host-mapped record
// (plain stores; the host reads it without synchronising). Later kernels of the rank see the flag and return.
__device__ __forceinline__ void report_error(const EP& ep, int status, int kernel, int expert, int src_rank) {
    if (atomicCAS(ep.counters() + C_ERROR, 0, status) == 0) {
        volatile ErrorRecord* e = ep.err();
        e->kernel = kernel;
        e->expert = expert;
        e->src_rank = src_rank;
        __threadfence_system();
        e->status = status;
        __threadfence_system();
    }
}

// A failed wait leaves the protocol in an unknown state: later kernels of the rank return at once (until the host
// resets the buffer). Bad routing input is only recorded: its choices are skipped and the round completes.
__device__ __forceinline__ bool has_failed(const EP& ep) {
    return *reinterpret_cast<volatile int*>(ep.counters() + C_ERROR) == kStatusTimeout;
}

// Rounds advance without an end-of-phase count: thread 0 of every block counts the block in right after it read
// the rounds (count_entry, an atomic whose result it needs only at the end), and the block that entered last, when
// every block has read them, advances them (last_to_enter, at the end of the kernel; the next launch on the stream
// reads them). A count of blocks done at the end of a phase (fence, atomic, fence) took 1.3 us of a decode round.
__device__ __forceinline__ int count_entry(const EP& ep, int counter) {
    return threadIdx.x == 0 ? atomicAdd(ep.counters() + counter, 1) : -1;
}
// Thread 0 of the block that entered last (after resetting the count for the next launch): true once per launch.
__device__ __forceinline__ bool last_to_enter(const EP& ep, int counter, int entered) {
    if (threadIdx.x != 0 || entered != static_cast<int>(gridDim.x) - 1) return false;
    ep.counters()[counter] = 0;
    return true;
}

// A spinning wait looks at the rank's error flag (has_failed) at most this often. Every poll of it goes to the one
// L2 line that also holds the work-item counters: polled on every spin by a thousand waiting warps it slowed the
// item claims and the flag itself.
constexpr uint64_t kFailCheckNs = 1000;

// The clock of one bounded spin (every wait loop of the EP kernels has one): started at the first miss (a wait
// whose flag is already there never reads the timer), stop() says when to give up: once the rank has failed (the
// error flag, looked at every kFailCheckNs) or past the timeout, which it records as (kernel, src).
struct SpinClock {
    uint64_t t0 = 0, checked = 0;
    __device__ __forceinline__ bool stop(const EP& ep, int kernel, int src) {
        const uint64_t now = global_timer_ns();
        if (t0 == 0) t0 = checked = now;
        if (now - checked > kFailCheckNs) {
            if (has_failed(ep)) return true;
            checked = now;
        }
        if (now - t0 > static_cast<uint64_t>(ep[P_TIMEOUT_NS])) {
            report_error(ep, kStatusTimeout, kernel, -1, src);
            return true;
        }
        return false;
    }
};

// The rounds and the error flag at kernel entry: one 16-byte load by thread 0 of each block, shared through shared
// memory. (Every thread loading them, 67K loads of one line, took 3 us of every EP kernel: a dispatch with no phase
// ran 7.5 us event to event on 2 x H200, an empty kernel of the same grid 4.5.) All threads; ends with a barrier.
struct EntryCounters {
    int disp_round, recv_round, comb_round, status, crecv_round;
};
static_assert(C_RECV_ROUND == C_DISP_ROUND + 1 && C_COMB_ROUND == C_DISP_ROUND + 2 && C_ERROR == C_DISP_ROUND + 3 &&
                  C_CRECV_COUNT == C_DISP_ROUND + 5 && C_DISP_ROUND % 4 == 0,
              "the entry counters are two aligned int4");
__device__ __forceinline__ EntryCounters load_entry_counters(const EP& ep) {
    __shared__ int4 s_entry[2];
    if (threadIdx.x == 0) {
        int4 v, w;
        asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(ep.counters() + C_DISP_ROUND));
        asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                     : "l"(ep.counters() + C_DISP_ROUND + 4));
        s_entry[0] = v;
        s_entry[1] = w;
    }
    __syncthreads();
    const int4 v = s_entry[0], w = s_entry[1];
    return {v.x, v.y, v.z, v.w, w.y};
}

// Split each of `items` rows of `unit_count` units into chunks so the grid's warps all get work: one chunk per
// item when items outnumber warps (prefill), up to one unit per lane-step when they are few (decode).
// Returns the chunk size in units, a multiple of `align_units`.
// `warps`: the warps sharing the items (default: the whole grid).
__device__ __forceinline__ long long chunk_units(long long items, long long unit_count, long long align_units,
                                                 long long warps = 0) {
    if (warps <= 0) warps = static_cast<long long>(gridDim.x) * (blockDim.x / kWarp);
    long long n = items > 0 ? warps / items : 1;
    n = n < 1 ? 1 : n;
    const long long max_n = (unit_count + align_units - 1) / align_units;
    n = n > max_n ? max_n : n;
    const long long per = (unit_count + n - 1) / n;
    return (per + align_units - 1) / align_units * align_units;
}

// Work items (message, chunk) interleaved over the source ranks: item v is chunk v % n_chunks of message
// q / n_src of source (q + rot) % n_src, q = v / n_chunks; items past a source's message count are empty (at()
// returns false). Senders go through their messages in this order so that every GPU writes to every destination
// at once (one destination at a time, as in source order, takes several GPUs' traffic and halves the all-to-all
// rate), and receivers take them in the same order, which is the order they arrive in.
struct SourceInterleave {
    const int* count;  // [n_src] messages of each source
    int n_src, n_chunks, rot;
    int n_items;       // n_src x (largest count) x n_chunks, empty items included
    __device__ __forceinline__ bool at(int v, int& s, int& i, int& ch) const {
        ch = v % n_chunks;
        const int q = v / n_chunks;
        i = q / n_src;
        s = (q % n_src + rot) % n_src;
        return i < count[s];
    }
};

// Lane 0 spins (acquire, bounded) until done(*tag) holds; the warp barrier then orders every lane's reads after
// it. Returns false (after recording whom it waited for) on timeout or once the rank has failed.
template <class Done>
__device__ __forceinline__ bool warp_wait_until(const int* tag, Done done, const EP& ep, int kernel, int src,
                                                int lane, unsigned sleep_ns = 32) {
    int ok = 1;
    if (lane == 0) {
        SpinClock clock;
        while (!done(load_acquire_sys_i32(tag))) {
            if (clock.stop(ep, kernel, src)) {
                ok = 0;
                break;
            }
            __nanosleep(sleep_ns);
        }
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();
    return ok != 0;
}

// The same, until *tag == want.
__device__ __forceinline__ bool warp_wait_tag(const int* tag, int want, const EP& ep, int kernel, int src, int lane) {
    return warp_wait_until(tag, [want](int v) { return v == want; }, ep, kernel, src, lane);
}

// Blocks of a launch that move data in the send phase: all of them, except that in one fused launch (send and
// receive phases) recv_eighths / 8 of the grid only receive; knob bits 27-29, when set, replace recv_eighths.
__device__ __forceinline__ int send_block_count(int phases, int recv_eighths) {
    const bool fused = (phases & kPhaseSend) && (phases & kPhaseRecv);
    const int knob = (phases >> kKnobRecvShareShift) & 7;
    const int grid = static_cast<int>(gridDim.x);
    return fused ? grid - grid * (knob ? knob : recv_eighths) / 8 : grid;
}

// "Last block done" pattern: every block calls this once after its share of a phase (all threads); it returns true
// in exactly one block, after every other block's writes of the phase are visible to it. That block finishes the
// phase and resets `*done` to 0 so the next round starts clean.
// `peer_writes`: the phase stored into peer memory, so the fence must be system-wide; a phase that wrote only
// this GPU's memory needs a device-scope fence, which is much cheaper.
// `n_blocks`: the blocks that take part (default: the grid).
__device__ __forceinline__ bool last_block_done(int* done, int* s_flag, bool peer_writes = true, int n_blocks = 0) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (peer_writes) __threadfence_system(); else __threadfence();  // this block's writes before the count
        const int prev = atomicAdd(done, 1);
        *s_flag = (prev == (n_blocks > 0 ? n_blocks : static_cast<int>(gridDim.x)) - 1);
        if (*s_flag) {
            if (peer_writes) __threadfence_system(); else __threadfence();
        }
    }
    __syncthreads();
    return *s_flag != 0;
}

// Grid barrier of the n_blocks blocks that call it (all threads; the blocks must be resident together, as an EP
// launch's one block per SM is): each arrives on *count (zeroed a round ahead by its owner), then waits, bounded,
// for all. The fences order every block's writes before the barrier with every block's reads after it.
__device__ __forceinline__ bool blocks_barrier(const EP& ep, int* count, int n_blocks, int kernel, int* s_ok) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1);
        int ok = 1;
        SpinClock clock;
        while (load_acquire_i32(count) < n_blocks) {
            if (clock.stop(ep, kernel, -1)) {
                ok = 0;
                break;
            }
            __nanosleep(32);
        }
        __threadfence();
        *s_ok = ok;
    }
    __syncthreads();
    return *s_ok != 0;
}

// Spin (all threads of the block call it) until done(flags[i]) for every i < n, bounded by the timeout.
// Returns false and records (kernel, expert=-1, src) on timeout.
// `stride`: flags[i * stride] is flag i.
template <class Done>
__device__ __forceinline__ bool block_wait_flags(const uint64_t* flags, int n, Done done, const EP& ep, int kernel,
                                                 int* s_ok, int stride = 1) {
    if (threadIdx.x == 0) *s_ok = 1;
    __syncthreads();
    if (threadIdx.x < n) {
        SpinClock clock;
        while (!done(load_acquire_u64(flags + static_cast<long long>(threadIdx.x) * stride))) {
            if (clock.stop(ep, kernel, threadIdx.x)) {
                *s_ok = 0;
                break;
            }
            __nanosleep(64);
        }
    }
    __syncthreads();
    return *s_ok != 0;
}

// msg_rows [n_src, T, K] (the row of each message's choice k, -1 if none here) is followed by the router weight of
// each of those choices (float, same shape), so combine reads a message's rows and weights together instead of the
// weight behind the row (row_weight[row]: one more dependent load before a decode combine's first expert row).
__device__ __forceinline__ float* msg_weights(const EP& ep, int* msg_rows) {
    return reinterpret_cast<float*>(msg_rows + ep[P_N_SRC] * ep[P_MAX_TOKENS] * ep[P_TOP_K]);
}
__device__ __forceinline__ const float* msg_weights(const EP& ep, const int* msg_rows) {
    return reinterpret_cast<const float*>(msg_rows + ep[P_N_SRC] * ep[P_MAX_TOKENS] * ep[P_TOP_K]);
}

// A warp holding one token's top-k row, lane k = choice k (k < K): does an earlier lane hold the same value v?
// (All lanes take part.) With `width` W < 32 (a power of two >= K) each W-lane segment holds its own token and
// `lane` is the lane's index in its segment.
__device__ __forceinline__ bool warp_repeats_earlier(int v, int lane, int K, int width = kWarp) {
    bool repeat = false;
    for (int k2 = 0; k2 < K; ++k2) {
        const int u = __shfl_sync(0xffffffffu, v, k2, width);
        if (k2 < lane && u == v) repeat = true;
    }
    return repeat;
}
// Is this lane's choice, valid by `valid_mask`, the first valid one of its rank `rank_of` (no earlier valid lane
// with the same rank)? (All lanes take part; `width` and `lane` as above, `valid_mask` the segment's own bits.)
__device__ __forceinline__ bool warp_first_of_rank(int rank_of, unsigned valid_mask, int lane, int K,
                                                   int width = kWarp) {
    bool first = (valid_mask >> lane) & 1u;
    for (int k2 = 0; k2 < K; ++k2) {
        const int u = __shfl_sync(0xffffffffu, rank_of, k2, width);
        if (k2 < lane && ((valid_mask >> k2) & 1u) && u == rank_of) first = false;
    }
    return first;
}

// Is top-k choice k of this token a valid expert for this call (in range, not a repeat; with skip_a2a, local)?
__device__ __forceinline__ bool valid_choice(const EP& ep, const int* ids_row, int k) {
    const int e = ids_row[k];
    if (e < 0 || e >= ep[P_N_EXPERTS]) return false;
    for (int j = 0; j < k; ++j)
        if (ids_row[j] == e) return false;
    if (ep[P_SKIP_A2A] && e / ep[P_N_LOCAL] != ep[P_RANK]) return false;
    return true;
}

}  // namespace cuep
