"""cuep with torch CUDA tensors (cuep.interop): rounds checked bit for bit against cuep.reference, outputs that are
zero-copy torch views of the buffer, work queued on torch's current stream, ``torch.cuda.graph`` capture and replay,
cuep.ops and cuep.moe with torch tensors, and clear errors for CPU / non-contiguous tensors.

Simulated ranks share GPU 0 (``cuep.init([0, 0])``), as in tests/test_ep_gpu.py. Skipped without torch or CUDA.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuep  # noqa: E402
import cuep.moe as moe  # noqa: E402
from cuep import reference as ref  # noqa: E402
from cuep.interop import as_cupy, as_torch  # noqa: E402
from ep_check import BF16, _call, check_dispatch, make_inputs, poison_outputs, random_tokens  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA")]

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ["bf16", "fp8", "nvfp4", "mxfp4"]
GROUPS = [pytest.param([0], id="gpu1"), pytest.param([0, 0], id="sim2")]
# bare: one rank's tensors passed as they are (not in lists): after a call has prepared its launch, the torch short
# path (cuep.ep._dispatch_single_torch, ...) takes such calls
GROUPS_BARE = [pytest.param([0], False, id="gpu1"), pytest.param([0], True, id="gpu1-bare"),
               pytest.param([0, 0], False, id="sim2")]
FIELDS = ("tokens", "scales", "row_offsets", "expert_ids", "src_info", "scales_offsets")
SLEEP_CYCLES = int(2e9)  # torch.cuda._sleep: about a second of GPU clock, far longer than the host needs to enqueue


def make(devices, **kw):
    cfg = cuep.EPConfig(**{**dict(hidden=1024, top_k=8, n_experts=32, max_tokens_per_rank=48,
                                  n_gpus_per_node=len(devices)), **kw})
    return cfg, cuep.Buffer(cuep.init(devices), cfg, timeout_s=5.0)


def to_torch(a: np.ndarray, dev: int):
    """Host array -> torch tensor on cuda:dev (bfloat16 travels as its int16 bits)."""
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(f"cuda:{dev}")
    return torch.from_numpy(a).to(f"cuda:{dev}")


def to_numpy(t) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(BF16)
    return t.cpu().numpy()


def seen_by_cupy(d):
    """A torch-mode Dispatched as CuPy views of its torch fields, for ep_check.check_dispatch."""
    return types.SimpleNamespace(rank=d.rank, **{f: None if getattr(d, f) is None else as_cupy(getattr(d, f))
                                                 for f in FIELDS})


def check_torch_dispatched(buf, cfg, got) -> None:
    """Every field a torch view of the rank's buffer output: device, dtype, shape, address."""
    for d, r in zip(got, buf._ranks):
        assert isinstance(d, cuep.Dispatched) and d._torch
        dev = torch.device("cuda", r.device)
        for f in FIELDS:
            t, a = getattr(d, f), getattr(r, f)
            if a is None:
                assert t is None, f
                continue
            assert isinstance(t, torch.Tensor) and t.device == dev, f
            assert tuple(t.shape) == a.shape and t.data_ptr() == a.data.ptr, f  # zero copy
        assert d.tokens.dtype == (torch.bfloat16 if cfg.fmt.name == "bf16" else torch.uint8)
        assert d.row_offsets.dtype == torch.int32 and d.expert_ids.dtype == torch.int32  # uint32 offsets: int32
        assert d.src_info.dtype == torch.int32
        if cfg.fmt.name == "fp8":
            assert d.scales.dtype == torch.float32
        elif cfg.fmt.swizzled_scales:
            assert d.scales.dtype == torch.uint8 and d.scales_offsets.dtype == torch.int32


