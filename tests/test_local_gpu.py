"""The one-rank dispatch (cuda_src/dispatch/local.cuh): a group of one rank runs a fused round of at most
small_batch_tokens tokens in its own kernel (every block lays the round out from topk_ids, no protocol). Every
output against cuep.reference, mixed with protocol rounds on the same buffer, every combine mode after it, bad
routing reported, and a CUDA graph replay."""
from __future__ import annotations

import numpy as np
import pytest

import cuep
from cuep import reference as ref
from ep_check import make_inputs, run_round, to_devices

FORMATS = ["bf16", "fp8", "nvfp4", "mxfp4"]


def make(**kw):
    cfg = cuep.EPConfig(**{**dict(hidden=1024, top_k=8, n_experts=32, max_tokens_per_rank=48, n_gpus_per_node=1,
                                  small_batch_tokens=32), **kw})
    return cfg, cuep.Buffer(cuep.init([0]), cfg, timeout_s=5.0)


def local_launches(buf, op: str = "dispatch") -> int:
    """How many one-rank kernels of ``op`` this buffer has prepared (one per kernel variant used)."""
    host = buf._launch_cache.get("host")
    return sum(1 for key in (host.launches if host else {}) if f":cuep_{op}_local_" in key[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared_expert"])
def test_local_rounds_match_reference(fmt, shared, rng):
    cfg, buf = make(dispatch_format=fmt, fused_shared_expert=shared)
    # 0, 1, some, exactly small_batch_tokens; 48 > 32 takes the protocol in between; the halves too
    for n in (1, 0, 7, 32, 48, 32, 1):
        run_round(buf, cfg, rng, [n], weights_at="dispatch")
    run_round(buf, cfg, rng, [32], weights_at="combine", residual=True)
    run_round(buf, cfg, rng, [20], weights_at=None)
    run_round(buf, cfg, rng, [20], skew=True, dtype=np.dtype(np.float32))
    run_round(buf, cfg, rng, [12], async_halves=True)  # two launches: the protocol's halves
    run_round(buf, cfg, rng, [12], bare=True)
    assert local_launches(buf) >= 2  # bf16 and float32 input
    assert local_launches(buf, "combine") == 1
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared_expert"])
def test_local_rounds_float32_combine(shared, rng):
    cfg, buf = make(dispatch_format="nvfp4", combine_dtype="float32", fused_shared_expert=shared)
    for n, weights_at, residual in ((9, "dispatch", False), (32, "combine", True), (3, None, False),
                                    (40, "dispatch", True), (1, "dispatch", True)):
        run_round(buf, cfg, rng, [n], weights_at=weights_at, residual=residual)
    assert local_launches(buf, "combine") == 1
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_local_rounds_other_shapes(fmt, rng):
    # top_k = 1 and 2, many experts with few tokens each (most groups empty), a wide row (several chunks per token)
    for kw in (dict(top_k=1, n_experts=8), dict(top_k=2, n_experts=256, hidden=2048),
               dict(top_k=8, n_experts=64, hidden=7168, max_tokens_per_rank=128, small_batch_tokens=128)):
        cfg, buf = make(dispatch_format=fmt, **kw)
        for n in (1, 5, cfg.small_batch_tokens):
            run_round(buf, cfg, rng, [n])
        assert local_launches(buf) == 1
        buf.close()


@pytest.mark.gpu
def test_local_round_reports_bad_routing(rng):
    cfg, buf = make()
    xs, ids, ws = make_inputs(rng, cfg, [8])
    ids[0][3, 2] = cfg.n_experts + 5
    gx, gids, gws = to_devices(buf.group, xs), to_devices(buf.group, ids), to_devices(buf.group, ws)
    with pytest.raises(cuep.EPError, match=str(cfg.n_experts + 5)):
        cuep.dispatch(buf, gx, gids, gws)
        buf.synchronize()
    assert local_launches(buf) == 1
    buf.reset()
    run_round(buf, cfg, rng, [8])  # a good round after reset
    buf.close()


@pytest.mark.gpu
def test_local_round_in_a_cuda_graph(rng):
    import cupy

    cfg, buf = make(dispatch_format="fp8")
    n = 16
    xs, ids, ws = make_inputs(rng, cfg, [n])
    gx, gids, gws = to_devices(buf.group, xs), to_devices(buf.group, ids), to_devices(buf.group, ws)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuep.dispatch(buf, gx, gids, gws)  # compile and prepare outside the capture
        stream.synchronize()
        stream.begin_capture()
        d = cuep.dispatch(buf, gx, gids, gws)
        graph = stream.end_capture()
    # fresh routing and tokens into the captured arrays, then replay: the outputs follow the new inputs
    for _ in range(3):
        xs2, ids2, ws2 = make_inputs(rng, cfg, [n])
        for dst, src in ((gx, xs2), (gids, ids2), (gws, ws2)):
            dst[0][...] = to_devices(buf.group, src)[0]
        with stream:
            graph.launch()
            stream.synchronize()
        want = ref.dispatch([np.asarray(xs2[0])], ids2, cfg)[0]
        rows = int(d[0].row_offsets[-1].get())
        assert rows == want.n_rows
        np.testing.assert_array_equal(d[0].row_offsets.get(), want.row_offsets)
        got_rows = {(int(t), int(k)): d[0].tokens[i].get().tobytes()
                    for i, (t, k) in enumerate(d[0].src_info[:rows].get()) if t >= 0}
        want_rows = {(int(t), int(k)): np.asarray(want.tokens[i]).tobytes()
                     for i, (t, k) in enumerate(want.src_info[:rows]) if t >= 0}
        assert got_rows == want_rows
    buf.close()
