"""cuep.nvshmem without a GPU: finding NVSHMEM, the prelude, the device transport, the NVRTC + nvJitLink build and
its disk cache, the heap size, and the init/finalize reference count (against a stand-in for nvshmem4py).

Tests that need the nvshmem extra skip without it; the build test fails instead under ``CI`` (CI must prove that an
NVSHMEM kernel compiles and links), as tests/test_compile.py does for nvcc.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from cuep import nvshmem

HAVE_NVSHMEM = nvshmem.available()
needs_nvshmem = pytest.mark.skipif(not HAVE_NVSHMEM, reason=f"nvshmem extra not installed ({nvshmem.INSTALL_HINT})")

# a put-with-signal and its wait: the calls cuep's inter-node kernels make
PUT_SIGNAL = r'''
#include <nvshmem.h>
#include <nvshmemx.h>
extern "C" __global__ void put_signal(float* dst, const float* src, unsigned long long* sig, size_t n, int pe,
                                      unsigned long long value) {
    nvshmemx_float_put_signal_nbi_block(dst, src, n, sig, value, NVSHMEM_SIGNAL_SET, pe);
}
extern "C" __global__ void wait_signal(unsigned long long* sig, unsigned long long value) {
    if (threadIdx.x == 0) nvshmem_signal_wait_until(sig, NVSHMEM_CMP_GE, value);
}
'''


@pytest.fixture
def can_build():
    if not HAVE_NVSHMEM:
        if os.environ.get("CI"):
            pytest.fail(f"nvshmem extra not installed: CI must build an NVSHMEM kernel ({nvshmem.INSTALL_HINT})")
        pytest.skip("nvshmem extra not installed")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUEP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_root(tmp_path, version="3.4.5", rtc_drops_ibgda=False):
    """A stand-in nvidia-nvshmem folder: the version header and build options of NVSHMEM ``version``."""
    inc = tmp_path / "nvshmem" / "include"
    (inc / "non_abi").mkdir(parents=True)
    major, minor, patch = version.split(".")
    (inc / "non_abi" / "nvshmem_version.h").write_text(
        f"#define NVSHMEM_VENDOR_MAJOR_VERSION {major}\n#define NVSHMEM_VENDOR_MINOR_VERSION {minor}\n"
        f"#define NVSHMEM_VENDOR_PATCH_VERSION {patch}\n#define NVSHMEM_VENDOR_PACKAGE_VERSION 0\n")
    opts = "#pragma once\n#define NVSHMEM_IBGDA_SUPPORT\n#define NVSHMEM_GPUNETIO_SUPPORT\n"
    if rtc_drops_ibgda:  # what NVSHMEM 3.8's header says
        opts += ("#if defined(__CUDACC_RTC__) && (defined(NVSHMEM_ENABLE_ALL_DEVICE_INLINING) || \\\n"
                 "                              defined(__NVSHMEM_NUMBA_SUPPORT__))\n"
                 "#undef NVSHMEM_IBGDA_SUPPORT\n#undef NVSHMEM_IBGDA_SUPPORT_GPUMEM_ONLY\n"
                 "#undef NVSHMEM_GPUNETIO_SUPPORT\n#endif\n")
    (inc / "non_abi" / "nvshmem_build_options.h").write_text(opts)
    return inc.parent


def _rdma_dir(tmp_path):
    d = tmp_path / "rdma" / "include"
    (d / "infiniband").mkdir(parents=True)
    (d / "infiniband" / "mlx5dv.h").write_text("/* stand-in for rdma-core's header */\n")
    return d


# ---- what is installed ------------------------------------------------------------------------------------------
def test_import_is_light():
    code = ("import sys, cuep.nvshmem as n; n.available(); "
            "print(sorted(m for m in ('nvshmem', 'cuda.core', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_require_names_the_fix_and_the_caller(monkeypatch):
    monkeypatch.setattr(nvshmem, "available", lambda: False)
    with pytest.raises(ImportError) as e:
        nvshmem.require("cfg.n_nodes=2")
    msg = str(e.value)
    assert "cfg.n_nodes=2" in msg and 'pip install "cuep[nvshmem]"' in msg


def test_require_lists_what_is_missing(monkeypatch):
    monkeypatch.setattr(nvshmem, "_package_root", lambda: None)
    with pytest.raises(ImportError, match=r"nvidia-nvshmem .*cuep\[nvshmem\]"):
        nvshmem.require("cuep.nvshmem.init")
    with pytest.raises(ImportError, match=r"cuep\[nvshmem\]"):
        nvshmem.root()


@needs_nvshmem
def test_available_means_require_passes():
    nvshmem.require("a test")
    assert (nvshmem.root() / "include" / "nvshmem.h").is_file()
    assert (nvshmem.root() / "lib" / "libnvshmem_device.a").is_file()


@needs_nvshmem
def test_version_parses():
    v = nvshmem.version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", v), v
    assert tuple(int(x) for x in v.split(".")) >= (3, 4)


def test_version_from_the_header(tmp_path, monkeypatch):
    monkeypatch.setattr(nvshmem, "_package_root", lambda: _fake_root(tmp_path, "3.4.5"))
    assert nvshmem.version() == "3.4.5"


# ---- prelude, transport, options --------------------------------------------------------------------------------
UNDEFS = ("#undef NVSHMEM_IBGDA_SUPPORT\n", "#undef NVSHMEM_IBGDA_SUPPORT_GPUMEM_ONLY\n",
          "#undef NVSHMEM_GPUNETIO_SUPPORT\n")


@pytest.mark.parametrize("version, shim", [("3.4.5", True), ("3.3.24", True), ("3.5.19", False), ("3.8.0", False)])
@pytest.mark.parametrize("transport", ["proxy", "ibgda"])
def test_prelude(transport, version, shim):
    text = nvshmem.prelude(transport, version)
    lines = [ln for ln in text.splitlines() if not ln.startswith("//")]
    assert lines[0] == "#include <non_abi/nvshmem_build_options.h>"
    assert all((u in text) == (transport == "proxy") for u in UNDEFS)
    assert ("#include <cuda/std/type_traits>" in text) == shim
    assert ("using cuda::std::is_integral;" in text) == shim
    assert ("using cuda::std::is_unsigned;" in text) == shim
    assert "#include <nvshmem.h>" not in text  # the kernel file includes NVSHMEM itself


@pytest.mark.parametrize("bad", [dict(transport="nvlink"), dict(version="three")])
def test_prelude_rejects(bad):
    args = {"transport": "proxy", "version": "3.8.0"}
    args.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        nvshmem.prelude(**args)


def test_device_transport_without_rdma_headers(tmp_path, monkeypatch):
    monkeypatch.setattr(nvshmem, "_package_root", lambda: _fake_root(tmp_path, "3.4.5"))
    (tmp_path / "empty").mkdir()
    assert nvshmem.device_transport([str(tmp_path / "empty")]) == "proxy"
    assert nvshmem.device_transport([]) == "proxy"


def test_device_transport_with_rdma_headers(tmp_path, monkeypatch):
    monkeypatch.setattr(nvshmem, "_package_root", lambda: _fake_root(tmp_path, "3.4.5"))
    assert nvshmem.device_transport([str(tmp_path / "nowhere"), str(_rdma_dir(tmp_path))]) == "ibgda"


def test_device_transport_when_nvshmem_keeps_ibgda_from_nvrtc(tmp_path, monkeypatch):
    """NVSHMEM 3.8's own build options drop IBGDA for every NVRTC compile: rdma-core headers change nothing."""
    monkeypatch.setattr(nvshmem, "_package_root", lambda: _fake_root(tmp_path, "3.8.0", rtc_drops_ibgda=True))
    assert nvshmem.device_transport([str(_rdma_dir(tmp_path))]) == "proxy"


