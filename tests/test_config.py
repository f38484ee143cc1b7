"""EPConfig validation and derived sizes (CPU)."""
from __future__ import annotations

import re

import pytest

from cuep import EPConfig
from cuep.formats import ALIGN, FORMATS, MessageLayout, swizzled_scale_offset

STD = dict(hidden=7168, top_k=8, n_experts=256, max_tokens_per_rank=4096, n_gpus_per_node=4)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(n_experts=250), "n_experts"),               # E % R != 0
    (dict(top_k=300, n_experts=256), "top_k"),        # K > E
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
    (dict(hidden=100), "hidden"),                     # not a multiple of 8 (bf16)
    (dict(hidden=7168 + 64, dispatch_format="fp8"), "hidden"),
    (dict(hidden=7168 + 16, dispatch_format="mxfp4"), "hidden"),
    (dict(n_gpus_per_node=9, n_experts=252), "n_gpus_per_node"),
    (dict(dispatch_format="int4"), "dispatch_format"),
    (dict(combine_dtype="float16x"), "combine_dtype"),
    (dict(top_k=0), "top_k"),
    (dict(n_nodes=0), "n_nodes"),
    (dict(hidden=True), "hidden"),
    (dict(small_batch_tokens=-1), "small_batch_tokens"),
    (dict(small_batch_tokens=4097), "max_tokens_per_rank"),        # above T
    (dict(small_batch_tokens=2048), "small_batch_tokens"),         # 2048 x K=8 choices > 8192
    (dict(small_batch_tokens=16, n_experts=2048), "n_experts"),    # per-range counters in shared memory
    (dict(small_batch_tokens=True), "small_batch_tokens"),
    (dict(allreduce_world_size=0), "allreduce_world_size"),
    (dict(allreduce_world_size=2), "allreduce_world_size"),                      # needs skip_a2a + shared
])
def test_config_rejects_bad_arguments_by_name(kwargs, arg):
    with pytest.raises(ValueError, match=re.escape(arg)):
        EPConfig(**{**STD, **kwargs})


SKIP_SHARED = dict(skip_a2a=True, fused_shared_expert=True)


@pytest.mark.parametrize("kwargs, rule", [
    (dict(allreduce_world_size=0, **SKIP_SHARED), "allreduce_world_size=0 must be a positive int"),
    (dict(allreduce_world_size=-2, **SKIP_SHARED), "allreduce_world_size=-2 must be a positive int"),
    (dict(allreduce_world_size=True, **SKIP_SHARED), "allreduce_world_size=True must be a positive int"),
    (dict(allreduce_world_size=2.0, **SKIP_SHARED), "allreduce_world_size=2.0 must be a positive int"),
    (dict(allreduce_world_size=2), "allreduce_world_size=2 needs skip_a2a=True and fused_shared_expert=True"),
    (dict(allreduce_world_size=2, skip_a2a=True), "allreduce_world_size=2 needs skip_a2a=True and "
                                                  "fused_shared_expert=True"),
    (dict(allreduce_world_size=4, fused_shared_expert=True), "allreduce_world_size=4 needs skip_a2a=True"),
    (dict(allreduce_world_size=3, **SKIP_SHARED), "allreduce_world_size=3 must divide the number of ranks 4"),
    (dict(allreduce_world_size=8, **SKIP_SHARED), "allreduce_world_size=8 must divide the number of ranks 4"),
])
def test_allreduce_world_size_rules(kwargs, rule):
    with pytest.raises(ValueError, match=re.escape(rule)):
        EPConfig(**{**STD, **kwargs})


def test_allreduce_world_size_in_repr_describe_and_sizes():
    """Default 1; part of the repr every rank compares and of describe(); it moves no buffer (the shared expert's
    share only shrinks group 0 below the bound that capacity already holds)."""
    one = EPConfig(**STD, **SKIP_SHARED)
    assert one.allreduce_world_size == 1 and "allreduce_world_size=1" in repr(one)
    assert "all-reduce" not in one.describe()
    for A in (2, 4):
        cfg = EPConfig(**STD, **SKIP_SHARED, allreduce_world_size=A)
        assert f"allreduce_world_size={A}" in repr(cfg) and repr(cfg) != repr(one)
        assert f"all-reduce groups of {A} ranks" in cfg.describe()
        assert cfg.capacity == one.capacity and cfg.buffer_regions == one.buffer_regions
    assert EPConfig(**{**STD, "n_nodes": 2}, **SKIP_SHARED, allreduce_world_size=8).n_ranks == 8


