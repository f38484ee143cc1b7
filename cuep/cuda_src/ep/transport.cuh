// The transport seam: every byte and every signal an EP kernel sends to another rank goes through the functions
// below, and a receiver waits on its own memory through the poll functions. Kernels never form a peer address or
// choose a memory order for cross-rank traffic themselves.
//
// Today's implementation is NVLink peer stores: a peer's buffer is mapped into this GPU's address space (peer
// access in one process, cudaIpcOpenMemHandle across processes), remote() is its base address plus an offset,
// puts are ordinary (or bulk-copy) stores, and signals are system-scope stores or atomics. Every call names the
// destination rank even where the address alone would do. Across nodes the two-hop protocol (per-node forwarders,
// NVSHMEM puts with signals) has its own kernels in nvshmem/, since its steps differ, not only its transport.
//
// The contract every implementation keeps:
//   put_*        data into `rank`'s buffer; unordered with other puts
//   fence_puts   every put this thread issued before it is visible to `rank` before any signal it issues after
//   signal_*     a flag, a stamped entry or a count at `rank`; signal_stamped / signal_flag need fence_puts for the
//                data they announce (a stamped entry announces only itself: the receiver checks its stamp),
//                signal_release and signal_add order the thread's (and, after a barrier, its block's) earlier
//                writes themselves
//   poll_*       the receiver's acquire loads of its own buffer; after one returns a signal's value, the data that
//                signal announces is visible to the polling thread (and, after a warp or block barrier, its group)
#pragma once
#include "params.cuh"

namespace cuep {

// ---- addressing -------------------------------------------------------------------------------------------------
// Address of byte `off` of `rank`'s symmetric buffer (rank may be this one).
__device__ __forceinline__ char* remote(const EPParams& ep, int rank, long long off) {
    return reinterpret_cast<char*>(ep.peer_base[rank]) + off;
}

// ---- data -------------------------------------------------------------------------------------------------------
// A destination of bulk data as one 64-bit word: a 16-byte aligned address in `rank`'s buffer with the rank in its
// low 4 bits, so a warp that fans one chunk out to several ranks keeps one register per destination.
using PutTarget = unsigned long long;
__device__ __forceinline__ PutTarget put_target(int rank, const void* dst) {
    return reinterpret_cast<unsigned long long>(dst) | static_cast<unsigned>(rank);
}
__device__ __forceinline__ int target_rank(PutTarget t) { return static_cast<int>(t & 15u); }
// A warp's registers (WarpVectors, lane l holds vectors l, l + 32, ...) to byte `off` of `target`: `nbytes` bytes.
template <int kVec>
__device__ __forceinline__ void put_vectors(PutTarget target, long long off, const WarpVectors<kVec>& v, int nbytes,
                                            int lane) {
    v.store(reinterpret_cast<char*>(target & ~15ull) + off, nbytes, lane);
}
// One value (a message's metadata field, its scales) to `dst` in `rank`'s buffer.
template <typename T>
__device__ __forceinline__ void put_value(int /*rank*/, T* dst, const T& value) {
    *dst = value;
}
// A warp's copy of `nbytes` (a multiple of 16, both 16-byte aligned) from this GPU to `dst` in `rank`'s buffer.
__device__ __forceinline__ void put_copy(int /*rank*/, void* dst, const void* src, int64_t nbytes, int lane) {
    warp_copy16(dst, src, nbytes, lane);
}
// `bytes` of this block's shared memory to `dst` in `rank`'s buffer by the bulk-copy engine (one thread): the
// thread never waits for the remote write. Before it: every generic write of the source (fence_shared_for_bulk).
__device__ __forceinline__ void put_bulk(int /*rank*/, void* dst, const void* smem, int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Generic shared-memory writes before the copy engine reads them (each writing thread, then a barrier).
__device__ __forceinline__ void fence_shared_for_bulk() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// This thread's bulk puts have read their shared memory (it may be rewritten).
__device__ __forceinline__ void put_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// This thread's bulk puts but the newest `kPending` groups are complete, and their writes ordered before the
// thread's later signals.
template <int kPending>
__device__ __forceinline__ void put_bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
}
// A 16-byte vector as two 8-byte words that a polling receiver takes each as soon as it differs from all ones
// (poll_words): no fence and no signal behind it. An aligned 8-byte access is single-copy atomic.
__device__ __forceinline__ void put_words_polled(int /*rank*/, void* dst, unsigned long long lo,
                                                 unsigned long long hi) {
    asm volatile("st.relaxed.sys.global.v2.b64 [%0], {%1, %2};" ::"l"(dst), "l"(lo), "l"(hi) : "memory");
}

// ---- signals ----------------------------------------------------------------------------------------------------
__device__ __forceinline__ void fence_puts() { fence_sys(); }
// A flag (relaxed, system scope): after fence_puts for the data it announces.
__device__ __forceinline__ void signal_flag(int /*rank*/, int* flag, int value) { store_relaxed_sys_i32(flag, value); }
// A stamped entry (relaxed): the receiver takes it once its stamp is this round's; it announces nothing else.
__device__ __forceinline__ void signal_stamped(int /*rank*/, uint64_t* entry, uint64_t value) {
    store_relaxed_u64(entry, value);
}
// A flag with release semantics: every earlier write of this thread (after a barrier, of its block) before it.
__device__ __forceinline__ void signal_release(int /*rank*/, uint64_t* flag, uint64_t value) {
    store_release_u64(flag, value);
}
// Add `v` to a count at `rank` that orders this thread's earlier writes before it (release at the narrowest scope
// that holds the reader: GPU scope when `rank` is this one).
__device__ __forceinline__ void signal_add(const EPParams& ep, int rank, int* count, int v) {
    release_add_count(count, v, rank == static_cast<int>(ep.rank));
}

// ---- polls (the receiver, on its own buffer) ----------------------------------------------------------------------
__device__ __forceinline__ int poll_flag(const int* flag) { return load_acquire_sys_i32(flag); }
__device__ __forceinline__ uint64_t poll_u64(const uint64_t* entry) { return load_acquire_u64(entry); }
// Both 8-byte words of a polled vector (put_words_polled); all ones: not landed.
__device__ __forceinline__ void poll_words(const void* p, unsigned long long& lo, unsigned long long& hi) {
    asm volatile("ld.relaxed.sys.global.v2.b64 {%0, %1}, [%2];" : "=l"(lo), "=l"(hi) : "l"(p) : "memory");
}

}  // namespace cuep
