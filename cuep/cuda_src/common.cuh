// cuep common device helpers: constants, 16-byte vector copies, memory-order primitives, block prefix sum,
// completion signal and bounded spin-waits. One helper per idea; every kernel file includes this.
#pragma once
#include <cuda/std/cstdint>  // NVRTC has no C++ standard library; CCCL ships this one (nvcc and CuPy both find it)

using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint8_t;
using cuda::std::uint16_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;

#ifndef CUEP_SRC_HASH
#define CUEP_SRC_HASH 0ULL
#endif

namespace cuep {

// ---- constants (mirrored in cuep/formats.py; a CPU test checks they agree) ------------------------------
constexpr int kAlign = 16;                    // device alignment: every message part, every region
constexpr int kWarp = 32;
constexpr uint64_t kEmpty = ~0ull;            // a recv_count slot nobody has written this round
constexpr int kStatusOk = 0;
constexpr int kStatusTimeout = 1;

__host__ __device__ constexpr int64_t align_up(int64_t n, int64_t a = kAlign) { return (n + a - 1) / a * a; }
__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- 16-byte vector copies ----------------------------------------------------------------------------
// Block-wide copy of `nbytes` (a multiple of 16, both pointers 16-byte aligned) with 16-byte loads and stores,
// `kUnroll` independent loads in flight per thread before the first store.
template <int kUnroll = 4>
__device__ __forceinline__ void block_copy16(void* __restrict__ dst, const void* __restrict__ src, int64_t nbytes,
                                             int tid, int nthreads) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    const int64_t n = nbytes / 16;
    int64_t i = tid;
    for (; i + (kUnroll - 1) * nthreads < n; i += kUnroll * nthreads) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = s[i + u * nthreads];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) d[i + u * nthreads] = v[u];
    }
    for (; i < n; i += nthreads) d[i] = s[i];
}

// Warp-wide version of block_copy16 (lane = threadIdx.x % 32).
__device__ __forceinline__ void warp_copy16(void* __restrict__ dst, const void* __restrict__ src, int64_t nbytes,
                                            int lane) {
    block_copy16<4>(dst, src, nbytes, lane, kWarp);
}

// One warp's registers holding up to 32 x kVec 16-byte vectors (lane l holds vectors l, l + 32, ...): a chunk is
// loaded once and stored to several places (a token's rows, or its destination ranks). A copy per destination
// re-loads the source each time, and the loads after the first wait behind the previous stores: 8 rows of one
// decode token took 4 us that way, one L2 round trip each.
template <int kVec>
struct WarpVectors {
    static constexpr int kBytes = kVec * kWarp * 16;  // the most one load covers
    int4 v[kVec];
    __device__ __forceinline__ void load(const void* src, int nbytes, int lane) {
        const int4* s = reinterpret_cast<const int4*>(src);
#pragma unroll
        for (int j = 0; j < kVec; ++j)
            if ((lane + j * kWarp) * 16 < nbytes) v[j] = s[lane + j * kWarp];
    }
    __device__ __forceinline__ void store(void* dst, int nbytes, int lane) const {
        int4* d = reinterpret_cast<int4*>(dst);
#pragma unroll
        for (int j = 0; j < kVec; ++j)
            if ((lane + j * kWarp) * 16 < nbytes) d[lane + j * kWarp] = v[j];
    }
};

// A store that fills part of a 32-byte sector which other warps fill later (the scale layouts put a row's scales in
// a column), with an L2 evict-last hint: under a round's stream of row stores the half-written sector otherwise
// leaves L2 before the rest of it arrives, and is read back to be merged. (H100, one rank, cold: fp8 N = 1024
// dispatch 7% faster, nvfp4 N = 256 12%; 2 x H200 direct scales at fp8 N = 8192: 437 -> 387 us.) Stores that fill
// whole sectors (the fp4 padding's zero quads, 14.7 MB at nvfp4 N = 128) stay plain: the same speed, and no
// evict-last lines left in L2 for the kernels after.
__device__ __forceinline__ void store_u32_evict_last(void* p, uint32_t v) {
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;" ::"l"(p), "r"(v), "l"(policy) : "memory");
}

