"""Every kernel file compiles for sm_90 with the runtime's source and options, warnings as errors (CPU).

CuPy compiles at run time with NVRTC and needs a GPU; here nvcc builds the same file with the same options
(cuep._kernels.compile_options plus the flags CuPy adds itself), so CI catches a broken kernel without a GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys

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


UNITS = _kernels.kernel_units()
UNIT_IDS = [_kernels.unit_name(f, p) for f, p in UNITS]


def cubin_kernels(cubin: bytes) -> set[str]:
    """The kernels of an ELF cubin: the names of its ``.text.<kernel>`` sections."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    strtab = headers[names_at][4]

    def name(off: int) -> str:
        return cubin[strtab + off:cubin.index(b"\0", strtab + off)].decode()

    return {n[len(".text."):] for n in (name(h[0]) for h in headers) if n.startswith(".text.")}


def expected_part_kernels(filename: str, part: str) -> set[str]:
    """The kernels the runtime takes from one part (cuep/ep.py's names): dispatch.cu's, per format."""
    assert filename == "dispatch.cu", "a new parted file needs its kernel list here"
    names = set()
    for src in ("bf16", "f32"):
        names |= {f"cuep_dispatch_{part}_from_{src}", f"cuep_dispatch_local_{part}_from_{src}",
                  f"cuep_dispatch_local_large_{part}_from_{src}"}
        if (part, src) != ("bf16", "bf16"):  # (bf16 from bf16 has no split-layout kernel)
            names.add(f"cuep_dispatch_local_split_{part}_from_{src}")
    return names


def check_unit_kernels(filename: str, part, cubin: bytes) -> None:
    """A part holds exactly its kernels (each of which part_of sends to it); a whole file, at least one kernel."""
    kernels = cubin_kernels(cubin)
    assert kernels, f"{filename}: no kernels in the cubin"
    if part is not None:
        assert kernels == expected_part_kernels(filename, part), sorted(kernels)
        assert {_kernels.part_of(filename, k) for k in kernels} == {part}


@pytest.mark.parametrize("filename, part", UNITS, ids=UNIT_IDS)
def test_kernel_file_compiles_for_sm90(nvcc, filename, part, tmp_path):
    cmd = _kernels.nvcc_command(filename, out=str(tmp_path / "k.cubin"), part=part)
    cmd[0] = nvcc
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    msg = (res.stdout + res.stderr).strip()
    assert res.returncode == 0, f"{' '.join(cmd)}\n{msg}"
    assert "warning" not in msg.lower(), msg
    check_unit_kernels(filename, part, (tmp_path / "k.cubin").read_bytes())


def test_parts_cover_their_files():
    """Every file in PARTS is compiled part by part (no unit compiles it whole), each part's macro is its own, and
    a kernel name that names no part is refused with a message."""
    for filename, (prefix, parts) in _kernels.PARTS.items():
        assert [p for f, p in UNITS if f == filename] == list(parts)
        assert [_kernels.part_defines(filename, p) for p in parts] == [(f"{prefix}_{p.upper()}",) for p in parts]
        text = (_kernels.SRC_DIR / filename).read_text()
        assert all(f"defined({prefix}_{p.upper()})" in text for p in parts)
    assert _kernels.part_defines("dispatch.cu", None) == ()
    assert _kernels.part_of("combine.cu", "cuep_combine_bf16") is None
    assert _kernels.part_of("dispatch.cu", "cuep_dispatch_local_split_nvfp4_from_f32") == "nvfp4"
    with pytest.raises(ValueError, match="names none of its parts"):
        _kernels.part_of("dispatch.cu", "cuep_dispatch_whatever")
    with pytest.raises(ValueError, match="no part 'fp16'"):
        _kernels.part_defines("dispatch.cu", "fp16")
    with pytest.raises(ValueError, match="compiles whole"):
        _kernels.part_defines("combine.cu", "bf16")


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:
        return False


@pytest.mark.parametrize("filename, part", UNITS, ids=UNIT_IDS)
def test_kernel_file_compiles_with_nvrtc(filename, part):
    """NVRTC is what CuPy uses at run time: it has no C++ standard library, so this catches what nvcc hides."""
    if not _nvrtc_available():
        if os.environ.get("CI"):
            pytest.fail("NVRTC not found: install the test extra (nvidia-cuda-nvrtc)")
        pytest.skip("NVRTC not found")
    cubin, log = _kernels.nvrtc_compile(filename, part=part)
    assert "warning" not in log.lower(), log
    check_unit_kernels(filename, part, cubin)


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

    ep_h = _cuh_constants((_kernels.SRC_DIR / "ep" / "params.cuh").read_text())
    assert int(ep_h["kNotifyRanges"]) == config.NOTIFY_RANGES  # sizes the dispatch scratch
    assert int(ep_h["kNotifyRanges"]) % 32 == 0  # the last notify block scans them a warp at a time
    assert int(ep_h["kMaxRanks"]) == config.MAX_GPUS_PER_NODE
    state_h = _cuh_constants((_kernels.SRC_DIR / "ep" / "state.cuh").read_text())
    assert int(state_h["kLocalHistStride"]) == config.LOCAL_HIST_STRIDE  # sizes the counters region


def test_phase_bits_match_python():
    """params.cuh's phase bits are cuep/ep.py's PHASE_*, one bit each."""
    from cuep import ep

    c = _cuh_constants((_kernels.SRC_DIR / "ep" / "params.cuh").read_text())
    bits = tuple(int(c[k]) for k in ("kPhaseNotify", "kPhaseSend", "kPhaseRecv", "kPhaseLocalX"))
    assert bits == (ep.PHASE_NOTIFY, ep.PHASE_SEND, ep.PHASE_RECV, ep.PHASE_LOCAL_X)
    assert sorted(bits) == [1, 2, 4, 8]


