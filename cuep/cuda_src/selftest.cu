// Tiny kernels that exercise the device helpers of common.cuh and the element primitives of formats.cuh, so GPU
// tests can check them directly (cuep.ops._selftest_*). Not used by any op.
#include "common.cuh"
#include "formats.cuh"

// block_copy16 (kUnroll 4) of `nbytes` from src to dst by one block of any size; pointers 16-byte aligned.
extern "C" __global__ void __launch_bounds__(1024)
    selftest_block_copy16(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, long long nbytes) {
    cuep::block_copy16(dst, src, nbytes, int(threadIdx.x), int(blockDim.x));
}

// warp_copy16 by warp `warp` of the block (the other warps do nothing).
extern "C" __global__ void __launch_bounds__(1024)
    selftest_warp_copy16(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, long long nbytes, int warp) {
    if (int(threadIdx.x) / cuep::kWarp == warp) cuep::warp_copy16(dst, src, nbytes, int(threadIdx.x) % cuep::kWarp);
}

// Two scans in a row (the second reuses the scratch of the first): out[t] = inclusive scan of in[t];
// out[blockDim + t] = inclusive scan of 2 * in[t] + 1; totals[0], totals[1] the block sums seen by thread t
// (checked equal in every thread: totals[2 * t], totals[2 * t + 1]).
extern "C" __global__ void __launch_bounds__(1024)
    selftest_block_scan(const int* __restrict__ in, int* __restrict__ out, int* __restrict__ totals) {
    __shared__ int scratch[cuep::kWarp];
    const int t = int(threadIdx.x);
    int total0, total1;
    out[t] = cuep::block_inclusive_scan(in[t], scratch, &total0);
    out[blockDim.x + t] = cuep::block_inclusive_scan(2 * in[t] + 1, scratch, &total1);
    totals[2 * t] = total0;
    totals[2 * t + 1] = total1;
}

// Block 0 writes `n` payload words then publishes `count` with signal_completion (release when `last`);
// block 1 waits (wait_not_empty_u64, bounded by timeout_ns) and then reads the payload:
// result[0] = value seen (kEmpty on timeout), result[1] = number of payload words that matched,
// result[2] = elapsed ns of the wait. `slot` must hold kEmpty before the launch. Launch 2 blocks of 32 threads.
extern "C" __global__ void __launch_bounds__(32)
    selftest_signal_wait(uint64_t* slot, uint64_t* payload, long long n, unsigned long long count, int last,
                         unsigned long long timeout_ns, unsigned long long* result) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) {
        for (long long i = 0; i < n; ++i) reinterpret_cast<volatile uint64_t*>(payload)[i] = count + uint64_t(i);
        cuep::signal_completion(slot, count, last != 0);
    } else {
        const uint64_t t0 = cuep::global_timer_ns();
        const uint64_t v = cuep::wait_not_empty_u64(slot, timeout_ns);
        const uint64_t t1 = cuep::global_timer_ns();
        unsigned long long ok = 0;
        if (v != cuep::kEmpty)
            for (long long i = 0; i < n; ++i) ok += reinterpret_cast<volatile uint64_t*>(payload)[i] == v + uint64_t(i);
        result[0] = v;
        result[1] = ok;
        result[2] = t1 - t0;
    }
}

// The timeout path alone: one thread waits on `slot` (nobody writes it). result as above.
extern "C" __global__ void __launch_bounds__(32)
    selftest_wait_timeout(const uint64_t* slot, unsigned long long timeout_ns, unsigned long long* result) {
    if (threadIdx.x != 0) return;
    const uint64_t t0 = cuep::global_timer_ns();
    result[0] = cuep::wait_not_empty_u64(slot, timeout_ns);
    result[2] = cuep::global_timer_ns() - t0;
}

// out[2i] = align_up(n[i], a[i]), out[2i + 1] = ceil_div(n[i], a[i]).
extern "C" __global__ void __launch_bounds__(cuep::kOpsThreads)
    selftest_align_up(const long long* __restrict__ n, const long long* __restrict__ a, long long* __restrict__ out,
                      int count) {
    const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < count) {
        out[2 * i] = cuep::align_up(n[i], a[i]);
        out[2 * i + 1] = cuep::ceil_div(n[i], a[i]);
    }
}

// Element primitives, one value per thread: e4m3 / e2m1 / bf16 encode of float32, e4m3 / e2m1 decode of codes,
// ftz, and the swizzled offset.
extern "C" __global__ void __launch_bounds__(cuep::kOpsThreads)
    selftest_encode(const float* __restrict__ v, uint8_t* __restrict__ e4m3, uint8_t* __restrict__ e2m1,
                    uint16_t* __restrict__ bf16, float* __restrict__ flushed, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        e4m3[i] = uint8_t(cuep::e4m3_encode(v[i]));
        e2m1[i] = uint8_t(cuep::e2m1_encode(v[i]));
        bf16[i] = uint16_t(cuep::bf16_encode(v[i]));
        flushed[i] = cuep::ftz(v[i]);
    }
}

