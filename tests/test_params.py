"""The kernel parameter structs: cuep/params.py's dtypes against the C layout of cuda_src/ep/params.cuh (CPU).

nvcc compiles a generated file of static_asserts (offsetof of every field, sizeof of every struct) that includes
the header the kernels include, so a field added, moved or retyped on one side only fails here.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from cuep import _kernels, params

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


def _asserts(struct: str, dtype: np.dtype) -> list[str]:
    """sizeof the struct and offsetof each of its (top-level) fields, as the dtype has them."""
    lines = [f"static_assert(sizeof(cuep::{struct}) == {dtype.itemsize}, \"sizeof {struct}\");"]
    for name in dtype.names:
        off = dtype.fields[name][1]
        lines.append(f"static_assert(offsetof(cuep::{struct}, {name}) == {off}, \"{struct}.{name}\");")
    return lines


def layout_source() -> str:
    """A translation unit that compiles iff every dtype of cuep.params matches its C struct."""
    out = ["#include <cstddef>", '#include "ep/params.cuh"']
    for struct, dtype in params.C_STRUCTS.items():
        out += _asserts(struct, dtype)
    # nested members: the call part of the launch structs, field by field, at its offset in the whole struct
    for struct, dtype in (("DispatchParams", params.DISPATCH_PARAMS_DTYPE),
                          ("CombineParams", params.COMBINE_PARAMS_DTYPE)):
        base = dtype.fields["call"][1]
        for name in dtype["call"].names:
            off = base + dtype["call"].fields[name][1]
            out.append(f"static_assert(offsetof(cuep::{struct}, call.{name}) == {off}, \"{struct}.call.{name}\");")
    out.append("__global__ void cuep_params_layout_check() {}")
    return "\n".join(out) + "\n"


def test_layout_matches_header(tmp_path):
    if NVCC is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc not found: CI must check the parameter structs' layout")
        pytest.skip("nvcc not found")
    src = tmp_path / "params_layout.cu"
    src.write_text(layout_source())
    cmd = [NVCC, "-cubin", "-arch=sm_90", "--std=c++17", f"-I{_kernels.SRC_DIR}", "-o", str(tmp_path / "x.cubin"),
           str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


def test_layout_check_catches_a_moved_field(tmp_path):
    """The check is real: a dtype with two fields swapped does not compile."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    names = list(params.DISPATCH_ARGS_DTYPE.names)
    i, j = names.index("num_tokens"), names.index("phases")
    names[i], names[j] = names[j], names[i]
    bad = np.dtype([(n, params.DISPATCH_ARGS_DTYPE.fields[n][0]) for n in names], align=True)
    src = tmp_path / "bad.cu"
    src.write_text("\n".join(["#include <cstddef>", '#include "ep/params.cuh"', *_asserts("DispatchArgs", bad),
                              "__global__ void k() {}"]) + "\n")
    res = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "--std=c++17", f"-I{_kernels.SRC_DIR}", "-o",
                          str(tmp_path / "x.cubin"), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "DispatchArgs.phases" in res.stderr


def test_ep_params_record():
    values = {f: i * 3 + 1 for i, f in enumerate(params.EP_PARAMS_FIELDS)}
    values["peer_base"] = [0x7F0000000000 + 0x100000 * r for r in range(3)]
    values["rank"] = 2
    rec = params.ep_params(values)
    assert rec.dtype == params.EP_PARAMS_DTYPE and rec.shape == (1,)
    raw = np.frombuffer(rec.tobytes(), np.int64)
    n = len(params.EP_PARAMS_FIELDS)
    assert raw[0] == values["peer_base"][2]  # self_base: this rank's own buffer, first
    assert raw[1:n + 1].tolist() == [values[f] for f in params.EP_PARAMS_FIELDS]
    assert raw[n + 1:].tolist() == values["peer_base"] + [0] * (params.MAX_RANKS - 3)
    with pytest.raises(ValueError, match="rank=3 has no entry in peer_base"):
        params.ep_params({**values, "rank": 3})
    with pytest.raises(ValueError, match="missing fields"):
        params.ep_params({k: v for k, v in values.items() if k != "rank"})
    with pytest.raises(ValueError, match="unknown fields"):
        params.ep_params({**values, "bogus": 1})
    with pytest.raises(ValueError, match="at most 8 ranks"):
        params.ep_params({**values, "peer_base": list(range(9))})