def torch_round(buf, cfg, rng, n_tokens, *, weights_at="dispatch", async_halves=False, residual=False, bare=False):
    """One round with torch tensors in and out, checked against cuep.reference as ep_check.run_round does."""
    devs = buf.group.devices
    xs, ids, ws = make_inputs(rng, cfg, n_tokens)
    want = ref.dispatch(xs, ids, cfg)
    tx, tids, tws = ([to_torch(a, d) for a, d in zip(arrays, devs)] for arrays in (xs, ids, ws))
    poison_outputs(buf)
    torch.cuda.synchronize()
    wd = tws if weights_at == "dispatch" else None
    if async_halves:
        got = _call(cuep.dispatch_wait, bare, _call(cuep.dispatch_async, bare, buf, tx, tids, wd))
    else:
        got = _call(cuep.dispatch, bare, buf, tx, tids, wd)
    check_torch_dispatched(buf, cfg, got)
    buf.synchronize()
    perms = check_dispatch(buf, [seen_by_cupy(d) for d in got], want, cfg)

    cdt = BF16 if cfg.combine_dtype == "bfloat16" else np.dtype(np.float32)
    eo_ref = [rng.standard_normal((w.n_rows, cfg.hidden)).astype(cdt) for w in want]
    teo = []
    for dev, w, perm, e in zip(devs, want, perms, eo_ref):
        full = np.full((cfg.capacity, cfg.hidden), np.nan, dtype=cdt)
        full[: w.n_rows] = e[perm]
        teo.append(to_torch(full, dev))
    res_np = [rng.standard_normal((n, cfg.hidden)).astype(cdt) for n in n_tokens] if residual else None
    kw = {"residual": [to_torch(a, d) for a, d in zip(res_np, devs)]} if residual else {}
    wc = tws if weights_at == "combine" else None
    if async_halves:
        _call(cuep.combine_async, bare, buf, teo, got, wc, **kw)
        out = _call(cuep.combine_wait, bare, buf, teo, got, wc, **kw)
    else:
        out = _call(cuep.combine, bare, buf, teo, got, wc, **kw)
    buf.synchronize()
    wref = ws if weights_at else None
    want_c = ref.combine([e.astype(np.float32) for e in eo_ref], want, wref, cfg, num_tokens=n_tokens)
    for i, (o, wc_) in enumerate(zip(out, want_c)):
        r = buf._ranks[i]
        assert isinstance(o, torch.Tensor) and o.device == torch.device("cuda", r.device)
        assert o.dtype == (torch.bfloat16 if cdt == BF16 else torch.float32)
        base = r.combined if wref is not None else r.combined_unreduced
        if o.numel():  # the buffer's combine output, not a copy (an empty result has no address)
            assert o.data_ptr() == base.data.ptr
        got_c = to_numpy(o).astype(np.float32)
        if residual:
            wc_ = wc_ + res_np[i].astype(np.float32)
        assert got_c.shape == wc_.shape, (got_c.shape, wc_.shape)
        if wref is None:
            np.testing.assert_array_equal(got_c, wc_, err_msg=f"rank {r.rank} unreduced combine")
        else:
            scale = max(1.0, float(np.abs(wc_).max())) if wc_.size else 1.0
            tol = 2e-2 if cdt == BF16 else 1e-5
            np.testing.assert_allclose(got_c, wc_, rtol=tol, atol=tol * scale, err_msg=f"rank {r.rank} combine")
    return got, out


# ---- dispatch / combine ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("devices", GROUPS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_rounds_match_reference(devices, fmt, rng):
    cfg, buf = make(devices, dispatch_format=fmt, small_batch_tokens=24)
    R = len(devices)
    T = cfg.max_tokens_per_rank
    # a full rank and (sim2) an empty one; then token counts that take the staged and the direct protocol
    torch_round(buf, cfg, rng, [T, 0][:R] if R > 1 else [T], weights_at="dispatch")
    torch_round(buf, cfg, rng, [int(rng.integers(1, T + 1)) for _ in range(R)], weights_at="combine",
                residual=True, async_halves=True)
    torch_round(buf, cfg, rng, [int(rng.integers(1, 25)) for _ in range(R)], weights_at=None, bare=R == 1)


@pytest.mark.parametrize("devices", GROUPS)
def test_outputs_are_views_made_once(devices, rng):
    """A second round converts nothing new: the same torch views of the buffer come back."""
    cfg, buf = make(devices, dispatch_format="fp8")
    R = len(devices)
    d1, out1 = torch_round(buf, cfg, rng, [16] * R)
    d2, out2 = torch_round(buf, cfg, rng, [9] * R)
    for i in range(R):
        assert all(getattr(d1[i], f) is getattr(d2[i], f) for f in FIELDS)
        assert out1[i]._base is not None and out1[i]._base is out2[i]._base  # slices of one cached view


