"""One rank of a one-process-per-GPU (CUDA IPC) group: dispatch/combine rounds checked against cuep.reference.

Run under the launcher, e.g. every rank on GPU 0 (the phase-by-phase mode with host barriers)::

    python -m cuep.run -n 4 tests/ipc_worker.py --device 0

or one rank per GPU (the fused kernels)::

    python -m cuep.run -n 4 tests/ipc_worker.py

Every process draws the inputs of all ranks from the same seed, computes the reference for all of them, runs its
own rank and checks its own outputs (tests/ep_check.py). Any mismatch raises, and the process exits non-zero.
The last line of a rank that passed is ``PASS``.
"""
from __future__ import annotations

import argparse
import os
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ep_check

import cuep  # noqa: E402
from ep_check import run_round  # noqa: E402

# (dispatch format, fused_shared_expert, skip_a2a)
CASES = {"bf16": [("bf16", False, False), ("bf16", False, True)],
         "fp8": [("fp8", False, False), ("fp8", True, False)],
         "nvfp4": [("nvfp4", False, False)],
         "mxfp4": [("mxfp4", True, False)]}
# (weights_at, async_halves, residual, bare arrays): every way of calling the API, in turn
CALLS = [("dispatch", False, False, True), ("combine", True, True, False), (None, False, False, True),
         ("dispatch", True, False, True)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", type=int, default=None, help="CUDA device of every rank (default LOCAL_RANK)")
    p.add_argument("--formats", default="bf16,fp8", help="comma-separated dispatch formats")
    p.add_argument("--rounds", type=int, default=6, help="rounds per case")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--expect-phase-barrier", type=int, choices=[0, 1], default=None)
    a = p.parse_args(argv)

    group = cuep.init_distributed(device=a.device, timeout_s=300)
    R, me = group.n_ranks, group.ranks[0]
    print(f"{group!r}", flush=True)
    assert group.kind == "ipc" and group.n_local == 1
    if a.expect_phase_barrier is not None:
        assert group.phase_barrier == bool(a.expect_phase_barrier), group
    for fmt in a.formats.split(","):
        for fmt_name, shared, skip in CASES[fmt]:
            cfg = cuep.EPConfig(hidden=1024, top_k=8, n_experts=24, max_tokens_per_rank=48, n_gpus_per_node=R,
                                dispatch_format=fmt_name, fused_shared_expert=shared, skip_a2a=skip)
            buf = cuep.Buffer(group, cfg, timeout_s=30.0)
            name = f"{fmt_name}{' shared' if shared else ''}{' skip_a2a' if skip else ''}"
            rng = np.random.default_rng([a.seed, zlib.crc32(name.encode())])  # the same on every rank
            for i in range(a.rounds):
                if skip:  # every rank holds the same tokens
                    n = [cfg.max_tokens_per_rank] * R
                else:  # a rank with no tokens (first round), a full one, random ones
                    n = [int(rng.integers(0, 49)) for _ in range(R)]
                    n[-1] = 48
                    if i == 0:
                        n[0] = 0
                weights_at, async_halves, residual, bare = CALLS[i % len(CALLS)]
                run_round(buf, cfg, rng, n, skew=(i % 3 == 2), weights_at=weights_at, async_halves=async_halves,
                          residual=residual, bare=bare)
                if i == a.rounds // 2:
                    buf.reset()  # collective; rounds go on afterwards
            print(f"{name}: {a.rounds} rounds match the reference on rank {me}", flush=True)
            group.barrier()  # no peer still writes into this buffer
            buf.close()
    group.close()
    print("PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
