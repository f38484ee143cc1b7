"""NVSHMEM from the host: find it, build kernels against it, start it, and allocate on its symmetric heap.

The one place cuep touches NVSHMEM from Python (the ``nvshmem`` extra: ``pip install "cuep[nvshmem]"``). Nothing
heavy is imported with this module: ``nvshmem``, ``cuda.core`` and ``cupy`` are imported inside the functions.

Lifecycle (one process per GPU, one NVSHMEM PE per process):

1. :func:`heap_bytes_needed_env` (optional, before :func:`init`): size the symmetric heap for what will be
   allocated, unless the user set ``NVSHMEM_SYMMETRIC_SIZE``.
2. :func:`init` on every rank: rank 0 makes a unique id, the group's all-gather carries it to the others, and every
   rank joins (UID bootstrap; no MPI needed).
3. :func:`load` a kernel file of ``cuep/cuda_src/nvshmem/``: compiled with NVRTC and linked with nvJitLink against
   ``libnvshmem_device.a`` (no nvcc at run time; :func:`build`), cached on disk, registered with NVSHMEM.
4. :func:`alloc` / :func:`free` symmetric arrays (collective), :func:`peer_address` for load/store peers.
5. :func:`shutdown` on every rank (``Group.close`` does it: NVSHMEM, once started, lives as long as the group, so
   later Buffers reuse it; :func:`finalize` balances one :func:`init`).

Kernel files stay plain CUDA: cuep prepends a short :func:`prelude` (which device transports to compile, and a
shim for old NVSHMEM headers under NVRTC) before the file's own ``#include <nvshmem.h>``.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import threading
import time
from pathlib import Path

from . import _kernels

log = logging.getLogger("cuep")

#: Kernel files compiled against NVSHMEM (one module per file).
SRC_DIR = _kernels.SRC_DIR / "nvshmem"

#: The command that installs everything this module needs.
INSTALL_HINT = 'pip install "cuep[nvshmem]"'

#: NVSHMEM's symmetric heap per PE when ``NVSHMEM_SYMMETRIC_SIZE`` is unset (its documented default, 1 GiB).
DEFAULT_HEAP_BYTES = 1 << 30

#: Heap that :func:`heap_bytes_needed_env` adds to the caller's need: NVSHMEM keeps its own objects (team sync
#: arrays, collective scratch, signals) on the same heap, and each allocation is aligned.
HEAP_RESERVE_BYTES = 128 << 20

_HEAP_GRANULE = 2 << 20  # heap sizes are rounded up to whole 2 MiB pages
_SIZE_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRANSPORTS = ("proxy", "ibgda")
# NVSHMEM < 3.5 headers name these std:: traits, which NVRTC (no C++ standard library) lacks
_STD_SHIM_NAMES = ("integral_constant", "true_type", "false_type", "enable_if", "conditional", "is_same",
                   "is_integral", "is_signed", "is_unsigned", "is_floating_point")


# ---- what is installed ----------------------------------------------------------------------------------------------
def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _package_root() -> Path | None:
    """The nvidia-nvshmem package folder (``include/nvshmem.h`` and ``lib/libnvshmem_device.a``), or None."""
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(d)
        if (p / "include" / "nvshmem.h").is_file() and (p / "lib" / "libnvshmem_device.a").is_file():
            return p
    return None


def _missing() -> list[str]:
    """What of the nvshmem extra is not installed (empty when everything is)."""
    missing = []
    if not _has_module("nvshmem"):
        missing.append("nvshmem4py (import nvshmem)")
    if _package_root() is None:
        missing.append("nvidia-nvshmem (headers and libnvshmem_device.a)")
    if not _has_module("cuda.core"):
        missing.append("cuda-core (import cuda.core)")
    return missing


def available() -> bool:
    """True when nvshmem4py, the nvidia-nvshmem package (headers + ``libnvshmem_device.a``) and cuda.core are
    installed (nothing is imported or loaded to find out)."""
    return not _missing()


def require(what: str) -> None:
    """Raise ImportError unless :func:`available`, naming what is missing, what needs it (``what``, e.g.
    ``"cfg.n_nodes=2"``) and the fix (:data:`INSTALL_HINT`)."""
    if available():
        return
    missing = _missing() or ["the NVSHMEM packages"]
    raise ImportError(f"{what} needs NVSHMEM, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                      f"not installed: {INSTALL_HINT}")


def root() -> Path:
    """The nvidia-nvshmem package root (``include/``, ``lib/``). Raises ImportError when it is not installed."""
    p = _package_root()
    if p is None:
        raise ImportError(f"the nvidia-nvshmem package (NVSHMEM headers and libnvshmem_device.a) is not installed: "
                          f"{INSTALL_HINT}")
    return p


def version() -> str:
    """The NVSHMEM library version, e.g. ``"3.4.5"``: from ``include/non_abi/nvshmem_version.h``, else the
    package metadata of nvidia-nvshmem."""
    return _version_at(str(root()))


@functools.lru_cache(maxsize=None)
def _version_at(root_dir: str) -> str:
    header = Path(root_dir) / "include" / "non_abi" / "nvshmem_version.h"
    if header.is_file():
        text = header.read_text(errors="replace")
        parts = [re.search(rf"^\s*#\s*define\s+NVSHMEM_VENDOR_{k}_VERSION\s+(\d+)", text, re.M)
                 for k in ("MAJOR", "MINOR", "PATCH")]
        if all(parts):
            return ".".join(m.group(1) for m in parts)
    from importlib import metadata

    for dist in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    raise RuntimeError(f"cannot tell the NVSHMEM version: no NVSHMEM_VENDOR_*_VERSION in {header} and no "
                       f"nvidia-nvshmem package metadata")


def _version_tuple(v: str) -> tuple[int, ...]:
    nums = re.findall(r"\d+", v)
    if len(nums) < 2:
        raise ValueError(f"version={v!r} is not an NVSHMEM version like '3.4.5'")
    return tuple(int(x) for x in nums[:3])


# ---- include paths and the device transport -------------------------------------------------------------------------
def _cuda_include_dirs() -> list[str]:
    """CUDA's include folders (``$CUDA_PATH`` or /usr/local/cuda, its ``targets/*/include``, and the ``nvidia.cu13``
    pip package), each followed by its ``cccl`` subfolder when present; duplicates (symlinks) dropped."""
    base = Path(os.environ.get("CUDA_PATH") or "/usr/local/cuda")
    cands = [base / "include", *sorted(base.glob("targets/*/include"))]
    try:
        spec = importlib.util.find_spec("nvidia.cu13")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        cands += [Path(d) / "include" for d in spec.submodule_search_locations or []]
    out, seen = [], set()
    for d in cands:
        for p in (d, d / "cccl"):
            if p.is_dir() and p.resolve() not in seen:
                seen.add(p.resolve())
                out.append(str(p))
    return out


def _rdma_include_dir(include_dirs) -> str | None:
    for d in include_dirs:
        if (Path(d) / "infiniband" / "mlx5dv.h").is_file():
            return str(d)
    return None


def _nvrtc_drops_ibgda(nvshmem_root: Path) -> bool:
    """True when NVSHMEM's own build options turn IBGDA off for every NVRTC compile (3.8 does:
    ``#if defined(__CUDACC_RTC__) && defined(NVSHMEM_ENABLE_ALL_DEVICE_INLINING) ... #undef NVSHMEM_IBGDA_SUPPORT``),
    or never build it in."""
    p = nvshmem_root / "include" / "non_abi" / "nvshmem_build_options.h"
    if not p.is_file():
        return True
    text = p.read_text(errors="replace").replace("\\\n", " ")  # join continued directive lines
    if not re.search(r"^\s*#\s*define\s+NVSHMEM_IBGDA_SUPPORT\b", text, re.M):
        return True
    # an '#if' on NVRTC and the all-inlining macro whose block undefines IBGDA
    for m in re.finditer(r"^\s*#\s*if\b([^\n]*)\n(.*?)^\s*#\s*endif", text, re.M | re.S):
        cond, body = m.group(1), m.group(2)
        if ("defined(__CUDACC_RTC__)" in cond.replace(" ", "") and "NVSHMEM_ENABLE_ALL_DEVICE_INLINING" in cond
                and re.search(r"#\s*undef\s+NVSHMEM_IBGDA_SUPPORT\b", body)):
            return True
    return False


def device_transport(include_dirs: list[str] | None = None) -> str:
    """How cuep's NVSHMEM kernels reach a PE on another node: ``"ibgda"`` or ``"proxy"``.

    ``"ibgda"`` (the GPU itself drives the NIC) needs NVSHMEM's IBGDA device code, which includes the rdma-core
    header ``infiniband/mlx5dv.h``. It is chosen when that header is found in ``include_dirs`` (default: /usr/include
    and CUDA's include folders) and the installed NVSHMEM headers keep IBGDA under NVRTC (NVSHMEM 3.8 turns it off
    for every NVRTC compile). Otherwise ``"proxy"``: the device code is compiled without IBGDA and remote puts go
    through NVSHMEM's CPU proxy thread (IB RC / UCX / libfabric transports of the host library). Intra-node peers
    are reached by NVLink load/store either way. The rdma-core headers come with ``libibverbs-dev`` (Debian/Ubuntu)
    or ``rdma-core-devel`` (RHEL), but NVRTC cannot parse what they include (glibc, x86 intrinsics), so in practice
    the build falls back to ``"proxy"`` (:func:`build`; ``docs/internode.md``). With ``"proxy"`` kernels leave
    ``NVSHMEM_IB_ENABLE_IBGDA`` unset. After :func:`build` found that NVRTC cannot compile the IBGDA code, the
    default answer is ``"proxy"``.
    """
    if include_dirs is None and _ibgda_failed:
        return "proxy"  # build() found that NVRTC cannot compile the IBGDA code here
    dirs = ["/usr/include", *_cuda_include_dirs()] if include_dirs is None else list(include_dirs)
    if _rdma_include_dir(dirs) is None:
        return "proxy"
    try:
        nv_root = root()
    except ImportError:
        return "proxy"
    return "proxy" if _nvrtc_drops_ibgda(nv_root) else "ibgda"


def include_paths() -> list[str]:
    """NVRTC's include path for an NVSHMEM kernel: NVSHMEM's headers, CUDA's (with CCCL), cuep's ``cuda_src``
    (``#include "ep/params.cuh"``) and ``cuda_src/nvshmem`` (so ``#include "../common.cuh"`` resolves from the main
    file too), and the rdma-core headers' folder only when :func:`device_transport` is ``"ibgda"``."""
    paths = [str(root() / "include"), *_cuda_include_dirs(), str(_kernels.SRC_DIR), str(SRC_DIR)]
    if device_transport() == "ibgda":
        d = _rdma_include_dir(["/usr/include", *_cuda_include_dirs()])
        if d not in paths:
            paths.append(d)
    return paths