@pytest.mark.parametrize("devices, bare", GROUPS_BARE)
def test_work_is_queued_on_torchs_current_stream(devices, bare, rng):
    import cupy

    cfg, buf = make(devices, hidden=512, max_tokens_per_rank=32)
    R = len(devices)
    xs, ids, ws = make_inputs(rng, cfg, [32] * R)
    tx, tids, tws = ([to_torch(a, 0) for a in arrays] for arrays in (xs, ids, ws))
    _call(cuep.dispatch, bare, buf, tx, tids, tws)  # compiles the kernels and makes the views
    buf.synchronize()
    poison_outputs(buf)
    cupy.cuda.Device(0).synchronize()
    before = cupy.cuda.get_current_stream()
    stream = torch.cuda.Stream(device=0)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        d = _call(cuep.dispatch, bare, buf, tx, tids, tws)
        done = torch.cuda.Event()
        done.record()
    assert cupy.cuda.get_current_stream() is before  # CuPy's stream is restored after the call
    assert not done.query(), "the stream finished while it should still be sleeping"
    side = cupy.cuda.Stream(non_blocking=True)
    assert (buf._ranks[0].row_offsets.get(stream=side) == 0xFFFFFFF).all(), "dispatch ran before the sleep ended"
    stream.synchronize()
    buf.check()
    check_dispatch(buf, [seen_by_cupy(x) for x in d], ref.dispatch(xs, ids, cfg), cfg)