// silu_f32 and rcp_rn_normal of formats.cuh, one value per thread.
extern "C" __global__ void __launch_bounds__(cuep::kOpsThreads)
    selftest_silu(const float* __restrict__ v, float* __restrict__ silu, float* __restrict__ rcp, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        silu[i] = cuep::silu_f32(v[i]);
        rcp[i] = cuep::rcp_rn_normal(v[i]);
    }
}

// The quantizers' division-free block-scale arithmetic against IEEE division (div.rn.ftz / rcp.rn.ftz), over
// `count` inputs from `first` (grid-stride): mismatches are counted in result[0], the first mismatching index goes
// to result[1] (atomicMin; start it at ~0). mode 0: x = bits(first + i), fp8's s = max(x, 1e-4) / 448;
// mode 1: x = bits(first + i), nvfp4's sf = cvt_e4m3(x / 6) (x clamped as warp_quantize does); mode 2:
// d = bits(first + i), RN(1 / d); mode 3: g = gs[i / 126], sfv = e4m3 code 1 + i % 126: g / sfv.
extern "C" __global__ void __launch_bounds__(cuep::kOpsThreads)
    selftest_scale_divisions(int mode, unsigned long long first, unsigned long long count,
                             const float* __restrict__ gs, unsigned long long* result) {
    unsigned long long bad = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < count;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float x = __uint_as_float(uint32_t(first + i));
        bool same;
        if (mode == 0) {
            const float a = fmaxf(x, cuep::kFp8AmaxFloor);
            same = __float_as_uint(cuep::div_rn_by(a, cuep::kFp8Max, cuep::kFp8MaxRcp)) ==
                   __float_as_uint(__fdiv_rn(a, cuep::kFp8Max));
        } else if (mode == 1) {
            same = cuep::e4m3_encode(cuep::div_rn_by(fminf(x, 4096.0f), cuep::kE2m1Max, cuep::kE2m1MaxRcp)) ==
                   cuep::e4m3_encode(__fdiv_rn(x, cuep::kE2m1Max));
        } else if (mode == 2) {
            same = __float_as_uint(cuep::rcp_rn_normal(x)) == __float_as_uint(__frcp_rn(x));
        } else {
            const float g = gs[i / 126], sfv = cuep::e4m3_to_float(uint32_t(1 + i % 126));
            same = __float_as_uint(cuep::div_rn_by(g, sfv, cuep::rcp_rn_normal(sfv))) ==
                   __float_as_uint(__fdiv_rn(g, sfv));
        }
        if (!same) {
            ++bad;
            atomicMin(result + 1, i);
        }
    }
    if (bad) atomicAdd(result, bad);
}

// codes 0..255: e4m3 decode; codes & 15: e2m1 decode; out[2i], out[2i + 1]. Launch >= 256 threads.
extern "C" __global__ void __launch_bounds__(cuep::kOpsThreads) selftest_decode(float* __restrict__ out) {
    const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < 256) {
        out[2 * i] = cuep::e4m3_decode(uint32_t(i));
        out[2 * i + 1] = cuep::e2m1_decode(uint32_t(i) & 15u);
    }
}

extern "C" __global__ void __launch_bounds__(cuep::kOpsThreads)
    selftest_swizzled_offset(const long long* __restrict__ rows, const int* __restrict__ cols, int k_tiles,
                             long long* __restrict__ out, int count) {
    const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < count) out[i] = cuep::swizzled_scale_offset(rows[i], cols[i], k_tiles);
}

// The header constants, for a GPU test against cuep.formats: [fp8 block, fp8 max, fp8 amax floor, nvfp4 block,
// mxfp4 block, e2m1 max, tile rows, tile cols, tile bytes, align, ops threads].
extern "C" __global__ void selftest_constants(double* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = cuep::kFp8Block;
        out[1] = cuep::kFp8Max;
        out[2] = cuep::kFp8AmaxFloor;
        out[3] = cuep::kNvfp4Block;
        out[4] = cuep::kMxfp4Block;
        out[5] = cuep::kE2m1Max;
        out[6] = cuep::kScaleTileRows;
        out[7] = cuep::kScaleTileCols;
        out[8] = cuep::kScaleTileBytes;
        out[9] = cuep::kAlign;
        out[10] = cuep::kOpsThreads;
    }
}