def _sources() -> list:
    return sorted(p for p in _kernels.SRC_DIR.rglob("*") if p.suffix in (".cu", ".cuh"))


def test_no_measurement_switches_in_shipped_code():
    """Nothing a user sets changes what a kernel computes: no knob bits, no trace points, no environment-driven
    defines in the package (experiments live in a benchmark harness or a branch)."""
    pkg = _kernels.SRC_DIR.parent
    pattern = re.compile(r"kKnob|CUEP_EP_KNOBS|CUEP_AB_|CUEP_EXTRA_DEFINES|CUEP_TRACE")
    hits = [f"{p.relative_to(pkg)}:{i + 1}" for p in [*_sources(), *pkg.rglob("*.py")]
            for i, line in enumerate(p.read_text().splitlines()) if pattern.search(line)]
    assert not hits, hits


def test_kernel_sources_are_split_by_concern():
    """No kernel source file above 600 lines, and every one starts with a comment that says what it holds."""
    for p in _sources():
        lines = p.read_text().splitlines()
        assert len(lines) <= 600, f"{p.name}: {len(lines)} lines"
        assert lines[0].startswith("//"), f"{p.name} has no header comment"


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


def test_environment_does_not_change_the_build(monkeypatch):
    """The compile options depend on the sources alone; a variant's defines are an explicit argument."""
    before = _kernels.compile_options()
    monkeypatch.setenv("CUEP_EXTRA_DEFINES", "CUEP_QUANT_STEPS=1")
    assert _kernels.compile_options() == before
    assert _kernels.compile_options(("CUEP_QUANT_STEPS=1",))[-1] == "-DCUEP_QUANT_STEPS=1"


def test_spills_are_errors():
    """The CPU compile test fails on any register spill: ptxas reports them as warnings, made errors."""
    cmd = _kernels.nvcc_command("combine.cu")
    assert cmd[cmd.index("-Xptxas") + 1] == "-warn-spills"
    assert "-Werror" in cmd and cmd[cmd.index("-Werror") + 1] == "all-warnings"


# The benchmark variants of the kernels' tuning constants (speed only, never results): each must still compile,
# warnings and spills as errors, so a harness run on the GPU machine never starts with a broken build.
VARIANTS = [
    ("dispatch.cu", "CUEP_DISPATCH_ENCODE_STEPS=2"),
    ("quantize.cu", "CUEP_QUANT_STEPS=1"),
]


@pytest.mark.parametrize("filename, define", VARIANTS, ids=[f"{f}:{d}" for f, d in VARIANTS])
def test_tuning_variants_compile(nvcc, filename, define, tmp_path):
    cmd = _kernels.nvcc_command(filename, out=str(tmp_path / "k.cubin"))
    cmd[0] = nvcc
    cmd.insert(cmd.index("-Werror"), f"-D{define}")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    msg = (res.stdout + res.stderr).strip()
    assert res.returncode == 0, f"{' '.join(cmd)}\n{msg}"
    assert "warning" not in msg.lower(), msg


def test_runtime_units_are_what_calls_compile():
    """compile_kernels' units: dispatch.cu's parts of the formats asked for (longest first), combine.cu, and with
    ops the ops' files; never bench.cu (cuep.bench's own). A bad format is refused naming the argument."""
    every = _kernels.runtime_units()
    assert every[:4] == [("dispatch.cu", p) for p in ("bf16", "fp8", "nvfp4", "mxfp4")]
    assert {f for f, _ in every} == set(_kernels.kernel_files()) - {"bench.cu"}
    assert _kernels.runtime_units("fp8", ops=False) == [("dispatch.cu", "fp8"), ("combine.cu", None)]
    assert _kernels.runtime_units(["nvfp4", "mxfp4"], ops=False)[:2] == [("dispatch.cu", "nvfp4"), ("dispatch.cu", "mxfp4")]
    for bad in (["fp16"], [], "int8"):
        with pytest.raises(ValueError, match="formats"):
            _kernels.runtime_units(bad)


def test_compile_kernels_runs_units_at_once_and_reports_every_failure_after(monkeypatch):
    """Units compile in parallel threads (a fake compile here: no GPU), every unit is named in the result, and a
    failing unit raises only once the others have finished."""
    import threading
    import time as _time

    active, peak, done = [0], [0], []
    guard = threading.Lock()

    def fake(unit, device):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        _time.sleep(0.05)
        with guard:
            active[0] -= 1
            done.append(unit)
        if unit == ("silu.cu", None) and fail[0]:
            raise RuntimeError("nvrtc: error")
        return 0.05

    monkeypatch.setattr(_kernels, "_compile_unit", fake)
    fail = [False]
    times = _kernels.compile_kernels(device=0, jobs=4)
    assert list(times) == [_kernels.unit_name(*u) for u in _kernels.runtime_units()]
    assert "dispatch.cu[nvfp4]" in times and peak[0] == 4
    fail[0], done[:] = True, []
    with pytest.raises(RuntimeError, match=r"silu.cu failed \(1 of 8") as e:
        _kernels.compile_kernels(device=0, jobs=2)
    assert isinstance(e.value.__cause__, RuntimeError) and len(done) == 8
    with pytest.raises(ValueError, match="formats"):
        _kernels.compile_kernels(["fp16"], device=0)


def test_cli_compile_without_a_gpu_says_so():
    res = subprocess.run([sys.executable, "-m", "cuep", "--compile"], capture_output=True, text=True, timeout=120,
                         cwd=_kernels.SRC_DIR.parents[1])
    if "needs an NVIDIA GPU" not in res.stderr:
        pytest.skip("a GPU is present: tests/test_compile_gpu.py runs the real compile")
    assert res.returncode == 2