def compile_options(arch: str = "sm_90") -> dict:
    """The ``cuda.core.ProgramOptions`` keyword arguments of every NVSHMEM kernel build.

    Relocatable device code (linked against ``libnvshmem_device.a``), C++17, ``-ftz=true`` like cuep's other
    kernels, ``NVSHMEM_ENABLE_ALL_DEVICE_INLINING`` (the transfer code comes from the headers; without it the link
    misses ``nvshmemi_transfer_*``), ``CUEP_SRC_HASH`` (the ``cuda_src`` tree, as :func:`cuep._kernels.compile_options`)
    and ``device_as_default_execution_space`` (NVSHMEM 3.4 headers need it under NVRTC; 3.8 compiles the same).
    """
    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"arch={arch!r} must name a GPU architecture like 'sm_90'")
    return dict(arch=arch, relocatable_device_code=True, std="c++17", ftz=True,
                device_as_default_execution_space=True, include_path=include_paths(),
                define_macro=["NVSHMEM_ENABLE_ALL_DEVICE_INLINING", f"CUEP_SRC_HASH=0x{_kernels.source_hash()}ULL"])


def prelude(transport: str, version: str) -> str:
    """The lines cuep puts before a kernel file: NVSHMEM's build options, minus the device transports NVRTC
    cannot compile (``transport="proxy"``: IBGDA and GPUNetIO need ``infiniband/mlx5dv.h``), and for NVSHMEM
    ``version`` < 3.5 the ``std::`` type traits its headers use, taken from ``<cuda/std/type_traits>``."""
    if transport not in _TRANSPORTS:
        raise ValueError(f"transport={transport!r} must be one of {_TRANSPORTS}")
    lines = ["// cuep prelude (cuep/nvshmem.py)", "#include <non_abi/nvshmem_build_options.h>"]
    if transport == "proxy":
        lines += ["#undef NVSHMEM_IBGDA_SUPPORT", "#undef NVSHMEM_IBGDA_SUPPORT_GPUMEM_ONLY",
                  "#undef NVSHMEM_GPUNETIO_SUPPORT"]
    if _version_tuple(version) < (3, 5):
        lines += ["#include <cuda/std/type_traits>",
                  "namespace std { " + " ".join(f"using cuda::std::{n};" for n in _STD_SHIM_NAMES) + " }"]
    return "\n".join(lines) + "\n"


