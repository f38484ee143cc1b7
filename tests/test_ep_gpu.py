"""Dispatch and combine on the GPU against cuep.reference.

`gpu` tests simulate R ranks on one GPU (the protocol runs phase by phase, rank by rank, on one stream): every
byte of the contract is checked without several GPUs. `multigpu` tests run the same bodies with one rank per GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

import cuep
from ep_check import BF16, make_inputs, run_round, to_devices
from conftest import N_GPUS

FORMATS = ["bf16", "fp8", "nvfp4", "mxfp4"]


def make(devices, num_sms=None, **kw):
    cfg = cuep.EPConfig(**{**dict(hidden=1024, top_k=8, n_experts=32, max_tokens_per_rank=48,
                                  n_gpus_per_node=len(devices)), **kw})
    return cfg, cuep.Buffer(cuep.init(devices), cfg, timeout_s=5.0, num_sms=num_sms)


def groups():
    out = [pytest.param([0], id="gpu1", marks=pytest.mark.gpu),  # one real rank: the fused single-launch path
           pytest.param([0, 0], id="sim2", marks=pytest.mark.gpu),
           pytest.param([0, 0, 0, 0], id="sim4", marks=pytest.mark.gpu),
           # eight ranks (the field's EP size, kMaxRanks) on one GPU: every 8-wide table and rank mask in use
           pytest.param([0] * 8, id="sim8", marks=pytest.mark.gpu)]
    for n in (2, 4, 8):
        out.append(pytest.param(list(range(n)), id=f"gpu{n}",
                                marks=[pytest.mark.multigpu,
                                       pytest.mark.skipif(N_GPUS < n, reason=f"needs {n} GPUs")]))
    return out


@pytest.mark.parametrize("devices", groups())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shared, skip", [(False, False), (True, False), (False, True), (True, True)])
def test_round_matches_reference(devices, fmt, shared, skip, rng):
    # small_batch_tokens: ranks with at most 24 tokens take the staged (decode) protocol and the others the
    # direct one, in the same round; 48: every rank staged; 0: every rank direct
    small = {(False, False): 24, (True, False): 48, (False, True): 0, (True, True): 48}[shared, skip]
    cfg, buf = make(devices, dispatch_format=fmt, fused_shared_expert=shared, skip_a2a=skip, small_batch_tokens=small)
    R = len(devices)
    # a rank with no tokens, ranks with some, and one with N = T
    n = [cfg.max_tokens_per_rank] * R if skip else [
        48 if r == R - 1 else (0 if r == 0 else int(rng.integers(1, 48))) for r in range(R)]
    run_round(buf, cfg, rng, n, weights_at="dispatch")
    run_round(buf, cfg, rng, n, weights_at="combine", residual=True, async_halves=True)
    run_round(buf, cfg, rng, n, weights_at=None)


@pytest.mark.parametrize("devices", [p for p in groups() if p.id in ("sim2", "gpu2")])
@pytest.mark.parametrize("fmt", FORMATS)
def test_protocol_rounds_edge_inputs(devices, fmt, rng):
    # The protocol's send encodes as the one-rank kernels do: subnormal inputs count as zeros of their sign (bf16
    # keeps them), from bf16 and float32 tokens, a direct rank (48 tokens) beside a staged one (10)
    cfg, buf = make(devices, dispatch_format=fmt, small_batch_tokens=24)
    for dtype in (BF16, np.dtype(np.float32)):
        run_round(buf, cfg, rng, [48, 10], dtype=dtype, edge=True)
        run_round(buf, cfg, rng, [10, 48], dtype=dtype, edge=True, async_halves=True)
    buf.close()


@pytest.mark.parametrize("devices", [p for p in groups() if p.id in ("sim2", "gpu2")])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_padding_zeroed_across_protocol_rounds(devices, fmt, rng):
    # The protocol's receive (phase_recv) with scales not poisoned between rounds: it zeroes only the scale-tile rows
    # the rounds before may have left (scale_tile_rows), directly or, in large rounds (H = 7168), through the gather
    # of whole tiles; growing and shrinking rounds, staged and direct, a shared expert, must keep every padding byte
    # of the used tiles zero and every tile's rows past its bound zero (check_dispatch).
    cfg, buf = make(devices, dispatch_format=fmt, hidden=7168, max_tokens_per_rank=600, small_batch_tokens=32,
                    fused_shared_expert=True)
    for n, kw in (([600, 600], {}), ([3, 1], {}), ([600, 300], {"skew": True}), ([2, 0], {}), ([300, 40], {}),
                  ([1, 5], {"skew": True}), ([600, 600], {"async_halves": True}), ([7, 7], {})):
        run_round(buf, cfg, rng, n, poison_scales=False, **kw)
    buf.close()


@pytest.mark.parametrize("devices", groups())
def test_direct_rounds_with_a_rank_without_tokens(devices, rng):
    # small_batch_tokens=0: every round direct (notify numbers messages per token range); rank 0 sends nothing, and
    # one round has a single token on every other rank (one range holds it, the others are empty)
    cfg, buf = make(devices, small_batch_tokens=0)
    R = len(devices)
    for n in ([0 if r == 0 and R > 1 else 48 for r in range(R)], [0 if r == 0 and R > 1 else 1 for r in range(R)]):
        run_round(buf, cfg, rng, n, weights_at="dispatch")
        run_round(buf, cfg, rng, n, weights_at="combine", async_halves=True)


GATHER_SCALES_FROM = 2 << 20  # dispatch/scales.cuh kGatherScalesFrom


def _scale_layout_bytes(buf, cfg) -> list[int]:
    """Bytes of each local rank's last dispatch output scales, as the receive counts them to choose the layout: fp8
    rows x n_scales x 4; fp4 the 128-row tiles of every group (each group starts a tile) x k_tiles x 512."""
    out = []
    for r in buf._ranks:
        offs = np.asarray(r.row_offsets.get(), dtype=np.int64)
        if cfg.dispatch_format == "fp8":
            out.append(int(offs[-1]) * cfg.n_scales * 4)
        else:
            tiles = int(((np.diff(offs) + 127) // 128).sum())
            out.append(tiles * cfg.scale_k_tiles * 512)
    return out


@pytest.mark.parametrize("devices", groups()[:2])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("layout", ["gathered", "direct"])
def test_large_round_scale_layouts(devices, fmt, layout, rng):
    # A large round's receive notes where each row's scales are and gathers them into the output layout after a
    # barrier once they span 2 MiB (dispatch/scales.cuh kGatherScalesFrom); below that it places them as each
    # message lands. Both, with the shared expert's rows (group 0, placed by the send phase) and a staged source in
    # the same round (several ranks), across many 32-row and 128-row scale tiles.
    R = len(devices)
    gathered = layout == "gathered"
    hidden, T = (7168, 1400 * R) if gathered else (2048, 200)
    for shared in (False, True):
        cfg, buf = make(devices, hidden=hidden, dispatch_format=fmt, fused_shared_expert=shared,
                        max_tokens_per_rank=T, small_batch_tokens=16)
        n = [10 if r == 0 and R > 1 else (T if gathered else int(rng.integers(150, 201))) for r in range(R)]
        run_round(buf, cfg, rng, n, weights_at="dispatch")
        run_round(buf, cfg, rng, n, weights_at="combine", async_halves=True)
        sizes = _scale_layout_bytes(buf, cfg)
        assert all((b >= GATHER_SCALES_FROM) == gathered for b in sizes), (layout, sizes)
        buf.close()


@pytest.mark.parametrize("devices", groups())
@pytest.mark.parametrize("hidden, top_k, fmt", [(2048, 1, "bf16"), (7168, 8, "fp8"), (7168, 8, "bf16"),
                                                 (2048, 8, "nvfp4"), (7168, 4, "mxfp4")])
def test_shapes_and_skew(devices, hidden, top_k, fmt, rng):
    cfg, buf = make(devices, hidden=hidden, top_k=top_k, dispatch_format=fmt, max_tokens_per_rank=64,
                    small_batch_tokens=32)
    R = len(devices)
    run_round(buf, cfg, rng, [64] * R, skew=True)  # direct; then a mix of staged and direct ranks
    run_round(buf, cfg, rng, [32] * R, skew=True)  # every rank staged, at the limit
    run_round(buf, cfg, rng, [int(rng.integers(0, 65)) for _ in range(R)], weights_at="combine",
              dtype=np.float32, global_scale=3.0)


@pytest.mark.parametrize("devices", groups())
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_few_sms_move_whole_tokens_per_warp(devices, fmt, rng):
    # 4 blocks: a sending warp stores whole 14 KiB tokens to every destination, 2 KiB through its registers at a
    # time, and a receiving warp fans out chunks of several 2 KiB passes (the paths a decode or prefill round takes
    # at scale, which the other tests' small shapes never reach)
    cfg, buf = make(devices, num_sms=4, hidden=7168, dispatch_format=fmt, max_tokens_per_rank=64,
                    small_batch_tokens=16)
    R = len(devices)
    run_round(buf, cfg, rng, [64] * R)                                   # direct
    run_round(buf, cfg, rng, [16] * R, weights_at="combine")             # staged
    run_round(buf, cfg, rng, [int(rng.integers(1, 65)) for _ in range(R)], skew=True)


@pytest.mark.parametrize("devices", groups())
def test_polled_and_counted_partial_sums(devices, rng):
    # bf16 partial sums in parity slots: tokens t < 256 (combine_poll_tokens) go to comb_poll, where the receiver
    # polls the data, and later tokens to comb_recv behind arrival counts, in the same round; a weighted round (rows
    # behind counts) in between, and rounds of both parities (the receiver resets what it polled)
    cfg, buf = make(devices, hidden=256, dispatch_format="bf16", max_tokens_per_rank=320, n_experts=32,
                    small_batch_tokens=16)
    R = len(devices)
    assert cfg.combine_poll_tokens == (256 if 2 * R <= cfg.top_k else 0)
    n = [320 if r == R - 1 else int(rng.integers(200, 321)) for r in range(R)]
    run_round(buf, cfg, rng, n)
    run_round(buf, cfg, rng, n, weights_at="combine")
    run_round(buf, cfg, rng, [int(rng.integers(1, 321)) for _ in range(R)], skew=True)
    run_round(buf, cfg, rng, [16] * R)  # staged dispatch, every token polled
    run_round(buf, cfg, rng, n, residual=True)


@pytest.mark.parametrize("devices", groups())
def test_hundred_rounds_with_changing_routing(devices, rng):
    # small rounds (<= 16 tokens, staged) and large ones (direct) mixed from round to round and rank to rank
    cfg, buf = make(devices, hidden=256, dispatch_format="fp8", max_tokens_per_rank=32, n_experts=16,
                    small_batch_tokens=16)
    R = len(devices)
    for i in range(100):
        n = [int(rng.integers(0, 33)) for _ in range(R)]
        run_round(buf, cfg, rng, n, skew=(i % 7 == 0), weights_at=["dispatch", "combine"][i % 2])


@pytest.mark.parametrize("devices", groups())
def test_cuda_graph_replay(devices, rng):
    """dispatch -> (a stand-in expert op) -> combine captured once and replayed with new inputs in place."""
    import cupy

    cfg, buf = make(devices, hidden=512, max_tokens_per_rank=32)
    R = len(devices)
    xs, ids, ws = make_inputs(rng, cfg, [32] * R)
    gx, gids, gws = to_devices(buf.group, xs), to_devices(buf.group, ids), to_devices(buf.group, ws)
    eo = []
    for dev in buf.group.devices:
        with cupy.cuda.Device(dev):
            eo.append(cupy.zeros((cfg.capacity, cfg.hidden), dtype=BF16))
    # warm up (compiles, allocates persistent outputs) outside the capture
    d = cuep.dispatch(buf, gx, gids, gws)
    out = cuep.combine(buf, eo, d)
    buf.synchronize()
    if len(set(buf.group.devices)) != 1:
        pytest.skip("this test captures one device's stream; with several GPUs each device needs its own graph")
    with cupy.cuda.Device(buf.group.devices[0]):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            d = cuep.dispatch(buf, gx, gids, gws)
            for i in range(R):  # identity experts on bf16: copy the dispatched rows
                eo[i][...] = d[i].tokens
            out = cuep.combine(buf, eo, d)
            graph = stream.end_capture()
        for _ in range(3):
            xs2, ids2, ws2 = make_inputs(rng, cfg, [32] * R)
            for i in range(R):
                gx[i][...] = cupy.asarray(xs2[i])
                gids[i][...] = cupy.asarray(ids2[i])
                gws[i][...] = cupy.asarray(ws2[i])
            graph.launch(stream)
            stream.synchronize()
            buf.check()
            for i in range(R):
                want = xs2[i].astype(np.float32) * ws2[i].sum(1, keepdims=True)
                np.testing.assert_allclose(out[i].get().astype(np.float32), want, rtol=3e-2, atol=3e-2)


def rank0_alone(small_batch_tokens, phases, rng):
    """Two ranks on GPU 0, 16 tokens each, a 0.2 s timeout; only rank 0 runs its dispatch kernel (phase bits
    `phases`), so whatever it waits for from rank 1 never comes. Returns (cfg, buf, x, ids) once it is done."""
    import cupy
    from cuep import ep as ep_mod, params

    cfg = cuep.EPConfig(hidden=256, top_k=2, n_experts=8, max_tokens_per_rank=16, n_gpus_per_node=2,
                        small_batch_tokens=small_batch_tokens)
    buf = cuep.Buffer(cuep.init([0, 0]), cfg, timeout_s=0.2)
    xs, ids, ws = make_inputs(rng, cfg, [16, 16])
    gx, gids = to_devices(buf.group, xs), to_devices(buf.group, ids)
    r = buf._ranks[0]
    threads, smem = ep_mod._dispatch_launch(buf, staged=False)
    fn = ep_mod._kernel("dispatch.cu:cuep_dispatch_bf16_from_bf16", smem)
    ep_mod._launch(fn, buf, threads, smem, params.DISPATCH_PARAMS_DTYPE, r.params, x=params.pointer(gx[0]),
                   topk_ids=params.pointer(gids[0]), topk_weights=0, num_tokens=16, global_scale=1.0, phases=phases,
                   chunk_plan=0, **ep_mod._dispatch_outputs(r))
    cupy.cuda.Device(0).synchronize()
    return cfg, buf, gx, gids


@pytest.mark.gpu
def test_wait_times_out_with_a_clear_error_and_recovers(rng):
    """Only rank 0 runs its send half (direct protocol: notify + send wait for every rank's histogram): it must give
    up after the timeout, report whom it waited for, and the buffer must work again after reset()."""
    cfg, buf, gx, gids = rank0_alone(0, 3, rng)
    with pytest.raises(cuep.EPError, match="timed out.*rank 1"):
        buf.check()
    with pytest.raises(cuep.EPError):  # the next call refuses to run on a failed buffer
        cuep.dispatch(buf, gx, gids)
    buf.reset()
    run_round(buf, cfg, rng, [16, 16])


@pytest.mark.gpu
def test_small_round_wait_times_out_with_a_clear_error_and_recovers(rng):
    """A small (staged) round: rank 0's send half waits for nobody in a first round, its receive half waits for
    rank 1's histogram, which never comes; the next rounds after reset() must not see the failed one's messages."""
    cfg, buf, gx, gids = rank0_alone(16, 7, rng)
    assert cfg.small_batch_tokens == 16
    with pytest.raises(cuep.EPError, match="dispatch \\(receive\\) timed out.*rank 1"):
        buf.check()
    buf.reset()
    run_round(buf, cfg, rng, [16, 16])
    run_round(buf, cfg, rng, [5, 16])


@pytest.mark.gpu
@pytest.mark.parametrize("small", [0, 16], ids=["direct", "staged"])
def test_bad_expert_ids_are_reported_and_skipped(small, rng):
    import cupy

    cfg = cuep.EPConfig(hidden=256, top_k=2, n_experts=8, max_tokens_per_rank=16, n_gpus_per_node=2,
                        small_batch_tokens=small)
    buf = cuep.Buffer(cuep.init([0, 0]), cfg, timeout_s=2.0)
    xs, ids, ws = make_inputs(rng, cfg, [16, 16])
    ids[1][3, 1] = 99
    gx, gids = to_devices(buf.group, xs), to_devices(buf.group, ids)
    cuep.dispatch(buf, gx, gids)
    cupy.cuda.Device(0).synchronize()
    with pytest.raises(cuep.EPError, match="out of range.*99"):
        buf.check()
    buf.reset()
    run_round(buf, cfg, rng, [16, 16])


@pytest.mark.gpu
def test_bad_arguments_raise_before_launch(rng):
    import cupy

    cfg = cuep.EPConfig(hidden=256, top_k=2, n_experts=8, max_tokens_per_rank=16, n_gpus_per_node=2)
    buf = cuep.Buffer(cuep.init([0, 0]), cfg)
    xs, ids, ws = make_inputs(rng, cfg, [16, 16])
    gx, gids = to_devices(buf.group, xs), to_devices(buf.group, ids)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        cuep.dispatch(buf, [cupy.zeros((17, 256), BF16)] * 2, [cupy.zeros((17, 2), np.int32)] * 2)
    with pytest.raises(TypeError, match="topk_ids.*int32"):
        cuep.dispatch(buf, gx, [g.astype(np.int64) for g in gids])
    with pytest.raises(ValueError, match="hidden"):
        cuep.dispatch(buf, [g[:, :128].copy() for g in gx], gids)
    with pytest.raises(ValueError, match="C-contiguous"):
        cuep.dispatch(buf, [cupy.asfortranarray(g) for g in gx], gids)
    bad = [g.copy() for g in gids]
    bad[1][5, 1] = 8
    with pytest.raises(ValueError, match=r"topk_ids\[rank 1\]\[5, 1\] = 8 is outside"):
        cuep.dispatch(buf, gx, bad, validate=True)
    bad[1][5, 1] = bad[1][5, 0]
    with pytest.raises(ValueError, match=r"topk_ids\[rank 1\]\[5\] chooses expert .* twice"):
        cuep.dispatch(buf, gx, bad, validate=True)
    with pytest.raises(ValueError, match="2 rank"):
        cuep.dispatch(buf, gx[:1], gids[:1])
    with pytest.raises(ValueError, match="cfg.n_ranks"):
        cuep.Buffer(cuep.init([0, 0, 0]), cfg)
    with pytest.raises(RuntimeError, match="n_nodes=2: several nodes need one process per rank"):
        cuep.Buffer(cuep.init([0, 0]), cuep.EPConfig(256, 2, 8, 16, n_gpus_per_node=1, n_nodes=2))
    run_round(buf, cfg, rng, [16, 16])  # nothing was corrupted


@pytest.mark.parametrize("devices", [g for g in groups() if len(g.values[0]) in (2, 4, 8)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_allreduce_shares_of_the_shared_expert(devices, fmt, rng):
    # allreduce_world_size A: with skip_a2a and a fused shared expert, rank r's group 0 holds only its share of the
    # tokens ([p N / A, (p + 1) N / A), p = r % A) and combine adds the shared row only there, so the all-reduce over
    # a group sums it once (the reference checks rows, src_info and every output). Direct and staged rounds, N < A,
    # no tokens, weights at combine with a residual, and the unreduced output (slot K zero outside the share).
    R = len(devices)
    for A in sorted({2, R}):
        cfg, buf = make(devices, dispatch_format=fmt, fused_shared_expert=True, skip_a2a=True,
                        allreduce_world_size=A, small_batch_tokens=24)
        for n in (48, 13, 1, 0):
            run_round(buf, cfg, rng, [n] * R, weights_at="dispatch")
        run_round(buf, cfg, rng, [48] * R, weights_at="combine", residual=True, async_halves=True)
        run_round(buf, cfg, rng, [20] * R, weights_at=None)
        buf.close()
