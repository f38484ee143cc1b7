"""One rank of a multi-node group (NVSHMEM between nodes): dispatch/combine rounds checked against cuep.reference.

Run under the launcher; the node layout is declared, so several "nodes" fit on one host, even on one GPU::

    python -m cuep.run -n 4 --gpus-per-node 2 tests/internode_worker.py --device 0

Every process draws the inputs of all ranks from the same seed, computes the reference for all of them, runs its
own rank and checks its own outputs (tests/ep_check.py). The last line of a rank that passed is ``PASS``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ep_check

import cuep  # noqa: E402
from ep_check import BF16, check_dispatch, make_inputs, run_round  # noqa: E402

from cuep import reference as ref  # noqa: E402

# (dispatch format, fused_shared_expert, combine dtype, skip_a2a, allreduce_world_size)
CASES = {"bf16": [("bf16", False, "bfloat16", False, 1), ("bf16", True, "float32", False, 1),
                  ("bf16", True, "bfloat16", True, 2)],
         "fp8": [("fp8", False, "bfloat16", False, 1), ("fp8", True, "bfloat16", False, 1),
                 ("fp8", False, "bfloat16", True, 1)],
         "nvfp4": [("nvfp4", False, "bfloat16", False, 1)],
         "mxfp4": [("mxfp4", True, "bfloat16", False, 1)]}
# (weights_at, async_halves, residual, bare arrays): every way of calling the API, in turn
CALLS = [("dispatch", False, False, True), ("combine", True, True, False), (None, False, False, True),
         ("dispatch", True, True, True)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", type=int, default=None, help="CUDA device of every rank (default LOCAL_RANK)")
    p.add_argument("--formats", default="bf16,fp8,nvfp4,mxfp4", help="comma-separated dispatch formats")
    p.add_argument("--rounds", type=int, default=6, help="rounds per case")
    p.add_argument("--tokens", type=int, default=40, help="max_tokens_per_rank")
    p.add_argument("--small", type=int, default=None,
                   help="small_batch_tokens (default tokens // 2: rounds mix direct and two-hop sources)")
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--graph", action="store_true", help="also capture dispatch + combine in a CUDA graph, replay")
    p.add_argument("--moe", action="store_true", help="also a cuep.moe layer (every format) against the dense one")
    p.add_argument("--missing-peer", type=int, default=None, help="only: this rank skips a round (timeout test)")
    a = p.parse_args(argv)

    group = cuep.init_distributed(device=a.device, timeout_s=300)
    R, me, G = group.n_ranks, group.ranks[0], group.gpus_per_node
    print(f"{group!r}: {R // G} nodes x {G} GPUs", flush=True)
    assert R // G > 1, "this worker tests several nodes: pass the launcher --gpus-per-node"
    T = a.tokens
    if a.missing_peer is not None:
        missing_peer_round(group, a.missing_peer, T)
        a.formats = ""
    for fmt in filter(None, a.formats.split(",")):
        for fmt_name, shared, cdt, skip, ar in CASES[fmt]:
            cfg = cuep.EPConfig(hidden=512, top_k=6, n_experts=24, max_tokens_per_rank=T, n_gpus_per_node=G,
                                n_nodes=R // G, dispatch_format=fmt_name, fused_shared_expert=shared,
                                combine_dtype=cdt, small_batch_tokens=T // 2 if a.small is None else a.small,
                                skip_a2a=skip, allreduce_world_size=ar)
            buf = cuep.Buffer(group, cfg, timeout_s=60.0)
            name = f"{fmt_name}{' shared' if shared else ''} combine {cdt}{' skip_a2a' if skip else ''} A={ar}"
            rng = np.random.default_rng([a.seed, zlib.crc32(name.encode())])  # the same on every rank
            for i in range(a.rounds):
                n = [int(rng.integers(0, T + 1)) for _ in range(R)]
                n[-1] = T  # a full rank
                if i == 0:
                    n[:G] = [0] * G  # a node sending nothing
                if skip:  # every rank holds the same tokens
                    n = [n[i % R]] * R
                weights_at, async_halves, residual, bare = CALLS[i % len(CALLS)]
                run_round(buf, cfg, rng, n, skew=(i % 3 == 2), weights_at=weights_at, async_halves=async_halves,
                          residual=residual and weights_at is not None, bare=bare)
                if i == a.rounds // 2:
                    buf.reset()  # collective; rounds go on afterwards
            print(f"{name}: {a.rounds} rounds match the reference on rank {me}", flush=True)
            group.barrier()
            buf.close()
    if a.graph:
        graph_replay(group, T, a.seed, T // 2 if a.small is None else a.small)
    if a.moe:
        moe_layer(group, T)
    group.close()
    print("PASS", flush=True)
    return 0


def _inputs(rng, cfg, R):
    return make_inputs(rng, cfg, [cfg.max_tokens_per_rank] * R)


def graph_replay(group, T: int, seed: int, small: int) -> None:
    """dispatch (weights at dispatch) -> expert_out = the dispatched rows (identity experts) -> combine, captured
    once in a CUDA graph per rank and replayed with fresh inputs copied into the captured arrays. Ranks sharing a
    GPU run the captured kernels without host barriers (the GPU time-slices the processes' spinning kernels)."""
    import cupy

    R, G, me = group.n_ranks, group.gpus_per_node, group.ranks[0]
    cfg = cuep.EPConfig(hidden=512, top_k=6, n_experts=24, max_tokens_per_rank=T, n_gpus_per_node=G, n_nodes=R // G,
                        small_batch_tokens=small)
    buf = cuep.Buffer(group, cfg, timeout_s=60.0)
    group.phase_barrier = False  # a graph holds no host barrier
    rng = np.random.default_rng([seed, 99])
    xs, ids, ws = _inputs(rng, cfg, R)
    x, i, w = (cupy.asarray(v[me]) for v in (xs, ids, ws))
    eo = cupy.zeros((cfg.capacity, cfg.hidden), dtype=BF16)
    d = cuep.dispatch(buf, x, i, w)  # eager first: kernels built, first-launch barrier done
    cuep.combine(buf, eo, d)
    buf.synchronize()
    group.barrier()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        d = cuep.dispatch(buf, x, i, w)
        eo[:] = d.tokens
        out = cuep.combine(buf, eo, d)
        graph = stream.end_capture()
    for rep in range(3):
        xs, ids, ws = _inputs(rng, cfg, R)
        x[...], i[...], w[...] = (cupy.asarray(v[me]) for v in (xs, ids, ws))
        cupy.cuda.Device().synchronize()
        group.barrier()
        graph.launch(stream)
        stream.synchronize()
        buf.check()
        want = ref.dispatch(xs, ids, cfg)
        check_dispatch(buf, [d], [want[me]], cfg)
        want_c = ref.combine([v.tokens.astype(np.float32) for v in want], want, ws, cfg)[me]
        got = out.get().astype(np.float32)
        scale = max(1.0, float(np.abs(want_c).max()))
        np.testing.assert_allclose(got, want_c, rtol=2e-2, atol=2e-2 * scale, err_msg=f"graph replay {rep}")
        group.barrier()
    print(f"graph: 3 replays match the reference on rank {me}", flush=True)
    group.barrier()
    buf.close()


def moe_layer(group, T: int) -> None:
    """cuep.moe.moe_forward (router, dispatch, grouped GEMMs, fused SwiGLU, combine) across nodes against the dense
    NumPy layer, each format, fused shared expert: relative Frobenius error below the single-node tests' bound."""
    import cupy

    from cuep import moe

    R, G, me = group.n_ranks, group.gpus_per_node, group.ranks[0]
    for fmt in ("bf16", "fp8", "nvfp4", "mxfp4"):
        cfg = cuep.EPConfig(hidden=512, top_k=6, n_experts=24, max_tokens_per_rank=T, n_gpus_per_node=G,
                            n_nodes=R // G, dispatch_format=fmt, fused_shared_expert=True)
        buf = cuep.Buffer(group, cfg, timeout_s=60.0)
        weights = moe.init_weights(cfg, 256, seed=11, devices=[0] * R)  # every rank's, for the dense reference
        rng = np.random.default_rng([5, R])
        xs = [rng.standard_normal((T - r, cfg.hidden)).astype(BF16) for r in range(R)]
        out = moe.moe_forward(buf, [cupy.asarray(xs[me])], [weights[me]])
        want = moe.moe_reference(xs, [w.to_numpy() for w in weights], cfg)[me]
        got = out[0].get().astype(np.float32)
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert np.isfinite(got).all() and err < 2e-2, f"moe {fmt}: relative error {err:.2e}"
        print(f"moe {fmt}: relative error {err:.2e} on rank {me}", flush=True)
        group.barrier()
        buf.close()


def missing_peer_round(group, missing: int, T: int) -> None:
    """One good round, then a round rank ``missing`` skips: every other rank's device-side wait times out and
    raises cuep.EPError at synchronize; then every rank resets and a good round runs again."""
    R, G, me = group.n_ranks, group.gpus_per_node, group.ranks[0]
    cfg = cuep.EPConfig(hidden=512, top_k=6, n_experts=24, max_tokens_per_rank=T, n_gpus_per_node=G, n_nodes=R // G)
    timeout = 3.0
    buf = cuep.Buffer(group, cfg, timeout_s=timeout)
    rng = np.random.default_rng([7, 7])
    run_round(buf, cfg, rng, [T] * R, bare=True)
    group.phase_barrier = False  # the device-side waits, not the host barriers, must catch the missing peer
    xs, ids, ws = _inputs(rng, cfg, R)
    if me == missing:
        time.sleep(3 * timeout)
        print(f"rank {me}: skipped the round", flush=True)
    else:
        import cupy

        try:
            cuep.dispatch(buf, cupy.asarray(xs[me]), cupy.asarray(ids[me]), cupy.asarray(ws[me]))
            buf.synchronize()
            raise AssertionError(f"rank {me}: a round without rank {missing} completed")
        except cuep.EPError as e:
            print(f"EPError ({e.reason}): {e}", flush=True)
            assert e.reason == "timeout", e
    group.phase_barrier = True
    buf.reset()  # collective: every rank re-armed
    run_round(buf, cfg, rng, [T] * R, bare=True)
    print(f"rank {me}: a good round after reset matches the reference", flush=True)
    group.barrier()
    buf.close()


if __name__ == "__main__":
    sys.exit(main())