# ---- build ----------------------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where linked cubins are kept: ``$CUEP_CACHE_DIR``, else ``~/.cache/cuep/nvshmem``."""
    d = os.environ.get("CUEP_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "cuep" / "nvshmem"


def _toolchain() -> str:
    """NVRTC and nvJitLink versions (a new compiler is a new cache entry)."""
    parts = []
    try:
        from cuda.bindings import nvjitlink, nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        parts.append(f"nvrtc{major}.{minor}")
        parts.append("nvjitlink%d.%d" % nvjitlink.version())
    except Exception:  # noqa: BLE001 (an old cuda-bindings: the cache key just carries less)
        pass
    return ",".join(parts)


def build(filename: str, arch: str = "sm_90", name_expressions=(), source: str | None = None) -> Path:
    """Compile ``cuda_src/nvshmem/<filename>`` for ``arch`` and link it against NVSHMEM; the linked cubin's path.

    NVRTC (``cuda.core.Program``) compiles :func:`prelude` + the file to a relocatable cubin with
    :func:`compile_options`; nvJitLink (``cuda.core.Linker``) links it with ``libnvshmem_device.a``. The cubin is
    kept in :func:`cache_dir` under a SHA-256 of everything that decides it (source, ``cuda_src`` hash, NVSHMEM
    version, transport, arch, options, compiler versions) and reused from there. When :func:`device_transport` says
    ``"ibgda"`` but NVRTC cannot compile NVSHMEM's IBGDA code (the rdma-core headers pull in glibc and x86
    intrinsics headers NVRTC cannot parse), it warns once and builds ``"proxy"``; :func:`device_transport` then
    answers ``"proxy"`` for the rest of the process.

    Args:
        filename: a file of ``cuda_src/nvshmem/`` (its kernels ``extern "C"``), or only a name when ``source`` is
            given.
        arch: the GPU architecture, ``"sm_90"``.
        name_expressions: template instantiations to compile (passed to NVRTC; cuep's kernels are ``extern "C"``
            and need none).
        source: the kernel text itself instead of the file (tests).

    Raises:
        ImportError: the nvshmem extra is not installed.
        FileNotFoundError: no such file.
        RuntimeError: NVRTC or nvJitLink failed (their log in the message).
    """
    require(f"cuep.nvshmem.build({filename!r})")
    if source is None:
        path = SRC_DIR / filename
        if not path.is_file():
            raise FileNotFoundError(f"no NVSHMEM kernel file {filename!r} in {SRC_DIR}")
        source, program_name = path.read_text(), str(path)
    else:
        program_name = filename
    if device_transport() == "ibgda":
        try:
            return _build(filename, program_name, source, arch, tuple(name_expressions), "ibgda")
        except _CompileError as e:
            _ibgda_failed.append(str(e))
            log.warning("cuep: NVRTC cannot compile NVSHMEM's IBGDA device code here; building %s with the proxy "
                        "transport instead (remote puts through NVSHMEM's CPU proxy). NVRTC said:\n%s",
                        filename, "\n".join(str(e).splitlines()[1:6]))
    return _build(filename, program_name, source, arch, tuple(name_expressions), "proxy")


class _CompileError(RuntimeError):
    """NVRTC rejected the source (as opposed to a link failure)."""


_ibgda_failed: list[str] = []  # why IBGDA did not compile in this process (empty: it did, or was not tried)


def _build(filename: str, program_name: str, source: str, arch: str, name_expressions: tuple, transport: str) -> Path:
    ver = version()
    opts = compile_options(arch)
    pre = prelude(transport, ver)
    lib = root() / "lib" / "libnvshmem_device.a"
    h = hashlib.sha256()
    for part in (pre, source, _kernels.source_hash(), ver, transport, arch, repr(sorted(opts.items())),
                 repr(name_expressions), str(lib.stat().st_size), _toolchain()):
        h.update(part.encode())
        h.update(b"\0")
    out = cache_dir() / f"{Path(filename).stem}.{arch}.{transport}.{h.hexdigest()[:24]}.cubin"
    failed = out.with_suffix(".nvrtc-log")  # a failed compile of exactly this input is not tried again
    if out.is_file() and out.stat().st_size > 0:
        return out
    if failed.is_file():
        raise _CompileError(f"NVRTC failed on {filename} (NVSHMEM {ver}, transport {transport}, {arch}; "
                            f"remembered in {failed}):\n{failed.read_text(errors='replace')}")

    from cuda.core import Linker, LinkerOptions, ObjectCode, Program, ProgramOptions

    log.info("cuep: compiling %s against NVSHMEM %s (%s) for %s ...", filename, ver, transport, arch)
    t0 = time.perf_counter()
    # '#line' keeps NVRTC's messages on the file's own line numbers
    text = f'{pre}#line 1 "{program_name}"\n{source}'
    prog = Program(text, "c++", options=ProgramOptions(name=program_name, **opts))
    logs = _Log()
    try:
        obj = prog.compile("cubin", name_expressions=name_expressions, logs=logs)
    except Exception as e:
        detail = logs.text() or str(e)
        if transport == "ibgda":
            _write_atomic(failed, detail.encode())
        raise _CompileError(f"NVRTC failed on {filename} (NVSHMEM {ver}, transport {transport}, {arch}):\n"
                            f"{detail}") from e
    t1 = time.perf_counter()
    linker = Linker(obj, ObjectCode.from_library(str(lib)), options=LinkerOptions(arch=arch))
    try:
        cubin = bytes(linker.link("cubin").code)
    except Exception as e:
        detail = ""
        try:
            detail = linker.get_error_log()
        except Exception:  # noqa: BLE001
            pass
        raise RuntimeError(f"nvJitLink failed to link {filename} with {lib} ({arch}):\n{detail or e}") from e
    t2 = time.perf_counter()
    _write_atomic(out, cubin)
    log.info("cuep: %s done in %.1f s (link %.1f s), cached in %s", filename, t2 - t0, t2 - t1, out.parent)
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (ranks building the same file at once each write a complete copy)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class _Log:
    """A ``write``-able sink for cuda.core's compile log."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, s) -> None:
        self.parts.append(s.decode(errors="replace") if isinstance(s, (bytes, bytearray)) else str(s))

    def text(self) -> str:
        return "".join(self.parts).strip()


# ---- the runtime ----------------------------------------------------------------------------------------------------
_lock = threading.RLock()
_state: dict = {"count": 0, "info": None, "device": None}
_modules: dict[tuple, tuple] = {}  # (file, device) -> (cupy.RawModule, CUmodule handle registered with NVSHMEM)


def is_initialized() -> bool:
    """True between a first :func:`init` and the :func:`finalize` that balances it."""
    return _state["count"] > 0


def init(group, device: int, timeout_s: float = 60.0) -> dict:
    """Start NVSHMEM in this process (one PE per process) with the UID bootstrap, or count one more user.

    Collective over ``group`` (a :class:`cuep.Group` of kind ``"ipc"``, one rank per process, or a one-rank
    group): rank 0 makes the unique id and ``group.allgather`` carries it to every rank (bounded by ``timeout_s``;
    NVSHMEM's own join has no bound of cuep's). PE number = ``group.ranks[0]``, PEs = ``group.n_ranks``.
    Calling it again counts a reference (same device required); :func:`finalize` ends NVSHMEM at the last.

    Returns:
        ``{"version": str, "transport": "proxy" | "ibgda", "init_s": float (seconds the first init took),
        "pes": int}``
    """
    with _lock:
        if _state["count"] > 0:
            if int(device) != _state["device"]:
                raise ValueError(f"device={device!r}: NVSHMEM is already initialised on device {_state['device']} "
                                 f"in this process (one PE per process)")
            _state["count"] += 1
            return dict(_state["info"])
        require("cuep.nvshmem.init")
        if len(group.ranks) != 1:
            raise ValueError(f"group drives {len(group.ranks)} ranks in this process: NVSHMEM has one PE per "
                             f"process (start one process per GPU: cuep.init_distributed / python -m cuep.run)")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        import cupy
        import numpy as np
        import nvshmem.core as nv
        from cuda.core import Device

        t0 = time.perf_counter()
        rank, n_ranks = int(group.ranks[0]), int(group.n_ranks)
        cupy.cuda.Device(int(device)).use()
        dev = Device(int(device))
        dev.set_current()
        uid = nv.get_unique_id(empty=(rank != 0))
        raw = uid._data.view(np.int8)  # nvshmemx_uniqueid_t: 128 bytes
        parts = group.allgather(raw.tobytes() if rank == 0 else b"", timeout_s)
        sent = [p for p in parts if p]
        if len(sent) != 1 or len(sent[0]) != raw.nbytes:
            raise RuntimeError(f"NVSHMEM unique id exchange: expected one {raw.nbytes}-byte id from rank 0, got "
                               f"{[len(p) for p in parts]} bytes per rank")
        if rank != 0:
            raw[:] = np.frombuffer(sent[0], np.int8)
        nv.init(device=dev, uid=uid, rank=rank, nranks=n_ranks, initializer_method="uid")
        info = {"version": version(), "transport": device_transport(), "init_s": time.perf_counter() - t0,
                "pes": int(nv.n_pes()), "heap_bytes": heap_size()}
        _state.update(count=1, info=info, device=int(device))
        log.info("cuep: NVSHMEM %s started, PE %d of %d on device %d (%s transport, heap %.0f MiB) in %.2f s",
                 info["version"], rank, info["pes"], int(device), info["transport"], info["heap_bytes"] / 2**20,
                 info["init_s"])
        return dict(info)


def finalize() -> None:
    """Balance one :func:`init`; the last one unregisters the loaded modules and ends NVSHMEM (collective then).
    A call without a matching init does nothing."""
    with _lock:
        if _state["count"] == 0:
            return
        _state["count"] -= 1
        if _state["count"] > 0:
            return
        import nvshmem.core as nv
        from nvshmem import bindings

        try:
            for _, handle in _modules.values():
                bindings.cumodule_finalize(handle)
        finally:
            _modules.clear()
            _state.update(info=None, device=None)
            nv.finalize()


def barrier_all() -> None:
    """Every PE's NVSHMEM operations so far are complete (remote puts and signals delivered, the proxy's included)
    and every PE is here: ``nvshmemx_barrier_all_on_stream`` on the current CuPy stream, then a stream sync.
    Collective over all PEs (``Buffer.reset`` calls it before re-arming the signals)."""
    _require_init("cuep.nvshmem.barrier_all")
    import cupy
    import nvshmem.core as nv

    stream = cupy.cuda.get_current_stream()
    nv.barrier_all(stream=stream)
    stream.synchronize()


def shutdown() -> None:
    """End NVSHMEM in this process whatever the count of :func:`init` calls (``Group.close``: NVSHMEM, once started,
    lives as long as the group, so a later Buffer reuses it). Collective over the PEs, like NVSHMEM's finalize."""
    with _lock:
        if _state["count"] > 0:
            _state["count"] = 1
            finalize()


