"""The benchmark harness's own kernels (``cuda_src/bench.cu``: the start gate, the segment sum).

They are measurement tools, not part of the EP path, but live with every other kernel in ``cuda_src`` so the
compile tests cover them and ``cuep._kernels`` loads them.
"""
from __future__ import annotations

import functools

from .. import _kernels

GATE_THREADS = 32      # kGateThreads
SEGMENT_THREADS = 256  # kSegThreads


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