@pytest.mark.parametrize("A", [1, 2, 4])
def test_shared_expert_share(A):
    """rank r at position p = r % A takes [p * N // A, (p + 1) * N // A): each group's shares tile [0, N) in rank
    order, sizes differing by at most one; A = 1 takes all N."""
    cfg = EPConfig(**{**STD, "max_tokens_per_rank": 67}, **({} if A == 1 else SKIP_SHARED), allreduce_world_size=A)
    for n in range(68):
        for g in range(4 // A):
            shares = [cfg.shared_expert_share(r, n) for r in range(g * A, g * A + A)]
            assert shares == [(p * n // A, (p + 1) * n // A) for p in range(A)]
            assert shares[0][0] == 0 and shares[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
            sizes = [hi - lo for lo, hi in shares]
            assert max(sizes) - min(sizes) <= 1
    for kwargs, arg in ((dict(rank=-1, n_tokens=1), "rank"), (dict(rank=4, n_tokens=1), "rank"),
                        (dict(rank=True, n_tokens=1), "rank"), (dict(rank=0, n_tokens=68), "n_tokens"),
                        (dict(rank=0, n_tokens=-1), "n_tokens"), (dict(rank=0, n_tokens=2.0), "n_tokens")):
        with pytest.raises(ValueError, match=rf"{arg}=.* must be an int in \[0, "):
            cfg.shared_expert_share(**kwargs)


def test_config_is_frozen():
    cfg = EPConfig(**STD)
    with pytest.raises(Exception):
        cfg.hidden = 1  # type: ignore[misc]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_derived_sizes(fmt, shared, skip):
    cfg = EPConfig(**STD, dispatch_format=fmt, fused_shared_expert=shared, skip_a2a=skip)
    R, T, K, L, H = 4, 4096, 8, 64, 7168
    assert cfg.n_ranks == R and cfg.n_local_experts == L
    assert cfg.n_groups == L + shared
    assert cfg.row_offsets_len == L + shared + 1
    src = 1 if skip else R
    assert cfg.max_routed_rows == src * T * min(K, L)
    pad = 3 if fmt == "fp8" else 0
    assert cfg.capacity == src * T * K + (T if shared else 0) + cfg.n_groups * pad
    m = cfg.message
    for off in (m.src_offset, m.topk_ids_offset, m.topk_weights_offset, m.topk_rows_offset, m.scales_offset,
                m.meta_bytes):
        assert off % ALIGN == 0
    assert m.payload_bytes == {"bf16": 2 * H, "fp8": H, "nvfp4": H // 2, "mxfp4": H // 2}[fmt]
    assert m.scale_bytes == {"bf16": 0, "fp8": H // 128 * 4, "nvfp4": H // 16, "mxfp4": H // 32}[fmt]
    assert m.topk_ids_offset >= 4 and m.topk_weights_offset >= m.topk_ids_offset + 2 * K
    assert m.topk_rows_offset >= m.topk_weights_offset + 4 * K and m.scales_offset >= m.topk_rows_offset + 4 * K
    assert m.meta_bytes >= m.scales_offset + m.scale_bytes and m.nbytes == m.payload_bytes + m.meta_bytes
    assert cfg.buffer_regions["tokens"][1] == cfg.capacity * m.payload_bytes
    assert cfg.buffer_regions["meta"][1] == src * T * (m.meta_bytes + cfg.stage_flag_bytes)
    assert cfg.total_bytes == cfg.buffer_bytes + cfg.output_bytes
    # where each row's (fp8) or scale row's (fp4) scales are in a large round: one uint32 per row of the scales
    scales = {"bf16": 0, "fp8": 4 * (H // 128) * cfg.capacity}.get(fmt, cfg.scales_shape[0])
    rows = {"bf16": 0, "fp8": cfg.capacity}.get(fmt, cfg.swizzled_scale_tiles * 128)
    assert cfg.scales_bytes == scales and cfg.scale_rows == rows
    assert cfg.buffer_regions["scale_rows"][1] == 4 * rows
    regions = sorted(cfg.buffer_regions.values())
    for (o1, s1), (o2, _) in zip(regions, regions[1:]):
        assert o1 % 256 == 0 and o1 + s1 <= o2
    assert regions[-1][0] + regions[-1][1] <= cfg.buffer_bytes
    assert cfg.describe()


def test_small_batch_tokens_default_and_staging_region():
    """Small rounds (decode) stage their messages: 2 parities x sources x small_batch_tokens records of
    (meta | chunk flags | payload), then a book row per parity and source (token mask words, then the choices).
    Default min(T, 256); off (0) past 1024 experts, where the book's counters would not fit in shared memory;
    capped so that small_batch_tokens x top_k <= 8192."""
    cfg = EPConfig(**STD)
    assert cfg.small_batch_tokens == 256
    assert cfg.small_book_len == 256 // 32 + 256 * 8
    # one uint32 flag per 256-value span of H = 7168 (28), 16-byte aligned
    assert cfg.stage_flag_bytes == 112
    assert cfg.stage_record_bytes == cfg.message.meta_bytes + 112 + cfg.message.payload_bytes
    assert EPConfig(**{**STD, "hidden": 7168 + 128}).stage_flag_bytes == 128  # 29 spans
    assert cfg.buffer_regions["stage"][1] == 2 * 4 * (256 * cfg.stage_record_bytes + 8 * cfg.small_book_len)
    odd = EPConfig(**{**STD, "top_k": 3, "small_batch_tokens": 33})
    assert odd.small_book_len == 2 + 99  # ceil(33 / 32) mask words, 99 choices
    assert EPConfig(**{**STD, "max_tokens_per_rank": 100}).small_batch_tokens == 100
    assert EPConfig(**{**STD, "n_experts": 2048}).small_batch_tokens == 0
    assert EPConfig(**{**STD, "top_k": 32, "n_experts": 256}).small_batch_tokens == 256
    assert EPConfig(**{**STD, "top_k": 16, "n_experts": 256, "small_batch_tokens": 512}).small_batch_tokens == 512
    off = EPConfig(**STD, small_batch_tokens=0)
    assert off.small_batch_tokens == 0 and off.small_book_len == 0 and off.buffer_regions["stage"][1] == 0
    assert EPConfig(**STD, skip_a2a=True).buffer_regions["stage"][1] == 2 * 1 * (256 * cfg.stage_record_bytes +
                                                                                   8 * cfg.small_book_len)
    # the resolved value is part of the config (the repr every rank compares)
    assert "small_batch_tokens=256" in repr(cfg)
    from cuep.ep import _small_book_bytes
    assert _small_book_bytes(off) == 0
    assert _small_book_bytes(cfg) == 2 * 2 * 256 * 8 + 4 * 8 * 8 + 4 * 256 + 4 * 256 * 8 + 4 * 256 + 32
    # a one-rank group's small round (dispatch/local.cuh) keeps the groups' first rows and scale tiles after the book
    from cuep.ep import _local_layout_bytes
    one = EPConfig(**{**STD, "n_gpus_per_node": 1, "n_nodes": 1})
    groups = 16 * -(-4 * (one.n_groups + 1) // 16) + 16 * -(-4 * one.n_groups // 16)
    assert _local_layout_bytes(one) == _small_book_bytes(one) + groups
    assert cfg.n_ranks == 4 and _local_layout_bytes(cfg) == 0
    # small rounds off: the larger rounds' layout only (groups and the local experts' row counts)
    off1 = EPConfig(**{**STD, "n_gpus_per_node": 1, "n_nodes": 1, "small_batch_tokens": 0})
    assert _local_layout_bytes(off1) == groups + 4 * 256
    # block 0's per-expert token masks bound small_batch_tokens by n_experts (64 KiB of masks)
    assert EPConfig(**{**STD, "n_experts": 1024, "small_batch_tokens": 512}).small_batch_tokens == 512
    with pytest.raises(ValueError, match=r"small_batch_tokens=544 with n_experts=1024 must be <= 512"):
        EPConfig(**{**STD, "n_experts": 1024, "small_batch_tokens": 544})


def test_combine_regions_hold_two_parities():
    """comb_ready is uint64 [2, R] ("any" and parity-slot readiness from each rank); comb_arrived is int32
    [2 parities, T, 32] (one arrival counter per 128-byte line), which must hold the stride the combine kernel
    uses (kArrivedStride, or the older CUEP_ARRIVED_STRIDE macro, wherever it lives under cuda_src/)."""
    from pathlib import Path

    cfg = EPConfig(**STD)
    regions = cfg.buffer_regions
    assert regions["comb_ready"][1] == 8 * 2 * cfg.n_ranks
    assert regions["comb_arrived"][1] == 4 * 2 * cfg.max_tokens_per_rank * 32
    cuda_src = Path(__file__).resolve().parents[1] / "cuep" / "cuda_src"
    pattern = re.compile(r"(?:#define CUEP_ARRIVED_STRIDE|constexpr int kArrivedStride =) (\d+)")
    strides = {int(m.group(1)) for f in sorted(cuda_src.rglob("*.cu*")) for m in pattern.finditer(f.read_text())}
    assert len(strides) == 1, f"the combine's arrival counter stride, defined once under {cuda_src}: {strides}"
    assert 1 <= strides.pop() <= 32
    # every region starts on a 256-byte boundary, so each token's counter line is aligned
    assert all(off % 256 == 0 for off, _ in regions.values())


@pytest.mark.parametrize("kwargs, want", [
    (dict(), 256),                                              # 4 ranks, K = 8: parity slots, bf16
    (dict(max_tokens_per_rank=128), 128),                       # capped at T
    (dict(combine_dtype="float32"), 0),                         # polled words are bf16 only
    (dict(n_gpus_per_node=8, n_experts=256), 0),                # 2 x 8 ranks > K: no parity slots
    (dict(n_gpus_per_node=8, n_experts=256, skip_a2a=True), 256),  # skip_a2a: one destination rank
])
def test_combine_poll_region(kwargs, want):
    """comb_poll holds bf16 [2 parities, combine_poll_tokens, destination ranks, H] (empty when the combine cannot
    poll), and the kernels find its offset and token count in the parameter block."""
    from cuep.params import EP_PARAMS_FIELDS

    cfg = EPConfig(**{**STD, **kwargs})
    assert cfg.combine_poll_tokens == want
    n_dest = 1 if cfg.skip_a2a else cfg.n_ranks
    assert cfg.buffer_regions["comb_poll"][1] == 2 * want * n_dest * cfg.hidden * 2
    assert {"off_comb_poll", "poll_tokens"} <= set(EP_PARAMS_FIELDS)


def test_no_bf16_partial_sum_is_the_not_landed_word():
    """A polled receiver takes an 8-byte word of all ones as "not landed": no bf16 value the kernels write may be
    0xFFFF. bf16 rounding as the kernels do it (ml_dtypes; NaN -> 0x7FC0 / 0xFFC0, overflow -> Inf) over every high
    half of a float32 with the low halves that round differently."""
    import ml_dtypes
    import numpy as np

    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    bits = (hi[:, None] | np.array([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)).ravel()
    with np.errstate(invalid="ignore"):  # the NaN inputs
        out = bits.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert not (out == 0xFFFF).any()
    nan = np.isnan(bits.view(np.float32))
    assert set(np.unique(out[nan]).tolist()) == {0x7FC0, 0xFFC0}


def test_memory_at_standard_shape_is_small():
    """The spec's receive layout needs ~15 GB at this shape; ours sizes by what can arrive."""
    cfg = EPConfig(**STD)
    spec_recv = cfg.n_local_experts * cfg.n_ranks * cfg.max_tokens_per_rank * cfg.message.nbytes
    assert spec_recv > 14e9
    assert cfg.total_bytes < 2.5e9


def test_message_layout_small():
    m = MessageLayout.make(FORMATS["nvfp4"], 32, 1)
    assert (m.payload_bytes, m.scale_bytes) == (16, 2)
    assert (m.src_offset, m.topk_ids_offset, m.topk_weights_offset, m.topk_rows_offset, m.scales_offset,
            m.meta_bytes) == (0, 16, 32, 48, 64, 80)


def test_row_align_is_a_power_of_two():
    """The kernels pad a group's rows with a mask (dispatch/layout.cuh: padded), so Format refuses any other."""
    import dataclasses

    for f in FORMATS.values():
        assert f.row_align >= 1 and f.row_align & (f.row_align - 1) == 0, f
    with pytest.raises(ValueError, match="row_align=3 must be a power of two"):
        dataclasses.replace(FORMATS["fp8"], row_align=3)


def test_swizzled_offset_is_a_bijection_on_a_tile():
    offs = {swizzled_scale_offset(r, c, 1) for r in range(128) for c in range(4)}
    assert offs == set(range(512))
    assert swizzled_scale_offset(0, 4, 2) == 512  # second K tile
    assert swizzled_scale_offset(128, 0, 2) == 1024  # second row tile
    assert swizzled_scale_offset(33, 2, 1) == 1 * 16 + 1 * 4 + 2


def test_swizzled_tile_words_and_quads():
    """What dispatch.cu's fp4 padding and scale gathering rely on: in a (tile, k-tile) 512-byte block, 4-byte
    word w holds the 4 scales of row w // 4 + 32 (w % 4), so 16-byte quad j holds rows j, j + 32, j + 64, j + 96 and
    lane l of a warp storing quad l writes rows l + 32 q; and padding rows first .. 127 are exactly the words of
    rows >= first (whole quads from j = first, the other quads' words q with j + 32 q >= first)."""
    k_tiles, T = 3, 2
    for kt in range(k_tiles):
        block = (T * k_tiles + kt) * 512
        for w in range(128):
            row = T * 128 + w // 4 + 32 * (w % 4)
            assert swizzled_scale_offset(row, 4 * kt, k_tiles) == block + 4 * w
    for first in (1, 5, 31, 32, 33, 100, 127):
        want = {swizzled_scale_offset(T * 128 + r, 4 * kt, k_tiles) for r in range(first, 128) for kt in range(k_tiles)}
        got = set()
        for kt in range(k_tiles):
            block = (T * k_tiles + kt) * 512
            for j in range(32):
                got |= {block + 16 * j + 4 * q for q in range(4) if j >= first or j + 32 * q >= first}
        assert got == want, first
