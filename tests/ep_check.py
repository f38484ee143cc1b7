"""Run cuep dispatch/combine on a group and compare every output with cuep.reference (shared by the EP tests).

Rows inside one (expert, source rank) block arrive in any order on the GPU; the reference puts them in ascending
token order. Each block is therefore matched by its (token, k) keys before bytes are compared.

The same functions serve one process per GPU (tests/ipc_worker.py): every process draws the inputs of ALL ranks
from the same seeded generator and computes the reference for all ranks, runs its own rank, and checks it.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

import cuep
from cuep import reference as ref
from cuep.formats import SCALE_TILE_ROWS
from cuep.reference.quant import unswizzle_block_scales

BF16 = np.dtype(ml_dtypes.bfloat16)


def random_routing(rng, n: int, cfg, skew: bool = False) -> np.ndarray:
    """int32 [n, K] distinct experts per row; with skew, expert 0 is in almost every row."""
    scores = rng.random((n, cfg.n_experts))
    if skew:
        scores[:, 0] += 10.0
    return np.argsort(-scores, axis=1)[:, : cfg.top_k].astype(np.int32)


def random_tokens(rng, n: int, h: int, dtype=BF16) -> np.ndarray:
    """Fresh random rows whose magnitudes span several octaves (never zeros)."""
    x = rng.standard_normal((n, h)).astype(np.float32) * np.exp2(rng.integers(-6, 6, size=(n, 1))).astype(np.float32)
    return x.astype(dtype)


def edge_tokens(rng, n: int, h: int, dtype=BF16) -> np.ndarray:
    """random_tokens with what the quantizers must flush or keep: about 10% subnormals of ``dtype`` and 2% signed
    zeros scattered; in each row a 32-value block of subnormals only, one of subnormals and one normal value (a
    random magnitude from the smallest normal up), and one of values near 2**-110 (mxfp4 from bf16 then leaves its
    bf16 lines for the float32 ones). Subnormal inputs count as zeros of their sign (docs/formats.md)."""
    x = random_tokens(rng, n, h, np.float32)
    if np.dtype(dtype) == BF16:  # bf16 subnormals: exponent 0, mantissa 1 .. 127, either sign
        sub = lambda shape: ((rng.integers(1, 1 << 7, size=shape, dtype=np.uint32)  # noqa: E731
                              | rng.integers(0, 2, size=shape, dtype=np.uint32) << 15) << 16).view(np.float32)
    else:
        sub = lambda shape: (rng.integers(1, 1 << 23, size=shape, dtype=np.uint32)  # noqa: E731
                             | rng.integers(0, 2, size=shape, dtype=np.uint32) << 31).view(np.float32)
    u = rng.random((n, h))
    x = np.where(u < 0.10, sub((n, h)), x)
    x = np.where((u >= 0.10) & (u < 0.12), np.where(u < 0.11, np.float32(0.0), np.float32(-0.0)), x)
    if h >= 96:
        blocks = rng.permutation(h // 32)[:3] * 32  # three distinct 32-value blocks of each row (the same columns)
        x[:, blocks[0]:blocks[0] + 32] = sub((n, 32))
        x[:, blocks[1]:blocks[1] + 32] = sub((n, 32))
        big = np.exp2(rng.integers(-126, 8, size=n)).astype(np.float32) * rng.uniform(1, 1.99, n).astype(np.float32)
        x[np.arange(n), blocks[1] + rng.integers(0, 32, size=n)] = big * np.where(rng.random(n) < 0.5, 1, -1)
        x[:, blocks[2]:blocks[2] + 32] = (rng.standard_normal((n, 32)) * 2.0**-110).astype(np.float32)
    return x.astype(dtype)


def random_values(rng, n: int, h: int, dtype=BF16) -> np.ndarray:
    """Fresh random [n, h] values, drawn fast for the large arrays of a round (expert outputs, residuals): random
    sign and mantissa bits, magnitudes in [1/8, 2) over four octaves; never zero, subnormal or non-finite. bf16: 16
    random bits a value, float32: 32 (a tenth of the time of normal values and their cast, 25k x 7168 values)."""
    if np.dtype(dtype) == BF16:
        bits = rng.integers(0, 1 << 16, size=(n, h), dtype=np.uint16)
        return ((bits & np.uint16(0x81FF)) | np.uint16(0x3E00)).view(BF16)  # exponent 124 + 0..3
    bits = rng.integers(0, 1 << 32, size=(n, h), dtype=np.uint32)
    return ((bits & np.uint32(0x81FF_FFFF)) | np.uint32(0x3E00_0000)).view(np.float32).astype(dtype, copy=False)


def make_inputs(rng, cfg, n_tokens: list[int], skew=False, dtype=BF16, edge=False):
    """Each rank's tokens x, top-k ids and weights (``edge``: tokens with subnormals, zeros and tiny blocks,
    :func:`edge_tokens`)."""
    tokens = edge_tokens if edge else random_tokens
    if cfg.skip_a2a:  # every rank holds the same tokens
        n = n_tokens[0]
        x = tokens(rng, n, cfg.hidden, dtype)
        ids = random_routing(rng, n, cfg, skew)
        w = rng.random((n, cfg.top_k)).astype(np.float32)
        return [x] * cfg.n_ranks, [ids] * cfg.n_ranks, [w] * cfg.n_ranks
    xs = [tokens(rng, n, cfg.hidden, dtype) for n in n_tokens]
    ids = [random_routing(rng, n, cfg, skew) for n in n_tokens]
    ws = [rng.random((n, cfg.top_k)).astype(np.float32) for n in n_tokens]
    return xs, ids, ws


def to_devices(group, arrays):
    import cupy

    out = []
    for dev, a in zip(group.devices, arrays):
        with cupy.cuda.Device(dev):
            out.append(cupy.asarray(a))
    return out


def poison_outputs(buf, scales: bool = True) -> None:
    """Fill every dispatch output with a pattern the kernels never write, so unwritten elements show up.

    ``scales=False`` leaves the scales alone: fp4 rounds then zero only the padding rows earlier rounds left (the
    per-tile bounds, ``scale_tile_rows``), as in a real run, and :func:`check_dispatch` checks those bounds."""
    for r in buf._ranks:
        import cupy

        with cupy.cuda.Device(r.device):
            r.tokens.view(np.uint8).fill(0xA5)
            if r.scales is not None and scales:
                r.scales.view(np.uint8).fill(0xA5)
                if r.scale_tile_rows is not None:  # every row of a tile may be nonzero now (as Buffer.reset says)
                    r.scale_tile_rows.fill(SCALE_TILE_ROWS)
            r.src_info.fill(-7)
            r.row_offsets.fill(0xFFFFFFF)
            r.expert_ids.fill(-7)
            if r.scales_offsets is not None:
                r.scales_offsets.fill(0xFFFFFFF)


def gpu_row_perm(g_src_info, g_src_rank, r_src_info, r_src_rank, rows):
    """perm[i] = reference row matching GPU row i (by source rank, token, k); padding rows map to themselves."""
    key_to_ref = {}
    for i in range(rows):
        if r_src_info[i, 0] >= 0:
            key_to_ref[(int(r_src_rank[i]), int(r_src_info[i, 0]), int(r_src_info[i, 1]))] = i
    perm = np.empty(rows, dtype=np.int64)
    for i in range(rows):
        if g_src_info[i, 0] < 0:
            perm[i] = i
        else:
            perm[i] = key_to_ref.pop((int(g_src_rank[i]), int(g_src_info[i, 0]), int(g_src_info[i, 1])))
    assert not key_to_ref, f"rows missing on the GPU: {list(key_to_ref)[:5]}"
    return perm


def check_dispatch(buf, got, want, cfg) -> list[np.ndarray]:
    """Assert each local rank's GPU dispatch equals the reference; return each one's GPU->reference row permutation.

    ``got`` and ``want`` hold one entry per local rank of ``buf`` (in ``buf._ranks`` order).
    """
    perms = []
    for i, (d, w) in enumerate(zip(got, want)):
        r = d.rank
        ro = d.row_offsets.get()
        np.testing.assert_array_equal(ro, w.row_offsets, err_msg=f"rank {r} row_offsets")
        np.testing.assert_array_equal(d.expert_ids.get(), w.expert_ids, err_msg=f"rank {r} expert_ids")
        rows = int(ro[-1])
        si = d.src_info.get()[:rows]
        src_rank = buf._ranks[i].row_src.get()[:rows]
        # padding rows exactly where the reference has them; each (source, token, k) exactly once
        np.testing.assert_array_equal(si[:, 0] < 0, w.src_info[:, 0] < 0, err_msg=f"rank {r} padding rows")
        # every row stays inside its (expert, source) block
        for g in range(cfg.n_groups):
            a, b = int(ro[g]), int(ro[g + 1])
            np.testing.assert_array_equal(np.sort(src_rank[a:b]), np.sort(w.src_rank[a:b]),
                                          err_msg=f"rank {r} group {g} sources")
            real = src_rank[a:b][src_rank[a:b] >= 0]
            np.testing.assert_array_equal(real, np.sort(real), err_msg=f"rank {r} group {g}: source-rank order")
        perm = gpu_row_perm(si, src_rank, w.src_info, w.src_rank, rows)
        np.testing.assert_array_equal(si, w.src_info[perm], err_msg=f"rank {r} src_info")
        tok = d.tokens.get()[:rows]
        np.testing.assert_array_equal(tok.view(np.uint8), w.tokens[perm].view(np.uint8), err_msg=f"rank {r} tokens")
        if cfg.fmt.name == "fp8":
            sc = d.scales.get()[:, :rows]
            np.testing.assert_array_equal(sc.view(np.uint32), w.scales[:, perm].view(np.uint32),
                                          err_msg=f"rank {r} fp8 scales")
        elif cfg.fmt.swizzled_scales:
            so = d.scales_offsets.get()
            np.testing.assert_array_equal(so, w.scales_offsets, err_msg=f"rank {r} scales_offsets")
            sw = d.scales.get()
            got_rows = unswizzle_block_scales(sw, ro, cfg.fmt.name, cfg.hidden)
            want_rows = unswizzle_block_scales(w.scales, ro, cfg.fmt.name, cfg.hidden)
            np.testing.assert_array_equal(got_rows, want_rows[perm], err_msg=f"rank {r} block scales")
            # padding of every used tile is zero: re-swizzling the rows reproduces the GPU's bytes exactly
            re, _ = ref.swizzle_block_scales(got_rows, ro, cfg.fmt.name, cfg.hidden)
            np.testing.assert_array_equal(sw[: re.size], re, err_msg=f"rank {r} scale tile padding")
            if buf._ranks[i].scale_tile_rows is not None:  # (none on several nodes: every padding row written)
                check_scale_tile_bounds(sw, buf._ranks[i].scale_tile_rows.get(), cfg, f"rank {r}")
        perms.append(perm)
    return perms


def check_scale_tile_bounds(swizzled: np.ndarray, bounds: np.ndarray, cfg, where: str = "") -> None:
    """Assert the fp4 scales' per-tile bounds hold over the whole output: every row of tile t from bounds[t] on is
    zero (a round zeroes only the rows below a tile's bound, so a row past it left nonzero would stay wrong)."""
    k_tiles = cfg.fmt.scale_k_tiles(cfg.hidden)
    tiles = swizzled.size // (k_tiles * 512)
    assert bounds.shape == (tiles,) and (bounds <= 128).all(), f"{where} scale_tile_rows {bounds.shape}"
    # byte (t, kt, j, q, c) = row q * 32 + j, column kt * 4 + c of tile t
    rows = swizzled.reshape(tiles, k_tiles, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(tiles, 128, k_tiles * 4)
    past = np.arange(128)[None, :] >= bounds[:, None].astype(np.int64)
    bad = np.argwhere(rows.any(axis=2) & past)
    assert not bad.size, f"{where} scale tile rows past their bound are nonzero (tile, row): {bad[:5].tolist()}"


def _call(fn, bare: bool, *args, **kw) -> list:
    """``fn`` on the per-rank lists, or (``bare``: one local rank) on their single entries; a list back."""
    if not bare:
        return fn(*args, **kw)
    one = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731
    return [fn(*map(one, args), **{k: one(v) for k, v in kw.items()})]


def run_round(buf, cfg, rng, n_tokens, *, skew=False, weights_at="dispatch", check_unreduced=True, dtype=BF16,
              global_scale=1.0, async_halves=False, residual=False, bare=False, poison_scales=True, edge=False):
    """One dispatch + combine round on the GPU and in the reference; asserts everything matches.

    Inputs and expert outputs of every rank are drawn from ``rng`` (so processes with equally seeded generators
    agree on them); the kernels run and are checked for the ranks ``buf`` drives in this process. ``bare``
    (a process driving one rank) passes bare arrays instead of one-entry lists. ``poison_scales=False`` keeps the
    scales of the rounds before (:func:`poison_outputs`). ``edge``: tokens with subnormals and zeros
    (:func:`edge_tokens`).
    """
    group = buf.group
    mine = list(group.ranks)  # the global ranks this process drives
    local = lambda arrays: [arrays[r] for r in mine]  # noqa: E731
    xs, ids, ws = make_inputs(rng, cfg, n_tokens, skew, dtype, edge)
    want_all = ref.dispatch([np.asarray(x) for x in xs], ids, cfg, global_scale=global_scale)
    want = local(want_all)
    gx, gids, gws = to_devices(group, local(xs)), to_devices(group, local(ids)), to_devices(group, local(ws))
    poison_outputs(buf, scales=poison_scales)
    if group.kind == "ipc":  # peers write into this rank's outputs: every rank poisons before any rank sends
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        group.barrier()
    if bare and len(mine) != 1:
        raise ValueError(f"bare arrays need a process that drives one rank; this one drives {len(mine)}")
    if async_halves:
        pend = _call(cuep.dispatch_async, bare, buf, gx, gids, gws if weights_at == "dispatch" else None,
                     global_scale=global_scale)
        got = _call(cuep.dispatch_wait, bare, pend)
    else:
        got = _call(cuep.dispatch, bare, buf, gx, gids, gws if weights_at == "dispatch" else None,
                    global_scale=global_scale)
    buf.synchronize()
    perms = check_dispatch(buf, got, want, cfg)

    # expert outputs: random per (source, token, k) key, laid out in each side's row order
    cdt = BF16 if cfg.combine_dtype == "bfloat16" else np.dtype(np.float32)
    eo_ref = [random_values(rng, w.n_rows, cfg.hidden, cdt) for w in want_all]
    eo_gpu = []
    for r, perm in zip(mine, perms):
        rows = want_all[r].n_rows
        full = np.full((cfg.capacity, cfg.hidden), np.nan, dtype=cdt)
        full[:rows] = eo_ref[r][perm]
        eo_gpu.append(full)
    g_eo = to_devices(group, eo_gpu)
    res_np = [random_values(rng, x.shape[0], cfg.hidden, cdt) for x in xs] if residual else None
    kw = {}
    if residual:
        kw["residual"] = to_devices(group, local(res_np))
    if weights_at == "combine":
        out = _call(cuep.combine, bare, buf, g_eo, got, gws, **kw)
        wref = ws
    elif weights_at == "dispatch":
        out = _call(cuep.combine, bare, buf, g_eo, got, **kw)
        wref = ws
    else:
        out = _call(cuep.combine, bare, buf, g_eo, got)
        wref = None
    buf.synchronize()
    want_c = ref.combine(eo_ref, want_all, wref, cfg, num_tokens=[x.shape[0] for x in xs])  # (bf16 taken as is)
    for r, o in zip(mine, out):
        wc = want_c[r]
        o = o.get().astype(np.float32)
        if residual:
            wc = wc + res_np[r].astype(np.float32)
        assert o.shape == wc.shape, (o.shape, wc.shape)
        if wref is None:  # unreduced: exact copies
            np.testing.assert_array_equal(o, wc, err_msg=f"rank {r} unreduced combine")
        else:
            scale = max(1.0, float(np.abs(wc).max())) if wc.size else 1.0
            tol = 2e-2 if cdt == BF16 else 1e-5
            np.testing.assert_allclose(o, wc, rtol=tol, atol=tol * scale, err_msg=f"rank {r} combine")
    return got


# A kernel of the tests' own that holds its 8 blocks for 50 us, then copies each (src, dst) job byte by byte: queued
# right before a launch of cuep's, it is the kernel that launch depends on, still running when a programmatic
# dependent launch is scheduled (cuep/_kernels.py DependentLaunch).
_SLOW_COPY = r"""
extern "C" __global__ void slow_copy(const long long* jobs, int n_jobs, long long spin_ns) {
    if (threadIdx.x == 0) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)spin_ns);
    }
    __syncthreads();
    for (int j = 0; j < n_jobs; ++j) {
        const unsigned char* src = reinterpret_cast<const unsigned char*>(jobs[3 * j]);
        unsigned char* dst = reinterpret_cast<unsigned char*>(jobs[3 * j + 1]);
        for (long long b = blockIdx.x * blockDim.x + threadIdx.x; b < jobs[3 * j + 2]; b += gridDim.x * blockDim.x)
            dst[b] = src[b];
    }
}
"""
_slow_kernel: list = []


def slow_copy(*jobs):
    """Queue the slow copy of ``jobs`` ((src, dst) C-contiguous CuPy arrays of equal bytes) on the current stream;
    returns its job table, which must stay alive until the copy has run."""
    import cupy

    if not _slow_kernel:
        _slow_kernel.append(cupy.RawKernel(_SLOW_COPY, "slow_copy"))
    for src, dst in jobs:
        assert src.nbytes == dst.nbytes and src.flags.c_contiguous and dst.flags.c_contiguous
    table = cupy.asarray(np.array([v for src, dst in jobs for v in (src.data.ptr, dst.data.ptr, src.nbytes)],
                                  dtype=np.int64))
    _slow_kernel[0]((8,), (256,), (table, np.int32(len(jobs)), np.int64(50_000)))
    return table
