"""cuep.internode without a GPU: the heap layout, the parameter structs against the C structs (compiled with NVRTC
and linked against NVSHMEM's device library, as the runtime does), and the configuration checks."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

import cuep
from cuep import internode, nvshmem


def _cfg(**kw):
    base = dict(hidden=512, top_k=6, n_experts=24, max_tokens_per_rank=40, n_gpus_per_node=2, n_nodes=2)
    base.update(kw)
    return cuep.EPConfig(**base)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("nodes", [2, 3])
def test_heap_regions_are_aligned_and_disjoint(fmt, nodes):
    cfg = _cfg(dispatch_format=fmt, n_nodes=nodes)
    regions = internode.heap_regions(cfg)
    end = 0
    for name, (off, size) in regions.items():
        assert off % 256 == 0 and off >= end, name
        end = off + size
    assert internode.heap_bytes(cfg) >= end
    M, T, K, H = cfg.n_nodes, cfg.max_tokens_per_rank, cfg.top_k, cfg.hidden
    rb = internode.row_bytes(cfg)
    assert rb % 16 == 0 and rb >= cfg.payload_bytes + cfg.fmt.scale_bytes(H)
    assert regions["x_recv"][1] == 2 * M * T * rb
    assert regions["c_recv"][1] == 2 * T * max(K, M) * H * cfg.combine_itemsize
    assert regions["sig"][1] == 8 * (8 * M + 4 + 2 * cfg.n_ranks)
    assert regions["x_dir"][1] == 2 * cfg.n_ranks * cfg.small_batch_tokens * rb
    assert internode.header_bytes(cfg) >= 16 + T * 8 * K


def test_struct_sizes():
    assert internode.NODE_PARAMS_DTYPE.itemsize == 8 * (len(internode.NODE_PARAMS_FIELDS) + internode.MAX_NODE_GPUS)
    assert internode.NODE_DISPATCH_ARGS_DTYPE.itemsize == 10 * 8 + 8
    assert internode.NODE_COMBINE_ARGS_DTYPE.itemsize == 5 * 8 + 8
    # the prepared launches pack exactly the call part of each record
    assert internode._DISPATCH_PACK.size == internode.NODE_DISPATCH_ARGS_DTYPE.itemsize
    assert internode._COMBINE_PACK.size == internode.NODE_COMBINE_ARGS_DTYPE.itemsize


def _offset_asserts() -> str:
    lines = []
    for struct, dtype in (("NodeParams", internode.NODE_PARAMS_DTYPE),
                          ("NodeDispatchArgs", internode.NODE_DISPATCH_ARGS_DTYPE),
                          ("NodeCombineArgs", internode.NODE_COMBINE_ARGS_DTYPE),
                          ("DispatchCall", internode.DISPATCH_CALL_DTYPE),
                          ("CombineCall", internode.COMBINE_CALL_DTYPE)):
        for name in dtype.names:
            off = dtype.fields[name][1]
            lines.append(f"static_assert(__builtin_offsetof(cuep::node::{struct}, {name}) == {off}, "
                         f"\"{struct}.{name} offset: cuep/internode.py says {off}\");")
        lines.append(f"static_assert(sizeof(cuep::node::{struct}) == {dtype.itemsize}, \"sizeof {struct}\");")
    return "\n".join(lines)


def test_internode_kernels_build_for_sm90_and_match_the_structs(tmp_path, monkeypatch):
    """The NVSHMEM kernel file compiles (NVRTC) and links (nvJitLink, libnvshmem_device.a) for sm_90 with the
    runtime's prelude and options, and every field offset of its structs equals the NumPy dtypes'."""
    if not nvshmem.available():
        if os.environ.get("CI"):
            pytest.fail(f"nvshmem extra not installed: CI must build the multi-node kernels ({nvshmem.INSTALL_HINT})")
        pytest.skip("nvshmem extra not installed")
    monkeypatch.setenv("CUEP_CACHE_DIR", str(tmp_path / "cache"))
    text = (nvshmem.SRC_DIR / internode.KERNEL_FILE).read_text()
    cubin = nvshmem.build("internode_layout.cu", "sm_90", source=text + "\n" + _offset_asserts())
    data = cubin.read_bytes()
    assert len(data) > 10_000
    for kernel in ("cuep_nd_send_nvfp4_from_f32", "cuep_nd_relay", "cuep_nd_count", "cuep_nd_offsets",
                   "cuep_nd_place_fp8", "cuep_nc_send_bf16", "cuep_nc_relay_f32", "cuep_nc_recv_bf16"):
        assert kernel.encode() in data, kernel


def _group(kind="ipc", n_ranks=4, gpus_per_node=2):
    return SimpleNamespace(kind=kind, n_ranks=n_ranks, gpus_per_node=gpus_per_node)


def test_check_config_errors():
    cfg = _cfg()
    internode.check_config(cfg, _group())
    with pytest.raises(RuntimeError, match="one process per rank"):
        internode.check_config(cfg, _group(kind="local"))
    with pytest.raises(ValueError, match="n_gpus_per_node=2 but the group's nodes have 4"):
        internode.check_config(cfg, _group(gpus_per_node=4))
    internode.check_config(_cfg(skip_a2a=True), _group())
    assert internode.heap_regions(_cfg(skip_a2a=True))["stage"][1] == 0


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_reference_is_the_same_for_any_node_layout(fmt):
    """The multi-node kernels are checked against cuep.reference, which must not depend on how the R ranks split
    into nodes: 2 nodes x 2 GPUs gives exactly 1 node x 4 GPUs' dispatch and combine."""
    import numpy as np

    from cuep import reference as ref

    rng = np.random.default_rng(3)
    one, two = _cfg(dispatch_format=fmt, n_gpus_per_node=4, n_nodes=1), _cfg(dispatch_format=fmt)
    n = [40, 0, 17, 33]
    xs = [rng.standard_normal((k, 512)).astype(np.float32) for k in n]
    ids = [np.argsort(-rng.random((k, 24)), axis=1)[:, :6].astype(np.int32) for k in n]
    ws = [rng.random((k, 6)).astype(np.float32) for k in n]
    a, b = ref.dispatch(xs, ids, one), ref.dispatch(xs, ids, two)
    for da, db in zip(a, b):
        for name in ("tokens", "row_offsets", "expert_ids", "src_info", "src_rank"):
            np.testing.assert_array_equal(getattr(da, name), getattr(db, name), err_msg=name)
    eo = [rng.standard_normal((d.n_rows, 512)).astype(np.float32) for d in a]
    for ca, cb in zip(ref.combine(eo, a, ws, one), ref.combine(eo, b, ws, two)):
        np.testing.assert_array_equal(ca, cb)