def _require_init(what: str) -> None:
    if _state["count"] == 0:
        raise RuntimeError(f"{what} needs NVSHMEM started: call cuep.nvshmem.init(group, device) first")


def load(filename: str, first_kernel: str | None = None):
    """The ``cupy.RawModule`` of ``cuda_src/nvshmem/<filename>`` for the current device, built (:func:`build`)
    for its architecture, loaded and registered with NVSHMEM (``nvshmemx_cumodule_init``); cached per (file,
    device). ``first_kernel``: a kernel of the file to look up first (checks that it is there). Needs :func:`init`.
    """
    import cupy

    _require_init(f"cuep.nvshmem.load({filename!r})")
    dev = cupy.cuda.Device()
    key = (filename, dev.id)
    with _lock:
        if key in _modules:
            return _modules[key][0]
        from nvshmem import bindings

        path = build(filename, f"sm_{dev.compute_capability}")
        mod = cupy.RawModule(path=str(path))
        if first_kernel is not None:
            mod.get_function(first_kernel)
        handle = int(mod.module.ptr)  # .module loads the cubin on the current device
        status = bindings.cumodule_init(handle)
        if status:
            raise RuntimeError(f"nvshmemx_cumodule_init failed on {filename} (status {status})")
        _modules[key] = (mod, handle)
        return mod