def test_device_transport_without_nvshmem(tmp_path, monkeypatch):
    monkeypatch.setattr(nvshmem, "_package_root", lambda: None)
    assert nvshmem.device_transport([str(_rdma_dir(tmp_path))]) == "proxy"


@needs_nvshmem
def test_include_paths():
    paths = nvshmem.include_paths()
    assert paths[0] == str(nvshmem.root() / "include")
    assert str(nvshmem._kernels.SRC_DIR) in paths and str(nvshmem.SRC_DIR) in paths
    assert ("/usr/include" in paths) == (nvshmem.device_transport() == "ibgda")
    assert len(paths) == len(set(paths))


@needs_nvshmem
def test_compile_options():
    o = nvshmem.compile_options("sm_90")
    assert o["arch"] == "sm_90" and o["relocatable_device_code"] is True and o["std"] == "c++17"
    assert o["ftz"] is True and o["device_as_default_execution_space"] is True
    assert "NVSHMEM_ENABLE_ALL_DEVICE_INLINING" in o["define_macro"]
    assert f"CUEP_SRC_HASH=0x{nvshmem._kernels.source_hash()}ULL" in o["define_macro"]
    assert o["include_path"] == nvshmem.include_paths()
    from cuda.core import ProgramOptions

    ProgramOptions(**o)  # every key is a field of cuda.core's options


