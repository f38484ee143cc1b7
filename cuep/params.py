"""The kernel parameter structs of ``cuda_src/ep/params.cuh`` as NumPy structured dtypes, and their builders.

Every EP kernel takes one struct by value: ``DispatchParams`` (``EPParams`` + ``DispatchArgs``) or
``CombineParams`` (``EPParams`` + ``CombineArgs``). ``EPParams`` describes one rank's buffer and is built once per
:class:`cuep.Buffer`; the ``*Args`` part is one call's arrays (device pointers) and scalars. The dtypes below are
aligned like the C structs (``align=True``); ``tests/test_params.py`` compiles a file of ``static_assert``s with
nvcc that checks every field's offset and every struct's size against these dtypes.
"""
from __future__ import annotations

import struct

import numpy as np

MAX_RANKS = 8  # kMaxRanks: entries of peer_base

#: EPParams' int64 fields a caller gives (:func:`ep_params`), in the order of the C struct, which starts with
#: ``self_base`` (derived: ``peer_base[rank]``) and ends with ``peer_base[MAX_RANKS]``. What the decode kernels read
#: first leads, so that it takes the fewest 64-byte lines of the constant bank (each new line a warp reaches costs
#: it a miss: ``benchmarks/launch_gpu.py``).
EP_PARAMS_FIELDS = (
    "rank", "n_ranks", "n_local", "n_experts", "top_k", "hidden", "n_groups", "shared", "skip_a2a",
    "ar_size", "ar_index", "small_tokens", "row_align", "payload_bytes", "scale_bytes", "n_scales", "k_tiles",
    "off_tokens", "off_counters", "off_scratch", "off_scale_rows", "timeout_ns", "err_ptr", "n_src", "src_index",
    "max_tokens", "capacity", "meta_bytes", "meta_ids", "meta_w", "meta_rows", "meta_scales", "combine_itemsize",
    "stage_record", "off_comb_recv", "off_meta", "off_tally", "off_comb_ready", "off_comb_arrived", "off_stage",
    "off_comb_poll", "poll_tokens",
)

EP_PARAMS_DTYPE = np.dtype([("self_base", np.int64)] + [(f, np.int64) for f in EP_PARAMS_FIELDS]
                           + [("peer_base", np.int64, (MAX_RANKS,))], align=True)

_PTR = np.uint64  # device pointers (0 = nullptr)

#: DispatchArgs (the C struct's order): first the fields that change from call to call (CALL_FIELDS: one span, so
#: a prepared launch packs them with one ``struct.pack_into``), then the rank's persistent arrays.
DISPATCH_ARGS_DTYPE = np.dtype([
    ("x", _PTR), ("topk_ids", _PTR), ("topk_weights", _PTR),
    ("num_tokens", np.int32), ("global_scale", np.float32), ("phases", np.int32), ("chunk_plan", np.int32),
    ("scales_out", _PTR), ("row_offsets", _PTR), ("expert_ids", _PTR), ("scales_offsets", _PTR), ("src_info", _PTR),
    ("row_src", _PTR), ("row_weight", _PTR), ("msg_rows", _PTR), ("msg_token", _PTR), ("msg_j", _PTR),
    ("msg_count", _PTR), ("scale_tile_rows", _PTR),
], align=True)

#: CombineArgs, ordered as DispatchArgs (the call's fields first).
COMBINE_ARGS_DTYPE = np.dtype([
    ("expert_out", _PTR), ("topk_ids", _PTR), ("topk_weights", _PTR), ("residual", _PTR), ("out", _PTR),
    ("num_tokens", np.int32), ("mode", np.int32), ("phases", np.int32), ("chunk_plan", np.int32),
    ("src_info", _PTR), ("row_src", _PTR), ("row_weight", _PTR), ("msg_rows", _PTR), ("msg_token", _PTR),
    ("msg_j", _PTR), ("msg_count", _PTR), ("row_offsets", _PTR),
], align=True)

#: The fields of each call struct that change from call to call, in order, at its start.
CALL_FIELDS = {"dispatch": ("x", "topk_ids", "topk_weights", "num_tokens", "global_scale", "phases", "chunk_plan"),
               "combine": ("expert_out", "topk_ids", "topk_weights", "residual", "out", "num_tokens", "mode", "phases",
                           "chunk_plan")}

DISPATCH_PARAMS_DTYPE = np.dtype([("ep", EP_PARAMS_DTYPE), ("call", DISPATCH_ARGS_DTYPE)], align=True)
COMBINE_PARAMS_DTYPE = np.dtype([("ep", EP_PARAMS_DTYPE), ("call", COMBINE_ARGS_DTYPE)], align=True)

