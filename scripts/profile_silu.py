"""Run each fused_silu output format once after warm-up (for ncu): python scripts/profile_silu.py [--n 16384]."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from cuep import ops  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--inter", type=int, default=7168)
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8", "nvfp4", "mxfp4"])
    a = p.parse_args()
    rng = cupy.random.default_rng(0)
    h = (rng.standard_normal((a.n, 2 * a.inter), dtype=np.float32) * 3).astype(np.dtype(ml_dtypes.bfloat16))
    ro = cupy.asarray(np.linspace(0, a.n, 9).astype(np.int32))
    for f in a.formats:
        for _ in range(3):
            ops.fused_silu(h, ro, f)
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    for f in a.formats:
        ops.fused_silu(h, ro, f)
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()


if __name__ == "__main__":
    main()
