// Waits and work sharing of the EP kernels: bounded waits on signals (a warp's, a block's), the grid barrier of a
// launch's co-resident blocks, the "last block done" pattern, how items are cut and ordered over the warps, and the
// barrier teams of a one-rank small round's layout.
// Every wait here is bounded by SpinClock (ep/state.cuh): a peer that never signals becomes kStatusTimeout.
#pragma once
#include "state.cuh"
#include "transport.cuh"

namespace cuep {

// Split each of `items` rows of `unit_count` units into chunks so the grid's warps all get work: one chunk per
// item when items outnumber warps (prefill), up to one unit per lane-step when they are few (decode).
// Returns the chunk size in units, a multiple of `align_units`.
// `warps`: the warps sharing the items (default: the whole grid). I: the integer type of the arithmetic (named,
// not deduced: chunk_units<int> where every value fits, as in the one-rank kernels, whose decode layout waits on
// these divisions; 64-bit ones take twice the instructions).
template <class I>
struct NotDeduced {
    using type = I;
};
template <typename I = long long>
__device__ __forceinline__ I chunk_units(typename NotDeduced<I>::type items, typename NotDeduced<I>::type unit_count,
                                         typename NotDeduced<I>::type align_units,
                                         typename NotDeduced<I>::type warps = 0) {
    if (warps <= 0) warps = static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x / kWarp);
    I n = items > 0 ? warps / items : 1;
    n = n < 1 ? 1 : n;
    const I max_n = (unit_count + align_units - 1) / align_units;
    n = n > max_n ? max_n : n;
    const I per = (unit_count + n - 1) / n;
    return (per + align_units - 1) / align_units * align_units;
}
// A chunk plan from the host (`plan`: units per chunk | chunks per row << 16, cuep/ep.py _pack_plan) into *per and
// *chunks when it covers a row of `units` units exactly (every chunk starts inside the row, the last reaches its
// end); false otherwise (none given, 0), the caller's fallback then.
__device__ __forceinline__ bool take_chunk_plan(int plan, int units, int* per, int* chunks) {
    const int p = plan & 0xffff, c = plan >> 16;
    if (p < 1 || c < 1 || (c - 1) * p >= units || c * p < units) return false;
    *per = p;
    *chunks = c;
    return true;
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

// Lane 0 spins (acquire, bounded) until done(*flag) holds; the warp barrier then orders every lane's reads after
// it. Returns false (after recording whom it waited for) on timeout or once the rank has failed.
template <class Done>
__device__ __forceinline__ bool warp_wait_until(const int* flag, Done done, const EPParams& ep, int kernel, int src,
                                                int lane, unsigned sleep_ns = 32) {
    int ok = 1;
    if (lane == 0) {
        SpinClock clock;
        while (!done(poll_flag(flag))) {
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

// The same, until *flag == want.
__device__ __forceinline__ bool warp_wait_value(const int* flag, int want, const EPParams& ep, int kernel, int src,
                                                int lane) {
    return warp_wait_until(flag, [want](int v) { return v == want; }, ep, kernel, src, lane);
}

// Spin (this thread, bounded) until the stamped entry *p carries `stamp` in its high 32 bits; its low 32 bits in
// `value`. False (after recording whom it waited for) on timeout or once the rank has failed.
__device__ __forceinline__ bool wait_stamped(const EPParams& ep, const uint64_t* p, uint32_t stamp, int kernel,
                                             int src, uint32_t& value, unsigned sleep_ns = 32) {
    uint64_t v;
    SpinClock clock;
    while (static_cast<uint32_t>((v = poll_u64(p)) >> 32) != stamp) {
        if (clock.stop(ep, kernel, src)) return false;
        __nanosleep(sleep_ns);
    }
    value = static_cast<uint32_t>(v);
    return true;
}

// Spin (all threads of the block call it) until done(entries[i]) for every i < n, bounded by the timeout.
// Returns false and records (kernel, expert=-1, src) on timeout. `stride`: entries[i * stride] is entry i.
template <class Done>
__device__ __forceinline__ bool block_wait_entries(const uint64_t* entries, int n, Done done, const EPParams& ep,
                                                   int kernel, int* s_ok, int stride = 1) {
    if (threadIdx.x == 0) *s_ok = 1;
    __syncthreads();
    if (threadIdx.x < n) {
        SpinClock clock;
        while (!done(poll_u64(entries + static_cast<long long>(threadIdx.x) * stride))) {
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

// Blocks of a launch that move data in the send phase: all of them, except that in one fused launch (send and
// receive phases) recv_eighths / 8 of the grid only receive.
__device__ __forceinline__ int send_block_count(int phases, int recv_eighths) {
    const bool fused = (phases & kPhaseSend) && (phases & kPhaseRecv);
    const int grid = static_cast<int>(gridDim.x);
    return fused ? grid - grid * recv_eighths / 8 : grid;
}

// "Last block done" pattern: every block calls this once after its share of a phase (all threads); it returns true
// in exactly one block, after every other block's writes of the phase are visible to it. That block finishes the
// phase and resets `*done` to 0 so the next round starts clean. The phases that use it write only this GPU's
// memory before it, so the fences are at device scope.
__device__ __forceinline__ bool last_block_done(int* done, int* s_flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // this block's writes before the count
        const int prev = atomicAdd(done, 1);
        *s_flag = (prev == static_cast<int>(gridDim.x) - 1);
        if (*s_flag) __threadfence();
    }
    __syncthreads();
    return *s_flag != 0;
}

// One thread spins until *count >= n (acquire), sleeping sleep_ns between polls; false on timeout (recorded as
// (kernel, expert=-1)).
__device__ __forceinline__ bool spin_count_reaches(const EPParams& ep, const int* count, int n, int kernel,
                                                   unsigned sleep_ns) {
    SpinClock clock;
    while (load_acquire_i32(count) < n) {
        if (clock.stop(ep, kernel, -1)) return false;
        __nanosleep(sleep_ns);
    }
    return true;
}

// Grid barrier of the n_blocks blocks that call it (all threads; the blocks must be resident together, as an EP
// launch's one block per SM is): each arrives on *count (zeroed a round ahead by its owner), then waits, bounded,
// for all. The fences order every block's writes before the barrier with every block's reads after it. In two
// halves where a block has work that needs no other block between them (blocks_arrive, then blocks_wait).
__device__ __forceinline__ void blocks_arrive(int* count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1);
    }
}
__device__ __forceinline__ bool blocks_wait(const EPParams& ep, const int* count, int n_blocks, int kernel,
                                            int* s_ok) {
    if (threadIdx.x == 0) {
        const bool ok = spin_count_reaches(ep, count, n_blocks, kernel, 32);
        __threadfence();
        *s_ok = ok;
    }
    __syncthreads();
    return *s_ok != 0;
}
__device__ __forceinline__ bool blocks_barrier(const EPParams& ep, int* count, int n_blocks, int kernel, int* s_ok) {
    blocks_arrive(count);
    return blocks_wait(ep, count, n_blocks, kernel, s_ok);
}
// The same between warps (every lane of each warp calls them): a warp arrives once its own writes are in, and waits,
// bounded, until n warps have; then each lane acquires the count itself, so its loads after see every arrived warp's
// writes. Blocks whose warps finish at different times need not wait for their slowest.
__device__ __forceinline__ void warp_arrive(int* count, int lane) {
    __syncwarp();
    if (lane == 0) {
        __threadfence();
        atomicAdd(count, 1);
    }
}
__device__ __forceinline__ bool warp_wait(const EPParams& ep, const int* count, int n, int kernel, int lane) {
    int ok = lane == 0 ? spin_count_reaches(ep, count, n, kernel, 64) : 1;
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (ok) (void)load_acquire_i32(count);
    return ok != 0;
}

// Barrier teams: the threads that lay a one-rank small round out and synchronize among themselves (static members:
// the same expressions as the block's builtins, so a kernel that never splits compiles as before): the whole block
// (barrier 0), or in a small quantized round's split layout its last kWarps warps (barrier 2; pad_group's padding
// threads use 1) while the others encode their first item (dispatch/local.cuh dispatch_local). (A team of
// run-time fields, __syncthreads for the block, made the kernels that never split 40-80 instructions longer and
// their rounds 1.5-3% slower, H200.)
struct BlockTeam {
    __device__ __forceinline__ static unsigned tid() { return threadIdx.x; }
    __device__ __forceinline__ static unsigned nthreads() { return blockDim.x; }
    __device__ __forceinline__ static unsigned warp() { return threadIdx.x / kWarp; }
    __device__ __forceinline__ static unsigned n_warps() { return blockDim.x / kWarp; }
    __device__ __forceinline__ static void sync() { __syncthreads(); }
};
template <int kWarps>
struct LastWarpsTeam {
    __device__ __forceinline__ static unsigned tid() { return threadIdx.x - (blockDim.x - kWarps * kWarp); }
    __device__ __forceinline__ static unsigned nthreads() { return kWarps * kWarp; }
    __device__ __forceinline__ static unsigned warp() { return tid() / kWarp; }
    __device__ __forceinline__ static unsigned n_warps() { return kWarps; }
    __device__ __forceinline__ static void sync() { asm volatile("bar.sync 2, %0;" ::"n"(kWarps * kWarp) : "memory"); }
};
template <bool kSplitLayout, int kWarps>
struct LayoutTeam {
    using type = BlockTeam;
};
template <int kWarps>
struct LayoutTeam<true, kWarps> {
    using type = LastWarpsTeam<kWarps>;
};

}  // namespace cuep