@pytest.mark.parametrize("devices, bare", GROUPS_BARE)
def test_torch_cuda_graph_capture_and_replay(devices, bare, rng):
    """dispatch -> a torch expert op -> combine captured by torch.cuda.graph, replayed with new inputs in place."""
    cfg, buf = make(devices, hidden=512, max_tokens_per_rank=32)
    R = len(devices)
    xs, ids, ws = make_inputs(rng, cfg, [32] * R)
    tx, tids, tws = ([to_torch(a, 0) for a in arrays] for arrays in (xs, ids, ws))
    eo = [torch.zeros((cfg.capacity, cfg.hidden), dtype=torch.bfloat16, device="cuda:0") for _ in range(R)]

    def layer():
        d = _call(cuep.dispatch, bare, buf, tx, tids, tws)
        for i in range(R):
            torch.mul(d[i].tokens, 2, out=eo[i])  # the "expert": a torch op on the dispatched rows (exact in bf16)
        return _call(cuep.combine, bare, buf, eo, d)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up before capture, as torch asks (compiles, allocates persistent outputs)
        layer()
    torch.cuda.current_stream().wait_stream(side)
    buf.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for _ in range(3):
        xs2, ids2, ws2 = make_inputs(rng, cfg, [32] * R)
        for i in range(R):
            tx[i].copy_(to_torch(xs2[i], 0))
            tids[i].copy_(to_torch(ids2[i], 0))
            tws[i].copy_(to_torch(ws2[i], 0))
        graph.replay()
        torch.cuda.synchronize()
        buf.check()
        for i in range(R):
            want = 2 * xs2[i].astype(np.float32) * ws2[i].sum(1, keepdims=True)
            np.testing.assert_allclose(to_numpy(out[i]).astype(np.float32), want, rtol=3e-2, atol=6e-2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_short_path_rounds_match_reference(fmt, rng, monkeypatch):
    """One rank, bare tensors: once a first pass of rounds has prepared the launches, every call of a second pass
    takes the torch short path (torch mode refuses here) and the rounds still match cuep.reference: fused and in
    halves, small and larger one-rank rounds, weights at dispatch, at combine or none, with a residual."""
    from cuep import interop

    cfg, buf = make([0], dispatch_format=fmt, small_batch_tokens=24)
    T = cfg.max_tokens_per_rank
    rounds = [([T], dict(weights_at="dispatch")), ([5], dict(weights_at="combine", residual=True)),
              ([30], dict(weights_at=None)), ([T], dict(weights_at="combine", async_halves=True, residual=True)),
              ([3], dict(weights_at="dispatch", async_halves=True))]
    for n, kw in rounds:
        torch_round(buf, cfg, rng, n, bare=True, **kw)

    def torch_mode(fn, *a, **k):
        raise AssertionError(f"{fn.__name__} went to torch mode, not the torch short path")

    monkeypatch.setattr(interop, "_call_torch", torch_mode)
    for n, kw in rounds:
        torch_round(buf, cfg, rng, n, bare=True, **kw)
    buf.check()


def test_bad_torch_inputs_give_clear_errors(rng):
    cfg, buf = make([0, 0], hidden=512, max_tokens_per_rank=32)
    xs, ids, ws = make_inputs(rng, cfg, [8, 8])
    tx, tids, tws = ([to_torch(a, 0) for a in arrays] for arrays in (xs, ids, ws))
    with pytest.raises(TypeError, match=r"x\[1\] is a torch tensor on the CPU.*\.cuda\(\)"):
        cuep.dispatch(buf, [tx[0], tx[1].cpu()], tids, tws)
    strided = [torch.empty((cfg.hidden, 8), dtype=torch.bfloat16, device="cuda:0").t() for _ in range(2)]
    with pytest.raises(ValueError, match=r"x\[rank 0\].*C-contiguous.*tensor\.contiguous\(\)"):
        cuep.dispatch(buf, strided, tids, tws)
    with pytest.raises(TypeError, match=r"x\[rank 0\] has dtype float16.*tensor\.to\(dtype\)"):
        cuep.dispatch(buf, [t.half() for t in tx], tids, tws)
    with pytest.raises(TypeError, match=r"x is a torch tensor on the CPU"):
        cuep.ops.quantize(torch.zeros((4, 128)), "fp8")
    torch_round(buf, cfg, rng, [8, 8])  # nothing was launched: the next round is exact


# ---- ops ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_ops_take_and_return_torch_tensors(fmt, rng):
    n, h = 40, 512
    x = random_tokens(rng, n, h)
    tx = to_torch(x, 0)
    before = torch.cuda.memory_allocated(0)
    payload, scales = cuep.ops.quantize(tx, fmt)
    assert isinstance(payload, torch.Tensor) and payload.dtype == torch.uint8 and payload.device == tx.device
    assert isinstance(scales, torch.Tensor) and scales.dtype == torch.uint8
    assert torch.cuda.memory_allocated(0) - before >= payload.numel()  # the outputs came from torch's allocator
    want_p, want_s = ref.quantize(x, fmt)
    np.testing.assert_array_equal(to_numpy(payload), want_p)
    np.testing.assert_array_equal(to_numpy(scales), want_s)
    y = cuep.ops.dequantize(payload, scales, fmt, h)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and tuple(y.shape) == (n, h)
    np.testing.assert_array_equal(to_numpy(y).view(np.uint32),
                                  ref.dequantize(want_p, want_s, fmt, h).view(np.uint32))
    out = (torch.empty_like(payload), torch.empty_like(scales))
    got = cuep.ops.quantize(tx, fmt, out=out)
    assert type(got) is tuple and got[0] is out[0] and got[1] is out[1]  # out= comes back as the caller's tensors
    np.testing.assert_array_equal(to_numpy(out[0]), want_p)


@pytest.mark.parametrize("out_fmt", ["bf16", "fp8"])
def test_fused_silu_with_torch_tensors(out_fmt, rng):
    cap, inter = 64, 256
    h = rng.standard_normal((cap, 2 * inter)).astype(BF16)
    ro = np.array([0, 10, 10, 40], np.int32)
    want = ref.fused_silu(h, ro, out_fmt)
    got = cuep.ops.fused_silu(to_torch(h, 0), to_torch(ro, 0), out_fmt)
    if out_fmt == "bf16":
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and tuple(got.shape) == (cap, inter)
        np.testing.assert_array_equal(to_numpy(got)[:40].view(np.uint16), want.view(np.uint16))
    else:
        assert type(got) is tuple and all(isinstance(t, torch.Tensor) for t in got)
        np.testing.assert_array_equal(to_numpy(got[0])[:40], want[0])
        np.testing.assert_array_equal(to_numpy(got[1])[:, :40].view(np.uint32), want[1].view(np.uint32))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_torch_ops_short_path_matches_reference(fmt, rng, monkeypatch):
    """quantize and fused_silu with bare tensors: once a first call has made the plan, the next ones take the torch
    short path (torch mode refuses here), outputs from torch or ``out=``, bit for bit as cuep.reference."""
    from cuep import interop

    n, h, cap, inter = 40, 512, 64, 256
    ro = np.array([0, 10, 10, 40], np.int32)
    tro = to_torch(ro, 0)
    hs = rng.standard_normal((cap, 2 * inter)).astype(BF16)
    cuep.ops.quantize(to_torch(random_tokens(rng, n, h), 0), fmt)  # the plans, in torch mode
    for out_fmt in ("bf16", fmt):
        cuep.ops.fused_silu(to_torch(hs, 0), tro, out_fmt)

    def torch_mode(fn, *a, **k):
        raise AssertionError(f"{fn.__name__} went to torch mode, not the torch short path")

    monkeypatch.setattr(interop, "_call_torch", torch_mode)
    x = random_tokens(rng, n, h)
    want_p, want_s = ref.quantize(x, fmt)
    payload, scales = cuep.ops.quantize(to_torch(x, 0), fmt)
    assert payload.dtype == torch.uint8 and payload.device == torch.device("cuda", 0)
    out = (torch.full_like(payload, 0xAB), torch.full_like(scales, 0xAB))
    got = cuep.ops.quantize(to_torch(x, 0), fmt, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    for p_, s_ in ((payload, scales), out):
        np.testing.assert_array_equal(to_numpy(p_), want_p)
        np.testing.assert_array_equal(to_numpy(s_), want_s)
    hs = rng.standard_normal((cap, 2 * inter)).astype(BF16)
    th = to_torch(hs, 0)
    want = ref.fused_silu(hs, ro, "bf16")
    got = cuep.ops.fused_silu(th, tro, "bf16")
    np.testing.assert_array_equal(to_numpy(got)[:40].view(np.uint16), want.view(np.uint16))
    got = cuep.ops.fused_silu(th, tro, fmt)
    want = ref.fused_silu(hs, ro, fmt)
    np.testing.assert_array_equal(to_numpy(got[0])[:40], want[0])
    if fmt == "fp8":
        np.testing.assert_array_equal(to_numpy(got[1])[:, :40].view(np.uint32), want[1].view(np.uint32))
    else:  # the swizzled scales' shape and dtype and their group offsets, as torch mode gives them (the bytes
        # past the used tiles are left as they were, so the scales themselves: tests/test_ops_gpu.py)
        monkeypatch.undo()
        again = interop._call_torch(cuep.ops._fused_silu, ("h", "row_offsets", "out_fmt"),
                                    (th, tro, fmt), {})
        for a, b in zip(got, again):
            assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(to_numpy(got[0])[:40], to_numpy(again[0])[:40])
        np.testing.assert_array_equal(to_numpy(got[2]), to_numpy(again[2]))


def test_ops_under_torch_cuda_graph(rng):
    n, h = 64, 512
    tx = to_torch(random_tokens(rng, n, h), 0)
    p, s = cuep.ops.quantize(tx, "fp8")  # warm up: compiles, sizes the grids
    cuep.ops.dequantize(p, s, "fp8", h)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p, s = cuep.ops.quantize(tx, "fp8")  # outputs from the graph's pool
        y = cuep.ops.dequantize(p, s, "fp8", h)
    for _ in range(3):
        x = random_tokens(rng, n, h)
        tx.copy_(to_torch(x, 0))
        graph.replay()
        torch.cuda.synchronize()
        want_p, want_s = ref.quantize(x, "fp8")
        np.testing.assert_array_equal(to_numpy(p), want_p)
        np.testing.assert_array_equal(to_numpy(y).view(np.uint32),
                                      ref.dequantize(want_p, want_s, "fp8", h).view(np.uint32))


# ---- moe ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("devices", GROUPS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_forward_with_torch_tensors(devices, fmt, rng):
    H, I, E, K, T = 512, 256, 16, 4, 64
    R = len(devices)
    cfg = cuep.EPConfig(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T, n_gpus_per_node=R,
                        dispatch_format=fmt, fused_shared_expert=True)
    buf = cuep.Buffer(cuep.init(devices), cfg, timeout_s=10.0)
    weights = moe.init_weights(cfg, I, seed=int(rng.integers(2**31)), devices=buf.group.devices)
    tw = [moe.MoEWeights(*(as_torch(a) for a in (w.w_gate_up, w.w_down, w.router))) for w in weights]
    assert tw[0].w_gate_up.data.ptr == weights[0].w_gate_up.data.ptr  # torch weights held as zero-copy views
    xs = [rng.standard_normal((T - 5 * r, H)).astype(BF16) for r in range(R)]
    out = moe.moe_forward(buf, [to_torch(x, d) for x, d in zip(xs, buf.group.devices)], tw)
    want = moe.moe_reference(xs, [w.to_numpy() for w in weights], cfg)
    assert isinstance(out, list) and len(out) == R
    for r, (o, w) in enumerate(zip(out, want)):
        assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and tuple(o.shape) == w.shape
        got = to_numpy(o).astype(np.float32)
        err = float(np.linalg.norm(got - w) / np.linalg.norm(w))
        assert err < 2e-2, f"rank {r} ({fmt}): relative Frobenius error {err:.2e}"


def test_route_with_torch_tensors(rng):
    import cupy

    x = random_tokens(rng, 50, 256)
    router = (rng.standard_normal((256, 16)) / 16).astype(np.float32)
    ids, w = moe.route(to_torch(x, 0), to_torch(router, 0), 4)
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int32 and w.dtype == torch.float32
    want_ids, want_w = moe.route(cupy.asarray(x), cupy.asarray(router), 4)
    np.testing.assert_array_equal(to_numpy(ids), want_ids.get())
    np.testing.assert_array_equal(to_numpy(w), want_w.get())


# ---- the example --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_torch_moe_layer_example_passes():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_moe_layer.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASS" in res.stdout, res.stdout
