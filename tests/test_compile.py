"""Every kernel file compiles for sm_90 with the runtime's source and options, warnings as errors (CPU).

CuPy compiles at run time with NVRTC and needs a GPU; here nvcc builds the same file with the same options
(cuep._kernels.compile_options plus the flags CuPy adds itself), so CI catches a broken kernel without a GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from cuep import _kernels, formats

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


@pytest.fixture(scope="module")
def nvcc():
    if NVCC is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc not found: CI must compile every kernel (install the CUDA 13 toolkit)")
        pytest.skip("nvcc not found")
    return NVCC


def test_there_are_kernel_files():
    assert "common.cuh" in {p.name for p in _kernels.SRC_DIR.iterdir()}
    assert _kernels.kernel_files(), "no .cu files in cuda_src"


@pytest.mark.parametrize("filename", _kernels.kernel_files())
def test_kernel_file_compiles_for_sm90(nvcc, filename, tmp_path):
    cmd = _kernels.nvcc_command(filename, out=str(tmp_path / "k.cubin"))
    cmd[0] = nvcc
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    msg = (res.stdout + res.stderr).strip()
    assert res.returncode == 0, f"{' '.join(cmd)}\n{msg}"
    assert "warning" not in msg.lower(), msg
    assert (tmp_path / "k.cubin").stat().st_size > 0


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:
        return False


@pytest.mark.parametrize("filename", _kernels.kernel_files())
def test_kernel_file_compiles_with_nvrtc(filename):
    """NVRTC is what CuPy uses at run time: it has no C++ standard library, so this catches what nvcc hides."""
    if not _nvrtc_available():
        if os.environ.get("CI"):
            pytest.fail("NVRTC not found: install the test extra (nvidia-cuda-nvrtc)")
        pytest.skip("NVRTC not found")
    cubin, log = _kernels.nvrtc_compile(filename)
    assert len(cubin) > 0
    assert "warning" not in log.lower(), log


def test_options_match_runtime():
    opts = _kernels.compile_options()
    assert not any(o.startswith("-arch") for o in opts), "CuPy adds -arch itself; a second one breaks NVRTC"
    assert f"-I{_kernels.SRC_DIR}" in opts
    assert any(o.startswith("-DCUEP_SRC_HASH=") for o in opts)
    cmd = _kernels.nvcc_command("x.cu")
    for o in (*opts, *_kernels.CUPY_IMPLICIT_OPTIONS, "-arch=sm_90"):
        assert o in cmd


def test_source_hash_covers_headers(tmp_path, monkeypatch):
    src = tmp_path / "cuda_src"
    shutil.copytree(_kernels.SRC_DIR, src)
    monkeypatch.setattr(_kernels, "SRC_DIR", src)
    _kernels.source_hash.cache_clear()
    before = _kernels.source_hash()
    try:
        assert _kernels.source_hash() == before
        (src / "common.cuh").write_text((src / "common.cuh").read_text() + "\n// edit\n")
        _kernels.source_hash.cache_clear()
        assert _kernels.source_hash() != before
    finally:
        _kernels.source_hash.cache_clear()


def _cuh_constants(text: str) -> dict[str, str]:
    return dict(re.findall(r"constexpr\s+(?:int|float|double|int64_t|uint64_t)\s+(k\w+)\s*=\s*([^;]+);", text))


def test_header_constants_match_python():
    common = _cuh_constants((_kernels.SRC_DIR / "common.cuh").read_text())
    assert int(common["kAlign"]) == formats.ALIGN
    from cuep import config

    ep_h = _cuh_constants((_kernels.SRC_DIR / "ep.cuh").read_text())
    assert int(ep_h["kNotifyRanges"]) == config.NOTIFY_RANGES  # sizes the dispatch scratch
    assert int(ep_h["kNotifyRanges"]) % 32 == 0  # the last notify block scans them a warp at a time
    assert int(ep_h["kMaxRanks"]) == config.MAX_GPUS_PER_NODE


def test_phase_and_knob_bits_are_apart():
    """ep.cuh's phase bits are cuep/ep.py's PHASE_*, and the measurement knobs (kKnob*) live above the low four
    bits, which cuep/ep.py keeps for the phases."""
    from cuep import ep

    c = _cuh_constants((_kernels.SRC_DIR / "ep.cuh").read_text())
    value = lambda s: eval(s, {})  # noqa: E731  ("1 << 8" and plain integers)
    assert (value(c["kPhaseNotify"]), value(c["kPhaseSend"]), value(c["kPhaseRecv"]), value(c["kPhaseLocalX"])) == (
        ep.PHASE_NOTIFY, ep.PHASE_SEND, ep.PHASE_RECV, ep.PHASE_LOCAL_X)
    knobs = {k: value(v) for k, v in c.items() if k.startswith("kKnob")}
    assert knobs and all(v >= 4 for v in knobs.values()), knobs  # a shift, or a bit of 0x10 and up
    bits = [value(c[k]) for k in ("kPhaseNotify", "kPhaseSend", "kPhaseRecv", "kPhaseLocalX")]
    assert sum(bits) == 15 and all(b < 0x10 for b in bits)  # the four low bits
    masks = [v for k, v in knobs.items() if not k.endswith("Shift")]
    assert len(set(masks)) == len(masks) and all(m & (m - 1) == 0 and m >= 0x10 for m in masks), knobs
    # the share (bits 10-14, 27-29) and poll (16-18) fields hold none of the single-bit knobs
    fields = (0x1F << value(c["kKnobSmallSendShift"])) | (0x7 << value(c["kKnobPollShift"])) | (
        0x7 << value(c["kKnobRecvShareShift"]))
    assert fields < 2**31
    assert not any(m & fields for m in masks), knobs


def test_param_block_matches_header():
    """cuep/buffer.py's PARAM_FIELDS and ep.cuh's enum Param list the same fields in the same order."""
    from cuep.buffer import PARAM_FIELDS

    text = (_kernels.SRC_DIR / "ep.cuh").read_text()
    body = text[text.index("enum Param : int {"):text.index("P_COUNT = P_PEER_BASE + 8")]
    names = re.findall(r"^\s*P_([A-Z0-9_]+),", body, re.M)
    want = [f.upper() for f in PARAM_FIELDS if not f.startswith("peer_base")] + ["PEER_BASE"]
    assert names == want
    assert len(PARAM_FIELDS) == len(names) - 1 + 8


def test_params_argument_is_the_struct_by_value():
    """The kernels take EPParams (P_COUNT int64) by value: the argument is exactly those bytes, in field order."""
    from cuep.buffer import PARAM_FIELDS, params_argument

    values = [(i + 1) * 0x0101010101 - (3 if i % 5 == 0 else 0) for i in range(len(PARAM_FIELDS))]
    arg = params_argument(values)
    assert isinstance(arg, np.void) and arg.dtype.itemsize == 8 * len(PARAM_FIELDS)
    assert np.frombuffer(arg.tobytes(), dtype=np.int64).tolist() == values
    with pytest.raises(ValueError, match="parameter values; expected"):
        params_argument(values[:-1])


def test_dynamic_shared_memory_opt_in(monkeypatch):
    """allow_dynamic_smem opts a kernel in only past 48 KiB (its static shared memory counted), once per size."""

    class FakeKernel:
        def __init__(self, static):
            self.shared_size_bytes = static
            self.sets = []

        @property
        def max_dynamic_shared_size_bytes(self):
            return self.sets[-1] if self.sets else 0

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, v):
            self.sets.append(v)

    monkeypatch.setattr(_kernels, "_smem_allowed", {})
    small, big = FakeKernel(0), FakeKernel(16 << 10)
    _kernels.allow_dynamic_smem(small, 40 << 10)
    assert small.sets == []                       # 40 KiB fit without opting in
    _kernels.allow_dynamic_smem(big, 40 << 10)
    assert big.sets == [40 << 10]                 # 16 KiB static + 40 KiB dynamic do not
    _kernels.allow_dynamic_smem(big, 32 << 10)
    _kernels.allow_dynamic_smem(big, 40 << 10)
    assert big.sets == [40 << 10]                 # asked once per size
    _kernels.allow_dynamic_smem(big, 128 << 10)
    assert big.sets == [40 << 10, 128 << 10]


def test_tuning_value_follows_extra_defines(monkeypatch):
    monkeypatch.setenv("CUEP_EXTRA_DEFINES", "CUEP_SILU_STAGES=3 CUEP_FLAG")
    assert _kernels.tuning_value("CUEP_SILU_STAGES", 2) == 3
    assert _kernels.tuning_value("CUEP_FLAG", 0) == 1
    assert _kernels.tuning_value("CUEP_COMBINE_RING", 2) == 2


# The measurement knobs and tuning overrides the kernels accept through CUEP_EXTRA_DEFINES (the measurements behind
# BENCHMARKS.md and docs/design.md used them): each must still compile, warnings as errors, so an A/B run on the GPU
# machine never starts with a broken build.
KNOBS = [
    ("dispatch.cu", "CUEP_AB_TRACE=1"),
    ("dispatch.cu", "CUEP_DISPATCH_ENCODE_STEPS=1"),
    ("combine.cu", "CUEP_AB_TRACE=1"),
    ("combine.cu", "CUEP_AB_COMBINE_LOCAL=1"),
    ("combine.cu", "CUEP_AB_COMBINE_NO_LOADS=1"),
    ("combine.cu", "CUEP_COMBINE_RING=1"),
    ("silu.cu", "CUEP_AB_NO_SCALE_STORES=1"),
]


@pytest.mark.parametrize("filename, define", KNOBS, ids=[f"{f}:{d}" for f, d in KNOBS])
def test_knobs_compile(nvcc, filename, define, tmp_path, monkeypatch):
    monkeypatch.setenv("CUEP_EXTRA_DEFINES", define)
    cmd = _kernels.nvcc_command(filename, out=str(tmp_path / "k.cubin"))
    assert f"-D{define}" in cmd
    cmd[0] = nvcc
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    msg = (res.stdout + res.stderr).strip()
    assert res.returncode == 0, f"{' '.join(cmd)}\n{msg}"
    assert "warning" not in msg.lower(), msg