@pytest.mark.parametrize("arch", ["90", "sm90", "", None])
def test_compile_options_rejects_arch(arch):
    with pytest.raises(ValueError, match="arch"):
        nvshmem.compile_options(arch)


# ---- build ------------------------------------------------------------------------------------------------------
def test_build_and_cache(can_build, cache, caplog):
    with caplog.at_level(logging.INFO, logger="cuep"):
        first = nvshmem.build("put_signal_test.cu", "sm_90", source=PUT_SIGNAL)
    data = first.read_bytes()
    assert first.parent == cache and data[:4] == b"\x7fELF" and len(data) > 1000
    compiling = [r.getMessage() for r in caplog.records if "compiling put_signal_test.cu" in r.getMessage()]
    assert len(compiling) == 1 and "NVSHMEM " + nvshmem.version() in compiling[0] and "sm_90" in compiling[0]
    assert any(" done in " in r.getMessage() and "(link " in r.getMessage() for r in caplog.records)

    caplog.clear()
    mtime = first.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="cuep"):
        second = nvshmem.build("put_signal_test.cu", "sm_90", source=PUT_SIGNAL)
    assert second == first and second.stat().st_mtime_ns == mtime
    assert not [r for r in caplog.records if "compiling" in r.getMessage()]  # a cache hit compiles nothing
    assert sorted(p.name for p in cache.iterdir()) == [first.name]  # no temporary files left


def test_build_reports_the_nvrtc_log(can_build, cache):
    bad = 'extern "C" __global__ void broken(int* x) { x[0] = undeclared_name; }\n'
    with pytest.raises(RuntimeError, match=r"(?s)NVRTC failed on broken\.cu.*undeclared_name"):
        nvshmem.build("broken.cu", source=bad)
    assert not list(cache.glob("*.cubin"))


@needs_nvshmem
def test_build_missing_file(cache):
    with pytest.raises(FileNotFoundError, match="no_such_kernel.cu"):
        nvshmem.build("no_such_kernel.cu")


# ---- the symmetric heap -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, nbytes", [("1073741824", 1 << 30), ("512M", 512 << 20), ("2g", 2 << 30),
                                          ("64K", 64 << 10), ("3G", 3 << 30)])
def test_heap_size_reads_the_environment(monkeypatch, text, nbytes):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", text)
    assert nvshmem.heap_size() == nbytes


def test_heap_size_default(monkeypatch):
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    assert nvshmem.heap_size() == nvshmem.DEFAULT_HEAP_BYTES == 1 << 30


def test_heap_bytes_needed_env_sets_it_when_unset(monkeypatch):
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    need = 3 * (1 << 30) + 12345
    got = nvshmem.heap_bytes_needed_env(need)
    assert got >= need + nvshmem.HEAP_RESERVE_BYTES and got % (2 << 20) == 0
    assert got - (need + nvshmem.HEAP_RESERVE_BYTES) < 2 << 20
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(got) and nvshmem.heap_size() == got


def test_heap_bytes_needed_env_keeps_the_users_setting(monkeypatch):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "2G")
    assert nvshmem.heap_bytes_needed_env(5 << 30) == 2 << 30  # the caller compares and explains
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == "2G"


@pytest.mark.parametrize("bad", [-1, 1.5, "1G", True])
def test_heap_bytes_needed_env_rejects(bad):
    with pytest.raises(ValueError, match="nbytes"):
        nvshmem.heap_bytes_needed_env(bad)


def test_bad_heap_size_in_the_environment(monkeypatch):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "lots")
    with pytest.raises(ValueError, match="NVSHMEM_SYMMETRIC_SIZE"):
        nvshmem.heap_size()


# ---- init / finalize (nvshmem4py and the devices stood in) ------------------------------------------------------
@pytest.mark.parametrize("call", [lambda: nvshmem.alloc(64), lambda: nvshmem.free(None),
                                  lambda: nvshmem.peer_address(None, 0), lambda: nvshmem.load("x.cu")])
def test_needs_init_first(call):
    pytest.importorskip("cupy")
    assert not nvshmem.is_initialized()
    with pytest.raises(RuntimeError, match=r"nvshmem\.init"):
        call()


