"""The non-finite policy (docs/formats.md) through dispatch: a NaN or +-Inf in one block of a token makes that
block's payload and scale unspecified; every other block of the token, every other token, and the layout (row
offsets, expert ids, src_info, which rows exist) are exactly the reference's. The quantize op's half of the policy is
tests/test_ops_gpu.py::test_quantize_nonfinite_leaves_other_blocks_exact, the reference's
tests/test_reference_quant.py::test_nonfinite_blocks_leave_other_blocks_exact."""
from __future__ import annotations

import numpy as np
import pytest

import cuep
from cuep import reference as ref
from cuep.formats import FORMATS
from cuep.reference.quant import unswizzle_block_scales
from ep_check import BF16, gpu_row_perm, make_inputs, poison_outputs, run_round, to_devices


@pytest.mark.gpu
@pytest.mark.parametrize("devices", [[0], [0, 0]], ids=["gpu1", "sim2"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)], ids=["bf16", "f32"])
@pytest.mark.parametrize("n", [32, 12], ids=["direct", "staged"])
def test_dispatch_nonfinite_blocks_leave_the_rest_exact(devices, fmt, dtype, n, rng):
    R = len(devices)
    cfg = cuep.EPConfig(hidden=512, top_k=4, n_experts=16, max_tokens_per_rank=32, n_gpus_per_node=R,
                        dispatch_format=fmt, small_batch_tokens=16)
    buf = cuep.Buffer(cuep.init(devices), cfg, timeout_s=5.0)
    f, H = FORMATS[fmt], cfg.hidden
    xs, ids, ws = make_inputs(rng, cfg, [n] * R, dtype=dtype)
    bad = set()  # (source rank, token, block) holding a NaN/Inf; bf16: (source rank, token, column) of a NaN
    for r in range(R):
        for k, t in enumerate(rng.choice(n, size=5, replace=False)):
            b = int(rng.integers(H // f.block)) if fmt != "bf16" else 0
            c = b * f.block + int(rng.integers(f.block)) if fmt != "bf16" else int(rng.integers(H))
            v = (np.nan, np.inf, -np.inf)[k % 3]
            xs[r][t, c] = v
            bad.add((r, int(t), b if fmt != "bf16" else c) if fmt != "bf16" or np.isnan(v) else (-1, -1, -1))
    want = ref.dispatch([np.asarray(x) for x in xs], ids, cfg)
    gx, gids, gws = to_devices(buf.group, xs), to_devices(buf.group, ids), to_devices(buf.group, ws)
    poison_outputs(buf)
    got = cuep.dispatch(buf, gx, gids, gws)
    buf.synchronize()
    unspecified = 0
    for i, (d, w) in enumerate(zip(got, want)):
        ro = d.row_offsets.get()
        np.testing.assert_array_equal(ro, w.row_offsets)
        np.testing.assert_array_equal(d.expert_ids.get(), w.expert_ids)
        rows = int(ro[-1])
        si, src = d.src_info.get()[:rows], buf._ranks[i].row_src.get()[:rows]
        perm = gpu_row_perm(si, src, w.src_info, w.src_rank, rows)
        np.testing.assert_array_equal(si, w.src_info[perm])
        tok = d.tokens.get()[:rows].view(np.uint8).reshape(rows, -1)
        want_tok = w.tokens[perm].view(np.uint8).reshape(rows, -1)
        if fmt == "bf16":  # no blocks: every element but a NaN is exact (Inf too)
            keep = np.ones((rows, H), bool)
            for j in range(rows):
                for (r, t, c) in bad:
                    if si[j, 0] >= 0 and (r, t) == (int(src[j]), int(si[j, 0])):
                        keep[j, c] = False
            unspecified += int((~keep).sum())
            np.testing.assert_array_equal(tok.view(np.uint16)[keep], want_tok.view(np.uint16)[keep])
            continue
        nb = H // f.block
        keep = np.ones((rows, nb), bool)
        for j in range(rows):
            if si[j, 0] >= 0:
                for b in range(nb):
                    keep[j, b] = (int(src[j]), int(si[j, 0]), b) not in bad
        unspecified += int((~keep).sum())
        pb = f.payload_bytes(f.block)
        np.testing.assert_array_equal(tok.reshape(rows, nb, pb)[keep], want_tok.reshape(rows, nb, pb)[keep],
                                      err_msg=f"rank {d.rank}: payload of finite blocks")
        if fmt == "fp8":
            sc = d.scales.get()[:, :rows].view(np.uint32).T
            wsc = w.scales[:, perm].view(np.uint32).T
        else:
            np.testing.assert_array_equal(d.scales_offsets.get(), w.scales_offsets)
            sc = unswizzle_block_scales(d.scales.get(), ro, fmt, H)
            wsc = unswizzle_block_scales(w.scales, ro, fmt, H)[perm]
        np.testing.assert_array_equal(sc[keep], wsc[keep], err_msg=f"rank {d.rank}: scales of finite blocks")
    assert unspecified > 0  # some non-finite blocks did arrive
    buf.check()
    run_round(buf, cfg, rng, [n] * R)  # and the buffer works on as before
    buf.close()