#: The C struct behind each dtype (the layout test's table).
C_STRUCTS = {
    "EPParams": EP_PARAMS_DTYPE, "DispatchArgs": DISPATCH_ARGS_DTYPE, "CombineArgs": COMBINE_ARGS_DTYPE,
    "DispatchParams": DISPATCH_PARAMS_DTYPE, "CombineParams": COMBINE_PARAMS_DTYPE,
}


def ep_params(values: dict) -> np.ndarray:
    """One rank's ``EPParams`` as a one-element structured array.

    Args:
        values: every name of :data:`EP_PARAMS_FIELDS` (int) and ``peer_base`` (up to ``MAX_RANKS`` ints; the
            rest are 0). ``self_base`` is ``peer_base[rank]``.

    Raises:
        ValueError: a field missing or unknown, more than ``MAX_RANKS`` bases, or ``rank`` without one.
    """
    want = set(EP_PARAMS_FIELDS) | {"peer_base"}
    missing, unknown = want - set(values), set(values) - want
    if missing or unknown:
        raise ValueError(f"EPParams: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
    rec = np.zeros(1, EP_PARAMS_DTYPE)
    bases = list(values["peer_base"])
    if len(bases) > MAX_RANKS:
        raise ValueError(f"peer_base has {len(bases)} entries; at most {MAX_RANKS} ranks")
    if not 0 <= values["rank"] < len(bases):
        raise ValueError(f"rank={values['rank']} has no entry in peer_base ({len(bases)} entries)")
    for f in EP_PARAMS_FIELDS:
        rec[f] = values[f]
    rec["peer_base"][0, :len(bases)] = bases
    rec["self_base"] = bases[values["rank"]]
    return rec


def launch_record(dtype: np.dtype, ep: np.ndarray, **call) -> np.ndarray:
    """One ``DispatchParams`` / ``CombineParams`` record: ``ep`` (the rank's EPParams) and the call's fields by name
    (device pointers as ints from :func:`pointer`, 0 for nullptr; the scalars).

    Raises:
        ValueError: a field of the call missing or unknown.
    """
    args = dtype["call"]
    if call.keys() != set(args.names):
        missing, unknown = set(args.names) - call.keys(), call.keys() - set(args.names)
        raise ValueError(f"kernel call: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
    rec = np.empty(1, dtype)
    rec["ep"] = ep
    rec["call"] = np.array(tuple(call[n] for n in args.names), dtype=args)
    return rec


_STRUCT_CODES = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i",
                 np.dtype(np.float32): "f"}


def call_struct(dtype: np.dtype) -> tuple[struct.Struct, int, tuple[str, ...]]:
    """The call part of a ``DispatchParams`` / ``CombineParams`` record as a ``struct.Struct`` that packs its fields
    in C order (padding explicit, little-endian), the part's offset in the record and the field names: what a
    prepared launch packs once (the same bytes as :func:`launch_record`'s call part; tests/test_params.py)."""
    names = dtype["call"].names
    pack, offset = span_struct(dtype, names)
    return pack, offset, names


def span_struct(dtype: np.dtype, names: tuple[str, ...]) -> tuple[struct.Struct, int]:
    """A ``struct.Struct`` packing the consecutive call fields ``names`` of a ``DispatchParams`` / ``CombineParams``
    record (padding between them explicit; after the last one, up to the next field or the record's end) and the
    record offset it packs at: a prepared launch packs only the fields that change per call."""
    args = dtype["call"]
    order = args.names
    first = order.index(names[0])
    if order[first:first + len(names)] != tuple(names):
        raise ValueError(f"{names} are not consecutive fields of {order}")
    nxt = first + len(names)
    end = args.fields[order[nxt]][1] if nxt < len(order) else args.itemsize
    start = pos = args.fields[names[0]][1]
    fmt = "<"
    for name in names:
        ftype, off = args.fields[name][:2]
        if off < pos:
            raise ValueError(f"field {name} overlaps the previous one")
        fmt += "x" * (off - pos) + _STRUCT_CODES[ftype]
        pos = off + ftype.itemsize
    fmt += "x" * (end - pos)
    return struct.Struct(fmt), dtype.fields["call"][1] + start


def pointer(a) -> int:
    """The device address of a CuPy array, or 0 for None (a nullptr in the kernel)."""
    return 0 if a is None else int(a.data.ptr)


def c_contiguous(a) -> bool:
    """``a.flags.c_contiguous`` without building the flags object (CuPy keeps the flag as ``_c_contiguous``); the
    kernels ignore strides, so every array argument is checked with it."""
    try:
        return a._c_contiguous
    except AttributeError:
        return a.flags.c_contiguous


def kernel_argument(rec: np.ndarray) -> np.void:
    """The struct as the kernel takes it by value: the record's bytes as one ``numpy.void`` (CuPy copies them
    into the launch's parameter space)."""
    return rec.view(np.dtype((np.void, rec.dtype.itemsize)))[0]