def alloc(nbytes: int):
    """A ``cupy`` uint8 array ``[nbytes]`` on the symmetric heap. Collective: every PE allocates the same sizes in
    the same order. Free with :func:`free`."""
    _require_init("cuep.nvshmem.alloc")
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__") or int(nbytes) < 1:
        raise ValueError(f"nbytes={nbytes!r} must be a positive int")
    import nvshmem.core.interop.cupy as nvc

    return nvc.array((int(nbytes),), dtype="uint8")


def free(arr) -> None:
    """Give back an array of :func:`alloc` (collective, like the allocation)."""
    _require_init("cuep.nvshmem.free")
    import nvshmem.core.interop.cupy as nvc

    nvc.free_array(arr)


def peer_address(arr, pe: int) -> int:
    """Address of PE ``pe``'s copy of symmetric ``arr`` (same offset into the heap) as this GPU can load/store it
    (``nvshmem_ptr``); 0 when ``pe`` is reachable only through NVSHMEM's transfers (another node)."""
    _require_init("cuep.nvshmem.peer_address")
    from nvshmem import bindings

    n = int(_state["info"]["pes"])
    if isinstance(pe, bool) or not hasattr(pe, "__index__") or not 0 <= int(pe) < n:
        raise ValueError(f"pe={pe!r} must be an int in 0..{n - 1} (PEs: {n})")
    return int(bindings.ptr(int(arr.data.ptr), int(pe)) or 0)


