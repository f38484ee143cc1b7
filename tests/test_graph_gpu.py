"""CUDA graphs of many calls (as a model captures its decode step): one-rank rounds (small and larger, every
format), their combines, and ops captured back to back in one graph, each behind a CuPy kernel that writes its
inputs, replay to exactly the reference's outputs (every round's outputs copied out inside the graph)."""
from __future__ import annotations

import numpy as np
import pytest

import cuep
from cuep import ops
from cuep import reference as ref
from ep_check import BF16, check_dispatch, make_inputs, random_tokens

REPLAYS = 2  # fresh inputs before each: the graph follows them, and each round's hidden state re-arms


class _Graph:
    """``fn``'s launches captured on a fresh stream; :meth:`replay` launches the graph and synchronises."""

    def __init__(self, fn):
        import cupy

        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.stream.begin_capture()
            try:
                fn()
            finally:
                self.graph = self.stream.end_capture()

    def replay(self) -> None:
        self.graph.launch(self.stream)
        self.stream.synchronize()


def _rewrite(dst, src) -> None:
    """dst := src by a CuPy kernel (not a copy engine), right before the call that reads dst."""
    import cupy

    if dst.dtype == BF16:
        dst, src = dst.view(cupy.uint16), src.view(cupy.uint16)
    if dst.dtype.kind == "f":
        cupy.multiply(src, 1, out=dst)
    else:
        cupy.bitwise_or(src, 0, out=dst)


class _Snapshot:
    """Arrays allocated before the capture that a captured round copies its dispatch outputs into (the names
    check_dispatch reads; ``_ranks[0]`` the rank's row_src / scale bounds)."""

    FIELDS = ("tokens", "scales", "row_offsets", "expert_ids", "src_info", "scales_offsets")

    def __init__(self, buf, d):
        import cupy

        self.rank = d.rank
        for k in self.FIELDS:
            a = getattr(d, k)
            setattr(self, k, None if a is None else cupy.empty_like(a))
        r = buf._ranks[0]
        self.rank_arrays = type("Rank", (), {})()
        self.rank_arrays.row_src = cupy.empty_like(r.row_src)
        self.rank_arrays.scale_tile_rows = None if r.scale_tile_rows is None else cupy.empty_like(r.scale_tile_rows)
        self._ranks = [self.rank_arrays]

    def take(self, buf, d) -> None:
        import cupy

        for k in self.FIELDS:
            if getattr(self, k) is not None:
                cupy.copyto(getattr(self, k), getattr(d, k))
        r = buf._ranks[0]
        cupy.copyto(self.rank_arrays.row_src, r.row_src)
        if r.scale_tile_rows is not None:
            cupy.copyto(self.rank_arrays.scale_tile_rows, r.scale_tile_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_rounds_captured_back_to_back_replay_exactly(fmt, rng):
    # small (<= 32) and larger one-rank rounds in one graph, each dispatch right behind the kernel that writes its
    # tokens; the bf16 rounds combine the dispatched rows (identity experts) right behind the dispatch
    import cupy

    cfg = cuep.EPConfig(hidden=1024, top_k=8, n_experts=32, max_tokens_per_rank=48, n_gpus_per_node=1,
                        small_batch_tokens=32, dispatch_format=fmt)
    buf = cuep.Buffer(cuep.init([0]), cfg, timeout_s=5.0)
    sizes = (16, 48, 1, 40, 32, 7, 48, 3)
    rounds = []
    for n in sizes:
        xs, ids, ws = make_inputs(rng, cfg, [n])
        src = (cupy.asarray(xs[0]), cupy.asarray(ids[0]), cupy.asarray(ws[0]))
        rounds.append({"src": src, "dst": tuple(cupy.empty_like(a) for a in src)})
    d = cuep.dispatch(buf, *rounds[0]["src"])  # compile, prepare and shape the snapshots outside the capture
    out = cuep.combine(buf, d.tokens, d) if fmt == "bf16" else None
    for r in rounds:
        r["snap"] = _Snapshot(buf, d)
        r["out"] = None if out is None else cupy.empty((r["src"][0].shape[0], cfg.hidden), out.dtype)
    buf.synchronize()

    def chain():
        for r in rounds:
            (gx, gids, gw), (dx, dids, dw) = r["src"], r["dst"]
            _rewrite(dids, gids)
            _rewrite(dw, gw)
            _rewrite(dx, gx)
            d = cuep.dispatch(buf, dx, dids, dw)
            r["snap"].take(buf, d)
            if r["out"] is not None:
                cupy.copyto(r["out"], cuep.combine(buf, d.tokens, d))

    graph = _Graph(chain)
    for _ in range(REPLAYS):
        for r, n in zip(rounds, sizes):  # fresh tokens, routing and weights into the captured source arrays
            xs, ids, ws = make_inputs(rng, cfg, [n])
            r["host"] = (xs[0], ids[0], ws[0])
            for a, h in zip(r["src"], r["host"]):
                a.set(h)
        cupy.cuda.get_current_stream().synchronize()  # (the graph's stream does not wait for this one)
        graph.replay()
        buf.check()
        for r in rounds:
            x, ids, w = r["host"]
            want = ref.dispatch([x], [ids], cfg)
            check_dispatch(r["snap"], [r["snap"]], want, cfg)
            if r["out"] is not None:
                wc = ref.combine([want[0].tokens.astype(np.float32)], want, [w], cfg, num_tokens=[x.shape[0]])[0]
                np.testing.assert_allclose(r["out"].get().astype(np.float32), wc, rtol=2e-2,
                                           atol=2e-2 * max(1.0, float(np.abs(wc).max())))
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_ops_captured_back_to_back_replay_exactly(fmt, rng):
    import cupy

    cases = []
    for n in (5, 64, 300, 1):
        x = random_tokens(rng, n, 512)
        gx = cupy.asarray(x)
        cases.append((x, gx, cupy.empty_like(gx), ops.quantize(gx, fmt)))  # (the outputs, written in the graph)
    cupy.cuda.get_current_stream().synchronize()

    def chain():
        for _, gx, dx, out in cases:
            _rewrite(dx, gx)
            ops.quantize(dx, fmt, out=out)

    graph = _Graph(chain)
    for _ in range(REPLAYS):
        fresh = []
        for x, gx, _, (p, sc) in cases:  # fresh rows into the captured source, poisoned outputs
            x = random_tokens(rng, x.shape[0], x.shape[1])
            gx.set(x)
            p.fill(0xA5)
            sc.fill(0xA5)
            fresh.append((x, p, sc))
        cupy.cuda.get_current_stream().synchronize()
        graph.replay()
        for x, p, sc in fresh:
            want_p, want_s = ref.quantize(x, fmt)
            np.testing.assert_array_equal(p.get(), want_p)
            np.testing.assert_array_equal(sc.get(), want_s)
