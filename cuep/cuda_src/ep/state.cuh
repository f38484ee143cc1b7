// Per-rank protocol state of the EP kernels: the private int32 counters (rounds, work items, the histogram), the
// error record, bounded spinning, and how a launch reads and advances the rounds.
//
// Rounds advance without an end-of-phase count: thread 0 of every block counts the block in right after it read
// the rounds (count_entry), and the block that entered last advances them at the end of the kernel (last_to_enter);
// the next launch on the stream reads them. A failed wait records kStatusTimeout: every later kernel of the rank
// returns at once until the host re-arms the buffer (Buffer.reset zeroes the counters and flags).
#pragma once
#include "params.cuh"

namespace cuep {

// Private int32 counters (offsets into the counters region; cuep/config.py: n_counters).
enum Counter : int {
    C_CREADY = 1,         // the last "any" combine readiness value this rank published (combine)
    C_ENTER_DISPATCH = 2, // blocks of the running dispatch kernel that read the rounds (count_entry)
    C_ENTER_COMBINE = 3,  // the same for combine
    C_RECV_NOTED = 4,     // [2] dispatch receive blocks done noting a large round's scale rows, by parity
    C_DISP_ROUND = 8,     // dispatch send rounds completed
    C_RECV_ROUND = 9,     // dispatch receive rounds completed
    C_COMB_ROUND = 10,    // combine send rounds completed
    C_ERROR = 11,         // nonzero once any kernel of this rank reported an error (first one wins)
    C_DONE_NOTIFY = 12,   // blocks done with a phase (last one finishes the phase and resets it)
    C_CRECV_COUNT = 13,   // combine receive rounds completed
    C_LOCAL_GEN = 15,     // larger one-rank dispatch rounds (block 0 advances it once every block has read it)
    C_DONE_CRECV = 16,
    C_LOCAL_NOTED = 17,   // warps of a larger one-rank dispatch done noting its scale rows (zeroed before its count)
    C_CRECV_ITEM = 18,    // [2] next receive work item to claim (combine receive phase), by round parity
    C_ARRIVED_N = 20,     // [2] tokens of the last combine round of each parity (their arrival counts to re-arm)
    C_RECV_ITEM = 22,     // [2] next receive work item to claim (dispatch receive phase), by round parity
    C_LOCAL_COUNTED = 24, // [2] blocks of a larger one-rank dispatch done counting, by parity (C_LOCAL_GEN's)
    C_HIST = 32,          // [E] this round's expert histogram (atomics on it also reserve each choice's slot)
    // then [2][E x kLocalHistStride]: a larger one-rank dispatch round's histogram, by parity (local_hist)
};
// Ints between two experts' counters of a larger one-rank round's histogram (cuep/config.py LOCAL_HIST_STRIDE): one
// 128-byte line each, so that the atomics on different experts' counts spread over the L2 instead of queueing on
// the few lines a packed histogram spans.
constexpr int kLocalHistStride = 32;

// Kernel ids recorded in ErrorRecord.kernel.
enum KernelId : int { K_DISPATCH_SEND = 1, K_DISPATCH_RECV = 2, K_COMBINE_SEND = 3, K_COMBINE_RECV = 4 };
// Extra error codes (status field) besides kStatusTimeout.
constexpr int kStatusBadExpertId = 2;
constexpr int kStatusDuplicateExpert = 3;

// Record an error once per rank: the first reporter wins the device-side flag and writes the host-mapped record
// (plain stores; the host reads it without synchronising). Later kernels of the rank see the flag and return.
__device__ __forceinline__ void report_error(const EPParams& ep, int status, int kernel, int expert, int src_rank) {
    if (atomicCAS(ep.counters() + C_ERROR, 0, status) == 0) write_error_record(ep.err(), status, kernel, expert, src_rank);
}

// A failed wait leaves the protocol in an unknown state: later kernels of the rank return at once (until the host
// resets the buffer). Bad routing input is only recorded: its choices are skipped and the round completes.
__device__ __forceinline__ bool has_failed(const EPParams& ep) {
    return *reinterpret_cast<volatile int*>(ep.counters() + C_ERROR) == kStatusTimeout;
}

// has_failed for a kernel that checks late: thread 0 loads the flag word at entry and compares it only after a
// later barrier (note_failed), before the block's first global store, so the load's latency passes under the work
// between. (has_failed's volatile load had its comparison scheduled right after it: thread 0's warp, which every
// block barrier waits for, stood still for the load.) Other threads get 0.
__device__ __forceinline__ int read_failed(const EPParams& ep) {
    int word = 0;
    if (threadIdx.x == 0) word = __ldcg(ep.counters() + C_ERROR);
    return word;
}
// Call before a barrier with whether thread 0 found the rank failed (all threads; read_failed's word compared with
// kStatusTimeout, or has_failed); after the barrier *s_failed is the block's answer.
__device__ __forceinline__ void note_failed(bool failed, int* s_failed) {
    if (threadIdx.x == 0) *s_failed = failed;
}

// Thread 0 of every block counts the block in once it has read the rounds: an atomic whose result it needs only at
// the end. (A count of blocks done at the end of a phase, fence, atomic, fence, took 1.3 us of a decode round.)
__device__ __forceinline__ int count_entry(const EPParams& ep, int counter) {
    return threadIdx.x == 0 ? atomicAdd(ep.counters() + counter, 1) : -1;
}
// Thread 0 of the block that entered last (after resetting the count for the next launch): true once per launch.
__device__ __forceinline__ bool last_to_enter(const EPParams& ep, int counter, int entered) {
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
    __device__ __forceinline__ bool stop(const EPParams& ep, int kernel, int src) {
        const uint64_t now = global_timer_ns();
        if (t0 == 0) t0 = checked = now;
        if (now - checked > kFailCheckNs) {
            if (has_failed(ep)) return true;
            checked = now;
        }
        if (now - t0 > static_cast<uint64_t>(ep.timeout_ns)) {
            report_error(ep, kStatusTimeout, kernel, -1, src);
            return true;
        }
        return false;
    }
};

// The rounds and the error flag at kernel entry: one 16-byte load by thread 0 of each block, shared through shared
// memory. (Every thread loading them, 67K loads of one line, took 3 us of every EP kernel.) All threads; ends with
// a barrier.
struct EntryCounters {
    int disp_round, recv_round, comb_round, status, crecv_round;
};
static_assert(C_RECV_ROUND == C_DISP_ROUND + 1 && C_COMB_ROUND == C_DISP_ROUND + 2 && C_ERROR == C_DISP_ROUND + 3 &&
                  C_CRECV_COUNT == C_DISP_ROUND + 5 && C_DISP_ROUND % 4 == 0,
              "the entry counters are two aligned int4");
__device__ __forceinline__ EntryCounters load_entry_counters(const EPParams& ep) {
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

}  // namespace cuep