class _FakeDevice:
    def __init__(self, i=0):
        self.device_id = i

    def use(self):
        pass

    def set_current(self):
        pass


@pytest.fixture
def fake_nvshmem(monkeypatch):
    """nvshmem4py, cuda.core.Device and cupy.cuda.Device stood in: records what init/finalize are asked."""
    pytest.importorskip("cupy")
    if not HAVE_NVSHMEM:
        pytest.skip("nvshmem extra not installed")
    import cupy
    import cuda.core

    calls = {"init": [], "finalize": 0, "uid_made": 0}

    def get_unique_id(empty=False):
        data = np.zeros(128, np.int8)
        if not empty:
            calls["uid_made"] += 1
            data[:] = np.arange(128) % 100
        return types.SimpleNamespace(_data=data)

    core = types.ModuleType("nvshmem.core")
    core.get_unique_id = get_unique_id
    core.init = lambda **kw: calls["init"].append(dict(kw, uid=kw["uid"]._data.copy()))
    core.n_pes = lambda: calls["init"][-1]["nranks"]
    core.finalize = lambda: calls.__setitem__("finalize", calls["finalize"] + 1)
    bindings = types.ModuleType("nvshmem.bindings")
    bindings.cumodule_finalize = lambda handle: 0
    pkg = types.ModuleType("nvshmem")
    pkg.core, pkg.bindings = core, bindings
    for name, mod in (("nvshmem", pkg), ("nvshmem.core", core), ("nvshmem.bindings", bindings)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(nvshmem, "available", lambda: True)  # the stand-ins have no import spec
    monkeypatch.setattr(cuda.core, "Device", _FakeDevice)
    monkeypatch.setattr(cupy.cuda, "Device", _FakeDevice)
    yield calls
    nvshmem._state.update(count=0, info=None, device=None)
    nvshmem._modules.clear()


def _group(rank, n_ranks, uid_from_rank0=None):
    def allgather(data, timeout_s=None):
        return [data] if n_ranks == 1 else [uid_from_rank0 if r == 0 else (data if r == rank else b"")
                                             for r in range(n_ranks)]
    return types.SimpleNamespace(ranks=[rank], n_ranks=n_ranks, allgather=allgather)


def test_init_is_counted(fake_nvshmem):
    info = nvshmem.init(_group(0, 1), device=0)
    assert set(info) >= {"version", "transport", "init_s", "pes"} and info["pes"] == 1 and info["init_s"] >= 0
    assert info["version"] == nvshmem.version() and info["transport"] in ("proxy", "ibgda")
    assert nvshmem.init(_group(0, 1), device=0) == info
    assert len(fake_nvshmem["init"]) == 1 and nvshmem.is_initialized()
    kw = fake_nvshmem["init"][0]
    assert kw["rank"] == 0 and kw["nranks"] == 1 and kw["initializer_method"] == "uid"
    with pytest.raises(ValueError, match="already initialised on device 0"):
        nvshmem.init(_group(0, 1), device=1)
    nvshmem.finalize()
    assert fake_nvshmem["finalize"] == 0 and nvshmem.is_initialized()
    nvshmem.finalize()
    assert fake_nvshmem["finalize"] == 1 and not nvshmem.is_initialized()
    nvshmem.finalize()  # unbalanced: nothing happens
    assert fake_nvshmem["finalize"] == 1


def test_init_takes_rank0s_unique_id(fake_nvshmem):
    uid = bytes(np.arange(128, dtype=np.int8) % 100)
    nvshmem.init(_group(2, 4, uid_from_rank0=uid), device=0)
    kw = fake_nvshmem["init"][0]
    assert fake_nvshmem["uid_made"] == 0  # only rank 0 makes one
    assert kw["rank"] == 2 and kw["nranks"] == 4 and kw["uid"].tobytes() == uid
    nvshmem.finalize()


def test_init_rejects_a_bad_unique_id(fake_nvshmem):
    with pytest.raises(RuntimeError, match="unique id"):
        nvshmem.init(_group(1, 2, uid_from_rank0=b"short"), device=0)
    assert not nvshmem.is_initialized() and not fake_nvshmem["init"]


def test_init_needs_one_rank_per_process(fake_nvshmem):
    group = types.SimpleNamespace(ranks=[0, 1], n_ranks=2, allgather=None)
    with pytest.raises(ValueError, match="one PE per process"):
        nvshmem.init(group, device=0)
    assert not nvshmem.is_initialized()