def test_kernel_argument_is_the_record_bytes():
    ep = params.ep_params({**{f: 7 for f in params.EP_PARAMS_FIELDS}, "rank": 1, "peer_base": [1, 2]})
    names = params.DISPATCH_ARGS_DTYPE.names
    scalars = ("num_tokens", "global_scale", "phases")
    call = {n: i + 1 for i, n in enumerate(n for n in names if n not in scalars)}  # the pointers, x = 1
    rec = params.launch_record(params.DISPATCH_PARAMS_DTYPE, ep, **call, num_tokens=128, global_scale=0.5, phases=7)
    assert rec["call"]["global_scale"][0] == 0.5 and rec["call"]["phases"][0] == 7
    with pytest.raises(ValueError, match=r"missing fields \['phases'\]"):
        params.launch_record(params.DISPATCH_PARAMS_DTYPE, ep, **call, num_tokens=128, global_scale=0.5)
    with pytest.raises(ValueError, match=r"unknown fields \['bogus'\]"):
        params.launch_record(params.DISPATCH_PARAMS_DTYPE, ep, **call, num_tokens=1, global_scale=1, phases=1, bogus=1)
    arg = params.kernel_argument(rec)
    assert isinstance(arg, np.void) and arg.dtype.itemsize == params.DISPATCH_PARAMS_DTYPE.itemsize
    assert arg.tobytes() == rec.tobytes()
    call = params.DISPATCH_PARAMS_DTYPE.fields["call"][1]
    assert np.frombuffer(arg.tobytes()[call:call + 8], np.uint64)[0] == 1
    assert params.DISPATCH_PARAMS_DTYPE.itemsize <= 4096  # a kernel's parameter space


def test_pointer():
    assert params.pointer(None) == 0


@pytest.mark.parametrize("dtype", [params.DISPATCH_PARAMS_DTYPE, params.COMBINE_PARAMS_DTYPE])
def test_call_struct_packs_the_record_bytes(dtype):
    """A prepared launch packs the call part with params.call_struct: the same bytes as launch_record's."""
    ep = params.ep_params({**{f: 5 + i for i, f in enumerate(params.EP_PARAMS_FIELDS)}, "rank": 0,
                          "peer_base": [9, 10]})
    pack, offset, names = params.call_struct(dtype)
    assert offset == dtype.fields["call"][1] and pack.size == dtype["call"].itemsize
    values = {}
    for i, n in enumerate(names):
        kind = dtype["call"].fields[n][0]
        values[n] = 0.375 if kind == np.float32 else (0x7F0000001000 + 16 * i if kind == np.uint64 else i - 3)
    rec = params.launch_record(dtype, ep, **values)
    raw = bytearray(dtype.itemsize)
    raw[:offset] = ep.tobytes()
    pack.pack_into(raw, offset, *(values[n] for n in names))
    got = np.frombuffer(bytes(raw), dtype)  # field by field: launch_record leaves the struct's tail padding unset
    assert got["ep"].tobytes() == rec["ep"].tobytes()
    for n in names:
        assert got["call"][n][0] == rec["call"][n][0], n


@pytest.mark.parametrize("kind,dtype", [("dispatch", params.DISPATCH_PARAMS_DTYPE),
                                        ("combine", params.COMBINE_PARAMS_DTYPE)])
def test_call_span_repacks_only_the_call_fields(kind, dtype):
    """A prepared launch packs the whole call part once, then per call only the call's span at its start
    (params.CALL_FIELDS, params.span_struct): the bytes equal launch_record's, and the fixed fields after it are
    left as written."""
    ep = params.ep_params({**{f: 5 + i for i, f in enumerate(params.EP_PARAMS_FIELDS)}, "rank": 0,
                          "peer_base": [9, 10]})
    pack, offset, names = params.call_struct(dtype)
    call = params.CALL_FIELDS[kind]
    assert names[:len(call)] == call

    def value(n, i, salt):
        kind = dtype["call"].fields[n][0]
        return 0.375 * salt if kind == np.float32 else (0x7F0000001000 + 16 * (i + salt) if kind == np.uint64
                                                        else i - 3 + salt)

    first = {n: value(n, i, 1) for i, n in enumerate(names)}
    raw = bytearray(dtype.itemsize)
    raw[:offset] = ep.tobytes()
    pack.pack_into(raw, offset, *(first[n] for n in names))
    second = dict(first)
    s, off = params.span_struct(dtype, call)
    assert off == offset  # the call's span starts the call part
    vals = [value(n, names.index(n), 7) for n in call]
    second.update(zip(call, vals))
    s.pack_into(raw, off, *vals)
    got = np.frombuffer(bytes(raw), dtype)
    rec = params.launch_record(dtype, ep, **second)
    assert got["ep"].tobytes() == rec["ep"].tobytes()
    for n in names:
        assert got["call"][n][0] == rec["call"][n][0], n
    with pytest.raises(ValueError, match="not consecutive"):
        params.span_struct(dtype, (names[0], names[2]))
