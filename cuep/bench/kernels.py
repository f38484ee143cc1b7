"""The benchmark harness's own kernels (``cuda_src/bench.cu``: the start gate, the segment sum, the floor copy).

They are measurement tools, not part of the EP path, but live with every other kernel in ``cuda_src`` so the
compile tests cover them and ``cuep._kernels`` loads them.
"""
from __future__ import annotations

import functools

from .. import _kernels

GATE_THREADS = 32      # kGateThreads
SEGMENT_THREADS = 256  # kSegThreads
FLOOR_THREADS = 512    # kFloorThreads
FLOOR_UNROLL = 4       # kFloorUnroll: 16-byte vectors in flight per thread
FLOOR_BLOCKS_PER_SM = 4


def function(name: str):
    """Kernel ``name`` of ``cuda_src/bench.cu`` for the current device (compiled on first use, then cached)."""
    return _kernels.function("bench.cu", name)


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device))


def segment_sum_bf16(src, rows, seg, n_seg: int, out, weights=None, max_blocks: int | None = None) -> None:
    """``out[m] = sum_{i in seg[m]..seg[m+1]} w[i] * src[rows[i]]`` on the current stream (see the .cu file).

    Args:
        src: bf16 [*, H] (C-contiguous, H a multiple of 8).
        rows: int32 [nnz]; seg: int32 [n_seg + 1]; weights: float32 [nnz] or None (all ones).
        out: bf16 [>= n_seg, H].
    """
    import cupy
    import numpy as np

    if n_seg == 0:
        return
    hidden = int(src.shape[1])
    if hidden % 8 or not (src.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("segment_sum_bf16 needs C-contiguous rows and hidden a multiple of 8")
    if max_blocks is None:
        max_blocks = 8 * _sm_count(cupy.cuda.Device().id)
    grid = int(min(n_seg, max_blocks))
    fn = function("cuep_bench_segment_sum_bf16")
    fn((grid,), (SEGMENT_THREADS,), (src, rows, weights if weights is not None else np.uint64(0), seg,
                                     np.int32(n_seg), np.int32(hidden), out))


def floor_blocks(read_bytes: int, write_bytes: int, sms: int) -> int:
    """Blocks of one floor copy: enough for every thread to move ``FLOOR_UNROLL`` vectors, at most
    ``FLOOR_BLOCKS_PER_SM`` per SM (a full H100/H200 SM: 2048 threads)."""
    vectors = -(-max(int(read_bytes), int(write_bytes), 16) // 16)
    return int(max(1, min(FLOOR_BLOCKS_PER_SM * sms, -(-vectors // (FLOOR_THREADS * FLOOR_UNROLL)))))


def floor_copy(src, dst, read_bytes: int, write_bytes: int, salt: int = 0x9E3779B9) -> None:
    """One copy kernel reading ``read_bytes`` of ``src`` and writing ``write_bytes`` of ``dst`` (both multiples of
    16, at most the buffers' sizes; ``cuda_src/bench.cu``: cuep_bench_floor_copy) on the current stream.

    Args:
        src, dst: CuPy arrays or ``cupy.cuda.Memory`` (16-byte aligned, not overlapping).
    """
    import cupy
    import numpy as np

    if read_bytes % 16 or write_bytes % 16 or read_bytes < 0 or write_bytes < 0:
        raise ValueError(f"floor_copy: read_bytes={read_bytes} and write_bytes={write_bytes} must be non-negative "
                         f"multiples of 16")
    ptr = lambda a: int(a.ptr) if hasattr(a, "ptr") else int(a.data.ptr)  # noqa: E731
    size = lambda a: int(a.size) if hasattr(a, "ptr") else int(a.nbytes)  # noqa: E731
    if read_bytes > size(src) or write_bytes > size(dst):
        raise ValueError(f"floor_copy: {read_bytes} bytes read from {size(src)}, {write_bytes} written to {size(dst)}")
    grid = floor_blocks(read_bytes, write_bytes, _sm_count(cupy.cuda.Device().id))
    function("cuep_bench_floor_copy")((grid,), (FLOOR_THREADS,), (
        np.uint64(ptr(src)), np.uint64(ptr(dst)), np.int64(read_bytes // 16), np.int64(write_bytes // 16),
        np.uint32(salt)))


LAUNCH_FLOOR_BYTES = 544  # sizeof(LaunchFloorArgs) in cuda_src/bench.cu: cuep.params.DISPATCH_PARAMS_DTYPE's size


def launch_floor():
    """A prepared launch (:class:`cuep._kernels.PreparedLaunch`) of ``cuep_bench_launch_floor`` on the current
    device: an empty kernel launched as cuep's dispatch is (one 512-thread block per SM, a 544-byte struct by
    value). Call ``launch(grid)``: the host cost of a launch alone, the part of an eager call Python cannot cut."""
    import struct

    from .._kernels import PreparedLaunch

    return PreparedLaunch(function("cuep_bench_launch_floor"), 512, 0, LAUNCH_FLOOR_BYTES, (0,), struct.Struct("<q"))