# ---- the symmetric heap size ----------------------------------------------------------------------------------------
def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)[bB]?\s*", text)
    if m is None:
        raise ValueError(f"NVSHMEM_SYMMETRIC_SIZE={text!r} is not a size (bytes, or a number with K, M, G or T)")
    return int(m.group(1)) * _SIZE_SUFFIX[m.group(2).lower()]


def heap_size() -> int:
    """Bytes of symmetric heap per PE: ``NVSHMEM_SYMMETRIC_SIZE`` as NVSHMEM reads it at :func:`init` (the value
    then in force once started), default :data:`DEFAULT_HEAP_BYTES`."""
    if _state["info"] is not None:
        return int(_state["info"]["heap_bytes"])
    env = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    return _parse_size(env) if env else DEFAULT_HEAP_BYTES


def heap_bytes_needed_env(nbytes: int) -> int:
    """Size NVSHMEM's symmetric heap for ``nbytes`` of cuep allocations; the heap size that will be used.

    A Buffer with ``n_nodes > 1`` calls this before :func:`init`: when the user has not set
    ``NVSHMEM_SYMMETRIC_SIZE`` and NVSHMEM has not started, it sets it to ``nbytes`` + :data:`HEAP_RESERVE_BYTES`
    rounded up to 2 MiB. Otherwise it changes nothing and returns the size in force (the caller compares).
    """
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__") or int(nbytes) < 0:
        raise ValueError(f"nbytes={nbytes!r} must be a non-negative int")
    if _state["count"] > 0 or os.environ.get("NVSHMEM_SYMMETRIC_SIZE"):
        return heap_size()
    need = -(-(int(nbytes) + HEAP_RESERVE_BYTES) // _HEAP_GRANULE) * _HEAP_GRANULE
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(need)
    return need
