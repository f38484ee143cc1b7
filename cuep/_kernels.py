"""Compile and cache the CUDA C++ in ``cuep/cuda_src`` with ``cupy.RawModule``.

One module per ``.cu`` file, compiled once per (file, device) and kept for the life of the process.
CuPy's disk cache keys on the source string and options only, not on headers reached through ``-I``; the
options therefore carry a hash of the whole ``cuda_src`` tree (``-DCUEP_SRC_HASH=...``), so editing a header
recompiles every module. CuPy adds ``-arch=sm_XX`` of the device, ``--std=c++17`` and ``-ftz=true`` itself;
:func:`nvcc_command` spells out the same compile for a machine without a GPU (the CPU compile test).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("cuep")

SRC_DIR = Path(__file__).resolve().parent / "cuda_src"

#: Flags CuPy's RawModule adds to every compile itself (we must not pass -arch: NVRTC rejects a second one).
CUPY_IMPLICIT_OPTIONS = ("--std=c++17", "-ftz=true")


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """SHA-256 (first 16 hex digits) of every file under ``cuda_src``, names included."""
    h = hashlib.sha256()
    for p in sorted(SRC_DIR.rglob("*")):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h"):
            h.update(p.relative_to(SRC_DIR).as_posix().encode())
            h.update(b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def compile_options(defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The options cuep passes to ``cupy.RawModule`` (CuPy adds :data:`CUPY_IMPLICIT_OPTIONS` and -arch).

    ``defines`` (``("NAME=VALUE", ...)``, each becoming ``-DNAME=VALUE``) builds a variant of a kernel's tuning
    constants for a benchmark harness; the product always compiles with none. Nothing in the environment changes
    what is compiled.
    """
    return ("--std=c++17", f"-I{SRC_DIR}", f"-DCUEP_SRC_HASH=0x{source_hash()}ULL", *(f"-D{d}" for d in defines))


def kernel_files() -> list[str]:
    """Every compilable kernel file (``*.cu``) in ``cuda_src``."""
    return sorted(p.name for p in SRC_DIR.glob("*.cu"))


def nvcc_command(filename: str, arch: str = "sm_90", out: str = "/dev/null") -> list[str]:
    """The nvcc command that compiles ``filename`` like the runtime does, warnings as errors, and register spills
    reported as warnings (``-warn-spills``), hence errors: no kernel may spill under the runtime's options."""
    opts = list(compile_options())
    for o in CUPY_IMPLICIT_OPTIONS:
        if o not in opts:
            opts.append(o)
    return ["nvcc", "-cubin", f"-arch={arch}", *opts, "-Xptxas", "-warn-spills", "-Werror", "all-warnings",
            "-o", out, str(SRC_DIR / filename)]


def nvrtc_include_options() -> tuple[str, ...]:
    """The include directories CuPy's RawModule hands NVRTC (its bundled CCCL and headers, and CUDA's)."""
    import cupy

    base = Path(cupy.__file__).resolve().parent / "_core" / "include"
    cuda = Path(os.environ.get("CUDA_PATH", "/usr/local/cuda")) / "include"
    return (*(f"-I{base / 'cupy' / '_cccl' / d}" for d in ("cub", "thrust", "libcudacxx")), f"-I{base}", f"-I{cuda}")


def nvrtc_compile(filename: str, arch: str = "sm_90") -> tuple[bytes, str]:
    """Compile ``cuda_src/<filename>`` with NVRTC, CuPy's runtime compiler, without a GPU: (cubin, log).

    Same source and options as :func:`module` (plus the flags CuPy adds itself). Raises RuntimeError with the
    compiler log on failure.
    """
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram((SRC_DIR / filename).read_text(), filename, [], [])
    opts = (*nvrtc_include_options(), *compile_options(), *CUPY_IMPLICIT_OPTIONS[1:], f"-arch={arch}")
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception as e:
        raise RuntimeError(f"NVRTC failed on {filename}:\n{nvrtc.getProgramLog(prog)}") from e
    return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)


_lock = threading.Lock()
_modules: dict[tuple, object] = {}
_functions: dict[tuple, object] = {}


def module(filename: str, name_expressions: tuple[str, ...] = (), defines: tuple[str, ...] = ()):
    """The ``cupy.RawModule`` of ``cuda_src/<filename>`` for the current device, compiled on first use.

    ``name_expressions`` lists template instantiations to compile (``"kernel<int, 4>"``); pass the same tuple on
    every call for one file (the first call's list is the one compiled). ``defines``: a benchmark variant's tuning
    constants (:func:`compile_options`), cached apart from the product's build.
    """
    import cupy

    dev = cupy.cuda.Device().id
    key = (filename, dev, tuple(defines))
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            path = SRC_DIR / filename
            if not path.is_file():
                raise FileNotFoundError(f"no kernel file {filename!r} in {SRC_DIR}")
            code = path.read_text()
            t0 = time.perf_counter()
            log.info("cuep: compiling %s for device %d ...", filename, dev)
            mod = cupy.RawModule(code=code, options=compile_options(tuple(defines)),
                                 name_expressions=list(name_expressions) or None)
            mod.compile()
            log.info("cuep: %s ready on device %d in %.1f s (cached on disk for next time)",
                     filename, dev, time.perf_counter() - t0)
            _modules[key] = mod
    return mod


def function(filename: str, name: str, name_expressions: tuple[str, ...] = (), defines: tuple[str, ...] = ()):
    """A kernel of :func:`module` by name (cached: ``get_function`` builds a new object each call)."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (filename, dev, name, tuple(defines))
    fn = _functions.get(key)
    if fn is None:
        fn = module(filename, name_expressions, defines).get_function(name)
        _functions[key] = fn
    return fn


_SMEM_WITHOUT_OPT_IN = 48 << 10  # shared memory (static + dynamic) a block gets without opting in
_smem_allowed: dict[int, int] = {}


def allow_dynamic_smem(fn, smem: int) -> None:
    """Let kernel ``fn`` (a ``cupy.RawKernel`` from :func:`function`) launch with ``smem`` bytes of dynamic shared
    memory: opts in (``max_dynamic_shared_size_bytes``) once ``smem`` plus the kernel's static shared memory passes
    the 48 KiB a block gets by default; remembered per kernel object, so the driver is asked once per size."""
    key = id(fn)  # function() caches its kernels for the process, so the id stays theirs
    allowed = _smem_allowed.get(key)
    if allowed is None:
        allowed = _SMEM_WITHOUT_OPT_IN - fn.shared_size_bytes
    if smem > allowed:
        fn.max_dynamic_shared_size_bytes = smem
        allowed = smem
    _smem_allowed[key] = allowed


def enable_compile_log() -> None:
    """Print cuep's one-line compile messages to stderr (the default; ``CUEP_LOG=0`` turns them off)."""
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)


if os.environ.get("CUEP_LOG", "1") != "0":  # CUEP_LOG=0 silences the first-compile lines
    enable_compile_log()