// ---- memory order (system scope: peers write our memory over NVLink) ------------------------------------
__device__ __forceinline__ uint64_t load_acquire_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void store_relaxed_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int load_acquire_i32(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release_gpu_i32(int* p, int v) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int load_acquire_sys_i32(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release_sys_i32(int* p, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void store_relaxed_sys_i32(int* p, int v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void red_add_relaxed_sys(int* p, int v) {
    asm volatile("red.relaxed.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add_release_sys(int* p, int v) {
    asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Add v to a count that a reader acquires (system scope) to see this thread's earlier writes, and, through a warp or
// block barrier before this, its warp's or block's: a release pattern at the scope that holds the reader, GPU scope
// when it runs on this GPU (a system-scope fence, MEMBAR.SYS, costs about 2 us under NVLink traffic), then a relaxed
// system-scope add (other GPUs add to the same count).
__device__ __forceinline__ void release_add_count(int* p, int v, bool reader_on_this_gpu) {
    if (reader_on_this_gpu) asm volatile("fence.acq_rel.gpu;" ::: "memory");
    else fence_sys();
    red_add_relaxed_sys(p, v);
}

// ---- programmatic dependent launch ---------------------------------------------------------------------
// A kernel that cuep/_kernels.py launches as a programmatic dependent (DependentLaunch: the one-rank kernels) may be
// scheduled while the kernel before it in the stream is finishing; it calls this first, before touching global
// memory. It lets the next such kernel be scheduled as soon as every block of this one has started (that kernel
// waits here in turn, so nothing is read early), then waits until the kernel before has completed and its memory
// operations are visible. Both instructions return at once in a kernel launched the plain way.
__device__ __forceinline__ void await_previous_grid() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// ---- completion signal ---------------------------------------------------------------------------------
// Publish `count` at `slot` (a peer's recv_count). All but the last signal bound for one rank may be plain
// relaxed stores; the last one is a release store, which orders every earlier write of this thread (and, after
// a __syncthreads, of its block) before it becomes visible.
__device__ __forceinline__ void signal_completion(uint64_t* slot, uint64_t count, bool last_for_rank) {
    if (last_for_rank)
        store_release_u64(slot, count);
    else
        store_relaxed_u64(slot, count);
}

// ---- block-wide inclusive prefix sum -------------------------------------------------------------------
// Inclusive scan of one value per thread over the whole block (blockDim.x a multiple of 32, at most 1024).
// `scratch` holds 32 values of shared memory. Returns this thread's inclusive sum; `*total` gets the block sum.
// (V = long long scans two ints at once, packed low and high, when neither half's sums overflow.)
template <typename V>
__device__ __forceinline__ V block_inclusive_scan(V v, V* scratch, V* total) {
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
        const V n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == kWarp - 1) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        V w = lane < nwarps ? scratch[lane] : V(0);
#pragma unroll
        for (int o = 1; o < kWarp; o <<= 1) {
            const V n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        scratch[lane] = w;
    }
    __syncthreads();
    if (total) *total = scratch[nwarps - 1];
    return v + (warp > 0 ? scratch[warp - 1] : V(0));
}

// ---- bounded spin --------------------------------------------------------------------------------------
// Every wait on the device is bounded: after `timeout_ns` of %globaltimer it gives up and returns false.
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Spin until *p != kEmpty (acquire). Returns the value, or kEmpty after the timeout.
__device__ __forceinline__ uint64_t wait_not_empty_u64(const uint64_t* p, uint64_t timeout_ns) {
    const uint64_t t0 = global_timer_ns();
    uint64_t v;
    while ((v = load_acquire_u64(p)) == kEmpty) {
        if (global_timer_ns() - t0 > timeout_ns) return kEmpty;
        __nanosleep(32);
    }
    return v;
}

// Error record the host reads after a failed wait or bad input: [status, kernel id, expert, source rank].
struct ErrorRecord {
    int status;
    int kernel;
    int expert;
    int src_rank;
};
// Fill the record of the first reporter (the caller won the error flag): fields first, status last, each visible to
// the host before the next.
__device__ __forceinline__ void write_error_record(ErrorRecord* rec, int status, int kernel, int expert, int src_rank) {
    volatile ErrorRecord* e = rec;
    e->kernel = kernel;
    e->expert = expert;
    e->src_rank = src_rank;
    __threadfence_system();
    e->status = status;
    __threadfence_system();
}

// ---- asynchronous copies (cp.async) ---------------------------------------------------------------------
// 16 bytes global -> shared, asynchronously (L2 only); completion per thread through commit / wait groups.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(
                     smem))),
                 "l"(gmem)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory"); }
// Bytes of dynamic shared memory the launch gave this block.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

}  // namespace cuep
